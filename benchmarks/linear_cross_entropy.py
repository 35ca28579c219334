"""Peak memory and time of the LM head + loss: the whole logits (F.linear, then F.cross_entropy) against
picotron.kernels.linear_cross_entropy (the logits made and used a chunk of tokens at a time).

    python benchmarks/linear_cross_entropy.py          # CPU or GPU: the table for docs/benchmarks.md

Peak memory: picotron.memory_tracking.MemoryTracker around one forward and backward (every storage the ops
create, to the byte), under FakeTensorMode, so that Llama 3 8B's head (8192 tokens, V = 128,256) is measured
without allocating it. Time: real tensors of a smaller head, best of 3 (CUDA-synchronised on a GPU).
"""

import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from picotron.kernels.linear_cross_entropy import linear_cross_entropy
from picotron.memory_tracking import MemoryTracker

SHAPES = [("Llama 3 8B head", 8192, 4096, 128256, 1024), ("SmolLM head", 2048, 576, 49152, 256)]


def whole_logits(x, w, targets, chunk_size):
    return F.cross_entropy(F.linear(x, w).float(), targets)


def chunked(x, w, targets, chunk_size):
    return linear_cross_entropy(x, w, targets, chunk_size=chunk_size)


def inputs(tokens, hidden, vocab, device):
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) / hidden ** 0.5).requires_grad_()
    return x, w, torch.randint(0, vocab, (tokens,), device=device)


def peak_bytes(loss_of, tokens, hidden, vocab, chunk) -> int:
    with FakeTensorMode():
        x, w, targets = inputs(tokens, hidden, vocab, "cpu")
        with MemoryTracker() as tracker:
            loss_of(x, w, targets, chunk).backward()
    return tracker.peak_bytes


def seconds(loss_of, tokens, hidden, vocab, chunk, device) -> float:
    x, w, targets = inputs(tokens, hidden, vocab, device)
    times = []
    for _ in range(3):
        x.grad = w.grad = None
        start = time.perf_counter()
        loss_of(x, w, targets, chunk).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("| shape | whole logits: peak | chunked: peak | chunk |\n| --- | --- | --- | --- |")
    for name, tokens, hidden, vocab, chunk in SHAPES:
        peaks = [peak_bytes(f, tokens, hidden, vocab, chunk) / 2 ** 30 for f in (whole_logits, chunked)]
        print(f"| {name}: {tokens} tokens, h {hidden}, V {vocab:,} | {peaks[0]:.2f} GiB | {peaks[1]:.2f} GiB | "
              f"{chunk} tokens |")
    name, tokens, hidden, vocab, chunk = SHAPES[1] if device == "cpu" else SHAPES[0]
    times = [seconds(f, tokens, hidden, vocab, chunk, device) for f in (whole_logits, chunked)]
    print(f"\ntime on {device}, {name}, fp32: whole logits {times[0]:.3f} s, chunked {times[1]:.3f} s "
          f"({times[1] / times[0]:.2f}x)")


if __name__ == "__main__":
    main()

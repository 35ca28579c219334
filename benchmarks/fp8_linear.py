"""Forward + backward time of picotron's Float8Linear against a bf16 nn.Linear, on one GPU.

    python benchmarks/fp8_linear.py                           # d = 4096 and 8192, 8192 tokens, eager and compiled
    python benchmarks/fp8_linear.py --dims 4096 8192 --tokens 8192 --recipes tensorwise rowwise --json out.json

What one measurement is: a square Linear (d inputs, d outputs, no bias) with bf16 weights on
`tokens` x d bf16 inputs; y = layer(x), then y.backward(dy): three matmuls of 2 tokens d^2 FLOPs.
The bf16 baseline is torch's nn.Linear; the fp8 layer is picotron.fp8.Float8Linear sharing its
weight, whose matmuls call torch._scaled_mm (tensorwise: one float32 scale per operand; rowwise:
(M, 1) and (1, N) scales, e4m3 gradients). Each runs in eager mode and under torch.compile, which
can fuse the amax, scale and cast of each operand into the ops around them; in eager mode every
cast is a few separate kernels that read and write the whole tensor.

Timing: CUDA events around --iters iterations after --warmup ones; the table shows the median of
--reps repetitions, the bf16 / fp8 ratio (the speed-up) and the achieved TFLOP/s (6 tokens d^2 per
iteration). It also prints, once per shape and recipe, the relative error of the fp8 output and
gradients against bf16, as a sanity check (expect 0.03-0.06).

Needs an NVIDIA GPU with fp8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, B200);
elsewhere it exits with a message. Chapter 10 models the speed-up it should show; the figures
measured with it go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch import nn

from picotron.fp8 import Float8Linear, has_fp8_matmul


def need_fp8_gpu() -> torch.device:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_linear.py needs an NVIDIA GPU with fp8 tensor cores (compute capability 8.9+); "
                 "this machine has no CUDA device. On a CPU, chapter 10 shows the fp8 numerics (emulated), not speed.")
    device = torch.device("cuda", torch.cuda.current_device())
    if not has_fp8_matmul(device):
        major, minor = torch.cuda.get_device_capability(device)
        sys.exit(f"benchmarks/fp8_linear.py needs fp8 tensor cores (compute capability 8.9+); "
                 f"{torch.cuda.get_device_name(device)} has {major}.{minor}.")
    return device


def fwd_bwd(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    layer(x).backward(grad)


def time_ms(step, warmup: int, iters: int, reps: int) -> list[float]:
    """Milliseconds per call of step(), one figure per repetition of `iters` calls."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return times


def relative_errors(fp8: nn.Module, bf16: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Relative error of y, dx and dW of the fp8 layer against the bf16 one (same weight)."""
    out = {}
    for name, layer in (("fp8", fp8), ("bf16", bf16)):
        layer.weight.grad = None
        x_in = x.detach().clone().requires_grad_()
        y = layer(x_in)
        y.backward(grad)
        out[name] = (y.float(), x_in.grad.float(), layer.weight.grad.float())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    return {what: rel(a, b) for what, a, b in zip(("y", "dx", "dW"), out["fp8"], out["bf16"])}


def bench(d: int, tokens: int, recipe: str, compiled: bool, device, args) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(d, d, bias=False, device=device, dtype=torch.bfloat16)
    fp8 = Float8Linear.from_linear(linear, recipe)                 # shares linear.weight
    x = torch.randn(tokens, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, d, device=device, dtype=torch.bfloat16)
    errors = relative_errors(fp8, linear, x, grad) if not compiled else None
    layers = {"bf16": linear, "fp8": fp8}
    if compiled:
        layers = {name: torch.compile(layer) for name, layer in layers.items()}
    ms = {name: statistics.median(time_ms(lambda layer=layer: fwd_bwd(layer, x, grad), args.warmup, args.iters,
                                          args.reps))
          for name, layer in layers.items()}
    flops = 3 * 2 * tokens * d * d
    return {"d": d, "tokens": tokens, "recipe": recipe, "mode": "compiled" if compiled else "eager",
            "bf16_ms": ms["bf16"], "fp8_ms": ms["fp8"], "speedup": ms["bf16"] / ms["fp8"],
            "bf16_tflops": flops / ms["bf16"] / 1e9, "fp8_tflops": flops / ms["fp8"] / 1e9, "errors": errors}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    device = need_fp8_gpu()
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; Linear(d, d) forward + backward on "
          f"{args.tokens} tokens, bf16 weights and inputs; median of {args.reps} x {args.iters} iterations")
    print(f"{'d':>6} {'recipe':<11}{'mode':<9}{'bf16 ms':>9}{'fp8 ms':>9}{'speed-up':>10}{'bf16 TFLOP/s':>14}"
          f"{'fp8 TFLOP/s':>13}")
    rows = []
    for d in args.dims:
        for recipe in args.recipes:
            for mode in args.modes:
                row = bench(d, args.tokens, recipe, mode == "compiled", device, args)
                rows.append(row)
                print(f"{d:>6} {recipe:<11}{mode:<9}{row['bf16_ms']:>9.3f}{row['fp8_ms']:>9.3f}"
                      f"{row['speedup']:>9.2f}x{row['bf16_tflops']:>14.0f}{row['fp8_tflops']:>13.0f}", flush=True)
                if row["errors"]:
                    print(f"{'':>7}fp8 vs bf16 relative error: " +
                          ", ".join(f"{k} {v:.3f}" for k, v in row["errors"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

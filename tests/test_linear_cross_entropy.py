"""The chunked LM head + loss (picotron/kernels/linear_cross_entropy.py): equal to F.cross_entropy(F.linear(x, W))
in value and gradients, and it never holds more than a chunk of logits."""

import pytest
import torch
import torch.nn.functional as F

from picotron.kernels.linear_cross_entropy import linear_cross_entropy
from picotron.memory_tracking import MemoryTracker
from picotron.tolerance import compare


def inputs(tokens=(3, 37), hidden=24, vocab=101, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*tokens, hidden, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden ** 0.5).requires_grad_()
    targets = torch.randint(0, vocab, tokens, generator=g)
    return x, w, targets


def loss_and_grads(fn, x, w, targets):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, targets)
    loss.backward()
    return loss, x.grad, w.grad


def unfused(x, w, targets, ignore_index=-100):
    return F.cross_entropy(F.linear(x, w).float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index)


def roundings(x, w, targets):
    """x W^T over h, the log-sum-exp over V, then dW over the tokens (tolerance policy: a chain adds up)."""
    return 2 * x.shape[-1] + w.shape[0] + targets.numel()


@pytest.mark.parametrize("chunk_size", [1, 16, 50, 10_000])      # one token, chunks that do not divide, one chunk
def test_equal_to_cross_entropy_of_linear_in_value_and_gradients(chunk_size):
    x, w, targets = inputs()
    targets[0, :5] = -100                                        # ignored tokens: not counted in the mean
    expected = loss_and_grads(unfused, x, w, targets)
    actual = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_size=chunk_size), x, w, targets)
    for name, a, e in zip(("loss", "dx", "dW"), actual, expected):
        result = compare(a, e, n=roundings(x, w, targets), dtype=torch.float32)
        assert result, f"{name}: {result}"
    assert actual[1][0, :5].abs().max() == 0                     # an ignored token gets no gradient


def test_another_ignore_index_and_a_wrong_gradient_is_caught():
    x, w, targets = inputs(tokens=(64,), vocab=50)
    targets[::3] = 7
    expected = loss_and_grads(lambda *a: unfused(*a, ignore_index=7), x, w, targets)
    actual = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_size=10, ignore_index=7), x, w, targets)
    n = roundings(x, w, targets)
    assert all(compare(a, e, n=n, dtype=torch.float32) for a, e in zip(actual, expected))
    wrong = loss_and_grads(unfused, x, w, targets)                # counting the ignored tokens after all
    assert not compare(wrong[1], expected[1], n=n, dtype=torch.float32)


def test_under_autocast_matches_the_models_bf16_loss_within_one_bf16_rounding():
    x, w, targets = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = loss_and_grads(unfused, x, w, targets)
        actual = loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk_size=16), x, w, targets)
    assert actual[1].dtype == x.dtype and actual[2].dtype == w.dtype
    for name, a, e in zip(("loss", "dx", "dW"), actual, expected):
        # bf16 matmuls accumulate in fp32 and round once; the two sides round differently: two roundings
        result = compare(a, e, n=2, dtype=torch.bfloat16)
        assert result, f"{name}: {result}"


def test_tied_weight_gets_both_gradients():
    """An LM head tied to the embedding: the loss's dW adds to the embedding's gradient, as with F.linear."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(30, 8)
    ids, targets = torch.randint(0, 30, (2, 9)), torch.randint(0, 30, (2, 9))
    grads = []
    for loss_of in (lambda h: unfused(h, embed.weight, targets),
                    lambda h: linear_cross_entropy(h, embed.weight, targets, chunk_size=4)):
        embed.zero_grad()
        loss_of(torch.tanh(embed(ids))).backward()
        grads.append(embed.weight.grad.clone())
    assert compare(grads[1], grads[0], n=2 * 8 + 30 + 18, dtype=torch.float32)


def test_peak_memory_is_a_chunk_of_logits_not_all_of_them():
    tokens, hidden, vocab, chunk = 512, 16, 2048, 64
    x, w, targets = inputs(tokens=(tokens,), hidden=hidden, vocab=vocab)
    peaks = {}
    for name, fn in [("unfused", unfused), ("chunked", lambda *a: linear_cross_entropy(*a, chunk_size=chunk))]:
        xc, wc = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with MemoryTracker() as tracker:
            fn(xc, wc, targets).backward()
        peaks[name] = tracker.peak_bytes
    logits = tokens * vocab * 4
    assert peaks["unfused"] >= 2 * logits                         # the logits and their softmax (and its gradient)
    assert peaks["chunked"] < logits / 2                          # a few (chunk x V) tensors, dW, dx
    assert peaks["chunked"] <= 4 * chunk * vocab * 4 + 2 * (vocab * hidden * 4) + 4 * tokens * (hidden + 2) * 4


def test_bad_input_is_a_clear_error():
    x, w, targets = inputs()
    with pytest.raises(ValueError, match="without its last"):
        linear_cross_entropy(x, w, targets[:, :-1])
    with pytest.raises(ValueError, match=r"\(vocab, hidden=24\)"):
        linear_cross_entropy(x, w.T, targets)
    with pytest.raises(ValueError, match="at least one token"):
        linear_cross_entropy(x, w, targets, chunk_size=0)
    with pytest.raises(ValueError, match="integer"):
        linear_cross_entropy(x, w, targets.float())

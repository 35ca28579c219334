"""FlashAttention-2 in plain PyTorch (picotron/kernels/flash_attention_torch.py): equal to softmax attention in
value, log-sum-exp and gradients, under the call contract of Stanford CS336's assignment 2 and picotron's own."""

import math

import pytest
import torch
import torch.nn.functional as F

from picotron.kernels.flash_attention_torch import FlashAttention2, flash_attention_torch
from picotron.tolerance import compare


def reference(q, k, v, causal, scale=None):
    """Softmax attention in float64, and each row's log-sum-exp: the numbers both versions approximate."""
    q, k, v = q.double(), k.double(), v.double()
    if q.dim() == 4 and q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.mT * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def inputs(q_shape, kv_shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=g).to(dtype).requires_grad_()
    k = torch.randn(kv_shape, generator=g).to(dtype).requires_grad_()
    v = torch.randn(kv_shape, generator=g).to(dtype).requires_grad_()
    return q, k, v, torch.randn(q_shape[:-1] + (kv_shape[-1],), generator=g).to(dtype)


def grads_of(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(do)
    return out, q.grad, k.grad, v.grad


def roundings(q, k):
    """The longest chain of sums behind one element of the output or a gradient: QK^T over d, the softmax and
    P V over n_k, then dK and dV over n_q queries (tolerance policy: chains add their lengths)."""
    return 2 * q.shape[-1] + 2 * k.shape[-2] + q.shape[-2]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape, blocks", [
    (((2, 40, 16), (2, 40, 16)), (16, 16)),           # CS336's layout (batch, n, d), tiles that do not divide n
    (((1, 3, 33, 8), (1, 3, 33, 8)), (8, 16)),        # (batch, heads, n, d), unequal tiles, n prime to both
    (((2, 4, 24, 8), (2, 2, 24, 8)), (5, 7)),         # grouped-query attention, odd tiles
    (((1, 2, 12, 8), (1, 2, 20, 8)), (4, 8)),         # more keys than queries (top-left causal mask)
    (((1, 2, 20, 8), (1, 2, 12, 8)), (8, 4)),         # more queries than keys
])
def test_equal_to_softmax_attention_in_value_and_gradients(shape, blocks, causal):
    q, k, v, do = inputs(*shape)
    expected_out, expected_lse = reference(q, k, v, causal)
    out, dq, dk, dv = grads_of(lambda *t: flash_attention_torch(*t, causal=causal, block_q=blocks[0],
                                                                 block_k=blocks[1]), q, k, v, do)
    _, rq, rk, rv = grads_of(lambda *t: reference(*t, causal)[0], q, k, v, do.double())
    n = roundings(q, k)
    for name, actual, expected in [("out", out, expected_out), ("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)]:
        result = compare(actual, expected, n=n, dtype=torch.float32)
        assert result, f"{name}: {result}"
    lse = FlashAttention2.apply(q, k, v, causal, None, *blocks).grad_fn.saved_tensors[-1]
    assert compare(lse, expected_lse, n=n, dtype=torch.float32)


def test_sdpa_agrees_and_a_wrong_algorithm_would_not():
    """Against torch's own attention (GQA and causal), and a planted bug (dropping D from dS) is far outside."""
    q, k, v, do = inputs((2, 4, 32, 16), (2, 2, 32, 16))
    out, dq, dk, dv = grads_of(lambda *t: flash_attention_torch(*t, block_q=8, block_k=8), q, k, v, do)
    ref = grads_of(lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v, do)
    for actual, expected in zip((out, dq, dk, dv), ref):
        assert compare(actual, expected, n=2 * roundings(q, k), dtype=torch.float32)
    p = torch.softmax(q.double() @ k.double().repeat_interleave(2, 1).mT / 4
                      + torch.full((32, 32), float("-inf"), dtype=torch.float64).triu(1), dim=-1)
    wrong_dq = (p * (do.double() @ v.double().repeat_interleave(2, 1).mT)) @ k.double().repeat_interleave(2, 1) / 4
    assert not compare(wrong_dq, ref[1], n=2 * roundings(q, k), dtype=torch.float32)


def test_cs336_call_contract():
    """apply(q, k, v, is_causal) on (batch, n, d) inputs saves exactly one (batch, n_q) tensor: the log-sum-exp."""
    for is_causal in (False, True):
        q, k, v, do = inputs((4, 64, 32), (4, 48, 32))
        out = FlashAttention2.apply(q, k, v, is_causal)
        saved = [t for t in out.grad_fn.saved_tensors if t.shape == (q.shape[0], q.shape[1])]
        assert len(saved) == 1
        expected_out, expected_lse = reference(q, k, v, is_causal)
        assert compare(saved[0], expected_lse, n=roundings(q, k), dtype=torch.float32)
        assert compare(out, expected_out, n=roundings(q, k), dtype=torch.float32)
        out.backward(do)
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_nothing_the_size_of_the_scores_is_saved():
    q, k, v, _ = inputs((1, 2, 256, 8), (1, 2, 256, 8))
    out = flash_attention_torch(q, k, v, block_q=32, block_k=32)
    assert max(t.numel() for t in out.grad_fn.saved_tensors) == q.numel()   # q, k, v, O; L is n_q per head


def test_bf16_inputs_give_bf16_results_within_one_bf16_rounding():
    q, k, v, do = inputs((1, 2, 40, 16), (1, 2, 40, 16), dtype=torch.bfloat16)
    out, dq, dk, dv = grads_of(lambda *t: flash_attention_torch(*t, block_q=16, block_k=16), q, k, v, do)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == torch.bfloat16
    expected = grads_of(lambda *t: reference(*t, True)[0], q, k, v, do.double())
    for actual, ref in zip((out, dq, dk, dv), expected):
        assert compare(actual, ref, n=1, dtype=torch.bfloat16)   # fp32 arithmetic, one rounding to bf16 at the end


def test_bad_shapes_are_clear_errors():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(ValueError, match="head_dim 16 but k has 8"):
        flash_attention_torch(q, torch.randn(1, 4, 8, 8), torch.randn(1, 4, 8, 8))
    with pytest.raises(ValueError, match="dividing"):
        flash_attention_torch(q, torch.randn(1, 3, 8, 16), torch.randn(1, 3, 8, 16))
    with pytest.raises(ValueError, match="one shape"):
        flash_attention_torch(q, q, torch.randn(1, 4, 9, 16))
    with pytest.raises(ValueError, match="at least 1"):
        flash_attention_torch(q, q, q, block_q=0)

"""FlashAttention-2 in plain PyTorch: the algorithm of attention.py's Triton kernels, tile by tile in torch.

Chapter: chapters/09_gpu_kernels.ipynb (the bridge from chapter 05's online softmax to the kernels).

    O = softmax(Q K^T * scale + causal mask) V        Q: (..., n_q, d), K and V: (..., n_k, d)

`FlashAttention2` is one torch.autograd.Function whose forward and backward are both written out
block by block, as the kernels run them, so each line of the algorithm (Dao 2023, arXiv:2307.08691,
algorithms 1 and 2) can be read and stepped through on a CPU:

    forward   outer loop over query tiles of block_q rows, inner loop over key tiles of block_k keys.
              A running max m, a running sum l and an *unnormalised* output acc per row; a tile that
              raises the max rescales l and acc by exp(m_old - m_new) (the online softmax). The output
              is divided by l once, after the last tile. Causal: key tiles after the query tile's last
              row are skipped, and only tiles that cross the diagonal are masked. Saved for backward:
              Q, K, V, the output O and one fp32 log-sum-exp per row, L = m + log l, shape (..., n_q).
              No (n_q x n_k) matrix is ever kept.
    backward  D = rowsum(dO * O) once; then outer loop over key tiles, inner loop over the query tiles
              that see them. Each tile recomputes P = exp(S - L) from L (no max, no sum: L is both),
              and accumulates dV_j += P^T dO_i, dK_j += dS^T Q_i * scale with dS = P * (dO_i V_j^T - D_i),
              and dQ_i += dS K_j * scale (the kernels do dQ in its own pass, or with atomic adds).

The causal mask is aligned top-left (query i sees keys 0..i), as F.scaled_dot_product_attention's.
Grouped-query attention: Q (batch, heads, n_q, d) with K, V (batch, kv_heads, n_k, d) and kv_heads dividing
heads; query head i reads key/value head i // (heads / kv_heads), and the dK, dV of a group add up.
The arithmetic runs in fp32 (as the kernels' accumulators); the output and gradients come back in the
inputs' dtype, L in fp32. The call contract, `FlashAttention2.apply(q, k, v, is_causal)` with q of shape
(batch, n_q, d) and exactly one saved tensor of shape (batch, n_q), the log-sum-exp, is the one Stanford
CS336's assignment 2 tests (tests/test_flash_attention_torch.py checks it).
"""

from __future__ import annotations

import math

import torch

__all__ = ["FlashAttention2", "flash_attention_torch", "attention_roundings"]


def attention_roundings(head_dim: int, keys: int, of: str = "output") -> int:
    """How many roundings stand behind one value attention computes: the `n` of picotron.tolerance's bound
    C sqrt(n) u scale, for comparing two attention implementations (docs/design.md, "Equivalence and tolerances"),
    counted along the chain as that policy adds lengths up.

    of="lse"       a score q.k is a sum over head_dim, the log-sum-exp a sum over the keys: head_dim + keys
    of="output"    the softmax's sum and P V are two sums over the keys: head_dim + 2 keys
    of="gradient"  dQ, dK, dV: backward recomputes the output's chain, then dP = dO V^T and rowsum(dO * O) are
                   sums over head_dim (together another output's worth: 2 (head_dim + 2 keys)), and each gradient
                   ends with one more sum over the keys or the queries (dQ = dS K, dK = dS^T Q, dV = P^T dO;
                   `keys` stands for both, as in self-attention): 2 (head_dim + 2 keys) + keys
    """
    if of == "lse":
        return head_dim + keys
    if of == "output":
        return head_dim + 2 * keys
    if of == "gradient":
        return 2 * (head_dim + 2 * keys) + keys
    raise ValueError(f"of={of!r}: choose 'lse', 'output' or 'gradient'")


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """q, k, v as broadcastable views, and the dimension to sum dK, dV over (None without grouping)."""
    if q.dim() < 2 or k.dim() != q.dim() or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q (..., n_q, d) "
                         f"and k, v of one shape (..., n_k, d) with as many dimensions as q")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has head_dim {q.shape[-1]} but k has {k.shape[-1]}: they must be equal")
    if q.shape[:-2] == k.shape[:-2]:
        return q, k, v, None
    heads, kv_heads = q.shape[-3] if q.dim() >= 3 else 0, k.shape[-3] if k.dim() >= 3 else 0
    if q.dim() != 4 or q.shape[0] != k.shape[0] or not kv_heads or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: leading dimensions must be equal, or (batch, "
                         f"heads, n, d) with k's heads dividing q's (grouped-query attention)")
    group = heads // kv_heads   # (b, heads, n, d) -> (b, kv_heads, group, n, d); k, v get a group dim of 1
    return q.unflatten(1, (kv_heads, group)), k.unsqueeze(2), v.unsqueeze(2), 2


def _scores(q_tile: torch.Tensor, k_tile: torch.Tensor, scale: float, causal: bool, i0: int, j0: int) -> torch.Tensor:
    """S = Q_i K_j^T * scale for one pair of tiles (fp32), -inf where a key comes after its query (causal)."""
    s = (q_tile @ k_tile.mT) * scale
    rows, cols = s.shape[-2], s.shape[-1]
    if causal and j0 + cols - 1 > i0:          # the tile crosses the diagonal: mask it (the others need no mask)
        future = (torch.arange(j0, j0 + cols, device=s.device)[None, :]
                  > torch.arange(i0, i0 + rows, device=s.device)[:, None])
        s = s.masked_fill(future, float("-inf"))
    return s


def _key_end(causal: bool, i1: int, n_k: int) -> int:
    """Keys past this one are in the future of every query of a tile ending at row i1 (causal)."""
    return min(n_k, i1) if causal else n_k


def _forward(q, k, v, causal: bool, scale: float, block_q: int, block_k: int):
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i0 in range(0, n_q, block_q):
        i1 = min(i0 + block_q, n_q)
        q_tile = q[..., i0:i1, :].float()
        m = torch.full(q_tile.shape[:-1], float("-inf"), device=q.device)           # running max per row
        l = torch.zeros_like(m)                                                     # running sum of exp(s - m)
        acc = torch.zeros(q_tile.shape[:-1] + (v.shape[-1],), device=q.device)      # sum of exp(s - m) v, not / l
        for j0 in range(0, _key_end(causal, i1, n_k), block_k):
            j1 = min(j0 + block_k, n_k)
            s = _scores(q_tile, k[..., j0:j1, :].float(), scale, causal, i0, j0)
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = torch.exp(m - m_new)                     # the old max was too small by this much: rescale
            p = torch.exp(s - m_new[..., None])
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v[..., j0:j1, :].float()
            m = m_new
        out[..., i0:i1, :] = acc / l[..., None]               # normalised once, after the last key tile
        lse[..., i0:i1] = m + torch.log(l)
    return out, lse


def _backward(do, q, k, v, out, lse, causal: bool, scale: float, block_q: int, block_k: int, group_dim):
    n_q, n_k = q.shape[-2], k.shape[-2]
    delta = (do.float() * out.float()).sum(dim=-1)                                  # D = rowsum(dO * O)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)

    def summed(x):   # the query heads of a group read one key/value head: their contributions add up
        return x if group_dim is None else x.sum(dim=group_dim, keepdim=True)

    for j0 in range(0, n_k, block_k):
        j1 = min(j0 + block_k, n_k)
        k_tile, v_tile = k[..., j0:j1, :].float(), v[..., j0:j1, :].float()
        first = (j0 // block_q) * block_q if causal else 0     # query tiles before it never see these keys
        for i0 in range(first, n_q, block_q):
            i1 = min(i0 + block_q, n_q)
            q_tile, do_tile = q[..., i0:i1, :].float(), do[..., i0:i1, :].float()
            p = torch.exp(_scores(q_tile, k_tile, scale, causal, i0, j0) - lse[..., i0:i1, None])   # P from L
            dk_v = summed(p.mT @ do_tile)
            dv[..., j0:j1, :] += dk_v
            ds = p * (do_tile @ v_tile.mT - delta[..., i0:i1, None])                  # dS = P * (dP - D)
            dq[..., i0:i1, :] += (ds @ k_tile) * scale
            dk[..., j0:j1, :] += summed(ds.mT @ q_tile) * scale
    return dq, dk, dv


class FlashAttention2(torch.autograd.Function):
    """FlashAttention-2, forward and backward written tile by tile in torch (the module's docstring).

    apply(q, k, v, is_causal=False, scale=None, block_q=64, block_k=64): scale defaults to 1/sqrt(d)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool = False, scale: float | None = None, block_q: int = 64,
                block_k: int = 64):
        if block_q < 1 or block_k < 1:
            raise ValueError(f"block_q={block_q}, block_k={block_k}: tile sizes must be at least 1")
        qg, kg, vg, group_dim = _grouped(q, k, v)
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        out, lse = _forward(qg, kg, vg, bool(is_causal), scale, block_q, block_k)
        out = out.to(q.dtype).reshape(q.shape[:-1] + (v.shape[-1],))
        lse = lse.reshape(q.shape[:-1])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (bool(is_causal), scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        qg, kg, vg, group_dim = _grouped(q, k, v)
        shape = qg.shape[:-1]
        dq, dk, dv = _backward(do.reshape(shape + (v.shape[-1],)), qg, kg, vg, out.reshape(shape + (v.shape[-1],)),
                               lse.reshape(shape), *ctx.options, group_dim)
        return dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype), \
            None, None, None, None


def flash_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                          scale: float | None = None, block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, like F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=scale, enable_gqa=True), computed tile by tile (FlashAttention2). Differentiable in q, k, v."""
    return FlashAttention2.apply(q, k, v, causal, scale, block_q, block_k)

"""FlashAttention in Triton: causal attention that never writes the (seq x seq) scores to memory.

Chapter: chapters/09_gpu_kernels.ipynb, section 8.

    O = softmax(Q K^T * scale + causal mask) V          Q, K, V, O: (batch, heads, seq, head_dim)

Eager attention writes S = Q K^T and P = softmax(S) to HBM (seq^2 values per head, each read back
at least once): at seq 4096 that is 64 MiB per head in fp32, and the kernels doing it are
memory-bound. FlashAttention (Dao et al. 2022, arXiv:2205.14135; FlashAttention-2, Dao 2023,
arXiv:2307.08691) *tiles* the work: a program owns BLOCK_M query rows, keeps them and their
running output in registers, and streams K and V past them BLOCK_N keys at a time. The softmax
is done online (picotron/parallel/online_softmax.py, chapter 05): a running max m and sum l per
row, and when a block raises the max the output so far is rescaled by exp(m_old - m_new). HBM
traffic falls from O(seq^2) to O(seq * head_dim) per head, and the matmuls run on tensor cores.

Versions (kernels `attention_forward_kernel_vN`, `attention_backward_dkdv_kernel_vN` and
`attention_backward_dq_kernel_vN`, launched from here by `attention_forward_vN`, `attention_backward_vN`; the
kernels of the versions that use tensor descriptors, forward v2 to v4 and backward v2 and v3, are in attention_tma.py;
`flash_attention` is the autograd function of one version, forward and backward):

    forward v1   grid (query blocks, batch * heads); keys above the diagonal are skipped (causal: half
                 the work), only the diagonal blocks are masked. Writes O and the log-sum-exp
                 L = m + log l of every row (fp32), for backward.
    forward v2   v1 with every tile moved through a tensor descriptor (tl.make_tensor_descriptor): on Hopper a
                 load is one TMA instruction that copies the tile to shared memory asynchronously, so the
                 pipeliner keeps num_stages K/V tiles in flight and no thread computes addresses or masks.
                 Compiled for sm_90 (python -m picotron.kernels.report): 142 registers instead of 242, no
                 loads into registers, 13 TMA loads, 129 KiB of shared memory for 3 stages. Rows must be
                 16-byte aligned (TMA's rule).
    forward v3   v2's kernel under @triton.autotune: BLOCK_M, BLOCK_N, num_warps and num_stages timed per
                 (seq_q, seq_k, head_dim, causal) among six configs. (`warp_specialize=True` on its loop
                 compiles for sm_90 with triton 3.9 but gives the same cubin: not used.)
    backward v1  FlashAttention-2's, two kernels, so that no two programs add into the same rows (no
                 atomics): dkdv, one block of keys per program, loops over the query blocks that see
                 it, recomputes P = exp(S - L) and accumulates dV = P^T dO, dK = dS^T Q * scale;
                 dq, one block of queries per program, loops over its keys, dQ = dS K * scale.
                 With dS = P * (dP - D), dP = dO V^T and D = rowsum(dO * O) (computed in torch, one pass).
    backward v2  v1 with the tiles through descriptors (TMA on Hopper); the causal mask only on the diagonal
                 blocks (padded rows need none: they load as zeros and add nothing); and one dkdv program per
                 key/value head that loops over its group of query heads, so dK, dV are written once in k's
                 dtype instead of per query head in fp32 and added up by torch.
    backward v3  v2 with dkdv's products turned around: S^T = K Q^T, so P^T and dS^T come out of the dots as
                 dV += P^T dO and dK += dS^T Q take them, where v2 transposed P and dS in registers every step;
                 and each kernel its own tiles, warps and stages, found by timing (autotuning) among configs
                 that compile for sm_90 without spilling. Compiled for sm_90 (triton 3.9.0), v1's and v2's dkdv
                 spill 104 and 256 bytes of registers per thread to local memory at their 64 x 64 tiles; v3's
                 configs none.
    forward v4   v3 with fewer instructions per score: only the tiles that need a mask (the diagonal, the last
                 key tile when seq_k is not a whole number of tiles) get one, and the scale moves into the
                 exponent's fused multiply-add, exp2(s * scale - m), the max scaled once per row (which needs
                 scale >= 0: a negative one is refused, version 3 takes it). On an H100 a
                 score's dots (4 x head_dim FLOPs at 989 TFLOP/s) take as long as about 17 FP32 operations at
                 head_dim 128 (67 TFLOP/s), and an exp2 costs about 8 of them: v2's scale, select and subtract
                 are each ~6% of the dots' time. Compiled for sm_90, the causal kernel's FP32 instructions fall
                 from 876 to 784 (python -m picotron.kernels.report), its exp2s stay 72.

`flash_attention(..., version=N)` runs version N both ways (forward v3 and v4 are v2's kernel autotuned; version 4's
backward is v3's). Versions 2 to 4 take any BLOCK_M and BLOCK_N (the causal split crosses one tile or several); v1
takes BLOCK_M a multiple of BLOCK_N.

Scores are scaled by scale * log2(e) so that exp becomes exp2, the GPU's native instruction.
Grouped-query attention (fewer key/value heads, as picotron's Llama) reads key/value head
h // (heads / kv_heads); backward adds the dK, dV of the query heads that share a key/value head.
In the interpreter bf16 `tl.dot` returns wrong values (docs/design.md, "CPU first, GPU real"), so
there the dots run in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from picotron.kernels.attention_tma import (attention_backward_dkdv_kernel_v2, attention_backward_dkdv_kernel_v3,
                                            attention_backward_dq_kernel_v2, attention_backward_dq_kernel_v3,
                                            attention_forward_kernel_v2, attention_forward_kernel_v3,
                                            attention_forward_kernel_v4)
from picotron.kernels.runtime import INTERPRETED, check_device, use_device_descriptors

__all__ = ["attention_forward_kernel_v1", "attention_backward_dkdv_kernel_v1", "attention_backward_dq_kernel_v1",
           "attention_forward_v1", "attention_forward_v2", "attention_forward_v3", "attention_forward_v4",
           "attention_backward_v1",
           "attention_backward_v2", "attention_backward_v3", "VERSIONS", "FlashAttentionFunction", "flash_attention"]

LOG2E = 1.4426950408889634   # log2(e): exp(x) = exp2(x * log2(e))


# ---- forward v1 -------------------------------------------------------------------------------
@triton.jit
def _attend_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d, d_inside, seq_k,
                   lo, hi, qk_scale, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr, DOT_FP32: tl.constexpr,
                   PRECISION: tl.constexpr):
    """Fold keys [lo, hi) into the running (acc, l, m) of BLOCK_M query rows, BLOCK_N keys at a time."""
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_inside = offs_n < seq_k
        kv_mask = n_inside[:, None] & d_inside[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale      # (BLOCK_M, BLOCK_N), log2 units
        visible = n_inside[None, :]
        if CAUSAL_MASK:                                                       # only blocks on the diagonal
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)                   # how much the old max overestimated: rescale by it
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel_v1(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                                n_heads, group, seq_q, seq_k, head_dim, qk_scale,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group                                      # GQA: `group` query heads share it
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < head_dim
    q_mask = (offs_m[:, None] < seq_q) & d_inside[None, :]
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max of each row (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)        # running, unnormalised output
    if CAUSAL:
        # Keys before start_m are visible to every row of the block: no mask. Keys from start_m to the
        # end of the block straddle the diagonal: masked. Keys after the block are never visible.
        acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                       d_inside, seq_k, 0, tl.minimum(start_m, seq_k), qk_scale, BLOCK_N, False,
                                       DOT_FP32, PRECISION)
        acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                       d_inside, seq_k, start_m, tl.minimum(start_m + BLOCK_M, seq_k), qk_scale,
                                       BLOCK_N, True, DOT_FP32, PRECISION)
    else:
        acc, l_i, m_i = _attend_blocks(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_vn, offs_m, offs_d,
                                       d_inside, seq_k, 0, seq_k, qk_scale, BLOCK_N, False, DOT_FP32, PRECISION)

    out = acc / l_i[:, None]
    tl.store(o_ptr + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_mask)
    # log-sum-exp of the row's scaled scores, natural log: L = (m + log2 l) * ln 2
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634
    tl.store(lse_ptr + (batch * n_heads + head) * seq_q + offs_m, lse, mask=offs_m < seq_q)


# ---- backward v1 ------------------------------------------------------------------------------
@triton.jit
def attention_backward_dkdv_kernel_v1(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                      stride_vb, stride_vh, stride_vn, stride_gb, stride_gh, stride_gm,
                                      n_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                      CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # q, dO share strides (stride_q*); dk, dv are (batch, heads, seq_k, head_dim) per *query* head,
    # contiguous (stride_g*): the caller adds the query heads of a group.
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < head_dim
    kv_mask = (offs_n[:, None] < seq_k) & d_inside[None, :]
    k = tl.load(k_ptr + batch * stride_kb + kv_head * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + batch * stride_vb + kv_head * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                mask=kv_mask, other=0.0)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    q_base = q_ptr + batch * stride_qb + head * stride_qh
    do_base = do_ptr + batch * stride_qb + head * stride_qh
    row_base = (batch * n_heads + head) * seq_q
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: only queries at or after start_n see these keys; start at the query block holding start_n.
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, seq_q, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_inside = offs_m < seq_q
        q_mask = m_inside[:, None] & d_inside[None, :]
        q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_ptr + row_base + offs_m, mask=m_inside, other=0.0) * 1.4426950408889634   # log2 units
        delta = tl.load(delta_ptr + row_base + offs_m, mask=m_inside, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale       # (BLOCK_M, BLOCK_N)
        visible = m_inside[:, None] & (offs_n[None, :] < seq_k)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)                   # the forward's probabilities
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])                                          # softmax backward
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    dk = dk * scale
    g_offsets = batch * stride_gb + head * stride_gh + offs_n[:, None] * stride_gm + offs_d[None, :]
    tl.store(dk_ptr + g_offsets, dk.to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + g_offsets, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def attention_backward_dq_kernel_v1(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                    stride_vb, stride_vh, stride_vn,
                                    n_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                    CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    # q, dO and dq share strides (stride_q*).
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_inside = offs_d < head_dim
    m_inside = offs_m < seq_q
    q_mask = m_inside[:, None] & d_inside[None, :]
    q_offsets = batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_offsets, mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_base = (batch * n_heads + head) * seq_q
    lse = tl.load(lse_ptr + row_base + offs_m, mask=m_inside, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=m_inside, other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, seq_k) if CAUSAL else seq_k
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < seq_k) & d_inside[None, :]
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = m_inside[:, None] & (offs_n[None, :] < seq_k)
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + q_offsets, (dq * scale).to(dq_ptr.dtype.element_ty), mask=q_mask)


# ---- launchers --------------------------------------------------------------------------------
def _blocks(head_dim: int, backward: bool = False, element_size: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M is a multiple of BLOCK_N (the causal split needs it).

    On a GPU, 128 x 64 tiles with 8 warps for the forward (FlashAttention-2's shape for head_dim up to
    128), 64 x 64 for backward, which holds more tiles at once. In the interpreter, 64 x 64: it
    executes each program's block operations as a few numpy calls, and each program costs ~50 ms of
    Python, so fewer, larger tiles run faster there."""
    if INTERPRETED:
        return 64, 64, 4, 1
    if backward:
        return 64, 64, 4 if head_dim <= 64 else 8, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    # Each pipeline stage holds a K and a V tile in shared memory (228 KB per SM): fp32 tiles, or wider
    # heads, leave room for two stages only (fp32 at head_dim 128 with 3 stages needs 225 KB).
    return 128, 64, 8, 2 if head_dim > 128 or element_size > 2 else 3


def _checked_blocks(blocks: tuple[int, int], any_ratio: bool = False) -> tuple[int, int]:
    """blocks, checked: powers of two >= 16, and (v1) BLOCK_M a multiple of BLOCK_N."""
    block_m, block_n = blocks
    powers = all(b >= 16 and b & (b - 1) == 0 for b in (block_m, block_n))
    if not powers or (block_m % block_n and not any_ratio):
        raise ValueError(f"blocks={blocks}: BLOCK_M and BLOCK_N must be powers of two >= 16 (tl.dot's smallest "
                         "tile) and, in version 1, BLOCK_M a multiple of BLOCK_N (the causal loop splits at "
                         "block edges)")
    return block_m, block_n


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention takes (batch, heads, seq, head_dim) tensors, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must have one shape, and batch and head_dim as q: q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not split into groups over {k.shape[1]} key/value heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_device(q, k, v)
    return q.shape[1] // k.shape[1]


def _last_dim_contiguous(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products ("ieee") to match torch; on a GPU tl.dot would otherwise use TF32.
    return "ieee" if dtype == torch.float32 else "tf32"


def attention_forward_v1(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         scale: float | None = None,
                         blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """O (batch, heads, seq_q, head_dim) and the log-sum-exp (batch, heads, seq_q) fp32 of each row (v1).

    blocks: (BLOCK_M, BLOCK_N) to use instead of the defaults, powers of two >= 16, BLOCK_M a multiple
    of BLOCK_N (to see the tiling at work on short sequences)."""
    group = _check_shapes(q, k, v)
    q, k, v = _last_dim_contiguous(q, k, v)
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = _blocks(head_dim, element_size=q.element_size())
    if blocks is not None:
        block_m, block_n = _checked_blocks(blocks)
    grid = (triton.cdiv(seq_q, block_m), batch * heads)
    attention_forward_kernel_v1[grid](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, group, seq_q, seq_k, head_dim, scale * LOG2E,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal,
        DOT_FP32=INTERPRETED, PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out, lse


def _check_tma(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if (t.stride(-2) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"attention_forward_v2 reads tiles with TMA, which needs 16-byte aligned rows: a row of "
                             f"{t.shape[-1]} x {t.element_size()} bytes at stride {t.stride(-2)} is not; pad "
                             f"head_dim or use attention_forward_v1")


def attention_forward_v2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         scale: float | None = None,
                         blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As attention_forward_v1, with the tiles moved through tensor descriptors (TMA on Hopper) (v2)."""
    return _forward_by_descriptors(q, k, v, causal, scale, blocks, version=2)


def attention_forward_v3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         scale: float | None = None,
                         blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As attention_forward_v2, with BLOCK_M, BLOCK_N, num_warps and num_stages found by timing the configs of
    attention_tma.FORWARD_CONFIGS the first time a (seq_q, seq_k, head_dim, causal) is seen (v3);
    attention_tma.attention_forward_kernel_v3.best_config tells which won. blocks: tiles of one's own instead
    (then it is v2)."""
    return _forward_by_descriptors(q, k, v, causal, scale, blocks, version=3)


def attention_forward_v4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                         scale: float | None = None,
                         blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As attention_forward_v3, with fewer instructions per score (v4): only the tiles that need a mask get one,
    and the scale is applied inside exp2's fused multiply-add. blocks: tiles of one's own instead of timing."""
    if scale is not None and scale < 0:   # max(s) * scale is the max of the scaled scores only for scale >= 0
        raise ValueError(f"attention_forward_v4 scales each row's maximum instead of every score, which needs "
                         f"scale >= 0, got {scale}; use version 3 for a negative scale")
    return _forward_by_descriptors(q, k, v, causal, scale, blocks, version=4)


def _forward_by_descriptors(q, k, v, causal, scale, blocks, version: int):
    """Forward v2 to v4: all launch attention_tma's forward kernel; v4 with LEAN; v3 and v4, unless blocks are
    given, through their autotuners."""
    group = _check_shapes(q, k, v)
    q, k, v = _last_dim_contiguous(q, k, v)
    _check_tma(q, k, v)
    batch, heads, seq_q, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float32, device=q.device)
    use_device_descriptors()
    kernel, tiles = {3: attention_forward_kernel_v3, 4: attention_forward_kernel_v4}.get(version), {}
    if kernel is None or blocks is not None:   # the kernel itself, not an autotuner: the launcher's tiles or blocks
        block_m, block_n, warps, stages = _blocks(head_dim, element_size=q.element_size())
        if blocks is not None:
            block_m, block_n = _checked_blocks(blocks, any_ratio=True)
        kernel, tiles = attention_forward_kernel_v2, dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                                                          num_stages=stages)
    kernel[lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)](
        q, k, v, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        batch, heads, k.shape[1], group, seq_q, k.shape[2], head_dim, scale * LOG2E,
        BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal, LEAN=version == 4, DOT_FP32=INTERPRETED,
        PRECISION=_precision(q.dtype), **tiles)
    return out, lse


def attention_backward_v1(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, causal: bool = True, scale: float | None = None,
                          blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from dO and what forward saved (q, k, v, O, log-sum-exp); blocks as in the forward (v1)."""
    group = _check_shapes(q, k, v)
    q, do = q.contiguous(), do.contiguous()     # the kernels read q, dO and write dq with one set of strides
    k, v = _last_dim_contiguous(k, v)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    delta = (do.float() * out.float()).sum(dim=-1)                  # D = rowsum(dO * O): (batch, heads, seq_q)
    dq = torch.empty_like(q)
    # dK, dV per query head (fp32 when a group adds several, to sum in full precision), then per kv head.
    grad_dtype = torch.float32 if group > 1 else k.dtype
    dk = torch.empty(batch, heads, seq_k, head_dim, dtype=grad_dtype, device=k.device)
    dv = torch.empty_like(dk)
    block_m, block_n, warps, stages = _blocks(head_dim, backward=True, element_size=q.element_size())
    if blocks is not None:
        block_m, block_n = _checked_blocks(blocks)
    common = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal,
                  DOT_FP32=INTERPRETED, PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
    attention_backward_dkdv_kernel_v1[(triton.cdiv(seq_k, block_n), batch * heads)](
        q, k, v, do, lse, delta, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3],
        heads, group, seq_q, seq_k, head_dim, scale * LOG2E, scale, **common)
    attention_backward_dq_kernel_v1[(triton.cdiv(seq_q, block_m), batch * heads)](
        q, k, v, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        heads, group, seq_q, seq_k, head_dim, scale * LOG2E, scale, **common)
    if group > 1:   # the query heads of a group all read one key/value head: their gradients add up
        dk = dk.view(batch, kv_heads, group, seq_k, head_dim).sum(dim=2).to(k.dtype)
        dv = dv.view(batch, kv_heads, group, seq_k, head_dim).sum(dim=2).to(v.dtype)
    return dq, dk, dv


def attention_backward_v2(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, causal: bool = True, scale: float | None = None,
                          blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As attention_backward_v1 (v2): tiles through descriptors, masks on diagonal blocks only, and dK, dV of a
    key/value head made by one program over its group of query heads (no per-query-head copies to add).
    blocks: any two powers of two >= 16."""
    return _backward_by_descriptors(do, q, k, v, out, lse, causal, scale, blocks, version=2)


def attention_backward_v3(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, causal: bool = True, scale: float | None = None,
                          blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As attention_backward_v2 (v3): dkdv computes S^T = K Q^T, so P^T and dS^T need no transposing, and each
    kernel finds its own tiles, warps and stages by timing attention_tma.DKDV_CONFIGS and DQ_CONFIGS (the
    first time a (seq_q, seq_k, head_dim, group, causal) is seen; `.best_config` of each kernel says which won).
    blocks: (BLOCK_M, BLOCK_N) for both kernels instead of timing, any two powers of two >= 16."""
    return _backward_by_descriptors(do, q, k, v, out, lse, causal, scale, blocks, version=3)


def _backward_by_descriptors(do, q, k, v, out, lse, causal, scale, blocks, version: int):
    """Backward v2 and v3: both launch attention_tma's two kernels; v3 with KEYS_MAJOR and, unless blocks are
    given, through their autotuners."""
    group = _check_shapes(q, k, v)
    q, do = q.contiguous(), do.contiguous()
    k, v = _last_dim_contiguous(k, v)
    _check_tma(q, k, v)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    delta = (do.float() * out.float()).sum(dim=-1)                  # D = rowsum(dO * O): (batch, heads, seq_q)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)       # per key/value head, in k's dtype
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    use_device_descriptors()
    common = dict(BLOCK_D=triton.next_power_of_2(head_dim), CAUSAL=causal, DOT_FP32=INTERPRETED,
                  PRECISION=_precision(q.dtype))
    dkdv, dq_kernel = attention_backward_dkdv_kernel_v2, attention_backward_dq_kernel_v2
    if version == 3 and blocks is None:
        dkdv, dq_kernel = attention_backward_dkdv_kernel_v3, attention_backward_dq_kernel_v3
    else:
        block_m, block_n, warps, stages = _blocks(head_dim, backward=True, element_size=q.element_size())
        if blocks is not None:
            block_m, block_n = _checked_blocks(blocks, any_ratio=True)
        common.update(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    dkdv[lambda meta: (triton.cdiv(seq_k, meta["BLOCK_N"]), batch * kv_heads)](
        q, k, v, do, lse, delta, dk, dv, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3],
        batch, heads, kv_heads, group, seq_q, seq_k, head_dim, scale * LOG2E, scale, KEYS_MAJOR=version == 3,
        **common)
    dq_kernel[lambda meta: (triton.cdiv(seq_q, meta["BLOCK_M"]), batch * heads)](
        q, k, v, do, lse, delta, dq, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        batch, heads, kv_heads, group, seq_q, seq_k, head_dim, scale * LOG2E, scale, **common)
    return dq, dk, dv


VERSIONS = {1: (attention_forward_v1, attention_backward_v1), 2: (attention_forward_v2, attention_backward_v2),
            3: (attention_forward_v3, attention_backward_v3), 4: (attention_forward_v4, attention_backward_v3)}


class FlashAttentionFunction(torch.autograd.Function):
    """Attention with FlashAttention kernels both ways (forward and backward of one version); saves q, k, v, O and
    one fp32 per query row."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float | None, blocks: tuple[int, int] | None, version: int = 1):
        q, k, v = _last_dim_contiguous(q, k, v)
        out, lse = VERSIONS[version][0](q, k, v, causal, scale, blocks)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.blocks, ctx.version = causal, scale, blocks, version
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = VERSIONS[ctx.version][1](do, q, k, v, out, lse, ctx.causal, ctx.scale, ctx.blocks)
        return dq, dk, dv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, blocks: tuple[int, int] | None = None,
                    version: int = 1) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, like F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=scale, enable_gqa=True). q (batch, heads, seq_q, d), k and v (batch, kv_heads, seq_k, d); the causal
    mask is aligned top-left (query i sees keys 0..i), as SDPA's. Differentiable in q, k and v.
    blocks: (BLOCK_M, BLOCK_N) tile sizes instead of the defaults (see attention_forward_v1).
    version: which forward and backward kernels (1 to 4; the module's docstring says what each changes)."""
    if version not in VERSIONS:
        raise ValueError(f"version={version!r}; choose one of {sorted(VERSIONS)}")
    return FlashAttentionFunction.apply(q, k, v, causal, scale, blocks, version)



"""FlashAttention kernels that move their tiles through tensor descriptors (TMA on Hopper): forward v2, v3 and
v4, backward v2 and v3. Their launchers, and what each version changes, are in attention.py
(chapters/09_gpu_kernels.ipynb).

A descriptor (tl.make_tensor_descriptor) knows a tensor's shape and strides; a load or store names a tile by its
corner. Compiled for sm_90 each is one TMA instruction, which copies the tile between HBM and shared memory
asynchronously, so the pipeliner keeps num_stages tiles in flight; rows and columns past the end read as zeros
and are not written, so the kernels need no load masks. Rows must be 16-byte aligned (TMA's rule).
"""

from __future__ import annotations

import triton
import triton.language as tl

from picotron.kernels.runtime import INTERPRETED

__all__ = ["attention_forward_kernel_v2", "attention_forward_kernel_v3", "attention_forward_kernel_v4",
           "FORWARD_CONFIGS", "attention_backward_dkdv_kernel_v2", "attention_backward_dq_kernel_v2",
           "attention_backward_dkdv_kernel_v3", "attention_backward_dq_kernel_v3", "DKDV_CONFIGS", "DQ_CONFIGS"]


# ---- forward v2: tiles through tensor descriptors (TMA on Hopper) -------------------------------
@triton.jit
def _tiles_of(ptr, batches, heads, seq, head_dim, stride_b, stride_h, stride_s, ROWS: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """A descriptor of a (batch, heads, seq, head_dim) tensor whose loads and stores move (ROWS, BLOCK_D) tiles of
    one head: on Hopper each is one TMA copy; rows and columns past the end read as zeros and are not written."""
    return tl.make_tensor_descriptor(ptr, shape=[batches, heads, seq, head_dim],
                                     strides=[stride_b, stride_h, stride_s, 1], block_shape=[1, 1, ROWS, BLOCK_D])


@triton.jit
def _attend_blocks_v2(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, seq_k, lo, hi, qk_scale,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                      LEAN: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """v1's loop, the K and V tiles read through descriptors: no address arithmetic, no load masks (rows past
    seq_k and columns past head_dim come back as zeros). MASK: the tiles on the diagonal (v2), or (LEAN) the
    tiles that need any mask, causal or past seq_k.

    LEAN (v4) spends fewer instructions on each score. On an H100 the tensor cores do the tile's two dots in
    about the time the FP32 units take for a handful of operations per score, so each operation counts:
    v2 multiplies every score by the scale, then masks it (a compare and a select, on every tile, for the keys
    past seq_k), then subtracts the max; v4 masks only the tiles that need it and scales in the exponent's own
    fused multiply-add, exp2(s * scale - m), with the max scaled once per row."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if LEAN:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                 # unscaled
            if MASK:
                visible = offs_n[None, :] < seq_k
                if CAUSAL:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None])
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)                 # scale > 0: max commutes
            p = tl.exp2(s * qk_scale - m_new[:, None])                           # one FMA, then exp2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            visible = offs_n[None, :] < seq_k                        # zero-padded keys past the end: not keys
            if MASK:
                visible = visible & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attention_forward_kernel_v2(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
                                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                                batches, n_heads, kv_heads, group, seq_q, seq_k, head_dim, qk_scale,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                CAUSAL: tl.constexpr, LEAN: tl.constexpr, DOT_FP32: tl.constexpr,
                                PRECISION: tl.constexpr):
    # LEAN: v4's loop (_attend_blocks_v2), and only the tiles that need a mask get one.
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group
    # One descriptor per tensor: its 4-D shape and strides, and the tile a load or store moves. On Hopper a
    # load is one TMA instruction that copies the tile into shared memory, asynchronously, so Triton's
    # pipeliner can keep num_stages tiles of K and V in flight while the tensor cores work on another.
    q_desc = _tiles_of(q_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    k_desc = _tiles_of(k_ptr, batches, kv_heads, seq_k, head_dim, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _tiles_of(v_ptr, batches, kv_heads, seq_k, head_dim, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    o_desc = _tiles_of(o_ptr, batches, n_heads, seq_q, head_dim, stride_ob, stride_oh, stride_om, BLOCK_M, BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key tiles [0, mid) go unmasked, [mid, end) masked. Causal: as v1, split at the start of the key tile holding
    # start_m (any BLOCK_M and BLOCK_N), and keys past the tile's last row are never seen. LEAN: the unmasked
    # part is whole tiles only, so the keys past seq_k are masked in the last tile alone.
    if CAUSAL:
        mid = (start_m // BLOCK_N) * BLOCK_N
        end = tl.minimum(start_m + BLOCK_M, seq_k)
    else:
        mid = seq_k
        end = seq_k
    if LEAN:
        mid = tl.minimum(mid, (seq_k // BLOCK_N) * BLOCK_N)
    acc, l_i, m_i = _attend_blocks_v2(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, seq_k, 0,
                                      tl.minimum(mid, seq_k), qk_scale, BLOCK_N, BLOCK_D, False, CAUSAL, LEAN,
                                      DOT_FP32, PRECISION)
    if CAUSAL or LEAN:
        acc, l_i, m_i = _attend_blocks_v2(acc, l_i, m_i, q, k_desc, v_desc, batch, kv_head, offs_m, seq_k, mid, end,
                                          qk_scale, BLOCK_N, BLOCK_D, True, CAUSAL, LEAN, DOT_FP32, PRECISION)
    out = acc / l_i[:, None]
    o_desc.store([batch, head, start_m, 0], out.to(o_ptr.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))
    lse = (m_i + tl.log2(l_i)) / 1.4426950408889634
    tl.store(lse_ptr + (batch * n_heads + head) * seq_q + offs_m, lse, mask=offs_m < seq_q)


# ---- forward v3: v2 with its tiles, warps and stages chosen by timing (autotuning) ------------------------
# The best tile shape depends on the GPU, head_dim and the sequence: FlashAttention-2 and Triton's tutorial
# both pick among a few. Every config here compiles for sm_90 (head_dim 128, bf16) without spilling registers
# (python -m picotron.kernels.report); one whose shared memory does not fit a smaller GPU is skipped by the
# autotuner. In the interpreter only one runs: timing Python there would pick nothing a GPU would.
FORWARD_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                   for m, n, w, s in ((128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3),
                                      (128, 32, 4, 4), (256, 32, 8, 3))]
attention_forward_kernel_v3 = triton.autotune(
    configs=[triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=1)] if INTERPRETED
    else FORWARD_CONFIGS, key=["seq_q", "seq_k", "head_dim", "CAUSAL"])(attention_forward_kernel_v2)
# ---- forward v4: v3 with fewer instructions per score (LEAN: masks where needed, the scale in exp2's FMA) ----
attention_forward_kernel_v4 = triton.autotune(   # launched with LEAN=True
    configs=[triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=1)] if INTERPRETED
    else FORWARD_CONFIGS, key=["seq_q", "seq_k", "head_dim", "CAUSAL"])(attention_forward_kernel_v2)


# ---- backward v2: tiles through descriptors, a GQA group in one program, masks on the diagonal only --------
@triton.jit
def _dkdv_blocks_v2(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, row_base, batch, head, offs_n, seq_q,
                    lo, hi, qk_scale, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr,
                    KEYS_MAJOR: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Add query blocks [lo, hi) of one query head to the dK, dV of a key block. Query rows past seq_q come in
    as zeros (q, dO) with D = 0, so they add nothing: no mask is needed but the causal one (MASK).

    v2 computes S = Q K^T (queries, keys) and transposes P and dS, tiles held in registers, for dV += P^T dO and
    dK += dS^T Q: each transpose a trip through shared memory, every step. v3 (KEYS_MAJOR) turns every product
    around: S^T = K Q^T is (keys, queries), so P^T and dS^T come out of the dots as those two take them."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        do = do_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        if DOT_FP32:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(lse_ptr + row_base + offs_m, mask=offs_m < seq_q, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_ptr + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
        if KEYS_MAJOR:
            p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse[None, :])
            if MASK:
                p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
        else:
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
            if MASK:
                p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def attention_backward_dkdv_kernel_v2(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                                      stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                      stride_vb, stride_vh, stride_vn, stride_gb, stride_gh, stride_gm,
                                      batches, n_heads, kv_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                      CAUSAL: tl.constexpr, KEYS_MAJOR: tl.constexpr, DOT_FP32: tl.constexpr,
                                      PRECISION: tl.constexpr):
    # One program per (key block, batch, key/value head): it visits the `group` query heads that read this
    # head and writes dK, dV once, per key/value head (v1 wrote them per query head for torch to add up).
    # KEYS_MAJOR: v3's loop (_dkdv_blocks_v2).
    start_n = tl.program_id(0) * BLOCK_N
    batch = tl.program_id(1) // kv_heads
    kv_head = tl.program_id(1) % kv_heads
    q_desc = _tiles_of(q_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    do_desc = _tiles_of(do_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    k_desc = _tiles_of(k_ptr, batches, kv_heads, seq_k, head_dim, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _tiles_of(v_ptr, batches, kv_heads, seq_k, head_dim, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    dk_desc = _tiles_of(dk_ptr, batches, kv_heads, seq_k, head_dim, stride_gb, stride_gh, stride_gm, BLOCK_N, BLOCK_D)
    dv_desc = _tiles_of(dv_ptr, batches, kv_heads, seq_k, head_dim, stride_gb, stride_gh, stride_gm, BLOCK_N, BLOCK_D)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
    if DOT_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Causal: queries before the block holding start_n never see these keys; from there to start_n + BLOCK_N the
    # query blocks cross the diagonal (masked: one block, or BLOCK_N / BLOCK_M of them); the rest see every key.
    lo = 0
    mid = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M
    for g in range(group):
        head = kv_head * group + g
        row_base = (batch * n_heads + head) * seq_q
        if CAUSAL:
            dk, dv = _dkdv_blocks_v2(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, row_base, batch, head, offs_n,
                                     seq_q, lo, tl.minimum(mid, seq_q), qk_scale, BLOCK_M, BLOCK_D, True, KEYS_MAJOR,
                                     DOT_FP32, PRECISION)
        dk, dv = _dkdv_blocks_v2(dk, dv, k, v, q_desc, do_desc, lse_ptr, delta_ptr, row_base, batch, head, offs_n,
                                 seq_q, mid, seq_q, qk_scale, BLOCK_M, BLOCK_D, False, KEYS_MAJOR, DOT_FP32, PRECISION)
    dk = (dk * scale).to(dk_ptr.dtype.element_ty)
    dk_desc.store([batch, kv_head, start_n, 0], dk.reshape(1, 1, BLOCK_N, BLOCK_D))
    dv_desc.store([batch, kv_head, start_n, 0], dv.to(dv_ptr.dtype.element_ty).reshape(1, 1, BLOCK_N, BLOCK_D))


@triton.jit
def _dq_blocks_v2(dq, q, do, lse, delta, k_desc, v_desc, batch, kv_head, offs_m, lo, hi, qk_scale,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASK: tl.constexpr, DOT_FP32: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Add key blocks [lo, hi) to dQ of a query block. Keys past seq_k come in as zero rows of K and V: their
    dS K product is zero, so they need no mask; only the diagonal block is masked (MASK)."""
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([batch, kv_head, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse[:, None])
        if MASK:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(offs_n[None, :] <= offs_m[:, None], p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def attention_backward_dq_kernel_v2(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                                    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                                    stride_vb, stride_vh, stride_vn,
                                    batches, n_heads, kv_heads, group, seq_q, seq_k, head_dim, qk_scale, scale,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                    CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group
    q_desc = _tiles_of(q_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    do_desc = _tiles_of(do_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    dq_desc = _tiles_of(dq_ptr, batches, n_heads, seq_q, head_dim, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    k_desc = _tiles_of(k_ptr, batches, kv_heads, seq_k, head_dim, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _tiles_of(v_ptr, batches, kv_heads, seq_k, head_dim, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    do = do_desc.load([batch, head, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row_base = (batch * n_heads + head) * seq_q
    lse = tl.load(lse_ptr + row_base + offs_m, mask=offs_m < seq_q, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + row_base + offs_m, mask=offs_m < seq_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:   # key blocks before the one holding start_m: every row sees them; from there to the block's last
        # row: masked (one block, or BLOCK_M / BLOCK_N of them when key blocks are the smaller); later keys: never seen
        mid = (start_m // BLOCK_N) * BLOCK_N
        dq = _dq_blocks_v2(dq, q, do, lse, delta, k_desc, v_desc, batch, kv_head, offs_m, 0,
                           tl.minimum(mid, seq_k), qk_scale, BLOCK_N, BLOCK_D, False, DOT_FP32, PRECISION)
        dq = _dq_blocks_v2(dq, q, do, lse, delta, k_desc, v_desc, batch, kv_head, offs_m, mid,
                           tl.minimum(start_m + BLOCK_M, seq_k), qk_scale, BLOCK_N, BLOCK_D, True, DOT_FP32, PRECISION)
    else:
        dq = _dq_blocks_v2(dq, q, do, lse, delta, k_desc, v_desc, batch, kv_head, offs_m, 0, seq_k, qk_scale,
                           BLOCK_N, BLOCK_D, False, DOT_FP32, PRECISION)
    dq_desc.store([batch, head, start_m, 0], (dq * scale).to(dq_ptr.dtype.element_ty).reshape(1, 1, BLOCK_M, BLOCK_D))


# ---- backward v3: v2's kernels, dK, dV from P^T directly (KEYS_MAJOR), each kernel's tiles chosen by timing --
# Each kernel its own tiles: dkdv keeps dK and dV of BLOCK_N keys (2 x BLOCK_N x head_dim fp32) all along and streams
# queries past them; dq keeps dQ of BLOCK_M queries and streams keys. Every config here compiles for sm_90 without
# spilling registers (python -m picotron.kernels.report; tests/test_kernels.py checks it).
DKDV_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                for m, n, w, s in ((32, 128, 8, 3), (16, 128, 8, 3), (32, 64, 8, 3), (16, 64, 4, 3))]
DQ_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
              for m, n, w, s in ((128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3))]
_INTERPRETER_CONFIG = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=1)]
_BACKWARD_KEY = ["seq_q", "seq_k", "head_dim", "group", "CAUSAL"]


attention_backward_dkdv_kernel_v3 = triton.autotune(   # launched with KEYS_MAJOR=True
    configs=_INTERPRETER_CONFIG if INTERPRETED else DKDV_CONFIGS, key=_BACKWARD_KEY)(attention_backward_dkdv_kernel_v2)
attention_backward_dq_kernel_v3 = triton.autotune(
    configs=_INTERPRETER_CONFIG if INTERPRETED else DQ_CONFIGS, key=_BACKWARD_KEY)(attention_backward_dq_kernel_v2)

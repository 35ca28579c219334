"""Row softmax in Triton: one pass over HBM instead of eager PyTorch's five.

Chapter: chapters/09_gpu_kernels.ipynb, section 6.

softmax(x)_j = exp(x_j - m) / sum_k exp(x_k - m), m = max_k x_k (subtracting m keeps exp from
overflowing and does not change the result). Written as torch ops it is max, subtract, exp, sum,
divide: five kernels, each reading its input from HBM and writing its output back, about 8 bytes
moved per element and byte of dtype where 2 would do (read x once, write y once). A fused kernel
keeps the row in registers between the steps. Softmax does ~5 FLOPs per element, so it is
memory-bound on every GPU and its speed is its bandwidth: bytes moved / time.

Versions (kernel `softmax_kernel_vN`, launched by `softmax_vN`; `softmax` picks v2 or v3):

    v1  one program per row, the whole row in one block: 1 read + 1 write
    v2  v1 with ROWS rows per program, a (ROWS, BLOCK) tile: fewer, fuller programs for short rows
        (thread coarsening), same bytes
    v3  v1 for rows too long for one block: a first pass over the row's blocks keeps a running max and
        sum (online softmax, Milakov & Gimelshein 2018, arXiv:1805.02867), a second writes the output:
        2 reads + 1 write, any row length

Every version computes in fp32 and stores in the input's dtype. Rows are addressed through their
stride, so a slice x[:, :n] of a wider tensor works without a copy; the last dimension must be
contiguous (stride 1) for the loads to coalesce, and `softmax` copies it when it is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from picotron.kernels.runtime import INTERPRETED, check_device

__all__ = ["softmax_kernel_v1", "softmax_kernel_v2", "softmax_kernel_v3", "softmax_v1", "softmax_v2", "softmax_v3",
           "softmax", "MAX_FUSED_BLOCK"]

# The longest row v1/v2 hold in one block: 16384 fp32 values are 64 KB of registers spread over a
# program's 16 warps (128 B per thread), near what an SM can give one program without spilling.
MAX_FUSED_BLOCK = 16384


# ---- v1: one row per program -----------------------------------------------------------------
@triton.jit
def softmax_kernel_v1(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    # Lanes past the end read -inf: they lose the max and add exp(-inf) = 0 to the sum.
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def softmax_v1(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor, one program per row (v1)."""
    x, out = _prepare(x)
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    softmax_kernel_v1[(n_rows,)](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=_warps(block))
    return out


# ---- v2: several rows per program ------------------------------------------------------------
@triton.jit
def softmax_kernel_v2(x_ptr, out_ptr, n_rows, n_cols, x_row_stride, out_row_stride, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)          # (ROWS,)
    cols = tl.arange(0, BLOCK)                                    # (BLOCK,)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)  # (ROWS, BLOCK)
    # Rows past the end of the last tile re-read the last row (and store nothing): a row of only -inf
    # would give max - max = -inf - (-inf) = NaN, harmless but noisy.
    safe_rows = tl.minimum(rows, n_rows - 1)
    x = tl.load(x_ptr + safe_rows[:, None] * x_row_stride + cols[None, :], mask=cols[None, :] < n_cols,
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=inside)


def softmax_v2(x: torch.Tensor, rows_per_program: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor, a tile of rows per program (v2).

    Default tile: about 4096 elements (a short row gets several rows per program, a long one one),
    so each program has enough loads in flight to keep memory busy.
    """
    x, out = _prepare(x)
    n_rows, n_cols = x.shape
    block = triton.next_power_of_2(n_cols)
    rows = rows_per_program or max(1, min(64, 4096 // block))
    softmax_kernel_v2[(triton.cdiv(n_rows, rows),)](x, out, n_rows, n_cols, x.stride(0), out.stride(0),
                                                     ROWS=rows, BLOCK=block, num_warps=_warps(rows * block))
    return out


# ---- v3: online softmax, for rows longer than a block -----------------------------------------
@triton.jit
def softmax_kernel_v3(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * x_row_stride
    cols = tl.arange(0, BLOCK)
    m = float("-inf")     # running max of the row so far
    total = 0.0           # running sum of exp(x - m)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        # The sum so far was taken against the old max: rescale it by exp(m - new_m) before adding. While every
        # value so far is -inf (a masked start of the row), shift by 0: exp(-inf - -inf) would be NaN.
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) / total
        tl.store(out_ptr + row * out_row_stride + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


def softmax_v3(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Softmax over the last dimension of a 2-D tensor, `block` columns at a time (v3)."""
    x, out = _prepare(x)
    n_rows, n_cols = x.shape
    block = min(block, triton.next_power_of_2(n_cols))
    softmax_kernel_v3[(n_rows,)](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, num_warps=_warps(block))
    return out


# ---- the one to call --------------------------------------------------------------------------
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension, any leading shape: v2 when a row fits in a block, else v3."""
    if x.dim() == 0:
        raise ValueError("softmax needs at least one dimension")
    if x.numel() == 0:
        return torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])                     # (rows, n): a view when it can be
    fits = triton.next_power_of_2(x.shape[-1]) <= MAX_FUSED_BLOCK
    out = softmax_v2(rows) if fits else softmax_v3(rows)
    return out.view(x.shape)






def _prepare(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"expected a 2-D tensor (rows, columns), got shape {tuple(x.shape)}; "
                         "`softmax` takes any shape")
    check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()   # the loads walk along the last dimension: it must be contiguous
    return x, torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _warps(tile: int) -> int:
    """Warps per program: enough threads that each holds a handful of the tile's values."""
    if INTERPRETED:
        return 4          # ignored by the interpreter
    return 4 if tile <= 2048 else 8 if tile <= 8192 else 16

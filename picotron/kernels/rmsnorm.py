"""RMSNorm in Triton, forward and backward, and `TritonRMSNorm`, a drop-in for picotron.model.RMSNorm.

Chapter: chapters/09_gpu_kernels.ipynb, section 7 (the backward's derivation is there).

    y = w * (x * r),   r = 1 / sqrt(mean_j x_j^2 + eps)     (per row; Zhang & Sennrich 2019, arXiv:1910.07467)

picotron.model.RMSNorm writes it as six torch ops (float, pow, mean, add + rsqrt, multiply, cast,
multiply by w); in eager mode each is a kernel that reads its input from memory and writes its
output, and autograd keeps several of those outputs for backward. Here one forward kernel reads x
once and writes y once, and keeps for backward only x and r (4 bytes per row).

Backward, with x^ = x r and g = dL/dy:

    dL/dw = sum over rows of g * x^
    dL/dx = r * (g w - x^ * mean_j(g_j w_j x^_j))

Versions (kernels `rmsnorm_forward_kernel_vN`, `rmsnorm_backward_kernel_vN`, launched by `rmsnorm_forward_vN`,
`rmsnorm_backward_vN`; `rmsnorm` is the autograd function of forward v2 and backward v1, `TritonRMSNorm` its module):

    forward v1   one row per program (the kernel assignment 09 writes)
    forward v2   v1 with a tile of ROWS rows per program: fewer programs for narrow rows (thread coarsening)
    backward v1  dx row by row, and each program's partial sum of dw over the rows it visits (grid-stride,
                 coarsened); torch adds the few partial rows
    backward v2  v1 with the tiles of x, dy, dx moved by TMA (tensor descriptors) in a loop pipelined 3 deep:
                 the next tiles' copies are in flight while one is computed. On sm_90 (python -m
                 picotron.kernels.report): 6 TMA loads and 8 plain loads instead of 42, 96 registers instead
                 of 112, 40 KiB of shared memory for the stages. Rows of a multiple of 16 bytes only.

Arithmetic in fp32 whatever the input dtype, as picotron.model.RMSNorm does; x^ is rounded to x's
dtype before the weight multiplies it, as there, so the two agree in bf16 too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from picotron.kernels.runtime import INTERPRETED, check_device, use_device_descriptors

__all__ = ["rmsnorm_forward_kernel_v1", "rmsnorm_forward_kernel_v2", "rmsnorm_backward_kernel_v1",
           "rmsnorm_backward_kernel_v2", "rmsnorm_forward_v1", "rmsnorm_forward_v2", "rmsnorm_backward_v1",
           "rmsnorm_backward_v2", "RMSNormFunction", "rmsnorm", "TritonRMSNorm"]


# ---- forward v1: one row per program ---------------------------------------------------------
@triton.jit
def rmsnorm_forward_kernel_v1(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    # Padding lanes hold 0: they add nothing to the sum of squares, and the mean divides by n_cols.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)   # rounded like the torch module
    tl.store(out_ptr + row * out_row_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(rstd_ptr + row, rstd)


# ---- forward v2: a tile of rows per program ---------------------------------------------------
@triton.jit
def rmsnorm_forward_kernel_v2(x_ptr, w_ptr, out_ptr, rstd_ptr, n_rows, n_cols, x_row_stride, out_row_stride, eps,
                              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)          # (ROWS,)
    cols = tl.arange(0, BLOCK)                                    # (BLOCK,)
    row_inside = rows < n_rows
    inside = row_inside[:, None] & (cols[None, :] < n_cols)       # (ROWS, BLOCK)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)   # (ROWS,)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)   # read once per program
    normed = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y, mask=inside)
    tl.store(rstd_ptr + rows, rstd, mask=row_inside)


# ---- backward v1: dx per row, dw in partial sums ----------------------------------------------
@triton.jit
def rmsnorm_backward_kernel_v1(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                               dy_row_stride, x_row_stride, dx_row_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_inside = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)      # this program's share of dL/dw, kept in registers
    # Grid-stride over tiles of rows: every program visits many rows, so dw is written once per program
    # (a few rows of partial sums) instead of once per row of x.
    for tile in range(pid, (n_rows + ROWS - 1) // ROWS, programs):
        rows = tile * ROWS + tl.arange(0, ROWS)
        inside = (rows[:, None] < n_rows) & col_inside[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        dw += tl.sum(dy * x_hat, axis=0)
        g = dy * w[None, :]                                                   # dL/dx^
        mean_gx = tl.sum(g * x_hat, axis=1) / n_cols                          # (ROWS,)
        dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
        tl.store(dx_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_inside)


# ---- backward v2: v1 with its tiles moved by TMA, software-pipelined ---------------------------------
@triton.jit
def rmsnorm_backward_kernel_v2(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, n_cols,
                               dy_row_stride, x_row_stride, dx_row_stride, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    col_inside = cols < n_cols
    # Descriptors: a tile of (ROWS, BLOCK) is one TMA copy into shared memory on Hopper; rows and columns past
    # the end come in as zeros, so no masks. With tl.range's num_stages the copies of the next STAGES - 1 tiles
    # are in flight while this one is computed: HBM's latency hides behind the arithmetic.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, n_cols], strides=[x_row_stride, 1],
                                       block_shape=[ROWS, BLOCK])
    dy_desc = tl.make_tensor_descriptor(dy_ptr, shape=[n_rows, n_cols], strides=[dy_row_stride, 1],
                                        block_shape=[ROWS, BLOCK])
    dx_desc = tl.make_tensor_descriptor(dx_ptr, shape=[n_rows, n_cols], strides=[dx_row_stride, 1],
                                        block_shape=[ROWS, BLOCK])
    w = tl.load(w_ptr + cols, mask=col_inside, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for tile in tl.range(pid, (n_rows + ROWS - 1) // ROWS, programs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        x = x_desc.load([tile * ROWS, 0]).to(tl.float32)
        dy = dy_desc.load([tile * ROWS, 0]).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        dw += tl.sum(dy * x_hat, axis=0)
        g = dy * w[None, :]
        mean_gx = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * mean_gx[:, None])
        dx_desc.store([tile * ROWS, 0], dx.to(dx_ptr.dtype.element_ty))
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw, mask=col_inside)


# ---- launchers --------------------------------------------------------------------------------
def _warps(tile: int) -> int:
    """Warps per program: enough threads that each holds a handful of the tile's values."""
    return 4 if INTERPRETED or tile <= 2048 else 8 if tile <= 8192 else 16


def _tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps): the row padded to a power of two, and rows per program for ~4096 elements."""
    block = triton.next_power_of_2(n_cols)
    rows = max(1, min(64, 4096 // block))
    return block, rows, _warps(rows * block)


def _forward_outputs(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Check x (rows, n) and weight (n,); allocate y, in the dtype `weight * x` gives in torch
    (picotron.model.RMSNorm's output dtype), and rstd (rows,) fp32."""
    n_rows, n_cols = x.shape
    if weight.shape != (n_cols,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n_cols},) for rows of {n_cols}")
    check_device(x, weight)
    out = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    return out, torch.empty(n_rows, dtype=torch.float32, device=x.device)


def rmsnorm_forward_v1(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, n) with a contiguous last dimension -> y (rows, n), rstd (rows,) fp32; one program per row (v1)."""
    out, rstd = _forward_outputs(x, weight)
    n_rows, n_cols = x.shape
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        rmsnorm_forward_kernel_v1[(n_rows,)](x, weight, out, rstd, n_cols, x.stride(0), out.stride(0), eps,
                                             BLOCK=block, num_warps=_warps(block))
    return out, rstd


def rmsnorm_forward_v2(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, n) with a contiguous last dimension -> y (rows, n), rstd (rows,) fp32; a tile of rows per
    program (v2)."""
    out, rstd = _forward_outputs(x, weight)
    n_rows, n_cols = x.shape
    if n_rows:
        block, rows, warps = _tile(n_cols)
        rmsnorm_forward_kernel_v2[(triton.cdiv(n_rows, rows),)](x, weight, out, rstd, n_rows, n_cols, x.stride(0),
                                                                out.stride(0), eps, ROWS=rows, BLOCK=block,
                                                                num_warps=warps)
    return out, rstd


def rmsnorm_backward_v1(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dL/dy (rows, n), saved x and rstd -> dL/dx (x's dtype), dL/dw (weight's dtype) (v1)."""
    n_rows, n_cols = x.shape
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx = torch.empty_like(x)
    block, rows, warps = _tile(n_cols)
    tiles = triton.cdiv(n_rows, rows)
    # Enough programs to fill the GPU (2 per SM), few enough that adding their partial dw rows is cheap.
    most = 4 if INTERPRETED else 2 * torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = max(1, min(tiles, most))
    dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x.device)
    if n_rows:
        rmsnorm_backward_kernel_v1[(programs,)](dy, x, weight, rstd, dx, dw_partial, n_rows, n_cols, dy.stride(0),
                                                x.stride(0), dx.stride(0), ROWS=rows, BLOCK=block, num_warps=warps)
    return dx, dw_partial.sum(dim=0).to(weight.dtype)


def rmsnorm_backward_v2(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As rmsnorm_backward_v1, the tiles of x, dy and dx moved by TMA and pipelined 3 deep (v2). TMA needs rows
    of a multiple of 16 bytes: other widths raise (use v1)."""
    n_rows, n_cols = x.shape
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx = torch.empty_like(x)
    for t in (x, dy, dx):
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"rmsnorm_backward_v2 moves rows by TMA, which needs 16-byte aligned rows: rows of "
                             f"{n_cols} x {t.element_size()} bytes at stride {t.stride(0)} are not; use "
                             f"rmsnorm_backward_v1")
    block, rows, warps = _tile(n_cols)
    tiles = triton.cdiv(n_rows, rows)
    most = 4 if INTERPRETED else 2 * torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = max(1, min(tiles, most))
    dw_partial = torch.zeros(programs, n_cols, dtype=torch.float32, device=x.device)
    use_device_descriptors()
    if n_rows:
        rmsnorm_backward_kernel_v2[(programs,)](dy, x, weight, rstd, dx, dw_partial, n_rows, n_cols, dy.stride(0),
                                                x.stride(0), dx.stride(0), ROWS=rows, BLOCK=block,
                                                STAGES=1 if INTERPRETED else 3, num_warps=warps)
    return dx, dw_partial.sum(dim=0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimension with Triton kernels both ways (forward v2, backward v1); saves x and one
    fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])                 # (rows, n): a view when x is contiguous
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y, rstd = rmsnorm_forward_v2(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward_v1(dy.reshape(rows.shape), rows, weight, rstd)
        return dx.view(dy.shape), dw, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension, differentiable in x and weight, with Triton kernels."""
    return RMSNormFunction.apply(x, weight, eps)


class TritonRMSNorm(nn.Module):
    """picotron.model.RMSNorm computed by Triton kernels, a drop-in for it: the same `eps`, the same parameter
    `weight` (dim ones to start with), so the same state dict, and the same forward up to round-off.

    Not a subclass (this package imports nothing from the rest of picotron): code that looks for the model's
    norms by class finds only picotron.model.RMSNorm. On a machine without a GPU the kernels run in the
    Triton interpreter: correct, and slow.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, {'interpreted' if INTERPRETED else 'compiled'} Triton"

    @classmethod
    def from_torch(cls, norm: nn.Module) -> "TritonRMSNorm":
        """A TritonRMSNorm holding `norm`'s weight (the same Parameter) and eps."""
        new = cls(norm.weight.shape[0], norm.eps)
        new.weight = norm.weight
        return new



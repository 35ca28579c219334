"""The checks of assignment 09 pass correct kernels and fail planted wrong ones.

The correct kernels are written here, not taken from the solution notebook (which runs under nbval
on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.kernels' own kernels, except to see that the checks refuse them. Without a GPU the
kernels run in the Triton interpreter, where the online softmax's check also counts loads and
stores: a right answer that reads the row three times, or writes it twice, fails too.
"""

import re

import pytest
import triton
import triton.language as tl

from picotron_course.checks_kernels import check_online_softmax_kernel, check_rmsnorm_kernel, check_softmax_kernel


# ---- correct answers ------------------------------------------------------------------------------
@triton.jit
def ref_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def ref_softmax_exp2(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """exp2 of x log2(e), a where() instead of `other`, and multiplication by 1/sum: the same softmax."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside).to(tl.float32)
    x = tl.where(inside, x * 1.4426950408889634, float("-inf"))
    e = tl.exp2(x - tl.max(x, axis=0))
    y = e * (1.0 / tl.sum(e, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def ref_rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, normed * w, mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def ref_online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """A running max and sum over the row's blocks (shifted by 0 while every score is -inf), then the write."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        y = tl.exp(x - m) / total
        tl.store(out_ptr + row * out_row_stride + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def ref_online_softmax_lanes(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """A running max and sum per lane, started at a finite -1e38 (never nan), merged across lanes at the end;
    exp2 of x log2(e)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1e38, tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32) * 1.4426950408889634
        new_m = tl.maximum(m, x)
        total = total * tl.exp2(m - new_m) + tl.exp2(x - new_m)
        m = new_m
    row_m = tl.max(m, axis=0)
    row_total = tl.sum(total * tl.exp2(m - row_m), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        y = tl.exp2(x * 1.4426950408889634 - row_m) / row_total
        tl.store(out_ptr + row * out_row_stride + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@pytest.mark.parametrize("check, kernel", [(check_softmax_kernel, ref_softmax),
                                           (check_softmax_kernel, ref_softmax_exp2),
                                           (check_rmsnorm_kernel, ref_rmsnorm),
                                           (check_online_softmax_kernel, ref_online_softmax),
                                           (check_online_softmax_kernel, ref_online_softmax_lanes)],
                         ids=["softmax", "softmax_exp2", "rmsnorm", "online_softmax", "online_softmax_lanes"])
def test_correct_answer_passes(check, kernel, capsys):
    check(kernel)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


# ---- planted wrong answers: softmax ------------------------------------------------------------------
@triton.jit
def softmax_no_max(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """exp(x) / sum exp(x): right in exact arithmetic, overflows for large scores."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x)
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_pads_with_zero(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Padding lanes read 0 instead of -inf: each adds exp(-max) to the sum."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_one_stride(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Rows addressed as row * n_cols: right only for contiguous tensors."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * n_cols + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@triton.jit
def softmax_unmasked_store(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """The store writes all BLOCK lanes: past the end of the row, into the next one."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0))


@triton.jit
def softmax_of_first_row(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Every program reads row 0 (program_id forgotten in the load)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


# ---- planted wrong answers: RMSNorm ------------------------------------------------------------------
@triton.jit
def rmsnorm_mean_over_block(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                            BLOCK: tl.constexpr):
    """Mean of squares divided by BLOCK (the padded width) instead of n_cols."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / BLOCK + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, x * rstd * w, mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rmsnorm_no_eps(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, x * rstd * w, mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rmsnorm_no_weight(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * out_row_stride + cols, x * rstd, mask=inside)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rmsnorm_forgets_rstd(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                         BLOCK: tl.constexpr):
    """Right output, but backward's rstd is never stored."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, normed * w, mask=inside)


@triton.jit
def rmsnorm_std_not_rstd(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                         BLOCK: tl.constexpr):
    """Multiplies by the root mean square instead of dividing by it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rms = tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + cols, x * rms * w, mask=inside)
    tl.store(rstd_ptr + row, rms)


@triton.jit
def rmsnorm_input_stride_for_output(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                                    BLOCK: tl.constexpr):
    """Writes output rows with the input's row stride."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * x_row_stride + cols, normed * w, mask=inside)
    tl.store(rstd_ptr + row, rstd)


# ---- planted wrong answers: online softmax (the stretch) ------------------------------------------------
@triton.jit
def online_nan_after_masked_block(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """No care for a block of only -inf: exp(m - new_m) = exp(-inf - (-inf)) = nan."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total, mask=inside)


@triton.jit
def online_no_rescale(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Adds each block's exp(x - new_m) to a sum taken against older, smaller maxima, without rescaling it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = -1e38
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
        total = total + tl.sum(tl.exp(x - m), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total, mask=inside)


@triton.jit
def online_rescale_inverted(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Rescales the old sum by exp(new_m - m) instead of exp(m - new_m)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = -1e38
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(tl.minimum(new_m - m, 80.0)) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total, mask=inside)


@triton.jit
def online_three_passes(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Right, but not online: the max, then the sum, then the write: three reads of the row."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.exp(x - m), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total, mask=inside)


@triton.jit
def online_store_then_fix(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Right, but writes twice: stores exp(x - running max) in the first pass, then re-reads and rescales it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = -1e38
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m), mask=inside)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        e = tl.load(out_ptr + row * out_row_stride + start + cols, mask=inside, other=0.0)
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total + 0.0 * e, mask=inside)


@triton.jit
def online_one_big_block(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Ignores BLOCK: the whole row (up to 8192 columns) in one block, as softmax_kernel does."""
    row = tl.program_id(0)
    cols = tl.arange(0, 8192)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def online_unmasked_tail(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Masks with cols < n_cols instead of start + cols < n_cols: the ragged last block reads and writes past the
    row."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m) / total, mask=cols < n_cols)


@triton.jit
def online_lanes_from_minus_inf(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Per-lane running max started at -inf: a lane that has seen only -inf (padding, masked scores) turns nan."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, x)
        total = total * tl.exp(m - new_m) + tl.exp(x - new_m)
        m = new_m
    row_m = tl.max(m, axis=0)
    row_total = tl.sum(total * tl.exp(m - row_m), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - row_m) / row_total, mask=inside)


@triton.jit
def online_no_max(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """One running sum of exp(x), no max: right in exact arithmetic, overflows for large scores."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32)
        total += tl.sum(tl.exp(x), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x) / total, mask=inside)


@triton.jit
def online_contiguous_rows(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """Rows addressed as row * n_cols: right only for contiguous tensors."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = float("-inf")
    total = 0.0
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = new_m
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * n_cols + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tl.store(out_ptr + row * n_cols + start + cols, tl.exp(x - m) / total, mask=inside)


def _course_softmax():
    from picotron.kernels.row_softmax import softmax_kernel_v1
    return softmax_kernel_v1


def _course_rmsnorm():
    from picotron.kernels.rmsnorm import rmsnorm_forward_kernel_v1
    return rmsnorm_forward_kernel_v1


def _course_online_softmax():
    from picotron.kernels.row_softmax import softmax_kernel_v3
    return softmax_kernel_v3


WRONG_ANSWERS = [
    (check_softmax_kernel, softmax_no_max, "large values"),
    (check_softmax_kernel, softmax_pads_with_zero, "100 columns"),
    (check_softmax_kernel, softmax_one_stride, r"x\[:, :70\]"),
    (check_softmax_kernel, softmax_unmasked_store, "outside the rows"),
    (check_softmax_kernel, softmax_of_first_row, "softmax_kernel"),
    (check_rmsnorm_kernel, rmsnorm_mean_over_block, "100 columns"),
    (check_rmsnorm_kernel, rmsnorm_no_eps, "64 columns"),   # eps = 1e-5 moves y by ~5e-6: above fp32 round-off
    (check_rmsnorm_kernel, rmsnorm_no_weight, "rmsnorm_kernel"),
    (check_rmsnorm_kernel, rmsnorm_forgets_rstd, "rstd"),
    (check_rmsnorm_kernel, rmsnorm_std_not_rstd, "rmsnorm_kernel"),
    (check_rmsnorm_kernel, rmsnorm_input_stride_for_output, "outside the rows"),
    (check_online_softmax_kernel, online_nan_after_masked_block, "first block all -inf.*NaN"),
    (check_online_softmax_kernel, online_no_rescale, "the max rises in every block .*FAIL"),
    (check_online_softmax_kernel, online_rescale_inverted, "the max rises in every block .*FAIL"),
    (check_online_softmax_kernel, online_unmasked_tail, "ragged last block"),
    (check_online_softmax_kernel, online_lanes_from_minus_inf, "fewer columns than BLOCK .*FAIL"),
    (check_online_softmax_kernel, online_no_max, "large values"),
    (check_online_softmax_kernel, online_contiguous_rows, r"x\[:, :300\]"),
]


# Right values, wrong traffic: only the interpreter's count of loads and stores sees them.
COUNTED_WRONG_ANSWERS = [
    (check_online_softmax_kernel, online_three_passes, "loaded 3.00 times"),
    (check_online_softmax_kernel, online_store_then_fix, "stored 2.00 times"),
    (check_online_softmax_kernel, online_one_big_block, "read 8192 values at once"),
]


def _interpreted():
    from picotron.kernels.runtime import INTERPRETED
    return INTERPRETED


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("check, kernel, says", WRONG_ANSWERS, ids=[k.fn.__name__ for _, k, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, kernel, says, capsys):
    _fails_saying(check, kernel, says, capsys)


@pytest.mark.skipif(not _interpreted(), reason="loads and stores are counted in the Triton interpreter only")
@pytest.mark.parametrize("check, kernel, says", COUNTED_WRONG_ANSWERS,
                         ids=[k.fn.__name__ for _, k, _ in COUNTED_WRONG_ANSWERS])
def test_wrong_traffic_fails_in_the_interpreter(check, kernel, says, capsys):
    _fails_saying(check, kernel, says, capsys)


def _fails_saying(check, kernel, says, capsys):
    """`says` is found in the error (its first failed case) or in the table's failed rows."""
    with pytest.raises(AssertionError) as error:
        check(kernel)
    table = capsys.readouterr().out
    assert "FAIL" in table
    assert re.search(says, str(error.value)) or re.search(says, table), (says, str(error.value), table)


@pytest.mark.parametrize("check, course", [(check_softmax_kernel, _course_softmax),
                                           (check_rmsnorm_kernel, _course_rmsnorm),
                                           (check_online_softmax_kernel, _course_online_softmax)],
                         ids=["softmax", "rmsnorm", "online_softmax"])
def test_the_course_kernel_is_refused(check, course):
    with pytest.raises(AssertionError, match="the course's own kernel"):
        check(course())


@triton.jit
def unsolved_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """What the exercise notebook gives the learner."""
    raise NotImplementedError("unsolved_softmax: write this part")


@triton.jit
def unsolved_rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    raise NotImplementedError("unsolved_rmsnorm: write this part")


@pytest.mark.parametrize("check, kernel", [(check_softmax_kernel, unsolved_softmax),
                                           (check_rmsnorm_kernel, unsolved_rmsnorm),
                                           (check_online_softmax_kernel, unsolved_softmax)],
                         ids=["softmax", "rmsnorm", "online_softmax"])
def test_unsolved_kernel_raises_not_implemented(check, kernel):
    with pytest.raises(NotImplementedError, match="not written yet"):
        check(kernel)


def test_not_implemented_raised_inside_a_kernel_comes_out_as_itself():
    """The interpreter wraps what a kernel raises in an InterpreterError; launch unwraps NotImplementedError."""
    import torch

    from picotron_course.checks_kernels import launch

    @triton.jit
    def calls_an_unfinished_helper(x_ptr, BLOCK: tl.constexpr):
        unfinished_helper(x_ptr)

    with pytest.raises(NotImplementedError, match="unfinished"):
        launch(calls_an_unfinished_helper, (1,), torch.zeros(4), BLOCK=4)


@triton.jit
def unfinished_helper(x_ptr):
    raise NotImplementedError("unfinished_helper: write this part")


def test_a_kernel_that_crashes_is_a_failed_case(capsys):
    @triton.jit
    def wrong_signature(x_ptr, out_ptr, BLOCK: tl.constexpr):
        pass

    with pytest.raises(AssertionError, match="raised"):
        check_softmax_kernel(wrong_signature)
    assert "FAIL" in capsys.readouterr().out


def test_not_a_kernel_is_explained():
    def plain_python(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK):
        pass

    with pytest.raises(AssertionError, match="triton.jit"):
        check_softmax_kernel(plain_python)


def test_counting_loads_and_stores_leaves_the_interpreter_as_it_was(capsys):
    """The online check patches the interpreter's load and store for each launch only, even when a kernel crashes."""
    from triton.runtime import interpreter

    from picotron.kernels.runtime import INTERPRETED

    if not INTERPRETED:
        pytest.skip("counts only in the Triton interpreter")
    builder = interpreter.interpreter_builder

    @triton.jit
    def crashes_half_way(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, BLOCK))
        tl.store(out_ptr + tl.arange(0, BLOCK), x, mask=tl.arange(0, BLOCK) < n_cols, bad_argument=1)

    for kernel in (ref_online_softmax, crashes_half_way):
        try:
            check_online_softmax_kernel(kernel)
        except AssertionError:
            pass
        assert "create_masked_load" not in vars(builder) and "create_masked_store" not in vars(builder)

"""The checks of assignment 09 pass correct kernels and fail planted wrong ones.

The correct kernels are written here, not taken from the solution notebook (which runs under nbval
on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.kernels' own kernels, except to see that the checks refuse them. Without a GPU the
kernels run in the Triton interpreter.
"""

import pytest
import triton
import triton.language as tl

from picotron_course.checks_kernels import check_rmsnorm_kernel, check_softmax_kernel


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


@pytest.mark.parametrize("check, kernel", [(check_softmax_kernel, ref_softmax),
                                           (check_softmax_kernel, ref_softmax_exp2),
                                           (check_rmsnorm_kernel, ref_rmsnorm)],
                         ids=["softmax", "softmax_exp2", "rmsnorm"])
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


def _course_softmax():
    from picotron.kernels.row_softmax import softmax_kernel_v1
    return softmax_kernel_v1


def _course_rmsnorm():
    from picotron.kernels.rmsnorm import rmsnorm_forward_kernel_v1
    return rmsnorm_forward_kernel_v1


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
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("check, kernel, says", WRONG_ANSWERS, ids=[k.fn.__name__ for _, k, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, kernel, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(kernel)
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("check, course", [(check_softmax_kernel, _course_softmax),
                                           (check_rmsnorm_kernel, _course_rmsnorm)],
                         ids=["softmax", "rmsnorm"])
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
                                           (check_rmsnorm_kernel, unsolved_rmsnorm)], ids=["softmax", "rmsnorm"])
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

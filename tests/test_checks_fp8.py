"""The checks of assignment 10 pass correct answers and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under nbval
on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.fp8, except to see that the checks refuse it.
"""

import time

import pytest
import torch

from picotron_course.checks_fp8 import (E4M3, E5M2, check_float8_linear, check_float8_matmul, check_rowwise,
                                        check_tensorwise)


# ---- correct answers ------------------------------------------------------------------------------------
def quantize_tensorwise(x, dtype, scale=None):
    limit = torch.finfo(dtype).max
    if scale is None:
        scale = x.abs().max().float().clamp(min=1e-12) / limit
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def dequantize(q, scale):
    return q.float() * scale


def quantize_rowwise(x, dtype):
    limit = torch.finfo(dtype).max
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / limit
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def quantize_rowwise_loop(x, dtype):
    """Row by row, in a loop: slower, the same numbers."""
    pairs = [quantize_tensorwise(row[None], dtype) for row in x]
    return torch.cat([q for q, _ in pairs]), torch.stack([s for _, s in pairs]).reshape(-1, 1)


def float8_matmul(a, b, quantize, a_dtype=E4M3, b_dtype=E4M3):
    qa, sa = quantize(a, a_dtype)
    qb, sb = quantize(b, b_dtype)
    return dequantize(qa, sa) @ dequantize(qb, sb).t()


def _backward(ctx, grad_y):
    """The backward the assignment gives."""
    x, weight = ctx.saved_tensors
    g = grad_y.reshape(-1, grad_y.shape[-1])
    grad_x = float8_matmul(g, weight.t(), ctx.quantize, E5M2, E4M3)
    grad_w = float8_matmul(g.t(), x.t(), ctx.quantize, E5M2, E4M3)
    return grad_x.reshape(ctx.x_shape), grad_w, None


class Float8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return float8_matmul(x2, weight, quantize, E4M3, E4M3).reshape(*x.shape[:-1], weight.shape[0])

    backward = staticmethod(_backward)


CORRECT = [(check_tensorwise, (quantize_tensorwise, dequantize)),
           (check_rowwise, (quantize_rowwise, dequantize)),
           (check_rowwise, (quantize_rowwise_loop, dequantize)),
           (check_float8_matmul, (float8_matmul,)),
           (check_float8_linear, (Float8LinearFunction,))]


@pytest.mark.parametrize("check, answers", CORRECT, ids=["tensorwise", "rowwise", "rowwise_loop", "matmul", "linear"])
def test_correct_answer_passes_quickly(check, answers, capsys):
    start = time.perf_counter()
    check(*answers)
    assert time.perf_counter() - start < 15                     # an exercise check's budget
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


# ---- wrong answers ---------------------------------------------------------------------------------------
def tw_inverted(x, dtype, scale=None):
    limit = torch.finfo(dtype).max
    scale = limit / x.abs().max().float().clamp(min=1e-12) if scale is None else 1 / scale
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale


def tw_no_clamp(x, dtype, scale=None):
    limit = torch.finfo(dtype).max
    scale = x.abs().max().float().clamp(min=1e-12) / limit if scale is None else scale
    return (x.float() / scale).to(dtype), scale


def tw_signed_max(x, dtype, scale=None):
    limit = torch.finfo(dtype).max
    scale = x.max().float().clamp(min=1e-12) / limit if scale is None else scale
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def tw_no_zero_guard(x, dtype, scale=None):
    limit = torch.finfo(dtype).max
    scale = x.abs().max().float() / limit if scale is None else scale
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def tw_e4m3_max_always(x, dtype, scale=None):
    scale = x.abs().max().float().clamp(min=1e-12) / 448.0 if scale is None else scale
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def tw_float64_scale(x, dtype, scale=None):
    q, s = quantize_tensorwise(x, dtype, scale)
    return q, s.double()


def tw_ignores_given_scale(x, dtype, scale=None):
    return quantize_tensorwise(x, dtype)


def dequantize_divides(q, scale):
    return q.float() / scale


def rw_per_column(x, dtype):
    limit = torch.finfo(dtype).max
    scale = x.abs().amax(dim=0, keepdim=True).float().clamp(min=1e-12) / limit
    return (x.float() / scale).clamp(-limit, limit).to(dtype), scale


def rw_no_keepdim(x, dtype):
    limit = torch.finfo(dtype).max
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-12) / limit
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype), scale


def rw_one_scale_per_tensor(x, dtype):
    q, s = quantize_tensorwise(x, dtype)
    return q, s.expand(x.shape[0], 1)


def mm_forgets_scales(a, b, quantize, a_dtype=E4M3, b_dtype=E4M3):
    qa, _ = quantize(a, a_dtype)
    qb, _ = quantize(b, b_dtype)
    return qa.float() @ qb.float().t()


def mm_quantizes_b_along_n(a, b, quantize, a_dtype=E4M3, b_dtype=E4M3):
    qa, sa = quantize(a, a_dtype)
    qb, sb = quantize(b.t(), b_dtype)                          # scales across the wrong dimension
    return dequantize(qa, sa) @ dequantize(qb, sb)


def mm_high_precision(a, b, quantize, a_dtype=E4M3, b_dtype=E4M3):
    return a @ b.t()


def mm_one_dtype(a, b, quantize, a_dtype=E4M3, b_dtype=E4M3):
    return float8_matmul(a, b, quantize, a_dtype, a_dtype)


class LinearNoReshape(Float8LinearFunction):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return float8_matmul(x2, weight, quantize, E4M3, E4M3)


class LinearSavesNothing(Float8LinearFunction):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        return float8_matmul(x.reshape(-1, x.shape[-1]), weight, quantize).reshape(*x.shape[:-1], weight.shape[0])


class LinearSavesQuantized(Float8LinearFunction):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(dequantize(*quantize(x2, E4M3)), dequantize(*quantize(weight, E4M3)))
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return float8_matmul(x2, weight, quantize, E4M3, E4M3).reshape(*x.shape[:-1], weight.shape[0])


class LinearHighPrecision(Float8LinearFunction):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return (x2 @ weight.t()).reshape(*x.shape[:-1], weight.shape[0])


class LinearE5M2Forward(Float8LinearFunction):
    @staticmethod
    def forward(ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return float8_matmul(x2, weight, quantize, E5M2, E5M2).reshape(*x.shape[:-1], weight.shape[0])


WRONG_ANSWERS = [
    (check_tensorwise, (tw_inverted, dequantize), "inverted"),
    (check_tensorwise, (tw_no_clamp, dequantize), "clamp"),
    (check_tensorwise, (tw_signed_max, dequantize), "amax of |x|"),
    (check_tensorwise, (tw_no_zero_guard, dequantize), "scale differs"),
    (check_tensorwise, (tw_e4m3_max_always, dequantize), "this\\* format"),
    (check_tensorwise, (tw_float64_scale, dequantize), "float32"),
    (check_tensorwise, (tw_ignores_given_scale, dequantize), "scale differs"),
    (check_tensorwise, (quantize_tensorwise, dequantize_divides), "not q \\* scale"),
    (check_rowwise, (rw_per_column, dequantize), "shape"),
    (check_rowwise, (rw_no_keepdim, dequantize), "shape"),
    (check_rowwise, (rw_one_scale_per_tensor, dequantize), "scale differs"),
    (check_rowwise, (quantize_rowwise, dequantize_divides), "not q \\* scale"),
    (check_float8_matmul, (mm_forgets_scales,), "dequantized"),
    (check_float8_matmul, (mm_quantizes_b_along_n,), "along K"),
    (check_float8_matmul, (mm_high_precision,), "dequantized"),
    (check_float8_matmul, (mm_one_dtype,), "float8_matmul"),
    (check_float8_linear, (LinearNoReshape,), "leading dimensions"),
    (check_float8_linear, (LinearSavesNothing,), "saved_tensors"),
    (check_float8_linear, (LinearSavesQuantized,), "before any quantization"),
    (check_float8_linear, (LinearHighPrecision,), "e4m3 copies"),
    (check_float8_linear, (LinearE5M2Forward,), "e4m3 copies"),
]


def _wrong_id(answers) -> str:
    return "+".join(getattr(a, "__name__", "?") for a in answers)


@pytest.mark.parametrize("check, answers, says", WRONG_ANSWERS, ids=[_wrong_id(a) for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answers, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(*answers)
    assert "FAIL" in capsys.readouterr().out


def test_the_course_answer_is_refused():
    from picotron.fp8 import dequantize as course_dequantize
    from picotron.fp8 import quantize as course_quantize
    with pytest.raises(AssertionError, match="course's own code"):
        check_tensorwise(course_quantize, course_dequantize)


def test_unsolved_answer_raises_not_implemented():
    def unsolved(*args, **kwargs):
        raise NotImplementedError("write this part")

    class Unsolved(Float8LinearFunction):
        forward = staticmethod(unsolved)

    for check, answers in [(check_tensorwise, (unsolved, dequantize)),
                           (check_tensorwise, (quantize_tensorwise, unsolved)),
                           (check_rowwise, (unsolved, dequantize)), (check_float8_matmul, (unsolved,)),
                           (check_float8_linear, (Unsolved,))]:
        with pytest.raises(NotImplementedError):
            check(*answers)

"""The checks of assignment 10 pass correct answers and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under nbval
on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.fp8, except to see that the checks refuse it.
"""

import time

import pytest
import torch

from picotron_course.checks_fp8 import (E4M3, E5M2, check_delayed_scaler, check_float8_linear, check_float8_matmul,
                                        check_rowwise, check_tensorwise)


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


class DelayedScaler:
    """The stretch's rules: scale from the largest amax of the last H steps (x 2^margin); this step's own amax
    with no history or on an overflow (counted); then record this step's amax."""

    def __init__(self, dtype, history_len, margin=0):
        self.dtype, self.history_len, self.margin = dtype, history_len, margin
        self.history, self.overflows = [], 0

    def delayed_amax(self, amax):
        past = max(self.history[-self.history_len:], default=0.0)
        if past == 0:
            return amax
        if amax > past * 2 ** self.margin:
            self.overflows += 1
            return amax
        return past

    def quantize(self, x):
        limit = torch.finfo(self.dtype).max
        amax = x.abs().max().item()
        chosen = self.delayed_amax(amax)
        self.history.append(amax)
        scale = torch.tensor(max(chosen, 1e-12) * 2 ** self.margin / limit, dtype=torch.float32)
        return (x.float() / scale).clamp(-limit, limit).to(self.dtype), scale


def tensorwise_scale_1x1(x, dtype, scale=None):
    """One scale of shape (1, 1) instead of (): one element, as the task says."""
    q, s = quantize_tensorwise(x, dtype, scale)
    return q, s.reshape(1, 1)


CORRECT = [(check_tensorwise, (quantize_tensorwise, dequantize)),
           (check_tensorwise, (tensorwise_scale_1x1, dequantize)),
           (check_rowwise, (quantize_rowwise, dequantize)),
           (check_rowwise, (quantize_rowwise_loop, dequantize)),
           (check_float8_matmul, (float8_matmul,)),
           (check_float8_linear, (Float8LinearFunction,)),
           (check_delayed_scaler, (DelayedScaler,))]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"tensorwise": 8, "rowwise": 6, "float8_matmul": 6, "float8_linear": 4, "delayed_scaler": 6}


@pytest.mark.parametrize("check, answers", CORRECT, ids=["tensorwise", "tensorwise_1x1", "rowwise", "rowwise_loop",
                                                         "matmul", "linear", "delayed"])
def test_correct_answer_passes_quickly(check, answers, every_case):
    start = time.perf_counter()
    check(*answers)
    assert time.perf_counter() - start < 15                     # an exercise check's budget
    every_case(CASES)


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


class DsDynamic(DelayedScaler):
    """Records this step's amax before choosing the scale: delayed scaling that is not delayed."""

    def quantize(self, x):
        self.history.append(x.abs().max().item())
        self.history = self.history[-self.history_len:]
        limit = torch.finfo(self.dtype).max
        scale = torch.tensor(max(self.history) * 2 ** self.margin / limit, dtype=torch.float32).clamp(min=1e-12 / limit)
        return (x.float() / scale).clamp(-limit, limit).to(self.dtype), scale


class DsUnbounded(DelayedScaler):
    """Keeps every amax since the start."""

    def __init__(self, dtype, history_len, margin=0):
        super().__init__(dtype, 10**9, margin)


class DsWindowOneLonger(DelayedScaler):
    """Keeps H + 1 amaxes."""

    def __init__(self, dtype, history_len, margin=0):
        super().__init__(dtype, history_len + 1, margin)


class DsSaturates(DelayedScaler):
    """Counts an overflow but keeps the delayed scale: the step saturates."""

    def delayed_amax(self, amax):
        chosen = super().delayed_amax(amax)
        past = max(self.history[-self.history_len:], default=0.0)
        return past if past else chosen


class DsUncounted(DelayedScaler):
    """Falls back on an overflow, and forgets to count it."""

    def delayed_amax(self, amax):
        chosen = super().delayed_amax(amax)
        self.overflows = 0
        return chosen


class DsCountsWithoutHistory(DelayedScaler):
    """Counts the first step (no history) as an overflow, since its amax exceeds 0."""

    def delayed_amax(self, amax):
        if not any(self.history[-self.history_len:]):
            self.overflows += 1
        return super().delayed_amax(amax)


class DsMarginDivides(DelayedScaler):
    """scale = amax / 2^margin / max: the headroom the wrong way."""

    def __init__(self, dtype, history_len, margin=0):
        super().__init__(dtype, history_len, -margin)


class DsNoZeroGuard(DelayedScaler):
    def quantize(self, x):
        limit = torch.finfo(self.dtype).max
        amax = x.abs().max().item()
        chosen = self.delayed_amax(amax)
        self.history.append(amax)
        scale = torch.tensor(chosen * 2 ** self.margin / limit, dtype=torch.float32)
        return (x.float() / scale).clamp(-limit, limit).to(self.dtype), scale


class DsSharedHistory(DelayedScaler):
    """The history a class attribute: every scaler appends to the same list."""

    history: list = []
    overflows = 0

    def __init__(self, dtype, history_len, margin=0):
        self.dtype, self.history_len, self.margin = dtype, history_len, margin


class DsFloat64Scale(DelayedScaler):
    def quantize(self, x):
        q, scale = super().quantize(x)
        return q, scale.double()


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
    (check_delayed_scaler, (DsDynamic,), "joined the history before the scale was chosen"),
    (check_delayed_scaler, (DsUnbounded,), "keep only the last history_len"),
    (check_delayed_scaler, (DsWindowOneLonger,), "last 5 steps: the history holds the last history_len = 4"),
    (check_delayed_scaler, (DsSaturates,), "count an overflow and use this step's own amax"),
    (check_delayed_scaler, (DsUncounted,), "overflows is 0 after step 8"),
    (check_delayed_scaler, (DsCountsWithoutHistory,), "a step without history never overflows"),
    (check_delayed_scaler, (DsMarginDivides,), "the margin divides"),
    (check_delayed_scaler, (DsNoZeroGuard,), "positive scale"),
    (check_delayed_scaler, (DsSharedHistory,), "no history yet"),
    (check_delayed_scaler, (DsFloat64Scale,), "one float32 number"),
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
    with pytest.raises(AssertionError, match="course's answer"):
        check_tensorwise(course_quantize, course_dequantize)


def test_the_course_delayed_scales_are_refused():
    from picotron.fp8 import DelayedScales

    class Scaler(DelayedScales):
        def __init__(self, dtype, history_len, margin=0):
            super().__init__(history_len)

    with pytest.raises(AssertionError, match="course's answer"):
        check_delayed_scaler(Scaler)


def test_two_scalers_sharing_a_history_fail_even_when_each_sequence_passes(capsys):
    """A scaler whose history is shared only between instances made in a row: the planted sequences (one
    scaler each, the shared list cleared by each new one) pass; the interleaved pair does not."""

    class ClearedShared(DelayedScaler):
        shared: list = []

        def __init__(self, dtype, history_len, margin=0):
            super().__init__(dtype, history_len, margin)
            ClearedShared.shared.clear()
            self.history = ClearedShared.shared

    with pytest.raises(AssertionError, match="share their history"):
        check_delayed_scaler(ClearedShared)
    out = capsys.readouterr().out
    assert out.count(" ok") == 5 and "two scalers, interleaved" in out


def test_unsolved_answer_raises_not_implemented():
    def unsolved(*args, **kwargs):
        raise NotImplementedError("write this part")

    class Unsolved(Float8LinearFunction):
        forward = staticmethod(unsolved)

    class UnsolvedScaler:
        def __init__(self, dtype, history_len, margin=0):
            raise NotImplementedError("DelayedScaler.__init__: write this part")

    for check, answers in [(check_tensorwise, (unsolved, dequantize)),
                           (check_tensorwise, (quantize_tensorwise, unsolved)),
                           (check_rowwise, (unsolved, dequantize)), (check_float8_matmul, (unsolved,)),
                           (check_float8_linear, (Unsolved,)), (check_delayed_scaler, (UnsolvedScaler,))]:
        with pytest.raises(NotImplementedError):
            check(*answers)

"""The checks of assignment 10 pass correct answers and refuse the course's own.

The correct answers are written here, not taken from the solution notebook (which runs under nbval
on its own), so a check that passes everything, or nothing, is caught. The wrong answers are the checks'
misconceptions, each failing with its hint (tests/test_misconceptions.py). Nothing here uses picotron.fp8,
except to see that the checks refuse it.
"""

import time

import pytest
import torch

from picotron_course import checks_fp8
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


# ---- answers refused, a mistake no misconception describes, and properties ---------------------------------
# The planted wrong answers are the checks' misconceptions (checks_fp8.py), tested in test_misconceptions.py.
class LinearOnItsBase(checks_fp8._Linear):   # the correct base the misconceptions change
    pass


def test_the_course_answer_is_refused(capsys):
    from picotron.fp8 import DelayedScales, dequantize, quantize

    class Scaler(DelayedScales):
        def __init__(self, dtype, history_len, margin=0):
            super().__init__(history_len)

    for check, answers in [(check_tensorwise, (quantize, dequantize)), (check_delayed_scaler, (Scaler,)),
                           (check_float8_linear, (LinearOnItsBase,)), (check_delayed_scaler, (checks_fp8._Scaler,))]:
        with pytest.raises(AssertionError, match="course's answer"):
            check(*answers)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    with pytest.raises(AssertionError, match=r"the scale: amax of \|x\|") as error:   # a scale twice too large
        check_tensorwise(lambda x, dtype, scale=None: (lambda q, s: (q, 2 * s))(*quantize_tensorwise(x, dtype, scale)),
                         dequantize)
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


def test_two_scalers_sharing_a_history_fail_even_when_each_sequence_passes(capsys):
    """A history shared only by the scalers alive together: the planted sequences (one scaler each) pass, the
    interleaved pair does not."""
    with pytest.raises(AssertionError, match="share their history"):
        check_delayed_scaler(checks_fp8.DsSharedWhileAlive)
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

"""The checks of assignment 10 pass correct answers and refuse the course's own.

The correct answer is the checks' own correct code (checks_fp8.ref_quantize_tensorwise, ref_quantize_rowwise,
ref_dequantize, _fp8_product, and _Linear and _Scaler, which the misconceptions change and a learner may not
submit), judged with the refusal off; other valid answers are written here. So a check that passes everything,
or nothing, is caught. The wrong answers are the checks'
misconceptions, each failing with its hint (tests/test_misconceptions.py). Nothing here uses picotron.fp8,
except to see that the checks refuse it.
"""

import time

import pytest
import torch

from picotron_course import checks_fp8
from picotron_course.checks_fp8 import (check_delayed_scaler, check_float8_linear, check_float8_matmul,
                                        check_rowwise, check_tensorwise, ref_dequantize, ref_quantize_rowwise,
                                        ref_quantize_tensorwise)


# ---- correct answers ------------------------------------------------------------------------------------
# The checks' own correct code (their references, and the bases their misconceptions change: _Linear and _Scaler,
# refused as a learner's answer), judged with the refusal off; then other valid answers, which they must accept too.
BASES = {"tensorwise": (check_tensorwise, (ref_quantize_tensorwise, ref_dequantize)),
         "rowwise": (check_rowwise, (ref_quantize_rowwise, ref_dequantize)),
         "matmul": (check_float8_matmul, (checks_fp8._fp8_product,)),
         "linear": (check_float8_linear, (checks_fp8._Linear,)),
         "delayed": (check_delayed_scaler, (checks_fp8._Scaler,))}


def quantize_rowwise_loop(x, dtype):
    """Row by row, in a loop: slower, the same numbers."""
    pairs = [ref_quantize_tensorwise(row[None], dtype) for row in x]
    return torch.cat([q for q, _ in pairs]), torch.stack([s for _, s in pairs]).reshape(-1, 1)


def tensorwise_scale_1x1(x, dtype, scale=None):
    """One scale of shape (1, 1) instead of (): one element, as the task says."""
    q, s = ref_quantize_tensorwise(x, dtype, scale)
    return q, s.reshape(1, 1)


OTHERS = {"tensorwise_1x1": (check_tensorwise, (tensorwise_scale_1x1, ref_dequantize)),
          "rowwise_loop": (check_rowwise, (quantize_rowwise_loop, ref_dequantize))}

# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"tensorwise": 8, "rowwise": 6, "float8_matmul": 6, "float8_linear": 4, "delayed_scaler": 6}


def passes_quickly(check, answers, every_case):
    start = time.perf_counter()
    check(*answers)
    assert time.perf_counter() - start < 15                     # an exercise check's budget
    every_case(CASES)


@pytest.mark.parametrize("check, answers", BASES.values(), ids=list(BASES))
def test_correct_answer_passes_quickly(check, answers, every_case, refusing_nothing):
    refusing_nothing(checks_fp8)   # the checks' own bases pass (no check here has ranks)
    passes_quickly(check, answers, every_case)


@pytest.mark.parametrize("check, answers", OTHERS.values(), ids=list(OTHERS))
def test_another_correct_answer_passes_quickly(check, answers, every_case):
    passes_quickly(check, answers, every_case)


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
        check_tensorwise(lambda x, dtype, scale=None: (lambda q, s: (q, 2 * s))(
            *ref_quantize_tensorwise(x, dtype, scale)), ref_dequantize)
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

    class Unsolved(torch.autograd.Function):
        forward = staticmethod(unsolved)

    class UnsolvedScaler:
        def __init__(self, dtype, history_len, margin=0):
            raise NotImplementedError("DelayedScaler.__init__: write this part")

    for check, answers in [(check_tensorwise, (unsolved, ref_dequantize)),
                           (check_tensorwise, (ref_quantize_tensorwise, unsolved)),
                           (check_rowwise, (unsolved, ref_dequantize)), (check_float8_matmul, (unsolved,)),
                           (check_float8_linear, (Unsolved,)), (check_delayed_scaler, (UnsolvedScaler,))]:
        with pytest.raises(NotImplementedError):
            check(*answers)

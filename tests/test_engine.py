"""The check engine on a check of its own: where it says a difference lies, and which hint it gives.

The course's checks and their records test the engine too (tests/test_misconceptions.py); this one-process check
pins the rules: the first difference named inside nested values, lists of different lengths, a hint only for an
answer that makes a record's mistake (NaN included), none for another mistake."""

import dataclasses
import math

import pytest
import torch

from picotron_course import checks, engine
from picotron_course.engine import Check, Close, Exact, Misconception


def softmax_rows(x):
    return x.softmax(-1)


def without_max(x):             # overflows to NaN for large logits, as a learner's exp(x) / sum does
    return x.exp() / x.exp().sum(-1, keepdim=True)


def over_columns(x):
    return x.softmax(0)


def sums_to_two(x):
    return 2 * x.softmax(-1)


def _observe(answers, cases):
    return [[{"shape": list(answer(c["_x"]).shape), "rows": list(answer(c["_x"]))} for c in cases]
            for answer in answers]


def _logits(rows, cols, seed, offset=0.0, spread=1.0):
    return offset + spread * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


SOFTMAX = Check(
    "softmax", cases=[dict(logits="small", _x=_logits(3, 4, 0)), dict(logits="large", _x=_logits(2, 5, 1, 100, 100))],
    observe=_observe, expect=lambda case, got: {"shape": list(case["_x"].shape), "rows": list(case["_x"].softmax(-1))},
    quantities={"shape": Exact("the shape returned"), "rows": Close("each row's softmax", n=8, axes=("row {}",))},
    misconceptions=[Misconception(without_max, "subtract each row's max before exp: exp(100) overflows"),
                    Misconception(over_columns, "the softmax runs along the last dimension")])
engine.CHECKS.remove(SOFTMAX)   # not one of the course's: tests/test_misconceptions.py must not see it


def test_a_correct_answer_passes(capsys):
    SOFTMAX(softmax_rows)
    assert "2/2 cases passed" in capsys.readouterr().out


def test_the_same_nan_written_otherwise_gets_the_record_hint():
    def mine(x):                # no max either, but other code: the same NaN rows in the same case
        e = torch.exp(x)
        return e / torch.sum(e, dim=-1, keepdim=True)
    with pytest.raises(AssertionError, match=r"each row's softmax \(row 0\).*Hint: subtract each row's max"):
        SOFTMAX(mine)


def test_a_mistake_no_record_makes_gets_the_difference_and_no_hint():
    with pytest.raises(AssertionError) as error:
        SOFTMAX(sums_to_two)
    assert "each row's softmax (row 0)" in str(error.value) and "Hint" not in str(error.value)


def test_lists_of_different_lengths_name_the_first_missing_place():
    quantity = Exact("the order", axes=("position {}",))
    assert quantity.difference(["a", "b"], ["a", "b", "c"]) == "the order (position 2): expected c, got nothing"
    assert quantity.difference(["a", "b"], ["a", "b"]) == ""


def test_close_takes_roundings_per_case_from_the_expected_tensor():
    want, got = torch.tensor([1.0]), torch.tensor([1.0 + 1e-6])
    assert not Close("x", n=1).equal(got, want)
    assert Close("x", n=1).equal(got, engine.per_case(want.clone(), n=10**6))
    assert math.isinf(Close("x").error(None, want))


# ---- the one launcher of the checks that run on ranks ------------------------------------------------
def _summed(answer, case, group):
    import torch.distributed as dist
    t = torch.tensor([float(dist.get_rank() + 1)])
    answer(t, group)
    return {"sum": t.item(), "group size": dist.get_world_size(group)}


def _all_reduce(t, group):
    import torch.distributed as dist
    dist.all_reduce(t, group=group)


def _only_rank_0_waits(t, group):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        dist.recv(t, 1)


def test_observe_on_ranks_runs_each_case_in_its_group_and_merges_by_rank():
    observe = engine.observe_on_ranks(4, _summed, engine.world_and_halves, "tp")
    (got_tp4, got_tp2), = observe([_all_reduce], [{"tp": 4}, {"tp": 2}])
    assert got_tp4 == {"sum": [10.0] * 4, "group size": [4] * 4}
    assert got_tp2 == {"sum": [3.0, 3.0, 7.0, 7.0], "group size": [2] * 4}


def test_observe_on_ranks_names_a_deadlock(monkeypatch):
    quick = dataclasses.replace(engine.settings, check_timeout=5.0)
    monkeypatch.setattr(engine, "settings", quick)
    monkeypatch.setattr(checks, "settings", quick)   # the launcher's own timeout
    observe = engine.observe_on_ranks(2, _summed, lambda: {1: None}, "k",
                                      deadlock="it did not finish within {timeout:g} s: a receive no rank sends to.")
    with pytest.raises(AssertionError, match=r"^it did not finish within 5 s: a receive no rank sends to\. "):
        observe([_only_rank_0_waits], [{"k": 1}])

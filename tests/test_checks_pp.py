"""The checks of assignment 06 pass correct schedules and fail planted wrong ones, each with a message
that names the mistake.

The correct answers are written here, not taken from the solution notebook (which runs under nbval
on its own) nor from picotron.parallel.pipeline_schedules, which the checks refuse.
The structure checks run in this process (milliseconds); the training check launches 4 ranks, so it
runs only for the answers where that is the point: the right one, AFAB posing as 1F1B (right
gradients, too much memory), and two that must be refused before any rank starts.
"""

import time

import pytest

from picotron_course.checks_pp import (STRUCTURE_CASES, TRAIN_CASES, check_afab_actions, check_one_f_one_b_actions,
                                       check_one_f_one_b_training, show_timeline)
from picotron.parallel.pipeline_schedules import Action


# ---- correct answers ------------------------------------------------------------------------------
def ref_afab(rank, pp, m):
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def ref_afab_tuples(rank, pp, m):
    """Plain tuples are actions too."""
    return [(op, i, rank) for op in "FB" for i in range(m)]


def ref_afab_newest_first(rank, pp, m):
    """GPipe's backward from the newest micro-batch: the same on every rank, so the messages still match."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in reversed(range(m))]


def ref_1f1b(rank, pp, m):
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k, rank), Action("B", k, rank)]
    return actions + [Action("B", k, rank) for k in range(m - warmup, m)]


def ref_1f1b_queue(rank, pp, m):
    """The same order from a queue of micro-batches in flight: forward while fewer than p - r are held."""
    actions, in_flight, next_forward = [], [], 0
    while next_forward < m or in_flight:
        if next_forward < m and len(in_flight) < pp - rank:
            actions.append(Action("F", next_forward, rank))
            in_flight.append(next_forward)
            next_forward += 1
        else:
            actions.append(Action("B", in_flight.pop(0), rank))
    return actions


@pytest.mark.parametrize("check, answer", [(check_afab_actions, ref_afab), (check_afab_actions, ref_afab_tuples),
                                           (check_afab_actions, ref_afab_newest_first),
                                           (check_one_f_one_b_actions, ref_1f1b),
                                           (check_one_f_one_b_actions, ref_1f1b_queue)],
                         ids=["afab", "afab_tuples", "afab_newest_first", "1f1b", "1f1b_queue"])
def test_correct_structure_passes(check, answer, capsys):
    check(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and f"{len(STRUCTURE_CASES)}/{len(STRUCTURE_CASES)} cases passed" in out


def test_correct_training_passes(capsys):
    check_one_f_one_b_training(ref_1f1b)
    out = capsys.readouterr().out
    assert "FAIL" not in out and f"{len(TRAIN_CASES)}/{len(TRAIN_CASES)} cases passed" in out


def test_cases_cover_the_edges():
    """No pipeline (p = 1), one micro-batch, fewer micro-batches than stages, more, and uneven."""
    assert any(pp == 1 for pp, _ in STRUCTURE_CASES) and any(m == 1 and pp > 1 for pp, m in STRUCTURE_CASES)
    assert any(1 < m < pp for pp, m in STRUCTURE_CASES) and any(m > pp for pp, m in STRUCTURE_CASES)
    assert any(m % pp for pp, m in STRUCTURE_CASES if pp > 1 and m > pp)
    layouts = {tuple(sorted(layout.items())) for layout, _ in TRAIN_CASES}
    assert (("pp", 4),) in layouts and (("dp", 2), ("pp", 2)) in layouts
    assert any(m < layout["pp"] for layout, m in TRAIN_CASES) and any(m > layout["pp"] for layout, m in TRAIN_CASES)


# ---- planted wrong answers --------------------------------------------------------------------------
def warmup_one_too_many(rank, pp, m):
    """pp - rank warm-up forwards, not pp - rank - 1: right order, one micro-batch more in memory."""
    warmup = min(pp - rank, m)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k, rank), Action("B", k, rank)]
    return actions + [Action("B", k, rank) for k in range(m - warmup, m)]


def no_warmup(rank, pp, m):
    """F0 B0 F1 B1 ...: every micro-batch crosses the whole pipeline alone."""
    return [Action(op, i, rank) for i in range(m) for op in "FB"]


def warmup_counts_up(rank, pp, m):
    """rank warm-up forwards instead of pp - rank - 1: the last rank waits for a forward rank 0 never sends."""
    warmup = min(rank, m)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("F", warmup + k, rank), Action("B", k, rank)]
    return actions + [Action("B", k, rank) for k in range(m - warmup, m)]


def newest_backward_first(rank, pp, m):
    """In the steady state, the backward of the micro-batch just forwarded (a stack, not a queue)."""
    warmup = min(pp - rank - 1, m)
    actions, stack = [Action("F", i, rank) for i in range(warmup)], list(range(warmup))
    for k in range(warmup, m):
        actions += [Action("F", k, rank), Action("B", k, rank)]
    return actions + [Action("B", k, rank) for k in reversed(stack)]


def missing_last_backward(rank, pp, m):
    return ref_1f1b(rank, pp, m)[:-1]


def stage_counted_from_the_end(rank, pp, m):
    return [Action(op, i, pp - 1 - rank) for op, i, _ in ref_1f1b(rank, pp, m)]


def afab_on_stage_zero(rank, pp, m):
    return [Action(op, i, 0) for op, i, _ in ref_afab(rank, pp, m)]


def backward_before_forward(rank, pp, m):
    """The steady state as B then F: the last rank's first backward comes before any forward."""
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for k in range(m - warmup):
        actions += [Action("B", k, rank), Action("F", warmup + k, rank)]
    return actions + [Action("B", k, rank) for k in range(m - warmup, m)]


def returns_strings(rank, pp, m):
    return [f"{a.op}{a.microbatch}" for a in ref_1f1b(rank, pp, m)]


def calls_the_course_1f1b(rank, pp, m):
    from picotron.parallel.pipeline_schedules import one_f_one_b_schedule
    return one_f_one_b_schedule(pp, m).actions[rank]


def calls_make_schedule(rank, pp, m):
    import picotron.parallel.pipeline_schedules as pipeline
    return pipeline.make_schedule("afab", pp, m).actions[rank]


WRONG_STRUCTURE = [
    (check_one_f_one_b_actions, warmup_one_too_many, "warm-up of p - r - 1"),
    (check_one_f_one_b_actions, no_warmup, "warm-up of p - r - 1"),
    (check_one_f_one_b_actions, warmup_counts_up, "deadlocks"),
    (check_one_f_one_b_actions, ref_afab, "which is AFAB"),
    (check_one_f_one_b_actions, newest_backward_first, "same micro-batch order"),
    (check_one_f_one_b_actions, missing_last_backward, "missing B"),
    (check_one_f_one_b_actions, stage_counted_from_the_end, "holds stage"),
    (check_one_f_one_b_actions, backward_before_forward, "comes before F"),
    (check_one_f_one_b_actions, returns_strings, "Action"),
    (check_afab_actions, ref_1f1b, "AFAB all"),
    (check_afab_actions, no_warmup, "AFAB all"),
    (check_afab_actions, afab_on_stage_zero, "holds stage"),
]


@pytest.mark.parametrize("check, answer, says", WRONG_STRUCTURE,
                         ids=[f"{c.__name__.removeprefix('check_')}-{a.__name__}" for c, a, _ in WRONG_STRUCTURE])
def test_wrong_structure_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("check, answer, name", [(check_one_f_one_b_actions, calls_the_course_1f1b,
                                                  "one_f_one_b_schedule"),
                                                 (check_afab_actions, calls_make_schedule, "make_schedule"),
                                                 (check_one_f_one_b_training, calls_the_course_1f1b,
                                                  "one_f_one_b_schedule")],
                         ids=["1f1b", "afab_make_schedule", "training"])
def test_the_course_answer_is_refused(check, answer, name):
    with pytest.raises(AssertionError, match=f"{name}, the course's answer"):
        check(answer)


def test_afab_posing_as_1f1b_trains_right_but_fails_on_memory(capsys):
    with pytest.raises(AssertionError, match="that is AFAB"):
        check_one_f_one_b_training(ref_afab)
    out = capsys.readouterr().out
    assert "FAIL" in out and "loss" in out


@pytest.mark.parametrize("answer, says", [(warmup_counts_up, "deadlocks"), (missing_last_backward, "missing B")],
                         ids=["deadlock", "missing_backward"])
def test_training_refuses_a_broken_list_before_launching(answer, says, capsys):
    start = time.perf_counter()
    with pytest.raises(AssertionError, match=f"not run: .*{says}"):
        check_one_f_one_b_training(answer)
    assert time.perf_counter() - start < 10      # no rank waited for its timeout
    assert "FAIL" in capsys.readouterr().out


def test_unsolved_lets_not_implemented_through():
    def unsolved(rank, pp, m):
        raise NotImplementedError("one_f_one_b_actions: write this part")
    for check in (check_afab_actions, check_one_f_one_b_actions, check_one_f_one_b_training):
        with pytest.raises(NotImplementedError):
            check(unsolved)


def test_timeline_shows_the_warm_up(capsys):
    show_timeline(ref_1f1b, 4, 8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("rank 0: F0 F1 F2 F3 ..") and "peak 4, bubble 0.27" in lines[1]
    assert lines[4].startswith("rank 3: .. .. .. F0 B0 --") and "peak 1" in lines[4]
    with pytest.raises(ValueError, match="deadlocks"):
        show_timeline(warmup_counts_up, 4, 8)

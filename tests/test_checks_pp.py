"""The checks of assignment 06 pass correct schedules and refuse the course's own.

The correct answers are the checks' own correct schedules (checks_pp._afab, _one_f_one_b, _zb_h1, which the
misconceptions change and a learner may not submit), judged with the refusal off, and others written here, not taken
from the solution notebook (which runs under nbval on its own) nor from picotron.parallel.pipeline_schedules, which
the checks refuse. The wrong answers are the checks' misconceptions, each failing with its hint
(tests/test_misconceptions.py).
"""

import pytest

import picotron.parallel.pipeline_schedules as pipeline_schedules
from picotron_course import checks_pp
from picotron_course.checks_pp import (COURSE_SCHEDULES, STRUCTURE_CASES, TRAIN_CASES, check_afab_actions,
                                       check_one_f_one_b_actions, check_one_f_one_b_training, check_zb_h1_actions,
                                       show_timeline)
from picotron.parallel.pipeline_schedules import Action


# ---- correct answers: the checks' own bases, and others --------------------------------------------
def ref_afab_tuples(rank, pp, m):
    """Plain tuples are actions too."""
    return [(op, i, rank) for op in "FB" for i in range(m)]


def ref_1f1b(rank, pp, m, extra=0):
    warmup = min(pp - rank - 1 + extra, m)
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


def ref_zb_h1(rank, pp, m):
    """1F1B's F and B order; W of micro-batch k - rank right after B of k, the W's still owed at the end."""
    actions = []
    for a in ref_1f1b(rank, pp, m):
        actions.append(a)
        if a.op == "B" and a.microbatch >= rank:
            actions.append(Action("W", a.microbatch - rank, rank))
    return actions + [Action("W", k, rank) for k in range(max(m - rank, 0), m)]


def ref_zb_h1_pending(rank, pp, m):
    """The same from a memory budget, as plain tuples: after a B, run the oldest W while more than `rank`
    wait (rank r holds p - r micro-batches between F and B, so p in all)."""
    actions, pending = [], []
    for op, i, _ in ref_1f1b_queue(rank, pp, m):
        actions.append((op, i, rank))
        if op == "B":
            pending.append(i)
            if len(pending) > rank:
                actions.append(("W", pending.pop(0), rank))
    return actions + [("W", i, rank) for i in pending]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"afab_actions": 10, "one_f_one_b_actions": 10, "zb_h1_actions": 10, "one_f_one_b_actions on the executor": 3}


@pytest.mark.parametrize("check, answer", [(check_afab_actions, checks_pp._afab),
                                           (check_afab_actions, ref_afab_tuples),
                                           (check_one_f_one_b_actions, checks_pp._one_f_one_b),
                                           (check_one_f_one_b_actions, ref_1f1b),
                                           (check_one_f_one_b_actions, ref_1f1b_queue),
                                           (check_zb_h1_actions, checks_pp._zb_h1),
                                           (check_zb_h1_actions, ref_zb_h1), (check_zb_h1_actions, ref_zb_h1_pending),
                                           (check_one_f_one_b_training, ref_1f1b)],
                         ids=["afab_base", "afab_tuples", "1f1b_base", "1f1b", "1f1b_queue", "zb_h1_base", "zb_h1",
                              "zb_h1_pending", "training"])
def test_correct_answer_passes(check, answer, every_case, monkeypatch, refusing_nothing):
    """With the course's schedules broken: the checks judge with picotron's simulator (the exercise hands it to the
    learner), never with its schedules (what the exercise teaches). The refusal is off (the checks' own bases)."""
    def broken(*args, **kwargs):
        raise RuntimeError("the check called the course's schedules")
    for name in COURSE_SCHEDULES:
        monkeypatch.setattr(pipeline_schedules, name, broken)
    refusing_nothing(checks_pp)   # the checks' own schedules pass (the lists reach no rank)
    check(answer)
    every_case(CASES)


def test_cases_cover_the_edges():
    """No pipeline (p = 1), one micro-batch, fewer micro-batches than stages, more, and uneven."""
    assert any(pp == 1 for pp, _ in STRUCTURE_CASES) and any(m == 1 and pp > 1 for pp, m in STRUCTURE_CASES)
    assert any(1 < m < pp for pp, m in STRUCTURE_CASES) and any(m > pp for pp, m in STRUCTURE_CASES)
    assert any(m % pp for pp, m in STRUCTURE_CASES if pp > 1 and m > pp)
    layouts = {tuple(sorted(layout.items())) for layout, _ in TRAIN_CASES}
    assert (("pp", 4),) in layouts and (("dp", 2), ("pp", 2)) in layouts
    assert any(m < layout["pp"] for layout, m in TRAIN_CASES) and any(m > layout["pp"] for layout, m in TRAIN_CASES)


# ---- answers refused, and a mistake no misconception describes -------------------------------------------
# The planted wrong answers are the checks' misconceptions (checks_pp.py), tested in test_misconceptions.py.
def calls_the_course_1f1b(rank, pp, m):
    from picotron.parallel.pipeline_schedules import one_f_one_b_schedule
    return one_f_one_b_schedule(pp, m).actions[rank]


REFUSED = {"1f1b": (check_one_f_one_b_actions, calls_the_course_1f1b, "one_f_one_b_schedule, the course's answer"),
           "afab_make_schedule": (check_afab_actions, lambda r, pp, m: pipeline_schedules.make_schedule(
               "afab", pp, m).actions[r], "make_schedule, the course's answer"),
           "training": (check_one_f_one_b_training, calls_the_course_1f1b, "one_f_one_b_schedule, the course's answer"),
           "zb_h1": (check_zb_h1_actions, lambda r, pp, m: pipeline_schedules.zb_h1_schedule(pp, m).actions[r],
                     "zb_h1_schedule, the course's answer"),
           "1f1b_calls_the_checks_base": (check_one_f_one_b_actions, lambda r, pp, m: checks_pp._one_f_one_b(r, pp, m),
                                          "checks_pp._one_f_one_b, the course's answer"),
           "1f1b_the_checks_base": (check_one_f_one_b_actions, checks_pp._one_f_one_b, "comes from picotron_course"),
           "zb_h1_the_checks_base": (check_zb_h1_actions, checks_pp._zb_h1, "comes from picotron_course.checks_pp")}


@pytest.mark.parametrize("check, answer, says", REFUSED.values(), ids=REFUSED)
def test_the_course_answer_is_refused(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    """Two warm-up forwards too many: the peak says which way it is wrong, but no record makes this mistake."""
    with pytest.raises(AssertionError, match=r"\(rank 0\): expected 4, got 6: a warm-up longer") as error:
        check_one_f_one_b_actions(lambda rank, pp, m: ref_1f1b(rank, pp, m, extra=2))
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


@pytest.mark.parametrize("answer, says", [(checks_pp.WARMUP_UP.answer, "a deadlock"),
                                          (checks_pp.NO_LAST_B.answer, "'B7 missing'")],
                         ids=["deadlock", "missing_backward"])
def test_training_refuses_a_broken_list_before_launching(answer, says, monkeypatch, capsys):
    """Lists that would hang or crash the ranks never reach them (the misconceptions' own run may: it is not this)."""
    def launched(*args):
        raise RuntimeError("the check launched ranks")
    monkeypatch.setattr(checks_pp, "on_ranks", launched)
    with pytest.raises(AssertionError, match=says):
        check_one_f_one_b_training(answer)
    assert "FAIL" in capsys.readouterr().out


def test_unsolved_lets_not_implemented_through():
    def unsolved(rank, pp, m):
        raise NotImplementedError("one_f_one_b_actions: write this part")
    for check in (check_afab_actions, check_one_f_one_b_actions, check_one_f_one_b_training, check_zb_h1_actions):
        with pytest.raises(NotImplementedError):
            check(unsolved)


def test_timeline_shows_the_warm_up_and_the_held_back_w(capsys):
    show_timeline(ref_1f1b, 4, 8)
    show_timeline(ref_zb_h1, 4, 8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("rank 0: F0 F1 F2 F3 ..") and "peak 4, bubble 0.27" in lines[1]
    assert lines[4].startswith("rank 3: .. .. .. F0 B0 --") and "peak 1" in lines[4]
    assert "F, B and W take 1 each" in lines[5]
    assert lines[9].startswith("rank 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4") and "peak 4, bubble 0.11" in lines[9]
    with pytest.raises(ValueError, match="deadlock"):
        show_timeline(checks_pp.WARMUP_UP.answer, 4, 8)

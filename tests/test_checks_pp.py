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

import picotron.parallel.pipeline_schedules as pipeline_schedules
from picotron_course.checks_pp import (COURSE_SCHEDULES, STRUCTURE_CASES, TRAIN_CASES, check_afab_actions,
                                       check_one_f_one_b_actions, check_one_f_one_b_training, check_zb_h1_actions,
                                       show_timeline)
from picotron.parallel.pipeline_schedules import Action


# ---- correct answers ------------------------------------------------------------------------------
def ref_afab(rank, pp, m):
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in range(m)]


def ref_afab_tuples(rank, pp, m):
    """Plain tuples are actions too."""
    return [(op, i, rank) for op in "FB" for i in range(m)]


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


@pytest.mark.parametrize("check, answer", [(check_afab_actions, ref_afab), (check_afab_actions, ref_afab_tuples),
                                           (check_one_f_one_b_actions, ref_1f1b),
                                           (check_one_f_one_b_actions, ref_1f1b_queue),
                                           (check_zb_h1_actions, ref_zb_h1), (check_zb_h1_actions, ref_zb_h1_pending)],
                         ids=["afab", "afab_tuples", "1f1b", "1f1b_queue", "zb_h1", "zb_h1_pending"])
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


def afab_newest_first(rank, pp, m):
    """Backwards from the newest micro-batch on every rank: the messages still match, and it would train
    right, but the task asks for the backwards in the same order as the forwards."""
    return [Action("F", i, rank) for i in range(m)] + [Action("B", i, rank) for i in reversed(range(m))]


def afab_all_reversed(rank, pp, m):
    """Forwards and backwards both newest first, the same on every rank."""
    return [Action(op, i, rank) for op in "FB" for i in reversed(range(m))]


def zb_w_right_after_b(rank, pp, m):
    """1F1B with the backward cut in two and nothing moved: B's gradient leaves sooner, but the waits stay."""
    return [x for a in ref_1f1b(rank, pp, m) for x in ([a, Action("W", a.microbatch, rank)] if a.op == "B" else [a])]


def zb_all_w_at_the_end(rank, pp, m):
    """Every W after the last B: no bubble left to fill, but every micro-batch held until the end."""
    return ref_1f1b(rank, pp, m) + [Action("W", i, rank) for i in range(m)]


def zb_w_early_in_the_cool_down(rank, pp, m):
    """The lag of ref_zb_h1, plus a waiting W run before each cool-down B: it delays the B a neighbour
    waits for."""
    warmup, actions, pending = min(pp - rank - 1, m), [], []
    base = ref_1f1b(rank, pp, m)
    for k, a in enumerate(base):
        if a.op == "B" and k >= 2 * m - warmup and pending:      # the cool-down's B's
            actions.append(Action("W", pending.pop(0), rank))
        actions.append(a)
        if a.op == "B":
            pending.append(a.microbatch)
            if len(pending) > rank:
                actions.append(Action("W", pending.pop(0), rank))
    return actions + [Action("W", i, rank) for i in pending]


def zb_w_before_its_b(rank, pp, m):
    actions = ref_zb_h1(rank, pp, m)
    b, w = actions.index(Action("B", 0, rank)), actions.index(Action("W", 0, rank))
    actions[b], actions[w] = actions[w], actions[b]
    return actions


def zb_without_w(rank, pp, m):
    return ref_1f1b(rank, pp, m)


def calls_the_course_zb_h1(rank, pp, m):
    return pipeline_schedules.zb_h1_schedule(pp, m).actions[rank]


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
    (check_afab_actions, afab_newest_first, r"backwards in the order \[7, 6, .*same order as the forwards"),
    (check_afab_actions, afab_all_reversed, r"forwards in the order \[7, 6"),
    (check_zb_h1_actions, zb_w_right_after_b, "Every W runs right after its B"),
    (check_zb_h1_actions, zb_all_w_at_the_end, "more than p = 4"),
    (check_zb_h1_actions, zb_w_early_in_the_cool_down, r"ZB-H1 takes m\(F\+B\+W\) \+ \(p-1\)\(F\+B-W\) = 27"),
    (check_zb_h1_actions, zb_w_before_its_b, "W0 comes before B0"),
    (check_zb_h1_actions, zb_without_w, "missing W"),
    (check_zb_h1_actions, ref_1f1b_queue, "missing W"),
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
                                                  "one_f_one_b_schedule"),
                                                 (check_zb_h1_actions, calls_the_course_zb_h1, "zb_h1_schedule")],
                         ids=["1f1b", "afab_make_schedule", "training", "zb_h1"])
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
    for check in (check_afab_actions, check_one_f_one_b_actions, check_one_f_one_b_training, check_zb_h1_actions):
        with pytest.raises(NotImplementedError):
            check(unsolved)


def test_timeline_shows_the_warm_up(capsys):
    show_timeline(ref_1f1b, 4, 8)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("rank 0: F0 F1 F2 F3 ..") and "peak 4, bubble 0.27" in lines[1]
    assert lines[4].startswith("rank 3: .. .. .. F0 B0 --") and "peak 1" in lines[4]
    with pytest.raises(ValueError, match="deadlocks"):
        show_timeline(warmup_counts_up, 4, 8)


def test_zb_h1_timeline_shows_the_held_back_w(capsys):
    show_timeline(ref_zb_h1, 4, 8)
    lines = capsys.readouterr().out.splitlines()
    assert "F, B and W take 1 each" in lines[0]
    assert lines[4].startswith("rank 3: .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4") and "peak 4, bubble 0.11" in lines[4]


@pytest.mark.parametrize("check, answer", [(check_afab_actions, ref_afab), (check_one_f_one_b_actions, ref_1f1b),
                                           (check_zb_h1_actions, ref_zb_h1)], ids=["afab", "1f1b", "zb_h1"])
def test_structure_checks_need_nothing_of_the_course_module(check, answer, monkeypatch, capsys):
    """The checks judge with their own simulation: with the course's schedules and simulator broken,
    a right answer still passes (so the checks are no copy of picotron's answer)."""
    def broken(*args, **kwargs):
        raise RuntimeError("the check called the course's pipeline_schedules")
    for name in (*COURSE_SCHEDULES, "simulate", "check_schedule", "peak_in_flight", "bubble_fraction",
                 "bubble_formula"):
        monkeypatch.setattr(pipeline_schedules, name, broken)
    check(answer)
    assert "FAIL" not in capsys.readouterr().out

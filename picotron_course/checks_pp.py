"""The checks of assignment 06: pipeline schedules written as lists of actions, one list per rank.

The learner writes `afab_actions(rank, pp, m)` and `one_f_one_b_actions(rank, pp, m)`: the order in
which pp rank `rank` runs the forward ("F") and backward ("B") of m micro-batches on its stage, as
`Action(op, microbatch, stage)` items; and, as a stretch, `zb_h1_actions(rank, pp, m)`, whose backward
is split into B (the input's gradient) and W (the weights' gradient). The checks call them here, in the
parent, for every rank of several (pp, m), and judge the lists with their own arithmetic: nothing here
calls a schedule of picotron.parallel.pipeline_schedules, and a learner's function that does is refused.

    check_afab_actions(afab_actions)            complete, right stages, no deadlock; forwards and backwards
                                                both in micro-batch order 0, 1, ..., m-1 (as the task says);
                                                every forward before the first backward (peak m); bubble
                                                (p-1)/(m+p-1), exactly
    check_one_f_one_b_actions(fn)               the same, with at most min(p - r, m) micro-batches in flight on
                                                rank r, and the same bubble
    check_one_f_one_b_training(fn)              the lists through the executor on 4 ranks (pp=4, and dp=2 x pp=2):
                                                a few AdamW steps, losses, gradients and weights equal to one
                                                process training a plain Llama on the whole batch; peak in flight
                                                measured by the executor
    check_zb_h1_actions(fn)                     stretch: F, B and W of every micro-batch once, each W after its B,
                                                no deadlock; at most p micro-batches held on a rank (from F until
                                                W); with F = B = W = 1 the step of ZB-H1, m(F+B+W) + (p-1)(F+B-W),
                                                when m >= p, and no longer than 1F1B's when m < p

The structure checks simulate the lists with unit costs (F = 1, B = 2: a backward does twice a
forward's matmuls; F = B = W = 1 once the backward is split) in integers, so the bubble, idle / total
per rank, is compared with the formula as an exact fraction. The same simulation finds a deadlock
without running any rank, and the run check refuses a list that would deadlock before it launches
one: it fails, never hangs.

Point-to-point messages carry no tag: between two ranks they match in the order they are posted.
So rank r must run its forwards in the order rank r + 1 runs its own (activations go r -> r + 1),
and rank r + 1 its backwards in the order rank r runs its own (gradients go r + 1 -> r). A list that
breaks this would not hang: rank r + 1 would silently compute on another micro-batch's activations.
The checks look for it explicitly.
"""

from __future__ import annotations

from contextlib import contextmanager
from fractions import Fraction
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from picotron import tolerance
from picotron.config import ModelConfig
from picotron_course.checks import (Report, close_in_training, max_abs_error, mismatch, on_ranks, one_thread,
                                    watch_calls)
from picotron.model import Llama, loss_fn

__all__ = ["check_afab_actions", "check_one_f_one_b_actions", "check_one_f_one_b_training", "check_zb_h1_actions",
           "show_timeline", "STRUCTURE_CASES", "TRAIN_CASES", "WORLD"]

PACKAGE = "picotron.parallel.pipeline_schedules"
# The schedule builders of the course's module: the answers, which the learner's functions may not call.
COURSE_SCHEDULES = ("naive_schedule", "afab_schedule", "one_f_one_b_schedule", "interleaved_schedule",
                    "zb_h1_schedule", "make_schedule")
COST = {"F": 1, "B": 2}           # time units of a forward and a backward in the simulated timeline
# With the backward split (ZB-H1): B, the input's gradient, and W, the weights', each about a forward's
# matmuls, so B + W is the whole backward above (Qi et al. 2023, arXiv:2401.10241, take F = B = W).
SPLIT_COST = {"F": 1, "B": 1, "W": 1}
# (pp, m): m > p first (the case a failure message shows), m = p, m < p, m = 1, m not a multiple of p,
# no pipeline at all.
STRUCTURE_CASES = [(4, 8), (4, 4), (4, 2), (4, 1), (2, 5), (2, 1), (3, 7), (5, 3), (6, 9), (1, 3)]

WORLD = 4
# (layout, micro-batches): pp=4 with a steady state and with m < p; pp=2 beside dp=2.
TRAIN_CASES = [({"pp": 4}, 8), ({"pp": 4}, 2), ({"dp": 2, "pp": 2}, 4)]
TRAIN_STEPS, LR, BATCH, SEQ = 3, 1e-2, 8, 8       # BATCH: the global batch, over the dp ranks
CHECK_MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, max_seq_len=SEQ)


# ---- the learner's lists -------------------------------------------------------------------------
@contextmanager
def _course_schedules_watched() -> Iterator[list[str]]:
    """Inside the block, note every call of one of the course's schedule builders, however it was
    imported (the profiler sees the function's code, not the name it was called by)."""
    import picotron.parallel.pipeline_schedules as module

    codes = {getattr(module, name).__code__: name for name in COURSE_SCHEDULES if hasattr(module, name)}
    with watch_calls(lambda frame: codes.get(frame.f_code)) as called:
        yield called


def _lists(fn: Callable, pp: int, m: int) -> list:
    """fn(rank, pp, m) for every rank; AssertionError if it used the course's own schedule."""
    with _course_schedules_watched() as called:
        lists = [fn(rank, pp, m) for rank in range(pp)]
    if called:
        raise AssertionError(f"{fn.__name__} called {PACKAGE}.{called[0]}, the course's answer: build the list "
                             f"of Actions yourself")
    return lists


def _as_actions(lists: list, m: int, ops: str = "FB") -> tuple[list, str]:
    """The lists as (op, microbatch, stage) tuples, or a message saying what is not an action."""
    out = []
    for rank, actions in enumerate(lists):
        if not isinstance(actions, (list, tuple)):
            return [], f"rank {rank}: got {type(actions).__name__}; return a list of Action(op, microbatch, stage)"
        mine = []
        for k, a in enumerate(actions):
            if not (isinstance(a, tuple) and len(a) == 3):
                return [], (f"rank {rank}: item {k} is {a!r}; each item is Action(op, microbatch, stage), "
                            f"e.g. Action('F', 0, {rank})")
            op, i, s = a
            if op not in tuple(ops):
                return [], (f"rank {rank}: item {k} has op {op!r}; this schedule has only "
                            + " and ".join(repr(o) for o in ops))
            if not (isinstance(i, int) and isinstance(s, int)):
                return [], f"rank {rank}: item {k} is {a!r}; micro-batch and stage are ints"
            if not 0 <= i < m:
                return [], f"rank {rank}: {_name(a)} but m={m}: micro-batches are numbered 0..{m - 1}"
            mine.append((op, i, s))
        out.append(mine)
    return out, ""


def _name(a: tuple) -> str:
    return f"{a[0]}{a[1]}@{a[2]}"


# ---- structure: what every valid schedule must satisfy --------------------------------------------
def _structure_problem(lists: list, pp: int, m: int, ops: str = "FB") -> str:
    """'' when the lists can run on the executor: complete, on the right stages, each backward after
    its forward (and each W after its B), messages in matching order, no deadlock; else what is
    wrong, with a hint. ops: "FB", or "FBW" for a split backward."""
    for rank, actions in enumerate(lists):
        wrong = [a for a in actions if a[2] != rank]
        if wrong:
            return (f"rank {rank}: {_name(wrong[0])} runs stage {wrong[0][2]}; with one stage per rank, rank {rank} "
                    f"holds stage {rank} and all its actions use stage={rank}")
        for op in ops:
            counts = [sum(1 for a in actions if a[:2] == (op, i)) for i in range(m)]
            missing = [i for i, n in enumerate(counts) if n == 0]
            twice = [i for i, n in enumerate(counts) if n > 1]
            if missing or twice:
                what = {"F": "forward", "B": "backward", "W": "weight gradient"}[op]
                return (f"rank {rank}: every micro-batch needs exactly one {what} ({op}); "
                        + (f"missing {op} of micro-batches {missing}" if missing else
                           f"micro-batches {twice} have more than one {op}"))
        where = {a[:2]: k for k, a in enumerate(actions)}
        early = [i for i in range(m) if where[("B", i)] < where[("F", i)]]
        if early:
            return (f"rank {rank}: B{early[0]} comes before F{early[0]}; a backward needs the activations its "
                    f"forward saved")
        early = [i for i in range(m) if "W" in ops and where[("W", i)] < where[("B", i)]]
        if early:
            return (f"rank {rank}: W{early[0]} comes before B{early[0]}; the weights' gradient needs the output "
                    f"gradient that B received")
    for rank in range(pp - 1):
        for op, sender, receiver, what in (("F", rank, rank + 1, "activations"), ("B", rank + 1, rank, "gradients")):
            sent, received = _order(lists[sender], op), _order(lists[receiver], op)
            if sent != received:
                return (f"rank {sender} sends {what} to rank {receiver} in the order {_short(sent)} but rank "
                        f"{receiver} runs its {op}s in the order {_short(received)}. Messages between two ranks "
                        f"carry no tag and match in the order they are posted: rank {receiver} would compute on "
                        f"another micro-batch's {what}. Run the {op}s in the same micro-batch order on every rank "
                        f"(oldest first)")
    _, stuck = _simulate(lists, pp, SPLIT_COST if "W" in ops else COST)
    if stuck:
        return (f"the schedule deadlocks: {stuck}. Each of these ranks waits for something the other does only "
                f"later. A rank must not wait for a gradient before it has sent the forwards that the ranks "
                f"after it need first: the warm-up shrinks with the rank (rank 0 the most forwards, the last "
                f"rank none)")
    return ""


def _order(actions: list, op: str) -> list[int]:
    return [i for o, i, _ in actions if o == op]


def _short(order: list[int]) -> str:
    return str(order) if len(order) <= 8 else f"[{', '.join(map(str, order[:8]))}, ...]"


def _needs(action: tuple, pp: int) -> list[tuple]:
    """What an action waits for: its input from the previous stage (F), its forward and the output
    gradient from the next stage (B), its own B (W)."""
    op, i, s = action
    if op == "F":
        return [("F", i, s - 1)] if s > 0 else []
    if op == "W":
        return [("B", i, s)]
    return [("F", i, s)] + ([("B", i, s + 1)] if s < pp - 1 else [])


def _simulate(lists: list, pp: int, cost: dict = COST) -> tuple[list[list[tuple[int, int]]], str]:
    """Each rank runs its list in order; an action starts when the rank is free and what it needs is
    done (messages take no time); `cost` gives each op's time. Returns (start, end) of every action per
    rank, and '' or a description of a deadlock."""
    done: dict[tuple, int] = {}
    free, position = [0] * pp, [0] * pp
    spans: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    while any(position[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(lists[r]):
                action = lists[r][position[r]]
                needs = _needs(action, pp)
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = done[action] = start + cost[action[0]]
                spans[r].append((start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            waits = []
            for r in range(pp):
                if position[r] < len(lists[r]):
                    action = lists[r][position[r]]
                    need = next(n for n in _needs(action, pp) if n not in done)
                    what = (f"micro-batch {need[1]}'s activation from rank {r - 1}" if need[0] == "F" else
                            f"its own B{need[1]}" if need[2] == r else
                            f"micro-batch {need[1]}'s gradient from rank {r + 1}")
                    waits.append(f"rank {r} waits at {_name(action)} for {what}")
            return spans, "; ".join(waits)
    return spans, ""


def _bubbles(spans: list) -> list[Fraction]:
    """Idle / total per rank, total being the whole step (first start to last end on any rank)."""
    end = max(e for rank in spans for _, e in rank)
    return [Fraction(end - sum(e - s for s, e in rank), end) for rank in spans]


def _peaks(lists: list) -> list[int]:
    """Per rank, the most micro-batches whose activations are held at once: from F until its B, or
    until its W when the backward is split (W still needs the layers' inputs)."""
    frees = "W" if any(a[0] == "W" for actions in lists for a in actions) else "B"
    peaks = []
    for actions in lists:
        alive = peak = 0
        for op, _, _ in actions:
            alive += (op == "F") - (op == frees)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def _forwards_first(lists: list) -> list[int]:
    """Per rank, the forwards before its first backward."""
    return [next((k for k, a in enumerate(actions) if a[0] == "B"), len(actions)) for actions in lists]


def bubble_of(pp: int, m: int) -> Fraction:
    """(p-1)/(m+p-1): the idle fraction of AFAB and 1F1B (Playbook, "Pipeline Parallelism")."""
    return Fraction(pp - 1, m + pp - 1)


def _fraction(x: Fraction | None) -> str:
    return "-" if x is None else f"{x.numerator}/{x.denominator} = {float(x):.3f}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "es" if noun.endswith("h") else "s")


def _per_rank(values: list | None) -> str:
    return "-" if values is None else ",".join(map(str, values))


# ---- 1. AFAB ----------------------------------------------------------------------------------------
def check_afab_actions(afab_actions: Callable[[int, int, int], list]) -> None:
    """All forwards, then all backwards (GPipe): complete, on stage `rank`, deadlock-free; forwards and
    backwards both in micro-batch order 0, 1, ..., m-1, as the task says; every rank holds all m
    micro-batches at its peak; simulated bubble (p-1)/(m+p-1), exactly."""
    _check_structure(afab_actions, "afab_actions", afab=True)


# ---- 2. 1F1B ----------------------------------------------------------------------------------------
def check_one_f_one_b_actions(one_f_one_b_actions: Callable[[int, int, int], list]) -> None:
    """1F1B: complete, on stage `rank`, deadlock-free; rank r holds at most min(p - r, m) micro-batches
    (its warm-up has min(p - r - 1, m) forwards); simulated bubble (p-1)/(m+p-1), exactly."""
    _check_structure(one_f_one_b_actions, "one_f_one_b_actions", afab=False)


def _check_structure(fn: Callable, title: str, afab: bool) -> None:
    note = (f"each rank's list from {title}(rank, pp, m), simulated with F = {COST['F']}, B = {COST['B']} time "
            f"units; peak = most micro-batches between their F and B on a rank; bubble = idle / total, the same "
            f"on every rank; want: (p-1)/(m+p-1)")
    cases = [(pp, m, _lists(fn, pp, m)) for pp, m in STRUCTURE_CASES]
    with Report(title, note=note) as report:
        for pp, m, raw in cases:
            want_peak = [m if afab else min(pp - r, m) for r in range(pp)]
            want_bubble = bubble_of(pp, m)
            lists, detail = _as_actions(raw, m)
            detail = detail or _structure_problem(lists, pp, m)
            peak = bubble = None
            if not detail and afab:
                detail = _afab_order_problem(lists, m)
            if not detail:
                peak = _peaks(lists)
                spans, _ = _simulate(lists, pp)
                bubbles = _bubbles(spans)
                bubble = max(bubbles)
                detail = (_peak_problem(pp, m, peak, want_peak, _forwards_first(lists), afab)
                          or _bubble_problem(bubbles, want_bubble))
            report.add(not detail, detail, pp=pp, m=m,
                       **{"peak (want)": _per_rank(want_peak), "peak (got)": _per_rank(peak),
                          "bubble (want)": _fraction(want_bubble), "bubble (got)": _fraction(bubble)})


def _afab_order_problem(lists: list, m: int) -> str:
    """'' when every rank runs its forwards, and then its backwards, in micro-batch order 0, 1, ..., m-1.

    The task asks for this order, and picotron's afab schedule and torch's ScheduleGPipe both run it.
    Newest-first backwards on every rank would also train right (the message orders would still
    match), but they are not what the task asks for."""
    for rank, actions in enumerate(lists):
        for op, what in (("F", "forwards"), ("B", "backwards")):
            order = _order(actions, op)
            if order != list(range(m)):
                return (f"rank {rank} runs its {what} in the order {_short(order)}; the task asks for "
                        f"{_short(list(range(m)))}: the forwards of micro-batches 0, 1, ... in turn, then their "
                        f"backwards in the same order as the forwards (oldest first)")
    return ""


def _peak_problem(pp: int, m: int, peak: list, want_peak: list, first_b: list, afab: bool) -> str:
    """first_b: per rank, the forwards before its first backward (1F1B: the p - r - 1 warm-up forwards
    and the first forward of the steady state)."""
    for r in range(pp):
        if peak[r] == want_peak[r]:
            continue
        got = f"rank {r} holds the activations of up to {_count(peak[r], 'micro-batch')} at once"
        if afab:
            return (f"{got}, AFAB all {m}: run every forward before the first backward (rank {r} runs "
                    f"{_count(first_b[r], 'forward')} before its first B)")
        if peak[r] > want_peak[r] and first_b[r] == m:
            return (f"{got}, 1F1B at most min(p - r, m) = {want_peak[r]}: every forward comes before the first "
                    f"backward, which is AFAB. Start the backwards after a warm-up of min(p - r - 1, m) = "
                    f"{min(pp - r - 1, m)} forwards")
        if peak[r] > want_peak[r] and first_b[r] > want_peak[r]:
            return (f"{got}, 1F1B at most min(p - r, m) = {want_peak[r]}: it runs {_count(first_b[r], 'forward')} "
                    f"before its first backward. A warm-up of p - r - 1 = {_count(pp - r - 1, 'forward')}, then F "
                    f"and B in turn, is enough: the first gradient comes back just as the warm-up is done, and "
                    f"one more forward only costs memory")
        if peak[r] > want_peak[r]:
            return (f"{got}, 1F1B at most min(p - r, m) = {want_peak[r]}: after the warm-up, alternate one "
                    f"forward and one backward (the backward of the oldest micro-batch in flight)")
        return (f"{got}, fewer than min(p - r, m) = {want_peak[r]}: it runs {_count(first_b[r], 'forward')} before "
                f"its first backward. Without a warm-up of p - r - 1 = {_count(pp - r - 1, 'forward')} it waits "
                f"for gradients while it could be running forwards, and the bubble grows")
    return ""


def _bubble_problem(bubbles: list, want: Fraction) -> str:
    for r, got in enumerate(bubbles):
        if got != want:
            return (f"rank {r} idles {_fraction(got)} of the step, not (p-1)/(m+p-1) = {_fraction(want)}: "
                    f"its actions wait for one another longer than the pipeline's fill and drain")
    return ""


# ---- 4. stretch: ZB-H1, the backward split into B and W ------------------------------------------------
def zb_h1_step(pp: int, m: int) -> int:
    """ZB-H1's step in time units of SPLIT_COST: m(F+B+W) of work plus (p-1)(F+B-W) idle on every rank
    (Qi et al. 2023, arXiv:2401.10241, section 3; needs m >= p and W <= min(F, B))."""
    f, b, w = SPLIT_COST["F"], SPLIT_COST["B"], SPLIT_COST["W"]
    return m * (f + b + w) + (pp - 1) * (f + b - w)


def one_f_one_b_step(pp: int, m: int) -> int:
    """1F1B's step in time units of SPLIT_COST, its backward B + W in one piece: (m+p-1)(F+B+W)."""
    return (m + pp - 1) * sum(SPLIT_COST.values())


def check_zb_h1_actions(zb_h1_actions: Callable[[int, int, int], list]) -> None:
    """Stretch. ZB-H1: every micro-batch's F, B and W once on stage `rank`, each W after its B, messages
    in matching order, deadlock-free; at most p micro-batches held on a rank (from F until W); with
    F = B = W = 1, a step of m(F+B+W) + (p-1)(F+B-W) when m >= p, and no longer than 1F1B's
    (m+p-1)(F+B+W) when m < p (where ZB-H1's formula does not apply)."""
    note = (f"each rank's list from zb_h1_actions(rank, pp, m), simulated with F = B = W = 1 time unit "
            f"(B: the input's gradient, W: the weights'); peak = most micro-batches between their F and their W on "
            f"a rank, want <= p; step = the simulated step's length, want m(F+B+W) + (p-1)(F+B-W) (ZB-H1) when "
            f"m >= p, at most 1F1B's (m+p-1)(F+B+W) when m < p")
    cases = [(pp, m, _lists(zb_h1_actions, pp, m)) for pp, m in STRUCTURE_CASES]
    with Report("zb_h1_actions", note=note) as report:
        for pp, m, raw in cases:
            full = m >= pp
            want_step = zb_h1_step(pp, m) if full else one_f_one_b_step(pp, m)
            lists, detail = _as_actions(raw, m, ops="FBW")
            detail = detail or _structure_problem(lists, pp, m, ops="FBW")
            peak = step = None
            if not detail:
                peak = _peaks(lists)
                spans, _ = _simulate(lists, pp, SPLIT_COST)
                step = max(e for rank in spans for _, e in rank)
                detail = _zb_peak_problem(pp, peak) or _zb_step_problem(lists, pp, m, step, want_step, full)
            report.add(not detail, detail, pp=pp, m=m, **{"peak (want)": f"<= {pp}", "peak (got)": _per_rank(peak),
                                                          "step (want)": f"{'' if full else '<= '}{want_step}",
                                                          "step (got)": "-" if step is None else step,
                                                          "bubble (got)": "-" if step is None else
                                                          _fraction(Fraction(step - m * sum(SPLIT_COST.values()),
                                                                             step))})


def _zb_peak_problem(pp: int, peak: list) -> str:
    for r, held in enumerate(peak):
        if held > pp:
            return (f"rank {r} holds up to {_count(held, 'micro-batch')} between F and W, more than p = {pp}: a "
                    f"micro-batch's activations stay until its W has run. In 1F1B's steady state rank {r} holds "
                    f"p - r = {pp - r} between F and B; that leaves room for only a few W's waiting. Run each W "
                    f"sooner")
    return ""


def _zb_step_problem(lists: list, pp: int, m: int, step: int, want: int, full: bool) -> str:
    if step <= want:
        return ""
    if not full:
        return (f"the step takes {step} time units, longer than 1F1B's (m+p-1)(F+B+W) = {want}: with fewer "
                f"micro-batches than stages, splitting the backward should still never make the step longer")
    if all(a[0] != "B" or actions[k + 1:k + 2] == [("W", a[1], a[2])]
           for actions in lists for k, a in enumerate(actions)):
        return (f"the step takes {step} time units; ZB-H1 takes m(F+B+W) + (p-1)(F+B-W) = {want}. Every W runs right "
                f"after its B: the gradient leaves a little sooner than in 1F1B, but the ranks still wait where 1F1B "
                f"waits. Hold W's back, to fill the time a rank would otherwise spend waiting for a gradient")
    return (f"the step takes {step} time units; ZB-H1 takes m(F+B+W) + (p-1)(F+B-W) = {want}. Somewhere a rank "
            f"runs a W while a neighbour waits for its B or F, or waits while a W could run: "
            f"`show_timeline(zb_h1_actions, {pp}, {m})` shows where")


# ---- the timeline, for the notebook -------------------------------------------------------------------
def show_timeline(fn: Callable[[int, int, int], list], pp: int, m: int) -> None:
    """Print the simulated timeline of fn's lists (F = 1 time unit, B = 2; F = B = W = 1 when the lists
    split the backward into B and W), each rank's peak and bubble."""
    raw = _lists(fn, pp, m)
    split = any(isinstance(a, tuple) and len(a) == 3 and a[0] == "W"
                for actions in raw if isinstance(actions, (list, tuple)) for a in actions)
    ops, cost = ("FBW", SPLIT_COST) if split else ("FB", COST)
    lists, problem = _as_actions(raw, m, ops)
    problem = problem or _structure_problem(lists, pp, m, ops)
    if problem:
        raise ValueError(problem)
    spans, _ = _simulate(lists, pp, cost)
    end = max(e for rank in spans for _, e in rank)
    width = len(str(m - 1)) + 1
    costs = "F, B and W take 1 each" if split else "F takes 1, B takes 2"
    print(f"{fn.__name__}, pp={pp}, m={m}: one column per time unit ({costs}; '.' idle)")
    for r, (actions, rank_spans, peak, bubble) in enumerate(zip(lists, spans, _peaks(lists), _bubbles(spans))):
        cells = ["." * width] * end
        for (op, i, _), (start, stop) in zip(actions, rank_spans):
            cells[start] = f"{op}{i}".ljust(width)
            for t in range(start + 1, stop):
                cells[t] = "-" * width
        print(f"rank {r}: {' '.join(cells)}   peak {peak}, bubble {float(bubble):.2f}")


# ---- 3. through the executor, on 4 ranks ----------------------------------------------------------------
def check_one_f_one_b_training(one_f_one_b_actions: Callable[[int, int, int], list]) -> None:
    """The lists run by picotron's executor on 4 ranks, as pp=4 and as dp=2 x pp=2: TRAIN_STEPS AdamW
    steps whose losses and gradients equal one process's (1e-5) and final weights too (1e-4); rank r
    of the pipeline holds at most min(p - r, m) micro-batches, as the executor measures it."""
    note = (f"{WORLD} ranks, {TRAIN_STEPS} AdamW steps of a {CHECK_MODEL.num_layers}-layer Llama, global batch "
            f"{BATCH} x {SEQ} tokens cut into m micro-batches; compared with one process training the whole "
            f"batch. The lists are checked here first: one that would deadlock is refused, not run")
    plans = []
    for layout, m in TRAIN_CASES:
        lists, problem = _as_actions(_lists(one_f_one_b_actions, layout["pp"], m), m)
        plans.append((layout, m, None if problem else lists, problem or _structure_problem(lists, layout["pp"], m)))
    with Report("one_f_one_b_actions on the executor", note=note) as report:
        runnable = [(layout, m, lists if not problem else None) for layout, m, lists, problem in plans]
        results = on_ranks(_train_on_rank, WORLD, runnable) if any(l for _, _, l in runnable) else None
        with one_thread():
            reference = _train_one_process()
        for c, (layout, m, lists, problem) in enumerate(plans):
            pp, dp = layout["pp"], layout.get("dp", 1)
            want_peak = [min(pp - r, m) for r in range(pp)]
            columns = {"layout": " x ".join(f"{k}={v}" for k, v in layout.items()), "m": m,
                       "peak (want)": _per_rank(want_peak)}
            if problem:
                report.add(False, f"not run: {problem}", **columns, **{"peak (got)": "-"})
                continue
            per_rank = [r[c] for r in results]
            detail, errors, peak = _training_problem(per_rank, reference, pp, dp, m, want_peak)
            report.add(not detail, detail, **columns, **{"peak (got)": _per_rank(peak)},
                       **{"loss (want)": f"{reference['loss'][-1]:.6f}", "loss (got)": f"{errors['last loss']:.6f}"},
                       max_err_loss=errors["loss"], max_err_grad=errors["grad"], max_err_weight=errors["weight"])


def _training_problem(per_rank: list, reference: dict, pp: int, dp: int, m: int, want_peak: list):
    """Compare the ranks' losses, gradients and weights with the reference; ('' or the first problem,
    the largest errors, the peak per pp rank)."""
    last = [r for r in per_rank if r["pp_rank"] == pp - 1]
    losses = [sum(r["loss"][step] for r in last) / dp for step in range(TRAIN_STEPS)]
    errors = {"loss": max(abs(a - b) for a, b in zip(losses, reference["loss"])), "last loss": losses[-1],
              "grad": max(max_abs_error(g, reference["grads"][step][name])
                          for r in per_rank for step, grads in enumerate(r["grads"]) for name, g in grads.items()),
              "weight": max(max_abs_error(w, reference["weights"][name])
                            for r in per_rank for name, w in r["weights"].items())}
    peak = [max(r["peak"] for r in per_rank if r["pp_rank"] == p) for p in range(pp)]
    detail = ""
    for step in range(TRAIN_STEPS):
        if abs(losses[step] - reference["loss"][step]) > tolerance.LOSS_ATOL:   # fp32 losses: 1e-5
            detail = (f"step {step}: loss {losses[step]:.6f}, one process {reference['loss'][step]:.6f}: the schedule "
                      f"ran, but on the wrong data")
            break
    for rank, r in enumerate(per_rank):
        if detail:
            break
        for step, grads in enumerate(r["grads"]):
            bad = [name for name, g in grads.items() if not close_in_training(g, reference["grads"][step][name])]
            if bad:
                detail = (f"rank {rank} (pp rank {r['pp_rank']}), step {step}: the gradient of {bad[0]} differs from "
                          f"one process's: {mismatch(grads[bad[0]], reference['grads'][step][bad[0]])}")
                break
    if not detail and errors["weight"] > tolerance.ADAM_WEIGHTS_ATOL:   # Adam amplifies round-off: 1e-4
        detail = f"the final weights differ from one process's by {errors['weight']:.2e} (> 1e-4)"
    if not detail and peak != want_peak:
        r = next(i for i in range(pp) if peak[i] != want_peak[i])
        if peak[r] < want_peak[r]:
            why = "fewer than p - r: the warm-up is too short, and the pipeline runs dry"
        elif peak[r] == m:
            why = "the gradients are right, but every forward runs before the first backward: that is AFAB"
        else:
            why = "more than p - r: the gradients are right, but the warm-up is too long"
        detail = (f"pp rank {r} held the activations of {_count(peak[r], 'micro-batch')} at once (the executor's "
                  f"count), {why}; 1F1B holds min(p - r, m) = {want_peak[r]}")
    return detail, errors, peak


def _tokens(step: int) -> torch.Tensor:
    """(BATCH, SEQ + 1) tokens of one step's global batch; the parent and every rank make the same."""
    generator = torch.Generator().manual_seed(7919 * step + 11)
    return torch.randint(0, CHECK_MODEL.vocab_size, (BATCH, SEQ + 1), generator=generator)


def _model() -> Llama:
    with torch.random.fork_rng(devices=[]):      # leave the caller's random state alone
        torch.manual_seed(0)
        return Llama(CHECK_MODEL)


def _train_one_process() -> dict:
    """Plain torch: the whole global batch, one forward and one backward per step, AdamW."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"loss": [], "grads": []}
    for step in range(TRAIN_STEPS):
        tokens = _tokens(step)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _train_on_rank(cases: list) -> list:
    """Every case on this rank: build the stages, run the learner's lists TRAIN_STEPS times."""
    from picotron.mesh import Mesh
    from picotron.parallel.pipeline_parallel import (Timeline, build_stages, run_schedule, split_microbatches,
                                                     stage_parameters, sync_tied_embeddings)
    from picotron.parallel.pipeline_schedules import Action, Schedule
    out = []
    for layout, m, lists in cases:
        mesh = Mesh(**layout)                    # every rank builds every case's groups, in the same order
        if lists is None:
            out.append(None)
            continue
        model = _model()
        names = {p: n for n, p in model.named_parameters()}
        stages = build_stages(model, mesh.pp_rank, mesh.pp_size)
        params = stage_parameters(stages)
        optimizer = torch.optim.AdamW(params, lr=LR)
        schedule = Schedule("learner's", mesh.pp_size, m, 1, [[Action(*a) for a in actions] for actions in lists])
        share = BATCH // mesh.dp_size
        result = {"pp_rank": mesh.pp_rank, "loss": [], "grads": [], "peak": 0}
        for step in range(TRAIN_STEPS):
            tokens = _tokens(step)[mesh.dp_rank * share:(mesh.dp_rank + 1) * share]   # this dp rank's rows
            timeline = Timeline()                # counts the micro-batches in flight
            step_result = run_schedule(schedule, stages, mesh, split_microbatches(tokens[:, :-1], m),
                                       split_microbatches(tokens[:, 1:], m), loss_fn,
                                       (share // m, SEQ, CHECK_MODEL.hidden_size), observer=timeline)
            sync_tied_embeddings(stages, mesh)   # the embedding (stage 0) and the LM head (last stage) are one matrix
            for p in params:                     # data parallelism: average over the dp group
                dist.all_reduce(p.grad, group=mesh.dp_group)
                p.grad /= mesh.dp_size
            result["loss"].append(0.0 if step_result.loss is None else step_result.loss.item())
            result["grads"].append({names[p]: p.grad.clone() for p in params})
            result["peak"] = max(result["peak"], timeline.peak_activations)
            optimizer.step()
            optimizer.zero_grad()
        result["weights"] = {names[p]: p.detach().clone() for p in params}
        out.append(result)
    return out

"""The checks of assignment 06, declared on the course's engine: pipeline schedules as lists of actions, one a rank.

The learner's afab_actions, one_f_one_b_actions and (stretch) zb_h1_actions(rank, pp, m) give the Action(op,
microbatch, stage) items a pp rank runs, in order. The checks call them here for every rank of ten (pp, m) and
observe, from cause to effect: what the lists hold, the stages they use, actions missing, repeated or before the one
they need, each rank's forward and backward order (messages between two ranks carry no tag and match in the order
they are posted), where the ranks deadlock, the peak in flight and the bubble (ZB-H1: the step), in integer time units
(F = 1, B = 2; F = B = W = 1 once the backward is split) from picotron's `simulate`, the simulator the exercise hands
the learner. The training check runs the lists that pass through picotron's executor on 4 ranks; one that fails here
is not run: it fails, never hangs. Nothing here uses a schedule of picotron.parallel.pipeline_schedules (what the
exercise teaches), a function that calls one is refused, and the misconceptions change correct schedules written
here, refused as answers.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from fractions import Fraction
from typing import Callable

import torch
import torch.distributed as dist

import picotron.parallel.pipeline_schedules as schedules
from picotron import tolerance
from picotron.config import ModelConfig
from picotron.model import Llama, loss_fn
from picotron.parallel.pipeline_schedules import Action, Schedule, peak_in_flight, simulate
from picotron_course.checks import on_ranks, one_thread, watch_calls
from picotron_course.engine import Check, Count, Exact, InTraining, Misconception, Within, by_rank, named

__all__ = ["check_afab_actions", "check_one_f_one_b_actions", "check_one_f_one_b_training", "check_zb_h1_actions",
           "show_timeline", "STRUCTURE_CASES", "TRAIN_CASES", "WORLD"]

PACKAGE = schedules.__name__
# The schedule builders of the course's module: the answers, which the learner's functions may not call.
COURSE_SCHEDULES = ("naive_schedule", "afab_schedule", "one_f_one_b_schedule", "interleaved_schedule",
                    "zb_h1_schedule", "make_schedule")
COURSE_CODES = {getattr(schedules, name).__code__: f"{PACKAGE}.{name}" for name in COURSE_SCHEDULES}
COURSE, ONLY = (PACKAGE, __name__), {__name__: {"_afab", "_one_f_one_b", "_zb_h1"}}   # and this file's bases
# (pp, m): m > p first (the case a failure message shows), m = p, m < p, m = 1, m not a multiple of p, no pipeline.
STRUCTURE_CASES = [(4, 8), (4, 4), (4, 2), (4, 1), (2, 5), (2, 1), (3, 7), (5, 3), (6, 9), (1, 3)]
WORLD = 4
# (layout, micro-batches): pp=4 with a steady state and with m < p; pp=2 beside dp=2.
TRAIN_CASES = [({"pp": 4}, 8), ({"pp": 4}, 2), ({"dp": 2, "pp": 2}, 4)]
TRAIN_STEPS, LR, BATCH, SEQ = 3, 1e-2, 8, 8       # BATCH: the global batch, over the dp ranks
CHECK_MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, max_seq_len=SEQ)
RANK, ITEMS = ("rank {}",), "Action(op, microbatch, stage) items"


# ---- the learner's lists, as the checks see them ---------------------------------------------------
def _lists(fn: Callable, pp: int, m: int) -> list:
    """fn(rank, pp, m) for every rank; AssertionError if it called one of the course's schedules."""
    with watch_calls(_course_schedule) as called:
        lists = [fn(rank, pp, m) for rank in range(pp)]
    if called:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} called {called[0]}, the course's answer: build the list "
                             f"of Actions yourself")
    return lists


def _course_schedule(frame) -> str | None:
    """picotron's schedule a frame runs, or a correct one of this file's called from outside it."""
    if frame.f_code in BASES and frame.f_back.f_globals.get("__name__") != __name__:
        return f"{__name__}.{frame.f_code.co_name}"
    return COURSE_CODES.get(frame.f_code)


def _seen(lists: list, pp: int, m: int, ops: str) -> dict:
    """The observations of a case, from cause to effect (the quantities below); none past a list of wrong items."""
    seen = {"items": [_items(actions, m, ops) for actions in lists]}
    if seen["items"] != [ITEMS] * pp:
        return seen
    lists = [[tuple(a) for a in actions] for actions in lists]
    counts = [Counter(a[:2] for a in actions) for actions in lists]
    where = [{a[:2]: k for k, a in enumerate(actions)} for actions in lists]
    seen.update(lists=lists, stages=[sorted({a[2] for a in actions} - {r}) for r, actions in enumerate(lists)],
                once=[[f"{op}{i} " + ("missing" if n[op, i] == 0 else f"{n[op, i]} times")
                       for op in ops for i in range(m) if n[op, i] != 1] for n in counts],
                after=[[f"{b}{i} before {a}{i}" for a, b in zip(ops, ops[1:]) for i in range(m)
                        if at.get((b, i), math.inf) < at.get((a, i), -1)] for at in where],
                forwards=[[i for op, i, _ in actions if op == "F"] for actions in lists],
                backwards=[[i for op, i, _ in actions if op == "B"] for actions in lists],
                **{"forwards before B": [next((k for k, a in enumerate(actions) if a[0] == "B"), len(actions))
                                         for actions in lists]})
    if any(seen["once"]):
        return seen
    schedule = _schedule(lists, pp, m)
    seen["peak"] = peak_in_flight(schedule)
    try:
        events = simulate(schedule)
    except ValueError as error:   # a deadlock: picotron's message names each rank's stuck action, {rank: action}
        seen["deadlock"] = str(error).partition("(")[2].partition(")")[0] or str(error)
        return seen
    span = int(max(e.end for e in events) - min(e.start for e in events))
    busy = [int(sum(e.end - e.start for e in events if e.rank == r)) for r in range(pp)]
    seen.update(deadlock="", step=span, bubble=[str(Fraction(span - b, span)) for b in busy])
    return seen


def _items(actions, m: int, ops: str) -> str:
    if not isinstance(actions, (list, tuple)):
        return f"a {type(actions).__name__}"
    for k, a in enumerate(actions):
        if not (isinstance(a, tuple) and len(a) == 3 and a[0] in tuple(ops) and isinstance(a[1], int)
                and isinstance(a[2], int) and 0 <= a[1] < m):
            return f"{a!r} at item {k}"
    return ITEMS


def _schedule(lists: list, pp: int, m: int) -> Schedule:
    return Schedule("yours", pp, m, 1, [[Action(*a) for a in actions] for actions in lists])


def _expect_lists(pp: int, m: int, got: dict) -> dict:
    """What right lists show up to the deadlock: each rank's forwards in the previous rank's order, its backwards in
    the next rank's."""
    order = [list(range(m))] * pp
    f, b = got.get("forwards") or order, got.get("backwards") or order
    return {"items": [ITEMS] * pp, "stages": [[]] * pp, "once": [[]] * pp, "after": [[]] * pp,
            "forwards": [f[max(r - 1, 0)] for r in range(pp)], "backwards": [b[min(r + 1, pp - 1)] for r in range(pp)],
            "deadlock": ""}


def _structure(ops: str) -> dict:
    """The quantities of the lists up to the deadlock."""
    order = ("each rank's {}, by micro-batch, which must be in the {} rank's order: messages between two ranks carry "
             "no tag and match in the order they are posted, so the rank would compute on another micro-batch's {}")
    return {
        "items": Exact(f"what each rank's list holds: {ITEMS}, op {' or '.join(map(repr, ops))}, micro-batch an int "
                       f"0..m-1, stage an int", RANK),
        "stages": Exact("the stages a rank's actions use besides its own: with one stage per rank, rank r holds stage "
                        "r and all its actions use stage=r", RANK),
        "once": Exact(f"the actions a rank lacks or repeats: every micro-batch needs exactly one "
                      f"{', one '.join(ops[:-1])} and one {ops[-1]} on every rank", RANK),
        "after": Exact("the actions a rank runs before the one they need: a B needs the activations its F saved"
                       + (", a W the output gradient its B received" if "W" in ops else ""), RANK),
        "forwards": Exact(order.format("forwards", "previous", "activations"), RANK),
        "backwards": Exact(order.format("backwards", "next", "gradients"), RANK),
        "deadlock": Exact("the ranks stuck in the simulation {rank: its next action}, each waiting for an action that "
                          "runs only later or never (an F for the previous rank's F of its micro-batch, a B for its F "
                          "and the next rank's B): a deadlock")}


def _observe(answers: list, cases: list, ops: str = "FB") -> list:
    return [[_seen(_lists(fn, c["pp"], c["m"]), c["pp"], c["m"], ops) for c in cases] for fn in answers]


def _declare(title: str, ops: str, expect: Callable, quantities: dict, misconceptions: list, note: str,
             cases: list | None = None, observe: Callable | None = None) -> Check:
    """A check of lists: the quantities up to the deadlock, then `quantities`, expected by expect(pp, m, got)."""
    check = Check(title, cases=cases or [dict(pp=pp, m=m) for pp, m in STRUCTURE_CASES], note=note,
                  observe=observe or functools.partial(_observe, ops=ops),
                  expect=lambda c, got: {**_expect_lists(c["pp"], c["m"], got), **expect(c["pp"], c["m"], got)},
                  columns=lambda case, got: _columns(check, case, got), quantities={**_structure(ops), **quantities},
                  misconceptions=misconceptions, course=COURSE, only=ONLY)
    return check


def _columns(check: Check, case: dict, got: dict) -> dict:
    want, out = check.expect(case, got), {"forwards before B": _per_rank(got.get("forwards before B"))}
    for key in ("peak", "bubble", "step"):
        if key in want:
            at_most = "<= " if getattr(check.quantities[key], "at_most", False) else ""
            out.update({f"{key} (want)": at_most + _per_rank(want[key]), f"{key} (got)": _per_rank(got.get(key))})
    return out


def _per_rank(values) -> str:
    """Per-rank values, one if they are all equal; '-' when there are none."""
    values = values if isinstance(values, list) or values is None else [values]
    if not values:
        return "-"
    return str(values[0]) if len(set(map(str, values))) == 1 else ",".join(map(str, values))


# ---- correct schedules (refused as answers), and the misconceptions' answers that change them --------------------
def _afab(rank, pp, m):
    return [Action(op, i, rank) for op in "FB" for i in range(m)]


def _one_f_one_b(rank, pp, m, warmup=None, pair="FB", newest=False):
    """min(p - r - 1, m) warm-up forwards, then the forward of a new micro-batch and the backward of the oldest in
    turn, then the backwards still owed. warmup, pair, newest (the newest's backward): what misconceptions change."""
    w = min(pp - rank - 1, m) if warmup is None else warmup
    steady = [Action(op, w + k if op == "F" or newest else k, rank) for k in range(m - w) for op in pair]
    owed = range(w)[::-1] if newest else range(m - w, m)
    return [Action("F", i, rank) for i in range(w)] + steady + [Action("B", k, rank) for k in owed]


def _zb_h1(rank, pp, m, lag=None, early=False):
    """1F1B's F and B; after a B, the oldest W while more than `lag` wait (r on rank r); the rest at the end. early:
    what a misconception changes (a waiting W before each B of the cool-down)."""
    lag, actions, waiting = rank if lag is None else lag, [], []
    for k, a in enumerate(_one_f_one_b(rank, pp, m)):
        if early and a.op == "B" and k >= 2 * m - min(pp - rank - 1, m) and waiting:
            actions.append(Action("W", waiting.pop(0), rank))
        actions.append(a)
        waiting += [a.microbatch] * (a.op == "B")
        if len(waiting) > lag:
            actions.append(Action("W", waiting.pop(0), rank))
    return actions + [Action("W", i, rank) for i in waiting]


BASES = {_afab.__code__, _one_f_one_b.__code__, _zb_h1.__code__}


def zb_w_before_its_b(rank, pp, m):
    actions = _zb_h1(rank, pp, m)
    b, w = actions.index(Action("B", 0, rank)), actions.index(Action("W", 0, rank))
    actions[b], actions[w] = actions[w], actions[b]
    return actions


NO_WARMUP = named("no_warmup", lambda r, pp, m: _one_f_one_b(r, pp, m, warmup=0))   # F0 B0 F1 B1 ...
WARMUP_UP = Misconception(named("warmup_counts_up", lambda r, pp, m: _one_f_one_b(r, pp, m, warmup=min(r, m))),
                          "the warm-up shrinks with the rank (rank 0 the most forwards, the last rank none): a rank "
                          "must not wait for a gradient before it has sent the forwards that the ranks after it need "
                          "first")
NO_LAST_B = Misconception(named("missing_last_backward", lambda r, pp, m: _one_f_one_b(r, pp, m)[:-1]),
                          "every micro-batch needs exactly one backward (B) on every rank: the cool-down runs all the "
                          "backwards still owed, the last one too")
IN_FLIGHT = "the most micro-batches in flight on each rank, from F until B"
BUBBLE = Exact("each rank's idle share of the simulated step, exactly (p-1)/(m+p-1): more when its actions wait for "
               "one another longer than the pipeline's fill and drain", RANK)
NOTE = ("each rank's list from {}(rank, pp, m), simulated with F = 1, B = 2 time units; peak = most micro-batches "
        "between their F and B on a rank; bubble = idle / total, per rank")


# ---- 1, 2. AFAB and 1F1B -------------------------------------------------------------------------------------
AFAB = _declare(
    "afab_actions", "FB", note=NOTE.format("afab_actions"),
    expect=lambda pp, m, got: {"forwards": [list(range(m))] * pp, "backwards": [list(range(m))] * pp,
                               "peak": [m] * pp, "bubble": [str(Fraction(pp - 1, m + pp - 1))] * pp},
    quantities={"forwards": Exact("each rank's forwards, by micro-batch: 0, 1, ..., m-1 in turn, as the task asks",
                                  RANK),
                "backwards": Exact("each rank's backwards, by micro-batch: in the same order as the forwards (oldest "
                                   "first), as the task asks", RANK),
                "peak": Count(f"{IN_FLIGHT}: AFAB all m", RANK, fewer="run every forward before the first backward"),
                "bubble": BUBBLE},
    misconceptions=[
        Misconception(named("afab_on_stage_zero", lambda r, pp, m: _afab(0, pp, m)),
                      "rank r holds stage r: all its actions use stage=rank, not 0"),
        Misconception(named("afab_all_reversed", lambda r, pp, m: [(op, i, r) for op in "FB" for i in range(m)[::-1]]),
                      "the forwards of micro-batches 0, 1, ..., m-1 in turn, then their backwards in the same order "
                      "(oldest first), as the task asks"),
        Misconception(named("afab_newest_first", lambda r, pp, m: _afab(r, pp, m)[:m] + _afab(r, pp, m)[m:][::-1]),
                      "the backwards in the same order as the forwards (oldest first), as the task asks: newest first "
                      "would train right too, but picotron's afab schedule and torch's ScheduleGPipe go oldest first"),
        Misconception(_one_f_one_b, "that is 1F1B: AFAB runs all m forwards before the first backward, so every rank "
                                    "holds all m micro-batches"),
        Misconception(NO_WARMUP, "F0 B0 F1 B1 ... sends one micro-batch at a time through the whole pipeline: AFAB "
                                 "runs every forward, then every backward")])

ONE_F_ONE_B = _declare(
    "one_f_one_b_actions", "FB", note=NOTE.format("one_f_one_b_actions"),
    expect=lambda pp, m, got: {"peak": [min(pp - r, m) for r in range(pp)],
                               "bubble": [str(Fraction(pp - 1, m + pp - 1))] * pp},
    quantities={"peak": Count(f"{IN_FLIGHT}: 1F1B at most min(p - r, m) on rank r", RANK,
                              more="a warm-up longer than min(p - r - 1, m) forwards, or after it not one forward and "
                                   "one backward (of the oldest in flight) in turn, only costs memory",
                              fewer="without a warm-up of min(p - r - 1, m) forwards the rank waits for gradients "
                                    "while it could run forwards, and the bubble grows"),
                "bubble": BUBBLE},
    misconceptions=[
        Misconception(named("returns_strings", lambda r, pp, m: [f"{op}{i}" for op, i, _ in _one_f_one_b(r, pp, m)]),
                      "each item is an Action(op, microbatch, stage), e.g. Action('F', 0, rank), not a string"),
        Misconception(named("stage_counted_from_the_end",
                             lambda r, pp, m: [Action(op, i, pp - 1 - r) for op, i, _ in _one_f_one_b(r, pp, m)]),
                      "with one stage per rank, rank r holds stage r and all its actions use stage=rank (not a stage "
                      "counted from the last rank)"),
        NO_LAST_B,
        Misconception(named("backward_before_forward", lambda r, pp, m: _one_f_one_b(r, pp, m, pair="BF")),
                      "a backward needs the activations its forward saved: in the steady state run the forward of a "
                      "new micro-batch, then a backward"),
        Misconception(named("newest_backward_first", lambda r, pp, m: _one_f_one_b(r, pp, m, newest=True)),
                      "run the backwards in the same micro-batch order on every rank, oldest first (a queue, not a "
                      "stack): the gradients a rank receives would belong to another micro-batch"),
        WARMUP_UP,
        Misconception(_afab, "every forward comes before the first backward, which is AFAB. Start the backwards after "
                             "a warm-up of min(p - r - 1, m) forwards"),
        Misconception(named("warmup_one_too_many", lambda r, pp, m: _one_f_one_b(r, pp, m, warmup=min(pp - r, m))),
                      "a warm-up of p - r - 1 forwards, then F and B in turn, is enough: the first gradient comes back "
                      "just as the warm-up is done, and one more forward only costs memory"),
        Misconception(NO_WARMUP, "without a warm-up of p - r - 1 forwards a rank waits for gradients while it could be "
                                 "running forwards, and the bubble grows")])


def check_afab_actions(afab_actions: Callable[[int, int, int], list]) -> None:
    """All forwards, then all backwards (GPipe): complete, on stage `rank`, deadlock-free; forwards and
    backwards both in micro-batch order 0, 1, ..., m-1, as the task says; every rank holds all m
    micro-batches at its peak; simulated bubble (p-1)/(m+p-1), exactly."""
    AFAB(afab_actions)


def check_one_f_one_b_actions(one_f_one_b_actions: Callable[[int, int, int], list]) -> None:
    """1F1B: complete, on stage `rank`, deadlock-free; rank r holds at most min(p - r, m) micro-batches
    (its warm-up has min(p - r - 1, m) forwards); simulated bubble (p-1)/(m+p-1), exactly."""
    ONE_F_ONE_B(one_f_one_b_actions)


# ---- 3. through the executor, on 4 ranks ----------------------------------------------------------------
def _observe_training(answers: list, cases: list) -> list:
    """The lists seen here; those that pass the checks up to the deadlock then run, in one launch, on WORLD ranks."""
    seen = _observe(answers, cases)
    runnable = [[s.get("lists") if not TRAINING.differences(s, _expect_lists(c["pp"], c["m"], s)) else None
                 for s, c in zip(mine, cases)] for mine in seen]
    launch = any(lists for mine in runnable for lists in mine)
    ran = by_rank(on_ranks(_train_on_rank, WORLD, runnable, cases)) if launch else [[{}] * len(cases)] * len(answers)
    for mine, theirs in zip(seen, ran):
        for s, r, c in zip(mine, theirs, cases):   # the loss: the last stage's, averaged over the dp ranks
            last = [loss for p, loss in zip(r.get("pp_rank", []), r.get("loss", [])) if p == c["pp"] - 1]
            s.update(r, peak=r.get("peak"), loss=[torch.tensor(sum(x[k] for x in last) / len(last), dtype=torch.float64)
                                                  for k in range(TRAIN_STEPS)] if last else None)
    return seen


def _expect_training(pp: int, m: int, got: dict) -> dict:
    one, names = _train_one_process(), got.get("names") or []
    return {"loss": [torch.tensor(loss, dtype=torch.float64) for loss in one["loss"]],
            "grads": [[[grads[n] for n in mine] for grads in one["grads"]] for mine in names],
            "weights": [[one["weights"][n] for n in mine] for mine in names],
            "peak": [min(pp - p, m) for p in got.get("pp_rank") or []]}


TRAINING = _declare(
    "one_f_one_b_actions on the executor", "FB", observe=_observe_training, expect=_expect_training,
    cases=[dict(dp=layout.get("dp", 1), pp=layout["pp"], m=m) for layout, m in TRAIN_CASES],
    note=f"{WORLD} ranks, {TRAIN_STEPS} AdamW steps of a {CHECK_MODEL.num_layers}-layer Llama, global batch {BATCH} x "
         f"{SEQ} tokens cut into m micro-batches; compared with one process training the whole batch. The lists are "
         f"checked here first: one that would deadlock is refused, not run",
    quantities={"loss": Within("the loss of each step, against one process's (a schedule that runs on the wrong data "
                               "differs here)", ("step {}",), atol=tolerance.LOSS_ATOL),
                "grads": InTraining("the gradients of each rank's parameters, against one process's",
                                    ("rank {}", "step {}", "params[{}]")),
                "weights": Within("the final weights, against one process's", ("rank {}", "params[{}]"),
                                  atol=tolerance.ADAM_WEIGHTS_ATOL),
                "peak": Count("the most micro-batches in flight on each rank, as the executor counts them: 1F1B holds "
                              "min(p - r, m) on pp rank r", RANK,
                              more="more than p - r: the gradients are right, but the warm-up is too long",
                              fewer="fewer than p - r: the warm-up is too short, and the pipeline runs dry")},
    misconceptions=[NO_LAST_B, WARMUP_UP, Misconception(_afab, "the gradients are right, but every forward runs "
                                                               "before the first backward: that is AFAB")])


def check_one_f_one_b_training(one_f_one_b_actions: Callable[[int, int, int], list]) -> None:
    """The lists run by picotron's executor on 4 ranks, as pp=4 and as dp=2 x pp=2: TRAIN_STEPS AdamW
    steps whose losses and gradients equal one process's (1e-5) and final weights too (1e-4); rank r
    of the pipeline holds at most min(p - r, m) micro-batches, as the executor measures it."""
    TRAINING(one_f_one_b_actions)


def _tokens(step: int) -> torch.Tensor:
    """(BATCH, SEQ + 1) tokens of one step's global batch; the parent and every rank make the same."""
    generator = torch.Generator().manual_seed(7919 * step + 11)
    return torch.randint(0, CHECK_MODEL.vocab_size, (BATCH, SEQ + 1), generator=generator)


def _model() -> Llama:
    with torch.random.fork_rng(devices=[]):      # leave the caller's random state alone
        torch.manual_seed(0)
        return Llama(CHECK_MODEL)


@functools.cache
def _train_one_process() -> dict:
    """Plain torch: the whole global batch, one forward and one backward per step, AdamW."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"loss": [], "grads": []}
    with one_thread():
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


def _train_on_rank(runnable: list, cases: list) -> list:
    """[answer][case] on this rank: build the stages, run the answer's lists TRAIN_STEPS times ({} where not run)."""
    from picotron.mesh import Mesh
    meshes = [Mesh(dp=c["dp"], pp=c["pp"]) for c in cases]   # every rank builds every case's groups, in the same order
    return [[_train(lists, mesh, case["m"]) if lists else {} for lists, mesh, case in zip(mine, meshes, cases)]
            for mine in runnable]


def _train(lists: list, mesh, m: int) -> dict:
    from picotron.parallel.pipeline_parallel import (Timeline, build_stages, run_schedule, split_microbatches,
                                                     stage_parameters, sync_tied_embeddings)
    model = _model()
    names = {p: n for n, p in model.named_parameters()}
    stages = build_stages(model, mesh.pp_rank, mesh.pp_size)
    params = stage_parameters(stages)
    optimizer = torch.optim.AdamW(params, lr=LR)
    schedule = _schedule(lists, mesh.pp_size, m)
    share = BATCH // mesh.dp_size
    out = {"pp_rank": mesh.pp_rank, "names": [names[p] for p in params], "loss": [], "grads": [], "peak": 0}
    for step in range(TRAIN_STEPS):
        tokens = _tokens(step)[mesh.dp_rank * share:(mesh.dp_rank + 1) * share]   # this dp rank's rows
        timeline = Timeline()                # counts the micro-batches in flight
        result = run_schedule(schedule, stages, mesh, split_microbatches(tokens[:, :-1], m),
                              split_microbatches(tokens[:, 1:], m), loss_fn, (share // m, SEQ, CHECK_MODEL.hidden_size),
                              observer=timeline)
        sync_tied_embeddings(stages, mesh)   # the embedding (stage 0) and the LM head (last stage) are one matrix
        for p in params:                     # data parallelism: average over the dp group
            dist.all_reduce(p.grad, group=mesh.dp_group)
            p.grad /= mesh.dp_size
        out["loss"].append(0.0 if result.loss is None else result.loss.item())
        out["grads"].append([p.grad.clone() for p in params])
        out["peak"] = max(out["peak"], timeline.peak_activations)
        optimizer.step()
        optimizer.zero_grad()
    return {**out, "weights": [p.detach().clone() for p in params]}


# ---- 4. stretch: ZB-H1, the backward split into B and W ------------------------------------------------
ZB_H1 = _declare(
    "zb_h1_actions", "FBW",
    expect=lambda pp, m, got: {"peak": [pp] * pp, "step": 3 * m + pp - 1 if m >= pp else 3 * (m + pp - 1)},
    note="each rank's list from zb_h1_actions(rank, pp, m), simulated with F = B = W = 1 time unit (B: the input's "
         "gradient, W: the weights'); peak = most micro-batches between their F and their W on a rank; step = the "
         "simulated step's length",
    quantities={"peak": Count("the most micro-batches held on each rank, from F until W (W still needs the layers' "
                              "inputs)", RANK, at_most=True,
                              more="more than p, 1F1B's peak on its first stage: in 1F1B's steady state rank r holds "
                                   "p - r between F and B, which leaves room for only a few W's waiting"),
                "step": Count("the simulated step's length: ZB-H1's m(F+B+W) + (p-1)(F+B-W) when m >= p; when m < p, "
                              "where that formula does not apply, no longer than 1F1B's (m+p-1)(F+B+W): splitting the "
                              "backward should never make the step longer", at_most=True,
                              more="somewhere a rank runs a W while a neighbour waits for its B or F, or waits while a "
                                   "W could run: show_timeline(zb_h1_actions, pp, m) shows where")},
    misconceptions=[
        Misconception(_one_f_one_b, "every micro-batch needs exactly one weight gradient (W) too: split each backward "
                                    "into B (the input's gradient) and W (the weights')"),
        Misconception(zb_w_before_its_b, "the weights' gradient needs the output gradient that B received: run each "
                                          "W after its B"),
        Misconception(named("zb_all_w_at_the_end", lambda r, pp, m: _zb_h1(r, pp, m, lag=m)),
                      "a micro-batch's activations stay until its W has run, so with every W after the last B all m "
                      "are held until the end: run each W sooner"),
        Misconception(named("zb_w_right_after_b", lambda r, pp, m: _zb_h1(r, pp, m, lag=0)),
                      "every W runs right after its B: the gradient leaves a little sooner than in 1F1B, but the ranks "
                      "still wait where 1F1B waits. Hold W's back, to fill the time a rank would otherwise spend "
                      "waiting for a gradient"),
        Misconception(named("zb_w_early_in_the_cool_down", lambda r, pp, m: _zb_h1(r, pp, m, early=True)),
                      "a W run before a B of the cool-down delays the B the previous rank waits for: in the cool-down, "
                      "run the waiting W's after the B's")])


def check_zb_h1_actions(zb_h1_actions: Callable[[int, int, int], list]) -> None:
    """Stretch. ZB-H1: every micro-batch's F, B and W once on stage `rank`, each W after its B, messages
    in matching order, deadlock-free; at most p micro-batches held on a rank (from F until W); with
    F = B = W = 1, a step of m(F+B+W) + (p-1)(F+B-W) when m >= p, and no longer than 1F1B's
    (m+p-1)(F+B+W) when m < p (where ZB-H1's formula does not apply)."""
    ZB_H1(zb_h1_actions)


# ---- the timeline, for the notebook -------------------------------------------------------------------
def show_timeline(fn: Callable[[int, int, int], list], pp: int, m: int) -> None:
    """Print the simulated timeline of fn's lists (F = 1 time unit, B = 2; F = B = W = 1 when the lists
    split the backward into B and W), each rank's peak and bubble; ValueError if they cannot run."""
    raw = _lists(fn, pp, m)
    split = any(isinstance(a, tuple) and a[:1] == ("W",) for actions in raw if isinstance(actions, (list, tuple))
                for a in actions)
    seen = _seen(raw, pp, m, "FBW" if split else "FB")
    wrong = (ZB_H1 if split else ONE_F_ONE_B).differences(seen, _expect_lists(pp, m, seen))
    if wrong:
        raise ValueError(next(iter(wrong.values())))
    events, width = simulate(_schedule(seen["lists"], pp, m)), len(str(m - 1)) + 1
    print(f"{getattr(fn, '__name__', 'fn')}, pp={pp}, m={m}: one column per time unit "
          f"({'F, B and W take 1 each' if split else 'F takes 1, B takes 2'}; '.' idle)")
    for r in range(pp):
        cells = ["." * width] * seen["step"]
        for e in (e for e in events if e.rank == r):
            start, end = int(e.start), int(e.end)
            cells[start:end] = [f"{e.op}{e.microbatch}".ljust(width)] + ["-" * width] * (end - start - 1)
        print(f"rank {r}: {' '.join(cells)}   peak {seen['peak'][r]}, bubble {float(Fraction(seen['bubble'][r])):.2f}")

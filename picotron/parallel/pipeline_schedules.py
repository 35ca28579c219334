"""Pipeline schedules as data: which rank runs which forward (F), backward (B) and weight-gradient (W)
action, in what order; checked, simulated and priced without torch. The chapter, with what each
schedule costs in time and memory: chapters/06_pipeline_parallel.ipynb.

A schedule lists, for every pp rank, the actions it runs in order; sends and receives are implied
by the actions (F on stage s > 0 receives from stage s - 1, B on stage s < S - 1 from stage s + 1).
picotron/parallel/pipeline_parallel.py holds the stages and the executor that runs a schedule on
real ranks; this file holds the schedules themselves, `check_schedule` (complete, on the right
ranks, no deadlock, messages in matching order), `simulate` (the timeline from unit costs), and the
measured and textbook bubbles:

    naive         one batch, no micro-batches: F then B, one stage busy at a time
    afab          all forward, all backward: GPipe (Huang et al. 2019, arXiv:1811.06965)
    1f1b          one forward, one backward: PipeDream-Flush (Narayanan et al. 2021, arXiv:2006.09503), as
                  Megatron-LM runs it (arXiv:2104.04473)
    interleaved   v chunks of layers per rank (Narayanan et al. 2021, arXiv:2104.04473, section 2.2)
    zb-h1         zero bubble, handcrafted 1: the backward split into B and W (Qi et al. 2023, arXiv:2401.10241)

Playbook, "Pipeline Parallelism" and the sections after it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Action", "Schedule", "Event", "naive_schedule", "afab_schedule", "one_f_one_b_schedule",
           "interleaved_schedule", "zb_h1_schedule", "make_schedule", "SCHEDULES", "check_stages", "stage_layers",
           "check_pipeline", "check_schedule", "simulate", "peak_in_flight", "bubble_fraction", "bubble_formula"]


# ---- schedules as data ---------------------------------------------------------------------------------
class Action(NamedTuple):
    """One step of a rank's work: op "F" (forward), "B" (backward) or "W" (weight gradient)."""
    op: str
    microbatch: int
    stage: int          # global stage index, 0 .. pp * virtual_stages - 1

    def __str__(self) -> str:
        return f"{self.op}{self.microbatch}@{self.stage}"


@dataclass
class Schedule:
    """What every pp rank runs, in order: actions[r] is rank r's list.

    Without any "W", each B computes the input and the weight gradients together; with W actions
    (zero-bubble schedules) B computes the input gradient only and W the weight gradients.
    Stage s lives on rank s % pp.
    """
    name: str
    pp: int
    num_microbatches: int
    virtual_stages: int
    actions: list[list[Action]]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        return any(a.op == "W" for rank in self.actions for a in rank)

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def __str__(self) -> str:
        show = str if self.virtual_stages > 1 else (lambda a: f"{a.op}{a.microbatch}")
        return "\n".join(f"rank {r}: " + " ".join(show(a) for a in acts) for r, acts in enumerate(self.actions))


def afab_schedule(pp: int, num_microbatches: int) -> Schedule:
    """GPipe: every forward, then every backward. Each rank keeps all m micro-batches' activations."""
    m = num_microbatches
    actions = [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)] for r in range(pp)]
    return Schedule("afab", pp, m, 1, actions)


def naive_schedule(pp: int) -> Schedule:
    """No micro-batching: the whole batch goes forward through the stages and back, one stage busy at a time."""
    return Schedule("naive", pp, 1, 1, afab_schedule(pp, 1).actions)


def one_f_one_b_schedule(pp: int, num_microbatches: int) -> Schedule:
    """1F1B: pp - r - 1 warm-up forwards, then one forward, one backward, ...; then the remaining backwards.

    A micro-batch's backward starts as soon as its gradient can arrive, so rank r never holds more
    than pp - r micro-batches' activations.
    """
    m, actions = num_microbatches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        rank = [Action("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):                       # steady state: F of a new one, B of the oldest
            rank += [Action("F", warmup + i, r), Action("B", i, r)]
        rank += [Action("B", i, r) for i in range(m - warmup, m)]
        actions.append(rank)
    return Schedule("1f1b", pp, m, 1, actions)


def interleaved_schedule(pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): rank r holds chunks r, r + pp, ...; micro-batches go in groups of pp.

    Forward order on a rank: the first pp micro-batches through its first chunk, the same pp through
    its second chunk, ..., then the next group. Backward order: the same with the chunks reversed.
    The warm-up is long enough for the first backward's gradient to come back around:
    2 (pp - r - 1) forwards to fill the pipeline once more than 1F1B, plus (v-1) pp for the other chunks.
    """
    m, v = num_microbatches, virtual_stages
    if m % pp:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of pp={pp}: num_microbatches={m} "
                         f"is not a multiple of {pp}; use {max(pp, m - m % pp)} or {m - m % pp + pp}")
    actions = []
    for r in range(pp):
        def nth(k: int, backward: bool) -> tuple[int, int]:
            """(micro-batch, stage) of this rank's k-th forward (or backward)."""
            group, within = divmod(k, pp * v)
            chunk = within // pp
            chunk = v - 1 - chunk if backward else chunk
            return group * pp + within % pp, chunk * pp + r

        total = m * v
        warmup = min(2 * (pp - r - 1) + (v - 1) * pp, total)
        rank = [Action("F", *nth(k, False)) for k in range(warmup)]
        for i in range(total - warmup):
            rank += [Action("F", *nth(warmup + i, False)), Action("B", *nth(i, True))]
        rank += [Action("B", *nth(k, True)) for k in range(total - warmup, total)]
        actions.append(rank)
    return Schedule("interleaved", pp, m, v, actions)


def zb_h1_schedule(pp: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B (input gradient) and W (weight gradient).

    Rank r runs 1F1B's F and B order and puts W of micro-batch i after B of micro-batch i + r: later
    ranks, which idle longest at the end of 1F1B, keep their W's for then. Peak memory stays 1F1B's
    (rank r holds p - r micro-batches in flight plus r waiting for their W: p).
    """
    m, actions = num_microbatches, []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        rank = [Action("F", i, r) for i in range(warmup)]
        next_w = 0

        def backward(i: int) -> None:
            nonlocal next_w
            rank.append(Action("B", i, r))
            if i - r >= next_w:                          # W lags B by r micro-batches on rank r
                rank.append(Action("W", next_w, r))
                next_w += 1

        for i in range(m - warmup):
            rank.append(Action("F", warmup + i, r))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        rank += [Action("W", i, r) for i in range(next_w, m)]   # the lagging W's fill the cool-down
        actions.append(rank)
    return Schedule("zb-h1", pp, m, 1, actions)


SCHEDULES = ("naive", "afab", "1f1b", "interleaved", "zb-h1")
_ALIASES = {"gpipe": "afab", "1F1B": "1f1b", "zbh1": "zb-h1", "zb_h1": "zb-h1"}


def check_stages(num_layers: int, pp: int, virtual_stages: int = 1) -> None:
    """Raise ValueError unless every one of the pp x virtual_stages stages gets at least one layer."""
    stages = pp * virtual_stages
    if stages > num_layers:
        raise ValueError(f"pp={pp} x virtual_stages={virtual_stages} = {stages} stages need at least {stages} layers, "
                         f"but num_layers={num_layers}: a stage needs at least one layer; lower pp (or "
                         f"virtual_stages), or use a model with more layers")


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive, balanced slices of the layers: stage s gets layers stage_layers(...)[s].

    Sizes differ by at most one; the first stages get the extra layers, since the last stage also
    computes the LM head and the loss.
    """
    check_stages(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def check_pipeline(num_layers: int, pp: int, schedule: str, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ValueError naming the fix if `schedule` cannot run pp stages of a num_layers model over
    num_microbatches micro-batches (the training configuration's pipeline, checked before anything is built)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not a pipeline schedule; choose one of {SCHEDULES}")
    if virtual_stages < 1 or (virtual_stages > 1 and schedule != "interleaved"):
        raise ValueError(f"pp_virtual_stages={virtual_stages}: use 1, or more with pp_schedule='interleaved'")
    check_stages(num_layers, pp, virtual_stages)
    if pp > 1 and schedule == "naive" and num_microbatches != 1:
        raise ValueError(f"pp_schedule='naive' runs one batch per step, but grad_accum_steps={num_microbatches}; "
                         f"set grad_accum_steps=1 or choose 'afab', '1f1b', 'interleaved' or 'zb-h1'")
    if pp > 1 and schedule == "interleaved" and num_microbatches % pp:
        raise ValueError(f"the interleaved schedule sends micro-batches round in groups of pp={pp}, but "
                         f"grad_accum_steps={num_microbatches} micro-batches do not divide by it; choose a multiple")


def make_schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule called `name` (one of SCHEDULES; "gpipe" is "afab"), checked."""
    name = _ALIASES.get(name, name)
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if pp < 1 or num_microbatches < 1:
        raise ValueError(f"pp={pp} and num_microbatches={num_microbatches} must both be at least 1")
    if virtual_stages != 1 and name != "interleaved":
        raise ValueError(f"virtual_stages={virtual_stages} is for the interleaved schedule only; "
                         f"use name='interleaved' or virtual_stages=1 with {name!r}")
    if name == "naive" and num_microbatches != 1:
        raise ValueError(f"the naive schedule runs the whole batch at once (num_microbatches=1, got "
                         f"{num_microbatches}); use 'afab' or '1f1b' to cut it into micro-batches")
    if name == "interleaved" and virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages} must be at least 1 (2 or more to interleave)")
    schedule = {"naive": lambda: naive_schedule(pp),
                "afab": lambda: afab_schedule(pp, num_microbatches),
                "1f1b": lambda: one_f_one_b_schedule(pp, num_microbatches),
                "interleaved": lambda: interleaved_schedule(pp, num_microbatches, virtual_stages),
                "zb-h1": lambda: zb_h1_schedule(pp, num_microbatches)}[name]()
    check_schedule(schedule)
    return schedule


# ---- what an action needs, and checking a schedule -----------------------------------------------------
def _depends_on(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results `action` uses (on this rank or arriving from a neighbour)."""
    op, i, s = action
    if op == "F":
        return [Action("F", i, s - 1)] if s > 0 else []
    if op == "B":   # its own forward's graph, and the output gradient from the next stage
        return [Action("F", i, s)] + ([Action("B", i, s + 1)] if s < num_stages - 1 else [])
    return [Action("B", i, s)]   # W: the output gradients B left behind


def _messages(schedule: Schedule) -> tuple[dict, dict]:
    """For each (sender, receiver) pair of ranks: the messages in the order the sender posts them,
    and in the order the receiver waits for them. A message is (kind, micro-batch, from stage)."""
    sent, received = {}, {}
    last = schedule.num_stages - 1
    for r, actions in enumerate(schedule.actions):
        for op, i, s in actions:
            if op == "F" and s < last:
                sent.setdefault((r, schedule.rank_of(s + 1)), []).append(("activation", i, s))
            if op == "F" and s > 0:
                received.setdefault((schedule.rank_of(s - 1), r), []).append(("activation", i, s - 1))
            if op == "B" and s > 0:
                sent.setdefault((r, schedule.rank_of(s - 1)), []).append(("gradient", i, s))
            if op == "B" and s < last:
                received.setdefault((schedule.rank_of(s + 1), r), []).append(("gradient", i, s + 1))
    return sent, received


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError unless the schedule is complete, places stages right, and runs without deadlock.

    Complete: every (micro-batch, stage) has one F and one B, and one W if the schedule splits the
    backward. Messages between two ranks are received in the order they are sent (p2p ops carry
    no tag that could tell them apart).
    """
    S, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.actions) != schedule.pp:
        raise ValueError(f"the schedule has action lists for {len(schedule.actions)} ranks; pp={schedule.pp}")
    ops = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    seen: Counter = Counter()
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op not in ops or not 0 <= a.microbatch < m or not 0 <= a.stage < S:
                raise ValueError(f"rank {r}: {a} is not an action of this schedule (ops {ops}, micro-batches "
                                 f"0..{m - 1}, stages 0..{S - 1})")
            if schedule.rank_of(a.stage) != r:
                raise ValueError(f"rank {r}: {a} runs stage {a.stage}, which lives on rank {schedule.rank_of(a.stage)}")
            seen[a] += 1
    expected = {Action(op, i, s) for op in ops for i in range(m) for s in range(S)}
    missing, twice = expected - set(seen), [a for a, n in seen.items() if n > 1]
    if missing or twice:
        raise ValueError(f"every micro-batch needs one {'/'.join(ops)} on every stage: missing "
                         f"{sorted(map(str, missing))[:6]}, repeated {sorted(map(str, twice))[:6]}")
    sent, received = _messages(schedule)
    for (src, dst), order in sent.items():
        if src != dst and received.get((src, dst)) != order:
            raise ValueError(f"rank {src} sends to rank {dst} in the order {order[:6]}... but rank {dst} receives "
                             f"{received.get((src, dst), [])[:6]}...; messages between two ranks match in the "
                             f"order they are posted: reorder the actions so both sides agree")
    simulate(schedule)   # raises on a deadlock


# ---- the simulator: timelines from unit costs, no torch --------------------------------------------------
class Event(NamedTuple):
    """One action as it ran (or would run): on which rank, when it started and ended."""
    rank: int
    op: str
    microbatch: int
    stage: int
    start: float
    end: float


def simulate(schedule: Schedule, f: float = 1.0, b: float = 1.0, w: float = 1.0, p2p: float = 0.0) -> list[Event]:
    """The timeline of `schedule` if every forward takes f, every input-gradient backward b and every
    weight-gradient step w (a schedule without W actions spends b + w in each B), and a message
    between two ranks takes p2p. Costs are per action: an interleaved chunk holds 1/v of a rank's
    layers, so pass f/v, b/v, w/v to compare with the other schedules.

    Each rank runs its list in order; an action starts when the rank is free and its inputs are
    there. Raises ValueError naming the stuck actions if the schedule deadlocks.
    """
    cost = {"F": f, "B": b if schedule.split_backward else b + w, "W": w}
    done: dict[Action, float] = {}                      # action -> end time
    free = [0.0] * schedule.pp                          # when each rank is next idle
    position = [0] * schedule.pp
    events = []
    while any(position[r] < len(schedule.actions[r]) for r in range(schedule.pp)):
        progressed = False
        for r, actions in enumerate(schedule.actions):
            while position[r] < len(actions):
                action = actions[position[r]]
                needs = _depends_on(action, schedule.num_stages)
                if any(n not in done for n in needs):
                    break                               # wait for another rank to get further
                arrivals = [done[n] + (p2p if schedule.rank_of(n.stage) != r else 0.0) for n in needs]
                start = max([free[r], *arrivals])
                free[r] = done[action] = start + cost[action.op]
                events.append(Event(r, action.op, action.microbatch, action.stage, start, free[r]))
                position[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(a[position[r]]) for r, a in enumerate(schedule.actions) if position[r] < len(a)}
            raise ValueError(f"the schedule deadlocks: each rank's next action waits for one that never runs "
                             f"({stuck}); an action must come after those it depends on")
    return events


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) activation sets alive at once: from F until B (or W)."""
    frees = "W" if schedule.split_backward else "B"
    peaks = []
    for actions in schedule.actions:
        alive = peak = 0
        for a in actions:
            alive += (a.op == "F") - (a.op == frees)
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def bubble_fraction(events: list[Event]) -> list[float]:
    """Idle / total time per rank, total being the whole step (first start to last end on any rank)."""
    start, end = min(e.start for e in events), max(e.end for e in events)
    ranks = sorted({e.rank for e in events})
    busy = {r: sum(e.end - e.start for e in events if e.rank == r) for r in ranks}
    return [1 - busy[r] / (end - start) for r in ranks]


def bubble_formula(name: str, pp: int, num_microbatches: int, virtual_stages: int = 1, *,
                   f: float = 1.0, b: float = 1.0, w: float = 1.0) -> float:
    """The textbook idle fraction of a schedule (Playbook, "Pipeline Parallelism" and following sections).

    naive, afab, 1f1b   (p-1)/(m+p-1)              whatever F and B cost
    interleaved         (p-1)/(v m+p-1)
    zb-h1               (p-1)(f+b-w) / (m(f+b+w) + (p-1)(f+b-w)): idle (p-1)(F+B-W) instead of
                        (p-1)(F+B+W); needs m >= p and w <= min(f, b) (a third of 1F1B's at f=b=w)
    """
    name = _ALIASES.get(name, name)
    p, m, v = pp, num_microbatches, virtual_stages
    if name in ("naive", "afab", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name == "zb-h1":
        if m < p or w > min(f, b):
            raise ValueError(f"the ZB-H1 formula assumes a full pipeline (m >= p, got m={m}, p={p}) and w <= min(f, b) "
                             f"(got f={f}, b={b}, w={w}); use simulate() for other cases")
        idle = (p - 1) * (f + b - w)
        return idle / (m * (f + b + w) + idle)
    raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")

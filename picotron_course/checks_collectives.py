"""The checks of assignment 00: a ring all-reduce from send and recv, recursive doubling, a hang, on the engine.

Each check runs the learner's function (on 2, 3 and 4 ranks where it communicates, point-to-point only: a
collective raises), observes what it did (the chunks it sent, the tensors it left, the bytes of each message,
what it returned or raised) and compares with single-process torch computed here, in the parent: the plain sum
of every rank's tensor (picotron_course.engine). Nothing here uses picotron.comm.ring_all_reduce, the answer.

    check_chunk_to_send(chunk_to_send)              the ring's schedule: at step t rank r sends chunk (r - t) mod N
    check_reduce_scatter_phase(reduce_scatter_phase) N-1 steps that add: rank r ends with chunk r+1 summed
    check_all_gather_phase(all_gather_phase)        N-1 steps that copy: every rank ends with every chunk
    check_ring_all_reduce(ring_all_reduce)          the sum in place, at most 2(N-1)/N S bytes per rank
    check_recursive_doubling_all_reduce(fn)         stretch: log2 N messages of S bytes; refuses N not a power of 2
    check_hang_diagnosis(hang, fixed_fn)            part 8: read the hang report, then fix the function

Part 8's data (FEATURES, MICRO_BATCH, HANG_SPLIT, shard, first_weights, batch_gradient) and the colleague's
function that hangs (gradient_per_micro_batch) live here too: the notebook imports them. The misconceptions at the
end of each section are wrong answers learners write, with the hint each should read; the correct bases they
change (`_reduce_scatter`, ...) are refused as answers.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from picotron.comm import send_recv
from picotron.launch import device, run
from picotron_course.checks import (COLLECTIVES, _sends_counted, close_enough, only_point_to_point, patched,
                                    rank_tensor, refusing)
from picotron_course.engine import Check, Close, Exact, Misconception, Quantity, named, observe_on_ranks, per_case

__all__ = ["check_chunk_to_send", "check_reduce_scatter_phase", "check_all_gather_phase", "check_ring_all_reduce",
           "check_recursive_doubling_all_reduce", "check_hang_diagnosis", "gradient_per_micro_batch", "mean_gradient",
           "shard", "first_weights", "batch_gradient", "FEATURES", "MICRO_BATCH", "HANG_SPLIT"]

# Chunk schedule of the ring (Playbook, "A quick focus on collective operations"): at ring
# step t (0 <= t < 2(N-1)) rank r sends chunk (r - t) mod N to rank r+1. The first N-1 steps
# add (reduce-scatter), after which rank r holds the full sum of chunk (r+1) mod N; the next
# N-1 steps copy (all-gather).
RING_WORLDS = (2, 3, 4)
RING_DTYPES = (torch.float32, torch.float64)
RING_SHAPES = ((12,), (7,), (3,), (3, 50))  # 12 splits over 2, 3, 4; 7 over none; 3 < 4 ranks; 2-D
PHASE_CHUNK_NUMELS = (1, 5)
RANK = ("rank {}",)
COURSE = __name__   # the correct bases of this file's misconceptions (ONLY), refused as answers


@dataclass(frozen=True)
class Words(Exact):
    """What went wrong, in words ("" when nothing): shown as it is, since it says what to fix."""

    def shown(self, got, want) -> str:
        return str(got) if got else f"expected {want}, got nothing"


@dataclass(frozen=True)
class Sent(Quantity):
    """The bytes a rank sent: more than 0 and at most the expected number (the bound); `why` says what it is."""
    why: str = ""

    def equal(self, got, want) -> bool:
        return isinstance(got, int) and 0 < got <= want

    def shown(self, got, want) -> str:
        return f"{got}; {self.why.format(bound=want)}"


def _on_worlds(run_case: Callable) -> Callable:
    """observe(answers, cases) for cases on several world sizes: observe_on_ranks on the ranks of each world the
    cases name (one launch a world, every answer in it), the observations put back in the cases' order."""
    def observe(answers: list, cases: list) -> list:
        out = [[{} for _ in cases] for _ in answers]
        for world in dict.fromkeys(case["world"] for case in cases):
            index = [i for i, case in enumerate(cases) if case["world"] == world]
            seen = observe_on_ranks(world, run_case)(answers, [cases[i] for i in index])
            for a, per_case_seen in enumerate(seen):
                for i, observed in zip(index, per_case_seen):
                    out[a][i] = observed
        return out
    return observe


def _sum_over_ranks(world: int, shape: tuple, dtype, seed: int) -> torch.Tensor:
    """The single-process answer: the plain sum of every rank's tensor, in float64."""
    return sum(rank_tensor(rank, shape, dtype, seed).double() for rank in range(world))


def _what_came_back(returned, tensor: torch.Tensor, expected: torch.Tensor, n: int) -> str:
    """"the tensor" when a function returned its input itself, otherwise what it returned, in words."""
    if returned is tensor:
        return "the tensor"
    if isinstance(returned, torch.Tensor):
        if returned.shape == expected.shape and close_enough(returned.cpu(), expected, n=n):
            return "a new tensor with the right sum, but the input must be summed in place"
        return "a new tensor, not the one it was given"
    return "None" if returned is None else f"a {type(returned).__name__}"


# ---- 1. chunk_to_send ----------------------------------------------------------------------------
def _observe_chunks(answers: list, cases: list) -> list:
    return [[{"chunks": [_index(fn(step, case["rank"], case["world"])) for step in range(2 * (case["world"] - 1))]}
             for case in cases] for fn in answers]


def _index(value):
    return value if isinstance(value, int) else f"a {type(value).__name__} ({value!r})"


def _expect_chunks(case: dict, observed: dict) -> dict:
    return {"chunks": [(case["rank"] - step) % case["world"] for step in range(2 * (case["world"] - 1))]}


def _chunk(step, rank, world):
    """The correct schedule the misconceptions below change (refused as an answer)."""
    return (rank - step) % world


CHUNK_TO_SEND = Check(
    "chunk_to_send", cases=[dict(world=world, rank=rank) for world in RING_WORLDS for rank in range(world)],
    observe=_observe_chunks, expect=_expect_chunks,
    quantities={"chunks": Exact("the chunk sent at each step: a chunk index is an int in 0..world-1, one per step",
                                axes=("step {}",))},
    columns=lambda case, got: {"expected": _expect_chunks(case, got)["chunks"], "actual": got["chunks"]},
    course=COURSE, only={COURSE: {"_chunk"}},
    misconceptions=[
        Misconception(named("chunk_rotates_the_wrong_way", lambda step, rank, world: (rank + step) % world),
                      "the chunks travel to rank + 1: at step t a rank sends the chunk it received at step t - 1, "
                      "from rank - 1; the index goes down by one each step"),
        Misconception(named("chunk_without_modulo", lambda step, rank, world: rank - step),
                      "take the index mod world (Python's %): rank - step is negative once step > rank"),
        Misconception(named("chunk_one_behind", lambda step, rank, world: _chunk(step + 1, rank, world)),
                      "at step 0 each rank sends its own chunk, chunk rank"),
        Misconception(named("chunk_restarts_for_the_all_gather",
                            lambda step, rank, world: _chunk(step % (world - 1), rank, world)),
                      "the all-gather continues the rotation: step t of either phase sends chunk (rank - t) mod "
                      "world, with t counted from the first step of the reduce-scatter"),
        Misconception(named("chunk_as_a_float", lambda step, rank, world: float(_chunk(step, rank, world))),
                      "return an int: the index picks a chunk from the list `chunks`")])


def check_chunk_to_send(chunk_to_send: Callable[[int, int, int], int]) -> None:
    """At every step of both phases, each rank must send chunk (rank - step) mod world."""
    CHUNK_TO_SEND(chunk_to_send)


# ---- 2, 3. the two phases --------------------------------------------------------------------------
PHASE_CASES = [dict(world=world, chunk_numel=k, dtype=dtype, _seed=seed) for world in RING_WORLDS
               for seed, (k, dtype) in enumerate(itertools.product(PHASE_CHUNK_NUMELS, RING_DTYPES))]


def _owned(rank: int, world: int, k: int) -> slice:
    """The chunk a rank owns after the reduce-scatter, (rank + 1) % world, as a slice of the flat buffer."""
    return slice((rank + 1) % world * k, ((rank + 1) % world + 1) * k)


def _phase_case(title: str, gather: bool, phase: Callable, case: dict) -> dict:
    """One phase on this rank: the chunks replaced by new tensors, the chunks it must have made (reduce-scatter: the
    owned one; all-gather: all), the bytes it sent, and what it returned, in words."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k, dtype, seed = case["chunk_numel"], case["dtype"], case["_seed"]
    flat = rank_tensor(rank, (world * k,), dtype, seed)
    if gather:  # the state after a reduce-scatter: the owned chunk complete, the rest partial
        owned = _owned(rank, world, k)
        flat[owned] = sum(rank_tensor(r, (world * k,), dtype, seed)[owned] for r in range(world))
    flat = flat.to(device())
    chunks = list(flat.split(k))
    originals = list(chunks)
    with only_point_to_point(title) as sent:
        returned = phase(chunks, rank, world)
    replaced = [i for i, (a, b) in enumerate(zip(chunks, originals)) if a is not b]
    return {"replaced": "" if not replaced else (
                f"chunks {replaced} were replaced by new tensors: update them in place (chunks[i] += ..., "
                "chunks[i].copy_(...)), they are views of one buffer"),
            "chunks": flat.cpu()[slice(None) if gather else _owned(rank, world, k)],
            "sent": sent.bytes,
            "returned": "" if returned is None else (
                f"{title} returned a {type(returned).__name__}; return nothing: the phase works in place on "
                "`chunks`, and the caller reads the result there")}


def _expect_phase(case: dict, observed: dict, gather: bool) -> dict:
    world, k, dtype = case["world"], case["chunk_numel"], case["dtype"]
    total = _sum_over_ranks(world, (world * k,), dtype, case["_seed"])
    chunks = [per_case(total[slice(None) if gather else _owned(rank, world, k)], n=world) for rank in range(world)]
    return {"replaced": [""] * world, "chunks": chunks, "sent": [(world - 1) * k * dtype.itemsize] * world,
            "returned": [""] * world}


def _phase_columns(case: dict, got: dict) -> dict:
    return {"sent/rank (B)": max(got["sent"]),
            "N-1 chunks (B)": (case["world"] - 1) * case["chunk_numel"] * case["dtype"].itemsize}


def _phase_quantities(what: str) -> dict:
    return {"replaced": Words("chunks replaced", axes=RANK),
            "chunks": Close(f"{what}: the sum over the ranks", axes=RANK),
            "sent": Sent("the bytes a rank sent", axes=RANK, why="one phase sends N-1 chunks: {bound} bytes"),
            "returned": Words("what the phase returned", axes=RANK)}


def _ring_steps(chunks, rank, world, steps, add: bool) -> None:
    """The ring's schedule at `steps`: send chunk (rank - step) % world to rank + 1, and add (reduce-scatter) or copy
    (all-gather) what rank - 1 sends into chunk (rank - 1 - step) % world."""
    buffer = torch.empty_like(chunks[0])
    for step in steps:
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        into = chunks[(rank - 1 - step) % world]
        into.add_(buffer) if add else into.copy_(buffer)


def _reduce_scatter(chunks, rank, world, steps=None, add=True):
    """The correct reduce-scatter the misconceptions below change (refused as an answer)."""
    _ring_steps(chunks, rank, world, range(world - 1 if steps is None else steps), add)


def _all_gather(chunks, rank, world, first=None, add=False):
    """The correct all-gather the misconceptions below change (refused as an answer)."""
    first = world - 1 if first is None else first
    _ring_steps(chunks, rank, world, range(first, first + world - 1), add)


def rs_rebinds_chunks(chunks, rank, world):
    buffer = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        i = (rank - 1 - step) % world
        chunks[i] = chunks[i] + buffer  # a new tensor: the flat buffer never sees it


REDUCE_SCATTER_PHASE = Check(
    "reduce_scatter_phase", cases=PHASE_CASES,
    observe=_on_worlds(functools.partial(_phase_case, "reduce_scatter_phase", False)),
    expect=functools.partial(_expect_phase, gather=False), quantities=_phase_quantities("chunk (rank + 1) % world"),
    columns=_phase_columns, course=COURSE, only={COURSE: {"_reduce_scatter"}},
    misconceptions=[
        Misconception(rs_rebinds_chunks, "`chunks[i] = chunks[i] + buffer` makes a new tensor the caller never sees: "
                                         "add into the chunk itself, chunks[i] += buffer"),
        Misconception(named("rs_one_step_short", lambda chunks, rank, world: _reduce_scatter(chunks, rank, world,
                                                                                             steps=world - 2)),
                      "the reduce-scatter takes N-1 steps: each adds one more rank's part into the chunk passing by"),
        Misconception(named("rs_copies_instead_of_adds", lambda *args: _reduce_scatter(*args, add=False)),
                      "the reduce-scatter adds what it receives to its own part of the chunk: copying keeps only the "
                      "last rank's sum"),
        Misconception(named("rs_returns_chunks", lambda chunks, *args: _reduce_scatter(chunks, *args) or chunks),
                      "return nothing: the phase works in place on `chunks`, which the caller holds too")])


def check_reduce_scatter_phase(reduce_scatter_phase: Callable) -> None:
    """After the phase, chunk (rank+1) % world of each rank holds the sum of that chunk over ranks."""
    REDUCE_SCATTER_PHASE(reduce_scatter_phase)


def ag_receives_into_new_tensors(chunks, rank, world):
    for step in range(world - 1, 2 * (world - 1)):
        received = torch.empty_like(chunks[0])
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, received, (rank - 1) % world)
        chunks[(rank - 1 - step) % world] = received


ALL_GATHER_PHASE = Check(
    "all_gather_phase", cases=PHASE_CASES,
    observe=_on_worlds(functools.partial(_phase_case, "all_gather_phase", True)),
    expect=functools.partial(_expect_phase, gather=True), quantities=_phase_quantities("every chunk"),
    columns=_phase_columns, course=COURSE, only={COURSE: {"_all_gather"}},
    misconceptions=[
        Misconception(ag_receives_into_new_tensors, "receive into the chunk itself (or copy into it): a new tensor "
                                                    "put in the list is not the caller's buffer"),
        Misconception(named("ag_adds_instead_of_copies", lambda *args: _all_gather(*args, add=True)),
                      "the all-gather copies: the chunk that arrives is already the full sum, so adding it counts the "
                      "rank's own part twice"),
        Misconception(named("ag_starts_at_step_0", lambda *args: _all_gather(*args, first=0)),
                      "the all-gather continues the ring's schedule at step N-1: each rank first sends the chunk it "
                      "completed, (rank + 1) % world"),
        Misconception(named("ag_returns_a_chunk", lambda chunks, rank, world: _all_gather(chunks, rank, world)
                            or chunks[(rank + 1) % world]),
                      "return nothing: every chunk is in `chunks`, which the caller holds too")])


def check_all_gather_phase(all_gather_phase: Callable) -> None:
    """Starting from chunk (rank+1) % world complete on each rank, every rank ends with every chunk."""
    ALL_GATHER_PHASE(all_gather_phase)


# ---- 4. ring_all_reduce ------------------------------------------------------------------------------
def _all_reduce_case(title: str, answers: tuple, fn: Callable, case: dict) -> dict:
    """An all-reduce on this rank: what it returned (in words), the tensor after, the bytes it sent and those of each
    message; on a world size that is not a power of two (recursive doubling), what it did instead of refusing."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if case.get("refused"):
        return {"refused": _refusal(fn, world)}
    shape, dtype, seed = case["shape"], case["dtype"], case["_seed"]
    tensor = rank_tensor(rank, shape, dtype, seed).to(device())
    messages: list[int] = []   # the bytes of each send or isend
    with only_point_to_point(title, answers=answers) as sent, patched(_sends_counted(messages.append)):
        returned = fn(tensor)
    return {"returned": _what_came_back(returned, tensor, _sum_over_ranks(world, shape, dtype, seed), world),
            "sum": tensor.cpu(), "sent": sent.bytes, "messages": messages}


def _expect_ring(case: dict, observed: dict) -> dict:
    world = case["world"]
    want = per_case(_sum_over_ranks(world, case["shape"], case["dtype"], case["_seed"]), n=world)
    # the bound: chunks of ceil(numel / world) elements, N-1 steps a phase; exactly 2(N-1)/N S when world divides numel
    bound = 2 * (world - 1) * math.ceil(math.prod(case["shape"]) / world) * case["dtype"].itemsize
    return {"returned": ["the tensor"] * world, "sum": [want] * world, "sent": [bound] * world}


def _ring(tensor, phases=2, pad=True, give_back=True):
    """The correct ring the misconceptions below change (refused as an answer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world) if pad else tensor.numel() // world
    flat, kept = tensor.new_zeros(world * k), min(tensor.numel(), world * k)
    flat[:kept] = tensor.flatten()[:kept]
    if k:
        chunks = list(flat.split(k))
        _reduce_scatter(chunks, rank, world)
        if phases == 2:
            _all_gather(chunks, rank, world)
    tensor.view(-1)[:kept] = flat[:kept]
    return tensor if give_back else None


def ring_sends_whole_tensor(tensor):
    """Right sum, wrong algorithm: the whole tensor goes around the ring, (N-1) S bytes per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    passing, received = tensor.clone(), torch.empty_like(tensor)
    for _ in range(world - 1):
        send_recv(passing, (rank + 1) % world, received, (rank - 1) % world)
        tensor += received
        passing = received.clone()
    return tensor


RING_ALL_REDUCE = Check(
    "ring_all_reduce", cases=[dict(world=world, shape=shape, dtype=dtype, _seed=seed) for world in RING_WORLDS
                              for seed, (shape, dtype) in enumerate(itertools.product(RING_SHAPES, RING_DTYPES))],
    observe=_on_worlds(functools.partial(_all_reduce_case, "ring_all_reduce", ("ring_all_reduce",))),
    expect=_expect_ring,
    quantities={"returned": Exact("what ring_all_reduce returned: return the tensor it summed in place "
                                  "(`return tensor`)", axes=RANK),
                "sum": Close("every rank's tensor after the call, the sum over the ranks in place", axes=RANK),
                "sent": Sent("the bytes a rank sent", axes=RANK, why="a ring all-reduce sends at most {bound} "
                                                                      "(2(N-1) steps of one chunk), and more than 0")},
    # the bound first: `sent/rank` stays third from the end of a row, where tests/test_course.py reads it
    columns=lambda case, got: {"2(N-1)/N*S (B)": round(2 * (case["world"] - 1) / case["world"]
                                                       * math.prod(case["shape"]) * case["dtype"].itemsize),
                               "sent/rank (B)": max(got["sent"])},
    note="2(N-1)/N*S: what each rank sends in a ring all-reduce of S bytes over N ranks (a little more when N does "
         "not divide the size: padding)",
    course=("picotron.comm", COURSE), only={"picotron.comm": {"ring_all_reduce"}, COURSE: {"_ring"}},
    misconceptions=[
        Misconception(named("ring_not_in_place", lambda tensor: _ring(tensor.clone())),
                      "the returned tensor is right, but the input must be summed in place: write the result into "
                      "`tensor` (tensor.copy_(...)) and return it"),
        Misconception(named("ring_returns_nothing", lambda tensor: _ring(tensor, give_back=False)),
                      "end with `return tensor`: the caller may use the returned tensor"),
        Misconception(named("ring_local_only", lambda tensor: tensor),   # never communicates
                      "communicate: each rank must end with the sum over every rank (a reduce-scatter, then an "
                      "all-gather), not its own tensor"),
        Misconception(named("ring_drops_remainder", lambda tensor: _ring(tensor, pad=False)),
                      "when world does not divide numel, pad the flat tensor to world * ceil(numel / world) elements: "
                      "the last numel % world were left out"),
        Misconception(named("ring_skips_the_all_gather", lambda tensor: _ring(tensor, phases=1)),
                      "after the reduce-scatter each rank holds one summed chunk: the all-gather phase gives every "
                      "rank the others"),
        Misconception(ring_sends_whole_tensor, "pass chunks around the ring, not the whole tensor: a ring sends "
                                               "2(N-1) chunks of S/N bytes, not (N-1) times S")])


def check_ring_all_reduce(ring_all_reduce: Callable) -> None:
    """Every rank's tensor becomes the sum over ranks, in place, sending at most a ring's bytes."""
    RING_ALL_REDUCE(ring_all_reduce)


# ---- 00, stretch: an all-reduce in log2 N steps, by recursive doubling ---------------------------
# At step k (0 <= k < log2 N) rank r swaps its whole running sum with rank r XOR 2^k and adds what it
# receives (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
# MPICH"): log2 N messages of S bytes per rank, against the ring's 2(N-1) messages of S/N. The check
# holds the learner to that count and to the sum one process computes; it has no reference of its own.
DOUBLING_WORLDS = (2, 4)           # powers of two
DOUBLING_REFUSED = 3               # not a power of two: every rank must raise ValueError before any message
DOUBLING_SHAPES = ((6,), (3, 5))   # 1-D and 2-D, a size that 4 does not divide
DOUBLING_DTYPES = RING_DTYPES


class MessageBeforeRefusal(Exception):
    """Raised in the check, on a world size that is not a power of two, by the first send or receive."""


@dataclass(frozen=True)
class Messages(Exact):
    """The bytes of each message a rank sent, against log2 N messages of the whole tensor."""

    def shown(self, got, want) -> str:
        sizes = "/".join(str(size) for size in sorted(set(got))) or "0"
        return (f"{len(got)} messages of {sizes} bytes; recursive doubling on {2 ** len(want)} ranks sends "
                f"log2 N = {len(want)}, each the whole tensor ({want[0]} bytes): at step k, to rank r XOR 2^k")


def _refusal(fn: Callable, world: int) -> str:
    """On a world size that is not a power of two: "" when the learner raised ValueError naming it before any
    send or receive, otherwise what happened instead. Every send and receive raises here, so no rank can
    wait for a partner that has already refused."""
    tensor = rank_tensor(dist.get_rank(), (6,), torch.float32, seed=7).to(device())
    try:
        with only_point_to_point("recursive_doubling_all_reduce"), _no_messages():
            fn(tensor)
    except ValueError as error:
        if str(world) not in str(error):
            return f"the ValueError does not name the world size {world}: {error}"
        return ""
    except MessageBeforeRefusal as error:
        what = f"it {error}"
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's own error, reported in the table
        what = f"it raised {type(error).__name__} ({error})"
    else:
        what = "it returned"
    return f"on {world} ranks (not a power of two) {what}; raise ValueError naming {world} before any send or receive"


@contextmanager
def _no_messages() -> Iterator[None]:
    """Inside the block every send and receive raises MessageBeforeRefusal."""
    def refuse(name: str) -> Callable:
        def call(*args, **kwargs):
            raise MessageBeforeRefusal(f"called dist.{name}")
        call.__name__ = name
        return call

    refusals = {name: refuse(name) for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")}
    with patched([(module, name, call) for module in (dist, c10d) for name, call in refusals.items()]):
        yield


def _expect_doubling(case: dict, observed: dict) -> dict:
    world = case["world"]
    if case.get("refused"):
        return {"refused": [""] * world, "sum": None}
    shape, dtype = case["shape"], case["dtype"]
    want = per_case(_sum_over_ranks(world, shape, dtype, case["_seed"]), n=world)
    nbytes = math.prod(shape) * dtype.itemsize
    return {"returned": ["the tensor"] * world, "sum": [want] * world,
            "messages": [[nbytes] * (world.bit_length() - 1)] * world}


def _doubling_columns(case: dict, got: dict) -> dict:
    if case.get("refused"):
        return {}
    steps, nbytes = case["world"].bit_length() - 1, math.prod(case["shape"]) * case["dtype"].itemsize
    return {"messages/rank": max(len(m) for m in got["messages"]),
            "sent/rank (B)": max(sum(m) for m in got["messages"]), "log2(N) x S (B)": steps * nbytes}


def _steps(world: int) -> int:
    if world & (world - 1):
        raise ValueError(f"recursive doubling needs a power-of-two world size, not {world}")
    return world.bit_length() - 1


def _swap(mine: torch.Tensor, partner: int, received: torch.Tensor, source: int | None = None) -> None:
    send_recv(mine, partner, received, partner if source is None else source)


def _doubling(tensor, skip=0, give_back=True, send_input=False, steps=_steps):
    """The correct recursive doubling the misconceptions below change (refused as an answer)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, received = tensor.clone() if send_input else tensor, torch.empty_like(tensor)
    for k in range(steps(world) - skip):
        _swap(mine, rank ^ (1 << k), received)
        tensor += received
    return tensor if give_back else None


def doubling_overwrites(tensor):
    """Receives straight into the tensor: nothing is ever added."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for k in range(_steps(world)):
        _swap(tensor.clone(), rank ^ (1 << k), tensor)
    return tensor


def doubling_direct(tensor):
    """The right sum, the wrong algorithm: its input to every other rank, N-1 messages of S bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _steps(world)
    mine, received = tensor.clone(), torch.empty_like(tensor)
    for shift in range(1, world):
        _swap(mine, (rank + shift) % world, received, (rank - shift) % world)
        tensor += received
    return tensor


def doubling_checks_after_sending(tensor):
    """Refuses a partner outside the world inside the loop: on 3 ranks, ranks 0 and 1 have exchanged by then."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range((world - 1).bit_length()):       # ceil(log2 N) steps
        partner = rank ^ (1 << k)
        if partner >= world:
            raise ValueError(f"world size {world} is not a power of two")
        _swap(tensor, partner, received)
        tensor += received
    return tensor


def doubling_refuses_vaguely(tensor):
    """Refuses with a ValueError that does not say which world size is wrong."""
    world = dist.get_world_size()
    if world & (world - 1):
        raise ValueError("bad world size")
    return _doubling(tensor)


RECURSIVE_DOUBLING = Check(
    "recursive_doubling_all_reduce",
    cases=[dict(world=world, shape=shape, dtype=dtype, _seed=100 + seed) for world in DOUBLING_WORLDS
           for seed, (shape, dtype) in enumerate(itertools.product(DOUBLING_SHAPES, DOUBLING_DTYPES))]
    + [dict(world=DOUBLING_REFUSED, shape=(6,), dtype=torch.float32, refused="ValueError")],
    observe=_on_worlds(functools.partial(_all_reduce_case, "recursive_doubling_all_reduce", ())),
    expect=_expect_doubling,
    quantities={"returned": Exact("what it returned: return the tensor it summed in place (`return tensor`)",
                                  axes=RANK),
                "sum": Close("every rank's tensor after the call, the sum over the ranks in place", axes=RANK),
                "messages": Messages("the messages a rank sent", axes=RANK),
                "refused": Words("what a rank did on a world size that is not a power of two", axes=RANK)},
    columns=_doubling_columns,
    note="log2(N) x S: what each rank sends by recursive doubling, one message of the whole tensor (S bytes) per step",
    course=COURSE, only={COURSE: {"_doubling"}},
    misconceptions=[
        Misconception(named("doubling_not_in_place", lambda tensor: _doubling(tensor.clone())),
                      "the returned tensor is right, but the input must be summed in place: add into `tensor` "
                      "(tensor += received) and return it"),
        Misconception(named("doubling_returns_nothing", lambda tensor: _doubling(tensor, give_back=False)),
                      "end with `return tensor`: the caller may use the returned tensor"),
        Misconception(doubling_overwrites, "receive into a separate buffer and add it to the running sum: receiving "
                                           "into the tensor replaces this rank's sum by the partner's"),
        Misconception(named("doubling_one_step_short", lambda tensor: _doubling(tensor, skip=1)),
                      "take log2 N steps, k = 0 .. log2 N - 1: after step k each rank holds the sum of a group of "
                      "2^(k+1) ranks"),
        Misconception(named("doubling_sends_the_input", lambda tensor: _doubling(tensor, send_input=True)),
                      "send the running sum at every step, not the rank's input: what a partner added at step 0 must "
                      "travel on at step 1"),
        Misconception(doubling_direct, "exchange with one partner per step, rank XOR 2^k, and send the running sum: "
                                       "log2 N messages, not one to every other rank"),
        Misconception(named("doubling_no_power_check",   # log2 N rounded down, at least 1, whatever N is
                            lambda tensor: _doubling(tensor, steps=lambda world: max(world.bit_length() - 1, 1))),
                      "check the world size before the loop: on 3 ranks rank 2's partner at step 0 would be rank 3; "
                      "raise ValueError naming it"),
        Misconception(doubling_checks_after_sending, "refuse before the first message: every rank can tell from the "
                                                     "world size alone, before ranks 0 and 1 exchange at step 0"),
        Misconception(doubling_refuses_vaguely, "name the world size in the ValueError's message, e.g. "
                                                "f\"... a power of two, not {world}\"")])


def check_recursive_doubling_all_reduce(recursive_doubling_all_reduce: Callable) -> None:
    """On 2 and 4 ranks: the sum over ranks, in place, the tensor returned, and exactly log2 N messages of S
    bytes per rank. On 3 ranks: ValueError naming the world size on every rank, before any message."""
    RECURSIVE_DOUBLING(recursive_doubling_all_reduce)


# ---- 00, part 8: diagnose a hang ------------------------------------------------------------------
# Data parallelism over an uneven split: each rank all-reduces its gradient after each of its own
# micro-batches, so the rank with one micro-batch more makes an all_reduce that no other rank makes and
# waits in it forever. The learner reads the hang report (picotron/collective_trace.py) and fixes the
# function. The check finds the truth the same way, from `run`'s TimeoutError.rank_states.
FEATURES = 4                                    # weights of the linear model
MICRO_BATCH = 4                                 # examples per micro-batch
HANG_SPLIT = (8, 8, 9, 8)                       # examples per rank: 2, 2, 3 and 2 micro-batches
FIX_SPLITS = (HANG_SPLIT, (0, 7, 2, 5), (5, 13, 1), (12, 3))   # a rank without data; 3 and 2 ranks
HANG_TIMEOUTS = (3.0, 12.0)                     # the second try: a loaded machine had not reached the hang
FIX_TIMEOUT = 10.0                              # a fix that still hangs fails after this many seconds


def shard(rank: int, split: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s examples (x, y): `split[rank]` consecutive rows of one dataset of sum(split) examples."""
    x, y = _examples(sum(split))
    start = sum(split[:rank])
    return x[start:start + split[rank]], y[start:start + split[rank]]


def _examples(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(n, FEATURES, generator=generator, dtype=torch.float64)
    return x, x.sum(dim=1) + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)


def first_weights() -> torch.Tensor:
    """The weights rank 0 starts from; it broadcasts them to the others."""
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def batch_gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the summed squared error, sum of (x w - y)^2 / 2 over the examples, by backward
    (zeros for no examples)."""
    w = w.detach().requires_grad_()
    (0.5 * (x @ w - y).square().sum()).backward()
    return w.grad


def gradient_per_micro_batch(split: tuple) -> torch.Tensor:
    """The mean gradient over every example of `split` (examples per rank), all-reduced after each micro-batch."""
    rank = dist.get_rank()
    w = first_weights() if rank == 0 else torch.empty(FEATURES, dtype=torch.float64)
    dist.broadcast(w, src=0)                     # every rank starts from rank 0's weights
    x, y = shard(rank, split)
    grad = torch.zeros_like(w)
    for xb, yb in zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)):
        g = batch_gradient(w, xb, yb)
        # this micro-batch's gradient, summed over the ranks
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


def mean_gradient(split: tuple) -> torch.Tensor:
    """One process's answer: the gradient of the mean squared error over every example of `split`."""
    x, y = _examples(sum(split))
    return batch_gradient(first_weights(), x, y) / sum(split)


_HANGS: dict = {}   # (function, split): its hang, found once per process (a diagnosis is judged against it)


def _hang_of(fn: Callable, split: tuple):
    """Run `fn` until it hangs; return the waiting rank's RankState and {rank: state} of the finished ones."""
    if (fn, split) in _HANGS:
        return _HANGS[fn, split]
    for timeout in HANG_TIMEOUTS:
        try:
            run(fn, len(split), args=(split,), timeout=timeout, backend="gloo")
        except TimeoutError as error:
            waiting = [s for s in error.rank_states if s.phase == "in a collective" and s.collective]
            finished = {s.rank: s for s in error.rank_states if s.phase == "finished"}
            if len(waiting) == 1 and len(finished) == len(split) - 1:
                _HANGS[fn, split] = waiting[0], finished
                return waiting[0], finished
        else:
            raise RuntimeError(f"{fn.__name__}{split} returned: the check expected it to hang")
    raise RuntimeError(f"{fn.__name__}{split} did not reach its hang in {HANG_TIMEOUTS[-1]:g} s: run the check again")


def _diagnosis_hints(hang: dict, waiting, finished: dict) -> list[tuple[str, str]]:
    """(key, "" or the hint for a wrong answer) for "rank", "op" and "call"; no hint gives the answer away."""
    rank, op, call, truth = hang.get("rank"), hang.get("op"), hang.get("call"), waiting.collective
    line = "the line of the rank that waits"
    rank_hint, op_hint, call_hint = "", "", ""
    if isinstance(rank, int) and rank in finished:
        last = finished[rank].collective
        rank_hint = (f"rank {rank} finished the function (after {last.op} #{last.number}): it waits for nothing. "
                     "Name the rank whose line says 'waits in'")
    elif rank != waiting.rank or not isinstance(rank, int):
        rank_hint = "the rank is a number: the one whose line in the report says 'waits in'"
    if _op_key(op) in {_op_key(c) for c in COLLECTIVES} - {_op_key(truth.op)}:
        op_hint = (f"{op} is not the call the waiting rank is stuck in (the ranks got past their other calls): "
                   f"name the operation after 'waits in' on {line}")
    elif _op_key(op) != _op_key(truth.op):
        op_hint = f"write the operation as the report does, e.g. 'all_gather', from {line}"
    if call == truth.number - 1:
        call_hint = "the report counts calls from 1 (#1 is the first): write the number after '#' as it is"
    elif call == truth.number + 1:
        call_hint = ("the report counts each operation on its own: all_reduce #N is the N-th all_reduce, "
                     "whatever other collectives (a broadcast) came before")
    elif call != truth.number or not isinstance(call, int):
        call_hint = f"the call is the number after '#' in {line}"
    hints = {"rank": rank_hint, "op": op_hint, "call": call_hint}
    return [(key, hint if key in hang or not hint else f"the diagnosis has no {key!r}: {hint}")
            for key, hint in hints.items()]


def _op_key(op) -> str:
    """'dist.all_reduce', 'all-reduce', 'allreduce' -> 'allreduce'."""
    return str(op).split(".")[-1].lower().replace("_", "").replace("-", "").replace(" ", "")


def _observe_diagnosis(answers: list, cases: list) -> list:
    waiting, finished = _hang_of(gradient_per_micro_batch, HANG_SPLIT)
    out = []
    for hang in answers:
        hints = dict(_diagnosis_hints(hang, waiting, finished))
        out.append([{"said": hints[case["what"]], "yours": repr(hang.get(case["what"]))} for case in cases])
    return out


class _Diagnosis(dict):
    """A diagnosis (a misconception) under the name its test shows."""


def _diagnosis(name: str, **said) -> dict:
    hang = _Diagnosis(said)
    hang.__name__ = name
    return hang


RIGHT_KEYS = {"rank": 2, "op": "all_reduce"}   # with "call": 3, what the report of HANG_SPLIT shows
HANG_DIAGNOSIS = Check(
    "hang_diagnosis", cases=[dict(what=key) for key in ("rank", "op", "call")],
    observe=_observe_diagnosis, expect=lambda case, got: {"said": ""},
    quantities={"said": Words("your diagnosis")}, columns=lambda case, got: {"yours": got["yours"]},
    note=f"gradient_per_micro_batch{HANG_SPLIT} on {len(HANG_SPLIT)} ranks",
    misconceptions=[
        Misconception(_diagnosis("rank_0", rank=0, op="all_reduce", call=3),
                      "a rank that finished waits for nothing: the hang is the rank still in a collective"),
        Misconception(_diagnosis("rank_3", rank=3, op="all_reduce", call=3),
                      "the last rank is not always the one that hangs: read which rank's line says 'waits in'"),
        Misconception(_diagnosis("rank_as_words", rank="rank 2", op="all_reduce", call=3),
                      "write the rank as an int, not as the words of the report"),
        Misconception(_diagnosis("call_from_0", **RIGHT_KEYS, call=2),
                      "#1 is the first call: copy the number after '#', do not count from 0"),
        Misconception(_diagnosis("call_counts_the_broadcast", **RIGHT_KEYS, call=4),
                      "all_reduce #N counts all_reduce calls only: the broadcast before them is not one"),
        Misconception(_diagnosis("call_guessed", **RIGHT_KEYS, call=7),
                      "read the call off the report: the number after '#' on the waiting rank's line"),
        Misconception(_diagnosis("op_broadcast", rank=2, op="broadcast", call=3),
                      "every rank got past the broadcast: the hang is in the call after 'waits in'"),
        Misconception(_diagnosis("op_sum", rank=2, op="sum", call=3),
                      "name the collective (all_reduce, broadcast, ...), not the reduction it applies"),
        Misconception(_diagnosis("no_call", **RIGHT_KEYS),
                      "a diagnosis has three keys: rank, op and call")])


def _fixed_on_rank(fixed_fn: Callable, split: tuple):
    """The learner's fix on this rank, which must not call the check's reference (each rank has a shard only)."""
    with refusing("your fix", {mean_gradient.__code__: "mean_gradient (the check's own reference)"}):
        return fixed_fn(split)


def _observe_fixes(answers: list, cases: list) -> list:
    """Each fix on each split, on len(split) ranks: "" or how the ranks hung, and each rank's result. After a hang,
    the next splits are not run (each would wait FIX_TIMEOUT again): the first hang is the one to fix."""
    out = []
    for fixed_fn in answers:
        seen, hung = [], ""
        for case in cases:
            if hung:
                seen.append({"hung": f"not run: {hung}"})
                continue
            try:
                per_rank = run(_fixed_on_rank, len(case["split"]), args=(fixed_fn, case["split"]), timeout=FIX_TIMEOUT,
                               backend="gloo")
            except TimeoutError as error:
                where = str(error).split("\n", 1)[-1]   # "Where each rank was ...", one line per rank
                seen.append({"hung": "the ranks hung. " + re.sub(r" for [0-9.]+ s,", ",", where)})
                hung = f"the ranks hung on split {case['split']}"
                continue
            seen.append({"hung": "", "gradient": [g if isinstance(g, torch.Tensor) else
                                                  f"a {type(g).__name__}, not a tensor" for g in per_rank]})
        out.append(seen)
    return out


def _expect_fix(case: dict, observed: dict) -> dict:
    split = case["split"]
    return {"hung": "", "gradient": [per_case(mean_gradient(split), n=sum(split))] * len(split)}


def _start(split: tuple):
    """Rank 0's weights on every rank, and this rank's examples cut into micro-batches."""
    rank = dist.get_rank()
    w = first_weights() if rank == 0 else torch.empty(FEATURES, dtype=torch.float64)
    dist.broadcast(w, src=0)
    x, y = shard(rank, split)
    return w, list(zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)))


def _fixed_gradient(split, agree=dist.ReduceOp.MAX, skip=False):
    """The correct fix the misconceptions below change (refused as an answer): the ranks agree on the most
    micro-batches (all_reduce MAX); a rank out of data all-reduces zeros."""
    w, batches = _start(split)
    steps = torch.tensor(len(batches))
    dist.all_reduce(steps, op=agree)
    grad = torch.zeros_like(w)
    for step in range(min(int(steps), len(batches)) if skip else int(steps)):
        g = batch_gradient(w, *batches[step]) if step < len(batches) else torch.zeros_like(w)
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


FIXED_GRADIENT = Check(
    "fixed gradient", cases=[dict(split=split, world=len(split)) for split in FIX_SPLITS],
    observe=_observe_fixes, expect=_expect_fix,
    quantities={"hung": Words("the fix on this split"),
                "gradient": Close("each rank's result, the mean gradient over every example", axes=RANK)},
    note="every rank's result against one process's mean_gradient",
    course=COURSE, only={COURSE: {"_fixed_gradient", "mean_gradient", "gradient_per_micro_batch"}},
    misconceptions=[
        Misconception(named("fixed_skips_the_call", lambda split: _fixed_gradient(split, skip=True)),   # still hangs
                      "a rank out of data must still make every all_reduce the others make (with a zero gradient): "
                      "skipping it leaves them waiting"),
        Misconception(named("fixed_agrees_on_the_fewest",
                            lambda split: _fixed_gradient(split, agree=dist.ReduceOp.MIN)),
                      "agree on the most micro-batches any rank has (ReduceOp.MAX): the fewest drops the other ranks' "
                      "last examples"),
        Misconception(named("fixed_divides_by_33", lambda split: _fixed_gradient(split) * sum(split) / 33),
                      "divide by the number of examples of the split, sum(split): 33 is HANG_SPLIT's only"),
        Misconception(named("fixed_returns_a_list", lambda split: _fixed_gradient(split).tolist()),
                      "return the gradient as a tensor, as gradient_per_micro_batch does")])


def check_hang_diagnosis(hang: dict, fixed_fn: Callable) -> None:
    """`hang` names what the report of gradient_per_micro_batch on HANG_SPLIT shows: the rank that waits, the
    operation and its call number (from 1). Then `fixed_fn(split)` must return mean_gradient(split) on every
    rank, without hanging, on every split of FIX_SPLITS."""
    if not isinstance(hang, dict):
        raise AssertionError(f'hang is a {type(hang).__name__}; write a dict: {{"rank": ..., "op": ..., "call": ...}}')
    HANG_DIAGNOSIS(hang)
    FIXED_GRADIENT(fixed_fn)

"""The checks of assignment 00 pass correct answers and refuse the course's own.

The correct answers are the checks' own correct bases (the course's answers, which the checks refuse:
unrefused here) and others written here, not taken from the solution notebook (which runs under nbval on
its own); the checks' only reference is the sum one process computes. The wrong answers are the checks'
misconceptions (picotron_course/checks_collectives.py), each failing with its hint (tests/test_misconceptions.py).
"""

import ast

import pytest
import torch
import torch.distributed as dist

import picotron.comm
from picotron.comm import send_recv
from picotron_course import checks_collectives as collectives
from picotron_course.checks import CollectiveNotAllowed
from picotron_course.checks_collectives import (check_all_gather_phase, check_chunk_to_send, check_hang_diagnosis,
                                                check_recursive_doubling_all_reduce, check_reduce_scatter_phase,
                                                check_ring_all_reduce)


# ---- correct answers: the checks' own bases (unrefused here), and others -----------------------------------
def ref_all_gather_phase(chunks, rank, world):
    """Receives straight into the chunk (the checks' own all-gather copies from a buffer)."""
    for step in range(world - 1, 2 * (world - 1)):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, chunks[(rank - 1 - step) % world],
                  (rank - 1) % world)


def ref_ring_all_reduce(tensor):
    """Pads, runs both phases, copies back by reshape (the checks' own ring writes through a view)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world)
    flat = tensor.new_zeros(world * k)
    flat[: tensor.numel()] = tensor.flatten()
    chunks = list(flat.split(k))
    collectives._reduce_scatter(chunks, rank, world)
    ref_all_gather_phase(chunks, rank, world)
    tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))
    return tensor


def _ring_by(exchange):
    """The ring with each step's send and receive made by exchange(chunk to send, where to receive, rank, world)."""
    def ring(tensor):
        rank, world = dist.get_rank(), dist.get_world_size()
        k = -(-tensor.numel() // world)
        flat = tensor.new_zeros(world * k)
        flat[: tensor.numel()] = tensor.flatten()
        chunks, buffer = list(flat.split(k)), torch.empty(k, dtype=tensor.dtype)
        for step in range(2 * (world - 1)):
            into = buffer if step < world - 1 else chunks[(rank - 1 - step) % world]
            exchange(chunks[(rank - step) % world], into, rank, world)
            if step < world - 1:
                chunks[(rank - 1 - step) % world] += buffer
        tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))
        return tensor
    return ring


def _isend_irecv(chunk, into, rank, world):
    for request in [dist.isend(chunk, (rank + 1) % world), dist.irecv(into, (rank - 1) % world)]:
        request.wait()


def _blocking(chunk, into, rank, world):   # even ranks send first, odd ranks receive first
    send = lambda: dist.send(chunk.clone(), (rank + 1) % world)
    recv = lambda: dist.recv(into, (rank - 1) % world)
    for op in ((send, recv) if rank % 2 == 0 else (recv, send)):
        op()


ring_with_isend_irecv = _ring_by(_isend_irecv)           # the same ring, with dist.isend / dist.irecv and waits
ring_with_blocking_send_recv = _ring_by(_blocking)       # and with blocking dist.send / dist.recv


def ref_doubling_blocking(tensor):
    """With blocking dist.send / dist.recv: in each pair, the lower rank sends first. A 2-D tensor, sent whole."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(collectives._steps(world)):
        partner = rank ^ (1 << k)
        if rank < partner:
            dist.send(tensor, partner)
            dist.recv(received, partner)
        else:
            dist.recv(received, partner)
            dist.send(tensor, partner)
        tensor.add_(received)
    return tensor


def ref_doubling_shifted(tensor):
    """Another log2 N algorithm: at step k send to rank + 2^k and receive from rank - 2^k (a dissemination
    all-reduce). Not XOR, but also log2 N messages of S bytes and the right sum: it must pass."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(collectives._steps(world)):
        send_recv(tensor.clone(), (rank + (1 << k)) % world, received, (rank - (1 << k)) % world)
        tensor += received
    return tensor


@pytest.fixture
def unrefused(refusing_nothing):
    """The checks' own bases pass as answers (only this process refuses them)."""
    refusing_nothing(collectives)


RIGHT_HANG = {"rank": 2, "op": "all_reduce", "call": 3}   # what the report of HANG_SPLIT shows


def fixed_one_all_reduce(split):
    """Another fix: accumulate locally, then one all_reduce that every rank makes."""
    w, batches = collectives._start(split)
    grad = sum((collectives.batch_gradient(w, x, y) for x, y in batches), torch.zeros_like(w))
    dist.all_reduce(grad)
    return grad / sum(split)


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"chunk_to_send": 9, "reduce_scatter_phase": 12, "all_gather_phase": 12, "ring_all_reduce": 24,
         "recursive_doubling_all_reduce": 9, "hang_diagnosis": 3, "fixed gradient": 4}


BASES = {"chunk_to_send": (check_chunk_to_send, collectives._chunk),
         "reduce_scatter": (check_reduce_scatter_phase, collectives._reduce_scatter),
         "all_gather": (check_all_gather_phase, collectives._all_gather),
         "ring": (check_ring_all_reduce, collectives._ring),
         "doubling": (check_recursive_doubling_all_reduce, collectives._doubling),
         "fix": (lambda fixed: check_hang_diagnosis(RIGHT_HANG, fixed), collectives._fixed_gradient)}
OTHERS = {"all_gather_in_place": (check_all_gather_phase, ref_all_gather_phase),
          "ring_by_reshape": (check_ring_all_reduce, ref_ring_all_reduce),
          # sent bytes within the ring's bound whatever the point-to-point API: counted once, not twice
          "ring_isend_irecv": (check_ring_all_reduce, ring_with_isend_irecv),
          "ring_blocking": (check_ring_all_reduce, ring_with_blocking_send_recv),
          "doubling_blocking": (check_recursive_doubling_all_reduce, ref_doubling_blocking),
          "doubling_shifted": (check_recursive_doubling_all_reduce, ref_doubling_shifted),
          "fix_one_all_reduce": (lambda fixed: check_hang_diagnosis(RIGHT_HANG, fixed), fixed_one_all_reduce)}


@pytest.mark.parametrize("check, answer", list(BASES.values()), ids=list(BASES))
def test_correct_answer_passes(check, answer, every_case, unrefused):
    check(answer)
    every_case(CASES)


@pytest.mark.parametrize("check, answer", list(OTHERS.values()), ids=list(OTHERS))
def test_another_correct_answer_passes(check, answer, every_case):
    check(answer)
    every_case(CASES)


def test_ring_check_covers_the_cases_it_promises():
    """World sizes 2-4, float32 and float64, sizes that split over the ranks and sizes that do not."""
    assert set(collectives.RING_WORLDS) >= {2, 3, 4} and set(collectives.RING_DTYPES) == {torch.float32, torch.float64}
    numels = [(world, torch.Size(shape).numel()) for world in collectives.RING_WORLDS
              for shape in collectives.RING_SHAPES]
    assert any(n % w == 0 for w, n in numels) and any(n % w for w, n in numels) and any(n < w for w, n in numels)
    assert any(len(shape) > 1 for shape in collectives.RING_SHAPES)


def test_remainder_bug_fails_only_where_world_does_not_divide(capsys):
    with pytest.raises(AssertionError):
        check_ring_all_reduce(next(m.answer for m in collectives.RING_ALL_REDUCE.misconceptions
                                   if m.name == "ring_drops_remainder"))
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("2", "3", "4") and parts[-1] in ("ok", "FAIL"):
            numel = torch.Size(ast.literal_eval(" ".join(parts[1:-5]))).numel()
            assert (parts[-1] == "ok") == (numel % int(parts[0]) == 0), line


def test_doubling_check_covers_what_the_task_says():
    """Powers of two (2 and 4, so log2 N = 1 and 2), float32 and float64, 1-D and 2-D, and a world it refuses."""
    assert set(collectives.DOUBLING_WORLDS) == {2, 4}
    assert set(collectives.DOUBLING_DTYPES) == {torch.float32, torch.float64}
    assert any(len(shape) > 1 for shape in collectives.DOUBLING_SHAPES)
    assert collectives.DOUBLING_REFUSED & (collectives.DOUBLING_REFUSED - 1)   # not a power of two
    assert CASES["recursive_doubling_all_reduce"] == len(collectives.DOUBLING_WORLDS) * len(
        collectives.DOUBLING_SHAPES) * len(collectives.DOUBLING_DTYPES) + 1


def test_a_doubling_that_fails_only_on_four_ranks_is_caught_there(capsys):
    """Sending the input instead of the running sum is right on 2 ranks (one step): only the 4-rank rows fail."""
    with pytest.raises(AssertionError):
        check_recursive_doubling_all_reduce(next(m.answer for m in collectives.RECURSIVE_DOUBLING.misconceptions
                                                 if m.name == "doubling_sends_the_input"))
    results = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()
               if line.split() and line.split()[0] in ("2", "4") and line.split()[-1] in ("ok", "FAIL")}
    assert results == {"2": "ok", "4": "FAIL"}


# ---- answers refused: a collective, and the course's own code ------------------------------------------
def ring_uses_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def fixed_asks_the_reference(split):
    return collectives.mean_gradient(split)


REFUSED = [
    (check_ring_all_reduce, ring_uses_all_reduce, "dist.all_reduce"),
    (check_recursive_doubling_all_reduce, ring_uses_all_reduce, "dist.all_reduce"),
    (check_ring_all_reduce, picotron.comm.ring_all_reduce, "the course's answer"),
    (check_ring_all_reduce, collectives._ring, "the course's answer"),
    (check_chunk_to_send, collectives._chunk, "the course's answer"),
    (check_reduce_scatter_phase, collectives._reduce_scatter, "the course's answer"),
    (check_all_gather_phase, collectives._all_gather, "the course's answer"),
    (check_recursive_doubling_all_reduce, collectives._doubling, "the course's answer"),
    (lambda fixed: check_hang_diagnosis(RIGHT_HANG, fixed), collectives._fixed_gradient, "the course's answer"),
    (lambda fixed: check_hang_diagnosis(RIGHT_HANG, fixed), collectives.mean_gradient, "the course's answer"),
    (lambda fixed: check_hang_diagnosis(RIGHT_HANG, fixed), fixed_asks_the_reference, "called mean_gradient"),
]


@pytest.mark.parametrize("check, answer, says", REFUSED, ids=[f"{a.__name__}-{i}" for i, (_, a, _) in
                                                              enumerate(REFUSED)])
def test_the_course_answer_and_collectives_are_refused(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out.split("check fixed gradient")[-1]   # refused before its table


def test_collective_not_allowed_is_an_assertion():
    assert issubclass(CollectiveNotAllowed, AssertionError)


def test_a_diagnosis_that_is_not_a_dict_is_refused():
    with pytest.raises(AssertionError, match="write a dict"):
        check_hang_diagnosis([2, "all_reduce", 3], collectives._fixed_gradient)


def test_the_check_finds_the_hang_by_running_the_function():
    """No answer is written in the check: on another split another rank waits, in another call."""
    waiting, finished = collectives._hang_of(collectives.gradient_per_micro_batch, (4, 9, 4))   # 1, 3, 1 batches
    assert (waiting.rank, waiting.collective.op, waiting.collective.number) == (1, "all_reduce", 2)
    assert sorted(finished) == [0, 2] and all(s.collective.number == 1 for s in finished.values())


def test_fix_splits_cover_what_the_task_says():
    """An empty shard, 2, 3 and 4 ranks, and the split that hangs."""
    assert collectives.HANG_SPLIT in collectives.FIX_SPLITS and any(0 in split for split in collectives.FIX_SPLITS)
    assert {len(split) for split in collectives.FIX_SPLITS} == {2, 3, 4}


@pytest.mark.parametrize("op", ["all_reduce", "dist.all_reduce", "all-reduce", "AllReduce"])
def test_the_operation_may_be_written_several_ways(op):
    hang = collectives._hang_of(collectives.gradient_per_micro_batch, collectives.HANG_SPLIT)
    assert all(hint == "" for _, hint in collectives._diagnosis_hints({**RIGHT_HANG, "op": op}, *hang))

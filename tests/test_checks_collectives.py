"""The checks of assignment 00 pass correct answers and fail planted wrong ones.

The stretch check (recursive doubling) and part 8's hang diagnosis are tested here in full; the four
checks of the guided part are tested in tests/test_course.py, and here only for what the task text asks
of them beyond the numbers: a phase returns nothing, ring_all_reduce returns its tensor.

The correct answers are written here, not taken from the solution notebook (which runs under nbval
on its own), and picotron has no recursive doubling: the check's only reference is the sum one
process computes.
"""

import re

import pytest
import torch
import torch.distributed as dist

from picotron.comm import send_recv
from picotron_course import checks
from picotron_course.checks import (check_all_gather_phase, check_recursive_doubling_all_reduce,
                                    check_reduce_scatter_phase, check_ring_all_reduce)


# ---- correct answers ------------------------------------------------------------------------------
def _steps(world):
    if world & (world - 1):
        raise ValueError(f"recursive doubling needs a power-of-two world size, not {world}")
    return world.bit_length() - 1


def ref_doubling(tensor):
    """With send_recv: at step k, swap the running sum with rank XOR 2^k and add."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(_steps(world)):
        partner = rank ^ (1 << k)
        send_recv(tensor, partner, received, partner)
        tensor += received
    return tensor


def ref_doubling_blocking(tensor):
    """With blocking dist.send / dist.recv: in each pair, the lower rank sends first. A 2-D tensor, sent whole."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(_steps(world)):
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
    for k in range(_steps(world)):
        send_recv(tensor.clone(), (rank + (1 << k)) % world, received, (rank - (1 << k)) % world)
        tensor += received
    return tensor


@pytest.mark.parametrize("answer", [ref_doubling, ref_doubling_blocking, ref_doubling_shifted],
                         ids=lambda f: f.__name__)
def test_correct_doubling_passes(answer, capsys):
    check_recursive_doubling_all_reduce(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out
    rows = [line.split() for line in out.splitlines() if line.endswith(" ok")]
    assert len(rows) == len(checks.DOUBLING_WORLDS) * len(checks.DOUBLING_SHAPES) * len(checks.DOUBLING_DTYPES) + 1


def test_doubling_check_covers_what_the_task_says():
    """Powers of two (2 and 4, so log2 N = 1 and 2), float32 and float64, 1-D and 2-D, and a world it refuses."""
    assert set(checks.DOUBLING_WORLDS) == {2, 4} and set(checks.DOUBLING_DTYPES) == {torch.float32, torch.float64}
    assert any(len(shape) > 1 for shape in checks.DOUBLING_SHAPES)
    assert checks.DOUBLING_REFUSED & (checks.DOUBLING_REFUSED - 1)   # not a power of two


# ---- planted wrong answers ------------------------------------------------------------------------
def doubling_overwrites(tensor):
    """Receives straight into the tensor: nothing is ever added."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for k in range(_steps(world)):
        partner = rank ^ (1 << k)
        outgoing = tensor.clone()
        send_recv(outgoing, partner, tensor, partner)
    return tensor


def doubling_one_step_short(tensor):
    """Stops one step early: on 4 ranks each holds a pair's sum, on 2 ranks it never communicates."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(_steps(world) - 1):
        partner = rank ^ (1 << k)
        send_recv(tensor, partner, received, partner)
        tensor += received
    return tensor


def doubling_sends_the_input(tensor):
    """Sends its own input at every step instead of the running sum: on 4 ranks, rank r misses rank r XOR 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, received = tensor.clone(), torch.empty_like(tensor)
    for k in range(_steps(world)):
        partner = rank ^ (1 << k)
        send_recv(mine, partner, received, partner)
        tensor += received
    return tensor


def doubling_direct(tensor):
    """The right sum, the wrong algorithm: its input to every other rank, N-1 messages of S bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _steps(world)
    mine, received = tensor.clone(), torch.empty_like(tensor)
    for shift in range(1, world):
        send_recv(mine, (rank + shift) % world, received, (rank - shift) % world)
        tensor += received
    return tensor


def doubling_not_in_place(tensor):
    """Builds the sum in a new tensor and returns it; the caller's tensor is left as it was."""
    rank, world = dist.get_rank(), dist.get_world_size()
    total, received = tensor.clone(), torch.empty_like(tensor)
    for k in range(_steps(world)):
        partner = rank ^ (1 << k)
        send_recv(total, partner, received, partner)
        total = total + received
    return total


def doubling_returns_nothing(tensor):
    """The right sum in place, but no `return tensor`."""
    ref_doubling(tensor)


def doubling_no_power_check(tensor):
    """No check of the world size: on 3 ranks rank 2's partner would be rank 3."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    for k in range(max(world.bit_length() - 1, 1)):
        partner = rank ^ (1 << k)
        send_recv(tensor, partner, received, partner)
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
        send_recv(tensor, partner, received, partner)
        tensor += received
    return tensor


def doubling_refuses_vaguely(tensor):
    """Refuses with a ValueError that does not say which world size is wrong."""
    world = dist.get_world_size()
    if world & (world - 1):
        raise ValueError("bad world size")
    return ref_doubling(tensor)


def doubling_uses_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


WRONG_DOUBLING = [
    (doubling_overwrites, "worst at element"),
    (doubling_one_step_short, "worst at element"),
    (doubling_sends_the_input, "worst at element"),
    (doubling_direct, "log2 N = 2"),
    (doubling_not_in_place, "in place"),
    (doubling_returns_nothing, "return the tensor"),
    (doubling_no_power_check, "raise ValueError naming 3"),
    (doubling_checks_after_sending, "called dist.batch_isend_irecv"),
    (doubling_refuses_vaguely, "does not name the world size 3"),
    (doubling_uses_all_reduce, "dist.all_reduce"),
]


@pytest.mark.parametrize("answer, says", WRONG_DOUBLING, ids=[a.__name__ for a, _ in WRONG_DOUBLING])
def test_wrong_doubling_fails(answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check_recursive_doubling_all_reduce(answer)
    if answer is not doubling_uses_all_reduce:   # a collective stops the check before its table
        assert "FAIL" in capsys.readouterr().out


def test_a_doubling_that_fails_only_on_four_ranks_is_caught_there(capsys):
    """Sending the input instead of the running sum is right on 2 ranks (one step): only the 4-rank rows fail."""
    with pytest.raises(AssertionError):
        check_recursive_doubling_all_reduce(doubling_sends_the_input)
    results = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()
               if line.split() and line.split()[0] in ("2", "4") and line.split()[-1] in ("ok", "FAIL")}
    assert results == {"2": "ok", "4": "FAIL"}


# ---- what the guided part's texts ask beyond the numbers -------------------------------------------
def rs_returns_chunks(chunks, rank, world):
    """The right phase, but it returns the list: the task says return nothing."""
    buffer = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        chunks[(rank - 1 - step) % world] += buffer
    return chunks


def ag_returns_a_chunk(chunks, rank, world):
    for step in range(world - 1, 2 * (world - 1)):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, chunks[(rank - 1 - step) % world],
                  (rank - 1) % world)
    return chunks[(rank + 1) % world]


def ring_returns_nothing(tensor):
    """Sums in place with the right bytes, but forgets `return tensor`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world)
    flat = tensor.new_zeros(world * k)
    flat[: tensor.numel()] = tensor.flatten()
    chunks = list(flat.split(k))
    rs_returns_chunks(chunks, rank, world)
    ag_returns_a_chunk(chunks, rank, world)
    tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))


@pytest.mark.parametrize("check, answer, says", [(check_reduce_scatter_phase, rs_returns_chunks, "return nothing"),
                                                 (check_all_gather_phase, ag_returns_a_chunk, "return nothing"),
                                                 (check_ring_all_reduce, ring_returns_nothing, "return the tensor")],
                         ids=["reduce_scatter_returns", "all_gather_returns", "ring_returns_none"])
def test_guided_checks_hold_to_their_text(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" in capsys.readouterr().out


# ---- part 8: diagnose a hang ------------------------------------------------------------------------
# gradient_per_micro_batch on HANG_SPLIT = (8, 8, 9, 8): rank 2 has 3 micro-batches, the others 2, so rank 2
# waits in all_reduce #3 and the others finish after all_reduce #2. The check finds that by running it.
RIGHT_HANG = {"rank": 2, "op": "all_reduce", "call": 3}


def _start(split):
    """Rank 0's weights on every rank, and this rank's examples cut into micro-batches."""
    rank = dist.get_rank()
    w = checks.first_weights() if rank == 0 else torch.empty(checks.FEATURES, dtype=torch.float64)
    dist.broadcast(w, src=0)
    x, y = checks.shard(rank, split)
    return w, list(zip(x.split(checks.MICRO_BATCH), y.split(checks.MICRO_BATCH)))


def fixed_agree_on_steps(split):
    """The ranks agree on the most micro-batches (all_reduce MAX); a rank out of data all-reduces zeros."""
    w, batches = _start(split)
    steps = torch.tensor(len(batches))
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    grad = torch.zeros_like(w)
    for step in range(int(steps)):
        g = checks.batch_gradient(w, *batches[step]) if step < len(batches) else torch.zeros_like(w)
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


def fixed_one_all_reduce(split):
    """Another fix: accumulate locally, then one all_reduce that every rank makes."""
    w, batches = _start(split)
    grad = sum((checks.batch_gradient(w, x, y) for x, y in batches), torch.zeros_like(w))
    dist.all_reduce(grad)
    return grad / sum(split)


@pytest.mark.parametrize("fixed", [fixed_agree_on_steps, fixed_one_all_reduce], ids=lambda f: f.__name__)
def test_correct_diagnosis_and_fix_pass(fixed, capsys):
    checks.check_hang_diagnosis(RIGHT_HANG, fixed)
    out = capsys.readouterr().out
    assert "FAIL" not in out and "hang_diagnosis: 3/3" in out and f"{len(checks.FIX_SPLITS)}/" in out


def test_the_check_finds_the_hang_by_running_the_function():
    """No answer is written in the check: on another split another rank waits, in another call."""
    waiting, finished = checks._hang_of(checks.gradient_per_micro_batch, (4, 9, 4))   # 1, 3 and 1 micro-batches
    assert (waiting.rank, waiting.collective.op, waiting.collective.number) == (1, "all_reduce", 2)
    assert sorted(finished) == [0, 2] and all(s.collective.number == 1 for s in finished.values())


def test_fix_splits_cover_what_the_task_says():
    """An empty shard, 2, 3 and 4 ranks, and the split that hangs."""
    assert checks.HANG_SPLIT in checks.FIX_SPLITS and any(0 in split for split in checks.FIX_SPLITS)
    assert {len(split) for split in checks.FIX_SPLITS} == {2, 3, 4}


@pytest.fixture(scope="module")
def hang_truth():
    """The hang of HANG_SPLIT, found once for the tests below (each would otherwise wait for it again)."""
    return checks._hang_of(checks.gradient_per_micro_batch, checks.HANG_SPLIT)


@pytest.fixture
def known_hang(hang_truth, monkeypatch):
    monkeypatch.setattr(checks, "_hang_of", lambda fn, split: hang_truth)
    monkeypatch.setattr(checks, "FIX_TIMEOUT", 3.0)   # a fix that hangs fails in 3 s here


@pytest.mark.parametrize("op", ["all_reduce", "dist.all_reduce", "all-reduce", "AllReduce"])
def test_the_operation_may_be_written_several_ways(op, hang_truth):
    assert all(hint == "" for _, hint in checks._diagnosis_hints({**RIGHT_HANG, "op": op}, *hang_truth))


WRONG_DIAGNOSES = [
    ({**RIGHT_HANG, "rank": 0}, "rank 0 finished the function (after all_reduce #2): it waits for nothing"),
    ({**RIGHT_HANG, "rank": 3}, "rank 3 finished the function"),
    ({**RIGHT_HANG, "rank": "rank 2"}, "the rank is a number"),
    ({**RIGHT_HANG, "call": 2}, "the report counts calls from 1"),
    ({**RIGHT_HANG, "call": 4}, "the report counts each operation on its own"),
    ({**RIGHT_HANG, "call": 7}, "the call is the number after '#'"),
    ({**RIGHT_HANG, "op": "broadcast"}, "broadcast is not the call the waiting rank is stuck in"),
    ({**RIGHT_HANG, "op": "sum"}, "write the operation as the report does"),
    ({"rank": 2, "op": "all_reduce"}, "the call is the number after '#'"),
]


@pytest.mark.parametrize("hang, says", WRONG_DIAGNOSES, ids=[str(h) for h, _ in WRONG_DIAGNOSES])
def test_wrong_diagnosis_fails_with_its_hint(hang, says, known_hang, capsys):
    with pytest.raises(AssertionError, match=re.escape(says)):
        checks.check_hang_diagnosis(hang, fixed_agree_on_steps)
    out = capsys.readouterr().out
    assert "FAIL" in out and "fixed gradient" not in out   # the fix is not run before the diagnosis is right


def test_a_diagnosis_that_is_not_a_dict_is_refused(known_hang):
    with pytest.raises(AssertionError, match="write a dict"):
        checks.check_hang_diagnosis([2, "all_reduce", 3], fixed_agree_on_steps)


def fixed_skips_the_call(split):
    """Agrees on the steps, but a rank out of data skips the all_reduce: it still hangs."""
    w, batches = _start(split)
    steps = torch.tensor(len(batches))
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    grad = torch.zeros_like(w)
    for step in range(min(int(steps), len(batches))):
        g = checks.batch_gradient(w, *batches[step])
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


def fixed_agrees_on_the_fewest(split):
    """all_reduce MIN: no hang, but rank 2's last micro-batch is dropped."""
    w, batches = _start(split)
    steps = torch.tensor(len(batches))
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    grad = torch.zeros_like(w)
    for step in range(int(steps)):
        g = checks.batch_gradient(w, *batches[step])
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


def fixed_divides_by_33(split):
    """Right on HANG_SPLIT (33 examples) only: the mean's denominator is written in."""
    return fixed_one_all_reduce(split) * sum(split) / 33


def fixed_asks_the_reference(split):
    return checks.mean_gradient(split)


def fixed_returns_a_list(split):
    return fixed_one_all_reduce(split).tolist()


WRONG_FIXES = [
    (fixed_skips_the_call, "split (8, 8, 9, 8): the ranks hung. Where each rank was"),
    (fixed_agrees_on_the_fewest, "split (8, 8, 9, 8), rank 0: worst at element"),
    (fixed_divides_by_33, "split (0, 7, 2, 5), rank 0: worst at element"),
    (fixed_asks_the_reference, "called mean_gradient"),
    (fixed_returns_a_list, "returned a list, not a tensor"),
]


@pytest.mark.parametrize("fixed, says", WRONG_FIXES, ids=[f.__name__ for f, _ in WRONG_FIXES])
def test_wrong_fix_fails(fixed, says, known_hang, capsys):
    with pytest.raises(AssertionError, match=re.escape(says)):
        checks.check_hang_diagnosis(RIGHT_HANG, fixed)
    if fixed is not fixed_asks_the_reference:   # raised on a rank: no table
        assert "FAIL" in capsys.readouterr().out

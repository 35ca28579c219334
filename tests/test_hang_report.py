"""run()'s TimeoutError says where each rank was: the collective it waits in, or that it finished or computes.

Each hang below is planted on purpose and ends at a short timeout; the report (picotron/collective_trace.py)
must name the right rank, operation, call number, group, bytes and line of the user's code.
"""

import inspect
import linecache
import re
import statistics
import time
import types

import pytest
import torch
import torch.distributed as dist

from picotron import collective_trace, comm
from picotron.collective_trace import Collective, RankState
from picotron.launch import run

TIMEOUT = 5  # seconds: long enough for 2-3 ranks to reach their hang on a loaded machine, short for the suite


def hang_report(fn, world_size, **kwargs) -> str:
    """The TimeoutError's message, printed (the report text is part of what this test file shows)."""
    with pytest.raises(TimeoutError) as info:
        run(fn, world_size, timeout=TIMEOUT, **kwargs)
    message = str(info.value)
    print(message)
    return message


def line_of(fn, text: str) -> int:
    """The line number of the first line of `fn` that contains `text`."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def rank_line(message: str, rank: int) -> str:
    """The report's line about `rank`."""
    lines = [line.strip() for line in message.splitlines() if line.strip().startswith(f"rank {rank} ")]
    assert len(lines) == 1, message
    return lines[0]


# ---- (1) a collective called on one rank only ---------------------------------------------------
def extra_all_reduce_on_rank_1():
    x = torch.ones(1024)                 # 4 KiB
    comm.all_reduce(x)                   # through picotron.comm: counted once, not twice
    dist.all_reduce(x)
    if dist.get_rank() == 1:
        dist.all_reduce(x)               # the third call, which rank 0 never makes
    return x.sum().item()


def test_a_collective_on_one_rank_only():
    message = hang_report(extra_all_reduce_on_rank_1, 2)
    assert message.startswith("ranks [1] had not finished after 5 s; every rank was killed.")
    assert "\nWhere each rank was when the time ran out:\n" in message
    line = line_of(extra_all_reduce_on_rank_1, "the third call")
    assert re.fullmatch(rf"rank 1 waits in all_reduce #3 of group \[0, 1\] \(4 KiB\) for [\d.]+ s, at "
                        rf"tests/test_hang_report\.py:{line}: `dist\.all_reduce\(x\)  +# the third call, .*`",
                        rank_line(message, 1)), message
    assert rank_line(message, 0) == "rank 0 finished the function after all_reduce #2 of group [0, 1] (4 KiB)"


# ---- (2) a mismatched pair ----------------------------------------------------------------------
def all_reduce_against_broadcast():
    x = torch.ones(256)                  # 1 KiB
    if dist.get_rank() == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)
    return x.sum().item()


def test_a_mismatched_pair_all_reduce_against_broadcast():
    """gloo hangs on this pair (both ranks wait, each in its own collective)."""
    message = hang_report(all_reduce_against_broadcast, 2)
    assert message.startswith("ranks [0, 1] had not finished")
    assert re.fullmatch(rf"rank 0 waits in all_reduce #1 of group \[0, 1\] \(1 KiB\) for [\d.]+ s, at "
                        rf"tests/test_hang_report\.py:{line_of(all_reduce_against_broadcast, 'all_reduce(x)')}: "
                        rf"`dist\.all_reduce\(x\)`", rank_line(message, 0)), message
    assert re.fullmatch(rf"rank 1 waits in broadcast #1 from 0 of group \[0, 1\] \(1 KiB\) for [\d.]+ s, at "
                        rf"tests/test_hang_report\.py:{line_of(all_reduce_against_broadcast, 'broadcast(x')}: "
                        rf"`dist\.broadcast\(x, src=0\)`", rank_line(message, 1)), message


# ---- (3) a subgroup -----------------------------------------------------------------------------
def extra_all_reduce_in_a_subgroup():
    pair = dist.new_group([1, 2])        # every rank creates it; only ranks 1 and 2 are in it
    x = torch.ones(2, dtype=torch.float64)
    if dist.get_rank() in (1, 2):
        dist.all_reduce(x, group=pair)
    if dist.get_rank() == 2:
        dist.all_reduce(x, group=pair)   # rank 1 never makes this second call on the pair
    return x.sum().item()


def test_a_collective_on_a_subgroup_names_its_global_ranks():
    message = hang_report(extra_all_reduce_in_a_subgroup, 3)
    assert message.startswith("ranks [2] had not finished")
    line = line_of(extra_all_reduce_in_a_subgroup, "never makes")
    assert re.fullmatch(rf"rank 2 waits in all_reduce #2 of group \[1, 2\] \(16 B\) for [\d.]+ s, at "
                        rf"tests/test_hang_report\.py:{line}: .*", rank_line(message, 2)), message
    assert rank_line(message, 1) == "rank 1 finished the function after all_reduce #1 of group [1, 2] (16 B)"
    assert rank_line(message, 0) == "rank 0 finished the function without calling a collective"


# ---- (4) async_op=True, and the wait on its work --------------------------------------------------
def async_all_reduce_on_rank_0():
    x = torch.ones(3)
    if dist.get_rank() == 0:
        work = dist.all_reduce(x, async_op=True)
        work.wait()                      # rank 1 never joins: the wait is where rank 0 hangs
    return x.sum().item()


def test_an_async_collective_hangs_in_the_wait_on_its_work():
    message = hang_report(async_all_reduce_on_rank_0, 2)
    line = line_of(async_all_reduce_on_rank_0, "work.wait()")
    assert re.fullmatch(rf"rank 0 waits in the wait\(\) on the work of all_reduce #1 of group \[0, 1\] \(12 B\) "
                        rf"for [\d.]+ s, at tests/test_hang_report\.py:{line}: `work\.wait\(\) .*`",
                        rank_line(message, 0)), message
    assert rank_line(message, 1) == "rank 1 finished the function without calling a collective"


# ---- (5) one rank computes while the other waits --------------------------------------------------
def rank_0_computes_while_rank_1_exchanges():
    x = torch.ones(4)
    dist.all_reduce(x)
    if dist.get_rank() == 0:
        time.sleep(600)                  # "computing": in no collective
    else:
        comm.send_recv(x, 0, torch.empty(4), 0)  # a batch_isend_irecv, then the wait on its works
    return 0


def test_a_rank_computing_while_another_waits():
    message = hang_report(rank_0_computes_while_rank_1_exchanges, 2)
    assert message.startswith("ranks [0, 1] had not finished")
    all_reduce_line = line_of(rank_0_computes_while_rank_1_exchanges, "dist.all_reduce(x)")
    assert rank_line(message, 0) == (
        "rank 0 is not in a collective (computing, or waiting on something else); its last collective was "
        f"all_reduce #1 of group [0, 1] (16 B), at tests/test_hang_report.py:{all_reduce_line}: `dist.all_reduce(x)`")
    # picotron.comm's frames are skipped: the user's line is the call of comm.send_recv.
    line = line_of(rank_0_computes_while_rank_1_exchanges, "comm.send_recv")
    assert re.fullmatch(rf"rank 1 waits in the wait\(\) on the work of batch_isend_irecv #1 "
                        rf"\(isend to 0, irecv from 0\) of group \[0, 1\] \(16 B\) for [\d.]+ s, at "
                        rf"tests/test_hang_report\.py:{line}: `comm\.send_recv\(.*`", rank_line(message, 1)), message


# ---- (6) a function from a notebook cell ----------------------------------------------------------
CELL = '''\
import torch, torch.distributed as dist

def cell_hang():
    t = torch.zeros(5)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        dist.all_reduce(t)  # the cell's line 7
    return 0
'''


def test_a_function_defined_in_a_notebook_cell_shows_the_cells_line():
    """A cell's code has a file name that is no file (Jupyter's /tmp/ipykernel_*/N.py) and its lines only in
    the kernel's linecache; the function travels by value (its module cannot be imported by the ranks)."""
    file_name = "/nonexistent/ipykernel_31/hang_cell.py"
    linecache.cache[file_name] = (len(CELL), None, CELL.splitlines(keepends=True), file_name)
    module = types.ModuleType("a_notebook_cell")
    exec(compile(CELL, file_name, "exec"), module.__dict__)
    message = hang_report(module.cell_hang, 2)
    assert re.fullmatch(rf"rank 1 waits in all_reduce #2 of group \[0, 1\] \(20 B\) for [\d.]+ s, at "
                        rf"{file_name}:7: `dist\.all_reduce\(t\)  # the cell's line 7`", rank_line(message, 1)), message
    assert rank_line(message, 0) == "rank 0 finished the function after all_reduce #1 of group [0, 1] (20 B)"


# ---- the report's other phrasings, and the wrappers staying out of tracebacks -------------------
def test_report_lines_for_ranks_still_starting_connecting_or_computing_under_nccl():
    last = Collective("reduce_scatter", 4, "[0, 2]", 3 * 2**20 // 2, "", "", "model.py", 12, 0.0)
    states = [RankState(0, "unknown", None), RankState(1, "connecting", None), RankState(2, "running", last),
              RankState(3, "in a collective", Collective("recv", 1, "[0, 1, 2, 3]", 8, "from 2", "", "", 0, 10.0))]
    text = collective_trace.report(states, backend="nccl", now=12.5, what="the cell")
    assert text.splitlines() == [
        "rank 0 had not reached the cell yet (still starting)",
        "rank 1 is still connecting to the other ranks (joining the process group)",
        "rank 2 is not in a collective call (computing, or waiting on something else; under NCCL a collective "
        "returns once it is queued on the GPU, so this may be a wait at a synchronisation such as .item() for its "
        "last collective); its last collective was reduce_scatter #4 of group [0, 2] (1.5 MiB), at model.py:12",
        "rank 3 waits in recv #1 from 2 of group [0, 1, 2, 3] (8 B) for 2.5 s, at an unknown line",
    ]


def wrong_argument():
    dist.all_reduce([torch.ones(1)])     # a list where a tensor belongs: torch raises


def test_an_error_inside_a_collective_has_no_tracing_frames_in_its_traceback():
    with pytest.raises(Exception) as info:
        run(wrong_argument, 2, timeout=60)
    traceback = info.value.rank_traceback
    assert "in wrong_argument" in traceback and "dist.all_reduce([torch.ones(1)])" in traceback
    assert "collective_trace" not in traceback, traceback


# ---- (7) what tracing costs ----------------------------------------------------------------------
def traced_and_plain_all_reduce(calls):
    """Per-call time of an all_reduce of one float, traced (dist.all_reduce, the wrapper) and not (the torch
    function it wraps), alternating so that both see the same machine; medians in microseconds."""
    traced, plain = dist.all_reduce, collective_trace.original("all_reduce")
    x = torch.zeros(1)
    times = {"traced": [], "plain": []}
    for i in range(calls):
        for name, call in ((("traced", traced), ("plain", plain)) if i % 2 else (("plain", plain), ("traced", traced))):
            x.fill_(1.0)
            start = time.perf_counter_ns()
            call(x)
            times[name].append(time.perf_counter_ns() - start)
            assert x.item() == dist.get_world_size()  # each call did its all-reduce
    return {name: statistics.median(values) / 1000 for name, values in times.items()}, traced.__wrapped__ is plain


def test_tracing_overhead_on_an_all_reduce_of_one_float():
    """Measured, printed, not asserted as a timing (this machine's load decides the numbers)."""
    results = run(traced_and_plain_all_reduce, 2, args=(2000,), backend="gloo", timeout=120)
    for rank, (medians, wraps) in enumerate(results):
        assert wraps, "dist.all_reduce on a rank is not the tracing wrapper"
        print(f"rank {rank}: all_reduce of 1 float, median of 2000: {medians['plain']:.1f} us plain, "
              f"{medians['traced']:.1f} us traced ({medians['traced'] - medians['plain']:+.1f} us)")

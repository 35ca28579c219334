"""picotron.launch.run: results, errors, timeouts, and no process left behind."""

import os
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from picotron.launch import RankError, run


def _children() -> list:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


def rank_sum(offset):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} says hi")
    return t.item() + offset


def test_returns_per_rank_results_and_prints_with_prefix(capsys):
    assert run(rank_sum, 4, args=(10,)) == [16.0] * 4
    out = capsys.readouterr().out
    for r in range(4):
        assert f"[rank {r}] rank {r} of 4 says hi" in out


def test_two_runs_back_to_back():
    assert run(rank_sum, 2, args=(0,)) == [1.0, 1.0]
    assert run(rank_sum, 3, args=(1,)) == [4.0, 4.0, 4.0]


def test_ranks_are_seeded_alike_and_single_threaded():
    def draw():
        return torch.rand(3), torch.get_num_threads()
    results = run(draw, 3, seed=7)
    expected = torch.Generator().manual_seed(7)
    expected = torch.rand(3, generator=expected)
    for values, threads in results:
        torch.testing.assert_close(values, expected)
        assert threads == 1


def raise_on_rank_2():
    if dist.get_rank() == 2:
        raise NotImplementedError("write the ring step")
    dist.barrier()  # the others wait for rank 2, which never comes: they must be stopped


def test_a_failing_rank_raises_its_exception_type_with_traceback():
    start = time.monotonic()
    with pytest.raises(NotImplementedError) as info:
        run(raise_on_rank_2, 4, timeout=60)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "rank 2" in message and "write the ring step" in message
    assert "raise_on_rank_2" in message  # the rank's traceback
    assert not _children()


def test_a_hanging_rank_times_out_and_is_killed():
    def hang_on_rank_1():
        if dist.get_rank() == 1:
            time.sleep(600)
        return dist.get_rank()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] had not finished after 2 s"):
        run(hang_on_rank_1, 3, timeout=2)
    assert time.monotonic() - start < 6
    assert not _children()


def test_a_rank_that_dies_is_reported():
    def die():
        if dist.get_rank() == 1:
            os._exit(3)
        return 0
    with pytest.raises(RankError, match="rank 1 \\(exit code 3\\) died without a result"):
        run(die, 2, timeout=20)
    assert not _children()


def test_exception_classes_defined_locally_still_come_back():
    class LocalError(Exception):
        pass

    def fail():
        raise LocalError("local")
    with pytest.raises(RankError, match="LocalError: local"):
        run(fail, 2, timeout=20)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        run(rank_sum, 0)


def test_from_a_notebook_cell_results_crashes_and_hangs():
    """What a learner sees in Jupyter: a cell-defined function runs on 4 ranks, and a crashing
    rank and a hanging rank come back to the cell as errors within the timeout."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "import time, torch, torch.distributed as dist\nfrom picotron.launch import run",
        "def double_rank():\n    return 2 * dist.get_rank()\nassert run(double_rank, 4) == [0, 2, 4, 6]",
        "def crash():\n    if dist.get_rank() == 3:\n        raise KeyError('no such layer')\n"
        "    print(f'rank {dist.get_rank()} waits', flush=True)\n    dist.barrier()\n"
        "start = time.monotonic()\ntry:\n    run(crash, 4, timeout=60)\nexcept KeyError as e:\n    error = str(e)\n"
        "assert 'rank 3' in error and 'no such layer' in error and time.monotonic() - start < 10",
        "def hang():\n    if dist.get_rank() == 0:\n        time.sleep(600)\n"
        "start = time.monotonic()\ntry:\n    run(hang, 4, timeout=3)\nexcept TimeoutError as e:\n    error = str(e)\n"
        "assert 'ranks [0] had not finished' in error and time.monotonic() - start < 8",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    crash_output = "".join(o.get("text", "") for o in notebook.cells[2].outputs)
    assert "[rank 1] rank 1 waits" in crash_output  # each rank's prints land in the cell

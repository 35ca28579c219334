"""picotron.launch.run: results, errors, timeouts, and no process left behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import picotron.launch as launch
from picotron.launch import run
from picotron.rank_server import RankError


def _children() -> list:
    """The ranks still alive: every descendant but the rank server, which waits for the next run."""
    server = launch._the_server.process.pid if launch._the_server else None
    return [p for p in psutil.Process().children(recursive=True)
            if p.pid != server and p.status() != psutil.STATUS_ZOMBIE]


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
        torch.testing.assert_close(values, expected, rtol=0, atol=0)   # the same stream: the same bits
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


def test_a_rank_that_dies_in_native_code_is_reported_before_the_errors_it_causes():
    def segfault_while_others_wait():
        if dist.get_rank() == 1:
            import ctypes
            ctypes.string_at(0)           # SIGSEGV, no Python exception
        dist.all_reduce(torch.ones(1))    # the others wait for rank 1, then lose the connection
        return 0
    with pytest.raises(RankError, match=r"rank 1 \(exit code -11\) died without a result"):
        run(segfault_while_others_wait, 3, timeout=20)
    assert not _children()


def test_exception_classes_defined_locally_still_come_back():
    class LocalError(Exception):
        pass

    def fail():
        raise LocalError("local")
    with pytest.raises(LocalError, match=r"rank \d raised LocalError: local"):
        run(fail, 2, timeout=20)


def test_a_result_that_cannot_travel_is_the_ranks_error():
    def return_a_lock():
        import threading
        return threading.Lock()
    with pytest.raises(RankError, match=r"rank \d+ raised RankError: its return value \(lock\) cannot be sent back"):
        run(return_a_lock, 2, timeout=20)


def test_a_function_that_cannot_travel_is_a_clear_error():
    import threading
    lock = threading.Lock()

    def uses_a_lock():
        with lock:
            return 0
    with pytest.raises(TypeError, match="run\\(\\) cannot send .*uses_a_lock.*create such an object inside the function"):
        run(uses_a_lock, 2)


def test_backend_nccl_without_enough_gpus_names_the_fix():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="needs one GPU per rank.*use backend='gloo'"):
        run(rank_sum, gpus + 1, args=(0,), backend="nccl")
    with pytest.raises(ValueError, match="backend='mpi'"):
        run(rank_sum, 2, args=(0,), backend="mpi")


def test_cpu_ranks_never_see_a_gpu():
    def visible():
        return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.is_available()
    assert run(visible, 2, backend="gloo") == [("", False)] * 2


def test_tensors_travel_on_the_cpu():
    """Arguments (and values a function closes over) made on the caller's GPU, where it has one, arrive on the
    CPU, equal, leaf tensors with requires_grad kept and Parameters still Parameters: ranks that see no GPU
    could not rebuild a CUDA tensor (an H200 showed it). The results come back on the CPU too."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(6.0, device=device).reshape(2, 3)
    weight = torch.nn.Parameter(torch.ones(3, device=device))
    captured = torch.full((2,), 7.0, device=device)

    def arrived(x, weight):
        return ([(t.device.type, t.is_leaf, t.requires_grad) for t in (x, weight, captured)],
                type(weight).__name__, x @ weight + captured.sum())

    for devices, kind, value in run(arrived, 2, args=(x, weight), backend="gloo"):
        assert devices == [("cpu", True, False), ("cpu", True, True), ("cpu", True, False)]
        assert kind == "Parameter" and torch.equal(value, (x @ weight + captured.sum()).detach().cpu())


def test_ranks_start_clean_after_autograd_and_cuda_in_the_caller():
    """The caller has run backward passes (and touched CUDA where there is one) and imported a
    module the ranks never asked for: the ranks still train, and start without that state."""
    import wave  # noqa: F401 - an unrelated module the caller has and the ranks must not
    x = torch.randn(8, 8, requires_grad=True)
    (x @ x).sum().backward()
    if torch.cuda.is_available():
        y = torch.randn(8, 8, device="cuda", requires_grad=True)
        (y @ y).sum().backward()
        torch.optim.Adam([y]).step()

    def train_a_little():
        import sys
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        return "wave" in sys.modules, "pytest" in sys.modules, os.getpid() != caller
    caller = os.getpid()
    assert run(train_a_little, 2) == [(False, False, True)] * 2


def test_the_rank_server_and_its_ranks_die_with_the_caller(tmp_path):
    """A caller killed mid-run (a Jupyter kernel restarted, a script killed) leaves nothing behind."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent("""
        import time
        from picotron.launch import run
        def hang():
            print("started", flush=True)
            time.sleep(600)
        run(hang, 2, timeout=600)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert "started" in caller.stdout.readline() + caller.stdout.readline()
        processes = psutil.Process(caller.pid).children(recursive=True)
        assert len(processes) == 3  # the rank server and its two ranks
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    gone, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive


def test_a_rank_server_that_died_is_replaced():
    run(rank_sum, 2, args=(0,))
    launch._the_server.process.kill()
    launch._the_server.process.wait()
    assert run(rank_sum, 2, args=(0,)) == [1.0, 1.0]


def test_launch_overhead_after_the_first_run():
    def nothing():
        return None
    run(nothing, 4)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        run(nothing, 4)
        times.append(time.perf_counter() - start)
    # 0.1 s is typical for 4 ranks on 2 cores (docs/benchmarks.md); a rare rendezvous stall of a
    # few seconds in the sandbox's network stack is why this takes the best of five, not the mean.
    assert min(times) < 0.3, times


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
        # The kernel has run backward passes and imported a module the ranks never asked for.
        "import wave\nx = torch.randn(4, 4, requires_grad=True)\n(x @ x).sum().backward()\n"
        "if torch.cuda.is_available():\n    (torch.ones(2, device='cuda', requires_grad=True) * 2).sum().backward()\n"
        "def fresh():\n    import sys\n    w = torch.randn(3, requires_grad=True)\n    (w * w).sum().backward()\n"
        "    return 'wave' in sys.modules, 'ipykernel' in sys.modules, w.grad.shape\n"
        "assert run(fresh, 4) == [(False, False, torch.Size([3]))] * 4",
        "def fails_in_a_cell():\n    raise ValueError('from the cell')\n"
        "try:\n    run(fails_in_a_cell, 2)\nexcept ValueError as e:\n    error = str(e)\n"
        "assert \"raise ValueError('from the cell')\" in error, error  # the cell's source in the traceback",
    ]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3").execute()
    crash_output = "".join(o.get("text", "") for o in notebook.cells[2].outputs)
    assert "[rank 1] rank 1 waits" in crash_output  # each rank's prints land in the cell


def test_ranks_that_could_not_connect_are_started_again(monkeypatch, capsys):
    """gloo can fail to connect the ranks to each other (seen about once in a hundred launches in
    a sandboxed network stack); no rank has run `fn` then (they pass a barrier first), so `run`
    starts them again, twice at most, and says so."""
    attempts = []

    def flaky_attempt(self):
        attempts.append(1)
        if len(attempts) < 3:
            raise launch._NotConnected(RuntimeError("Gloo connectFullMesh failed: Connection closed by peer"))
        return ["ok"]
    monkeypatch.setattr(launch._Launch, "_attempt", flaky_attempt)
    assert run(rank_sum, 1, args=(0,)) == ["ok"]
    assert len(attempts) == 3
    assert capsys.readouterr().err.count("could not connect") == 2

    def never_connects(self):
        attempts.append(1)
        raise launch._NotConnected(RuntimeError("still closed"))
    attempts.clear()
    monkeypatch.setattr(launch._Launch, "_attempt", never_connects)
    with pytest.raises(RuntimeError, match="still closed"):   # the third failure is the caller's error
        run(rank_sum, 1, args=(0,))
    assert len(attempts) == 3


def test_an_error_while_connecting_is_told_apart_from_an_error_in_fn():
    def fails_in_fn():
        raise RuntimeError("in fn")
    with pytest.raises(RuntimeError, match="in fn") as info:
        run(fails_in_fn, 2)
    assert not isinstance(info.value, launch._NotConnected)

"""Live ranks in a notebook (picotron/ranks.py), driven through a real Jupyter kernel as a learner's notebook
drives them: `%load_ext picotron.ranks`, `%ranks start`, `%%ranks` cells, the stop button, a kernel restart.

Each hang below is planted on purpose; the report must name the right rank, operation, group, call number and
cell line, and the ranks must be usable in the next cell, with the variables the message says they kept.
"""

import os
import re
import signal
import time

import psutil
import pytest
import torch
from jupyter_client.manager import start_new_kernel

from picotron.collective_trace import Collective, RankState
from picotron.ranks import Ranks, _hang, side_by_side


class Kernel:
    """A Jupyter kernel and what each executed cell showed: its text (streams, displays, errors) and status."""

    def __init__(self):
        self.manager, self.client = start_new_kernel(kernel_name="python3")

    def cell(self, code: str, timeout: float = 120) -> tuple[str, str]:
        shown = []
        # stop_on_error=False: after a cell that raised, ipykernel 6 aborts the requests that reach it within a moment
        # (a reply without execution_count, seen in .ci/oldest); these cells come one after another on purpose.
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=shown.append, stop_on_error=False)
        self.number = reply["content"]["execution_count"]  # the cell's In[N], as Jupyter shows it
        return _text(shown), reply["content"]["status"]

    def ok(self, code: str) -> str:
        text, status = self.cell(code)
        assert status == "ok", text
        return text

    def pid(self) -> int:
        return int(self.ok("import os; print(os.getpid())").split()[-1])

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def _text(messages: list) -> str:
    parts = []
    for m in messages:
        kind, content = m["msg_type"], m["content"]
        if kind == "stream":
            parts.append(content["text"])
        elif kind in ("display_data", "execute_result"):
            parts.append(content["data"].get("text/plain", "") + "\n")
        elif kind == "error":
            parts.append(f"{content['ename']}: {content['evalue']}\n")
    return "".join(parts)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.ok("%load_ext picotron.ranks")
    k.ok("%ranks start 2 --backend gloo")
    yield k
    k.ok("%ranks stop")
    k.shutdown()


def columns(text: str) -> dict:
    """{rank: its value} from the side-by-side table a cell's last expression shows."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if re.match(r"rank \d+( +\| rank \d+)*$", line))
    header, values = lines[at], lines[at + 2]  # a rule of dashes between them
    ranks = [int(r) for r in re.findall(r"rank (\d+)", header)]
    return dict(zip(ranks, [v.strip() for v in values.split(" | ")]))


# ---- (1) persistent namespaces, some ranks, values in and out ----------------------------------------
def test_state_persists_across_cells_and_subsets_run_alone(kernel):
    kernel.ok("%%ranks\nx = torch.tensor([float(rank)])\ndist.all_reduce(x)")
    assert columns(kernel.ok("%%ranks\nx.item(), rank, world_size, str(device)")) == {
        0: "(1.0, 0, 2, 'cpu')", 1: "(1.0, 1, 2, 'cpu')"}
    kernel.ok("%%ranks 1\nx += 10")
    assert columns(kernel.ok("%%ranks\nx.item()")) == {0: "1.0", 1: "11.0"}
    assert columns(kernel.ok("%%ranks 0\nx.item()")) == {0: "1.0"}
    assert kernel.ok("%%ranks\nx.item();") == ""  # a trailing ';' shows nothing, as in Jupyter


def test_pull_and_push(kernel):
    kernel.ok("%%ranks\nw = torch.full((2,), float(rank))")
    assert kernel.ok("ws = %ranks pull w\nprint([t.tolist() for t in ws])").strip() == "[[0.0, 0.0], [1.0, 1.0]]"
    kernel.ok("scale = 3.0\ndef double(t):\n    return 2 * t\n%ranks push scale double")
    assert columns(kernel.ok("%%ranks\ndouble(w * scale).tolist()")) == {0: "[0.0, 0.0]", 1: "[6.0, 6.0]"}
    text, status = kernel.cell("%ranks pull nothing_here")
    assert status == "error" and "name 'nothing_here' is not defined on ranks 0, 1" in text


def test_output_streams_as_the_ranks_print(kernel):
    text = kernel.ok("%%ranks\nimport sys\nprint('to stdout', rank)\nprint('to stderr', rank, file=sys.stderr)")
    for r in (0, 1):
        assert f"[rank {r}] to stdout {r}" in text and f"[rank {r}] to stderr {r}" in text


# ---- (3) an exception on one rank -------------------------------------------------------------------
def test_an_exception_shows_the_cells_own_line_and_the_ranks_stay(kernel):
    text, status = kernel.cell("%%ranks\nkept = rank\nif rank == 1:\n    1 / 0\nkept")
    assert status == "error"
    assert f'File "Cell In[{kernel.number}]", line 4, in <module>\n    1 / 0' in text, text
    assert "RanksError: rank 1 raised ZeroDivisionError" in text
    assert columns(text) == {0: "0"}  # rank 0 finished the cell and showed its value
    assert columns(kernel.ok("%%ranks\nkept")) == {0: "0", 1: "1"}


# ---- (4) hangs: the report, then recovery -------------------------------------------------------------
def test_a_collective_on_one_rank_is_reported_and_the_stuck_rank_restarted(kernel):
    kernel.ok("%%ranks\nmine = 100 + rank")
    started = time.monotonic()
    text, status = kernel.cell("%%ranks\nt = torch.ones(1024)\ndist.all_reduce(t)\nif rank == 1:\n"
                               "    dist.all_reduce(t)\n")
    assert status == "error" and time.monotonic() - started < 20
    assert "The cell cannot finish: rank 1 waits in a collective that will never complete." in text
    assert "rank 0 finished the cell after all_reduce #1 of group [0, 1] (4 KiB)" in text
    assert re.search(r"rank 1 waits in all_reduce #2 of group \[0, 1\] \(4 KiB\) for [\d.]+ s, "
                     rf"at Cell In\[{kernel.number}\], line 5: `dist.all_reduce\(t\)`", text), text
    assert "restarted rank 1: its variables are gone" in text and "rank 0 kept its variables" in text
    text, status = kernel.cell("%%ranks\nmine")
    assert status == "error" and columns(text) == {0: "100"} and "rank 1 raised NameError" in text
    assert columns(kernel.ok("%%ranks\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")) == {0: "2.0", 1: "2.0"}


def test_a_mismatched_pair_is_reported_on_both_ranks(kernel):
    text, status = kernel.cell("%%ranks\nt = torch.ones(4)\nif rank == 0:\n    dist.all_reduce(t)\nelse:\n"
                               "    dist.broadcast(t, src=1)\n")
    assert status == "error"
    cell = f"Cell In[{kernel.number}]"
    assert "rank 0 waits in all_reduce #1 of group [0, 1] (16 B)" in text and f"{cell}, line 4" in text
    assert "rank 1 waits in broadcast #1 from 1 of group [0, 1] (16 B)" in text and f"{cell}, line 6" in text
    assert "restarted ranks 0 and 1" in text
    assert columns(kernel.ok("%%ranks\nrank")) == {0: "0", 1: "1"}


def test_a_collective_on_a_subset_of_ranks_is_a_hang_not_a_deadlock(kernel):
    text, status = kernel.cell("%%ranks 0\ndist.barrier()")
    assert status == "error"
    assert "rank 1 does not run this cell (it runs on ranks 0)" in text and "rank 0 waits in barrier #1" in text


def test_after_a_timeout_a_computing_rank_is_interrupted_and_keeps_its_variables(kernel):
    kernel.ok("%%ranks\nmine = 200 + rank")
    text, status = kernel.cell("%%ranks --timeout 3\nimport time\nif rank == 0:\n    time.sleep(60)\n"
                               "dist.barrier()")
    assert status == "error"
    assert "Rank 1 had not finished the cell after 3 s." not in text  # both ranks were busy
    assert "Ranks 0 and 1 had not finished the cell after 3 s." in text
    assert "rank 0 is not in a collective (computing, or waiting on something else)" in text
    assert "rank 1 waits in barrier #1 of group [0, 1]" in text
    assert "rank 0 stopped at KeyboardInterrupt and kept its variables" in text
    assert "restarted rank 1" in text
    text, status = kernel.cell("%%ranks\nmine")
    assert columns(text) == {0: "200"} and "rank 1 raised NameError" in text


def test_the_stop_button_interrupts_the_ranks(kernel):
    kernel.ok("%%ranks\nmine = 300 + rank")
    kernel.client.execute("%%ranks\nimport time\ntime.sleep(60)")
    time.sleep(2)
    started = time.monotonic()
    kernel.manager.interrupt_kernel()
    shown = []
    while True:
        message = kernel.client.get_iopub_msg(timeout=30)
        shown.append(message)
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            break
    text = _text(shown)
    assert time.monotonic() - started < 15
    assert "Interrupted: ranks 0 and 1 had not finished the cell." in text
    assert "ranks 0 and 1 stopped at KeyboardInterrupt and kept their variables" in text
    kernel.client.get_shell_msg(timeout=10)
    assert columns(kernel.ok("%%ranks\nmine")) == {0: "300", 1: "301"}


def test_a_rank_that_exits_is_named_first_and_restarted(kernel):
    kernel.ok("%%ranks\nmine = 400 + rank")
    text, status = kernel.cell("%%ranks\nimport os\nif rank == 1:\n    os._exit(3)\ndist.barrier()")
    assert status == "error" and "RanksError: rank 1 exited during the cell (exit code 3)" in text, text
    assert "restarted rank 1: its variables are gone" in text and "rank 0 kept its variables" in text
    text, status = kernel.cell("%%ranks\nmine")
    assert columns(text) == {0: "400"} and "rank 1 raised NameError" in text


def test_status_and_restart(kernel):
    text = kernel.ok("%ranks status")
    assert re.search(r"^0\s+\d+\s+yes\s+cpu\s+\d+ MiB resident$", text, re.M), text
    kernel.ok("%%ranks\ngone = 1")
    assert "every variable on the ranks is gone" in kernel.ok("%ranks restart")
    text, status = kernel.cell("%%ranks\ngone")
    assert status == "error" and "ranks 0 and 1 raised NameError" in text


def test_a_syntax_error_is_shown_once_and_runs_nowhere(kernel):
    text, status = kernel.cell("%%ranks\nnever = 1\ny = (\n")
    assert status == "error" and text.startswith("RanksError: the cell is not valid Python, so no rank ran it:\n"
                                                 f'  File "Cell In[{kernel.number}]", line 3'), text
    assert "never" not in kernel.ok("%%ranks\nsorted(globals())")


def test_bad_usage_says_what_to_type(kernel):
    text, status = kernel.cell("%%ranks 5\nx")
    assert status == "error" and "ranks [5] do not exist: the ranks are 0 to 1" in text
    text, status = kernel.cell("%ranks frobnicate")
    assert status == "error" and "%ranks frobnicate: unknown command" in text and "%ranks start N" in text


# ---- (5) no orphans -------------------------------------------------------------------------------
def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def wait_gone(processes: list[psutil.Process], seconds: float = 15) -> list[psutil.Process]:
    """The processes still running (not exited, not zombies) after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        left = []
        for p in processes:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_no_process_outlives_stop_restart_or_the_kernel():
    k = Kernel()
    try:
        pid = k.pid()
        k.ok("%load_ext picotron.ranks")
        for _ in range(5):  # five start/stop cycles in a row
            k.ok("%ranks start 2 --backend gloo")
            started = descendants(pid)
            assert len(started) == 3, started  # the rank server and its two ranks
            k.ok("%ranks stop")
            assert wait_gone(started) == [] and descendants(pid) == []
        k.ok("%ranks start 2 --backend gloo")
        started = descendants(pid)
        k.manager.restart_kernel(now=True)  # a kernel restart: the old kernel is killed
        assert wait_gone(started) == []
        k.client.wait_for_ready(timeout=60)
        pid = k.pid()
        k.ok("%load_ext picotron.ranks")
        k.ok("%ranks start 2 --backend gloo")
        started = descendants(pid)
        os.kill(pid, signal.SIGKILL)  # the kernel dies
        assert wait_gone(started) == []
    finally:
        k.shutdown()


# ---- the device rule -----------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nccl_is_chosen_with_a_gpu_per_rank():
    world = min(2, torch.cuda.device_count())  # one GPU (Colab, the GPU check): one NCCL rank
    ranks = Ranks(world)
    try:
        assert ranks.backend == "nccl"
        result = ranks.execute("x = torch.ones(1, device=device)\ndist.all_reduce(x)\n(str(device), x.item())")
        assert result.values == {r: {"text/plain": f"('cuda:{r}', {float(world)})"} for r in range(world)}
    finally:
        ranks.stop()


# ---- what decides that a hang cannot end (no ranks needed) -----------------------------------------------
def waiting(rank: int, op: str, number: int, group: str = "[0, 1]", peer: str = "") -> RankState:
    return RankState(rank, "in a collective", Collective(op, number, group, 4, peer, "", "cell", 1, 0.0))


def done(rank: int) -> RankState:
    return RankState(rank, "finished", None)


@pytest.mark.parametrize("states, busy, certain", [
    ([done(0), waiting(1, "all_reduce", 2)], [1], True),                                     # peer finished
    ([waiting(0, "all_reduce", 1), waiting(1, "broadcast", 1, peer="from 1")], [0, 1], True),  # another op
    ([waiting(0, "all_reduce", 2), waiting(1, "all_reduce", 1)], [0, 1], True),              # another call
    ([waiting(0, "all_reduce", 1), waiting(1, "all_reduce", 1)], [0, 1], False),             # slow, not stuck
    ([RankState(0, "running", None), waiting(1, "all_reduce", 1)], [0, 1], False),           # 0 may still come
    ([waiting(0, "send", 1, peer="to 1"), waiting(1, "recv", 1, peer="from 0")], [0, 1], False),  # a pair
    ([waiting(0, "send", 1, peer="to 1"), done(1)], [0], True),                              # nobody receives
    ([waiting(0, "all_reduce", 1, "[0, 2]"), waiting(1, "all_reduce", 1, "[1, 2]"), done(2)], [0, 1], True),
])
def test_a_hang_is_certain_only_when_no_wait_can_be_met(states, busy, certain):
    assert _hang(states, busy) is certain


def test_values_are_shown_side_by_side_or_stacked_when_too_wide():
    shown = side_by_side({0: {"text/plain": "tensor([0.])"}, 1: {"text/plain": "tensor([1.])"}})
    assert shown["text/plain"].splitlines() == ["rank 0       | rank 1", "-------------+-------------",
                                                "tensor([0.]) | tensor([1.])"]
    assert "<th>rank 1</th>" in shown["text/html"]
    wide = side_by_side({0: {"text/plain": "a" * 80}, 1: {"text/plain": "b" * 80}})
    assert wide["text/plain"] == "[rank 0]\n" + "a" * 80 + "\n[rank 1]\n" + "b" * 80

"""Live ranks for a notebook, side by side: picotron.ranks, ipyparallel and nbdistributed on N gloo CPU ranks.

    python benchmarks/ranks.py                          # every tool installed, 4 ranks, 30 cells of each kind
    python benchmarks/ranks.py --only picotron --cells 100
    python benchmarks/ranks.py --drivers python         # the Python APIs only, not the cell magics

Each tool is driven two ways, each a row of the table:

    python   its Python API: picotron.ranks.Ranks(N).execute(code); ipyparallel's Cluster, then
             view.execute(code) on a DirectView of all engines (what %%px sends); nbdistributed's
             ProcessManager and CommunicationManager.send_to_all("execute", code) (what %%distributed sends)
    magic    its cell magic in an IPython shell in the same process (InteractiveShell.run_cell, no
             Jupyter kernel): %%ranks, %%px, and nbdistributed's plain cells (%dist_init turns every
             cell into %%distributed). The magic's own costs count: display, and for nbdistributed a
             wait for the answer in steps of 100 ms and a namespace sync with rank 0 after each cell

What a row shows:

    import        importing the tool (torch is imported before: a notebook has it already)
    processes     starting the rank processes: picotron's Ranks(N) returns with the group made, so its
                  whole start is here; ipyparallel's controller and engines until the client sees N;
                  nbdistributed's start_workers (as %dist_init), which returns after a fixed 2 s sleep
    + group       then until N ranks are in one gloo process group and answer: ipyparallel's
                  dist.init_process_group cell (its engines import torch there); nbdistributed's workers
                  join by themselves, so this is the wait until all N answer a probe. A cell sent before
                  then is dropped (a ZMQ ROUTER drops messages to workers not yet connected) and fails
                  after its 30 s timeout; a notebook cannot tell when the workers are ready
    ready         the two together: from nothing to N ranks in a process group that run a cell
    procs         processes the tool runs while ready (servers, controllers and nannies count)
    x = 1         round trip of a trivial cell on all N ranks, median (90th percentile), --cells cells
    all_reduce    round trip of `t = torch.ones(4); dist.all_reduce(t)` (and an assert on the sum)
    failed        cells that raised on a rank, or timed out, of all cells run (warm-up and group cell included)
    stop          the tool's own shutdown: Ranks.stop(); rc.close() and cluster.stop_cluster_sync();
                  nbdistributed's graceful path (a "shutdown" message, then terminate, as its
                  shutdown_all does), and in the magic row %dist_shutdown, what its README says to run
    left          processes still running after that shutdown: at once / --settle s later / after the
                  process that drove the tool has exited (the last are then killed here, by pid)
    left if killed  the kill test (skip it with --no-kill): another driver, in a fresh process, starts the
                  ranks and is killed (SIGKILL, as a kernel that dies); the processes still running
                  --settle s later (then killed here, by pid). One per tool, in its first driver's row

How: each row runs in a fresh child process of its own, one after another, so no tool sees another's
imports, sockets or class-level state, and each starts from a clean interpreter, as a notebook kernel
does. Every process a child starts inherits a tag in its environment, and the processes are counted by
that tag (from /proc), not by name: other programs on the machine may run processes named alike.
nbdistributed's %dist_shutdown (and %dist_reset) end with `pkill -f` on patterns such as "python.*worker",
which would match other users' processes: in its children the script refuses any pkill or killall
(and says so in the notes). nbdistributed starts its workers as `python worker.py`, found on PATH: the
children get this interpreter's folder first on PATH so that its workers use this environment.
The cells of the two kinds alternate, so drifting load on the machine hits both alike. On 2 shared
cores, numbers move by tens of percent from run to run; this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import io
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

TOOLS = ("picotron", "ipyparallel", "nbdistributed")
DRIVERS = ("python", "magic")
MODULES = {"picotron": "picotron.ranks", "ipyparallel": "ipyparallel", "nbdistributed": "nbdistributed"}
MEASURED = {"ipyparallel": "ipyparallel==9.2.0", "nbdistributed": "nbdistributed==0.1.0"}  # what this was written for
DRIVEN_BY = {("picotron", "python"): "Ranks.execute", ("picotron", "magic"): "%%ranks (IPython)",
             ("ipyparallel", "python"): "view.execute", ("ipyparallel", "magic"): "%%px (IPython)",
             ("nbdistributed", "python"): "send_to_all", ("nbdistributed", "magic"): "%%distributed (IPython)"}
TAG = "PICOTRON_BENCH_RANKS_TAG"
CELL_TIMEOUT = 30.0   # seconds a cell may take before it counts as failed
READY_TIMEOUT = 120.0  # seconds nbdistributed's workers may take to answer at all
WARMUP = 2            # untimed cells of each kind before the timed ones
TRIVIAL = "x = 1"
ALL_REDUCE = "t = torch.ones(4)\ndist.all_reduce(t)\nassert t[0].item() == world_size"
GOALS = {"ready": 1.5, "trivial_ms": 10.0}  # picotron's goals: seconds to ready, ms per trivial cell


# ---- counting processes --------------------------------------------------------------------------
def tagged_processes(tag: str) -> list[int]:
    """Pids of the running (not zombie) processes whose environment carries `tag`, except this one.
    The tag is inherited by every process a child starts, whatever its name or parent after reparenting."""
    marker = f"{TAG}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:  # gone, or not ours to read
            continue
        if state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def kill_tagged(tag: str, grace: float = 3.0) -> list[int]:
    """End the processes this benchmark's child left behind (found by their tag): SIGTERM, then SIGKILL."""
    pids = tagged_processes(tag)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and tagged_processes(tag):
            time.sleep(0.1)
        if not tagged_processes(tag):
            break
    return pids


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- one tool, driven one way (runs in a child process) ---------------------------------------------
class Session:
    """Start N ranks, run cells on them, stop them. `start` returns (processes s, + group s), either None
    when the tool does both in one call; `cell` returns whether every rank ran the cell without error."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.notes: list[str] = []
        self.cells = self.failed = 0  # cells run inside start (ipyparallel's process group cell)

    def load(self) -> None: ...
    def start(self) -> tuple: ...
    def cell(self, code: str) -> bool: ...
    def stop(self) -> None: ...


def _shell():
    """An IPython shell in this process, as a kernel has (without the kernel's messaging)."""
    from IPython.core.interactiveshell import InteractiveShell
    return InteractiveShell.instance()


class PicotronPython(Session):
    def load(self):
        from picotron.ranks import Ranks
        self.Ranks = Ranks

    def start(self):
        self.ranks = self.Ranks(self.world_size, backend="gloo")
        return None, None

    def cell(self, code):
        result = self.ranks.execute(code, timeout=CELL_TIMEOUT)
        return result.why is None and not result.errors and not result.died

    def stop(self):
        if hasattr(self, "ranks"):  # else Ranks() raised, and stopped what it had started
            self.ranks.stop()


class PicotronMagic(Session):
    def load(self):
        self.shell = _shell()
        self.shell.run_line_magic("load_ext", "picotron.ranks")

    def start(self):
        if not self.shell.run_cell(f"%ranks start {self.world_size} --backend gloo").success:
            raise RuntimeError("%ranks start failed (see the log)")
        return None, None

    def cell(self, code):
        return self.shell.run_cell(f"%%ranks --timeout {CELL_TIMEOUT:g}\n{code}").success

    def stop(self):
        self.shell.run_cell("%ranks stop")


class IpyparallelPython(Session):
    """A local Cluster (controller + N engines); the engines then join a gloo group in one cell."""

    magic = False

    def load(self):
        import ipyparallel
        self.ipp = ipyparallel
        if self.magic:
            self.shell = _shell()

    def start(self):
        import logging
        started = time.perf_counter()
        self.cluster = self.ipp.Cluster(n=self.world_size, log_level=logging.WARNING)
        self.client = self.cluster.start_and_connect_sync(activate=self.magic)  # activate: %px magics
        processes = time.perf_counter() - started
        started = time.perf_counter()
        self.view = self.client[:]
        # the engines know no rank: give engine i rank i, as a notebook would before %%px
        self.view.scatter("rank", list(range(self.world_size)), flatten=True, block=True)
        self.view.push({"world_size": self.world_size}, block=True)
        group = ("import datetime, torch, torch.distributed as dist\ndevice = torch.device('cpu')\n"
                 f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=rank, "
                 "world_size=world_size, timeout=datetime.timedelta(seconds=120))")
        self.cells += 1
        if not self.cell(group):
            self.failed += 1
            raise RuntimeError("the engines could not join a process group (see the log)")
        return processes, time.perf_counter() - started

    def cell(self, code):
        if self.magic:
            return self.shell.run_cell(f"%%px\n{code}").success
        try:
            self.view.execute(code, block=False).get(timeout=CELL_TIMEOUT)
            return True
        except Exception as e:  # noqa: BLE001 - a rank's error or a timeout: the cell failed
            print(f"cell failed: {type(e).__name__}: {e}", flush=True)
            return False

    def stop(self):
        if getattr(self, "client", None) is not None:
            self.client.close()
        if hasattr(self, "cluster"):
            self.cluster.stop_cluster_sync()


class IpyparallelMagic(IpyparallelPython):
    magic = True


def _refuse_pkill(notes: list) -> None:
    """nbdistributed's shutdowns may run `pkill -f PATTERN`, which matches every user's processes
    on the machine: refuse it here, and note what it would have run."""
    real_run = subprocess.run

    def run(command, *args, **kwargs):
        if isinstance(command, (list, tuple)) and command and os.path.basename(command[0]) in ("pkill", "killall"):
            notes.append(f"refused {shlex.join(command)}")
            return subprocess.CompletedProcess(command, 1)
        return real_run(command, *args, **kwargs)

    subprocess.run = run


class NbdistributedPython(Session):
    """What %dist_init does (ProcessManager.start_workers, then a CommunicationManager on its port), then
    probes until every worker answers; cells go through CommunicationManager.send_to_all."""

    def load(self):
        _refuse_pkill(self.notes)
        from nbdistributed.communication import CommunicationManager
        from nbdistributed.process_manager import ProcessManager
        self.managers = ProcessManager, CommunicationManager

    def start(self):
        ProcessManager, CommunicationManager = self.managers
        started = time.perf_counter()
        self.processes = ProcessManager()
        port = self.processes.start_workers(self.world_size, "localhost")
        self.comm = CommunicationManager(self.world_size, port)
        processes = time.perf_counter() - started
        return processes, self._wait_ready(self.comm)

    def _wait_ready(self, comm) -> float:
        """Seconds until every worker answers a probe (each waits 0.1 s; a dropped one is sent again)."""
        started = time.perf_counter()
        while True:
            try:
                comm.send_to_all("get_status", {}, timeout=0.1)
                return time.perf_counter() - started
            except TimeoutError:
                if time.perf_counter() - started > READY_TIMEOUT:
                    raise RuntimeError(f"the workers did not answer within {READY_TIMEOUT:g} s") from None

    def cell(self, code):
        try:
            answers = self.comm.send_to_all("execute", code, timeout=CELL_TIMEOUT)
        except TimeoutError:
            return False
        return len(answers) == self.world_size and not any("error" in a for a in answers.values())

    def stop(self):
        # nbdistributed's shutdown_all, on our managers: the workers never answer "shutdown", so this
        # message always waits out its 5 s; then the workers are terminated (killed after 3 s)
        if hasattr(self, "comm"):
            with contextlib.suppress(TimeoutError):
                self.comm.send_to_all("shutdown", {}, timeout=5.0)
            self.comm.shutdown()
        if hasattr(self, "processes"):
            self.processes.shutdown()


class NbdistributedMagic(NbdistributedPython):
    """%load_ext nbdistributed and %dist_init -n N in an IPython shell; plain cells then run on the workers.
    Its magic reports a rank's error by printing it, so a cell failed when its output says so."""

    def load(self):
        _refuse_pkill(self.notes)
        self.shell = _shell()
        self.shell.run_line_magic("load_ext", "nbdistributed")

    def start(self):
        started = time.perf_counter()
        self.shell.run_cell(f"%dist_init -n {self.world_size}")
        processes = time.perf_counter() - started
        magic = self.shell.magics_manager.registry["DistributedMagic"]
        if magic._comm_manager is None:
            raise RuntimeError("%dist_init failed (see the log)")
        return processes, self._wait_ready(magic._comm_manager)  # probe on the magic's own manager

    def cell(self, code):
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            result = self.shell.run_cell(code)
        text = captured.getvalue()
        sys.stdout.write(text)
        return result.success and "Error on Rank" not in text and "Error executing distributed code" not in text

    def stop(self):
        magic = self.shell.magics_manager.registry["DistributedMagic"]
        workers = list(magic._process_manager.processes) if magic._process_manager else []
        self.shell.run_cell("%dist_shutdown")
        running = [w.pid for w in workers if w.poll() is None]
        if running:
            self.notes.append(f"%dist_shutdown left its {len(running)} workers running (%dist_init keeps its "
                              "managers on the magic instance; the shutdown reads the class's, which are None)")


SESSIONS = {("picotron", "python"): PicotronPython, ("picotron", "magic"): PicotronMagic,
            ("ipyparallel", "python"): IpyparallelPython, ("ipyparallel", "magic"): IpyparallelMagic,
            ("nbdistributed", "python"): NbdistributedPython, ("nbdistributed", "magic"): NbdistributedMagic}


def child(tool: str, driver: str, world_size: int, cells: int, settle: float, die_at: str | None = None) -> dict:
    """Measure one row, in this (child) process. Whatever fails is recorded and the ranks still stopped.
    With `die_at`, write the row to that file once the ranks are ready and die there (SIGKILL, as a
    kernel that crashes or is killed): the parent then counts what outlives it."""
    importlib.import_module("torch")  # before the tool: a notebook has torch already
    tag = os.environ[TAG]
    session = SESSIONS[tool, driver](world_size)
    row = {"tool": tool, "driver": driver, "trivial_ms": [], "all_reduce_ms": [], "cells": 0, "failed": 0,
           "error": None, "notes": session.notes}

    def run(code: str, timed: list | None = None) -> None:
        started = time.perf_counter()
        try:
            ok = session.cell(code)
        except Exception as e:  # noqa: BLE001 - the driver itself failed: count the cell as failed
            print(f"cell raised {type(e).__name__}: {e}", flush=True)
            ok = False
        if timed is not None:
            timed.append(1e3 * (time.perf_counter() - started))
        row["cells"] += 1
        row["failed"] += not ok

    started = time.perf_counter()
    session.load()
    row["import_s"] = time.perf_counter() - started
    started_ranks = False
    try:
        started = time.perf_counter()
        started_ranks = True
        processes, group = session.start()
        row["ready_s"] = time.perf_counter() - started
        row["processes_s"], row["group_s"] = processes, group
        row["procs"] = len(tagged_processes(tag))
        if die_at:
            with open(die_at, "w") as f:
                json.dump(row, f)
            os.kill(os.getpid(), signal.SIGKILL)
        for code in [TRIVIAL, ALL_REDUCE] * WARMUP:
            run(code)
        for _ in range(cells):
            run(TRIVIAL, row["trivial_ms"])
            run(ALL_REDUCE, row["all_reduce_ms"])
    except Exception as e:  # noqa: BLE001 - report it in the table, and still stop what was started
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if started_ranks:
            started = time.perf_counter()
            try:
                session.stop()
            except Exception as e:  # noqa: BLE001
                row["error"] = (row["error"] + "; " if row["error"] else "") + f"stop: {type(e).__name__}: {e}"
            row["stop_s"] = time.perf_counter() - started
            row["left_at_stop"] = len(tagged_processes(tag))
            time.sleep(settle)
            row["left_later"] = len(tagged_processes(tag))
        row["cells"] += session.cells
        row["failed"] += session.failed
    return row


# ---- the parent: one child per row, then the table ----------------------------------------------------
def version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_revision() -> str | None:
    """The picotron commit measured (with '-dirty' when the work tree has changes), if this is a checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def measure(tool: str, driver: str, args, logs: str, die: bool = False) -> dict:
    """Run one row in a fresh child process; then count and end what it left behind. With `die`, the
    child kills itself once its ranks are ready, and only what outlives it is counted."""
    tag = uuid.uuid4().hex
    env = dict(os.environ)
    env[TAG] = tag
    env["PYTHONIOENCODING"] = "utf-8"  # nbdistributed prints emoji; the log is a file
    # nbdistributed starts its workers as `python`, found on PATH: make that this interpreter
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    name = f"{tool}-{driver}" + ("-killed" if die else "")
    out, log = os.path.join(logs, f"{name}.json"), os.path.join(logs, f"{name}.log")
    command = [sys.executable, os.path.abspath(__file__), "--child", tool, driver, "--out", out,
               "--ranks", str(args.ranks), "--cells", str(args.cells), "--settle", str(args.settle)]
    command += ["--die"] if die else []
    with open(log, "w") as f:
        try:
            code = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=args.timeout).returncode
            failure = f"the child process exited with code {code}"
        except subprocess.TimeoutExpired:
            failure = f"the child process ran past --timeout {args.timeout:g} s and was killed"
    try:
        with open(out) as f:
            row = json.load(f)
    except (OSError, ValueError):
        row = {"tool": tool, "driver": driver, "error": f"{failure}; log: {log}", "notes": []}
    if row.get("error"):
        row["log"] = log
    time.sleep(args.settle)
    row["left_after_exit"] = len(tagged_processes(tag))
    killed = kill_tagged(tag)
    if killed:
        row["notes"].append(f"this script killed {len(killed)} process(es) left after "
                            f"{'the driver was killed' if die else 'exit'}: pids " + " ".join(map(str, killed)))
    return row


def _s(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(values: list) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    median, p90 = statistics.median(ordered), ordered[int(0.9 * (len(ordered) - 1))]
    digits = 2 if p90 < 10 else 1
    return f"{median:.{digits}f} ({p90:.{digits}f})"


def table(rows: list[dict]) -> str:
    header = ["tool", "driven by", "import s", "processes s", "+ group s", "ready s", "procs", "x = 1 ms",
              "all_reduce ms", "failed", "stop s", "left: at stop / later / after exit", "left if killed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        name = DRIVEN_BY[r["tool"], r["driver"]]
        if r.get("missing"):
            lines.append(f"| {r['tool']} | {name} | {r['missing']} not installed |" + " |" * (len(header) - 3))
            continue
        within = "(in ready)" if r.get("ready_s") is not None else "-"
        processes = _s(r.get("processes_s")) if r.get("processes_s") is not None else within
        group = _s(r.get("group_s")) if r.get("group_s") is not None else within
        left = " / ".join(str(r.get(k, "-")) for k in ("left_at_stop", "left_later", "left_after_exit"))
        failed = f"{r['failed']} of {r['cells']}" if "cells" in r else "-"
        lines.append(f"| {r['tool']} | {name} | {_s(r.get('import_s'))} | {processes} | {group} | "
                     f"{_s(r.get('ready_s'))} | {r.get('procs', '-')} | {_ms(r.get('trivial_ms'))} | "
                     f"{_ms(r.get('all_reduce_ms'))} | {failed} | {_s(r.get('stop_s'))} | {left} | "
                     f"{r.get('left_after_kill', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="The table's columns are explained at the top of this file.")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per tool (default 4)")
    parser.add_argument("--cells", type=int, default=30, help="timed cells of each kind per row (default 30)")
    parser.add_argument("--only", nargs="+", choices=TOOLS, default=list(TOOLS), metavar="TOOL",
                        help=f"measure only these tools, of {', '.join(TOOLS)} (default: all)")
    parser.add_argument("--drivers", nargs="+", choices=DRIVERS, default=list(DRIVERS),
                        help="python: each tool's Python API; magic: its cell magic in an IPython shell "
                             "(default: both)")
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds to wait before counting processes left again (default 2)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one row may take before its process is killed (default 600)")
    parser.add_argument("--no-kill", action="store_true",
                        help="skip the kill test: per tool, a driver that is killed (SIGKILL) once its ranks are "
                             "ready, and the processes that outlive it")
    parser.add_argument("--json", help="also write the rows (every cell's time) to this file")
    parser.add_argument("--child", nargs=2, metavar=("TOOL", "DRIVER"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--die", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.cells < 1:
        parser.error("--ranks and --cells must be at least 1")

    if args.child:
        row = child(*args.child, args.ranks, args.cells, args.settle, die_at=args.out if args.die else None)
        with open(args.out, "w") as f:
            json.dump(row, f)
        return [row]

    command = shlex.join([sys.executable] + sys.argv) if argv is None else shlex.join(["ranks.py"] + argv)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": command,
            "python": platform.python_version(), "cpus": os.cpu_count(), "torch": version("torch"),
            "picotron": version("picotron"), "picotron_commit": git_revision(),
            "ipyparallel": version("ipyparallel"), "nbdistributed": version("nbdistributed"),
            "load_before": os.getloadavg()}
    rows = []
    logs = tempfile.mkdtemp(prefix="picotron-bench-ranks-")  # kept when a row failed
    for tool in args.only:
        if importlib.util.find_spec(MODULES[tool].split(".")[0]) is None:
            print(f"{tool} is not installed: its rows are skipped (pip install {MEASURED.get(tool, tool)} "
                  "to measure it)", flush=True)
            rows += [{"tool": tool, "driver": d, "missing": tool, "notes": []} for d in args.drivers]
            continue
        for driver in args.drivers:
            if driver == "magic" and importlib.util.find_spec("IPython") is None:
                print(f"IPython is not installed: the {tool} magic row is skipped", flush=True)
                rows.append({"tool": tool, "driver": driver, "missing": "IPython", "notes": []})
                continue
            print(f"measuring {tool} driven by {DRIVEN_BY[tool, driver]} ...", flush=True)
            row = measure(tool, driver, args, logs)
            rows.append(row)
            if not args.no_kill and driver == args.drivers[0]:
                print(f"  ... and killing a driver of {tool} once its ranks are ready", flush=True)
                killed = measure(tool, driver, args, logs, die=True)
                row["left_after_kill"] = killed["left_after_exit"] if killed.get("procs") else "-"
                row["notes"] += killed["notes"]
                if killed.get("error"):
                    row["notes"].append(f"kill test: {killed['error']}")
                    row["kill_failed"] = True  # keep the logs
            if row.get("error") and row.get("log"):
                with contextlib.suppress(OSError), open(row["log"]) as f:
                    row["log_tail"] = f.read()[-3000:]
    meta["load_after"] = os.getloadavg()
    if not any(r.get("error") or r.get("kill_failed") for r in rows):
        shutil.rmtree(logs, ignore_errors=True)

    print()
    print(f"{args.ranks} ranks, gloo on CPU, {args.cells} timed cells of each kind per row; {meta['date']}; "
          f"{meta['cpus']} CPUs, load average {meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after")
    commit = f" ({meta['picotron_commit']})" if meta["picotron_commit"] else ""
    print(f"python {meta['python']}, torch {meta['torch']}, picotron {meta['picotron']}{commit}, "
          f"ipyparallel {meta['ipyparallel']}, nbdistributed {meta['nbdistributed']}")
    print(f"command: {command}\n")
    print(table(rows))
    print()
    for r in rows:
        if r.get("tool") == "picotron" and r.get("ready_s") is not None and r.get("trivial_ms"):
            ready, trivial = r["ready_s"], statistics.median(r["trivial_ms"])
            print(f"picotron goals, {DRIVEN_BY['picotron', r['driver']]}: ready {ready:.2f} s "
                  f"(goal <= {GOALS['ready']:g} s: {'met' if ready <= GOALS['ready'] else 'missed'}), "
                  f"x = 1 median {trivial:.2f} ms (goal <= {GOALS['trivial_ms']:g} ms: "
                  f"{'met' if trivial <= GOALS['trivial_ms'] else 'missed'})")
    for r in rows:
        for note in ([r["error"]] if r.get("error") else []) + r.get("notes", []):
            print(f"{r['tool']}, {DRIVEN_BY[r['tool'], r['driver']]}: {note}")
        if r.get("log_tail"):
            print(f"--- end of its log ---\n{r['log_tail']}\n---")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()

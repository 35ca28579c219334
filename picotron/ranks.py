"""Live ranks in a notebook: `%%ranks` cells run on N ranks that keep their variables from cell to cell.

    %load_ext picotron.ranks
    %ranks start 4                 # 4 ranks in one process group (NCCL with a GPU each, else gloo CPU ranks)

    %%ranks
    x = torch.full((3,), float(rank))
    dist.all_reduce(x)
    x                              # the last expression, shown per rank, side by side

    %%ranks 0,2                    # only ranks 0 and 2 run this cell
    x += 1

    xs = %ranks pull x             # [x on rank 0, ..., x on rank 3], in the notebook
    %ranks push lr                 # the notebook's lr, bound on every rank
    %ranks status                  # alive, pid, device, memory per rank
    %ranks stop

Every rank's namespace starts with `torch`, `dist`, `rank`, `world_size` and `device` bound. Output
streams into the cell as the ranks print it, as "[rank r] ..." (tqdm bars redraw in place, as
`picotron.launch.run` relays them). An exception on a rank shows that rank's traceback with the
cell's own line numbers, and the ranks stay as they were for the next cell.

A hang is reported and the ranks recover. While a cell runs, the ranks' collective records
(picotron/collective_trace.py) are read twice a second: when every rank still in the cell waits in
a collective that can never complete (a rank of its group is done with the cell, does not run it,
or waits in another call), the cell ends within about two seconds with a report of where each rank
is, e.g. "rank 1 waits in all_reduce #3 of group [0, 1] (4 KiB) ... at Cell In[7], line 4"; so does
a cell that runs past its timeout (`--timeout S`), or one the learner stops (Jupyter's stop button).
Then the ranks recover: each busy rank is sent SIGINT, and a rank computing in Python stops with
KeyboardInterrupt and keeps its variables; a rank blocked inside a collective cannot be interrupted
(gloo and NCCL wait in C++), so it is restarted with a fresh namespace, and every rank then joins a
new process group. The message says which ranks lost their variables.

The ranks come from a rank server of their own (picotron/rank_server.py, the same as `run`'s), so
they start from a clean interpreter with the launcher's device rules, and notebook-defined functions
and values reach them by value (cloudpickle). `%ranks stop`, a kernel restart or the kernel's death
leave no process behind: the server kills its ranks when the kernel's socket closes, and each process
is also killed by the kernel (Linux's parent-death signal) if its parent dies.

Why not ipyparallel (which has persistent engines, `%%px`, push/pull and interrupts since 2015):
docs/design.md, "Starting ranks".

From Python, without IPython: `Ranks(4)` has the same operations (`execute`, `pull`, `push`,
`status`, `stop`).
"""

from __future__ import annotations

import atexit
import html
import math
import numbers
import os
import pickle
import re
import selectors
import shlex
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field

from picotron import collective_trace, launch, pickling
from picotron.rank_server import _FRAME, RankError, _Missing

__all__ = ["Ranks", "CellResult", "RanksError", "current", "last_cell", "side_by_side", "load_ipython_extension"]

CONNECT_TIMEOUT = 60.0   # seconds for the ranks to start and join their process group
GROUP_TIMEOUT = 3600.0   # the process group's own timeout: a long cell is not an error
HANG_SETTLE = 1.5        # seconds a certain hang must stay unchanged before the cell is ended
INTERRUPT_GRACE = 2.0    # seconds a busy rank has to answer SIGINT before it is restarted


class RanksError(RuntimeError):
    """A `%%ranks` cell did not complete on every rank: a rank raised, or the ranks hung, ran past
    the timeout or were interrupted. The message says what happened and what each rank kept."""


@dataclass
class _LiveRank:
    """The notebook's view of one live rank: its pid and its three pipes."""
    rank: int
    pid: int
    out_fd: int        # the rank's stdout and stderr
    result_fd: int     # its answers, in frames
    command_fd: int    # our commands, in frames
    out_buffer: bytes = b""
    redrawing: bool = False
    inbox: bytearray = field(default_factory=bytearray)
    answers: list = field(default_factory=list)
    gone: bool = False  # its result pipe closed: the rank exited


@dataclass
class CellResult:
    """How a cell went: each rank's shown value or error, and, when it did not complete, why, where
    each rank was (`report`) and how the ranks recovered (`recovery`)."""
    targets: list
    values: dict = field(default_factory=dict)   # rank -> {"text/plain": ..., "text/html": ...} or None
    errors: dict = field(default_factory=dict)   # rank -> the rank's error (type, message, traceback)
    died: dict = field(default_factory=dict)     # rank -> exit code, for a rank that exited during the cell
    why: str | None = None                       # None, "hang", "timeout" or "interrupted"
    report: str = ""
    recovery: str = ""

    def error(self) -> RanksError | None:
        """The RanksError to raise for this cell (None when every rank completed it)."""
        if self.why is None and not self.errors and not self.died:
            return None
        # A rank that exited comes first: the errors of ranks that were talking to it follow from it.
        parts = [f"rank {r} exited during the cell (exit code {code})" for r, code in sorted(self.died.items())]
        if self.errors:
            first = min(self.errors)
            by_type: dict = {}
            for r in sorted(self.errors):
                by_type.setdefault(self.errors[r]["type"].__name__, []).append(r)
            kinds = ", ".join(f"{_ranks(ranks)} raised {name}" for name, ranks in by_type.items())
            parts.append(f"{kinds} (traceback above; rank {first}: "
                         f"{_first_line(self.errors[first]['message'])})")
        message = "; ".join(parts)
        if self.why is not None:
            message = (message + ".\n" if message else "") + self.report
        if self.recovery:
            message += ("\n" if self.why else ". ") + self.recovery
        return RanksError(message)


class Ranks:
    """N live ranks in one process group, each with its own namespace (what `%ranks start N` makes)."""

    def __init__(self, world_size: int, *, backend: str = "auto", timeout: float | None = None, seed: int = 0):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a whole number of ranks, at least 1")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend={backend!r}; choose 'auto', 'gloo' or 'nccl'")
        _check_timeout(timeout)
        if not hasattr(os, "fork"):
            raise RuntimeError("live ranks are forked from a helper process, and this Python has no os.fork "
                               "(Windows): run the course in WSL (Ubuntu), where it works as on Linux")
        self.world_size, self.timeout, self.seed = world_size, timeout, seed
        self.backend = launch._choose_backend(backend, world_size)
        self.directory = tempfile.mkdtemp(prefix="picotron-ranks-")
        self.ranks: list[_LiveRank | None] = [None] * world_size
        self.generation = 0
        self.stopped = False
        self.server = launch._Server()
        atexit.register(self.stop)
        try:
            self._fork(list(range(world_size)))
            self._expect_ready(list(range(world_size)), [])
        except BaseException:
            self.stop()
            raise

    # ---- what a notebook does with them -------------------------------------------------------
    def execute(self, code: str, *, targets: list[int] | None = None, timeout: float | None = None,
                file: str | None = None, first_line: int = 1, text: str | None = None) -> CellResult:
        """Run `code` on `targets` (default: every rank). `file`, `first_line` and `text` name the cell
        its tracebacks and hang reports quote: its name, the line `code` starts on, and its whole text."""
        targets = self._targets(targets)
        _check_timeout(timeout)
        timeout = self.timeout if timeout is None else timeout
        file = file or f"<ranks cell {time.monotonic_ns()}>"
        text = text if text is not None else "\n" * (first_line - 1) + code
        import linecache
        linecache.cache[file] = (len(text), None, text.splitlines(True), file)  # for the hang report's lines
        compile("\n" * (first_line - 1) + code, file, "exec")  # a SyntaxError is shown here, not N times
        result = CellResult(targets)
        cell = {"code": code, "file": file, "first_line": first_line, "text": text}
        for r in targets:
            self._send(r, ("exec", cell))
        answers: dict = {}
        try:
            self._wait(targets, answers, timeout=timeout, watch=True)
        except _Stuck as stuck:
            result.why = stuck.why
        except KeyboardInterrupt:
            result.why = "interrupted"
        self._file(result, answers)
        if result.why is not None:
            result.report = self._where(result, answers, timeout)
            result.recovery = self._recover(result, answers)
        elif result.died:
            result.recovery = self._recover(result, answers)
        return result

    def pull(self, name: str, *, targets: list[int] | None = None) -> list:
        """The value bound to `name` on each rank (tensors moved to the CPU), in rank order."""
        targets = self._targets(targets)
        answers = self._ask(targets, ("pull", [name]))
        missing = [r for r in targets if isinstance(answers[r][0], _Missing)]
        if missing:
            raise NameError(f"name {name!r} is not defined on rank{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(str, missing))}; define it in a %%ranks cell first")
        return [answers[r][0] for r in targets]

    def push(self, values: dict, *, targets: list[int] | None = None) -> None:
        """Bind each name of `values` to its value on every rank of `targets` (a copy each)."""
        targets = self._targets(targets)
        try:
            data = pickling.dumps(dict(values), tensors_on_cpu=True)
        except Exception as e:  # noqa: BLE001 - say what could not travel
            raise TypeError(f"cannot send {', '.join(values)} to the ranks: {type(e).__name__}: {e}. Send the "
                            "values it is built from, and build it in a %%ranks cell") from e
        self._ask(targets, ("push", data))

    def status(self) -> list[dict]:
        """Each rank's pid, device and resident memory (and GPU memory on a GPU), and whether it is alive."""
        rows = []
        for r in self.ranks:
            alive = not r.gone and self.server.alive()
            row = {"rank": r.rank, "pid": r.pid, "alive": alive}
            if alive:
                row.update(self._ask([r.rank], ("status",))[r.rank])
            rows.append(row)
        return rows

    def stop(self) -> None:
        """Stop every rank and the rank server; nothing is left running. Safe to call twice."""
        if self.stopped:
            return
        self.stopped = True
        atexit.unregister(self.stop)
        live = [r for r in self.ranks if r is not None]
        for r in live:
            if not r.gone:
                try:
                    self._send(r.rank, ("stop",))
                except OSError:
                    pass
        try:
            if self.server.alive():
                self.server.stop([r.pid for r in live], kill=False)
        except (RuntimeError, OSError):  # the server is gone: so are its ranks
            pass
        finally:
            self.server.close()
            for r in live:
                self._close(r)
            shutil.rmtree(self.directory, ignore_errors=True)

    # ---- starting ranks ---------------------------------------------------------------------
    def _fork(self, which: list[int]) -> None:
        """Ask the server to fork the ranks in `which`, joining the process group of this generation."""
        child_fds, ours = [], []
        try:
            for _ in which:
                out_read, out_write = os.pipe()
                result_read, result_write = os.pipe()
                command_read, command_write = os.pipe()
                child_fds += [out_write, result_write, command_read]
                ours.append((out_read, result_read, command_write))
            request = {"live": True, "ranks": which, "world_size": self.world_size, "backend": self.backend,
                       "store": self._store(), "trace": self.directory, "seed": self.seed,
                       "timeout": GROUP_TIMEOUT, "task": None, "cwd": os.getcwd(), "sys_path": list(sys.path),
                       "env": dict(os.environ), "sources": pickling.cell_sources()}
            pids = self.server.launch(request, child_fds)
        except BaseException:
            for fd in child_fds + [fd for trio in ours for fd in trio]:
                os.close(fd)
            raise
        for fd in child_fds:
            os.close(fd)
        for rank, pid, (out_fd, result_fd, command_fd) in zip(which, pids, ours):
            os.set_blocking(out_fd, False)
            self.ranks[rank] = _LiveRank(rank, pid, out_fd, result_fd, command_fd)

    def _store(self) -> str:
        return os.path.join(self.directory, f"store-{self.generation}")

    def _expect_ready(self, new: list[int], regrouping: list[int]) -> None:
        """Wait for the ranks in `new` to say they are ready and those in `regrouping` to answer."""
        answers: dict = {}
        try:
            self._wait(new + regrouping, answers, timeout=CONNECT_TIMEOUT, watch=False)
        except _Stuck:
            late = sorted(set(new + regrouping) - set(answers))
            raise RankError(f"ranks {late} did not join the process group within {CONNECT_TIMEOUT:g} s; "
                            "stop them with `%ranks stop` and start again") from None
        for r in sorted(answers):
            kind, value = answers[r]
            if kind == "died":
                raise RankError(f"rank {r} exited (exit code {value}) while joining the process group")
            if kind == "error":
                raise RankError(f"rank {r} could not join the process group: {value['message']}\n"
                                f"{value['traceback']}")

    # ---- talking to the ranks ---------------------------------------------------------------
    def _targets(self, targets) -> list[int]:
        if self.stopped:
            raise RanksError("these ranks were stopped; start new ones with `%ranks start N`")
        if targets is None:
            return list(range(self.world_size))
        targets = sorted(set(targets))
        wrong = [t for t in targets if not isinstance(t, int) or not 0 <= t < self.world_size]
        if wrong or not targets:
            raise ValueError(f"ranks {wrong or targets} do not exist: the ranks are 0 to {self.world_size - 1}")
        return targets

    def _send(self, rank: int, command: tuple) -> None:
        data = pickle.dumps(command)
        from picotron.rank_server import _write_all
        _write_all(self.ranks[rank].command_fd, _FRAME.pack(len(data)) + data)

    def _ask(self, targets: list[int], command: tuple) -> dict:
        """Send a command that every rank answers at once, and return the answers' values."""
        for r in targets:
            self._send(r, command)
        answers: dict = {}
        try:
            self._wait(targets, answers, timeout=CONNECT_TIMEOUT, watch=False)
        except _Stuck:
            raise RanksError(f"ranks {sorted(set(targets) - set(answers))} did not answer within "
                             f"{CONNECT_TIMEOUT:g} s; `%ranks stop` and start again") from None
        for r in targets:
            kind, value = answers[r]
            if kind == "died":
                raise RanksError(f"rank {r} has exited (exit code {value}); `%ranks restart` starts the ranks again")
            if kind == "error":
                raise RanksError(f"rank {r}: {value['message']}")
        return {r: answers[r][1] for r in targets}

    def _wait(self, targets: list[int], answers: dict, *, timeout: float | None, watch: bool) -> None:
        """Relay every rank's output until each rank in `targets` has answered (into `answers`: rank ->
        (kind, value), kind "ok", "ready", "error" or "died"). Raise _Stuck("timeout") past `timeout`;
        with `watch`, raise _Stuck("hang") once the ranks' records show a hang that cannot end."""
        start = time.monotonic()
        deadline = math.inf if timeout is None else start + timeout
        selector = selectors.DefaultSelector()
        for r in self.ranks:
            if not r.gone:
                selector.register(r.out_fd, selectors.EVENT_READ, (r, "out"))
                selector.register(r.result_fd, selectors.EVENT_READ, (r, "result"))
        hang_since, last_states, next_look = None, None, start + 0.5
        try:
            while any(t not in answers for t in targets):
                now = time.monotonic()
                if now >= deadline:
                    raise _Stuck("timeout")
                for key, _ in selector.select(timeout=min(deadline - now, 0.5)):
                    r, kind = key.data
                    try:
                        chunk = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if kind == "out":
                        if chunk:
                            r.out_buffer += chunk
                            launch.relay_output(r)
                        else:
                            selector.unregister(key.fd)
                        continue
                    if chunk:
                        r.inbox += chunk
                        _unframe(r)
                    else:  # the rank exited
                        selector.unregister(key.fd)
                        r.gone = True
                        r.answers.append(("died", self._exit_code(r)))
                for r in self.ranks:
                    while r.answers and r.rank in targets and r.rank not in answers:
                        answers[r.rank] = r.answers.pop(0)
                if watch and time.monotonic() >= next_look:  # twice a second, however much the ranks print
                    next_look = time.monotonic() + 0.5
                    states = self._states()
                    stuck = _hang(states, [t for t in targets if t not in answers])
                    if stuck and states == last_states:
                        if time.monotonic() - hang_since >= HANG_SETTLE:
                            raise _Stuck("hang")
                    else:
                        hang_since, last_states = time.monotonic(), (states if stuck else None)
        finally:
            selector.close()
            self._drain()

    def _drain(self) -> None:
        """Relay what the ranks printed before they answered (it is in the pipe before the answer)."""
        for r in self.ranks:
            while True:
                try:
                    chunk = os.read(r.out_fd, 1 << 16)
                except (BlockingIOError, OSError):
                    break
                if not chunk:
                    break
                r.out_buffer += chunk
            launch.relay_output(r, final=True)

    def _exit_code(self, r: _LiveRank) -> int | None:
        try:
            self.server._wait_for([r.pid], seconds=5.0)
        except RuntimeError:  # the server itself is gone
            return None
        return self.server.exited.get(r.pid)

    def _states(self) -> list:
        return [collective_trace.read(collective_trace.record_path(self.directory, r), r)
                for r in range(self.world_size)]

    # ---- when a cell does not complete ------------------------------------------------------------
    def _file(self, result: CellResult, answers: dict) -> None:
        for r, (kind, value) in answers.items():
            if kind == "ok":
                result.values[r] = value
            elif kind == "error":
                result.errors[r] = value
            elif kind == "died":
                result.died[r] = value

    def _where(self, result: CellResult, answers: dict, timeout: float | None) -> str:
        """The headline and one line per rank: where each rank was when the cell was ended."""
        busy = [r for r in result.targets if r not in answers]
        if result.why == "hang":
            head = (f"The cell cannot finish: {_ranks(busy)} wait{'' if len(busy) > 1 else 's'} in a collective "
                    "that will never complete. A collective completes only when every rank of its group calls it: "
                    "the same operation, in the same order.")
        elif result.why == "timeout":
            head = f"{_ranks(busy).capitalize()} had not finished the cell after {timeout:g} s."
        else:
            head = f"Interrupted: {_ranks(busy)} had not finished the cell."
        lines = []
        for state in self._states():
            r = state.rank
            if r not in result.targets:
                lines.append(f"rank {r} does not run this cell (it runs on ranks "
                             f"{', '.join(map(str, result.targets))})")
            elif r in result.errors:
                lines.append(f"rank {r} stopped at its error ({result.errors[r]['type'].__name__}, traceback above)"
                             + (f" after {state.collective.describe()}" if state.collective else ""))
            elif r in result.died:
                lines.append(f"rank {r} exited during the cell (exit code {result.died[r]})")
            else:
                lines.append(collective_trace.report([state], what="the cell", backend=self.backend))
        return head + "\nWhere each rank was:\n" + textwrap.indent("\n".join(lines), "  ")

    def _recover(self, result: CellResult, answers: dict) -> str:
        """Interrupt the busy ranks; restart those that cannot be interrupted (and any that exited), then
        put every rank in a new process group if any was restarted. Say what each rank kept."""
        busy = [r for r in result.targets if r not in answers]
        # A rank in a collective waits in C++ (gloo, NCCL): SIGINT would not reach Python before the
        # collective returns, which it never does. The others (computing in Python) are interrupted.
        states = self._states()
        computing = [r for r in busy if states[r].phase != "in a collective"]
        for r in computing:
            try:
                os.kill(self.ranks[r].pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        late: dict = {}
        try:
            self._wait(computing, late, timeout=INTERRUPT_GRACE, watch=False)
        except (_Stuck, KeyboardInterrupt):
            pass
        interrupted = sorted(r for r, (kind, _) in late.items() if kind == "error")
        for r, (kind, value) in late.items():
            if kind == "died":
                result.died[r] = value
        restart = sorted(set(busy) - set(interrupted) | set(result.died))
        parts = []
        if interrupted:
            parts.append(f"{_ranks(interrupted)} stopped at KeyboardInterrupt and kept {_their(interrupted)} variables")
        if not restart:
            return "Recovered: " + "; ".join(parts or ["every rank kept its variables"]) + "."
        stuck = sorted(set(restart) - set(result.died))
        if stuck:
            parts.append(f"{_ranks(stuck)} could not be interrupted (a rank blocked in a collective waits inside "
                         "gloo or NCCL, not in Python)")
        self._restart(restart)
        parts.append(f"restarted {_ranks(restart)}: {_their(restart)} variables are gone (a fresh namespace: torch, "
                     "dist, rank, world_size, device)")
        kept = [r for r in range(self.world_size) if r not in restart and r not in interrupted]
        if kept:
            parts.append(f"{_ranks(kept)} kept {_their(kept)} variables")
        return ("Recovered: " + "; ".join(parts) + ". Every rank is in a new process group: make the groups you made "
                "with dist.new_group again.")

    def _restart(self, which: list[int]) -> None:
        """Kill the ranks in `which` and fork them again; every rank joins a new process group."""
        pids = [self.ranks[r].pid for r in which]
        self.server.stop(pids, kill=True)
        for r in which:
            self._close(self.ranks[r])
        self.generation += 1
        keep = [r for r in range(self.world_size) if r not in which]
        for r in keep:
            self._send(r, ("regroup", self._store()))
        self._fork(which)
        self._expect_ready(which, keep)

    def _close(self, r: _LiveRank) -> None:
        for fd in (r.out_fd, r.result_fd, r.command_fd):
            try:
                os.close(fd)
            except OSError:
                pass
        r.gone = True


class _Stuck(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def _unframe(r: _LiveRank) -> None:
    """Move each complete frame of the rank's answers into `r.answers`."""
    while len(r.inbox) >= _FRAME.size:
        n = _FRAME.unpack_from(r.inbox)[0]
        if len(r.inbox) < _FRAME.size + n:
            return
        r.answers.append(pickle.loads(bytes(r.inbox[_FRAME.size:_FRAME.size + n])))
        del r.inbox[:_FRAME.size + n]


_POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list", "recv_object_list")


def _hang(states: list, busy: list[int]) -> bool:
    """Whether the ranks still in the cell (`busy`) can never finish: every one waits in a collective,
    and some wait cannot be met, because a rank it needs is done with the cell (or does not run it), or
    waits in another call (one thread per rank: it cannot be in two calls at once)."""
    if not busy:
        return False
    calls = {}
    for r in busy:
        state = states[r]
        c = state.collective
        if state.phase != "in a collective" or c is None or c.mode == "async":
            return False  # computing, or posting an async call: it may still arrive
        calls[r] = c
    for r, c in calls.items():
        if c.op in _POINT_TO_POINT:
            peers = [int(p) for p in re.findall(r"(?:to|from) (\d+)", c.peer)]
            if peers and any(p not in calls for p in peers):
                return True
            continue
        members = [int(m) for m in re.findall(r"\d+", c.group)]
        for m in members:
            other = calls.get(m)
            if other is None or (other.op, other.number, other.group) != (c.op, c.number, c.group):
                return True
    return False


def _check_timeout(timeout) -> None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or not 0 < timeout < math.inf):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (or None: no limit)")


def _ranks(ranks: list[int]) -> str:
    """'rank 1', 'ranks 0 and 2', 'ranks 0, 1 and 3'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + " and " + str(ranks[-1])


def _their(ranks: list[int]) -> str:
    return "their" if len(ranks) > 1 else "its"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# ---- showing values --------------------------------------------------------------------------------
def side_by_side(values: dict, width: int = 120) -> dict:
    """A display bundle of the ranks' values: text columns "rank r" side by side when they fit in
    `width` characters, else one block per rank; and an HTML table with one column per rank."""
    ranks = sorted(values)
    texts = {r: values[r]["text/plain"].splitlines() or [""] for r in ranks}
    widths = {r: max(len(f"rank {r}"), *map(len, texts[r])) for r in ranks}
    if sum(widths.values()) + 3 * (len(ranks) - 1) <= width:
        rows = [" | ".join(f"rank {r}".ljust(widths[r]) for r in ranks).rstrip()]
        rows.append("-+-".join("-" * widths[r] for r in ranks))
        for i in range(max(len(t) for t in texts.values())):
            rows.append(" | ".join((texts[r][i] if i < len(texts[r]) else "").ljust(widths[r])
                                   for r in ranks).rstrip())
        plain = "\n".join(rows)
    else:
        plain = "\n".join(f"[rank {r}]\n" + "\n".join(texts[r]) for r in ranks)
    header = "".join(f"<th>rank {r}</th>" for r in ranks)
    cells = "".join("<td style='text-align:left;vertical-align:top'>"
                    + (values[r].get("text/html") or f"<pre>{html.escape(values[r]['text/plain'])}</pre>") + "</td>"
                    for r in ranks)
    return {"text/plain": plain, "text/html": f"<table><tr>{header}</tr><tr>{cells}</tr></table>"}


# ---- the IPython extension ---------------------------------------------------------------------------
_current: Ranks | None = None
_last: CellResult | None = None


def current() -> Ranks | None:
    """The ranks `%ranks start` made (None before, or after `%ranks stop`)."""
    return None if _current is None or _current.stopped else _current


def last_cell() -> CellResult | None:
    """How the last %%ranks cell went (its values, errors, hang report and recovery), for a cell that checks it."""
    return _last

_USAGE = """\
%ranks start N [--backend gloo|nccl|auto] [--timeout S]   start N ranks (stops any running ones)
%ranks stop | restart | status
%ranks pull NAME          the value of NAME on every rank, as a list
%ranks push NAME [NAME]   bind the notebook's NAME on every rank
%%ranks [0,2] [--timeout S]   run the cell on every rank (or on ranks 0 and 2)"""


def load_ipython_extension(ipython) -> None:
    """`%load_ext picotron.ranks`: register %ranks / %%ranks, and show a RanksError as its message alone."""
    ipython.register_magic_function(_magic, "line_cell", "ranks")
    ipython.set_custom_exc((RanksError,), _show_error)


def unload_ipython_extension(ipython) -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def _show_error(shell, kind, error, tb, tb_offset=None):
    print(f"{kind.__name__}: {error}", file=sys.stderr)


def _magic(line: str, cell: str | None = None):
    global _current, _last
    from IPython import get_ipython
    shell = get_ipython()
    words = shlex.split(line)
    options = _options(words)
    if cell is not None:
        if _current is None or _current.stopped:
            raise RanksError("no ranks are running: start them with `%ranks start 4` (4 ranks) in a cell above")
        targets = None
        if words and re.fullmatch(r"\d+(,\d+)*", words[0]):
            targets = [int(t) for t in words.pop(0).split(",")]
        if words:
            raise RanksError(f"%%ranks {line}: unknown {words[0]!r}\n{_USAGE}")
        file = _cell_name(shell)
        try:
            result = _current.execute(cell, targets=targets, timeout=options.get("timeout"), file=file, first_line=2,
                                      text=f"%%ranks {line}\n{cell}")
        except SyntaxError as e:  # found before any rank ran the cell: the error alone, no magic frames
            import traceback
            raise RanksError("the cell is not valid Python, so no rank ran it:\n"
                             + "".join(traceback.format_exception_only(type(e), e)).rstrip()) from None
        _last = result
        by_traceback: dict = {}  # ranks that raised the same error show it once
        for r in sorted(result.errors):
            by_traceback.setdefault(result.errors[r]["traceback"], []).append(r)
        for text, ranks in by_traceback.items():
            print(f"--- {_ranks(ranks)} raised {result.errors[ranks[0]]['type'].__name__} ---\n{text.rstrip()}",
                  file=sys.stderr)
        shown = {r: v for r, v in result.values.items() if v is not None}
        if shown:
            from IPython.display import display
            display(side_by_side(shown), raw=True)
        error = result.error()
        if error is not None:
            raise error
        return None
    command = words.pop(0) if words else "status"
    if command == "start":
        if not words or not words[0].isdigit():
            raise RanksError(f"%ranks start needs the number of ranks: `%ranks start 4`\n{_USAGE}")
        if _current is not None and not _current.stopped:
            print(f"picotron.ranks: stopping the {_current.world_size} running ranks first")
            _current.stop()
        started = time.perf_counter()
        _current = Ranks(int(words[0]), backend=options.get("backend", "auto"), timeout=options.get("timeout"))
        print(f"picotron.ranks: {_current.world_size} ranks ready ({_current.backend}) in "
              f"{time.perf_counter() - started:.1f} s; run cells on them with %%ranks")
        return None
    if _current is None or _current.stopped:
        if command == "stop":
            return None
        raise RanksError(f"no ranks are running: start them with `%ranks start 4` before `%ranks {command}`")
    if command == "stop":
        _current.stop()
        print(f"picotron.ranks: stopped the {_current.world_size} ranks")
        return None
    if command == "restart":
        size, backend, timeout = _current.world_size, _current.backend, _current.timeout
        _current.stop()
        _current = Ranks(size, backend=backend, timeout=timeout)
        print(f"picotron.ranks: {size} new ranks ready; every variable on the ranks is gone")
        return None
    if command == "status":
        print(_status_table(_current.status()))
        return None
    if command == "pull":
        if len(words) != 1:
            raise RanksError("%ranks pull takes one name: `xs = %ranks pull x`")
        return _current.pull(words[0])
    if command == "push":
        if not words:
            raise RanksError("%ranks push takes the names of notebook values: `%ranks push lr steps`")
        missing = [w for w in words if w not in shell.user_ns]
        if missing:
            raise RanksError(f"%ranks push: {', '.join(missing)} not defined in the notebook")
        _current.push({w: shell.user_ns[w] for w in words})
        return None
    raise RanksError(f"%ranks {command}: unknown command\n{_USAGE}")


def _cell_name(shell) -> str:
    """"Cell In[N]" for the cell running this magic, as IPython's own tracebacks name it: found from the file
    IPython compiled the cell into (its execution count has already moved on while the cell runs)."""
    frame = sys._getframe(1)
    name_of = getattr(shell.compile, "format_code_name", lambda file: None)
    while frame is not None:
        named = name_of(frame.f_code.co_filename)
        if named:
            return " ".join(named)
        frame = frame.f_back
    return f"Cell In[{shell.execution_count}]"


def _options(words: list[str]) -> dict:
    """Take `--timeout S` and `--backend B` out of `words`."""
    options = {}
    for name, kind in (("--timeout", float), ("--backend", str)):
        if name in words:
            at = words.index(name)
            if at + 1 >= len(words):
                raise RanksError(f"{name} needs a value\n{_USAGE}")
            try:
                options[name[2:]] = kind(words[at + 1])
            except ValueError:
                raise RanksError(f"{name} {words[at + 1]!r}: not a number of seconds") from None
            del words[at:at + 2]
    return options


def _status_table(rows: list[dict]) -> str:
    lines = ["rank  pid      alive  device   memory"]
    for row in rows:
        memory = f"{row['rss'] / 2**20:.0f} MiB resident" if "rss" in row else "-"
        if "gpu_allocated" in row:
            memory += (f", {row['gpu_allocated'] / 2**20:.0f} MiB on the GPU "
                       f"({row['gpu_reserved'] / 2**20:.0f} reserved)")
        lines.append(f"{row['rank']:<5} {row['pid']:<8} {'yes' if row['alive'] else 'no':<6} "
                     f"{row.get('device', '-'):<8} {memory}")
    return "\n".join(lines)

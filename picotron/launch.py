"""Run a function on N ranks: from a notebook cell, a test or a script.

The first chapter (chapters/00_collectives.ipynb) starts here; docs/design.md, "Starting ranks",
says why the ranks are forked by a rank server and never from the caller.

    def step():
        rank = dist.get_rank()
        ...
        return loss.item()

    losses = run(step, world_size=4, timeout=120)   # [loss on rank 0, ..., loss on rank 3]

How the ranks start. A rank must begin in a clean interpreter: forking the caller itself would
copy a notebook that has already run a backward pass (autograd's device threads, which a forked
child cannot use on a machine with a GPU) or touched CUDA (which a forked child cannot
initialise again). So the first `run` starts one helper process, the *rank server*
(picotron/rank_server.py): a fresh Python that imports torch and then only waits. Each `run`
asks it to fork the N ranks, so every rank starts from that clean, already-imported state (about 0.1 s for 4 ranks, against about
1 s to start a Python with torch; the server itself costs that once). The function travels to
the ranks with cloudpickle, which copies a function defined in a notebook cell, with the
values it uses, by value. The ranks join one process group (they meet through a file):
NCCL with one GPU per rank when there are enough GPUs, otherwise gloo on the CPU, N processes
standing in for N GPUs, with the GPUs hidden from them so that they never initialise CUDA
(the caller's own single-process work keeps the GPU). The collectives are the same; only the
speed differs.

What the caller can rely on:
- every rank is seeded with the same seed and runs with one CPU thread (N ranks share the
  machine's cores; more threads per rank oversubscribe them);
- each rank's stdout and stderr come back to the caller, line by line, as "[rank r] ...";
- the return value is the list of per-rank results (moved to the CPU);
- when a rank raises, every rank is stopped and the caller gets the same exception type,
  with the rank and its traceback in the message (and apart, as its attributes `rank`,
  `rank_message` and `rank_traceback`); a rank that dies without raising (a crash
  in native code, os._exit, out of memory) is reported with its exit code, ahead of the
  connection errors it causes on the ranks that were waiting for it;
- after `timeout` seconds every rank is killed and a TimeoutError names the ranks that had
  not finished, then says where each rank was: finished, or the collective it waits in (its
  operation, call number, group, bytes and the line that called it), or computing outside any
  collective (picotron/collective_trace.py; the same as data in the error's `rank_states`); no
  rank outlives the call, and the rank server dies with the caller;
- arguments that cannot work (fn not callable, world_size < 1, a timeout that is not a
  positive number of seconds, an unknown backend) are refused before any rank starts, and so
  is a Python without os.fork (native Windows: the course runs in WSL).

Under `torchrun` (RANK and WORLD_SIZE set) `run` calls `fn` in the current process and
all-gathers the results, so the same notebook code works on a real cluster.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import pickle
import re
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from picotron import collective_trace, pickling
from picotron.rank_server import RankError, receive, seed_everything, send

__all__ = ["run", "device", "backend_for"]


def backend_for(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, otherwise gloo on the CPU."""
    return "nccl" if _gpu_count() >= world_size else "gloo"


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL (or in a single process on a
    GPU machine), else the CPU."""
    if dist.is_initialized():
        on_gpu = dist.get_backend() == "nccl"
    else:
        on_gpu = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def run(fn: Callable, world_size: int, *, args: tuple = (), kwargs: dict | None = None,
        timeout: float = 180, seed: int = 0, backend: str = "auto") -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks and return the per-rank results.

    Arguments that cannot work are refused here, before any rank starts (see `_check_arguments`).
    Tensors travel on the CPU both ways: a GPU tensor among the arguments arrives as a CPU copy (move it to the
    rank's device in fn), and the results come back on the CPU, whatever the ranks' devices.
    When a rank raises, the exception the caller gets also carries the rank's own account of it:
    `.rank` (its number), `.rank_message` (its message, alone) and `.rank_traceback` (its traceback).
    """
    kwargs = {} if kwargs is None else kwargs
    _check_arguments(fn, world_size, args, kwargs, timeout, seed, backend)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_in_place(fn, world_size, args, kwargs, seed, backend)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; "
                           "call run() from a process that has none (or under torchrun)")
    if not hasattr(os, "fork"):
        raise RuntimeError("run() starts the ranks by forking them from a helper process, and this Python has no "
                           "os.fork (Windows): run the course in WSL (Ubuntu), where it works as on Linux")
    backend = _choose_backend(backend, world_size)
    with _launch_lock:
        return _Launch(fn, world_size, args, kwargs, timeout, seed, backend).go()


def _check_arguments(fn, world_size, args, kwargs, timeout, seed, backend) -> None:
    """Raise TypeError or ValueError, naming the argument and what to pass, for arguments `run` cannot use."""
    if not callable(fn):
        raise TypeError(f"run(fn, world_size): fn={_shown(fn)} ({type(fn).__name__}) is not callable; pass the "
                        f"function every rank calls, by its name without parentheses (run(step, 4) after "
                        f"`def step(): ...`), and its arguments with args=(...)")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a whole number of ranks, at least 1")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args={_shown(args)} must be a tuple of fn's positional arguments (args=(x,) for one)")
    if not isinstance(kwargs, dict):
        raise TypeError(f"kwargs={_shown(kwargs)} must be a dict of fn's keyword arguments (kwargs={{'steps': 10}})")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds: how long the ranks may run "
                         f"before every rank is killed (default 180)")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} must be a whole number (every rank seeds its generators with it)")
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={backend!r}; choose 'auto', 'gloo' or 'nccl'")


def _shown(value) -> str:
    """repr(value), cut to a length that fits in a message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _choose_backend(backend: str, world_size: int) -> str:
    """Say once, for each world size, where the ranks run and why."""
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        why = ("this torch is a CPU build" if not torch.backends.cuda.is_built() else
               f"{gpus} GPU{'s' if gpus != 1 else ''} visible here")
        raise ValueError(f"backend='nccl' needs one GPU per rank, {world_size} in all, but {why}; "
                         "use backend='gloo' (or 'auto') to run the ranks as CPU processes")
    chosen = backend_for(world_size) if backend == "auto" else backend
    if (chosen, world_size) not in _told:
        _told.add((chosen, world_size))
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        if chosen == "nccl":
            print(f"picotron.launch: {ranks} with NCCL, one GPU each (cuda:0..{world_size - 1})")
        else:
            why = ("asked for" if backend == "gloo" else
                   "no GPU here" if gpus == 0 else
                   f"{gpus} GPU{'s' if gpus != 1 else ''} here, fewer than {world_size}; "
                   "the ranks leave the GPU to this process")
            print(f"picotron.launch: {ranks} as CPU processes with gloo ({why})")
    return chosen


_told: set = set()
_launch_lock = threading.Lock()


def _run_in_place(fn: Callable, world_size: int, args: tuple, kwargs: dict, seed: int, backend: str) -> list:
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"run(world_size={world_size}) under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}; "
                         f"launch torchrun with --nproc-per-node {world_size}")
    owns_group = not dist.is_initialized()
    if owns_group:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        backend = _choose_backend(backend, local_world) if backend != "gloo" else backend
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    seed_everything(seed)
    result = fn(*args, **kwargs)
    results: list = [None] * world_size
    dist.all_gather_object(results, result)
    if owns_group:
        # A gloo group left for interpreter exit can abort the process ("terminate called
        # without an active exception") while its threads are torn down: close it ourselves.
        dist.destroy_process_group()
    return results


# ---- the caller's side -------------------------------------------------------------------------
@dataclass
class _Rank:
    """The caller's view of one rank: its pid, its output pipe and its result pipe."""
    rank: int
    out_fd: int
    result_fd: int
    pid: int = 0
    out_buffer: bytes = b""
    result: bytearray = field(default_factory=bytearray)  # grows in place: a large result stays linear
    open_fds: set = field(default_factory=set)
    exit_code: int | None = None
    died: bool = False  # ended without a result (before the caller stopped it)
    redrawing: bool = False  # the last thing printed was a progress-bar redraw without newline


class _Launch:
    def __init__(self, fn, world_size, args, kwargs, timeout, seed, backend):
        self.fn, self.world_size, self.timeout = fn, world_size, timeout
        self.task = _pickle_task(fn, args, kwargs)
        self.seed, self.backend = seed, backend
        self.ranks: list[_Rank] = []
        self.failed: list[_Rank] = []

    def go(self) -> list:
        """Launch; if gloo fails to connect the ranks to each other (before any rank has called
        `fn`: they pass a barrier first), launch again, at most twice more, and say so."""
        for attempt in range(3):
            try:
                return self._attempt()
            except _NotConnected as e:
                if attempt == 2:
                    raise e.error from None
                print(f"picotron.launch: the ranks could not connect ({str(e.error).splitlines()[0][:160]}); "
                      "starting them again", file=sys.stderr)
                self.ranks, self.failed = [], []

    def _attempt(self) -> list:
        sys.stdout.flush()
        sys.stderr.flush()
        self.server = _server()
        # The ranks meet through a file store in a fresh directory: no port to choose, and no TCP
        # connect to the store (on some machines one in a few dozen stalls for seconds).
        store_dir = self.store_dir = tempfile.mkdtemp(prefix="picotron-run-")
        child_fds = []
        try:
            for rank in range(self.world_size):
                out_read, out_write = os.pipe()
                result_read, result_write = os.pipe()
                self.ranks.append(_Rank(rank, out_read, result_read, open_fds={out_read, result_read}))
                child_fds += [out_write, result_write]
            request = {"world_size": self.world_size, "backend": self.backend,
                       "store": os.path.join(store_dir, "store"), "trace": store_dir,
                       "seed": self.seed, "timeout": self.timeout, "task": self.task,
                       "cwd": os.getcwd(), "sys_path": list(sys.path), "env": dict(os.environ),
                       "sources": pickling.cell_sources()}
            pids = self.server.launch(request, child_fds)
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            for r, pid in zip(self.ranks, pids):
                r.pid = pid
            self._watch()
        finally:
            for fd in child_fds:
                os.close(fd)
            self._stop_all()
            for r in self.ranks:
                for fd in r.open_fds:
                    os.close(fd)
            shutil.rmtree(store_dir, ignore_errors=True)
        return self._collect()

    # ---- watching the ranks -----------------------------------------------------------
    def _watch(self) -> None:
        """Relay output until every rank is done, one fails, or the time is up."""
        deadline = time.monotonic() + self.timeout
        selector = selectors.DefaultSelector()
        for r in self.ranks:
            selector.register(r.out_fd, selectors.EVENT_READ, (r, "out"))
            selector.register(r.result_fd, selectors.EVENT_READ, (r, "result"))
        try:
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._raise_timeout()
                for key, _ in selector.select(timeout=min(left, 0.5)):
                    r, kind = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        r.open_fds.discard(key.fd)
                        if kind == "out":
                            self._print(r, final=True)
                        elif self._failed(r):
                            self.failed.append(r)
                            self._drain(selector)
                            return
                    elif kind == "out":
                        r.out_buffer += chunk
                        self._print(r)
                    else:
                        r.result += chunk
        finally:
            selector.close()

    def _failed(self, r: _Rank) -> bool:
        r.died = not r.result
        try:
            return pickle.loads(r.result)[0] == "error"
        except Exception:  # noqa: BLE001 - an empty or cut result is a failure too (the rank died)
            return True

    def _drain(self, selector) -> None:
        """A rank failed: give the others a moment to print and to report how they ended (a
        rank that died shows up here too, after the connection errors it caused), then stop."""
        end = time.monotonic() + 0.3
        while selector.get_map() and time.monotonic() < end:
            for key, _ in selector.select(timeout=0.05):
                r, kind = key.data
                chunk = os.read(key.fd, 1 << 16)
                if chunk:
                    if kind == "out":
                        r.out_buffer += chunk
                        self._print(r)
                    else:
                        r.result += chunk
                    continue
                selector.unregister(key.fd)
                if kind == "result" and self._failed(r):
                    self.failed.append(r)
        for r in self.ranks:
            self._print(r, final=True)

    def _print(self, r: _Rank, final: bool = False) -> None:
        relay_output(r, final)

    def _raise_timeout(self) -> None:
        """Read where each rank is (picotron.collective_trace: the ranks are still alive, killed only after
        this raises) and raise a TimeoutError that names the stuck ranks, then says where every rank was."""
        stuck = [r.rank for r in self.ranks if not r.result]
        states = [collective_trace.read(collective_trace.record_path(self.store_dir, r.rank), r.rank)
                  for r in self.ranks]
        for r in self.ranks:
            self._print(r, final=True)
        where = collective_trace.report(states, backend=self.backend)
        error = TimeoutError(f"ranks {stuck} had not finished after {self.timeout:g} s; every rank was killed. "
                           "A rank waiting in a collective that another rank never calls hangs like this: "
                           "check that all ranks make the same collective calls in the same order, "
                           "or raise `timeout`.\nWhere each rank was when the time ran out:\n"
                           + textwrap.indent(where, "  "))
        error.rank_states = states  # the same, as data (collective_trace.RankState per rank)
        raise error

    def _stop_all(self) -> None:
        """Stop every rank (killing it, with its process group, unless all ended well) and learn every exit code."""
        all_ok = all(r.result for r in self.ranks) and not self.failed
        codes = self.server.stop([r.pid for r in self.ranks if r.pid], kill=not all_ok)
        for r in self.ranks:
            r.exit_code = codes.get(r.pid)

    def _collect(self) -> list:
        # A rank that died without a result is the cause; the ranks that were waiting for it in
        # a collective fail afterwards with connection errors, so report the death first.
        dead = [r for r in self.ranks if r.died]
        if dead:
            r = dead[0]
            raise RankError(f"rank {r.rank} (exit code {r.exit_code}) died without a result; a crash in native "
                            "code (a negative code is the signal that killed it), os._exit or running out of "
                            "memory does this" + self._others(r))
        for r in self.failed:
            if r.result:
                status, value = pickle.loads(r.result)
                if value.get("phase") == "connecting" and issubclass(value["type"], RuntimeError):
                    raise _NotConnected(_rebuild(value))
                raise _rebuild(value)
        results = []
        for r in self.ranks:
            if not r.result:
                continue
            status, value = pickle.loads(r.result)
            if status == "error":
                raise _rebuild(value)
            results.append(value)
        if len(results) < self.world_size:
            gone = [f"rank {r.rank} (exit code {r.exit_code})" for r in self.ranks if not r.result]
            raise RankError(f"{', '.join(gone)} died without a result; a crash in native code, os._exit or "
                            "running out of memory does this")
        return results

    def _others(self, dead: _Rank) -> str:
        errors = [r for r in self.ranks if r is not dead and r.result and self._failed(r)]
        if not errors:
            return ""
        return "; then " + ", ".join(f"rank {r.rank}" for r in errors) + " failed waiting for it"


def relay_output(r, final: bool = False) -> None:
    """Print rank `r.rank`'s complete lines (from `r.out_buffer`) with a "[rank r]" prefix. A progress
    bar redraws its line after a carriage return: relay that as a redraw, not as a new line
    (`r.redrawing` remembers one). `final`: the rank is done, print its unfinished line too."""
    pieces = re.split(rb"(\r|\n)", r.out_buffer)  # text, separator, text, ..., unfinished rest
    r.out_buffer = pieces.pop()
    if final and r.out_buffer:
        pieces += [r.out_buffer, b"\n"]
        r.out_buffer = b""
    for text, separator in zip(pieces[::2], pieces[1::2]):
        line = f"[rank {r.rank}] {text.decode(errors='replace')}"
        if separator == b"\r":
            if text.strip():
                print("\r" + line, end="", flush=True)
                r.redrawing = True
        else:
            print(("\r" if r.redrawing else "") + line, flush=True)
            r.redrawing = False


class _NotConnected(Exception):
    """The ranks failed while joining the process group, before any ran the function."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _pickle_task(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return pickling.dumps((fn, args, kwargs), tensors_on_cpu=True)
    except Exception as e:  # noqa: BLE001 - say what could not travel and what to do instead
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"run() cannot send {name} and its arguments to the ranks: {type(e).__name__}: {e}. "
                        "Each rank gets a copy of the function, its arguments and the notebook values it uses; "
                        "create such an object inside the function instead (or pass what it is built from)") from e


def _rebuild(info: dict) -> BaseException:
    """The caller gets the rank's exception type, with the rank and its traceback in the message, and
    the same pieces apart as attributes (`rank`, `rank_message`, `rank_traceback`) for whoever shows
    the error in fewer words (`python -m picotron.train` prints one line)."""
    message = f"rank {info['rank']} raised {info['type'].__name__}: {info['message']}\n\n" \
              f"--- traceback of rank {info['rank']} ---\n{info['traceback']}"
    try:
        error = info["type"](message)
    except Exception:  # noqa: BLE001 - some exception types need other constructor arguments
        error = RankError(message)
    try:
        error.rank, error.rank_message, error.rank_traceback = info["rank"], info["message"], info["traceback"]
    except AttributeError:  # an exception type with __slots__: the message still says it all
        pass
    return error


# ---- the caller's handle on its rank server (picotron/rank_server.py) ---------------------------
class _Server:
    """The caller's handle on its rank server."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log = tempfile.TemporaryFile()  # what the server itself prints, shown if it fails
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
        env["OMP_NUM_THREADS"] = "1"
        # Asking how many GPUs there are must not initialise CUDA in the server (a forked rank
        # could not use it then): count them through NVML instead.
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(name, None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"import picotron.rank_server as s; s.serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL, stderr=self.log,
            start_new_session=True)
        theirs.close()
        self.sock = ours
        self.exited: dict[int, int] = {}

    def alive(self) -> bool:
        return self.process.poll() is None

    def launch(self, request: dict, fds: list[int]) -> list[int]:
        send(self.sock, request, fds)
        while True:
            message = self._next()
            if message[0] == "started":
                return message[1]
            if message[0] == "failed":
                raise RuntimeError(f"the rank server could not start the ranks: {message[1]}")

    def stop(self, pids: list[int], *, kill: bool) -> dict[int, int]:
        """Wait until every rank in `pids` has exited and return their exit codes. With `kill`
        (a rank failed, or time ran out) kill them at once; otherwise give them a few seconds to
        exit by themselves (they have sent their results) before killing what is left. The server
        does the killing: it knows which of its children have not been reaped, so a pid that has
        meanwhile been reused by another process is never hit."""
        if not kill:
            self._wait_for(pids, seconds=5.0)
        left = [pid for pid in pids if pid not in self.exited]
        if left:
            send(self.sock, ("kill", left))
            if not self._wait_for(pids, seconds=30.0):
                self.close()  # the server is stuck: take it down, its ranks go with it
        return {pid: self.exited.get(pid) for pid in pids}

    def _wait_for(self, pids: list[int], seconds: float) -> bool:
        """Wait up to `seconds` for the server to report every pid's exit; whether it did."""
        deadline = time.monotonic() + seconds
        while any(pid not in self.exited for pid in pids):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._next(timeout=min(1.0, left))
        return True

    def _next(self, timeout: float | None = None) -> tuple:
        self.sock.settimeout(timeout)
        try:
            message, _ = receive(self.sock)
        except socket.timeout:
            return ("waiting",)
        finally:
            self.sock.settimeout(None)
        if message is None:
            code = self.process.wait()
            self.log.seek(0)
            said = self.log.read().decode(errors="replace")[-4000:]
            raise RuntimeError(f"the rank server exited (code {code}); the next run() starts a new one. "
                               f"It said:\n{said}")
        if message[0] == "exited":
            self.exited[message[1]] = message[2]
        return message

    def close(self) -> None:
        self.sock.close()
        if self.alive():
            self.process.kill()
        self.process.wait()


_the_server: _Server | None = None


def _server() -> _Server:
    """The caller's rank server, started on first use (about a second: a fresh Python imports torch)."""
    global _the_server
    if _the_server is None or not _the_server.alive():
        if _the_server is not None:  # it died (killed, or the machine ran out of memory)
            _the_server.close()
        _the_server = _Server()
        atexit.register(_the_server.close)
    return _the_server



"""Run a function on N ranks: from a notebook cell, a test or a script.

    def step():
        rank = dist.get_rank()
        ...
        return loss.item()

    losses = run(step, world_size=4, timeout=120)   # [loss on rank 0, ..., loss on rank 3]

Each rank is a forked child process (0.1 s for 4 ranks, and unlike `spawn` it works with a
function defined in a notebook cell). The children join one process group: NCCL with one GPU
per rank when there are enough GPUs, otherwise gloo on the CPU, N processes standing in for
N GPUs. The collectives are the same; only the speed differs.

What the caller can rely on:
- every rank is seeded with the same seed and runs with one CPU thread (N ranks share the
  machine's cores; more threads per rank oversubscribe them and a forked child that keeps
  the parent's OpenMP threads can hang);
- each rank's stdout and stderr come back to the caller, line by line, as "[rank r] ...";
- the return value is the list of per-rank results;
- when a rank raises, every rank is stopped and the caller gets the same exception type,
  with the rank and its traceback in the message;
- after `timeout` seconds every rank is killed and a TimeoutError names the ranks that had
  not finished; no child process outlives the call.

Under `torchrun` (RANK and WORLD_SIZE set) `run` calls `fn` in the current process and
all-gathers the results, so the same notebook code works on a real cluster.
"""

from __future__ import annotations

import os
import pickle
import re
import random
import select
import selectors
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run", "device", "backend_for", "RankError"]


class RankError(RuntimeError):
    """Raised in the caller when a rank failed with an exception that cannot be rebuilt."""


def backend_for(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, otherwise gloo on the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL (or in a single process on a
    GPU machine), else the CPU."""
    if dist.is_initialized():
        on_gpu = dist.get_backend() == "nccl"
    else:
        on_gpu = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # numpy is optional for the launcher itself
        pass


def run(fn: Callable, world_size: int, *, args: tuple = (), kwargs: dict | None = None,
        timeout: float = 180, seed: int = 0, backend: str = "auto") -> list:
    """Call `fn(*args, **kwargs)` on `world_size` ranks and return the per-rank results."""
    kwargs = kwargs or {}
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_in_place(fn, world_size, args, kwargs, seed, backend)
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; "
                           "call run() from a process that has none (or under torchrun)")
    backend = backend_for(world_size) if backend == "auto" else backend
    if backend == "nccl" and torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised in this process, and forked ranks cannot use it. "
                           "Restart the kernel and call run() before any CUDA work in the parent "
                           "(do GPU work inside the function you pass to run).")
    _say_backend_once(backend, world_size)
    return _Launch(fn, world_size, args, kwargs, timeout, seed, backend).go()


_told: set = set()


def _say_backend_once(backend: str, world_size: int) -> None:
    if backend == "gloo" and world_size not in _told:
        _told.add(world_size)
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
        why = (f"{gpus} GPU{'s' if gpus != 1 else ''} here, fewer than {world_size}" if gpus < world_size
               else "asked for")
        print(f"picotron.launch: {ranks} as CPU processes with gloo ({why})")


def _run_in_place(fn: Callable, world_size: int, args: tuple, kwargs: dict, seed: int, backend: str) -> list:
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"run(world_size={world_size}) under torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}; "
                         f"launch torchrun with --nproc-per-node {world_size}")
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = backend_for(int(os.environ.get("LOCAL_WORLD_SIZE", world_size))) if backend == "auto" else backend
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


@dataclass
class _Rank:
    """The parent's view of one child: its pid, its output pipe and its result pipe."""
    rank: int
    pid: int
    out_fd: int
    result_fd: int
    out_buffer: bytes = b""
    result: bytearray = field(default_factory=bytearray)  # grows in place: a large result stays linear
    open_fds: set = field(default_factory=set)
    exit_code: int | None = None
    redrawing: bool = False  # the last thing printed was a progress-bar redraw without newline


class _Launch:
    def __init__(self, fn, world_size, args, kwargs, timeout, seed, backend):
        self.fn, self.world_size, self.args, self.kwargs = fn, world_size, args, kwargs
        self.timeout, self.seed, self.backend = timeout, seed, backend
        self.ranks: list[_Rank] = []
        self.first_failure: _Rank | None = None

    def go(self) -> list:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            # Rank 0 hosts the rendezvous store on a port the OS picks (no fixed port, no race)
            # and tells us the port; the parent starts no threads of its own before forking,
            # since a fork taken while another thread holds a lock can deadlock the child.
            port_read, port_write = os.pipe()
            self.ranks.append(self._fork(0, None, port_write))
            port = self._read_port(port_read)
            for rank in range(1, self.world_size):
                self.ranks.append(self._fork(rank, port, None))
            self._watch()
        finally:
            self._kill_all()
            for r in self.ranks:
                for fd in r.open_fds:
                    os.close(fd)
        return self._collect()

    def _read_port(self, port_read: int) -> int:
        with os.fdopen(port_read, "rb") as f:
            ready, _, _ = select.select([f], [], [], self.timeout)
            if not ready:
                raise TimeoutError(f"rank 0 did not start the rendezvous store within {self.timeout:g} s")
            data = f.read()
        if not data:  # rank 0 failed before its store was up: raise its error
            self._watch()
            self._collect()
            raise RankError(f"rank 0 did not start the rendezvous store within {self.timeout:g} s")
        return int(data)

    # ---- the child -------------------------------------------------------------------
    def _fork(self, rank: int, port: int | None, port_fd: int | None) -> _Rank:
        out_read, out_write = os.pipe()
        result_read, result_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: never returns
            os.close(out_read)
            os.close(result_read)
            for r in self.ranks:  # the pipes of earlier ranks belong to the parent
                for fd in r.open_fds:
                    os.close(fd)
            self._child(rank, port, port_fd, out_write, result_write)
        os.close(out_write)
        os.close(result_write)
        if port_fd is not None:
            os.close(port_fd)
        return _Rank(rank, pid, out_read, result_read, open_fds={out_read, result_read})

    def _child(self, rank: int, port: int | None, port_fd: int | None, out_fd: int, result_fd: int) -> None:
        code = 0
        try:
            os.setpgid(0, 0)  # own process group: killing it takes any grandchildren too
            _die_with_parent()
            torch.set_num_threads(1)
            # Point fds 1 and 2 at the pipe, so prints, warnings and C++ logs all come back.
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            payload = self._child_body(rank, port, port_fd)
        except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
            payload = ("error", _describe(e, rank))
            code = 1
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            with os.fdopen(result_fd, "wb") as f:
                f.write(pickle.dumps(payload))
        except BaseException as e:  # noqa: BLE001 - e.g. a result that cannot be pickled
            with os.fdopen(os.dup(2), "w") as err:
                err.write(f"could not send the result of rank {rank} to the parent: {e!r}\n")
            code = 2
        os._exit(code)  # skip the parent's atexit handlers (Jupyter's, pytest's)

    def _child_body(self, rank: int, port: int | None, port_fd: int | None) -> tuple:
        if self.backend == "nccl":
            torch.cuda.set_device(rank)
        timeout = timedelta(seconds=self.timeout)
        if rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                  wait_for_workers=False, timeout=timeout)
            with os.fdopen(port_fd, "wb") as f:
                f.write(str(store.port).encode())
        else:
            store = dist.TCPStore("127.0.0.1", port, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=self.world_size,
                                timeout=timedelta(seconds=self.timeout))
        seed_everything(self.seed)
        result = _to_cpu(self.fn(*self.args, **self.kwargs))  # a CUDA tensor would initialise CUDA in the parent
        dist.destroy_process_group()
        return ("ok", result)

    # ---- the parent ------------------------------------------------------------------
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
                            self.first_failure = r
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
        try:
            return pickle.loads(r.result)[0] == "error"
        except Exception:  # noqa: BLE001 - an empty or cut result is a failure too
            return True

    def _drain(self, selector) -> None:
        """A rank failed: give the others a moment to print, then stop everyone."""
        end = time.monotonic() + 0.3
        while selector.get_map() and time.monotonic() < end:
            for key, _ in selector.select(timeout=0.05):
                r, kind = key.data
                chunk = os.read(key.fd, 1 << 16)
                if kind == "out" and chunk:
                    r.out_buffer += chunk
                    self._print(r)
                elif kind == "result" and chunk:
                    r.result += chunk
        for r in self.ranks:
            self._print(r, final=True)

    def _print(self, r: _Rank, final: bool = False) -> None:
        """Print the rank's complete lines with a "[rank r]" prefix. A progress bar redraws
        its line after a carriage return: relay that as a redraw, not as a new line."""
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

    def _raise_timeout(self) -> None:
        stuck = [r.rank for r in self.ranks if not r.result]
        for r in self.ranks:
            self._print(r, final=True)
        raise TimeoutError(f"ranks {stuck} had not finished after {self.timeout:g} s; every rank was killed. "
                           "A rank waiting in a collective that another rank never calls hangs like this: "
                           "check that all ranks make the same collective calls in the same order, "
                           "or raise `timeout`.")

    def _kill_all(self) -> None:
        """Reap every child; kill (with its process group) any that is still running."""
        for r in self.ranks:
            if r.exit_code is not None:
                continue
            pid, status = os.waitpid(r.pid, os.WNOHANG)
            if pid == 0:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(r.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                _, status = os.waitpid(r.pid, 0)
            r.exit_code = os.waitstatus_to_exitcode(status)

    def _collect(self) -> list:
        if self.first_failure is not None and self.first_failure.result:
            status, value = pickle.loads(self.first_failure.result)
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
            dead = [f"rank {r.rank} (exit code {r.exit_code})" for r in self.ranks if not r.result]
            raise RankError(f"{', '.join(dead)} died without a result; a crash in native code or os._exit "
                            "does this, or running out of memory")
        return results


def _die_with_parent() -> None:
    """On Linux, ask the kernel to kill this rank if the parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (list, tuple):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _describe(e: BaseException, rank: int) -> dict:
    kind = type(e)
    try:
        pickle.loads(pickle.dumps(kind))  # a class defined inside a function cannot travel
    except Exception:  # noqa: BLE001
        kind = RankError
    return {"type": kind, "rank": rank, "message": f"{type(e).__name__}: {e}" if kind is RankError else str(e),
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__))}


def _rebuild(info: dict) -> BaseException:
    """The caller gets the rank's exception type, with the rank and its traceback in the message."""
    message = f"rank {info['rank']} raised {info['type'].__name__}: {info['message']}\n\n" \
              f"--- traceback of rank {info['rank']} ---\n{info['traceback']}"
    try:
        return info["type"](message)
    except Exception:  # noqa: BLE001 - some exception types need other constructor arguments
        return RankError(message)

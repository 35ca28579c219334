"""The rank server: the helper process behind `picotron.launch.run`, and what each rank does.

Why it exists: docs/design.md, "Starting ranks".

`run` starts this module once per caller, in a fresh Python (`serve`): it imports torch and
picotron's heavy dependencies, then only waits. For each launch the caller sends one request
(the pickled function, the caller's environment, working directory and sys.path, and two pipe
ends per rank); the server forks one process per rank, so every rank starts from this clean,
already-imported state, never from a copy of the caller (a notebook that has run a backward pass
or touched CUDA). It reports each rank's exit code back as the rank exits, and kills ranks when
the caller asks, or when the caller itself is gone.

A rank (`rank_main`) adopts the caller's environment (CPU ranks with the GPUs hidden), installs
picotron.collective_trace (each collective it calls leaves a record that the caller reads if the
ranks hang), joins the process group through a file store, passes a barrier, runs the function
and writes its result, or its error with the traceback, to its result pipe; then it waits for the
other ranks to finish before it leaves the group. Its stdout and stderr go to its output pipe,
which the caller relays as "[rank r] ...". A live rank (picotron.ranks, `%%ranks` cells) joins the
group the same way, then runs the commands it reads from a third pipe until it is told to stop
(`_live`). Only this module (with picotron.collective_trace) runs in the
server and the ranks; picotron.launch is the caller's side.
"""

from __future__ import annotations

import linecache
import os
import pickle
import random
import selectors
import signal
import socket
import struct
import sys
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from picotron import collective_trace

__all__ = ["RankError", "seed_everything", "serve", "send", "receive"]


class RankError(RuntimeError):
    """Raised in the caller when a rank failed without an exception that can be rebuilt there
    (it died, or its exception could not travel)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:  # numpy is optional for the launcher itself
        pass


# ---- talking to the caller ----------------------------------------------------------------------
# The caller and the server talk over a Unix socket in frames: 4 bytes of length, then a pickle.
# A launch request carries two pipe ends per rank (output, result) as file descriptors.
_FRAME = struct.Struct("!I")


def send(sock: socket.socket, message: Any, fds: list[int] = ()) -> None:
    data = pickle.dumps(message)
    socket.send_fds(sock, [_FRAME.pack(len(data))], list(fds))
    sock.sendall(data)


def receive(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    """One frame and the descriptors that came with it; (None, []) when the other side is gone."""
    header, fds, _, _ = socket.recv_fds(sock, _FRAME.size, max_fds) if max_fds else (sock.recv(_FRAME.size), [], 0, 0)
    if not header:
        return None, []
    header += _read_exactly(sock, _FRAME.size - len(header))
    return pickle.loads(_read_exactly(sock, _FRAME.unpack(header)[0])), list(fds)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ConnectionError("the other end (the caller or the rank server) closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# ---- the server --------------------------------------------------------------------------------
def _kill_group(pid: int) -> None:
    for kill in (os.killpg, os.kill):  # the group takes the rank's own children with it
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError):
            pass


def serve(fd: int) -> None:
    """The rank server's loop: fork the ranks of each request, report each rank's exit code."""
    # Imported once here rather than in every rank (none of them initialises CUDA on import):
    # cloudpickle, and torch.distributed.checkpoint, which picotron's trainer imports (0.6 s).
    # Not torch._dynamo, which a rank's first optimizer step imports (0.5 s): it imports triton
    # too, and forking from a server that holds it has not been shown safe on a GPU machine.
    import cloudpickle  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    _die_with_parent()
    sock = socket.socket(fileno=fd)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a rank exited: the wakeup pipe says so
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "exit")
    running: set[int] = set()
    while True:
        for key, _ in selector.select():
            if key.data == "exit":
                os.read(wake_read, 1 << 12)
                for pid, code in _reap(running):
                    send(sock, ("exited", pid, code))
                continue
            request, fds = receive(sock, max_fds=2 * 1024)
            if request is None:  # the caller is gone: so are its ranks
                for pid in running:
                    _kill_group(pid)
                os._exit(0)
            if isinstance(request, tuple) and request[0] == "kill":  # ranks to stop: those not yet reaped
                for pid in set(request[1]) & running:
                    _kill_group(pid)
                continue
            try:
                pids = []
                for rank in request.get("ranks", range(request["world_size"])):
                    pid = os.fork()
                    if pid == 0:
                        os.close(wake_read)
                        os.close(wake_write)
                        sock.close()
                        _rank_main(rank, request, fds)  # never returns
                    try:
                        os.setpgid(pid, pid)  # also done by the child: whichever runs first
                    except OSError:
                        pass
                    pids.append(pid)
                    running.add(pid)
                send(sock, ("started", pids))
            except Exception as e:  # noqa: BLE001 - tell the caller rather than die
                send(sock, ("failed", f"{type(e).__name__}: {e}"))
            finally:
                for descriptor in fds:
                    os.close(descriptor)


def _reap(running: set[int]) -> list[tuple[int, int]]:
    done = []
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        running.discard(pid)
        done.append((pid, os.waitstatus_to_exitcode(status)))
    return done


# ---- a rank ------------------------------------------------------------------------------------
def _rank_main(rank: int, request: dict, fds: list[int]) -> None:
    """In a freshly forked rank: adopt the caller's environment, run the task, send the result.
    A live rank (request["live"], picotron.ranks) runs commands instead, until told to stop."""
    # Each rank gets an output and a result pipe; a live rank also a command pipe. A restarted
    # live rank is forked alone (request["ranks"]): its pipes are then the first.
    per_rank = 3 if request.get("live") else 2
    index = list(request.get("ranks", range(request["world_size"]))).index(rank)
    mine = fds[per_rank * index:per_rank * (index + 1)]
    out_fd, result_fd = mine[:2]
    code = 0
    progress = {"phase": "starting"}  # then "connecting" (joining the process group), then "running"
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)  # own process group: killing it takes any grandchildren too
        _die_with_parent()
        for descriptor in fds:  # the other ranks' pipes belong to them
            if descriptor not in mine:
                os.close(descriptor)
        # Point fds 1 and 2 at the pipe, so prints, warnings and C++ logs all come back.
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        if request["backend"] == "gloo":
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks never initialise CUDA
        os.chdir(request["cwd"])
        sys.path[:] = request["sys_path"]
        linecache.cache.update(request["sources"])
        torch.set_num_threads(1)
        if request.get("live"):
            _live(rank, request, progress, result_fd, mine[2])  # never returns
        payload = _rank_body(rank, request, progress)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
        payload = ("error", {**_describe(e, rank), "phase": progress["phase"]})
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        data = _dumps(payload, rank)
    except BaseException as e:  # noqa: BLE001 - the error itself cannot travel: say what it was
        data = pickle.dumps(("error", {"type": RankError, "rank": rank, "message": f"{type(e).__name__}: {e}",
                                       "traceback": ""}))
        code = 2
    with os.fdopen(result_fd, "wb") as f:
        f.write(data)
    if code == 0:
        _leave_group(rank, request, progress)
    os._exit(code)  # skip the server's atexit handlers


def _leave_group(rank: int, request: dict, progress: dict) -> None:
    """After sending its result, a rank waits until every rank has finished before it closes its
    connections. Closing them at once would turn a collective that a slower rank still calls (on
    that rank alone) into a "Connection closed by peer" error on gloo, which looks like a crash;
    waiting makes it the hang it is (as under NCCL), which the caller's timeout then reports with
    where each rank was. Every rank is killed at the timeout anyway, waiting or not."""
    try:
        store = progress["store"]
        store.set(f"finished-{rank}", "1")
        store.wait([f"finished-{other}" for other in range(request["world_size"])])
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is sent: nothing is left to report to the caller
        pass


def _rank_body(rank: int, request: dict, progress: dict) -> tuple:
    import cloudpickle  # noqa: F401 - loads what cloudpickle dumped
    # Before the task is unpickled (it may import modules that keep a reference to a collective):
    # from here on every collective leaves a record the caller reads if the ranks hang.
    collective_trace.install(collective_trace.record_path(request["trace"], rank))
    fn, args, kwargs = pickle.loads(request["task"])
    if request["backend"] == "nccl":
        torch.cuda.set_device(rank)
    _join(rank, request, request["store"], progress)
    progress["phase"] = "running"
    seed_everything(request["seed"])
    collective_trace.set_phase("running")
    # The caller gets CPU tensors, whatever its device. Under NCCL the copy waits for the GPU, and so
    # for this rank's last collectives: the rank has finished only once it is done.
    result = _to_cpu(fn(*args, **kwargs))
    collective_trace.set_phase("finished")
    return ("ok", result)  # then `_leave_group`, after the result is sent


def _join(rank: int, request: dict, store_path: str, progress: dict) -> None:
    """Join the process group through the file store at `store_path`, and pass a barrier."""
    world_size = request["world_size"]
    timeout = timedelta(seconds=request["timeout"])
    progress["phase"] = "connecting"
    collective_trace.set_phase("connecting")
    store = progress["store"] = dist.FileStore(store_path, world_size)
    store.set_timeout(timeout)
    dist.init_process_group(request["backend"], store=store, rank=rank, world_size=world_size, timeout=timeout)
    # Every rank is connected to every other before any runs fn: without this, a rank whose fn makes no
    # collective call can finish and close its sockets while a peer still completes their connection.
    dist.barrier()


# ---- a live rank (picotron.ranks: %%ranks cells) ------------------------------------------------
# The caller sends commands on the rank's command pipe and reads the answers on its result pipe,
# both in frames (4 bytes of length, then a cloudpickle). A command is ("exec", cell), ("push",
# values), ("pull", names), ("status",), ("regroup", store path) or ("stop",); every command
# gets one answer, ("ok", value) or ("error", what _describe says), and a rank starts by sending
# ("ready", status) once it is in the process group.
def _live(rank: int, request: dict, progress: dict, result_fd: int, command_fd: int) -> None:
    import cloudpickle  # noqa: F401 - loads what cloudpickle dumped (pushed values)
    collective_trace.install(collective_trace.record_path(request["trace"], rank))
    if request["backend"] == "nccl":
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if request["backend"] == "nccl" else torch.device("cpu")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "torch": torch, "dist": dist,
                 "rank": rank, "world_size": request["world_size"], "device": device}
    running = [False]  # SIGINT (the caller interrupting a cell) raises only while a cell runs

    def interrupted(signum, frame):
        if running[0]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)

    def answer(message: tuple) -> None:
        sys.stdout.flush()  # what the rank printed reaches the caller before the answer
        sys.stderr.flush()
        data = _dumps(message, rank)
        _write_all(result_fd, _FRAME.pack(len(data)) + data)

    try:
        _join(rank, request, request["store"], progress)
        seed_everything(request["seed"])
        collective_trace.set_phase("finished")
        answer(("ready", _live_status(device)))
    except BaseException as e:  # noqa: BLE001 - the caller says why the ranks could not start
        answer(("error", {**_describe(e, rank), "phase": progress["phase"]}))
        os._exit(1)
    while True:
        command = _read_frame(command_fd)
        if command is None or command[0] == "stop":  # the caller is gone, or says stop
            try:
                dist.destroy_process_group()
            finally:
                os._exit(0)
        kind = command[0]
        try:
            if kind == "exec":
                collective_trace.reset()
                collective_trace.set_phase("running")
                running[0] = True
                try:
                    value = _run_cell(command[1], namespace)
                finally:
                    running[0] = False
                    collective_trace.set_phase("finished")
            elif kind == "push":
                namespace.update(pickle.loads(command[1]))
                value = None
            elif kind == "pull":
                value = [_to_cpu(namespace[name]) if name in namespace else _Missing(name) for name in command[1]]
            elif kind == "status":
                value = _live_status(device)
            elif kind == "regroup":  # a rank was restarted: every rank joins a new process group
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - the old group is broken: that is why it is replaced
                    pass
                _join(rank, request, command[1], progress)
                collective_trace.reset()
                collective_trace.set_phase("finished")
                value = None
            else:
                raise ValueError(f"unknown command {kind!r}")
            reply = ("ok", value)
        except BaseException as e:  # noqa: BLE001 - the cell's error goes to the caller; the rank lives on
            reply = ("error", _describe(e, rank))
        answer(reply)


class _Missing:
    """What a rank sends back for a name its namespace lacks."""

    def __init__(self, name: str):
        self.name = name


def _run_cell(cell: dict, namespace: dict):
    """Run a cell's code in the rank's namespace, as Jupyter does: the value of a last expression
    (unless the cell ends with ';') comes back as its text (and HTML, when it has one)."""
    import ast
    linecache.cache[cell["file"]] = (len(cell["text"]), None, cell["text"].splitlines(True), cell["file"])
    # Blank lines in front keep the cell's own line numbers (its first line is the %%ranks line).
    source = "\n" * (cell["first_line"] - 1) + cell["code"]
    tree = ast.parse(source, cell["file"])
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not cell["code"].rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, cell["file"], "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(last, cell["file"], "eval"), namespace)
    if value is None:
        return None
    shown = {"text/plain": repr(value)}
    html = getattr(value, "_repr_html_", None)
    if callable(html):
        try:
            shown["text/html"] = html()
        except Exception:  # noqa: BLE001 - the text is enough
            pass
    return shown


def _live_status(device: torch.device) -> dict:
    """What `%ranks status` shows of a rank: its pid, device and memory."""
    status = {"pid": os.getpid(), "device": str(device), "rss": _resident_bytes()}
    if device.type == "cuda":
        status["gpu_allocated"] = torch.cuda.memory_allocated(device)
        status["gpu_reserved"] = torch.cuda.memory_reserved(device)
    return status


def _resident_bytes() -> int:
    """This process's resident memory (Linux: /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _read_frame(fd: int):
    """The next frame on a pipe, unpickled; None once the other end is closed."""
    header = _read_fd(fd, _FRAME.size)
    if header is None:
        return None
    data = _read_fd(fd, _FRAME.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _read_fd(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        try:
            chunk = os.read(fd, min(n, 1 << 20))
        except InterruptedError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _dumps(payload: tuple, rank: int) -> bytes:
    import cloudpickle
    try:
        return cloudpickle.dumps(payload)
    except Exception as e:  # noqa: BLE001 - a result that cannot travel is the rank's error
        if payload[0] != "ok":
            raise
        message = (f"its return value ({type(payload[1]).__name__}) cannot be sent back: {type(e).__name__}: {e}. "
                   "Return plain values (numbers, strings, tensors, lists, dicts of them)")
        return cloudpickle.dumps(("error", {"type": RankError, "rank": rank, "message": message, "traceback": ""}))


def _die_with_parent() -> None:
    """On Linux, ask the kernel to kill this process if its parent dies (even by SIGKILL)."""
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
    import cloudpickle
    kind = type(e)
    try:
        cloudpickle.dumps(kind)  # a class defined in a notebook cell travels by value
    except Exception:  # noqa: BLE001
        kind = RankError
    frames = e.__traceback__
    while frames is not None and frames.tb_next is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next  # start at the user's code, not at the launcher's frames around it
    report = traceback.TracebackException(type(e), e, frames)
    _drop_trace_frames(report, set())
    return {"type": kind, "rank": rank, "message": f"{type(e).__name__}: {e}" if kind is RankError else str(e),
            "traceback": "".join(report.format())}


def _drop_trace_frames(report: traceback.TracebackException, seen: set) -> None:
    """Leave collective_trace's wrappers out of a traceback: the user called torch, not them."""
    if id(report) in seen:
        return
    seen.add(id(report))
    report.stack = traceback.StackSummary.from_list(
        [frame for frame in report.stack if frame.filename != collective_trace.__file__])
    for chained in (report.__cause__, report.__context__):
        if chained is not None:
            _drop_trace_frames(chained, seen)

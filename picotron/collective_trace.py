"""Where each rank is when ranks hang: every collective a rank calls leaves a record the caller can read.

A rank that hangs is blocked inside C++ (gloo or NCCL) and cannot answer a question. So each rank
says where it is *before* it enters a collective and again when it leaves, into a small record of
its own (a file of `RECORD_BYTES` bytes, written through a memory map: no system call per write),
and whoever watches the ranks reads the records when the time is up, before it kills them:

    rank 1 waits in all_reduce #3 of group [0, 1] (4 KiB) for 8.0 s, at train.py:42: `dist.all_reduce(x)`
    rank 0 finished the function after all_reduce #2 of group [0, 1]

`install(path)` wraps the collectives of `torch.distributed` in the rank's own process (a fresh
process per rank, so the wrappers are that rank's only copy and nothing is ever restored): the
functions in `torch.distributed` and in `torch.distributed.distributed_c10d` (torch calls its own
functions through the latter, and `P2POp` checks `op is isend` there), and `Work.wait`, so that a
collective started with `async_op=True` is found again in the `wait()` on its work. Everything
that calls these functions is covered: user code calling `dist.all_reduce` directly, and
picotron.comm, which calls them once per collective. A collective that torch implements with
another public one (`all_gather_into_tensor` calls `all_gather_single`, `all_gather_object` calls
`all_gather`, `barrier` waits on its work) counts once, as the call the user made: a call made
while this thread is already inside a traced one is not traced again.

What a record holds: the rank's phase (starting, connecting, running, in a collective, finished)
and the collective it is in or was last in: the operation, which call of that operation on that
group it is (#1, #2, ... counted per rank from the start of the function), the group's global
ranks, the bytes of the tensor(s) this rank passes as its data (its input; the buffer of a
broadcast, scatter or receive, on every rank, so that ranks passing different sizes show it), the
peer of a send or a receive and the root of a broadcast, reduce, gather or scatter, and the line
of the user's code that called it: the innermost frame outside torch and outside picotron's comm,
launch and rank-server code. The source of that line is looked up only when the report is
written, in the reading process (a notebook cell's lines live in the notebook's `linecache`).
What it costs: about 2 microseconds of Python per call (measured on a 2-core CPU; an all_reduce
of one float with gloo takes about 100 between two ranks).

Not seen: collectives that never pass through these Python functions (DDP's C++ reducer, the
functional collectives of DTensor and torch.compile'd graphs, a `get_future()` waited on instead of
the work). Under NCCL a collective returns as soon as it is queued on the GPU, so a rank held up by
one usually waits at its next synchronisation (`.item()`, `.cpu()`): the report then shows it "not
in a collective" and names its last collective, the one to suspect.

picotron.launch uses this for `run`'s TimeoutError, and picotron.ranks for the hang report of a
`%%ranks` cell (`install`, `set_phase` and, at each cell, `reset` in the rank; `read` and `report` in
the watcher).
"""

from __future__ import annotations

import inspect
import linecache
import mmap
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["RECORD_BYTES", "Collective", "RankState", "install", "set_phase", "reset", "record_path", "read",
           "report", "original"]

RECORD_BYTES = 1024
_SEPARATOR = "\x1f"  # between the fields of a record (a character no file name or operation name holds)

# Phases, one byte at the start of the record.
_PHASES = {b"S": "starting", b"C": "connecting", b"R": "running", b"W": "in a collective", b"F": "finished"}
_PHASE_BYTES = {name: byte for byte, name in _PHASES.items()}

# What each operation hands in: the arguments whose tensors count as its bytes, and its root or
# peer: (argument, group-rank argument, word).
_INPUT = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",), "gather": ("tensor",),
    "scatter": ("tensor",), "all_gather": ("tensor",), "all_gather_into_tensor": ("input_tensor",),
    "all_gather_single": ("input_tensor",), "reduce_scatter": ("input_list",), "reduce_scatter_tensor": ("input",),
    "reduce_scatter_single": ("input",), "all_to_all": ("input_tensor_list",), "all_to_all_single": ("input",),
    "barrier": (), "monitored_barrier": (), "send": ("tensor",), "recv": ("tensor",), "isend": ("tensor",),
    "irecv": ("tensor",), "all_reduce_coalesced": ("tensors",), "all_gather_coalesced": ("input_tensor_list",),
    "batch_isend_irecv": (),  # its P2POps' tensors, counted apart
    # The *_object collectives pickle their objects inside: their bytes are not known before the call.
    "all_gather_object": None, "broadcast_object_list": None, "gather_object": None, "scatter_object_list": None,
    "send_object_list": None, "recv_object_list": None,
}
_ROOT = {
    "broadcast": ("src", "group_src", "from"), "scatter": ("src", "group_src", "from"),
    "reduce": ("dst", "group_dst", "to"), "gather": ("dst", "group_dst", "to"),
    "send": ("dst", "group_dst", "to"), "isend": ("dst", "group_dst", "to"),
    "recv": ("src", "group_src", "from"), "irecv": ("src", "group_src", "from"),
    "broadcast_object_list": ("src", "group_src", "from"), "scatter_object_list": ("src", "group_src", "from"),
    "gather_object": ("dst", "group_dst", "to"), "send_object_list": ("dst", "group_dst", "to"),
    "recv_object_list": ("src", "group_src", "from"),
}

_ALWAYS_ASYNC = ("isend", "irecv", "batch_isend_irecv")  # they return works whatever async_op says

# Frames skipped when looking for the user's line: torch's, and picotron's own collective plumbing.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = frozenset(os.path.join(_HERE, name) for name in
                       ("comm.py", "launch.py", "rank_server.py", "collective_trace.py"))



class _Depth(threading.local):
    depth = 0  # >0 while this thread is inside a traced call (a class default: no AttributeError to catch)


# This rank's tracing state (one process per rank: module globals are this rank's).
_record: mmap.mmap | None = None
_tracing = False                      # True while the function runs (phase "running")
_local = _Depth()                     # per thread: whether it is inside a traced call
_calls: dict = {}                     # (operation, group) -> calls so far
_groups: dict = {}                    # group argument (None: the default group) -> ("[0, 1]", the group itself)
_skipped_code: dict = {}              # code object -> whether its frames are skipped
_posted = weakref.WeakKeyDictionary()  # Work -> the fields of the async collective that returned it
_originals: dict = {}                 # operation -> the torch function it wraps (for measuring the overhead)


# ---- in the rank -------------------------------------------------------------------------------
def record_path(directory: str, rank: int) -> str:
    """Where rank `rank` of a launch keeps its record, in the launch's temporary directory."""
    return os.path.join(directory, f"collectives-{rank}")


def install(path: str) -> None:
    """In a rank, before the user's function is unpickled: create the record at `path` and wrap
    torch.distributed's collectives so that each call leaves its trace there. Once per process."""
    global _record
    if _record is not None:
        raise RuntimeError("collective_trace.install() was called twice in one process; each rank installs it once")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, RECORD_BYTES)
        _record = mmap.mmap(fd, RECORD_BYTES)
    finally:
        os.close(fd)
    _record[:2] = b"S\0"
    for name, inputs in _INPUT.items():
        function = getattr(c10d, name, None)
        if function is None:  # an operation this torch does not have (all_gather_single before 2.13)
            continue
        wrapper = _wrap(name, function, inputs)
        _originals[name] = function
        for module in (c10d, dist):
            if getattr(module, name, None) is function:
                setattr(module, name, wrapper)
        _keep_compilable(function, wrapper)
    work = c10d.Work
    _originals["wait"] = work.wait
    work.wait = _wrap_wait(work.wait)


def _keep_compilable(function, wrapper) -> None:
    """Let torch.compile see through the wrapper. Dynamo replaces a call of `dist.all_reduce` (and the
    other collectives it can trace) by a functional collective, found in a table keyed by the function,
    and then checks `fn in (dist.all_reduce, ...)`: once the wrapper is `dist.all_reduce`, inlining it would
    reach the original, which that check no longer recognises ("'RedOpType' object has no attribute
    'lower'"). So the wrapper gets the original's entry and is rewritten directly, like the original was.
    (Inside a compiled graph nothing is traced: the graph runs its collectives without Python.)"""
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps
    except ImportError:  # a torch without it: nothing to keep
        return
    if function in traceable_collective_remaps:
        traceable_collective_remaps[wrapper] = traceable_collective_remaps[function]


def set_phase(phase: str) -> None:
    """Say where the rank is outside the function: "connecting" (joining the process group),
    "running" (the function runs: its collectives are traced from here on) or "finished"."""
    global _tracing
    _tracing = phase == "running"
    if _record is not None:
        _record[:1] = _PHASE_BYTES[phase]


def reset() -> None:
    """Count calls from #1 again and forget the last collective (a live rank, at the start of each cell)."""
    _calls.clear()
    _groups.clear()  # a regroup replaces the default group
    if _record is not None:
        _record[1:2] = b"\0"


def original(name: str):
    """The torch function that the wrapper of `name` calls (to measure what tracing costs)."""
    return _originals[name]


def _wrap(name: str, function, inputs: tuple | None):
    """`function` with a record written before the call and the phase set back after it. Where its
    arguments sit (positional or by keyword) is read from its signature once, here."""
    parameters = list(inspect.signature(function).parameters)
    place = {p: i for i, p in enumerate(parameters)}
    input_at = None if inputs is None else tuple((place[p], p) for p in inputs)
    group_at = place.get("group", -1)
    async_at = place.get("async_op", -1)
    root = _ROOT.get(name)
    root_at = None if root is None else (place[root[0]], root[0], place[root[1]], root[1], root[2])
    always_async = name in _ALWAYS_ASYNC

    def traced(*args, **kwargs):
        if not _tracing or torch.compiler.is_compiling() or _local.depth:
            return function(*args, **kwargs)
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            group = ops[0].group if ops else None
            nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op.__name__ == "isend")
            peer = "(" + ", ".join(f"{op.op.__name__} {'to' if op.op.__name__ == 'isend' else 'from'} {op.peer}"
                                   for op in ops) + ")"
        else:
            group = _argument(args, kwargs, group_at, "group")
            if input_at is None:
                nbytes = -1
            elif len(input_at) == 1:
                nbytes = _bytes(_argument(args, kwargs, *input_at[0]))
            else:
                nbytes = sum(_bytes(_argument(args, kwargs, i, p)) for i, p in input_at)
            peer = "" if root_at is None else _root(args, kwargs, group, root_at)
        label, same_group = _groups.get(group) or _group(group)
        key = (name, same_group)
        number = _calls[key] = _calls.get(key, 0) + 1
        is_async = always_async or bool(_argument(args, kwargs, async_at, "async_op"))
        fields = (name, str(number), label, str(nbytes), peer, "async" if is_async else "")
        _enter(fields)
        try:
            result = function(*args, **kwargs)
        finally:
            _leave()
        if is_async and result is not None:
            for work in (result if isinstance(result, list) else [result]):
                try:
                    _posted[work] = fields
                except TypeError:  # None, or a work type without weak references: its wait goes untraced
                    pass
        return result

    traced.__name__, traced.__qualname__, traced.__doc__ = function.__name__, function.__qualname__, function.__doc__
    traced.__module__, traced.__wrapped__ = function.__module__, function
    return traced


def _wrap_wait(wait):
    """Work.wait, traced as a wait in the collective that returned the work (with async_op=True)."""
    def traced_wait(self, *args, **kwargs):
        if not _tracing or torch.compiler.is_compiling() or _local.depth:
            return wait(self, *args, **kwargs)
        fields = _posted.get(self)
        if fields is None:  # a work this rank did not get from a traced call
            return wait(self, *args, **kwargs)
        _enter(fields[:5] + ("wait",))
        try:
            return wait(self, *args, **kwargs)
        finally:
            _leave()
    traced_wait.__name__, traced_wait.__qualname__, traced_wait.__doc__ = "wait", "Work.wait", wait.__doc__
    return traced_wait


def _enter(fields: tuple) -> None:
    """Write "in a collective" with its fields, the user's line and the time, before the call."""
    _local.depth = 1
    file, line = _user_line()
    text = "W" + _SEPARATOR.join((*fields, file, str(line), str(time.time_ns() // 1000))) + "\0"
    data = text.encode(errors="replace")
    if len(data) > RECORD_BYTES:
        data = data[:RECORD_BYTES - 1] + b"\0"
    _record[:len(data)] = data


def _leave() -> None:
    _record[:1] = b"R"
    _local.depth = 0


def _user_line() -> tuple[str, int]:
    """The innermost frame outside torch and picotron's own comm/launch code: the user's call."""
    frame = sys._getframe(3)  # _enter's caller's caller: the first frame that may be the user's
    while frame is not None:
        code = frame.f_code
        skipped = _skipped_code.get(code)
        if skipped is None:
            name = code.co_filename
            skipped = _skipped_code[code] = name.startswith(_TORCH_DIR) or name in _OWN_FILES
        if not skipped:
            return code.co_filename[-600:], frame.f_lineno
        frame = frame.f_back
    return "", 0


def _argument(args: tuple, kwargs: dict, index: int, name: str):
    if name in kwargs:
        return kwargs[name]
    return args[index] if 0 <= index < len(args) else None


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def _root(args, kwargs, group, root_at) -> str:
    """'to 1', 'from 0' (global ranks), or 'from any rank' for a recv without a source."""
    at, name, group_at, group_name, word = root_at
    rank = _argument(args, kwargs, at, name)
    if rank is None:
        group_rank = _argument(args, kwargs, group_at, group_name)
        if group_rank is None:
            return f"{word} any rank" if word == "from" else ""
        try:
            rank = dist.get_global_rank(group if group is not None else c10d._get_default_group(), group_rank)
        except Exception:  # noqa: BLE001 - the collective itself will say what is wrong with its arguments
            return f"{word} group rank {group_rank}"
    return f"{word} {rank}"


def _group(group) -> tuple[str, object]:
    """The group's global ranks as "[0, 1]", and the group itself (the default group for None, so that
    group=None and group=dist.group.WORLD count as one), computed once per group."""
    try:
        same_group = group if group is not None else c10d._get_default_group()
        ranks = dist.get_process_group_ranks(same_group)
    except Exception:  # noqa: BLE001 - not a group this rank is in: the collective says so itself
        return "[?]", group
    _groups[group] = ("[" + ", ".join(map(str, ranks)) + "]", same_group)
    return _groups[group]


# ---- in the watcher ----------------------------------------------------------------------------
@dataclass
class Collective:
    """One collective call as a rank recorded it."""
    op: str
    number: int           # which call of `op` on this group it is, from 1
    group: str            # the group's global ranks, "[0, 1]"
    nbytes: int           # this rank's input bytes; -1 when not known before the call (the *_object ones)
    peer: str             # "to 1", "from 0", "" for a collective without a root
    mode: str             # "", "async" (posted with async_op=True), "wait" (in the wait() on its work)
    file: str
    line: int
    since: float          # time.time() when the rank entered it

    def describe(self) -> str:
        """'all_reduce #3 of group [0, 1] (4 KiB)', 'recv #1 from 0 of group [0, 1] (4 B)'."""
        text = f"{self.op} #{self.number}" + (f" {self.peer}" if self.peer else "") + f" of group {self.group}"
        return text + (f" ({_size(self.nbytes)})" if self.nbytes > 0 else "")

    def where(self) -> str:
        """'file:line: `source`', the line of the user's code that made the call."""
        if not self.file:
            return "at an unknown line"
        source = linecache.getline(self.file, self.line).strip()
        return f"at {_place(self.file, self.line)}" + (f": `{source}`" if source else "")


@dataclass
class RankState:
    """What a rank's record says: its phase and the collective it is in, or was last in (None: none yet)."""
    rank: int
    phase: str  # "starting", "connecting", "running", "in a collective", "finished"; "unknown" without a record
    collective: Collective | None


def read(path: str, rank: int) -> RankState:
    """Read rank `rank`'s record at `path` (from any process, while the rank runs or after it stopped)."""
    try:
        with open(path, "rb") as f:
            data = f.read(RECORD_BYTES)
            for _ in range(3):  # a rank still running may be rewriting it: take two equal reads
                again = os.pread(f.fileno(), RECORD_BYTES, 0)
                if again == data:
                    break
                data = again
    except FileNotFoundError:
        return RankState(rank, "unknown", None)
    if not data:
        return RankState(rank, "unknown", None)
    phase = _PHASES.get(data[:1], "unknown")
    fields = data[1:].split(b"\0", 1)[0].decode(errors="replace").split(_SEPARATOR)
    collective = None
    if len(fields) == 9:
        op, number, group, nbytes, peer, mode, file, line, since = fields
        try:
            collective = Collective(op, int(number), group, int(nbytes), peer, mode, file, int(line), int(since) / 1e6)
        except ValueError:
            collective = None
    return RankState(rank, phase, collective)


def report(states: list[RankState], *, what: str = "the function", backend: str = "gloo",
           now: float | None = None) -> str:
    """One line per rank: finished, or the collective it waits in and the user's line, or that it is
    in none (and its last), or that it is still connecting. `what` names what the ranks run."""
    now = time.time() if now is None else now
    return "\n".join(_line(state, what, backend, now) for state in states)


def _line(state: RankState, what: str, backend: str, now: float) -> str:
    r, c = state.rank, state.collective
    if state.phase == "in a collective" and c is not None:
        if c.mode == "wait":
            call = f"the wait() on the work of {c.describe()}"
        else:
            call = c.describe() + (" (async_op=True)" if c.mode == "async" and c.op not in _ALWAYS_ASYNC else "")
        return f"rank {r} waits in {call} for {max(now - c.since, 0):.1f} s, {c.where()}"
    if state.phase == "finished":
        return f"rank {r} finished {what} " + (f"after {c.describe()}" if c else "without calling a collective")
    if state.phase == "running":
        if backend == "nccl":
            doing = ("is not in a collective call (computing, or waiting on something else; under NCCL a collective "
                     "returns once it is queued on the GPU, so this may be a wait at a synchronisation such as "
                     ".item() for its last collective)")
        else:
            doing = "is not in a collective (computing, or waiting on something else)"
        if c is None:
            return f"rank {r} {doing}; it has called no collective yet"
        unfinished = ", whose work it has not waited on" if c.mode == "async" else ""
        return f"rank {r} {doing}; its last collective was {c.describe()}{unfinished}, {c.where()}"
    if state.phase == "connecting":
        return f"rank {r} is still connecting to the other ranks (joining the process group)"
    return f"rank {r} had not reached {what} yet (still starting)"


def _size(nbytes: int) -> str:
    """4 B, 4 KiB, 1.5 MiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.3g} {unit}"
    raise AssertionError("unreachable")


def _place(file: str, line: int) -> str:
    """A line of a notebook cell as Jupyter's tracebacks name it ("Cell In[3], line 5"), of a file as
    "file:line", the file relative to the working directory when it lies under it."""
    if file.startswith("Cell In["):  # a %%ranks cell (picotron.ranks) is named so already
        return f"{file}, line {line}"
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda name: None)(file)
    if named:
        return f"{' '.join(named)}, line {line}"
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        relative = file
    return f"{file if relative.startswith('..') else relative}:{line}"

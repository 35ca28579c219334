"""The tools the checks share: run the learner's function on N ranks, compare with plain math.

The checks themselves are declared on picotron_course.engine in the checks_* modules (assignment 00's in
checks_collectives); the engine imports this module, so no check lives here.

A check never trusts the picotron module the exercise teaches. It runs the learner's function
on N ranks with `picotron.launch.run`, computes the expected answer in this (the parent)
process with single-process torch (the plain sum of every rank's tensor, ...), prints one
row per case (expected, actual, error, pass/fail) and raises AssertionError when any case
failed, so a check cell fails under nbval and in the grader whatever its table says.

An unsolved exercise raises NotImplementedError on every rank; `run` re-raises that type in
the parent and the check lets it through, so each check cell fails on its own until solved.

A check written with these tools alone (one function per exercise; the engine's declarations use them too):

    def check_zero1_step(zero1_step):
        with Report("zero1_step") as report:                    # prints + raises on exit
            for world in (2, 4):
                got = on_ranks(_zero1_on_rank, world, zero1_step)  # the learner's code, N ranks
                want = ...                                         # one process, plain torch
                report.add(ok=close_enough(got, want, n=world), world=world,   # a sum of `world` terms
                           max_abs_err=max_abs_error(got, want))

    def _zero1_on_rank(zero1_step):                             # module level: runs in each rank
        with only_point_to_point("zero1_step") as sent:          # if the exercise builds a collective
            ...
        return result, sent.bytes

Tools: `rank_tensor` (per-rank data the parent can recompute), `close_enough` (equal up to the
float round-off of n additions, from picotron.tolerance) / `close_in_training` (the course's
claim for gradients step after step) / `max_abs_error` / `mismatch` (where two tensors differ
most, for the `detail` of a failed row), `only_point_to_point` (collectives raise inside the
block; bytes sent point-to-point are counted), `on_ranks` (run with the course timeout),
`watch_calls` / `refusing` (which of the course's own functions an answer called, however it
imported or renamed them).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from picotron import tolerance
from picotron_course import settings
from picotron.launch import run

__all__ = ["Report", "CollectiveNotAllowed", "rank_tensor", "close_enough", "close_in_training", "max_abs_error",
           "mismatch", "on_ranks", "one_thread", "patched", "collective_patches", "collectives_observed", "payload_of",
           "tensors_in", "only_point_to_point", "watch_calls", "refusing", "not_the_course_answer", "all_ranks_ok",
           "grad_of", "worst_error", "reduce_name", "raised"]

# ---- small pieces the distributed checks share --------------------------------------------------------
def all_ranks_ok(ok: bool, group) -> bool:
    """True on every rank of `group` when `ok` is true on all: ranks skip a step together, never alone
    (a rank that skipped a collective the others make would leave them waiting)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """A copy of a leaf's gradient, None when nothing reached it."""
    return None if t.grad is None else t.grad.detach().clone()


def worst_error(per_rank: list, key: str, wants: list) -> float:
    """The largest |error| of `key` over the ranks that have it (inf for a rank whose value is None)."""
    errors = [max_abs_error(r[key], want) if r.get(key) is not None else math.inf
              for r, want in zip(per_rank, wants) if key in r]
    return max(errors, default=math.nan)


def raised(error: BaseException) -> tuple[str, str]:
    """(type name, first line) of an exception an answer raised on a rank, with the fix where the cause is the
    installed torch rather than the answer: gloo before torch 2.13 has no dist.all_to_all on lists."""
    message = str(error).splitlines()[0] if str(error) else ""
    if "does not support alltoall" in message:
        message += (f" (gloo in torch {torch.__version__} has dist.all_to_all_single but not dist.all_to_all on "
                    "lists, which torch 2.13 adds: join the pieces into one tensor and call all_to_all_single)")
    return type(error).__name__, message


# ---- an answer that is the course's own ------------------------------------------------------------
def not_the_course_answer(what: str, *answers, course, only: dict | None = None) -> None:
    """Refuse an answer that is the course's own code rather than the learner's: a function, a class or an
    instance (a Triton kernel: its Python function) whose module, or one of whose classes' modules, lies under
    `course` (a module name or a tuple of them). `only` = {module: names}: in those modules, only these names."""
    course = (course,) if isinstance(course, str) else tuple(course)
    for answer in answers:
        inner = answer.fn if type(answer).__name__ in ("JITFunction", "InterpretedFunction") else answer
        for k in (inner, *(inner.__mro__ if isinstance(inner, type) else type(inner).__mro__)):
            module, name = str(getattr(k, "__module__", "")), getattr(k, "__name__", "")
            if module.startswith(course) and (only is None or module not in only or name in only[module]):
                shown = getattr(inner, "__name__", type(inner).__name__)
                raise AssertionError(f"{what}: {shown} comes from {module}, the course's answer; write your own")


# ---- which functions an answer called ----------------------------------------------------------
@contextmanager
def watch_calls(name_of: Callable) -> Iterator[list[str]]:
    """Inside the block, note every Python function call for which name_of(frame) gives a name (each name once,
    in order). sys.setprofile sees the function's code, not the name it was called by, so an answer cannot hide
    a call by importing the function under another name."""
    called: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            name = name_of(frame)
            if name and name not in called:
                called.append(name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(previous)


@contextmanager
def refusing(what: str, answers: dict) -> Iterator[None]:
    """Raise AssertionError after the block if it called one of `answers`: {code object or file name: its name}."""
    wanted = {Path(k).resolve() if isinstance(k, str) else k: name for k, name in answers.items()}
    files: dict[str, Path] = {}

    def name_of(frame):
        code = frame.f_code
        if code.co_filename not in files:
            files[code.co_filename] = Path(code.co_filename).resolve()
        return wanted.get(code) or wanted.get(files[code.co_filename])

    with watch_calls(name_of) as called:
        yield
    if called:
        raise AssertionError(f"{what} called {called[0]}, which does this exercise for you; write your own")


# ---- reporting ----------------------------------------------------------------------------
class Report:
    """One row per case; on leaving the `with` block, print the table and raise if a row failed.

    An exception raised inside the block (NotImplementedError from an unsolved exercise, a
    rank's crash) goes through untouched and no table is printed.
    """

    # (title, number of cases) of every table finished in this process: what the tests of the checks count
    finished: list[tuple[str, int]] = []

    def __init__(self, title: str, note: str = ""):
        self.title, self.note = title, note
        self.rows: list[tuple[dict, bool, str]] = []
        self.hint = ""   # what a learner whose answer fails should read (engine.Misconception), shown last

    def add(self, ok: bool, detail: str = "", **columns) -> None:
        """Record a case: `columns` are shown in the table (`**{"sent (B)": n}` for a header that is not
        a name), `detail` only under the table when the case failed."""
        self.rows.append((columns, bool(ok), detail))

    def __enter__(self) -> "Report":
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        if kind is None:
            self.finish()
        return False

    def table(self) -> str:
        names = list(dict.fromkeys(name for columns, _, _ in self.rows for name in columns))
        cells = [[_show(columns.get(name, "")) for name in names] + ["ok" if ok else "FAIL"]
                 for columns, ok, _ in self.rows]
        header = [name.replace("_", " ") for name in names] + ["result"]
        widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
        lines = ["  ".join(text.rjust(width) for text, width in zip(row, widths)) for row in [header, *cells]]
        passed = sum(ok for _, ok, _ in self.rows)
        title = f"check {self.title}: {passed}/{len(self.rows)} cases passed"
        return "\n".join([title, *([self.note] if self.note else []), *lines])

    def finish(self) -> None:
        Report.finished.append((self.title, len(self.rows)))
        print(self.table())
        failed = [(columns, detail) for columns, ok, detail in self.rows if not ok]
        for columns, detail in failed[:4]:
            print(f"  FAIL {_where(columns)}" + (f"\n       {detail}" if detail else ""))
        if failed and self.hint:
            print(f"  hint: {self.hint}")
        if not self.rows:
            raise AssertionError(f"{self.title}: the check ran no case")
        if failed:
            columns, detail = failed[0]
            raise AssertionError(f"{self.title}: {len(failed)} of {len(self.rows)} cases failed (table above). "
                                 f"First: {_where(columns)}. {detail}" + (f" Hint: {self.hint}" if self.hint else ""))


def _where(columns: dict) -> str:
    return ", ".join(f"{name}={_show(value)}" for name, value in columns.items())


def _show(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.2e}"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.Tensor):
        return preview(value)
    return str(value)


def preview(t: torch.Tensor, n: int = 4) -> str:
    """The first `n` values of a tensor, for a failure message."""
    values = ", ".join(f"{v:.4g}" for v in t.detach().flatten()[:n].tolist())
    return f"[{values}{', ...' if t.numel() > n else ''}]"


def mismatch(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where two tensors differ most, and their first values, for a failure message."""
    if actual.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}"
    diff = (actual.double() - expected.double()).abs().flatten()
    diff = diff.nan_to_num(nan=math.inf, posinf=math.inf)   # a NaN or an infinity is the worst place
    worst = int(diff.argmax())
    return (f"worst at element {worst}: expected {expected.flatten()[worst].item():.6g}, "
            f"got {actual.flatten()[worst].item():.6g} (first values: expected {preview(expected)}, "
            f"got {preview(actual)})")


# ---- data and comparison -------------------------------------------------------------------
def rank_tensor(rank: int, shape: tuple, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random data that differs per rank and per seed, and that the parent can recompute."""
    generator = torch.Generator().manual_seed(1_000_003 * seed + rank)
    return torch.randn(shape, generator=generator, dtype=dtype)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.shape != expected.shape:
        return math.inf
    if actual.numel() == 0:
        return 0.0
    return (actual.double() - expected.double()).abs().max().item()


def close_enough(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, *, n: int,
                 scale: float | None = None) -> bool:
    """Equal up to float round-off, shapes equal, no NaN: the learner's code adds in another order than the
    parent, so the results may differ by the rounding of the n additions behind each number, no more
    (picotron.tolerance: 8 sqrt(n) u x scale, by default the largest expected value; u of `dtype`, default
    the less precise of the two tensors')."""
    return tolerance.close_enough(actual, expected, n=n, dtype=dtype, scale=scale)


def close_in_training(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """A gradient at some step of a training run against one process's: within rtol = atol =
    tolerance.TRAINING_GRAD_TOL (1e-5), the course's claim. Not a rounding bound: after the first step
    the two runs' weights already differ by Adam's amplified round-off."""
    tol = tolerance.TRAINING_GRAD_TOL
    return actual.shape == expected.shape and torch.allclose(actual.double(), expected.double(), rtol=tol, atol=tol)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one thread, like each rank: a single-process reference computed with two
    threads while four ranks (and anything else) share two cores ran 4x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def patched(patches: list[tuple[object, str, object]]) -> Iterator[None]:
    """Inside the block, each `(module, name, replacement)` stands in for `module.name`; the
    originals come back on the way out, whatever happens inside."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def collective_patches(wrap: Callable[[str, Callable], Callable]) -> list[tuple[object, str, Callable]]:
    """Patches (for `patched`) that put `wrap(name, original)` in place of every collective and of
    send/isend: in torch.distributed, in its distributed_c10d module, and in picotron.comm, which
    holds the *_single collectives under names of its own. For checks that record what a rank sends."""
    import picotron.comm as comm

    names = [name for name in (*COLLECTIVES, "send", "isend") if hasattr(c10d, name)]
    patches = [(module, name, wrap(name, getattr(c10d, name))) for name in names for module in (dist, c10d)
               if hasattr(module, name)]
    patches += [(comm, short, wrap(name, getattr(comm, short)))
                for short, name in (("_all_gather_single", "all_gather_into_tensor"),
                                    ("_reduce_scatter_single", "reduce_scatter_tensor")) if hasattr(comm, short)]
    return patches


@contextmanager
def collectives_observed(on_call: Callable[[str, dict], None],
                         after: Callable[[str, dict, object], object] | None = None) -> Iterator[None]:
    """Inside the block, `on_call(name, arguments)` runs before every collective (and send) this rank
    makes, with the call's arguments bound to their parameter names; `after(name, arguments, result)`, when
    given, once it returned, and the caller gets what `after` returns (a handle that notes its wait, say).

    A call made inside another (torch's deprecated names call the new ones) is seen once; a call
    whose arguments do not bind goes to torch untouched, for torch to say what is wrong.
    """
    busy = [False]

    def wrap(name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def observed(*args, **kwargs):
            if busy[0]:
                return original(*args, **kwargs)
            try:
                arguments = signature.bind(*args, **kwargs).arguments
            except TypeError:
                return original(*args, **kwargs)
            on_call(name, arguments)
            busy[0] = True
            try:
                result = original(*args, **kwargs)
            finally:
                busy[0] = False
            return result if after is None else after(name, arguments, result)
        return observed

    with patched(collective_patches(wrap)):
        yield


def reduce_name(op) -> str:
    """"sum", "avg", ... for a dist.ReduceOp; "" for None."""
    if op is None:
        return ""
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if op == getattr(dist.ReduceOp, name):
            return name.lower()
    return str(op)


def payload_of(name: str, arguments: dict) -> torch.Tensor | None:
    """The tensor a collective call moves, for counting: an all-reduce's tensor, otherwise the largest
    tensor among its arguments (an all-gather's output, a scatter's list, ...)."""
    tensors = tensors_in([arguments["tensor"]] if name == "all_reduce" else list(arguments.values()))
    return max(tensors, key=lambda t: t.numel(), default=None)


def tensors_in(values: list) -> list[torch.Tensor]:
    """The tensors among `values`, looking inside lists and tuples (a collective's arguments)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += tensors_in(list(value))
    return out


def on_ranks(fn: Callable, world_size: int, *args) -> list:
    """`run` with the course's check timeout: a ring that deadlocks fails in a minute, not three.

    Always gloo on CPU: the checks compare with single-process math done on the CPU here, and
    their problems are tiny, so the same check behaves alike on a laptop and on a GPU node.
    """
    return run(fn, world_size, args=args, timeout=settings.check_timeout, backend="gloo")


# ---- point-to-point only -------------------------------------------------------------------
class CollectiveNotAllowed(AssertionError):
    """The learner called a collective in an exercise that builds one from send and recv."""


COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
               "all_gather_into_tensor", "all_gather_single", "all_gather_coalesced", "all_gather_object",
               "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather", "scatter",
               "broadcast_object_list", "gather_object", "scatter_object_list")


class SentBytes:
    """Bytes this rank handed to send/isend inside an `only_point_to_point` block."""

    def __init__(self) -> None:
        self.bytes = 0

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes


def _sends_counted(on_send: Callable[[int], None]) -> list[tuple[object, str, Callable]]:
    """Patches (for `patched`) calling on_send(bytes) for each message this rank sends with send or isend (a send
    that calls isend counts once), in torch.distributed and its c10d module, as P2POp checks its op by identity."""
    isend, send, in_send = c10d.isend, c10d.send, [False]

    @functools.wraps(isend)
    def counted_isend(tensor, *args, **kwargs):
        if not in_send[0]:
            on_send(tensor.numel() * tensor.element_size())
        return isend(tensor, *args, **kwargs)

    @functools.wraps(send)
    def counted_send(tensor, *args, **kwargs):
        on_send(tensor.numel() * tensor.element_size())
        in_send[0] = True
        try:
            return send(tensor, *args, **kwargs)
        finally:
            in_send[0] = False

    return [(module, name, new) for module in (dist, c10d) for name, new in (("isend", counted_isend),
                                                                                ("send", counted_send))]


@contextmanager
def only_point_to_point(what: str, answers: tuple[str, ...] = ()) -> Iterator[SentBytes]:
    """Inside the block, collectives raise CollectiveNotAllowed and point-to-point sends are counted.

    Use it in a rank around the learner's call when the exercise is to build a collective from
    send/recv. Both `torch.distributed` and its `distributed_c10d` module are patched (P2POp
    checks its op against the latter), and so are picotron.comm's bound shortcuts; `answers`
    names picotron.comm functions that would do the exercise for the learner (they raise too).
    Everything is restored on the way out.
    """
    import picotron.comm as comm

    sent = SentBytes()

    def forbidden(name: str, why: str = "the collective") -> Callable:
        def call(*args, **kwargs):
            raise CollectiveNotAllowed(f"{what} must use point-to-point operations only (picotron.comm.send_recv, "
                                       f"dist.send/recv, dist.isend/irecv, dist.batch_isend_irecv), "
                                       f"but it called {why} {name}")
        return call

    patches = [(module, name, forbidden(f"dist.{name}")) for name in COLLECTIVES
               for module in (dist, c10d) if hasattr(module, name)]
    patches += [(comm, name, forbidden(f"picotron.comm.{name.strip('_')}"))
                for name in ("_all_gather_single", "_reduce_scatter_single") if hasattr(comm, name)]
    patches += [(comm, name, forbidden(f"picotron.comm.{name}", "the course's own answer,"))
                for name in answers if hasattr(comm, name)]
    with patched(patches + _sends_counted(sent.add)):
        yield sent


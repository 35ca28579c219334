"""The checks the assignments call: run the learner's function on N ranks, compare with plain math.

A check never trusts the picotron module the exercise teaches. It runs the learner's function
on N ranks with `picotron.launch.run`, computes the expected answer in this (the parent)
process with single-process torch (the plain sum of every rank's tensor, ...), prints one
row per case (expected, actual, error, pass/fail) and raises AssertionError when any case
failed, so a check cell fails under nbval and in the grader whatever its table says.

An unsolved exercise raises NotImplementedError on every rank; `run` re-raises that type in
the parent and the check lets it through, so each check cell fails on its own until solved.

Adding the check of a chapter (one function per exercise, in a section of this file):

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
from picotron.launch import device, run

__all__ = ["Report", "CollectiveNotAllowed", "rank_tensor", "close_enough", "close_in_training", "max_abs_error",
           "mismatch", "on_ranks", "one_thread", "patched", "collective_patches", "collectives_observed", "payload_of",
           "tensors_in", "only_point_to_point", "watch_calls", "refusing", "not_the_course_answer", "all_ranks_ok",
           "grad_of", "worst_error", "reduce_name",
           "check_chunk_to_send", "check_reduce_scatter_phase", "check_all_gather_phase", "check_ring_all_reduce",
           "check_recursive_doubling_all_reduce", "check_hang_diagnosis", "gradient_per_micro_batch", "mean_gradient",
           "shard", "first_weights", "batch_gradient", "FEATURES", "MICRO_BATCH", "HANG_SPLIT", "raised"]

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


# ==== 00 collectives: a ring all-reduce from send and recv ====================================
# Chunk schedule of the ring (Playbook, "A quick focus on collective operations"): at ring
# step t (0 <= t < 2(N-1)) rank r sends chunk (r - t) mod N to rank r+1. The first N-1 steps
# add (reduce-scatter), after which rank r holds the full sum of chunk (r+1) mod N; the next
# N-1 steps copy (all-gather).
RING_WORLDS = (2, 3, 4)
RING_DTYPES = (torch.float32, torch.float64)
RING_SHAPES = ((12,), (7,), (3,), (3, 50))  # 12 splits over 2, 3, 4; 7 over none; 3 < 4 ranks; 2-D
PHASE_CHUNK_NUMELS = (1, 5)


def check_chunk_to_send(chunk_to_send: Callable[[int, int, int], int]) -> None:
    """At every step of both phases, each rank must send chunk (rank - step) mod world."""
    with Report("chunk_to_send") as report:
        for world in RING_WORLDS:
            steps = range(2 * (world - 1))
            for rank in range(world):
                expected = [(rank - step) % world for step in steps]
                actual = [chunk_to_send(step, rank, world) for step in steps]
                ok = all(isinstance(a, int) and a == e for a, e in zip(actual, expected))
                report.add(ok, world=world, rank=rank, expected=expected, actual=actual,
                           detail="" if ok else "a chunk index is an int in 0..world-1, one per step")


def check_reduce_scatter_phase(reduce_scatter_phase: Callable) -> None:
    """After the phase, chunk (rank+1) % world of each rank holds the sum of that chunk over ranks."""
    _check_phase(reduce_scatter_phase, "reduce_scatter_phase", gather=False)


def check_all_gather_phase(all_gather_phase: Callable) -> None:
    """Starting from chunk (rank+1) % world complete on each rank, every rank ends with every chunk."""
    _check_phase(all_gather_phase, "all_gather_phase", gather=True)


def _check_phase(phase: Callable, title: str, gather: bool) -> None:
    with Report(title) as report:
        for world in RING_WORLDS:
            cases = [(k, dtype, seed) for seed, (k, dtype) in enumerate(_product(PHASE_CHUNK_NUMELS, RING_DTYPES))]
            results = on_ranks(_phase_on_rank, world, phase, title, cases, gather)
            for (k, dtype, seed), per_rank in zip(cases, zip(*results)):
                total = _sum_over_ranks(world, (world * k,), dtype, seed)
                errors, detail = [], ""
                for rank, (flat, _, replaced, _) in enumerate(per_rank):
                    # reduce-scatter: only the owned chunk is defined; all-gather: every chunk
                    looked_at = slice(None) if gather else _owned(rank, world, k)
                    errors.append(max_abs_error(flat[looked_at], total[looked_at]))
                    if not detail and not close_enough(flat[looked_at], total[looked_at], dtype, n=world):
                        what = "all chunks" if gather else f"chunk {(rank + 1) % world}"
                        detail = (f"rank {rank}, {what}: {mismatch(flat[looked_at], total[looked_at])}"
                                  + _replaced_note(replaced))
                sent = max(nbytes for _, nbytes, _, _ in per_rank)
                bound = (world - 1) * k * _itemsize(dtype)  # N-1 steps, one chunk each
                if not detail and not 0 < sent <= bound:
                    detail = f"a rank sent {sent} bytes; one phase sends N-1 chunks: {bound} bytes"
                returned = next((kind for _, _, _, kind in per_rank if kind is not None), None)
                if not detail and returned is not None:  # the task says: return nothing
                    detail = (f"{title} returned a {returned}; return nothing: the phase works in place on "
                              "`chunks`, and the caller reads the result there")
                report.add(not detail, detail, world=world, chunk_numel=k, dtype=dtype, max_abs_err=max(errors),
                           **{"sent/rank (B)": sent, "N-1 chunks (B)": bound})


def _owned(rank: int, world: int, k: int) -> slice:
    """The chunk a rank owns after the reduce-scatter, (rank + 1) % world, as a slice of the flat buffer."""
    return slice((rank + 1) % world * k, ((rank + 1) % world + 1) * k)


def check_ring_all_reduce(ring_all_reduce: Callable) -> None:
    """Every rank's tensor becomes the sum over ranks, in place, sending at most a ring's bytes."""
    with Report("ring_all_reduce", note="2(N-1)/N*S: what each rank sends in a ring all-reduce of S bytes over "
                                        "N ranks (a little more when N does not divide the size: padding)") as report:
        for world in RING_WORLDS:
            cases = [(shape, dtype, seed) for seed, (shape, dtype) in enumerate(_product(RING_SHAPES, RING_DTYPES))]
            results = on_ranks(_ring_on_rank, world, ring_all_reduce, cases)
            for (shape, dtype, seed), per_rank in zip(cases, zip(*results)):
                expected = _sum_over_ranks(world, shape, dtype, seed)
                numel = math.prod(shape)
                # Chunks of ceil(numel / world) elements, N-1 steps per phase; exactly 2(N-1)/N S
                # when world divides numel.
                bound = 2 * (world - 1) * math.ceil(numel / world) * _itemsize(dtype)
                errors, sent, detail = [], [], ""
                for rank, (tensor, nbytes, returned, gave_back) in enumerate(per_rank):
                    errors.append(max_abs_error(tensor, expected))
                    sent.append(nbytes)
                    if not detail and not close_enough(tensor, expected, dtype, n=world):
                        detail = f"rank {rank}: {mismatch(tensor, expected)}"
                        if returned is not None and close_enough(returned, expected, dtype, n=world):
                            detail += "; the returned tensor is right, but the input must be summed in place"
                    if not detail and gave_back != "the tensor":  # the task says: return it
                        detail = (f"rank {rank}: ring_all_reduce returned {gave_back}; return the tensor "
                                  "it summed in place (`return tensor`)")
                traffic_ok = 0 < max(sent) <= bound
                if not detail and not traffic_ok:
                    detail = (f"a rank sent {max(sent)} bytes; a ring all-reduce sends at most {bound} "
                              "(2(N-1) steps of one chunk), and more than 0")
                report.add(not detail, detail, world=world, shape=shape, dtype=dtype, max_abs_err=max(errors),
                           **{"sent/rank (B)": max(sent),
                              "2(N-1)/N*S (B)": round(ring_bytes(world, numel * _itemsize(dtype)))})


def _phase_on_rank(phase: Callable, what: str, cases: list, gather: bool) -> list:
    """Run one phase on this rank for every case; return (all chunks, bytes sent, chunks replaced, the type of
    what the phase returned or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for k, dtype, seed in cases:
        flat = rank_tensor(rank, (world * k,), dtype, seed)
        if gather:  # the state after a reduce-scatter: the owned chunk complete, the rest partial
            owned = _owned(rank, world, k)
            flat[owned] = sum(rank_tensor(r, (world * k,), dtype, seed)[owned] for r in range(world))
        flat = flat.to(device())
        chunks = list(flat.split(k))
        originals = list(chunks)
        with only_point_to_point(what) as sent:
            returned = phase(chunks, rank, world)
        replaced = [i for i, (a, b) in enumerate(zip(chunks, originals)) if a is not b]
        out.append((flat.cpu(), sent.bytes, replaced, None if returned is None else type(returned).__name__))
    return out


def _ring_on_rank(ring_all_reduce: Callable, cases: list) -> list:
    rank = dist.get_rank()
    out = []
    for shape, dtype, seed in cases:
        tensor = rank_tensor(rank, shape, dtype, seed).to(device())
        with only_point_to_point("ring_all_reduce", answers=("ring_all_reduce",)) as sent:
            returned = ring_all_reduce(tensor)
        gave_back = _what_came_back(returned, tensor)
        if not isinstance(returned, torch.Tensor) or returned is tensor:
            returned = None  # only kept to explain a result returned instead of written in place
        out.append((tensor.cpu(), sent.bytes, None if returned is None else returned.cpu(), gave_back))
    return out


def _what_came_back(returned, tensor: torch.Tensor) -> str:
    """"the tensor" when a function returned its input itself, otherwise what it returned, in words."""
    if returned is tensor:
        return "the tensor"
    if isinstance(returned, torch.Tensor):
        return "a new tensor, not the one it was given"
    return "None" if returned is None else f"a {type(returned).__name__}"


def _replaced_note(replaced: list) -> str:
    if not replaced:
        return ""
    return (f"; chunks {replaced} were replaced by new tensors: update them in place "
            "(chunks[i] += ..., chunks[i].copy_(...)), they are views of one buffer")


def _sum_over_ranks(world: int, shape: tuple, dtype, seed: int) -> torch.Tensor:
    """The single-process answer: the plain sum of every rank's tensor, in float64."""
    return sum(rank_tensor(rank, shape, dtype, seed).double() for rank in range(world))


def _product(a, b) -> list:
    return [(x, y) for x in a for y in b]


def ring_bytes(world: int, nbytes: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `nbytes` over `world` ranks: 2 (N-1)/N S."""
    return 2 * (world - 1) / world * nbytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- 00, stretch: an all-reduce in log2 N steps, by recursive doubling ---------------------------
# At step k (0 <= k < log2 N) rank r swaps its whole running sum with rank r XOR 2^k and adds what it
# receives (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
# MPICH"): log2 N messages of S bytes per rank, against the ring's 2(N-1) messages of S/N. The check
# holds the learner to that count and to the sum one process computes; it has no reference of its own.
DOUBLING_WORLDS = (2, 4)           # powers of two
DOUBLING_REFUSED = 3               # not a power of two: every rank must raise ValueError before any message
DOUBLING_SHAPES = ((6,), (3, 5))   # 1-D and 2-D, a size that 4 does not divide
DOUBLING_DTYPES = RING_DTYPES


class MessageBeforeRefusal(Exception):
    """Raised in the check, on a world size that is not a power of two, by the first send or receive."""


def check_recursive_doubling_all_reduce(recursive_doubling_all_reduce: Callable) -> None:
    """On 2 and 4 ranks: the sum over ranks, in place, the tensor returned, and exactly log2 N messages of S
    bytes per rank. On 3 ranks: ValueError naming the world size on every rank, before any message."""
    fn = recursive_doubling_all_reduce
    with Report("recursive_doubling_all_reduce",
                note="log2(N) x S: what each rank sends by recursive doubling, one message of the whole "
                     "tensor (S bytes) per step") as report:
        for world in DOUBLING_WORLDS:
            steps = world.bit_length() - 1  # log2 N
            cases = [(shape, dtype, 100 + seed)
                     for seed, (shape, dtype) in enumerate(_product(DOUBLING_SHAPES, DOUBLING_DTYPES))]
            results = on_ranks(_doubling_on_rank, world, fn, cases)
            for (shape, dtype, seed), per_rank in zip(cases, zip(*results)):
                expected = _sum_over_ranks(world, shape, dtype, seed)
                nbytes = math.prod(shape) * _itemsize(dtype)
                errors, detail = [], ""
                for rank, (tensor, messages, returned, gave_back) in enumerate(per_rank):
                    errors.append(max_abs_error(tensor, expected))
                    if detail:
                        continue
                    if not close_enough(tensor, expected, dtype, n=world):
                        detail = f"rank {rank}: {mismatch(tensor, expected)}"
                        if returned is not None and close_enough(returned, expected, dtype, n=world):
                            detail += "; the returned tensor is right, but the input must be summed in place"
                    elif gave_back != "the tensor":
                        detail = (f"rank {rank}: it returned {gave_back}; return the tensor it summed in place "
                                  "(`return tensor`)")
                    elif messages != [nbytes] * steps:
                        detail = (f"rank {rank} sent {len(messages)} messages of {_sizes(messages)} bytes; recursive "
                                  f"doubling on {world} ranks sends log2 N = {steps}, each the whole tensor "
                                  f"({nbytes} bytes): at step k, to rank r XOR 2^k")
                report.add(not detail, detail, world=world, shape=shape, dtype=dtype, max_abs_err=max(errors),
                           **{"messages/rank": max(len(m) for _, m, _, _ in per_rank),
                              "sent/rank (B)": max(sum(m) for _, m, _, _ in per_rank),
                              "log2(N) x S (B)": steps * nbytes})
        world = DOUBLING_REFUSED
        outcomes = on_ranks(_doubling_refusal_on_rank, world, fn)
        detail = next((f"rank {rank}: {outcome}" for rank, outcome in enumerate(outcomes) if outcome), "")
        report.add(not detail, detail, world=world, shape=(6,), dtype=torch.float32, refused="ValueError")


def _doubling_on_rank(fn: Callable, cases: list) -> list:
    """Run the learner's all-reduce for every case; return (tensor after, bytes of each message sent, the returned
    tensor when it is another one, what came back in words)."""
    rank = dist.get_rank()
    out = []
    for shape, dtype, seed in cases:
        tensor = rank_tensor(rank, shape, dtype, seed).to(device())
        with only_point_to_point("recursive_doubling_all_reduce"), _messages_sent() as messages:
            returned = fn(tensor)
        other = returned.cpu() if isinstance(returned, torch.Tensor) and returned is not tensor else None
        out.append((tensor.cpu(), list(messages), other, _what_came_back(returned, tensor)))
    return out


def _doubling_refusal_on_rank(fn: Callable) -> str:
    """On a world size that is not a power of two: "" when the learner raised ValueError naming it before any
    send or receive, otherwise what happened instead. Every send and receive raises here, so no rank can
    wait for a partner that has already refused."""
    world = dist.get_world_size()
    tensor = rank_tensor(dist.get_rank(), (6,), torch.float32, seed=7).to(device())
    try:
        with only_point_to_point("recursive_doubling_all_reduce"), _no_messages():
            fn(tensor)
    except ValueError as error:
        if str(world) not in str(error):
            return f"the ValueError does not name the world size {world}: {error}"
        return ""
    except MessageBeforeRefusal as error:
        what = f"it {error}"
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - the learner's own error, reported in the table
        what = f"it raised {type(error).__name__} ({error})"
    else:
        what = "it returned"
    return f"on {world} ranks (not a power of two) {what}; raise ValueError naming {world} before any send or receive"


@contextmanager
def _messages_sent() -> Iterator[list[int]]:
    """Inside the block, the bytes of each message this rank sends, one entry per send or isend."""
    sizes: list[int] = []
    with patched(_sends_counted(sizes.append)):
        yield sizes


@contextmanager
def _no_messages() -> Iterator[None]:
    """Inside the block every send and receive raises MessageBeforeRefusal."""
    def refuse(name: str) -> Callable:
        def call(*args, **kwargs):
            raise MessageBeforeRefusal(f"called dist.{name}")
        call.__name__ = name
        return call

    refusals = {name: refuse(name) for name in ("send", "recv", "isend", "irecv", "batch_isend_irecv")}
    with patched([(module, name, call) for module in (dist, c10d) for name, call in refusals.items()]):
        yield


def _sizes(messages: list[int]) -> str:
    return "/".join(str(size) for size in sorted(set(messages))) or "0"


# ---- 00, part 8: diagnose a hang ------------------------------------------------------------------
# Data parallelism over an uneven split: each rank all-reduces its gradient after each of its own
# micro-batches, so the rank with one micro-batch more makes an all_reduce that no other rank makes and
# waits in it forever. The learner reads the hang report (picotron/collective_trace.py) and fixes the
# function. The check finds the truth the same way, from `run`'s TimeoutError.rank_states.
FEATURES = 4                                    # weights of the linear model
MICRO_BATCH = 4                                 # examples per micro-batch
HANG_SPLIT = (8, 8, 9, 8)                       # examples per rank: 2, 2, 3 and 2 micro-batches
FIX_SPLITS = (HANG_SPLIT, (0, 7, 2, 5), (5, 13, 1), (12, 3))   # a rank without data; 3 and 2 ranks
HANG_TIMEOUTS = (3.0, 12.0)                     # the second try: a loaded machine had not reached the hang
FIX_TIMEOUT = 10.0                              # a fix that still hangs fails after this many seconds


def shard(rank: int, split: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s examples (x, y): `split[rank]` consecutive rows of one dataset of sum(split) examples."""
    x, y = _examples(sum(split))
    start = sum(split[:rank])
    return x[start:start + split[rank]], y[start:start + split[rank]]


def _examples(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(n, FEATURES, generator=generator, dtype=torch.float64)
    return x, x.sum(dim=1) + 0.1 * torch.randn(n, generator=generator, dtype=torch.float64)


def first_weights() -> torch.Tensor:
    """The weights rank 0 starts from; it broadcasts them to the others."""
    return torch.randn(FEATURES, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def batch_gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the summed squared error, sum of (x w - y)^2 / 2 over the examples, by backward
    (zeros for no examples)."""
    w = w.detach().requires_grad_()
    (0.5 * (x @ w - y).square().sum()).backward()
    return w.grad


def gradient_per_micro_batch(split: tuple) -> torch.Tensor:
    """The mean gradient over every example of `split` (examples per rank), all-reduced after each micro-batch."""
    rank = dist.get_rank()
    w = first_weights() if rank == 0 else torch.empty(FEATURES, dtype=torch.float64)
    dist.broadcast(w, src=0)                     # every rank starts from rank 0's weights
    x, y = shard(rank, split)
    grad = torch.zeros_like(w)
    for xb, yb in zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)):
        g = batch_gradient(w, xb, yb)
        # this micro-batch's gradient, summed over the ranks
        dist.all_reduce(g)
        grad += g
    return grad / sum(split)


def mean_gradient(split: tuple) -> torch.Tensor:
    """One process's answer: the gradient of the mean squared error over every example of `split`."""
    x, y = _examples(sum(split))
    return batch_gradient(first_weights(), x, y) / sum(split)


def check_hang_diagnosis(hang: dict, fixed_fn: Callable) -> None:
    """`hang` names what the report of gradient_per_micro_batch on HANG_SPLIT shows: the rank that waits, the
    operation and its call number (from 1). Then `fixed_fn(split)` must return mean_gradient(split) on every
    rank, without hanging, on every split of FIX_SPLITS."""
    if not isinstance(hang, dict):
        raise AssertionError(f'hang is a {type(hang).__name__}; write a dict: {{"rank": ..., "op": ..., "call": ...}}')
    waiting, finished = _hang_of(gradient_per_micro_batch, HANG_SPLIT)
    with Report("hang_diagnosis", note=f"gradient_per_micro_batch{HANG_SPLIT} on {len(HANG_SPLIT)} ranks") as report:
        for key, hint in _diagnosis_hints(hang, waiting, finished):
            report.add(not hint, hint, what=key, yours=repr(hang.get(key)))
    with Report("fixed gradient", note="every rank's result against one process's mean_gradient") as report:
        for split in FIX_SPLITS:
            expected, detail = mean_gradient(split), ""
            try:
                per_rank = run(_fixed_on_rank, len(split), args=(fixed_fn, split), timeout=FIX_TIMEOUT,
                               backend="gloo")
            except TimeoutError as error:   # the first hang is the one to fix: no more splits
                where = str(error).split("\n", 1)[-1]   # "Where each rank was ...", one line per rank
                report.add(False, f"split {split}: the ranks hung. {where}", split=split, world=len(split))
                break
            for rank, got in enumerate(per_rank):
                if not isinstance(got, torch.Tensor):
                    detail = detail or f"split {split}, rank {rank}: returned a {type(got).__name__}, not a tensor"
                elif not close_enough(got, expected, n=sum(split)):
                    detail = detail or f"split {split}, rank {rank}: {mismatch(got, expected)}"
            errors = [max_abs_error(g, expected) if isinstance(g, torch.Tensor) else math.inf for g in per_rank]
            report.add(not detail, detail, split=split, world=len(split), max_abs_err=max(errors))


def _hang_of(fn: Callable, split: tuple):
    """Run `fn` until it hangs; return the waiting rank's RankState and {rank: state} of the finished ones."""
    for timeout in HANG_TIMEOUTS:
        try:
            run(fn, len(split), args=(split,), timeout=timeout, backend="gloo")
        except TimeoutError as error:
            waiting = [s for s in error.rank_states if s.phase == "in a collective" and s.collective]
            finished = {s.rank: s for s in error.rank_states if s.phase == "finished"}
            if len(waiting) == 1 and len(finished) == len(split) - 1:
                return waiting[0], finished
        else:
            raise RuntimeError(f"{fn.__name__}{split} returned: the check expected it to hang")
    raise RuntimeError(f"{fn.__name__}{split} did not reach its hang in {HANG_TIMEOUTS[-1]:g} s: run the check again")


def _diagnosis_hints(hang: dict, waiting, finished: dict) -> list[tuple[str, str]]:
    """(key, "" or the hint for a wrong answer) for "rank", "op" and "call"; no hint gives the answer away."""
    rank, op, call, truth = hang.get("rank"), hang.get("op"), hang.get("call"), waiting.collective
    line = "the line of the rank that waits"
    rank_hint, op_hint, call_hint = "", "", ""
    if isinstance(rank, int) and rank in finished:
        last = finished[rank].collective
        rank_hint = (f"rank {rank} finished the function (after {last.op} #{last.number}): it waits for nothing. "
                     "Name the rank whose line says 'waits in'")
    elif rank != waiting.rank or not isinstance(rank, int):
        rank_hint = "the rank is a number: the one whose line in the report says 'waits in'"
    if _op_key(op) in {_op_key(c) for c in COLLECTIVES} - {_op_key(truth.op)}:
        op_hint = (f"{op} is not the call the waiting rank is stuck in (the ranks got past their other calls): "
                   f"name the operation after 'waits in' on {line}")
    elif _op_key(op) != _op_key(truth.op):
        op_hint = f"write the operation as the report does, e.g. 'all_gather', from {line}"
    if call == truth.number - 1:
        call_hint = "the report counts calls from 1 (#1 is the first): write the number after '#' as it is"
    elif call == truth.number + 1:
        call_hint = ("the report counts each operation on its own: all_reduce #N is the N-th all_reduce, "
                     "whatever other collectives (a broadcast) came before")
    elif call != truth.number or not isinstance(call, int):
        call_hint = f"the call is the number after '#' in {line}"
    return [("rank", rank_hint), ("op", op_hint), ("call", call_hint)]


def _op_key(op) -> str:
    """'dist.all_reduce', 'all-reduce', 'allreduce' -> 'allreduce'."""
    return str(op).split(".")[-1].lower().replace("_", "").replace("-", "").replace(" ", "")


def _fixed_on_rank(fixed_fn: Callable, split: tuple):
    """The learner's fix on this rank, which must not call the check's reference (each rank has a shard only)."""
    with refusing("your fix", {mean_gradient.__code__: "mean_gradient (the check's own reference)"}):
        return fixed_fn(split)

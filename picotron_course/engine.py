"""One engine judges every declared check: what it runs, what it expects, and the misconceptions it knows.

A check is a declaration. It names its cases, how to run an answer on them (`observe`: on N ranks or in this
process, it returns what it saw, one dict of observations a case), what a correct answer observes (`expect`:
single-process torch, computed here), what each observation is in words and how close is equal (`Exact`,
`Close`, `InTraining`, `Within`), and its misconceptions. The engine runs the answer, compares every
observation of every case, prints one row a case, and raises AssertionError naming the first difference:

    GRAD_BUCKET = Check("GradBucket", cases=[dict(shapes=[(3, 4)], dtype=torch.float32), ...],
                        observe=observe_buckets, expect=mean_over_ranks,
                        quantities={"all-reduces": Exact("the all-reduces launched, in order"),
                                    "grads": Close("gradients after wait()", n=WORLD + 1, axes=("rank {}",))},
                        misconceptions=[Misconception(BucketSums, "divide by the world size: ...")])

    def check_grad_bucket(GradBucket):
        GRAD_BUCKET(GradBucket)

A misconception is one record: a wrong implementation and the hint a learner who wrote it should read. When an
answer fails, the engine runs the check's misconceptions on the same cases (one more run, once per process: the
records are fixed code) and reports the hint of the first whose mistake the answer reproduces: it fails in the
same cases, first at the same observation, with the same value there (what follows a first mistake, say a
gradient an early all-reduce read, may vary by run). An answer whose mistake no record makes gets the first
difference without a hint. The same records are the tests of the check (tests/test_misconceptions.py): each must
fail its check with its own hint, so two records that cannot be told apart, or a check that cannot see one, fail
there.

A check that runs on ranks observes through `observe_on_ranks`: one launch for every answer and case, each case
in its group (`world_and_halves`: the groups of all ranks and of half of them), a deadlock named.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from picotron_course import settings
from picotron_course.checks import Report, close_enough, close_in_training, max_abs_error, mismatch, preview
from picotron_course.checks import not_the_course_answer
from picotron_course.checks import on_ranks as launch

__all__ = ["Quantity", "Exact", "Count", "AtMost", "Said", "Close", "per_case", "InTraining", "Within", "Misconception",
           "Check", "CHECKS", "named", "observe_in_process", "observe_on_ranks", "world_and_halves", "by_rank"]

CHECKS: list["Check"] = []   # every check declared, in the order its module was imported


class _Nothing:
    """Past the end of a list (one list shorter than the other)."""

    def __repr__(self) -> str:
        return "nothing"


NOTHING = _Nothing()


# ---- how two observations are compared --------------------------------------------------------
@dataclass(frozen=True)
class Quantity:
    """One observation a check compares: what it is, in words; `axes` name the levels of a nested value
    ("rank {}", "params[{}]"), so a difference is found and named inside it."""
    says: str
    axes: tuple = ()

    def equal(self, got, want) -> bool:
        raise NotImplementedError

    def shown(self, got, want) -> str:
        return f"expected {_short(want)}, got {_short(got)}"

    def error(self, got, want) -> float:
        """The largest absolute error of the tensors inside (NaN for a quantity without tensors)."""
        return math.nan

    def difference(self, got, want) -> str:
        """"" when equal, else where the first difference lies and what it is."""
        path, got, want = self._first_difference(got, want, self.axes)
        if path is None:
            return ""
        return f"{self.says}" + (f" ({', '.join(path)})" if path else "") + f": {self.shown(got, want)}"

    def _first_difference(self, got, want, axes):
        if axes and isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
            for i in range(max(len(got), len(want))):
                g, w = (got[i] if i < len(got) else NOTHING), (want[i] if i < len(want) else NOTHING)
                path, g, w = self._first_difference(g, w, axes[1:])
                if path is not None:
                    return [axes[0].format(i), *path], g, w
            return None, got, want
        return (None if self.equal(got, want) else []), got, want


@dataclass(frozen=True)
class Exact(Quantity):
    """Equal as Python values: counts, names, what a call was given, in order."""

    def equal(self, got, want) -> bool:
        return got == want


class _Tensors(Quantity):
    def equal(self, got, want) -> bool:
        if isinstance(want, torch.Tensor):
            return isinstance(got, torch.Tensor) and self.close(got, want)
        if isinstance(want, (list, tuple)):
            return isinstance(got, (list, tuple)) and len(got) == len(want) and all(
                self.equal(g, w) for g, w in zip(got, want))
        return got == want

    def shown(self, got, want) -> str:
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor):
            return mismatch(got, want.to(got.dtype) if got.shape == want.shape else want)
        return super().shown(got, want)

    def error(self, got, want) -> float:
        if isinstance(want, torch.Tensor):
            return max_abs_error(got, want) if isinstance(got, torch.Tensor) else math.inf
        if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
            return max((self.error(g, w) for g, w in zip(got, want)), default=math.nan)
        return math.nan if want is None else math.inf


@dataclass(frozen=True)
class Close(_Tensors):
    """Tensors equal up to the rounding of the `n` operations behind each number (picotron.tolerance). Where they
    differ by case, the expected tensor carries its own (`per_case(want, n=..., scale=...)`)."""
    n: int = 1
    dtype: Any = None

    def close(self, got, want) -> bool:
        return close_enough(got, want, self.dtype, n=getattr(want, "roundings", self.n),
                            scale=getattr(want, "scale", None))


def per_case(want: torch.Tensor, n: int | None = None, scale: float | None = None) -> torch.Tensor:
    """An expected tensor that carries its own roundings `n` or `scale` for Close (picotron.tolerance)."""
    if n is not None:
        want.roundings = n
    if scale is not None:
        want.scale = scale
    return want


@dataclass(frozen=True)
class Count(Exact):
    """A count equal to the expected one, or at most it (`at_most`); `more`, `fewer`: what a count above, below says."""
    more: str = ""
    fewer: str = ""
    at_most: bool = False

    def equal(self, got, want) -> bool:
        return got == want or (self.at_most and isinstance(got, int) and got <= want)

    def shown(self, got, want) -> str:
        why = "" if not (isinstance(got, int) and isinstance(want, int)) else self.more if got > want else self.fewer
        return f"expected {'at most ' * self.at_most}{want}, got {got}" + (f": {why}" if why else "")


@dataclass(frozen=True)
class AtMost(Quantity):
    """A number no larger than the expected one, a bound (an error, a budget); `rule` shows a number over it, with
    {got} and {want}."""
    rule: str = "{got:.3g}, above {want:g}"

    def equal(self, got, want) -> bool:
        return isinstance(got, (int, float)) and got <= want

    def shown(self, got, want) -> str:
        return self.rule.format(got=got, want=want) if isinstance(got, (int, float)) else super().shown(got, want)


@dataclass(frozen=True)
class Said(Exact):
    """Exact, shown whole (what a rank raised or refused, "" when nothing): the message says what to fix."""

    def shown(self, got, want) -> str:
        return f"expected {want or 'nothing'}, got {got or 'nothing'}"


@dataclass(frozen=True)
class InTraining(_Tensors):
    """Gradients some steps into training against one process's: the course's claim (tolerance.TRAINING_GRAD_TOL)."""

    def close(self, got, want) -> bool:
        return close_in_training(got, want)


@dataclass(frozen=True)
class Within(_Tensors):
    """Tensors within an absolute tolerance (weights after AdamW steps: tolerance.ADAM_WEIGHTS_ATOL)."""
    atol: float = 0.0

    def close(self, got, want) -> bool:
        return max_abs_error(got, want) <= self.atol

    def shown(self, got, want) -> str:
        return f"off by {self.error(got, want):.2e} (> {self.atol:.0e}); " + super().shown(got, want)


# ---- a check ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Misconception:
    """A wrong answer a learner may write, and the hint that sets it right."""
    answer: Any
    hint: str

    @property
    def name(self) -> str:
        """The answer's name; for several answers taken together (a tuple), theirs joined by '+'."""
        parts = self.answer if isinstance(self.answer, tuple) else (self.answer,)
        return "+".join(getattr(part, "__name__", type(part).__name__) for part in parts)


@dataclass
class Check:
    """A check as data; calling it judges an answer (prints the table, raises AssertionError on a wrong one).

    observe(answers, cases) -> for each answer, a list of observation dicts (one a case); it runs them all in one
    launch when they need ranks. expect(case, observed) -> the observations of a correct answer (`observed`, the
    answer's own, for expectations relative to it: one all-reduce per bucket *it* made). columns(case, observed)
    -> extra columns of the table. course: the module(s) whose own answer is refused (not_the_course_answer).
    """
    title: str
    cases: list[dict]
    observe: Callable[[list, list], list]
    expect: Callable[[dict, dict], dict]
    quantities: dict[str, Quantity]
    misconceptions: list[Misconception] = field(default_factory=list)
    columns: Callable[[dict, dict], dict] | None = None
    note: str = ""
    course: str | tuple | None = None
    only: dict | None = None
    requires: tuple = ()   # packages the check (and its records) cannot run without, e.g. ("triton",)

    def __post_init__(self):
        CHECKS.append(self)
        self._theirs: list | None = None   # the misconceptions' observations, made once per process

    def missing(self) -> list[str]:
        """The packages of `requires` this Python cannot import (a finder that hides one may raise)."""
        def found(name: str) -> bool:
            try:
                return importlib.util.find_spec(name) is not None
            except ImportError:
                return False
        return [name for name in self.requires if not found(name)]

    def refuse(self, answer, *made) -> None:
        """Refuse `answer` (each of a tuple of answers), and what it made (an instance, its parts), when it is the
        course's own code (not_the_course_answer with `course` and `only`), unless it is one of this check's
        misconceptions (known by ==: a tuple sent to the ranks arrives as a copy of the same classes)."""
        if self.course and all(answer != m.answer for m in self.misconceptions):
            answers = answer if isinstance(answer, tuple) else (answer,)
            not_the_course_answer(self.title, *answers, *made, course=self.course, only=self.only)

    def __call__(self, answer) -> None:
        self.refuse(answer)
        self.judge(self.observe([answer], self.cases)[0])

    def judge(self, observed: list) -> None:
        """Judge an answer by what it was seen to do (one observation dict a case): print the table, and raise
        AssertionError with the hint of the misconception it reproduces when it is wrong."""
        expected = [self.expect(case, got) for case, got in zip(self.cases, observed)]
        differences = [self.differences(got, want) for got, want in zip(observed, expected)]
        report = Report(self.title, self.note)
        for case, got, want, wrong in zip(self.cases, observed, expected, differences):
            errors = [q.error(got.get(k), want[k]) for k, q in self.quantities.items()
                      if isinstance(q, _Tensors) and k in want]
            shown = {k: v for k, v in case.items() if not k.startswith("_")}
            report.add(not wrong, next(iter(wrong.values()), ""), **shown,
                       **(self.columns(case, got) if self.columns else {}),
                       **({"max_abs_err": max(errors, key=lambda e: -1 if math.isnan(e) else e)} if errors else {}))
        if any(differences):
            report.hint = self.hint(observed, expected, differences)
        report.finish()

    def differences(self, got: dict, want: dict) -> dict[str, str]:
        """{quantity: what differs} for the quantities of one case that differ from the expected ones."""
        found = {key: quantity.difference(got.get(key), want[key]) for key, quantity in self.quantities.items()
                 if key in want}
        return {key: text for key, text in found.items() if text}

    def hint(self, observed: list, expected: list, differences: list) -> str:
        """The hint of the first misconception the answer reproduces, "" when none does."""
        if not self.misconceptions:
            return ""
        if self._theirs is None:   # the records are fixed code on fixed cases: one run per process
            try:
                self._theirs = self.observe([m.answer for m in self.misconceptions], self.cases)
            except Exception:   # noqa: BLE001  (a record that cannot run on this machine gives no hint)
                return ""
        for misconception, their in zip(self.misconceptions, self._theirs):
            if all(self._same_mistake(mine, wrong, want, them)
                   for mine, wrong, want, them in zip(observed, differences, expected, their)):
                return misconception.hint
        return ""

    def _same_mistake(self, mine: dict, wrong: dict, want: dict, theirs: dict) -> bool:
        """The misconception goes wrong in the same case, first at the same quantity, with the same value there.
        Only the first difference counts: what follows it (a gradient an early all-reduce read) may vary by run."""
        first = next(iter(self.differences(theirs, want)), None)
        if first != next(iter(wrong), None):
            return False
        mine, theirs = mine.get(first), theirs.get(first)
        return first is None or self.quantities[first].equal(mine, theirs) or _identical(mine, theirs)


def _identical(a, b) -> bool:
    """The same values, NaN and infinities included (which no tolerance calls equal): a mistake that makes NaN
    is the same mistake wherever it does."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5))
                                                                   and torch.equal(a.isnan(), b.isnan()))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


def named(name: str, answer: Callable) -> Callable:
    """A misconception written as a lambda, under the name its test shows."""
    answer.__name__ = answer.__qualname__ = name
    return answer


# ---- where observations are made ---------------------------------------------------------------
def observe_in_process(run_case: Callable) -> Callable:
    """observe(answers, cases) in this process: run_case(answer, case) -> what it saw, of every answer on every
    case."""
    return lambda answers, cases: [[run_case(answer, case) for case in cases] for answer in answers]


def observe_on_ranks(world: int, run_case: Callable, groups: Callable | None = None, key: str = "",
                     deadlock: str = "") -> Callable:
    """observe(answers, cases) on `world` ranks: one launch runs every answer on every case, as [answer][case] dicts
    of lists over the ranks (by_rank). On each rank, groups() -> {case[key]: group or tuple of groups} is made once
    (new_group is collective: every rank makes every group, in one order) and run_case(answer, case, *its groups)
    says what the rank saw. `deadlock`: what to say when the ranks do not finish within the check's timeout (a
    rank waits for a message no rank sends; "{timeout}" in it becomes the timeout), followed by the first line of
    the launcher's own message; without it the TimeoutError goes through."""
    def observe(answers: list, cases: list) -> list:
        try:
            return by_rank(launch(_every_case, world, run_case, groups, key, answers, cases))
        except TimeoutError as e:
            if not deadlock:
                raise
            raise AssertionError(deadlock.format(timeout=settings.check_timeout) + " " + str(e).splitlines()[0]) \
                from None
    return observe


def _every_case(run_case: Callable, groups: Callable | None, key: str, answers: list, cases: list) -> list:
    made = groups() if groups else {}

    def of(case) -> tuple:
        group = made[case[key]] if groups else ()
        return group if isinstance(group, tuple) else (group,)
    return [[run_case(answer, case, *of(case)) for case in cases] for answer in answers]


def world_and_halves() -> dict:
    """{world size: the whole world, half of it: this rank's half}, the groups of a check whose cases run in groups
    of all ranks and of half of them (ranks 0-1 and 2-3 of 4: a rank's place in its group is not its global rank).
    Every rank makes both halves (new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    halves = [dist.new_group(list(range(start, start + world // 2))) for start in (0, world // 2)]
    return {world: dist.group.WORLD, world // 2: halves[rank // (world // 2)]}


def by_rank(per_rank: list) -> list:
    """What each rank returned, [rank][answer][case] dicts, as [answer][case] dicts whose values are lists over
    the ranks: the shape `observe` returns. A rank that stopped before it observed something has None there."""
    def merged(a: int, c: int) -> dict:
        keys = dict.fromkeys(key for rank in per_rank for key in rank[a][c])
        return {key: [rank[a][c].get(key) for rank in per_rank] for key in keys}
    return [[merged(a, c) for c in range(len(per_rank[0][a]))] for a in range(len(per_rank[0]))]


def _short(value, limit: int = 160) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {preview(value)}"
    text = repr(value) if not isinstance(value, str) else value or "nothing"
    return text if len(text) <= limit else text[:limit - 5] + " ...]"

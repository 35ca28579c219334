"""One proof for every technique: a parallel run trains like one process, step by step.

A parallel technique is done when its training run equals one process's: the same seed, the same global
batch, every step (docs/design.md, "Equivalence and tolerances"). The tests, the chapters and the checks
all prove it this way: both runs record the same things at the same points, and `Recorder` compares them.

A run records, after each step's backward, the step's loss over the global batch and the model's full
gradients by parameter name (a sharded run gathers them first), and after the last step the full weights:

    record = Recorder(reference)        # reference: the one-process run's Trace (None while making it)
    for step in range(steps):
        ...
        loss.backward()
        record.step(loss, gradients)    # gradients: {name: full tensor}, or None on a rank without them
        optimizer.step()
        optimizer.zero_grad()
    return record.finish(weights)       # the reference run: a Trace; a parallel run: a Lockstep

A parallel run compares inside the rank as it goes and keeps only the differences, so no rank sends a
copy of the model back each step. What is equal enough comes from picotron/tolerance.py: each step's loss
within LOSS_ATOL, each step's gradients within TRAINING_GRAD_TOL (rtol = atol), the weights after the
AdamW steps within ADAM_WEIGHTS_ATOL; and, given `first_step_n`, the first step's gradients (both runs
from equal weights, so rounding alone separates them) within the rounding bound for that many roundings.
`figure` draws any number of Locksteps against their reference: the losses, and the gradient differences
beside their tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from picotron import tolerance

__all__ = ["Trace", "Lockstep", "Recorder", "compare", "combine", "figure"]


@dataclass
class Trace:
    """What the reference run recorded: the loss and the full gradients of every step, the final weights."""
    loss: list = field(default_factory=list)
    grads: list = field(default_factory=list)
    weights: dict | None = None

    def only(self, names) -> Trace:
        """The same run restricted to the parameters `names` (what one pipeline stage holds, by name)."""
        names = set(names)
        return Trace(self.loss, [None if g is None else {n: t for n, t in g.items() if n in names} for g in self.grads],
                     None if self.weights is None else {n: w for n, w in self.weights.items() if n in names})


@dataclass
class Lockstep:
    """A parallel run against its reference, step by step: its losses, how far its losses and gradients
    were from the reference's at each step (NaN at a step it recorded no gradients), and its weights'."""
    loss: list = field(default_factory=list)
    loss_diff: list = field(default_factory=list)
    grad_diff: list = field(default_factory=list)
    grads_close: list = field(default_factory=list)    # None at a step without gradients
    weight_diff: float | None = None
    weights_close: bool | None = None
    first_step: tolerance.Comparison | None = None     # step 0 against the rounding bound (first_step_n)
    # What must have been compared, or the run is not proven (a check that silently skips is no check):
    reference_steps: int = 0                           # as many steps as the reference
    expect_grads: bool = True                          # gradients at every step (Recorder(grads=False): none)
    expect_weights: bool = True                        # the final weights, when the reference has them
    no_grads: list = field(default_factory=list)       # steps at which the run recorded no gradients

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """What is not equal enough, or was not compared, one line each (empty when the run equals its reference)."""
        out = []
        if len(self.loss) != self.reference_steps:
            out.append(f"the run recorded {len(self.loss)} steps, the reference {self.reference_steps}")
        if self.expect_grads and self.no_grads:
            out.append(f"steps {self.no_grads}: no gradients were compared (Recorder.step got none)")
        if self.expect_weights and self.weights_close is None:
            out.append("the final weights were not compared (Recorder.finish got none)")
        out += [f"step {i}: loss differs by {d:.3g} (tolerance {tolerance.LOSS_ATOL:g})"
                for i, d in enumerate(self.loss_diff) if not d <= tolerance.LOSS_ATOL]
        out += [f"step {i}: gradients differ by up to {self.grad_diff[i]:.3g} (tolerance rtol = atol = "
                f"{tolerance.TRAINING_GRAD_TOL:g})" for i, close in enumerate(self.grads_close) if close is False]
        if self.weights_close is False:
            out.append(f"final weights differ by up to {self.weight_diff:.3g} "
                       f"(tolerance {tolerance.ADAM_WEIGHTS_ATOL:g})")
        if self.first_step is not None and not self.first_step.ok:
            out.append(f"step 0 (equal weights, rounding alone): {self.first_step}")
        return out

    def assert_equal(self, what: str = "the parallel run") -> None:
        """Raise AssertionError, naming every step and quantity that is not equal enough."""
        problems = self.failures()
        if problems:
            raise AssertionError(f"{what} does not train like one process:\n  " + "\n  ".join(problems))


class Recorder:
    """Records a run step by step: the reference run keeps everything (`finish` returns a Trace); a
    parallel run given the reference compares each step as it is recorded (`finish` returns a Lockstep)."""

    def __init__(self, reference: Trace | None = None, *, first_step_n: int | None = None, grads: bool = True):
        """`grads=False`: this run has no full gradients to compare (e.g. torch's FSDP2 keeps them sharded);
        otherwise every step must bring them, or the Lockstep says which steps were not compared."""
        self.reference, self.first_step_n = reference, first_step_n
        self.trace, self.result = Trace(), Lockstep(expect_grads=grads)

    def step(self, loss, grads: dict | None = None) -> None:
        loss = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        step = len(self.trace.loss)
        self.trace.loss.append(loss)
        if self.reference is None:
            self.trace.grads.append(None if grads is None else {n: g.detach().clone() for n, g in grads.items()})
            return
        self.result.loss.append(loss)
        self.result.loss_diff.append(abs(loss - self.reference.loss[step]))
        expected = self.reference.grads[step] if step < len(self.reference.grads) else None
        if grads is None:
            self.result.no_grads.append(step)
        if grads is None or expected is None:  # (a reference may keep gradients on one rank only: compared there)
            self.result.grad_diff.append(math.nan)
            self.result.grads_close.append(None)
            return
        diff, close = _difference(grads, expected, tolerance.TRAINING_GRAD_TOL, relative=True)
        self.result.grad_diff.append(diff)
        self.result.grads_close.append(close)
        if step == 0 and self.first_step_n is not None:
            self.result.first_step = tolerance.compare_all(grads, expected, n=self.first_step_n)

    def finish(self, weights: dict | None = None) -> Trace | Lockstep:
        if self.reference is None:
            self.trace.weights = None if weights is None else {n: w.detach().clone() for n, w in weights.items()}
            return self.trace
        # The reference may be recorded beside this run (in the same loop): its length is known only now.
        self.result.reference_steps = len(self.reference.loss)
        self.result.expect_weights = self.reference.weights is not None
        if weights is not None and self.reference.weights is not None:
            self.result.weight_diff, self.result.weights_close = _difference(
                weights, self.reference.weights, tolerance.ADAM_WEIGHTS_ATOL, relative=False)
        return self.result


def compare(run: Trace, reference: Trace, *, first_step_n: int | None = None) -> Lockstep:
    """Two recorded Traces (both brought back to one process), compared as a Recorder compares as it goes
    (gradients where `run` has them: a Trace of losses and weights compares those)."""
    recorder = Recorder(reference, first_step_n=first_step_n, grads=any(g is not None for g in run.grads))
    for loss, grads in zip(run.loss, run.grads + [None] * (len(run.loss) - len(run.grads))):
        recorder.step(loss, grads)
    return recorder.finish(run.weights)


def combine(runs: list) -> Lockstep:
    """Locksteps of the ranks of one run, each over the parameters its rank holds (pipeline stages, experts), as
    one over the whole model: at every step the worst rank, and what any rank did not compare."""
    return Lockstep(loss=runs[0].loss,
                    loss_diff=[max(d) for d in zip(*(r.loss_diff for r in runs))],
                    grad_diff=[max(d) for d in zip(*(r.grad_diff for r in runs))],
                    grads_close=[None if None in c else all(c) for c in zip(*(r.grads_close for r in runs))],
                    weight_diff=max((r.weight_diff for r in runs if r.weight_diff is not None), default=None),
                    weights_close=None if any(r.weights_close is None for r in runs) else
                    all(r.weights_close for r in runs),
                    first_step=None, reference_steps=min(r.reference_steps for r in runs),
                    expect_grads=any(r.expect_grads for r in runs), expect_weights=any(r.expect_weights for r in runs),
                    no_grads=sorted({step for r in runs for step in r.no_grads}))


def _difference(actual: dict, expected: dict, tol: float, *, relative: bool) -> tuple[float, bool]:
    """The largest absolute difference over every tensor of `expected` (by name), and whether every element
    is within `tol` (absolute, plus `tol` relative with `relative`). A missing name is infinitely far."""
    if set(actual) != set(expected):
        return math.inf, False
    worst, close = 0.0, True
    for name, e in expected.items():
        a = actual[name].detach().to(e.device, e.dtype)
        if a.shape != e.shape:
            return math.inf, False
        worst = max(worst, (a - e).abs().max().item() if e.numel() else 0.0)
        close = close and torch.allclose(a, e, rtol=tol if relative else 0.0, atol=tol)
    return worst, close


def figure(runs: dict, reference: Trace, *, title: str = ""):
    """Left: every run's loss on the reference's curve; right: each run's largest gradient difference per
    step (log scale), beside the tolerance. `runs` maps a label to a Lockstep. Returns the figure (a
    chapter adds its caption, picotron_course.notebook.caption)."""
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_grad) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax_loss.plot(reference.loss, "k-", lw=4, alpha=0.25, label="one process")
    for i, (label, run) in enumerate(runs.items()):
        ax_loss.plot(run.loss, "o", ms=3, color=f"C{i}", label=label)
        shown = [max(d, 1e-10) if not math.isnan(d) else math.nan for d in run.grad_diff]
        ax_grad.semilogy(shown, "o-", ms=3, color=f"C{i}", label=label)
    ax_grad.axhline(tolerance.TRAINING_GRAD_TOL, color="C3", ls=":", lw=1.5,
                    label=f"tolerance {tolerance.TRAINING_GRAD_TOL:g}")
    ax_loss.set(xlabel="step", ylabel="loss (nats per token)", title=f"Loss{': ' + title if title else ''}")
    ax_grad.set(xlabel="step", ylabel="max |gradient difference|", title="Full gradients vs one process, every step")
    ax_loss.legend(fontsize=7)
    ax_grad.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    return fig

"""picotron.lockstep: the one comparison behind every "N ranks train like one process" proof.

The parallel runs themselves are proven in each technique's tests; here the comparison is shown to pass
what is equal and to fail, naming the step and the quantity, what is not (each tolerance of the policy).
"""

import math

import pytest
import torch

from picotron import tolerance
from picotron.lockstep import Lockstep, Recorder, Trace, compare, figure

STEPS = 4


def train(reference: Trace | None = None, *, nudge: dict | None = None, first_step_n: int | None = None,
          gradients_on: tuple = tuple(range(STEPS))):
    """A tiny linear model trained with AdamW; `nudge` = {"loss" | "grad" | "weight": (step, amount)} plants
    a difference of that size in what is recorded."""
    nudge = nudge or {}
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    record = Recorder(reference, first_step_n=first_step_n)
    for step in range(STEPS):
        x = torch.randn(16, 8, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if nudge.get("loss", (None,))[0] == step:
            loss = loss + nudge["loss"][1]
        if nudge.get("grad", (None,))[0] == step:
            grads["weight"][0, 0] += nudge["grad"][1]
        record.step(loss, grads if step in gradients_on else None)
        optimizer.step()
        optimizer.zero_grad()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if "weight" in nudge:
        weights["bias"][0] += nudge["weight"][1]
    return record.finish(weights)


@pytest.fixture(scope="module")
def reference() -> Trace:
    return train()


def test_the_same_run_is_equal_step_by_step(reference):
    result = train(reference, first_step_n=8)
    assert isinstance(reference, Trace) and isinstance(result, Lockstep)
    assert result.ok and result.failures() == []
    assert result.loss_diff == [0.0] * STEPS and result.grad_diff == [0.0] * STEPS
    assert result.grads_close == [True] * STEPS and result.weight_diff == 0.0 and result.weights_close
    assert result.first_step.ok
    result.assert_equal()


@pytest.mark.parametrize("nudge, message", [
    ({"loss": (2, 3 * tolerance.LOSS_ATOL)}, "step 2: loss differs by 3e-05 (tolerance 1e-05)"),
    ({"grad": (1, 1e-3)}, "step 1: gradients differ by up to 0.001 (tolerance rtol = atol = 1e-05)"),
    ({"weight": (0, 1e-3)}, "final weights differ by up to 0.001 (tolerance 0.0001)"),
])
def test_a_difference_past_its_tolerance_is_named_with_its_step(reference, nudge, message):
    result = train(reference, nudge=nudge)
    assert not result.ok and result.failures() == [message]
    with pytest.raises(AssertionError, match="does not train like one process"):
        result.assert_equal()


def test_a_difference_within_tolerance_passes(reference):
    assert train(reference, nudge={"loss": (0, tolerance.LOSS_ATOL / 2), "grad": (0, 1e-7)}).ok


def test_the_first_step_is_held_to_the_rounding_bound(reference):
    # 1e-6 is within the training tolerance (1e-5) but far past the rounding of 8 sums in fp32
    result = train(reference, nudge={"grad": (0, 1e-6)}, first_step_n=8)
    assert result.grads_close[0] and not result.first_step.ok
    assert [line.split(":")[0] for line in result.failures()] == ["step 0 (equal weights, rounding alone)"]


def test_a_step_without_gradients_is_not_compared(reference):
    result = train(reference, gradients_on=(0, 2))
    assert result.grads_close == [True, None, True, None] and math.isnan(result.grad_diff[1]) and result.ok


def test_two_traces_compare_as_the_recorder_does(reference):
    nudged = train(nudge={"grad": (3, 1e-3)})
    assert compare(nudged, reference).failures() == train(reference, nudge={"grad": (3, 1e-3)}).failures()


def test_the_figure_draws_every_run(reference):
    import matplotlib
    matplotlib.use("Agg")
    fig = figure({"same": train(reference), "nudged": train(reference, nudge={"grad": (1, 1e-3)})}, reference)
    loss_axis, grad_axis = fig.axes
    assert [line.get_label() for line in loss_axis.lines] == ["one process", "same", "nudged"]
    assert grad_axis.lines[-1].get_ydata()[0] == tolerance.TRAINING_GRAD_TOL

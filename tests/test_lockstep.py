"""picotron.lockstep: the one comparison behind every "N ranks train like one process" proof.

The parallel runs themselves are proven in each technique's tests; here the comparison is shown to pass
what is equal and to fail, naming the step and the quantity, what is not (each tolerance of the policy).
"""

import math

import pytest
import torch

from picotron import tolerance
from picotron.lockstep import Lockstep, Recorder, Trace, combine, compare, figure

STEPS = 4


def train(reference: Trace | None = None, *, nudge: dict | None = None, first_step_n: int | None = None,
          gradients_on: tuple = tuple(range(STEPS)), grads: bool = True, steps: int = STEPS, weights: bool = True):
    """A tiny linear model trained with AdamW; `nudge` = {"loss" | "grad" | "weight": (step, amount)} plants
    a difference of that size in what is recorded."""
    nudge = nudge or {}
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    record = Recorder(reference, first_step_n=first_step_n, grads=grads)
    for step in range(steps):
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
    weights = {n: p.detach().clone() for n, p in model.named_parameters()} if weights else {}
    if "weight" in nudge:
        weights["bias"][0] += nudge["weight"][1]
    return record.finish(weights if weights else None)


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


def test_what_was_not_compared_fails(reference):
    """A proof that silently skipped its gradients, its weights or its last steps would prove nothing."""
    assert train(reference, gradients_on=(0, 2)).failures() == [
        "steps [1, 3]: no gradients were compared (Recorder.step got none)"]
    assert train(reference, weights=False).failures() == [
        "the final weights were not compared (Recorder.finish got none)"]
    short = train(reference, steps=STEPS - 1).failures()
    assert short[0] == f"the run recorded {STEPS - 1} steps, the reference {STEPS}"


def test_a_run_without_gradients_says_so_and_compares_the_rest(reference):
    result = train(reference, gradients_on=(), grads=False)
    assert result.grads_close == [None] * STEPS and math.isnan(result.grad_diff[1]) and result.ok
    assert not train(reference, gradients_on=(), grads=False, nudge={"loss": (1, 1e-3)}).ok


def test_a_trace_restricted_to_some_parameters_compares_those_only(reference):
    """What a pipeline stage does: compare the parameters it holds against the reference's, by name."""
    stage = reference.only({"bias"})
    assert list(stage.weights) == ["bias"] and all(list(g) == ["bias"] for g in stage.grads)

    def replay(names):
        record = Recorder(stage)
        for step in range(STEPS):
            record.step(reference.loss[step], {n: reference.grads[step][n] for n in names})
        return record.finish({n: reference.weights[n] for n in names})

    assert replay(["bias"]).ok
    assert not replay(["bias", "weight"]).ok   # a parameter the stage should not hold is a difference too


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


def test_ranks_holding_parts_combine_into_one_run(reference):
    """Pipeline stages (or expert groups) each compare what they hold; the run is the worst of them at each step."""
    stages = [train(reference, nudge={"grad": (2, 1e-3)}), train(reference), train(reference, weights=False)]
    whole = combine(stages)
    assert whole.grad_diff[2] == pytest.approx(1e-3, rel=1e-3) and whole.grads_close == [True, True, False, True]
    assert whole.weights_close is None and sorted(line.split(":")[0] for line in whole.failures()) == [
        "step 2", "the final weights were not compared (Recorder.finish got none)"]

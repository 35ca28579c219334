"""The checks of assignment 01 pass a correct answer and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. Each wrong answer is
a mistake a learner makes; its check must fail and say what the mistake is.
"""

import pytest
import torch

from picotron.config import ModelConfig
from picotron_course import checks_memory
from picotron_course.checks_memory import (SavedStorages, check_activation_bytes, check_checkpoint_plan,
                                           check_num_params, check_recompute, measure_plan)


# ---- correct answers -------------------------------------------------------------------------
def ref_num_params(config):
    h, d, layers = config.hidden_size, config.head_dim, config.num_layers
    q_and_o = 2 * h * config.num_attention_heads * d
    k_and_v = 2 * h * config.num_key_value_heads * d
    per_layer = q_and_o + k_and_v + 3 * h * config.intermediate_size + 2 * h
    vocab = config.vocab_size * h
    return layers * per_layer + (vocab if config.tie_word_embeddings else 2 * vocab) + h


def ref_activation_bytes(config, batch, seq, dtype_bytes=4):
    a, t = dtype_bytes, batch * seq
    h, d, f = config.hidden_size, config.head_dim, config.intermediate_size
    n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
    norms = 2 * ((4 + 2 * a) * t * h + 4 * t)
    attention = a * t * d * (2 * n_q + 2 * n_kv)
    if config.attention == "sdpa":
        attention += 4 * batch * n_q * seq
    else:
        attention += 2 * a * t * (n_q - n_kv) * d + a * batch * n_q * seq * seq
    return norms + attention + 4 * a * t * f


class RefRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)  # autograd.Function.forward runs without recording a graph

    @staticmethod
    def backward(ctx, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        torch.autograd.backward(out, grad_output)
        return None, *(t.grad for t in inputs)


def ref_recompute(fn, *inputs):
    return RefRecompute.apply(fn, *inputs)


def ref_peak_saved_bytes(config, batch, seq, recomputed):
    layer, inputs = ref_activation_bytes(config, batch, seq), 4 * batch * seq * config.hidden_size
    kept = [inputs if i in recomputed else layer for i in range(config.num_layers)]
    spikes = [sum(kept[:i]) + layer for i in recomputed]  # in fp32 the input is one of the layer's own saves
    return max([sum(kept), *spikes])


def ref_checkpoint_plan(config, batch, seq, budget):
    for k in range(config.num_layers):  # the lowest layers first; the last layer never helps
        if ref_peak_saved_bytes(config, batch, seq, range(k)) <= budget:
            return list(range(k))
    raise ValueError(f"no plan fits in {budget} bytes")


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"num_params": 13, "activation_bytes_per_layer": 12, "recompute": 4, "checkpoint_plan": 37}


@pytest.mark.parametrize("check, answer", [(check_num_params, (ref_num_params,)),
                                           (check_activation_bytes, (ref_activation_bytes,)),
                                           (check_recompute, (ref_recompute,)),
                                           (check_recompute, (RefRecompute,)),
                                           (check_checkpoint_plan, (ref_peak_saved_bytes, ref_checkpoint_plan))],
                         ids=["num_params", "activation_bytes", "recompute", "recompute_class", "checkpoint_plan"])
def test_correct_answer_passes(check, answer, every_case):
    check(*answer)
    every_case(CASES)


def test_checks_cover_the_cases_they_promise():
    """Every preset tied and untied; GQA, MHA, MQA and head_dim != hidden/heads; fp32 and bf16."""
    configs = [c for _, c in checks_memory.PARAM_SHAPES]
    assert {(c.vocab_size, c.hidden_size, c.tie_word_embeddings) for c in configs} >= \
           {(ModelConfig.preset(n).vocab_size, ModelConfig.preset(n).hidden_size, tie)
            for n in ("tiny", "smollm-135m", "llama3-8b") for tie in (True, False)}
    for kinds in (configs, list(checks_memory.ACTIVATION_SHAPES.values())):
        ratios = {c.num_attention_heads // c.num_key_value_heads for c in kinds}
        assert 1 in ratios and len(ratios) >= 3  # MHA, GQA, MQA
        assert any(c.num_attention_heads * c.head_dim != c.hidden_size for c in kinds)
    assert {dtype for *_, dtype in checks_memory.ACTIVATION_CASES} == {torch.float32, torch.bfloat16}


def test_plan_measurement_sees_the_recomputation_in_backward():
    """The measured peak of the last layer alone recomputed is the peak without recomputation: the layer's
    activations come back, in backward, while the three below still hold theirs."""
    config, batch, seq = checks_memory.PLAN_SHAPES["sdpa GQA 4/2, 4 layers"]
    layer, inputs = ref_activation_bytes(config, batch, seq), 4 * batch * seq * config.hidden_size
    assert measure_plan(config, batch, seq, set()) == (4 * layer, 4 * layer)
    assert measure_plan(config, batch, seq, {3}) == (3 * layer + inputs, 4 * layer)
    assert measure_plan(config, batch, seq, {0, 1, 2, 3}) == (4 * inputs, 3 * inputs + layer)
    assert {c.attention for c, _, _ in checks_memory.PLAN_SHAPES.values()} == {"sdpa", "eager"}


def test_saved_storages_counts_each_storage_once_and_only_while_held():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedStorages() as saved:
        y = (x @ w) @ w  # w saved twice, x once, x @ w once
    assert saved.bytes() == 8 * 8 * 4 + 2 * 4 * 8 * 4  # w, x, x @ w
    assert saved.bytes(besides=[w]) == 2 * 4 * 8 * 4
    del y  # the graph goes, and with it x @ w; x itself is still held here
    assert saved.bytes(besides=[w]) == 4 * 8 * 4


# ---- planted wrong answers: the parameter count -----------------------------------------------
def np_no_final_norm(config):
    return ref_num_params(config) - config.hidden_size


def np_tied_twice(config):
    return ref_num_params(config) + (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)


def np_kv_as_wide_as_q(config):
    h, d = config.hidden_size, config.head_dim
    return ref_num_params(config) + config.num_layers * 2 * h * (config.num_attention_heads
                                                                 - config.num_key_value_heads) * d


def np_head_dim_from_hidden(config):
    wrong = ModelConfig(**{**config.__dict__, "head_dim": config.hidden_size // config.num_attention_heads})
    return ref_num_params(wrong)


def np_no_layer_norms(config):
    return ref_num_params(config) - 2 * config.num_layers * config.hidden_size


def np_float(config):
    return float(ref_num_params(config))


def np_asks_the_config(config):
    return config.num_params()


# ---- planted wrong answers: the activations ---------------------------------------------------
def act_no_probabilities(config, batch, seq, dtype_bytes=4):
    extra = dtype_bytes * batch * config.num_attention_heads * seq * seq if config.attention == "eager" else 0
    return ref_activation_bytes(config, batch, seq, dtype_bytes) - extra


def act_no_gqa_copies(config, batch, seq, dtype_bytes=4):
    copies = 2 * dtype_bytes * batch * seq * (config.num_attention_heads - config.num_key_value_heads) * config.head_dim
    return ref_activation_bytes(config, batch, seq, dtype_bytes) - (copies if config.attention == "eager" else 0)


def act_kv_as_wide_as_q(config, batch, seq, dtype_bytes=4):
    copies = 2 * dtype_bytes * batch * seq * (config.num_attention_heads - config.num_key_value_heads) * config.head_dim
    return ref_activation_bytes(config, batch, seq, dtype_bytes) + (copies if config.attention == "sdpa" else 0)


def act_no_logsumexp(config, batch, seq, dtype_bytes=4):
    lse = 4 * batch * config.num_attention_heads * seq if config.attention == "sdpa" else 0
    return ref_activation_bytes(config, batch, seq, dtype_bytes) - lse


def act_norm_input_in_activation_dtype(config, batch, seq, dtype_bytes=4):
    return ref_activation_bytes(config, batch, seq, dtype_bytes) - 2 * (4 - dtype_bytes) * batch * seq * \
        config.hidden_size


def act_ignores_dtype(config, batch, seq, dtype_bytes=4):
    return ref_activation_bytes(config, batch, seq, 4)


def act_three_mlp_tensors(config, batch, seq, dtype_bytes=4):
    return ref_activation_bytes(config, batch, seq, dtype_bytes) - dtype_bytes * batch * seq * config.intermediate_size


def act_asks_picotron(config, batch, seq, dtype_bytes=4):
    from picotron.costs import activation_bytes_per_layer as course_answer  # renamed: still caught
    return course_answer(config, batch, seq, dtype_bytes=dtype_bytes)


# ---- planted wrong answers: recomputation -------------------------------------------------------
class KeepsTheGraph(torch.autograd.Function):
    """Correct gradients, no memory saved: forward records fn's graph, backward goes through it."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            ctx.out = fn(*ctx.inputs)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        torch.autograd.backward(ctx.out, grad_output)
        return None, *(t.grad for t in ctx.inputs)


class SavesIntermediates(RefRecompute):
    """Recomputes in backward, but forward also kept its own graph alive."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.enable_grad():
            ctx.kept = fn(*[t.detach().requires_grad_(t.requires_grad) for t in inputs])
        return ctx.kept.detach()


class GradOfInputsOnly(RefRecompute):
    @staticmethod
    def backward(ctx, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_output))
        return None, *(next(grads) if t.requires_grad else None for t in inputs)


class NoEnableGrad(RefRecompute):
    @staticmethod
    def backward(ctx, grad_output):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        out = ctx.fn(*inputs)  # backward runs with grad mode off: no graph is recorded
        torch.autograd.backward(out, grad_output)
        return None, *(t.grad for t in inputs)


class NotDetached(RefRecompute):
    @staticmethod
    def backward(ctx, grad_output):
        inputs = ctx.saved_tensors  # still attached to the outer graph
        with torch.enable_grad():
            out = ctx.fn(*inputs)
        torch.autograd.backward(out, grad_output)
        return None, *(t.grad for t in inputs)


class ForgetsNoneForFn(RefRecompute):
    @staticmethod
    def backward(ctx, grad_output):
        grads = RefRecompute.backward(ctx, grad_output)
        return grads[1:]


def uses_torch_checkpoint(fn, *inputs):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(fn, *inputs, use_reentrant=False)


def uses_the_course_answer(fn, *inputs):
    from picotron.model import recompute
    return recompute(fn, *inputs)


# ---- planted wrong answers: the stretch, which layers to recompute -----------------------------------
def peak_end_of_forward(config, batch, seq, recomputed):
    """What the layers hold when forward ends: misses the layer rebuilt in backward."""
    layer, inputs = ref_activation_bytes(config, batch, seq), 4 * batch * seq * config.hidden_size
    return sum(inputs if i in recomputed else layer for i in range(config.num_layers))


def peak_inputs_free(config, batch, seq, recomputed):
    """A recomputed layer keeps nothing, not even its input."""
    layer = ref_activation_bytes(config, batch, seq)
    kept = [0 if i in recomputed else layer for i in range(config.num_layers)]
    return max([sum(kept), *(sum(kept[:i]) + layer for i in recomputed)])


def peak_input_twice(config, batch, seq, recomputed):
    """The recomputed layer's input counted besides its activations (in fp32 it is one of them)."""
    extra = 4 * batch * seq * config.hidden_size
    layer = ref_activation_bytes(config, batch, seq)
    kept = [extra if i in recomputed else layer for i in range(config.num_layers)]
    return max([sum(kept), *(sum(kept[:i]) + extra + layer for i in recomputed)])


def peak_asks_picotron(config, batch, seq, recomputed):
    from picotron.costs import activation_bytes_per_layer as layer_bytes  # renamed: still caught
    layer, inputs = layer_bytes(config, batch, seq), 4 * batch * seq * config.hidden_size
    kept = [inputs if i in recomputed else layer for i in range(config.num_layers)]
    return max([sum(kept), *(sum(kept[:i]) + layer for i in recomputed)])


def plan_top_layers(config, batch, seq, budget):
    """The right count, the wrong end: the last layers, rebuilt while all below still hold theirs."""
    plan = ref_checkpoint_plan(config, batch, seq, budget)
    return list(range(config.num_layers - len(plan), config.num_layers))


def plan_end_of_forward(config, batch, seq, budget):
    """Counts only what forward leaves, so it may recompute every layer, and picks too few."""
    for k in range(config.num_layers + 1):
        if peak_end_of_forward(config, batch, seq, range(k)) <= budget:
            return list(range(k))
    raise ValueError("no plan fits")


def plan_strictly_under(config, batch, seq, budget):
    """A plan that reaches the budget exactly fits; this one wants to stay below it."""
    return ref_checkpoint_plan(config, batch, seq, budget - 1)


def plan_none_when_nothing_fits(config, batch, seq, budget):
    try:
        return ref_checkpoint_plan(config, batch, seq, budget)
    except ValueError:
        return None


def plan_top_down(config, batch, seq, budget):
    return ref_checkpoint_plan(config, batch, seq, budget)[::-1]


def stretch(peak=ref_peak_saved_bytes, plan=ref_checkpoint_plan):
    """check_checkpoint_plan with one of the two functions wrong (the checks below call check(answer))."""
    def check(_):
        check_checkpoint_plan(peak, plan)
    return check


WRONG_ANSWERS = [
    (check_num_params, np_no_final_norm, "final RMSNorm is missing"),
    (check_num_params, np_tied_twice, "tied embedding is counted twice"),
    (check_num_params, np_kv_as_wide_as_q, "k_proj and v_proj are counted as wide as q_proj"),
    (check_num_params, np_head_dim_from_hidden, "head_dim is a field of the config"),
    (check_num_params, np_no_layer_norms, "RMSNorm weights of the layers are missing"),
    (check_num_params, np_float, "return an int"),
    (check_num_params, np_asks_the_config, "ModelConfig.num_params, which does this exercise for you"),
    (check_activation_bytes, act_no_probabilities, "softmax probabilities are missing"),
    (check_activation_bytes, act_no_gqa_copies, "copies of k and v are missing"),
    (check_activation_bytes, act_kv_as_wide_as_q, "sdpa reads them without copying"),
    (check_activation_bytes, act_no_logsumexp, "log-sum-exp is missing"),
    (check_activation_bytes, act_norm_input_in_activation_dtype, "RMSNorm computes in fp32"),
    (check_activation_bytes, act_ignores_dtype, "that is the fp32 count"),
    (check_activation_bytes, act_three_mlp_tensors, "SwiGLU keeps four"),
    (check_activation_bytes, act_asks_picotron, "picotron.costs, which does this exercise for you"),
    (check_recompute, KeepsTheGraph, "forward must run fn without recording a graph"),
    (check_recompute, SavesIntermediates, "forward must run fn without recording a graph"),
    (check_recompute, GradOfInputsOnly, "got no gradient"),
    (check_recompute, NoEnableGrad, r"torch.enable_grad\(\)"),
    (check_recompute, NotDetached, "detach the saved inputs"),
    (check_recompute, ForgetsNoneForFn, "None for fn"),
    (check_recompute, uses_torch_checkpoint, "torch.utils.checkpoint, which does this exercise for you"),
    (check_recompute, uses_the_course_answer, "picotron.model.recompute, which does this exercise for you"),
    (stretch(peak=peak_end_of_forward), peak_end_of_forward, "peak comes later, in backward"),
    (stretch(peak=peak_inputs_free), peak_inputs_free, "a recomputed layer still keeps its input"),
    (stretch(peak=peak_input_twice), peak_input_twice, "its input is one of the tensors it saves"),
    (stretch(peak=peak_asks_picotron), peak_asks_picotron, "picotron.costs, which does this exercise for you"),
    (stretch(plan=plan_top_layers), plan_top_layers, "peaks at .* B in backward, over the budget"),
    (stretch(plan=plan_end_of_forward), plan_end_of_forward, "peaks at .* B in backward, over the budget"),
    (stretch(plan=plan_strictly_under), plan_strictly_under, "suffice"),
    (stretch(plan=plan_none_when_nothing_fits), plan_none_when_nothing_fits, "raise ValueError, do not return None"),
    (stretch(plan=plan_top_down), plan_top_down, "in increasing order"),
]
REFUSED = (np_asks_the_config, act_asks_picotron, uses_torch_checkpoint, uses_the_course_answer, peak_asks_picotron)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # NotDetached's
@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    if answer not in REFUSED:  # refused before the table is printed
        assert "FAIL" in capsys.readouterr().out


def test_a_wrong_row_leaves_the_right_ones_passing(capsys):
    """Counting a tied embedding twice is wrong exactly where the embedding is tied."""
    with pytest.raises(AssertionError):
        check_num_params(np_tied_twice)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith((" ok", " FAIL"))]
    assert len(rows) == len(checks_memory.PARAM_SHAPES)
    for (_, config), row in zip(checks_memory.PARAM_SHAPES, rows):
        assert row.endswith("FAIL") == config.tie_word_embeddings, row


def test_unsolved_exercise_goes_through_as_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError("stub: write this part")

    class StubRecompute(RefRecompute):
        @staticmethod
        def backward(ctx, grad_output):
            raise NotImplementedError("backward: write this part")

    for check, answer in ((check_num_params, stub), (check_activation_bytes, stub), (check_recompute, stub),
                          (check_recompute, StubRecompute), (stretch(peak=stub), None), (stretch(plan=stub), None)):
        with pytest.raises(NotImplementedError):
            check(answer)

"""The checks of assignment 01 pass a correct answer and refuse the course's own.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. The wrong answers
are the checks' misconceptions, each failing with its hint (tests/test_misconceptions.py).
"""

import pytest
import torch

from picotron.config import ModelConfig
from picotron_course import checks_memory
from picotron_course.checks_memory import (RECOMPUTE, SavedStorages, check_activation_bytes, check_checkpoint_plan,
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


# ---- answers refused, a mistake no misconception describes, and a row the others leave passing ----------------
# The planted wrong answers are the checks' misconceptions (checks_memory.py), tested in test_misconceptions.py.
def np_asks_the_config(config):
    return config.num_params()


def act_asks_picotron(config, batch, seq, dtype_bytes=4):
    from picotron.costs import activation_bytes_per_layer as course_answer  # renamed: still caught
    return course_answer(config, batch, seq, dtype_bytes=dtype_bytes)


def uses_torch_checkpoint(fn, *inputs):
    from torch.utils.checkpoint import checkpoint
    return checkpoint(fn, *inputs, use_reentrant=False)


def uses_the_course_answer(fn, *inputs):
    from picotron.model import recompute
    return recompute(fn, *inputs)


def peak_asks_picotron(config, batch, seq, recomputed):
    from picotron.costs import activation_bytes_per_layer as layer_bytes  # renamed: still caught
    return config.num_layers * layer_bytes(config, batch, seq)


def stretch(peak=ref_peak_saved_bytes, plan=ref_checkpoint_plan):
    """check_checkpoint_plan with one of the two functions given (the tests below call check(answer))."""
    return lambda _: check_checkpoint_plan(peak, plan)


REFUSED = [(check_num_params, np_asks_the_config, "ModelConfig.num_params, which does this exercise for you"),
           (check_activation_bytes, act_asks_picotron, "picotron.costs, which does this exercise for you"),
           (check_recompute, uses_torch_checkpoint, "torch.utils.checkpoint, which does this exercise for you"),
           (check_recompute, uses_the_course_answer, "picotron.model.recompute, which does this exercise for you"),
           (stretch(peak=peak_asks_picotron), None, "peak_saved_bytes called picotron.costs, which does this")]


@pytest.mark.parametrize("check, answer, says", REFUSED, ids=["num_params", "activation_bytes", "torch_checkpoint",
                                                              "course_recompute", "peak"])
def test_the_course_answer_is_refused(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


class SavesIntermediates(RefRecompute):   # recomputes in backward, but forward kept its own graph alive as well
    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        with torch.enable_grad():
            ctx.kept = fn(*[t.detach().requires_grad_(t.requires_grad) for t in inputs])
        return ctx.kept.detach()


def test_a_graph_kept_besides_the_recomputation_gets_the_kept_graph_hint():
    hint = next(m.hint for m in RECOMPUTE.misconceptions if m.answer.__name__ == "KeepsTheGraph")
    with pytest.raises(AssertionError) as error:
        check_recompute(SavesIntermediates)
    assert str(error.value).endswith(f"Hint: {hint}")


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    with pytest.raises(AssertionError, match=r"the parameters counted .*expected \d+, got \d+") as error:
        check_num_params(lambda config: ref_num_params(config) + 7)   # off by 7: no mistake a record makes
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


def np_tied_twice(config):
    return ref_num_params(config) + (config.vocab_size * config.hidden_size if config.tie_word_embeddings else 0)


def test_a_wrong_row_leaves_the_right_ones_passing(capsys):
    """Counting a tied embedding twice is wrong exactly where the embedding is tied."""
    with pytest.raises(AssertionError, match="the tied embedding is counted twice"):
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

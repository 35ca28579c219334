"""Memory: the formula equals what a real (or fake) training step keeps; recomputation and
gradient accumulation change memory, never the gradients."""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig, validate
from picotron.memory import (MemoryTracker, activation_bytes, activation_bytes_per_layer, estimate_memory,
                             measure_memory, num_param_tensors, saved_tensors, training_flops_per_token)
from picotron.model import DecoderLayer, Llama, loss_fn
from picotron.train import flops_per_token

TINY = ModelConfig()   # 4 layers, h=128, GQA 4/2 heads, vocab 256: about 1M parameters
# The only bytes the formula leaves out: the loss scalar and cross-entropy's total weight, 4 B each.
RESIDUAL_BYTES = 8


def grads_of(config: ModelConfig, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    model = Llama(config)
    loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


# ---- parameters, gradients, optimizer state: equal to the byte ----------------------------------
@pytest.mark.parametrize("name, precision, fake", [("tiny", "fp32", False), ("tiny", "bf16-mixed", False),
                                                   ("smollm-135m", "fp32", True), ("llama3-8b", "bf16-mixed", True)])
def test_state_bytes_equal_the_formula(name, precision, fake):
    config = ModelConfig.preset(name)
    measured = measure_memory(config, 1, 32, precision=precision, fake=fake).measured
    formula = estimate_memory(config, TrainConfig(micro_batch_size=1, seq_len=32), precision=precision)
    assert (measured.parameters, measured.gradients, measured.optimizer) == \
           (formula.parameters, formula.gradients, formula.optimizer)
    state = formula.parameters + formula.gradients + formula.optimizer
    step_counters = 4 * (9 * config.num_layers + 2 + (not config.tie_word_embeddings))   # fp32, one per tensor
    assert state == 16 * config.num_params() + step_counters     # 4+4+8 and 2+2+12 bytes per parameter


# ---- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("batch, seq", [(1, 16), (4, 96)])
def test_activation_formula_matches_a_real_step(attention, recompute, batch, seq):
    config = dataclasses.replace(TINY, attention=attention, recompute=recompute)
    measured = measure_memory(config, batch, seq, steps=1).measured.activations
    assert measured - activation_bytes(config, batch, seq) == RESIDUAL_BYTES


@pytest.mark.parametrize("attention, recompute", [("sdpa", "none"), ("eager", "none"), ("eager", "selective"),
                                                  ("sdpa", "full")])
def test_activation_formula_on_the_llama3_8b_shape(attention, recompute):
    # Two of its 32 layers, bf16, under FakeTensorMode: the CPU kernels' shapes, no memory used.
    config = dataclasses.replace(ModelConfig.preset("llama3-8b"), num_layers=2, attention=attention,
                                 recompute=recompute)
    measured = measure_memory(config, 1, 1024, precision="bf16-mixed", steps=1, fake=True).measured.activations
    formula = activation_bytes(config, 1, 1024, dtype_bytes=2)
    assert measured == pytest.approx(formula, rel=1e-6)   # far inside the 10%


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_saved_tensors_of_one_layer_sum_to_the_per_layer_formula(attention):
    config = dataclasses.replace(TINY, attention=attention)
    torch.manual_seed(0)
    model = Llama(config)
    x = torch.randn(2, 24, config.hidden_size, requires_grad=True)
    cos, sin = model.rope(torch.arange(24)[None])
    out = model.layers[0](x, cos, sin)
    rows = saved_tensors(out, exclude=[*model.parameters(), cos, sin])
    # Leaves out the 0-dim scale factor 1/sqrt(head_dim) that eager's division keeps (8 bytes).
    unique = {row.storage: row.nbytes for row in rows if row.shape != ()}
    assert sum(unique.values()) == activation_bytes_per_layer(config, 2, 24)


# ---- the tracker ---------------------------------------------------------------------------------
def test_tracker_counts_new_storages_not_views_and_sees_frees():
    a = torch.randn(64, 32)
    with MemoryTracker() as tracker:
        b = a @ a.T                      # new: 64*64*4 bytes
        view = b.t()[:10]                # a view: nothing new
        b.add_(1)                        # in place: nothing new
        assert tracker.live_bytes == 64 * 64 * 4
        c = torch.ones(1000)             # new: 4000 bytes
        del b, view, c
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 64 * 64 * 4 + 4000
    assert [blk.died is not None for blk in tracker.blocks] == [True, True]


def test_timeline_has_optimizer_state_only_after_the_first_step():
    tracker = measure_memory(TINY, 2, 32, steps=2).tracker
    series = tracker.timeline()
    first_optimizer = next(event for event, phase in tracker.phases if phase == "optimizer")
    assert max(series["optimizer state"][:first_optimizer]) == 0
    assert series["optimizer state"][-1] > 0 and series["activations"][-1] == 0
    assert max(series["activations"]) > 0 and max(series["gradients"]) > 0


# ---- recomputation -------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recomputation_gives_identical_gradients(attention):
    ids = torch.randint(0, TINY.vocab_size, (2, 49))
    ref_loss, ref = grads_of(dataclasses.replace(TINY, attention=attention), ids)
    for recompute in ("selective", "full"):
        loss, grads = grads_of(dataclasses.replace(TINY, attention=attention, recompute=recompute), ids)
        assert_close(loss, ref_loss, rtol=0, atol=0)
        for name in ref:
            assert_close(grads[name], ref[name], rtol=0, atol=1e-6, msg=f"{recompute} {name}")


def test_eager_attention_equals_sdpa():
    ids = torch.randint(0, TINY.vocab_size, (2, 33))
    sdpa_loss, sdpa = grads_of(TINY, ids)
    eager_loss, eager = grads_of(dataclasses.replace(TINY, attention="eager"), ids)
    assert_close(eager_loss, sdpa_loss, rtol=1e-6, atol=1e-6)
    for name in sdpa:
        assert_close(eager[name], sdpa[name], rtol=1e-5, atol=1e-6)


def test_recomputation_lowers_measured_activations():
    measured = {(a, r): measure_memory(dataclasses.replace(TINY, attention=a, recompute=r), 4, 128,
                                       steps=1).measured.activations
                for a in ("sdpa", "eager") for r in ("none", "selective", "full")}
    assert measured["eager", "selective"] < 0.9 * measured["eager", "none"]     # the s^2 probabilities go
    assert measured["sdpa", "selective"] < measured["sdpa", "none"]             # only the log-sum-exp goes
    assert measured["eager", "selective"] == measured["sdpa", "selective"]
    assert measured["sdpa", "full"] < 0.15 * measured["sdpa", "none"]


def test_recomputation_flops():
    seq, config = 1024, ModelConfig.preset("llama3-8b")
    base = flops_per_token(config, seq)
    selective = training_flops_per_token(dataclasses.replace(config, recompute="selective"), seq)
    full = training_flops_per_token(dataclasses.replace(config, recompute="full"), seq)
    assert selective - base == 4 * config.num_layers * config.hidden_size * seq   # one more QK^T and AV
    assert full / base == pytest.approx(8 / 6, rel=0.05)                        # about one more forward


# ---- gradient accumulation -----------------------------------------------------------------------
def test_gradient_accumulation_equals_one_big_batch():
    ids = torch.randint(0, TINY.vocab_size, (8, 33))
    _, big = grads_of(TINY, ids)
    torch.manual_seed(0)
    model = Llama(TINY)
    for chunk in ids.chunk(4):
        (loss_fn(model(chunk[:, :-1]), chunk[:, 1:]) / 4).backward()   # mean of means = mean over all
    for name, p in model.named_parameters():
        assert_close(p.grad, big[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_accumulation_memory_is_flat_in_micro_batches():
    peaks = [measure_memory(TINY, 2, 64, micro_batches=k).peak for k in (2, 4, 8)]
    assert max(peaks) == min(peaks)
    one = measure_memory(TINY, 2, 64, micro_batches=1).peak
    # With one micro-batch, no gradient is alive during forward: the peak is lower by at most the gradients.
    assert 0 <= peaks[0] - one <= estimate_memory(TINY, TrainConfig()).gradients


# ---- errors --------------------------------------------------------------------------------------
def test_bad_choices_are_refused_with_the_options():
    with pytest.raises(ValueError, match="selective"):
        Llama(dataclasses.replace(TINY, recompute="some"))
    with pytest.raises(ValueError, match="eager"):
        validate(Config(model=dataclasses.replace(TINY, attention="flash")))
    with pytest.raises(ValueError, match="bf16-mixed"):
        estimate_memory(TINY, TrainConfig(), precision="fp16")
    with pytest.raises(NotImplementedError, match="chapter 04"):
        estimate_memory(TINY, TrainConfig(), ParallelConfig(tp=2))
    assert estimate_memory(TINY, TrainConfig(), ParallelConfig(dp=4)) == estimate_memory(TINY, TrainConfig())


# ---- ZeRO: which terms each stage divides by the dp ranks ----------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_zero_stages_shard_the_playbooks_terms(precision):
    config, train, n = ModelConfig.preset("llama3-8b"), TrainConfig(micro_batch_size=1, seq_len=4096), 8
    whole = estimate_memory(config, train, precision=precision)
    stages = [estimate_memory(config, train, ParallelConfig(dp=n, zero_stage=s), precision=precision)
              for s in range(4)]
    shard = lambda nbytes: -(-nbytes // n)
    assert stages[0] == whole
    assert (stages[1].parameters, stages[1].gradients, stages[1].optimizer) == \
           (whole.parameters, whole.gradients, shard(whole.optimizer))
    assert (stages[2].parameters, stages[2].gradients, stages[2].optimizer) == \
           (whole.parameters, shard(whole.gradients), shard(whole.optimizer))
    assert (stages[3].parameters, stages[3].gradients, stages[3].optimizer) == \
           (shard(whole.parameters), shard(whole.gradients), shard(whole.optimizer))
    assert all(s.activations == whole.activations for s in stages)     # each rank's own micro-batch
    # The Playbook's numbers for an 8B model on 8 ranks in bf16-mixed: 16 -> 4 + 2 + 1.5 -> 2 bytes per parameter.
    if precision == "bf16-mixed":
        psi = config.num_params()
        per_param = [(s.parameters + s.gradients + s.optimizer) / psi for s in stages]
        assert per_param == pytest.approx([16, 2 + 2 + 12 / 8, 2 + 2 / 8 + 12 / 8, 16 / 8], rel=1e-6)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_estimate_is_picotrons_exact_bytes_up_to_padding_and_counters(stage):
    from picotron.parallel.zero import zero_state_bytes
    from picotron.parallel.zero3 import llama_units
    units = llama_units(Llama(TINY))
    numels = ([TINY.num_params()] if stage < 3 else
              [sum(p.numel() for p in dict.fromkeys(p for m in unit for p in m.parameters())) for unit in units])
    exact = zero_state_bytes(numels, 4, stage, "bf16-mixed")
    estimate = estimate_memory(TINY, TrainConfig(), ParallelConfig(dp=4, zero_stage=stage), precision="bf16-mixed")
    # Padding: under 4 elements of <= 16 bytes per group. Counters: 4 bytes per tensor here, per group there.
    margin = 16 * 4 * len(numels) + 4 * num_param_tensors(TINY)
    assert abs(estimate.parameters - exact.parameters) <= margin
    assert abs(estimate.gradients - exact.gradients) <= margin
    assert abs(estimate.optimizer - exact.optimizer) <= margin


def test_bad_zero_stage_is_refused():
    with pytest.raises(ValueError, match=r"zero_stage=5; choose 0 \(plain data parallelism\)"):
        estimate_memory(TINY, TrainConfig(), ParallelConfig(dp=4, zero_stage=5))
    with pytest.raises(ValueError, match="zero_stage=-1"):
        validate(Config(parallel=ParallelConfig(zero_stage=-1)))

"""Memory: the formula equals what a real (or fake) training step keeps; recomputation and
gradient accumulation change memory, never the gradients."""

import dataclasses

import pytest
import torch
from torch.testing import assert_close

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.layout import validate
from picotron.memory import estimate_memory, num_param_tensors
from picotron.memory_tracking import MemoryTracker, measure_memory, saved_tensors, step_peaks
from picotron.costs import activation_bytes, activation_bytes_per_layer, training_flops_per_token
from picotron.model import DecoderLayer, Llama, loss_fn
from picotron.tolerance import LOSS_ATOL, compare_all, llama_roundings
from picotron.costs import flops_per_token

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


def test_first_steps_peak_rises_by_exactly_the_lazy_adamw_state():
    # Activations (4 x 128 tokens) outweigh the state, so each step peaks early in backward; AdamW makes its
    # state in step 1's optimizer step, so steps 2 and 3 peak higher by exactly the formula's optimizer bytes.
    run = measure_memory(TINY, 4, 128, steps=3)
    formula = estimate_memory(TINY, TrainConfig(micro_batch_size=4, seq_len=128))
    peaks = step_peaks(run.tracker.timeline(), run.tracker.step_starts)
    assert len(peaks) == 3 and peaks[1] == peaks[2] == peaks[0] + formula.optimizer


def test_gradients_kept_between_steps_raise_the_later_peaks_but_not_the_first():
    freed, kept = (measure_memory(TINY, 4, 128, steps=2, set_to_none=flag) for flag in (True, False))
    first = [step_peaks(run.tracker.timeline(), run.tracker.step_starts) for run in (freed, kept)]
    assert first[0][0] == first[1][0]                          # step 1: no gradient exists yet either way
    assert first[0][1] < first[1][1] <= first[0][1] + freed.measured.gradients
    gradients = kept.tracker.timeline()["gradients"]
    assert gradients[kept.tracker.step_starts[1] + 1] == kept.measured.gradients   # alive into step 2's forward


def test_step_peaks_refuses_starts_outside_the_timeline():
    with pytest.raises(ValueError, match="must be events of the timeline"):
        step_peaks({"activations": [0, 5, 2]}, [0, 3])


# ---- recomputation -------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_recomputation_gives_identical_gradients(attention):
    ids = torch.randint(0, TINY.vocab_size, (2, 49))
    ref_loss, ref = grads_of(dataclasses.replace(TINY, attention=attention), ids)
    for recompute in ("selective", "full"):
        loss, grads = grads_of(dataclasses.replace(TINY, attention=attention, recompute=recompute), ids)
        assert_close(loss, ref_loss, rtol=0, atol=0)
        # The same ops again inside backward; gradients may add up in another order (picotron.tolerance).
        within = compare_all(grads, ref, n=llama_roundings(TINY, 48, 2 * 48))
        assert within, f"{recompute}: {within}"


def test_eager_attention_equals_sdpa():
    ids = torch.randint(0, TINY.vocab_size, (2, 33))
    sdpa_loss, sdpa = grads_of(TINY, ids)
    eager_loss, eager = grads_of(dataclasses.replace(TINY, attention="eager"), ids)
    assert abs(eager_loss - sdpa_loss) < LOSS_ATOL                      # the course's claim for fp32 losses
    within = compare_all(eager, sdpa, n=llama_roundings(TINY, 32, 2 * 32))   # float32 round-off (picotron.tolerance)
    assert within, str(within)


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
    # The same sums over 8 x 32 tokens, in 4 parts: float32 round-off (picotron.tolerance).
    within = compare_all({n: p.grad for n, p in model.named_parameters()}, big, n=llama_roundings(TINY, 32, 8 * 32) + 4)
    assert within, str(within)


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
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        estimate_memory(TINY, TrainConfig(), ParallelConfig(tp=3))
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


# ---- per rank under 5D parallelism: the formula against a real run of the trainer ------------------
# Each case: the trainer on 4 CPU ranks for two steps; every rank counts the parameters, gradients and
# optimizer state it holds (ZeRO: its state_bytes) and the peak of the activations saved for backward.
RANK_CASES = {
    "dp4": dict(dp=4), "dp4 zero1": dict(dp=4, zero_stage=1), "dp4 zero2": dict(dp=4, zero_stage=2),
    "dp4 zero3": dict(dp=4, zero_stage=3), "dp2 tp2": dict(dp=2, tp=2),
    "dp2 tp2 sp": dict(dp=2, tp=2, sequence_parallel=True),
    "dp2 cp2": dict(dp=2, cp=2), "cp2 tp2 sp": dict(cp=2, tp=2, sequence_parallel=True),
    "dp2 cp2 ulysses": dict(dp=2, cp=2, cp_mode="ulysses"), "dp2 pp2 1f1b": dict(dp=2, pp=2),
    "pp4 afab": dict(pp=4, pp_schedule="afab"), "dp2 pp2 interleaved": dict(dp=2, pp=2, pp_schedule="interleaved",
                                                                          pp_virtual_stages=2),
    "dp4 ep2": dict(dp=4, ep=2), "dp4 ep4": dict(dp=4, ep=4),
    # axes composed: pipeline with tp and SP, with cp, with ZeRO-1 and ZeRO-2; ZeRO with tp; tp with ep
    "tp2 pp2 sp": dict(tp=2, pp=2, sequence_parallel=True), "cp2 pp2": dict(cp=2, pp=2),
    "dp2 pp2 zero1": dict(dp=2, pp=2, zero_stage=1), "dp2 pp2 zero2 untied": dict(dp=2, pp=2, zero_stage=2),
    "dp2 tp2 zero2 sp": dict(dp=2, tp=2, zero_stage=2, sequence_parallel=True), "dp2 tp2 ep2": dict(dp=2, tp=2, ep=2)}
RANK_MODEL = ModelConfig(num_layers=4, num_attention_heads=4, num_key_value_heads=2, max_seq_len=64)


def rank_config(name: str) -> Config:
    parallel = ParallelConfig(**RANK_CASES[name])
    model = dataclasses.replace(ModelConfig.preset("tiny-moe"), max_seq_len=64) if parallel.ep > 1 else RANK_MODEL
    if "untied" in name:                                  # ZeRO-2 with pp needs an untied head (layout.validate)
        model = dataclasses.replace(model, tie_word_embeddings=False)
    return Config(model=model, parallel=parallel,
                  train=TrainConfig(precision="fp32", steps=2, micro_batch_size=2, seq_len=32,
                                    grad_accum_steps=4 if parallel.pp > 1 else 1))


def measure_rank(name: str) -> dict:
    """This rank's state bytes after a step, and its peak saved activations during the second step."""
    import torch.distributed as dist
    from picotron.memory_tracking import SavedActivations, optimizer_state, tensor_bytes
    from picotron.mesh import Mesh
    from picotron.parallel.pipeline_parallel import stage_parameters
    from picotron.train import Trainer
    config = rank_config(name)
    p = config.parallel
    mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)
    trainer = Trainer(config, mesh)
    trainer.train_step(0)
    with SavedActivations() as saved:
        trainer.train_step(1)
    if getattr(trainer, "zero", None):
        state = trainer.zero.state_bytes()
        state = (state.parameters, state.gradients, state.optimizer)
    else:
        stages = getattr(trainer, "stages", None)
        params = stage_parameters(stages) if stages else list(trainer.model.parameters())
        state = (tensor_bytes(params), tensor_bytes(q.grad for q in params),
                 tensor_bytes(optimizer_state(trainer.optimizer)))
    received = [sum(moe.last_splits[1]) for moe in trainer.model.moe_layers()] if p.ep > 1 else []
    return {"pp_rank": mesh.pp_rank, "state": state, "activations": saved.peak, "received": received,
            "zero numels": trainer.zero.numels if getattr(trainer, "zero", None) else None,
            "world": dist.get_world_size()}


@pytest.fixture(scope="module")
def rank_measurements() -> dict:
    from picotron.launch import run
    return run(lambda: {name: measure_rank(name) for name in RANK_CASES}, 4, timeout=600)


def trainer_residual(config: Config, in_flight: int) -> int:
    """Saved bytes a trainer step keeps that the formula leaves out, per micro-batch in flight: the trainer
    passes every row's positions, so RoPE's cos/sin rows come b times (the formula counts one shared row),
    and the hooks also see the input ids and targets the loss and embedding save (int64, never allocated
    by the forward pass that MemoryTracker watches)."""
    t, m = config.train, config.model
    rope = (t.micro_batch_size - 1) * 2 * (t.seq_len // config.parallel.cp) * m.head_dim * 4
    return in_flight * (rope + 16 * t.micro_batch_size * t.seq_len // config.parallel.cp)


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_state_bytes_per_rank_equal_the_trainers(name, rank_measurements):
    """Parameters, gradients, optimizer state on every rank: exact without ZeRO; with ZeRO the Playbook's
    rule is within padding and step counters of picotron's exact zero_state_bytes (which is exact)."""
    from picotron.parallel.zero import zero_state_bytes
    config = rank_config(name)
    p = config.parallel
    for rank in rank_measurements:
        measured = rank[name]
        formula = estimate_memory(config.model, config.train, p, pp_rank=measured["pp_rank"])
        estimate = (formula.parameters, formula.gradients, formula.optimizer)
        if not p.zero_stage:
            assert measured["state"] == estimate, (name, measured["state"], estimate)
            continue
        exact = zero_state_bytes(measured["zero numels"], p.dp * p.cp, p.zero_stage)
        assert measured["state"] == (exact.parameters, exact.gradients, exact.optimizer)
        groups = len(measured["zero numels"])
        margin = 4 * (p.dp * groups + num_param_tensors(config.model))     # padding < N elements a group; counters
        assert all(abs(e - m) <= margin for e, m in zip(estimate, measured["state"])), (estimate, measured["state"])


@pytest.mark.parametrize("name", [n for n in RANK_CASES if "ep" not in n])
def test_saved_activations_per_rank_equal_the_formula(name, rank_measurements):
    """The peak of what autograd keeps, across the micro-batches a pipeline schedule holds: the formula plus
    the trainer's per-row RoPE tables and saved token ids, within 0.2% (a few bytes of scalars and masks)."""
    from picotron.parallel.pipeline_schedules import make_schedule, peak_in_flight
    config = rank_config(name)
    p = config.parallel
    in_flight = (peak_in_flight(make_schedule(p.pp_schedule, p.pp, config.train.grad_accum_steps, p.pp_virtual_stages))
                 if p.pp > 1 else [1])
    for rank in rank_measurements:
        measured, r = rank[name]["activations"], rank[name]["pp_rank"]
        formula = estimate_memory(config.model, config.train, p, pp_rank=r).activations
        explained = formula + trainer_residual(config, in_flight[r])
        assert abs(measured - explained) <= 0.002 * formula, (name, r, measured, formula, explained)


@pytest.mark.parametrize("name", ["dp4 ep2", "dp4 ep4", "dp2 tp2 ep2"])
def test_moe_activations_per_rank_follow_the_rows_each_rank_received(name, rank_measurements):
    """Expert parallelism: a rank's experts compute the rows the router sent them, which vary from rank to
    rank; with each layer's measured rows the formula is the measurement (balanced, it is their mean)."""
    from picotron.memory import moe_activation_bytes
    config = rank_config(name)
    model, t, p = config.model, config.train, config.parallel
    tokens = t.micro_batch_size * t.seq_len
    balanced = estimate_memory(model, t, p).activations
    for rank in rank_measurements:
        rows = rank[name]["received"]
        exact = balanced + sum(moe_activation_bytes(model, tokens, p.ep, received_rows=r)
                               - moe_activation_bytes(model, tokens, p.ep) for r in rows)
        explained = exact + trainer_residual(config, 1)
        assert abs(rank[name]["activations"] - explained) <= 0.002 * balanced, (rank[name]["activations"], explained)
    mean_rows = sum(sum(rank[name]["received"]) for rank in rank_measurements) / len(rank_measurements)
    assert mean_rows == model.num_moe_layers * tokens * model.experts_per_token   # every slot lands somewhere


def test_moe_layer_saved_tensors_equal_the_formula():
    from picotron.memory import moe_activation_bytes
    config = ModelConfig.preset("tiny-moe")
    torch.manual_seed(0)
    model = Llama(config)
    x = torch.randn(2, 24, config.hidden_size, requires_grad=True)
    cos, sin = model.rope(torch.arange(24)[None])
    out = model.layers[0](x, cos, sin) + model.layers[0].mlp.aux_loss        # the aux loss joins every step
    rows = saved_tensors(out, exclude=[*model.parameters(), cos, sin])
    unique = {row.storage: row.nbytes for row in rows}
    dense_part = activation_bytes_per_layer(config, 2, 24) - 4 * 4 * 48 * config.intermediate_size
    assert sum(unique.values()) == dense_part + moe_activation_bytes(config, 48)


# ---- per rank: what each axis divides -----------------------------------------------------------
def test_one_rank_is_the_whole_model():
    from picotron.memory import parameters_on_rank
    for name in ("tiny", "tiny-moe", "llama3-8b"):
        config = ModelConfig.preset(name)
        owned = parameters_on_rank(config, ParallelConfig())
        assert owned.total == config.num_params()
        if name != "llama3-8b":                                    # small enough to build: count its tensors
            assert owned.tensors == num_param_tensors(config) == len(list(Llama(config).parameters()))


def test_pipeline_stages_hold_the_model_once_plus_the_tied_copy():
    from picotron.memory import parameters_on_rank
    for tied in (True, False):
        config = dataclasses.replace(ModelConfig(num_layers=6), tie_word_embeddings=tied)
        for pp, v in ((2, 1), (3, 1), (2, 3)):
            parallel = ParallelConfig(pp=pp, pp_schedule="interleaved" if v > 1 else "1f1b", pp_virtual_stages=v)
            total = sum(parameters_on_rank(config, parallel, r).total for r in range(pp))
            copy = config.vocab_size * config.hidden_size if tied else 0
            assert total == config.num_params() + copy


def test_tensor_parallel_divides_everything_but_the_norms():
    from picotron.memory import parameters_on_rank
    config = ModelConfig.preset("llama3-8b")
    norms = (2 * config.num_layers + 1) * config.hidden_size
    for tp in (2, 4, 8):
        owned = parameters_on_rank(config, ParallelConfig(tp=tp))
        assert owned.total == (config.num_params() - norms) // tp + norms


def test_experts_split_over_ep_and_zero_over_their_replicas():
    from picotron.memory import parameters_on_rank, state_bytes_on_rank
    config = ModelConfig.preset("tiny-moe")
    expert = config.num_layers * config.num_experts * 3 * config.hidden_size * config.intermediate_size
    for ep in (1, 2, 4, 8):
        owned = parameters_on_rank(config, ParallelConfig(dp=8, ep=ep))
        assert owned.expert == expert // ep and owned.dense == config.num_params() - expert
    # ZeRO-1 over dp=8 (validate refuses ep with ZeRO in the trainer, so the rule is shown on state_bytes_on_rank):
    # dense optimizer state / 8, an expert's over the 8/ep ranks holding it.
    parallel = ParallelConfig(dp=8, ep=2, zero_stage=1)
    owned = parameters_on_rank(config, parallel)
    _, _, optimizer = state_bytes_on_rank(config, parallel, precision="bf16-mixed")
    assert optimizer == -(-(12 * owned.dense + 4 * owned.tensors) // 8) + -(-(12 * owned.expert) // 4)


def test_context_parallel_divides_the_activations_not_the_state():
    config, train = ModelConfig.preset("llama3-8b"), TrainConfig(micro_batch_size=1, seq_len=8192)
    whole = estimate_memory(config, train, precision="bf16-mixed")
    for cp in (2, 4, 8):
        split = estimate_memory(config, train, ParallelConfig(cp=cp), precision="bf16-mixed")
        assert (split.parameters, split.gradients, split.optimizer) == \
            (whole.parameters, whole.gradients, whole.optimizer)
        assert split.activations == pytest.approx(whole.activations / cp, rel=0.01)
    zero = estimate_memory(config, train, ParallelConfig(dp=2, cp=4, zero_stage=1), precision="bf16-mixed")
    assert zero.optimizer == -(-whole.optimizer // 8)                  # ZeRO shards over dp x cp


def test_tp_and_cp_together_compose_their_formulas():
    from picotron.memory import dense_layer_activation_bytes
    from picotron.parallel.context_parallel_costs import cp_activation_bytes_per_layer
    from picotron.parallel.tensor_parallel_costs import tp_activation_bytes_per_layer
    config = ModelConfig(num_attention_heads=8, num_key_value_heads=4)
    for recompute in ("none", "selective", "full"):
        c = dataclasses.replace(config, recompute=recompute)
        assert dense_layer_activation_bytes(c, 2, 64, ParallelConfig(tp=2, cp=1)) == \
            tp_activation_bytes_per_layer(c, 2, 64, 2)
        assert dense_layer_activation_bytes(c, 2, 64, ParallelConfig(tp=1, cp=2)) == \
            cp_activation_bytes_per_layer(c, 2, 64, 2, "zigzag")
        both = dense_layer_activation_bytes(c, 2, 64, ParallelConfig(tp=2, cp=2, sequence_parallel=True))
        assert both < dense_layer_activation_bytes(c, 2, 64, ParallelConfig(tp=2, sequence_parallel=True))


def test_pipeline_activations_grow_with_the_micro_batches_in_flight():
    config = ModelConfig(num_layers=8)
    one = estimate_memory(config, TrainConfig(micro_batch_size=1, grad_accum_steps=8), ParallelConfig(pp=4), pp_rank=1)
    afab = estimate_memory(config, TrainConfig(micro_batch_size=1, grad_accum_steps=8),
                           ParallelConfig(pp=4, pp_schedule="afab"), pp_rank=1)
    assert afab.activations == one.activations * 8 // 3        # AFAB: all 8 micro-batches; 1F1B: p - r = 3
    per_stage = [estimate_memory(config, TrainConfig(grad_accum_steps=8), ParallelConfig(pp=4), pp_rank=r).activations
                 for r in range(4)]
    assert per_stage[0] > per_stage[1] > per_stage[2] and estimate_memory(
        config, TrainConfig(grad_accum_steps=8), ParallelConfig(pp=4)).activations == per_stage[0]


def test_layouts_picotron_refuses_are_refused():
    with pytest.raises(ValueError, match="pp_rank=4"):
        estimate_memory(TINY, TrainConfig(), ParallelConfig(pp=2), pp_rank=4)
    with pytest.raises(ValueError, match="zero_stage=3 with pp"):
        estimate_memory(TINY, TrainConfig(grad_accum_steps=4), ParallelConfig(pp=2, dp=2, zero_stage=3))
    with pytest.raises(ValueError, match="ep=3 does not divide dp=4"):
        estimate_memory(ModelConfig.preset("tiny-moe"), TrainConfig(), ParallelConfig(dp=4, ep=3))


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_long_accumulation_keeps_the_warm_up_peak(schedule, v):
    """estimate_memory walks only the first 2 p v micro-batches of a schedule: the peak in flight is reached
    in the warm-up, and the timeline of a longer accumulation only replaces freed sets."""
    from picotron.memory import peak_bytes_in_flight
    from picotron.parallel.pipeline_schedules import make_schedule, peak_in_flight
    pp = 4
    weights = {s: 1000 + 7 * s for s in range(pp * v)}               # chunks of different sizes
    short, long = (make_schedule(schedule, pp, k * pp * v, v) for k in (2, 6))
    assert peak_in_flight(short) == peak_in_flight(long)
    frees = "W" if short.split_backward else "B"
    for rank in range(pp):
        assert peak_bytes_in_flight(short.actions[rank], weights, frees) == \
            peak_bytes_in_flight(long.actions[rank], weights, frees)
    config = ModelConfig(num_layers=8)
    parallel = ParallelConfig(pp=pp, pp_schedule=schedule, pp_virtual_stages=v)
    assert estimate_memory(config, TrainConfig(grad_accum_steps=6 * pp * v), parallel) == \
        estimate_memory(config, TrainConfig(grad_accum_steps=2 * pp * v), parallel)

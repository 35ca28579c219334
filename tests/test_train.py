"""The trainer: dp ranks equal one process on the same global batch; the command line works."""

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

from picotron import checkpoint, lockstep
from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.layout import validate
from picotron.launch import run
from picotron.mesh import Mesh
from picotron.model import Llama
from picotron.parallel.tensor_parallel import gather_along, gather_parameters
from picotron.parallel.zero3 import Zero3
from picotron.tolerance import LOSS_ATOL
from picotron.train import Trainer, lr_at, main, train
from picotron.train_cli import parse_args
from picotron.costs import flops_per_token

SMALL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=64)


def record(config: Config, steps: int, reference: lockstep.Trace | None = None) -> tuple:
    """Train `steps` steps, recorded by picotron.lockstep: each step's loss and gradients (after the all-reduce
    every dp rank holds them whole), the final weights. One process (no `reference`) gives its Trace; a rank its
    Lockstep against `reference`, compared in the rank. Beside it, the windows each step saw."""
    mesh = Mesh(dp=config.parallel.dp) if dist.is_initialized() else None
    trainer = Trainer(config, mesh)
    recorder, samples = lockstep.Recorder(reference), []
    for step in range(steps):
        result = trainer.train_step(step)
        recorder.step(result.loss, {n: p.grad for n, p in trainer.model.named_parameters()})
        samples.append(result.sample_ids)
    return recorder.finish(dict(trainer.model.named_parameters())), samples


@pytest.mark.parametrize("dp, accum, steps, bucket_mb, recompute", [
    (4, 1, 20, 25.0, "none"),      # one bucket: the tiny model's gradients are 4 MB
    (2, 2, 10, 25.0, "none"),      # gradient accumulation: no_sync, then one all-reduce per step
    (2, 2, 6, 0.05, "selective"),  # many buckets, and a recomputed attention core
])
def test_data_parallel_equals_one_process(dp, accum, steps, bucket_mb, recompute):
    model = dataclasses.replace(SMALL, recompute=recompute)
    train = TrainConfig(precision="fp32", micro_batch_size=2, grad_accum_steps=accum, seq_len=32, steps=steps,
                        warmup_steps=3, bucket_mb=bucket_mb)
    parallel = Config(model=model, parallel=ParallelConfig(dp=dp), train=train)
    single = Config(model=SMALL, train=dataclasses.replace(train, micro_batch_size=2 * dp))

    # The one process runs where the ranks run: here it would take the GPU, which the gloo ranks leave alone.
    [(reference, windows)] = run(record, 1, args=(single, steps), timeout=120, backend="gloo")
    ranks = run(record, dp, args=(parallel, steps, reference), timeout=120, backend="gloo")

    for rank, (result, _) in enumerate(ranks):   # every rank: the global loss and the gradients of every step,
        result.assert_equal(f"rank {rank} of dp={dp}")   # the weights after them
    for step in range(steps):
        # The ranks saw different windows, and together exactly the single process's batch.
        seen = [samples[step] for _, samples in ranks]
        assert len({tuple(s) for s in seen}) == dp
        together = [i for m in range(accum) for rank in seen for i in rank[m * 2:(m + 1) * 2]]
        assert together == windows[step]
    assert reference.loss[-1] < reference.loss[0] - 0.5  # and it learned something


def assert_trains_like_one_process(ranks: list[dict], reference: dict, steps: int) -> None:
    """Every rank's loss at every step and its final weights (picotron.lockstep, of the two runs' Traces), its
    clipped gradient norm at every step and its evaluation equal one process's (record_losses on both sides)."""
    for r, rank in enumerate(ranks):
        lockstep.compare(rank["trace"], reference["trace"]).assert_equal(f"rank {r}")
        assert_grad_norms_equal(rank, reference, steps)
        assert rank["digits"] == reference["digits"]


def assert_grad_norms_equal(rank: dict, reference: dict, steps: int) -> None:
    """The clipped gradient's norm, every step, within 1e-5 relative: these layouts' trainer keeps no whole
    gradient to compare, but its norm counts every element once over the whole mesh."""
    for step in range(steps):
        assert abs(rank["grad_norm"][step] - reference["grad_norm"][step]) < 1e-5 * reference["grad_norm"][step]


def record_losses(config: Config, steps: int) -> dict:
    """Train `steps` steps; return the "trace" (picotron.lockstep: the losses and the whole weights at the end,
    which ZeRO-3 and tensor parallelism gather), the gradient norms and the held-out digit accuracy."""
    p = config.parallel
    mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp) if dist.is_initialized() else None
    trainer = Trainer(config, mesh)
    results = [trainer.train_step(step) for step in range(steps)]
    digits = trainer.accuracy(16)["digits"]   # under pp this first gives every rank every stage's weights
    if isinstance(trainer.zero, Zero3):   # each rank keeps 1/N of every (tp-local) weight: gather them
        weights = trainer.zero.gather_parameters()
        if mesh.tp_size > 1:
            shard_dims = {n: getattr(q, "tp_shard_dim", None) for n, q in trainer.model.named_parameters()}
            weights = {n: w if shard_dims[n] is None else gather_along(w.contiguous(), shard_dims[n], mesh.tp_group)
                       for n, w in weights.items()}
    elif mesh and mesh.tp_size > 1:     # (under pp, accuracy() gave every rank every stage's weights)
        weights = gather_parameters(trainer.model, mesh.tp_group)
    else:
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"trace": lockstep.Trace(loss=[r.loss for r in results], weights=weights),
            "grad_norm": [r.grad_norm for r in results], "kind": type(trainer.zero or trainer.dp).__name__,
            "digits": digits}


@pytest.mark.parametrize("dp, pp, schedule, accum, virtual", [
    (2, 2, "1f1b", 4, 1), (1, 4, "zb-h1", 4, 1), (1, 2, "interleaved", 4, 2), (2, 2, "afab", 2, 1)])
def test_pipeline_parallel_equals_one_process(dp, pp, schedule, accum, virtual):
    """dp x pp ranks, the step's micro-batches run by the schedule: loss, clipped gradient norm (the tied
    embedding counted once) and weights equal one process's; evaluation gathers every stage's weights."""
    steps, model = 5, dataclasses.replace(SMALL, num_layers=4)
    train = TrainConfig(precision="fp32", micro_batch_size=2, grad_accum_steps=accum, seq_len=32, steps=steps,
                        warmup_steps=2, grad_clip=0.5)
    parallel = Config(model=model, parallel=ParallelConfig(dp=dp, pp=pp, pp_schedule=schedule,
                                                           pp_virtual_stages=virtual), train=train)
    single = Config(model=model, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp * pp, args=(parallel, steps), timeout=120)
    reference = record_losses(single, steps)
    assert min(reference["grad_norm"]) > 0.5     # clipping was active: the norm over the stages matters
    assert_trains_like_one_process(ranks, reference, steps)


@pytest.mark.parametrize("zero_stage, dp, accum", [(3, 4, 1), (2, 2, 2)])
def test_zero_equals_one_process(zero_stage, dp, accum):
    steps = 6
    train = TrainConfig(precision="fp32", micro_batch_size=2, grad_accum_steps=accum, seq_len=32, steps=steps,
                        warmup_steps=3)
    parallel = Config(model=SMALL, parallel=ParallelConfig(dp=dp, zero_stage=zero_stage), train=train)
    single = Config(model=SMALL, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp, args=(parallel, steps), timeout=120)
    reference = record_losses(single, steps)
    assert ranks[0]["kind"] == ("Zero3" if zero_stage == 3 else "ZeroOptimizer")
    for r, rank in enumerate(ranks):   # the loss of every step, the gathered weights after them
        lockstep.compare(rank["trace"], reference["trace"]).assert_equal(f"rank {r}, ZeRO-{zero_stage}")


@pytest.mark.parametrize("dp, tp, sequence_parallel", [(2, 2, False), (2, 2, True)])
def test_tensor_parallel_equals_one_process(dp, tp, sequence_parallel):
    """dp x tp ranks: the loss, the clipped gradient's norm and the weights equal one process's; so does
    the accuracy evaluation, which all-gathers the vocabulary slices (and pads the sequence under SP)."""
    steps = 6
    train = TrainConfig(precision="fp32", micro_batch_size=2, seq_len=32, steps=steps, warmup_steps=3, grad_clip=0.5)
    parallel = Config(model=SMALL, parallel=ParallelConfig(dp=dp, tp=tp, sequence_parallel=sequence_parallel),
                      train=train)
    single = Config(model=SMALL, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp * tp, args=(parallel, steps), timeout=120)
    reference = record_losses(single, steps)
    assert min(reference["grad_norm"]) > 0.5     # clipping was active at every step: the norm matters
    assert_trains_like_one_process(ranks, reference, steps)


@pytest.mark.parametrize("dp, cp, tp, cp_mode, more", [
    (1, 2, 1, "ulysses", dict(grad_accum_steps=2)),   # gradient accumulation: no_sync over the cp ranks too
    (2, 2, 1, "zigzag", {}),
    (2, 2, 1, "ring", dict(zero_stage=1)),            # ZeRO shards the state over the dp x cp ranks
    (1, 2, 2, "zigzag", dict(sequence_parallel=True)),
], ids=["cp2-ulysses-accum", "dp2-cp2-zigzag", "dp2-cp2-ring-zero1", "cp2-tp2-sp-zigzag"])
def test_context_parallel_equals_one_process(dp, cp, tp, cp_mode, more):
    """dp x cp (x tp) ranks, each cp rank holding part of every sequence: the loss (the mean over all tokens),
    the clipped gradient's norm and the weights equal one process's; the accuracy evaluation, which runs
    whole prompts of any length on every rank, too."""
    steps = 6
    accum = more.pop("grad_accum_steps", 1)
    train = TrainConfig(precision="fp32", micro_batch_size=2, grad_accum_steps=accum, seq_len=32, steps=steps,
                        warmup_steps=3, grad_clip=0.5)
    parallel = Config(model=SMALL, parallel=ParallelConfig(dp=dp, cp=cp, tp=tp, cp_mode=cp_mode, **more), train=train)
    single = Config(model=SMALL, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp * cp * tp, args=(parallel, steps), timeout=120)
    reference = record_losses(single, steps)
    assert min(reference["grad_norm"]) > 0.5     # clipping was active at every step: the norm matters
    assert_trains_like_one_process(ranks, reference, steps)


@pytest.mark.parametrize("dp, ep, tp", [(2, 2, 1), (4, 2, 1), (2, 2, 2)])
def test_expert_parallel_equals_one_process(dp, ep, tp):
    """An MoE model with its experts split over groups of ep dp ranks (and its attention over tp ranks):
    loss, clipped gradient norm and weights equal one process's (the balancing loss too: its load
    statistics cover the global batch)."""
    steps = 4
    model = dataclasses.replace(SMALL, num_experts=4, experts_per_token=2, moe_aux_loss_coef=0.05)
    train = TrainConfig(precision="fp32", micro_batch_size=2, seq_len=32, steps=steps, warmup_steps=2, grad_clip=0.5)
    parallel = Config(model=model, parallel=ParallelConfig(dp=dp, ep=ep, tp=tp), train=train)
    single = Config(model=model, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp * tp, args=(parallel, steps), timeout=120)
    reference = record_losses(single, steps)
    for r, rank in enumerate(ranks):   # every step's loss; the weights this rank holds (its experts and the rest)
        lockstep.compare(rank["trace"], reference["trace"].only(rank["trace"].weights)).assert_equal(f"rank {r}")
        assert_grad_norms_equal(rank, reference, steps)
    whole = {name for rank in ranks[:ep * tp:tp] for name in rank["trace"].weights}   # the first ep group
    assert whole == reference["trace"].weights.keys()            # its ranks hold every expert between them
    assert all(rank["digits"] == reference["digits"] for rank in ranks)


@pytest.mark.parametrize("dp, pp, cp, tp, more", [
    (2, 2, 1, 2, {}),                                             # the 8 ranks: dp2 x pp2 x tp2
    (1, 2, 2, 2, dict(sequence_parallel=True, cp_mode="ring")),   # pp x cp x tp+SP: what travels is seq/cp/tp
    (2, 2, 1, 1, dict(zero_stage=1, pp_schedule="zb-h1")),        # ZeRO-1 with pp, as DeepSeek-V3
    (2, 1, 1, 2, dict(zero_stage=2)),                             # ZeRO shards of tp shards
    (2, 1, 1, 2, dict(zero_stage=3)),
], ids=["dp2-pp2-tp2", "pp2-cp2-tp2-sp", "dp2-pp2-zero1-zbh1", "dp2-tp2-zero2", "dp2-tp2-zero3"])
def test_axes_compose_and_equal_one_process(dp, pp, cp, tp, more):
    """Several axes at once: the loss and the clipped gradient norm at every step (each gradient element
    counted once over the whole mesh), the final weights and the evaluation equal one process's."""
    steps = 10 if dp * pp * cp * tp == 8 and not more else 5
    model = dataclasses.replace(SMALL, num_layers=4)
    train = TrainConfig(precision="fp32", micro_batch_size=2, grad_accum_steps=2, seq_len=32, steps=steps,
                        warmup_steps=2, grad_clip=0.5)
    parallel = Config(model=model, parallel=ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, **more), train=train)
    single = Config(model=model, train=dataclasses.replace(train, micro_batch_size=2 * dp))
    ranks = run(record_losses, dp * pp * cp * tp, args=(parallel, steps), timeout=240)
    reference = record_losses(single, steps)
    assert min(reference["grad_norm"]) > 0.5     # clipping was active at every step: the norm matters
    assert_trains_like_one_process(ranks, reference, steps)


def test_moe_aux_loss_reaches_training_and_flops_count_active_experts():
    moe = dataclasses.replace(SMALL, num_experts=4, experts_per_token=2)
    train = TrainConfig(precision="fp32", micro_batch_size=2, seq_len=32, steps=1, warmup_steps=1)
    router_grads = []
    for coef in (0.0, 0.5):
        trainer = Trainer(Config(model=dataclasses.replace(moe, moe_aux_loss_coef=coef), train=train))
        trainer.train_step(0)
        router_grads.append(trainer.model.layers[0].mlp.router.weight.grad.clone())
    assert (router_grads[0] - router_grads[1]).abs().max() > 1e-6   # the balancing loss moved the router
    idle = 2 * 3 * moe.hidden_size * moe.intermediate_size * moe.num_layers    # 2 of 4 experts idle per token
    assert flops_per_token(moe, 32) == flops_per_token(SMALL, 32) + 6 * (moe.num_params() - SMALL.num_params() - idle)


def test_lr_schedule_and_flops():
    config = Config(train=TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, steps=110))
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)
    assert lr_at(110, config) == pytest.approx(0.1)
    model = ModelConfig.preset("llama3-8b")
    # 6N + 12 L h s at s=4096: 48.2e9 + 6.4e9 FLOPs per token
    assert flops_per_token(model, 4096) == 6 * 8_030_261_248 + 12 * 32 * 4096 * 4096


def test_command_line_overrides_and_config_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model": {"preset": "tiny", "num_layers": 2},
                                "parallel": {"dp": 2}, "train": {"steps": 7, "betas": [0.9, 0.99]}}))
    config = parse_args(["--config", str(path), "--lr", "1e-3", "--dp", "1"])
    assert config.model.num_layers == 2 and config.model.hidden_size == 128
    assert config.parallel.dp == 1 and config.train.steps == 7 and config.train.lr == 1e-3
    assert config.train.betas == (0.9, 0.99)
    assert parse_args([]).parallel.dp == 4  # the default main job: 4 data-parallel ranks
    config = parse_args(["--recompute", "full", "--attention", "eager", "--bucket-mb", "0"])
    assert (config.model.recompute, config.model.attention, config.train.bucket_mb) == ("full", "eager", 0.0)
    assert parse_args(["--zero", "3"]).parallel.zero_stage == 3 and parse_args([]).parallel.zero_stage == 0
    config = parse_args(["--dp", "1", "--cp", "2", "--cp-mode", "ring"])
    assert (config.parallel.cp, config.parallel.cp_mode) == (2, "ring")
    assert parse_args(["--cp", "2"]).parallel.cp_mode == "zigzag"   # balanced by default


def _args(*argv):
    return lambda: parse_args(list(argv))


def _from_file(text: str):
    """Config.from_json of a file bad.json holding `text`, written when the case runs."""
    def make():
        with tempfile.TemporaryDirectory() as folder:
            path = pathlib.Path(folder) / "bad.json"
            path.write_text(text)
            return Config.from_json(path)
    return make


MOE = ["--preset", "tiny-moe"]
# (what is wrong, how the config is built, the exception, the message it must contain). Each builds the config
# and runs validate() (what Trainer and `python -m picotron.train` run first).
BAD_CONFIGS = [
    ("tp-heads", _args("--dp", "1", "--tp", "3"), ValueError, "tp=3 does not divide num_attention_heads=4"),
    ("tp-vocab", lambda: Config(model=ModelConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                                                  intermediate_size=384), parallel=ParallelConfig(tp=3)),
     ValueError, "tp=3 does not divide vocab_size=256"),
    ("typo-field", lambda: Config.from_dict({"train": {"stpes": 3}}), ValueError, "unknown TrainConfig fields ['stpes']"),
    ("unknown-section", lambda: Config.from_dict({"optim": {}}), ValueError, "unknown config sections ['optim']"),
    ("unknown-preset", lambda: Config.from_dict({"model": {"preset": "gpt5"}}), ValueError, "unknown model preset 'gpt5'"),
    ("bucket", _args("--dp", "1", "--bucket-mb", "-1"), ValueError,
     "train.bucket_mb=-1.0 must be at least 0 (0: one all-reduce bucket per parameter)"),
    ("zero-stage", lambda: Config.from_dict({"parallel": {"zero_stage": 4}}), ValueError,
     "zero_stage=4; choose 0 (plain data parallelism), 1"),
    ("sp-without-tp", _args("--dp", "1", "--sp"), ValueError, "sequence_parallel=True needs tp > 1"),
    ("sp-seq", _args("--dp", "1", "--tp", "2", "--sp", "--seq-len", "31"), ValueError, "seq_len=31 does not divide by it"),
    ("sp-cp-seq", _args("--dp", "1", "--tp", "2", "--sp", "--cp", "2", "--cp-mode", "ring", "--seq-len", "34"),
     ValueError, "does not divide by it; choose a seq_len that is a multiple of 4"),
    ("interleaved-microbatches", _args("--dp", "1", "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages",
                                       "2", "--grad-accum-steps", "3"),
     ValueError, "grad_accum_steps=3 micro-batches do not divide by it"),
    ("virtual-stages", _args("--dp", "1", "--pp", "2", "--virtual-stages", "2"), ValueError,
     "pp_virtual_stages=2: use 1, or more with pp_schedule='interleaved'"),
    ("pp-layers", _args("--dp", "1", "--pp", "8"), ValueError,
     "pp=8 x virtual_stages=1 = 8 stages need at least 8 layers, but num_layers=4"),
    ("naive-microbatches", _args("--dp", "1", "--pp", "2", "--pp-schedule", "naive", "--grad-accum-steps", "2"),
     ValueError, "pp_schedule='naive' runs one batch per step"),
    ("ep-dense", _args("--dp", "2", "--ep", "2"), ValueError, "ep=2 needs a mixture-of-experts model"),
    ("ep-dp", _args(*MOE, "--ep", "3"), ValueError, "ep=3 does not divide dp=4"),
    ("cp-mode", lambda: Config.from_dict({"parallel": {"cp": 2, "cp_mode": "striped"}}), ValueError,
     "cp_mode='striped' is not a context-parallel mode; choose one of ('ring', 'zigzag', 'ulysses')"),
    ("zigzag-seq", _args("--dp", "1", "--cp", "4", "--seq-len", "36"), ValueError,
     "seq_len=36 does not split for cp_mode='zigzag' (zig-zag cuts it into 2*cp = 8 chunks); choose a seq_len "
     "that is a multiple of 8"),
    ("ulysses-heads", _args("--dp", "1", "--cp", "4", "--cp-mode", "ulysses"), ValueError,
     "cp=4 does not divide the 4 query and 2 key/value heads"),
    ("ulysses-tp-heads", _args("--dp", "1", "--tp", "2", "--cp", "2", "--cp-mode", "ulysses"), ValueError,
     "cp=2 does not divide the 2 query and 1 key/value heads per tp rank"),
    ("seq-len", _args("--dp", "1", "--seq-len", "512"), ValueError, "seq_len=512 is longer than max_seq_len=256"),
    ("zero3-pp", _args("--dp", "2", "--pp", "2", "--zero", "3"), ValueError,
     "zero_stage=3 with pp>1: ZeRO-3 all-gathers a layer's weights for every forward and backward"),
    ("zero2-pp-tied", _args("--dp", "2", "--pp", "2", "--zero", "2"), ValueError,
     "zero_stage=2 with pp>1 and tie_word_embeddings=True"),
    ("zero2-zbh1", _args("--dp", "2", "--pp", "2", "--zero", "2", "--pp-schedule", "zb-h1"), NotImplementedError,
     "zero_stage=2 with pp_schedule='zb-h1'"),
    ("moe-pp", _args(*MOE, "--dp", "2", "--pp", "2"), NotImplementedError, "pp=2 with an MoE model"),
    ("moe-sp", _args(*MOE, "--dp", "2", "--tp", "2", "--sp"), NotImplementedError,
     "sequence parallelism with an MoE model (tp=2, num_experts=8) is not written"),
    ("ep-zero", _args(*MOE, "--ep", "2", "--zero", "1"), NotImplementedError, "ep=2 with zero_stage=1 is not written"),
    ("negative-axis", _args("--dp", "0"), ValueError, "dp=0 must be at least 1"),
    ("model-choice", lambda: Config(model=ModelConfig(attention="flash")), ValueError,
     "attention='flash'; choose one of ('sdpa', 'eager')"),
    # Values out of range: each field's bound (picotron.config.AT_LEAST), before anything divides by it.
    ("seq-len-zero", _args("--dp", "1", "--seq-len", "0"), ValueError, "train.seq_len=0 must be at least 1"),
    ("seq-len-negative", _args("--dp", "1", "--seq-len", "-8"), ValueError, "train.seq_len=-8 must be at least 1"),
    ("micro-batch-zero", _args("--micro-batch-size", "0"), ValueError, "train.micro_batch_size=0 must be at least 1"),
    ("grad-accum-zero", _args("--grad-accum-steps", "0"), ValueError, "train.grad_accum_steps=0 must be at least 1"),
    ("steps-negative", _args("--steps", "-1"), ValueError, "train.steps=-1 must be at least 0 (0: train nothing)"),
    ("log-every-zero", _args("--log-every", "0"), ValueError, "train.log_every=0 must be at least 1"),
    ("ep-zero", _args("--ep", "0"), ValueError, "parallel.ep=0 must be at least 1 (1: no expert parallelism)"),
    ("vocab-zero", lambda: Config.from_dict({"model": {"vocab_size": 0}}), ValueError,
     "model.vocab_size=0 must be at least 1"),
    ("heads-zero", lambda: Config.from_dict({"model": {"num_attention_heads": 0}}), ValueError,
     "model.num_attention_heads=0 must be at least 1"),      # checked before hidden_size // heads
    # Values of the wrong type: each field's annotation (an int is not a bool, a float may be an int).
    ("json-str-for-int", lambda: Config.from_dict({"parallel": {"dp": "2"}}), ValueError,
     "parallel.dp='2' has type str; expected int (write 2, without quotes)"),
    ("json-bool-for-int", lambda: Config.from_dict({"train": {"steps": True}}), ValueError,
     "train.steps=True has type bool; expected int"),
    ("json-optional", lambda: Config.from_dict({"model": {"head_dim": "32"}}), ValueError,
     "model.head_dim='32' has type str; expected int | None (write 32, without quotes)"),
    ("json-betas", lambda: Config.from_dict({"train": {"betas": [0.9]}}), ValueError,
     "train.betas=[0.9] has type list; expected tuple[float, float]"),
    ("python-type", lambda: Config(parallel=ParallelConfig(tp="2")), ValueError,
     "parallel.tp='2' has type str; expected int"),
    # Config files: every message names the file.
    ("json-file-type", _from_file('{"parallel": {"dp": "2"}}'), ValueError,
     "bad.json: parallel.dp='2' has type str; expected int"),
    ("json-malformed", _from_file('{"parallel": {"dp": 2,}}'), ValueError,
     "bad.json is not valid JSON: Expecting property name enclosed in double quotes at line 1, column 23"),
    ("json-not-object", _from_file('[{"parallel": {"dp": 2}}]'), ValueError,
     "bad.json: the config is a JSON array, but it must be an object with the sections 'model', 'parallel'"),
    ("json-section-not-object", _from_file('{"train": 3}'), ValueError,
     "bad.json: section 'train' is a JSON number, but it must be an object of fields"),
    ("config-missing", _args("--config", "/nonexistent/picotron.json"), ValueError,
     "cannot read the config file /nonexistent/picotron.json"),
]


@pytest.mark.parametrize("make, error, message", [case[1:] for case in BAD_CONFIGS],
                         ids=[case[0] for case in BAD_CONFIGS])
def test_bad_configs_are_clear_errors(make, error, message):
    with pytest.raises(error, match=re.escape(message)):
        validate(make())


def test_bad_config_kinds_and_where_they_are_caught():
    assert len({case[0] for case in BAD_CONFIGS}) >= 15
    with pytest.raises(ValueError, match=re.escape("dp*pp*cp*tp = 2*2*1*2 = 8 but the world has 4 ranks; change "
                                                   "the sizes or launch 8 ranks")):
        validate(parse_args(["--dp", "2", "--pp", "2", "--tp", "2"]), world_size=4)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        Trainer(parse_args(["--dp", "1", "--tp", "3"]))          # the trainer validates before building anything
    for argv in (["--zero", "5"], ["--cp-mode", "striped"], ["--pp-schedule", "gpipe"]):
        with pytest.raises(SystemExit):                          # argparse: "invalid choice"
            parse_args(argv)
    validate(parse_args(["--dp", "1", "--cp", "4", "--cp-mode", "ring", "--seq-len", "36"]))   # 4 slices of 9


def _unwritable(tmp_path: pathlib.Path, kind: str) -> str:
    """A path that cannot be written: one under a plain file, or in a read-only directory."""
    if kind == "under-a-file":
        (tmp_path / "file.txt").write_text("")
        return str(tmp_path / "file.txt" / "out")
    (tmp_path / "read-only").mkdir(mode=0o555)
    return str(tmp_path / "read-only" / "out")


def _writes_into_read_only_dirs() -> bool:
    """Whether this process ignores directory permissions (root, with CAP_DAC_OVERRIDE)."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o555)
        try:
            open(os.path.join(folder, "probe"), "w").close()
            return True
        except OSError:
            return False
        finally:
            os.chmod(folder, 0o755)


@pytest.mark.parametrize("flag", ["--save-dir", "--log-file"])
@pytest.mark.parametrize("kind", ["under-a-file", pytest.param("read-only-dir", marks=pytest.mark.skipif(
    _writes_into_read_only_dirs(), reason="this process (root) writes into read-only directories"))])
def test_unwritable_outputs_fail_before_step_0(tmp_path, capsys, flag, kind):
    """--save-dir and --log-file are tried before any rank starts: a clean error, nothing trained."""
    path = _unwritable(tmp_path, kind)
    with pytest.raises(SystemExit) as exit_info:
        main(["--dp", "1", flag, path])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""      # no model was built, no step trained
    assert err.startswith(f"python -m picotron.train: error: {flag[2:].replace('-', '_')}={path!r} ({flag}) cannot "
                          f"be written: ") and err.count("\n") == 1
    # train() itself (as a notebook calls it) checks them before building the trainer, on every rank.
    field = {"--save-dir": "save_dir", "--log-file": "log_file"}[flag]
    with pytest.raises(ValueError, match=re.escape(f"{field}={path!r} ({flag}) cannot be written")):
        train(Config(train=TrainConfig(**{field: path})))


def test_a_world_size_torchrun_did_not_start_is_one_line_naming_dp(monkeypatch, capsys):
    """Under torchrun every process sees WORLD_SIZE: a config for another world stops before any group forms."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit) as stop:
        main(["--dp", "4", "--tp", "2", "--pp", "2", "--steps", "1"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "torchrun started 8 processes but dp*pp*cp*tp = 4*2*1*2 = 16" in err and "--dp 2" in err
    assert "Traceback" not in err


def test_bad_input_is_one_line_without_a_traceback(tmp_path):
    """Every bad input the table above covers stops `python -m picotron.train` the same way: status 2, one line."""
    (tmp_path / "bad.json").write_text('{"parallel": {"dp": 2,}}')
    for argv, message in [(["--seq-len", "0"], "train.seq_len=0 must be at least 1"),
                          (["--config", str(tmp_path / "bad.json")], f"{tmp_path / 'bad.json'} is not valid JSON"),
                          (["--dp", "2", "--pp", "2", "--zero", "3"], "zero_stage=3 with pp>1")]:
        result = subprocess.run([sys.executable, "-m", "picotron.train", *argv], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 2 and result.stdout == "", result.stderr
        assert result.stderr.startswith(f"python -m picotron.train: error: ") and message in result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_zero_steps_save_the_initial_state(tmp_path, capsys):
    """--steps 0 trains nothing; with --save-dir the initial state is saved as step_000000 (and said so)."""
    main(["--dp", "1", "--steps", "0", "--save-dir", str(tmp_path / "init"), "--log-file", str(tmp_path / "log")])
    out = capsys.readouterr().out
    saved = tmp_path / "init" / "step_000000"
    assert f"steps=0: nothing to train; saving the initial state to {saved}\n" in out
    assert [p.name for p in (tmp_path / "init").iterdir()] == ["step_000000"]
    assert checkpoint.read_info(saved)["step"] == 0 and (tmp_path / "log").read_text() == ""
    torch.manual_seed(0)                              # what Trainer builds from the default seed
    initial, loaded = Llama(ModelConfig()), Llama(ModelConfig())
    for weight in loaded.parameters():
        torch.nn.init.zeros_(weight)
    checkpoint.load_model_weights(loaded, saved)
    for (name, weight), again in zip(initial.named_parameters(), loaded.parameters()):
        assert torch.equal(weight, again), name
    # Resumed at or past --steps: nothing to train, and no copy of the checkpoint resumed from.
    main(["--dp", "1", "--steps", "0", "--resume", str(saved), "--save-dir", str(tmp_path / "again")])
    assert (f"steps=0: nothing to train from step 0; no checkpoint written to {tmp_path / 'again'} ({saved} holds "
            f"this state)") in capsys.readouterr().out
    assert not any((tmp_path / "again").iterdir())
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())      # argparse wraps the lines
    assert "0 trains nothing (the initial model is evaluated, and with --save-dir saved as" in help_text


def test_main_job_runs_two_ranks_from_the_command_line():
    result = subprocess.run([sys.executable, "-m", "picotron.train", "--dp", "2", "--steps", "4",
                             "--log-every", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "2 ranks as CPU processes with gloo" in out
    assert "[rank 0] step    3  loss" in out and "tok/s" in out and "MFU" in out
    assert "[rank 1] step" not in out  # only rank 0 logs


@pytest.mark.parametrize("path", sorted(pathlib.Path(__file__).parents[1].glob("configs/*.json")),
                         ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    config = Config.from_json(path)
    validate(config, config.parallel.world_size)


def test_under_torchrun_each_process_trains_in_place():
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "-m", "picotron.train", "--dp", "2", "--steps", "3", "--log-every", "1"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "step    2  loss" in result.stdout and "[rank" not in result.stdout  # no forked ranks


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(path: pathlib.Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_two_node_torchrun_on_localhost_matches_the_forked_run(tmp_path):
    """Two torchrun "nodes" of 2 processes each meet through c10d rendezvous (as on a real cluster, with
    localhost for the head node's address) and train dp2 x tp2: the same losses as the 4 forked ranks."""
    common = ["-m", "picotron.train", "--dp", "2", "--tp", "2", "--steps", "4", "--micro-batch-size", "2",
              "--seq-len", "32"]
    forked = tmp_path / "forked.jsonl"
    result = subprocess.run([sys.executable, *common, "--log-file", str(forked)], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    nodes_log = tmp_path / "nodes.jsonl"
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "picotron-test"]
    nodes = [subprocess.Popen([*torchrun, *common, "--log-file", str(nodes_log)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-2000:]
    assert "[rank" not in "".join(out for out, _ in outputs)   # each process trained in place
    assert len(_losses(nodes_log)) == 4                        # written once, by global rank 0
    assert _losses(nodes_log) == pytest.approx(_losses(forked), abs=1e-6)


def test_command_line_checkpoints_resume_bit_identical_and_in_another_layout(tmp_path):
    """--save-dir/--save-every write DCP checkpoints; --resume continues the same loss curve bit for bit in
    the same layout (dp2), and within float round-off in another (tp2), the checkpoint being resharded.
    fp32 on any machine: on a GPU node "auto" would train in bf16, whose round-off is larger."""
    common = ["-m", "picotron.train", "--steps", "4", "--micro-batch-size", "2", "--seq-len", "32",
              "--precision", "fp32"]

    def train(*argv, log):
        result = subprocess.run([sys.executable, *common, *argv, "--log-file", str(tmp_path / log)],
                                capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, result.stderr[-2000:]
        return _losses(tmp_path / log)

    uninterrupted = train("--dp", "2", "--save-dir", str(tmp_path / "ckpt"), "--save-every", "2", log="a.jsonl")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000002", "step_000004"]
    resumed = train("--dp", "2", "--resume", str(tmp_path / "ckpt" / "step_000002"), log="b.jsonl")
    assert resumed == uninterrupted[2:]                                  # bit-identical
    resharded = train("--dp", "1", "--tp", "2", "--micro-batch-size", "4", "--resume",
                      str(tmp_path / "ckpt" / "step_000002"), log="c.jsonl")
    assert resharded == pytest.approx(uninterrupted[2:], abs=LOSS_ATOL)   # the course's claim for fp32 losses

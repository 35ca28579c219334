"""bf16 mixed precision in the trainer: bf16 matmuls, fp32 master weights and optimizer state, on every axis.

The axes' arithmetic is proven in fp32 at 1e-5 (test_train.py); here N ranks in bf16 train like one
process in bf16, their loss curves within one bf16 rounding (picotron.tolerance.BF16_TRAINING_RTOL), and the
collectives carry the dtypes docs/design.md ("Mixed precision in the trainer") says they do.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.costs import peak_flops
from picotron.launch import run
from picotron.layout import validate
from picotron.mesh import Mesh
from picotron.tolerance import BF16_TRAINING_RTOL, unit_roundoff
from picotron.train import Trainer, compute_dtype

MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=64)
MOE = dataclasses.replace(MODEL, num_experts=4, experts_per_token=2)
STEPS = 8


def curves(config: Config, steps: int = STEPS) -> dict:
    """Train `steps` steps: the logged losses and clipped gradient norms (every rank logs the global ones)."""
    p = config.parallel
    mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp) if dist.is_initialized() else None
    trainer = Trainer(config, mesh)
    results = [trainer.train_step(step) for step in range(steps)]
    return {"loss": [r.loss for r in results], "grad_norm": [r.grad_norm for r in results]}


def train_config(precision: str = "bf16", *, accum: int = 1, **changes) -> TrainConfig:
    """The tests' training: clipping active (the norm matters), a short warm-up."""
    values = dict(micro_batch_size=2, seq_len=32, steps=STEPS, warmup_steps=2, grad_clip=0.5) | changes
    return TrainConfig(precision=precision, grad_accum_steps=accum, **values)


def worst_gap(curve: dict, reference: dict) -> float:
    """The largest |difference| / (u_bf16 |reference|) over every step's loss and the first step's gradient norm
    (from equal weights: rounding alone; later norms are not claimed, picotron.tolerance says why): below 1 passes."""
    pairs = list(zip(curve["loss"], reference["loss"])) + [(curve["grad_norm"][0], reference["grad_norm"][0])]
    return max(abs(a - b) / (BF16_TRAINING_RTOL * abs(b)) for a, b in pairs)


def test_auto_precision_is_bf16_on_a_gpu_and_fp32_on_a_cpu():
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match="precision='fp16'; choose one of"):
        validate(Config(train=TrainConfig(precision="fp16")))


def test_bf16_runs_the_matmuls_in_bf16_and_keeps_fp32_master_weights_and_adam_state():
    trainer = Trainer(Config(model=MODEL, train=train_config("bf16")))
    ids = torch.randint(0, MODEL.vocab_size, (2, 16), device=trainer.device)   # the GPU, where there is one
    with trainer.autocast():
        assert trainer.model(ids).dtype == torch.bfloat16                     # the LM head's matmul ran in bf16
    trainer.train_step(0)
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in trainer.model.parameters())
    state = [s for per_param in trainer.optimizer.state.values() for s in per_param.values() if s.dim()]
    assert state and all(s.dtype == torch.float32 for s in state)              # Adam's m and v
    fp32 = curves(Config(model=MODEL, train=train_config("fp32")), steps=3)
    bf16 = curves(Config(model=MODEL, train=train_config("bf16")), steps=3)
    # bf16 did change the arithmetic: the curves part by far more than fp32's rounding. Relative to
    # each value, over losses and norms: the mean loss averages bf16's roundings away (1e-5 here, on
    # one CPU), the gradient norms show them (1e-3); 100 fp32 roundings is 6e-6.
    gaps = [abs(a - b) / abs(b) for key in ("loss", "grad_norm") for a, b in zip(bf16[key], fp32[key])]
    assert max(gaps) > 100 * unit_roundoff(torch.float32)


def test_the_bf16_bound_sees_a_ten_percent_change_of_the_learning_rate():
    """The bound is not so loose that it cannot fail: the same run with lr 10% larger leaves it (2% does too)."""
    reference = curves(Config(model=MODEL, train=train_config("bf16")))
    changed = curves(Config(model=MODEL, train=train_config("bf16", lr=1.1 * TrainConfig.lr)))
    assert worst_gap(changed, reference) > 1


LAYOUTS = {
    "dp4": dict(dp=4),
    "dp2-zero1": dict(dp=2, zero_stage=1),
    "dp2-zero2": dict(dp=2, zero_stage=2),
    "dp4-zero3": dict(dp=4, zero_stage=3),
    "dp2-tp2-sp": dict(dp=2, tp=2, sequence_parallel=True),
    "cp2-ring": dict(dp=2, cp=2, cp_mode="ring"),
    "cp2-zigzag-tp2": dict(cp=2, tp=2),
    "dp2-cp2-ulysses": dict(dp=2, cp=2, cp_mode="ulysses"),
    "dp2-pp2-1f1b": dict(dp=2, pp=2),
    "pp4-zbh1": dict(pp=4, pp_schedule="zb-h1"),
    "dp2-ep2-moe": dict(dp=2, ep=2),
    "dp2-pp2-tp2-sp-zero1": dict(dp=2, pp=2, tp=2, sequence_parallel=True, zero_stage=1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_axis_in_bf16_trains_like_one_process_in_bf16(layout):
    parallel = ParallelConfig(**LAYOUTS[layout])
    model = MOE if parallel.ep > 1 else MODEL
    train = train_config("bf16", accum=4 if parallel.pp > 1 else 1)
    ranks = run(curves, parallel.world_size, args=(Config(model=model, parallel=parallel, train=train),), timeout=240,
                backend="gloo")
    single = Config(model=model, train=dataclasses.replace(train, micro_batch_size=2 * parallel.dp))
    [reference] = run(curves, 1, args=(single,), timeout=240, backend="gloo")   # on the CPU, where the ranks run
    assert reference["loss"][-1] < reference["loss"][0] - 1.0                 # it trains
    for rank in ranks:
        assert worst_gap(rank, reference) < 1, (rank, reference)


def step_bytes(config: Config) -> dict:
    """Payload bytes per collective of one training step on this rank (picotron.comm's counter)."""
    p = config.parallel
    mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)
    trainer = Trainer(config, mesh)
    mesh.counter.reset()
    trainer.train_step(0)
    return {op: nbytes for op, (_, nbytes) in mesh.counter.snapshot().items()}


@pytest.mark.parametrize("layout, op, ratio", [
    ("dp2", "all_reduce", 1.0),              # gradients of fp32 master weights: reduced in fp32
    ("tp2-sp", "all_gather", None),          # bf16 forward (matmul outputs), fp32 backward: between
    ("cp2-ulysses", "all_to_all", 0.5),      # q, k, v and the attention output: all bf16
    ("pp2", "send", 1.0),                    # the residual stream stays fp32 (fp32 + bf16 is fp32)
])
def test_which_tensors_travel_in_bf16(layout, op, ratio):
    parallel = ParallelConfig(**{"dp2": dict(dp=2), "tp2-sp": dict(tp=2, sequence_parallel=True),
                                 "cp2-ulysses": dict(cp=2, cp_mode="ulysses"), "pp2": dict(pp=2)}[layout])
    sent = {}
    for precision in ("fp32", "bf16"):
        config = Config(model=MODEL, parallel=parallel, train=train_config(precision, accum=2, steps=1))
        sent[precision] = run(step_bytes, parallel.world_size, args=(config,))[0][op]
    if ratio is None:
        assert 0.5 < sent["bf16"] / sent["fp32"] < 1.0
    else:
        assert sent["bf16"] / sent["fp32"] == ratio


def test_mfu_is_measured_against_the_peak_of_the_precision_that_ran(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, torch.bfloat16) == (989e12, "H100 spec-sheet dense bf16")
    before = torch.get_float32_matmul_precision()  # not monkeypatch: allow_tf32 is no plain attribute
    torch.set_float32_matmul_precision("high")       # (pytest 9.2 deletes it on undo)
    try:
        assert peak_flops(gpu, torch.float32) == (989e12 / 2, "H100 spec-sheet dense TF32 (half of bf16)")
    finally:
        torch.set_float32_matmul_precision(before)
    flops, source = peak_flops(torch.device("cpu"), torch.bfloat16)
    assert flops > 0 and source == "measured CPU bfloat16 matmul"

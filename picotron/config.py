"""Configuration: what model, how it is split over ranks, how it is trained.

Three plain dataclasses travel through the code explicitly (no globals, no environment
variables): `ModelConfig` (the shape of the Llama-style decoder), `ParallelConfig` (the
dp x pp x cp x tp grid) and `TrainConfig` (batch, steps, optimizer). `Config` groups them
and reads/writes the JSON files in configs/, whose sections are "model", "parallel" and
"train".

`validate(config, world_size)` rejects every impossible combination with a message that
names the values and the fix, so a bad config fails at start-up instead of hanging a
collective later.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 512          # SwiGLU inner width
    num_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2          # < heads: grouped-query attention (GQA)
    head_dim: int | None = None           # None: hidden_size // num_attention_heads
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # {"rope_type": "llama3", "factor": 8.0, ...} or None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    init_std: float = 0.02
    attention: str = "sdpa"               # "sdpa" (fused, never stores seq x seq scores) or "eager"
    recompute: str = "none"               # activation recomputation: "none", "selective" or "full"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named shape: "tiny" (about 1M parameters, trains in seconds on a CPU) up to "llama3-8b"."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    def num_params(self) -> int:
        """Parameter count from the shape alone (embedding counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size                                       # gate, up, down
        layer = attention + mlp + 2 * h                                            # + two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h                            # + final norm


ATTENTION_CHOICES = ("sdpa", "eager")
RECOMPUTE_CHOICES = ("none", "selective", "full")


def check_model_choices(model: ModelConfig) -> None:
    """Raise ValueError for an attention or recomputation mode the model does not have."""
    if model.attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention={model.attention!r}; choose one of {ATTENTION_CHOICES}")
    if model.recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={model.recompute!r}; choose one of {RECOMPUTE_CHOICES} "
                         f"(selective: recompute the attention core, full: recompute whole layers)")


# Shapes of public checkpoints (their config.json files on the Hugging Face hub).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(),
    "smollm-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, max_seq_len=2048),
    "smollm-360m": dict(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_layers=32,
                        num_attention_heads=15, num_key_value_heads=5, max_seq_len=2048),
    "smollm-1.7b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_layers=24,
                        num_attention_heads=32, num_key_value_heads=32, max_seq_len=2048),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_seq_len=8192,
                      rope_theta=500000.0, tie_word_embeddings=False),
}


@dataclass
class ParallelConfig:
    """Sizes of the process grid. World size = dp * pp * cp * tp.

    Rank order (see picotron/mesh.py): tp innermost (fastest links), then cp, then dp,
    pp outermost.

    zero_stage: how much of the training state the dp ranks split between them instead of
    each keeping a copy (picotron/parallel/zero.py): 0 none (plain data parallelism),
    1 the optimizer state, 2 and the gradients, 3 and the parameters.
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False       # with tp > 1: norms and residuals split along the sequence (SP)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


@dataclass
class TrainConfig:
    """How to train: batch, sequence, optimizer and logging."""

    seed: int = 0
    steps: int = 200
    micro_batch_size: int = 8             # sequences per rank per micro-batch
    grad_accum_steps: int = 1             # micro-batches per optimizer step
    seq_len: int = 64
    lr: float = 3e-3
    min_lr: float = 3e-4                  # end of the cosine decay
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0                # max global gradient norm; 0 disables clipping
    dataset: str = "arithmetic"           # "arithmetic" (built in) or a path to .txt / .jsonl files
    log_every: int = 10
    eval_every: int = 0                   # 0: evaluate task accuracy only at the end
    backend: str = "auto"                 # "auto", "gloo" or "nccl"
    bucket_mb: float = 25.0               # MiB per data-parallel gradient bucket (0: one per parameter)

    @property
    def tokens_per_step(self) -> int:
        """Tokens one data-parallel rank processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps * self.seq_len


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        unknown = set(data) - {"model", "parallel", "train"}
        if unknown:
            raise ValueError(f"unknown config sections {sorted(unknown)}; use 'model', 'parallel' and 'train'")
        model = dict(data.get("model", {}))
        preset = model.pop("preset", None)
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
        base = PRESETS[preset] if preset else {}
        return cls(model=_build(ModelConfig, {**base, **model}),
                   parallel=_build(ParallelConfig, data.get("parallel", {})),
                   train=_build(TrainConfig, data.get("train", {})))

    @classmethod
    def from_json(cls, path: str | Path) -> "Config":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _build(kind: type, values: dict) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"unknown {kind.__name__} fields {sorted(unknown)}; valid fields: {sorted(names)}")
    if "betas" in values:
        values = {**values, "betas": tuple(values["betas"])}
    return kind(**values)


ZERO_STAGES = (0, 1, 2, 3)


def check_zero_stage(stage, name: str = "zero_stage") -> None:
    """Raise ValueError for a ZeRO stage that does not exist (`name`: the argument, for the message)."""
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise ValueError(f"{name}={stage!r}; choose 0 (plain data parallelism), 1 (shard the optimizer "
                         f"state), 2 (and the gradients) or 3 (and the parameters)")


def validate(config: Config, world_size: int | None = None) -> None:
    """Raise ValueError naming the problem and the fix for any impossible combination."""
    m, p, t = config.model, config.parallel, config.train
    check_model_choices(m)
    for name in ("dp", "pp", "cp", "tp"):
        if getattr(p, name) < 1:
            raise ValueError(f"{name}={getattr(p, name)} must be at least 1")
    check_zero_stage(p.zero_stage)
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"num_key_value_heads={m.num_key_value_heads} does not divide "
                         f"num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % p.tp:
        raise ValueError(f"tp={p.tp} does not divide num_attention_heads={m.num_attention_heads}")
    if m.num_key_value_heads % p.tp:
        raise ValueError(f"tp={p.tp} does not divide num_key_value_heads={m.num_key_value_heads}")
    if m.intermediate_size % p.tp:
        raise ValueError(f"tp={p.tp} does not divide intermediate_size={m.intermediate_size}")
    if m.vocab_size % p.tp:
        raise ValueError(f"tp={p.tp} does not divide vocab_size={m.vocab_size}: each tp rank holds an equal "
                         f"slice of the vocabulary; choose a tp that divides it")
    if p.sequence_parallel and p.tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1: it splits the tensor-parallel ranks' norms "
                         "along the sequence; set tp or drop sequence_parallel")
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ValueError(f"sequence parallelism splits the sequence over tp={p.tp} ranks, but seq_len={t.seq_len} "
                         f"does not divide by it; choose a seq_len that is a multiple of {p.tp}")
    if p.pp > m.num_layers:
        raise ValueError(f"pp={p.pp} is larger than num_layers={m.num_layers}: a stage needs at least one layer")
    if t.seq_len > m.max_seq_len:
        raise ValueError(f"seq_len={t.seq_len} is longer than max_seq_len={m.max_seq_len}; raise max_seq_len")
    if t.seq_len % p.cp:
        raise ValueError(f"cp={p.cp} does not divide seq_len={t.seq_len}")
    if t.micro_batch_size < 1 or t.grad_accum_steps < 1 or t.steps < 0:
        raise ValueError("micro_batch_size and grad_accum_steps must be >= 1 and steps >= 0")
    if t.bucket_mb < 0:
        raise ValueError(f"bucket_mb={t.bucket_mb} must be >= 0 (0: one all-reduce bucket per parameter)")
    if t.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={t.backend!r}; choose 'auto', 'gloo' or 'nccl'")
    if world_size is not None and p.world_size != world_size:
        raise ValueError(f"dp*pp*cp*tp = {p.dp}*{p.pp}*{p.cp}*{p.tp} = {p.world_size} but the world has "
                         f"{world_size} ranks; change the sizes or launch {p.world_size} ranks")

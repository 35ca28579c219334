"""Configuration: what model, how it is split over ranks, how it is trained.

The fields and their own rules; the rules that involve a technique are that technique's, and
picotron.layout.validate runs them all (docs/design.md, "Layers").

Three plain dataclasses travel through the code explicitly (no globals, no environment
variables): `ModelConfig` (the shape of the Llama-style decoder), `ParallelConfig` (the
dp x pp x cp x tp grid) and `TrainConfig` (batch, steps, optimizer). `Config` groups them
and reads/writes the JSON files in configs/, whose sections are "model", "parallel" and
"train".

`validate(config, world_size)` rejects every impossible combination with a message that
names the values and the fix, so a bad config fails at start-up instead of hanging a
collective later. It starts with `check_fields`, which checks every field against its
annotation (an int field takes an int and not a bool, a float field an int or a finite float,
...) and against its lower bound in AT_LEAST (seq_len >= 1, steps >= 0, ...). `Config.from_json`
and `Config.from_dict` run the same check before building the dataclasses, naming the file
and the key (`configs/x.json: parallel.dp='2' has type str; expected int (write 2, without quotes)`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
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
    norm_impl: str = "torch"              # RMSNorm computed by "torch" ops or by picotron's "triton" kernels (ch. 09)
    fp8: str = "none"                     # "none", or the Linears' matmuls in fp8 with a recipe of picotron.fp8 (ch. 10)
    loss_impl: str = "torch"              # "torch": the whole logits, then F.cross_entropy; "chunked": head and loss
    loss_chunk_tokens: int = 1024         #   fused, the logits made and used this many tokens at a time (ch. 09)
    # Mixture of experts (picotron.model.MoE, chapter 07): 0 keeps the dense SwiGLU MLP in every layer.
    num_experts: int = 0                  # > 0: MoE layers with this many SwiGLU experts of intermediate_size
    experts_per_token: int = 2            # top-k: experts each token is sent to
    moe_capacity_factor: float | None = None  # None: dropless; c: each expert takes <= ceil(c * tokens * k / E)
    moe_aux_loss_coef: float = 0.01       # weight of the load-balancing loss (Switch Transformer's alpha)
    moe_every: int = 1                    # layers i with (i + 1) % moe_every == 0 are MoE; 2: every other layer

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        """A named shape: "tiny" (about 1M parameters, trains in seconds on a CPU) up to "llama3-8b"."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (from 0) has a mixture of experts instead of the dense MLP."""
        return self.num_experts > 0 and (index + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def num_params(self) -> int:
        """Parameter count from the shape alone (embedding counted once when tied).

        An MoE layer holds num_experts SwiGLU MLPs and a router (hidden x num_experts) where a
        dense layer holds one MLP.
        """
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * self.num_attention_heads * self.head_dim * 2 + h * kv * 2  # q, o, k, v
        mlp = 3 * h * self.intermediate_size                                       # gate, up, down
        layer = attention + mlp + 2 * h                                            # + two RMSNorms
        moe_extra = (self.num_experts - 1) * mlp + h * self.num_experts            # more experts + router
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + self.num_moe_layers * moe_extra + embeddings + h   # + final norm

    def num_active_params(self) -> int:
        """Parameters one token computes with: only its experts_per_token experts in MoE layers.

        What FLOPs per token scale with (6 x this, not 6 x num_params, for an MoE model).
        """
        idle_experts = max(self.num_experts - self.experts_per_token, 0)
        return self.num_params() - self.num_moe_layers * idle_experts * 3 * self.hidden_size * self.intermediate_size


ATTENTION_CHOICES = ("sdpa", "eager")
RECOMPUTE_CHOICES = ("none", "selective", "full")
NORM_IMPLS = ("torch", "triton")
LOSS_IMPLS = ("torch", "chunked")
PRECISIONS = ("auto", "fp32", "bf16")     # TrainConfig.precision
FP8_RECIPES = ("none", "tensorwise", "delayed", "rowwise", "blockwise")   # picotron.fp8.RECIPES, and "none"


def check_model_choices(model: ModelConfig) -> None:
    """Raise ValueError for an attention or recomputation mode the model does not have."""
    if model.attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention={model.attention!r}; choose one of {ATTENTION_CHOICES}")
    if model.recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={model.recompute!r}; choose one of {RECOMPUTE_CHOICES} "
                         f"(selective: recompute the attention core, full: recompute whole layers)")
    if model.norm_impl not in NORM_IMPLS:
        raise ValueError(f"norm_impl={model.norm_impl!r}; choose one of {NORM_IMPLS} (triton: picotron.kernels, "
                         f"interpreted on a CPU)")
    if model.loss_impl not in LOSS_IMPLS:
        raise ValueError(f"loss_impl={model.loss_impl!r}; choose one of {LOSS_IMPLS} (chunked: the LM head and the "
                         f"loss computed {model.loss_chunk_tokens} tokens at a time, never all logits at once)")
    if model.fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8={model.fp8!r}; choose one of {FP8_RECIPES} (chapter 10: how the fp8 scales are "
                         f"chosen)")
    check_moe(model)


def check_moe(model: ModelConfig) -> None:
    """Raise ValueError naming the fix for an impossible mixture-of-experts setting."""
    if model.num_experts < 0:
        raise ValueError(f"num_experts={model.num_experts}; use 0 for the dense MLP or a positive number of experts")
    if model.num_experts == 0:
        return
    if not 1 <= model.experts_per_token <= model.num_experts:
        raise ValueError(f"experts_per_token={model.experts_per_token} must be between 1 and num_experts="
                         f"{model.num_experts}: each token goes to that many different experts")
    if model.moe_capacity_factor is not None and not model.moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor={model.moe_capacity_factor} must be > 0 (1.0: room for a perfectly "
                         f"balanced load), or None for dropless routing")
    if model.moe_aux_loss_coef < 0:
        raise ValueError(f"moe_aux_loss_coef={model.moe_aux_loss_coef} must be >= 0 (0 turns the "
                         f"load-balancing loss off)")
    if not 1 <= model.moe_every <= model.num_layers:
        raise ValueError(f"moe_every={model.moe_every} leaves no MoE layer among num_layers={model.num_layers}; "
                         f"choose 1 (every layer) up to {model.num_layers}")


# Shapes of public checkpoints (their config.json files on the Hugging Face hub).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(),
    # tiny's FLOPs per token (top-2 of experts half tiny's MLP width) with 4x its MLP parameters: chapter 07.
    "tiny-moe": dict(intermediate_size=256, num_experts=8, experts_per_token=2),
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

    cp_mode: how the cp ranks, each holding a slice of every sequence, compute attention
    (picotron/parallel/context_parallel.py): "ring" passes key/value blocks around a ring of
    contiguous slices, "zigzag" does the same with each rank holding an early and a late chunk
    (balanced causal work), "ulysses" swaps the split to the heads with all-to-alls.

    pp_schedule: the order in which the pp stages run the step's micro-batches (its
    grad_accum_steps micro-batches; picotron/parallel/pipeline_schedules.py): "naive" (one
    micro-batch), "afab" (all forward, all backward: GPipe), "1f1b", "interleaved" (each rank
    holds pp_virtual_stages chunks of layers) or "zb-h1" (zero bubble).
    """

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False       # with tp > 1: norms and residuals split along the sequence (SP)
    cp_mode: str = "zigzag"               # with cp > 1: "ring", "zigzag" (ring, balanced layout) or "ulysses"
    pp_schedule: str = "1f1b"             # with pp > 1: "naive", "afab", "1f1b", "interleaved" or "zb-h1"
    pp_virtual_stages: int = 1            # chunks of layers per pp rank, for pp_schedule="interleaved"
    ep: int = 1                           # expert parallelism: groups of ep dp ranks split the experts (MoE)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


@dataclass
class TrainConfig:
    """How to train: batch, sequence, optimizer and logging."""

    seed: int = 0
    steps: int = 600
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
    tokenizer: str = ""                   # a Hugging Face tokenizer.json ("": bytes are the tokens)
    cache_dir: str = ""                   # where tokenized corpora are kept ("": ~/.cache/picotron)
    log_every: int = 10
    eval_every: int = 0                   # 0: evaluate task accuracy only at the end
    backend: str = "auto"                 # "auto", "gloo" or "nccl"
    precision: str = "auto"               # "fp32", "bf16" (autocast, fp32 master weights) or "auto": bf16 on a GPU
    compile: bool = False                 # torch.compile each decoder layer (the first step compiles)
    bucket_mb: float = 25.0               # MiB per data-parallel gradient bucket (0: one per parameter)
    log_file: str = ""                    # a path: rank 0 appends one JSON line per step (loss, tokens/s, MFU)
    save_dir: str = ""                    # checkpoints go to save_dir/step_NNNNNN (picotron.checkpoint, DCP)
    save_every: int = 0                   # steps between checkpoints (0: only after the last step, if save_dir)
    resume: str = ""                      # a checkpoint directory to start from (any layout: it is resharded)

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
    def from_dict(cls, data: dict, source: str = "") -> "Config":
        """Build a Config from {"model": {...}, "parallel": {...}, "train": {...}}; `source` (a file) prefixes
        the messages of the ValueErrors raised for unknown keys and for values of the wrong type or range."""
        where = f"{source}: " if source else ""
        if not isinstance(data, dict):
            raise ValueError(f"{where}the config is a JSON {_json_kind(data)}, but it must be an object with the "
                             f"sections 'model', 'parallel' and 'train', e.g. {{\"parallel\": {{\"dp\": 2}}}}")
        unknown = set(data) - {"model", "parallel", "train"}
        if unknown:
            raise ValueError(f"{where}unknown config sections {sorted(unknown)}; use 'model', 'parallel' and 'train'")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ValueError(f"{where}section {section!r} is a JSON {_json_kind(values)}, but it must be an "
                                 f"object of fields, e.g. \"{section}\": {{}}")
        model = dict(data.get("model", {}))
        preset = model.pop("preset", None)
        if preset is not None and (not isinstance(preset, str) or preset not in PRESETS):
            raise ValueError(f"{where}unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
        base = PRESETS[preset] if preset else {}
        return cls(model=_build(ModelConfig, {**base, **model}, where, "model"),
                   parallel=_build(ParallelConfig, data.get("parallel", {}), where, "parallel"),
                   train=_build(TrainConfig, data.get("train", {}), where, "train"))

    @classmethod
    def from_json(cls, path: str | Path) -> "Config":
        """Read a config file; every error (unreadable file, malformed JSON, wrong key or value) names the file."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise ValueError(f"cannot read the config file {path}: {error.strerror or error}; give the path of a "
                             f"JSON file such as configs/tiny_dp4.json") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}; "
                             f"fix the file (keys and strings in double quotes, no trailing commas)") from None
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _json_kind(value: Any) -> str:
    """What JSON calls the type of a parsed value, for messages."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _build(kind: type, values: dict, where: str, section: str) -> Any:
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = set(values) - names
    if unknown:
        raise ValueError(f"{where}unknown {kind.__name__} fields {sorted(unknown)} in section {section!r}; "
                         f"valid fields: {sorted(names)}")
    check_fields(kind, values, f"{where}{section}.")     # before the dataclass computes anything from them
    if "betas" in values:
        values = {**values, "betas": tuple(values["betas"])}
    return kind(**values)


# ---- field types and bounds -----------------------------------------------------------------------------
# The least value of each numeric field (anything below means nothing), and a note on what the bound means.
# Other limits depend on several fields (tp must divide the heads, ...) and are checked in validate().
AT_LEAST: dict[str, tuple[float, str]] = {
    # ModelConfig
    "vocab_size": (1, ""), "hidden_size": (1, ""), "intermediate_size": (1, ""), "num_layers": (1, ""),
    "num_attention_heads": (1, ""), "num_key_value_heads": (1, ""), "head_dim": (1, "or None: hidden / heads"),
    "max_seq_len": (1, ""), "num_experts": (0, "0: the dense MLP in every layer"), "init_std": (0, ""),
    "loss_chunk_tokens": (1, "tokens whose logits exist at once with loss_impl='chunked'"),
    # ParallelConfig: a size of 1 leaves the axis unsplit
    "dp": (1, "1: no data parallelism"), "pp": (1, "1: no pipeline"), "cp": (1, "1: no context parallelism"),
    "tp": (1, "1: no tensor parallelism"), "ep": (1, "1: no expert parallelism"),
    "pp_virtual_stages": (1, "1: one chunk of layers per pp rank"),
    # TrainConfig
    "steps": (0, "0: train nothing"), "micro_batch_size": (1, "sequences per rank per micro-batch"),
    "grad_accum_steps": (1, "micro-batches per optimizer step"), "seq_len": (1, "tokens per sequence"),
    "lr": (0, ""), "min_lr": (0, ""), "warmup_steps": (0, "0: no warm-up"), "weight_decay": (0, ""),
    "grad_clip": (0, "0 disables clipping"), "log_every": (1, "1: a log line every step"),
    "eval_every": (0, "0: evaluate only at the end"), "bucket_mb": (0, "0: one all-reduce bucket per parameter"),
    "save_every": (0, "0: save only after the last step"),
}


@functools.cache
def _type_hints(kind: type) -> dict[str, Any]:
    return typing.get_type_hints(kind)   # the annotations are strings (from __future__ import annotations)


def _accepts(hint: Any, value: Any) -> bool:
    """Whether `value` is of the annotated type `hint` (int | None, tuple[float, float], ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_accepts(arg, value) for arg in args)
    if origin is tuple:   # a tuple, or a JSON array, of as many values of these types
        return (isinstance(value, (tuple, list)) and len(value) == len(args)
                and all(_accepts(arg, v) for arg, v in zip(args, value)))
    if hint is type(None):
        return value is None
    if isinstance(value, bool):   # True is an int in Python; in a config it is only a bool
        return hint is bool
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin or hint)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("NoneType", "None")


def _unquote_hint(hint: Any, value: Any) -> str:
    """For a quoted number or boolean ("2", "true") where one is expected: how to write it."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError:
        return ""
    return f" (write {json.dumps(parsed)}, without quotes)" if parsed is not None and _accepts(hint, parsed) else ""


def _default(kind: type, name: str) -> Any:
    """The default value of field `name` of dataclass `kind` (None if it has none)."""
    f = next(f for f in dataclasses.fields(kind) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else None


def check_fields(kind: type, values: dict, where: str = "") -> None:
    """Raise ValueError if a value in `values` (field name -> value of dataclass `kind`) has the wrong type
    for its annotation, is not finite (nan, inf) or lies below its bound in AT_LEAST; `where` prefixes the
    key ("c.json: train.")."""
    hints = _type_hints(kind)
    for name, value in values.items():
        if not _accepts(hints[name], value):
            raise ValueError(f"{where}{name}={value!r} has type {type(value).__name__}; expected "
                             f"{_type_name(hints[name])}{_unquote_hint(hints[name], value)}")
        numbers = value if isinstance(value, (tuple, list)) else [value]    # betas holds two
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):  # nan passes every bound below
            what = "holds a number that is not finite" if len(numbers) > 1 else "is not a finite number"
            raise ValueError(f"{where}{name}={value!r} {what}; give a finite number such as the default, "
                             f"{name}={_default(kind, name)!r}")
        least, note = AT_LEAST.get(name, (None, ""))
        if least is not None and value is not None and value < least:
            raise ValueError(f"{where}{name}={value!r} must be at least {least}" + (f" ({note})" if note else ""))

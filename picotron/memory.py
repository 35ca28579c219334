"""Where the memory of a training step goes: a formula, and a measurement to check it against.

A training step keeps four kinds of tensors (Playbook, "Memory usage in Transformers"):

    parameters       N numbers
    gradients        N numbers, one per parameter
    optimizer state  AdamW's two moments (and, in mixed precision, an fp32 master copy of the weights)
    activations      what the forward pass saves for the backward pass: grows with batch x sequence

Bytes per parameter (parameters + gradients + optimizer state), N = ModelConfig.num_params():

    fp32        4 + 4 + 8  = 16
    bf16-mixed  2 + 2 + 12 = 16   bf16 weights and gradients; fp32 master weights, Adam m and v
                                  (Micikevicius et al. 2018, arXiv:1710.03740; frameworks that also
                                  keep fp32 gradients pay 4 more)

plus AdamW's step counter, one fp32 scalar per parameter tensor.

Activations: what one decoder layer saves for backward, term by term, is picotron.costs's
(`activation_bytes_per_layer`, with the table of its terms); recomputation keeps less.

`estimate_memory` adds it all up from the configs; picotron.memory_tracking's `measure_memory`
runs a real (or fake) training step under `MemoryTracker` and returns the same breakdown, measured.

Per rank, under 5D parallelism (chapter 08), each axis divides its own terms, and the formulas
of the technique files are reused rather than rewritten:

    tp (+SP)   every Linear and the vocabulary / tp; norms replicated (chapter 04); activations:
               tensor_parallel_costs.tp_activation_bytes_per_layer
    cp         nothing of the state; activations on s/cp tokens (chapter 05):
               context_parallel_costs.cp_activation_bytes_per_layer
    pp         the rank's stages only: its layers, the embedding on the first stage, the final
               norm and LM head on the last (a tied matrix has a copy on each); activations of a
               stage times the micro-batches in flight at the schedule's peak
               (pipeline_schedules.peak_in_flight: p - r on rank r for 1F1B, m for AFAB; chapter 06)
    ep         E/ep experts of each MoE layer per rank, the router replicated (chapter 07);
               an MoE layer saves, with T tokens on the rank, k = experts_per_token and R = T k
               rows received (dropless, balanced):
                   a (2 T k + R) h         the experts' input rows, the outputs back and their
                                           gate-weighted copy
                   + 4 a R f               the experts' SwiGLU tensors
                   + 4 T E + 4 T + 4 T k   router softmax, top-k probabilities and their sum (fp32)
                   + a T k + 24 T k        gates; three int64 index vectors
                   + 4 E + 16              the balancing loss's load fraction and two scalars
                   + 16 R (ep > 1)         two more int64 orders regrouping received rows
    ZeRO       stage 1 / 2 / 3 divide optimizer state / gradients / parameters by the ranks that
               hold the same weights: dp x cp for dense weights, dp x cp / ep for experts (chapter 03)

`estimate_memory(..., parallel_config)` returns the most loaded rank (the first pipeline stage
usually: most micro-batches in flight), or the one `pp_rank` names; `estimate_memory_per_stage`
all of them. `memory_tracking.SavedActivations` measures the same activations on a real rank: the peak of the
bytes autograd keeps for backward (saved-tensor hooks), across every micro-batch in flight.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.layout import validate
from picotron.parallel.context_parallel_costs import cp_activation_bytes_per_layer
from picotron.parallel.pipeline_schedules import make_schedule, stage_layers
from picotron.parallel.tensor_parallel_costs import tp_activation_bytes_per_layer
from picotron.parallel.zero import check_zero_stage

GiB = 2**30


# ---- The formula ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state, and per element of an activation."""

    param: int
    grad: int
    optimizer: int
    activation: int


PRECISIONS = {"fp32": Precision(param=4, grad=4, optimizer=8, activation=4),
              "bf16-mixed": Precision(param=2, grad=2, optimizer=12, activation=2)}


def precision_of(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r}; choose one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


def num_param_tensors(config: ModelConfig) -> int:
    """Parameter tensors: 9 per dense layer (q, k, v, o, gate, up, down, two norms), 7 + 3E per MoE
    layer (a router and E experts instead of one MLP), embedding, final norm, head (when untied)."""
    return parameters_on_rank(config, ParallelConfig()).tensors


@dataclass
class MemoryBreakdown:
    """Bytes of one rank's training state. `total` is what must fit in the accelerator's memory,
    before temporaries (logits' gradients, a recomputed layer) and allocator fragmentation."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer state": self.optimizer,
                "activations": self.activations, "total": self.total}

    def __str__(self) -> str:
        return "\n".join(f"{name:<16}{value / GiB:>10.3f} GiB" for name, value in self.as_dict().items())


def comparison_table(formula: MemoryBreakdown, measured: MemoryBreakdown) -> str:
    """Formula next to measurement, component by component, in MiB (GiB when the total passes 1 GiB)."""
    unit, unit_name = (GiB, "GiB") if formula.total > GiB else (2**20, "MiB")
    lines = [f"{'':<16}{'formula (' + unit_name + ')':>16}{'measured':>14}{'measured/formula':>18}"]
    for (name, f), m in zip(formula.as_dict().items(), measured.as_dict().values()):
        lines.append(f"{name:<16}{f / unit:>16.4f}{m / unit:>14.4f}{m / f:>18.6f}")
    return "\n".join(lines)


def estimate_memory(model_config: ModelConfig, train_config: TrainConfig,
                    parallel_config: ParallelConfig | None = None, *, precision: str = "fp32",
                    pp_rank: int | None = None) -> MemoryBreakdown:
    """Bytes per rank of training `model_config` with `train_config`'s micro-batch and sequence.

    Without pipeline parallelism activations are those of one micro-batch: with gradient
    accumulation each micro-batch's backward frees them before the next forward, so
    grad_accum_steps does not appear. With pp > 1 the grad_accum_steps micro-batches are the
    pipeline's, and a stage keeps as many as its schedule has in flight. `pp_rank`: the pipeline
    rank to estimate; None returns the most loaded one (what must fit).
    """
    stages = estimate_memory_per_stage(model_config, train_config, parallel_config, precision=precision)
    if pp_rank is not None:
        if not 0 <= pp_rank < len(stages):
            raise ValueError(f"pp_rank={pp_rank} is not a pipeline rank; choose one in 0..{len(stages) - 1}")
        return stages[pp_rank]
    return max(stages, key=lambda m: m.total)


def estimate_memory_per_stage(model_config: ModelConfig, train_config: TrainConfig,
                              parallel_config: ParallelConfig | None = None, *,
                              precision: str = "fp32") -> list[MemoryBreakdown]:
    """`estimate_memory` for each pipeline rank, in order (one entry without pipeline parallelism)."""
    parallel = parallel_config or ParallelConfig()
    check_layout(model_config, train_config, parallel)
    p = precision_of(precision)
    return [MemoryBreakdown(*state_bytes_on_rank(model_config, parallel, r, precision),
                            activations=activation_bytes_on_rank(model_config, train_config, parallel, r,
                                                                 dtype_bytes=p.activation))
            for r in range(parallel.pp)]


def check_layout(model: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> None:
    """Raise for a layout picotron does not run: layout.validate's rules (ValueError when impossible,
    NotImplementedError when a pairing is not written), so the formula describes picotron's memory."""
    check_zero_stage(parallel.zero_stage)
    # max_seq_len only sizes the RoPE tables (buffers, not counted): any sequence may be estimated.
    model = dataclasses.replace(model, max_seq_len=max(model.max_seq_len, train.seq_len))
    validate(Config(model=model, parallel=parallel, train=train))


# ---- Per rank: parameters, gradients, optimizer state --------------------------------------------

@dataclass(frozen=True)
class RankParameters:
    """Parameters one rank holds, split by who else holds the same ones.

    dense    replicated over the dp x cp ranks (they average its gradient)
    expert   replicated over the dp x cp / ep ranks that hold the same experts
    tensors  parameter tensors: AdamW keeps one fp32 step counter per tensor
    """

    dense: int
    expert: int
    tensors: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def pp_rank_layers(num_layers: int, parallel: ParallelConfig, pp_rank: int) -> list[range]:
    """The layer ranges of the stages pipeline rank `pp_rank` holds: stages r, r + pp, ... (interleaved)."""
    num_stages = parallel.pp * parallel.pp_virtual_stages
    return stage_layers(num_layers, num_stages)[pp_rank::parallel.pp]


def parameters_on_rank(config: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0) -> RankParameters:
    """What one (pp_rank, any tp, cp, dp) rank holds, counted from the shapes like ModelConfig.num_params.

    tp splits every Linear (q, k, v, o, gate, up, down) and the vocabulary; the RMSNorm weights stay
    whole. pp keeps this rank's layers, the embedding on the first stage and the final norm and LM
    head on the last; a tied head on another rank than the embedding is a copy of its own (pipeline_
    parallel.sync_tied_embeddings). ep keeps E/ep experts per MoE layer; the router is replicated,
    and tp leaves MoE blocks whole (every tp rank runs the router and its experts on all tokens).
    """
    h, t = config.hidden_size, parallel.tp
    q, kv = config.num_attention_heads * config.head_dim // t, config.num_key_value_heads * config.head_dim // t
    attention = 2 * h * q + 2 * h * kv                                  # q, o and k, v: this rank's heads
    mlp = 3 * h * config.intermediate_size // t                         # gate, up, down
    dense = expert = tensors = 0
    for layer in (i for stage in pp_rank_layers(config.num_layers, parallel, pp_rank) for i in stage):
        dense += attention + 2 * h                                      # + the two RMSNorms
        tensors += 4 + 2
        if config.is_moe_layer(layer):
            local_experts = config.num_experts // parallel.ep
            dense += h * config.num_experts                             # router
            expert += local_experts * 3 * h * config.intermediate_size  # whole experts, whatever tp
            tensors += 1 + 3 * local_experts
        else:
            dense += mlp
            tensors += 3
    first, last = pp_rank == 0, pp_rank == parallel.pp - 1
    vocab = config.vocab_size * h // t                                  # this rank's rows of the vocabulary
    if first:
        dense, tensors = dense + vocab, tensors + 1                     # embedding
    if last:
        dense, tensors = dense + h, tensors + 1                         # final norm
        if not (first and config.tie_word_embeddings):                  # an untied head, or the tied copy
            dense, tensors = dense + vocab, tensors + 1
    return RankParameters(dense, expert, tensors)


def state_bytes_on_rank(config: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0,
                        precision: str = "fp32") -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes of one rank, after ZeRO's sharding.

    ZeRO splits over the ranks holding the same weights (Playbook, "ZeRO (Zero Redundancy
    Optimizer)"): stage 1 the optimizer state, stage 2 the gradients too, stage 3 the parameters too,
    each term / N rounded up, N = dp x cp for dense weights and dp x cp / ep for experts. That is the
    Playbook's rule; picotron.parallel.zero.zero_state_bytes gives picotron's exact bytes (it pads each
    flat group to a multiple of N and keeps one step counter per group): a few bytes per group apart.
    """
    check_zero_stage(parallel.zero_stage)
    p, owned = precision_of(precision), parameters_on_rank(config, parallel, pp_rank)
    stage, replicas = parallel.zero_stage, parallel.dp * parallel.cp

    def shard(nbytes: int, ranks: int, from_stage: int) -> int:
        return -(-nbytes // ranks) if stage >= from_stage else nbytes

    state = [0, 0, 0]
    for numel, ranks, counters in ((owned.dense, replicas, owned.tensors), (owned.expert, replicas // parallel.ep, 0)):
        state[0] += shard(p.param * numel, ranks, 3)
        state[1] += shard(p.grad * numel, ranks, 2)
        state[2] += shard(p.optimizer * numel + 4 * counters, ranks, 1)    # + AdamW's fp32 step counters
    return tuple(state)


# ---- Per rank: activations -----------------------------------------------------------------------

def dense_layer_activation_bytes(config: ModelConfig, batch: int, seq: int, parallel: ParallelConfig,
                                 dtype_bytes: int = 4) -> int:
    """Bytes a dense decoder layer saves on one rank under tp (+SP) and cp, for one micro-batch.

    One axis alone is its chapter's formula. Both: tp's formula on this cp rank's s/cp tokens, plus
    the attention core as cp runs it over this tp rank's n_q/tp and n_kv/tp heads (the core's terms
    are what "selective" recomputation drops: the difference of cp's formula with and without it).
    """
    tp, cp, sp, a = parallel.tp, parallel.cp, parallel.sequence_parallel, dtype_bytes
    if cp == 1:
        return tp_activation_bytes_per_layer(config, batch, seq, tp, sp, a)
    if tp == 1:
        return cp_activation_bytes_per_layer(config, batch, seq, cp, parallel.cp_mode, a)
    if config.recompute == "full":
        return a * batch * (seq // cp // (tp if sp else 1)) * config.hidden_size    # the layer input only
    outside_core = tp_activation_bytes_per_layer(dataclasses.replace(config, recompute="selective"),
                                                 batch, seq // cp, tp, sp, a)
    if config.recompute == "selective":
        return outside_core
    heads = dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                                num_key_value_heads=config.num_key_value_heads // tp, head_dim=config.head_dim)
    core = (cp_activation_bytes_per_layer(heads, batch, seq, cp, parallel.cp_mode, a)
            - cp_activation_bytes_per_layer(dataclasses.replace(heads, recompute="selective"), batch, seq, cp,
                                            parallel.cp_mode, a))
    return outside_core + core


def moe_activation_bytes(config: ModelConfig, tokens: int, ep: int = 1, dtype_bytes: int = 4,
                         received_rows: int | None = None) -> int:
    """Bytes the mixture of experts of one layer saves on a rank holding `tokens` tokens (dropless).

    The rank routes its T tokens into T k slots and its experts compute the R rows the ep ranks send
    them (R = T k when the load is balanced; pass the real `received_rows` to compare with a run).
    Listed tensor by tensor in the module docstring; chapter 07 explains the layer.
    """
    a, k, h, f, E = dtype_bytes, config.experts_per_token, config.hidden_size, config.intermediate_size, \
        config.num_experts
    slots = tokens * k
    rows = slots if received_rows is None else received_rows
    data = a * (2 * slots + rows) * h + 4 * a * rows * f                 # expert inputs, outputs (twice); SwiGLU
    router = 4 * tokens * E + 4 * tokens + 4 * slots + a * slots         # softmax, top-k sum and probs, gates
    indices = 24 * slots + (16 * rows if ep > 1 else 0)                  # int64 orders and indices
    return data + router + indices + 4 * E + 16                          # + the aux loss's load fraction, 2 scalars


def layer_activation_bytes(config: ModelConfig, layer: int, batch: int, seq: int, parallel: ParallelConfig,
                           dtype_bytes: int = 4) -> int:
    """Bytes decoder layer `layer` saves on one rank for one micro-batch: dense or MoE."""
    dense = dense_layer_activation_bytes(config, batch, seq, parallel, dtype_bytes)
    if not config.is_moe_layer(layer) or config.recompute == "full":
        return dense                                                     # full: only the layer input
    tokens = batch * seq // parallel.cp                                 # every tp rank runs the MoE on all
    dense_mlp = 4 * dtype_bytes * tokens * config.intermediate_size // parallel.tp   # the SwiGLU it replaces
    return dense - dense_mlp + moe_activation_bytes(config, tokens, parallel.ep, dtype_bytes)


def head_activation_bytes(config: ModelConfig, batch: int, seq: int, parallel: ParallelConfig,
                          dtype_bytes: int = 4) -> int:
    """The last stage's final RMSNorm and loss, for one micro-batch on one rank.

    Final norm as in tp_activation_bytes_per_layer (n' = n/tp tokens under SP, its output whole for the
    column-parallel head). Loss: the fp32 log-probabilities, 4 n V. The vocab-parallel cross-entropy
    (tp > 1) keeps two fp32 tensors of the rank's V/tp entries (the shifted logits, read by the target
    gather, and their exponentials) and, per token, the local target (int64), the sum of
    exponentials (fp32) and two bool masks: 8 n V/tp + 14 n.
    """
    a, h, tp = dtype_bytes, config.hidden_size, parallel.tp
    tokens = batch * seq // parallel.cp
    my_tokens = tokens // tp if parallel.sequence_parallel else tokens
    norm = (4 + a) * my_tokens * h + 4 * my_tokens + a * tokens * h
    loss = 4 * tokens * config.vocab_size if tp == 1 else 8 * tokens * config.vocab_size // tp + 14 * tokens
    return norm + loss


def stage_activation_bytes(config: ModelConfig, layers: range, batch: int, seq: int, parallel: ParallelConfig,
                           first: bool, last: bool, dtype_bytes: int = 4) -> int:
    """One micro-batch's activations on one stage: its layers, the RoPE rows, the embedding or head."""
    tokens = batch * seq // parallel.cp
    total = sum(layer_activation_bytes(config, i, batch, seq, parallel, dtype_bytes) for i in layers)
    total += 2 * (seq // parallel.cp) * config.head_dim * dtype_bytes   # RoPE cos/sin of this rank's positions
    if first and parallel.tp > 1:
        total += 9 * tokens                                              # vocab-parallel lookup: local ids, mask
    if last:
        total += head_activation_bytes(config, batch, seq, parallel, dtype_bytes)
    return total


def peak_bytes_in_flight(actions: list, stage_bytes: dict[int, int], frees: str = "B") -> int:
    """The most bytes one rank's activation sets hold at once, walking its actions in order: a forward
    of stage s adds stage_bytes[s], the action `frees` ("B", or "W" for zero-bubble) of it removes them.
    peak_in_flight with a weight per set: interleaved chunks differ (the last one holds the loss)."""
    alive = peak = 0
    for action in actions:
        alive += stage_bytes[action.stage] * ((action.op == "F") - (action.op == frees))
        peak = max(peak, alive)
    return peak


def activation_bytes_on_rank(config: ModelConfig, train: TrainConfig, parallel: ParallelConfig, pp_rank: int = 0,
                             *, dtype_bytes: int = 4) -> int:
    """Activation bytes on pipeline rank `pp_rank` at the schedule's peak (one micro-batch without pp)."""
    batch, seq = train.micro_batch_size, train.seq_len
    num_stages = parallel.pp * parallel.pp_virtual_stages
    layers = stage_layers(config.num_layers, num_stages)
    stage_bytes = {s: stage_activation_bytes(config, layers[s], batch, seq, parallel, first=s == 0,
                                             last=s == num_stages - 1, dtype_bytes=dtype_bytes)
                   for s in range(pp_rank, num_stages, parallel.pp)}
    if parallel.pp == 1 and parallel.pp_virtual_stages == 1:
        return stage_bytes[0]                                            # one micro-batch at a time
    m = train.grad_accum_steps
    if parallel.pp_schedule == "afab":
        return m * stage_bytes[pp_rank]                                  # every forward before any backward
    # The other schedules reach their peak in the warm-up, within the first 2 p v micro-batches: later
    # ones only replace freed sets (tests/test_memory.py checks it), so a long accumulation costs nothing.
    m = min(m, 2 * parallel.pp * parallel.pp_virtual_stages)
    schedule = _schedule(parallel.pp_schedule, parallel.pp, m, parallel.pp_virtual_stages)
    return peak_bytes_in_flight(schedule.actions[pp_rank], stage_bytes, "W" if schedule.split_backward else "B")


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, num_microbatches: int, virtual_stages: int):
    return make_schedule(name, pp, num_microbatches, virtual_stages)

"""Plan a 5D layout: memory per GPU and step time of a configuration, and a search for the best one.

Chapter 08 (Playbook, "5D parallelism in a nutshell" and "Finding the Best Training
Configuration"). Given a model, a sequence length, a global batch and a cluster, `estimate_plan`
prices one layout (dp x pp x cp x tp, ep carved out of dp, a ZeRO stage, micro-batches,
recomputation) and `search` lists every layout that fits, fastest first. Every number comes from
the formulas the chapters before measured, and one assumed number, the kernels' efficiency
(ASSUMED_MFU, below); `predict_published` puts the result next to published throughputs:

    memory per GPU   picotron.memory.estimate_memory: the most loaded pipeline rank (chapters 01-07)
    compute          FLOPs per token (costs.training_flops_per_token: 6N + 12 L h s, plus what
                     recomputation runs again) at `assumed_mfu` of the GPU's peak
    tp (+SP)         tensor_parallel_costs.tp_comm_bytes_per_layer: 8 (t-1)/t b s h a per layer and
                     micro-batch, on the critical path of every layer (chapter 04)
    cp               context_parallel_costs.cp_comm_bytes_per_layer: the ring's K,V blocks, hidden behind
                     the attention blocks they feed when computing a block takes longer (chapter 05);
                     Ulysses' all-to-alls are exposed
    ep               expert_parallel_costs.ep_comm_bytes: 4 T k h a per MoE layer, (ep-1)/ep of it on the
                     wire, exposed (chapter 07)
    pp               pipeline_schedules.simulate: the step of the schedule's actions with each
                     micro-batch's forward, backward (and weight-gradient) time and each stage-to-stage
                     send, so the bubble (p-1)/(m+p-1) and exposed sends come out of the timeline (chapter 06)
    dp / ZeRO        zero.zero_comm_bytes + zero.ring_bytes: the all-reduce (stage 0), reduce-scatter and
                     all-gather (1-3) of the gradients and parameters, per step or per micro-batch
                     (chapter 03), overlapped with backward/forward when `overlap=True`

Assumptions, each one a place where the estimate can be wrong:

1. Compute runs at `assumed_mfu` of the spec-sheet peak whatever the layout: the kernels' own
   efficiency (no communication, no bubble). Real matmuls get slower as tp shrinks them.
2. A collective runs at the bandwidth of the slowest link its group crosses: the intra-node
   bandwidth when the group's ranks sit in one node, the inter-node bandwidth per GPU otherwise.
   Rank order is picotron's (mesh.py): tp innermost, then cp, dp, pp outermost, so a group of
   `size` ranks `stride` apart spans stride x size consecutive ranks, inside a node when that
   divides the GPUs per node. Ring algorithms, bandwidth-bound: latency is not modelled.
3. Exposed communication: tp, Ulysses and ep are on the critical path; ring attention hides behind
   its blocks' compute; dp/ZeRO gradient reduction hides behind the last micro-batch's backward,
   the parameter all-gather behind the next forward, ZeRO-3's per micro-batch traffic behind that
   micro-batch (overlap=True), or nothing hides (overlap=False).
4. Work is balanced: every dp, cp and ep rank gets the same tokens and the routing is uniform; the
   pipeline stage with the most layers sets the pace; the optimizer step, data loading and kernel
   launches take no time.
5. FLOPs per token follow docs/design.md, "FLOPs, peaks and MFU" (6N + 12 L h s, MFU without
   recomputation: picotron.costs); the embedding lookup is priced like a matmul, as the convention
   counts it.
6. A layout fits when the most loaded rank's estimate_memory total is at most (1 - reserve) of the
   GPU's memory: the reserve stands for what the formula leaves out (CUDA context, NCCL buffers,
   allocator fragmentation, the logits' gradient and other temporaries).

Layouts picotron refuses are refused here too, with layout.validate's messages: ValueError for
impossible ones (ZeRO-3 with pipeline parallelism among them: it would gather every stage's weights
for each micro-batch), NotImplementedError for pairings the trainer does not run yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass, field

from picotron.config import ModelConfig, ParallelConfig, TrainConfig
from picotron.costs import flops_per_token, training_flops_per_token
from picotron.memory import GiB, MemoryBreakdown, estimate_memory, parameters_on_rank
from picotron.parallel.context_parallel_costs import cp_comm_bytes_per_layer
from picotron.parallel.expert_parallel_costs import ep_comm_bytes
from picotron.parallel.pipeline_schedules import bubble_formula, make_schedule, simulate, stage_layers
from picotron.parallel.tensor_parallel_costs import tp_comm_bytes_per_layer
from picotron.parallel.zero import ring_bytes, zero_comm_bytes

__all__ = ["ASSUMED_MFU", "ClusterSpec", "Plan", "PlanEstimate", "SearchResult", "estimate_plan", "search",
           "group_link", "describe", "divisors", "PublishedRun", "PUBLISHED_RUNS", "predict_published", "LLAMA3_8B",
           "LLAMA3_70B", "LLAMA3_405B", "GPT3_175B"]

PRECISION_BYTES = {"fp32": 4, "bf16-mixed": 2}      # bytes per activation element (and per sent element)
# The kernels' efficiency without communication or bubble, one number for every layout (assumption 1):
# large bf16 matmuls and FlashAttention reach 60-75% of an A100's or H100's peak, and the best end-to-end
# MFUs published, which include communication and bubbles, are 57% (A100) and 47-48% (H100). It is the
# planner's one free number: 0.6 was chosen after comparing with PUBLISHED_RUNS at 0.5-0.7 (docs/benchmarks.md
# gives the errors at each), not fitted per run.
ASSUMED_MFU = 0.6


# ---- the cluster -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterSpec:
    """The GPUs and the links between them. Bandwidths: bytes/s one GPU sends (and receives) at once.

    Defaults: an H100 SXM node of 8 GPUs on NVLink 4 (450 GB/s per direction on paper; NCCL's
    all-reduce reaches about 360 GB/s of bus bandwidth) and one 400 Gb/s NIC per GPU between nodes
    (50 GB/s; about 45 GB/s reached). Peak: the dense bf16 spec-sheet figure
    (docs/design.md, "FLOPs, peaks and MFU").
    """

    num_gpus: int
    gpu_memory: float = 80e9               # bytes per GPU ("80 GB")
    peak_flops: float = 989e12             # dense bf16 FLOP/s per GPU
    intra_node_bandwidth: float = 360e9    # bytes/s per GPU inside a node
    inter_node_bandwidth: float = 45e9     # bytes/s per GPU between nodes
    gpus_per_node: int = 8
    name: str = "H100 SXM"

    def __post_init__(self) -> None:
        for attribute in ("num_gpus", "gpus_per_node"):
            value = getattr(self, attribute)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{attribute}={value!r} must be a positive integer")
        for attribute in ("gpu_memory", "peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            if not getattr(self, attribute) > 0:
                raise ValueError(f"{attribute}={getattr(self, attribute)!r} must be positive")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(f"num_gpus={self.num_gpus} is not a whole number of {self.gpus_per_node}-GPU nodes; "
                             f"use a multiple of gpus_per_node or change gpus_per_node")

    @classmethod
    def h100(cls, num_gpus: int, **changes) -> "ClusterSpec":
        return cls(num_gpus, **changes)

    @classmethod
    def a100(cls, num_gpus: int, **changes) -> "ClusterSpec":
        """A100 SXM 80 GB: 312 TFLOP/s dense bf16, NVLink 3 (300 GB/s per direction, ~230 reached),
        one 200 Gb/s NIC per GPU (25 GB/s, ~22 reached)."""
        values = dict(gpu_memory=80e9, peak_flops=312e12, intra_node_bandwidth=230e9, inter_node_bandwidth=22e9,
                      name="A100 SXM")
        return cls(num_gpus, **{**values, **changes})

    def bandwidth(self, stride: int, size: int) -> float:
        return self.intra_node_bandwidth if group_link(self, stride, size) == "intra" else self.inter_node_bandwidth


def group_link(cluster: ClusterSpec, stride: int, size: int) -> str:
    """"intra" when every group of `size` ranks `stride` apart sits inside one node, else "inter".

    Such a group spans stride x size consecutive ranks; the groups tile the nodes exactly when that
    span divides the GPUs per node (a group of 1 rank never communicates).
    """
    span = stride * size
    if size == 1 or span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0:
        return "intra"
    return "inter"


# ---- one plan ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """A layout to price: the parallel sizes, the micro-batch, recomputation and precision."""

    parallel: ParallelConfig
    micro_batch_size: int = 1
    recompute: str = "none"
    precision: str = "bf16-mixed"


@dataclass
class PlanEstimate:
    """What `estimate_plan` predicts for one layout, per GPU and per optimizer step."""

    plan: Plan
    model: ModelConfig
    cluster: ClusterSpec
    seq_len: int
    global_batch: int                     # sequences per optimizer step
    grad_accum_steps: int                 # micro-batches per dp rank per step (the pipeline's m)
    memory: MemoryBreakdown               # the most loaded rank
    fits: bool
    time: dict[str, float]                # seconds per step: compute, recompute, bubble, tp, cp, ep, pp p2p, dp
    links: dict[str, str] = field(default_factory=dict)   # technique -> "intra" / "inter"

    @property
    def step_time(self) -> float:
        return sum(self.time.values())

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq_len / self.step_time

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.cluster.num_gpus

    @property
    def mfu(self) -> float:
        """Model FLOPs (6N + 12 L h s per token, no recomputation) per second over the cluster's peak."""
        return self.tokens_per_s * flops_per_token(self.model, self.seq_len) / (self.cluster.num_gpus *
                                                                                self.cluster.peak_flops)

    @property
    def tflops_per_gpu(self) -> float:
        return self.mfu * self.cluster.peak_flops / 1e12

    def row(self) -> dict:
        """One line of a table: the layout, memory, step time, throughput."""
        return {"layout": describe(self.plan, self.grad_accum_steps), "memory (GiB)": self.memory.total / GiB,
                "step (s)": self.step_time, "tokens/s/GPU": self.tokens_per_s_per_gpu, "MFU": self.mfu}

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in self.time.items() if seconds)
        return (f"{describe(self.plan, self.grad_accum_steps)}: {self.memory.total / GiB:.1f} GiB per GPU "
                f"({'fits' if self.fits else 'does not fit'}), step {self.step_time:.3g} s ({parts}), "
                f"{self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%}")


def describe(plan: Plan, grad_accum_steps: int | None = None) -> str:
    """A short name for a layout, e.g. "tp8 pp16 dp64 ZeRO-1 mb1 x32 1f1b, recompute full"."""
    p = plan.parallel
    axes = " ".join(f"{name}{size}" for name, size in (("tp", p.tp), ("cp", p.cp), ("pp", p.pp), ("dp", p.dp),
                                                      ("ep", p.ep)) if size > 1) or "1 GPU"
    axes += "+SP" if p.sequence_parallel and p.tp > 1 else ""
    axes += f" ZeRO-{p.zero_stage}" if p.zero_stage else ""
    axes += f" mb{plan.micro_batch_size}" + (f" x{grad_accum_steps}" if grad_accum_steps else "")
    if p.pp > 1:
        axes += f" {p.pp_schedule}" + (f" v{p.pp_virtual_stages}" if p.pp_virtual_stages > 1 else "")
    if p.cp > 1 and p.cp_mode != "zigzag":
        axes += f" {p.cp_mode}"
    return axes + (f", recompute {plan.recompute}" if plan.recompute != "none" else "")


def _check_inputs(model: ModelConfig, cluster: ClusterSpec, seq_len: int, global_batch: int,
                  assumed_mfu: float, reserve: float) -> None:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive number of tokens")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a positive number of sequences per step")
    if not 0 < assumed_mfu <= 1:
        raise ValueError(f"assumed_mfu={assumed_mfu!r} is the fraction of peak the kernels reach: choose it in (0, 1], "
                         f"e.g. 0.5")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve={reserve!r} is the fraction of GPU memory kept free: choose it in [0, 1)")


def estimate_plan(model: ModelConfig, plan: Plan | ParallelConfig, cluster: ClusterSpec, *, seq_len: int,
                  global_batch: int, assumed_mfu: float = ASSUMED_MFU, overlap: bool = True,
                  reserve: float = 0.1) -> PlanEstimate:
    """Memory per GPU and time per step of training `model` with `plan` on `cluster`.

    global_batch: sequences of seq_len tokens per optimizer step; each of the dp ranks runs
    global_batch / (dp x micro_batch_size) micro-batches (gradient accumulation; the pipeline's m).
    """
    plan = plan if isinstance(plan, Plan) else Plan(plan)
    _check_inputs(model, cluster, seq_len, global_batch, assumed_mfu, reserve)
    p = plan.parallel
    if p.world_size != cluster.num_gpus:
        raise ValueError(f"dp*pp*cp*tp = {p.dp}*{p.pp}*{p.cp}*{p.tp} = {p.world_size} but the cluster has "
                         f"{cluster.num_gpus} GPUs; choose sizes whose product is {cluster.num_gpus}")
    per_step = p.dp * plan.micro_batch_size
    if global_batch % per_step:
        raise ValueError(f"global_batch={global_batch} sequences do not split into dp={p.dp} ranks x micro-batches of "
                         f"{plan.micro_batch_size}; choose a global batch that is a multiple of {per_step}")
    model = dataclasses.replace(model, recompute=plan.recompute, max_seq_len=max(model.max_seq_len, seq_len))
    m = global_batch // per_step
    train = TrainConfig(micro_batch_size=plan.micro_batch_size, grad_accum_steps=m, seq_len=seq_len)
    memory = estimate_memory(model, train, p, precision=plan.precision)   # raises for invalid layouts
    fits = memory.total <= (1 - reserve) * cluster.gpu_memory
    time, links = _step_time(model, plan, cluster, seq_len, m, assumed_mfu, overlap)
    return PlanEstimate(plan, model, cluster, seq_len, global_batch, m, memory, fits, time, links)


# ---- the step time -----------------------------------------------------------------------------------
def _groups(p: ParallelConfig) -> dict[str, tuple[int, int]]:
    """(stride, size) of each group in picotron's rank order: tp innermost, then cp, dp, pp."""
    return {"tp": (1, p.tp), "cp": (p.tp, p.cp), "dp": (p.tp, p.cp * p.dp), "ep": (p.tp * p.cp, p.ep),
            "expert dp": (p.tp, p.cp * p.dp // p.ep), "pp": (p.tp * p.cp * p.dp, p.pp)}


def _step_time(model: ModelConfig, plan: Plan, cluster: ClusterSpec, seq: int, m: int, assumed_mfu: float,
               overlap: bool) -> tuple[dict[str, float], dict[str, str]]:
    p, b, a = plan.parallel, plan.micro_batch_size, PRECISION_BYTES[plan.precision]
    groups = _groups(p)
    links = {name: group_link(cluster, *groups[name]) for name in ("tp", "cp", "dp", "ep", "pp")
             if groups[name][1] > 1}
    speed = cluster.peak_flops * assumed_mfu                     # FLOP/s a GPU computes at
    v = p.pp_virtual_stages
    chunk_layers = max(len(layers) for layers in stage_layers(model.num_layers, p.pp * v))
    share = chunk_layers / model.num_layers                      # of the model's work, in the slowest chunk
    tokens = b * seq // p.cp                                     # tokens of a micro-batch on this rank
    model_flops = flops_per_token(model, seq) * tokens * share / p.tp
    extra_flops = (training_flops_per_token(model, seq) - flops_per_token(model, seq)) * tokens * share / p.tp
    # One micro-batch on one chunk: forward a third of the model FLOPs, backward two thirds (input and
    # weight gradients, B and W of the zero-bubble schedules); recomputation reruns forward work in B.
    third, recompute = model_flops / 3 / speed, extra_flops / speed
    f = b_ = w = third

    # tp: per layer and micro-batch, on the critical path; full recomputation repeats the forward's. An MoE
    # block stays whole on every tp rank (chapter 07): only its attention's collectives remain, half a layer's.
    moe_layers = round(chunk_layers * model.num_moe_layers / model.num_layers)
    tp_layers = chunk_layers - moe_layers / 2
    tp_bytes = tp_layers * tp_comm_bytes_per_layer(b, seq // p.cp, model.hidden_size, p.tp, p.sequence_parallel, a)
    tp_time = tp_bytes * (1.5 if plan.recompute == "full" else 1) / cluster.bandwidth(*groups["tp"])
    # cp: the ring's blocks hide behind the attention core they feed (12 s h FLOPs per token, fwd + bwd);
    # Ulysses' all-to-alls do not.
    cp_time = 0.0
    if p.cp > 1:
        heads = dataclasses.replace(model, num_attention_heads=model.num_attention_heads // p.tp,
                                    num_key_value_heads=model.num_key_value_heads // p.tp, head_dim=model.head_dim)
        cp_bytes = chunk_layers * cp_comm_bytes_per_layer(heads, b, seq, p.cp, p.cp_mode, a)
        cp_time = cp_bytes / cluster.bandwidth(*groups["cp"])
        if p.cp_mode != "ulysses":
            core = chunk_layers * 12 * tokens * seq * model.num_attention_heads * model.head_dim / p.tp / speed
            cp_time = max(0.0, cp_time - core)
    # ep: the token all-to-alls of every MoE layer, (ep-1)/ep of the payload leaves the rank.
    ep_time = 0.0
    if p.ep > 1:
        wire = moe_layers * ep_comm_bytes(tokens, model.hidden_size, model.experts_per_token, p.ep, a)
        ep_time = wire * (p.ep - 1) / p.ep / cluster.bandwidth(*groups["ep"])
    # Exposed communication joins the action it belongs to: a third in forward, the rest in backward.
    f += (tp_time + cp_time + ep_time) / 3
    b_ += 2 * (tp_time + cp_time + ep_time) / 3 + recompute
    work = m * v * (f + b_ + w)                                  # this rank's actions, back to back
    time = {"compute": m * v * 3 * third, "recompute": m * v * recompute, "tp": m * v * tp_time,
            "cp": m * v * cp_time, "ep": m * v * ep_time}
    if p.pp > 1:
        p2p = b * (seq // p.cp) * model.hidden_size * a / cluster.bandwidth(*groups["pp"])
        makespan = _pipeline_makespan(p.pp_schedule, p.pp, m, v, f, b_, w, p2p)
        idle = _pipeline_makespan(p.pp_schedule, p.pp, m, v, f, b_, w, 0.0) - work
        time["bubble"], time["pp p2p"] = idle, makespan - work - idle
    time["dp"] = _dp_time(model, plan, cluster, groups, m, f=v * f, backward=v * (b_ + w), overlap=overlap)
    return time, links


def _pipeline_makespan(schedule: str, pp: int, m: int, v: int, f: float, b: float, w: float, p2p: float) -> float:
    """One step of the schedule from its timeline (pipeline_schedules.simulate), each action's cost given.

    The timeline scales with the costs: computed once per shape of costs (relative to f) and cached."""
    return f * _unit_makespan(schedule, pp, m, v, round(b / f, 4), round(w / f, 4), round(p2p / f, 4))


@functools.lru_cache(maxsize=4096)
def _unit_makespan(schedule: str, pp: int, m: int, v: int, b: float, w: float, p2p: float) -> float:
    if p2p == 0 and schedule in ("afab", "1f1b", "interleaved", "naive"):
        return m * v * (1 + b + w) / (1 - bubble_formula(schedule, pp, m, v))   # same as the timeline
    steady = (4 if schedule == "zb-h1" else 1) * pp * v     # micro-batches after which the step grows linearly
    if schedule != "naive" and m > 2 * steady:
        # Past the warm-up every micro-batch adds the same time: the step is linear in m (exactly, in the
        # simulator; tests/test_planner.py checks it), so two short timelines give a long one.
        short, long = (_unit_makespan(schedule, pp, k, v, b, w, p2p) for k in (steady, 2 * steady))
        return long + (m - 2 * steady) * (long - short) / steady
    events = simulate(_schedule(schedule, pp, m, v), 1.0, b, w, p2p)
    return max(e.end for e in events) - min(e.start for e in events)


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, m: int, v: int):
    return make_schedule(name, pp, m, v)


def _dp_time(model: ModelConfig, plan: Plan, cluster: ClusterSpec, groups: dict, m: int, f: float,
             backward: float, overlap: bool) -> float:
    """Exposed seconds of the data-parallel (and ZeRO) traffic of one step on the most loaded pp rank.

    f / backward: one micro-batch's forward / backward on this rank, the windows that hide it.
    """
    p = plan.parallel
    owned = max((parameters_on_rank(model, p, r) for r in range(p.pp)), key=lambda o: o.total)
    exposed = 0.0
    for numel, (stride, size) in ((owned.dense, groups["dp"]), (owned.expert, groups["expert dp"])):
        if size == 1 or numel == 0:
            continue
        payload = zero_comm_bytes(numel, size, p.zero_stage, plan.precision, micro_batches=m)
        bandwidth = cluster.bandwidth(stride, size)
        reduce = ring_bytes({op: n for op, n in payload.items() if op != "all_gather"}, size) / bandwidth
        gather = ring_bytes({op: n for op, n in payload.items() if op == "all_gather"}, size) / bandwidth
        if not overlap:
            exposed += reduce + gather
        elif p.zero_stage == 3:      # per micro-batch: gathers before forward and backward, a reduce-scatter after
            exposed += m * max(0.0, (reduce + gather) / m - (f + backward))
        elif p.zero_stage == 2:      # a reduce-scatter per micro-batch behind its backward; a gather per step
            exposed += m * max(0.0, reduce / m - backward) + max(0.0, gather - f)
        else:                        # once per step: behind the last backward, the gather behind the next forward
            exposed += max(0.0, reduce - backward) + max(0.0, gather - f)
    return exposed


# ---- the search --------------------------------------------------------------------------------------
@dataclass
class SearchResult:
    """The layouts that fit, fastest first; the rest counted by why they were left out."""

    fitting: list[PlanEstimate]
    too_big: list[PlanEstimate]            # valid, but over the GPU's memory (least memory first)
    rejected: Counter                      # reason -> layouts refused before pricing

    @property
    def best(self) -> PlanEstimate:
        if not self.fitting:
            smallest = self.too_big[0] if self.too_big else None
            hint = (f"; the smallest needs {smallest.memory.total / GiB:.1f} GiB per GPU ({describe(smallest.plan)})"
                    if smallest else "")
            raise ValueError(f"no layout fits{hint}: add GPUs, shorten the sequence, or allow more recomputation "
                             f"and ZeRO stages")
        return self.fitting[0]

    def table(self, top: int = 10) -> str:
        rows = [plan.row() for plan in self.fitting[:top]]
        if not rows:
            return "no layout fits"
        width = max(len(r["layout"]) for r in rows)
        lines = [f"{'layout':<{width}}  {'GiB/GPU':>8}  {'step (s)':>9}  {'tokens/s/GPU':>12}  {'MFU':>6}"]
        lines += [f"{r['layout']:<{width}}  {r['memory (GiB)']:>8.1f}  {r['step (s)']:>9.3f}  "
                  f"{r['tokens/s/GPU']:>12,.0f}  {r['MFU']:>6.1%}" for r in rows]
        return "\n".join(lines)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: ModelConfig, cluster: ClusterSpec, *, seq_len: int, global_batch: int,
           assumed_mfu: float = ASSUMED_MFU, overlap: bool = True, reserve: float = 0.1, precision: str = "bf16-mixed",
           tp_sizes: tuple | None = None, cp_sizes: tuple | None = None, pp_sizes: tuple | None = None,
           ep_sizes: tuple | None = None, zero_stages: tuple = (0, 1, 2, 3),
           recomputes: tuple = ("none", "selective", "full"), micro_batch_sizes: tuple = (1, 2, 4, 8),
           schedules: tuple = (("1f1b", 1),), cp_mode: str = "zigzag", sequence_parallel: bool = True
           ) -> SearchResult:
    """Every valid layout of cluster.num_gpus GPUs for this model, sequence and global batch, priced.

    The Playbook's steps: (1) the model must fit (memory per GPU), (2) the global batch must be
    reachable (dp x micro-batch x accumulation = global_batch), (3) among those, the most tokens per
    second. Sizes default to every divisor of the GPU count (tp up to a node, pp up to the layers,
    ep dividing dp and the experts); schedules are (name, virtual stages) pairs tried when pp > 1;
    sequence parallelism is used whenever tp > 1 (the same communication as tp, less memory).
    """
    _check_inputs(model, cluster, seq_len, global_batch, assumed_mfu, reserve)
    n = cluster.num_gpus
    tp_sizes = tp_sizes or tuple(d for d in divisors(n) if d <= cluster.gpus_per_node)
    cp_sizes = cp_sizes or tuple(divisors(n))
    pp_sizes = pp_sizes or tuple(d for d in divisors(n) if d <= model.num_layers)
    fitting, too_big, rejected = [], [], Counter()
    for tp in tp_sizes:
        for cp in cp_sizes:
            for pp in pp_sizes:
                if n % (tp * cp * pp):
                    continue
                dp = n // (tp * cp * pp)
                if global_batch % dp:
                    rejected[f"global batch {global_batch} does not split over dp"] += 1
                    continue
                for ep in (ep_sizes or (divisors(dp) if model.num_experts else (1,))):
                    if ep > dp or dp % ep or (model.num_experts and model.num_experts % ep):
                        continue
                    for plan in _plans(tp, cp, pp, dp, ep, model, global_batch, zero_stages, recomputes,
                                       micro_batch_sizes, schedules, cp_mode, sequence_parallel, precision):
                        try:
                            estimate = estimate_plan(model, plan, cluster, seq_len=seq_len, global_batch=global_batch,
                                                     assumed_mfu=assumed_mfu, overlap=overlap, reserve=reserve)
                        except (ValueError, NotImplementedError) as error:
                            rejected[str(error).split(";")[0]] += 1
                            continue
                        (fitting if estimate.fits else too_big).append(estimate)
    # Fastest first; at equal speed (to 0.1%), the fewest GPUs per model replica (data parallelism is the
    # simplest axis and scales best: the Playbook's first choice), then the least memory.
    fitting.sort(key=lambda e: (-round(e.tokens_per_s, -int(math.floor(math.log10(e.tokens_per_s))) + 3),
                                e.plan.parallel.tp * e.plan.parallel.cp * e.plan.parallel.pp, e.memory.total))
    too_big.sort(key=lambda e: e.memory.total)
    return SearchResult(fitting, too_big, rejected)


def _plans(tp, cp, pp, dp, ep, model, global_batch, zero_stages, recomputes, micro_batch_sizes, schedules,
           cp_mode, sequence_parallel, precision):
    """The plans of one mesh shape: micro-batch, schedule, ZeRO stage and recomputation choices."""
    replicas = dp * cp
    for mb in micro_batch_sizes:
        if global_batch % (dp * mb):
            continue
        for schedule, virtual in (schedules if pp > 1 else (("1f1b", 1),)):
            for stage in zero_stages:
                if stage and replicas == 1:
                    continue                        # nothing to shard over
                for recompute in recomputes:
                    parallel = ParallelConfig(dp=dp, pp=pp, cp=cp, tp=tp, zero_stage=stage, ep=ep,
                                              sequence_parallel=sequence_parallel and tp > 1, cp_mode=cp_mode,
                                              pp_schedule=schedule, pp_virtual_stages=virtual)
                    yield Plan(parallel, micro_batch_size=mb, recompute=recompute, precision=precision)


# ---- published runs, to check the planner against ------------------------------------------------------
# Model shapes from the papers and the models' config.json files. GPT-3's GELU MLP (2 matrices of h x 4h)
# is written as a SwiGLU of the same parameter count (3 matrices of h x 8h/3): the FLOPs are the same.
LLAMA3_8B = ModelConfig.preset("llama3-8b")
LLAMA3_70B = ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, max_seq_len=8192, rope_theta=500000.0,
                         tie_word_embeddings=False)
LLAMA3_405B = ModelConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_layers=126,
                          num_attention_heads=128, num_key_value_heads=8, max_seq_len=131072, rope_theta=500000.0,
                          tie_word_embeddings=False)
GPT3_175B = ModelConfig(vocab_size=131072, hidden_size=12288, intermediate_size=32768, num_layers=96,
                        num_attention_heads=96, num_key_value_heads=96, max_seq_len=2048)


@dataclass(frozen=True)
class PublishedRun:
    """A throughput someone measured and published, with what they published about the layout.

    layout: the ParallelConfig fields the source states (None: not stated; the planner's best layout is
    used). Knobs the source leaves open (recomputation, pipeline interleaving) are chosen by the
    planner as the fastest variant that fits; `note` says what was assumed.
    """

    name: str
    model: ModelConfig
    cluster: ClusterSpec
    seq_len: int
    global_batch: int                      # sequences per step
    layout: dict | None
    published_mfu: float | None            # as the source states it
    published_tokens_per_s_per_gpu: float | None
    source: str
    micro_batch_size: int = 1
    recomputes: tuple = ("none", "selective", "full")
    note: str = ""
    search_options: dict = field(default_factory=dict)   # narrows `search` when the layout is not published


LLAMA3_PAPER = "Llama 3 paper, arXiv:2407.21783, Table 4 (16M tokens per batch); https://arxiv.org/abs/2407.21783"
TORCHTITAN_H100 = ("torchtitan docs/performance.md (commit eaea6f6), Tables 1 and 3, bf16 rows; "
                   "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
TORCHTITAN_A100 = ("torchtitan docs/performance.md (commit 0413364), Llama 3 on 64 A100 80GB, FSDP; "
                   "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
MEGATRON_README = ("Megatron-LM README, 'Training Speed and Scalability' (GPT-3 strong scaling, batch 1152); "
                   "https://github.com/NVIDIA/Megatron-LM#training-speed-and-scalability")
# torchtitan's H100s: 96 GB HBM2e at a 500 W limit, peak between the SXM and NVL figures (its MFU uses SXM's).
H100_TORCHTITAN = dict(gpu_memory=96 * GiB, name="H100 96GB, 500 W")
MEGATRON_SEARCH = dict(tp_sizes=(4, 8), pp_sizes=(4, 6, 8, 12, 16))   # the sizes Megatron-LM's GPT-3 recipes use

PUBLISHED_RUNS = [
    PublishedRun("Llama 3 405B, 8k context, 8,192 GPUs", LLAMA3_405B, ClusterSpec.h100(8192), 8192, 2048,
                 dict(tp=8, cp=1, pp=16, dp=64, zero_stage=1), 0.43, None, LLAMA3_PAPER,
                 note="ZeRO-1 assumed (the paper shards optimizer state and gradients)"),
    PublishedRun("Llama 3 405B, 8k context, 16,384 GPUs", LLAMA3_405B, ClusterSpec.h100(16384), 8192, 2048,
                 dict(tp=8, cp=1, pp=16, dp=128, zero_stage=1), 0.41, None, LLAMA3_PAPER,
                 note="ZeRO-1 assumed"),
    PublishedRun("Llama 3 405B, 131k context, 16,384 GPUs", LLAMA3_405B, ClusterSpec.h100(16384), 131072, 128,
                 dict(tp=8, cp=16, pp=16, dp=8, zero_stage=1), 0.38, None, LLAMA3_PAPER,
                 note="ZeRO-1 assumed; the paper's CP is all-gather based, priced here as picotron's zig-zag ring"),
    PublishedRun("torchtitan Llama 3.1 8B, FSDP, 8 GPUs", LLAMA3_8B, ClusterSpec.h100(8, **H100_TORCHTITAN), 8192, 16,
                 dict(dp=8, zero_stage=3), None, 5762, TORCHTITAN_H100, micro_batch_size=2, recomputes=("selective",),
                 note="500 W GPUs with a lower peak than the 989 TFLOP/s assumed; published memory 82.4 GiB"),
    PublishedRun("torchtitan Llama 3.1 8B, FSDP, 128 GPUs", LLAMA3_8B, ClusterSpec.h100(128, **H100_TORCHTITAN), 8192,
                 256, dict(dp=128, zero_stage=3), None, 5605, TORCHTITAN_H100, micro_batch_size=2,
                 recomputes=("selective",), note="as above; published memory 67.0 GiB"),
    PublishedRun("torchtitan Llama 3 8B, FSDP, 64 A100", LLAMA3_8B, ClusterSpec.a100(64), 8192, 64,
                 dict(dp=64, zero_stage=3), 0.568, 2904, TORCHTITAN_A100, recomputes=("selective",)),
    PublishedRun("torchtitan Llama 3 70B, FSDP, 64 A100", LLAMA3_70B, ClusterSpec.a100(64), 8192, 64,
                 dict(dp=64, zero_stage=3), 0.517, 331, TORCHTITAN_A100, recomputes=("full",)),
    PublishedRun("Megatron-LM GPT-3 175B, 96 H100", GPT3_175B, ClusterSpec.h100(96), 2048, 1152, None, 0.47, None,
                 MEGATRON_README, search_options=MEGATRON_SEARCH,
                 note="layout not in the README's text: the planner's best with tp 4-8, pp up to 16; sequence "
                      "2048 assumed"),
    PublishedRun("Megatron-LM GPT-3 175B, 4,608 H100", GPT3_175B, ClusterSpec.h100(4608), 2048, 1152, None, 0.42,
                 None, MEGATRON_README, search_options=MEGATRON_SEARCH, note="as above"),
]


def predict_published(run: PublishedRun, assumed_mfu: float = ASSUMED_MFU, **search_options) -> dict:
    """The planner's prediction for a published run, next to the published figure, with the relative error.

    With a published layout, the open knobs (recomputation; 1F1B or interleaved with 2 or 4 chunks
    when pp > 1) take the fastest variant, whether or not it fits picotron's memory estimate: the
    authors' implementations keep less than picotron's (fused norms, sequence-parallel activations
    re-gathered in backward), and the question here is the step time of the same work; "fits" reports
    picotron's verdict. Without a layout, `search` picks the whole layout among those that fit
    (search_options narrow it). error = predicted / published - 1, on MFU when the source states it,
    else on tokens/s per GPU.
    """
    if run.layout is None:
        options = dict(cp_sizes=(1,), zero_stages=(1,), recomputes=run.recomputes, micro_batch_sizes=(1,),
                       schedules=(("1f1b", 1), ("interleaved", 2)))
        result = search(run.model, run.cluster, seq_len=run.seq_len, global_batch=run.global_batch,
                        assumed_mfu=assumed_mfu, **{**options, **run.search_options, **search_options})
        best = result.best
    else:
        pp = run.layout.get("pp", 1)
        schedules = (("1f1b", 1), ("interleaved", 2), ("interleaved", 4)) if pp > 1 else (("1f1b", 1),)
        estimates = [estimate_plan(run.model, Plan(ParallelConfig(**run.layout, pp_schedule=name, pp_virtual_stages=v,
                                                                  sequence_parallel=run.layout.get("tp", 1) > 1),
                                                   run.micro_batch_size, recompute),
                                   run.cluster, seq_len=run.seq_len, global_batch=run.global_batch,
                                   assumed_mfu=assumed_mfu)
                     for recompute in run.recomputes for name, v in schedules]
        best = max(estimates, key=lambda e: e.tokens_per_s)
    on_mfu = run.published_mfu is not None
    published = run.published_mfu if on_mfu else run.published_tokens_per_s_per_gpu
    predicted = best.mfu if on_mfu else best.tokens_per_s_per_gpu
    return {"run": run.name, "layout": describe(best.plan, best.grad_accum_steps), "fits": best.fits,
            "memory (GiB)": best.memory.total / GiB, "metric": "MFU" if on_mfu else "tokens/s/GPU",
            "published": published, "predicted": predicted, "error": predicted / published - 1,
            "estimate": best, "source": run.source, "note": run.note}

"""The checks of assignment 08: the memory and the step time of one 5D layout, and the best layout for a cluster.

The learner prices a `Layout` (tp x pp x dp with ZeRO, sequence parallelism whenever tp > 1, a 1F1B
pipeline, micro-batches of `micro_batch_size` sequences, recomputation "none" or "full"; cp only in the
stretch, no ep) with the formulas of chapters 01-06, and the checks compare with what picotron knows:

    check_params_on_first_stage(f)   exactly memory.parameters_on_rank(pp_rank=0): tied and untied models,
                                     even and uneven pipeline splits
    check_memory_per_gpu(f)          memory.estimate_memory(pp_rank=0) term by term (state within 0.5%: ZeRO's
                                     rounding and AdamW's step counters may be left out; activations within
                                     2%), and the memory a real run of the trainer holds on its first pipeline
                                     stage, on 4 CPU ranks (within 2%)
    check_step_time(f)               planner.estimate_plan without overlap, less the stage-to-stage sends
                                     (within 1%): compute, recomputation, tp on the critical path, the 1F1B
                                     bubble, the dp / ZeRO traffic at the bandwidth of the links it crosses
    check_best_layout(f)             the layout returned fits (the first stage's estimate_memory within 90% of
                                     the GPU, the rule the task states) and is as fast, by the planner, as the
                                     fastest layout of the same space that fits (within 1%)
    check_step_time_cp(f)            the stretch: check_step_time's reference on layouts with context
                                     parallelism (cp 2 to 8, the K,V ring hidden or exposed, ZeRO over dp x cp)

This assignment is about the planner, so its checks may use it (chapter 08 validates the planner itself
against measurement and published runs); the learner's code may not: calling picotron's memory
estimates or the planner from inside an answer fails the check. The step-time checks also refuse the byte
counters and link rule chapter 08's `step_time` calls (tp_comm_bytes_per_layer, cp_comm_bytes_per_layer,
zero_comm_bytes, ring_bytes, bubble_formula, simulate, ClusterSpec.bandwidth, group_link): copying that cell
does not answer part 3, writing the counts does.

`fastest_layout` and `planner_step_time` are the reference the checks use, given to the notebook for its
"predict, then run" section, which needs an answer even before the learner has one.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.layout import validate
from picotron_course.checks import Report, on_ranks, refusing
from picotron.memory import (
    GiB, activation_bytes_on_rank, estimate_memory, estimate_memory_per_stage, parameters_on_rank,
    state_bytes_on_rank)
from picotron.memory_tracking import optimizer_state, tensor_bytes
from picotron.parallel.context_parallel_costs import cp_comm_bytes_per_layer
from picotron.parallel.pipeline_schedules import bubble_formula, simulate
from picotron.parallel.tensor_parallel_costs import tp_comm_bytes_per_layer
from picotron.parallel.zero import ring_bytes, zero_comm_bytes
from picotron.planner import ClusterSpec, Plan, PlanEstimate, estimate_plan, group_link, search

__all__ = ["Layout", "plan_of", "is_valid", "layout_name", "check_params_on_first_stage", "check_memory_per_gpu",
           "check_step_time", "check_best_layout", "check_step_time_cp", "candidate_layouts", "first_stage_fits",
           "planner_step_time", "fastest_layout", "MEMORY_CASES", "TIME_CASES", "BEST_CASES", "CP_TIME_CASES"]


@dataclass(frozen=True)
class Layout:
    """A 3D layout: tp x pp x dp GPUs, ZeRO over dp, sequence parallelism whenever tp > 1, 1F1B when pp > 1.

    cp (the stretch) makes it 4D: tp x cp x pp x dp GPUs, zig-zag ring attention, ZeRO over dp x cp.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    recompute: str = "none"           # "none" or "full"
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def __repr__(self) -> str:         # cp only when it is used: parts 1-4 never set it
        cp = f", cp={self.cp}" if self.cp != 1 else ""
        return (f"Layout(tp={self.tp}, pp={self.pp}, dp={self.dp}, zero_stage={self.zero_stage}, "
                f"micro_batch_size={self.micro_batch_size}, recompute={self.recompute!r}{cp})")


def plan_of(layout: Layout, precision: str = "bf16-mixed") -> Plan:
    """The planner's Plan for a Layout."""
    parallel = ParallelConfig(tp=layout.tp, pp=layout.pp, dp=layout.dp, cp=layout.cp, zero_stage=layout.zero_stage,
                              sequence_parallel=layout.tp > 1)
    return Plan(parallel, layout.micro_batch_size, layout.recompute, precision)


def layout_name(layout: Layout) -> str:
    """A short name: "tp4 pp4 dp2 ZeRO-1, recompute full"."""
    parts = [f"{a}{getattr(layout, a)}" for a in ("tp", "cp", "pp", "dp") if getattr(layout, a) > 1]
    parts += [f"ZeRO-{layout.zero_stage}"] if layout.zero_stage else []
    name = " ".join(parts) or "1 GPU"
    return name + (f", recompute {layout.recompute}" if layout.recompute != "none" else "")


def is_valid(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> bool:
    """Whether picotron runs this layout: sizes divide (layout.validate), the batch splits, the pairing is allowed."""
    if global_batch % (layout.dp * layout.micro_batch_size):
        return False
    m = global_batch // (layout.dp * layout.micro_batch_size)
    config = Config(model=dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(model.max_seq_len,
                                                                                                  seq_len)),
                    parallel=plan_of(layout).parallel,
                    train=TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m, seq_len=seq_len))
    try:
        validate(config)
    except (ValueError, NotImplementedError):
        return False
    return True


# picotron's estimates and the planner do these exercises: an answer must not call them.
ANSWERS = {estimate_memory.__code__: "picotron.memory.estimate_memory",
           estimate_memory_per_stage.__code__: "picotron.memory.estimate_memory_per_stage",
           parameters_on_rank.__code__: "picotron.memory.parameters_on_rank",
           state_bytes_on_rank.__code__: "picotron.memory.state_bytes_on_rank",
           activation_bytes_on_rank.__code__: "picotron.memory.activation_bytes_on_rank",
           estimate_plan.__code__: "picotron.planner.estimate_plan", search.__code__: "picotron.planner.search"}
# ... and a step time must not call the counters chapter 08's `step_time` calls: the task is to write them.
TIME_ANSWERS = {**ANSWERS,
                tp_comm_bytes_per_layer.__code__: "picotron.parallel.tensor_parallel_costs.tp_comm_bytes_per_layer",
                cp_comm_bytes_per_layer.__code__: "picotron.parallel.context_parallel_costs.cp_comm_bytes_per_layer",
                zero_comm_bytes.__code__: "picotron.parallel.zero.zero_comm_bytes",
                ring_bytes.__code__: "picotron.parallel.zero.ring_bytes",
                bubble_formula.__code__: "picotron.parallel.pipeline_schedules.bubble_formula",
                simulate.__code__: "picotron.parallel.pipeline_schedules.simulate",
                ClusterSpec.bandwidth.__code__: "picotron.planner.ClusterSpec.bandwidth",
                group_link.__code__: "picotron.planner.group_link"}


def _model(name: str, **changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset(name), **changes)


TINY_UNTIED = ModelConfig(num_layers=6, tie_word_embeddings=False)
# (name, model, layout, seq_len, global_batch)
MEMORY_CASES = [
    ("tiny, one GPU", ModelConfig(), Layout(), 64, 1),
    ("tiny tied, tp2 pp2 (its head copy: last stage)", ModelConfig(), Layout(tp=2, pp=2, micro_batch_size=2), 64, 8),
    ("6 layers untied, pp4 (uneven: 2, 2, 1, 1)", TINY_UNTIED, Layout(pp=4, dp=2), 64, 16),
    ("llama3-8b, tp8 dp8 ZeRO-1", _model("llama3-8b"), Layout(tp=8, dp=8, zero_stage=1), 4096, 64),
    ("llama3-8b, pp4 dp2 ZeRO-2, full", _model("llama3-8b"), Layout(pp=4, dp=2, zero_stage=2, recompute="full"), 4096,
     32),
    ("smollm-1.7b, tp2 pp2 dp4 ZeRO-1", _model("smollm-1.7b"), Layout(tp=2, pp=2, dp=4, zero_stage=1,
                                                                     micro_batch_size=2), 2048, 64),
    ("smollm-135m, dp8 ZeRO-3, mb4", _model("smollm-135m"), Layout(dp=8, zero_stage=3, micro_batch_size=4), 1024, 64),
]
# Layouts the trainer runs on 4 CPU ranks (fp32), each measured on its first pipeline stage.
RUN_MODEL = ModelConfig(num_layers=4, max_seq_len=64)
RUN_CASES = [("dp2 tp2 +SP", Layout(tp=2, dp=2, micro_batch_size=2), 16),
             ("dp2 pp2 1F1B", Layout(pp=2, dp=2, micro_batch_size=2), 16)]
RUN_SEQ = 32


def check_params_on_first_stage(params_on_first_stage: Callable[[ModelConfig, Layout], int]) -> None:
    """params_on_first_stage(model, layout): parameters on a GPU of the first pipeline stage, exactly."""
    with Report("params_on_first_stage", note="expected: memory.parameters_on_rank(model, parallel, pp_rank=0)") \
            as report:
        for name, model, layout, _, _ in MEMORY_CASES:
            expected = parameters_on_rank(model, plan_of(layout).parallel, 0).total
            with refusing("params_on_first_stage", ANSWERS):
                got = params_on_first_stage(dataclasses.replace(model), layout)
            ok = isinstance(got, int) and got == expected
            report.add(ok, "" if ok else _params_hint(model, layout, got, expected), case=name,
                       expected=f"{expected:,}", yours=f"{got:,}" if isinstance(got, int) else repr(got))


def _params_hint(model: ModelConfig, layout: Layout, got, expected: int) -> str:
    if not isinstance(got, int):
        return f"return an int (got {type(got).__name__})"
    h, vocab = model.hidden_size, model.vocab_size * model.hidden_size // layout.tp
    layers = -(-model.num_layers // layout.pp)
    hints = [(vocab, "the first stage holds the embedding but not the LM head (with pp > 1 the head lives on the "
                     "last stage; with pp = 1 and tied embeddings it is the embedding itself)"),
             (-vocab, "the embedding (vocab / tp rows of hidden) is missing"),
             (h, "the final RMSNorm lives on the last stage"),
             (-2 * layers * h * (layout.tp - 1) // layout.tp,
              "the RMSNorm weights are not split by tp: every tp rank keeps them whole")]
    for difference, hint in hints:
        if difference and got - expected == difference:
            return f"off by {got - expected:+,}: {hint}"
    return (f"off by {got - expected:+,}: the first stage holds layers 0..ceil(L/pp)-1 (picotron gives the extra "
            f"layers to the first stages), each with q, k, v, o and the MLP / tp and two whole norms, and the "
            f"embedding")


def check_memory_per_gpu(memory_per_gpu: Callable) -> None:
    """memory_per_gpu(model, layout, seq_len, global_batch, precision) -> dict of bytes on a first-stage GPU."""
    parts = ("parameters", "gradients", "optimizer state", "activations")
    with Report("memory_per_gpu", note="expected: estimate_memory(pp_rank=0); 'measured': the trainer on 4 CPU "
                                       "ranks, fp32, the first stage's rank") as report:
        for name, model, layout, seq, batch in MEMORY_CASES:
            for precision in (("bf16-mixed", "fp32") if layout.gpus == 1 else ("bf16-mixed",)):
                expected = _expected_memory(model, layout, seq, batch, precision)
                with refusing("memory_per_gpu", ANSWERS):
                    got = memory_per_gpu(dataclasses.replace(model), layout, seq, batch, precision)
                detail = _memory_problem(got, expected, parts)
                total = sum(got.values()) if isinstance(got, dict) and all(p in got for p in parts) else math.nan
                report.add(not detail, detail, case=name, precision=precision,
                           **{"expected GiB": f"{sum(expected.values()) / GiB:.3f}",
                              "yours GiB": f"{total / GiB:.3f}" if total == total else "?"})
        measured = on_ranks(_run_on_rank, 4)
        for (name, layout, batch) in RUN_CASES:
            first = max((rank[name] for rank in measured if rank[name]["pp_rank"] == 0), key=lambda r: r["total"])
            with refusing("memory_per_gpu", ANSWERS):
                got = memory_per_gpu(dataclasses.replace(RUN_MODEL), layout, RUN_SEQ, batch, "fp32")
            total = sum(got.values()) if isinstance(got, dict) else math.nan
            ok = isinstance(got, dict) and abs(total / first["total"] - 1) < 0.02
            detail = "" if ok else (f"a real run holds {first['total']:,} bytes on its first pipeline stage (state "
                                    f"{first['state']:,}, peak saved activations {first['activations']:,}); yours "
                                    f"{total:,.0f}")
            report.add(ok, detail, case=f"measured: {name}", precision="fp32",
                       **{"expected GiB": f"{first['total'] / GiB:.4f}", "yours GiB": f"{total / GiB:.4f}"})


def _expected_memory(model: ModelConfig, layout: Layout, seq: int, batch: int, precision: str) -> dict:
    plan = plan_of(layout, precision)
    m = batch // (layout.dp * layout.micro_batch_size)
    model = dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(model.max_seq_len, seq))
    memory = estimate_memory(model, TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m,
                                                seq_len=seq), plan.parallel, precision=precision, pp_rank=0)
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer state": memory.optimizer,
            "activations": memory.activations}


def _memory_problem(got, expected: dict, parts: tuple) -> str:
    if not isinstance(got, dict) or any(p not in got for p in parts):
        return f"return a dict with the keys {list(parts)} (bytes each)"
    for part in parts:
        tolerance = 0.02 if part == "activations" else 0.005
        if not abs(got[part] - expected[part]) <= tolerance * max(expected[part], 1):
            hint = {"activations": "a layer's saved bytes (given) x the first stage's layers x the micro-batches in "
                                   "flight (min(pp, m) under 1F1B), plus, with pp = 1, the final norm and the loss",
                    "optimizer state": "12 bytes per parameter in bf16-mixed (8 in fp32), divided by dp from ZeRO-1 on",
                    "gradients": "divided by dp from ZeRO-2 on",
                    "parameters": "divided by dp at ZeRO-3 only"}[part]
            return f"{part}: expected {expected[part]:,}, got {got[part]:,} ({hint})"
    return ""


def _run_on_rank() -> dict:
    """The trainer for each RUN_CASE on this rank: its state after a step, and its peak saved activations."""
    from picotron.memory_tracking import SavedActivations
    from picotron.mesh import Mesh
    from picotron.parallel.pipeline_parallel import stage_parameters
    from picotron.train import Trainer
    out = {}
    for name, layout, batch in RUN_CASES:
        m = batch // (layout.dp * layout.micro_batch_size)
        config = Config(model=RUN_MODEL, parallel=plan_of(layout).parallel,
                        train=TrainConfig(precision="fp32", steps=2, micro_batch_size=layout.micro_batch_size,
                                          grad_accum_steps=m, seq_len=RUN_SEQ))
        mesh = Mesh(dp=layout.dp, pp=layout.pp, tp=layout.tp)
        trainer = Trainer(config, mesh)
        trainer.train_step(0)
        with SavedActivations() as saved:
            trainer.train_step(1)
        stages = getattr(trainer, "stages", None)
        params = stage_parameters(stages) if stages else list(trainer.model.parameters())
        state = (tensor_bytes(params) + tensor_bytes(w.grad for w in params)
                 + tensor_bytes(optimizer_state(trainer.optimizer)))
        out[name] = {"pp_rank": mesh.pp_rank, "state": state, "activations": saved.peak,
                     "total": state + saved.peak}
    return out


# ==== the step time ===============================================================================
H100_NODE, H100_2_NODES, H100_8_NODES = ClusterSpec.h100(8), ClusterSpec.h100(16), ClusterSpec.h100(64)
# (name, model, layout, cluster, seq_len, global_batch)
TIME_CASES = [
    ("llama3-8b, dp8 ZeRO-1, one node", _model("llama3-8b"), Layout(dp=8, zero_stage=1, recompute="full"), H100_NODE,
     4096, 64),
    ("llama3-8b, tp8 (SP), one node", _model("llama3-8b"), Layout(tp=8), H100_NODE, 4096, 16),
    ("llama3-8b, tp4 dp4 ZeRO-2, 2 nodes", _model("llama3-8b"), Layout(tp=4, dp=4, zero_stage=2, micro_batch_size=2),
     H100_2_NODES, 4096, 64),
    ("llama3-8b, pp4 dp4 ZeRO-1, 2 nodes", _model("llama3-8b"), Layout(pp=4, dp=4, zero_stage=1), H100_2_NODES, 4096,
     64),
    ("smollm-1.7b, dp16 ZeRO-3, 2 nodes", _model("smollm-1.7b"), Layout(dp=16, zero_stage=3), H100_2_NODES, 2048, 64),
    ("llama3-8b, tp8 pp2 dp4 ZeRO-1, full, 8 nodes", _model("llama3-8b"),
     Layout(tp=8, pp=2, dp=4, zero_stage=1, recompute="full"), H100_8_NODES, 8192, 64),
]


def planner_step_time(model: ModelConfig, layout: Layout, cluster: ClusterSpec, seq_len: int, global_batch: int, *,
                      sends: bool = False) -> tuple[float, dict]:
    """The planner's seconds per step of `layout` (bf16-mixed, nothing overlapped), and its parts.

    sends=False leaves out the stage-to-stage sends, as the assignment's step_time does."""
    estimate = estimate_plan(model, plan_of(layout), cluster, seq_len=seq_len, global_batch=global_batch,
                             overlap=False)
    time = {k: v for k, v in estimate.time.items() if sends or k != "pp p2p"}
    return sum(time.values()), time


def check_step_time(step_time: Callable) -> None:
    """step_time(model, layout, cluster, seq_len, global_batch) -> seconds per optimizer step, no overlap."""
    _check_times("step_time", step_time, TIME_CASES)


def _check_times(title: str, step_time: Callable, cases: list) -> None:
    with Report(title, note="expected: planner.estimate_plan(..., overlap=False), without the stage-to-stage "
                            "sends; bf16-mixed, kernels at ASSUMED_MFU of peak") as report:
        for name, model, layout, cluster, seq, batch in cases:
            expected, parts = planner_step_time(model, layout, cluster, seq, batch)
            with refusing(title, TIME_ANSWERS):
                got = step_time(dataclasses.replace(model), layout, cluster, seq, batch)
            ok = isinstance(got, (int, float)) and abs(got / expected - 1) < 0.01
            detail = "" if ok else ("the planner's parts: " + ", ".join(f"{k} {v:.4g} s" for k, v in parts.items()
                                                                        if v) + _time_hint(parts, got, expected))
            report.add(ok, detail, case=name, **{"expected (s)": f"{expected:.4g}",
                                                 "yours (s)": f"{got:.4g}" if isinstance(got, (int, float)) else "?"})


def _time_hint(parts: dict, got, expected: float) -> str:
    if not isinstance(got, (int, float)):
        return "; return a float, seconds"
    for name, seconds in parts.items():
        if seconds and abs((expected - got) / seconds - 1) < 0.02:
            return f"; yours lacks about the {name} part"
        if seconds and abs((got - expected) / seconds - 1) < 0.02:
            return f"; yours counts the {name} part twice"
    return ""


# ==== the best layout =============================================================================
BEST_CASES = [("llama3-8b on one node, 64 x 4096", _model("llama3-8b"), H100_NODE, 4096, 64),
              ("smollm-1.7b on 2 nodes, 32 x 2048", _model("smollm-1.7b"), H100_2_NODES, 2048, 32),
              ("llama3-8b on 2 nodes, 32 x 8192", _model("llama3-8b"), H100_2_NODES, 8192, 32)]


def candidate_layouts(model: ModelConfig, cluster: ClusterSpec, seq_len: int, global_batch: int,
                      cp_sizes: tuple = (1,)) -> list[Layout]:
    """The space of the exercise: tp within a node, any pp and dp, ZeRO 0-2, recompute none or full, one sequence
    per micro-batch; only layouts picotron runs. cp_sizes=(1, 2, 4, 8) adds context parallelism (the stretch)."""
    n = cluster.num_gpus
    out = []
    for tp in (d for d in range(1, cluster.gpus_per_node + 1) if n % d == 0):
        for cp in (c for c in cp_sizes if (n // tp) % c == 0):
            for pp in (d for d in range(1, min(model.num_layers, n // (tp * cp)) + 1) if (n // (tp * cp)) % d == 0):
                dp = n // (tp * cp * pp)
                for zero in ((0, 1, 2) if dp * cp > 1 else (0,)):
                    for recompute in ("none", "full"):
                        layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero, recompute=recompute, cp=cp)
                        if is_valid(model, layout, seq_len, global_batch):
                            out.append(layout)
    return out


def _first_stage_bytes(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int) -> int:
    """estimate_memory(pp_rank=0), bf16-mixed: what memory_per_gpu adds up (the first stage's GPU)."""
    m = global_batch // (layout.dp * layout.micro_batch_size)
    model = dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(model.max_seq_len, seq_len))
    return estimate_memory(model, TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m,
                                              seq_len=seq_len), plan_of(layout).parallel, precision="bf16-mixed",
                           pp_rank=0).total


def first_stage_fits(model: ModelConfig, layout: Layout, cluster: ClusterSpec, seq_len: int,
                     global_batch: int) -> bool:
    """Whether a first-stage GPU's memory (picotron's estimate, bf16-mixed) is within 90% of the GPU's."""
    return _first_stage_bytes(model, layout, seq_len, global_batch) <= 0.9 * cluster.gpu_memory


def fastest_layout(model: ModelConfig, cluster: ClusterSpec, seq_len: int, global_batch: int, *, sends: bool = False,
                   cp_sizes: tuple = (1,)) -> tuple[Layout, PlanEstimate, float]:
    """The planner's answer to best_layout: the fastest of candidate_layouts whose first stage fits in 90% of a GPU.

    Returns the layout, its PlanEstimate (overlap=False; .links says which groups cross nodes) and its seconds
    per step, the stage-to-stage sends left out unless sends=True."""
    ranked = []
    for layout in candidate_layouts(model, cluster, seq_len, global_batch, cp_sizes):
        if first_stage_fits(model, layout, cluster, seq_len, global_batch):
            ranked.append((planner_step_time(model, layout, cluster, seq_len, global_batch, sends=sends)[0], layout))
    if not ranked:
        raise ValueError(f"no layout of {cluster.num_gpus} GPUs fits {global_batch} x {seq_len} tokens")
    seconds, layout = min(ranked, key=lambda x: x[0])
    estimate = estimate_plan(model, plan_of(layout), cluster, seq_len=seq_len, global_batch=global_batch,
                             overlap=False)
    return layout, estimate, seconds


def check_best_layout(best_layout: Callable) -> None:
    """best_layout(model, cluster, seq_len, global_batch) -> the fastest Layout that fits, among candidate_layouts."""
    with Report("best_layout", note="expected: the planner's fastest layout of candidate_layouts whose first stage "
                                    "fits in 90% of a GPU (overlap=False, sends left out); yours must fit and be as "
                                    "fast (1%)") as report:
        for name, model, cluster, seq, batch in BEST_CASES:
            priced = {layout: (_first_stage_bytes(model, layout, seq, batch),
                               planner_step_time(model, layout, cluster, seq, batch)[0])
                      for layout in candidate_layouts(model, cluster, seq, batch)}
            limit = 0.9 * cluster.gpu_memory
            fastest = min(((t, layout) for layout, (memory, t) in priced.items() if memory <= limit),
                          key=lambda x: x[0])
            with refusing("best_layout", ANSWERS):
                got = best_layout(dataclasses.replace(model), cluster, seq, batch)
            if got not in priced:
                report.add(False, f"return one of candidate_layouts(...), a Layout (got {got!r})", case=name,
                           expected=layout_name(fastest[1]), yours=repr(got)[:40])
                continue
            memory, seconds = priced[got]
            fits = memory <= limit
            ok = fits and seconds <= fastest[0] * 1.01
            detail = "" if ok else (f"{layout_name(got)} needs {memory / GiB:.1f} GiB on a first-stage GPU, more "
                                    f"than 90% of {cluster.gpu_memory / 1e9:.0f} GB" if not fits else
                                    f"{layout_name(got)} takes {seconds:.3f} s a step; {layout_name(fastest[1])} "
                                    f"fits and takes {fastest[0]:.3f} s")
            report.add(ok, detail, case=name, expected=layout_name(fastest[1]), yours=layout_name(got),
                       **{"your step (s)": f"{seconds:.3f}", "fastest (s)": f"{fastest[0]:.3f}"})


# ==== the stretch: context parallelism in the step time ==========================================
# (name, model, layout, cluster, seq_len, global_batch): the ring hidden behind attention (long sequences, NVLink),
# exposed (8k tokens, cp across nodes) and in between; ZeRO over dp x cp, with dp = 1 too; tp, pp and recomputation.
CP_TIME_CASES = [
    ("llama3-8b, cp2 dp4 ZeRO-1, one node, 16k", _model("llama3-8b"), Layout(cp=2, dp=4, zero_stage=1), H100_NODE,
     16384, 16),
    ("llama3-8b, tp2 cp4, full, one node, 32k", _model("llama3-8b"), Layout(tp=2, cp=4, recompute="full"), H100_NODE,
     32768, 8),
    ("llama3-8b, tp2 cp8, 2 nodes, 8k: ring exposed", _model("llama3-8b"), Layout(tp=2, cp=8), H100_2_NODES, 8192, 8),
    ("llama3-8b, cp8 pp2 ZeRO-1, 2 nodes, 32k", _model("llama3-8b"), Layout(cp=8, pp=2, zero_stage=1), H100_2_NODES,
     32768, 8),
    ("smollm-1.7b, cp4 dp4 ZeRO-2, 2 nodes, 16k", _model("smollm-1.7b"), Layout(cp=4, dp=4, zero_stage=2),
     H100_2_NODES, 16384, 32),
    ("llama3-8b, tp4 cp4 dp4, 8 nodes, 8k: ring across nodes", _model("llama3-8b"), Layout(tp=4, cp=4, dp=4),
     H100_8_NODES, 8192, 32),
]


def check_step_time_cp(step_time_cp: Callable) -> None:
    """step_time_cp(model, layout, cluster, seq_len, global_batch) -> seconds per step of a layout with cp > 1."""
    _check_times("step_time_cp", step_time_cp, CP_TIME_CASES)

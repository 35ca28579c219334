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

from picotron.costs import training_flops_per_token
from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.layout import validate
from picotron_course.checks import on_ranks, refusing
from picotron_course.engine import Check, Exact, Misconception, Quantity, named, observe_in_process
from picotron.memory import (
    GiB, activation_bytes_on_rank, estimate_memory, estimate_memory_per_stage, parameters_on_rank,
    state_bytes_on_rank)
from picotron.memory_tracking import optimizer_state, tensor_bytes
from picotron.parallel.context_parallel_costs import cp_comm_bytes_per_layer
from picotron.parallel.pipeline_schedules import bubble_formula, simulate
from picotron.parallel.tensor_parallel_costs import tp_comm_bytes_per_layer
from picotron.parallel.zero import ring_bytes, zero_comm_bytes
from picotron.planner import ASSUMED_MFU, ClusterSpec, Plan, PlanEstimate, estimate_plan, group_link, search

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


# ==== how an answer is run and its numbers compared ==============================================
def _guarded(check: Check, answer, refused: dict):
    """refusing(refused) around a call of `answer`, unless it is one of the check's misconceptions (they call
    picotron's estimates to be the right value off by their mistake's cost)."""
    return refusing(check.title, {} if any(answer == m.answer for m in check.misconceptions) else refused)


def _kind(value) -> str:
    return "a number" if isinstance(value, (int, float)) else f"a {type(value).__name__}"


@dataclass(frozen=True)
class Near(Quantity):
    """A number near picotron's: |got - want| <= rel * max(want, floor) with a floor (bytes), else
    |got / want - 1| < rel (seconds, a measured total)."""
    rel: float = 0.0
    floor: float = 0.0

    def equal(self, got, want) -> bool:
        want = want["total"] if isinstance(want, dict) else want
        if not isinstance(got, (int, float)) or not isinstance(want, (int, float)):
            return got == want
        return abs(got - want) <= self.rel * max(want, self.floor) if self.floor else abs(got / want - 1) < self.rel

    def shown(self, got, want) -> str:
        return f"expected {want:,}, got {got:,}" if isinstance(got, (int, float)) else super().shown(got, want)


def _off(name: str, value: Callable, off: Callable) -> Callable:
    """A wrong answer: picotron's value, off by off(value, *arguments) (the mistake's cost)."""
    return named(name, lambda *args: off(value(*args), *args))


# ==== 1. the parameters of the first stage ======================================================
def _params(model: ModelConfig, layout: Layout) -> int:
    return parameters_on_rank(model, plan_of(layout).parallel, 0).total


class _Count(Exact):
    def shown(self, got, want) -> str:
        return f"off by {got - want:+,} (expected {want:,}, got {got:,})" if isinstance(got, int) else \
            super().shown(got, want)


def _params_seen(answer, case) -> dict:
    with _guarded(PARAMS, answer, ANSWERS):
        got = answer(dataclasses.replace(case["_model"]), case["_layout"])
    return {"returned": "an int" if isinstance(got, int) else f"a {type(got).__name__}", "count": got}


def _params_off(name: str, off: Callable) -> Callable:
    return _off(name, _params, lambda right, model, layout: right + off(model, layout))


def _vocab(model: ModelConfig, layout: Layout) -> int:
    return model.vocab_size * model.hidden_size // layout.tp


PARAMS = Check(
    "params_on_first_stage", observe=observe_in_process(_params_seen),
    note="expected: memory.parameters_on_rank(model, parallel, pp_rank=0)",
    cases=[dict(case=name, _model=model, _layout=layout) for name, model, layout, _, _ in MEMORY_CASES],
    expect=lambda case, got: {"returned": "an int", "count": _params(case["_model"], case["_layout"])},
    columns=lambda case, got: {"expected": f"{_params(case['_model'], case['_layout']):,}",
                               "yours": f"{got['count']:,}" if isinstance(got["count"], int) else repr(got["count"])},
    quantities={"returned": Exact("what params_on_first_stage returned (return an int)"),
                "count": _Count("the parameters on a first-stage GPU (it holds layers 0..ceil(L/pp)-1: picotron gives "
                                "the extra layers to the first stages; each with q, k, v, o and the MLP / tp and two "
                                "whole norms; and the embedding)")},
    misconceptions=[
        Misconception(_off("params_float", _params, lambda right, *_: float(right)), "return an int"),
        Misconception(_params_off("params_with_the_head_everywhere", lambda m, l: _vocab(m, l) if l.pp > 1 else 0),
                      "the first stage holds the embedding but not the LM head (with pp > 1 the head lives on the "
                      "last stage; with pp = 1 and tied embeddings it is the embedding itself)"),
        Misconception(_params_off("params_without_the_embedding", lambda m, l: -_vocab(m, l)),
                      "the embedding (vocab / tp rows of hidden) is missing"),
        Misconception(_params_off("params_final_norm_on_the_first_stage",
                                  lambda m, l: m.hidden_size if l.pp > 1 else 0),
                      "the final RMSNorm lives on the last stage"),
        Misconception(_params_off("params_norms_split_by_tp", lambda m, l: -2 * -(-m.num_layers // l.pp)
                                  * m.hidden_size * (l.tp - 1) // l.tp),
                      "the RMSNorm weights are not split by tp: every tp rank keeps them whole"),
        Misconception(named("params_floor_layers", lambda m, l: _params(dataclasses.replace(
            m, num_layers=m.num_layers // l.pp * l.pp), l)),
                      "picotron gives the extra layers to the first stages: the first stage holds layers "
                      "0..ceil(L/pp)-1, not floor(L/pp)")])


def check_params_on_first_stage(params_on_first_stage: Callable[[ModelConfig, Layout], int]) -> None:
    """params_on_first_stage(model, layout): parameters on a GPU of the first pipeline stage, exactly."""
    PARAMS(params_on_first_stage)


# ==== 2. the memory of a first-stage GPU ========================================================
PARTS = ("parameters", "gradients", "optimizer state", "activations")


class _Measured(Near):
    def shown(self, got, want) -> str:
        yours = f"{got:,.0f}" if isinstance(got, (int, float)) else repr(got)
        return (f"a real run holds {want['total']:,} bytes on its first pipeline stage (state {want['state']:,}, "
                f"peak saved activations {want['activations']:,}); yours {yours}")


def _first_stage_memory(model: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                        precision: str = "bf16-mixed"):
    """estimate_memory(pp_rank=0): what memory_per_gpu adds up (the first stage's GPU)."""
    m = global_batch // (layout.dp * layout.micro_batch_size)
    model = dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(model.max_seq_len, seq_len))
    return estimate_memory(model, TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m,
                                              seq_len=seq_len), plan_of(layout).parallel, precision=precision,
                           pp_rank=0)


def _expected_memory(model: ModelConfig, layout: Layout, seq: int, batch: int, precision: str) -> dict:
    memory = _first_stage_memory(model, layout, seq, batch, precision)
    return {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer state": memory.optimizer,
            "activations": memory.activations}


def _observe_memory(answers: list, cases: list) -> list:
    measured = on_ranks(_run_on_rank, 4) if any("_run" in case for case in cases) else []   # once a call

    def one(answer, case):
        with _guarded(MEMORY, answer, ANSWERS):
            got = answer(dataclasses.replace(case["_model"]), case["_layout"], case["_seq"], case["_batch"],
                         case["precision"])
        whole = isinstance(got, dict) and all(part in got for part in PARTS)
        out = {"returned": "a dict of the four parts" if whole else _kind(got)} | (got if whole else {})
        if "_run" in case:
            out["measured"] = max((rank[case["_run"]] for rank in measured if rank[case["_run"]]["pp_rank"] == 0),
                                  key=lambda r: r["total"])
            out["total"] = sum(got.values()) if isinstance(got, dict) else math.nan
        return out
    return [[one(answer, case) for case in cases] for answer in answers]


def _memory_wanted(case: dict, got: dict) -> dict:
    if "_run" in case:
        return {"returned": "a dict of the four parts", "total": got["measured"]}
    return {"returned": "a dict of the four parts", **_expected_memory(case["_model"], case["_layout"], case["_seq"],
                                                                       case["_batch"], case["precision"])}


def _memory_off(name: str, off: Callable) -> Callable:
    return _off(name, lambda *args: _expected_memory(*args), lambda right, *args: right | off(right, *args))


def _in_flight(layout: Layout, batch: int) -> int:
    return min(layout.pp, batch // (layout.dp * layout.micro_batch_size)) if layout.pp > 1 else 1


MEMORY = Check(
    "memory_per_gpu", observe=_observe_memory, expect=_memory_wanted,
    note="expected: estimate_memory(pp_rank=0); 'measured': the trainer on 4 CPU ranks, fp32, the first stage's rank",
    cases=[dict(case=name, precision=precision, _model=model, _layout=layout, _seq=seq, _batch=batch)
           for name, model, layout, seq, batch in MEMORY_CASES
           for precision in (("bf16-mixed", "fp32") if layout.gpus == 1 else ("bf16-mixed",))]
    + [dict(case=f"measured: {name}", precision="fp32", _model=RUN_MODEL, _layout=layout, _seq=RUN_SEQ, _batch=batch,
            _run=name) for name, layout, batch in RUN_CASES],
    columns=lambda case, got: {"expected GiB": f"{sum(_memory_wanted(case, got)[p] for p in PARTS) / GiB:.3f}"
                               if "_run" not in case else f"{got['measured']['total'] / GiB:.4f}",
                               "yours GiB": f"{sum(got[p] for p in PARTS) / GiB:.3f}" if "parameters" in got else "?"},
    quantities={"returned": Exact(f"what memory_per_gpu returned (return a dict with the keys {list(PARTS)}, bytes "
                                  f"each)"),
                "parameters": Near("parameters (divided by dp at ZeRO-3 only)", rel=0.005, floor=1),
                "gradients": Near("gradients (divided by dp from ZeRO-2 on)", rel=0.005, floor=1),
                "optimizer state": Near("optimizer state (12 bytes per parameter in bf16-mixed, 8 in fp32, divided by "
                                        "dp from ZeRO-1 on)", rel=0.005, floor=1),
                "activations": Near("activations (a layer's saved bytes (given) x the first stage's layers x the "
                                    "micro-batches in flight (min(pp, m) under 1F1B), plus, with pp = 1, the final "
                                    "norm and the loss)", rel=0.02, floor=1),
                "total": _Measured("the memory of a real run", rel=0.02)},
    misconceptions=[
        Misconception(_memory_off("memory_without_zero", lambda right, model, layout, *rest: _expected_memory(
            model, dataclasses.replace(layout, zero_stage=0), *rest)),
                      "ZeRO divides by dp: the optimizer state from ZeRO-1 on, the gradients from ZeRO-2 on, the "
                      "parameters at ZeRO-3"),
        Misconception(_memory_off("memory_one_micro_batch_in_flight", lambda right, model, layout, seq, batch, _: {
            "activations": right["activations"] // _in_flight(layout, batch)}),
                      "under 1F1B the first stage holds the activations of min(pp, m) micro-batches in flight, not "
                      "one"),
        Misconception(_memory_off("memory_fp32_optimizer_always", lambda right, *args: {
            "optimizer state": right["optimizer state"] * 8 // (12 if args[-1] == "bf16-mixed" else 8)}),
                      "the optimizer state takes 12 bytes per parameter in bf16-mixed (fp32 master weights, m and "
                      "v), 8 in fp32")])


def check_memory_per_gpu(memory_per_gpu: Callable) -> None:
    """memory_per_gpu(model, layout, seq_len, global_batch, precision) -> dict of bytes on a first-stage GPU."""
    MEMORY(memory_per_gpu)


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


class _Seconds(float):
    """The planner's seconds per step, with its parts."""
    parts: dict = {}


class StepTime(Near):
    """Seconds within 1% of the planner's; a difference names the planner's parts, and the part it is about."""

    def shown(self, got, want) -> str:
        parts = getattr(want, "parts", {})
        text = f"expected {want:.4g} s, got " + (f"{got:.4g} s" if isinstance(got, (int, float)) else repr(got))
        text += "; the planner's parts: " + ", ".join(f"{k} {v:.4g} s" for k, v in parts.items() if v)
        for name, seconds in parts.items() if isinstance(got, (int, float)) else ():
            if seconds and abs((want - got) / seconds - 1) < 0.02:
                return text + f"; yours lacks about the {name} part"
            if seconds and abs((got - want) / seconds - 1) < 0.02:
                return text + f"; yours counts the {name} part twice"
        return text


def _planner_seconds(model, layout, cluster, seq, batch) -> _Seconds:
    total, parts = planner_step_time(model, layout, cluster, seq, batch)
    seconds = _Seconds(total)
    seconds.parts = parts
    return seconds


def _observe_times(check: Callable) -> Callable:
    def one(answer, case):
        with _guarded(check(), answer, TIME_ANSWERS):
            got = answer(dataclasses.replace(case["_model"]), case["_layout"], case["_cluster"], case["_seq"],
                         case["_batch"])
        return {"returned": _kind(got), "seconds": got}
    return observe_in_process(one)


def _time_check(title: str, cases: list, says: str, misconceptions: list) -> Check:
    check = Check(
        title, observe=_observe_times(lambda: check),
        note="expected: planner.estimate_plan(..., overlap=False), without the stage-to-stage sends; bf16-mixed, "
             "kernels at ASSUMED_MFU of peak",
        cases=[dict(case=name, _model=model, _layout=layout, _cluster=cluster, _seq=seq, _batch=batch)
               for name, model, layout, cluster, seq, batch in cases],
        expect=lambda case, got: {"returned": "a number", "seconds": _time_of(case)},
        columns=lambda case, got: {"expected (s)": f"{_time_of(case):.4g}", "yours (s)": f"{got['seconds']:.4g}"
                                   if got["returned"] == "a number" else "?"},
        quantities={"returned": Exact(f"what {title} returned (return a float, seconds)"),
                    "seconds": StepTime(says, rel=0.01)},
        misconceptions=misconceptions)
    return check


def _time_of(case: dict) -> _Seconds:
    return _planner_seconds(case["_model"], case["_layout"], case["_cluster"], case["_seq"], case["_batch"])


def _time_off(name: str, off: Callable) -> Callable:
    """A wrong step time: the planner's, off by off(seconds with .parts, model, layout, cluster, seq, batch)."""
    return _off(name, _planner_seconds, lambda right, *args: right + off(right, *args))


def _recomputed(right, model, layout, cluster, seq, batch) -> float:
    if layout.recompute == "none":
        return 0.0
    return planner_step_time(model, dataclasses.replace(layout, recompute="none"), cluster, seq, batch)[0] - right


STEP_TIME = _time_check("step_time", TIME_CASES, "seconds per step (compute, recomputation, tp on the critical "
                        "path, the 1F1B bubble, the dp / ZeRO traffic at the bandwidth of the links it crosses)", [
    Misconception(_time_off("time_without_bubble", lambda right, *args: -right.parts.get("bubble", 0.0)),
                  "1F1B leaves each stage idle (pp - 1) / (m + pp - 1) of the step: count the bubble"),
    Misconception(_time_off("time_tp_over_the_network", lambda right, model, layout, cluster, seq, batch:
                            planner_step_time(model, layout, dataclasses.replace(
                                cluster, intra_node_bandwidth=cluster.inter_node_bandwidth), seq, batch)[0] - right),
                  "a group inside a node talks over NVLink (intra_node_bandwidth); only a group that spans nodes "
                  "crosses the network (inter_node_bandwidth)"),
    Misconception(_time_off("time_forgets_recomputation", _recomputed),
                  "recompute='full' reruns each layer's forward in backward, tp collectives included: count it")])


def check_step_time(step_time: Callable) -> None:
    """step_time(model, layout, cluster, seq_len, global_batch) -> seconds per optimizer step, no overlap."""
    STEP_TIME(step_time)


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


def first_stage_fits(model: ModelConfig, layout: Layout, cluster: ClusterSpec, seq_len: int,
                     global_batch: int) -> bool:
    """Whether a first-stage GPU's memory (picotron's estimate, bf16-mixed) is within 90% of the GPU's."""
    return _first_stage_memory(model, layout, seq_len, global_batch).total <= 0.9 * cluster.gpu_memory


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


_PRICED: dict = {}   # by case: every candidate's first-stage bytes and seconds (fixed numbers: once a process)


def _priced(case: dict) -> dict:
    if case["case"] not in _PRICED:
        model, cluster, seq, batch = case["_model"], case["_cluster"], case["_seq"], case["_batch"]
        _PRICED[case["case"]] = {layout: (_first_stage_memory(model, layout, seq, batch).total,
                                          planner_step_time(model, layout, cluster, seq, batch)[0])
                                 for layout in candidate_layouts(model, cluster, seq, batch)}
    return _PRICED[case["case"]]


class _Step(float):
    """A layout's seconds a step; `fastest` names the fastest layout that fits (on the expected value)."""
    name: str = ""
    fastest: str = ""


class AsFast(Quantity):
    """As fast as the fastest layout that fits (within 1%); two answers' layouts are the same mistake when equal."""

    def equal(self, got, want) -> bool:
        if not want.fastest:   # another answer's layout
            return getattr(got, "name", None) == want.name
        return isinstance(got, float) and got <= want * 1.01

    def shown(self, got, want) -> str:
        if not isinstance(got, _Step):
            return super().shown(got, want)
        return f"{got.name} takes {got:.3f} s a step; {want.fastest} fits and takes {want:.3f} s"


class _Told(Exact):
    def shown(self, got, want) -> str:
        return str(got)


def _best_seen(answer, case) -> dict:
    priced, cluster = _priced(case), case["_cluster"]
    with _guarded(BEST, answer, ANSWERS):
        got = answer(dataclasses.replace(case["_model"]), cluster, case["_seq"], case["_batch"])
    if got not in priced:
        return {"returned": f"{got!r}"[:60]}
    memory, seconds = priced[got]
    step = _Step(seconds)
    step.name = layout_name(got)
    return {"returned": "one of candidate_layouts", "fits": "fits" if memory <= 0.9 * cluster.gpu_memory else (
        f"{layout_name(got)} needs {memory / GiB:.1f} GiB on a first-stage GPU, more than 90% of "
        f"{cluster.gpu_memory / 1e9:.0f} GB"), "seconds": step}


def _fastest(case: dict) -> _Step:
    limit = 0.9 * case["_cluster"].gpu_memory
    seconds, layout = min(((t, layout) for layout, (memory, t) in _priced(case).items() if memory <= limit),
                          key=lambda x: x[0])
    step = _Step(seconds)
    step.name = step.fastest = layout_name(layout)
    return step


def best_ignores_memory(model, cluster, seq, batch):
    return min(candidate_layouts(model, cluster, seq, batch),
               key=lambda layout: planner_step_time(model, layout, cluster, seq, batch)[0])


def best_always_data_parallel(model, cluster, seq, batch):
    return Layout(dp=cluster.num_gpus, zero_stage=2, recompute="full")


BEST = Check(
    "best_layout", observe=observe_in_process(_best_seen),
    note="expected: the planner's fastest layout of candidate_layouts whose first stage fits in 90% of a GPU "
         "(overlap=False, sends left out); yours must fit and be as fast (1%)",
    cases=[dict(case=name, _model=model, _cluster=cluster, _seq=seq, _batch=batch)
           for name, model, cluster, seq, batch in BEST_CASES],
    expect=lambda case, got: {"returned": "one of candidate_layouts", "fits": "fits", "seconds": _fastest(case)},
    columns=lambda case, got: {"expected": _fastest(case).name, "yours": getattr(got.get("seconds"), "name", "?"),
                               "your step (s)": f"{got['seconds']:.3f}" if "seconds" in got else "?",
                               "fastest (s)": f"{_fastest(case):.3f}"},
    quantities={"returned": Exact("what best_layout returned (return one of candidate_layouts(...), a Layout)"),
                "fits": _Told("whether its first stage fits in 90% of a GPU's memory"),
                "seconds": AsFast("its seconds a step, by the planner")},
    misconceptions=[
        Misconception(best_ignores_memory, "the fastest layout may not fit: keep only the layouts whose first "
                                            "stage (memory_per_gpu, summed) is within 90% of the GPU's memory"),
        Misconception(best_always_data_parallel, "pure data parallelism is not always fastest: price every layout "
                                                  "of candidate_layouts with step_time and return the fastest that "
                                                  "fits")])


def check_best_layout(best_layout: Callable) -> None:
    """best_layout(model, cluster, seq_len, global_batch) -> the fastest Layout that fits, among candidate_layouts."""
    BEST(best_layout)


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


def _ring(model, layout, cluster, seq) -> tuple[float, float]:
    """The K,V ring of one micro-batch on the first stage: seconds it sends, seconds of attention core hiding it."""
    layers = -(-model.num_layers // layout.pp)
    heads = dataclasses.replace(model, num_attention_heads=model.num_attention_heads // layout.tp,
                                num_key_value_heads=model.num_key_value_heads // layout.tp, head_dim=model.head_dim)
    sent = layers * cp_comm_bytes_per_layer(heads, layout.micro_batch_size, seq, layout.cp, "zigzag", 2)
    tokens = layout.micro_batch_size * seq // layout.cp
    core = layers * 12 * tokens * seq * model.num_attention_heads * model.head_dim / layout.tp
    return sent / cluster.bandwidth(layout.tp, layout.cp), core / (cluster.peak_flops * ASSUMED_MFU)


def _cp_off(name: str, per_micro_batch: Callable) -> Callable:
    """A wrong step time with cp: the planner's, off by a cost per micro-batch, stretched by 1F1B."""
    def off(right, model, layout, cluster, seq, batch):
        m = batch // (layout.dp * layout.micro_batch_size)
        return (m + layout.pp - 1) * per_micro_batch(right.parts, m, model, layout, cluster, seq)
    return _time_off(name, off)


def _ring_in_bf16(parts, m, model, layout, cluster, seq) -> float:
    sent, core = _ring(model, layout, cluster, seq)
    c = layout.cp
    bf16 = sent * (4 * (c - 1) + 2 * c) / (4 * (c - 1) + 4 * c)    # K,V blocks in bf16, their gradients in fp32
    return max(0.0, bf16 - core) - max(0.0, sent - core)


def _over_the_slice(parts, m, model, layout, cluster, seq) -> float:
    model = dataclasses.replace(model, recompute=layout.recompute)
    ratio = training_flops_per_token(model, seq // layout.cp) / training_flops_per_token(model, seq)
    return (parts["compute"] + parts["recompute"]) / m * (ratio - 1)


def _dp_replicas(parts, m, model, layout, cluster, seq) -> float:
    n, c = layout.dp, layout.cp
    if n == 1:
        return -parts["dp"] / (m + layout.pp - 1)
    scale = ((n - 1) / n) / ((n * c - 1) / (n * c)) * cluster.bandwidth(layout.tp, n * c) / cluster.bandwidth(
        layout.tp * c, n)
    return parts["dp"] * (scale - 1) / (m + layout.pp - 1)


def _cp_ignored(model, layout, cluster, seq, batch):
    return planner_step_time(model, dataclasses.replace(layout, cp=1), dataclasses.replace(
        cluster, num_gpus=cluster.num_gpus // layout.cp), seq, batch)[0]


STEP_TIME_CP = _time_check("step_time_cp", CP_TIME_CASES, "seconds per step with cp (s/cp tokens a rank, the K,V "
                           "ring past the attention core, dp / ZeRO over dp x cp)", [
    Misconception(named("cp_ignored", _cp_ignored), "with cp each rank computes s/cp tokens of every sequence, "
                  "passes K,V around the ring, and averages gradients over dp x cp: part 3's answer counts none"),
    Misconception(_cp_off("cp_without_the_ring", lambda parts, m, *_: -parts["cp"] / m),
                  "the K,V ring is missing: cp - 1 steps pass a K,V block (and in backward its gradients) to the "
                  "next rank; count what the attention core does not hide"),
    Misconception(_cp_off("cp_ring_never_hidden", lambda parts, m, model, layout, cluster, seq: _ring(
        model, layout, cluster, seq)[0] - parts["cp"] / m),
                  "the ring's blocks travel while the attention core computes (12 s h FLOPs a token, forward and "
                  "backward): only what exceeds it is exposed"),
    Misconception(_cp_off("cp_attention_over_the_slice", _over_the_slice),
                  "a token of the slice still attends over the whole sequence: count the FLOPs per token at s, "
                  "on s/cp tokens"),
    Misconception(_cp_off("cp_ranks_not_replicas", _dp_replicas),
                  "the cp ranks hold the same weights: gradients are averaged (and ZeRO shards) over dp x cp ranks"),
    Misconception(_cp_off("cp_tp_on_the_whole_sequence", lambda parts, m, model, layout, *_:
                          parts["tp"] / m * (layout.cp - 1)),
                  "with cp a rank's tp collectives carry its slice, s/cp tokens, not the whole sequence"),
    Misconception(_cp_off("cp_ring_gradients_in_bf16", _ring_in_bf16),
                  "the K,V gradients travel the ring in fp32 (4 bytes), the K,V blocks in bf16")])


def check_step_time_cp(step_time_cp: Callable) -> None:
    """step_time_cp(model, layout, cluster, seq_len, global_batch) -> seconds per step of a layout with cp > 1."""
    STEP_TIME_CP(step_time_cp)

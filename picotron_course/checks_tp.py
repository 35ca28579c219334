"""The checks of assignment 04: tensor parallelism, each layer's matrices split over the tp ranks.

Each check runs the learner's code on 4 ranks, twice over: as one tp group of 4, and as two tp
groups of 2 (ranks 0-1 and 2-3, from dist.new_group, so a rank's place in its group differs from
its global rank). It compares with single-process torch computed here, in the parent: a full
F.linear, or F.cross_entropy on the full-vocabulary logits (in float64), and their autograd
gradients, cut into the shard each rank should hold. Nothing here uses
picotron.parallel.tensor_parallel, the module the assignment rebuilds.

    check_copy_to_tp(CopyToTP)                  f: identity forward; backward one all-reduce (sum) of the gradient
    check_reduce_from_tp(ReduceFromTP)          g: forward one all-reduce (sum); identity backward
    check_column_parallel(ColumnParallelLinear) rows of W; this rank's output features; input gradient summed
    check_row_parallel(RowParallelLinear)       columns of W; partial outputs summed; no communication backward
    check_tp_mlp(ColumnParallelLinear, RowParallelLinear)
                                                column -> GELU -> row equals the full MLP, one all-reduce each way
    check_vocab_parallel_cross_entropy(fn)      loss and logit gradients equal F.cross_entropy's; at most 3 numbers
                                                per token all-reduced, nothing else, nothing in backward
    check_gather_from_sp(GatherFromSP)          stretch: all-gather the sequence forward; reduce-scatter (sum) backward
    check_reduce_scatter_to_sp(ReduceScatterToSP)
                                                stretch: reduce-scatter (sum) the sequence forward; all-gather backward
    check_sp_mlp(SequenceParallelMLP)           stretch: all-gather -> column -> GELU -> row -> reduce-scatter equals the
                                                full MLP on this rank's tokens; one all-gather and one reduce-scatter
                                                each way, no all-reduce

`mlp_with_g(g)` is the "predict, then run" cell's harness: the MLP with a given g on the ranks
against one process (gradients, and a few steps of AdamW and of SGD).

Inside the ranks, `recorded_collectives` wraps torch.distributed's collectives (and point-to-point
sends) to note every call: the operation, the elements and bytes handed in, the reduction and the
size of the group it ran over. Forward and backward are recorded apart.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_course.checks import (Report, close_enough, collectives_observed, max_abs_error, mismatch,
                                    on_ranks, payload_of, rank_tensor)
from picotron_course.checks import all_ranks_ok, grad_of, not_the_course_answer, reduce_name, worst_error

__all__ = ["check_copy_to_tp", "check_reduce_from_tp", "check_column_parallel", "check_row_parallel",
           "check_tp_mlp", "check_vocab_parallel_cross_entropy", "check_gather_from_sp", "check_reduce_scatter_to_sp",
           "check_sp_mlp", "mlp_with_g", "recorded_collectives", "Call", "WORLD", "TP_SIZES"]

WORLD = 4
TP_SIZES = (4, 2)          # one group of all 4 ranks; two groups of 2 (ranks 0-1, 2-3)
FP32 = torch.float32
PACKAGE = "picotron.parallel.tensor_parallel"

REGION_SHAPES = [(2, 3, 5), (4, 6)]                     # x of f and g
COLUMN_CASES = [((2, 3), 6, 8), ((5,), 4, 12)]          # (leading dims of x, in_features, out_features)
ROW_CASES = [((2, 3), 8, 6), ((5,), 12, 4)]             # the split dimension (out for column, in for row) / 4
MLP_CASES = [((2, 3), 8, 16), ((5,), 6, 12)]            # (leading dims, hidden, ffn)
SP_SHAPES = [(2, 8, 3), (1, 4, 5)]                      # (batch, seq, hidden): the sequence splits over 4 and 2
SP_MLP_CASES = [((2, 8), 8, 16), ((1, 4), 6, 12)]       # ((batch, seq), hidden, ffn)
# (name, leading dims, vocabulary, logit offset, upstream gradient). Near 100, exp overflows in fp32
# (it does above 88.7) unless the max is subtracted first.
CE_CASES = [("random", (2, 3), 16, 0.0, 1.0), ("logits near 100", (2, 3), 16, 100.0, 1.0),
            ("upstream 0.25", (4, 5), 24, 0.0, 0.25)]
CE_SPREAD = 3.0           # logits = offset + 3 x N(0, 1): a softmax that is neither flat nor one-hot
# Roundings behind one number checked here (picotron.tolerance): the MLP's sums over up to 16 features each way,
# forward and backward, a softmax over 24 logits and a gradient summed over 20 tokens.
ROUNDINGS = 2 * (16 + 16) + 24 + 20


# ---- recording the collectives a rank makes ---------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One call: operation, elements and bytes handed in, reduction ("" if none), ranks of its group."""
    op: str
    numel: int
    nbytes: int
    reduce: str
    group_size: int


_REDUCING = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
             "reduce_scatter_single", "_reduce_scatter_base")


@contextmanager
def recorded_collectives() -> Iterator[list[Call]]:
    """Inside the block, every collective (and send) this rank calls is appended to the yielded list.

    An all-reduce counts its tensor; any other operation its largest tensor argument. Calls made
    inside a recorded call (torch's deprecated names call the new ones) are not counted twice.
    """
    calls: list[Call] = []

    def record(name: str, arguments: dict) -> None:
        op = name.strip("_").removesuffix("_base")
        payload = payload_of(op, arguments)
        reduce = reduce_name(arguments.get("op", dist.ReduceOp.SUM)) if name in _REDUCING else ""
        group_size = dist.get_world_size(arguments.get("group"))
        calls.append(Call(op, 0 if payload is None else payload.numel(),
                          0 if payload is None else payload.numel() * payload.element_size(), reduce, group_size))

    with collectives_observed(record):
        yield calls


def describe(calls: list[Call], tp: int | None = None) -> str:
    """'none', or e.g. 'all_reduce sum 96 B' (identical calls as '2x ...'; the group size when it is not tp)."""
    if not calls:
        return "none"
    counts: dict[Call, int] = {}
    for call in calls:
        counts[call] = counts.get(call, 0) + 1
    parts = []
    for call, n in counts.items():
        text = " ".join(filter(None, [call.op, call.reduce, f"{call.nbytes} B"]))
        if tp is not None and call.group_size != tp and call.op not in ("send", "isend"):
            text += f" over {call.group_size}"
        parts.append(f"{n}x {text}" if n > 1 else text)
    return ", ".join(parts)


# ---- tools shared by the checks --------------------------------------------------------------
def _groups() -> list[tuple[int, object]]:
    """(tp, group) pairs this rank belongs to: all 4 ranks, then its pair (every rank makes both pairs)."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    return [(WORLD, dist.group.WORLD), (2, pairs[dist.get_rank() // 2])]


def _cases(items: list) -> list[tuple[int, int, object]]:
    """(tp, seed, item) in the order the ranks run them."""
    return [(tp, seed, item) for tp in TP_SIZES for seed, item in enumerate(items)]


def _comm_problem(per_rank: list, key: str, tp: int, nbytes: int | None, where: str, why: str) -> str:
    """Compare every rank's recorded calls with what the step needs: nothing (`nbytes` None) or one
    all-reduce (sum) of `nbytes` over the tp group. `why` explains the expected communication."""
    for rank, result in enumerate(per_rank):
        calls = result.get(key)
        if calls is None:
            continue
        at = f"{where} (rank {rank})"
        if nbytes is None:
            if calls:
                return f"{at} made {describe(calls, tp)}; expected no communication: {why}"
            continue
        if not calls:
            return f"{at} made no collective; {why}"
        others = sorted({c.op for c in calls} - {"all_reduce"})
        if others:
            return f"{at} called {', '.join(others)}; one all-reduce is all it needs: {why}"
        if len(calls) > 1:
            return f"{at} made {len(calls)} all-reduces ({describe(calls, tp)}); expected one, of {nbytes} B"
        call = calls[0]
        if call.reduce != "sum":
            return (f"{at} all-reduced with {call.reduce.upper()}; the pieces add up to the result: use SUM "
                    "(dist.ReduceOp.SUM, the default)")
        if call.group_size != tp:
            return (f"{at} all-reduced over {call.group_size} ranks, not the {tp} of the tp group: pass "
                    "group=<the tp group> to the collective")
        if call.nbytes != nbytes:
            return f"{at} all-reduced {call.nbytes} B; expected {nbytes} B"
    return ""


def _value_problem(per_rank: list, key: str, wants: list, what: str, hint: Callable | None = None) -> str:
    """First rank whose `key` differs from its expected value, with a hint when one fits."""
    for rank, (result, want) in enumerate(zip(per_rank, wants)):
        got = result.get(key)
        if got is None:
            return f"rank {rank}: {what} is None"
        if not close_enough(got, want.to(got.dtype), FP32, n=ROUNDINGS):
            extra = hint(got, want, rank) if hint else ""
            return f"rank {rank}: {what} is wrong{extra}: {mismatch(got, want.to(got.dtype))}"
    return ""


def _group_rank_note(tp: int, rank: int) -> str:
    if tp < WORLD and rank % tp != rank:
        return (f" (rank {rank} is rank {rank % tp} of its tp group of {tp}: slice with dist.get_rank(group) "
                "and dist.get_world_size(group), not the global rank)")
    return ""


# ---- the region functions (f, g and SP's two), on the ranks --------------------------------------
# Per function: rank i's input x_i and the gradient g_i it backpropagates into y, from (i, tp, shape, seed).
_REGION_INPUTS = {
    "f": lambda i, tp, shape, seed: (rank_tensor(0, shape, FP32, seed), _upstream(i, shape, seed).float()),
    "g": lambda i, tp, shape, seed: (_partial(i, shape, seed).float(), rank_tensor(30, shape, FP32, seed)),
    "gather": lambda i, tp, shape, seed: (_tokens(_sp_input(shape, seed), i, tp).float(),      # (b, s/t, h)
                                          _sp_upstream(i, shape, seed).float()),
    "scatter": lambda i, tp, shape, seed: (_sp_upstream(i, shape, seed).float(),              # a partial sum
                                           _tokens(_sp_input(shape, seed), i, tp).float()),
}


def _region_on_rank(Fn: type, kind: str, shapes: list) -> list:
    """y = Fn.apply(x_i, group), then backward from g_i (when every rank's y has g_i's shape and needs grad),
    each with the collectives it made."""
    rank, out = dist.get_rank(), []
    for tp, group in _groups():
        for seed, shape in enumerate(shapes):
            x, upstream = _REGION_INPUTS[kind](rank % tp, tp, shape, seed)
            x = x.clone().requires_grad_()
            with recorded_collectives() as forward:
                y = Fn.apply(x, group)
            result = {"forward": forward, "y": y.detach().clone()}
            out.append(result)
            if all_ranks_ok(y.shape == upstream.shape and y.requires_grad, group):
                with recorded_collectives() as backward:
                    (y * upstream).sum().backward()
                result.update(backward=backward, x_grad=grad_of(x))
    return out


# ---- 1. f and g ------------------------------------------------------------------------------
def check_copy_to_tp(CopyToTP: type) -> None:
    """f: y = x on every rank with no communication; in backward, one all-reduce (sum) over the tp group
    gives x.grad = the sum of every rank's gradient of y."""
    not_the_course_answer("check_copy_to_tp", CopyToTP, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y = CopyToTP.apply(x, group), x the same on every rank; "
            "rank i backpropagates its own gradient g_i of y. Expected: y = x, no communication forward; "
            "x.grad = sum of the g_i, one all-reduce (sum) backward")
    with Report("CopyToTP (f)", note=note) as report:
        results = on_ranks(_region_on_rank, WORLD, CopyToTP, "f", REGION_SHAPES)
        for c, (tp, seed, shape) in enumerate(_cases(REGION_SHAPES)):
            per_rank = [r[c] for r in results]
            x = rank_tensor(0, shape, FP32, seed).double()
            upstream = sum(_upstream(i, shape, seed) for i in range(tp))
            nbytes = x.numel() * 4
            detail = (_comm_problem(per_rank, "forward", tp, None, "the forward",
                                    "f's forward is the identity: every rank already holds the whole x")
                      or _value_problem(per_rank, "y", [x] * WORLD, "y", lambda *_: ": f's forward returns x unchanged")
                      or _comm_problem(per_rank, "backward", tp, nbytes, "the backward",
                                       "f's backward must all-reduce (sum) the gradient: each rank's gradient covers "
                                       "only its share of what x feeds, and x's gradient is the sum of them all")
                      or _value_problem(per_rank, "x_grad", [upstream] * WORLD, "x.grad"))
            report.add(not detail, detail, tp=tp, x=shape,
                       **{"forward comm": describe(per_rank[0]["forward"], tp),
                          "backward comm (want)": f"all_reduce sum {nbytes} B",
                          "backward comm (got)": describe(per_rank[0].get("backward", []), tp)},
                       max_err_y=worst_error(per_rank, "y", [x] * WORLD),
                       max_err_grad=worst_error(per_rank, "x_grad", [upstream] * WORLD))


def _upstream(i: int, shape: tuple, seed: int) -> torch.Tensor:
    """The gradient rank i of a tp group backpropagates into f's output (it differs per rank)."""
    return rank_tensor(10 + i, shape, FP32, seed).double()


def check_reduce_from_tp(ReduceFromTP: type) -> None:
    """g: y = the sum of every rank's x, by one all-reduce (sum) over the tp group; in backward, no
    communication: x.grad = y's gradient, which every rank holds whole."""
    not_the_course_answer("check_reduce_from_tp", ReduceFromTP, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y = ReduceFromTP.apply(x_i, group), x_i different on every "
            "rank; every rank backpropagates the same gradient g of y. Expected: y = sum of the x_i, one all-reduce "
            "(sum) forward; x_i.grad = g, no communication backward")
    with Report("ReduceFromTP (g)", note=note) as report:
        results = on_ranks(_region_on_rank, WORLD, ReduceFromTP, "g", REGION_SHAPES)
        for c, (tp, seed, shape) in enumerate(_cases(REGION_SHAPES)):
            per_rank = [r[c] for r in results]
            total = sum(_partial(i, shape, seed) for i in range(tp))
            upstream = rank_tensor(30, shape, FP32, seed).double()
            nbytes = total.numel() * 4

            def mean_hint(got, want, rank, tp=tp):
                mean = close_enough(got, want / tp, FP32, n=ROUNDINGS)
                return ": it is the mean, the sum divided by tp; use SUM" if mean else ""

            def grad_hint(got, want, rank, tp=tp):
                return (f": it is {tp} x the gradient of y, summed over the ranks; g's backward is the identity"
                        if close_enough(got, want * tp, FP32, n=ROUNDINGS) else "")

            detail = (_comm_problem(per_rank, "forward", tp, nbytes, "the forward",
                                    "g's forward must all-reduce (sum) x: the layer's output is the sum of every "
                                    "rank's partial output")
                      or _value_problem(per_rank, "y", [total] * WORLD, "y", mean_hint)
                      or _comm_problem(per_rank, "backward", tp, None, "the backward",
                                       "g's backward is the identity: every rank computes the same loss from the same "
                                       "sum, so each already holds the whole gradient of y")
                      or _value_problem(per_rank, "x_grad", [upstream] * WORLD, "x.grad", grad_hint))
            report.add(not detail, detail, tp=tp, x=shape,
                       **{"forward comm (want)": f"all_reduce sum {nbytes} B",
                          "forward comm (got)": describe(per_rank[0]["forward"], tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err_y=worst_error(per_rank, "y", [total] * WORLD),
                       max_err_grad=worst_error(per_rank, "x_grad", [upstream] * WORLD))


def _partial(i: int, shape: tuple, seed: int) -> torch.Tensor:
    """Rank i's partial sum, the input of g."""
    return rank_tensor(20 + i, shape, FP32, seed).double()


# ---- 2-4. column- and row-parallel linears, and the MLP they make ---------------------------------
def _weight(out_features: int, in_features: int, seed: int, which: int = 0) -> torch.Tensor:
    """The full weight (out, in) of a bias-free Linear; every rank and the parent make the same."""
    return rank_tensor(100 + which, (out_features, in_features), FP32, seed) / math.sqrt(in_features)


def _linear(out_features: int, in_features: int, seed: int, which: int = 0) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(_weight(out_features, in_features, seed, which))
    return linear


def _reference(weights: list[torch.Tensor], x: torch.Tensor, upstream: torch.Tensor) -> dict:
    """One process: y = W_1 gelu(W_0 x) (or W_0 x for one weight), sum(y * upstream) backpropagated, float64."""
    ws = [w.double().requires_grad_() for w in weights]
    x = x.double().requires_grad_()
    y = F.linear(x, ws[0])
    if len(ws) == 2:
        y = F.linear(F.gelu(y), ws[1])
    (y * upstream.double()).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "w_grads": [w.grad for w in ws]}


def _shard_rows(t: torch.Tensor, i: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, 0)[i]


def _shard_last(t: torch.Tensor, i: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, -1)[i]


def _weight_problem(per_rank: list, wants: list, tp: int, kind: str, key: str = "weight",
                    name: str = "module.weight") -> str:
    """The shard each rank keeps: an nn.Parameter, its shape, its values; and no full copy kept besides."""
    for rank, (result, want) in enumerate(zip(per_rank, wants)):
        info = result[key]
        rows = kind == "column"
        keeps = ("rows [i*out/t, (i+1)*out/t) of linear.weight, shape (out/t, in): nn.Linear stores W as "
                 "(out_features, in_features), so its output features are the rows" if rows else
                 "columns [i*in/t, (i+1)*in/t) of linear.weight, shape (out, in/t): nn.Linear stores W as "
                 "(out_features, in_features), so its input features are the columns")
        if info["weight"] is None:
            return f"rank {rank}: {name} is missing; keep this rank's shard there as an nn.Parameter"
        if not info["is_param"]:
            return (f"rank {rank}: {name} is a {type(info['weight']).__name__}, not an nn.Parameter: wrap a copy of "
                    "the shard, nn.Parameter(linear.weight.detach()[...].clone()), so autograd fills its .grad")
        shape = tuple(info["weight"].shape)
        if shape != tuple(want.shape):
            other = (want.shape[0] * tp, want.shape[1] // tp) if rows else (want.shape[0] // tp, want.shape[1] * tp)
            swapped = (" That is the other layer's shard." if shape == other else "")
            return (f"rank {rank}: {name} has shape {shape}, expected {tuple(want.shape)}: rank i keeps {keeps}."
                    f"{swapped}{_group_rank_note(tp, rank)}")
        if not close_enough(info["weight"], want.float(), FP32, n=ROUNDINGS):
            return (f"rank {rank}: {name} holds the wrong slice: rank i keeps {keeps}"
                    f"{_group_rank_note(tp, rank)}. {mismatch(info['weight'], want.float())}")
        if info["param_numel"] != want.numel():
            return (f"rank {rank}: the module has {info['param_numel']} parameter elements, its shard {want.numel()}: "
                    "keep only the shard (self.linear = linear would keep the whole weight on every rank)")
        if info["storage_numel"] > want.numel():
            return (f"rank {rank}: {name} is a view into the memory of the whole weight ({info['storage_numel']} "
                    f"elements) for a shard of {want.numel()}: every rank would still store all of W. Keep a copy "
                    "of the slice: nn.Parameter(linear.weight.detach()[...].clone())")
    return ""


def _module_info(module: nn.Module, attribute: str = "weight") -> dict:
    """What a rank keeps: the tensor at `attribute`, whether it is a Parameter, the module's parameter
    elements, and the elements of the memory the tensor lives in (more than its own for a view)."""
    weight = getattr(module, attribute, None)
    tensor = isinstance(weight, torch.Tensor)
    return {"weight": weight.detach().clone() if tensor else None,
            "is_param": isinstance(weight, nn.Parameter),
            "param_numel": sum(p.numel() for p in module.parameters()),
            "storage_numel": weight.untyped_storage().nbytes() // weight.element_size() if tensor else 0}


def _shape_ok(info: dict, shape: tuple) -> bool:
    return info["is_param"] and tuple(info["weight"].shape) == shape


def check_column_parallel(ColumnParallelLinear: type) -> None:
    """Rank i keeps rows [i out/t, (i+1) out/t) of W; y_i = x W_i^T is its slice of the output features,
    with no communication; backward sums the input gradient over the tp group (one all-reduce) and
    leaves each rank the gradient of its own rows of W."""
    not_the_course_answer("check_column_parallel", ColumnParallelLinear, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; ColumnParallelLinear(linear, group) on x (the same on every "
            "rank), rank i backpropagates its slice of dL/dY. Compared with one full F.linear: y, x.grad, W.grad")
    with Report("ColumnParallelLinear", note=note) as report:
        results = on_ranks(_linear_on_rank, WORLD, ColumnParallelLinear, "column", COLUMN_CASES)
        for c, (tp, seed, (lead, fan_in, fan_out)) in enumerate(_cases(COLUMN_CASES)):
            per_rank = [r[c] for r in results]
            x, upstream = _inputs(lead, fan_in, fan_out, seed)
            ref = _reference([_weight(fan_out, fan_in, seed)], x, upstream)
            w = _weight(fan_out, fan_in, seed)
            shards = [_shard_rows(w, r % tp, tp) for r in range(WORLD)]
            ys = [_shard_last(ref["y"], r % tp, tp) for r in range(WORLD)]
            w_grads = [_shard_rows(ref["w_grads"][0], r % tp, tp) for r in range(WORLD)]
            nbytes = x.numel() * 4
            detail = (_weight_problem(per_rank, shards, tp, "column")
                      or _comm_problem(per_rank, "forward", tp, None, "the forward",
                                       "x is whole on every rank, and each computes its own output features "
                                       "(enter through f, whose forward is the identity)")
                      or _value_problem(per_rank, "y", ys, "y (this rank's output features)")
                      or _comm_problem(per_rank, "backward", tp, nbytes, "the backward",
                                       "enter through f (CopyToTP.apply(x, self.group)): each rank's dL/dx covers "
                                       "only its output features, and the whole gradient is their sum")
                      or _value_problem(per_rank, "x_grad", [ref["x_grad"]] * WORLD, "x.grad")
                      or _value_problem(per_rank, "w_grad", w_grads, "weight.grad (this rank's rows of W.grad)"))
            report.add(not detail, detail, tp=tp, x=(*lead, fan_in), W=(fan_out, fan_in),
                       **{"shard (want)": tuple(shards[0].shape),
                          "shard (got)": _shape_of(per_rank, tuple(shards[0].shape)),
                          "forward comm": describe(per_rank[0].get("forward", []), tp),
                          "backward comm (want)": f"all_reduce sum {nbytes} B",
                          "backward comm (got)": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", ys), ("x_grad", [ref["x_grad"]] * WORLD),
                                                   ("w_grad", w_grads)]))


def check_row_parallel(RowParallelLinear: type) -> None:
    """Rank i keeps columns [i in/t, (i+1) in/t) of W and gets its slice x_i of the input features;
    y = sum_i x_i W_i^T on every rank, by one all-reduce; backward needs no communication."""
    not_the_course_answer("check_row_parallel", RowParallelLinear, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; RowParallelLinear(linear, group) on x_i, rank i's slice of x's "
            "features; every rank backpropagates the same dL/dY. Compared with one full F.linear: y, x.grad, W.grad")
    with Report("RowParallelLinear", note=note) as report:
        results = on_ranks(_linear_on_rank, WORLD, RowParallelLinear, "row", ROW_CASES)
        for c, (tp, seed, (lead, fan_in, fan_out)) in enumerate(_cases(ROW_CASES)):
            per_rank = [r[c] for r in results]
            x, upstream = _inputs(lead, fan_in, fan_out, seed)
            ref = _reference([_weight(fan_out, fan_in, seed)], x, upstream)
            w = _weight(fan_out, fan_in, seed)
            shards = [_shard_last(w, r % tp, tp) for r in range(WORLD)]
            x_grads = [_shard_last(ref["x_grad"], r % tp, tp) for r in range(WORLD)]
            w_grads = [_shard_last(ref["w_grads"][0], r % tp, tp) for r in range(WORLD)]
            nbytes = ref["y"].numel() * 4

            def partial_hint(got, want, rank, tp=tp):
                partial = F.linear(_shard_last(x.double(), rank % tp, tp), _shard_last(w.double(), rank % tp, tp))
                return (": it is this rank's partial sum x_i W_i^T; the output is the sum over the tp ranks"
                        if close_enough(got, partial, FP32, n=ROUNDINGS) else "")

            detail = (_weight_problem(per_rank, shards, tp, "row")
                      or _comm_problem(per_rank, "forward", tp, nbytes, "the forward",
                                       "leave through g (ReduceFromTP.apply(y, self.group)): each rank holds a partial "
                                       "sum x_i W_i^T, and the output is their sum")
                      or _value_problem(per_rank, "y", [ref["y"]] * WORLD, "y", partial_hint)
                      or _comm_problem(per_rank, "backward", tp, None, "the backward",
                                       "every rank holds the whole dL/dy, and x_i's and W_i's gradients need only it "
                                       "and this rank's own x_i and W_i (g's backward is the identity)")
                      or _value_problem(per_rank, "x_grad", x_grads, "x.grad (this rank's input features)")
                      or _value_problem(per_rank, "w_grad", w_grads, "weight.grad (this rank's columns of W.grad)"))
            report.add(not detail, detail, tp=tp, x=(*lead, fan_in), W=(fan_out, fan_in),
                       **{"shard (want)": tuple(shards[0].shape),
                          "shard (got)": _shape_of(per_rank, tuple(shards[0].shape)),
                          "forward comm (want)": f"all_reduce sum {nbytes} B",
                          "forward comm (got)": describe(per_rank[0].get("forward", []), tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", [ref["y"]] * WORLD), ("x_grad", x_grads),
                                                   ("w_grad", w_grads)]))


def _inputs(lead: tuple, fan_in: int, fan_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full input x (..., in) and the full upstream gradient dL/dY (..., out)."""
    return rank_tensor(1, (*lead, fan_in), FP32, seed), rank_tensor(2, (*lead, fan_out), FP32, seed)


def _shape_of(per_rank: list, want: tuple, key: str = "weight") -> object:
    """The shard shape to show: the first rank's that is wrong, else rank 0's."""
    shapes = ["-" if r[key]["weight"] is None else tuple(r[key]["weight"].shape) for r in per_rank]
    return next((shape for shape in shapes if shape != want), shapes[0])


def _max_err(per_rank: list, pairs: list) -> float:
    return max((worst_error(per_rank, key, wants) for key, wants in pairs), key=lambda e: -1 if math.isnan(e) else e)


def _linear_on_rank(Layer: type, kind: str, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for tp, group in _groups():
        i = rank % tp
        for seed, (lead, fan_in, fan_out) in enumerate(cases):
            module = Layer(_linear(fan_out, fan_in, seed), group)
            not_the_course_answer(f"check_{kind}_parallel", module, course=PACKAGE)
            result = {"weight": _module_info(module)}
            out.append(result)
            want = (fan_out // tp, fan_in) if kind == "column" else (fan_out, fan_in // tp)
            if not all_ranks_ok(_shape_ok(result["weight"], want), group):
                continue
            x, upstream = _inputs(lead, fan_in, fan_out, seed)
            if kind == "column":
                upstream = _shard_last(upstream, i, tp)   # dL/dY_i: this rank's output features
            else:
                x = _shard_last(x, i, tp)                 # x_i: this rank's input features
            x = x.clone().requires_grad_()
            with recorded_collectives() as forward:
                y = module(x)
            result.update(forward=forward, y=y.detach().clone())
            if not all_ranks_ok(y.shape == upstream.shape and y.requires_grad, group):
                continue
            with recorded_collectives() as backward:
                (y * upstream).sum().backward()
            result.update(backward=backward, x_grad=grad_of(x), w_grad=grad_of(module.weight))
    return out


def check_tp_mlp(ColumnParallelLinear: type, RowParallelLinear: type) -> None:
    """Column-parallel (h -> f), GELU on this rank's f/t features, row-parallel (f -> h): the full MLP,
    with one all-reduce in forward (leaving) and one in backward (entering), none in between."""
    not_the_course_answer("check_tp_mlp", ColumnParallelLinear, RowParallelLinear, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y = row(gelu(column(x))) on x, the same on every rank; every "
            "rank backpropagates the same dL/dY. Compared with the full MLP in one process")
    with Report("tensor-parallel MLP", note=note) as report:
        results = on_ranks(_mlp_on_rank, WORLD, ColumnParallelLinear, RowParallelLinear, MLP_CASES)
        for c, (tp, seed, (lead, hidden, ffn)) in enumerate(_cases(MLP_CASES)):
            per_rank = [r[c] for r in results]
            x, upstream = _inputs(lead, hidden, hidden, seed)
            w_up, w_down = _weight(ffn, hidden, seed, 0), _weight(hidden, ffn, seed, 1)
            ref = _reference([w_up, w_down], x, upstream)
            up_shards = [_shard_rows(w_up, r % tp, tp) for r in range(WORLD)]
            down_shards = [_shard_last(w_down, r % tp, tp) for r in range(WORLD)]
            up_grads = [_shard_rows(ref["w_grads"][0], r % tp, tp) for r in range(WORLD)]
            down_grads = [_shard_last(ref["w_grads"][1], r % tp, tp) for r in range(WORLD)]
            nbytes = x.numel() * 4
            why = ("a column-parallel layer followed by a row-parallel one talks only where the pair starts "
                   "(f: backward) and ends (g: forward)")
            detail = (_weight_problem(per_rank, up_shards, tp, "column", "up", "column.weight")
                      or _weight_problem(per_rank, down_shards, tp, "row", "down", "row.weight")
                      or _one_call_problem(per_rank, "forward", tp, nbytes, why)
                      or _value_problem(per_rank, "y", [ref["y"]] * WORLD, "y")
                      or _one_call_problem(per_rank, "backward", tp, nbytes, why)
                      or _value_problem(per_rank, "x_grad", [ref["x_grad"]] * WORLD, "x.grad")
                      or _value_problem(per_rank, "up_grad", up_grads, "column.weight.grad")
                      or _value_problem(per_rank, "down_grad", down_grads, "row.weight.grad"))
            report.add(not detail, detail, tp=tp, x=(*lead, hidden), ffn=ffn,
                       **{"each pass (want)": f"all_reduce sum {nbytes} B",
                          "forward comm (got)": describe(per_rank[0].get("forward", []), tp),
                          "backward comm (got)": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", [ref["y"]] * WORLD), ("x_grad", [ref["x_grad"]] * WORLD),
                                                   ("up_grad", up_grads), ("down_grad", down_grads)]))


def _one_call_problem(per_rank: list, key: str, tp: int, nbytes: int, why: str) -> str:
    return _comm_problem(per_rank, key, tp, nbytes, f"the MLP's {key}", f"expected exactly one all-reduce: {why}")


def _mlp_on_rank(Column: type, Row: type, cases: list) -> list:
    out = []
    for tp, group in _groups():
        for seed, (lead, hidden, ffn) in enumerate(cases):
            column = Column(_linear(ffn, hidden, seed, 0), group)
            row = Row(_linear(hidden, ffn, seed, 1), group)
            not_the_course_answer("check_tp_mlp", column, row, course=PACKAGE)
            result = {"up": _module_info(column), "down": _module_info(row)}
            out.append(result)
            shapes_ok = _shape_ok(result["up"], (ffn // tp, hidden)) and _shape_ok(result["down"], (hidden, ffn // tp))
            if not all_ranks_ok(shapes_ok, group):
                continue
            x, upstream = _inputs(lead, hidden, hidden, seed)
            x = x.clone().requires_grad_()
            with recorded_collectives() as forward:
                y = row(F.gelu(column(x)))      # (..., hidden): GELU works feature by feature, on f/t of them
            result.update(forward=forward, y=y.detach().clone())
            if not all_ranks_ok(y.shape == upstream.shape and y.requires_grad, group):
                continue
            with recorded_collectives() as backward:
                (y * upstream).sum().backward()
            result.update(backward=backward, x_grad=grad_of(x), up_grad=grad_of(column.weight),
                          down_grad=grad_of(row.weight))
    return out


# ---- 5. vocab-parallel cross-entropy ----------------------------------------------------------
def _ce_inputs(lead: tuple, vocab: int, offset: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full logits (..., V) and the targets (...), as every rank and the parent make them."""
    logits = offset + CE_SPREAD * rank_tensor(200, (*lead, vocab), FP32, seed)
    generator = torch.Generator().manual_seed(300 + seed)
    return logits, torch.randint(0, vocab, lead, generator=generator)


def _ce_reference(logits: torch.Tensor, targets: torch.Tensor, upstream: float) -> tuple[torch.Tensor, torch.Tensor]:
    """F.cross_entropy (mean over tokens) of the full logits in float64, and d(upstream x loss)/dlogits."""
    z = logits.double().requires_grad_()
    loss = F.cross_entropy(z.flatten(0, -2), targets.flatten())
    (upstream * loss).backward()
    return loss.detach(), z.grad


def _every_rank_losses(logits: torch.Tensor, targets: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Losses of the classic mistake: every rank adds 'its' target logit, not just the owner.

    Non-owners index a wrong entry (0, or the target clamped into their slice), with the max
    subtracted on each rank or once."""
    z = logits.double()
    k = z.shape[-1] // tp
    lse, m = torch.logsumexp(z, -1), z.amax(-1)
    out = []
    for pick in (lambda d: torch.where((d >= 0) & (d < k), d, 0), lambda d: d.clamp(0, k - 1)):
        picked = sum(z[..., r * k:(r + 1) * k].gather(-1, pick(targets - r * k)[..., None]).squeeze(-1)
                     for r in range(tp))
        out += [(lse - picked).mean(), (lse - picked + (tp - 1) * m).mean()]
    return out


def check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy: Callable) -> None:
    """Each rank gets its V/t slice of the logits; every rank must return the mean cross-entropy of the
    full logits, and backward must give each rank its slice of the full gradient. Forward may
    all-reduce at most 3 numbers per token (no other collective: no rank may gather b s V logits);
    backward needs no communication."""
    not_the_course_answer("check_vocab_parallel_cross_entropy", vocab_parallel_cross_entropy, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; rank i gets vocabulary entries [i V/t, (i+1) V/t) of the "
            "logits, backpropagates upstream x loss. Compared with F.cross_entropy on the full logits (float64). "
            "Forward: all-reduces only, of at most 3 numbers per token; backward: none")
    with Report("vocab_parallel_cross_entropy", note=note) as report:
        results = on_ranks(_ce_on_rank, WORLD, vocab_parallel_cross_entropy, CE_CASES)
        for c, (tp, seed, (name, lead, vocab, offset, upstream)) in enumerate(_cases(CE_CASES)):
            per_rank = [r[c] for r in results]
            logits, targets = _ce_inputs(lead, vocab, offset, seed)
            want, grad = _ce_reference(logits, targets, upstream)
            grads = [_shard_last(grad, r % tp, tp) for r in range(WORLD)]
            tokens = targets.numel()
            detail = _ce_problem(per_rank, tp, tokens, want, grads, logits, targets, upstream)
            losses = [r["loss"] for r in per_rank if r.get("loss") is not None]
            wrong = [l for l in losses if not close_enough(l, want.float(), FP32, n=ROUNDINGS)]
            got = (wrong or losses or [torch.tensor(math.nan)])[0].item()   # the first wrong rank's, else rank 0's
            report.add(not detail, detail, case=name, tp=tp, tokens=tokens, V=vocab,
                       **{"loss (want)": f"{want.item():.6f}", "loss (got)": f"{got:.6f}",
                          "forward comm (want)": f"all_reduce <= {3 * tokens * 4} B",
                          "forward comm (got)": describe(per_rank[0].get("forward", []), tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err_loss=max((max_abs_error(l, want) for l in losses), default=math.nan),
                       max_err_grad=worst_error(per_rank, "grad", grads))


def _ce_problem(per_rank: list, tp: int, tokens: int, want: torch.Tensor, grads: list, logits: torch.Tensor,
                targets: torch.Tensor, upstream: float) -> str:
    for rank, result in enumerate(per_rank):
        if result.get("not_scalar"):
            return (f"rank {rank}: vocab_parallel_cross_entropy returned {result['not_scalar']}; return the mean loss "
                    "as a 0-dim tensor that backward can start from")
    problem = _ce_comm_problem(per_rank, tp, tokens)
    if problem:
        return problem
    losses = [r["loss"] for r in per_rank]
    for rank, loss in enumerate(losses):
        if not torch.isfinite(loss):
            return (f"rank {rank}: the loss is {loss.item()}: exp overflowed (fp32's exp is inf above 88.7). Subtract "
                    "each token's max logit over the whole vocabulary (all-reduce the local max with ReduceOp.MAX) "
                    "before exp: softmax does not change when every logit moves by the same amount")
    for rank, loss in enumerate(losses):
        if close_enough(loss, want.float(), FP32, n=ROUNDINGS):
            continue
        group = losses[rank // tp * tp:(rank // tp + 1) * tp]
        if rank >= tp and all(close_enough(other, want.float(), FP32, n=ROUNDINGS) for other in losses[:tp]):
            hint = ("the first tp group is right, this one is not" + _group_rank_note(tp, rank)
                    + "; rank i of the group owns vocabulary entries [i V/t, (i+1) V/t)")
        elif any(not close_enough(other, group[0], FP32, n=ROUNDINGS) for other in group):
            hint = (f"the ranks of one tp group return different losses ({', '.join(f'{l.item():.6f}' for l in group)})"
                    ": each must all-reduce its parts and compute the same loss from the same sums")
        elif close_enough(loss, (want * tokens).float(), FP32, n=ROUNDINGS):
            hint = f"it is the sum over the {tokens} tokens; return the mean (divide by batch x seq)"
        elif any(close_enough(loss, wrong.float(), FP32, n=ROUNDINGS)
                 for wrong in _every_rank_losses(logits, targets, tp)):
            hint = ("it looks like every rank added a target logit: only the rank whose slice "
                    "[i V/t, (i+1) V/t) holds a token's target has its logit; the others must add 0 for that token")
        elif not any(c.reduce == "max" for c in per_rank[rank]["forward"]):
            hint = ("no all-reduce with MAX: the max subtracted before exp must be the same on every rank (the max "
                    "over the whole vocabulary), or the ranks' sums of exponentials are on different scales")
        else:
            hint = ("check: the max over the whole vocabulary (all-reduce MAX), the sum of exp(z - max) over the "
                    "whole vocabulary (all-reduce SUM), the target's logit from the one rank that holds it (others "
                    "add 0, all-reduce SUM), and loss = mean over tokens of log(sum) - (z_target - max)")
        return f"rank {rank}: loss {loss.item():.6f}, expected {want.item():.6f}: {hint}"
    for rank, (result, want_grad) in enumerate(zip(per_rank, grads)):
        got = result.get("grad")
        if got is None:
            return (f"rank {rank}: local_logits.grad is None after backward: backward must return the gradient of "
                    "the logits first (None for targets and group)")
        if close_enough(got, want_grad.float(), FP32, n=ROUNDINGS):
            continue
        if not torch.isfinite(got).all():
            hint = "it is not finite: compute it from the max-shifted softmax saved in forward"
        elif close_enough(got, (want_grad * tokens).float(), FP32, n=ROUNDINGS):
            hint = f"it is {tokens} x too large: the loss is a mean over the {tokens} tokens, divide by them"
        elif upstream != 1.0 and close_enough(got, (want_grad / upstream).float(), FP32, n=ROUNDINGS):
            hint = f"it ignores the incoming gradient ({upstream}): multiply by backward's grad_output"
        else:
            hint = ("dL/dz = (softmax(z) - one_hot(target)) x grad_output / tokens, where softmax uses the global "
                    "max and sum, and the one-hot 1 sits only on the rank whose slice holds the target")
        return f"rank {rank}: local_logits.grad is wrong: {hint}. {mismatch(got, want_grad.float())}"
    return ""


def _ce_comm_problem(per_rank: list, tp: int, tokens: int) -> str:
    bound = 3 * tokens
    for rank, result in enumerate(per_rank):
        forward = result["forward"]
        others = sorted({c.op for c in forward} - {"all_reduce"})
        if others:
            return (f"rank {rank}: the forward called {', '.join(others)} ({describe(forward, tp)}): no rank may "
                    "gather the full-vocabulary logits (b s V numbers, the largest tensor of the model). All-reduce "
                    "three numbers per token instead: the max, the sum of exponentials, the target's logit")
        numel = sum(c.numel for c in forward)
        if numel > bound:
            return (f"rank {rank}: the forward all-reduced {numel} elements, more than 3 per token ({bound}): "
                    "all-reduce per-token numbers (shape (batch, seq)), never logits")
        wrong_group = [c for c in forward if c.group_size != tp]
        if wrong_group:
            return (f"rank {rank}: the forward all-reduced over {wrong_group[0].group_size} ranks, not the {tp} of "
                    "the tp group: pass group=group to every collective")
        if result.get("backward"):
            return (f"rank {rank}: the backward made {describe(result['backward'], tp)}; it needs no communication: "
                    "the softmax (or the max and the sum of exponentials) saved in forward is all it needs")
    return ""


def _ce_on_rank(fn: Callable, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for tp, group in _groups():
        i = rank % tp
        for seed, (_, lead, vocab, offset, upstream) in enumerate(cases):
            logits, targets = _ce_inputs(lead, vocab, offset, seed)
            local = _shard_last(logits, i, tp).clone().requires_grad_()   # (..., V/t): entries [i V/t, (i+1) V/t)
            with recorded_collectives() as forward:
                loss = fn(local, targets.clone(), group)
            result = {"forward": forward}
            out.append(result)
            scalar = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad
            if isinstance(loss, torch.Tensor) and not scalar:
                no_graph = "" if loss.requires_grad else " with no grad_fn"
                result["not_scalar"] = f"a tensor of shape {tuple(loss.shape)}{no_graph}"
            elif not scalar:
                result["not_scalar"] = type(loss).__name__
            if not all_ranks_ok(scalar, group):
                continue
            result["loss"] = loss.detach().clone()
            with recorded_collectives() as backward:
                (upstream * loss).backward()
            result.update(backward=backward, grad=grad_of(local))
    return out


# ---- 8. stretch: sequence parallelism ----------------------------------------------------------
# Outside a tp block, rank i of the group keeps only tokens [i s/t, (i+1) s/t) of the (b, s, h) activations.
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")


def _kind(call: Call) -> str:
    """'all-gather' or 'reduce-scatter' whatever torch function made it, else the operation's own name."""
    return "all-gather" if call.op in GATHERS else "reduce-scatter" if call.op in SCATTERS else call.op


def _tokens(t: torch.Tensor, i: int, tp: int) -> torch.Tensor:
    """Rank i's tokens: (b, s, h) -> (b, s/tp, h), positions [i s/tp, (i+1) s/tp) of the sequence (dim 1)."""
    return t.chunk(tp, 1)[i]


def _sp_comm_problem(per_rank: list, key: str, tp: int, want: list[str], numel: int, where: str, why: str) -> str:
    """Each rank's calls must be exactly the collectives `want` ('all-gather', 'reduce-scatter'), over the tp
    group, reductions summing, each moving this rank's tokens or the whole (b, s, h) tensor (`numel` elements):
    the counted payload is a gather's input shard or whole output, depending on the torch function."""
    for rank, result in enumerate(per_rank):
        calls = result.get(key)
        if calls is None:
            continue
        at = f"{where} (rank {rank})"
        expected = " and ".join(f"one {kind}" for kind in want)
        kinds = [_kind(c) for c in calls]
        if sorted(kinds) != sorted(want):
            extra = ""
            if "all_reduce" in kinds and "reduce-scatter" in kinds:
                extra = (" The all-reduce sums what the reduce-scatter sums again: under SP the all-gather and the "
                         "reduce-scatter replace f and g, they do not come on top of them.")
            elif "all_reduce" in kinds and want == ["reduce-scatter"]:
                extra = (" An all-reduce and then a slice gives the same numbers, but it sends 2(t-1)/t of the tensor "
                         "per rank, not (t-1)/t, and builds the whole sum on every rank.")
            elif "all_reduce" in kinds:
                extra = " Under SP, the all-gather and the reduce-scatter take the place of f's and g's all-reduces."
            return f"{at} made {describe(calls, tp)}; expected {expected}: {why}.{extra}"
        for call in calls:
            if call.group_size != tp:
                return (f"{at} called {call.op} over {call.group_size} ranks, not the {tp} of the tp group: pass "
                        "group=<the tp group> to the collective")
            if _kind(call) == "reduce-scatter" and call.reduce != "sum":
                return f"{at} reduce-scattered with {call.reduce.upper()}; the ranks' terms add up: use SUM"
            if call.numel not in (numel // tp, numel):
                return (f"{at} called {call.op} on {call.numel} elements; expected this rank's tokens "
                        f"({numel // tp}) or the whole (b, s, h) tensor ({numel})")
    return ""


def _own_term_hint(own: Callable) -> Callable:
    """A hint for a gradient that is this rank's own term only: `own(rank)` is that term."""
    def hint(got, want, rank):
        if close_enough(got, own(rank).to(got.dtype), FP32, n=ROUNDINGS):
            return (": it is this rank's own term; each rank's gradient of the gathered sequence is partial, "
                    "so sum them over the ranks (reduce-scatter, op SUM)")
        return ""
    return hint


def check_gather_from_sp(GatherFromSP: type) -> None:
    """Stretch. SP's way in: rank i holds tokens [i s/t, (i+1) s/t) of x, (b, s/t, h); y = the whole (b, s, h) on
    every rank, by one all-gather. Backward: rank i's gradient of y is partial (its features' term), so
    x_i.grad = its tokens of the sum over the ranks, by one reduce-scatter (sum)."""
    not_the_course_answer("check_gather_from_sp", GatherFromSP, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y = GatherFromSP.apply(x_i, group), x_i rank i's s/t tokens; "
            "rank i backpropagates its own gradient g_i of the whole y. Expected: y = the x_i joined along the "
            "sequence (dim 1) in rank order, one all-gather forward; x_i.grad = tokens [i s/t, (i+1) s/t) of the "
            "sum of the g_i, one reduce-scatter (sum) backward")
    with Report("GatherFromSP (all-gather the sequence)", note=note) as report:
        results = on_ranks(_region_on_rank, WORLD, GatherFromSP, "gather", SP_SHAPES)
        for c, (tp, seed, shape) in enumerate(_cases(SP_SHAPES)):
            per_rank = [r[c] for r in results]
            whole = _sp_input(shape, seed)
            upstream = sum(_sp_upstream(i, shape, seed) for i in range(tp))
            x_grads = [_tokens(upstream, r % tp, tp) for r in range(WORLD)]
            own = _own_term_hint(lambda rank, tp=tp, shape=shape, seed=seed:
                                 _tokens(_sp_upstream(rank % tp, shape, seed), rank % tp, tp))
            numel = whole.numel()
            detail = (_sp_comm_problem(per_rank, "forward", tp, ["all-gather"], numel, "the forward",
                                       "every rank needs the whole sequence, and each holds s/t of its tokens")
                      or _value_problem(per_rank, "y", [whole] * WORLD, "y (the whole sequence)",
                                        lambda *_: ": join the ranks' pieces along dim 1 (the sequence), rank 0's first")
                      or _sp_comm_problem(per_rank, "backward", tp, ["reduce-scatter"], numel, "the backward",
                                          "each rank's gradient of y is a partial term, and x_i needs only its own "
                                          "tokens of their sum")
                      or _value_problem(per_rank, "x_grad", x_grads, "x.grad (this rank's tokens)", own))
            report.add(not detail, detail, tp=tp, x=tuple(_tokens(whole, 0, tp).shape), y=shape,
                       **{"forward comm": describe(per_rank[0].get("forward", []), tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", [whole] * WORLD), ("x_grad", x_grads)]))


def _sp_input(shape: tuple, seed: int) -> torch.Tensor:
    """The whole (b, s, h) activation every rank and the parent make; rank i keeps its tokens."""
    return rank_tensor(40, shape, FP32, seed).double()


def _sp_upstream(i: int, shape: tuple, seed: int) -> torch.Tensor:
    """Rank i's own (b, s, h) term: a gradient of the gathered sequence, or a row-parallel partial sum."""
    return rank_tensor(50 + i, shape, FP32, seed).double()


def check_reduce_scatter_to_sp(ReduceScatterToSP: type) -> None:
    """Stretch. SP's way out: rank i holds a partial sum x_i, (b, s, h); y_i = tokens [i s/t, (i+1) s/t) of the sum
    over the ranks, (b, s/t, h), by one reduce-scatter (sum). Backward: every rank's x_i feeds all the tokens, so
    x_i.grad = all the ranks' gradients joined along the sequence, by one all-gather."""
    not_the_course_answer("check_reduce_scatter_to_sp", ReduceScatterToSP, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y_i = ReduceScatterToSP.apply(x_i, group), x_i rank i's partial "
            "sum of the whole sequence; rank i backpropagates the gradient g_i of its own tokens. Expected: y_i = "
            "tokens [i s/t, (i+1) s/t) of the sum of the x_i, one reduce-scatter (sum) forward; x_i.grad = the g_i "
            "joined along the sequence (dim 1), one all-gather backward")
    with Report("ReduceScatterToSP (reduce-scatter the sequence)", note=note) as report:
        results = on_ranks(_region_on_rank, WORLD, ReduceScatterToSP, "scatter", SP_SHAPES)
        for c, (tp, seed, shape) in enumerate(_cases(SP_SHAPES)):
            per_rank = [r[c] for r in results]
            total = sum(_sp_upstream(i, shape, seed) for i in range(tp))
            ys = [_tokens(total, r % tp, tp) for r in range(WORLD)]
            upstream = _sp_input(shape, seed)            # the g_i, joined: rank i backpropagates its tokens of it
            numel = total.numel()

            def sum_hint(got, want, rank, tp=tp, shape=shape, seed=seed):
                own = _tokens(_sp_upstream(rank % tp, shape, seed), rank % tp, tp)
                if close_enough(got, own.to(got.dtype), FP32, n=ROUNDINGS):
                    return ": it is this rank's own partial sum, not the sum over the ranks"
                if close_enough(got, (want / tp).to(got.dtype), FP32, n=ROUNDINGS):
                    return ": it is the mean over the ranks; the partial sums add up"
                return _group_rank_note(tp, rank)

            detail = (_sp_comm_problem(per_rank, "forward", tp, ["reduce-scatter"], numel, "the forward",
                                       "the output is the sum of the ranks' partial sums, and each rank keeps only "
                                       "its own tokens of it")
                      or _value_problem(per_rank, "y", ys, "y (this rank's tokens of the sum)", sum_hint)
                      or _sp_comm_problem(per_rank, "backward", tp, ["all-gather"], numel, "the backward",
                                          "x_i feeds every token of the sum, and each rank holds the gradient of "
                                          "its own tokens only")
                      or _value_problem(per_rank, "x_grad", [upstream] * WORLD, "x.grad (the whole sequence)",
                                        lambda *_: ": join the ranks' gradients along dim 1 (the sequence), "
                                                   "rank 0's first"))
            report.add(not detail, detail, tp=tp, x=shape, y=tuple(_tokens(total, 0, tp).shape),
                       **{"forward comm": describe(per_rank[0].get("forward", []), tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", ys), ("x_grad", [upstream] * WORLD)]))


def check_sp_mlp(SequenceParallelMLP: type) -> None:
    """Stretch. SequenceParallelMLP(up, down, group) keeps rows of up's weight (up_weight, (ffn/t, h)) and columns of
    down's (down_weight, (h, ffn/t)); on this rank's tokens (b, s/t, h) it returns its tokens of the full MLP
    down(gelu(up(x))). One all-gather and one reduce-scatter each way; no all-reduce."""
    not_the_course_answer("check_sp_mlp", SequenceParallelMLP, course=PACKAGE)
    note = ("4 ranks as tp=4 and as 2 groups of tp=2; y_i = SequenceParallelMLP(up, down, group)(x_i), x_i rank i's "
            "s/t tokens of x; rank i backpropagates the gradient of its tokens. Compared with the full MLP in one "
            "process on all the tokens: y, x.grad, both weight gradients, each cut to what rank i holds")
    with Report("SequenceParallelMLP", note=note) as report:
        results = on_ranks(_sp_mlp_on_rank, WORLD, SequenceParallelMLP, SP_MLP_CASES)
        for c, (tp, seed, (lead, hidden, ffn)) in enumerate(_cases(SP_MLP_CASES)):
            per_rank = [r[c] for r in results]
            x, upstream = _inputs(lead, hidden, hidden, seed)
            w_up, w_down = _weight(ffn, hidden, seed, 0), _weight(hidden, ffn, seed, 1)
            ref = _reference([w_up, w_down], x, upstream)
            ys = [_tokens(ref["y"], r % tp, tp) for r in range(WORLD)]
            x_grads = [_tokens(ref["x_grad"], r % tp, tp) for r in range(WORLD)]
            up_shards = [_shard_rows(w_up, r % tp, tp) for r in range(WORLD)]
            down_shards = [_shard_last(w_down, r % tp, tp) for r in range(WORLD)]
            up_grads = [_shard_rows(ref["w_grads"][0], r % tp, tp) for r in range(WORLD)]
            down_grads = [_shard_last(ref["w_grads"][1], r % tp, tp) for r in range(WORLD)]
            why = "the block enters with GatherFromSP and leaves with ReduceScatterToSP, and nothing else talks"
            detail = (_sp_mlp_weights_problem(per_rank, up_shards, down_shards, tp)
                      or _sp_comm_problem(per_rank, "forward", tp, ["all-gather", "reduce-scatter"], x.numel(),
                                          "the MLP's forward", why)
                      or _value_problem(per_rank, "y", ys, "y (this rank's tokens)")
                      or _sp_comm_problem(per_rank, "backward", tp, ["reduce-scatter", "all-gather"], x.numel(),
                                          "the MLP's backward", why)
                      or _value_problem(per_rank, "x_grad", x_grads, "x.grad (this rank's tokens)")
                      or _value_problem(per_rank, "up_grad", up_grads, "up_weight.grad (this rank's rows)")
                      or _value_problem(per_rank, "down_grad", down_grads, "down_weight.grad (this rank's columns)"))
            report.add(not detail, detail, tp=tp, **{"x on a rank": tuple(_tokens(x, 0, tp).shape)}, ffn=ffn,
                       **{"forward comm": describe(per_rank[0].get("forward", []), tp),
                          "backward comm": describe(per_rank[0].get("backward", []), tp)},
                       max_err=_max_err(per_rank, [("y", ys), ("x_grad", x_grads), ("up_grad", up_grads),
                                                   ("down_grad", down_grads)]))


def _sp_mlp_weights_problem(per_rank: list, up_shards: list, down_shards: list, tp: int) -> str:
    """up_weight and down_weight as the column and row layers keep them, and no other parameter."""
    # Each shard on its own first (given its own element count: the module's total is checked after).
    for key, shards, kind in (("up", up_shards, "column"), ("down", down_shards, "row")):
        infos = [{"weight": {**r[key], "param_numel": shard.numel()}} for r, shard in zip(per_rank, shards)]
        problem = _weight_problem(infos, shards, tp, kind, name=f"{key}_weight")
        if problem:
            return problem
    for rank, (result, up, down) in enumerate(zip(per_rank, up_shards, down_shards)):
        if result["param_numel"] != up.numel() + down.numel():
            return (f"rank {rank}: the module has {result['param_numel']} parameter elements, its two shards "
                    f"{up.numel() + down.numel()}: keep only up_weight and down_weight (not the Linears themselves)")
    return ""


def _sp_mlp_on_rank(SequenceParallelMLP: type, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for tp, group in _groups():
        i = rank % tp
        for seed, (lead, hidden, ffn) in enumerate(cases):
            mlp = SequenceParallelMLP(_linear(ffn, hidden, seed, 0), _linear(hidden, ffn, seed, 1), group)
            not_the_course_answer("check_sp_mlp", mlp, course=PACKAGE)
            result = {"up": _module_info(mlp, "up_weight"), "down": _module_info(mlp, "down_weight"),
                      "param_numel": sum(p.numel() for p in mlp.parameters())}
            out.append(result)
            shapes_ok = (_shape_ok(result["up"], (ffn // tp, hidden)) and _shape_ok(result["down"], (hidden, ffn // tp))
                         and result["param_numel"] == 2 * hidden * ffn // tp)
            if not all_ranks_ok(shapes_ok, group):
                continue
            x, upstream = _inputs(lead, hidden, hidden, seed)
            x = _tokens(x, i, tp).clone().requires_grad_()                # (b, s/t, h): this rank's tokens
            upstream = _tokens(upstream, i, tp)
            with recorded_collectives() as forward:
                y = mlp(x)
            result.update(forward=forward, y=y.detach().clone())
            if not all_ranks_ok(y.shape == upstream.shape and y.requires_grad, group):
                continue
            with recorded_collectives() as backward:
                (y * upstream).sum().backward()
            result.update(backward=backward, x_grad=grad_of(x), up_grad=grad_of(mlp.up_weight),
                          down_grad=grad_of(mlp.down_weight))
    return out


# ---- 7. predict, then run: the MLP with a given g -----------------------------------------------
DEMO_TOKENS, DEMO_HIDDEN, DEMO_FFN = 6, 8, 16
DEMO_STEPS = 5
DEMO_OPTIMIZERS = {"AdamW": 1e-2, "SGD": 0.5}              # name: learning rate
ADAMW_BETAS, ADAMW_EPS, ADAMW_DECAY = (0.9, 0.999), 1e-8, 0.01   # torch.optim.AdamW's defaults


def mlp_with_g(g: type) -> dict:
    """The MLP x -> column (f) -> GELU -> row -> g, with the g given, on 4 ranks as tp=4 and as two groups of
    tp=2, against one process. Prints the loss and each gradient as a multiple of one process's (the best
    multiple, and whether it matches to round-off), then the
    loss of DEMO_STEPS steps of training with AdamW and with SGD. Returns the numbers printed."""
    results = on_ranks(_mlp_with_g_on_rank, WORLD, g)
    x, target, w_up, w_down = _demo_data()
    ref = _demo_one_process(x, target, w_up, w_down)
    table = {"one process": {"loss": ref["loss"], "curves": ref["curves"]}}
    print(f"the MLP with g = {getattr(g, '__name__', g)} on tp ranks, against one process "
          "(each gradient as a multiple of one process's; '?' if no multiple matches it)")
    print(f"{'':>6}{'loss':>12}{'x.grad':>12}{'up.grad':>12}{'down.grad':>12}")
    print(f"{'one':>6}{ref['loss']:>12.6f}")
    for index, tp in sorted(enumerate(TP_SIZES), key=lambda pair: pair[1]):
        ranks = [r[index] for r in results[:tp]]                # the first tp group: ranks 0 .. tp-1
        got = {"x_grad": ranks[0]["x_grad"],                    # summed over the ranks: the same on each
               "up_grad": torch.cat([r["up_grad"] for r in ranks], 0),     # the shards, put back together
               "down_grad": torch.cat([r["down_grad"] for r in ranks], 1)}
        factors = {key: _factor(got[key], ref[key]) for key in got}
        table[f"tp={tp}"] = {"loss": ranks[0]["loss"], "factors": factors, "curves": ranks[0]["curves"]}
        shown = [f"{k:.3f} x" + ("" if exact else " ?") for k, exact in factors.values()]
        print(f"{'tp=' + str(tp):>6}{ranks[0]['loss']:>12.6f}" + "".join(f"{text:>12}" for text in shown))
    print(f"training loss, steps 0 to {DEMO_STEPS - 1} (the same data every step), and the largest difference "
          "from one process's:")
    for name in DEMO_OPTIMIZERS:
        for who, row in table.items():
            curve = " ".join(f"{value:.4f}" for value in row["curves"][name])
            apart = max(abs(a - b) for a, b in zip(row["curves"][name], ref["curves"][name]))
            print(f"  {name:<6} {who:<12} {curve}   {apart:.1e}")
    return table


def _factor(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """(k, exact): the k that makes k x want closest to got (least squares), and whether got = k x want to
    round-off."""
    got, want = got.double(), want.double()
    k = (got * want).sum().item() / (want * want).sum().item()
    return k, close_enough(got, k * want, FP32, n=ROUNDINGS)


def _demo_data() -> tuple[torch.Tensor, ...]:
    x = rank_tensor(1, (DEMO_TOKENS, DEMO_HIDDEN), FP32)
    target = rank_tensor(3, (DEMO_TOKENS, DEMO_HIDDEN), FP32)
    return x, target, _weight(DEMO_FFN, DEMO_HIDDEN, 0, 0), _weight(DEMO_HIDDEN, DEMO_FFN, 0, 1)


def _demo_loss(x, target, up, down, leave: Callable) -> torch.Tensor:
    """Mean squared error of leave(down gelu(up x)): `leave` sums the ranks' partial outputs (g)."""
    return ((leave(F.linear(F.gelu(F.linear(x, up)), down)) - target) ** 2).mean()


def _demo_curves(x, target, weights: list[torch.Tensor], leave: Callable) -> dict:
    """The loss at each of DEMO_STEPS steps on the same batch, for each optimizer of DEMO_OPTIMIZERS."""
    curves = {}
    for name, lr in DEMO_OPTIMIZERS.items():
        params = [w.detach().clone().requires_grad_() for w in weights]
        moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in params]
        losses = []
        for step in range(1, DEMO_STEPS + 1):
            loss = _demo_loss(x, target, *params, leave)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for w, grad, (m, v) in zip(params, grads, moments):
                    if name == "SGD":
                        w -= lr * grad
                    else:
                        _adamw_step(w, grad, m, v, lr, step)
            losses.append(loss.item())
        curves[name] = losses
    return curves


def _adamw_step(w, grad, m, v, lr: float, step: int) -> None:
    """AdamW written out (Loshchilov & Hutter 2019), in place: w -= lr (m_hat / (sqrt(v_hat) + eps) + decay w),
    m and v the running means of the gradient and of its square, m_hat and v_hat corrected for their zero start.
    (torch.optim's first step imports torch._dynamo, most of a second on every rank.)"""
    beta1, beta2 = ADAMW_BETAS
    m.lerp_(grad, 1 - beta1)
    v.lerp_(grad * grad, 1 - beta2)
    m_hat, v_hat = m / (1 - beta1 ** step), v / (1 - beta2 ** step)
    w -= lr * (m_hat / (v_hat.sqrt() + ADAMW_EPS) + ADAMW_DECAY * w)


def _demo_one_process(x, target, w_up, w_down) -> dict:
    x = x.clone().requires_grad_()
    up, down = w_up.clone().requires_grad_(), w_down.clone().requires_grad_()
    loss = _demo_loss(x, target, up, down, lambda y: y)
    loss.backward()
    return {"loss": loss.item(), "x_grad": x.grad, "up_grad": up.grad, "down_grad": down.grad,
            "curves": _demo_curves(x.detach(), target, [w_up, w_down], lambda y: y)}


def _mlp_with_g_on_rank(g: type) -> list:
    rank, out = dist.get_rank(), []
    x, target, w_up, w_down = _demo_data()
    for tp, group in _groups():
        i = rank % tp
        shards = [_shard_rows(w_up, i, tp), _shard_last(w_down, i, tp)]   # column's rows, row's columns
        up, down = (w.clone().requires_grad_() for w in shards)
        x_in = x.clone().requires_grad_()
        loss = _demo_loss(x_in, target, up, down, lambda y: g.apply(y, group))
        loss.backward()
        dist.all_reduce(x_in.grad, group=group)     # what f does in backward: add the ranks' terms of dL/dx
        out.append({"loss": loss.item(), "x_grad": x_in.grad, "up_grad": up.grad, "down_grad": down.grad,
                    "curves": _demo_curves(x, target, shards, lambda y: g.apply(y, group))})
    return out

"""The checks of assignment 04: tensor parallelism, declared on the course's engine (picotron_course.engine).

Each check runs the learner's code on 4 ranks as one tp group of 4 and as two of 2 (ranks 0-1 and 2-3, so a rank's
place in its group differs from its global rank). It observes what each rank keeps (its shard of a weight), the
collectives of forward and of backward in words ('all_reduce sum of 96 B on the tp group of 2') and the values, and
compares with one process computed here in float64 (F.linear, the MLP, F.cross_entropy on the full-vocabulary logits,
and their gradients, cut into what each rank should hold). Nothing here uses picotron.parallel.tensor_parallel, the
module the assignment rebuilds; the misconceptions change correct bases written here, refused as answers. Checked:
f and g, SP's all-gather and reduce-scatter (stretch), the column- and row-parallel linears, the MLP they make and SP's
(stretch), the vocab-parallel cross-entropy; `mlp_with_g(g)` is the "predict, then run" cell's harness.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from picotron_course.checks import (all_ranks_ok, close_enough, collectives_observed, grad_of, on_ranks, payload_of,
                                    rank_tensor, reduce_name)
from picotron_course.engine import Check, Close, Exact, Misconception, observe_on_ranks, world_and_halves

__all__ = ["check_copy_to_tp", "check_reduce_from_tp", "check_column_parallel", "check_row_parallel",
           "check_tp_mlp", "check_vocab_parallel_cross_entropy", "check_gather_from_sp", "check_reduce_scatter_to_sp",
           "check_sp_mlp", "mlp_with_g", "recorded_collectives", "Call", "WORLD", "TP_SIZES"]

WORLD = 4
TP_SIZES = (4, 2)          # one group of all 4 ranks; two groups of 2 (ranks 0-1, 2-3)
FP32 = torch.float32
SUM, AVG, MAX = dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX
COURSE = ("picotron.parallel.tensor_parallel", __name__)   # picotron's answers, and this file's correct bases
ONLY = {__name__: {"_Copy", "_Reduce", "_Gather", "_Scatter", "_Column", "_Row", "_SPMLP", "_CE", "ce_"}}

REGION_SHAPES = [(2, 3, 5), (4, 6)]                     # x of f and g
SP_SHAPES = [(2, 8, 3), (1, 4, 5)]                      # (batch, seq, hidden): the sequence splits over 4 and 2
COLUMN_CASES = [((2, 3), 6, 8), ((5,), 4, 12)]          # (leading dims of x, in_features, out_features)
ROW_CASES = [((2, 3), 8, 6), ((5,), 12, 4)]             # the split dimension (out for column, in for row) / 4
MLP_CASES = [((2, 3), 8, 16), ((5,), 6, 12)]            # (leading dims, hidden, ffn)
SP_MLP_CASES = [((2, 8), 8, 16), ((1, 4), 6, 12)]       # ((batch, seq), hidden, ffn)
# (name, leading dims, vocabulary, logit offset, upstream gradient). Near 100, exp overflows in fp32
# (it does above 88.7) unless the max is subtracted first.
CE_CASES = [("random", (2, 3), 16, 0.0, 1.0), ("logits near 100", (2, 3), 16, 100.0, 1.0),
            ("upstream 0.25", (4, 5), 24, 0.0, 0.25)]
CE_SPREAD = 3.0           # logits = offset + 3 x N(0, 1): a softmax that is neither flat nor one-hot
# Roundings behind one number checked here (picotron.tolerance): the MLP's sums over up to 16 features each way,
# forward and backward, a softmax over 24 logits and a gradient summed over 20 tokens.
ROUNDINGS = 2 * (16 + 16) + 24 + 20
SETUP = "4 ranks as tp=4 and as 2 groups of tp=2; "


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
GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")


@contextmanager
def recorded_collectives() -> Iterator[list[Call]]:
    """Inside the block, every collective (and send) this rank calls is appended to the yielded list. An all-reduce
    counts its tensor; any other operation its largest tensor argument. Calls made inside a recorded call (torch's
    deprecated names call the new ones) are not counted twice."""
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


def _said(calls: list[Call], tp: int, whole: int = 0) -> list[str]:
    """The calls in words, sorted: 'all_reduce sum of 96 B on the tp group of 2' ('on 4 ranks' off it). With `whole`
    (SP: the elements of the whole (b, s, h)), a gather or reduce-scatter by its kind, whatever torch function made it,
    sized only when it is neither this rank's tokens nor the whole tensor (its payload depends on the function)."""
    said = []
    for call in calls:
        kind = whole and ("all-gather" if call.op in GATHERS else "reduce-scatter" if call.op in SCATTERS else "")
        size = "" if kind and call.numel in (whole // tp, whole) else f" of {call.nbytes} B"
        group = f"the tp group of {tp}" if call.group_size == tp else f"{call.group_size} ranks"
        said.append(" ".join(filter(None, [kind or call.op, call.reduce])) + f"{size} on {group}")
    return sorted(said)


def _comm(tp: int, nbytes: int = 0) -> dict:
    """The words of the collectives a correct answer makes: one all-reduce (sum) of nbytes, or SP's two."""
    return {"all_reduce": [f"all_reduce sum of {nbytes} B on the tp group of {tp}"], "none": [],
            "all-gather": [f"all-gather on the tp group of {tp}"],
            "reduce-scatter": [f"reduce-scatter sum on the tp group of {tp}"],
            "sp": [f"all-gather on the tp group of {tp}", f"reduce-scatter sum on the tp group of {tp}"]}


# ---- running an answer on the ranks ------------------------------------------------------------
def _cases(items: list, **shown: Callable) -> list[dict]:
    """A check's cases, tp groups of 4 then of 2: `shown` columns made from each item, the item and seed hidden."""
    return [{"tp": tp, **{name: f(item) for name, f in shown.items()}, "_item": item, "_seed": seed}
            for tp in TP_SIZES for seed, item in enumerate(items)]


def _launch(run: Callable, *args) -> Callable:
    """observe: all answers on all cases in one launch of WORLD ranks, run(*args, answer, case, group) -> what a rank
    saw, in the group of the case's tp (engine.observe_on_ranks)."""
    return observe_on_ranks(WORLD, functools.partial(run, *args), world_and_halves, "tp")


def _parts(kind: str, items: list) -> tuple:
    """The cases, observe and expect of a check of `kind`; a layer's items are (lead, in, out) of a linear or
    (lead, hidden, ffn) of an MLP, its cases hold the shapes of the full weights."""
    if kind in _REGION_INPUTS:
        return _cases(items, **{"y" if kind == "gather" else "x": tuple}), _launch(_region, kind), _expect_region(kind)
    mlp = kind in ("mlp", "sp")
    cases = _cases(items, x=lambda item: (*item[0], item[1]),
                   **({"ffn": lambda item: item[2]} if mlp else {"W": lambda item: item[:0:-1]}))
    for case in cases:
        _, a, b = case["_item"]
        case["_weights"] = [(b, a), (a, b)][:1 + mlp]
    return cases, _launch(_layers, kind), _expect_layers(kind)


def _run(call: Callable, x: torch.Tensor, upstream: torch.Tensor, group, leaves: dict, whole: int = 0) -> dict:
    """y = call(x) and, when every rank of the group has a y of upstream's shape that needs grad, backward from
    upstream: what y is, y, the gradients of the `leaves` and each pass's collectives (in words; raw in 'calls')."""
    tp = dist.get_world_size(group)
    with recorded_collectives() as forward:
        y = call(x)
    seen = {"returned": _what(y) + ("" if getattr(y, "requires_grad", True) else " without a grad_fn"),
            "forward": _said(forward, tp, whole), "calls": forward,
            "y": y.detach().clone() if isinstance(y, torch.Tensor) else None}
    if all_ranks_ok(isinstance(y, torch.Tensor) and y.shape == upstream.shape and y.requires_grad, group):
        with recorded_collectives() as backward:
            (y * upstream).sum().backward()
        seen.update(backward=_said(backward, tp, whole), **{key: grad_of(t) for key, t in leaves.items()})
    return seen


def _what(value) -> str:
    if not isinstance(value, torch.Tensor):
        return "nothing" if value is None else f"a {type(value).__name__}"
    return f"{'an nn.Parameter' if isinstance(value, nn.Parameter) else 'a Tensor'} of shape {tuple(value.shape)}"


def _cut(t: torch.Tensor, i: int, tp: int, dim: int) -> torch.Tensor:
    """Rank i's slice of t along dim: rows of a weight (0), columns (1 or -1), tokens of (b, s, h) (1)."""
    return t.chunk(tp, dim)[i]


def _each(tp: int, f: Callable) -> list:
    """f(i) for every rank of the world, i its place in its tp group."""
    return [f(r % tp) for r in range(WORLD)]


_exact = functools.partial(Exact, axes=("rank {}",))
_close = functools.partial(Close, n=ROUNDINGS, dtype=FP32, axes=("rank {}",))


def _columns(case: dict, got: dict) -> dict:
    """Rank 0's collectives in each pass, for the table."""
    return {f"{p} comm": ", ".join(got[p][0]) or "none" if got.get(p, [None])[0] is not None else "-"
            for p in ("forward", "backward")}


def _quantities(forward: str, y: str, backward: str, x_grad: str, kept: str = "", weights: tuple = ()) -> dict:
    """What a check compares, from cause to effect: what each rank keeps (the shards of `weights`, described by
    `kept`), the forward's collectives, y, the backward's, the input's gradient, the weights' gradients."""
    shards = {} if not kept else {
        "kept": _exact(kept), **{w: _close(f"the values of {w}, this rank's slice") for w in weights},
        "parameters": _exact("the parameter elements of each module: only its shards"),
        "storage": _exact("the elements of the memory each shard lives in: a copy of its slice, not a view of W")}
    return {**shards, "forward": _exact(f"the forward's collectives ({forward})"), "y": _close(y),
            "backward": _exact(f"the backward's collectives ({backward})"), "x_grad": _close(x_grad),
            **{f"{w}.grad": _close(f"{w}.grad, this rank's slice of the full weight's gradient") for w in weights}}


@dataclass
class _TP(Check):
    """A check here: its table shows each pass's collectives; the course's answers are refused."""
    columns: Callable | None = _columns
    course: str | tuple | None = COURSE
    only: dict | None = field(default_factory=lambda: ONLY)


# ---- 1. f, g, and SP's all-gather and reduce-scatter (stretch) ----------------------------------
def _function(name: str, forward: Callable, backward: Callable) -> type:
    """An autograd Function y = forward(x, group), x.grad = backward(y.grad, group)."""
    def forward_(ctx, x, group):
        ctx.group = group
        return forward(x, group)
    return type(Function)(name, (Function,), {"forward": staticmethod(forward_), "__module__": __name__,
                                              "backward": staticmethod(lambda ctx, g: (backward(g, ctx.group), None))})


def _same(t: torch.Tensor, group) -> torch.Tensor:
    return t


def _all_reduce(t: torch.Tensor, group, op=SUM) -> torch.Tensor:
    t = t.contiguous().clone()
    dist.all_reduce(t, op=op, group=group)
    return t


def _gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """(b, s/t, h) on every rank -> (b, s, h), rank order, by all_gather_into_tensor (which joins along dim 0)."""
    first = x.movedim(dim, 0).contiguous()
    whole = first.new_empty(dist.get_world_size(group) * first.shape[0], *first.shape[1:])
    dist.all_gather_into_tensor(whole, first, group=group)
    return whole.movedim(0, dim).contiguous()


def _scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/t, h): this rank's tokens of their sum, by reduce_scatter_tensor."""
    first = x.movedim(1, 0).contiguous()
    mine = first.new_empty(first.shape[0] // dist.get_world_size(group), *first.shape[1:])
    dist.reduce_scatter_tensor(mine, first, group=group)
    return mine.movedim(0, 1).contiguous()


def _own(t: torch.Tensor, group) -> torch.Tensor:
    return _cut(t, dist.get_rank(group), dist.get_world_size(group), 1).contiguous()


def _zero_padded(grad: torch.Tensor, group) -> torch.Tensor:   # this rank's gradient at its tokens, zeros elsewhere
    i, s, tp = dist.get_rank(group), grad.shape[1], dist.get_world_size(group)
    return F.pad(grad, (0, 0, i * s, (tp - 1 - i) * s))


# Per function, rank i's input x_i and the gradient g_i it backpropagates into y, from (i, tp, shape, seed): f gets x
# whole everywhere; g a partial sum; SP's all-gather rank i's tokens of x; its reduce-scatter a partial sum of all.
_REGION_INPUTS = {
    "f": lambda i, tp, shape, seed: (rank_tensor(0, shape, FP32, seed), rank_tensor(10 + i, shape, FP32, seed)),
    "g": lambda i, tp, shape, seed: (rank_tensor(20 + i, shape, FP32, seed), rank_tensor(30, shape, FP32, seed)),
    "gather": lambda i, tp, shape, seed: (_cut(rank_tensor(40, shape, FP32, seed), i, tp, 1),
                                          rank_tensor(50 + i, shape, FP32, seed)),
    "scatter": lambda i, tp, shape, seed: (rank_tensor(50 + i, shape, FP32, seed),
                                           _cut(rank_tensor(40, shape, FP32, seed), i, tp, 1))}


def _region(kind: str, Fn: type, case: dict, group) -> dict:
    """y = Fn.apply(x_i, group), then backward from g_i."""
    shape, sp = case["_item"], kind in ("gather", "scatter")
    x, upstream = _REGION_INPUTS[kind](dist.get_rank(group), case["tp"], shape, case["_seed"])
    x = x.clone().requires_grad_()
    return _run(lambda x: Fn.apply(x, group), x, upstream, group, {"x_grad": x}, sp and math.prod(shape))


def _expect_region(kind: str) -> Callable:
    """One process, float64: each rank's y and x.grad from every rank's x_i and g_i, and the collectives."""
    def expect(case: dict, got: dict) -> dict:
        tp, shape = case["tp"], case["_item"]
        xs, gs = zip(*([t.double() for t in _REGION_INPUTS[kind](i, tp, shape, case["_seed"])] for i in range(tp)))
        y, x_grad = {"f": (lambda i: xs[0], lambda i: sum(gs)), "g": (lambda i: sum(xs), lambda i: gs[0]),
                     "gather": (lambda i: torch.cat(xs, 1), lambda i: _cut(sum(gs), i, tp, 1)),
                     "scatter": (lambda i: _cut(sum(xs), i, tp, 1), lambda i: torch.cat(gs, 1))}[kind]
        forward, backward = {"f": ("none", "all_reduce"), "g": ("all_reduce", "none"), "gather": (
            "all-gather", "reduce-scatter"), "scatter": ("reduce-scatter", "all-gather")}[kind]
        said = _comm(tp, 4 * math.prod(shape))
        return {"forward": [said[forward]] * WORLD, "y": _each(tp, y), "backward": [said[backward]] * WORLD,
                "x_grad": _each(tp, x_grad)}
    return expect


_Copy = _function("_Copy", _same, _all_reduce)          # f
_Reduce = _function("_Reduce", _all_reduce, _same)      # g
Identity = _function("Identity", _same, _same)          # no all-reduce either way
CopyAverages = _function("CopyAverages", _same, lambda grad, group: _all_reduce(grad, group, AVG))
CopyWholeWorld = _function("CopyWholeWorld", _same, lambda grad, group: _all_reduce(grad, None))  # forgot group=
ReduceAverages = _function("ReduceAverages", lambda x, group: _all_reduce(x, group, AVG), _same)
ReduceMean = _function("ReduceMean", lambda x, group: _all_reduce(x, group) / dist.get_world_size(group), _same)
ReduceBackwardToo = _function("ReduceBackwardToo", _all_reduce, _all_reduce)
ReduceAveragesBackward = _function("ReduceAveragesBackward", _all_reduce,   # the right numbers, a needless all-reduce
                                   lambda grad, group: _all_reduce(grad, group, AVG))
_Gather = _function("_Gather", _gather_seq, _scatter_seq)
_Scatter = _function("_Scatter", _scatter_seq, _gather_seq)
GatherKeepsOwnTerm = _function("GatherKeepsOwnTerm", _gather_seq, _own)   # its own term of its tokens, never summed
GatherAllReducesBackward = _function("GatherAllReducesBackward", _gather_seq,
                                     lambda grad, group: _own(_all_reduce(grad, group), group))
GatherAlongBatch = _function("GatherAlongBatch", lambda x, group: _gather_seq(x, group, 0), _scatter_seq)
GatherWholeWorld = _function("GatherWholeWorld", lambda x, group: _gather_seq(x, None), _scatter_seq)  # no group=
GatherSumsTwice = _function("GatherSumsTwice", _gather_seq,            # f's all-reduce kept, then the reduce-scatter
                            lambda grad, group: _scatter_seq(_all_reduce(grad, group), group))
ScatterByAllReduce = _function("ScatterByAllReduce", lambda x, group: _own(_all_reduce(x, group), group), _gather_seq)
ScatterMean = _function("ScatterMean", lambda x, group: _scatter_seq(x, group) / dist.get_world_size(group),
                        _gather_seq)
ScatterZeroPadsBackward = _function("ScatterZeroPadsBackward", _scatter_seq, _zero_padded)
ScatterBackwardSums = _function("ScatterBackwardSums", _scatter_seq,
                                lambda grad, group: _all_reduce(_gather_seq(grad, group), group))

_USE_SUM = "the pieces add up to the result: use SUM (dist.ReduceOp.SUM, the default)"
_PASS_GROUP = "pass group=<the tp group> to the collective: without it, it runs over all 4 ranks, not the tp group"
_ALL_REDUCE_SLICE = ("an all-reduce and then a slice gives the same numbers, but it sends 2(t-1)/t of the tensor per "
                     "rank, not (t-1)/t, and builds the whole sum on every rank: reduce-scatter")
_NOT_ON_TOP = ("the all-reduce sums what the reduce-scatter sums again: under SP the all-gather and the reduce-scatter "
               "replace f and g, they do not come on top of them")
_IN_PLACE = "under SP, the all-gather and the reduce-scatter take the place of f's and g's all-reduces"

COPY = _TP(
    "CopyToTP (f)", *_parts("f", REGION_SHAPES),
    note=SETUP + "y = CopyToTP.apply(x, group), x the same on every rank; rank i backpropagates its own gradient g_i "
                 "of y. Expected: y = x, no communication forward; x.grad = sum of the g_i, one all-reduce backward",
    quantities=_quantities("none: f's forward is the identity, every rank already holds the whole x",
                           "y (f's forward returns x unchanged)",
                           "one all-reduce (sum) of the gradient over the tp group: each rank's gradient covers only "
                           "its share of what x feeds, and x's gradient is the sum of them all",
                           "x.grad, the sum of every rank's gradient of y"),
    misconceptions=[
        Misconception(_Reduce, "f and g are swapped: f's forward is the identity (no communication); its backward "
                               "all-reduces the gradient"),
        Misconception(Identity, "f's backward must all-reduce (sum) the gradient over the tp group"),
        Misconception(CopyAverages, f"f's backward all-reduced with AVG; {_USE_SUM}"),
        Misconception(CopyWholeWorld, _PASS_GROUP)])

REDUCE = _TP(
    "ReduceFromTP (g)", *_parts("g", REGION_SHAPES),
    note=SETUP + "y = ReduceFromTP.apply(x_i, group), x_i different on every rank; every rank backpropagates the "
                 "same g. Expected: y = sum of the x_i, one all-reduce forward; x_i.grad = g, no communication back",
    quantities=_quantities("one all-reduce (sum) of x over the tp group: the layer's output is the sum of every "
                           "rank's partial output", "y, the sum of every rank's x",
                           "none: g's backward is the identity, every rank computes the same loss from the same "
                           "sum, so each already holds the whole gradient of y", "x.grad, the gradient of y"),
    misconceptions=[
        Misconception(_Copy, "g's forward must all-reduce (sum) x: that is f, whose all-reduce is in backward"),
        Misconception(ReduceAverages, f"g's forward all-reduced with AVG; {_USE_SUM}"),
        Misconception(ReduceMean, "y is the mean, the sum divided by tp: the partial outputs add up, return their sum"),
        Misconception(ReduceBackwardToo, "g's backward is the identity: summed over the ranks, x.grad is tp x the "
                                         "gradient of y"),
        Misconception(ReduceAveragesBackward, "g's backward is the identity: averaging the ranks' gradients gives "
                                              "the same numbers, for an all-reduce nothing needs")])

GATHER = _TP(
    "GatherFromSP (all-gather the sequence)", *_parts("gather", SP_SHAPES),
    note=SETUP + "y = GatherFromSP.apply(x_i, group), x_i rank i's s/t tokens of the sequence (dim 1); rank i "
                 "backpropagates its own gradient g_i of the whole y",
    quantities=_quantities("one all-gather over the tp group: every rank needs the whole sequence, and each holds "
                           "s/t of its tokens", "y, the whole sequence: the ranks' pieces joined along dim 1",
                           "one reduce-scatter (sum) over the tp group: each rank's gradient of y is a partial term, "
                           "and x_i needs only its own tokens of their sum",
                           "x.grad, this rank's tokens of the sum of the ranks' gradients"),
    misconceptions=[
        Misconception(GatherWholeWorld, _PASS_GROUP),
        Misconception(GatherAlongBatch, "join the ranks' pieces along dim 1 (the sequence), rank 0's first"),
        Misconception(GatherKeepsOwnTerm, "x.grad kept this rank's own term: each rank's gradient of the gathered "
                                          "sequence is partial, so sum them over the ranks (reduce-scatter, op SUM)"),
        Misconception(GatherAllReducesBackward, _ALL_REDUCE_SLICE),
        Misconception(GatherSumsTwice, _NOT_ON_TOP)])

REDUCE_SCATTER = _TP(
    "ReduceScatterToSP (reduce-scatter the sequence)", *_parts("scatter", SP_SHAPES),
    note=SETUP + "y_i = ReduceScatterToSP.apply(x_i, group), x_i rank i's partial sum of the whole sequence; rank i "
                 "backpropagates the gradient g_i of its own tokens",
    quantities=_quantities("one reduce-scatter (sum) over the tp group: the output is the sum of the ranks' partial "
                           "sums, and each rank keeps only its own tokens of it",
                           "y, this rank's tokens of the sum over the ranks (not its own partial sum, nor the mean)",
                           "one all-gather over the tp group: x_i feeds every token of the sum, and each rank holds "
                           "the gradient of its own tokens only",
                           "x.grad, the whole sequence: the ranks' gradients joined along dim 1, rank 0's first"),
    misconceptions=[
        Misconception(_Gather, "the forward must reduce-scatter (sum): an all-gather is SP's way in, not out"),
        Misconception(ScatterByAllReduce, _ALL_REDUCE_SLICE),
        Misconception(ScatterMean, "y is the mean over the ranks; the partial sums add up"),
        Misconception(ScatterZeroPadsBackward, "x.grad needs every rank's gradient of its tokens: all-gather them "
                                               "along the sequence, do not pad with zeros"),
        Misconception(ScatterBackwardSums, f"the backward only all-gathers, nothing is summed there: {_IN_PLACE}")])


def check_copy_to_tp(CopyToTP: type) -> None:
    """f: y = x on every rank with no communication; in backward, one all-reduce (sum) over the tp group
    gives x.grad = the sum of every rank's gradient of y."""
    COPY(CopyToTP)


def check_reduce_from_tp(ReduceFromTP: type) -> None:
    """g: y = the sum of every rank's x, by one all-reduce (sum) over the tp group; in backward, no
    communication: x.grad = y's gradient, which every rank holds whole."""
    REDUCE(ReduceFromTP)


def check_gather_from_sp(GatherFromSP: type) -> None:
    """Stretch. SP's way in: rank i holds tokens [i s/t, (i+1) s/t) of x, (b, s/t, h); y = the whole (b, s, h) on
    every rank, by one all-gather. Backward: rank i's gradient of y is partial (its features' term), so
    x_i.grad = its tokens of the sum over the ranks, by one reduce-scatter (sum)."""
    GATHER(GatherFromSP)


def check_reduce_scatter_to_sp(ReduceScatterToSP: type) -> None:
    """Stretch. SP's way out: rank i holds a partial sum x_i, (b, s, h); y_i = tokens [i s/t, (i+1) s/t) of the sum
    over the ranks, (b, s/t, h), by one reduce-scatter (sum). Backward: every rank's x_i feeds all the tokens, so
    x_i.grad = all the ranks' gradients joined along the sequence, by one all-gather."""
    REDUCE_SCATTER(ReduceScatterToSP)


# ---- 2. column- and row-parallel linears, the MLP they make, and SP's MLP (stretch) --------------
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


def _inputs(lead: tuple, fan_in: int, fan_out: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full input x (..., in) and the full upstream gradient dL/dY (..., out)."""
    return rank_tensor(1, (*lead, fan_in), FP32, seed), rank_tensor(2, (*lead, fan_out), FP32, seed)


# Per check: the weights kept, by name (the attribute read: after the last dot), and the dim of the full weight each
# rank takes its slice of: a column-parallel layer keeps rows (its output features), a row-parallel one columns.
# Then how y and x.grad are cut: None whole, -1 the features of this rank, 1 its tokens.
_WEIGHTS = {"column": {"module.weight": 0}, "row": {"module.weight": 1},
            "mlp": {"column.weight": 0, "row.weight": 1}, "sp": {"up_weight": 0, "down_weight": 1}}
_CUTS = {"column": (-1, None), "row": (None, -1), "mlp": (None, None), "sp": (1, 1)}


def _layers(kind: str, answer, case: dict, group) -> dict:
    """Build the layers from full nn.Linears, note what each rank keeps and, when every rank of the group keeps shards
    of the right kind and shape, run forward and backward."""
    i, tp, seed, names = dist.get_rank(group), case["tp"], case["_seed"], _WEIGHTS[kind]
    linears = [_linear(*shape, seed, which) for which, shape in enumerate(case["_weights"])]
    if kind == "mlp":
        modules = [answer[0](linears[0], group), answer[1](linears[1], group)]
        call = lambda x: modules[1](F.gelu(modules[0](x)))     # noqa: E731  (GELU on this rank's f/t features)
    else:
        modules = [answer(*linears, group)]
        call = modules[0]
    LAYERS[kind].refuse(answer, *modules)
    weights = {n: getattr(modules[j if kind == "mlp" else 0], n.rsplit(".")[-1], None) for j, n in enumerate(names)}
    seen = _kept(modules, weights)
    if not all_ranks_ok(seen["kept"] == _kept_want(kind, case["_weights"], tp), group):
        return seen
    x, upstream = _inputs(case["_item"][0], case["_weights"][0][1], case["_weights"][-1][0], seed)
    x, upstream = (t if d is None else _cut(t, i, tp, d) for t, d in zip((x, upstream), _CUTS[kind][::-1]))
    x = x.clone().requires_grad_()
    leaves = {"x_grad": x, **{f"{n}.grad": w for n, w in weights.items()}}
    return {**seen, **_run(call, x, upstream, group, leaves, x.numel() * tp if kind == "sp" else 0)}


def _kept(modules: list, weights: dict) -> dict:
    """What a rank keeps: each weight in words, its values, the parameter elements of each module, and the elements
    of the memory each weight lives in (for a view, the whole tensor it is cut from)."""
    tensors = {n: w for n, w in weights.items() if isinstance(w, torch.Tensor)}
    return {"kept": "; ".join(f"{n}: {_what(w)}" for n, w in weights.items()),
            **{n: w.detach().clone() for n, w in tensors.items()},
            "parameters": [sum(p.numel() for p in m.parameters()) for m in modules],
            "storage": [w.untyped_storage().nbytes() // w.element_size() if n in tensors else 0
                        for n, w in weights.items()]}


def _shards(kind: str, full: list, tp: int) -> dict:
    """{weight: the slice of its full tensor (a weight, or its gradient) each rank keeps}."""
    return {n: _each(tp, lambda i, t=t, d=d: _cut(t, i, tp, d)) for (n, d), t in zip(_WEIGHTS[kind].items(), full)}


def _kept_want(kind: str, shapes: list, tp: int) -> str:
    shards = _shards(kind, [torch.empty(shape) for shape in shapes], tp)
    return "; ".join(f"{n}: {_what(nn.Parameter(s[0]))}" for n, s in shards.items())


def _expect_layers(kind: str) -> Callable:
    def expect(case: dict, got: dict) -> dict:
        tp, seed = case["tp"], case["_seed"]
        ws = [_weight(*shape, seed, which) for which, shape in enumerate(case["_weights"])]
        x, upstream = _inputs(case["_item"][0], ws[0].shape[1], ws[-1].shape[0], seed)
        ref = _reference(ws, x, upstream)
        y, x_grad = (_each(tp, lambda i, t=t, d=d: _cut(t, i, tp, d)) if d else [t] * WORLD
                     for t, d in zip((ref["y"], ref["x_grad"]), _CUTS[kind]))
        said = _comm(tp, 4 * (ref["y"] if kind == "row" else x).numel())   # the all-reduce of y, or of dL/dx
        forward, backward = {"column": ("none", "all_reduce"), "row": ("all_reduce", "none"),
                             "mlp": ("all_reduce", "all_reduce"), "sp": ("sp", "sp")}[kind]
        shards = _shards(kind, ws, tp)
        sizes = [shard[0].numel() for shard in shards.values()]
        return {"kept": [_kept_want(kind, case["_weights"], tp)] * WORLD, **shards,
                "parameters": [[sum(sizes)] if kind == "sp" else sizes] * WORLD, "storage": [sizes] * WORLD,
                "forward": [said[forward]] * WORLD, "y": y, "backward": [said[backward]] * WORLD, "x_grad": x_grad,
                **{f"{n}.grad": g for n, g in _shards(kind, ref["w_grads"], tp).items()}}
    return expect


class _Column(nn.Module):
    """The correct column-parallel linear: rows of W, entering through f. _Row: columns of W, leaving through g."""
    enter, leave, dim = _Copy, Identity, 0

    def __init__(self, linear, group):
        super().__init__()
        self.group = group
        self.weight = self.keep(self.slice(linear.weight.detach(), dist.get_world_size(group)))

    def slice(self, w, tp):   # narrow, not chunk: a shard of the wrong dim still gets one (of n // tp)
        return w.narrow(self.dim, dist.get_rank(self.group) * (w.shape[self.dim] // tp), w.shape[self.dim] // tp)

    def keep(self, shard):
        return nn.Parameter(shard.clone())

    def forward(self, x):
        return self.leave.apply(F.linear(self.enter.apply(x, self.group), self.weight), self.group)


_Row = type("_Row", (_Column,), {"enter": Identity, "leave": _Reduce, "dim": 1})


class _KeepsLinears:
    def __init__(self, *linears_and_group):
        super().__init__(*linears_and_group)
        self.linears = nn.ModuleList(linears_and_group[:-1])   # their whole weights become parameters of this module


ColumnKeepsLinear = type("ColumnKeepsLinear", (_KeepsLinears, _Column), {})
ColumnGlobalRank = type("ColumnGlobalRank", (_Column,), {   # the global rank: ranks 2-3 of a pair slice past the end
    "slice": lambda self, w, tp: w[dist.get_rank() * (w.shape[0] // tp):][:w.shape[0] // tp]})
ColumnTakesColumns = type("ColumnTakesColumns", (_Column,), {"dim": 1})          # the row layer's shard
ColumnPlainTensor = type("ColumnPlainTensor", (_Column,), {"keep": torch.clone})  # not a Parameter
ColumnViewShard = type("ColumnViewShard", (_Column,), {"keep": nn.Parameter})    # a view: W stays whole
ColumnWithReduce = type("ColumnWithReduce", (_Column,), {"enter": _Reduce})      # g in place of f
ColumnNoCopy = type("ColumnNoCopy", (_Column,), {"enter": Identity})             # forgets f: dL/dx never summed
RowTakesRows = type("RowTakesRows", (_Row,), {"dim": 0})                         # the column layer's shard
RowViewShard = type("RowViewShard", (_Row,), {"keep": nn.Parameter})
RowNoReduce = type("RowNoReduce", (_Row,), {"leave": Identity})                  # returns the partial sum


class _SPMLP(nn.Module):
    """The correct sequence-parallel MLP: up keeps rows of its W, down columns, between SP's all-gather and
    reduce-scatter."""
    enter, leave, dims, keep = _Gather, _Scatter, (0, 1), _Column.keep

    def __init__(self, up, down, group):
        super().__init__()
        self.group = group
        i, tp = dist.get_rank(group), dist.get_world_size(group)
        self.up_weight, self.down_weight = (self.keep(w.narrow(dim, i * (w.shape[dim] // tp), w.shape[dim] // tp))
                                            for w, dim in zip((up.weight.detach(), down.weight.detach()), self.dims))

    def forward(self, x):
        h = F.gelu(F.linear(self.enter.apply(x, self.group), self.up_weight))
        return self.leave.apply(F.linear(h, self.down_weight), self.group)


SPMLPKeepsLinears = type("SPMLPKeepsLinears", (_KeepsLinears, _SPMLP), {})
SPMLPSwapsShards = type("SPMLPSwapsShards", (_SPMLP,), {"dims": (1, 1)})             # up keeps columns, not rows
SPMLPViewShards = type("SPMLPViewShards", (_SPMLP,), {"keep": nn.Parameter})
SPMLPPlainTP = type("SPMLPPlainTP", (_SPMLP,), {"enter": _Copy, "leave": _Reduce})   # f and g on its tokens only
SPMLPWithF = type("SPMLPWithF", (_SPMLP,), {"enter": GatherSumsTwice})              # f on top of the all-gather

_COPY_SLICE = "keep a copy of the slice: nn.Parameter(linear.weight.detach()[...].clone())"
_ROWS = ("rank i keeps rows [i*out/t, (i+1)*out/t) of linear.weight, shape (out/t, in): nn.Linear stores W as "
         "(out_features, in_features), so its output features are the rows")
_COLS = ("rank i keeps columns [i*in/t, (i+1)*in/t) of linear.weight, shape (out, in/t): nn.Linear stores W as "
         "(out_features, in_features), so its input features are the columns")
_ENTER_F = ("enter through f (CopyToTP.apply(x, self.group)): each rank's dL/dx covers only its output features, "
            "and the whole gradient is their sum")
_LEAVE_G = ("leave through g (ReduceFromTP.apply(y, self.group)): y is this rank's partial sum x_i W_i^T, and the "
            "output is their sum over the tp ranks")
_ONE_EACH_WAY = ("exactly one all-reduce (sum) over the tp group: a column-parallel layer followed by a row-parallel "
                 "one talks only where the pair starts (f: backward) and ends (g: forward)")
_SP_WHY = ("one all-gather and one reduce-scatter over the tp group, and nothing else: the block enters with "
           "GatherFromSP and leaves with ReduceScatterToSP")

COLUMN = _TP(
    "ColumnParallelLinear", *_parts("column", COLUMN_CASES),
    note=SETUP + "ColumnParallelLinear(linear, group) on x (the same on every rank), rank i backpropagates its slice "
                 "of dL/dY. Compared with one full F.linear: y, x.grad, W.grad",
    quantities=_quantities(
        "none: x is whole on every rank, and each computes its own output features (f's forward is the identity)",
        "y, this rank's output features", f"one all-reduce (sum) of dL/dx over the tp group: {_ENTER_F}",
        "x.grad, the whole gradient", kept=f"what the module keeps at .weight, an nn.Parameter: {_ROWS}",
        weights=("module.weight",)),
    misconceptions=[
        Misconception(ColumnTakesColumns, "that is the row layer's shard: a column-parallel layer keeps rows"),
        Misconception(ColumnGlobalRank, "rank i of the tp group keeps slice i: i = dist.get_rank(group), t = "
                                        "dist.get_world_size(group), not the global rank (rank 2 is 0 of its pair)"),
        Misconception(ColumnPlainTensor, f"module.weight is not an nn.Parameter, so autograd never fills its .grad: "
                                         f"{_COPY_SLICE}"),
        Misconception(ColumnKeepsLinear, "keep only the shard: self.linear = linear keeps all of W on every rank"),
        Misconception(ColumnViewShard, f"module.weight is a view into the memory of the whole weight: every rank "
                                       f"would still store all of W; {_COPY_SLICE}"),
        Misconception(ColumnWithReduce, "x is whole on every rank: enter through f, whose forward is the identity, "
                                        "not g, which all-reduces in forward"),
        Misconception(ColumnNoCopy, _ENTER_F)])

ROW = _TP(
    "RowParallelLinear", *_parts("row", ROW_CASES),
    note=SETUP + "RowParallelLinear(linear, group) on x_i, rank i's slice of x's features; every rank backpropagates "
                 "the same dL/dY. Compared with one full F.linear: y, x.grad, W.grad",
    quantities=_quantities(
        f"one all-reduce (sum) of y over the tp group: {_LEAVE_G}", "y, the whole output",
        "none: every rank holds the whole dL/dy, and x_i's and W_i's gradients need only it and this rank's own x_i "
        "and W_i (g's backward is the identity)", "x.grad, this rank's input features",
        kept=f"what the module keeps at .weight, an nn.Parameter: {_COLS}", weights=("module.weight",)),
    misconceptions=[
        Misconception(RowTakesRows, "that is the column layer's shard: a row-parallel layer keeps columns"),
        Misconception(RowViewShard, f"module.weight is a view into the memory of the whole weight: every rank "
                                    f"would still store all of W; {_COPY_SLICE}"),
        Misconception(RowNoReduce, f"{_LEAVE_G} (f in its place talks only in backward)")])

TP_MLP = _TP(
    "tensor-parallel MLP", *_parts("mlp", MLP_CASES),
    note=SETUP + "y = row(gelu(column(x))) on x, the same on every rank; every rank backpropagates the same dL/dY. "
                 "Compared with the full MLP in one process",
    quantities=_quantities(_ONE_EACH_WAY, "y", _ONE_EACH_WAY, "x.grad", weights=("column.weight", "row.weight"),
                           kept=f"the weights the layers keep, nn.Parameters; column: {_ROWS}; row: {_COLS}"),
    misconceptions=[
        Misconception((_Column, RowNoReduce), f"the row layer must {_LEAVE_G}"),
        Misconception((ColumnNoCopy, _Row), f"the column layer must {_ENTER_F}")])

SP_MLP = _TP(
    "SequenceParallelMLP", *_parts("sp", SP_MLP_CASES),
    note=SETUP + "y_i = SequenceParallelMLP(up, down, group)(x_i), x_i rank i's s/t tokens of x, backpropagating their "
                 "gradient. Compared with the full MLP in one process, cut to what rank i holds",
    quantities=_quantities(_SP_WHY, "y, this rank's tokens", _SP_WHY, "x.grad, this rank's tokens",
                           kept="the weights the module keeps, nn.Parameters: up_weight, rows [i ffn/t, (i+1) ffn/t) "
                                "of up.weight (ffn/t, h), as the column layer; down_weight, columns of down.weight "
                                "(h, ffn/t), as the row layer", weights=("up_weight", "down_weight")),
    misconceptions=[
        Misconception(SPMLPSwapsShards, "up_weight is the other layer's shard: it keeps rows of up.weight, as a "
                                        "column-parallel layer"),
        Misconception(SPMLPKeepsLinears, "keep only up_weight and down_weight (not the Linears themselves)"),
        Misconception(SPMLPViewShards, f"up_weight and down_weight are views into the memory of the whole weights: "
                                       f"{_COPY_SLICE}"),
        Misconception(SPMLPPlainTP, _IN_PLACE),
        Misconception(SPMLPWithF, _NOT_ON_TOP)])
LAYERS = {"column": COLUMN, "row": ROW, "mlp": TP_MLP, "sp": SP_MLP}


def check_column_parallel(ColumnParallelLinear: type) -> None:
    """Rank i keeps rows [i out/t, (i+1) out/t) of W; y_i = x W_i^T is its slice of the output features,
    with no communication; backward sums the input gradient over the tp group (one all-reduce) and
    leaves each rank the gradient of its own rows of W."""
    COLUMN(ColumnParallelLinear)


def check_row_parallel(RowParallelLinear: type) -> None:
    """Rank i keeps columns [i in/t, (i+1) in/t) of W and gets its slice x_i of the input features;
    y = sum_i x_i W_i^T on every rank, by one all-reduce; backward needs no communication."""
    ROW(RowParallelLinear)


def check_tp_mlp(ColumnParallelLinear: type, RowParallelLinear: type) -> None:
    """Column-parallel (h -> f), GELU on this rank's f/t features, row-parallel (f -> h): the full MLP,
    with one all-reduce in forward (leaving) and one in backward (entering), none in between."""
    TP_MLP((ColumnParallelLinear, RowParallelLinear))


def check_sp_mlp(SequenceParallelMLP: type) -> None:
    """Stretch. SequenceParallelMLP(up, down, group) keeps rows of up's weight (up_weight, (ffn/t, h)) and columns of
    down's (down_weight, (h, ffn/t)); on this rank's tokens (b, s/t, h) it returns its tokens of the full MLP
    down(gelu(up(x))). One all-gather and one reduce-scatter each way; no all-reduce."""
    SP_MLP(SequenceParallelMLP)


# ---- 3. vocab-parallel cross-entropy -----------------------------------------------------------
def _ce_inputs(lead: tuple, vocab: int, offset: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full logits (..., V) and the targets (...), as every rank and the parent make them."""
    logits = offset + CE_SPREAD * rank_tensor(200, (*lead, vocab), FP32, seed)
    generator = torch.Generator().manual_seed(300 + seed)
    return logits, torch.randint(0, vocab, lead, generator=generator)


def _ce_case(fn: Callable, case: dict, group) -> dict:
    tp, (_, lead, vocab, offset, upstream) = case["tp"], case["_item"]
    logits, targets = _ce_inputs(lead, vocab, offset, case["_seed"])
    local = _cut(logits, dist.get_rank(group), tp, -1).clone().requires_grad_()  # entries [i V/t, (i+1) V/t)
    seen = _run(lambda z: fn(z, targets.clone(), group), local, torch.tensor(upstream), group, {"grad": local})
    calls, loss = seen.pop("calls"), seen.pop("y")
    numbers = sum(call.numel for call in calls if call.op == "all_reduce")
    return {**seen, "gathers": sorted({call.op for call in calls} - {"all_reduce"}),
            "per token": "at most 3" if numbers <= 3 * targets.numel() else
                         f"{numbers} numbers, {numbers / targets.numel():g} per token",
            "off the group": [said for said in seen["forward"] if not said.endswith(f"the tp group of {tp}")],
            "finite": None if loss is None else bool(torch.isfinite(loss).all()), "loss": loss}


def _expect_ce(case: dict, got: dict) -> dict:
    """F.cross_entropy (mean over tokens) of the full logits in float64, and d(upstream x loss)/dlogits."""
    tp, (_, lead, vocab, offset, upstream) = case["tp"], case["_item"]
    logits, targets = _ce_inputs(lead, vocab, offset, case["_seed"])
    z = logits.double().requires_grad_()
    (upstream * (loss := F.cross_entropy(z.flatten(0, -2), targets.flatten()))).backward()
    return {"returned": ["a Tensor of shape ()"] * WORLD, "gathers": [[]] * WORLD, "per token": ["at most 3"] * WORLD,
            "off the group": [[]] * WORLD, "backward": [[]] * WORLD, "finite": [True] * WORLD,
            "loss": [loss.detach()] * WORLD, "grad": _each(tp, lambda i: _cut(z.grad, i, tp, -1))}


class _CE(Function):
    """The correct vocab-parallel cross-entropy; `wrong` names the mistake of a misconception below."""

    @staticmethod
    def forward(ctx, logits, targets, group, wrong=""):
        k = logits.shape[-1]
        low = (dist.get_rank() if wrong == "global rank" else dist.get_rank(group)) * k
        group = None if wrong == "whole world" else group                       # forgot group=
        m = torch.zeros(targets.shape) if wrong == "no max" else logits.amax(-1)
        if wrong not in ("no max", "local max"):
            dist.all_reduce(m, op=MAX, group=group)
        e = (logits - m[..., None]).exp()
        owned = (targets >= low) & (targets < low + k)
        idx = torch.where(owned, targets - low, 0)
        target = logits.gather(-1, idx[..., None])[..., 0] - m
        s = _all_reduce(e.sum(-1), group)
        target = _all_reduce(target if wrong == "target on every rank" else target * owned, group)
        ctx.save_for_backward(e, s, idx, owned)
        ctx.wrong = wrong
        return (s.log() - target).mean() * (targets.numel() if wrong == "sum" else 1)

    @staticmethod
    def backward(ctx, grad):
        e, s, idx, owned = ctx.saved_tensors
        if ctx.wrong == "backward talks":
            _all_reduce(s, None)                                   # a needless collective
        one_hot = F.one_hot(idx, e.shape[-1]) * (1 if ctx.wrong == "one-hot on every rank" else owned[..., None])
        g = (e / s[..., None] - one_hot) * (1 if ctx.wrong == "ignores grad" else grad)
        return g / (1 if ctx.wrong == "gradient of the sum" else idx.numel()), None, None, None


def _ce(wrong: str) -> Callable:
    """A vocab_parallel_cross_entropy with the mistake `wrong`."""
    def answer(local_logits, targets, group):
        return _CE.apply(local_logits, targets, group, wrong)
    answer.__name__ = "ce_" + wrong.replace(" ", "_").replace("-", "_")
    return answer


def ce_all_gather(local_logits, targets, group):   # the full logits on every rank: b s V numbers
    pieces = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local_logits.detach().contiguous(), group=group)
    pieces[dist.get_rank(group)] = local_logits
    return F.cross_entropy(torch.cat(pieces, -1).flatten(0, -2), targets.flatten())


def ce_all_reduces_logits(local_logits, targets, group):   # its slice zero-padded to all V and summed: a gather
    i, k, tp = dist.get_rank(group), local_logits.shape[-1], dist.get_world_size(group)
    full = _Reduce.apply(F.pad(local_logits, (i * k, (tp - 1 - i) * k)), group)
    return F.cross_entropy(full.flatten(0, -2), targets.flatten())


def ce_per_token(local_logits, targets, group):
    return _CE.apply(local_logits, targets, group, "").expand(targets.shape)   # a (batch, seq) tensor


_SLICE_OWNS = "rank i of the tp group owns vocabulary entries [i V/t, (i+1) V/t)"
CE = _TP(
    "vocab_parallel_cross_entropy", observe=_launch(_ce_case), expect=_expect_ce,
    cases=_cases(CE_CASES, case=lambda c: c[0], tokens=lambda c: math.prod(c[1]), V=lambda c: c[2]),
    note=SETUP + "rank i gets vocabulary entries [i V/t, (i+1) V/t) of the logits, backpropagates upstream x loss. "
                 "Compared with F.cross_entropy on the full logits (float64)",
    quantities={
        "returned": _exact("what vocab_parallel_cross_entropy returned (the mean loss, a 0-dim tensor)"),
        "gathers": _exact("the forward's collectives other than all-reduce (none: no rank may gather the "
                          "full-vocabulary logits, b s V numbers, the largest tensor of the model)"),
        "per token": _exact("the numbers the forward all-reduced (per-token numbers, shape (batch, seq))"),
        "off the group": _exact("the forward's collectives off the tp group (pass group=group to every collective)"),
        "backward": _exact("the backward's collectives (none: the softmax, or the max and the sum of exponentials, "
                           "saved in forward is all it needs)"),
        "finite": _exact("whether the loss is finite"),
        "loss": _close("the loss, against F.cross_entropy of the full logits: the max over the whole vocabulary "
                       "(all-reduce MAX), the sum of exp(z - max) over it (all-reduce SUM), the target's logit from "
                       f"the one rank that holds it, others adding 0 ({_SLICE_OWNS}), loss = mean over tokens of "
                       "log(sum) - (z_target - max); every rank of a group computes the same loss from the same sums"),
        "grad": _close("local_logits.grad, this rank's slice of dL/dz = (softmax(z) - one_hot(target)) x grad_output "
                       "/ tokens, from the max-shifted softmax saved in forward (backward returns it first, then None "
                       "for targets and group)")},
    misconceptions=[
        Misconception(ce_per_token, "return the mean loss as a 0-dim tensor that backward can start from"),
        Misconception(ce_all_gather, "all-reduce three numbers per token instead: the max, the sum of exponentials, "
                                     "the target's logit"),
        Misconception(ce_all_reduces_logits, "all-reducing zero-padded logits gathers them: all-reduce per-token "
                                             "numbers, never logits"),
        Misconception(_ce("whole world"), "the forward all-reduced over 4 ranks, not the 2 of the tp group"),
        Misconception(_ce("backward talks"), "backward needs no communication"),
        Misconception(_ce("no max"), "exp overflowed (fp32's exp is inf above 88.7). Subtract each token's max logit "
                                     "over the whole vocabulary (all-reduce the local max with ReduceOp.MAX) before "
                                     "exp: softmax does not change when every logit moves by the same amount"),
        Misconception(_ce("local max"), "no all-reduce with MAX: the max subtracted before exp must be the same on "
                                        "every rank (the max over the whole vocabulary), or the ranks' sums of "
                                        "exponentials are on different scales"),
        Misconception(_ce("target on every rank"), f"every rank added a target logit: only the rank whose slice "
                                                   f"holds a token's target has its logit ({_SLICE_OWNS}); the others "
                                                   f"must add 0 for that token"),
        Misconception(_ce("sum"), "the loss is the sum over the tokens; return the mean (divide by batch x seq)"),
        Misconception(_ce("global rank"), f"the first tp group is right, the second is not: {_SLICE_OWNS}, i = "
                                          "dist.get_rank(group), not the global rank (rank 2 of the world is rank 0 "
                                          "of its group of 2)"),
        Misconception(_ce("ignores grad"), "local_logits.grad ignores the incoming gradient: multiply by backward's "
                                           "grad_output"),
        Misconception(_ce("gradient of the sum"), "local_logits.grad is tokens x too large: the loss is a mean over "
                                                  "the tokens, divide by them"),
        Misconception(_ce("one-hot on every rank"), "the one-hot 1 of dL/dz = softmax(z) - one_hot(target) sits only "
                                                    "on the rank whose slice holds the target")])


def check_vocab_parallel_cross_entropy(vocab_parallel_cross_entropy: Callable) -> None:
    """Each rank gets its V/t slice of the logits; every rank must return the mean cross-entropy of the
    full logits, and backward must give each rank its slice of the full gradient. Forward may
    all-reduce at most 3 numbers per token (no other collective: no rank may gather b s V logits);
    backward needs no communication."""
    CE(vocab_parallel_cross_entropy)


# ---- 5. predict, then run: the MLP with a given g -----------------------------------------------
DEMO_TOKENS, DEMO_HIDDEN, DEMO_FFN, DEMO_STEPS = 6, 8, 16, 5
DEMO_OPTIMIZERS = {"AdamW": 1e-2, "SGD": 0.5}              # name: learning rate
ADAMW_BETAS, ADAMW_EPS, ADAMW_DECAY = (0.9, 0.999), 1e-8, 0.01   # torch.optim.AdamW's defaults


def mlp_with_g(g: type) -> dict:
    """The MLP x -> column (f) -> GELU -> row -> g, with the g given, on 4 ranks as tp=4 and as two groups of tp=2,
    against one process. Prints the loss and each gradient as a multiple of one process's (the best multiple, and
    whether it matches to round-off), then the loss of DEMO_STEPS steps of training with AdamW and with SGD. Returns
    the numbers printed."""
    results = on_ranks(_mlp_with_g_on_rank, WORLD, g)
    x, target, w_up, w_down = _demo_data()
    ref = _demo_run(x, target, [w_up, w_down], lambda y: y)
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
    """(k, exact): the k that makes k x want closest to got (least squares), and whether got = k x want."""
    got, want = got.double(), want.double()
    k = (got * want).sum().item() / (want * want).sum().item()
    return k, close_enough(got, k * want, FP32, n=ROUNDINGS)


def _demo_data() -> tuple[torch.Tensor, ...]:
    return (rank_tensor(1, (DEMO_TOKENS, DEMO_HIDDEN), FP32), rank_tensor(3, (DEMO_TOKENS, DEMO_HIDDEN), FP32),
            _weight(DEMO_FFN, DEMO_HIDDEN, 0, 0), _weight(DEMO_HIDDEN, DEMO_FFN, 0, 1))


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


def _demo_run(x, target, weights: list[torch.Tensor], leave: Callable) -> dict:
    """Loss and gradients of the MLP on `weights` (the full ones, or a rank's shards), and its training curves."""
    x_in, up, down = (t.clone().requires_grad_() for t in (x, *weights))
    loss = _demo_loss(x_in, target, up, down, leave)
    loss.backward()
    return {"loss": loss.item(), "x_grad": x_in.grad, "up_grad": up.grad, "down_grad": down.grad,
            "curves": _demo_curves(x, target, weights, leave)}


def _mlp_with_g_on_rank(g: type) -> list:
    rank, out = dist.get_rank(), []
    x, target, w_up, w_down = _demo_data()
    for tp, group in world_and_halves().items():
        i = rank % tp                              # column's rows, row's columns
        out.append(_demo_run(x, target, [_cut(w_up, i, tp, 0), _cut(w_down, i, tp, 1)], lambda y: g.apply(y, group)))
        dist.all_reduce(out[-1]["x_grad"], group=group)   # what f does in backward: add the ranks' terms of dL/dx
    return out

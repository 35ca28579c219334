"""The checks of assignment 04 pass correct answers and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.parallel.tensor_parallel, except to see that the checks refuse it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function

from picotron_course.checks_tp import (TP_SIZES, check_column_parallel, check_copy_to_tp, check_gather_from_sp,
                                       check_reduce_from_tp, check_reduce_scatter_to_sp, check_row_parallel,
                                       check_sp_mlp, check_tp_mlp, check_vocab_parallel_cross_entropy, mlp_with_g,
                                       recorded_collectives)
from picotron.launch import run

MAX, AVG = dist.ReduceOp.MAX, dist.ReduceOp.AVG
PACKAGE = "picotron.parallel.tensor_parallel"


# ---- correct answers ------------------------------------------------------------------------------
class RefCopy(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed, None


class RefReduce(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RefReduceInPlace(Function):
    """Megatron's way: all-reduce the partial sum where it lies and return it."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RefCopyMegatron(Function):
    """Megatron-LM's way: return the input itself, all-reduce the incoming gradient in place."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class RefCopyThroughComm(RefCopy):
    """The same through picotron.comm's wrapper, which calls torch under its own name."""

    @staticmethod
    def backward(ctx, grad):
        from picotron.comm import all_reduce
        summed = grad.contiguous().clone()
        all_reduce(summed, group=ctx.group)
        return summed, None


def _rank_and_size(group):
    return dist.get_rank(group), dist.get_world_size(group)


class RefColumn(nn.Module):
    copy = RefCopy

    def __init__(self, linear, group):
        super().__init__()
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = nn.Parameter(torch.chunk(linear.weight.detach(), size, dim=0)[rank].clone())

    def forward(self, x):
        return F.linear(self.copy.apply(x, self.group), self.weight)


class RefRow(nn.Module):
    reduce = RefReduce

    def __init__(self, linear, group):
        super().__init__()
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = nn.Parameter(torch.chunk(linear.weight.detach(), size, dim=1)[rank].contiguous())

    def forward(self, x):
        return self.reduce.apply(x @ self.weight.T, self.group)


def _ce_forward(ctx, logits, targets, group, low):
    """RefCE's forward with this rank's first vocabulary entry given."""
    k = logits.shape[-1]
    m = logits.max(dim=-1).values
    dist.all_reduce(m, op=MAX, group=group)
    e = torch.exp(logits - m.unsqueeze(-1))
    s = e.sum(dim=-1)
    dist.all_reduce(s, group=group)
    owned = (targets >= low) & (targets < low + k)
    idx = torch.where(owned, targets - low, torch.zeros_like(targets))
    picked = logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - m
    zt = torch.where(owned, picked, torch.zeros_like(picked))
    dist.all_reduce(zt, group=group)
    ctx.save_for_backward(e, s, idx, owned)
    return (torch.log(s) - zt).mean()


class RefCE(Function):
    @staticmethod
    def forward(ctx, logits, targets, group):
        return _ce_forward(ctx, logits, targets, group, dist.get_rank(group) * logits.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        e, s, idx, owned = ctx.saved_tensors
        g = e / s.unsqueeze(-1)
        g.scatter_add_(-1, idx.unsqueeze(-1), -owned.unsqueeze(-1).to(g.dtype))
        return g * grad / idx.numel(), None, None


def ref_ce(local_logits, targets, group):
    return RefCE.apply(local_logits, targets, group)


def ref_ce_merged(local_logits, targets, group):
    """Sum of exponentials and target logit in one all-reduce: 3 numbers per token in two calls."""
    return RefCEMerged.apply(local_logits, targets, group)


class RefCEMerged(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        k = logits.shape[-1]
        low = dist.get_rank(group) * k
        m = logits.amax(-1)
        dist.all_reduce(m, op=MAX, group=group)
        e = (logits - m[..., None]).exp()
        owned = (targets >= low) & (targets < low + k)
        idx = (targets - low).clamp(0, k - 1)
        both = torch.stack([e.sum(-1), ((logits.gather(-1, idx[..., None])[..., 0] - m) * owned)])
        dist.all_reduce(both, group=group)
        ctx.save_for_backward(e, both[0], idx, owned)
        return (both[0].log() - both[1]).mean()


def ref_ce_from_pieces(local_logits, targets, group):
    """No Function of its own: autograd through g (identity backward) for the two sums."""
    k = local_logits.shape[-1]
    low = dist.get_rank(group) * k
    m = local_logits.detach().amax(-1)
    dist.all_reduce(m, op=MAX, group=group)
    shifted = local_logits - m[..., None]
    sum_exp = RefReduce.apply(shifted.exp().sum(-1), group)
    owned = (targets >= low) & (targets < low + k)
    picked = shifted.gather(-1, (targets - low).clamp(0, k - 1)[..., None]).squeeze(-1)
    target = RefReduce.apply(picked * owned, group)
    return (sum_exp.log() - target).mean()


CORRECT = [(check_copy_to_tp, (RefCopy,)), (check_copy_to_tp, (RefCopyMegatron,)),
           (check_copy_to_tp, (RefCopyThroughComm,)),
           (check_reduce_from_tp, (RefReduce,)), (check_reduce_from_tp, (RefReduceInPlace,)),
           (check_column_parallel, (RefColumn,)), (check_row_parallel, (RefRow,)),
           (check_tp_mlp, (RefColumn, RefRow)), (check_vocab_parallel_cross_entropy, (ref_ce,)),
           (check_vocab_parallel_cross_entropy, (ref_ce_merged,)),
           (check_vocab_parallel_cross_entropy, (ref_ce_from_pieces,))]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"CopyToTP (f)": 4, "ReduceFromTP (g)": 4, "ColumnParallelLinear": 4, "RowParallelLinear": 4,
         "tensor-parallel MLP": 4, "vocab_parallel_cross_entropy": 6}


@pytest.mark.parametrize("check, answers", CORRECT, ids=["copy", "copy_megatron", "copy_comm", "reduce",
                                                         "reduce_in_place", "column", "row", "mlp", "ce", "ce_merged",
                                                         "ce_pieces"])
def test_correct_answer_passes(check, answers, every_case):
    check(*answers)
    every_case(CASES)


# ---- planted wrong answers: f and g ---------------------------------------------------------------
class CopyReducesForward(Function):
    """f and g swapped: the all-reduce in the wrong direction."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class CopyNoAllReduce(RefCopy):
    @staticmethod
    def backward(ctx, grad):
        return grad, None  # each rank keeps only its own term of dL/dx


class CopyAverages(RefCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=AVG, group=ctx.group)
        return grad, None


class CopyWholeWorld(RefCopy):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # forgot group=: sums over all 4 ranks
        return grad, None


class ReduceAverages(RefReduce):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=AVG, group=group)
        return y


class ReduceBackwardToo(RefReduce):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceDividesAndReducesBackward(RefReduce):
    """Averages in backward: the right numbers (the gradients are equal), a needless all-reduce."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, op=AVG, group=ctx.group)
        return grad, None


# ---- column / row -------------------------------------------------------------------------------
class ColumnTakesColumns(RefColumn):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = _rank_and_size(group)
        n = linear.in_features // size
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone())  # the row layer's


class ColumnGlobalRank(RefColumn):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        size, rank = dist.get_world_size(group), dist.get_rank()  # global rank
        n = linear.out_features // size
        self.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone())


class ColumnNoCopy(RefColumn):
    def forward(self, x):
        return F.linear(x, self.weight)  # forgets f: no all-reduce of dL/dx in backward


class ColumnWithReduce(RefColumn):
    copy = RefReduce  # g instead of f


class ColumnKeepsLinear(RefColumn):
    def __init__(self, linear, group):
        super().__init__(linear, group)
        self.linear = linear  # its whole weight becomes a parameter of this module too


class ColumnPlainTensor(RefColumn):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = torch.chunk(linear.weight, size, dim=0)[rank]  # a view, not a Parameter


class ColumnViewShard(RefColumn):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = _rank_and_size(group)
        n = linear.out_features // size
        self.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n])  # a view: W stays whole


class RowViewShard(RefRow):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = _rank_and_size(group)
        self.weight = nn.Parameter(torch.chunk(linear.weight.detach(), size, dim=1)[rank])  # a strided view of W


class RowTakesRows(RefRow):
    def __init__(self, linear, group):
        nn.Module.__init__(self)
        self.group = group
        rank, size = _rank_and_size(group)
        n = linear.out_features // size
        self.weight = nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone())  # the column layer's


class RowNoReduce(RefRow):
    def forward(self, x):
        return F.linear(x, self.weight)  # returns the partial sum


class RowWithCopy(RefRow):
    reduce = RefCopy  # f instead of g: the all-reduce in backward


# ---- vocab-parallel cross-entropy ------------------------------------------------------------------
class CENoMax(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        k = logits.shape[-1]
        low = dist.get_rank(group) * k
        e = logits.exp()  # overflows for logits above 88.7
        s = e.sum(-1)
        dist.all_reduce(s, group=group)
        owned = (targets >= low) & (targets < low + k)
        idx = (targets - low).clamp(0, k - 1)
        zt = logits.gather(-1, idx[..., None])[..., 0] * owned
        dist.all_reduce(zt, group=group)
        ctx.save_for_backward(e, s, idx, owned)
        return (s.log() - zt).mean()


class CELocalMax(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        k = logits.shape[-1]
        low = dist.get_rank(group) * k
        m = logits.amax(-1)  # this rank's max only
        e = (logits - m[..., None]).exp()
        s = e.sum(-1)
        dist.all_reduce(s, group=group)
        owned = (targets >= low) & (targets < low + k)
        idx = (targets - low).clamp(0, k - 1)
        zt = (logits.gather(-1, idx[..., None])[..., 0] - m) * owned
        dist.all_reduce(zt, group=group)
        ctx.save_for_backward(e, s, idx, owned)
        return (s.log() - zt).mean()


class CETargetOnEveryRank(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        k = logits.shape[-1]
        low = dist.get_rank(group) * k
        m = logits.amax(-1)
        dist.all_reduce(m, op=MAX, group=group)
        e = (logits - m[..., None]).exp()
        s = e.sum(-1)
        dist.all_reduce(s, group=group)
        owned = (targets >= low) & (targets < low + k)
        idx = torch.where(owned, targets - low, 0)
        zt = logits.gather(-1, idx[..., None])[..., 0] - m  # not zeroed on the ranks that do not own it
        dist.all_reduce(zt, group=group)
        ctx.save_for_backward(e, s, idx, owned)
        return (s.log() - zt).mean()


class CESum(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        return RefCE.forward(ctx, logits, targets, group) * targets.numel()


class CEGlobalRank(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        return _ce_forward(ctx, logits, targets, group, dist.get_rank() * logits.shape[-1])  # the global rank


class CEWholeWorld(RefCE):
    @staticmethod
    def forward(ctx, logits, targets, group):
        return _ce_forward(ctx, logits, targets, None, dist.get_rank(group) * logits.shape[-1])  # forgot group=


class CEAllGather(Function):
    """Gathers the full logits on every rank: b s V numbers."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        size = dist.get_world_size(group)
        pieces = [torch.empty_like(logits) for _ in range(size)]
        dist.all_gather(pieces, logits.contiguous(), group=group)
        full = torch.cat(pieces, -1)
        ctx.save_for_backward(full, targets)
        ctx.rank, ctx.size = dist.get_rank(group), size
        return F.cross_entropy(full.flatten(0, -2), targets.flatten())

    @staticmethod
    def backward(ctx, grad):
        full, targets = ctx.saved_tensors
        g = (full.softmax(-1) - F.one_hot(targets, full.shape[-1])) * grad / targets.numel()
        return g.chunk(ctx.size, -1)[ctx.rank], None, None


class CEAllReducesLogits(Function):
    """Zero-pads its slice to the whole vocabulary and all-reduces: the gather in disguise."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        k = logits.shape[-1]
        full = logits.new_zeros(*logits.shape[:-1], k * size)
        full[..., rank * k:(rank + 1) * k] = logits
        dist.all_reduce(full, group=group)
        ctx.save_for_backward(full, targets)
        ctx.rank, ctx.size = rank, size
        return F.cross_entropy(full.flatten(0, -2), targets.flatten())

    backward = staticmethod(CEAllGather.backward)


class CEBackwardTalks(RefCE):
    @staticmethod
    def backward(ctx, grad):
        e, s, idx, owned = ctx.saved_tensors
        check = s.clone()
        dist.all_reduce(check)  # a needless collective in backward
        return RefCE.backward(ctx, grad)


class CEIgnoresGradOutput(RefCE):
    @staticmethod
    def backward(ctx, grad):
        return RefCE.backward(ctx, torch.ones_like(grad))


class CEGradientOfTheSum(RefCE):
    @staticmethod
    def backward(ctx, grad):
        g, _, _ = RefCE.backward(ctx, grad)
        return g * ctx.saved_tensors[2].numel(), None, None  # forgets to divide by the tokens


class CEOneHotOnEveryRank(RefCE):
    @staticmethod
    def backward(ctx, grad):
        e, s, idx, owned = ctx.saved_tensors
        g = e / s[..., None] - F.one_hot(idx, e.shape[-1])  # the 1 on every rank, not only the owner's
        return g * grad / idx.numel(), None, None


def _ce(function):
    def loss(local_logits, targets, group):
        return function.apply(local_logits, targets, group)
    loss.__name__ = function.__name__
    return loss


def ce_returns_per_token(local_logits, targets, group):
    return RefCE.apply(local_logits, targets, group).expand(targets.shape)  # a (batch, seq) tensor


def _course_answer():
    from picotron.parallel.tensor_parallel import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy


CourseCopy = type("CopyToTP", (RefCopy,), {"__module__": PACKAGE})  # named, never imported

WRONG_ANSWERS = [
    (check_copy_to_tp, (CopyReducesForward,), "expected no communication: f's forward is the identity"),
    (check_copy_to_tp, (CopyNoAllReduce,), "made no collective; f's backward must all-reduce"),
    (check_copy_to_tp, (CopyAverages,), "AVG"),
    (check_copy_to_tp, (CopyWholeWorld,), "all-reduced over 4 ranks, not the 2 of the tp group"),
    (check_copy_to_tp, (CourseCopy,), "the course's answer"),
    (check_reduce_from_tp, (ReduceAverages,), "AVG"),
    (check_reduce_from_tp, (ReduceBackwardToo,), "g's backward is the identity"),
    (check_reduce_from_tp, (ReduceDividesAndReducesBackward,), "g's backward is the identity"),
    (check_reduce_from_tp, (RefCopy,), "made no collective; g's forward must all-reduce"),
    (check_column_parallel, (ColumnTakesColumns,), "the other layer's shard"),
    (check_column_parallel, (ColumnGlobalRank,), r"dist.get_rank\(group\)"),
    (check_column_parallel, (ColumnNoCopy,), r"made no collective; enter through f"),
    (check_column_parallel, (ColumnWithReduce,), "expected no communication"),
    (check_column_parallel, (ColumnKeepsLinear,), "keep only the shard"),
    (check_column_parallel, (ColumnPlainTensor,), "not an nn.Parameter"),
    (check_column_parallel, (ColumnViewShard,), "a view into the memory of the whole weight"),
    (check_row_parallel, (RowViewShard,), "a view into the memory of the whole weight"),
    (check_row_parallel, (RowTakesRows,), "the other layer's shard"),
    (check_row_parallel, (RowNoReduce,), "made no collective; leave through g"),
    (check_row_parallel, (RowWithCopy,), "made no collective; leave through g"),
    (check_tp_mlp, (ColumnNoCopy, RefRow), "the MLP's backward .* made no collective"),
    (check_tp_mlp, (RefColumn, RowNoReduce), "the MLP's forward .* made no collective"),
    (check_vocab_parallel_cross_entropy, (_ce(CENoMax),), "exp overflowed"),
    (check_vocab_parallel_cross_entropy, (_ce(CELocalMax),), "no all-reduce with MAX"),
    (check_vocab_parallel_cross_entropy, (_ce(CETargetOnEveryRank),), "every rank added a target logit"),
    (check_vocab_parallel_cross_entropy, (_ce(CESum),), "sum over the 6 tokens"),
    (check_vocab_parallel_cross_entropy, (_ce(CEWholeWorld),), "all-reduced over 4 ranks, not the 2 of the tp group"),
    (check_vocab_parallel_cross_entropy, (_ce(CEAllGather),), "called all_gather .* no rank may gather"),
    (check_vocab_parallel_cross_entropy, (_ce(CEAllReducesLogits),), "more than 3 per token"),
    (check_vocab_parallel_cross_entropy, (_ce(CEBackwardTalks),), "it needs no communication"),
    (check_vocab_parallel_cross_entropy, (_ce(CEIgnoresGradOutput),), "ignores the incoming gradient"),
    (check_vocab_parallel_cross_entropy, (_ce(CEGradientOfTheSum),), "too large: the loss is a mean"),
    (check_vocab_parallel_cross_entropy, (_ce(CEOneHotOnEveryRank),), "only on the rank whose slice holds"),
    (check_vocab_parallel_cross_entropy, (ce_returns_per_token,), "return the mean loss as a 0-dim tensor"),
]


@pytest.mark.parametrize("check, answers, says", WRONG_ANSWERS,
                         ids=[f"{c.__name__.removeprefix('check_')}-{a[0].__name__}" for c, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answers, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(*answers)
    if answers[0] is not CourseCopy:  # refused before running: no table
        assert "FAIL" in capsys.readouterr().out


def test_global_rank_in_the_loss_fails_only_the_groups_of_two(capsys):
    """Rank 2 of the world is rank 0 of its pair: with the global rank, ranks 2-3 own no target."""
    with pytest.raises(AssertionError, match=r"dist.get_rank\(group\)"):
        check_vocab_parallel_cross_entropy(_ce(CEGlobalRank))
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  FAIL case=")]
    assert len(failed) == 3 and all(", tp=2," in line for line in failed), failed


def test_the_course_answer_is_refused():
    with pytest.raises(AssertionError, match="the course's answer"):
        check_vocab_parallel_cross_entropy(_course_answer())


# ---- the recorder --------------------------------------------------------------------------------
def _record_each_name():
    import picotron.comm as comm
    import torch.distributed.nn.functional as dist_nn
    rank = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    originals = (dist.all_reduce, dist.all_gather_into_tensor, comm._all_gather_single)
    x, full = torch.ones(3), torch.zeros(3 * 4)
    with recorded_collectives() as calls:
        dist.all_reduce(x.clone(), op=MAX, group=pair)
        comm.all_reduce(x.clone())
        dist_nn.all_reduce(x.clone(), group=pair)
        dist.all_gather_into_tensor(full, x)
        comm.all_gather(full, x)
        dist.all_gather([torch.zeros(3) for _ in range(4)], x)
        dist.all_gather_object([None] * 4, rank)
    restored = originals == (dist.all_reduce, dist.all_gather_into_tensor, comm._all_gather_single)
    return [(c.op, c.numel, c.nbytes, c.reduce, c.group_size) for c in calls], restored


def test_recorder_counts_each_call_once_with_its_group():
    calls, restored = run(_record_each_name, 4, timeout=60)[0]
    assert calls[:6] == [("all_reduce", 3, 12, "max", 2), ("all_reduce", 3, 12, "sum", 4),
                         ("all_reduce", 3, 12, "sum", 2), ("all_gather_into_tensor", 12, 48, "", 4),
                         ("all_gather_into_tensor", 12, 48, "", 4), ("all_gather", 3, 12, "", 4)]
    assert [c[0] for c in calls[6:]] == ["all_gather_object"]
    assert restored


# ---- stretch: sequence parallelism -----------------------------------------------------------------
def _gather_seq(x, group):
    """(b, s/t, h) on every rank -> (b, s, h), rank order, through all_gather_into_tensor (joins along dim 0)."""
    size = dist.get_world_size(group)
    first = x.movedim(1, 0).contiguous()                                # (s/t, b, h)
    whole = first.new_empty(size * first.shape[0], *first.shape[1:])
    dist.all_gather_into_tensor(whole, first, group=group)
    return whole.movedim(0, 1).contiguous()


def _scatter_seq(x, group):
    """(b, s, h) partial sums -> (b, s/t, h): this rank's tokens of their sum, through reduce_scatter_tensor."""
    size = dist.get_world_size(group)
    first = x.movedim(1, 0).contiguous()                                # (s, b, h)
    mine = first.new_empty(first.shape[0] // size, *first.shape[1:])
    dist.reduce_scatter_tensor(mine, first, group=group)
    return mine.movedim(0, 1).contiguous()


class RefGather(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad, ctx.group), None


class RefScatter(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class RefGatherLists(RefGather):
    """The list versions, all_gather and reduce_scatter, as the solution notebook's hints suggest."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, 1)

    @staticmethod
    def backward(ctx, grad):
        pieces = [p.contiguous() for p in grad.chunk(dist.get_world_size(ctx.group), 1)]
        mine = torch.empty_like(pieces[0])
        dist.reduce_scatter(mine, pieces, group=ctx.group)
        return mine, None


class RefSPMLP(nn.Module):
    gather, scatter = RefGather, RefScatter

    def __init__(self, up, down, group):
        super().__init__()
        self.group = group
        rank, size = _rank_and_size(group)
        self.up_weight = nn.Parameter(torch.chunk(up.weight.detach(), size, 0)[rank].clone())
        self.down_weight = nn.Parameter(torch.chunk(down.weight.detach(), size, 1)[rank].contiguous())

    def forward(self, x):
        h = F.gelu(self.gather.apply(x, self.group) @ self.up_weight.T)
        return self.scatter.apply(h @ self.down_weight.T, self.group)


SP_CORRECT = [(check_gather_from_sp, (RefGather,)), (check_gather_from_sp, (RefGatherLists,)),
              (check_reduce_scatter_to_sp, (RefScatter,)), (check_sp_mlp, (RefSPMLP,))]


@pytest.mark.parametrize("check, answers", SP_CORRECT, ids=["gather", "gather_lists", "scatter", "sp_mlp"])
def test_correct_stretch_answer_passes(check, answers, capsys):
    check(*answers)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


class GatherKeepsOwnTerm(RefGather):
    @staticmethod
    def backward(ctx, grad):
        rank, size = _rank_and_size(ctx.group)
        return grad.chunk(size, 1)[rank].contiguous(), None   # its own term of its tokens, never summed


class GatherAllReducesBackward(RefGather):
    """The right numbers by an all-reduce and a slice: twice the bytes of a reduce-scatter."""

    @staticmethod
    def backward(ctx, grad):
        rank, size = _rank_and_size(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(size, 1)[rank].contiguous(), None


class GatherAlongBatch(RefGather):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, 0)                            # joined along the batch, not the sequence


class GatherWholeWorld(RefGather):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, None)                            # forgot group=: all 4 ranks


class GatherSumsTwice(RefGather):
    """f's all-reduce kept in backward, then the reduce-scatter: the input gradient summed twice."""

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _scatter_seq(grad, ctx.group), None


class ScatterByAllReduce(RefScatter):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        rank, size = _rank_and_size(group)
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size, 1)[rank].contiguous()


class ScatterMean(RefScatter):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _scatter_seq(x, group) / dist.get_world_size(group)


class ScatterZeroPadsBackward(RefScatter):
    """Backward puts this rank's gradient at its tokens and zeros elsewhere: no gather."""

    @staticmethod
    def backward(ctx, grad):
        rank, size = _rank_and_size(ctx.group)
        whole = torch.zeros(grad.shape[0], grad.shape[1] * size, *grad.shape[2:])
        whole[:, rank * grad.shape[1]:(rank + 1) * grad.shape[1]] = grad
        return whole, None


class ScatterBackwardSums(RefScatter):
    """Backward reduce-scatters again (the gather's backward, by symmetry gone wrong)."""

    @staticmethod
    def backward(ctx, grad):
        whole = _gather_seq(grad, ctx.group).contiguous()
        dist.all_reduce(whole, group=ctx.group)
        return whole, None


class SPMLPWithF(RefSPMLP):
    def forward(self, x):
        whole = RefCopy.apply(self.gather.apply(x, self.group), self.group)   # f on top of the all-gather
        return self.scatter.apply(F.gelu(whole @ self.up_weight.T) @ self.down_weight.T, self.group)


class SPMLPPlainTP(RefSPMLP):
    def forward(self, x):
        h = F.gelu(RefCopy.apply(x, self.group) @ self.up_weight.T)            # f and g on this rank's tokens only
        return RefReduce.apply(h @ self.down_weight.T, self.group)


class SPMLPKeepsLinears(RefSPMLP):
    def __init__(self, up, down, group):
        super().__init__(up, down, group)
        self.up, self.down = up, down


class SPMLPViewShards(RefSPMLP):
    def __init__(self, up, down, group):
        super().__init__(up, down, group)
        rank, size = _rank_and_size(group)
        self.up_weight = nn.Parameter(torch.chunk(up.weight.detach(), size, 0)[rank])   # a view of the whole W


class SPMLPSwapsShards(RefSPMLP):
    def __init__(self, up, down, group):
        super().__init__(up, down, group)
        rank, size = _rank_and_size(group)
        n = up.in_features // size
        self.up_weight = nn.Parameter(up.weight.detach()[:, rank * n:(rank + 1) * n].clone())  # columns, not rows


CourseGather = type("GatherFromSP", (RefGather,), {"__module__": PACKAGE})   # named, never imported

SP_WRONG = [
    (check_gather_from_sp, (GatherKeepsOwnTerm,), "the backward .* made none; expected one reduce-scatter"),
    (check_gather_from_sp, (GatherAllReducesBackward,), "An all-reduce and then a slice"),
    (check_gather_from_sp, (GatherAlongBatch,), r"join the ranks' pieces along dim 1 .* expected shape \(2, 8, 3\)"),
    (check_gather_from_sp, (GatherWholeWorld,), "over 4 ranks, not the 2 of the tp group"),
    (check_gather_from_sp, (GatherSumsTwice,), "expected one reduce-scatter.* sums what the reduce-scatter sums again"),
    (check_gather_from_sp, (CourseGather,), "the course's answer"),
    (check_reduce_scatter_to_sp, (ScatterByAllReduce,), "An all-reduce and then a slice"),
    (check_reduce_scatter_to_sp, (ScatterMean,), "it is the mean over the ranks"),
    (check_reduce_scatter_to_sp, (ScatterZeroPadsBackward,), "the backward .* made none; expected one all-gather"),
    (check_reduce_scatter_to_sp, (ScatterBackwardSums,), "the backward .* expected one all-gather"),
    (check_reduce_scatter_to_sp, (RefGather,), "the forward .* made all_gather_into_tensor .* expected one "
                                               "reduce-scatter"),
    (check_sp_mlp, (SPMLPWithF,), "the MLP's backward .* all_reduce .* sums what the reduce-scatter sums again"),
    (check_sp_mlp, (SPMLPPlainTP,), "the MLP's forward .* expected one all-gather and one reduce-scatter.* take "
                                    "the place of f's and g's all-reduces"),
    (check_sp_mlp, (SPMLPKeepsLinears,), "keep only up_weight and down_weight"),
    (check_sp_mlp, (SPMLPViewShards,), "up_weight is a view into the memory of the whole weight"),
    (check_sp_mlp, (SPMLPSwapsShards,), "up_weight has shape .* That is the other layer's shard"),
]


@pytest.mark.parametrize("check, answers, says", SP_WRONG,
                         ids=[f"{c.__name__.removeprefix('check_')}-{a[0].__name__}" for c, a, _ in SP_WRONG])
def test_wrong_stretch_answer_fails(check, answers, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(*answers)
    if answers[0] is not CourseGather:  # refused before running: no table
        assert "FAIL" in capsys.readouterr().out


# ---- predict, then run: the harness shows what a g does to the gradients ----------------------------
class ReduceBothWays(RefReduce):
    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def test_mlp_with_g_shows_the_gradients_t_times_too_large(capsys):
    right, both = mlp_with_g(RefReduce), mlp_with_g(ReduceBothWays)
    one = right["one process"]
    for tp in TP_SIZES:
        assert right[f"tp={tp}"]["loss"] == pytest.approx(one["loss"], rel=1e-6)
        assert both[f"tp={tp}"]["loss"] == pytest.approx(one["loss"], rel=1e-6)     # the forward is right
        for (k_right, exact_right), (k_both, exact_both) in zip(right[f"tp={tp}"]["factors"].values(),
                                                                  both[f"tp={tp}"]["factors"].values()):
            assert exact_right and k_right == pytest.approx(1, abs=1e-5)
            assert exact_both and k_both == pytest.approx(tp, rel=1e-5)            # every gradient t x
        assert both[f"tp={tp}"]["curves"]["AdamW"] == pytest.approx(one["curves"]["AdamW"], abs=1e-5)
        assert both[f"tp={tp}"]["curves"]["SGD"] != pytest.approx(one["curves"]["SGD"], abs=1e-2)
    assert "4.000 x" in capsys.readouterr().out

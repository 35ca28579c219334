"""The checks of assignment 04 pass correct answers and refuse the course's own (picotron.parallel.tensor_parallel).

The correct answers are the checks' own correct code, judged with the refusal off, and others written here, not
taken from the solution notebook (which runs under nbval on its own), so a check that passes everything, or nothing,
is caught. The wrong answers are the checks' misconceptions, each failing
with its hint (tests/test_misconceptions.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_course import checks_tp
from picotron_course.checks_tp import (TP_SIZES, check_column_parallel, check_copy_to_tp, check_gather_from_sp,
                                       check_reduce_from_tp, check_reduce_scatter_to_sp, check_row_parallel,
                                       check_sp_mlp, check_tp_mlp, check_vocab_parallel_cross_entropy, mlp_with_g,
                                       recorded_collectives)
from picotron.launch import run

MAX = dist.ReduceOp.MAX
PACKAGE = "picotron.parallel.tensor_parallel"


# ---- correct answers ------------------------------------------------------------------------------
# The checks' own correct code (the bases their misconceptions change, refused as a learner's answer), judged with
# the refusal off: f, g, SP's two and the loss, refused only here, in the parent. The layers are refused on the ranks
# too (where no monkeypatch reaches), so theirs are written here. Then other valid answers, which must pass too.
BASES = {"copy": (check_copy_to_tp, checks_tp._Copy), "reduce": (check_reduce_from_tp, checks_tp._Reduce),
         "gather": (check_gather_from_sp, checks_tp._Gather),
         "scatter": (check_reduce_scatter_to_sp, checks_tp._Scatter),
         "ce": (check_vocab_parallel_cross_entropy, checks_tp._ce(""))}


def function(name, forward, backward, module=__name__):
    """A Function whose forward is forward(x, group) and backward backward(grad, group) (checks_tp's builder), in
    `module`: this file, where the ranks find it."""
    made = checks_tp._function(name, forward, backward)
    made.__module__ = module
    return made


def summed_in_place(t, group):   # Megatron-LM's way: all-reduce the tensor where it lies and return it
    dist.all_reduce(t, group=group)
    return t


def summed_through_comm(t, group):   # picotron.comm's wrapper, which calls torch under its own name
    from picotron.comm import all_reduce
    t = t.contiguous().clone()
    all_reduce(t, group=group)
    return t


def gather_list(x, group):   # the list versions, all_gather and reduce_scatter, as the solution's hints suggest
    pieces = [torch.empty_like(x.contiguous()) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, 1)


def scatter_list(grad, group):
    pieces = [p.contiguous() for p in grad.chunk(dist.get_world_size(group), 1)]
    mine = torch.empty_like(pieces[0])
    dist.reduce_scatter(mine, pieces, group=group)
    return mine


RefCopyMegatron = function("RefCopyMegatron", checks_tp._same, summed_in_place)
RefCopyThroughComm = function("RefCopyThroughComm", lambda x, group: x.clone(), summed_through_comm)
RefReduceInPlace = function("RefReduceInPlace", summed_in_place, checks_tp._same)
RefGatherLists = function("RefGatherLists", gather_list, scatter_list)


# ---- the layers ------------------------------------------------------------------------------------
def shard(weight, group, dim):
    return torch.chunk(weight.detach(), dist.get_world_size(group), dim)[dist.get_rank(group)].clone()


class RefColumn(nn.Module):
    def __init__(self, linear, group):
        super().__init__()
        self.group, self.weight = group, nn.Parameter(shard(linear.weight, group, 0))

    def forward(self, x):
        return F.linear(checks_tp._Copy.apply(x, self.group), self.weight)


class RefRow(nn.Module):
    def __init__(self, linear, group):
        super().__init__()
        self.group, self.weight = group, nn.Parameter(shard(linear.weight, group, 1))

    def forward(self, x):
        return checks_tp._Reduce.apply(x @ self.weight.T, self.group)


class RefSPMLP(nn.Module):
    def __init__(self, up, down, group):
        super().__init__()
        self.group, self.up_weight = group, nn.Parameter(shard(up.weight, group, 0))
        self.down_weight = nn.Parameter(shard(down.weight, group, 1))

    def forward(self, x):
        h = F.gelu(checks_tp._Gather.apply(x, self.group) @ self.up_weight.T)
        return checks_tp._Scatter.apply(h @ self.down_weight.T, self.group)


# ---- vocab-parallel cross-entropy -------------------------------------------------------------------
class RefCEMerged(checks_tp._CE):
    """Sum of exponentials and target logit in one all-reduce: 3 numbers per token in two calls."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        k, low = logits.shape[-1], dist.get_rank(group) * logits.shape[-1]
        m = logits.amax(-1)
        dist.all_reduce(m, op=MAX, group=group)
        e = (logits - m[..., None]).exp()
        owned = (targets >= low) & (targets < low + k)
        idx = (targets - low).clamp(0, k - 1)
        both = torch.stack([e.sum(-1), ((logits.gather(-1, idx[..., None])[..., 0] - m) * owned)])
        dist.all_reduce(both, group=group)
        ctx.save_for_backward(e, both[0], idx, owned)
        ctx.wrong = ""                                      # the base's backward, with no mistake
        return (both[0].log() - both[1]).mean()


def ref_ce_from_pieces(local_logits, targets, group):
    """No Function of its own: autograd through g (identity backward) for the two sums."""
    k, low = local_logits.shape[-1], dist.get_rank(group) * local_logits.shape[-1]
    m = local_logits.detach().amax(-1)
    dist.all_reduce(m, op=MAX, group=group)
    shifted = local_logits - m[..., None]
    sum_exp = checks_tp._Reduce.apply(shifted.exp().sum(-1), group)
    owned = (targets >= low) & (targets < low + k)
    picked = shifted.gather(-1, (targets - low).clamp(0, k - 1)[..., None]).squeeze(-1)
    target = checks_tp._Reduce.apply(picked * owned, group)
    return (sum_exp.log() - target).mean()


OTHERS = {"copy_megatron": (check_copy_to_tp, RefCopyMegatron), "copy_comm": (check_copy_to_tp, RefCopyThroughComm),
          "reduce_in_place": (check_reduce_from_tp, RefReduceInPlace), "column": (check_column_parallel, RefColumn),
          "row": (check_row_parallel, RefRow), "mlp": (check_tp_mlp, RefColumn, RefRow),
          "ce_merged": (check_vocab_parallel_cross_entropy, RefCEMerged.apply),   # apply(local_logits, targets, group)
          "ce_pieces": (check_vocab_parallel_cross_entropy, ref_ce_from_pieces),
          "gather_lists": (check_gather_from_sp, RefGatherLists), "sp_mlp": (check_sp_mlp, RefSPMLP)}

# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"CopyToTP (f)": 4, "ReduceFromTP (g)": 4, "ColumnParallelLinear": 4, "RowParallelLinear": 4,
         "tensor-parallel MLP": 4, "vocab_parallel_cross_entropy": 6, "GatherFromSP (all-gather the sequence)": 4,
         "ReduceScatterToSP (reduce-scatter the sequence)": 4, "SequenceParallelMLP": 4}


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in BASES.values()], ids=list(BASES))
def test_correct_answer_passes(check, answers, every_case, refusing_nothing):
    refusing_nothing(checks_tp)   # the checks' own bases pass (these ranks never refuse)
    check(*answers)
    every_case(CASES)


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in OTHERS.values()], ids=list(OTHERS))
def test_another_correct_answer_passes(check, answers, every_case):
    check(*answers)
    every_case(CASES)


# ---- answers refused, and mistakes that share a misconception's ----------------------------------
# The planted wrong answers are the checks' misconceptions (checks_tp.py), tested in test_misconceptions.py.
def course_ce():
    from picotron.parallel.tensor_parallel import vocab_parallel_cross_entropy
    return vocab_parallel_cross_entropy


CourseCopy = function("CopyToTP", checks_tp._same, checks_tp._all_reduce, PACKAGE)   # named, never imported
CourseGather = function("GatherFromSP", checks_tp._gather_seq, checks_tp._scatter_seq, PACKAGE)
REFUSED = {"course_copy": (check_copy_to_tp, CourseCopy), "base_copy": (check_copy_to_tp, checks_tp._Copy),
           "course_gather": (check_gather_from_sp, CourseGather), "base_sp_mlp": (check_sp_mlp, checks_tp._SPMLP),
           "course_ce": (check_vocab_parallel_cross_entropy, course_ce()),
           "base_ce": (check_vocab_parallel_cross_entropy, checks_tp._ce("")),
           "base_column_in_mlp": (check_tp_mlp, checks_tp._Column, RefRow)}


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in REFUSED.values()], ids=list(REFUSED))
def test_the_course_answer_is_refused(check, answers, capsys):
    with pytest.raises(AssertionError, match="the course's answer"):
        check(*answers)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def test_global_rank_in_the_loss_fails_only_the_groups_of_two(capsys):
    """Rank 2 of the world is rank 0 of its pair: with the global rank, ranks 2-3 own no target."""
    global_rank = next(m for m in checks_tp.CE.misconceptions if m.name == "ce_global_rank")
    with pytest.raises(AssertionError, match=r"dist.get_rank\(group\)"):
        check_vocab_parallel_cross_entropy(global_rank.answer)
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  FAIL ")]
    assert len(failed) == 3 and all(line.startswith("  FAIL tp=2,") for line in failed), failed


class RowWithCopy(RefRow):
    def forward(self, x):
        return checks_tp._Copy.apply(x @ self.weight.T, self.group)   # f instead of g: the all-reduce in backward


def test_f_in_place_of_g_gets_the_hint_of_no_g():
    """Its first difference is RowNoReduce's (no collective in forward, the partial sums returned): its hint too."""
    with pytest.raises(AssertionError, match=r"leave through g .*\(f in its place talks only in backward\)$"):
        check_row_parallel(RowWithCopy)


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


# ---- predict, then run: the harness shows what a g does to the gradients ----------------------------
def test_mlp_with_g_shows_the_gradients_t_times_too_large(capsys):
    right, both = mlp_with_g(checks_tp._Reduce), mlp_with_g(checks_tp.ReduceBackwardToo)   # g, and g both ways
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

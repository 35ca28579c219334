"""The checks of assignment 07 pass correct answers and refuse the course's own.

The correct answer is the checks' own correct code (checks_ep._permute, _AllToAll, _dispatch, _combine,
_capacity_moe), which the misconceptions change and a learner may not submit, judged with the refusal off; other
valid answers are written here. So a check that passes everything, or nothing, is caught. The wrong answers
are the checks' misconceptions, each failing with its hint (tests/test_misconceptions.py).
Nothing here uses picotron.parallel.expert_parallel, except to see that the checks refuse it.
"""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch.autograd import Function

from picotron_course import checks_ep as ep
from picotron_course.checks_ep import (check_all_to_all, check_capacity_moe, check_combine, check_dispatch,
                                       check_expert_parallel_moe, check_permute, dense_moe, recorded_exchanges)
from picotron.launch import run
from picotron.model import route


# ---- correct answers ------------------------------------------------------------------------------
# The checks' own correct code (the bases their misconceptions change, refused as a learner's answer), judged with
# the refusal off; then other valid answers, which the checks must accept too.
BASES = {"permute": (check_permute, ep._permute), "a2a": (check_all_to_all, ep._AllToAll),
         "dispatch": (check_dispatch, ep._dispatch), "combine": (check_combine, ep._combine),
         "layer": (check_expert_parallel_moe, ep._permute, ep._dispatch, ep._combine),
         "capacity": (check_capacity_moe, ep._capacity_moe)}


def ref_permute_unstable(tokens, expert_ids, num_experts):
    """Grouped by expert, but slots of one expert in descending order: any order inside a group is right."""
    k = expert_ids.shape[1]
    slots = torch.arange(expert_ids.numel())
    order = torch.tensor(sorted(slots.tolist(), key=lambda s: (int(expert_ids.reshape(-1)[s]), -s)))
    return tokens[order // k], order, torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


class AllToAllComm(Function):
    """Forward through picotron.comm's wrapper (gloo's list form, dist.all_to_all, wants equal sizes)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        from picotron.comm import all_to_all
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        all_to_all(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    backward = staticmethod(ep._AllToAll.backward)


class AllToAllTorch(Function):
    """torch's own differentiable all-to-all inside."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        with torch.enable_grad():
            y = dist_nn.all_to_all_single(out, x.detach().requires_grad_(), recv_splits, send_splits, group=group)
        ctx.saved = (x, y)
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return y.detach()

    backward = staticmethod(ep._AllToAll.backward)


def ref_dispatch_comm(rows, counts, group):
    received_counts, send, recv = ep._exchange_counts(counts, group)
    return AllToAllComm.apply(rows, send, recv, group), received_counts, (send, recv)


def ref_combine_scatter(expert_out, splits, order, gates, group):
    """Un-permute by scattering into slot order, then weight per token."""
    send, recv = splits
    back = ep._AllToAll.apply(expert_out, recv, send, group)
    slots = torch.empty_like(back)
    slots[order] = back
    return (slots.view(*gates.shape, -1) * gates.unsqueeze(-1)).sum(1)


def ref_capacity_moe_vectorised(x, expert_ids, gates, experts, capacity_factor):
    """The queue positions by a sort instead of a loop; each expert's kept rows in slot-priority order."""
    tokens, top_k = expert_ids.shape
    capacity = ep._capacity_of(tokens, top_k, len(experts), capacity_factor)
    flat = expert_ids.t().reshape(-1)                                    # priority order: choice-major
    order = flat.argsort(stable=True)
    load = torch.bincount(flat, minlength=len(experts))
    start = load.cumsum(0) - load
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel()) - start[flat[order]]
    out = x
    for e, expert in enumerate(experts):
        slot = order[start[e]:start[e] + min(int(load[e]), capacity)]   # slot j T + t: token t's j-th choice
        if len(slot):
            token, choice = slot % tokens, slot // tokens
            out = out.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(x[token]))
    return out, (place < capacity).view(top_k, tokens).t()


def ref_capacity_moe_padded(x, expert_ids, gates, experts, capacity_factor):
    """Each expert on a buffer of exactly C rows, zeros where no slot was kept (GShard's fixed shapes)."""
    tokens, top_k = expert_ids.shape
    capacity = ep._capacity_of(tokens, top_k, len(experts), capacity_factor)
    kept = ep._kept_by_rule(expert_ids, len(experts), capacity)
    out = x
    for e, expert in enumerate(experts):
        token, choice = (kept & (expert_ids == e)).nonzero(as_tuple=True)
        buffer = x.new_zeros(capacity, x.shape[1]).index_copy(0, torch.arange(len(token)), x[token])
        out = out.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(buffer)[:len(token)])
    return out, kept


OTHERS = {"permute_unstable": (check_permute, ref_permute_unstable), "a2a_comm": (check_all_to_all, AllToAllComm),
          "a2a_torch": (check_all_to_all, AllToAllTorch), "dispatch_comm": (check_dispatch, ref_dispatch_comm),
          "combine_scatter": (check_combine, ref_combine_scatter),
          "layer_variants": (check_expert_parallel_moe, ref_permute_unstable, ref_dispatch_comm, ref_combine_scatter),
          "capacity_vectorised": (check_capacity_moe, ref_capacity_moe_vectorised),
          "capacity_padded": (check_capacity_moe, ref_capacity_moe_padded)}

# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"permute": 5, "AllToAll": 4, "dispatch": 8, "combine": 8, "expert-parallel MoE layer": 8, "capacity_moe": 7}


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in BASES.values()], ids=list(BASES))
def test_correct_answer_passes(check, answers, every_case, refusing_nothing):
    refusing_nothing(ep)   # the checks' own bases pass (the ranks never refuse here)
    check(*answers)
    every_case(CASES)


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in OTHERS.values()], ids=list(OTHERS))
def test_another_correct_answer_passes(check, answers, every_case):
    check(*answers)
    every_case(CASES)


# ---- answers refused ------------------------------------------------------------------------------------
# The planted wrong answers are the checks' misconceptions (checks_ep.py), tested in test_misconceptions.py.
def _course(name):
    from picotron.parallel import expert_parallel
    return getattr(expert_parallel, name)


class SubclassOfTheBase(ep._AllToAll):   # the correct base the misconceptions change
    pass


REFUSED = [(check_all_to_all, (_course("TokenAllToAll"),)), (check_all_to_all, (SubclassOfTheBase,)),
           (check_permute, (ep._permute,)), (check_dispatch, (ep._dispatch,)), (check_combine, (ep._combine,)),
           (check_expert_parallel_moe, (ref_permute_unstable, ref_dispatch_comm, ep._combine)),
           (check_capacity_moe, (ep._capacity_moe,)), (check_capacity_moe, (route,))]


@pytest.mark.parametrize("check, answers", REFUSED, ids=[a[-1].__name__ for _, a in REFUSED])
def test_the_course_answer_is_refused(check, answers, capsys):
    with pytest.raises(AssertionError, match="the course's answer"):
        check(*answers)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def test_unsolved_answer_raises_not_implemented():
    def unsolved(*args):
        raise NotImplementedError("dispatch: write this part")
    with pytest.raises(NotImplementedError):
        check_dispatch(unsolved)


# ---- the reference and the recorder -------------------------------------------------------------------
def test_dense_loop_matches_a_vectorised_moe():
    """The dense loop equals the same layer written with one matmul per expert over a one-hot mask."""
    case = ep.ROUTE_CASES[0]
    _, tokens, top_k, kind = case
    xs = [ep._tokens(r, tokens, 0) for r in range(2)]
    ids = [ep._expert_ids(x, 0, case, s, 2) for s, x in enumerate(xs)]
    ups = [torch.randn(tokens, ep.HIDDEN) for _ in xs]
    ys, _, _ = dense_moe(xs, ids, 0, case, ups)
    for s, (x, chosen) in enumerate(zip(xs, ids)):
        x = x.double()
        gates = ep._gates(x, chosen, 0, kind, s, 2)
        weight = torch.zeros(tokens, ep.NUM_EXPERTS, dtype=torch.float64).scatter(1, chosen, gates)  # (T, E)
        outs = torch.stack([ep._expert(x, *(w.double() for w in ep._expert_weights(e, 0)))
                            for e in range(ep.NUM_EXPERTS)], 1)                                     # (T, E, h)
        torch.testing.assert_close(ys[s], (weight.unsqueeze(-1) * outs).sum(1))


def _record_splits():
    rank = dist.get_rank()
    x = torch.ones(3 if rank == 0 else 1, 2)
    send = [1, 2] if rank == 0 else [1, 0]
    recv = [1, 1] if rank == 0 else [2, 0]
    with recorded_exchanges("test") as calls:
        out = x.new_empty(sum(recv), 2)
        dist.all_to_all_single(out, x, recv, send)
        dist.all_reduce(torch.zeros(5))
    try:
        with recorded_exchanges("test"):
            dist.all_to_all_single(x.new_empty(3, 2), x, [1, 2], send)   # rank 1 expects 2 from rank 0, not 1
    except AssertionError as e:
        problem = str(e)
    return [(c.op, c.nbytes, c.send, c.recv) for c in calls], problem


def test_recorder_counts_input_bytes_and_guards_the_splits():
    (calls, problem), (calls_1, problem_1) = run(_record_splits, 2, timeout=60)
    assert calls == [("all_to_all", 24, (1, 2), (1, 1)), ("all_reduce", 20, None, None)]
    assert calls_1[0] == ("all_to_all", 8, (1, 0), (2, 0))
    assert problem == problem_1 and "output_split_sizes" in problem


# ---- the predict-then-run demo --------------------------------------------------------------------------
def test_unpermute_demo_layer_tells_right_from_wrong():
    """The one-layer part of the demo (the training part runs in the solution notebook)."""
    def colleague(outputs, order, gates):
        tokens, k = gates.shape
        return (outputs.view(tokens, k, -1) * gates.unsqueeze(-1)).sum(1)

    right, wrong = ep._demo_layer(ep._unpermute), ep._demo_layer(colleague)
    assert right["right tokens"] == list(range(ep.DEMO_TOKENS)) and right["token 0 reads"] == [0]
    assert right["error"] < 1e-6
    assert len(wrong["right tokens"]) < ep.DEMO_TOKENS // 2 and wrong["token 0 reads"] != [0]
    assert wrong["error"] > 0.1

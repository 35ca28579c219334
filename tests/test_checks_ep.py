"""The checks of assignment 07 pass correct answers and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.parallel.expert_parallel, except to see that the checks refuse it.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch.autograd import Function

from picotron_course.checks_ep import (check_all_to_all, check_capacity_moe, check_combine, check_dispatch,
                                       check_expert_parallel_moe, check_permute, dense_moe, recorded_exchanges)
from picotron.launch import run


# ---- correct answers ------------------------------------------------------------------------------
def ref_permute(tokens, expert_ids, num_experts):
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1)                       # slot t*k + j: token t's j-th choice
    order = flat.argsort(stable=True)
    return tokens[order // k], order, torch.bincount(flat, minlength=num_experts)


def ref_permute_unstable(tokens, expert_ids, num_experts):
    """Grouped by expert, but slots of one expert in descending order: any order inside a group is right."""
    k = expert_ids.shape[1]
    slots = torch.arange(expert_ids.numel())
    order = torch.tensor(sorted(slots.tolist(), key=lambda s: (int(expert_ids.reshape(-1)[s]), -s)))
    return tokens[order // k], order, torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


def _exchange(x, send, recv, group):
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class RefAllToAll(Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _exchange(grad, recv, send, ctx.group), None, None, None


class RefAllToAllComm(RefAllToAll):
    """The same through picotron.comm's wrapper (gloo's list form, dist.all_to_all, wants equal sizes)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        from picotron.comm import all_to_all
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        all_to_all(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out


class RefAllToAllTorch(Function):
    """torch's own differentiable all-to-all inside."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        with torch.enable_grad():
            y = dist_nn.all_to_all_single(out, x.detach().requires_grad_(), recv_splits, send_splits, group=group)
        ctx.saved = (x, y)
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return y.detach()

    backward = RefAllToAll.backward


def ref_dispatch(rows, counts, group, a2a=RefAllToAll):
    ep = dist.get_world_size(group)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)       # (E,): [s*L + j] from rank s for my j
    received_counts = received_counts.view(ep, -1)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = received_counts.sum(1).tolist()
    return a2a.apply(rows, send, recv, group), received_counts, (send, recv)


def ref_dispatch_comm(rows, counts, group):
    return ref_dispatch(rows, counts, group, RefAllToAllComm)


def ref_combine(expert_out, splits, order, gates, group, a2a=RefAllToAll):
    send, recv = splits
    back = a2a.apply(expert_out, recv, send, group)                     # (T k, h) in the experts' order
    k = gates.shape[1]
    weighted = back * gates.reshape(-1)[order].unsqueeze(-1)
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // k, weighted)


def ref_combine_scatter(expert_out, splits, order, gates, group):
    """Un-permute by scattering into slot order, then weight per token."""
    send, recv = splits
    back = RefAllToAll.apply(expert_out, recv, send, group)
    slots = torch.empty_like(back)
    slots[order] = back
    return (slots.view(*gates.shape, -1) * gates.unsqueeze(-1)).sum(1)


CORRECT = [(check_permute, (ref_permute,)), (check_permute, (ref_permute_unstable,)),
           (check_all_to_all, (RefAllToAll,)), (check_all_to_all, (RefAllToAllComm,)),
           (check_all_to_all, (RefAllToAllTorch,)),
           (check_dispatch, (ref_dispatch,)), (check_dispatch, (ref_dispatch_comm,)),
           (check_combine, (ref_combine,)), (check_combine, (ref_combine_scatter,)),
           (check_expert_parallel_moe, (ref_permute, ref_dispatch, ref_combine)),
           (check_expert_parallel_moe, (ref_permute_unstable, ref_dispatch_comm, ref_combine_scatter))]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"permute": 5, "AllToAll": 4, "dispatch": 8, "combine": 8, "expert-parallel MoE layer": 8, "capacity_moe": 7}


@pytest.mark.parametrize("check, answers", CORRECT,
                         ids=["permute", "permute_unstable", "a2a", "a2a_comm", "a2a_torch", "dispatch",
                              "dispatch_comm", "combine", "combine_scatter", "layer", "layer_variants"])
def test_correct_answer_passes(check, answers, every_case):
    check(*answers)
    every_case(CASES)


# ---- planted wrong answers: permute -------------------------------------------------------------------
def permute_token_order(tokens, expert_ids, num_experts):
    rows, order, counts = ref_permute(tokens, expert_ids, num_experts)
    return rows, order // expert_ids.shape[1], counts              # token numbers, not slots


def permute_not_sorted(tokens, expert_ids, num_experts):
    k = expert_ids.shape[1]
    order = torch.arange(expert_ids.numel())                        # slot order, not grouped by expert
    return tokens[order // k], order, torch.bincount(expert_ids.reshape(-1), minlength=num_experts)


def permute_counts_without_minlength(tokens, expert_ids, num_experts):
    rows, order, _ = ref_permute(tokens, expert_ids, num_experts)
    return rows, order, torch.bincount(expert_ids.reshape(-1))      # too short when the last experts get nothing


def permute_rows_by_slot(tokens, expert_ids, num_experts):
    rows, order, counts = ref_permute(tokens, expert_ids, num_experts)
    return tokens[order.clamp(max=tokens.shape[0] - 1)], order, counts   # indexes tokens with slot numbers


def permute_detached(tokens, expert_ids, num_experts):
    rows, order, counts = ref_permute(tokens.detach(), expert_ids, num_experts)
    return rows, order, counts


# ---- the all-to-all ---------------------------------------------------------------------------------
class AllToAllBackwardNotSwapped(RefAllToAll):
    """Splits transposed in backward: the gradient sent with the forward's splits."""

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _exchange(grad, send, recv, ctx.group), None, None, None


class AllToAllSplitsSwapped(RefAllToAll):
    """input and output split sizes swapped in forward (torch's argument order is output first)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), send_splits, recv_splits, group=group)
        return out


class AllToAllIdentityBackward(RefAllToAll):
    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None                               # the gradient stays where it is


class AllToAllWholeWorld(RefAllToAll):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), None   # forgot group= in backward
        return _exchange(x, send_splits, recv_splits, group)


def _course_all_to_all():
    from picotron.parallel.expert_parallel import TokenAllToAll
    return TokenAllToAll


# ---- dispatch -----------------------------------------------------------------------------------------
def dispatch_splits_swapped(rows, counts, group):
    ep = dist.get_world_size(group)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(ep, -1)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = received_counts.sum(1).tolist()
    return RefAllToAll.apply(rows, recv, send, group), received_counts, (send, recv)   # send and recv swapped


def dispatch_no_counts_exchange(rows, counts, group):
    """Assumes every rank sends it as many rows as it sends that rank."""
    ep = dist.get_world_size(group)
    send = counts.view(ep, -1).sum(1).tolist()
    return RefAllToAll.apply(rows, send, send, group), counts.view(ep, -1), (send, send)


def dispatch_even_splits(rows, counts, group):
    """No counts exchange, no splits: every rank sends T k / ep rows to every rank."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows.detach(), group=group)
    even = [rows.shape[0] // ep] * ep
    return received.requires_grad_(), counts.view(ep, -1), (even, even)


def dispatch_padded(rows, counts, group):
    """Pads every rank's block to the most it could be (T k rows), one even all-to-all, unpads after."""
    ep = dist.get_world_size(group)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(ep, -1)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = received_counts.sum(1).tolist()
    cap = rows.shape[0]
    padded = rows.new_zeros(ep * cap, rows.shape[1])
    for j, block in enumerate(rows.split(send)):
        padded[j * cap:j * cap + len(block)] = block
    out = RefAllToAll.apply(padded, [cap] * ep, [cap] * ep, group)
    received = torch.cat([out[s * cap:s * cap + n] for s, n in enumerate(recv)])
    return received, received_counts, (send, recv)


def dispatch_padded_to_max(rows, counts, group):
    """Pads every block to the largest split of the group (found by an all-reduce MAX): even splits."""
    ep = dist.get_world_size(group)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    received_counts = received_counts.view(ep, -1)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = received_counts.sum(1).tolist()
    cap = torch.tensor(max(send))
    dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
    cap = int(cap)
    padded = rows.new_zeros(ep * cap, rows.shape[1])
    for j, block in enumerate(rows.split(send)):
        padded[j * cap:j * cap + len(block)] = block
    out = RefAllToAll.apply(padded, [cap] * ep, [cap] * ep, group)
    return torch.cat([out[s * cap:s * cap + n] for s, n in enumerate(recv)]), received_counts, (send, recv)


def dispatch_all_gather(rows, counts, group):
    """Every rank gathers every rank's rows and counts, and keeps the rows for its own experts."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    all_counts = [torch.empty_like(counts) for _ in range(ep)]
    dist.all_gather(all_counts, counts, group=group)
    all_rows = [torch.empty_like(rows) for _ in range(ep)]         # every rank routes T k rows here
    dist.all_gather(all_rows, rows.detach().contiguous(), group=group)
    received_counts = torch.stack([c.view(ep, -1)[me] for c in all_counts])
    kept = [r.split(c.view(ep, -1).sum(1).tolist())[me] for r, c in zip(all_rows, all_counts)]
    send = counts.view(ep, -1).sum(1).tolist()
    return torch.cat(kept).requires_grad_(), received_counts, (send, received_counts.sum(1).tolist())


def dispatch_own_counts(rows, counts, group):
    received, _, splits = ref_dispatch(rows, counts, group)
    return received, counts.view(dist.get_world_size(group), -1), splits   # this rank's counts, not received ones


def dispatch_not_differentiable(rows, counts, group):
    received, received_counts, splits = ref_dispatch(rows, counts, group)
    return received.detach(), received_counts, splits


def dispatch_whole_world(rows, counts, group):
    return ref_dispatch(rows, counts, None)                         # forgot group=


# ---- combine ------------------------------------------------------------------------------------------
def combine_no_gates(expert_out, splits, order, gates, group):
    send, recv = splits
    back = RefAllToAll.apply(expert_out, recv, send, group)
    k = gates.shape[1]
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // k, back) + 0 * gates.sum()


def combine_not_unpermuted(expert_out, splits, order, gates, group):
    send, recv = splits
    back = RefAllToAll.apply(expert_out, recv, send, group)
    return (back.view(*gates.shape, -1) * gates.unsqueeze(-1)).sum(1)     # rows still in the experts' order


def combine_gates_in_slot_order(expert_out, splits, order, gates, group):
    send, recv = splits
    back = RefAllToAll.apply(expert_out, recv, send, group)
    k = gates.shape[1]
    weighted = back * gates.reshape(-1).unsqueeze(-1)                    # gates not permuted like the rows
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // k, weighted)


def combine_no_all_to_all(expert_out, splits, order, gates, group):
    k = gates.shape[1]
    weighted = expert_out * gates.reshape(-1)[order].unsqueeze(-1)      # expert_out is not this rank's slots
    return expert_out.new_zeros(gates.shape[0], expert_out.shape[1]).index_add(0, order // k, weighted)


def combine_splits_not_reversed(expert_out, splits, order, gates, group):
    send, recv = splits
    back = RefAllToAll.apply(expert_out, send, recv, group)              # the dispatch's splits, not reversed
    k = gates.shape[1]
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // k,
                                                                   back * gates.reshape(-1)[order].unsqueeze(-1))


def combine_plain_all_to_all(expert_out, splits, order, gates, group):
    send, recv = splits
    back = _exchange(expert_out.detach(), recv, send, group)             # invisible to autograd
    k = gates.shape[1]
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // k,
                                                                   back * gates.reshape(-1)[order].unsqueeze(-1))


def combine_detached_gates(expert_out, splits, order, gates, group):
    return ref_combine(expert_out, splits, order, gates.detach(), group)


WRONG_ANSWERS = [
    (check_permute, (permute_token_order,), "looks like token numbers"),
    (check_permute, (permute_not_sorted,), "not grouped by expert"),
    (check_permute, (permute_counts_without_minlength,), "minlength"),
    (check_permute, (permute_rows_by_slot,), r"tokens\[order\[i\] // k\]"),
    (check_permute, (permute_detached,), "does not require grad"),
    (check_all_to_all, (AllToAllBackwardNotSwapped,), "backward.*look swapped"),
    (check_all_to_all, (AllToAllSplitsSwapped,), "forward.*look swapped"),
    (check_all_to_all, (AllToAllIdentityBackward,), "made no collective: send each row's gradient back"),
    (check_all_to_all, (AllToAllWholeWorld,), "over 4 ranks, not the 2 of the group"),
    (check_all_to_all, (_course_all_to_all(),), "the course's answer"),
    (check_dispatch, (dispatch_splits_swapped,), "look swapped"),
    (check_dispatch, (dispatch_no_counts_exchange,), "no exchange of the counts first"),
    (check_dispatch, (dispatch_even_splits,), "no exchange of the counts first"),
    (check_dispatch, (dispatch_padded,), "Padding every split"),
    (check_dispatch, (dispatch_padded_to_max,), "Padding every split"),
    (check_dispatch, (dispatch_all_gather,), "gathers every rank's tokens"),
    (check_dispatch, (dispatch_own_counts,), "that is what this rank sends"),
    (check_dispatch, (dispatch_not_differentiable,), "do not require grad"),
    (check_dispatch, (dispatch_whole_world,), "not the 2 ranks of the group"),
    (check_combine, (combine_no_gates,), "gates are not applied"),
    (check_combine, (combine_not_unpermuted,), "still in the experts' order"),
    (check_combine, (combine_gates_in_slot_order,), "the gates are not"),
    (check_combine, (combine_no_all_to_all,), "no reverse all-to-all"),
    (check_combine, (combine_splits_not_reversed,), "look swapped|reverse of the dispatch"),
    (check_combine, (combine_plain_all_to_all,), "combine's backward .*made no collective"),
    (check_combine, (combine_detached_gates,), "gates got no gradient"),
    (check_expert_parallel_moe, (ref_permute, dispatch_padded, ref_combine), "Padding every split"),
    (check_expert_parallel_moe, (ref_permute, ref_dispatch, combine_not_unpermuted), "y is wrong"),
    (check_expert_parallel_moe, (ref_permute, ref_dispatch, combine_detached_gates), "gates must stay differentiable"),
]


def _wrong_id(check, answers) -> str:
    wrong = next(f for f in answers if not f.__name__.startswith("ref_"))
    return f"{check.__name__.removeprefix('check_')}-{wrong.__name__}"


@pytest.mark.parametrize("check, answers, says", WRONG_ANSWERS, ids=[_wrong_id(c, a) for c, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answers, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(*answers)
    if "course" not in says:  # refused before running: no table
        assert "FAIL" in capsys.readouterr().out


def test_unsolved_answer_raises_not_implemented():
    def unsolved(*args):
        raise NotImplementedError("dispatch: write this part")
    with pytest.raises(NotImplementedError):
        check_dispatch(unsolved)


# ---- the reference and the recorder -------------------------------------------------------------------
def test_dense_loop_matches_a_vectorised_moe():
    """The dense loop equals the same layer written with one matmul per expert over a one-hot mask."""
    from picotron_course import checks_ep as ep
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


# ---- the stretch: capacity_moe, in one process ---------------------------------------------------------
# Written here from the task text (section 8 of the assignment), not copied from the check or the solution.
def _kept(expert_ids, num_experts, capacity, order="choice"):
    """(T, k) bools: each expert keeps its first `capacity` slots, walking the slots in `order`."""
    tokens, top_k = expert_ids.shape
    walk = {"choice": [(t, j) for j in range(top_k) for t in range(tokens)],        # the task's priority
            "token": [(t, j) for t in range(tokens) for j in range(top_k)],
            "last": [(t, j) for j in range(top_k) for t in range(tokens)][::-1]}[order]
    used, kept = [0] * num_experts, torch.zeros(tokens, top_k, dtype=torch.bool)
    for t, j in walk:
        e = int(expert_ids[t, j])
        if used[e] < capacity:
            kept[t, j], used[e] = True, used[e] + 1
    return kept


def _layer(x, expert_ids, gates, experts, kept, residual=True):
    """Each expert once, on its kept rows; the gate-weighted outputs added into their tokens."""
    out = x if residual else torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = (kept & (expert_ids == e)).nonzero(as_tuple=True)
        if len(token):
            out = out.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(x[token]))
    return out


def _capacity(factor, tokens, top_k, experts):
    return math.ceil(factor * tokens * top_k / experts)


def _kept_by_task(expert_ids, experts, capacity_factor):
    tokens, top_k = expert_ids.shape
    return _kept(expert_ids, len(experts), _capacity(capacity_factor, tokens, top_k, len(experts)))


def ref_capacity_moe(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_task(expert_ids, experts, capacity_factor)
    return _layer(x, expert_ids, gates, experts, kept), kept


def ref_capacity_moe_vectorised(x, expert_ids, gates, experts, capacity_factor):
    """The queue positions by a sort instead of a loop; the experts' rows in slot-priority order."""
    tokens, top_k = expert_ids.shape
    capacity = _capacity(capacity_factor, tokens, top_k, len(experts))
    flat = expert_ids.t().reshape(-1)                                    # priority order: choice-major
    order = flat.argsort(stable=True)
    load = torch.bincount(flat, minlength=len(experts))
    place = torch.empty_like(order)
    place[order] = torch.arange(order.numel()) - (load.cumsum(0) - load)[flat[order]]
    kept = (place < capacity).view(top_k, tokens).t()
    return _layer(x, expert_ids, gates, experts, kept), kept


def ref_capacity_moe_padded(x, expert_ids, gates, experts, capacity_factor):
    """Each expert on a buffer of exactly C rows, zeros where no slot was kept (GShard's fixed shapes)."""
    tokens, top_k = expert_ids.shape
    capacity = _capacity(capacity_factor, tokens, top_k, len(experts))
    kept = _kept(expert_ids, len(experts), capacity)
    out = x
    for e, expert in enumerate(experts):
        token, choice = (kept & (expert_ids == e)).nonzero(as_tuple=True)
        buffer = x.new_zeros(capacity, x.shape[1]).index_copy(0, torch.arange(len(token)), x[token])
        out = out.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(buffer)[:len(token)])
    return out, kept


def capacity_floor(x, expert_ids, gates, experts, capacity_factor):
    tokens, top_k = expert_ids.shape
    kept = _kept(expert_ids, len(experts), math.floor(capacity_factor * tokens * top_k / len(experts)))
    return _layer(x, expert_ids, gates, experts, kept), kept


def capacity_counts_tokens(x, expert_ids, gates, experts, capacity_factor):
    tokens, top_k = expert_ids.shape
    kept = _kept(expert_ids, len(experts), _capacity(capacity_factor, tokens, 1, len(experts)))   # k forgotten
    return _layer(x, expert_ids, gates, experts, kept), kept


def capacity_token_priority(x, expert_ids, gates, experts, capacity_factor):
    tokens, top_k = expert_ids.shape
    kept = _kept(expert_ids, len(experts), _capacity(capacity_factor, tokens, top_k, len(experts)), "token")
    return _layer(x, expert_ids, gates, experts, kept), kept


def capacity_keeps_last(x, expert_ids, gates, experts, capacity_factor):
    tokens, top_k = expert_ids.shape
    kept = _kept(expert_ids, len(experts), _capacity(capacity_factor, tokens, top_k, len(experts)), "last")
    return _layer(x, expert_ids, gates, experts, kept), kept


def capacity_no_residual(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_task(expert_ids, experts, capacity_factor)
    return _layer(x, expert_ids, gates, experts, kept, residual=False), kept


def capacity_renormalised(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_task(expert_ids, experts, capacity_factor)
    shares = gates * kept
    shares = shares / shares.sum(-1, keepdim=True).clamp(min=1e-30)      # the kept gates made to sum to 1
    return _layer(x, expert_ids, shares, experts, kept), kept


def capacity_drops_nothing_in_out(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_task(expert_ids, experts, capacity_factor)
    return _layer(x, expert_ids, gates, experts, torch.ones_like(kept)), kept    # kept reported, not applied


def capacity_token_by_token(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_task(expert_ids, experts, capacity_factor)
    rows = []
    for t in range(x.shape[0]):                                          # one expert call per kept slot
        y = x[t]
        for j in range(expert_ids.shape[1]):
            if kept[t, j]:
                y = y + gates[t, j] * experts[int(expert_ids[t, j])](x[t:t + 1])[0]
        rows.append(y)
    return torch.stack(rows), kept


def capacity_detached_gates(x, expert_ids, gates, experts, capacity_factor):
    return ref_capacity_moe(x, expert_ids, gates.detach(), experts, capacity_factor)


def capacity_returns_dropped(x, expert_ids, gates, experts, capacity_factor):
    out, kept = ref_capacity_moe(x, expert_ids, gates, experts, capacity_factor)
    return out, ~kept


def capacity_kept_as_ints(x, expert_ids, gates, experts, capacity_factor):
    out, kept = ref_capacity_moe(x, expert_ids, gates, experts, capacity_factor)
    return out, kept.long()


@pytest.mark.parametrize("answer", [ref_capacity_moe, ref_capacity_moe_vectorised, ref_capacity_moe_padded],
                         ids=["loop", "vectorised", "padded-buffers"])
def test_capacity_correct_answer_passes(answer, capsys):
    check_capacity_moe(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and "7/7 cases passed" in out


CAPACITY_WRONG = [
    (capacity_floor, "rounds up"),
    (capacity_counts_tokens, "C counts tokens, not slots"),
    (capacity_token_priority, "kept in token order"),
    (capacity_keeps_last, "keeps its last C slots"),
    (capacity_no_residual, "the residual is missing"),
    (capacity_renormalised, "renormalised over the kept slots"),
    (capacity_drops_nothing_in_out, "call it on exactly those rows"),
    (capacity_token_by_token, "call each expert once"),
    (capacity_detached_gates, "the gates got no gradient"),
    (capacity_returns_dropped, "True means kept"),
    (capacity_kept_as_ints, "expected torch.bool"),
]


@pytest.mark.parametrize("answer, says", CAPACITY_WRONG, ids=[f.__name__ for f, _ in CAPACITY_WRONG])
def test_capacity_wrong_answer_fails(answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check_capacity_moe(answer)
    assert "FAIL" in capsys.readouterr().out


def test_capacity_refuses_the_course_code():
    from picotron.model import route
    with pytest.raises(AssertionError, match="the course's answer"):
        check_capacity_moe(route)


# ---- the predict-then-run demo --------------------------------------------------------------------------
def test_unpermute_demo_layer_tells_right_from_wrong():
    """The one-layer part of the demo (the training part runs in the solution notebook)."""
    from picotron_course import checks_ep as ep

    def colleague(outputs, order, gates):
        tokens, k = gates.shape
        return (outputs.view(tokens, k, -1) * gates.unsqueeze(-1)).sum(1)

    right, wrong = ep._demo_layer(ep._unpermute), ep._demo_layer(colleague)
    assert right["right tokens"] == list(range(ep.DEMO_TOKENS)) and right["token 0 reads"] == [0]
    assert right["error"] < 1e-6
    assert len(wrong["right tokens"]) < ep.DEMO_TOKENS // 2 and wrong["token 0 reads"] != [0]
    assert wrong["error"] > 0.1

"""The checks of assignment 07: expert parallelism, tokens sent to their experts and back by all-to-all.

A mixture-of-experts layer has E = 8 experts split over the ep ranks of a group: rank r of the group
holds experts [r E/ep, (r+1) E/ep). The checks that communicate run the learner's code on 4 ranks, as
one ep group of 4 and as two ep groups of 2 (ranks 0-1 and 2-3: a rank's place in its group differs
from its global rank), in one launch per check. They compare with single-process math done here, in
the parent: for the whole layer, a plain loop over every token and its top-k experts (the sum of
gate x expert(token)) in float64, and its autograd gradients. Nothing here uses
picotron.parallel.expert_parallel or picotron.model's MoE, the code the assignment rebuilds.

    check_permute(permute)        one process: the (token, choice) slots grouped by expert, their order, the counts
    check_all_to_all(AllToAll)    rows to their ranks with uneven splits; backward the reverse all-to-all
    check_dispatch(dispatch)      an all-to-all of the counts, then of the rows (exactly the rows routed); what
                                  each rank receives, from whom, and the gradient that comes back
    check_combine(combine)        the reverse all-to-all, un-permute, gates: y, and the gradients of the expert
                                  outputs and of the gates
    check_expert_parallel_moe(permute, dispatch, combine)
                                  the whole layer, router and experts included, equals the dense loop: y, x.grad
                                  and every local expert's weight gradients; 3 all-to-alls forward, 2 backward
    check_capacity_moe(capacity_moe)
                                  stretch, one process: each expert keeps at most C = ceil(factor T k / E) slots in
                                  GShard's priority (first choices first, then token order); out = x + the kept
                                  slots' gate-weighted outputs, each expert called once; gradients. The reference
                                  is a plain loop written from the task text, in float64
    unpermute_demo(unpermute)     predict, then run: a given way back from the experts' order to the tokens, in a
                                  layer and in a small causal LM trained beside the right one (not a check)

The routings cover random top-2 and top-1, a skewed one where experts 6 and 7 get no token (so with
ep = 4 rank 3 receives nothing), and one where rank 1 sends no row to one of the ranks.

Inside the ranks, `recorded_exchanges` notes every collective a rank calls (operation, bytes handed in,
split sizes, group size). Before each all-to-all runs, it also compares the split sizes of every rank
of the group (one small all-gather of its own, not recorded): gloo crashes, or mixes rows up, when
they disagree, and the check says instead which rank sends what to whom.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from picotron_course.checks import (Report, close_enough, collectives_observed, max_abs_error, mismatch,
                                    on_ranks, one_thread, payload_of, rank_tensor)
from picotron_course.checks import all_ranks_ok, grad_of, not_the_course_answer, worst_error

__all__ = ["check_permute", "check_all_to_all", "check_dispatch", "check_combine", "check_expert_parallel_moe",
           "check_capacity_moe", "unpermute_demo", "recorded_exchanges", "Exchange", "SplitsDisagree", "dense_moe",
           "WORLD", "EP_SIZES", "NUM_EXPERTS", "HIDDEN"]

WORLD = 4
EP_SIZES = (4, 2)          # one ep group of all 4 ranks; two groups of 2 (ranks 0-1, 2-3)
FP32 = torch.float32
NUM_EXPERTS = 8            # E: 2 per rank with ep = 4, 4 per rank with ep = 2
HIDDEN = 6                 # h: the width of a token
FFN = 8                    # each expert: h -> FFN -> h
# Roundings behind one number checked here (picotron.tolerance): an expert's sums over h and FFN and a token's
# over its top-k slots (k <= 3), forward and backward, and a weight gradient's sum over up to 4 ranks' 8 tokens
# x 3 slots.
ROUNDINGS = 2 * (HIDDEN + FFN + 3) + WORLD * 8 * 3
COURSE = ("picotron.parallel.expert_parallel", "picotron.model")

# (name, tokens per rank, top_k, routing). "skewed": expert 0 favoured, experts 6 and 7 never chosen;
# "gap": rank 1 of the group never chooses the experts of rank (2 mod ep), so it sends it no row.
ROUTE_CASES = [("random", 6, 2, "random"), ("skewed", 6, 2, "skewed"), ("gap", 6, 2, "gap"),
               ("top-1", 5, 1, "random")]
# (name, {ep: rows[i][j] that rank i of the group sends to rank j}, trailing shape of a row)
A2A_CASES = [("uneven, rank 1 sends nothing", {4: [[1, 2, 0, 3], [0, 0, 0, 0], [2, 1, 1, 0], [0, 3, 0, 1]],
                                               2: [[1, 2], [0, 0]]}, (5,)),
             ("rank 1 receives nothing, rows (2, 3)", {4: [[2, 0, 1, 1], [1, 0, 2, 0], [0, 0, 0, 3], [1, 0, 1, 1]],
                                                       2: [[2, 0], [3, 0]]}, (2, 3))]
# (name, tokens, top_k, experts, logit bias {expert: bias}) for permute, in one process
PERMUTE_CASES = [("random top-2", 7, 2, 8, {}), ("top-1", 5, 1, 4, {}),
                 ("expert 2 gets nothing, expert 0 most", 6, 2, 4, {0: 5.0, 2: -30.0}),
                 ("one token", 1, 2, 8, {}), ("top-3", 4, 3, 6, {})]

SPLIT_RULE = ("all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group): "
              "input_split_sizes[j] = rows this rank sends to rank j (they add up to the input's rows), "
              "output_split_sizes[j] = rows it receives from rank j (they add up to the output's rows)")


# ---- recording (and guarding) the collectives a rank makes ------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One collective call: operation ("all_to_all" for either form), elements and bytes handed in, the
    rows sent to / received from each rank (all-to-all only) and the size of its group."""
    op: str
    numel: int
    nbytes: int
    send: tuple | None
    recv: tuple | None
    group_size: int


class SplitsDisagree(AssertionError):
    """The ranks of a group called an all-to-all with split sizes that do not fit together.

    Raised on every rank of the group at once (they all see the same gathered sizes), so the ranks
    stay in step and the check can go on with its next case."""


@contextmanager
def recorded_exchanges(where: str) -> Iterator[list[Exchange]]:
    """Inside the block, every collective this rank calls is appended to the yielded list.

    An all-to-all counts its input; any other operation its largest tensor argument. Before an
    all-to-all runs, the split sizes of every rank of its group are compared; if they disagree, every
    rank raises SplitsDisagree naming `where` and the first mismatch.
    """
    calls: list[Exchange] = []
    gather = c10d.all_gather  # the guard's own all-gather, never recorded

    def record(name: str, arguments: dict) -> None:
        group = arguments.get("group")
        size = dist.get_world_size(group)
        if name in ("all_to_all_single", "all_to_all"):
            call, shapes = _all_to_all_call(name, arguments, size)
            calls.append(call)
            _check_splits(where, shapes, group, gather)   # raises SplitsDisagree before the exchange runs
        else:
            payload = payload_of(name, arguments)
            numel = 0 if payload is None else payload.numel()
            nbytes = 0 if payload is None else numel * payload.element_size()
            calls.append(Exchange(name.strip("_").removesuffix("_base"), numel, nbytes, None, None, size))

    with collectives_observed(record):
        yield calls


def _all_to_all_call(name: str, arguments: dict, size: int) -> tuple[Exchange, dict]:
    """The Exchange of an all-to-all, and the sizes the guard compares across ranks."""
    if name == "all_to_all_single":
        output, input = arguments["output"], arguments["input"]
        rows_in, rows_out = input.shape[0] if input.dim() else 1, output.shape[0] if output.dim() else 1
        send = _splits(arguments.get("input_split_sizes"), rows_in, size)
        recv = _splits(arguments.get("output_split_sizes"), rows_out, size)
        same_rows = tuple(input.shape[1:]) == tuple(output.shape[1:])
        numel, nbytes = input.numel(), input.numel() * input.element_size()
    else:  # all_to_all(output_tensor_list, input_tensor_list): one tensor per rank
        outputs, inputs = list(arguments["output_tensor_list"]), list(arguments["input_tensor_list"])
        send = tuple(t.shape[0] if t.dim() else 1 for t in inputs)
        recv = tuple(t.shape[0] if t.dim() else 1 for t in outputs)
        rows_in, rows_out = sum(send), sum(recv)
        same_rows = len({tuple(t.shape[1:]) for t in inputs + outputs}) <= 1
        numel = sum(t.numel() for t in inputs)
        nbytes = sum(t.numel() * t.element_size() for t in inputs)
    call = Exchange("all_to_all", numel, nbytes, send, recv, size)
    return call, {"rows_in": rows_in, "rows_out": rows_out, "send": send, "recv": recv, "same_rows": same_rows}


def _splits(sizes, rows: int, size: int) -> tuple | None:
    """Split sizes as a tuple of ints; None (even split) as the even split it stands for, or None if
    the rows do not divide."""
    if sizes is None or len(sizes) == 0:
        return tuple([rows // size] * size) if rows % size == 0 else None
    return tuple(int(s) for s in sizes)


def _check_splits(where: str, shapes: dict, group, gather: Callable) -> None:
    """Raise SplitsDisagree on every rank of `group` if the ranks' all-to-all sizes do not fit together."""
    size = dist.get_world_size(group)
    send, recv = shapes["send"], shapes["recv"]
    valid = send is not None and recv is not None and len(send) == size and len(recv) == size
    mine = [shapes["rows_in"], shapes["rows_out"], int(shapes["same_rows"]), int(valid)]
    mine += list(send) + list(recv) if valid else [0] * (2 * size)
    table = [torch.zeros(len(mine), dtype=torch.long) for _ in range(size)]
    gather(table, torch.tensor(mine, dtype=torch.long), group=group)
    problem = _splits_problem([row.tolist() for row in table], size)
    if problem:
        raise SplitsDisagree(f"{where}: the all-to-all's split sizes do not fit: {problem}")


def _splits_problem(table: list[list[int]], size: int) -> str:
    for i, (rows_in, rows_out, same_rows, valid, *sizes) in enumerate(table):
        send, recv = sizes[:size], sizes[size:]
        if not valid:
            return (f"rank {i} of the group passed split sizes that are not one number per rank of the group "
                    f"({size}), or none with rows that do not divide by {size}. {SPLIT_RULE}")
        if not same_rows:
            return f"rank {i} of the group: the input's rows and the output's rows have different shapes"
        looks_swapped = sum(send) == rows_out and sum(recv) == rows_in and rows_in != rows_out
        swapped = (" input_split_sizes and output_split_sizes look swapped: the rows this rank sends come "
                   "from its own counts, the rows it receives from the counts the others sent it."
                   if looks_swapped else "")
        if sum(send) != rows_in:
            return (f"rank {i} of the group hands in {rows_in} rows, but its input_split_sizes {send} add up to "
                    f"{sum(send)}.{swapped} {SPLIT_RULE}")
        if sum(recv) != rows_out:
            return (f"rank {i} of the group has room for {rows_out} rows, but its output_split_sizes {recv} add up "
                    f"to {sum(recv)}.{swapped} {SPLIT_RULE}")
    for i, row in enumerate(table):
        for j in range(size):
            sent, expected = row[4 + j], table[j][4 + size + i]
            if sent != expected:
                return (f"rank {i} of the group sends {sent} rows to rank {j}, but rank {j} expects {expected} from "
                        f"rank {i}. A rank learns what it will receive only from the others: exchange the counts "
                        f"first (an all-to-all of the per-expert counts). {SPLIT_RULE}")
    return ""


def describe(calls: list[Exchange], ep: int | None = None) -> str:
    """'none', or e.g. 'all_to_all 64 B, all_to_all 288 B' in call order (the group size when it is not ep)."""
    if not calls:
        return "none"
    parts = []
    for call in calls:
        text = f"{call.op} {call.nbytes} B"
        if ep is not None and call.group_size != ep and call.op not in ("send", "isend"):
            text += f" over {call.group_size}"
        parts.append(text)
    return ", ".join(parts)


# ---- tools shared by the checks -----------------------------------------------------------------
def _groups() -> list[tuple[int, object, list[int]]]:
    """(ep, group, global ranks of the group) for each group this rank is in: all 4, then its pair."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    rank = dist.get_rank()
    return [(WORLD, dist.group.WORLD, list(range(WORLD))), (2, pairs[rank // 2], [0, 1] if rank < 2 else [2, 3])]


def _members(ep: int, rank: int) -> list[int]:
    """The global ranks of `rank`'s ep group, as `_groups` makes them."""
    return list(range(WORLD)) if ep == WORLD else ([0, 1] if rank < 2 else [2, 3])


def _cases(items: list) -> list[tuple[int, int, object]]:
    """(ep, seed, item) in the order the ranks run them."""
    return [(ep, seed, item) for ep in EP_SIZES for seed, item in enumerate(items)]


def _attempt(result: dict, step: str, fn: Callable, *args):
    """Call the learner's `fn`; an error (other than NotImplementedError) is noted in `result` for the table.

    The splits guard raises on every rank of the group together, and a step without collectives fails
    alone without leaving another rank waiting, so the ranks stay in step."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except SplitsDisagree as e:
        result.setdefault("problem", (step, str(e), True))
    except Exception as e:  # noqa: BLE001 - reported in the table, with the step and the rank
        result.setdefault("problem", (step, f"{type(e).__name__}: {e}", False))
    return None


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """The gradient of a leaf, zeros where nothing reached it (an expert no token chose, a rank that got no row)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


def _problem_of(per_rank: list, backward: bool = False) -> str:
    """The first error a rank noted in forward (or in backward), as a sentence."""
    for rank, result in enumerate(per_rank):
        if "problem" in result:
            step, message, guard = result["problem"]
            if ("backward" in step) == backward:
                return message if guard else f"rank {rank}: {step} raised {message}"
    return ""


def _shape_problem(per_rank: list) -> str:
    for rank, result in enumerate(per_rank):
        if "bad" in result:
            return f"rank {rank}: {result['bad']}"
    return ""


def _max_err(per_rank: list, pairs: list) -> float:
    errors = [worst_error(per_rank, key, wants) for key, wants in pairs]
    return max((e for e in errors if not math.isnan(e)), default=math.nan)


def _value_problem(per_rank: list, key: str, wants: list, what: str, hint: Callable | None = None) -> str:
    """The first rank whose `key` differs from its expected value (float64 math, fp32 tolerance)."""
    for rank, (result, want) in enumerate(zip(per_rank, wants)):
        if key not in result:
            continue
        got = result[key]
        if got is None:
            return f"rank {rank}: {what} is None" + (hint(None, want, rank) if hint else "")
        if not close_enough(got, want.to(got.dtype), FP32, n=ROUNDINGS):
            extra = hint(got, want, rank) if hint else ""
            return f"rank {rank}: {what} is wrong{extra}. {mismatch(got, want.to(got.dtype))}"
    return ""


# ---- the data every rank and the parent make alike ------------------------------------------------
def _tokens(rank: int, tokens: int, seed: int) -> torch.Tensor:
    """This rank's tokens (T, h): they differ per global rank."""
    return rank_tensor(10 + rank, (tokens, HIDDEN), FP32, seed)


def _router(seed: int) -> torch.Tensor:
    """The router's weight (E, h), the same on every rank."""
    return rank_tensor(1, (NUM_EXPERTS, HIDDEN), FP32, seed) * 0.7


def _bias(kind: str, group_rank: int, ep: int) -> torch.Tensor:
    """A per-case shift of the router's logits, (E,), that makes the routing skewed or leaves a gap."""
    bias = torch.zeros(NUM_EXPERTS)
    if kind == "skewed":
        bias[0], bias[6:] = 2.0, -30.0
    elif kind == "gap" and group_rank == 1:
        local, target = NUM_EXPERTS // ep, 2 % ep
        bias[target * local:(target + 1) * local] = -30.0
    return bias


def _case_name(case: tuple, ep: int) -> str:
    name, _, _, kind = case
    if kind == "skewed":
        return "skewed: experts 6, 7 get nothing"
    if kind == "gap":
        return f"rank 1 sends nothing to rank {2 % ep}"
    return name


def _logits(x: torch.Tensor, seed: int, kind: str, group_rank: int, ep: int) -> torch.Tensor:
    return F.linear(x, _router(seed).to(x.dtype)) + _bias(kind, group_rank, ep).to(x.dtype)


def _expert_ids(x: torch.Tensor, seed: int, case: tuple, group_rank: int, ep: int) -> torch.Tensor:
    """Each token's top-k experts (T, k), chosen in fp32 exactly as every rank chooses them."""
    _, _, top_k, kind = case
    with torch.no_grad():
        return _logits(x.float(), seed, kind, group_rank, ep).softmax(-1).topk(top_k, dim=-1).indices


def _gates(x: torch.Tensor, ids: torch.Tensor, seed: int, kind: str, group_rank: int, ep: int) -> torch.Tensor:
    """The gates (T, k): the router's softmax at the chosen experts, renormalised to sum to 1 per token."""
    probs = _logits(x, seed, kind, group_rank, ep).softmax(-1)
    chosen = probs.gather(-1, ids)
    return chosen / chosen.sum(-1, keepdim=True)


def _expert_weights(expert: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's two weights: w_in (FFN, h) and w_out (h, FFN)."""
    return (rank_tensor(100 + expert, (FFN, HIDDEN), FP32, seed) / math.sqrt(HIDDEN),
            rank_tensor(200 + expert, (HIDDEN, FFN), FP32, seed) / math.sqrt(FFN))


def _expert(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """One expert: a small MLP, (..., h) -> (..., h)."""
    return F.linear(F.silu(F.linear(x, w_in)), w_out)


def _upstream(rank: int, shape: tuple, seed: int, which: int = 0) -> torch.Tensor:
    """The gradient a rank backpropagates into an output of that shape."""
    return rank_tensor(300 + 10 * which + rank, shape, FP32, seed)


@dataclass
class _Plan:
    """Where every (token, choice) slot of an ep group goes, with slots sorted by expert, stably.

    Slot t*k + j is token t's j-th choice. Source rank s sends its sorted rows block by block, one
    block per destination rank; destination d receives the blocks of rank 0, 1, ... in turn."""
    ep: int
    top_k: int
    ids: list[torch.Tensor]      # per group rank: (T, k) experts
    orders: list[torch.Tensor]   # per group rank: (T k,) slot of each sorted row
    counts: torch.Tensor         # (ep, E): counts[s, e] = rows of rank s for expert e

    @property
    def local(self) -> int:
        return NUM_EXPERTS // self.ep

    def send(self, s: int) -> list[int]:
        return self.counts[s].view(self.ep, self.local).sum(1).tolist()

    def recv(self, d: int) -> list[int]:
        return self.received_counts(d).sum(1).tolist()

    def received_counts(self, d: int) -> torch.Tensor:
        """(ep, E/ep): [s, j] = rows rank d receives from rank s for its local expert j."""
        return self.counts[:, d * self.local:(d + 1) * self.local].clone()

    def destinations(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each slot of rank s (in slot order): the rank it goes to and its row there."""
        experts = self.ids[s].flatten()[self.orders[s]]               # (T k,) expert of each sorted row
        dest = torch.div(experts, self.local, rounding_mode="floor")
        first = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(self.send(s)).cumsum(0)[:-1]])
        before = torch.tensor([sum(self.send(o)[d] for o in range(s)) for d in range(self.ep)], dtype=torch.long)
        row = before[dest] + torch.arange(len(experts)) - first[dest]  # offset of s's block in d + place in it
        slot_dest, slot_row = torch.empty_like(dest), torch.empty_like(row)
        slot_dest[self.orders[s]], slot_row[self.orders[s]] = dest, row
        return slot_dest, slot_row


def _plan(members: list[int], seed: int, case: tuple) -> _Plan:
    ep, (_, tokens, top_k, _) = len(members), case
    ids = [_expert_ids(_tokens(rank, tokens, seed), seed, case, s, ep) for s, rank in enumerate(members)]
    orders = [i.flatten().argsort(stable=True) for i in ids]
    counts = torch.stack([torch.bincount(i.flatten(), minlength=NUM_EXPERTS) for i in ids])
    return _Plan(ep, top_k, ids, orders, counts)


def _sorted_rows(plan: _Plan, s: int, x: torch.Tensor) -> torch.Tensor:
    """Rank s's rows grouped by expert: token order[i] // k for sorted row i."""
    return x[torch.div(plan.orders[s], plan.top_k, rounding_mode="floor")]


# ---- 1. permute -----------------------------------------------------------------------------------
def _permute_inputs(case: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    _, tokens, top_k, experts, bias = case
    x = rank_tensor(50, (tokens, HIDDEN), FP32, seed)
    scores = rank_tensor(60, (tokens, experts), FP32, seed)
    for expert, shift in bias.items():
        scores[:, expert] += shift
    return x, scores.topk(top_k, dim=-1).indices


def check_permute(permute: Callable) -> None:
    """rows, order, counts = permute(tokens, expert_ids, num_experts): the T k (token, choice) slots grouped by
    expert (expert 0's first), row i being slot order[i] (token order[i] // k), and the rows per expert."""
    not_the_course_answer("check_permute", permute, course=COURSE)
    note = ("one process; tokens (T, h) with requires_grad, expert_ids (T, k). Expected: rows (T k, h) grouped by "
            "expert, rows[i] = tokens[order[i] // k], order a permutation of the slots 0..T k - 1 (slot t k + j = "
            "token t's j-th choice), counts (E,) = rows per expert; rows differentiable")
    with Report("permute", note=note) as report:
        for seed, case in enumerate(PERMUTE_CASES):
            name, tokens, top_k, experts, _ = case
            x, ids = _permute_inputs(case, seed)
            want_counts = torch.bincount(ids.flatten(), minlength=experts)
            x = x.clone().requires_grad_()
            got = permute(x, ids.clone(), experts)
            detail, got_counts = _permute_problem(got, x, ids, want_counts)
            report.add(not detail, detail, case=name, T=tokens, k=top_k, E=experts,
                       **{"counts (want)": want_counts.tolist(), "counts (got)": got_counts})


def _permute_problem(got, x: torch.Tensor, ids: torch.Tensor, want_counts: torch.Tensor) -> tuple[str, object]:
    tokens, top_k = ids.shape
    slots = tokens * top_k
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return f"permute returned {type(got).__name__}; return the three tensors (rows, order, counts)", "-"
    rows, order, counts = got
    if not all(isinstance(t, torch.Tensor) for t in got):
        return "rows, order and counts must all be tensors", "-"
    shown = counts.tolist() if counts.dim() == 1 else tuple(counts.shape)
    if tuple(rows.shape) != (slots, HIDDEN):
        return (f"rows has shape {tuple(rows.shape)}, expected {(slots, HIDDEN)}: one row per (token, choice) slot, "
                f"{tokens} tokens x k = {top_k}"), shown
    if order.dtype != torch.long or tuple(order.shape) != (slots,):
        return f"order is {order.dtype} of shape {tuple(order.shape)}, expected torch.int64 of shape {(slots,)}", shown
    if sorted(order.tolist()) != list(range(slots)):
        tokens_only = order.max().item() < tokens if slots > tokens else False
        hint = (": it looks like token numbers; give slot numbers t*k + j, so that combine finds each slot's gate"
                if tokens_only else "")
        return f"order is not a permutation of the slots 0..{slots - 1}{hint} (got {order.tolist()})", shown
    if counts.shape != want_counts.shape or not torch.equal(counts.long(), want_counts):
        return (f"counts {shown} differ from the rows each expert gets, {want_counts.tolist()}: "
                "torch.bincount(expert_ids.flatten(), minlength=num_experts)"), shown
    experts = ids.flatten()[order]
    if (experts[1:] < experts[:-1]).any():
        return (f"the rows are not grouped by expert: the experts of rows 0, 1, ... are {experts.tolist()}; sort the "
                "slots by expert (expert_ids.flatten().argsort(stable=True))"), shown
    want_rows = x.detach()[torch.div(order, top_k, rounding_mode="floor")]
    if not torch.equal(rows.detach(), want_rows):
        token_rows = x.detach()[order.clamp(max=tokens - 1)]
        hint = (": rows[i] must be tokens[order[i] // k] (order holds slots; a slot's token is slot // k)"
                if torch.equal(rows.detach(), token_rows) else "")
        return f"rows[i] is not tokens[order[i] // k]{hint}. {mismatch(rows.detach(), want_rows)}", shown
    if not rows.requires_grad:
        return ("rows does not require grad: index the tokens (tokens[index]) so that gradients flow back to them; "
                "no .detach(), no torch.no_grad()"), shown
    upstream = rank_tensor(70, rows.shape, FP32, 0)
    (rows * upstream).sum().backward()
    want_grad = torch.zeros_like(x).index_add(0, torch.div(order, top_k, rounding_mode="floor"), upstream)
    if x.grad is None or not close_enough(x.grad, want_grad, FP32, n=ROUNDINGS):
        return "the gradient of the tokens is wrong: each slot's gradient must add into its token's", shown
    return "", shown


# ---- 2. the differentiable all-to-all -------------------------------------------------------------
def _a2a_rows(rank: int, rows: int, trailing: tuple, seed: int) -> torch.Tensor:
    return rank_tensor(400 + rank, (rows, *trailing), FP32, seed)


def check_all_to_all(AllToAll: type) -> None:
    """y = AllToAll.apply(x, send_splits, recv_splits, group): rank i's rows [sum send[:j], sum send[:j+1])
    go to rank j, which puts what it receives from ranks 0, 1, ... in turn; one all-to-all each way,
    backward the reverse one (each row's gradient goes back to the rank the row came from)."""
    not_the_course_answer("check_all_to_all", AllToAll, course=COURSE)
    note = ("4 ranks as ep=4 and as 2 groups of ep=2; rank i sends M[i][j] rows to rank j (some send or receive "
            "nothing), backpropagates its own gradient of y. Compared with the rows and gradients cut and pasted "
            "in one process. Forward: one all-to-all of the rows sent; backward: one of the rows received")
    with Report("AllToAll", note=note) as report:
        results = on_ranks(_a2a_on_rank, WORLD, AllToAll)
        for c, (ep, seed, (name, matrices, trailing)) in enumerate(_cases(A2A_CASES)):
            per_rank = [r[c] for r in results]
            m = matrices[ep]
            ys, x_grads, forward_bytes, backward_bytes = [], [], [], []
            row = math.prod(trailing) * 4
            for rank in range(WORLD):
                members = _members(ep, rank)
                i = members.index(rank)
                xs = [_a2a_rows(g, sum(m[s]), trailing, seed) for s, g in enumerate(members)]
                ups = [_upstream(g, (sum(m[s][d] for s in range(ep)), *trailing), seed) for d, g in enumerate(members)]
                ys.append(torch.cat([xs[s].split(m[s])[i] for s in range(ep)]).double())
                x_grads.append(torch.cat([ups[d].split([m[s][d] for s in range(ep)])[i] for d in range(ep)]).double())
                forward_bytes.append(sum(m[i]) * row)
                backward_bytes.append(sum(m[s][i] for s in range(ep)) * row)
            index = [_members(ep, rank).index(rank) for rank in range(WORLD)]
            send = [list(m[i]) for i in index]                          # per global rank, as in its group
            recv = [[m[s][i] for s in range(ep)] for i in index]
            detail = (_one_all_to_all(per_rank, "forward", ep, forward_bytes, send, recv, "AllToAll's forward",
                                      "send each block of rows to its rank with all_to_all_single")
                      or _problem_of(per_rank)
                      or _shape_problem(per_rank)
                      or _value_problem(per_rank, "y", ys, "y (the rows received)", _a2a_hint)
                      or _one_all_to_all(per_rank, "backward", ep, backward_bytes, recv, send, "AllToAll's backward",
                                         "send each row's gradient back to the rank the row came from: the reverse "
                                         "all-to-all, with the send and receive splits swapped")
                      or _problem_of(per_rank, backward=True)
                      or _value_problem(per_rank, "x_grad", x_grads, "x.grad", _a2a_grad_hint))
            report.add(not detail, detail, ep=ep, case=name, row=trailing,
                       **{"forward (want)": f"all_to_all {forward_bytes[0]} B",
                          "forward (got)": describe(per_rank[0].get("forward", []), ep),
                          "backward (want)": f"all_to_all {backward_bytes[0]} B",
                          "backward (got)": describe(per_rank[0].get("backward", []), ep)},
                       max_err=_max_err(per_rank, [("y", ys), ("x_grad", x_grads)]))


def _a2a_hint(got, want, rank) -> str:
    return (": rank j puts what it receives from ranks 0, 1, ... in turn, and rank i's rows for rank j are "
            "its consecutive block j (blocks of send_splits[0], send_splits[1], ... rows)")


def _a2a_grad_hint(got, want, rank) -> str:
    if got is None:
        return (": backward must return the gradient of x first (then None for the splits and the group); "
                "if y had no grad_fn, forward must be AllToAll's, called through AllToAll.apply")
    return ": row r of x.grad is the gradient of the row that x's row r became on the rank it was sent to"


def _one_all_to_all(per_rank: list, key: str, ep: int, nbytes: list, send: list, recv: list, where: str,
                    why: str) -> str:
    """Exactly one all-to-all over the group, of the expected bytes and split sizes (per global rank), nothing else."""
    for rank, result in enumerate(per_rank):
        calls = result.get(key)
        if calls is None:
            continue
        at = f"{where} (rank {rank})"
        if not calls:
            return f"{at} made no collective: {why}"
        others = sorted({c.op for c in calls} - {"all_to_all"})
        if others:
            return f"{at} called {', '.join(others)} ({describe(calls, ep)}); one all-to-all is all it needs: {why}"
        if len(calls) > 1:
            return f"{at} made {len(calls)} all-to-alls ({describe(calls, ep)}); expected one"
        call = calls[0]
        if call.group_size != ep:
            return (f"{at} ran over {call.group_size} ranks, not the {ep} of the group: pass group=group to "
                    "the collective")
        if call.send is not None and (list(call.send) != send[rank] or list(call.recv) != recv[rank]):
            swapped = (" (the two look swapped)" if list(call.send) == recv[rank] and list(call.recv) == send[rank]
                       else "")
            return (f"{at} sent {list(call.send)} rows and received {list(call.recv)}; expected to send {send[rank]} "
                    f"and receive {recv[rank]}{swapped}: {why}")
        if call.nbytes != nbytes[rank]:
            return f"{at} handed {call.nbytes} B to the all-to-all; expected {nbytes[rank]} B"
    return ""


def _a2a_on_rank(AllToAll: type) -> list:
    rank, out = dist.get_rank(), []
    for ep, group, members in _groups():
        i = dist.get_rank(group)
        for seed, (_, matrices, trailing) in enumerate(A2A_CASES):
            m = matrices[ep]
            send, recv = list(m[i]), [m[s][i] for s in range(ep)]
            x = _a2a_rows(rank, sum(send), trailing, seed).requires_grad_()
            result: dict = {}
            out.append(result)
            with recorded_exchanges("AllToAll's forward") as forward:
                y = _attempt(result, "AllToAll's forward", AllToAll.apply, x, send, recv, group)
            result["forward"] = forward
            want = (sum(recv), *trailing)
            if "problem" not in result:
                if not isinstance(y, torch.Tensor):
                    result["bad"] = f"AllToAll.apply returned {type(y).__name__}, expected a tensor"
                elif tuple(y.shape) != want:
                    result["bad"] = (f"y has shape {tuple(y.shape)}, expected {want}: the rows this rank receives, "
                                     f"{recv} from ranks 0..{ep - 1}")
                elif not y.requires_grad:
                    result["bad"] = ("y does not require grad: forward must return a tensor that autograd connects to "
                                     "x (call it as AllToAll.apply(x, ...), and return a new tensor from forward)")
                else:
                    result["y"] = y.detach().clone()
            if not all_ranks_ok("y" in result, group):
                continue
            upstream = _upstream(rank, want, seed)
            with recorded_exchanges("AllToAll's backward") as backward:
                _attempt(result, "AllToAll's backward", lambda: (y * upstream).sum().backward())
            result.update(backward=backward, x_grad=grad_of(x))
            all_ranks_ok(True, group)
    return out


# ---- 3. dispatch ----------------------------------------------------------------------------------
def check_dispatch(dispatch: Callable) -> None:
    """received, received_counts, (send, recv) = dispatch(rows, counts, group): an all-to-all of the E counts,
    then one of exactly the rows routed; rank d gets, from ranks 0, 1, ... in turn, their rows for its experts."""
    not_the_course_answer("check_dispatch", dispatch, course=COURSE)
    note = ("4 ranks as ep=4 and as 2 groups of ep=2; E = 8 experts, rank r of a group holds [r E/ep, (r+1) E/ep). "
            "Each rank's T k rows come sorted by expert with their counts (E,); it backpropagates its own gradient "
            "of the rows received. Compared with the rows cut and pasted in one process")
    with Report("dispatch", note=note) as report:
        results = on_ranks(_dispatch_on_rank, WORLD, dispatch)
        for c, (ep, seed, case) in enumerate(_cases(ROUTE_CASES)):
            per_rank = [r[c] for r in results]
            want = _dispatch_expected(ep, seed, case)
            detail = (_dispatch_comm_problem(per_rank, ep, want)
                      or _problem_of(per_rank)
                      or _shape_problem(per_rank)
                      or _counts_problem(per_rank, want)
                      or _splits_value_problem(per_rank, want)
                      or _value_problem(per_rank, "received", want["received"], "the received rows",
                                        lambda *_: (": rank d gets the rows of rank 0 for its experts, then rank 1's, "
                                                    "..., each block in the order its sender sorted them"))
                      or _one_all_to_all(per_rank, "backward", ep, want["backward_bytes"], want["recv"], want["send"],
                                         "dispatch's backward", "the gradient of each received row must go back to "
                                         "the rank it came from: send the rows with AllToAll.apply, whose backward "
                                         "does that (a plain dist.all_to_all_single is invisible to autograd)")
                      or _problem_of(per_rank, backward=True)
                      or _value_problem(per_rank, "rows_grad", want["rows_grad"], "rows.grad", _rows_grad_hint))
            report.add(not detail, detail, ep=ep, case=_case_name(case, ep),
                       **{"sent by rank 0": want["send"][0], "received (want)": want["recv"][0],
                          "received (got)": per_rank[0].get("splits", ("-", "-"))[1],
                          "forward (want)": (f"all_to_all {want['counts_bytes']} B, "
                                             f"all_to_all {want['rows_bytes'][0]} B"),
                          "forward (got)": describe(per_rank[0].get("forward", []), ep),
                          "backward (got)": describe(per_rank[0].get("backward", []), ep)},
                       max_err=_max_err(per_rank, [("received", want["received"]), ("rows_grad", want["rows_grad"])]))


def _dispatch_expected(ep: int, seed: int, case: tuple) -> dict:
    """Per global rank: what dispatch must receive, return, send and hand back, from the plan of its group."""
    _, tokens, top_k, _ = case
    want = {key: [] for key in ("received", "received_counts", "send", "recv", "rows_grad", "rows_bytes",
                                "backward_bytes", "own_counts")}
    row = HIDDEN * 4
    plans = {}
    for rank in range(WORLD):
        members = _members(ep, rank)
        key = tuple(members)
        if key not in plans:
            plans[key] = _plan(members, seed, case)
        plan, i = plans[key], members.index(rank)
        rows = [_sorted_rows(plan, s, _tokens(g, tokens, seed)) for s, g in enumerate(members)]
        received = torch.cat([rows[s].split(plan.send(s))[i] for s in range(ep)])
        ups = [_upstream(g, (sum(plan.recv(d)), HIDDEN), seed) for d, g in enumerate(members)]
        dest, where = plan.destinations(i)
        order = plan.orders[i]
        grad = torch.stack([ups[dest[slot]][where[slot]] for slot in order.tolist()])   # (T k, h), sorted rows
        want["received"].append(received.double())
        want["received_counts"].append(plan.received_counts(i))
        want["own_counts"].append(plan.counts[i].view(ep, -1))
        want["send"].append(plan.send(i))
        want["recv"].append(plan.recv(i))
        want["rows_grad"].append(grad.double())
        want["rows_bytes"].append(rows[i].shape[0] * row)
        want["backward_bytes"].append(received.shape[0] * row)
    want["counts_bytes"] = NUM_EXPERTS * 8
    return want


def _dispatch_comm_problem(per_rank: list, ep: int, want: dict) -> str:
    """Forward: an all-to-all of the E counts, then one of exactly this rank's rows; nothing else."""
    for rank, result in enumerate(per_rank):
        calls = result.get("forward")
        if calls is None:
            continue
        problem = _dispatch_calls_problem(calls, ep, want["rows_bytes"][rank], want["send"][rank], want["recv"][rank])
        if problem:
            return f"dispatch (rank {rank}) made {describe(calls, ep)}: {problem}"
    return ""


def _dispatch_calls_problem(calls: list[Exchange], ep: int, rows_bytes: int, send: list, recv: list) -> str:
    others = [c for c in calls if c.op != "all_to_all"]
    exchanges = [c for c in calls if c.op == "all_to_all"]
    if any(c.nbytes >= rows_bytes > 0 and ("gather" in c.op or c.op == "broadcast") for c in others):
        return ("it gathers every rank's tokens: each rank would receive all ep x T k rows and keep the few for its "
                "experts. An all-to-all sends each row only to the rank that needs it")
    padded = [c for c in exchanges if c.numel != NUM_EXPERTS and c.nbytes > rows_bytes]
    if padded:
        return (f"the rows' all-to-all handed in {padded[0].nbytes} B, but this rank's {rows_bytes // (HIDDEN * 4)} "
                f"rows are {rows_bytes} B: send exactly the rows routed, with uneven splits. Padding every split to "
                "the same size (as a fixed capacity does) sends padding through the network")
    if others:
        return ("dispatch needs two all-to-alls and nothing else: first the counts (each rank learns how many rows "
                "it will receive from every rank), then the rows")
    if any(c.group_size != ep for c in exchanges):
        return f"an all-to-all ran over the whole world, not the {ep} ranks of the group: pass group=group"
    if len(exchanges) == 1 and exchanges[0].numel == NUM_EXPERTS:
        return "it exchanged the counts but never sent the rows"
    if len(exchanges) == 1 or (exchanges and exchanges[0].numel != NUM_EXPERTS):
        return ("no exchange of the counts first. A rank cannot know how many rows the others will send it: start "
                f"with an all-to-all of the E = {NUM_EXPERTS} per-expert counts (rank j gets the counts of its own "
                "experts from every rank), then size the rows' all-to-all with them")
    if len(exchanges) != 2:
        return "expected exactly two all-to-alls: the counts, then the rows"
    rows = exchanges[1]
    if rows.nbytes < rows_bytes:
        return f"the rows' all-to-all handed in {rows.nbytes} B, fewer than this rank's {rows_bytes} B of rows"
    if rows.send is not None and (list(rows.send) != send or list(rows.recv) != recv):
        swapped = (": input and output split sizes look swapped" if (list(rows.send), list(rows.recv)) == (recv, send)
                   else "")
        return (f"the rows' all-to-all sent {list(rows.send)} rows to the ranks and received {list(rows.recv)}; "
                f"expected to send {send} (this rank's counts, summed per rank) and receive {recv} (from the counts "
                f"the others sent){swapped}. {SPLIT_RULE}")
    return ""


def _unpack_dispatch(got, ep: int, sent_counts: torch.Tensor) -> tuple[tuple | None, str]:
    """(received, received_counts, (send, recv)) from what dispatch returned, or a sentence saying what is wrong.

    sent_counts: the (E,) counts this rank passed in, to recognise them when returned as received_counts."""
    local = NUM_EXPERTS // ep
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return None, f"dispatch returned {type(got).__name__}; return (received, received_counts, (send, recv))"
    received, counts, splits = got
    if not isinstance(received, torch.Tensor) or received.dim() != 2 or received.shape[1] != HIDDEN:
        shape = tuple(received.shape) if isinstance(received, torch.Tensor) else type(received).__name__
        return None, f"received is {shape}, expected a tensor (rows received, {HIDDEN})"
    if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (ep, local):
        shape = tuple(counts.shape) if isinstance(counts, torch.Tensor) else type(counts).__name__
        return None, (f"received_counts is {shape}, expected a tensor (ep, E/ep) = {(ep, local)}: [s, j] = rows "
                      "received from rank s for this rank's local expert j")
    try:
        send, recv = ([int(v) for v in split] for split in splits)
    except (TypeError, ValueError):
        return None, "the splits must be a pair (send, recv) of lists of ints, one per rank of the group"
    if len(send) != ep or len(recv) != ep:
        return None, f"the splits must hold one number per rank of the group ({ep}); got {send}, {recv}"
    if int(counts.sum()) != received.shape[0] or sum(recv) != received.shape[0]:
        own = torch.equal(counts, sent_counts.view(ep, local))
        own = (" received_counts is this rank's own counts: that is what this rank sends; after the all-to-all of "
               "the counts, row s holds what rank s sends to this rank" if own else "")
        return None, (f"received has {received.shape[0]} rows, but received_counts add up to {int(counts.sum())} "
                      f"and recv to {sum(recv)}.{own}")
    if not received.requires_grad:
        return None, ("the received rows do not require grad: send them with AllToAll.apply, whose backward brings "
                      "the gradients back (dist.all_to_all_single alone is invisible to autograd)")
    return (received, counts.long(), (send, recv)), ""


def _counts_problem(per_rank: list, want: dict) -> str:
    for rank, result in enumerate(per_rank):
        got = result.get("received_counts")
        if got is None:
            continue
        expected = want["received_counts"][rank]
        if not torch.equal(got.long(), expected):
            own = torch.equal(got.long(), want["own_counts"][rank])
            hint = (": that is what this rank sends (its own counts, viewed (ep, E/ep)); after the all-to-all of the "
                    "counts, row s holds what rank s sends to this rank" if own else
                    ": row s must hold rank s's counts for this rank's experts, as the counts' all-to-all "
                    "delivers them")
            return f"rank {rank}: received_counts is {got.tolist()}, expected {expected.tolist()}{hint}"
    return ""


def _splits_value_problem(per_rank: list, want: dict) -> str:
    for rank, result in enumerate(per_rank):
        if "splits" not in result:
            continue
        send, recv = result["splits"]
        if send != want["send"][rank] or recv != want["recv"][rank]:
            swapped = (" (swapped: return (send, recv))" if (recv, send) == (want["send"][rank], want["recv"][rank])
                       else "")
            return (f"rank {rank}: the splits are {send}, {recv}; expected (send, recv) = {want['send'][rank]}, "
                    f"{want['recv'][rank]}{swapped}: rows sent to and received from each rank")
    return ""


def _rows_grad_hint(got, want, rank) -> str:
    if got is None:
        return ": the gradient did not reach the rows; send them with AllToAll.apply"
    return ": each row's gradient must come back from the rank it was sent to (AllToAll's backward)"


def _dispatch_on_rank(dispatch: Callable) -> list:
    rank, out = dist.get_rank(), []
    for ep, group, members in _groups():
        i = dist.get_rank(group)
        for seed, case in enumerate(ROUTE_CASES):
            plan = _plan(members, seed, case)
            rows = _sorted_rows(plan, i, _tokens(rank, case[1], seed)).clone().requires_grad_()  # (T k, h) by expert
            result: dict = {}
            out.append(result)
            with recorded_exchanges("dispatch") as forward:
                got = _attempt(result, "dispatch", dispatch, rows, plan.counts[i].clone(), group)
            result["forward"] = forward
            if "problem" not in result:
                unpacked, bad = _unpack_dispatch(got, ep, plan.counts[i])
                if bad:
                    result["bad"] = bad
                else:
                    received, counts, splits = unpacked
                    result.update(received=received.detach().clone(), received_counts=counts.detach().clone(),
                                  splits=splits)
            if not all_ranks_ok("received" in result, group):
                continue
            upstream = _upstream(rank, tuple(received.shape), seed)
            with recorded_exchanges("dispatch's backward") as backward:
                _attempt(result, "dispatch's backward", lambda: (received * upstream).sum().backward())
            result.update(backward=backward, rows_grad=grad_of(rows))
            all_ranks_ok(True, group)
    return out


# ---- 4. combine -----------------------------------------------------------------------------------
def _expert_out(rank: int, rows: int, seed: int) -> torch.Tensor:
    """Stand-in outputs of this rank's experts for the rows it received, (R, h)."""
    return rank_tensor(500 + rank, (rows, HIDDEN), FP32, seed)


def _random_gates(rank: int, tokens: int, top_k: int, seed: int) -> torch.Tensor:
    return rank_tensor(600 + rank, (tokens, top_k), FP32, seed).softmax(-1)


def check_combine(combine: Callable) -> None:
    """y = combine(expert_out, (send, recv), order, gates, group): the reverse all-to-all brings every slot's
    expert output home; y[t] = sum_j gates[t, j] x (output of slot t k + j); gradients flow to expert_out
    (back through the all-to-all) and to the gates."""
    not_the_course_answer("check_combine", combine, course=COURSE)
    note = ("4 ranks as ep=4 and as 2 groups of ep=2; expert_out (R, h) on each rank stands for its experts' outputs "
            "of the rows it received; the splits and order are those of the dispatch. Compared with the sum over "
            "every token's k slots in one process (float64). Forward: one all-to-all of the R rows; backward: one "
            "of the T k rows")
    with Report("combine", note=note) as report:
        results = on_ranks(_combine_on_rank, WORLD, combine)
        for c, (ep, seed, case) in enumerate(_cases(ROUTE_CASES)):
            per_rank = [r[c] for r in results]
            want = _combine_expected(ep, seed, case)
            detail = (_combine_comm_problem(per_rank, ep, want)
                      or _problem_of(per_rank)
                      or _shape_problem(per_rank)
                      or _value_problem(per_rank, "y", want["y"], "y", _y_hint(want))
                      or _one_all_to_all(per_rank, "backward", ep, want["backward_bytes"], want["recv"], want["send"],
                                         "combine's backward", "the gradient of each slot's output must go back to "
                                         "the rank whose expert made it: bring the outputs home with AllToAll.apply, "
                                         "whose backward does that (a plain dist.all_to_all_single is invisible to "
                                         "autograd)")
                      or _problem_of(per_rank, backward=True)
                      or _value_problem(per_rank, "out_grad", want["out_grad"], "expert_out.grad", _out_grad_hint)
                      or _value_problem(per_rank, "gates_grad", want["gates_grad"], "gates.grad", _gates_grad_hint))
            report.add(not detail, detail, ep=ep, case=_case_name(case, ep),
                       **{"forward (want)": f"all_to_all {want['forward_bytes'][0]} B",
                          "forward (got)": describe(per_rank[0].get("forward", []), ep),
                          "backward (want)": f"all_to_all {want['backward_bytes'][0]} B",
                          "backward (got)": describe(per_rank[0].get("backward", []), ep)},
                       max_err=_max_err(per_rank, [("y", want["y"]), ("out_grad", want["out_grad"]),
                                                   ("gates_grad", want["gates_grad"])]))


def _combine_expected(ep: int, seed: int, case: tuple) -> dict:
    """y and its gradients per global rank, from a loop over every token's k slots in float64.

    Also the outputs of three classic mistakes, for the hints: gates left out, rows left in the
    experts' order (not un-permuted), and gates taken in slot order for rows in the experts' order."""
    _, tokens, top_k, _ = case
    want = {key: [] for key in ("y", "out_grad", "gates_grad", "send", "recv", "forward_bytes", "backward_bytes",
                                "no_gates", "not_unpermuted", "gates_unpermuted")}
    for members in ([list(range(WORLD))] if ep == WORLD else [[0, 1], [2, 3]]):
        plan = _plan(members, seed, case)
        outs = [_expert_out(g, sum(plan.recv(d)), seed).double().requires_grad_() for d, g in enumerate(members)]
        gates = [_random_gates(g, tokens, top_k, seed).double().requires_grad_() for g in members]
        ys = []
        for s, g in enumerate(members):
            dest, where = plan.destinations(s)
            slot_out = torch.stack([outs[dest[slot]][where[slot]] for slot in range(tokens * top_k)])  # (T k, h)
            y = torch.stack([sum(gates[s][t, j] * slot_out[t * top_k + j] for j in range(top_k))
                             for t in range(tokens)])                                                    # (T, h)
            ys.append(y)
            sorted_out = slot_out.detach()[plan.orders[s]]          # (T k, h): in the experts' order
            flat_gates = gates[s].detach().flatten()
            token_of = torch.div(plan.orders[s], top_k, rounding_mode="floor")
            want["no_gates"].append(slot_out.detach().view(tokens, top_k, HIDDEN).sum(1))
            want["not_unpermuted"].append((sorted_out.view(tokens, top_k, HIDDEN)
                                           * gates[s].detach()[..., None]).sum(1))
            want["gates_unpermuted"].append(torch.zeros(tokens, HIDDEN, dtype=torch.float64)
                                            .index_add(0, token_of, sorted_out * flat_gates[:, None]))
        sum((y * _upstream(g, tuple(y.shape), seed).double()).sum() for y, g in zip(ys, members)).backward()
        for s, g in enumerate(members):
            want["y"].append(ys[s].detach())
            want["out_grad"].append(_grad_or_zeros(outs[s]))    # a rank that received nothing: (0, h)
            want["gates_grad"].append(_grad_or_zeros(gates[s]))
            want["send"].append(plan.recv(s))       # combine sends back what dispatch received
            want["recv"].append(plan.send(s))
            want["forward_bytes"].append(sum(plan.recv(s)) * HIDDEN * 4)
            want["backward_bytes"].append(tokens * top_k * HIDDEN * 4)
    return want


def _combine_comm_problem(per_rank: list, ep: int, want: dict) -> str:
    for rank, result in enumerate(per_rank):
        calls = result.get("forward")
        if calls is None:
            continue
        problem = _combine_calls_problem(calls, ep, want["forward_bytes"][rank], want["send"][rank],
                                         want["recv"][rank])
        if problem:
            return f"combine (rank {rank}) made {describe(calls, ep)}: {problem}"
    return ""


def _combine_calls_problem(calls: list[Exchange], ep: int, nbytes: int, send: list, recv: list) -> str:
    exchanges = [c for c in calls if c.op == "all_to_all"]
    others = [c for c in calls if c.op != "all_to_all"]
    if others:
        return ("combine needs one all-to-all and nothing else: the reverse of the dispatch's, so each expert output "
                "goes back only to the rank that owns its token")
    if not exchanges:
        return ("no reverse all-to-all. expert_out holds what this rank's experts computed for every rank's rows "
                "(in the order they arrived), not this rank's own slots: send them back first, with the splits of "
                "the dispatch swapped (send what was received, receive what was sent)")
    if len(exchanges) > 1:
        return "expected exactly one all-to-all, the reverse of the dispatch's rows"
    call = exchanges[0]
    if call.group_size != ep:
        return f"the all-to-all ran over {call.group_size} ranks, not the {ep} of the group: pass group=group"
    if call.send is not None and (list(call.send) != send or list(call.recv) != recv):
        return (f"it sent {list(call.send)} rows and received {list(call.recv)}; the reverse of the dispatch sends "
                f"{send} (what the dispatch received) and receives {recv} (what it sent)")
    if call.nbytes != nbytes:
        return f"it handed {call.nbytes} B to the all-to-all; expected {nbytes} B"
    return ""


def _y_hint(want: dict) -> Callable:
    def hint(got, expected, rank):
        if got is None:
            return ""
        mistakes = [("no_gates", "the gates are not applied: weight each slot's output by its gate, "
                                 "gates.flatten()[order] for the rows in the experts' order"),
                    ("not_unpermuted", "the rows are still in the experts' order: row i belongs to slot order[i], "
                                       "token order[i] // k; un-permute before summing per token"),
                    ("gates_unpermuted", "the rows are un-permuted but the gates are not: row i's gate is "
                                         "gates.flatten()[order[i]]")]
        for key, text in mistakes:
            if close_enough(got, want[key][rank].to(got.dtype), FP32, n=ROUNDINGS):
                return f": {text}"
        return ""
    return hint


def _out_grad_hint(got, want, rank) -> str:
    if got is None:
        return (": no gradient reached expert_out; bring the rows back with AllToAll.apply (a differentiable "
                "all-to-all), not dist.all_to_all_single alone")
    return ": each slot's gradient (gate x gradient of its token's y) must go back to the rank whose expert made it"


def _gates_grad_hint(got, want, rank) -> str:
    if got is None:
        return ": the gates got no gradient; do not detach them: the router learns through them"
    return ": d y[t] / d gates[t, j] is the output of slot t k + j"


def _combine_on_rank(combine: Callable) -> list:
    rank, out = dist.get_rank(), []
    for ep, group, members in _groups():
        i = dist.get_rank(group)
        for seed, case in enumerate(ROUTE_CASES):
            _, tokens, top_k, _ = case
            plan = _plan(members, seed, case)
            expert_out = _expert_out(rank, sum(plan.recv(i)), seed).requires_grad_()   # (R, h)
            gates = _random_gates(rank, tokens, top_k, seed).requires_grad_()         # (T, k)
            splits = (plan.send(i), plan.recv(i))
            result: dict = {}
            out.append(result)
            with recorded_exchanges("combine") as forward:
                y = _attempt(result, "combine", combine, expert_out, splits, plan.orders[i].clone(), gates, group)
            result["forward"] = forward
            if "problem" not in result:
                if not isinstance(y, torch.Tensor) or tuple(y.shape) != (tokens, HIDDEN):
                    shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
                    result["bad"] = f"combine returned {shape}, expected (tokens, h) = {(tokens, HIDDEN)}"
                elif not y.requires_grad:
                    result["bad"] = ("y does not require grad: keep expert_out and the gates in the graph "
                                     "(AllToAll.apply, no .detach())")
                else:
                    result["y"] = y.detach().clone()
            if not all_ranks_ok("y" in result, group):
                continue
            upstream = _upstream(rank, (tokens, HIDDEN), seed)
            with recorded_exchanges("combine's backward") as backward:
                _attempt(result, "combine's backward", lambda: (y * upstream).sum().backward())
            result.update(backward=backward, out_grad=grad_of(expert_out), gates_grad=grad_of(gates))
            all_ranks_ok(True, group)
    return out


# ---- 5. the whole layer ---------------------------------------------------------------------------
def dense_moe(xs: list[torch.Tensor], ids: list[torch.Tensor], seed: int, case: tuple, upstreams: list[torch.Tensor]):
    """One process, float64: y = sum_j gate_j x expert_{e_j}(x) for every token of every rank of a group, by
    a plain loop; sum(y * upstream) backpropagated. Returns the ys, the xs' gradients and every expert's
    (w_in.grad, w_out.grad)."""
    ep, (_, _, top_k, kind) = len(xs), case
    weights = [tuple(w.double().requires_grad_() for w in _expert_weights(e, seed)) for e in range(NUM_EXPERTS)]
    leaves = [x.double().requires_grad_() for x in xs]
    ys = []
    for s, (x, chosen) in enumerate(zip(leaves, ids)):
        gates = _gates(x, chosen, seed, kind, s, ep)                   # (T, k), differentiable through the router
        rows = []
        for t in range(x.shape[0]):
            rows.append(sum(gates[t, j] * _expert(x[t], *weights[int(chosen[t, j])]) for j in range(top_k)))
        ys.append(torch.stack(rows))                                   # (T, h)
    sum((y * up.double()).sum() for y, up in zip(ys, upstreams)).backward()
    return ([y.detach() for y in ys], [_grad_or_zeros(x) for x in leaves],
            [(_grad_or_zeros(w_in), _grad_or_zeros(w_out)) for w_in, w_out in weights])   # an unused expert: zeros


def check_expert_parallel_moe(permute: Callable, dispatch: Callable, combine: Callable) -> None:
    """The whole layer on each rank, router and experts included: permute, dispatch, the local experts on
    what arrived, combine. y, x.grad and every expert's weight gradients equal the dense loop over tokens."""
    not_the_course_answer("check_expert_parallel_moe", permute, dispatch, combine, course=COURSE)
    note = ("4 ranks as ep=4 and as 2 groups of ep=2; each rank routes its own tokens with the same router (top-k "
            "softmax gates), runs permute, dispatch, its E/ep experts (the check's code) and combine, and "
            "backpropagates its own gradient of y. Compared with a loop over every token and its k experts in one "
            "process (float64). Forward: all-to-alls of the counts, the rows, the outputs; backward: two")
    with Report("expert-parallel MoE layer", note=note) as report:
        results = on_ranks(_moe_on_rank, WORLD, permute, dispatch, combine)
        for c, (ep, seed, case) in enumerate(_cases(ROUTE_CASES)):
            per_rank = [r[c] for r in results]
            want = _moe_expected(ep, seed, case)
            detail = (_no_comm_problem(per_rank)
                      or _moe_comm_problem(per_rank, ep, want)
                      or _problem_of(per_rank)
                      or _shape_problem(per_rank)
                      or _counts_problem(per_rank, want)
                      or _value_problem(per_rank, "y", want["y"], "y",
                                        lambda *_: ": check_permute, check_dispatch and check_combine should "
                                                   "pass first")
                      or _backward_comm_problem(per_rank, ep, want)
                      or _problem_of(per_rank, backward=True)
                      or _value_problem(per_rank, "x_grad", want["x_grad"], "x.grad",
                                        lambda got, *_: ": the gates must stay differentiable (the router learns "
                                                        "through them)" if got is not None else "")
                      or _expert_grad_problem(per_rank, want))
            report.add(not detail, detail, ep=ep, case=_case_name(case, ep), k=case[2],
                       **{"rows per expert (rank 0's group)": want["load"],
                          "forward (want)": f"3 all_to_all, {want['forward_bytes'][0]} B",
                          "forward (got)": _total(per_rank[0], ("permute", "dispatch", "combine")),
                          "backward (want)": f"2 all_to_all, {want['backward_total'][0]} B",
                          "backward (got)": _total(per_rank[0], ("backward",))},
                       max_err=max(_max_err(per_rank, [("y", want["y"]), ("x_grad", want["x_grad"])]),
                                   _expert_grad_error(per_rank, want)))


def _total(result: dict, keys: tuple) -> str:
    calls = [c for key in keys for c in result.get(key, [])]
    if not calls:
        return "none" if any(key in result for key in keys) else "-"
    exchanges = [c for c in calls if c.op == "all_to_all"]
    others = sorted({c.op for c in calls} - {"all_to_all"})
    text = f"{len(exchanges)} all_to_all, {sum(c.nbytes for c in exchanges)} B"
    return text + (f" + {', '.join(others)}" if others else "")


def _moe_expected(ep: int, seed: int, case: tuple) -> dict:
    _, tokens, top_k, _ = case
    want = {key: [] for key in ("y", "x_grad", "w", "received_counts", "own_counts", "rows_bytes", "send", "recv",
                                "forward_bytes", "backward_total", "combine_bytes", "combine_send", "combine_recv")}
    loads = []
    for members in ([list(range(WORLD))] if ep == WORLD else [[0, 1], [2, 3]]):
        plan = _plan(members, seed, case)
        loads.append(plan.counts.sum(0))
        xs = [_tokens(g, tokens, seed) for g in members]
        ups = [_upstream(g, (tokens, HIDDEN), seed, which=1) for g in members]
        ys, x_grads, w_grads = dense_moe(xs, plan.ids, seed, case, ups)
        local = NUM_EXPERTS // ep
        for s in range(ep):
            rows, received = tokens * top_k * HIDDEN * 4, sum(plan.recv(s)) * HIDDEN * 4
            want["y"].append(ys[s])
            want["x_grad"].append(x_grads[s])
            want["w"].append(w_grads[s * local:(s + 1) * local])
            want["received_counts"].append(plan.received_counts(s))
            want["own_counts"].append(plan.counts[s].view(ep, -1))
            want["rows_bytes"].append(rows)
            want["send"].append(plan.send(s))
            want["recv"].append(plan.recv(s))
            want["combine_bytes"].append(received)
            want["combine_send"].append(plan.recv(s))
            want["combine_recv"].append(plan.send(s))
            want["forward_bytes"].append(NUM_EXPERTS * 8 + rows + received)
            want["backward_total"].append(rows + received)
    want["load"] = loads[0].tolist()                  # the group of rank 0
    return want


def _no_comm_problem(per_rank: list) -> str:
    for rank, result in enumerate(per_rank):
        if result.get("permute"):
            return (f"permute (rank {rank}) made {describe(result['permute'])}: it works on this rank's own tokens and "
                    "needs no communication")
    return ""


def _moe_comm_problem(per_rank: list, ep: int, want: dict) -> str:
    for rank, result in enumerate(per_rank):
        if result.get("dispatch") is not None:
            problem = _dispatch_calls_problem(result["dispatch"], ep, want["rows_bytes"][rank], want["send"][rank],
                                              want["recv"][rank])
            if problem:
                return f"dispatch (rank {rank}) made {describe(result['dispatch'], ep)}: {problem}"
        if result.get("combine") is not None:
            problem = _combine_calls_problem(result["combine"], ep, want["combine_bytes"][rank],
                                             want["combine_send"][rank], want["combine_recv"][rank])
            if problem:
                return f"combine (rank {rank}) made {describe(result['combine'], ep)}: {problem}"
    return ""


def _backward_comm_problem(per_rank: list, ep: int, want: dict) -> str:
    """Backward: the reverse of combine's all-to-all (the T k slots' gradients), then of dispatch's."""
    for rank, result in enumerate(per_rank):
        calls = result.get("backward")
        if calls is None:
            continue
        expected = [want["rows_bytes"][rank], want["combine_bytes"][rank]]
        if [c.op for c in calls] != ["all_to_all", "all_to_all"] or [c.nbytes for c in calls] != expected:
            return (f"the backward (rank {rank}) made {describe(calls, ep)}; expected all_to_all {expected[0]} B (the "
                    f"gradients of the slots' outputs, back to the experts' ranks), then all_to_all {expected[1]} B "
                    "(the gradients of the received rows, back to their tokens' ranks)")
    return ""


def _expert_grad_problem(per_rank: list, want: dict) -> str:
    for rank, result in enumerate(per_rank):
        if "w_grads" not in result:
            continue
        for j, ((got_in, got_out), (want_in, want_out)) in enumerate(zip(result["w_grads"], want["w"][rank])):
            for name, got, expected in (("w_in", got_in, want_in), ("w_out", got_out, want_out)):
                if got is None or not close_enough(got, expected.float(), FP32, n=ROUNDINGS):
                    shown = "None" if got is None else mismatch(got, expected.float())
                    return (f"rank {rank}: local expert {j}'s {name}.grad is wrong: an expert's gradient sums over "
                            "the rows of every rank it received, and their gradients come back through combine's "
                            f"all-to-all. {shown}")
    return ""


def _expert_grad_error(per_rank: list, want: dict) -> float:
    errors = [max_abs_error(got, expected) if got is not None else math.inf
              for result, wants in zip(per_rank, want["w"]) if "w_grads" in result
              for pair, expected_pair in zip(result["w_grads"], wants) for got, expected in zip(pair, expected_pair)]
    return max(errors, default=math.nan)


def _run_local_experts(received: torch.Tensor, received_counts: torch.Tensor, weights: list) -> torch.Tensor:
    """The check's own expert step: regroup the received rows by local expert, run each, restore the order."""
    ep, local = received_counts.shape
    expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(received_counts.flatten().long())   # (R,)
    by_expert = expert_of_row.argsort(stable=True)
    blocks = received[by_expert].split(received_counts.sum(0).tolist())
    outputs = torch.cat([_expert(block, *w) for block, w in zip(blocks, weights)])
    return outputs[by_expert.argsort()]


def _moe_on_rank(permute: Callable, dispatch: Callable, combine: Callable) -> list:
    rank, out = dist.get_rank(), []
    for ep, group, members in _groups():
        i = dist.get_rank(group)
        local = NUM_EXPERTS // ep
        for seed, case in enumerate(ROUTE_CASES):
            _, tokens, top_k, kind = case
            x = _tokens(rank, tokens, seed).requires_grad_()                        # (T, h)
            ids = _expert_ids(x, seed, case, i, ep)                                  # (T, k)
            gates = _gates(x, ids, seed, kind, i, ep)                                # (T, k), through the router
            weights = [tuple(w.requires_grad_() for w in _expert_weights(e, seed))
                       for e in range(i * local, (i + 1) * local)]
            result: dict = {}
            out.append(result)
            with recorded_exchanges("permute") as calls:
                got = _attempt(result, "permute", permute, x, ids.clone(), NUM_EXPERTS)
            result["permute"] = calls
            if "problem" not in result:
                if not (isinstance(got, (tuple, list)) and len(got) == 3
                        and all(isinstance(t, torch.Tensor) for t in got)
                        and tuple(got[0].shape) == (tokens * top_k, HIDDEN) and tuple(got[1].shape) == (tokens * top_k,)
                        and tuple(got[2].shape) == (NUM_EXPERTS,)):
                    result["bad"] = "permute returned something else than (rows (T k, h), order (T k,), counts (E,))"
            if not all_ranks_ok("problem" not in result and "bad" not in result, group):
                continue
            rows, order, counts = got
            with recorded_exchanges("dispatch") as calls:
                got = _attempt(result, "dispatch", dispatch, rows, counts, group)
            result["dispatch"] = calls
            unpacked = None
            if "problem" not in result:
                unpacked, bad = _unpack_dispatch(got, ep, counts)
                if bad:
                    result["bad"] = bad
                else:
                    result["received_counts"] = unpacked[1].detach().clone()
            if not all_ranks_ok(unpacked is not None, group):
                continue
            received, received_counts, splits = unpacked
            expert_out = _run_local_experts(received, received_counts, weights)     # (R, h), as received
            with recorded_exchanges("combine") as calls:
                y = _attempt(result, "combine", combine, expert_out, splits, order, gates, group)
            result["combine"] = calls
            if "problem" not in result:
                if not isinstance(y, torch.Tensor) or tuple(y.shape) != (tokens, HIDDEN) or not y.requires_grad:
                    result["bad"] = (f"combine returned something else than y (tokens, h) = {(tokens, HIDDEN)} "
                                     "with a grad_fn")
                else:
                    result["y"] = y.detach().clone()
            if not all_ranks_ok("y" in result, group):
                continue
            upstream = _upstream(rank, (tokens, HIDDEN), seed, which=1)
            with recorded_exchanges("the layer's backward") as backward:
                _attempt(result, "the layer's backward", lambda: (y * upstream).sum().backward())
            result.update(backward=backward, x_grad=grad_of(x), w_grads=[(grad_of(a), grad_of(b)) for a, b in weights])
            all_ranks_ok(True, group)
    return out


# ---- 6. predict, then run: expert outputs that never went home ------------------------------------
# A layer in one process (ep = 1: both all-to-alls send nothing anywhere), built the assignment's way:
# route, permute, one matmul per expert, then an `unpermute(outputs, order, gates)` that puts each row
# back in its token. The demo runs a given unpermute beside the right one (the check's own).
DEMO_TOKENS, DEMO_EXPERTS, DEMO_TOP_K = 16, 4, 2     # the one-layer look: 16 tokens, 4 experts, top-2
DEMO_LM = dict(hidden_size=64, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_seq_len=64)                       # a small causal LM whose MLPs are MoE layers
DEMO_STEPS, DEMO_BATCH, DEMO_SEQ, DEMO_LR = 100, 8, 32, 3e-3
DEMO_CUT = 5                                         # the position whose output must not see the tokens after it


def _permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """The check's permute: rows grouped by expert (stable), order[i] = slot of row i, counts per expert."""
    k = expert_ids.shape[1]
    slots = expert_ids.flatten()
    order = slots.argsort(stable=True)
    return tokens[torch.div(order, k, rounding_mode="floor")], order, torch.bincount(slots, minlength=num_experts)


def _unpermute(outputs: torch.Tensor, order: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """The right way back: row i is slot order[i], token order[i] // k, gate gates.flatten()[order[i]]."""
    k = gates.shape[1]
    weighted = outputs * gates.flatten()[order].unsqueeze(-1).to(outputs.dtype)
    token = torch.div(order, k, rounding_mode="floor")
    return outputs.new_zeros(gates.shape[0], outputs.shape[1]).index_add(0, token, weighted)


class _DemoMoE(torch.nn.Module):
    """Router (top-k of a softmax, renormalised), permute, one SwiGLU-free MLP per expert, `unpermute`."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, unpermute: Callable):
        super().__init__()
        self.top_k, self.unpermute = top_k, unpermute
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(hidden, ffn, bias=False), torch.nn.SiLU(),
                                torch.nn.Linear(ffn, hidden, bias=False)) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])                        # (T, h): every sequence of the batch
        top, ids = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        gates = top / top.sum(-1, keepdim=True)                    # (T, k)
        rows, order, counts = _permute(tokens, ids, len(self.experts))
        outputs = torch.cat([expert(block) for expert, block in zip(self.experts, rows.split(counts.tolist()))])
        return self.unpermute(outputs, order, gates).view(x.shape)


def _demo_layer(unpermute: Callable) -> dict:
    """One layer on 16 tokens: how far y is from the right y, which tokens are right, and which tokens
    the output of token 0 depends on."""
    torch.manual_seed(0)
    layer = _DemoMoE(HIDDEN, FFN, DEMO_EXPERTS, DEMO_TOP_K, unpermute)
    right = _DemoMoE(HIDDEN, FFN, DEMO_EXPERTS, DEMO_TOP_K, _unpermute)
    right.load_state_dict(layer.state_dict())
    x = rank_tensor(900, (DEMO_TOKENS, HIDDEN), FP32).requires_grad_()
    y, want = layer(x), right(x).detach()
    scale = want.abs().max().item()
    per_token = (y.detach() - want).abs().amax(-1)
    (grad_x,) = torch.autograd.grad(y[0].sum(), x)
    return {"error": per_token.max().item() / scale,
            "right tokens": [t for t in range(DEMO_TOKENS) if close_enough(y[t].detach(), want[t], FP32, n=ROUNDINGS,
                                                                           scale=scale)],
            "token 0 reads": [t for t in range(DEMO_TOKENS) if grad_x[t].abs().max() > 0]}


def _demo_training(unpermute: Callable, dataset) -> dict:
    """The small LM trained DEMO_STEPS AdamW steps: its losses, a held-out loss, and how much the output at
    position DEMO_CUT changes when the tokens after it are cut off (0 up to rounding in a causal model)."""
    from picotron.config import ModelConfig
    from picotron.data import DataLoader
    from picotron.model import Llama, loss_fn
    torch.manual_seed(0)
    model = Llama(ModelConfig(**DEMO_LM))
    for layer in model.layers:                                     # every MLP becomes an MoE layer
        layer.mlp = _DemoMoE(DEMO_LM["hidden_size"], DEMO_LM["intermediate_size"], DEMO_EXPERTS, DEMO_TOP_K,
                             unpermute)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEMO_LR)
    loader = DataLoader(dataset, DEMO_BATCH)
    losses = []
    for step in range(DEMO_STEPS):
        batch = loader.get_batch(step)
        loss = loss_fn(model(batch.input_ids), batch.targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        held_out = loader.get_batch(10_000)
        held = loss_fn(model(held_out.input_ids), held_out.targets).item()
        ids = held_out.input_ids[:1]
        whole, cut = model(ids)[0, DEMO_CUT], model(ids[:, :DEMO_CUT + 1])[0, DEMO_CUT]
    return {"losses": losses, "held-out": held, "future": (whole - cut).abs().max().item()}


def unpermute_demo(unpermute: Callable) -> dict:
    """Run `unpermute(outputs, order, gates)` inside an MoE layer in one process, beside the right one.

    Prints, for one layer of 16 tokens: the error of y, the tokens whose y is right, the tokens that
    token 0's output depends on; then, for a 2-layer causal LM whose MLPs are such MoE layers, trained
    DEMO_STEPS steps on the course's arithmetic corpus: the loss curve, a held-out loss, and how much the
    output at position DEMO_CUT changes when the tokens after it are cut off. Returns the numbers printed.
    A few seconds on one CPU core."""
    from picotron.config import TrainConfig
    from picotron.data import build_dataset
    with one_thread():
        numbers = {"layer": _demo_layer(unpermute), "right layer": _demo_layer(_unpermute)}
        data = build_dataset(TrainConfig(seq_len=DEMO_SEQ))
        numbers |= {"training": _demo_training(unpermute, data), "right training": _demo_training(_unpermute, data)}
    layer = numbers["layer"]
    print(f"one layer, {DEMO_TOKENS} tokens, {DEMO_EXPERTS} experts, top-{DEMO_TOP_K}, with "
          f"{getattr(unpermute, '__name__', 'your unpermute')}:")
    print(f"  largest error of y: {layer['error']:.2f} x max |y|")
    print(f"  tokens whose y is right: {layer['right tokens']} ({len(layer['right tokens'])} of {DEMO_TOKENS})")
    print(f"  y[0] depends on the inputs of tokens {layer['token 0 reads']} (the right layer: "
          f"{numbers['right layer']['token 0 reads']})")
    print(f"a {DEMO_LM['num_layers']}-layer causal LM with these MoE layers, {DEMO_STEPS} AdamW steps of "
          f"{DEMO_BATCH} x {DEMO_SEQ} tokens:")
    print(f"  {'':<22}{'loss at step 0':>15}{'25':>7}{'50':>7}{DEMO_STEPS - 1:>7}{'held out':>10}"
          f"{'future -> position ' + str(DEMO_CUT):>26}")
    name = getattr(unpermute, "__name__", "yours")[:22]
    for name, run in ((name, numbers["training"]), ("the right unpermute", numbers["right training"])):
        curve = "".join(f"{run['losses'][s]:>7.3f}" for s in (25, 50, DEMO_STEPS - 1))
        print(f"  {name:<22}{run['losses'][0]:>15.3f}{curve}{run['held-out']:>10.3f}{run['future']:>26.1e}")
    return numbers


# ---- 7. stretch: a capacity per expert, the overflow dropped ------------------------------------------
# (name, tokens, top_k, experts, capacity factor, logit bias {expert: bias}). Factors are exact in binary, so
# capacity_factor * T * k / E has no rounding to argue about. "first choices first": expert 0 is many tokens'
# second choice and a few tokens' first, so keeping slots in token order keeps other slots than GShard's rule.
CAPACITY_CASES = [("random, factor 1", 12, 2, 4, 1.0, {}),
                  ("ceil: C = 7, not 6", 10, 2, 4, 1.25, {1: 1.5}),
                  ("first choices first", 12, 2, 4, 1.0, {0: 1.2}),
                  ("top-1 (Switch)", 10, 1, 4, 1.0, {2: 1.0}),
                  ("top-3, factor 0.75", 8, 3, 6, 0.75, {}),
                  ("factor 0.5: tokens lose every expert", 8, 2, 4, 0.5, {}),
                  ("factor 4: nothing dropped", 6, 2, 4, 4.0, {})]


class _RecordingExpert:
    """An expert (n, h) -> (n, h) that notes how many rows each call gets; its weights are fp32 leaves."""

    def __init__(self, expert: int, seed: int):
        self.w_in, self.w_out = (w.requires_grad_() for w in _expert_weights(expert, seed))
        self.calls: list[int] = []

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append(rows.shape[0] if rows.dim() > 1 else 1)
        return _expert(rows, self.w_in, self.w_out)


def _capacity_inputs(case: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, h), expert_ids (T, k) (the top-k of random scores, shifted by the case's bias), gates (T, k)."""
    _, tokens, top_k, experts, _, bias = case
    x = rank_tensor(700, (tokens, HIDDEN), FP32, seed)
    scores = rank_tensor(710, (tokens, experts), FP32, seed)
    for expert, shift in bias.items():
        scores[:, expert] += shift
    top, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return x, ids, top / top.sum(-1, keepdim=True)


def _capacity_of(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """C = ceil(factor * T k / E): the slots one expert may take."""
    return math.ceil(factor * tokens * top_k / experts)


def _kept_by_rule(ids: torch.Tensor, experts: int, capacity: int, priority: str = "choice") -> torch.Tensor:
    """(T, k) bools: each expert keeps its first `capacity` slots in the priority order, by a plain loop.

    "choice" (the task's, GShard's): every token's first choice, in token order, then every second
    choice, ...; "token": slot t k + j order; "last": the task's order, but the last C kept."""
    tokens, top_k = ids.shape
    slots = [(t, j) for j in range(top_k) for t in range(tokens)]
    if priority == "token":
        slots = [(t, j) for t in range(tokens) for j in range(top_k)]
    elif priority == "last":
        slots = slots[::-1]
    used, kept = [0] * experts, torch.zeros(tokens, top_k, dtype=torch.bool)
    for t, j in slots:
        e = int(ids[t, j])
        if used[e] < capacity:
            kept[t, j], used[e] = True, used[e] + 1
    return kept


def _capacity_layer(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, weights: list, kept: torch.Tensor,
                    residual: bool = True, renormalise: bool = False) -> torch.Tensor:
    """out[t] = x[t] + sum over kept slots j of gates[t, j] expert_{ids[t, j]}(x[t]), token by token."""
    if renormalise:
        gates = gates * kept / (gates * kept).sum(-1, keepdim=True).clamp(min=1e-30)
    rows = []
    for t in range(x.shape[0]):
        y = x[t] if residual else torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            if kept[t, j]:
                y = y + gates[t, j] * _expert(x[t], *weights[int(ids[t, j])])
        rows.append(y)
    return torch.stack(rows)


def _capacity_expected(case: tuple, seed: int) -> dict:
    """The task's rule in float64, with autograd: kept, out and the gradients; plus the classic mistakes."""
    _, tokens, top_k, experts, factor, _ = case
    x, ids, gates = _capacity_inputs(case, seed)
    capacity = _capacity_of(tokens, top_k, experts, factor)
    kept = _kept_by_rule(ids, experts, capacity)
    x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
    w64 = [tuple(w.double().requires_grad_() for w in _expert_weights(e, seed)) for e in range(experts)]
    out = _capacity_layer(x64, ids, g64, w64, kept)
    (out * _upstream(0, tuple(out.shape), seed, which=7).double()).sum().backward()
    want = {"capacity": capacity, "kept": kept, "out": out.detach(), "x_grad": x64.grad,
            "gates_grad": _grad_or_zeros(g64), "w_grads": [(_grad_or_zeros(a), _grad_or_zeros(b)) for a, b in w64],
            "per_expert": torch.bincount(ids[kept], minlength=experts).tolist()}
    with torch.no_grad():
        x64, g64 = x.double(), gates.double()
        w64 = [tuple(w.double() for w in _expert_weights(e, seed)) for e in range(experts)]
        want["mistaken kept"] = {
            "floor": _kept_by_rule(ids, experts, math.floor(factor * tokens * top_k / experts)),
            "no k": _kept_by_rule(ids, experts, math.ceil(factor * tokens / experts)),
            "token": _kept_by_rule(ids, experts, capacity, "token"),
            "last": _kept_by_rule(ids, experts, capacity, "last"),
            "all": torch.ones_like(kept)}
        want["mistaken out"] = {
            "no residual": _capacity_layer(x64, ids, g64, w64, kept, residual=False),
            "renormalised": _capacity_layer(x64, ids, g64, w64, kept, renormalise=True),
            "dropped kept": _capacity_layer(x64, ids, g64, w64, torch.ones_like(kept)),
            "no gates": _capacity_layer(x64, ids, torch.ones_like(g64), w64, kept)}
    return want


_KEPT_HINTS = {
    "floor": "C is rounded down; C = ceil(capacity_factor x T k / E) rounds up (math.ceil)",
    "no k": "C counts tokens, not slots: C = ceil(capacity_factor x T k / E), with k the slots of each token",
    "token": ("the slots are kept in token order (token 0's choices, then token 1's, ...); GShard's priority is "
              "every token's first choice before any second choice, then tokens in order within a choice"),
    "last": "an expert keeps its last C slots; it keeps the first C in the priority order and drops the rest",
    "all": "nothing is dropped: an expert keeps at most C slots"}
_OUT_HINTS = {
    "no residual": "the residual is missing: out[t] = x[t] + the kept slots' gate-weighted outputs",
    "renormalised": "the gates are renormalised over the kept slots; use them as given",
    "dropped kept": "dropped slots still reach their expert's output: add only the kept slots",
    "no gates": "the gates are not applied: weight each kept slot's output by gates[t, j]"}


def check_capacity_moe(capacity_moe: Callable) -> None:
    """Stretch. out, kept = capacity_moe(x, expert_ids, gates, experts, capacity_factor): each expert keeps at
    most C = ceil(capacity_factor T k / E) slots, first choices before second choices, then in token order;
    out[t] = x[t] + sum over kept slots of gates[t, j] expert(x[t]); each expert called at most once, on its
    kept rows; gradients to x, the gates and the experts' weights."""
    not_the_course_answer("check_capacity_moe", capacity_moe, course=COURSE)
    note = ("one process; x (T, h), expert_ids (T, k), gates (T, k), experts: E functions (n, h) -> (n, h) that note "
            "their calls. Compared with a loop over the slots in priority order and over the tokens (float64); "
            "gradients of sum(out * u) for a fixed u. per expert: kept slots of experts 0, 1, ...")
    with Report("capacity_moe", note=note) as report:
        for seed, case in enumerate(CAPACITY_CASES):
            name, tokens, top_k, experts, factor, _ = case
            want = _capacity_expected(case, seed)
            got_per_expert, detail = "-", ""
            x, ids, gates = _capacity_inputs(case, seed)
            x, gates = x.clone().requires_grad_(), gates.clone().requires_grad_()
            recording = [_RecordingExpert(e, seed) for e in range(experts)]
            got = capacity_moe(x, ids.clone(), gates, recording, factor)
            detail, kept = _capacity_returned(got, tokens, top_k)
            if not detail:
                got_per_expert = torch.bincount(ids[kept], minlength=experts).tolist()
                detail = (_kept_problem(kept, want) or _calls_problem(recording, want)
                          or _capacity_out_problem(got[0], want))
            if not detail:
                detail = _capacity_grad_problem(got[0], x, gates, recording, want, seed)
            report.add(not detail, detail, case=name, T=tokens, k=top_k, E=experts, factor=str(factor),
                       C=want["capacity"], **{"per expert (want)": want["per_expert"],
                                              "per expert (got)": got_per_expert})


def _capacity_returned(got, tokens: int, top_k: int) -> tuple[str, torch.Tensor | None]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return f"capacity_moe returned {type(got).__name__}; return the pair (out, kept)", None
    out, kept = got
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (tokens, HIDDEN):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"out is {shape}, expected a tensor (T, h) = {(tokens, HIDDEN)}", None
    if not isinstance(kept, torch.Tensor) or tuple(kept.shape) != (tokens, top_k) or kept.dtype != torch.bool:
        shape = (f"{kept.dtype} of shape {tuple(kept.shape)}" if isinstance(kept, torch.Tensor)
                 else type(kept).__name__)
        return f"kept is {shape}, expected torch.bool of shape (T, k) = {(tokens, top_k)}", None
    return "", kept


def _kept_problem(kept: torch.Tensor, want: dict) -> str:
    if torch.equal(kept, want["kept"]):
        return ""
    if torch.equal(kept, ~want["kept"]):
        return "kept is True for the dropped slots and False for the kept ones: True means kept"
    hint = next((text for key, text in _KEPT_HINTS.items() if torch.equal(kept, want["mistaken kept"][key])),
                "each expert keeps its first C slots in the priority order: (choice 0, token 0), (0, 1), ..., "
                "(0, T-1), (1, 0), ...")
    wrong = (kept != want["kept"]).nonzero().tolist()
    return f"kept differs at (token, choice) {[tuple(w) for w in wrong[:4]]}: {hint} (C = {want['capacity']})"


def _calls_problem(recording: list, want: dict) -> str:
    for e, (expert, rows) in enumerate(zip(recording, want["per_expert"])):
        if len(expert.calls) > 1:
            return (f"expert {e} was called {len(expert.calls)} times (rows {expert.calls}); call each expert once, "
                    f"on one block of its kept rows: that block is its buffer of at most C = {want['capacity']} rows")
        if expert.calls and expert.calls[0] not in (rows, want["capacity"]):
            return (f"expert {e} was called on {expert.calls[0]} rows; it keeps {rows} slots: call it on exactly "
                    f"those rows (or on a buffer of C = {want['capacity']} rows)")
        if rows and not expert.calls:
            return f"expert {e} keeps {rows} slots but was never called"
    return ""


def _capacity_out_problem(out: torch.Tensor, want: dict) -> str:
    expected = want["out"].to(out.dtype)
    if close_enough(out.detach(), expected, FP32, n=ROUNDINGS):
        return ""
    hint = next((text for key, text in _OUT_HINTS.items()
                 if close_enough(out.detach(), want["mistaken out"][key].to(out.dtype), FP32, n=ROUNDINGS)), "")
    return f"out is wrong{': ' + hint if hint else ''}. {mismatch(out.detach(), expected)}"


def _capacity_grad_problem(out: torch.Tensor, x: torch.Tensor, gates: torch.Tensor, recording: list, want: dict,
                           seed: int) -> str:
    if not out.requires_grad:
        return "out does not require grad: keep x, the gates and the experts' outputs in the graph (no .detach())"
    (out * _upstream(0, tuple(out.shape), seed, which=7)).sum().backward()
    if gates.grad is None:
        return "the gates got no gradient: do not detach them (the router learns through them)"
    for what, got, expected in (("x.grad", x.grad, want["x_grad"]), ("gates.grad", gates.grad, want["gates_grad"])):
        if got is None or not close_enough(got, expected.float(), FP32, n=ROUNDINGS):
            shown = "None" if got is None else mismatch(got, expected.float())
            extra = (": a dropped slot gets no gradient; the residual gives every token's x a gradient of its own"
                     if what == "x.grad" else
                     ": d out[t] / d gates[t, j] is expert(x[t]) for a kept slot, 0 for a dropped one")
            return f"{what} is wrong{extra}. {shown}"
    for e, (expert, (want_in, want_out)) in enumerate(zip(recording, want["w_grads"])):
        for name, w, expected in (("w_in", expert.w_in, want_in), ("w_out", expert.w_out, want_out)):
            got = torch.zeros_like(w) if w.grad is None else w.grad
            if not close_enough(got, expected.float(), FP32, n=ROUNDINGS):
                return (f"expert {e}'s {name}.grad is wrong: it sums over the expert's kept rows only. "
                        f"{mismatch(got, expected.float())}")
    return ""

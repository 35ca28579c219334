"""The checks of assignment 07: expert parallelism, tokens sent to their experts and back by all-to-all,
declared on the course's engine (picotron_course.engine).

A mixture-of-experts layer has E = 8 experts split over the ep ranks of a group: rank r of the group holds experts
[r E/ep, (r+1) E/ep). The checks that communicate run the learner's code on 4 ranks, as one ep group of 4 and as
two ep groups of 2 (ranks 0-1 and 2-3: a rank's place in its group differs from its global rank), in one launch.
They observe what each rank raised, the collectives of each phase in words (operation, bytes, split sizes, group
size), what the code returned, values and gradients, and compare with single-process math done here, in the
parent: for the whole layer, a plain loop over every token and its top-k experts in float64, and its autograd
gradients. Nothing here uses picotron.parallel.expert_parallel or picotron.model's MoE, the code rebuilt.

    check_permute(permute)        one process: the (token, choice) slots grouped by expert, their order, the counts
    check_all_to_all(AllToAll)    rows to their ranks with uneven splits; backward the reverse all-to-all
    check_dispatch(dispatch)      an all-to-all of the counts, then one of exactly the rows routed; what each rank
                                  receives, from whom, and the gradient that comes back
    check_combine(combine)        the reverse all-to-all, un-permute, gates: y and the gradients of expert_out, gates
    check_expert_parallel_moe(permute, dispatch, combine)
                                  the whole layer, router and experts included, equals the dense loop: y, x.grad and
                                  every local expert's weight gradients; 3 all-to-alls forward, 2 backward
    check_capacity_moe(capacity_moe)
                                  stretch, one process: each expert keeps at most C = ceil(factor T k / E) slots in
                                  GShard's priority; out = x + the kept slots' gate-weighted outputs, each expert
                                  called once; gradients. The reference: a plain loop from the task text, in float64
    unpermute_demo(unpermute)     predict, then run: a given way back from the experts' order to the tokens, in a
                                  layer and in a small causal LM trained beside the right one (not a check)

The routings cover random top-2 and top-1, a skewed one where experts 6 and 7 get no token (so with ep = 4 rank 3
receives nothing), and one where rank 1 sends no row to one of the ranks. Inside the ranks, `recorded_exchanges`
notes every collective; before each all-to-all runs, it compares the split sizes of every rank of the group (a
small all-gather of its own, not recorded): gloo crashes, or mixes rows up, when they disagree, and the check says
instead which rank sends what to whom. Each check's misconceptions are wrong answers learners write, with the hint
each should read.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F

from picotron_course.checks import (all_ranks_ok, close_enough, collectives_observed, grad_of, one_thread,
                                    payload_of, raised, rank_tensor)
from picotron_course.engine import (Check, Close, Exact, Misconception, Within, named, observe_in_process,
                                    observe_on_ranks, world_and_halves)

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
# picotron's answers, and the correct bases of this file's misconceptions (refused as answers)
COURSE = ("picotron.parallel.expert_parallel", "picotron.model", __name__)
ONLY = {__name__: {"_permute", "_AllToAll", "_dispatch", "_combine", "_capacity_moe"}}
RANK = ("rank {}",)

# (name, tokens per rank, top_k, routing). "skewed": expert 0 favoured, experts 6 and 7 never chosen;
# "gap": rank 1 of the group never chooses the experts of rank {gap} = 2 mod ep, so it sends it no row.
ROUTE_CASES = [("random", 6, 2, "random"), ("skewed: experts 6, 7 get nothing", 6, 2, "skewed"),
               ("rank 1 sends nothing to rank {gap}", 6, 2, "gap"), ("top-1", 5, 1, "random")]
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


# ---- how the observations are compared and shown ---------------------------------------------------
@dataclass(frozen=True)
class Said(Exact):
    """Exact, shown whole: what a rank raised, the collectives of a phase, what a function returned. Not engine.Said:
    a phase's collectives are a list, said one after the other ("a, then b"; "no collective" for none)."""

    def shown(self, got, want) -> str:
        return f"expected {_words(want)}; got {_words(got)}"


def _words(value) -> str:
    if isinstance(value, list):
        return ", then ".join(map(str, value)) or "no collective"
    return "nothing" if value is None or value == "" else str(value)


def _tensor(t, dtype: bool = False, grad: bool = False) -> str:
    """A tensor in words: its shape, and its dtype or whether it requires grad when asked (another value: its type,
    and its length)."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}" + (f" of {len(t)}" if isinstance(t, (tuple, list)) else "")
    return (f"{tuple(t.shape)}" + (f" {str(t.dtype).removeprefix('torch.')}" if dtype else "")
            + ((" requiring grad" if t.requires_grad else " not requiring grad") if grad else ""))


def _wanted(*shape: int) -> str:
    """The words of a tensor of that shape that requires grad: what a differentiable step must return."""
    return f"{shape} requiring grad"


# ---- recording (and guarding) the collectives a rank makes ------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One collective call: operation ("all_to_all" for either form), bytes handed in, the rows sent to / received
    from each rank (all-to-all only) and the size of its group."""
    op: str
    nbytes: int
    send: tuple | None
    recv: tuple | None
    group_size: int

    def said(self) -> str:
        return _collective(self.op, self.nbytes, self.group_size, self.send, self.recv)


def _collective(op: str, nbytes: int, group_size: int, send=None, recv=None) -> str:
    """A collective in words, as the checks compare them: 'all_to_all (64 B over 4 ranks, sends [2, 2, 2, 2] rows,
    receives [2, 2, 2, 2])'."""
    rows = (f", sends {list(send) if send is not None else '?'} rows, receives "
            f"{list(recv) if recv is not None else '?'}" if op == "all_to_all" else "")
    return f"{op} ({nbytes} B over {group_size} ranks{rows})"


class SplitsDisagree(AssertionError):
    """The ranks of a group called an all-to-all with split sizes that do not fit together.

    Raised on every rank of the group at once (they all see the same gathered sizes), so the ranks
    stay in step and the check can go on with its next case."""


@contextmanager
def recorded_exchanges(where: str) -> Iterator[list[Exchange]]:
    """Inside the block, every collective this rank calls is appended to the yielded list.

    An all-to-all counts its input; any other operation its largest tensor argument. Before an
    all-to-all runs, the split sizes of every rank of its group are compared (by an all-gather of the
    guard's own, not recorded); if they disagree, every rank raises SplitsDisagree naming `where` and
    the first mismatch.
    """
    calls: list[Exchange] = []
    gather = c10d.all_gather

    def record(name: str, arguments: dict) -> None:
        group = arguments.get("group")
        size = dist.get_world_size(group)
        if name in ("all_to_all_single", "all_to_all"):
            call, sizes = _all_to_all_call(name, arguments, size)
            calls.append(call)
            table = [torch.zeros(len(sizes), dtype=torch.long) for _ in range(size)]
            gather(table, torch.tensor(sizes, dtype=torch.long), group=group)
            problem = _splits_problem([row.tolist() for row in table], size)
            if problem:
                raise SplitsDisagree(f"{where}: the all-to-all's split sizes do not fit: {problem}")
        else:
            payload = payload_of(name, arguments)
            nbytes = 0 if payload is None else payload.numel() * payload.element_size()
            calls.append(Exchange(name.strip("_").removesuffix("_base"), nbytes, None, None, size))

    with collectives_observed(record):
        yield calls


def _all_to_all_call(name: str, arguments: dict, size: int) -> tuple[Exchange, list[int]]:
    """The Exchange of an all-to-all, and the sizes the guard compares across ranks: rows in, rows out, whether
    the rows have one shape, whether the splits are one number per rank, then the splits sent and received."""
    def rows(t: torch.Tensor) -> int:
        return t.shape[0] if t.dim() else 1
    if name == "all_to_all_single":
        inputs, outputs = [arguments["input"]], [arguments["output"]]
        send = _splits(arguments.get("input_split_sizes"), rows(inputs[0]), size)
        recv = _splits(arguments.get("output_split_sizes"), rows(outputs[0]), size)
    else:  # all_to_all(output_tensor_list, input_tensor_list): one tensor per rank
        inputs, outputs = list(arguments["input_tensor_list"]), list(arguments["output_tensor_list"])
        send, recv = tuple(map(rows, inputs)), tuple(map(rows, outputs))
    same_rows = len({t.shape[1:] for t in inputs + outputs}) <= 1
    valid = send is not None and recv is not None and len(send) == len(recv) == size
    sizes = [sum(map(rows, inputs)), sum(map(rows, outputs)), int(same_rows), int(valid),
             *(list(send) + list(recv) if valid else [0] * (2 * size))]
    return Exchange("all_to_all", sum(t.numel() * t.element_size() for t in inputs), send, recv, size), sizes


def _splits(sizes, rows: int, size: int) -> tuple | None:
    """Split sizes as a tuple of ints; None (even split) as the even split it stands for, or None if
    the rows do not divide."""
    if sizes is None or len(sizes) == 0:
        return tuple([rows // size] * size) if rows % size == 0 else None
    return tuple(int(s) for s in sizes)


def _splits_problem(table: list[list[int]], size: int) -> str:
    """What does not fit in the sizes every rank of a group gathered (one row a rank), "" when they fit."""
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


# ---- the data every rank and the parent make alike ------------------------------------------------
def _tokens(rank: int, tokens: int, seed: int) -> torch.Tensor:
    """This rank's tokens (T, h): they differ per global rank."""
    return rank_tensor(10 + rank, (tokens, HIDDEN), FP32, seed)


def _bias(kind: str, group_rank: int, ep: int) -> torch.Tensor:
    """A per-case shift of the router's logits, (E,), that makes the routing skewed or leaves a gap."""
    bias = torch.zeros(NUM_EXPERTS)
    if kind == "skewed":
        bias[0], bias[6:] = 2.0, -30.0
    elif kind == "gap" and group_rank == 1:
        local, target = NUM_EXPERTS // ep, 2 % ep
        bias[target * local:(target + 1) * local] = -30.0
    return bias


def _logits(x: torch.Tensor, seed: int, kind: str, group_rank: int, ep: int) -> torch.Tensor:
    """The router's logits: its weight (E, h) is the same on every rank; the case's bias shifts them."""
    router = rank_tensor(1, (NUM_EXPERTS, HIDDEN), FP32, seed) * 0.7
    return F.linear(x, router.to(x.dtype)) + _bias(kind, group_rank, ep).to(x.dtype)


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
        return self.counts[:, d * self.local:(d + 1) * self.local]

    def outward(self, s: int) -> str:
        """In words, the all-to-all of rank s's T k rows (h fp32 each) to the ranks of their experts."""
        return _collective("all_to_all", sum(self.send(s)) * HIDDEN * 4, self.ep, self.send(s), self.recv(s))

    def homeward(self, s: int) -> str:
        """In words, the reverse one: the rows rank s received, back to the ranks they came from."""
        return _collective("all_to_all", sum(self.recv(s)) * HIDDEN * 4, self.ep, self.recv(s), self.send(s))


def _plan(members: list[int], seed: int, case: tuple) -> _Plan:
    ep, (_, tokens, top_k, _) = len(members), case
    ids = [_expert_ids(_tokens(rank, tokens, seed), seed, case, s, ep) for s, rank in enumerate(members)]
    orders = [i.flatten().argsort(stable=True) for i in ids]
    counts = torch.stack([torch.bincount(i.flatten(), minlength=NUM_EXPERTS) for i in ids])
    return _Plan(ep, top_k, ids, orders, counts)


def _sorted_rows(plan: _Plan, s: int, x: torch.Tensor) -> torch.Tensor:
    """Rank s's rows grouped by expert: token order[i] // k for sorted row i."""
    return x[torch.div(plan.orders[s], plan.top_k, rounding_mode="floor")]


# ---- running the answers on the ranks -----------------------------------------------------------------
def _groups(ep: int) -> list[list[int]]:
    """The ep groups, as global ranks: all 4, or the pairs 0-1 and 2-3."""
    return [list(range(first, first + ep)) for first in range(0, WORLD, ep)]


def _members(ep: int, rank: int) -> list[int]:
    """The global ranks of `rank`'s ep group."""
    return _groups(ep)[rank // ep]


def _all_to_all(blocks: list[torch.Tensor], splits: list[list[int]], i: int) -> torch.Tensor:
    """The all-to-all in one process: what rank i of a group receives when each rank s sends blocks[s] cut into
    splits[s] rows for ranks 0, 1, ... (rank i puts what comes from ranks 0, 1, ... in turn)."""
    return torch.cat([block.split(split)[i] for block, split in zip(blocks, splits)])


def _per_rank(wants: list[dict]) -> dict:
    """What each global rank must observe, one dict a rank, as one list over the ranks a quantity; nothing raised."""
    nothing_raised = {"raised": [""] * WORLD, "backward raised": [""] * WORLD}
    return {key: [want[key] for want in wants] for key in wants[0]} | nothing_raised


def _on_ranks(run_case: Callable) -> Callable:
    """observe(answers, cases) of a check on ranks: one launch runs every answer on every case, each in the group
    of its ep (engine.observe_on_ranks)."""
    return observe_on_ranks(WORLD, run_case, world_and_halves, "ep")


def _route_cases(**columns: Callable) -> list[dict]:
    """The routings in ep = 4, then in ep = 2 (the rows of a table); `columns`: more of them, from the routing."""
    return [dict(ep=ep, case=route[0].format(gap=2 % ep), **{k: f(route) for k, f in columns.items()}, _seed=seed,
                 _route=route) for ep in EP_SIZES for seed, route in enumerate(ROUTE_CASES)]


def _plan_of(case: dict, rank: int) -> _Plan:
    return _plan(_members(case["ep"], rank), case["_seed"], case["_route"])


def _unseen(check: Check) -> dict:
    """A rank's observations before it made any: every quantity None, nothing raised."""
    return dict.fromkeys(check.quantities) | {"raised": "", "backward raised": ""}


def _step(seen: dict, key: str, step: str, fn: Callable, *args, raised_key: str = "raised"):
    """Run one step of the learner's code on this rank: its collectives go to seen[key] in words, the first error
    to seen[raised_key] (NotImplementedError goes through). The splits guard raises on every rank of the group
    together, and a step without collectives fails alone without leaving another rank waiting, so the ranks stay
    in step."""
    with recorded_exchanges(step) as calls:
        try:
            out = fn(*args)
        except NotImplementedError:
            raise
        except SplitsDisagree as e:
            out, seen[raised_key] = None, seen[raised_key] or str(e)
        except Exception as e:  # noqa: BLE001 - observed, with the step and the rank
            out, seen[raised_key] = None, seen[raised_key] or "{} raised {}: {}".format(step, *raised(e))
    seen[key] = [call.said() for call in calls]
    return out


def _backward(seen: dict, group, step: str, y, upstream: torch.Tensor, leaves: dict) -> None:
    """Once every rank of the group has its y (None on a rank that has none: then no rank goes on),
    backpropagate sum(y * upstream): its collectives to seen["backward"], the leaves' gradients to seen."""
    if all_ranks_ok(y is not None, group):
        _step(seen, "backward", f"{step}'s backward", lambda: (y * upstream).sum().backward(),
              raised_key="backward raised")
        seen.update({key: grad_of(t) for key, t in leaves.items()})
        all_ranks_ok(True, group)


def _scored(case: dict, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens x (T, h) of a case in one process, and random router scores (T, E) shifted by its bias."""
    x = rank_tensor(first, (case["T"], HIDDEN), FP32, case["_seed"])
    scores = rank_tensor(first + 10, (case["T"], case["E"]), FP32, case["_seed"])
    for expert, shift in case["_bias"].items():
        scores[:, expert] += shift
    return x, scores


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    """The gradient of a leaf, zeros where nothing reached it (an expert no token chose, a rank that got no row)."""
    return torch.zeros_like(t) if t.grad is None else t.grad


# ---- 1. permute -----------------------------------------------------------------------------------
def _permute_inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, scores = _scored(case, 50)
    return x, scores.topk(case["k"], dim=-1).indices


def _permute_said(got) -> str:
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return _tensor(got)
    return "rows {}, order {}, counts {}".format(_tensor(got[0]), _tensor(got[1], dtype=True), _tensor(got[2]))


def _permute_shapes(slots: int, experts: int = NUM_EXPERTS) -> tuple:
    """A stand-in answer of the right shapes, whose description is the expected one."""
    return torch.empty(slots, HIDDEN), torch.empty(slots, dtype=torch.long), torch.empty(experts)


def _permuted(permute: Callable, case: dict) -> dict:
    x, ids = _permute_inputs(case)
    got = permute(x.requires_grad_(), ids.clone(), case["E"])
    seen = dict.fromkeys(PERMUTE.quantities) | {"returned": _permute_said(got), "_order": None}
    if seen["returned"] != _permute_said(_permute_shapes(ids.numel(), case["E"])):
        return seen
    rows, order, counts = got
    seen.update(order=sorted(order.tolist()), counts=counts.tolist(), grad=rows.requires_grad)
    if seen["order"] == list(range(ids.numel())):
        seen.update(experts=ids.flatten()[order].tolist(), rows=rows.detach().clone(), _order=order.tolist())
        if rows.requires_grad:
            (rows * rank_tensor(70, rows.shape, FP32, 0)).sum().backward()
            seen["x.grad"] = grad_of(x)
    return seen


def _expect_permute(case: dict, seen: dict) -> dict:
    """What rows and x.grad must be follows the answer's own order (any order inside an expert's rows is right)."""
    x, ids = _permute_inputs(case)
    slots = ids.numel()
    token = torch.tensor(seen["_order"] or list(range(slots))) // case["k"]
    return {"returned": _permute_said(_permute_shapes(slots, case["E"])),
            "order": list(range(slots)), "counts": torch.bincount(ids.flatten(), minlength=case["E"]).tolist(),
            "experts": sorted(ids.flatten().tolist()), "rows": x[token], "grad": True,
            "x.grad": torch.zeros_like(x).index_add(0, token, rank_tensor(70, (slots, HIDDEN), FP32, 0))}


def _permute(tokens: torch.Tensor, expert_ids: torch.Tensor, num_experts: int):
    """The correct permute the misconceptions below change (refused as an answer), the demo's too: rows grouped
    by expert (stable), order[i] = slot of row i, counts per expert."""
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


def permute_token_order(tokens, expert_ids, num_experts):
    rows, order, counts = _permute(tokens, expert_ids, num_experts)
    return rows, order // expert_ids.shape[1], counts              # token numbers, not slots


def permute_not_sorted(tokens, expert_ids, num_experts):
    order = torch.arange(expert_ids.numel())                        # slot order, not grouped by expert
    return tokens[order // expert_ids.shape[1]], order, torch.bincount(expert_ids.flatten(), minlength=num_experts)


def permute_rows_by_slot(tokens, expert_ids, num_experts):
    rows, order, counts = _permute(tokens, expert_ids, num_experts)
    return tokens[order.clamp(max=tokens.shape[0] - 1)], order, counts   # indexes tokens with slot numbers


PERMUTE = Check(
    "permute", observe=observe_in_process(_permuted), expect=_expect_permute, course=COURSE, only=ONLY,
    note="one process; tokens (T, h) with requires_grad, expert_ids (T, k). Expected: rows (T k, h) grouped by "
         "expert, rows[i] = tokens[order[i] // k], order a permutation of the slots 0..T k - 1 (slot t k + j = "
         "token t's j-th choice), counts (E,) = rows per expert; rows differentiable",
    cases=[dict(case=name, T=t, k=k, E=e, _seed=seed, _bias=bias)
           for seed, (name, t, k, e, bias) in enumerate(PERMUTE_CASES)],
    columns=lambda case, got: {"counts": got["counts"] or "-"},
    quantities={
        "returned": Said("what permute returned: the three tensors (rows (T k, h), order (T k,) int64, counts (E,): "
                         "one number per expert)"),
        "order": Exact("the slots order holds, sorted (a permutation of the slots 0..T k - 1)"),
        "counts": Exact("counts, the rows each expert gets: torch.bincount(expert_ids.flatten(), "
                        "minlength=num_experts)"),
        "experts": Exact("the experts of rows 0, 1, ... (grouped by expert: expert 0's first)"),
        "rows": Within("rows[i], which must be tokens[order[i] // k]", atol=0.0),
        "grad": Exact("rows require grad"),
        "x.grad": Close("the gradient of the tokens: each slot's gradient adds into its token's", n=ROUNDINGS,
                        dtype=FP32)},
    misconceptions=[
        Misconception(named("permute_counts_without_minlength", lambda tokens, expert_ids, num_experts: (
            *_permute(tokens, expert_ids, num_experts)[:2], torch.bincount(expert_ids.flatten()))),   # no minlength
                      "counts needs one number per expert, 0 for an expert nobody chose (the last ones too): "
                      "torch.bincount(expert_ids.flatten(), minlength=num_experts)"),
        Misconception(permute_token_order, "order looks like token numbers; give slot numbers t*k + j, so that combine "
                                           "finds each slot's gate"),
        Misconception(permute_not_sorted, "the rows are not grouped by expert: sort the slots by expert "
                                          "(expert_ids.flatten().argsort(stable=True))"),
        Misconception(permute_rows_by_slot, "rows[i] must be tokens[order[i] // k] (order holds slots; a slot's token "
                                            "is slot // k)"),
        Misconception(named("permute_detached", lambda tokens, *args: _permute(tokens.detach(), *args)),
                      "rows does not require grad: index the tokens (tokens[index]) so that gradients flow back to "
                      "them; no .detach(), no torch.no_grad()")])


def check_permute(permute: Callable) -> None:
    """rows, order, counts = permute(tokens, expert_ids, num_experts): the T k (token, choice) slots grouped by
    expert (expert 0's first), row i being slot order[i] (token order[i] // k), and the rows per expert."""
    PERMUTE(permute)


# ---- 2. the differentiable all-to-all -------------------------------------------------------------
def _a2a_rows(rank: int, rows: int, trailing: tuple, seed: int) -> torch.Tensor:
    return rank_tensor(400 + rank, (rows, *trailing), FP32, seed)


def _a2a_splits(case: dict, i: int) -> tuple[list, list]:
    """(send, recv) of rank i of the group: the rows it sends to and receives from each rank of it."""
    m = case["_m"]
    return list(m[i]), [m[s][i] for s in range(case["ep"])]


def _a2a_case(AllToAll: type, case: dict, group) -> dict:
    rank, (send, recv) = dist.get_rank(), _a2a_splits(case, dist.get_rank(group))
    x = _a2a_rows(rank, sum(send), case["row"], case["_seed"]).requires_grad_()
    seen = _unseen(ALL_TO_ALL)
    y = _step(seen, "forward", "AllToAll's forward", AllToAll.apply, x, send, recv, group)
    seen.update(returned=_tensor(y, grad=True), y=y.detach().clone() if isinstance(y, torch.Tensor) else None)
    ok = seen["returned"] == _wanted(sum(recv), *case["row"])
    _backward(seen, group, "AllToAll", y if ok else None, _upstream(rank, (sum(recv), *case["row"]), case["_seed"]),
              {"x.grad": x})
    return seen


def _expect_a2a(case: dict, seen: dict) -> dict:
    """Per global rank: the rows and gradients cut and pasted in one process, one all-to-all each way."""
    ep, m, trailing, seed = case["ep"], case["_m"], case["row"], case["_seed"]
    row, received = math.prod(trailing) * 4, [_a2a_splits(case, d)[1] for d in range(ep)]
    wants = []
    for rank in range(WORLD):
        members = _members(ep, rank)
        i = members.index(rank)
        send, recv = _a2a_splits(case, i)
        xs = [_a2a_rows(g, sum(m[s]), trailing, seed) for s, g in enumerate(members)]
        ups = [_upstream(g, (sum(received[d]), *trailing), seed) for d, g in enumerate(members)]
        wants.append({"forward": [_collective("all_to_all", sum(send) * row, ep, send, recv)],
                      "returned": _wanted(sum(recv), *trailing), "y": _all_to_all(xs, m, i).double(),
                      "backward": [_collective("all_to_all", sum(recv) * row, ep, recv, send)],
                      "x.grad": _all_to_all(ups, received, i).double()})
    return _per_rank(wants)


def _exchange(x: torch.Tensor, send: list, recv: list, group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The correct all-to-all the misconceptions below change (refused as an answer)."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.splits
        return _exchange(grad, recv, send, ctx.group), None, None, None


class AllToAllSplitsSwapped(_AllToAll):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), send_splits, recv_splits, group=group)   # output's first
        return out


class AllToAllBackwardNotSwapped(_AllToAll):
    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, *ctx.splits, ctx.group), None, None, None   # the forward's splits, not swapped


class AllToAllIdentityBackward(_AllToAll):
    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None                               # the gradient stays where it is


class AllToAllWholeWorld(_AllToAll):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), None   # forgot group= in backward
        return _exchange(x, send_splits, recv_splits, group)


ALL_TO_ALL = Check(
    "AllToAll", observe=_on_ranks(_a2a_case), expect=_expect_a2a, course=COURSE, only=ONLY,
    note="4 ranks as ep=4 and as 2 groups of ep=2; rank i sends M[i][j] rows to rank j (some send or receive "
         "nothing), backpropagates its own gradient of y. Compared with the rows and gradients cut and pasted "
         "in one process. Forward: one all-to-all of the rows sent; backward: one of the rows received",
    cases=[dict(ep=ep, case=name, row=trailing, _seed=seed, _m=m[ep])
           for ep in EP_SIZES for seed, (name, m, trailing) in enumerate(A2A_CASES)],
    quantities={
        "raised": Said("what AllToAll's forward raised", axes=RANK),
        "forward": Said("the collectives of AllToAll's forward: one all-to-all over the group (group=group), block j "
                        "of x to rank j (send each block of rows to its rank with all_to_all_single)", axes=RANK),
        "returned": Said("what AllToAll.apply returned: a new tensor of the rows this rank receives (sum(recv_splits), "
                         "...), which autograd connects to x (call it as AllToAll.apply(x, ...))", axes=RANK),
        "y": Close("y, the rows received: rank j puts what it receives from ranks 0, 1, ... in turn, and rank i's rows "
                   "for rank j are its consecutive block j (blocks of send_splits[0], send_splits[1], ... rows)",
                   n=ROUNDINGS, dtype=FP32, axes=RANK),
        "backward raised": Said("what AllToAll's backward raised", axes=RANK),
        "backward": Said("the collectives of AllToAll's backward: one all-to-all over the group, the reverse one, "
                         "with the send and receive splits swapped, so each row's gradient goes back to the rank "
                         "the row came from", axes=RANK),
        "x.grad": Close("x.grad: row r is the gradient of the row that x's row r became on the rank it was sent to "
                        "(backward returns it first, then None for the splits and the group)", n=ROUNDINGS,
                        dtype=FP32, axes=RANK)},
    misconceptions=[
        Misconception(AllToAllSplitsSwapped, "input_split_sizes and output_split_sizes are swapped: all_to_all_single "
                      "takes the output first, (output, input, output_split_sizes=recv_splits, "
                      "input_split_sizes=send_splits)"),
        Misconception(AllToAllWholeWorld, "backward's all-to-all ran over every rank, not the ranks of the group: "
                                          "keep the group on ctx and pass group=group to the collective"),
        Misconception(AllToAllBackwardNotSwapped, "backward sent the gradients with the forward's splits: send "
                      "each row's gradient back to the rank the row came from, the reverse all-to-all, with the "
                      "send and receive splits swapped"),
        Misconception(AllToAllIdentityBackward, "backward made no collective, so each gradient stayed on the rank "
                      "that received its row: send each row's gradient back to the rank the row came from (the "
                      "reverse all-to-all, the splits swapped)")])


def check_all_to_all(AllToAll: type) -> None:
    """y = AllToAll.apply(x, send_splits, recv_splits, group): rank i's rows [sum send[:j], sum send[:j+1])
    go to rank j, which puts what it receives from ranks 0, 1, ... in turn; one all-to-all each way,
    backward the reverse one (each row's gradient goes back to the rank the row came from)."""
    ALL_TO_ALL(AllToAll)


# ---- 3. dispatch ----------------------------------------------------------------------------------
def _dispatch_said(got) -> str:
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return _tensor(got)
    received, counts, splits = got
    try:
        send, recv = ([int(v) for v in split] for split in splits)
        pair = f"(send, recv) of {len(send)} and {len(recv)} ints"
    except (TypeError, ValueError):
        pair = f"splits {_tensor(splits)}, not a pair (send, recv) of lists of ints"
    return f"received {_tensor(received, grad=True)}, received_counts {_tensor(counts)}, {pair}"


def _dispatch_shapes(plan: _Plan, i: int) -> tuple:
    """A stand-in of what rank i's dispatch returns, of the right shapes (its description is the expected one)."""
    return (torch.empty(sum(plan.recv(i)), HIDDEN, requires_grad=True), torch.empty(plan.ep, plan.local),
            (plan.send(i), plan.recv(i)))


def _dispatched(dispatch: Callable, case: dict, group) -> dict:
    rank, i, seed = dist.get_rank(), dist.get_rank(group), case["_seed"]
    plan = _plan_of(case, rank)
    rows = _sorted_rows(plan, i, _tokens(rank, case["_route"][1], seed)).clone().requires_grad_()  # (T k, h)
    seen = _unseen(DISPATCH)
    got = _step(seen, "forward", "dispatch", dispatch, rows, plan.counts[i].clone(), group)
    seen["returned"] = _dispatch_said(got)
    ok = seen["returned"] == _dispatch_said(_dispatch_shapes(plan, i))
    if ok:
        received, counts, splits = got
        seen.update(received_counts=counts.long().tolist(), splits=[[int(v) for v in s] for s in splits],
                    received=received.detach().clone())
    _backward(seen, group, "dispatch", got[0] if ok else None, _upstream(rank, (sum(plan.recv(i)), HIDDEN), seed),
              {"rows.grad": rows})
    return seen


def _expect_dispatch(case: dict, seen: dict) -> dict:
    """Per global rank: what dispatch must receive, return, send and hand back, from the plan of its group."""
    tokens, seed, ep, wants = case["_route"][1], case["_seed"], case["ep"], []
    for rank in range(WORLD):
        members, plan = _members(ep, rank), _plan_of(case, rank)
        i = members.index(rank)
        rows = [_sorted_rows(plan, s, _tokens(g, tokens, seed)) for s, g in enumerate(members)]
        ups = [_upstream(g, (sum(plan.recv(d)), HIDDEN), seed) for d, g in enumerate(members)]
        wants.append({"forward": _dispatch_collectives(plan, i), "returned": _dispatch_said(_dispatch_shapes(plan, i)),
                      "received_counts": plan.received_counts(i).tolist(), "splits": [plan.send(i), plan.recv(i)],
                      "received": _all_to_all(rows, [plan.send(s) for s in range(ep)], i).double(),
                      "backward": [plan.homeward(i)],   # rows.grad: in the order of the sorted rows, as they went
                      "rows.grad": _all_to_all(ups, [plan.recv(d) for d in range(ep)], i).double()})
    return _per_rank(wants)


def _dispatch_collectives(plan: _Plan, i: int) -> list[str]:
    """An all-to-all of the E counts (E/ep to each rank), then one of exactly rank i's T k rows."""
    local = [plan.local] * plan.ep
    return [_collective("all_to_all", NUM_EXPERTS * 8, plan.ep, local, local), plan.outward(i)]


def _exchange_counts(counts: torch.Tensor, group) -> tuple[torch.Tensor, list, list]:
    """The counts' all-to-all: received_counts (ep, E/ep), and the splits (send, recv) of the rows."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, -1)
    return received, counts.view(ep, -1).sum(1).tolist(), received.sum(1).tolist()


def _dispatch(rows, counts, group):
    """The correct dispatch the misconceptions below change (refused as an answer)."""
    received_counts, send, recv = _exchange_counts(counts, group)
    return _AllToAll.apply(rows, send, recv, group), received_counts, (send, recv)


def dispatch_splits_swapped(rows, counts, group):
    received_counts, send, recv = _exchange_counts(counts, group)
    return _AllToAll.apply(rows, recv, send, group), received_counts, (send, recv)   # send and recv swapped


def dispatch_no_counts_exchange(rows, counts, group):
    """Assumes every rank sends it as many rows as it sends that rank."""
    send = counts.view(dist.get_world_size(group), -1).sum(1).tolist()
    return _AllToAll.apply(rows, send, send, group), counts.view(len(send), -1), (send, send)


def dispatch_even_splits(rows, counts, group):
    """No counts exchange, no splits: every rank sends T k / ep rows to every rank."""
    ep = dist.get_world_size(group)
    received = torch.empty_like(rows)
    dist.all_to_all_single(received, rows.detach(), group=group)
    even = [rows.shape[0] // ep] * ep
    return received.requires_grad_(), counts.view(ep, -1), (even, even)


def dispatch_padded(rows, counts, group, to_largest=False):
    """Every block padded to the most a block could be, T k rows (to_largest: to the group's largest block, found
    by an all-reduce MAX), one even all-to-all, unpadded after."""
    received_counts, send, recv = _exchange_counts(counts, group)
    ep, cap = len(send), torch.tensor(max(send) if to_largest else sum(send))
    if to_largest:
        dist.all_reduce(cap, op=dist.ReduceOp.MAX, group=group)
    cap = int(cap)
    padded = rows.new_zeros(ep * cap, rows.shape[1])
    for j, block in enumerate(rows.split(send)):
        padded[j * cap:j * cap + len(block)] = block
    out = _AllToAll.apply(padded, [cap] * ep, [cap] * ep, group)
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


def dispatch_returns_recv_send(rows, counts, group):
    received, received_counts, (send, recv) = _dispatch(rows, counts, group)
    return received, received_counts, (recv, send)


def dispatch_own_counts(rows, counts, group):
    received, _, splits = _dispatch(rows, counts, group)
    return received, counts.view(dist.get_world_size(group), -1), splits   # this rank's counts, not received ones


def dispatch_not_differentiable(rows, counts, group):
    received, received_counts, splits = _dispatch(rows, counts, group)
    return received.detach(), received_counts, splits


DISPATCH = Check(
    "dispatch", observe=_on_ranks(_dispatched), expect=_expect_dispatch, course=COURSE, only=ONLY,
    note="4 ranks as ep=4 and as 2 groups of ep=2; E = 8 experts, rank r of a group holds [r E/ep, (r+1) E/ep). "
         "Each rank's T k rows come sorted by expert with their counts (E,); it backpropagates its own gradient "
         "of the rows received. Compared with the rows cut and pasted in one process",
    cases=_route_cases(),
    quantities={
        "raised": Said("what dispatch raised", axes=RANK),
        "forward": Said("the collectives of dispatch: two all-to-alls over the group and nothing else, first the E "
                        "counts (each rank learns how many rows it will receive from every rank), then exactly the "
                        "rows routed, with uneven splits", axes=RANK),
        "returned": Said("what dispatch returned: received (rows received, h), requiring grad (sent with "
                         "AllToAll.apply), received_counts (ep, E/ep) and the splits (send, recv), a number per rank "
                         "of the group", axes=RANK),
        "received_counts": Exact("received_counts: row s holds rank s's counts for this rank's experts, as the "
                                 "counts' all-to-all delivers them", axes=RANK),
        "splits": Exact("the splits (send, recv): the rows sent to and received from each rank", axes=RANK),
        "received": Close("the received rows: rank d gets the rows of rank 0 for its experts, then rank 1's, ..., "
                          "each block in the order its sender sorted them", n=ROUNDINGS, dtype=FP32, axes=RANK),
        "backward raised": Said("what dispatch's backward raised", axes=RANK),
        "backward": Said("the collectives of dispatch's backward: the gradient of each received row goes back to the "
                         "rank it came from, by the reverse all-to-all: send the rows with AllToAll.apply, whose "
                         "backward does that (a plain dist.all_to_all_single is invisible to autograd)", axes=RANK),
        "rows.grad": Close("rows.grad: each row's gradient comes back from the rank it was sent to (AllToAll's "
                           "backward; send the rows with AllToAll.apply)", n=ROUNDINGS, dtype=FP32, axes=RANK)},
    misconceptions=[
        Misconception(dispatch_all_gather, "it gathers every rank's tokens: each rank would receive all ep x T k "
                      "rows and keep the few for its experts. An all-to-all sends each row only to the rank that "
                      "needs it"),
        Misconception(dispatch_padded, "send exactly the rows routed, with uneven splits. Padding every split to the "
                      "same size (as a fixed capacity does) sends padding through the network"),
        Misconception(named("dispatch_padded_to_max", functools.partial(dispatch_padded, to_largest=True)),
                      "send exactly the rows routed, with uneven splits. Padding every split to the group's largest "
                      "(found by an all-reduce) still sends padding through the network"),
        Misconception(named("dispatch_whole_world", lambda rows, counts, group: _dispatch(rows, counts, None)),
                      "an all-to-all ran over the whole world, not the ranks of the group: pass group=group to every "
                      "collective"),
        Misconception(dispatch_no_counts_exchange, "no exchange of the counts first. A rank cannot know how many "
                      f"rows the others will send it: start with an all-to-all of the E = {NUM_EXPERTS} per-expert "
                      "counts (rank j gets the counts of its own experts from every rank), then size the rows' "
                      "all-to-all with them"),
        Misconception(dispatch_even_splits, "no exchange of the counts first, and no split sizes: an all-to-all "
                      "without them sends every rank the same number of rows. Exchange the E per-expert counts "
                      "first, then send the rows with the split sizes they give"),
        Misconception(dispatch_splits_swapped, "the rows' input and output split sizes look swapped: the rows this "
                      "rank sends come from its own counts, the rows it receives from the counts the others sent "
                      f"it. {SPLIT_RULE}"),
        Misconception(dispatch_own_counts, "received_counts is this rank's own counts: that is what this rank sends; "
                      "after the all-to-all of the counts, row s holds what rank s sends to this rank"),
        Misconception(dispatch_returns_recv_send, "the splits are returned swapped: return (send, recv), the rows "
                                                  "sent to and received from each rank"),
        Misconception(dispatch_not_differentiable, "the received rows do not require grad: send them with "
                      "AllToAll.apply, whose backward brings the gradients back (dist.all_to_all_single alone is "
                      "invisible to autograd)")])


def check_dispatch(dispatch: Callable) -> None:
    """received, received_counts, (send, recv) = dispatch(rows, counts, group): an all-to-all of the E counts,
    then one of exactly the rows routed; rank d gets, from ranks 0, 1, ... in turn, their rows for its experts."""
    DISPATCH(dispatch)


# ---- 4. combine -----------------------------------------------------------------------------------
def _expert_out(rank: int, rows: int, seed: int) -> torch.Tensor:
    """Stand-in outputs of this rank's experts for the rows it received, (R, h)."""
    return rank_tensor(500 + rank, (rows, HIDDEN), FP32, seed)


def _random_gates(rank: int, tokens: int, top_k: int, seed: int) -> torch.Tensor:
    return rank_tensor(600 + rank, (tokens, top_k), FP32, seed).softmax(-1)


def _combined(combine: Callable, case: dict, group) -> dict:
    rank, i, seed, (_, tokens, top_k, _) = dist.get_rank(), dist.get_rank(group), case["_seed"], case["_route"]
    plan = _plan_of(case, rank)
    expert_out = _expert_out(rank, sum(plan.recv(i)), seed).requires_grad_()   # (R, h)
    gates = _random_gates(rank, tokens, top_k, seed).requires_grad_()         # (T, k)
    seen = _unseen(COMBINE)
    y = _step(seen, "forward", "combine", combine, expert_out, (plan.send(i), plan.recv(i)), plan.orders[i].clone(),
              gates, group)
    seen.update(returned=_tensor(y, grad=True), y=y.detach().clone() if isinstance(y, torch.Tensor) else None)
    ok = seen["returned"] == _wanted(tokens, HIDDEN)
    _backward(seen, group, "combine", y if ok else None, _upstream(rank, (tokens, HIDDEN), seed),
              {"expert_out.grad": expert_out, "gates.grad": gates})
    return seen


def _expect_combine(case: dict, seen: dict) -> dict:
    """y and its gradients per global rank, from a loop over every token's k slots in float64."""
    (_, tokens, top_k, _), seed, ep = case["_route"], case["_seed"], case["ep"]
    wants = []
    for members in _groups(ep):
        plan = _plan(members, seed, case["_route"])
        outs = [_expert_out(g, sum(plan.recv(d)), seed).double().requires_grad_() for d, g in enumerate(members)]
        gates = [_random_gates(g, tokens, top_k, seed).double().requires_grad_() for g in members]
        ys = []
        for s in range(ep):   # the outputs of rank s's slots come home in its sorted rows' order; in slot order:
            slot_out = _all_to_all(outs, [plan.recv(d) for d in range(ep)], s)[plan.orders[s].argsort()]  # (T k, h)
            ys.append(torch.stack([sum(gates[s][t, j] * slot_out[t * top_k + j] for j in range(top_k))
                                   for t in range(tokens)]))                                       # (T, h)
        sum((y * _upstream(g, tuple(y.shape), seed).double()).sum() for y, g in zip(ys, members)).backward()
        wants += [{"forward": [plan.homeward(s)], "returned": _wanted(tokens, HIDDEN), "y": ys[s].detach(),
                   "backward": [plan.outward(s)], "gates.grad": _grad_or_zeros(gates[s]),
                   "expert_out.grad": _grad_or_zeros(outs[s])} for s in range(ep)]   # received nothing: (0, h)
    return _per_rank(wants)


def _combine(expert_out, splits, order, gates, group, unpermute=_unpermute):
    """The correct combine the misconceptions below change (refused as an answer); some, its `unpermute`."""
    send, recv = splits
    return unpermute(_AllToAll.apply(expert_out, recv, send, group), order, gates)


def combine_not_unpermuted(expert_out, splits, order, gates, group):
    return _combine(expert_out, splits, order, gates, group,            # the rows still in the experts' order
                    unpermute=lambda back, order, gates: (back.view(*gates.shape, -1) * gates.unsqueeze(-1)).sum(1))


def combine_gates_in_slot_order(expert_out, splits, order, gates, group):
    send, recv = splits
    back = _AllToAll.apply(expert_out, recv, send, group)
    weighted = back * gates.reshape(-1).unsqueeze(-1)                    # gates not permuted like the rows
    return back.new_zeros(gates.shape[0], back.shape[1]).index_add(0, order // gates.shape[1], weighted)


def combine_detached_gates(expert_out, splits, order, gates, group):
    return _combine(expert_out, splits, order, gates.detach(), group)


COMBINE = Check(
    "combine", observe=_on_ranks(_combined), expect=_expect_combine, course=COURSE, only=ONLY,
    note="4 ranks as ep=4 and as 2 groups of ep=2; expert_out (R, h) on each rank stands for its experts' outputs "
         "of the rows it received; the splits and order are those of the dispatch. Compared with the sum over "
         "every token's k slots in one process (float64). Forward: one all-to-all of the R rows; backward: one "
         "of the T k rows",
    cases=_route_cases(),
    quantities={
        "raised": Said("what combine raised", axes=RANK),
        "forward": Said("the collectives of combine: one all-to-all over the group (group=group) and nothing else, the "
                        "reverse of "
                        "the dispatch's (send what the dispatch received, receive what it sent), so each expert "
                        "output goes back only to the rank that owns its token", axes=RANK),
        "returned": Said("what combine returned: y (tokens, h), requiring grad (keep expert_out and the gates in "
                         "the graph: AllToAll.apply, no .detach())", axes=RANK),
        "y": Close("y: y[t] = sum_j gates[t, j] x (output of slot t k + j)", n=ROUNDINGS, dtype=FP32, axes=RANK),
        "backward raised": Said("what combine's backward raised", axes=RANK),
        "backward": Said("the collectives of combine's backward: the reverse all-to-all of the T k slots' gradients "
                         "(AllToAll's backward), back to the ranks whose experts made the outputs", axes=RANK),
        "expert_out.grad": Close("expert_out.grad: each slot's gradient (gate x gradient of its token's y) goes back "
                                 "to the rank whose expert made it (bring the rows back with AllToAll.apply, a "
                                 "differentiable all-to-all, not dist.all_to_all_single alone)", n=ROUNDINGS,
                                 dtype=FP32, axes=RANK),
        "gates.grad": Close("gates.grad: d y[t] / d gates[t, j] is the output of slot t k + j", n=ROUNDINGS,
                            dtype=FP32, axes=RANK)},
    misconceptions=[
        Misconception(named("combine_no_all_to_all", lambda out, splits, order, gates, group: _unpermute(
                          out, order, gates)),   # out: what this rank's experts made, not this rank's slots
                      "no reverse all-to-all. expert_out holds what this rank's experts computed for every rank's rows "
                      "(in the order they arrived), not this rank's own slots: send them back first, with the splits "
                      "of the dispatch swapped (send what was received, receive what was sent)"),
        Misconception(named("combine_splits_not_reversed", lambda out, splits, order, gates, group: _unpermute(
                          _AllToAll.apply(out, *splits, group), order, gates)),   # the dispatch's splits
                      "the all-to-all used the dispatch's splits as they are: the reverse of the dispatch sends what "
                      "the dispatch received (recv) and receives what it sent (send)"),
        Misconception(named("combine_no_gates", lambda *args: _combine(*args, unpermute=lambda back, order, gates: (
                          _unpermute(back, order, torch.ones_like(gates)) + 0 * gates.sum()))),
                      "the gates are not applied: weight each slot's output by its gate, gates.flatten()[order] for "
                      "the rows in the experts' order"),
        Misconception(combine_not_unpermuted, "the rows are still in the experts' order: row i belongs to slot "
                                              "order[i], token order[i] // k; un-permute before summing per token"),
        Misconception(combine_gates_in_slot_order, "the rows are un-permuted but the gates are not: row i's gate is "
                                                   "gates.flatten()[order[i]]"),
        Misconception(named("combine_plain_all_to_all", lambda out, splits, order, gates, group: _unpermute(
                          _exchange(out.detach(), *splits[::-1], group), order, gates)),   # invisible to autograd
                      "combine's backward made no collective: the gradient of each slot's output must go back to the "
                      "rank whose expert made it. Bring the outputs home with AllToAll.apply, whose backward does "
                      "that (a plain dist.all_to_all_single is invisible to autograd)"),
        Misconception(combine_detached_gates, "the gates got no gradient: do not detach them, the router learns "
                                              "through them")])


def check_combine(combine: Callable) -> None:
    """y = combine(expert_out, (send, recv), order, gates, group): the reverse all-to-all brings every slot's
    expert output home; y[t] = sum_j gates[t, j] x (output of slot t k + j); gradients flow to expert_out
    (back through the all-to-all) and to the gates."""
    COMBINE(combine)


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
        ys.append(torch.stack([sum(gates[t, j] * _expert(x[t], *weights[int(chosen[t, j])]) for j in range(top_k))
                               for t in range(len(x))]))               # (T, h)
    sum((y * up.double()).sum() for y, up in zip(ys, upstreams)).backward()
    return ([y.detach() for y in ys], [_grad_or_zeros(x) for x in leaves],
            [(_grad_or_zeros(w_in), _grad_or_zeros(w_out)) for w_in, w_out in weights])   # an unused expert: zeros


def _run_local_experts(received: torch.Tensor, received_counts: torch.Tensor, weights: list) -> torch.Tensor:
    """The check's own expert step: regroup the received rows by local expert, run each, restore the order."""
    ep, local = received_counts.shape
    expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(received_counts.flatten().long())   # (R,)
    by_expert = expert_of_row.argsort(stable=True)
    blocks = received[by_expert].split(received_counts.sum(0).tolist())
    outputs = torch.cat([_expert(block, *w) for block, w in zip(blocks, weights)])
    return outputs[by_expert.argsort()]


def _layer_returned(parts: list[str]) -> str:
    return "; ".join(f"{name}: {said}" for name, said in zip(("permute", "dispatch", "combine"), parts))


def _layer_on_rank(answer: tuple, case: dict, group) -> dict:
    """permute, dispatch, the check's local experts, combine; each step once every rank of the group has what it
    needs (a step skipped on one rank is skipped on all)."""
    permute, dispatch, combine = answer
    rank, i, ep, seed, route = dist.get_rank(), dist.get_rank(group), case["ep"], case["_seed"], case["_route"]
    plan, local = _plan_of(case, rank), NUM_EXPERTS // ep
    x = _tokens(rank, route[1], seed).requires_grad_()                              # (T, h)
    ids = _expert_ids(x, seed, route, i, ep)                                         # (T, k)
    gates = _gates(x, ids, seed, route[3], i, ep)                                    # (T, k), through the router
    weights = [tuple(w.requires_grad_() for w in _expert_weights(e, seed)) for e in range(i * local, (i + 1) * local)]
    seen, said = _unseen(MOE), []
    got = _step(seen, "permute", "permute", permute, x, ids.clone(), NUM_EXPERTS)
    said.append(_permute_said(got))
    if all_ranks_ok(said[-1] == _permute_said(_permute_shapes(x.shape[0] * route[2])), group):
        rows, order, counts = got
        got = _step(seen, "dispatch", "dispatch", dispatch, rows, counts, group)
        said.append(_dispatch_said(got))
        expert_out = None
        if said[-1] == _dispatch_said(_dispatch_shapes(plan, i)):
            received, received_counts, splits = got
            seen["received_counts"] = received_counts.long().tolist()
            if received_counts.min() >= 0 and received_counts.sum() == len(received):   # else they differ, and no
                expert_out = _run_local_experts(received, received_counts, weights)      # rank goes on
        if all_ranks_ok(expert_out is not None, group):
            y = _step(seen, "combine", "combine", combine, expert_out, splits, order, gates, group)
            said.append(_tensor(y, grad=True))
            ok = said[-1] == _wanted(*x.shape)
            seen["y"] = y.detach().clone() if ok else None
            _backward(seen, group, "the layer", y if ok else None, _upstream(rank, tuple(x.shape), seed, which=1),
                      {"x.grad": x})
            seen["expert grads"] = [[grad_of(w_in), grad_of(w_out)] for w_in, w_out in weights]
    seen.update(returned=_layer_returned(said), _steps=len(said))
    return seen


def _expect_layer(case: dict, seen: dict) -> dict:
    """Per global rank, from the dense loop. A step that did not run (an earlier one failed, on this rank or
    another of its group) has no collectives nor result to compare: what stopped it is the difference."""
    (_, tokens, top_k, _), seed, ep = case["_route"], case["_seed"], case["ep"]
    wants = []
    for members in _groups(ep):
        plan = _plan(members, seed, case["_route"])
        ups = [_upstream(g, (tokens, HIDDEN), seed, which=1) for g in members]
        ys, x_grads, w_grads = dense_moe([_tokens(g, tokens, seed) for g in members], plan.ids, seed, case["_route"],
                                         ups)
        for s, rank in enumerate(members):
            returned = [_permute_said(_permute_shapes(tokens * top_k)), _dispatch_said(_dispatch_shapes(plan, s)),
                        _wanted(tokens, HIDDEN)][:seen["_steps"][rank]]
            wants.append({"permute": [], "dispatch": _dispatch_collectives(plan, s), "combine": [plan.homeward(s)],
                          "returned": _layer_returned(returned), "received_counts": plan.received_counts(s).tolist(),
                          "y": ys[s], "backward": [plan.outward(s), plan.homeward(s)], "x.grad": x_grads[s],
                          "expert grads": [list(pair) for pair in w_grads[s * plan.local:(s + 1) * plan.local]]})
    want = _per_rank(wants)
    for phase in ("dispatch", "combine"):
        want[phase] = [w if got is not None else None for w, got in zip(want[phase], seen[phase])]
    return want


MOE = Check(
    "expert-parallel MoE layer", observe=_on_ranks(_layer_on_rank), expect=_expect_layer, course=COURSE, only=ONLY,
    note="4 ranks as ep=4 and as 2 groups of ep=2; each rank routes its own tokens with the same router (top-k "
         "softmax gates), runs permute, dispatch, its E/ep experts (the check's code) and combine, and "
         "backpropagates its own gradient of y. Compared with a loop over every token and its k experts in one "
         "process (float64). Forward: all-to-alls of the counts, the rows, the outputs; backward: two",
    cases=_route_cases(k=lambda route: route[2]),
    columns=lambda case, got: {"rows per expert (rank 0's group)": _plan_of(case, 0).counts.sum(0).tolist()},
    quantities={
        "raised": Said("what a step of the layer raised", axes=RANK),
        "permute": Said("the collectives of permute: none, it works on this rank's own tokens", axes=RANK),
        "dispatch": Said("the collectives of dispatch: an all-to-all of the E counts, then one of exactly the rows "
                         "routed (check_dispatch tells more)", axes=RANK),
        "combine": Said("the collectives of combine: one all-to-all, the reverse of the dispatch's rows "
                        "(check_combine tells more)", axes=RANK),
        "returned": Said("what permute, dispatch and combine returned: (rows (T k, h), order (T k,), counts (E,)), "
                         "(received, received_counts (ep, E/ep), (send, recv)), y (T, h) with a grad_fn", axes=RANK),
        "received_counts": Exact("received_counts: row s holds rank s's counts for this rank's experts", axes=RANK),
        "y": Close("y: check_permute, check_dispatch and check_combine should pass first", n=ROUNDINGS, dtype=FP32,
                   axes=RANK),
        "backward raised": Said("what the layer's backward raised", axes=RANK),
        "backward": Said("the collectives of the backward: the reverse of combine's all-to-all (the gradients of "
                         "the slots' outputs, back to the experts' ranks), then of dispatch's (the gradients of the "
                         "received rows, back to their tokens' ranks)", axes=RANK),
        "x.grad": Close("x.grad, through the rows and through the gates (which must stay differentiable: the router "
                        "learns through them)", n=ROUNDINGS, dtype=FP32, axes=RANK),
        "expert grads": Close("the local experts' weight gradients: an expert's gradient sums over the rows of every "
                              "rank it received, and their gradients come back through combine's all-to-all",
                              n=ROUNDINGS, dtype=FP32, axes=("rank {}", "local expert {}", "[w_in, w_out][{}]"))},
    misconceptions=[
        Misconception((_permute, dispatch_padded, _combine), "dispatch pads every split to the same size, as "
                      "a fixed capacity does, and so sends padding through the network: send exactly the rows "
                      "routed, with uneven splits"),
        Misconception((_permute, dispatch_own_counts, _combine), "dispatch returns this rank's own counts as "
                      "received_counts: after the all-to-all of the counts, row s holds what rank s sends to this "
                      "rank (check_dispatch tells more)"),
        Misconception((_permute, _dispatch, combine_not_unpermuted), "y is wrong although the collectives "
                      "are right: check_permute, check_dispatch and check_combine should pass first (here combine "
                      "leaves the rows in the experts' order)"),
        Misconception((_permute, _dispatch, combine_detached_gates), "x.grad misses the router's part: the "
                      "gates must stay differentiable (the router learns through them)")])


def check_expert_parallel_moe(permute: Callable, dispatch: Callable, combine: Callable) -> None:
    """The whole layer on each rank, router and experts included: permute, dispatch, the local experts on
    what arrived, combine. y, x.grad and every expert's weight gradients equal the dense loop over tokens."""
    MOE((permute, dispatch, combine))


# ---- 6. predict, then run: expert outputs that never went home ------------------------------------
# A layer in one process (ep = 1: both all-to-alls send nothing anywhere), built the assignment's way:
# route, permute, one matmul per expert, then an `unpermute(outputs, order, gates)` that puts each row
# back in its token. The demo runs a given unpermute beside the right one (the check's own).
DEMO_TOKENS, DEMO_EXPERTS, DEMO_TOP_K = 16, 4, 2     # the one-layer look: 16 tokens, 4 experts, top-2
DEMO_LM = dict(hidden_size=64, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_seq_len=64)                       # a small causal LM whose MLPs are MoE layers
DEMO_STEPS, DEMO_BATCH, DEMO_SEQ, DEMO_LR = 100, 8, 32, 3e-3
DEMO_CUT = 5                                         # the position whose output must not see the tokens after it


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


def _capacity_inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, h), expert_ids (T, k) (the top-k of random scores, shifted by the case's bias), gates (T, k)."""
    x, scores = _scored(case, 700)
    top, ids = scores.softmax(-1).topk(case["k"], dim=-1)
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


def _capacity_said(got) -> str:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        return _tensor(got)
    return f"out {_tensor(got[0])}, kept {_tensor(got[1], dtype=True)}"


def _capacity_seen(capacity_moe: Callable, case: dict) -> dict:
    x, ids, gates = (t.requires_grad_(t.is_floating_point()) for t in _capacity_inputs(case))
    experts = [_RecordingExpert(e, case["_seed"]) for e in range(case["E"])]
    got = capacity_moe(x, ids.clone(), gates, experts, case["_factor"])
    seen = dict.fromkeys(CAPACITY.quantities) | {"returned": _capacity_said(got), "_per_expert": "-"}
    if seen["returned"] == _capacity_said((x, ids.bool())):
        out, kept = got
        seen.update(kept=kept.tolist(), _per_expert=torch.bincount(ids[kept], minlength=case["E"]).tolist(),
                    calls=[expert.calls for expert in experts], out=out.detach().clone())
        if out.requires_grad:
            (out * _upstream(0, tuple(out.shape), case["_seed"], which=7)).sum().backward()
        seen.update({"x.grad": grad_of(x), "gates.grad": grad_of(gates),
                     "weight grads": [[_grad_or_zeros(e.w_in), _grad_or_zeros(e.w_out)] for e in experts]})
    return seen


def _capacity_layer(x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor, experts: list,
                    kept: torch.Tensor) -> torch.Tensor:
    """out[t] = x[t] + sum over the kept slots j of gates[t, j] experts[ids[t, j]](x[t]), token by token: the
    reference's plain loop, and a misconception's (an expert called once per slot, on one row)."""
    return torch.stack([sum((gates[t, j] * experts[int(ids[t, j])](x[t:t + 1])[0] for j in range(ids.shape[1])
                             if kept[t, j]), x[t]) for t in range(len(x))])


def _expect_capacity(case: dict, seen: dict) -> dict:
    """The task's rule in float64, with autograd. An expert is called once, on its kept rows or a buffer of C."""
    x, ids, gates = _capacity_inputs(case)
    kept = _kept_by_rule(ids, case["E"], case["C"])
    x64, g64 = x.double().requires_grad_(), gates.double().requires_grad_()
    w64 = [tuple(w.double().requires_grad_() for w in _expert_weights(e, case["_seed"])) for e in range(case["E"])]
    out = _capacity_layer(x64, ids, g64, [functools.partial(_expert, w_in=a, w_out=b) for a, b in w64], kept)
    (out * _upstream(0, tuple(out.shape), case["_seed"], which=7).double()).sum().backward()
    rows = torch.bincount(ids[kept], minlength=case["E"]).tolist()
    calls = [got if got in ([n], [case["C"]]) or (not n and got in ([], [0])) else [n] if n else []
             for n, got in zip(rows, seen["calls"] or [None] * case["E"])]
    return {"returned": _capacity_said((x, kept)), "kept": kept.tolist(), "calls": calls, "out": out.detach(),
            "x.grad": x64.grad, "gates.grad": _grad_or_zeros(g64),
            "weight grads": [[_grad_or_zeros(a), _grad_or_zeros(b)] for a, b in w64]}


def _capacity_moe(x, expert_ids, gates, experts, capacity_factor, capacity=_capacity_of, priority="choice",
                  residual=True, gated=lambda gates, kept: gates, every_slot=False, shown=lambda kept: kept):
    """The correct layer the misconceptions below change (refused as an answer): each expert called once, on its
    kept rows. A misconception makes one of its choices otherwise."""
    tokens, top_k = expert_ids.shape
    kept = _kept_by_rule(expert_ids, len(experts), capacity(tokens, top_k, len(experts), capacity_factor), priority)
    gates, out = gated(gates, kept), x if residual else torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, choice = ((kept | every_slot) & (expert_ids == e)).nonzero(as_tuple=True)
        if len(token):
            out = out.index_add(0, token, gates[token, choice].unsqueeze(-1) * expert(x[token]))
    return out, shown(kept)


def capacity_token_by_token(x, expert_ids, gates, experts, capacity_factor):
    kept = _kept_by_rule(expert_ids, len(experts), _capacity_of(*expert_ids.shape, len(experts), capacity_factor))
    return _capacity_layer(x, expert_ids, gates, experts, kept), kept          # one expert call per kept slot


def _variant(name: str, **choices) -> Callable:
    """A misconception's answer: _capacity_moe, the correct code, with some of its choices made otherwise."""
    return named(name, functools.partial(_capacity_moe, **choices))


CAPACITY = Check(
    "capacity_moe", observe=observe_in_process(_capacity_seen), expect=_expect_capacity, course=COURSE, only=ONLY,
    note="one process; x (T, h), expert_ids (T, k), gates (T, k), experts: E functions (n, h) -> (n, h) that note "
         "their calls. Compared with a loop over the slots in priority order and over the tokens (float64); "
         "gradients of sum(out * u) for a fixed u. per expert: kept slots of experts 0, 1, ...",
    cases=[dict(case=name, T=t, k=k, E=e, factor=str(f), C=_capacity_of(t, k, e, f), _factor=f, _seed=seed,
                _bias=bias) for seed, (name, t, k, e, f, bias) in enumerate(CAPACITY_CASES)],
    columns=lambda case, got: {"per expert": got["_per_expert"]},
    quantities={
        "returned": Said("what capacity_moe returned: the pair (out (T, h), kept (T, k) of torch.bool)"),
        "kept": Exact("the kept slots, token by token: each expert keeps its first C slots in the priority order "
                      "(choice 0, token 0), (0, 1), ..., (0, T-1), (1, 0), ...", axes=("token {}",)),
        "calls": Exact("the rows each expert was called on, call by call: once, on one block of exactly its kept "
                       "rows (or a buffer of C rows)", axes=("expert {}",)),
        "out": Close("out: out[t] = x[t] + sum over the kept slots j of gates[t, j] expert(x[t])", n=ROUNDINGS,
                     dtype=FP32),
        "x.grad": Close("x.grad (out must require grad: keep x, the gates and the experts' outputs in the graph, no "
                        ".detach()): a dropped slot gets no gradient; the residual gives every token's x a gradient "
                        "of its own", n=ROUNDINGS, dtype=FP32),
        "gates.grad": Close("gates.grad: d out[t] / d gates[t, j] is expert(x[t]) for a kept slot, 0 for a dropped "
                            "one", n=ROUNDINGS, dtype=FP32),
        "weight grads": Close("the experts' weight gradients: each sums over its expert's kept rows only", n=ROUNDINGS,
                              dtype=FP32, axes=("expert {}", "[w_in, w_out][{}]"))},
    misconceptions=[
        Misconception(_variant("capacity_kept_as_ints", shown=lambda kept: kept.long()),
                      "return kept as a tensor of bools (torch.bool), True for a kept slot"),
        Misconception(_variant("capacity_floor", capacity=lambda t, k, e, f: math.floor(f * t * k / e)),
                      "C is rounded down; C = ceil(capacity_factor x T k / E) rounds up (math.ceil)"),
        Misconception(_variant("capacity_counts_tokens", capacity=lambda t, k, e, f: math.ceil(f * t / e)),
                      "C counts tokens, not slots: C = ceil(capacity_factor x T k / E), with k the slots of each "
                      "token"),
        Misconception(_variant("capacity_token_priority", priority="token"), "the slots are kept in token order "
                      "(token 0's choices, then token 1's, ...); GShard's priority is every token's first choice "
                      "before any second choice, then tokens in order within a choice"),
        Misconception(_variant("capacity_keeps_last", priority="last"), "an expert keeps its last C slots; it keeps "
                      "the first C in the priority order and drops the rest"),
        Misconception(_variant("capacity_keeps_all", capacity=lambda t, k, e, f: t * k),
                      "nothing is dropped: an expert keeps at most C slots"),
        Misconception(_variant("capacity_returns_dropped", shown=lambda kept: ~kept),
                      "kept is True for the dropped slots and False for the kept ones: True means kept"),
        Misconception(capacity_token_by_token, "call each expert once, on one block of its kept rows: that block is "
                                               "its buffer of at most C rows"),
        Misconception(_variant("capacity_drops_nothing_in_out", every_slot=True), "dropped slots still reach their "
                      "expert: call it on exactly its kept rows (or on a buffer of C rows), and add only the kept "
                      "slots' outputs"),
        Misconception(_variant("capacity_no_residual", residual=False),
                      "the residual is missing: out[t] = x[t] + the kept slots' gate-weighted outputs"),
        Misconception(_variant("capacity_renormalised",
                               gated=lambda g, kept: g * kept / (g * kept).sum(-1, keepdim=True).clamp(min=1e-30)),
                      "the gates are renormalised over the kept slots; use them as given"),
        Misconception(_variant("capacity_no_gates", gated=lambda g, kept: torch.ones_like(g)),
                      "the gates are not applied: weight each kept slot's output by gates[t, j]"),
        Misconception(_variant("capacity_detached_gates", gated=lambda g, kept: g.detach()),
                      "the gates got no gradient: do not detach them (the router learns through them)")])


def check_capacity_moe(capacity_moe: Callable) -> None:
    """Stretch. out, kept = capacity_moe(x, expert_ids, gates, experts, capacity_factor): each expert keeps at
    most C = ceil(capacity_factor T k / E) slots, first choices before second choices, then in token order;
    out[t] = x[t] + sum over kept slots of gates[t, j] expert(x[t]); each expert called at most once, on its
    kept rows; gradients to x, the gates and the experts' weights."""
    CAPACITY(capacity_moe)

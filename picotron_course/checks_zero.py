"""The checks of assignment 03: ZeRO-1 and ZeRO-3, each rank keeping 1/N of the model's state.

Each check runs the learner's code on 4 ranks (where it communicates) and compares it with
single-process torch computed here, in the parent: one plain Llama trained with plain AdamW on
the whole global batch (the data-parallel result), its gradients cut into the shards each
rank should own. Nothing here uses picotron.parallel.zero, the module the assignment rebuilds.

    check_shard_range(shard_range)        equal shards of a buffer padded to a multiple of N (one process)
    check_zero1(Zero1)                    5 AdamW steps: reduce-scatter, step the shard, all-gather
    check_zero3_forward(Zero3Unit)        one forward: every unit gathered before, freed after
    check_zero3_training(Zero3Unit)       4 AdamW steps on the shards, the last over 2 micro-batches:
                                          gathered again for backward, gradients reduce-scattered into
                                          the shards (and added there), everything freed
    check_clip_grad_norm(clip)            the global gradient norm from sharded gradients, one all-reduce
                                          of one number, against torch.nn.utils.clip_grad_norm_ in one process
    check_zero3_prefetch(Zero3Unit,       (stretch) ZeRO-3 with prefetch over prefetch_units (the outer unit,
                         Zero3Prefetch)   each layer's attention and MLP): the rules read from the order of
                                          events (launch, wait, forward start and end, backward's first read),
                                          results against one process as check_zero3_training's

and `zero1_write_back_demo()`, the predict-then-run problem: what ZeRO-1 does when the updated
shards are not all-gathered back into the model.

Inside the ranks, `recorded_collectives` wraps torch.distributed's collectives (and the names
picotron.comm calls them by) to note every call: which operation, the payload bytes this rank
handed in (picotron.comm's convention: the input of an all-gather or a reduce-scatter) and the
reduction. It also refuses, with a message for the learner, the calls that would crash or hang:
a reduce-scatter whose input is not N times its output (a buffer that was not padded), an
all-gather into a tensor whose memory was freed.

A ZeRO-3 unit computes with views of a buffer whose memory it frees; reading freed memory
crashes the process. So the checks also watch every unit's module (a forward pre-hook after the
learner's, and autograd's saved-tensor hooks for backward) and raise a clear AssertionError
when a module is about to run its forward or its backward with parameters that have no memory.
The stretch's timeline (_Timeline) adds the order of the units' events and refuses, when it happens,
a unit that computes before its all-gather's handle was waited or that is freed while it is in flight.
"""

from __future__ import annotations

import functools
import math
import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import tolerance
from picotron.config import ModelConfig
from picotron_course import settings
from picotron_course.checks import (Report, close_enough, close_in_training, collectives_observed, max_abs_error,
                                    mismatch, on_ranks, one_thread, patched, reduce_name)
from picotron_course.checks import not_the_course_answer
from picotron.model import Llama, loss_fn

__all__ = ["check_shard_range", "check_zero1", "check_zero3_forward", "check_zero3_training", "check_clip_grad_norm",
           "check_zero3_prefetch", "zero1_write_back_demo", "recorded_collectives", "unit_params", "prefetch_units",
           "WrongCollectiveUse", "ZERO_MODELS", "WORLD"]

WORLD = 4
# Two small Llamas with tied embeddings: 2 layers and 26784 parameters (a multiple of 4), and an odd
# shape whose 1350 parameters (710 in its layer) need padding to split over 4 ranks.
ZERO_MODELS = {
    "2 layers": ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_seq_len=16),
    "odd sizes": ModelConfig(vocab_size=63, hidden_size=10, intermediate_size=15, num_layers=1,
                             num_attention_heads=5, num_key_value_heads=1, max_seq_len=16),
}
SEQ, BATCH_PER_RANK, LR = 12, 2, 1e-2
ZERO1_STEPS, ZERO3_STEPS = 5, 4
ACCUMULATE = 2          # the ZeRO-3 check's last step: 2 micro-batches of 1 sequence, gradients accumulated
WEIGHT_TOL = tolerance.ADAM_WEIGHTS_ATOL  # weights after several Adam steps: Adam amplifies round-off (1e-4)
# Roundings behind one logit of either model on the global batch (picotron.tolerance).
ROUNDINGS = max(tolerance.llama_roundings(config, SEQ, WORLD * BATCH_PER_RANK * SEQ)
                for config in ZERO_MODELS.values())
PACKAGE = "picotron.parallel.zero"


# ---- recording the collectives a rank makes ---------------------------------------------------
class WrongCollectiveUse(AssertionError):
    """A collective called with arguments that would crash or hang it; the message says what to fix."""


@dataclass
class Call:
    """One collective call: the operation, the payload bytes this rank handed in, the reduction, how many
    elements the payload held, and whether it was launched asynchronously (async_op=True)."""
    op: str
    nbytes: int
    reduce: str = ""
    numel: int = 0
    async_op: bool = False


# name -> (operation, index of the payload argument, index of the output argument or None)
_RECORDED = {
    "all_reduce": ("all_reduce", 0, None), "reduce": ("reduce", 0, None), "broadcast": ("broadcast", 0, None),
    "all_gather": ("all_gather", 1, None), "all_gather_into_tensor": ("all_gather", 1, 0),
    "all_gather_single": ("all_gather", 1, 0), "_all_gather_base": ("all_gather", 1, 0),
    "reduce_scatter": ("reduce_scatter", 1, None), "reduce_scatter_tensor": ("reduce_scatter", 1, 0),
    "reduce_scatter_single": ("reduce_scatter", 1, 0), "_reduce_scatter_base": ("reduce_scatter", 1, 0),
}


@contextmanager
def recorded_collectives(observe: Callable | None = None) -> Iterator[list[Call]]:
    """Inside the block, every collective this rank calls is appended to the yielded list (checks.collectives_observed:
    torch.distributed's deprecated names call the new ones, and only the outer call is recorded).
    observe(call, output, result), when given, sees each call once it returned (`output`: the tensor an
    all-gather or a reduce-scatter wrote, else None) and returns what the caller gets in place of `result`.
    """
    calls: list[Call] = []

    def record(name: str, arguments: dict) -> None:
        if name not in _RECORDED:
            return
        op, payload_at, output_at = _RECORDED[name]
        names = list(arguments)          # bound in the signature's order: the tensors come first
        payload = arguments[names[payload_at]]
        tensors = payload if isinstance(payload, (list, tuple)) else [payload]
        if output_at is not None:
            _refuse_misuse(op, arguments[names[output_at]], payload, arguments.get("group"))
        reduce = arguments.get("op", dist.ReduceOp.SUM) if op in ("all_reduce", "reduce", "reduce_scatter") else None
        calls.append(Call(op, sum(t.numel() * t.element_size() for t in tensors), reduce_name(reduce),
                          sum(t.numel() for t in tensors), bool(arguments.get("async_op", False))))

    def after(name: str, arguments: dict, result):
        if observe is None or name not in _RECORDED:
            return result
        output_at = _RECORDED[name][2]
        return observe(calls[-1], arguments[list(arguments)[output_at]] if output_at is not None else None, result)

    with collectives_observed(record, after):
        yield calls


def _refuse_misuse(op: str, output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Raise, before the real call, for the arguments that would make it crash or hang."""
    world = dist.get_world_size(group)
    if op == "all_gather":
        if output.numel() != world * input.numel():
            raise WrongCollectiveUse(f"an all-gather of {input.numel()} elements per rank over {world} ranks fills "
                                     f"{world * input.numel()} elements, but its output has {output.numel()}: gather "
                                     "each rank's shard into the whole padded buffer")
        if input.requires_grad and torch.is_grad_enabled():
            raise WrongCollectiveUse("an all-gather of a tensor that requires grad (a Parameter?): collectives do not "
                                     "go through autograd, and torch refuses to write it into the output's views. "
                                     "Pass tensor.detach() (the same numbers, without autograd)")
        needed = (output.storage_offset() + output.numel()) * output.element_size()
        if output.untyped_storage().nbytes() < needed:
            raise WrongCollectiveUse(f"an all-gather into a tensor whose memory was freed (its storage holds "
                                     f"{output.untyped_storage().nbytes()} of the {needed} bytes it needs): give it "
                                     "its memory back first, tensor.untyped_storage().resize_(numel * element_size)")
    elif op == "reduce_scatter" and input.numel() != world * output.numel():
        raise WrongCollectiveUse(f"a reduce-scatter of {input.numel()} elements into {output.numel()} per rank over "
                                 f"{world} ranks: the input must hold exactly {world} x the output. Pad the flat "
                                 f"buffer with zeros to a multiple of {world} (the shard size times {world})")


def _per_op(calls: list[Call]) -> dict[str, tuple[int, int]]:
    """{operation: (calls, payload bytes)}."""
    out: dict[str, list[int]] = {}
    for call in calls:
        entry = out.setdefault(call.op, [0, 0])
        entry[0] += 1
        entry[1] += call.nbytes
    return {op: (n, nbytes) for op, (n, nbytes) in out.items()}


# ---- the single-process reference -------------------------------------------------------------
def _tokens(name: str, step: int, rank: int) -> torch.Tensor:
    """(BATCH_PER_RANK, SEQ + 1) tokens of one rank at one step; the parent rebuilds every rank's."""
    generator = torch.Generator().manual_seed(10_007 * step + 101 * rank + len(name))
    return torch.randint(0, ZERO_MODELS[name].vocab_size, (BATCH_PER_RANK, SEQ + 1), generator=generator)


def _model(name: str) -> Llama:
    torch.manual_seed(0)
    return Llama(ZERO_MODELS[name])


def unit_params(model: Llama) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The ZeRO-3 units of the check: one per decoder layer, and one around the whole model holding
    the rest (the embedding, which is also the LM head, and the final norm)."""
    units = [(f"layer {i}", layer, list(layer.parameters())) for i, layer in enumerate(model.layers)]
    owned = {p for _, _, params in units for p in params}
    units.append(("model", model, [p for p in model.parameters() if p not in owned]))
    return units


def _padded(numel: int) -> int:
    return -(-numel // WORLD) * WORLD


def _flat(tensors: list[torch.Tensor], padded: int | None = None) -> torch.Tensor:
    flat = torch.cat([t.detach().flatten() for t in tensors])
    return torch.cat([flat, flat.new_zeros((padded or flat.numel()) - flat.numel())])


def _reference(name: str, steps: int, layout: Callable = unit_params) -> dict:
    """One process, the whole global batch, plain AdamW: losses, every parameter's gradient at each
    step, the final parameters; and the same in ZeRO-3 units (`layout(model)`: unit_params or prefetch_units)."""
    with one_thread():
        model = _model(name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        params = list(model.parameters())
        units = [unit for _, _, unit in layout(model)]
        losses, grads, unit_grads = [], [], []
        for step in range(steps):
            batch = torch.cat([_tokens(name, step, rank) for rank in range(WORLD)])
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
            loss.backward()
            losses.append(loss.item())
            grads.append(_flat([p.grad for p in params], _padded(sum(p.numel() for p in params))))
            unit_grads.append([_flat([p.grad for p in unit], _padded(sum(p.numel() for p in unit))) for unit in units])
            optimizer.step()
            optimizer.zero_grad()
        return {"losses": losses, "grads": grads, "weights": _flat(params), "unit_grads": unit_grads,
                "unit_weights": [_flat(unit) for unit in units]}


def _shard(flat: torch.Tensor, rank: int) -> torch.Tensor:
    size = flat.numel() // WORLD
    return flat[rank * size:(rank + 1) * size]


def _sum_hint(got: torch.Tensor, want: torch.Tensor) -> str:
    return (" (it looks like the sum over ranks: average, op=ReduceOp.AVG or divide by the world size)"
            if close_in_training(got, want * WORLD) else "")


def _state_numel(optimizer) -> int:
    """Elements of optimizer state (AdamW: exp_avg, exp_avg_sq; the 0-d step counters not counted)."""
    return sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


# ---- 1. shard_range -----------------------------------------------------------------------------
SHARD_CASES = [(12, 4), (13, 4), (3, 4), (1, 2), (7, 3), (26784, 4), (1350, 4), (10, 1)]


def check_shard_range(shard_range: Callable[[int, int, int], tuple]) -> None:
    """Rank r of `world` owns elements [r*k, (r+1)*k) with k = ceil(numel / world): equal shards of
    the buffer padded to world*k elements, the padding in the last shards."""
    with Report("shard_range", note="one process: (start, stop) of every rank's shard") as report:
        for numel, world in SHARD_CASES:
            k = -(-numel // world)
            expected = [(rank * k, (rank + 1) * k) for rank in range(world)]
            actual = [_as_pair(shard_range(numel, rank, world)) for rank in range(world)]
            detail = _shard_problem(actual, expected, numel, world, k)
            report.add(not detail, detail, numel=numel, world=world, padded=world * k, expected=_short(expected),
                       actual=_short(actual))


def _as_pair(answer):
    """(start, stop) as two Python ints when `answer` is any pair of whole numbers (a tuple, a list, numpy or
    torch integers); otherwise `answer` itself, for the message."""
    if isinstance(answer, torch.Tensor) and answer.numel() == 2 and not answer.is_floating_point():
        answer = answer.tolist()
    if isinstance(answer, (tuple, list)) and len(answer) == 2:
        try:
            if not any(isinstance(x, (bool, float)) for x in answer):
                return tuple(operator.index(x) for x in answer)
        except TypeError:
            pass
    return answer


def _short(actual: list) -> str:
    text = str([tuple(a) if isinstance(a, (list, tuple)) else a for a in actual])
    return text if len(text) <= 48 else text[:45] + "..."


def _shard_problem(actual: list, expected: list, numel: int, world: int, k: int) -> str:
    if actual == expected:
        return ""
    if not all(isinstance(a, (tuple, list)) and len(a) == 2 and all(isinstance(x, int) for x in a) for a in actual):
        return f"shard_range must return (start, stop), two ints; got {actual[0]!r} for rank 0"
    sizes = {stop - start for start, stop in actual}
    if len(sizes) > 1:
        return (f"the shards have sizes {sorted(sizes)}: every shard must have the same size, ceil(numel / world) "
                f"= {k}, so that reduce-scatter and all-gather cut the buffer into equal pieces (pad the buffer, "
                "not the shards)")
    if actual[0][0] != 0 or any(a[1] != b[0] for a, b in zip(actual, actual[1:])):
        return "shard 0 must start at 0 and shard r+1 where shard r stops: rank r owns [r*k, (r+1)*k)"
    size = sizes.pop()
    if size * world < numel:
        return (f"{world} shards of {size} cover only {size * world} of the {numel} elements: round the shard size "
                f"up, k = ceil(numel / world) = {k}; the padding then sits at the end of the last shards")
    return f"shards of {size} elements are larger than needed: k = ceil(numel / world) = {k}"


# ---- 2. ZeRO-1 -----------------------------------------------------------------------------------
def check_zero1(Zero1: type) -> None:
    """5 AdamW steps on 4 ranks: each rank's gradient shard is the mean over ranks of its slice, its
    optimizer holds state for 1/N of the parameters, one reduce-scatter of the flat gradients and
    one all-gather of the shards per step (no all-reduce), weights equal one process's."""
    not_the_course_answer("check_zero1", Zero1, course=PACKAGE)
    note = (f"{WORLD} ranks, {ZERO1_STEPS} AdamW steps. Payload per step: the reduce-scatter takes the whole "
            "padded gradient buffer, the all-gather one shard (wire: (N-1)/N of the buffer each, together "
            "the 2(N-1)/N of data parallelism's all-reduce)")
    with Report("Zero1", note=note) as report:
        results = on_ranks(_zero1_on_rank, WORLD, Zero1, list(ZERO_MODELS))   # first: an unsolved step() fails fast
        references = {name: _reference(name, ZERO1_STEPS) for name in ZERO_MODELS}
        for i, name in enumerate(ZERO_MODELS):
            per_rank = [rank[i] for rank in results]
            ref = references[name]
            padded = ref["grads"][0].numel()
            shard = padded // WORLD
            detail, errors = _zero1_problem(per_rank, ref, shard)
            got = per_rank[0]
            report.add(not detail, detail, model=name, params=ref["weights"].numel(), padded=padded,
                       **{"state/rank": got.get("state", "-"), "2 x shard": 2 * shard,
                          "reduce-scatter (B)": _bytes(got, "reduce_scatter"), "all-gather (B)": _bytes(got, "all_gather"),
                          "all-reduce (B)": _bytes(got, "all_reduce")},
                       max_grad_err=errors[0], max_weight_err=errors[1])


def _bytes(got: dict, op: str) -> str:
    """Payload per step of one operation, as 'b' when every step moved the same, else the list."""
    if "comm" not in got:
        return "-"
    per_step = sorted({step.get(op, (0, 0))[1] for step in got["comm"]})
    return str(per_step[0]) if len(per_step) == 1 else str(per_step)


def _zero1_on_rank(Zero1: type, names: list) -> list:
    rank, out = dist.get_rank(), []
    for name in names:
        model = _model(name)
        try:
            zero = Zero1(model, dist.group.WORLD, LR)
            not_the_course_answer("check_zero1", zero, course=PACKAGE)
            losses, grads, comm, seen = [], [], [], []
            # param_shard.grad as the optimizer sees it, when step() calls it (step() may drop it afterwards)
            zero.optimizer.register_step_pre_hook(functools.partial(_grad_at_step, zero, seen))
            for step in range(ZERO1_STEPS):
                tokens = _tokens(name, step, rank)
                loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                losses.append(loss.item())
                seen.clear()
                with recorded_collectives() as calls:
                    zero.step()
                comm.append(_per_op(calls))
                grads.append(seen[-1] if seen else "no step")
                zero.zero_grad()
        except WrongCollectiveUse as e:
            out.append({"error": str(e)})
            continue
        out.append({"losses": losses, "grads": grads, "comm": comm, "state": _state_numel(zero.optimizer),
                    "weights": _flat(list(model.parameters()))})
    return out


def _grad_at_step(zero, seen: list, optimizer, args, kwargs) -> None:
    grad = getattr(getattr(zero, "param_shard", None), "grad", None)
    seen.append(None if grad is None else grad.detach().clone())


def _zero1_problem(per_rank: list, ref: dict, shard: int) -> tuple[str, tuple[float, float]]:
    nan = (math.nan, math.nan)
    if "error" in per_rank[0]:
        return f"step(): {per_rank[0]['error']}", nan
    grad_err = max((max_abs_error(g, _shard(want, r)) if isinstance(g, torch.Tensor) else math.inf)
                   for r, got in enumerate(per_rank) for g, want in zip(got["grads"], ref["grads"]))
    weight_err = max(max_abs_error(got["weights"], ref["weights"]) for got in per_rank)
    errors = (grad_err, weight_err)
    got = per_rank[0]
    if got["state"] != 2 * shard:
        whole = 2 * ref["weights"].numel()
        why = (" That is AdamW's two moments for the whole model: each rank must step only its shard "
               "(self.optimizer over self.param_shard), not every parameter") if got["state"] >= whole else ""
        if got["state"] == 0:
            why = (" None at all: AdamW makes its state at its first step, for parameters that have a gradient. Set "
                   "self.param_shard.grad, then call self.optimizer.step()")
        return (f"rank 0's optimizer holds {got['state']} elements of state, expected 2 x its shard = "
                f"{2 * shard}.{why}"), errors
    problem = _zero1_comm_problem(got["comm"], ref["grads"][0].numel() * 4, shard * 4)
    if problem:
        return problem, errors
    for rank, result in enumerate(per_rank):
        for step, (g, want) in enumerate(zip(result["grads"], ref["grads"])):
            want = _shard(want, rank)
            if isinstance(g, str):
                return (f"step {step}: step() never called self.optimizer.step(), the AdamW over param_shard that "
                        "__init__ made"), errors
            if g is None:
                return ("when step() called self.optimizer.step(), param_shard.grad was None: give the optimizer "
                        "the averaged gradient shard (self.param_shard.grad = ...) before that call"), errors
            if not close_in_training(g, want):
                return (f"rank {rank}, step {step}: param_shard.grad is not this rank's shard of the gradient "
                        f"averaged over ranks{_sum_hint(g, want)}: {mismatch(g, want)}"), errors
    loss_err = max(abs(sum(r["losses"][s] for r in per_rank) / WORLD - want) for s, want in enumerate(ref["losses"]))
    if loss_err > tolerance.LOSS_ATOL:   # fp32 losses: 1e-5
        return f"the losses (mean over ranks) differ from one process's by {loss_err:.2e} (> 1e-5)", errors
    for rank, result in enumerate(per_rank):
        if max_abs_error(result["weights"], ref["weights"]) > WEIGHT_TOL:
            return (f"rank {rank}'s weights after {ZERO1_STEPS} steps differ from one process's by "
                    f"{max_abs_error(result['weights'], ref['weights']):.2e} (> {WEIGHT_TOL}): "
                    f"{mismatch(result['weights'], ref['weights'])}. Every rank must end each step with every "
                    "rank's updated shard in flat_params"), errors
    return "", errors


def _zero1_comm_problem(comm: list, grad_bytes: int, shard_bytes: int) -> str:
    for step, ops in enumerate(comm):
        if "all_reduce" in ops:
            return (f"step {step} called all-reduce ({ops['all_reduce'][1]} bytes): every rank would get the whole "
                    "averaged gradient, but it steps only its shard. Reduce-scatter the flat gradients instead: "
                    "each rank receives just its shard, and sends half the bytes of an all-reduce")
        others = sorted(set(ops) - {"reduce_scatter", "all_gather"})
        if others:
            return f"step {step} called {', '.join(others)}: ZeRO-1 needs one reduce-scatter and one all-gather"
        if "reduce_scatter" not in ops:
            return (f"step {step} made no reduce-scatter: average the flat gradient buffer over ranks with a "
                    "reduce-scatter into this rank's gradient shard")
        calls, nbytes = ops["reduce_scatter"]
        if (calls, nbytes) != (1, grad_bytes):
            return (f"step {step} reduce-scattered {nbytes} bytes in {calls} call(s); expected one reduce-scatter of "
                    f"the whole flat gradient buffer ({grad_bytes} bytes)")
        if "all_gather" not in ops:
            return (f"step {step} made no all-gather: each rank updated only its own shard, so the others' parts of "
                    "the model are stale. All-gather every rank's updated param_shard into flat_params")
        calls, nbytes = ops["all_gather"]
        if (calls, nbytes) != (1, shard_bytes):
            return (f"step {step} all-gathered {nbytes} bytes in {calls} call(s); expected one all-gather of this "
                    f"rank's parameter shard ({shard_bytes} bytes) into flat_params")
    return ""


# ---- 3. ZeRO-3 forward ---------------------------------------------------------------------------
def _missing(tensors) -> int:
    """Bytes the tensors need but their storage does not hold (0 when all have memory)."""
    return sum(max(0, (t.storage_offset() + t.numel()) * t.element_size() - t.untyped_storage().nbytes())
               for t in tensors)


class _Guard:
    """Refuses, with a message, to let a unit's module compute with parameters that have no memory.

    Forward: a pre-hook on each module, registered after the learner's (so after their gather).
    Backward: autograd's saved-tensor hooks; a saved weight is read back exactly when the module's
    backward needs it, whichever hook the learner gathered it from.
    """

    def __init__(self):
        self.labels: dict[int, str] = {}  # storage (its C++ address, stable across resize_) -> unit label

    def watch(self, label: str, module: nn.Module, params: list) -> None:
        module.register_forward_pre_hook(functools.partial(self.before_forward, f"{label} ({type(module).__name__})",
                                                           params))

    def before_forward(self, label: str, params: list, module, args) -> None:
        if _missing(params):
            raise WrongCollectiveUse(
                f"{label} starts its forward with parameters that have no memory ({_missing(params)} bytes missing): "
                "before its forward, gather_params must give unit.full its memory back and all-gather the shards "
                "into it (the parameters are views of unit.full); hook_forward must call it from a forward pre-hook")
        for p in params:
            self.labels[p.untyped_storage()._cdata] = label

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor) and _missing([saved]):
            label = self.labels.get(saved.untyped_storage()._cdata, "a unit's module")
            raise WrongCollectiveUse(
                f"{label} runs its backward with parameters that have no memory ({_missing([saved])} bytes missing): "
                "autograd reads the weights again to compute gradients. Gather them again before the module's "
                "backward: in the forward hook, register a hook on the output (output.register_hook) that calls "
                "gather_params; it fires when the output's gradient arrives")
        return saved

    def reads(self):
        """Around forward and backward: check every saved tensor when backward reads it."""
        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, self.unpack)


def _build_units(Unit: type, model: Llama, guard: _Guard) -> list:
    units = []
    for label, module, params in unit_params(model):
        unit = Unit(module, params, dist.group.WORLD)
        not_the_course_answer("the ZeRO-3 check", unit, course=PACKAGE)
        guard.watch(label, module, params)
        units.append(unit)
    return units


def _held(units: list) -> int:
    """Bytes of memory behind the units' full parameters (each storage counted once)."""
    storages = {}
    for unit in units:
        for p in unit.params:
            storage = p.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _shard_sizes(units: list) -> list[int]:
    return [unit.shard.numel() for unit in units]


def check_zero3_forward(Zero3Unit: type) -> None:
    """One forward on 4 ranks: each unit all-gathers its shard once before its module runs and frees
    the full parameters after; the logits equal one process's, and no full parameter is left."""
    not_the_course_answer("check_zero3_forward", Zero3Unit, course=PACKAGE)
    note = (f"{WORLD} ranks, one forward; units: one per decoder layer + one for the rest of the model. "
            "'held after' is the memory behind the units' full parameters once forward returned: 0 when freed")
    with Report("Zero3Unit forward", note=note) as report:
        results = on_ranks(_zero3_forward_on_rank, WORLD, Zero3Unit, list(ZERO_MODELS))
        with one_thread():
            for i, name in enumerate(ZERO_MODELS):
                per_rank = [rank[i] for rank in results]
                model = _model(name)
                sizes = [sum(p.numel() for p in params) for _, _, params in unit_params(model)]
                with torch.no_grad():
                    expected = [model(_tokens(name, 0, rank)[:, :-1]) for rank in range(WORLD)]
                detail, err = _zero3_forward_problem(per_rank, expected, sizes)
                got = per_rank[0]
                gathers = got["comm"].get("all_gather", (0, 0)) if "comm" in got else ("-", "-")
                report.add(not detail, detail, model=name, units=len(sizes),
                           **{"shard numels": got.get("shards", "-"), "all-gathers": gathers[0],
                              "gathered (B)": gathers[1],
                              "shards (B)": sum(_padded(n) // WORLD * 4 for n in sizes),
                              "held after (B)": got.get("held", "-")},
                           max_abs_err=err)


def _zero3_forward_on_rank(Zero3Unit: type, names: list) -> list:
    rank, out = dist.get_rank(), []
    for name in names:
        model = _model(name)
        tokens = _tokens(name, 0, rank)
        try:
            units = _build_units(Zero3Unit, model, _Guard())
            with recorded_collectives() as calls:
                logits = model(tokens[:, :-1])
        except WrongCollectiveUse as e:
            out.append({"error": str(e)})
            continue
        out.append({"logits": logits.detach().clone(), "held": _held(units), "shards": _shard_sizes(units),
                    "comm": _per_op(calls)})
    return out


def _zero3_forward_problem(per_rank: list, expected: list, sizes: list) -> tuple[str, float]:
    if "error" in per_rank[0]:
        return per_rank[0]["error"], math.nan
    err = max(max_abs_error(got["logits"], want) for got, want in zip(per_rank, expected))
    got = per_rank[0]
    shards = [_padded(n) // WORLD for n in sizes]
    if got["shards"] != shards:
        return (f"the units' shards hold {got['shards']} elements, expected {shards}: 1/{WORLD} of each unit's "
                "padded parameters, nothing more"), err
    if got["held"]:
        return (f"after forward the units' full parameters still hold {got['held']} bytes: free_params must release "
                "unit.full's memory (unit.full.untyped_storage().resize_(0)) and hook_forward must call it from a "
                "forward hook, after the module's forward"), err
    problem = _zero3_gather_problem(got["comm"], sizes, per_forward=1)
    if problem:
        return problem, err
    for rank, (result, want) in enumerate(zip(per_rank, expected)):
        if not close_enough(result["logits"], want, n=ROUNDINGS):
            return (f"rank {rank}'s logits differ from one process's: {mismatch(result['logits'], want)}. Each unit "
                    "must gather every rank's shard, in rank order, into unit.full"), err
    return "", err


def _zero3_gather_problem(ops: dict, sizes: list, per_forward: int) -> str:
    units, shard_bytes = len(sizes), sum(_padded(n) // WORLD * 4 for n in sizes)
    when = "forward" if per_forward == 1 else "forward and backward"
    calls, nbytes = ops.get("all_gather", (0, 0))
    if calls == 0:
        return (f"no all-gather ran during the {when}: gather_params must all-gather every rank's unit.shard into "
                "unit.full")
    if (calls, nbytes) != (per_forward * units, per_forward * shard_bytes):
        return (f"{calls} all-gathers of {nbytes} bytes in one {when} for {units} units; expected {per_forward} per "
                f"unit, of its shard: {per_forward * units} calls, {per_forward * shard_bytes} bytes")
    return ""


# ---- 4. ZeRO-3 training ----------------------------------------------------------------------------
def check_zero3_training(Zero3Unit: type) -> None:
    """4 AdamW steps on the units' shards, 4 ranks, the last step over 2 micro-batches with no zero_grad
    between them: after each step's backward every shard's gradient is the mean over ranks of its slice
    (over the whole step's batch), no full parameter or full gradient is left after any backward; per
    forward and backward 2 all-gathers and 1 reduce-scatter per unit, no all-reduce; losses and weights
    equal one process's."""
    not_the_course_answer("check_zero3_training", Zero3Unit, course=PACKAGE)
    note = (f"{WORLD} ranks, {ZERO3_STEPS} AdamW steps over the units' shards, the last over {ACCUMULATE} "
            "micro-batches. Per forward and backward each unit all-gathers its shard twice and reduce-scatters its "
            "gradient once: the Playbook's 3 x Psi")
    with Report("Zero3Unit training", note=note) as report:
        results = on_ranks(_zero3_train_on_rank, WORLD, Zero3Unit, list(ZERO_MODELS))
        references = {name: _reference(name, ZERO3_STEPS) for name in ZERO_MODELS}
        for i, name in enumerate(ZERO_MODELS):
            per_rank = [rank[i] for rank in results]
            ref = references[name]
            sizes = [sum(p.numel() for p in params) for _, _, params in unit_params(_model(name))]
            detail, errors = _zero3_train_problem(per_rank, ref, sizes)
            got = per_rank[0]
            calls = {op: (max(step.get(op, (0, 0))[0] for step in got["comm"]) if "comm" in got else "-")
                     for op in ("all_gather", "reduce_scatter", "all_reduce")}
            report.add(not detail, detail, model=name, units=len(sizes),
                       **{"all-gathers/pass": calls["all_gather"], "reduce-scatters/pass": calls["reduce_scatter"],
                          "all-reduces/pass": calls["all_reduce"],
                          "held after bwd (B)": max(got["held"]) if "held" in got else "-"},
                       max_grad_err=errors[0], max_loss_err=errors[1], max_weight_err=errors[2])


def _micro_batches(step: int) -> int:
    """Micro-batches of a training step of the ZeRO-3 check: the last step accumulates gradients over 2."""
    return ACCUMULATE if step == ZERO3_STEPS - 1 else 1


def _zero3_train_on_rank(Zero3Unit: type, names: list) -> list:
    rank, out = dist.get_rank(), []
    for name in names:
        model, guard, at = _model(name), _Guard(), {"where": "step 0", "phase": "forward"}
        try:
            units = _build_units(Zero3Unit, model, guard)

            def one_pass(part, micro, where):
                with recorded_collectives() as calls, guard.reads():
                    at.update(where=where, phase="forward")
                    output = model(part[:, :-1])
                    loss = loss_fn(output, part[:, 1:]) / micro   # equal sizes: mean of means
                    at["phase"] = "backward"
                    loss.backward()
                return loss, output, calls

            out.append(_train_units(name, rank, units, one_pass))
        except WrongCollectiveUse as e:
            out.append({"error": f"{at['where']}, {at['phase']}: {e}"})
    return out


def _train_units(name: str, rank: int, units: list, one_pass) -> dict:
    """ZERO3_STEPS AdamW steps over the units' shards, the last over ACCUMULATE micro-batches, with what the
    ZeRO-3 checks compare: the first logits, each step's loss and gradient shards, each pass's collectives, the
    bytes held after it and the full gradients left in p.grad, and the final shards. `one_pass(part, micro,
    where)` runs one micro-batch's forward and backward under the check's recorders and returns (loss,
    output, recorded calls)."""
    optimizer = torch.optim.AdamW([unit.shard for unit in units], lr=LR)
    got = {"logits": None, "losses": [], "grads": [], "comm": [], "held": [], "full_grads": []}
    for step in range(ZERO3_STEPS):
        micro = _micro_batches(step)
        step_loss = 0.0
        for i, part in enumerate(_tokens(name, step, rank).chunk(micro)):  # no zero_grad in between
            loss, output, calls = one_pass(part, micro, f"step {step}" + (f", micro-batch {i}" if micro > 1 else ""))
            if got["logits"] is None:
                got["logits"] = output.detach().clone()
            step_loss += loss.item()
            got["comm"].append(_per_op(calls))        # per forward and backward pass
            got["held"].append(_held(units))
            got["full_grads"].append(sum(p.grad.numel() for unit in units for p in unit.params if p.grad is not None))
        got["losses"].append(step_loss)
        got["grads"].append([None if unit.shard.grad is None else unit.shard.grad.detach().clone() for unit in units])
        optimizer.step()
        optimizer.zero_grad()
    got["shards"] = [unit.shard.detach().clone() for unit in units]
    return got


def _zero3_train_problem(per_rank: list, ref: dict, sizes: list) -> tuple[str, tuple[float, float, float]]:
    if "error" in per_rank[0]:
        return per_rank[0]["error"], (math.nan,) * 3
    grad_err = max((max_abs_error(g, _shard(want, rank)) if g is not None else math.inf)
                   for rank, got in enumerate(per_rank) for step, per_unit in enumerate(got["grads"])
                   for g, want in zip(per_unit, ref["unit_grads"][step]))
    loss_err = max(abs(sum(r["losses"][s] for r in per_rank) / WORLD - want) for s, want in enumerate(ref["losses"]))
    weights = [torch.cat([r["shards"][u] for r in per_rank])[:n] for u, n in enumerate(sizes)]
    weight_err = max(max_abs_error(w, want) for w, want in zip(weights, ref["unit_weights"]))
    errors = (grad_err, loss_err, weight_err)
    got = per_rank[0]
    if max(got["held"]):
        return (f"after backward the units' full parameters still hold {max(got['held'])} bytes: once a unit's "
                "gradients are reduce-scattered its parameters must be freed (free_params), and each unit's backward "
                "gather must be freed the same way"), errors
    if max(got["full_grads"]):
        return (f"after backward the parameters still hold {max(got['full_grads'])} elements of full gradients "
                "(p.grad): reduce_scatter_grads must drop them (p.grad = None) once their average is in the shard"), \
            errors
    passes = [(step, i) for step in range(ZERO3_STEPS) for i in range(_micro_batches(step))]
    for (step, i), ops in zip(passes, got["comm"]):
        problem = _zero3_step_comm_problem(ops, sizes)
        if problem:
            return f"step {step}{f', micro-batch {i}' if _micro_batches(step) > 1 else ''}: {problem}", errors
    for rank, result in enumerate(per_rank):
        for step, per_unit in enumerate(result["grads"]):
            for u, (g, want) in enumerate(zip(per_unit, ref["unit_grads"][step])):
                want = _shard(want, rank)
                if g is None:
                    return (f"unit {u}'s shard.grad is None after backward: reduce_scatter_grads must put the "
                            "averaged gradient shard in unit.shard.grad"), errors
                if not close_in_training(g, want):
                    if _micro_batches(step) > 1:
                        return (f"rank {rank}, step {step}, unit {u}: this step ran {_micro_batches(step)} micro-batches "
                                "with no zero_grad between them, and shard.grad is not the sum of their averaged "
                                "gradient shards: add the new shard to unit.shard.grad when a gradient is already "
                                f"there{_sum_hint(g, want)}. {mismatch(g, want)}"), errors
                    return (f"rank {rank}, step {step}, unit {u}: shard.grad is not this rank's shard of the gradient "
                            f"averaged over ranks{_sum_hint(g, want)}: {mismatch(g, want)}"), errors
    if loss_err > tolerance.LOSS_ATOL:   # fp32 losses: 1e-5
        return f"the losses (mean over ranks) differ from one process's by {loss_err:.2e} (> 1e-5)", errors
    if weight_err > WEIGHT_TOL:
        return (f"the weights after {ZERO3_STEPS} steps (every rank's shards put together) differ from one process's "
                f"by {weight_err:.2e} (> {WEIGHT_TOL})"), errors
    return "", errors


def _zero3_step_comm_problem(ops: dict, sizes: list) -> str:
    if "all_reduce" in ops:
        return (f"all-reduce called ({ops['all_reduce'][1]} bytes): every rank would get the whole averaged "
                "gradient but keeps only its shard. reduce_scatter_grads must reduce-scatter the flat gradient "
                "instead: each rank receives just its shard, half the bytes of an all-reduce")
    others = sorted(set(ops) - {"reduce_scatter", "all_gather"})
    if others:
        return f"{', '.join(others)} called: ZeRO-3 needs only all-gathers and reduce-scatters"
    problem = _zero3_gather_problem(ops, sizes, per_forward=2)
    if problem:
        return problem
    calls, nbytes = ops.get("reduce_scatter", (0, 0))
    grad_bytes = sum(_padded(n) * 4 for n in sizes)
    if (calls, nbytes) != (len(sizes), grad_bytes):
        return (f"{calls} reduce-scatters of {nbytes} bytes for {len(sizes)} units; expected one per unit, of its "
                f"whole padded flat gradient: {len(sizes)} calls, {grad_bytes} bytes")
    return ""


# ---- 5. clipping sharded gradients by the global norm --------------------------------------------
JUNK = 100.0          # what the check writes into the padding of every shard's gradient
CLIP_EPS = 1e-6       # torch.nn.utils.clip_grad_norm_: coefficient = max_norm / (norm + 1e-6), at most 1


def _odd_model_unit_grads() -> list[torch.Tensor]:
    """The averaged gradient of each ZeRO-3 unit of the "odd sizes" model on the global batch of step 0,
    flat and unpadded (710 and 640 elements): what the ranks' shards hold after the reduce-scatter."""
    model = _model("odd sizes")
    batch = torch.cat([_tokens("odd sizes", 0, rank) for rank in range(WORLD)])
    loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
    return [_flat([p.grad for p in params]) for _, _, params in unit_params(model)]


def _random_buffers(numels: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) * (i + 1) for i, n in enumerate(numels)]


def _clip_cases() -> list[dict]:
    """Each case: the groups of ranks, per group its buffers (flat, unpadded averaged gradients) and max_norm."""
    with one_thread():
        unit_grads = _odd_model_unit_grads()
    norm = torch.linalg.vector_norm(torch.cat(unit_grads)).item()
    tiny = _random_buffers([3, 13, 1], seed=1)          # on 4 ranks: whole shards of padding
    pairs = [_random_buffers([7, 10, 5], seed=2), _random_buffers([7, 10, 5], seed=3)]

    def clipped_at(fraction, buffers):
        return fraction * torch.linalg.vector_norm(torch.cat(buffers)).item()
    return [
        {"case": "odd model's units, clipped", "groups": [[0, 1, 2, 3]], "buffers": [unit_grads],
         "max_norm": [0.5 * norm]},
        {"case": "odd model's units, below max_norm", "groups": [[0, 1, 2, 3]], "buffers": [unit_grads],
         "max_norm": [2.0 * norm]},
        {"case": "buffers of 3, 13 and 1", "groups": [[0, 1, 2, 3]], "buffers": [tiny],
         "max_norm": [clipped_at(0.25, tiny)]},
        {"case": "two groups of 2", "groups": [[0, 1], [2, 3]], "buffers": pairs,
         "max_norm": [clipped_at(0.5, buffers) for buffers in pairs]},
    ]


def _torch_clip(buffers: list[torch.Tensor], max_norm: float) -> tuple[float, list[torch.Tensor]]:
    """One process: torch.nn.utils.clip_grad_norm_ over parameters whose gradients are the buffers."""
    params = [nn.Parameter(torch.zeros_like(flat)) for flat in buffers]
    for p, flat in zip(params, buffers):
        p.grad = flat.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.item(), [p.grad for p in params]


def check_clip_grad_norm(clip_grad_norm_sharded: Callable) -> None:
    """clip_grad_norm_sharded(shards, numels, max_norm, group) on 4 ranks (one group of 4, and two groups
    of 2): every rank returns the global norm of the unpadded gradients, scales its shards' gradients
    in place by min(1, max_norm / (norm + 1e-6)), and makes one all-reduce (sum) of a single number;
    against torch.nn.utils.clip_grad_norm_ in one process. The padding holds junk (100.0)."""
    note = (f"{WORLD} ranks; each rank's shards of flat gradient buffers, their padding filled with {JUNK:g}; "
            "expected: torch.nn.utils.clip_grad_norm_ on the unpadded buffers, in one process")
    with Report("clip_grad_norm_sharded", note=note) as report:
        cases = _clip_cases()
        results = on_ranks(_clip_on_rank, WORLD, clip_grad_norm_sharded, cases)
        for c, case in enumerate(cases):
            per_rank = [rank[c] for rank in results]
            for g, (members, buffers, max_norm) in enumerate(zip(case["groups"], case["buffers"], case["max_norm"])):
                want_norm, want_grads = _torch_clip(buffers, max_norm)
                got = [per_rank[r] for r in members]
                detail, err = _clip_problem(got, buffers, max_norm, want_norm, want_grads, len(case["groups"]) > 1)
                calls = got[0].get("calls", [])
                report.add(not detail, detail, case=case["case"], ranks=str(members),
                           numels=str([b.numel() for b in buffers]), max_norm=max_norm, norm=want_norm,
                           **{"rank's norm": got[0].get("norm", "-"), "collectives": len(calls),
                              "sent (B)": sum(nbytes for _, nbytes, *_ in calls)}, max_err=err)


def _clip_on_rank(clip: Callable, cases: list) -> list:
    rank, out, groups = dist.get_rank(), [], {}
    for case in cases:
        for members in case["groups"]:          # every rank makes every group, in the same order
            if tuple(members) not in groups:
                groups[tuple(members)] = (dist.group.WORLD if len(members) == dist.get_world_size()
                                          else dist.new_group(members))
    for case in cases:
        g = next(i for i, members in enumerate(case["groups"]) if rank in members)
        members, buffers = case["groups"][g], case["buffers"][g]
        world, place = len(members), members.index(rank)
        shards = []
        for flat in buffers:
            k = -(-flat.numel() // world)
            padded = torch.full((world * k,), JUNK)
            padded[:flat.numel()] = flat
            shard = nn.Parameter(torch.zeros(k))                      # (k,): this rank's parameter shard
            shard.grad = padded[place * k:(place + 1) * k].clone()    # its averaged gradient, padding and all
            shards.append(shard)
        try:
            with recorded_collectives() as calls:
                norm = clip(shards, [flat.numel() for flat in buffers], case["max_norm"][g], groups[tuple(members)])
        except WrongCollectiveUse as e:
            out.append({"error": str(e)})
            continue
        out.append({"norm": _as_number(norm), "grads": [None if s.grad is None else s.grad.detach().clone()
                                                        for s in shards],
                    "calls": [(call.op, call.nbytes, call.reduce, call.numel) for call in calls]})
    return out


def _as_number(value):
    """A returned norm as a float (a Python number or a one-element tensor), else a description."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return f"{type(value).__name__}: {value!r}"[:60]


def _clip_problem(got: list, buffers: list, max_norm: float, want_norm: float, want_grads: list,
                  grouped: bool) -> tuple[str, float]:
    if "error" in got[0]:
        return got[0]["error"], math.nan
    total = sum(b.numel() for b in buffers)
    calls = got[0]["calls"]
    problem = _clip_calls_problem(calls)
    if problem:
        return problem, math.nan
    norms = [result["norm"] for result in got]
    if any(isinstance(n, str) for n in norms):
        return f"return the total norm of the gradients (a float or a 0-d tensor), not {norms[0]}", math.nan
    result = tolerance.compare(norms[0], want_norm, n=total, dtype=torch.float32)
    if not result or len(set(norms)) > 1:
        return _wrong_norm(norms, buffers, want_norm, grouped) + f" ({result})", abs(norms[0] - want_norm)
    err, worst = 0.0, None
    for b, (flat, want) in enumerate(zip(buffers, want_grads)):
        k = -(-flat.numel() // len(got))
        pieces = [result["grads"][b] for result in got]
        if any(piece is None or piece.shape != (k,) for piece in pieces):
            return (f"buffer {b}: shard.grad is None or changed shape after the call: scale it in place "
                    "(shard.grad.mul_(coefficient))"), math.nan
        real = torch.cat(pieces)[:flat.numel()]
        err = max(err, max_abs_error(real, want))
        if worst is None and not tolerance.close_enough(real, want, n=total):
            worst = (b, real, want, flat)
    if worst is None:
        return "", err
    b, real, want, flat = worst
    coefficient = min(1.0, max_norm / (want_norm + CLIP_EPS))
    if torch.equal(real, flat) and coefficient < 1:
        return (f"the gradients were not scaled: the norm {want_norm:.4g} is above max_norm {max_norm:.4g}, so every "
                f"shard.grad must be multiplied, in place, by max_norm / (norm + 1e-6) = {coefficient:.4g}"), err
    if coefficient == 1 and tolerance.close_enough(real, flat * max_norm / (want_norm + CLIP_EPS), n=total):
        return (f"the norm {want_norm:.4g} is below max_norm {max_norm:.4g}: the gradients must stay as they are. "
                "The coefficient is min(1, max_norm / (norm + 1e-6)): clipping never scales gradients up"), err
    return f"buffer {b}: the clipped gradients differ from torch's: {mismatch(real, want)}", err


def _clip_calls_problem(calls: list) -> str:
    gathers = [op for op, *_ in calls if op != "all_reduce"]
    if gathers:
        return (f"{', '.join(sorted(set(gathers)))} called: the norm needs one number from each rank, the sum of the "
                "squares of its shards' real elements; gathering gradients moves the whole buffer to compute it")
    if not calls:
        return ("no collective: each rank holds only its shards, so its sum of squares is a part of the total. "
                "All-reduce (sum) it over `group`, then take the square root")
    if len(calls) > 1:
        return (f"{len(calls)} all-reduces: make one, for every buffer at once. Add up the squares of all the "
                "shards first: an all-reduce of one number costs a latency, and it is paid once")
    _, nbytes, reduce, numel = calls[0]
    if numel != 1:
        return (f"the all-reduce carried {numel} numbers ({nbytes} bytes): one number is enough, this rank's sum of "
                "squares over all its shards (a tensor of one element)")
    if reduce != "sum":
        return f"the all-reduce used op={reduce.upper()}: the squares of the ranks' shards add up (ReduceOp.SUM)"
    return ""


def _wrong_norm(norms: list, buffers: list, want: float, grouped: bool) -> str:
    """Why the norm is wrong, when it matches a plausible mistake."""
    world = len(norms)
    if len(set(norms)) > 1:
        return f"the ranks of one group returned different norms, {norms}: every rank must return the same global norm"
    got = norms[0]
    squares = [sum((_padded_shard(flat, world, r) ** 2).sum().item() for flat in buffers) for r in range(world)]
    real = [sum((_padded_shard(flat, world, r, junk=0.0) ** 2).sum().item() for flat in buffers) for r in range(world)]
    near = lambda x: abs(got - x) <= 1e-4 * max(abs(x), 1e-12)
    if near(math.sqrt(sum(squares))):
        return (f"the norm {got:.6g} counts the padding ({JUNK:g} in every padding element here; torch.empty leaves "
                f"anything there): sum the squares of each shard's real elements only; expected {want:.6g}")
    if near(sum(real)):
        return f"the norm {got:.6g} is the sum of squares: return its square root, {want:.6g}"
    if near(sum(math.sqrt(x) for x in real)):
        return (f"the norm {got:.6g} is the sum of the ranks' norms: all-reduce the sum of squares, then take the "
                f"root (||g||^2 adds up over the shards, ||g|| does not); expected {want:.6g}")
    hint = (" In the groups of 2, use this rank's place in `group` (dist.get_rank(group), "
            "dist.get_world_size(group)) and all-reduce over `group` only." if grouped else "")
    return f"the norm is {got:.6g}, expected {want:.6g}.{hint}"


def _padded_shard(flat: torch.Tensor, world: int, rank: int, junk: float = JUNK) -> torch.Tensor:
    k = -(-flat.numel() // world)
    padded = torch.full((world * k,), junk)
    padded[:flat.numel()] = flat
    return padded[rank * k:(rank + 1) * k]


# ---- 6. stretch: ZeRO-3 with prefetch -------------------------------------------------------------
AHEAD = 2   # units besides the outer one that may hold full parameters at once: the one computing, the next


def prefetch_units(model: Llama) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """The ZeRO-3 units of the stretch, in the order their forwards start: one around the whole model holding
    what no other unit holds (the embedding, which is also the LM head, and every norm), then each decoder
    layer's attention and its MLP. Twice as many units as layers, and of different sizes."""
    inner = [(f"{part} {i}", module, list(module.parameters()))
             for i, layer in enumerate(model.layers) for part, module in (("attn", layer.attn), ("mlp", layer.mlp))]
    owned = {p for _, _, params in inner for p in params}
    return [("model", model, [p for p in model.parameters() if p not in owned]), *inner]


class _Handle:
    """The handle of an asynchronous all-gather, handed to the learner's code in place of torch's: it tells
    the timeline when it is waited, and does the rest as torch's handle does. is_completed() waits and answers
    True, so that what the check sees never depends on how fast the bytes travelled."""

    def __init__(self, work, waited: Callable[[], None]):
        self._work, self._waited = work, waited

    def wait(self, *args, **kwargs):
        self._waited()
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        self.wait()
        return True

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class _Timeline(_Guard):
    """What happens to the units on one rank, pass by pass (a forward, then a backward), in order, as
    (event, unit index) pairs:

        "gather"   an all-gather into the unit's `full` was called without async_op=True (it returned when done)
        "launch"   ... with async_op=True (it returned at once; its handle is in flight)
        "wait"     that handle's wait() was called
        "start"    the unit's module starts its forward (after every forward pre-hook)
        "end"      its forward is over (before any forward hook)
        "need"     backward reads one of the unit's saved weights, for the first time in the pass
        other      another collective (its name; unit None)

    At every event it counts the units, the outer one (index 0) aside, whose `full` holds memory, and keeps
    the largest count. Only the order of calls is recorded, never a time: the verdict is the same on a CPU
    with gloo and on a GPU with NCCL, where wait() returns before the bytes arrive.

    Two mistakes would let a collective write into memory that is read or freed meanwhile (a result that
    depends on timing, or a crash): a unit that computes before its all-gather's handle was waited, and a
    unit's memory resized while its all-gather is in flight. The timeline refuses them when they happen: it
    waits for every all-gather in flight, then raises WrongCollectiveUse. An all-gather still unwaited when a
    pass returns is waited for there, and noted for the check.
    """

    def __init__(self, names: list[str], units: list):
        super().__init__()
        self.names, self.units = names, units
        self.unit_of = {unit.full.untyped_storage()._cdata: u for u, unit in enumerate(units)}
        self.passes: list[dict] = []
        self.needed: set[int] = set()
        self.pending: dict[int, list] = {}     # unit -> its all-gathers launched and not waited (torch's handles)

    def watch_all(self, modules: list[nn.Module]) -> None:
        """Hooks on each unit's module, registered after the learner's: "start" once their pre-hooks have run,
        "end" before their forward hooks run."""
        for u, module in enumerate(modules):
            label = f"{self.names[u]} ({type(module).__name__})"
            module.register_forward_pre_hook(functools.partial(self._starts, u, label, list(self.units[u].params)))
            module.register_forward_hook(lambda module, args, output, u=u: self.note("end", u), prepend=True)

    def begin(self, phase: str, where: str) -> None:
        self.current = {"phase": phase, "where": where, "events": [], "peak": (0, [], -1)}
        self.passes.append(self.current)
        self.needed = set()

    def finish(self) -> None:
        """At the end of a pass: the units that still hold memory, and those whose all-gather was never waited
        (the timeline waits for those itself, so that nothing writes into a unit's memory any more)."""
        self.current["held_after"] = [u for u, unit in enumerate(self.units) if unit.full.untyped_storage().nbytes()]
        self.current["unwaited"] = [u for u, works in self.pending.items() if works]
        self._drain()

    def _drain(self) -> None:
        for works in self.pending.values():
            for work in works:
                work.wait()
        self.pending.clear()

    def _refuse(self, message: str) -> None:
        """Wait for every all-gather in flight (it writes into a unit's memory), then raise."""
        self._drain()
        raise WrongCollectiveUse(message)

    def _refuse_unwaited(self, u: int, computes: str) -> None:
        if self.pending.get(u):
            events = self.current["events"]
            launched = max(i for i, (event, v) in enumerate(events) if event == "launch" and v == u)
            other = [self.names[v] for event, v in events[launched:] if event == "wait" and v != u]
            self._refuse(f"{self.names[u]}'s {computes} before the handle of its all-gather was waited: its "
                         "parameters may still be arriving (on a GPU, NCCL writes them while the kernels read). "
                         f"Wait on {self.names[u]}'s own handle just before it computes"
                         + (f" (the handle waited was {other[-1]}'s)" if other else ""))

    def guard_frees(self):
        """Around the passes: refuse to resize a unit's memory while an all-gather writes into it."""
        resize = torch.UntypedStorage.resize_

        def guarded(storage, nbytes):
            u = self.unit_of.get(storage._cdata)
            if u is not None and self.pending.get(u):
                self._refuse(f"{self.names[u]}'s memory was resized to {nbytes} bytes while its all-gather was in "
                             "flight, writing into it: wait on its handle before freeing the unit")
            return resize(storage, nbytes)
        return patched([(torch.UntypedStorage, "resize_", guarded)])

    def note(self, event: str, unit: int | None) -> None:
        events = self.current["events"]
        events.append((event, unit))
        held = [u for u, one in enumerate(self.units) if u and one.full.untyped_storage().nbytes()]
        if len(held) > self.current["peak"][0]:
            self.current["peak"] = (len(held), held, len(events) - 1)

    def _starts(self, u: int, label: str, params: list, module, args) -> None:
        self.before_forward(label, params, module, args)    # refuses parameters without memory
        self._refuse_unwaited(u, "forward started")
        self.note("start", u)

    def unpack(self, saved):
        saved = super().unpack(saved)                       # refuses weights without memory
        if isinstance(saved, torch.Tensor):
            u = self.unit_of.get(saved.untyped_storage()._cdata)
            if u is not None and u not in self.needed:
                self._refuse_unwaited(u, "backward began computing")
                self.needed.add(u)
                self.note("need", u)
        return saved

    def _waited(self, u: int | None, work) -> None:
        self.note("wait", u)
        if any(one is work for one in self.pending.get(u, [])):
            self.pending[u] = [one for one in self.pending[u] if one is not work]

    def observe(self, call: Call, output, result):
        """recorded_collectives' observer: note the call, and hand out a handle that notes its wait."""
        if call.op != "all_gather":
            self.note(call.op, None)
            return result
        u = self.unit_of.get(output.untyped_storage()._cdata) if isinstance(output, torch.Tensor) else None
        if not call.async_op or result is None:
            self.note("gather", u)
            return result
        self.note("launch", u)
        self.pending.setdefault(u, []).append(result)
        return _Handle(result, functools.partial(self._waited, u, result))


def check_zero3_prefetch(Zero3Unit: type, Zero3Prefetch: type) -> None:
    """4 AdamW steps on 4 ranks, the last over 2 micro-batches, with the units of prefetch_units (the outer
    one, then each layer's attention and MLP) built from your Zero3Unit with its hook_forward switched off,
    and Zero3Prefetch(units) wiring them. Every forward and every backward, from the order of events (never
    their times): each unit all-gathered exactly once; every all-gather but the first of the pass launched
    with async_op=True before the unit ahead of it starts computing, and its handle waited after that unit
    computed and before its own unit computes; backward in the reverse order of the forwards' ends; besides
    the outer unit at most 2 units holding full parameters at any moment, none when a pass returns. Logits,
    losses, gradient shards and weights equal one process's."""
    not_the_course_answer("check_zero3_prefetch", Zero3Unit, course=PACKAGE)
    not_the_course_answer("check_zero3_prefetch", Zero3Prefetch, course=PACKAGE)
    note = (f"{WORLD} ranks, {ZERO3_STEPS} AdamW steps, the last over {ACCUMULATE} micro-batches; units: the outer "
            "one (embedding = LM head, norms), then each layer's attention and MLP. 'async' counts the all-gathers "
            "launched with async_op=True per forward and backward; 'most held' the units, besides the outer one, "
            f"holding full parameters at once (at most {AHEAD})")
    with Report("Zero3Prefetch", note=note) as report:
        try:
            results = on_ranks(_prefetch_on_rank, WORLD, Zero3Unit, Zero3Prefetch, list(ZERO_MODELS))
        except TimeoutError as e:
            raise AssertionError(
                f"Zero3Prefetch did not finish on every rank within {settings.check_timeout:g} s: a rank waited "
                "for a collective the others never made (a deadlock). Every rank must launch the same all-gathers "
                "and reduce-scatters in the same order, each unit's of its own size (the units differ in size "
                f"here). {str(e).splitlines()[0]}") from None
        for i, name in enumerate(ZERO_MODELS):
            per_rank = [rank[i] for rank in results]
            ref = _reference(name, ZERO3_STEPS, prefetch_units)
            with one_thread(), torch.no_grad():
                model = _model(name)
                layout = prefetch_units(model)
                expected = [model(_tokens(name, 0, rank)[:, :-1]) for rank in range(WORLD)]
            names, sizes = [label for label, _, _ in layout], [sum(p.numel() for p in ps) for _, _, ps in layout]
            detail, errors = _prefetch_check_problem(per_rank, ref, sizes, names, expected)
            passes = per_rank[0].get("passes", [])
            report.add(not detail, detail, model=name, units=len(sizes), sizes=str(sizes),
                       **{"async": str(sorted({sum(event == "launch" for event, _ in p["events"]) for p in passes})),
                          "most held": max((p["peak"][0] for p in passes), default="-")},
                       max_logit_err=errors[0], max_grad_err=errors[1], max_weight_err=errors[2])


def _prefetch_on_rank(Zero3Unit: type, Zero3Prefetch: type, names: list) -> list:
    rank, out = dist.get_rank(), []
    # The learner's unit with its own hooks off: Zero3Prefetch wires every unit.
    Unit = type(Zero3Unit.__name__, (Zero3Unit,), {"hook_forward": lambda self: None})
    for name in names:
        model, at = _model(name), {"where": "building the units", "phase": ""}
        try:
            layout = prefetch_units(model)
            units = [Unit(module, params, dist.group.WORLD) for _, module, params in layout]
            prefetch = Zero3Prefetch(units)
            not_the_course_answer("check_zero3_prefetch", prefetch, course=PACKAGE)
            timeline = _Timeline([label for label, _, _ in layout], units)
            timeline.watch_all([module for _, module, _ in layout])

            def one_pass(part, micro, where):
                with recorded_collectives(timeline.observe) as calls, timeline.reads(), timeline.guard_frees():
                    at.update(where=where, phase="forward")
                    timeline.begin("forward", where)
                    output = model(part[:, :-1])
                    timeline.finish()
                    loss = loss_fn(output, part[:, 1:]) / micro   # equal sizes: mean of means
                    at["phase"] = "backward"
                    timeline.begin("backward", where)
                    loss.backward()
                    timeline.finish()
                return loss, output, calls

            out.append({**_train_units(name, rank, units, one_pass), "passes": timeline.passes})
        except WrongCollectiveUse as e:
            out.append({"error": f"{at['where']}{', ' + at['phase'] if at['phase'] else ''}: {e}"})
    return out


def _prefetch_check_problem(per_rank: list, ref: dict, sizes: list, names: list,
                            expected: list) -> tuple[str, tuple[float, float, float]]:
    if "error" in per_rank[0]:
        return per_rank[0]["error"], (math.nan,) * 3
    logit_err = max(max_abs_error(got["logits"], want) for got, want in zip(per_rank, expected))
    problem = _prefetch_problem(per_rank[0]["passes"], names)
    detail, (grad_err, _, weight_err) = _zero3_train_problem(per_rank, ref, sizes)
    errors = (logit_err, grad_err, weight_err)
    if problem:
        return problem, errors
    for rank, (result, want) in enumerate(zip(per_rank, expected)):
        if not close_enough(result["logits"], want, n=ROUNDINGS):
            return (f"step 0: rank {rank}'s logits differ from one process's: {mismatch(result['logits'], want)}. "
                    "Each unit must compute with every rank's shard gathered into unit.full"), errors
    return detail, errors


def _prefetch_problem(passes: list[dict], names: list[str]) -> str:
    """The first rule of the stretch that a pass breaks, read from its events; '' when none does."""
    ends: list[int] = []
    for record in passes:
        if record["phase"] == "forward":
            order = list(range(len(names)))
            ends = [u for event, u in record["events"] if event == "end"]
        else:
            order = ends[::-1]    # backward meets the units in the reverse order of their forwards' ends
        problem = _pass_problem(record, order, names)
        if problem:
            return f"{record['where']}, {record['phase']}: {problem}"
    return ""


def _pass_problem(record: dict, order: list[int], names: list[str]) -> str:
    events, phase = record["events"], record["phase"]
    backward = phase == "backward"
    use = "need" if backward else "start"          # the moment a unit computes with its parameters
    computes = "backward began computing" if backward else "forward started"

    def first(event: str, u: int) -> int | None:
        return next((i for i, (e, v) in enumerate(events) if e == event and v == u), None)

    if any(event in ("gather", "launch") and u is None for event, u in events):
        return ("an all-gather wrote into a tensor that is no unit's `full`: gather each unit's shards straight "
                "into unit.full (the module's parameters are views of it)")
    for u in order:
        count = sum(event in ("gather", "launch") and v == u for event, v in events)
        if count != 1:
            return (f"{names[u]} was all-gathered {count} times: gather each unit exactly once per {phase}. "
                    + ("A unit whose all-gather was prefetched is already on its way: wait on its handle instead of "
                       "gathering it again" if count else f"{names[u]} computes with its parameters: gather it")
                    + (f". {_backward_order(order, names)}" if backward else ""))
    for u in order[1:]:
        if first("gather", u) is not None:
            return (f"{names[u]}'s all-gather was called without async_op=True: it returns only once every shard "
                    f"has arrived, so nothing computes while it travels. Launch it with async_op=True and keep its "
                    f"handle{'; in backward as in forward' if backward else ''}")
    for before, u in zip(order, order[1:]):
        mark = first(use, before)
        if mark is not None and first("launch", u) > mark:
            when = (f"when {names[before]}'s backward starts (the hook on its output's gradient). "
                    f"{_backward_order(order, names)}" if backward else
                    f"from {names[before]}'s forward pre-hook, before {names[before]} computes")
            return (f"{names[u]}'s all-gather was launched after {names[before]}'s {computes}: it cannot travel "
                    f"while {names[before]} computes. Launch it {when}")
    # Each handle waited after the unit ahead computed (a unit computing before its wait was refused on the rank).
    for before, u in zip(order, order[1:]):
        waited, used = first("wait", u), first(use, u)
        if waited is None or used is None:
            continue
        marks = ([first("need", before)] if backward else
                 [i for i, (event, _) in enumerate(events[:used]) if event in ("start", "end")][-1:])
        if marks and marks[0] is not None and waited < marks[0]:
            return (f"{names[u]}'s all-gather was waited before {_describe(events[marks[0]], names)}: waiting so "
                    "early makes the gather synchronous again, nothing computes while it travels. Wait on its "
                    f"handle just before {names[u]} computes")
    count, held, at = record["peak"]
    if count > AHEAD:
        ended = [names[u] for u in held if not backward and first("end", u) is not None and first("end", u) < at]
        ahead = [names[u] for u in held if names[u] not in ended]
        why = (f" The forward of {', '.join(ended)} had ended: free each unit's parameters right after its forward"
               if ended else f" {', '.join(ahead)} were gathered ahead at once: launch only the next unit's all-gather,"
               " one ahead, when a unit is about to compute")
        return (f"{count} units besides the outer one held their full parameters at once "
                f"({', '.join(names[u] for u in held)}), when {_describe(record['events'][at], names)}: at most "
                f"{AHEAD} may, the one computing and the next, whose all-gather is in flight.{why}")
    if record["unwaited"]:
        return (f"the {phase} returned while the all-gather of {', '.join(names[u] for u in record['unwaited'])} was "
                "in flight, never waited: launch only the all-gathers this pass uses, and wait on each handle")
    if record["held_after"]:
        return (f"when the {phase} returned, {', '.join(names[u] for u in record['held_after'])} still held full "
                f"parameters: free each unit right after its {phase}")
    return ""


def _backward_order(order: list[int], names: list[str]) -> str:
    return ("Backward meets the units in the reverse order of their forwards' ends: "
            + ", ".join(names[u] for u in order))


def _describe(event: tuple, names: list[str]) -> str:
    """An event of the timeline in words."""
    what, u = event
    name = names[u] if u is not None else "a tensor"
    words = {"start": f"{name}'s forward started", "end": f"{name}'s forward ended",
             "need": f"{name}'s backward read its weights", "launch": f"{name}'s all-gather was launched",
             "gather": f"{name} was all-gathered", "wait": f"{name}'s handle was waited"}
    return words.get(what, f"a {what} was called")


# ---- predict, then run: ZeRO-1 that does not write the updated shards back ----------------------
DEMO_STEPS = 3
WRITE_BACKS = {"all-gather": "with the all-gather", "none": "no all-gather", "own slice": "own slice only"}


class _AdamW:
    """torch.optim.AdamW's update with its defaults (betas 0.9 and 0.999, eps 1e-8, weight decay 0.01),
    written out: torch.optim's first use imports torch._dynamo, about a second on each of 4 ranks
    sharing 2 cores, which the demo does not need to pay."""

    def __init__(self, params: list, lr: float):
        self.params, self.lr, self.steps = list(params), lr, 0
        self.moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for p, (m, v) in zip(self.params, self.moments):
            p.mul_(1 - self.lr * 0.01)                               # decoupled weight decay
            m.lerp_(p.grad, 1 - 0.9)                                 # running mean of the gradient
            v.mul_(0.999).addcmul_(p.grad, p.grad, value=1 - 0.999)  # ... and of its square
            m_hat, v_hat = m / (1 - 0.9 ** self.steps), v / (1 - 0.999 ** self.steps)
            p.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


class _DemoZero1:
    """Section 2's ZeRO-1, with the write-back after the optimizer step chosen: "all-gather" (right), "none"
    (step() stops after the optimizer), "own slice" (each rank copies its updated shard into its own slice
    of flat_params, and nothing else)."""

    def __init__(self, model: Llama, lr: float, write_back: str):
        self.write_back, self.world, self.rank = write_back, dist.get_world_size(), dist.get_rank()
        params = list(model.parameters())
        self.size = -(-sum(p.numel() for p in params) // self.world)
        self.flat_params = _flat(params, self.world * self.size)   # (padded,): p.data are views of it
        self.flat_grads = torch.zeros_like(self.flat_params)        # (padded,): p.grad are views of it
        offset = 0
        for p in params:
            p.data = self.flat_params[offset:offset + p.numel()].view_as(p)
            p.grad = self.flat_grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.mine = slice(self.rank * self.size, (self.rank + 1) * self.size)
        self.param_shard = nn.Parameter(self.flat_params[self.mine].clone())
        self.optimizer = _AdamW([self.param_shard], lr)

    def step(self) -> None:
        from picotron.comm import all_gather, reduce_scatter
        grad = torch.empty_like(self.param_shard)
        reduce_scatter(grad, self.flat_grads, dist.group.WORLD, op=dist.ReduceOp.AVG)
        self.param_shard.grad = grad
        self.optimizer.step()
        if self.write_back == "all-gather":
            all_gather(self.flat_params, self.param_shard.detach(), dist.group.WORLD)
        elif self.write_back == "own slice":
            self.flat_params[self.mine] = self.param_shard.detach()
        self.flat_grads.zero_()


def _demo_batch(name: str) -> torch.Tensor:
    """The global batch every step of the demo trains on (rank r its share, rows 2r and 2r+1)."""
    return torch.cat([_tokens(name, 0, rank) for rank in range(WORLD)])


def _demo_on_rank(name: str) -> dict:
    rank, out, batch = dist.get_rank(), {}, _demo_batch(name)
    mine = batch[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    for write_back in WRITE_BACKS:
        model = _model(name)
        zero = _DemoZero1(model, LR, write_back)
        start, shard_start = zero.flat_params.clone(), zero.param_shard.detach().clone()
        losses = []
        for step in range(DEMO_STEPS + 1):
            with torch.no_grad():                       # this replica's loss on the whole global batch
                losses.append(loss_fn(model(batch[:, :-1]), batch[:, 1:]).item())
            if step < DEMO_STEPS:
                loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
                zero.step()
        out[write_back] = {"losses": losses, "weights": zero.flat_params.clone(),
                           "moved": (zero.flat_params != start).float().mean().item(),
                           "shard_moved": not torch.equal(zero.param_shard.detach(), shard_start)}
    return out


def _demo_one_process(name: str) -> list[float]:
    """One process, plain AdamW on the global batch: its loss before each step and after the last."""
    with one_thread():
        model, batch = _model(name), _demo_batch(name)
        optimizer, losses = _AdamW(model.parameters(), LR), []
        for step in range(DEMO_STEPS + 1):
            loss = loss_fn(model(batch[:, :-1]), batch[:, 1:])
            losses.append(loss.item())
            if step < DEMO_STEPS:
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        return losses


def zero1_write_back_demo(name: str = "2 layers") -> dict:
    """ZeRO-1 on 4 ranks, DEMO_STEPS AdamW steps on one global batch (each rank its share), three ways of
    writing the updated shards back (WRITE_BACKS), next to one process. Prints each replica's loss on the
    whole batch before each step and after the last, the share of its parameters that moved, whether every
    rank's optimizer shard moved, and whether the replicas are identical. Returns {way: {"losses": [rank][step],
    "moved": [rank], "shard_moved": [rank], "identical": bool}, "one process": [step]}."""
    per_rank = on_ranks(_demo_on_rank, WORLD, name)
    table = {"one process": _demo_one_process(name)}
    for way in WRITE_BACKS:
        runs = [rank[way] for rank in per_rank]
        table[way] = {"losses": [run["losses"] for run in runs], "moved": [run["moved"] for run in runs],
                      "shard_moved": [run["shard_moved"] for run in runs],
                      "identical": all(torch.equal(run["weights"], runs[0]["weights"]) for run in runs)}
    print(f"ZeRO-1 on {WORLD} ranks: {DEMO_STEPS} AdamW steps (lr {LR:g}) on one batch of {WORLD * BATCH_PER_RANK} "
          f"sequences, {BATCH_PER_RANK} per rank. Each replica's loss on the whole batch:")
    print(f"{'':<33}" + "".join(f"{'before' if s == 0 else f'step {s}':>8}" for s in range(DEMO_STEPS + 1))
          + f"{'weights moved':>15}{'shard moved':>13}")
    print(f"{'one process':<33}" + "".join(f"{x:>8.4f}" for x in table["one process"]) + f"{'100%':>15}")
    for way, label in WRITE_BACKS.items():
        row = table[way]
        for r in ([0] if row["identical"] else range(WORLD)):
            who = "every rank" if row["identical"] else f"rank {r}"
            print(f"{label if r == 0 else '':<21}{who:<12}" + "".join(f"{x:>8.4f}" for x in row["losses"][r])
                  + f"{row['moved'][r]:>15.0%}{'yes' if row['shard_moved'][r] else 'no':>13}")
    print("replicas identical: " + ", ".join(f"{label} {'yes' if table[way]['identical'] else 'no'}"
                                            for way, label in WRITE_BACKS.items()))
    return table

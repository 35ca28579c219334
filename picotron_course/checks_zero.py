"""The checks of assignment 03: ZeRO-1 and ZeRO-3, each rank keeping 1/N of the model's state, declared on the
course's engine (picotron_course.engine).

Each check runs the learner's code (on 4 ranks where it communicates), observes what it did and compares it with
single-process torch computed here, in the parent: one plain Llama trained with plain AdamW on the whole global
batch, its gradients cut into the shards each rank should own. Nothing here uses picotron.parallel.zero.

    check_shard_range(shard_range)        equal shards of a buffer padded to a multiple of N (one process)
    check_zero1(Zero1)                    5 AdamW steps: reduce-scatter, step the shard, all-gather
    check_zero3_forward(Zero3Unit)        one forward: every unit gathered before, freed after
    check_zero3_training(Zero3Unit)       4 AdamW steps on the shards, the last over 2 micro-batches: gathered
                                          again for backward, gradients reduce-scattered into the shards
    check_clip_grad_norm(clip)            the global norm of sharded gradients, one all-reduce of one number
    check_zero3_prefetch(Zero3Unit,       (stretch) ZeRO-3 with prefetch over prefetch_units: its rules read
                         Zero3Prefetch)   from the order of events (launch, wait, forward start and end, ...)

and `zero1_write_back_demo()`, the predict-then-run problem (ZeRO-1 without the all-gather back).

On the ranks, `recorded_collectives` notes every collective call, compared in words with the calls expected, and
refuses (WrongCollectiveUse, with what to fix) those that would crash or hang; `_Guard` and the stretch's
`_Timeline` refuse a unit that computes without memory, or before its all-gather was waited. After each check come
its misconceptions, wrong answers learners write with the hint each should read; `_Zero1`, `_Unit` and `_Prefetch`
are the correct bases they change.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import tolerance
from picotron.config import ModelConfig
from picotron.model import Llama, loss_fn
from picotron_course.checks import collectives_observed, on_ranks, one_thread
from picotron_course.checks import patched, reduce_name
from picotron_course.engine import (Check, Close, Exact, InTraining, Misconception, Said, Within, named,
                                    observe_on_ranks, per_case, world_and_halves)

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
COURSE = (PACKAGE, __name__)   # picotron's answers, and the correct bases of this file's misconceptions
ONLY = {__name__: {"_Zero1", "_Unit", "_Prefetch"}}
AVG = dist.ReduceOp.AVG


# ---- running the answers on the ranks ----------------------------------------------------------
def _on_ranks(run_case: Callable, after: Callable | None = None, deadlock: str = "", **groups) -> Callable:
    """observe (engine.observe_on_ranks, `groups` its groups and key): run_case(answer, case, at, *groups) of every
    answer on every case on WORLD ranks in one launch, as [answer][case] dicts of lists over the ranks; after(got,
    case) makes what is compared of them. A rank that refuses a call (WrongCollectiveUse) observes only "refused":
    where it was (at["where"]), then what it said."""
    observe = observe_on_ranks(WORLD, functools.partial(_refusing, run_case), deadlock=deadlock, **groups)
    return lambda answers, cases: [[after(got, case) if after else got for got, case in zip(one, cases)]
                                   for one in observe(answers, cases)]


def _refusing(run_case: Callable, answer, case: dict, *groups) -> dict:
    at = {"where": ""}
    try:
        return {"refused": "", **run_case(answer, case, at, *groups)}
    except WrongCollectiveUse as e:
        return {"refused": f"{at['where']}{e}"}


def _variant(base: type, name: str, **changed) -> type:
    """A misconception written as the correct `base` with one method or attribute changed (as engine.named writes
    a lambda), under `name`: assigned to that name in this module, the ranks import it as they do a class."""
    return type(name, (base,), {"__module__": __name__, "__qualname__": name, **changed})


# ---- recording the collectives a rank makes ---------------------------------------------------
class WrongCollectiveUse(AssertionError):
    """A collective called with arguments that would crash or hang it; the message says what to fix."""


@dataclass
class Call:
    """One collective call: the operation, the payload bytes this rank handed in, the reduction, how many
    elements the payload held, whether it was launched asynchronously (async_op=True), the ranks of its group."""
    op: str
    nbytes: int
    reduce: str = ""
    numel: int = 0
    async_op: bool = False
    ranks: int = 0


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
                          sum(t.numel() for t in tensors), bool(arguments.get("async_op", False)),
                          dist.get_world_size(arguments.get("group"))))

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


def _in_bytes(calls: list[Call]) -> list[str]:
    """The calls as the ZeRO checks compare them: operation and payload, sorted, repeats counted."""
    return _counted(f"{call.op} of {call.nbytes} B" for call in calls)


def _counted(said) -> list[str]:
    return sorted(f"{n} x {words}" if n > 1 else words for words, n in Counter(said).items())


def _calls(counted: list[str]) -> int:
    return sum(int(words.split(" x ")[0]) if " x " in words else 1 for words in counted)


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


def _viewed(params: list, padded: int, *attributes: str) -> list[torch.Tensor]:
    """Flat buffers of `padded` elements, one per attribute ("data": the parameters, "grad": zeros), each
    parameter's attribute a view of its slice."""
    flats = [_flat(params, padded) if attribute == "data" else torch.zeros(padded) for attribute in attributes]
    offset = 0
    for p in params:
        for attribute, flat in zip(attributes, flats):
            setattr(p, attribute, flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return flats


@functools.cache
def _reference(name: str, steps: int, layout: Callable = None) -> dict:
    """One process, the whole global batch, plain AdamW: losses, every parameter's gradient at each
    step, the final parameters; and the same in ZeRO-3 units (`layout(model)`: unit_params or prefetch_units)."""
    with one_thread():
        model = _model(name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        params = list(model.parameters())
        units = [unit for _, _, unit in (layout or unit_params)(model)]
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
        return {"losses": torch.tensor(losses, dtype=torch.float64), "grads": grads, "weights": _flat(params),
                "unit_grads": unit_grads, "unit_weights": [_flat(unit) for unit in units]}


@functools.cache
def _sizes(name: str, layout: Callable = None) -> list[int]:
    """The elements of each ZeRO-3 unit of a model."""
    return [sum(p.numel() for p in params) for _, _, params in (layout or unit_params)(_model(name))]


@functools.cache
def _logits(name: str) -> list[torch.Tensor]:
    """One process's logits of each rank's batch of step 0."""
    with one_thread(), torch.no_grad():
        model = _model(name)
        return [model(_tokens(name, 0, rank)[:, :-1]) for rank in range(WORLD)]


def _shard(flat: torch.Tensor, rank: int) -> torch.Tensor:
    size = flat.numel() // WORLD
    return flat[rank * size:(rank + 1) * size]


def _state_numel(optimizer) -> int:
    """Elements of optimizer state (AdamW: exp_avg, exp_avg_sq; the 0-d step counters not counted)."""
    return sum(t.numel() for state in optimizer.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _mean_losses(got: dict, case: dict) -> dict:
    """The ranks' losses as their mean, what one process's loss of the global batch is."""
    return got | ({"losses": torch.tensor(got["losses"], dtype=torch.float64).mean(0)} if "losses" in got else {})


def _rank0(got: dict, key: str, shown: Callable = lambda value: value):
    """What rank 0 observed, for a column of the table ("-" when it observed nothing)."""
    values = got.get(key)
    return shown(values[0]) if values and values[0] is not None else "-"


# ---- 1. shard_range -----------------------------------------------------------------------------
SHARD_CASES = [(12, 4), (13, 4), (3, 4), (1, 2), (7, 3), (26784, 4), (1350, 4), (10, 1)]


def _as_pair(answer):
    """(start, stop) as two Python ints when `answer` is any pair of whole numbers (a tuple, a list, numpy or
    torch integers); otherwise None."""
    if isinstance(answer, torch.Tensor) and answer.numel() == 2 and not answer.is_floating_point():
        answer = answer.tolist()
    if isinstance(answer, (tuple, list)) and len(answer) == 2 and not any(isinstance(x, (bool, float)) for x in answer):
        try:
            return tuple(operator.index(x) for x in answer)
        except TypeError:
            pass
    return None


def _ranges(shard_range: Callable, numel: int, world: int, **_) -> dict:
    returned = [shard_range(numel, rank, world) for rank in range(world)]
    pairs = [_as_pair(answer) for answer in returned]
    return {"returned": ["two ints" if pair else repr(answer)[:60] for pair, answer in zip(pairs, returned)],
            "sizes": [pair and pair[1] - pair[0] for pair in pairs], "starts": [pair and pair[0] for pair in pairs],
            "actual": [pair or answer for pair, answer in zip(pairs, returned)]}


def _expect_ranges(case: dict, observed: dict) -> dict:
    k, world = case["padded"] // case["world"], case["world"]
    return {"returned": ["two ints"] * world, "sizes": [k] * world, "starts": [r * k for r in range(world)]}


def _short(pairs: list) -> str:
    text = str([tuple(a) if isinstance(a, (list, tuple)) else a for a in pairs])
    return text if len(text) <= 48 else text[:45] + "..."


def sr_floor(numel, rank, world):
    size = numel // world  # rounds down: the last numel % world elements belong to nobody
    return rank * size, (rank + 1) * size


def sr_uneven(numel, rank, world):
    size, extra = divmod(numel, world)  # torch.tensor_split's cut: sizes differ by one
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


SHARD_RANGE = Check(
    "shard_range", observe=lambda answers, cases: [[_ranges(f, **case) for case in cases] for f in answers],
    expect=_expect_ranges, note="one process: (start, stop) of every rank's shard",
    cases=[dict(numel=n, world=w, padded=-(-n // w) * w) for n, w in SHARD_CASES],
    columns=lambda case, got: {"expected": _short([(r * case["padded"] // case["world"], (r + 1) * case["padded"]
                                                    // case["world"]) for r in range(case["world"])]),
                               "actual": _short(got["actual"])},
    quantities={"returned": Exact("what shard_range(numel, rank, world) returned: (start, stop), two ints",
                                  axes=("rank {}",)),
                "sizes": Exact("the size of each rank's shard, stop - start: every shard the same, k = ceil(numel / "
                               "world), so that reduce-scatter and all-gather cut the padded buffer into equal "
                               "pieces", axes=("rank {}",)),
                "starts": Exact("where each shard starts: shard 0 at 0, shard r+1 where shard r stops (rank r owns "
                                "[r*k, (r+1)*k))", axes=("rank {}",))},
    misconceptions=[
        Misconception(sr_uneven, "every shard must have the same size, ceil(numel / world), so that reduce-scatter "
                                 "and all-gather cut the buffer into equal pieces (pad the buffer, not the shards)"),
        Misconception(sr_floor, "world shards of numel // world elements cover only part of the buffer: round the "
                                "shard size up, k = ceil(numel / world); the padding then sits at the end of the last "
                                "shards")])


def check_shard_range(shard_range: Callable[[int, int, int], tuple]) -> None:
    """Rank r of `world` owns elements [r*k, (r+1)*k) with k = ceil(numel / world): equal shards of
    the buffer padded to world*k elements, the padding in the last shards."""
    SHARD_RANGE(shard_range)


# ---- 2. ZeRO-1 -----------------------------------------------------------------------------------
def _zero1_case(Zero1: type, case: dict, at: dict) -> dict:
    rank, name, model = dist.get_rank(), case["model"], _model(case["model"])
    zero = Zero1(model, dist.group.WORLD, LR)
    ZERO1.refuse(Zero1, zero)
    at["where"], got, seen = "step(): ", {"losses": [], "grads": [], "collectives": []}, []
    # param_shard.grad as the optimizer sees it, when step() calls it (step() may drop it afterwards)
    zero.optimizer.register_step_pre_hook(functools.partial(_grad_at_step, zero, seen))
    for step in range(ZERO1_STEPS):
        tokens = _tokens(name, step, rank)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        got["losses"].append(loss.item())
        seen.clear()
        with recorded_collectives() as calls:
            zero.step()
        got["collectives"].append(_in_bytes(calls))
        got["grads"].append(seen[-1] if seen else "step() never called self.optimizer.step(), the AdamW over "
                                                  "param_shard that __init__ made")
        zero.zero_grad()
    return got | {"state": _state_numel(zero.optimizer), "weights": _flat(list(model.parameters()))}


def _grad_at_step(zero, seen: list, optimizer, args, kwargs) -> None:
    grad = getattr(getattr(zero, "param_shard", None), "grad", None)
    seen.append(grad.detach().clone() if grad is not None else "param_shard.grad was None when step() called "
                "self.optimizer.step(): give the optimizer the averaged gradient shard (self.param_shard.grad = ...) "
                "before that call")


def _expect_zero1(case: dict, observed: dict) -> dict:
    ref = _reference(case["model"], ZERO1_STEPS)
    padded = ref["grads"][0].numel()
    calls = [f"all_gather of {padded // WORLD * 4} B", f"reduce_scatter of {padded * 4} B"]
    return {"refused": [""] * WORLD, "state": [2 * padded // WORLD] * WORLD,
            "collectives": [[calls] * ZERO1_STEPS] * WORLD,
            "grads": [[_shard(g, rank) for g in ref["grads"]] for rank in range(WORLD)], "losses": ref["losses"],
            "weights": [ref["weights"]] * WORLD}


def _zero1_columns(case: dict, got: dict) -> dict:
    padded = _reference(case["model"], ZERO1_STEPS)["grads"][0].numel()
    return {"params": _reference(case["model"], ZERO1_STEPS)["weights"].numel(), "padded": padded,
            "state/rank": _rank0(got, "state"), "2 x shard": 2 * padded // WORLD,
            "payloads of a step (rank 0)": _rank0(got, "collectives", lambda steps: ", ".join(steps[0]))}


class _Zero1:
    """The correct Zero1 the misconceptions below change (refused as an answer): parameters and gradients are
    views of two padded flat buffers; AdamW over this rank's slice."""
    Optimizer = torch.optim.AdamW   # the write-back demo's: _AdamW, which does not import torch._dynamo
    op = AVG                        # the reduction of the gradients (Zero1Sums: SUM)

    def __init__(self, model, group, lr):
        self.group, world, rank = group, dist.get_world_size(group), dist.get_rank(group)
        params = list(model.parameters())
        self.numel = sum(p.numel() for p in params)
        size = -(-self.numel // world)
        self.flat_params, self.flat_grads = _viewed(params, world * size, "data", "grad")
        self.mine = slice(rank * size, (rank + 1) * size)
        self.param_shard = nn.Parameter(self.flat_params[self.mine].clone())
        self.optimizer = self.Optimizer([self.param_shard], lr=lr)

    def step(self):
        self.param_shard.grad = self.reduce(self.flat_grads)
        self.optimizer.step()
        self.gather()

    def reduce(self, flat):
        shard = torch.empty_like(self.param_shard)
        dist.reduce_scatter_tensor(shard, flat, op=self.op, group=self.group)
        return shard

    def gather(self):
        dist.all_gather_into_tensor(self.flat_params, self.param_shard.detach(), group=self.group)

    def zero_grad(self):
        self.flat_grads.zero_()


class Zero1WholeModel(_Zero1):
    """Plain data parallelism in ZeRO's clothes: every rank keeps AdamW state for every parameter."""

    def __init__(self, model, group, lr):
        super().__init__(model, group, lr)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self):
        dist.all_reduce(self.flat_grads, op=AVG, group=self.group)
        self.optimizer.step()


class Zero1AllReduce(_Zero1):
    def reduce(self, flat):
        dist.all_reduce(flat, op=AVG, group=self.group)  # the whole mean everywhere, then a slice of it
        return flat[self.mine].clone()


class Zero1NoAllGather(_Zero1):
    def gather(self):  # the updated shard goes back into this rank's slice only
        self.flat_params[self.mine] = self.param_shard.detach()


# param_shard requires grad: torch refuses to write it into flat_params' views
Zero1NoDetach = _variant(_Zero1, "Zero1NoDetach", gather=lambda self: dist.all_gather_into_tensor(
    self.flat_params, self.param_shard, group=self.group))
# the gradients of the parameters only, without the padding
Zero1Unpadded = _variant(_Zero1, "Zero1Unpadded", reduce=lambda self, flat: _Zero1.reduce(self, flat[:self.numel]))
Zero1Sums = _variant(_Zero1, "Zero1Sums", op=dist.ReduceOp.SUM)   # sum, never divided


ZERO1 = Check(
    "Zero1", observe=_on_ranks(_zero1_case, _mean_losses), expect=_expect_zero1, course=COURSE, only=ONLY,
    note=(f"{WORLD} ranks, {ZERO1_STEPS} AdamW steps. Payload per step: the reduce-scatter takes the whole padded "
          "gradient buffer, the all-gather one shard (wire: (N-1)/N of the buffer each, together the 2(N-1)/N of "
          "data parallelism's all-reduce)"),
    cases=[dict(model=name) for name in ZERO_MODELS], columns=_zero1_columns,
    quantities={
        "refused": Said("stopped before a collective that would crash or hang", axes=("rank {}",)),
        "state": Exact("the elements of AdamW state in each rank's optimizer: the two moments of its shard, 2 x shard "
                       "(none: AdamW makes its state at its first step, for parameters that have a gradient; set "
                       "self.param_shard.grad, then call self.optimizer.step())", axes=("rank {}",)),
        "collectives": Exact("the collectives of each step() and their payloads: one reduce-scatter of the whole "
                             "padded flat gradient buffer into this rank's gradient shard, one all-gather of this "
                             "rank's updated param_shard into flat_params, nothing else", axes=("rank {}", "step {}")),
        "grads": InTraining("param_shard.grad when step() called self.optimizer.step(), against this rank's shard of "
                            "the gradient averaged over ranks", axes=("rank {}", "step {}")),
        "losses": Within("the losses (mean over ranks), against one process's", atol=tolerance.LOSS_ATOL),
        "weights": Within(f"the weights after {ZERO1_STEPS} steps, against one process's: every rank must end each "
                          "step with every rank's updated shard in flat_params", atol=WEIGHT_TOL, axes=("rank {}",))},
    misconceptions=[
        Misconception(Zero1WholeModel, "each rank's optimizer holds AdamW's two moments for the whole model: each "
                                       "rank must step only its shard (self.optimizer over self.param_shard), not "
                                       "every parameter"),
        Misconception(Zero1NoDetach, "all-gather param_shard.detach(): collectives do not go through autograd, and "
                                     "torch refuses to write a tensor that requires grad into flat_params' views"),
        Misconception(Zero1Unpadded, "reduce-scatter the whole padded flat gradient buffer: its input must hold "
                                     "exactly world x the shard, so pad the flat buffer with zeros to a multiple of "
                                     "the world size"),
        Misconception(Zero1AllReduce, "reduce-scatter the flat gradients, do not all-reduce them: every rank would "
                                      "get the whole averaged gradient, but it steps only its shard; with a "
                                      "reduce-scatter each rank receives just its shard, and sends half the bytes"),
        Misconception(Zero1NoAllGather, "each rank updated only its own shard, so the others' parts of the model are "
                                        "stale: all-gather every rank's updated param_shard into flat_params"),
        Misconception(Zero1Sums, "param_shard.grad looks like the sum over ranks: average, op=ReduceOp.AVG or divide "
                                 "by the world size")])


def check_zero1(Zero1: type) -> None:
    """5 AdamW steps on 4 ranks: each rank's gradient shard is the mean over ranks of its slice, its
    optimizer holds state for 1/N of the parameters, one reduce-scatter of the flat gradients and
    one all-gather of the shards per step (no all-reduce), weights equal one process's."""
    ZERO1(Zero1)


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


def _build_units(check: Check, Zero3Unit: type, model: Llama, guard: _Guard) -> list:
    units = []
    for label, module, params in unit_params(model):
        units.append(Zero3Unit(module, params, dist.group.WORLD))
        guard.watch(label, module, params)
    check.refuse(Zero3Unit, *units)
    return units


def _held(units: list) -> int:
    """Bytes of memory behind the units' full parameters (each storage counted once)."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for u in units for p in u.params}.values())


def _forward_case(Zero3Unit: type, case: dict, at: dict) -> dict:
    model, tokens = _model(case["model"]), _tokens(case["model"], 0, dist.get_rank())
    units = _build_units(FORWARD, Zero3Unit, model, _Guard())
    with recorded_collectives() as calls:
        logits = model(tokens[:, :-1])
    return {"shards": [unit.shard.numel() for unit in units], "held": _held(units), "collectives": _in_bytes(calls),
            "logits": logits.detach().clone()}


def _expect_forward(case: dict, observed: dict) -> dict:
    shards = [_padded(n) // WORLD for n in _sizes(case["model"])]
    return {"refused": [""] * WORLD, "shards": [shards] * WORLD, "held": [0] * WORLD,
            "collectives": [_counted(f"all_gather of {4 * shard} B" for shard in shards)] * WORLD,
            "logits": _logits(case["model"])}


class _Unit:
    """The correct Zero3Unit the misconceptions below change (refused as an answer): one module's parameters as
    views of a padded flat buffer; this rank keeps 1/N of it."""
    op = AVG   # the reduction of the gradients (UnitSums: SUM)

    def __init__(self, module, params, group):
        self.module, self.params, self.group = module, list(params), group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        size = -(-sum(p.numel() for p in self.params) // world)
        self.full, = _viewed(self.params, world * size, "data")
        self.shard = nn.Parameter(self.full[rank * size:(rank + 1) * size].clone())
        self.pending = len(self.params)
        self.hook_forward()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)
        self.free()

    def hook_forward(self):
        self.module.register_forward_pre_hook(lambda module, args: self.gather())
        self.module.register_forward_hook(self.post_forward)

    def post_forward(self, module, args, output):
        self.free()
        if output.requires_grad:
            output.register_hook(lambda grad: self.gather())

    def grad_ready(self, param):
        self.pending -= 1
        if not self.pending:
            self.pending = len(self.params)
            self.reduce_grads()
            self.free()

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * 4)
        dist.all_gather_into_tensor(self.full, self.shard.detach(), group=self.group)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def flat_grad(self):
        return _flat([p.grad for p in self.params], self.full.numel())

    def reduce_grads(self):
        shard = self.scatter(self.flat_grad())
        self.shard.grad = shard if self.shard.grad is None else self.shard.grad + shard
        self.drop()

    def scatter(self, flat):
        shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard, flat, op=self.op, group=self.group)
        return shard

    def drop(self):
        for p in self.params:
            p.grad = None


UnitNeverFrees = _variant(_Unit, "UnitNeverFrees", free=lambda self: None)
# forgets to give the buffer its memory back
UnitGathersIntoFreedMemory = _variant(_Unit, "UnitGathersIntoFreedMemory", gather=lambda self: (
    dist.all_gather_into_tensor(self.full, self.shard.detach(), group=self.group)))
UnitNoForwardGather = _variant(_Unit, "UnitNoForwardGather",
                               hook_forward=lambda self: self.module.register_forward_hook(self.post_forward))


FORWARD = Check(
    "Zero3Unit forward", observe=_on_ranks(_forward_case), expect=_expect_forward, course=COURSE, only=ONLY,
    note=(f"{WORLD} ranks, one forward; units: one per decoder layer + one for the rest of the model. 'held after' "
          "is the memory behind the units' full parameters once forward returned: 0 when freed"),
    cases=[dict(model=name) for name in ZERO_MODELS],
    columns=lambda case, got: {"units": len(_sizes(case["model"])), "shard numels": _rank0(got, "shards"),
                               "all-gathers": _rank0(got, "collectives", _calls),
                               "held after (B)": _rank0(got, "held")},
    quantities={
        "refused": Said("stopped before it could crash", axes=("rank {}",)),
        "shards": Exact(f"the elements of each unit's shard: 1/{WORLD} of the unit's padded parameters, nothing more",
                        axes=("rank {}",)),
        "held": Exact("the bytes still behind the units' full parameters once forward returned: free_params must "
                      "release unit.full's memory (unit.full.untyped_storage().resize_(0)) and hook_forward must "
                      "call it from a forward hook, after the module's forward", axes=("rank {}",)),
        "collectives": Exact("the collectives of one forward and their payloads: one all-gather per unit, of its "
                             "shard (gather_params all-gathers every rank's unit.shard into unit.full)",
                             axes=("rank {}",)),
        "logits": Close("the logits, against one process's: each unit must gather every rank's shard, in rank order, "
                        "into unit.full", n=ROUNDINGS, axes=("rank {}",))},
    misconceptions=[
        Misconception(UnitNeverFrees, "the full parameters still hold memory after forward: free_params must release "
                                      "unit.full's memory (unit.full.untyped_storage().resize_(0)), called from a "
                                      "forward hook"),
        Misconception(UnitGathersIntoFreedMemory, "give unit.full its memory back before the all-gather writes into "
                                                  "it: unit.full.untyped_storage().resize_(numel * element_size)"),
        Misconception(UnitNoForwardGather, "a module starts its forward with parameters that have no memory: "
                                           "hook_forward must call gather_params from a forward pre-hook")])


def check_zero3_forward(Zero3Unit: type) -> None:
    """One forward on 4 ranks: each unit all-gathers its shard once before its module runs and frees
    the full parameters after; the logits equal one process's, and no full parameter is left."""
    FORWARD(Zero3Unit)


# ---- 4. ZeRO-3 training ----------------------------------------------------------------------------
def _micro_batches(step: int) -> int:
    """Micro-batches of a training step of the ZeRO-3 check: the last step accumulates gradients over 2."""
    return ACCUMULATE if step == ZERO3_STEPS - 1 else 1


NO_GRAD = "None (reduce_scatter_grads must put the averaged gradient shard in unit.shard.grad)"
PASSES = sum(_micro_batches(step) for step in range(ZERO3_STEPS))   # forwards and backwards, one per micro-batch


def _train_units(model: Llama, name: str, units: list, at: dict, guard: _Guard) -> dict:
    """ZERO3_STEPS AdamW steps over the units' shards, the last over ACCUMULATE micro-batches, with what the
    ZeRO-3 checks compare: the first logits, each step's loss and gradient shards, each pass's collectives, the
    bytes held after it and the full gradients left in p.grad, and this rank's part of the final weights (its
    shards without the padding). Each micro-batch's forward and backward run under the recorders and the guard
    (the stretch's timeline, when it is one), `at` saying where they are."""
    rank, optimizer = dist.get_rank(), torch.optim.AdamW([unit.shard for unit in units], lr=LR)
    got = {"logits": None, "losses": [], "grads": [], "collectives": [], "held": [], "full grads": []}
    timeline = guard if isinstance(guard, _Timeline) else None

    def phase(name: str, where: str, run: Callable):
        at["where"] = f"{where}, {name}: "
        if timeline:
            timeline.begin(name, where)
        result = run()
        if timeline:
            timeline.finish()
        return result

    for step in range(ZERO3_STEPS):
        micro = _micro_batches(step)
        step_loss = 0.0
        for i, part in enumerate(_tokens(name, step, rank).chunk(micro)):  # no zero_grad in between
            where = f"step {step}" + (f", micro-batch {i}" if micro > 1 else "")
            frees = timeline.guard_frees() if timeline else nullcontext()
            with recorded_collectives(timeline and timeline.observe) as calls, guard.reads(), frees:
                output = phase("forward", where, lambda: model(part[:, :-1]))
                loss = loss_fn(output, part[:, 1:]) / micro   # equal sizes: mean of means
                phase("backward", where, loss.backward)
            if got["logits"] is None:
                got["logits"] = output.detach().clone()
            step_loss += loss.item()
            got["collectives"].append(_in_bytes(calls))        # per forward and backward pass
            got["held"].append(_held(units))
            got["full grads"].append(sum(p.grad.numel() for unit in units for p in unit.params if p.grad is not None))
        got["losses"].append(step_loss)
        got["grads"].append([unit.shard.grad.detach().clone() if unit.shard.grad is not None else NO_GRAD
                             for unit in units])
        optimizer.step()
        optimizer.zero_grad()
    numels = [sum(p.numel() for p in unit.params) for unit in units]
    got["weights"] = [unit.shard.detach()[:max(0, n - rank * unit.shard.numel())].clone()
                      for unit, n in zip(units, numels)]
    return got


def _trained(got: dict, case: dict) -> dict:
    """The mean of the ranks' losses, and the weights of each unit, every rank's shard put together."""
    got = _mean_losses(got, case)
    return got | ({"weights": [torch.cat(parts) for parts in zip(*got["weights"])]} if "weights" in got else {})


def _train_case(Zero3Unit: type, case: dict, at: dict) -> dict:
    model, guard = _model(case["model"]), _Guard()
    units = _build_units(TRAINING, Zero3Unit, model, guard)
    return _train_units(model, case["model"], units, at, guard)


def _expect_training(layout: Callable = None) -> Callable:
    def expect(case: dict, observed: dict) -> dict:
        name = case["model"]
        ref, sizes = _reference(name, ZERO3_STEPS, layout), _sizes(name, layout)
        calls = _counted([f"all_gather of {_padded(n) // WORLD * 4} B" for n in sizes] * 2
                       + [f"reduce_scatter of {_padded(n) * 4} B" for n in sizes])
        return {"refused": [""] * WORLD, "held": [[0] * PASSES] * WORLD, "full grads": [[0] * PASSES] * WORLD,
                "collectives": [[calls] * PASSES] * WORLD, "logits": _logits(name),
                "grads": [[[_shard(g, rank) for g in step] for step in ref["unit_grads"]] for rank in range(WORLD)],
                "losses": ref["losses"], "weights": ref["unit_weights"], **{rule: [[]] * WORLD for rule in RULES}}
    return expect


TRAINED = {   # what a ZeRO-3 training run is compared by, after anything a rank refused
    "held": Exact("the bytes still behind the units' full parameters after each forward and backward: once a unit's "
                  "gradients are reduce-scattered its parameters must be freed (free_params), and each unit's backward "
                  "gather freed the same way", axes=("rank {}", "pass {}")),
    "full grads": Exact("the elements of full gradients left in p.grad after each backward: reduce_scatter_grads must "
                        "drop them (p.grad = None) once their average is in the shard", axes=("rank {}", "pass {}")),
    "collectives": Exact("the collectives of each forward and backward and their payloads: per unit two all-gathers "
                         "of its shard (before its forward, before its backward) and one reduce-scatter of its whole "
                         "padded flat gradient, nothing else", axes=("rank {}", "pass {}")),
    "logits": Close("the logits of step 0, against one process's: each unit must compute with every rank's shard "
                    "gathered into unit.full", n=ROUNDINGS, axes=("rank {}",)),
    "grads": InTraining("each unit's shard.grad after each step's backward, against this rank's shard of the gradient "
                        "averaged over ranks (the last step: the sum over its micro-batches, no zero_grad between "
                        "them)", axes=("rank {}", "step {}", "unit {}")),
    "losses": Within("the losses (mean over ranks), against one process's", atol=tolerance.LOSS_ATOL),
    "weights": Within(f"the weights after {ZERO3_STEPS} steps (every rank's shards put together), against one "
                      "process's", atol=WEIGHT_TOL, axes=("unit {}",))}


UnitNoBackwardGather = _variant(_Unit, "UnitNoBackwardGather",
                                post_forward=lambda self, module, args, output: self.free())
UnitUnpadded = _variant(_Unit, "UnitUnpadded",
                        flat_grad=lambda self: torch.cat([p.grad.reshape(-1) for p in self.params]))
# the p.grad stay: a full gradient on every rank
UnitKeepsFullGrads = _variant(_Unit, "UnitKeepsFullGrads", drop=lambda self: None)
UnitSums = _variant(_Unit, "UnitSums", op=dist.ReduceOp.SUM)   # sum, never divided


class UnitAllReduce(_Unit):
    def scatter(self, flat):
        dist.all_reduce(flat, op=AVG, group=self.group)
        rank, size = dist.get_rank(self.group), self.shard.numel()
        return flat[rank * size:(rank + 1) * size].clone()


class UnitOverwritesGrad(_Unit):
    def reduce_grads(self):
        self.shard.grad = self.scatter(self.flat_grad())  # the micro-batch before is lost
        self.drop()


SUMS = "the gradient shards look like the sum over ranks: average, op=ReduceOp.AVG or divide by the world size"
TRAINING = Check(
    "Zero3Unit training", observe=_on_ranks(_train_case, _trained), expect=_expect_training(), course=COURSE,
    only=ONLY, cases=[dict(model=name) for name in ZERO_MODELS],
    note=(f"{WORLD} ranks, {ZERO3_STEPS} AdamW steps over the units' shards, the last over {ACCUMULATE} "
          "micro-batches (passes 3 and 4: a pass is one forward and backward). Per pass each unit all-gathers its "
          "shard twice and reduce-scatters its gradient once: the Playbook's 3 x Psi"),
    columns=lambda case, got: {"units": len(_sizes(case["model"])),
                               "collectives/pass": _rank0(got, "collectives", lambda passes: _calls(passes[0])),
                               "held after (B)": _rank0(got, "held", max)},
    quantities={"refused": Said("stopped before it could crash or hang", axes=("rank {}",)), **TRAINED},
    misconceptions=[
        Misconception(UnitNoBackwardGather, "a module runs its backward with parameters that have no memory: gather "
                                            "them again before the module's backward. In the forward hook, register "
                                            "a hook on the output (output.register_hook) that calls gather_params"),
        Misconception(UnitUnpadded, "reduce-scatter the whole padded flat gradient: pad it with zeros to a multiple "
                                    "of the world size, so that the input holds exactly world x the shard"),
        Misconception(UnitKeepsFullGrads, "the full gradients stay in p.grad on every rank: reduce_scatter_grads must "
                                          "drop them (p.grad = None) once their average is in the shard"),
        Misconception(UnitAllReduce, "reduce_scatter_grads called all-reduce: every rank would get the whole averaged "
                                     "gradient but keeps only its shard. Reduce-scatter the flat gradient instead: "
                                     "each rank receives just its shard, half the bytes of an all-reduce"),
        Misconception(UnitSums, SUMS),
        Misconception(UnitOverwritesGrad, "the last step ran 2 micro-batches with no zero_grad between them, and "
                                          "shard.grad is not the sum of their averaged gradient shards: add the new "
                                          "shard to unit.shard.grad when a gradient is already there")])


def check_zero3_training(Zero3Unit: type) -> None:
    """4 AdamW steps on the units' shards, 4 ranks, the last step over 2 micro-batches with no zero_grad
    between them: after each step's backward every shard's gradient is the mean over ranks of its slice
    (over the whole step's batch), no full parameter or full gradient is left after any backward; per
    forward and backward 2 all-gathers and 1 reduce-scatter per unit, no all-reduce; losses and weights
    equal one process's."""
    TRAINING(Zero3Unit)


# ---- 5. clipping sharded gradients by the global norm --------------------------------------------
JUNK = 100.0          # what the check writes into the padding of every shard's gradient
CLIP_EPS = 1e-6       # torch.nn.utils.clip_grad_norm_: coefficient = max_norm / (norm + 1e-6), at most 1


def _random_buffers(numels: list[int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) * (i + 1) for i, n in enumerate(numels)]


@functools.cache
def _clip_cases() -> list[tuple[list, float]]:
    """(buffers, max_norm) of each row of CLIP's cases. The buffers: flat, unpadded averaged gradients. The odd
    model's: the averaged gradient of each of its ZeRO-3 units on the global batch of step 0 (710 and 640
    elements); on 4 ranks, buffers of 3, 13 and 1 elements leave whole shards of padding."""
    with one_thread():
        model = _model("odd sizes")
        batch = torch.cat([_tokens("odd sizes", 0, rank) for rank in range(WORLD)])
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        units = [_flat([p.grad for p in params]) for _, _, params in unit_params(model)]
    tiny, pairs = _random_buffers([3, 13, 1], seed=1), [_random_buffers([7, 10, 5], seed=seed) for seed in (2, 3)]
    norm = lambda buffers: torch.linalg.vector_norm(torch.cat(buffers)).item()   # noqa: E731
    return [(units, 0.5 * norm(units)), (units, 2.0 * norm(units)), (tiny, 0.25 * norm(tiny)),
            *[(buffers, 0.5 * norm(buffers)) for buffers in pairs]]


@functools.cache
def _torch_clip(row: int) -> tuple[float, list[torch.Tensor]]:
    """One process: torch.nn.utils.clip_grad_norm_ over parameters whose gradients are a row's buffers."""
    buffers, max_norm = _clip_cases()[row]
    params = [nn.Parameter(torch.zeros_like(flat)) for flat in buffers]
    for p, flat in zip(params, buffers):
        p.grad = flat.clone()
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item(), [p.grad for p in params]


def _clip_case(clip: Callable, case: dict, at: dict, group) -> dict:
    """One rank's row: its shards of the row's buffers (the parent's _clip_cases, made again here), their padding
    filled with JUNK; what clip returned, the gradients after it and the collectives it made."""
    members, rank, (buffers, max_norm) = case["ranks"], dist.get_rank(), _clip_cases()[case["_row"]]
    if rank not in members:   # the other ranks sit this row out: their group has its own row
        return {}
    world, place, shards = len(members), members.index(rank), []
    for flat in buffers:
        k = -(-flat.numel() // world)
        padded = torch.full((world * k,), JUNK)
        padded[:flat.numel()] = flat
        shards.append(nn.Parameter(torch.zeros(k)))                # (k,): this rank's parameter shard
        shards[-1].grad = padded[place * k:(place + 1) * k].clone()  # its gradient, padding and all
    with recorded_collectives() as calls:
        norm = clip(shards, [flat.numel() for flat in buffers], max_norm, group)
    return {"norm": _as_number(norm), "grads": [s.grad if s.grad is None else s.grad.detach().clone() for s in shards],
            "collectives": _counted(f"{c.op}{f' ({c.reduce})' if c.reduce else ''} of {c.numel} number"
                                    f"{'s' * (c.numel != 1)} over {c.ranks} ranks" for c in calls)}


def _as_number(value):
    """A returned norm as a float64 tensor (from a Python number or a one-element tensor), else a description."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return torch.tensor(float(value.detach()), dtype=torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    return f"{type(value).__name__}: {value!r}"[:60]


def _clipped(got: dict, case: dict) -> dict:
    """The group's ranks only; their gradients put together, without the padding."""
    members, (buffers, _) = case["ranks"], _clip_cases()[case["_row"]]
    got = {key: [got.get(key, [None] * WORLD)[rank] for rank in members]
           for key in ("refused", "collectives", "norm", "grads")}
    if got["grads"][0] is not None:
        pieces = list(zip(*got["grads"]))
        got["grads"] = [torch.cat(piece)[:flat.numel()] if all(g is not None and g.shape == (-(-flat.numel() //
                        len(members)),) for g in piece) else "shard.grad None or of another shape: scale it in place, "
                        "shard.grad.mul_(coefficient)" for piece, flat in zip(pieces, buffers)]
    return got | {"same": len({n.item() if isinstance(n, torch.Tensor) else n for n in got["norm"]}) == 1}


def _expect_clip(case: dict, observed: dict) -> dict:
    buffers, world = _clip_cases()[case["_row"]][0], len(case["ranks"])
    norm, grads = _torch_clip(case["_row"])
    total = sum(flat.numel() for flat in buffers)
    return {"refused": [""] * world, "collectives": [[f"all_reduce (sum) of 1 number over {world} ranks"]] * world,
            "same": True, "norm": [per_case(torch.tensor(norm, dtype=torch.float64), n=total)] * world,
            "grads": [per_case(grad, n=total) for grad in grads]}


def _real(shard, numel, rank):
    k = shard.numel()
    return shard.grad[:max(0, min(k, numel - rank * k))]


def _squares(shards, numels, rank):
    return sum(_real(shard, numel, rank).pow(2).sum() for shard, numel in zip(shards, numels))


def _norm(shards, numels, group, rank=None, op=dist.ReduceOp.SUM, whole_world=False, reduced=True) -> float:
    """The global norm of sharded gradients: this rank's sum of the squares of its shards' real elements (`rank`:
    its place in `group`), all-reduced (sum) over `group`, then the root. The other arguments are records' mistakes."""
    total = _squares(shards, numels, dist.get_rank(group) if rank is None else rank)
    if reduced:
        dist.all_reduce(total, op=op, group=None if whole_world else group)
    return total.sqrt().item()


def _clip_with(shards, norm, max_norm, clamp=True):
    coefficient = max_norm / (norm + CLIP_EPS)
    for shard in shards:
        shard.grad.mul_(min(1.0, coefficient) if clamp else coefficient)
    return norm


def _clip(shards, numels, max_norm, group, clamp=True, **mistake) -> float:
    """The correct clip the records below change: the global norm (_norm), every shard.grad scaled in place by
    min(1, max_norm / (norm + 1e-6)) (clamp=False: the coefficient alone), the norm returned."""
    return _clip_with(shards, _norm(shards, numels, group, **mistake), max_norm, clamp)


def clip_gathers(shards, numels, max_norm, group):
    world, total = dist.get_world_size(group), 0.0
    for s, n in zip(shards, numels):
        full = torch.empty(world * s.numel())
        dist.all_gather_into_tensor(full, s.grad, group=group)  # the whole gradient, to every rank
        total += full[:n].pow(2).sum().item()
    return _clip_with(shards, total ** 0.5, max_norm)


def clip_per_buffer(shards, numels, max_norm, group):
    rank, total = dist.get_rank(group), 0.0
    for s, n in zip(shards, numels):
        squares = _real(s, n, rank).pow(2).sum()
        dist.all_reduce(squares, group=group)                    # one all-reduce per buffer
        total += squares.item()
    return _clip_with(shards, total ** 0.5, max_norm)


def clip_reduces_two_numbers(shards, numels, max_norm, group):
    both = torch.stack([_squares(shards, numels, dist.get_rank(group)), torch.zeros(())])   # two numbers
    dist.all_reduce(both, group=group)
    return _clip_with(shards, both[0].sqrt().item(), max_norm)


def clip_sums_norms(shards, numels, max_norm, group):
    local = _squares(shards, numels, dist.get_rank(group)).sqrt()
    dist.all_reduce(local, group=group)                          # sum of the ranks' norms
    return _clip_with(shards, local.item(), max_norm)


CLIP = Check(
    "clip_grad_norm_sharded", observe=_on_ranks(_clip_case, _clipped, groups=world_and_halves, key="_world"),
    expect=_expect_clip,
    note=(f"{WORLD} ranks; each rank's shards of flat gradient buffers, their padding filled with {JUNK:g}; "
          "expected: torch.nn.utils.clip_grad_norm_ on the unpadded buffers, in one process"),
    cases=[dict(case=case, ranks=ranks, _row=row, _world=len(ranks)) for row, (case, ranks) in enumerate([
        ("odd model's units, clipped", [0, 1, 2, 3]), ("odd model's units, below max_norm", [0, 1, 2, 3]),
        ("buffers of 3, 13 and 1", [0, 1, 2, 3]), ("two groups of 2", [0, 1]), ("two groups of 2", [2, 3])])],
    columns=lambda case, got: {"numels": str([flat.numel() for flat in _clip_cases()[case["_row"]][0]]),
                               "max_norm": _clip_cases()[case["_row"]][1], "norm": _torch_clip(case["_row"])[0],
                               "rank's norm": _rank0(got, "norm", lambda n: n.item() if hasattr(n, "item") else n),
                               "collectives": _rank0(got, "collectives", _calls)},
    quantities={
        "refused": Said("stopped before a collective that would crash or hang", axes=("rank {} of the group",)),
        "collectives": Exact("the collectives of each rank of the group: one all-reduce (sum) of one number, this "
                             "rank's sum of the squares of its shards' real elements, over `group`",
                             axes=("rank {} of the group",)),
        "same": Exact("every rank of the group returned the same norm"),
        "norm": Close("the norm each rank returned (a float or a 0-d tensor), against torch's: the global norm of "
                          "the unpadded gradients", dtype=torch.float32, axes=("rank {} of the group",)),
        "grads": Close("the gradients after the call (the group's shards put together, without the padding), "
                           "against torch's: every shard.grad scaled in place by min(1, max_norm / (norm + 1e-6))",
                           axes=("buffer {}",))},
    misconceptions=[
        Misconception(clip_gathers, "the norm needs one number from each rank, the sum of the squares of its shards' "
                                    "real elements; gathering gradients moves the whole buffer to compute it"),
        Misconception(named("clip_local_norm", lambda *args: _clip(*args, reduced=False)),   # this rank's part only
                      "each rank holds only its shards, so its sum of squares is a part of the total: all-reduce (sum) "
                      "it over `group`, then take the square root"),
        Misconception(clip_per_buffer, "make one all-reduce, for every buffer at once: add up the squares of all the "
                                       "shards first. An all-reduce of one number costs a latency, and it is paid "
                                       "once"),
        Misconception(clip_reduces_two_numbers, "one number is enough: all-reduce this rank's sum of squares over all "
                                                "its shards, a tensor of one element"),
        Misconception(named("clip_averages", lambda *args: _clip(*args, op=AVG)),
                      "the all-reduce used op=AVG: the squares of the ranks' shards add up (ReduceOp.SUM)"),
        Misconception(named("clip_whole_world", lambda *args: _clip(*args, whole_world=True)),   # forgot group=
                      "all-reduce over `group` only (group=group): without it the all-reduce adds up every rank of the "
                      "world"),
        Misconception(clip_sums_norms, "the norm is the sum of the ranks' norms: all-reduce the sum of squares, then "
                                       "take the root (||g||^2 adds up over the shards, ||g|| does not)"),
        Misconception(named("clip_counts_padding",   # every element taken as real, the padding's junk too
                            lambda shards, numels, *rest: _clip(shards, [s.numel() * WORLD for s in shards], *rest)),
                      f"the norm counts the padding ({JUNK:g} in every padding element here; torch.empty leaves "
                      "anything there): sum the squares of each shard's real elements only"),
        Misconception(named("clip_returns_square", lambda *args: _clip(*args) ** 2),
                      "the norm returned is the sum of squares: return its square root"),
        Misconception(named("clip_global_rank", lambda *args: _clip(*args, rank=dist.get_rank())),   # in the world
                      "use this rank's place in `group` (dist.get_rank(group), dist.get_world_size(group)), not its "
                      "rank in the world"),
        Misconception(named("clip_forgets_to_scale", lambda shards, numels, _, group: _norm(shards, numels, group)),
                      "the gradients were not scaled: when the norm is above max_norm, every shard.grad must be "
                      "multiplied, in place, by max_norm / (norm + 1e-6)"),
        Misconception(named("clip_never_clamps", lambda *args: _clip(*args, clamp=False)),
                      "below max_norm the gradients must stay as they are: the coefficient is min(1, max_norm / (norm "
                      "+ 1e-6)), clipping never scales gradients up")])


def check_clip_grad_norm(clip_grad_norm_sharded: Callable) -> None:
    """clip_grad_norm_sharded(shards, numels, max_norm, group) on 4 ranks (one group of 4, and two groups
    of 2): every rank returns the global norm of the unpadded gradients, scales its shards' gradients
    in place by min(1, max_norm / (norm + 1e-6)), and makes one all-reduce (sum) of a single number;
    against torch.nn.utils.clip_grad_norm_ in one process. The padding holds junk (100.0)."""
    CLIP(clip_grad_norm_sharded)


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

    def _drain(self, refused: str = "") -> None:
        """Wait for every all-gather in flight (it writes into a unit's memory); then raise `refused`, if given."""
        for work in [work for works in self.pending.values() for work in works]:
            work.wait()
        self.pending.clear()
        if refused:
            raise WrongCollectiveUse(refused)

    def _refuse_unwaited(self, u: int, computes: str) -> None:
        if self.pending.get(u):
            events = self.current["events"]
            launched = max(i for i, (event, v) in enumerate(events) if event == "launch" and v == u)
            other = [self.names[v] for event, v in events[launched:] if event == "wait" and v != u]
            self._drain(f"{self.names[u]}'s {computes} before the handle of its all-gather was waited: its "
                         "parameters may still be arriving (on a GPU, NCCL writes them while the kernels read). "
                         f"Wait on {self.names[u]}'s own handle just before it computes"
                         + (f" (the handle waited was {other[-1]}'s)" if other else ""))

    def guard_frees(self):
        """Around the passes: refuse to resize a unit's memory while an all-gather writes into it."""
        resize = torch.UntypedStorage.resize_

        def guarded(storage, nbytes):
            u = self.unit_of.get(storage._cdata)
            if u is not None and self.pending.get(u):
                self._drain(f"{self.names[u]}'s memory was resized to {nbytes} bytes while its all-gather was in "
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
        self.pending[u] = [one for one in self.pending.get(u, []) if one is not work]

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


# The rules of the stretch, each read from the events of every pass: what breaking it means, in words.
RULES = {
    "foreign": "all-gathers into a tensor that is no unit's `full`: gather each unit's shards straight into "
               "unit.full (the module's parameters are views of it)",
    "at once": f"moments when more than {AHEAD} units besides the outer one held their full parameters: at most "
               f"{AHEAD} may, the one computing and the next, whose all-gather is in flight. Free each unit right "
               "after its forward; launch only the next unit's all-gather, one ahead",
    "left held": "units still holding full parameters when a forward or a backward returned: free each unit right "
                 "after its forward, and after its backward",
    "unwaited": "all-gathers still in flight, never waited, when a pass returned: launch only the all-gathers this "
                "pass uses, and wait on each handle",
    "gathers": "units not all-gathered exactly once in a pass: gather each unit exactly once per forward and per "
               "backward (a prefetched unit is already on its way: wait on its handle instead of gathering it again). "
               "Backward meets the units in the reverse order of their forwards' ends",
    "sync": "all-gathers called without async_op=True (every one but the first of a pass): such a call returns only "
            "once every shard has arrived, so nothing computes while it travels. Launch it with async_op=True and "
            "keep its handle, in backward as in forward",
    "late": "all-gathers launched after the unit ahead of theirs began computing: they cannot travel while it "
            "computes. Launch the next unit's from the forward pre-hook of the unit ahead, before it computes; in "
            "backward when the unit ahead's backward starts (the hook on its output's gradient)",
    "early": "handles waited before the unit ahead of theirs had computed: waiting so early makes the gather "
             "synchronous again, nothing computes while it travels. Wait on a unit's handle just before it computes",
}


def _broken(passes: list[dict], names: list[str]) -> dict[str, list[str]]:
    """Per rule, the passes that broke it, each as 'step 0, forward: what broke it'."""
    found: dict[str, list[str]] = {rule: [] for rule in RULES}
    for record in passes:
        if record["phase"] == "forward":
            order = list(range(len(names)))
            ends = [u for event, u in record["events"] if event == "end"]
        else:
            order = ends[::-1]    # backward meets the units in the reverse order of their forwards' ends
        for rule, what in _pass_rules(record, order, names).items():
            if what:
                found[rule].append(f"{record['where']}, {record['phase']}: {'; '.join(what)}")
    return found


def _pass_rules(record: dict, order: list[int], names: list[str]) -> dict[str, list[str]]:
    events, backward = record["events"], record["phase"] == "backward"
    use = "need" if backward else "start"          # the moment a unit computes with its parameters

    def first(event: str, u: int | None) -> int | None:
        return next((i for i, (e, v) in enumerate(events) if e == event and v == u), None)

    def gathers(u: int | None) -> int:
        return sum(event in ("gather", "launch") and v == u for event, v in events)

    count, held, at = record["peak"]
    what = {"foreign": [f"{gathers(None)} all-gathers"] if gathers(None) else [],
            "at once": [f"{count} ({', '.join(names[u] for u in held)}) when {_describe(events[at], names)}"]
            if count > AHEAD else [],
            "left held": [names[u] for u in record["held_after"]], "unwaited": [names[u] for u in record["unwaited"]],
            "gathers": [f"{names[u]} {gathers(u)} times" for u in order if gathers(u) != 1],
            "sync": [names[u] for u in order[1:] if first("gather", u) is not None], "late": [], "early": []}
    for before, u in zip(order, order[1:]):
        mark, launched = first(use, before), first("launch", u)
        if mark is not None and launched is not None and launched > mark:
            what["late"].append(f"{names[u]}'s after {names[before]} began computing")
        waited, used = first("wait", u), first(use, u)
        if waited is None or used is None:
            continue
        marks = ([first("need", before)] if backward else
                 [i for i, (event, _) in enumerate(events[:used]) if event in ("start", "end")][-1:])
        if marks and marks[0] is not None and waited < marks[0]:
            what["early"].append(f"{names[u]}'s before {_describe(events[marks[0]], names)}")
    return what


def _describe(event: tuple, names: list[str]) -> str:
    """An event of the timeline in words."""
    what, u = event
    name = names[u] if u is not None else "a tensor"
    words = {"start": f"{name}'s forward started", "end": f"{name}'s forward ended",
             "need": f"{name}'s backward read its weights", "launch": f"{name}'s all-gather was launched",
             "gather": f"{name} was all-gathered", "wait": f"{name}'s handle was waited"}
    return words.get(what, f"a {what} was called")


def _prefetch_case(answer: tuple, case: dict, at: dict) -> dict:
    Zero3Unit, Zero3Prefetch = answer
    # The learner's unit with its own hooks off: Zero3Prefetch wires every unit.
    Unit = type(Zero3Unit.__name__, (Zero3Unit,), {"hook_forward": lambda self: None})
    model = _model(case["model"])
    layout = prefetch_units(model)
    units = [Unit(module, params, dist.group.WORLD) for _, module, params in layout]
    PREFETCH.refuse(answer, Zero3Prefetch(units))
    names = [label for label, _, _ in layout]
    timeline = _Timeline(names, units)
    timeline.watch_all([module for _, module, _ in layout])
    got = _train_units(model, case["model"], units, at, timeline)
    return got | _broken(timeline.passes, names) | {
        "async": [sum(event == "launch" for event, _ in p["events"]) for p in timeline.passes],
        "most held": max(p["peak"][0] for p in timeline.passes)}


def _start_gather(unit):
    unit.full.untyped_storage().resize_(unit.full.numel() * 4)
    return dist.all_gather_into_tensor(unit.full, unit.shard.detach(), group=unit.group, async_op=True)


class _Prefetch:
    """The correct Zero3Prefetch the misconceptions below change (refused as an answer): the next unit's
    all-gather launched (async) when a unit is about to compute, its handle waited just before that unit
    computes; backward in the reverse order of the forwards' ends."""

    def __init__(self, units):
        self.units, self.handles, self.ended = units, {}, []
        for i, unit in enumerate(units):
            unit.module.register_forward_pre_hook(lambda module, args, i=i: self.before_forward(i))
            unit.module.register_forward_hook(lambda module, args, output, i=i: self.after_forward(i, output))

    def launch(self, unit):
        if unit not in self.handles and not unit.full.untyped_storage().nbytes():
            self.handles[unit] = _start_gather(unit)

    def ready(self, unit):
        self.launch(unit)
        handle = self.handles.pop(unit, None)
        if handle is not None:
            handle.wait()

    def before_forward(self, i):
        if i == 0:
            self.ended = []
        self.ready(self.units[i])
        self.ahead(i)

    def ahead(self, i):
        if i + 1 < len(self.units):
            self.launch(self.units[i + 1])

    def after_forward(self, i, output):
        self.ended.append(i)
        self.release(i)
        if output.requires_grad:
            output.register_hook(lambda grad: self.before_backward(i))

    def release(self, i):
        self.units[i].free()

    def before_backward(self, i):
        order = self.ended[::-1]
        self.ready(self.units[i])
        if order.index(i) + 1 < len(order):
            self.launch(self.units[order[order.index(i) + 1]])


class PrefetchStaging(_Prefetch):
    """Gathers into a staging buffer of its own and copies it into unit.full once waited."""

    def launch(self, unit):
        if unit not in self.handles and not unit.full.untyped_storage().nbytes():
            staging = torch.empty(unit.full.numel())
            self.handles[unit] = (staging, dist.all_gather_into_tensor(staging, unit.shard.detach(), async_op=True))

    def ready(self, unit):
        self.launch(unit)
        if unit in self.handles:
            staging, handle = self.handles.pop(unit)
            handle.wait()
            unit.full.untyped_storage().resize_(unit.full.numel() * 4)
            unit.full.copy_(staging)


class PrefetchAllUpFront(_Prefetch):
    def ahead(self, i):  # every unit's all-gather launched when the forward starts
        for unit in self.units[1:] if i == 0 else []:
            self.launch(unit)


class PrefetchBackwardInForwardOrder(_Prefetch):
    def before_backward(self, i):  # "next" taken as in forward (units[i + 1])
        self.ready(self.units[i])
        self.ahead(i)


class PrefetchGathersTwice(_Prefetch):
    def ready(self, unit):  # prefetched, then gathered again, synchronously, before it computes
        super().ready(unit)
        unit.gather()


class PrefetchSync(_Prefetch):
    """No prefetch: each unit gathers itself, synchronously, when it is about to compute (section 3 again)."""

    def launch(self, unit):
        if not unit.full.untyped_storage().nbytes():
            unit.gather()

    def ahead(self, i):
        pass


PrefetchNeverFrees = _variant(_Prefetch, "PrefetchNeverFrees", release=lambda self, i: None)
# the outer unit kept from the end of forward to its backward
PrefetchKeepsOuter = _variant(_Prefetch, "PrefetchKeepsOuter",
                              release=lambda self, i: self.units[i].free() if i else None)
PrefetchBackwardSync = _variant(_Prefetch, "PrefetchBackwardSync",   # prefetches in forward only
                                before_backward=lambda self, i: self.units[i].gather())
# asynchronous, but launched only when the unit itself is about to compute
PrefetchLate = _variant(_Prefetch, "PrefetchLate", ahead=lambda self, i: None)
PrefetchBackwardLate = _variant(_Prefetch, "PrefetchBackwardLate",
                                before_backward=lambda self, i: self.ready(self.units[i]))


class PrefetchWaitsEarly(_Prefetch):
    def launch(self, unit):  # waits on each handle right after launching it
        super().launch(unit)
        if unit in self.handles:
            self.handles.pop(unit).wait()


class PrefetchWrongHandle(_Prefetch):
    def before_forward(self, i):  # one handle for all: the one waited is the next unit's
        if i == 0:
            self.ended, self.handle = [], _start_gather(self.units[0])
        if i + 1 < len(self.units):
            self.handle = _start_gather(self.units[i + 1])
        self.handle.wait()


class PrefetchNeverWaits(_Prefetch):
    def ready(self, unit):  # launches every all-gather asynchronously and drops the handles
        self.launch(unit)
        self.handles.pop(unit, None)


class PrefetchFreesInFlight(_Prefetch):
    def release(self, i):  # frees the next unit too, its all-gather in flight (a free of the wrong unit)
        super().release(i)
        if i + 1 < len(self.units) and self.units[i + 1] in self.handles:
            self.units[i + 1].free()


class PrefetchWrongShard(_Prefetch):
    def ahead(self, i):  # the next unit's all-gather from this unit's shard: the units differ in size
        if i + 1 < len(self.units):
            nxt = self.units[i + 1]
            nxt.full.untyped_storage().resize_(nxt.full.numel() * 4)
            self.handles[nxt] = dist.all_gather_into_tensor(nxt.full, self.units[i].shard.detach(), async_op=True)


def _with(Zero3Prefetch: type, Zero3Unit: type = _Unit) -> tuple:
    return (Zero3Unit, Zero3Prefetch)


PREFETCH = Check(
    "Zero3Prefetch", expect=_expect_training(prefetch_units), course=COURSE, only=ONLY,
    observe=_on_ranks(_prefetch_case, _trained, deadlock=(
        "Zero3Prefetch did not finish on every rank within {timeout:g} s: a rank waited for a collective the others "
        "never made (a deadlock). Every rank must launch the same all-gathers and reduce-scatters in the same order, "
        "each unit's of its own size (the units differ in size here)")),
    note=(f"{WORLD} ranks, {ZERO3_STEPS} AdamW steps, the last over {ACCUMULATE} micro-batches; units: the outer one "
          "(embedding = LM head, norms), then each layer's attention and MLP. 'async' counts the all-gathers launched "
          "with async_op=True per forward and backward; 'most held' the units, besides the outer one, holding full "
          f"parameters at once (at most {AHEAD})"),
    cases=[dict(model=name) for name in ZERO_MODELS],
    columns=lambda case, got: {"units": len(_sizes(case["model"], prefetch_units)),
                               "sizes": str(_sizes(case["model"], prefetch_units)),
                               "async": _rank0(got, "async", lambda passes: str(sorted(set(passes)))),
                               "most held": _rank0(got, "most held")},
    quantities={"refused": Said("stopped when it happened", axes=("rank {}",)),
                **{rule: Exact(says, axes=("rank {}",)) for rule, says in RULES.items()}, **TRAINED},
    misconceptions=[
        Misconception(_with(PrefetchStaging), "gather each unit's shards straight into unit.full (the module's "
                                              "parameters are views of it), not into a buffer of your own"),
        Misconception(_with(PrefetchAllUpFront), "every unit was gathered ahead at once: launch only the next unit's "
                                                 "all-gather, one ahead, when a unit is about to compute"),
        Misconception(_with(PrefetchNeverFrees), "free each unit's parameters right after its forward: at most "
                                                 f"{AHEAD} units besides the outer one may hold them at once"),
        Misconception(_with(PrefetchBackwardInForwardOrder), "in backward, prefetch the unit whose backward comes "
                                                             "next: backward meets the units in the reverse order of "
                                                             "their forwards' ends (model, mlp 1, attn 1, mlp 0, "
                                                             "attn 0 here), not units[i + 1]"),
        Misconception(_with(PrefetchKeepsOuter), "free the outer unit too when its forward returns: it is gathered "
                                                 "again for backward"),
        Misconception(_with(PrefetchGathersTwice), "a prefetched unit's all-gather is already on its way: wait on its "
                                                   "handle instead of gathering it again"),
        Misconception(_with(PrefetchSync), "launch the next unit's all-gather with async_op=True when a unit is about "
                                           "to compute, and keep its handle: a synchronous all-gather returns only "
                                           "once every shard has arrived, so nothing computes while it travels"),
        Misconception(_with(PrefetchBackwardSync), "prefetch in backward as in forward: when a unit's backward "
                                                   "starts, launch the next unit's all-gather with async_op=True"),
        Misconception(_with(PrefetchLate), "launch the next unit's all-gather from the forward pre-hook of the unit "
                                           "ahead, before it computes, so that it travels meanwhile"),
        Misconception(_with(PrefetchBackwardLate), "in backward, launch the next unit's all-gather when the unit "
                                                   "ahead's backward starts (the hook on its output's gradient)"),
        Misconception(_with(PrefetchWaitsEarly), "waiting right after the launch makes the gather synchronous again: "
                                                 "wait on a unit's handle just before that unit computes"),
        Misconception(_with(PrefetchWrongHandle), "keep one handle per unit (a dict keyed by unit): the handle waited "
                                                  "was another unit's, so this unit's parameters may still be "
                                                  "arriving"),
        Misconception(_with(PrefetchNeverWaits), "wait on each unit's own handle just before it computes: its "
                                                 "parameters may still be arriving"),
        Misconception(_with(PrefetchFreesInFlight), "never free a unit whose all-gather is in flight: wait on its "
                                                    "handle first (and free the unit that just computed)"),
        Misconception(_with(PrefetchWrongShard), "all-gather each unit's own shard into its own full: the units "
                                                 "differ in size, and a collective the ranks call with the wrong "
                                                 "sizes crashes or hangs"),
        Misconception(_with(_Prefetch, UnitSums), SUMS + " (your Zero3Unit's reduce_scatter_grads)")])


def check_zero3_prefetch(Zero3Unit: type, Zero3Prefetch: type) -> None:
    """4 AdamW steps on 4 ranks, the last over 2 micro-batches, with the units of prefetch_units (the outer
    one, then each layer's attention and MLP) built from your Zero3Unit with its hook_forward switched off,
    and Zero3Prefetch(units) wiring them. Every forward and every backward, from the order of events (never
    their times): each unit all-gathered exactly once; every all-gather but the first of the pass launched
    with async_op=True before the unit ahead of it starts computing, and its handle waited after that unit
    computed and before its own unit computes; backward in the reverse order of the forwards' ends; besides
    the outer unit at most 2 units holding full parameters at any moment, none when a pass returns. Logits,
    losses, gradient shards and weights equal one process's."""
    PREFETCH(((Zero3Unit, Zero3Prefetch)))


# ---- predict, then run: ZeRO-1 that does not write the updated shards back ----------------------
DEMO_STEPS = 3


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


class _DemoZero1(_Zero1):
    """_Zero1 with _AdamW, its collectives through picotron.comm (which calls them by the names torch 2.13 does not
    warn about: the demo prints what the learner reads)."""
    Optimizer = _AdamW

    def reduce(self, flat):
        from picotron.comm import reduce_scatter
        shard = torch.empty_like(self.param_shard)
        reduce_scatter(shard, flat, self.group, op=AVG)
        return shard

    def gather(self):
        from picotron.comm import all_gather
        all_gather(self.flat_params, self.param_shard.detach(), self.group)


class _DemoNoWriteBack(_DemoZero1):
    def gather(self):   # step() stops after the optimizer
        pass


class _DemoOwnSlice(Zero1NoAllGather, _DemoZero1):   # each rank copies its updated shard into its own slice only
    pass


# Section 2's ZeRO-1 (_Zero1, with _AdamW) and the write-back after its optimizer step: (label, the class)
WRITE_BACKS = {"all-gather": ("with the all-gather", _DemoZero1), "none": ("no all-gather", _DemoNoWriteBack),
               "own slice": ("own slice only", _DemoOwnSlice)}


def _demo_batch(name: str) -> torch.Tensor:
    """The global batch every step of the demo trains on (rank r its share, rows 2r and 2r+1)."""
    return torch.cat([_tokens(name, 0, rank) for rank in range(WORLD)])


def _demo_on_rank(name: str) -> dict:
    rank, out, batch = dist.get_rank(), {}, _demo_batch(name)
    mine = batch[rank * BATCH_PER_RANK:(rank + 1) * BATCH_PER_RANK]
    for write_back, (_, Zero1) in WRITE_BACKS.items():
        model = _model(name)
        zero = Zero1(model, dist.group.WORLD, LR)
        start, shard_start = zero.flat_params.clone(), zero.param_shard.detach().clone()
        losses = []
        for step in range(DEMO_STEPS + 1):
            with torch.no_grad():                       # this replica's loss on the whole global batch
                losses.append(loss_fn(model(batch[:, :-1]), batch[:, 1:]).item())
            if step < DEMO_STEPS:
                loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
                zero.step()
                zero.zero_grad()
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
    for way, (label, _) in WRITE_BACKS.items():
        row = table[way]
        for r in ([0] if row["identical"] else range(WORLD)):
            who = "every rank" if row["identical"] else f"rank {r}"
            print(f"{label if r == 0 else '':<21}{who:<12}" + "".join(f"{x:>8.4f}" for x in row["losses"][r])
                  + f"{row['moved'][r]:>15.0%}{'yes' if row['shard_moved'][r] else 'no':>13}")
    print("replicas identical: " + ", ".join(f"{label} {'yes' if table[way]['identical'] else 'no'}"
                                            for way, (label, _) in WRITE_BACKS.items()))
    return table

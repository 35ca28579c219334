"""The checks of assignment 02: bucketed, overlapped data parallelism.

Each check runs the learner's code (on 4 ranks where it communicates) and compares it with
single-process torch computed here, in the parent: the mean of every rank's tensor, the
gradient of the whole global batch from one plain model, a plain AdamW run. Nothing here
uses picotron.parallel.data_parallel, the module the assignment rebuilds.

    check_grad_views(grad_views)        views into one flat buffer; autograd fills it (one process)
    check_grad_bucket(GradBucket)       one async all-reduce of the whole buffer, when the last gradient is ready
    check_hooks(DataParallel)           every bucket launched during backward, gradients = one process's
    check_data_parallel(DataParallel)   5 AdamW steps, bucket sizes x gradient accumulation with no_sync
    check_assign_buckets(assign_buckets) stretch: the bucket plan of a model, against the order one backward
                                        finishes the gradients in (one process)

`given_bucket_plan` is the plan the guided part's DataParallel is given; the stretch asks for the
learner's own, and its check refuses an answer that calls it (or picotron's `assign_buckets`).

Inside the ranks, `recorded_all_reduces` wraps `torch.distributed.all_reduce` (which
`picotron.comm.all_reduce` calls) to note every call: its tensor, whether it was
asynchronous, and whether its handle was waited for.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import tolerance
from picotron.config import ModelConfig
from picotron_course.checks import (Report, close_enough, close_in_training, collectives_observed, max_abs_error,
                                    mismatch, on_ranks, one_thread, rank_tensor, watch_calls)
from picotron_course.checks import not_the_course_answer
from picotron.model import Llama, loss_fn

__all__ = ["check_grad_views", "check_grad_bucket", "check_hooks", "check_data_parallel", "check_assign_buckets",
           "given_bucket_plan", "recorded_all_reduces", "CHECK_MODEL", "WORLD"]

WORLD = 4
# A small Llama with a tied embedding (one weight, two uses): 11 parameter tensors of 32 to 8192 elements.
CHECK_MODEL = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, max_seq_len=16)
SEQ, BATCH_PER_RANK = 12, 2
# Roundings behind one gradient of CHECK_MODEL on the global batch (picotron.tolerance), and the all-reduce's sum.
MODEL_ROUNDINGS = tolerance.llama_roundings(CHECK_MODEL, SEQ, WORLD * BATCH_PER_RANK * SEQ) + WORLD
PACKAGE = "picotron.parallel.data_parallel"


# ---- recording the all-reduces a rank makes --------------------------------------------------
class AllReduceCall:
    """One call of dist.all_reduce: what it was given, and whether its handle was waited for."""

    def __init__(self, tensor: torch.Tensor, async_op: bool):
        self.numel, self.data_ptr, self.async_op = tensor.numel(), tensor.data_ptr(), async_op
        self.waited = not async_op  # a blocking call is done when it returns
        self.tensor, self.sent = tensor, tensor.detach().clone()   # what it held when the all-reduce started


class _RecordedWork:
    """The handle an async all-reduce returns, noting when it is waited for."""

    def __init__(self, work, call: AllReduceCall):
        self._work, self._call = work, call

    def wait(self, *args, **kwargs):
        self._call.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def recorded_all_reduces() -> Iterator[list[AllReduceCall]]:
    """Inside the block, every dist.all_reduce call is appended to the yielded list (checks.collectives_observed)."""
    calls: list[AllReduceCall] = []

    def record(name: str, arguments: dict) -> None:
        if name == "all_reduce":
            calls.append(AllReduceCall(arguments["tensor"], bool(arguments.get("async_op", False))))

    def after(name: str, arguments: dict, work):
        return _RecordedWork(work, calls[-1]) if name == "all_reduce" and work is not None else work

    with collectives_observed(record, after):
        yield calls


VIEW_CASES = [([(3, 4), (5,), (2, 3, 2)], torch.float32), ([(7,)], torch.float32),
              ([(1,), (4, 4), (6,)], torch.float64)]


def check_grad_views(grad_views: Callable) -> None:
    """grad_views(params) returns one zero buffer; each p.grad is a view of its slice, in order;
    backward adds gradients into the buffer."""
    with Report("grad_views") as report:
        for seed, (shapes, dtype) in enumerate(VIEW_CASES):
            params = [nn.Parameter(rank_tensor(0, shape, dtype, seed)) for shape in shapes]
            buffer = grad_views(params)
            detail = _views_problem(params, buffer)
            err = math.nan
            if not detail:  # backward twice: autograd must add into the views, so into the buffer
                scales = [rank_tensor(1, p.shape, dtype, seed) for p in params]
                for _ in range(2):
                    sum((p * s).sum() for p, s in zip(params, scales)).backward()
                expected = 2 * torch.cat([s.flatten() for s in scales])
                err = max_abs_error(buffer, expected)
                if not close_enough(buffer, expected, n=2):          # two backward passes added
                    detail = ("after two backward passes the buffer is not the summed gradients: "
                              + mismatch(buffer, expected))
                elif any(p.grad.data_ptr() != v for p, v in zip(params, _offsets(buffer, params))):
                    detail = "after backward a p.grad no longer points into the buffer"
            report.add(not detail, detail, shapes=shapes, dtype=dtype, max_abs_err=err)


def _offsets(buffer: torch.Tensor, params: list) -> list[int]:
    """Where each parameter's slice of the buffer starts, params laid out one after another."""
    starts, offset = [], 0
    for p in params:
        starts.append(buffer.data_ptr() + offset * buffer.element_size())
        offset += p.numel()
    return starts


def _views_problem(params: list, buffer) -> str:
    total = sum(p.numel() for p in params)
    if not isinstance(buffer, torch.Tensor):
        return f"grad_views must return the flat buffer (a tensor), got {type(buffer).__name__}"
    if buffer.dim() != 1 or buffer.numel() != total or buffer.dtype != params[0].dtype:
        return (f"expected a 1-D {params[0].dtype} buffer of {total} elements (all parameters), got "
                f"{buffer.dtype} of shape {tuple(buffer.shape)}")
    if buffer.count_nonzero():
        return "the buffer must start at zero (autograd adds into it)"
    for i, (p, start) in enumerate(zip(params, _offsets(buffer, params))):
        if p.grad is None:
            return f"params[{i}].grad is None: set it to a view of the buffer"
        if p.grad.shape != p.shape:
            return f"params[{i}].grad has shape {tuple(p.grad.shape)}, the parameter {tuple(p.shape)}"
        if p.grad.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr():
            return (f"params[{i}].grad is not a view of the buffer (a copy?): slice the buffer and "
                    ".view_as(param), do not torch.cat or .clone")
        if p.grad.data_ptr() != start:
            element = lambda ptr: (ptr - buffer.data_ptr()) // buffer.element_size()
            return (f"params[{i}].grad starts at element {element(p.grad.data_ptr())} of the buffer, expected "
                    f"{element(start)}: lay the parameters out one after another, in the order given")
    return ""


# ---- 2. GradBucket -----------------------------------------------------------------------------
BUCKET_CASES = [([(3, 4), (5,), (2, 3, 2)], torch.float32), ([(6, 2)], torch.float32),
                ([(4,), (3, 3)], torch.float64)]
ROUNDS = 2  # the same bucket twice: it must be ready for the next step after wait()


def check_grad_bucket(GradBucket: type) -> None:
    """mark_ready launches one async all-reduce of the whole buffer when the last gradient is ready;
    after wait() every gradient is the mean over ranks; the bucket then serves the next step."""
    not_the_course_answer("check_grad_bucket", GradBucket, course=PACKAGE)
    with Report("GradBucket", note=f"{WORLD} ranks; each row: mark every parameter ready (last first), then wait()") \
            as report:
        results = on_ranks(_bucket_on_rank, WORLD, GradBucket, BUCKET_CASES)
        for case, (shapes, dtype) in enumerate(BUCKET_CASES):
            for round_ in range(ROUNDS):
                per_rank = [rank[case][round_] for rank in results]
                detail, err = _bucket_problem(per_rank, shapes, dtype, case, round_)
                launches = per_rank[0].get("launches", [math.nan])
                report.add(not detail, detail, shapes=shapes, dtype=dtype, step=round_,
                           **{"launched before last": sum(launches[:-1]), "launched at last": launches[-1]},
                           max_abs_err=err)


def _grad_seed(case: int, round_: int, index: int) -> int:
    return 100 * case + 10 * round_ + index


def _bucket_on_rank(GradBucket: type, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for case, (shapes, dtype) in enumerate(cases):
        params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes]
        bucket = GradBucket(params, dist.group.WORLD)
        not_the_course_answer("check_grad_bucket", bucket, course=PACKAGE)
        rounds = []
        if not all(p.grad is not None and p.grad.untyped_storage().data_ptr() == bucket.buffer.untyped_storage()
                   .data_ptr() for p in params):
            out.append([{"not_views": True}] * ROUNDS)
            continue
        for round_ in range(ROUNDS):
            for i, p in enumerate(params):  # this rank's gradients, written through the views
                p.grad.copy_(rank_tensor(rank, p.shape, dtype, _grad_seed(case, round_, i)))
            with recorded_all_reduces() as calls:
                launches = []
                for p in reversed(params):  # backward finishes the last parameters first
                    before = len(calls)
                    bucket.mark_ready(p)
                    launches.append(len(calls) - before)
                bucket.wait()
            rounds.append({"launches": launches, "calls": [(c.numel, c.data_ptr == bucket.buffer.data_ptr(),
                                                            c.async_op, c.waited) for c in calls],
                           "numel": bucket.buffer.numel(), "grads": [p.grad.clone() for p in params]})
        out.append(rounds)
    return out


def _bucket_problem(per_rank: list, shapes: list, dtype, case: int, round_: int) -> tuple[str, float]:
    mine = per_rank[0]
    if mine.get("not_views"):
        return ("after GradBucket(params, group) the p.grad are not views of bucket.buffer: "
                "solve grad_views first (check_grad_views)"), math.nan
    expected = [sum(rank_tensor(r, shape, dtype, _grad_seed(case, round_, i)).double() for r in range(WORLD)) / WORLD
                for i, shape in enumerate(shapes)]
    err = max(max_abs_error(g, e) for rank in per_rank for g, e in zip(rank["grads"], expected))
    if sum(mine["launches"][:-1]):
        return ("mark_ready launched an all-reduce before the bucket's last gradient was ready: count the ready "
                "parameters and launch only when all are"), err
    if mine["launches"][-1] != 1:
        return (f"marking the last parameter ready launched {mine['launches'][-1]} all-reduces; launch exactly one, "
                "of the whole buffer, there"), err
    numel, same_buffer, async_op, waited = mine["calls"][0]
    if not (same_buffer and numel == mine["numel"]):
        return (f"the all-reduce got a tensor of {numel} elements{'' if same_buffer else ' outside the buffer'}; "
                f"all-reduce self.buffer ({mine['numel']} elements) itself, in one call"), err
    if not async_op:
        return "the all-reduce blocked: pass async_op=True and keep the handle, so backward can go on", err
    if not waited:
        return "wait() did not call .wait() on the all-reduce's handle", err
    for rank, grads in enumerate(r["grads"] for r in per_rank):
        for i, (g, e) in enumerate(zip(grads, expected)):
            if not close_enough(g, e, dtype, n=WORLD + 1):     # a sum over the ranks, then a division
                hint = (" (it looks like the sum: divide by the world size)"
                        if close_enough(g, e * WORLD, dtype, n=WORLD + 1) else "")
                return (f"rank {rank}, params[{i}].grad is not the mean over ranks{hint}: "
                        f"{mismatch(g, e.to(dtype))}"), err
    return "", err


# ---- 3. hooks --------------------------------------------------------------------------------
HOOK_BUCKETS = [0, 3000, 10**9]  # elements: one bucket per parameter, a few, one for everything


def _tokens(step: int, micro: int, rank: int) -> torch.Tensor:
    """(BATCH_PER_RANK, SEQ + 1) tokens of one rank's micro-batch; the parent can rebuild them all."""
    generator = torch.Generator().manual_seed(10_007 * step + 101 * micro + rank)
    return torch.randint(0, CHECK_MODEL.vocab_size, (BATCH_PER_RANK, SEQ + 1), generator=generator)


def _model() -> Llama:
    """The check's model, the same every time, without reseeding the caller's (the notebook's) RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Llama(CHECK_MODEL)


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def check_hooks(DataParallel: type) -> None:
    """One backward on 4 ranks: each bucket's all-reduce starts during backward, once; after
    finish_gradient_sync the gradients equal one process's gradient of the global batch."""
    not_the_course_answer("check_hooks", DataParallel, course=PACKAGE)
    with Report("hooks", note=f"{WORLD} ranks, one backward of a Llama with {len(list(_model().parameters()))} "
                              "parameter tensors (the embedding tied to the LM head)") as report:
        results = on_ranks(_hooks_on_rank, WORLD, DataParallel, HOOK_BUCKETS)
        with one_thread():
            model = _model()
            batch = torch.cat([_tokens(0, 0, r) for r in range(WORLD)])  # the global batch
            loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
            expected = _flat_grads(model)
        for i, bucket_numel in enumerate(HOOK_BUCKETS):
            per_rank = [rank[i] for rank in results]
            got = per_rank[0]
            err = max(max_abs_error(r["grads"], expected) for r in per_rank)
            detail = ""
            if got["in_backward"] < got["buckets"]:
                detail = (f"only {got['in_backward']} of {got['buckets']} buckets started their all-reduce while "
                          "backward ran: register a post-accumulate-grad hook on every parameter that marks it "
                          "ready in its bucket")
            elif got["total"] != got["buckets"]:
                detail = f"{got['total']} all-reduces for {got['buckets']} buckets: launch each bucket once"
            elif not got["waited"]:
                detail = "finish_gradient_sync returned before waiting for every bucket's all-reduce"
            elif any(r["stale"] for r in per_rank):
                rank, name = next((rank, r["stale"]) for rank, r in enumerate(per_rank) if r["stale"])
                detail = (f"rank {rank}'s all-reduce started before {name}'s gradient was in its bucket, so the "
                          "gradients differ from one process's whenever the all-reduce reads the bucket early: mark "
                          "a parameter ready in a post-accumulate-grad hook (after .grad holds the gradient), not a "
                          "tensor hook")
            else:
                for rank, r in enumerate(per_rank):
                    if not close_enough(r["grads"], expected, n=MODEL_ROUNDINGS):
                        detail = f"rank {rank}'s gradients differ from one process's: {mismatch(r['grads'], expected)}"
                        break
            report.add(not detail, detail, bucket_numel=bucket_numel, buckets=got["buckets"],
                       **{"launched in backward": got["in_backward"], "launched in all": got["total"]},
                       max_abs_err=err)


def _hooks_on_rank(DataParallel: type, bucket_sizes: list) -> list:
    rank, out = dist.get_rank(), []
    tokens = _tokens(0, 0, rank)
    for bucket_numel in bucket_sizes:
        model = _model()
        dp = DataParallel(model, dist.group.WORLD, bucket_numel)
        not_the_course_answer("check_hooks", dp, *dp.buckets, course=PACKAGE)
        local = _model()                                     # this rank's own gradient, without communication
        loss_fn(local(tokens[:, :-1]), tokens[:, 1:]).backward()
        with recorded_all_reduces() as calls:
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            in_backward = len(calls)
            dp.finish_gradient_sync()
        out.append({"buckets": len(dp.buckets), "in_backward": in_backward, "total": len(calls),
                    "waited": all(c.waited for c in calls), "grads": _flat_grads(model),
                    "stale": _sent_before_ready(model, local, calls)})
    return out


def _sent_before_ready(model: nn.Module, local: nn.Module, calls: list[AllReduceCall]) -> str:
    """The first parameter whose slice of a bucket did not hold this rank's gradient (or its 1/N share) when its
    all-reduce started ("" if none). Deterministic, unlike the reduced result: an async all-reduce may read the buffer late enough
    to see a gradient that was written after it started."""
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        for call in calls:
            g = p.grad
            if g is None or g.untyped_storage().data_ptr() != call.tensor.untyped_storage().data_ptr():
                continue
            start = g.storage_offset() - call.tensor.storage_offset()
            if start < 0 or start + g.numel() > call.tensor.numel():   # another bucket's part of one buffer
                continue
            sent, own = call.sent.flatten()[start:start + g.numel()], q.grad.flatten()
            if not any(close_enough(sent, own / scale, n=MODEL_ROUNDINGS) for scale in (1, WORLD)):  # or pre-divided
                return name
    return ""


# ---- 4. training with gradient accumulation ----------------------------------------------------
TRAIN_CASES = [(0, 1), (3000, 1), (10**9, 1), (3000, 2), (10**9, 3)]  # (bucket_numel, micro-batches per step)
TRAIN_STEPS, LR = 5, 1e-2


def check_data_parallel(DataParallel: type) -> None:
    """5 AdamW steps on 4 ranks, with gradient accumulation inside no_sync(): every step's gradients
    and the final weights equal one process training on the same global batches, with one
    all-reduce per bucket per step."""
    not_the_course_answer("check_data_parallel", DataParallel, course=PACKAGE)
    with Report("DataParallel training", note=f"{WORLD} ranks, {TRAIN_STEPS} AdamW steps; micro-batches of "
                                              f"{BATCH_PER_RANK} sequences per rank") as report:
        results = on_ranks(_train_on_rank, WORLD, DataParallel, TRAIN_CASES)
        with one_thread():
            references = {accum: _train_one_process(accum) for accum in sorted({a for _, a in TRAIN_CASES})}
        for i, (bucket_numel, accum) in enumerate(TRAIN_CASES):
            per_rank = [rank[i] for rank in results]
            grads, weights = references[accum]
            got = per_rank[0]
            grad_err = max(max_abs_error(g, e) for r in per_rank for g, e in zip(r["grads"], grads))
            weight_err = max(max_abs_error(r["weights"], weights) for r in per_rank)
            detail = ""
            if max(got["calls"]) != got["buckets"] or min(got["calls"]) != got["buckets"]:
                detail = (f"all-reduces per step {got['calls']}, expected one per bucket ({got['buckets']})"
                          + ("; inside no_sync() the hooks must not mark gradients ready" if accum > 1 else ""))
            else:
                for rank, r in enumerate(per_rank):
                    bad = [s for s, (g, e) in enumerate(zip(r["grads"], grads)) if not close_in_training(g, e)]
                    if bad:
                        detail = (f"rank {rank}, step {bad[0]}: gradients differ from one process's: "
                                  f"{mismatch(r['grads'][bad[0]], grads[bad[0]])}")
                        break
                if not detail and weight_err > tolerance.ADAM_WEIGHTS_ATOL:  # Adam amplifies round-off: 1e-4
                    detail = f"final weights differ from one process's by {weight_err:.2e} (> 1e-4)"
            report.add(not detail, detail, bucket_numel=bucket_numel, micro_batches=accum, buckets=got["buckets"],
                       **{"all-reduces/step": max(got["calls"])}, max_grad_err=grad_err, max_weight_err=weight_err)


def _train_on_rank(DataParallel: type, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for bucket_numel, accum in cases:
        model = _model()
        dp = DataParallel(model, dist.group.WORLD, bucket_numel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        grads, calls_per_step = [], []
        with recorded_all_reduces() as calls:
            for step in range(TRAIN_STEPS):
                before = len(calls)
                for micro in range(accum):
                    tokens = _tokens(step, micro, rank)
                    with dp.no_sync() if micro < accum - 1 else nullcontext():
                        (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / accum).backward()
                dp.finish_gradient_sync()
                calls_per_step.append(len(calls) - before)
                grads.append(_flat_grads(model))
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)  # zero the views in place: they are the buckets
        out.append({"buckets": len(dp.buckets), "calls": calls_per_step, "grads": grads,
                    "weights": torch.cat([p.detach().flatten() for p in model.parameters()])})
    return out


def _train_one_process(accum: int) -> tuple[list, torch.Tensor]:
    """Plain torch: the whole global batch (every rank's micro-batches) in one backward per step."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads = []
    for step in range(TRAIN_STEPS):
        batch = torch.cat([_tokens(step, micro, r) for micro in range(accum) for r in range(WORLD)])
        loss_fn(model(batch[:, :-1]), batch[:, 1:]).backward()
        grads.append(_flat_grads(model))
        optimizer.step()
        optimizer.zero_grad()
    return grads, torch.cat([p.detach().flatten() for p in model.parameters()])


# ---- 5. stretch: the bucket plan ---------------------------------------------------------------
def given_bucket_plan(model: nn.Module, bucket_numel: int) -> list[list[nn.Parameter]]:
    """The bucket plan the guided part's DataParallel is given; the stretch asks for your own.

    Trainable parameters, each once, last registered first, cut into groups that close once they
    hold at least `bucket_numel` elements.
    """
    plan: list[list[nn.Parameter]] = []
    size = 0
    for param in [p for p in model.parameters() if p.requires_grad][::-1]:
        if not plan or size >= bucket_numel:
            plan.append([])
            size = 0
        plan[-1].append(param)
        size += param.numel()
    return plan


# (model, bucket_numel, names of frozen parameters): one bucket per parameter, a few, one for all,
# a deeper model, and frozen parameters (no gradient, so no hook: they must stay out of every bucket).
PLAN_CASES = [("1 layer", 0, ()), ("1 layer", 3000, ()), ("1 layer", 10**9, ()), ("2 layers", 2500, ()),
              ("2 layers", 3000, ("norm.weight", "layers.1.attn.q_proj.weight"))]
PLAN_MODELS = {"1 layer": CHECK_MODEL, "2 layers": replace(CHECK_MODEL, num_layers=2)}
COURSE_PLANS = {(PACKAGE, "assign_buckets"), (__name__, "given_bucket_plan")}


def check_assign_buckets(assign_buckets: Callable) -> None:
    """assign_buckets(model, bucket_numel) -> list of buckets (lists of parameters): every trainable
    parameter exactly once (the tied embedding too), in the order one backward finishes their
    gradients, cut into consecutive groups that close once they hold >= bucket_numel elements."""
    with Report("assign_buckets", note="one process; 'ready order' = the order the post-accumulate-grad hooks "
                                       "fired in one backward of the same model") as report:
        for model_name, bucket_numel, frozen in PLAN_CASES:
            model = plan_model(model_name, frozen)
            ready = ready_order(model)
            with _course_plan_calls() as called:
                plan = assign_buckets(model, bucket_numel)
            if called:
                raise AssertionError(f"check_assign_buckets: your assign_buckets called {called[0]}, the course's "
                                     "plan; write your own")
            detail = _plan_problem(plan, model, ready, bucket_numel)
            sizes = [sum(p.numel() for p in bucket) for bucket in plan] if not detail else []
            report.add(not detail, detail, model=model_name, bucket_numel=bucket_numel, frozen=len(frozen),
                       buckets=len(plan) if isinstance(plan, (list, tuple)) else "-",
                       **{"largest (elements)": max(sizes, default="-")})


def plan_model(name: str, frozen: tuple = ()) -> Llama:
    """A check model (the embedding tied to the LM head), the same every time, with `frozen` parameters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Llama(PLAN_MODELS[name])
    for param_name, param in model.named_parameters():
        param.requires_grad_(param_name not in frozen)
    return model


def ready_order(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters in the order one backward finishes their gradients (a single-process fact)."""
    order: list[nn.Parameter] = []
    handles = [p.register_post_accumulate_grad_hook(order.append) for p in model.parameters() if p.requires_grad]
    tokens = _tokens(0, 0, 0)
    with one_thread():
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    for handle in handles:
        handle.remove()
    model.zero_grad(set_to_none=True)
    return order


@contextmanager
def _course_plan_calls() -> Iterator[list[str]]:
    """Inside the block, note every call of the course's own bucket plans, however they were imported."""
    def name_of(frame):
        where = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        return f"{where[0]}.{where[1]}" if where in COURSE_PLANS else None

    with watch_calls(name_of) as called:
        yield called


def _plan_problem(plan, model: nn.Module, ready: list, bucket_numel: int) -> str:
    """What is wrong with `plan`, in words, or "" when every fact holds."""
    names = {id(p): name for name, p in model.named_parameters()}   # a tied weight once, by its first name
    params = {id(p): p for p in model.parameters()}
    if not isinstance(plan, (list, tuple)) or not all(isinstance(b, (list, tuple)) for b in plan):
        return (f"return a list of buckets, each a list of parameters; got {type(plan).__name__}"
                + (f" of {type(plan[0]).__name__}" if isinstance(plan, (list, tuple)) and plan else ""))
    flat = [p for bucket in plan for p in bucket]
    if not all(isinstance(p, torch.Tensor) for p in flat):
        return "a bucket holds something that is not a tensor: put the parameters themselves in, not names or sizes"
    if any(id(p) not in params for p in flat):
        return "a bucket holds a tensor that is not a parameter of the model (a copy?): put the parameters themselves in"
    empty = [i for i, bucket in enumerate(plan) if not bucket]
    if empty:
        return f"bucket {empty[0]} is empty: every bucket holds at least one parameter"
    frozen = [names[id(p)] for p in flat if not p.requires_grad]
    if frozen:
        return (f"{frozen[0]} does not require grad: it never gets a gradient, so its hook never fires and its "
                "bucket would never be full; leave it out")
    counts = Counter(names[id(p)] for p in flat)
    twice = [name for name, k in counts.items() if k > 1]
    if twice:
        tied = " (the embedding is tied to the LM head: one tensor under two names)" if twice[0] == "embed.weight" else ""
        return (f"{twice[0]} is in the plan {counts[twice[0]]} times{tied}; put each parameter in exactly one "
                "bucket, once (model.parameters() lists a tied weight once)")
    missing = [names[id(p)] for p in ready if names[id(p)] not in counts]
    if missing:
        return f"missing from every bucket: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"
    for position, (got, want) in enumerate(zip(flat, ready)):
        if got is not want:
            return (f"position {position} of the plan holds {names[id(got)]}, but backward finishes {names[id(want)]} "
                    "there: list the parameters in the order their gradients become ready")
    for i, bucket in enumerate(plan):
        size = sum(p.numel() for p in bucket)
        if i < len(plan) - 1 and size < bucket_numel:
            return (f"bucket {i} holds {size} elements, fewer than bucket_numel={bucket_numel}, and is not the last: "
                    "keep filling a bucket until it holds at least bucket_numel elements")
        if len(bucket) > 1 and size - bucket[-1].numel() >= bucket_numel:
            return (f"bucket {i} already held {size - bucket[-1].numel()} >= bucket_numel={bucket_numel} elements "
                    f"before {names[id(bucket[-1])]} was added: close a bucket as soon as it holds at least "
                    "bucket_numel (a parameter is never split, so a bucket may go over)")
    return ""

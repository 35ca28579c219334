"""The checks of assignment 02: bucketed, overlapped data parallelism, declared on the course's engine.

Each check runs the learner's code (on 4 ranks where it communicates), observes what it did (the buffer and
where each gradient lies in it, the all-reduces launched and waited for, the gradients and weights) and compares
with single-process torch computed here, in the parent: the mean of every rank's tensor, the gradient of the
whole global batch from one plain model, a plain AdamW run (picotron_course.engine). Nothing here uses
picotron.parallel.data_parallel, the module the assignment rebuilds.

    check_grad_views(grad_views)        views into one flat buffer; autograd fills it (one process)
    check_grad_bucket(GradBucket)       one async all-reduce of the whole buffer, when the last gradient is ready
    check_hooks(DataParallel)           every bucket launched during backward, gradients = one process's
    check_data_parallel(DataParallel)   5 AdamW steps, bucket sizes x gradient accumulation with no_sync
    check_assign_buckets(assign_buckets) stretch: the bucket plan of a model, against the order one backward
                                        finishes the gradients in (one process)

`given_bucket_plan` is the plan the guided part's DataParallel is given; the stretch asks for the
learner's own, and its check refuses an answer that calls it (or picotron's `assign_buckets`).
The misconceptions at the end of each section are wrong answers learners write, with the hint each should read.
"""

from __future__ import annotations

import functools
import math
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import tolerance
from picotron.config import ModelConfig
from picotron.model import Llama, loss_fn
from picotron_course.checks import close_enough, collectives_observed, on_ranks, one_thread, rank_tensor, watch_calls
from picotron_course.engine import (Check, Close, Exact, InTraining, Misconception, Within, by_rank, named,
                                    observe_on_ranks)

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
COURSE = (PACKAGE, __name__)   # picotron's answers, and the correct bases of this file's misconceptions
ONLY = {__name__: {"_Bucket", "_DataParallel"}}


# ---- recording the all-reduces a rank makes --------------------------------------------------
class AllReduceCall:
    """One call of dist.all_reduce: what it was given, whether its handle was waited for, and the handle."""

    def __init__(self, tensor: torch.Tensor, async_op: bool):
        self.numel, self.data_ptr, self.async_op = tensor.numel(), tensor.data_ptr(), async_op
        self.waited = not async_op  # a blocking call is done when it returns
        self.tensor, self.sent = tensor, tensor.detach().clone()   # what it held when the all-reduce started
        self.work = None

    def describe(self, buffer: torch.Tensor) -> str:
        whole = self.data_ptr == buffer.data_ptr() and self.numel == buffer.numel()
        inside = _shares(self.tensor, buffer)
        what = "the whole buffer" if whole else f"{self.numel} elements {'of' if inside else 'outside'} the buffer"
        return (f"async all-reduce of {what}, {'waited' if self.waited else 'never waited'}" if self.async_op
                else f"blocking all-reduce of {what}")


class _RecordedWork:
    """The handle an async all-reduce returns, noting when it is waited for."""

    def __init__(self, work, call: AllReduceCall):
        self._work, self._call = work, call
        call.work = work

    def wait(self, *args, **kwargs):
        self._call.waited = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextmanager
def recorded_all_reduces() -> Iterator[list[AllReduceCall]]:
    """Inside the block, every dist.all_reduce call is appended to the yielded list (checks.collectives_observed).
    On the way out, an all-reduce never waited for is completed (noted as not waited), so what the rank then reads
    does not depend on how far the backend had got."""
    calls: list[AllReduceCall] = []

    def record(name: str, arguments: dict) -> None:
        if name == "all_reduce":
            calls.append(AllReduceCall(arguments["tensor"], bool(arguments.get("async_op", False))))

    def after(name: str, arguments: dict, work):
        return _RecordedWork(work, calls[-1]) if name == "all_reduce" and work is not None else work

    with collectives_observed(record, after):
        yield calls
    for call in calls:
        if not call.waited and call.work is not None:
            call.work.wait()


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ---- 1. grad_views ---------------------------------------------------------------------------
def _views(grad_views: Callable, case: dict) -> dict:
    params = [nn.Parameter(rank_tensor(0, shape, case["dtype"], case["_seed"])) for shape in case["shapes"]]
    buffer = grad_views(params)
    seen = {"returned": _described(buffer), "grads": _placed(params, buffer)}
    if isinstance(buffer, torch.Tensor):   # backward twice: autograd must add into the views, so into the buffer
        scales = [rank_tensor(1, p.shape, case["dtype"], 10 * case["_seed"] + i) for i, p in enumerate(params)]
        for _ in range(2):
            sum((p * s).sum() for p, s in zip(params, scales)).backward()
        seen.update({"after backward": buffer.clone(), "grads after backward": _placed(params, buffer)})
    return seen


def _described(buffer) -> str:
    if not isinstance(buffer, torch.Tensor):
        return f"a {type(buffer).__name__}, not a tensor"
    zero = "all zero" if not buffer.count_nonzero() else "not all zero"
    return f"a {buffer.dim()}-D {str(buffer.dtype).removeprefix('torch.')} tensor of {buffer.numel()} elements, {zero}"


def _placed(params: list, buffer) -> list:
    """Where each p.grad starts in the buffer (an element index), or why it is not in it."""
    def place(grad):
        if grad is None:
            return "None"
        if not isinstance(buffer, torch.Tensor) or not _shares(grad, buffer):
            return "not in the buffer"
        return (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
    return [place(p.grad) for p in params]


def _expect_views(case: dict, observed: dict) -> dict:
    shapes, dtype = case["shapes"], case["dtype"]
    sizes = [math.prod(shape) for shape in shapes]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    scales = [rank_tensor(1, shape, dtype, 10 * case["_seed"] + i) for i, shape in enumerate(shapes)]
    return {"returned": _described(torch.zeros(sum(sizes), dtype=dtype)), "grads": starts,
            "after backward": 2 * torch.cat([s.flatten() for s in scales]), "grads after backward": starts}


def _gv_no_grads(params):
    return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)


def _gv_reversed(params):
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = buffer.numel()
    for p in params:  # laid out from the end
        offset -= p.numel()
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
    return buffer


GRAD_VIEWS = Check(
    "grad_views", observe=lambda answers, cases: [[_views(f, case) for case in cases] for f in answers],
    expect=_expect_views,
    cases=[dict(shapes=shapes, dtype=dtype, _seed=seed) for seed, (shapes, dtype) in enumerate(
        [([(3, 4), (5,), (2, 3, 2)], torch.float32), ([(7,)], torch.float32), ([(1,), (4, 4), (6,)], torch.float64)])],
    quantities={"returned": Exact("what grad_views returned"),
                "grads": Exact("where each p.grad starts in the buffer (element)", axes=("params[{}]",)),
                "after backward": Close("the buffer after two backward passes (the summed gradients)", n=2),
                "grads after backward": Exact("where each p.grad starts after backward", axes=("params[{}]",))},
    misconceptions=[   # _Bucket (below) makes the correct views
        Misconception(named("_gv_returns_nothing", lambda params: _Bucket(params, None) and None),   # views, no buffer
                      "grad_views must return the flat buffer (a tensor)"),
        Misconception(named("_gv_ones", lambda params: _Bucket(params, None).buffer.fill_(1)),
                      "the buffer must start at zero: autograd adds each gradient into it"),
        Misconception(_gv_no_grads, "set each p.grad to a view of its slice of the buffer"),
        Misconception(named("_gv_copies", lambda params: _Bucket(params, None).buffer.clone()),   # p.grad elsewhere
                      "each p.grad must be a view of the buffer, not a copy: slice the buffer and .view_as(param), do "
                      "not torch.cat or .clone"),
        Misconception(_gv_reversed, "lay the parameters out one after another, in the order given")])


def check_grad_views(grad_views: Callable) -> None:
    """grad_views(params) returns one zero buffer; each p.grad is a view of its slice, in order;
    backward adds gradients into the buffer."""
    GRAD_VIEWS(grad_views)


# ---- 2. GradBucket -----------------------------------------------------------------------------
def _grad_seed(case: int, step: int, index: int) -> int:
    return 100 * case + 10 * step + index


def _buckets_on_rank(answers: list, cases: list) -> list:
    """Per answer, per case: make a bucket at a case's step 0 (the next step reuses it), write this rank's
    gradients through the views, mark every parameter ready (the last first, as backward does), then wait()."""
    rank, out = dist.get_rank(), []
    for GradBucket in answers:
        seen = []
        for case in cases:
            if case["step"] == 0:
                params = [nn.Parameter(torch.zeros(shape, dtype=case["dtype"])) for shape in case["shapes"]]
                bucket = GradBucket(params, dist.group.WORLD)
                GRAD_BUCKET.refuse(GradBucket, bucket)
            views = all(p.grad is not None and _shares(p.grad, bucket.buffer) for p in params)
            seen.append({"views": views, "launched": None, "all-reduces": None, "grads": None})
            if not views:
                continue
            for i, p in enumerate(params):
                p.grad.copy_(rank_tensor(rank, p.shape, case["dtype"], _grad_seed(case["_case"], case["step"], i)))
            with recorded_all_reduces() as calls:
                launched = []
                for p in reversed(params):
                    before = len(calls)
                    bucket.mark_ready(p)
                    launched.append(len(calls) - before)
                bucket.wait()
            seen[-1].update({"launched": launched, "all-reduces": [c.describe(bucket.buffer) for c in calls],
                             "grads": [p.grad.clone() for p in params]})
        out.append(seen)
    return out


def _expect_bucket(case: dict, observed: dict) -> dict:
    means = [sum(rank_tensor(r, shape, case["dtype"], _grad_seed(case["_case"], case["step"], i)).double()
                 for r in range(WORLD)) / WORLD for i, shape in enumerate(case["shapes"])]
    launched = [0] * (len(case["shapes"]) - 1) + [1]
    return {"views": [True] * WORLD, "launched": [launched] * WORLD,
            "all-reduces": [["async all-reduce of the whole buffer, waited"]] * WORLD, "grads": [means] * WORLD}


class _Bucket:
    """The correct bucket the misconceptions below change (refused as an answer)."""

    def __init__(self, params, group):
        self.params, self.group = list(params), group
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=self.params[0].dtype)
        for p, piece in zip(self.params, self.buffer.split([p.numel() for p in self.params])):
            p.grad = piece.view_as(p)
        self.ready, self.work = set(), None

    def mark_ready(self, param):
        self.ready.add(param)
        if len(self.ready) == len(self.params):
            self.launch()

    def launch(self):
        self.work = dist.all_reduce(self.buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)

    def wait(self):
        self.work.wait()
        self.work, self.ready = None, set()


class BucketLaunchesEarly(_Bucket):
    def mark_ready(self, param):
        self.ready.add(param)
        if self.work is not None:
            self.work.wait()
        self.launch()  # every time: sends gradients that are not final


class BucketBlocks(_Bucket):
    def launch(self):
        dist.all_reduce(self.buffer, op=dist.ReduceOp.AVG, group=self.group)

    def wait(self):
        self.ready = set()


class BucketPerGradient(_Bucket):
    def launch(self):
        works = [dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.group, async_op=True) for p in self.params]
        self.work = type("Works", (), {"wait": lambda _: [w.wait() for w in works]})()


class BucketSums(_Bucket):
    def launch(self):
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)  # sum, never divided


class BucketNeverResets(_Bucket):
    def wait(self):
        self.work.wait()


class BucketDoesNotWait(_Bucket):
    def wait(self):
        self.work, self.ready = None, set()


GRAD_BUCKET = Check(
    "GradBucket", observe=lambda answers, cases: by_rank(on_ranks(_buckets_on_rank, WORLD, answers, cases)),
    expect=_expect_bucket, course=COURSE, only=ONLY,
    note=f"{WORLD} ranks; each row: mark every parameter ready (last first), then wait()",
    cases=[dict(shapes=shapes, dtype=dtype, step=step, _case=i) for i, (shapes, dtype) in enumerate(
        [([(3, 4), (5,), (2, 3, 2)], torch.float32), ([(6, 2)], torch.float32), ([(4,), (3, 3)], torch.float64)])
        for step in range(2)],   # the same bucket twice: it must be ready for the next step after wait()
    columns=lambda case, got: {"all-reduces launched": got["launched"][0] if got["launched"][0] else "-"},
    quantities={
        "views": Exact("after GradBucket(params, group), the p.grad are views of bucket.buffer (solve check_grad_views "
                       "first)", axes=("rank {}",)),
        "launched": Exact("all-reduces launched by each mark_ready, the last parameter first", axes=("rank {}",)),
        "all-reduces": Exact("the all-reduces of the step", axes=("rank {}",)),
        "grads": Close("the gradients after wait(), against the mean over ranks", n=WORLD + 1,
                       axes=("rank {}", "params[{}]"))},
    misconceptions=[
        Misconception(BucketNeverResets, "after wait(), empty the set of ready parameters: the bucket serves the next "
                                         "step, whose first mark_ready must not launch"),
        Misconception(BucketLaunchesEarly, "mark_ready launched an all-reduce before the bucket's last gradient was "
                                           "ready: count the ready parameters and launch only when all are"),
        Misconception(BucketBlocks, "the all-reduce blocked: pass async_op=True and keep the handle, so backward can "
                                    "go on"),
        Misconception(BucketPerGradient, "launch exactly one all-reduce, of the whole buffer (self.buffer itself, in "
                                         "one call), when the last parameter is ready"),
        Misconception(BucketSums, "the gradients are the sum over ranks: divide by the world size (or all-reduce "
                                  "with op=ReduceOp.AVG)"),
        Misconception(BucketDoesNotWait, "wait() did not call .wait() on the all-reduce's handle")])


def check_grad_bucket(GradBucket: type) -> None:
    """mark_ready launches one async all-reduce of the whole buffer when the last gradient is ready;
    after wait() every gradient is the mean over ranks; the bucket then serves the next step."""
    GRAD_BUCKET(GradBucket)


# ---- 3. hooks, 4. training with gradient accumulation ------------------------------------------
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


def _hooks_on_rank(DataParallel: type, case: dict) -> dict:
    tokens, model = _tokens(0, 0, dist.get_rank()), _model()
    dp = DataParallel(model, dist.group.WORLD, case["bucket_numel"])
    HOOKS.refuse(DataParallel, dp, *dp.buckets)
    local = _model()                                     # this rank's own gradient, without communication
    loss_fn(local(tokens[:, :-1]), tokens[:, 1:]).backward()
    with recorded_all_reduces() as calls:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        in_backward = len(calls)
        dp.finish_gradient_sync()
    return {"buckets": len(dp.buckets), "in backward": in_backward, "all-reduces": len(calls),
            "waited": all(c.waited for c in calls), "stale": _sent_before_ready(model, local, calls),
            "grads": _flat_grads(model)}


def _sent_before_ready(model: nn.Module, local: nn.Module, calls: list[AllReduceCall]) -> str:
    """The first parameter whose slice of a bucket did not hold this rank's gradient (or its 1/N share) when its
    all-reduce started ("" if none). Deterministic, unlike the reduced result: an async all-reduce may read the
    buffer late enough to see a gradient that was written after it started."""
    for (name, p), q in zip(model.named_parameters(), local.parameters()):
        for call in calls:
            g = p.grad
            if g is None or not _shares(g, call.tensor):
                continue
            start = g.storage_offset() - call.tensor.storage_offset()
            if start < 0 or start + g.numel() > call.tensor.numel():   # another bucket's part of one buffer
                continue
            sent, own = call.sent.flatten()[start:start + g.numel()], q.grad.flatten()
            if not any(close_enough(sent, own / scale, n=MODEL_ROUNDINGS) for scale in (1, WORLD)):  # or pre-divided
                return name
    return ""


def _expect_hooks(case: dict, observed: dict) -> dict:
    buckets = observed["buckets"]   # one all-reduce per bucket the answer made
    return {"in backward": buckets, "all-reduces": buckets, "waited": [True] * WORLD, "stale": [""] * WORLD,
            "grads": [_train_one_process(1)[0][0]] * WORLD}   # one process's gradient of step 0's global batch


TRAIN_STEPS, LR = 5, 1e-2


def _train_on_rank(DataParallel: type, case: dict) -> dict:
    accum, model = case["micro_batches"], _model()
    dp = DataParallel(model, dist.group.WORLD, case["bucket_numel"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    grads, per_step = [], []
    with recorded_all_reduces() as calls:
        for step in range(TRAIN_STEPS):
            before = len(calls)
            for micro in range(accum):
                tokens = _tokens(step, micro, dist.get_rank())
                with dp.no_sync() if micro < accum - 1 else nullcontext():
                    (loss_fn(model(tokens[:, :-1]), tokens[:, 1:]) / accum).backward()
            dp.finish_gradient_sync()
            per_step.append(len(calls) - before)
            grads.append(_flat_grads(model))
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # zero the views in place: they are the buckets
    return {"buckets": len(dp.buckets), "all-reduces": per_step, "grads": grads,
            "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}


@functools.cache
def _train_one_process(accum: int) -> tuple[list, torch.Tensor]:
    """Plain torch: the whole global batch (every rank's micro-batches) in one backward per step."""
    with one_thread():
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


def _expect_training(case: dict, observed: dict) -> dict:
    grads, weights = _train_one_process(case["micro_batches"])
    return {"all-reduces": [[b] * TRAIN_STEPS for b in observed["buckets"]], "grads": [grads] * WORLD,
            "weights": [weights] * WORLD}


class _DataParallel:
    """The correct DataParallel the misconceptions below change (refused as an answer)."""
    bucket = _Bucket

    def __init__(self, model, group, bucket_numel):
        self.require_sync = True
        self.buckets = [self.bucket(chunk, group) for chunk in given_bucket_plan(model, bucket_numel)]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.register([p for bucket in self.buckets for p in bucket.params])

    def register(self, params):
        for p in params:
            p.register_post_accumulate_grad_hook(self.on_grad_ready)

    def on_grad_ready(self, param):
        if self.require_sync:
            self.bucket_of[param].mark_ready(param)

    @contextmanager
    def no_sync(self):
        self.require_sync = False
        yield
        self.require_sync = True

    def finish_gradient_sync(self):
        for b in self.buckets:
            b.wait()


class DPTensorHook(_DataParallel):
    def register(self, params):  # fires before .grad holds the gradient
        for p in params:
            p.register_hook(lambda grad, p=p: self.on_grad_ready(p))


class DPAfterBackward(_DataParallel):
    def register(self, params):
        pass

    def finish_gradient_sync(self):  # all-reduces after backward: no overlap
        for b in self.buckets:
            for p in b.params:
                b.mark_ready(p)
        super().finish_gradient_sync()


class DPForgetsToWait(_DataParallel):
    def finish_gradient_sync(self):
        pass


class DPIgnoresNoSync(_DataParallel):
    def on_grad_ready(self, param):
        bucket = self.bucket_of[param]
        if bucket.work is not None:  # still running from the previous micro-batch
            bucket.wait()
        bucket.mark_ready(param)


HOOKS = Check(
    "hooks", observe=observe_on_ranks(WORLD, _hooks_on_rank),
    expect=_expect_hooks, course=COURSE, only=ONLY,
    note=f"{WORLD} ranks, one backward of a Llama with 11 parameter tensors (the embedding tied to the LM head)",
    cases=[dict(bucket_numel=n) for n in (0, 3000, 10**9)],   # one bucket per parameter, a few, one for everything
    columns=lambda case, got: {"buckets": got["buckets"][0], "launched in backward": got["in backward"][0]},
    quantities={"in backward": Exact("all-reduces started while backward ran (one per bucket)", axes=("rank {}",)),
                "all-reduces": Exact("all-reduces in all (one per bucket)", axes=("rank {}",)),
                "waited": Exact("every all-reduce waited for by finish_gradient_sync", axes=("rank {}",)),
                "stale": Exact("the first parameter whose gradient was not yet in its bucket when the bucket's "
                               "all-reduce started", axes=("rank {}",)),
                "grads": Close("the gradients, against one process's gradient of the global batch", n=MODEL_ROUNDINGS,
                               axes=("rank {}",))},
    misconceptions=[
        Misconception(DPAfterBackward, "register a post-accumulate-grad hook on every parameter that marks it ready "
                                       "in its bucket, so each bucket's all-reduce starts while backward still runs"),
        Misconception(DPForgetsToWait, "finish_gradient_sync must wait for every bucket's all-reduce before it "
                                       "returns"),
        Misconception(DPTensorHook, "mark a parameter ready in a post-accumulate-grad hook (after .grad holds the "
                                    "gradient), not a tensor hook: the bucket's all-reduce read it before the "
                                    "gradient was there")])

TRAINING = Check(
    "DataParallel training", observe=observe_on_ranks(WORLD, _train_on_rank),
    expect=_expect_training, course=COURSE, only=ONLY,
    note=f"{WORLD} ranks, {TRAIN_STEPS} AdamW steps; micro-batches of {BATCH_PER_RANK} sequences per rank",
    cases=[dict(bucket_numel=n, micro_batches=a) for n, a in [(0, 1), (3000, 1), (10**9, 1), (3000, 2), (10**9, 3)]],
    columns=lambda case, got: {"buckets": got["buckets"][0], "all-reduces/step": max(got["all-reduces"][0])},
    quantities={"all-reduces": Exact("all-reduces per step (one per bucket)", axes=("rank {}",)),
                "grads": InTraining("the gradients, against one process's", axes=("rank {}", "step {}")),
                "weights": Within("the final weights, against one process's", atol=tolerance.ADAM_WEIGHTS_ATOL,
                                  axes=("rank {}",))},
    misconceptions=[Misconception(DPIgnoresNoSync, "inside no_sync() the hooks must not mark gradients ready: the "
                                                   "buckets all-reduce once a step, after the last micro-batch")])


def check_hooks(DataParallel: type) -> None:
    """One backward on 4 ranks: each bucket's all-reduce starts during backward, once; after
    finish_gradient_sync the gradients equal one process's gradient of the global batch."""
    HOOKS(DataParallel)


def check_data_parallel(DataParallel: type) -> None:
    """5 AdamW steps on 4 ranks, with gradient accumulation inside no_sync(): every step's gradients
    and the final weights equal one process training on the same global batches, with one
    all-reduce per bucket per step."""
    TRAINING(DataParallel)


# ---- 5. stretch: the bucket plan ---------------------------------------------------------------
def given_bucket_plan(model: nn.Module, bucket_numel: int) -> list[list[nn.Parameter]]:
    """The bucket plan the guided part's DataParallel is given; the stretch asks for your own.

    Trainable parameters, each once, last registered first, cut into groups that close once they
    hold at least `bucket_numel` elements.
    """
    return _cut([p for p in model.parameters() if p.requires_grad][::-1], bucket_numel)


def _cut(params: list, bucket_numel: int, closed: Callable | None = None) -> list[list]:
    """params cut into consecutive buckets; a bucket closes once it holds >= bucket_numel elements (or, in a
    misconception, when closed(its elements, the next parameter, the bucket))."""
    plan: list[list] = []
    size = 0
    for param in params:
        if not plan or (closed(size, param, plan[-1]) if closed else size >= bucket_numel):
            plan.append([])
            size = 0
        plan[-1].append(param)
        size += param.numel()
    return plan


PLAN_MODELS = {"1 layer": CHECK_MODEL, "2 layers": replace(CHECK_MODEL, num_layers=2)}
COURSE_PLANS = {(PACKAGE, "assign_buckets"), (__name__, "given_bucket_plan")}


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


def _plan(assign_buckets: Callable, case: dict) -> dict:
    model = plan_model(case["model"], case["_frozen"])
    with watch_calls(_course_plan) as called:
        plan = assign_buckets(model, case["bucket_numel"])
    if called:
        raise AssertionError(f"check_assign_buckets: your assign_buckets called {called[0]}, the course's plan; "
                             "write your own")
    return _plan_seen(plan, model)


def _plan_seen(plan, model: nn.Module) -> dict:
    """What a plan is: its kind, the parameters in it by name, in order, and the elements of each bucket."""
    names = {id(p): name for name, p in model.named_parameters()}   # a tied weight once, by its first name
    buckets = [list(b) for b in plan] if isinstance(plan, list) and all(isinstance(b, list) for b in plan) else None
    items = [p for b in buckets for p in b] if buckets is not None else list(plan) if isinstance(plan, list) else []
    kinds = "/".join(sorted({type(p).__name__ for p in items}))
    if not isinstance(plan, list):
        kind = f"a {type(plan).__name__}"
    elif buckets is None:
        kind = f"a list of {kinds}"
    elif not all(isinstance(p, torch.Tensor) for p in items):
        kind = f"a list of lists of {kinds}"
    elif any(id(p) not in names for p in items):
        kind = "a list of lists of tensors, some not parameters of the model"
    else:
        kind = "a list of lists of parameters" + (", some empty" if not all(buckets) else "")
    order = [names.get(id(p), f"<{type(p).__name__}>") for p in items]
    frozen = [names[id(p)] for p in items if id(p) in names and not p.requires_grad]
    return {"kind": kind, "repeated": sorted({n for n in order if order.count(n) > 1 and n in names.values()}),
            "frozen": frozen, "order": order,
            "elements": [sum(p.numel() for p in b if isinstance(p, torch.Tensor)) for b in buckets or []]}


def _expect_plan(case: dict, observed: dict) -> dict:
    model = plan_model(case["model"], case["_frozen"])
    return _plan_seen(_cut(ready_order(model), case["bucket_numel"]), model)


def _course_plan(frame) -> str | None:
    """The course's own bucket plan a frame runs, however it was imported (for watch_calls)."""
    where = (frame.f_globals.get("__name__"), frame.f_code.co_name)
    return f"{where[0]}.{where[1]}" if where in COURSE_PLANS else None


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def plan_registration_order(model, bucket_numel):  # the order forward uses them: backward finishes them last
    return _cut(_trainable(model), bucket_numel)


def plan_tied_twice(model, bucket_numel):  # every name, so the tied embedding also as lm_head.weight
    return _cut([p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad][::-1], bucket_numel)


def plan_never_over(model, bucket_numel):  # closes a bucket before it would exceed bucket_numel
    return _cut(_trainable(model)[::-1], bucket_numel, lambda size, p, bucket: size + p.numel() > bucket_numel)


def plan_one_past(model, bucket_numel):  # closes one parameter late
    return _cut(_trainable(model)[::-1], bucket_numel, lambda size, p, bucket: size >= bucket_numel and len(bucket) > 1)


def plan_with_frozen(model, bucket_numel):  # a frozen parameter never gets a gradient, nor a hook call
    return _cut(list(model.parameters())[::-1], bucket_numel)


def plan_of_names(model, bucket_numel):
    return [[name] for name, _ in reversed(list(model.named_parameters()))]


def plan_of_copies(model, bucket_numel):
    return [[p.detach().clone() for p in bucket] for bucket in _cut(_trainable(model)[::-1], bucket_numel)]


def plan_flat(model, bucket_numel):
    return _trainable(model)[::-1]


# (model, bucket_numel, names of frozen parameters): one bucket per parameter, a few, one for all,
# a deeper model, and frozen parameters (no gradient, so no hook: they must stay out of every bucket).
ASSIGN_BUCKETS = Check(
    "assign_buckets", observe=lambda answers, cases: [[_plan(f, case) for case in cases] for f in answers],
    expect=_expect_plan,
    note="one process; 'ready order': the order the post-accumulate-grad hooks fired in one backward of the model",
    cases=[dict(model=m, bucket_numel=n, frozen=len(f), _frozen=f) for m, n, f in [
        ("1 layer", 0, ()), ("1 layer", 3000, ()), ("1 layer", 10**9, ()), ("2 layers", 2500, ()),
        ("2 layers", 3000, ("norm.weight", "layers.1.attn.q_proj.weight"))]],
    columns=lambda case, got: {"buckets": len(got["elements"]), "largest": max(got["elements"], default="-")},
    quantities={"kind": Exact("what assign_buckets returned"),
                "repeated": Exact("parameters in the plan more than once"),
                "frozen": Exact("parameters in the plan that do not require grad"),
                "order": Exact("the parameters in the plan, in order", axes=("position {}",)),
                "elements": Exact("the elements in each bucket", axes=("bucket {}",))},
    misconceptions=[
        Misconception(plan_flat, "return a list of buckets, each a list of parameters"),
        Misconception(plan_of_names, "put the parameters themselves in the buckets, not names or sizes"),
        Misconception(plan_of_copies, "put the parameters themselves in the buckets, not copies of them"),
        Misconception(plan_with_frozen, "leave out a parameter that does not require grad: it never gets a gradient, "
                                        "so its hook never fires and its bucket would never be full"),
        Misconception(plan_tied_twice, "put each parameter in exactly one bucket, once: the embedding is tied to the "
                                       "LM head (one tensor under two names), and model.parameters() lists it once"),
        Misconception(plan_registration_order, "list the parameters in the order backward finishes their gradients "
                                               "(the reverse of the order forward uses them)"),
        Misconception(plan_never_over, "keep filling a bucket until it holds at least bucket_numel elements (a "
                                       "parameter is never split, so a bucket may go over)"),
        Misconception(plan_one_past, "close a bucket as soon as it holds at least bucket_numel elements")])


def check_assign_buckets(assign_buckets: Callable) -> None:
    """assign_buckets(model, bucket_numel) -> list of buckets (lists of parameters): every trainable
    parameter exactly once (the tied embedding too), in the order one backward finishes their
    gradients, cut into consecutive groups that close once they hold >= bucket_numel elements."""
    ASSIGN_BUCKETS(assign_buckets)

"""The checks of assignment 02 pass a correct answer and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from picotron_course.checks_dp import (PLAN_CASES, check_assign_buckets, check_data_parallel, check_grad_bucket,
                                       check_grad_views, check_hooks, given_bucket_plan, plan_model, ready_order)
from picotron.parallel import data_parallel as package


# ---- a correct answer ------------------------------------------------------------------------
def ref_grad_views(params):
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    for p, piece in zip(params, buffer.split([p.numel() for p in params])):
        p.grad = piece.view_as(p)
    return buffer


class RefBucket:
    views = staticmethod(ref_grad_views)

    def __init__(self, params, group):
        self.params, self.group = list(params), group
        self.buffer = self.views(self.params)
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


class RefDP:
    bucket = RefBucket

    def __init__(self, model, group, bucket_numel):
        self.require_sync = True
        params = [p for p in model.parameters()][::-1]
        chunks, size = [], 0
        for p in params:
            if not chunks or size >= bucket_numel:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += p.numel()
        self.buckets = [self.bucket(chunk, group) for chunk in chunks]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.register(params)

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


def ref_assign_buckets(model, bucket_numel):
    trainable = [p for p in model.parameters() if p.requires_grad]
    plan, size = [], 0
    for p in reversed(trainable):
        if plan and size < bucket_numel:
            plan[-1].append(p)
        else:
            plan.append([p])
            size = 0
        size += p.numel()
    return plan


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"grad_views": 3, "GradBucket": 6, "hooks": 3, "DataParallel training": 5, "assign_buckets": 5}


@pytest.mark.parametrize("check, answer", [(check_grad_views, ref_grad_views), (check_grad_bucket, RefBucket),
                                           (check_hooks, RefDP), (check_data_parallel, RefDP),
                                           (check_assign_buckets, ref_assign_buckets)],
                         ids=["grad_views", "bucket", "hooks", "training", "assign_buckets"])
def test_correct_answer_passes(check, answer, every_case):
    check(answer)
    every_case(CASES)


# ---- planted wrong answers -------------------------------------------------------------------
def gv_copies(params):
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    for p in params:
        p.grad = torch.zeros_like(p)  # its own tensor: backward never reaches the buffer
    return buffer


def gv_reversed(params):
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = buffer.numel()
    for p in params:  # laid out from the end
        offset -= p.numel()
        p.grad = buffer[offset:offset + p.numel()].view_as(p)
    return buffer


def gv_returns_nothing(params):
    ref_grad_views(params)


class BucketLaunchesEarly(RefBucket):
    def mark_ready(self, param):
        self.ready.add(param)
        if self.work is not None:
            self.work.wait()
        self.launch()  # every time: sends gradients that are not final


class BucketBlocks(RefBucket):
    def launch(self):
        dist.all_reduce(self.buffer, op=dist.ReduceOp.AVG, group=self.group)
        self.work = None

    def wait(self):
        self.ready = set()


class BucketPerGradient(RefBucket):
    def launch(self):
        works = [dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=self.group, async_op=True) for p in self.params]
        self.work = type("Works", (), {"wait": lambda _: [w.wait() for w in works]})()


class BucketSums(RefBucket):
    def launch(self):
        self.work = dist.all_reduce(self.buffer, group=self.group, async_op=True)  # sum, never divided


class BucketNeverResets(RefBucket):
    def wait(self):
        self.work.wait()


class BucketDoesNotWait(RefBucket):
    def wait(self):
        self.work, self.ready = None, set()


class DPGradientHook(RefDP):
    def register(self, params):  # fires before .grad holds the gradient
        for p in params:
            p.register_hook(lambda grad, p=p: self.on_grad_ready(p))


class DPAfterBackward(RefDP):
    def register(self, params):
        pass

    def finish_gradient_sync(self):  # all-reduces after backward: no overlap
        for b in self.buckets:
            for p in b.params:
                b.mark_ready(p)
        super().finish_gradient_sync()


class DPForgetsToWait(RefDP):
    def finish_gradient_sync(self):
        pass


class DPIgnoresNoSync(RefDP):
    def on_grad_ready(self, param):
        bucket = self.bucket_of[param]
        if bucket.work is not None:  # still running from the previous micro-batch
            bucket.wait()
        bucket.mark_ready(param)


class PackageBucket(package.GradBucket):
    def __init__(self, params, group):
        super().__init__(params, group)


def plan_registration_order(model, bucket_numel):  # the order forward uses them: backward finishes them last
    return ref_assign_buckets(_Reversed(model), bucket_numel)


class _Reversed:
    def __init__(self, model):
        self.model = model

    def parameters(self):
        return reversed(list(self.model.parameters()))


def plan_tied_twice(model, bucket_numel):  # every name, so the tied embedding also as lm_head.weight
    params = [p for _, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    return [[p] for p in reversed(params)] if bucket_numel == 0 else [list(reversed(params))]


def plan_never_over(model, bucket_numel):  # closes a bucket before it would exceed bucket_numel
    plan, size = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if not plan or size + p.numel() > bucket_numel:
            plan.append([])
            size = 0
        plan[-1].append(p)
        size += p.numel()
    return plan


def plan_one_past(model, bucket_numel):  # closes one parameter late
    plan, size = [], 0
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        if not plan or (size >= bucket_numel and len(plan[-1]) > 1):
            plan.append([])
            size = 0
        plan[-1].append(p)
        size += p.numel()
    return plan


def plan_with_frozen(model, bucket_numel):  # a frozen parameter never gets a gradient, nor a hook call
    plan, size = [], 0
    for p in reversed(list(model.parameters())):
        if not plan or size >= bucket_numel:
            plan.append([])
            size = 0
        plan[-1].append(p)
        size += p.numel()
    return plan


def plan_of_names(model, bucket_numel):
    return [[name] for name, _ in reversed(list(model.named_parameters()))]


def plan_of_copies(model, bucket_numel):
    return [[p.detach().clone() for p in bucket] for bucket in ref_assign_buckets(model, bucket_numel)]


def plan_flat(model, bucket_numel):
    return [p for bucket in ref_assign_buckets(model, bucket_numel) for p in bucket]


def plan_given(model, bucket_numel):
    return given_bucket_plan(model, bucket_numel)


def plan_package(model, bucket_numel):
    return package.assign_buckets([p for p in model.parameters() if p.requires_grad][::-1], bucket_numel)


WRONG_ANSWERS = [
    (check_grad_views, gv_copies, "not a view of the buffer"),
    (check_grad_views, gv_reversed, "in the order given"),
    (check_grad_views, gv_returns_nothing, "must return the flat buffer"),
    (check_grad_bucket, BucketLaunchesEarly, "before the bucket's last gradient was ready"),
    (check_grad_bucket, BucketBlocks, "async_op=True"),
    (check_grad_bucket, BucketPerGradient, "launched 3 all-reduces"),
    (check_grad_bucket, BucketSums, "looks like the sum"),
    (check_grad_bucket, BucketNeverResets, "before the bucket's last gradient was ready"),
    (check_grad_bucket, BucketDoesNotWait, r"did not call \.wait\(\)"),
    (check_grad_bucket, PackageBucket, "the course's answer"),
    (check_hooks, DPGradientHook, "gradients differ from one process's"),
    (check_hooks, DPAfterBackward, "started their all-reduce while backward ran"),
    (check_hooks, DPForgetsToWait, "before waiting"),
    (check_data_parallel, DPIgnoresNoSync, "inside no_sync"),
    (check_assign_buckets, plan_registration_order, "backward finishes"),
    (check_assign_buckets, plan_tied_twice, "embed.weight is in the plan 2 times .the embedding is tied"),
    (check_assign_buckets, plan_never_over, "fewer than bucket_numel"),
    (check_assign_buckets, plan_one_past, "close a bucket as soon as"),
    (check_assign_buckets, plan_with_frozen, "does not require grad"),
    (check_assign_buckets, plan_of_names, "not a tensor"),
    (check_assign_buckets, plan_of_copies, "not a parameter of the model"),
    (check_assign_buckets, plan_flat, "list of buckets"),
    (check_assign_buckets, plan_given, "given_bucket_plan, the course's plan"),
    (check_assign_buckets, plan_package, "data_parallel.assign_buckets, the course's plan"),
]
REFUSED = {PackageBucket, plan_given, plan_package}  # refused before a table is printed


@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    if answer not in REFUSED:
        assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("model_name, frozen", sorted({(m, f) for m, _, f in PLAN_CASES}))
def test_reverse_registration_is_the_ready_order_of_the_check_models(model_name, frozen):
    """The proxy the stretch task names is exact for the check's models: the check's 'ready order'
    (measured from the hooks of one backward) is model.parameters() reversed, the tied embedding last."""
    model = plan_model(model_name, frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ready = ready_order(model)
    assert [id(p) for p in ready] == [id(p) for p in reversed(trainable)]
    assert ready[-1] is model.embed.weight is model.lm_head.weight
    assert all(p.grad is None for p in model.parameters())  # the check hands the learner a model without gradients

"""The checks of assignment 02 pass a correct answer and refuse the course's own.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. The wrong answers
are the checks' misconceptions, each failing with its hint (tests/test_misconceptions.py).
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from picotron_course import checks_dp
from picotron_course.checks_dp import (ASSIGN_BUCKETS, check_assign_buckets, check_data_parallel, check_grad_bucket,
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


# ---- answers refused, and a mistake no misconception describes -------------------------------------------
# The planted wrong answers are the checks' misconceptions (checks_dp.py), tested in test_misconceptions.py.
class PackageBucket(package.GradBucket):
    def __init__(self, params, group):
        super().__init__(params, group)


class MisconceptionsBase(checks_dp._DataParallel):   # the correct base the misconceptions change
    pass


def plan_given(model, bucket_numel):
    return given_bucket_plan(model, bucket_numel)


def plan_package(model, bucket_numel):
    return package.assign_buckets([p for p in model.parameters() if p.requires_grad][::-1], bucket_numel)


REFUSED = [(check_grad_bucket, PackageBucket, "the course's answer"),
           (check_grad_bucket, checks_dp._Bucket, "the course's answer"),
           (check_hooks, MisconceptionsBase, "the course's answer"),
           (check_assign_buckets, plan_given, "given_bucket_plan, the course's plan"),
           (check_assign_buckets, plan_package, "data_parallel.assign_buckets, the course's plan")]


@pytest.mark.parametrize("check, answer, says", REFUSED, ids=[a.__name__ for _, a, _ in REFUSED])
def test_the_course_answer_is_refused(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


class BucketDoublesTheMean(RefBucket):
    def wait(self):
        super().wait()
        self.buffer.mul_(2)


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    """Fails like BucketSums (the gradients after wait()), but with other values: no hint is given."""
    with pytest.raises(AssertionError, match=r"the gradients after wait\(\).*\(rank 0, params\[0\]\)") as error:
        check_grad_bucket(BucketDoublesTheMean)
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


@pytest.mark.parametrize("model_name, frozen", sorted({(c["model"], c["_frozen"]) for c in ASSIGN_BUCKETS.cases}))
def test_reverse_registration_is_the_ready_order_of_the_check_models(model_name, frozen):
    """The proxy the stretch task names is exact for the check's models: the check's 'ready order'
    (measured from the hooks of one backward) is model.parameters() reversed, the tied embedding last."""
    model = plan_model(model_name, frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    ready = ready_order(model)
    assert [id(p) for p in ready] == [id(p) for p in reversed(trainable)]
    assert ready[-1] is model.embed.weight is model.lm_head.weight
    assert all(p.grad is None for p in model.parameters())  # the check hands the learner a model without gradients

"""The checks of assignment 02 pass a correct answer and refuse the course's own.

The correct answer is the checks' own correct bases (checks_dp._Bucket, _DataParallel), which the
misconceptions change and a learner may not submit: so the records and the check agree on what is right,
and a check that passes everything, or nothing, is caught. The wrong answers are the checks'
misconceptions, each failing with its hint (tests/test_misconceptions.py).
"""

import pytest

from picotron_course import checks_dp
from picotron_course.checks_dp import (ASSIGN_BUCKETS, check_assign_buckets, check_data_parallel, check_grad_bucket,
                                       check_grad_views, check_hooks, given_bucket_plan, plan_model, ready_order)
from picotron.parallel import data_parallel as package


# ---- the correct answer: the checks' own bases --------------------------------------------------
def unrefused(base: type, **changed) -> type:
    """`base`, a correct class of checks_dp, with its own methods under this file's name: the checks refuse the
    course's classes by module and name (Check.refuse), also on the ranks, where no monkeypatch reaches."""
    body = {k: v for k, v in vars(base).items() if k not in ("__dict__", "__weakref__")}
    return type(base.__name__.lstrip("_"), base.__bases__, {**body, "__module__": __name__, **changed})


Bucket = unrefused(checks_dp._Bucket)
DataParallel = unrefused(checks_dp._DataParallel, bucket=Bucket)


def grad_views(params):
    """The views _Bucket makes (its group is not used before launch)."""
    return checks_dp._Bucket(params, None).buffer


def assign_buckets(model, bucket_numel):
    """given_bucket_plan's cut, which the check refuses to see called by its name."""
    return checks_dp._cut([p for p in model.parameters() if p.requires_grad][::-1], bucket_numel)


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"grad_views": 3, "GradBucket": 6, "hooks": 3, "DataParallel training": 5, "assign_buckets": 5}


@pytest.mark.parametrize("check, answer", [(check_grad_views, grad_views), (check_grad_bucket, Bucket),
                                           (check_hooks, DataParallel), (check_data_parallel, DataParallel),
                                           (check_assign_buckets, assign_buckets)],
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


class BucketDoublesTheMean(Bucket):
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

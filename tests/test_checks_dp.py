"""The checks of assignment 02 pass a correct answer and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught.
"""

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from picotron_course.checks_dp import check_data_parallel, check_grad_bucket, check_grad_views, check_hooks
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


@pytest.mark.parametrize("check, answer", [(check_grad_views, ref_grad_views), (check_grad_bucket, RefBucket),
                                           (check_hooks, RefDP), (check_data_parallel, RefDP)],
                         ids=["grad_views", "bucket", "hooks", "training"])
def test_correct_answer_passes(check, answer, capsys):
    check(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


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
]


@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    if answer is not PackageBucket:  # refused before running: no table
        assert "FAIL" in capsys.readouterr().out

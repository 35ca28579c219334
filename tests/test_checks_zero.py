"""The checks of assignment 03 pass a correct answer and refuse the course's own.

The correct answer is the checks' own correct bases (checks_zero._Zero1, _Unit, _Prefetch), which the
misconceptions change and a learner may not submit: so the records and the check agree on what is right, and a
check that passes everything, or nothing, is caught; other valid answers are written here. Nothing here uses
picotron.parallel.zero. The wrong answers are the checks' misconceptions, each failing with its hint
(tests/test_misconceptions.py).
"""

import functools

import pytest
import torch
import torch.distributed as dist

from picotron_course import checks_zero
from picotron_course.checks_zero import (check_clip_grad_norm, check_shard_range, check_zero1, check_zero3_forward,
                                         check_zero3_prefetch, check_zero3_training, recorded_collectives,
                                         zero1_write_back_demo)
from picotron.launch import run

AVG = dist.ReduceOp.AVG


# ---- the correct answer: the checks' own bases ---------------------------------------------------
def unrefused(base: type, **changed) -> type:
    """`base`, a correct class of checks_zero, with its own methods under this file's name: the checks refuse the
    course's classes by module and name (Check.refuse), also on the ranks, where no monkeypatch reaches."""
    body = {k: v for k, v in vars(base).items() if k not in ("__dict__", "__weakref__")}
    return type(base.__name__.lstrip("_"), base.__bases__, {**body, "__module__": __name__, **changed})


Zero1 = unrefused(checks_zero._Zero1)
Unit = unrefused(checks_zero._Unit)
Prefetch = unrefused(checks_zero._Prefetch)


def clip(shards, numels, max_norm, group):
    """The checks' own clip: one all-reduce of this rank's sum of squares of its real elements, then scale."""
    return checks_zero._clip(shards, numels, max_norm, group)


# ---- other correct answers ------------------------------------------------------------------------
def ref_shard_range(numel, rank, world):   # checks_zero has none of its own
    size = (numel + world - 1) // world
    return rank * size, rank * size + size


class UnitWithComm(Unit):
    """The same through picotron.comm's wrappers (which call torch under other names)."""

    def gather(self):
        from picotron.comm import all_gather
        self.full.untyped_storage().resize_(self.full.numel() * 4)
        all_gather(self.full, self.shard.detach(), self.group)

    def reduce_grads(self):
        from picotron.comm import reduce_scatter
        shard = torch.empty_like(self.shard)
        reduce_scatter(shard, self.flat_grad(), self.group, op=AVG)
        if self.shard.grad is None:
            self.shard.grad = shard
        else:
            self.shard.grad += shard          # in place: also right
        self.drop()


class Zero1FreesGrad(Zero1):
    """Right too: drops the gradient shard once the optimizer has used it (the task does not forbid it)."""

    def step(self):
        super().step()
        self.param_shard.grad = None


def ref_shard_range_list(numel, rank, world):
    import numpy as np
    size = -(-numel // world)
    return [np.int64(rank * size), np.int64((rank + 1) * size)]   # a list of numpy ints: a pair all the same


def ref_clip_float64(shards, numels, max_norm, group):
    """The same in float64, a Python float returned and the gradients rebound rather than scaled in place."""
    rank = dist.get_rank(group)
    total = torch.zeros((), dtype=torch.float64)
    for shard, numel in zip(shards, numels):
        start = rank * shard.numel()
        total += shard.grad.double()[:max(0, numel - start)].square().sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt().item()
    for shard in shards:
        shard.grad = shard.grad * min(1.0, max_norm / (norm + 1e-6))
    return norm


class UnitBackwardPreHook(Unit):
    """Another valid wiring: gather for backward from a module backward pre-hook, not an output hook."""

    def hook_forward(self):
        self.module.register_forward_pre_hook(lambda module, args: self.gather())
        self.module.register_forward_hook(lambda module, args, output: self.free())
        self.module.register_full_backward_pre_hook(lambda module, grad_output: self.gather())


class PrefetchModuleHooks:
    """Right too: picotron.comm's all-gather, the backward order fixed up front (the outer unit, then the others
    reversed), backward gathers from module backward pre-hooks, the first unit of a pass gathered synchronously."""

    def __init__(self, units):
        self.handles = {}
        forward, backward = list(units), [units[0], *units[:0:-1]]
        for unit in units:
            unit.module.register_forward_pre_hook(lambda module, args, unit=unit: self.compute(unit, forward))
            unit.module.register_forward_hook(lambda module, args, output, unit=unit: unit.free())
            unit.module.register_full_backward_pre_hook(lambda module, grad, unit=unit: self.compute(unit, backward))

    def compute(self, unit, order):
        from picotron.comm import all_gather
        if unit in self.handles:
            self.handles.pop(unit).wait()
        else:
            unit.gather()
        after = order.index(unit) + 1
        if after < len(order) and not order[after].full.untyped_storage().nbytes():
            nxt = order[after]
            nxt.full.untyped_storage().resize_(nxt.full.numel() * 4)
            self.handles[nxt] = all_gather(nxt.full, nxt.shard.detach(), nxt.group, async_op=True)


check_prefetch = functools.partial(check_zero3_prefetch, Unit)   # the learner's unit here: the checks' own
CORRECT = [(check_shard_range, ref_shard_range), (check_shard_range, ref_shard_range_list), (check_zero1, Zero1),
           (check_zero1, Zero1FreesGrad), (check_zero3_forward, Unit), (check_zero3_training, Unit),
           (check_zero3_training, UnitWithComm), (check_zero3_training, UnitBackwardPreHook),
           (check_clip_grad_norm, clip), (check_clip_grad_norm, ref_clip_float64),
           (check_prefetch, Prefetch), (check_prefetch, PrefetchModuleHooks)]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"shard_range": 8, "Zero1": 2, "Zero3Unit forward": 2, "Zero3Unit training": 2, "clip_grad_norm_sharded": 5,
         "Zero3Prefetch": 2}


@pytest.mark.parametrize("check, answer", CORRECT, ids=["shard_range", "shard_range_list", "zero1", "zero1_frees_grad",
                                                        "zero3_forward", "zero3_training", "zero3_training_comm",
                                                        "zero3_training_module_hook", "clip", "clip_float64",
                                                        "prefetch", "prefetch_module_hooks"])
def test_correct_answer_passes(check, answer, every_case, capsys):
    check(answer)
    every_case(CASES)
    if check is check_prefetch:
        assert "most held" in capsys.readouterr().out


# ---- answers refused --------------------------------------------------------------------------
# The planted wrong answers are the checks' misconceptions (checks_zero.py), tested in test_misconceptions.py.
CourseAnswer = type("Zero1", (Zero1,), {"__module__": "picotron.parallel.zero"})  # named, never imported
CoursePrefetch = type("Zero3", (Prefetch,), {"__module__": "picotron.parallel.zero3"})


class MisconceptionsBase(checks_zero._Unit):   # the correct base the misconceptions change
    pass


REFUSED = [(check_zero1, CourseAnswer), (check_zero1, checks_zero._Zero1), (check_zero3_forward, MisconceptionsBase),
           (check_zero3_training, checks_zero._Unit), (check_prefetch, CoursePrefetch),
           (check_prefetch, checks_zero._Prefetch),
           (functools.partial(check_zero3_prefetch, checks_zero._Unit), Prefetch)]


@pytest.mark.parametrize("check, answer", REFUSED, ids=["zero1", "zero1_base", "forward_base", "training_base",
                                                        "prefetch", "prefetch_base", "prefetch_unit_base"])
def test_the_course_answer_is_refused(check, answer, capsys):
    with pytest.raises(AssertionError, match="the course's answer"):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def clip_doubles_the_norm(shards, numels, max_norm, group):
    return 2 * clip(shards, numels, max_norm, group)


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    """Fails at the norm, as clip_sums_norms or clip_returns_square do, but with other values: no hint is given."""
    with pytest.raises(AssertionError, match=r"the norm each rank returned .*\(rank 0 of the group\)") as error:
        check_clip_grad_norm(clip_doubles_the_norm)
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


# ---- the recorder ----------------------------------------------------------------------------
def _record_each_name():
    """Every name a learner may call a collective by is recorded once, with its payload bytes."""
    import picotron.comm as comm
    world = dist.get_world_size()
    originals = (dist.all_reduce, dist.all_gather_into_tensor, comm._all_gather_single)
    x, full = torch.ones(3), torch.zeros(3 * world)
    with recorded_collectives() as calls:
        dist.all_reduce(x.clone(), op=AVG)
        dist.all_gather_into_tensor(full, x)
        dist.reduce_scatter_tensor(x.clone(), full)
        comm.all_gather(full, x)
        comm.reduce_scatter(x.clone(), full, op=AVG)
        dist.all_gather([torch.zeros(3) for _ in range(world)], x)
    restored = originals == (dist.all_reduce, dist.all_gather_into_tensor, comm._all_gather_single)
    return [(c.op, c.nbytes, c.reduce) for c in calls], restored


def test_recorder_counts_each_call_once():
    calls, restored = run(_record_each_name, 2, timeout=60)[0]
    assert calls == [("all_reduce", 12, "avg"), ("all_gather", 12, ""), ("reduce_scatter", 24, "sum"),
                     ("all_gather", 12, ""), ("reduce_scatter", 24, "avg"), ("all_gather", 12, "")]
    assert restored


# ---- the stretch's cases and the predict-then-run demo -------------------------------------------
def test_clip_cases_cover_what_the_task_promises():
    """Whole shards of padding, a norm below max_norm (nothing clipped), groups of 2 inside the world."""
    rows = [(len(case["ranks"]), buffers, max_norm)
            for case, (buffers, max_norm) in zip(checks_zero.CLIP.cases, checks_zero._clip_cases())]
    assert any(n <= (world - 1) * -(-n // world) for world, buffers, _ in rows for n in map(len, buffers))
    assert any(world < checks_zero.WORLD for world, _, _ in rows)
    norms = [(torch.linalg.vector_norm(torch.cat(buffers)).item(), max_norm) for _, buffers, max_norm in rows]
    assert any(max_norm > norm for norm, max_norm in norms)
    assert all(max_norm < 0.6 * norm or max_norm > 1.5 * norm for norm, max_norm in norms)   # never borderline


def test_write_back_demo_shows_what_the_notebook_asserts(capsys):
    seen = zero1_write_back_demo()
    one = seen["one process"]
    right, none, own = seen["all-gather"], seen["none"], seen["own slice"]
    assert all(max(abs(a - b) for a, b in zip(losses, one)) < 1e-5 for losses in right["losses"])
    assert right["identical"] and none["identical"] and not own["identical"]
    assert all(losses == [one[0]] * len(one) for losses in none["losses"])  # the model never changes
    assert all(none["shard_moved"]) and none["moved"] == [0.0] * 4           # ... while the shards train
    assert all(0.2 < moved < 0.3 for moved in own["moved"])                  # a quarter of each replica moves
    assert all(one[-1] < losses[-1] < one[0] for losses in own["losses"])   # falls, more slowly than one process
    assert "replicas identical" in capsys.readouterr().out

"""The checks of assignment 03 pass a correct answer and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.parallel.zero.
"""

import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from picotron_course.checks_zero import (check_clip_grad_norm, check_shard_range, check_zero1, check_zero3_forward,
                                         check_zero3_prefetch, check_zero3_training, recorded_collectives,
                                         zero1_write_back_demo)
from picotron.launch import run

AVG = dist.ReduceOp.AVG


# ---- a correct answer ------------------------------------------------------------------------
def ref_shard_range(numel, rank, world):
    size = (numel + world - 1) // world
    return rank * size, rank * size + size


def _views_of(flat, params, attribute):
    start = 0
    for p in params:
        setattr(p, attribute, flat.narrow(0, start, p.numel()).view(p.shape))
        start += p.numel()


class RefZero1:
    """Model parameters and gradients are views of two padded flat buffers; AdamW over this rank's slice."""

    def __init__(self, model, group, lr):
        self.group = group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        start, stop = ref_shard_range(numel, rank, world)
        self.flat_params = torch.zeros(world * (stop - start))
        self.flat_params[:numel] = torch.cat([p.detach().reshape(-1) for p in params])
        self.flat_grads = torch.zeros_like(self.flat_params)
        _views_of(self.flat_params, params, "data")
        _views_of(self.flat_grads, params, "grad")
        self.param_shard = nn.Parameter(self.flat_params[start:stop].clone())
        self.optimizer = torch.optim.AdamW([self.param_shard], lr=lr)

    def step(self):
        self.param_shard.grad = self.reduce(self.flat_grads)
        self.optimizer.step()
        self.gather()

    def reduce(self, flat):
        shard = torch.empty_like(self.param_shard)
        dist.reduce_scatter_tensor(shard, flat, op=AVG, group=self.group)
        return shard

    def gather(self):
        dist.all_gather_into_tensor(self.flat_params, self.param_shard.detach(), group=self.group)

    def zero_grad(self):
        self.flat_grads.zero_()


class RefUnit:
    """One module's parameters as views of a padded flat buffer; this rank keeps 1/N of it."""

    def __init__(self, module, params, group):
        self.module, self.params, self.group = module, list(params), group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        numel = sum(p.numel() for p in self.params)
        start, stop = ref_shard_range(numel, rank, world)
        self.full = torch.zeros(world * (stop - start))
        self.full[:numel] = torch.cat([p.detach().reshape(-1) for p in self.params])
        _views_of(self.full, self.params, "data")
        self.shard = nn.Parameter(self.full[start:stop].clone())
        self.pending = len(self.params)
        self.hook_forward()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)
        self.free()

    def hook_forward(self):
        self.module.register_forward_pre_hook(self.pre_forward)
        self.module.register_forward_hook(self.post_forward)

    def pre_forward(self, module, args):
        self.gather()

    def post_forward(self, module, args, output):
        self.free()
        if output.requires_grad:
            output.register_hook(self.pre_backward)

    def pre_backward(self, grad):
        self.gather()

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
        flat = torch.zeros(self.full.numel())
        flat[:sum(p.numel() for p in self.params)] = torch.cat([p.grad.reshape(-1) for p in self.params])
        return flat

    def reduce_grads(self):
        shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard, self.flat_grad(), op=AVG, group=self.group)
        self.shard.grad = shard if self.shard.grad is None else self.shard.grad + shard
        for p in self.params:
            p.grad = None


class RefUnitWithComm(RefUnit):
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
        for p in self.params:
            p.grad = None


class RefZero1FreesGrad(RefZero1):
    """Right too: drops the gradient shard once the optimizer has used it (the task does not forbid it)."""

    def step(self):
        super().step()
        self.param_shard.grad = None


def ref_shard_range_list(numel, rank, world):
    import numpy as np
    size = -(-numel // world)
    return [np.int64(rank * size), np.int64((rank + 1) * size)]   # a list of numpy ints: a pair all the same


def ref_clip(shards, numels, max_norm, group):
    """Clip by the global norm of the real elements: one all-reduce of this rank's sum of squares."""
    rank = dist.get_rank(group)
    total = torch.zeros(())
    for shard, numel in zip(shards, numels):
        k = shard.numel()
        real = max(0, min(k, numel - rank * k))      # elements of this shard that are not padding
        total += shard.grad[:real].pow(2).sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for shard in shards:
        shard.grad.mul_(coefficient)
    return norm


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


class RefUnitBackwardPreHook(RefUnit):
    """Another valid wiring: gather for backward from a module backward pre-hook, not an output hook."""

    def hook_forward(self):
        self.module.register_forward_pre_hook(self.pre_forward)
        self.module.register_forward_hook(lambda module, args, output: self.free())
        self.module.register_full_backward_pre_hook(lambda module, grad_output: self.gather())


def ref_start_gather(unit):
    unit.full.untyped_storage().resize_(unit.full.numel() * 4)
    return dist.all_gather_into_tensor(unit.full, unit.shard.detach(), group=unit.group, async_op=True)


class RefPrefetch:
    """ZeRO-3 with prefetch: the next unit's all-gather launched (async) when a unit is about to compute, its
    handle waited just before that unit computes; backward in the reverse order of the forwards' ends."""

    def __init__(self, units):
        self.units, self.handles, self.ended = units, {}, []
        for i, unit in enumerate(units):
            unit.module.register_forward_pre_hook(lambda module, args, i=i: self.before_forward(i))
            unit.module.register_forward_hook(lambda module, args, output, i=i: self.after_forward(i, output))

    def launch(self, unit):
        if unit not in self.handles and not unit.full.untyped_storage().nbytes():
            self.handles[unit] = ref_start_gather(unit)

    def ready(self, unit):
        self.launch(unit)
        handle = self.handles.pop(unit, None)
        if handle is not None:
            handle.wait()

    def before_forward(self, i):
        if i == 0:
            self.ended = []
        self.ready(self.units[i])
        if i + 1 < len(self.units):
            self.launch(self.units[i + 1])

    def after_forward(self, i, output):
        self.ended.append(i)
        self.units[i].free()
        if output.requires_grad:
            output.register_hook(lambda grad: self.before_backward(i))

    def before_backward(self, i):
        order = self.ended[::-1]
        self.ready(self.units[i])
        if order.index(i) + 1 < len(order):
            self.launch(self.units[order[order.index(i) + 1]])


class RefPrefetchModuleHooks:
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


CORRECT = [(check_shard_range, ref_shard_range), (check_shard_range, ref_shard_range_list), (check_zero1, RefZero1),
           (check_zero1, RefZero1FreesGrad), (check_zero3_forward, RefUnit), (check_zero3_training, RefUnit),
           (check_zero3_training, RefUnitWithComm), (check_zero3_training, RefUnitBackwardPreHook),
           (check_clip_grad_norm, ref_clip), (check_clip_grad_norm, ref_clip_float64)]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"shard_range": 8, "Zero1": 2, "Zero3Unit forward": 2, "Zero3Unit training": 2, "clip_grad_norm_sharded": 5}


@pytest.mark.parametrize("check, answer", CORRECT, ids=["shard_range", "shard_range_list", "zero1", "zero1_frees_grad",
                                                        "zero3_forward", "zero3_training", "zero3_training_comm",
                                                        "zero3_training_module_hook", "clip", "clip_float64"])
def test_correct_answer_passes(check, answer, every_case):
    check(answer)
    every_case(CASES)


@pytest.mark.parametrize("prefetch", [RefPrefetch, RefPrefetchModuleHooks], ids=lambda cls: cls.__name__)
def test_correct_prefetch_passes(prefetch, capsys):
    check_zero3_prefetch(RefUnit, prefetch)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out
    assert "most held" in out


# ---- planted wrong answers -------------------------------------------------------------------
def sr_floor(numel, rank, world):
    size = numel // world  # rounds down: the last numel % world elements belong to nobody
    return rank * size, (rank + 1) * size


def sr_uneven(numel, rank, world):
    size, extra = divmod(numel, world)  # torch.tensor_split's cut: sizes differ by one
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


class Zero1Sums(RefZero1):
    def reduce(self, flat):
        shard = torch.empty_like(self.param_shard)
        dist.reduce_scatter_tensor(shard, flat, group=self.group)  # sum, never divided
        return shard


class Zero1AllReduce(RefZero1):
    def reduce(self, flat):
        dist.all_reduce(flat, op=AVG, group=self.group)  # the whole mean everywhere, then a slice of it
        rank, size = dist.get_rank(self.group), self.param_shard.numel()
        return flat[rank * size:(rank + 1) * size].clone()


class Zero1WholeModel(RefZero1):
    """Plain data parallelism in ZeRO's clothes: every rank keeps AdamW state for every parameter."""

    def __init__(self, model, group, lr):
        super().__init__(model, group, lr)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self):
        dist.all_reduce(self.flat_grads, op=AVG, group=self.group)
        self.optimizer.step()


class Zero1NoAllGather(RefZero1):
    def gather(self):  # the updated shard goes back into this rank's slice only
        rank, size = dist.get_rank(self.group), self.param_shard.numel()
        self.flat_params[rank * size:(rank + 1) * size] = self.param_shard.detach()


class Zero1NoDetach(RefZero1):
    def gather(self):  # param_shard requires grad: torch refuses to write it into flat_params' views
        dist.all_gather_into_tensor(self.flat_params, self.param_shard, group=self.group)


class Zero1Unpadded(RefZero1):
    """Reduce-scatters the gradients of the parameters only, without the padding."""

    def __init__(self, model, group, lr):
        super().__init__(model, group, lr)
        self.numel = sum(p.numel() for p in model.parameters())

    def reduce(self, flat):
        return super().reduce(flat[:self.numel])


class UnitNeverFrees(RefUnit):
    def free(self):
        pass


class UnitGathersIntoFreedMemory(RefUnit):
    def gather(self):  # forgets to give the buffer its memory back
        dist.all_gather_into_tensor(self.full, self.shard.detach(), group=self.group)


class UnitNoForwardGather(RefUnit):
    def hook_forward(self):
        self.module.register_forward_hook(self.post_forward)


class UnitNoBackwardGather(RefUnit):
    def post_forward(self, module, args, output):
        self.free()


class UnitSums(RefUnit):
    def reduce_grads(self):
        shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard, self.flat_grad(), group=self.group)
        self.shard.grad = shard
        for p in self.params:
            p.grad = None


class UnitAllReduce(RefUnit):
    def reduce_grads(self):
        flat = self.flat_grad()
        dist.all_reduce(flat, op=AVG, group=self.group)
        rank, size = dist.get_rank(self.group), self.shard.numel()
        self.shard.grad = flat[rank * size:(rank + 1) * size].clone()
        for p in self.params:
            p.grad = None


class UnitKeepsFullGrads(RefUnit):
    def reduce_grads(self):
        shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard, self.flat_grad(), op=AVG, group=self.group)
        self.shard.grad = shard  # the p.grad stay: a full gradient on every rank


class UnitUnpadded(RefUnit):
    def flat_grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])


class UnitOverwritesGrad(RefUnit):
    def reduce_grads(self):
        shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(shard, self.flat_grad(), op=AVG, group=self.group)
        self.shard.grad = shard  # the micro-batch before is lost
        for p in self.params:
            p.grad = None


# ---- planted wrong answers to the clip: plausible ways to get the global norm wrong ----------------
def _clip_with(shards, norm, max_norm, clamp=True):
    coefficient = max_norm / (norm + 1e-6)
    if clamp:
        coefficient = min(1.0, coefficient)
    for shard in shards:
        shard.grad.mul_(coefficient)
    return norm


def _real(shard, numel, rank):
    k = shard.numel()
    return shard.grad[:max(0, min(k, numel - rank * k))]


def clip_counts_padding(shards, numels, max_norm, group):
    total = sum(shard.grad.pow(2).sum() for shard in shards)   # the padding's junk too
    dist.all_reduce(total, group=group)
    return _clip_with(shards, total.sqrt().item(), max_norm)


def clip_sums_norms(shards, numels, max_norm, group):
    rank = dist.get_rank(group)
    local = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels)).sqrt()
    dist.all_reduce(local, group=group)                          # sum of the ranks' norms
    return _clip_with(shards, local.item(), max_norm)


def clip_local_norm(shards, numels, max_norm, group):
    rank = dist.get_rank(group)
    local = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels)).sqrt()
    return _clip_with(shards, local.item(), max_norm)          # this rank's shards only


def clip_per_buffer(shards, numels, max_norm, group):
    rank, total = dist.get_rank(group), 0.0
    for s, n in zip(shards, numels):
        squares = _real(s, n, rank).pow(2).sum()
        dist.all_reduce(squares, group=group)                    # one all-reduce per buffer
        total += squares.item()
    return _clip_with(shards, math.sqrt(total), max_norm)


def clip_gathers(shards, numels, max_norm, group):
    world, total = dist.get_world_size(group), 0.0
    for s, n in zip(shards, numels):
        full = torch.empty(world * s.numel())
        dist.all_gather_into_tensor(full, s.grad, group=group)  # the whole gradient, to every rank
        total += full[:n].pow(2).sum().item()
    return _clip_with(shards, math.sqrt(total), max_norm)


def clip_never_clamps(shards, numels, max_norm, group):
    return _clip_with(shards, ref_norm(shards, numels, group), max_norm, clamp=False)


def clip_returns_square(shards, numels, max_norm, group):
    norm = ref_norm(shards, numels, group)
    _clip_with(shards, norm, max_norm)
    return norm ** 2


def clip_global_rank(shards, numels, max_norm, group):
    rank = dist.get_rank()                                       # the rank in the world, not in the group
    total = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels))
    dist.all_reduce(total, group=group)
    return _clip_with(shards, total.sqrt().item(), max_norm)


def clip_whole_world(shards, numels, max_norm, group):
    rank = dist.get_rank(group)
    total = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels))
    dist.all_reduce(total)                                       # forgot group=: every rank of the world
    return _clip_with(shards, total.sqrt().item(), max_norm)


def clip_forgets_to_scale(shards, numels, max_norm, group):
    norm = ref_norm(shards, numels, group)
    [shard.grad * min(1.0, max_norm / (norm + 1e-6)) for shard in shards]   # computed, never stored
    return norm


def clip_averages(shards, numels, max_norm, group):
    rank = dist.get_rank(group)
    total = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels))
    dist.all_reduce(total, op=AVG, group=group)
    return _clip_with(shards, total.sqrt().item(), max_norm)


def clip_reduces_two_numbers(shards, numels, max_norm, group):
    rank = dist.get_rank(group)
    squares = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels))
    both = torch.stack([squares, torch.zeros(())])             # 8 bytes in fp32, but two numbers
    dist.all_reduce(both, group=group)
    return _clip_with(shards, both[0].sqrt().item(), max_norm)


def ref_norm(shards, numels, group):
    rank = dist.get_rank(group)
    total = sum(_real(s, n, rank).pow(2).sum() for s, n in zip(shards, numels))
    dist.all_reduce(total, group=group)
    return total.sqrt().item()


# ---- planted wrong answers to the stretch: ZeRO-3 with prefetch, each breaking one rule of the task ---------
class PrefetchSync(RefPrefetch):
    """No prefetch: each unit gathers itself, synchronously, when it is about to compute (section 3 again)."""

    def launch(self, unit):
        if not unit.full.untyped_storage().nbytes():
            unit.gather()

    def before_forward(self, i):
        if i == 0:
            self.ended = []
        self.ready(self.units[i])


class PrefetchLate(RefPrefetch):
    """Asynchronous, but each unit's all-gather launched only when the unit itself is about to compute."""

    def before_forward(self, i):
        if i == 0:
            self.ended = []
        self.ready(self.units[i])


class PrefetchAllUpFront(RefPrefetch):
    """Every unit's all-gather launched when the forward starts: nothing waits, but every unit is held at once."""

    def before_forward(self, i):
        if i == 0:
            self.ended = []
            for unit in self.units:
                self.launch(unit)
        self.ready(self.units[i])


class PrefetchNeverFrees(RefPrefetch):
    """Forgets free_params after each unit's forward."""

    def after_forward(self, i, output):
        self.ended.append(i)
        if output.requires_grad:
            output.register_hook(lambda grad: self.before_backward(i))


class PrefetchWrongHandle(RefPrefetch):
    """One handle for all: launching the next unit's all-gather overwrites the handle of this unit's, which is
    never waited; the one waited is the next unit's."""

    def before_forward(self, i):
        if i == 0:
            self.ended = []
            self.handle = ref_start_gather(self.units[0])
        if i + 1 < len(self.units):
            self.handle = ref_start_gather(self.units[i + 1])
        self.handle.wait()


class PrefetchNeverWaits(RefPrefetch):
    """Launches every all-gather asynchronously and drops the handles."""

    def ready(self, unit):
        self.launch(unit)
        self.handles.pop(unit, None)


class PrefetchWaitsEarly(RefPrefetch):
    """Waits on each handle right after launching it: synchronous again."""

    def launch(self, unit):
        super().launch(unit)
        if unit in self.handles:
            self.handles.pop(unit).wait()


class PrefetchGathersTwice(RefPrefetch):
    """Prefetches, then gathers each unit again, synchronously, before it computes."""

    def ready(self, unit):
        super().ready(unit)
        unit.gather()


class PrefetchBackwardSync(RefPrefetch):
    """Prefetches in forward only: backward gathers each unit, synchronously, when its backward starts."""

    def before_backward(self, i):
        self.units[i].gather()


class PrefetchBackwardLate(RefPrefetch):
    """Asynchronous in backward too, but each unit's all-gather launched only when its own backward starts."""

    def before_backward(self, i):
        self.ready(self.units[i])


class PrefetchKeepsOuter(RefPrefetch):
    """Keeps the outer unit gathered from the end of forward to its backward (it is needed again first)."""

    def after_forward(self, i, output):
        if i:
            super().after_forward(i, output)
            return
        self.ended.append(i)
        output.register_hook(lambda grad: self.before_backward(i))


class PrefetchStaging(RefPrefetch):
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


class PrefetchOnSummingUnits(RefPrefetch):
    """Right, but over units whose reduce_scatter_grads sums the gradients (section 4's mistake): the results
    must equal one process's."""


class PrefetchBackwardInForwardOrder(RefPrefetch):
    """In backward, "next" taken as in forward (units[i + 1]) instead of the reverse order of the forwards' ends."""

    def before_backward(self, i):
        self.ready(self.units[i])
        if i + 1 < len(self.units):
            self.launch(self.units[i + 1])


class PrefetchFreesInFlight(RefPrefetch):
    """Frees the next unit, its all-gather still in flight, when a unit's forward ends (e.g. a free of the
    wrong unit)."""

    def after_forward(self, i, output):
        super().after_forward(i, output)
        if i + 1 < len(self.units) and self.units[i + 1] in self.handles:
            self.units[i + 1].free()


class PrefetchWrongShard(RefPrefetch):
    """Launches the next unit's all-gather from this unit's shard: the units differ in size, so the ranks would
    exchange buffers of the wrong size (a crash or a hang); the recorder refuses it before the call."""

    def before_forward(self, i):
        if i == 0:
            self.ended = []
        self.ready(self.units[i])
        if i + 1 < len(self.units):
            nxt = self.units[i + 1]
            nxt.full.untyped_storage().resize_(nxt.full.numel() * 4)
            self.handles[nxt] = dist.all_gather_into_tensor(nxt.full, self.units[i].shard.detach(), async_op=True)


CourseAnswer = type("Zero1", (RefZero1,), {"__module__": "picotron.parallel.zero"})  # named, never imported
CoursePrefetch = type("Zero3", (RefPrefetch,), {"__module__": "picotron.parallel.zero3"})
check_prefetch = functools.partial(check_zero3_prefetch, RefUnit)   # the learner's unit here: the reference one
check_prefetch_summing = functools.partial(check_zero3_prefetch, UnitSums)

WRONG_ANSWERS = [
    (check_shard_range, sr_floor, "cover only"),
    (check_shard_range, sr_uneven, "same size"),
    (check_zero1, Zero1Sums, "looks like the sum"),
    (check_zero1, Zero1AllReduce, "called all-reduce"),
    (check_zero1, Zero1WholeModel, "whole model"),
    (check_zero1, Zero1NoAllGather, "no all-gather"),
    (check_zero1, Zero1Unpadded, "Pad the flat buffer"),
    (check_zero1, Zero1NoDetach, r"detach\(\)"),
    (check_zero1, CourseAnswer, "the course's answer"),
    (check_zero3_forward, UnitNeverFrees, "still hold"),
    (check_zero3_forward, UnitGathersIntoFreedMemory, "memory was freed"),
    (check_zero3_forward, UnitNoForwardGather, "starts its forward with parameters that have no memory"),
    (check_zero3_training, UnitNoBackwardGather, "runs its backward with parameters that have no memory"),
    (check_zero3_training, UnitSums, "looks like the sum"),
    (check_zero3_training, UnitAllReduce, "all-reduce called"),
    (check_zero3_training, UnitKeepsFullGrads, "full gradients"),
    (check_zero3_training, UnitUnpadded, "Pad the flat buffer"),
    (check_zero3_training, UnitOverwritesGrad, "not the sum of their averaged gradient shards"),
    (check_clip_grad_norm, clip_counts_padding, "counts the padding"),
    (check_clip_grad_norm, clip_sums_norms, "sum of the ranks' norms"),
    (check_clip_grad_norm, clip_local_norm, "no collective"),
    (check_clip_grad_norm, clip_per_buffer, "all-reduces: make one"),
    (check_clip_grad_norm, clip_gathers, "all_gather called"),
    (check_clip_grad_norm, clip_never_clamps, "never scales gradients up"),
    (check_clip_grad_norm, clip_returns_square, "return its square root"),
    (check_clip_grad_norm, clip_global_rank, "place in `group`"),
    (check_clip_grad_norm, clip_whole_world, "place in `group`"),
    (check_clip_grad_norm, clip_forgets_to_scale, "were not scaled"),
    (check_clip_grad_norm, clip_averages, "op=AVG"),
    (check_clip_grad_norm, clip_reduces_two_numbers, "carried 2 numbers"),
    (check_prefetch, PrefetchSync, "forward: attn 0's all-gather was called without async_op=True"),
    (check_prefetch, PrefetchLate, "attn 0's all-gather was launched after model's forward started"),
    (check_prefetch, PrefetchAllUpFront, r"4 units besides the outer one held .* gathered ahead at once"),
    (check_prefetch, PrefetchNeverFrees, r"held their full parameters at once .* free each unit's parameters right "
                                         "after its forward"),
    (check_prefetch, PrefetchWrongHandle, "model's forward started before the handle of its all-gather was waited.* "
                                          r"\(the handle waited was attn 0's\)"),
    (check_prefetch, PrefetchNeverWaits, "model's forward started before the handle of its all-gather was waited"),
    (check_prefetch, PrefetchWaitsEarly, "attn 0's all-gather was waited before model's forward started: waiting so "
                                         "early makes the gather synchronous"),
    (check_prefetch, PrefetchGathersTwice, "forward: model was all-gathered 2 times"),
    (check_prefetch, PrefetchBackwardSync, "backward: mlp 1's all-gather was called without async_op=True"),
    (check_prefetch, PrefetchBackwardLate, "backward: mlp 1's all-gather was launched after model's backward began "
                                           "computing"),
    (check_prefetch, PrefetchBackwardInForwardOrder, "backward: mlp 1 was all-gathered 2 times.* reverse order of "
                                                     "their forwards' ends: model, mlp 1, attn 1, mlp 0, attn 0"),
    (check_prefetch, PrefetchKeepsOuter, "forward: when the forward returned, model still held"),
    (check_prefetch, PrefetchStaging, "no unit's `full`"),
    (check_prefetch_summing, PrefetchOnSummingUnits, "looks like the sum"),
    (check_prefetch, PrefetchFreesInFlight, "mlp 0's memory was resized to 0 bytes while its all-gather was in flight"),
    (check_prefetch, PrefetchWrongShard, "fills 8352 elements, but its output has 3072"),
    (check_prefetch, CoursePrefetch, "the course's answer"),
]


@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    if answer not in (CourseAnswer, CoursePrefetch):  # refused before running: no table
        assert "FAIL" in capsys.readouterr().out


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
    from picotron_course.checks_zero import _clip_cases
    cases = _clip_cases()
    numels = [(len(members), b.numel()) for case in cases for members, buffers in zip(case["groups"], case["buffers"])
              for b in buffers]
    assert any(n <= (world - 1) * -(-n // world) for world, n in numels)     # a rank whose shard is all padding
    assert any(max(case["max_norm"]) > 1 for case in cases)
    assert any(len(case["groups"]) > 1 for case in cases)
    for case in cases:
        for buffers, max_norm in zip(case["buffers"], case["max_norm"]):
            norm = torch.linalg.vector_norm(torch.cat(buffers)).item()
            assert max_norm < 0.6 * norm or max_norm > 1.5 * norm             # clipped or not, never borderline


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

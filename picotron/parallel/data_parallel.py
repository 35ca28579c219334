"""Data parallelism: every rank holds the whole model and trains on its own slice of the batch.

After the backward pass each rank has the gradient of *its* samples; averaging the gradients
over the N dp ranks gives exactly the gradient of the whole global batch (the loss is a mean
over equally sized slices), so every rank takes the same optimizer step and the replicas stay
identical. Playbook, "Data Parallelism".

Cost per step: an all-reduce of every gradient, 2 (N-1)/N * 4 bytes * params sent per rank
(fp32 gradients, ring algorithm); memory: a full copy of model, gradients and optimizer state
on every rank. Three ways to pay for the all-reduce, in the order the Playbook builds them
(chapter 02 measures each):

    all_reduce_each_gradient   naive: after backward, one blocking all-reduce per parameter.
                               Every call pays the collective's latency, and backward is over
                               before the first byte moves.
    DataParallel(bucket_mb=0)  overlapped: a hook launches each gradient's all-reduce the moment
                               autograd has finished it, while backward computes the rest.
    DataParallel(bucket_mb=25) bucketed and overlapped: gradients live as views in flat buffers
                               of ~bucket_mb MiB; each buffer is all-reduced with one async call
                               as soon as its last gradient is ready (Li et al. 2020, "PyTorch
                               Distributed", arXiv:2006.15704, the design of torch's DDP).

Gradient accumulation runs the backward of several micro-batches before one optimizer step;
inside `DataParallel.no_sync()` gradients only add up locally, and the last micro-batch's
backward syncs them once (Playbook, "Adding gradient accumulation").

`all_reduce_gradients` (one flat all-reduce after backward) is the plain version the trainer
uses, and `broadcast_parameters` makes the replicas start identical. To measure what they send,
open `picotron.comm.counting()` around the work. Chapter: chapters/02_data_parallel.ipynb.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm

__all__ = ["broadcast_parameters", "all_reduce_gradients", "all_reduce_each_gradient", "assign_buckets",
           "GradBucket", "DataParallel"]


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Copy the first dp rank's weights to the others, so replicas start identical whatever the seed."""
    src = dist.get_global_rank(group, 0)
    for param in model.parameters():
        comm.broadcast(param.data, src=src, group=group)


# ---- after backward: naive and flat ------------------------------------------------------------
def all_reduce_each_gradient(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Naive DP: average each gradient over `group` with its own blocking all-reduce, after backward.

    Correct, and as slow as it gets: one collective latency per parameter tensor, and none of
    the communication overlaps the backward pass.
    """
    world = dist.get_world_size(group)
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad, group=group)  # sum over ranks
            param.grad.div_(world)                     # sum -> mean


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Average the gradients over the ranks of `group`, with one all-reduce of a flat buffer.

    One big all-reduce instead of one per parameter: each call pays a fixed latency, and
    a small model has dozens of small tensors (chapter 02 measures the difference).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])    # (total params,)
    comm.all_reduce(flat, group=group)                  # sum over ranks
    flat.div_(world)                                    # sum -> mean
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


# ---- buckets -------------------------------------------------------------------------------------
def assign_buckets(params: list[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Cut `params` (in the order given) into consecutive groups of about `bucket_numel` elements.

    A bucket closes once it holds at least `bucket_numel` elements, so a parameter larger than
    that gets a bucket of its own (bucket_numel=0: one bucket per parameter) and no parameter is
    ever split. Parameters of another dtype or device start a new bucket: one buffer, one dtype.
    """
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for param in params:
        last = buckets[-1][-1] if buckets else None
        if last is None or size >= bucket_numel or (param.dtype, param.device) != (last.dtype, last.device):
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += param.numel()
    return buckets


class GradBucket:
    """The gradients of a few parameters, stored as views into one flat buffer, all-reduced together.

    `param.grad` *is* a slice of `buffer`: autograd adds each gradient in place into it, so the
    bucket is ready to send without a copy (DDP's gradient_as_bucket_view). When the last of its
    parameters is marked ready, `launch` starts one asynchronous all-reduce of the whole buffer;
    `wait` blocks until it is done. `launched_at` / `done_at` (time.perf_counter) record the last
    all-reduce, for timeline pictures.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        self.params, self.group = params, group
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                                  device=params[0].device)   # (bucket numel,)
        self.views: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for param in params:
            self.views[param] = self.buffer[offset:offset + param.numel()].view_as(param)
            if param.grad is not None:  # a gradient accumulated before the bucket existed is kept
                self.views[param].copy_(param.grad)
            param.grad = self.views[param]
            offset += param.numel()
        self.ready: set[nn.Parameter] = set()
        self.work = None
        self.launched_at = self.done_at = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def store(self, param: nn.Parameter) -> None:
        """Make `param.grad` the bucket's view again, if it is not.

        `optimizer.zero_grad()` sets grads to None by default; autograd then hands the next
        gradient over in a fresh tensor. Copy it into the bucket and point .grad back at the view.
        """
        view = self.views[param]
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def mark_ready(self, param: nn.Parameter) -> bool:
        """Note that `param`'s gradient is final for this step; True when the whole bucket is."""
        self.ready.add(param)
        return self.is_full

    @property
    def is_full(self) -> bool:
        return len(self.ready) == len(self.params)

    def launch(self) -> None:
        """Start averaging the buffer over the group, asynchronously."""
        # Divide before summing, as DDP does: the same mean, and an fp16/bf16 sum cannot overflow.
        self.buffer.div_(dist.get_world_size(self.group))
        self.launched_at, self.done_at = time.perf_counter(), None
        self.work = comm.all_reduce(self.buffer, group=self.group, async_op=True)
        self.work.get_future().then(self._record_done)

    def _record_done(self, future) -> None:
        # Runs in the backend's thread when the all-reduce completes (after the GPU work, on NCCL).
        self.done_at = time.perf_counter()

    def wait(self) -> None:
        """Block until the all-reduce is done, then get ready for the next step."""
        self.work.wait()
        self.work = None
        self.ready.clear()


class DataParallel:
    """Average the gradients of `model` over `group`, bucketed and overlapped with the backward pass.

        dp = DataParallel(model, mesh.dp_group, bucket_mb=25)
        for micro_step in range(accum):
            with dp.no_sync() if micro_step < accum - 1 else nullcontext():
                loss_fn(model(x), y).backward()   # buckets all-reduce while backward runs
        dp.finish_gradient_sync()                 # wait for them; grads now hold the global mean
        optimizer.step()

    The model itself is untouched (call it as usual); its gradients become views into the
    buckets' buffers, and a post-accumulate-grad hook on every parameter feeds the buckets.
    Construction broadcasts the first rank's weights, as DDP does, so the replicas start equal.

    bucket_mb: MiB of gradients per bucket (torch DDP's bucket_cap_mb, also 25 by default);
        0 gives one bucket per parameter. Parameters are bucketed in reverse order, roughly the
        order backward finishes them, so the first bucket fills first.
    overlap: launch each bucket's all-reduce from the hook as soon as it is full (True), or
        all of them in `finish_gradient_sync` after backward (False, to measure what overlap buys).
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, bucket_mb: float = 25.0,
                 overlap: bool = True):
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be >= 0 (0: one bucket per parameter)")
        self.model, self.group, self.overlap = model, group, overlap
        self.require_sync = True
        broadcast_parameters(model, group)  # replicas must start identical
        params = [p for p in model.parameters() if p.requires_grad]  # a tied weight appears once
        if not params:
            raise ValueError(f"{type(model).__name__} has no parameter that requires grad: nothing to average")
        bucket_numel = int(bucket_mb * 2**20) // params[0].element_size()
        self.buckets = [GradBucket(chunk, group) for chunk in assign_buckets(params[::-1], bucket_numel)]
        self.bucket_of = {p: bucket for bucket in self.buckets for p in bucket.params}
        self.names = {p: name for name, p in model.named_parameters()}
        for param in params:
            # Fires once per backward, after autograd has added this parameter's whole gradient into
            # .grad (a tied embedding's input and output contributions are summed first). A hook on
            # the gradient (tensor.register_hook) fires *before* that: .grad would not hold it yet.
            param.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of[param]
        bucket.store(param)
        if self.require_sync and bucket.mark_ready(param) and self.overlap:
            bucket.launch()  # returns at once; backward goes on computing earlier layers

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally (no communication).

        For gradient accumulation: run all micro-batches but the last inside this block; the
        last one's backward all-reduces the summed gradients once. Same idea as DDP.no_sync.
        """
        before, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = before

    def finish_gradient_sync(self) -> None:
        """Wait for every bucket's all-reduce (launch those still waiting, without overlap).

        Call it after the last backward of a step and before clipping or the optimizer step.
        """
        for i, bucket in enumerate(self.buckets):
            if bucket.work is None:
                if not bucket.is_full:
                    raise RuntimeError(self._not_ready_message(i, bucket))
                bucket.launch()
        for bucket in self.buckets:
            bucket.wait()

    def _not_ready_message(self, i: int, bucket: GradBucket) -> str:
        missing = [self.names[p] for p in bucket.params if p not in bucket.ready]
        if len(missing) == len(bucket.params):
            hint = ("no gradient arrived since the last finish_gradient_sync: run a backward outside "
                    "no_sync() before calling it (once per optimizer step)")
        else:
            hint = ("these parameters got no gradient in the last backward; every parameter must take part "
                    "in the loss (or set requires_grad=False on it before building DataParallel)")
        return (f"bucket {i} of {len(self.buckets)} has {len(bucket.ready)} of {len(bucket.params)} gradients "
                f"ready (missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); {hint}")

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradients all-reduced per step: 4 bytes x parameters in fp32."""
        return sum(bucket.nbytes for bucket in self.buckets)

"""Data parallelism: every rank holds the whole model and trains on its own slice of the batch.

After the backward pass each rank has the gradient of *its* micro-batches; averaging the
gradients over the dp ranks gives exactly the gradient of the whole global batch (the loss
is a mean over equally sized slices), so every rank takes the same optimizer step and the
replicas stay identical. Playbook, "Data Parallelism".

Cost per step: one all-reduce of all gradients, 2 (N-1)/N * 4 bytes * params sent per rank
(fp32 gradients, ring algorithm); memory: a full copy of model, gradients and optimizer
state on every rank.

This file holds the plain version the trainer uses: one flat all-reduce after the backward
pass. Chapter 02 builds the overlapped and bucketed versions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.comm import CommCounter


def broadcast_parameters(model: nn.Module, group: dist.ProcessGroup, *, counter: CommCounter | None = None) -> None:
    """Copy the first dp rank's weights to the others, so replicas start identical whatever the seed."""
    src = dist.get_global_rank(group, 0)
    for param in model.parameters():
        comm.broadcast(param.data, src=src, group=group, counter=counter)


def all_reduce_gradients(model: nn.Module, group: dist.ProcessGroup, *, counter: CommCounter | None = None) -> None:
    """Average the gradients over the ranks of `group`, with one all-reduce of a flat buffer.

    One big all-reduce instead of one per parameter: each call pays a fixed latency, and
    a small model has dozens of small tensors (chapter 02 measures the difference).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])    # (total params,)
    comm.all_reduce(flat, group=group, counter=counter)  # sum over ranks
    flat.div_(world)                                     # sum -> mean
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

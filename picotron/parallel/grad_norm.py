"""Gradient clipping over a model split any way: the norm of the whole gradient, from its pieces.

torch.nn.utils.clip_grad_norm_ scales the gradient g by min(1, max_norm / ||g||). When g is
spread over ranks, ||g||^2 is still a sum over the elements of the whole model's gradient, so
each rank adds the squares of the elements it *counts*, one all-reduce of a scalar sums them,
and every rank scales what it holds by the same factor. The only question is which rank counts
each element, exactly once in the world: `counted_here` answers it for every layout picotron
builds (chapters/08_5d_parallelism.ipynb; ZeRO's shards: chapters/03_zero.ipynb).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from picotron import comm
from picotron.mesh import Mesh


def counted_here(param: nn.Parameter, mesh: Mesh, *, sharded_over_dp: bool = False, ep: int = 1) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm.

    A tensor-parallel shard (it has `tp_shard_dim`) is a distinct piece on every tp rank; a weight
    without one (the norms, an MoE block) is the same on all of them: tp rank 0 counts it. After the
    gradients are averaged the dp x cp replicas hold the same gradient, so their first counts it,
    unless each holds a different shard of it (ZeRO: `sharded_over_dp`). An expert's replicas are
    the ranks that hold the same experts: the same dp rank modulo ep, any cp rank.
    """
    if mesh.tp_rank != 0 and not hasattr(param, "tp_shard_dim"):
        return False
    if sharded_over_dp:
        return True
    if getattr(param, "expert_parallel", False):
        return mesh.cp_rank == 0 and mesh.dp_rank < ep
    return mesh.dp_rank == 0 and mesh.cp_rank == 0


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What the gradient is multiplied by: max_norm / ||g||, never above 1 (torch's rule, same epsilon)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def sum_of_squares(grads: Iterable[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """sum of g^2 over every element of `grads`, in fp32 (a 0-d tensor; zero for no gradient)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total = total + g.float().square().sum()
    return total


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, group=None, *,
                    counted: Callable[[nn.Parameter], bool] | None = None) -> torch.Tensor:
    """Scale every `.grad` of `params` so that the whole gradient's norm is at most max_norm; return the norm.

    `counted(param)` says whether this rank adds param's squares (default: every one, for a
    gradient this rank alone holds); the squares are summed over `group` (default: all ranks; no
    communication without a process group).
    """
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else None
    squares = sum_of_squares((p.grad for p in params if counted is None or counted(p)), device)
    if torch.distributed.is_initialized():
        comm.all_reduce(squares, group)
    norm = squares.sqrt()
    factor = clip_factor(norm, max_norm)
    for p in params:
        p.grad.mul_(factor.to(p.grad.dtype))
    return norm

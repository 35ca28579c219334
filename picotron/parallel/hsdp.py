"""HSDP, hybrid sharded data parallelism: ZeRO within a group of s ranks, plain replicas across r groups.

ZeRO-3 over all N = s * r data-parallel ranks gathers every unit from N ranks, twice a step, and on
a cluster most of those ranks sit on other nodes, behind a network several times slower than the
links inside one (NVLink). HSDP keeps the sharding inside a group of s ranks (a node) and
replicates it r times: rank i of every shard group holds the same shard i. What moves where:

    all-gather (parameters)        inside the shard group, s ranks: the fast links
    reduce-scatter (gradients)     inside the shard group, then
    all-reduce (gradient shards)   across the replicate group, r ranks: 1/s of the gradient on the slow links

Memory per rank is ZeRO's over s ranks, not N: the replicas hold the same shards. The recipe is
CS231n's DP -> FSDP -> HSDP and PyTorch FSDP2's HSDP (fully_shard over a 2-D device mesh of
(replicate, shard)). picotron's ZeroOptimizer (stages 1-2) and Zero3 take it as one more argument:

    shard_group, replicate_group = hsdp_groups(shard_size=2)          # world 4 = 2 replicas x 2 shards
    zero = Zero3(model, shard_group, replicate_group=replicate_group, optimizer=...)

Chapter: chapters/03_zero.ipynb. The bytes: picotron.parallel.zero.zero_comm_bytes(..., replicate=r).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from picotron.mesh import Mesh

__all__ = ["hsdp_groups", "check_replicate_group"]


def _dp_lines(mesh: Mesh | None) -> list[list[int]]:
    """The global ranks of every data-parallel group: the whole world, or each line along a mesh's dp axis."""
    if mesh is None:
        return [list(range(dist.get_world_size()))]
    others = ("pp", "cp", "tp")
    return [[mesh.rank_of(dp=d, **dict(zip(others, fixed))) for d in range(mesh.dp_size)]
            for fixed in itertools.product(*(range(mesh.sizes[a]) for a in others))]


def hsdp_groups(shard_size: int, mesh: Mesh | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (shard group, replicate group) for HSDP over the data-parallel ranks.

    The dp ranks (the whole world, or each of `mesh`'s dp groups) are cut into groups of
    `shard_size` consecutive ranks, where the all-gathers run (neighbours: the same node); the
    replicate group of a rank joins the ranks at its position in every shard group. World 4,
    shard_size 2: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}.
    Call it on every rank, in the same order (every rank creates every group).
    """
    if not dist.is_initialized():
        raise RuntimeError("hsdp_groups needs a process group: call it inside the function you pass to "
                           "picotron.launch.run (or under torchrun)")
    lines = _dp_lines(mesh)
    ranks = len(lines[0])
    if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1 or ranks % shard_size:
        raise ValueError(f"shard_size={shard_size!r} does not divide the {ranks} data-parallel ranks into shard "
                         f"groups; choose a divisor of {ranks} (1: plain replicas, {ranks}: ZeRO over all of them)")
    me, mine = dist.get_rank(), {}
    for line in lines:
        for kind, groups in (("shard", [line[i:i + shard_size] for i in range(0, ranks, shard_size)]),
                             ("replicate", [line[i::shard_size] for i in range(shard_size)])):
            for members in groups:
                group = dist.new_group(members)
                if me in members:
                    mine[kind] = group
    return mine["shard"], mine["replicate"]


def check_replicate_group(group: dist.ProcessGroup, replicate_group: dist.ProcessGroup,
                          device: torch.device) -> int:
    """Check that `group` (the shard group) and `replicate_group` tile the dp ranks as HSDP needs; return r.

    This rank must be in both, the two must cross in this rank only, and every rank of the
    replicate group must hold the same shard (the same position in a shard group of the same
    size). The last is a fact about other ranks: one all-gather of two numbers over the replicate
    group finds it out (every rank checks, so all raise together). Not counted: set-up, not training.
    """
    me = dist.get_rank()
    if dist.get_rank(replicate_group) < 0:
        raise ValueError(f"global rank {me} is not a member of replicate_group; pass this rank's own "
                         f"(hsdp_groups builds both groups)")
    shared = sorted(set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(replicate_group)))
    if shared != [me]:
        raise ValueError(f"the shard group and replicate_group share ranks {shared}; they must cross in this rank "
                         f"only (a shard group of s ranks, replicated across r groups): build them with hsdp_groups")
    position = torch.tensor([dist.get_rank(group), dist.get_world_size(group)], device=device)
    everyone = [torch.empty_like(position) for _ in range(dist.get_world_size(replicate_group))]
    dist.all_gather(everyone, position, group=replicate_group)
    held = sorted({tuple(t.tolist()) for t in everyone})
    if len(held) > 1:
        raise ValueError(f"replicate_group joins ranks at (shard, shard group size) {held}; it must join the ranks "
                         f"holding the same shard, the i-th of each shard group of one size: build them with "
                         f"hsdp_groups")
    return dist.get_world_size(replicate_group)

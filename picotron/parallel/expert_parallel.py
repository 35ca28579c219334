"""Expert parallelism: the experts of a mixture-of-experts layer split over ranks, tokens sent to them.

Expert parallelism (GShard, Lepikhin et al. 2020, arXiv:2006.16668; Playbook, "Expert parallelism")
gives each of the ep ranks E/ep whole experts of picotron.model.MoE; the router and the rest of the
model stay replicated, and each rank routes its own tokens. In every MoE layer:

    permute   sort this rank's (token, expert) slots by expert, hence by the rank owning it
    counts    all-to-all of the slot counts: each rank learns how many rows it will receive
    dispatch  all-to-all of the slots, uneven splits: rank r gets every rank's slots for its experts
    compute   regroup the received rows by local expert, run each expert on its rows
    combine   the reverse all-to-all brings the outputs home; sum them weighted by the gates

Both row all-to-alls are `TokenAllToAll`, whose backward is the reverse all-to-all. The ep groups are
carved out of the data-parallel (or dp x cp) ranks, not a mesh axis of their own (docs/design.md,
"Expert parallelism inside data parallelism"); `average_gradients` then averages the expert and the
other gradients over the right ranks.

    model = Llama(config)                                   # config.num_experts > 0, same weights on every rank
    groups = expert_parallel_groups(mesh, ep=2)             # from mesh's dp (x cp) ranks
    apply_expert_parallel(model, groups)                    # keeps this rank's experts
    loss = loss_fn(model(input_ids), targets) + model.aux_loss()
    loss.backward()
    average_gradients(model, groups)

To measure what it sends, open `picotron.comm.counting()` around the work; its formulas
(`ep_comm_per_layer`, the exact count, and `ep_comm_bytes`) are in expert_parallel_costs.py. The cost per layer, how data parallelism composes with
it, capacity, and why routing makes "equal to one process" fragile: chapters/07_expert_parallel.ipynb.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.config import ModelConfig
from picotron.mesh import Mesh
from picotron.model import MoE, Routing, combine, load_balancing_loss, route, run_experts

__all__ = ["ExpertParallelGroups", "expert_parallel_groups", "check_expert_parallel", "TokenAllToAll",
           "all_to_all_tokens", "ExpertParallelMoE", "apply_expert_parallel", "average_gradients"]


# ---- which ranks talk to which -------------------------------------------------------------------
@dataclass
class ExpertParallelGroups:
    """The process groups expert parallelism needs, as seen from this rank.

    ep_group         the ranks that split the experts between them (rank i holds block i)
    expert_dp_group  the ranks holding the same experts as this one (None: no replica)
    data_group       every rank whose tokens form the global batch (dp, or dp x cp): the
                     non-expert gradients and the load statistics are averaged over it
    """

    ep_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup | None
    data_group: dist.ProcessGroup

    @property
    def ep(self) -> int:
        return dist.get_world_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)

    @property
    def data_size(self) -> int:
        return dist.get_world_size(self.data_group)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> "ExpertParallelGroups":
        """Plain EP over `group` (default: the world): its ranks are all the data, no expert replicas."""
        group = group if group is not None else dist.group.WORLD
        return cls(ep_group=group, expert_dp_group=None, data_group=group)


def expert_parallel_groups(mesh: Mesh, ep: int | None = None) -> ExpertParallelGroups:
    """Carve ep groups out of the mesh's dp axis: consecutive blocks of ep dp ranks (default ep = dp).

    dp rank d is rank d % ep of the ep group number d // ep; the ranks with the same d % ep (and any
    cp rank) hold the same experts: that is the expert-dp group. mesh.py is unchanged: the groups
    are made here, every rank creating every group in the same order, as torch requires.
    """
    dp = mesh.dp_size
    ep = dp if ep is None else ep
    if ep < 1 or dp % ep:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ValueError(f"ep={ep} does not divide dp={dp}: expert parallelism splits the dp ranks into groups "
                         f"of ep; choose ep among {divisors}")
    others = [range(mesh.sizes[axis]) for axis in ("pp", "tp")]
    ep_group = expert_dp_group = None
    for pp, tp in itertools.product(*others):
        for cp, block in itertools.product(range(mesh.cp_size), range(dp // ep)):   # ep groups
            ranks = [mesh.rank_of(pp=pp, tp=tp, cp=cp, dp=block * ep + i) for i in range(ep)]
            group = dist.new_group(ranks)
            if mesh.rank in ranks:
                ep_group = group
        for i in range(ep):                                                       # expert-dp groups
            ranks = sorted(mesh.rank_of(pp=pp, tp=tp, cp=cp, dp=block * ep + i)
                           for cp, block in itertools.product(range(mesh.cp_size), range(dp // ep)))
            group = dist.new_group(ranks)
            if mesh.rank in ranks:
                expert_dp_group = group
    replicas = (dp // ep) * mesh.cp_size
    return ExpertParallelGroups(ep_group=ep_group, expert_dp_group=expert_dp_group if replicas > 1 else None,
                                data_group=mesh.dp_cp_group)


def check_expert_parallel(config: ModelConfig, ep: int, dp: int | None = None) -> None:
    """Raise ValueError if ep does not divide the dp ranks it is carved from (when dp is given), the model
    has no experts, or they cannot be split evenly over ep ranks."""
    if dp is not None and dp % ep:
        raise ValueError(f"ep={ep} does not divide dp={dp}: expert parallelism splits the dp ranks into groups "
                         f"of ep; choose ep among {[d for d in range(1, dp + 1) if dp % d == 0]}")
    if config.num_experts == 0:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model: set ModelConfig.num_experts > 0 (preset "
                         f"'tiny-moe' has 8)")
    _check_experts_divide(config.num_experts, ep)


def _check_experts_divide(num_experts: int, ep: int) -> None:
    if num_experts % ep:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"ep={ep} does not divide num_experts={num_experts}: each ep rank holds the same "
                         f"number of whole experts; choose ep among {divisors} or change num_experts")


# ---- the all-to-all, differentiable -------------------------------------------------------------
def _exchange_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows input_splits[j] of `x` go to rank j; output_splits[j] rows come from rank j, in rank order."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all(out, x, output_splits, input_splits, group=group)
    return out


class TokenAllToAll(torch.autograd.Function):
    """Token rows to their experts' ranks: all-to-all forward; the reverse all-to-all (splits swapped) backward.

    Row i sent to rank j arrives there as some row i'; the gradient of i' is exactly what row i's
    gradient is, and it lies on rank j: sending it back the way it came is the whole backward.
    """

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _exchange_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange_rows(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_tokens(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of rows with uneven splits: (sum input_splits, ...) -> (sum output_splits, ...)."""
    return TokenAllToAll.apply(x, output_splits, input_splits, group)


def _by_local_expert(received_counts: torch.Tensor) -> torch.Tensor:
    """The order that regroups received rows from (source rank, local expert) to (local expert, source rank).

    received_counts: (ep, local experts), rows received from rank s for local expert j. The rows
    arrive rank by rank, each rank's grouped by expert; the experts want their rows together.
    """
    ep, local = received_counts.shape
    block = torch.arange(ep * local, device=received_counts.device).repeat_interleave(received_counts.flatten())
    source, expert = block // local, block % local                  # (received rows,) each
    return (expert * ep + source).argsort(stable=True)               # stable: keeps each block's row order


# ---- the expert-parallel MoE layer ---------------------------------------------------------------
class ExpertParallelMoE(nn.Module):
    """picotron.model.MoE with only this rank's E/ep experts; tokens reach the others by all-to-all.

    Built from the full MoE (identical on every rank). Parameter names stay the plain model's
    (experts.5.up_proj.weight is expert 5 wherever it lives), and expert weights carry
    `expert_parallel = True` for `average_gradients`. Records aux_loss, last_load (over the data
    group) and last_dropped (this rank's tokens) like MoE, and last_splits = (sent, received)
    rows per ep rank for the communication formulas.
    """

    def __init__(self, moe: MoE, groups: ExpertParallelGroups):
        super().__init__()
        self.groups = groups
        self.num_experts, self.top_k = moe.num_experts, moe.top_k
        self.capacity_factor, self.aux_loss_coef = moe.capacity_factor, moe.aux_loss_coef
        ep, ep_rank = groups.ep, groups.ep_rank
        _check_experts_divide(self.num_experts, ep)
        self.num_local = self.num_experts // ep
        self.first_expert = ep_rank * self.num_local
        self.router = moe.router
        local = range(self.first_expert, self.first_expert + self.num_local)
        self.experts = nn.ModuleDict({str(e): moe.experts[e] for e in local})   # the plain model's names
        for param in self.experts.parameters():
            param.expert_parallel = True
        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.last_dropped = 0
        self.last_splits: tuple[list[int], list[int]] = ([], [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])                              # (tokens, hidden): this rank's
        routing = route(self.router, tokens, self.top_k, self.capacity_factor)
        self.record(routing)
        slots = tokens[routing.token]                                    # (kept slots, hidden), by expert, so by owner
        outputs = self.exchange(slots, routing.counts)                   # (kept slots, hidden)
        return combine(outputs, routing, tokens.shape[0]).view(x.shape)

    def record(self, routing: Routing) -> None:
        """Balancing loss with the load of the whole batch, as one process computes it on that batch.

        f_i counts every data rank's slots (an all-reduce of E numbers); P_i stays this rank's
        mean: the mean over ranks of E sum_i f_i P_i(rank) is then the loss of the global batch,
        and averaging the gradients over the data ranks gives its gradient.
        """
        load = routing.load.clone()
        if self.groups.data_size > 1:
            comm.all_reduce(load, group=self.groups.data_group)   # (experts,)
        self.aux_loss = self.aux_loss_coef * load_balancing_loss(load, routing.mean_probs)
        self.last_load, self.last_dropped = load, routing.dropped

    def exchange(self, slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send the slots to their experts' ranks, run the local experts, bring the outputs back."""
        ep, group = self.groups.ep, self.groups.ep_group
        received_counts = torch.empty_like(counts)                      # (experts,) = (ep * local,)
        comm.all_to_all(received_counts, counts, group=group)
        received_counts = received_counts.view(ep, self.num_local)      # [s, j]: from rank s for my expert j
        # The splits must be Python ints: on a GPU, .tolist() waits for the counts (a host sync per layer).
        sent = counts.view(ep, self.num_local).sum(dim=1).tolist()      # rows to each rank
        received = received_counts.sum(dim=1).tolist()                  # rows from each rank
        self.last_splits = (sent, received)
        rows = all_to_all_tokens(slots, received, sent, group)          # (received rows, hidden), by source rank
        order = _by_local_expert(received_counts)
        per_expert = received_counts.sum(dim=0).tolist()                # rows for each local expert
        outputs = run_experts(self.experts.values(), rows[order], per_expert)   # (received rows, hidden), by expert
        outputs = outputs[order.argsort()]                              # back to (source rank, expert) order
        return all_to_all_tokens(outputs, sent, received, group)        # (kept slots, hidden), as sent


def _as_groups(where) -> ExpertParallelGroups:
    if isinstance(where, ExpertParallelGroups):
        return where
    if isinstance(where, Mesh):
        return expert_parallel_groups(where)
    return ExpertParallelGroups.from_group(where)


def apply_expert_parallel(model: nn.Module, where) -> nn.Module:
    """Split every MoE layer of a plain model over the ep ranks, in place; it computes what it did.

    `where`: ExpertParallelGroups (from `expert_parallel_groups`), a Mesh (ep = its whole dp axis),
    or a process group (plain EP over it, no data-parallel replicas). The model must be identical on
    every rank (same seed, or broadcast first); each rank keeps its E/ep experts and frees the rest.
    """
    groups = _as_groups(where)
    check_expert_parallel(model.config, groups.ep)
    for layer in model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, groups)
    return model


def average_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Make every gradient that of the mean loss over the global batch (after backward).

    Non-expert parameters: average over the data ranks (plain data parallelism). Expert
    parameters: the all-to-all's backward already summed their gradient over the ep group's
    tokens; sum it over the expert-dp replicas and divide by the number of data ranks. One flat
    all-reduce each.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    _sum_flat([p.grad for p in dense], groups.data_group)
    _sum_flat([p.grad for p in experts], groups.expert_dp_group)
    for p in params:
        p.grad.div_(groups.data_size)                                   # sum over the global batch -> mean


def _sum_flat(grads: list[torch.Tensor], group) -> None:
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])                   # (total numel,)
    comm.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()

"""ZeRO stages 0-2: data parallelism with the optimizer state (stage 1) and gradients (stage 2) sharded.

The Zero Redundancy Optimizer (Rajbhandari et al. 2020, arXiv:1910.02054; Playbook, "ZeRO (Zero
Redundancy Optimizer)") cuts the training state into N shards over the N dp ranks and lets rank r
keep and update only shard r; the arithmetic is unchanged, so every stage trains exactly like one
process. This file holds:

    zero_state_bytes, zero_comm_bytes, ring_bytes   the exact bytes per rank and the bytes sent per step
    FlatGroup                                       parameters as views of one flat buffer, padded to N shards
    ZeroOptimizer                                   stages 0 (plain DP in the same layout), 1 and 2

Stage 3 (the parameters sharded too) is `Zero3` in zero3.py, built on the same FlatGroup. Stages 1-3
also run as HSDP (sharded within a group of s ranks, replicated across r such groups): pass
`replicate_group`, from picotron.parallel.hsdp.hsdp_groups.

    zero = ZeroOptimizer(model, mesh.dp_group, stage=1,              # or stage=0 or 2
                         optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), bucket_mb=25)
    for step in range(steps):
        zero.zero_grad()
        for x, y in micro_batches:
            loss_fn(model(x), y).backward()      # stage 2: buckets reduce-scatter as they fill
        zero.clip_grad_norm_(1.0)                # optional: the whole gradient's norm, from the shards
        zero.step()                              # step this rank's shard, then all-gather (stages 1, 2)

To measure what it sends, open `picotron.comm.counting()` around the work. The stages' memory and
communication tables, the padding and the formulas' derivations: chapters/03_zero.ipynb.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.parallel.data_parallel import assign_buckets, broadcast_parameters
from picotron.parallel.grad_norm import clip_factor
from picotron.parallel.hsdp import check_replicate_group

__all__ = ["ZERO_STAGES", "check_zero_stage", "StateBytes", "zero_state_bytes", "zero_comm_bytes", "ring_bytes",
           "FlatGroup", "ZeroOptimizer"]

# Bytes per parameter of (parameters, gradients, optimizer state): fp32 master weights, m and v in bf16-mixed.
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16-mixed": (2, 2, 12)}
STEP_COUNTER_BYTES = 4   # AdamW keeps `step` as one fp32 scalar per tensor it updates

MakeOptimizer = Callable[[list], torch.optim.Optimizer]


ZERO_STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = (torch.bfloat16, torch.float16)   # ZeRO-3's gathered copies (FSDP2's MixedPrecisionPolicy.param_dtype)


def check_zero_stage(stage, name: str = "zero_stage") -> None:
    """Raise ValueError for a ZeRO stage that does not exist (`name`: the argument, for the message)."""
    if stage not in ZERO_STAGES or isinstance(stage, bool):
        raise ValueError(f"{name}={stage!r}; choose 0 (plain data parallelism), 1 (shard the optimizer "
                         f"state), 2 (and the gradients) or 3 (and the parameters)")


# ---- The formulas -------------------------------------------------------------------------------

@dataclass
class StateBytes:
    """Bytes of one rank's training state (activations aside)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer state": self.optimizer,
                "total": self.total}


def _shard_numel(numels: int | Sequence[int], world: int, stage: int) -> tuple[list[int], int]:
    """(group sizes, S): S = sum over groups of ceil(n_g / N), with no split at stage 0."""
    check_zero_stage(stage, "stage")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world={world!r} must be a positive number of dp ranks")
    numels = [numels] if isinstance(numels, int) else list(numels)
    shards = 1 if stage == 0 else world
    return numels, sum(-(-n // shards) for n in numels)


def zero_state_bytes(numels: int | Sequence[int], world: int, stage: int, precision: str = "fp32") -> StateBytes:
    """Bytes per rank of parameters, gradients and optimizer state, to the byte, for picotron's ZeRO.

    numels: parameters per flat group (`zero.numels`), or the model's total for one group.
    world: the ranks of one shard group (HSDP: s; each of the r replicas holds the same bytes).
    Zero3 with a compute dtype keeps this fp32 state ("fp32"); its gathered units, in the compute
    dtype, come on top while they live (Zero3.peak_gathered_bytes). The padding to a multiple of N
    per group and AdamW's step counters (4 bytes per group) are included, so this equals
    `ZeroOptimizer.state_bytes()` exactly (chapters/03_zero.ipynb derives it).
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r}; choose one of {sorted(BYTES_PER_PARAM)}")
    p, g, o = BYTES_PER_PARAM[precision]
    numels, shard = _shard_numel(numels, world, stage)
    whole = shard * (1 if stage == 0 else world)                        # Psi', padded
    return StateBytes(parameters=p * (shard if stage == 3 else whole),
                      gradients=g * (shard if stage >= 2 else whole),
                      optimizer=o * shard + STEP_COUNTER_BYTES * len(numels))


def zero_comm_bytes(numels: int | Sequence[int], world: int, stage: int, precision: str = "fp32",
                    micro_batches: int = 1, *, replicate: int = 1, compute_dtype: torch.dtype | None = None
                    ) -> dict[str, int]:
    """Payload bytes per optimizer step that this rank's CommCounter records, by operation.

    picotron.comm counts what a rank hands to a collective: the whole input of an all-reduce or
    reduce-scatter, the input *shard* of an all-gather. Gradient clipping adds a 4-byte
    all-reduce of the squared norm (stages 1-3), not included here.

    world: the ranks one shard group splits the state over (all the dp ranks, unless HSDP).
    replicate: HSDP's r, the shard groups that hold the same shards; r > 1 adds an all-reduce of
        every reduced gradient shard (S elements) over the r ranks that hold it.
    compute_dtype: ZeRO-3 gathering the parameters in this dtype (Zero3's compute_dtype, precision
        "fp32"): the all-gathers move 2 bytes a parameter in bf16, the reductions stay fp32.
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision={precision!r}; choose one of {sorted(BYTES_PER_PARAM)}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    if not isinstance(replicate, int) or replicate < 1:
        raise ValueError(f"replicate={replicate!r} must be a positive number of shard groups")
    if replicate > 1 and stage == 0:
        raise ValueError("replicate > 1 with stage=0: stage 0 shards nothing to replicate; count all the ranks "
                         "as world")
    p, g, _ = BYTES_PER_PARAM[precision]
    if compute_dtype is not None:
        check_compute_dtype(compute_dtype, stage, precision)
        p = compute_dtype.itemsize
    numels, shard = _shard_numel(numels, world, stage)
    k = micro_batches
    if stage == 0:
        return {"all_reduce": g * shard}                                # the whole (unpadded) gradient
    reductions = 1 if stage == 1 else k                                 # stages 2, 3: every micro-batch
    gathers = 1 if stage < 3 else 2 * k                                 # stage 3: before forward and backward
    payload = {"reduce_scatter": reductions * g * world * shard, "all_gather": gathers * p * shard}
    if replicate > 1:
        payload["all_reduce"] = reductions * g * shard                  # HSDP: each reduced shard, over r ranks
    return payload


def check_compute_dtype(compute_dtype, stage: int, precision: str = "fp32") -> None:
    """Raise ValueError unless `compute_dtype` can be ZeRO-3's compute dtype over fp32 master parameters."""
    if compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r}; choose torch.bfloat16 or torch.float16 (or None: "
                         f"compute in the parameters' own dtype)")
    if stage != 3:
        raise ValueError(f"compute_dtype with stage={stage}: only ZeRO-3 gathers the parameters; at stages 0-2 "
                         f"convert the model (model.to(torch.bfloat16)): its fp32 masters are kept for you")
    if precision != "fp32":
        raise ValueError(f"compute_dtype with precision={precision!r}: the parameters must be fp32, the masters "
                         f"that the gathered {compute_dtype} copies are cast from")


def ring_bytes(payload: dict[str, int], world: int, replicate: int = 1) -> float:
    """Bytes a rank sends on the wire for these payloads when each collective runs as a ring.

    all-reduce: 2 (N-1)/N of its tensor; reduce-scatter: (N-1)/N of its input (N-1 steps, one
    1/N chunk each); all-gather: its input shard N-1 times (Playbook, "A quick focus on
    collective operations"). For ZeRO in fp32 this gives (N-1)/N x 4 bytes x 2Psi', 2Psi', 3Psi'.
    HSDP (replicate = r > 1): the all-reduce runs over the r replicas, 2 (r-1)/r of it; the
    reduce-scatters and all-gathers over the shard group's world = s ranks.
    """
    ar = replicate if replicate > 1 else world
    factor = {"all_reduce": 2 * (ar - 1) / ar, "reduce_scatter": (world - 1) / world,
              "all_gather": world - 1}
    unknown = set(payload) - set(factor)
    if unknown:
        raise ValueError(f"no ring cost for {sorted(unknown)}; known: {sorted(factor)}")
    return sum(factor[op] * nbytes for op, nbytes in payload.items())


# ---- The flat buffer every stage is built on ----------------------------------------------------

class FlatGroup:
    """Some parameters as views of one flat buffer, padded with zeros to split into N equal shards.

        full    (N*S,)  the parameters one after another, then zeros, in the model's dtype (or
                        the compute dtype: below)
        shard   (S,)    slice `index` of full, the part this rank updates: a view of full at
                        stages 0-2, its own tensor at stage 3 (where full is freed between uses)
        master  (S,)    what the optimizer steps: the shard itself in fp32, else an fp32 copy
        grad            the gradient this rank keeps: all of it at stages 0-1 (each param.grad is
                        a view of it, so autograd accumulates in place), only an (S,) shard at 2-3

    Stage 0 builds it with num_shards=1: the "shard" is everything. Stage 3 with a compute dtype
    (fp32 parameters, compute_dtype bf16): shard, master and grad are fp32, full and the views the
    model computes with are bf16, filled by gathering bf16 casts of the shards.
    """

    def __init__(self, params: list[nn.Parameter], names: list[str], num_shards: int, index: int, stage: int,
                 compute_dtype: torch.dtype | None = None):
        dtypes = {(p.dtype, p.device) for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"parameters {names} mix dtypes/devices {sorted(map(str, dtypes))}; "
                             f"one flat buffer holds one dtype: convert the model first (model.to(dtype))")
        self.params, self.names = params, names
        self.numel = sum(p.numel() for p in params)
        self.shard_numel = -(-self.numel // num_shards)                         # S = ceil(numel / N)
        self.full = torch.zeros(num_shards * self.shard_numel, dtype=params[0].dtype, device=params[0].device)
        self.offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        self.views = [self.full[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]
        with torch.no_grad():
            for p, view in zip(params, self.views):
                view.copy_(p)
                p.data = view                          # the model now computes in the buffer's memory
        shard = self.full[index * self.shard_numel:(index + 1) * self.shard_numel]
        self.shard = shard.clone() if stage == 3 else shard
        if compute_dtype is not None and compute_dtype != self.full.dtype:   # stage 3 only (Zero3 checks)
            self.full = self.full.to(compute_dtype)
            self.views = [self.full[o:o + p.numel()].view_as(p) for o, p in zip(self.offsets, params)]
            for p, view in zip(params, self.views):
                p.data = view                          # the model computes in the compute dtype
        # Mixed precision: the optimizer updates fp32 numbers; bf16 would lose small updates (a bf16
        # weight of 1.0 cannot move by less than 2^-8). Micikevicius et al. 2018, arXiv:1710.03740.
        self.master = self.shard if self.shard.dtype == torch.float32 else self.shard.float()
        if stage < 2:
            self.grad = torch.zeros_like(self.full)
            self.grad_views = [self.grad[o:o + v.numel()].view_as(v) for o, v in zip(self.offsets, self.views)]
            for p, view in zip(params, self.grad_views):
                p.grad = view
        else:
            self.grad = self.shard.new_zeros(self.shard_numel)   # in the shard's dtype: fp32 under a compute dtype
        self.ready: set[nn.Parameter] = set()   # params whose gradient arrived in this backward (stages 2-3)
        self.reductions = 0                     # reduce-scatters since the last step (stages 2-3)
        # Stage 3 only: does `full` hold the parameters now; the all-gather filling it, while one runs;
        # is the unit between its backward's start and end; what parameters point at while it is freed;
        # the shard cast to the compute dtype while an all-gather reads it.
        self.gathered, self.work, self.in_backward = True, None, False
        self.empty = self.full.new_empty(0)
        self.gather_input: torch.Tensor | None = None

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cut a (N*S,) tensor laid out like `full` into one tensor per parameter, by name."""
        return {name: flat[o:o + v.numel()].view_as(v).clone()
                for name, o, v in zip(self.names, self.offsets, self.views)}


def _group_position(group) -> tuple[dist.ProcessGroup, int, int]:
    if not dist.is_initialized():
        raise RuntimeError("ZeRO needs a process group: build it inside the function you pass to "
                           "picotron.launch.run (or under torchrun)")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the process group passed in; "
                         f"pass this rank's own data-parallel group (mesh.dp_group)")
    return group, dist.get_world_size(group), rank


def _storage_bytes(tensors, skip: set | None = None) -> dict:
    """{storage: bytes} of the distinct, non-empty storages behind `tensors` (views count once)."""
    found = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            key = (t.device, t.untyped_storage().data_ptr())
            if not skip or key not in skip:
                found[key] = t.untyped_storage().nbytes()
    return found


# ---- ZeRO-1 and ZeRO-2 (and stage 0, plain DP in the same layout) -------------------------------

class ZeroOptimizer:
    """Data parallelism with this rank's share of the optimizer state (stage 1) and gradients (stage 2).

    model: its parameters become views of flat buffers (one per bucket); every rank keeps all of
        them, and the initial broadcast makes them equal to the first rank's.
    group: the data-parallel process group (None: the whole world).
    stage: 0 plain data parallelism (all-reduce, every rank steps everything, for comparison);
        1 reduce-scatter the gradients after backward, each rank steps its shard, all-gather;
        2 as 1, but each bucket is reduce-scattered as soon as backward has filled it and only the
        shard is kept, so whole gradients never outlive their bucket.
    optimizer: builds the inner optimizer from a list of tensors (the fp32 master shards);
        AdamW with torch's defaults when None. It sees one flat tensor per bucket, which is
        exact for element-wise optimizers (SGD, Adam, AdamW); one that reads a tensor's shape
        or whole norm (Adafactor, LAMB, Muon) would need the parameters' boundaries.
    bucket_mb: MiB of parameters per flat group (0: one per parameter). Stage 2 overlaps each
        bucket's reduce-scatter with the rest of backward.
    replicate_group: HSDP (stages 1-3). `group` is then the shard group of s ranks and this group
        joins the r ranks that hold the same shard in the other shard groups
        (picotron.parallel.hsdp.hsdp_groups builds both). Each reduced gradient shard is
        all-reduced over it, so the average is over all s * r ranks; the all-gathers stay
        inside the shard group.

    Gradient accumulation: call backward once per micro-batch. Stages 0-1 add into their whole
    gradient buffer and communicate once in step(); stage 2 reduce-scatters every micro-batch and
    adds into its shard.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, *, stage: int = 1,
                 optimizer: MakeOptimizer | None = None, bucket_mb: float = 25.0,
                 replicate_group: dist.ProcessGroup | None = None):
        check_zero_stage(stage, "stage")
        if stage == 3:
            raise ValueError("stage=3 also shards the parameters, which needs hooks around every unit's "
                             "forward and backward: use Zero3(model, group, ...)")
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb={bucket_mb} must be >= 0 (0: one bucket per parameter)")
        params = self._setup(model, group, stage, replicate_group)
        bucket_numel = int(bucket_mb * 2**20) // params[0].element_size()
        # Reverse order, as DataParallel: roughly the order backward finishes the gradients.
        self._build(assign_buckets(params[::-1], bucket_numel), optimizer)
        if stage == 2:
            for param in params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ---- set-up shared with Zero3 ------------------------------------------------------------
    def _setup(self, model: nn.Module, group, stage: int, replicate_group=None) -> list[nn.Parameter]:
        self.group, self.world, self.rank = _group_position(group)
        self.model, self.stage = model, stage
        params = list(model.parameters())             # a tied weight appears once
        if not params:
            raise ValueError(f"{type(model).__name__} has no parameters: nothing to shard")
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(f"parameters {frozen[:4]} do not require grad; this ZeRO shards trainable "
                             f"parameters only: make them trainable or keep them outside the model")
        self.name_of = {p: name for name, p in model.named_parameters()}
        # HSDP: r copies of the s-way sharded state. The gradients are averaged over all s * r ranks.
        self.replicate_group, self.replicas = replicate_group, 1
        if replicate_group is not None:
            if stage == 0:
                raise ValueError("replicate_group with stage=0: stage 0 shards nothing, so there is nothing to "
                                 "replicate; pass all the data-parallel ranks as `group`")
            self.replicas = check_replicate_group(self.group, replicate_group, params[0].device)
            broadcast_parameters(model, replicate_group)   # then the shard groups copy their first rank's
        broadcast_parameters(model, self.group)   # replicas must start identical
        self._pending = None            # (work, group, shard, flat input) of the reduce-scatter in flight
        self._grads_ready = False       # finish_gradient_sync ran since the last step
        return params

    def _build(self, param_lists: list[list[nn.Parameter]], optimizer: MakeOptimizer | None,
               compute_dtype: torch.dtype | None = None) -> None:
        shards, index = (1, 0) if self.stage == 0 else (self.world, self.rank)
        self.groups = [FlatGroup(ps, [self.name_of[p] for p in ps], shards, index, self.stage, compute_dtype)
                       for ps in param_lists]
        self.group_of = {p: g for g in self.groups for p in g.params}
        make = optimizer if optimizer is not None else torch.optim.AdamW
        self.optimizer = make([g.master for g in self.groups])

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's param_groups (set "lr" here for a schedule)."""
        return self.optimizer.param_groups

    @property
    def numels(self) -> list[int]:
        """Parameters per flat group, unpadded: the argument of zero_state_bytes / zero_comm_bytes."""
        return [g.numel for g in self.groups]

    # ---- gradients -----------------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # Fires once per backward, after autograd has added this parameter's whole gradient into .grad.
        group = self.group_of[param]
        group.ready.add(param)
        if len(group.ready) == len(group.params):
            self._reduce_scatter(group)

    def _reduce_scatter(self, group: FlatGroup) -> None:
        """Send the group's fresh gradients off to be averaged; keep only this rank's slice (stages 2, 3).

        The whole gradients are copied into one padded flat tensor and released at once: from
        here on this rank holds just its shard of them.
        """
        flat = group.grad.new_zeros(self.world * group.shard_numel)          # (N*S,), padded with zeros
        for p, offset in zip(group.params, group.offsets):
            # In the gradient shard's dtype: with a compute dtype (Zero3) the bf16 gradients are cast up to
            # fp32 before they are summed, so the sum over the ranks is not rounded to bf16.
            flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        for p in group.params:
            p.grad = None
        flat.div_(self.world * self.replicas)   # divide before summing, as DDP does: a bf16 sum cannot overflow
        self._wait_pending()            # one reduce-scatter in flight at a time
        shard = flat.new_empty(group.shard_numel)
        work = comm.reduce_scatter(shard, flat, self.group, async_op=True)
        self._pending = (work, group, shard, flat)   # flat must live until the collective is done
        group.ready.clear()
        group.reductions += 1

    def _wait_pending(self) -> None:
        if self._pending is not None:
            work, group, shard, _ = self._pending
            work.wait()
            if self.replicate_group is not None:    # HSDP: add the other shard groups' sums of this shard
                comm.all_reduce(shard, self.replicate_group)
            group.grad.add_(shard)      # accumulate: one addition per micro-batch
            self._pending = None

    @torch.no_grad()
    def finish_gradient_sync(self) -> None:
        """Average the gradients over the group and hand this rank's shard to the optimizer.

        Stage 1 reduce-scatters the whole gradient here. An all-reduce followed by taking one's
        slice would give the same numbers, but an all-reduce is a reduce-scatter plus an
        all-gather: the second half would deliver gradients no rank's optimizer reads, twice the
        traffic for nothing. step() calls this when it has not run since the last step.
        """
        if self.stage in (0, 1):
            self._reattach_grad_views()
            for g in self.groups:
                g.grad.div_(self.world * self.replicas)
            if self.stage == 0:
                comm.wait_all([comm.all_reduce(g.grad, self.group, async_op=True) for g in self.groups])
                averaged = [g.grad for g in self.groups]
            else:
                averaged = [g.grad.new_empty(g.shard_numel) for g in self.groups]
                comm.wait_all([comm.reduce_scatter(shard, g.grad, self.group, async_op=True)
                               for shard, g in zip(averaged, self.groups)])
                if self.replicate_group is not None:     # HSDP: and over the replicas holding the same shard
                    comm.wait_all([comm.all_reduce(shard, self.replicate_group, async_op=True) for shard in averaged])
        else:
            self._wait_pending()
            for i, g in enumerate(self.groups):
                if g.ready or not g.reductions:
                    raise RuntimeError(self._not_ready_message(i, g))
                g.reductions = 0
            averaged = [g.grad for g in self.groups]
        for g, grad in zip(self.groups, averaged):
            g.master.grad = grad.to(g.master.dtype)      # the same tensor in fp32, an fp32 copy in bf16
        self._grads_ready = True

    def _reattach_grad_views(self) -> None:
        # model.zero_grad() (set_to_none) makes autograd hand over fresh tensors: copy them back in.
        for g in self.groups:
            for p, view in zip(g.params, g.grad_views):
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def _not_ready_message(self, i: int, group: FlatGroup) -> str:
        kind = "unit" if self.stage == 3 else "bucket"
        if not group.ready:
            return (f"{kind} {i} of {len(self.groups)} got no gradient since the last step: run a backward "
                    f"before finish_gradient_sync() / step()")
        missing = [self.name_of[p] for p in group.params if p not in group.ready]
        return (f"{kind} {i} of {len(self.groups)} has {len(group.ready)} of {len(group.params)} gradients "
                f"(missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); every parameter "
                f"must take part in the loss")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, counted: Callable[[nn.Parameter], bool] | None = None,
                        group=None) -> torch.Tensor:
        """Scale the gradient so that its global 2-norm is at most max_norm; return the norm before.

        picotron.parallel.grad_norm's rule, for a gradient kept in flat shards: each rank holds 1/N
        of it (stages 1-3), so the squared norms of the shards add up over the group, one 4-byte
        all-reduce (HSDP: over the shard group; its replicas hold the same squares). A model split
        another way too passes `counted` (grad_norm.counted_here) and
        the group over which the squares add up (the whole world).
        """
        squares = self.gradient_squares(counted)
        if group is not None or self.stage > 0:      # stage 0: every rank holds the whole gradient
            comm.all_reduce(squares, group if group is not None else self.group)
        norm = squares.sqrt()
        self.scale_gradients(clip_factor(norm, max_norm))
        return norm

    @torch.no_grad()
    def gradient_squares(self, counted: Callable[[nn.Parameter], bool] | None = None) -> torch.Tensor:
        """This rank's part of ||g||^2: the sum of squares of the averaged gradient it holds (its shard at
        stages 1-3), over the parameters `counted` accepts (default: all).

        A model split another way too (tensor or pipeline parallelism) has weights that several of
        these groups hold alike (a norm weight on every tp rank): the trainer counts those on one
        rank only, which needs the parameters' boundaries inside the flat shard.
        """
        if not self._grads_ready:
            self.finish_gradient_sync()
        total = torch.zeros((), dtype=torch.float32, device=self.groups[0].master.device)
        for g in self.groups:
            grad = g.master.grad                                       # (S,): elements start..start+S of full
            if counted is None:
                total += grad.float().square().sum()
                continue
            start = 0 if self.stage == 0 else self.rank * g.shard_numel
            for param, offset, view in zip(g.params, g.offsets, g.views):   # (ZeRO-3: param may be freed)
                lo, hi = max(offset, start), min(offset + view.numel(), start + g.shard_numel)
                if lo < hi and counted(param):                         # the part of param in this shard
                    total += grad[lo - start:hi - start].float().square().sum()
        return total

    @torch.no_grad()
    def scale_gradients(self, scale: torch.Tensor) -> None:
        """Multiply the gradient the optimizer will read by `scale` (clipping)."""
        for g in self.groups:
            g.master.grad.mul_(scale)

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's shard with the inner optimizer, then make the new parameters whole again."""
        if not self._grads_ready:
            self.finish_gradient_sync()
        self.optimizer.step()
        works = []
        for g in self.groups:
            g.master.grad = None
            if g.master is not g.shard:
                g.shard.copy_(g.master)                  # round the fp32 master into the model's dtype
            works.append(self._publish(g))
        comm.wait_all(works)
        self._grads_ready = False

    def _publish(self, group: FlatGroup):
        """Stages 1-2: every rank needs every updated parameter for its next forward."""
        if self.stage in (1, 2):
            # In place: the shard is slice `rank` of full, exactly where the all-gather puts it.
            return comm.all_gather(group.full, group.shard, self.group, async_op=True)
        return None

    def zero_grad(self) -> None:
        """Zero the gradient this rank keeps (in place: param.grad stay views at stages 0-1)."""
        self._wait_pending()            # a reduce-scatter still in flight would add into it afterwards
        for g in self.groups:
            g.grad.zero_()
        if self.stage < 2:
            self._reattach_grad_views()
        self._grads_ready = False

    # ---- looking inside: the chapter's measurements and the tests' checks ----------------------
    def state_bytes(self) -> StateBytes:
        """Bytes of parameters, gradients and optimizer state this rank holds now, from the real tensors.

        Each storage counts once: in fp32 the master shard is a slice of the parameters' buffer
        (stages 0-2) or the parameter shard itself (stage 3), so it is not counted again.
        """
        params = _storage_bytes([*(p for g in self.groups for p in g.params), *(g.shard for g in self.groups)])
        grads = _storage_bytes([*(p.grad for g in self.groups for p in g.params), *(g.grad for g in self.groups)])
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        optimizer = _storage_bytes([*(g.master for g in self.groups), *state], skip=set(params))
        return StateBytes(sum(params.values()), sum(grads.values()), sum(optimizer.values()))

    def _whole(self, group: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
        """All ranks' shards side by side, (N*S,): one all-gather (stage 0 has no shards)."""
        if self.stage == 0:
            return shard
        whole = shard.new_empty(self.world * group.shard_numel)
        comm.all_gather(whole, shard, self.group)
        return whole

    @torch.no_grad()
    def gather_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, as a new tensor by name (at stage 3 it all-gathers: call it on every rank)."""
        out = {}
        for g in self.groups:
            out.update(g.unflatten(g.full if self.stage in (0, 1, 2) else self._whole(g, g.shard)))
        return out

    @torch.no_grad()
    def gather_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradient of every parameter by name, as the optimizer will see it (in its dtype).

        Call it between finish_gradient_sync() and step(), on every rank.
        """
        if not self._grads_ready:
            raise RuntimeError("no averaged gradient yet: call finish_gradient_sync() after backward first")
        out = {}
        for g in self.groups:
            out.update(g.unflatten(self._whole(g, g.master.grad)))
        return out

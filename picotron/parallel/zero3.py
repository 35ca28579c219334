"""ZeRO-3: each rank keeps 1/N of the parameters too, and gathers a layer only while it computes.

Stage 3 of the Zero Redundancy Optimizer (Rajbhandari et al. 2020, arXiv:1910.02054), what torch
calls FSDP. It builds on picotron/parallel/zero.py (the flat, padded buffers of stages 1 and 2,
their formulas for bytes per rank and bytes sent, and the sharded optimizer step): the model is
cut into units (a decoder layer; the embedding; the final norm and head), each a FlatGroup whose
full buffer exists only around the unit's forward and again around its backward.

    before forward    all-gather the unit's parameters (and start the next unit's: prefetch)
    after forward     free them
    before backward   all-gather them again
    after backward    reduce-scatter the unit's gradient into this rank's shard, free them

Memory per rank (2Psi + 2Psi + 12Psi)/N in bf16-mixed, plus the units gathered at a time;
communication per step one all-gather more than ZeRO-1/2 (three copies of the parameters instead
of two: 6Psi bytes in bf16 instead of 4Psi). Playbook,
"ZeRO (Zero Redundancy Optimizer)". Chapter: chapters/03_zero.ipynb.

Two options shape what travels, as FSDP2's do:

    compute_dtype=torch.bfloat16   fp32 parameters stay the masters, sharded; the all-gathers move
                                   bf16 casts of the shards (half the bytes) and forward and backward
                                   compute in bf16; the gradients are cast up and reduce-scattered in
                                   fp32 (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))
    replicate_group=...            HSDP: shard within `group`, replicate across this group
                                   (picotron/parallel/hsdp.py)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from picotron import comm
from picotron.parallel.zero import FlatGroup, MakeOptimizer, ZeroOptimizer, check_compute_dtype

__all__ = ["Zero3", "llama_units"]


def llama_units(model: nn.Module) -> list[list[nn.Module]]:
    """picotron's Llama cut into ZeRO-3 units, in the order forward first uses them.

    Each decoder layer is a unit; so are the embedding and the final norm with the head. A tied
    head *is* the embedding, read at both ends of the model, so then all three make one unit
    that stays gathered from the embedding's forward to the head's (the same choice FSDP2 makes
    for the root module's parameters).
    """
    for attr in ("embed", "layers", "norm", "lm_head"):
        if not hasattr(model, attr):
            raise ValueError(f"{type(model).__name__} is not picotron's Llama (no .{attr}); pass units=[[module, "
                             f"...], ...] listing the modules whose parameters are gathered together")
    layers = [[layer] for layer in model.layers]
    if model.lm_head.weight is model.embed.weight:
        return [[model.embed, model.norm, model.lm_head], *layers]
    return [[model.embed], *layers, [model.norm, model.lm_head]]


def _unit_params(model: nn.Module, units: list[list[nn.Module]]) -> list[list[nn.Parameter]]:
    """The parameters of each unit; every parameter of the model in exactly one."""
    names = {p: name for name, p in model.named_parameters()}
    owner: dict[nn.Parameter, int] = {}
    lists = []
    for i, modules in enumerate(units):
        if not modules:
            raise ValueError(f"unit {i} has no modules")
        params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
        for p in params:
            if p not in names:
                raise ValueError(f"unit {i} holds a parameter that is not the model's: pass modules of this model")
            if p in owner:
                raise ValueError(f"{names[p]} is in units {owner[p]} and {i}; a parameter must belong to one unit "
                                 f"(put modules that share weights in the same unit)")
            owner[p] = i
        if not params:
            raise ValueError(f"unit {i} ({[type(m).__name__ for m in modules]}) has no parameters")
        lists.append(params)
    missing = [name for p, name in names.items() if p not in owner]
    if missing:
        raise ValueError(f"parameters {missing[:4]} are in no unit; add their modules to a unit")
    return lists


class Zero3(ZeroOptimizer):
    """ZeRO-3: each rank keeps 1/N of every parameter too, and gathers a unit only while it computes.

    model: cut into units (llama_units for picotron's Llama, or `units`: lists of modules, in
        the order forward first uses them). Each unit's parameters are a FlatGroup; its full
        buffer exists only around the unit's forward and its backward:

            before forward    all-gather the unit (forward pre-hook on its first module)
            after forward     free it (forward hook on its last module), and hook the output's gradient
            before backward   all-gather it again (that hook fires just before the unit's backward)
            after backward    reduce-scatter its gradients into this rank's shard and free it
                              (post-accumulate-grad hooks: the last of its parameters is done)

        Freeing resizes the buffer's storage to 0 bytes, as FSDP does, so the tensors autograd
        saved (views of the weights, like weight.t()) give their memory back too, and point at it
        again once it is re-gathered. A parameter outside its unit's use points at an empty tensor.
    prefetch: start the all-gather of the next unit (asynchronously) when the current one
        starts computing, in forward and in backward, so communication hides behind compute;
        False gathers each unit only when it is needed (the chapter times both).
    optimizer: as for ZeroOptimizer. Full recomputation works too: a unit recomputed
        inside backward is already gathered.
    compute_dtype: torch.bfloat16 or torch.float16 for a model in fp32: the fp32 shards are the
        masters the optimizer steps; each gather casts this rank's shard to the compute dtype and
        all-gathers that (half the bytes of fp32), so the model's parameters are bf16 while gathered
        and forward and backward compute in bf16; each bf16 gradient is cast up to fp32 before the
        reduce-scatter, which sums and keeps fp32 gradient shards. None: compute in the model's dtype.
    replicate_group: HSDP, as for ZeroOptimizer: `group` is the shard group, and each reduced
        gradient shard is all-reduced over the replicas.
    """

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None = None, *,
                 units: list[list[nn.Module]] | None = None, prefetch: bool = True,
                 optimizer: MakeOptimizer | None = None, compute_dtype: torch.dtype | None = None,
                 replicate_group: dist.ProcessGroup | None = None):
        if compute_dtype is not None:
            check_compute_dtype(compute_dtype, 3)
            dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
            if dtypes != ["float32"]:
                raise ValueError(f"compute_dtype={compute_dtype} needs the model in fp32 (its parameters become the "
                                 f"fp32 masters), but they are {', '.join(dtypes)}: build it in fp32")
        self._setup(model, group, 3, replicate_group)
        self.units = units if units is not None else llama_units(model)
        self.compute_dtype = compute_dtype
        self._build(_unit_params(model, self.units), optimizer, compute_dtype)
        self.prefetch = prefetch
        self._forward_ends: list[int] = []      # units in the order their forward ended: backward reverses it
        self.gathered_bytes = sum(g.full.untyped_storage().nbytes() for g in self.groups)   # built whole
        for g in self.groups:
            self._free(g)                       # from now on this rank keeps 1/N of the model
        self.peak_gathered_bytes = 0            # most bytes of gathered units held at once, since here
        for i, (modules, g) in enumerate(zip(self.units, self.groups)):
            modules[0].register_forward_pre_hook(lambda module, args, i=i: self._before_forward(i))
            modules[-1].register_forward_hook(lambda module, args, output, i=i: self._after_forward(i, output))
            for p in g.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ---- gather and free -------------------------------------------------------------------------
    def _start_gather(self, g: FlatGroup) -> None:
        """Give the unit's buffer its memory back and start filling it from every rank's shard."""
        if g.gathered or g.work is not None:
            return
        nbytes = g.full.numel() * g.full.element_size()
        g.full.untyped_storage().resize_(nbytes)
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        # With a compute dtype the shard is cast first: what travels is bf16, half the bytes (kept until done).
        g.gather_input = g.shard if g.shard.dtype == g.full.dtype else g.shard.to(g.full.dtype)
        g.work = comm.all_gather(g.full, g.gather_input, self.group, async_op=True)

    def _gather(self, g: FlatGroup) -> None:
        """Make the unit's parameters whole: wait for a prefetch, or gather now."""
        self._start_gather(g)
        if g.work is not None:
            g.work.wait()
            g.work = g.gather_input = None
            for p, view in zip(g.params, g.views):
                p.data = view
            g.gathered = True

    def _free(self, g: FlatGroup) -> None:
        for p in g.params:
            p.data = g.empty            # never a dangling pointer: reading it outside gives an empty tensor
        self.gathered_bytes -= g.full.untyped_storage().nbytes()
        g.full.untyped_storage().resize_(0)
        g.gathered = False

    def _prefetch_after(self, order: list[int], i: int) -> None:
        if self.prefetch and i in order and order.index(i) + 1 < len(order):
            self._start_gather(self.groups[order[order.index(i) + 1]])

    # ---- the hooks -------------------------------------------------------------------------------
    def _before_forward(self, i: int) -> None:
        g = self.groups[i]
        if g.in_backward:               # recomputed inside backward: already gathered for it
            return
        if i == 0:
            self._forward_ends = []
        self._gather(g)
        self._prefetch_after(list(range(len(self.groups))), i)

    def _after_forward(self, i: int, output) -> None:
        g = self.groups[i]
        if g.in_backward:
            return
        self._forward_ends.append(i)
        self._free(g)
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, i=i: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        g = self.groups[i]
        if g.in_backward:               # a second output tensor of the same unit
            return
        g.in_backward = True
        self._gather(g)
        self._prefetch_after(self._forward_ends[::-1], i)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        super()._on_grad_ready(param)
        g = self.group_of[param]
        if not g.ready:                 # the unit's whole gradient has been sent: its parameters can go
            self._free(g)
            g.in_backward = False

    def _publish(self, group: FlatGroup):
        return None                     # the next forward gathers what it needs

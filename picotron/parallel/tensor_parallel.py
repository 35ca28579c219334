"""Tensor parallelism, with sequence parallelism: every layer's weight matrices split over the tp ranks.

Chapter 04 (chapters/04_tensor_parallel.ipynb) builds and measures it. A column-parallel Linear keeps
rows of W (a slab of the output features), a row-parallel one columns of W (a partial sum of the
output); each block of the Llama is column then row, so it talks only where it starts and where it
ends, through four autograd functions:

    entering a block (tp region)                     leaving a block
    TP  copy: identity, backward all-reduce (f)      all-reduce, backward identity (g)
    SP  all-gather the sequence, backward            reduce-scatter the sequence, backward
        reduce-scatter                               all-gather

Attention splits by heads, the MLP by its width, the embedding and the LM head by vocabulary
(`vocab_parallel_cross_entropy` takes the loss without gathering the logits). Its cost formulas
are in picotron/parallel/tensor_parallel_costs.py.

    model = Llama(config)                                  # identical on every tp rank
    apply_tensor_parallel(model, mesh, sequence_parallel=True)
    logits = model(input_ids)                              # (batch, seq, vocab/tp): this rank's vocab
    loss = vocab_parallel_cross_entropy(logits, targets, mesh.tp_group)
    loss.backward()                                        # every rank holds the same loss

The collectives go through picotron.comm; to count them, open `comm.counting(counter)` around the
forward and the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron import comm
from picotron.config import ModelConfig
from picotron.model import DecoderLayer, Llama

__all__ = ["copy_to_tp_region", "reduce_from_tp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region",
           "gather_along", "split_along", "enter_tp_region", "exit_tp_region",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "check_tensor_parallel", "parallelize_layer", "apply_tensor_parallel",
           "scatter_to_sp_region", "gather_parameters", "gather_gradients"]

SEQ_DIM = 1  # activations are (batch, seq, hidden)


# ---- moving a tensor along one dimension --------------------------------------------------------
def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `x` over the ranks, in place (nothing to do, and nothing counted, on one rank)."""
    if dist.get_world_size(group) > 1:
        comm.all_reduce(x, group=group, op=op)
    return x


def _all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank 0's first."""
    world = dist.get_world_size(group)
    if world == 1:
        return x.contiguous()
    # The collectives concatenate and split along the first dimension of contiguous memory.
    # Megatron keeps activations (seq, batch, hidden) so the sequence is already first; picotron's
    # model is batch-first, so we pay a copy each way.
    shard = x.movedim(dim, 0).contiguous()                           # (n, ...): `dim` first
    full = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))  # (world * n, ...)
    comm.all_gather(full, shard, group=group)
    return full.movedim(0, dim).contiguous()                         # `dim` back in place, world times longer


def _reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over the ranks and keep this rank's 1/world slice of the sum along `dim`."""
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"{x.shape[dim]} positions along dim {dim} of a {tuple(x.shape)} tensor do not split over "
                         f"tp={world} ranks; sequence parallelism needs a sequence length divisible by {world}")
    if world == 1:
        return x.contiguous()
    full = x.movedim(dim, 0).contiguous()                            # (world * n, ...)
    shard = full.new_empty((full.shape[0] // world, *full.shape[1:]))  # (n, ...)
    comm.reduce_scatter(shard, full, group=group)
    return shard.movedim(0, dim).contiguous()


def _split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's 1/world slice of `x` along `dim` (no communication)."""
    world = dist.get_world_size(group)
    if x.shape[dim] % world:
        raise ValueError(f"a dimension of {x.shape[dim]} (shape {tuple(x.shape)}, dim {dim}) does not split "
                         f"over tp={world} ranks; choose sizes divisible by {world}")
    return x.chunk(world, dim)[dist.get_rank(group)].contiguous()


def _summable(grad: torch.Tensor) -> torch.Tensor:
    # A contiguous copy to reduce in place: autograd may still hold the incoming gradient elsewhere.
    return grad.clone(memory_format=torch.contiguous_format)


# ---- the autograd functions: where tensor parallelism communicates ---------------------------------
class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward. Enters a tp region from a replicated tensor.

    Each rank feeds the same X into its own slice of a column-parallel layer, so each rank's dL/dX
    covers only its slice of the output features: the whole gradient is their sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(_summable(grad), ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward. Leaves a tp region (after a row-parallel layer).

    Y = sum_i Y_i, so dL/dY_i = dL/dY; and every rank computes the same thing from the same sum,
    so every rank already holds that whole gradient.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromSP(torch.autograd.Function):
    """SP's way in: all-gather the sequence forward, reduce-scatter backward.

    (batch, seq/t, hidden) -> (batch, seq, hidden). In backward each rank's gradient of the whole
    sequence is partial (its slice of features), like f's: sum them, and keep our tokens' part.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_along(grad, SEQ_DIM, ctx.group), None


class ReduceScatterToSP(torch.autograd.Function):
    """SP's way out: reduce-scatter the sequence forward, all-gather backward.

    (batch, seq, hidden) partial sums -> (batch, seq/t, hidden) whole. In backward every rank
    needs the gradient of the whole sequence, and each holds that of its own tokens.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_along(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, SEQ_DIM, ctx.group), None


class GatherAlong(torch.autograd.Function):
    """All-gather along `dim` forward, keep our slice backward.

    For a result that every rank then uses the same way (a column-parallel output gathered for
    replicated code): its gradient is the same on all ranks, so each keeps its part, no sum.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along(grad, ctx.dim, ctx.group), None, None


class SplitAlong(torch.autograd.Function):
    """Keep our slice along `dim` forward, all-gather backward: a replicated tensor into shards.

    Each rank's slice gets the gradient of its own part only; the whole gradient is their union.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split_along(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_along(grad, ctx.dim, ctx.group), None, None


def copy_to_tp_region(x, group):
    return CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group):
    return ReduceFromTP.apply(x, group)


def gather_from_sp_region(x, group):
    return GatherFromSP.apply(x, group)


def reduce_scatter_to_sp_region(x, group):
    return ReduceScatterToSP.apply(x, group)


def gather_along(x, dim, group):
    return GatherAlong.apply(x, dim, group)


def split_along(x, dim, group):
    return SplitAlong.apply(x, dim, group)


def scatter_to_sp_region(x, group):
    """(batch, seq, ...) the same on every rank -> this rank's (batch, seq/t, ...) piece, to feed an SP region.

    No communication forward (each rank keeps its slice); backward all-gathers the pieces' gradients.
    """
    return split_along(x, SEQ_DIM, group)


def enter_tp_region(x, group, sequence_parallel=False):
    """(batch, seq, h) replicated, or (batch, seq/t, h) under SP -> (batch, seq, h) for column-parallel layers."""
    return gather_from_sp_region(x, group) if sequence_parallel else copy_to_tp_region(x, group)


def exit_tp_region(x, group, sequence_parallel=False):
    """(batch, seq, h) partial sums -> the sum, (batch, seq, h) replicated or (batch, seq/t, h) under SP."""
    if sequence_parallel:
        return reduce_scatter_to_sp_region(x, group)
    return reduce_from_tp_region(x, group)


# ---- sharded modules --------------------------------------------------------------------------------
def _shard(weight: torch.Tensor, dim: int, group, what: str) -> nn.Parameter:
    """This rank's slice of a full weight along `dim`, as a new Parameter marked with that dim."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if weight.shape[dim] % world:
        raise ValueError(f"tp={world} does not divide the {weight.shape[dim]} {what} of a weight of shape "
                         f"{tuple(weight.shape)}; choose tp among the divisors of {weight.shape[dim]}")
    shard = nn.Parameter(weight.detach().chunk(world, dim)[rank].clone(), requires_grad=weight.requires_grad)
    shard.tp_shard_dim = dim   # how to put the full weight back together (gather_parameters)
    return shard


def _no_bias(module: nn.Module) -> None:
    if getattr(module, "bias", None) is not None:
        raise ValueError(f"{type(module).__name__} has a bias; picotron's tensor parallelism shards bias-free "
                         f"Linears (the Llama has none)")


class ColumnParallelLinear(nn.Module):
    """A Linear whose output features are split over the tp ranks: Y_i = X W_i^T, W_i = rows of W.

    Built from the full `linear` (every rank slices its own rows, so the result equals it exactly).
    The input must be whole on every rank: with enter_region=True the layer brings it there itself
    (copy, or all-gather of the sequence under SP); False when the caller did it once for several
    layers that read the same input (q, k, v; gate, up), which saves an all-reduce per extra layer
    in backward. gather_output=True all-gathers the features for code that needs all of them.
    """

    def __init__(self, linear: nn.Linear, group, *, sequence_parallel: bool = False, enter_region: bool = True,
                 gather_output: bool = False):
        super().__init__()
        _no_bias(linear)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.enter_region, self.gather_output = enter_region, gather_output
        self.weight = _shard(linear.weight, 0, group, "output features")   # (out/t, in)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.group, self.sequence_parallel)                 # (batch, seq, in)
        y = F.linear(x, self.weight)                                                   # (batch, seq, out/t)
        if self.gather_output:
            y = gather_along(y, -1, self.group)                                        # (batch, seq, out)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's)"


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the tp ranks: Y = sum_i X_i W_i^T, W_i = columns of W.

    Its input is this rank's slice of features (what a column-parallel layer produced), or, with
    split_input=True, the whole input, which it slices itself. The partial sums leave the tp region
    summed: all-reduced, or reduce-scattered along the sequence under SP.
    """

    def __init__(self, linear: nn.Linear, group, *, sequence_parallel: bool = False, split_input: bool = False):
        super().__init__()
        _no_bias(linear)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.split_input = split_input
        self.weight = _shard(linear.weight, 1, group, "input features")    # (out, in/t)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_input:
            x = split_along(x, -1, self.group)                              # (batch, seq, in/t)
        partial = F.linear(x, self.weight)                                  # (batch, seq, out): our share of the sum
        return exit_tp_region(partial, self.group, self.sequence_parallel)  # (batch, seq or seq/t, out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Module):
    """The token table split by vocabulary: rank i holds rows [i V/t, (i+1) V/t).

    A lookup is a one-hot row times the table, so this is a row-parallel layer: every rank
    returns the rows of the tokens it holds and zeros for the others, and the sum over ranks (the
    exit of a tp region: all-reduce, or reduce-scatter of the sequence under SP) has every row.
    """

    def __init__(self, embedding: nn.Embedding, group, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _shard(embedding.weight, 0, group, "vocabulary entries")   # (V/t, hidden)
        self.vocab_start = dist.get_rank(group) * self.weight.shape[0]
        self.vocab_end = self.vocab_start + self.weight.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: (batch, seq), the same on every tp rank
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(~mine, 0)      # a valid row, zeroed below
        rows = F.embedding(local_ids, self.weight).masked_fill(~mine[..., None], 0.0)  # (batch, seq, hidden)
        return exit_tp_region(rows, self.group, self.sequence_parallel)  # (batch, seq or seq/t, hidden)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, group, *,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy from each rank's slice of the vocabulary: picotron.model.loss_fn, sharded.

    local_logits: (batch, seq, V/t), rank i's vocabulary entries [i V/t, (i+1) V/t); targets:
    (batch, seq), the same on every rank. -log softmax(z)_y = log sum_v exp(z_v - m) - (z_y - m)
    needs only three numbers per token from all ranks: the max m, the sum of exponentials and the
    target's logit (held by one rank). Three all-reduces of b s fp32 values instead of gathering
    b s V logits. Every rank returns the same loss and runs backward from it; the sums' backward
    is the identity (ReduceFromTP) because each rank's part enters that loss once.
    """
    logits = local_logits.float()                                     # (batch, seq, V/t), in fp32 like loss_fn
    vocab_start = dist.get_rank(group) * logits.shape[-1]
    # Softmax does not change when every logit moves by the same amount: subtract the global max so
    # exp cannot overflow. A constant for autograd (detached).
    row_max = logits.detach().amax(dim=-1)                            # (batch, seq)
    _all_reduce(row_max, group, op=dist.ReduceOp.MAX)
    shifted = logits - row_max[..., None]
    sum_exp = reduce_from_tp_region(shifted.exp().sum(dim=-1), group)   # (batch, seq): over all V
    mine = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
    local_targets = (targets - vocab_start).masked_fill(~mine, 0)
    target_logit = shifted.gather(-1, local_targets[..., None]).squeeze(-1).masked_fill(~mine, 0.0)
    target_logit = reduce_from_tp_region(target_logit, group)           # (batch, seq): from its owner
    losses = sum_exp.log() - target_logit                             # (batch, seq)
    valid = targets != ignore_index
    return losses.masked_fill(~valid, 0.0).sum() / valid.sum()


# ---- applying it to the Llama ---------------------------------------------------------------------
def check_tensor_parallel(config: ModelConfig, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ValueError if the model cannot be split over tp ranks (whole heads, equal shards), and
    NotImplementedError for sequence parallelism with an MoE model (not written).

    The one check of tensor parallelism's sizes: `apply_tensor_parallel` and `parallelize_layer` run it.
    """
    if config.num_experts and tp > 1 and sequence_parallel:
        raise NotImplementedError(f"sequence parallelism with an MoE model (tp={tp}, num_experts="
                                  f"{config.num_experts}) is not written: each tp rank would route its own slice "
                                  f"of the sequence, and the experts' gradients and the balancing loss's load "
                                  f"would have to be summed over the tp ranks too; use tp without sequence_parallel")
    sizes = {"num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    sizes = {name: size for name, size in sizes.items() if size}   # 0: nothing of that kind is split
    for name, size in sizes.items():
        if size % tp:
            common = [d for d in range(1, min(sizes.values()) + 1) if all(v % d == 0 for v in sizes.values())]
            raise ValueError(f"tp={tp} does not divide {name}={size}: each tp rank holds an equal share of it; "
                             f"choose tp among {common} (the common divisors of "
                             f"{', '.join(f'{n}={v}' for n, v in sizes.items())})")


def _layer_config(layer: DecoderLayer) -> ModelConfig:
    """The sizes of one decoder layer that `check_tensor_parallel` reads, read from its modules. 0 for what
    the layer does not split: a vocabulary (it has none), an MoE block's width (the block stays whole)."""
    attn, mlp = layer.attn, layer.mlp
    moe = hasattr(mlp, "router")
    return ModelConfig(vocab_size=0, hidden_size=attn.q_proj.in_features,
                       intermediate_size=0 if moe else mlp.gate_proj.out_features,
                       num_attention_heads=attn.q_proj.out_features // attn.head_dim,
                       num_key_value_heads=attn.k_proj.out_features // attn.head_dim, head_dim=attn.head_dim,
                       num_experts=len(mlp.experts) if moe else 0)


def _enter_region_on_input(module: nn.Module, group, sequence_parallel: bool) -> None:
    """Make the first input of `module` enter the tp region before the module reads it."""
    def hook(module, args):
        x, *rest = args
        return (enter_tp_region(x, group, sequence_parallel), *rest)
    module.register_forward_pre_hook(hook)


def _sum_grad_over_tp(param: nn.Parameter, group) -> None:
    """Under SP a replicated weight (RMSNorm's) meets only this rank's tokens: its gradient is a
    partial sum over the sequence, and the weight's gradient is the sum over the tp ranks. It is
    f (copy forward, all-reduce backward) applied to the weight. A hook on the tensor sees this
    backward's gradient before it is added into .grad, so gradient accumulation stays right."""
    if dist.get_world_size(group) > 1:
        param.register_hook(lambda grad: _all_reduce(_summable(grad), group))


def parallelize_layer(layer: DecoderLayer, group, *, sequence_parallel: bool = False) -> DecoderLayer:
    """Split one decoder layer over `group` in place: attention by heads, the MLP by its width.

    Input and output: (batch, seq, hidden) on every rank, or (batch, seq/t, hidden) under SP.
    """
    check_tensor_parallel(_layer_config(layer), dist.get_world_size(group), sequence_parallel)
    return _split_layer(layer, group, sequence_parallel)


def _split_layer(layer: DecoderLayer, group, sequence_parallel: bool) -> DecoderLayer:
    """`parallelize_layer` once its sizes are checked."""
    attn, mlp = layer.attn, layer.mlp
    moe = hasattr(mlp, "router")     # a mixture of experts (chapter 07): left whole, see below
    column = dict(sequence_parallel=sequence_parallel, enter_region=False)
    row = dict(sequence_parallel=sequence_parallel)
    # Attention computes its head counts from these Linears' sizes: n_q/t and n_kv/t heads here.
    attn.q_proj = ColumnParallelLinear(attn.q_proj, group, **column)
    attn.k_proj = ColumnParallelLinear(attn.k_proj, group, **column)
    attn.v_proj = ColumnParallelLinear(attn.v_proj, group, **column)
    attn.o_proj = RowParallelLinear(attn.o_proj, group, **row)
    # One entry per block, shared by the Linears that read its input.
    _enter_region_on_input(attn, group, sequence_parallel)
    if not moe:
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group, **column)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group, **column)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group, **row)
        _enter_region_on_input(mlp, group, sequence_parallel)
    # An MoE block stays whole: after the attention's row-parallel all-reduce every tp rank holds the
    # same residual stream, so each runs the router and its experts on all tokens itself (the same
    # numbers, hence the same gradients, on every tp rank). Tensor parallelism thus splits the
    # attention part, and the experts are split by expert parallelism over the dp ranks instead
    # (each tp rank has its own ep groups), as Megatron-LM's expert-tensor-parallel size 1 does.
    if sequence_parallel:
        for norm in (layer.attn_norm, layer.mlp_norm):
            _sum_grad_over_tp(norm.weight, group)
    return layer


def apply_tensor_parallel(model: Llama, mesh, sequence_parallel: bool = False) -> Llama:
    """Split a plain Llama over mesh.tp_group in place; it then computes what it computed before.

    The model must be identical on every tp rank (same seed, or broadcast first): each rank keeps
    its slice of the full weights. Afterwards it takes the same (batch, seq) token ids on every tp
    rank and returns this rank's (batch, seq, vocab/tp) logits, for `vocab_parallel_cross_entropy`.
    Under SP the embedding reduce-scatters the sequence, so the layers and the final norm see
    (batch, seq/tp, hidden), and the LM head all-gathers it back.
    """
    check_tensor_parallel(model.config, mesh.tp_size, sequence_parallel)
    group = mesh.tp_group
    tied = model.lm_head.weight is model.embed.weight
    for layer in model.layers:
        _split_layer(layer, group, sequence_parallel)
    model.embed = VocabParallelEmbedding(model.embed, group, sequence_parallel=sequence_parallel)
    model.lm_head = ColumnParallelLinear(model.lm_head, group, sequence_parallel=sequence_parallel)
    if tied:   # the same vocabulary rows read tokens in and write logits out: one shard serves both
        model.lm_head.weight = model.embed.weight
    if sequence_parallel:
        _sum_grad_over_tp(model.norm.weight, group)
    return model


def _gather_full(model: nn.Module, group, tensor_of) -> dict[str, torch.Tensor]:
    full = {}
    for name, param in model.named_parameters():   # a tied weight appears once, under its first name
        tensor = tensor_of(param)
        if tensor is not None:
            tensor = tensor.detach().clone()
            if hasattr(param, "tp_shard_dim"):
                tensor = _all_gather_along(tensor, param.tp_shard_dim, group)
        full[name] = tensor
    return full


def gather_parameters(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """The full weights by name (the plain model's names), from every rank's shards."""
    return _gather_full(model, group, lambda p: p)


def gather_gradients(model: nn.Module, group) -> dict[str, torch.Tensor]:
    """The full gradients by name, from every rank's shards (None where a parameter has none)."""
    return _gather_full(model, group, lambda p: p.grad)

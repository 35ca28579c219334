"""The harness chapter 04 runs, times and draws: tensor parallelism's proofs, counters, timings and figures.

Chapter 04 (chapters/04_tensor_parallel.ipynb) keeps on its reading path the idea, the technique's key
code (f and g, a column- and a row-parallel linear, the cross-entropy from vocabulary slices, an
all-reduce cut in two halves), each proof's asserts and its one-line verdict. What only runs, records,
times or draws lives here:

    Setup                                          the chapter's model, batch and data, sent to the ranks
    mlp_roundings, loss_roundings                  the n of picotron.tolerance for section 1's block algebra
                                                   and section 2.3's sliced cross-entropy
    state_bytes, layers_activations                training state and activations per GPU (formulas)
    split_figure, regions_figure                   the two splits of a matrix product; where a layer talks (1)
    column_then_row, picotron_linears              the chapter's layers and picotron's vs nn.Linear (2.1)
    layer_inputs, plain_layer_result               one plain decoder layer, its output and gradients
    split_layer_vs_plain, tp_layer_and_tiny        that layer split over the ranks, TP or TP+SP (2.2, 2.4)
    vocab_parallel                                 the embedding and the loss split by vocabulary (2.3)
    one_tp_step                                    a whole model, one training step (2.5)
    train, dtensor_plan, layer_vs_dtensor, prove   20 steps against one process (picotron.lockstep, whose
                                                   figure the chapter draws); one layer against DTensor (3)
    measure, layer_saved_bytes                     collectives and saved activations, counted (4)
    comm_figure, activations_figure                bytes on the wire (4.1); activations per rank (4.2)
    rank_share, step_times, time_alone             step times on ranks and one rank's compute alone (4.3)
    step_time_figure, limits_figure                the timings (4.3); computed times per layer on H100s (5)
    worst_case                                     the one-line verdict of a proof on ranks

The rank functions are module-level, so `run` sends them by reference; they take the chapter's
`Setup` (or sizes) as arguments. The chapter's own classes (`ColumnLinear`, `RowLinear`) travel as
arguments too. Generic helpers (caption, max_diff, take_turns, the step-time figure) come from picotron_course.notebook.
matplotlib is imported inside the drawing functions only: the ranks, which import this module,
then start without it.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron import comm, lockstep, tolerance
from picotron.config import ModelConfig
from picotron.data import DataLoader
from picotron.launch import backend_for, device
from picotron.memory import GiB
from picotron.memory_tracking import saved_tensors
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               apply_tensor_parallel, gather_gradients, gather_parameters,
                                               parallelize_layer, scatter_to_sp_region,
                                               vocab_parallel_cross_entropy)
from picotron.parallel.tensor_parallel_costs import tp_activation_bytes_per_layer, tp_comm_bytes_per_layer
from picotron_course import notebook
from picotron_course.notebook import caption, count_passes, max_diff, no_frame, take_turns, worst_comparison

MODES = (("TP", False), ("TP+SP", True))


# ---- the chapter's model and data ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
    """The chapter's small model, batch and data set: what every rank function builds from."""

    config: ModelConfig
    batch: int
    seq: int
    dataset: object

    def new_model(self, config: ModelConfig | None = None) -> Llama:
        """The same weights on every rank and in one process."""
        torch.manual_seed(0)
        return Llama(config or self.config)

    def get_batch(self, step: int = 0):
        """Step `step`'s batch: the same tokens on every tp rank (TP splits the model, not the batch)."""
        return DataLoader(self.dataset, self.batch).get_batch(step)

    @property
    def layer_n(self) -> int:
        """Roundings behind any number of one decoder layer, forward and backward: the n of picotron.tolerance,
        whose bound on a float32 difference in summation order is 8 sqrt(n) u x the largest value, u = 2^-24."""
        return tolerance.llama_roundings(dataclasses.replace(self.config, num_layers=1), self.seq,
                                         self.batch * self.seq)


def mlp_roundings(h: int, h_ff: int = 0, tokens: int = 0) -> int:
    """n of picotron.tolerance (the roundings behind one number) for a Linear h -> h_ff followed by one
    h_ff -> h, in any summation order: a sum over the h inputs, then one over the h_ff features (h_ff = 0:
    the first Linear alone). A weight gradient sums over the `tokens` too. The bound on a float32
    difference is then 8 sqrt(n) u x the largest value."""
    return h + h_ff + tokens


def loss_roundings(vocab: int, tokens: int) -> int:
    """n of picotron.tolerance for a mean cross-entropy, however its vocabulary is sliced: each token's sum
    of exponentials over the `vocab` logits, then the mean over the `tokens`."""
    return vocab + tokens


def state_bytes(config: ModelConfig, tp: int) -> int:
    """Weights, gradients and AdamW state per GPU in bf16 mixed precision: 16 bytes per parameter (chapter 01).
    Every matrix and the embedding are split over the tp ranks; the RMSNorm weights (2 per layer + the final
    one) are replicated."""
    norms = (2 * config.num_layers + 1) * config.hidden_size
    return 16 * ((config.num_params() - norms) // tp + norms)


def layers_activations(config: ModelConfig, tp: int, sequence_parallel: bool, batch: int = 1, seq: int = 8192,
                       dtype_bytes: int = 2) -> int:
    """What the decoder layers keep for backward on one rank (picotron's exact count, section 4.2)."""
    return config.num_layers * tp_activation_bytes_per_layer(config, batch, seq, tp, sequence_parallel,
                                                             dtype_bytes=dtype_bytes)


# ---- 1. the idea: two figures ----------------------------------------------------------------------
def _matrix(ax, x, y, w, h, parts=1, along="cols", label="", offset=0.0) -> None:
    """A matrix drawn as a w x h box at (x, y), cut into `parts` slabs along its columns or rows, one colour
    per rank."""
    import matplotlib.pyplot as plt
    for i in range(parts):
        if along == "cols":
            box = (x + i * w / parts + i * offset, y - i * offset, w / parts, h)
        else:
            box = (x, y + h - (i + 1) * h / parts, w, h / parts)
        colour = plt.cm.tab10(i) if parts > 1 else "0.8"
        ax.add_patch(plt.Rectangle(box[:2], box[2], box[3], facecolor=colour, edgecolor="k", lw=0.8, alpha=0.5))
    ax.text(x + w / 2, y - 0.15, label, ha="center", va="top", fontsize=8)


def _partial_sums(ax, x, y, w, h, parts, label) -> None:
    """t full-sized partial results stacked like cards: their sum is Y."""
    import matplotlib.pyplot as plt
    for i in reversed(range(parts)):
        ax.add_patch(plt.Rectangle((x + 0.08 * i, y - 0.08 * i), w, h, facecolor=plt.cm.tab10(i), edgecolor="k",
                                   lw=0.8, alpha=0.6))
    ax.text(x + w / 2, y - 0.08 * parts - 0.15, label, ha="center", va="top", fontsize=8)


def split_figure() -> None:
    """Y = XA split two ways over 4 ranks: by A's columns (output features), by A's rows (input features)."""
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.4))
    _matrix(left, 0, 0, 1.0, 2, label="X (tokens x h_in)\nwhole on every rank")
    left.text(1.25, 1, "x", fontsize=14, ha="center", va="center")
    _matrix(left, 1.5, 0.5, 2.0, 1.0, 4, "cols", label="A: rank i holds\nthe columns $A_i$")
    left.text(3.8, 1, "=", fontsize=14, ha="center", va="center")
    _matrix(left, 4.1, 0, 2.0, 2, 4, "cols", label="Y = [X A$_0$ | ... | X A$_3$]\nrank i: its output features")
    left.set_title("Column-parallel: split the output features")
    right.set_title("Row-parallel: split the input features")
    _matrix(right, 0, 0, 1.0, 2, 4, "cols", label="X = [X$_0$ | ... | X$_3$]\nrank i: its input features")
    right.text(1.25, 1, "x", fontsize=14, ha="center", va="center")
    _matrix(right, 1.5, 0.5, 1.0, 1.0, 4, "rows", label="A: rank i holds\nthe rows $A_i$")
    right.text(2.85, 1, "=", fontsize=14, ha="center", va="center")
    _partial_sums(right, 3.2, 0, 1.0, 2, 4, "X$_i$ A$_i$: full-sized\npartial sums")
    right.text(4.75, 1, "sum\nover\nranks", fontsize=8, ha="center", va="center")
    _matrix(right, 5.2, 0, 1.0, 2, label="Y (tokens x h_out)\nafter an all-reduce")
    for ax in (left, right):
        ax.set(xlim=(-0.2, 6.4), ylim=(-0.9, 2.3), xticks=[], yticks=[], xlabel="block layout (colour = rank, t = 4)")
        no_frame(ax)
    caption(fig, "Left: each rank multiplies the whole input by its columns of A and gets a slab of the output. "
            "Right: each rank multiplies its slab of the input by its rows of A and gets a partial sum; the output "
            "is their sum.")
    plt.show()


def _box(ax, x0, x1, y, text, colour) -> None:
    import matplotlib.pyplot as plt
    ax.add_patch(plt.Rectangle((x0, y - 0.32), x1 - x0, 0.64, facecolor=colour, edgecolor="k", lw=0.8))
    ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=7.5)


def _operator(ax, x, y, name, forward, backward, colour) -> None:
    import matplotlib.pyplot as plt
    ax.add_patch(plt.Circle((x, y), 0.2, facecolor=colour, edgecolor="k", lw=0.8, zorder=3))
    ax.text(x, y, name, ha="center", va="center", fontsize=8, zorder=4, weight="bold")
    ax.text(x, y - 0.42, f"fwd: {forward}\nbwd: {backward}", ha="center", va="top", fontsize=6.5)


def regions_figure() -> None:
    """One decoder layer, forward from left to right: where TP and TP+SP enter and leave each block."""
    import matplotlib.pyplot as plt
    outside, inside = "0.88", (0.75, 0.85, 1.0)
    rows = {"TP": (1.9, "(b, s, h), the same\non every rank", ("f", "identity", "all-reduce"),
                   ("g", "all-reduce", "identity")),
            "TP + SP": (0.0, "(b, s/t, h): this\nrank's tokens", ("AG", "all-gather s", "reduce-scatter s"),
                        ("RS", "reduce-scatter s", "all-gather s"))}
    fig, ax = plt.subplots(figsize=(12, 3.9))
    for name, (y, between, enter, leave) in rows.items():
        ax.text(-0.15, y, name, ha="right", va="center", fontsize=10, weight="bold")
        _box(ax, 0.0, 1.6, y, "RMSNorm\n" + between, outside)
        _operator(ax, 2.0, y, *enter, "white")
        _box(ax, 2.4, 5.2, y, "q, k, v column-parallel\nattention: n_q/t, n_kv/t heads\no_proj row-parallel", inside)
        _operator(ax, 5.6, y, *leave, "white")
        _box(ax, 6.0, 7.6, y, "+ residual, RMSNorm\n" + between, outside)
        _operator(ax, 8.0, y, *enter, "white")
        _box(ax, 8.4, 11.2, y, "gate, up column-parallel\nSwiGLU on h_ff/t features\ndown row-parallel", inside)
        _operator(ax, 11.6, y, *leave, "white")
        _box(ax, 12.0, 12.9, y, "+ residual", outside)
    ax.add_patch(plt.Rectangle((0, -1.2), 0.3, 0.2, facecolor=outside, edgecolor="k", lw=0.6))
    ax.text(0.4, -1.1, "replicated (TP) or split along the sequence (SP)", va="center", fontsize=7.5)
    ax.add_patch(plt.Rectangle((5.2, -1.2), 0.3, 0.2, facecolor=inside, edgecolor="k", lw=0.6))
    ax.text(5.6, -1.1, "tensor-parallel region: weights and features split over the t ranks", va="center",
            fontsize=7.5)
    ax.set(xlim=(-1.0, 13.1), ylim=(-1.4, 2.4), xticks=[], yticks=[],
           xlabel="one decoder layer, forward from left to right", title="Where a tensor-parallel layer communicates")
    no_frame(ax)
    caption(fig, "Top: plain TP enters each block with f and leaves it with g (one all-reduce each way per block). "
            "Bottom: SP splits g's all-reduce into its two halves, a reduce-scatter at the exit and an all-gather at "
            "the next entry.")
    plt.show()


# ---- 2.1 the chapter's layers and picotron's, on ranks ---------------------------------------------
def column_then_row(column_cls, row_cls, h: int = 16, h_ff: int = 32) -> dict:
    """On a rank: nn.Linear(h, h_ff), SiLU, nn.Linear(h_ff, h), in one process and as column -> SiLU -> row
    (the chapter's classes). Output, input gradient and this rank's weight-gradient blocks, compared; the
    collectives of each pass; and the same shards without f and g."""
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)                                   # the same layers and data on every rank
    first, second = nn.Linear(h, h_ff, bias=False), nn.Linear(h_ff, h, bias=False)
    x, grad_out = torch.randn(3, 5, h), torch.randn(3, 5, h)                  # (batch, seq, h)
    x_ref = x.clone().requires_grad_()
    y_ref = second(F.silu(first(x_ref)))                   # the one-process layers
    y_ref.backward(grad_out)

    column, row = column_cls(first, group), row_cls(second, group)
    x_tp = x.clone().requires_grad_()
    y, counts = count_passes(lambda: row(F.silu(column(x_tp))),   # (3, 5, h_ff/t) in between
                             lambda y: y.backward(grad_out))       # every collective of each pass, counted
    n = mlp_roundings(h, h_ff, tokens=x[..., 0].numel())   # sums over h and h_ff, and the 15 tokens
    out = {"output": tolerance.compare(y, y_ref, n=n), "input grad": tolerance.compare(x_tp.grad, x_ref.grad, n=n),
           "weight grads": tolerance.compare_all(
               {"column": column.weight.grad, "row": row.weight.grad},
               {"column": first.weight.grad.chunk(world, 0)[rank], "row": second.weight.grad.chunk(world, 1)[rank]},
               n=n),
           **counts}

    x_alone = x.clone().requires_grad_()                   # the same shards, without f and g
    F.linear(F.silu(F.linear(x_alone, column.weight)), row.weight).backward(grad_out)
    out["input grad without f"] = max_diff(x_alone.grad, x_ref.grad)
    summed = x_alone.grad.clone()
    dist.all_reduce(summed)                                # what f's backward does
    out["sum over ranks of those"] = tolerance.compare(summed, x_ref.grad, n=n)
    return out


def picotron_linears(column_cls, row_cls, h: int = 16, h_ff: int = 32) -> dict:
    """On a rank: picotron's pair against the chapter's (bit for bit), and each gathered/split variant alone
    against nn.Linear (output, input gradient, gathered weight gradient)."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    first, second = nn.Linear(h, h_ff, bias=False), nn.Linear(h_ff, h, bias=False)
    x, grad_out = torch.randn(3, 5, h), torch.randn(3, 5, h_ff)
    ours = row_cls(second, group)(F.silu(column_cls(first, group)(x)))
    theirs = RowParallelLinear(second, group)(F.silu(ColumnParallelLinear(first, group)(x)))
    out = {"picotron pair vs ours": max_diff(theirs, ours)}
    for name, layer in (("column, gather_output", ColumnParallelLinear(first, group, gather_output=True)),
                        ("row, split_input", RowParallelLinear(first, group, split_input=True))):
        x_in = x.clone().requires_grad_()
        y = layer(x_in)                                     # (3, 5, h_ff): the whole output on every rank
        y.backward(grad_out)
        x_ref = x.clone().requires_grad_()
        first.weight.grad = None
        first(x_ref).backward(grad_out)
        out[name] = tolerance.compare_all(                  # sums over h, h_ff and the 15 tokens: float32 round-off
            {"output": y, "input grad": x_in.grad, "weight grad": gather_gradients(layer, group)["weight"]},
            {"output": first(x), "input grad": x_ref.grad, "weight grad": first.weight.grad},
            n=mlp_roundings(h, h_ff, tokens=x[..., 0].numel()))
    return out


# ---- 2.2, 2.4 one decoder layer split over the ranks -----------------------------------------------
def layer_inputs(setup: Setup):
    """A plain decoder layer, its RoPE tables and a random input and output gradient (the same on every rank)."""
    model = setup.new_model()
    cos, sin = model.rope(torch.arange(setup.seq)[None])
    generator = torch.Generator().manual_seed(1)
    x, grad_out = (torch.randn(setup.batch, setup.seq, setup.config.hidden_size, generator=generator)
                   for _ in range(2))
    return model.layers[0], cos, sin, x, grad_out


def plain_layer_result(layer, cos, sin, x, grad_out):
    """The plain layer's output, input gradient and weight gradients."""
    x = x.clone().requires_grad_()
    y = layer(x, cos, sin)
    y.backward(grad_out)
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}


def _mine(sequence_parallel: bool, group):
    """This rank's part of a (b, s, h) tensor: its s/t tokens under SP, all of it otherwise."""
    return (lambda x: scatter_to_sp_region(x, group)) if sequence_parallel else (lambda x: x)


def split_layer_vs_plain(setup: Setup, sequence_parallel: bool) -> dict:
    """One layer split over all ranks vs the plain layer: output, input gradient, gathered weight gradients
    (float32 round-off, nothing more); shard shapes, heads per rank and the collectives of each pass."""
    group, config, n = dist.group.WORLD, setup.config, setup.layer_n
    plain, cos, sin, x, grad_out = layer_inputs(setup)
    y_ref, x_grad_ref, grads_ref = plain_layer_result(copy.deepcopy(plain), cos, sin, x, grad_out)
    layer = parallelize_layer(copy.deepcopy(plain), group, sequence_parallel=sequence_parallel)
    mine = _mine(sequence_parallel, group)
    x_local = mine(x).detach().requires_grad_()                            # a leaf of its own
    y, counts = count_passes(lambda: layer(x_local, cos, sin), lambda y: y.backward(mine(grad_out)))
    grads = gather_gradients(layer, group)
    return {"output": tolerance.compare(y, mine(y_ref), n=n),
            "input grad": tolerance.compare(x_local.grad, mine(x_grad_ref), n=n),
            "weight grads": tolerance.compare_all(grads, grads_ref, n=n),
            "shapes": {name: tuple(p.shape) for name, p in layer.named_parameters()},
            "input shape": tuple(x_local.shape),
            "heads": (layer.attn.q_proj.out_features // config.head_dim,       # query heads on this rank
                      layer.attn.k_proj.out_features // config.head_dim),      # key-value heads
            **counts}


def tp_layer_and_tiny(setup: Setup, tiny: ModelConfig) -> dict:
    """split_layer_vs_plain under plain TP, and the error apply_tensor_parallel raises for `tiny` on these ranks."""
    out = split_layer_vs_plain(setup, sequence_parallel=False)
    mesh = Mesh(tp=dist.get_world_size())            # new process groups, which no collective uses below
    try:
        apply_tensor_parallel(Llama(tiny), mesh)
    except ValueError as error:
        out["tiny"] = str(error)
    dist.barrier()   # no rank exits (closing its sockets) while a peer still connects to the mesh's groups
    return out


# ---- 2.3 the embedding and the loss, split by vocabulary -------------------------------------------
def vocab_parallel(setup: Setup) -> dict:
    """picotron's VocabParallelEmbedding and vocab_parallel_cross_entropy against nn.Embedding, the full (tied)
    LM head and loss_fn: the embedding, the loss, this rank's slice of the logits' gradient, the loss's
    collectives."""
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    model, batch = setup.new_model(), setup.get_batch(0)
    embed = VocabParallelEmbedding(model.embed, group)
    hidden = torch.randn(setup.batch, setup.seq, setup.config.hidden_size)
    logits_ref = (hidden @ model.embed.weight.T).detach().requires_grad_()          # tied LM head: (b, s, V)
    loss_ref = loss_fn(logits_ref, batch.targets)
    loss_ref.backward()
    local = (hidden @ embed.weight.T).detach().requires_grad_()                     # this rank's (b, s, V/t)
    with comm.counting() as counter:
        loss = vocab_parallel_cross_entropy(local, batch.targets, group)
    forward = counter.snapshot()
    loss.backward()
    return {"embedding": tolerance.compare(embed(batch.input_ids), model.embed(batch.input_ids), n=world),
            "loss": abs(loss.item() - loss_ref.item()), "local logits": tuple(local.shape),
            "logits grad": tolerance.compare(local.grad, logits_ref.grad.chunk(world, -1)[rank],   # softmax over V
                                             n=setup.config.vocab_size), "forward": forward}


# ---- 2.5 the whole model ---------------------------------------------------------------------------
def one_tp_step(setup: Setup, sequence_parallel: bool):
    """apply_tensor_parallel, then one forward and backward counted into mesh.counter: (loss, logits shape,
    {parameter: (shard shape, tp_shard_dim)}, whether the LM head is tied to the embedding shard, counts)."""
    mesh = Mesh(tp=dist.get_world_size())
    model = apply_tensor_parallel(setup.new_model(), mesh, sequence_parallel)
    batch = setup.get_batch(0)
    with comm.counting(mesh.counter):
        logits = model(batch.input_ids)                                    # (b, s, V/t)
        loss = vocab_parallel_cross_entropy(logits, batch.targets, mesh.tp_group)
        loss.backward()
    sharded = {n: (tuple(p.shape), getattr(p, "tp_shard_dim", None)) for n, p in model.named_parameters()}
    tied = model.lm_head.weight is model.embed.weight
    return loss.item(), tuple(logits.shape), sharded, tied, mesh.counter.snapshot()


# ---- 3. prove it right -----------------------------------------------------------------------------
def train(setup: Setup, steps: int, sequence_parallel: bool | None = None, reference=None):
    """`steps` AdamW steps in one process (sequence_parallel=None): its picotron.lockstep Trace. Or this rank
    of a TP model, compared with that one-process `reference` every step (loss, gathered gradients; gathered
    weights at the end): its Lockstep, and its replicated weights (the RMSNorm weights) to compare across ranks."""
    model, mesh = setup.new_model(), None
    if sequence_parallel is not None:
        mesh = Mesh(tp=dist.get_world_size())
        apply_tensor_parallel(model, mesh, sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    record = lockstep.Recorder(reference)
    for step in range(steps):
        batch = setup.get_batch(step)                      # the same batches on every tp rank
        logits = model(batch.input_ids)
        if mesh is None:
            loss = loss_fn(logits, batch.targets)
            loss.backward()
            record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        else:
            loss = vocab_parallel_cross_entropy(logits, batch.targets, mesh.tp_group)
            loss.backward()
            record.step(loss, gather_gradients(model, mesh.tp_group))
        optimizer.step()
        optimizer.zero_grad()
    if mesh is None:
        return record.finish(dict(model.named_parameters()))
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if not hasattr(p, "tp_shard_dim")}
    return record.finish(gather_parameters(model, mesh.tp_group)), replicated


def dtensor_plan(sequence_parallel: bool) -> dict:
    """torch's tensor parallelism for picotron's DecoderLayer, module name -> style (the plan torchtitan
    uses for its Llama)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    leave = {"output_layouts": Shard(1)} if sequence_parallel else {}     # SP: reduce-scatter along the sequence
    plan = {name: ColwiseParallel() for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                                                 "mlp.up_proj")}
    plan |= {"attn.o_proj": RowwiseParallel(**leave), "mlp.down_proj": RowwiseParallel(**leave)}
    if sequence_parallel:                                 # norms on (b, s/t, h); all-gather into each block
        plan |= {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                 "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
                 "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return plan


def layer_vs_dtensor(setup: Setup, sequence_parallel: bool) -> dict:
    """One layer split by picotron and by torch's DTensor plan: each against the plain layer, and against
    each other (output, input gradient, full weight gradients)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    group, n = dist.group.WORLD, setup.layer_n
    plain, cos, sin, x, grad_out = layer_inputs(setup)
    y_ref, x_grad_ref, grads_ref = plain_layer_result(copy.deepcopy(plain), cos, sin, x, grad_out)
    mine = _mine(sequence_parallel, group)
    ours = parallelize_layer(copy.deepcopy(plain), group, sequence_parallel=sequence_parallel)
    theirs = parallelize_module(copy.deepcopy(plain), init_device_mesh("cpu", (dist.get_world_size(),)),
                                dtensor_plan(sequence_parallel))
    out, outputs, grads = {}, {}, {}
    for name, layer in (("picotron", ours), ("DTensor", theirs)):
        x_local = mine(x).detach().requires_grad_()                        # a fresh leaf for each run
        outputs[name] = layer(x_local, cos, sin)                          # (b, s, h) or (b, s/t, h)
        outputs[name].backward(mine(grad_out))
        grads[name] = (gather_gradients(layer, group) if name == "picotron" else
                       {p_name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        for p_name, p in layer.named_parameters()})
        out[name] = tolerance.compare_all({"output": outputs[name], "input grad": x_local.grad, **grads[name]},
                                          {"output": mine(y_ref), "input grad": mine(x_grad_ref), **grads_ref}, n=n)
    out["picotron vs DTensor"] = tolerance.compare_all({"output": outputs["picotron"], **grads["picotron"]},
                                                       {"output": outputs["DTensor"], **grads["DTensor"]}, n=n)
    return out


def prove(setup: Setup, steps: int, reference) -> dict:
    """On a rank: `steps` training steps under TP and TP+SP against the one-process Trace `reference` (train's
    (Lockstep, replicated weights) by mode name), and one layer against DTensor (by ("DTensor", mode name))."""
    out = {name: train(setup, steps, sp, reference) for name, sp in MODES}
    out |= {("DTensor", name): layer_vs_dtensor(setup, sp) for name, sp in MODES}
    return out


# ---- 4. measure it ---------------------------------------------------------------------------------
def _layer_comm(setup: Setup, sequence_parallel: bool) -> dict:
    """{"forward": counts, "backward": counts} of one decoder layer on this rank."""
    group = dist.group.WORLD
    plain, cos, sin, x, _ = layer_inputs(setup)
    layer = parallelize_layer(plain, group, sequence_parallel=sequence_parallel)
    x = _mine(sequence_parallel, group)(x).requires_grad_()
    return count_passes(lambda: layer(x, cos, sin), lambda y: y.sum().backward())[1]


def _step_comm(setup: Setup, mesh, sequence_parallel: bool) -> dict:
    """The same for a whole model: embedding, layers, LM head and the vocab-parallel loss."""
    model = apply_tensor_parallel(setup.new_model(), mesh, sequence_parallel)
    batch = setup.get_batch(0)
    return count_passes(lambda: vocab_parallel_cross_entropy(model(batch.input_ids), batch.targets, mesh.tp_group),
                        lambda loss: loss.backward())[1]


def layer_saved_bytes(setup: Setup, sequence_parallel: bool | None = None) -> int:
    """Bytes one layer keeps for backward on this rank, each storage once: the plain layer (None, in one
    process), or the layer split over all ranks (chapter 01's saved_tensors)."""
    plain, cos, sin, x, _ = layer_inputs(setup)
    layer = plain
    if sequence_parallel is not None:
        layer = parallelize_layer(plain, dist.group.WORLD, sequence_parallel=sequence_parallel)
        x = _mine(sequence_parallel, dist.group.WORLD)(x)
    rows = saved_tensors(layer(x.requires_grad_(), cos, sin), exclude=[*layer.parameters(), cos, sin])
    return sum({row.storage: row.nbytes for row in rows}.values())


def measure(setup: Setup) -> dict:
    """On a rank, for TP and TP+SP: one layer's collectives, one training step's, and one layer's saved bytes."""
    mesh = Mesh(tp=dist.get_world_size())
    out = {}
    for name, sp in MODES:
        out[("layer comm", name)] = _layer_comm(setup, sp)
        out[("step comm", name)] = _step_comm(setup, mesh, sp)
        out[("saved", name)] = layer_saved_bytes(setup, sp)
    return out


def comm_figure(setup: Setup, tps, wire: dict, measured: dict) -> None:
    """Left: ring bytes per layer and step from the counted calls, on the formula; right: calls per kind."""
    import matplotlib.pyplot as plt
    batch, seq, h = setup.batch, setup.seq, setup.config.hidden_size
    fig, (ax_bytes, ax_calls) = plt.subplots(1, 2, figsize=(11, 3.8))
    ts = np.arange(1, 9)
    ax_bytes.plot(ts, [tp_comm_bytes_per_layer(batch, seq, h, int(t)) / 1024 for t in ts], "-", color="0.4",
                  label="formula 8(t-1)/t · bsha (TP and TP+SP)")
    ax_bytes.axhline(8 * batch * seq * h * 4 / 1024, color="0.6", ls=":", lw=1, label="limit 8 bsha")
    for i, (name, _) in enumerate(MODES):
        ax_bytes.plot(np.array(tps) + (i - 0.5) * 0.12, [wire[tp, name] / 1024 for tp in tps], "os"[i],
                      color=f"C{i}", label=f"{name}, counted calls converted to ring bytes")
    ax_bytes.set(xlabel="tensor-parallel size t", ylabel="KiB sent per rank, per layer and step", ylim=(0, None),
                 title=f"Bytes on the wire, one layer ({batch} x {seq} tokens, h = {h}, fp32)")
    ax_bytes.legend(fontsize=7, loc="lower right")
    labels = [f"tp={tp}\n{name}" for tp in tps for name, _ in MODES]
    bottom = np.zeros(len(labels))
    for j, op in enumerate(("all_reduce", "all_gather", "reduce_scatter")):
        calls = [sum(measured[tp][0][("layer comm", name)][p].get(op, (0, 0))[0] for p in ("forward", "backward"))
                 for tp in tps for name, _ in MODES]
        ax_calls.bar(labels, calls, bottom=bottom, color=f"C{j + 2}", label=op.replace("_", "-"))
        bottom += calls
    ax_calls.set(ylabel="collective calls per layer and step", title="Counted calls, forward + backward")
    ax_calls.legend(fontsize=7)
    caption(fig, "Left: counted traffic equals the formula at t = 2 and 4, the same for TP and TP+SP, and grows "
            "towards 8 bsha per layer as t grows: it does not shrink with more ranks. Right: SP makes twice the calls "
            "(plus two small norm-gradient all-reduces), each half an all-reduce.")
    plt.show()


def activations_figure(setup: Setup, tps, U: int, S: int, saved: dict, llama: ModelConfig, gpu_bytes: int) -> None:
    """Left: one layer's activations per rank, measured on the formulas; right: Llama-3-8B per GPU at t <= 8."""
    import matplotlib.pyplot as plt
    config, batch, seq = setup.config, setup.batch, setup.seq
    fig, (ax_layer, ax_8b) = plt.subplots(1, 2, figsize=(12, 4.2))
    ts = np.array([1, 2, 4, 8])
    ax_layer.plot(ts, [(U + S / t) / 1024 for t in ts], "-", color="C0", label="TP: U + S/t")
    ax_layer.plot(ts, [tp_activation_bytes_per_layer(config, batch, seq, int(t), True) / 1024 for t in ts], "-",
                  color="C1", label="TP+SP, picotron: (U + S)/t + 2absh(1 - 1/t)")
    ax_layer.plot(ts, [(U + S) / t / 1024 for t in ts], "--", color="C1", alpha=0.6,
                  label="TP+SP, Playbook: (U + S)/t")
    for i, (name, _) in enumerate(MODES):
        ax_layer.plot([1, *tps], [saved[t, name] / 1024 for t in (1, *tps)], "os"[i], color=f"C{i}", ms=7,
                      label=f"{name}, measured")
    ax_layer.set(xscale="log", xlabel="tensor-parallel size t", ylabel="activations of one layer per rank (KiB)",
                 ylim=(0, None), title=f"One layer of MODEL, {batch} x {seq} tokens, fp32")
    ax_layer.set_xticks(ts, ts, minor=False)
    ax_layer.minorticks_off()
    ax_layer.legend(fontsize=7)

    width = 0.38
    for i, (name, sp) in enumerate(MODES):
        x = np.arange(len(ts)) + (i - 0.5) * width
        state = np.array([state_bytes(llama, int(t)) for t in ts]) / GiB
        acts = np.array([layers_activations(llama, int(t), sp) for t in ts]) / GiB
        ax_8b.bar(x, state, width, color="C2", alpha=0.8, label="weights + grads + optimizer" if i == 0 else None)
        ax_8b.bar(x, acts, width, bottom=state, color=f"C{i}", alpha=0.8, label=f"activations, {name}")
        for xi, total in zip(x, state + acts):
            ax_8b.text(xi, total + 2, f"{total:.0f}", ha="center", fontsize=7)
    ax_8b.axhline(gpu_bytes / GiB, color="k", ls="--", lw=1, label=f"one H100, {gpu_bytes / GiB:.1f} GiB")
    ax_8b.set(xticks=np.arange(len(ts)), xticklabels=[f"t = {t}" for t in ts], ylabel="GiB per GPU",
              title="Llama-3-8B, bf16 mixed, AdamW, 1 x 8192 tokens (formulas)")
    ax_8b.legend(fontsize=7)
    caption(fig, "Left: measured (dots) on the formulas (lines): TP alone flattens out at the norms' share, TP+SP "
            "keeps falling, a little above the Playbook's (U + S)/t by the gathered block inputs. Right: at t = 8 "
            "TP+SP brings Llama-3-8B to about 25 GiB per GPU; TP alone leaves twice the activations.")
    plt.show()


def rank_share(config: ModelConfig, tp: int) -> ModelConfig:
    """One rank's share of the work as a plain model: same hidden size, 1/tp of heads, MLP width and vocabulary."""
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                               num_key_value_heads=config.num_key_value_heads // tp, head_dim=config.head_dim,
                               intermediate_size=config.intermediate_size // tp, vocab_size=config.vocab_size // tp)


def step_times(config: ModelConfig, batch: int, seq: int, modes, reps: int = 5) -> dict:
    """{mode: [seconds per step]} on this rank: mode None trains `config` as it is, False / True split as TP /
    TP+SP. A repetition is one training step behind a barrier; the modes take turns, so that changes of load
    hit them alike; the first round (AdamW allocating its state) is not kept."""
    data = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    ids, targets = data[:, :-1].to(device()), data[:, 1:].to(device())
    mesh = Mesh(tp=dist.get_world_size())
    runners = {}
    for mode in modes:
        torch.manual_seed(0)
        model = Llama(config).to(device())
        if mode is not None:
            apply_tensor_parallel(model, mesh, mode)
        runners[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(mode):
        model, optimizer = runners[mode]
        logits = model(ids)
        loss = (loss_fn(logits, targets) if mode is None else
                vocab_parallel_cross_entropy(logits, targets, mesh.tp_group))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return {mode: [seconds for seconds, _ in runs] for mode, runs in take_turns(step, modes, reps).items()}


def time_alone(config: ModelConfig, batch: int, seq: int, tps) -> dict:
    """On one rank: the whole model, then each tp's rank share, with no communication at all."""
    return {tp: step_times(rank_share(config, tp), batch, seq, (None,))[None] for tp in (1, *tps)}


def step_time_figure(step_ms: dict, tps, world: int) -> None:
    """Step time against t: one process / t, one rank's compute alone, and the measured TP and TP+SP steps."""
    on_cpu = backend_for(world) == "gloo"
    notebook.step_time_figure(
        step_ms, tps, [name for name, _ in MODES], "tensor-parallel size t", on_cpu=on_cpu, reps=5,
        alone="compute alone",
        title=f"Training step of TIMED ({'gloo, CPU processes' if on_cpu else 'NCCL, one GPU per rank'})",
        text=f"A rank's compute shrinks with t (green: {step_ms[2, 'compute alone']:.0f} ms at t = 2 against "
             f"{step_ms[1, 'one process']:.0f} ms in one process), but the measured steps ({step_ms[2, 'TP']:.0f} ms "
             f"TP, {step_ms[2, 'TP+SP']:.0f} ms TP+SP at t = 2) sit well above it: every layer waits for its "
             "collectives.")


# ---- 5. where it breaks ----------------------------------------------------------------------------
def limits_figure(ts, compute, communication, nvlink_only) -> None:
    """Computed milliseconds per layer and step against t: compute, TP's communication, and the same if NVLink
    spanned every GPU; the percentages are communication / compute."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.loglog(ts, compute, "o-", color="C0", label="compute per layer (6P + 12hs) · s / t / R")
    ax.loglog(ts[1:], communication[1:], "s-", color="C3", label="TP communication per layer, 8(t-1)/t · sha / W")
    ax.loglog(ts[1:], nvlink_only[1:], ":", color="C3", alpha=0.6, label="the same if NVLink spanned all GPUs")
    ax.axvspan(8.5, 40, color="0.92", zorder=-1)
    ax.text(10, compute[0] * 0.8, "beyond one 8-GPU node:\nInfiniBand, 45 GB/s", fontsize=8, va="top")
    ax.minorticks_off()
    ax.set(xticks=ts, xticklabels=ts, xlabel="tensor-parallel size t", ylabel="time per layer and step (ms)",
           title="Llama-3-8B, 1 x 8192 tokens, bf16, H100 (computed)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    for t, c, m in zip(ts[1:], compute[1:], communication[1:]):
        ax.annotate(f"{m / c:.0%}", (t, m), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                    color="C3")
    caption(fig, "Computed from the formulas (percentages: communication / compute). Inside a node the collectives "
            "cost a fraction of the compute that grows with t; at t = 16 the layer spans two nodes and waits several "
            "times longer for InfiniBand than it computes.")
    plt.show()


# ---- verdicts --------------------------------------------------------------------------------------
def worst_case(per_rank: list[dict], names) -> str:
    """The one-line verdict over every rank's picotron.tolerance Comparisons `names` (each against one
    process): how close the worst comes to its float32 rounding bound, and where it is."""
    ratio, worst = worst_comparison(per_rank, names)
    return (f"{len(per_rank) * len(names)} cases ({'; '.join(names)}; on {len(per_rank)} ranks): all within float32 "
            f"round-off of one process, at most {ratio:.2g} x the bound ({worst})")

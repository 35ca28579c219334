"""The harness chapter 05 runs, times and draws: context parallelism's data, proofs, counters and figures.

Chapter 05 (chapters/05_context_parallel.ipynb) keeps the technique in front of the reader: the
online softmax, the ring and its backward, the zig-zag layout, a training step. What feeds those
cells, runs the proofs on ranks, counts the bytes and times the steps lives here:

    attention_inputs, sdpa_reference, new_model           data and the one-device reference
    online_softmax_roundings, attention_roundings,        picotron.tolerance's n for the comparisons, each
    cp_step_roundings                                     counted from the sizes it reads
    layers_activations                                    what the decoder layers keep, per rank (formula)
    idea_figure                                           the ring, and the causal work per rank (section 1)
    worst_error                                           the one-line verdict of a proof on ranks
    ulysses_on_ranks                                      picotron's Ulysses on ranks, shapes recorded (2.5)
    train, prove, proof_rows, show_proof                  attention; 20 steps in lockstep with one process (3)
    measure, step_times                                   work, bytes, activations (and step times) on ranks (4)
    show_work, work_figure, comm_figure, ...              the tables behind SHOW_DETAILS, and the figures (4, 5)

Every function takes its sizes as arguments: the chapter picks them from picotron_course.settings.
The rank functions (`ulysses_on_ranks`, `prove`, `measure`) are module-level, so `run` sends
them by reference.
"""

from __future__ import annotations

import dataclasses

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.patches import FancyArrowPatch, Polygon, Rectangle

from picotron import lockstep, tolerance
from picotron.data import DataLoader, cp_positions
from picotron.memory import GiB
from picotron.memory_tracking import SavedActivations
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.context_parallel import (CP_MODES, AttentionWork, apply_context_parallel, ring_attention,
                                                take_cp_tokens, ulysses_attention)
from picotron.parallel.context_parallel_costs import (cp_activation_bytes_per_layer, cp_comm_bytes_per_layer,
                                                      ring_attention_work)
from picotron.parallel.data_parallel import all_reduce_gradients
from picotron_course import notebook
from picotron_course.notebook import caption, count_passes, take_turns, worst_comparison

RANK_COLOURS = [plt.cm.tab10(i) for i in range(4)]


# ---- data and the one-device reference -----------------------------------------------------------
def online_softmax_roundings(row: int, blocks: int) -> int:
    """n of picotron.tolerance for one probability of a softmax over `row` scores read in `blocks` blocks, against
    torch.softmax: the sum of the row's exponentials (`row` roundings), and the running sum's rescale by
    exp(M - M') and the addition of each block's partial sum (one rounding per block)."""
    return row + blocks


def attention_roundings(seq: int, head_dim: int, backward: bool = False) -> int:
    """n of picotron.tolerance for one number of causal attention over `seq` tokens: q.k over head_dim, the
    softmax and P V over the sequence, merges of up to 8 blocks; gradients: as long again, and a key-value
    group's 2 query heads. The bound on a float32 difference in summation order is 8 sqrt(n) u x the largest value."""
    n = head_dim + 2 * seq + 8
    return 2 * n + 2 if backward else n


def cp_step_roundings(config, seq: int, batch: int, cp: int) -> int:
    """n of picotron.tolerance for a weight gradient of one training step on cp ranks, after the all-reduce, against
    one process on the same `batch` sequences of `seq` tokens: the whole model's sums
    (picotron.tolerance.llama_roundings: every layer's reductions, forward and backward, and the weight gradient's
    sum over the batch's tokens), then the all-reduce's sum over the cp ranks. The ring's merges add no more: a
    row's softmax summed in blocks rounds (block length + number of blocks) times, fewer than its `seq` terms."""
    return tolerance.llama_roundings(config, seq, batch * seq) + cp


def new_model(config):
    """The same weights on every rank and in one process."""
    torch.manual_seed(0)
    return Llama(config)


def attention_inputs(seq: int, heads: int, kv_heads: int, head_dim: int):
    """q (2, heads, seq, d), k and v (2, kv_heads, seq, d), and a gradient for the output: the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, head_dim, generator=generator)
    k, v = (torch.randn(2, kv_heads, seq, head_dim, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=generator)


def sdpa_reference(q, k, v, grad_out) -> dict:
    """Causal softmax attention on one device (torch's fused SDPA): the output and dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(grad_out)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def layers_activations(config, seq: int, cp: int = 1, mode: str = "zigzag", batch: int = 1, dtype_bytes: int = 2):
    """What the decoder layers keep for backward on one of cp ranks (picotron's exact count, section 4.3)."""
    return config.num_layers * cp_activation_bytes_per_layer(config, batch, seq, cp, mode, dtype_bytes=dtype_bytes)


def _compare_grads(local, reference, mine, seq, head_dim) -> dict:
    """out, dq, dk, dv of this rank against its rows of the one-device reference (picotron.tolerance)."""
    errors = {"out": tolerance.compare(local["out"], mine(reference["out"]), n=attention_roundings(seq, head_dim))}
    errors |= {f"d{n}": tolerance.compare(t.grad, mine(reference[f"d{n}"]),
                                          n=attention_roundings(seq, head_dim, backward=True))
               for n, t in zip("qkv", local["leaves"])}
    return errors


def worst_error(per_rank: list[dict]) -> str:
    """The one-line verdict over every rank's `errors` (picotron.tolerance Comparisons, one per tensor): how close
    the worst comes to its float32 rounding bound, and where it is."""
    ratio, worst = worst_comparison([result["errors"] for result in per_rank])
    tensors = ", ".join(per_rank[0]["errors"])
    return f"{tensors} on {len(per_rank)} ranks within {ratio:.2g} of their float32 rounding bound ({worst})"


# ---- section 1: the idea figure --------------------------------------------------------------------
def _draw_ring(ax, cp: int = 4) -> None:
    """cp ranks on a circle, rank 0 at the top; each passes its K, V block to the next, clockwise."""
    angles = np.pi / 2 - 2 * np.pi * np.arange(cp) / cp
    xy = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    for r, (x, y) in enumerate(xy):
        ax.add_patch(plt.Circle((x, y), 0.34, facecolor=RANK_COLOURS[r], alpha=0.75, edgecolor="k"))
        ax.text(x, y, f"rank {r}\nQ of its\nown tokens", ha="center", va="center", fontsize=7)
    for r in range(cp):
        a, b = xy[r], xy[(r + 1) % cp]
        unit = (b - a) / np.linalg.norm(b - a)
        ax.add_patch(FancyArrowPatch(a + 0.4 * unit, b - 0.4 * unit, arrowstyle="-|>", mutation_scale=14, lw=1.3,
                                     connectionstyle="arc3,rad=-0.3"))
        ax.text(*((a + b) / 2 * 1.62), "K, V", fontsize=8, ha="center", va="center")
    ax.text(0, 0, "step τ: rank r holds\nthe K, V of rank\n(r - τ) mod c", ha="center", va="center", fontsize=7)
    ax.set(xlim=(-1.7, 1.7), ylim=(-1.7, 1.7), aspect="equal", xticks=[], yticks=[],
           title=f"Ring attention, c = {cp}", xlabel="one hop per step: c - 1 hops in all")


def _chunk_owners(chunks: int, cp: int, zigzag: bool) -> list[int]:
    """The rank that holds each of `chunks` equal pieces of the sequence."""
    owner = {}
    for r in range(cp):
        for chunk in cp_positions(chunks, r, cp, zigzag).tolist():
            owner[chunk] = r
    return [owner[i] for i in range(chunks)]


def _draw_causal_work(ax, cp: int, zigzag: bool) -> list[float]:
    """The causal score matrix in 2cp x 2cp chunks, each (query chunk, key chunk) coloured by the rank computing
    it; returns each rank's work in chunk pairs (a diagonal triangle is half a pair)."""
    chunks = 2 * cp
    owner, work = _chunk_owners(chunks, cp, zigzag), [0.0] * cp
    for i in range(chunks):                                 # query chunk: row i from the top
        for j in range(i + 1):                              # key chunks it can see
            x, y, colour = j, chunks - 1 - i, RANK_COLOURS[owner[i]]
            if j < i:
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=colour, edgecolor="k", lw=0.5, alpha=0.75))
            else:                                           # the diagonal: keys after the query are masked
                ax.add_patch(Polygon([(x, y + 1), (x, y), (x + 1, y)], facecolor=colour, edgecolor="k", lw=0.5,
                                     alpha=0.75))
            work[owner[i]] += 1 if j < i else 0.5
    ax.set(xlim=(0, chunks), ylim=(0, chunks), aspect="equal", xlabel="key chunk", ylabel="query chunk (rank)")
    ax.set_xticks(np.arange(chunks) + 0.5, range(chunks))
    ax.set_yticks(np.arange(chunks) + 0.5, [f"{i} (r{owner[i]})" for i in reversed(range(chunks))], fontsize=7)
    ax.set_title(f"{'Zig-zag' if zigzag else 'Contiguous'}: chunk pairs per rank " + ", ".join(f"{w:g}" for w in work),
                 fontsize=9)
    return work


def idea_figure(cp: int = 4) -> dict[bool, list[float]]:
    """The ring, and who computes which part of the causal score matrix, contiguous vs zig-zag.
    Returns {zigzag: chunk pairs per rank} as drawn."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.3))
    _draw_ring(axes[0], cp)
    work = {zigzag: _draw_causal_work(ax, cp, zigzag) for ax, zigzag in zip(axes[1:], (False, True))}
    axes[2].legend(handles=[Rectangle((0, 0), 1, 1, color=c, alpha=0.75, label=f"rank {r}") for r, c in
                            enumerate(RANK_COLOURS[:cp])], fontsize=7, loc="upper right")
    plain, zig = work[False], work[True]
    caption(fig, f"Left: the queries stay, the key/value blocks go round. Middle: with contiguous slices rank {cp - 1} "
            f"computes {plain[-1]:g} chunk pairs' worth (a triangle is half a pair) and rank 0 only {plain[0]:g}. "
            f"Right: zig-zag gives every rank one early and one late chunk, {zig[0]:g} each.")
    plt.show()
    return work


# ---- section 2.5: Ulysses on ranks ---------------------------------------------------------------------
def ulysses_on_ranks(seq: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """On a rank: picotron's ulysses_attention against SDPA on the whole sequence, with a core that records the
    shapes it is given; the collectives counted in each pass; the error for too few key-value heads."""
    rank, c = dist.get_rank(), dist.get_world_size()
    q, k, v, grad_out = attention_inputs(seq, heads, kv_heads, head_dim)
    reference = sdpa_reference(q, k, v, grad_out)
    mine = lambda t: take_cp_tokens(t, rank, c)                             # contiguous slices  # noqa: E731
    leaves = [mine(t).requires_grad_() for t in (q, k, v)]
    seen = {}

    def core(q, k, v):                                                      # runs between the all-to-alls
        seen["q"], seen["k"] = tuple(q.shape), tuple(k.shape)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    out, counts = count_passes(lambda: ulysses_attention(*leaves, dist.group.WORLD, attend=core),
                               lambda out: out.backward(mine(grad_out)))
    errors = _compare_grads({"out": out, "leaves": leaves}, reference, mine, seq, head_dim)
    two_kv_heads = torch.randn(2, 2, seq // c, head_dim)                    # 2 key-value heads for 4 ranks
    try:
        ulysses_attention(leaves[0].detach(), two_kv_heads, two_kv_heads, dist.group.WORLD)
        error = "no error"
    except ValueError as e:
        error = str(e)
    return {"errors": errors, "local": tuple(leaves[0].shape), "seen": seen, **counts, "error": error}


# ---- section 3: the proof --------------------------------------------------------------------------------
def train(config, dataset, batch: int, steps: int, mode: str | None = None, reference=None):
    """`steps` AdamW steps on `batch` sequences of the dataset. One process (mode None): its Trace, every step's
    loss and gradients and the final weights. Or this rank of a cp run in `mode`, compared with `reference` at
    every step (picotron.lockstep: the mean loss over the cp ranks, the gradients after the all-reduce, the final
    weights): its Lockstep, and the positions of the tokens it held."""
    model, mesh = new_model(config), None
    loader = DataLoader(dataset, batch)
    if mode is not None:
        mesh = Mesh(cp=dist.get_world_size())
        apply_context_parallel(model, mesh, mode)
        loader = DataLoader(dataset, batch, cp_rank=mesh.cp_rank, cp_size=mesh.cp_size, zigzag=mode == "zigzag")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    record = lockstep.Recorder(reference)
    for step in range(steps):
        data = loader.get_batch(step)
        loss = loss_fn(model(data.input_ids, data.position_ids), data.targets)
        loss.backward()
        if mesh is not None:
            all_reduce_gradients(model, mesh.dp_cp_group)
            loss = loss.detach().clone()                        # the mean over the cp ranks: the whole batch's
            dist.all_reduce(loss, group=mesh.dp_cp_group)
            loss /= mesh.cp_size
        record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    result = record.finish(dict(model.named_parameters()))
    return result if mesh is None else (result, data.position_ids[0].tolist())


def attention_errors(seq: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Every mode on this rank's tokens against SDPA on the whole sequence: a Comparison per tensor."""
    rank, c = dist.get_rank(), dist.get_world_size()
    q, k, v, grad_out = attention_inputs(seq, heads, kv_heads, head_dim)
    reference = sdpa_reference(q, k, v, grad_out)
    out = {}
    for mode in CP_MODES:
        mine = lambda t: take_cp_tokens(t, rank, c, zigzag=mode == "zigzag")  # noqa: E731
        leaves = [mine(t).requires_grad_() for t in (q, k, v)]
        if mode == "ulysses":
            y = ulysses_attention(*leaves, dist.group.WORLD)
        else:
            y = ring_attention(*leaves, dist.group.WORLD, zigzag=mode == "zigzag")
        y.backward(mine(grad_out))
        out[mode] = _compare_grads({"out": y, "leaves": leaves}, reference, mine, seq, head_dim)
    return out


def prove(config, dataset, batch: int, steps: int, seq: int, reference) -> dict:
    """On a rank: attention_errors in every mode, and `steps` training steps in every mode against the one-process
    `reference` (a Trace): {"attention": {mode: Comparisons}, "train": {mode: Lockstep}, "positions": {mode: [...]}}."""
    trained = {mode: train(config, dataset, batch, steps, mode, reference) for mode in CP_MODES}
    return {"attention": attention_errors(seq, config.num_attention_heads, config.num_key_value_heads,
                                          config.head_dim),
            "train": {mode: result for mode, (result, _) in trained.items()},
            "positions": {mode: positions for mode, (_, positions) in trained.items()}}


def proof_rows(proof: dict, seq: int) -> dict:
    """One row per (cp, mode), the worst over its ranks: attention's error as a fraction of its rounding bound
    (and in absolute terms per tensor); training's largest loss and gradient differences over the steps and the
    final weights' (each rank's Lockstep holds them), and whether the ranks held every token once."""
    rows = {}
    for cp, ranks in proof.items():
        for mode in CP_MODES:
            attention = [rank["attention"][mode] for rank in ranks]
            runs = [rank["train"][mode] for rank in ranks]
            positions = [set(rank["positions"][mode]) for rank in ranks]
            rows[cp, mode] = {
                "attention": max(e.ratio for a in attention for e in a.values()),
                "attention worst": max(((str(e), e.ratio) for a in attention for e in a.values()),
                                       key=lambda pair: pair[1])[0],
                **{name: max(a[name].error for a in attention) for name in ("out", "dq", "dk", "dv")},
                "loss": max(max(run.loss_diff) for run in runs),
                "grad": max(max(run.grad_diff) for run in runs),
                "weights": max(run.weight_diff for run in runs),
                "each token once": set().union(*positions) == set(range(seq)) and sum(map(len, positions)) == seq,
            }
    return rows


def show_proof(rows: dict) -> None:
    """The proof's full table: attention's largest differences per tensor, then training's."""
    print(f"{'case':<16}{'attention: out':>15}{'dq':>9}{'dk':>9}{'dv':>9}{'max loss error':>16}{'max grad error':>16}"
          f"{'weight error':>14}")
    for (cp, mode), row in rows.items():
        print(f"cp={cp} {mode:<10}{row['out']:>15.1e}{row['dq']:>9.1e}{row['dk']:>9.1e}{row['dv']:>9.1e}"
              f"{row['loss']:>16.1e}{row['grad']:>16.1e}{row['weights']:>14.1e}")


# ---- section 4: what one launch per cp size measures ------------------------------------------------------
def layer_saved_bytes(config, batch: int, mesh, mode, seq: int) -> int:
    """Bytes one decoder layer keeps for backward on this rank; mesh None: the plain layer, one process."""
    model = new_model(config)
    c, rank = (mesh.cp_size, mesh.cp_rank) if mesh else (1, 0)
    if mesh:
        apply_context_parallel(model, mesh, mode)
    cos, sin = model.rope(cp_positions(seq, rank, c, mode == "zigzag")[None])
    x = torch.randn(batch, seq // c, config.hidden_size, requires_grad=True)
    with SavedActivations(exclude=[cos, sin]) as saved:        # saved-tensor hooks, each storage once
        model.layers[0](x, cos, sin)
    return saved.peak


def _step_comm(config, dataset, batch: int, mesh, mode: str) -> dict:
    """The collectives of one forward and backward of the whole model on this rank."""
    model = apply_context_parallel(new_model(config), mesh, mode)
    data = DataLoader(dataset, batch, cp_rank=mesh.cp_rank, cp_size=mesh.cp_size, zigzag=mode == "zigzag").get_batch(0)
    return count_passes(lambda: loss_fn(model(data.input_ids, data.position_ids), data.targets),
                        lambda loss: loss.backward())[1]


def _ring_work(seq: int, heads: int, kv_heads: int, head_dim: int, zigzag: bool) -> dict:
    """Chunk pairs, FLOPs and seconds of this rank's ring attention, forward and backward."""
    rank, c = dist.get_rank(), dist.get_world_size()
    q, k, v, grad_out = attention_inputs(seq, heads, kv_heads, head_dim)
    local = [take_cp_tokens(t, rank, c, zigzag).requires_grad_() for t in (q, k, v)]
    work = AttentionWork()
    out = ring_attention(*local, dist.group.WORLD, zigzag=zigzag, work=work)
    forward = dataclasses.asdict(work)
    out.backward(take_cp_tokens(grad_out, rank, c, zigzag))
    backward = {key: value - forward[key] for key, value in dataclasses.asdict(work).items()}
    return {"forward": forward, "backward": backward}


def step_times(config, batch: int, seq: int, modes, reps: int = 3) -> dict:
    """{mode: [seconds per training step]} on this rank, the modes taking turns; mode None: one process, the whole
    sequences."""
    c, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    data = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    runners = {}
    for mode in modes:
        model, mesh, positions = new_model(config), None, torch.arange(seq)
        if mode is not None:
            mesh = Mesh(cp=c)
            apply_context_parallel(model, mesh, mode)
            positions = cp_positions(seq, rank, c, mode == "zigzag")
        runners[mode] = (model, mesh, positions, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(mode):
        model, mesh, positions, optimizer = runners[mode]
        ids, targets = data[:, :-1][:, positions], data[:, 1:][:, positions]
        loss_fn(model(ids, positions.expand(batch, -1)), targets).backward()
        if mesh:
            all_reduce_gradients(model, mesh.dp_cp_group)
        optimizer.step()
        optimizer.zero_grad()

    return {mode: [seconds for seconds, _ in runs] for mode, runs in take_turns(step, modes, reps).items()}


def measure(config, dataset, batch: int, saved_seqs, work_seq: int, timed=None, timed_batch: int = 0,
            timed_seq: int = 0) -> dict:
    """On a rank of a cp group: the collectives of a training step in every mode, the bytes one layer keeps at
    each of `saved_seqs`, the ring's work per rank over `work_seq` tokens, and, when `timed` is a model config,
    the step times of that model ("times" is None otherwise: the chapter times only with SHOW_DETAILS)."""
    mesh = Mesh(cp=dist.get_world_size())
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    return {"comm": {mode: _step_comm(config, dataset, batch, mesh, mode) for mode in CP_MODES},
            "saved": {(mode, seq): layer_saved_bytes(config, batch, mesh, mode, seq)
                      for mode in CP_MODES for seq in saved_seqs},
            "work": {zigzag: _ring_work(work_seq, heads, kv_heads, d, zigzag) for zigzag in (False, True)},
            "times": step_times(timed, timed_batch, timed_seq, CP_MODES) if timed is not None else None}


# ---- section 4.1: work per rank -------------------------------------------------------------------------
def imbalance(flops) -> float:
    """The slowest rank's work over a perfectly balanced share of the same total."""
    return max(flops) / (sum(flops) / len(flops))


def show_work(measured: dict) -> None:
    """Chunk pairs and MFLOP per rank, as each rank's ring counted them, forward and backward."""
    print(f"{'':<20}{'chunk pairs per rank':<24}{'forward MFLOP per rank':<30}{'backward MFLOP per rank':<30}")
    for cp, ranks in measured.items():
        for zigzag in (False, True):
            flops = {p: [round(rank["work"][zigzag][p]["flops"] / 1e6, 2) for rank in ranks]
                     for p in ("forward", "backward")}
            print(f"cp={cp} {'zig-zag' if zigzag else 'contiguous':<14}"
                  f"{str([rank['work'][zigzag]['forward']['blocks'] for rank in ranks]):<24}"
                  f"{str(flops['forward']):<30}{str(flops['backward']):<30}")


def work_figure(measured: dict, replayed: dict | None, cp: int, work_seq: int, replay_seq: int) -> None:
    """Counted FLOPs per rank, replayed time per rank (when `replayed` is given: SHOW_DETAILS), and the imbalance
    of both layouts against c (formula)."""
    if replayed is None:
        fig, (ax_flops, ax_cp) = plt.subplots(1, 2, figsize=(10, 3.9))
        ax_time = None
    else:
        fig, (ax_flops, ax_time, ax_cp) = plt.subplots(1, 3, figsize=(14, 3.9))
    ranks, width = np.arange(cp), 0.38
    for i, zigzag in enumerate((False, True)):
        flops = [rank["work"][zigzag]["forward"]["flops"] / 1e6 for rank in measured[cp]]
        ax_flops.bar(ranks + (i - 0.5) * width, flops, width, color=f"C{i}", alpha=0.8,
                     label=f"{'zig-zag' if zigzag else 'contiguous'}, counted (= formula)")
        ax_flops.axhline(np.mean(flops), color=f"C{i}", ls=":", lw=1.2)
        if ax_time is not None:
            ax_time.bar(ranks + (i - 0.5) * width, replayed[zigzag], width, color=f"C{i}", alpha=0.8,
                        label="zig-zag" if zigzag else "contiguous")
            ax_time.axhline(np.mean(replayed[zigzag]), color=f"C{i}", ls=":", lw=1.2)
    ax_flops.set(xticks=ranks, xlabel="cp rank", ylabel="attention forward MFLOP per rank",
                 title=f"Work per rank, cp = {cp}, {work_seq} tokens (dotted: mean)")
    ax_flops.legend(fontsize=7)
    if ax_time is not None:
        ax_time.set(xticks=ranks, xlabel="cp rank", ylabel="replayed forward time per rank (ms)",
                    title=f"Time per rank, replayed alone, cp = {cp}, {replay_seq} tokens")
        ax_time.legend(fontsize=7)
    cps = 2 ** np.arange(1, 7)
    for i, zigzag in enumerate((False, True)):
        ax_cp.plot(cps, [imbalance([w["flops"] for w in ring_attention_work(1, 4096, 8, 64, int(c), zigzag)])
                         for c in cps], "os"[i] + "-", color=f"C{i}",
                   label="zig-zag" if zigzag else "contiguous: 2c / (c + 1)")
    ax_cp.set(xscale="log", xlabel="context-parallel size c", ylabel="slowest rank / mean",
              title="Imbalance of causal ring attention (formula)", ylim=(0.9, 2.1))
    ax_cp.set_xticks(cps, cps)
    ax_cp.minorticks_off()
    ax_cp.legend(fontsize=7)
    middle = ("" if replayed is None else "Middle: the same work replayed rank by rank (the slowest contiguous rank "
              f"{max(replayed[False]):.1f} ms, zig-zag {max(replayed[True]):.1f} ms). ")
    caption(fig, "Left: counted FLOPs per rank; contiguous slices give rank r (r + 1) blocks, zig-zag gives every rank "
            f"the same. {middle}Right: the contiguous ring runs at the pace of a rank doing almost twice its share.")
    plt.show()


# ---- section 4.2: communication ----------------------------------------------------------------------------
def wire_bytes(counted: dict, cp: int) -> float:
    """Bytes leaving the rank for the counted payloads: a ring hop sends all of it, an all-to-all (c-1)/c."""
    factor = {"send": 1, "all_to_all": (cp - 1) / cp}
    return sum(factor[op] * nbytes for p in counted.values() for op, (calls, nbytes) in p.items())


def show_comm(measured: dict, wire: dict, formula: dict) -> None:
    """What rank 0 counted in a whole step, per pass (calls, payload bytes), its wire bytes and the formula's."""
    print(f"{'':<16}{'forward (calls, payload bytes)':<34}{'backward':<34}{'wire bytes':>12}{'formula':>12}")
    for (cp, mode), nbytes in wire.items():
        counted = measured[cp][0]["comm"][mode]
        print(f"cp={cp} {mode:<10}{str(counted['forward']):<34}{str(counted['backward']):<34}"
              f"{nbytes:>12,.0f}{formula[cp, mode]:>12,}")


def comm_figure(wire: dict, config, batch: int, seq: int, cps, llama, long_seq: int) -> None:
    """Bytes per rank: counted on the small model against the formula (left), Llama-3-8B by formula (right)."""
    fig, (ax_small, ax_8b) = plt.subplots(1, 2, figsize=(12, 4))
    all_cps = np.array([2, 4, 8, 16, 32, 64])
    small_cps = [2, 4, 8, 16]                                    # zig-zag needs 2c chunks of the sequence
    for i, mode in enumerate(("ring", "ulysses")):
        allowed = [c for c in small_cps if mode == "ring" or c <= config.num_key_value_heads]
        ax_small.plot(allowed, [config.num_layers * cp_comm_bytes_per_layer(config, batch, seq, c, mode) / 1024
                                for c in allowed], "-", color=f"C{i}", label=f"{mode}, formula")
        ax_small.plot(cps, [wire[cp, mode] / 1024 for cp in cps], "os"[i], color=f"C{i}", ms=8,
                      label=f"{mode}, counted on the ranks")
    ax_small.plot(cps, [wire[cp, "zigzag"] / 1024 for cp in cps], "x", color="k", ms=8, label="zig-zag, counted")
    ax_small.set(xscale="log", xlabel="context-parallel size c", ylabel="KiB sent per rank per step",
                 title=f"MODEL, {batch} x {seq} tokens, fp32, {config.num_layers} layers "
                       f"(Ulysses: c <= {config.num_key_value_heads})", ylim=(0, None))
    ax_small.set_xticks(small_cps, small_cps)
    ax_small.minorticks_off()
    ax_small.legend(fontsize=7)
    for i, mode in enumerate(("ring", "ulysses")):
        allowed = [int(c) for c in all_cps if mode == "ring" or c <= llama.num_key_value_heads]
        ax_8b.plot(allowed, [cp_comm_bytes_per_layer(llama, 1, long_seq, c, mode, dtype_bytes=2) / 2**20
                             for c in allowed], "os"[i] + "-", color=f"C{i}", label=mode)
    ax_8b.axhline(2 * long_seq * llama.num_key_value_heads * llama.head_dim * (2 * 2 + 4) / 2**20, color="C0", ls=":",
                  lw=1, label="ring's limit, 2bs n_kv d (2a + 4)")
    ax_8b.axvspan(llama.num_key_value_heads + 0.5, 70, color="0.93", zorder=-1)
    ax_8b.text(10, 50, f"Ulysses impossible:\nc > {llama.num_key_value_heads} key-value heads", fontsize=8)
    ax_8b.set(xscale="log", xlabel="context-parallel size c", ylabel="MiB sent per GPU per layer and step",
              title=f"Llama-3-8B, 1 x {long_seq:,} tokens, bf16 (formula)", ylim=(0, None))
    ax_8b.set_xticks(all_cps, all_cps)
    ax_8b.minorticks_off()
    ax_8b.legend(fontsize=7)
    caption(fig, f"Left: counted traffic equals the formula for all three modes at c = {', '.join(map(str, cps))}. "
            "Right: the ring sends about the same bytes per GPU whatever c (each K, V block visits every rank); "
            f"Ulysses' bytes fall like 1/c, and are fewer, but stop at c = {llama.num_key_value_heads} and cannot "
            "hide behind compute.")
    plt.show()


# ---- section 4.3: activations -------------------------------------------------------------------------------
def show_saved(saved: dict, saved_seqs, cps) -> None:
    """Bytes one decoder layer keeps for backward, per rank, at each length: one process and every (cp, mode)."""
    print(f"{'seq':>5}{'cp=1':>10}" + "".join(f"{f'cp={cp} {mode}':>16}" for cp in cps for mode in CP_MODES))
    for seq in saved_seqs:
        print(f"{seq:>5}{saved[1, 'plain', seq]:>10,}"
              + "".join(f"{saved[cp, mode, seq]:>16,}" for cp in cps for mode in CP_MODES))
    print("(bytes one decoder layer keeps for backward, per rank, fp32; every entry == cp_activation_bytes_per_layer)")


def activation_figure(saved: dict, config, batch: int, seq: int, saved_seqs, cps, llama, long_seq: int,
                      gpu_bytes: int) -> None:
    """One layer of the small model, measured on the formula (left); Llama-3-8B's 32 layers per GPU (right)."""
    fig, (ax_small, ax_8b) = plt.subplots(1, 2, figsize=(12, 4.2))
    seqs = np.linspace(seq, 4 * seq, 50).astype(int) // 8 * 8
    for i, cp in enumerate((1, *cps)):
        ax_small.plot(seqs, [cp_activation_bytes_per_layer(config, batch, int(s), cp, "ring") / 1024 for s in seqs],
                      "-", color=f"C{i}",
                      label=f"c = {cp}, ring / zig-zag formula" if cp > 1 else "c = 1 (no CP), formula")
        if cp > 1:
            ax_small.plot(seqs, [cp_activation_bytes_per_layer(config, batch, int(s), cp, "ulysses") / 1024
                                 for s in seqs], "--", color=f"C{i}", lw=1, label=f"c = {cp}, Ulysses formula")
            for mode, marker in zip(CP_MODES, "o^s"):
                ax_small.plot(saved_seqs, [saved[cp, mode, s] / 1024 for s in saved_seqs], marker, color=f"C{i}",
                              ms=6, mfc="none" if mode == "ulysses" else None,
                              label=f"c = {cp}, {mode}, measured" if cp == max(cps) else None)
        else:
            ax_small.plot(saved_seqs, [saved[1, "plain", s] / 1024 for s in saved_seqs], "o", color="C0", ms=6)
    ax_small.set(xlabel="sequence length s (tokens)", ylabel="KiB kept by one layer per rank",
                 title=f"One layer of MODEL, batch {batch}, fp32", ylim=(0, None))
    ax_small.legend(fontsize=6.5, ncol=2)
    long_seqs = 2 ** np.arange(13, 21)
    for i, cp in enumerate((1, 2, 4, 8, 16, 32, 64)):
        ax_8b.plot(long_seqs, [layers_activations(llama, int(s), cp) / GiB for s in long_seqs], "o-", ms=3,
                   color=plt.cm.viridis(i / 6), label=f"c = {cp}")
    ax_8b.axhline(gpu_bytes / GiB, color="k", ls="--", lw=1, label=f"one H100, {gpu_bytes / GiB:.1f} GiB")
    ax_8b.set(xscale="log", yscale="log", xlabel="sequence length s (tokens)", ylabel="GiB per GPU",
              title="Llama-3-8B, 32 layers' activations, bf16, sdpa, zig-zag (formula)")
    ax_8b.set_xticks(long_seqs, [f"{s // 1024}k" for s in long_seqs])
    ax_8b.minorticks_off()
    ax_8b.legend(fontsize=7, ncol=2)
    caption(fig, "Left: measured (markers) on the formulas (lines) at three lengths; c ranks keep 1/c of a layer's "
            "activations, Ulysses a little more (its second copy of the output). Right: at 128k tokens one GPU would "
            f"keep {layers_activations(llama, long_seq) / GiB:.0f} GiB; c = 16 brings it under an H100, and every "
            "doubling of the sequence needs a doubling of c.")
    plt.show()


# ---- section 4.4: step time ----------------------------------------------------------------------------------
def step_time_figure(step_ms: dict, cps, timed_batch: int, timed_seq: int) -> None:
    """Step time against c, measured, next to one process / c."""
    notebook.step_time_figure(
        step_ms, cps, CP_MODES, "context-parallel size c", on_cpu=True, reps=3,
        title=f"Training step of TIMED, {timed_batch} x {timed_seq} tokens (gloo, CPU processes)",
        text=f"On CPU ranks: at c = 2 the contiguous ring takes {step_ms[2, 'ring']:.0f} ms, zig-zag "
             f"{step_ms[2, 'zigzag']:.0f} ms and Ulysses {step_ms[2, 'ulysses']:.0f} ms, against "
             f"{step_ms[1, 'one process']:.0f} ms in one process. The ring's unfused blocks and gloo's latency "
             "dominate here; none of these times says much about GPUs.")


# ---- section 5: when the transfers hide --------------------------------------------------------------------
def hiding_figure(ring_step, thresholds: dict, links: dict, config, rate: float, long_seq: int) -> None:
    """Compute per ring step (`ring_step(config, tokens_per_rank)` -> (FLOPs, bytes)) at `rate` FLOP/s against
    each link's transfer time, with the crossing points `thresholds[(link name, False)]`."""
    fig, ax = plt.subplots(figsize=(8.5, 4))
    tokens = np.geomspace(256, 65536, 60)
    compute = np.array([ring_step(config, m)[0] for m in tokens]) / rate * 1e6
    ax.loglog(tokens, compute, "-", color="k", lw=2,
              label=f"compute per step, 2 pairs of (s/2c)^2, at {rate / 1e12:.0f} TFLOP/s")
    for (name, w), colour in zip(links.items(), ("C2", "C0")):
        ax.loglog(tokens, np.array([ring_step(config, m)[1] for m in tokens]) / w * 1e6, "--", color=colour,
                  label=f"K, V block transfer, {name}")
        m = thresholds[name, False]
        ax.plot(m, ring_step(config, m)[1] / w * 1e6, "o", color=colour)
        ax.annotate(f"{m:,.0f} tokens", (m, ring_step(config, m)[1] / w * 1e6), textcoords="offset points",
                    xytext=(8, -12), fontsize=8, color=colour)
    for c in (8, 16, 32):
        ax.axvline(long_seq / c, color="0.7", lw=0.8, zorder=-1)
        ax.text(long_seq / c * 1.04, 1.2, f"128k / {c}", fontsize=7, ha="left", color="0.4")
    ax.set(xlabel="tokens per rank s / c", ylabel="time per ring step, one layer (µs)",
           title="Llama-3-8B, zig-zag ring, forward, bf16, H100 (computed)")
    ax.legend(fontsize=7, loc="upper left")
    caption(fig, "Compute grows like (s/c)^2, the transfer like s/c: left of a dot the ring waits for its link. Inside "
            "a node a few hundred tokens per rank suffice; across nodes a 128k sequence hides up to c = 16 (8,192 "
            "tokens per rank) but not at c = 32.")
    plt.show()

"""The harness chapter 00 runs, times and draws: the before/after tables of the collectives, the ring's
trace, the bytes it sends, the timing loop of the bandwidth curve and the figures of the cost model.

Kept out of the chapter's reading path; the chapter keeps the technique (the ring all-reduce), its
proofs and the cost formulas, and calls these for the pictures and the clock. `time_collective` runs
in the ranks, which import this module: matplotlib is imported only by the functions that draw.

    from picotron_course.notebook_collectives import show_collective, time_collective
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from picotron import comm
from picotron.launch import device
from picotron_course.notebook import caption, sync

__all__ = ["show_collective", "draw_ring_trace", "draw_ring_bytes", "time_collective", "draw_bandwidth",
           "draw_ring_vs_tree"]


# ---- section 1: a collective, before and after -----------------------------------------------
def _draw_table(ax, rows: list, width: int, title: str) -> None:
    """One row per rank, one cell per element; colour = the rank a value came from (tens digit), grey = a sum."""
    import matplotlib.pyplot as plt

    ranks = len(rows)
    for rank, row in enumerate(rows):
        if row is None:
            ax.text((width - 1) / 2, rank, "—", ha="center", va="center", color="0.5")
            continue
        for j, value in enumerate(row):
            colour = plt.cm.tab10(int(value) // 10) if value < 10 * ranks else "0.7"
            ax.add_patch(plt.Rectangle((j - 0.45, rank - 0.45), 0.9, 0.9, color=colour, alpha=0.5))
            ax.text(j, rank, f"{value:g}", ha="center", va="center", fontsize=9)
    ax.set(xlim=(-0.5, width - 0.5), ylim=(ranks - 0.5, -0.5), xticks=range(width), yticks=range(ranks),
           xlabel="element index", ylabel="rank", title=title)


def show_collective(name: str, results: list, text: str) -> None:
    """Before/after picture of a collective from the (before, after) pair each rank returned (None: nothing)."""
    import matplotlib.pyplot as plt

    rows = [[None if r[k] is None else r[k].tolist() for r in results] for k in (0, 1)]
    width = max(len(row) for table in rows for row in table if row is not None)
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.8))
    for ax, table, title in zip(axes, rows, ("before", "after")):
        _draw_table(ax, table, width, title)
    fig.suptitle(name, fontweight="bold")
    caption(fig, text)
    plt.show()


# ---- section 2: the ring, step by step, and its bytes ----------------------------------------
def draw_ring_trace(traces: np.ndarray) -> None:
    """traces[rank, step, chunk]: a bit mask, bit r set when rank r's data is in that chunk's running sum."""
    import matplotlib.pyplot as plt

    ranks, steps, _ = traces.shape
    names = (["start"] + [f"reduce-scatter {k + 1}" for k in range(ranks - 1)]
             + [f"all-gather {k + 1}" for k in range(ranks - 1)])
    fig, axes = plt.subplots(1, steps, figsize=(2.1 * steps, 2.6), sharey=True)
    for step, ax in enumerate(axes):
        held = np.vectorize(lambda m: bin(m).count("1"))(traces[:, step])   # how many ranks' data
        ax.imshow(held, cmap="Blues", vmin=0, vmax=2 * ranks)  # light: one rank's data, mid-blue: all of it
        for rank in range(ranks):
            for chunk in range(ranks):
                label = "".join(str(r) for r in range(ranks) if traces[rank, step, chunk] >> r & 1)
                changed = step > 0 and traces[rank, step, chunk] != traces[rank, step - 1, chunk]
                ax.text(chunk, rank, label, ha="center", va="center", fontsize=8,
                        fontweight="bold" if changed else "normal", color="red" if changed else "black")
        ax.set(title=names[step], xlabel="chunk", xticks=range(ranks), yticks=range(ranks))
    axes[0].set_ylabel("rank")
    fig.suptitle(f"Ring all-reduce on {ranks} ranks: which ranks' data each chunk holds", fontweight="bold")
    caption(fig, "Each cell lists the ranks summed into that chunk; red = just received. After N-1 steps each rank "
            "owns one complete chunk (0123); N-1 more steps copy it to everyone.")
    plt.show()


def draw_ring_bytes(measured: dict, tensor_bytes: int, largest: int = 16) -> None:
    """Bytes sent per rank over S against N: the formulas as lines, `measured` ({N: bytes}) as dots."""
    import matplotlib.pyplot as plt

    ns = np.arange(2, largest + 1)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(ns, 2 * (ns - 1) / ns, "-", color="0.4", label="all-reduce, formula 2(N-1)/N")
    ax.plot(ns, (ns - 1) / ns, "--", color="0.6", label="reduce-scatter or all-gather, (N-1)/N")
    ax.plot(list(measured), [b / tensor_bytes for b in measured.values()], "o", color="C3", ms=8,
            label="ring_all_reduce, measured")
    ax.axhline(2, color="0.8", lw=1)
    ax.set(xlabel="ranks N", ylabel="bytes sent per rank / tensor bytes S",
           title="Bytes each rank sends in a ring all-reduce", ylim=(0, 2.2))
    ax.legend(fontsize=8, loc="lower right")
    caption(fig, "Measured bytes sit on the formula; the cost per rank approaches 2S and never exceeds it, whatever N.")
    plt.show()


# ---- section 3: the clock, nccl-tests style ----------------------------------------------------
def time_collective(op: str, sizes, reps: int = 5, iters: int = 5) -> list[list[float]]:
    """On a rank: for each message size (bytes), `reps` timings, each the mean of `iters` back-to-back calls.

    op: "all_reduce" (the backend's), "ring_all_reduce" (picotron.comm's) or "all_gather" (S = the output).
    A warm-up call first (buffers, connections); every repetition starts behind a barrier and ends
    after the GPU has finished (sync), like nccl-tests.
    """
    n = dist.get_world_size()
    timings = []
    for nbytes in sizes:
        x = torch.zeros(int(nbytes) // 4, device=device())   # zeros: repeated sums stay finite
        shard = x[: x.numel() // n].clone()
        call = {"all_reduce": lambda: dist.all_reduce(x),
                "ring_all_reduce": lambda: comm.ring_all_reduce(x),
                "all_gather": lambda: comm.all_gather(x, shard)}[op]
        call()
        samples = []
        for _ in range(reps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            sync()
            samples.append((time.perf_counter() - t0) / iters)
        timings.append(samples)
    return timings


def draw_bandwidth(sizes: np.ndarray, seconds: dict, fits: dict, factors: dict, title: str) -> None:
    """Left: time per call against size, with the fit T = alpha + factor S / W. Right: bus bandwidth.

    seconds[op]: one time per size; fits[op] = (alpha, W); factors[op]: the busbw factor, 2(N-1)/N or (N-1)/N.
    """
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.4))
    line = np.geomspace(sizes[0], sizes[-1], 100)
    for i, (op, (alpha, bus)) in enumerate(fits.items()):
        ax_t.loglog(sizes, seconds[op] * 1e3, "o", color=f"C{i}", label=f"{op}, measured")
        ax_t.loglog(line, (alpha + factors[op] * line / bus) * 1e3, "-", color=f"C{i}", alpha=0.6,
                    label=f"fit: α={alpha * 1e6:.0f} µs, W={bus / 1e9:.2f} GB/s")
        ax_bw.loglog(sizes, factors[op] * sizes / seconds[op] / 1e9, "o-", color=f"C{i}", label=op)
        ax_bw.axhline(bus / 1e9, color=f"C{i}", ls=":", lw=1)
    top = max(s.max() for s in seconds.values()) * 1e3
    ax_t.set(xlabel="message size S (bytes)", ylabel="time per call T (ms)",
             title="Time vs message size, with α-W fit", ylim=(None, top * 30))
    ax_bw.set(xlabel="message size S (bytes)", ylabel="bus bandwidth (GB/s)", title="Bus bandwidth vs message size")
    ax_t.legend(fontsize=7, loc="upper left")
    ax_bw.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontweight="bold")
    caption(fig, "Left: flat at small sizes (latency α), then growing with size (bandwidth); lines are the fit. "
            "Right: measured busbw climbs towards the fitted W (dotted) only once messages pass the knee.")
    plt.show()


# ---- section 4: the model of ring against tree -------------------------------------------------
def draw_ring_vs_tree(ranks: np.ndarray, ring_time, tree_time, alpha: float, bus: float,
                      sizes=(2**20, 256 * 2**20)) -> None:
    """ring_time(N, S) and tree_time(N, S) in seconds, for each size in `sizes` (bytes), against N."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for nbytes, style in zip(sizes, ("-", "--")):
        ax.loglog(ranks, ring_time(ranks, nbytes) * 1e3, style, color="C0", label=f"ring, {nbytes // 2**20} MiB")
        ax.loglog(ranks, tree_time(ranks, nbytes) * 1e3, style, color="C1", label=f"tree, {nbytes // 2**20} MiB")
    ax.set(xlabel="ranks N", ylabel="all-reduce time T (ms)", title="Model: ring vs tree all-reduce as N grows")
    ax.legend(fontsize=8)
    caption(fig, f"α = {alpha * 1e6:.0f} µs per step, W = {bus / 1e9:.0f} GB/s per GPU (assumed). A 1 MiB ring is "
            "latency-bound beyond ~5 ranks and grows linearly with N, the tree only as log N; 256 MiB stays "
            "bandwidth-bound up to ~1000 ranks.")
    plt.show()

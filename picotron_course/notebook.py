"""The small helpers every chapter uses for its figures, differences and timings.

One copy here instead of one per chapter; a chapter imports what it needs:

    from picotron_course.notebook import caption, max_diff, show_lines, show_source, slowest_median, sync

worst_comparison finds the worst of a proof's picotron.tolerance Comparisons over its ranks, for a chapter's
one-line verdict; count_passes counts the collectives of a forward, then of its backward (picotron.comm).

take_turns is the timing loop of every chapter that times steps (modes in turns behind a barrier, the first
round dropped); step_time_figure draws measured step times against the number of ranks (chapters 04, 05).

show_source and show_lines print picotron's own code, as it is now, so a chapter reads what runs
rather than a copy that can drift from it.
"""

from __future__ import annotations

import inspect
import os
import statistics
import textwrap
import time

import torch
import torch.distributed as dist

from picotron import comm


def caption(fig, text: str) -> None:
    """The one-line caption under a figure: what to see in it (placed under the lowest axis label)."""
    fig.tight_layout()
    below = fig.get_tightbbox().y0 / fig.get_figheight() - 0.03
    fig.text(0.5, below, textwrap.fill(text, 120), ha="center", va="top", fontsize=9, style="italic")


def sync() -> None:
    """Wait for this process's GPU work to finish before reading a clock (nothing to wait for on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def max_diff(a, b) -> float:
    """The largest absolute difference between two tensors, or between two dicts of tensors (keys of `b`)."""
    if isinstance(b, dict):
        return max((max_diff(a[name], b[name]) for name in b), default=0.0)
    return (a.detach() - b.detach()).abs().max().item()


def slowest_median(per_rank: list[list[float]]) -> float:
    """Median over repetitions of the slowest rank's time: per_rank[r][i] is rank r's i-th repetition.

    A step of N ranks takes as long as its slowest rank; the median keeps one slow repetition
    (another process on the machine, a page fault) from deciding the figure.
    """
    reps = len(per_rank[0])
    return statistics.median(max(rank[i] for rank in per_rank) for i in range(reps))


def worst_comparison(per_rank: list[dict], names=None) -> tuple[float, str]:
    """The worst of every rank's picotron.tolerance Comparisons `names` (all of each rank's dict when None), each
    against one process: (its error / bound, "worst: NAME on rank R, max |difference| E"), for a one-line verdict."""
    ratio, name, rank, error = max((comparisons[name].ratio, name, rank, comparisons[name].error)
                                   for rank, comparisons in enumerate(per_rank) for name in names or comparisons)
    return ratio, f"worst: {name} on rank {rank}, max |difference| {error:.1e}"


def count_passes(forward, backward) -> tuple:
    """(what forward() returned, {"forward": counts, "backward": counts}): the collectives this rank issues in
    forward(), then in backward(what it returned), each pass counted apart by picotron.comm.counting (counts as
    CommCounter.snapshot has them: {operation: (calls, payload bytes)})."""
    with comm.counting() as counter:
        out = forward()
    counts = {"forward": counter.snapshot()}
    with comm.counting() as counter:
        backward(out)
    return out, counts | {"backward": counter.snapshot()}


def take_turns(step, names, reps: int, warmup: int = 1) -> dict:
    """{name: [(seconds, what step(name) returned)] per repetition}: each repetition, every name in turn runs
    step(name) behind a barrier (when there are ranks), so that changes of the machine's load hit them alike;
    the first `warmup` rounds (AdamW allocating its state, gloo connecting) are not kept."""
    times = {name: [] for name in names}
    for rep in range(warmup + reps):
        for name in names:
            sync()
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            result = step(name)
            sync()
            if rep >= warmup:
                times[name].append((time.perf_counter() - start, result))
    return times


def no_frame(ax) -> None:
    """A drawing, not a plot: no box around the axes."""
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)


def shade_crowded(ax, ranks) -> None:
    """Grey behind the rank counts above this machine's CPU cores: their CPU processes share cores."""
    cores = os.cpu_count() or 1
    crowded = [n for n in ranks if n > cores]
    if crowded:
        ax.axvspan(min(crowded) * 0.9, max(crowded) * 1.1, color="0.93", zorder=-1)
        ax.text(max(crowded) * 1.08, 0.03, f"more ranks than\nthe {cores} CPU cores", fontsize=7, ha="right",
                va="bottom", transform=ax.get_xaxis_transform())


def step_time_figure(step_ms: dict, sizes, modes, size: str, title: str, text: str, reps: int, on_cpu: bool,
                     alone: str | None = None) -> None:
    """Measured time per step against the number of ranks n (`size`, e.g. "tensor-parallel size t"): one process
    / n, a perfect split; step_ms[n, alone], one rank's compute with no communication (if given); step_ms[n, mode]
    for each mode (slowest rank, median of `reps`); step_ms[1, "one process"] starts every line."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    everyone, one, n = [1, *sizes], step_ms[1, "one process"], size.split()[-1]
    ax.plot(everyone, [one / s for s in everyone], ":", color="0.5", label=f"one process / {n} (perfect split)")
    if alone:
        ax.plot(everyone, [one] + [step_ms[s, alone] for s in sizes], "^-", color="C2",
                label="rank's compute alone (no communication)")
    for i, mode in enumerate(modes):
        ax.plot(everyone, [one] + [step_ms[s, mode] for s in sizes], "os^"[i] + "-", color=f"C{i}",
                label=f"{mode}, measured (slowest rank, median of {reps})")
    if on_cpu:
        shade_crowded(ax, sizes)
    ax.set(xscale="log", xlabel=f"{size} (ranks)", ylabel="time per step (ms)", ylim=(0, None), title=title)
    ax.set_xticks(everyone, everyone)
    ax.minorticks_off()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    caption(fig, text)
    plt.show()


def _source(function) -> tuple[list[str], int, str, str]:
    """(lines, first line number, file relative to the checkout, qualified name) of a function, a method
    (a decorated one: its own file, not the decorator's) or a Triton kernel (its Python function)."""
    function = inspect.unwrap(getattr(function, "fn", function))
    lines, first = inspect.getsourcelines(function)
    path = inspect.getsourcefile(function)
    shown = os.path.relpath(path, os.path.dirname(os.path.dirname(__file__))) if path else "?"
    return lines, first, shown, function.__qualname__


def show_source(*functions) -> None:
    """Print each function's source as picotron has it now, headed by its file and line numbers."""
    for function in functions:
        lines, first, shown, name = _source(function)
        print(f"# {shown}, lines {first}-{first + len(lines) - 1}: {name}")
        print("".join(lines))


def show_lines(function, *needles: str) -> None:
    """Print the lines of `function` (as picotron has it now) that contain any of `needles`, each with its line
    number, "..." where lines are left out: the few lines a paragraph reads, without the rest of the method.
    Raises if a needle is no longer there, so a chapter cannot go on reading code that changed."""
    lines, first, shown, name = _source(function)
    missing = [needle for needle in needles if not any(needle in line for line in lines)]
    if missing:
        raise ValueError(f"{missing} not in {name}: picotron's code changed; update the cell")
    print(f"# {shown}, from {name} (lines {first}-{first + len(lines) - 1}):")
    previous = None
    for i, line in enumerate(lines):
        if any(needle in line for needle in needles):
            if previous is not None and i > previous + 1:
                print(f"{'':>5}  ...")
            print(f"{first + i:>5}  {line.rstrip()}")
            previous = i
    print()

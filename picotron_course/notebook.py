"""The small helpers every chapter uses for its figures, differences and timings.

One copy here instead of one per chapter; a chapter imports what it needs:

    from picotron_course.notebook import caption, max_diff, slowest_median, sync
"""

from __future__ import annotations

import statistics
import textwrap

import torch


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

"""One timer for both machines: CUDA events on a GPU, a CPU clock in the Triton interpreter.

Used by chapters/09_gpu_kernels.ipynb and benchmarks/kernels.py.

`triton.testing.do_bench` times with the device's events and flushes the L2 cache before each
run (so a bandwidth figure is HBM's, not the cache's). Without a GPU it has no device to ask and
fails; `cpu_do_bench` takes its place, with the same call signature, so it can also be handed to
`@triton.autotune(..., do_bench=cpu_do_bench)`. In the interpreter a kernel's time is the time
Python and numpy take to execute its programs one after another: it measures the interpreter,
not a GPU. Use it to compare versions' *number of programs and operations*, never bandwidth.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from picotron.kernels.runtime import kernel_device

__all__ = ["bench", "cpu_do_bench"]


def cpu_do_bench(fn: Callable[[], object], warmup: int = 1, rep: int = 5, quantiles=None,
                 return_mode: str = "median", **unused) -> float | list[float]:
    """`triton.testing.do_bench` for the CPU: milliseconds per call of `fn`, timed with perf_counter.

    warmup and rep count *calls* here (do_bench's are milliseconds): an interpreted kernel can take
    a second, and a fixed count keeps a chapter's time predictable. Returns the median, or the
    requested quantiles as a list (what @triton.autotune asks for).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(rep, 1)):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if quantiles is not None:
        ordered = sorted(times)
        return [ordered[min(int(q * len(ordered)), len(ordered) - 1)] for q in quantiles]
    return {"median": statistics.median, "mean": statistics.mean, "min": min, "max": max}[return_mode](times)


def bench(fn: Callable[[], object], device: torch.device | str | None = None, warmup: int | None = None,
          rep: int | None = None) -> float:
    """Median milliseconds per call of `fn`, on `device` (default: where the kernels run).

    On a GPU: triton.testing.do_bench, `warmup` and `rep` in milliseconds (default 25 and 100), the
    L2 cache flushed before every call. On the CPU: `cpu_do_bench`, `warmup` and `rep` in calls
    (default 1 and 5).
    """
    device = torch.device(device) if device is not None else kernel_device()
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup or 25, rep=rep or 100, return_mode="median")
    return cpu_do_bench(fn, warmup=1 if warmup is None else warmup, rep=rep or 5)

"""Reading a torch.profiler trace of one training step: when backward computed, when the all-reduces ran.

`torch.profiler.profile(...).export_chrome_trace(path)` writes the step as Chrome trace-event JSON, the
file Perfetto (https://ui.perfetto.dev) and chrome://tracing open. This module reads that file back, so
that a chapter can draw it and assert on it (chapters/02_data_parallel.ipynb):

    trace = json.load(open(path))
    step = read_step(trace)            # times in ms from the start of the "forward" mark
    step.backward_ops                  # [(start, end)] of backward's compute
    step.all_reduces                   # [(start, end)] of the all-reduces, as they really ran
    step.started_during_backward       # how many of them began before backward's last op ended

What marks what in a trace (torch 2.x, Kineto's Chrome format):

- the step's phases are the `record_function("forward")`-style marks the caller puts around them: events
  of category "user_annotation" on the thread that ran them;
- with gloo (CPU ranks), `c10d::allreduce_` on the calling thread is only the *launch*; gloo's worker
  threads run the collective, as spans named `gloo:all_reduce`;
- with NCCL (GPU ranks), the collective is a kernel (category "kernel", named `ncclDevKernel_AllReduce_...`
  or, in older NCCL, `ncclKernel_AllReduce_...`) on NCCL's own CUDA stream; the CPU side only enqueues it;
- backward's compute on a CPU is the autograd engine's `autograd::engine::evaluate_function: ...` spans;
  on a GPU it is the kernels (other than NCCL's) whose launch (a "cuda_runtime" or "cuda_driver" event
  with the same `correlation` id) happened inside the "backward" mark.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["StepTrace", "read_step", "phase_marks", "collectives", "compute_ops"]

_EVALUATE = "autograd::engine::evaluate_function:"


def _spans(trace: dict):
    """The complete events ("ph": "X") of a Chrome trace, with a duration."""
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _is_nccl_kernel(event: dict) -> bool:
    return event.get("cat") == "kernel" and event["name"].lower().startswith("nccl")


def _letters(name: str) -> str:
    return re.sub("[^a-z]", "", name.lower())


def phase_marks(trace: dict, names=("forward", "backward", "finish_gradient_sync", "optimizer")) -> dict:
    """{name: (start us, end us)} of the first `record_function(name)` mark of each of `names` found."""
    marks = {}
    for event in _spans(trace):
        if event.get("cat") == "user_annotation" and event["name"] in names and event["name"] not in marks:
            marks[event["name"]] = (event["ts"], event["ts"] + event["dur"])
    missing = [name for name in names if name not in marks]
    if missing:
        raise ValueError(f"the trace has no record_function mark {missing}: wrap those parts of the step in "
                         f"torch.profiler.record_function(name) while profiling")
    return marks


def collectives(trace: dict, kind: str = "all_reduce") -> list[tuple[float, float]]:
    """[(start us, end us)] of every `kind` collective as the backend ran it, in order of start.

    gloo: its worker threads' `gloo:<kind>` spans. NCCL: the `nccl...` kernels whose name contains the
    kind ("AllReduce" for "all_reduce"). Launches on the calling thread (c10d::allreduce_, nccl:all_reduce,
    record_param_comms) are not counted: they end before the work does.
    """
    want = _letters(kind)
    found = [(e["ts"], e["ts"] + e["dur"]) for e in _spans(trace)
             if (e["name"].startswith("gloo:") and _letters(e["name"][5:]) == want)
             or (_is_nccl_kernel(e) and want in _letters(e["name"]))]
    return sorted(found)


def compute_ops(trace: dict, window: tuple[float, float]) -> list[tuple[float, float]]:
    """[(start us, end us)] of the compute of the `window` (a phase mark), in order of start.

    CPU: the autograd engine's evaluate_function spans inside the window. GPU (the trace has kernels):
    the kernels other than NCCL's whose launch falls inside the window, wherever they ran in time.
    """
    spans = _spans(trace)
    begin, end = window
    kernels = [e for e in spans if e.get("cat") == "kernel" and not _is_nccl_kernel(e)]
    if not kernels:
        return sorted((e["ts"], e["ts"] + e["dur"]) for e in spans
                      if e["name"].startswith(_EVALUATE) and begin <= e["ts"] and e["ts"] + e["dur"] <= end)
    launched = {e["args"]["correlation"]: e["ts"] for e in spans
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    return sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels
                  if begin <= launched.get(k.get("args", {}).get("correlation"), k["ts"]) <= end)


@dataclass
class StepTrace:
    """One profiled step, in ms from the start of its "forward" mark."""

    device: str                                          # "cpu" (gloo) or "cuda" (NCCL kernels)
    marks: dict[str, tuple[float, float]]                # phase -> (start, end)
    backward_ops: list[tuple[float, float]] = field(default_factory=list)
    all_reduces: list[tuple[float, float]] = field(default_factory=list)

    @property
    def backward_end(self) -> float:
        """When backward's last compute op ended (on a GPU: its last kernel, which may end after the mark)."""
        return max(end for _, end in self.backward_ops)

    @property
    def started_during_backward(self) -> int:
        """How many all-reduces began before backward's last compute op ended: overlap, read off the trace."""
        return sum(start < self.backward_end for start, _ in self.all_reduces)

    @property
    def hidden_share(self) -> float:
        """The share of the all-reduces' running time that fell before backward's last op ended."""
        total = sum(end - start for start, end in self.all_reduces)
        inside = sum(max(0.0, min(end, self.backward_end) - start) for start, end in self.all_reduces)
        return inside / total if total else 0.0


def read_step(trace: dict, kind: str = "all_reduce") -> StepTrace:
    """The step of a profiler trace whose phases carry record_function marks ("forward", "backward",
    "finish_gradient_sync", "optimizer"): backward's compute and the `kind` collectives, in ms."""
    marks = phase_marks(trace)
    zero = marks["forward"][0]
    backward = compute_ops(trace, marks["backward"])
    if not backward:
        raise ValueError("no compute op found inside the 'backward' mark: profile with ProfilerActivity.CPU "
                         "(and ProfilerActivity.CUDA on a GPU) and run loss.backward() inside the mark")
    device = "cuda" if any(e.get("cat") == "kernel" for e in _spans(trace)) else "cpu"

    def ms(spans):
        return [((a - zero) / 1e3, (b - zero) / 1e3) for a, b in spans]

    return StepTrace(device, {name: ((a - zero) / 1e3, (b - zero) / 1e3) for name, (a, b) in marks.items()},
                     ms(backward), ms(collectives(trace, kind)))

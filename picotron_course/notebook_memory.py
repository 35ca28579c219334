"""The harness chapter 01 runs, times and draws: listings, step timings, the figures and the calculator.

Chapter 01 (memory) keeps on its reading path the idea, the technique's mechanism in prose (it uses
picotron.model.recompute as a black box: writing it is assignment 01's), each proof's asserts and its
one-line verdict; what only prints, times or draws lives here:

    saved_listing(config, batch, seq)            the tensors one decoder layer saves, one row per storage
    memory_shares_figure(models)                 where a 4096-token step's memory goes, four public shapes
    first_steps_figure(series, phases, starts)   bytes alive over the first steps, phases shaded, peaks marked
    cuda_first_steps(config, batch, seq)         the same steps on CUDA, read from the allocator's history
    cuda_block_bytes(nbytes)                     what the allocator counts for a tensor: 512-byte multiples
    sequence_length_figure(config, modes, ...)   one layer and the whole model against the sequence
    step_seconds(config, batch, seq)             the fastest of a few training steps
    recompute_cost_table(results)                memory, time and FLOPs of each recomputation
    accumulation_figure(counts, peaks)           peak memory against micro-batches per step
    breakdown_bar(ax, ...), fit_figure(), calculator(...)   does it fit in an H100?

Generic helpers (caption, sync, ...) come from picotron_course.notebook.
"""

from __future__ import annotations

import dataclasses
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

from picotron import costs, memory_tracking
from picotron.config import ModelConfig, TrainConfig
from picotron.memory import GiB, estimate_memory
from picotron.model import Llama, loss_fn
from picotron_course.notebook import caption

MiB = 2**20
H100 = 81_559 * MiB  # an "80 GB" H100 as nvidia-smi reports it: 79.6 GiB
COMPONENTS = ("parameters", "gradients", "optimizer state", "activations")
COLOURS = {"parameters": "C0", "gradients": "C1", "optimizer state": "C2", "activations": "C3", "temporaries": "0.75"}


# ---- section 2: what autograd saves ---------------------------------------------------------
def saved_listing(config: ModelConfig, batch: int = 2, seq: int = 16) -> int:
    """Print the tensors layer 0 of a Llama saves for backward, one row per storage with the ops that
    saved it (weights and the RoPE tables left out); return the bytes of those storages."""
    torch.manual_seed(0)
    model = Llama(config)
    x = torch.randn(batch, seq, config.hidden_size, requires_grad=True)   # the layer's input
    cos, sin = model.rope(torch.arange(seq)[None])
    out = model.layers[0](x, cos, sin)
    rows = memory_tracking.saved_tensors(out, exclude=[*model.parameters(), cos, sin])
    storages = {}
    for row in rows:
        storages.setdefault(row.storage, []).append(row)
    print(f"{'shape':<17}{'dtype':<9}{'bytes':>7}   saved by")
    for same in storages.values():
        print(f"{str(same[0].shape):<17}{str(same[0].dtype)[6:]:<9}{same[0].nbytes:>7}   "
              + ", ".join(f"{r.op}.{r.slot}" for r in same))
    return sum(same[0].nbytes for same in storages.values())


# ---- section 1 and 3: figures of the formula and the tracker ---------------------------------
def memory_shares_figure(models: list[str], seq_len: int = 4096) -> None:
    """Stacked shares of parameters, gradients, optimizer state and activations, bf16 mixed, one sequence."""
    breakdowns = [estimate_memory(ModelConfig.preset(m), TrainConfig(micro_batch_size=1, seq_len=seq_len),
                                  precision="bf16-mixed").as_dict() for m in models]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bottom = np.zeros(len(models))
    for part in COMPONENTS:
        share = np.array([100 * b[part] / b["total"] for b in breakdowns])
        ax.bar(models, share, bottom=bottom, color=COLOURS[part], label=part)
        bottom += share
    for i, b in enumerate(breakdowns):
        ax.text(i, 101, f"{b['total'] / GiB:.1f} GiB", ha="center", va="bottom", fontsize=9)
    ax.set(ylabel="share of training memory (%)", xlabel=f"model (bf16 mixed, AdamW, 1 x {seq_len} tokens, sdpa)",
           title="Where the memory of a training step goes", ylim=(0, 112))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    caption(fig, "Small models at long sequences are mostly activations; large ones mostly optimizer state. "
            f"Totals above the bars: the 8B model needs nearly twice an H100's {H100 / GiB:.1f} GiB.")
    plt.show()


def first_steps_figure(series: dict[str, list[int]], phases: list[tuple[int, str]], step_starts: list[int],
                       title: str, note: str) -> list[int]:
    """Bytes alive after every allocation and free, stacked by kind (one kind: the allocator's total), with
    the phases shaded, each step labelled and its peak marked; returns the peak of each step."""
    events = np.arange(len(next(iter(series.values()))))
    peaks = memory_tracking.step_peaks(series, step_starts)
    total = sum(np.array(values) for values in series.values())
    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.stackplot(events, [np.array(values) / MiB for values in series.values()], labels=list(series),
                 colors=[COLOURS.get(kind, "0.55") for kind in series])
    shades = {"forward": "white", "backward": "#e6edf8", "optimizer": "#fbf1d5"}
    bounds = phases + [(events[-1], "end")]
    for (begin, phase), (end, _) in zip(bounds, bounds[1:]):
        ax.axvspan(begin, end, color=shades[phase], zorder=-1)
    top = total.max() / MiB * 1.25
    ends = [*step_starts[1:], len(events)]
    for step, (begin, end, peak) in enumerate(zip(step_starts, ends, peaks)):
        at = begin + int(np.argmax(total[begin:end]))
        ax.axvline(begin, color="0.3", lw=0.8)
        ax.text(begin + len(events) * 0.005, top * 0.97, f"step {step + 1}", fontsize=9, va="top", weight="bold")
        ax.plot(at, peak / MiB, "kv", ms=6)
        ax.annotate(f"peak {peak / MiB:.1f} MiB", (at, peak / MiB), textcoords="offset points", xytext=(4, 6),
                    fontsize=8)
    ax.set(xlabel="allocation and free events (time order)", ylabel="bytes alive (MiB)", ylim=(0, top),
           xlim=(0, events[-1]), title=title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=5)   # under the axis, off the peaks
    caption(fig, "Background white: forward, blue: backward, yellow: optimizer step. " + note)
    plt.show()
    return peaks


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a tensor of `nbytes`: a block of a multiple of 512 bytes
    (its kMinBlockSize), at least one."""
    return max(1, -(-nbytes // 512)) * 512


def cuda_first_steps(config: ModelConfig, batch: int, seq: int, steps: int = 3) -> tuple:
    """`steps` AdamW steps of a new Llama on the current CUDA device, with the caching allocator recording its
    history (torch.cuda.memory._record_memory_history). Returns ({"allocated": bytes after every event},
    [(event, phase)], [event at which each step began], snapshot); the events are the allocator's allocs
    and completed frees. Phase starts are found by counting allocations: memory_stats' cumulative
    "allocation.all.allocated" rises by one per "alloc" entry of the history."""
    def allocations() -> int:
        return torch.cuda.memory_stats()["allocation.all.allocated"]

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")  # every alloc and free
    first, marks, starts = allocations(), [], []
    torch.manual_seed(0)
    model = Llama(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), device="cuda")
    for _ in range(steps):
        starts.append(allocations() - first)
        optimizer.zero_grad(set_to_none=True)
        marks.append((allocations() - first, "forward"))
        loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
        marks.append((allocations() - first, "backward"))
        loss.backward()
        del loss
        marks.append((allocations() - first, "optimizer"))
        optimizer.step()
    torch.cuda.synchronize()
    made = allocations() - first
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)             # stop recording
    del model, optimizer
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    if sum(entry["action"] == "alloc" for entry in trace) != made:
        raise RuntimeError(f"the allocator's history holds {sum(e['action'] == 'alloc' for e in trace)} allocations "
                           f"of the {made} made: raise max_entries so that it keeps them all")
    allocated, alloc_index, series = 0, [], []                         # alloc_index[k]: event of the k-th alloc
    for entry in trace:
        if entry["action"] in ("alloc", "free_completed"):
            if entry["action"] == "alloc":
                alloc_index.append(len(series))
            allocated += entry["size"] if entry["action"] == "alloc" else -entry["size"]
            series.append(allocated)

    def event(count: int) -> int:                                      # the event of the count-th allocation
        return alloc_index[count] if count < len(alloc_index) else len(series) - 1

    return ({"allocated": series}, [(event(count), phase) for count, phase in marks],
            [event(count) for count in starts], snapshot)


def sequence_length_figure(config: ModelConfig, modes: dict, seqs, measured: dict) -> None:
    """Left: one layer's activations, formula (lines) and `measured[mode]` at `seqs` (dots); right: the
    whole model's training memory, against the sequence length, for each mode's config changes."""
    lines = np.geomspace(512, 32768, 40).astype(int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (mode, changes) in enumerate(modes.items()):
        changed = dataclasses.replace(config, **changes)
        formula = [costs.activation_bytes_per_layer(changed, 1, int(s), dtype_bytes=2) / GiB for s in lines]
        style = dict(lw=5, alpha=0.4) if mode == "sdpa" else {}   # sdpa lies under selective: drawn wide
        left.plot(lines, formula, "-", color=f"C{i}", label=f"{mode}, formula", **style)
        left.plot(seqs, np.array(measured[mode]) / GiB, "o", color=f"C{i}")
        total = [estimate_memory(changed, TrainConfig(micro_batch_size=1, seq_len=int(s)),
                                 precision="bf16-mixed").total / GiB for s in lines]
        right.plot(lines, total, "-", color=f"C{i}", label=mode, **style)
    left.set(xlabel="sequence length (tokens)", ylabel="activations of one layer (GiB)", xlim=(0, 8400), ylim=(0, 6),
             title="One Llama-3-8B layer, bf16, batch 1 (dots: measured)")
    right.axhline(H100 / GiB, color="k", ls="--", lw=1, label=f"H100, {H100 / GiB:.1f} GiB")
    right.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="training memory (GiB)",
              title="Whole model, bf16 mixed, AdamW, batch 1")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    caption(fig, "Left: eager attention's memory bends upwards (the s² probabilities); sdpa and selective recomputation "
            "are the same straight line (up to sdpa's small log-sum-exp); full recomputation keeps only the layer "
            "inputs. Right: the 120 GiB of state alone exceed one GPU at any length.")
    plt.show()


# ---- section 4: what recomputation costs -----------------------------------------------------
def step_seconds(config: ModelConfig, batch: int, seq: int, steps: int = 6) -> float:
    """The fastest of `steps` - 1 AdamW training steps (the first allocates the optimizer state; the
    fastest is the least disturbed by whatever else runs on the machine)."""
    torch.manual_seed(0)
    model = Llama(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def recompute_cost_table(results: dict) -> None:
    """Print activations (formula, measured, share of no recomputation), step time and FLOPs ratio of each
    (attention, recompute) in `results`: {(attention, recompute): dict(formula, measured, seconds, flops)}."""
    print(f"{'':<17}{'activations (MiB)':>19}{'':>9}{'step time':>11}{'time':>7}{'FLOPs':>7}")
    print(f"{'':<17}{'formula':>10}{'measured':>10}{'vs none':>9}{'(ms)':>11}{'x':>7}{'x':>7}")
    for (attention, recompute), r in results.items():
        none = results[attention, "none"]
        print(f"{attention + ', ' + recompute:<17}{r['formula'] / MiB:>10.2f}{r['measured'] / MiB:>10.2f}"
              f"{r['measured'] / none['measured']:>9.0%}{r['seconds'] * 1e3:>11.1f}"
              f"{r['seconds'] / none['seconds']:>7.2f}{r['flops'] / none['flops']:>7.2f}")


# ---- section 5: gradient accumulation --------------------------------------------------------
def accumulation_figure(counts: list[int], peaks: list[int], tokens: list[int]) -> None:
    """Measured peak memory and tokens per optimizer step against the number of micro-batches."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(counts, np.array(peaks) / MiB, "o-", label="peak memory (measured)")
    ax.set(xlabel="micro-batches per optimizer step", ylabel="peak memory (MiB)", xticks=counts,
           ylim=(0, max(peaks) / MiB * 1.3), title="Gradient accumulation: more tokens per step, same memory")
    twin = ax.twinx()
    twin.plot(counts, tokens, "s--", color="C1", label="tokens per step")
    twin.set(ylabel="tokens per optimizer step", ylim=(0, max(tokens) * 1.3))
    fig.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.12, 0.88))
    caption(fig, "The peak is flat from 2 micro-batches on, while tokens per step grow 8x. One micro-batch peaks lower: "
            "no gradient exists yet during its forward; from the second on, the first one's gradients do.")
    plt.show()


# ---- section 6: the calculator ---------------------------------------------------------------
def breakdown_bar(ax, model="llama3-8b", seq_len=4096, micro_batch=1, precision="bf16-mixed", attention="sdpa",
                  recompute="none", label=None):
    """One horizontal bar of estimate_memory's four parts, with its total and whether it fits an H100."""
    config = dataclasses.replace(ModelConfig.preset(model), attention=attention, recompute=recompute)
    m = estimate_memory(config, TrainConfig(micro_batch_size=micro_batch, seq_len=seq_len), precision=precision)
    row, left = label or model, 0.0
    for part, value in zip(COMPONENTS, (m.parameters, m.gradients, m.optimizer, m.activations)):
        ax.barh(row, value / GiB, left=left, color=COLOURS[part], label=part)
        left += value / GiB
    ax.text(left, row, f" {left:.1f} GiB: {'fits' if m.total <= H100 else 'does NOT fit'}", va="center", fontsize=9)
    return m


def fit_figure() -> None:
    """Llama-3-8B at 4096 tokens with eager attention, sdpa, and sdpa with full recomputation; SmolLM-1.7B."""
    fig, ax = plt.subplots(figsize=(10, 3.2))
    breakdown_bar(ax, "smollm-1.7b", label="smollm-1.7b, sdpa")
    breakdown_bar(ax, recompute="full", label="llama3-8b, sdpa, full recompute")
    breakdown_bar(ax, label="llama3-8b, sdpa")
    breakdown_bar(ax, attention="eager", label="llama3-8b, eager")
    ax.axvline(H100 / GiB, color="k", ls="--", lw=1)
    handles, names = ax.get_legend_handles_labels()
    ax.legend(handles[:4], names[:4], fontsize=8, loc="lower right")
    ax.set(xlabel="training memory per GPU (GiB)", xlim=(0, 240),
           title="bf16 mixed, AdamW, 1 x 4096 tokens per GPU (dashed: one H100)")
    caption(fig, "Attention kernels and recomputation shrink only the red part; Llama-3-8B's 120 GiB of weights, "
            "gradients and optimizer state still do not fit. That part needs sharding over GPUs (ZeRO, chapter 03).")
    plt.show()


def calculator(model="llama3-8b", seq_len=4096, micro_batch=1, precision="bf16-mixed", attention="sdpa",
               recompute="none") -> None:
    """One bar for the widget's choice, against one H100."""
    fig, ax = plt.subplots(figsize=(10, 1.9))
    m = breakdown_bar(ax, model, seq_len, micro_batch, precision, attention, recompute)
    ax.axvline(H100 / GiB, color="k", ls="--", lw=1)
    ax.set(xlabel="training memory per GPU (GiB)", xlim=(0, max(m.total / GiB, H100 / GiB) * 1.35),
           title=f"{model}, {precision}, {micro_batch} x {seq_len} tokens, {attention}, recompute={recompute}")
    ax.legend(fontsize=7, loc="lower right", ncols=4)
    caption(fig, f"{'Fits' if m.total <= H100 else 'Does not fit'} in one H100 (dashed, {H100 / GiB:.1f} GiB), "
            "before temporaries and allocator overhead.")
    plt.show()

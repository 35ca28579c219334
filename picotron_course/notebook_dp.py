"""The harness chapter 02 runs, times and draws: data parallelism's proofs, measurements and figures.

Chapter 02 (data parallelism) keeps on its reading path the idea, the technique's key code (NaiveDP,
the hooks' order, OverlappedDP, a gradient view, Bucket and BucketedDP, no_sync), each proof's
asserts and its one-line verdict. What only runs, records, times or draws lives here:

    parts(dp, model)                              (module to call, no_sync, finish) of any gradient sync
    first_step(make, new_model, loader, n)        one step on a rank, checked against one process on rank 0
    prove(variants, new_model, loader, ...)       every variant in lockstep with one process (picotron.lockstep)
    step_times(variants, new_model, loader)       step times and waits, round-robin, on a rank
    times_of(per_rank, name, which)               one variant's times, rank by rank
    bytes_per_step(variants, new_model, loader)   all-reduce calls and bytes of one step, and a ring's sends
    idea_figure, step_time_figure, trace_figure, sweep_figure, exposed_figure,
    limits_figure                                 the chapter's figures, one function each (the proof's
                                                  is picotron.lockstep's figure)

A variant is `make(model) -> gradient sync`: None (no communication), torch's DistributedDataParallel,
or an object with finish_gradient_sync() and, optionally, no_sync() (the chapter's classes, picotron's).
The functions that run on ranks take the chapter's own `new_model` and `loader` as arguments (they
travel to the ranks by value). matplotlib is imported inside the figure functions, so the ranks never
load it. Generic helpers (caption, take_turns, slowest_median) come from picotron_course.notebook.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron import comm, tolerance
from picotron.launch import device
from picotron.lockstep import Recorder, Trace
from picotron.model import loss_fn
from picotron_course.notebook import caption, take_turns

__all__ = ["parts", "first_step", "prove", "step_times", "times_of", "bytes_per_step",
           "idea_figure", "step_time_figure", "trace_figure", "sweep_figure", "exposed_figure", "limits_figure"]


# ---- running the variants on ranks --------------------------------------------------------------

def parts(dp, model):
    """(module to call, no_sync context, finish) of the gradient sync `dp` of `model`."""
    if dp is None:
        return model, nullcontext, lambda: None
    if isinstance(dp, DistributedDataParallel):  # it all-reduces inside backward
        return dp, dp.no_sync, lambda: None
    return model, getattr(dp, "no_sync", nullcontext), dp.finish_gradient_sync


def first_step(make, new_model, loader, roundings: int) -> dict:
    """On a rank: one forward and backward of its shard with the sync `make(model)`, then its finish.

    Returns "matches" (on rank 0: every gradient equals a plain model's on the whole global batch
    within `roundings` float32 roundings, picotron.tolerance; True on the others), "sync_s" (seconds
    in the finish after backward), "launched" (all-reduces started during backward) and "buckets".
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = new_model()
    dp = make(model)
    module, _, finish = parts(dp, model)
    batch = loader(rank, world).get_batch(step=0).to(device())         # this rank's shard of the batch
    with comm.counting() as counter:
        loss_fn(module(batch.input_ids), batch.targets).backward()
        launched = counter.calls["all_reduce"]
        start = time.perf_counter()
        finish()
        seconds = time.perf_counter() - start
    matches = True
    if rank == 0:
        reference = new_model()
        whole = loader(0, 1).get_batch(step=0).to(device())             # all the sequences of the step
        loss_fn(reference(whole.input_ids), whole.targets).backward()
        matches = all(tolerance.close_enough(p.grad, q.grad, n=roundings)
                      for p, q in zip(model.parameters(), reference.parameters()))
    return {"matches": matches, "sync_s": seconds, "launched": launched, "buckets": len(getattr(dp, "buckets", []))}


def _replica(make, new_model, data, accum: int, lr: float) -> dict:
    model = new_model()
    module, no_sync, finish = parts(make(model) if make else None, model)
    return {"model": model, "module": module, "no_sync": no_sync, "finish": finish, "data": data, "accum": accum,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)}


def _backward(replica: dict, step: int, world: int) -> float:
    """Forward and backward of every micro-batch of a step, then the sync; the loss of the global batch."""
    loss_sum, accum = torch.zeros((), device=device()), replica["accum"]
    for micro in range(accum):
        batch = replica["data"].get_batch(step, micro).to(device())
        with replica["no_sync"]() if micro < accum - 1 else nullcontext():
            loss = loss_fn(replica["module"](batch.input_ids), batch.targets) / accum
            loss.backward()
        loss_sum += loss.detach()
    replica["finish"]()                                               # now .grad holds the mean over ranks
    if world > 1:
        dist.all_reduce(loss_sum)                                     # the global loss, for the comparison only
        loss_sum /= world
    return loss_sum.item()


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def prove(variants: dict, new_model, loader, steps: int, accum: dict | None = None, pairs=(),
          lr: float = 3e-3) -> dict:
    """Train every variant side by side on this rank for `steps` AdamW steps, in lockstep with one process
    (picotron.lockstep): rank 0 also trains plain models on the whole global batch, the one-process references
    (one per micro-batch count), and broadcasts their losses, so that every rank compares every step's global
    loss; rank 0 also compares each step's gradients after the sync, and the weights after the last step.

    variants: {name: make}; accum: {name: micro-batches per step} (1 if absent). Gradients are zeroed
    in place (`zero_grad(set_to_none=False)`), which bucket views need. Returns
    "lockstep": {name: its Lockstep against one process};
    "one process": {micro-batches per step: that reference's losses (a Trace)};
    "pairs": {(a, b): b's Lockstep against a, the two variants' losses, gradients and weights compared step by
        step on every rank};
    "replica_diff": {name: the largest difference of this replica's weights from rank 0's}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    accum = accum or {}
    counts = sorted({1, *accum.values()})
    replicas = {name: _replica(make, new_model, loader(rank, world), accum.get(name, 1), lr)
                for name, make in variants.items()}
    references = {k: _replica(None, new_model, loader(0, 1), k, lr) for k in counts} if rank == 0 else {}
    traces = {k: Recorder() for k in counts}                          # rank 0: losses and gradients; else losses
    records = {name: Recorder(traces[replica["accum"]].trace) for name, replica in replicas.items()}
    kept = {a: Recorder() for a, _ in pairs}                          # a's own record, for b to be compared with
    pair_records = {(a, b): Recorder(kept[a].trace) for a, b in pairs}
    for step in range(steps):
        ref_losses = torch.tensor([_backward(references[k], step, 1) for k in counts] if rank == 0 else
                                  [0.0] * len(counts), dtype=torch.float64, device=device())
        dist.broadcast(ref_losses, src=0)                             # every rank compares its losses with them
        for k, loss in zip(counts, ref_losses):
            traces[k].step(loss, _grads(references[k]["model"]) if rank == 0 else None)
        losses = {name: _backward(replica, step, world) for name, replica in replicas.items()}
        for name, replica in replicas.items():                        # every rank holds the averaged gradients
            records[name].step(losses[name], _grads(replica["model"]))
            if name in kept:
                kept[name].step(losses[name], _grads(replica["model"]))
        for (_, b), record in pair_records.items():
            record.step(losses[b], _grads(replicas[b]["model"]))
        for recorder in [*traces.values(), *kept.values()]:
            recorder.trace.grads[step] = None                         # compared by every variant: free them
        for replica in [*replicas.values(), *references.values()]:
            replica["optimizer"].step()
            replica["optimizer"].zero_grad(set_to_none=False)
    for k, trace in traces.items():
        trace.finish(_weights(references[k]["model"]) if rank == 0 else None)
    out = {"lockstep": {}, "one process": {k: Trace(loss=t.trace.loss) for k, t in traces.items()},
           "replica_diff": {}}
    weights = {name: _weights(replica["model"]) for name, replica in replicas.items()}
    for name, recorder in kept.items():
        recorder.finish(weights[name])
    for name, record in records.items():
        out["lockstep"][name] = record.finish(weights[name])
        flat = torch.cat([w.flatten() for w in weights[name].values()])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)                                  # every replica must hold rank 0's weights
        out["replica_diff"][name] = (flat - rank0).abs().max().item()
    out["pairs"] = {(a, b): record.finish(weights[b]) for (a, b), record in pair_records.items()}
    return out


def step_times(variants: dict, new_model, loader, reps: int = 5, steps: int = 2) -> dict:
    """{name: [(seconds per step, seconds per step waiting in the finish) per repetition]} on this rank.

    Every variant gets its own model and AdamW; they are timed round-robin, so that the machine's
    changing load hits them alike: a repetition is `steps` steps behind a barrier, after a warm-up round.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = loader(rank, world).get_batch(0).to(device())
    runners = {}
    for name, make in variants.items():
        model = new_model()
        module, _, finish = parts(make(model) if make else None, model)
        runners[name] = (module, finish, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(name) -> float:
        module, finish, optimizer = runners[name]
        loss_fn(module(batch.input_ids), batch.targets).backward()
        start = time.perf_counter()
        finish()
        waited = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return waited

    def repetition(name) -> float:                                    # `steps` steps: seconds waiting per step
        return sum(step(name) for _ in range(steps)) / steps

    return {name: [(seconds / steps, waited) for seconds, waited in runs]      # warm-up: one round of `steps`
            for name, runs in take_turns(repetition, runners, reps).items()}


def times_of(per_rank: list, name, which: int = 0) -> list[list[float]]:
    """[r][i]: rank r's i-th repetition of `name` from step_times: step time (which=0) or waiting (1)."""
    return [[rep[which] for rep in rank[name]] for rank in per_rank]


def bytes_per_step(variants: dict, new_model, loader) -> dict:
    """{name: (all-reduce calls, their payload bytes, bytes a ring all-reduce of the same gradients sends)}
    for one step of each variant on this rank, counted by picotron.comm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = loader(rank, world).get_batch(0).to(device())
    out = {}
    for name, make in variants.items():
        model = new_model()
        module, _, finish = parts(make(model), model)
        with comm.counting() as counter:                              # the step only, not a set-up broadcast
            loss_fn(module(batch.input_ids), batch.targets).backward()
            finish()
        with comm.counting() as wire:                                 # the same bytes through a ring, sends counted
            comm.ring_all_reduce(torch.cat([p.grad.flatten() for p in model.parameters()]))
        out[name] = (counter.calls["all_reduce"], counter.bytes["all_reduce"], wire.bytes["send"])
    return out


# ---- the figures ---------------------------------------------------------------------------------

def idea_figure(world: int, sequences_per_rank: int) -> None:
    """Data parallelism in one picture: shards in, a full model per rank, one all-reduce, the same step."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for r in range(world):
        y, colour = world - 1 - r, plt.cm.tab10(r)
        ax.add_patch(plt.Rectangle((0, y - 0.3), 1.4, 0.6, color=colour, alpha=0.35))
        ax.text(0.7, y, f"batch shard {r}\n{sequences_per_rank} sequences", ha="center", va="center", fontsize=8)
        ax.add_patch(plt.Rectangle((2.0, y - 0.3), 1.8, 0.6, color="0.85"))
        ax.text(2.9, y, "full model copy\nforward + backward", ha="center", va="center", fontsize=8)
        ax.annotate("", (2.0, y), (1.4, y), arrowprops=dict(arrowstyle="->"))
        ax.text(4.7, y, rf"$g_{r}$", ha="center", va="center", fontsize=12, color=colour)
        ax.annotate("", (4.4, y), (3.8, y), arrowprops=dict(arrowstyle="->"))
        ax.annotate("", (6.0, (world - 1) / 2), (5.0, y), arrowprops=dict(arrowstyle="->", color="0.5"))
        ax.annotate("", (8.4, y), (7.6, (world - 1) / 2), arrowprops=dict(arrowstyle="->", color="0.5"))
        ax.text(9.2, y, "same step\nsame weights", ha="center", va="center", fontsize=8)
    middle = (world - 1) / 2
    ax.add_patch(plt.Rectangle((6.0, middle - 0.6), 1.6, 1.2, color="C3", alpha=0.2))
    ax.text(6.8, middle, "all-reduce\n" + r"$\frac{1}{N}\sum_r g_r$", ha="center", va="center", fontsize=10)
    ax.set(xlim=(-0.2, 10), ylim=(-0.6, world - 0.4), xticks=[], yticks=range(world),
           yticklabels=[f"rank {r}" for r in reversed(range(world))], xlabel="one training step, left to right",
           title="Data parallelism: split the batch, average the gradients")
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    caption(fig, "Each rank computes the gradient g_r of its own shard; one all-reduce averages them into the "
            "gradient of the whole batch, so every replica takes the same step.")
    plt.show()


def step_time_figure(step_ms: dict, spread: dict, title: str) -> None:
    """Bars of the median step time per variant, dots for each repetition, the compute floor dotted."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = list(step_ms)
    ax.bar(names, [step_ms[n] for n in names], color=["0.6", "C3", "C1", "C2", "C0"][:len(names)], alpha=0.8)
    for i, n in enumerate(names):
        ax.plot([i] * len(spread[n]), spread[n], "k.", ms=4)
        ax.text(i, step_ms[n], f"{step_ms[n]:.0f} ms", ha="center", va="bottom", fontsize=9)
    ax.axhline(step_ms["no communication"], color="0.4", ls=":", lw=1)
    ax.set(ylabel="time per step (ms)", title=title)
    caption(fig, f"Bars: median of {len(spread[names[0]])} repetitions (dots: each repetition, slowest rank). "
            f"Bucketing removes most of the communication cost: {step_ms['naive'] / step_ms['bucketed']:.1f}x faster "
            "than one all-reduce per parameter; the dotted line is the compute floor.")
    plt.show()


def trace_figure(steps: dict, bucket_mb: float, backend: str) -> None:
    """Per rank, backward's compute ops and the all-reduces as the profiler recorded them (picotron.profiling's
    StepTrace); `steps[overlap]` is one StepTrace per rank, overlap True on top, False below."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 1, figsize=(11, 7))
    phase_colours = {"forward": "0.82", "backward": "#b9d6ee", "finish_gradient_sync": "#f2b8b8", "optimizer": "0.6"}
    for ax, overlap in zip(axes, (True, False)):
        world = len(steps[overlap])
        for rank, step in enumerate(steps[overlap]):
            top = (world - 1 - rank) * 2.0                          # three rows per rank: phases, compute, comms
            for name, (a, b) in step.marks.items():
                ax.broken_barh([(a, b - a)], (top + 0.45, 0.25), color=phase_colours[name],
                               label=f"mark: {name}" if rank == 0 else None)
            ax.broken_barh([(a, b - a) for a, b in step.backward_ops], (top - 0.1, 0.4), color="C0",
                           label="backward compute op" if rank == 0 else None)
            for i, (a, b) in enumerate(step.all_reduces):           # alternate rows: gloo runs two at once
                ax.broken_barh([(a, b - a)], (top - 0.75 + 0.2 * (i % 2), 0.18), color="C3",
                               label="all-reduce, as the backend ran it" if rank == i == 0 else None)
            ax.plot([step.backward_end] * 2, [top - 0.8, top + 0.75], "k--", lw=0.8,
                    label="backward's last op ends" if rank == 0 else None)
        ax.set_yticks([(world - 1 - r) * 2.0 + k for r in range(world) for k in (0.1, -0.55)],
                      [f"rank {r} {what}" for r in range(world) for what in ("backward", "all-reduces")], fontsize=7)
        started = sum(step.started_during_backward for step in steps[overlap])
        how = "launched from the hooks (overlap=True)" if overlap else "launched after backward (overlap=False)"
        ax.set_title(f"Profiler trace of one step, buckets of {bucket_mb:g} MiB, {how}: {started} of "
                     f"{sum(len(s.all_reduces) for s in steps[overlap])} all-reduces start during backward", fontsize=9)
        end = max(max(b for _, b in s.marks.values()) for s in steps[overlap])
        ax.set_xlim(0, end * 1.35)                                    # each its own scale; room for the legend
        ax.set_xlabel("time since the rank's forward began (ms), read from the trace", fontsize=8)
    axes[0].legend(fontsize=7, loc="upper right")
    caption(fig, f"{backend}. Top: the first buckets' all-reduces run while backward still computes (left of the "
            "dashed line). Bottom: nothing is sent until backward is over. With gloo the all-reduces are spans of "
            "gloo's worker threads, with NCCL kernels on NCCL's own stream; open the JSON files in ui.perfetto.dev "
            "to see every op.")
    plt.show()


def sweep_figure(sweep_mb: list, sweep_ms: list, sweep_wait: list, counts: list, floor_ms: float,
                 world: int) -> None:
    """Step time and exposed wait against the bucket size (0 MiB: one bucket per parameter, drawn at the left)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    x = [max(mb, sweep_mb[1] / 3) for mb in sweep_mb]
    ax.semilogx(x, sweep_ms, "o-", color="C0", label="step time")
    ax.semilogx(x, sweep_wait, "s--", color="C3", label="waiting in finish_gradient_sync")
    ax.axhline(floor_ms, color="0.4", ls=":", lw=1, label="no communication (4.1)")
    for xi, ms, count in zip(x, sweep_ms, counts):
        ax.annotate(f"{count}", (xi, ms), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xticks(x, ["per\nparam"] + [f"{mb:g}" for mb in sweep_mb[1:]], fontsize=8)
    ax.set(xlabel="bucket size (MiB)", ylabel="time per step (ms)", ylim=(0, None),
           title=f"Bucket size sweep, {world} ranks (numbers: how many buckets)")
    ax.legend(fontsize=8)
    caption(fig, "Small buckets are latency-bound: each all-reduce costs milliseconds here, so time falls as the count "
            "falls. On this CPU communication cannot run beside compute for free, so the curve flattens instead of "
            "rising again at one bucket; the model below shows the GPU case.")
    plt.show()


def exposed_figure(exposed_seconds, grad_bytes: float, backward_s: float, links: dict, world: int) -> None:
    """The computed exposed communication against the bucket size, one curve per link {label: (W, alpha)}."""
    import matplotlib.pyplot as plt
    import numpy as np
    bucket_sizes = np.geomspace(2**16, grad_bytes, 40)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for (label, (busbw, alpha)), colour in zip(links.items(), ("C2", "C4")):
        exposed = [exposed_seconds(grad_bytes, b, backward_s, busbw, alpha, world) * 1e3 for b in bucket_sizes]
        best = bucket_sizes[int(np.argmin(exposed))]
        ax.loglog(bucket_sizes / 2**20, exposed, "-", color=colour, label=f"{label} (best ~{best / 2**20:.0f} MiB)")
    ax.axvline(25, color="0.5", ls=":", lw=1, label="torch DDP default, 25 MiB")
    ax.set(xlabel="bucket size (MiB)", ylabel="exposed communication (ms)",
           title=f"Model: communication left after backward, {grad_bytes / 1e9:.1f} GB of gradients")
    ax.legend(fontsize=8)
    caption(fig, "Computed, not measured. Left wall: thousands of tiny buckets queue up behind their latencies. Right "
            "wall: one huge bucket starts only after backward, so all of it is exposed. DDP's 25 MiB sits in the "
            "valley.")
    plt.show()


def limits_figure(gpus, compute, all_reduce, models: dict, title: str, gpu_gb: float = 80) -> int:
    """Left: compute and all-reduce seconds per step against the GPU count; right: 16 Psi bytes per model.
    Returns the first GPU count at which the all-reduce outlasts the compute."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4))
    ax_t.loglog(gpus, compute, "o-", label="compute per step (6ΨT/R)")
    ax_t.loglog(gpus, all_reduce, "s-", color="C3", label="gradient all-reduce (2(N-1)/N · 2Ψ / W)")
    ax_t.set(xlabel="GPUs N (data parallel)", ylabel="seconds per step", title=title)
    ax_t.legend(fontsize=8)
    ax_m.bar(list(models), [16 * p / 1e9 for p in models.values()], color="C0", alpha=0.8)
    ax_m.axhline(gpu_gb, color="C3", ls="--", label=f"H100 memory, {gpu_gb:g} GB")
    ax_m.set_yscale("log")
    ax_m.set(ylabel="GB per GPU (16Ψ, before activations)", title="Data parallelism: every GPU holds everything")
    ax_m.legend(fontsize=8)
    crossover = int(gpus[np.argmax(all_reduce > compute)])
    caption(fig, f"Computed from the formulas above (not measured). Left: from about {crossover} GPUs on, the "
            "all-reduce outlasts the whole step's compute, so no overlap can hide it. Right: beyond ~5B parameters "
            "the model no longer fits on one GPU at all.")
    plt.show()
    return crossover

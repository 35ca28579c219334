"""The harness chapter 06 runs, times and draws: pipeline timelines, the proofs on ranks, the timed
schedules, and the figures.

Chapter 06 (chapters/06_pipeline_parallel.ipynb) keeps the technique in front of the reader: two
stages cut from one model, the send and the receive between them, a loop that runs a schedule
written as data, picotron's schedules, and one training step of a stage. What feeds those cells,
runs the proofs on ranks, times the schedules and draws them lives here:

    gradient_roundings                           the n of picotron.tolerance for a gradient, split or not
    new_model, adamw, one_process_grads          the shared model, optimizer and one-process reference
    step_time, mean_bubble, gantt, op_legend     a timeline's arithmetic, and its drawing: a bar per action
    idea_figure, simulated_figure                where the layers live and the bubble (1); simulated timelines
    show_two_stages, show_two_schedules          the per-rank tables behind section 2's pass lines
    train_one_process, prove, expected_comm      every schedule against one process and torch, on ranks (3),
                                                 compared by picotron.lockstep, whose figure the chapter draws
    whole_runs, show_proof                       the ranks' comparisons as one per case, and the proof's table (3)
    WaitingStage, measure                        stages that sleep, and the real model, timed on ranks (4)
    waiting_figure, real_figure, bubble_figure,  section 4's figures, and the tables behind them
    memory_rows, memory_figure, show_*
    limits_figure, explorer                      the formulas at Llama 3 405B's scale (5); the widgets' figure (6)

Symbols as in the chapter: p stages, m micro-batches, v chunks per rank; T_F, T_B, T_W the time of one
F, B and W action (`simulate` calls them f, b, w).

Every function takes its sizes as arguments: the chapter picks them from picotron_course.settings.
The rank functions (`prove`, `measure`) are module-level, so `run` sends them by reference; the
chapter's own step function travels to them as an argument. matplotlib is imported inside the
drawing functions, so the ranks never load it.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from picotron import comm, lockstep, tolerance
from picotron.data import DataLoader
from picotron.launch import device
from picotron.memory_tracking import MemoryTracker
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import all_reduce_gradients
from picotron.parallel.pipeline_parallel import (Timeline, build_stages, run_schedule, split_microbatches,
                                                 stage_parameters)
from picotron.parallel.pipeline_schedules import (SCHEDULES, bubble_formula, bubble_fraction, make_schedule,
                                                  peak_in_flight, simulate)
from picotron_course.notebook import caption, max_diff

OP_COLOURS = {"F": "C0", "B": "C1", "W": "C2"}
RANK_COLOURS = ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb"]
MiB = 2**20


# ---- the model, the optimizer, the one-process reference -----------------------------------------
def gradient_roundings(config, seq: int, batch: int, microbatches: int, replicas: int) -> int:
    """n of picotron.tolerance (the roundings behind one number) for any gradient of a Llama of `config` over
    `batch` sequences of `seq` tokens, however a pipeline splits the work: the model's own forward and backward
    (tolerance.llama_roundings), plus what the split adds: the shares of up to `microbatches` micro-batches
    accumulated and divided, those of `replicas` data-parallel replicas averaged, and the tied matrix's second
    share. The bound on a float32 difference is then 8 sqrt(n) u x the largest value."""
    return tolerance.llama_roundings(config, seq, batch * seq) + microbatches + replicas + 1


def new_model(config):
    """The same weights on every rank and in one process."""
    torch.manual_seed(0)
    return Llama(config)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def one_process_grads(config, dataset, batch: int) -> tuple[float, dict]:
    """One process, the whole first batch at once: its loss and every parameter's gradient, by name."""
    model, data = new_model(config), DataLoader(dataset, batch).get_batch(0)
    loss = loss_fn(model(data.input_ids), data.targets)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


# ---- timelines -----------------------------------------------------------------------------------
def step_time(events) -> float:
    """From the first action's start to the last one's end, on any rank."""
    return max(e.end for e in events) - min(e.start for e in events)


def mean_bubble(events) -> float:
    """Idle time over the step's time (`bubble_fraction`), averaged over the ranks."""
    return float(np.mean(bubble_fraction(events)))


def gantt(ax, events, pp: int, scale: float = 1.0, unit: str = "units of $T_F$, one forward") -> None:
    """One bar per action: its rank on the y axis, its start and end on the x axis, its micro-batch inside.
    Under the interleaved schedule a rank's second chunk is drawn paler."""
    t0, t1 = min(e.start for e in events), max(e.end for e in events)
    for e in events:
        ax.barh(e.rank, (e.end - e.start) * scale, left=(e.start - t0) * scale, height=0.75, color=OP_COLOURS[e.op],
                alpha=1.0 if e.stage < pp else 0.45, edgecolor="k", lw=0.3)
        if e.end - e.start > 0.012 * (t1 - t0):          # room for a label
            ax.text(((e.start + e.end) / 2 - t0) * scale, e.rank, e.microbatch, ha="center", va="center", fontsize=6)
    ax.set(xlim=(0, (t1 - t0) * scale), ylim=(pp - 0.5, -0.5), xlabel=f"time ({unit})")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)], fontsize=8)


def op_legend(ax, ops: str = "FB", paler: bool = False, **kwargs) -> None:
    from matplotlib.patches import Patch
    names = {"F": "F: forward", "B": "B: backward" + (" (ZB-H1: input gradient only)" if "W" in ops else ""),
             "W": "W: weight gradient (ZB-H1)"}
    handles = [Patch(color=OP_COLOURS[op], label=names[op]) for op in ops]
    if paler:
        handles.append(Patch(facecolor="0.5", alpha=0.45, label="a rank's second chunk"))
    ax.legend(handles=handles, fontsize=7, **kwargs)


# ---- section 1: the idea -------------------------------------------------------------------------
def _draw_layout(ax, p: int, layers: int) -> None:
    """The model's blocks in a row, coloured by the stage that holds them; arrows for x and dL/dx between stages."""
    from matplotlib.patches import Rectangle
    blocks = [("embed", 0)] + [(f"layer {i}", i * p // layers) for i in range(layers)] + [("norm, head\nloss", p - 1)]
    x, spans = 0.0, {}
    for i, (name, r) in enumerate(blocks):
        if i and r != blocks[i - 1][1]:
            x += 1.0                                        # room for the arrows between stages
        ax.add_patch(Rectangle((x, 0.2), 1.0, 0.6, facecolor=RANK_COLOURS[r % 4], edgecolor="k", lw=0.8))
        ax.text(x + 0.5, 0.5, name, ha="center", va="center", fontsize=7.5)
        spans[r] = (spans.get(r, (x, x))[0], x + 1.0)
        x += 1.05
    for r, (left, right) in spans.items():
        ax.text((left + right) / 2, 0.95, f"rank {r}: stage {r}", ha="center", va="bottom", fontsize=8, weight="bold")
        if r + 1 in spans:
            nxt = spans[r + 1][0]
            ax.annotate("", xy=(nxt - 0.05, 0.65), xytext=(right + 0.05, 0.65), arrowprops=dict(arrowstyle="->"))
            ax.annotate("", xy=(right + 0.05, 0.35), xytext=(nxt - 0.05, 0.35),
                        arrowprops=dict(arrowstyle="->", color="C1"))
            ax.text((right + nxt) / 2, 0.72, "x", ha="center", fontsize=7)
            ax.text((right + nxt) / 2, 0.12, "dL/dx", ha="center", fontsize=7, color="C1")
    ax.set(xlim=(-0.2, x), ylim=(0, 1.25), title=f"Where the layers live: a {layers}-layer model on {p} stages; "
           "between neighbours an activation x (b, s, h) goes forward and its gradient dL/dx comes back")
    ax.title.set_fontsize(9)
    ax.axis("off")


def idea_figure(p: int, m: int, layers: int) -> dict:
    """Top: where the layers live. Below: one batch, then AFAB with m micro-batches, simulated with T_F = 1 and
    T_B = 2. Returns {"naive": bubble, "afab": bubble} (mean over ranks), to hold against the formula."""
    import matplotlib.pyplot as plt
    fig = plt.figure(figsize=(12, 6.6))
    grid = fig.add_gridspec(3, 1, height_ratios=[1.0, 1.0, 1.2])
    _draw_layout(fig.add_subplot(grid[0]), p, layers)
    bubbles = {}
    for row, (name, micro) in enumerate((("naive", 1), ("afab", m)), start=1):
        ax = fig.add_subplot(grid[row])
        events = simulate(make_schedule(name, p, micro), f=1, b=2, w=0)      # T_F = 1, a whole backward T_B = 2
        bubbles[name] = mean_bubble(events)
        gantt(ax, events, p)
        what = ("one batch, no micro-batches" if micro == 1 else
                f"{micro} micro-batches, all forwards then all backwards (AFAB)")
        ax.set_title(f"{what}: every rank idle {bubbles[name]:.0%} of the step; (p-1)/(m+p-1) = "
                     f"{bubble_formula(name, p, micro):.0%}", fontsize=9)
    op_legend(ax, loc="lower right")
    idle, step = (p - 1) * 3, (m + p - 1) * 3
    caption(fig, f"Simulated, $T_F$ = 1 and $T_B$ = 2, no communication time. Middle: one stage works while {p - 1} "
            f"wait. Bottom: {m} micro-batches overlap, yet every rank still idles (p-1)($T_F$+$T_B$) = {idle} of the "
            f"step's {step} units: the bubble, the empty triangles where the pipeline fills and drains.")
    plt.show()
    return bubbles


def simulated_figure(plans: dict, costs: dict, text: str, unit: str = "units of $T_F$, one forward",
                     row_height: float = 2.4) -> dict:
    """One simulated timeline per schedule, stacked on one time axis. plans: {title: Schedule}; costs: {title:
    (T_F, T_B, T_W)} for `simulate`. Each panel's title adds the bubble and the peak in flight per rank.
    Returns {title: events}."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(plans), 1, figsize=(12, row_height * len(plans) + (0.6 if len(plans) > 1 else 0)),
                             sharex=True, squeeze=False)
    axes = axes[:, 0]
    timelines = {}
    for ax, (title, plan) in zip(axes, plans.items()):
        events = timelines[title] = simulate(plan, *costs[title])
        gantt(ax, events, plan.pp)
        ax.set_title(f"{title}: bubble {mean_bubble(events):.1%}; micro-batches in flight per rank "
                     f"{peak_in_flight(plan)}", fontsize=9)
        ax.set_xlabel("")
    axes[-1].set(xlim=(0, max(step_time(e) for e in timelines.values())), xlabel=f"time ({unit})")
    split = any(plan.split_backward for plan in plans.values())
    op_legend(axes[-1], "FBW" if split else "FB", paler=any(plan.virtual_stages > 1 for plan in plans.values()),
              loc="lower right")
    caption(fig, text)
    plt.show()
    return timelines


# ---- section 2: the per-rank tables behind the pass lines -----------------------------------------
def show_two_stages(results: list) -> None:
    """Section 2.2, per rank: its layers, its gradients against one process around the tied exchange, what it sent."""
    for rank, r in enumerate(results):
        layers = sorted({int(n.split(".")[1]) for n in r["parameters"] if n.startswith("layers.")})
        print(f"rank {rank}: layers {layers}, embed.weight: {'embed.weight' in r['parameters']}; max |difference| "
              f"from one process: other gradients {r['others'].error:.1e}, tied matrix {r['tied before']:.1e} before "
              f"the exchange, {r['tied after'].error:.1e} after; sent {r['sent']}")


def show_two_schedules(results: list, names) -> None:
    """Section 2.3, per schedule and rank: the peak in flight, the gradients against one process, what it sent."""
    for name in names:
        for rank, r in enumerate(results):
            print(f"{name} rank {rank}: at most {r[name]['peak']} micro-batch(es) in flight; gradients vs one process "
                  f"{r[name]['error'].error:.1e}; sent {r[name]['sent']}")


# ---- section 3: the proof ------------------------------------------------------------------------
def train_one_process(config, dataset, batch: int, steps: int) -> lockstep.Trace:
    """`steps` AdamW steps of one process on the whole batch: every step's loss and gradients, the final weights."""
    model, loader = new_model(config), DataLoader(dataset, batch)
    optimizer = adamw(model.parameters())
    record = lockstep.Recorder()
    for step in range(steps):
        data = loader.get_batch(step)
        loss = loss_fn(model(data.input_ids), data.targets)
        loss.backward()
        record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return record.finish(dict(model.named_parameters()))


def train_pipeline(mesh, schedule, step, config, dataset, batch: int, reference: lockstep.Trace) -> dict:
    """On a rank: one step of `schedule` per reference step, through the chapter's `step` (run_schedule, the
    tied gradient, the dp all-reduce), then AdamW; out["lockstep"] holds every step's loss and this rank's
    gradients, and its final weights, against one process's (picotron.lockstep). A stage holds whole parameters,
    so nothing is gathered: they are compared with the reference's of the same names (the tied matrix under
    "embed.weight" on both its ends), and the ranks together cover the model. Step 0's messages, timeline and
    ready times are kept."""
    model = new_model(config)
    names = {p: n for n, p in model.named_parameters()}
    stages = build_stages(model, mesh.pp_rank, mesh.pp_size, schedule.virtual_stages)
    params = stage_parameters(stages)
    mine = {names[p]: p for p in params}                                   # this rank's parameters, by name
    record = lockstep.Recorder(reference.only(mine))                      # one process's, cut to the same names
    optimizer = adamw(params)
    loader = DataLoader(dataset, batch // mesh.dp_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    out = {"param_bytes": 4 * sum(p.numel() for p in params), "stages": [s.index for s in stages]}
    for i in range(len(reference.loss)):
        data = loader.get_batch(i)
        mesh.counter.reset()
        ready, timeline = [], Timeline()                                   # (stage, time) its gradients were final
        with comm.counting(mesh.counter):                                  # every send, receive and all-reduce
            result = step(schedule, stages, mesh, data, observer=timeline,
                          on_grads_ready=lambda stage: ready.append((stage, time.perf_counter())))
        if i == 0:
            out.update(counted=mesh.counter.snapshot(), ready=ready, events=timeline.events,
                       samples=data.sample_ids.tolist())
        loss = result.loss if result.loss is not None else torch.zeros(())
        dist.all_reduce(loss)            # not counted, for the comparison only: the last stages' losses, summed
        record.step(loss.item() / mesh.dp_size, {n: p.grad for n, p in mine.items()})
        optimizer.step()
        optimizer.zero_grad()
    out["lockstep"] = record.finish(mine)
    ends = [s.embed.weight for s in stages if s.is_first] + [s.lm_head.weight for s in stages if s.is_last]
    out["tied copy"] = ends[0].detach().clone() if ends else None          # this rank's copy of the tied matrix
    return out


def against_torch(mesh, step, config, dataset, batch: int, m: int, roundings: int, steps: int = 3) -> dict:
    """On a rank: our 1F1B (through `step`) and torch.distributed.pipelining's Schedule1F1B side by side, on an
    untied model (torch's stages know nothing of a weight two of them share)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    untied = dataclasses.replace(config, tie_word_embeddings=False)
    stages = {who: build_stages(new_model(untied), mesh.pp_rank, mesh.pp_size) for who in ("ours", "torch")}
    optimizers = {who: adamw(stage_parameters(stages[who])) for who in stages}
    theirs = Schedule1F1B(PipelineStage(stages["torch"][0], mesh.pp_rank, mesh.pp_size, torch.device("cpu"),
                                        group=mesh.pp_group), m, loss_fn=loss_fn)
    ours = make_schedule("1f1b", mesh.pp_size, m)
    loader = DataLoader(dataset, batch // mesh.dp_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    out = {"loss": [], "grads": []}
    for i in range(steps):
        data = loader.get_batch(i)
        result = step(ours, stages["ours"], mesh, data)                    # all-reduces over dp inside
        losses = []
        if mesh.is_first_stage:
            theirs.step(data.input_ids)                                    # torch cuts the micro-batches itself
        elif mesh.is_last_stage:
            theirs.step(target=data.targets, losses=losses)                # gradients scaled by 1/m, like ours
        else:
            theirs.step()
        all_reduce_gradients(nn.ModuleList(stages["torch"]), mesh.dp_group)
        if mesh.is_last_stage:
            out["loss"].append(abs(result.loss.item() - sum(l.item() for l in losses) / m))
        pairs = list(zip(stage_parameters(stages["ours"]), stage_parameters(stages["torch"])))
        out["grads"].append(tolerance.compare_all({k: a.grad for k, (a, _) in enumerate(pairs)},   # same ops,
                                                  {k: b.grad for k, (_, b) in enumerate(pairs)}, n=roundings))
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
    out["weights"] = max(max_diff(a, b) for a, b in pairs)
    return out


def prove(layouts: dict, schedule_for, step, config, dataset, batch: int, reference: lockstep.Trace,
          roundings: int, torch_m: int) -> dict:
    """On a rank, for each layout {pp: Mesh sizes}: every schedule `schedule_for(name, pp)` trained against the
    one-process Trace `reference` (train_pipeline), then our 1F1B against torch's (against_torch)."""
    out = {}
    for pp, sizes in layouts.items():
        mesh = Mesh(**sizes)
        out[pp] = {name: train_pipeline(mesh, schedule_for(name, pp), step, config, dataset, batch, reference)
                   for name in SCHEDULES}
        out[pp]["torch"] = against_torch(mesh, step, config, dataset, batch, torch_m, roundings)
        out[pp]["coords"] = mesh.coords
    return out


def expected_comm(schedule, r: int, dp: int, message_bytes: int, tied_bytes: int, grad_bytes: int) -> dict:
    """What rank r must send in one step: the messages its actions imply, the tied gradient (first and last
    rank), and one dp all-reduce of its gradients. As comm.counting reports it: {op: (calls, payload bytes)}."""
    last, acts = schedule.num_stages - 1, schedule.actions[r]
    sends = sum((a.op == "F" and a.stage < last) + (a.op == "B" and a.stage > 0) for a in acts)
    receives = sum((a.op == "F" and a.stage > 0) + (a.op == "B" and a.stage < last) for a in acts)
    ends = r in (0, schedule.pp - 1)
    out = {"send": (sends + ends, sends * message_bytes + ends * tied_bytes), "recv": (receives, 0)}
    return out | ({"all_reduce": (1, grad_bytes)} if dp > 1 else {})


def _case(pp: int, name: str) -> str:
    return f"pp={pp}{' x dp=2' if pp == 2 else '':<7} {name}"


def whole_runs(proof: list, cases) -> dict:
    """{(pp, schedule): its ranks' Locksteps as one over the whole model (lockstep.combine: at each step the worst
    stage)}, for the table and picotron.lockstep's figure."""
    return {(pp, name): lockstep.combine([rank[pp][name]["lockstep"] for rank in proof]) for pp, name in cases}


def show_proof(runs: dict, proof: list) -> None:
    """The proof's full table: every case against one process (the worst over its ranks and steps) and rank 0's
    messages of step 0, then ours against torch's Schedule1F1B."""
    print(f"{'case':<24}{'loss error':>11}{'grad error':>12}{'weight error':>14}   rank 0 sent in one step")
    for (pp, name), run in runs.items():
        print(f"{_case(pp, name):<24}{max(run.loss_diff):>11.1e}{max(run.grad_diff):>12.1e}{run.weight_diff:>14.1e}   "
              f"{proof[0][pp][name]['counted']}")
    for pp in proof[0]:
        pairs = [rank[pp]["torch"] for rank in proof]
        loss = max(e for r in pairs for e in r["loss"])
        grads = max(g.error for r in pairs for g in r["grads"])
        print(f"pp={pp}: ours vs torch's Schedule1F1B, {len(pairs[0]['grads'])} steps: loss {loss:.1e}, gradients "
              f"{grads:.1e}, weights {max(r['weights'] for r in pairs):.1e}")


# ---- section 4: stages that wait, and the real model, timed on ranks ------------------------------
class Wait(torch.autograd.Function):
    """The identity, sleeping `forward_s` in forward and `backward_s` in backward."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class WaitingBias(nn.Module):
    """x + b, where the gradient of b (the W step) takes `seconds`."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds, self.bias = seconds, nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + Wait.apply(self.bias, 0.0, self.seconds)


class WaitingStage(nn.Module):
    """A pipeline stage that computes nothing: its forward, its input gradient (B) and its weight gradient (W)
    each sleep `seconds`; a whole backward sleeps both."""

    def __init__(self, index, num_stages, seconds):
        super().__init__()
        self.index, self.num_stages, self.seconds = index, num_stages, seconds
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.weighted = WaitingBias(seconds)                 # owns the weight: W asks for its gradient

    def forward(self, x):
        return Wait.apply(self.weighted(x), self.seconds, self.seconds)   # the way back to the input: B


def everyone(events) -> list:
    """Every rank's events, on every rank."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    return [e for rank in gathered for e in rank]


def waiting_timelines(mesh, cases: dict, seconds: float, repeats: int = 3) -> dict:
    """{schedule: every rank's events} with WaitingStages: the fastest of `repeats` steps, after one that does not
    wait (other processes on the machine only ever add time). cases: {schedule: (m, v)}."""
    out = {}
    for name, (m, v) in cases.items():
        schedule = make_schedule(name, mesh.pp_size, m, v)
        inputs = [torch.ones(1, 4, device=device()) for _ in range(m)]
        steps = []
        for wait in (0.0,) + (seconds,) * repeats:         # a warm-up that does not wait, then those that do
            stages = [WaitingStage(s, schedule.num_stages, wait).to(device())
                      for s in range(mesh.pp_rank, schedule.num_stages, mesh.pp_size)]
            dist.barrier()                                   # start together
            timeline = Timeline()
            run_schedule(schedule, stages, mesh, inputs, [None] * m, lambda y, target: y.sum(), (1, 4),
                         observer=timeline)
            steps.append(everyone(timeline.events))
        out[name] = min(steps[1:], key=step_time)
    return out


def one_graph_bytes(stages, inputs, targets, shape) -> list[int]:
    """Per chunk of this rank: the bytes one micro-batch's forward leaves alive for its backward (output included)."""
    sizes = []
    for stage in stages:
        with MemoryTracker() as tracker:
            x = inputs[0] if stage.is_first else torch.randn(shape, device=device(), requires_grad=True)
            y = stage(x)
            if stage.is_last:
                y = loss_fn(y, targets[0])
            sizes.append(tracker.live_bytes)
        del x, y
    return sizes


def real_model(mesh, config, dataset, micro: int, seq: int, m: int, schedules: dict) -> dict:
    """Per schedule {name: v}: one step under MemoryTracker (and the executor's count), then the faster of two
    timed steps with the counter on. {name: {events, counted, memory}}."""
    batch = DataLoader(dataset, micro * m).get_batch(0).to(device())
    inputs, targets = split_microbatches(batch.input_ids, m), split_microbatches(batch.targets, m)
    shape = (micro, seq, config.hidden_size)
    out = {}
    for name, v in schedules.items():
        schedule = make_schedule(name, mesh.pp_size, m, v)
        stages = build_stages(new_model(config).to(device()), mesh.pp_rank, mesh.pp_size, v)
        for p in stage_parameters(stages):
            p.grad = torch.zeros_like(p)          # gradients exist before the step: the tracker sees activations
        one = one_graph_bytes(stages, inputs, targets, shape)
        timeline = Timeline()                     # counts the micro-batches in flight
        with MemoryTracker() as tracker:          # also the warm-up of the timed steps
            run_schedule(schedule, stages, mesh, inputs, targets, loss_fn, shape, observer=timeline)
        memory = dict(one=one, peak=tracker.peak_bytes, count=timeline.peak_activations)
        steps = []
        for _ in range(2):
            mesh.counter.reset()
            dist.barrier()
            timeline = Timeline()
            with comm.counting(mesh.counter):
                run_schedule(schedule, stages, mesh, inputs, targets, loss_fn, shape, observer=timeline)
            steps.append((everyone(timeline.events), mesh.counter.snapshot()))
        events, counted = min(steps, key=lambda s: step_time(s[0]))
        out[name] = dict(events=events, counted=counted, memory=memory)
    return out


def measure(wait_cases: dict, wait: float, config, dataset, micro: int, seq: int, m: int, schedules: dict) -> dict:
    """On a rank of a pp = world pipeline: the waiting stages' timelines (4.1), the real model's (4.2-4.4)."""
    mesh = Mesh(pp=dist.get_world_size())
    return {"waiting": waiting_timelines(mesh, wait_cases, wait),
            "real": real_model(mesh, config, dataset, micro, seq, m, schedules)}


def _title(name: str, m: int, v: int) -> str:
    return f"{name}, m = {m}{f', v = {v}' if v > 1 else ''}"


def waiting_figure(waiting: dict, cases: dict, p: int, wait: float) -> dict:
    """Every action of every rank, waiting stages, one panel per schedule. Returns {name: bubble per rank}."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(cases), 1, figsize=(12, 9.6))
    measured = {}
    for ax, (name, (m, v)) in zip(axes, cases.items()):
        events = waiting[name]
        measured[name] = bubble_fraction(events)
        gantt(ax, events, p, scale=1e3)
        ax.set_title(f"{_title(name, m, v)}: measured bubble {min(measured[name]):.1%} to {max(measured[name]):.1%} "
                     f"(ranks), formula {bubble_formula(name, p, m, v):.1%}; step {step_time(events) * 1e3:.0f} ms, "
                     f"{sum(e.end - e.start for e in events) / p * 1e3:.0f} ms of work per rank", fontsize=9)
        ax.set_xlabel("")
    axes[-1].set_xlabel("time since the step started (ms)")
    op_legend(axes[0], "FBW", paler=True, loc="upper left", bbox_to_anchor=(1.005, 1))
    caption(fig, f"Measured, not drawn: every action of every rank, stages that sleep {wait * 1e3:.0f} ms per F, B "
            "and W. Naive idles three quarters of the time; AFAB and 1F1B take the same time in a different order; "
            "interleaving (twice the work here) shrinks the fill and the drain against the step; ZB-H1 fills the drain "
            "with the W steps it held back (green).")
    plt.show()
    return measured


def show_waiting(measured: dict, cases: dict, p: int) -> None:
    """Section 4.1's table: per schedule the formula, the measured bubble per rank, the largest relative error."""
    print(f"{'schedule':<12}{'m':>3}{'v':>3}{'formula':>9}   measured per rank            relative error (max)")
    for name, (m, v) in cases.items():
        formula = bubble_formula(name, p, m, v)
        error = max(abs(b - formula) / formula for b in measured[name])
        per_rank = "  ".join(f"{b:.1%}" for b in measured[name])
        print(f"{name:<12}{m:>3}{v:>3}{formula:>9.1%}   {per_rank:<28} {error:.1%}")


def real_figure(real: dict, schedules: dict, p: int, m: int) -> None:
    """The real model's timelines, one panel per schedule, on one time axis."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 8.4), sharex=True)
    for ax, (name, v) in zip(axes, schedules.items()):
        events = real[name]
        gantt(ax, events, p, scale=1e3)
        ax.set_title(f"{_title(name, m, v)}: measured bubble {mean_bubble(events):.0%} (mean of ranks), formula "
                     f"{bubble_formula(name, p, m, v):.0%}; step {step_time(events) * 1e3:.0f} ms", fontsize=9)
        ax.set_xlabel("")
    axes[-1].set(xlim=(0, max(step_time(e) for e in real.values()) * 1e3), xlabel="time since the step started (ms)")
    op_legend(axes[0], "FBW", paler=True, loc="upper left", bbox_to_anchor=(1.005, 1))
    caption(fig, f"The real model, measured on {p} CPU processes sharing the machine's cores. The shapes of 4.1 are "
            "there, stretched and jittered: when more ranks compute at once than there are free cores they take "
            "turns, another process may take a core mid-action, and each message adds a gap; so the measured "
            "bubbles sit away from the formula, mostly above.")
    plt.show()


def show_real(real: dict, schedules: dict, p: int, m: int) -> None:
    """Section 4.2's table: step time, formula, measured bubble per rank, median F and B."""
    print(f"{'schedule':<12}{'step':>8}{'formula':>9}   measured bubble per rank        median F   median B (ms)")
    for name, v in schedules.items():
        events = real[name]
        median = {op: np.median([e.end - e.start for e in events if e.op == op]) * 1e3 for op in "FB"}
        print(f"{name:<12}{step_time(events) * 1e3:>6.0f} ms{bubble_formula(name, p, m, v):>9.1%}   "
              f"{'  '.join(f'{b:.1%}' for b in bubble_fraction(events)):<30}{median['F']:>9.1f}{median['B']:>11.1f}")


def bubble_figure(p: int, waiting: dict, wait_cases: dict, real: dict, schedules: dict, m_real: int) -> dict:
    """The bubble against m: formulas (lines), `simulate` (crosses), waiting stages (dots, range over ranks), the
    real model (squares). Returns {(name, m, v): simulated bubble} for the chapter to hold against the formula."""
    import matplotlib.pyplot as plt
    colour = {"naive": "C0", "afab": "C0", "1f1b": "C0", "interleaved": "C3", "zb-h1": "C2"}
    ms = np.arange(1, 65)
    fig, ax = plt.subplots(figsize=(10, 4.4))
    simulated = {}
    lines = {"AFAB / 1F1B": ("1f1b", 1), "interleaved, v = 2": ("interleaved", 2),
             "ZB-H1, $T_F$ = $T_B$ = $T_W$": ("zb-h1", 1)}
    for label, (name, v) in lines.items():
        valid = ms[ms >= p] if name == "zb-h1" else ms
        ax.plot(valid, [bubble_formula(name, p, int(m), v) for m in valid], "-", color=colour[name],
                label=f"formula, {label}")
        points = [m for m in (1, 2, 4, 8, 16, 32, 64)
                  if (name != "interleaved" or m % p == 0) and (name != "zb-h1" or m >= p)]
        for m in points:
            simulated[name, m, v] = mean_bubble(simulate(make_schedule(name, p, m, v), 1 / v, 1 / v, 1 / v))
        ax.plot(points, [simulated[name, m, v] for m in points], "x", color=colour[name], ms=7)
    for name, (m, v) in wait_cases.items():
        b = waiting[name]
        ax.errorbar(m * (1.04 if name == "afab" else 1), np.mean(b), fmt="o", color=colour[name], ms=6, capsize=3,
                    yerr=[[np.mean(b) - min(b)], [max(b) - np.mean(b)]])
    for name in schedules:
        ax.plot(m_real * (1.04 if name == "afab" else 1), mean_bubble(real[name]), "s", mfc="none",
                color=colour[name], ms=8, mew=1.5)
    ax.plot([], [], "kx", label="simulated (picotron's simulate)")
    ax.plot([], [], "ko", label="measured, stages that wait (range over ranks)")
    ax.plot([], [], "ks", mfc="none", label="measured, the real model")
    ax.set(xscale="log", xlabel="micro-batches per step m", ylabel="bubble (idle / step time)", ylim=(0, 0.8),
           title=f"Bubble of a {p}-stage pipeline against the number of micro-batches")
    ax.set_xticks([1, 2, 4, 8, 16, 32, 64], [1, 2, 4, 8, 16, 32, 64])
    ax.minorticks_off()
    ax.legend(fontsize=7, loc="upper right")
    caption(fig, f"The bubble falls like (p-1)/(m+p-1): m = 4 micro-batches still leave "
            f"{bubble_formula('1f1b', p, 4):.0%} idle at p = {p}. Interleaving and ZB-H1 sit lower at every m. Waiting "
            "stages land on the formulas; the real model on this CPU lands off them, mostly above (4.2).")
    plt.show()
    return simulated


def memory_rows(measured: list, schedules: dict) -> dict:
    """{name: [rank r's memory record]}: the executor's count, the tracker's peak, one micro-batch's graph per chunk."""
    return {name: [rank["real"][name]["memory"] for rank in measured] for name in schedules}


def memory_figure(rows: dict, p: int, m: int, micro: int, seq: int) -> None:
    """Peak activation bytes per rank and schedule (bars), the count times one graph (black), the count (numbers)."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 4.2))
    width = 0.2
    for i, (name, ranks) in enumerate(rows.items()):
        for r, row in enumerate(ranks):
            x = r + (i - 1.5) * width
            predicted = row["count"] * np.mean(row["one"])                  # one micro-batch's graph (per chunk)
            ax.bar(x, row["peak"] / MiB, width, color=f"C{i}", label=name if r == 0 else None)
            ax.plot([x - width / 2, x + width / 2], [predicted / MiB] * 2, "k-", lw=2,
                    label="count x one micro-batch's graph" if (i, r) == (0, 0) else None)
            ax.text(x, row["peak"] / MiB, row["count"], ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set(ylabel="peak activation memory (MiB)", title=f"Activation memory per rank, p = {p}, m = {m} micro-batches "
           f"of {micro} x {seq} tokens (numbers: micro-batches in flight)")
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    ax.set_ylim(0, max(row["peak"] for ranks in rows.values() for row in ranks) / MiB * 1.25)
    counts = ", ".join(str(p - r) for r in range(p))
    caption(fig, f"AFAB holds all {m} micro-batches on every rank; 1F1B p - r = {counts} (rank {p - 1} also holds the "
            "logits, so its micro-batch weighs more). Interleaved holds more chunks, each half a stage. ZB-H1 holds "
            f"p = {p} everywhere, and more bytes than the count: picotron keeps each graph and the output gradients W "
            "needs until W has run.")
    plt.show()


def show_memory(rows: dict) -> None:
    """Section 4.4's table: per schedule and rank, the count, the peak, and the peak over the count's prediction."""
    print(f"{'schedule':<12}{'count per rank':<18}{'peak MiB per rank':<30}{'peak / (count x one graph)'}")
    for name, ranks in rows.items():
        peaks = "  ".join(f"{row['peak'] / MiB:5.1f}" for row in ranks)
        ratios = "  ".join(f"{row['peak'] / (row['count'] * np.mean(row['one'])):.2f}" for row in ranks)
        print(f"{name:<12}{str([row['count'] for row in ranks]):<18}{peaks:<30}{ratios}")


# ---- section 5: the formulas at scale ------------------------------------------------------------
def limits_figure(p: int, dp: int, kinds: dict, fewest, tokens_per_micro: int = 8192,
                  batch_tokens: float = 2048 * 8192) -> None:
    """Left: the bubble against m at p stages (formulas). Right: the global batch that keeps the bubble <= 10%,
    against p. kinds: {label: (schedule, v, colour)}; fewest(name, p, v): the smallest such m."""
    import matplotlib.pyplot as plt
    fig, (ax_m, ax_tokens) = plt.subplots(1, 2, figsize=(12, 4.2))
    ms = np.arange(1, 513)
    for label, (name, v, colour) in kinds.items():
        valid = ms[ms >= p] if name == "zb-h1" else ms
        ax_m.plot(valid, [bubble_formula(name, p, int(m), v) for m in valid], color=colour, label=label)
    ax_m.axvline(p, color="k", ls="--", lw=1)
    ax_m.text(p + 1, 0.8, "Llama 3 405B:\n16 sequences\nper pipeline", fontsize=7, va="top")
    ax_m.axhline(0.1, color="0.5", ls=":", lw=1)
    ax_m.set(xscale="log", xlabel="micro-batches per step m", ylabel="bubble (idle / step time)", ylim=(0, 1),
             title=f"p = {p} stages (formulas)")
    ax_m.legend(fontsize=7)
    ps = np.array([2, 4, 8, 16, 32, 64])
    for label, (name, v, colour) in kinds.items():
        needed = [fewest(name, int(q), v) * tokens_per_micro * dp / 1e6 for q in ps]
        ax_tokens.plot(ps, needed, "o-", color=colour, ms=4, label=label)
    ax_tokens.axhline(batch_tokens / 1e6, color="k", ls="--", lw=1, label="Llama 3 405B's batch, 16M tokens")
    ax_tokens.set(xscale="log", yscale="log", xlabel="pipeline stages p", ylabel="tokens per step (millions)",
                  title=f"Global batch for a bubble <= 10% (dp = {dp}, {tokens_per_micro}-token micro-batches)")
    ax_tokens.set_xticks(ps, ps)
    ax_tokens.minorticks_off()
    ax_tokens.legend(fontsize=7)
    caption(fig, "Computed, not measured. Left: with 16 micro-batches on 16 stages, 1F1B idles 48%, interleaving with "
            "v = 4 19%, ZB-H1 24%. Right: a 10% bubble at p = 16 would need 142M tokens per step with 1F1B, 8.4 times "
            "Llama 3's batch (2,048 x 8,192 = 16.8M tokens); interleaving and ZB-H1 cut that, but the batch size "
            "still grows with p.")
    plt.show()


# ---- section 6: the explorer's figure -------------------------------------------------------------
def explorer(schedule="1f1b", p=4, m=8, v=2, forward=1.0, backward=1.0, weight=1.0, p2p=0.0) -> None:
    """One schedule simulated with the widgets' costs: forward, backward, weight are T_F, T_B, T_W per stage."""
    import matplotlib.pyplot as plt
    v = v if schedule == "interleaved" else 1
    m = 1 if schedule == "naive" else m
    try:
        plan = make_schedule(schedule, p, m, v)
    except ValueError as error:
        print(f"ValueError: {error}")
        return
    events = simulate(plan, forward / v, backward / v, weight / v, p2p)      # a chunk holds 1/v of the layers
    try:
        formula = f"formula {bubble_formula(schedule, p, m, v, f=forward, b=backward, w=weight):.1%}"
    except ValueError:
        formula = "no closed formula for these costs"
    fig, ax = plt.subplots(figsize=(12, 0.32 * p + 1.6))
    gantt(ax, events, p)
    ax.set_title(f"{schedule}, p = {p}, m = {m}{f', v = {v}' if v > 1 else ''}: bubble {mean_bubble(events):.1%} "
                 f"simulated, {formula}", fontsize=9)
    op_legend(ax, "FBW" if plan.split_backward else "FB", paler=v > 1, loc="lower right")
    caption(fig, f"Simulated with $T_F$ = {forward}, $T_B$ = {backward}, $T_W$ = {weight}, p2p = {p2p}. Micro-batches "
            f"in flight per rank: {peak_in_flight(plan)}.")
    plt.show()

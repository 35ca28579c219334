"""Pipeline parallelism: the model's layers cut into stages over the pp ranks, and the executor that
runs a schedule on them. The chapter: chapters/06_pipeline_parallel.ipynb (Playbook, "Pipeline
Parallelism").

`build_stages` gives pp rank r its stages (consecutive layers; the first stage also the embedding, the
last the final norm, the LM head and the loss). `run_schedule` runs this rank's actions of a `Schedule`
(picotron/parallel/pipeline_schedules.py: the schedules as data, checked and simulated): F receives its
input from the previous stage and sends its output on, B receives its output's gradient and sends its
input's back, W (zero-bubble schedules) adds the weight gradients B left out. `sync_tied_embeddings`
sums the tied embedding's two gradients (first and last stage) after the step.

The executor only runs the actions. Measuring is the caller's: `comm.counting` records its sends
(payload bytes) and receives, and an observer passed to `run_schedule`, such as `Timeline`, sees every
action start and end (the timeline, the activations in flight).

    stages = build_stages(model, mesh.pp_rank, mesh.pp_size)
    optimizer = torch.optim.AdamW(stage_parameters(stages))
    schedule = make_schedule("1f1b", mesh.pp_size, num_microbatches=8)      # pipeline_schedules
    timeline = Timeline()                                                    # to measure; else leave it out
    with comm.counting(mesh.counter):                                        # to count; else leave it out
        result = run_schedule(schedule, stages, mesh, inputs, targets, loss_fn,
                              activation_shape=(micro_batch, seq, hidden), observer=timeline)
        sync_tied_embeddings(stages, mesh)        # first + last stage
    all_reduce_gradients(...)                     # data parallelism: once, after the last micro-batch
    optimizer.step()
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.model import Llama, recompute
from picotron.parallel.pipeline_schedules import Action, Event, Schedule, check_schedule, check_stages, stage_layers

__all__ = ["Stage", "build_stages", "stage_parameters", "split_microbatches", "ScheduleResult",
           "ScheduleObserver", "Timeline", "run_schedule", "sync_tied_embeddings"]


# ---- splitting the model -------------------------------------------------------------------------------
class Stage(nn.Module):
    """Stage `index` of `num_stages`: a slice of a Llama's layers, with the embedding on the first
    stage and the final norm and LM head on the last.

    The modules are the Llama's own (not copies), so its parameter names still find them. The
    forward takes token ids (batch, seq) on the first stage and hidden states (batch, seq, hidden)
    elsewhere; it returns hidden states, or logits (batch, seq, vocab) on the last stage.
    """

    def __init__(self, model: Llama, index: int, num_stages: int):
        super().__init__()
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.layer_ids = stage_layers(model.config.num_layers, num_stages)[index]
        self.full_recompute = model.config.recompute == "full"
        # The LM head reads the embedding's matrix: on different ranks the first and the last stage
        # each keep a copy, and sync_tied_embeddings sums their gradients.
        self.tied = model.lm_head.weight is model.embed.weight
        self.rope = model.rope   # cos/sin tables: buffers, no parameters, needed by every layer
        self.embed = model.embed if self.is_first else None
        self.layers = nn.ModuleList(model.layers[i] for i in self.layer_ids)
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)              # (1, seq)
        cos, sin = self.rope(position_ids)                        # (batch or 1, 1, seq, head_dim)
        if self.embed is not None:
            x = self.embed(x)                                     # (batch, seq) -> (batch, seq, hidden)
        for layer in self.layers:
            x = recompute(layer, x, cos, sin) if self.full_recompute else layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))                        # (batch, seq, vocab)
        return x

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.num_stages}, layers {self.layer_ids.start}..{self.layer_ids.stop - 1}"


def build_stages(model: Llama, pp_rank: int, pp: int, virtual_stages: int = 1) -> list[Stage]:
    """The stages pp rank `pp_rank` holds: r, r + pp, ..., r + (virtual_stages-1) pp, of pp * virtual_stages.

    Build the same `model` on every rank first (same seed). With virtual_stages > 1 (interleaved
    schedule) the layers are cut into pp * virtual_stages chunks and dealt out round-robin. The
    stages share the model's modules; the other stages' layers are freed once `model` is dropped.
    """
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp={pp})")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages} must be at least 1")
    if getattr(model.config, "num_experts", 0):
        raise NotImplementedError("pipeline stages do not carry mixture-of-experts auxiliary losses yet (each "
                                  "stage's layers would need their aux_loss added to that stage's backward); "
                                  "use num_experts=0 with pipeline stages")
    check_stages(model.config.num_layers, pp, virtual_stages)
    num_stages = pp * virtual_stages
    return [Stage(model, s, num_stages) for s in range(pp_rank, num_stages, pp)]


def stage_parameters(stages: list[Stage]) -> list[nn.Parameter]:
    """The parameters of this rank's stages, each once (for the optimizer)."""
    return list(nn.ModuleList(stages).parameters())   # .parameters() skips repeats (a tied weight at pp=1)


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """Cut a batch (batch, ...) into `num_microbatches` equal micro-batches along the first dimension."""
    if batch.shape[0] % num_microbatches:
        raise ValueError(f"a batch of {batch.shape[0]} does not split into {num_microbatches} equal micro-batches; "
                         f"choose a batch size divisible by num_microbatches")
    return list(batch.chunk(num_microbatches))


# ---- watching the executor -------------------------------------------------------------------------------
class ScheduleObserver(Protocol):
    """What `run_schedule(..., observer=...)` calls around each action of this rank, in order."""

    def before(self, rank: int, action: Action) -> None:
        """The action's input is here (received, or not needed); its computation starts now."""

    def after(self, rank: int, action: Action, in_flight: int) -> None:
        """Its computation is done (its sends are not posted yet); in_flight: the (micro-batch, stage)
        graphs this rank holds now, kept from their F until their backward no longer needs them."""


class Timeline:
    """An observer that records when every action ran and the most activations held at once; one per step.

    events: one Event per action, start and end from time.perf_counter. An action starts once its
    input has arrived, so a rank's waiting for a message is idle time between its events (what
    `bubble_fraction` measures). peak_activations: the most (micro-batch, stage) graphs alive at once.
    On a GPU the host only queues the work: every reading of the clock first waits for the device
    (torch.cuda.synchronize), so an event is when the action really ran. That stops the host from
    running ahead, which is why the executor leaves it to an observer.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.peak_activations = 0
        self._start = 0.0

    def before(self, rank: int, action: Action) -> None:
        self._start = self._now()

    def after(self, rank: int, action: Action, in_flight: int) -> None:
        self.events.append(Event(rank, *action, self._start, self._now()))
        self.peak_activations = max(self.peak_activations, in_flight)

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()     # this rank's device (picotron.launch sets it per rank)
        return time.perf_counter()


# ---- the executor ----------------------------------------------------------------------------------------
@dataclass
class ScheduleResult:
    """What one pipeline step computed on this rank."""
    loss: torch.Tensor | None             # sum over micro-batches of loss / m (the last stage's rank; else None)


@dataclass
class _Graph:
    """A micro-batch's forward on one stage, kept until its backward is done."""
    input: torch.Tensor                   # the stage's input (a leaf; its .grad goes to the previous stage)
    root: torch.Tensor | None = None      # the output, or the scaled loss on the last stage
    weight_ops: list = field(default_factory=list)     # (module, output) of modules with parameters (B/W split)
    weight_grads: list = field(default_factory=list)   # their output gradients, left by B for W


class _Executor:
    """Runs one rank's action list: for each action, receive its input, compute, send its output."""

    def __init__(self, schedule: Schedule, stages: list[Stage], mesh, inputs, targets, loss_fn, activation_shape,
                 dtype, position_ids, on_grads_ready, observer, autocast_dtype):
        self.schedule, self.mesh, self.loss_fn = schedule, mesh, loss_fn
        self.inputs, self.targets, self.position_ids = inputs, targets, position_ids
        self.activation_shape, self.dtype = tuple(activation_shape), dtype
        self.on_grads_ready, self.observer = on_grads_ready, observer
        self.stages = {stage.index: stage for stage in stages}
        self.device = next(stages[0].parameters()).device
        self.autocast = (functools.partial(torch.autocast, self.device.type, dtype=autocast_dtype)
                         if autocast_dtype is not None else nullcontext)
        self.outbox: list[tuple[torch.Tensor, int]] = []   # sends of the last action, not posted yet
        self.posted: list = []                             # requests of posted sends, waited for at the end
        self.local: dict = {}                              # messages between two stages of this rank
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.grads_left = Counter({s: schedule.num_microbatches for s in self.stages})
        self.loss = None

    def run(self) -> ScheduleResult:
        rank, observer = self.mesh.pp_rank, self.observer
        compute = {"F": self.forward, "B": self.backward, "W": self.weight}
        last_gradient_step = "W" if self.schedule.split_backward else "B"
        for action in self.schedule.actions[rank]:
            received = self._receive(action)
            if observer is not None:
                observer.before(rank, action)
            outgoing = compute[action.op](action, received)
            if observer is not None:
                observer.after(rank, action, len(self.graphs))
            if action.op == last_gradient_step:
                self._grads_done(action.stage)
            if outgoing is not None:
                self._send(action, outgoing)
        self._post()                     # the last sends
        comm.wait_all(self.posted)
        return ScheduleResult(self.loss)

    # ---- point-to-point -------------------------------------------------------------------------------
    # F on stage s > 0 receives from s - 1 and, below the last stage, sends to s + 1; B the other way.
    # A message between two stages of this rank (pp=1, interleaved) is handed over in `local`.
    def _peer(self, stage: int) -> int:
        return self.mesh.rank_of(pp=self.schedule.rank_of(stage))

    def _receive(self, action: Action) -> torch.Tensor | None:
        """Post the pending sends with this action's receive, if it has one, and wait for that receive."""
        op, microbatch, s = action
        source = {"F": s - 1, "B": s + 1}.get(op, -1)        # W needs no message
        if not 0 <= source < self.schedule.num_stages:
            self._post()
            return None
        src = self._peer(source)
        if src == self.mesh.rank:
            self._post()
            return self.local.pop((microbatch, source, s))
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        self._post(receive=(buffer, src))
        return buffer

    def _send(self, action: Action, tensor: torch.Tensor) -> None:
        op, microbatch, s = action
        to = s + 1 if op == "F" else s - 1
        dst = self._peer(to)
        if dst == self.mesh.rank:
            self.local[(microbatch, s, to)] = tensor
        else:
            self.outbox.append((tensor.contiguous(), dst))

    def _post(self, receive: tuple[torch.Tensor, int] | None = None) -> None:
        """Post the pending sends and this action's receive as one batch; wait for the receive only.

        Batching the two directions is what lets two neighbours that send to each other and then
        receive from each other (1F1B's steady state) both make progress on NCCL.
        """
        ops = [dist.P2POp(dist.isend, tensor, dst) for tensor, dst in self.outbox]
        for tensor, _ in self.outbox:    # counted as picotron.comm's wrappers count: payload bytes per send
            comm.record("send", tensor)
        self.outbox = []
        if receive is not None:
            comm.record("recv")
            ops.append(dist.P2POp(dist.irecv, *receive))
        if not ops:
            return
        requests = dist.batch_isend_irecv(ops)
        if receive is not None:
            requests[-1].wait()          # (NCCL may return one request for the batch: then it covers all)
            requests = requests[:-1]     # (and never wait twice: a second wait on a gloo receive hangs)
        # Forget the sends that are done, so their tensors can be freed before the step ends.
        self.posted = [r for r in self.posted if not r.is_completed()] + requests

    # ---- the three actions: each returns what it sends on (or None) -----------------------------------
    def forward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        _, microbatch, s = action
        stage = self.stages[s]
        x = self.inputs[microbatch] if stage.is_first else received.requires_grad_()   # ids, or (batch, seq, hidden)
        graph = _Graph(x)
        with _record_weight_ops(stage, graph.weight_ops, self.schedule.split_backward), self.autocast():
            y = stage(x) if self.position_ids is None else stage(x, self.position_ids[microbatch])
            # Mean of the m micro-batch means: the loss of the whole batch (equal micro-batches).
            loss = self.loss_fn(y, self.targets[microbatch]) / self.schedule.num_microbatches if stage.is_last else None
        self.graphs[(microbatch, s)] = graph
        if not stage.is_last:
            graph.root = y
            return y.detach()
        graph.root = loss
        self.loss = graph.root.detach() if self.loss is None else self.loss + graph.root.detach()
        return None

    def backward(self, action: Action, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The input's gradient (None on the last stage: the loss is where it starts); with W actions,
        also the gradients of the outputs of the modules that own weights, for W."""
        _, microbatch, s = action
        stage, graph = self.stages[s], self.graphs[(microbatch, s)]
        if self.schedule.split_backward:
            # The graph stays whole until W, for simplicity; a memory-tuned version frees what only B needed.
            wanted = ([] if stage.is_first else [graph.input]) + [out for _, out in graph.weight_ops]
            grads = torch.autograd.grad(graph.root, wanted, grad, retain_graph=True, allow_unused=True)
            input_grad = None if stage.is_first else grads[0]
            graph.weight_grads = list(grads[0 if stage.is_first else 1:])
        else:
            torch.autograd.backward(graph.root, grad)                   # input and weight gradients
            input_grad = graph.input.grad
            del self.graphs[(microbatch, s)]
        return None if stage.is_first else input_grad

    def weight(self, action: Action, _: None) -> None:
        """The weights' gradients from the output gradients B left: dA = dy^T x for a Linear y = x A^T."""
        _, microbatch, s = action
        graph = self.graphs.pop((microbatch, s))
        for (module, output), output_grad in zip(graph.weight_ops, graph.weight_grads):
            if output_grad is None:      # this output did not reach the loss
                continue
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            # Only the path from the output back to the module's own weights.
            for param, grad in zip(params, torch.autograd.grad(output, params, output_grad)):
                param.grad = grad if param.grad is None else param.grad.add_(grad)

    def _grads_done(self, s: int) -> None:
        """Count the stage's gradient steps; after the last micro-batch its gradients are final."""
        self.grads_left[s] -= 1
        if self.grads_left[s] == 0 and self.on_grads_ready is not None:
            self.on_grads_ready(s)


@contextmanager
def _record_weight_ops(stage: nn.Module, record: list, active: bool) -> Iterator[None]:
    """While active, append (module, output) for every module of `stage` that owns parameters
    (each returns one tensor: Linear, Embedding, RMSNorm)."""
    if not active:
        yield
        return
    owners = [m for m in stage.modules() if any(True for _ in m.parameters(recurse=False))]
    handles = [m.register_forward_hook(lambda module, args, output: record.append((module, output)))
               for m in owners]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_no_shared_weights(stages: list[nn.Module]) -> None:
    """W asks autograd for a module's weight gradient starting from that module's output. A weight that
    another module on this rank also uses would get that module's share as well, through the rest of
    the graph: counted twice."""
    owner: dict[nn.Parameter, str] = {}
    for stage in stages:
        for name, module in stage.named_modules():
            here = f"stage {stage.index}'s {name}"
            for param in module.parameters(recurse=False):
                if owner.setdefault(param, here) != here:
                    raise ValueError(f"{here} shares a weight with {owner[param]} on this rank (a tied embedding "
                                     f"with pp=1); a schedule with W steps would count its gradient twice: untie "
                                     f"the weights (tie_word_embeddings=False) or use pp > 1, where the two copies "
                                     f"live on different ranks")


def _check_step(schedule: Schedule, stages: list[Stage], mesh, inputs, targets) -> None:
    """ValueError unless the schedule is sound, fits the mesh, and this rank has the stages and data it needs."""
    check_schedule(schedule)
    if schedule.pp != mesh.pp_size:
        raise ValueError(f"the schedule is for pp={schedule.pp} but the mesh has pp={mesh.pp_size}")
    mine = [s for s in range(schedule.num_stages) if schedule.rank_of(s) == mesh.pp_rank]
    if sorted(stage.index for stage in stages) != mine or any(st.num_stages != schedule.num_stages for st in stages):
        raise ValueError(f"pp rank {mesh.pp_rank} must hold stages {mine} of {schedule.num_stages} for this schedule, "
                         f"got {[(st.index, st.num_stages) for st in stages]}; build them with build_stages(model, "
                         f"{mesh.pp_rank}, {schedule.pp}, virtual_stages={schedule.virtual_stages})")
    m = schedule.num_microbatches
    for what, items, needed in (("inputs", inputs, 0 in mine), ("targets", targets, schedule.num_stages - 1 in mine)):
        if needed and (items is None or len(items) != m):
            raise ValueError(f"this rank holds the {'first' if what == 'inputs' else 'last'} stage and needs {m} "
                             f"micro-batch {what}, got {None if items is None else len(items)}")
    if schedule.split_backward:
        _check_no_shared_weights(stages)


def run_schedule(schedule: Schedule, stages: list[Stage], mesh, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable, activation_shape: tuple[int, ...], *,
                 dtype: torch.dtype = torch.float32, position_ids: list[torch.Tensor] | None = None,
                 on_grads_ready: Callable[[int], None] | None = None,
                 observer: ScheduleObserver | None = None, autocast_dtype: torch.dtype | None = None) -> ScheduleResult:
    """Run this rank's part of one step of `schedule`: gradients of loss / m summed over the micro-batches.

    inputs: the m micro-batches' inputs (used on the rank holding stage 0; others may pass None).
    targets: their targets (used on the rank holding the last stage). loss_fn(output, target) is the
    mean loss of one micro-batch; it is divided by m here. activation_shape: what travels between
    stages, e.g. (micro_batch, seq, hidden). position_ids: the m micro-batches' token positions, for
    every stage's rotary embedding (None: 0..seq-1; context parallelism passes its slice's positions).
    on_grads_ready(stage): called when a stage's gradients are final (after its last micro-batch's
    backward), the moment a data-parallel all-reduce of that stage could start; or sync after this
    returns. observer: told before and after each action (`Timeline` records the timeline); None
    measures nothing. autocast_dtype: run the stages' forwards (and the loss) under torch.autocast in
    this dtype (bf16 mixed precision: the weights and their gradients stay fp32); None: as they are.
    Gradients accumulate into .grad like backward().
    """
    _check_step(schedule, stages, mesh, inputs, targets)
    return _Executor(schedule, stages, mesh, inputs, targets, loss_fn, activation_shape, dtype, position_ids,
                     on_grads_ready, observer, autocast_dtype).run()


def sync_tied_embeddings(stages: list[Stage], mesh) -> None:
    """Sum the tied embedding's gradient (first stage) with the LM head's (last stage), on both ranks.

    The first and the last stage each keep a copy of the tied matrix (Megatron-LM's embedding group
    does the same). Call this after the step's last backward, before the optimizer: both copies then
    get the same gradient, the one the tied matrix of a single process gets, and stay equal. A no-op
    on middle stages, for untied models, and where one rank holds both ends (pp=1).
    """
    first = next((s for s in stages if s.is_first), None)
    last = next((s for s in stages if s.is_last), None)
    if (first is None) == (last is None) or not (first or last).tied:
        return
    weight = first.embed.weight if first else last.lm_head.weight
    if weight.grad is None:
        raise RuntimeError(f"the {'embedding' if first else 'LM head'} has no gradient yet: call "
                           f"sync_tied_embeddings after run_schedule, before the optimizer step")
    peer = mesh.rank_of(pp=mesh.pp_size - 1 if first else 0)
    other = torch.empty_like(weight.grad)
    comm.send_recv(weight.grad, peer, other, peer)
    weight.grad += other   # a + b on one rank, b + a on the other: the same floats

"""Pipeline parallelism: the layers split into stages on p ranks, micro-batches flowing through them.

Rank r of the pp group holds a consecutive slice of the decoder layers (the first stage also the
embedding, the last one the final norm, the LM head and the loss). A micro-batch's activations
travel forward from stage to stage with point-to-point sends, its gradients travel back the same
way (Playbook, "Pipeline Parallelism"). Nothing else moves: per micro-batch and stage boundary,
one (batch, seq, hidden) activation forward and one gradient of that size backward, far less than
tensor parallelism's all-reduces inside every layer; pp therefore spans the slow links between
nodes (picotron/mesh.py puts it outermost).

Costs, with p stages, m micro-batches per optimizer step, F / B the time of one micro-batch's
forward / backward on one stage:

    weights, grads, optimizer state   divided by p (each rank holds its layers only)
    bubble        stage r waits r F for its first input, (p-1-r)(F+B) for the first gradient to
                  come back and r B at the end: (p-1)(F+B) idle per step beside m (F+B) of work,
                  an idle fraction of (p-1)/(m+p-1)
    activations   AFAB keeps all m micro-batches' activations until the backward; 1F1B at most
                  p - r on rank r (p on the first stage, whatever m is)

Schedules are data (picotron/parallel/pipeline_schedules.py): a `Schedule` lists, for every rank, the actions it runs in order, each an
`Action` ("F" forward, "B" backward, "W" weight gradient, of micro-batch i on stage s). The sends
and receives are implied: F on stage s > 0 receives its input from stage s - 1, B on stage s < S - 1
receives its output gradient from stage s + 1. One executor, `run_schedule`, runs any of them:

    naive         one batch, no micro-batching: F then B, one stage busy at a time (bubble (p-1)/p)
    afab          all forward, all backward, the GPipe schedule (Huang et al. 2019, arXiv:1811.06965)
    1f1b          one-forward-one-backward: p - r - 1 warm-up forwards, then alternate F and B, so
                  a micro-batch's activations are freed as early as possible. Same bubble as AFAB,
                  memory p - r instead of m micro-batches (PipeDream-Flush, Narayanan et al. 2021,
                  arXiv:2006.09503; as Megatron-LM runs it, arXiv:2104.04473). Playbook,
                  "One-forward-one-backward and LLama 3.1 schemes".
    interleaved   each rank holds v chunks of layers (stages r, r + p, ..., r + (v-1) p); each
                  chunk's F and B take 1/v of the time, so the warm-up and cool-down shrink v-fold:
                  bubble (p-1)/(v m + p-1), at the price of v times more sends (Narayanan et al.
                  2021, arXiv:2104.04473, section 2.2; Playbook, "Interleaving stages")
    zb-h1         zero bubble, handcrafted 1 (Qi et al. 2023, arXiv:2401.10241): the backward split
                  into B, the input gradient (which the previous stage waits for), and W, the weight
                  gradient (which nobody waits for). Rank r runs 1F1B with B only and lets its W lag
                  r micro-batches behind, filling the cool-down's idle time. Bubble (p-1)(F+B-W)
                  with F = B = W, a third of 1F1B's, same peak memory (p micro-batches on a rank).
                  Playbook, "Zero Bubble and DualPipe".

For every schedule `simulate` computes the timeline from unit costs (no torch) and
`bubble_formula` gives the textbook bubble; `run_schedule` records the real timeline (start and end
of every action, time.perf_counter) and `bubble_fraction` measures idle / total per rank from it.

B and W: B asks autograd for the gradient of the stage's input and, on the way, of the output of
every module that owns parameters (Linear, Embedding, RMSNorm), keeping the graph; W then asks,
module by module, for the parameters' gradients given those output gradients: for a Linear y = x A^T
that is exactly the dA = dy^T x product, the "weight GEMM" of the paper. The sums are the ones a
plain backward computes, so the gradients are equal (not approximations). For simplicity the whole
graph stays alive until W; an implementation tuned for memory frees what only B needed.

A tied embedding (the default model ties the LM head to the embedding) sits on the first and the
last stage at once. We keep a copy on each and sum the two gradients with one exchange between
those two ranks after the step (`sync_tied_embeddings`, what Megatron-LM does with its embedding
group): both copies then take the same optimizer step and stay equal. Refusing tied embeddings
under pp would have been simpler but would make pp fail on the default model.

Communication: sends are asynchronous; each action's pending sends are posted together with the
next action's receive in one batch_isend_irecv. Where two neighbours exchange (1F1B's steady state:
rank r sends an activation to r+1 and waits for a gradient from it while r+1 does the opposite) the
two directions are posted together, as Megatron-LM does: on NCCL a send waits for its receive, and
two ranks each sending first would wait for each other forever. Between two ranks messages match in
the order they are posted (no tags), so `check_schedule` verifies that every sender's order equals
its receiver's, as well as that the schedule runs without deadlock. The counter records each send
(payload bytes) and each receive (a call, no bytes), as picotron.comm does.

How to use it (same model on every rank, e.g. the same seed; gradient syncs after the step):

    stages = build_stages(model, mesh.pp_rank, mesh.pp_size, virtual_stages=1)
    optimizer = torch.optim.AdamW(stage_parameters(stages))
    schedule = make_schedule("1f1b", mesh.pp_size, num_microbatches=8)
    result = run_schedule(schedule, stages, mesh, inputs, targets, loss_fn,
                          activation_shape=(micro_batch, seq, hidden), counter=mesh.counter)
    sync_tied_embeddings(stages, mesh, counter=mesh.counter)   # first + last stage
    all_reduce_gradients(...)                                  # data parallelism: once, after the last micro-batch
    optimizer.step()
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.comm import CommCounter
from picotron.model import Llama, recompute
# The schedules themselves (data, checks, simulator, bubbles) live in their own file; every name is
# also reachable from here, so `pipeline_parallel.make_schedule(...)` reads as one technique.
from picotron.parallel.pipeline_schedules import (SCHEDULES, Action, Event, Schedule, afab_schedule, bubble_formula,
                                                  bubble_fraction, check_schedule, interleaved_schedule,
                                                  make_schedule, naive_schedule, one_f_one_b_schedule,
                                                  peak_in_flight, simulate, zb_h1_schedule)

__all__ = ["Action", "Schedule", "Event", "StepResult", "Stage", "stage_layers", "build_stages", "stage_parameters",
           "split_microbatches", "naive_schedule", "afab_schedule", "one_f_one_b_schedule", "interleaved_schedule",
           "zb_h1_schedule", "make_schedule", "SCHEDULES", "check_schedule", "simulate", "peak_in_flight",
           "bubble_fraction", "bubble_formula", "run_schedule", "sync_tied_embeddings"]


# ---- splitting the model -------------------------------------------------------------------------------
def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """Consecutive, balanced slices of the layers: stage s gets layers stage_layers(...)[s].

    Sizes differ by at most one; the first stages get the extra layers, since the last stage also
    computes the LM head and the loss.
    """
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers, but the model has "
                         f"{num_layers}; lower pp (or virtual_stages), or use a model with more layers")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


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
    num_stages = pp * virtual_stages
    if num_stages > model.config.num_layers:
        raise ValueError(f"pp={pp} x virtual_stages={virtual_stages} = {num_stages} stages need at least "
                         f"{num_stages} layers, but the model has num_layers={model.config.num_layers}; "
                         f"lower pp or virtual_stages, or use a model with more layers")
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


# ---- the executor ----------------------------------------------------------------------------------------
@dataclass
class StepResult:
    """What one pipeline step did on this rank."""
    loss: torch.Tensor | None             # sum over micro-batches of loss / m (the last stage's rank; else None)
    events: list[Event]                   # every action with its perf_counter start and end
    peak_activations: int                 # most (micro-batch, stage) graphs alive at once on this rank


@dataclass
class _Graph:
    """A micro-batch's forward on one stage, kept until its backward is done."""
    input: torch.Tensor                   # the stage's input (a leaf; its .grad goes to the previous stage)
    root: torch.Tensor                    # the output, or the scaled loss on the last stage
    weight_ops: list = field(default_factory=list)     # (module, output) of modules with parameters (B/W split)
    weight_grads: list = field(default_factory=list)   # their output gradients, left by B for W


class _Executor:
    """Runs one rank's action list: receives, computes, sends, and records the timeline."""

    def __init__(self, schedule: Schedule, stages: list[Stage], mesh, inputs, targets, loss_fn,
                 activation_shape, dtype, counter, on_grads_ready, position_ids=None):
        self.schedule, self.mesh, self.loss_fn = schedule, mesh, loss_fn
        self.position_ids = position_ids
        self.inputs, self.targets = inputs, targets
        self.activation_shape, self.dtype, self.counter = tuple(activation_shape), dtype, counter
        self.on_grads_ready = on_grads_ready
        self.stages = {stage.index: stage for stage in stages}
        self.device = next(stages[0].parameters()).device
        self.outbox: list[tuple[torch.Tensor, int]] = []   # sends of the last action, not posted yet
        self.posted: list = []                             # requests of posted sends, waited for at the end
        self.local: dict = {}                              # messages between two stages of this rank
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.grads_left = Counter({s: schedule.num_microbatches for s in self.stages})
        self.events: list[Event] = []
        self.loss = None
        self.peak = 0

    def run(self) -> StepResult:
        rank = self.mesh.pp_rank
        for action in self.schedule.actions[rank]:
            {"F": self.forward, "B": self.backward, "W": self.weight}[action.op](action.microbatch, action.stage)
        self._post()                     # the last sends
        comm.wait_all(self.posted)
        return StepResult(self.loss, self.events, self.peak)

    # ---- point-to-point -------------------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.mesh.rank_of(pp=self.schedule.rank_of(stage))

    def _send(self, kind: str, microbatch: int, from_stage: int, to_stage: int, tensor: torch.Tensor) -> None:
        dst = self._peer(to_stage)
        if dst == self.mesh.rank:        # the next chunk lives here too (pp=1): hand it over
            self.local[(kind, microbatch, from_stage)] = tensor
        else:
            self.outbox.append((tensor.contiguous(), dst))

    def _receive(self, kind: str, microbatch: int, from_stage: int) -> torch.Tensor:
        src = self._peer(from_stage)
        if src == self.mesh.rank:
            self._post()
            return self.local.pop((kind, microbatch, from_stage))
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        self._post(receive=(buffer, src))
        return buffer

    def _post(self, receive: tuple[torch.Tensor, int] | None = None) -> None:
        """Post the pending sends and this action's receive as one batch; wait for the receive only.

        Batching the two directions is what lets two neighbours that send to each other and then
        receive from each other (1F1B's steady state) both make progress on NCCL.
        """
        ops = [dist.P2POp(dist.isend, tensor, dst) for tensor, dst in self.outbox]
        if self.counter is not None:     # as picotron.comm counts: payload bytes per send, none per receive
            for tensor, _ in self.outbox:
                self.counter.record("send", tensor.numel() * tensor.element_size())
            if receive is not None:
                self.counter.record("recv", 0)
        self.outbox = []
        if receive is not None:
            ops.append(dist.P2POp(dist.irecv, *receive))
        if not ops:
            return
        requests = dist.batch_isend_irecv(ops)
        if receive is not None:
            requests[-1].wait()          # (NCCL may return one request for the batch: then it covers all)
            requests = requests[:-1]     # (and never wait twice: a second wait on a gloo receive hangs)
        # Forget the sends that are done, so their tensors can be freed before the step ends.
        self.posted = [r for r in self.posted if not r.is_completed()] + requests

    def _now(self) -> float:
        # On a GPU the host only queues the work: wait for it, so the clock sees when it really ran
        # (and a received tensor has really arrived). Costs the CPU's running ahead; fine to measure.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record(self, op: str, microbatch: int, stage: int, start: float) -> None:
        self.events.append(Event(self.mesh.pp_rank, op, microbatch, stage, start, self._now()))

    # ---- the three actions ---------------------------------------------------------------------------
    def forward(self, microbatch: int, s: int) -> None:
        stage = self.stages[s]
        if stage.is_first:
            self._post()                                                 # nothing to receive: just send
            x = self.inputs[microbatch]                                  # (batch, seq) token ids
        else:
            x = self._receive("activation", microbatch, s - 1).requires_grad_()   # (batch, seq, hidden)
        start = self._now()
        graph = _Graph(x, None)
        with _record_weight_ops(stage, graph.weight_ops, self.schedule.split_backward):
            y = stage(x) if self.position_ids is None else stage(x, self.position_ids[microbatch])
        if stage.is_last:
            # Mean of the m micro-batch means: the loss of the whole batch (equal micro-batches).
            graph.root = self.loss_fn(y, self.targets[microbatch]) / self.schedule.num_microbatches
            self.loss = graph.root.detach() if self.loss is None else self.loss + graph.root.detach()
        else:
            graph.root = y
        self.graphs[(microbatch, s)] = graph
        self.peak = max(self.peak, len(self.graphs))
        self._record("F", microbatch, s, start)
        if not stage.is_last:
            self._send("activation", microbatch, s, s + 1, y.detach())

    def backward(self, microbatch: int, s: int) -> None:
        stage, graph = self.stages[s], self.graphs[(microbatch, s)]
        if stage.is_last:
            self._post()                 # nothing to receive: the loss is where the backward starts
            grad = None
        else:
            grad = self._receive("gradient", microbatch, s + 1)                 # (batch, seq, hidden)
        start = self._now()
        if self.schedule.split_backward:
            # B: the input's gradient, and the gradients of the parameter-owning modules' outputs for W.
            wanted = ([] if stage.is_first else [graph.input]) + [out for _, out in graph.weight_ops]
            grads = torch.autograd.grad(graph.root, wanted, grad, retain_graph=True, allow_unused=True)
            input_grad = None if stage.is_first else grads[0]
            graph.weight_grads = list(grads[0 if stage.is_first else 1:])
        else:
            torch.autograd.backward(graph.root, grad)                   # input and weight gradients
            input_grad = graph.input.grad
            del self.graphs[(microbatch, s)]
        self._record("B", microbatch, s, start)
        if not self.schedule.split_backward:
            self._grads_done(s)
        if not stage.is_first:
            self._send("gradient", microbatch, s, s - 1, input_grad)

    def weight(self, microbatch: int, s: int) -> None:
        graph = self.graphs.pop((microbatch, s))
        self._post()
        start = self._now()
        for (module, output), output_grad in zip(graph.weight_ops, graph.weight_grads):
            if output_grad is None:      # this output did not reach the loss
                continue
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            # Only the path from the output back to the module's own weights: dA = dy^T x for a Linear.
            for param, grad in zip(params, torch.autograd.grad(output, params, output_grad)):
                param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._record("W", microbatch, s, start)
        self._grads_done(s)

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


def run_schedule(schedule: Schedule, stages: list[Stage], mesh, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None, loss_fn: Callable, activation_shape: tuple[int, ...], *,
                 dtype: torch.dtype = torch.float32, counter: CommCounter | None = None,
                 position_ids: list[torch.Tensor] | None = None,
                 on_grads_ready: Callable[[int], None] | None = None) -> StepResult:
    """Run this rank's part of one step of `schedule`: gradients of loss / m summed over the micro-batches.

    inputs: the m micro-batches' inputs (used on the rank holding stage 0; others may pass None).
    targets: their targets (used on the rank holding the last stage). loss_fn(output, target) is the
    mean loss of one micro-batch; it is divided by m here. activation_shape: what travels between
    stages, e.g. (micro_batch, seq, hidden). position_ids: the m micro-batches' token positions, for
    every stage's rotary embedding (None: 0..seq-1; context parallelism passes its slice's positions).
    on_grads_ready(stage): called when a stage's gradients
    are final (after its last micro-batch's backward), the moment a data-parallel all-reduce of that
    stage could start; or sync after this returns. Gradients accumulate into .grad like backward().
    """
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
    executor = _Executor(schedule, stages, mesh, inputs, targets, loss_fn, activation_shape, dtype, counter,
                         on_grads_ready, position_ids)
    return executor.run()


def sync_tied_embeddings(stages: list[Stage], mesh, *, counter: CommCounter | None = None) -> None:
    """Sum the tied embedding's gradient (first stage) with the LM head's (last stage), on both ranks.

    Call it after the step's last backward, before the optimizer: both copies of the matrix then
    get the same gradient, the gradient the one tied matrix of a single process gets, and stay equal.
    A no-op on middle stages, for untied models, and where one rank holds both ends (pp=1).
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
    comm.send_recv(weight.grad, peer, other, peer, counter=counter)
    weight.grad += other   # a + b on one rank, b + a on the other: the same floats

"""Measuring training memory: every tensor a step creates, counted to the byte.

picotron.memory writes the formula; this module measures what a real (or fake) training step
really allocates, so that the two can be compared term by term (chapters/01_memory.ipynb):

- `MemoryTracker`, a TorchDispatchMode that sees every op's outputs and when their storages are
  freed: the live bytes at every moment, by kind (parameters, gradients, optimizer state,
  activations), and their peak;
- `measure_memory(config, batch, seq, precision=..., fake=...)`, a training step under the tracker,
  returned as the same MemoryBreakdown the formula gives (fake=True: FakeTensorMode, so a
  Llama-3-8B shape is measured without its memory);
- `saved_tensors(output)`, the tensors autograd keeps for backward, read from the graph, and
  `SavedActivations`, the same through saved-tensor hooks on a running rank;
- `step_peaks(series, step_starts)`, the most bytes alive in each training step of a timeline (the
  tracker's, or one read from the CUDA allocator's history).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from picotron.config import ModelConfig
from picotron.memory import MemoryBreakdown, precision_of
from picotron.model import Llama, loss_fn

@dataclass
class Block:
    """One tensor storage: its bytes, what it holds, and when (event index) it was made and freed."""

    nbytes: int
    category: str
    born: int
    died: int | None = None


class MemoryTracker(TorchDispatchMode):
    """Counts the bytes of every storage the ops create, from its creation until it is freed.

    Each op passes through __torch_dispatch__; an output whose storage is not one of the inputs'
    is a new allocation, and a weak reference tells us when its last tensor dies. That sees
    everything, including what torch.utils.checkpoint keeps (saved-tensor hooks alone miss it),
    and works the same on CPU, GPU, meta and FakeTensorMode tensors: the size is in the storage,
    whether or not memory was really allocated. New storages are "activations" during forward,
    "temporaries" otherwise, until `label` names them gradients or optimizer state.
    """

    CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "temporaries")

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.blocks: list[Block] = []
        self.phases: list[tuple[int, str]] = []        # (event, phase) where each phase starts
        self.step_starts: list[int] = []               # event at which each optimizer step began
        self.events = 0                                # allocations + frees so far: the clock
        self.stopped: int | None = None                # event at which the tracker was exited
        self.live_bytes = self.peak_bytes = 0
        self._live: dict[int, tuple[Block, weakref.ref]] = {}   # id(storage) -> block, weak ref

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:
                self._add(t, "activations" if self.phase == "forward" else "temporaries", tick=True)
        return out

    def __exit__(self, *exc):
        self.stopped = self.events                     # later frees (the caller's clean-up) are not plotted
        return super().__exit__(*exc)

    def _add(self, tensor: torch.Tensor, category: str, tick: bool = False) -> Block:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:                          # a view or an in-place result: not new
            return self._live[key][0]
        block = Block(storage.nbytes(), category, born=self.events)
        self._live[key] = (block, weakref.ref(storage, lambda _, key=key: self._free(key)))
        self.blocks.append(block)
        self.events += tick                            # an allocation moves the clock; labelling does not
        self.live_bytes += block.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return block

    def _free(self, key: int) -> None:
        block, _ = self._live.pop(key)
        block.died = self.events
        self.events += 1
        self.live_bytes -= block.nbytes

    def label(self, tensors, category: str) -> None:
        """Name what these tensors' storages hold, for their whole life (tracked now if they were not)."""
        for t in tensors:
            self._add(t, category).category = category

    @contextlib.contextmanager
    def during(self, phase: str):
        """Mark the ops inside as `phase` ("forward", "backward", "optimizer")."""
        previous, self.phase = self.phase, phase
        self.phases.append((self.events, phase))
        try:
            yield
        finally:
            self.phase = previous

    def live(self, category: str) -> int:
        """Bytes alive now in `category`."""
        return sum(block.nbytes for block, _ in self._live.values() if block.category == category)

    def timeline(self) -> dict[str, list[int]]:
        """Bytes alive in each category after every event (index = event number) until the tracker exited."""
        end = self.events if self.stopped is None else self.stopped
        series = {}
        for category in self.CATEGORIES:
            change = [0] * (end + 1)
            for block in self.blocks:
                if block.category == category and block.born <= end:
                    change[block.born] += block.nbytes
                    if block.died is not None and block.died <= end:
                        change[block.died] -= block.nbytes
            running, series[category] = 0, []
            for delta in change:
                running += delta
                series[category].append(running)
        return series


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a tied weight counts once)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


@dataclass
class Measurement:
    measured: MemoryBreakdown
    peak: int                                   # most bytes alive at once, parameters included
    tracker: MemoryTracker = field(repr=False)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules in `dtype`: under FakeTensorMode a model cannot be converted after it is built."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def measure_memory(config: ModelConfig, batch: int, seq: int, *, precision: str = "fp32", micro_batches: int = 1,
                   steps: int = 2, fake: bool = False, seed: int = 0, set_to_none: bool = True) -> Measurement:
    """Train `steps` AdamW steps of `micro_batches` x (batch, seq) tokens and measure what stays in memory.

    From the second step on the optimizer state exists during forward and backward: torch's AdamW
    creates it lazily, in the first `step()`. That second step is the steady state, whose peak
    matters. Each step starts with `zero_grad(set_to_none)`: True (torch's default) frees the
    gradients until backward makes them again; False keeps them, zeroed, through the next forward.
    fake=True runs under FakeTensorMode: every op computes shapes only, so a Llama-3-8B step takes a
    second and no memory. bf16-mixed trains a bf16 model from fp32
    master weights; its optimizer step makes fp32 copies of the gradients (4 bytes per parameter
    during the step, which some frameworks keep for good).
    """
    mixed = precision_of(precision).param == 2                          # bf16 weights, fp32 master copy
    dtype = torch.bfloat16 if mixed else torch.float32
    with FakeTensorMode() if fake else contextlib.nullcontext(), default_dtype(dtype):
        torch.manual_seed(seed)
        model = Llama(config)
        master = [w.detach().float() for w in model.parameters()] if mixed else None    # fp32 master weights
        optimizer = torch.optim.AdamW(master or model.parameters(), lr=1e-4)
        data = torch.randint(0, config.vocab_size, (steps, micro_batches, 2, batch, seq))  # input ids, targets
        tracker = MemoryTracker()
        tracker.label(model.parameters(), "parameters")
        tracker.label(master or [], "optimizer state")
        activations = []
        with tracker:
            for step in range(steps):
                activations += tracked_step(model, optimizer, data[step], tracker, master, set_to_none)
        measured = MemoryBreakdown(
            parameters=tensor_bytes(model.parameters()),
            gradients=tensor_bytes(w.grad for w in model.parameters()),
            optimizer=tensor_bytes([*(master or []), *optimizer_state(optimizer)]),
            activations=max(activations))
    return Measurement(measured, tracker.peak_bytes, tracker)


def tracked_step(model: Llama, optimizer: torch.optim.Optimizer, micro_batches: torch.Tensor,
                 tracker: MemoryTracker, master: list[torch.Tensor] | None = None,
                 set_to_none: bool = True) -> list[int]:
    """One optimizer step with gradient accumulation; returns the activation bytes after each forward."""
    tracker.step_starts.append(tracker.events)
    model.zero_grad(set_to_none=set_to_none)
    activations = []
    for input_ids, targets in micro_batches:
        with tracker.during("forward"):
            loss = loss_fn(model(input_ids), targets) / len(micro_batches)   # mean over the whole batch
        activations.append(tracker.live("activations"))
        with tracker.during("backward"):
            loss.backward()
        del loss
    tracker.label([w.grad for w in model.parameters()], "gradients")
    with tracker.during("optimizer"):
        if master is None:
            optimizer.step()
        else:  # mixed precision: step the fp32 master weights, then round them into the bf16 model
            for fp32, weight in zip(master, model.parameters()):
                fp32.grad = weight.grad.float()
            optimizer.step()
            with torch.no_grad():
                for fp32, weight in zip(master, model.parameters()):
                    weight.copy_(fp32)
                    fp32.grad = None
    tracker.label(optimizer_state(optimizer), "optimizer state")
    return activations


def optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def step_peaks(series: dict[str, list[int]], step_starts: list[int]) -> list[int]:
    """The most bytes alive at once (all kinds of `series` together) in each step: from its start event to the
    next step's start, the last step to the end of the timeline."""
    total = [sum(values) for values in zip(*series.values())]
    if not step_starts or step_starts[0] < 0 or step_starts[-1] >= len(total):
        raise ValueError(f"step_starts {step_starts} must be events of the timeline (0 to {len(total) - 1}), "
                         "one per step, in order")
    ends = [*step_starts[1:], len(total)]
    return [max(total[start:end]) for start, end in zip(step_starts, ends)]


@dataclass
class SavedTensor:
    op: str                  # the backward node that saved it, e.g. "MmBackward0"
    slot: str                # which of its inputs or outputs, e.g. "self", "mat2", "result"
    shape: tuple
    dtype: torch.dtype
    nbytes: int              # of the whole storage
    storage: int             # id of the storage: rows with the same id share memory


def saved_tensors(output: torch.Tensor, exclude=()) -> list[SavedTensor]:
    """Every tensor autograd saved to compute the backward of `output`, in forward order.

    Walks the graph from output.grad_fn and reads each node's `_saved_*` slots. Tensors in
    `exclude` (parameters, shared tables) are left out.
    """
    skip = {id(t.untyped_storage()) for t in exclude}
    nodes, stack = {}, [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node not in nodes:
            nodes[node] = node._sequence_nr()           # creation order in the forward pass
            stack.extend(child for child, _ in node.next_functions)
    rows = []
    for node in sorted(nodes, key=nodes.get):
        for name in dir(node):
            value = getattr(node, name) if name.startswith("_saved_") else None
            for t in (value if isinstance(value, (tuple, list)) else [value]):
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in skip:
                    rows.append(SavedTensor(node.name(), name[len("_saved_"):], tuple(t.shape), t.dtype,
                                            t.untyped_storage().nbytes(), id(t.untyped_storage())))
    return rows


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Peak bytes of the activations autograd keeps for backward, measured on a real rank.

        with SavedActivations() as saved:
            trainer.train_step(0)               # any forward/backward, pipeline schedules included
        saved.peak                              # most bytes saved for backward at once

    Every tensor an op saves (saved-tensor hooks) counts once per storage, from when it is first
    saved until its storage is freed (a weak reference tells): micro-batches in flight add up, a
    finished backward frees its own. Parameters (and tensors in `exclude`) are weights, not
    activations, and are skipped. What the formulas of estimate_memory count, on any rank and
    layout; unlike MemoryTracker it sees no temporaries and works while collectives run.
    """

    def __init__(self, exclude=()):
        self.skip = {id(t.untyped_storage()) for t in exclude}
        self.live: dict[int, int] = {}                   # id(storage) -> bytes
        self.live_bytes = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}
        super().__init__(self._pack, lambda tensor: tensor)

    def __enter__(self) -> "SavedActivations":
        super().__enter__()
        return self

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor._base if tensor._base is not None else tensor, torch.nn.Parameter):
            return tensor                                # a weight (or a view of one, e.g. W^T in a matmul)
        storage = tensor.untyped_storage()
        key = id(storage)
        if key not in self.skip and key not in self.live:
            self.live[key] = storage.nbytes()
            self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.live_bytes += self.live[key]
            self.peak = max(self.peak, self.live_bytes)
        return tensor

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)
        self._refs.pop(key, None)

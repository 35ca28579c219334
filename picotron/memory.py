"""Where the memory of a training step goes: a formula, and a measurement to check it against.

A training step keeps four kinds of tensors (Playbook, "Memory usage in Transformers"):

    parameters       N numbers
    gradients        N numbers, one per parameter
    optimizer state  AdamW's two moments (and, in mixed precision, an fp32 master copy of the weights)
    activations      what the forward pass saves for the backward pass: grows with batch x sequence

Bytes per parameter (parameters + gradients + optimizer state), N = ModelConfig.num_params():

    fp32        4 + 4 + 8  = 16
    bf16-mixed  2 + 2 + 12 = 16   bf16 weights and gradients; fp32 master weights, Adam m and v
                                  (Micikevicius et al. 2018, arXiv:1710.03740; frameworks that also
                                  keep fp32 gradients pay 4 more)

plus AdamW's step counter, one fp32 scalar per parameter tensor.

Activations of one decoder layer of picotron's Llama, in bytes (b batch, s sequence, h hidden,
n_q / n_kv query / key-value heads of width d, f MLP width, a bytes per activation: 4 in fp32,
2 in bf16), counting what autograd really saves (chapter 01 lists it tensor by tensor):

    RMSNorm, twice   (4 + 2a) b s h + 4 b s   fp32 input, normalised x, output; 1/rms per token
    attention        a b s (2 n_q d + 2 n_kv d) q and k after RoPE, v, attention output
        sdpa         + 4 b n_q s                log-sum-exp per query row (fp32)
        eager        + 2a b s (n_q - n_kv) d     k and v copied for every query head (GQA)
                     + a b n_q s^2              softmax probabilities: the quadratic term
    SwiGLU MLP       4 a b s f                  gate out, silu(gate), up out, their product

Recomputation keeps less: "selective" drops the attention core's own tensors (the last two
lines of attention), "full" keeps only each layer's input, a b s h. Once per model: the final
RMSNorm, the fp32 log-probabilities of the loss, 4 b s V, and the RoPE cos/sin rows, 2 s d a.

`estimate_memory` adds it all up from the configs; `measure_memory` runs a real (or fake)
training step under `MemoryTracker` and returns the same breakdown, measured.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from picotron.config import ModelConfig, ParallelConfig, TrainConfig, check_zero_stage
from picotron.model import Llama, loss_fn
from picotron.train import flops_per_token

GiB = 2**30


# ---- The formula ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each state, and per element of an activation."""

    param: int
    grad: int
    optimizer: int
    activation: int


PRECISIONS = {"fp32": Precision(param=4, grad=4, optimizer=8, activation=4),
              "bf16-mixed": Precision(param=2, grad=2, optimizer=12, activation=2)}


def precision_of(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r}; choose one of {sorted(PRECISIONS)}")
    return PRECISIONS[name]


def num_param_tensors(config: ModelConfig) -> int:
    """Parameter tensors: 9 per layer (q, k, v, o, gate, up, down, two norms), embedding, final norm, head."""
    return 9 * config.num_layers + 2 + (0 if config.tie_word_embeddings else 1)


def activation_bytes_per_layer(config: ModelConfig, batch: int, seq: int, *, dtype_bytes: int = 4) -> int:
    """Bytes one decoder layer saves for backward, for config.attention and config.recompute."""
    a, tokens = dtype_bytes, batch * seq
    q_width = config.num_attention_heads * config.head_dim                 # n_q d
    kv_width = config.num_key_value_heads * config.head_dim                # n_kv d
    if config.recompute == "full":
        return a * tokens * config.hidden_size                              # the layer input, kept by the checkpoint
    norms = 2 * rms_norm_bytes(tokens, config.hidden_size, a)
    attention = a * tokens * (2 * q_width + 2 * kv_width)                  # q, k (after RoPE), v, output
    mlp = 4 * a * tokens * config.intermediate_size                        # gate, silu(gate), up, product
    if config.recompute == "none":
        attention += attention_core_bytes(config, batch, seq, a)
    return norms + attention + mlp


def rms_norm_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Input in fp32 (pow and mul save it), normalised x and the output (read by the next matmuls), 1/rms."""
    return (4 + 2 * dtype_bytes) * tokens * hidden + 4 * tokens


def attention_core_bytes(config: ModelConfig, batch: int, seq: int, dtype_bytes: int) -> int:
    """What the core softmax(q k^T) v saves beyond its inputs and output: selective recomputation drops it."""
    heads = config.num_attention_heads
    if config.attention == "sdpa":
        return 4 * batch * heads * seq                                     # fp32 log-sum-exp per query row
    kv_copies = 2 * dtype_bytes * batch * seq * (heads - config.num_key_value_heads) * config.head_dim
    return kv_copies + dtype_bytes * batch * heads * seq * seq             # (b, n_q, s, s) probabilities


def activation_bytes(config: ModelConfig, batch: int, seq: int, *, dtype_bytes: int = 4) -> int:
    """Activation bytes of the whole model for one micro-batch of (batch, seq) tokens."""
    tokens = batch * seq
    return (config.num_layers * activation_bytes_per_layer(config, batch, seq, dtype_bytes=dtype_bytes)
            + rms_norm_bytes(tokens, config.hidden_size, dtype_bytes)     # final norm
            + 4 * tokens * config.vocab_size                               # fp32 log-probabilities of the loss
            + 2 * seq * config.head_dim * dtype_bytes)                     # RoPE cos/sin rows, shared by all layers


@dataclass
class MemoryBreakdown:
    """Bytes of one rank's training state. `total` is what must fit in the accelerator's memory,
    before temporaries (logits' gradients, a recomputed layer) and allocator fragmentation."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations

    def as_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer state": self.optimizer,
                "activations": self.activations, "total": self.total}

    def __str__(self) -> str:
        return "\n".join(f"{name:<16}{value / GiB:>10.3f} GiB" for name, value in self.as_dict().items())


def comparison_table(formula: MemoryBreakdown, measured: MemoryBreakdown) -> str:
    """Formula next to measurement, component by component, in MiB (GiB when the total passes 1 GiB)."""
    unit, unit_name = (GiB, "GiB") if formula.total > GiB else (2**20, "MiB")
    lines = [f"{'':<16}{'formula (' + unit_name + ')':>16}{'measured':>14}{'measured/formula':>18}"]
    for (name, f), m in zip(formula.as_dict().items(), measured.as_dict().values()):
        lines.append(f"{name:<16}{f / unit:>16.4f}{m / unit:>14.4f}{m / f:>18.6f}")
    return "\n".join(lines)


def estimate_memory(model_config: ModelConfig, train_config: TrainConfig,
                    parallel_config: ParallelConfig | None = None, *, precision: str = "fp32") -> MemoryBreakdown:
    """Bytes per rank of training `model_config` with `train_config`'s micro-batch and sequence.

    Activations are those of one micro-batch: with gradient accumulation each micro-batch's
    backward frees them before the next forward, so grad_accum_steps does not appear.
    """
    if model_config.num_experts > 0:
        raise NotImplementedError(f"num_experts={model_config.num_experts}: the activation formula covers the dense "
                                  f"MLP only (an MoE layer's activations depend on the routing); measure an MoE "
                                  f"model with measure_memory instead")
    p = precision_of(precision)
    n = model_config.num_params()
    whole = MemoryBreakdown(
        parameters=p.param * n, gradients=p.grad * n,
        optimizer=p.optimizer * n + 4 * num_param_tensors(model_config),  # + AdamW's fp32 step counters
        activations=activation_bytes(model_config, train_config.micro_batch_size, train_config.seq_len,
                                     dtype_bytes=p.activation))
    return per_rank(whole, parallel_config or ParallelConfig())


def per_rank(whole: MemoryBreakdown, parallel: ParallelConfig) -> MemoryBreakdown:
    """What one rank holds. Plain data parallelism replicates everything: each rank keeps the whole
    model and the activations of its own micro-batch. The chapters that shard add their rule here.

    ZeRO (chapter 03) splits state over the N = dp ranks instead: stage 1 the optimizer state,
    stage 2 the gradients too, stage 3 the parameters too (Playbook, "ZeRO (Zero Redundancy
    Optimizer)"); activations stay per rank. This is the Playbook's rule, each sharded term / N
    (rounded up). picotron.parallel.zero.zero_state_bytes gives the exact bytes of picotron's
    implementation, which pads each flat group to a multiple of N and keeps one AdamW step
    counter per group (instead of one per parameter tensor): a few bytes per group apart.
    """
    for axis, chapter in (("tp", "04, tensor parallelism"), ("cp", "05, context parallelism"),
                          ("pp", "06, pipeline parallelism")):
        if getattr(parallel, axis) > 1:
            raise NotImplementedError(f"{axis}={getattr(parallel, axis)}: the memory model of chapter {chapter} "
                                      f"is not written yet; estimate with {axis}=1")
    check_zero_stage(parallel.zero_stage)
    stage, n = parallel.zero_stage, parallel.dp

    def shard(nbytes: int, from_stage: int) -> int:
        return -(-nbytes // n) if stage >= from_stage else nbytes

    return MemoryBreakdown(parameters=shard(whole.parameters, 3), gradients=shard(whole.gradients, 2),
                           optimizer=shard(whole.optimizer, 1), activations=whole.activations)


def recompute_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Extra training FLOPs per token that config.recompute costs (hardware FLOPs minus model FLOPs).

    One more forward of what is recomputed: the attention core is 2 matmuls of 2 s n_q d FLOPs per
    token per layer; a whole layer adds 2 FLOPs per layer parameter per token on top of that.
    """
    core = 4 * config.num_layers * seq_len * config.num_attention_heads * config.head_dim
    if config.recompute == "none":
        return 0
    if config.recompute == "selective":
        return core
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    layer_params = config.num_active_params() - embeddings - config.hidden_size  # per token; not embedding, head, final norm
    return 2 * layer_params + core


def training_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """6N + 12 L h s (picotron.train.flops_per_token), plus what recomputation runs again."""
    return flops_per_token(config, seq_len) + recompute_flops_per_token(config, seq_len)


# ---- Measuring it -----------------------------------------------------------------------------

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
                   steps: int = 2, fake: bool = False, seed: int = 0) -> Measurement:
    """Train `steps` AdamW steps of `micro_batches` x (batch, seq) tokens and measure what stays in memory.

    From the second step on the optimizer state exists during forward and backward: the steady
    state, whose peak matters. fake=True runs under FakeTensorMode: every op computes shapes only,
    so a Llama-3-8B step takes a second and no memory. bf16-mixed trains a bf16 model from fp32
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
                activations += tracked_step(model, optimizer, data[step], tracker, master)
        measured = MemoryBreakdown(
            parameters=tensor_bytes(model.parameters()),
            gradients=tensor_bytes(w.grad for w in model.parameters()),
            optimizer=tensor_bytes([*(master or []), *optimizer_state(optimizer)]),
            activations=max(activations))
    return Measurement(measured, tracker.peak_bytes, tracker)


def tracked_step(model: Llama, optimizer: torch.optim.Optimizer, micro_batches: torch.Tensor,
                 tracker: MemoryTracker, master: list[torch.Tensor] | None = None) -> list[int]:
    """One optimizer step with gradient accumulation; returns the activation bytes after each forward."""
    model.zero_grad(set_to_none=True)
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

"""The checks of assignment 01: count the memory of a training step, then spend less of it.

Each check compares the learner's answer with a measurement made here, never with a formula
and never with picotron.memory or picotron.model.recompute, the code the assignment rebuilds:

    check_num_params(num_params)                         sum(p.numel()) of the model built on the meta device
    check_activation_bytes(activation_bytes_per_layer)   the storages autograd saves for one decoder layer
    check_recompute(recompute)                           gradients bit-equal to the plain ones; nothing saved inside
    check_checkpoint_plan(peak_saved_bytes, checkpoint_plan)
                                                         (stretch) the peak of every plan of a layer stack, measured;
                                                         the fewest recomputed layers under a budget

Activations are measured with saved-tensor hooks (`SavedStorages`; picotron's `SavedActivations`
for a peak over forward and backward): autograd hands every tensor it saves for backward to a
pack hook, which notes its storage. Several saves of one storage (a view, or one tensor read by
three matmuls) count once; parameters and the RoPE cos/sin rows, which all layers share, are not
activations and are left out.

No ranks here: everything runs in one process, on one thread. A wrong answer fails its row
with a hint that names the likely mistake (a forgotten final norm, k and v as wide as q under
GQA, ...); an unsolved one raises NotImplementedError, which goes through untouched.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from picotron import tolerance
from picotron.config import PRESETS, ModelConfig
from picotron.memory_tracking import SavedActivations
from picotron.model import DecoderLayer, Llama, Rotary, eager_attention
from picotron.model import recompute as course_recompute
from picotron_course.checks import Report, one_thread, refusing

__all__ = ["check_num_params", "check_activation_bytes", "check_recompute", "check_checkpoint_plan", "SavedStorages",
           "saved_by_layer", "measure_plan", "PARAM_SHAPES", "ACTIVATION_CASES", "RECOMPUTE_CASES", "PLAN_SHAPES"]


# ---- tools -----------------------------------------------------------------------------------
class SavedStorages:
    """Inside `with SavedStorages() as saved:`, note every tensor autograd saves for backward.

    `saved.bytes()` sums the distinct storages of those tensors that are still held (by a graph
    whose output is alive, or by anything else): several saves of one storage count once, and a
    graph built and dropped inside the block counts nothing. Call it while the outputs are alive.
    0-dim tensors (a scalar divisor) are left out: a few bytes no formula counts.
    """

    def __init__(self):
        self.saved: list[weakref.ref] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0:
            self.saved.append(weakref.ref(t))
        return t  # the tensor itself: backward gets what it would have got; the graph holds it

    def __enter__(self) -> "SavedStorages":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def storages(self, besides=()) -> dict[int, torch.Tensor]:
        """One live saved tensor per storage (by address, first saved first), leaving out those of `besides`."""
        skip = {_address(t) for t in besides}
        first: dict[int, torch.Tensor] = {}
        for t in (ref() for ref in self.saved):
            if t is not None and _address(t) not in skip:
                kept = first.setdefault(_address(t), t)
                if t.dim() > kept.dim():  # show (batch, seq, hidden), not the (batch*seq, hidden) a matmul saved
                    first[_address(t)] = t
        return first

    def bytes(self, besides=()) -> int:
        """Bytes of the live saved storages, not counting those of `besides` (parameters, a wrapper's inputs)."""
        return sum(t.untyped_storage().nbytes() for t in self.storages(besides).values())


def _address(t: torch.Tensor) -> int:
    # Saved tensors stay alive until backward, so no two of them share an address unless they share memory.
    return t.untyped_storage().data_ptr()


def saved_by_layer(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> list:
    """(shape, dtype, bytes) of each distinct storage one decoder layer saves for backward, in forward order.

    Parameters and the RoPE cos/sin rows are left out; a storage saved as several views shows the
    shape with the most dimensions.
    """
    layer, x, cos, sin = _layer_and_input(config, batch, seq, dtype)
    with SavedStorages() as saved:
        out = layer(x, cos, sin)  # noqa: F841 (kept alive: its graph holds the saved tensors)
    return [(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
            for t in saved.storages(besides=[*layer.parameters(), cos, sin]).values()]


def _layer_and_input(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype):
    torch.manual_seed(0)
    layer = DecoderLayer(config).to(dtype)
    cos, sin = Rotary(config).to(dtype)(torch.arange(seq)[None])  # (1, 1, seq, head_dim) each
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    return layer, x, cos, sin




# The code the assignment rebuilds: a learner's answer must not call it.
MEMORY_FILE = importlib.util.find_spec("picotron.memory").origin
COSTS_FILE = importlib.util.find_spec("picotron.costs").origin      # the one-process formulas memory builds on
CHECKPOINT_FILE = torch.utils.checkpoint.__file__




# ==== 1. the parameter count ====================================================================
# Every dense preset (the assignment counts the dense Llama; MoE presets are chapter 07's), tied and
# untied, and three shapes the presets lack: multi-head attention (as many key-value heads as query
# heads), multi-query attention (one), and head_dim * heads != hidden.
PARAM_SHAPES: list[tuple[str, ModelConfig]] = [
    (f"{name}, {'tied' if tie else 'untied'}", dataclasses.replace(ModelConfig.preset(name), tie_word_embeddings=tie))
    for name in PRESETS if not PRESETS[name].get("num_experts") for tie in (True, False)
] + [
    ("MHA, untied", ModelConfig(num_key_value_heads=4, num_layers=6, tie_word_embeddings=False)),
    ("MQA, tied", ModelConfig(num_key_value_heads=1, num_layers=2, vocab_size=1000)),
    ("head_dim 32 x 4 != h 96, tied", ModelConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=32, intermediate_size=256, num_layers=3)),
]


def check_num_params(num_params: Callable[[ModelConfig], int]) -> None:
    """num_params(config) equals the parameters of picotron's Llama built with that config, counted."""
    answers = {MEMORY_FILE: "picotron.memory", ModelConfig.num_params.__code__: "ModelConfig.num_params",
               Llama.__init__.__code__: "Llama(config) (building the model counts it for you)"}
    with Report("num_params", note="expected: sum(p.numel() for p in model.parameters()) of "
                                   "Llama(config) built on the meta device") as report, one_thread():
        for name, config in PARAM_SHAPES:
            with torch.device("meta"):  # shapes without memory: the 8B model builds in a moment
                model = Llama(config)
            counted = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
            with refusing("num_params", answers):
                got = num_params(dataclasses.replace(config))  # a copy: the answer cannot change our config
            ok = isinstance(got, int) and got == counted
            detail = "" if ok else _param_hint(model, config, got, counted)
            report.add(ok, detail, shape=name, layers=config.num_layers,
                       **{"heads q/kv": f"{config.num_attention_heads}/{config.num_key_value_heads}",
                          "counted": f"{counted:,}", "yours": _number(got),
                          "yours - counted": _difference(got, counted)})


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) else repr(value)


def _difference(got, expected: int) -> str:
    return f"{got - expected:+,}" if isinstance(got, int) else "?"


def _param_hint(model: Llama, config: ModelConfig, got, counted: int) -> str:
    """Name the mistake from the measured sizes of the model's parts, when one explains the difference."""
    if not isinstance(got, int):
        return f"return an int, the number of parameters (got {type(got).__name__} {got!r})"
    layers, layer = config.num_layers, model.layers[0]
    n = lambda *modules: sum(p.numel() for m in modules for p in m.parameters(recurse=False))  # noqa: E731
    attn, mlp = layer.attn, layer.mlp
    q_width_h = config.hidden_size * config.hidden_size  # a q or o matrix if head_dim were hidden / heads
    hints = [
        (-n(model.norm), f"the final RMSNorm is missing ({config.hidden_size} weights, after the last layer)"),
        (-layers * n(layer.attn_norm, layer.mlp_norm),
         "the RMSNorm weights of the layers are missing: two per layer, hidden_size each"),
        (-layers * n(layer.attn_norm), "each layer has two RMSNorms (before attention, before the MLP), not one"),
        (n(model.embed) if config.tie_word_embeddings else 0,
         "the tied embedding is counted twice: with tie_word_embeddings=True the LM head is the embedding matrix"),
        (0 if config.tie_word_embeddings else -n(model.lm_head),
         "the LM head is missing: with tie_word_embeddings=False it is its own vocab x hidden matrix"),
        (-n(model.embed), "the token embedding (vocab x hidden) is missing"),
        (layers * (2 * n(attn.q_proj) - n(attn.k_proj, attn.v_proj)),
         "k_proj and v_proj are counted as wide as q_proj: under GQA they have num_key_value_heads * head_dim "
         "outputs, not num_attention_heads * head_dim"),
        (layers * 2 * (q_width_h - n(attn.q_proj)),
         "q_proj and o_proj are hidden x (num_attention_heads * head_dim); head_dim is a field of the config and "
         "need not be hidden_size / num_attention_heads"),
        (layers * (2 * config.hidden_size * (config.num_attention_heads + config.num_key_value_heads)
                   * (config.hidden_size // config.num_attention_heads) - n(attn.q_proj, attn.k_proj, attn.v_proj,
                                                                        attn.o_proj)),
         f"head_dim is a field of the config ({config.head_dim} here), not always hidden_size / num_attention_heads "
         f"({config.hidden_size // config.num_attention_heads})"),
        (-layers * n(mlp.gate_proj), "the SwiGLU MLP has three matrices (gate, up, down), not two"),
        (model.rope.cos.numel() + model.rope.sin.numel(),
         "the RoPE cos/sin tables are counted: they are buffers computed from positions, not parameters"),
    ]
    matches = [hint for difference, hint in hints if difference and got - counted == difference]
    if matches:  # two mistakes can cost the same number of parameters: name both
        return f"off by {got - counted:+,}: " + "; or ".join(matches)
    return (f"off by {got - counted:+,}: list every module's weights (print(model) or model.named_parameters() "
            f"on the meta device) and compare with your sum")


# ==== 2. the activations of one decoder layer ===================================================
_GQA = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2)
ACTIVATION_SHAPES = {
    "GQA 4/2": ModelConfig(**_GQA),
    "MHA 4/4": ModelConfig(**{**_GQA, "num_key_value_heads": 4}),
    "MQA 4/1": ModelConfig(**{**_GQA, "num_key_value_heads": 1}),
    "head_dim 24 (4 x 24 != h 64)": ModelConfig(**_GQA, head_dim=24),
}
# (shape, batch, seq, dtype): every shape in fp32 with both attentions, two of them in bf16 too.
ACTIVATION_CASES = [("GQA 4/2", 2, 20, torch.float32), ("MHA 4/4", 1, 24, torch.float32),
                    ("MQA 4/1", 3, 8, torch.float32), ("head_dim 24 (4 x 24 != h 64)", 2, 12, torch.float32),
                    ("GQA 4/2", 2, 12, torch.bfloat16), ("head_dim 24 (4 x 24 != h 64)", 1, 20, torch.bfloat16)]
ATTENTIONS = ("sdpa", "eager")


def measure_layer(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes of the distinct storages one decoder layer saves for backward (parameters, cos, sin left out)."""
    layer, x, cos, sin = _layer_and_input(config, batch, seq, dtype)
    with SavedStorages() as saved:
        out = layer(x, cos, sin)  # noqa: F841 (kept alive: its graph holds the saved tensors)
    return saved.bytes(besides=[*layer.parameters(), cos, sin])


def check_activation_bytes(activation_bytes_per_layer: Callable) -> None:
    """activation_bytes_per_layer(config, batch, seq, dtype_bytes=a) equals the bytes one decoder layer
    saves for backward, measured with saved-tensor hooks, for sdpa and eager attention, fp32 and bf16."""
    with Report("activation_bytes_per_layer",
                note="expected: distinct storages one DecoderLayer saves for backward (saved-tensor hooks), "
                     "parameters and RoPE tables left out; recompute='none'") as report, one_thread():
        for shape, batch, seq, dtype in ACTIVATION_CASES:
            for attention in ATTENTIONS:
                config = dataclasses.replace(ACTIVATION_SHAPES[shape], attention=attention)
                measured = measure_layer(config, batch, seq, dtype)
                a = torch.tensor([], dtype=dtype).element_size()
                with refusing("activation_bytes_per_layer",
                               {MEMORY_FILE: "picotron.memory", COSTS_FILE: "picotron.costs",
                                DecoderLayer.forward.__code__:
                                "a DecoderLayer (the formula must come from the shape; the check measures)"}):
                    got = activation_bytes_per_layer(dataclasses.replace(config), batch, seq, dtype_bytes=a)
                ok = isinstance(got, int) and got == measured
                detail = "" if ok else _activation_hint(config, batch, seq, a, got, measured)
                report.add(ok, detail, shape=shape, attention=attention, batch=batch, seq=seq, dtype=dtype,
                           **{"measured (B)": f"{measured:,}", "yours (B)": _number(got),
                              "yours - measured": _difference(got, measured)})


def _activation_hint(config: ModelConfig, batch: int, seq: int, a: int, got, measured: int) -> str:
    """Name the term that explains the difference, when one does."""
    if not isinstance(got, int):
        return f"return an int, a number of bytes (got {type(got).__name__} {got!r})"
    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    n_q, n_kv, tokens, eager = config.num_attention_heads, config.num_key_value_heads, batch * seq, \
        config.attention == "eager"
    probabilities, lse = a * batch * n_q * seq * seq, 4 * batch * n_q * seq
    gqa_copies = 2 * a * tokens * (n_q - n_kv) * d
    hints = [
        (-probabilities if eager else 0, f"the softmax probabilities are missing: eager attention keeps "
                                         f"(batch, n_q, seq, seq) = ({batch}, {n_q}, {seq}, {seq}), a*b*n_q*s^2 bytes"),
        (probabilities if not eager else 0, "sdpa is a fused kernel: it never stores the (seq x seq) probabilities"),
        (-gqa_copies if eager else 0,
         "the copies of k and v are missing: eager attention repeats each key-value head for the query heads "
         "that read it (GQA), and its matmuls keep those n_q*d-wide copies"),
        (gqa_copies if not eager else 0,
         "k and v are counted n_q*d wide: under GQA they have n_kv heads, and sdpa reads them without copying"),
        (-lse if not eager else 0, "sdpa's log-sum-exp is missing: one fp32 number per query row, 4*b*n_q*s bytes"),
        (lse if eager else 0, "eager attention keeps no log-sum-exp (sdpa's kernel does); it keeps the probabilities"),
        (2 * a * tokens * (h - n_q * d),
         "q and the attention output are n_q*head_dim wide, which here is not hidden_size "
         f"({n_q} x {d} = {n_q * d}, hidden {h})"),
        (-a * tokens * f, "SwiGLU keeps four (b, s, f) tensors: the gate output, silu(gate), the up output and "
                          "their product"),
        (-a * tokens * n_q * d, "attention keeps q, k, v and its output (o_proj's input, n_q*d wide)"),
        (-8 * tokens, "RMSNorm's 1/rms is missing: one fp32 number per token, in each of the two norms"),
        (-2 * (4 - a) * tokens * h, "RMSNorm computes in fp32: the input it keeps is an fp32 copy, 4 bytes per "
                                    "element whatever the activation dtype"),
        (-(4 - a) * (2 * tokens * h + 2 * tokens + (0 if eager else batch * n_q * seq)),
         "some tensors are fp32 whatever the activation dtype: RMSNorm's input copy and 1/rms, sdpa's log-sum-exp"),
        (-2 * a * tokens * h, "each RMSNorm keeps three (b, s, h) tensors: its fp32 input, the normalised x and "
                              "its output"),
        (-(4 + 2 * a) * tokens * h - 4 * tokens, "a layer has two RMSNorms (before attention, before the MLP)"),
    ]
    if a != 4:  # the same layer in fp32: an answer that ignores dtype_bytes returns this
        fp32 = measure_layer(config, batch, seq, torch.float32)
        if got == fp32:
            return (f"that is the fp32 count: with dtype_bytes={a} the activations take {a} bytes each, except "
                    "the fp32 ones (RMSNorm's input copy and 1/rms, sdpa's log-sum-exp)")
    matches = [hint for difference, hint in hints if difference and got - measured == difference]
    if matches:  # two terms can have the same size for one shape: name both
        return f"off by {got - measured:+,} bytes: " + "; or ".join(matches)
    return (f"off by {got - measured:+,} bytes ({(got - measured) / tokens:+.1f} per token): print "
            "saved_by_layer(config, batch, seq, dtype) to see every tensor the layer keeps")


# ==== 3. recomputation ===========================================================================
SEQ = 64
LAYER = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    attention="eager")
KEPT_BYTES_ALLOWED = 0  # nothing beyond the inputs, as the task says (SavedStorages leaves out 0-dim scalars)


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _attention_case(wrap: Callable, attend: Callable) -> tuple:
    """Selective recomputation: the attention core on q (4 heads) and k, v (2 heads), all leaves."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, SEQ, 16, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    out = wrap(attend, q, k, v)  # (2, 4, SEQ, 16)
    return out, {"q": q, "k": k, "v": v}, [q, k, v], {}


def _layers_case(wrap: Callable, num_layers: int) -> tuple:
    """Full recomputation: each layer wrapped; its input is not a leaf, cos and sin need no gradient."""
    torch.manual_seed(0)
    layers = nn.ModuleList(DecoderLayer(LAYER) for _ in range(num_layers))
    cos, sin = Rotary(LAYER)(torch.arange(SEQ)[None])
    x0 = torch.randn(2, SEQ, LAYER.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x, inputs = x0 * 1.0, [cos, sin]  # a layer's input comes out of an earlier op
    for layer in layers:
        inputs.append(x)
        x = wrap(layer, x, cos, sin)
    return x, {"x": x0}, inputs, dict(layers.named_parameters())


RECOMPUTE_CASES = [
    ("eager attention, GQA 4/2", lambda wrap: _attention_case(wrap, eager_attention)),
    ("sdpa attention, GQA 4/2", lambda wrap: _attention_case(wrap, _sdpa)),
    ("1 decoder layer", lambda wrap: _layers_case(wrap, 1)),
    ("2 decoder layers, each wrapped", lambda wrap: _layers_case(wrap, 2)),
]


def _plain(fn: Callable, *inputs):
    return fn(*inputs)


def _run_recompute_case(case: Callable, wrap: Callable) -> dict:
    """What `wrap` keeps in forward (under the saved-tensor counter), then, in a second run without
    the counter, its output and gradients for a fixed upstream gradient.

    Two runs, because a saved tensor that went through pack/unpack hooks comes back as a new
    tensor object: backward must see what it sees in training. Every fn the case hands to `wrap`
    is counted: how often it runs in forward and in backward.
    """
    runs: list[Callable] = []

    def counting_wrap(fn, *inputs):
        def counted(*args):
            runs.append(fn)
            return fn(*args)
        return wrap(counted, *inputs)

    with SavedStorages() as saved:
        out, _, inputs, params = case(counting_wrap)
    kept = saved.bytes(besides=[*inputs, *params.values()])  # while out (and so its graph) is alive
    del out
    runs.clear()
    out, leaves, _, params = case(counting_wrap)
    forward_runs = len(runs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
    grads = {f"input {name}": t.grad for name, t in leaves.items()}
    grads.update({f"parameter {name}": p.grad for name, p in params.items()})
    return {"out": out.detach(), "grads": grads, "kept": kept, "forward runs": forward_runs,
            "backward runs": runs[forward_runs:]}


def check_recompute(recompute: Callable) -> None:
    """recompute(fn, *inputs) returns fn(*inputs) bit for bit, keeps nothing for backward beyond its
    inputs (saved-tensor hooks), runs fn again in backward, and gives bit-equal gradients, to the
    inputs and to the parameters fn uses, for GQA attention (eager and sdpa) and decoder layers."""
    if isinstance(recompute, type) and issubclass(recompute, torch.autograd.Function):
        recompute = recompute.apply  # the class itself was passed: call it the way autograd does
    answers = {CHECKPOINT_FILE: "torch.utils.checkpoint", course_recompute.__code__: "picotron.model.recompute"}
    with Report("recompute", note="kept: bytes autograd saves for backward besides the inputs (saved-tensor hooks); "
                                  "fn runs: in forward / in backward; gradients compared with torch.equal") \
            as report, one_thread():
        for name, case in RECOMPUTE_CASES:
            plain = _run_recompute_case(case, _plain)
            with refusing("recompute", answers):
                try:
                    yours, error = _run_recompute_case(case, recompute), None
                except NotImplementedError:
                    raise
                except Exception as e:  # autograd's own errors: turn them into a hint
                    yours, error = None, e
            columns = {"case": name, "kept, plain (B)": f"{plain['kept']:,}"}
            if yours is None:
                report.add(False, _error_hint(error), **columns)
                continue
            report.add(*_recompute_verdict(plain, yours), **columns,
                       **{"kept, yours (B)": f"{yours['kept']:,}",
                          "fn runs": f"{yours['forward runs']}/{len(yours['backward runs'])}"},
                       max_grad_err=_max_error(plain["grads"], yours["grads"]))


def _max_error(expected: dict, actual: dict) -> float:
    errors = [(actual[k] - e).abs().max().item() for k, e in expected.items() if actual.get(k) is not None]
    return max(errors) if len(errors) == len(expected) else float("nan")


def _error_hint(error: Exception) -> str:
    text = str(error).strip().split("\n")[0].split(". ")[0]  # torch's first sentence says what happened
    if "incorrect number of gradients" in text:
        hint = "backward returns one gradient per argument of forward: None for fn, then one per input"
    elif "backward through the graph a second time" in text:
        hint = ("the recomputation went through the original graph as well: detach the saved inputs "
                "(t.detach().requires_grad_(t.requires_grad)) before running fn again")
    elif "does not require grad" in text or "does not have a grad_fn" in text:
        hint = ("backward runs with gradients switched off: recompute fn under torch.enable_grad(), on inputs "
                "detached from the outer graph, with requires_grad as the originals had it")
    else:
        hint = "see the error above it in the traceback of your code"
    return f"{type(error).__name__}: {text} ({hint})"


def _recompute_verdict(plain: dict, yours: dict) -> tuple[bool, str]:
    """(ok, what is wrong) for one case."""
    if yours["kept"] > KEPT_BYTES_ALLOWED:
        return False, (f"autograd kept {yours['kept']:,} bytes for backward besides the inputs (without recomputation: "
                       f"{plain['kept']:,}): forward must run fn without recording a graph and save only the inputs")
    wrapped = plain["forward runs"]  # calls of the wrapper in this case
    if yours["forward runs"] != wrapped or len(yours["backward runs"]) != wrapped:
        return False, (f"fn ran {yours['forward runs']} time(s) in forward and {len(yours['backward runs'])} in "
                       f"backward for {wrapped} call(s) of the wrapper: run it once in each (backward recomputes "
                       "what forward did not keep)")
    if not torch.equal(yours["out"], plain["out"]):
        return False, "the output differs from fn(*inputs): forward must return fn's output unchanged"
    for what, expected in plain["grads"].items():
        got = yours["grads"].get(what)
        if got is None:
            return False, (f"{what} got no gradient: backpropagate through the recomputed graph with "
                           "torch.autograd.backward(output, grad_output), which also fills the .grad of the "
                           "parameters fn uses (torch.autograd.grad(output, inputs) returns only the inputs')")
        if not torch.equal(got, expected):
            if tolerance.close_enough(got, 2 * expected, n=2):   # added twice: equal up to round-off
                return False, (f"{what}: the gradient is twice the plain one: the recomputation went through the "
                               "original graph as well; detach the saved inputs before running fn again")
            return False, (f"{what}: the gradient differs from the plain one by "
                           f"{(got - expected).abs().max().item():.2e}; recompute with the same ops on the same "
                           "inputs and return their gradients")
    return True, ""


# ==== 4. stretch: which layers to recompute ======================================================
# Stacks of decoder layers in fp32: sdpa and eager attention, GQA and multi-head, 4 and 5 layers. Each
# stack is measured with every subset of its layers recomputed, so the check knows the peak of every
# plan, and the fewest layers any plan needs under a budget, from measurements alone.
_PLAN = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
PLAN_SHAPES = {  # name: (config, batch, seq)
    "sdpa GQA 4/2, 4 layers": (ModelConfig(**_PLAN, num_key_value_heads=2, num_layers=4), 2, 16),
    "eager GQA 4/2, 4 layers": (ModelConfig(**_PLAN, num_key_value_heads=2, num_layers=4, attention="eager"), 1, 24),
    "sdpa MHA 4/4, 5 layers": (ModelConfig(**_PLAN, num_key_value_heads=4, num_layers=5), 2, 8),
}
MEMORY_TRACKING_FILE = importlib.util.find_spec("picotron.memory_tracking").origin


class _PeakSaved(SavedActivations):
    """picotron's peak of the bytes saved for backward, leaving out 0-dim tensors (a scalar divisor), as
    SavedStorages does: 8 bytes no formula counts."""

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.dim() == 0 else super()._pack(tensor)


def measure_plan(config: ModelConfig, batch: int, seq: int, recomputed) -> tuple[int, int]:
    """(bytes saved at the end of forward, most bytes saved at once over forward and backward) for a stack
    of config.num_layers decoder layers in fp32, the layers in `recomputed` wrapped whole for recomputation.

    The wrapper is torch's reentrant checkpoint: like the Recompute of part 3, it saves its inputs with
    save_for_backward and runs the layer again, recorded, in backward. Parameters and cos/sin are left out.
    """
    torch.manual_seed(0)
    layers = [DecoderLayer(config) for _ in range(config.num_layers)]
    cos, sin = Rotary(config)(torch.arange(seq)[None])
    x0 = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    with _PeakSaved(exclude=[cos, sin]) as saved:
        x = x0 * 1.0  # the first layer's input comes out of an op, as the embedding's output does
        for i, layer in enumerate(layers):
            if i in recomputed:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=True)
            else:
                x = layer(x, cos, sin)
        end_of_forward = saved.live_bytes
        x.backward(torch.ones_like(x))  # inside the hooks: what a recomputation saves counts too
    return end_of_forward, saved.peak


def _every_plan(config: ModelConfig, batch: int, seq: int) -> dict[frozenset, tuple[int, int]]:
    """measure_plan for every subset of the layers: 2^L small forward and backward passes."""
    layers = range(config.num_layers)
    return {frozenset(plan): measure_plan(config, batch, seq, set(plan))
            for k in range(config.num_layers + 1) for plan in itertools.combinations(layers, k)}


def _peak_plans(num_layers: int) -> list[tuple[int, ...]]:
    """Plans whose peak the learner predicts: none, the first, the last, two apart, all but the last, all."""
    last = num_layers - 1
    return [(), (0,), (last,), (1, last), tuple(range(last)), tuple(range(num_layers))]


def _budgets(peaks: list[int]) -> list[int]:
    """Every peak some plan reaches (exactly: a plan at the budget fits), one between the two largest,
    and one byte under the lowest (no plan fits)."""
    levels = sorted(set(peaks))
    between = (levels[-2] + levels[-1]) // 2 if len(levels) > 1 else levels[0] + 1
    return [*levels[::-1], between, levels[0] - 1]


def check_checkpoint_plan(peak_saved_bytes: Callable, checkpoint_plan: Callable) -> None:
    """peak_saved_bytes(config, batch, seq, recomputed) equals the measured peak of the bytes a stack of
    decoder layers saves for backward, over forward and backward, with the layers `recomputed` wrapped;
    checkpoint_plan(config, batch, seq, budget) names the fewest layers whose measured peak fits the
    budget, and raises ValueError when no plan fits."""
    answers = {MEMORY_FILE: "picotron.memory", COSTS_FILE: "picotron.costs",
               MEMORY_TRACKING_FILE: "picotron.memory_tracking (the check measures; you predict)",
               DecoderLayer.forward.__code__: "a DecoderLayer (the peak comes from the shape; the check measures)"}
    note = ("measured: bytes autograd saves for backward (distinct storages, parameters and cos/sin left out), fp32, "
            "most at once over forward and backward, for every subset of the layers recomputed")
    with Report("checkpoint_plan", note=note) as report, one_thread():
        measured = {name: _every_plan(*shape) for name, shape in PLAN_SHAPES.items()}
        for name, (config, batch, seq) in PLAN_SHAPES.items():
            for plan in _peak_plans(config.num_layers):
                _, peak = measured[name][frozenset(plan)]
                with refusing("peak_saved_bytes", answers):
                    got = peak_saved_bytes(dataclasses.replace(config), batch, seq, list(plan))
                ok = isinstance(got, int) and not isinstance(got, bool) and got == peak
                detail = "" if ok else _peak_hint(measured[name], config, plan, got)
                report.add(ok, detail, part="peak", shape=name, **{"b x s": f"{batch} x {seq}"},
                           recomputed=list(plan), **{"measured (B)": f"{peak:,}", "yours (B)": _number(got)})
        for name, (config, batch, seq) in PLAN_SHAPES.items():
            peaks = measured[name]
            for budget in _budgets([peak for _, peak in peaks.values()]):
                fitting = [plan for plan, (_, peak) in peaks.items() if peak <= budget]
                fewest = min(map(len, fitting), default=None)
                with refusing("checkpoint_plan", answers):
                    try:
                        got, error = checkpoint_plan(dataclasses.replace(config), batch, seq, budget), None
                    except ValueError as e:
                        got, error = None, e
                ok, detail = _plan_verdict(peaks, config.num_layers, budget, fewest, got, error)
                report.add(ok, detail, part="plan", shape=name,
                           **{"b x s": f"{batch} x {seq}", "budget (B)": f"{budget:,}"},
                           fewest="none fits" if fewest is None else fewest,
                           yours="ValueError" if error else _show_plan(got), **{"its peak (B)": _plan_peak(peaks, got)})


def _show_plan(plan) -> str:
    return repr(plan) if not isinstance(plan, list) else str(plan)


def _plan_peak(peaks: dict, plan) -> str:
    key = frozenset(plan) if isinstance(plan, list) and all(isinstance(i, int) for i in plan) else None
    return f"{peaks[key][1]:,}" if key in peaks else ""


def _layer_and_input_bytes(peaks: dict, num_layers: int) -> tuple[int, int]:
    """(what a stored layer keeps, what a recomputed one keeps), read off two measurements."""
    layer = peaks[frozenset()][1] // num_layers
    return layer, peaks[frozenset({0})][0] - (num_layers - 1) * layer


def _peak_hint(peaks: dict, config: ModelConfig, plan: tuple, got) -> str:
    if not isinstance(got, int) or isinstance(got, bool):
        return f"return an int, a number of bytes (got {type(got).__name__} {got!r})"
    end, peak = peaks[frozenset(plan)]
    _, inputs = _layer_and_input_bytes(peaks, config.num_layers)
    if got == end and peak > end:
        return (f"{end:,} bytes is what the layers hold at the end of forward; this plan's peak comes later, in "
                "backward: a recomputed layer's activations all come back while the layers below it still hold theirs")
    if got - peak == inputs:
        return ("off by one layer input: in fp32 the first RMSNorm saves the layer's input itself, so while a layer "
                "is recomputed its input is one of the tensors it saves, not one more")
    if got < peak and (peak - got) % inputs == 0:
        return ("a recomputed layer still keeps its input, a*b*s*h bytes, from its forward until backward reaches "
                f"it (off by {got - peak:+,} bytes)")
    if not plan:
        return f"off by {got - peak:+,} bytes with nothing recomputed: num_layers times part 2's count of one layer"
    return f"off by {got - peak:+,} bytes; at the end of forward this plan holds {end:,} bytes (measured)"


def _plan_verdict(peaks: dict, num_layers: int, budget: int, fewest, got, error) -> tuple[bool, str]:
    lowest = min(peak for _, peak in peaks.values())
    if error is not None:
        if fewest is None:
            return True, ""
        example = sorted(min((plan for plan, (_, peak) in peaks.items() if peak <= budget and len(plan) == fewest),
                             key=sorted))
        return False, f"ValueError, but a plan fits: {example} (measured peak {peaks[frozenset(example)][1]:,} B)"
    nothing_fits = (f"no plan fits in {budget:,} bytes (the lowest peak of any plan is {lowest:,}): raise "
                    f"ValueError, do not return {got!r}")
    valid = isinstance(got, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in got)
    if fewest is None and not valid:
        return False, nothing_fits
    if not valid:
        return False, f"return a list of layer indices (ints), not {got!r}"
    if got != sorted(set(got)) or any(i < 0 or i >= num_layers for i in got):
        return False, f"return each layer once, in increasing order, from 0 to {num_layers - 1}: got {got}"
    end, peak = peaks[frozenset(got)]
    if peak > budget:
        if peak > end:
            return False, (f"this plan peaks at {peak:,} B in backward, over the budget: when backward reaches a "
                           "recomputed layer, its activations come back while every layer below it still holds its "
                           f"own ({peak - end:+,} B over the end of forward)"
                           + (f". And {nothing_fits}" if fewest is None else
                              ". Which layers can you recompute without that spike?"))
        return False, (f"at the end of forward these layers hold {end:,} B, over the budget: recompute more of them"
                       if fewest is not None else nothing_fits)
    if len(got) > fewest:
        example = sorted(min((plan for plan, (_, p) in peaks.items() if p <= budget and len(plan) == fewest),
                             key=sorted))
        return False, (f"{len(got)} layers recomputed where {fewest} suffice ({example} peaks at "
                       f"{peaks[frozenset(example)][1]:,} B): each recomputed layer costs one more forward of it")
    return True, ""

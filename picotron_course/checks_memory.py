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

No ranks here: everything runs in one process, on one thread, declared on the course's engine
(picotron_course.engine). A wrong answer fails its row; the misconceptions after each check are the
mistakes learners make (a forgotten final norm, k and v as wide as q under GQA, ...), each with the
hint it should read. An unsolved answer raises NotImplementedError, which goes through untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import weakref
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from picotron.config import PRESETS, ModelConfig
from picotron.memory_tracking import SavedActivations
from picotron.model import DecoderLayer, Llama, Rotary, eager_attention
from picotron.model import recompute as course_recompute
from picotron_course.checks import one_thread, refusing
from picotron_course.engine import Check, Exact, Misconception, Within, named

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
    return [(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
            for t in _layer_storages(config, batch, seq, dtype).values()]


def _layer_storages(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> dict:
    """SavedStorages.storages of one decoder layer's forward, parameters and cos/sin left out."""
    torch.manual_seed(0)
    layer = DecoderLayer(config).to(dtype)
    cos, sin = Rotary(config).to(dtype)(torch.arange(seq)[None])  # (1, 1, seq, head_dim) each
    x = torch.randn(batch, seq, config.hidden_size, dtype=dtype, requires_grad=True)
    with SavedStorages() as saved:
        out = layer(x, cos, sin)
    kept = saved.storages(besides=[*layer.parameters(), cos, sin])   # while out (and its graph) holds them
    del out
    return kept


# The code the assignment rebuilds: a learner's answer must not call it.
MEMORY_FILE = importlib.util.find_spec("picotron.memory").origin
COSTS_FILE = importlib.util.find_spec("picotron.costs").origin      # the one-process formulas memory builds on
CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def _refusing(check: Check, answer, answers: dict, what: str = ""):
    """refusing(answers) around a call of `answer`, unless it is one of the check's misconceptions (they measure)."""
    return refusing(what or check.title, {} if any(answer == m.answer for m in check.misconceptions) else answers)


def _kind(value) -> str:
    return "an int" if isinstance(value, int) and not isinstance(value, bool) else f"a {type(value).__name__}"


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
PARAM_ANSWERS = {MEMORY_FILE: "picotron.memory", ModelConfig.num_params.__code__: "ModelConfig.num_params",
                 Llama.__init__.__code__: "Llama(config) (building the model counts it for you)"}


def _meta_llama(config: ModelConfig) -> Llama:
    with torch.device("meta"):  # shapes without memory: the 8B model builds in a moment
        return Llama(config)


_MEASURED: dict = {}   # by repr: a config is not hashable


def _counted(config: ModelConfig) -> int:
    if repr(config) not in _MEASURED:
        _MEASURED[repr(config)] = sum(p.numel() for p in _meta_llama(config).parameters())  # a tied weight once
    return _MEASURED[repr(config)]


def _observe_counts(answers: list, cases: list) -> list:
    def count(num_params, case):
        with _refusing(NUM_PARAMS, num_params, PARAM_ANSWERS):
            got = num_params(dataclasses.replace(case["_config"]))  # a copy: the answer cannot change our config
        return {"returned": _kind(got), "count": got}
    with one_thread():
        return [[count(num_params, case) for case in cases] for num_params in answers]


def _n(*modules) -> int:
    return sum(p.numel() for m in modules for p in m.parameters(recurse=False))


def _params_off(name: str, off: Callable) -> Callable:
    """A wrong num_params: the count, off by off(model, config, layer, num_layers) (a mistake's cost, read off the
    parts of a one-layer model)."""
    def num_params(config):
        model = _meta_llama(dataclasses.replace(config, num_layers=1))   # the layers are alike: one shows them
        return _counted(config) + off(model, config, model.layers[0], config.num_layers)
    return named(name, num_params)


NUM_PARAMS = Check(
    "num_params", observe=_observe_counts,
    expect=lambda case, got: {"returned": "an int", "count": _counted(case["_config"])},
    note="expected: sum(p.numel() for p in model.parameters()) of Llama(config) built on the meta device",
    cases=[dict(shape=name, layers=c.num_layers, **{"heads q/kv": f"{c.num_attention_heads}/{c.num_key_value_heads}"},
                _config=c) for name, c in PARAM_SHAPES],
    columns=lambda case, got: {"counted": _counted(case["_config"]), "yours": got["count"], "yours - counted":
                               got["count"] - _counted(case["_config"]) if got["returned"] == "an int" else "?"},
    quantities={"returned": Exact("what num_params returned (return an int, the number of parameters)"),
                "count": Exact("the parameters counted (list every module's weights, print(model) or "
                               "model.named_parameters() on the meta device, and compare with your sum)")},
    misconceptions=[
        Misconception(named("_params_float", lambda config: float(_counted(config))),
                      "return an int, the number of parameters"),
        Misconception(_params_off("np_no_final_norm", lambda m, c, l, n: -_n(m.norm)),
                      "the final RMSNorm is missing (hidden_size weights, after the last layer)"),
        Misconception(_params_off("np_no_layer_norms", lambda m, c, l, n: -n * _n(l.attn_norm, l.mlp_norm)),
                      "the RMSNorm weights of the layers are missing: two per layer, hidden_size each"),
        Misconception(_params_off("np_one_norm_per_layer", lambda m, c, l, n: -n * _n(l.attn_norm)),
                      "each layer has two RMSNorms (before attention, before the MLP), not one"),
        Misconception(_params_off("np_tied_twice", lambda m, c, l, n: _n(m.embed) if c.tie_word_embeddings else 0),
                      "the tied embedding is counted twice: with tie_word_embeddings=True the LM head is the "
                      "embedding matrix"),
        Misconception(_params_off("np_no_lm_head", lambda m, c, l, n: 0 if c.tie_word_embeddings else -_n(m.lm_head)),
                      "the LM head is missing: with tie_word_embeddings=False it is its own vocab x hidden matrix"),
        Misconception(_params_off("np_no_embedding", lambda m, c, l, n: -_n(m.embed)),
                      "the token embedding (vocab x hidden) is missing"),
        Misconception(_params_off("np_kv_as_wide_as_q", lambda m, c, l, n: n * (2 * _n(l.attn.q_proj)
                                                                               - _n(l.attn.k_proj, l.attn.v_proj))),
                      "k_proj and v_proj are counted as wide as q_proj: under GQA they have num_key_value_heads * "
                      "head_dim outputs, not num_attention_heads * head_dim"),
        Misconception(_params_off("np_q_and_o_square", lambda m, c, l, n: n * 2 * (c.hidden_size ** 2
                                                                                  - _n(l.attn.q_proj))),
                      "q_proj and o_proj are hidden x (num_attention_heads * head_dim); head_dim is a field of the "
                      "config and need not be hidden_size / num_attention_heads"),
        Misconception(_params_off("np_head_dim_from_hidden", lambda m, c, l, n: n * (
            2 * c.hidden_size * (c.num_attention_heads + c.num_key_value_heads)
            * (c.hidden_size // c.num_attention_heads) - _n(*(getattr(l.attn, f"{x}_proj") for x in "qkvo")))),
                      "head_dim is a field of the config, not always hidden_size / num_attention_heads"),
        Misconception(_params_off("np_two_mlp_matrices", lambda m, c, l, n: -n * _n(l.mlp.gate_proj)),
                      "the SwiGLU MLP has three matrices (gate, up, down), not two"),
        Misconception(_params_off("np_counts_rope", lambda m, c, l, n: m.rope.cos.numel() + m.rope.sin.numel()),
                      "the RoPE cos/sin tables are counted: they are buffers computed from positions, not parameters")])


def check_num_params(num_params: Callable[[ModelConfig], int]) -> None:
    """num_params(config) equals the parameters of picotron's Llama built with that config, counted."""
    NUM_PARAMS(num_params)


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
ACTIVATION_ANSWERS = {MEMORY_FILE: "picotron.memory", COSTS_FILE: "picotron.costs", DecoderLayer.forward.__code__:
                      "a DecoderLayer (the formula must come from the shape; the check measures)"}
_DTYPES = {4: torch.float32, 2: torch.bfloat16}


def measure_layer(config: ModelConfig, batch: int, seq: int, dtype: torch.dtype) -> int:
    """Bytes of the distinct storages one decoder layer saves for backward (parameters, cos, sin left out)."""
    key = (repr(config), batch, seq, dtype)
    if key not in _MEASURED:
        _MEASURED[key] = sum(t.untyped_storage().nbytes() for t in _layer_storages(config, batch, seq, dtype).values())
    return _MEASURED[key]


def _observe_activations(answers: list, cases: list) -> list:
    def count(answer, case):
        with _refusing(ACTIVATIONS, answer, {**ACTIVATION_ANSWERS, measure_layer.__code__: "measure_layer (the check "
                                             "measures; you count)"}):
            got = answer(dataclasses.replace(case["_config"]), case["batch"], case["seq"], dtype_bytes=case["_a"])
        return {"returned": _kind(got), "bytes": got}
    with one_thread():
        return [[count(answer, case) for case in cases] for answer in answers]


def _expect_activations(case: dict, observed: dict) -> dict:
    with one_thread():
        return {"returned": "an int",
                "bytes": measure_layer(case["_config"], case["batch"], case["seq"], case["dtype"])}


def _bytes_off(name: str, off: Callable) -> Callable:
    """A wrong activation_bytes_per_layer: the measured bytes, off by off(config, terms) (a mistake's cost)."""
    def activation_bytes_per_layer(c, batch, seq, dtype_bytes=4):
        a, t, n_q = dtype_bytes, batch * seq, c.num_attention_heads
        x = SimpleNamespace(a=a, t=t, b=batch, s=seq, eager=c.attention == "eager", probs=a * batch * n_q * seq * seq,
                            copies=2 * a * t * (n_q - c.num_key_value_heads) * c.head_dim, lse=4 * batch * n_q * seq)
        return measure_layer(c, batch, seq, _DTYPES[a]) + off(c, x)
    return named(name, activation_bytes_per_layer)


ACTIVATIONS = Check(
    "activation_bytes_per_layer", observe=_observe_activations, expect=_expect_activations,
    note="expected: distinct storages one DecoderLayer saves for backward (saved-tensor hooks), parameters and RoPE "
         "tables left out; recompute='none'",
    cases=[dict(shape=shape, attention=attention, batch=batch, seq=seq, dtype=dtype, _a=dtype.itemsize,
                _config=dataclasses.replace(ACTIVATION_SHAPES[shape], attention=attention))
           for shape, batch, seq, dtype in ACTIVATION_CASES for attention in ATTENTIONS],
    columns=lambda case, got: {"yours (B)": got["bytes"]},
    quantities={"returned": Exact("what activation_bytes_per_layer returned (return an int, a number of bytes)"),
                "bytes": Exact("the bytes one layer saves for backward (print saved_by_layer(config, batch, seq, "
                               "dtype) to see every tensor the layer keeps)")},
    misconceptions=[
        Misconception(named("_act_ignores_dtype", lambda c, batch, seq, dtype_bytes=4: measure_layer(c, batch, seq,
                                                                                                     torch.float32)),
                      "that is the fp32 count: with dtype_bytes=2 the activations take 2 bytes each, except the fp32 "
                      "ones (RMSNorm's input copy and 1/rms, sdpa's log-sum-exp)"),
        Misconception(_bytes_off("act_no_probabilities", lambda c, x: -x.probs * x.eager),
                      "the softmax probabilities are missing: eager attention keeps (batch, n_q, seq, seq), "
                      "a*b*n_q*s^2 bytes"),
        Misconception(_bytes_off("act_sdpa_probabilities", lambda c, x: x.probs * (not x.eager)),
                      "sdpa is a fused kernel: it never stores the (seq x seq) probabilities"),
        Misconception(_bytes_off("act_no_gqa_copies", lambda c, x: -x.copies * x.eager),
                      "the copies of k and v are missing: eager attention repeats each key-value head for the query "
                      "heads that read it (GQA), and its matmuls keep those n_q*d-wide copies"),
        Misconception(_bytes_off("act_kv_as_wide_as_q", lambda c, x: x.copies * (not x.eager)),
                      "k and v are counted n_q*d wide: under GQA they have n_kv heads, and sdpa reads them without "
                      "copying"),
        Misconception(_bytes_off("act_no_logsumexp", lambda c, x: -x.lse * (not x.eager)),
                      "sdpa's log-sum-exp is missing: one fp32 number per query row, 4*b*n_q*s bytes"),
        Misconception(_bytes_off("act_eager_logsumexp", lambda c, x: x.lse * x.eager),
                      "eager attention keeps no log-sum-exp (sdpa's kernel does); it keeps the probabilities"),
        Misconception(_bytes_off("act_q_hidden_wide", lambda c, x: 2 * x.a * x.t * (
            c.hidden_size - c.num_attention_heads * c.head_dim)),
                      "q and the attention output are n_q*head_dim wide, which need not be hidden_size"),
        Misconception(_bytes_off("act_three_mlp_tensors", lambda c, x: -x.a * x.t * c.intermediate_size),
                      "SwiGLU keeps four (b, s, f) tensors: the gate output, silu(gate), the up output and their "
                      "product"),
        Misconception(_bytes_off("act_no_attention_output", lambda c, x: -x.a * x.t
                                 * c.num_attention_heads * c.head_dim),
                      "attention keeps q, k, v and its output (o_proj's input, n_q*d wide)"),
        Misconception(_bytes_off("act_no_rms", lambda c, x: -8 * x.t),
                      "RMSNorm's 1/rms is missing: one fp32 number per token, in each of the two norms"),
        Misconception(_bytes_off("act_norm_input_in_activation_dtype", lambda c, x: -2 * (4 - x.a) * x.t
                                 * c.hidden_size),
                      "RMSNorm computes in fp32: the input it keeps is an fp32 copy, 4 bytes per element whatever the "
                      "activation dtype"),
        Misconception(_bytes_off("act_all_in_activation_dtype", lambda c, x: -(4 - x.a) * (
            2 * x.t * c.hidden_size + 2 * x.t + (0 if x.eager else x.lse // 4))),
                      "some tensors are fp32 whatever the activation dtype: RMSNorm's input copy and 1/rms, sdpa's "
                      "log-sum-exp"),
        Misconception(_bytes_off("act_two_tensors_per_norm", lambda c, x: -2 * x.a * x.t * c.hidden_size),
                      "each RMSNorm keeps three (b, s, h) tensors: its fp32 input, the normalised x and its output"),
        Misconception(_bytes_off("act_one_norm", lambda c, x: -(4 + 2 * x.a) * x.t * c.hidden_size - 4 * x.t),
                      "a layer has two RMSNorms (before attention, before the MLP)")])


def check_activation_bytes(activation_bytes_per_layer: Callable) -> None:
    """activation_bytes_per_layer(config, batch, seq, dtype_bytes=a) equals the bytes one decoder layer
    saves for backward, measured with saved-tensor hooks, for sdpa and eager attention, fp32 and bf16."""
    ACTIVATIONS(activation_bytes_per_layer)


# ==== 3. recomputation ===========================================================================
SEQ = 64
LAYER = ModelConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    attention="eager")
KEPT_BYTES_ALLOWED = 0  # nothing beyond the inputs, as the task says (SavedStorages leaves out 0-dim scalars)
RECOMPUTE_ANSWERS = {CHECKPOINT_FILE: "torch.utils.checkpoint", course_recompute.__code__: "picotron.model.recompute"}


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
    ("sdpa attention, GQA 4/2", lambda wrap: _attention_case(wrap, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))),
    ("1 decoder layer", lambda wrap: _layers_case(wrap, 1)),
    ("2 decoder layers, each wrapped", lambda wrap: _layers_case(wrap, 2)),
]


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
    grads = {**{f"input {name}": t.grad for name, t in leaves.items()},
             **{f"parameter {name}": p.grad for name, p in params.items()}}
    return {"error": "", "kept": kept, "fn runs": [forward_runs, len(runs) - forward_runs], "out": out.detach(),
            "no gradient": [name for name, g in grads.items() if g is None], "grads": list(grads.values())}


def _observe_recompute(answers: list, cases: list) -> list:
    def run(recompute, case):
        wrap = recompute.apply if isinstance(recompute, type) and issubclass(recompute, torch.autograd.Function) \
            else recompute   # the class itself was passed: call it the way autograd does
        with _refusing(RECOMPUTE, recompute, {**RECOMPUTE_ANSWERS, _Recompute.backward.__code__: "the check's own "
                                              "recompute (checks_memory._Recompute)"}):
            try:
                return _run_recompute_case(case["_case"], wrap)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001  (autograd's own errors: observed, and named by a hint)
                first = str(e).strip().split("\n")[0].split(". ")[0]   # torch's first sentence says what happened
                return {"error": f"{type(e).__name__}: {first}"}
    with one_thread():
        return [[run(recompute, case) for case in cases] for recompute in answers]


@functools.lru_cache(maxsize=None)
def _plain_run(name: str) -> dict:
    with one_thread():
        return _run_recompute_case(dict(RECOMPUTE_CASES)[name], lambda fn, *inputs: fn(*inputs))


def _expect_recompute(case: dict, observed: dict) -> dict:
    plain = _plain_run(case["case"])
    return {"error": "", "kept": KEPT_BYTES_ALLOWED, "fn runs": [plain["fn runs"][0]] * 2, "out": plain["out"],
            "no gradient": [], "grads": plain["grads"]}


class _Recompute(torch.autograd.Function):
    """The correct answer the misconceptions below change, each in one of these (refused as an answer)."""
    detach, enable_grad, grads_of_parameters, none_for_fn = True, True, True, True

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.fn = fn
        ctx.save_for_backward(*inputs)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad_output):
        how = ctx._forward_cls   # the class whose apply() made ctx
        inputs = [t.detach().requires_grad_(t.requires_grad) if how.detach else t for t in ctx.saved_tensors]
        with torch.set_grad_enabled(how.enable_grad):
            out = ctx.fn(*inputs)
        if how.grads_of_parameters:
            torch.autograd.backward(out, grad_output)
            grads = [t.grad for t in inputs]
        else:   # torch.autograd.grad returns the inputs' gradients only
            wanted = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_output))
            grads = [next(wanted) if t.requires_grad else None for t in inputs]
        return (None, *grads) if how.none_for_fn else tuple(grads)


class KeepsTheGraph(torch.autograd.Function):
    """Correct gradients, no memory saved: forward records fn's graph, backward goes through it."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        ctx.inputs = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            ctx.out = fn(*ctx.inputs)
        return ctx.out.detach()

    @staticmethod
    def backward(ctx, grad_output):
        torch.autograd.backward(ctx.out, grad_output)
        return None, *(t.grad for t in ctx.inputs)


class GradOfInputsOnly(_Recompute):
    grads_of_parameters = False


class NoEnableGrad(_Recompute):
    enable_grad = False   # backward runs with grad mode off: no graph is recorded


class NotDetached(_Recompute):
    detach = False   # the saved inputs are still attached to the outer graph


class ForgetsNoneForFn(_Recompute):
    none_for_fn = False


RECOMPUTE = Check(
    "recompute", observe=_observe_recompute, expect=_expect_recompute,
    note="kept: bytes autograd saves for backward besides the inputs (saved-tensor hooks); fn runs: in forward / in "
         "backward; gradients compared with torch.equal",
    cases=[dict(case=name, _case=case) for name, case in RECOMPUTE_CASES],
    columns=lambda case, got: {"kept (B)": got.get("kept", "-"), "fn runs": got.get("fn runs", "-")},
    quantities={
        "error": Exact("the error autograd raised (see the error above it in the traceback of your code)"),
        "kept": Exact("the bytes autograd kept for backward besides the inputs: forward must run fn without "
                      "recording a graph and save only the inputs"),
        "fn runs": Exact("the times fn ran in forward and in backward: once in each for each call of the wrapper "
                         "(backward recomputes what forward did not keep)"),
        "out": Within("the output, bit for bit against fn(*inputs): forward must return fn's output unchanged"),
        "no gradient": Exact("the inputs and parameters that got no gradient"),
        "grads": Within("the gradients, bit for bit against the plain ones (the inputs', then the parameters' in "
                        "order): recompute with the same ops on the same inputs and return their gradients",
                        axes=("gradient {}",))},
    misconceptions=[
        Misconception(KeepsTheGraph, "forward must run fn without recording a graph and save only the inputs: "
                                     "backward recomputes the rest (keep no graph of fn alive besides them)"),
        Misconception(GradOfInputsOnly, "the parameters got no gradient: backpropagate through the recomputed graph "
                                        "with torch.autograd.backward(output, grad_output), which also fills the "
                                        ".grad of the parameters fn uses (torch.autograd.grad(output, inputs) "
                                        "returns only the inputs')"),
        Misconception(NoEnableGrad, "backward runs with gradients switched off: recompute fn under "
                                    "torch.enable_grad(), on inputs detached from the outer graph, with requires_grad "
                                    "as the originals had it"),
        Misconception(NotDetached, "the recomputation went through the original graph as well: detach the saved "
                                   "inputs (t.detach().requires_grad_(t.requires_grad)) before running fn again"),
        Misconception(ForgetsNoneForFn, "backward returns one gradient per argument of forward: None for fn, then "
                                        "one per input")])


def check_recompute(recompute: Callable) -> None:
    """recompute(fn, *inputs) returns fn(*inputs) bit for bit, keeps nothing for backward beyond its
    inputs (saved-tensor hooks), runs fn again in backward, and gives bit-equal gradients, to the
    inputs and to the parameters fn uses, for GQA attention (eager and sdpa) and decoder layers."""
    RECOMPUTE(recompute)


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
PLAN_ANSWERS = {MEMORY_FILE: "picotron.memory", COSTS_FILE: "picotron.costs",
                MEMORY_TRACKING_FILE: "picotron.memory_tracking (the check measures; you predict)",
                DecoderLayer.forward.__code__: "a DecoderLayer (the peak comes from the shape; the check measures)"}


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


@functools.lru_cache(maxsize=None)
def _every_plan(name: str) -> dict[frozenset, tuple[int, int]]:
    """measure_plan for every subset of the layers of PLAN_SHAPES[name]: 2^L small forward and backward passes."""
    config, batch, seq = PLAN_SHAPES[name]
    with one_thread():
        return {frozenset(plan): measure_plan(config, batch, seq, set(plan)) for k in range(config.num_layers + 1)
                for plan in itertools.combinations(range(config.num_layers), k)}


def _plans_of(config: ModelConfig, batch: int, seq: int) -> dict:
    return _every_plan(next(name for name, (c, b, s) in PLAN_SHAPES.items() if (repr(c), b, s) ==
                            (repr(config), batch, seq)))


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


def _plan_cases() -> list[dict]:
    shapes = [(name, config, dict(_b=batch, _s=seq, **{"b x s": f"{batch} x {seq}"}))
              for name, (config, batch, seq) in PLAN_SHAPES.items()]
    peaks = [dict(part="peak", shape=name, **bs, recomputed=list(plan), _config=config)
             for name, config, bs in shapes for plan in _peak_plans(config.num_layers)]
    return peaks + [dict(part="plan", shape=name, **bs, **{"budget (B)": budget}, _config=config)
                    for name, config, bs in shapes
                    for budget in _budgets([peak for _, peak in _every_plan(name).values()])]


def _observe_plans(answers: list, cases: list) -> list:
    refused = {**PLAN_ANSWERS, _plans_of.__code__: "the check's own measurements (checks_memory._plans_of)"}

    def run(answer, case):
        config, batch, seq = dataclasses.replace(case["_config"]), case["_b"], case["_s"]
        if case["part"] == "peak":
            with _refusing(PLAN, answer, refused, "peak_saved_bytes"):
                got = answer[0](config, batch, seq, list(case["recomputed"]))
            return {"peak returned": _kind(got), "peak": got}
        try:
            with _refusing(PLAN, answer, refused, "checkpoint_plan"):
                got = answer[1](config, batch, seq, case["budget (B)"])
        except ValueError:
            return {"returned": "ValueError"}
        valid = isinstance(got, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in got)
        seen = {"returned": "a list of ints" if valid else f"a {type(got).__name__}", "plan": got}
        if valid:
            seen["in order"] = got == sorted(set(got)) and all(0 <= i < case["_config"].num_layers for i in got)
        if valid and seen["in order"]:
            seen["end of forward"], seen["its peak"] = _every_plan(case["shape"])[frozenset(got)]
            seen["layers"] = len(got)
        return seen
    return [[run(answer, case) for case in cases] for answer in answers]


def _fewest(case: dict):
    fitting = [plan for plan, (_, peak) in _every_plan(case["shape"]).items() if peak <= case["budget (B)"]]
    return min(map(len, fitting), default=None)


def _expect_plans(case: dict, observed: dict) -> dict:
    if case["part"] == "peak":
        return {"peak returned": "an int", "peak": _every_plan(case["shape"])[frozenset(case["recomputed"])][1]}
    if _fewest(case) is None:
        return {"returned": "ValueError"}
    expected = {"returned": "a list of ints", "in order": True}
    if "its peak" in observed:   # a plan of layers, in order: it must fit, with as few layers as any plan that fits
        budget = case["budget (B)"]
        expected.update({"end of forward": min(observed["end of forward"], budget),
                         "its peak": min(observed["its peak"], budget), "layers": _fewest(case)})
    return expected


def _plan_columns(case: dict, got: dict) -> dict:
    if case["part"] == "peak":
        end, peak = _every_plan(case["shape"])[frozenset(case["recomputed"])]
        return {"end of forward (B)": end, "measured (B)": peak, "yours (B)": got["peak"]}
    return {"fewest": _fewest(case) if _fewest(case) is not None else "none fits",
            "yours": got.get("plan", got["returned"]), "its peak (B)": got.get("its peak", "")}


def _right_plan(config, batch, seq, budget):
    """The fewest layers whose measured peak fits (read off the measurements); ValueError if none fits."""
    fitting = [sorted(plan) for plan, (_, peak) in _plans_of(config, batch, seq).items() if peak <= budget]
    if not fitting:
        raise ValueError(f"no plan fits in {budget} bytes")
    return min(fitting, key=lambda plan: (len(plan), plan))


def _right_peak(config, batch, seq, recomputed):
    return _plans_of(config, batch, seq)[frozenset(recomputed)][1]


def peak_end_of_forward(config, batch, seq, recomputed):   # what the layers hold when forward ends
    return _plans_of(config, batch, seq)[frozenset(recomputed)][0]


def peak_inputs_free(config, batch, seq, recomputed, twice=False):   # a recomputed layer keeps nothing, not its input
    plans, n = _plans_of(config, batch, seq), config.num_layers
    layer = plans[frozenset()][1] // n   # what a stored layer keeps, and a recomputed one, read off two measurements
    inputs = plans[frozenset({0})][0] - (n - 1) * layer
    kept = [inputs * twice if i in recomputed else layer for i in range(n)]
    return max([sum(kept), *(sum(kept[:i]) + inputs * twice + layer for i in recomputed)])


def plan_top_layers(config, batch, seq, budget):   # the right count, the wrong end
    plan = _right_plan(config, batch, seq, budget)
    return list(range(config.num_layers - len(plan), config.num_layers))


def plan_end_of_forward(config, batch, seq, budget):   # counts only what forward leaves
    for k in range(config.num_layers + 1):
        if peak_end_of_forward(config, batch, seq, range(k)) <= budget:
            return list(range(k))
    raise ValueError("no plan fits")


def plan_strictly_under(config, batch, seq, budget):   # a plan that reaches the budget exactly fits
    return _right_plan(config, batch, seq, budget - 1)


def plan_none_when_nothing_fits(config, batch, seq, budget):
    try:
        return _right_plan(config, batch, seq, budget)
    except ValueError:
        return None


def plan_top_down(config, batch, seq, budget):
    return _right_plan(config, batch, seq, budget)[::-1]


PLAN = Check(
    "checkpoint_plan", observe=_observe_plans, expect=_expect_plans, cases=_plan_cases(),
    note="measured: bytes autograd saves for backward (distinct storages, parameters and cos/sin left out), fp32, most "
         "at once over forward and backward, for every subset of the layers recomputed",
    columns=_plan_columns,
    quantities={
        "peak returned": Exact("what peak_saved_bytes returned (return an int, a number of bytes)"),
        "peak": Exact("the most bytes saved at once over forward and backward, measured (with nothing recomputed: "
                      "num_layers times part 2's count of one layer)"),
        "returned": Exact("what checkpoint_plan returned: a list of layer indices (ints), or ValueError when no "
                          "plan fits"),
        "in order": Exact("each layer once, in increasing order, from 0 to num_layers - 1"),
        "end of forward": Exact("what the plan's layers hold at the end of forward, against the budget (recompute "
                                "more of them)"),
        "its peak": Exact("the plan's measured peak, against the budget: when backward reaches a recomputed layer, its "
                          "activations come back while every layer below it still holds its own"),
        "layers": Exact("the layers recomputed, as few as any plan that fits needs (each recomputed layer costs one "
                        "more forward of it)")},
    misconceptions=[
        Misconception((peak_end_of_forward, _right_plan),
                      "that is what the layers hold at the end of forward; this plan's peak comes later, in backward: "
                      "a recomputed layer's activations all come back while the layers below it still hold theirs"),
        Misconception((peak_inputs_free, _right_plan), "a recomputed layer still keeps its input, a*b*s*h bytes, from "
                                                       "its forward until backward reaches it"),
        Misconception((named("peak_input_twice", lambda *args: peak_inputs_free(*args, twice=True)), _right_plan),
                      "off by one layer input: in fp32 the first RMSNorm saves the layer's input itself, so while a "
                      "layer is recomputed its input is one of the tensors it saves, not one more"),
        Misconception((_right_peak, plan_top_layers),
                      "the plan peaks in backward, over the budget: when backward reaches a recomputed layer, its "
                      "activations come back while every layer below it still holds its own. Which layers can you "
                      "recompute without that spike?"),
        Misconception((_right_peak, plan_end_of_forward),
                      "a plan must fit at its peak, not only at the end of forward: it peaks in backward, over the "
                      "budget, when a recomputed layer's activations come back while every layer below it still holds "
                      "its own"),
        Misconception((_right_peak, plan_strictly_under), "recompute the fewest layers whose peak fits (a peak equal "
                                                          "to the budget fits): fewer suffice, and each recomputed "
                                                          "layer costs one more forward of it"),
        Misconception((_right_peak, plan_none_when_nothing_fits), "no plan fits in the budget (it is under the lowest "
                                                                  "peak of any plan): raise ValueError, do not return "
                                                                  "None"),
        Misconception((_right_peak, plan_top_down), "return each layer once, in increasing order, from 0 to "
                                                    "num_layers - 1")])


def check_checkpoint_plan(peak_saved_bytes: Callable, checkpoint_plan: Callable) -> None:
    """peak_saved_bytes(config, batch, seq, recomputed) equals the measured peak of the bytes a stack of
    decoder layers saves for backward, over forward and backward, with the layers `recomputed` wrapped;
    checkpoint_plan(config, batch, seq, budget) names the fewest layers whose measured peak fits the
    budget, and raises ValueError when no plan fits."""
    PLAN((peak_saved_bytes, checkpoint_plan))

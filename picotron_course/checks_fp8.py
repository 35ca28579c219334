"""The checks of assignment 10: fp8 quantization with a scale, and a Linear whose matmuls run in fp8, declared on
the course's engine (picotron_course.engine).

Everything runs in this process (fp8 needs no ranks). Each check compares the learner's code with
plain torch written here, never with picotron.fp8 (the module the assignment rebuilds):

    check_tensorwise(quantize_tensorwise, dequantize)
        scale = amax / max of the format (a single number, of any one-element shape), q = saturate(x /
        scale) in fp8: the fp8 values bit for bit, the scale, the error of dequantize(q, scale) within
        half a gap of the format; zeros stay zeros; a given (stale) scale saturates instead of overflowing
    check_rowwise(quantize_rowwise, dequantize)
        the same with one scale per row, shape (M, 1); a row 1000x larger leaves the other rows
        exactly as they were
    check_float8_matmul(float8_matmul)
        a (M, K) @ b (N, K)^T from fp8 copies of both operands quantized along K: equal to the plain
        computation (up to float32 round-off), and within a stated error of the fp32 product
    check_float8_linear(Float8LinearFunction)
        its forward (the learner's) with the given backward: output and both gradients equal to the
        three quantized products written out (up to float32 round-off), and close to bf16 (stated tolerance)
    check_delayed_scaler(DelayedScaler)                                                  (the stretch)
        tensorwise delayed scaling, driven through planted sequences of amaxes (drift, a spike, steady
        growth under a margin, all-zero steps, a gradient-sized random walk, two scalers in turn): each
        step's scale against the rules of the task written out here (history of H amaxes, 2^margin,
        no history, overflow fallback), q bit for bit at that scale, and the overflow count

Error bound of one quantized element (round to nearest): half a gap of the format at that
magnitude, |x| 2^-(m+1) for a mantissa of m bits, or scale x (smallest subnormal)/2 below the
normal range. Matmul tolerances, as relative Frobenius error ||got - ref|| / ||ref|| against bf16:
0.05 with two e4m3 operands, 0.08 with an e5m2 one (about 2^-(m+1)/sqrt(3) per operand). "Equal up to
float32 round-off" is picotron.tolerance's bound for a sum of n terms added in another order (n = K for a
matmul); the scale and dequantize(q, scale), one division or multiplication, are n = 2.
The misconceptions at the end of each section are wrong answers learners write, with the hint each should read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from picotron_course.checks import mismatch
from picotron_course.engine import (AtMost, Check, Close, Exact, Misconception, Quantity, named, observe_in_process,
                                    per_case)

__all__ = ["check_tensorwise", "check_rowwise", "check_float8_matmul", "check_float8_linear", "check_delayed_scaler",
           "ref_quantize_tensorwise", "ref_quantize_rowwise", "ref_dequantize", "E4M3", "E5M2",
           "FORWARD_TOL", "E5M2_TOL"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32 = torch.float32
FORWARD_TOL = 0.05       # relative Frobenius error against bf16, two e4m3 operands
E5M2_TOL = 0.08          # with an e5m2 operand (gradients)
COURSE = ("picotron.fp8", "picotron.mixed_precision", __name__)   # and the correct bases of the misconceptions
ONLY = {__name__: ("_Linear", "_Scaler")}
MANTISSA = {E4M3: 3, E5M2: 2}
SMALLEST_SUBNORMAL = {E4M3: 2.0 ** -9, E5M2: 2.0 ** -16}


# ---- the reference, in plain torch ------------------------------------------------------------------
def _max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def ref_quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None):
    if scale is None:
        scale = x.detach().abs().max().float().clamp(min=1e-12) / _max(dtype)
    return (x.float() / scale).clamp(-_max(dtype), _max(dtype)).to(dtype), scale


def ref_quantize_rowwise(x: torch.Tensor, dtype: torch.dtype):
    scale = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / _max(dtype)
    return (x.float() / scale).clamp(-_max(dtype), _max(dtype)).to(dtype), scale


def ref_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


QUANTIZERS = {"tensorwise": ref_quantize_tensorwise, "rowwise": ref_quantize_rowwise}


def _bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a gap of the format around each element of x at this scale."""
    return torch.maximum(x.abs().float() * 2.0 ** -(MANTISSA[dtype] + 1), scale * SMALLEST_SUBNORMAL[dtype] / 2)


def _rel(got, ref: torch.Tensor) -> float:
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape:
        return math.inf
    diff = (got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30)
    return diff.item() if diff.isfinite() else math.inf


def _data(shape: tuple, seed: int, spread: bool = True) -> torch.Tensor:
    """Values with a spread of magnitudes across rows (so rowwise scales differ), reproducible."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread and len(shape) >= 2:
        x = x * torch.logspace(-2, 1, shape[-2]).view(-1, 1)      # row i of size 10^(-2 + 3 i / (M-1))
    return x


# ---- how these checks observe and compare -----------------------------------------------------------------
@dataclass(frozen=True)
class Bits(Quantity):
    """fp8 tensors equal bit for bit."""

    def equal(self, got, want) -> bool:
        return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8)))

    def shown(self, got, want) -> str:
        if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
                and (got.dtype, got.shape) == (want.dtype, want.shape)):
            return super().shown(got, want)
        wrong = int((got.view(torch.uint8) != want.view(torch.uint8)).sum())
        return f"{wrong} of {got.numel()} fp8 values differ. {mismatch(got.float(), want.float())}"


def _terms(t: torch.Tensor | None, n: int):
    """t in float32, carrying the n terms of the sums behind each of its numbers (K of a matmul, which varies by
    case): Close's roundings, float32 round-off of a sum of n terms (per_case)."""
    return per_case(t.detach().float().clone(), n=n) if isinstance(t, torch.Tensor) else t


def _call(fn: Callable, *args) -> tuple:
    """(fn(*args), what it returned in words), or (None, what it raised) (NotImplementedError goes through)."""
    try:
        got = fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - observed, shown in the table
        return None, f"it raised {type(e).__name__}: {e}"
    return got, (f"a tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else
                 f"a {type(got).__name__}")


def _raised(said: str) -> str:
    """What _call said, when it is what the call raised; "" otherwise."""
    return said if said.startswith("it raised") else ""


def _one(scale: torch.Tensor) -> torch.Tensor:
    """A one-element scale of any shape ((), (1,), (1, 1) all broadcast) as a number; others as they are."""
    return scale.detach().reshape(()) if scale.numel() == 1 else scale.detach()


PAIR = "(q, scale), two tensors"


def _pair(got, said: str) -> str:
    ok = isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)
    return PAIR if ok else said


# ---- 1. tensorwise and 2. rowwise ----------------------------------------------------------------------
def _quantized(answer: tuple, case: dict) -> dict:
    quantize, dequantize = answer
    x, dtype, given = case["_x"], case["dtype"], case.get("_given")
    got, said = _call(quantize, x.clone(), dtype, *(() if given is None else (given.clone(),)))
    seen = {"returned": _pair(got, said)}
    if seen["returned"] != PAIR:
        return seen
    q, scale = got
    seen.update({"q": f"{q.dtype}, shape {tuple(q.shape)}", "scale dtype": scale.dtype, "_scale": scale,
                 "scale shape": "one element" if scale.numel() == 1 and scale.dim() <= x.dim() else tuple(scale.shape),
                 "scale": _one(scale), "fp8 values": q})
    back, said = _call(dequantize, q, scale)
    finite = isinstance(back, torch.Tensor) and bool(back.isfinite().all())
    seen["dequantize"] = said + ("" if finite or not isinstance(back, torch.Tensor) else ", holding inf or NaN")
    fits = scale.dim() <= x.dim() and all(n in (1, m) for n, m in zip(scale.shape[::-1], x.shape[::-1]))
    if isinstance(back, torch.Tensor) and back.shape == x.shape and fits:   # the scale broadcasts against x
        seen["dequantized"] = back.float()
        inside = x.abs() <= _max(dtype) * scale          # saturated elements have no rounding bound
        ratio = (back.float() - x.float()).abs() / _bound(x, scale.float(), dtype)
        seen["error/bound"] = ratio[inside].max().item() if inside.any() else 0.0
    if case.get("_spike") is not None and q.shape == x.shape:   # the other rows, quantized without the outlier row
        calm = x.clone()
        calm[case["_spike"]] /= 1000.0
        others = torch.arange(x.shape[0]) != case["_spike"]
        calm_got, _ = _call(quantize, calm, dtype)
        seen["others kept"] = _pair(calm_got, "") == PAIR and calm_got[0].shape == q.shape and torch.equal(
            calm_got[0][others].view(torch.uint8), q[others].view(torch.uint8))
    return seen


def _expect_quantized(case: dict, observed: dict) -> dict:
    x, dtype = case["_x"], case["dtype"]
    q, scale = ref_quantize_tensorwise(x, dtype, case["_given"]) if "_given" in case else \
        ref_quantize_rowwise(x, dtype)
    shape = "one element" if scale.numel() == 1 else tuple(scale.shape)
    mine = observed.get("scale shape") == shape and observed.get("q") == f"{dtype}, shape {tuple(x.shape)}"
    return {"returned": PAIR, "q": f"{dtype}, shape {tuple(x.shape)}", "scale dtype": FP32, "scale shape": shape,
            "scale": _one(scale), "dequantize": f"a tensor of shape {tuple(x.shape)}", "fp8 values": q,
            "dequantized": ref_dequantize(observed["fp8 values"], observed["_scale"]) if mine else None,
            "error/bound": 1 + 1e-5, **({"others kept": True} if case.get("_spike") is not None else {})}


def _quantities(scale: str) -> dict:
    return {
        "returned": Exact("what quantize returned: (q, scale), two tensors"),
        "q": Exact("q's dtype and shape: the dtype asked for (cast the scaled values with .to(dtype)), the shape of x"),
        "scale dtype": Exact("the scale's dtype: keep scales in float32 (torch._scaled_mm wants them so)"),
        "scale shape": Exact(f"the scale's shape: {scale}"),
        "scale": Close("the scale: amax of |x| over the max of *this* format, torch.finfo(dtype).max (or the scale "
                       "given)", n=2, dtype=FP32),
        "dequantize": Exact("what dequantize(q, scale) returned: a finite tensor of the shape of x (clamp to +-max "
                            "before the cast, and never divide 0 by 0)"),
        "fp8 values": Bits("q: clamp(x / scale, -max, max).to(dtype), bit for bit"),
        "dequantized": Close("dequantize(q, scale): q * scale", n=2, dtype=FP32),
        "error/bound": AtMost("the largest |x - dequantize(q, scale)| over half a gap of the format"),
        "others kept": Exact("with one row 1000x larger, the other rows quantized as without it: each row needs its "
                             "own amax (amax over dim=-1, keepdim=True)")}


def _columns(case: dict, got: dict) -> dict:
    return {"err/bound": got.get("error/bound", math.inf),
            **({"others kept": {True: "yes", False: "no"}.get(got.get("others kept"), "-")}
               if "_spike" in case else {})}


def tw_inverted(x, dtype, scale=None):
    limit = _max(dtype)
    scale = limit / x.abs().max().float().clamp(min=1e-12) if scale is None else 1 / scale
    return (x.float() * scale).clamp(-limit, limit).to(dtype), scale


def tw_no_clamp(x, dtype, scale=None):
    scale = x.abs().max().float().clamp(min=1e-12) / _max(dtype) if scale is None else scale
    return (x.float() / scale).to(dtype), scale


def _set(x: torch.Tensor, where, value) -> torch.Tensor:
    x[where] = value
    return x


def _variant(name: str, base: type, **changed) -> type:
    """A misconception as its correct base with some attributes changed, under the name its test shows."""
    return type(name, (base,), {"__module__": __name__, **changed})


def _tw(name: str, scale_of: Callable) -> tuple:
    """A tensorwise quantize whose own scale (none given) is scale_of(x, dtype), with the correct dequantize."""
    return named(name, lambda x, dtype, scale=None: ref_quantize_tensorwise(
        x, dtype, scale_of(x, dtype) if scale is None else scale)), ref_dequantize


def _rescaled(name: str, quantize: Callable, scale: Callable) -> tuple:
    """quantize's q with scale(its scale, x) instead of its scale, with the correct dequantize."""
    return named(name, lambda x, *args: (lambda q, s: (q, scale(s, x)))(*quantize(x, *args))), ref_dequantize


def dequantize_divides(q, scale):
    return q.float() / scale


MULTIPLY = "dequantize multiplies: x = q * scale (q.float() * scale), the inverse of q = x / scale"

TENSORWISE = Check(
    "tensorwise", observe=observe_in_process(_quantized), expect=_expect_quantized, course=COURSE, only=ONLY,
    columns=_columns,
    note="one process. scale = amax(|x|) / max(dtype) as a float32 tensor (or the scale given), q = "
         "clamp(x / scale, -max, max).to(dtype); err/bound: largest |x - dequantize(q, scale)| over half a gap",
    cases=[dict(case=name, dtype=dtype, _x=x, _given=given) for name, x, dtype, given in [
        ("normal (16, 64)", _data((16, 64), 1), E4M3, None), ("normal (16, 64)", _data((16, 64), 1), E5M2, None),
        ("3-D (2, 8, 48)", _data((2, 8, 48), 2), E4M3, None),
        ("a negative outlier -2000", _set(_data((16, 64), 3), (2, 5), -2000.0), E4M3, None),   # the largest |x|
        ("gradient-sized, 1e-7", _data((8, 32), 4) * 1e-7, E5M2, None),   # far below e4m3's range unscaled
        ("all zeros", torch.zeros(4, 32), E4M3, None),
        ("stale scale: saturate", _data((8, 32), 5), E5M2, torch.tensor(1.0 / 57344.0)),
        ("stale scale: saturate", _data((8, 32), 5), E4M3, torch.tensor(0.5 / 448.0))]],
    quantities=_quantities("one element ((), (1,) or (1, 1))"),
    misconceptions=[
        Misconception(_rescaled("tw_float64_scale", ref_quantize_tensorwise, lambda s, x: s.double()),
                      "keep scales in float32 (torch._scaled_mm wants them so)"),
        Misconception((tw_inverted, ref_dequantize), "the scale looks inverted: scale = amax / max, so that x = q * "
                                                     "scale"),
        Misconception(_tw("tw_signed_max", lambda x, dtype: x.max().float().clamp(min=1e-12) / _max(dtype)),
                      "the scale is the amax of |x|, the largest magnitude: a negative value may be the largest "
                      "(x.abs().max())"),
        Misconception(_tw("tw_e4m3_max_always", lambda x, dtype: x.abs().max().float().clamp(min=1e-12) / 448.0),
                      "divide by the max of *this* format, torch.finfo(dtype).max: 448 for e4m3, 57344 for e5m2"),
        Misconception(_tw("tw_no_zero_guard", lambda x, dtype: x.abs().max().float() / _max(dtype)),
                      "the scale differs from amax / max on an all-zero tensor: clamp the amax at 1e-12, so the "
                      "scale stays positive and x / scale is never 0 / 0"),
        Misconception((named("tw_ignores_given_scale", lambda x, dtype, scale=None: ref_quantize_tensorwise(x, dtype)),
                       ref_dequantize), "the scale differs from the scale given: when a (stale) scale is given, use "
                                        "it, and saturate"),
        Misconception((tw_no_clamp, ref_dequantize), "clamp to +-max before the cast: beyond the format's max, "
                                                     "x / scale becomes inf or NaN in fp8"),
        Misconception((ref_quantize_tensorwise, dequantize_divides), MULTIPLY)])


def check_tensorwise(quantize_tensorwise: Callable, dequantize: Callable) -> None:
    """q, scale = quantize_tensorwise(x, dtype, scale=None); dequantize(q, scale) ~= x."""
    TENSORWISE((quantize_tensorwise, dequantize))


ROWWISE = Check(
    "rowwise", observe=observe_in_process(_quantized), expect=_expect_quantized, course=COURSE, only=ONLY,
    columns=_columns,
    note="one process. scale[i] = amax(|x[i, :]|) / max(dtype), shape (M, 1), float32; q = clamp(x / scale, "
         "-max, max).to(dtype). 'others kept': with one row 1000x larger, the other rows quantize as without it",
    cases=[dict(case=name, dtype=dtype, _x=x, _spike=spike) for name, x, dtype, spike in [
        ("rows of 1e-2 .. 10", _data((16, 64), 1), E4M3, None), ("rows of 1e-2 .. 10", _data((16, 64), 1), E5M2, None),
        ("one row 1000x larger", _set(_data((12, 40), 7), 3, _data((12, 40), 7)[3] * 1000), E4M3, 3),
        ("a row of zeros", _set(_data((6, 40), 8), 4, 0.0), E4M3, None),
        ("negative amax", _set(_data((6, 40), 9), (slice(None), 0), -50.0), E4M3, None),   # each row's largest |x|
        ("one row (1, 64)", _data((1, 64), 10, spread=False), E4M3, None)]],
    quantities=_quantities("(M, 1), one scale per row"),
    misconceptions=[
        Misconception(_tw("rw_per_column", lambda x, dtype: x.abs().amax(0, keepdim=True).clamp(min=1e-12) / _max(
            dtype)), "one scale per row: the amax over dim=-1 (along K), keepdim=True, shape (M, 1), not one per "
                     "column"),
        Misconception(_rescaled("rw_no_keepdim", ref_quantize_rowwise, lambda s, x: s[:, 0]),
                      "keep the reduced dimension (keepdim=True): the scale has shape (M, 1), so it broadcasts against "
                      "x (M, K)"),
        Misconception(_rescaled("rw_one_scale_per_tensor", ref_quantize_tensorwise, lambda s, x: s.expand(len(x), 1)),
                      "each row needs its own amax (amax over dim=-1, keepdim=True), not one for the whole tensor"),
        Misconception((ref_quantize_rowwise, dequantize_divides), MULTIPLY)])


def check_rowwise(quantize_rowwise: Callable, dequantize: Callable) -> None:
    """q, scale = quantize_rowwise(x (M, K), dtype): one scale per row, shape (M, 1)."""
    ROWWISE((quantize_rowwise, dequantize))


# ---- 3. the fp8 matmul ------------------------------------------------------------------------------
def _fp8_product(a, b, quantize, a_dtype, b_dtype) -> torch.Tensor:
    qa, sa = quantize(a, a_dtype)
    qb, sb = quantize(b, b_dtype)
    return ref_dequantize(qa, sa) @ ref_dequantize(qb, sb).t()


def _matmul_seen(float8_matmul: Callable, case: dict) -> dict:
    a, b = case["_a"], case["_b"]
    got, said = _call(float8_matmul, a.clone(), b.clone(), QUANTIZERS[case["scaling"]], *case["_dtypes"])
    return {"returned": said, "product": _terms(got, a.shape[-1]), "vs fp32": _rel(got, a.double() @ b.double().t())}


def _expect_matmul(case: dict, observed: dict) -> dict:
    a, b = case["_a"], case["_b"]
    return {"returned": f"a tensor of shape {(a.shape[0], b.shape[0])}", "vs fp32": case["_tol"],
            "product": _terms(_fp8_product(a, b, QUANTIZERS[case["scaling"]], *case["_dtypes"]), a.shape[-1])}


_A, _B, _GRAD = _data((24, 96), 11), _data((40, 96), 12, spread=False) * 0.05, _data((24, 40), 13) * 1e-6
FLOAT8_MATMUL = Check(
    "float8_matmul", observe=observe_in_process(_matmul_seen), expect=_expect_matmul, course=COURSE, only=ONLY,
    note="one process. Expected: dequantize(quantize(a, a_dtype)) @ dequantize(quantize(b, b_dtype)).T in float32 "
         "(what torch._scaled_mm computes); 'vs fp32': relative error against a @ b.T, "
         f"<= {FORWARD_TOL} (e4m3 x e4m3) or {E5M2_TOL} (with e5m2)",
    cases=[dict(case=name, scaling=scaling, _a=a, _b=b, _dtypes=dtypes, _tol=E5M2_TOL if E5M2 in dtypes else
                FORWARD_TOL) for name, a, b, dtypes in [
        ("x W^T: e4m3 x e4m3", _A, _B, (E4M3, E4M3)),
        ("dy W: e5m2 x e4m3", _GRAD, _B.t(), (E5M2, E4M3)),           # b (K, N) as the second operand
        ("dy^T x: e5m2 x e4m3", _GRAD.t(), _A.t(), (E5M2, E4M3))] for scaling in QUANTIZERS],
    columns=lambda case, got: {"vs fp32": got["vs fp32"]},
    quantities={
        "returned": Exact("what float8_matmul returned: a tensor of shape (rows of a, rows of b)"),
        "product": Close("the product of the two dequantized fp8 operands (quantize both along K, the last "
                         "dimension, then multiply in float32)", dtype=FP32),
        "vs fp32": AtMost("the relative error against a @ b.T in fp32")},
    misconceptions=[
        Misconception(named("mm_forgets_scales", lambda a, b, quantize, a_dtype, b_dtype: quantize(
            a, a_dtype)[0].float() @ quantize(b, b_dtype)[0].float().t()),
            "multiply the dequantized operands, q.float() * scale of each: the fp8 values alone are x / scale"),
        Misconception(named("mm_high_precision", lambda a, b, quantize, a_dtype, b_dtype: a @ b.t()),
                      "quantize both operands to fp8 and multiply the dequantized copies: a @ b.T in high precision "
                      "is not the fp8 matmul"),
        Misconception(named("mm_quantizes_b_along_n", lambda a, b, quantize, a_dtype, b_dtype: ref_dequantize(
            *quantize(a, a_dtype)) @ ref_dequantize(*quantize(b.t(), b_dtype))),   # b's scales across N
            "quantize b as given, (N, K), along K, its last dimension: rowwise scales of b.t() run across N"),
        Misconception(named("mm_one_dtype", lambda a, b, quantize, a_dtype, b_dtype: _fp8_product(
            a, b, quantize, a_dtype, a_dtype)), "quantize a in a_dtype and b in b_dtype: a gradient's product "
                                                "mixes e5m2 and e4m3")])


def check_float8_matmul(float8_matmul: Callable) -> None:
    """y = float8_matmul(a (M, K), b (N, K), quantize, a_dtype, b_dtype) ~= a @ b.T, from fp8 copies of a and b.

    Run with two quantizers written here (tensorwise and rowwise, both along the last dimension), so
    that only the matmul is checked."""
    FLOAT8_MATMUL(float8_matmul)


# ---- 4. the Linear ----------------------------------------------------------------------------------
def _linear_data(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape, out, seed = case["_shape"], case["_out"], case["_seed"]
    return (_data(shape, 20 + seed, spread=False), _data((out, shape[-1]), 30 + seed, spread=False) * 0.05,
            _data((*shape[:-1], out), 40 + seed, spread=False) * 1e-3)


def _linear_seen(Float8LinearFunction, case: dict) -> dict:
    x, w, grad = _linear_data(case)
    x_in, w_in = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, said = _call(Float8LinearFunction.apply, x_in, w_in, QUANTIZERS[case["scaling"]])
    seen = {"forward": said, "y": _terms(y, x.shape[-1])}
    if isinstance(y, torch.Tensor):
        seen["grad_fn"] = y.grad_fn is not None
        if seen["grad_fn"]:
            seen["backward"] = _raised(_call(y.backward, grad)[1])
    ref = _bf16_linear(x, w, grad)
    # float32 round-off of each product's sum: dx = dy W over the outputs, dW = dy^T x over the tokens
    seen.update({"dx": _terms(x_in.grad, w.shape[0]), "dW": _terms(w_in.grad, x.numel() // x.shape[-1]),
                 "y vs bf16": _rel(y.detach() if isinstance(y, torch.Tensor) else y, ref[0]),
                 "dx vs bf16": _rel(x_in.grad, ref[1]), "dW vs bf16": _rel(w_in.grad, ref[2])})
    return seen


def _expect_linear(case: dict, observed: dict) -> dict:
    """Forward and both gradients as three quantized products (_Linear): x W^T, dy W, dy^T x (flattened tokens)."""
    x, w, grad = _linear_data(case)
    x.requires_grad_(), w.requires_grad_()
    y = _Linear.apply(x, w, QUANTIZERS[case["scaling"]])
    y.backward(grad)
    return {"forward": f"a tensor of shape {tuple(y.shape)}", "y": _terms(y, x.shape[-1]), "grad_fn": True,
            "backward": "", "dx": _terms(x.grad, w.shape[0]), "dW": _terms(w.grad, x.numel() // x.shape[-1]),
            "y vs bf16": FORWARD_TOL, "dx vs bf16": E5M2_TOL, "dW vs bf16": E5M2_TOL}


def _bf16_linear(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor):
    """The same layer with bf16 inputs and fp32 accumulation, autograd's gradients."""
    x16, w16 = x.bfloat16().float().requires_grad_(), w.bfloat16().float().requires_grad_()
    y = x16 @ w16.t()
    y.backward(grad.bfloat16().float())
    return y.detach(), x16.grad, w16.grad


class _Linear(torch.autograd.Function):
    """The correct Function the misconceptions below change: forward(x2, weight) saves what `saved` returns and
    multiplies in `dtype`; backward is the one the assignment gives."""
    dtype, saved = E4M3, staticmethod(lambda x2, weight, quantize: (x2, weight))

    @classmethod
    def product(cls, x2, weight, quantize):
        return _fp8_product(x2, weight, quantize, cls.dtype, cls.dtype)

    @classmethod
    def forward(cls, ctx, x, weight, quantize):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(*cls.saved(x2, weight, quantize))
        ctx.quantize, ctx.x_shape = quantize, x.shape
        return cls.shaped(cls.product(x2, weight, quantize), x, weight)

    @staticmethod
    def shaped(y, x, weight):
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        return (_fp8_product(g, weight.t(), ctx.quantize, E5M2, E4M3).reshape(ctx.x_shape),
                _fp8_product(g.t(), x.t(), ctx.quantize, E5M2, E4M3), None)


FLOAT8_LINEAR = Check(
    "float8_linear", observe=observe_in_process(_linear_seen), expect=_expect_linear, course=COURSE, only=ONLY,
    note="one process. Expected: forward x W^T from e4m3 copies, backward dy W and dy^T x with dy in e5m2, each "
         "product as in float8_matmul. 'vs bf16': largest relative error of y, dx, dW against bf16 matmuls, "
         f"<= {FORWARD_TOL} for y and {E5M2_TOL} for the gradients",
    cases=[dict(case=name, scaling=scaling, _shape=shape, _out=out, _seed=seed)
           for seed, (name, shape, out) in enumerate([("tokens (32, 96)", (32, 96), 64),
                                                      ("batch x seq (2, 12, 80)", (2, 12, 80), 48)])
           for scaling in QUANTIZERS],
    columns=lambda case, got: {key: got[key] for key in ("y vs bf16", "dx vs bf16", "dW vs bf16")},
    quantities={
        "forward": Exact("what forward returned: y of shape (..., N) (flatten the leading dimensions for the matmul "
                         "and restore them after)"),
        "y": Close("forward: x W^T from e4m3 copies of x and W (quantized along K)", dtype=FP32),
        "grad_fn": Exact("the output has a grad_fn: return forward's result as is (no .detach(), no "
                         "torch.no_grad())"),
        "backward": Exact("what the given backward raised: it reads ctx.saved_tensors = (x as (M, K), weight), "
                          "ctx.quantize and ctx.x_shape; set them in forward"),
        "dx": Close("dx, against the quantized product dy W (did forward save x and the weight themselves, before "
                    "any quantization, and the quantize it was given?)", dtype=FP32),
        "dW": Close("dW, against the quantized product dy^T x (did forward save x and the weight themselves, "
                    "before any quantization, and the quantize it was given?)", dtype=FP32),
        "y vs bf16": AtMost("the relative error of y against bf16"),
        "dx vs bf16": AtMost("the relative error of dx against bf16"),
        "dW vs bf16": AtMost("the relative error of dW against bf16")},
    misconceptions=[
        Misconception(_variant("LinearNoReshape", _Linear, shaped=staticmethod(lambda y, x, weight: y)),
                      "flatten the leading dimensions for the matmul and restore them after: y has the shape of x "
                      "with N last"),
        Misconception(_variant("LinearHighPrecision", _Linear, product=staticmethod(lambda x2, w, q: x2 @ w.t())),
                      "forward must multiply e4m3 copies of x and W (quantized along K), not the high-precision "
                      "product"),
        Misconception(_variant("LinearE5M2Forward", _Linear, dtype=E5M2), "forward multiplies e4m3 copies of x and W "
                                                                          "(more mantissa); e5m2 is for the gradients"),
        Misconception(_variant("LinearSavesNothing", _Linear, saved=staticmethod(lambda x2, weight, quantize: ())),
                      "the given backward reads ctx.saved_tensors = (x as (M, K), weight), ctx.quantize and "
                      "ctx.x_shape: set them in forward"),
        Misconception(_variant("LinearSavesQuantized", _Linear, saved=staticmethod(lambda x2, weight, quantize: (
            ref_dequantize(*quantize(x2, E4M3)), ref_dequantize(*quantize(weight, E4M3))))),
            "save x and the weight themselves (before any quantization) and the quantize forward was given: the "
            "given backward quantizes them itself")])


def check_float8_linear(Float8LinearFunction) -> None:
    """y = Float8LinearFunction.apply(x (..., K), weight (N, K), quantize): your forward, the given backward."""
    FLOAT8_LINEAR(Float8LinearFunction)


# ---- 5. stretch: delayed scaling --------------------------------------------------------------------
class _Scaler:
    """The rules of the stretch, step by step, in plain torch: the scale from the largest amax of the last H steps
    (x 2^margin); this step's own amax when there is no history (none yet, or all zeros) or when it overflows the
    delayed one (counted); then this step's amax joins the history. The correct base of the misconceptions below
    (refused as an answer)."""

    def __init__(self, dtype, history_len, margin=0):
        self.dtype, self.history_len, self.margin = dtype, history_len, margin
        self.history, self.overflows = [], 0

    def delayed_amax(self, amax):
        past = max(self.history[-self.history_len:], default=0.0)
        if past == 0:
            return amax
        if amax > past * 2 ** self.margin:
            self.overflows += 1
            return amax
        return past

    def scale(self, chosen):
        return torch.tensor(max(chosen, 1e-12) * 2 ** self.margin / _max(self.dtype), dtype=torch.float32)

    def quantize(self, x):
        amax = x.abs().max().item()
        chosen = self.delayed_amax(amax)
        self.history.append(amax)
        return ref_quantize_tensorwise(x, self.dtype, self.scale(chosen))


def _planted(amaxes: list[float], seed: int, shape=(16, 48)) -> list[torch.Tensor]:
    """One tensor per step, each with (about) the planted amax; an amax of 0 gives an all-zero tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for amax in amaxes:
        x = torch.randn(shape, generator=g)
        out.append(x * (amax / x.abs().max()) if amax else torch.zeros(shape))
    return out


def _count(scaler) -> float | None:
    """The learner's overflow count as a number, or None when it is missing or not a number."""
    counted = getattr(scaler, "overflows", None)
    if isinstance(counted, torch.Tensor) and counted.numel() == 1:
        counted = counted.item()
    return counted if isinstance(counted, (int, float)) and not isinstance(counted, bool) else None


def _each_scaler(values: list):
    """One scaler's value as it is, two scalers' as a list (the quantity's axis "scaler {}")."""
    return values[0] if len(values) == 1 else values


def _returned(got) -> str:
    if _pair(got, "") != PAIR:
        return f"a {type(got).__name__}" + (f" of {len(got)}" if isinstance(got, (tuple, list)) else "")
    q, scale = got
    one = "one float32 number" if scale.dtype == FP32 and scale.numel() == 1 else \
        f"{scale.dtype} of shape {tuple(scale.shape)}"
    return f"(q, scale): q {q.dtype} of shape {tuple(q.shape)}, the scale {one}"


def _observe_scalers(answers: list, cases: list) -> list:
    out = []
    for DelayedScaler in answers:
        getattr(DelayedScaler, "_misconception_restart", lambda: None)()   # a record's class state starts afresh
        out.append([_scaler_seen(DelayedScaler, case) for case in cases])
    return out


def _scaler_seen(DelayedScaler, case: dict) -> dict:
    """Each step, each scaler in turn (a new scaler per sequence): what quantize returned, its scale and q, and the
    overflow count after it."""
    made = [_call(lambda: DelayedScaler(dtype=case["dtype"], history_len=case["H"], margin=case["margin"]))
            for _ in case["_sequences"]]
    seen = {"made": _each_scaler([_raised(said) for _, said in made])}
    if any(_raised(said) for _, said in made):
        return seen
    sequences = [_planted(amaxes, seed) for amaxes, seed in case["_sequences"]]
    for step in range(len(sequences[0])):
        row: dict[str, list] = {"returned": [], "scale": [], "fp8 values": [], "overflows": []}
        for (scaler, _), xs in zip(made, sequences):
            got, said = _call(scaler.quantize, xs[step].clone())
            row["returned"].append(_raised(said) or _returned(got))
            pair = _pair(got, "") == PAIR
            row["scale"].append(_one(got[1]) if pair else None)
            row["fp8 values"].append(got[0] if pair else None)
            row["overflows"].append(_count(scaler))
        for key, values in row.items():
            seen.setdefault(key, []).append(_each_scaler(values))
        if any(_raised(said) for said in row["returned"]):
            break
    seen["counted"] = _each_scaler([_count(scaler) for scaler, _ in made])
    return seen


def _expect_scalers(case: dict, observed: dict) -> dict:
    """The rules' scale and overflow count each step; q as the rules make it at the learner's own scale."""
    dtype = case["dtype"]
    refs = [_Scaler(dtype, case["H"], case["margin"]) for _ in case["_sequences"]]
    want: dict[str, list] = {key: [] for key in ("returned", "scale", "fp8 values", "overflows")}
    for step, xs in enumerate(zip(*[_planted(amaxes, seed) for amaxes, seed in case["_sequences"]])):
        mine = observed.get("scale", [])[step] if step < len(observed.get("scale", [])) else None
        mine = mine if isinstance(mine, list) else [mine]
        row = {key: [] for key in want}
        for ref, x, scale in zip(refs, xs, mine):
            row["scale"].append(ref.quantize(x)[1])
            row["returned"].append(f"(q, scale): q {dtype} of shape {tuple(x.shape)}, the scale one float32 number")
            one = isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.dtype == FP32
            row["fp8 values"].append(ref_quantize_tensorwise(x, dtype, scale)[0] if one else None)
            row["overflows"].append(ref.overflows)
        for key, values in row.items():
            want[key].append(_each_scaler(values))
    return {"made": _each_scaler([""] * len(refs)), **want}


class DsDynamic(_Scaler):
    def quantize(self, x):   # records this step's amax before choosing the scale
        self.history.append(x.abs().max().item())
        return ref_quantize_tensorwise(x, self.dtype, self.scale(max(self.history[-self.history_len:])))


class DsSaturates(_Scaler):
    def delayed_amax(self, amax):   # counts an overflow but keeps the delayed scale: the step saturates
        chosen = super().delayed_amax(amax)
        return max(self.history[-self.history_len:], default=0.0) or chosen


class DsCountsWithoutHistory(_Scaler):
    def delayed_amax(self, amax):   # counts a step without history as an overflow, since its amax exceeds 0
        if not any(self.history[-self.history_len:]):
            self.overflows += 1
        return super().delayed_amax(amax)


class DsSharedHistory(_Scaler):
    """The history a class attribute: every scaler appends to the same list."""
    history: list = []
    overflows = 0

    def __init__(self, dtype, history_len, margin=0):
        self.dtype, self.history_len, self.margin = dtype, history_len, margin

    @classmethod
    def _misconception_restart(cls):   # as a learner's class on the check's first run
        cls.history.clear()


class DsSharedWhileAlive(_Scaler):
    """A history shared only by the scalers alive together: each new one clears it, so one scaler at a time passes."""
    shared: list = []

    def __init__(self, dtype, history_len, margin=0):
        super().__init__(dtype, history_len, margin)
        DsSharedWhileAlive.shared.clear()
        self.history = DsSharedWhileAlive.shared


def _ds(name: str, keeps=lambda h: h, headroom=lambda m: m, **changed) -> type:
    """A scaler whose history keeps keeps(H) amaxes, with the margin headroom(m), and other methods changed."""
    def init(self, dtype, history_len, margin=0):
        _Scaler.__init__(self, dtype, keeps(history_len), headroom(margin))
    return _variant(name, _Scaler, __init__=init, **changed)


def _sequence(name, dtype, history_len, margin, amaxes, seed) -> dict:
    return dict(case=name, dtype=dtype, H=history_len, margin=margin, steps=len(amaxes), _sequences=[(amaxes, seed)])


_WALK = (1e-6 * torch.exp(torch.randn(24, generator=torch.Generator().manual_seed(60)).mul(0.25).cumsum(0))).tolist()
DELAYED_SCALER = Check(
    "delayed_scaler", observe=_observe_scalers, expect=_expect_scalers, course=COURSE, only=ONLY,
    note="one process. Per step: scale = (largest amax of the last H steps) x 2^margin / max(dtype), float32; this "
         "step's amax instead with no history (none yet, or all 0) or when it exceeds that amax x 2^margin (an "
         "overflow, counted); q = clamp(x / scale, -max, max).to(dtype). Two scalers used in turn keep separate "
         "histories and counts. 'overflows': the learner's count at the end",
    cases=[_sequence("drifts down, then up", E4M3, 4, 0, [2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.2, 1.25, 1.9, 2.5], 70),
           _sequence("a 20x spike", E4M3, 3, 0, [1.0, 0.9, 20.0, 0.95, 0.9, 0.92, 0.85, 0.88, 0.8], 71),
           _sequence("grows 30% a step, margin 1", E5M2, 2, 1, [1.3 ** k for k in range(8)] + [20.0, 8.5], 72),
           _sequence("all-zero steps", E4M3, 3, 0, [0.0, 0.0, 1.5, 1.2, 0.0, 1.1, 0.7], 73),
           _sequence("gradient-sized random walk", E5M2, 16, 0, _WALK, 74),
           dict(case="two scalers, interleaved", dtype=E4M3, H=3, margin=0, steps=12,
                _sequences=[([1.0, 0.9, 0.8, 0.7, 0.6, 0.5], 90), ([900.0, 800.0, 950.0, 700.0, 600.0, 500.0], 91)])],
    columns=lambda case, got: {"overflows": got.get("counted", "-")},
    quantities={
        "made": Exact("what DelayedScaler(dtype=..., history_len=H, margin=m) raised", axes=("scaler {}",)),
        "returned": Exact("what scaler.quantize(x) returned: (q, scale), q in the scaler's dtype of the shape of x, "
                          "the scale one float32 number", axes=("step {}", "scaler {}")),
        "scale": Close("the scale: (the largest amax of the last history_len steps before this one) x 2^margin / "
                       "max; this step's own amax instead when there is no history (none yet, or all zeros) or when "
                       "it exceeds the delayed amax x 2^margin (an overflow); positive even for an all-zero tensor "
                       "(clamp the amax at 1e-12, as in part 1)", n=2, dtype=FP32, axes=("step {}", "scaler {}")),
        "fp8 values": Bits("q: clamp(x / scale, -max, max).to(dtype) at the scale returned, bit for bit",
                           axes=("step {}", "scaler {}")),
        "overflows": Exact("scaler.overflows after each step: one for each step whose amax exceeds the delayed amax "
                           "x 2^margin (a step without history never overflows)", axes=("step {}", "scaler {}"))},
    misconceptions=[
        Misconception(_ds("DsFloat64Scale", scale=lambda self, chosen: _Scaler.scale(self, chosen).double()),
                      "the scale must be one float32 number"),
        Misconception(_ds("DsNoZeroGuard", scale=lambda self, chosen: torch.tensor(
            chosen * 2 ** self.margin / _max(self.dtype), dtype=FP32)), "an all-zero tensor with no history must "
                                                                        "still get a positive scale (clamp the amax "
                                                                        "at 1e-12, as in part 1)"),
        Misconception(DsSharedHistory, "a new scaler has no history yet, so step 0 uses its own amax: keep the "
                                       "history on the instance (set in __init__), not shared with an earlier scaler"),
        Misconception(DsSharedWhileAlive, "two scalers share their history or count. Keep them on the instance "
                                          "(self.history = [] in __init__, not a class attribute)"),
        Misconception(_ds("DsOwnAmax", delayed_amax=lambda self, amax: amax),
                      "the scale is this step's own amax (dynamic scaling); the delayed scale comes from the amaxes of "
                      "the earlier steps, and this step's amax joins the history only after its scale is chosen"),
        Misconception(DsDynamic, "the scale is the largest amax of the last history_len steps up to this one: this "
                                 "step's amax joined the history before the scale was chosen"),
        Misconception(_ds("DsWindowOneLonger", keeps=lambda h: h + 1),
                      "the scale is the largest amax of the last history_len + 1 steps: the history holds the last "
                      "history_len"),
        Misconception(_ds("DsUnbounded", keeps=lambda h: 10**9),
                      "the scale is the largest amax of every earlier step: keep only the last history_len"),
        Misconception(DsSaturates, "this step's amax exceeds the delayed amax x 2^margin: count an overflow and use "
                                   "this step's own amax"),
        Misconception(_ds("DsNoMargin", headroom=lambda m: 0), "2^margin is missing: scale = amax x 2^margin / max"),
        Misconception(_ds("DsMarginDivides", headroom=lambda m: -m), "the margin divides: scale = amax x 2^margin / "
                                                                     "max"),
        Misconception(_ds("DsUncounted", delayed_amax=lambda self, amax: (_Scaler.delayed_amax(self, amax), setattr(
            self, "overflows", 0))[0]), "count an overflow (overflows += 1) for each step whose amax exceeds the "
                                        "delayed amax x 2^margin"),
        Misconception(DsCountsWithoutHistory, "a step without history (none yet, or all zeros) uses its own amax "
                                              "and is no overflow: a step without history never overflows")])


def check_delayed_scaler(DelayedScaler) -> None:
    """scaler = DelayedScaler(dtype=..., history_len=H, margin=m); q, scale = scaler.quantize(x) once per step;
    scaler.overflows counts the steps that overflowed. Planted sequences of amaxes, each with a new scaler."""
    DELAYED_SCALER(DelayedScaler)

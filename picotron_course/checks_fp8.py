"""The checks of assignment 10: fp8 quantization with a scale, and a Linear whose matmuls run in fp8.

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
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from picotron_course.checks import Report, close_enough, mismatch
from picotron_course.checks import not_the_course_answer

__all__ = ["check_tensorwise", "check_rowwise", "check_float8_matmul", "check_float8_linear", "check_delayed_scaler",
           "ref_quantize_tensorwise", "ref_quantize_rowwise", "ref_dequantize", "E4M3", "E5M2",
           "FORWARD_TOL", "E5M2_TOL"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP32 = torch.float32
FORWARD_TOL = 0.05       # relative Frobenius error against bf16, two e4m3 operands
E5M2_TOL = 0.08          # with an e5m2 operand (gradients)
COURSE = ("picotron.fp8", "picotron.mixed_precision")
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


def _bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a gap of the format around each element of x at this scale."""
    return torch.maximum(x.abs().float() * 2.0 ** -(MANTISSA[dtype] + 1), scale * SMALLEST_SUBNORMAL[dtype] / 2)


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    if got.shape != ref.shape:
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


# ---- tools ----------------------------------------------------------------------------------------------
def _call(fn: Callable, *args):
    """The learner's fn(*args), or (None, "error text") when it raises (NotImplementedError goes through)."""
    try:
        return fn(*args), ""
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - shown in the table
        return None, f"raised {type(e).__name__}: {e}"


def _pair(got, what: str) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    """(q, scale) from a learner's quantize, or a problem."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return None, None, f"{what} must return (q, scale), two tensors; got {type(got).__name__}"
    return got[0], got[1], ""


def _quantize_problem(got, x: torch.Tensor, dtype: torch.dtype, want_q: torch.Tensor, want_scale: torch.Tensor,
                      dequantize: Callable, what: str) -> tuple[str, float]:
    """A description of what is wrong with a learner's (q, scale) (empty if nothing), and max |error| / bound."""
    q, scale, problem = _pair(got, what)
    if problem:
        return problem, math.inf
    if q.dtype != dtype:
        return f"q is {q.dtype}, expected {dtype}: cast the scaled values with .to(dtype)", math.inf
    if q.shape != x.shape:
        return f"q has shape {tuple(q.shape)}, expected {tuple(x.shape)}", math.inf
    if scale.dtype != torch.float32:
        return f"the scale is {scale.dtype}; keep scales in float32 (torch._scaled_mm wants them so)", math.inf
    if want_scale.numel() == 1 and scale.numel() == 1 and scale.dim() <= x.dim():
        want_scale = want_scale.reshape(scale.shape)          # one scale: (), (1,) or (1, 1) all broadcast
    elif tuple(scale.shape) != tuple(want_scale.shape):
        expected = "one element" if want_scale.numel() == 1 else str(tuple(want_scale.shape))
        return f"the scale has shape {tuple(scale.shape)}, expected {expected}", math.inf
    if not close_enough(scale, want_scale, FP32, n=2):        # amax / max: a division, a rounding or two apart
        ratio = (scale / want_scale).flatten()[0].item()
        hint = (" (it looks inverted: scale = amax / max, so that x = q * scale)" if abs(ratio - 1) > 0.5 and
                torch.allclose(scale * want_scale, torch.ones_like(scale), rtol=1e-3) else
                f" (ratio {ratio:.4g}: amax of |x|, and the max of *this* format, {_max(dtype):g})")
        return f"the scale differs from amax / max{hint}. {mismatch(scale, want_scale)}", math.inf
    back, problem = _call(dequantize, q, scale)
    if problem:
        return f"dequantize {problem}", math.inf
    if not isinstance(back, torch.Tensor) or back.shape != x.shape:
        return f"dequantize returned {getattr(back, 'shape', type(back).__name__)}, expected shape {tuple(x.shape)}", \
            math.inf
    if not back.isfinite().all():
        return "dequantize(q, scale) holds inf or NaN: clamp to +-max before the cast (and never divide 0 by 0)", \
            math.inf
    if not torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)):
        wrong = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
        return (f"{wrong} of {q.numel()} fp8 values differ from clamp(x / scale, -max, max).to(dtype). "
                f"{mismatch(q.float(), want_q.float())}"), math.inf
    if not close_enough(back.float(), ref_dequantize(q, scale), FP32, n=2):   # q * scale: one multiplication
        return f"dequantize(q, scale) is not q * scale. {mismatch(back, ref_dequantize(q, scale))}", math.inf
    inside = x.abs() <= _max(dtype) * scale          # saturated elements have no rounding bound
    ratio = ((back - x.float()).abs() / _bound(x, scale, dtype))[inside].max().item() if inside.any() else 0.0
    problem = "" if ratio <= 1 + 1e-5 else "the error is above half a gap of the format"
    return problem, ratio


# ---- 1. tensorwise ----------------------------------------------------------------------------------
def _tensorwise_cases() -> list[tuple[str, torch.Tensor, torch.dtype, torch.Tensor | None]]:
    outlier = _data((16, 64), 3)
    outlier[2, 5] = -2000.0                                  # the largest |x| is negative
    zeros = torch.zeros(4, 32)
    tiny = _data((8, 32), 4) * 1e-7                          # gradient-sized: far below e4m3's range unscaled
    return [("normal (16, 64)", _data((16, 64), 1), E4M3, None),
            ("normal (16, 64)", _data((16, 64), 1), E5M2, None),
            ("3-D (2, 8, 48)", _data((2, 8, 48), 2), E4M3, None),
            ("a negative outlier -2000", outlier, E4M3, None),
            ("gradient-sized, 1e-7", tiny, E5M2, None),
            ("all zeros", zeros, E4M3, None),
            ("stale scale: saturate", _data((8, 32), 5), E5M2, torch.tensor(1.0 / 57344.0)),
            ("stale scale: saturate", _data((8, 32), 5), E4M3, torch.tensor(0.5 / 448.0))]


def check_tensorwise(quantize_tensorwise: Callable, dequantize: Callable) -> None:
    """q, scale = quantize_tensorwise(x, dtype, scale=None); dequantize(q, scale) ~= x."""
    not_the_course_answer("check_tensorwise", quantize_tensorwise, dequantize, course=COURSE)
    note = ("one process. scale = amax(|x|) / max(dtype) as a float32 tensor (or the scale given), q = "
            "clamp(x / scale, -max, max).to(dtype); err/bound: largest |x - dequantize(q, scale)| over half a gap")
    with Report("tensorwise", note=note) as report:
        for name, x, dtype, given in _tensorwise_cases():
            want_q, want_scale = ref_quantize_tensorwise(x, dtype, given)
            args = (x.clone(), dtype) if given is None else (x.clone(), dtype, given.clone())
            got, problem = _call(quantize_tensorwise, *args)
            ratio = math.inf
            if not problem:
                problem, ratio = _quantize_problem(got, x, dtype, want_q, want_scale, dequantize, "quantize_tensorwise")
            report.add(not problem, problem, case=name, dtype=dtype, **{"err/bound": ratio})


# ---- 2. rowwise -------------------------------------------------------------------------------------
def _rowwise_cases() -> list[tuple[str, torch.Tensor, torch.dtype]]:
    spike = _data((12, 40), 7)
    spike[3] *= 1000.0
    zero_row = _data((6, 40), 8)
    zero_row[4] = 0.0
    negative = _data((6, 40), 9)
    negative[:, 0] = -50.0                                   # each row's largest |x| is negative
    return [("rows of 1e-2 .. 10", _data((16, 64), 1), E4M3),
            ("rows of 1e-2 .. 10", _data((16, 64), 1), E5M2),
            ("one row 1000x larger", spike, E4M3),
            ("a row of zeros", zero_row, E4M3),
            ("negative amax", negative, E4M3),
            ("one row (1, 64)", _data((1, 64), 10, spread=False), E4M3)]


def check_rowwise(quantize_rowwise: Callable, dequantize: Callable) -> None:
    """q, scale = quantize_rowwise(x (M, K), dtype): one scale per row, shape (M, 1)."""
    not_the_course_answer("check_rowwise", quantize_rowwise, dequantize, course=COURSE)
    note = ("one process. scale[i] = amax(|x[i, :]|) / max(dtype), shape (M, 1), float32; q = clamp(x / scale, "
            "-max, max).to(dtype). 'others kept': with one row 1000x larger, the other rows quantize as without it")
    with Report("rowwise", note=note) as report:
        for name, x, dtype in _rowwise_cases():
            want_q, want_scale = ref_quantize_rowwise(x, dtype)
            got, problem = _call(quantize_rowwise, x.clone(), dtype)
            ratio, kept = math.inf, "-"
            if not problem:
                problem, ratio = _quantize_problem(got, x, dtype, want_q, want_scale, dequantize, "quantize_rowwise")
            if not problem and name.startswith("one row 1000x"):
                calm = x.clone()
                calm[3] /= 1000.0
                others = torch.arange(x.shape[0]) != 3
                calm_q, problem = _call(quantize_rowwise, calm, dtype)
                same = calm_q is not None and torch.equal(calm_q[0][others].view(torch.uint8),
                                                          got[0][others].view(torch.uint8))
                kept = "yes" if same else "no"
                problem = problem or ("" if same else "the outlier row changed how the other rows were quantized: "
                                                      "each row needs its own amax (amax over dim=-1, keepdim=True)")
            report.add(not problem, problem, case=name, dtype=dtype, **{"err/bound": ratio, "others kept": kept})


# ---- 3. the fp8 matmul ------------------------------------------------------------------------------
def _matmul_cases():
    a, b = _data((24, 96), 11), _data((40, 96), 12, spread=False) * 0.05
    grad = _data((24, 40), 13) * 1e-6
    return [("x W^T: e4m3 x e4m3", a, b, E4M3, E4M3),
            ("dy W: e5m2 x e4m3", grad, b.t(), E5M2, E4M3),           # b (K, N) as the second operand
            ("dy^T x: e5m2 x e4m3", grad.t(), a.t(), E5M2, E4M3)]


def check_float8_matmul(float8_matmul: Callable) -> None:
    """y = float8_matmul(a (M, K), b (N, K), quantize, a_dtype, b_dtype) ~= a @ b.T, from fp8 copies of a and b.

    Run with two quantizers written here (tensorwise and rowwise, both along the last dimension), so
    that only the matmul is checked."""
    not_the_course_answer("check_float8_matmul", float8_matmul, course=COURSE)
    note = ("one process. Expected: dequantize(quantize(a, a_dtype)) @ dequantize(quantize(b, b_dtype)).T in float32 "
            "(what torch._scaled_mm computes); 'vs fp32': relative error against a @ b.T, "
            f"<= {FORWARD_TOL} (e4m3 x e4m3) or {E5M2_TOL} (with e5m2)")
    quantizers = {"tensorwise": ref_quantize_tensorwise, "rowwise": ref_quantize_rowwise}
    with Report("float8_matmul", note=note) as report:
        for name, a, b, a_dtype, b_dtype in _matmul_cases():
            for scaling, quantize in quantizers.items():
                qa, sa = quantize(a, a_dtype)
                qb, sb = quantize(b, b_dtype)
                want = ref_dequantize(qa, sa) @ ref_dequantize(qb, sb).t()
                exact = a.double() @ b.double().t()
                got, problem = _call(float8_matmul, a.clone(), b.clone(), quantize, a_dtype, b_dtype)
                error = math.inf
                if not problem:
                    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                        problem = (f"expected a tensor of shape {tuple(want.shape)} = (rows of a, rows of b), got "
                                   f"{getattr(got, 'shape', type(got).__name__)}")
                    else:
                        error = _rel(got, exact)
                        # float32 round-off of a sum over K, added in another order (picotron.tolerance)
                        if not close_enough(got.float(), want, FP32, n=a.shape[-1]):
                            problem = ("not the product of the two dequantized fp8 operands (quantize both along K, "
                                       f"the last dimension, then multiply in float32). {mismatch(got, want)}")
                tol = E5M2_TOL if E5M2 in (a_dtype, b_dtype) else FORWARD_TOL
                if not problem and not error <= tol:
                    problem = f"relative error {error:.3g} against fp32 is above {tol}"
                report.add(not problem, problem, case=name, scaling=scaling, **{"vs fp32": error})


# ---- 4. the Linear ----------------------------------------------------------------------------------
def _ref_float8_linear(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, quantize: Callable):
    """Forward and both gradients as three quantized products: x W^T, dy W, dy^T x (flattened tokens)."""
    def mm(a, b, a_dtype, b_dtype):
        qa, sa = quantize(a, a_dtype)
        qb, sb = quantize(b, b_dtype)
        return ref_dequantize(qa, sa) @ ref_dequantize(qb, sb).t()
    x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
    y = mm(x2, w, E4M3, E4M3).reshape(*x.shape[:-1], w.shape[0])
    return y, mm(g2, w.t(), E5M2, E4M3).reshape(x.shape), mm(g2.t(), x2.t(), E5M2, E4M3)


def _bf16_linear(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor):
    """The same layer with bf16 inputs and fp32 accumulation, autograd's gradients."""
    x16, w16 = x.bfloat16().float().requires_grad_(), w.bfloat16().float().requires_grad_()
    y = x16 @ w16.t()
    y.backward(grad.bfloat16().float())
    return y.detach(), x16.grad, w16.grad


def check_float8_linear(Float8LinearFunction) -> None:
    """y = Float8LinearFunction.apply(x (..., K), weight (N, K), quantize): your forward, the given backward."""
    not_the_course_answer("check_float8_linear", Float8LinearFunction, course=COURSE)
    note = ("one process. Expected: forward x W^T from e4m3 copies, backward dy W and dy^T x with dy in e5m2, "
            f"each product as in float8_matmul. 'vs bf16': largest relative error of y, dx, dW against bf16 "
            f"matmuls, <= {FORWARD_TOL} for y and {E5M2_TOL} for the gradients")
    quantizers = {"tensorwise": ref_quantize_tensorwise, "rowwise": ref_quantize_rowwise}
    cases = [("tokens (32, 96)", (32, 96), 64), ("batch x seq (2, 12, 80)", (2, 12, 80), 48)]
    with Report("float8_linear", note=note) as report:
        for seed, (name, shape, out) in enumerate(cases):
            x = _data(shape, 20 + seed, spread=False)
            w = _data((out, shape[-1]), 30 + seed, spread=False) * 0.05
            grad = _data((*shape[:-1], out), 40 + seed, spread=False) * 1e-3
            for scaling, quantize in quantizers.items():
                problem, errors = _linear_case(Float8LinearFunction, x, w, grad, quantize)
                report.add(not problem, problem, case=name, scaling=scaling,
                           **{"y vs bf16": errors[0], "dx vs bf16": errors[1], "dW vs bf16": errors[2]})


def _linear_case(Float8LinearFunction, x, w, grad, quantize) -> tuple[str, list[float]]:
    """What is wrong with the learner's Function on this case ("" if nothing), and the errors against bf16."""
    nothing = [math.inf] * 3
    want_y, want_dx, want_dw = _ref_float8_linear(x, w, grad, quantize)
    x_in, w_in = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, problem = _call(Float8LinearFunction.apply, x_in, w_in, quantize)
    if problem:
        return f"forward {problem}", nothing
    if not isinstance(y, torch.Tensor) or y.shape != want_y.shape:
        return (f"forward returned {getattr(y, 'shape', type(y).__name__)}, expected shape {tuple(want_y.shape)}: "
                "flatten the leading dimensions for the matmul and restore them after"), nothing
    if not close_enough(y.float(), want_y, FP32, n=x.shape[-1]):      # float32 round-off of a sum over K
        return f"forward is not x W^T from e4m3 copies of x and W (quantized along K). {mismatch(y, want_y)}", nothing
    if y.grad_fn is None:
        return "the output has no grad_fn: return forward's result as is (no .detach(), no torch.no_grad())", nothing
    _, problem = _call(y.backward, grad)
    if problem:
        return (f"backward {problem}. The given backward reads ctx.saved_tensors = (x as (M, K), weight), "
                "ctx.quantize and ctx.x_shape: set them in forward"), nothing
    tokens, out = x.numel() // x.shape[-1], w.shape[0]
    # float32 round-off of each product's sum: dx = dy W over the outputs, dW = dy^T x over the tokens
    for what, got, want, n in (("dx", x_in.grad, want_dx, out), ("dW", w_in.grad, want_dw, tokens)):
        if got is None or got.shape != want.shape:
            return f"{what} has shape {getattr(got, 'shape', None)}, expected {tuple(want.shape)}", nothing
        if not close_enough(got, want, FP32, n=n):
            return (f"{what} differs from the quantized product: did forward save x and the weight themselves "
                    f"(before any quantization) and the quantize it was given? {mismatch(got, want)}"), nothing
    ref = _bf16_linear(x, w, grad)
    errors = [_rel(y.detach(), ref[0]), _rel(x_in.grad, ref[1]), _rel(w_in.grad, ref[2])]
    ok = errors[0] <= FORWARD_TOL and max(errors[1:]) <= E5M2_TOL
    return ("" if ok else "relative errors against bf16 above the tolerance"), errors


# ---- 5. stretch: delayed scaling --------------------------------------------------------------------
class _RefDelayed:
    """The rules of the stretch, step by step, in plain torch: the scale from the largest amax of the last H
    steps (x 2^margin); this step's own amax when there is no history (none yet, or all zeros) or when it
    overflows the delayed one (counted); then this step's amax joins the history."""

    def __init__(self, dtype: torch.dtype, history_len: int, margin: int):
        self.dtype, self.history_len, self.margin = dtype, history_len, margin
        self.history: list[float] = []                   # float32 amaxes, oldest first
        self.overflows = 0

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(the scale of this step, whether it overflowed)."""
        amax = x.detach().abs().max().float()
        delayed = max(self.history[-self.history_len:], default=0.0)
        overflow = delayed > 0 and amax.item() > delayed * 2.0 ** self.margin
        chosen = amax if delayed == 0 or overflow else torch.tensor(delayed)
        self.overflows += overflow
        self.history.append(amax.item())
        return chosen.clamp(min=1e-12) * 2.0 ** self.margin / _max(self.dtype), overflow


def _planted(amaxes: list[float], seed: int, shape=(16, 48)) -> list[torch.Tensor]:
    """One tensor per step, each with (about) the planted amax; an amax of 0 gives an all-zero tensor."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for amax in amaxes:
        x = torch.randn(shape, generator=g)
        out.append(x * (amax / x.abs().max()) if amax else torch.zeros(shape))
    return out


def _delayed_cases() -> list[tuple[str, torch.dtype, int, int, list[float]]]:
    g = torch.Generator().manual_seed(60)
    walk = (1e-6 * torch.exp(torch.randn(24, generator=g).mul(0.25).cumsum(0))).tolist()   # gradient-sized
    return [("drifts down, then up", E4M3, 4, 0, [2.0, 1.8, 1.6, 1.5, 1.4, 1.3, 1.2, 1.25, 1.9, 2.5]),
            ("a 20x spike", E4M3, 3, 0, [1.0, 0.9, 20.0, 0.95, 0.9, 0.92, 0.85, 0.88, 0.8]),
            ("grows 30% a step, margin 1", E5M2, 2, 1, [1.3 ** k for k in range(8)] + [20.0, 8.5]),
            ("all-zero steps", E4M3, 3, 0, [0.0, 0.0, 1.5, 1.2, 0.0, 1.1, 0.7]),
            ("gradient-sized random walk", E5M2, 16, 0, walk)]


def _delayed_hint(got: float, step: int, amaxes: list[float], history_len: int, margin: int,
                  dtype: torch.dtype) -> str:
    """Which plausible rule the learner's scale of `step` follows instead, if one."""
    fmax, now = _max(dtype), amaxes[step]
    def scale(amax, m=margin):
        return max(amax, 1e-12) * 2.0 ** m / fmax
    def window(first):
        return max(amaxes[max(first, 0):step], default=0.0)
    past = window(step - history_len)
    chosen = now if past == 0 or now > past * 2.0 ** margin else past     # the amax the rules use
    candidates = [
        (scale(now), "it is this step's own amax (dynamic scaling); the delayed scale comes from the amaxes of "
                     "the earlier steps, and this step's amax joins the history only after its scale is chosen"),
        (scale(max(amaxes[max(step - history_len + 1, 0):step + 1])),
         f"it is the largest amax of steps {max(step - history_len + 1, 0)}..{step}: this step's amax joined the "
         f"history before the scale was chosen, or the history keeps {history_len - 1} steps, not {history_len}"),
        (scale(window(step - history_len - 1)), f"it is the largest amax of the last {history_len + 1} steps: the "
                                                f"history holds the last history_len = {history_len}"),
        (scale(window(0)), "it is the largest amax of every earlier step: keep only the last history_len"),
        (scale(window(step - history_len)), "it is the delayed scale, but this step's amax exceeds the delayed amax "
                                            "x 2^margin: count an overflow and use this step's own amax"),
        (scale(chosen, 0), "2^margin is missing: scale = amax x 2^margin / max"),
        (scale(chosen, -margin), "the margin divides: scale = amax x 2^margin / max"),
    ]
    hints = [hint for value, hint in candidates if value > 0 and abs(got / value - 1) < 1e-5]
    if step == 0 and not hints:
        hints = ["a new scaler has no history yet, so step 0 uses its own amax: keep the history on the instance "
                 "(set in __init__), not shared with an earlier scaler"]
    return "; or ".join(hints) or "apply the rules in order: the delayed amax of the last history_len steps, no " \
                                  "history, overflow"


def _count(scaler) -> float | None:
    """The learner's overflow count as a number, or None when it is missing or not a number."""
    counted = getattr(scaler, "overflows", None)
    if isinstance(counted, torch.Tensor) and counted.numel() == 1:
        counted = counted.item()
    return counted if isinstance(counted, (int, float)) and not isinstance(counted, bool) else None


def _delayed_step(scaler, ref: _RefDelayed, x: torch.Tensor, where: str, amaxes: list[float], step: int) -> str:
    """One step of a planted sequence: what is wrong with the learner's scaler (empty if nothing)."""
    want_scale, overflow = ref.step(x)
    got, problem = _call(scaler.quantize, x.clone())
    if problem:
        return f"quantize at {where} {problem}"
    q, scale, problem = _pair(got, "quantize")
    if problem:
        return problem
    if scale.dtype != torch.float32 or scale.numel() != 1:
        return f"the scale must be one float32 number; got {scale.dtype} of shape {tuple(scale.shape)}"
    scale = scale.reshape(())
    if not scale.isfinite() or scale.item() <= 0:
        return (f"the scale at {where} is {scale.item():.3g}: an all-zero tensor with no history must still get a "
                "positive scale (clamp the amax at 1e-12, as in part 1)")
    if not close_enough(scale, want_scale, FP32, n=2):                 # amax x 2^margin / max: one division
        hint = _delayed_hint(scale.item(), step, amaxes, ref.history_len, ref.margin, ref.dtype)
        return (f"the scale at {where} is {scale.item():.6g}, expected {want_scale.item():.6g}"
                f"{' (an overflow step)' if overflow else ''}: {hint}")
    if q.dtype != ref.dtype or q.shape != x.shape:
        return f"q at {where} is {q.dtype} of shape {tuple(q.shape)}, expected {ref.dtype} of {tuple(x.shape)}"
    limit = _max(ref.dtype)
    want_q = (x.float() / scale).clamp(-limit, limit).to(ref.dtype)     # with the learner's own scale
    if not torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)):
        return f"q at {where} is not clamp(x / scale, -max, max).to(dtype). {mismatch(q.float(), want_q.float())}"
    if _count(scaler) != ref.overflows:
        return (f"overflows is {getattr(scaler, 'overflows', None)!r} after {where}, expected {ref.overflows}: count "
                "one for each step whose amax exceeds the delayed amax x 2^margin (a step without history never "
                "overflows)")
    return ""


def _delayed_sequence(DelayedScaler, dtype, history_len, margin, amaxes, seed) -> tuple[str, str]:
    """Run one planted sequence on a new scaler: (what is wrong or "", "learner's count/the rules' count")."""
    ref = _RefDelayed(dtype, history_len, margin)
    scaler, problem = _call(lambda: DelayedScaler(dtype=dtype, history_len=history_len, margin=margin))
    if problem:
        return f"DelayedScaler(dtype=..., history_len={history_len}, margin={margin}) {problem}", "-"
    xs = _planted(amaxes, seed)
    actual = [x.abs().max().item() for x in xs]
    for step, x in enumerate(xs):
        first = max(step - history_len - 1, 0)                   # the window, one step more, and this step
        where = f"step {step} (amaxes of steps {first}..{step}: {[float(f'{a:.3g}') for a in actual[first:step + 1]]})"
        problem = _delayed_step(scaler, ref, x, where, actual, step)
        if problem:
            break
    counted = _count(scaler)
    return problem, f"{'-' if counted is None else f'{counted:g}'}/{ref.overflows}"


def check_delayed_scaler(DelayedScaler) -> None:
    """scaler = DelayedScaler(dtype=..., history_len=H, margin=m); q, scale = scaler.quantize(x) once per step;
    scaler.overflows counts the steps that overflowed. Planted sequences of amaxes, each with a new scaler."""
    not_the_course_answer("check_delayed_scaler", DelayedScaler, course=COURSE)
    note = ("one process. Per step: scale = (largest amax of the last H steps) x 2^margin / max(dtype), float32; this "
            "step's amax instead with no history (none yet, or all 0) or when it exceeds that amax x 2^margin (an "
            "overflow, counted); q = clamp(x / scale, -max, max).to(dtype). 'overflows': the learner's / the rules'")
    with Report("delayed_scaler", note=note) as report:
        for seed, (name, dtype, history_len, margin, amaxes) in enumerate(_delayed_cases()):
            problem, counts = _delayed_sequence(DelayedScaler, dtype, history_len, margin, amaxes, 70 + seed)
            report.add(not problem, problem, case=name, dtype=dtype, H=history_len, margin=margin, steps=len(amaxes),
                       overflows=counts)
        problem = _two_scalers(DelayedScaler)
        report.add(not problem, problem, case="two scalers, interleaved", dtype=E4M3, H=3, margin=0, steps=12,
                   overflows="-")


def _two_scalers(DelayedScaler) -> str:
    """Two scalers used in turn (a layer's input and its weight) keep separate histories and counts."""
    small, large = _planted([1.0, 0.9, 0.8, 0.7, 0.6, 0.5], 90), _planted([900.0, 800.0, 950.0, 700.0, 600.0, 500.0],
                                                                           91)
    refs = [_RefDelayed(E4M3, 3, 0), _RefDelayed(E4M3, 3, 0)]
    scalers = []
    for _ in range(2):
        scaler, problem = _call(lambda: DelayedScaler(dtype=E4M3, history_len=3, margin=0))
        if problem:
            return f"DelayedScaler(...) {problem}"
        scalers.append(scaler)
    for step, pair in enumerate(zip(small, large)):
        for which, (scaler, ref, x) in enumerate(zip(scalers, refs, pair)):
            want, _ = ref.step(x)
            got, problem = _call(scaler.quantize, x.clone())
            if problem:
                return f"quantize {problem}"
            _, scale, problem = _pair(got, "quantize")
            if problem:
                return problem
            shared = ("two scalers share their history or count. Keep them on the instance (self.history = [] in "
                      "__init__, not a class attribute)")
            if scale.numel() != 1 or not close_enough(scale.reshape(()).float(), want, FP32, n=2):
                return (f"scaler {which} at step {step}: scale {scale.flatten()[0].item():.4g}, expected "
                        f"{want.item():.4g}: {shared}")
            if _count(scaler) != ref.overflows:
                return (f"scaler {which} at step {step}: overflows {getattr(scaler, 'overflows', None)!r}, expected "
                        f"{ref.overflows}: {shared}")
    return ""

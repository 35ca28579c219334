"""How far apart two computations of the same numbers may be when they differ only in rounding.

The policy behind every equivalence test and proof cell (docs/design.md, "Equivalence and
tolerances"); chapter 00 meets it first, comparing a ring all-reduce with torch's.

Two correct programs that compute the same sum of n terms (the K products of a matmul, one
gradient from every rank of an all-reduce, the row of a softmax) add them in different orders:
another CPU's vector width, a GPU's reduction tree, a matmul split over tp ranks, another
kernel. Each addition rounds its result to the nearest number of the format, off by at most u
times its size, u being the *unit roundoff* of the format the arithmetic really runs in:

    float64   u = 2^-53 = 1.1e-16
    float32   u = 2^-24 = 6.0e-8
    TF32      u = 2^-11 = 4.9e-4    an fp32 matmul on a CUDA GPU where torch allows it
                                    (torch.backends.cuda.matmul.allow_tf32, or
                                    torch.set_float32_matmul_precision("high")), and an fp32
                                    `tl.dot` in compiled Triton (its default input_precision)
    float16   u = 2^-11 = 4.9e-4
    bfloat16  u = 2^-8  = 3.9e-3

In the worst case, a sum of n terms in any order is off by gamma_n = n u / (1 - n u) times the
sum of the |terms| (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed. 2002,
section 4.2). That bound is reached only if every rounding goes the same way by its full u; it
grows like n, and a tolerance built on it (1e-3 of the sum of |terms| for K = 16384 in fp32)
would let real bugs through. Rounding errors of round-to-nearest behave instead like independent errors of
mean zero, and add like a random walk: sqrt(n) u (Higham & Mary 2019, "A New Approach to
Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5)). The policy, for every
element of the two tensors:

    |actual - expected| <= C sqrt(n) u scale,       C = SAFETY = 8

    n      how many roundings stand between the inputs and one element: the length of the
           reduction (K for a matmul, the ranks of an all-reduce, a softmax's row). A chain of
           computations adds its lengths up (their errors add up like one longer walk): a
           matmul over K after a norm over h is n = K + h.
    u      of the format the arithmetic runs in (above). bf16 matmuls accumulate in fp32 and
           round once, at the end: n = 1 in bf16 (an fp32 walk of K < 2^32 steps is smaller).
    scale  max |expected| over the whole tensor: every element's error is measured against it,
           so an element near zero (a sum whose terms cancel) gets the same absolute floor as
           the largest one. Where cancellation is heavy and the largest sum of |terms| is known
           (|A| @ |B| for A @ B), pass that instead.

Why C = 8 is safe. The difference of two computations is a sum of at most 2n rounding errors,
each at most u scale (no partial sum larger than the scale). By Hoeffding's inequality such a
sum exceeds C sqrt(n) u scale with probability at most 2 exp(-C^2 / 4): 2e-7 for C = 8, per
element. Measured (tests/test_tolerance.py, which requires below 2): sums and split matmuls of 16
to 16384 fp32 terms in forward, reversed, shuffled, pairwise, blocked and split orders, bf16 sums
and split bf16 matmuls stay below 1.2 sqrt(n) u scale; a small Llama whose norms sum in a
shuffled order has gradients within 0.04 of the bound (and, dividing by h - 1, 1000x outside).

Why it is still tight. A bug is not a rounding: a missing term of a K-term dot product moves the
result by about scale / sqrt(K), C K u times the bound (over 100x for K = 16384 in fp32); a wrong
scale factor, a transpose or a wrong shard by far more.

What it does not cover. Errors that a later step amplifies rather than adds: Adam divides each
gradient by its running RMS, so a gradient within rounding of zero can take a different step
(compare the losses, and the gradients while the weights are still equal); exp(a - b) of numbers
of size L, whose relative error is u L (pass scale = max |expected| x L, as the check of a
log-sum-exp merge does); a difference of nearly equal numbers relative to its own tiny size
(pass the larger scale); and data whose roundings are not independent (n equal terms rounded
the same way: a worst case, gamma_n).

Three claims of the course are fixed numbers, not derived here: N ranks train like one process,
step after step, with fp32 losses within 1e-5 (LOSS_ATOL), gradients within rtol = atol = 1e-5
(TRAINING_GRAD_TOL) and the weights after the AdamW steps within 1e-4 (ADAM_WEIGHTS_ATOL). After
the first step these compare runs whose weights already differ (Adam's amplified rounding), so
no rounding bound applies; they stay as strict as they were written. One step from equal
weights is rounding alone: that comparison uses the policy.

In bf16 mixed precision (picotron.train's --precision bf16) the claim is one bf16 rounding: N
ranks train like one process in bf16 with every step's loss within u_bf16 = 2^-8 of its size
(BF16_TRAINING_RTOL), i.e. the two losses would round to the same bf16 value or to neighbours;
so is the first step's gradient norm, from equal weights. Why that size: every bf16 matmul
rounds its output once, and the parallel run rounds in other places (a row-parallel matmul
rounds each rank's partial sum, each dp rank its share of a weight gradient), so the two runs
differ by a few bf16 roundings of each token's terms, which the loss's mean over the tokens
averages down. Measured over 8 steps of 12 layouts covering every axis
(tests/test_train_precision.py): the losses at most 0.10 of the bound (tp2 + SP), while one
process with a learning rate 2% larger leaves it (1.5 times the bound; 10% larger: 7.3 times).
Later gradient norms are not claimed: after Adam has turned rounding-sized gradient differences
into lr-sized weight differences, a norm can move by several percent while the losses still agree
to a tenth of a rounding (measured: 18 u at one step of tp2 + SP). The axes' arithmetic itself is
proven in fp32 at 1e-5; the bf16 comparison shows the precision composes with them (what is cast
where, which tensors travel in bf16).

    assert_close(y_tp, y_one_process, n=in_features)        # raises, saying the error and the bound
    close_enough(got, want, n=world)                       # the same test, as a bool
    compare_all(grads, reference_grads, n=n)               # the worst of a dict of tensors; truthy when within
    llama_roundings(config, seq, tokens)                   # n for a gradient of a whole picotron Llama
    rtol, atol = tolerance(torch.float32, n=K, scale=s)    # for torch.testing.assert_close
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

__all__ = ["SAFETY", "LOSS_ATOL", "TRAINING_GRAD_TOL", "ADAM_WEIGHTS_ATOL", "BF16_TRAINING_RTOL", "unit_roundoff",
           "relative_bound", "tf32_matmuls", "llama_roundings", "tolerance", "Comparison", "compare", "compare_all",
           "close_enough", "assert_close"]

SAFETY = 8                  # C: the bound is C sqrt(n) u scale (why 8: the module's docstring)
LOSS_ATOL = 1e-5            # N ranks vs one process, while training: fp32 losses, every step (a claim of the course)
TRAINING_GRAD_TOL = 1e-5    # ... gradients, every step: rtol = atol
ADAM_WEIGHTS_ATOL = 1e-4    # ... the weights after the AdamW steps (Adam amplifies rounding)
BF16_TRAINING_RTOL = 2.0 ** -8   # N ranks vs one process, both in bf16: every step's loss, relative (u_bf16)

# Significand bits p (the leading one included) of each format: u = 2^-p.
_BITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
_TF32_BITS = 11             # TF32 keeps fp32's exponent and fp16's 10 stored significand bits


def unit_roundoff(dtype: torch.dtype, *, device: torch.device | str | None = None, tf32: bool | None = None) -> float:
    """u of the arithmetic that produced a `dtype` result: half the gap between 1 and the next number.

    `tf32` says whether fp32 matmuls ran in TF32: None works it out (on a CUDA device, if torch
    allows TF32 matmuls), True for a compiled fp32 `tl.dot` with Triton's default input
    precision, False where no matmul could have (a sum, a collective, input_precision="ieee").
    Integers and bools are exact: u = 0.
    """
    if not dtype.is_floating_point:
        if dtype.is_complex:
            raise ValueError(f"dtype={dtype}: complex tensors are not covered; compare real and imaginary parts")
        return 0.0
    if dtype not in _BITS:
        raise ValueError(f"dtype={dtype}: no unit roundoff known (float8 formats: compare their dequantized values "
                         f"in the dtype of the arithmetic); choose one of {sorted(map(str, _BITS))}")
    bits = _BITS[dtype]
    if dtype == torch.float32 and (tf32 if tf32 is not None else tf32_matmuls(device)):
        bits = _TF32_BITS
    return 2.0 ** -bits


def tf32_matmuls(device: torch.device | str | None) -> bool:
    """Do fp32 torch matmuls on `device` run in TF32? Only on CUDA, and only where torch was told they may."""
    if device is None or torch.device(device).type != "cuda":
        return False
    return torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"


def relative_bound(n: int, dtype: torch.dtype = torch.float32, *, device: torch.device | str | None = None,
                   tf32: bool | None = None) -> float:
    """C sqrt(n) u: the largest difference allowed, as a fraction of the scale."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r}: the number of roundings behind each element, a whole number >= 1 "
                         "(the length of the reduction; 1 for an elementwise op)")
    return SAFETY * math.sqrt(n) * unit_roundoff(dtype, device=device, tf32=tf32)


def llama_roundings(config, seq: int, tokens: int) -> int:
    """n for any number a Llama (picotron.model, `config` its ModelConfig) computes in a forward and backward
    pass over `tokens` tokens in sequences of `seq`: the chain rule above, read from its shapes.

    Per layer, forward: two RMSNorms and the q/k/v and gate/up matmuls reduce over hidden h, o_proj
    over the heads' n_q d, the scores over head_dim d, softmax and P V over the sequence, down over
    the MLP width f (an MoE layer adds its router over h and the sum over its experts); backward
    reduces over the same lengths again. Then the LM head over h, the loss's softmax over the
    vocabulary, and every weight gradient's sum over the tokens.
    """
    h, d = config.hidden_size, config.head_dim
    layer = 4 * h + config.num_attention_heads * d + d + 2 * seq + config.intermediate_size
    moe = config.num_moe_layers * (h + config.num_experts)
    return 2 * (config.num_layers * layer + moe + h + config.vocab_size) + tokens


def tolerance(dtype: torch.dtype = torch.float32, n: int = 1, *, device: torch.device | str | None = None,
              tf32: bool | None = None, scale: float = 1.0) -> tuple[float, float]:
    """(rtol, atol) for torch.testing.assert_close / torch.allclose: rtol = 0, atol = C sqrt(n) u scale."""
    return 0.0, relative_bound(n, dtype, device=device, tf32=tf32) * scale


@dataclass(frozen=True)
class Comparison:
    """The outcome of `compare`: truthy when within the bound; str() explains either way."""

    error: float             # max |actual - expected| (inf: a NaN, an infinity, or shapes that differ)
    bound: float             # C sqrt(n) u scale
    n: int
    u: float
    scale: float
    scale_from: str          # "max |expected|", or "given"
    arithmetic: str          # e.g. "float32 on cpu", "float32 matmuls in TF32 on cuda"
    worst: str = ""          # where the error is largest: index, actual and expected values
    shape_note: str = ""     # set when the shapes differ
    name: str = ""           # which tensor, when several were compared (compare_all)

    @property
    def ok(self) -> bool:
        return not self.shape_note and self.error <= self.bound

    @property
    def ratio(self) -> float:
        """error / bound: below 1 passes."""
        if self.shape_note:
            return math.inf
        return self.error / self.bound if self.bound else (0.0 if self.error == 0 else math.inf)

    def __bool__(self) -> bool:
        return self.ok

    def __str__(self) -> str:
        name = f"{self.name}: " if self.name else ""
        if self.shape_note:
            return name + self.shape_note
        u = f"2^{round(math.log2(self.u))}" if self.u else "0 (exact)"
        return (f"{name}max |actual - expected| = {self.error:.3g}{self.worst}; allowed {self.bound:.3g} = "
                f"{SAFETY} x sqrt(n={self.n}) x u x scale, u = {u} ({self.arithmetic}), scale = {self.scale:.3g} "
                f"({self.scale_from}): {self.ratio:.2g} of the bound")


def compare(actual, expected, *, n: int, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
            tf32: bool | None = None, scale: float | None = None) -> Comparison:
    """Compare two tensors (or numbers) element by element against C sqrt(n) u scale.

    dtype   the format the arithmetic ran in; default the less precise of the two tensors'
            (a float64 reference does not count); required when both are Python numbers
    device  where it ran (default: `actual`'s device): decides TF32, with `tf32`
    scale   default max |expected| over the finite elements
    """
    actual_t, expected_t = _as_tensor(actual), _as_tensor(expected)
    dtype = dtype or _arithmetic_dtype(actual, expected)
    if device is None and isinstance(actual, torch.Tensor):
        device = actual.device
    u = unit_roundoff(dtype, device=device, tf32=tf32)
    arithmetic = _describe(dtype, device, u)
    a, e = actual_t.detach().double().cpu(), expected_t.detach().double().cpu()
    if a.shape != e.shape:
        return Comparison(math.inf, 0.0, n, u, 0.0, "", arithmetic,
                          shape_note=f"shapes differ: actual {tuple(a.shape)}, expected {tuple(e.shape)}")
    finite = e[e.isfinite()]
    scale_from = "given" if scale is not None else "max |expected|"
    if scale is None:
        scale = finite.abs().max().item() if finite.numel() else 0.0
    scale = float(scale)
    bound = relative_bound(n, dtype, device=device, tf32=tf32) * scale
    if a.numel() == 0:
        return Comparison(0.0, bound, n, u, scale, scale_from, arithmetic)
    diff = (a - e).abs()
    diff[a == e] = 0.0                                   # equal infinities (masked scores) are equal
    diff = diff.nan_to_num(nan=math.inf)                 # a NaN is as far off as can be
    worst = int(diff.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else ()
    where = (f" at {list(index)}" if index else "") + (f": actual {a.flatten()[worst].item():.8g}, "
                                                       f"expected {e.flatten()[worst].item():.8g}")
    return Comparison(diff.flatten()[worst].item(), bound, n, u, scale, scale_from, arithmetic, worst=where)


def compare_all(actual: dict, expected: dict, *, n: int, **options) -> Comparison:
    """Compare actual[k] with expected[k] for every key of `expected` (e.g. gradients by parameter name), each
    against its own scale, and return the worst comparison (largest error / bound), named by its key."""
    if not expected:
        return Comparison(0.0, 0.0, n, 0.0, 0.0, "", "", name="nothing to compare")
    if set(actual) != set(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        return Comparison(math.inf, 0.0, n, 0.0, 0.0, "", "", shape_note=f"keys differ: missing {missing}, "
                          f"unexpected {extra}")
    results = [dataclasses.replace(compare(actual[k], expected[k], n=n, **options), name=str(k)) for k in expected]
    return max(results, key=lambda result: result.ratio)


def close_enough(actual, expected, *, n: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tf32: bool | None = None,
                 scale: float | None = None) -> bool:
    """`compare(...)` as a bool: same shape, every element within C sqrt(n) u scale, no NaN."""
    return compare(actual, expected, n=n, dtype=dtype, device=device, tf32=tf32, scale=scale).ok


def assert_close(actual, expected, *, n: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tf32: bool | None = None,
                 scale: float | None = None, msg: str = "") -> Comparison:
    """Raise AssertionError unless `actual` equals `expected` within C sqrt(n) u scale; the message
    says the error, the bound and where the bound comes from. Returns the comparison (to print)."""
    result = compare(actual, expected, n=n, dtype=dtype, device=device, tf32=tf32, scale=scale)
    if not result.ok:
        raise AssertionError(f"{msg}: {result}" if msg else str(result))
    return result


def _as_tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value, dtype=torch.float64)


def _arithmetic_dtype(actual, expected) -> torch.dtype:
    """The less precise floating dtype of the tensors given; float64 references do not lower it."""
    dtypes = [t.dtype for t in (actual, expected) if isinstance(t, torch.Tensor)]
    if not dtypes:
        raise ValueError("both values are Python numbers: pass dtype=, the format they were computed in "
                         "(torch.float32 for a loss.item() of an fp32 model)")
    floating = [d for d in dtypes if d.is_floating_point]
    if not floating:
        return dtypes[0]
    return max(floating, key=lambda d: unit_roundoff(d))


def _describe(dtype: torch.dtype, device, u: float) -> str:
    where = f" on {torch.device(device).type}" if device is not None else ""
    if dtype == torch.float32 and u == 2.0 ** -_TF32_BITS:
        return f"float32 matmuls in TF32{where}"
    return f"{str(dtype).removeprefix('torch.')}{where}"

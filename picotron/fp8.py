"""FP8 training: number formats, scaling recipes and `Float8Linear`.

Chapter: chapters/10_mixed_precision.ipynb (Playbook, "Mixed precision training", "FP8
pretraining"), which measures the formats and explains the recipes. In short: each tensor is
scaled into the fp8 format's range before the cast (scale = amax / max_fp8; q = saturate(x /
scale)), and a scaled matmul multiplies the fp8 values and then the two scales, so a scale must be
constant along the contraction dimension. The recipes differ in what one scale covers and when it
is known:

    tensorwise   one scale per tensor, dynamic
    delayed      one scale per tensor, from the amaxes of the last `history_len` steps
    rowwise      one scale per row of each operand, (M, 1) and (1, N)
    blockwise    1 x 128 tiles for activations and gradients, 128 x 128 for weights (DeepSeek-V3)

Forward uses e4m3; gradients use e5m2 with one scale per tensor (its wider range) and e4m3 with
finer scales.

`Float8Linear` is an `nn.Linear` whose three matmuls (forward; input and weight gradients in
backward) use fp8 operands. On a CUDA GPU with fp8 support the tensorwise and rowwise products
run through `scaled_mm`; everywhere else (CPU, blockwise) they are emulated: quantize,
dequantize, multiply in fp32. The emulation computes the same sum of the same fp8 products, only
not faster.

Which path runs, and when:

    fp8_matmul, CUDA sm89+, tensorwise or rowwise, dims % 16 == 0   scaled_mm
    fp8_matmul, anything else (a CPU, blockwise, odd shapes)          emulation, always
    scaled_mm(a, b, scale_a, scale_b), any device                     torch._scaled_mm where this torch
                                                                      runs it with these dtypes, scales
                                                                      and bias on this device; else the
                                                                      same product emulated

`scaled_mm_runs` decides the last line once per combination (device, operand and output dtypes,
tensorwise or rowwise scales, bias or not; functools.cache), by a trial call on 16 x 32 @ 32 x 16
matrices whose result it checks against the dequantized product: so a kernel that refuses the
scales and one that would silently misuse them both fall back. torch >= 2.13 runs tensorwise
and rowwise scales on a CPU as on sm89+ GPUs; torch 2.11's CPU kernel takes one scale per tensor
only, so there rowwise products are emulated. The emulation matches `_scaled_mm`'s semantics:
out = (A * scale_a) @ (B * scale_b) accumulated in fp32, + bias, cast to out_dtype.

The master weight stays the module's fp32 (or bf16) parameter; backward re-quantizes the saved
high-precision input along the other axis where the recipe needs it (rowwise, blockwise).
Saving fp8 copies instead would halve the activation memory; not done here.

`convert_to_float8(model, recipe)` swaps a picotron Llama's Linears in place, sharing the
parameters, so state dicts and an optimizer made before the swap keep working.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

E4M3 = torch.float8_e4m3fn      # 1 sign, 4 exponent, 3 mantissa bits; "fn": no infinities, max 448
E5M2 = torch.float8_e5m2        # 1 sign, 5 exponent, 2 mantissa bits; IEEE-like, has inf, max 57344
FP8_DTYPES = (E4M3, E5M2)


# ---- Number formats -----------------------------------------------------------------------------

@dataclass(frozen=True)
class NumberFormat:
    """A binary floating-point format: what it can hold and how finely.

    A normal number is (1 + m / 2^mantissa_bits) * 2^e: 2^mantissa_bits values per power of two
    ([1, 2), [2, 4), ... each hold as many), so the relative gap between neighbours is at most
    eps = 2^-mantissa_bits. Below smallest_normal the exponent stops and the gap stays fixed at
    smallest_subnormal: precision fades linearly to zero (gradual underflow).
    """

    name: str
    dtype: torch.dtype | None       # None: tf32 exists only inside tensor cores (fp32 storage)
    exponent_bits: int
    mantissa_bits: int
    max: float                      # largest finite value
    smallest_normal: float
    smallest_subnormal: float

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def eps(self) -> float:
        """Gap between 1 and the next value: the relative precision of normal numbers."""
        return 2.0 ** -self.mantissa_bits

    @property
    def values_per_binade(self) -> int:
        """How many values lie in [1, 2) (or in any [2^e, 2^(e+1)) of the normal range)."""
        return 2 ** self.mantissa_bits

    def ulp(self, x: torch.Tensor) -> torch.Tensor:
        """Gap between |x| and the next larger value of the format (x in its finite range)."""
        exponent = torch.floor(torch.log2(x.abs().clamp(min=self.smallest_normal)))
        return torch.maximum(2.0 ** (exponent - self.mantissa_bits), torch.tensor(self.smallest_subnormal))


def _from_finfo(name: str, dtype: torch.dtype, exponent_bits: int, mantissa_bits: int) -> NumberFormat:
    info = torch.finfo(dtype)
    return NumberFormat(name, dtype, exponent_bits, mantissa_bits, float(info.max), float(info.tiny),
                        float(info.smallest_normal) * 2.0 ** -mantissa_bits)


FORMATS: dict[str, NumberFormat] = {
    "fp32": _from_finfo("fp32", torch.float32, 8, 23),
    # TF32: fp32's range with fp16's 10 mantissa bits; tensor cores read fp32 inputs this way
    # (NVIDIA A100 whitepaper). torch has no tf32 dtype: `round_to` emulates it.
    "tf32": NumberFormat("tf32", None, 8, 10, (2 - 2.0 ** -10) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -136),
    "fp16": _from_finfo("fp16", torch.float16, 5, 10),
    "bf16": _from_finfo("bf16", torch.bfloat16, 8, 7),
    "e4m3": _from_finfo("e4m3", E4M3, 4, 3),
    "e5m2": _from_finfo("e5m2", E5M2, 5, 2),
}


def format_of(dtype: torch.dtype) -> NumberFormat:
    for fmt in FORMATS.values():
        if fmt.dtype == dtype:
            return fmt
    raise ValueError(f"no number format for {dtype}; known: {[f.dtype for f in FORMATS.values()]}")


def round_mantissa(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """fp32 x rounded (to nearest, ties to even) to `mantissa_bits` bits of mantissa, fp32's exponent range.

    Works on the bit pattern: drop the low 23 - mantissa_bits bits after adding half of the dropped
    part (plus the kept last bit, for ties to even). tf32 is mantissa_bits=10.
    """
    if not 0 <= mantissa_bits <= 23:
        raise ValueError(f"mantissa_bits={mantissa_bits}; fp32 has 23")
    drop = 23 - mantissa_bits
    if drop == 0:
        return x.float().clone()
    bits = x.float().contiguous().view(torch.int32)
    keep_last = (bits >> drop) & 1
    rounded = (bits + (1 << (drop - 1)) - 1 + keep_last) & ~((1 << drop) - 1)
    return rounded.view(torch.float32)


def round_to(x: torch.Tensor, fmt: NumberFormat | str) -> torch.Tensor:
    """x rounded to the nearest value of `fmt` and returned in x's dtype: a low-precision number in
    fp32 storage, which is how this course emulates bf16, fp16 and fp8 on a CPU (a cast and back).

    fp16 and e5m2 overflow to inf beyond their max; e4m3fn saturates at 448 on this CPU (quantize
    below clamps first, so that no device-specific overflow rule is ever relied on).
    """
    fmt = FORMATS[fmt] if isinstance(fmt, str) else fmt
    if fmt.dtype is None:
        return round_mantissa(x, fmt.mantissa_bits).to(x.dtype)
    return x.to(fmt.dtype).to(x.dtype)


def all_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an 8-bit float format, sorted, as fp32 (the 256 bit patterns, decoded)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"all_values enumerates 8-bit formats only, not {dtype}")
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    return values[values.isfinite()].unique()      # unique: +0 and -0 are one value


# ---- Quantization: scale, saturate, cast ------------------------------------------------------------

def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def tiles_shape(shape: torch.Size, tile: tuple[int, int]) -> tuple[int, int]:
    """How many tiles cover (M, K): (ceil(M/rows), ceil(K/cols)), the shape of the scale."""
    return (-(-shape[0] // tile[0]), -(-shape[1] // tile[1]))


def _tiled(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """x (M, K) viewed (M/r, r, K/c, c) for tile = (r, c), padded with zeros to whole tiles if needed."""
    rows, cols = tile
    if x.shape[0] % rows or x.shape[1] % cols:
        x = F.pad(x, (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    return x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)


def tile_amax(x: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """Largest |x| of each (rows, cols) tile of x (M, K): shape (ceil(M/rows), ceil(K/cols)), fp32."""
    x = x.detach()
    if tile[0] >= x.shape[0] and tile[1] >= x.shape[1]:      # tensorwise
        return x.abs().amax().float().reshape(1, 1)
    if tile[0] == 1 and tile[1] >= x.shape[1]:                # rowwise
        return x.abs().amax(dim=1, keepdim=True).float()
    return _tiled(x.abs(), tile).amax(dim=(1, 3)).float()


def _per_tile(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int], op) -> torch.Tensor:
    """op(x, scale) with each tile's scale applied to its elements; (M, K) in, (M, K) out.

    Tensorwise and rowwise scales broadcast as they are; block scales are applied on the tiled
    view, so that no (M, K) tensor of scales is ever made."""
    m, k = x.shape
    if (tile[0] == 1 or tile[0] >= m) and tile[1] >= k:       # one scale per row, or per tensor
        return op(x, scale)
    tiled = op(_tiled(x, tile), scale[:, None, :, None])    # (M/r, r, K/c, c)
    return tiled.reshape(tiled.shape[0] * tiled.shape[1], -1)[:m, :k]


def expand_scale(scale: torch.Tensor, shape: torch.Size, tile: tuple[int, int]) -> torch.Tensor:
    """A per-tile scale (M/r, K/c) repeated over its tiles: the scale of every element, (M, K)."""
    rows, cols = tile
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """amax / max_fp8: the largest value lands on the format's largest. An all-zero tile gets a tiny
    positive scale, so that its zeros stay zeros instead of 0/0 = NaN."""
    return amax.float().clamp(min=1e-12) / fp8_max(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype, tile: tuple[int, int],
             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (fp8 values (M, K), fp32 scale per tile (ceil(M/r), ceil(K/c))), x ~= q * scale.

    tile (M, K) is tensorwise, (1, K) rowwise, (1, 128) or (128, 128) blockwise. `scale` given
    (delayed scaling): use it instead of this tensor's own amax; values beyond then saturate.
    """
    if scale is None:
        scale = scale_from_amax(tile_amax(x, tile), dtype)
    limit = fp8_max(dtype)
    scaled = _per_tile(x.float(), scale, tile, torch.div)
    return scaled.clamp_(-limit, limit).to(dtype), scale   # clamp: saturate rather than overflow to inf


def fp8_to_float(q: torch.Tensor) -> torch.Tensor:
    """q.float(), for e4m3 on a CPU decoded from the bits: torch's CPU conversion from e4m3 is ~10x
    slower than the one to it, and this exact decoding ~3x faster than it.

    An e4m3 byte s eeee mmm is the fp32 pattern s 0000eeee mmm 0...0 (the 7 low bits moved up by
    20) times 2^(127 - 7), the difference of the exponent biases; for e = 0 the fp32 pattern is a
    subnormal m 2^-129 and the product m 2^-9, e4m3's subnormal: both ranges come out right.
    """
    if q.dtype != E4M3 or q.device.type != "cpu":
        return q.float()
    bits = q.view(torch.int8).to(torch.int32)               # sign-extended: bit 31 is the sign
    keep = 0x87F00000 - 2**32                               # sign bit and the 7 bits moved up; as int32
    return ((bits << 20) & keep).view(torch.float32) * 2.0 ** 120


def dequantize(q: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """fp8 values (M, K) and their per-tile scale -> fp32 (M, K)."""
    return _per_tile(fp8_to_float(q), scale, tile, torch.mul)


def quantization_error_bound(x: torch.Tensor, scale: torch.Tensor, tile: tuple[int, int],
                             dtype: torch.dtype) -> torch.Tensor:
    """Largest |x - dequantize(quantize(x))| rounding to nearest allows, element by element (no saturation):

        normal range:    |x| eps / 2              eps = 2^-mantissa_bits: half a gap, relative
        subnormal range: scale * subnormal / 2    a fixed gap below smallest_normal * scale
    """
    fmt = format_of(dtype)
    full_scale = expand_scale(scale, x.shape, tile)
    return torch.maximum(x.abs().float() * fmt.eps / 2, full_scale * fmt.smallest_subnormal / 2)


# ---- Recipes ------------------------------------------------------------------------------------------

GRANULARITIES = ("tensorwise", "rowwise", "blockwise")
SCALINGS = ("dynamic", "delayed", "none")


@dataclass(frozen=True)
class Float8Recipe:
    """How a Float8Linear quantizes its three matmuls.

    granularity  "tensorwise", "rowwise" or "blockwise" (1 x block activations/gradients, block x block weights)
    scaling      "dynamic" (this tensor's amax), "delayed" (max amax of the last history_len steps,
                 tensorwise only) or "none" (scale 1: the plain cast, to show why scaling exists)
    grad_dtype   fp8 format of the output gradient in backward (forward always uses e4m3)
    """

    granularity: str = "tensorwise"
    scaling: str = "dynamic"
    grad_dtype: torch.dtype = E5M2
    block: int = 128
    history_len: int = 16

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity={self.granularity!r}; choose one of {GRANULARITIES}")
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling={self.scaling!r}; choose one of {SCALINGS}")
        if self.scaling == "delayed" and self.granularity != "tensorwise":
            raise ValueError("delayed scaling keeps one amax history per tensor: use granularity='tensorwise'")
        if self.grad_dtype not in FP8_DTYPES:
            raise ValueError(f"grad_dtype={self.grad_dtype}; choose torch.float8_e4m3fn or torch.float8_e5m2")
        if self.block < 1 or self.history_len < 1:
            raise ValueError(f"block={self.block} and history_len={self.history_len} must be >= 1")

    def tile(self, shape: torch.Size, weight: bool = False) -> tuple[int, int]:
        """The scaling tile of an operand (M, K) whose contraction dimension is K (the last)."""
        if self.granularity == "tensorwise":
            return (max(shape[0], 1), max(shape[1], 1))
        if self.granularity == "rowwise":
            return (1, max(shape[1], 1))
        return (self.block, self.block) if weight else (1, self.block)


# The recipes a config can name. Why these grad formats: see the module docstring.
NAMED_RECIPES: dict[str, Float8Recipe] = {
    "tensorwise": Float8Recipe("tensorwise", "dynamic", E5M2),
    "delayed": Float8Recipe("tensorwise", "delayed", E5M2),
    "rowwise": Float8Recipe("rowwise", "dynamic", E4M3),
    "blockwise": Float8Recipe("blockwise", "dynamic", E4M3, block=128),
}
RECIPES = tuple(NAMED_RECIPES)


def recipe_of(recipe: str | Float8Recipe) -> Float8Recipe:
    if isinstance(recipe, Float8Recipe):
        return recipe
    if recipe not in NAMED_RECIPES:
        raise ValueError(f"unknown fp8 recipe {recipe!r}; choose one of {RECIPES} (or pass a Float8Recipe)")
    return NAMED_RECIPES[recipe]


# ---- The fp8 matmul ------------------------------------------------------------------------------------

# The installed torch's kernel, for the trial calls of scaled_mm_runs (scaled_mm itself looks torch._scaled_mm up
# at each call). None where this torch has none.
_TORCH_SCALED_MM = getattr(torch, "_scaled_mm", None)


@functools.cache
def scaled_mm_runs(device: str, a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool,
                   out_dtype: torch.dtype, bias: bool = False) -> bool:
    """Whether torch._scaled_mm computes a product of these fp8 dtypes with tensorwise (rowwise=False) or
    rowwise scales, this output dtype and a bias or not, correctly on `device` ("cpu", "cuda:0").

    A trial call once per combination: a (16, 32) @ b (32, 16), b column-major, values and power-of-two
    scales that make the exact result easy to compare; an error or a wrong result (a kernel ignoring all
    but one scale) means no.
    """
    if _TORCH_SCALED_MM is None:
        return False
    # The first call comes from a forward pass, often under the trainer's bf16 autocast, which would round the
    # expected product to bf16 (and allclose refuses to compare it with the fp32 output): the trial is in fp32.
    with torch.autocast(torch.device(device).type, enabled=False):
        grid = torch.arange(16 * 32, dtype=torch.float32, device=device).reshape(16, 32)
        a = ((grid * 7 % 9 - 4) / 2).to(a_dtype)             # -2 .. 2 in steps of 1/2: exact in e4m3 and e5m2
        b = ((grid * 5 % 7 - 3) / 2).to(b_dtype).t()         # (32, 16) column-major
        rows, cols = torch.arange(16, dtype=torch.float32, device=device), torch.arange(16, device=device)
        scale_a = 2.0 ** (rows % 4 - 1).reshape(16, 1) if rowwise else torch.tensor(0.5, device=device)
        scale_b = 2.0 ** -(cols % 3).float().reshape(1, 16) if rowwise else torch.tensor(4.0, device=device)
        bias_value = torch.linspace(-1, 1, 16, device=device).to(out_dtype) if bias else None
        expected = (a.float() * scale_a) @ (b.float() * scale_b) + (bias_value.float() if bias else 0)
        try:
            out = _TORCH_SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias_value, out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False
        eps = torch.finfo(out_dtype).eps                     # the output's rounding, nothing more
        return out.dtype == out_dtype and bool(torch.allclose(out.float(), expected, rtol=eps, atol=eps))


def _scaled_mm_runs_here(device: str, a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool,
                         out_dtype: torch.dtype, bias: bool) -> bool:
    # scaled_mm_runs for scaled_mm. torch.compile cannot trace its trial call (the answer depends on the data:
    # "Unsupported: Data dependent operator"), and the cache around it is invisible to Dynamo; marked by
    # _answer_is_a_graph_constant, the compiler calls it once while tracing and keeps the answer as a constant.
    return scaled_mm_runs(device, a_dtype, b_dtype, rowwise, out_dtype, bias)


@functools.cache
def _answer_is_a_graph_constant() -> None:
    """torch.compiler.assume_constant_result on _scaled_mm_runs_here, once, when a Float8Linear is made rather than
    at import: marking imports torch._dynamo, and triton with it, which the rest of picotron never needs."""
    global _scaled_mm_runs_here
    _scaled_mm_runs_here = torch.compiler.assume_constant_result(_scaled_mm_runs_here)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch._scaled_mm(a, b, scale_a=, scale_b=, bias=, out_dtype=) where this torch runs it here
    (`scaled_mm_runs`), else the same product emulated: (a * scale_a) @ (b * scale_b) in fp32, + bias.

    a (M, K) and b (K, N) in fp8 (on a GPU: b column-major, dims multiples of 16), float32 scales of
    shape () each or (M, 1) and (1, N). Returns (M, N) in out_dtype, a 16- or 32-bit float (torch's fp8
    outputs, which need a scale of their own, are not offered).
    """
    if out_dtype in FP8_DTYPES:
        raise ValueError(f"out_dtype={out_dtype}: scaled_mm returns a 16- or 32-bit float; quantize its output "
                         f"afterwards if an fp8 one is needed")
    rowwise = scale_a.dim() > 0 or scale_b.dim() > 0      # shapes () or (M, 1), (1, N): known while tracing
    if _scaled_mm_runs_here(str(a.device), a.dtype, b.dtype, rowwise, out_dtype, bias is not None):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    out = (fp8_to_float(a) * scale_a) @ (fp8_to_float(b) * scale_b)         # (M, N), fp32 accumulation
    return (out if bias is None else out + bias.float()).to(out_dtype)


def has_fp8_matmul(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs on fp8 tensor cores here (NVIDIA compute capability 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _use_scaled_mm(a: torch.Tensor, b_t: torch.Tensor, recipe: Float8Recipe, a_dtype, b_dtype) -> bool:
    # cuBLAS fp8 GEMMs want every dimension a multiple of 16 and not both operands e5m2; rowwise
    # scales are taken with e4m3 operands only, and blockwise scales are emulated (portable across
    # torch versions).
    if not has_fp8_matmul(a.device) or any(d % 16 for d in (*a.shape, b_t.shape[0])):
        return False
    if recipe.granularity == "rowwise":
        return a_dtype == E4M3 and b_dtype == E4M3
    return recipe.granularity == "tensorwise" and not (a_dtype == E5M2 and b_dtype == E5M2)


def fp8_matmul(a: torch.Tensor, b_t: torch.Tensor, recipe: Float8Recipe, a_dtype: torch.dtype,
               b_dtype: torch.dtype, *, b_is_weight: bool = False, scale_a: torch.Tensor | None = None,
               scale_b: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a (M, K) @ b_t (N, K)^T with both operands quantized along K: (M, N) in out_dtype (a's by default).

    Both operands come row-major with K last, so one quantize serves both. With the "none" scaling
    the scale is 1 (the plain cast). scale_a / scale_b: fixed tensorwise scales (delayed scaling).
    """
    out_dtype = out_dtype or a.dtype
    tile_a, tile_b = recipe.tile(a.shape), recipe.tile(b_t.shape, weight=b_is_weight)
    if recipe.scaling == "none":
        scale_a = torch.ones(tiles_shape(a.shape, tile_a), device=a.device)
        scale_b = torch.ones(tiles_shape(b_t.shape, tile_b), device=a.device)
    qa, sa = quantize(a, a_dtype, tile_a, scale_a)
    qb, sb = quantize(b_t, b_dtype, tile_b, scale_b)
    if _use_scaled_mm(a, b_t, recipe, a_dtype, b_dtype):
        # The second operand must be column-major: qb (N, K) row-major, transposed, is. Rowwise scales
        # are (M, 1) and (1, N); tensorwise ones single numbers. fp32 accumulation inside.
        if recipe.granularity == "tensorwise":
            sa, sb = sa.reshape(()), sb.reshape(())
        else:
            sb = sb.t()
        mm_dtype = out_dtype if recipe.granularity == "tensorwise" or out_dtype == torch.bfloat16 else torch.bfloat16
        return scaled_mm(qa, qb.t(), sa, sb, out_dtype=mm_dtype).to(out_dtype)
    # Emulation: the same fp8 values and scales, multiplied in fp32.
    return (dequantize(qa, sa, tile_a) @ dequantize(qb, sb, tile_b).t()).to(out_dtype)


class DelayedScales(nn.Module):
    """Amax histories of one Float8Linear's input, weight and output gradient (delayed scaling).

    The scale of step t is max(amax of steps t-H .. t-1) / max_fp8: known before the tensor is
    (a real kernel can then quantize while it computes the amax for the next step). Before any
    history exists, the tensor's own amax is used. The buffers are not persistent: state dicts
    stay those of nn.Linear (a resumed run rebuilds its history in H steps).
    """

    def __init__(self, history_len: int):
        super().__init__()
        for role in ("input", "weight", "grad"):
            self.register_buffer(role, torch.zeros(history_len), persistent=False)

    def scale(self, role: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The scale to quantize x with, from the history; then record x's own amax."""
        history = getattr(self, role)
        amax = x.detach().abs().max().float()
        past = history.max()
        scale = scale_from_amax(torch.where(past > 0, past, amax), dtype).reshape(1, 1)
        with torch.no_grad():
            history.copy_(torch.cat([amax.reshape(1), history[:-1]]))      # newest first
        return scale


class _Float8LinearFunction(torch.autograd.Function):
    """y = x W^T with all three matmuls in fp8 (K = in_features, N = out_features, M = tokens):

        forward   y  = x  @ W^T      x (M, K) e4m3 along K,  W (N, K) e4m3 along K
        backward  dx = dy @ W        dy (M, N) grad_dtype along N,  W^T (K, N) e4m3 along N
                  dW = dy^T @ x      dy^T (N, M) grad_dtype along M,  x^T (K, M) e4m3 along M

    Each product is quantized along its own contraction dimension, so rowwise and blockwise
    scales are recomputed from the high-precision x and W that forward saves.
    """

    @staticmethod
    def forward(ctx, x, weight, recipe, delayed):
        scale_x = delayed.scale("input", x, E4M3) if delayed is not None else None
        scale_w = delayed.scale("weight", weight, E4M3) if delayed is not None else None
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.delayed, ctx.scales = recipe, delayed, (scale_x, scale_w)
        return fp8_matmul(x, weight, recipe, E4M3, E4M3, b_is_weight=True, scale_a=scale_x, scale_b=scale_w)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        recipe, delayed, (scale_x, scale_w) = ctx.recipe, ctx.delayed, ctx.scales
        grad_y = grad_y.contiguous()
        scale_g = delayed.scale("grad", grad_y, recipe.grad_dtype) if delayed is not None else None
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_matmul(grad_y, weight.t().contiguous(), recipe, recipe.grad_dtype, E4M3,
                                b_is_weight=True, scale_a=scale_g, scale_b=scale_w, out_dtype=x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = fp8_matmul(grad_y.t().contiguous(), x.t().contiguous(), recipe, recipe.grad_dtype, E4M3,
                                scale_a=scale_g, scale_b=scale_x, out_dtype=weight.dtype)
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """An nn.Linear (same `weight`, same `bias`, same state dict) whose matmuls run in fp8.

    The weight stays in its own dtype (the master copy); each forward quantizes it, and the
    input, according to `recipe`. The bias is added in high precision.
    """

    converted = True        # swap_linears leaves it alone

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: str | Float8Recipe = "tensorwise", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _answer_is_a_graph_constant()
        self.recipe = recipe_of(recipe)
        self.delayed = DelayedScales(self.recipe.history_len) if self.recipe.scaling == "delayed" else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | Float8Recipe = "tensorwise") -> "Float8Linear":
        """A Float8Linear that shares `linear`'s parameters (no copy: an optimizer holding them still works)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        _answer_is_a_graph_constant()
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.recipe = recipe_of(recipe)
        new.delayed = (DelayedScales(new.recipe.history_len).to(linear.weight.device)
                       if new.recipe.scaling == "delayed" else None)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _Float8LinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.recipe, self.delayed)
        y = y.reshape(*lead, self.out_features)                     # (..., out_features)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{super().extra_repr()}, fp8 {r.granularity} {r.scaling}, "
                f"grad {str(r.grad_dtype).removeprefix('torch.')}")


# ---- Swapping a model's Linears ----------------------------------------------------------------------

# Kept in high precision, and why (DeepSeek-V3, arXiv:2412.19437, 3.3.1, keeps these two, the
# embedding, norms and attention in bf16/fp32 too; here only Linears are ever converted):
#   lm_head   tied to the embedding in the small presets, and its output feeds the softmax over the
#             vocabulary, where logit errors become probability errors
#   router    an MoE router's scores decide which experts a token visits: a step function, so fp8
#             noise flips choices (chapter 07 shows fp32 round-off alone can); it is tiny anyway
KEEP_HIGH_PRECISION = ("lm_head", "router")


def swap_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module],
                 keep: Callable[[str, nn.Linear], bool]) -> list[str]:
    """Replace every nn.Linear under `module` (picotron.model's LMHead included; layers already converted, marked
    `converted`, stay) for which keep(name, linear) is False by make(linear). Returns the swapped names."""
    swapped = []
    for name, child in list(module.named_modules()):
        if not isinstance(child, nn.Linear) or getattr(child, "converted", False) or keep(name, child):
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent_name) if parent_name else module, attr, make(child))
        swapped.append(name)
    return swapped


def keeps_high_precision(name: str, linear: nn.Linear) -> bool:
    """True for layers convert_to_float8 leaves alone: KEEP_HIGH_PRECISION, and dimensions that are not
    multiples of 16 (what fp8 tensor cores need; such layers are small)."""
    last = name.rpartition(".")[2]
    return last in KEEP_HIGH_PRECISION or linear.in_features % 16 != 0 or linear.out_features % 16 != 0


def convert_to_float8(module: nn.Module, recipe: str | Float8Recipe = "tensorwise") -> nn.Module:
    """Swap the nn.Linear layers of `module` (a picotron Llama, or any module) for Float8Linear, in place.

    Parameters are shared, not copied: names, shapes, state dicts and an existing optimizer are
    unchanged, so it may run before or after wrapping for data parallelism or ZeRO. Stays high
    precision: see KEEP_HIGH_PRECISION and `keeps_high_precision`. Tensor parallelism does not
    compose with it yet: its layers are not nn.Linear (after apply_tensor_parallel nothing is left
    to convert, and a Float8Linear converted before is rebuilt as a high-precision shard).
    Raises ValueError when nothing was converted. Returns `module`.
    """
    recipe = recipe_of(recipe)
    swapped = swap_linears(module, lambda linear: Float8Linear.from_linear(linear, recipe), keeps_high_precision)
    if not swapped:
        raise ValueError(f"convert_to_float8 found no nn.Linear to convert in {type(module).__name__} (kept in high "
                         f"precision: {KEEP_HIGH_PRECISION} and dimensions not multiples of 16; tensor-parallel layers "
                         f"are never converted)")
    return module


def float8_layers(module: nn.Module) -> list[str]:
    """Names of the Float8Linear layers under `module`."""
    return [name for name, child in module.named_modules() if isinstance(child, Float8Linear)]

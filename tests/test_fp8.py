"""picotron.fp8: number formats, quantization error bounds per recipe, Float8Linear, the model swap.

Tolerances, stated once: a quantized element is within half a gap of the format (relative
2^-4 for e4m3, 2^-3 for e5m2 in the normal range; scale x half a subnormal below it). A whole
fp8 matmul is compared by relative Frobenius error ||got - ref|| / ||ref||, against bf16:
<= 0.05 when both operands are e4m3 (about 2^-4 / sqrt(3) per operand, two operands), <= 0.08
with an e5m2 operand (twice the gap).
"""

import pytest
import torch
from torch import nn
from torch.torch_version import TorchVersion

from picotron import tolerance
from picotron.config import ModelConfig, TrainConfig
from picotron.data import make_loader
import picotron.fp8 as fp8
from picotron.fp8 import (E4M3, E5M2, FORMATS, RECIPES, Float8Linear, Float8Recipe, all_values, convert_to_float8,
                          dequantize, float8_layers, fp8_matmul, fp8_to_float, format_of, has_fp8_matmul, quantize,
                          quantization_error_bound, recipe_of, round_mantissa, round_to, scaled_mm, scaled_mm_runs,
                          tile_amax)
from picotron.mixed_precision import LowPrecisionLinear
from picotron.model import Llama, LMHead, loss_fn

FORWARD_TOL = 0.05        # relative Frobenius error against bf16, both operands e4m3
E5M2_GRAD_TOL = 0.08      # with an e5m2 operand


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def activations(m=96, k=320, seed=0, outlier_row=None, factor=1000.0):
    """Activation-like data: K not a multiple of 128 (blockwise pads), optionally one outlier row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1)
    if outlier_row is not None:
        x[outlier_row] *= factor
    return x


# ---- formats ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["fp32", "fp16", "bf16", "e4m3", "e5m2"])
def test_formats_agree_with_torch(name):
    fmt = FORMATS[name]
    info = torch.finfo(fmt.dtype)
    assert fmt.bits == info.bits
    assert fmt.eps == info.eps and fmt.max == info.max and fmt.smallest_normal == info.smallest_normal
    assert fmt is format_of(fmt.dtype)


@pytest.mark.parametrize("dtype, width", [(torch.float16, torch.int16), (torch.bfloat16, torch.int16)])
def test_values_per_binade_by_enumeration(dtype, width):
    values = torch.arange(-2**15, 2**15, dtype=torch.int32).to(width).view(dtype).float()
    assert int(((values >= 1) & (values < 2)).sum()) == format_of(dtype).values_per_binade


@pytest.mark.parametrize("dtype, count, smallest", [(E4M3, 8, 2.0 ** -9), (E5M2, 4, 2.0 ** -16)])
def test_fp8_value_sets(dtype, count, smallest):
    values = all_values(dtype)
    fmt = format_of(dtype)
    assert int(((values >= 1) & (values < 2)).sum()) == count == fmt.values_per_binade
    assert values.max().item() == fmt.max and values[values > 0].min().item() == smallest == fmt.smallest_subnormal
    assert values.numel() == (253 if dtype == E4M3 else 247)     # 256 patterns - NaNs (- infs) - one zero


def test_round_mantissa_is_bf16_and_fp16_rounding():
    x = torch.randn(10_000) * 10
    assert torch.equal(round_mantissa(x, 7), x.to(torch.bfloat16).float())   # same exponent range: identical
    assert torch.equal(round_mantissa(x, 10), x.half().float())              # inside fp16's normal range
    tf32 = round_to(x, "tf32")
    assert ((tf32 - x).abs() <= x.abs() * 2.0 ** -11).all() and not torch.equal(tf32, x)
    ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8])                 # exactly half-way for bf16
    assert round_mantissa(ties, 7).tolist() == [1.0, 1 + 4 * 2.0 ** -8]     # ties to even


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fast_decode_equals_torch(dtype):
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    slow, fast = patterns.float(), fp8_to_float(patterns)
    finite = slow.isfinite()
    assert torch.equal(slow[finite], fast[finite]) and torch.equal(slow[finite].signbit(), fast[finite].signbit())
    x = (torch.randn(300, 200) * 100).to(dtype)
    assert torch.equal(fp8_to_float(x), x.float())


# ---- quantization error bounds, per recipe ------------------------------------------------------------

def tiles(recipe: Float8Recipe, shape, weight=False):
    return recipe.tile(torch.Size(shape), weight=weight)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("weight", [False, True])
def test_quantization_error_within_bound(recipe, dtype, weight):
    """Every element within half a gap of the format at its scale: eps/2 relative, or scale x subnormal/2."""
    x = activations(outlier_row=5)
    tile = tiles(recipe_of(recipe), x.shape, weight)
    q, scale = quantize(x, dtype, tile)
    back = dequantize(q, scale, tile)
    bound = quantization_error_bound(x, scale, tile, dtype)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    assert q.dtype == dtype and scale.dtype == torch.float32


@pytest.mark.parametrize("recipe, weight, shape", [
    ("tensorwise", False, (1, 1)), ("rowwise", False, (96, 1)),
    ("blockwise", False, (96, 3)), ("blockwise", True, (1, 3))])
def test_scale_shapes(recipe, weight, shape):
    x = activations()                                           # (96, 320): 320 = 2.5 blocks of 128
    q, scale = quantize(x, E4M3, tiles(recipe_of(recipe), x.shape, weight))
    assert tuple(scale.shape) == shape and q.shape == x.shape


def test_scale_is_amax_over_max():
    x = activations()
    for recipe in RECIPES:
        tile = tiles(recipe_of(recipe), x.shape)
        _, scale = quantize(x, E4M3, tile)
        tolerance.assert_close(scale, tile_amax(x, tile) / 448.0, n=2)   # a division: a rounding or two apart
    _, scale = quantize(x, E4M3, tiles(recipe_of("blockwise"), x.shape))
    tolerance.assert_close(scale[:, 2], x[:, 256:].abs().amax(1) / 448.0, n=2)   # the last, partial block


def test_finer_scales_contain_an_outlier():
    """One row 10^5 times larger: tensorwise error grows for every other row (they slide into e4m3's subnormals);
    rowwise and blockwise keep the others exactly as they would be without the outlier."""
    clean, spiked = activations(), activations(outlier_row=5, factor=1e5)
    others = torch.arange(96) != 5
    errors = {}
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        tile = tiles(recipe_of(recipe), clean.shape)
        back_clean = dequantize(*quantize(clean, E4M3, tile), tile)
        back_spiked = dequantize(*quantize(spiked, E4M3, tile), tile)
        errors[recipe] = rel_err(back_spiked[others], spiked[others])
        if recipe != "tensorwise":
            assert torch.equal(back_clean[others], back_spiked[others])
    assert errors["tensorwise"] > 3 * errors["rowwise"] and errors["rowwise"] < 0.04


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_zeros_stay_zeros(dtype):
    x = torch.zeros(4, 256)
    x[1, :3] = torch.tensor([1.0, -2.0, 3.0])
    for recipe in RECIPES:
        tile = tiles(recipe_of(recipe), x.shape)
        back = dequantize(*quantize(x, dtype, tile), tile)
        assert back.isfinite().all() and (back[x == 0] == 0).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_a_stale_scale_saturates_instead_of_overflowing(dtype):
    """Delayed scaling: a scale from a smaller past amax. Values beyond max * scale clamp to it (e5m2 would
    otherwise give inf)."""
    x = torch.tensor([[0.5, -1.0, 1e3, -1e6]])
    scale = torch.tensor([[1.0 / 448.0]])                     # fitted to amax = 1
    q, _ = quantize(x, dtype, (1, 4), scale)
    back = dequantize(q, scale, (1, 4))
    limit = torch.finfo(dtype).max / 448.0
    assert back.isfinite().all()
    assert back[0, 2].item() == limit and back[0, 3].item() == -limit


# ---- the fp8 matmul and Float8Linear ------------------------------------------------------------------

def _needs_cpu_scaled_mm(rowwise: bool) -> None:
    if not scaled_mm_runs("cpu", E4M3, E4M3, rowwise, torch.float32):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm lacks {'rowwise' if rowwise else 'tensorwise'} "
                    f"scales: picotron emulates them (test_scaled_mm_falls_back_to_the_same_product)")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_emulation_equals_scaled_mm(recipe):
    """On CPU torch._scaled_mm runs too: the real API on the same fp8 values and scales gives the emulated result."""
    _needs_cpu_scaled_mm(rowwise=recipe == "rowwise")
    a, b_t = activations(64, 256, seed=1), activations(48, 256, seed=2) * 0.02
    r = recipe_of(recipe)
    qa, sa = quantize(a, E4M3, r.tile(a.shape))
    qb, sb = quantize(b_t, E4M3, r.tile(b_t.shape, weight=True))
    scales = (sa.reshape(()), sb.reshape(())) if recipe == "tensorwise" else (sa, sb.t())
    real = torch._scaled_mm(qa, qb.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.float32)
    emulated = fp8_matmul(a, b_t, r, E4M3, E4M3, b_is_weight=True)
    tolerance.assert_close(emulated, real, n=256)   # sums of K = 256 fp32 products in two orders (picotron.tolerance)


def test_no_scaled_mm_on_cpu():
    assert not has_fp8_matmul(torch.device("cpu"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_scaled_mm_path_forced_on_cpu(recipe, monkeypatch):
    """The GPU path of Float8Linear (torch._scaled_mm, second operand column-major, float32 scales of shape ()
    or (M, 1) / (1, N)) run on this CPU: the same three products as the emulation; rowwise output goes through bf16,
    as _scaled_mm requires for rowwise scales."""
    _needs_cpu_scaled_mm(rowwise=recipe == "rowwise")
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False)
    x, grad = torch.randn(64, 256), torch.randn(64, 128) * 1e-3

    def run():
        linear.weight.grad = None
        x_in = x.clone().requires_grad_()
        Float8Linear.from_linear(linear, recipe)(x_in).backward(grad)
        return x_in.grad, linear.weight.grad.clone()

    emulated = run()
    calls = []
    real_scaled_mm = torch._scaled_mm

    def spy(a, b, **kwargs):
        calls.append((a.dtype, b.dtype, tuple(kwargs["scale_a"].shape), tuple(kwargs["scale_b"].shape), b.stride()))
        return real_scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(fp8, "has_fp8_matmul", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    real = run()
    assert len(calls) == 3 and all(stride[0] == 1 for *_, stride in calls)          # column-major second operand
    if recipe == "tensorwise":
        assert [c[:2] for c in calls] == [(E4M3, E4M3), (E5M2, E4M3), (E5M2, E4M3)]
        assert all(c[2] == c[3] == () for c in calls)
        assert all(torch.equal(a, b) for a, b in zip(real, emulated))
    else:
        assert calls[0][2:4] == ((64, 1), (1, 128))                                  # (M, 1) and (1, N)
        assert all(rel_err(a, b) < 2 ** -8 for a, b in zip(real, emulated))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_scaled_mm_path_compiles_in_one_graph(recipe, monkeypatch):
    """torch.compile(fullgraph=True) of a Float8Linear on the _scaled_mm path (forced on this CPU), forward and
    backward, as the trainer runs it (--compile --fp8 --precision bf16): the first trial of _scaled_mm comes while
    Dynamo traces, under bf16 autocast. One graph, and the gradients of eager. Both failed on an H200 on
    2026-11-28: Dynamo traced the trial's comparison ("Data dependent operator"; the answer is now a constant of
    the graph), then autocast rounded its expected product ("Float did not match BFloat16")."""
    _needs_cpu_scaled_mm(rowwise=recipe == "rowwise")
    monkeypatch.setattr(fp8, "has_fp8_matmul", lambda device: True)
    torch.manual_seed(0)
    layer = Float8Linear.from_linear(nn.Linear(256, 128, bias=False), recipe)
    x = torch.randn(64, 256)

    def grads(module, autocast):
        layer.weight.grad = None
        x_in = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = module(x_in)
        y.float().pow(2).sum().backward()
        return x_in.grad, layer.weight.grad.clone()

    for autocast in (True, False):
        scaled_mm_runs.cache_clear()
        torch._dynamo.reset()
        compiled = grads(torch.compile(layer, fullgraph=True), autocast)   # the first trial: while tracing
        eager = grads(layer, autocast)
        if autocast:   # bf16 outputs, rounded where eager and the compiled graph round
            for a, b in zip(compiled, eager):
                tolerance.assert_close(a, b, n=256, dtype=torch.bfloat16)
        else:
            assert all(torch.equal(a, b) for a, b in zip(compiled, eager))
    scaled_mm_runs.cache_clear()
    torch._dynamo.reset()


@pytest.fixture
def fresh_scaled_mm_runs():
    """scaled_mm_runs' cache emptied before and after: trials made under a fake kernel are not kept."""
    scaled_mm_runs.cache_clear()
    yield scaled_mm_runs
    scaled_mm_runs.cache_clear()


@pytest.mark.skipif(TorchVersion(torch.__version__) < "2.13", reason="torch 2.13 is the first with rowwise scales on "
                                                                     "a CPU")
def test_scaled_mm_runs_on_this_cpu_with_both_scalings(fresh_scaled_mm_runs):
    for rowwise in (False, True):
        for a_dtype, out_dtype in ((E4M3, torch.float32), (E5M2, torch.bfloat16)):
            assert scaled_mm_runs("cpu", a_dtype, E4M3, rowwise, out_dtype), (rowwise, a_dtype, out_dtype)
    assert scaled_mm_runs("cpu", E4M3, E4M3, True, torch.float32, bias=True)
    calls_before = scaled_mm_runs.cache_info().misses
    scaled_mm_runs("cpu", E4M3, E4M3, True, torch.float32)
    assert scaled_mm_runs.cache_info().misses == calls_before          # tried once, then remembered


def test_scaled_mm_runs_under_the_trainers_autocast(fresh_scaled_mm_runs):
    """The first trial comes from a forward pass under bf16 autocast (the trainer's --precision bf16): same answer
    as without it. Autocast once rounded the expected product to bf16 and allclose refused to compare
    ("Float did not match BFloat16": --compile --fp8 on an H200, 2026-11-28)."""
    combos = [(rowwise, out_dtype) for rowwise in (False, True) for out_dtype in (torch.float32, torch.bfloat16)]
    plain = [scaled_mm_runs("cpu", E4M3, E4M3, rowwise, out_dtype) for rowwise, out_dtype in combos]
    scaled_mm_runs.cache_clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [scaled_mm_runs("cpu", E4M3, E4M3, rowwise, out_dtype) for rowwise, out_dtype in combos] == plain


def test_scaled_mm_runs_sees_a_kernel_without_rowwise_scales(fresh_scaled_mm_runs, monkeypatch):
    """A kernel that refuses rowwise scales (torch 2.11's CPU one) or misuses them silently: no, for rowwise only."""
    real = fp8._TORCH_SCALED_MM

    def refuses(a, b, *, scale_a, scale_b, **kwargs):    # torch 2.11's CPU check, word for word
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError("Now _scaled_mm only supports per-tensor scaling for CPU backend.")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    def first_scale_only(a, b, *, scale_a, scale_b, **kwargs):
        return real(a, b, scale_a=scale_a.flatten()[0], scale_b=scale_b.flatten()[0], **kwargs)

    for fake in (refuses, first_scale_only):
        monkeypatch.setattr(fp8, "_TORCH_SCALED_MM", fake)
        scaled_mm_runs.cache_clear()
        assert not scaled_mm_runs("cpu", E4M3, E4M3, True, torch.float32), fake.__name__
        assert scaled_mm_runs("cpu", E4M3, E4M3, False, torch.float32), fake.__name__
    monkeypatch.setattr(fp8, "_TORCH_SCALED_MM", None)                  # a torch without _scaled_mm at all
    scaled_mm_runs.cache_clear()
    assert not scaled_mm_runs("cpu", E4M3, E4M3, False, torch.float32)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_scaled_mm_falls_back_to_the_same_product(rowwise, out_dtype, bias, fresh_scaled_mm_runs, monkeypatch):
    """Where this torch's _scaled_mm cannot (forced here), scaled_mm emulates it: the same (A sa) @ (B sb) + bias,
    against the exact product and, where this torch has the kernel, against the kernel.

    Tolerance from the dtypes: a sum of K fp32 terms, each the product of two fp32-rounded dequantized values,
    is within (K + 2) u sum|terms| of the exact one (u = 2^-24; Higham's gamma bound), so two such sums in any
    order are within 2 (K + 2) u sum|terms| of each other; a 16-bit output then rounds each by half a gap of
    out_dtype: eps |x| / 2 from the exact value, one gap, eps max|x|, between two rounded results.
    """
    m, k, n = 64, 256, 48
    g = torch.Generator().manual_seed(0)
    qa = (torch.randn(m, k, generator=g) * 50).to(E4M3)
    qb = (torch.randn(n, k, generator=g) * 50).to(E4M3).t()             # (K, N) column-major
    scale_a = torch.rand(m, 1, generator=g) + 0.5 if rowwise else torch.tensor(0.3)
    scale_b = torch.rand(1, n, generator=g) / 100 if rowwise else torch.tensor(0.02)
    bias_value = torch.randn(n, generator=g).to(out_dtype) if bias else None
    u, eps = 2.0 ** -24, torch.finfo(out_dtype).eps * (out_dtype != torch.float32)   # fp32 out: no 2nd rounding
    terms = (qa.double() * scale_a.double()).abs() @ (qb.double() * scale_b.double()).abs()
    exact = (qa.double() * scale_a.double()) @ (qb.double() * scale_b.double())
    exact = exact + (bias_value.double() if bias else 0)

    def no_kernel(*args, **kwargs):
        raise AssertionError("the fallback called torch._scaled_mm")

    with monkeypatch.context() as patch:
        patch.setattr(fp8, "scaled_mm_runs", lambda *args: False)
        patch.setattr(torch, "_scaled_mm", no_kernel)
        emulated = scaled_mm(qa, qb, scale_a, scale_b, out_dtype=out_dtype, bias=bias_value)
    assert emulated.dtype == out_dtype and emulated.shape == (m, n)
    bound = (k + 2) * u * terms + eps / 2 * exact.abs()
    assert ((emulated.double() - exact).abs() <= bound).all()
    assert (bound < 0.01 * exact.abs().max()).all()       # tight enough to catch a wrong scale, bias or dtype
    with pytest.raises(ValueError, match="returns a 16- or 32-bit float"):
        scaled_mm(qa, qb, scale_a, scale_b, out_dtype=E4M3)

    if not scaled_mm_runs("cpu", E4M3, E4M3, rowwise, out_dtype, bias):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm lacks these scales: no kernel to compare with")
    real = scaled_mm(qa, qb, scale_a, scale_b, out_dtype=out_dtype, bias=bias_value)
    assert torch.equal(real, torch._scaled_mm(qa, qb, scale_a=scale_a, scale_b=scale_b, bias=bias_value,
                                              out_dtype=out_dtype))      # this torch runs it: the kernel itself
    largest = torch.maximum(real.double().abs(), emulated.double().abs())
    assert ((emulated.double() - real.double()).abs() <= 2 * (k + 2) * u * terms + eps * largest).all()


def bf16_reference(linear: nn.Linear, x: torch.Tensor, grad: torch.Tensor):
    """Output and gradients of the same layer with bf16 matmuls (fp32 accumulation)."""
    ref = LowPrecisionLinear.from_linear(linear, torch.bfloat16)
    x = x.clone().requires_grad_()
    y = ref(x)
    y.backward(grad)
    out = (y.detach(), x.grad, linear.weight.grad.clone())
    linear.weight.grad = None
    return out


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_close_to_bf16(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(256, 192, bias=False)
    x = torch.randn(4, 32, 256)
    grad = torch.randn(4, 32, 192)
    y_ref, dx_ref, dw_ref = bf16_reference(linear, x, grad)
    layer = Float8Linear.from_linear(linear, recipe)
    x8 = x.clone().requires_grad_()
    y = layer(x8)
    y.backward(grad)
    grad_tol = E5M2_GRAD_TOL if layer.recipe.grad_dtype == E5M2 else FORWARD_TOL
    assert rel_err(y, y_ref) < FORWARD_TOL
    assert rel_err(x8.grad, dx_ref) < grad_tol
    assert rel_err(linear.weight.grad, dw_ref) < grad_tol
    assert y.shape == (4, 32, 192) and x8.grad.shape == x.shape


def test_float8_linear_matches_its_definition():
    """Forward and both gradients are exactly the three quantized products written out by hand (tensorwise)."""
    torch.manual_seed(1)
    layer = Float8Linear(64, 32, bias=True, recipe="tensorwise")
    x = torch.randn(10, 64, requires_grad=True)
    grad = torch.randn(10, 32)
    layer(x).backward(grad)

    def qdq(t, dtype):
        scale = t.abs().max() / torch.finfo(dtype).max
        return (t / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() * scale

    w = layer.weight.detach()
    y = qdq(x.detach(), E4M3) @ qdq(w, E4M3).t() + layer.bias.detach()
    # The same fp8 values, summed in another order: fp32 round-off of sums over K (picotron.tolerance).
    tolerance.assert_close(layer(x).detach(), y, n=64)                                           # in_features
    tolerance.assert_close(x.grad, qdq(grad, E5M2) @ qdq(w, E4M3), n=32)                         # out_features
    tolerance.assert_close(layer.weight.grad, qdq(grad, E5M2).t() @ qdq(x.detach(), E4M3), n=10)  # tokens
    tolerance.assert_close(layer.bias.grad, grad.sum(0), n=10)


def test_unscaled_cast_loses_small_values():
    """Scale 1: weights of std 0.005 keep 1-2 bits in e4m3 (below its normal range, 2^-6), gradients of 1e-6 vanish."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False)
    nn.init.normal_(linear.weight, std=0.005)
    x, grad = torch.randn(64, 256), torch.randn(64, 128) * 1e-6
    errors = {}
    for name, recipe in (("scaled", recipe_of("tensorwise")), ("unscaled", Float8Recipe(scaling="none"))):
        linear.weight.grad = None
        layer = Float8Linear.from_linear(linear, recipe)
        x8 = x.clone().requires_grad_()
        y = layer(x8)
        y.backward(grad)
        errors[name] = (rel_err(y, x @ linear.weight.detach().t()), x8.grad.abs().max().item())
    assert errors["scaled"][0] < FORWARD_TOL and errors["unscaled"][0] > 2 * errors["scaled"][0]
    assert errors["scaled"][1] > 0 and errors["unscaled"][1] == 0.0


def test_delayed_scaling_uses_the_history():
    torch.manual_seed(0)
    recipe = Float8Recipe("tensorwise", "delayed", E5M2, history_len=4)
    layer = Float8Linear(32, 16, bias=False, recipe=recipe)
    x = torch.randn(8, 32)
    layer(x)                                          # first step: its own amax (nothing in the history)
    assert layer.delayed.input[0].item() == x.abs().max().item()
    spike = x.clone()
    spike[0, 0] = 50 * x.abs().max()                  # a sudden outlier: the stale scale saturates it
    y = layer(spike)
    cap = x.abs().max()                               # the history's amax: max representable input
    assert layer.delayed.input[:2].tolist() == [spike.abs().max().item(), x.abs().max().item()]
    w8 = dequantize(*quantize(layer.weight.detach(), E4M3, (16, 32)), (16, 32))
    x_seen = dequantize(*quantize(spike, E4M3, (8, 32), (cap / 448).reshape(1, 1)), (8, 32))
    tolerance.assert_close(y.detach(), x_seen @ w8.t(), n=32)   # a sum over in_features: fp32 round-off
    assert x_seen[0, 0].item() == pytest.approx(cap.item(), rel=1e-6)     # saturated at the old amax
    assert "delayed" not in str(layer.state_dict().keys())                # histories are not persistent


def test_recipes_are_validated():
    assert set(RECIPES) == {"tensorwise", "delayed", "rowwise", "blockwise"}
    with pytest.raises(ValueError, match="unknown fp8 recipe"):
        recipe_of("columnwise")
    with pytest.raises(ValueError, match="tensorwise"):
        Float8Recipe("rowwise", "delayed")
    with pytest.raises(ValueError, match="grad_dtype"):
        Float8Recipe(grad_dtype=torch.bfloat16)


# ---- swapping a picotron Llama ----------------------------------------------------------------------

def test_convert_swaps_the_right_layers_and_keeps_the_state_dict():
    torch.manual_seed(0)
    model = Llama(ModelConfig(num_layers=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    assert convert_to_float8(model, "rowwise") is model
    names = float8_layers(model)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert sorted(names) == sorted(f"layers.{i}.{part}.{p}" for i in range(2) for part, p in
                                   [("attn", p) if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else ("mlp", p)
                                    for p in projections])
    assert type(model.lm_head) is LMHead and model.lm_head.weight is model.embed.weight   # still tied
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(a is b for a, b in zip(model.parameters(), params))       # shared: an old optimizer still works


def test_convert_refuses_a_model_with_nothing_to_convert():
    with pytest.raises(ValueError, match="no nn.Linear"):
        convert_to_float8(nn.Sequential(nn.Linear(10, 10), nn.ReLU()), "tensorwise")   # 10: not a multiple of 16


def test_convert_leaves_the_router_and_converts_experts():
    model = Llama(ModelConfig.preset("tiny-moe"))
    convert_to_float8(model, "tensorwise")
    mlp = model.layers[0].mlp
    assert type(mlp.router) is nn.Linear and all(isinstance(e.up_proj, Float8Linear) for e in mlp.experts)


def test_fp8_model_trains_like_fp32():
    """Ten AdamW steps of the tiny model: every recipe's loss within 0.02 of fp32's at every step."""
    config, train = ModelConfig(num_layers=2), TrainConfig(micro_batch_size=4, seq_len=32)
    loader = make_loader(train)

    def losses(recipe):
        torch.manual_seed(0)
        model = Llama(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)   # made before the swap: shared parameters
        if recipe:
            convert_to_float8(model, recipe)
        out = []
        for step in range(10):
            batch = loader.get_batch(step)
            loss = loss_fn(model(batch.input_ids), batch.targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return torch.tensor(out)

    reference = losses(None)
    assert reference[-1] < reference[0] - 1.0
    for recipe in RECIPES:
        assert (losses(recipe) - reference).abs().max() < 0.02, recipe


@pytest.mark.skipif(not torch.cuda.is_available() or not has_fp8_matmul(torch.device("cuda")),
                    reason="needs a GPU with fp8 tensor cores (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_path_equals_emulation_on_gpu(recipe):
    torch.manual_seed(0)
    linear = nn.Linear(256, 128, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer = Float8Linear.from_linear(linear, recipe)
    y = layer(x)
    y.float().pow(2).sum().backward()
    cpu = Float8Linear.from_linear(nn.Linear(256, 128, bias=False), recipe)
    with torch.no_grad():
        cpu.weight.copy_(linear.weight.float().cpu())
    x_cpu = x.detach().float().cpu().requires_grad_()
    y_cpu = cpu(x_cpu)
    assert rel_err(y.float().cpu(), y_cpu) < 0.01     # bf16 output rounding and summation order only


def test_fp8_by_config_in_the_model_and_the_trainer():
    """ModelConfig.fp8 converts the model's Linears when it is built (same state dict); the trainer then
    trains in fp8 (emulated here) close to fp32; picotron.config lists exactly picotron.fp8's recipes."""
    import dataclasses

    from picotron.config import FP8_RECIPES, Config, ModelConfig, ParallelConfig, TrainConfig
    from picotron.layout import validate
    from picotron.fp8 import RECIPES, Float8Linear
    from picotron.model import Llama
    from picotron.train import Trainer

    assert FP8_RECIPES == ("none", *RECIPES)
    config = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                         num_key_value_heads=2)
    torch.manual_seed(0)
    plain = Llama(config)
    torch.manual_seed(0)
    fp8 = Llama(dataclasses.replace(config, fp8="rowwise"))
    assert isinstance(fp8.layers[0].attn.q_proj, Float8Linear) and not isinstance(fp8.lm_head, Float8Linear)
    assert {n: p.shape for n, p in fp8.state_dict().items()} == {n: p.shape for n, p in plain.state_dict().items()}
    train = TrainConfig(precision="fp32", micro_batch_size=4, seq_len=32, steps=4, warmup_steps=2)
    losses = {}
    for recipe in ("none", "tensorwise"):
        trainer = Trainer(Config(model=dataclasses.replace(config, fp8=recipe), train=train))
        losses[recipe] = [trainer.train_step(step).loss for step in range(4)]
    assert losses["tensorwise"] == pytest.approx(losses["none"], abs=0.05)
    assert losses["tensorwise"] != losses["none"]                     # it really computed in fp8
    with pytest.raises(NotImplementedError, match="fp8='tensorwise' with tp=2 is not written"):
        validate(Config(model=dataclasses.replace(config, fp8="tensorwise"), parallel=ParallelConfig(tp=2)))
    with pytest.raises(ValueError, match="fp8='e4m3'; choose one of"):
        validate(Config(model=dataclasses.replace(config, fp8="e4m3")))

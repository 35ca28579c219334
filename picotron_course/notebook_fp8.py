"""The harness chapter 10 runs, times and draws: number formats, mixed precision and fp8.

Chapter 10 (chapters/10_mixed_precision.ipynb) keeps the technique in front of the reader: the
16-bit matmul, the loss scaler's loop, the scale s = amax / max, the fp8 Linear's three matmuls,
torch._scaled_mm. What feeds those cells, runs the experiments and draws the figures lives here:

    rel_err, agreement                         a whole tensor's relative error; a proof's worst case, in words
    values_in_unit                             how many values of a format lie in [1, 2)
    draw_formats                               every fp8 value, and each format's gaps (section 1)
    running_sums, promoted_sums, draw_sums     a long sum, rounded after every addend (1.1)
    output_grads, draw_grad_histogram          the gradients at the Linears' outputs, against fp16 (2.3)
    draw_recipe_bytes                          training state per recipe (2.4)
    draw_scale_sweep                           the error of a tensor for scales around amax / max (3.1)
    outlier_errors, draw_outliers              one outlier token or channel, per granularity (3.2)
    draw_delayed                               delayed against dynamic scaling, step by step (3.3)
    run_layer                                  a Linear's output and both gradients, for one call (3.5)
    train_tiny, show_runs, draw_runs           the tiny Llama trained with each recipe (4)
    draw_small_gradients                       the same with a 4M-token batch's gradients (4.1)
    draw_speedup                               the modelled fp8 speed-up of a Linear on an H100 (5)

Every function takes what it measures as arguments; none reads the chapter's globals.
"""

from __future__ import annotations

import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

from picotron.fp8 import E4M3, E5M2, FORMATS, all_values, round_mantissa, round_to
from picotron.model import Llama, loss_fn
from picotron_course.notebook import caption

__all__ = ["rel_err", "agreement", "values_in_unit", "draw_formats", "running_sums", "promoted_sums", "draw_sums",
           "output_grads", "draw_grad_histogram", "draw_recipe_bytes", "draw_scale_sweep", "outlier_errors",
           "draw_outliers", "draw_delayed", "run_layer", "train_tiny", "show_runs", "draw_runs", "draw_small_gradients",
           "draw_speedup"]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref||: the relative error of a whole tensor."""
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def agreement(ratio: float, bound: str = "the rounding bound", worst: str = "") -> str:
    """A proof's worst case in words: "bit for bit" when the error is 0, else the fraction of `bound` it reaches
    and, when given, where (`worst`)."""
    if ratio == 0:
        return "bit for bit"
    return f"within {ratio:.2g} of {bound}" + (f" (worst: {worst})" if worst else "")


# ---- 1. number formats ----------------------------------------------------------------------------------
def values_in_unit(name: str) -> int:
    """How many values of the format `name` lie in [1, 2), counted from its bit patterns."""
    fmt = FORMATS[name]
    if fmt.dtype in (E4M3, E5M2):
        values = all_values(fmt.dtype)
    elif name == "tf32":                                    # no dtype: round a fine grid of [1, 2) and count
        values = round_to(torch.linspace(1, 2, 2**16 + 1)[:-1], "tf32").unique()
    elif name == "fp32":                                    # 2^23, too many to list: the grid of its gaps
        return round((2 - 1) / torch.finfo(torch.float32).eps)
    else:                                                   # every 16-bit pattern
        values = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(fmt.dtype).float()
    return int(((values >= 1) & (values < 2)).sum())


def draw_formats() -> None:
    """Left: every positive e4m3 and e5m2 value. Right: the gap to the next value, relative, for every format."""
    fig, (ax_line, ax_gap) = plt.subplots(1, 2, figsize=(13, 4.2))
    for row, (name, dtype) in enumerate((("e4m3", E4M3), ("e5m2", E5M2))):
        f = FORMATS[name]
        values = all_values(dtype)
        values = values[values > 0]
        normal = values >= f.smallest_normal
        ax_line.vlines(np.log2(values[normal].numpy()), row - 0.3, row + 0.3, color="C0", lw=0.8)
        ax_line.vlines(np.log2(values[~normal].numpy()), row - 0.3, row + 0.3, color="C3", lw=0.8)
        ax_line.text(math.log2(f.max) + 0.4, row, f"max {f.max:g}", va="center", fontsize=8)
    ax_line.set(yticks=[0, 1], yticklabels=["e4m3", "e5m2"], xlabel="log2(value)", xlim=(-17.5, 19.5),
                ylim=(-0.6, 1.6), title="Every positive fp8 value (blue: normal, red: subnormal)")
    x = torch.logspace(-45, 40, 4000, base=2.0, dtype=torch.float64)
    for name, f in FORMATS.items():
        inside = (x >= f.smallest_subnormal) & (x <= f.max)
        gap = f.ulp(x[inside].float()).double() / x[inside]
        ax_gap.loglog(x[inside], gap, lw=1.4, label=f"{name} (m = {f.mantissa_bits})", base=2)
    ax_gap.set(xlabel="|x|", ylabel="gap to the next value / |x|", xlim=(2.0**-45, 2.0**40), ylim=(2.0**-25, 2.0),
               title="Range (width) and precision (height) of each format")
    ax_gap.legend(fontsize=7, ncol=2, loc="upper right")
    caption(fig, "Left: e4m3 packs 8 values per power of two into 2^-9 .. 448, e5m2 4 values into 2^-16 .. 57344; red "
            "ticks are subnormals, evenly spaced. Right: each line is flat at 2^-m in the normal range and rises "
            "where subnormals run out of bits; fp32, tf32 and bf16 share one range (8 exponent bits), fp16 and "
            "e5m2 another (5).")
    plt.show()


# ---- 1.1 a long sum -------------------------------------------------------------------------------------
def running_sums(addends: torch.Tensor, round_sum) -> torch.Tensor:
    """A <- round_sum(A + x) after every addend of each row of `addends` (runs, n); every partial sum, (runs, n)."""
    runs, n = addends.shape
    total, partial = torch.zeros(runs), torch.empty(runs, n)
    for i in range(n):
        total = round_sum(total + addends[:, i])
        partial[:, i] = total
    return partial


def promoted_sums(addends: torch.Tensor, chunk: int, mantissa_bits: int) -> torch.Tensor:
    """Each chunk of `chunk` addends summed in an accumulator of `mantissa_bits`, the chunk sums added in fp32
    (DeepSeek-V3's promotion of partial sums, section 3.3.2 of its report); every partial sum, (runs, n)."""
    runs, n = addends.shape
    partial, total = torch.empty(runs, n), torch.zeros(runs)
    for start in range(0, n, chunk):
        narrow = torch.zeros(runs)
        for i in range(start, min(start + chunk, n)):
            narrow = round_mantissa(narrow + addends[:, i], mantissa_bits)
            partial[:, i] = total + narrow
        total = total + narrow
    return partial


def draw_sums(sums: dict, exact: torch.Tensor) -> None:
    """Left: one run's running sum in each format. Right: the mean relative error of the 16 runs."""
    n = exact.shape[1]
    fig, (ax_sum, ax_err) = plt.subplots(1, 2, figsize=(13, 4.2))
    steps = np.arange(1, n + 1)
    for name, s in sums.items():
        style = "--" if "," in name or "14-bit" in name else "-"
        ax_sum.plot(steps, s[0], style, lw=1.3, label=name)
        error = ((s.double() - exact).abs() / exact).mean(0)
        ax_err.loglog(steps[31:], error[31:], style, lw=1.3, label=name)
    ax_sum.plot(steps, exact[0], "k:", lw=1, label="exact")
    for name in ("bf16", "fp16"):
        ax_sum.axhline(2 ** (FORMATS[name].mantissa_bits + 1), color="0.6", lw=0.6)
        ax_sum.text(60, 2 ** (FORMATS[name].mantissa_bits + 1) * 1.05, f"2^(m+1), {name}", fontsize=7)
    ax_sum.set(xlabel="addends summed", ylabel="running sum", title=f"Summing {n} values in [0, 1), one run")
    ax_sum.legend(fontsize=7, ncol=2)
    ax_err.set(xlabel="addends summed", ylabel="relative error (mean of 16 runs)", title="Error of the running sum")
    caption(fig, "Each format stalls exactly where its gap reaches 2 (bf16 at 256, fp16 and tf32 at 2048, fp8 at 8 and"
            " 16). fp32 accumulation of bf16 inputs keeps the error at the inputs' rounding; a 14-bit accumulator"
            " drifts, and promoting its partial sums to fp32 every 128 addends cuts its error about 50-fold.")
    plt.show()


# ---- 2.3 gradients against fp16's range -----------------------------------------------------------------
def output_grads(model: nn.Module, batch, lm_head: bool = True) -> list[torch.Tensor]:
    """The gradient at every nn.Linear's output for one batch (autograd's grad_output), each as a (tokens,
    features) matrix, in the order backward reaches them; `lm_head=False` leaves out the model's LM head."""
    grads, hooks = [], []
    for module in model.modules():
        if isinstance(module, nn.Linear) and (lm_head or module is not model.lm_head):
            hooks.append(module.register_full_backward_hook(
                lambda m, grad_in, grad_out: grads.append(grad_out[0].reshape(-1, grad_out[0].shape[-1]))))
    loss_fn(model(batch.input_ids), batch.targets).backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad()
    return [g.detach() for g in grads]


def draw_grad_histogram(cases: dict, grads: torch.Tensor) -> None:
    """Histograms of log2 |gradient| for the first two `cases`, against fp16's subnormal and flush bands."""
    fp16 = FORMATS["fp16"]
    fig, ax = plt.subplots(figsize=(11, 4))
    bins = np.linspace(-45, 0, 181)
    for (name, g), colour in zip(list(cases.items())[:2], ("C0", "C3")):
        ax.hist(np.log2(g.abs().numpy()), bins=bins, histtype="step", lw=1.5, color=colour, label=f"gradients, {name}")
    ax.axvspan(-45, math.log2(fp16.smallest_subnormal / 2), color="C3", alpha=0.12, label="fp16: flushed to zero")
    ax.axvspan(math.log2(fp16.smallest_subnormal / 2), math.log2(fp16.smallest_normal), color="C1", alpha=0.12,
               label="fp16: subnormal (fewer bits)")
    for name, colour in (("e5m2", "C4"), ("e4m3", "C2")):
        ax.axvline(math.log2(FORMATS[name].smallest_subnormal), color=colour, ls="--", lw=1,
                   label=f"{name}: smallest value")
    median = math.log2(grads.abs().median().item())
    ax.annotate("", xy=(median - 14, 0.6), xycoords=("data", "axes fraction"), xytext=(median, 0.6),
                arrowprops=dict(arrowstyle="->", color="0.3"))
    ax.text(median - 7, 0.63, "x 2^-14: a 2^14 times larger batch", ha="center", fontsize=8,
            transform=ax.get_xaxis_transform())
    ax.set(xlabel="log2 |gradient|", ylabel="elements",
           title="Gradients at the Linear outputs of the tiny model, one batch")
    ax.legend(fontsize=7, loc="upper left")
    caption(fig, "Even at 256 tokens most activation gradients sit in fp16's subnormal range; at the batch size of a "
            "real run most would be zero. A loss scale of 2^14 moves the whole histogram right by 14 without "
            "touching a mantissa bit. bf16's range reaches 2^-133: nothing there is lost.")
    plt.show()


# ---- 2.4 memory per parameter ---------------------------------------------------------------------------
def draw_recipe_bytes(recipes: dict, params: int) -> None:
    """Stacked bars: weights, gradients and optimizer state of a `params`-parameter model, per recipe."""
    fig, ax = plt.subplots(figsize=(10, 3.4))
    left = np.zeros(len(recipes))
    labels = {"param": "weights", "grad": "gradients", "optimizer": "master + Adam m, v"}
    for part, colour in (("param", "C0"), ("grad", "C1"), ("optimizer", "C2")):
        widths = np.array([getattr(b, part) * params / 1e9 for b in recipes.values()])
        ax.barh(list(recipes), widths, left=left, color=colour, label=labels[part])
        left += widths
    ax.axvline(81_559 * 2**20 / 1e9, color="k", ls="--", lw=1, label="one H100 (85.5 GB)")
    ax.invert_yaxis()
    ax.set(xlabel="GB of training state (weights + gradients + optimizer)", title="Llama-3-8B: state per recipe")
    ax.legend(fontsize=7, loc="lower right")
    caption(fig, "fp32 and every 16-bit or fp8 recipe keep 16 bytes per parameter (18 with fp32 gradients); only "
            "DeepSeek-V3's bf16 Adam moments save, 12 bytes. Memory is saved by sharding (chapter 03), not by "
            "precision.")
    plt.show()


# ---- 3.1 choosing the scale -----------------------------------------------------------------------------
def draw_scale_sweep(multipliers: np.ndarray, sweep: dict) -> None:
    """The relative error of a tensor quantized with each multiple of amax / max, per format."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for fname, errs in sweep.items():
        ax.loglog(multipliers, errs, "o-", ms=3, base=2, label=fname)
    ax.axvline(1, color="k", lw=0.8)
    ax.text(1.15, 0.5, "scale = amax / max", fontsize=8, transform=ax.get_xaxis_transform())
    ax.text(2**-5.5, 0.55, "saturates", fontsize=8, transform=ax.get_xaxis_transform())
    ax.text(2**9, 0.55, "small values\nunderflow", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set(xlabel="scale / (amax / max)", ylabel="relative error of the weights",
           title="Choosing the scale (down_proj weights)")
    ax.legend(fontsize=8)
    caption(fig, "The error is flat for a range of scales above amax/max and rises steeply below it: a value clipped "
            "at 448 loses much more than a small value loses to subnormals. amax/max is the smallest scale that "
            "clips nothing; e5m2's wider range makes its floor wider and higher (one bit less mantissa).")
    plt.show()


# ---- 3.2 granularity and outliers -----------------------------------------------------------------------
def outlier_errors(acts: torch.Tensor, factors: np.ndarray, tiles: dict, quantize, dequantize,
                   where: int = 7) -> dict:
    """{(kind, recipe): relative error of every other element, per factor}: token `where` (a row) or channel
    `where` (a column) of `acts` multiplied by each factor, then quantized to e4m3 with the recipe's tile."""
    others = {"token": torch.ones_like(acts, dtype=torch.bool), "channel": torch.ones_like(acts, dtype=torch.bool)}
    others["token"][where] = False
    others["channel"][:, where] = False
    errors = {}
    for kind in ("token", "channel"):
        for recipe, tile in tiles.items():
            curve = []
            for factor in factors:
                x = acts.clone()
                if kind == "token":
                    x[where] *= factor
                else:
                    x[:, where] *= factor
                back = dequantize(*quantize(x, E4M3, tile), tile)
                curve.append(rel_err(back[others[kind]], x[others[kind]]))
            errors[kind, recipe] = np.array(curve)
    return errors


def draw_outliers(factors: np.ndarray, errors: dict) -> None:
    """Left: one outlier token; right: one outlier channel; the error of the rest, per granularity."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    for ax, kind in zip(axes, ("token", "channel")):
        for recipe, colour in zip(("tensorwise", "rowwise", "blockwise"), ("C3", "C0", "C2")):
            ax.loglog(factors, errors[kind, recipe], "o-", ms=3, base=2, color=colour, label=recipe)
        ax.axvline(1e4, color="0.5", ls=":", lw=1)
        ax.text(1.1e4, 0.5, "10^4: massive\nactivations", fontsize=7, transform=ax.get_xaxis_transform())
        ax.set(xlabel=f"outlier factor lambda (one {kind} x lambda)", title=f"One outlier {kind}, e4m3")
    axes[0].set_ylabel("relative error of all other elements")
    axes[0].legend(fontsize=8)
    caption(fig, "An outlier token costs tensorwise scaling precision everywhere once lambda passes ~2^12 (2.6% error "
            "at 1, 5% at 10^4, 97% at 2^19: everything else underflows) and leaves rowwise and blockwise (one "
            "scale per token, or per 128 channels of a token) exactly as they were. An outlier channel sits in "
            "every row: rowwise suffers too; blockwise hurts only the tile holding it, a quarter of each token "
            "here, and halves the error.")
    plt.show()


# ---- 3.3 delayed scaling --------------------------------------------------------------------------------
def draw_delayed(trace: dict) -> None:
    """Left: each step's amax and the largest value the delayed scale holds. Right: both scalings' errors."""
    fig, (ax_amax, ax_err) = plt.subplots(1, 2, figsize=(13, 3.8))
    ax_amax.semilogy(trace["amax"], "k.-", label="amax of this step")
    ax_amax.semilogy(trace["delayed max"], "C1-", label="largest value the delayed scale represents")
    ax_amax.set(xlabel="step", ylabel="|x|", title="Delayed scaling lags the tensor")
    ax_amax.legend(fontsize=8)
    ax_err.semilogy(trace["dynamic error"], "C0.-", label="dynamic")
    ax_err.semilogy(trace["delayed error"], "C1.-", label="delayed (history 16)")
    ax_err.set(xlabel="step", ylabel="relative error after e4m3", title="Quantization error per step")
    ax_err.legend(fontsize=8)
    caption(fig, "While the tensor drifts slowly the delayed scale is as good as the dynamic one. At the spike it "
            f"clips everything above the old amax: {trace['delayed error'][25]:.0%} error. For the 16 steps after, "
            f"the spike's amax stays in the history and the scale is "
            f"{trace['delayed max'][30] / trace['amax'][30]:.0f}x coarser than needed (step 30), which e4m3's range "
            f"absorbs here ({trace['delayed error'][30]:.1%} error); a 1000x spike would not be.")
    plt.show()


# ---- 3.5 one Linear -------------------------------------------------------------------------------------
def run_layer(forward, linear: nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> tuple:
    """(output, input gradient, weight gradient) of forward(x) with output gradient `grad`; `linear` is the
    layer whose weight the call uses: its gradient is read, then cleared for the next call."""
    x_in = x.clone().requires_grad_()
    y = forward(x_in)
    y.backward(grad)
    out = (y.detach(), x_in.grad, linear.weight.grad.clone())
    linear.weight.grad = None
    return out


# ---- 4. training ----------------------------------------------------------------------------------------
def train_tiny(config, loader, convert=None, scaler=None, shrink: float = 1.0, steps: int = 30) -> dict:
    """The losses, seconds per step (the median step after the first) and loss scales of a picotron Llama of
    `config`, trained `steps` AdamW steps on `loader` from seed 0; `convert(model)` changes its layers in place
    first.

    shrink < 1 divides every activation gradient by 1/shrink, as a batch 1/shrink times larger would; the
    weight gradients are multiplied back after backward (powers of 2: exact), so fp32 training is unchanged.
    """
    torch.manual_seed(0)
    model = Llama(config)
    if convert:
        convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    losses, scales, times = [], [], []
    for step in range(steps):
        start = time.perf_counter()
        batch = loader.get_batch(step)
        loss = loss_fn(model(batch.input_ids), batch.targets)
        (scaler.scale(loss * shrink) if scaler else loss * shrink).backward()
        for p in model.parameters():
            p.grad.mul_(1 / shrink)
        if scaler:
            scales.append(scaler.scale_value)
            scaler.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    # The median step after the first: the first pays one-time costs (allocations, torch's lazy imports).
    return {"loss": np.array(losses), "step_s": float(np.median(times[1:] or times)), "scales": scales}


def show_runs(runs: dict, reference: np.ndarray) -> None:
    """Every run's first and last loss, and its largest distance from `reference`."""
    print(f"{'run':<26}{'first':>7}{'last':>7}{'max |loss - fp32|':>19}")
    for name, run in runs.items():
        print(f"{name:<26}{run['loss'][0]:>7.3f}{run['loss'][-1]:>7.3f}{np.abs(run['loss'] - reference).max():>19.4f}")


def draw_runs(runs: dict, reference: np.ndarray) -> None:
    """Left: every run's loss. Right: each run's distance from the fp32 run."""
    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(13, 4))
    for i, (name, run) in enumerate(runs.items()):
        ax_loss.plot(run["loss"], lw=1.3, color=f"C{i}", label=name)
        if name != "fp32":
            ax_diff.semilogy(np.abs(run["loss"] - reference) + 1e-6, lw=1.2, color=f"C{i}", label=name)
    ax_loss.set(xlabel="step", ylabel="training loss", title=f"Tiny Llama, {len(reference)} steps: every recipe")
    ax_loss.legend(fontsize=7)
    ax_diff.set(xlabel="step", ylabel="|loss - fp32 loss|", title="Distance from the fp32 run", ylim=(1e-6, 1))
    caption(fig, "The curves lie on top of each other: 16-bit and fp8 matmuls with fp32 master weights train like fp32"
            " here. Right: the gaps follow the mantissa bits: fp16 (10 bits) stays near 1e-4, bf16 (7) reaches "
            "1e-3, fp8 (3 and 2) about 1e-2 in the first steps, and all shrink as the loss flattens.")
    plt.show()


def draw_small_gradients(small: dict, tensorwise: dict) -> None:
    """Left: the runs with a 4M-token batch's gradients, and fp8 tensorwise. Right: the fp16 run's loss scale."""
    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    for (name, run), style in zip(small.items(), ("k-", "C3-", "C1--", "C4-")):
        ax_loss.plot(run["loss"], style, lw=1.4, label=name)
    ax_loss.plot(tensorwise["loss"], "C2:", lw=1.6, label="fp8 tensorwise (same with or without shrink)")
    ax_loss.set(xlabel="step", ylabel="training loss", title="Per-token gradients as in a 4M-token batch (x 2^-14)")
    ax_loss.legend(fontsize=7)
    ax_scale.semilogy(small["fp16 mixed + loss scaler"]["scales"], "C1.-", base=2)
    ax_scale.set(xlabel="step", ylabel="loss scale S", title="The dynamic loss scale (fp16)")
    caption(fig, "Without loss scaling, fp16 loses most activation gradients to underflow: it learns slowly, then "
            "diverges. fp8 without scales loses them too and lags for the first steps (the LM head and embedding,"
            " in high precision, still learn). The loss scaler and fp8's per-tensor scales both move the "
            "gradients back into range: S = 2^16 (then 2^17, 2^18 after 10 and 20 clean steps) lifts them 16 "
            "binades, enough here.")
    plt.show()


# ---- 5. where it breaks ---------------------------------------------------------------------------------
def draw_speedup(fp8_speedup, widths: np.ndarray) -> None:
    """fp8_speedup(h, cast_bytes=...) for each width h, with separate and with fused cast kernels."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    kernels = ((5, "separate cast kernels (amax pass + scale pass)"), (3, "casts fused into neighbours"))
    for cast_bytes, label in kernels:
        ax.semilogx(widths, [fp8_speedup(int(h), cast_bytes=cast_bytes) for h in widths], "o-", base=2, label=label)
    ax.axhline(2, color="k", lw=0.8)
    ax.axhline(1.4, color="C3", ls="--", lw=0.8, label="1.4x: the goal at h = 8192")
    ax.set(xlabel="h (in = out features), 8192 tokens", ylabel="bf16 time / fp8 time",
           title="Modelled fp8 speed-up of a Linear, forward + backward, H100 (not measured)", ylim=(0, 2.1))
    ax.legend(fontsize=7)
    caption(fig, "A model at spec-sheet peaks (989 / 1979 TFLOP/s, 3.35 TB/s): small layers are bound by the casts' "
            "memory traffic and fp8 can be slower than bf16; at h = 4096-8192 fused casts reach 1.5-1.6x. Real "
            "GEMMs run below peak and fp8 ones less efficiently: benchmarks/fp8_linear.py measures it.")
    plt.show()

"""The harness chapter 09 runs, times and draws: the rounding counts of its proofs, the timer, the measured
roofline of this machine, the kernel cut out of torch.compile's generated code, the bytes autograd keeps for
backward, two models trained side by side, and the chapter's figures (memory levels, rooflines, waves,
coalescing, softmax times, causal tiles, attention traffic, achieved bandwidth).

None of it is the technique: the kernels are in picotron/kernels/, and their key code is printed in the
chapter. A chapter cell calls one of these, then `plt.show()`:

    from picotron_course.notebook_kernels import seconds, measure_machine, roofline_figure, ...
"""

from __future__ import annotations

import numpy as np
import torch

from picotron_course.notebook import caption

__all__ = ["seconds", "measure_machine", "generated_kernel", "saved_bytes", "train_side_by_side", "rmsnorm_roundings",
           "lm_head_loss_roundings",
           "memory_levels_figure", "roofline_figure", "measured_roofline_figure", "waves_figure",
           "coalescing_figure", "softmax_time_figure", "causal_tiles_figure", "attention_traffic_figure",
           "gpu_bandwidth_figure", "without_triton"]


def without_triton(what: str, where: str) -> None:
    """What a cell that runs a Triton kernel prints where triton is not installed (macOS, Windows outside WSL)."""
    print(f"Skipped here: {what} needs triton, which is built for Linux only. Read the code in {where}; on Linux, "
          "in WSL or on Colab this cell runs it.")


# ---- rounding counts (picotron.tolerance's n) ----------------------------------------------------------
def rmsnorm_roundings(width: int, rows: int, of: str = "output") -> int:
    """n of picotron.tolerance for one value of an RMSNorm over rows of `width` values, `rows` rows in all:
    the output is behind the mean of `width` squares ("output"); dx adds backward's sum over the row again
    ("dx": 2 width); dw adds the sum over the rows ("dw": width + rows)."""
    counts = {"output": width, "dx": 2 * width, "dw": width + rows}
    if of not in counts:
        raise ValueError(f"of={of!r}: choose one of {sorted(counts)}")
    return counts[of]


def lm_head_loss_roundings(hidden: int, vocab: int, tokens: int) -> int:
    """n of picotron.tolerance for the loss, dx and dW of cross_entropy(x W^T): a logit is a sum over `hidden`
    (forward, and again in backward), the log-sum-exp a sum over the `vocab`, dW a sum over the `tokens`."""
    return 2 * hidden + vocab + tokens


# ---- timing and measuring ----------------------------------------------------------------------
def seconds(fn, reps: int = 5, device=None) -> float:
    """Median time of fn() in seconds: CUDA events on a GPU (L2 flushed first; do_bench picks the
    repetitions), perf_counter over `reps` calls on a CPU. device: where fn runs (default: where the
    kernels run, picotron.kernels.runtime.kernel_device())."""
    from picotron.kernels.runtime import kernel_device
    from picotron.kernels.timing import bench
    device = kernel_device() if device is None else device
    on_cpu = torch.device(device).type == "cpu"
    return bench(fn, device=device, rep=reps if on_cpu else None) / 1e3


def measure_machine(device: str, on_gpu: bool) -> tuple[float, float, dict]:
    """(copy bandwidth in bytes/s, best fp32 matmul FLOP/s, {size: (FLOPs, bytes, seconds)} of the square
    matmuls) on `device`. The copy is of a tensor far past the caches: 1 GiB on a GPU, 32 MiB on a CPU."""
    n = (1 << 28) if on_gpu else (1 << 23)
    x = torch.randn(n, device=device)
    out = torch.empty_like(x)
    bandwidth = 2 * x.nbytes / seconds(lambda: out.copy_(x), device=device)   # bytes read + written per second
    mm = {}
    for size in [32, 64, 128, 256, 512] + ([1024, 4096] if on_gpu else []):
        a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
        mm[size] = (2 * size**3, 3 * 4 * size**2, seconds(lambda: a @ b, device=device))
    return bandwidth, max(f / t for f, _, t in mm.values()), mm


def generated_kernel(source: str, on_gpu: bool) -> str:
    """The kernel inside the Python module torch.compile wrote: the Triton function on a GPU, the C++ of
    `cpp_fused_...` on a CPU (each sits in a triple-quoted string)."""
    quotes = "'" * 3
    anchor = source.index("@triton.jit" if on_gpu else "cpp_fused")
    opening = source.rindex(quotes, 0, anchor) if on_gpu else source.index(quotes, anchor)
    return source[opening + 3:source.index(quotes, opening + 3)]


def saved_bytes(module, x: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of module(x) (saved-tensor hooks see each)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(storages.values())


def train_side_by_side(models: dict, batches: list, lr: float) -> tuple[dict, dict]:
    """Train each of {name: Llama} for one AdamW step per batch of token ids. Returns {name: [loss per step]}
    and {name: {parameter: gradient of the first step}} (taken while all the models still hold the same
    weights, if they started equal: only rounding differs)."""
    from picotron.model import loss_fn
    losses, first_grads = {}, {}
    for name, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses[name] = []
        for step, ids in enumerate(batches):
            loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
            loss.backward()
            if step == 0:
                first_grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    return losses, first_grads


# ---- figures ------------------------------------------------------------------------------------
def memory_levels_figure(spec) -> None:
    """The capacity of each memory level of a GPU (`spec`: picotron.kernels.gpu's H100_SXM), summed over the chip."""
    import matplotlib.pyplot as plt
    levels = {f"registers\n({spec.sms} SMs x 256 KB)": spec.sms * spec.registers_per_sm * 4,
              f"L1 / shared memory\n({spec.sms} SMs x 256 KB)": spec.sms * 256 * 1024,
              "L2 cache": spec.l2_bytes, "HBM3": spec.hbm_bytes}
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.barh(list(levels), list(levels.values()), color=["C2", "C2", "C1", "C0"])
    for i, value in enumerate(levels.values()):
        ax.text(value * 1.3, i, f"{value / 1e6:,.1f} MB" if value < 1e9 else f"{value / 1e9:.0f} GB", va="center",
                fontsize=8)
    ax.set(xscale="log", xlim=(1e6, 1e12), xlabel="bytes (log scale)", title="H100 SXM: where the bytes can live")
    ax.invert_yaxis()
    caption(fig, "On-chip memory (green: registers, L1/shared, private to each SM) totals ~69 MB, L2 50 MB, HBM 80 "
            "GB: over 1,000 times more room, and the only place a tensor of a real model fits. Every kernel starts and "
            "ends there.")


def roofline_figure(kernels: dict, spec) -> None:
    """The spec sheet's roofline (bf16 tensor cores, and fp32 without them), with each of {name: (FLOPs, bytes)}
    placed at its intensity."""
    import matplotlib.pyplot as plt

    from picotron.kernels.gpu import roofline
    intensity = np.logspace(-2, 4, 200)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.loglog(intensity, [roofline(i, spec.bf16_flops, spec.hbm_bandwidth) / 1e12 for i in intensity], "k-",
              label="H100 roofline, bf16 tensor cores")
    ax.loglog(intensity, [roofline(i, spec.fp32_flops, spec.hbm_bandwidth) / 1e12 for i in intensity], "k:",
              label="fp32 without tensor cores (67 TFLOP/s)")
    for (name, (f, b)), colour in zip(kernels.items(), [f"C{i}" for i in range(8)]):
        i = f / b
        ax.plot(i, roofline(i, spec.bf16_flops, spec.hbm_bandwidth) / 1e12, "o", color=colour,
                label=f"{name}: I = {i:,.2f}")
    ax.axvline(spec.ridge_point, color="0.6", lw=0.8)
    ax.text(spec.ridge_point * 1.1, 2, f"ridge point\n{spec.ridge_point:.0f} FLOP/B", fontsize=8)
    ax.set(xlabel="arithmetic intensity (FLOP per byte of HBM traffic)", ylabel="best possible TFLOP/s",
           title="H100 SXM roofline (computed from the spec sheet)", ylim=(0.01, 2000))
    ax.legend(fontsize=7, loc="upper left")
    caption(fig, "Everything left of the ridge is limited by the 3.35 TB/s of HBM: fusing softmax or RMSNorm does "
            "not change its FLOPs, it moves the point right (fewer bytes) and up. Matmuls and FlashAttention sit on the "
            "flat part: their limit is the tensor cores.")


def measured_roofline_figure(ops: dict, peak: float, bandwidth: float, on_gpu: bool) -> None:
    """This machine's roofline from its measured peak and copy bandwidth, with each of {name: (FLOPs, bytes,
    seconds)} at its achieved FLOP/s (names "matmul M^3" drawn as squares)."""
    import matplotlib.pyplot as plt

    from picotron.kernels.gpu import roofline
    fig, ax = plt.subplots(figsize=(9, 4.5))
    grid = np.logspace(-2, 3, 200)
    ax.loglog(grid, [roofline(i, peak, bandwidth) / 1e9 for i in grid], "k-", label="measured roofline")
    first_mm = next(name for name in ops if name.startswith("matmul"))
    for k, (name, (f, b, t)) in enumerate(ops.items()):
        is_mm = name.startswith("matmul")
        label = "M = " + name.split()[1].removesuffix("^3") if is_mm else name
        ax.plot(f / b, f / t / 1e9, "s" if is_mm else "o", color="C0" if is_mm else "C3", ms=6,
                label="matmul M x M x M" if name == first_mm else None)
        ax.annotate(label, (f / b, f / t / 1e9), textcoords="offset points", xytext=(4, -12 if k % 2 else 5),
                    fontsize=7)
    ax.legend(fontsize=8, loc="upper left")
    ax.set(xlabel="arithmetic intensity (FLOP/B)", ylabel="achieved GFLOP/s",
           title=f"Measured roofline, fp32, {'one GPU' if on_gpu else 'one CPU core (shared machine)'}")
    fusion_gain = ops["softmax as 5 torch ops"][2] / ops["torch.softmax (1 kernel)"][2]
    caption(fig, f"Line: min(matmul peak {peak / 1e9:.0f} GFLOP/s, I x copy bandwidth {bandwidth / 1e9:.1f} GB/s). The "
            "pointwise ops and softmax sit on the sloped part: memory-bound, their speed is bytes per second. Small "
            "matmuls are memory-bound too; the large ones reach the flat part. Softmax as five ops moves 4x the bytes "
            f"of torch's one-kernel softmax and takes {fusion_gain:.1f}x its time here.")


def waves_figure(sms: int, per_sm: int = 4) -> None:
    """The useful fraction of the SM-time a grid of equal programs takes, against the grid's size."""
    import matplotlib.pyplot as plt
    slots = sms * per_sm
    counts = np.arange(1, 4 * slots + 1)
    busy = counts / (np.ceil(counts / slots) * slots)    # useful fraction of the SM-time the waves take
    fig, ax = plt.subplots(figsize=(9, 3))
    ax.plot(counts, busy, lw=1)
    ax.plot([slots, 2 * slots, 3 * slots, 4 * slots], [1, 1, 1, 1], "o", color="C2",
            label="whole waves (a grid-stride launch picks G here)")
    ax.set(xlabel="programs in the grid (equal work each)", ylabel="SM time doing work",
           title=f"Waves on {sms} SMs x {per_sm} programs per SM (computed)", ylim=(0, 1.05))
    ax.legend(fontsize=8, loc="lower right")
    caption(fig, f"{slots + 1} programs take two waves and leave the second one almost empty: half the machine waits. "
            "With many programs the tail matters less; a grid-stride launch sizes the grid to the machine and removes "
            "it.")


def coalescing_figure(sectors: dict) -> None:
    """Left: the sectors one warp's fp32 loads touch, for a row and for a column. Right: the useful fraction of
    the fetched bytes, from {stride in elements: sectors per warp}."""
    import matplotlib.pyplot as plt
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(12, 3.8))
    threads = np.arange(32)
    for stride, label, marker in [(1, "row: thread i reads x[r, i]", "o"),
                                  (64, "column: thread i reads x[i, c] (64 floats a row)", "s")]:
        sector_of = threads * stride * 4 // 32           # which 32-byte sector each thread's 4 bytes are in
        ax_a.plot(threads, sector_of, marker, ms=4, label=f"{label}: {len(np.unique(sector_of))} distinct sectors")
    ax_a.set(yscale="symlog", xlabel="thread of the warp", ylabel="32-byte sector read (symlog)",
             title="One warp's 32 fp32 loads: which sectors they touch")
    ax_a.legend(fontsize=7, loc="upper left")
    strides = list(sectors)
    ax_b.semilogx(strides, [128 / (sectors[s] * 32) for s in strides], "o-", base=2)
    ax_b.set(xlabel="distance between consecutive threads' values (elements)", ylabel="useful bytes / fetched bytes",
             title="Coalescing efficiency of a warp's fp32 load (computed)", ylim=(0, 1.05))
    caption(fig, "Left: consecutive threads on consecutive addresses share 4 sectors; a column read needs one sector "
            "per thread. Right: efficiency falls as 1/stride until every thread has its own sector (12.5% for fp32).")


def softmax_time_figure(predicted_ms: dict) -> None:
    """Bars of {version: ms} for the softmax of one layer's scores at the H100's HBM bandwidth."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 2.6))
    ax.barh(list(predicted_ms), list(predicted_ms.values()), color=["C3", "C1", "C2"])
    for i, value in enumerate(predicted_ms.values()):
        ax.text(value, i, f" {value:.2f} ms", va="center", fontsize=8)
    ax.set(xlabel="ms at 3.35 TB/s (lower bound)", xlim=(0, max(predicted_ms.values()) * 1.25),
           title="Softmax of 32 x 4096 x 4096 bf16 scores on an H100 (computed)")
    caption(fig, "Time is bytes / bandwidth for a memory-bound kernel: the fused kernel is 4x faster than five eager "
            "kernels before any tuning. FlashAttention (section 8) goes further: it never writes these scores at all.")


def causal_tiles_figure(seq: int, block: int) -> tuple[int, int]:
    """The tiles causal FlashAttention computes (full, masked on the diagonal, skipped) for s = seq and square
    blocks of `block`. Returns (tiles computed, tiles per side)."""
    import matplotlib.pyplot as plt
    blocks_n = seq // block
    tile = np.zeros((blocks_n, blocks_n))
    for i in range(blocks_n):
        tile[i, :i] = 2                  # below the diagonal: computed, no mask
        tile[i, i] = 1                   # on the diagonal: computed with the mask
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    ax.imshow(tile, cmap=plt.matplotlib.colors.ListedColormap(["0.93", "C1", "C0"]), vmin=0, vmax=2)
    ax.set(xlabel=f"key block (B_N = {block} keys)", ylabel=f"query block = one program (B_M = {block} rows)",
           title=f"Causal FlashAttention, s = {seq}: work per tile")
    ax.set_xticks(range(blocks_n))
    ax.set_yticks(range(blocks_n))
    done = int((tile > 0).sum())
    caption(fig, f"Blue: full tiles, no mask; orange: diagonal tiles, masked; grey: skipped. {done} of {blocks_n**2} "
            f"tiles ({done / blocks_n**2:.0%}) are computed; as the blocks shrink relative to s this tends to half.")
    return done, blocks_n


def attention_traffic_figure(seqs, eager_mib, flash_mib, lower_bound_mib, block_m: int) -> None:
    """MiB per head of an attention forward against the sequence length: eager, FlashAttention, the lower bound."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.loglog(seqs, eager_mib, "o-", color="C3", label="eager: S and P through HBM")
    ax.loglog(seqs, flash_mib, "s-", color="C0",
              label=f"FlashAttention: K, V re-read per query block (B_M = {block_m})")
    ax.loglog(seqs, lower_bound_mib, "--", color="0.5", label="Q, K, V, O once each (lower bound)")
    ax.set(xlabel="sequence length s", ylabel="MiB per head, forward (bf16)",
           title="Attention forward: HBM traffic per head (computed)")
    ax.legend(fontsize=8)
    caption(fig, "Eager attention moves 4 s^2 values per head through HBM. FlashAttention's K, V re-reads grow as "
            "2 s^2 d / B_M, but they are reads of data every query block of the head wants at once, served mostly by "
            "L2; the dashed line, linear in s, is what must come from HBM.")


def gpu_bandwidth_figure(softmax_gbs: float, rmsnorm_gbs: float, copy_gbs: float) -> None:
    """Achieved GB/s of the softmax and RMSNorm kernels beside a copy on the same GPU."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 2.8))
    ax.barh(["softmax", "RMSNorm"], [softmax_gbs, rmsnorm_gbs], color="C0")
    ax.axvline(copy_gbs, color="k", label="measured copy")
    ax.axvline(0.85 * copy_gbs, color="k", ls="--", label="85% of copy")
    ax.set(xlabel="GB/s", title=f"Achieved bandwidth on {torch.cuda.get_device_name()}")
    ax.legend(fontsize=8)
    caption(fig, "Bytes each kernel must move divided by its time, beside what a copy achieves on this GPU.")

"""Bandwidth and FLOP/s of picotron's Triton kernels against the GPU's measured peak and torch's kernels.

    python benchmarks/kernels.py                    # on a GPU: a few minutes; prints the tables for docs/benchmarks.md
    python benchmarks/kernels.py --json out.json    # also write every figure
    python benchmarks/kernels.py --quick            # fewer shapes

What it measures (chapter 09; the kernels are in picotron/kernels/):

    copy peak      the bandwidth of a device-to-device copy (torch's copy_ of 1 GiB, read + write): the
                   practical ceiling of a memory-bound kernel on this GPU, next to the spec sheet's
    softmax        row_softmax.softmax (one read, one write per element) against torch.softmax:
                   GB/s = 2 x bytes of x / time, and its fraction of the copy peak (goal: >= 85%)
    RMSNorm        TritonRMSNorm forward (rmsnorm_forward_v2: reads x and w, writes y and one fp32 per row)
                   and rmsnorm_backward_v1 (reads dy, x, w, rstd, writes dx), against
                   picotron.model.RMSNorm in eager mode and torch.nn.functional.rms_norm; same goal
    FlashAttention every version of flash_attention (attention.VERSIONS), forward and backward, bf16, causal
                   and not: TFLOP/s counted as FlashAttention's benchmarks do (4 b h s^2 d, halved when causal;
                   backward 2.5x), against F.scaled_dot_product_attention (goals: the best version's forward
                   >= 0.9x SDPA, backward >= 0.7x); the tiles the autotuners chose (version 4's backward is
                   version 3's: timed again)

Every time is triton.testing.do_bench's median (CUDA events, L2 flushed before each call).

Without a GPU there is nothing to measure: the kernels run in the Triton interpreter, which
executes each program in Python. The script then runs a tiny smoke test instead (each kernel once,
checked against torch, with interpreter times that say nothing about a GPU) and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import torch.nn.functional as F

from picotron import tolerance
from picotron.kernels import attention, attention_tma, gpu, rmsnorm, row_softmax, timing
from picotron.kernels.runtime import INTERPRETED
from picotron.model import RMSNorm

GOAL_BANDWIDTH = 0.85      # of the measured copy peak
GOAL_ATTENTION = {"fwd": 0.9, "bwd": 0.7}     # of SDPA's TFLOP/s, forward and backward


# ---- measurements -------------------------------------------------------------------------------
def ms(fn) -> float:
    return timing.bench(fn)


def copy_peak() -> dict:
    """GB/s of a 1 GiB device-to-device copy (read 1 GiB + write 1 GiB)."""
    src = torch.empty(2**28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return {"bytes": 2 * src.nbytes, "ms": t, "GB/s": 2 * src.nbytes / t / 1e6}


def bench_softmax(shapes, dtypes, peak: float) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for n_rows, n_cols in shapes:
            x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype)
            torch.testing.assert_close(row_softmax.softmax(x), torch.softmax(x.float(), -1).to(dtype))
            moved = gpu.softmax_bytes(n_rows, n_cols, x.element_size(), "fused")
            ours, theirs = ms(lambda: row_softmax.softmax(x)), ms(lambda: torch.softmax(x, -1))
            fits = triton_block(n_cols) <= row_softmax.MAX_FUSED_BLOCK
            rows.append({"shape": (n_rows, n_cols), "dtype": str(dtype).removeprefix("torch."),
                         "version": "v2 fused" if fits else "v3 online (reads x twice)",
                         "ms": ours, "GB/s": moved / ours / 1e6, "of copy peak": moved / ours / 1e6 / peak,
                         "torch ms": theirs, "torch GB/s": moved / theirs / 1e6})
    return rows


def bench_rmsnorm(shapes, dtypes, peak: float) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for n_rows, n_cols in shapes:
            x = torch.randn(n_rows, n_cols, device="cuda", dtype=dtype, requires_grad=True)
            norm = RMSNorm(n_cols, 1e-5).to(device="cuda", dtype=dtype)
            triton_norm = rmsnorm.TritonRMSNorm(n_cols, 1e-5).to(device="cuda", dtype=dtype)
            w = triton_norm.weight
            forward = gpu.rmsnorm_bytes(n_rows, n_cols, x.element_size())
            backward = gpu.rmsnorm_bytes(n_rows, n_cols, x.element_size(), backward=True)
            with torch.no_grad():
                t_fwd = ms(lambda: triton_norm(x))
                t_eager = ms(lambda: norm(x))
                t_fn = ms(lambda: F.rms_norm(x, (n_cols,), w, 1e-5))
            y = triton_norm(x)
            dy = torch.randn_like(y)
            _, rstd = rmsnorm.rmsnorm_forward_v2(x.detach(), w.detach(), 1e-5)
            t_bwd = ms(lambda: rmsnorm.rmsnorm_backward_v1(dy, x.detach(), w.detach(), rstd))
            t_bwd2 = ms(lambda: rmsnorm.rmsnorm_backward_v2(dy, x.detach(), w.detach(), rstd))
            y_eager = norm(x)
            t_bwd_eager = ms(lambda: torch.autograd.grad(y_eager, (x, norm.weight), dy, retain_graph=True))
            rows.append({"shape": (n_rows, n_cols), "dtype": str(dtype).removeprefix("torch."),
                         "fwd ms": t_fwd, "fwd GB/s": forward / t_fwd / 1e6,
                         "fwd of copy peak": forward / t_fwd / 1e6 / peak,
                         "eager fwd ms": t_eager, "F.rms_norm fwd ms": t_fn,
                         "bwd ms": t_bwd, "bwd GB/s": backward / t_bwd / 1e6,
                         "bwd of copy peak": backward / t_bwd / 1e6 / peak,
                         "bwd v2 of copy peak": backward / t_bwd2 / 1e6 / peak,
                         "eager bwd ms": t_bwd_eager})
    return rows


def bench_attention(cases, backward: bool) -> list[dict]:
    """Every version of attention.VERSIONS against SDPA, forward and (with backward) backward: TFLOP/s and the
    ratio to SDPA's time, each version checked against SDPA first (bf16 round-off)."""
    rows = []
    for batch, heads, seq, head_dim, causal in cases:
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        do = torch.randn_like(ref)
        flops = gpu.attention_flops(batch, heads, seq, seq, head_dim, causal)
        flops_bwd = gpu.attention_flops(batch, heads, seq, seq, head_dim, causal, backward=True)
        with torch.no_grad():
            t_sdpa = ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        row = {"shape (b, h, s, d)": (batch, heads, seq, head_dim), "causal": causal,
               "SDPA fwd ms": t_sdpa, "SDPA fwd TFLOP/s": flops / t_sdpa / 1e9}
        if backward:
            t_bwd_sdpa = ms(lambda: torch.autograd.grad(ref, (q, k, v), do, retain_graph=True))
            row.update({"SDPA bwd ms": t_bwd_sdpa, "SDPA bwd TFLOP/s": flops_bwd / t_bwd_sdpa / 1e9})
            ref_grads = torch.autograd.grad(ref, (q, k, v), do, retain_graph=True)
        for version, (forward_fn, _) in attention.VERSIONS.items():
            row[f"v{version} check"] = "ok"
            try:
                out = attention.flash_attention(q, k, v, causal=causal, version=version)   # v3, v4: autotunes
                grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True) if backward else ()
            except Exception as error:       # a version that does not run is reported, and the others measured
                row[f"v{version} check"] = f"did not run: {type(error).__name__}: {str(error)[:300]}"
                continue
            try:                             # bf16: P (and dS) rounded before their products, the result once
                tolerance.assert_close(out, ref, n=4, msg="O")
                for name, mine, theirs in zip("qkv", grads, ref_grads if backward else ()):
                    tolerance.assert_close(mine, theirs, n=4, msg=f"d{name}")
            except AssertionError as error:  # timed all the same, and left out of the goals
                row[f"v{version} check"] = f"WRONG: {str(error)[:300]}"
            with torch.no_grad():
                t = ms(lambda: forward_fn(q, k, v, causal))
            row.update({f"v{version} fwd ms": t, f"v{version} fwd TFLOP/s": flops / t / 1e9,
                        f"v{version} fwd vs SDPA": t_sdpa / t})
            if backward:
                t = ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
                row.update({f"v{version} bwd ms": t, f"v{version} bwd TFLOP/s": flops_bwd / t / 1e9,
                            f"v{version} bwd vs SDPA": t_bwd_sdpa / t})
        row["v3 fwd config"] = tiles(getattr(attention_tma.attention_forward_kernel_v3, "best_config", None))
        row["v4 fwd config"] = tiles(getattr(attention_tma.attention_forward_kernel_v4, "best_config", None))
        if backward:
            row["v3 bwd configs"] = (
                f"dkdv {tiles(getattr(attention_tma.attention_backward_dkdv_kernel_v3, 'best_config', None))}, "
                f"dq {tiles(getattr(attention_tma.attention_backward_dq_kernel_v3, 'best_config', None))}")
        rows.append(row)
    return rows


def tiles(config) -> str:
    """An autotuner's choice, short: BLOCK_M x BLOCK_N, warps, stages (or that it chose none)."""
    if config is None:
        return "none (did not run)"
    return (f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']} {config.num_warps} warps "
            f"{config.num_stages} stages")


def triton_block(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ---- printing ----------------------------------------------------------------------------------
def show(column: str, value) -> str:
    """A cell: fractions as percentages, small numbers with 3 digits, large ones whole."""
    if isinstance(value, float):
        if "of copy" in column or " vs " in column:
            return f"{value:.1%}" if "of copy" in column else f"{value:.2f}x"
        return f"{value:.3g}" if value < 10 else f"{value:,.0f}"
    return str(value)


def table(rows: list[dict], columns: list[str]) -> str:
    """A markdown table, ready for docs/benchmarks.md."""
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(show(column, row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)


def smoke_test() -> dict:
    """No GPU: run each kernel once in the interpreter against torch, and say what that means."""
    print("No GPU here: Triton kernels run in the Triton interpreter, which executes every program in Python with\n"
          "numpy. There is no bandwidth or FLOP/s to measure. Smoke test instead (tiny sizes, checked against torch;\n"
          "the times are the interpreter's, not a GPU's). Run this script on a GPU for the real figures.\n")
    results = {}
    x = torch.randn(64, 300)
    cases = {
        "softmax (64 x 300)": (lambda: row_softmax.softmax(x), lambda: torch.softmax(x, -1)),
        "rmsnorm (64 x 300)": (lambda: rmsnorm.rmsnorm(x, torch.ones(300), 1e-5),
                                lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
    }
    q, k, v = (torch.randn(1, 2, 128, 32) for _ in range(3))
    cases["flash_attention fwd (1, 2, 128, 32)"] = (lambda: attention.flash_attention(q, k, v),
                                                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    for name, (ours, reference) in cases.items():
        torch.testing.assert_close(ours(), reference(), atol=1e-5, rtol=1e-5)
        t = timing.bench(ours, rep=3)
        results[name] = {"interpreter ms": t, "matches torch": True}
        print(f"  {name:<36} matches torch; {t:8.1f} ms in the interpreter")
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--no-backward", action="store_true", help="skip attention's backward")
    args = parser.parse_args(argv)

    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version()}
    import triton
    meta["triton"] = triton.__version__
    if INTERPRETED or not torch.cuda.is_available():
        results = {"meta": meta, "smoke": smoke_test()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return results

    device = torch.cuda.get_device_name()
    spec = gpu.H200 if "H200" in device else gpu.H100_SXM if "H100" in device else None
    meta.update(device=device, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, {meta['date']}\n")

    peak = copy_peak()
    spec_line = f" (spec sheet: {spec.hbm_bandwidth / 1e9:,.0f} GB/s, {spec.name})" if spec else ""
    print(f"copy peak: {peak['GB/s']:,.0f} GB/s{spec_line}\n")

    dtypes = (torch.bfloat16,) if args.quick else (torch.bfloat16, torch.float32)
    softmax_shapes = [(16384, 4096)] if args.quick else [(65536, 1024), (16384, 4096), (4096, 16384), (2048, 65536)]
    norm_shapes = [(16384, 4096)] if args.quick else [(65536, 1024), (16384, 4096), (8192, 8192)]
    attention_cases = ([(4, 16, 4096, 128, True)] if args.quick else
                       [(b, 16 if d == 128 else 32, s, d, c) for d in (64, 128) for s in (1024, 4096, 8192)
                        for c in (True, False) for b in (max(1, 16384 // s),)])

    sm = bench_softmax(softmax_shapes, dtypes, peak["GB/s"])
    print("softmax (picotron.kernels.row_softmax.softmax vs torch.softmax)")
    print(table(sm, ["shape", "dtype", "version", "ms", "GB/s", "of copy peak", "torch ms", "torch GB/s"]), "\n")
    rn = bench_rmsnorm(norm_shapes, dtypes, peak["GB/s"])
    print("RMSNorm (TritonRMSNorm vs picotron.model.RMSNorm eager and F.rms_norm)")
    print(table(rn, ["shape", "dtype", "fwd ms", "fwd GB/s", "fwd of copy peak", "eager fwd ms", "F.rms_norm fwd ms",
                     "bwd ms", "bwd GB/s", "bwd of copy peak", "bwd v2 of copy peak", "eager bwd ms"]), "\n")
    fa = bench_attention(attention_cases, backward=not args.no_backward)
    versions = [f"v{version}" for version in attention.VERSIONS]
    passes = ("fwd", "bwd") if not args.no_backward else ("fwd",)
    print("FlashAttention, bf16 (every version of flash_attention, forward and backward, vs "
          "F.scaled_dot_product_attention)")
    print(table(fa, ["shape (b, h, s, d)", "causal"]
                + [f"{name} {part} TFLOP/s" for part in passes for name in ["SDPA"] + versions]
                + [f"{name} {part} vs SDPA" for part in passes for name in versions]), "\n")
    for r in fa:
        for name in versions:
            if r[f"{name} check"] != "ok":
                print(f"{r['shape (b, h, s, d)']} causal={r['causal']} {name}: {r[f'{name} check']}")
    print("autotuned: " + "; ".join(f"{r['shape (b, h, s, d)']} causal={r['causal']}: fwd v3 {r['v3 fwd config']}, "
                                    f"v4 {r['v4 fwd config']}"
                                    + (f"; bwd {r['v3 bwd configs']}" if "v3 bwd configs" in r else "")
                                    for r in fa), "\n")

    big = [r for r in sm if r["version"].startswith("v2")]
    goals = {
        "softmax >= 85% of copy peak (fused shapes)": min(r["of copy peak"] for r in big) >= GOAL_BANDWIDTH,
        "RMSNorm forward >= 85% of copy peak": min(r["fwd of copy peak"] for r in rn) >= GOAL_BANDWIDTH,
        "RMSNorm backward (v1 or v2) >= 85% of copy peak":
            min(max(r["bwd of copy peak"], r["bwd v2 of copy peak"]) for r in rn) >= GOAL_BANDWIDTH,
        **{f"flash-attention {part} (best correct version) >= {GOAL_ATTENTION[part]}x SDPA":
           min(max([r[f"{name} {part} vs SDPA"] for name in versions if r[f"{name} check"] == "ok"], default=0)
               for r in fa) >= GOAL_ATTENTION[part]
           for part in passes},
    }
    for goal, met in goals.items():
        print(f"{'met    ' if met else 'NOT met'}  {goal}")
    results = {"meta": meta, "copy_peak": peak, "softmax": sm, "rmsnorm": rn, "attention": fa, "goals": goals}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()

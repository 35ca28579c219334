"""Tokens/s and MFU of the trainer on one GPU (or the CPU) over micro-batch sizes and recomputation.

    python benchmarks/train_sweep.py --preset smollm-1.7b --seq-len 2048 --micro-batch-sizes 1,2,4,8 \
        --recompute none,selective,full --steps 10 --precision bf16 --compile --json out.json
    python benchmarks/train_sweep.py --preset tiny --seq-len 64 --micro-batch-sizes 2,4 \
        --recompute none,full --steps 3                          # CPU smoke run, a few seconds

Each configuration (micro-batch size, recomputation) builds a fresh `picotron.train.Trainer` in this
process (one rank, mesh=None) and runs --steps real training steps: forward, backward, gradient
clipping and AdamW, on the built-in corpus. The first --warmup steps are dropped (allocations, cuDNN
and autotuning; with --compile, tracing and compilation) and the step time is the median of the rest.

    tokens/s = micro_batch_size * seq_len / step time
    MFU      = tokens/s * model FLOPs per token / peak FLOP/s
    HFU      = tokens/s * hardware FLOPs per token / peak FLOP/s

Model FLOPs per token are 6 N + 12 L h s (N parameters, L layers, h hidden size, s sequence length:
2 FLOPs per weight per token forward, 4 backward, plus attention's QK^T and AV; PaLM, arXiv:2204.02311,
appendix B). They count the work the model needs, so MFU compares layouts fairly. Hardware FLOPs add
what recomputation runs a second time (picotron.costs.training_flops_per_token): HFU says how busy the
GPU was, and is above MFU exactly when something is recomputed. The peak is that of the precision the
matmuls ran in (picotron.costs.peak_flops: the spec sheet's dense bf16 figure on a known GPU, a
measured matmul on a CPU; docs/design.md, "FLOPs, peaks and MFU").

A configuration that runs out of GPU memory is reported as OOM and the sweep goes on. On a GPU the
table shows the peak memory torch's allocator held during the configuration's steps. This is a
benchmark, not a test: the times depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics

import torch

from picotron.config import RECOMPUTE_CHOICES, Config, ModelConfig, TrainConfig
from picotron.costs import flops_per_token, peak_flops, training_flops_per_token
from picotron.train import Trainer


def make_config(preset: str, seq_len: int, micro_batch_size: int, recompute: str, *, steps: int,
                precision: str = "auto", compile: bool = False) -> Config:
    """One process, one micro-batch per step: the configuration whose step this sweep times."""
    model = ModelConfig.preset(preset)
    # max_seq_len only sizes the RoPE tables: a preset may be timed at a longer sequence than it was trained on.
    model = dataclasses.replace(model, recompute=recompute, max_seq_len=max(model.max_seq_len, seq_len))
    train = TrainConfig(steps=steps, micro_batch_size=micro_batch_size, seq_len=seq_len, precision=precision,
                        compile=compile, log_every=1)
    return Config(model=model, train=train)


def measure(config: Config, steps: int, warmup: int, peaks: dict) -> dict:
    """Train `steps` steps of `config` and return its row: step time, tokens/s, MFU, HFU, peak memory.

    `peaks` caches (FLOP/s, source) per (device, dtype): on a CPU the peak is a measured matmul.
    """
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(config)
    times = [trainer.train_step(step).seconds for step in range(steps)]
    step_s = statistics.median(times[warmup:])
    memory = torch.cuda.max_memory_allocated() / 2**30 if trainer.device.type == "cuda" else None
    key = (str(trainer.device), trainer.compute_dtype)
    if key not in peaks:
        peaks[key] = peak_flops(trainer.device, trainer.compute_dtype)
    peak, _ = peaks[key]
    t, model = config.train, config.model
    tokens_per_s = t.micro_batch_size * t.seq_len / step_s
    return {"micro_batch_size": t.micro_batch_size, "recompute": model.recompute, "status": "ok",
            "step_s": step_s, "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * flops_per_token(model, t.seq_len) / peak,
            "hfu": tokens_per_s * training_flops_per_token(model, t.seq_len) / peak,
            "peak_memory_gib": memory, "warmup_s": sum(times[:warmup])}


def measure_or_oom(config: Config, steps: int, warmup: int, peaks: dict) -> dict:
    """`measure`, or an "OOM" row when the GPU runs out of memory; the memory is freed either way."""
    try:
        row = measure(config, steps, warmup, peaks)
    except torch.cuda.OutOfMemoryError:
        row = {"micro_batch_size": config.train.micro_batch_size, "recompute": config.model.recompute,
               "status": "OOM"}
    # The trainer is gone with measure's frame (and the exception's traceback): give its memory back
    # before the next configuration, so that one's peak is its own.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def sweep(preset: str, seq_len: int, micro_batch_sizes: list[int], recomputes: list[str], *, steps: int,
          warmup: int, precision: str = "auto", compile: bool = False) -> tuple[list[dict], dict]:
    """Every (micro-batch size, recomputation) pair, in order; returns the rows and the peaks used."""
    rows, peaks = [], {}
    for micro_batch_size in micro_batch_sizes:
        for recompute in recomputes:
            if compile:
                torch._dynamo.reset()   # each configuration compiles its own shapes, as a fresh run would
            config = make_config(preset, seq_len, micro_batch_size, recompute, steps=steps, precision=precision,
                                 compile=compile)
            rows.append(measure_or_oom(config, steps, warmup, peaks))
            print_row(rows[-1])
    return rows, peaks


def best_row(rows: list[dict]) -> dict | None:
    """The configuration with the most tokens/s, or None when every one ran out of memory."""
    ok = [row for row in rows if row["status"] == "ok"]
    return max(ok, key=lambda row: row["tokens_per_s"]) if ok else None


HEADER = (f"{'micro-batch':>11}  {'recompute':<10}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}{'HFU':>8}"
          f"{'peak GiB':>10}")


def print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"{row['micro_batch_size']:>11}  {row['recompute']:<10}{row['status']:>10}")
        return
    memory = f"{row['peak_memory_gib']:.1f}" if row["peak_memory_gib"] is not None else "-"
    print(f"{row['micro_batch_size']:>11}  {row['recompute']:<10}{row['step_s'] * 1e3:>10.1f}"
          f"{row['tokens_per_s']:>12,.0f}{row['mfu']:>8.1%}{row['hfu']:>8.1%}{memory:>10}")


def parse_list(text: str, kind: type, name: str) -> list:
    """"1,2,4" -> [1, 2, 4]; an argparse type with the flag's name in the message."""
    try:
        values = [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} {text!r}: write a comma-separated list, e.g. 1,2,4") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{name} is empty: give at least one value")
    return values


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="tiny", help="model shape (ModelConfig.preset)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batch-sizes", type=lambda s: parse_list(s, int, "--micro-batch-sizes"),
                        default=[1, 2, 4, 8], help="comma-separated, e.g. 1,2,4,8")
    parser.add_argument("--recompute", type=lambda s: parse_list(s, str, "--recompute"),
                        default=["none", "selective", "full"], help=f"comma-separated of {RECOMPUTE_CHOICES}")
    parser.add_argument("--steps", type=int, default=10, help="training steps per configuration, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median (compilation)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="auto: bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if unknown := [r for r in args.recompute if r not in RECOMPUTE_CHOICES]:
        parser.error(f"--recompute {','.join(unknown)}: choose from {','.join(RECOMPUTE_CHOICES)}")
    if args.warmup < 0 or args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no step to time after --warmup {args.warmup}; "
                     f"use --steps {args.warmup + 3} or more")
    if min(args.micro_batch_sizes) < 1 or args.seq_len < 1:
        parser.error("--micro-batch-sizes and --seq-len must be positive")

    model = ModelConfig.preset(args.preset)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{args.preset}: {model.num_params() / 1e6:,.1f}M parameters, sequence {args.seq_len}, on {device}, "
          f"precision {args.precision}{', compiled' if args.compile else ''}; median of steps {args.warmup}.."
          f"{args.steps - 1} per configuration")
    print(HEADER)
    rows, peaks = sweep(args.preset, args.seq_len, args.micro_batch_sizes, args.recompute, steps=args.steps,
                        warmup=args.warmup, precision=args.precision, compile=args.compile)
    for peak, source in peaks.values():
        print(f"peak: {peak / 1e12:,.3f} TFLOP/s ({source})")
    best = best_row(rows)
    if best:
        print(f"best: micro-batch {best['micro_batch_size']}, recompute {best['recompute']}: "
              f"{best['tokens_per_s']:,.0f} tokens/s, MFU {best['mfu']:.1%}")
    else:
        print("best: none; every configuration ran out of memory")
    results = {"args": vars(args), "device": device, "params": model.num_params(),
               "peaks": [{"dtype": str(dtype), "flops": peak, "source": source}
                         for (_, dtype), (peak, source) in peaks.items()],
               "rows": rows, "best": best}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

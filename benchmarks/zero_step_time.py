"""Step time of ZeRO stages 0-3 and of ZeRO-3's prefetch, on N ranks.

    python benchmarks/zero_step_time.py                 # 4 ranks, tiny Llama, about a minute on 2 cores
    python benchmarks/zero_step_time.py --reps 9 --json out.json

What one step is: zero_grad, forward + backward of this rank's micro-batch, the optimizer step,
with each variant's communication (picotron/parallel/zero.py, chapter 03):

    plain DP               picotron's DataParallel (bucketed all-reduce) and a full AdamW
    stage 0                ZeroOptimizer(stage=0): the same, in ZeRO's flat layout
    stage 1                reduce-scatter after backward, AdamW on 1/N, all-gather the parameters
    stage 2                reduce-scatter each bucket during backward, keep only the shard
    stage 3, prefetch      Zero3: all-gather each unit before its forward and its backward, and
                           start the next unit's all-gather while the current one computes
    stage 3, no prefetch   Zero3(prefetch=False): each all-gather starts when its unit is needed

How it is measured (as benchmarks/dp_step_time.py): all variants live in one launch of N ranks
(each its own model and optimizer), are warmed up, then timed round-robin so drifting machine
load hits them alike. A repetition is --steps steps behind a barrier; its time is the slowest
rank's mean step time; the table shows the median over --reps repetitions and the range. For
stage 3 it also shows the time spent inside Zero3._gather (starting an all-gather that prefetch
did not start, and waiting for it): the communication that compute did not hide. (Under NCCL,
Work.wait() only makes the compute stream wait, so there that column is host time, not GPU time.)

On a CPU, gloo's communication runs on the same cores as the compute: an all-gather started
early (prefetch) has no idle hardware to run on, so expect prefetch to gain little or nothing
here. On GPUs NCCL moves the bytes while the SMs compute, which is what prefetch is for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from picotron import launch
from picotron.config import ModelConfig
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import DataParallel
from picotron.parallel.zero import ZeroOptimizer
from picotron.parallel.zero3 import Zero3

VARIANTS = {
    "plain DP": dict(kind="dp"),
    "stage 0": dict(kind="zero", stage=0),
    "stage 1": dict(kind="zero", stage=1),
    "stage 2": dict(kind="zero", stage=2),
    "stage 3, prefetch": dict(kind="zero3", prefetch=True),
    "stage 3, no prefetch": dict(kind="zero3", prefetch=False),
}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


class Runner:
    """One variant on this rank: its own model, its optimizer and its communication."""

    def __init__(self, spec: dict, config: ModelConfig, tokens: torch.Tensor, bucket_mb: float):
        torch.manual_seed(0)
        self.tokens, self.dp = tokens, None
        self.model = Llama(config).to(tokens.device)
        group = dist.group.WORLD
        if spec["kind"] == "dp":
            self.dp = DataParallel(self.model, group, bucket_mb=bucket_mb)
            self.optimizer = adamw(self.model.parameters())
        elif spec["kind"] == "zero":
            self.optimizer = ZeroOptimizer(self.model, group, stage=spec["stage"], optimizer=adamw, bucket_mb=bucket_mb)
        else:
            self.optimizer = Zero3(self.model, group, prefetch=spec["prefetch"], optimizer=adamw)
            gather = self.optimizer._gather

            def timed_gather(g):                                        # this object's method only
                start = time.perf_counter()
                gather(g)
                self.waited += time.perf_counter() - start
            self.optimizer._gather = timed_gather
        self.waited = 0.0                                               # seconds inside Zero3._gather

    def step(self) -> None:
        self.optimizer.zero_grad()
        loss_fn(self.model(self.tokens[:, :-1]), self.tokens[:, 1:]).backward()
        if self.dp is not None:
            self.dp.finish_gradient_sync()
        self.optimizer.step()


def measure(config: ModelConfig, batch_per_rank: int, seq_len: int, bucket_mb: float, reps: int,
            steps: int) -> dict:
    """On each rank: {variant: [(seconds per step, seconds waiting for gathers per step), one per repetition]}."""
    dev = launch.device()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(dist.get_rank())          # each rank its own samples
    tokens = torch.randint(0, config.vocab_size, (batch_per_rank, seq_len + 1), generator=generator).to(dev)
    runners = {name: Runner(spec, config, tokens, bucket_mb) for name, spec in VARIANTS.items()}
    for runner in runners.values():                                     # warm-up: optimizer state, gloo pairs
        runner.step()
        runner.step()
    times = {name: [] for name in VARIANTS}
    for _ in range(reps):
        for name, runner in runners.items():
            runner.waited = 0.0
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                runner.step()
            sync()
            times[name].append(((time.perf_counter() - start) / steps, runner.waited / steps))
    return times


def summarise(per_rank: list[dict]) -> dict:
    """Per variant: median over repetitions of the slowest rank's step time, its range, and the wait."""
    out = {}
    for name in per_rank[0]:
        reps = range(len(per_rank[0][name]))
        slowest = [max(rank[name][i][0] for rank in per_rank) for i in reps]
        waited = [max(rank[name][i][1] for rank in per_rank) for i in reps]
        out[name] = {"median_s": statistics.median(slowest), "min_s": min(slowest), "max_s": max(slowest),
                     "gather_wait_s": statistics.median(waited), "reps": len(slowest)}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--preset", default="tiny", help="model shape (ModelConfig.preset)")
    parser.add_argument("--batch-per-rank", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of plain DP and stages 0-2")
    parser.add_argument("--reps", type=int, default=7, help="repetitions (the median is reported; >= 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per repetition")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps {args.reps}: use at least 5 repetitions, the machine is noisy")

    config = ModelConfig.preset(args.preset)
    print(f"{args.preset} Llama, {config.num_params() / 1e6:.2f}M parameters, {config.num_layers} layers; "
          f"{args.world_size} ranks, {args.batch_per_rank} x {args.seq_len} tokens per rank; "
          f"median of {args.reps} repetitions of {args.steps} steps, slowest rank")
    start = time.perf_counter()
    per_rank = launch.run(measure, args.world_size, timeout=1800,
                          args=(config, args.batch_per_rank, args.seq_len, args.bucket_mb, args.reps, args.steps))
    results = summarise(per_rank)
    print(f"{'variant':<24}{'median ms':>11}{'range ms':>16}{'waiting for gathers ms':>25}")
    for name, r in results.items():
        span = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
        wait = f"{r['gather_wait_s'] * 1e3:.1f}" if name.startswith("stage 3") else "-"
        print(f"{name:<24}{r['median_s'] * 1e3:>11.1f}{span:>16}{wait:>25}")
    on, off = results["stage 3, prefetch"]["median_s"], results["stage 3, no prefetch"]["median_s"]
    waits = [results[f"stage 3, {kind}"]["gather_wait_s"] * 1e3 for kind in ("prefetch", "no prefetch")]
    print(f"\nstage 3 without / with prefetch: {off / on:.2f}x ({off * 1e3:.0f} ms vs {on * 1e3:.0f} ms; waiting for "
          f"gathers {waits[1]:.0f} ms vs {waits[0]:.0f} ms); measured in {time.perf_counter() - start:.0f} s")
    out = {"args": vars(args), "params": config.num_params(), "step": results,
           "backend": launch.backend_for(args.world_size)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

"""Step time of data parallelism, naive vs overlapped vs bucketed, on N ranks.

    python benchmarks/dp_step_time.py                  # 4 ranks, tiny Llama, ~1 minute on 2 cores
    python benchmarks/dp_step_time.py --reps 9 --json out.json

What one step is: forward + backward of this rank's share of the global batch, the gradient
all-reduce, one AdamW step. The variants (picotron/parallel/data_parallel.py, chapter 02):

    no communication   the same step without any all-reduce: the compute floor
    naive              one blocking all-reduce per parameter, after backward
    overlapped         one async all-reduce per parameter, launched from backward's hooks
    flat               one all-reduce of all gradients (copied into one buffer), after backward
    bucketed           gradients as views in buckets of --bucket-mb MiB, async all-reduce per full bucket
    bucketed, no overlap   the same buckets, all launched after backward
    torch DDP          torch's DistributedDataParallel with the same bucket size
    comm only: ...     the all-reduces of one step and nothing else (per parameter / one flat buffer)

Then a sweep of bucket sizes, with the time each step waits in finish_gradient_sync (the
communication backward did not hide).

How it is measured: all variants live in one launch of N ranks (each its own model and
optimizer), are warmed up, then timed round-robin, so drifting machine load hits them alike.
A repetition is --steps steps behind a barrier; its time is the slowest rank's mean step
time; the table shows the median over --reps repetitions (and the min-max range). On CPU every
rank runs one thread (N gloo processes stand in for N GPUs); this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron import launch
from picotron.config import ModelConfig
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import DataParallel, all_reduce_each_gradient, all_reduce_gradients


def variants(bucket_mb: float) -> dict[str, dict]:
    return {
        "no communication": dict(sync="none"),
        "naive": dict(sync="each"),
        "overlapped": dict(sync="dp", bucket_mb=0),
        "flat": dict(sync="flat"),
        "bucketed": dict(sync="dp", bucket_mb=bucket_mb),
        "bucketed, no overlap": dict(sync="dp", bucket_mb=bucket_mb, overlap=False),
        "torch DDP": dict(sync="ddp", bucket_mb=bucket_mb),
        "comm only: per parameter": dict(sync="comm_each"),
        "comm only: one flat buffer": dict(sync="comm_flat"),
    }


def sweep_variants(sizes: list[float]) -> dict[str, dict]:
    return {f"sweep {mb:g} MiB": dict(sync="dp", bucket_mb=mb) for mb in sizes}


class Runner:
    """One variant on this rank: its own model replica, optimizer and gradient sync."""

    def __init__(self, spec: dict, config: ModelConfig, tokens: torch.Tensor):
        torch.manual_seed(0)
        self.spec, self.tokens = spec, tokens
        self.model = Llama(config).to(tokens.device)
        self.dp, self.ddp, group = None, None, dist.group.WORLD
        if spec["sync"] == "dp":
            self.dp = DataParallel(self.model, group, bucket_mb=spec["bucket_mb"], overlap=spec.get("overlap", True))
        if spec["sync"] == "ddp":
            self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=spec["bucket_mb"],
                                               gradient_as_bucket_view=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        if spec["sync"].startswith("comm"):  # gradients to send, without computing them
            for p in self.model.parameters():
                p.grad = torch.randn_like(p)
        self.exposed = 0.0  # seconds spent waiting in finish_gradient_sync, summed over steps

    def step(self) -> None:
        sync = self.spec["sync"]
        if sync == "comm_each":
            return all_reduce_each_gradient(self.model, dist.group.WORLD)
        if sync == "comm_flat":
            return all_reduce_gradients(self.model, dist.group.WORLD)
        model = self.ddp or self.model
        loss_fn(model(self.tokens[:, :-1]), self.tokens[:, 1:]).backward()
        if sync == "each":
            all_reduce_each_gradient(self.model, dist.group.WORLD)
        elif sync == "flat":
            all_reduce_gradients(self.model, dist.group.WORLD)
        elif sync == "dp":
            start = time.perf_counter()
            self.dp.finish_gradient_sync()
            self.exposed += time.perf_counter() - start
        self.optimizer.step()
        self.optimizer.zero_grad()


def measure(specs: dict, config: ModelConfig, batch_per_rank: int, seq_len: int, reps: int, steps: int) -> dict:
    """On each rank: {variant: [(seconds per step, exposed seconds per step) per repetition]}."""
    dev = launch.device()
    generator = torch.Generator().manual_seed(dist.get_rank())  # each rank its own samples
    tokens = torch.randint(0, config.vocab_size, (batch_per_rank, seq_len + 1), generator=generator).to(dev)
    runners = {name: Runner(spec, config, tokens) for name, spec in specs.items()}
    for runner in runners.values():  # warm-up: allocations, gloo connections, autograd caches
        runner.step()
        runner.step()
    times = {name: [] for name in specs}
    for _ in range(reps):
        for name, runner in runners.items():
            runner.exposed = 0.0
            with timed(dev) as elapsed:
                for _ in range(steps):
                    runner.step()
            times[name].append((elapsed() / steps, runner.exposed / steps))
    return times


@contextmanager
def timed(dev: torch.device):
    """Wall time of the block, started behind a barrier so all ranks start together."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    start = time.perf_counter()
    box = []
    yield lambda: box[0]
    sync()
    box.append(time.perf_counter() - start)


def summarise(per_rank: list[dict]) -> dict:
    """Per variant: median over repetitions of the slowest rank's step time (and exposed time)."""
    out = {}
    for name in per_rank[0]:
        reps = len(per_rank[0][name])
        slowest = [max(rank[name][i][0] for rank in per_rank) for i in range(reps)]
        exposed = [max(rank[name][i][1] for rank in per_rank) for i in range(reps)]
        out[name] = {"median_s": statistics.median(slowest), "min_s": min(slowest), "max_s": max(slowest),
                     "exposed_s": statistics.median(exposed), "reps": reps}
    return out


def print_table(title: str, results: dict) -> None:
    print(f"\n{title}")
    print(f"{'variant':<28}{'median ms':>11}{'range ms':>16}{'waiting for comm ms':>22}")
    for name, r in results.items():
        span = f"{r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f}"
        print(f"{name:<28}{r['median_s'] * 1e3:>11.1f}{span:>16}{r['exposed_s'] * 1e3:>22.1f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--preset", default="tiny", help="model shape (ModelConfig.preset)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size of 'bucketed' and 'torch DDP'")
    parser.add_argument("--sweep", type=float, nargs="*", default=[0, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 4])
    parser.add_argument("--reps", type=int, default=7, help="repetitions (the median is reported; >= 5)")
    parser.add_argument("--steps", type=int, default=3, help="steps per repetition")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.reps < 5:
        parser.error(f"--reps {args.reps}: use at least 5 repetitions, the machine is noisy")
    if args.global_batch % args.world_size:
        parser.error(f"--global-batch {args.global_batch} does not split over {args.world_size} ranks")

    config = ModelConfig.preset(args.preset)
    grad_mib = config.num_params() * 4 / 2**20
    print(f"{args.preset} Llama, {config.num_params() / 1e6:.2f}M parameters ({grad_mib:.2f} MiB of fp32 gradients), "
          f"{args.world_size} ranks, {args.global_batch // args.world_size} x {args.seq_len} tokens per rank; "
          f"median of {args.reps} repetitions of {args.steps} steps, slowest rank")
    common = (config, args.global_batch // args.world_size, args.seq_len, args.reps, args.steps)
    start = time.perf_counter()
    main_results = summarise(launch.run(measure, args.world_size, args=(variants(args.bucket_mb), *common),
                                        timeout=1800))
    print_table(f"step time (bucketed: {args.bucket_mb:g} MiB buckets)", main_results)
    sweep = summarise(launch.run(measure, args.world_size, args=(sweep_variants(args.sweep), *common),
                                 timeout=1800))
    print_table("bucket size sweep (0 MiB: one bucket per parameter)", sweep)
    naive, bucketed = main_results["naive"]["median_s"], main_results["bucketed"]["median_s"]
    print(f"\nnaive / bucketed step time: {naive / bucketed:.2f}x "
          f"({naive * 1e3:.0f} ms vs {bucketed * 1e3:.0f} ms); measured in {time.perf_counter() - start:.0f} s")
    results = {"args": vars(args), "params": config.num_params(), "step": main_results, "sweep": sweep,
               "backend": launch.backend_for(args.world_size)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()

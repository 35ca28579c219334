"""What `picotron.launch.run` costs: the first launch (it starts the rank server) and each later one.

    python benchmarks/launch_overhead.py                 # 2, 4 and 8 ranks, 30 launches each
    python benchmarks/launch_overhead.py --ranks 4 --launches 100

A launch here runs a function that does nothing, so its time is all overhead: the rank server
forks the ranks, each adopts the caller's environment and unpickles the function, the ranks
join a gloo (or NCCL) process group through the store the caller hosts, return, and exit.
Before timing, the caller runs a backward pass, as a notebook has by the time it calls `run`.
The table shows the median and the 90th percentile of the later launches, and how many took
longer than one second (a stalled TCP connect in the rendezvous; see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from picotron.launch import run


def nothing() -> None:
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--launches", type=int, default=30)
    args = parser.parse_args()
    x = torch.randn(16, 16, requires_grad=True)
    (x @ x).sum().backward()  # the caller has used autograd, as a notebook has

    start = time.perf_counter()
    run(nothing, args.ranks[0])
    print(f"first launch ({args.ranks[0]} ranks, starts the rank server): {time.perf_counter() - start:.2f} s")
    print(f"{'ranks':>5} {'median':>9} {'p90':>9} {'> 1 s':>6}")
    for world_size in args.ranks:
        run(nothing, world_size)
        times = []
        for _ in range(args.launches):
            start = time.perf_counter()
            run(nothing, world_size)
            times.append(time.perf_counter() - start)
        times.sort()
        p90 = times[int(0.9 * (len(times) - 1))]
        print(f"{world_size:>5} {statistics.median(times):>8.3f}s {p90:>8.3f}s {sum(t > 1 for t in times):>6}")


if __name__ == "__main__":
    main()

"""picotron.parallel.data_parallel: every variant equals one process, and torch's DDP.

The core test trains 20 steps on 4 ranks with each variant (naive, flat, overlapped, bucketed
with buckets smaller than a parameter up to one bucket, bucketed without overlap, gradient
accumulation with no_sync, torch DDP), all in one launch, and compares every step's loss and
gradients, and the final weights, with one process training on the same global batch, in lockstep
(picotron.lockstep), on every rank.
"""

import dataclasses
import functools
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron import comm, lockstep
from picotron.comm import CommCounter
from picotron.config import ModelConfig, TrainConfig
from picotron_course.checks import one_thread
from picotron.data import DataLoader, TokenDataset, build_dataset
from picotron.launch import run
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import (DataParallel, all_reduce_each_gradient, all_reduce_gradients,
                                             assign_buckets, broadcast_parameters)
from picotron.tolerance import compare_all

SMALL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=32)
DP, STEPS, MICRO_BATCH, SEQ = 4, 20, 2, 32
PARAM_BYTES = SMALL.num_params() * 4


# ---- against torch DDP, one step, different initial weights per rank --------------------------
def ours_and_ddp():
    rank = dist.get_rank()
    torch.manual_seed(rank)          # different initial weights on each rank: broadcast must fix that
    ours = Llama(SMALL)
    broadcast_parameters(ours, dist.group.WORLD)
    reference = Llama(SMALL)
    reference.load_state_dict(ours.state_dict())
    ddp = DistributedDataParallel(reference)
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(100 + rank))
    for model in (ours, ddp):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    all_reduce_gradients(ours, dist.group.WORLD)
    return ({n: p.grad for n, p in ours.named_parameters()},
            {n: p.grad for n, p in reference.named_parameters()},
            ours.embed.weight.detach())


def test_gradients_equal_ddp():
    results = run(ours_and_ddp, 3, timeout=60)
    for ours, ddp, embed in results:
        # The same local gradients, summed over 3 ranks in another order and divided by 3 before or after:
        # 3 + 2 roundings apart (picotron.tolerance).
        grads = compare_all(ours, ddp, n=3 + 2)
        assert grads, str(grads)
        torch.testing.assert_close(embed, results[0][2], rtol=0, atol=0)  # replicas identical


# ---- 20 steps, every variant, 4 ranks vs 1 process ----------------------------------------------
# name: (how gradients are synced, bucket MiB, overlap, micro-batches per step)
VARIANTS = {
    "naive": ("each", None, False, 1),
    "flat": ("flat", None, False, 1),
    "overlapped": ("dp", 0, True, 1),                    # one bucket per parameter
    "bucketed 0.01 MiB": ("dp", 0.01, True, 1),          # smaller than most parameters (16 KiB and up)
    "bucketed 0.1 MiB": ("dp", 0.1, True, 1),
    "bucketed 25 MiB": ("dp", 25, True, 1),              # the whole model in one bucket
    "bucketed, no overlap": ("dp", 0.1, False, 1),
    "accumulation, no_sync": ("dp", 0.1, True, 2),
    "torch DDP": ("ddp", 0.1, True, 1),
    "torch DDP, no_sync": ("ddp", 0.1, True, 2),
}


@functools.cache
def dataset() -> TokenDataset:
    """Built once (0.4 s each time otherwise); run() sends it to the ranks with the function that uses it."""
    return build_dataset(TrainConfig(seq_len=SEQ))


def train_variant(variant: tuple, reference: lockstep.Trace | None = None, counter: CommCounter | None = None,
                  keep: bool = False) -> tuple:
    """Train STEPS steps of AdamW, recorded by picotron.lockstep: every step's global loss and averaged gradients
    (every rank holds them whole), the final weights. One process (no `reference`) gives its Trace; a rank gives
    its Lockstep against `reference`, compared here in the rank: sending 20 steps of gradients back through the
    launcher's pipe would cost more than training. Beside it, what is measured, not proven: the samples each step
    saw, the calls per step, the weights (replicas are compared with each other), the buckets; with `keep`, the
    run's own Trace, to compare two variants with each other.

    `counter`, if given, records every collective of the run (picotron.comm.counting).
    """
    with comm.counting(counter) if counter is not None else nullcontext():
        return _train_variant(variant, reference, counter, keep)


def _train_variant(variant: tuple, reference: lockstep.Trace | None, counter: CommCounter | None, keep: bool):
    sync, bucket_mb, overlap, accum = variant
    dp_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(0)
    model = Llama(SMALL)
    wrapped, dp = model, None
    if sync == "dp":
        dp = DataParallel(model, dist.group.WORLD, bucket_mb=bucket_mb, overlap=overlap)
    elif sync == "ddp":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(dataset(), MICRO_BATCH * DP // dp_size, dp_rank=rank, dp_size=dp_size)
    record, own = lockstep.Recorder(reference), lockstep.Recorder() if keep else None
    measured = {"samples": [], "calls": []}
    for step in range(STEPS):
        step_loss, samples = torch.zeros(()), []
        before = counter.total_calls if counter else 0
        for micro in range(accum):
            batch = loader.get_batch(step, micro)
            last = micro == accum - 1
            quiet = (dp or wrapped).no_sync() if not last and sync in ("dp", "ddp") else nullcontext()
            with quiet:
                loss = loss_fn(wrapped(batch.input_ids), batch.targets) / accum
                loss.backward()
            step_loss += loss.detach()
            samples += batch.sample_ids.tolist()
        if sync == "each":
            all_reduce_each_gradient(model, dist.group.WORLD)
        elif sync == "flat":
            all_reduce_gradients(model, dist.group.WORLD)
        elif sync == "dp":
            dp.finish_gradient_sync()
        measured["calls"].append((counter.total_calls if counter else 0) - before)
        if dist.is_initialized():
            dist.all_reduce(step_loss)  # for the comparison only: not counted
            step_loss /= dp_size
        grads = {n: p.grad for n, p in model.named_parameters()}
        record.step(step_loss, grads)
        if own:
            own.step(step_loss, grads)
        measured["samples"].append(samples)
        optimizer.step()
        optimizer.zero_grad()  # set_to_none: DataParallel must point .grad back into its buckets
    measured["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if dp:
        measured["buckets"] = len(dp.buckets)
    if own:
        measured["trace"] = own.finish(measured["weights"])
    return record.finish(measured["weights"]), measured


DDP_PAIRS = [("bucketed 0.1 MiB", "torch DDP"), ("accumulation, no_sync", "torch DDP, no_sync")]


def all_variants(references: dict) -> dict:
    """Every variant on this rank, each against the one-process run of its micro-batch count (`references`
    travelled to the rank with the function); and ours against torch DDP, both runs' records compared step by
    step (picotron.lockstep.compare), here in the rank."""
    kept = {name for pair in DDP_PAIRS for name in pair}
    out = {name: train_variant(variant, references[variant[3]], CommCounter(), keep=name in kept)
           for name, variant in VARIANTS.items()}
    traces = {name: out[name][1].pop("trace") for name in kept}   # not sent back: 20 steps of gradients
    out["vs DDP"] = {(ours, ddp): lockstep.compare(traces[ours], traces[ddp]) for ours, ddp in DDP_PAIRS}
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The single-process runs, by micro-batches per step: (Trace, measured); one thread, like each rank (and
    not fighting the ranks of other tests for the cores)."""
    with one_thread():   # like each rank
        return {accum: train_variant(("local", None, False, accum)) for accum in (1, 2)}


@pytest.fixture(scope="module")
def four_ranks(one_process) -> list[dict]:
    references = {accum: trace for accum, (trace, _) in one_process.items()}
    return run(all_variants, DP, args=(references,), timeout=300)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_equals_one_process(name, four_ranks, one_process):
    accum = VARIANTS[name][3]
    reference, expected = one_process[accum]
    results, measured = zip(*[rank[name] for rank in four_ranks])
    for rank, result in enumerate(results):   # every rank: the loss and gradients of every step, the weights
        result.assert_equal(f"rank {rank}, {name}")
    for step in range(STEPS):
        # The ranks saw different samples, and together exactly the one process's global batch.
        seen = [m["samples"][step] for m in measured]
        assert len({tuple(s) for s in seen}) == DP
        per_micro = MICRO_BATCH
        together = [i for m in range(accum) for s in seen for i in s[m * per_micro:(m + 1) * per_micro]]
        assert together == expected["samples"][step]
    for m in measured:   # replicas identical
        torch.testing.assert_close(m["weights"], measured[0]["weights"], rtol=0, atol=0)
    assert reference.loss[-1] < reference.loss[0] - 0.5  # and it learned something


@pytest.mark.parametrize("ours, ddp", DDP_PAIRS)
def test_equals_torch_ddp_step_by_step(ours, ddp, four_ranks):
    """The course's claim for gradients while training, every step (with the losses and, after the Adam steps,
    the weights, by picotron.lockstep); the weights also within 1e-5."""
    for rank, result in enumerate(four_ranks):
        result["vs DDP"][(ours, ddp)].assert_equal(f"rank {rank}, {ours} against {ddp}")
        torch.testing.assert_close(result[ours][1]["weights"], result[ddp][1]["weights"], rtol=1e-5, atol=1e-5)


def test_one_all_reduce_per_bucket_per_step(four_ranks):
    """Bucketing sets the number of calls; no_sync keeps accumulation from adding any."""
    rank0 = {name: measured for name, (_, measured) in four_ranks[0].items() if name in VARIANTS}
    params = len(list(Llama(SMALL).parameters()))
    assert rank0["naive"]["calls"] == [params] * STEPS and rank0["flat"]["calls"] == [1] * STEPS
    assert rank0["overlapped"]["buckets"] == params
    assert rank0["bucketed 25 MiB"]["buckets"] == 1
    assert 1 < rank0["bucketed 0.1 MiB"]["buckets"] < rank0["bucketed 0.01 MiB"]["buckets"] < params
    for name in ("overlapped", "bucketed 0.01 MiB", "bucketed 0.1 MiB", "bucketed 25 MiB", "bucketed, no overlap",
                 "accumulation, no_sync"):
        assert rank0[name]["calls"] == [rank0[name]["buckets"]] * STEPS, name


# ---- the mechanics: hooks, views, overlap, bytes ------------------------------------------------
def hook_counts(recompute: str) -> dict:
    """How often each kind of hook fires for the tied embedding in one backward."""
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(SMALL, recompute=recompute))
    assert model.lm_head.weight is model.embed.weight  # tied: used at the input and at the output
    tensor_hook, post_hook = [], []
    model.embed.weight.register_hook(lambda grad: tensor_hook.append(grad.clone()))
    model.embed.weight.register_post_accumulate_grad_hook(lambda p: post_hook.append(p.grad.clone()))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    return {"tensor": tensor_hook, "post": post_hook, "grad": model.embed.weight.grad.clone()}


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_post_accumulate_hook_fires_once_for_a_tied_weight(recompute):
    counts = hook_counts(recompute)
    # One AccumulateGrad node per leaf: the engine sums the input-side and output-side contributions
    # before it runs, so both kinds of hook fire once per backward, with the total.
    assert len(counts["post"]) == 1
    torch.testing.assert_close(counts["post"][0], counts["grad"], rtol=0, atol=0)
    assert len(counts["tensor"]) == 1
    torch.testing.assert_close(counts["tensor"][0], counts["grad"], rtol=0, atol=0)


def mechanics() -> dict:
    """One rank's view of DataParallel: views, launch times, bytes, errors."""
    with comm.counting() as counter:
        return _mechanics(counter)


def _mechanics(counter: CommCounter) -> dict:
    torch.manual_seed(0)
    model = Llama(SMALL)
    dp = DataParallel(model, dist.group.WORLD, bucket_mb=0.05)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {"buckets": len(dp.buckets), "grad_bytes": dp.grad_bytes, "rank": dist.get_rank(),
           "broadcast": counter.bytes["broadcast"]}
    counter.reset()

    def in_buffer(p):
        bucket = dp.bucket_of[p]
        start = bucket.buffer.data_ptr()
        return start <= p.grad.data_ptr() < start + bucket.nbytes

    out["views_at_start"] = all(in_buffer(p) for p in model.parameters())
    with pytest.raises(RuntimeError, match="no gradient arrived since the last finish_gradient_sync"):
        dp.finish_gradient_sync()
    for overlap in (True, False):
        dp.overlap = overlap
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        backward_done = time.perf_counter()
        out[f"launched_in_backward_{overlap}"] = sum(b.work is not None for b in dp.buckets)
        out[f"before_end_{overlap}"] = all(b.launched_at < backward_done for b in dp.buckets)
        dp.finish_gradient_sync()
        out[f"views_{overlap}"] = all(in_buffer(p) for p in model.parameters())
        model.zero_grad()  # set_to_none: the next backward allocates fresh grads
        out["first_bucket_holds_last_param"] = dp.buckets[0].params[0] is list(model.parameters())[-1]
    out["all_reduce"] = counter.snapshot()["all_reduce"]
    with dp.no_sync():
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    with pytest.raises(RuntimeError, match="outside no_sync"):
        dp.finish_gradient_sync()
    return out


def test_grads_are_bucket_views_launched_during_backward():
    for out in run(mechanics, 2, timeout=60):
        assert out["views_at_start"] and out["views_True"] and out["views_False"]
        assert out["first_bucket_holds_last_param"]  # reverse order: the first bucket fills first
        assert out["launched_in_backward_True"] == out["buckets"] and out["before_end_True"]
        assert out["launched_in_backward_False"] == 0  # without overlap nothing starts before finish
        # Bytes: rank 0's broadcast and each step's all-reduce carry exactly the model's fp32 size.
        assert out["grad_bytes"] == PARAM_BYTES and out["broadcast"] == (PARAM_BYTES if out["rank"] == 0 else 0)
        assert out["all_reduce"] == (2 * out["buckets"], 2 * PARAM_BYTES)


def unused_parameter():
    torch.manual_seed(0)
    model = Llama(SMALL)
    dp = DataParallel(model, dist.group.WORLD, bucket_mb=25)
    model.norm.weight.requires_grad_(False)  # too late for DataParallel, which expects a gradient for it
    tokens = torch.randint(0, 256, (2, 17))
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    dp.finish_gradient_sync()


def test_missing_gradient_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"bucket 0 of 1 has \d+ of \d+ gradients ready \(missing: norm.weight\)"):
        run(unused_parameter, 2, timeout=60)


def test_assign_buckets():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (5, 3, 8, 1, 4)]
    sizes = lambda buckets: [[p.numel() for p in b] for b in buckets]
    assert sizes(assign_buckets(params, 0)) == [[5], [3], [8], [1], [4]]
    assert sizes(assign_buckets(params, 6)) == [[5, 3], [8], [1, 4]]   # closes once >= 6; never splits the 8
    assert sizes(assign_buckets(params, 100)) == [[5, 3, 8, 1, 4]]
    mixed = params[:2] + [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert sizes(assign_buckets(mixed, 100)) == [[5, 3], [2]]           # one dtype per buffer


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_mb=-1 must be >= 0"):
        DataParallel(Llama(SMALL), None, bucket_mb=-1)

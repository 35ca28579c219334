"""picotron.parallel.zero: every stage equals one process, plain DP and (stage 3) torch FSDP2;
its bytes per rank and its communication per step equal the formulas to the byte.

The main launch trains 20 steps on 4 ranks with each variant (plain DataParallel, stages 0-3,
stage 2 with many buckets, stage 3 without prefetch and with full recomputation, gradient
accumulation at stages 1-3, FSDP2, HSDP as 2 replicas x 2 shards at stages 1-3, ZeRO-3 and HSDP
computing in bf16) and compares every step's loss and gradients, and the final weights, with one process
training on the same global batch (for bf16 compute, one process running the same recipe), in lockstep
(picotron.lockstep), on every rank. The model has an odd hidden size, so no flat group divides evenly by 2
or 4 and the padding is exercised everywhere.
HSDP's and the compute dtype's bytes and errors: tests/test_hsdp.py.
"""

import copy
import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from picotron import comm, lockstep
from picotron.config import ModelConfig, TrainConfig
from picotron_course.checks import one_thread
from picotron.data import DataLoader, TokenDataset, build_dataset
from picotron.launch import run
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import DataParallel
from picotron.parallel.hsdp import hsdp_groups
from picotron.parallel.zero import ZeroOptimizer, ring_bytes, zero_comm_bytes, zero_state_bytes
from picotron.parallel.zero3 import Zero3, llama_units
from picotron.tolerance import ADAM_WEIGHTS_ATOL, LOSS_ATOL, compare, compare_all, llama_roundings

# Odd sizes: 33 hidden, 65 MLP, head_dim 8. Units of 8481 (embedding + final norm) and 8085 (a layer).
ODD = ModelConfig(hidden_size=33, intermediate_size=65, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, max_seq_len=32)
DP, STEPS, MICRO_BATCH, SEQ = 4, 20, 2, 32


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


@functools.cache
def dataset() -> TokenDataset:
    """Built once; run() sends it to the ranks with the function that uses it."""
    return build_dataset(TrainConfig(seq_len=SEQ))


def test_the_model_needs_padding():
    units = llama_units(Llama(ODD))              # tied head: embedding, final norm and head are one unit
    numels = [sum(p.numel() for p in dict.fromkeys(p for m in unit for p in m.parameters())) for unit in units]
    assert numels == [8481, 8085, 8085] and all(n % 2 and n % 4 for n in numels)


# ---- 20 steps, every variant, 4 ranks vs 1 process ----------------------------------------------
# name: (kind, ZeRO stage, micro-batches per step, extra options)
VARIANTS = {
    "DataParallel": ("dp", None, 1, {}),
    "stage 0": ("zero", 0, 1, {}),
    "stage 1": ("zero", 1, 1, {}),
    "stage 2": ("zero", 2, 1, {}),
    "stage 2, 0.01 MiB buckets": ("zero", 2, 1, {"bucket_mb": 0.01}),
    "stage 3": ("zero3", 3, 1, {"prefetch": True}),
    "stage 3, no prefetch": ("zero3", 3, 1, {"prefetch": False}),
    "stage 3, full recompute": ("zero3", 3, 1, {"prefetch": True, "recompute": "full"}),
    "stage 1, accumulation": ("zero", 1, 2, {}),
    "stage 2, accumulation": ("zero", 2, 2, {"bucket_mb": 0.01}),
    "stage 3, accumulation": ("zero3", 3, 2, {"prefetch": True}),
    "FSDP2": ("fsdp", 3, 1, {}),
    # HSDP: shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}
    "HSDP 2x2, stage 1": ("zero", 1, 1, {"shard": 2}),
    "HSDP 2x2, stage 2": ("zero", 2, 1, {"shard": 2, "bucket_mb": 0.01}),
    "HSDP 2x2, stage 3": ("zero3", 3, 1, {"shard": 2, "prefetch": True}),
    "HSDP 2x2, stage 3, accumulation": ("zero3", 3, 2, {"shard": 2, "prefetch": True}),
    # fp32 masters, bf16 gathers and compute, fp32 reductions; against one process doing the same
    "stage 3, bf16 compute": ("zero3", 3, 1, {"prefetch": True, "compute_dtype": torch.bfloat16}),
    "HSDP 2x2, stage 3, bf16 compute": ("zero3", 3, 1, {"shard": 2, "prefetch": True,
                                                         "compute_dtype": torch.bfloat16}),
}


def reference_key(variant: tuple) -> tuple:
    """Which one-process run a variant is compared with: (micro-batches per step, compute dtype)."""
    return variant[2], variant[3].get("compute_dtype")


class OneProcessComputeDtype:
    """ZeRO-3 with a compute dtype, on one process: the same recipe with nothing sharded.

    fp32 master weights, stepped by AdamW; a copy of them in the compute dtype that forward and
    backward run in; each dp rank's share of the batch its own backward (as on the ranks), its
    gradient cast to fp32, divided by the ranks and added up in fp32 (what the reduce-scatter adds).
    The same methods as the ZeRO objects, so that train_variant drives it like them.
    """

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.master, self.model = master, copy.deepcopy(master).to(dtype)   # tied weights stay tied
        self.optimizer = adamw(master.parameters())

    def zero_grad(self):
        for p in self.master.parameters():
            p.grad = torch.zeros_like(p)

    def accumulate(self, ranks: int):
        """Add the compute copy's fresh gradient, in fp32, / ranks, into the masters' gradient."""
        for p, q in zip(self.master.parameters(), self.model.parameters()):
            p.grad += q.grad.float() / ranks
            q.grad = None

    def finish_gradient_sync(self):
        pass

    def gather_gradients(self) -> dict:
        return {n: p.grad.clone() for n, p in self.master.named_parameters()}

    def gather_parameters(self) -> dict:
        return {n: p.detach().clone() for n, p in self.master.named_parameters()}

    @torch.no_grad()
    def step(self):
        self.optimizer.step()
        for p, q in zip(self.master.parameters(), self.model.parameters()):
            q.copy_(p)                                   # round the masters into the compute copy


def build(kind: str, stage, options: dict):
    """The model and the object that steps it, for one variant, on this rank (or one process)."""
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(ODD, recompute=options.get("recompute", "none")))
    compute_dtype = options.get("compute_dtype")
    if kind == "local" and compute_dtype is not None:
        reference = OneProcessComputeDtype(model, compute_dtype)
        return reference.model, reference
    group, replicate_group = hsdp_groups(options["shard"]) if "shard" in options else (None, None)
    if kind == "zero":
        return model, ZeroOptimizer(model, group, stage=stage, optimizer=adamw, bucket_mb=options.get("bucket_mb", 25),
                                    replicate_group=replicate_group)
    if kind == "zero3":
        return model, Zero3(model, group, prefetch=options["prefetch"], optimizer=adamw, compute_dtype=compute_dtype,
                            replicate_group=replicate_group)
    if kind == "dp":
        return model, DataParallel(model, dist.group.WORLD, bucket_mb=25)
    if kind == "fsdp":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, None


def train_variant(variant: tuple, reference: lockstep.Trace | None = None) -> tuple:
    """STEPS steps of AdamW, recorded by picotron.lockstep: one process (no `reference`) gives its Trace; a rank
    gives its Lockstep against `reference`: every step's global loss and gathered gradients (the first step's, from
    equal weights, against the rounding of the fp32 sum over the ranks), the final weights. Beside it, what is
    measured, not proven: the weights at the end (the replicas are compared with each other, variants with each
    other), the seconds of each step and ZeRO-3's peak of gathered bytes."""
    kind, stage, accum, options = variant
    dp_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, stepper = build(kind, stage, options)
    # One process in a compute dtype runs each rank's share of the batch as a backward of its own.
    pieces = DP if isinstance(stepper, OneProcessComputeDtype) else 1
    kind = "zero" if pieces > 1 else kind                  # it has the ZeRO objects' methods
    optimizer = stepper if kind.startswith("zero") else adamw(model.parameters())
    loader = DataLoader(dataset(), MICRO_BATCH * DP // dp_size, dp_rank=rank, dp_size=dp_size)
    record = lockstep.Recorder(reference, first_step_n=dp_size, grads=kind != "fsdp")   # FSDP2's stay sharded
    seconds = []
    for step in range(STEPS):
        start = time.perf_counter()
        optimizer.zero_grad()
        step_loss = torch.zeros(())
        for micro in range(accum):   # ZeRO needs nothing for accumulation (DataParallel runs accum=1 here)
            batch = loader.get_batch(step, micro)
            for ids, targets in zip(batch.input_ids.chunk(pieces), batch.targets.chunk(pieces)):
                loss = loss_fn(model(ids), targets) / accum
                loss.backward()
                step_loss += loss.detach() / pieces
                if pieces > 1:
                    stepper.accumulate(pieces)
        if kind in ("zero", "zero3", "dp"):
            stepper.finish_gradient_sync()
        elapsed = time.perf_counter() - start
        # For the comparison only, not timed: the full gradients (FSDP2 keeps them sharded) and the global loss.
        grads = stepper.gather_gradients() if kind.startswith("zero") else \
            {n: p.grad for n, p in model.named_parameters()} if kind in ("local", "dp") else None
        if dist.is_initialized():
            dist.all_reduce(step_loss)
            step_loss /= dp_size
        record.step(step_loss, grads)
        start = time.perf_counter()
        optimizer.step()
        seconds.append(elapsed + time.perf_counter() - start)
    if kind.startswith("zero"):
        weights = stepper.gather_parameters()
    elif kind == "fsdp":
        weights = {n: p.full_tensor() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    measured = {"weights": weights, "seconds": seconds,
                "peak_gathered_bytes": stepper.peak_gathered_bytes if kind == "zero3" else None}
    return record.finish(weights), measured


def all_variants(references: dict) -> dict:
    return {name: train_variant(v, references[reference_key(v)]) for name, v in VARIANTS.items()}


def as_trace(result: tuple) -> lockstep.Trace:
    """A rank's run of one variant as a Trace, its losses and final weights: to compare two variants."""
    proof, measured = result
    return lockstep.Trace(loss=proof.loss, weights=measured["weights"])


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The single-process runs, by reference_key; one thread, like each rank."""
    with one_thread():   # like each rank
        return {(accum, dtype): train_variant(("local", None, accum, {"compute_dtype": dtype} if dtype else {}))[0]
                for accum, dtype in sorted({reference_key(v) for v in VARIANTS.values()}, key=str)}


@pytest.fixture(scope="module")
def four_ranks(one_process) -> list[dict]:
    return run(all_variants, DP, args=(one_process,), timeout=300)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_equals_one_process(name, four_ranks, one_process):
    reference = one_process[reference_key(VARIANTS[name])]
    results, measured = zip(*[rank[name] for rank in four_ranks])
    for rank, result in enumerate(results):   # every rank: the losses and gradients of every step, the weights
        result.assert_equal(f"rank {rank}, {name}")
        assert len(result.loss) == STEPS and result.weights_close is not None, name   # all of them compared
        if VARIANTS[name][0] != "fsdp":   # FSDP2 keeps sharded gradients: its losses and weights are compared
            assert None not in result.grads_close and result.first_step is not None, name
    for m in measured:   # replicas identical
        for n, weight in m["weights"].items():
            torch.testing.assert_close(weight, measured[0]["weights"][n], rtol=0, atol=0, msg=f"{name} {n}")
    assert reference.loss[-1] < reference.loss[0] - 0.5  # and it learned something


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items()
                                  if v[2] == 1 and n != "DataParallel" and "compute_dtype" not in v[3]])
def test_equals_plain_data_parallel(name, four_ranks):
    """Losses within LOSS_ATOL every step, weights within ADAM_WEIGHTS_ATOL after them (picotron.lockstep)."""
    result = lockstep.compare(as_trace(four_ranks[0][name]), as_trace(four_ranks[0]["DataParallel"]))
    assert result.ok and result.weights_close is not None, result.failures()


def test_stage_3_equals_fsdp2(four_ranks):
    result = lockstep.compare(as_trace(four_ranks[0]["stage 3"]), as_trace(four_ranks[0]["FSDP2"]))
    assert result.ok and result.weights_close is not None, result.failures()


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if "compute_dtype" in v[3]])
def test_compute_dtype_computes_in_bf16(name, four_ranks, one_process):
    """The bf16 recipe is what the ranks ran: their losses agree with its one-process run (above) and differ
    from the fp32 one's by bf16 roundings, far more than two fp32 runs may (LOSS_ATOL)."""
    against_fp32 = lockstep.compare(as_trace(four_ranks[0][name]), one_process[1, None])
    assert max(against_fp32.loss_diff) > 10 * LOSS_ATOL
    assert against_fp32.weight_diff > 10 * ADAM_WEIGHTS_ATOL
    # bf16 gathers: half the bytes of the fp32 units held at once (the tied outer unit and two layers)
    padded = 8484 + 2 * 8088 if name.startswith("stage") else 8482 + 2 * 8086
    assert four_ranks[0][name][1]["peak_gathered_bytes"] == 2 * padded


def test_prefetch_holds_one_more_unit(four_ranks):
    """Gathered at once, in fp32: the tied embedding's unit (from its first use in forward to its
    last in backward) and the current layer; with prefetch, the next layer too."""
    padded = {"outer": 4 * 8484, "layer": 4 * 8088}   # 8481 and 8085 rounded up to a multiple of 4
    measured = {name: four_ranks[0][name][1] for name in ("stage 3", "stage 3, no prefetch")}
    assert measured["stage 3, no prefetch"]["peak_gathered_bytes"] == padded["outer"] + padded["layer"]
    assert measured["stage 3"]["peak_gathered_bytes"] == padded["outer"] + 2 * padded["layer"]


# ---- bytes and communication, against the formulas ---------------------------------------------
def state_and_comm(precisions=("fp32", "bf16-mixed"), micro_batches=(1, 2)) -> dict:
    """For each stage and precision: state bytes after a step, and the payload counted per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(rank))
    out = {}
    for precision in precisions:
        for stage in range(4):
            torch.manual_seed(0)
            model = Llama(ODD).to(torch.bfloat16 if precision == "bf16-mixed" else torch.float32)
            zero = (Zero3(model, optimizer=adamw) if stage == 3 else
                    ZeroOptimizer(model, stage=stage, optimizer=adamw))
            for k in micro_batches:
                with comm.counting() as counter:       # the step's collectives only
                    zero.zero_grad()
                    for _ in range(k):
                        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                    zero.step()
                out[precision, stage, "comm", k] = counter.snapshot()
            out[precision, stage, "bytes"] = zero.state_bytes()
            out[precision, stage, "numels"] = zero.numels
            out[precision, stage, "master"] = zero.groups[0].master.dtype
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run(state_and_comm, 2, timeout=120)


@pytest.fixture(scope="module")
def four_ranks_bytes() -> list[dict]:
    return run(state_and_comm, 4, timeout=120)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_equal_the_formula(world, precision, stage, two_ranks, four_ranks_bytes):
    ranks = two_ranks if world == 2 else four_ranks_bytes
    for rank in ranks:
        numels = rank[precision, stage, "numels"]
        assert rank[precision, stage, "bytes"] == zero_state_bytes(numels, world, stage, precision)
        assert rank[precision, stage, "master"] == torch.float32
    # The Playbook's pattern, up to padding (< N elements per group) and the step counters:
    psi = sum(ranks[0]["fp32", 0, "numels"])
    p, g, o = (2, 2, 12) if precision == "bf16-mixed" else (4, 4, 8)
    n = world
    playbook = {0: (p * psi, g * psi, o * psi), 1: (p * psi, g * psi, o * psi / n),
                2: (p * psi, g * psi / n, o * psi / n), 3: (p * psi / n, g * psi / n, o * psi / n)}[stage]
    measured = ranks[0][precision, stage, "bytes"]
    groups = len(ranks[0][precision, stage, "numels"])
    for got, want, per_element in zip((measured.parameters, measured.gradients, measured.optimizer), playbook, (p, g, o)):
        assert 0 <= got - want < per_element * groups + 4 * groups


def test_stage_3_state_is_a_quarter_of_plain_dp(four_ranks_bytes):
    whole = four_ranks_bytes[0]["fp32", 0, "bytes"].total
    sharded = four_ranks_bytes[0]["fp32", 3, "bytes"].total
    assert sharded / whole == pytest.approx(1 / 4, rel=1e-3)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_counted_communication_equals_the_formula(world, precision, stage, micro_batches, two_ranks,
                                                  four_ranks_bytes):
    ranks = two_ranks if world == 2 else four_ranks_bytes
    for rank in ranks:
        numels = rank[precision, stage, "numels"]
        counted = {op: nbytes for op, (calls, nbytes) in rank[precision, stage, "comm", micro_batches].items()}
        assert counted == zero_comm_bytes(numels, world, stage, precision, micro_batches)
        calls = {op: c for op, (c, nbytes) in rank[precision, stage, "comm", micro_batches].items()}
        groups = len(numels)
        expected_calls = {0: {"all_reduce": groups}, 1: {"reduce_scatter": groups, "all_gather": groups},
                          2: {"reduce_scatter": micro_batches * groups, "all_gather": groups},
                          3: {"reduce_scatter": micro_batches * groups, "all_gather": 2 * micro_batches * groups}}
        assert calls == expected_calls[stage]


def test_ring_traffic_is_the_playbooks_2_2_2_3_psi(four_ranks_bytes):
    """On the wire, in units of (N-1)/N x 4 bytes x padded parameters: 2, 2, 2 and 3 (fp32)."""
    world = 4
    for stage, expected in zip(range(4), (2, 2, 2, 3)):
        numels = four_ranks_bytes[0]["fp32", stage, "numels"]
        padded = sum(-(-n // world) * world for n in numels) if stage else sum(numels)
        wire = ring_bytes(zero_comm_bytes(numels, world, stage), world)
        assert wire / ((world - 1) / world * 4 * padded) == pytest.approx(expected)


# ---- mixed precision: a few steps are sane --------------------------------------------------------
def bf16_steps() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = DataLoader(dataset(), 2, dp_rank=rank, dp_size=world)
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        torch.manual_seed(0)
        model = Llama(ODD).to(torch.bfloat16 if precision == "bf16-mixed" else torch.float32)
        zero = Zero3(model, optimizer=adamw)
        losses = []
        for step in range(4):
            zero.zero_grad()
            batch = loader.get_batch(step)
            loss = loss_fn(model(batch.input_ids), batch.targets)
            loss.backward()
            zero.step()
            loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
        out[precision] = losses
        out[precision, "dtypes"] = (zero.groups[0].shard.dtype, zero.groups[0].master.dtype,
                                    zero.groups[0].grad.dtype)
    return out


def test_bf16_mixed_trains_like_fp32():
    rank0 = run(bf16_steps, 2, timeout=120)[0]
    assert rank0["bf16-mixed", "dtypes"] == (torch.bfloat16, torch.float32, torch.bfloat16)
    for fp32, bf16 in zip(rank0["fp32"], rank0["bf16-mixed"]):
        assert abs(fp32 - bf16) < 0.05        # bf16 keeps about 3 significant digits
    assert rank0["bf16-mixed"][-1] < rank0["bf16-mixed"][0]


# ---- mechanics and errors -------------------------------------------------------------------------
def mechanics() -> dict:
    out = {}
    torch.manual_seed(0)
    model = Llama(ODD)
    zero = Zero3(model, optimizer=adamw)
    tokens = torch.randint(0, 256, (2, 9))
    out["freed"] = [p.numel() for p in model.parameters()]
    with torch.no_grad():                                   # evaluation gathers and frees too
        out["eval"] = model(tokens[:, :-1]).shape
    out["freed after eval"] = [p.numel() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="unit 0 of 3 got no gradient since the last step"):
        zero.step()
    with pytest.raises(RuntimeError, match="call finish_gradient_sync"):
        zero.gather_gradients()
    # A parameter left out of the loss: its unit never completes.
    model = Llama(ODD)
    zero = ZeroOptimizer(model, stage=2, optimizer=adamw)
    model.layers[1].mlp_norm.weight.requires_grad_(False)
    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    with pytest.raises(RuntimeError, match=r"bucket 0 of 1 has \d+ of \d+ gradients \(missing: layers.1.mlp_norm"):
        zero.finish_gradient_sync()
    model = Llama(ODD)
    with pytest.raises(ValueError, match="embed.weight is in units 0 and 1"):
        Zero3(model, units=[[model.embed], [model.lm_head], *[[m] for m in model.layers], [model.norm]])
    with pytest.raises(ValueError, match=r"parameters \['norm.weight'\] are in no unit"):
        Zero3(model, units=[[model.embed], *[[m] for m in model.layers]])
    with pytest.raises(ValueError, match="not picotron's Llama"):
        Zero3(torch.nn.Linear(3, 3))
    # A group this rank is not in: every rank must create it; rank 1 then passes rank 0's.
    only_rank_0 = dist.new_group([0])
    if dist.get_rank() == 1:
        with pytest.raises(ValueError, match="global rank 1 is not a member of the process group"):
            ZeroOptimizer(Llama(ODD), only_rank_0, stage=1)
    return out


def clipping() -> dict:
    """clip_grad_norm_ from the shards against torch's on one process with the whole batch."""
    rank = dist.get_rank()
    tokens = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(7))   # the global batch
    torch.manual_seed(0)
    reference = Llama(ODD)
    loss_fn(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    errors = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = Llama(ODD)
        zero = Zero3(model, optimizer=adamw) if stage == 3 else ZeroOptimizer(model, stage=stage, optimizer=adamw)
        mine = tokens[2 * rank:2 * rank + 2]
        loss_fn(model(mine[:, :-1]), mine[:, 1:]).backward()
        norm = zero.clip_grad_norm_(0.05)
        grads = zero.gather_gradients()
        # Roundings (picotron.tolerance): the model's forward and backward on 4 x 8 tokens, then the norm's
        # sum of squares over every parameter.
        n = llama_roundings(ODD, 8, 4 * 8) + ODD.num_params()
        errors[stage] = (compare(norm, expected_norm, n=n), compare_all(grads, expected, n=n))
    return {"errors": errors, "norm": expected_norm.item()}


def test_mechanics_and_clear_errors():
    for out in run(mechanics, 2, timeout=60):
        assert all(n == 0 for n in out["freed"]) and all(n == 0 for n in out["freed after eval"])
        assert out["eval"] == (2, 8, 256)


def test_clip_grad_norm_equals_torch_on_one_process():
    for out in run(clipping, 2, timeout=60):
        assert out["norm"] > 0.5                          # far above max_norm: the clipping really scales
        for stage, (norm, grads) in out["errors"].items():
            assert norm and grads, (stage, str(norm), str(grads))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"stage=5; choose 0 \(plain data parallelism\)"):
        ZeroOptimizer(Llama(ODD), stage=5)
    with pytest.raises(ValueError, match="use Zero3"):
        ZeroOptimizer(Llama(ODD), stage=3)
    with pytest.raises(ValueError, match="bucket_mb=-1 must be >= 0"):
        ZeroOptimizer(Llama(ODD), stage=1, bucket_mb=-1)
    with pytest.raises(RuntimeError, match="ZeRO needs a process group"):
        ZeroOptimizer(Llama(ODD), stage=1)
    with pytest.raises(ValueError, match="stage=4; choose 0"):
        zero_state_bytes(100, 4, 4)
    with pytest.raises(ValueError, match="world=0 must be a positive number"):
        zero_comm_bytes(100, 0, 1)
    with pytest.raises(ValueError, match="precision='fp16'"):
        zero_state_bytes(100, 4, 1, "fp16")

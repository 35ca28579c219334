"""HSDP and ZeRO-3 with a compute dtype: bytes per rank and bytes sent per step equal the formulas, to the byte;
bad groups and dtypes are clear errors.

That they train like one process is proven with the other ZeRO variants in tests/test_zero.py (20 steps on
4 ranks: HSDP as 2 replicas x 2 shards at stages 1-3, ZeRO-3 and HSDP computing in bf16). Here, on 4 ranks:
what each collective moves, counted by picotron.comm, against zero_comm_bytes with replicate= and
compute_dtype=, and the state each rank keeps against zero_state_bytes over the shard group.
"""

import pytest
import torch
import torch.distributed as dist

from picotron import comm
from picotron.config import ModelConfig
from picotron.launch import run
from picotron.model import Llama, loss_fn
from picotron.parallel.hsdp import hsdp_groups
from picotron.parallel.zero import ZeroOptimizer, ring_bytes, zero_comm_bytes, zero_state_bytes
from picotron.parallel.zero3 import Zero3

# Odd sizes (as tests/test_zero.py): units of 8481 and 8085 parameters, divisible by neither 2 nor 4.
ODD = ModelConfig(hidden_size=33, intermediate_size=65, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, max_seq_len=32)
WORLD, SHARD = 4, 2
# name: (stage, shard group size, compute dtype)
SETUPS = {
    "HSDP stage 1": (1, SHARD, None),
    "HSDP stage 2": (2, SHARD, None),
    "HSDP stage 3": (3, SHARD, None),
    "stage 3, bf16 compute": (3, WORLD, torch.bfloat16),
    "stage 3, fp16 compute": (3, WORLD, torch.float16),
    "HSDP stage 3, bf16 compute": (3, SHARD, torch.bfloat16),
}


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


def build(stage: int, shard: int, compute_dtype):
    torch.manual_seed(0)
    model = Llama(ODD)
    group, replicate_group = hsdp_groups(shard) if shard < WORLD else (None, None)
    if stage == 3:
        return model, Zero3(model, group, optimizer=adamw, compute_dtype=compute_dtype,
                            replicate_group=replicate_group)
    return model, ZeroOptimizer(model, group, stage=stage, optimizer=adamw, bucket_mb=0.01,
                                replicate_group=replicate_group)


def bytes_and_comm() -> dict:
    """Per setup: what each collective moved in a step of 1 and of 2 micro-batches, and the state kept after."""
    rank = dist.get_rank()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, setup in SETUPS.items():
        model, zero = build(*setup)
        for k in (1, 2):
            with comm.counting() as counter:
                zero.zero_grad()
                for _ in range(k):
                    loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                zero.step()
            out[name, k] = counter.snapshot()
        out[name, "bytes"], out[name, "numels"] = zero.state_bytes(), zero.numels
        out[name, "dtypes"] = (zero.groups[0].shard.dtype, zero.groups[0].grad.dtype, zero.groups[0].full.dtype)
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run(bytes_and_comm, WORLD, timeout=180)


@pytest.mark.parametrize("micro_batches", [1, 2])
@pytest.mark.parametrize("name", list(SETUPS))
def test_counted_communication_equals_the_formula(name, micro_batches, four_ranks):
    stage, shard, compute_dtype = SETUPS[name]
    for rank in four_ranks:
        numels = rank[name, "numels"]
        counted = {op: nbytes for op, (calls, nbytes) in rank[name, micro_batches].items()}
        assert counted == zero_comm_bytes(numels, shard, stage, micro_batches=micro_batches,
                                          replicate=WORLD // shard, compute_dtype=compute_dtype)
        reductions = len(numels) * (1 if stage == 1 else micro_batches)
        calls = {op: c for op, (c, nbytes) in rank[name, micro_batches].items()}
        assert calls.get("all_reduce", 0) == (reductions if shard < WORLD else 0)   # HSDP: one per reduced shard


@pytest.mark.parametrize("name", [n for n, s in SETUPS.items() if s[2] is not None])
def test_compute_dtype_gathers_half_and_reduces_in_fp32(name, four_ranks):
    """Measured: the all-gathers move 2 bytes a parameter and the reduce-scatters 4, so neither an fp32
    gather (the fp32 formula's all_gather) nor a 16-bit reduction (half its reduce_scatter) matches."""
    stage, shard, compute_dtype = SETUPS[name]
    rank = four_ranks[0]
    counted = {op: nbytes for op, (calls, nbytes) in rank[name, 1].items()}
    fp32 = zero_comm_bytes(rank[name, "numels"], shard, stage, replicate=WORLD // shard)
    assert 2 * counted["all_gather"] == fp32["all_gather"]
    assert counted["reduce_scatter"] == fp32["reduce_scatter"]
    assert rank[name, "dtypes"] == (torch.float32, torch.float32, compute_dtype)   # shard (master), grad, gathered


@pytest.mark.parametrize("name", list(SETUPS))
def test_state_bytes_are_zero_over_the_shard_group(name, four_ranks):
    """Each rank keeps ZeRO's state over its s-rank shard group (fp32, whatever the compute dtype): the r
    replicas hold the same shards, so HSDP 2x2 keeps twice the sharded state of ZeRO over 4."""
    stage, shard, _ = SETUPS[name]
    for rank in four_ranks:
        numels = rank[name, "numels"]
        assert rank[name, "bytes"] == zero_state_bytes(numels, shard, stage)
    if shard < WORLD:
        over_all = zero_state_bytes(four_ranks[0][name, "numels"], WORLD, stage)
        assert four_ranks[0][name, "bytes"].optimizer > 1.9 * over_all.optimizer


def test_ring_traffic_of_hsdp():
    """On the wire per rank, fp32 ZeRO-3, Psi' padded parameters, s = 2 shards, r = 2 replicas: the
    reduce-scatter and the two all-gathers over s, (s-1)/s x 4 x 3 Psi', plus the all-reduce of a 1/s shard
    over r, 2 (r-1)/r x 4 Psi'/s."""
    numels, s, r = [8481, 8085, 8085], SHARD, WORLD // SHARD
    padded = sum(-(-n // s) * s for n in numels)
    wire = ring_bytes(zero_comm_bytes(numels, s, 3, replicate=r), s, replicate=r)
    assert wire == pytest.approx((s - 1) / s * 4 * 3 * padded + 2 * (r - 1) / r * 4 * padded / s)
    bf16 = ring_bytes(zero_comm_bytes(numels, s, 3, replicate=r, compute_dtype=torch.bfloat16), s, replicate=r)
    assert wire - bf16 == pytest.approx((s - 1) / s * 2 * 2 * padded)   # the gathers' bytes halve


# ---- errors ---------------------------------------------------------------------------------------
def bad_groups() -> dict:
    with pytest.raises(ValueError, match=r"shard_size=3 does not divide the 4 data-parallel ranks"):
        hsdp_groups(3)
    shard, replicate = hsdp_groups(2)
    with pytest.raises(ValueError, match=r"share ranks \[0, 1\]|share ranks \[2, 3\]"):
        Zero3(Llama(ODD), shard, replicate_group=shard)
    with pytest.raises(ValueError, match="replicate_group with stage=0: stage 0 shards nothing"):
        ZeroOptimizer(Llama(ODD), shard, stage=0, replicate_group=replicate)
    # Replicate groups {0, 3} and {1, 2} join shard 0 of one group with shard 1 of the other: every rank
    # creates both, then passes its own.
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    mine = crossed[0] if dist.get_rank() in (0, 3) else crossed[1]
    with pytest.raises(ValueError, match=r"replicate_group joins ranks at \(shard, shard group size\) "
                                         r"\[\(0, 2\), \(1, 2\)\]"):
        Zero3(Llama(ODD), shard, replicate_group=mine)
    with pytest.raises(ValueError, match="compute_dtype=torch.bfloat16 needs the model in fp32"):
        Zero3(Llama(ODD).to(torch.bfloat16), compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute_dtype=torch.float32; choose torch.bfloat16 or torch.float16"):
        Zero3(Llama(ODD), compute_dtype=torch.float32)
    return {"ok": True}


def test_bad_groups_and_dtypes_are_clear_errors():
    assert all(out["ok"] for out in run(bad_groups, WORLD, timeout=120))
    with pytest.raises(ValueError, match="compute_dtype with stage=2: only ZeRO-3 gathers"):
        zero_comm_bytes(100, 4, 2, compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="compute_dtype with precision='bf16-mixed'"):
        zero_comm_bytes(100, 4, 3, "bf16-mixed", compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="replicate > 1 with stage=0"):
        zero_comm_bytes(100, 4, 0, replicate=2)
    with pytest.raises(ValueError, match="replicate=0 must be a positive number"):
        zero_comm_bytes(100, 4, 1, replicate=0)

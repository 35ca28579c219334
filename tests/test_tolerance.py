"""The tolerance policy: its bound holds for real reorderings of real sums, with room to spare, and
it is tight enough that real bugs land far outside it.

Other machines are emulated here: every sum is computed in several explicit orders (one term at
a time forwards, backwards, shuffled; pairwise, as a GPU's reduction tree adds; split over 2, 4
and 8 ranks and the partial sums added, as a row-parallel layer does; the library's own blocked
order) and against float64. The measured error is reported in units of sqrt(n) u scale, the
policy's bound being SAFETY = 8 of those units; these tests require every error below 2 of them.
"""

import math

import pytest
import torch

from picotron.config import ModelConfig
from picotron.model import Llama, RMSNorm, loss_fn
from picotron.tolerance import (ADAM_WEIGHTS_ATOL, LOSS_ATOL, SAFETY, TRAINING_GRAD_TOL, assert_close, close_enough,
                                compare, compare_all, llama_roundings, relative_bound, tolerance, unit_roundoff)

MARGIN = 4          # the errors measured below stay under bound / MARGIN


def sequential_sum(terms: torch.Tensor, order) -> torch.Tensor:
    """Sum each row of `terms` (rows, n) one term at a time, in `order`, rounding in terms.dtype each time."""
    total = torch.zeros(terms.shape[0], dtype=terms.dtype)
    for k in order:
        total = total + terms[:, k]
    return total


def pairwise_sum(terms: torch.Tensor) -> torch.Tensor:
    """Sum each row as a binary tree: neighbours first, then neighbours of the sums (a GPU reduction)."""
    while terms.shape[1] > 1:
        if terms.shape[1] % 2:
            terms = torch.cat([terms, torch.zeros_like(terms[:, :1])], dim=1)
        terms = terms[:, 0::2] + terms[:, 1::2]
    return terms[:, 0]


def in_units(error: float, n: int, dtype: torch.dtype, scale: float, tf32: bool = False) -> float:
    """An error in units of sqrt(n) u scale: the bound is SAFETY of them."""
    return error / (math.sqrt(n) * unit_roundoff(dtype, tf32=tf32) * scale)


def worst_pair(results: list[torch.Tensor], exact: torch.Tensor, n: int, dtype: torch.dtype) -> float:
    """The largest difference, in units, between any two results or any result and the exact sum;
    every pair is also checked by the policy itself."""
    scale = exact.abs().max().item()
    worst = 0.0
    for i, a in enumerate(results):
        for b in [exact, *results[i + 1:]]:
            assert close_enough(a, b, n=n, dtype=dtype, scale=scale)
            worst = max(worst, in_units((a.double() - b.double()).abs().max().item(), n, dtype, scale))
    return worst


# ---- the formats ------------------------------------------------------------------------------------------
def test_unit_roundoff_of_each_format():
    assert unit_roundoff(torch.float64) == 2.0 ** -53
    assert unit_roundoff(torch.float32) == 2.0 ** -24 == torch.finfo(torch.float32).eps / 2
    assert unit_roundoff(torch.bfloat16) == 2.0 ** -8 == torch.finfo(torch.bfloat16).eps / 2
    assert unit_roundoff(torch.float16) == 2.0 ** -11 == torch.finfo(torch.float16).eps / 2
    assert unit_roundoff(torch.int64) == 0.0 and unit_roundoff(torch.bool) == 0.0
    assert unit_roundoff(torch.float32, tf32=True) == 2.0 ** -11          # a compiled fp32 tl.dot
    assert unit_roundoff(torch.bfloat16, tf32=True) == 2.0 ** -8          # TF32 concerns fp32 only
    with pytest.raises(ValueError, match="float8"):
        unit_roundoff(torch.float8_e4m3fn)


def test_tf32_follows_torch_settings_on_cuda_only():
    """fp32 matmuls run in TF32 on a CUDA device once torch allows it; never on the CPU. (Only reads the
    settings: no GPU needed.)"""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert unit_roundoff(torch.float32, device="cuda") == 2.0 ** -24
        torch.set_float32_matmul_precision("high")
        assert unit_roundoff(torch.float32, device="cuda") == 2.0 ** -11
        assert unit_roundoff(torch.float32, device="cuda", tf32=False) == 2.0 ** -24   # a sum: no matmul
        assert unit_roundoff(torch.float32, device="cpu") == 2.0 ** -24
        assert "TF32" in str(compare(torch.ones(2), torch.ones(2), n=4, device="cuda"))
    finally:
        torch.set_float32_matmul_precision(before)


def test_bound_and_torch_testing_agree():
    assert relative_bound(16) == SAFETY * 4 * 2.0 ** -24
    rtol, atol = tolerance(torch.float32, n=16, scale=3.0)
    assert rtol == 0.0 and atol == relative_bound(16) * 3.0
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ w.double()
    torch.testing.assert_close(x @ w, exact.float(), **dict(zip(("rtol", "atol"),
                                                                tolerance(n=16, scale=exact.abs().max().item()))))
    with pytest.raises(ValueError, match="whole number >= 1"):
        relative_bound(0)


def test_the_course_claims_are_the_design_numbers():
    assert LOSS_ATOL == TRAINING_GRAD_TOL == 1e-5 and ADAM_WEIGHTS_ATOL == 1e-4


# ---- the bound holds, with margin, for reorderings ---------------------------------------------------------
@pytest.mark.parametrize("n", [16, 256, 4096, 16384])
@pytest.mark.parametrize("signs", ["random signs", "positive"])
def test_fp32_sums_in_any_order_stay_inside(n, signs):
    generator = torch.Generator().manual_seed(n)
    terms = torch.randn(64, n, generator=generator)                          # 64 sums of n terms
    if signs == "positive":
        terms = terms.abs()
    shuffled = torch.randperm(n, generator=generator).tolist()
    results = [sequential_sum(terms, range(n)), sequential_sum(terms, reversed(range(n))),
               sequential_sum(terms, shuffled), pairwise_sum(terms), terms.sum(dim=1)]
    worst = worst_pair(results, terms.double().sum(dim=1), n, torch.float32)
    assert worst < SAFETY / MARGIN, f"{worst:.2f} sqrt(n) u scale"


@pytest.mark.parametrize("n", [16, 64, 256])
def test_bf16_sums_in_any_order_stay_inside(n):
    """Summed in bf16 arithmetic (u = 2^-8, every addition rounded to bf16)."""
    generator = torch.Generator().manual_seed(n)
    terms = torch.randn(64, n, generator=generator).to(torch.bfloat16)
    shuffled = torch.randperm(n, generator=generator).tolist()
    results = [sequential_sum(terms, range(n)), sequential_sum(terms, reversed(range(n))),
               sequential_sum(terms, shuffled), pairwise_sum(terms)]
    worst = worst_pair(results, terms.double().sum(dim=1), n, torch.bfloat16)
    assert worst < SAFETY / MARGIN, f"{worst:.2f} sqrt(n) u scale"


def row_parallel(x: torch.Tensor, w: torch.Tensor, tp: int, reverse: bool = False) -> torch.Tensor:
    """x @ w as tp ranks compute it: each multiplies its slice of K, then the partial products are summed
    (in x's dtype, as an all-reduce does), from the first rank or from the last."""
    k = x.shape[1] // tp
    partials = [x[:, r * k:(r + 1) * k] @ w[r * k:(r + 1) * k] for r in range(tp)]
    if reverse:
        partials.reverse()
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


@pytest.mark.parametrize("K", [16, 256, 4096, 16384])
def test_fp32_split_matmuls_stay_inside(K):
    generator = torch.Generator().manual_seed(K)
    x = torch.randn(32, K, generator=generator)
    w = torch.randn(K, 48, generator=generator) / math.sqrt(K)
    results = [x @ w] + [row_parallel(x, w, tp, reverse) for tp in (2, 4, 8) for reverse in (False, True)]
    worst = worst_pair(results, x.double() @ w.double(), K, torch.float32)
    assert worst < SAFETY / MARGIN, f"{worst:.2f} sqrt(n) u scale"


@pytest.mark.parametrize("K", [16, 256, 4096, 16384])
def test_bf16_split_matmuls_stay_inside(K):
    """A bf16 matmul accumulates in fp32 and rounds once; split over tp ranks, each partial is rounded and the
    tp - 1 additions of the all-reduce round again: n = tp roundings in bf16, whatever K."""
    generator = torch.Generator().manual_seed(K)
    x = torch.randn(32, K, generator=generator).to(torch.bfloat16)
    w = (torch.randn(K, 48, generator=generator) / math.sqrt(K)).to(torch.bfloat16)
    exact = x.double() @ w.double()
    worst = 0.0
    for tp in (2, 4, 8):
        results = [x @ w, row_parallel(x, w, tp), row_parallel(x, w, tp, reverse=True)]
        worst = max(worst, worst_pair(results, exact, tp, torch.bfloat16))
    assert worst < SAFETY / MARGIN, f"{worst:.2f} sqrt(n) u scale"


def to_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to TF32 (10 stored significand bits), to nearest: what a tensor core does to its inputs."""
    bits = x.view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@pytest.mark.parametrize("K", [64, 4096])
def test_tf32_matmul_stays_inside_the_tf32_bound_and_outside_the_fp32_one(K):
    """A GPU with TF32 matmuls, emulated: inputs rounded to TF32, products summed in fp32. Inside the bound
    with u = 2^-11 (tf32=True); well outside the fp32 one, which is why the policy must know."""
    generator = torch.Generator().manual_seed(K)
    x = torch.randn(32, K, generator=generator)
    w = torch.randn(K, 48, generator=generator) / math.sqrt(K)
    on_tensor_cores, exact = to_tf32(x) @ to_tf32(w), x.double() @ w.double()
    assert close_enough(on_tensor_cores, exact, n=K, tf32=True)
    scale = exact.abs().max().item()
    assert in_units((on_tensor_cores.double() - exact).abs().max().item(), K, torch.float32, scale, tf32=True) < 1
    assert not close_enough(on_tensor_cores, exact, n=K, tf32=False)


# ---- and real bugs land far outside it ---------------------------------------------------------------------
def far_outside(actual, expected, n, dtype=None, factor=10.0) -> bool:
    result = compare(actual, expected, n=n, dtype=dtype)
    return result.error > factor * result.bound


@pytest.mark.parametrize("K", [256, 16384])
def test_a_missing_term_is_caught(K):
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, K, generator=generator), torch.randn(K, 16, generator=generator) / math.sqrt(K)
    assert far_outside(x[:, 1:] @ w[1:], x @ w, n=K)                      # one of K products left out
    assert far_outside(row_parallel(x, w, 4) - x[:, :K // 4] @ w[:K // 4], x @ w, n=K)   # one rank's partial


def test_an_off_by_one_scale_is_caught():
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0))
    assert far_outside(x.sum(dim=1) / 1023, x.mean(dim=1), n=1024)        # divided by n - 1 instead of n


def test_a_wrong_transpose_and_a_wrong_shard_are_caught():
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 64, generator=generator), torch.randn(64, 64, generator=generator)
    assert far_outside(x @ w.T, x @ w, n=64)
    shards = w.chunk(4, dim=1)
    assert far_outside(torch.cat([shards[1], shards[0], *shards[2:]], dim=1), w, n=1)   # two ranks swapped


def test_a_bug_in_bf16_is_caught_too():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=generator).to(torch.bfloat16)
    w = (torch.randn(256, 32, generator=generator) / 16).to(torch.bfloat16)
    assert far_outside(row_parallel(x, w, 4) - x[:, :64] @ w[:64], x @ w, n=4)   # a rank's partial missing
    assert far_outside((x @ w) * 2, x @ w, n=4)                                    # summed where it should average


# ---- what it says ------------------------------------------------------------------------------------------
def test_the_message_says_the_error_the_bound_and_where_it_comes_from():
    expected = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    actual = expected.clone()
    actual[1, 0] += 1e-3
    with pytest.raises(AssertionError) as failure:
        assert_close(actual, expected, n=16, msg="row-parallel output")
    message = str(failure.value)
    for part in ("row-parallel output", "max |actual - expected| = 0.001", "at [1, 0]", "n=16", "u = 2^-24",
                 "float32 on cpu", "scale = 4 (max |expected|)", f"{SAFETY} x sqrt(n=16)"):
        assert part in message, (part, message)
    assert str(assert_close(expected, expected, n=16)).endswith("0 of the bound")


def test_edge_cases():
    assert not close_enough(torch.ones(3), torch.ones(2), n=1)                       # shapes
    assert "shapes differ" in str(compare(torch.ones(3), torch.ones(2), n=1))
    masked = torch.tensor([0.5, float("-inf")])
    assert close_enough(masked, masked.clone(), n=1)                                 # equal infinities
    assert not close_enough(torch.tensor([0.5, float("nan")]), masked, n=1)          # NaN, -inf
    assert not close_enough(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]), n=1)
    assert close_enough(torch.tensor([3]), torch.tensor([3]), n=1)                   # integers: exact
    assert not close_enough(torch.tensor([3]), torch.tensor([4]), n=100)
    assert close_enough(torch.empty(0), torch.empty(0), n=1)
    assert close_enough(torch.zeros(4), torch.zeros(4), n=8)                         # scale 0: exact only
    assert not close_enough(torch.full((4,), 1e-30), torch.zeros(4), n=8)
    assert close_enough(2.0 + 1e-7, 2.0, n=4, dtype=torch.float32)                  # numbers, e.g. loss.item()
    with pytest.raises(ValueError, match="pass dtype="):
        compare(1.0, 1.0, n=1)
    # dtype: the less precise side; a float64 reference does not tighten or loosen it.
    assert compare(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float64), n=1).u == 2.0 ** -8
    assert compare(torch.ones(2), torch.ones(2, dtype=torch.float64), n=1).u == 2.0 ** -24


def test_compare_all_names_the_worst_tensor():
    expected = {"w": torch.ones(3), "b": torch.full((2,), 4.0)}
    actual = {"w": torch.ones(3) + 1e-7, "b": torch.full((2,), 4.0 + 1e-2)}
    worst = compare_all(actual, expected, n=4)
    assert not worst and worst.name == "b" and str(worst).startswith("b: max |actual - expected|")
    assert compare_all({"w": torch.ones(3), "b": torch.full((2,), 4.0)}, expected, n=4)
    assert "keys differ: missing ['b']" in str(compare_all({"w": torch.ones(3)}, expected, n=4))
    assert compare_all({}, {}, n=1)


# ---- a whole model, its norms summed in another order ------------------------------------------------------
class ShuffledRMSNorm(RMSNorm):
    """picotron's RMSNorm with its mean of squares added one term at a time in a shuffled order: what another
    machine's reduction, or a Triton kernel, does. `divide_by` other than the width plants a bug."""

    def __init__(self, norm: RMSNorm, divide_by: int | None = None):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight = norm.weight
        self.order = torch.randperm(norm.weight.shape[0], generator=torch.Generator().manual_seed(0)).tolist()
        self.divide_by = divide_by or norm.weight.shape[0]

    def forward(self, x):
        x32 = x.float()
        squares = x32.pow(2).reshape(-1, x.shape[-1])
        total = sequential_sum(squares, self.order).reshape(*x.shape[:-1], 1)
        return self.weight * (x32 * torch.rsqrt(total / self.divide_by + self.eps)).to(x.dtype)


def llama_gradients(config, ids, divide_by=None, shuffled=False) -> dict:
    torch.manual_seed(0)
    model = Llama(config)
    if shuffled:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is RMSNorm:
                    setattr(module, name, ShuffledRMSNorm(child, divide_by))
    loss_fn(model(ids[:, :-1]), ids[:, 1:]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_a_model_whose_norms_sum_in_another_order_stays_inside_and_a_wrong_norm_does_not():
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_seq_len=32)
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    n = llama_roundings(config, 31, 2 * 31)
    reference = llama_gradients(config, ids)
    reordered = compare_all(llama_gradients(config, ids, shuffled=True), reference, n=n)
    assert reordered.ratio < 1 / MARGIN, str(reordered)
    wrong = compare_all(llama_gradients(config, ids, divide_by=63, shuffled=True), reference, n=n)   # mean over h - 1
    assert wrong.ratio > 10, str(wrong)

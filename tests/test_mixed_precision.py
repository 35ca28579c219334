"""picotron.mixed_precision: emulated 16-bit matmuls, master weights, the dynamic loss scaler, bytes per parameter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from picotron import tolerance
from picotron.config import ModelConfig, TrainConfig
from picotron.data import make_loader
from picotron.memory import PRECISIONS
from picotron.mixed_precision import (RECIPE_BYTES, DynamicLossScaler, LowPrecisionLinear, convert_to_low_precision,
                                      low_precision_matmul, round_parameters_)
from picotron.model import Llama, loss_fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulation_equals_a_real_16bit_matmul(dtype):
    """CPU emulation (round inputs, fp32 product, round output) against torch's own 16-bit matmul on this CPU.

    Both accumulate in fp32; summation order may differ, so outputs agree within one 16-bit rounding."""
    torch.manual_seed(0)
    a, b_t = torch.randn(48, 64), torch.randn(32, 64)
    real = F.linear(a.to(dtype), b_t.to(dtype)).float()
    emulated = low_precision_matmul(a, b_t, dtype)
    assert torch.equal(emulated, emulated.to(dtype).float())           # a 16-bit value in fp32 storage
    eps = torch.finfo(dtype).eps
    assert ((emulated - real).abs() <= eps * real.abs() + 1e-6).all()


def test_low_precision_linear_gradients():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 7, 64, requires_grad=True)
    grad = torch.randn(5, 7, 32)
    layer = LowPrecisionLinear.from_linear(linear, torch.bfloat16)
    layer(x).backward(grad)
    bf = lambda t: t.to(torch.bfloat16).float()
    g2, x2 = bf(grad.reshape(-1, 32)), bf(x.detach().reshape(-1, 64))
    # Both sides accumulate in fp32 and round once to bf16: two bf16 roundings apart (picotron.tolerance), the
    # fp32 sums in another order can tip a value to the neighbouring bf16 number.
    tolerance.assert_close(x.grad, bf(g2 @ bf(linear.weight.detach())).reshape(x.shape), n=2, dtype=torch.bfloat16)
    tolerance.assert_close(linear.weight.grad, bf(g2.t() @ x2), n=2, dtype=torch.bfloat16)
    assert linear.weight.dtype == torch.float32                        # the parameter is the fp32 master


def test_fp16_overflows_and_underflows():
    big, small = torch.tensor([[300.0]]), torch.tensor([[1e-5]])
    assert low_precision_matmul(big, big, torch.float16).isinf().all()         # 90000 > 65504
    assert low_precision_matmul(big, big, torch.bfloat16).isfinite().all()     # bf16 has fp32's range
    assert low_precision_matmul(small, small, torch.float16).item() == 0.0     # 1e-10 < 6e-8: flushed
    assert low_precision_matmul(small, small, torch.bfloat16).item() > 0


def test_master_weights_keep_small_updates():
    """w = 1 and 1000 updates of 1e-3: an fp32 master reaches 2; bf16 weights never move (the gap at 1 is 2^-7)."""
    master = torch.ones(1)
    pure = torch.ones(1)
    for _ in range(1000):
        master += 1e-3
        pure += 1e-3
        round_parameters_([pure], torch.bfloat16)
    assert master.item() == pytest.approx(2.0, abs=1e-3) and pure.item() == 1.0


def test_convert_shares_parameters_and_converts_every_linear():
    torch.manual_seed(0)
    model = Llama(ModelConfig(num_layers=1))
    keys = list(model.state_dict())
    convert_to_low_precision(model, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, LowPrecisionLinear) for m in linears)
    assert list(model.state_dict()) == keys and model.lm_head.weight is model.embed.weight


# ---- the dynamic loss scaler ------------------------------------------------------------------------

def _step_with(scaler, param, optimizer, overflow: bool) -> bool:
    optimizer.zero_grad()
    scaler.scale((param * 2).sum()).backward()
    if overflow:
        param.grad[0] = float("inf")
    return scaler.step(optimizer)


def test_overflow_skips_the_step_and_halves_the_scale():
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    assert _step_with(scaler, param, optimizer, overflow=False)
    assert_close(param.detach(), torch.full((3,), 0.8))                 # unscaled: the true gradient 2
    assert _step_with(scaler, param, optimizer, overflow=True) is False
    assert_close(param.detach(), torch.full((3,), 0.8))                 # skipped: weights untouched
    assert scaler.scale_value == 512.0 and scaler.skipped == 1
    for _ in range(3):                                                  # growth_interval good steps: doubles
        assert _step_with(scaler, param, optimizer, overflow=False)
    assert scaler.scale_value == 1024.0
    assert_close(param.detach(), torch.full((3,), 0.8 - 3 * 0.2))


def test_scale_follows_torch_grad_scaler():
    """The same overflow pattern through torch.amp.GradScaler (CPU) gives the same scales and the same skips."""
    pattern = [False, True, True, False, False, False, True, False, False, False, False]
    ours_p, theirs_p = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    ours_opt, theirs_opt = torch.optim.SGD([ours_p], lr=0.01), torch.optim.SGD([theirs_p], lr=0.01)
    ours = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=2)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for overflow in pattern:
        _step_with(ours, ours_p, ours_opt, overflow)
        theirs_opt.zero_grad()
        theirs.scale((theirs_p * 2).sum()).backward()
        if overflow:
            theirs_p.grad[0] = float("inf")
        theirs.step(theirs_opt)
        theirs.update()
        assert ours.scale_value == theirs.get_scale()
        assert torch.equal(ours_p.detach(), theirs_p.detach())


def test_fp16_training_recovers_from_a_forced_overflow():
    """Emulated fp16 training of the tiny model; at step 4 a gradient is forced to inf: that step is skipped,
    the scale halves, the weights stay, and training goes on to a lower loss."""
    torch.manual_seed(0)
    model = convert_to_low_precision(Llama(ModelConfig(num_layers=2)), torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=100)
    loader = make_loader(TrainConfig(micro_batch_size=4, seq_len=32))
    losses, scales = [], []
    for step in range(10):
        batch = loader.get_batch(step)
        loss = loss_fn(model(batch.input_ids), batch.targets)
        scaler.scale(loss).backward()
        if step == 4:
            model.lm_head.weight.grad.view(-1)[0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
        stepped = scaler.step(optimizer)
        if step == 4:
            assert not stepped and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        optimizer.zero_grad()
        losses.append(loss.item())
        scales.append(scaler.scale_value)
    assert scales[3] == 2.0 ** 12 and scales[4] == 2.0 ** 11 and scaler.skipped == 1
    assert losses[-1] < losses[4] - 0.3


def test_scaler_validates_its_arguments():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)


# ---- bytes per parameter ------------------------------------------------------------------------------

def test_recipe_bytes_agree_with_the_memory_model():
    for name in ("fp32", "bf16-mixed"):
        ours, theirs = RECIPE_BYTES[name], PRECISIONS[name]
        assert (ours.param, ours.grad, ours.optimizer, ours.activation) == \
               (theirs.param, theirs.grad, theirs.optimizer, theirs.activation)
    assert RECIPE_BYTES["fp32"].total == RECIPE_BYTES["bf16-mixed"].total == RECIPE_BYTES["fp8-mixed"].total == 16
    assert RECIPE_BYTES["bf16-mixed-fp32-grads"].total == 18 and RECIPE_BYTES["deepseek-v3-fp8"].total == 12

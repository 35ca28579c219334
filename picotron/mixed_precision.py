"""Mixed-precision training: 16-bit matmuls, fp32 master weights, dynamic loss scaling (chapter 10).

Micikevicius et al. 2018 ("Mixed Precision Training", arXiv:1710.03740) train in fp16 without
losing accuracy with three rules:

1. Matmuls read 16-bit inputs and accumulate in fp32 (tensor cores do); their outputs are 16-bit.
2. The optimizer updates an fp32 *master* copy of the weights. An update smaller than half a gap
   of the 16-bit weight would vanish: bf16 keeps 8 significant bits, so w = 1 ignores any step
   below 2^-8 ~ 0.004. The 16-bit weights are a cast of the master.
3. fp16 gradients underflow (below 6e-8 they are zero), so the loss is multiplied by S before
   backward and the gradients divided by S after. *Dynamic* loss scaling picks S: when a gradient
   is inf or NaN the step is skipped and S halves; after `growth_interval` good steps S doubles.

bf16 has fp32's exponent range and needs no loss scaling; rules 1 and 2 stay (Kalamkar et al. 2019,
arXiv:1905.12322). Memory per parameter (Playbook, "Mixed precision training"):

    fp32          4 weights + 4 gradients + 8 Adam (m, v)                         = 16 bytes
    bf16 / fp16   2 weights + 2 gradients + 4 master + 8 Adam                     = 16 bytes
    DeepSeek-V3   4 fp32 master + 4 fp32 gradients + 4 bf16 Adam (m, v), fp8 GEMMs = 12 bytes

Mixed precision does not save state memory; it halves activations and runs matmuls at twice
tf32's rate on an H100 (989 vs 495 dense TFLOP/s; fp8: 1979).

`LowPrecisionLinear` runs a Linear's three matmuls in bf16 or fp16. On a CPU, where 16-bit
matmuls are 60-100x slower than fp32, it *emulates* them: inputs rounded to the format, product in
fp32 (the fp32 accumulation of a tensor core), output rounded; on a GPU it casts and runs the
real 16-bit matmul. `convert_to_low_precision(model, dtype)` swaps a model's Linears (the
parameter stays the fp32 master). `DynamicLossScaler` is rule 3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from picotron.fp8 import swap_linears

LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)


# ---- Bytes per parameter of each recipe ----------------------------------------------------------------

@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter a recipe keeps between steps (the same split as picotron.memory.Precision:
    `optimizer` includes an fp32 master copy when the model's weights are not it)."""

    param: int          # the weights the forward reads (kept between steps)
    grad: int
    optimizer: int      # master weights + Adam's m and v
    activation: int     # bytes per saved activation element (the dominant dtype)

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


RECIPE_BYTES: dict[str, StateBytes] = {
    "fp32": StateBytes(param=4, grad=4, optimizer=8, activation=4),
    "bf16-mixed": StateBytes(param=2, grad=2, optimizer=12, activation=2),
    # Some frameworks accumulate the gradients in fp32 (the Playbook's 2 + 4 + 12 = 18).
    "bf16-mixed-fp32-grads": StateBytes(param=2, grad=4, optimizer=12, activation=2),
    # fp16 adds a single loss scale.
    "fp16-mixed": StateBytes(param=2, grad=2, optimizer=12, activation=2),
    # Float8Linear on a bf16-mixed model: the fp8 copies of the weights exist only during a matmul.
    "fp8-mixed": StateBytes(param=2, grad=2, optimizer=12, activation=2),
    # DeepSeek-V3 (arXiv:2412.19437, 3.3.3): fp32 master weights (the GEMMs read fp8 casts of them)
    # and fp32 gradients, Adam's moments in bf16.
    "deepseek-v3-fp8": StateBytes(param=4, grad=4, optimizer=4, activation=2),
}


# ---- Emulated (CPU) or real (GPU) 16-bit matmuls -------------------------------------------------------

def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype`, kept in x's dtype (a 16-bit value in fp32 storage)."""
    return x.to(dtype).to(x.dtype)


def low_precision_matmul(a: torch.Tensor, b_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b_t (N, K)^T as a 16-bit GEMM: 16-bit inputs, fp32 accumulation, 16-bit output, in a's dtype.

    On a GPU the real thing; on a CPU the same rounding around an fp32 product (the sums may be
    added in another order than a GPU's, nothing else differs).
    """
    if a.device.type == "cuda":
        return (a.to(dtype) @ b_t.to(dtype).t()).to(a.dtype)
    return _round(_round(a, dtype) @ _round(b_t, dtype).t(), dtype)


class _LowPrecisionLinearFunction(torch.autograd.Function):
    """y = x W^T, dx = dy W, dW = dy^T x, each a 16-bit GEMM; dW comes out rounded to 16 bits, as a
    16-bit model's gradient would be (the optimizer then adds it into the fp32 master)."""

    @staticmethod
    def forward(ctx, x, weight, dtype):
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        return low_precision_matmul(x, weight, dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        dtype = ctx.dtype
        grad_x = low_precision_matmul(grad_y, weight.t(), dtype) if ctx.needs_input_grad[0] else None
        grad_w = low_precision_matmul(grad_y.t(), x.t(), dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


class LowPrecisionLinear(nn.Linear):
    """An nn.Linear whose matmuls run in `dtype` (bf16 or fp16) while its parameter stays the fp32 master."""

    compute_dtype: torch.dtype
    converted = True        # swap_linears leaves it alone

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "LowPrecisionLinear":
        """Share `linear`'s parameters (no copy)."""
        if dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(f"dtype={dtype}; choose torch.bfloat16 or torch.float16 (fp8: picotron.fp8)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias, new.compute_dtype = linear.weight, linear.bias, dtype
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = _LowPrecisionLinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.compute_dtype)
        y = y.reshape(*lead, self.out_features)
        return y + _round(self.bias, self.compute_dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, matmuls in {str(self.compute_dtype).removeprefix('torch.')}"


def convert_to_low_precision(module: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Swap every plain nn.Linear of `module` for a LowPrecisionLinear in `dtype`, in place; parameters shared.

    What autocast does to a Llama: the matmuls go 16-bit, while the norms (fp32 inside RMSNorm),
    the softmax of the loss and the residual additions stay fp32. The tied LM head is converted
    too: under autocast it is a matmul like any other. Returns `module`.
    """
    swap_linears(module, lambda linear: LowPrecisionLinear.from_linear(linear, dtype), lambda name, linear: False)
    return module


def round_parameters_(params, dtype: torch.dtype) -> None:
    """Round the parameters to `dtype` in place (a model trained in pure 16-bit, without fp32 master weights)."""
    with torch.no_grad():
        for p in params:
            p.copy_(_round(p, dtype))


# ---- Dynamic loss scaling ----------------------------------------------------------------------------

class DynamicLossScaler:
    """Scale the loss up so that fp16 gradients do not underflow; skip a step whose gradients overflowed.

        loss.backward()  ->  scaler.scale(loss).backward()
        optimizer.step() ->  scaler.step(optimizer, params)     # unscale, check, step or skip, update S

    or, to clip the gradients between (they must be unscaled first):

        found_inf = scaler.unscale_(params); if not found_inf: clip and optimizer.step(); scaler.update(found_inf)

    The rule (Micikevicius et al. 2018, section 3.2; the same as torch.amp.GradScaler's defaults):
    an inf/NaN gradient halves S and the step is skipped; `growth_interval` finite steps in a row
    double S. S starts high (2^16) and finds its level by halving within a few steps.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1; "
                             f"got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.good_steps = 0      # finite steps since the last change of S
        self.skipped = 0         # steps skipped so far

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, params) -> bool:
        """Divide every gradient by S in place; return True if any of them holds an inf or NaN."""
        grads = [p.grad for p in params if p.grad is not None]
        found_inf = False
        for g in grads:
            g.mul_(1.0 / self.scale_value)
            found_inf = found_inf or not bool(torch.isfinite(g).all())
        return found_inf

    def update(self, found_inf: bool) -> None:
        """Halve S after an overflow; double it after growth_interval finite steps in a row."""
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, params=None) -> bool:
        """Unscale, then step the optimizer unless a gradient overflowed; update S. Returns whether it stepped."""
        params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps, self.skipped = state["scale"], state["good_steps"], state["skipped"]

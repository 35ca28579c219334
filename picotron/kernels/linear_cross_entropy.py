"""The LM head and the loss in one: cross_entropy(x W^T, targets), the logits made and used chunk by chunk.

Chapter: chapters/09_gpu_kernels.ipynb.

The last matmul of a language model makes one logit per token and vocabulary entry. With Llama 3's
128,256-entry vocabulary, 8192 tokens of fp32 logits are 4.2 GB, and autograd keeps them (and their
softmax) for the backward: the largest activation of the whole model. The loss only needs, per token,
the log-sum-exp of its logits and the logit of its target. So:

    forward   for each chunk of `chunk_size` tokens: logits = x_c W^T (chunk_size x V, in fp32),
              lse_c = logsumexp(logits), loss_c = lse_c - logits[target]; the chunk's logits are dropped.
              Saved for backward: x, W, the targets and one fp32 lse per token.
    backward  for each chunk again: logits = x_c W^T, G = softmax(logits) - onehot(target) = exp(logits - lse)
              minus 1 at the target, scaled by dloss / (tokens counted); dx_c = G W and dW += G^T x_c.

Peak memory of the loss falls from about 3 x tokens x V x 4 bytes (the logits, their fp32 softmax and
its gradient) to about 2 x chunk_size x V x 4 bytes, for one more matmul (the logits are computed
twice: forward and backward). `linear_cross_entropy` equals F.cross_entropy(F.linear(x, W), targets)
in value and gradients (tests/test_linear_cross_entropy.py), with its `ignore_index` and mean over the
tokens counted. Under torch.autocast the matmuls run in the autocast dtype and the softmax in fp32,
as the unfused model's loss does (it casts the logits to fp32).
"""

from __future__ import annotations

import torch

__all__ = ["LinearCrossEntropy", "linear_cross_entropy"]


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: the autocast dtype inside torch.autocast, else x's."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """mean over counted tokens of cross_entropy(x W^T, targets), chunk by chunk (the module's docstring)."""

    @staticmethod
    def forward(ctx, x, weight, targets, chunk_size: int, ignore_index: int):
        dtype = _matmul_dtype(x)
        hidden = x.reshape(-1, x.shape[-1])                       # (tokens, h)
        flat = targets.reshape(-1)                                # (tokens,)
        counted = flat != ignore_index
        lse = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            w = weight.to(dtype)
            for c0 in range(0, hidden.shape[0], chunk_size):
                c1 = min(c0 + chunk_size, hidden.shape[0])
                logits = (hidden[c0:c1].to(dtype) @ w.T).float()                 # (chunk, V): the only big tensor
                lse[c0:c1] = torch.logsumexp(logits, dim=-1)
                target_logit = logits.gather(1, flat[c0:c1].clamp(min=0)[:, None]).squeeze(1)
                total += ((lse[c0:c1] - target_logit) * counted[c0:c1]).sum()
        count = counted.sum()
        ctx.save_for_backward(x, weight, targets, lse, count)
        ctx.chunk_size, ctx.ignore_index, ctx.dtype = chunk_size, ignore_index, dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, targets, lse, count = ctx.saved_tensors
        dtype, chunk_size = ctx.dtype, ctx.chunk_size
        hidden, flat = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        counted = flat != ctx.ignore_index
        scale = grad_loss.float() / count                                          # d loss / d (one token's loss)
        grad_x = torch.empty(hidden.shape, dtype=x.dtype, device=x.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        w = weight.to(dtype)
        for c0 in range(0, hidden.shape[0], chunk_size):
            c1 = min(c0 + chunk_size, hidden.shape[0])
            h_c = hidden[c0:c1].to(dtype)
            g = (h_c @ w.T).float()                                                # the logits, recomputed
            g.sub_(lse[c0:c1, None]).exp_()                                        # softmax from the saved lse
            rows = torch.arange(c1 - c0, device=x.device)
            g[rows, flat[c0:c1].clamp(min=0)] -= 1.0                               # minus the one-hot target
            g *= (counted[c0:c1] * scale)[:, None]
            g = g.to(dtype)
            grad_x[c0:c1] = (g @ w).to(x.dtype)
            grad_w += (g.T @ h_c).float()
        return grad_x.reshape(x.shape), grad_w.to(weight.dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_size: int = 1024,
                         ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy(F.linear(x, weight).float().flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
    without ever holding more than `chunk_size` tokens' logits. x: (..., h), weight: (V, h), targets: x's
    leading shape, integers in [0, V) or ignore_index. Differentiable in x and weight."""
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"x {tuple(x.shape)} and targets {tuple(targets.shape)}: targets must have x's shape "
                         f"without its last (hidden) dimension")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (vocab, hidden={x.shape[-1]})")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: a chunk must hold at least one token")
    if targets.dtype.is_floating_point:
        raise ValueError(f"targets of dtype {targets.dtype}: expected token ids (an integer dtype)")
    return LinearCrossEntropy.apply(x, weight, targets, chunk_size, ignore_index)

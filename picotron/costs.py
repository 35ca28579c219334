"""What one model costs on one process, in FLOPs and in bytes: the formulas every chapter builds on.

- FLOPs per token of training (6N + 12 L h s, plus what recomputation runs again) and the peak
  FLOP/s of this rank's device, the two halves of MFU (chapters/01_memory.ipynb and
  chapters/08_5d_parallelism.ipynb; docs/design.md, "FLOPs, peaks and MFU").
- The bytes a decoder layer saves for backward, term by term (chapters/01_memory.ipynb, section on
  activations); each technique's cost module (picotron/parallel/*_costs.py) divides these terms
  over its ranks, and picotron.memory adds them up per rank.

Activations of one decoder layer of picotron's Llama, in bytes (b batch, s sequence, h hidden,
n_q / n_kv query / key-value heads of width d, f MLP width, a bytes per activation: 4 in fp32,
2 in bf16), counting what autograd really saves (chapter 01 lists it tensor by tensor):

    RMSNorm, twice   (4 + 2a) b s h + 4 b s   fp32 input, normalised x, output; 1/rms per token
    attention        a b s (2 n_q d + 2 n_kv d) q and k after RoPE, v, attention output
        sdpa         + 4 b n_q s                log-sum-exp per query row (fp32)
        eager        + 2a b s (n_q - n_kv) d     k and v copied for every query head (GQA)
                     + a b n_q s^2              softmax probabilities: the quadratic term
    SwiGLU MLP       4 a b s f                  gate out, silu(gate), up out, their product

Recomputation keeps less: "selective" drops the attention core's own tensors (the last two
lines of attention), "full" keeps only each layer's input, a b s h. Once per model: the final
RMSNorm, the fp32 log-probabilities of the loss, 4 b s V, and the RoPE cos/sin rows, 2 s d a.

This module imports only the configuration: it sits below the model and every technique.
"""

from __future__ import annotations

import math
import time

import torch

from picotron.config import ModelConfig
from picotron.tolerance import tf32_matmuls


# Dense bf16 tensor-core peaks from the vendors' spec sheets (without sparsity), FLOP/s.
GPU_PEAK_FLOPS = {"H100 SXM": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12,
                  "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "RTX 4090": 165e12}


def flops_per_token(model: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the weights, 12 L h s for attention (no recomputation).

    N counts the parameters a token computes with: for an MoE model only its experts_per_token
    experts (ModelConfig.num_active_params), so MFU is not inflated by idle experts.
    """
    return 6 * model.num_active_params() + 12 * model.num_layers * model.hidden_size * seq_len


def peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, where the figure comes from) of this rank's device for matmuls in `dtype`.

    MFU is only honest against the peak of the arithmetic that really ran: bf16 against the
    spec sheet's dense bf16 figure; fp32 on a GPU whose torch allows TF32 against half of it (TF32
    tensor cores run at half bf16's rate on Ampere and Hopper: 495 of 989 TFLOP/s on an H100 SXM);
    plain fp32 on a GPU, and anything on a CPU, against a matmul measured here in that dtype.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = next(((key, value) for key, value in GPU_PEAK_FLOPS.items() if key in name), None)  # most specific first
        if spec and dtype == torch.bfloat16:
            return spec[1], f"{spec[0]} spec-sheet dense bf16"
        if spec and dtype == torch.float32 and tf32_matmuls(device):
            return spec[1] / 2, f"{spec[0]} spec-sheet dense TF32 (half of bf16)"
        kind = str(dtype).removeprefix("torch.")
        return measured_matmul_flops(device, dtype), f"{name}: measured {kind} matmul"
    kind = str(dtype).removeprefix("torch.")
    return measured_matmul_flops(device, dtype), f"measured CPU {kind} matmul"


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 512, repeats: int = 10) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def recompute_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Extra training FLOPs per token that config.recompute costs (hardware FLOPs minus model FLOPs).

    One more forward of what is recomputed: the attention core is 2 matmuls of 2 s n_q d FLOPs per
    token per layer; a whole layer adds 2 FLOPs per layer parameter per token on top of that.
    """
    core = 4 * config.num_layers * seq_len * config.num_attention_heads * config.head_dim
    if config.recompute == "none":
        return 0
    if config.recompute == "selective":
        return core
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    # Per token: every parameter but the embedding, the head and the final norm.
    layer_params = config.num_active_params() - embeddings - config.hidden_size
    return 2 * layer_params + core


def training_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """6N + 12 L h s (flops_per_token), plus what recomputation runs again."""
    return flops_per_token(config, seq_len) + recompute_flops_per_token(config, seq_len)


# ---- Activations: bytes a layer saves for backward ------------------------------------------

def activation_bytes_per_layer(config: ModelConfig, batch: int, seq: int, *, dtype_bytes: int = 4) -> int:
    """Bytes one decoder layer saves for backward, for config.attention and config.recompute."""
    a, tokens = dtype_bytes, batch * seq
    q_width = config.num_attention_heads * config.head_dim                 # n_q d
    kv_width = config.num_key_value_heads * config.head_dim                # n_kv d
    if config.recompute == "full":
        return a * tokens * config.hidden_size                              # the layer input, kept by the checkpoint
    norms = 2 * rms_norm_bytes(tokens, config.hidden_size, a)
    attention = a * tokens * (2 * q_width + 2 * kv_width)                  # q, k (after RoPE), v, output
    mlp = 4 * a * tokens * config.intermediate_size                        # gate, silu(gate), up, product
    if config.recompute == "none":
        attention += attention_core_bytes(config, batch, seq, a)
    return norms + attention + mlp


def rms_norm_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """Input in fp32 (pow and mul save it), normalised x and the output (read by the next matmuls), 1/rms."""
    return (4 + 2 * dtype_bytes) * tokens * hidden + 4 * tokens


def attention_core_bytes(config: ModelConfig, batch: int, seq: int, dtype_bytes: int) -> int:
    """What the core softmax(q k^T) v saves beyond its inputs and output: selective recomputation drops it."""
    heads = config.num_attention_heads
    if config.attention == "sdpa":
        return 4 * batch * heads * seq                                     # fp32 log-sum-exp per query row
    kv_copies = 2 * dtype_bytes * batch * seq * (heads - config.num_key_value_heads) * config.head_dim
    return kv_copies + dtype_bytes * batch * heads * seq * seq             # (b, n_q, s, s) probabilities


def activation_bytes(config: ModelConfig, batch: int, seq: int, *, dtype_bytes: int = 4) -> int:
    """Activation bytes of the whole model for one micro-batch of (batch, seq) tokens."""
    tokens = batch * seq
    return (config.num_layers * activation_bytes_per_layer(config, batch, seq, dtype_bytes=dtype_bytes)
            + rms_norm_bytes(tokens, config.hidden_size, dtype_bytes)     # final norm
            + 4 * tokens * config.vocab_size                               # fp32 log-probabilities of the loss
            + 2 * seq * config.head_dim * dtype_bytes)                     # RoPE cos/sin rows, shared by all layers

"""A Llama-style decoder: the model every chapter trains, splits and measures.

Token embedding -> `num_layers` pre-norm decoder layers -> RMSNorm -> LM head. Each layer is
    x = x + Attention(RMSNorm(x))    grouped-query attention with rotary positions (RoPE)
    x = x + MLP(RMSNorm(x))          SwiGLU feed-forward
as in Llama (Touvron et al. 2023, arXiv:2302.13971) and Llama 3 (arXiv:2407.21783), and the
same tensors, names aside, as Hugging Face's `LlamaForCausalLM`, so `picotron.hf` loads its
checkpoints unchanged.

Parameters, with h = hidden_size, d = head_dim, n_q / n_kv = query / key-value heads,
f = intermediate_size, V = vocab_size, L = num_layers:
    per layer  2*h*n_q*d (q, o) + 2*h*n_kv*d (k, v) + 3*h*f (gate, up, down) + 2*h (norms)
    total      L * per_layer + V*h (embedding, once more if the LM head is untied) + h
Without GQA (n_kv = n_q, n_q*d = h) and with Llama's f = 8h/3 that is 12*h^2 + 2*h per layer,
the Playbook's count ("Memory usage in Transformers"). `ModelConfig.num_params()` computes the
same number from the shape alone.

Each layer, attention and MLP is its own module so later chapters can take a slice of
`layers` (pipeline parallelism), swap the q/k/v/o and gate/up/down Linears (tensor
parallelism) or replace `Attention.attend` (context parallelism).

Two switches in the ModelConfig trade memory for compute (chapter 01, picotron/memory.py):
    attention="sdpa"     fused attention (FlashAttention-style): the (seq x seq) scores are never stored
    attention="eager"    scores, softmax and @V as separate ops: backward keeps the (seq x seq) probabilities
    recompute="selective"  keep only q, k, v of the attention core and recompute it in backward
    recompute="full"       keep only each layer's input and recompute the whole layer in backward
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from picotron.config import ModelConfig, check_model_choices


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019, arXiv:1910.07467): LayerNorm without the mean."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even for bf16 inputs: bf16 keeps ~3 significant digits, too few for a mean of squares.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


# ---- Rotary position embedding (RoPE, Su et al. 2021, arXiv:2104.09864) ----------------------

def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotation speed of each pair of channels, theta^(-2i/d), shape (head_dim/2,)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type")
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use rope_scaling=None "
                         f"or {{'rope_type': 'llama3', 'factor': ..., 'low_freq_factor': ..., "
                         f"'high_freq_factor': ..., 'original_max_position_embeddings': ...}}")
    return llama3_scaled(inv_freq, scaling)


def llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context adjustment: slow down only the low frequencies.

    Channels whose wavelength is short compared with the original training context keep their
    speed (they encode local order), those longer than it are slowed by `factor` (so positions
    beyond the old context look like positions inside it), and the ones in between are blended.
    Same formula as Meta's reference code and transformers' `_compute_llama3_parameters`.
    """
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)   # 0 at the low edge, 1 at the high edge
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    in_between = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_between, blended, slowed)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + head_dim/2 by angle position * inv_freq[i].

    This is the "rotate_half" convention of Hugging Face's Llama, not the interleaved pairs
    (2i, 2i+1) of Meta's original code: HF permuted the q/k weights when converting, so using
    its convention lets `picotron.hf` load those checkpoints without touching any weight.
    """
    return x * cos + rotate_half(x) * sin   # x: (batch, heads, seq, head_dim)


class Rotary(nn.Module):
    """cos/sin tables for positions 0 .. max_seq_len-1, looked up by position id.

    Looking up by position (not by index in the sequence) lets context parallelism give each
    rank a slice of positions that does not start at 0.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("cos", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(config.max_seq_len, config.head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        device = self.cos.device
        positions = torch.arange(self.config.max_seq_len, dtype=torch.float32, device=device)
        angles = torch.outer(positions, rope_frequencies(self.config).to(device))  # (max_seq_len, head_dim/2)
        angles = torch.cat((angles, angles), dim=-1)                                # both halves share angles
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (batch or 1, seq) -> tables: (batch or 1, 1, seq, head_dim), broadcast over heads
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


# ---- Activation recomputation (Playbook, "Activation recomputation") ------------------------------

def recompute(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), keeping only `inputs` for backward; fn's inner activations are recomputed there.

    Backward needs the tensors each op saved in forward. Recomputation drops the ones saved
    inside fn and runs fn again when backward reaches it (Chen et al. 2016, arXiv:1604.06174):
    memory falls to the inputs, compute rises by one more forward of fn. Wrapping the attention
    core is *selective* recomputation, wrapping a whole layer is *full* recomputation
    (Korthikanti et al. 2022, arXiv:2205.05198). The same ops run on the same inputs, so the
    gradients are bit-for-bit those without recomputation.

    torch's non-reentrant checkpoint does the bookkeeping: saved-tensor hooks replace each
    saved tensor by a placeholder and refill it on first use in backward, which, unlike the
    reentrant version, also works with torch.autograd.grad (chapter 01 builds the idea from an
    autograd.Function). preserve_rng_state=False: the model has no dropout, no RNG to replay.
    """
    if not torch.is_grad_enabled():  # evaluation or generation: nothing is saved anyway
        return fn(*inputs)
    return checkpoint(fn, *inputs, use_reentrant=False, preserve_rng_state=False)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(head_dim)) v written out op by op, as in the Transformer paper.

    Backward needs the softmax output, (batch, heads, seq, seq): memory quadratic in the sequence,
    the s^2 term of the Playbook's activation formula (its 5as^2b, of which 3as^2b is dropout's,
    which this model does not have). Fused kernels (FlashAttention, Dao et al. 2022,
    arXiv:2205.14135; F.scaled_dot_product_attention) recompute it in backward instead and keep
    only a (batch, heads, seq) log-sum-exp.
    """
    batch, kv_heads, seq, head_dim = k.shape
    groups = q.shape[1] // kv_heads
    if groups > 1:  # GQA: copy each key/value head for the `groups` query heads that read it (HF's repeat_kv)
        k = k[:, :, None].expand(batch, kv_heads, groups, seq, head_dim).reshape(batch, -1, seq, head_dim)
        v = v[:, :, None].expand(batch, kv_heads, groups, seq, head_dim).reshape(batch, -1, seq, head_dim)
    scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)                  # (batch, heads, seq, seq)
    # An additive mask (-inf above the diagonal) saves nothing for backward; masked_fill would save it.
    future = torch.full((seq, seq), float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
    probs = torch.softmax(scores + future, dim=-1)  # in the compute dtype, like Megatron's fused softmax
    return probs @ v                                                         # (batch, heads, seq, head_dim)


# ---- The decoder layer -------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal grouped-query attention (Ainslie et al. 2023, arXiv:2305.13245).

    n_kv < n_q key/value heads, each shared by n_q/n_kv query heads: the KV cache and the k/v
    projections shrink by that factor. Head counts come from the Linears' output sizes, so a
    tensor-parallel version that gives each rank fewer heads just swaps the Linears.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.attention = config.attention                          # "sdpa" or "eager"
        self.recompute_core = config.recompute == "selective"
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (batch, heads, seq, head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (batch, kv_heads, seq, head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.recompute_core:  # selective recomputation: keep q, k, v; recompute scores, softmax, @V
            out = recompute(self.attend, q, k, v)
        else:
            out = self.attend(q, k, v)                                           # (batch, heads, seq, head_dim)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))        # (batch, seq, heads*head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.attention == "eager":
            return eager_attention(q, k, v)
        # softmax(q k^T / sqrt(head_dim)) v with a causal mask; enable_gqa lets query head i
        # read key/value head i // (heads/kv_heads) without copying k and v.
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020, arXiv:2002.05202): down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: normalising the branch input, not the stream, keeps deep stacks stable."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head (weight shared with the embedding when tied)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_model_choices(config)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = Rotary(config)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()   # also ties lm_head.weight to embed.weight when configured

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std) weights, unit norms; deterministic given torch.manual_seed.

        The two projections that write into the residual stream (o_proj, down_proj) get std
        init_std / sqrt(2 * num_layers): 2*L branches add to the stream, and this keeps its
        variance from growing with depth (GPT-2, Radford et al. 2019, section 2.3; nanoGPT).
        It draws from the global RNG: seed right before it to reproduce a model. Also call it
        after `to_empty()` to fill a model that was built on the meta device.
        """
        std = self.config.init_std
        nn.init.normal_(self.embed.weight, std=std)
        if self.config.tie_word_embeddings:
            # One matrix reads tokens in and writes them out. Tied here, not in __init__, because
            # to_empty() gives each module a new Parameter and so unties them.
            self.lm_head.weight = self.embed.weight
        else:
            nn.init.normal_(self.lm_head.weight, std=std)
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.layers.named_modules():
            if isinstance(module, nn.Linear):
                writes_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=residual_std if writes_residual else std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.ones_(self.norm.weight)
        self.rope.reset_tables()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab). position_ids: (seq,) or (batch, seq)."""
        seq = input_ids.shape[1]
        if position_ids is None:
            if seq > self.config.max_seq_len:
                raise ValueError(f"sequence of {seq} tokens is longer than max_seq_len="
                                 f"{self.config.max_seq_len}; raise max_seq_len in the ModelConfig")
            position_ids = torch.arange(seq, device=input_ids.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)          # (1, seq): same positions for every row
        cos, sin = self.rope(position_ids)                    # (batch or 1, 1, seq, head_dim)
        x = self.embed(input_ids)                             # (batch, seq, hidden)
        full_recompute = self.config.recompute == "full"
        for layer in self.layers:
            # Full recomputation: only the layer's input stays saved; backward runs the layer again.
            x = recompute(layer, x, cos, sin) if full_recompute else layer(x, cos, sin)
        return self.lm_head(self.norm(x))                     # (batch, seq, vocab)

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once: .parameters() skips repeats)."""
        return sum(p.numel() for p in self.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens, in fp32 (targets == -100 are skipped)."""
    # logits: (batch, seq, vocab), targets: (batch, seq)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

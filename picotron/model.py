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

With num_experts > 0 the MLP of every moe_every-th layer is a mixture of experts (`MoE`, chapter
07): a router sends each token to experts_per_token of num_experts SwiGLU MLPs. The layer then
holds num_experts * 3*h*f + h*num_experts parameters (experts, router), but a token computes with
only experts_per_token experts. Its load-balancing loss is not part of the logits:
    loss = loss_fn(model(input_ids), targets) + model.aux_loss()
The dense model (num_experts=0, the default) is unchanged.

Two switches in the ModelConfig trade memory for compute (chapter 01, picotron/memory.py):
    attention="sdpa"     fused attention (FlashAttention-style): the (seq x seq) scores are never stored
    attention="eager"    scores, softmax and @V as separate ops: backward keeps the (seq x seq) probabilities
    recompute="selective"  keep only q, k, v of the attention core and recompute it in backward
    recompute="full"       keep only each layer's input and recompute the whole layer in backward
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from picotron.config import ModelConfig, check_model_choices
from picotron.fp8 import convert_to_float8


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


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The RMSNorm of config.norm_impl: torch ops, or the Triton kernels of chapter 09 (same weight and eps)."""
    if config.norm_impl == "triton":
        # A late import keeps triton out of every process that does not ask for it (and makes no cycle).
        from picotron.kernels.rmsnorm import TritonRMSNorm
        return TritonRMSNorm(dim, config.rms_norm_eps)
    return RMSNorm(dim, config.rms_norm_eps)


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

    The tables are cast to x's dtype (bf16 under autocast, as Hugging Face's Llama does): fp32
    tables would promote q and k to fp32, doubling what attention reads and what context
    parallelism sends.
    """
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)   # x: (batch, heads, seq, head_dim)


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


# ---- Mixture of experts (chapter 07; picotron/parallel/expert_parallel.py splits it over ranks) ----

@dataclass
class Routing:
    """Where a router sends each token, as a list of (token, expert) slots grouped by expert.

    A token goes to top_k experts: top_k slots. Kept slots are listed expert by expert (all of
    expert 0's, then expert 1's, ...), which is the order both the local experts and the
    all-to-all of expert parallelism need; slots over an expert's capacity are left out.
    """

    token: torch.Tensor         # (kept slots,) long: the token of each slot
    gate: torch.Tensor          # (kept slots,) fp32: its gate weight (differentiable, reaches the router)
    counts: torch.Tensor        # (experts,) long: kept slots per expert; sums to the number of kept slots
    load: torch.Tensor          # (experts,) long: slots routed to each expert, before capacity
    mean_probs: torch.Tensor    # (experts,) fp32: router probability of each expert, mean over tokens
    dropped: int                # slots over capacity: those (token, expert) pairs are skipped


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots one expert takes: capacity_factor x its share of a perfectly balanced load (GShard, Switch)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def route(router: nn.Linear, tokens: torch.Tensor, top_k: int, capacity_factor: float | None = None) -> Routing:
    """Top-k softmax gating: each token's top_k experts and their weights, slots grouped by expert.

    Softmax over all experts, keep the k largest, renormalise them to sum to 1 (Mixtral's router,
    the same as a softmax over the k chosen logits). With top_k=1 the weight is then always 1 and
    the router learns only from the load-balancing loss. The softmax runs in fp32: bf16 keeps
    ~3 digits, and a near-tie rounded there picks another expert.

    With a capacity (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021) an expert keeps its
    first `expert_capacity` slots: first choices before second choices, then in token order
    (GShard's priority). The others are dropped: the token skips that expert, and if all its
    experts are full, only the residual connection carries it on.
    """
    num_tokens = tokens.shape[0]
    probs = router(tokens).float().softmax(dim=-1)                   # (tokens, experts)
    num_experts = probs.shape[-1]
    top_probs, top_experts = probs.topk(top_k, dim=-1)               # (tokens, top_k)
    gates = top_probs / top_probs.sum(dim=-1, keepdim=True)          # renormalised over the k chosen
    # Slot s = choice * tokens + token: every token's first choice comes before any second choice.
    expert = top_experts.t().reshape(-1)                             # (top_k * tokens,)
    gate = gates.t().reshape(-1)                                     # (top_k * tokens,)
    token = torch.arange(num_tokens, device=tokens.device).repeat(top_k)   # (top_k * tokens,)
    load = torch.bincount(expert, minlength=num_experts)             # (experts,)
    order = expert.argsort(stable=True)                              # slots grouped by expert, priority kept
    counts, dropped = load, 0
    if capacity_factor is not None:
        capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
        first = load.cumsum(0) - load                                # (experts,): where each group starts in order
        place = torch.arange(order.numel(), device=order.device) - first[expert[order]]   # place in its queue
        order = order[place < capacity]                              # (kept slots,)
        counts = load.clamp(max=capacity)
        dropped = int((load - counts).sum())
    return Routing(token=token[order], gate=gate[order], counts=counts, load=load,
                   mean_probs=probs.mean(dim=0), dropped=dropped)


def load_balancing_loss(load: torch.Tensor, mean_probs: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, E * sum_i f_i P_i (Fedus et al. 2021, arXiv:2101.03961, eq. 4).

    f_i = fraction of the routed slots that went to expert i (a count: no gradient), P_i = mean
    router probability of expert i (differentiable). Both are 1/E when the load is balanced, and
    the loss is then 1; it grows when the busiest experts are also the most probable ones, and
    its gradient, E f_i for P_i, pushes probability away from them. (Hugging Face's Mixtral
    counts f over each of the k choices, so its value at balance is k, not 1.)
    """
    fraction = load.float() / load.sum()                             # (experts,) f_i, sums to 1
    return load.numel() * (fraction * mean_probs).sum()


def run_experts(experts, slots: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each expert on its consecutive block of `slots` (counts[i] rows for the i-th expert, in order).

    slots: (slots, hidden) grouped by expert -> (slots, hidden). One small matmul per expert, in a
    loop: readable; fast implementations stack the experts' weights and run one grouped GEMM.
    """
    blocks = slots.split(counts)                                     # (counts[i], hidden) each
    return torch.cat([expert(block) for expert, block in zip(experts, blocks)])


def combine(outputs: torch.Tensor, routing: Routing, num_tokens: int) -> torch.Tensor:
    """Sum each token's expert outputs, weighted by their gates: (kept slots, hidden) -> (tokens, hidden)."""
    weighted = outputs * routing.gate[:, None].to(outputs.dtype)     # (kept slots, hidden)
    combined = outputs.new_zeros(num_tokens, outputs.shape[-1])      # a token with every slot dropped stays 0
    return combined.index_add(0, routing.token, weighted)            # (tokens, hidden)


class MoE(nn.Module):
    """A mixture of SwiGLU experts: each token is computed by its top_k of num_experts MLPs.

    Sparsely gated MoE (Shazeer et al. 2017, arXiv:1701.06538): parameters grow with the number
    of experts, compute per token with top_k only. A linear router scores the experts per token
    (`route`), each expert runs on the tokens sent to it (`run_experts`), and the outputs come back
    weighted by the gates (`combine`).

    Each forward records, for the caller:
        aux_loss     moe_aux_loss_coef * load_balancing_loss: add it to the training loss
                     (Llama.aux_loss() sums the layers'); without it the router tends to send
                     most tokens to a few experts, which then get all the training
        last_load    (experts,) slots routed to each expert, before capacity: the load histogram
                     (of this forward's tokens; of the whole data-parallel batch under EP)
        last_dropped slots dropped by the capacity (0 when dropless)
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = config.num_experts, config.experts_per_token
        self.capacity_factor, self.aux_loss_coef = config.moe_capacity_factor, config.moe_aux_loss_coef
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config) for _ in range(config.num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_load: torch.Tensor | None = None
        self.last_dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])                          # (tokens, hidden), tokens = batch * seq
        routing = route(self.router, tokens, self.top_k, self.capacity_factor)
        self.record(routing, routing.load)
        slots = tokens[routing.token]                                # (kept slots, hidden), grouped by expert
        outputs = run_experts(self.experts, slots, routing.counts.tolist())   # (kept slots, hidden)
        return combine(outputs, routing, tokens.shape[0]).view(x.shape)

    def record(self, routing: Routing, load: torch.Tensor) -> None:
        """Keep the auxiliary loss and the load statistics of this forward (`load`: over the balancing batch)."""
        self.aux_loss = self.aux_loss_coef * load_balancing_loss(load, routing.mean_probs)
        self.last_load, self.last_dropped = load.detach(), routing.dropped


class DecoderLayer(nn.Module):
    """Pre-norm residual block: normalising the branch input, not the stream, keeps deep stacks stable.

    `layer_index` decides, with config.moe_every, whether the MLP is dense or a mixture of experts.
    """

    def __init__(self, config: ModelConfig, layer_index: int = 0):
        super().__init__()
        self.attn_norm = make_norm(config, config.hidden_size)
        self.attn = Attention(config)
        self.mlp_norm = make_norm(config, config.hidden_size)
        self.mlp = MoE(config) if config.is_moe_layer(layer_index) else MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LMHead(nn.Linear):
    """The LM head: logits = x W^T. Given the targets too, it returns the loss instead, computed chunk by chunk
    with the logits never whole (picotron.kernels.linear_cross_entropy, chapter 09). The loss is a call of this
    module, so hooks on the head (ZeRO-3's gathers) run around it as around the logits."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, *, chunk_tokens: int = 1024):
        if targets is None:
            return super().forward(x)
        from picotron.kernels.linear_cross_entropy import linear_cross_entropy
        return linear_cross_entropy(x, self.weight, targets, chunk_size=chunk_tokens)


class Llama(nn.Module):
    """Embedding -> decoder layers -> final norm -> LM head (weight shared with the embedding when tied)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        check_model_choices(config)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = Rotary(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()   # also ties lm_head.weight to embed.weight when configured
        if config.fp8 != "none":   # chapter 10: the Linears' matmuls in fp8 (same parameters, same names)
            convert_to_float8(self, config.fp8)

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
            elif name.endswith(("attn_norm", "mlp_norm")):   # make_norm's, torch or Triton
                nn.init.ones_(module.weight)
        nn.init.ones_(self.norm.weight)
        self.rope.reset_tables()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab). position_ids: (seq,) or (batch, seq).

        With targets (batch, seq): the mean cross-entropy loss instead, the LM head and the loss fused chunk by
        chunk (config.loss_impl == "chunked": the whole logits never exist)."""
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
        if targets is not None:
            if not isinstance(self.lm_head, LMHead):
                raise TypeError(f"the loss fused with the head needs picotron's LMHead, but lm_head is a "
                                f"{type(self.lm_head).__name__} (converted or parallelised); call the model without "
                                f"targets and apply the loss to its logits")
            return self.lm_head(self.norm(x), targets, chunk_tokens=self.config.loss_chunk_tokens)  # the loss
        return self.lm_head(self.norm(x))                     # (batch, seq, vocab)

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once: .parameters() skips repeats)."""
        return sum(p.numel() for p in self.parameters())

    def moe_layers(self) -> list[nn.Module]:
        """The mixture-of-experts blocks (any MLP with a router: MoE, or its expert-parallel version)."""
        return [layer.mlp for layer in self.layers if hasattr(layer.mlp, "router")]

    def aux_loss(self) -> torch.Tensor:
        """The MoE layers' load-balancing losses from the last forward, summed; 0 for a dense model.

        Training an MoE model: loss = loss_fn(model(ids), targets) + model.aux_loss(). Kept apart
        from the logits so that forward's output, and the dense model, stay exactly as they were.
        """
        total = torch.zeros((), device=self.norm.weight.device)
        for moe in self.moe_layers():
            if moe.aux_loss is None:
                raise RuntimeError("aux_loss() reads the MoE layers' losses of the last forward: run the model first")
            total = total + moe.aux_loss
        return total


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all tokens, in fp32 (targets == -100 are skipped)."""
    # logits: (batch, seq, vocab), targets: (batch, seq)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

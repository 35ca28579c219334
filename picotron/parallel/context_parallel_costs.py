"""What context parallelism costs, as formulas that chapters/05_context_parallel.ipynb puts next to measurements.

Communication per decoder layer and per training step, in the format picotron.comm's CommCounter
counts it (`cp_comm_per_layer`) and as bytes that leave the rank (`cp_comm_bytes_per_layer`);
activation bytes one layer saves per rank, counted like picotron.costs counts them
(`cp_activation_bytes_per_layer`); the chunk pairs and FLOPs each rank's ring attention computes
(`ring_attention_work`). The technique itself is picotron/parallel/context_parallel.py.
"""

from __future__ import annotations

from picotron.config import ModelConfig
from picotron.parallel.context_parallel import check_context_parallel
from picotron.costs import attention_core_bytes, rms_norm_bytes

__all__ = ["ring_attention_work", "cp_comm_per_layer", "cp_comm_bytes_per_layer", "cp_activation_bytes_per_layer"]


def ring_attention_work(batch: int, seq: int, heads: int, head_dim: int, cp: int, zigzag: bool = False,
                        backward: bool = False) -> list[dict[str, int]]:
    """Per rank: the chunk pairs (query chunk x key chunk) ring attention computes in one pass, and their matmul FLOPs.

    A query chunk computes against every key chunk at or before it (the diagonal one masked inside,
    the later ones skipped). Contiguous slices: rank r's one chunk sees the chunks of ranks 0..r,
    r+1 pairs of (s/cp)^2. Zig-zag (chunks r and 2cp-1-r of 2cp): 3 pairs among its own chunks and
    2 with every other rank's, 2cp+1 pairs of (s/2cp)^2 on every rank, so the slowest rank does
    (2cp+1)/(4cp) of the contiguous layout's slowest: about half. A pair of chunks of c queries and
    c keys costs 2 matmuls of 2 c^2 d FLOPs per head forward, 5 backward (scores again, dV, dP, dQ, dK).
    """
    chunks = 2 * cp if zigzag else cp
    c = seq // chunks
    per_pair = (5 if backward else 2) * 2 * batch * heads * c * c * head_dim
    blocks = [2 * cp + 1] * cp if zigzag else [rank + 1 for rank in range(cp)]
    return [{"blocks": count, "flops": count * per_pair} for count in blocks]


def cp_comm_per_layer(config: ModelConfig, batch: int, seq: int, cp: int, mode: str,
                      dtype_bytes: int = 4) -> dict[str, dict[str, tuple[int, int]]]:
    """What one decoder layer hands to the collectives on each rank, as CommCounter counts it.

    {"forward": {op: (calls, payload bytes)}, "backward": {...}}. Ring and zig-zag: the K,V block,
    2 a b (s/cp) n_kv d, sent cp-1 times forward and again backward, plus its fp32 gradient sent cp
    times backward. Ulysses: 4 all-to-alls of q, k, v, output per pass, the whole local tensor
    each. Without recomputation ("selective" and "full" run the forward's once more in backward).
    """
    check_context_parallel(config, cp, mode)
    if cp == 1:
        return {"forward": {}, "backward": {}}
    tokens, d = batch * (seq // cp), config.head_dim
    if mode == "ulysses":
        both = {"all_to_all": (4, dtype_bytes * tokens * d * (2 * config.num_attention_heads
                                                              + 2 * config.num_key_value_heads))}
        return {"forward": both, "backward": dict(both)}
    kv_block = 2 * tokens * config.num_key_value_heads * d                       # elements of K and V
    return {"forward": {"send": (cp - 1, (cp - 1) * kv_block * dtype_bytes)},
            "backward": {"send": (2 * cp - 1, (cp - 1) * kv_block * dtype_bytes + cp * kv_block * 4)}}


def cp_comm_bytes_per_layer(config: ModelConfig, batch: int, seq: int, cp: int, mode: str,
                            dtype_bytes: int = 4) -> int:
    """Bytes each rank puts on the wire per layer per training step (forward + backward).

    A ring hop sends all it is given; an all-to-all keeps 1/cp of its input (the piece for itself)
    and sends the rest. For comparison: the ring's total barely changes with cp, Ulysses' falls as 1/cp.
    """
    counted = cp_comm_per_layer(config, batch, seq, cp, mode, dtype_bytes)
    total = sum(nbytes for pass_ in counted.values() for _, nbytes in pass_.values())
    return total * (cp - 1) // cp if mode == "ulysses" else total


def cp_activation_bytes_per_layer(config: ModelConfig, batch: int, seq: int, cp: int, mode: str = "zigzag",
                                  dtype_bytes: int = 4) -> int:
    """Bytes one decoder layer saves for backward on each cp rank, counted like costs.activation_bytes_per_layer.

    Every term of that formula is per token, so with n = b s/cp tokens on this rank (a bytes per
    element, h hidden, n_q / n_kv heads of width d, f MLP width):

        RMSNorm, twice   (4 + 2a) n h + 4 n
        attention        a n (2 n_q d + 2 n_kv d)      q, k after RoPE, v, output
            ring         + 4 b n_q s/cp                fp32 log-sum-exp (whatever config.attention says)
            Ulysses      + costs.attention_core_bytes at the full s, / cp (the core sees n_q/cp heads
                         of all s tokens: eager's probabilities are a b n_q s^2 / cp, not / cp^2)
                         + a n n_q d under sdpa        its output twice: SDPA keeps it in head slices for
                                                       its backward, o_proj in sequence slices (eager's
                                                       core keeps no output, only o_proj does)
        SwiGLU MLP       4 a n f
    "selective" recomputation drops the two core lines, "full" keeps a n h, the layer input.
    At cp=1 this is the plain model's formula (for "ring"/"zigzag" with attention="sdpa").
    """
    check_context_parallel(config, cp, mode)
    a, h, d = dtype_bytes, config.hidden_size, config.head_dim
    tokens = batch * (seq // cp)
    if config.recompute == "full":
        return a * tokens * h
    norms = 2 * rms_norm_bytes(tokens, h, a)
    attention = a * tokens * (2 * config.num_attention_heads * d + 2 * config.num_key_value_heads * d)
    mlp = 4 * a * tokens * config.intermediate_size
    if config.recompute == "none":
        if mode == "ulysses":
            attention += attention_core_bytes(config, batch, seq, a) // cp
            if cp > 1 and config.attention == "sdpa":
                attention += a * tokens * config.num_attention_heads * d
        else:
            attention += 4 * batch * config.num_attention_heads * (seq // cp)
    return norms + attention + mlp

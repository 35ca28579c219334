"""Online softmax: attention computed one block of keys at a time, on one device.

softmax over a row can be built block by block: keep the running maximum m and the running sum
of exp(score - m); when a new block raises the maximum, rescale what is already summed by
exp(m_old - m_new). For attention the same merge combines partial outputs, each with its row's
log-sum-exp (Milakov and Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022,
arXiv:2205.14135). This is what lets ring attention (picotron/parallel/context_parallel.py) see
the keys of other ranks one block at a time and still compute exact softmax attention
(chapters/05_context_parallel.ipynb, section 2.1).

    online_softmax            softmax over the last dimension, read one block at a time
    attention_block           attention over one block of keys: output and fp32 log-sum-exp per row
    merge_blocks              merge a new block into the running output (the log-sum-exp rule)
    online_softmax_attention  blockwise causal attention from those, equal to softmax attention
"""

from __future__ import annotations

import math

import torch

__all__ = ["online_softmax", "attention_block", "merge_blocks", "online_softmax_attention", "group_heads",
           "future_mask"]


def online_softmax(scores: torch.Tensor, num_blocks: int = 4) -> torch.Tensor:
    """softmax(scores) over the last dimension, reading the scores one block at a time.

    softmax(x)_j = exp(x_j - m) / l with m = max x (so exp never overflows) and l = sum_j exp(x_j - m).
    Both build up block by block (Milakov & Gimelshein 2018, arXiv:1805.02867): when a block raises
    the running max from m to m', the sum so far is rescaled by exp(m - m') and the block's own
    terms are added. Attention goes one step further (`merge_blocks`): it rescales the running
    *output* the same way, so it never needs the scores again; log l + m is the log-sum-exp.
    """
    m = torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype, device=scores.device)  # running max
    l = torch.zeros_like(m)                                                                      # running sum
    for block in scores.chunk(num_blocks, dim=-1):
        new_m = torch.maximum(m, block.amax(dim=-1))
        l = l * torch.exp(m - new_m) + torch.exp(block - new_m[..., None]).sum(dim=-1)
        m = new_m
    return torch.exp(scores - m[..., None]) / l[..., None]


def group_heads(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, seq, d) -> (batch, kv_heads, heads/kv_heads, seq, d): the query heads that share
    a key/value head side by side (query head i reads key/value head i // groups, as in HF's repeat_kv)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads))


def future_mask(size: int, like: torch.Tensor) -> torch.Tensor:
    """(size, size) additive mask: -inf where the key comes after the query."""
    return torch.full((size, size), float("-inf"), dtype=like.dtype, device=like.device).triu(1)


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v over one block of keys, and each query row's log-sum-exp (fp32).

    q: (batch, heads, sq, d); k, v: (batch, kv_heads, sk, d), kv_heads dividing heads (GQA: no copy
    of k and v is made). causal=True for a block on the diagonal (queries and keys are the same
    positions): a query sees itself and the keys before it. The log-sum-exp, lse = log sum_j
    exp(score_j), is what `merge_blocks` needs to put blocks together.
    """
    batch, kv_heads, sk, d = k.shape
    scores = group_heads(q, kv_heads) @ k.unsqueeze(2).transpose(-2, -1) / math.sqrt(d)  # (b, kv, g, sq, sk)
    if causal:
        scores = scores + future_mask(sk, scores)
    lse = torch.logsumexp(scores.float(), dim=-1)                                     # (b, kv, g, sq)
    probs = torch.exp(scores.float() - lse[..., None]).to(v.dtype)
    out = probs @ v.unsqueeze(2)                                                      # (b, kv, g, sq, d)
    return out.flatten(1, 2), lse.flatten(1, 2)                             # (b, heads, sq, d), (b, heads, sq)


def merge_blocks(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                 block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax: combine the attention over keys seen so far with that over a new block.

    Each output is a softmax-weighted mean, sum_j exp(score_j - lse) v_j. Over the union of two
    key sets the normaliser is lse = log(exp(lse_1) + exp(lse_2)), and each part's mean is
    reweighted by its share exp(lse_i - lse) of the total. Working with logs keeps exp from
    overflowing (the role of the running max). Out and lse start as None (no keys yet); the
    result is in fp32.
    """
    block_out = block_out.float()
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)                                          # (b, heads, sq)
    out = out * torch.exp(lse - new_lse)[..., None] + block_out * torch.exp(block_lse - new_lse)[..., None]
    return out, new_lse


def online_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_blocks: int = 4,
                             causal: bool = True) -> torch.Tensor:
    """Causal (or full) attention on one device, computed `num_blocks` x `num_blocks` blocks at a time.

    Query block i meets key blocks 0..i (causal: later blocks are the future, skipped; block i is
    the diagonal), merging them with the online softmax. Equal to softmax attention; the same
    loop is what ring attention runs, with the key blocks arriving from other ranks. Plain torch
    ops, so autograd differentiates it. q: (batch, heads, seq, d), k, v: (batch, kv_heads, seq, d).
    """
    seq = q.shape[2]
    if seq % num_blocks:
        raise ValueError(f"sequence of {seq} tokens does not split into num_blocks={num_blocks} equal blocks; "
                         f"choose num_blocks among the divisors of {seq}")
    outs = []
    for i, q_block in enumerate(q.chunk(num_blocks, dim=2)):                     # (b, heads, seq/blocks, d)
        out = lse = None
        for j, (k_block, v_block) in enumerate(zip(k.chunk(num_blocks, dim=2), v.chunk(num_blocks, dim=2))):
            if causal and j > i:
                break
            out, lse = merge_blocks(out, lse, *attention_block(q_block, k_block, v_block, causal and i == j))
        outs.append(out.to(q.dtype))
    return torch.cat(outs, dim=2)                                                # (b, heads, seq, d)

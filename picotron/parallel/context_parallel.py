"""Context parallelism: every rank holds a slice of each sequence; attention is the only op that must talk.

Chapter 05 (chapters/05_context_parallel.ipynb) builds and measures it. Everything in a decoder layer
but attention works token by token, so each of the cp ranks computes s/cp tokens of every sequence
with the whole model replicated (its gradients averaged over dp x cp, as in data parallelism).
Attention gets the keys and values it lacks in one of three ways (`CP_MODES`):

    ring       the queries stay, the key/value blocks travel round the ring of cp ranks, merged
               with the online softmax (picotron/parallel/online_softmax.py); each hop is posted
               before the block it overlaps is computed
    zigzag     the same ring, rank r holding chunks r and 2cp-1-r of 2cp: balanced causal work
    ulysses    all-to-alls swap (tokens/cp, all heads) for (all tokens, heads/cp), ordinary attention
               runs per head, and a second all-to-all swaps back

Its cost formulas are in picotron/parallel/context_parallel_costs.py.

    model = apply_context_parallel(Llama(config), mesh, mode="zigzag")
    batch = DataLoader(..., cp_rank=mesh.cp_rank, cp_size=mesh.cp_size, zigzag=True).get_batch(step)
    loss_fn(model(batch.input_ids, batch.position_ids), batch.targets).backward()
    all_reduce_gradients(model, mesh.dp_cp_group)    # average over dp x cp

The model file is untouched: `apply_context_parallel` replaces each layer's `Attention.attend`
(the attention core between RoPE and o_proj) with a `ContextParallelCore`. It composes with
tensor parallelism (each tp rank attends over its heads; Ulysses then needs heads/tp divisible
by cp) and with recomputation (a recomputed core runs its ring or all-to-alls again in backward).
The collectives go through picotron.comm (the ring's own hops are recorded with comm.record); to
count them, open `comm.counting(counter)` around the forward and the backward.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from picotron import comm
from picotron.config import ModelConfig
from picotron.data import cp_chunks, cp_positions
from picotron.parallel.online_softmax import attention_block, future_mask, group_heads, merge_blocks

__all__ = ["CP_MODES", "check_context_parallel", "take_cp_tokens", "gather_sequence", "AttentionWork", "RingAttention",
           "ring_attention", "UlyssesAllToAll",
           "ulysses_attention", "ContextParallelCore", "apply_context_parallel", "whole_sequence", "replay_ring_work"]


CP_MODES = ("ring", "zigzag", "ulysses")


def check_context_parallel(model: ModelConfig, cp: int, mode: str, seq_len: int | None = None, tp: int = 1) -> None:
    """Raise ValueError naming the fix if `mode` cannot split this model (and seq_len) over cp ranks."""
    if mode not in CP_MODES:
        raise ValueError(f"cp_mode={mode!r} is not a context-parallel mode; choose one of {CP_MODES}")
    heads, kv_heads = model.num_attention_heads // tp, model.num_key_value_heads // tp
    if mode == "ulysses" and (heads % cp or kv_heads % cp):
        raise ValueError(f"Ulysses splits the heads over cp={cp} ranks, but cp={cp} does not divide the {heads} "
                         f"query and {kv_heads} key/value heads{' per tp rank' if tp > 1 else ''}; choose a cp "
                         f"dividing both, or cp_mode='ring' or 'zigzag'")
    chunks = 2 * cp if mode == "zigzag" and cp > 1 else cp
    if seq_len is not None and seq_len % chunks:
        why = f"zig-zag cuts it into 2*cp = {chunks} chunks" if mode == "zigzag" else f"each of {cp} ranks holds 1/cp"
        raise ValueError(f"seq_len={seq_len} does not split for cp_mode={mode!r} ({why}); "
                         f"choose a seq_len that is a multiple of {chunks}")


# ---- who holds which tokens ---------------------------------------------------------------------
def take_cp_tokens(x: torch.Tensor, cp_rank: int, cp_size: int, zigzag: bool = False, dim: int = 2) -> torch.Tensor:
    """This cp rank's tokens of a whole-sequence tensor (no communication), along `dim`."""
    index = cp_positions(x.shape[dim], cp_rank, cp_size, zigzag).to(x.device)
    return x.index_select(dim, index)


def gather_sequence(pieces: list[torch.Tensor], zigzag: bool = False, dim: int = 2) -> torch.Tensor:
    """The inverse of `take_cp_tokens`: the whole sequence from every rank's piece (rank order)."""
    cp_size, seq = len(pieces), sum(p.shape[dim] for p in pieces)
    index = torch.cat([cp_positions(seq, r, cp_size, zigzag) for r in range(cp_size)]).to(pieces[0].device)
    whole = torch.cat(pieces, dim=dim)
    return whole.index_select(dim, torch.argsort(index))        # put each position back in its place


# ---- ring attention --------------------------------------------------------------------------------
@dataclass
class AttentionWork:
    """What ring attention did on this rank, added up over calls: chunk pairs (query chunk x key chunk)
    computed, their matmul FLOPs, seconds computing them and seconds waiting for a transfer.

    Pass one to `ring_attention` (or `apply_context_parallel`) to see the causal imbalance: with
    contiguous slices the last rank computes cp times the first's blocks and the first waits
    (context_parallel_costs.ring_attention_work writes the counts down).
    """

    blocks: int = 0
    flops: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0

    def reset(self) -> None:
        self.blocks, self.flops, self.compute_seconds, self.wait_seconds = 0, 0, 0.0, 0.0


def _pairs(q_chunks: list[int], kv_chunks: list[int]) -> Iterator[tuple[int, int, bool]]:
    """(i, j, causal) for each query chunk i and key chunk j it can see: j earlier (all of it) or
    the same chunk (the diagonal, causal). Later key chunks are the future: skipped, no work."""
    for i, q_chunk in enumerate(q_chunks):
        for j, kv_chunk in enumerate(kv_chunks):
            if kv_chunk <= q_chunk:
                yield i, j, kv_chunk == q_chunk


class _RingHop:
    """One hop in flight: our tensor on its way to the next rank, the previous rank's on its way here.

    Both sides are posted at once (a rank that only sent would wait for a neighbour that is also
    only sending); `wait` returns the received tensor. picotron.comm.send_recv does the same but
    blocks, and the point here is to compute while the bytes move, so the hop is posted with
    batch_isend_irecv and recorded (comm.record) as comm.send_recv counts it ("send").
    """

    def __init__(self, tensor: torch.Tensor, group):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        next_rank, prev_rank = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
        self.outgoing, self.incoming = tensor, torch.empty_like(tensor)   # both must live until wait()
        comm.record("send", tensor)
        self.requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, next_rank, group),
                                                dist.P2POp(dist.irecv, self.incoming, prev_rank, group)])

    def wait(self, work: AttentionWork | None = None) -> torch.Tensor:
        start = time.perf_counter()
        for request in self.requests:
            request.wait()
        if work is not None:
            work.wait_seconds += time.perf_counter() - start
        return self.incoming


def _block_grads(q, k, v, dout, lse, delta, causal):
    """dq, dk, dv of one block's share of the attention, given the whole row's lse and delta.

    The probabilities of this block are exp(score - lse) with the *final* lse (FlashAttention's
    backward, Dao et al. 2022, arXiv:2205.14135): recomputed, never stored. With dS = P (dP - delta),
    delta = rowsum(dO * O): dV = P^T dO, dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    Shapes as in `attention_block`; lse, delta: (batch, heads, sq) fp32.
    """
    kv_heads, d = k.shape[1], k.shape[-1]
    qg, doutg = group_heads(q, kv_heads), group_heads(dout, kv_heads)           # (b, kv, g, sq, d)
    k, v = k.unsqueeze(2), v.unsqueeze(2)                                          # (b, kv, 1, sk, d)
    scores = qg @ k.transpose(-2, -1) / math.sqrt(d)                               # (b, kv, g, sq, sk)
    if causal:
        scores = scores + future_mask(k.shape[-2], scores)
    probs = torch.exp(scores.float() - group_heads(lse, kv_heads)[..., None])
    dv = (probs.transpose(-2, -1) @ doutg.float()).sum(2)                          # (b, kv, sk, d): over the group
    dprobs = doutg.float() @ v.transpose(-2, -1).float()                           # (b, kv, g, sq, sk)
    dscores = probs * (dprobs - group_heads(delta, kv_heads)[..., None]) / math.sqrt(d)
    dq = (dscores @ k.float()).flatten(1, 2)                                       # (b, heads, sq, d)
    dk = (dscores.transpose(-2, -1) @ qg.float()).sum(2)                           # (b, kv, sk, d)
    return dq, dk, dv


def _record(work: AttentionWork | None, start: float, blocks: int, flops: int) -> None:
    if work is not None:
        work.compute_seconds += time.perf_counter() - start
        work.blocks += blocks
        work.flops += flops


def _pair_flops(q_chunk: torch.Tensor, matmuls: int) -> int:
    """FLOPs of one chunk pair: `matmuls` (c x d) @ (d x c) products per query head, 2 c^2 d each."""
    batch, heads, c, d = q_chunk.shape
    return matmuls * 2 * batch * heads * c * c * d


class RingAttention(torch.autograd.Function):
    """Causal attention over a sequence split over the ranks of `group`, blocks of keys passed round.

    Forward, step t = 0 .. cp-1: this rank holds the key/value block of rank (me - t) mod cp. It posts
    the hop that passes the block on (and brings the next one in), then computes its query chunks
    against the block's key chunks (`_pairs`: skip the future, causal on the diagonal, full for the
    past) and merges them into its output with the online softmax.

    Backward, same steps: dQ stays here; dK and dV of a block travel with it, each rank adding the
    gradient its queries give that block's keys, and after a last hop every block's gradient is
    back with its owner, complete. Saves q, k, v, the output and the fp32 log-sum-exp.
    """

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag, work):
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        mine = cp_chunks(me, cp, zigzag)
        n = len(mine)
        if q.shape[2] % n:
            raise ValueError(f"zig-zag ring attention needs an even number of local tokens (two chunks), got "
                             f"{q.shape[2]}; the sequence length must be a multiple of 2*cp = {2 * cp}")
        batch, heads, seq, d = q.shape                                # seq: this rank's s/cp tokens
        outs, lses = [None] * n, [None] * n
        q_chunks = q.chunk(n, dim=2)                                  # (b, heads, s/cp/n, d) each
        kv = torch.stack([k, v])                                      # (2, b, kv_heads, s/cp, d): one message
        for step in range(cp):
            hop = _RingHop(kv, group) if step < cp - 1 else None   # the next block moves meanwhile
            theirs = cp_chunks((me - step) % cp, cp, zigzag)
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            start, pairs = time.perf_counter(), list(_pairs(mine, theirs))
            for i, j, causal in pairs:
                block = attention_block(q_chunks[i], k_chunks[j], v_chunks[j], causal)
                outs[i], lses[i] = merge_blocks(outs[i], lses[i], *block)
            _record(work, start, len(pairs), len(pairs) * _pair_flops(q_chunks[0], matmuls=2))
            if hop is not None:
                kv = hop.wait(work)
        # Laid out (batch, seq, heads, d) like q, so o_proj reads the output without a copy.
        out = q.new_empty(batch, seq, heads, d).transpose(1, 2)       # (b, heads, s/cp, d)
        out.copy_(torch.cat(outs, dim=2))
        lse = torch.cat(lses, dim=2)                                  # (b, heads, s/cp) fp32
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag, ctx.work = group, zigzag, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, zigzag, work = ctx.group, ctx.zigzag, ctx.work
        cp, me = dist.get_world_size(group), dist.get_rank(group)
        mine = cp_chunks(me, cp, zigzag)
        n = len(mine)
        delta = (dout.float() * out.float()).sum(-1)                  # (b, heads, s/cp): rowsum(dO * O)
        q_chunks, dout_chunks = q.chunk(n, dim=2), dout.chunk(n, dim=2)
        lse_chunks, delta_chunks = lse.chunk(n, dim=2), delta.chunk(n, dim=2)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_chunks = dq.chunk(n, dim=2)                                # views: adding into them fills dq
        kv = torch.stack([k, v])                                      # (2, b, kv_heads, s/cp, d)
        grad_hop = None
        for step in range(cp):
            hop = _RingHop(kv, group) if step < cp - 1 else None
            theirs = cp_chunks((me - step) % cp, cp, zigzag)
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this block's, from our queries
            dk_chunks, dv_chunks = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            start, pairs = time.perf_counter(), list(_pairs(mine, theirs))
            for i, j, causal in pairs:
                dq_ij, dk_ij, dv_ij = _block_grads(q_chunks[i], k_chunks[j], v_chunks[j], dout_chunks[i],
                                                   lse_chunks[i], delta_chunks[i], causal)
                dq_chunks[i].add_(dq_ij)
                dk_chunks[j].add_(dk_ij)
                dv_chunks[j].add_(dv_ij)
            _record(work, start, len(pairs), len(pairs) * _pair_flops(q_chunks[0], matmuls=5))
            if grad_hop is not None:                                  # what the ranks before us gave this block
                dkv += grad_hop.wait(work)
            grad_hop = _RingHop(dkv, group) if cp > 1 else None   # fp32: c additions, no bf16 rounding
            if hop is not None:
                kv = hop.wait(work)
        if grad_hop is not None:
            dkv = grad_hop.wait(work)                                 # our own block, every rank's share added
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, zigzag: bool = False,
                   work: AttentionWork | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, split over `group`.

    q: (batch, heads, s/cp, d), k, v: (batch, kv_heads, s/cp, d), this rank's tokens: a contiguous
    slice (rank r: [r s/cp, (r+1) s/cp)) or, with zigzag=True, chunks r and 2cp-1-r of 2 cp.
    Returns (batch, heads, s/cp, d), this rank's rows of softmax(q k^T / sqrt(d)) v.
    """
    return RingAttention.apply(q, k, v, group, zigzag, work)


# ---- Ulysses -----------------------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Cut `x` into cp pieces along scatter_dim, send piece j to rank j, join what arrives along gather_dim."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim))                  # (cp, ...): piece j goes to rank j
    received = torch.empty_like(send)                                 # received[j]: rank j's piece for us
    comm.all_to_all(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)              # rank 0's piece first


class UlyssesAllToAll(torch.autograd.Function):
    """Ulysses' exchange: move the split of a tensor from one dimension to another (sequence <-> heads);
    backward moves it back."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _causal_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                      attend: Callable = _causal_sdpa) -> torch.Tensor:
    """Causal attention with the sequence split over `group`, by swapping the split to the heads.

    q: (batch, heads, s/cp, d), k, v: (batch, kv_heads, s/cp, d), contiguous slices in rank order.
    `attend` is any causal attention over a whole sequence (the model's own core by default).
    """
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"Ulysses gives each of the cp={cp} ranks whole heads, but there are {q.shape[1]} query "
                         f"and {k.shape[1]} key/value heads; choose cp dividing both, or use ring attention")
    # (batch, heads, s/cp, d) -> (batch, heads/cp, s, d): all tokens, our heads
    q, k, v = (UlyssesAllToAll.apply(t, 1, 2, group) for t in (q, k, v))
    out = attend(q, k, v)                                             # (batch, heads/cp, s, d)
    return UlyssesAllToAll.apply(out, 2, 1, group)                    # (batch, heads, s/cp, d)


# ---- applying it to the Llama -----------------------------------------------------------------------
class ContextParallelCore:
    """Stands in for one layer's `Attention.attend`: q, k, v of this rank's tokens -> their output.

    `whole_sequence` switches it off (enabled=False): then it is the layer's own core again.
    """

    def __init__(self, local_attend: Callable, group, mode: str, work: AttentionWork | None = None):
        self.local_attend, self.group, self.mode = local_attend, group, mode
        self.work, self.enabled = work, True

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.enabled or dist.get_world_size(self.group) == 1:
            return self.local_attend(q, k, v)
        if self.mode == "ulysses":
            return ulysses_attention(q, k, v, self.group, attend=self.local_attend)
        return ring_attention(q, k, v, self.group, zigzag=self.mode == "zigzag", work=self.work)

    def __repr__(self) -> str:
        return f"ContextParallelCore(mode={self.mode!r}, cp={dist.get_world_size(self.group)})"


def apply_context_parallel(model, mesh, mode: str = "zigzag", *, work: AttentionWork | None = None):
    """Make every layer of a Llama attend over a sequence split over mesh.cp_group, in place.

    Afterwards feed each cp rank its tokens and their position ids (`cp_positions`; the loader's
    cp_rank/cp_size/zigzag do it): model(input_ids, position_ids) -> (batch, s/cp, vocab) logits of
    those tokens. mode: "ring" (contiguous slices), "zigzag" (ring, balanced layout) or "ulysses"
    (contiguous slices, heads all-to-all). Under "ring" and "zigzag" ring attention is the whole
    core, so the model's attention="eager" or "sdpa" makes no difference; Ulysses wraps the
    model's own core.
    """
    check_context_parallel(model.config, mesh.cp_size, mode, tp=mesh.tp_size)   # tp: heads per rank
    for layer in model.layers:
        attn = layer.attn
        local = attn.attend.local_attend if isinstance(attn.attend, ContextParallelCore) else attn.attend
        attn.attend = ContextParallelCore(local, mesh.cp_group, mode, work)   # shadows the method
    return model


@contextmanager
def whole_sequence(model) -> Iterator[None]:
    """Inside, every rank attends over the whole sequence it is given, as without CP.

    For evaluation on short, odd-length prompts: each cp rank holds all the weights, so each can
    compute the full logits alone (cp times the work of splitting, no communication).
    """
    cores = [layer.attn.attend for layer in model.layers if isinstance(layer.attn.attend, ContextParallelCore)]
    for core in cores:
        core.enabled = False
    try:
        yield
    finally:
        for core in cores:
            core.enabled = True


# ---- replaying each rank's work ---------------------------------------------------------------
def replay_ring_work(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, zigzag: bool = False,
                     repeats: int = 3) -> list[dict[str, float]]:
    """Each cp rank's forward ring-attention computations, replayed one rank after another on this device.

    q: (batch, heads, s, d), k, v: (batch, kv_heads, s, d), the whole sequence. For every rank, the
    chunk pairs it would compute at each ring step (`_pairs`), timed together (best of `repeats`):
    per-rank blocks, FLOPs and seconds without the noise of cp ranks sharing a few CPU cores or
    waiting for each other (an `AttentionWork` passed to ring_attention measures the real run).
    """
    per_rank = []
    for rank in range(cp):
        mine = cp_chunks(rank, cp, zigzag)
        n = len(mine)
        q_chunks = take_cp_tokens(q, rank, cp, zigzag).chunk(n, dim=2)
        blocks = []                                   # (key chunks, value chunks, pairs) at each ring step
        for src in ((rank - step) % cp for step in range(cp)):
            k_chunks = take_cp_tokens(k, src, cp, zigzag).chunk(n, dim=2)
            v_chunks = take_cp_tokens(v, src, cp, zigzag).chunk(n, dim=2)
            blocks.append((k_chunks, v_chunks, list(_pairs(mine, cp_chunks(src, cp, zigzag)))))
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            for k_chunks, v_chunks, pairs in blocks:
                for i, j, causal in pairs:
                    attention_block(q_chunks[i], k_chunks[j], v_chunks[j], causal)
            best = min(best, time.perf_counter() - start)
        count = sum(len(pairs) for _, _, pairs in blocks)
        per_rank.append({"blocks": count, "flops": count * _pair_flops(q_chunks[0], matmuls=2), "seconds": best})
    return per_rank

"""The checks of assignment 05 pass correct answers and fail planted wrong ones.

The correct answers are written here, not taken from the solution notebook (which runs under
nbval on its own), so a check that passes everything, or nothing, is caught. Nothing here uses
picotron.parallel.context_parallel, except to see that the checks refuse it.
"""

import math
import time

import pytest
import torch
import torch.distributed as dist

from picotron.launch import run
from picotron_course import checks_cp
from picotron_course.checks_cp import (check_attend_block, check_attention_2d, check_layout, check_merge,
                                       check_mesh_2d, check_ring_attention)

INF = math.inf


# ---- correct answers ------------------------------------------------------------------------------
def ref_chunks(cp_rank, cp_size, zigzag):
    return sorted({cp_rank, 2 * cp_size - 1 - cp_rank}) if zigzag else [cp_rank]


def ref_positions(seq_len, cp_rank, cp_size, zigzag):
    chunks = 2 * cp_size if zigzag else cp_size
    return torch.arange(seq_len).view(chunks, -1)[ref_chunks(cp_rank, cp_size, zigzag)].flatten()


def ref_merge(out, lse, block_out, block_lse):
    """The max subtracted by hand; a zero total (no key on either side) gives out 0, lse -inf."""
    top = torch.maximum(lse, block_lse)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    a, b = torch.exp(lse - top), torch.exp(block_lse - top)
    total = a + b
    merged = (out * a[..., None] + block_out * b[..., None]) / total.clamp_min(1e-30)[..., None]
    return merged, top + torch.log(total)


def ref_block_attention(q, k, v, mask):
    """Grouped heads without copying K/V; mask (sq, sk) bool or None."""
    b, kv_heads, sk, d = k.shape
    qg = q.unflatten(1, (kv_heads, -1))                                   # (b, kv, g, sq, d)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k) / math.sqrt(d)
    if mask is not None:
        scores = scores.masked_fill(~mask, -INF)
    lse = torch.logsumexp(scores, -1)
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v).flatten(1, 2), lse.flatten(1, 2)


def ref_attend_block(out, lse, q, k, v, q_chunks, kv_chunks):
    """Masks built from positions: a pair is skipped when none of its keys is visible."""
    c = q.shape[2] // len(q_chunks)
    outs, lses = list(out.split(c, 2)), list(lse.split(c, 2))
    for i, qc in enumerate(q_chunks):
        q_pos = torch.arange(qc * c, (qc + 1) * c)
        for j, kc in enumerate(kv_chunks):
            k_pos = torch.arange(kc * c, (kc + 1) * c)
            mask = q_pos[:, None] >= k_pos[None, :]
            if not mask.any():
                continue
            part = ref_block_attention(q[:, :, i * c:(i + 1) * c], k[:, :, j * c:(j + 1) * c],
                                       v[:, :, j * c:(j + 1) * c], mask)
            outs[i], lses[i] = ref_merge(outs[i], lses[i], *part)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _start(q):
    return torch.zeros(q.shape), torch.full(q.shape[:-1], -INF)


def ref_ring(q, k, v, group, zigzag, attend=ref_attend_block):
    """K and V as two messages, dist.isend / dist.irecv with their own waits."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    out, lse = _start(q)
    for step in range(cp):
        if step < cp - 1:
            k_in, v_in = torch.empty_like(k), torch.empty_like(v)
            requests = [dist.isend(k, nxt, group), dist.isend(v, nxt, group),
                        dist.irecv(k_in, prv, group), dist.irecv(v_in, prv, group)]
        source = (me - step) % cp
        out, lse = attend(out, lse, q, k, v, ref_chunks(me, cp, zigzag), ref_chunks(source, cp, zigzag))
        if step < cp - 1:
            for request in requests:
                request.wait()
            k, v = k_in, v_in
    return out


def _p2p(kv, incoming, group, me, cp):
    """One hop posted with group ranks (group_peer=)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, group=group, group_peer=(me + 1) % cp),
                                   dist.P2POp(dist.irecv, incoming, group=group, group_peer=(me - 1) % cp)])


def ref_ring_group_peer(q, k, v, group, zigzag):
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = _start(q)
    kv = torch.cat([k, v], dim=1)                      # (b, 2 kv_heads, s/cp, d)
    for step in range(cp):
        incoming = torch.empty_like(kv)
        hop = _p2p(kv, incoming, group, me, cp) if step < cp - 1 else []
        kk, vv = kv.chunk(2, dim=1)
        out, lse = ref_attend_block(out, lse, q, kk, vv, ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
        for request in hop:
            request.wait()
        kv = incoming
    return out



# ---- 2-D context parallelism (the stretch part) --------------------------------------------------------
def ref_groups_2d(rank, u, r):
    node, place = divmod(rank, u)
    return list(range(node * u, node * u + u)), list(range(place, u * r, u))


def ref_positions_2d(seq_len, rank, u, r, zigzag):
    node, place = divmod(rank, u)
    return ref_positions(seq_len, node, r, zigzag).view(u, -1)[place]


def _heads_fit(q, k, group):
    u = dist.get_world_size(group)
    if q.shape[1] % u or k.shape[1] % u:
        raise ValueError(f"u={u} must divide the {q.shape[1]} query and {k.shape[1]} key/value heads")
    return u


def _swap(x, scatter_dim, gather_dim, group):
    """One all_to_all_single: piece i of scatter_dim to rank i, what arrives joined along gather_dim in rank order."""
    u = dist.get_world_size(group)
    send = torch.stack(x.chunk(u, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag, ring=ref_ring):
    _heads_fit(q, k, ulysses_group)
    q, k, v = (_swap(t, 1, 2, ulysses_group) for t in (q, k, v))          # (b, heads/u, s/r, d): ring rank g's tokens
    return _swap(ring(q, k, v, ring_group, zigzag), 2, 1, ulysses_group)  # (b, heads, s/cp, d)


def ref_attention_2d_lists(q, k, v, ulysses_group, ring_group, zigzag):
    """dist.all_to_all on lists, K and V in one exchange, no all-to-all at all where u = 1, the group_peer ring."""
    u = _heads_fit(q, k, ulysses_group)

    def swap(x, scatter_dim, gather_dim):
        if u == 1:
            return x
        pieces = [p.contiguous() for p in x.chunk(u, dim=scatter_dim)]
        received = [torch.empty_like(p) for p in pieces]
        dist.all_to_all(received, pieces, group=ulysses_group)
        return torch.cat(received, dim=gather_dim)

    kv_heads = k.shape[1]
    q = swap(q, 1, 2)
    kv = swap(torch.stack([k, v], dim=2).flatten(1, 2), 1, 2).unflatten(1, (kv_heads // u, 2))   # k0 v0 k1 v1 ...
    return swap(ref_ring_group_peer(q, kv[:, :, 0], kv[:, :, 1], ring_group, zigzag), 2, 1)


CORRECT = [(check_layout, (ref_chunks, ref_positions)), (check_merge, (ref_merge,)),
           (check_attend_block, (ref_attend_block,)), (check_ring_attention, (ref_ring,)),
           (check_ring_attention, (ref_ring_group_peer,)), (check_mesh_2d, (ref_groups_2d, ref_positions_2d)),
           (check_attention_2d, (ref_attention_2d,)), (check_attention_2d, (ref_attention_2d_lists,))]


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"layout": 10, "merge": 8, "attend_block": 8, "ring_attention": 8, "mesh_2d": 12, "attention_2d": 12}


@pytest.mark.parametrize("check, answers", CORRECT, ids=["layout", "merge", "attend_block", "ring", "ring_group_peer",
                                                         "mesh_2d", "attention_2d",
                                                         "attention_2d_lists"])
def test_correct_answer_passes(check, answers, every_case):
    if answers == (ref_attention_2d_lists,) and not run(_gloo_all_to_all_on_lists, 2, backend="gloo")[0]:
        with pytest.raises(AssertionError, match="raised RuntimeError.*call all_to_all_single"):
            check(*answers)                     # torch 2.11 (the GPU machine's): test_an_old_gloo_is_named_as_the_cause
        return
    check(*answers)
    every_case(CASES)


def _gloo_all_to_all_on_lists() -> bool:
    try:
        dist.all_to_all([torch.zeros(1), torch.zeros(1)], [torch.ones(1), torch.ones(1)])
    except RuntimeError:
        return False
    return True


def attention_2d_on_an_old_gloo(q, k, v, ulysses_group, ring_group, zigzag):
    """What torch 2.11's gloo does with dist.all_to_all on lists: q's exchange starts, then the backend refuses."""
    if dist.get_world_size(ulysses_group) > 1:
        _swap(q, 1, 2, ulysses_group)
        raise RuntimeError("ProcessGroup gloo does not support alltoall")
    return ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag)


def test_an_old_gloo_is_named_as_the_cause():
    """An exception beats the traffic it cut short in the report, and gloo's missing all_to_all on lists (before
    torch 2.13) is named as the cause, with the fix."""
    with pytest.raises(AssertionError, match=r"rank 0 \(u=2, r=2\): attention_2d raised RuntimeError: ProcessGroup "
                                             r"gloo does not support alltoall \(gloo in torch .* call all_to_all_single"):
        check_attention_2d(attention_2d_on_an_old_gloo)


def test_the_tables_show_the_imbalance_zigzag_removes(capsys):
    check_attend_block(ref_attend_block)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith(" ok")]
    plain = [row for row in rows if row[:2] == ["4", "plain"]]
    zigzag = [row for row in rows if row[:2] == ["4", "zig-zag"]]
    assert plain and all(row[-5:-1] == ["1", "2", "3", "4"] for row in plain)    # rank r: r + 1 blocks
    assert zigzag and all(row[-5:-1] == ["9"] * 4 for row in zigzag)            # 2 cp + 1 pairs each


# ---- planted wrong answers: the layout --------------------------------------------------------------
def chunks_mirror_in_first_half(cp_rank, cp_size, zigzag):
    return [cp_rank, cp_size - 1 - cp_rank] if zigzag else [cp_rank]


def chunks_late_first(cp_rank, cp_size, zigzag):
    return [2 * cp_size - 1 - cp_rank, cp_rank] if zigzag else [cp_rank]


def chunks_strided(cp_rank, cp_size, zigzag):
    return [cp_rank, cp_rank + cp_size] if zigzag else [cp_rank]      # balanced-looking, but not zig-zag


def positions_of_wide_chunks(seq_len, cp_rank, cp_size, zigzag):
    width = seq_len // cp_size                                         # forgets the 2 cp chunks of zig-zag
    return torch.cat([torch.arange(c * width, (c + 1) * width) for c in ref_chunks(cp_rank, cp_size, zigzag)])


def positions_as_floats(seq_len, cp_rank, cp_size, zigzag):
    return ref_positions(seq_len, cp_rank, cp_size, zigzag).float()


def positions_as_int32(seq_len, cp_rank, cp_size, zigzag):
    return ref_positions(seq_len, cp_rank, cp_size, zigzag).int()           # indexes fine, but not what was asked


def positions_as_list(seq_len, cp_rank, cp_size, zigzag):
    return ref_positions(seq_len, cp_rank, cp_size, zigzag).tolist()


def positions_overlap(seq_len, cp_rank, cp_size, zigzag):
    width = seq_len // (2 * cp_size if zigzag else cp_size)
    start = cp_rank * width // 2                                       # half a chunk per rank
    return torch.arange(start, start + seq_len // cp_size)


# ---- the merge ---------------------------------------------------------------------------------------
def merge_without_max(out, lse, block_out, block_lse):
    a, b = lse.exp(), block_lse.exp()                                  # inf above 88.7, 0 below -103
    return (out * a[..., None] + block_out * b[..., None]) / (a + b)[..., None], (a + b).log()


def merge_average(out, lse, block_out, block_lse):
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)


def merge_unscaled_running(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    return out + block_out * torch.exp(block_lse - new)[..., None], new


def merge_keeps_lse(out, lse, block_out, block_lse):
    merged, _ = ref_merge(out, lse, block_out, block_lse)
    return merged, lse


def merge_max_lse(out, lse, block_out, block_lse):
    merged, _ = ref_merge(out, lse, block_out, block_lse)
    return merged, torch.maximum(lse, block_lse)


def merge_nan_when_both_empty(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)                              # -inf - (-inf) below when both are -inf
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None], new


# ---- one block ------------------------------------------------------------------------------------
def _attend(rule):
    """attend_block with one pair rule: rule(q_chunk, kv_chunk, c) -> "skip" or a mask (None: every key)."""
    def attend(out, lse, q, k, v, q_chunks, kv_chunks):
        c = q.shape[2] // len(q_chunks)
        outs, lses = list(out.split(c, 2)), list(lse.split(c, 2))
        for i, qc in enumerate(q_chunks):
            for j, kc in enumerate(kv_chunks):
                mask = rule(qc, kc, c)
                if isinstance(mask, str):
                    continue
                part = ref_block_attention(q[:, :, i * c:(i + 1) * c], k[:, :, j * c:(j + 1) * c],
                                           v[:, :, j * c:(j + 1) * c], mask)
                outs[i], lses[i] = ref_merge(outs[i], lses[i], *part)
        return torch.cat(outs, 2), torch.cat(lses, 2)
    attend.__name__ = rule.__name__
    return attend


def _tril(c, offset=0):
    return torch.ones(c, c, dtype=torch.bool).tril(offset)


@_attend
def diagonal_unmasked(qc, kc, c):
    return "skip" if kc > qc else None


@_attend
def future_attended(qc, kc, c):
    return _tril(c) if kc == qc else None


@_attend
def diagonal_hides_itself(qc, kc, c):
    return "skip" if kc > qc else (_tril(c, -1) if kc == qc else None)


@_attend
def future_computed_masked(qc, kc, c):
    """Right values, wasted work: the future pairs are computed with a mask that hides everything."""
    return torch.zeros(c, c, dtype=torch.bool) if kc > qc else (_tril(c) if kc == qc else None)


def attend_replaces(out, lse, q, k, v, q_chunks, kv_chunks):
    """Forgets to merge: each computed pair replaces the running result."""
    c = q.shape[2] // len(q_chunks)
    outs, lses = list(out.split(c, 2)), list(lse.split(c, 2))
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            if kc <= qc:
                outs[i], lses[i] = ref_block_attention(q[:, :, i * c:(i + 1) * c], k[:, :, j * c:(j + 1) * c],
                                                       v[:, :, j * c:(j + 1) * c], _tril(c) if kc == qc else None)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def attend_whole_block(out, lse, q, k, v, q_chunks, kv_chunks):
    """The rank's queries against the whole block in one call, masked by position: right, but no pair skipped."""
    c = q.shape[2] // len(q_chunks)
    q_pos = torch.cat([torch.arange(i * c, (i + 1) * c) for i in q_chunks])
    k_pos = torch.cat([torch.arange(j * c, (j + 1) * c) for j in kv_chunks])
    return ref_merge(out, lse, *ref_block_attention(q, k, v, q_pos[:, None] >= k_pos[None, :]))


# ---- the ring ----------------------------------------------------------------------------------------
def ring_wrong_neighbour(q, k, v, group, zigzag):
    """Sends to the next rank and receives from the next rank too: nobody sends to what it waits for."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % cp)
    out, lse = _start(q)
    kv = torch.stack([k, v])
    for step in range(cp):
        incoming = torch.empty_like(kv)
        hop = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                      dist.P2POp(dist.irecv, incoming, nxt, group)]) if step < cp - 1 else []
        out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
        for request in hop:
            request.wait()
        kv = incoming
    return out


def ring_reversed(q, k, v, group, zigzag):
    """Sends to the previous rank, receives from the next, but still labels the block as rank (r - t)'s."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    out, lse = _start(q)
    kv = torch.stack([k, v])
    for step in range(cp):
        incoming = torch.empty_like(kv)
        hop = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, prv, group),
                                      dist.P2POp(dist.irecv, incoming, nxt, group)]) if step < cp - 1 else []
        out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
        for request in hop:
            request.wait()
        kv = incoming
    return out


def ring_all_gather(q, k, v, group, zigzag):
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    kv = torch.stack([k, v])
    blocks = [torch.empty_like(kv) for _ in range(cp)]
    dist.all_gather(blocks, kv, group=group)
    out, lse = _start(q)
    for source, block in enumerate(blocks):
        out, lse = ref_attend_block(out, lse, q, block[0], block[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks(source, cp, zigzag))
    return out


def ring_compute_then_send(q, k, v, group, zigzag):
    """Right values, no overlap: each block is computed before its hop is posted."""
    return _ring_in_steps(q, k, v, group, zigzag, compute_first=True)


def _ring_in_steps(q, k, v, group, zigzag, compute_first=False, hops=None, repeat_heads=False):
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    hops = cp - 1 if hops is None else hops
    if repeat_heads:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, lse = _start(q)
    kv = torch.stack([k, v])
    for step in range(cp):
        source_chunks = ref_chunks((me - step) % cp, cp, zigzag)
        if compute_first:
            out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag), source_chunks)
        incoming = torch.empty_like(kv)
        hop = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                      dist.P2POp(dist.irecv, incoming, prv, group)]) if step < hops else []
        if not compute_first:
            out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag), source_chunks)
        for request in hop:
            request.wait()
        kv = incoming
    return out


def ring_one_hop_too_many(q, k, v, group, zigzag):
    return _ring_in_steps(q, k, v, group, zigzag, hops=dist.get_world_size(group))


def ring_sends_repeated_heads(q, k, v, group, zigzag):
    return _ring_in_steps(q, k, v, group, zigzag, repeat_heads=True)


def ring_gathers_then_computes(q, k, v, group, zigzag):
    """Passes every block round the ring first, then computes: an all-gather made of sends."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    blocks = [torch.stack([k, v])]
    for _ in range(cp - 1):
        incoming = torch.empty_like(blocks[-1])
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, blocks[-1], nxt, group),
                                               dist.P2POp(dist.irecv, incoming, prv, group)]):
            request.wait()
        blocks.append(incoming)
    out, lse = _start(q)
    for step, block in enumerate(blocks):
        out, lse = ref_attend_block(out, lse, q, block[0], block[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
    return out


def ring_global_rank(q, k, v, group, zigzag):
    """dist.get_rank() where the group's rank is needed: right in the ring of 4, wrong in the rings of 2."""
    cp, me = dist.get_world_size(group), dist.get_rank()
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me - 1) % cp)
    out, lse = _start(q)
    kv = torch.stack([k, v])
    for step in range(cp):
        incoming = torch.empty_like(kv)
        hop = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                      dist.P2POp(dist.irecv, incoming, prv, group)]) if step < cp - 1 else []
        out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
        for request in hop:
            request.wait()
        kv = incoming
    return out


def ring_group_ranks_as_peers(q, k, v, group, zigzag):
    """Passes group ranks where P2POp wants global ones."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = _start(q)
    kv = torch.stack([k, v])
    for step in range(cp):
        incoming = torch.empty_like(kv)
        hop = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (me + 1) % cp, group),
                                      dist.P2POp(dist.irecv, incoming, (me - 1) % cp, group)]) \
            if step < cp - 1 else []
        out, lse = ref_attend_block(out, lse, q, kv[0], kv[1], ref_chunks(me, cp, zigzag),
                                    ref_chunks((me - step) % cp, cp, zigzag))
        for request in hop:
            request.wait()
        kv = incoming
    return out


def ring_own_block_only(q, k, v, group, zigzag):
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = _start(q)
    return ref_attend_block(out, lse, q, k, v, ref_chunks(me, cp, zigzag), ref_chunks(me, cp, zigzag))[0]


def ring_returns_lse_too(q, k, v, group, zigzag):
    out = ref_ring(q, k, v, group, zigzag)
    return out, out.sum(-1)


def ring_course_answer(q, k, v, group, zigzag):
    from picotron.parallel.context_parallel import ring_attention
    return ring_attention(q, k, v, group, zigzag=zigzag)



# ---- 2-D context parallelism ----------------------------------------------------------------------------
def groups_swapped(rank, u, r):
    """The ring inside the node, the all-to-all across nodes."""
    ulysses, ring = ref_groups_2d(rank, u, r)
    return ring, ulysses


def groups_ulysses_strided(rank, u, r):
    """Ulysses groups of ranks spread over the nodes (every r-th rank), rings of consecutive ranks."""
    return list(range(rank % r, u * r, r)), list(range(rank // r * r, rank // r * r + r))


def groups_ring_from_self(rank, u, r):
    """The right members of the ring, listed from this rank on, not in node order."""
    ulysses, ring = ref_groups_2d(rank, u, r)
    node = rank // u
    return ulysses, ring[node:] + ring[:node]


def positions_2d_as_list(seq_len, rank, u, r, zigzag):
    return ref_positions_2d(seq_len, rank, u, r, zigzag).tolist()


def positions_one_ring_of_cp(seq_len, rank, u, r, zigzag):
    """The layout of a ring of all u r ranks: right only for u = 1."""
    return ref_positions(seq_len, rank, u * r, zigzag)


def positions_every_uth_token(seq_len, rank, u, r, zigzag):
    node, place = divmod(rank, u)
    return ref_positions(seq_len, node, r, zigzag)[place::u]


def attention_2d_a2a_over_world(q, k, v, ulysses_group, ring_group, zigzag):
    """Ulysses over all 4 ranks, no ring: right values where 4 divides the heads, but the all-to-all leaves the node."""
    world = dist.group.WORLD
    _heads_fit(q, k, world)
    q, k, v = (_swap(t, 1, 2, world) for t in (q, k, v))
    u, r = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    pos = torch.cat([ref_positions_2d(q.shape[2], rank, u, r, zigzag) for rank in range(u * r)])
    out, _ = ref_block_attention(q, k, v, pos[:, None] >= pos[None, :])
    return _swap(out, 2, 1, world)


def attention_2d_ring_over_world(q, k, v, ulysses_group, ring_group, zigzag):
    """The right all-to-all, then the ring over every rank instead of the ring group."""
    return ref_attention_2d(q, k, v, ulysses_group, dist.group.WORLD, zigzag)


def attention_2d_all_gathers_kv(q, k, v, ulysses_group, ring_group, zigzag):
    """The right all-to-all, then K/V all-gathered over the ring group and attended at once: right values."""
    _heads_fit(q, k, ulysses_group)
    q, k, v = (_swap(t, 1, 2, ulysses_group) for t in (q, k, v))
    r = dist.get_world_size(ring_group)
    kv = torch.stack([k, v])
    blocks = [torch.empty_like(kv) for _ in range(r)]
    dist.all_gather(blocks, kv, group=ring_group)
    k, v = (torch.cat([block[i] for block in blocks], dim=2) for i in (0, 1))
    s = k.shape[2]
    pos = torch.cat([ref_positions(s, g, r, zigzag) for g in range(r)])
    mine = ref_positions(s, dist.get_rank(ring_group), r, zigzag)
    out, _ = ref_block_attention(q, k, v, mine[:, None] >= pos[None, :])
    return _swap(out, 2, 1, ulysses_group)


def attention_2d_repeats_kv_before_a2a(q, k, v, ulysses_group, ring_group, zigzag):
    groups = q.shape[1] // k.shape[1]
    if k.shape[1] % dist.get_world_size(ulysses_group):
        _heads_fit(q, k, ulysses_group)
    return ref_attention_2d(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), ulysses_group,
                            ring_group, zigzag)


def attention_2d_repeats_kv_before_ring(q, k, v, ulysses_group, ring_group, zigzag):
    def ring(q, k, v, group, zigzag):
        groups = q.shape[1] // k.shape[1]
        return ref_ring(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), group, zigzag)
    return ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag, ring=ring)


def attention_2d_interleaved_pieces(q, k, v, ulysses_group, ring_group, zigzag):
    """Joins what arrives token by token (rank 0's first token, rank 1's first, ...): right only for u = 1."""
    u = _heads_fit(q, k, ulysses_group)

    def swap_in(x):
        send = torch.stack(x.chunk(u, dim=1)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ulysses_group)
        return torch.stack(received.unbind(0), dim=3).flatten(2, 3)          # (b, h/u, s/cp, u, d) interleaved

    def swap_out(x):
        pieces = x.unflatten(2, (-1, u)).movedim(3, 0).contiguous()          # undo the interleaving
        received = torch.empty_like(pieces)
        dist.all_to_all_single(received, pieces, group=ulysses_group)
        return torch.cat(received.unbind(0), dim=1)

    q, k, v = (swap_in(t) for t in (q, k, v))
    return swap_out(ref_ring(q, k, v, ring_group, zigzag))


def attention_2d_no_swap_back(q, k, v, ulysses_group, ring_group, zigzag):
    _heads_fit(q, k, ulysses_group)
    q, k, v = (_swap(t, 1, 2, ulysses_group) for t in (q, k, v))
    return ref_ring(q, k, v, ring_group, zigzag)


def attention_2d_no_head_check(q, k, v, ulysses_group, ring_group, zigzag):
    u = dist.get_world_size(ulysses_group)
    if k.shape[1] % u:                                   # what happens without the check: heads lost, or a crash
        return torch.zeros_like(q)
    return ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag)


def attention_2d_checks_after_exchange(q, k, v, ulysses_group, ring_group, zigzag):
    if k.shape[1] % dist.get_world_size(ulysses_group):
        _swap(q, 1, 2, ulysses_group)                    # q's 8 heads split over 4: its exchange runs before the check
    return ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag)


def attention_2d_vague_error(q, k, v, ulysses_group, ring_group, zigzag):
    if k.shape[1] % dist.get_world_size(ulysses_group):
        raise ValueError("bad head count")
    return ref_attention_2d(q, k, v, ulysses_group, ring_group, zigzag)


def attention_2d_course_answer(q, k, v, ulysses_group, ring_group, zigzag):
    from picotron.parallel.context_parallel import ring_attention
    _heads_fit(q, k, ulysses_group)
    q, k, v = (_swap(t, 1, 2, ulysses_group) for t in (q, k, v))
    return _swap(ring_attention(q, k, v, ring_group, zigzag=zigzag), 2, 1, ulysses_group)


WRONG_ANSWERS = [
    (check_layout, (chunks_mirror_in_first_half, ref_positions), "Pair chunk r with its mirror from the end"),
    (check_layout, (chunks_late_first, ref_positions), "increasing order"),
    (check_layout, (chunks_strided, ref_positions), "keep the order of the first half"),
    (check_layout, (ref_chunks, positions_of_wide_chunks), r"outside \[0, 8\)"),
    (check_layout, (ref_chunks, positions_as_floats), "1-D torch.long tensor"),
    (check_layout, (ref_chunks, positions_overlap), "held by no rank"),
    (check_merge, (merge_without_max,), "exp overflowed or underflowed"),
    (check_merge, (merge_average,), "averaged the two outputs"),
    (check_merge, (merge_unscaled_running,), "weighed only the new block"),
    (check_merge, (merge_keeps_lse,), "returned the old lse unchanged"),
    (check_merge, (merge_max_lse,), "the larger of the two lse"),
    (check_merge, (merge_nan_when_both_empty,), r"both lse are -inf: lse - new_lse is then -inf - \(-inf\) = NaN"),
    (check_attend_block, (diagonal_unmasked,), "attended without the causal mask"),
    (check_attend_block, (future_attended,), "come after the query chunk were attended"),
    (check_attend_block, (diagonal_hides_itself,), "hides each query's own position"),
    (check_attend_block, (future_computed_masked,), "computed 4 chunk pairs over the 4 blocks where 1 are needed"),
    (check_attend_block, (attend_whole_block,), "Call block_attention once per"),
    (check_attend_block, (attend_replaces,), "merged into the running"),
    (check_ring_attention, (ring_reversed,),
     r"sent to rank\(s\) \[\d\] and received from \[\d\]; in the ring it sends to the next rank"),
    (check_ring_attention, (ring_all_gather,), "it called the collective dist.all_gather"),
    (check_ring_attention, (ring_compute_then_send,), "computed a block before posting that step's hop"),
    (check_ring_attention, (ring_gathers_then_computes,), "an all-gather by another name"),
    (check_ring_attention, (ring_one_hop_too_many,), "one hop too many"),
    (check_ring_attention, (ring_sends_repeated_heads,), "repeated to the 4 query heads"),
    (check_ring_attention, (ring_global_rank,), r"dist.get_rank\(group\)"),
    (check_ring_attention, (ring_group_ranks_as_peers,), "take the peer's global rank"),
    (check_ring_attention, (ring_own_block_only,), "only this rank's own K/V block"),
    (check_ring_attention, (ring_returns_lse_too,), "return this rank's output, one tensor"),
    (check_ring_attention, (ring_course_answer,), "the course's answer"),
    (check_layout, (ref_chunks, positions_as_int32), "1-D torch.long tensor"),
    (check_layout, (ref_chunks, positions_as_list), "returned list; return a 1-D torch.long tensor"),
    (check_mesh_2d, (groups_swapped, ref_positions_2d), "the two are swapped"),
    (check_mesh_2d, (groups_ulysses_strided, ref_positions_2d), "the u consecutive ranks"),
    (check_mesh_2d, (groups_ring_from_self, ref_positions_2d), r"one rank from each node, at the same place in it"),
    (check_mesh_2d, (ref_groups_2d, positions_2d_as_list), "return a 1-D torch.long tensor"),
    (check_mesh_2d, (ref_groups_2d, positions_one_ring_of_cp), "right only for u = 1"),
    (check_mesh_2d, (ref_groups_2d, positions_every_uth_token), "each piece must be contiguous"),
    (check_attention_2d, (attention_2d_a2a_over_world,),
     r"all_to_all_single over ranks \[0, 1, 2, 3\], but its Ulysses group is \[0, 1\]"),
    (check_attention_2d, (attention_2d_ring_over_world,), r"are not in its ring group \[\d, \d\]"),
    (check_attention_2d, (attention_2d_all_gathers_kv,), "it called dist.all_gather"),
    (check_attention_2d, (attention_2d_repeats_kv_before_a2a,), "repeated to the 8 query heads before the all-to-all"),
    (check_attention_2d, (attention_2d_repeats_kv_before_ring,), "repeated to the query heads before the ring"),
    (check_attention_2d, (attention_2d_interleaved_pieces,), "Every u = 1 row passes"),
    (check_attention_2d, (attention_2d_no_swap_back,), "a second all-to-all"),
    (check_attention_2d, (attention_2d_no_head_check,), r"raise ValueError when u does not divide both head counts"),
    (check_attention_2d, (attention_2d_checks_after_exchange,), "before any communication"),
    (check_attention_2d, (attention_2d_vague_error,), r"name u \(4\) and both head counts \(8, 2\)"),
    (check_attention_2d, (attention_2d_course_answer,), "the course's answer"),
]
NO_TABLE = (ring_all_gather, ring_group_ranks_as_peers, ring_course_answer,  # a rank raises: no table
            attention_2d_course_answer)


def _case_id(check, answers):
    wrong = next((a for a in answers if a not in (ref_chunks, ref_positions, ref_groups_2d, ref_positions_2d)),
                 answers[0])
    return f"{check.__name__.removeprefix('check_')}-{wrong.__name__}"


@pytest.mark.parametrize("check, answers, says", WRONG_ANSWERS, ids=[_case_id(c, a) for c, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answers, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(*answers)
    if answers[0] not in NO_TABLE:
        assert "FAIL" in capsys.readouterr().out


def test_global_rank_fails_only_the_rings_of_two(capsys):
    with pytest.raises(AssertionError):
        check_ring_attention(ring_global_rank)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith((" ok", " FAIL"))]
    assert len(rows) == 8 and all((row[-1] == "ok") == (row[0] == "4") for row in rows), rows


def test_pieces_joined_out_of_order_fail_only_where_u_is_above_1(capsys):
    with pytest.raises(AssertionError, match="Every u = 1 row passes"):
        check_attention_2d(attention_2d_interleaved_pieces)
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith((" ok", " FAIL"))]
    computed = [row for row in rows if "ValueError" not in row]           # u = 4 with 8/2 heads: refused, both ok
    assert len(rows) == 12 and computed and all((row[-1] == "ok") == (row[0] == "1") for row in computed), rows


def test_a_deadlocked_ring_fails_within_the_hop_timeout():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"the ring deadlocked: rank \d .* posted sends to rank\(s\) \[(\d)\] and "
                                             r"receives from \[\1\]; in the ring each rank sends to the next rank"):
        check_ring_attention(ring_wrong_neighbour)
    assert time.monotonic() - start < checks_cp.HOP_TIMEOUT + 20


def test_the_course_answer_is_refused_in_one_process_too():
    from picotron.parallel.online_softmax import merge_blocks

    with pytest.raises(AssertionError, match="the course's answer"):
        check_merge(merge_blocks)
    import picotron.parallel.context_parallel as course
    import picotron.parallel.online_softmax as blocks
    for module in (blocks, course):   # where it is defined, and the technique that calls it
        with pytest.raises(AssertionError, match="the course's answer"):
            check_merge(lambda *args: module.merge_blocks(*args))
    assert blocks.merge_blocks is merge_blocks and course.merge_blocks is merge_blocks   # restored afterwards


def test_the_course_layout_is_refused_where_it_lives():
    import picotron.data as data
    from picotron.data import cp_chunks, cp_positions

    with pytest.raises(AssertionError, match="the course's answer"):
        check_layout(cp_chunks, cp_positions)
    with pytest.raises(AssertionError, match=r"called picotron.data.cp_chunks, the course's answer"):
        check_layout(lambda *args: data.cp_chunks(*args), lambda *args: data.cp_positions(*args))
    assert data.cp_chunks is cp_chunks and data.cp_positions is cp_positions   # restored afterwards


def test_the_check_cases_cover_what_they_promise():
    assert checks_cp.CP_SIZES == (4, 2) and checks_cp.WORLD == 4
    assert {zigzag for zigzag, _, _ in checks_cp.RING_CASES} == {False, True}
    assert any(heads != kv for _, heads, kv in checks_cp.RING_CASES)             # GQA
    assert any(heads == kv for _, heads, kv in checks_cp.RING_CASES)
    assert {cp for cp, _ in checks_cp.LAYOUT_CASES} >= {2, 4, 8}
    assert {zigzag for zigzag, _, _ in checks_cp.CASES_2D} == {False, True}
    assert set(checks_cp.MESHES) == {(2, 2), (1, 4), (4, 1)}                         # 2-D and both degenerate cases
    assert any(heads % 4 == 0 and kv % 4 for _, heads, kv in checks_cp.CASES_2D)      # cannot split over u = 4
    assert any(heads != kv and kv % 2 == 0 for _, heads, kv in checks_cp.CASES_2D)    # GQA that splits over u = 2
    assert any(heads == kv for _, heads, kv in checks_cp.CASES_2D)
    names = [case[0] for case in checks_cp.MERGE_CASES]
    assert "nothing seen on either side" in names and "new block fully masked" in names

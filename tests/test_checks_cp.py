"""The checks of assignment 05 pass correct answers and refuse the course's own.

The correct answers are the checks' own correct code, judged with the refusal off, and others
written here, not taken from the solution notebook (which runs under nbval on its own), so a
check that passes everything, or nothing, is caught. The wrong answers
are the checks' misconceptions, each failing with its hint (tests/test_misconceptions.py).
Nothing here uses picotron.parallel.context_parallel, except to see that the checks refuse it.
"""

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist

import picotron.data as data
import picotron.parallel.context_parallel as course
import picotron.parallel.online_softmax as blocks
from picotron.launch import run
from picotron_course import checks_cp
from picotron_course.checks_cp import (check_attend_block, check_attention_2d, check_layout, check_merge,
                                       check_mesh_2d, check_ring_attention)

INF = math.inf


# ---- correct answers ------------------------------------------------------------------------------
# The checks' own correct code (the bases their misconceptions change, refused as a learner's answer), judged with
# the refusal off (only the parent refuses); then other valid answers, which the checks must accept too.
BASES = {"layout": (check_layout, checks_cp._chunks, checks_cp._positions), "merge": (check_merge, checks_cp._merge),
         "attend_block": (check_attend_block, checks_cp._attend), "ring": (check_ring_attention, checks_cp._Ring()),
         "mesh_2d": (check_mesh_2d, checks_cp._groups_2d, checks_cp._positions_2d),
         "attention_2d": (check_attention_2d, checks_cp._Attention2D())}


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


def ref_ring(q, k, v, group, zigzag, attend=ref_attend_block, back=-1):
    """K and V as two messages, dist.isend / dist.irecv with their own waits (from rank me + back: the previous)."""
    cp, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = dist.get_global_rank(group, (me + 1) % cp), dist.get_global_rank(group, (me + back) % cp)
    out, lse = checks_cp._start(q)
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
    out, lse = checks_cp._start(q)
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


def ref_attention_2d_lists(q, k, v, ulysses_group, ring_group, zigzag):
    """dist.all_to_all on lists, K and V in one exchange, no all-to-all at all where u = 1, the group_peer ring."""
    checks_cp._Attention2D().fit(q, k, ulysses_group)
    u = dist.get_world_size(ulysses_group)

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


OTHERS = {"layout": (check_layout, ref_chunks, ref_positions), "merge": (check_merge, ref_merge),
          "attend_block": (check_attend_block, ref_attend_block), "ring": (check_ring_attention, ref_ring),
          "ring_group_peer": (check_ring_attention, ref_ring_group_peer),
          "mesh_2d": (check_mesh_2d, ref_groups_2d, ref_positions_2d),
          "attention_2d_lists": (check_attention_2d, ref_attention_2d_lists)}


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"layout": 10, "merge": 8, "attend_block": 8, "ring_attention": 8, "mesh_2d": 12, "attention_2d": 12}


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in BASES.values()], ids=list(BASES))
def test_correct_answer_passes(check, answers, every_case, refusing_nothing):
    refusing_nothing(checks_cp)   # the checks' own bases pass (the ranks never refuse here)
    check(*answers)
    every_case(CASES)


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in OTHERS.values()], ids=list(OTHERS))
def test_another_correct_answer_passes(check, answers, every_case):
    if answers == (ref_attention_2d_lists,) and not run(_gloo_all_to_all_on_lists, 2, backend="gloo")[0]:
        with pytest.raises(AssertionError, match="RuntimeError.*call all_to_all_single"):
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
    base = checks_cp._Attention2D()
    if dist.get_world_size(ulysses_group) > 1:
        base.swap(q, 1, 2, ulysses_group)
        raise RuntimeError("ProcessGroup gloo does not support alltoall")
    return base(q, k, v, ulysses_group, ring_group, zigzag)


def test_an_old_gloo_is_named_as_the_cause():
    """An exception beats the traffic it cut short in the report, and gloo's missing all_to_all on lists (before
    torch 2.13) is named as the cause, with the fix."""
    with pytest.raises(AssertionError, match=r"u=2, r=2, .*what attention_2d raised.*\(rank 0\): expected nothing, got "
                                             r"RuntimeError: ProcessGroup gloo does not support alltoall \(gloo in "
                                             r"torch .* call all_to_all_single"):
        check_attention_2d(attention_2d_on_an_old_gloo)


def _record(check, name):
    """The answer of a check's misconception (refused as an answer unless it is the record's own)."""
    return next(m.answer for m in check.misconceptions if m.name == name)


def _rows(capsys) -> list[list[str]]:
    return [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith((" ok", " FAIL"))]


def test_the_tables_show_the_imbalance_zigzag_removes(capsys):
    check_attend_block(ref_attend_block)
    rows = _rows(capsys)                   # ... pairs/rank (want), pairs/rank (got), max abs err, result
    plain = [row for row in rows if row[:2] == ["4", "plain"]]
    zigzag = [row for row in rows if row[:2] == ["4", "zig-zag"]]
    assert plain and all(row[-6:-2] == ["1", "2", "3", "4"] for row in plain)    # rank r: r + 1 blocks
    assert zigzag and all(row[-6:-2] == ["9"] * 4 for row in zigzag)            # 2 cp + 1 pairs each


def test_global_rank_fails_only_the_rings_of_two(capsys):
    with pytest.raises(AssertionError, match=r"dist.get_rank\(group\)"):
        check_ring_attention(_record(checks_cp.RING, "RingGlobalRank"))
    rows = _rows(capsys)
    assert len(rows) == 8 and all((row[-1] == "ok") == (row[0] == "4") for row in rows), rows


def test_pieces_joined_out_of_order_fail_only_where_u_is_above_1(capsys):
    with pytest.raises(AssertionError, match="Hint: every u = 1 row passes"):
        check_attention_2d(_record(checks_cp.ATTENTION_2D, "A2DInterleavedPieces"))
    rows = _rows(capsys)
    computed = [row for row in rows if "ValueError" not in row]           # u = 4 with 8/2 heads: refused, both ok
    assert len(rows) == 12 and computed and all((row[-1] == "ok") == (row[0] == "1") for row in computed), rows


def test_a_deadlocked_ring_fails_within_the_hop_timeout():
    """Sends to the next rank and receives from the next rank too: nobody sends to what it waits for."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"the ring deadlocked: rank \d .* posted sends to rank\(s\) \[(\d)\] and "
                                             r"receives from \[\1\]; in the ring each rank sends to the next rank"):
        check_ring_attention(functools.partial(ref_ring, back=1))
    assert time.monotonic() - start < checks_cp.HOP_TIMEOUT + 20


# ---- answers refused, and a mistake no misconception describes -------------------------------------------
# The planted wrong answers are the checks' misconceptions (checks_cp.py), tested in test_misconceptions.py.
def calls(module, name):
    """The learner's answer that calls the course's own function, however it reaches it."""
    return lambda *args: getattr(module, name)(*args)


def ring_course_answer(q, k, v, group, zigzag):
    return course.ring_attention(q, k, v, group, zigzag=zigzag)


def attention_2d_course_answer(q, k, v, ulysses_group, ring_group, zigzag):
    base = checks_cp._Attention2D()
    base.ring = ring_course_answer                      # the checks' correct answer, round the course's ring
    return base(q, k, v, ulysses_group, ring_group, zigzag)


REFUSED = {"ring": (check_ring_attention, ring_course_answer),
           "attention_2d": (check_attention_2d, attention_2d_course_answer),
           "merge_blocks": (check_merge, blocks.merge_blocks),
           "layout": (check_layout, data.cp_chunks, data.cp_positions),
           "merge_blocks_called": (check_merge, calls(blocks, "merge_blocks")),   # where it is defined
           "merge_blocks_called_from_course": (check_merge, calls(course, "merge_blocks")),   # the technique using it
           "layout_called": (check_layout, calls(data, "cp_chunks"), calls(data, "cp_positions")),
           "base_ring": (check_ring_attention, checks_cp._Ring()), "base_merge": (check_merge, checks_cp._merge),
           "base_attention_2d": (check_attention_2d, checks_cp._Attention2D()),
           "base_attend": (check_attend_block, checks_cp._attend),
           "base_layout": (check_layout, checks_cp._chunks, ref_positions),
           "base_mesh": (check_mesh_2d, ref_groups_2d, checks_cp._positions_2d)}
COURSE = [(module, name, getattr(module, name)) for module, name in ((blocks, "merge_blocks"), (course, "merge_blocks"),
                                                                      (course, "ring_attention"), (data, "cp_chunks"))]


@pytest.mark.parametrize("check, answers", [(c, a) for c, *a in REFUSED.values()], ids=list(REFUSED))
def test_the_course_answer_is_refused(check, answers, capsys):
    with pytest.raises(AssertionError, match="the course's answer"):
        check(*answers)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed
    assert all(getattr(module, name) is original for module, name, original in COURSE)   # restored afterwards


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    """The output doubled: it fails at out, like merge_average, but with other values: no hint is given."""
    with pytest.raises(AssertionError, match=r"out: each part weighs by its share") as error:
        check_merge(lambda *args: (2 * ref_merge(*args)[0], ref_merge(*args)[1]))
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


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

"""The checks of assignment 05: context parallelism, each rank holding a slice of every sequence.

Every check compares with plain softmax attention over the whole sequence, computed here in the
parent in float64 (scores masked to the keys a query may see, GQA by repeating the key/value
heads), sliced to the positions each rank should hold. Nothing here uses
picotron.parallel.context_parallel, the module the assignment rebuilds.

    check_layout(rank_chunks, rank_positions)  plain and zig-zag splits, cp of 2 to 8 (one process): the
                                               chunks and positions of each rank, every position held
                                               once, zig-zag's causal work equal on every rank
    check_merge(merge)                         the log-sum-exp merge of two partial attentions (one
                                               process): hand-made blocks, scores near +90 and -120
                                               (exp overflows and underflows in fp32), blocks and rows
                                               that see no key (lse = -inf), never a NaN
    check_attend_block(attend_block)           one process, every rank's ring replayed: folding the K/V
                                               blocks in ring order gives full causal attention, and
                                               only the chunk pairs a query can see are computed
    check_ring_attention(ring_attention)       4 ranks, as one ring of 4 and as two rings of 2 (ranks
                                               0-1, 2-3): the output equals full causal attention;
                                               point-to-point only, (cp-1) K/V blocks sent per rank,
                                               each hop posted before the block it overlaps is computed
    check_mesh_2d(groups_2d, positions_2d)     the stretch, 2-D context parallelism (one process): for cp = u x r
                                               of 2x2 to 8x2, each rank's Ulysses group (u consecutive ranks, a
                                               node) and ring group (one rank per node), and its positions: piece
                                               j of u of ring rank g's, so a node's pieces join into ring rank g's
    check_attention_2d(attention_2d)           the stretch on 4 ranks as u x r = 2x2, 1x4 and 4x1, plain and
                                               zig-zag, 4/4 and 8/2 heads: the output equals full causal attention;
                                               from the recorded communication: all-to-alls only on the rank's
                                               Ulysses group, handed q, k, v, out once (K/V with their own heads),
                                               point-to-point only within its ring group, (r-1) K/V blocks of
                                               kv_heads/u heads, no other collective (no all-gather); a ValueError
                                               naming u and both head counts, before any communication, when u
                                               does not divide them (8/2 heads at u=4)

Layouts, for a sequence of s tokens over cp ranks: "plain" gives rank r the chunk r of cp chunks
(s/cp tokens each); "zig-zag" cuts 2 cp chunks and gives rank r chunks r and 2cp-1-r, in that order.
Sizes: batch 2, head dim 8, 4 query heads with 4 or 2 key/value heads (GQA), s = 32 at cp=4 and
16 at cp=2 (zig-zag chunks of 4 tokens); the 2-D checks: s = 32 on every mesh, 4/4 and 8/2 heads.

The 2-D checks record, on every rank, each collective with its group's members and the bytes handed to
it, and the peer of each send and receive (torch.distributed patched, as for the ring): the rules of the
task are read from that record, never from timing, so they hold alike on any machine.

Work is counted with a TorchDispatchMode: the FLOPs of every matmul the learner's code runs. A chunk
pair of c queries and c keys costs two matmuls (scores, then probabilities times values) of
2 c^2 d FLOPs per query head. In the ring, each matmul also notes how many bytes the rank had posted
by then, which shows whether a hop was posted before the block it should overlap with.

A ring that deadlocks (a rank receiving from a neighbour that never sends to it) would wait for
ever: the rings' process groups time out after HOP_TIMEOUT seconds, and the rank that timed out
raises an AssertionError naming the ranks it sent to and received from.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from picotron_course import settings
from picotron_course.checks import (Report, close_enough, collectives_observed, mismatch, on_ranks, one_thread,
                                    only_point_to_point, patched, preview, rank_tensor, tensors_in)
from picotron_course.checks import not_the_course_answer, raised

__all__ = ["check_layout", "check_merge", "check_attend_block", "check_ring_attention", "check_mesh_2d",
           "check_attention_2d", "WORLD", "CP_SIZES", "HOP_TIMEOUT"]

WORLD = 4
CP_SIZES = (4, 2)              # one ring of all 4 ranks; two rings of 2 (ranks 0-1, 2-3)
SEQ = {4: 32, 2: 16}           # tokens per sequence at each cp: 2 cp zig-zag chunks of 4 tokens
BATCH, HEAD_DIM = 2, 8
HEADS = ((4, 4), (4, 2))       # (query heads, key/value heads): plain multi-head, and GQA
RING_CASES = [(zigzag, heads, kv_heads) for zigzag in (False, True) for heads, kv_heads in HEADS]
LAYOUT_CASES = ((2, 8), (3, 12), (4, 16), (4, 32), (8, 32))   # (cp, seq_len)
# A hop that has not arrived after this long never will: the ring deadlocked. Tiny blocks take
# milliseconds; the margin is for ranks that share two busy cores.
HOP_TIMEOUT = 10.0
SECOND_ERROR_DELAY = 5.0       # a rank whose neighbour died waits this long before reporting it
FP32 = torch.float32
# Roundings behind one number of the attention checked here (picotron.tolerance): q.k over HEAD_DIM, the softmax
# and P V over the longest sequence, and merging the blocks of up to 4 ranks.
ROUNDINGS = HEAD_DIM + 2 * max(SEQ.values()) + max(CP_SIZES)
PACKAGE = "picotron.parallel.context_parallel"
BLOCKS = "picotron.parallel.online_softmax"     # its one-device building blocks: the course's answer too
LAYOUT = "picotron.data"                        # where the course's answer to the layout lives (the loader uses it)
LAYOUT_NAMES = ("cp_chunks", "cp_positions")
COURSE_ANSWER = dict(course=(PACKAGE, BLOCKS, LAYOUT), only={LAYOUT: LAYOUT_NAMES})   # not_the_course_answer's
INF = math.inf


# ---- the layouts, written here ----------------------------------------------------------------
def _layout(zigzag: bool) -> str:
    return "zig-zag" if zigzag else "plain"


def _chunks(rank: int, cp: int, zigzag: bool) -> list[int]:
    return [rank, 2 * cp - 1 - rank] if zigzag else [rank]


def _width(seq: int, cp: int, zigzag: bool) -> int:
    return seq // (2 * cp if zigzag else cp)


def _positions(seq: int, rank: int, cp: int, zigzag: bool) -> torch.Tensor:
    width = _width(seq, cp, zigzag)
    return torch.cat([torch.arange(c * width, (c + 1) * width) for c in _chunks(rank, cp, zigzag)])


def _owner(seq: int, cp: int, zigzag: bool) -> torch.Tensor:
    """(seq,) the rank holding each position."""
    owner = torch.empty(seq, dtype=torch.long)
    for rank in range(cp):
        owner[_positions(seq, rank, cp, zigzag)] = rank
    return owner


def _pairs_needed(rank: int, source: int, cp: int, zigzag: bool) -> int:
    """Chunk pairs (query chunk of `rank`, key chunk of `source`) a query can see something of."""
    return sum(k <= q for q in _chunks(rank, cp, zigzag) for k in _chunks(source, cp, zigzag))


def _ring_sources(rank: int, cp: int) -> list[int]:
    """Whose K/V block a rank holds at each ring step: its own, then the previous rank's, ..."""
    return [(rank - step) % cp for step in range(cp)]


# ---- reference attention in the parent ----------------------------------------------------------
def _qkv(seq: int, heads: int, kv_heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q (batch, heads, seq, d) and k, v (batch, kv_heads, seq, d) of a whole sequence: every rank and the
    parent make the same."""
    q = rank_tensor(0, (BATCH, heads, seq, HEAD_DIM), FP32, seed)
    k = rank_tensor(1, (BATCH, kv_heads, seq, HEAD_DIM), FP32, seed)
    v = rank_tensor(2, (BATCH, kv_heads, seq, HEAD_DIM), FP32, seed)
    return q, k, v


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v over the keys `allowed` (sq, sk) lets each query see, in float64,
    and each query's log-sum-exp. A query that sees no key gets output 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]                      # GQA: query head i reads K/V head i // groups
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q.double() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -INF)
    lse = torch.logsumexp(scores, dim=-1)                  # (batch, heads, sq)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return probs @ v, lse


def _causal(seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).tril()


def _wrong_masks(seq: int, cp: int, zigzag: bool, rank: int) -> list[tuple[torch.Tensor, str]]:
    """Masks of the usual mistakes, each with what it means: an output equal to attention under one of
    them names the mistake."""
    pos = torch.arange(seq)
    chunk = pos // _width(seq, cp, zigzag)
    qp, kp, qc, kc = pos[:, None], pos[None, :], chunk[:, None], chunk[None, :]
    owner = _owner(seq, cp, zigzag)[None, :]
    last = next(s for s in reversed(_ring_sources(rank, cp)) if _pairs_needed(rank, s, cp, zigzag))
    return [
        (kc <= qc, "the diagonal chunk pair (key chunk = query chunk) was attended without the causal mask: there "
                   "a query sees only its own position and the ones before it, torch.ones(w, w, dtype=torch.bool)"
                   ".tril() for chunks of w tokens"),
        ((kc != qc) | (kp <= qp), "key chunks that come after the query chunk were attended: they are the future "
                                  "of every query in the chunk; skip those pairs"),
        (torch.ones(seq, seq, dtype=torch.bool), "it is attention over every key, with no causal mask at all: skip "
                                                 "key chunks after the query chunk, mask the diagonal pair, take "
                                                 "earlier chunks whole"),
        ((kc < qc) | ((kc == qc) & (kp < qp)), "the diagonal mask hides each query's own position: tril() keeps "
                                               "the diagonal (a query sees itself)"),
        ((kp <= qp) & (owner == rank), "only this rank's own K/V block is in it: the blocks of the other ranks "
                                       "never arrived or were not merged"),
        ((kp <= qp) & (owner == last), f"only the last block merged (rank {last}'s) is in it: each block must be "
                                       "merged into the running (out, lse), not replace it"),
    ]


def _value_hint(got: torch.Tensor, q, k, v, seq: int, cp: int, zigzag: bool, rank: int) -> str:
    rows = _positions(seq, rank, cp, zigzag)
    for allowed, meaning in _wrong_masks(seq, cp, zigzag, rank):
        want, _ = _attention(q[:, :, rows], k, v, allowed[rows])
        if got.shape == want.shape and close_enough(got, want, FP32, n=ROUNDINGS):
            return f": {meaning}"
    return ""


# ---- counting the work -------------------------------------------------------------------------
_aten = torch.ops.aten


def _matmul_flops(func, args) -> int:
    packet = func.overloadpacket
    if packet in (_aten.mm, _aten.bmm):
        a, b = args[0], args[1]
    elif packet in (_aten.addmm, _aten.baddbmm):
        a, b = args[1], args[2]
    elif packet is _aten._scaled_dot_product_flash_attention_for_cpu:
        return 4 * args[0].numel() * args[1].shape[-2]    # q (b, h, sq, d), k (b, h, sk, d): two matmuls
    else:
        return 0
    return 2 * a.numel() * b.shape[-1]                      # (..., n, k) @ (..., k, m)


class _Work(TorchDispatchMode):
    """Inside: the matmul FLOPs run, and at each matmul the bytes `sent` had counted by then."""

    def __init__(self, sent=None):
        super().__init__()
        self.flops, self.marks, self.sent = 0, [], sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flops = _matmul_flops(func, args)
        if flops:
            self.flops += flops
            if self.sent is not None:
                self.marks.append(self.sent.bytes)
        return func(*args, **(kwargs or {}))


def _pair_flops(heads: int, chunk: int) -> int:
    """Two matmuls, q k^T and probabilities times v, of 2 chunk^2 d FLOPs per query head."""
    return 2 * 2 * BATCH * heads * chunk * chunk * HEAD_DIM


def _pairs_done(flops: int, heads: int, chunk: int) -> float | int:
    pairs = flops / _pair_flops(heads, chunk)
    return int(pairs) if pairs == int(pairs) else round(pairs, 2)


def _show_list(values: list) -> str:
    return " ".join(str(v) for v in values)


# ---- the course's answer is refused --------------------------------------------------------------
@contextmanager
def _course_answer_refused(what: str) -> Iterator[None]:
    """Inside, the functions of the course's module raise, however the learner's code reaches them (imported
    here only to be refused: a learner's import inside the call would otherwise find it unpatched)."""
    course = importlib.import_module(PACKAGE)
    blocks = importlib.import_module(BLOCKS)
    layout = importlib.import_module(LAYOUT)

    def refuse(module, name: str) -> Callable:
        def call(*args, **kwargs):
            raise AssertionError(f"{what} called {module.__name__}.{name}, the course's answer; write your own")
        return call

    names = ("ring_attention", "attention_block", "merge_blocks", "online_softmax_attention", "ulysses_attention",
             "_all_to_all", *LAYOUT_NAMES, "take_cp_tokens", "gather_sequence")
    patches = [(module, name, refuse(module, name)) for name in names for module in (course, blocks)
               if hasattr(module, name)]
    patches += [(layout, name, refuse(layout, name)) for name in LAYOUT_NAMES]
    ring = getattr(course, "RingAttention", None)          # reached through a reference imported earlier
    forward = ring.__dict__["forward"] if ring is not None else None
    try:
        if ring is not None:
            ring.forward = staticmethod(refuse(course, "RingAttention"))
        with patched(patches):
            yield
    finally:
        if ring is not None:
            ring.forward = forward


# ==== 1. the layout ===============================================================================
def check_layout(rank_chunks: Callable, rank_positions: Callable) -> None:
    """rank_chunks(r, cp, zigzag): [r] of cp chunks, or [r, 2cp-1-r] of 2 cp under zig-zag; rank_positions:
    the positions of those chunks, in order. Every position held by exactly one rank; under zig-zag
    every rank's queries see equally many keys (causal work = sum over its positions p of p + 1)."""
    not_the_course_answer("check_layout", rank_chunks, rank_positions, **COURSE_ANSWER)
    note = ("causal work/rank: the (query, key) pairs of a rank's queries, key <= query; the plain split gives "
            "the last rank the most, zig-zag must give every rank the same")
    with Report("layout", note=note) as report, _course_answer_refused("check_layout"):
        for zigzag in (False, True):
            for cp, seq in LAYOUT_CASES:
                want = [_positions(seq, r, cp, zigzag) for r in range(cp)]
                chunks = [rank_chunks(r, cp, zigzag) for r in range(cp)]
                positions = [rank_positions(seq, r, cp, zigzag) for r in range(cp)]
                detail = _chunks_problem(chunks, cp, zigzag)
                positions, problem = _as_positions(positions, seq)
                detail = detail or problem
                held = torch.zeros(seq, dtype=torch.long)
                work = []
                if not problem:
                    for p in positions:
                        held += torch.bincount(p, minlength=seq)[:seq]
                        work.append(int((p + 1).sum()))
                    detail = detail or _coverage_problem(held, cp, zigzag, seq)
                    for r, (got, exp) in enumerate(zip(positions, want)):
                        if not detail and not torch.equal(got, exp):
                            detail = (f"rank {r}: rank_positions({seq}, {r}, {cp}, zigzag={zigzag}) returned "
                                      f"{_show_list(got.tolist())}, expected {_show_list(exp.tolist())}: the "
                                      "positions of its chunks, chunk by chunk, in the order of rank_chunks")
                    if not detail and zigzag and len(set(work)) > 1:
                        detail = f"zig-zag must balance the causal work, but the ranks do {work}"
                once = "-" if problem else ("yes" if bool((held == 1).all()) else "no")
                report.add(not detail, detail, layout=_layout(zigzag), cp=cp, seq_len=seq,
                           **{"chunks of rank 0, 1, ...": " ".join("+".join(map(str, c)) if isinstance(c, (list, tuple))
                                                                   else str(c) for c in chunks),
                              "each position once": once,
                              "causal work/rank": _show_list(work) if work else "-"})


def _chunks_problem(chunks: list, cp: int, zigzag: bool) -> str:
    for r, got in enumerate(chunks):
        want = _chunks(r, cp, zigzag)
        try:
            got = [int(c) for c in got]
        except (TypeError, ValueError):
            return f"rank {r}: rank_chunks({r}, {cp}, zigzag={zigzag}) returned {got!r}; return a list of chunk indices"
        if got == want:
            continue
        call = f"rank {r}: rank_chunks({r}, {cp}, zigzag={zigzag}) returned {got}, expected {want}"
        if zigzag and got == [r, cp - 1 - r]:
            return (f"{call}: chunk cp-1-r = {cp - 1 - r} lies in the first half of the sequence too. Pair chunk r "
                    f"with its mirror from the end, 2cp-1-r = {2 * cp - 1 - r}, so that an early chunk (few keys to "
                    "see) goes with a late one (many)")
        if zigzag and got == [r, r + cp]:
            return (f"{call}: chunks r and r+cp keep the order of the first half, so the last rank still holds the "
                    f"latest tokens of both halves and does the most work. Take the mirror from the end, 2cp-1-r = "
                    f"{2 * cp - 1 - r}")
        if sorted(got) == want:
            return f"{call}: list them in increasing order, the order of the rank's tokens"
        if zigzag and len(got) == 1:
            return f"{call}: under zig-zag the sequence is cut into 2 cp chunks and each rank holds two"
        return call
    return ""


def _as_positions(positions: list, seq: int) -> tuple[list[torch.Tensor], str]:
    out = []
    for r, p in enumerate(positions):
        if not isinstance(p, torch.Tensor):
            return [], f"rank {r}: rank_positions returned {type(p).__name__}; return a 1-D torch.long tensor"
        if p.dtype != torch.long or p.dim() != 1:          # the task asks for torch.long, the dtype of an index
            return [], (f"rank {r}: rank_positions returned a {p.dim()}-D {str(p.dtype).removeprefix('torch.')} "
                        "tensor; return the positions as a 1-D torch.long tensor (torch.arange, torch.cat)")
        if p.numel() and (int(p.min()) < 0 or int(p.max()) >= seq):
            return [], f"rank {r}: rank_positions holds {_show_list(p.tolist())}, outside [0, {seq})"
        out.append(p)
    return out, ""


def _coverage_problem(held: torch.Tensor, cp: int, zigzag: bool, seq: int) -> str:
    if bool((held == 1).all()):
        return ""
    never = (held == 0).nonzero().flatten().tolist()
    twice = (held > 1).nonzero().flatten().tolist()
    parts = ([f"positions {_show_list(never)} are held by no rank"] if never else []) + \
            ([f"positions {_show_list(twice)} by more than one"] if twice else [])
    why = (f"; with {2 * cp if zigzag else cp} chunks of {_width(seq, cp, zigzag)} tokens, each rank holds "
           f"{seq // cp} positions and together they hold each once")
    return ", ".join(parts) + why


# ==== 2. the merge ================================================================================
MERGE_SHAPE = (2, 3, 5)        # (batch, heads, queries)
MERGE_KEYS = (4, 6)            # keys in the running part and in the new block
MERGE_DIM = 4
# (name, offset of both blocks' scores, extra offset of the new block's, which keys the running part sees,
#  which the new block sees: "all", "none" or "some rows" (rows 0 and 3 of the block see nothing))
MERGE_CASES = [
    ("random scores", 0.0, 0.0, "all", "all"),
    ("scores near +90", 90.0, 0.0, "all", "all"),
    ("scores near -120", -120.0, 0.0, "all", "all"),
    ("new block dominates", 0.0, 30.0, "all", "all"),
    ("start: nothing seen yet", 0.0, 0.0, "none", "all"),
    ("new block fully masked", 0.0, 0.0, "all", "none"),
    ("some rows see none of it", 0.0, 0.0, "all", "some rows"),
    ("nothing seen on either side", 0.0, 0.0, "none", "none"),
]


def _visible(which: str, keys: int) -> torch.Tensor:
    batch, heads, queries = MERGE_SHAPE
    seen = torch.ones(batch, heads, queries, keys, dtype=torch.bool)
    if which == "none":
        seen[:] = False
    elif which == "some rows":
        seen[:, :, [0, 3]] = False
    return seen


def _partial(scores: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax attention over the keys `seen`, in float64; out 0 and lse -inf where none is."""
    scores = scores.double().masked_fill(~seen, -INF)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ values.double(), lse


def _merge_inputs(seed: int, offset: float, extra: float, first: str, second: str):
    batch, heads, queries = MERGE_SHAPE
    n1, n2 = MERGE_KEYS
    scores = rank_tensor(40, (batch, heads, queries, n1 + n2), torch.float64, seed) * 2 + offset
    scores[..., n1:] += extra
    values = rank_tensor(41, (batch, heads, n1 + n2, MERGE_DIM), torch.float64, seed)
    seen = torch.cat([_visible(first, n1), _visible(second, n2)], dim=-1)
    out, lse = _partial(scores[..., :n1], values[..., :n1, :], seen[..., :n1])
    block_out, block_lse = _partial(scores[..., n1:], values[..., n1:, :], seen[..., n1:])
    want = _partial(scores, values, seen)                  # attention over both key sets at once
    return [t.float() for t in (out, lse, block_out, block_lse)], want


def check_merge(merge: Callable) -> None:
    """merge(out, lse, block_out, block_lse) -> (out, lse): the attention over the keys of both parts, from each
    part's output and log-sum-exp, in fp32 without overflow and without NaN where an lse is -inf."""
    not_the_course_answer("check_merge", merge, **COURSE_ANSWER)
    note = (f"out, block_out {(*MERGE_SHAPE, MERGE_DIM)}, lse, block_lse {MERGE_SHAPE}, fp32: softmax attention over "
            f"{MERGE_KEYS[0]} and over {MERGE_KEYS[1]} keys. Expected: attention over all {sum(MERGE_KEYS)} keys "
            "(float64); a query that sees no key at all: out 0, lse -inf")
    with Report("merge", note=note) as report, _course_answer_refused("check_merge"), one_thread():
        for seed, (name, offset, extra, first, second) in enumerate(MERGE_CASES):
            inputs, (want_out, want_lse) = _merge_inputs(seed, offset, extra, first, second)
            before = [t.clone() for t in inputs]
            got = merge(*[t.clone() for t in inputs])
            got_out, got_lse, detail = _unpack(got, "merge")
            if not detail:
                detail = _merge_problem(name, before, got_out, got_lse, want_out, want_lse)
            report.add(not detail, detail, case=name, **{"lse (first values)": preview(before[1]),
                                                          "block lse (first values)": preview(before[3])},
                       max_err_out=_error(got_out, want_out), max_err_lse=_error(got_lse, want_lse))


def _unpack(got, what: str) -> tuple[torch.Tensor | None, torch.Tensor | None, str]:
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return None, None, f"{what} returned {type(got).__name__}; return the pair (out, lse) of tensors"
    return got[0], got[1], ""


def _error(got: torch.Tensor | None, want: torch.Tensor) -> float:
    """Largest difference, counting equal infinities as 0 and a NaN as inf."""
    if got is None or got.shape != want.shape:
        return INF
    got, want = got.double(), want.double()
    diff = (got - want).abs().masked_fill(got == want, 0.0)
    return diff.nan_to_num(nan=INF, posinf=INF).max().item() if diff.numel() else 0.0


def _merge_problem(name: str, inputs: list, got_out, got_lse, want_out, want_lse) -> str:
    out, lse, block_out, block_lse = (t.double() for t in inputs)
    if got_out.shape != want_out.shape or got_lse.shape != want_lse.shape:
        return (f"out has shape {tuple(got_out.shape)}, lse {tuple(got_lse.shape)}; expected "
                f"{tuple(want_out.shape)} and {tuple(want_lse.shape)}, the shapes of the inputs")
    bad = [what for what, t in (("out", got_out), ("lse", got_lse)) if bool(t.isnan().any())]
    bad += [what for what, t in (("out", got_out), ("lse", got_lse))
            if bool((t.isinf() & ~(t.double() == (want_out if what == "out" else want_lse))).any())]
    if bad:
        bad = list(dict.fromkeys(bad))
        where = f"{' and '.join(bad)} {'hold' if len(bad) > 1 else 'holds'} NaN or inf"
        if name == "nothing seen on either side":
            return (f"{where} where both lse are -inf: lse - new_lse is then -inf - (-inf) = NaN. Where the new lse "
                    "is -inf, no key was seen: subtract 0 instead (torch.where(new_lse == -inf, 0, new_lse)), so "
                    "both weights are exp(-inf) = 0 and out stays 0")
        if bool(lse.isinf().any() or block_lse.isinf().any()):
            return (f"{where} where one lse is -inf (a part that saw no key): its weight must be exp(-inf) = 0. "
                    "Compute the weights as exp(lse - new_lse), never from exp(lse) / exp(new_lse)")
        return (f"{where}: exp overflowed or underflowed (in fp32 exp is inf above 88.7 and 0 below -103). "
                "Never exponentiate an lse itself: new_lse = torch.logaddexp(lse, block_lse) (or subtract the max "
                "first), then weigh with exp(lse - new_lse) and exp(block_lse - new_lse), both <= 1")
    if not close_enough(got_lse, want_lse, FP32, n=ROUNDINGS):
        hints = [(lse, "returned the old lse unchanged"), (block_lse, "returned block_lse"),
                 (torch.maximum(lse, block_lse), "returned the larger of the two lse"),
                 (lse + block_lse, "added the two lse")]
        said = next((text for alt, text in hints if close_enough(got_lse, alt, FP32, n=ROUNDINGS)),
                    "the new lse is wrong")
        return (f"{said}: the new lse is log(exp(lse) + exp(block_lse)), torch.logaddexp(lse, block_lse). "
                f"{mismatch(got_lse, want_lse.float())}")
    # exp(lse - new_lse) turns the fp32 rounding of an lse of size L (u L) into a relative error u L of the weights:
    # the outputs are measured against that larger scale, max |out| x L (picotron.tolerance's `scale`).
    size = max([1.0] + [t[t.isfinite()].abs().max().item() for t in (lse, block_lse) if t.isfinite().any()])
    out_scale = want_out.abs().max().item() * size
    if not close_enough(got_out, want_out, FP32, n=ROUNDINGS, scale=out_scale):
        new_lse = torch.logaddexp(lse, block_lse)
        share = torch.exp(block_lse - new_lse).nan_to_num(0.0)[..., None]
        hints = [((out + block_out) / 2, "averaged the two outputs"),
                 (out + block_out * share, "weighed only the new block: the running out must be scaled by its share "
                                           "exp(lse - new_lse) too"),
                 (out * (1 - share) + block_out, "weighed only the running out: block_out must be scaled by its "
                                                 "share exp(block_lse - new_lse) too"),
                 (out * share + block_out * (1 - share), "swapped the weights")]
        said = next((text for alt, text in hints if close_enough(got_out, alt, FP32, n=ROUNDINGS, scale=out_scale)),
                    "out is wrong")
        return (f"{said}: each part weighs by its share of the total, out * exp(lse - new_lse) + block_out * "
                f"exp(block_lse - new_lse). {mismatch(got_out, want_out.float())}")
    return ""


# ==== 3. one block into the running output, on one device =========================================
def _block_cases() -> list[tuple[int, bool, int, int]]:
    return [(cp, zigzag, heads, kv_heads) for cp in CP_SIZES for zigzag, heads, kv_heads in RING_CASES]


def check_attend_block(attend_block: Callable) -> None:
    """attend_block(out, lse, q, k, v, q_chunks, kv_chunks) -> (out, lse). Replayed for every rank in one process:
    starting from out 0 and lse -inf, the K/V block of each rank in ring order (own block first). The result
    equals full causal attention for the rank's positions, and only the chunk pairs a query can see are
    computed (later key chunks skipped, the diagonal causal, earlier chunks whole)."""
    not_the_course_answer("check_attend_block", attend_block, **COURSE_ANSWER)
    note = ("one process: for each rank, out 0 and lse -inf, then attend_block with the K/V block of every rank in "
            "ring order. Expected: full causal attention (float64) at the rank's positions; chunk pairs: pairs of "
            "(query chunk, key chunk) computed, counted from the matmul FLOPs")
    with Report("attend_block", note=note) as report, _course_answer_refused("check_attend_block"), one_thread():
        for seed, (cp, zigzag, heads, kv_heads) in enumerate(_block_cases()):
            seq = SEQ[cp]
            q, k, v = _qkv(seq, heads, kv_heads, seed)
            want_out, want_lse = _attention(q, k, v, _causal(seq))
            chunk = _width(seq, cp, zigzag)
            errors, pairs, want_pairs, detail = [], [], [], ""
            for rank in range(cp):
                rows = _positions(seq, rank, cp, zigzag)
                out = torch.zeros(BATCH, heads, len(rows), HEAD_DIM)
                lse = torch.full((BATCH, heads, len(rows)), -INF)
                with _Work() as work:
                    for source in _ring_sources(rank, cp):
                        cols = _positions(seq, source, cp, zigzag)
                        got = attend_block(out, lse, q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                           _chunks(rank, cp, zigzag), _chunks(source, cp, zigzag))
                        out, lse, problem = _unpack(got, "attend_block")
                        if problem:
                            break
                pairs.append(_pairs_done(work.flops, heads, chunk))
                want_pairs.append(sum(_pairs_needed(rank, s, cp, zigzag) for s in range(cp)))
                if problem:
                    detail = detail or problem
                    errors.append(INF)
                    continue
                expected_out, expected_lse = want_out[:, :, rows], want_lse[:, :, rows]
                errors.append(max(_error(out, expected_out), _error(lse, expected_lse)))
                where = f"rank {rank} of cp={cp} (chunks {_chunks(rank, cp, zigzag)})"
                if not detail and not close_enough(out, expected_out, FP32, n=ROUNDINGS):
                    hint = _value_hint(out, q, k, v, seq, cp, zigzag, rank)
                    detail = f"{where}: the output is wrong{hint}. {mismatch(out, expected_out.float())}"
                if not detail and not close_enough(lse, expected_lse, FP32, n=ROUNDINGS):
                    detail = (f"{where}: the output is right but lse is wrong; return the merged lse with the "
                              f"output. {mismatch(lse, expected_lse.float())}")
            if not detail and pairs != want_pairs:
                rank = next(r for r, (a, b) in enumerate(zip(pairs, want_pairs)) if a != b)
                detail = _pairs_problem(rank, pairs[rank], want_pairs[rank], cp)
            report.add(not detail, detail, cp=cp, layout=_layout(zigzag), heads=f"{heads}/{kv_heads}",
                       max_err=max(errors), **{"chunk pairs/rank (want)": _show_list(want_pairs),
                                               "chunk pairs/rank (got)": _show_list(pairs)})


def _pairs_problem(rank: int, got, want: int, cp: int) -> str:
    text = f"rank {rank} computed {got} chunk pairs over the {cp} blocks where {want} are needed"
    if got > want:
        return (f"{text}: the output is right, but pairs whose key chunk comes after the query chunk were computed "
                "(fully masked, they add nothing). Call block_attention once per (query chunk, key chunk) pair a "
                "query can see, and skip the others: that skipping is the work zig-zag balances")
    return f"{text}: each visible pair is computed once, with two matmuls"


# ==== 4. the ring ================================================================================
def check_ring_attention(ring_attention: Callable) -> None:
    """ring_attention(q, k, v, group, zigzag) on each rank's slice of the sequence equals full causal attention
    at its positions. Point-to-point only; each rank sends its K/V onwards cp-1 times (one block each); the hop
    of each step is posted before that step's block is computed, so the two overlap."""
    not_the_course_answer("check_ring_attention", ring_attention, **COURSE_ANSWER)
    note = ("4 ranks as one ring of cp=4 and as two rings of cp=2 (ranks 0-1, 2-3); each rank gets q, k, v of its "
            "positions. Expected: full causal attention (float64) at those positions; (cp-1) K/V blocks sent per "
            "rank, 2 x batch x kv_heads x s/cp x d x 4 B each")
    with Report("ring_attention", note=note) as report:
        try:
            results = on_ranks(_ring_on_rank, WORLD, ring_attention, RING_CASES)
        except TimeoutError as e:
            raise AssertionError(f"ring_attention did not finish on every rank within {settings.check_timeout:g} s: a "
                                 "rank waited for a transfer that never came (a deadlock) or a loop never ended. "
                                 "Each rank posts one send to the next rank of its group and one receive from the "
                                 "previous, on the group passed in (dist.P2POp(..., group)). "
                                 f"{str(e).splitlines()[0]}") from None
        c = 0
        for cp in CP_SIZES:
            for seed, (zigzag, heads, kv_heads) in enumerate(RING_CASES):
                per_rank = [r[c] for r in results]
                c += 1
                _ring_row(report, per_rank, cp, seed, zigzag, heads, kv_heads)


def _ring_row(report: Report, per_rank: list, cp: int, seed: int, zigzag: bool, heads: int, kv_heads: int) -> None:
    seq = SEQ[cp]
    q, k, v = _qkv(seq, heads, kv_heads, seed)
    want_out, _ = _attention(q, k, v, _causal(seq))
    block = 2 * BATCH * kv_heads * (seq // cp) * HEAD_DIM * 4                       # K and V of s/cp tokens, fp32
    chunk = _width(seq, cp, zigzag)
    errors, detail = [], ""
    pairs, want_pairs = [], []
    for rank, result in enumerate(per_rank):
        me, members = _ring_place(rank, cp)
        rows = _positions(seq, me, cp, zigzag)
        expected = want_out[:, :, rows]
        got = result["out"]
        errors.append(_error(got, expected) if got is not None else INF)
        pairs.append(_pairs_done(result["flops"], heads, chunk))
        want_pairs.append(sum(_pairs_needed(me, s, cp, zigzag) for s in range(cp)))
        where = f"rank {rank} (rank {me} of its ring of {cp}, chunks {_chunks(me, cp, zigzag)})"
        if detail:
            continue
        if got is None:
            detail = (f"{where}: ring_attention returned {result['returned']}; return this rank's output, one tensor "
                      "(batch, heads, s/cp, d)")
        elif not close_enough(got, expected, FP32, n=ROUNDINGS):
            hint = _value_hint(got, q, k, v, seq, cp, zigzag, me) or _peer_note(result, rank, me, members)
            detail = f"{where}: the output is wrong{hint}{_group_note(cp, rank)}. {mismatch(got, expected.float())}"
    sent = [r["sent"] for r in per_rank]
    want_sent = (cp - 1) * block
    if not detail:
        detail = _bytes_problem(sent, want_sent, block, heads, kv_heads, cp)
    if not detail:
        detail = _order_problem(per_rank, cp, zigzag, block)
    if not detail and pairs != want_pairs:
        rank = next(r for r, (a, b) in enumerate(zip(pairs, want_pairs)) if a != b)
        detail = _pairs_problem(rank, pairs[rank], want_pairs[rank], cp)
    report.add(not detail, detail, cp=cp, layout=_layout(zigzag), heads=f"{heads}/{kv_heads}", max_err=max(errors),
               **{"sent/rank (B)": _show_list(sorted(set(sent))), "(cp-1) K/V blocks (B)": want_sent,
                  "chunk pairs/rank": _show_list(pairs)})


def _ring_place(rank: int, cp: int) -> tuple[int, list[int]]:
    """This rank's place in its ring, and the ring's members (global ranks)."""
    members = list(range(WORLD)) if cp == WORLD else [rank - rank % cp + i for i in range(cp)]
    return members.index(rank), members


def _group_note(cp: int, rank: int) -> str:
    if cp < WORLD and rank % cp != rank:
        return (f" (rank {rank} is rank {rank % cp} of its ring of {cp}: use dist.get_rank(group) and "
                "dist.get_world_size(group), not the global rank)")
    return ""


def _peer_note(result: dict, rank: int, me: int, members: list[int]) -> str:
    cp = len(members)
    nxt, prv = members[(me + 1) % cp], members[(me - 1) % cp]
    sends, recvs = sorted(set(result["sends"]), key=str), sorted(set(result["recvs"]), key=str)
    if sends and recvs and set(sends) <= {nxt} and set(recvs) <= {prv}:
        return ""
    if not sends and not recvs:
        return ": this rank sent and received nothing, so it only ever saw its own block"
    return (f": rank {rank} sent to rank(s) {sends} and received from {recvs}; in the ring it sends to the next rank, "
            f"{nxt}, and receives from the previous, {prv} (global ranks), so that at step τ it holds the block of "
            "group rank (r - τ) mod cp")


def _bytes_problem(sent: list[int], want: int, block: int, heads: int, kv_heads: int, cp: int) -> str:
    for rank, nbytes in enumerate(sent):
        if nbytes == want:
            continue
        text = f"rank {rank} sent {nbytes} B; expected (cp-1) = {cp - 1} K/V blocks of {block} B, {want} B"
        if nbytes == 0:
            return f"{text}: it sent nothing"
        if nbytes == cp * block:
            return (f"{text}: one hop too many. After cp-1 hops every rank has seen every block, so the last "
                    "step posts no hop")
        if kv_heads != heads and nbytes == want * heads // kv_heads:
            return (f"{text}: K and V were repeated to the {heads} query heads before sending; send them with their "
                    f"{kv_heads} K/V heads (block_attention repeats them on the receiving side)")
        return f"{text}: send K and V of this rank's s/cp tokens (one block) at each of the cp-1 hops"
    return ""


def _order_problem(per_rank: list, cp: int, zigzag: bool, block: int) -> str:
    """At step t a rank computes with t+1 hops posted (cp-1 at the last step): the hop of step t travels while
    the block of step t is computed. Steps with nothing to compute (the plain layout's future) are skipped."""
    for rank, result in enumerate(per_rank):
        me, _ = _ring_place(rank, cp)
        steps = [t for t, source in enumerate(_ring_sources(me, cp)) if _pairs_needed(me, source, cp, zigzag)]
        want = sorted({min(t + 1, cp - 1) * block for t in steps})
        got = sorted(set(result["marks"]))
        if got == want:
            continue
        text = (f"rank {rank} computed blocks with {_show_list([m // block for m in got])} hops posted "
                f"(expected {_show_list([m // block for m in want])}, one per step")
        if got and got[0] < want[0]:
            return (f"{text}): it computed a block before posting that step's hop. Post the send of the current "
                    "block and the receive of the next one first, compute while they travel, then wait")
        if got == [(cp - 1) * block] and cp > 2:
            return (f"{text}): it received every block before computing: that is an all-gather by another name, "
                    "every block in memory at once and nothing overlapped. Compute each block while the next one "
                    "travels")
        return f"{text}): one hop per step, posted before the step's block is computed"
    return ""


@contextmanager
def _recorded_peers() -> Iterator[tuple[list, list]]:
    """Inside, the global rank each send goes to and each receive comes from are listed (None: any source)."""
    sends, recvs = [], []

    def wrap(original: Callable, into: list, peer_name: str, group_peer_name: str) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def call(*args, **kwargs):
            try:
                arguments = signature.bind(*args, **kwargs).arguments
                peer, group_peer = arguments.get(peer_name), arguments.get(group_peer_name)
                if peer is None and group_peer is not None:
                    peer = dist.get_global_rank(arguments.get("group") or dist.group.WORLD, group_peer)
                into.append(peer)
            except (TypeError, ValueError, RuntimeError):
                into.append("?")
            return original(*args, **kwargs)
        return call

    table = {"isend": (sends, "dst", "group_dst"), "send": (sends, "dst", "group_dst"),
             "irecv": (recvs, "src", "group_src"), "recv": (recvs, "src", "group_src")}
    wrapped = {name: wrap(getattr(c10d, name), *how) for name, how in table.items()}
    with patched([(module, name, fn) for name, fn in wrapped.items() for module in (dist, c10d)]):
        yield sends, recvs


def _rings() -> list[tuple[int, object]]:
    """(cp, group) for the rings this rank belongs to. Every rank makes every group; their timeout turns a
    deadlocked hop into an error after HOP_TIMEOUT seconds."""
    timeout = timedelta(seconds=HOP_TIMEOUT)
    whole = dist.new_group(list(range(WORLD)), timeout=timeout)
    pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    return [(WORLD, whole), (2, pairs[dist.get_rank() // 2])]


def _ring_on_rank(ring_attention: Callable, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for cp, group in _rings():
        me, members = _ring_place(rank, cp)
        seq = SEQ[cp]
        for seed, (zigzag, heads, kv_heads) in enumerate(cases):
            rows = _positions(seq, me, cp, zigzag)
            q, k, v = (t[:, :, rows].contiguous() for t in _qkv(seq, heads, kv_heads, seed))
            with (only_point_to_point("ring_attention") as sent, _recorded_peers() as (sends, recvs),
                  _course_answer_refused("ring_attention"), _Work(sent) as work):
                try:
                    got = ring_attention(q, k, v, group, zigzag)
                except RuntimeError as e:
                    if "timed out" in str(e).lower():
                        raise AssertionError(_deadlock(rank, me, members, sends, recvs, str(e))) from None
                    if "connection closed" in str(e).lower():
                        # A neighbour stopped first (its own error, or its hop timed out): let its error
                        # reach the parent first, which then stops this rank during the wait.
                        time.sleep(SECOND_ERROR_DELAY)
                    raise
                except ValueError as e:
                    if "not part of group" not in str(e):
                        raise
                    raise AssertionError(f"rank {rank} (rank {me} of its ring of {cp}): {e}. dist.P2POp(op, tensor, "
                                         "peer, group) and dist.isend/irecv take the peer's global rank: "
                                         "dist.get_global_rank(group, group_rank)") from None
            result = {"out": got.detach().float().clone() if isinstance(got, torch.Tensor) else None,
                      "returned": type(got).__name__, "sent": sent.bytes, "marks": work.marks, "flops": work.flops,
                      "sends": sends, "recvs": recvs}
            out.append(result)
    return out


def _deadlock(rank: int, me: int, members: list[int], sends: list, recvs: list, error: str) -> str:
    cp = len(members)
    nxt, prv = members[(me + 1) % cp], members[(me - 1) % cp]
    return (f"the ring deadlocked: rank {rank} (rank {me} of its ring of {cp}) waited {HOP_TIMEOUT:g} s for a "
            f"transfer that never completed. It posted sends to rank(s) {sorted(set(sends), key=str)} and receives "
            f"from {sorted(set(recvs), key=str)}; in the ring each rank sends to the next rank ({nxt} here) and "
            f"receives from the previous ({prv}), both posted together (dist.batch_isend_irecv), so that every "
            f"send has a matching receive. (gloo: {error.splitlines()[0].split('] ')[-1]})")


# ==== 5. stretch: 2-D context parallelism, Ulysses inside a node, the ring across nodes ==========
# cp = u x r ranks. Ulysses group g (g < r): the u consecutive ranks g u .. g u + u - 1 (one node). Ring group j
# (j < u): the ranks j, j + u, ..., j + (r - 1) u, one from each node, at the same place in it. Rank g u + j
# holds piece j of u equal, contiguous pieces of ring rank g's tokens (rank_positions(s, g, r, zigzag)), so the
# Ulysses all-to-all, joining its pieces along the sequence in group-rank order, hands each rank of node g
# exactly ring rank g's tokens, for heads/u heads: ring_attention of part 4 then runs on them unchanged.
MESH_CASES = ((2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (8, 2))     # (u, r) for the layout, in one process
MESH_SEQ = 64
MESHES = ((2, 2), (1, 4), (4, 1))          # (u, r) on the 4 ranks: 2-D, the ring alone, Ulysses alone
SEQ_2D = 32                                # 2 r zig-zag chunks of 4 tokens at r = 4
# (query heads, key/value heads). 8/2 does not split over u = 4: there the task wants a ValueError.
HEADS_2D = ((4, 4), (8, 2))
CASES_2D = [(zigzag, heads, kv_heads) for heads, kv_heads in HEADS_2D for zigzag in (False, True)]
ALL_TO_ALL = ("all_to_all", "all_to_all_single")
POINT_TO_POINT = ("send", "isend")
ROUNDINGS_2D = HEAD_DIM + 2 * SEQ_2D + WORLD


def _groups_2d(rank: int, u: int, r: int) -> tuple[list[int], list[int]]:
    """(Ulysses group, ring group) of a global rank: the u ranks of its node; one rank of each node."""
    g, j = divmod(rank, u)
    return [g * u + i for i in range(u)], [j + i * u for i in range(r)]


def _positions_2d(seq: int, rank: int, u: int, r: int, zigzag: bool) -> torch.Tensor:
    g, j = divmod(rank, u)
    return _positions(seq, g, r, zigzag).chunk(u)[j]


def _splits_2d(u: int, heads: int, kv_heads: int) -> bool:
    return heads % u == 0 and kv_heads % u == 0


def check_mesh_2d(groups_2d: Callable, positions_2d: Callable) -> None:
    """groups_2d(rank, u, r) -> (Ulysses ranks, ring ranks), positions_2d(seq_len, rank, u, r, zigzag) -> the positions
    a rank holds; one process, every rank of several (u, r). The groups tile the ranks (Ulysses: consecutive
    ranks, a node; ring: one rank per node, the same place in each); each position is held once, and a
    Ulysses group's positions, joined in group-rank order, are ring rank g's (rank_positions(s, g, r, zigzag))."""
    not_the_course_answer("check_mesh_2d", groups_2d, positions_2d, **COURSE_ANSWER)
    note = (f"one process, cp = u x r ranks, s = {MESH_SEQ}. Expected: Ulysses group of rank g u + j = ranks g u .. "
            "g u + u - 1, its ring group = ranks j, j + u, ...; its positions = piece j of u of ring rank g's")
    with Report("mesh_2d", note=note) as report, _course_answer_refused("check_mesh_2d"):
        for u, r in MESH_CASES:
            for zigzag in (False, True):
                detail = _groups_problem(groups_2d, u, r) or _positions_2d_problem(positions_2d, u, r, zigzag)
                report.add(not detail, detail, u=u, r=r, layout=_layout(zigzag),
                           **{"Ulysses group of rank 1": _show_list(_groups_2d(1, u, r)[0]),
                              "ring group of rank 1": _show_list(_groups_2d(1, u, r)[1]),
                              "positions of rank 1": _show_list(_positions_2d(MESH_SEQ, 1, u, r, zigzag).tolist())})


def _as_ranks(value) -> list[int] | None:
    try:
        return [int(x) for x in value]
    except (TypeError, ValueError):
        return None


def _groups_problem(groups_2d: Callable, u: int, r: int) -> str:
    for rank in range(u * r):
        got = groups_2d(rank, u, r)
        call = f"groups_2d({rank}, u={u}, r={r})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2) or None in (_as_ranks(got[0]), _as_ranks(got[1])):
            return f"{call} returned {got!r}; return the pair (Ulysses ranks, ring ranks), two lists of global ranks"
        ulysses, ring = _as_ranks(got[0]), _as_ranks(got[1])
        want_ulysses, want_ring = _groups_2d(rank, u, r)
        if (ulysses, ring) == (want_ring, want_ulysses) and want_ring != want_ulysses:
            return (f"{call} returned Ulysses {ulysses} and ring {ring}: the two are swapped. The all-to-alls move "
                    "q, k, v and the output of every token, on the fast links: the Ulysses group is one node, the "
                    f"u consecutive ranks {want_ulysses}; the ring takes one rank from each node, {want_ring}")
        if ulysses != want_ulysses:
            strided = [rank % r + i * r for i in range(u)] if u * r > 1 else [rank]
            why = (": ranks i r + ... are spread over the nodes, so the all-to-all would cross them"
                   if sorted(ulysses) == sorted(strided) and ulysses != want_ulysses else "")
            return (f"{call}: the Ulysses group is {ulysses}, expected {want_ulysses}, the u consecutive ranks of "
                    f"node {rank // u} (ranks g u .. g u + u - 1, in order){why}")
        if ring != want_ring:
            return (f"{call}: the ring group is {ring}, expected {want_ring}: one rank from each node, at the same "
                    "place in it (ranks j, j + u, ..., in node order, which is the order of the ring)")
    return ""


def _positions_2d_problem(positions_2d: Callable, u: int, r: int, zigzag: bool) -> str:
    seq, cp = MESH_SEQ, u * r
    held = torch.zeros(seq, dtype=torch.long)
    for rank in range(cp):
        got = positions_2d(seq, rank, u, r, zigzag)
        want = _positions_2d(seq, rank, u, r, zigzag)
        call = f"positions_2d({seq}, {rank}, u={u}, r={r}, zigzag={zigzag})"
        if not isinstance(got, torch.Tensor) or got.dtype != torch.long or got.dim() != 1:
            return f"{call} returned {type(got).__name__}; return a 1-D torch.long tensor of s/(u r) positions"
        if torch.equal(got, want):
            held += torch.bincount(got, minlength=seq)[:seq]
            continue
        text = f"{call} returned {_show_list(got.tolist())}, expected {_show_list(want.tolist())}"
        if got.shape == want.shape and torch.equal(got, _positions(seq, rank, cp, zigzag)):
            return (f"{text}: that is the layout of one ring of cp = u r ranks, right only for u = 1. After the "
                    "all-to-all a rank holds the tokens of its whole node, and those must be ring rank g's tokens "
                    "(rank_positions(s, g, r, zigzag)) in order: give rank g u + j piece j of them")
        g, j = divmod(rank, u)
        ring = _positions(seq, g, r, zigzag)
        if got.shape == want.shape and torch.equal(got, ring[j::u]):
            return (f"{text}: every u-th token of ring rank g's. The all-to-all joins the pieces one after the "
                    "other, in group-rank order, so each piece must be contiguous: piece j of u")
        return f"{text}: piece j = {j} of u = {u} equal contiguous pieces of ring rank g = {g}'s positions"
    if not bool((held == 1).all()):
        return "the ranks together do not hold every position exactly once"
    return ""


def check_attention_2d(attention_2d: Callable) -> None:
    """attention_2d(q, k, v, ulysses_group, ring_group, zigzag) on the 4 ranks as u x r = 2 x 2, 1 x 4 and 4 x 1, each
    rank holding q, k, v of its positions (the layout of check_mesh_2d): the output equals full causal attention
    at those positions. Checked from the communication each rank records: all-to-alls only on its Ulysses group,
    handed q, k, v and the output once (K/V with their own heads; none needed when u = 1); point-to-point only to
    and from its ring group, (r - 1) K/V blocks of kv_heads/u heads and s/r tokens; no other collective; and where
    u does not divide both head counts, a ValueError naming u and both counts, before any communication."""
    not_the_course_answer("check_attention_2d", attention_2d, **COURSE_ANSWER)
    note = ("4 ranks as u x r = 2 x 2 (Ulysses groups 0-1, 2-3; rings 0-2, 1-3), 1 x 4 (one ring), 4 x 1 (one "
            "Ulysses group); each rank gets q, k, v of its positions. Expected: full causal attention (float64) at "
            "those positions; all-to-alls handed q, k, v, out once: batch x s/cp x d x (2 heads + 2 kv_heads) x 4 B; "
            "ring: (r-1) blocks of K and V, 2 x batch x kv_heads/u x s/r x d x 4 B each")
    with Report("attention_2d", note=note) as report:
        try:
            results = on_ranks(_attention_2d_on_rank, WORLD, attention_2d, CASES_2D)
        except TimeoutError as e:
            raise AssertionError(f"attention_2d did not finish on every rank within {settings.check_timeout:g} s: a "
                                 "rank waited in a collective or a hop the others never joined. Every rank of a "
                                 "group must make the same calls, in the same order, with the same sizes. "
                                 f"{str(e).splitlines()[0]}") from None
        c, rows = 0, []
        for u, r in MESHES:
            for seed, (zigzag, heads, kv_heads) in enumerate(CASES_2D):
                per_rank = [result[c] for result in results]
                c += 1
                rows.append(_attention_2d_row(per_rank, u, r, seed, zigzag, heads, kv_heads))
        u1_ok = all(ok for ok, _, _, columns in rows if columns["u"] == 1)
        for ok, detail, wrong_values, columns in rows:
            if wrong_values and u1_ok and columns["u"] > 1:
                detail += (" (Every u = 1 row passes: the layout inside the node is wrong. After the all-to-all "
                           "the u pieces must join, in Ulysses-group order, into ring rank g's tokens)")
            report.add(ok, detail, **columns)


def _meshes() -> list[tuple[int, int, object, object]]:
    """(u, r, Ulysses group, ring group) of this rank for each mesh. Every rank makes every group, in one order."""
    timeout, rank, out = timedelta(seconds=HOP_TIMEOUT), dist.get_rank(), []
    for u, r in MESHES:
        ulysses = [dist.new_group(_groups_2d(g * u, u, r)[0], timeout=timeout) for g in range(r)]
        rings = [dist.new_group(_groups_2d(j, u, r)[1], timeout=timeout) for j in range(u)]
        out.append((u, r, ulysses[rank // u], rings[rank % u]))
    return out


def _members(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _attention_2d_on_rank(attention_2d: Callable, cases: list) -> list:
    rank, out = dist.get_rank(), []
    for u, r, ulysses_group, ring_group in _meshes():
        for seed, (zigzag, heads, kv_heads) in enumerate(cases):
            rows = _positions_2d(SEQ_2D, rank, u, r, zigzag)
            q, k, v = (t[:, :, rows].contiguous() for t in _qkv(SEQ_2D, heads, kv_heads, seed))
            calls = []

            def record(name: str, arguments: dict) -> None:
                if name == "all_to_all_single":
                    given = [arguments.get("input")]
                elif name == "all_to_all":
                    given = list(arguments.get("input_tensor_list") or [])
                else:
                    given = tensors_in([arguments.get("tensor")] if name in POINT_TO_POINT
                                       else list(arguments.values()))
                try:
                    members = _members(arguments.get("group"))
                except (ValueError, RuntimeError):
                    members = []
                nbytes = sum(t.numel() * t.element_size() for t in given if isinstance(t, torch.Tensor))
                calls.append((name, members, nbytes))

            result = {"out": None, "returned": "", "raised": None, "calls": calls}
            with (collectives_observed(record), _recorded_peers() as (sends, recvs),
                  _course_answer_refused("attention_2d")):
                try:
                    got = attention_2d(q, k, v, ulysses_group, ring_group, zigzag)
                except NotImplementedError:
                    raise
                except AssertionError:
                    raise
                except Exception as e:                                   # noqa: BLE001 - reported in the table
                    if isinstance(e, RuntimeError) and "timed out" in str(e).lower():
                        raise AssertionError(f"rank {rank} (u={u}, r={r}) waited {HOP_TIMEOUT:g} s for a collective "
                                             "or a hop that never came, after "
                                             f"{[name for name, _, _ in calls]}, sending to {sends} and receiving "
                                             f"from {recvs}: every rank of a group must make the same calls") from None
                    result["raised"] = raised(e)
                else:
                    result["returned"] = type(got).__name__
                    if isinstance(got, torch.Tensor):
                        result["out"] = got.detach().float().clone()
            result.update(sends=list(sends), recvs=list(recvs))
            out.append(result)
    return out


def _a2a_bytes_2d(u: int, r: int, heads: int, kv_heads: int) -> int:
    """What one rank hands to the all-to-alls: its s/cp tokens of q and the output (heads), k and v (kv_heads)."""
    return BATCH * (SEQ_2D // (u * r)) * HEAD_DIM * (2 * heads + 2 * kv_heads) * 4


def _ring_bytes_2d(u: int, r: int, kv_heads: int) -> int:
    """What one rank sends round its ring: r - 1 blocks of K and V, kv_heads/u heads of s/r tokens."""
    return (r - 1) * 2 * BATCH * (kv_heads // u) * (SEQ_2D // r) * HEAD_DIM * 4


def _attention_2d_row(per_rank: list, u: int, r: int, seed: int, zigzag: bool, heads: int,
                      kv_heads: int) -> tuple[bool, str, bool, dict]:
    """(passed, detail, whether the first problem is a wrong value, the row's columns)."""
    splits = _splits_2d(u, heads, kv_heads)
    a2a = [sum(n for name, _, n in res["calls"] if name in ALL_TO_ALL) for res in per_rank]
    p2p = [sum(n for name, _, n in res["calls"] if name in POINT_TO_POINT) for res in per_rank]
    columns = {"u": u, "r": r, "layout": _layout(zigzag), "heads": f"{heads}/{kv_heads}"}
    errors, detail, wrong_values = [], "", False
    if not splits:
        detail = _refusal_2d_problem(per_rank, u, heads, kv_heads)
        columns.update({"max_err": "-", "to all-to-alls/rank (B)": "-", "want (B)": "ValueError",
                        "ring sent/rank (B)": "-", "want ring (B)": "ValueError"})
        return not detail, detail, False, columns
    q, k, v = _qkv(SEQ_2D, heads, kv_heads, seed)
    want_out, _ = _attention(q, k, v, _causal(SEQ_2D))
    for rank, result in enumerate(per_rank):
        rows = _positions_2d(SEQ_2D, rank, u, r, zigzag)
        expected, got = want_out[:, :, rows], result["out"]
        errors.append(_error(got, expected) if got is not None else INF)
        if detail:
            continue
        where = f"rank {rank} (u={u}, r={r})"
        if result["raised"] is not None:        # first: what it sent before it raised is cut short
            detail = f"{where}: attention_2d raised {result['raised'][0]}: {result['raised'][1][:300]}"
        elif detail := _traffic_2d_problem(result, rank, u, r, heads, kv_heads, a2a[rank], p2p[rank]):
            detail = f"{where}: {detail}"
        elif got is None:
            detail = (f"{where}: attention_2d returned {result['returned']}; return this rank's output, one tensor "
                      "(batch, heads, s/cp, d)")
        elif got.shape != expected.shape:
            detail = (f"{where}: the output has shape {tuple(got.shape)}, expected {tuple(expected.shape)}: this "
                      "rank's s/cp tokens with all the heads. After the ring, a second all-to-all gives each rank "
                      "its tokens back, for every head")
        elif not close_enough(got, expected, FP32, n=ROUNDINGS_2D):
            wrong_values = True
            detail = f"{where}: the output is wrong. {mismatch(got, expected.float())}"
    columns.update({"max_err": max(errors), "to all-to-alls/rank (B)": _show_list(sorted(set(a2a))),
                    "want (B)": _a2a_bytes_2d(u, r, heads, kv_heads) if u > 1 else "0 or " + str(
                        _a2a_bytes_2d(u, r, heads, kv_heads)),
                    "ring sent/rank (B)": _show_list(sorted(set(p2p))),
                    "want ring (B)": _ring_bytes_2d(u, r, kv_heads)})
    return not detail, detail, wrong_values, columns


def _traffic_2d_problem(result: dict, rank: int, u: int, r: int, heads: int, kv_heads: int, a2a: int,
                        p2p: int) -> str:
    """The first rule of the task the recorded communication breaks, in words; "" if none."""
    ulysses, ring = _groups_2d(rank, u, r)
    for name, members, _ in result["calls"]:
        if name not in ALL_TO_ALL + POINT_TO_POINT:
            return (f"it called dist.{name}; 2-D attention moves its tensors with all-to-alls inside the node and "
                    "point-to-point hops round the ring, nothing else. A gather of K and V would put the whole "
                    "sequence's keys on every rank at once")
        if name in ALL_TO_ALL and members != ulysses:
            return (f"it called dist.{name} over ranks {members}, but its Ulysses group is {ulysses}: the "
                    "all-to-alls stay inside the node, on the fast links (group=ulysses_group)")
    outside = sorted({peer for peer in result["sends"] + result["recvs"] if peer not in ring or peer == rank},
                     key=str)
    if outside:
        sends, recvs = (sorted(set(result[key]), key=str) for key in ("sends", "recvs"))
        return (f"it sent to {sends} and received from {recvs}: rank(s) {outside} are not in its "
                f"ring group {ring}. The hops go round the ring group, one rank of each node (ring_attention on "
                "ring_group)")
    want_a2a = _a2a_bytes_2d(u, r, heads, kv_heads)
    if a2a != want_a2a and not (u == 1 and a2a == 0):
        text = (f"it handed {a2a} B to its all-to-alls; expected q, k, v and the output once, {want_a2a} B (batch x "
                f"s/cp x d x (2 x {heads} + 2 x {kv_heads}) x 4 B)")
        if a2a == 0:
            return f"{text}: it called no all-to-all on its Ulysses group of {u}"
        if kv_heads != heads and a2a == _a2a_bytes_2d(u, r, heads, heads):
            return (f"{text}: K and V were repeated to the {heads} query heads before the all-to-all; send them with "
                    f"their {kv_heads} heads, kv_heads/u to each rank")
        if a2a == want_a2a - BATCH * (SEQ_2D // (u * r)) * HEAD_DIM * heads * 4:
            return f"{text}: the output was not sent back; a second all-to-all returns each rank its tokens"
        return f"{text}: exchange each of q, k, v once before the ring, and the output once after it"
    want_ring = _ring_bytes_2d(u, r, kv_heads)
    if p2p != want_ring:
        text = (f"it sent {p2p} B round its ring; expected r - 1 = {r - 1} blocks of K and V with kv_heads/u = "
                f"{kv_heads // u} heads of s/r = {SEQ_2D // r} tokens, {want_ring} B")
        if kv_heads != heads and p2p == want_ring * heads // kv_heads:
            return (f"{text}: K and V were repeated to the query heads before the ring; they travel with their own "
                    "heads, and block_attention repeats them where they are used")
        if p2p == want_ring * u:
            return f"{text}: u = {u} times that: the ring ran before the all-to-all, on every head"
        return text
    return ""


def _refusal_2d_problem(per_rank: list, u: int, heads: int, kv_heads: int) -> str:
    for rank, result in enumerate(per_rank):
        raised = result["raised"]
        where = f"rank {rank}: with {heads} query and {kv_heads} key/value heads on u={u}"
        if raised is None:
            return (f"{where}, attention_2d returned {result['returned']}; each rank of the Ulysses group must get "
                    "whole heads, so raise ValueError when u does not divide both head counts, naming them")
        if raised[0] != "ValueError":
            return (f"{where}, it raised {raised[0]} ({raised[1][:120]}); check the head counts first and raise "
                    "ValueError, naming u and both head counts")
        if not all(f"{n}" in raised[1] for n in (u, heads, kv_heads)):
            return (f"{where}, the ValueError says {raised[1][:160]!r}; name u ({u}) and both head counts "
                    f"({heads}, {kv_heads}), so the user knows what to change")
        if result["calls"] or result["sends"] or result["recvs"]:
            return (f"{where}, it called {[name for name, _, _ in result['calls']]} before raising; check the head "
                    "counts before any communication")
    return ""

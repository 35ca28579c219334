"""The checks of assignment 05, context parallelism (each rank holds a slice of every sequence), declared on the
course's engine (picotron_course.engine): in this process check_layout, check_merge, check_attend_block (every rank's
ring replayed) and the stretch's check_mesh_2d; on 4 ranks check_ring_attention (one ring of 4, two rings of 2: ranks
0-1, 2-3) and the stretch's check_attention_2d (u x r = 2x2, 1x4, 4x1). Each compares with softmax attention over the
whole sequence computed here in float64 (GQA by repeating the key/value heads), sliced to each rank's positions.
Nothing here uses picotron.parallel.context_parallel, the module the assignment rebuilds.

Layouts, for s tokens over cp ranks: "plain" gives rank r chunk r of cp; "zig-zag" cuts 2 cp chunks and gives rank r
chunks r and 2cp-1-r. On the ranks, torch.distributed is patched to record each collective (its group's members, the
bytes handed to it) and the peer of each send and receive: the rules of the task are read from that record, in words,
never from timing. Work is counted with a TorchDispatchMode: the FLOPs of every matmul (a chunk pair of c queries and
c keys: two matmuls of 2 c^2 d FLOPs per query head), and in the ring the bytes posted by each matmul (whether a hop
was posted before the block it overlaps). A deadlocked ring times out after HOP_TIMEOUT seconds, the rank naming the
ranks it sent to and received from. The misconceptions after each check are wrong answers learners write, with the
hint each should read; the correct bases they change (_chunks, _positions, _merge, _attend, _Ring, _groups_2d,
_positions_2d, _Attention2D) are refused as answers.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from picotron_course.checks import (CollectiveNotAllowed, collectives_observed, one_thread,
                                    only_point_to_point, patched, preview, raised, rank_tensor, tensors_in)
from picotron_course.engine import Check, Close, Exact, Misconception, Said, named, observe_on_ranks

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
# and P V over the longest sequence, and merging the blocks of up to 4 ranks (the 2-D checks: the same).
ROUNDINGS = HEAD_DIM + 2 * max(SEQ.values()) + max(CP_SIZES)
PACKAGE = "picotron.parallel.context_parallel"
BLOCKS = "picotron.parallel.online_softmax"     # its one-device building blocks: the course's answer too
LAYOUT = "picotron.data"                        # where the course's answer to the layout lives (the loader uses it)
LAYOUT_NAMES = ("cp_chunks", "cp_positions")
COURSE = (PACKAGE, BLOCKS, LAYOUT, __name__)    # the course's answers, and the correct bases of the misconceptions
ONLY = {LAYOUT: LAYOUT_NAMES, __name__: ("_chunks", "_positions", "_merge", "_attend", "_Ring", "_groups_2d",
                                         "_positions_2d", "_Attention2D")}
INF = math.inf
PAIR, LONGS = "a pair of tensors", "a 1-D int64 tensor"


# ---- the quantities and the runs of these checks ---------------------------------------------------
_exact = functools.partial(Exact, axes=("rank {}",))
_close = functools.partial(Close, n=ROUNDINGS, dtype=FP32, axes=("rank {}",))


def _variant(base: type, name: str, **changed) -> object:
    """A misconception as its correct base with some methods changed: an instance of a class `name`."""
    return type(name, (base,), {"__module__": __name__, **changed})()


def _lists(dicts: list[dict]) -> dict:
    """One dict a rank -> one dict of lists over the ranks (None where a rank has no such key)."""
    return {key: [d.get(key) for d in dicts] for key in dict.fromkeys(key for d in dicts for key in d)}


def _in_process(seen: Callable, what: str) -> Callable:
    """observe in this process, on one thread, the course's answer refused: seen(answer, case) of each."""
    def observe(answers: list, cases: list) -> list:
        with _course_answer_refused(what), one_thread():
            return [[seen(answer, case) for case in cases] for answer in answers]
    return observe


def _kind(value) -> str:
    """What an answer returned, in words."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {str(value.dtype).removeprefix('torch.')} tensor"
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value):
        return PAIR
    return f"a {type(value).__name__}"


def _output(value):
    """A rank's output as compared: the tensor, or what it was instead."""
    return value.detach().float().clone() if isinstance(value, torch.Tensor) else _kind(value)


def _as_ranks(value) -> list[int] | None:
    try:
        return [int(x) for x in value]
    except (TypeError, ValueError):
        return None


def _ratio(a: int, b: int) -> float | int:
    return a // b if a % b == 0 else round(a / b, 2)


def _show_list(values: list) -> str:
    return " ".join(str(v) for v in values)


def _hops(nbytes: int, sends: list, recvs: list) -> str:
    """What a rank sent point-to-point, and the global ranks it sent to and received from, in words."""
    def peers(ranks):
        return ", ".join(str(p) for p in sorted(set(ranks), key=str)) or "none"
    return f"{nbytes} B sent to rank(s) {peers(sends)}, received from rank(s) {peers(recvs)}"


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


def _pairs_needed(rank: int, source: int, cp: int, zigzag: bool) -> int:
    """Chunk pairs (query chunk of `rank`, key chunk of `source`) a query can see something of."""
    return sum(k <= q for q in _chunks(rank, cp, zigzag) for k in _chunks(source, cp, zigzag))


def _ring_sources(rank: int, cp: int) -> list[int]:
    """Whose K/V block a rank holds at each ring step: its own, then the previous rank's, ..."""
    return [(rank - step) % cp for step in range(cp)]


def _want_pairs(rank: int, cp: int, zigzag: bool) -> int:
    return sum(_pairs_needed(rank, source, cp, zigzag) for source in range(cp))


# ---- reference attention in the parent ----------------------------------------------------------
def _qkv(seq: int, heads: int, kv_heads: int, seed: int, rows=slice(None)) -> tuple[torch.Tensor, ...]:
    """q (batch, heads, seq, d) and k, v (batch, kv_heads, seq, d) of a whole sequence (its `rows`, on a rank):
    every rank and the parent make the same."""
    return tuple(rank_tensor(i, (BATCH, h, seq, HEAD_DIM), FP32, seed)[:, :, rows].contiguous()
                 for i, h in enumerate((heads, kv_heads, kv_heads)))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v over the keys `allowed` (sq, sk) lets each query see, in float64,
    and each query's log-sum-exp. A query that sees no key gets output 0 and lse -inf."""
    groups = q.shape[1] // k.shape[1]                      # GQA: query head i reads K/V head i // groups
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    return _partial(q.double() @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), v, allowed)


def _partial(scores: torch.Tensor, values: torch.Tensor, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax attention over the keys `seen`, in float64; out 0 and lse -inf where none is."""
    scores = scores.masked_fill(~seen, -INF)
    lse = torch.logsumexp(scores, dim=-1)                  # (batch, heads, sq)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0) @ values, lse


def _causal(seq: int, heads: int, kv_heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full causal attention over the whole sequence: (out, lse)."""
    return _attention(*_qkv(seq, heads, kv_heads, seed), torch.ones(seq, seq, dtype=torch.bool).tril())


def _start(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out 0 and lse -inf: attention over no key yet."""
    return torch.zeros(q.shape), torch.full(q.shape[:-1], -INF)


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


def _pairs_done(flops: int, heads: int, chunk: int) -> float | int:
    """Chunk pairs computed: two matmuls, q k^T and probabilities times v, of 2 chunk^2 d FLOPs per query head."""
    return _ratio(flops, 2 * 2 * BATCH * heads * chunk * chunk * HEAD_DIM)


PAIRS = ("(query chunk, key chunk) pairs computed, counted from the matmul FLOPs: each pair a query can see once, "
         "with two matmuls (block_attention once per pair); pairs whose key chunk comes after the query chunk "
         "skipped (fully masked, they add nothing): that skipping is the work zig-zag balances")


# ---- the course's answer is refused --------------------------------------------------------------
@contextmanager
def _course_answer_refused(what: str) -> Iterator[None]:
    """Inside, the functions of the course's modules raise, however the learner's code reaches them (imported
    here only to be refused: a learner's import inside the call would otherwise find it unpatched)."""
    def refuse(module, name: str) -> Callable:
        def call(*args, **kwargs):
            raise AssertionError(f"{what} called {module.__name__}.{name}, the course's answer; write your own")
        return call

    modules = [importlib.import_module(name) for name in (PACKAGE, BLOCKS, LAYOUT)]
    names = ("ring_attention", "attention_block", "merge_blocks", "online_softmax_attention", "ulysses_attention",
             "_all_to_all", *LAYOUT_NAMES, "take_cp_tokens", "gather_sequence")
    ring = getattr(modules[0], "RingAttention", None)      # reached through a reference imported earlier
    forward = ring.__dict__["forward"] if ring is not None else None
    try:
        if ring is not None:
            ring.forward = staticmethod(refuse(modules[0], "RingAttention"))
        with patched([(module, name, refuse(module, name)) for module in modules for name in names
                      if hasattr(module, name)]):
            yield
    finally:
        if ring is not None:
            ring.forward = forward


# ==== 1. the layout ===============================================================================
def _layout_case(answer: tuple, case: dict) -> dict:
    (rank_chunks, rank_positions), seq, cp, zigzag = answer, case["seq_len"], case["cp"], case["_zigzag"]
    seen = []
    for rank in range(cp):
        chunks, got = rank_chunks(rank, cp, zigzag), rank_positions(seq, rank, cp, zigzag)
        seen.append({"chunks": repr(chunks)[:60] if _as_ranks(chunks) is None else _as_ranks(chunks),
                     "returned": _kind(got), "positions": got.tolist() if _kind(got) == LONGS else None})
    seen = _lists(seen)
    if None not in seen["positions"]:
        held = Counter(p for positions in seen["positions"] for p in positions)
        seen.update(outside=[[p for p in positions if not 0 <= p < seq] for positions in seen["positions"]],
                    held=", ".join(f"{_show_list(ps)} held by {what}" for what, ps in (
                        ("no rank", [p for p in range(seq) if not held[p]]),
                        ("more than one", sorted(p for p, n in held.items() if n > 1))) if ps),
                    work=[sum(p + 1 for p in positions) for positions in seen["positions"]])
    return seen


def _expect_layout(case: dict, observed: dict) -> dict:
    seq, cp, zigzag = case["seq_len"], case["cp"], case["_zigzag"]
    return {"chunks": [_chunks(r, cp, zigzag) for r in range(cp)], "returned": [LONGS] * cp, "outside": [[]] * cp,
            "held": "", "positions": [_positions(seq, r, cp, zigzag).tolist() for r in range(cp)]}


LAYOUT_CHECK = Check(
    "layout", observe=_in_process(_layout_case, "check_layout"), expect=_expect_layout, course=COURSE, only=ONLY,
    note="causal work/rank: the (query, key) pairs of a rank's queries, key <= query; the plain split gives the last "
         "rank the most, zig-zag must give every rank the same",
    cases=[dict(layout=_layout(z), cp=cp, seq_len=seq, _zigzag=z) for z in (False, True) for cp, seq in LAYOUT_CASES],
    columns=lambda case, got: {"chunks of rank 0, 1, ...": " ".join(
        "+".join(map(str, c)) if isinstance(c, list) else c for c in got["chunks"]),
        "causal work/rank": _show_list(got.get("work") or ["-"])},
    quantities={
        "chunks": _exact("rank_chunks(r, cp, zigzag), a list of chunk indices: [r] of cp chunks; under zig-zag the "
                         "sequence is cut into 2 cp chunks and each rank holds two, [r, 2cp-1-r], in increasing order"),
        "returned": _exact("what rank_positions returned: the positions as a 1-D torch.long tensor (torch.arange, "
                           "torch.cat)"),
        "outside": _exact("positions outside [0, seq_len)"),
        "held": Exact("positions not held by exactly one rank: with 2 cp chunks (zig-zag) or cp chunks, each rank "
                      "holds seq_len/cp positions and together they hold each once"),
        "positions": _exact("rank_positions(seq_len, r, cp, zigzag): the positions of its chunks, chunk by chunk, in "
                            "the order of rank_chunks")},
    misconceptions=[
        Misconception((named("chunks_mirror_in_first_half", lambda r, cp, z: [r, cp - 1 - r] if z else [r]),
                       _positions), "chunk cp-1-r lies in the first half of the sequence too. Pair chunk r with its "
                                    "mirror from the end, 2cp-1-r, so that an early chunk (few keys to see) goes with "
                                    "a late one (many)"),
        Misconception((named("chunks_late_first", lambda r, cp, z: _chunks(r, cp, z)[::-1]), _positions),
                      "list the chunks in increasing order, the order of the rank's tokens"),
        Misconception((named("chunks_strided", lambda r, cp, z: [r, r + cp] if z else [r]), _positions),
                      "chunks r and r+cp keep the order of the first half, so the last rank still holds the latest "
                      "tokens of both halves and does the most work. Take the mirror from the end, 2cp-1-r"),
        Misconception((_chunks, named("positions_of_wide_chunks", lambda seq, r, cp, z: torch.cat(
            [torch.arange(c * (seq // cp), (c + 1) * (seq // cp)) for c in _chunks(r, cp, z)]))),
            "a zig-zag chunk holds seq_len/(2 cp) tokens, not seq_len/cp: chunk 2cp-1-r of wider chunks runs past "
            "the end of the sequence"),
        Misconception((_chunks, named("positions_as_floats", lambda *a: _positions(*a).float())),
                      "return the positions as a 1-D torch.long tensor, the dtype of an index, not floats"),
        Misconception((_chunks, named("positions_as_int32", lambda *a: _positions(*a).int())),
                      "int32 positions index fine, but the task asks for torch.long (int64), the dtype of an index"),
        Misconception((_chunks, named("positions_as_list", lambda *a: _positions(*a).tolist())),
                      "rank_positions returned a list; return a 1-D torch.long tensor (torch.arange, torch.cat)"),
        Misconception((_chunks, named("positions_overlap", lambda seq, r, cp, z: torch.arange(
            r * _width(seq, cp, z) // 2, r * _width(seq, cp, z) // 2 + seq // cp))),
            "some positions are held by no rank and others by more than one: each rank holds the positions of its "
            "own chunks, and together the ranks hold each position once")])


def check_layout(rank_chunks: Callable, rank_positions: Callable) -> None:
    """rank_chunks(r, cp, zigzag): [r] of cp chunks, or [r, 2cp-1-r] of 2 cp under zig-zag; rank_positions:
    the positions of those chunks, in order. Every position held by exactly one rank; under zig-zag
    every rank's queries see equally many keys (causal work = sum over its positions p of p + 1)."""
    LAYOUT_CHECK((rank_chunks, rank_positions))


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


def _merge_case(seed: int, name: str, offset: float, extra: float, first: str, second: str) -> dict:
    """The inputs (fp32 out, lse of the first keys, block_out, block_lse of the others) and attention over all the
    keys (float64), whose out carries its scale: exp(lse - new_lse) turns the fp32 rounding of an lse of size L
    into a relative error u L of the weights, so out is measured against max |out| x L (tolerance's `scale`)."""
    n1, n2 = MERGE_KEYS
    scores = rank_tensor(40, (*MERGE_SHAPE, n1 + n2), torch.float64, seed) * 2 + offset
    scores[..., n1:] += extra
    values = rank_tensor(41, (*MERGE_SHAPE[:2], n1 + n2, MERGE_DIM), torch.float64, seed)
    seen = torch.ones(*MERGE_SHAPE, n1 + n2, dtype=torch.bool)
    for keys, which in ((slice(None, n1), first), (slice(n1, None), second)):   # rows 0 and 3, or all, see none
        seen[..., {"all": slice(0, 0), "none": slice(None), "some rows": [0, 3]}[which], keys] = False
    inputs = [t.float() for keys in (slice(None, n1), slice(n1, None))
              for t in _partial(scores[..., keys], values[..., keys, :], seen[..., keys])]
    want = _partial(scores, values, seen)                 # attention over both key sets at once
    size = max([1.0] + [t[t.isfinite()].abs().max().item() for t in inputs[1::2] if t.isfinite().any()])
    want[0].scale = want[0].abs().max().item() * size
    return {"case": name, "lse (first values)": preview(inputs[1]), "block lse (first values)": preview(inputs[3]),
            "_inputs": inputs, "_want": want}


def _merge_seen(merge: Callable, case: dict) -> dict:
    got = merge(*[t.clone() for t in case["_inputs"]])
    if _kind(got) != PAIR:
        return {"returned": _kind(got)}
    bad = [what for what, t, want in zip(("out", "lse"), got, case["_want"]) if bool(t.isnan().any()) or (
        t.shape == want.shape and bool((t.isinf() & (t.double() != want)).any()))]
    return {"returned": PAIR, "nonfinite": bad, "out": got[0], "lse": got[1]}


def _weights(lse: torch.Tensor, block_lse: torch.Tensor, new: torch.Tensor | None = None, safe: bool = True):
    """Each part's share of the total, exp(lse - new_lse), and new_lse = log(exp(lse) + exp(block_lse)); where no key
    was seen at all (new_lse = -inf) 0 is subtracted instead, so that both shares are exp(-inf) = 0."""
    new = torch.logaddexp(lse, block_lse) if new is None else new
    at = torch.where(new == -INF, 0.0, new) if safe else new
    return (lse - at).exp()[..., None], (block_lse - at).exp()[..., None], new


def _merge(out, lse, block_out, block_lse, **how):
    """The correct merge the misconceptions below change (refused as an answer)."""
    a, b, new = _weights(lse, block_lse, **how)
    return out * a + block_out * b, new


def merge_without_max(out, lse, block_out, block_lse):
    a, b = lse.exp(), block_lse.exp()                                  # inf above 88.7, 0 below -103
    return (out * a[..., None] + block_out * b[..., None]) / (a + b)[..., None], (a + b).log()


def _lse(name: str, new_lse: Callable) -> Misconception:
    """The misconception of a merge whose out is right and whose lse is new_lse(lse, block_lse)."""
    return Misconception(named(name, lambda o, lse, bo, block_lse: (_merge(o, lse, bo, block_lse)[0],
                                                                     new_lse(lse, block_lse))),
                         f"it {name.removeprefix('merge_').replace('_', ' ')}: the new lse is log(exp(lse) + "
                         "exp(block_lse)), torch.logaddexp(lse, block_lse)")


_SHARES = "each part weighs by its share of the total, out * exp(lse - new_lse) + block_out * exp(block_lse - new_lse)"
MERGE = Check(
    "merge", observe=_in_process(_merge_seen, "check_merge"), course=COURSE, only=ONLY,
    expect=lambda case, got: {"returned": PAIR, "nonfinite": [], "out": case["_want"][0], "lse": case["_want"][1]},
    note=f"out, block_out {(*MERGE_SHAPE, MERGE_DIM)}, lse, block_lse {MERGE_SHAPE}, fp32: softmax attention over "
         f"{MERGE_KEYS[0]} and over {MERGE_KEYS[1]} keys. Expected: attention over all {sum(MERGE_KEYS)} keys "
         "(float64); a query that sees no key at all: out 0, lse -inf",
    cases=[_merge_case(seed, *case) for seed, case in enumerate(MERGE_CASES)],
    quantities={
        "returned": Exact("what merge returned: the pair (out, lse) of tensors, of the shapes of the inputs"),
        "nonfinite": Exact("which of out and lse hold NaN, or an infinity attention does not have: in fp32 exp is inf "
                           "above 88.7 and 0 below -103, so never exponentiate an lse itself; where an lse is -inf "
                           "(no key seen) its weight must be exp(-inf) = 0"),
        "lse": Close("lse: the new lse is log(exp(lse) + exp(block_lse)), torch.logaddexp(lse, block_lse)",
                     n=ROUNDINGS, dtype=FP32),
        "out": Close(f"out: {_SHARES}", n=ROUNDINGS, dtype=FP32)},
    misconceptions=[
        Misconception(merge_without_max, "exp overflowed or underflowed (in fp32 exp is inf above 88.7 and 0 below "
                                         "-103). Never exponentiate an lse itself: new_lse = torch.logaddexp(lse, "
                                         "block_lse) (or subtract the max first), then weigh with exp(lse - new_lse) "
                                         "and exp(block_lse - new_lse), both <= 1"),
        Misconception(named("merge_nan_when_both_empty", lambda *a: _merge(*a, safe=False)),
                      "where both lse are -inf, lse - new_lse is -inf - (-inf) = NaN. Where the new lse is -inf, no "
                      "key was seen: subtract 0 instead (torch.where(new_lse == -inf, 0, new_lse)), so both weights "
                      "are exp(-inf) = 0 and out stays 0"),
        Misconception(named("merge_log1p_around_lse", lambda o, lse, bo, block_lse: _merge(
            o, lse, bo, block_lse, new=lse + torch.log1p((block_lse - lse).exp()))),
            "where one lse is -inf (a part that saw no key) its weight must be exp(-inf) = 0, but lse + log1p(exp("
            "block_lse - lse)) is -inf + inf = NaN there: take new_lse = torch.logaddexp(lse, block_lse), and the "
            "weights exp(lse - new_lse), never from exp(lse) / exp(new_lse)"),
        _lse("merge_returned_the_old_lse_unchanged", lambda lse, block_lse: lse),
        _lse("merge_returned_block_lse", lambda lse, block_lse: block_lse),
        _lse("merge_returned_the_larger_of_the_two_lse", torch.maximum),
        _lse("merge_added_the_two_lse", torch.add),
        Misconception(named("merge_average", lambda o, lse, bo, block_lse: ((o + bo) / 2, torch.logaddexp(
            lse, block_lse))), f"it averaged the two outputs: {_SHARES}"),
        Misconception(named("merge_unscaled_running", lambda o, lse, bo, block_lse: (
            o + bo * _weights(lse, block_lse)[1], torch.logaddexp(lse, block_lse))),
            "it weighed only the new block: the running out must be scaled by its share exp(lse - new_lse) too"),
        Misconception(named("merge_unscaled_block", lambda o, lse, bo, block_lse: (
            o * _weights(lse, block_lse)[0] + bo, torch.logaddexp(lse, block_lse))),
            "it weighed only the running out: block_out must be scaled by its share exp(block_lse - new_lse) too"),
        Misconception(named("merge_swapped_weights", lambda o, lse, bo, block_lse: _merge(o, block_lse, bo, lse)),
                      f"it swapped the weights: {_SHARES}")])


def check_merge(merge: Callable) -> None:
    """merge(out, lse, block_out, block_lse) -> (out, lse): the attention over the keys of both parts, from each
    part's output and log-sum-exp, in fp32 without overflow and without NaN where an lse is -inf."""
    MERGE(merge)


# ==== 3. one block into the running output, on one device =========================================
def _tril(c: int, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(c, c, dtype=torch.bool).tril(diagonal)


def _attend(out, lse, q, k, v, q_chunks, kv_chunks, diagonal=lambda qc, kc, c: None if kc > qc else c * (kc < qc),
            merge=_merge):
    """The correct attend_block the misconceptions below change (refused as an answer): each (query chunk, key
    chunk) pair attended under the mask tril(diagonal(qc, kc, c)) (None: skipped; 0: causal; c: every key) and merged
    into the running (out, lse)."""
    c = q.shape[2] // len(q_chunks)
    outs, lses = list(out.split(c, 2)), list(lse.split(c, 2))
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(kv_chunks):
            if (d := diagonal(qc, kc, c)) is not None:
                keys = slice(j * c, (j + 1) * c)
                part = _attention(q[:, :, i * c:(i + 1) * c], k[:, :, keys], v[:, :, keys], _tril(c, d))
                outs[i], lses[i] = merge(outs[i], lses[i], *(t.to(q.dtype) for t in part))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def _attend_case(attend_block: Callable, case: dict) -> dict:
    cp, zigzag, (heads, kv_heads) = case["cp"], case["_zigzag"], case["_heads"]
    q, k, v = _qkv(SEQ[cp], heads, kv_heads, case["_seed"])
    seen = []
    for rank in range(cp):
        rows, returned = _positions(SEQ[cp], rank, cp, zigzag), PAIR
        out, lse = _start(q[:, :, rows])
        with _Work() as work:
            for source in _ring_sources(rank, cp):
                cols = _positions(SEQ[cp], source, cp, zigzag)
                got = attend_block(out, lse, q[:, :, rows], k[:, :, cols], v[:, :, cols], _chunks(rank, cp, zigzag),
                                   _chunks(source, cp, zigzag))
                if (returned := _kind(got)) != PAIR:
                    out = lse = None
                    break
                out, lse = got
        seen.append({"returned": returned, "out": out, "lse": lse,
                     "pairs": _pairs_done(work.flops, heads, _width(SEQ[cp], cp, zigzag))})
    return _lists(seen)


def _expect_attend(case: dict, observed: dict) -> dict:
    cp, zigzag = case["cp"], case["_zigzag"]
    out, lse = _causal(SEQ[cp], *case["_heads"], case["_seed"])
    rows = [_positions(SEQ[cp], rank, cp, zigzag) for rank in range(cp)]
    return {"returned": [PAIR] * cp, "out": [out[:, :, r] for r in rows], "lse": [lse[:, :, r] for r in rows],
            "pairs": [_want_pairs(rank, cp, zigzag) for rank in range(cp)]}


def _ring_cases() -> list[dict]:
    """cp, then the layouts and heads of RING_CASES, seeded in order within each cp."""
    return [dict(cp=cp, layout=_layout(z), heads=f"{h}/{kv}", _zigzag=z, _heads=(h, kv), _seed=seed, _groups=cp)
            for cp in CP_SIZES for seed, (z, h, kv) in enumerate(RING_CASES)]


def _diagonal(name: str, diagonal: Callable) -> Callable:
    return named(name, lambda *args: _attend(*args, diagonal=diagonal))


ATTEND = Check(
    "attend_block", observe=_in_process(_attend_case, "check_attend_block"), expect=_expect_attend, course=COURSE,
    only=ONLY, note="one process: for each rank, out 0 and lse -inf, then attend_block with the K/V block of every "
                    "rank in ring order. Expected: full causal attention (float64) at the rank's positions; chunk "
                    "pairs: pairs of (query chunk, key chunk) computed, counted from the matmul FLOPs",
    cases=[dict(case, _seed=seed, **{"chunk pairs/rank (want)": _show_list(
        [_want_pairs(r, case["cp"], case["_zigzag"]) for r in range(case["cp"])])})
        for seed, case in enumerate(_ring_cases())],
    columns=lambda case, got: {"chunk pairs/rank (got)": _show_list(got["pairs"])},
    quantities={"returned": _exact("what attend_block returned: the pair (out, lse) of tensors"),
                "out": _close("the output after every block, against full causal attention at the rank's positions"),
                "lse": _close("lse after every block: return the merged lse with the output"),
                "pairs": _exact(PAIRS)},
    misconceptions=[
        Misconception(_diagonal("diagonal_unmasked", lambda qc, kc, c: None if kc > qc else c),
                      "the diagonal chunk pair (key chunk = query chunk) was attended without the causal mask: there "
                      "a query sees only its own position and the ones before it, torch.ones(w, w, dtype=torch.bool)"
                      ".tril() for chunks of w tokens"),
        Misconception(_diagonal("future_attended", lambda qc, kc, c: 0 if kc == qc else c),
                      "key chunks that come after the query chunk were attended: they are the future of every query "
                      "in the chunk; skip those pairs"),
        Misconception(_diagonal("no_mask_at_all", lambda qc, kc, c: c),
                      "it is attention over every key, with no causal mask at all: skip key chunks after the query "
                      "chunk, mask the diagonal pair, take earlier chunks whole"),
        Misconception(_diagonal("diagonal_hides_itself", lambda qc, kc, c: None if kc > qc else -1 if kc == qc else c),
                      "the diagonal mask hides each query's own position: tril() keeps the diagonal (a query sees "
                      "itself)"),
        Misconception(named("attend_replaces", lambda *args: _attend(*args, merge=lambda o, lse, bo, bl: (bo, bl))),
                      "only the last block computed is in the output: each block must be merged into the running "
                      "(out, lse), not replace it"),
        Misconception(_diagonal("future_computed_masked", lambda qc, kc, c: -c if kc > qc else c * (kc < qc)),
                      "the output is right, but pairs whose key chunk comes after the query chunk were computed "
                      "(fully masked, they add nothing; the whole block in one call computes them too). Call "
                      "block_attention once per (query chunk, key chunk) pair a query can see, and skip the others: "
                      "that skipping is the work zig-zag balances")])


def check_attend_block(attend_block: Callable) -> None:
    """attend_block(out, lse, q, k, v, q_chunks, kv_chunks) -> (out, lse). Replayed for every rank in one process:
    starting from out 0 and lse -inf, the K/V block of each rank in ring order (own block first). The result
    equals full causal attention for the rank's positions, and only the chunk pairs a query can see are
    computed (later key chunks skipped, the diagonal causal, earlier chunks whole)."""
    ATTEND(attend_block)


# ==== 4. the ring ================================================================================
@contextmanager
def _recorded_peers() -> Iterator[tuple[list, list]]:
    """Inside, the global rank each send goes to and each receive comes from are listed (None: any source)."""
    peers = {"send": [], "recv": []}

    def wrap(name: str) -> Callable:
        original, side = getattr(c10d, name), name.removeprefix("i")
        signature, peer = inspect.signature(original), "dst" if side == "send" else "src"

        @functools.wraps(original)
        def call(*args, **kwargs):
            try:
                given = signature.bind(*args, **kwargs).arguments
                group_peer = given.get(f"group_{peer}")
                peers[side].append(given.get(peer) if group_peer is None else
                                   dist.get_global_rank(given.get("group") or dist.group.WORLD, group_peer))
            except (TypeError, ValueError, RuntimeError):
                peers[side].append("?")
            return original(*args, **kwargs)
        return call

    wrapped = {name: wrap(name) for name in ("isend", "send", "irecv", "recv")}   # one wrapper a name: P2POp checks
    with patched([(module, name, fn) for name, fn in wrapped.items() for module in (dist, c10d)]):
        yield peers["send"], peers["recv"]


def _ring_place(rank: int, cp: int) -> tuple[int, list[int]]:
    """This rank's place in its ring, and the ring's members (global ranks): 0-3, or its pair, 0-1 or 2-3."""
    return rank % cp, list(range(rank - rank % cp, rank - rank % cp + cp))


def _rings() -> dict[int, tuple]:
    """{cp: (group,)} of the rings this rank belongs to. Every rank makes every group; their timeout turns a
    deadlocked hop into an error after HOP_TIMEOUT seconds."""
    timeout = timedelta(seconds=HOP_TIMEOUT)
    whole = dist.new_group(list(range(WORLD)), timeout=timeout)
    pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    return {WORLD: (whole,), 2: (pairs[dist.get_rank() // 2],)}


def _block_bytes(cp: int, kv_heads: int) -> int:
    return 2 * BATCH * kv_heads * (SEQ[cp] // cp) * HEAD_DIM * 4                  # K and V of s/cp tokens, fp32


def _ring_case(ring_attention: Callable, case: dict, group) -> dict:
    rank, cp, zigzag, (heads, kv_heads) = dist.get_rank(), case["cp"], case["_zigzag"], case["_heads"]
    me, members = _ring_place(rank, cp)
    q, k, v = _qkv(SEQ[cp], heads, kv_heads, case["_seed"], _positions(SEQ[cp], me, cp, zigzag))
    with (only_point_to_point("ring_attention") as sent, _recorded_peers() as (sends, recvs),
          _course_answer_refused("ring_attention"), _Work(sent) as work):
        try:
            got = ring_attention(q, k, v, group, zigzag)
        except CollectiveNotAllowed as e:
            return {"refused": str(e)}
        except ValueError as e:
            if "not part of group" not in str(e):
                raise
            return {"refused": f"{str(e).split(' is not part')[0]} is not part of its ring of {cp}"}
        except RuntimeError as e:
            if "timed out" in str(e).lower():
                raise AssertionError(_deadlock(rank, me, members, sends, recvs, str(e))) from None
            if "connection closed" in str(e).lower():
                # A neighbour stopped first (its own error, or its hop timed out): let its error
                # reach the parent first, which then stops this rank during the wait.
                time.sleep(SECOND_ERROR_DELAY)
            raise
    return {"refused": "", "hops": _hops(sent.bytes, sends, recvs),
            "posted": sorted({_ratio(mark, _block_bytes(cp, kv_heads)) for mark in work.marks}),
            "pairs": _pairs_done(work.flops, heads, _width(SEQ[cp], cp, zigzag)), "out": _output(got)}


def _deadlock(rank: int, me: int, members: list[int], sends: list, recvs: list, error: str) -> str:
    cp = len(members)
    nxt, prv = members[(me + 1) % cp], members[(me - 1) % cp]
    return (f"the ring deadlocked: rank {rank} (rank {me} of its ring of {cp}) waited {HOP_TIMEOUT:g} s for a "
            f"transfer that never completed. It posted sends to rank(s) {sorted(set(sends), key=str)} and receives "
            f"from {sorted(set(recvs), key=str)}; in the ring each rank sends to the next rank ({nxt} here) and "
            f"receives from the previous ({prv}), both posted together (dist.batch_isend_irecv), so that every "
            f"send has a matching receive. (gloo: {error.splitlines()[0].split('] ')[-1]})")


def _want_posted(me: int, cp: int, zigzag: bool) -> list[int]:
    """At step t a rank computes with t+1 hops posted (cp-1 at the last step): the hop of step t travels while the
    block of step t is computed. Steps with nothing to compute (the plain layout's future) are skipped."""
    return sorted({min(t + 1, cp - 1) for t, source in enumerate(_ring_sources(me, cp))
                   if _pairs_needed(me, source, cp, zigzag)})


def _expect_ring(case: dict, observed: dict) -> dict:
    cp, zigzag = case["cp"], case["_zigzag"]
    out, _ = _causal(SEQ[cp], *case["_heads"], case["_seed"])
    places = [_ring_place(rank, cp) for rank in range(WORLD)]
    return {"refused": [""] * WORLD, "posted": [_want_posted(me, cp, zigzag) for me, _ in places],
            "hops": [_hops((cp - 1) * _block_bytes(cp, case["_heads"][1]), [ring[(me + 1) % cp]],
                           [ring[(me - 1) % cp]]) for me, ring in places],
            "pairs": [_want_pairs(me, cp, zigzag) for me, _ in places],
            "out": [out[:, :, _positions(SEQ[cp], me, cp, zigzag)] for me, _ in places]}


class _Ring:
    """The correct ring_attention the misconceptions below change (refused as an answer): K and V stacked, each
    hop posted with dist.batch_isend_irecv before the step's block is computed, waited for after it."""

    def __call__(self, q, k, v, group, zigzag):
        cp, me = dist.get_world_size(group), self.rank(group)
        out, lse = _start(q)
        for source, kv in self.blocks(self.block(q, k, v), group, me, cp):
            out, lse = _attend(out, lse, q, kv[0], kv[1], _chunks(me, cp, zigzag), _chunks(source, cp, zigzag))
        return self.result(out, lse)

    def blocks(self, kv, group, me: int, cp: int) -> Iterator:
        """(whose block, the block) at each step, the next hop posted before the step's block is computed."""
        for step in range(cp):
            hop = self.post(kv, group, me, cp) if step < self.hops(cp) else None
            yield (me - step) % cp, kv
            kv = self.arrive(hop) if hop else kv

    def post(self, kv, group, me: int, cp: int):
        nxt, prv = self.peers(group, me, cp)
        incoming = torch.empty_like(kv)
        return incoming, dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, nxt, group),
                                                 dist.P2POp(dist.irecv, incoming, prv, group)])

    def arrive(self, hop):
        for request in hop[1]:
            request.wait()
        return hop[0]

    def peers(self, group, me: int, cp: int) -> list[int]:
        """The global ranks of the next rank of the ring and of the previous one."""
        return [dist.get_global_rank(group, (me + step) % cp) for step in (1, -1)]

    def rank(self, group) -> int:
        return dist.get_rank(group)

    def hops(self, cp: int) -> int:
        return cp - 1

    def block(self, q, k, v):
        return torch.stack([k, v])

    def result(self, out, lse):
        return out


def _all_gathered(ring: _Ring, kv, group, me: int, cp: int) -> Iterator:
    blocks = [torch.empty_like(kv) for _ in range(cp)]
    dist.all_gather(blocks, kv, group=group)
    return enumerate(blocks)


_RING_ALL_GATHER = _variant(_Ring, "RingAllGather", blocks=_all_gathered)
_RING_REPEATED_HEADS = _variant(_Ring, "RingRepeatedHeads", block=lambda self, q, k, v: torch.stack(
    [t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v)]))
_TO_NEXT = ("in the ring each rank sends to the next rank and receives from the previous (global ranks), so that at "
            "step τ it holds the block of group rank (r - τ) mod cp")
RING = Check(
    "ring_attention", observe=observe_on_ranks(WORLD, _ring_case, _rings, "_groups", deadlock=(
        "ring_attention did not finish on every rank within {timeout:g} s: a rank waited for a transfer that never "
        "came (a deadlock) or a loop never ended. Each rank posts one send to the next rank of its group and one "
        "receive from the previous, on the group passed in (dist.P2POp(..., group)).")),
    expect=_expect_ring, course=COURSE, only=ONLY, cases=_ring_cases(),
    note="4 ranks as one ring of cp=4 and as two rings of cp=2 (ranks 0-1, 2-3); each rank gets q, k, v of its "
         "positions. Expected: full causal attention (float64) at those positions; (cp-1) K/V blocks sent per rank, "
         "2 x batch x kv_heads x s/cp x d x 4 B each",
    columns=lambda case, got: {"chunk pairs/rank": _show_list(got.get("pairs") or ["-"])},
    quantities={
        "refused": Said("what the rank refused: a collective (ring_attention uses point-to-point operations only), or "
                        "a peer outside its group (dist.P2POp(op, tensor, peer, group) and dist.isend/irecv take the "
                        "peer's global rank: dist.get_global_rank(group, group_rank))", axes=("rank {}",)),
        "hops": _exact("what each rank sent round its ring and its peers: K and V of its s/cp tokens (one block, with "
                       f"their own kv_heads heads) at each of the cp-1 hops, none after the last; {_TO_NEXT}"),
        "posted": _exact("the hops posted when each block was computed: one hop per step, posted before the step's "
                         "block is computed, so that the two overlap"),
        "pairs": _exact(PAIRS),
        "out": _close("this rank's output, one tensor (batch, heads, s/cp, d), against full causal attention at its "
                      "positions")},
    misconceptions=[
        Misconception(_RING_ALL_GATHER, "ring_attention must use point-to-point operations only: an all-gather puts "
                                        "every block in memory at once; pass the blocks round the ring"),
        Misconception(_variant(_Ring, "RingGroupRanksAsPeers", peers=lambda self, group, me, cp: [
            (me + 1) % cp, (me - 1) % cp]), "dist.P2POp(op, tensor, peer, group) and dist.isend/irecv take the peer's "
                                            "global rank: dist.get_global_rank(group, group_rank)"),
        Misconception(_variant(_Ring, "RingOwnBlockOnly", blocks=lambda self, kv, group, me, cp: [(me, kv)]),
                      "only this rank's own K/V block is in the output: this rank sent and received nothing, so it "
                      "only ever saw its own block"),
        Misconception(_variant(_Ring, "RingReversed", peers=lambda self, *args: _Ring.peers(self, *args)[::-1]),
                      f"the blocks went the wrong way round: {_TO_NEXT}"),
        Misconception(_variant(_Ring, "RingOneHopTooMany", hops=lambda self, cp: cp),
                      "one hop too many. After cp-1 hops every rank has seen every block, so the last step posts no "
                      "hop"),
        Misconception(_RING_REPEATED_HEADS, "K and V were repeated to the query heads before sending; send them with "
                                            "their own K/V heads (block_attention repeats them on the receiving side)"),
        Misconception(_variant(_Ring, "RingComputeThenSend", post=lambda self, *args: args,
                               arrive=lambda self, hop: _Ring.arrive(self, _Ring.post(self, *hop))),
                      "it computed a block before posting that step's hop. Post the send of the current block and the "
                      "receive of the next one first, compute while they travel, then wait"),
        Misconception(_variant(_Ring, "RingGathersThenComputes", blocks=lambda self, *args: list(
            _Ring.blocks(self, *args))), "it received every block before computing: that is an all-gather by another "
                                         "name, every block in memory at once and nothing overlapped. Compute each "
                                         "block while the next one travels"),
        Misconception(_variant(_Ring, "RingGlobalRank", rank=lambda self, group: dist.get_rank()),
                      "the rings of 2 fail: rank 2 is rank 0 of its ring of 2. Use dist.get_rank(group) and "
                      "dist.get_world_size(group), not the global rank"),
        Misconception(_variant(_Ring, "RingReturnsLse", result=lambda self, out, lse: (out, lse)),
                      "return this rank's output, one tensor (batch, heads, s/cp, d), not (out, lse)")])


def check_ring_attention(ring_attention: Callable) -> None:
    """ring_attention(q, k, v, group, zigzag) on each rank's slice of the sequence equals full causal attention
    at its positions. Point-to-point only; each rank sends its K/V onwards cp-1 times (one block each); the hop
    of each step is posted before that step's block is computed, so the two overlap."""
    RING(ring_attention)


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
GROUPS = "a pair of lists of ranks"


def _groups_2d(rank: int, u: int, r: int) -> tuple[list[int], list[int]]:
    """(Ulysses group, ring group) of a global rank: the u ranks of its node; one rank of each node."""
    g, j = divmod(rank, u)
    return [g * u + i for i in range(u)], [j + i * u for i in range(r)]


def _positions_2d(seq: int, rank: int, u: int, r: int, zigzag: bool) -> torch.Tensor:
    g, j = divmod(rank, u)
    return _positions(seq, g, r, zigzag).chunk(u)[j]


def _mesh_case(answer: tuple, case: dict) -> dict:
    (groups_2d, positions_2d), u, r = answer, case["u"], case["r"]
    seen = []
    for rank in range(u * r):
        groups, got = groups_2d(rank, u, r), positions_2d(MESH_SEQ, rank, u, r, case["_zigzag"])
        pair = isinstance(groups, (tuple, list)) and len(groups) == 2 and None not in map(_as_ranks, groups)
        seen.append({"groups": GROUPS if pair else repr(groups)[:60], "ulysses": pair and _as_ranks(groups[0]),
                     "ring": pair and _as_ranks(groups[1]), "returned": _kind(got),
                     "positions": got.tolist() if isinstance(got, torch.Tensor) else None})
    return _lists(seen)


def _expect_mesh(case: dict, observed: dict) -> dict:
    u, r, ranks = case["u"], case["r"], range(case["u"] * case["r"])
    return {"groups": [GROUPS] * len(ranks), "ulysses": [_groups_2d(k, u, r)[0] for k in ranks],
            "ring": [_groups_2d(k, u, r)[1] for k in ranks], "returned": [LONGS] * len(ranks),
            "positions": [_positions_2d(MESH_SEQ, k, u, r, case["_zigzag"]).tolist() for k in ranks]}


_OF_RANK_1 = {"Ulysses group of rank 1": lambda u, r, z: _groups_2d(1, u, r)[0],
              "ring group of rank 1": lambda u, r, z: _groups_2d(1, u, r)[1],
              "positions of rank 1": lambda u, r, z: _positions_2d(MESH_SEQ, 1, u, r, z).tolist()}
MESH = Check(
    "mesh_2d", observe=_in_process(_mesh_case, "check_mesh_2d"), expect=_expect_mesh, course=COURSE, only=ONLY,
    note=f"one process, cp = u x r ranks, s = {MESH_SEQ}. Expected: Ulysses group of rank g u + j = ranks g u .. "
         "g u + u - 1, its ring group = ranks j, j + u, ...; its positions = piece j of u of ring rank g's",
    cases=[dict(u=u, r=r, layout=_layout(z), _zigzag=z, **{k: _show_list(f(u, r, z)) for k, f in _OF_RANK_1.items()})
           for u, r in MESH_CASES for z in (False, True)],
    quantities={
        "groups": _exact("what groups_2d(rank, u, r) returned: the pair (Ulysses ranks, ring ranks), two lists of "
                         "global ranks"),
        "ulysses": _exact("the Ulysses group: the u consecutive ranks of the rank's node (ranks g u .. g u + u - 1, "
                          "in order): the all-to-alls move q, k, v and the output of every token, on the fast links"),
        "ring": _exact("the ring group: one rank from each node, at the same place in it (ranks j, j + u, ..., in "
                       "node order, which is the order of the ring)"),
        "returned": _exact("what positions_2d returned: a 1-D torch.long tensor of s/(u r) positions"),
        "positions": _exact("positions_2d(s, rank, u, r, zigzag): piece j = rank % u of u equal contiguous pieces of "
                            "ring rank g = rank // u's positions (rank_positions(s, g, r, zigzag))")},
    misconceptions=[
        Misconception((named("groups_swapped", lambda rank, u, r: _groups_2d(rank, u, r)[::-1]), _positions_2d),
                      "the two groups are swapped. The all-to-alls move q, k, v and the output of every token, on "
                      "the fast links: the Ulysses group is one node, the u consecutive ranks; the ring takes one "
                      "rank from each node"),
        Misconception((named("groups_ulysses_strided", lambda rank, u, r: (
            list(range(rank % r, u * r, r)), list(range(rank // r * r, rank // r * r + r)))), _positions_2d),
            "the Ulysses group must be the u consecutive ranks of a node: ranks i r + ... are spread over the "
            "nodes, so the all-to-all would cross them"),
        Misconception((named("groups_ring_from_self", lambda rank, u, r: (
            _groups_2d(rank, u, r)[0], (ring := _groups_2d(rank, u, r)[1])[rank // u:] + ring[:rank // u])),
            _positions_2d), "list the ring group in node order, which is the order of the ring, not from this rank on"),
        Misconception((_groups_2d, named("positions_2d_as_list", lambda *args: _positions_2d(*args).tolist())),
                      "positions_2d returned a list: return a 1-D torch.long tensor"),
        Misconception((_groups_2d, named("positions_one_ring_of_cp", lambda s, rank, u, r, z: _positions(
            s, rank, u * r, z))), "that is the layout of one ring of cp = u r ranks, right only for u = 1. After the "
                                  "all-to-all a rank holds the tokens of its whole node, and those must be ring rank "
                                  "g's tokens (rank_positions(s, g, r, zigzag)) in order: give rank g u + j piece j "
                                  "of them"),
        Misconception((_groups_2d, named("positions_every_uth_token", lambda s, rank, u, r, z: _positions(
            s, rank // u, r, z)[rank % u::u])), "every u-th token of ring rank g's: the all-to-all joins the pieces "
                                               "one after the other, in group-rank order, so each piece must be "
                                               "contiguous, piece j of u")])


def check_mesh_2d(groups_2d: Callable, positions_2d: Callable) -> None:
    """groups_2d(rank, u, r) -> (Ulysses ranks, ring ranks), positions_2d(seq_len, rank, u, r, zigzag) -> the positions
    a rank holds; one process, every rank of several (u, r). The groups tile the ranks (Ulysses: consecutive
    ranks, a node; ring: one rank per node, the same place in each); each position is held once, and a
    Ulysses group's positions, joined in group-rank order, are ring rank g's (rank_positions(s, g, r, zigzag))."""
    MESH((groups_2d, positions_2d))


def _meshes() -> dict[tuple[int, int], tuple[object, object]]:
    """{(u, r): (Ulysses group, ring group)} of this rank. Every rank makes every group, in one order."""
    timeout, rank, out = timedelta(seconds=HOP_TIMEOUT), dist.get_rank(), {}
    for u, r in MESHES:
        ulysses = [dist.new_group(_groups_2d(g * u, u, r)[0], timeout=timeout) for g in range(r)]
        rings = [dist.new_group(_groups_2d(j, u, r)[1], timeout=timeout) for j in range(u)]
        out[u, r] = ulysses[rank // u], rings[rank % u]
    return out


def _members(group) -> list[int]:
    try:
        return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (ValueError, RuntimeError):
        return []


def _attention_2d_case(attention_2d: Callable, case: dict, ulysses_group, ring_group) -> dict:
    rank, u, r, zigzag, (heads, kv_heads) = dist.get_rank(), case["u"], case["r"], case["_zigzag"], case["_heads"]
    q, k, v = _qkv(SEQ_2D, heads, kv_heads, case["_seed"], _positions_2d(SEQ_2D, rank, u, r, zigzag))
    calls, seen = [], {"raised": "", "out": None}

    def record(name: str, arguments: dict) -> None:
        given = ([arguments.get("input")] if name == "all_to_all_single" else
                 list(arguments.get("input_tensor_list") or []) if name == "all_to_all" else
                 tensors_in([arguments.get("tensor")] if name in POINT_TO_POINT else list(arguments.values())))
        nbytes = sum(t.numel() * t.element_size() for t in given if isinstance(t, torch.Tensor))
        calls.append((name, _members(arguments.get("group")), nbytes))

    with collectives_observed(record), _recorded_peers() as (sends, recvs), _course_answer_refused("attention_2d"):
        try:
            seen["out"] = _output(attention_2d(q, k, v, ulysses_group, ring_group, zigzag))
        except (NotImplementedError, AssertionError):
            raise
        except Exception as e:                                   # noqa: BLE001 - observed, with the rank
            if isinstance(e, RuntimeError) and "timed out" in str(e).lower():
                raise AssertionError(f"rank {rank} (u={u}, r={r}) waited {HOP_TIMEOUT:g} s for a collective or a hop "
                                     f"that never came, after {[name for name, _, _ in calls]}, sending to {sends} "
                                     f"and receiving from {recvs}: every rank of a group must make the same calls"
                                     ) from None
            kind, message = raised(e)
            named = kind == "ValueError" and all(f"{n}" in message for n in (u, heads, kv_heads))
            seen["raised"] = _refusal(u, heads, kv_heads) if named else f"{kind}: {message}"
    a2a = Counter()
    for name, members, nbytes in calls:
        if name in ALL_TO_ALL:
            a2a[f"ranks {members}"] += nbytes
    return seen | {"other": [f"dist.{name} on ranks {members}" for name, members, _ in calls
                             if name not in ALL_TO_ALL + POINT_TO_POINT],
                   "a2a": [f"{nbytes} B on {members}" for members, nbytes in a2a.items()],
                   "ring": _hops(sum(n for name, _, n in calls if name in POINT_TO_POINT), sends, recvs)}


def _refusal(u: int, heads: int, kv_heads: int) -> str:
    return f"ValueError naming u = {u} and both head counts, {heads} and {kv_heads}"


def _expect_2d(case: dict, observed: dict) -> dict:
    """All-to-alls handed q and the output (heads), k and v (kv_heads) of s/cp tokens once, on the Ulysses group (none
    needed when u = 1); r - 1 blocks of K and V, kv_heads/u heads of s/r tokens, round the ring group."""
    u, r, zigzag, (heads, kv_heads) = case["u"], case["r"], case["_zigzag"], case["_heads"]
    nothing = {"other": [[]] * WORLD, "a2a": [[]] * WORLD, "ring": [_hops(0, [], [])] * WORLD}
    if heads % u or kv_heads % u:
        return {"raised": [_refusal(u, heads, kv_heads)] * WORLD, **nothing, "out": [None] * WORLD}
    out, _ = _causal(SEQ_2D, heads, kv_heads, case["_seed"])
    want = {"raised": [""] * WORLD, "other": nothing["other"], "a2a": [], "ring": [], "out": []}
    for rank in range(WORLD):
        (ulysses, ring), me = _groups_2d(rank, u, r), rank // u
        a2a = [f"{BATCH * SEQ_2D // (u * r) * HEAD_DIM * (2 * heads + 2 * kv_heads) * 4} B on ranks {ulysses}"]
        want["a2a"].append([] if u == 1 and not observed["a2a"][rank] else a2a)
        want["ring"].append(_hops((r - 1) * 2 * BATCH * (kv_heads // u) * (SEQ_2D // r) * HEAD_DIM * 4,
                                  [ring[(me + 1) % r]], [ring[(me - 1) % r]]) if r > 1 else nothing["ring"][0])
        want["out"].append(out[:, :, _positions_2d(SEQ_2D, rank, u, r, zigzag)])
    return want


class _Attention2D:
    """The correct attention_2d the misconceptions below change (refused as an answer): q, k, v swapped to ring rank
    g's tokens for heads/u heads by one all_to_all_single each, the ring of part 4, the output swapped back."""
    ring = _Ring()

    def __call__(self, q, k, v, ulysses_group, ring_group, zigzag):
        self.fit(q, k, ulysses_group)
        q, k, v = (self.swap(t, 1, 2, ulysses_group) for t in (q, k, v))
        return self.back(self.ring(q, k, v, ring_group, zigzag), ulysses_group)

    def fit(self, q, k, group):
        if q.shape[1] % dist.get_world_size(group) or k.shape[1] % dist.get_world_size(group):
            raise ValueError(self.refusal(dist.get_world_size(group), q.shape[1], k.shape[1]))

    def refusal(self, u: int, heads: int, kv_heads: int) -> str:
        return f"u={u} must divide the {heads} query and {kv_heads} key/value heads"

    def swap(self, x, scatter_dim: int, gather_dim: int, group):
        """Piece i of scatter_dim to rank i of the group; what arrives joined along gather_dim in rank order."""
        send = torch.stack(x.chunk(dist.get_world_size(group), dim=scatter_dim)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        return torch.cat(received.unbind(0), dim=gather_dim)

    def back(self, out, group):
        return self.swap(out, 2, 1, group)


def _ulysses_over_world(self, q, k, v, ulysses_group, ring_group, zigzag):
    """Ulysses over all 4 ranks and no ring: right values where 4 divides the heads."""
    world, u, r = dist.group.WORLD, dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    self.fit(q, k, world)
    q, k, v = (self.swap(t, 1, 2, world) for t in (q, k, v))
    pos = torch.cat([_positions_2d(q.shape[2], rank, u, r, zigzag) for rank in range(u * r)])
    return self.swap(_attention(q, k, v, pos[:, None] >= pos[None, :])[0].float(), 2, 1, world)


def _interleaved(self, x, scatter_dim, gather_dim, group):
    """Joins what arrives token by token (rank 0's first token, rank 1's first, ...): right only for u = 1."""
    u = dist.get_world_size(group)
    if gather_dim == 1:                                  # on the way back, the interleaving undone first
        x = x.unflatten(2, (-1, u)).transpose(2, 3).flatten(2, 3)
    x = _Attention2D.swap(self, x, scatter_dim, gather_dim, group)
    return x.unflatten(2, (u, -1)).transpose(2, 3).flatten(2, 3) if gather_dim == 2 else x


ATTENTION_2D = Check(
    "attention_2d", observe=observe_on_ranks(WORLD, _attention_2d_case, _meshes, "_groups", deadlock=(
        "attention_2d did not finish on every rank within {timeout:g} s: a rank waited in a collective or a hop the "
        "others never joined. Every rank of a group must make the same calls, in the same order, with the same "
        "sizes.")),
    expect=_expect_2d, course=COURSE, only=ONLY,
    note="4 ranks as u x r = 2 x 2 (Ulysses groups 0-1, 2-3; rings 0-2, 1-3), 1 x 4 (one ring), 4 x 1 (one Ulysses "
         "group); each rank gets q, k, v of its positions. Expected: full causal attention (float64) at those "
         "positions; all-to-alls handed q, k, v, out once: batch x s/cp x d x (2 heads + 2 kv_heads) x 4 B; ring: "
         "(r-1) blocks of K and V, 2 x batch x kv_heads/u x s/r x d x 4 B each",
    cases=[dict(u=u, r=r, layout=_layout(z), heads=f"{h}/{kv}", expected="ValueError" if h % u or kv % u else
                "output", _zigzag=z, _heads=(h, kv), _seed=seed, _groups=(u, r))
           for u, r in MESHES for seed, (z, h, kv) in enumerate(CASES_2D)],
    quantities={
        "raised": Said("what attention_2d raised: where u divides both head counts nothing; where it does not, each "
                       "rank of the Ulysses group cannot get whole heads, so check the head counts first and raise "
                       "ValueError, naming u and both head counts", axes=("rank {}",)),
        "other": _exact("collectives other than all-to-alls and sends: 2-D attention moves its tensors with "
                        "all-to-alls inside the node and point-to-point hops round the ring, nothing else (a gather "
                        "of K and V would put the whole sequence's keys on every rank at once)"),
        "a2a": _exact("the bytes handed to all-to-alls, by group: q, k, v once before the ring and the output once "
                      "after it (K and V with their own kv_heads heads), on the Ulysses group (group=ulysses_group: "
                      "the node, the fast links); none needed when u = 1, none before a ValueError"),
        "ring": _exact("what each rank sent point-to-point and its peers: r - 1 blocks of K and V with kv_heads/u "
                       "heads of s/r tokens (the ring runs after the all-to-all: before it, on every head, it sends u "
                       "times that), round its ring group, one rank of each node (ring_attention on ring_group); none "
                       "before a ValueError"),
        "out": _close("this rank's output, one tensor (batch, heads, s/cp, d): its s/cp tokens with all the heads, "
                      "against full causal attention at its positions (where every u = 1 row passes, the layout "
                      "inside the node is wrong: after the all-to-all the u pieces must join, in Ulysses-group order, "
                      "into ring rank g's tokens)")},
    misconceptions=[
        Misconception(_variant(_Attention2D, "A2DUlyssesOverWorld", __call__=_ulysses_over_world),
                      "the all-to-alls must stay inside the node, on the fast links (group=ulysses_group), not span "
                      "every rank"),
        Misconception(_variant(_Attention2D, "A2DRingOverWorld", __call__=lambda self, q, k, v, ulysses_group, _, z:
                               _Attention2D.__call__(self, q, k, v, ulysses_group, dist.group.WORLD, z)),
                      "the hops go round the ring group, one rank of each node (ring_attention on ring_group), not "
                      "round every rank"),
        Misconception(_variant(_Attention2D, "A2DAllGathersKV", ring=_RING_ALL_GATHER),
                      "2-D attention moves its tensors with all-to-alls inside the node and point-to-point hops round "
                      "the ring, nothing else. A gather of K and V would put the whole sequence's keys on every rank "
                      "at once"),
        Misconception(_variant(_Attention2D, "A2DRepeatsKVBeforeA2A", __call__=lambda self, q, k, v, group, *args: (
            self.fit(q, k, group) or _Attention2D.__call__(
                self, q, *(t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v)), group, *args))),
            "K and V were repeated to the query heads before the all-to-all; send them with their kv_heads heads, "
            "kv_heads/u to each rank"),
        Misconception(_variant(_Attention2D, "A2DRepeatsKVBeforeRing", ring=_RING_REPEATED_HEADS),
                      "K and V were repeated to the query heads before the ring; they travel with their own heads, "
                      "and block_attention repeats them where they are used"),
        Misconception(_variant(_Attention2D, "A2DInterleavedPieces", swap=_interleaved),
                      "every u = 1 row passes: the layout inside the node is wrong. After the all-to-all the u pieces "
                      "must join, in Ulysses-group order, into ring rank g's tokens"),
        Misconception(_variant(_Attention2D, "A2DNoSwapBack", back=lambda self, out, group: out),
                      "the output was not sent back: after the ring, a second all-to-all gives each rank its s/cp "
                      "tokens back, for every head"),
        Misconception(_variant(_Attention2D, "A2DNoHeadCheck", __call__=lambda self, q, k, v, group, *args: (
            torch.zeros_like(q) if k.shape[1] % dist.get_world_size(group)      # heads lost, or a crash
            else _Attention2D.__call__(self, q, k, v, group, *args))),
            "each rank of the Ulysses group must get whole heads, so raise ValueError when u does not divide both "
            "head counts, naming them"),
        Misconception(_variant(_Attention2D, "A2DChecksAfterExchange", fit=lambda self, q, k, group: (
            k.shape[1] % dist.get_world_size(group) and self.swap(q, 1, 2, group),   # q's 8 heads split over 4
            _Attention2D.fit(self, q, k, group))), "it communicated before raising: check the head counts before any "
                                                   "communication"),
        Misconception(_variant(_Attention2D, "A2DVagueError", refusal=lambda self, *counts: "bad head count"),
                      "name u and both head counts in the ValueError, so the user knows what to change")])


def check_attention_2d(attention_2d: Callable) -> None:
    """attention_2d(q, k, v, ulysses_group, ring_group, zigzag) on the 4 ranks as u x r = 2 x 2, 1 x 4 and 4 x 1, each
    rank holding q, k, v of its positions (the layout of check_mesh_2d): the output equals full causal attention
    at those positions. Checked from the communication each rank records: all-to-alls only on its Ulysses group,
    handed q, k, v and the output once (K/V with their own heads; none needed when u = 1); point-to-point only to
    and from its ring group, (r - 1) K/V blocks of kv_heads/u heads and s/r tokens; no other collective; and where
    u does not divide both head counts, a ValueError naming u and both counts, before any communication."""
    ATTENTION_2D(attention_2d)

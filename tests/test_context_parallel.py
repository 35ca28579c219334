"""Context parallelism: ring, zig-zag ring and Ulysses attention equal one process's attention, a model
trained on cp ranks equals one process, and the counted bytes, per-rank work and saved activations
equal the formulas.

Two launches (2 and 4 ranks) run every case that needs ranks; the tests below read their results.
"""

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from picotron import comm
from picotron.config import ModelConfig, TrainConfig
from picotron.parallel.context_parallel import CP_MODES, check_context_parallel
from picotron_course.checks import one_thread
from picotron.data import DataLoader, TokenDataset, build_dataset, cp_chunks, cp_positions
from picotron.launch import run
from picotron.lockstep import Recorder
from picotron.costs import activation_bytes_per_layer
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.context_parallel import (AttentionWork, apply_context_parallel, gather_sequence,
                                                replay_ring_work, ring_attention, take_cp_tokens, ulysses_attention,
                                                whole_sequence)
from picotron.parallel.context_parallel_costs import (cp_activation_bytes_per_layer, cp_comm_bytes_per_layer,
                                                      cp_comm_per_layer, ring_attention_work)
from picotron.parallel.online_softmax import attention_block, merge_blocks, online_softmax, online_softmax_attention
from picotron.parallel.data_parallel import all_reduce_gradients
from picotron.tolerance import TRAINING_GRAD_TOL, assert_close, compare, compare_all, llama_roundings

# GQA with 8 query and 4 key-value heads: Ulysses at cp=4 leaves 2 and 1 per rank.
CONFIG = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, max_seq_len=32)
STEPS, BATCH, SEQ = 20, 4, 32
HEAD_DIM = CONFIG.head_dim
# Roundings behind one number (picotron.tolerance, bound 8 sqrt(n) u scale): attention's output sums q.k over
# head_dim, then the softmax and P V over the sequence, and merges up to 4 blocks; its gradients go through that
# and back again, and add the query heads of a key-value group; a whole model's gradient, llama_roundings.
ATTENTION_N = HEAD_DIM + 2 * SEQ + 4
ATTENTION_GRAD_N = 2 * ATTENTION_N + CONFIG.num_attention_heads // CONFIG.num_key_value_heads
MODEL_N = llama_roundings(CONFIG, SEQ, BATCH * SEQ)
# Full-model training cases per launch: (mode, dp) on 2 and on 4 ranks.
TRAIN_CASES = {2: [("ring", 1), ("zigzag", 1), ("ulysses", 1)], 4: [("zigzag", 1), ("ulysses", 1), ("ring", 2)]}


@functools.cache
def dataset() -> TokenDataset:
    """Built once; run() sends it to the ranks with the function that uses it."""
    return build_dataset(TrainConfig(seq_len=SEQ))


def attention_inputs(seq: int = SEQ) -> tuple[torch.Tensor, ...]:
    """q (2, 8 heads, seq, d), k and v (2, 4 kv heads, seq, d), and a gradient for the output."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, CONFIG.num_attention_heads, seq, HEAD_DIM, generator=generator)
    k, v = (torch.randn(2, CONFIG.num_key_value_heads, seq, HEAD_DIM, generator=generator) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=generator)


def reference_attention(q, k, v, grad_out) -> dict:
    """Causal softmax attention on one device (torch's SDPA): output and dq, dk, dv."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# ---- one device: the online softmax -------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_online_softmax_equals_softmax_attention(num_blocks, causal):
    q, k, v, grad_out = attention_inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
    (expected * grad_out).sum().backward()
    reference = [t.grad for t in leaves]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = online_softmax_attention(*leaves, num_blocks=num_blocks, causal=causal)
    (out * grad_out).sum().backward()
    assert_close(out, expected, n=ATTENTION_N)
    for ours, theirs in zip(leaves, reference):
        assert_close(ours.grad, theirs, n=ATTENTION_GRAD_N)
    with pytest.raises(ValueError, match="does not split into num_blocks=5 equal blocks"):
        online_softmax_attention(q, k, v, num_blocks=5)


@pytest.mark.parametrize("num_blocks", [1, 3, 4])
def test_online_softmax_equals_softmax(num_blocks):
    scores = torch.randn(3, 5, 12) * 30              # large scores: exp would overflow without the running max
    scores[0, 0, 6:] += 200                          # a later block raises the max: the sum so far is rescaled
    assert_close(online_softmax(scores, num_blocks), torch.softmax(scores, dim=-1), n=12 + num_blocks)


def test_merging_blocks_in_any_order_gives_the_whole_softmax():
    q, k, v, _ = attention_inputs()
    whole = attention_block(q, k, v)
    blocks = [attention_block(q, kb, vb) for kb, vb in zip(k.chunk(4, dim=2), v.chunk(4, dim=2))]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        out = lse = None
        for i in order:
            out, lse = merge_blocks(out, lse, *blocks[i])
        assert_close(out, whole[0], n=ATTENTION_N)
        assert_close(lse, whole[1], n=ATTENTION_N)


# ---- layouts ---------------------------------------------------------------------------------------
def test_zigzag_layout_and_round_trip():
    assert [cp_chunks(r, 4, zigzag=True) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert cp_positions(16, 1, 4, zigzag=True).tolist() == [2, 3, 12, 13]
    assert cp_positions(16, 1, 4).tolist() == [4, 5, 6, 7]
    x = torch.randn(2, 3, 16, 5)
    for zigzag in (False, True):
        pieces = [take_cp_tokens(x, r, 4, zigzag) for r in range(4)]
        assert torch.equal(gather_sequence(pieces, zigzag), x)
    with pytest.raises(ValueError, match=r"multiple of 8"):
        cp_positions(12, 0, 4, zigzag=True)


# ---- formulas that need no ranks ----------------------------------------------------------------------
def test_work_per_rank_plain_vs_zigzag():
    for cp in (2, 4, 8):
        plain = ring_attention_work(BATCH, 64, 8, HEAD_DIM, cp)
        zigzag = ring_attention_work(BATCH, 64, 8, HEAD_DIM, cp, zigzag=True)
        assert [w["blocks"] for w in plain] == list(range(1, cp + 1))       # rank r: r + 1 blocks of (s/cp)^2
        assert {w["blocks"] for w in zigzag} == {2 * cp + 1}                # each: 2cp+1 half-chunk pairs
        half_pair = 4 * BATCH * 8 * (64 // (2 * cp)) ** 2 * HEAD_DIM
        assert zigzag[0]["flops"] == (2 * cp + 1) * half_pair
        assert plain[-1]["flops"] == 4 * cp * half_pair                    # the slowest plain rank
        backward = ring_attention_work(BATCH, 64, 8, HEAD_DIM, cp, zigzag=True, backward=True)
        assert backward[0]["flops"] * 2 == zigzag[0]["flops"] * 5


def test_replayed_work_per_rank():
    """One process replays each rank's forward blocks: the counts equal the formula; the seconds are what a
    chapter plots (not asserted: a shared CPU makes them noisy)."""
    q, k, v, _ = attention_inputs(seq=64)
    for zigzag in (False, True):
        replayed = replay_ring_work(q, k, v, 4, zigzag, repeats=1)
        formula = ring_attention_work(2, 64, CONFIG.num_attention_heads, HEAD_DIM, 4, zigzag)
        assert [{key: w[key] for key in ("blocks", "flops")} for w in replayed] == formula
        assert all(w["seconds"] > 0 for w in replayed)


def test_comm_formulas():
    kv_block = 2 * BATCH * (SEQ // 4) * CONFIG.num_key_value_heads * HEAD_DIM * 4       # bytes, cp=4, fp32
    ring = cp_comm_per_layer(CONFIG, BATCH, SEQ, 4, "ring")
    assert ring == {"forward": {"send": (3, 3 * kv_block)}, "backward": {"send": (7, 7 * kv_block)}}
    assert ring == cp_comm_per_layer(CONFIG, BATCH, SEQ, 4, "zigzag")
    assert cp_comm_bytes_per_layer(CONFIG, BATCH, SEQ, 4, "ring") == 10 * kv_block
    q_and_out = 2 * BATCH * (SEQ // 4) * CONFIG.num_attention_heads * HEAD_DIM * 4
    ulysses = cp_comm_per_layer(CONFIG, BATCH, SEQ, 4, "ulysses")
    assert ulysses["forward"] == ulysses["backward"] == {"all_to_all": (4, q_and_out + kv_block)}
    assert cp_comm_bytes_per_layer(CONFIG, BATCH, SEQ, 4, "ulysses") == 2 * (q_and_out + kv_block) * 3 // 4
    # Wire bytes: the ring's (3cp-2)/cp of 2 K,V blocks of the whole sequence hardly moves with cp, Ulysses'
    # fall like 1/cp.
    ring_bytes = [cp_comm_bytes_per_layer(CONFIG, BATCH, 64, cp, "ring") for cp in (2, 4, 8)]
    ulysses_bytes = [cp_comm_bytes_per_layer(CONFIG, BATCH, 64, cp, "ulysses") for cp in (2, 4)]
    assert ring_bytes[0] < ring_bytes[1] < ring_bytes[2] < 3 * ring_bytes[0] // 2
    assert ulysses_bytes[1] < ulysses_bytes[0]
    assert cp_comm_per_layer(CONFIG, BATCH, SEQ, 1, "ring") == {"forward": {}, "backward": {}}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_formula(recompute):
    config = dataclasses.replace(CONFIG, recompute=recompute)
    # cp=1 is the plain model (fused attention); at cp=2 the ring's layer saves half of it.
    whole = activation_bytes_per_layer(config, BATCH, SEQ)
    assert cp_activation_bytes_per_layer(config, BATCH, SEQ, 1, "ring") == whole
    assert 2 * cp_activation_bytes_per_layer(config, BATCH, SEQ, 2, "ring") == whole
    # 4 times the sequence on 4 ranks: the same bytes per rank as one rank with the short sequence; Ulysses
    # keeps the output a second time (in sequence slices for o_proj) unless recomputation drops the core.
    one_rank = cp_activation_bytes_per_layer(config, BATCH, SEQ, 1, "ring")
    second_output = BATCH * SEQ * CONFIG.num_attention_heads * HEAD_DIM * 4 if recompute == "none" else 0
    assert cp_activation_bytes_per_layer(config, BATCH, 4 * SEQ, 4, "ring") == one_rank
    assert cp_activation_bytes_per_layer(config, BATCH, 4 * SEQ, 4, "zigzag") == one_rank
    assert cp_activation_bytes_per_layer(config, BATCH, 4 * SEQ, 4, "ulysses") == one_rank + second_output


def test_config_errors():
    with pytest.raises(ValueError, match=r"cp_mode='striped' is not a context-parallel mode; choose one of"):
        check_context_parallel(CONFIG, 2, "striped")
    with pytest.raises(ValueError, match=r"cp=8 does not divide the 8 query and 4 key/value heads"):
        check_context_parallel(CONFIG, 8, "ulysses")
    with pytest.raises(ValueError, match=r"seq_len=36 does not split for cp_mode='zigzag' \(zig-zag cuts it into "
                                         r"2\*cp = 8 chunks\); choose a seq_len that is a multiple of 8"):
        check_context_parallel(CONFIG, 4, "zigzag", seq_len=36)
    check_context_parallel(CONFIG, 4, "ring", seq_len=36)   # a contiguous split only needs cp | seq_len


# ---- on ranks ---------------------------------------------------------------------------------------------
def attention_errors(reference: dict) -> dict:
    """Each mode on this rank's tokens against one device: output, and the worst of dq, dk, dv."""
    group, cp, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    q, k, v, grad_out = attention_inputs()
    out = {}
    for mode in CP_MODES:
        zigzag = mode == "zigzag"
        mine = lambda t: take_cp_tokens(t, rank, cp, zigzag)   # noqa: E731
        local = [mine(t).requires_grad_() for t in (q, k, v)]
        if mode == "ulysses":
            y = ulysses_attention(*local, group)
        else:
            y = ring_attention(*local, group, zigzag=zigzag)
        (y * mine(grad_out)).sum().backward()
        ours = {"out": y.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
        grads = {name: ours[name] for name in ("dq", "dk", "dv")}
        out[mode] = {"out": compare(ours["out"], mine(reference["out"]), n=ATTENTION_N),
                     "grads": compare_all(grads, {name: mine(reference[name]) for name in grads}, n=ATTENTION_GRAD_N)}
    return out


def work_per_rank(zigzag: bool) -> dict:
    """Blocks, FLOPs and seconds of this rank's ring attention (forward, then backward), 128 tokens."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad_out = attention_inputs(seq=128)
    local = [take_cp_tokens(t, rank, cp, zigzag).requires_grad_() for t in (q, k, v)]
    work = AttentionWork()
    for _ in range(3):   # keep the last of three runs: the first pays for warming up
        work.reset()
        y = ring_attention(*local, dist.group.WORLD, zigzag=zigzag, work=work)
        forward = dataclasses.asdict(work)
        (y * take_cp_tokens(grad_out, rank, cp, zigzag)).sum().backward()
    backward = {key: value - forward[key] for key, value in dataclasses.asdict(work).items()}
    return {"forward": forward, "backward": backward}


def train(mode: str | None = None, dp: int = 1, references: dict | None = None):
    """One process (mode=None), 20 AdamW steps: its Trace. Or this rank of dp x cp ranks, compared with the
    one-process run on the same global batch at every step (picotron.lockstep), and what lockstep does not
    check: the positions this rank saw, and the whole-sequence evaluation against the plain model."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    mesh = None
    loader = DataLoader(dataset(), BATCH * dp)
    if mode is not None:
        mesh = Mesh(dp=dp, cp=dist.get_world_size() // dp)
        apply_context_parallel(model, mesh, mode)
        loader = DataLoader(dataset(), BATCH, dp_rank=mesh.dp_rank, dp_size=dp, cp_rank=mesh.cp_rank,
                            cp_size=mesh.cp_size, zigzag=mode == "zigzag")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    record = Recorder(None if mesh is None else references[dp])
    for step in range(STEPS):
        batch = loader.get_batch(step)
        logits = model(batch.input_ids, batch.position_ids)
        loss = loss_fn(logits, batch.targets)
        loss.backward()
        if mesh is not None:
            assert logits.shape == (BATCH, SEQ // mesh.cp_size, CONFIG.vocab_size)   # never the whole sequence
            all_reduce_gradients(model, mesh.dp_cp_group)          # average over dp x cp, like dp
            loss = loss.detach().clone()                           # the mean loss over the global batch
            dist.all_reduce(loss, group=mesh.dp_cp_group)
            loss /= dist.get_world_size(mesh.dp_cp_group)
        record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    if mesh is None:
        return record.finish(dict(model.named_parameters()))
    ids = torch.arange(7)[None] * 3                                # an odd length no layout could split
    plain = Llama(CONFIG)
    plain.load_state_dict(model.state_dict())
    with whole_sequence(model):   # evaluation: every rank runs the whole sequence alone
        whole_error = (model(ids) - plain(ids)).abs().max().item()
    return record.finish(dict(model.named_parameters())), {"positions": batch.position_ids[0].tolist(),
                                                             "whole sequence error": whole_error}


def comm_per_step(mode: str) -> dict:
    """Collectives of a whole model's forward and backward under CP, counted on the real tensors."""
    torch.manual_seed(0)
    mesh = Mesh(cp=dist.get_world_size())
    model = apply_context_parallel(Llama(CONFIG), mesh, mode)
    batch = DataLoader(dataset(), BATCH, cp_rank=mesh.cp_rank, cp_size=mesh.cp_size,
                       zigzag=mode == "zigzag").get_batch(0)
    with comm.counting(mesh.counter):
        loss = loss_fn(model(batch.input_ids, batch.position_ids), batch.targets)
    forward = mesh.counter.snapshot()
    mesh.counter.reset()
    with comm.counting(mesh.counter):
        loss.backward()
    return {"forward": forward, "backward": mesh.counter.snapshot()}


def saved_bytes(fn, exclude) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd saves while fn() runs, and fn's result. Saved-tensor hooks
    see what an autograd.Function saves too (memory_tracking.saved_tensors reads the graph's _saved_ slots,
    which custom Functions such as RingAttention do not have). 0-dim scalars left out, as there."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.dim() and storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


def layer_saved_bytes(config: ModelConfig, mode: str | None) -> int:
    """Bytes one decoder layer saves for backward on this rank (mode=None: the plain layer, whole sequence)."""
    torch.manual_seed(0)
    model = Llama(config)
    cp, rank = (dist.get_world_size(), dist.get_rank()) if mode else (1, 0)
    if mode:
        apply_context_parallel(model, Mesh(cp=cp), mode)
    positions = cp_positions(SEQ, rank, cp, mode == "zigzag")
    cos, sin = model.rope(positions[None])
    x = torch.randn(BATCH, SEQ // cp, config.hidden_size, requires_grad=True)
    nbytes, _ = saved_bytes(lambda: model.layers[0](x, cos, sin), exclude=[*model.parameters(), cos, sin])
    return nbytes


def recompute_one_step(config: ModelConfig, mode: str):
    """The gradients after one backward under CP against one process's, for a recomputing model (the
    recomputed forward runs the ring, or the all-to-alls, again inside backward): the worst tensor."""
    mesh = Mesh(cp=dist.get_world_size())
    torch.manual_seed(0)
    plain = Llama(config)
    model = apply_context_parallel(Llama(config), mesh, mode)
    model.load_state_dict(plain.state_dict())
    whole = DataLoader(dataset(), BATCH).get_batch(0)
    batch = whole.seq_slice(mesh.cp_rank, mesh.cp_size, zigzag=mode == "zigzag")
    loss_fn(plain(whole.input_ids), whole.targets).backward()
    loss_fn(model(batch.input_ids, batch.position_ids), batch.targets).backward()
    all_reduce_gradients(model, mesh.cp_group)
    return compare_all({n: p.grad for n, p in model.named_parameters()},
                       {n: p.grad for n, p in plain.named_parameters()}, n=MODEL_N)


def bad_input() -> dict:
    """Clear errors: an odd number of local tokens under zig-zag; Ulysses with too few heads."""
    errors = {}
    q = torch.randn(1, 8, 3, HEAD_DIM)
    k = torch.randn(1, 4, 3, HEAD_DIM)
    for name, call in (("zigzag", lambda: ring_attention(q, k, k, dist.group.WORLD, zigzag=True)),
                       ("ulysses", lambda: apply_context_parallel(
                           Llama(dataclasses.replace(CONFIG, num_key_value_heads=2)), Mesh(cp=4), "ulysses"))):
        try:
            call()
            errors[name] = "no error"
        except ValueError as error:
            errors[name] = str(error)
    return errors


def all_cases(attention_reference: dict, references: dict) -> dict:
    """Everything one launch checks, on every rank."""
    world = dist.get_world_size()
    out = {"attention": attention_errors(attention_reference),
           "train": {case: train(*case, references) for case in TRAIN_CASES[world]},
           "work": {zigzag: work_per_rank(zigzag) for zigzag in (False, True)},
           "comm": {mode: comm_per_step(mode) for mode in CP_MODES}}
    if world == 2:
        for recompute, mode in (("selective", "zigzag"), ("full", "ring"), ("selective", "ulysses")):
            out[("recompute", recompute, mode)] = recompute_one_step(dataclasses.replace(CONFIG, recompute=recompute),
                                                                    mode)
        for mode in CP_MODES:
            for attention in ("sdpa", "eager"):
                out[("saved", mode, attention)] = layer_saved_bytes(dataclasses.replace(CONFIG, attention=attention),
                                                                    mode)
    else:
        out["errors"] = bad_input()
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The single-process runs: attention, and 20 training steps on batches of BATCH and 2 BATCH windows."""
    with one_thread():   # like each rank
        return {"attention": reference_attention(*attention_inputs()), "train": {dp: train(dp=dp) for dp in (1, 2)}}


@pytest.fixture(scope="module")
def launches(one_process) -> dict:
    return {cp: run(all_cases, cp, args=(one_process["attention"], one_process["train"]), timeout=300)
            for cp in (2, 4)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", CP_MODES)
def test_attention_equals_one_device(cp, mode, launches):
    for rank in launches[cp]:
        for what, comparison in rank["attention"][mode].items():   # float32 round-off only
            assert comparison, f"{what}: {comparison}"


TRAIN_IDS = [(world, mode, dp) for world in TRAIN_CASES for mode, dp in TRAIN_CASES[world]]


@pytest.mark.parametrize("world, mode, dp", TRAIN_IDS, ids=[f"dp{dp}-cp{w // dp}-{m}" for w, m, dp in TRAIN_IDS])
def test_training_equals_one_process(world, mode, dp, launches, one_process):
    reference = one_process["train"][dp]
    results, extras = zip(*[rank["train"][(mode, dp)] for rank in launches[world]])
    for rank, result in enumerate(results):   # every rank: the mean loss over the global batch, gradients, weights
        result.assert_equal(f"rank {rank} of dp={dp} x cp={world // dp}, {mode}")
        # and, as before lockstep's rtol = atol, every gradient within 1e-5 absolutely, every step
        assert max(result.grad_diff) < TRAINING_GRAD_TOL, (rank, result.grad_diff)
        assert extras[rank]["whole sequence error"] == 0
    cp = world // dp   # each cp rank saw its own positions: the zig-zag chunks or a contiguous slice
    positions = [set(rank["positions"]) for rank in extras[:cp]]
    assert set().union(*positions) == set(range(SEQ)) and sum(map(len, positions)) == SEQ
    assert reference.loss[-1] < reference.loss[0] - 0.5   # and it learned something


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", CP_MODES)
def test_counted_communication_equals_formula(cp, mode, launches):
    layer = cp_comm_per_layer(CONFIG, BATCH, SEQ, cp, mode)
    whole_model = {pass_: {op: (CONFIG.num_layers * calls, CONFIG.num_layers * nbytes)
                           for op, (calls, nbytes) in ops.items()} for pass_, ops in layer.items()}
    for rank in launches[cp]:
        assert rank["comm"][mode] == whole_model   # attention is the only part of the model that talks


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_balances_the_work(cp, launches):
    for zigzag in (False, True):
        for pass_ in ("forward", "backward"):
            formula = ring_attention_work(2, 128, CONFIG.num_attention_heads, HEAD_DIM, cp, zigzag,
                                          backward=pass_ == "backward")
            measured = [{key: rank["work"][zigzag][pass_][key] for key in ("blocks", "flops")}
                        for rank in launches[cp]]
            assert measured == formula
    plain, zigzag = ([rank["work"][z]["forward"]["flops"] for rank in launches[cp]] for z in (False, True))
    assert max(plain) == cp * min(plain) and len(set(zigzag)) == 1
    assert max(zigzag) < max(plain)


@pytest.mark.parametrize("mode", CP_MODES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_saved_activations_equal_formula(mode, attention, launches):
    config = dataclasses.replace(CONFIG, attention=attention)
    formula = cp_activation_bytes_per_layer(config, BATCH, SEQ, 2, mode)
    for rank in launches[2]:
        assert rank[("saved", mode, attention)] == formula
    # The same way of counting gives memory.py's formula for the plain layer on one process.
    assert layer_saved_bytes(config, None) == activation_bytes_per_layer(config, BATCH, SEQ)


@pytest.mark.parametrize("recompute, mode", [("selective", "zigzag"), ("full", "ring"), ("selective", "ulysses")])
def test_recomputation_under_context_parallelism(recompute, mode, launches):
    for rank in launches[2]:
        grads = rank[("recompute", recompute, mode)]
        assert grads, str(grads)


def test_clear_errors_on_ranks(launches):
    for rank in launches[4]:
        assert "needs an even number of local tokens (two chunks), got 3" in rank["errors"]["zigzag"]
        assert "cp=4 does not divide the 8 query and 2 key/value heads" in rank["errors"]["ulysses"]

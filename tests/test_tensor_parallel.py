"""Tensor and sequence parallelism: tp ranks train exactly like one process, equal torch's DTensor
tensor parallelism, and communicate and keep in memory what the formulas say.

Two launches (tp=2 and tp=4) run every case that needs ranks; the tests below read their results.
"""

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist

from picotron import comm
from picotron.comm import CommCounter
from picotron.config import ModelConfig, TrainConfig
from picotron_course.checks import one_thread
from picotron.data import DataLoader, TokenDataset, build_dataset
from picotron.launch import run
from picotron.lockstep import Recorder
from picotron.memory_tracking import saved_tensors
from picotron.costs import activation_bytes_per_layer
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, apply_tensor_parallel,
                                               check_tensor_parallel, gather_gradients, gather_parameters,
                                               parallelize_layer, scatter_to_sp_region, vocab_parallel_cross_entropy)
from picotron.parallel.tensor_parallel_costs import (tp_activation_bytes_per_layer, tp_comm_bytes_per_layer,
                                                     tp_comm_per_layer, tp_comm_per_step)
from picotron.tolerance import TRAINING_GRAD_TOL, close_enough, compare, llama_roundings

# GQA with 8 query and 4 key-value heads: tp=4 leaves 2 and 1 per rank. Vocabulary 256 / 4 = 64.
CONFIG = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=8,
                     num_key_value_heads=4, max_seq_len=32)
STEPS, BATCH, SEQ = 20, 4, 32
# (sequence parallel, tied embedding) per case, by tp
CASES = {2: {"TP": (False, True), "TP+SP": (True, True), "TP+SP untied": (True, False)},
         4: {"TP": (False, True), "TP+SP": (True, True)}}


@functools.cache
def dataset() -> TokenDataset:
    """Built once; run() sends it to the ranks with the function that uses it."""
    return build_dataset(TrainConfig(seq_len=SEQ))


# Roundings behind any gradient of the model, and of one layer (picotron.tolerance: the bound is 8 sqrt(n) u scale).
MODEL_N = llama_roundings(CONFIG, SEQ, BATCH * SEQ)
LAYER_N = llama_roundings(dataclasses.replace(CONFIG, num_layers=1), SEQ, BATCH * SEQ)


def max_error(ours: dict, reference: dict, n: int | None = None) -> tuple[float, bool]:
    """Largest absolute difference over all tensors, and whether all are close: within the tolerance policy's
    bound for n roundings (equal weights, one step); without n, within the course's claim for gradients
    while training (rtol = atol = TRAINING_GRAD_TOL: Adam carries each step's rounding into the next weights)."""
    assert ours.keys() == reference.keys()
    error = max((ours[name] - reference[name]).abs().max().item() for name in reference)
    if n is None:
        close = all(torch.allclose(ours[name], reference[name], rtol=TRAINING_GRAD_TOL, atol=TRAINING_GRAD_TOL)
                    for name in reference)
    else:
        close = all(close_enough(ours[name], reference[name], n=n) for name in reference)
    return error, close


# ---- 20 AdamW steps: tp ranks vs one process -----------------------------------------------------------
def train(tied: bool, sequence_parallel: bool | None = None, reference=None):
    """One process (sequence_parallel=None): its Trace. Or this rank of a TP model, compared with the one-process
    `reference` at every step (picotron.lockstep), and its replicated weights (the RMSNorm weights)."""
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(CONFIG, tie_word_embeddings=tied))
    mesh = None
    if sequence_parallel is not None:
        mesh = Mesh(tp=dist.get_world_size())
        apply_tensor_parallel(model, mesh, sequence_parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    loader = DataLoader(dataset(), BATCH)
    record = Recorder(reference)
    for step in range(STEPS):
        batch = loader.get_batch(step)
        logits = model(batch.input_ids)
        if mesh is None:
            loss = loss_fn(logits, batch.targets)
            loss.backward()
            record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        else:
            assert logits.shape == (BATCH, SEQ, CONFIG.vocab_size // mesh.tp_size)   # never the whole vocabulary
            loss = vocab_parallel_cross_entropy(logits, batch.targets, mesh.tp_group)
            loss.backward()
            record.step(loss, gather_gradients(model, mesh.tp_group))
        optimizer.step()
        optimizer.zero_grad()
    if mesh is None:
        return record.finish(dict(model.named_parameters()))
    replicated = {n: p.detach().clone() for n, p in model.named_parameters() if not hasattr(p, "tp_shard_dim")}
    return record.finish(gather_parameters(model, mesh.tp_group)), replicated


# ---- one decoder layer: against DTensor, counted bytes, saved activations ------------------------------
def dtensor_plan(sequence_parallel: bool) -> dict:
    """torch's tensor parallelism for picotron's DecoderLayer (torchtitan's plan for its Llama)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    leave = dict(output_layouts=Shard(1)) if sequence_parallel else {}
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(**leave), "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(**leave)}
    if sequence_parallel:
        plan.update({
            "attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    return plan


def full_dtensor_grads(module: torch.nn.Module) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            for n, p in module.named_parameters()}


def layer_vs_dtensor(plain, x, cos, sin, grad_out, sequence_parallel: bool) -> dict:
    """One layer, forward and backward: ours and torch's DTensor TP, each against the plain layer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    group = dist.group.WORLD
    reference_x = x.clone().requires_grad_()
    reference_out = plain(reference_x, cos, sin)
    (reference_out * grad_out).sum().backward()
    reference_grads = {n: p.grad for n, p in plain.named_parameters()}
    local = (lambda t: scatter_to_sp_region(t, group)) if sequence_parallel else (lambda t: t)
    ours = parallelize_layer(copy.deepcopy(plain), group, sequence_parallel=sequence_parallel)
    theirs = parallelize_module(copy.deepcopy(plain), init_device_mesh("cpu", (dist.get_world_size(),)),
                                dtensor_plan(sequence_parallel))
    out, grads = {}, {}
    for name, layer in (("ours", ours), ("DTensor", theirs)):
        layer.zero_grad()
        local_x = local(x).detach().requires_grad_()
        y = layer(local_x, cos, sin)                                   # (batch, seq or seq/tp, hidden)
        (y * local(grad_out)).sum().backward()
        grads[name] = gather_gradients(layer, group) if name == "ours" else full_dtensor_grads(layer)
        out[name] = {"output": compare(y, local(reference_out), n=LAYER_N),
                     "input grad": compare(local_x.grad, local(reference_x.grad), n=LAYER_N),
                     "grads": max_error(grads[name], reference_grads, LAYER_N)}
        out[name + " output"] = y.detach()
    out["ours vs DTensor"] = {"output": compare(out.pop("ours output"), out.pop("DTensor output"), n=LAYER_N),
                              "grads": max_error(grads["ours"], grads["DTensor"], LAYER_N)}
    return out


def linear_pieces() -> dict:
    """A column-parallel Linear that gathers its output and a row-parallel one that splits its input
    each stand in for the whole nn.Linear: output (a sum over the 16 input features), input gradient
    (over the 24 output features), weight gradient (over the 15 tokens), each within the tolerance policy."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 24, bias=False)
    x, grad_out = torch.randn(3, 5, 16), torch.randn(3, 5, 24)
    reference_x = x.clone().requires_grad_()
    reference = linear(reference_x)
    (reference * grad_out).sum().backward()
    out = {}
    pieces = {"column": ColumnParallelLinear(linear, group, gather_output=True),
              "row": RowParallelLinear(linear, group, split_input=True)}
    for name, piece in pieces.items():
        local_x = x.clone().requires_grad_()
        y = piece(local_x)                                              # (3, 5, 24) on every rank
        (y * grad_out).sum().backward()
        weight_grad = gather_gradients(piece, group)["weight"]
        out[name] = [compare(y, reference, n=16), compare(local_x.grad, reference_x.grad, n=24),
                     compare(weight_grad, linear.weight.grad, n=15)]
    return out


def layer_comm(plain, x, cos, sin, sequence_parallel: bool) -> dict:
    """Collectives of one layer's forward and backward, counted on the real tensors."""
    counter, group = CommCounter(), dist.group.WORLD
    layer = parallelize_layer(copy.deepcopy(plain), group, sequence_parallel=sequence_parallel)
    local_x = (scatter_to_sp_region(x, group) if sequence_parallel else x).detach().requires_grad_()
    with comm.counting(counter):
        y = layer(local_x, cos, sin)
    forward = counter.snapshot()
    counter.reset()
    with comm.counting(counter):
        y.sum().backward()
    return {"forward": forward, "backward": counter.snapshot()}


def step_comm(sequence_parallel: bool) -> dict:
    """Collectives of a whole model's forward (with the loss) and backward."""
    torch.manual_seed(0)
    mesh = Mesh(tp=dist.get_world_size())
    model = apply_tensor_parallel(Llama(CONFIG), mesh, sequence_parallel)
    batch = DataLoader(dataset(), BATCH).get_batch(0)
    mesh.counter.reset()
    with comm.counting(mesh.counter):
        loss = vocab_parallel_cross_entropy(model(batch.input_ids), batch.targets, mesh.tp_group)
    forward = mesh.counter.snapshot()
    mesh.counter.reset()
    with comm.counting(mesh.counter):
        loss.backward()
    return {"forward": forward, "backward": mesh.counter.snapshot()}


def layer_saved_bytes(config, sequence_parallel: bool) -> int:
    """Bytes autograd saves for one TP layer's backward on this rank, as memory.py counts them."""
    torch.manual_seed(0)
    model = Llama(config)
    layer = parallelize_layer(model.layers[0], dist.group.WORLD, sequence_parallel=sequence_parallel)
    x = torch.randn(BATCH, SEQ, config.hidden_size)
    x = (scatter_to_sp_region(x, dist.group.WORLD) if sequence_parallel else x).requires_grad_()
    cos, sin = model.rope(torch.arange(SEQ)[None])
    out = layer(x, cos, sin)
    rows = saved_tensors(out, exclude=[*model.parameters(), cos, sin])
    # Leaves out 0-dim scalars (eager's 1/sqrt(head_dim)), as tests/test_memory.py does.
    return sum({row.storage: row.nbytes for row in rows if row.shape != ()}.values())


def recompute_one_step(config: ModelConfig) -> tuple[float, bool]:
    """Largest gradient difference from one process after one step of TP+SP, for a model variant, and whether
    every gradient is within the tolerance policy's bound."""
    mesh = Mesh(tp=dist.get_world_size())
    torch.manual_seed(0)
    plain = Llama(config)
    model = apply_tensor_parallel(copy.deepcopy(plain), mesh, sequence_parallel=True)
    batch = DataLoader(dataset(), BATCH).get_batch(0)
    loss_fn(plain(batch.input_ids), batch.targets).backward()
    vocab_parallel_cross_entropy(model(batch.input_ids), batch.targets, mesh.tp_group).backward()
    return max_error(gather_gradients(model, mesh.tp_group), {n: p.grad for n, p in plain.named_parameters()}, MODEL_N)


def indivisible_sequence() -> str:
    mesh = Mesh(tp=dist.get_world_size())
    model = apply_tensor_parallel(Llama(CONFIG), mesh, sequence_parallel=True)
    try:
        model(torch.zeros(1, 30, dtype=torch.long))
    except ValueError as error:
        return str(error)
    return "no error"


def indivisible_heads() -> str:
    """One layer alone, of a model with 2 key-value heads, over 4 ranks: parallelize_layer checks it too."""
    layer = Llama(dataclasses.replace(CONFIG, num_key_value_heads=2)).layers[0]
    try:
        parallelize_layer(layer, dist.group.WORLD)
    except ValueError as error:
        return str(error)
    return "no error"


def all_cases(references: dict) -> dict:
    """Everything one launch checks, on every rank."""
    tp = dist.get_world_size()
    out = {"train": {name: train(tied, sp, references[tied]) for name, (sp, tied) in CASES[tp].items()}}
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plain = model.layers[0]
    generator = torch.Generator().manual_seed(1)
    x, grad_out = (torch.randn(BATCH, SEQ, CONFIG.hidden_size, generator=generator) for _ in range(2))
    cos, sin = model.rope(torch.arange(SEQ)[None])
    for sp in (False, True):
        out[("dtensor", sp)] = layer_vs_dtensor(copy.deepcopy(plain), x, cos, sin, grad_out, sp)
        out[("layer comm", sp)] = layer_comm(plain, x, cos, sin, sp)
        out[("step comm", sp)] = step_comm(sp)
        for attention in ("sdpa", "eager"):
            config = dataclasses.replace(CONFIG, attention=attention)
            out[("saved", attention, sp)] = layer_saved_bytes(config, sp)
    out["linear pieces"] = linear_pieces()
    if tp == 2:
        for variant in (dict(recompute="selective", attention="eager"), dict(recompute="full")):
            out[("recompute", variant["recompute"])] = recompute_one_step(dataclasses.replace(CONFIG, **variant))
    else:
        out["indivisible"] = indivisible_sequence()
        out["indivisible heads"] = indivisible_heads()
    return out


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The single-process runs, tied and untied; one thread, like each rank."""
    with one_thread():   # like each rank
        return {tied: train(tied) for tied in (True, False)}


@pytest.fixture(scope="module")
def launches(one_process) -> dict:
    return {tp: run(all_cases, tp, args=(one_process,), timeout=300) for tp in (2, 4)}


CASE_IDS = [(tp, name) for tp in CASES for name in CASES[tp]]


@pytest.mark.parametrize("tp, name", CASE_IDS, ids=[f"tp{tp}-{name}" for tp, name in CASE_IDS])
def test_training_equals_one_process(tp, name, launches, one_process):
    reference = one_process[CASES[tp][name][1]]
    results, replicated = zip(*[rank["train"][name] for rank in launches[tp]])
    for rank, result in enumerate(results):   # every rank: losses, gathered gradients and weights, every step
        result.assert_equal(f"rank {rank} of tp={tp}, {name}")
    for weights in replicated:   # replicated weights stay identical on every rank
        for n, weight in weights.items():
            torch.testing.assert_close(weight, replicated[0][n], rtol=0, atol=0)
    assert reference.loss[-1] < reference.loss[0] - 0.5   # and it learned something


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_layer_equals_dtensor_tensor_parallel(tp, sp, launches):
    for rank in launches[tp]:
        result = rank[("dtensor", sp)]
        for name in ("ours", "DTensor", "ours vs DTensor"):   # each against the plain layer, and the two together
            for what in ("output", "input grad"):
                if what in result[name]:
                    assert result[name][what], f"{name}, {what}: {result[name][what]}"
            assert result[name]["grads"][1], (name, result[name]["grads"])


@pytest.mark.parametrize("tp", [2, 4])
def test_column_and_row_parallel_linear_alone_equal_linear(tp, launches):
    for rank in launches[tp]:
        for name, comparisons in rank["linear pieces"].items():   # output, input gradient, weight gradient
            for what, comparison in zip(("output", "input grad", "weight grad"), comparisons):
                assert comparison, f"{name}-parallel {what}: {comparison}"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
def test_counted_communication_equals_formula(tp, sp, launches):
    layer = tp_comm_per_layer(BATCH, SEQ, CONFIG.hidden_size, tp, sp)
    step = tp_comm_per_step(CONFIG, BATCH, SEQ, tp, sp)
    for rank in launches[tp]:
        assert rank[("layer comm", sp)] == layer
        assert rank[("step comm", sp)] == step
    activation = BATCH * SEQ * CONFIG.hidden_size * 4
    if sp:   # 2 all-gathers and 2 reduce-scatters of b s h each way (+ the norm weights' gradients)
        assert layer["forward"] == {"all_gather": (2, 2 * activation // tp), "reduce_scatter": (2, 2 * activation)}
    else:    # 2 all-reduces of b s h each way
        assert layer["forward"] == layer["backward"] == {"all_reduce": (2, 2 * activation)}


def test_sequence_parallel_moves_the_same_bytes_as_tp():
    for tp in (2, 4, 8):
        tp_only = tp_comm_bytes_per_layer(BATCH, SEQ, 64, tp)
        assert tp_only == tp_comm_bytes_per_layer(BATCH, SEQ, 64, tp, sequence_parallel=True)
        assert tp_only == 8 * (tp - 1) * BATCH * SEQ * 64 * 4 // tp


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["TP", "TP+SP"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_saved_activations_equal_formula(tp, sp, attention, launches):
    config = dataclasses.replace(CONFIG, attention=attention)
    formula = tp_activation_bytes_per_layer(config, BATCH, SEQ, tp, sp)
    for rank in launches[tp]:
        assert rank[("saved", attention, sp)] == formula
    # Less than the whole layer; SP less than TP alone.
    assert formula < activation_bytes_per_layer(config, BATCH, SEQ)
    if sp:
        assert formula < tp_activation_bytes_per_layer(config, BATCH, SEQ, tp)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_formula_at_tp1_is_the_plain_one(attention, recompute):
    config = dataclasses.replace(CONFIG, attention=attention, recompute=recompute)
    for sp in (False, True):
        assert tp_activation_bytes_per_layer(config, BATCH, SEQ, 1, sp) == activation_bytes_per_layer(config, BATCH,
                                                                                                         SEQ)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_under_sequence_parallelism(recompute, launches):
    for rank in launches[2]:
        error, close = rank[("recompute", recompute)]
        assert close, f"gradients differ by up to {error:.2e}"


def test_clear_errors(launches):
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=8"):
        check_tensor_parallel(CONFIG, 3)
    with pytest.raises(ValueError, match=r"tp=8 does not divide num_key_value_heads=4.*choose tp among \[1, 2, 4\]"):
        check_tensor_parallel(CONFIG, 8)
    for rank in launches[4]:
        assert "do not split over tp=4 ranks" in rank["indivisible"], rank["indivisible"]
        message = rank["indivisible heads"]   # the layer's sizes only: it has no vocabulary
        assert "tp=4 does not divide num_key_value_heads=2" in message and "choose tp among [1, 2]" in message, message

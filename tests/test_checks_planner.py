"""The checks of assignment 08 pass correct answers and fail planted wrong ones.

The correct answers are written here from the chapters' formulas, not taken from the solution notebook
(which runs under nbval on its own) and not from picotron.memory or the planner (which the checks refuse
inside an answer), so a check that passes everything, or nothing, is caught.
"""

import dataclasses

import pytest

from picotron_course.checks_planner import (Layout, candidate_layouts, check_best_layout, check_memory_per_gpu,
                                            check_params_on_first_stage, check_step_time)
from picotron.memory import estimate_memory
from picotron.costs import training_flops_per_token
from picotron.parallel.tensor_parallel_costs import tp_activation_bytes_per_layer
from picotron.planner import ASSUMED_MFU
from picotron.costs import flops_per_token

BYTES = {"fp32": (4, 4, 8, 4), "bf16-mixed": (2, 2, 12, 2)}     # parameter, gradient, optimizer, activation


# ---- correct answers ------------------------------------------------------------------------------------
def ref_params_on_first_stage(model, layout):
    h, t = model.hidden_size, layout.tp
    layers = -(-model.num_layers // layout.pp)                   # the first stages take the extra layers
    q, kv = model.num_attention_heads * model.head_dim, model.num_key_value_heads * model.head_dim
    attention = (2 * h * q + 2 * h * kv) // t
    per_layer = attention + 3 * h * model.intermediate_size // t + 2 * h
    total = layers * per_layer + model.vocab_size * h // t       # + the embedding's vocabulary slice
    if layout.pp == 1:                                           # the last stage too: final norm, untied head
        total += h + (0 if model.tie_word_embeddings else model.vocab_size * h // t)
    return total


def head_bytes(model, batch, seq, tp, a):
    """The final norm and the loss (the given helper of the notebook)."""
    n = batch * seq
    mine = n // tp if tp > 1 else n
    norm = (4 + a) * mine * model.hidden_size + 4 * mine + a * n * model.hidden_size
    return norm + (4 * n * model.vocab_size if tp == 1 else 8 * n * model.vocab_size // tp + 14 * n)


def ref_memory_per_gpu(model, layout, seq_len, global_batch, precision, *, schedule_in_flight=True):
    p, g, o, a = BYTES[precision]
    n, dp, stage = ref_params_on_first_stage(model, layout), layout.dp, layout.zero_stage
    shard = lambda nbytes, from_stage: -(-nbytes // dp) if stage >= from_stage else nbytes   # noqa: E731
    m = global_batch // (dp * layout.micro_batch_size)
    in_flight = min(layout.pp, m) if layout.pp > 1 and schedule_in_flight else 1
    layer = tp_activation_bytes_per_layer(dataclasses.replace(model, recompute=layout.recompute),
                                          layout.micro_batch_size, seq_len, layout.tp, layout.tp > 1, a)
    stage_bytes = -(-model.num_layers // layout.pp) * layer
    if layout.pp == 1:
        stage_bytes += head_bytes(model, layout.micro_batch_size, seq_len, layout.tp, a)
    return {"parameters": shard(p * n, 3), "gradients": shard(g * n, 2), "optimizer state": shard(o * n, 1),
            "activations": in_flight * stage_bytes}


def ref_step_time(model, layout, cluster, seq_len, global_batch, *, bubble=True):
    speed, a, h = cluster.peak_flops * ASSUMED_MFU, 2, model.hidden_size
    m = global_batch // (layout.dp * layout.micro_batch_size)
    layers = -(-model.num_layers // layout.pp)
    tokens = layout.micro_batch_size * seq_len
    flops = flops_per_token(model, seq_len)
    extra = training_flops_per_token(dataclasses.replace(model, recompute=layout.recompute), seq_len) - flops
    compute = (flops + extra) * tokens * layers / model.num_layers / layout.tp / speed
    node = cluster.gpus_per_node
    tp_bw = cluster.intra_node_bandwidth if node % layout.tp == 0 else cluster.inter_node_bandwidth
    tp = layers * 8 * (layout.tp - 1) / layout.tp * tokens * h * a / tp_bw * (1.5 if layout.recompute == "full" else 1)
    pipeline = m * (compute + tp) * ((m + layout.pp - 1) / m if bubble else 1)   # 1F1B: (p-1)/(m+p-1) idle
    n, dp = ref_params_on_first_stage(model, layout), layout.dp
    dp_bw = cluster.intra_node_bandwidth if node % (layout.tp * dp) == 0 else cluster.inter_node_bandwidth
    one_pass = (dp - 1) / dp * 2 * n                              # a reduce-scatter or an all-gather, bf16
    sent = {0: 2 * one_pass, 1: 2 * one_pass, 2: (m + 1) * one_pass, 3: 3 * m * one_pass}[layout.zero_stage]
    return pipeline + (sent / dp_bw if dp > 1 else 0.0)


def ref_best_layout(model, cluster, seq_len, global_batch):
    fitting = [layout for layout in candidate_layouts(model, cluster, seq_len, global_batch)
               if sum(ref_memory_per_gpu(model, layout, seq_len, global_batch, "bf16-mixed").values())
               <= 0.9 * cluster.gpu_memory]
    return min(fitting, key=lambda layout: ref_step_time(model, layout, cluster, seq_len, global_batch))


@pytest.mark.parametrize("check, answer", [(check_params_on_first_stage, ref_params_on_first_stage),
                                           (check_memory_per_gpu, ref_memory_per_gpu),
                                           (check_step_time, ref_step_time), (check_best_layout, ref_best_layout)],
                         ids=["params", "memory", "step_time", "best_layout"])
def test_correct_answer_passes(check, answer, capsys):
    check(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


# ---- planted wrong answers --------------------------------------------------------------------------------
def params_with_the_head_everywhere(model, layout):
    return ref_params_on_first_stage(model, layout) + (model.vocab_size * model.hidden_size // layout.tp
                                                       if layout.pp > 1 else 0)


def params_norms_split_by_tp(model, layout):
    layers = -(-model.num_layers // layout.pp)
    return ref_params_on_first_stage(model, layout) - 2 * layers * model.hidden_size * (layout.tp - 1) // layout.tp


def params_floor_layers(model, layout):                 # the last stages take the extra layers: wrong for picotron
    short = model.num_layers // layout.pp
    return ref_params_on_first_stage(dataclasses.replace(model, num_layers=short * layout.pp), layout)


def memory_without_zero(model, layout, seq, batch, precision):
    return ref_memory_per_gpu(model, dataclasses.replace(layout, zero_stage=0), seq, batch, precision)


def memory_one_micro_batch_in_flight(model, layout, seq, batch, precision):
    return ref_memory_per_gpu(model, layout, seq, batch, precision, schedule_in_flight=False)


def memory_fp32_optimizer_always(model, layout, seq, batch, precision):
    out = ref_memory_per_gpu(model, layout, seq, batch, precision)
    return out | {"optimizer state": out["optimizer state"] * 8 // BYTES[precision][2]}


def memory_calls_picotron(model, layout, seq, batch, precision):
    from picotron_course.checks_planner import plan_of
    from picotron.config import TrainConfig
    m = batch // (layout.dp * layout.micro_batch_size)
    e = estimate_memory(dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(seq, model.max_seq_len)),
                        TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m, seq_len=seq),
                        plan_of(layout).parallel, precision=precision, pp_rank=0)
    return {"parameters": e.parameters, "gradients": e.gradients, "optimizer state": e.optimizer,
            "activations": e.activations}


def time_without_bubble(model, layout, cluster, seq, batch):
    return ref_step_time(model, layout, cluster, seq, batch, bubble=False)


def time_tp_over_the_network(model, layout, cluster, seq, batch):
    slow = dataclasses.replace(cluster, intra_node_bandwidth=cluster.inter_node_bandwidth)
    return ref_step_time(model, layout, slow, seq, batch)


def time_forgets_recomputation(model, layout, cluster, seq, batch):
    return ref_step_time(model, dataclasses.replace(layout, recompute="none"), cluster, seq, batch) \
        if layout.recompute == "full" else ref_step_time(model, layout, cluster, seq, batch) * 0.9


def best_ignores_memory(model, cluster, seq, batch):
    return min(candidate_layouts(model, cluster, seq, batch),
               key=lambda layout: ref_step_time(model, layout, cluster, seq, batch))


def best_always_data_parallel(model, cluster, seq, batch):
    return Layout(dp=cluster.num_gpus, zero_stage=2, recompute="full")


WRONG_ANSWERS = [
    (check_params_on_first_stage, params_with_the_head_everywhere, "params_on_first_stage"),
    (check_params_on_first_stage, params_norms_split_by_tp, "not split by tp"),
    (check_params_on_first_stage, params_floor_layers, "params_on_first_stage"),
    (check_memory_per_gpu, memory_without_zero, "divided by dp"),
    (check_memory_per_gpu, memory_one_micro_batch_in_flight, "in flight"),
    (check_memory_per_gpu, memory_fp32_optimizer_always, "optimizer state"),
    (check_memory_per_gpu, memory_calls_picotron, "picotron.memory.estimate_memory"),
    (check_step_time, time_without_bubble, "step_time"),
    (check_step_time, time_tp_over_the_network, "step_time"),
    (check_step_time, time_forgets_recomputation, "step_time"),
    (check_best_layout, best_ignores_memory, "GiB per GPU"),
    (check_best_layout, best_always_data_parallel, "best_layout"),
]


@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)


def test_unsolved_raises_not_implemented():
    def stub(*args):
        raise NotImplementedError("write this part")
    for check in (check_params_on_first_stage, check_memory_per_gpu, check_step_time, check_best_layout):
        with pytest.raises(NotImplementedError):
            check(stub)

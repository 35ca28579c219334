"""The checks of assignment 08 pass correct answers and refuse picotron's own estimates.

The correct answers are written here from the chapters' formulas, not taken from the solution notebook
(which runs under nbval on its own) and not from picotron.memory or the planner (which the checks refuse
inside an answer), so a check that passes everything, or nothing, is caught. The wrong answers are the checks'
misconceptions (checks_planner.py), each failing with its hint (tests/test_misconceptions.py).
"""

import dataclasses

import pytest

from picotron_course.checks_planner import (candidate_layouts, check_best_layout, check_memory_per_gpu,
                                            check_params_on_first_stage, check_step_time, check_step_time_cp,
                                            fastest_layout, layout_name)
from picotron.memory import estimate_memory
from picotron.costs import training_flops_per_token
from picotron.parallel.tensor_parallel_costs import tp_activation_bytes_per_layer
from picotron.planner import ASSUMED_MFU
from picotron.costs import flops_per_token
from picotron.parallel.context_parallel_costs import cp_comm_bytes_per_layer
from picotron.parallel.tensor_parallel_costs import tp_comm_bytes_per_layer

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


def ref_step_time_cp(model, layout, cluster, seq_len, global_batch, *, ring=True, hidden=True, attention_at_s=True,
                     cp_replicas=True, tp_on_slice=True, fp32_ring_grads=True):
    """Part 3's step time with cp: s/cp tokens per rank, the K,V ring past the attention core, dp over dp x cp."""
    speed, a, h = cluster.peak_flops * ASSUMED_MFU, 2, model.hidden_size
    t, c, p, n = layout.tp, layout.cp, layout.pp, layout.dp
    m = global_batch // (n * layout.micro_batch_size)
    layers = -(-model.num_layers // p)
    tokens = layout.micro_batch_size * seq_len // c
    node = cluster.gpus_per_node

    def bw(stride, size):
        inside = size == 1 or node % (stride * size) == 0
        return cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth

    flops = training_flops_per_token(dataclasses.replace(model, recompute=layout.recompute),
                                     seq_len if attention_at_s else seq_len // c)
    compute = flops * tokens * layers / model.num_layers / t / speed
    tp_tokens = tokens if tp_on_slice else layout.micro_batch_size * seq_len
    tp = layers * 8 * (t - 1) / t * tp_tokens * h * a / bw(1, t) * (1.5 if layout.recompute == "full" else 1)
    exposed = 0.0
    if ring and c > 1:
        kv = 2 * tokens * (model.num_key_value_heads // t) * model.head_dim       # K and V of this rank's heads
        sent = layers * kv * (2 * (c - 1) * a + c * (4 if fp32_ring_grads else a)) / bw(t, c)
        core = layers * 12 * tokens * seq_len * model.num_attention_heads * model.head_dim / t / speed
        exposed = max(0.0, sent - core) if hidden else sent
    pipeline = (m + p - 1) * (compute + tp + exposed)
    replicas, stride = (n * c, t) if cp_replicas else (n, t * c)
    one_pass = (replicas - 1) / replicas * 2 * ref_params_on_first_stage(model, layout)
    sent = {0: 2 * one_pass, 1: 2 * one_pass, 2: (m + 1) * one_pass, 3: 3 * m * one_pass}[layout.zero_stage]
    return pipeline + (sent / bw(stride, replicas) if replicas > 1 else 0.0)


def ref_best_layout(model, cluster, seq_len, global_batch):
    fitting = [layout for layout in candidate_layouts(model, cluster, seq_len, global_batch)
               if sum(ref_memory_per_gpu(model, layout, seq_len, global_batch, "bf16-mixed").values())
               <= 0.9 * cluster.gpu_memory]
    return min(fitting, key=lambda layout: ref_step_time(model, layout, cluster, seq_len, global_batch))


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"params_on_first_stage": 7, "memory_per_gpu": 10, "step_time": 6, "best_layout": 3, "step_time_cp": 6}


@pytest.mark.parametrize("check, answer", [(check_params_on_first_stage, ref_params_on_first_stage),
                                           (check_memory_per_gpu, ref_memory_per_gpu),
                                           (check_step_time, ref_step_time), (check_best_layout, ref_best_layout),
                                           (check_step_time_cp, ref_step_time_cp)],
                         ids=["params", "memory", "step_time", "best_layout", "step_time_cp"])
def test_correct_answer_passes(check, answer, every_case):
    check(answer)
    every_case(CASES)


# ---- answers refused, and a mistake no misconception describes ----------------------------------------------
def memory_calls_picotron(model, layout, seq, batch, precision):
    from picotron_course.checks_planner import plan_of
    from picotron.config import TrainConfig
    m = batch // (layout.dp * layout.micro_batch_size)
    e = estimate_memory(dataclasses.replace(model, recompute=layout.recompute, max_seq_len=max(seq, model.max_seq_len)),
                        TrainConfig(micro_batch_size=layout.micro_batch_size, grad_accum_steps=m, seq_len=seq),
                        plan_of(layout).parallel, precision=precision, pp_rank=0)
    return {"parameters": e.parameters, "gradients": e.gradients, "optimizer state": e.optimizer,
            "activations": e.activations}


def time_copies_the_chapter(model, layout, cluster, seq, batch):     # chapter 08's step_time calls the counters
    t = layout.tp
    tp_bytes = tp_comm_bytes_per_layer(layout.micro_batch_size, seq, model.hidden_size, t, t > 1, 2)
    return ref_step_time(model, layout, cluster, seq, batch) + 0 * tp_bytes


def cp_calls_the_counter(model, layout, cluster, seq, batch):
    heads = dataclasses.replace(model, num_attention_heads=model.num_attention_heads // layout.tp,
                                num_key_value_heads=model.num_key_value_heads // layout.tp, head_dim=model.head_dim)
    cp_comm_bytes_per_layer(heads, layout.micro_batch_size, seq, layout.cp, "zigzag", 2)
    return ref_step_time_cp(model, layout, cluster, seq, batch)


REFUSED = [(check_memory_per_gpu, memory_calls_picotron, "picotron.memory.estimate_memory"),
           (check_step_time, time_copies_the_chapter, "tensor_parallel_costs.tp_comm_bytes_per_layer"),
           (check_step_time_cp, cp_calls_the_counter, "context_parallel_costs.cp_comm_bytes_per_layer")]


@pytest.mark.parametrize("check, answer, says", REFUSED, ids=[a.__name__ for _, a, _ in REFUSED])
def test_picotrons_estimates_are_refused(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    assert "FAIL" not in capsys.readouterr().out   # refused before a table is printed


def test_a_mistake_no_misconception_describes_gets_the_difference_without_a_hint(capsys):
    with pytest.raises(AssertionError, match=r"the parameters on a first-stage GPU .*off by \+7") as error:
        check_params_on_first_stage(lambda model, layout: ref_params_on_first_stage(model, layout) + 7)
    assert "Hint" not in str(error.value) and "hint:" not in capsys.readouterr().out


def test_unsolved_raises_not_implemented():
    def stub(*args):
        raise NotImplementedError("write this part")
    for check in (check_params_on_first_stage, check_memory_per_gpu, check_step_time, check_best_layout,
                  check_step_time_cp):
        with pytest.raises(NotImplementedError):
            check(stub)


def test_fastest_layout_is_what_best_layout_is_held_to():
    """The notebook's "predict, then run" reads the checks' reference: it agrees with the formulas above, and
    a 10x slower network moves dp into the nodes and pp across them (the sends left out)."""
    import dataclasses as dc
    from picotron.config import ModelConfig
    from picotron.planner import ClusterSpec
    model, cluster = ModelConfig.preset("llama3-8b"), ClusterSpec.h100(32)
    slow = dc.replace(cluster, inter_node_bandwidth=cluster.inter_node_bandwidth / 10)
    fast_layout, fast_estimate, fast_seconds = fastest_layout(model, cluster, 8192, 32)
    slow_layout, slow_estimate, slow_seconds = fastest_layout(model, slow, 8192, 32)
    assert fast_layout == ref_best_layout(model, cluster, 8192, 32)
    assert abs(fast_seconds / ref_step_time(model, fast_layout, cluster, 8192, 32) - 1) < 0.01
    assert fast_estimate.links["dp"] == "inter" and slow_estimate.links["pp"] == "inter"
    assert slow_estimate.links["dp"] == "intra" and slow_seconds < 1.05 * fast_seconds
    assert layout_name(slow_layout) == "tp4 pp4 dp2" and "cp=1" not in repr(slow_layout)

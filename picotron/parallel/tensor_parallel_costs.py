"""What tensor and sequence parallelism cost: formulas that chapters/04_tensor_parallel.ipynb checks against counts.

Communication per decoder layer and per training step, in the format picotron.comm's CommCounter
counts it (`tp_comm_per_layer`, `tp_comm_per_step`) and as bytes on the wire with ring
algorithms (`tp_comm_bytes_per_layer`); activation bytes one layer saves per rank, counted like
picotron.costs counts them (`tp_activation_bytes_per_layer`). The technique itself is
picotron/parallel/tensor_parallel.py; chapter 04 derives why these are its costs.
"""

from __future__ import annotations

from picotron.config import ModelConfig

__all__ = ["tp_comm_per_layer", "tp_comm_per_step", "tp_comm_bytes_per_layer", "tp_activation_bytes_per_layer"]


def tp_comm_per_layer(batch: int, seq: int, hidden: int, tp: int, sequence_parallel: bool = False,
                      dtype_bytes: int = 4) -> dict[str, dict[str, tuple[int, int]]]:
    """What one decoder layer hands to the collectives on each rank, per pass, as CommCounter counts it.

    {"forward": {op: (calls, payload bytes)}, "backward": {...}} in CommCounter.snapshot()'s format
    (payload: an all-reduce's or reduce-scatter's whole input, an all-gather's shard). Without
    recomputation; "full" recomputation runs the forward's collectives once more in backward.
    """
    if tp == 1:
        return {"forward": {}, "backward": {}}
    activation = batch * seq * hidden * dtype_bytes                  # b s h a
    if not sequence_parallel:
        both = {"all_reduce": (2, 2 * activation)}                    # leaving attention and MLP / entering them
        return {"forward": both, "backward": dict(both)}
    gathers = {"all_gather": (2, 2 * activation // tp), "reduce_scatter": (2, 2 * activation)}
    norm_grads = {"all_reduce": (2, 2 * hidden * dtype_bytes)}        # the two RMSNorm weights' gradients
    return {"forward": gathers, "backward": {**gathers, **norm_grads}}


def tp_comm_per_step(config: ModelConfig, batch: int, seq: int, tp: int, sequence_parallel: bool = False,
                     dtype_bytes: int = 4) -> dict[str, dict[str, tuple[int, int]]]:
    """`tp_comm_per_layer` for the whole model and its loss: one forward and one backward, same format.

    Besides the layers: the embedding leaves a tp region (forward; under SP also an all-gather in
    backward), the LM head enters one (backward; under SP also an all-gather in forward), the loss
    all-reduces three fp32 numbers per token (max, sum of exponentials, target logit), and under
    SP the final norm's weight gradient is all-reduced.
    """
    per_layer = tp_comm_per_layer(batch, seq, config.hidden_size, tp, sequence_parallel, dtype_bytes)
    if tp == 1:
        return per_layer
    activation = batch * seq * config.hidden_size * dtype_bytes
    loss = {"all_reduce": (3, 3 * batch * seq * 4)}
    if sequence_parallel:
        gather, scatter = {"all_gather": (1, activation // tp)}, {"reduce_scatter": (1, activation)}
        forward = [scatter, gather, loss]                                   # embedding, LM head, loss
        backward = [gather, scatter, {"all_reduce": (1, config.hidden_size * dtype_bytes)}]
    else:
        forward = [{"all_reduce": (1, activation)}, loss]                   # embedding, loss
        backward = [{"all_reduce": (1, activation)}]                        # LM head's input
    layers = {pass_: {op: (config.num_layers * calls, config.num_layers * nbytes)
                      for op, (calls, nbytes) in per_layer[pass_].items()} for pass_ in per_layer}
    return {"forward": _add_counts(layers["forward"], *forward), "backward": _add_counts(layers["backward"], *backward)}


def _add_counts(*counts: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    total: dict[str, tuple[int, int]] = {}
    for count in counts:
        for op, (calls, nbytes) in count.items():
            before = total.get(op, (0, 0))
            total[op] = (before[0] + calls, before[1] + nbytes)
    return dict(sorted(total.items()))


def tp_comm_bytes_per_layer(batch: int, seq: int, hidden: int, tp: int, sequence_parallel: bool = False,
                            dtype_bytes: int = 4) -> int:
    """Bytes each rank sends per decoder layer per training step (forward + backward), ring algorithms.

    TP: 4 all-reduces of b s h a, each 2 (t-1)/t of it on the wire. SP: 4 all-gathers and 4
    reduce-scatters, each (t-1)/t of it. The same 8 (t-1)/t b s h a: SP moves no more bytes than
    TP (leaving out SP's norm-weight gradients, 2 all-reduces of h values).
    """
    activation = batch * seq * hidden * dtype_bytes
    collectives = 8 if sequence_parallel else 4
    per_collective = (1 if sequence_parallel else 2) * (tp - 1) * activation // tp
    return collectives * per_collective


def tp_activation_bytes_per_layer(config: ModelConfig, batch: int, seq: int, tp: int,
                                  sequence_parallel: bool = False, dtype_bytes: int = 4) -> int:
    """Bytes one decoder layer saves for backward on each rank, counted like costs.activation_bytes_per_layer.

    With a = dtype_bytes, t = tp, n = b s tokens, and n' = n / t under SP, n' = n under TP alone
    (the tokens this rank's norms and residual stream see):

        RMSNorm, twice   (4 + a) n' h + 4 n'   fp32 input, normalised x, 1/rms per token
                         + a n h               output as the column-parallel Linears read it:
                                               replicated (TP) or all-gathered (SP), never sharded
        attention        a n (2 n_q d + 2 n_kv d) / t   q, k after RoPE, v, output: heads / t
            sdpa         + 4 b (n_q/t) s
            eager        + 2a n (n_q - n_kv) d / t + a b (n_q/t) s^2
        SwiGLU MLP       4 a n f / t
    "selective" recomputation drops the attention core's terms; "full" keeps a n' h, the layer input.
    """
    a, t, h = dtype_bytes, tp, config.hidden_size
    tokens = batch * seq
    my_tokens = batch * (seq // t) if sequence_parallel else tokens
    if config.recompute == "full":
        return a * my_tokens * h
    heads, kv_heads, d = config.num_attention_heads // t, config.num_key_value_heads // t, config.head_dim
    norms = 2 * ((4 + a) * my_tokens * h + 4 * my_tokens + a * tokens * h)
    attention = a * tokens * (2 * heads * d + 2 * kv_heads * d)
    mlp = 4 * a * tokens * (config.intermediate_size // t)
    if config.recompute == "none":
        if config.attention == "sdpa":
            attention += 4 * batch * heads * seq                                        # log-sum-exp
        else:
            attention += 2 * a * tokens * (heads - kv_heads) * d + a * batch * heads * seq * seq
    return norms + attention + mlp

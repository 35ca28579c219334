"""Whether a configuration can run: every rule a layout must satisfy, in one call.

The allowed combinations are drawn in chapters/08_5d_parallelism.ipynb.

`validate(config, world_size)` checks the fields (types, bounds, choices: picotron.config), each
technique's own rules (the pipeline's stages and schedule, context parallelism's split of the
heads and the sequence, ...), and the pairings of techniques the trainer does not compose. Each
error names the problem and the fix. It lives here, above the techniques and not in
picotron.config, because every technique imports the configuration: a config that imported the
techniques' checks would close a loop (docs/design.md, "Layers").
"""

from __future__ import annotations

import dataclasses

from picotron.config import PRECISIONS, Config, ModelConfig, ParallelConfig, check_fields, check_model_choices
from picotron.data import load_tokenizer
from picotron.parallel.context_parallel import check_context_parallel
from picotron.parallel.expert_parallel import check_expert_parallel
from picotron.parallel.pipeline_schedules import check_pipeline
from picotron.parallel.tensor_parallel import check_tensor_parallel
from picotron.parallel.zero import check_zero_stage


def validate(config: Config, world_size: int | None = None) -> None:
    """Raise ValueError naming the problem and the fix for any impossible combination."""
    m, p, t = config.model, config.parallel, config.train
    for section in dataclasses.fields(config):   # types and bounds first: the checks below compare numbers
        values = getattr(config, section.name)
        check_fields(type(values), {f.name: getattr(values, f.name) for f in dataclasses.fields(values)},
                     f"{section.name}.")
    check_model_choices(m)
    check_zero_stage(p.zero_stage)
    if m.num_attention_heads % m.num_key_value_heads:
        raise ValueError(f"num_key_value_heads={m.num_key_value_heads} does not divide "
                         f"num_attention_heads={m.num_attention_heads}")
    check_tensor_parallel(m, p.tp, p.sequence_parallel)
    if p.sequence_parallel and p.tp == 1:
        raise ValueError("sequence_parallel=True needs tp > 1: it splits the tensor-parallel ranks' norms "
                         "along the sequence; set tp or drop sequence_parallel")
    if p.sequence_parallel and (t.seq_len % p.cp or (t.seq_len // p.cp) % p.tp):
        raise ValueError(f"sequence parallelism splits the sequence over tp={p.tp} ranks (after cp={p.cp}), but "
                         f"seq_len={t.seq_len} does not divide by it; choose a seq_len that is a multiple of "
                         f"{p.tp * p.cp}")
    check_pipeline(m.num_layers, p.pp, p.pp_schedule, p.pp_virtual_stages, t.grad_accum_steps)
    if p.ep > 1:
        check_expert_parallel(m, p.ep, dp=p.dp)
    if t.tokenizer and (vocab := load_tokenizer(t.tokenizer).get_vocab_size()) > m.vocab_size:
        raise ValueError(f"tokenizer {t.tokenizer} has {vocab} tokens but the model's vocab_size={m.vocab_size}: "
                         f"some ids would have no embedding; set vocab_size to at least {vocab} (or a preset "
                         f"built for this tokenizer)")
    if t.seq_len > m.max_seq_len:
        raise ValueError(f"seq_len={t.seq_len} is longer than max_seq_len={m.max_seq_len}; raise max_seq_len")
    check_context_parallel(m, p.cp, p.cp_mode, t.seq_len, p.tp)
    check_combination(m, p)
    if t.compile and p.cp > 1 and p.cp_mode != "ulysses":
        raise NotImplementedError(f"compile=True with cp_mode={p.cp_mode!r}: torch.compile cannot trace ring "
                                  f"attention's point-to-point sends inside a layer (they would break its graph); "
                                  f"use cp_mode='ulysses' (all-to-alls, which compile), or drop --compile")
    if t.precision not in PRECISIONS:
        raise ValueError(f"precision={t.precision!r}; choose one of {PRECISIONS} (auto: bf16 on a GPU, fp32 on a CPU)")
    if t.backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={t.backend!r}; choose 'auto', 'gloo' or 'nccl'")
    if world_size is not None and p.world_size != world_size:
        raise ValueError(f"dp*pp*cp*tp = {p.dp}*{p.pp}*{p.cp}*{p.tp} = {p.world_size} but the world has "
                         f"{world_size} ranks; change the sizes or launch {p.world_size} ranks")


def check_combination(model: ModelConfig, p: ParallelConfig) -> None:
    """Raise for axes that do not go together (ValueError), or whose pairing is not written (NotImplementedError).

    Every other pairing of dp (ZeRO-0/1/2/3), pp, cp, tp (+SP) and ep composes in the trainer.
    """
    if p.pp > 1 and p.zero_stage == 3:
        raise ValueError("zero_stage=3 with pp>1: ZeRO-3 all-gathers a layer's weights for every forward and "
                         "backward, and a pipeline runs each stage's layers once per micro-batch, so the weights "
                         "would cross the network 2m times a step, and a pipeline needs many micro-batches "
                         "(m >> p) to keep its bubble small; use zero_stage=1 or 2 with pp (as DeepSeek-V3 does), "
                         "or pp=1 with ZeRO-3")
    if p.pp > 1 and p.zero_stage == 2 and p.pp_schedule in ("zb-h1", "interleaved"):
        why = ("zb-h1's W steps write the weight gradients themselves, after backward" if p.pp_schedule == "zb-h1"
               else "a rank's chunks of layers run separate backwards, so a bucket spanning two chunks fills up "
                    "out of step with the micro-batches")
        raise NotImplementedError(f"zero_stage=2 with pp_schedule={p.pp_schedule!r}: ZeRO-2 reduce-scatters a bucket "
                                  f"when one backward has filled it, but {why}; use zero_stage=1 with this "
                                  f"schedule, or '1f1b' / 'afab' with zero_stage=2")
    if p.pp > 1 and p.zero_stage == 2 and model.tie_word_embeddings:
        raise ValueError("zero_stage=2 with pp>1 and tie_word_embeddings=True: the first and the last stage each "
                         "hold a copy of the tied matrix and must add their gradients, which ZeRO-2 has already "
                         "reduce-scattered into shards laid out differently on the two stages; use zero_stage=1, "
                         "or tie_word_embeddings=False")
    if model.num_experts and p.pp > 1:
        raise NotImplementedError(f"pp={p.pp} with an MoE model (num_experts={model.num_experts}) is not written: "
                                  f"each stage's balancing losses would have to join that stage's backward; use "
                                  f"pp=1 with MoE models")
    if model.fp8 != "none" and p.tp > 1:
        raise NotImplementedError(f"fp8={model.fp8!r} with tp={p.tp} is not written: the tensor-parallel Linears "
                                  f"compute their own matmuls, which picotron.fp8 does not replace; use tp=1 with fp8")
    if model.loss_impl == "chunked" and p.tp > 1:
        raise NotImplementedError(f"loss_impl='chunked' with tp={p.tp} is not written: under tp each rank already "
                                  f"holds only vocab/tp of the logits (the vocabulary-parallel loss), and a chunked "
                                  f"loss would need that loss's max and sum all-reduced chunk by chunk; use "
                                  f"loss_impl='torch' with tp > 1")
    if model.loss_impl == "chunked" and p.pp > 1:
        raise NotImplementedError(f"loss_impl='chunked' with pp={p.pp} is not written: the pipeline's last stage "
                                  f"hands its logits to the executor's loss function; use loss_impl='torch' with pp")
    if p.ep > 1 and p.zero_stage:
        raise NotImplementedError(f"ep={p.ep} with zero_stage={p.zero_stage} is not written: ZeRO's flat buffers "
                                  f"average every gradient over all dp ranks, but an expert's gradient is averaged "
                                  f"over the ranks holding that expert only; use one of them")

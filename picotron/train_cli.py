"""The trainer's command line (`python -m picotron.train`, whose `main` is in picotron/train.py): its flags, the
configuration they make, the inputs checked before any rank starts, and the one line an error ends on.

    build_parser()      the flags (`python -m picotron.train --help`)
    parse_args(argv)    the Config a command line asks for: the --config file (or 4-rank defaults), then each flag
    check_inputs(...)   what the run would read and cannot (--dataset, --resume, --backend nccl without GPUs)
    error_line(error)   the one line an error is shown as (a rank's own message, without its traceback)
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from picotron import checkpoint, launch
from picotron.config import FP8_RECIPES, LOSS_IMPLS, PRECISIONS, PRESETS, Config, ModelConfig, ParallelConfig
from picotron.data import dataset_files
from picotron.parallel.context_parallel import CP_MODES
from picotron.parallel.pipeline_schedules import SCHEDULES
from picotron.rank_server import RankError

__all__ = ["PROG", "build_parser", "parse_args", "config_of", "check_inputs", "error_line"]


def build_parser() -> argparse.ArgumentParser:
    """The command line: every flag overrides one field of the configuration (a --config file or the defaults)."""
    parser = argparse.ArgumentParser(prog="python -m picotron.train", description="Train a Llama on N ranks: `python -m picotron.train`.")
    parser.add_argument("--config", help="JSON file with 'model', 'parallel' and 'train' sections")
    parser.add_argument("--preset", help=f"model shape: {', '.join(PRESETS)}")
    for axis in ("dp", "pp", "cp", "tp"):
        parser.add_argument(f"--{axis}", type=int)
    parser.add_argument("--steps", type=int,
                        help="optimizer steps in all, resumed ones included; 0 trains nothing (the initial model is "
                             "evaluated, and with --save-dir saved as SAVE_DIR/step_000000)")
    for name in ("micro_batch_size", "grad_accum_steps", "seq_len", "seed", "log_every"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    for name in ("lr", "weight_decay"):
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=float)
    parser.add_argument("--bucket-mb", dest="bucket_mb", type=float,
                        help="MiB of gradients per data-parallel all-reduce bucket (0: one per parameter)")
    parser.add_argument("--sp", dest="sequence_parallel", action="store_true", default=None,
                        help="sequence parallelism with --tp (chapter 04): norms split along the sequence")
    parser.add_argument("--cp-mode", dest="cp_mode", choices=list(CP_MODES),
                        help="with --cp (chapter 05): ring attention over contiguous slices, zig-zag ring "
                             "(balanced causal work; the default) or Ulysses all-to-alls over the heads")
    parser.add_argument("--ep", type=int, help="expert parallelism for an MoE model (chapter 07): groups of ep "
                                               "dp ranks split the experts (e.g. --preset tiny-moe --ep 4)")
    parser.add_argument("--pp-schedule", dest="pp_schedule", choices=list(SCHEDULES),
                        help="with --pp (chapter 06): the order the stages run the step's --grad-accum-steps "
                             "micro-batches in (default 1f1b)")
    parser.add_argument("--virtual-stages", dest="pp_virtual_stages", type=int,
                        help="chunks of layers per pp rank, with --pp-schedule interleaved")
    parser.add_argument("--zero", dest="zero_stage", type=int, choices=[0, 1, 2, 3],
                        help="ZeRO stage (chapter 03): the dp ranks split 1 the optimizer state, 2 and the "
                             "gradients, 3 and the parameters; 0 is plain data parallelism (with dp=1 there is "
                             "nothing to split)")
    parser.add_argument("--recompute", choices=["none", "selective", "full"],
                        help="activation recomputation (chapter 01)")
    parser.add_argument("--attention", choices=["sdpa", "eager"], help="fused attention or the eager scores")
    parser.add_argument("--fp8", choices=list(FP8_RECIPES),
                        help="the Linears' matmuls in fp8 with this scaling recipe (chapter 10; emulated on a CPU)")
    parser.add_argument("--norm-impl", dest="norm_impl", choices=["torch", "triton"],
                        help="RMSNorm by torch ops or by picotron's Triton kernels (chapter 09; interpreted on a CPU)")
    parser.add_argument("--loss-impl", dest="loss_impl", choices=list(LOSS_IMPLS),
                        help="chunked: the LM head and the loss fused, --loss-chunk-tokens tokens' logits at a time "
                             "(chapter 09; the whole logits never exist)")
    parser.add_argument("--loss-chunk-tokens", dest="loss_chunk_tokens", type=int,
                        help="tokens whose logits exist at once with --loss-impl chunked (default 1024)")
    parser.add_argument("--dataset", help="'arithmetic' (built in) or a .txt/.jsonl file or folder")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json: the corpus is tokenized once into a "
                                            "memory-mapped file of --cache-dir (default: bytes are the tokens)")
    parser.add_argument("--cache-dir", dest="cache_dir", help="where tokenized corpora are kept "
                                                              "(default ~/.cache/picotron)")
    parser.add_argument("--precision", choices=list(PRECISIONS),
                        help="bf16: matmuls in bf16 under autocast, fp32 master weights, gradients and AdamW state "
                             "(chapter 10); auto (the default): bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="torch.compile each decoder layer (one graph, no breaks); the first step compiles")
    parser.add_argument("--backend", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--log-file", dest="log_file", help="rank 0 appends one JSON line per step to this file "
                                                            "(checked writable before step 0)")
    parser.add_argument("--save-dir", dest="save_dir",
                        help="write checkpoints to SAVE_DIR/step_NNNNNN (DCP; created and checked writable before "
                             "step 0); with --steps 0, the initial state as step_000000")
    parser.add_argument("--save-every", dest="save_every", type=int,
                        help="steps between checkpoints (default: only after the last step)")
    parser.add_argument("--resume", help="a checkpoint directory to continue from, saved with any layout")
    parser.add_argument("--traceback", action="store_true",
                        help="on an error, show the whole traceback (a rank's included) instead of one line")
    return parser


def parse_args(argv: list[str] | None) -> Config:
    """The configuration a command line asks for: the --config file (or 4-rank defaults), then each flag."""
    return config_of(build_parser().parse_args(argv))


def config_of(args: argparse.Namespace) -> Config:
    """The configuration of parsed arguments: the --config file (or 4-rank defaults), then each flag."""
    config = Config.from_json(args.config) if args.config else Config(parallel=ParallelConfig(dp=4))
    if args.preset:
        config.model = ModelConfig.preset(args.preset)
    for name in ("recompute", "attention", "norm_impl", "fp8", "loss_impl", "loss_chunk_tokens"):
        if getattr(args, name) is not None:
            config.model = dataclasses.replace(config.model, **{name: getattr(args, name)})
    for axis in ("dp", "pp", "cp", "tp", "ep", "zero_stage", "sequence_parallel", "cp_mode", "pp_schedule",
                 "pp_virtual_stages"):
        if getattr(args, axis) is not None:
            setattr(config.parallel, axis, getattr(args, axis))
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(config.train)
                 if getattr(args, f.name, None) is not None}
    config.train = dataclasses.replace(config.train, **overrides)
    return config


def check_inputs(config: Config, ranks_here: int) -> None:
    """Raise ValueError or FileNotFoundError naming the fix for what the run would read and cannot: a --dataset
    path with no text files, a --resume directory that holds no checkpoint of this model, a --backend nccl
    with fewer GPUs than the `ranks_here` ranks on this machine. Cheap (nothing is trained or tokenized):
    `main` runs it before any rank starts. (validate reads --tokenizer.)"""
    t = config.train
    if t.dataset != "arithmetic":
        dataset_files(t.dataset)
    if t.resume:
        checkpoint.check_checkpoint(t.resume, config.model)
    if t.backend == "nccl" and launch.backend_for(ranks_here) != "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        why = "this torch is a CPU build" if not torch.backends.cuda.is_built() else f"{gpus} GPU(s) are visible"
        raise ValueError(f"backend='nccl' (--backend nccl) needs one GPU per rank, {ranks_here} here, but {why}; "
                         f"use --backend gloo (or auto) to run the ranks as CPU processes, or run on a machine "
                         f"with {ranks_here} GPU{'s' if ranks_here != 1 else ''}")


PROG = "python -m picotron.train"
# The types whose message says what is wrong by itself (picotron raises them naming the fix); any other
# type is named in the one line, so that a bug reads as one ("KeyError: 'x'", not "'x'").
_SELF_EXPLAINED = (ValueError, NotImplementedError, FileNotFoundError, TimeoutError, RankError)


def error_line(error: BaseException) -> str:
    """One line for an error: its message (a rank's own, after the rank it came from, without the
    traceback that picotron.launch adds), its first line only, and its type where the message alone would
    not say what went wrong."""
    message = getattr(error, "rank_message", None)
    message = str(error) if message is None else message
    lines = [line for line in message.splitlines() if line.strip()]
    text = lines[0].strip() if lines else ""
    if not isinstance(error, _SELF_EXPLAINED) or not text:
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    rank = getattr(error, "rank", None)
    return f"rank {rank}: {text}" if rank is not None else text

"""Train a Llama on N ranks: `python -m picotron.train`.

    python -m picotron.train                           # 4 CPU ranks, data parallel, 600 steps: 75 s on 2 cores
    python -m picotron.train --dp 2 --steps 50         # overrides on top of the defaults
    python -m picotron.train --zero 3                  # ZeRO-3: each rank keeps 1/4 of the training state
    python -m picotron.train --dp 2 --tp 2 --sp        # tensor + sequence parallelism inside each dp replica
    python -m picotron.train --dp 2 --cp 2             # context parallelism: each rank holds half of every sequence
    python -m picotron.train --dp 1 --cp 2 --tp 2 --sp # context and tensor parallelism together, 4 ranks
    python -m picotron.train --dp 2 --pp 2 --grad-accum-steps 4   # 2 pipeline stages, 4 micro-batches (1F1B)
    python -m picotron.train --preset tiny-moe --ep 4  # mixture of experts, 2 of 8 experts on each of 4 ranks
    python -m picotron.train --config configs/tiny_5d_8ranks.json   # dp2 x pp2 x tp2 (+SP, ZeRO-1): 8 ranks
    python -m picotron.train --config configs/tiny_dp4.json --lr 1e-3
    python -m picotron.train --steps 100 --save-dir ckpt --save-every 50      # checkpoints (DCP), then:
    python -m picotron.train --steps 200 --dp 2 --tp 2 --resume ckpt/step_000100   # resume, in another layout
    python -m picotron.train --steps 0 --save-dir init  # train nothing: save the initial state, init/step_000000
    python -m picotron.train --precision bf16 --compile   # bf16 autocast, compiled layers (GPU defaults: bf16)
    torchrun --nproc-per-node 8 -m picotron.train --config configs/smollm_135m_dp8.json

Without torchrun it starts the ranks itself (picotron.launch.run); under torchrun each
process trains in place. Each log line shows the loss, the throughput in tokens/s and the
model FLOPs utilisation (MFU):

    MFU = (tokens/s * FLOPs per token) / peak FLOP/s
    FLOPs per token = 6 N + 12 L h s    (N parameters, L layers, h hidden size, s sequence;
                                         the second term is attention's QK^T and AV; PaLM, App. B)

The peak is that of the precision the matmuls run in: the spec-sheet dense bf16 figure on a
known GPU in bf16 (H100 SXM: 989 TFLOP/s), half of it for TF32, otherwise a matmul measured
on this rank in that dtype (any CPU), labelled as such. With recomputation the hardware FLOPs
utilisation (HFU, counting the recomputed forward) follows; with replicas, the share of the step
spent in gradient communication that backward did not hide; on a GPU, the peak memory.

Precision (docs/design.md, "Mixed precision and compiled layers in the trainer"): --precision
bf16 runs the forward under torch.autocast, bf16 matmuls with fp32 master weights, gradients and
AdamW state; it is the default on a GPU, fp32 the default on a CPU. --compile compiles each
decoder layer (one shared graph, no graph breaks); the first step's compile time is printed apart.

The axes compose on one mesh of dp x pp x cp x tp ranks (tp innermost, pp outermost; chapter
08). Data parallelism: bucketed all-reduces overlapped with backward (chapter 02), or with
--zero 1|2|3 the replicas split the optimizer state, gradients and parameters (ZeRO, chapter 03).
Tensor parallelism: --tp 2 splits every weight matrix and the vocabulary over 2 ranks, --sp adds
sequence parallelism (chapter 04). Context parallelism: --cp 2 gives each rank half of every
sequence, --cp-mode ring|zigzag|ulysses picks how attention sees the rest (chapter 05); the
gradients then average over the dp x cp ranks. Pipeline parallelism: --pp 2 splits the layers
into 2 stages that run the step's --grad-accum-steps micro-batches in the order of
--pp-schedule (chapter 06), with ZeRO-1/2 but not ZeRO-3. Expert parallelism: for a
mixture-of-experts model (--preset tiny-moe), --ep 4 splits the experts over groups of 4 dp
ranks, tokens travelling to their experts by all-to-all, while --tp splits the attention
(chapter 07). The combinations that do not go together are refused by
picotron.layout.check_combination, with the reason and the fix.

Every error ends the command with one line on stderr, "python -m picotron.train: error: ..."
naming the problem and the fix, and no traceback (--traceback shows the whole traceback instead,
a rank's included). Bad input stops the command before any rank starts, with exit status 2 as
argparse's own errors: a value of the wrong type or range (--seq-len 0, --lr nan, "dp": "2" in
a JSON config), a config file that cannot be read or parsed, a combination of axes that does
not go together, a --log-file or --save-dir that cannot be written, a --dataset, --tokenizer
or --resume path that holds no such thing (or a checkpoint of another model), --backend nccl
without a GPU for every rank. An error met while training, in this process or on a rank (a
dataset too short for one batch, a malformed .jsonl line), exits with status 1: the same line
(a rank's own message, after the rank's number) and a second one saying to rerun with
--traceback to see where it was raised. Ctrl-C stops quietly (status 130).
--steps 0 trains nothing; with --save-dir it saves the initial state as step_000000.
The flags, the inputs checked before any rank starts and the one-line errors are in
picotron/train_cli.py; `main` below puts them together.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from picotron import checkpoint, comm, launch
from picotron.config import Config, TrainConfig
from picotron.costs import flops_per_token, peak_flops, training_flops_per_token
from picotron.data import arithmetic_accuracy, arithmetic_digit_accuracy, arithmetic_eval_problems, make_loader
from picotron.layout import validate
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel import context_parallel as cp
from picotron.parallel import expert_parallel as ep
from picotron.parallel import grad_norm
from picotron.parallel import pipeline_parallel as pp
from picotron.parallel import tensor_parallel as tp
from picotron.parallel.data_parallel import DataParallel, all_reduce_gradients
from picotron.parallel.pipeline_schedules import make_schedule
from picotron.parallel.zero import ZeroOptimizer
from picotron.parallel.zero3 import Zero3
from picotron.train_cli import PROG, build_parser, check_inputs, config_of, error_line


def lr_at(step: int, config) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    t = config.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype of the forward's matmuls for TrainConfig.precision on `device`: "auto" is bf16 on a GPU
    (its tensor cores run bf16 at twice TF32's rate) and fp32 on a CPU (where bf16 buys little and the
    course's proofs are fp32-strict)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]


def compile_layers(model: Llama) -> None:
    """torch.compile each decoder layer's forward in place, fullgraph=True: a graph break inside a layer is
    an error, not a silent slowdown.

    Per layer rather than the whole model, so that what surrounds the layers keeps working unchanged:
    data parallelism's gradient hooks and ZeRO-3's gathering hooks (module hooks run outside forward),
    pipeline stages (a stage calls its layers), full recomputation (a checkpoint around each layer),
    parameter names and checkpoints (the modules stay the same objects). Every layer runs the same code on
    tensors of the same shapes, so they share one compiled graph (torch inlines the module, its weights
    become the graph's inputs). Collectives inside a layer (tensor parallelism's, Ulysses' and the experts'
    all-to-alls) are traced into the graph as torch's functional collectives.
    """
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward, fullgraph=True)


@dataclass
class StepResult:
    step: int
    loss: float          # mean over the global batch
    lr: float
    grad_norm: float
    seconds: float
    sample_ids: list = field(default_factory=list)  # windows this rank trained on (for tests)
    sync_seconds: float = 0.0   # of `seconds`: gradient communication after backward, not hidden behind it


@dataclass
class GradientSync:
    """How the trainer averages gradients over the replicas: one object, chosen once by the Trainer.

    `finish()` runs after the step's last backward; `accumulating()` wraps each earlier backward of
    a step with gradient accumulation (only bucketed data parallelism, whose all-reduces overlap
    backward, has to hold them back there).
    """

    finish: Callable[[], None] = lambda: None
    accumulating: Callable[[], ContextManager] = nullcontext


class Trainer:
    """One model replica and its optimizer; `mesh=None` trains in a single process.

    The axes compose in one order: tensor parallelism splits the weights (chapter 04), context
    parallelism the sequences (05), expert parallelism the experts (07), pipeline parallelism keeps
    this rank's stages (06), and data parallelism, plain or ZeRO (02-03), averages the gradients
    over the dp x cp replicas of whatever this rank holds.
    """

    def __init__(self, config: Config, mesh: Mesh | None = None):
        validate(config, mesh.world_size if mesh else 1)
        self.config, self.mesh = config, mesh
        with self.counting():   # building may communicate (ZeRO and DataParallel broadcast rank 0's weights)
            self._build()

    def _build(self) -> None:
        """The model, split over this rank's axes in one order, its optimizer and the gradients' sync."""
        config, mesh = self.config, self.mesh
        p, t = config.parallel, config.train
        self.device = launch.device()
        self.compute_dtype = compute_dtype(t.precision, self.device)
        torch.manual_seed(t.seed)
        self.model = Llama(config.model).to(self.device)
        self.loss_fn = loss_fn
        if mesh and p.tp > 1:  # chapter 04: each tp rank keeps its slice of every matrix and of the vocabulary
            tp.apply_tensor_parallel(self.model, mesh, sequence_parallel=p.sequence_parallel)
            self.loss_fn = functools.partial(tp.vocab_parallel_cross_entropy, group=mesh.tp_group)
        if mesh and p.cp > 1:  # chapter 05: each cp rank holds a slice of every sequence; attention gathers the rest
            cp.apply_context_parallel(self.model, mesh, mode=p.cp_mode)
        self.ep_groups = None
        if mesh and p.ep > 1:  # chapter 07: each rank of an ep group keeps num_experts/ep experts; tokens travel
            self.ep_groups = ep.expert_parallel_groups(mesh, p.ep)
            ep.apply_expert_parallel(self.model, self.ep_groups)
        if t.compile:          # after the techniques have swapped their modules in, before anything wraps the layers
            compile_layers(self.model)
        self.stages = None
        trained: torch.nn.Module = self.model          # what this rank trains: the whole model, or its stages
        if mesh and p.pp > 1:  # chapter 06: this rank runs its stages' layers; the step's micro-batches flow through
            self.stages = pp.build_stages(self.model, mesh.pp_rank, mesh.pp_size, virtual_stages=p.pp_virtual_stages)
            self.schedule = make_schedule(p.pp_schedule, mesh.pp_size, t.grad_accum_steps, p.pp_virtual_stages)
            trained = torch.nn.ModuleList(self.stages)
        self.trained = trained

        def make_optimizer(params):   # on a GPU one fused kernel updates every parameter (and m, v) at once
            return torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
                                     fused=self.device.type == "cuda")

        # The replicas are the dp x cp ranks: cp ranks hold the same weights and saw different tokens of the
        # same sequences, so the mean of their gradients is the gradient of the loss over whole sequences.
        # ZeRO and DataParallel broadcast rank 0's weights so that the replicas start identical (they are
        # already: every rank built the model from the same seed). _gradient_sync says how they average.
        self.dp = self.zero = None
        replicas = mesh.dp_cp_group if mesh else None
        if mesh and p.zero_stage == 3:      # chapter 03: parameters gathered unit by unit, prefetched
            self.zero = Zero3(self.model, replicas, optimizer=make_optimizer)
        elif mesh and p.zero_stage:         # chapter 03: this rank's shard of the optimizer state (and gradients)
            self.zero = ZeroOptimizer(trained, replicas, stage=p.zero_stage, optimizer=make_optimizer,
                                      bucket_mb=t.bucket_mb)
        elif mesh and not self.ep_groups and not self.stages:   # chapter 02: bucketed, overlapped all-reduces
            self.dp = DataParallel(self.model, replicas, bucket_mb=t.bucket_mb)
        # The ZeRO object steps its shards with an AdamW of its own, and has the same methods.
        self.optimizer = self.zero or make_optimizer(trained.parameters())
        self.grad_sync = self._gradient_sync()
        self.loader = make_loader(t, dp_rank=mesh.dp_rank if mesh else 0, dp_size=p.dp,
                                  cp_rank=mesh.cp_rank if mesh else 0, cp_size=p.cp, zigzag=p.cp_mode == "zigzag")

    def _gradient_sync(self) -> GradientSync:
        """How this rank's gradients become the mean over their replicas: decided here, once."""
        mesh = self.mesh
        if self.zero:           # ZeRO-1 all-reduces in finish, ZeRO-2/3 reduce-scatter each micro-batch's gradient
            return GradientSync(self.zero.finish_gradient_sync)
        if self.dp:             # bucketed all-reduces overlapped with the last backward; held back while accumulating
            return GradientSync(self.dp.finish_gradient_sync, accumulating=self.dp.no_sync)
        if self.ep_groups:      # each expert over the ranks holding it, the rest over dp x cp (chapter 07)
            return GradientSync(functools.partial(ep.average_gradients, self.model, self.ep_groups))
        if self.stages and mesh.dp_size * mesh.cp_size > 1:   # after the schedule's last backward (chapter 06)
            return GradientSync(functools.partial(all_reduce_gradients, self.trained, mesh.dp_cp_group))
        return GradientSync()   # one process, or no replicas

    def autocast(self) -> ContextManager:
        """The forward's precision: bf16 matmuls under torch.autocast (the weights, their gradients and AdamW's
        state stay fp32: the master copy), or nothing to change in fp32."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def counting(self):
        """Count the collectives of the block into `mesh.counter` (picotron.comm.counting); one process: none."""
        return comm.counting(self.mesh.counter) if self.mesh else nullcontext()

    def _pipeline_step(self, step: int) -> tuple[torch.Tensor, list]:
        """One step of the pipeline schedule; returns the global batch's loss and the sample ids.

        The grad_accum_steps micro-batches are the pipeline's m. Gradients are complete on this rank
        after the schedule; then the tied embedding's two copies (first and last stage) add their
        gradients, and the dp x cp replicas average theirs: once per step, after the last micro-batch.
        """
        p, t, mesh = self.config.parallel, self.config.train, self.mesh
        batches = [self.loader.get_batch(step, micro).to(self.device) for micro in range(t.grad_accum_steps)]
        # What travels between stages: this rank's part of the hidden states, (micro-batch, seq, hidden) with
        # the sequence cut over cp, and over tp too under sequence parallelism.
        seq = t.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
        result = pp.run_schedule(self.schedule, self.stages, mesh, [b.input_ids for b in batches],
                                 [b.targets for b in batches], self.loss_fn,
                                 activation_shape=(t.micro_batch_size, seq, self.config.model.hidden_size),
                                 position_ids=[b.position_ids for b in batches],
                                 autocast_dtype=None if self.compute_dtype == torch.float32 else self.compute_dtype)
        pp.sync_tied_embeddings(self.stages, mesh)
        self._finish_gradient_sync()
        # Only the last stage's rank knows the loss: a sum over the pp group with zeros elsewhere
        # shares it (for the log only: not counted); the dp x cp mean follows in train_step.
        loss = result.loss.detach().clone() if result.loss is not None else torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=mesh.pp_group)
        return loss, [i for b in batches for i in b.sample_ids.tolist()]

    def train_step(self, step: int) -> StepResult:
        """Forward and backward over the micro-batches, average gradients over dp x cp, one AdamW step."""
        with self.counting():
            return self._train_step(step)

    def _train_step(self, step: int) -> StepResult:
        t, start = self.config.train, time.perf_counter()
        self.sync_seconds = 0.0
        if self.zero:
            self.zero.zero_grad()          # ZeRO keeps its gradients in flat buffers: zeroed in place
        else:
            self.optimizer.zero_grad(set_to_none=self.dp is None)  # with dp, .grad are views into buckets
        if self.stages is not None:
            local_loss, sample_ids = self._pipeline_step(step)
        else:
            local_loss, sample_ids = self._accumulate(step)
        if self.mesh:
            # Every cp rank's loss is the mean over as many tokens: their mean is the whole sequences' loss.
            dist.all_reduce(local_loss, group=self.mesh.dp_cp_group)  # for the log only: not counted
            local_loss /= self.mesh.dp_size * self.mesh.cp_size
        grad_norm = self.clip_grad_norm_(t.grad_clip or math.inf)
        return self._optimizer_step(step, local_loss, grad_norm, sample_ids, start)

    def _accumulate(self, step: int) -> tuple[torch.Tensor, list]:
        """Forward and backward of each micro-batch, then the gradients averaged over the replicas."""
        t = self.config.train
        local_loss, sample_ids = torch.zeros((), device=self.device), []
        for micro_step in range(t.grad_accum_steps):
            batch = self.loader.get_batch(step, micro_step).to(self.device)
            last = micro_step == t.grad_accum_steps - 1
            with self.grad_sync.accumulating() if not last else nullcontext():
                with self.autocast():
                    if self.config.model.loss_impl == "chunked":   # head and loss fused: no whole logits (ch. 09)
                        loss = self.model(batch.input_ids, batch.position_ids, batch.targets) / t.grad_accum_steps
                    else:
                        logits = self.model(batch.input_ids, batch.position_ids)   # (batch, seq / cp, vocab / tp)
                        loss = self.loss_fn(logits, batch.targets) / t.grad_accum_steps
                # An MoE model adds its load-balancing loss (0 for a dense one), computed on this rank's tokens
                # as Megatron-LM does; the log shows the language-model loss alone.
                (loss + self.model.aux_loss() / t.grad_accum_steps).backward()
            local_loss += loss.detach()
            sample_ids += batch.sample_ids.tolist()
        self._finish_gradient_sync()   # once, after the last micro-batch
        return local_loss, sample_ids

    def _finish_gradient_sync(self) -> None:
        """grad_sync.finish(), timed as the step's exposed gradient communication: on a GPU after backward's
        kernels have run, so what remains is the all-reduce (or reduce-scatter) time backward did not hide."""
        self._synchronize()
        start = time.perf_counter()
        self.grad_sync.finish()
        self._synchronize()
        self.sync_seconds = time.perf_counter() - start

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- the gradient norm over the whole mesh ---------------------------------------------------------
    def _counted_here(self, param: torch.nn.Parameter) -> bool:
        """Whether this rank counts `param`'s gradient in the global norm (grad_norm.counted_here), except
        the last pp stage's copy of a tied embedding: it is the first stage's matrix again."""
        if id(param) in self._tied_copies:
            return False
        return grad_norm.counted_here(param, self.mesh, sharded_over_dp=self.zero is not None,
                                      ep=self.config.parallel.ep)

    @functools.cached_property
    def _tied_copies(self) -> set[int]:
        if not self.stages:
            return set()
        copies = {id(stage.lm_head.weight) for stage in self.stages if stage.is_last and stage.tied}
        return copies - {id(stage.embed.weight) for stage in self.stages if stage.is_first}  # both here: no copy

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model, however it is split; returns the norm.

        Each rank adds the squares of the gradient elements it counts (_counted_here), one all-reduce
        of a scalar over the world sums them, and every rank scales what it holds by the same factor.
        """
        if self.mesh is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if self.zero:                       # the gradient is in ZeRO's flat shards, not in .grad
            return self.zero.clip_grad_norm_(max_norm, counted=self._counted_here, group=dist.group.WORLD)
        return grad_norm.clip_grad_norm_(self.trained.parameters(), max_norm, counted=self._counted_here)

    def _optimizer_step(self, step: int, loss, grad_norm, sample_ids: list, start: float) -> StepResult:
        lr = lr_at(step, self.config)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._synchronize()
        return StepResult(step, float(loss), lr, float(grad_norm), time.perf_counter() - start, sample_ids,
                          sync_seconds=self.sync_seconds)

    @torch.no_grad()
    def accuracy(self, num_problems: int = 128) -> dict:
        """On held-out sums: answers exactly right (greedy), and answer digits right (teacher forced)."""
        if self.config.train.dataset != "arithmetic" or self.config.train.tokenizer:   # the sums are byte-level
            return {}
        problems = arithmetic_eval_problems(num_problems, seed=self.config.train.seed + 1)
        if self.stages is not None:
            self._gather_pipeline_weights()
        return {"exact": arithmetic_accuracy(self.full_logits, problems, device=self.device),
                "digits": arithmetic_digit_accuracy(self.full_logits, problems, device=self.device)}

    def _gather_pipeline_weights(self) -> None:
        """Give every pp rank the trained weights of every stage (each broadcast from its owner), so
        each can evaluate the whole model by itself. Evaluation only: the ranks still train their own."""
        p, mesh = self.config.parallel, self.mesh
        num_stages = mesh.pp_size * p.pp_virtual_stages
        for s, layers in enumerate(pp.stage_layers(self.config.model.num_layers, num_stages)):
            modules = [self.model.layers[i] for i in layers]
            modules += [self.model.embed] if s == 0 else []
            modules += [self.model.norm, self.model.lm_head] if s == num_stages - 1 else []
            owner = mesh.rank_of(pp=s % mesh.pp_size)
            for module in modules:
                for tensor in module.parameters():
                    dist.broadcast(tensor.data, src=owner, group=mesh.pp_group)

    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) -> (batch, seq, vocab) logits on every rank, for evaluation.

        Under tp the model returns this rank's slice of the vocabulary: all-gather the slices. Under
        sequence parallelism the length must split over tp: pad on the right, which a causal model's
        earlier positions never see, and cut the padding off again. Under cp every rank holds all the
        weights, so each simply runs the whole (short, any-length) sequence itself with context
        parallelism switched off: no padding to 2 cp chunks, no gather, the same logits everywhere.
        """
        with cp.whole_sequence(self.model), self.autocast():   # (nothing to switch off without cp)
            if not (self.mesh and self.mesh.tp_size > 1):
                return self.model(input_ids)
            seq, tp_size = input_ids.shape[1], self.mesh.tp_size
            padded = torch.nn.functional.pad(input_ids, (0, -seq % tp_size))   # (batch, seq rounded up to tp)
            local = self.model(padded)[:, :seq]                                 # (batch, seq, vocab / tp)
            return tp.gather_along(local.contiguous(), -1, self.mesh.tp_group)  # (batch, seq, vocab)


def check_outputs(t: TrainConfig, *, log_file: bool = True) -> None:
    """Raise ValueError naming the fix if t.log_file (when `log_file`: only the logging rank writes it) or
    t.save_dir cannot be written: before step 0, not at the first log line or checkpoint."""
    if t.log_file and log_file:
        try:
            open(t.log_file, "a").close()
        except OSError as error:
            raise ValueError(f"log_file={t.log_file!r} (--log-file) cannot be written: {error.strerror or error}; "
                             f"choose a file in a directory this process may write to") from None
    if t.save_dir:
        checkpoint.check_save_dir(t.save_dir)


def describe(config: Config, world: int, *, distributed: bool = True) -> str:
    """One line: the model's size and how it is split ("model 1.02M parameters, 8 rank(s), dp=2 ZeRO-1 tp=2 ...")."""
    p = config.parallel
    zero = f" ZeRO-{p.zero_stage}" if p.zero_stage and distributed else ""
    tp_text = f" tp={p.tp}{' +SP' if p.sequence_parallel else ''}" if p.tp > 1 else ""
    tp_text += f" pp={p.pp} ({p.pp_schedule})" if p.pp > 1 else ""
    cp_text = f" cp={p.cp} ({p.cp_mode})" if p.cp > 1 else ""
    cp_text += f" ep={p.ep}" if p.ep > 1 else ""
    return (f"model {config.model.num_params() / 1e6:.2f}M parameters, {world} rank(s), "
            f"dp={p.dp}{zero}{tp_text}{cp_text}")


def precision_text(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "fp32"
    return f"{str(dtype).removeprefix('torch.')} matmuls (autocast), fp32 master weights and AdamW state"


class Throughput:
    """The speed figures of a step (docs/design.md, "FLOPs, peaks and MFU").

    tokens_per_s      the global batch's tokens over the step's wall time (the logger's clock)
    per_rank          that over the world size: tokens/s per GPU, comparable across layouts
    mfu               model FLOPs (6N + 12 L h s per token) per second over the ranks' peak
    hfu               hardware FLOPs (adding what recomputation runs again) over the same peak
    sync_s            gradient communication after backward that backward did not hide (exposed)
    peak_memory_gib   the most this rank's GPU held at once (torch's allocator), on a GPU only
    """

    def __init__(self, config: Config, world: int, peak: float, device: torch.device):
        self.tokens_per_step = config.train.tokens_per_step * config.parallel.dp
        self.world, self.peak, self.device = world, peak, device
        self.model_flops = flops_per_token(config.model, config.train.seq_len)
        self.hardware_flops = training_flops_per_token(config.model, config.train.seq_len)
        self.recompute = config.model.recompute != "none"
        self.replicas = config.parallel.dp * config.parallel.cp > 1

    def of(self, result: StepResult) -> dict:
        tokens_per_s = self.tokens_per_step / result.seconds
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {"tokens_per_s": tokens_per_s, "per_rank": tokens_per_s / self.world,
                "mfu": tokens_per_s * self.model_flops / (self.peak * self.world),
                "hfu": tokens_per_s * self.hardware_flops / (self.peak * self.world),
                "step_s": result.seconds, "sync_s": result.sync_seconds, "peak_memory_gib": memory}

    def text(self, f: dict) -> str:
        """The log line's figures: HFU only with recomputation, exposed sync only with replicas, memory on a GPU."""
        line = f"{f['tokens_per_s']:9,.0f} tok/s ({f['per_rank']:,.0f}/rank)  MFU {f['mfu']:6.2%}"
        line += f"  HFU {f['hfu']:6.2%}" if self.recompute else ""
        line += f"  exposed grad sync {f['sync_s'] / f['step_s']:4.0%}" if self.replicas else ""
        return line + (f"  peak mem {f['peak_memory_gib']:.1f} GiB" if f["peak_memory_gib"] is not None else "")


def _first_step(trainer: Trainer, t: TrainConfig, is_logger: bool) -> int:
    """The step to train from: 0, or the resumed checkpoint's. With nothing left to train, says so, and a
    fresh run with save_dir saves its initial state (the state "after the last step")."""
    start = checkpoint.load(trainer, t.resume) if t.resume else 0    # every rank reads its part
    if is_logger and t.resume:
        print(f"resumed from {t.resume} at step {start}")
    if start >= t.steps:   # nothing to train
        initial = os.path.join(t.save_dir, f"step_{start:06d}") if t.save_dir and not t.resume else None
        if is_logger:
            saved = (f"; saving the initial state to {initial}" if initial else
                     f"; no checkpoint written to {t.save_dir} ({t.resume} holds this state)" if t.save_dir else "")
            print(f"steps={t.steps}: nothing to train{f' from step {start}' if t.resume else ''}{saved}")
        if initial:
            checkpoint.save(trainer, initial, start)    # every rank writes its part
    return start


def train(config: Config, *, progress: bool = True) -> dict:
    """Train on this rank (a process group must exist if the world has more than one rank).

    train.steps=0 trains nothing: the initial model is evaluated, and with save_dir saved as
    save_dir/step_000000 (the state "after the last step"). Resumed at or past train.steps, nothing is
    trained or saved either: the checkpoint resumed from holds that state.
    """
    mesh = None
    if dist.is_initialized():
        p = config.parallel
        mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)
    is_logger = mesh is None or mesh.rank == 0
    check_outputs(config.train, log_file=is_logger)   # before building anything
    trainer = Trainer(config, mesh)
    if mesh:
        dist.barrier()  # ranks measure the peak together, so each sees its share of a shared CPU
    peak, peak_source = peak_flops(trainer.device, trainer.compute_dtype)
    world = mesh.world_size if mesh else 1
    rate = Throughput(config, world, peak, trainer.device)
    history = {"loss": [], "tokens_per_s": [], "mfu": [], "hfu": [], "sync_s": [], "peak_source": peak_source}
    if is_logger:
        print(f"{describe(config, world, distributed=mesh is not None)}, {rate.tokens_per_step} tokens per step, "
              f"{precision_text(trainer.compute_dtype)}; MFU against {peak_source} ({peak / 1e9:,.1f} GFLOP/s "
              f"per rank)")
    t = config.train
    if is_logger and config.model.fp8 != "none" and not t.compile:
        print(f"warning: fp8={config.model.fp8!r} without --compile is slower than bf16: eager mode runs each "
              f"scale, cast and scaled matmul as its own kernel (one Float8Linear of width 8192 on an H100: "
              f"0.32-0.52x bf16's speed eager, 1.36-1.64x compiled); add --compile", file=sys.stderr)
    start = _first_step(trainer, t, is_logger)
    log = open(t.log_file, "a") if is_logger and t.log_file else None
    bar = tqdm(range(start, t.steps), disable=not (progress and is_logger), file=sys.stdout,
               mininterval=1.0, ncols=100)
    try:   # closed on an error too: the bar's line ends before the error is printed
        for step in bar:
            result = trainer.train_step(step)
            figures = rate.of(result)
            history["loss"].append(result.loss)
            compiling = t.compile and step == start   # the first step traces and compiles the layers
            if compiling:
                history["compile_s"] = result.seconds
            else:
                for key in ("tokens_per_s", "mfu", "hfu", "sync_s"):
                    history[key].append(figures[key])
            bar.set_postfix(loss=f"{result.loss:.3f}", refresh=False)
            if log:
                log.write(json.dumps({"step": step, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
                                      **figures}) + "\n")
                log.flush()
            last = step == t.steps - 1
            if is_logger and (step % t.log_every == 0 or last):
                speed = (f"compiling: {result.seconds:.1f} s (this first step; not in the speed figures)" if compiling
                         else rate.text(figures))
                bar.write(f"step {step:4d}  loss {result.loss:.4f}  lr {result.lr:.2e}  {speed}")
            if t.save_dir and (last or (t.save_every and (step + 1) % t.save_every == 0)):
                # A new directory per checkpoint: overwriting one in place is not atomic. Every rank writes its part.
                checkpoint.save(trainer, os.path.join(t.save_dir, f"step_{step + 1:06d}"), step + 1)
    finally:
        bar.close()
        if log:
            log.close()
    history["accuracy"] = trainer.accuracy()
    if is_logger and history["accuracy"]:
        print(f"held-out sums (pairs never seen in training): {history['accuracy']['exact']:.1%} answered exactly "
              f"right, {history['accuracy']['digits']:.1%} of answer digits right")
    return history


def main(argv: list[str] | None = None) -> dict:
    """Train with the command line's config: in place for one rank or under torchrun, else on ranks from picotron.launch.

    Errors (see the module docstring) print one line on stderr: bad input exits with status 2 before any
    rank starts; an error while training (here or on a rank) exits with status 1, with a hint to rerun with
    --traceback, which shows the whole traceback instead. Ctrl-C stops quietly (status 130).
    """
    args = build_parser().parse_args(argv)     # argparse prints its own errors (status 2)
    try:
        config = config_of(args)
        validate(config)
        torchrun_world = int(os.environ.get("WORLD_SIZE", "0"))   # set by torchrun for every process it starts
        if torchrun_world and torchrun_world != config.parallel.world_size and not dist.is_initialized():
            p = config.parallel
            raise ValueError(f"torchrun started {torchrun_world} processes but dp*pp*cp*tp = {p.dp}*{p.pp}*{p.cp}*"
                             f"{p.tp} = {p.world_size}; set the sizes to multiply to {torchrun_world} (usually "
                             f"--dp, e.g. --dp {torchrun_world // (p.pp * p.cp * p.tp) or 1}), or start "
                             f"{p.world_size} processes")
        # Only global rank 0 writes the log (under torchrun RANK is set; otherwise this process starts the ranks).
        check_outputs(config.train, log_file=int(os.environ.get("RANK", "0")) == 0)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) if torchrun_world else config.parallel.world_size
        check_inputs(config, ranks_here or config.parallel.world_size)
    except (ValueError, NotImplementedError, OSError, ImportError) as error:
        if args.traceback:
            raise
        print(f"{PROG}: error: {error_line(error)}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        return _run(config)
    except KeyboardInterrupt:   # Ctrl-C: the ranks are stopped already (picotron.launch); nothing to explain
        if args.traceback:
            raise
        raise SystemExit(130) from None
    except Exception as error:  # noqa: BLE001 - every error while training ends on one line (or --traceback)
        if args.traceback:
            raise
        sys.stdout.flush()
        print(f"{PROG}: error: {error_line(error)}\n{PROG}: rerun with --traceback to see where it was raised",
              file=sys.stderr)
        raise SystemExit(1) from None


def _run(config: Config) -> dict:
    """Train: in this process for one rank or under torchrun, else on ranks started by picotron.launch."""
    world = config.parallel.world_size
    progress = sys.stdout.isatty()  # a progress bar in a terminal; plain log lines in a file or CI log
    if world == 1 and not dist.is_initialized():
        return train(config, progress=progress)
    # `python -m picotron.train` runs this file as __main__; the ranks import it by its name instead.
    from picotron.train import train as importable_train
    return launch.run(importable_train, world, args=(config,), kwargs={"progress": progress}, timeout=24 * 3600,
                      seed=config.train.seed, backend=config.train.backend)[0]


if __name__ == "__main__":
    main()

"""Checkpoints: save the training state, resume it exactly, and load it into another layout.

Shown in chapters/08_5d_parallelism.ipynb (resume bit for bit, then in another layout).

A checkpoint written by 4 ranks as dp=2 x tp=2 should load into tp=4, into one process, or into
pp=2: the layout is a property of the run, not of the model. So nothing here is stored as a rank
holds it. Every rank describes its state with the single-process model's parameter names
(`picotron.model.Llama`'s `named_parameters()`, a tied embedding once, as `embed.weight`) and full
logical shapes, and says which part of each full tensor it holds:

    model.<name>              the weight, e.g. model.layers.0.attn.q_proj.weight
    optim.<name>.exp_avg      AdamW's first moment, shaped like the weight
    optim.<name>.exp_avg_sq   AdamW's second moment
    optim.<name>.step         AdamW's step counter (a 0-d tensor)
    progress.step             the training step to resume from

torch.distributed.checkpoint (DCP, https://pytorch.org/docs/stable/distributed.checkpoint.html)
does the rest. `dcp.save` gathers every rank's plan, writes each piece of each tensor once, and
records in `.metadata` which file holds which rectangle of which tensor. `dcp.load` lets every rank
ask for the rectangles it needs in the layout it has now, and reads them from whatever pieces the
saving ranks wrote: that is resharding, for free.

How a rank describes what it holds (the only two cases):

    a whole tensor   a plain torch.Tensor. DCP takes it as the whole of that key; ranks holding
                     the same key (dp and cp replicas, both ends of a tied pipeline, the replicas
                     of an expert) write it once between them. A pp rank simply has no key for
                     another stage's layers, an ep rank none for the experts it does not hold.
    a tp shard       a DTensor (https://pytorch.org/docs/stable/distributed.tensor.html) with
                     placement Shard(dim) on a 1-D DeviceMesh made from picotron's own tp group
                     (DeviceMesh.from_group: no new communicators). Its offset in the full tensor
                     is tp_rank * size / tp along `dim`, exactly the slice that
                     tensor_parallel._shard keeps (both use torch.chunk's split).

ZeRO's flat shards are neither: a rank's slice of a flat buffer cuts parameters at arbitrary
element boundaries, which no rectangle (so no DTensor placement) describes. At save, ZeRO's
ranks all-gather their flat shards of the fp32 master weights and of AdamW's moments, and cut
the result back into one whole tensor per parameter; at load, each rank reads the whole
tensors and keeps its own slice. Readable and exact, at the price of holding the whole
training state on every rank while it saves or loads (12 bytes per parameter in fp32): fine
for the course's models; a production system would write the flat shards as 1-D pieces.

So every layout of the trainer loads every other's checkpoint: one process, dp, cp, tp (+SP),
pp (any schedule, virtual stages), ep, ZeRO-1/2/3, and their compositions (tp x ZeRO, pp x tp x
ZeRO-1, MoE with tp x ep, ...). Refused, with the reason: an optimizer other than Adam/AdamW,
and a parameter that is neither whole nor a tp shard of the single-process one.

Resuming gives the same losses, bit for bit: the loader is a pure function of the step
(`loader.get_batch(step, micro)`), the learning rate too (`lr_at(step)`), the model has no
dropout, and the weights and AdamW's state are restored exactly.

    checkpoint.save(trainer, "ckpt/step_100", step=100)   # after train_step(99): 100 steps done
    start = checkpoint.load(trainer, "ckpt/step_100")     # a new Trainer, any layout: returns 100
    for step in range(start, steps): trainer.train_step(step)

Every rank calls save and load: DCP agrees on its plan with collectives. A trainer without a
mesh (one process) saves and loads alone, whether or not a process group exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from picotron.config import ModelConfig
from picotron.model import Llama
from picotron.parallel.zero import FlatGroup, ZeroOptimizer

__all__ = ["save", "load", "load_model_weights", "read_info", "check_save_dir", "check_checkpoint"]

INFO_FILE = "picotron.json"   # beside DCP's files: the config and layout it was saved from, for people


@dataclass
class ParamState:
    """One parameter's training state as this rank holds it: whole, or its tp shard (never a ZeRO slice)."""

    name: str                  # the single-process model's name
    weight: torch.Tensor       # the parameter (ZeRO: its fp32 master)
    exp_avg: torch.Tensor      # AdamW's moments, shaped like weight
    exp_avg_sq: torch.Tensor
    step: torch.Tensor         # AdamW's step counter, 0-d
    tp_shard_dim: int | None   # the dim the tp ranks split it along; None: whole on every tp rank


# ---- the two entry points ----------------------------------------------------------------------------
def save(trainer, path: str | os.PathLike, step: int) -> None:
    """Write the trainer's weights, optimizer state and `step` (the next step to train) to directory `path`.

    Call it on every rank. Under ZeRO it all-gathers the optimizer shards (see the module docstring).
    """
    states = _param_states(trainer, for_load=False)
    _check_single_process_shapes(states, trainer)
    path = os.fspath(path)
    if _rank(trainer) == 0:   # before dcp.save, whose collectives then keep the others from returning early
        os.makedirs(path, exist_ok=True)
        info = {"step": step, "model": dataclasses.asdict(trainer.config.model),
                "parallel": dataclasses.asdict(trainer.config.parallel)}
        with open(os.path.join(path, INFO_FILE), "w") as f:
            json.dump(info, f, indent=1)
    with _dcp_context(single_process=trainer.mesh is None):
        dcp.save(_as_dcp_state(states, trainer, step), storage_writer=dcp.FileSystemWriter(path),
                 no_dist=trainer.mesh is None)


def check_save_dir(path: str | os.PathLike) -> None:
    """Raise ValueError naming the fix if checkpoints cannot be written under directory `path`.

    Creates the directory (as `save` would) and writes and deletes a probe file in it: a typo, a path
    under a file or a read-only disk then fails before step 0, not at the first checkpoint after hours
    of training. The trainer calls it on every rank (each writes its part of a checkpoint).
    """
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ValueError(f"save_dir={path!r} (--save-dir) cannot be written: {error.strerror or error}; choose "
                         f"a directory this process may create and write to") from None


def load(trainer, path: str | os.PathLike) -> int:
    """Load a checkpoint saved by `save` in any layout into `trainer`; return the step to resume from.

    Call it on every rank, on a trainer that has not trained yet or has (its state is replaced).
    """
    path = os.fspath(path)
    _check_model(_read_metadata(path), trainer.config.model, path)
    states = _param_states(trainer, for_load=True)
    _check_single_process_shapes(states, trainer)
    state = _as_dcp_state(states, trainer, 0)
    # DCP loads in place: every tensor of `state` (for a DTensor, its local shard) is overwritten with
    # its part of the saved tensors. In the plain layouts those are the parameters and AdamW's state
    # themselves; under ZeRO they are fresh whole tensors, cut into the shards below.
    with _dcp_context(single_process=trainer.mesh is None):
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=trainer.mesh is None)
    if _zero_of(trainer):
        _zero_write_back(_zero_of(trainer), {s.name: s for s in states}, _names_of(trainer))
    return int(state["progress"]["step"])


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load only the weights of a checkpoint into a plain single-process model (e.g. a Llama for evaluation).

    Runs in this process alone (no collective), whatever the layout the checkpoint was saved in.
    """
    path = os.fspath(path)
    if hasattr(model, "config") and isinstance(model.config, ModelConfig):
        _check_model(_read_metadata(path), model.config, path)
    weights = {name: p.detach() for name, p in model.named_parameters()}
    with _dcp_context(single_process=True):
        dcp.load({"model": weights}, storage_reader=dcp.FileSystemReader(path), no_dist=True)


def check_checkpoint(path: str | os.PathLike, config: ModelConfig) -> None:
    """Raise FileNotFoundError or ValueError naming the fix unless `path` holds a checkpoint of a model of
    `config` (any layout). Reads only DCP's index: `python -m picotron.train --resume` runs it before any
    rank starts, and `load` runs the same checks."""
    path = os.fspath(path)
    _check_model(_read_metadata(path), config, path)


def read_info(path: str | os.PathLike) -> dict:
    """The step, model config and parallel layout a checkpoint was saved with ({} if it has no info file)."""
    info_path = os.path.join(os.fspath(path), INFO_FILE)
    if not os.path.isfile(info_path):
        return {}
    with open(info_path) as f:
        return json.load(f)


# ---- this rank's state, per parameter -------------------------------------------------------------------
def _zero_of(trainer) -> ZeroOptimizer | None:
    """The trainer's ZeRO optimizer (stages 1-3), if it has one."""
    for candidate in (trainer.zero, trainer.optimizer):
        if isinstance(candidate, ZeroOptimizer):
            return candidate
    return None


def _names_of(trainer) -> dict[int, str]:
    """Parameter identity -> single-process name. Tensor parallelism, pipeline stages and expert
    parallelism keep the plain model's module names, and a tied matrix is one Parameter: `embed.weight`."""
    return {id(p): name for name, p in trainer.model.named_parameters()}


def _name(names: dict[int, str], p: torch.Tensor, trainer) -> str:
    if id(p) not in names:
        raise NotImplementedError(f"the optimizer ({_layout(trainer)}) steps a tensor of shape {tuple(p.shape)} "
                                  f"that is not a parameter of trainer.model, so it has no single-process name; "
                                  f"picotron.checkpoint saves the optimizers that step the model's parameters")
    return names[id(p)]


def _param_states(trainer, for_load: bool) -> list[ParamState]:
    """What this rank trains, per parameter: the parameters its optimizer steps (a pp rank: its stages')."""
    if _zero_of(trainer):
        return _zero_param_states(trainer, for_load)
    optimizer = trainer.optimizer
    _check_adam(optimizer, trainer)
    names = _names_of(trainer)
    states = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            # On load, a trainer that has not stepped yet gets AdamW's initial state (zeros, step 0) to load
            # into: exactly what AdamW would create at its first step. On save it is only read.
            adam = _adam_state(optimizer, p, group, create=for_load)
            states.append(ParamState(_name(names, p, trainer), p.detach(), adam["exp_avg"], adam["exp_avg_sq"],
                                     adam["step"], _tp_dim(trainer, p)))
    return states


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict, create: bool) -> dict:
    """AdamW's state of `p`; its initial value (zeros, step 0) if it has not stepped yet."""
    state = optimizer.state.get(p)
    if state:
        return state
    # Where torch.optim.AdamW keeps the counter: on the device when fused or capturable, else on the CPU.
    on_device = group.get("fused") or group.get("capturable")
    state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if create:
        optimizer.state[p] = state
    return state


def _tp_dim(trainer, p: torch.Tensor) -> int | None:
    tp = trainer.mesh.tp_size if trainer.mesh else 1
    return getattr(p, "tp_shard_dim", None) if tp > 1 else None


def _check_adam(optimizer, trainer) -> None:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise NotImplementedError(f"picotron.checkpoint saves AdamW's state (exp_avg, exp_avg_sq, step); the "
                                  f"trainer's optimizer ({_layout(trainer)}) is a {type(optimizer).__name__}: "
                                  f"use AdamW, or add its state's keys here")
    if any(group.get("amsgrad") for group in optimizer.param_groups):
        raise NotImplementedError("AdamW with amsgrad=True keeps max_exp_avg_sq too, which picotron.checkpoint "
                                  "does not save; use amsgrad=False")


# ---- ZeRO: flat shards <-> whole tensors per parameter -----------------------------------------------
def _zero_param_states(trainer, for_load: bool) -> list[ParamState]:
    """ZeRO-1/2/3: one whole (or tp-shard) tensor per parameter, from the flat shards of every rank.

    Save: all-gather each flat group's fp32 master shard and AdamW moments over the ZeRO group and cut
    them per parameter. Load: zero tensors of those shapes to read into (_zero_write_back slices them).
    """
    zero, names = _zero_of(trainer), _names_of(trainer)
    _check_adam(zero.optimizer, trainer)
    group_of_master = {id(g.master): g for g in zero.groups}
    states = []
    for opt_group in zero.optimizer.param_groups:
        for master in opt_group["params"]:
            g = group_of_master[id(master)]
            adam = _adam_state(zero.optimizer, master, opt_group, create=for_load)
            shards = {"weight": master, "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
            if for_load:   # (N*S,) each, laid out like g.full
                whole = {key: torch.zeros(g.full.numel(), dtype=master.dtype, device=master.device) for key in shards}
            else:
                whole = {key: _all_gather_flat(zero, g, shard) for key, shard in shards.items()}
            for p, offset, view in zip(g.params, g.offsets, g.views):
                cut = {key: flat[offset:offset + view.numel()].view_as(view) for key, flat in whole.items()}
                states.append(ParamState(_name(names, p, trainer), cut["weight"], cut["exp_avg"], cut["exp_avg_sq"],
                                         adam["step"].clone(), _tp_dim(trainer, p)))
    return states


def _all_gather_flat(zero: ZeroOptimizer, g: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
    """(S,) shard of every rank of the ZeRO group -> (N*S,) laid out like g.full. Not counted: not training."""
    if zero.stage == 0:      # stage 0 keeps no shards: the "shard" is the whole buffer
        return shard.detach().clone()
    whole = shard.new_empty(zero.world * g.shard_numel)
    dist.all_gather_into_tensor(whole, shard.detach().contiguous(), group=zero.group)
    return whole


@torch.no_grad()
def _zero_write_back(zero: ZeroOptimizer, states: dict[str, ParamState], names: dict[int, str]) -> None:
    """Put the loaded whole tensors where ZeRO keeps them: its buffers, its master shard, AdamW's state."""
    index = 0 if zero.stage == 0 else zero.rank
    for g in zero.groups:
        mine = [states[names[id(p)]] for p in g.params]
        shard = slice(index * g.shard_numel, (index + 1) * g.shard_numel)

        def flat(key: str) -> torch.Tensor:   # (N*S,) like g.full, zero padding at the end
            parts = [getattr(s, key).reshape(-1) for s in mine]
            pad = parts[0].new_zeros(g.full.numel() - g.numel)
            return torch.cat(parts + [pad])

        weights = flat("weight")
        if zero.stage < 3:
            g.full.copy_(weights)            # the parameters are views of it; every rank keeps all of it
        g.master.copy_(weights[shard])       # fp32 at stages 0-2: the same memory, written again
        if g.shard is not g.master:
            g.shard.copy_(g.master)          # stage 3, or bf16: the model's copy of this rank's shard
        adam = zero.optimizer.state[g.master]
        adam["exp_avg"].copy_(flat("exp_avg")[shard])
        adam["exp_avg_sq"].copy_(flat("exp_avg_sq")[shard])
        adam["step"].copy_(mine[0].step)     # one counter per flat group; its parameters stepped together


# ---- in DCP's terms -----------------------------------------------------------------------------------
@contextmanager
def _dcp_context(single_process: bool):
    """Without a mesh the trainer is one process and DCP must not wait for other ranks (no_dist=True),
    even inside a process group. That is our choice, so DCP's warning about it would only alarm."""
    with warnings.catch_warnings():
        if single_process:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _as_dcp_state(states: list[ParamState], trainer, step: int) -> dict:
    """The nested dict DCP saves or loads: tp shards as DTensors, everything else as whole tensors."""
    tp_mesh = None
    if any(s.tp_shard_dim is not None for s in states):
        # picotron's own tp group as a 1-D mesh: tp rank i holds chunk i, as tensor_parallel._shard cut it.
        tp_mesh = DeviceMesh.from_group(trainer.mesh.tp_group, trainer.device.type, mesh_dim_names=("tp",))

    def logical(t: torch.Tensor, dim: int | None) -> torch.Tensor:
        return t if dim is None else DTensor.from_local(t, tp_mesh, [Shard(dim)], run_check=False)

    return {"model": {s.name: logical(s.weight, s.tp_shard_dim) for s in states},
            "optim": {s.name: {"exp_avg": logical(s.exp_avg, s.tp_shard_dim),
                               "exp_avg_sq": logical(s.exp_avg_sq, s.tp_shard_dim), "step": s.step}
                      for s in states},
            "progress": {"step": torch.tensor(step, dtype=torch.int64)}}


# ---- checks: what the user gets told --------------------------------------------------------------------
def _single_process_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """The plain model's parameter shapes, built on the meta device (no memory, no time)."""
    with torch.device("meta"):
        return {name: p.shape for name, p in Llama(config).named_parameters()}


def _check_single_process_shapes(states: list[ParamState], trainer) -> None:
    """Refuse a layout whose parameters are not whole or tp shards of the single-process ones."""
    expected = _single_process_shapes(trainer.config.model)
    tp = trainer.mesh.tp_size if trainer.mesh else 1
    for s in states:
        shape = list(s.weight.shape)
        if s.tp_shard_dim is not None:
            shape[s.tp_shard_dim] *= tp
        if s.name not in expected or torch.Size(shape) != expected[s.name]:
            raise NotImplementedError(
                f"picotron.checkpoint does not know this layout ({_layout(trainer)}): parameter {s.name} is "
                f"{tuple(s.weight.shape)} on rank {_rank(trainer)}, which is neither the single-process shape "
                f"{tuple(expected[s.name]) if s.name in expected else '(no such parameter)'} nor its tp shard. "
                f"It knows parameters that are whole or split by tp (tp_shard_dim) and ZeRO's flat shards; teach "
                f"_param_states how this layout splits its parameters, or save from one of those")


_PASS_ONE = "pass a directory checkpoint.save wrote (the trainer's --save-dir writes SAVE_DIR/step_NNNNNN)"


def _read_metadata(path: str):
    """DCP's index of the checkpoint at `path`; FileNotFoundError or ValueError naming the fix if there is none."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: the directory does not exist; "
                                + _checkpoints_in(os.path.dirname(os.path.abspath(path))))
    if os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        saved_here = os.path.isfile(os.path.join(folder, ".metadata"))
        raise FileNotFoundError(f"{path!r} is a file, not a checkpoint directory; " + (
            f"pass the checkpoint directory that holds it, {folder}" if saved_here else _checkpoints_in(folder)))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise FileNotFoundError(f"{path!r} holds no checkpoint: DCP's .metadata file is missing (a save that did not "
                                f"finish leaves none either); " + _checkpoints_in(path))
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as error:   # noqa: BLE001 - an empty or cut .metadata raises whatever unpickling meets
        raise ValueError(f"{path!r} has a .metadata file DCP cannot read ({type(error).__name__}: {error}); the save "
                         f"did not finish: resume from an earlier checkpoint") from None


def _checkpoints_in(folder: str) -> str:
    """The end of a message: the checkpoints `folder` holds, to pass one of them, or what to pass."""
    try:
        saved = sorted(name for name in os.listdir(folder) if os.path.isfile(os.path.join(folder, name, ".metadata")))
    except OSError:   # no such folder, or one this process may not list
        saved = []
    if not saved:
        return _PASS_ONE
    shown = ", ".join(saved[-3:]) + (f" (and {len(saved) - 3} earlier)" if len(saved) > 3 else "")
    return f"{folder} holds the checkpoints {shown}: pass one of them, e.g. {os.path.join(folder, saved[-1])}"


def _check_model(metadata, config: ModelConfig, path: str) -> None:
    """Raise ValueError if the checkpoint's weights are not this model's: names and full shapes."""
    expected = {f"model.{name}": shape for name, shape in _single_process_shapes(config).items()}
    saved = {key: md.size for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(md, "size")}
    problems = [f"{key} missing" for key in expected if key not in saved]
    problems += [f"{key} not in this model" for key in saved if key not in expected]
    problems += [f"{key} is {tuple(saved[key])} there, {tuple(shape)} here"
                 for key, shape in expected.items() if key in saved and saved[key] != shape]
    if not problems:
        return
    saved_model = read_info(path).get("model", {})
    recorded = f"{os.path.join(path, INFO_FILE)} records it; " if saved_model else ""
    here = dataclasses.asdict(config)
    differ = [f"{k}={saved_model[k]!r} there, {here[k]!r} here" for k in here
              if k in saved_model and saved_model[k] != here[k]]
    raise ValueError(f"the checkpoint at {path!r} is of a different model: {'; '.join(problems[:4])}"
                     f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. "
                     + (f"Its ModelConfig differs: {'; '.join(differ)}. " if differ else "")
                     + f"Build the model with the config it was saved with ({recorded}on the command line, the "
                       f"same --config, --preset and model flags)")


def _rank(trainer) -> int:
    return trainer.mesh.rank if trainer.mesh else 0


def _layout(trainer) -> str:
    p = trainer.config.parallel
    axes = [f"{axis}={getattr(p, axis)}" for axis in ("pp", "dp", "cp", "tp", "ep") if getattr(p, axis) > 1]
    axes += [f"ZeRO-{p.zero_stage}"] if p.zero_stage else []
    axes += ["sp"] if p.sequence_parallel else []
    return " ".join(axes) or "one process"

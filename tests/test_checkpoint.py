"""Checkpoints: resuming gives the uninterrupted run's losses bit for bit; a checkpoint saved in one layout
loads into another and training continues with the same losses (1e-5); the files hold the single-process
model's names and shapes; bad input is a clear error."""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from picotron import checkpoint
from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.launch import run
from picotron.mesh import Mesh
from picotron.model import Llama
from picotron.parallel.tensor_parallel import gather_parameters
from picotron.train import Trainer

# 8 query and 4 key/value heads: tp=4 divides both (GQA kept).
MODEL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, max_seq_len=64)
MOE = dataclasses.replace(MODEL, num_experts=4, experts_per_token=2, moe_aux_loss_coef=0.05)
STEPS, SAVE_AT = 4, 2      # train 4 steps straight; or 2, save, and 2 more in a new trainer
MICRO = 4                  # sequences per step in all: micro_batch_size = MICRO / dp

LAYOUTS = {   # name: (model, parallel config, grad_accum_steps)
    "one-process": (MODEL, ParallelConfig(), 1),
    "one-process-accum2": (MODEL, ParallelConfig(), 2),
    "dp2": (MODEL, ParallelConfig(dp=2), 1),
    "tp4": (MODEL, ParallelConfig(tp=4), 1),
    "dp2-tp2-sp": (MODEL, ParallelConfig(dp=2, tp=2, sequence_parallel=True), 1),
    "zero1-dp2": (MODEL, ParallelConfig(dp=2, zero_stage=1), 1),
    "dp2-tp2-zero2": (MODEL, ParallelConfig(dp=2, tp=2, zero_stage=2), 2),   # flat shards of tp shards
    "zero3-dp2": (MODEL, ParallelConfig(dp=2, zero_stage=3), 1),
    "dp2-cp2-zero1": (MODEL, ParallelConfig(dp=2, cp=2, cp_mode="zigzag", zero_stage=1), 1),   # ZeRO over dp x cp
    "pp2-dp2": (MODEL, ParallelConfig(dp=2, pp=2), 2),
    "ep2-dp2": (MOE, ParallelConfig(dp=2, ep=2), 1),
    "moe-one-process": (MOE, ParallelConfig(), 1),
}


def config_of(layout: str) -> Config:
    model, parallel, accum = LAYOUTS[layout]
    train = TrainConfig(precision="fp32", micro_batch_size=MICRO // parallel.dp // accum, grad_accum_steps=accum,
                        seq_len=32, steps=STEPS, warmup_steps=2, grad_clip=0.5)
    return Config(model=model, parallel=dataclasses.replace(parallel), train=train)


def new_trainer(config: Config, mesh: Mesh | None = None) -> Trainer:
    p = config.parallel
    if mesh is None and dist.is_initialized():
        mesh = Mesh(dp=p.dp, pp=p.pp, cp=p.cp, tp=p.tp)
    return Trainer(config, mesh)


def train_and_save(config: Config, path: str) -> dict:
    """An uninterrupted run of STEPS steps; then a second trainer trains SAVE_AT steps and saves."""
    straight = new_trainer(config)
    losses = [straight.train_step(step).loss for step in range(STEPS)]
    trainer = new_trainer(config, straight.mesh)
    del straight
    for step in range(SAVE_AT):
        trainer.train_step(step)
    checkpoint.save(trainer, path, SAVE_AT)
    mesh = trainer.mesh
    weights = None
    if not trainer.zero and not trainer.stages and not trainer.ep_groups:
        weights = gather_parameters(trainer.model, mesh.tp_group) if mesh else \
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return {"loss": losses, "weights": weights}


def resume(config: Config, path: str) -> dict:
    """A new trainer (in a new process group when run by `run`): load, then train to STEPS."""
    trainer = new_trainer(config)
    start = checkpoint.load(trainer, path)
    return {"start": start, "loss": [trainer.train_step(step).loss for step in range(start, STEPS)]}


def on_ranks(fn, layout: str, *args):
    """fn(config, *args) on the layout's ranks (rank 0's result), one rank included: gloo ranks on CPUs, so that
    layouts compare bit for bit on any machine (in this process, a one-process run would take a GPU)."""
    config = config_of(layout)
    return run(fn, config.parallel.world_size, args=(config, *args), timeout=120, backend="gloo")[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """layout -> (checkpoint directory, the uninterrupted run's losses and weights), each made once."""
    made = {}

    def get(layout: str):
        if layout not in made:
            path = str(tmp_path_factory.mktemp(layout) / "ckpt")
            made[layout] = path, on_ranks(train_and_save, layout, path)
        return made[layout]
    return get


@pytest.mark.parametrize("layout", ["one-process", "dp2", "dp2-tp2-sp", "zero1-dp2", "dp2-tp2-zero2",
                                    "zero3-dp2", "dp2-cp2-zero1", "pp2-dp2", "ep2-dp2"])
def test_resume_gives_the_uninterrupted_losses_bit_for_bit(saved, layout):
    path, straight = saved(layout)
    resumed = on_ranks(resume, layout, path)
    assert resumed["start"] == SAVE_AT
    assert torch.equal(torch.tensor(resumed["loss"]), torch.tensor(straight["loss"][SAVE_AT:])), \
        (resumed["loss"], straight["loss"])
    assert straight["loss"][-1] < straight["loss"][0]   # it trained


@pytest.mark.parametrize("source, target", [
    ("dp2-tp2-sp", "tp4"),           # tp shards of 2 -> shards of 4
    ("dp2-tp2-sp", "one-process"),   # tp shards -> whole tensors
    ("dp2", "dp2-tp2-sp"),           # whole tensors -> tp shards
    ("pp2-dp2", "one-process-accum2"),   # pipeline stages -> one model (the same micro-batches)
    ("zero3-dp2", "one-process"),    # ZeRO's flat shards -> whole tensors
    ("one-process", "zero1-dp2"),    # whole tensors -> ZeRO's flat shards
    ("ep2-dp2", "moe-one-process"),  # experts spread over ranks -> all in one model
])
def test_a_checkpoint_loads_into_another_layout_and_trains_on_equally(saved, source, target):
    """Same global batch in both layouts, so the continued losses equal the source's uninterrupted run
    (up to summation order: 1e-5)."""
    path, straight = saved(source)
    resumed = on_ranks(resume, target, path)
    assert resumed["start"] == SAVE_AT
    for got, want in zip(resumed["loss"], straight["loss"][SAVE_AT:], strict=True):
        assert abs(got - want) < 1e-5, (resumed["loss"], straight["loss"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")   # DCP in this one process, as meant
def test_the_checkpoint_holds_the_single_process_names_and_shapes(saved):
    path, straight = saved("dp2-tp2-sp")
    plain = Llama(MODEL)
    names = dict(plain.named_parameters())   # the tied embedding once, as embed.weight
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert {k[len("model."):]: md.size for k, md in metadata.items() if k.startswith("model.")} == \
           {n: p.shape for n, p in names.items()}
    for name, p in names.items():
        assert metadata[f"optim.{name}.exp_avg"].size == p.shape
        assert metadata[f"optim.{name}.exp_avg_sq"].size == p.shape
    # Plain DCP reads it into a plain model: the weights the 4 ranks held, gathered.
    dcp.load({"model": {n: p.detach() for n, p in names.items()}}, checkpoint_id=path)
    for name, p in names.items():
        assert torch.equal(p, straight["weights"][name]), name
    again = Llama(MODEL)
    checkpoint.load_model_weights(again, path)
    assert all(torch.equal(p, names[n]) for n, p in again.named_parameters())
    info = checkpoint.read_info(path)
    assert info["step"] == SAVE_AT and info["parallel"]["tp"] == 2 and info["model"]["hidden_size"] == 64


def test_bad_input_is_a_clear_error(saved, tmp_path):
    path, _ = saved("one-process")
    other = dataclasses.replace(config_of("one-process"), model=dataclasses.replace(MODEL, hidden_size=32))
    with pytest.raises(ValueError, match=r"is of a different model: model\.embed\.weight is \(256, 64\) there, "
                                         r"\(256, 32\) here.*hidden_size=64 there, 32 here"):
        checkpoint.load(Trainer(other), path)
    trainer = Trainer(config_of("one-process"))
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*the directory does not exist"):
        checkpoint.load(trainer, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint: DCP's \.metadata file is missing"):
        checkpoint.load(trainer, tmp_path)
    norm = trainer.model.norm.weight
    whole, norm.data = norm.data, norm.data[:32]      # split in a way the checkpoint does not know
    with pytest.raises(NotImplementedError, match=r"does not know this layout \(one process\): parameter "
                                                  r"norm\.weight is \(32,\) on rank 0, .* single-process shape "
                                                  r"\(64,\) nor its tp shard"):
        checkpoint.save(trainer, tmp_path / "odd", 0)
    norm.data = whole
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="saves AdamW's state .* is a SGD: use AdamW"):
        checkpoint.save(trainer, tmp_path / "sgd", 0)

"""The trainer with loss_impl="chunked" (the LM head and the loss fused, picotron/kernels/linear_cross_entropy.py):
it trains as the whole-logits loss does, in one process and with the axes it composes with, and refuses the rest."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from picotron.config import Config, ModelConfig, ParallelConfig, TrainConfig
from picotron.launch import run
from picotron.layout import validate
from picotron.mesh import Mesh
from picotron.parallel.zero3 import Zero3
from picotron.tolerance import ADAM_WEIGHTS_ATOL, LOSS_ATOL
from picotron.train import Trainer
from picotron.train_cli import parse_args

SMALL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=64)
TRAIN = TrainConfig(precision="fp32", micro_batch_size=2, seq_len=32, steps=4, warmup_steps=2)


def losses_and_weights(config: Config, steps: int) -> dict:
    p = config.parallel
    mesh = Mesh(dp=p.dp, cp=p.cp) if dist.is_initialized() else None
    trainer = Trainer(config, mesh)
    losses = [trainer.train_step(step).loss for step in range(steps)]
    weights = (trainer.zero.gather_parameters() if isinstance(trainer.zero, Zero3)
               else {n: w.detach().clone() for n, w in trainer.model.named_parameters()})
    return {"loss": losses, "weights": weights}


def assert_same_training(actual: dict, expected: dict) -> None:
    for step, (a, e) in enumerate(zip(actual["loss"], expected["loss"])):
        assert abs(a - e) < LOSS_ATOL, (step, a, e)
    for name, weight in expected["weights"].items():
        torch.testing.assert_close(actual["weights"][name], weight, rtol=ADAM_WEIGHTS_ATOL, atol=ADAM_WEIGHTS_ATOL)


@pytest.mark.parametrize("tied", [True, False])
def test_one_process_trains_as_with_the_whole_logits(tied):
    model = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    whole = losses_and_weights(Config(model=model, train=TRAIN), 4)
    chunked = losses_and_weights(Config(model=dataclasses.replace(model, loss_impl="chunked",
                                                                  loss_chunk_tokens=24), train=TRAIN), 4)
    assert_same_training(chunked, whole)


@pytest.mark.parametrize("parallel", [ParallelConfig(dp=2, zero_stage=3), ParallelConfig(dp=1, cp=2)],
                         ids=["dp2-zero3", "cp2"])
def test_ranks_with_the_chunked_loss_equal_one_process_with_the_whole_logits(parallel):
    """ZeRO-3 gathers the (tied) head around the fused loss as around the logits; under cp each rank's loss covers
    its own tokens, as the whole-logits loss does."""
    chunked = Config(model=dataclasses.replace(SMALL, loss_impl="chunked", loss_chunk_tokens=16),
                     parallel=parallel, train=TRAIN)
    single = Config(model=SMALL, train=dataclasses.replace(TRAIN, micro_batch_size=TRAIN.micro_batch_size * parallel.dp))
    ranks = run(losses_and_weights, parallel.world_size, args=(chunked, 4), timeout=120, backend="gloo")
    [reference] = run(losses_and_weights, 1, args=(single, 4), timeout=120, backend="gloo")   # where the ranks run
    for rank in ranks:
        assert_same_training(rank, reference)


@pytest.mark.parametrize("argv, message", [
    (["--dp", "1", "--tp", "2", "--loss-impl", "chunked"], "loss_impl='chunked' with tp=2 is not written"),
    (["--dp", "1", "--pp", "2", "--loss-impl", "chunked"], "loss_impl='chunked' with pp=2 is not written"),
])
def test_layouts_it_does_not_compose_with_are_refused(argv, message):
    with pytest.raises(NotImplementedError, match=re.escape(message)):
        validate(parse_args(argv))


def test_command_line_and_bad_values():
    config = parse_args(["--dp", "1", "--loss-impl", "chunked", "--loss-chunk-tokens", "256"])
    assert (config.model.loss_impl, config.model.loss_chunk_tokens) == ("chunked", 256)
    with pytest.raises(ValueError, match="loss_chunk_tokens=0 must be at least 1"):
        validate(parse_args(["--dp", "1", "--loss-impl", "chunked", "--loss-chunk-tokens", "0"]))
    with pytest.raises(ValueError, match="loss_impl='fused'; choose one of"):
        ModelConfig(loss_impl="fused")
        validate(Config(model=ModelConfig(loss_impl="fused")))

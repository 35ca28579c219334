"""picotron.parallel.data_parallel against torch's own DistributedDataParallel."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from picotron.config import ModelConfig
from picotron.launch import run
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import all_reduce_gradients, broadcast_parameters

SMALL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_seq_len=32)


def ours_and_ddp():
    rank = dist.get_rank()
    torch.manual_seed(rank)          # different initial weights on each rank: broadcast must fix that
    ours = Llama(SMALL)
    broadcast_parameters(ours, dist.group.WORLD)
    reference = Llama(SMALL)
    reference.load_state_dict(ours.state_dict())
    ddp = DistributedDataParallel(reference)
    tokens = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(100 + rank))
    for model in (ours, ddp):
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    all_reduce_gradients(ours, dist.group.WORLD)
    return ({n: p.grad for n, p in ours.named_parameters()},
            {n: p.grad for n, p in reference.named_parameters()},
            ours.embed.weight.detach())


def test_gradients_equal_ddp():
    results = run(ours_and_ddp, 3, timeout=60)
    for ours, ddp, embed in results:
        assert ours.keys() == ddp.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], ddp[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(embed, results[0][2], rtol=0, atol=0)  # replicas identical

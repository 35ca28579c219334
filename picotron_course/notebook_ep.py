"""The harness chapter 07 runs, times and draws: expert parallelism's proofs, measurements and figures.

The chapter keeps the technique in its cells (the router, `ep_moe` on picotron's differentiable
all-to-all, which assignment 07 writes) and the asserts of every proof; this module holds what
runs around them, so that the reading path stays idea, key code, proof, measurement:

    on ranks (picotron.launch.run sends them; module functions travel by reference)
        ep_moe_vs_plain    the chapter's ep_moe and picotron's ExpertParallelMoE against one device
        tp_and_ep          dp=2 x tp=2 with ep=2 against the model on one device
        prove              one MoE layer, then training runs of a small Llama in lockstep with one process
                           (picotron.lockstep compares them, and draws the proof's figure)
        train_for_load     tiny-moe trained with and without the balancing loss, the loads recorded
        time_steps         one training step per ep size, split into its phases and timed
    in this process
        moe_roundings      picotron.tolerance's n for one number of an MoE layer, read from its config
        train_proof        the one-process reference of `prove` (the same function, ep=None): its Trace
        summed             collective counts summed over layers, to hold against ep_comm_per_layer
        dropped_fractions  the slots a capacity drops on held-out batches
    figures
        draw_dispatch_example, draw_ep_groups, draw_margins, draw_load, draw_drops, draw_bytes,
        draw_step_times, draw_limits

Generic helpers (caption, sync, max_diff, slowest_median) come from picotron_course.notebook.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from picotron import comm, lockstep, tolerance
from picotron.config import ModelConfig
from picotron.data import DataLoader
from picotron.launch import backend_for, device
from picotron.mesh import Mesh
from picotron.model import Llama, MoE, loss_fn, route
from picotron.parallel.expert_parallel import (ExpertParallelGroups, ExpertParallelMoE, apply_expert_parallel,
                                               average_gradients, expert_parallel_groups)
from picotron.parallel.expert_parallel_costs import ep_comm_bytes
from picotron.parallel.tensor_parallel import (apply_tensor_parallel, gather_gradients,
                                               vocab_parallel_cross_entropy)
from picotron_course.notebook import caption, count_passes, max_diff, no_frame, sync, take_turns

__all__ = ["moe_roundings", "ep_moe_vs_plain", "tp_and_ep", "ProofSetup", "train_proof", "prove", "summed",
           "train_for_load", "dropped_fractions", "time_steps", "expert_params", "draw_dispatch_example",
           "draw_ep_groups", "draw_margins", "draw_load", "draw_drops", "draw_bytes", "draw_step_times", "draw_limits"]


def expert_params(config: ModelConfig) -> int:
    """Parameters in the expert MLPs: E SwiGLU MLPs of 3 h h_ff in every MoE layer."""
    return config.num_moe_layers * config.num_experts * 3 * config.hidden_size * config.intermediate_size


def moe_roundings(config: ModelConfig, tokens: int | None = None) -> int:
    """n of picotron.tolerance for one number an MoE layer (picotron.model.MoE, sizes from `config`) computes:
    the float32 roundings that stand between its input and that number, reduction by reduction.

    Forward, one token's output: the router's matmul over h, the softmax over the E logits, the gates'
    renormalisation over the k chosen, an expert's gate and up projections over h and its down projection
    over h_ff, and the gate-weighted sum of the k outputs:

        h + E + k + h + h_ff + k

    With `tokens` (forward and backward): backward reduces over the same lengths again, and every weight
    gradient sums over the tokens that reached it (at most `tokens`): 2 x forward + tokens.
    """
    h, experts, k = config.hidden_size, config.num_experts, config.experts_per_token
    forward = h + experts + k + h + config.intermediate_size + k
    return forward if tokens is None else 2 * forward + tokens


# ---- 2.4-2.5: the chapter's ep_moe and picotron's layer against one device, on every rank -----------
def ep_moe_vs_plain(ep_moe, layer: ModelConfig, per_rank: int = 10) -> dict:
    """On a rank: `ep_moe(moe, x, group)` (the chapter's) and ExpertParallelMoE on this rank's tokens, against
    the plain MoE run on every rank's tokens in one process. Outputs, input gradients, the local experts'
    and the router's gradients are compared under picotron.tolerance; picotron's layer must equal ep_moe
    bit for bit."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    plain = MoE(layer)                                         # the same weights on every rank
    ours = copy.deepcopy(plain)
    theirs = ExpertParallelMoE(copy.deepcopy(plain), ExpertParallelGroups.from_group())
    generator = torch.Generator().manual_seed(1)               # every rank's tokens and output gradients
    x = torch.randn(world, per_rank, layer.hidden_size, generator=generator)
    grad_out = torch.randn(world, per_rank, layer.hidden_size, generator=generator)
    x_ref = x.clone().requires_grad_()
    y_ref = plain(x_ref.view(-1, layer.hidden_size)).view(x.shape)    # one device, all the tokens
    (y_ref * grad_out).sum().backward()

    x_ours = x[rank].clone().requires_grad_()
    y, send, recv = ep_moe(ours, x_ours, dist.group.WORLD)
    (y * grad_out[rank]).sum().backward()
    local = range(rank * layer.num_experts // world, (rank + 1) * layer.num_experts // world)
    router_grad = ours.router.weight.grad.clone()
    dist.all_reduce(router_grad)                               # each rank holds its tokens' part
    x_theirs = x[rank].clone().requires_grad_()
    y_theirs = theirs(x_theirs)
    (y_theirs * grad_out[rank]).sum().backward()
    n = moe_roundings(layer, tokens=world * per_rank)         # weight gradients sum over every rank's tokens
    ours_grads = {(e, i): p.grad for e in local for i, p in enumerate(ours.experts[e].parameters())}
    plain_grads = {(e, i): p.grad for e in local for i, p in enumerate(plain.experts[e].parameters())}
    return {"send": send, "recv": recv, "output": tolerance.compare(y, y_ref[rank], n=n),
            "input grad": tolerance.compare(x_ours.grad, x_ref.grad[rank], n=n),
            "expert grads": tolerance.compare_all(ours_grads, plain_grads, n=n),
            "router grad": tolerance.compare(router_grad, plain.router.weight.grad, n=n),
            "other experts untouched": all(p.grad is None for e in range(layer.num_experts) if e not in local
                                           for p in ours.experts[e].parameters()),
            "picotron identical": torch.equal(y_theirs, y) and torch.equal(x_theirs.grad, x_ours.grad) and all(
                torch.equal(p.grad, q.grad) for e in local
                for p, q in zip(theirs.experts[str(e)].parameters(), ours.experts[e].parameters())),
            "picotron experts": sorted(int(e) for e in theirs.experts)}


# ---- 2.7: tensor parallelism for attention, EP for the experts ---------------------------------------
def tp_and_ep(config: ModelConfig) -> dict:
    """On 4 ranks, dp=2 x tp=2 with ep=2 carved out of dp: loss and gradients against the model on one device."""
    mesh = Mesh(dp=2, tp=2)                             # tp groups {0, 1} and {2, 3}; dp groups {0, 2} and {1, 3}
    torch.manual_seed(0)
    plain = Llama(config)                               # the same model on every rank: the one-device reference
    model = apply_tensor_parallel(copy.deepcopy(plain), mesh)     # attention split by heads; MoE blocks whole
    groups = expert_parallel_groups(mesh, ep=2)         # per tp coordinate: its 2 dp ranks split the experts
    apply_expert_parallel(model, groups)
    ids = torch.randint(0, config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    mine = ids[2 * mesh.dp_rank:2 * mesh.dp_rank + 2]   # this dp rank's half of the batch (same on its tp ranks)
    loss = vocab_parallel_cross_entropy(model(mine[:, :-1]), mine[:, 1:], mesh.tp_group)
    loss.backward()
    average_gradients(model, groups)                    # experts over their replicas, the rest over dp
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, group=mesh.dp_group)   # the mean of the two halves' means
    reference = loss_fn(plain(ids[:, :-1]), ids[:, 1:])
    reference.backward()
    grads = gather_gradients(model, mesh.tp_group)      # attention shards gathered; experts: this rank's own
    return {"ep group": dist.get_process_group_ranks(groups.ep_group),
            "experts": sorted({int(n.split(".")[4]) for n in grads if ".experts." in n}),
            "loss": abs(global_loss.item() / 2 - reference.item()),
            "grad": tolerance.compare_all(grads, {n: p.grad for n, p in plain.named_parameters() if n in grads},
                                          # float32 round-off: the model's sums, and the mean over the dp ranks
                                          n=tolerance.llama_roundings(config, 16, 4 * 16) + mesh.dp_size)}


# ---- 3: one layer and training runs, EP against one process ------------------------------------------
@dataclass(frozen=True)
class ProofSetup:
    """What section 3 trains: the model, its data, steps, sequences per dp rank, their length, the router's
    initial scale, and {world size (= dp): the ep sizes tried}."""
    config: ModelConfig
    data: object
    steps: int
    batch: int
    seq: int
    router_scale: float
    cases: dict


def _grads_of(module) -> dict:
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _layer_vs_one_device(config: ModelConfig, capacity_factor=None) -> dict:
    """picotron's EP layer, balancing loss on, against the plain MoE: on the global batch (dropless), or with a
    capacity against one device run on each rank's tokens in turn (the capacity applies per rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    hidden = config.hidden_size
    torch.manual_seed(0)
    plain = MoE(dataclasses.replace(config, moe_capacity_factor=capacity_factor))
    layer = ExpertParallelMoE(copy.deepcopy(plain), ExpertParallelGroups.from_group())
    generator = torch.Generator().manual_seed(1)
    x, grad_out = (torch.randn(world, 2, 12, hidden, generator=generator) for _ in range(2))   # 24 tokens per rank
    if capacity_factor is None:            # one device on the global batch, balancing loss included
        x_ref = x.clone().requires_grad_()
        y_ref = plain(x_ref)
        ((y_ref * grad_out).sum() + plain.aux_loss).backward()
        mine, aux_ref, load_ref = y_ref[rank], plain.aux_loss.item(), plain.last_load
    else:                                  # capacity is per rank: one device on each rank's tokens in turn
        dropped, mine = [], None
        for source in range(world):
            y_source = plain(x[source])
            (y_source * grad_out[source]).sum().backward()
            dropped.append(plain.last_dropped)
            mine = y_source if source == rank else mine
    x_local = x[rank].clone().requires_grad_()
    y = layer(x_local)
    aux = layer.aux_loss / world if capacity_factor is None else 0.0
    ((y * grad_out[rank]).sum() + aux).backward()
    grads = _grads_of(layer)
    dist.all_reduce(grads["router.weight"])                     # replicated: the sum of every rank's part
    n = moe_roundings(config, tokens=world * 24)                # weight gradients sum over every rank's 24 tokens
    reference_grads = _grads_of(plain)
    out = {"output": tolerance.compare(y, mine, n=n),
           "expert+router grads": tolerance.compare_all(grads, {k: reference_grads[k] for k in grads}, n=n)}
    if capacity_factor is None:
        aux_sum = layer.aux_loss.detach().clone()
        dist.all_reduce(aux_sum)
        out |= {"input grad": tolerance.compare(x_local.grad, x_ref.grad[rank], n=n),
                "aux": tolerance.compare(aux_sum.item() / world, aux_ref, n=n, dtype=torch.float32),
                "load equal": torch.equal(layer.last_load, load_ref)}
    else:
        out |= {"dropped": layer.last_dropped, "one device dropped": dropped[rank]}
    return out


def train_proof(setup: ProofSetup, dp: int, ep: int | None = None, reference: dict | None = None,
                router_scale: float | None = None) -> dict:
    """One process on the global batch of dp ranks (ep=None), or this rank of dp ranks with ep-way EP.

    The lockstep proof is picotron.lockstep's: one process keeps out["trace"] (every step's loss and gradients,
    the final weights), an EP rank out["lockstep"], compared with reference["trace"] as it trains. A rank holds
    whole tensors under the plain model's names (its experts and the replicated rest), so nothing is gathered:
    the reference is cut to those names (Trace.only), and an EP group's ranks together hold every expert.
    Beside it, every step records each expert's load; one process the routers' logits and the smallest top-k
    margin, an EP rank the largest logit difference from `reference` (the drift, section 3.3) and in step 0
    what its collectives carried."""
    config, steps, batch, seq = setup.config, setup.steps, setup.batch, setup.seq
    top_k = config.experts_per_token
    torch.manual_seed(0)
    model = Llama(config)
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.router.weight.mul_(setup.router_scale if router_scale is None else router_scale)
    logits = []                                           # the routers' logits of this step, layer by layer
    for moe in model.moe_layers():
        moe.router.register_forward_hook(lambda module, inputs, output: logits.append(output.detach()))
    if ep is None:
        loader = DataLoader(setup.data, batch * dp)
    else:
        mesh = Mesh(dp=dp)
        groups = expert_parallel_groups(mesh, ep)
        apply_expert_parallel(model, groups)
        loader = DataLoader(setup.data, batch, dp_rank=mesh.dp_rank, dp_size=dp)
        mine = slice(mesh.dp_rank * batch * seq, (mesh.dp_rank + 1) * batch * seq)   # my tokens in the global batch
    held = dict(model.named_parameters())                 # an EP rank: its experts and the replicated rest
    record = lockstep.Recorder(None if ep is None else reference["trace"].only(held))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    out = {"load": [], "logits": [], "margin": [], "drift": [], "samples": None, "held": sorted(held)}
    for step in range(steps):
        logits.clear()
        data = loader.get_batch(step)
        out["samples"] = out["samples"] or data.sample_ids.tolist()
        loss, counts = count_passes(lambda: loss_fn(model(data.input_ids), data.targets) + model.aux_loss(),
                                    lambda loss: loss.backward())   # every collective of this rank, phase by phase
        if ep is not None:
            with comm.counting() as averaging:
                average_gradients(model, groups)
            if step == 0:
                out |= {"forward comm": counts["forward"], "backward comm": counts["backward"],
                        "sync comm": averaging.snapshot(), "splits": [moe.last_splits for moe in model.moe_layers()]}
            loss = loss.detach().clone()
            dist.all_reduce(loss)                         # the global batch's loss: the mean over the dp ranks
            loss /= dp
        record.step(loss, {n: p.grad for n, p in held.items()})
        out["load"].append([moe.last_load.tolist() for moe in model.moe_layers()])
        if ep is None:
            out["logits"].append([l.clone() for l in logits])
            top = [l.topk(top_k + 1, dim=-1).values for l in logits]            # (tokens, k + 1) per layer
            out["margin"].append(min((t[:, top_k - 1] - t[:, top_k]).min().item() for t in top))
        else:
            out["drift"].append(max(max_diff(l, r[mine]) for l, r in zip(logits, reference["logits"][step])))
        optimizer.step()
        optimizer.zero_grad()
    out["trace" if ep is None else "lockstep"] = record.finish(held)
    if ep is not None:
        out["local experts"] = len(model.moe_layers()[0].experts)
        del out["logits"], out["margin"]
    return out


def prove(setup: ProofSetup, references: dict, unscaled_reference: dict | None = None) -> dict:
    """On each rank: the layer, dropless and with a capacity of 1.0, then a training run per ep size of
    setup.cases[world] against the one-process `references[world]` (train_proof: out[("train", ep)]["lockstep"]);
    with `unscaled_reference`, also dp = ep = world at the default router init, which may part from it."""
    world = dist.get_world_size()
    out = {"dropless": _layer_vs_one_device(setup.config), "capacity": _layer_vs_one_device(setup.config, 1.0)}
    out |= {("train", ep): train_proof(setup, world, ep, references[world]) for ep in setup.cases[world]}
    if unscaled_reference is not None:                    # section 3.3: the same, at the default router init
        out["unscaled"] = train_proof(setup, world, world, unscaled_reference, router_scale=1.0)
    return out


def summed(per_layer: list) -> dict:
    """{op: (calls, bytes)} summed over a list of such dicts (comm.counting snapshots, per-layer formulas)."""
    ops = sorted({op for counts in per_layer for op in counts})
    return {op: tuple(sum(c[op][i] for c in per_layer if op in c) for i in (0, 1)) for op in ops}


# ---- 4.1-4.2: the load per expert, and the drops of a capacity -----------------------------------------
def train_for_load(config: ModelConfig, data, coefs: tuple, steps: int, batch: int) -> dict:
    """On rank r: `config` trained with balancing coefficient coefs[r]; the loads of every step and layer,
    the cross-entropy of every step, and the final weights. The ranks never communicate."""
    coef = coefs[dist.get_rank()]
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(config, moe_aux_loss_coef=coef))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = DataLoader(data, batch)
    loads, ce = [], []
    for step in range(steps):
        data_batch = loader.get_batch(step)
        loss = loss_fn(model(data_batch.input_ids), data_batch.targets)
        (loss + model.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad()
        loads.append(torch.stack([moe.last_load for moe in model.moe_layers()]))    # (layers, E)
        ce.append(loss.item())
    return {"load": torch.stack(loads), "ce": ce, "state": model.state_dict()}


def dropped_fractions(config: ModelConfig, data, state: dict, factors: list, batch: int, seq: int,
                      batches: int = 2) -> list:
    """The fraction of slots each capacity factor drops, on `batches` batches the model did not train on."""
    model = Llama(config)
    model.load_state_dict(state)
    loader = DataLoader(data, batch)
    fractions = []
    for factor in factors:
        for moe in model.moe_layers():
            moe.capacity_factor = factor
        dropped = slots = 0
        with torch.no_grad():
            for i in range(batches):
                model(loader.get_batch(10_000 + i).input_ids)
                dropped += sum(moe.last_dropped for moe in model.moe_layers())
                slots += batch * seq * config.experts_per_token * len(model.moe_layers())
        fractions.append(dropped / slots)
    return fractions


# ---- 4.4: step time against ep ------------------------------------------------------------------------
def time_steps(config: ModelConfig, data, ep_sizes: tuple, batch: int, reps: int = 3) -> dict:
    """On each of dp ranks: per ep size, `reps` timed steps (after a warm-up round), split into forward +
    backward, the gradient averaging and the optimizer; the bytes that left the rank, the rows its experts
    computed, and the collectives of the last step."""
    mesh = Mesh(dp=dist.get_world_size())
    runners = {}
    for ep in ep_sizes:
        torch.manual_seed(0)
        model = Llama(config).to(device())
        groups = expert_parallel_groups(mesh, ep)
        apply_expert_parallel(model, groups)
        runners[ep] = (model, groups, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = DataLoader(data, batch, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    out, rounds = {ep: {} for ep in ep_sizes}, dict.fromkeys(ep_sizes, 0)

    def step(ep) -> tuple:
        model, groups, optimizer = runners[ep]
        step_batch = loader.get_batch(rounds[ep]).to(device())       # round r: the same batch for every ep
        rounds[ep] += 1
        with comm.counting() as counter:                   # this step's collectives
            t0 = time.perf_counter()
            (loss_fn(model(step_batch.input_ids), step_batch.targets) + model.aux_loss()).backward()
            sync()
            t1 = time.perf_counter()
            average_gradients(model, groups)
            sync()
            t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        sync()
        a = next(model.parameters()).element_size()
        out[ep]["leaving"] = sum(2 * (sum(s) - s[groups.ep_rank] + sum(v) - v[groups.ep_rank]) * config.hidden_size
                                 * a for s, v in (moe.last_splits for moe in model.moe_layers()))
        out[ep]["rows"] = sum(sum(moe.last_splits[1]) for moe in model.moe_layers())   # rows my experts computed
        out[ep]["counted"] = counter.snapshot()
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    for ep, runs in take_turns(step, ep_sizes, reps).items():      # in turns; round 0 allocates Adam's state
        out[ep]["times"] = [phases for _, phases in runs]
    return out


# ---- figures ------------------------------------------------------------------------------------------
def draw_dispatch_example() -> dict:
    """Draw one EP layer's dispatch and combine for a real routing: ep = 2 ranks, 4 experts (2 per rank), top-2,
    3 tokens per rank. Returns {rank: rows it received}."""
    import matplotlib.pyplot as plt
    torch.manual_seed(2)
    drawn = MoE(ModelConfig(hidden_size=8, intermediate_size=16, num_experts=4, experts_per_token=2))
    drawn_tokens = torch.randn(2, 3, 8)                                          # (rank, token, h)
    with torch.no_grad():
        homes = [route(drawn.router, drawn_tokens[r], 2) for r in range(2)]     # each rank routes its own tokens
    # Every slot as (home rank, token, expert, gate), in its home rank's expert-sorted order.
    slots = {r: [(r, 3 * r + int(t), int(e), float(g)) for t, g, e in
                 zip(homes[r].token, homes[r].gate, torch.arange(4).repeat_interleave(homes[r].counts))]
             for r in range(2)}
    # Rank q receives, for each of its experts, rank 0's slots then rank 1's.
    received = {q: [s for e in (2 * q, 2 * q + 1) for r in range(2) for s in slots[r] if s[2] == e] for q in range(2)}
    column = {"tokens": 0.0, "slots": 2.2, "received": 5.0, "back": 7.8, "out": 10.0}
    step = 0.55
    band = max(len(rows) for rows in [*slots.values(), *received.values()]) * step + 0.9

    def at(rank, i):
        return -rank * band - i * step

    fig, ax = plt.subplots(figsize=(13, 7))

    def square(x, y, text, colour, alpha=0.85):
        ax.add_patch(plt.Rectangle((x - 0.22, y - 0.2), 0.44, 0.4, facecolor=colour, edgecolor="k", lw=0.6,
                                   alpha=alpha))
        ax.text(x, y, text, ha="center", va="center", fontsize=7.5)

    def link(a, b, colour, lw=0.8, ls="-"):
        ax.plot([a[0] + 0.25, b[0] - 0.25], [a[1], b[1]], color=colour, lw=lw, ls=ls, alpha=0.8, zorder=-1)

    where = {}
    for r in range(2):
        ax.add_patch(plt.Rectangle((-0.6, at(r, 0) - band + 0.75), 11.3, band - 0.3, facecolor="0.96",
                                   edgecolor="0.7", lw=0.8, zorder=-2))
        ax.text(-0.5, at(r, 0) + 0.3, f"rank {r}: experts {2 * r} and {2 * r + 1}", fontsize=9, weight="bold",
                va="bottom")
        for i in range(3):
            square(column["tokens"], at(r, i), f"t{3 * r + i}", "0.8")
            square(column["out"], at(r, i), f"y{3 * r + i}", "0.8")
        for i, s in enumerate(slots[r]):
            where[s] = at(r, i)
            square(column["slots"], at(r, i), f"t{s[1]}", f"C{s[2]}")
            square(column["back"], at(r, i), f"t{s[1]}", f"C{s[2]}", alpha=0.45)
            link((column["tokens"], at(r, s[1] - 3 * r)), (column["slots"], at(r, i)), "0.5")
            link((column["back"], at(r, i)), (column["out"], at(r, s[1] - 3 * r)), "0.3", lw=0.5 + 2.5 * s[3])
    for q in range(2):
        for i, s in enumerate(received[q]):
            square(column["received"], at(q, i), f"t{s[1]}", f"C{s[2]}")
            link((column["slots"], where[s]), (column["received"], at(q, i)), f"C{s[2]}", lw=1.2)
            link((column["received"], at(q, i)), (column["back"], where[s]), f"C{s[2]}", lw=1.2, ls="--")
        for e in (2 * q, 2 * q + 1):
            rows = [i for i, s in enumerate(received[q]) if s[2] == e]
            if rows:
                top, bottom = at(q, rows[0]) + 0.28, at(q, rows[-1]) - 0.28
                ax.add_patch(plt.Rectangle((column["received"] + 0.3, bottom), 0.12, top - bottom, color=f"C{e}"))
                ax.text(column["received"] + 0.5, (top + bottom) / 2, f"expert {e}\n{len(rows)} rows", fontsize=7.5,
                        va="center")
    titles = {"tokens": "this rank's tokens", "slots": "1. route, sort the\nslots by expert (top-2)",
              "received": "2.-3. counts, all-to-all to the\nexperts' rank; experts compute",
              "back": "4. reverse all-to-all:\noutputs back home", "out": "5. sum weighted\nby the gates"}
    for key, x in column.items():
        ax.text(x, 1.05, titles[key], ha="center", va="bottom", fontsize=8.5)
    ax.set(xlim=(-0.7, 10.8), ylim=(at(1, 0) - band + 0.6, 1.9), xticks=[], yticks=[],
           xlabel="one MoE layer, forward from left to right",
           title="Expert parallelism, ep = 2: dispatch and combine (a real routing of 6 tokens over 4 experts)")
    no_frame(ax)
    caption(fig, f"Colour = expert. Solid: the dispatch all-to-all, dashed: the return all-to-all; the last lines' "
            f"width is the gate. The splits are uneven: rank 0 computes {len(received[0])} rows, rank 1 "
            f"{len(received[1])}, because the router sent more slots to experts 0 and 1.")
    plt.show()
    return {q: len(rows) for q, rows in received.items()}


def draw_ep_groups() -> None:
    """dp = 4, ep = 2: the EP groups and the expert-data-parallel groups over 4 ranks and 8 experts."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 3.4))
    for r in range(4):
        x0 = r * 2.6
        ax.add_patch(plt.Rectangle((x0, 0), 2.2, 2.2, facecolor="white", edgecolor="k", lw=1))
        ax.text(x0 + 1.1, 2.0, f"rank {r} (dp rank {r})", ha="center", va="top", fontsize=9, weight="bold")
        ax.add_patch(plt.Rectangle((x0 + 0.15, 1.05), 1.9, 0.5, facecolor="0.85", edgecolor="0.4"))
        ax.text(x0 + 1.1, 1.3, "attention, norms, router:\nall replicated", ha="center", va="center", fontsize=7)
        for j in range(4):                                    # experts 4*(r%2) ... 4*(r%2)+3
            e = 4 * (r % 2) + j
            ax.add_patch(plt.Rectangle((x0 + 0.15 + j * 0.48, 0.2), 0.42, 0.6, facecolor=f"C{e}", alpha=0.8))
            ax.text(x0 + 0.36 + j * 0.48, 0.5, str(e), ha="center", va="center", fontsize=8)
    for g, (left, right) in enumerate(((-0.1, 4.9), (5.1, 10.1))):
        ax.add_patch(plt.Rectangle((left, -0.15), right - left, 2.55, fill=False, ls="--", lw=1.2, edgecolor="C3"))
        ax.text((left + right) / 2, 2.45, f"EP group {g}: all 8 experts, tokens exchanged by all-to-all",
                ha="center", va="bottom", fontsize=8, color="C3")
    for a, b, lift in ((0, 2, 0.45), (1, 3, 0.9)):
        xa, xb = a * 2.6 + 1.1, b * 2.6 + 1.1
        ax.plot([xa, xa, xb, xb], [-0.2, -0.2 - lift, -0.2 - lift, -0.2], color="C0", lw=1.2)
        ax.text((xa + xb) / 2, -0.25 - lift, f"same experts: expert gradients all-reduced over ranks {{{a}, {b}}}",
                ha="center", va="top", fontsize=7.5, color="C0")
    ax.set(xlim=(-0.3, 10.3), ylim=(-1.5, 2.9), xticks=[], yticks=[], xlabel="4 data-parallel ranks, E = 8 experts",
           title="dp = 4, ep = 2: EP groups (red) and expert-data-parallel groups (blue)")
    no_frame(ax)
    caption(fig, "Each EP group splits the 8 experts over its 2 ranks; the non-expert weights are averaged over all 4 "
            "ranks, the expert weights only over the 2 ranks holding them (numbers: expert ids).")
    plt.show()


def draw_margins(scaled: tuple, unscaled: tuple, loss_gap: dict, flips: list, steps: int) -> None:
    """Left: the smallest top-k margin and the EP-vs-one-process drift of the logits, per step, for the scaled
    and the default router init ((margins, drifts) each); right: how far the two runs' losses end up."""
    import matplotlib.pyplot as plt
    import numpy as np
    fig, (ax_m, ax_l) = plt.subplots(1, 2, figsize=(12, 3.9))
    x = np.arange(steps)
    for name, (margin, drift), colour in (("x 10", scaled, "C0"), ("x 1", unscaled, "C3")):
        ax_m.semilogy(x, margin, "o-", ms=3, color=colour, label=f"smallest margin, router init {name}")
        ax_m.semilogy(x[1:], drift[1:], "s--", ms=3, color=colour, alpha=0.6,
                      label=f"drift EP vs one process, init {name}")
    ax_m.set(xlabel="step", ylabel="router logits (log scale)", title="Smallest top-2 margin vs drift, dp = ep = 2")
    ax_m.legend(fontsize=7, loc="lower right")
    for name, colour in (("x10", "C0"), ("x1", "C3")):
        ax_l.semilogy(x, np.maximum(loss_gap[name], 1e-9), "o-", ms=3, color=colour,
                      label=f"router init {name.replace('x', 'x ')}")
    ax_l.axhline(1e-5, color="k", ls=":", lw=1, label="tolerance 1e-5")
    ax_l.set(xlabel="step", ylabel="|loss EP - loss one process|", title="How far the two runs end up")
    ax_l.legend(fontsize=7)
    caption(fig, "Left: a token can change expert when the drift (dashed) reaches the smallest margin (solid). The "
            "scaled router keeps its margins far above the drift" + (f"; at the default init the margin fell under the "
            f"drift at step {flips[0]}." if flips else "; at the default init they come closer.") + " Right: once a "
            "token routes differently, the runs separate by far more than rounding, without any bug (an exact 0 is "
            "drawn at 1e-9).")
    plt.show()


def draw_load(max_over_mean: dict, load: dict, late: dict, experts: int, top_k: int, steps: int) -> None:
    """Left: max/mean load per step for each balancing coefficient; right: the last 10 steps' load per expert,
    busiest first."""
    import matplotlib.pyplot as plt
    import numpy as np
    coefs = list(max_over_mean)
    fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(12, 4))
    for coef, colour in zip(coefs, ("C3", "C0")):
        m = max_over_mean[coef].numpy()
        ax_t.plot(m.mean(1), "-", color=colour, lw=2, label=f"λ = {coef}: mean over the 4 layers")
        ax_t.fill_between(np.arange(len(m)), m.min(1), m.max(1), color=colour, alpha=0.15,
                          label=f"λ = {coef}: layer range")
    ax_t.axhline(1, color="k", ls=":", lw=1)
    ax_t.axhline(experts / top_k, color="k", ls="--", lw=1)
    ax_t.text(steps * 0.5, experts / top_k + 0.05, "every token to the same 2 experts (E/k)", fontsize=7, va="bottom")
    ax_t.text(steps * 0.6, 1.05, "perfectly balanced", fontsize=7, va="bottom")
    ax_t.set(xlabel="training step", ylabel="max / mean slots per expert", ylim=(0, 4.6),
             title="Load imbalance during training (tiny-moe)")
    ax_t.legend(fontsize=6.5, loc="lower left", ncol=2)
    width, idle = 0.4, {}
    for i, (coef, colour) in enumerate(zip(coefs, ("C3", "C0"))):
        # Each layer's experts sorted from busiest to idlest, averaged over layers and the last 10 steps.
        shares = (load[coef][-10:] / load[coef][-10:].sum(-1, keepdim=True)).sort(-1, descending=True).values
        idle[coef] = int((shares.mean((0, 1)) < 0.01).sum())
        ax_h.bar(np.arange(experts) + (i - 0.5) * width, shares.mean((0, 1)).numpy(), width, color=colour, alpha=0.85,
                 label=f"λ = {coef}")
    ax_h.axhline(1 / experts, color="k", ls=":", lw=1, label="balanced, 1/E")
    ax_h.set(xticks=range(experts), xticklabels=[f"#{j + 1}" for j in range(experts)],
             xlabel="experts of a layer, busiest first", ylabel="share of the layer's slots",
             title="Load per expert, last 10 steps")
    ax_h.legend(fontsize=7)
    off, on = coefs
    caption(fig, f"Early on every token looks alike to the router and both runs pile onto two experts per layer. "
            f"Without the balancing loss it stays that way (max/mean {late[off]:.1f}; {idle[off]} of {experts} experts "
            f"get under 1% of the slots); with it the router spreads the slots as the representations differentiate "
            f"(max/mean {late[on]:.1f}).")
    plt.show()


def draw_drops(drops: dict, factors: list, late: dict, experts: int, top_k: int, steps: int) -> None:
    """The measured fraction of slots dropped against the capacity factor, beside the balanced and the collapsed
    limits."""
    import matplotlib.pyplot as plt
    import numpy as np
    coefs = list(drops)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    factor_axis = np.linspace(0.25, 4.2, 200)
    ax.plot(factor_axis, np.maximum(0, 1 - factor_axis), "k:", label="perfectly balanced: max(0, 1 - γ)")
    ax.plot(factor_axis, 1 - np.minimum(1, factor_axis * top_k / experts), "k--",
            label="collapsed on k experts: 1 - min(1, γk/E)")
    for coef, colour in zip(coefs, ("C3", "C0")):
        ax.plot(factors, drops[coef], "o-", color=colour, label=f"measured, trained with λ = {coef}")
    ax.set(xlabel="capacity factor γ", ylabel="fraction of slots dropped", ylim=(-0.02, 1),
           title=f"Dropped slots vs capacity factor (tiny-moe after {steps} steps)")
    ax.legend(fontsize=7)
    at = {f: {coef: drops[coef][factors.index(f)] for coef in coefs} for f in (1.0, 2.0)}
    off, on = coefs
    caption(fig, f"The collapsed router follows the collapsed limit: it needs γ = E/k = 4 to drop nothing. The one "
            f"trained with the balancing loss (max/mean {late[on]:.1f}, still far from 1) drops {at[1.0][on]:.0%} at "
            f"γ = 1, {at[2.0][on]:.1%} at γ = 2; the collapsed one {at[1.0][off]:.0%} and {at[2.0][off]:.0%}.")
    plt.show()


def draw_bytes(bytes_table: dict, trained: list, layers: int, tokens: int, hidden: int, top_k: int) -> None:
    """Counted all-to-all bytes per rank of one training step, beside the formula 4Tkha per layer."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 3.8))
    ticks, labels, x = [], [], 0.0
    for i, (world, ep) in enumerate(trained):
        first_x = x
        for rank in range(world):
            payload, leaving, _ = bytes_table[world, ep, rank]
            ax.bar(x, payload / 1024, 0.8, color=f"C{i}", alpha=0.35,
                   label="payload (own rows included)" if x == 0 else None)
            ax.bar(x, leaving / 1024, 0.8, color=f"C{i}", alpha=0.9,
                   label="of which leaves the rank" if x == 0 else None)
            ticks.append(x)
            labels.append(f"rank {rank}")
            x += 1
        formula = layers * ep_comm_bytes(tokens, hidden, top_k, ep) / 1024
        ax.plot([first_x - 0.45, x - 0.55], [formula] * 2, "k-", lw=2,
                label="formula 4Tkha x layers (group mean)" if i == 0 else None)
        ax.plot([first_x - 0.45, x - 0.55], [formula * (ep - 1) / ep] * 2, "k:", lw=1.5,
                label="x (ep-1)/ep: what leaves a rank if balanced" if i == 0 else None)
        ax.text((first_x + x - 1) / 2, formula * 1.18, f"dp = {world}, ep = {ep}", ha="center", fontsize=8)
        x += 0.8
    ax.set_xticks(ticks, labels, fontsize=7)
    top = layers * ep_comm_bytes(tokens, hidden, top_k, 2) / 1024 * 1.75
    ax.set(ylabel="KiB per rank, one training step", ylim=(0, top),
           title=f"Token all-to-alls of a training step ({layers} MoE layers, T = {tokens} tokens per rank, fp32)")
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    caption(fig, "Counted per rank: the payload varies with the routing (a rank holding popular experts receives "
            "more), but its mean over an EP group is exactly 4Tkha per layer, at any ep; the part that leaves the rank "
            "grows as (ep-1)/ep.")
    plt.show()


def draw_step_times(phase_ms: dict, phases: tuple, all_reduce_bytes: dict, batch: int, seq: int, ranks: int) -> None:
    """Stacked bars: each phase of a step (slowest rank, median) per ep size; `all_reduce_bytes`: {ep: bytes}."""
    import matplotlib.pyplot as plt
    import numpy as np
    ep_sizes = list(phase_ms)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    bottom = np.zeros(len(ep_sizes))
    for p, (name, colour) in enumerate(zip(phases, ("C0", "C3", "C2"))):
        values = np.array([phase_ms[ep][p] for ep in ep_sizes])
        ax.bar([str(ep) for ep in ep_sizes], values, 0.6, bottom=bottom, color=colour, alpha=0.85, label=name)
        bottom += values
    for i in range(len(ep_sizes)):
        ax.text(i, bottom[i], f"{bottom[i]:.0f} ms", ha="center", va="bottom", fontsize=8)
    where = (f"gloo, {ranks} CPU processes on {os.cpu_count()} cores" if backend_for(ranks) == "gloo" else "NCCL")
    ax.set(xlabel=f"expert-parallel size ep (dp = {ranks} ranks in every case)", ylabel="time per step (ms)",
           ylim=(0, bottom.max() * 1.2), title=f"tiny-moe, {batch} x {seq} tokens per rank ({where})")
    ax.legend(fontsize=7, loc="upper right")
    first, last = ep_sizes[0], ep_sizes[-1]
    noise = " (CPU processes: expect tens of percent from run to run)" if backend_for(ranks) == "gloo" else ""
    caption(fig, f"Slowest rank per phase, median of 3 steps{noise}. ep = {first} all-reduces "
            f"every expert's gradient ({all_reduce_bytes[first] / 2**20:.1f} MiB); ep = {last} only the rest "
            f"({all_reduce_bytes[last] / 2**20:.1f} MiB) and its Adam updates 1/{last} of the experts, but its forward "
            "and backward wait for the all-to-alls and for the busiest rank.")
    plt.show()


def draw_limits(ratio, shapes: dict, ep_only: dict, zero1: dict, gpu_gb: float) -> None:
    """Left: all-to-all time over expert compute, `ratio(h_ff, ep)`, for each {name: h_ff}; right: GB per GPU of
    Mixtral's training state against ep, EP alone ({ep: GB}) and with ZeRO-1 ({ep: GB})."""
    import matplotlib.pyplot as plt
    import numpy as np
    eps = np.array([2, 4, 8, 16, 32, 64])
    fig, (ax_c, ax_m) = plt.subplots(1, 2, figsize=(13, 4.2))
    for (name, h_ff), colour in zip(shapes.items(), ("C0", "C3")):
        values = [ratio(h_ff, int(ep)) for ep in eps]
        ax_c.loglog(eps, values, "o-", color=colour, label=name)
        for ep, r in zip(eps, values):
            ax_c.annotate(f"{r:.2f}", (ep, r), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7,
                          color=colour)
    ax_c.axhline(1, color="k", lw=1)
    ax_c.text(2.1, 1.1, "all-to-all = expert compute", fontsize=7)
    ax_c.axvspan(8.5, 80, color="0.93", zorder=-1)
    ax_c.text(10, 0.006, "beyond one 8-GPU node:\nInfiniBand, 45 GB/s", fontsize=7)
    ax_c.minorticks_off()
    ax_c.set(xticks=eps, xticklabels=eps, xlabel="expert-parallel size ep (GPUs)",
             ylabel="all-to-all time / expert compute time",
             title="Can the all-to-alls hide? bf16, 400 TFLOP/s (computed)", ylim=(0.004, 5))
    ax_c.legend(fontsize=7, loc="upper left")
    eps_m = list(ep_only)
    ax_m.plot(eps_m, list(ep_only.values()), "o-", color="C1", label="EP alone: 16 (dense + experts/ep)")
    ax_m.plot(eps_m, list(zero1.values()), "s-", color="C2", label="EP + ZeRO-1 over 64 GPUs")
    ax_m.axhline(gpu_gb, color="k", ls="--", lw=1, label="one H100, 79.6 GiB (85.5 GB)")
    for values in (ep_only, zero1):
        for ep, v in values.items():
            ax_m.annotate(f"{v:.0f}", (ep, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax_m.set(xscale="log", xticks=eps_m, xticklabels=eps_m, xlabel="expert-parallel size ep", ylabel="GB per GPU",
             title="Mixtral-8x7B: weights, gradients, Adam state per GPU (bf16 mixed)", ylim=(0, 820))
    ax_m.minorticks_off()
    ax_m.legend(fontsize=7)
    caption(fig, "Computed. Left: inside a node the all-to-alls cost a few percent of the expert compute; across nodes "
            "Mixtral's reach a quarter of it and DeepSeek-V3's narrow experts exceed it. Right: EP divides only the "
            "experts' 97%; at ep = 8 Mixtral's state still needs 116 GB per GPU, and ZeRO-1 over the data-parallel "
            "ranks brings it to 38 GB.")
    plt.show()

"""picotron.parallel.pipeline_parallel and pipeline_schedules: every schedule trains exactly like one
process, matches torch's Schedule1F1B, and its measured bubble and memory are the textbook ones.

One launch of 4 ranks runs everything that needs ranks: 20 AdamW steps of every schedule at pp=4
(interleaved with v=2) and at dp=2 x pp=2 (a data-parallel all-reduce after the last micro-batch),
compared step by step with one process on the same global batch; torch.distributed.pipelining's
Schedule1F1B at both sizes; and a pipeline of stages that only sleep, whose measured bubble is the
schedule's and not the CPU's (4 ranks share 2 cores). Schedules, the simulator and the errors are
checked without ranks.
"""

import dataclasses
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from picotron import comm
from picotron.config import ModelConfig, TrainConfig
from picotron_course.checks import one_thread
from picotron.data import DataLoader, TokenDataset, build_dataset
from picotron.launch import run
from picotron.lockstep import Recorder, Trace
from picotron.mesh import Mesh
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import all_reduce_gradients
from picotron.parallel.pipeline_parallel import (Timeline, build_stages, run_schedule, split_microbatches,
                                                 stage_parameters, sync_tied_embeddings)
from picotron.parallel.pipeline_schedules import (Action, Schedule, bubble_formula, bubble_fraction, check_schedule,
                                                  make_schedule, peak_in_flight, simulate, stage_layers)
from picotron.tolerance import ADAM_WEIGHTS_ATOL, LOSS_ATOL, compare_all, llama_roundings

# 8 layers: pp=4 with v=2 interleaved chunks gets one layer per chunk.
CONFIG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, max_seq_len=16)
STEPS, BATCH, SEQ = 20, 16, 16                    # BATCH: the global batch, over all dp ranks
# name: (micro-batches, virtual stages) by pp
SCHEDULES = {4: {"naive": (1, 1), "afab": (8, 1), "1f1b": (8, 1), "interleaved": (8, 2), "zb-h1": (8, 1)},
             2: {"naive": (1, 1), "afab": (4, 1), "1f1b": (4, 1), "interleaved": (4, 2), "zb-h1": (4, 1)}}
LAYOUTS = {4: dict(pp=4), 2: dict(dp=2, pp=2)}    # both on 4 ranks
TORCH_STEPS = 3
# Roundings behind any gradient of the model (picotron.tolerance, bound 8 sqrt(n) u scale).
MODEL_N = llama_roundings(CONFIG, SEQ, BATCH * SEQ)


@functools.cache
def dataset() -> TokenDataset:
    """Built once; run() sends it to the ranks with the function that uses it."""
    return build_dataset(TrainConfig(seq_len=SEQ))


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


# ---- one process: the reference ------------------------------------------------------------------------------
def train_one_process(config: ModelConfig = CONFIG) -> Trace:
    """STEPS AdamW steps on the whole global batch: every step's loss and gradients, the final weights."""
    torch.manual_seed(0)
    model = Llama(config)
    optimizer = adamw(model.parameters())
    loader = DataLoader(dataset(), BATCH)
    record = Recorder()
    for step in range(STEPS):
        batch = loader.get_batch(step)
        loss = loss_fn(model(batch.input_ids), batch.targets)
        loss.backward()
        record.step(loss, {n: p.grad for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return record.finish(dict(model.named_parameters()))


@pytest.fixture(scope="module")
def one_process() -> Trace:
    with one_thread():   # like each rank
        return train_one_process()


# ---- on the ranks: 20 steps of each schedule ------------------------------------------------------------------
def pipeline_step(schedule, stages, mesh, batch, ready=None, observer=None):
    """One optimizer step's gradients: the schedule, the tied-embedding sum, the dp average. Returns the
    schedule's result and what the schedule and the tied-embedding sum sent (not the dp all-reduce)."""
    m = schedule.num_microbatches
    with comm.counting() as counted:
        result = run_schedule(schedule, stages, mesh, split_microbatches(batch.input_ids, m),
                              split_microbatches(batch.targets, m), loss_fn,
                              (batch.input_ids.shape[0] // m, SEQ, CONFIG.hidden_size), on_grads_ready=ready,
                              observer=observer)
        sync_tied_embeddings(stages, mesh)
    all_reduce_gradients(nn.ModuleList(stages), mesh.dp_group)   # once, after the last micro-batch
    return result, counted


def global_loss(result, mesh) -> float:
    """The step's loss on every rank: the last stage's, averaged over dp (not counted: for the test only)."""
    loss = result.loss if result.loss is not None else torch.zeros(())
    dist.all_reduce(loss)                       # over pp: only the last stage's is non-zero
    return loss.item() / mesh.dp_size


def train_pipeline(mesh: Mesh, name: str, num_microbatches: int, virtual: int, reference: Trace) -> dict:
    """STEPS steps of one schedule, compared with the one-process `reference` step by step here, in the rank
    (picotron.lockstep): out["lockstep"]. A stage holds whole parameters, so nothing is gathered: this rank's
    gradients and weights are held against the reference's of the same names (the tied matrix under
    "embed.weight" on both its ends), and the ranks together cover the model."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    names = {p: n for n, p in model.named_parameters()}
    stages = build_stages(model, mesh.pp_rank, mesh.pp_size, virtual)
    params = stage_parameters(stages)
    mine = {names[p]: p for p in params}
    record = Recorder(reference.only(mine))   # the reference, cut to this rank's stages
    optimizer = adamw(params)
    schedule = make_schedule(name, mesh.pp_size, num_microbatches, virtual)
    loader = DataLoader(dataset(), BATCH // mesh.dp_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    out = {"samples": []}
    for step in range(STEPS):
        batch = loader.get_batch(step)
        ready, timeline = ([], Timeline()) if step == 0 else (None, None)
        on_ready = (lambda stage: ready.append((stage, time.perf_counter()))) if step == 0 else None
        result, counted = pipeline_step(schedule, stages, mesh, batch, on_ready, timeline)
        if step == 0:
            out["counted"] = counted.snapshot()
            out["ready"] = ready
            out["events"] = timeline.events
            out["peak"] = timeline.peak_activations
        out["samples"].append(batch.sample_ids.tolist())
        record.step(global_loss(result, mesh), {n: p.grad for n, p in mine.items()})
        optimizer.step()
        optimizer.zero_grad()
    out["lockstep"] = record.finish(mine)
    out["stages"] = [stage.index for stage in stages]
    ends = [s.embed.weight for s in stages if s.is_first] + [s.lm_head.weight for s in stages if s.is_last]
    out["tied copy"] = ends[0].detach().clone() if ends else None   # the embedding's copy on this rank
    return out


def torch_1f1b(mesh: Mesh, num_microbatches: int) -> dict:
    """Ours and torch.distributed.pipelining's Schedule1F1B side by side, a few AdamW steps (untied model)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    config = dataclasses.replace(CONFIG, tie_word_embeddings=False)
    models, stages, optimizers = {}, {}, {}
    for who in ("ours", "torch"):
        torch.manual_seed(0)
        models[who] = Llama(config)
        stages[who] = build_stages(models[who], mesh.pp_rank, mesh.pp_size)
        optimizers[who] = adamw(stage_parameters(stages[who]))
    theirs = Schedule1F1B(PipelineStage(stages["torch"][0], mesh.pp_rank, mesh.pp_size, torch.device("cpu"),
                                        group=mesh.pp_group), num_microbatches, loss_fn=loss_fn)
    schedule = make_schedule("1f1b", mesh.pp_size, num_microbatches)
    loader = DataLoader(dataset(), BATCH // mesh.dp_size, dp_rank=mesh.dp_rank, dp_size=mesh.dp_size)
    out = {"loss": [], "grads": []}
    for step in range(TORCH_STEPS):
        batch = loader.get_batch(step)
        ours, _ = pipeline_step(schedule, stages["ours"], mesh, batch)
        losses = []
        if mesh.is_first_stage:
            theirs.step(batch.input_ids)
        elif mesh.is_last_stage:
            theirs.step(target=batch.targets, losses=losses)   # grads already scaled by 1/m (scale_grads)
        else:
            theirs.step()
        all_reduce_gradients(nn.ModuleList(stages["torch"]), mesh.dp_group)
        if mesh.is_last_stage:
            out["loss"].append(abs(ours.loss.item() - sum(loss.item() for loss in losses) / num_microbatches))
        pairs = list(zip(stage_parameters(stages["ours"]), stage_parameters(stages["torch"])))
        out["grads"].append(compare_all({i: a.grad for i, (a, _) in enumerate(pairs)},    # the same ops on the
                                        {i: b.grad for i, (_, b) in enumerate(pairs)}, n=MODEL_N))   # same weights
        for who in ("ours", "torch"):
            optimizers[who].step()
            optimizers[who].zero_grad()
    out["weights"] = max((a - b).abs().max().item() for a, b in pairs)
    return out


# ---- on the ranks: stages that only sleep ----------------------------------------------------------------------
# A stage's forward of one micro-batch; its backward sleeps twice as long. Long beside a hop (a gloo send, ~1 ms
# idle, 10 ms and more on a loaded machine: at 60 ms, 12 test workers on 16 cores put interleaved 14 % over).
FORWARD_S = 0.1


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepStage(nn.Module):
    """A stage whose cost is a fixed wait, not compute: 4 ranks on 2 cores then measure the schedule."""

    def __init__(self, index: int, num_stages: int, seconds: float):
        super().__init__()
        self.index, self.num_stages, self.seconds = index, num_stages, seconds
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return Sleep.apply(x * self.weight, self.seconds)


def sleeping_pipeline(mesh: Mesh) -> dict:
    """Measured timelines of AFAB, 1F1B and interleaved. Per schedule: one step that does not sleep (a
    process's first backward starts autograd's machinery, hundreds of ms), then two that do; the faster
    is kept, as timeit keeps its fastest run: other processes on the machine only ever add time."""
    out = {}
    for name, m, v in (("afab", 4, 1), ("1f1b", 4, 1), ("interleaved", 4, 2)):
        schedule = make_schedule(name, mesh.pp_size, m, v)
        inputs, targets = [torch.ones(1, 4) for _ in range(m)], [None] * m
        steps = []
        for seconds in (0.0, FORWARD_S / v, FORWARD_S / v):   # an interleaved chunk: half a rank's layers
            stages = [SleepStage(s, schedule.num_stages, seconds)
                      for s in range(mesh.pp_rank, schedule.num_stages, mesh.pp_size)]
            dist.barrier()   # start together: the step's time is the same for every rank
            timeline = Timeline()
            run_schedule(schedule, stages, mesh, inputs, targets, lambda y, t: y.sum(), (1, 4), observer=timeline)
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, timeline.events)
            steps.append([e for rank in everyone for e in rank])
        out[name] = min(steps[1:], key=lambda events: max(e.end for e in events) - min(e.start for e in events))
    return out


def all_cases(reference: Trace) -> dict:
    out = {}
    for pp, layout in LAYOUTS.items():
        mesh = Mesh(**layout)
        out[pp] = {name: train_pipeline(mesh, name, m, v, reference) for name, (m, v) in SCHEDULES[pp].items()}
        out[pp]["torch"] = torch_1f1b(mesh, SCHEDULES[pp]["1f1b"][0])
        out[pp]["coords"] = mesh.coords
        if pp == 4:
            out["sleep"] = sleeping_pipeline(mesh)
    return out


@pytest.fixture(scope="module")
def ranks(one_process) -> list[dict]:
    return run(all_cases, 4, args=(one_process,), timeout=300)


CASES = [(pp, name) for pp in SCHEDULES for name in SCHEDULES[pp]]


@pytest.mark.parametrize("pp, name", CASES, ids=[f"pp{pp}-{name}" for pp, name in CASES])
def test_schedule_trains_like_one_process(pp, name, ranks, one_process):
    results = [rank[pp][name] for rank in ranks]
    for rank, result in enumerate(results):   # every rank: the loss, its stages' gradients and weights, every step
        result["lockstep"].assert_equal(f"rank {rank} of pp={pp}, {name}")
    copies = [rank["tied copy"] for rank in results if rank["tied copy"] is not None]
    assert len(copies) == 2 * (4 // pp)   # first and last stage of each pipeline: still one matrix
    for copy in copies:
        torch.testing.assert_close(copy, copies[0], rtol=0, atol=0)
    assert sorted(s for rank in results for s in rank["stages"]) == sorted(
        s for s in range(pp * SCHEDULES[pp][name][1]) for _ in range(4 // pp))   # every stage, once per dp replica
    if pp == 2:   # the two dp replicas saw different halves of the batch, together the whole one
        by_dp = {rank[pp]["coords"]["dp"]: rank[pp][name]["samples"] for rank in ranks}
        assert all(set(by_dp[0][step]).isdisjoint(by_dp[1][step]) for step in range(STEPS))
    assert one_process.loss[-1] < one_process.loss[0] - 0.5   # and it learned something


@pytest.mark.parametrize("pp", [4, 2])
def test_equals_torch_schedule_1f1b(pp, ranks):
    for rank in ranks:
        result = rank[pp]["torch"]
        for step, grads in enumerate(result["grads"]):
            assert grads, f"step {step}: {grads}"
        assert result["weights"] < ADAM_WEIGHTS_ATOL and all(error < LOSS_ATOL for error in result["loss"]), result
    assert sum(len(rank[pp]["torch"]["loss"]) for rank in ranks) == TORCH_STEPS * (4 // pp)   # last stages compared


@pytest.mark.parametrize("pp, name", CASES, ids=[f"pp{pp}-{name}" for pp, name in CASES])
def test_measured_activations_equal_the_schedule(pp, name, ranks):
    m, v = SCHEDULES[pp][name]
    expected = peak_in_flight(make_schedule(name, pp, m, v))
    for rank in ranks:
        assert rank[pp][name]["peak"] == expected[rank[pp]["coords"]["pp"]]
    if name == "afab":
        assert expected == [m] * pp                        # GPipe holds every micro-batch
    if name == "1f1b":
        assert expected == [pp - r for r in range(pp)]     # 1F1B at most p - r


@pytest.mark.parametrize("pp, name", CASES, ids=[f"pp{pp}-{name}" for pp, name in CASES])
def test_counted_sends_and_grads_ready(pp, name, ranks):
    """Per step a rank sends one activation per micro-batch and chunk boundary it feeds and one gradient
    per boundary it drains, (micro_batch, seq, hidden) fp32 each; first and last stage add the tied
    embedding's gradient once. on_grads_ready fires once per stage, after its last gradient step."""
    m, v = SCHEDULES[pp][name]
    schedule = make_schedule(name, pp, m, v)
    activation = (BATCH // (4 // pp)) // m * SEQ * CONFIG.hidden_size * 4
    embedding = CONFIG.vocab_size * CONFIG.hidden_size * 4
    for rank in ranks:
        r, result = rank[pp]["coords"]["pp"], rank[pp][name]
        sends = sum((a.op == "F" and a.stage < pp * v - 1) + (a.op == "B" and a.stage > 0)
                    for a in schedule.actions[r])
        receives = sum((a.op == "F" and a.stage > 0) + (a.op == "B" and a.stage < pp * v - 1)
                       for a in schedule.actions[r])
        tied = r in (0, pp - 1)
        assert result["counted"] == {"send": (sends + tied, sends * activation + tied * embedding),
                                     "recv": (receives, 0)}
        assert sorted(stage for stage, _ in result["ready"]) == result["stages"]   # once per stage
        for stage, when in result["ready"]:   # after the stage's last gradient step
            assert when >= max(e.end for e in result["events"] if e.stage == stage and e.op in "BW")


@pytest.mark.parametrize("name", ["afab", "1f1b", "interleaved"])
def test_sleeping_stages_measure_the_textbook_bubble(name, ranks):
    """Stages that sleep F = 100 ms (50 ms per interleaved chunk) forward and twice that backward: the
    measured idle fraction is the formula's within 10 % (relative), on every rank."""
    events = ranks[0]["sleep"][name]   # every rank's events of the kept step
    v = 2 if name == "interleaved" else 1
    formula = bubble_formula(name, 4, 4, v)
    measured = bubble_fraction(events)
    assert all(abs(b - formula) < 0.1 * formula for b in measured), (measured, formula)
    assert all(e.end - e.start >= FORWARD_S / v * (1 if e.op == "F" else 2) for e in events)


# ---- without ranks: the schedules' structure -------------------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_simulated_bubble_is_the_formula(pp, m):
    """Unit costs (F=1, B=1, W=1; a full backward B+W=2): AFAB and 1F1B idle (p-1)/(m+p-1) exactly,
    interleaved (p-1)/(v m+p-1), ZB-H1 (p-1)/(3m+p-1) once the pipeline is full."""
    for name in ("afab", "1f1b"):
        bubbles = bubble_fraction(simulate(make_schedule(name, pp, m)))
        assert bubbles == pytest.approx([bubble_formula(name, pp, m)] * pp, abs=1e-12), name
    if m % pp == 0:
        for v in (2, 3):
            bubbles = bubble_fraction(simulate(make_schedule("interleaved", pp, m, v), 1 / v, 1 / v, 1 / v))
            assert bubbles == pytest.approx([bubble_formula("interleaved", pp, m, v)] * pp, abs=1e-12)
    if m >= pp:
        for f, b, w in ((1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5)):
            bubbles = bubble_fraction(simulate(make_schedule("zb-h1", pp, m), f, b, w))
            assert bubbles == pytest.approx([bubble_formula("zb-h1", pp, m, f=f, b=b, w=w)] * pp, abs=1e-12)
    if pp > 1 and m >= pp:   # ZB-H1's bubble is a third of 1F1B's at F=B=W
        assert bubble_formula("zb-h1", pp, m) < bubble_formula("1f1b", pp, m)
        assert bubble_formula("zb-h1", pp, m) * (3 * m + pp - 1) == pytest.approx(pp - 1)


def test_naive_schedule_idles_all_but_one_stage():
    for pp in (2, 4):
        assert bubble_fraction(simulate(make_schedule("naive", pp, 1))) == pytest.approx([(pp - 1) / pp] * pp)


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_peak_memory_of_each_schedule(pp):
    m = 2 * pp
    assert peak_in_flight(make_schedule("afab", pp, m)) == [m] * pp
    assert peak_in_flight(make_schedule("1f1b", pp, m)) == [pp - r for r in range(pp)]
    assert peak_in_flight(make_schedule("zb-h1", pp, m)) == [pp] * pp          # 1F1B's peak, on every rank
    # Interleaved: more micro-batches in flight, each a chunk of 1/v of the rank's layers.
    interleaved = peak_in_flight(make_schedule("interleaved", pp, m, 2))
    assert interleaved[0] == min(2 * (pp - 1) + pp + 1, 2 * m) and interleaved[-1] == pp + 1


def test_one_f_one_b_structure():
    schedule = make_schedule("1f1b", 4, 6)
    assert str(schedule).splitlines()[0] == "rank 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert str(schedule).splitlines()[3] == "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    interleaved = make_schedule("interleaved", 2, 2, 2)   # rank 0 holds stages 0 and 2
    assert str(interleaved).splitlines()[0] == "rank 0: F0@0 F1@0 F0@2 F1@2 B0@2 B1@2 B0@0 B1@0"
    zb = make_schedule("zb-h1", 2, 3)                    # rank 1's W lags its B by one micro-batch
    assert str(zb).splitlines()[1] == "rank 1: F0 B0 F1 B1 W0 F2 B2 W1 W2"


def test_simulated_timeline_is_a_gantt_chart():
    events = simulate(make_schedule("1f1b", 2, 2))        # F=1, full backward 2
    assert [(e.rank, e.op, e.microbatch, e.start, e.end) for e in sorted(events, key=lambda e: (e.rank, e.start))] == [
        (0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 4, 6), (0, "B", 1, 7, 9),
        (1, "F", 0, 1, 2), (1, "B", 0, 2, 4), (1, "F", 1, 4, 5), (1, "B", 1, 5, 7)]
    slower = bubble_fraction(simulate(make_schedule("interleaved", 4, 8, 2), 0.5, 0.5, 0.5, p2p=0.1))
    assert min(slower) > bubble_formula("interleaved", 4, 8, 2)  # each of the v times more sends costs


def test_stage_split():
    assert stage_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]   # extra layers to the first stages
    model = Llama(CONFIG)
    stages = build_stages(model, 1, 4, virtual_stages=2)                   # stages 1 and 5 of 8
    assert [s.index for s in stages] == [1, 5] and [list(s.layer_ids) for s in stages] == [[1], [5]]
    first, last = build_stages(model, 0, 2)[0], build_stages(model, 1, 2)[0]
    assert first.embed is model.embed and first.lm_head is None and first.tied
    assert last.lm_head is model.lm_head and last.embed is None and list(last.layer_ids) == [4, 5, 6, 7]
    tokens = torch.randint(0, 256, (2, SEQ))
    torch.testing.assert_close(last(first(tokens)), model(tokens), rtol=0, atol=0)


def test_one_rank_holding_every_stage_is_the_model():
    """pp=1: interleaved with 4 chunks on the one rank (activations handed over locally, the tied weight
    shared by the first and last chunk) and ZB-H1, also under full recomputation (untied: a weight two
    modules share on one rank is refused)."""
    def step():
        mesh = Mesh()
        tokens = torch.randint(0, 256, (4, SEQ + 1))
        inputs, targets = split_microbatches(tokens[:, :-1], 2), split_microbatches(tokens[:, 1:], 2)
        errors = {}
        for name, virtual, tied, recompute in (("interleaved", 4, True, "none"), ("zb-h1", 1, False, "none"),
                                               ("zb-h1", 1, False, "full"), ("zb-h1", 1, True, "none")):
            torch.manual_seed(0)
            model = Llama(dataclasses.replace(CONFIG, tie_word_embeddings=tied, recompute=recompute))
            reference = Llama(model.config)
            reference.load_state_dict(model.state_dict())
            loss_fn(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
            stages = build_stages(model, 0, 1, virtual)
            try:
                run_schedule(make_schedule(name, 1, 2, virtual), stages, mesh, inputs, targets, loss_fn,
                             (2, SEQ, CONFIG.hidden_size))
            except ValueError as error:
                errors[(name, tied)] = str(error)
                continue
            sync_tied_embeddings(stages, mesh)                       # a no-op here
            grads = compare_all({n: p.grad for n, p in model.named_parameters()},
                                {n: q.grad for n, q in reference.named_parameters()},
                                n=llama_roundings(model.config, SEQ, 4 * SEQ))   # float32 round-off only
            assert grads, f"{name}: {grads}"
        for schedule, stages in ((make_schedule("1f1b", 2, 2), build_stages(model, 0, 1)),
                                 (make_schedule("interleaved", 1, 2, 4), build_stages(model, 0, 1))):
            try:
                run_schedule(schedule, stages, mesh, inputs, targets, loss_fn, (2, SEQ, CONFIG.hidden_size))
            except ValueError as error:
                errors[schedule.name] = str(error)
        return errors
    errors = run(step, 1, timeout=60)[0]
    assert list(errors) == [("zb-h1", True), "1f1b", "interleaved"]
    assert errors["1f1b"] == "the schedule is for pp=2 but the mesh has pp=1"
    assert errors["interleaved"].startswith("pp rank 0 must hold stages [0, 1, 2, 3] of 4 for this schedule, got "
                                            "[(0, 1)]; build them with build_stages(model, 0, 1, virtual_stages=4)")
    assert errors[("zb-h1", True)].startswith("stage 0's lm_head shares a weight with stage 0's embed on this rank")


def test_observer_sees_every_action_in_order():
    """The executor only runs the actions; an observer is told before and after each one, in the
    schedule's order, with the graphs in flight after it (as peak_in_flight counts them)."""
    def step():
        tokens = torch.randint(0, 256, (4, SEQ + 1))
        schedule = make_schedule("interleaved", 1, 2, 2)
        calls = []

        class Recorder:
            def before(self, rank, action):
                calls.append(("before", rank, action))

            def after(self, rank, action, in_flight):
                calls.append(("after", rank, action, in_flight))

        run_schedule(schedule, build_stages(Llama(CONFIG), 0, 1, 2), Mesh(), split_microbatches(tokens[:, :-1], 2),
                     split_microbatches(tokens[:, 1:], 2), loss_fn, (2, SEQ, CONFIG.hidden_size), observer=Recorder())
        return calls
    calls = run(step, 1, timeout=60)[0]
    actions = make_schedule("interleaved", 1, 2, 2).actions[0]
    alive = [sum((a.op == "F") - (a.op == "B") for a in actions[:k + 1]) for k in range(len(actions))]
    assert calls == [call for a, n in zip(actions, alive) for call in (("before", 0, a), ("after", 0, a, n))]
    assert max(alive) == peak_in_flight(make_schedule("interleaved", 1, 2, 2))[0]


# ---- clear errors ----------------------------------------------------------------------------------------------
def test_clear_errors():
    model = Llama(CONFIG)
    with pytest.raises(ValueError, match=r"pp=16 x virtual_stages=1 = 16 stages need at least 16 layers.*num_layers=8"):
        build_stages(model, 0, 16)
    with pytest.raises(ValueError, match=r"pp=4 x virtual_stages=3 = 12 stages"):
        build_stages(model, 0, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="unknown schedule 'gpipe2'; choose one of naive, afab, 1f1b"):
        make_schedule("gpipe2", 4, 8)
    with pytest.raises(ValueError, match=r"groups of pp=4: num_microbatches=6 is not a multiple of 4; use 4 or 8"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 is for the interleaved schedule only"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match=r"naive schedule runs the whole batch at once \(num_microbatches=1, got 4\)"):
        make_schedule("naive", 4, 4)
    with pytest.raises(ValueError, match="a batch of 6 does not split into 4 equal micro-batches"):
        split_microbatches(torch.zeros(6, 3), 4)
    with pytest.raises(ValueError, match=r"ZB-H1 formula assumes a full pipeline \(m >= p, got m=2, p=4\)"):
        bubble_formula("zb-h1", 4, 2)
    assert make_schedule("gpipe", 2, 2).actions == make_schedule("afab", 2, 2).actions   # GPipe is AFAB


def test_broken_schedules_are_refused():
    """A hand-written schedule (the assignment's) is checked before it can hang the ranks."""
    good = make_schedule("1f1b", 2, 2).actions
    with pytest.raises(ValueError, match=r"missing \['B1@1'\]"):
        check_schedule(Schedule("mine", 2, 2, 1, [good[0], good[1][:-1]]))
    with pytest.raises(ValueError, match="runs stage 1, which lives on rank 1"):
        check_schedule(Schedule("mine", 2, 2, 1, [good[0] + [Action("F", 0, 1)], good[1]]))
    backward_first = [Action("B", 0, 1), Action("F", 0, 1), Action("F", 1, 1), Action("B", 1, 1)]
    with pytest.raises(ValueError, match=r"deadlocks.*1: 'B0@1'"):
        check_schedule(Schedule("mine", 2, 2, 1, [good[0], backward_first]))
    swapped = [Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1)]   # receives out of order
    with pytest.raises(ValueError, match=r"rank 0 sends to rank 1 in the order \[\('activation', 0, 0\)"):
        check_schedule(Schedule("mine", 2, 2, 1, [good[0], swapped]))

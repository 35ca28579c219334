"""picotron.profiling reads a torch.profiler trace: gloo- and NCCL-shaped traces built by hand, then real ones
from DataParallel on gloo ranks, with and without overlap."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from picotron import profiling
from picotron.config import ModelConfig
from picotron.launch import run
from picotron.model import Llama, loss_fn
from picotron.parallel.data_parallel import DataParallel
from picotron_course.checks import one_thread


def span(name, ts, dur, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


MARKS = [span("forward", 0, 100, "user_annotation"), span("backward", 100, 200, "user_annotation"),
         span("finish_gradient_sync", 300, 50, "user_annotation"), span("optimizer", 350, 50, "user_annotation")]


def gloo_trace():
    return {"traceEvents": MARKS + [
        span("autograd::engine::evaluate_function: MmBackward0", 110, 40),
        span("autograd::engine::evaluate_function: MulBackward0", 160, 130),
        span("autograd::engine::evaluate_function: MmBackward0", 50, 10),      # in forward: not backward's
        span("c10d::allreduce_", 150, 2),                                       # a launch, not the work
        span("gloo:all_reduce", 155, 60, "user_annotation"),
        span("gloo:all_reduce", 320, 20, "user_annotation"),
        span("gloo:broadcast", 200, 5, "user_annotation"),                      # another collective
        {"ph": "M", "name": "thread_name", "args": {"name": "gloo"}}]}


def nccl_trace():
    return {"traceEvents": MARKS + [
        span("cudaLaunchKernel", 120, 5, "cuda_runtime", correlation=1),
        span("cudaLaunchKernel", 130, 5, "cuda_runtime", correlation=2),
        span("cudaLaunchKernel", 50, 5, "cuda_runtime", correlation=3),        # launched in forward
        span("cuLaunchKernelEx", 140, 5, "cuda_driver", correlation=4),
        span("nccl:all_reduce", 141, 3, "user_annotation"),                     # the CPU side of the launch
        span("gemm_kernel", 200, 40, "kernel", correlation=1, stream=7),
        span("elementwise_kernel", 240, 70, "kernel", correlation=2, stream=7),  # ends after the mark
        span("gemm_kernel", 150, 30, "kernel", correlation=3, stream=7),         # runs in backward's time
        span("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 260, 80, "kernel", correlation=4, stream=20),
        span("backward", 200, 110, "gpu_user_annotation")]}


def test_gloo_trace_reads_worker_spans_and_autograd_nodes():
    step = profiling.read_step(gloo_trace())
    assert step.device == "cpu"
    assert step.backward_ops == [(0.11, 0.15), (0.16, 0.29)]
    assert step.all_reduces == [(0.155, 0.215), (0.32, 0.34)]
    assert step.backward_end == 0.29 and step.started_during_backward == 1
    assert step.hidden_share == pytest.approx(60 / 80)
    assert step.marks["optimizer"] == (0.35, 0.4)


def test_nccl_trace_reads_kernels_by_where_they_were_launched():
    step = profiling.read_step(nccl_trace())
    assert step.device == "cuda"
    assert step.backward_ops == [(0.2, 0.24), (0.24, 0.31)]          # not the forward's kernel, not NCCL's
    assert step.all_reduces == [(0.26, 0.34)]                         # the kernel, not nccl:all_reduce
    assert step.backward_end == 0.31 and step.started_during_backward == 1


def test_other_collectives_are_asked_for_by_name():
    assert profiling.collectives(gloo_trace(), "broadcast") == [(200, 205)]
    assert profiling.collectives(nccl_trace(), "all_gather") == []


def test_a_trace_without_the_marks_is_refused():
    with pytest.raises(ValueError, match="record_function"):
        profiling.read_step({"traceEvents": MARKS[:2]})


def _profiled(path, overlap):
    torch.manual_seed(0)
    model = Llama(ModelConfig())
    dp = DataParallel(model, dist.group.WORLD, bucket_mb=0.5, overlap=overlap)
    ids = torch.randint(0, 256, (2, 33))

    def step():
        with record_function("forward"):
            loss = loss_fn(model(ids[:, :-1]), ids[:, 1:])
        with record_function("backward"):
            loss.backward()
        with record_function("finish_gradient_sync"):
            dp.finish_gradient_sync()
        with record_function("optimizer"):
            model.zero_grad(set_to_none=False)

    with one_thread():
        step()                                                        # warm-up
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    prof.export_chrome_trace(f"{path}_{dist.get_rank()}.json")
    return len(dp.buckets)


@pytest.mark.parametrize("overlap", [True, False])
def test_real_gloo_traces_show_overlap_only_with_overlap(tmp_path, overlap):
    buckets = run(_profiled, 2, args=(str(tmp_path / "trace"), overlap))
    for rank in range(2):
        step = profiling.read_step(json.loads((tmp_path / f"trace_{rank}.json").read_text()))
        assert len(step.all_reduces) == buckets[rank] > 1
        assert (step.started_during_backward > 0) == overlap

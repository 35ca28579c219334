"""Triton kernels: vector add, row softmax, RMSNorm forward and backward, FlashAttention.

Chapter: chapters/09_gpu_kernels.ipynb.

A kernel is one program written for a *block* of data; the GPU runs a grid of copies of it, one
per block, on its streaming multiprocessors. Each kernel file holds one kernel family in numbered
versions, from the plainest to the one that moves the fewest bytes, each checked against torch
(tests/test_kernels.py) and timed (benchmarks/kernels.py). One naming scheme, as llm.c's dev/cuda:
version N of a kernel is `<name>_kernel_vN`, launched from Python by `<name>_vN`; each file's
docstring lists its versions and what each changes from the one before.

    add.py          z = x + y: add_v1 blocks and masks, add_v2 thread coarsening, add_v3 autotuning
    row_softmax.py  softmax_v1 one row per program, softmax_v2 many rows, softmax_v3 online for long rows;
                    `softmax` picks v2 or v3
    rmsnorm.py      rmsnorm_forward_v1, rmsnorm_forward_v2, rmsnorm_backward_v1; `rmsnorm` (autograd), and
                    `TritonRMSNorm`, a drop-in for picotron.model.RMSNorm (same `weight`, `eps`, state dict)
    attention.py    causal FlashAttention: attention_forward_v1, _v2 (TMA), _v3 (autotuned), _v4 (fewer FP32
                    operations per score), attention_backward_v1, _v2 (TMA), _v3 (P^T directly, autotuned);
                    `flash_attention`
    attention_tma.py  the kernels of its versions that move tiles by TMA (tensor descriptors): forward v2 to v4,
                    backward v2, v3
    flash_attention_torch.py  the same algorithm (FlashAttention-2) tile by tile in plain torch, no Triton:
                    `FlashAttention2`, an autograd.Function with a hand-written tiled backward
    report.py       python -m picotron.kernels.report: each version compiled for an H100 without one (registers,
                    spills, shared memory, wgmma / TMA / load instructions counted in the SASS)
    runtime.py      where the kernels run: the Triton interpreter on a CPU (set up there), compiled on a GPU
    gpu.py          what a GPU is made of (H100/H200 figures), the roofline, memory transactions
    timing.py       one timer for both machines: CUDA events on a GPU, a CPU clock otherwise

This package file imports nothing: import what you use from the file that defines it, e.g.
`from picotron.kernels.rmsnorm import TritonRMSNorm`. The kernel files import runtime.py first, which
chooses the interpreter when there is no GPU; nothing in picotron/kernels/ imports the rest of picotron,
and the rest of picotron imports the kernels only inside the function that needs them (triton stays out
of every process that does not ask for a kernel).
"""

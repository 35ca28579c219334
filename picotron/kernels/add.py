"""z = x + y, the first Triton kernel: programs, blocks, masks; then coarsening and autotuning.

Chapter: chapters/09_gpu_kernels.ipynb, section 4.

A Triton *program* handles one block of BLOCK elements; the launch grid says how many programs
run. Inside, `tl.arange(0, BLOCK)` is a vector of offsets, and a load or store of a vector of
pointers moves the whole block at once: Triton maps the block onto the 32-thread warps of the
program, so consecutive offsets land on consecutive threads and a warp's loads *coalesce* into a
few wide memory transactions (see gpu.py). BLOCK must be a power of two (a compile-time shape),
so the last block usually hangs over the end: the mask turns those lanes off.

Versions (kernel `add_kernel_vN`, launched by `add_vN`):

    v1  one block per program, cdiv(n, BLOCK) programs
    v2  v1 with a fixed number of programs P, each looping over blocks p, p + P, p + 2P, ...
        (thread coarsening: fewer, longer-lived programs; CUDA's grid-stride loop)
    v3  v1 with BLOCK and num_warps chosen by timing a few configurations (@triton.autotune)

An add reads 8 bytes and writes 4 per fp32 element for 1 FLOP: arithmetic intensity 1/12 FLOP/B,
as memory-bound as a kernel gets. On an H100 (3.35 TB/s) it cannot beat 0.28 TFLOP/s of the
989 available; its only goal is to run at the copy bandwidth.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from picotron.kernels.runtime import INTERPRETED, check_device
from picotron.kernels.timing import cpu_do_bench

__all__ = ["add_kernel_v1", "add_kernel_v2", "add_kernel_v3", "add_v1", "add_v2", "add_v3"]


# ---- v1: one block per program ----------------------------------------------------------------
@triton.jit
def add_kernel_v1(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                          # which block this program owns
    offsets = pid * BLOCK + tl.arange(0, BLOCK)     # (BLOCK,) element indices
    inside = offsets < n                            # the last block hangs over the end
    x = tl.load(x_ptr + offsets, mask=inside)
    y = tl.load(y_ptr + offsets, mask=inside)
    tl.store(z_ptr + offsets, x + y, mask=inside)


def add_v1(x: torch.Tensor, y: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x + y for two contiguous tensors of the same shape and dtype (v1)."""
    z = _output_like(x, y)
    n = x.numel()
    add_kernel_v1[(triton.cdiv(n, block),)](x, y, z, n, BLOCK=block)
    return z


# ---- v2: thread coarsening with a grid-stride loop -------------------------------------------
@triton.jit
def add_kernel_v2(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    # Program p does blocks p, p + P, p + 2P, ...: at every step the P programs together still read
    # one contiguous stretch of memory, so coalescing is kept while each program does more work.
    for block in range(pid, (n + BLOCK - 1) // BLOCK, programs):
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        x = tl.load(x_ptr + offsets, mask=inside)
        y = tl.load(y_ptr + offsets, mask=inside)
        tl.store(z_ptr + offsets, x + y, mask=inside)


def add_v2(x: torch.Tensor, y: torch.Tensor, block: int = 1024, programs: int | None = None) -> torch.Tensor:
    """x + y with a fixed number of programs (v2); default: 4 per SM on a GPU (enough warps in flight to
    hide memory latency), 4 in the interpreter."""
    z = _output_like(x, y)
    n = x.numel()
    if programs is None:
        programs = 4 if INTERPRETED else 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    programs = max(1, min(programs, triton.cdiv(n, block)))
    add_kernel_v2[(programs,)](x, y, z, n, BLOCK=block)
    return z


# ---- v3: autotuned ----------------------------------------------------------------------------
# On a GPU Triton times each configuration with CUDA events the first time it sees a new `n`, and
# keeps the fastest. In the interpreter there are no CUDA events: the CPU timer stands in (the
# winner then says which config the interpreter runs fastest, which is not what a GPU would pick).
_ADD_CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps)
                for block, warps in ((256, 2), (1024, 4), (4096, 8))]


@triton.autotune(configs=_ADD_CONFIGS, key=["n"], do_bench=cpu_do_bench if INTERPRETED else None)
@triton.jit
def add_kernel_v3(x_ptr, y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(z_ptr + offsets, tl.load(x_ptr + offsets, mask=inside) + tl.load(y_ptr + offsets, mask=inside),
             mask=inside)


def add_v3(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y with the BLOCK the autotuner found fastest for this size (v3); `add_kernel_v3.best_config` tells
    which."""
    z = _output_like(x, y)
    n = x.numel()
    add_kernel_v3[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, z, n)
    return z


def _output_like(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"picotron.kernels.add needs equal shapes and dtypes, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(y.shape)} {y.dtype}")
    if not (x.is_contiguous() and y.is_contiguous()):
        raise ValueError("picotron.kernels.add reads its inputs as flat arrays: pass contiguous tensors "
                         "(.contiguous())")
    check_device(x, y)
    return torch.empty_like(x)

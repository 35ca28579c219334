"""What a GPU is made of, and the two numbers that bound every kernel: peak FLOP/s and bandwidth.

The figures and counters chapters/09_gpu_kernels.ipynb uses: GPUSpec (H100_SXM, H200), roofline,
sectors_per_warp, count_traffic (the bytes each eager aten op moves), and what each kernel of
picotron/kernels/ moves or computes (softmax_bytes, rmsnorm_bytes, attention_flops), here rather than
beside the kernels so that they can be read where triton cannot be installed.

An H100 SXM has 132 streaming multiprocessors (SMs). Each SM runs up to 64 warps of 32 threads,
holds 65,536 32-bit registers (256 KB) and 256 KB of L1 cache that a kernel can partly use as
*shared memory* (up to 228 KB per SM); the SMs share a 50 MB L2 cache, and behind it 80 GB of HBM3
at 3.35 TB/s. Its tensor cores do 989 TFLOP/s of dense bf16 matmul. (NVIDIA H100 Tensor Core GPU
datasheet, and the NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022.)

The roofline (Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance
model", CACM 52(4)): a kernel that does F FLOPs while moving B bytes to and from memory has
arithmetic intensity I = F / B and can run at most at

    min(peak FLOP/s, I * bandwidth)

so it is memory-bound when I < peak / bandwidth (the *ridge point*: 295 FLOP/B for an H100 in
bf16) and compute-bound above. An elementwise op has I < 1; a (n x n) @ (n x n) bf16 matmul has
I = 2n^3 / (3 * 2 n^2) = n/3.

Memory is read in 32-byte sectors (CUDA C++ Best Practices Guide, "Coalesced Access to Global
Memory"): when the 32 threads of a warp read 32 consecutive fp32 values, the 128 bytes come in 4
sectors; when each reads a value from a different row, 32 sectors are fetched for the same 128
useful bytes. `sectors_per_warp` counts them for any pattern of offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["GPUSpec", "H100_SXM", "H200", "roofline", "arithmetic_intensity", "sectors_per_warp",
           "OpTraffic", "count_traffic", "softmax_unfused", "softmax_bytes", "rmsnorm_bytes", "attention_flops"]


@dataclass(frozen=True)
class GPUSpec:
    """Spec-sheet figures of one GPU (dense: without 2:4 sparsity)."""

    name: str
    sms: int
    hbm_bytes: float
    hbm_bandwidth: float          # bytes/s
    bf16_flops: float             # dense tensor-core FLOP/s
    fp32_flops: float             # FLOP/s on the CUDA cores, no tensor cores
    l2_bytes: float
    shared_per_sm: int            # largest shared memory one SM gives its blocks, bytes
    registers_per_sm: int         # 32-bit registers
    max_warps_per_sm: int
    source: str

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte above which bf16 matmul work is compute-bound."""
        return self.bf16_flops / self.hbm_bandwidth


H100_SXM = GPUSpec(
    name="H100 SXM5 80GB", sms=132, hbm_bytes=80e9, hbm_bandwidth=3.35e12, bf16_flops=989e12, fp32_flops=67e12,
    l2_bytes=50e6, shared_per_sm=228 * 1024, registers_per_sm=65536, max_warps_per_sm=64,
    source="NVIDIA H100 Tensor Core GPU datasheet (bandwidth, FLOP/s: 1,979 TFLOP/s bf16 with sparsity, "
           "989 dense); NVIDIA H100 Tensor Core GPU Architecture whitepaper (SMs, L2, registers, shared memory)")

H200 = GPUSpec(
    name="H200 SXM 141GB", sms=132, hbm_bytes=141e9, hbm_bandwidth=4.8e12, bf16_flops=989e12, fp32_flops=67e12,
    l2_bytes=50e6, shared_per_sm=228 * 1024, registers_per_sm=65536, max_warps_per_sm=64,
    source="NVIDIA H200 Tensor Core GPU datasheet (141 GB HBM3e, 4.8 TB/s; the H100's compute)")


def roofline(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The most FLOP/s a kernel of `intensity` FLOP/B can reach: min(peak, intensity * bandwidth)."""
    return min(peak_flops, intensity * bandwidth)


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    return flops / bytes_moved


def sectors_per_warp(offsets: torch.Tensor, element_size: int, sector: int = 32, warp: int = 32) -> float:
    """Mean number of `sector`-byte memory sectors each warp touches when thread i reads element offsets[i].

    offsets: (threads,) element indices in the order threads are numbered. Coalesced fp32 reads give
    4 sectors per warp (128 B); a read that puts every thread in a different sector gives 32.
    """
    offsets = offsets.flatten().long()
    warps = offsets.numel() // warp
    if warps == 0:
        raise ValueError(f"need at least one warp of {warp} offsets, got {offsets.numel()}")
    per_warp = (offsets[: warps * warp] * element_size // sector).view(warps, warp)
    return sum(len(torch.unique(row)) for row in per_warp) / warps


@dataclass
class OpTraffic:
    """One aten op as eager PyTorch runs it: a kernel that reads its inputs and writes its outputs."""

    name: str
    bytes_read: int
    bytes_written: int


class _TrafficMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[OpTraffic] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _FREE:
            return out
        read = sum(t.numel() * t.element_size() for t in _tensors((args, kwargs or {})))
        written = sum(t.numel() * t.element_size() for t in _tensors(out))
        self.ops.append(OpTraffic(str(func.overloadpacket.__name__), read, written))
        return out


# Ops that move no data: they only make a new view of the same memory.
_FREE = {torch.ops.aten.view, torch.ops.aten._unsafe_view, torch.ops.aten.expand, torch.ops.aten.t,
         torch.ops.aten.transpose, torch.ops.aten.unsqueeze, torch.ops.aten.squeeze, torch.ops.aten.detach,
         torch.ops.aten.alias, torch.ops.aten.slice, torch.ops.aten.select, torch.ops.aten.permute,
         torch.ops.aten.as_strided, torch.ops.aten.reshape}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def count_traffic(fn: Callable, *args, **kwargs) -> tuple[object, list[OpTraffic]]:
    """Run fn(*args, **kwargs) and list the kernels eager PyTorch launched, with the bytes each moved.

    Counts what each aten op reads (its input tensors) and writes (its outputs): real tensors, the
    traffic a GPU would see if nothing stayed in cache. Views are free and not listed.
    """
    with _TrafficMode() as mode:
        out = fn(*args, **kwargs)
    return out, mode.ops


# ---- what the kernels of picotron/kernels/ move and compute (no Triton needed to read them) ----
def softmax_unfused(x: torch.Tensor) -> torch.Tensor:
    """The same math as five separate torch ops: each reads its input from memory and writes its output."""
    m = x.amax(dim=-1, keepdim=True)      # read x,         write m
    shifted = x - m                       # read x and m,   write x - m
    e = shifted.exp()                     # read,           write e
    total = e.sum(dim=-1, keepdim=True)   # read e,         write the sums
    return e / total                      # read e and sum, write y


def softmax_bytes(n_rows: int, n_cols: int, element_size: int, version: str = "fused") -> int:
    """Bytes a softmax moves to and from memory: 'fused' (v1, v2), 'online' (v3) or 'unfused' (5 torch ops).

    Per element, unfused: amax 1 read, subtract 1 read + 1 write, exp 1 + 1, sum 1, divide 1 + 1 = 8;
    the per-row max and sum (n_rows values, 4 more passes) are counted too.
    """
    elements = n_rows * n_cols * element_size
    per_row = n_rows * element_size
    if version == "fused":
        return 2 * elements
    if version == "online":
        return 3 * elements
    if version == "unfused":
        return 8 * elements + 4 * per_row
    raise ValueError(f"version must be 'fused', 'online' or 'unfused', not {version!r}")


def rmsnorm_bytes(n_rows: int, n_cols: int, element_size: int, backward: bool = False) -> int:
    """Bytes the kernels move: forward reads x and w, writes y and rstd; backward reads dy, x, w, rstd,
    writes dx and the partial dw rows (not counted: a few rows)."""
    if backward:
        return 3 * n_rows * n_cols * element_size + n_cols * element_size + 4 * n_rows
    return 2 * n_rows * n_cols * element_size + n_cols * element_size + 4 * n_rows


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool = True,
                    backward: bool = False) -> float:
    """FLOPs of attention's two matmuls (Q K^T and P V: 2 * 2 * seq_q * seq_k * head_dim per head), halved when
    causal (the convention of FlashAttention's benchmarks); backward does 2.5 times the forward's
    (five matmuls instead of two; the recomputation of P counted)."""
    flops = 4 * batch * heads * seq_q * seq_k * head_dim
    if causal:
        flops /= 2
    return flops * (2.5 if backward else 1.0)

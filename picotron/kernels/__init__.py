"""Triton kernels: vector add, row softmax, RMSNorm (forward + backward), FlashAttention (chapter 09).

A kernel is one program written for a *block* of data; the GPU runs a grid of copies of it, one
per block, on its streaming multiprocessors. Each file holds one kernel family in numbered
versions, from the plainest to the one that moves the fewest bytes, each checked against torch
(tests/test_kernels.py) and timed (benchmarks/kernels.py):

    add.py              z = x + y: blocks and masks (v1), thread coarsening (v2), autotuning (v3)
    row_softmax.py      row softmax: one row per program (v1), many rows (v2), online for long rows (v3)
    rmsnorm.py          RMSNorm forward and backward kernels, `rms_norm`, and `TritonRMSNorm`, a drop-in
                        for picotron.model.RMSNorm (same `weight`, same `eps`, same state dict)
    attention.py        causal FlashAttention: tiled forward with online softmax, and its backward
    gpu.py              what a GPU is made of (H100/H200 figures), the roofline, memory transactions
    timing.py           one timer for both machines: CUDA events on a GPU, a CPU clock otherwise

On a machine without a GPU the kernels run in the Triton interpreter, which executes each
program with numpy on the CPU: same code, same results, no speed (Playbook, "A primer on GPU", "Fused kernels";
DESIGN.md, "CPU first, GPU real"). The interpreter is Triton's only CPU path, and triton decides
between interpreting and compiling when `@triton.jit` wraps a function, from TRITON_INTERPRET.
So this package sets that variable itself, here, before any of its kernels is defined; a user
who sets it (to debug on a GPU) keeps their choice. The rest of picotron never imports this
package at import time: triton is loaded only by code that asks for a kernel.

Import order. triton's own library functions (tl.max, tl.sum, tl.cdiv, ...) are also @triton.jit
functions, wrapped when triton is first imported; and torch imports triton early (torch._dynamo
does, so the first torch.optim step or torch.compile does). When that happened before this package
set TRITON_INTERPRET, those functions were made for the compiler, and an interpreted kernel that
calls them fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
`_interpret_triton_library` rewraps them for the interpreter, so the import order does not matter.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # No GPU: the interpreter is the only way to run a Triton kernel at all (triton >= 3.8 with numpy 2.4).
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
"""True when the kernels run in the Triton interpreter (on the CPU), False when they compile for the GPU."""

if not INTERPRETED and not torch.cuda.is_available():
    raise ImportError("picotron.kernels: there is no GPU and TRITON_INTERPRET is set to "
                      f"{os.environ['TRITON_INTERPRET']!r}, so Triton can neither compile nor interpret its "
                      "kernels; unset TRITON_INTERPRET (or set it to 1) before importing picotron.kernels")


def _interpret_triton_library() -> int:
    """Rewrap triton.language's @jit functions for the interpreter if triton was imported before
    TRITON_INTERPRET was set (see the module docstring). Returns how many it rewrapped (0 normally)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rewrapped: dict[int, InterpretedFunction] = {}

    def interpreted(value: JITFunction) -> InterpretedFunction:
        if id(value) not in rewrapped:
            rewrapped[id(value)] = InterpretedFunction(value.fn)
        return rewrapped[id(value)]

    modules = [module for name, module in list(sys.modules.items())
               if module is not None and (name == "triton.language" or name.startswith("triton.language."))]
    for namespace in [*modules, tl.tensor]:     # module functions, and tensor methods such as x.max()
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                setattr(namespace, name, interpreted(value))
    return len(rewrapped)


if INTERPRETED:
    _interpret_triton_library()

from picotron.kernels.attention import flash_attention  # noqa: E402  (after the interpreter is decided)
from picotron.kernels.rmsnorm import TritonRMSNorm, rms_norm  # noqa: E402
from picotron.kernels.row_softmax import softmax  # noqa: E402
from picotron.kernels.timing import bench, cpu_do_bench, kernel_device  # noqa: E402
from picotron.kernels.add import vector_add  # noqa: E402

__all__ = ["INTERPRETED", "TritonRMSNorm", "rms_norm", "softmax", "flash_attention", "vector_add", "bench",
           "cpu_do_bench", "kernel_device"]

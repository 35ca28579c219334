"""Where the kernels run: compiled on a GPU, in the Triton interpreter without one (chapters/09_gpu_kernels.ipynb).

Every kernel file of picotron/kernels/ imports this module before it defines a kernel; it imports
nothing from picotron. It holds:

    TRITON           False where triton is not installed: it is built for Linux only (macOS and Windows
                     outside WSL have no Triton, and chapter 09 then runs its torch parts only)
    INTERPRETED      True when the kernels run in the Triton interpreter (on the CPU)
    kernel_device    where the kernels' tensors must live: "cpu" interpreted, "cuda" compiled
    check_device     a clear error for a tensor that is elsewhere
    use_device_descriptors   give kernels that make tensor descriptors (TMA) the global memory they need
    gpu_problem      why this GPU cannot run a compiled kernel (capability, shared memory), or None
    interpreter_problem   why this triton's interpreter fails next to this numpy (3.6 with numpy >= 2.3)

On a machine without a GPU the kernels run in the Triton interpreter, which executes each program
with numpy on the CPU: same code, same results, no speed (Playbook, "A primer on GPU", "Fused
kernels"; docs/design.md, "CPU first, GPU real"). The interpreter is Triton's only CPU path, and
triton decides between interpreting and compiling when `@triton.jit` wraps a function, from
TRITON_INTERPRET. So this module sets that variable itself, before any kernel is defined; a user who
sets it (to debug on a GPU) keeps their choice. The rest of picotron never imports the kernels at
import time: triton is loaded only by code that asks for a kernel.

Import order. triton's own library functions (tl.max, tl.sum, tl.cdiv, ...) are also @triton.jit
functions, wrapped when triton is first imported; and torch imports triton early (torch._dynamo
does, so the first torch.optim step or torch.compile does). When that happened before this module
set TRITON_INTERPRET, those functions were made for the compiler, and an interpreted kernel that
calls them fails ("Cannot call @triton.jit'd outside of the scope of a kernel").
`_interpret_triton_library` rewraps them for the interpreter, so the import order does not matter.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

__all__ = ["TRITON", "INTERPRETED", "kernel_device", "check_device", "use_device_descriptors", "gpu_problem",
           "interpreter_problem"]


def _triton_installed() -> bool:
    """Whether `import triton` can work here, without importing it (a finder that hides it may raise)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


TRITON: bool = _triton_installed()
"""False where triton is not installed (it is built for Linux only): the kernels cannot run at all."""

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


def interpreter_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why this triton's interpreter cannot run a kernel with a loop next to this numpy, or None.

    triton 3.6's interpreter turns a loop bound into a Python int from a 1-element numpy array, which
    numpy 2.3 and newer refuse ("only 0-dimensional arrays can be converted to Python scalars"); 3.7
    no longer does (both measured on the assignment 09 kernels).
    """
    def major_minor(version: str) -> tuple[int, int]:
        major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 3):
        return (f"triton {triton_version}'s interpreter cannot run a kernel with a loop under numpy "
                f"{numpy_version} (a TypeError about 0-dimensional arrays): pip install 'triton>=3.7' "
                f"or 'numpy<2.3'")
    return None


if INTERPRETED and TRITON:
    _interpret_triton_library()
    import importlib.metadata
    import warnings

    import numpy
    _problem = interpreter_problem(importlib.metadata.version("triton"), numpy.__version__)
    if _problem:
        warnings.warn(_problem, stacklevel=2)


def kernel_device() -> torch.device:
    """Where the kernels' tensors must live: the GPU when they compile, the CPU when interpreted."""
    return torch.device("cpu") if INTERPRETED else torch.device("cuda", torch.cuda.current_device())


def check_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error when a tensor is not where the kernels run."""
    want = kernel_device().type
    for t in tensors:
        if t.device.type != want:
            how = "in the Triton interpreter (no GPU here)" if INTERPRETED else "compiled for the GPU"
            raise ValueError(f"picotron.kernels runs {how}, so its tensors must be on {want}, but one is on "
                             f"{t.device}; move it with .to('{want}')")


def use_device_descriptors() -> None:
    """Compiled kernels that call tl.make_tensor_descriptor need a little global memory for the descriptors
    (triton.set_allocator's contract); the interpreter needs none."""
    if not INTERPRETED:
        import triton

        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def gpu_problem(capability: tuple[int, int] = (8, 0), shared_kib: int = 0) -> str | None:
    """Why this machine cannot run a compiled kernel that needs compute `capability` and `shared_kib` KiB of shared
    memory per program, or None when it can. bf16 tl.dot needs Ampere (8.0) or newer; H100-sized tiles need the
    shared memory an A100 or H100 gives (a T4 has 64 KiB, an L4 99 KiB)."""
    if not TRITON:
        return "triton is not installed (it is built for Linux only)"
    if not torch.cuda.is_available():
        return "there is no GPU here"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    if (props.major, props.minor) < capability:
        return (f"the {props.name} is compute capability {props.major}.{props.minor}; these kernels need "
                f"{capability[0]}.{capability[1]} or newer")
    shared = getattr(props, "shared_memory_per_block_optin", None)
    if shared is not None and shared < shared_kib * 1024:
        return (f"the {props.name} gives a program {shared // 1024} KiB of shared memory; these tiles need "
                f"{shared_kib} KiB")
    return None

"""What the compiler makes of each kernel for an H100 (sm_90), without an H100.

Chapter: chapters/09_gpu_kernels.ipynb. Run it as a program (the kernels must be compiled, not interpreted,
so it sets that up itself, before anything imports picotron.kernels):

    python -m picotron.kernels.report            # a markdown table, one row per kernel version
    python -m picotron.kernels.report --json     # the same as JSON
    python -m picotron.kernels.report --only attention   # the kernels whose name contains "attention"

Triton compiles for any NVIDIA target on any machine: triton.compile(..., target=GPUTarget("cuda", 90, 32))
runs the whole pipeline down to the cubin an H100 would load. Its `asm` holds every stage (ttir, ttgir, llir,
ptx, cubin); the cuobjdump that ships with Triton reads the cubin's resource usage and disassembles its SASS.
Per kernel version, with the tile sizes and warps its launcher picks for a typical shape:

    registers     per thread (at most 255); more threads' worth than an SM holds means fewer programs per SM
    local bytes   per thread, in local memory (it lives in HBM, behind the caches): the stack frame, where the
                  registers that did not fit are spilled, and local arrays. 0 is the goal. (cuobjdump reports spills
                  under STACK, not LOCAL: reading LOCAL alone shows 0 for a kernel that spills.)
    shared        bytes of shared memory per program (an H100 gives one program at most 227 KB)
    HGMMA         Hopper's warpgroup matrix instructions (wgmma): a tl.dot on tensor cores, asynchronous
    HMMA          the older warp-level mma.sync (Ampere's): tensor cores, but synchronous
    UTMALDG       TMA loads: the tensor-memory accelerator copies a whole tile from HBM to shared memory
    LDGSTS        cp.async: global-to-shared copies that do not block the thread (software pipelining)
    LDG           plain global loads into registers
    FP32 ops      FP32 arithmetic (FMUL, FADD, FFMA, FSEL, FMNMX, FSETP, F2FP): the softmax's work beside the
                  exp2s, which run on the special-function units (MUFU); counted in the code, not per run

These are predictions, not measurements: they say what a change did to the code (a tl.dot that became wgmma,
loads that became TMA, spills that appeared), which is how a kernel is improved when no GPU is at hand. The
GPU figures (benchmarks/kernels.py) say whether the prediction held.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["CompileReport", "compile_report", "h100_builds", "main"]

INSTRUCTIONS = {"hgmma": "HGMMA", "hmma": "HMMA", "tma_loads": "UTMALDG", "async_copies": "LDGSTS",
                "global_loads": "LDG"}
FP32_OPS = ("FMUL", "FADD", "FFMA", "FSEL", "FMNMX", "FSETP", "F2FP")   # the FP32 units' work, exp2 (MUFU) aside


@dataclass
class CompileReport:
    """One kernel version compiled for one GPU target: the resources it takes and the instructions it uses."""

    name: str
    arch: int
    warps: int
    stages: int
    registers: int
    local_bytes: int
    shared_bytes: int
    hgmma: int
    hmma: int
    tma_loads: int
    async_copies: int
    global_loads: int
    fp32_ops: int = 0
    tiles: str = ""

    def row(self) -> str:
        return (f"| {self.name} | {self.tiles} | {self.warps} | {self.stages} | {self.registers} | "
                f"{self.local_bytes} | "
                f"{self.shared_bytes / 1024:.0f} KiB | {self.hgmma} | {self.hmma} | {self.tma_loads} | "
                f"{self.async_copies} | {self.global_loads} | {self.fp32_ops} |")


HEADER = ("| kernel | tiles | warps | stages | registers | local (spill) B | shared | HGMMA | HMMA | UTMALDG | "
          "LDGSTS | LDG | FP32 ops |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _cuobjdump(*args: str) -> str:
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    done = subprocess.run([tool, *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"cuobjdump {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def _jit_function(kernel):
    """The JITFunction inside an autotuned (or heuristics) kernel; a plain @triton.jit kernel is one."""
    from triton.runtime.jit import JITFunction
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


def _name(kernel) -> str:
    """The kernel's name; an autotuned version of another kernel is named by the module attribute it is bound to."""
    import importlib
    fn = _jit_function(kernel)
    if kernel is not fn:
        module = importlib.import_module(fn.fn.__module__)
        bound = [name for name, value in vars(module).items() if value is kernel]
        if bound:
            return bound[0]
    return fn.__name__


def compile_report(kernel, types: dict[str, str], constexprs: dict, warps: int, stages: int = 3, *, arch: int = 90,
                   name: str | None = None) -> CompileReport:
    """Compile `kernel` (a @triton.jit function, not interpreted) for sm_`arch` and read its cubin.

    types: the Triton type of each pointer or float argument ("*bf16", "*fp32", "fp32"); any other argument is
    an i32. constexprs: the tl.constexpr arguments' values."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(kernel)
    signature = {arg: "constexpr" if arg in constexprs else types.get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage, sass = _cuobjdump("-res-usage", cubin), _cuobjdump("-sass", cubin)
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    local = sum(int(re.search(rf"{part}:(\d+)", usage).group(1)) for part in ("STACK", "LOCAL"))   # spills: STACK
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    counts = {field: sum(op == mnemonic or op.startswith(mnemonic + ".") for op in opcodes)
              for field, mnemonic in INSTRUCTIONS.items()}
    counts["fp32_ops"] = sum(op.split(".")[0] in FP32_OPS for op in opcodes)
    tiles = ", ".join(f"{k}={v}" for k, v in constexprs.items() if k.startswith(("BLOCK", "ROWS")))
    return CompileReport(name or fn.__name__, arch, warps, stages, registers, local, compiled.metadata.shared,
                         tiles=tiles, **counts)


def h100_builds() -> list[tuple]:
    """(kernel, types, constexprs, warps, stages) of every kernel version, with the tiles its launcher picks on an
    H100 for a typical shape: rows of 4096 bf16 values; attention with head_dim 128 in bf16."""
    import picotron.kernels.add as add
    import picotron.kernels.attention as attention
    import picotron.kernels.attention_tma as attention_tma
    import picotron.kernels.rmsnorm as rmsnorm
    import picotron.kernels.row_softmax as row_softmax

    p32, b16 = "*fp32", "*bf16"
    vectors = dict(x_ptr=p32, y_ptr=p32, z_ptr=p32)
    norm = dict(x_ptr=b16, w_ptr=b16, out_ptr=b16, rstd_ptr=p32, eps="fp32")
    builds = [
        (add.add_kernel_v1, vectors, dict(BLOCK=1024), 4, 3),
        (add.add_kernel_v2, vectors, dict(BLOCK=1024), 4, 3),
        (add.add_kernel_v3, vectors, dict(BLOCK=4096), 8, 3),
        (row_softmax.softmax_kernel_v1, dict(x_ptr=b16, out_ptr=b16), dict(BLOCK=4096), 8, 3),
        (row_softmax.softmax_kernel_v2, dict(x_ptr=b16, out_ptr=b16), dict(ROWS=4, BLOCK=1024), 8, 3),
        (row_softmax.softmax_kernel_v3, dict(x_ptr=p32, out_ptr=p32), dict(BLOCK=4096), 8, 3),
        (rmsnorm.rmsnorm_forward_kernel_v1, norm, dict(BLOCK=4096), 8, 3),
        (rmsnorm.rmsnorm_forward_kernel_v2, norm, dict(ROWS=2, BLOCK=2048), 8, 3),
        (rmsnorm.rmsnorm_backward_kernel_v1, dict(dy_ptr=b16, x_ptr=b16, w_ptr=b16, rstd_ptr=p32, dx_ptr=b16,
                                                  dw_partial_ptr=p32), dict(ROWS=2, BLOCK=2048), 8, 3),
        (rmsnorm.rmsnorm_backward_kernel_v2, dict(dy_ptr=b16, x_ptr=b16, w_ptr=b16, rstd_ptr=p32, dx_ptr=b16,
                                                  dw_partial_ptr=p32), dict(ROWS=2, BLOCK=2048, STAGES=3), 8, 3),
    ]
    tensors = {name: b16 for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr")}
    tensors.update(lse_ptr=p32, delta_ptr=p32, qk_scale="fp32", scale="fp32")
    flash = dict(BLOCK_D=128, CAUSAL=True, DOT_FP32=False, PRECISION="tf32")
    block_m, block_n, warps, stages = attention._blocks(128, element_size=2)
    builds.append((attention.attention_forward_kernel_v1, tensors, dict(flash, BLOCK_M=block_m, BLOCK_N=block_n),
                   warps, stages))
    builds.append((attention_tma.attention_forward_kernel_v2, tensors,
                   dict(flash, BLOCK_M=block_m, BLOCK_N=block_n, LEAN=False), warps, stages))
    for kernel, lean in ((attention_tma.attention_forward_kernel_v3, False),
                         (attention_tma.attention_forward_kernel_v4, True)):
        for config in attention_tma.FORWARD_CONFIGS:     # v2's kernel, each config its autotuner may pick
            builds.append((kernel, tensors, dict(flash, **config.kwargs, LEAN=lean), config.num_warps,
                           config.num_stages))
    block_m, block_n, warps, stages = attention._blocks(128, backward=True, element_size=2)
    for kernel in (attention.attention_backward_dkdv_kernel_v1, attention.attention_backward_dq_kernel_v1,
                   attention_tma.attention_backward_dkdv_kernel_v2, attention_tma.attention_backward_dq_kernel_v2):
        major = dict(KEYS_MAJOR=False) if kernel is attention_tma.attention_backward_dkdv_kernel_v2 else {}
        builds.append((kernel, tensors, dict(flash, BLOCK_M=block_m, BLOCK_N=block_n, **major), warps, stages))
    for kernel, configs, major in ((attention_tma.attention_backward_dkdv_kernel_v3, attention_tma.DKDV_CONFIGS,
                                    dict(KEYS_MAJOR=True)),
                                   (attention_tma.attention_backward_dq_kernel_v3, attention_tma.DQ_CONFIGS, {})):
        for config in configs:                       # backward v3: each config its autotuners may pick
            builds.append((kernel, tensors, dict(flash, **config.kwargs, **major), config.num_warps,
                           config.num_stages))
    return builds


def _compiler_mode() -> None:
    """Make picotron.kernels define compiler kernels on a machine without a GPU (this process only)."""
    if "picotron.kernels.runtime" in sys.modules:
        import picotron.kernels.runtime as runtime
        if runtime.INTERPRETED:
            raise RuntimeError("picotron.kernels was already imported in interpreter mode in this process; run "
                               "`python -m picotron.kernels.report` in a fresh process")
        return
    import torch
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if not torch.cuda.is_available():
        torch.cuda.is_available = lambda: True   # runtime.py then keeps the kernels compilable; nothing launches


def main(argv: list[str] | None = None) -> list[CompileReport]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 and H200)")
    parser.add_argument("--only", default="", help="only the kernels whose name contains this (e.g. attention)")
    args = parser.parse_args(argv)
    _compiler_mode()
    builds = [build for build in h100_builds() if args.only in _name(build[0])]
    if not builds:
        raise SystemExit(f"no kernel's name contains {args.only!r}")
    reports = [compile_report(kernel, types, constexprs, warps, stages, arch=args.arch, name=_name(kernel))
               for kernel, types, constexprs, warps, stages in builds]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in reports], indent=1))
    else:
        print(f"Compiled for sm_{args.arch} by triton (no GPU needed); per kernel version:\n\n{HEADER}")
        print("\n".join(r.row() for r in reports))
    return reports


if __name__ == "__main__":
    main()

"""The checks of assignment 09: a fused row-softmax kernel, an RMSNorm forward kernel, an online softmax for rows
longer than one block and (the stretch) the FlashAttention forward, in Triton.

Each check launches the learner's @triton.jit kernel itself, on inputs chosen to catch the usual slips, and
compares with plain torch math done here in float64 (never with picotron.kernels, the code the assignment
rebuilds, which the checks refuse). Without a GPU the kernel runs in the Triton interpreter
(picotron.kernels.runtime sets it up); on a GPU it compiles. Chapter: chapters/09_gpu_kernels.ipynb; the
assignment: solutions/09_gpu_kernels.ipynb.

    check_softmax_kernel(softmax_kernel)
        softmax_kernel[(rows,)](x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK=BLOCK)
    check_rmsnorm_kernel(rmsnorm_kernel)
        rmsnorm_kernel[(rows,)](x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                                BLOCK=BLOCK)
    check_online_softmax_kernel(online_softmax_kernel)
        online_softmax_kernel[(rows,)](x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK=BLOCK)
    check_flash_attention_kernel(flash_attention_kernel)
        flash_attention_kernel[(heads, cdiv(seq_len, BLOCK_M))](q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len,
            head_dim, head_stride, row_stride, o_head_stride, o_row_stride, scale,
            CAUSAL=, BLOCK_M=, BLOCK_N=, BLOCK_D=)

For the first two, BLOCK is n_cols rounded up to a power of two. Their cases: a power-of-two row, a
row that is not one (the padding lanes must neither win the max nor add to the sum or the mean),
rows read through a stride (a slice x[:, :n] of a wider tensor) and written through another, bf16;
softmax adds large values (exp overflows without the max subtracted) and -inf entries (masked
scores), RMSNorm tiny values (where eps matters) and a large eps. The output is written into a
larger buffer filled with a sentinel: a store without its mask, or through the wrong stride,
changes values outside the rows, and the check says so.

The online softmax gets a BLOCK smaller than the row (a row of 3 to 5 blocks, a ragged last block,
a row shorter than one block, 5000 columns in blocks of 1024), scores whose maximum rises block
after block (the running sum must be rescaled each time), large values, -inf entries, a first
block entirely -inf (the running max is still -inf after it), strides and bf16. FlashAttention
gets causal and not, ragged blocks, a head_dim that is not a power of two, and scores that rise
with every key block; O is compared with SDPA (float64) and picotron's torch FlashAttention, the
lse with torch.logsumexp.

The rules these two tasks state about memory traffic are checked on the kernel's Triton IR (KernelIR):
the kernel compiled as far as TTIR for an H100, which triton does on any machine, so the same rules
hold in the interpreter and on a GPU, whatever pointers the kernel uses. The IR gives the shape of
every load and store and the argument its pointer comes from; the loops' bounds, evaluated with each
program's ids and the launch's integers, say how often each runs. Online softmax: at most BLOCK values
a load, each element loaded at most twice and stored once. FlashAttention: loads of at most a
BLOCK_M x BLOCK_D tile of Q and a BLOCK_N x BLOCK_D tile of K or V, no tensor longer than a tile (never
the s x s scores), one pass over K and V per query block, and (causal) no key block above the diagonal.
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from picotron import tolerance
from picotron_course.checks import Report, max_abs_error, mismatch
from picotron_course.checks import not_the_course_answer
from picotron.kernels.runtime import INTERPRETED, TRITON, kernel_device   # interpreter or compiler, before any kernel

__all__ = ["check_softmax_kernel", "check_rmsnorm_kernel", "check_online_softmax_kernel",
           "check_flash_attention_kernel", "SOFTMAX_CASES", "RMSNORM_CASES", "ONLINE_SOFTMAX_CASES", "FLASH_CASES",
           "KernelIR", "launch"]

REQUIRES = ("triton",)   # the grader refuses to grade assignment 09 where these are not installed
REQUIRES_WHY = "it is built for Linux only: use Linux or WSL"

SENTINEL = -4096.0   # exact in bf16 too; fills the output buffer around the rows: any change is a store out of place
# Elements of spare memory after every tensor a kernel gets. The interpreter does not check addresses:
# a wrong stride would write into whatever lies after the tensor and can crash the process. With this
# room, it writes into the spare part instead, and the check reports it.
SLACK = 16384

# (name, rows, n_cols, dtype, x_row_stride or None for contiguous, padding of each output row, make)
SOFTMAX_CASES = [
    ("64 columns", 4, 64, torch.float32, None, 0, "randn"),
    ("100 columns: BLOCK 128, 28 padding lanes", 5, 100, torch.float32, None, 0, "randn"),
    ("large values, around 2000", 3, 50, torch.float32, None, 0, "large"),
    ("-inf entries (masked scores)", 4, 40, torch.float32, None, 0, "masked"),
    ("x[:, :70] of a (6, 96) tensor", 6, 70, torch.float32, 96, 0, "randn"),
    ("output rows 13 apart in memory", 3, 20, torch.float32, None, 13, "randn"),
    ("bf16", 4, 100, torch.bfloat16, None, 0, "randn"),
]
# (name, rows, n_cols, dtype, x_row_stride or None, output padding, make, eps)
RMSNORM_CASES = [
    ("64 columns", 4, 64, torch.float32, None, 0, "randn", 1e-5),
    ("100 columns: BLOCK 128, mean over 100", 5, 100, torch.float32, None, 0, "randn", 1e-5),
    ("tiny values: eps matters", 3, 48, torch.float32, None, 0, "tiny", 1e-5),
    ("eps = 0.5", 3, 32, torch.float32, None, 0, "randn", 0.5),
    ("x[:, :70] of a (6, 96) tensor", 6, 70, torch.float32, 96, 0, "randn", 1e-5),
    ("output rows 13 apart in memory", 3, 20, torch.float32, None, 13, "randn", 1e-5),
    ("bf16 x and weight", 4, 100, torch.bfloat16, None, 0, "randn", 1e-5),
]
# (name, rows, n_cols, BLOCK, dtype, x_row_stride or None, output padding, make)
ONLINE_SOFTMAX_CASES = [
    ("3 blocks", 3, 192, 64, torch.float32, None, 0, "randn"),
    ("4.3 blocks: a ragged last block", 4, 275, 64, torch.float32, None, 0, "randn"),
    ("the max rises in every block", 3, 256, 64, torch.float32, None, 0, "rising"),
    ("large values, around 2000", 3, 200, 64, torch.float32, None, 0, "large"),
    ("-inf entries (masked scores)", 4, 200, 64, torch.float32, None, 0, "masked"),
    ("first block all -inf", 3, 250, 64, torch.float32, None, 0, "first block masked"),
    ("fewer columns than BLOCK", 2, 50, 64, torch.float32, None, 0, "randn"),
    ("x[:, :300] of a (3, 320) tensor", 3, 300, 128, torch.float32, 320, 13, "randn"),
    ("bf16, 5 blocks", 3, 320, 64, torch.bfloat16, None, 0, "randn"),
    ("5000 columns, BLOCK 1024", 2, 5000, 1024, torch.float32, None, 0, "randn"),
]
# (name, heads, seq_len, head_dim, BLOCK_M, BLOCK_N, causal, make): fp32, q, k, v rows head_dim + 8 apart, O rows
# head_dim + 3 apart; small enough for the interpreter, long enough that no tile holds a whole row.
FLASH_CASES = [
    ("64 keys", 2, 64, 16, 16, 16, False, "randn"),
    ("64 keys, causal", 2, 64, 16, 16, 16, True, "randn"),
    ("80 keys, causal, BLOCK_M 32 x BLOCK_N 16", 1, 80, 16, 32, 16, True, "randn"),
    ("50 keys: ragged last blocks", 2, 50, 16, 16, 16, False, "randn"),
    ("head_dim 24: BLOCK_D 32", 1, 48, 24, 16, 16, True, "randn"),
    ("scores rise with every key block", 1, 64, 16, 16, 16, False, "rising"),
]


# ---- launching the learner's kernel ---------------------------------------------------------------
def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs); an unsolved kernel's NotImplementedError comes out as itself.

    The interpreter wraps what a kernel raises in an InterpreterError, and the compiler refuses a
    `raise` with a CompilationError that quotes it: either way the check cell must fail with
    NotImplementedError, like every other unsolved exercise.
    """
    kernel = _runnable(kernel)
    code = getattr(getattr(kernel, "fn", None), "__code__", None)
    if code is not None and "NotImplementedError" in code.co_names:
        # The exercise's stub: say so before launching (its source may not even be readable, e.g. under exec).
        raise NotImplementedError(f"{_name(kernel)} is not written yet: replace the `raise NotImplementedError` "
                                  "with the kernel's body")
    try:
        kernel[grid](*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised as is unless it is an unsolved stub
        if _is_unsolved(e):
            raise NotImplementedError(f"{_name(kernel)} is not written yet: {_first_line(e)}") from e
        raise


def _runnable(kernel):
    """The kernel as this process can run it. A kernel decorated before picotron.kernels.runtime chose the
    interpreter was made for the compiler: rewrap it for the interpreter."""
    if not hasattr(kernel, "__getitem__") or not hasattr(kernel, "fn"):
        raise AssertionError(f"expected a @triton.jit kernel, got {type(kernel).__name__}: decorate your function "
                             "with @triton.jit and pass the function itself (not a call of it)")
    if INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        if isinstance(kernel, JITFunction):
            return InterpretedFunction(kernel.fn)
    return kernel


def _is_unsolved(error: BaseException) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError) or "NotImplementedError" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", "the kernel")


def _first_line(error: BaseException) -> str:
    """The error in one line. Triton's compile errors start with "at line:column:" and the source; their
    message is the last line."""
    lines = [line for line in str(error).strip().split("\n") if line.strip()] or [""]
    text = lines[-1] if lines[0].startswith("at ") and lines[0].endswith(":") else lines[0]
    return f"{type(error).__name__}: {text}"[:200]


# ---- data ---------------------------------------------------------------------------------------
def _data(rows: int, n_cols: int, dtype: torch.dtype, stride: int | None, make: str, seed: int) -> torch.Tensor:
    """(rows, n_cols) input, as a slice of a (rows, stride) tensor when stride is given."""
    generator = torch.Generator().manual_seed(seed)
    width = stride or n_cols
    x = torch.randn(rows, width, generator=generator, dtype=torch.float32)
    if make == "large":
        x = x * 1000.0 + 2000.0                # exp(2000) overflows fp32 (and fp64)
    elif make == "rising":
        x = x + torch.linspace(0.0, 40.0, width)          # every block raises the maximum
    elif make == "tiny":
        x = x * 1e-3                           # mean of squares 1e-6: eps = 1e-5 dominates it
    elif make == "masked":
        x[torch.rand(rows, width, generator=generator) < 0.3] = float("-inf")
        x[:, 0] = torch.randn(rows, generator=generator)    # every row keeps at least one finite score
    return _with_room(x.to(dtype))[:, :n_cols]


def _with_room(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """A copy of `t` on the kernels' device, followed in memory by SLACK spare elements set to `fill`."""
    storage = torch.full((t.numel() + SLACK,), fill, dtype=t.dtype, device=kernel_device())
    storage[: t.numel()] = t.flatten().to(storage.device)
    return storage[: t.numel()].view(t.shape)


def _output_buffer(rows: int, n_cols: int, padding: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, out): out is a (rows, n_cols) view into a sentinel-filled buffer, rows n_cols + padding apart,
    with SLACK sentinels after the last."""
    stride = n_cols + padding
    buffer = torch.full((rows * stride + SLACK,), SENTINEL, dtype=dtype, device=kernel_device())
    return buffer, buffer[: rows * stride].view(rows, stride)[:, :n_cols]


def _outside_touched(buffer: torch.Tensor, out: torch.Tensor) -> int:
    """How many buffer elements outside `out` lost their sentinel."""
    inside = torch.zeros(buffer.numel(), dtype=torch.bool, device=buffer.device)
    inside.view(-1)[: out.shape[0] * out.stride(0)].view(out.shape[0], out.stride(0))[:, : out.shape[1]] = True
    return int((buffer[~inside] != SENTINEL).sum())


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, n_cols: int) -> bool:
    """Equal to the float64 math up to round-off (picotron.tolerance): in fp32, a sum over the row's n_cols values
    and a few more roundings; in bf16, where the kernel computes in fp32 and rounds its output once, as the
    expected value was, two bf16 roundings."""
    n = n_cols + 2 if dtype == torch.float32 else 2
    return tolerance.close_enough(actual, expected, n=n, dtype=dtype, tf32=False)


def _block(n_cols: int) -> int:
    return 1 << max(n_cols - 1, 0).bit_length()     # n rounded up to a power of two


# ---- softmax ------------------------------------------------------------------------------------
def check_softmax_kernel(softmax_kernel) -> None:
    """Launch softmax_kernel with one program per row on each case of SOFTMAX_CASES; compare with float64 torch."""
    not_the_course_answer("check_softmax_kernel", softmax_kernel, course="picotron.kernels")
    where = "the Triton interpreter (CPU)" if INTERPRETED else "a compiled GPU kernel"
    note = f"one program per row, in {where}; expected = torch.softmax in float64"
    with Report("softmax_kernel", note=note) as report:
        for seed, (name, rows, n_cols, dtype, stride, padding, make) in enumerate(SOFTMAX_CASES):
            x = _data(rows, n_cols, dtype, stride, make, seed)
            expected = torch.softmax(x.double(), dim=-1).to(dtype)
            buffer, out = _output_buffer(rows, n_cols, padding, dtype)
            _run_case(report, name, dtype, expected, buffer, out, x, lambda: launch(
                softmax_kernel, (rows,), x, out, n_cols, x.stride(0), out.stride(0), BLOCK=_block(n_cols)))


# ---- RMSNorm ------------------------------------------------------------------------------------
def check_rmsnorm_kernel(rmsnorm_kernel) -> None:
    """Launch rmsnorm_kernel with one program per row on each case of RMSNORM_CASES; compare y and rstd with
    float64 torch."""
    not_the_course_answer("check_rmsnorm_kernel", rmsnorm_kernel, course="picotron.kernels")
    where = "the Triton interpreter (CPU)" if INTERPRETED else "a compiled GPU kernel"
    note = (f"one program per row, in {where}; expected: rstd = 1/sqrt(mean(x^2) + eps), "
            "y = w * (x rstd, rounded to x's dtype), in float64")
    with Report("rmsnorm_kernel", note=note) as report:
        for seed, (name, rows, n_cols, dtype, stride, padding, make, eps) in enumerate(RMSNORM_CASES):
            x = _data(rows, n_cols, dtype, stride, make, seed)
            weight = (1 + 0.5 * torch.randn(n_cols, generator=torch.Generator().manual_seed(100 + seed)))
            weight = _with_room(weight.to(dtype))
            rstd_expected = torch.rsqrt(x.double().pow(2).mean(dim=-1) + eps)                   # (rows,)
            normed = (x.double() * rstd_expected[:, None]).to(dtype).double()                   # rounded as x
            expected = (normed * weight.double()).to(dtype)
            buffer, out = _output_buffer(rows, n_cols, padding, dtype)
            rstd = _with_room(torch.full((rows,), SENTINEL), fill=SENTINEL)
            _run_case(report, name, dtype, expected, buffer, out, x, lambda: launch(
                rmsnorm_kernel, (rows,), x, weight, out, rstd, n_cols, x.stride(0), out.stride(0), eps,
                BLOCK=_block(n_cols)), rstd=(rstd, rstd_expected))


# ---- part 6: online softmax ---------------------------------------------------------------------------
def check_online_softmax_kernel(online_softmax_kernel) -> None:
    """Launch online_softmax_kernel with one program per row and a BLOCK smaller than the row, on each case of
    ONLINE_SOFTMAX_CASES; compare with float64 torch.softmax. From the kernel's Triton IR (the same on a CPU and
    a GPU), count what each program loads and stores: at most BLOCK values a load, two loads and one store of
    each element."""
    not_the_course_answer("check_online_softmax_kernel", online_softmax_kernel, course="picotron.kernels")
    where = "the Triton interpreter (CPU)" if INTERPRETED else "a compiled GPU kernel"
    note = (f"one program per row, BLOCK columns at a time, in {where}; expected = torch.softmax in float64; "
            "loads and stores counted on the kernel's Triton IR")
    with Report("online_softmax_kernel", note=note) as report:
        for seed, (name, rows, n_cols, block, dtype, stride, padding, make) in enumerate(ONLINE_SOFTMAX_CASES):
            x = _data(rows, n_cols, dtype, stride, "randn" if make == "first block masked" else make, 200 + seed)
            if make == "first block masked":
                x[:, :block] = float("-inf")          # a row that starts with masked keys (a padded prompt)
            expected = torch.softmax(x.double(), dim=-1).to(dtype)
            buffer, out = _output_buffer(rows, n_cols, padding, dtype)
            args = (x, out, n_cols, x.stride(0), out.stride(0))

            def call(args=args, rows=rows, block=block):
                launch(online_softmax_kernel, (rows,), *args, BLOCK=block)

            blocks = -(-n_cols // block)
            _run_case(report, name, dtype, expected, buffer, out, x, call, n=n_cols + 2 * blocks + 2,
                      traffic=lambda args=args, block=block, rows=rows, n_cols=n_cols: _online_traffic(
                          online_softmax_kernel, args, block, rows, n_cols))


def _online_traffic(kernel, args: tuple, block: int, rows: int, n_cols: int) -> tuple[dict, list[str]]:
    """The BLOCK column, and the loads and stores per element each program runs (from the kernel's IR); the
    problems if over budget: a load wider than BLOCK, more than two loads or one store of an element."""
    columns = {"BLOCK": block}
    named = _arguments(kernel, args, {"BLOCK": block})
    try:
        kernel_ir = _kernel_ir(kernel, named, {"BLOCK": block})
        programs = [kernel_ir.traffic((row, 0, 0), named) for row in range(rows)]
    except _Unknown as e:
        return columns, [f"could not count what the kernel loads: {e}"]
    except Exception as e:  # noqa: BLE001 - a kernel the compiler refuses is a failed case, said in one line
        return columns, [f"could not compile the kernel to count its loads: {_first_line(e)}"]
    x_name, out_name = list(named)[:2]
    padded = -(-n_cols // block) * block               # the values a row's blocks cover
    loads = max(p.loaded(x_name) + p.loaded(out_name) for p in programs) / padded
    stores = max(p.stored(out_name) for p in programs) / padded
    widest = max((math.prod(shape) for p in programs for shapes in p.load_shapes.values() for shape in shapes),
                 default=0)
    columns.update({"loads/elem": f"{loads:.2f}", "stores/elem": f"{stores:.2f}"})
    problems = []
    if widest > block:
        problems.append(f"one load read {widest} values at once; BLOCK is {block}: walk the row BLOCK columns at a "
                        "time")
    if loads > 2:
        problems.append(f"each element was loaded {loads:.2f} times: at most 2 (a first pass keeps the running max "
                        "and sum, a second writes the output)")
    if stores > 1:
        problems.append(f"each element was stored {stores:.2f} times: once, in the second pass")
    others = sorted({name for p in programs for name in p.stores} - {out_name})
    if others:
        problems.append(f"the kernel stores through {', '.join(others)}: write the output only")
    return columns, problems


# ---- the stretch: FlashAttention forward ------------------------------------------------------------------
def check_flash_attention_kernel(flash_attention_kernel) -> None:
    """Launch flash_attention_kernel with one program per (head, query block) on each case of FLASH_CASES; compare
    O with F.scaled_dot_product_attention in float64 and with picotron's FlashAttention in torch
    (picotron/kernels/flash_attention_torch.py, same tiles), and the log-sum-exp with torch.logsumexp in float64.
    From the kernel's Triton IR (the same on a CPU and a GPU): loads of at most a BLOCK_M x BLOCK_D tile of Q and
    a BLOCK_N x BLOCK_D tile of K or V, no tensor longer than a tile, one pass over K and V per query block, and
    (causal) no key block above the diagonal."""
    from picotron.kernels.flash_attention_torch import attention_roundings, flash_attention_torch

    not_the_course_answer("check_flash_attention_kernel", flash_attention_kernel, course="picotron.kernels")
    where = "the Triton interpreter (CPU)" if INTERPRETED else "a compiled GPU kernel (fp32 tl.dot in TF32)"
    note = (f"one program per (head, query block), in {where}; expected O = SDPA in float64 and picotron's torch "
            "FlashAttention, lse = logsumexp in float64; loads counted on the kernel's Triton IR")
    tf32 = not INTERPRETED            # a compiled fp32 tl.dot runs in TF32 unless told input_precision="ieee"
    with Report("flash_attention_kernel", note=note) as report:
        for seed, (name, heads, seq, head_dim, block_m, block_n, causal, make) in enumerate(FLASH_CASES):
            q, k, v = _attention_data(heads, seq, head_dim, make, 300 + seed)
            scale = 1.0 / math.sqrt(head_dim)
            qd, kd, vd = (t.cpu().double() for t in (q, k, v))
            expected = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
            scores = (qd @ kd.mT) * scale
            if causal:
                scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
            lse_expected = torch.logsumexp(scores, dim=-1)
            in_torch = flash_attention_torch(q.cpu(), k.cpu(), v.cpu(), causal=causal, scale=scale, block_q=block_m,
                                             block_k=block_n)
            buffer, rows_out = _output_buffer(heads * seq, head_dim, 3, torch.float32)
            out = rows_out.view(heads, seq, head_dim)
            lse = _with_room(torch.full((heads, seq), SENTINEL), fill=SENTINEL)
            constexprs = dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, _block(head_dim)))
            args = (q, k, v, out, lse, seq, head_dim, q.stride(0), q.stride(1), out.stride(0), out.stride(1), scale)
            columns = {"case": name, "(heads, s, d)": (heads, seq, head_dim),
                       "BLOCK_M x BLOCK_N": f"{block_m} x {block_n}", "causal": causal}
            try:
                launch(flash_attention_kernel, (heads, -(-seq // block_m)), *args, **constexprs)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - a crash is a failed case, shown in the table
                report.add(ok=False, detail=f"the kernel raised {_first_line(e)}", **columns, max_abs_err=math.inf)
                continue
            actual, lse_actual = out.cpu(), lse.cpu()
            n = attention_roundings(head_dim, seq)
            problems = []
            if not tolerance.close_enough(actual, expected, n=n, dtype=torch.float32, tf32=tf32):
                problems.append("O against SDPA: " + mismatch(actual.double(), expected))
                if actual.isnan().any():
                    problems.append("NaN in O: an exp(-inf - (-inf)) or a 0 / 0 somewhere")
            elif not tolerance.close_enough(actual, in_torch, n=n, dtype=torch.float32, tf32=tf32):
                problems.append("O against picotron's torch FlashAttention: "
                                + mismatch(actual.double(), in_torch.double()))
            if not tolerance.close_enough(lse_actual, lse_expected, n=attention_roundings(head_dim, seq, of="lse"),
                                          dtype=torch.float32, tf32=tf32):
                problems.append("lse (store m + log l of row i, natural log, at lse_ptr + head * seq_len + i): "
                                + mismatch(lse_actual.double(), lse_expected))
            touched = _outside_touched(buffer, rows_out)
            if touched:
                problems.append(f"{touched} values outside O were overwritten: mask the store (rows < seq_len, "
                                "dims < head_dim) and address O through o_head_stride and o_row_stride")
            named = _arguments(flash_attention_kernel, args, constexprs)
            problems += _flash_traffic(flash_attention_kernel, named, constexprs, heads, seq)
            err = max_abs_error(actual.double().nan_to_num(nan=math.inf), expected)
            report.add(ok=not problems, detail="; ".join(problems), **columns, max_abs_err=err)


def _flash_traffic(kernel, named: dict, constexprs: dict, heads: int, seq: int) -> list[str]:
    """The stretch's rules, from the kernel's IR, for every program: tile-sized loads, no tensor longer than a
    tile, one pass over K and V per query block, and (causal) no key block above the diagonal."""
    block_m, block_n, block_d, causal = (constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "CAUSAL"))
    q_name, k_name, v_name, o_name, lse_name = list(named)[:5]
    try:
        kernel_ir = _kernel_ir(kernel, named, constexprs)
        programs = {(h, b): kernel_ir.traffic((h, b, 0), named) for h in range(heads)
                    for b in range(-(-seq // block_m))}
    except _Unknown as e:
        return [f"could not count what the kernel loads: {e}"]
    except Exception as e:  # noqa: BLE001 - a kernel the compiler refuses is a failed case, said in one line
        return [f"could not compile the kernel to count its loads: {_first_line(e)}"]
    problems = []
    largest, shape = kernel_ir.largest_dimension()
    if largest > max(block_m, block_n, block_d):
        problems.append(f"the kernel holds a tensor of shape {shape}, longer than any tile (BLOCK_M {block_m}, "
                        f"BLOCK_N {block_n}, BLOCK_D {block_d}): never the s x s scores, nor a whole row of them")
    first = programs[(0, 0)]
    for name, tile, what in ((q_name, block_m * block_d, "BLOCK_M x BLOCK_D"),
                             (k_name, block_n * block_d, "BLOCK_N x BLOCK_D"),
                             (v_name, block_n * block_d, "BLOCK_N x BLOCK_D")):
        widest = max((math.prod(s) for s in first.load_shapes.get(name, ())), default=0)
        if widest > tile:
            problems.append(f"one load of {name} reads {widest} values: at most a {what} tile ({tile})")
    passes = []
    for (head, block), traffic in programs.items():
        visible = min((block + 1) * block_m, seq) if causal else seq         # keys this query block can see
        needed, every = -(-visible // block_n), -(-seq // block_n)
        for name in (k_name, v_name):
            tiles = traffic.loaded(name) / (block_n * block_d)
            if tiles > needed and causal and tiles <= every:
                passes.append(f"causal: program (head {head}, query block {block}) loads {tiles:.0f} tiles of "
                              f"{name} where {needed} reach its last row: skip the key blocks above the diagonal")
            elif tiles > needed:
                passes.append(f"{name} was read {tiles / needed:.2f} times by program (head {head}, query block "
                              f"{block}): one pass over K and V per query block (the online softmax)")
        if passes:
            break                                    # one program says it; the others would say the same
    others = sorted({name for t in programs.values() for name in t.stores} - {o_name, lse_name})
    if others:
        problems.append(f"the kernel stores through {', '.join(others)}: write O and the lse only")
    return problems + passes


def _attention_data(heads: int, seq: int, head_dim: int, make: str, seed: int):
    """q, k, v (heads, seq, head_dim) fp32, rows head_dim + 8 apart (slices of wider rows, one layout for all
    three), on the kernels' device."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(heads, seq, head_dim + 8, generator=generator) for _ in range(3))
    if make == "rising":        # every key block raises each row's max: the running sum and output must be rescaled
        q = q.abs() + 0.5
        k = 0.3 * k + torch.linspace(0.0, 3.0, seq)[None, :, None]
    storage = _with_room(torch.stack([q, k, v]))
    return tuple(storage[i, :, :, :head_dim] for i in range(3))


def _kernel_ir(kernel, named: dict, constexprs: dict) -> "KernelIR":
    """KernelIR of the kernel for these argument types and constexprs, compiled once while a check runs
    (the cache is an attribute of this function)."""
    fn = _python_function(kernel)
    kinds = tuple((name, str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__)
                  for name, v in named.items() if name not in constexprs)
    key = (fn.__code__, kinds, tuple(sorted(constexprs.items())))
    cache = _kernel_ir.cache
    if key not in cache:
        if len(cache) > 16:
            cache.clear()
        cache[key] = KernelIR(kernel, named, constexprs)
    return cache[key]


_kernel_ir.cache = {}


def _arguments(kernel, args: tuple, constexprs: dict) -> dict:
    """The launch's arguments by the kernel's parameter names (positional ones, then the constexprs)."""
    names = list(inspect.signature(_python_function(kernel)).parameters)
    return {**dict(zip(names, args)), **constexprs}


def _run_case(report: Report, name: str, dtype: torch.dtype, expected: torch.Tensor, buffer: torch.Tensor,
              out: torch.Tensor, x: torch.Tensor, call: Callable[[], None], rstd=None, n: int | None = None,
              traffic: Callable[[], tuple[dict, list[str]]] | None = None) -> None:
    """Run one launch and add its row: output (and rstd) against expected, and nothing written elsewhere.
    n: the roundings behind each fp32 output (default n_cols + 2); traffic(): extra columns and problems."""
    columns = {"case": name, "shape": tuple(out.shape), "dtype": dtype, "row strides": (x.stride(0), out.stride(0))}
    try:
        call()
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - a crash is a failed case, shown in the table
        report.add(ok=False, detail=f"the kernel raised {_first_line(e)}", **columns, max_abs_err=math.inf)
        return
    actual = out.cpu()
    problems = []
    if not _close(actual, expected.cpu(), dtype, out.shape[-1] if n is None else n):
        problems.append("y: " + mismatch(actual.double(), expected.cpu().double()))
        if actual.isnan().any() and not expected.isnan().any():
            problems.append("NaN in the output: an inf / inf, a 0 / 0 or an exp(-inf - (-inf)) somewhere")
    if rstd is not None:
        got, want = rstd[0].cpu(), rstd[1].cpu()
        if not tolerance.close_enough(got, want, n=out.shape[-1] + 2, dtype=torch.float32, tf32=False):
            problems.append("rstd (store 1/sqrt(mean(x^2) + eps) of row r at rstd_ptr + r): "
                            + mismatch(got.double(), want))
    touched = _outside_touched(buffer, out)
    if touched:
        problems.append(f"{touched} values outside the rows were overwritten: mask the store (cols < n_cols) and "
                        "address row r of the output at out_ptr + r * out_row_stride")
    if traffic is not None:
        more_columns, more_problems = traffic()
        columns.update(more_columns)
        problems += more_problems
    err = max_abs_error(actual.double().nan_to_num(nan=math.inf), expected.cpu().double())
    report.add(ok=not problems, detail="; ".join(problems), **columns, max_abs_err=err)


# ---- what the kernel reads and writes, from its Triton IR (the same on a CPU and a GPU) ---------------
# A kernel's rules about traffic (at most BLOCK values a load, two passes over a row, one pass over K and V) are
# checked on its Triton IR (TTIR): the kernel compiled, as far as that first stage, for an H100 (sm_90), which
# triton does on any machine. The IR says the shape of every load and store, which argument its pointer comes
# from and which loops hold it; evaluating the loops' bounds with a program's ids and the launch's integers
# counts how often each runs, for every program of the grid. No kernel runs for this: the counts hold for the
# compiled kernel on a GPU and for the interpreter on a CPU alike, whatever pointers (block pointers, tensor
# descriptors) the kernel uses.
_LOADS = ("tt.load", "tt.descriptor_load", "tt.descriptor_gather")
_STORES = ("tt.store", "tt.descriptor_store", "tt.descriptor_scatter", "tt.atomic_rmw", "tt.atomic_cas")
_POINTER_STEPS = ("tt.addptr", "tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.make_tensor_ptr",
                  "tt.advance", "tt.make_tensor_descriptor", "tt.bitcast", "tt.trans", "arith.select")
_PREDICATES = {"eq": "__eq__", "ne": "__ne__", "slt": "__lt__", "sle": "__le__", "sgt": "__gt__", "sge": "__ge__",
               "ult": "__lt__", "ule": "__le__", "ugt": "__gt__", "uge": "__ge__"}
_ARITH = {"arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
          "arith.divsi": lambda a, b: int(a / b), "arith.divui": lambda a, b: a // b,
          "arith.floordivsi": lambda a, b: a // b, "arith.ceildivsi": lambda a, b: -(-a // b),
          "arith.remsi": lambda a, b: int(math.fmod(a, b)), "arith.remui": lambda a, b: a % b,
          "arith.minsi": min, "arith.maxsi": max, "arith.minui": min, "arith.maxui": max,
          "arith.andi": lambda a, b: a & b, "arith.ori": lambda a, b: a | b, "arith.xori": lambda a, b: a ^ b,
          "arith.shli": lambda a, b: a << b, "arith.shrsi": lambda a, b: a >> b, "arith.shrui": lambda a, b: a >> b}
_CASTS = ("arith.extsi", "arith.extui", "arith.trunci", "arith.bitcast", "arith.index_cast")


class _Unknown(Exception):
    """A loop bound the IR walk cannot evaluate (it depends on loaded data, or on an operation it does not know)."""


@dataclass
class _IROp:
    name: str
    results: list
    operands: list
    text: str
    parent: int | None          # the index of the enclosing scf.for / scf.if / other region op (None: the kernel)
    branch: int = 0             # which of its regions: scf.if 0 then, 1 else
    loop: tuple = ()            # scf.for: (induction variable, lower bound, upper bound, step)


@dataclass
class Traffic:
    """What one program of a kernel loads and stores: for each pointer argument, the values of every load (and
    store) it runs, in order, and the shape of each load site."""

    loads: dict            # argument name -> [values per load executed]
    stores: dict           # argument name -> [values per store executed]
    load_shapes: dict      # argument name -> {shape of a load site}

    def loaded(self, argument: str) -> int:
        return sum(self.loads.get(argument, []))

    def stored(self, argument: str) -> int:
        return sum(self.stores.get(argument, []))


class KernelIR:
    """The Triton IR of `kernel` (a @triton.jit function, interpreted or not) for one launch's argument types and
    constexprs, compiled for an H100 (sm_90) as far as TTIR, on any machine: the operations a check reads.

    traffic(pids, scalars) counts the loads and stores one program runs; largest_dimension() is the longest side of
    any tensor the kernel holds. The IR's value names are local to the region (loop body, branch) that defines
    them, as MLIR prints them: a name is looked up from the region of the operation that uses it outwards."""

    def __init__(self, kernel, args: dict, constexprs: dict):
        self.text = _ttir(kernel, args, constexprs)
        self.arguments = [name for name in args if name not in constexprs]
        self.arg_names = {f"%arg{i}": name for i, name in enumerate(self.arguments)}
        self.ops: list[_IROp] = []
        self.scope: dict = {}              # ((region op, branch), name) -> index of the op that defines it
        self.iter_init: dict = {}          # (loop op, iter_arg name) -> the name of its initial value
        self._parse()

    def _parse(self) -> None:
        head = re.search(r"tt\.func public @\w+\((.*?)\)\s*(?:attributes|\{)", self.text, re.S)
        if head is None:
            raise RuntimeError("no kernel function in the Triton IR")
        stack: list[tuple[int | None, int]] = []   # the open regions: (region op, branch)
        for raw in self.text[head.end():].split("\n"):
            line = raw.strip()
            if not line or line.startswith("^bb"):
                continue
            if line.startswith("}"):
                if stack:
                    region, branch = stack.pop()
                    if line.endswith("{"):                          # } else {
                        stack.append((region, branch + 1))
                continue
            parent, branch = stack[-1] if stack else (None, 0)
            op = self._op(line, parent, branch)
            if op is not None:
                self.ops.append(op)
                for name in op.results:
                    self.scope[((parent, branch), name)] = len(self.ops) - 1
            if line.endswith("{"):
                stack.append((len(self.ops) - 1 if op is not None else None, 0))

    def _op(self, line: str, parent, branch) -> _IROp | None:
        results: list[str] = []
        match = re.match(r"(%\w+)(?::(\d+))?\s*=\s*(.*)", line)
        rest = line
        if match:
            name, count, rest = match.group(1), match.group(2), match.group(3)
            results = [f"{name}#{i}" for i in range(int(count))] if count else [name]
        op_name = re.match(r'"?([\w.]+)"?', rest)
        if op_name is None:
            return None
        op = _IROp(op_name.group(1), results, [], line, parent, branch)
        args = rest[op_name.end():]
        if op.name == "scf.for":
            loop = re.match(r"\s*(%\w+) = (%[\w#]+) to (%[\w#]+) step (%[\w#]+)(?: iter_args\((.*?)\))?", args)
            op.loop = loop.group(1, 2, 3, 4)
            for pair in (loop.group(5) or "").split(","):
                if "=" in pair:
                    inner, init = (part.strip() for part in pair.split("="))
                    self.iter_init[(len(self.ops), inner)] = init
            op.operands = list(op.loop[1:])
        else:
            op.operands = re.findall(r"%[\w#]+", args.split(" : ")[0])
        return op

    def _lookup(self, name: str, at: int):
        """What `name`, used by op `at`, refers to: ("op", index), ("iter", loop index), ("arg", name) or None."""
        if name in self.arg_names:
            return "arg", self.arg_names[name]
        region = (self.ops[at].parent, self.ops[at].branch)
        while True:
            if (region, name) in self.scope:
                return "op", self.scope[(region, name)]
            if region[0] is None:
                return None
            if (region[0], name) in self.iter_init:
                return "iter", region[0]
            region = (self.ops[region[0]].parent, self.ops[region[0]].branch)

    # -- pointers and shapes --
    def base(self, name: str, at: int, seen=None) -> set:
        """The kernel arguments a pointer value (`name`, used by op `at`) is derived from."""
        seen = set() if seen is None else seen
        if (name, at) in seen:
            return set()
        seen.add((name, at))
        found = self._lookup(name, at)
        if found is None:
            return set()
        kind, where = found
        if kind == "arg":
            return {where}
        if kind == "iter":
            return self.base(self.iter_init[(where, name)], where, seen)
        op = self.ops[where]
        if op.name not in _POINTER_STEPS or not op.operands:
            return set()
        sources = op.operands[1:3] if op.name == "arith.select" else op.operands[:1]
        return set().union(*(self.base(source, where, seen) for source in sources))

    @staticmethod
    def shape(op: _IROp) -> tuple:
        """The shape of the tile a load or store moves (() for one value)."""
        types = op.text.split(" : ")[-1]
        tile = re.search(r"tensor<((?:\d+x)*\d+)x", types)
        return tuple(int(d) for d in tile.group(1).split("x")) if tile else ()

    def largest_dimension(self) -> tuple[int, str]:
        """The longest side of any tensor in the kernel, and that tensor's shape as the IR writes it."""
        shapes = re.findall(r"tensor<((?:\d+x)*\d+)x", self.text)
        if not shapes:
            return 0, ""
        shape = max(shapes, key=lambda s: max(int(d) for d in s.split("x")))
        return max(int(d) for d in shape.split("x")), shape

    # -- counting what one program runs --
    def traffic(self, pids: tuple[int, ...], scalars: dict) -> Traffic:
        """The loads and stores program `pids` runs, with the kernel's integer arguments `scalars` (by name)."""
        children: dict = {}
        for index, op in enumerate(self.ops):
            children.setdefault((op.parent, op.branch), []).append(index)
        traffic = Traffic({}, {}, {})
        self._steps = 0
        self._run((None, 0), {}, pids, scalars, children, traffic)
        return traffic

    def _run(self, region, env, pids, scalars, children, traffic) -> None:
        for index in children.get(region, []):
            op = self.ops[index]
            if op.name == "scf.for":
                iv, lower, upper, step = op.loop
                lo, hi, by = (self._value(v, index, env, pids, scalars) for v in (lower, upper, step))
                if by <= 0:
                    raise _Unknown(f"a loop with step {by}")
                for value in range(lo, hi, by):
                    self._steps += 1
                    if self._steps > 100_000:
                        raise _Unknown("more than 100,000 loop iterations in one program")
                    self._run((index, 0), {**env, iv: value}, pids, scalars, children, traffic)
            elif op.name == "scf.if":
                try:
                    taken = [0 if self._value(op.operands[0], index, env, pids, scalars) else 1]
                except _Unknown:
                    taken = [0, 1]                     # a condition on loaded data: count both branches
                for branch in taken:
                    self._run((index, branch), env, pids, scalars, children, traffic)
            elif op.name == "scf.while" and any(o.name in _LOADS + _STORES for o in self.ops[index:]
                                                if self._inside(o, index)):
                raise _Unknown("a while loop (write the loop as `for start in range(lo, hi, BLOCK)`)")
            elif op.name in _LOADS or op.name in _STORES:
                values = math.prod(self.shape(op))
                table = traffic.loads if op.name in _LOADS else traffic.stores
                for argument in self.base(op.operands[0], index) or {"an unknown pointer"}:
                    table.setdefault(argument, []).append(values)
                    if op.name in _LOADS:
                        traffic.load_shapes.setdefault(argument, set()).add(self.shape(op))

    def _inside(self, op: _IROp, region_op: int) -> bool:
        while op.parent is not None:
            if op.parent == region_op:
                return True
            op = self.ops[op.parent]
        return False

    def _value(self, name: str, at: int, env: dict, pids, scalars: dict) -> int:
        """The integer value of a scalar (`name`, used by op `at`) in one program."""
        if name in env:
            return env[name]
        found = self._lookup(name, at)
        if found is None or found[0] == "iter":
            raise _Unknown(f"{name} (a value carried from one loop iteration to the next)")
        if found[0] == "arg":
            if not isinstance(scalars.get(found[1]), int):
                raise _Unknown(f"the argument {found[1]}, which is not an integer")
            return scalars[found[1]]
        index = found[1]
        op = self.ops[index]
        if op.name == "arith.constant":
            constant = re.search(r"arith\.constant (-?\d+|true|false)\b", op.text)
            if constant is None:
                raise _Unknown(op.text)
            token = constant.group(1)
            return 1 if token == "true" else 0 if token == "false" else int(token)
        if op.name == "tt.get_program_id":
            return pids["xyz".index(re.search(r"get_program_id (\w)", op.text).group(1))]
        values = [self._value(operand, index, env, pids, scalars) for operand in op.operands]
        if op.name in _ARITH:
            return _ARITH[op.name](*values)
        if op.name in _CASTS:
            return values[0]
        if op.name == "arith.select":
            return values[1] if values[0] else values[2]
        if op.name == "arith.cmpi":
            predicate = re.search(r"arith\.cmpi (\w+),", op.text).group(1)
            return int(getattr(values[0], _PREDICATES[predicate])(values[1]))
        raise _Unknown(f"{op.name} in a loop bound")


def _ttir(kernel, args: dict, constexprs: dict) -> str:
    """The kernel's TTIR for an H100 (sm_90): `args` by name (tensors give their pointer type, Python floats are
    fp32, ints i32), `constexprs` by name. Works in the interpreter too (see _compilable)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    types = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64"}
    signature = {name: "constexpr" if name in constexprs else types[value.dtype] if isinstance(value, torch.Tensor)
                 else "fp32" if isinstance(value, float) else "i32" for name, value in args.items()}
    with _compilable(kernel) as function:
        source = ASTSource(fn=function, signature=signature, constexprs=constexprs)
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options({"num_warps": 4})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = source.make_ir(target, options, backend.get_codegen_implementation(options),
                                backend.get_module_map(), context)
        stages: dict = {}
        backend.add_stages(stages, options, source.language)
        module = stages["ttir"](module, {})        # inline helpers, fold constants: the first stage only
        text = module.str_nodebug()
        del module
        return text


@contextmanager
def _compilable(kernel) -> Iterator:
    """A JITFunction of the kernel's Python function, for the compiler, while this block lasts.

    In the interpreter, the kernel, the @triton.jit helpers it calls and triton.language's own @jit functions
    (tl.max, tl.sum, ...) are interpreted functions, which the compiler cannot call: the kernel and its helpers
    are rewrapped in copies of their globals, and triton.language's are swapped for compilable ones until the
    block ends (nothing runs meanwhile)."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    interpreted = _interpreted_type()
    swapped = []
    if interpreted is not None:
        import triton.language as tl
        _undo_interpreter_patches()
        made: dict = {}
        modules = [module for name, module in list(sys.modules.items())
                   if module is not None and (name == "triton.language" or name.startswith("triton.language."))]
        for namespace in [*modules, tl.tensor]:
            for name, value in list(vars(namespace).items()):
                if isinstance(value, interpreted):
                    made.setdefault(id(value), JITFunction(value.fn))
                    swapped.append((namespace, name, value))
                    setattr(namespace, name, made[id(value)])
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            yield _jit_copy(_python_function(kernel), {}, interpreted)
    finally:
        for namespace, name, value in swapped:
            setattr(namespace, name, value)


def _language_namespaces() -> list:
    import triton.language as tl
    return [tl, tl.core, tl.math, tl.tensor, tl.dtype, tl.condition, tl.core.tensor_descriptor_base]


def _language_state() -> list:
    """Every attribute of the triton.language namespaces the interpreter patches, as they are now."""
    return [(namespace, dict(vars(namespace))) for namespace in _language_namespaces()] if INTERPRETED and TRITON \
        else []


def _undo_interpreter_patches() -> None:
    """Put triton.language back as it was when this module was imported. The interpreter patches it while a
    kernel runs and undoes that at the end, except for what a @jit library function it calls (tl.max, ...) patched
    in turn (triton 3.9): left as is, the compiler cannot read a kernel any more."""
    for namespace, attributes in _undo_interpreter_patches.pristine:
        for name in set(vars(namespace)) - set(attributes):
            delattr(namespace, name)
        for name, value in attributes.items():
            if vars(namespace).get(name, _MISSING) is not value:
                setattr(namespace, name, value)


_MISSING = object()


def _interpreted_type():
    if not INTERPRETED:
        return None
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


def _python_function(kernel):
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def _jit_copy(fn, made: dict, interpreted):
    """JITFunction(fn), with every interpreted @triton.jit function among its globals made compilable too."""
    from triton.runtime.jit import JITFunction

    if id(fn) in made:
        return made[id(fn)]
    names = dict(fn.__globals__)
    copy = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
    made[id(fn)] = JITFunction(copy)
    if interpreted is not None:
        for name, value in list(names.items()):
            if isinstance(value, interpreted):
                names[name] = _jit_copy(value.fn, made, interpreted)
    return made[id(fn)]


# triton.language before any kernel ran here (see _compilable), kept as an attribute of the function.
_undo_interpreter_patches.pristine = _language_state()

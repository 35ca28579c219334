"""The checks of assignment 09: a fused row-softmax kernel, an RMSNorm forward kernel, an online softmax for rows
longer than one block and (the stretch) the FlashAttention forward, in Triton, declared on the course's engine
(picotron_course.engine). The misconceptions before each check are wrong kernels learners write, with the hint each
should read: each is a thin kernel that calls the check's base kernel (the right one, written once) with its MISTAKE,
a constexpr the compiler resolves, so a record's Triton IR holds only its own mistake.

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
from picotron_course.engine import AtMost, Check, Close, Exact, Misconception, Said, per_case
from picotron.kernels.runtime import INTERPRETED, TRITON, kernel_device   # interpreter or compiler, before any kernel
if TRITON:   # after the runtime chose the interpreter or the compiler
    import triton
    import triton.language as tl  # noqa: F401  (the records' annotations name tl.constexpr)
    jit = triton.jit
else:        # importable without triton: the grader reads REQUIRES and refuses assignment 09; no record runs here
    def jit(fn: Callable) -> Callable:
        return fn

__all__ = ["check_softmax_kernel", "check_rmsnorm_kernel", "check_online_softmax_kernel",
           "check_flash_attention_kernel", "SOFTMAX_CASES", "RMSNORM_CASES", "ONLINE_SOFTMAX_CASES", "FLASH_CASES",
           "KernelIR", "launch"]

REQUIRES = ("triton",)   # the grader refuses to grade assignment 09 where these are not installed
REQUIRES_WHY = "it is built for Linux only: use Linux or WSL"

WHERE = "the Triton interpreter (CPU)" if INTERPRETED else "a compiled GPU kernel"
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


# ---- softmax: the misconceptions, wrong kernels learners write --------------------------------------------------
@jit
def _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr, MISTAKE: tl.constexpr):
    """softmax_kernel, right when MISTAKE is "", else with that mistake."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    if MISTAKE == "one_stride":                   # rows addressed as row * n_cols: right only when contiguous
        x_row_stride, out_row_stride = n_cols, n_cols
    x_row = x_ptr if MISTAKE == "first_row" else x_ptr + row * x_row_stride    # program_id forgotten in the load
    padding = 0.0 if MISTAKE == "pads_with_zero" else float("-inf")           # 0: each adds exp(-max) to the sum
    x = tl.load(x_row + cols, mask=cols < n_cols, other=padding).to(tl.float32)
    e = tl.exp(x) if MISTAKE == "no_max" else tl.exp(x - tl.max(x, axis=0))  # no max: exp(2000) overflows
    if MISTAKE == "unmasked_store":               # all BLOCK lanes written: past the end of the row
        tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0))
    else:
        tl.store(out_ptr + row * out_row_stride + cols, e / tl.sum(e, axis=0), mask=cols < n_cols)


@jit
def softmax_no_max(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "no_max")


@jit
def softmax_pads_with_zero(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "pads_with_zero")


@jit
def softmax_one_stride(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "one_stride")


@jit
def softmax_unmasked_store(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "unmasked_store")


@jit
def softmax_of_first_row(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "first_row")


# ---- softmax, declared on the engine (picotron_course.engine) ------------------------------------------
@dataclass(frozen=True)
class RowClose(Close):
    """Equal to the float64 math up to round-off (_close: in fp32, 2 roundings more than n_cols, or than the
    expected tensor's own `roundings` (online softmax: n_cols + 2 per block + 2); two in bf16)."""

    def close(self, got, want) -> bool:
        return got.shape == want.shape and _close(got, want, want.dtype, getattr(want, "roundings", want.shape[-1]))


RAISED = Said("the kernel raised")
NAN = Exact("NaN in the output (an inf / inf, a 0 / 0 or an exp(-inf - (-inf)) somewhere)")
OUTSIDE = Exact("values outside the rows overwritten (mask the store (cols < n_cols) and address row r of the "
                "output at out_ptr + r * out_row_stride)")
ROW_QUANTITIES = {"raised": RAISED, "NaN": NAN, "y": RowClose("y"), "outside": OUTSIDE}


def _softmax_case(seed: int, name, rows, n_cols, dtype, stride, padding, make) -> dict:
    x = _data(rows, n_cols, dtype, stride, make, seed)
    return {"case": name, "shape": (rows, n_cols), "dtype": dtype,
            "row strides": (x.stride(0), n_cols + padding), "_x": x, "_padding": padding}


def _observe(run: Callable) -> Callable:
    """observe(answers, cases) from run(kernel, case) -> what the kernel did on the case: {"raised": ""} and run's
    observations, or what it raised (a crash is a failed case, shown in the table; an unsolved kernel's
    NotImplementedError goes through)."""
    def observed(kernel, case: dict) -> dict:
        try:
            return {"raised": "", **run(kernel, case)}
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a crash is a failed case, shown in the table
            return {"raised": _first_line(e)}
    return lambda answers, cases: [[observed(kernel, case) for case in cases] for kernel in answers]


def _observe_rows(run: Callable) -> Callable:
    """observe(answers, cases) for a kernel with one program per row: what it raised, its output (and what
    run(kernel, case, out) returns: rstd, traffic), and how many values outside the rows it overwrote."""
    def rows(kernel, case: dict) -> dict:
        buffer, out = _output_buffer(*case["shape"], case["_padding"], case["dtype"])
        more = run(kernel, case, out)
        y = out.cpu()
        return {"NaN": int(y.isnan().sum()), "y": y, **more, "outside": _outside_touched(buffer, out)}
    return _observe(rows)


def _run_softmax(kernel, case: dict, out: torch.Tensor) -> dict:
    x = case["_x"]
    launch(kernel, (out.shape[0],), x, out, out.shape[1], x.stride(0), out.stride(0), BLOCK=_block(out.shape[1]))
    return {}


def expect_softmax(case: dict, observed: dict) -> dict:
    return {"raised": "", "NaN": 0, "y": torch.softmax(case["_x"].cpu().double(), dim=-1).to(case["dtype"]),
            "outside": 0}


SOFTMAX = Check(
    "softmax_kernel", requires=REQUIRES, cases=[_softmax_case(seed, *case) for seed, case in enumerate(SOFTMAX_CASES)],
    observe=_observe_rows(_run_softmax), expect=expect_softmax, course="picotron.kernels",
    note=f"one program per row, in {WHERE}; expected = torch.softmax in float64",
    quantities=ROW_QUANTITIES,
    misconceptions=[
        Misconception(softmax_no_max, "subtract the row's max before exp: exp(2000) overflows to inf, and inf / inf "
                                      "is NaN; softmax(x - max) is the same softmax"),
        Misconception(softmax_pads_with_zero, "load the padding lanes (cols >= n_cols) as -inf, not 0: a 0 lane "
                                              "adds exp(0 - max) to the sum (and can win the max)"),
        Misconception(softmax_one_stride, "address row r at x_ptr + r * x_row_stride and out_ptr + r * "
                                          "out_row_stride: rows are n_cols apart only in a contiguous tensor"),
        Misconception(softmax_unmasked_store, "mask the store with cols < n_cols: the BLOCK - n_cols padding lanes "
                                              "write past the end of the row"),
        Misconception(softmax_of_first_row, "each program handles its own row: offset the load by "
                                            "tl.program_id(0) * x_row_stride")])


def check_softmax_kernel(softmax_kernel) -> None:
    """Launch softmax_kernel with one program per row on each case of SOFTMAX_CASES; compare with float64 torch."""
    SOFTMAX(softmax_kernel)


# ---- RMSNorm: the misconceptions ------------------------------------------------------------------
@jit
def _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr,
             MISTAKE: tl.constexpr):
    """rmsnorm_kernel, right when MISTAKE is "", else with that mistake. The mistakes about rstd (and the missing
    weight) also leave x * rstd unrounded to x's dtype, as the learners who make them write it."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x * x, axis=0) / (BLOCK if MISTAKE == "mean_over_block" else n_cols)   # BLOCK: the padded width
    if MISTAKE != "no_eps":
        mean = mean + eps
    rstd = tl.sqrt(mean) if MISTAKE == "std_not_rstd" else tl.rsqrt(mean)   # sqrt: multiplies by the rms
    normed = x * rstd
    if MISTAKE == "" or MISTAKE == "forgets_rstd" or MISTAKE == "input_stride_for_output":
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    if MISTAKE != "no_weight":
        normed = normed * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if MISTAKE == "input_stride_for_output":      # output rows written with the input's row stride
        out_row_stride = x_row_stride
    tl.store(out_ptr + row * out_row_stride + cols, normed, mask=inside)
    if MISTAKE != "forgets_rstd":                 # backward's rstd never stored
        tl.store(rstd_ptr + row, rstd)


@jit
def rmsnorm_mean_over_block(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                            BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "mean_over_block")


@jit
def rmsnorm_no_eps(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "no_eps")


@jit
def rmsnorm_no_weight(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "no_weight")


@jit
def rmsnorm_forgets_rstd(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                         BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "forgets_rstd")


@jit
def rmsnorm_std_not_rstd(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                         BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "std_not_rstd")


@jit
def rmsnorm_input_stride_for_output(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                                    BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK,
             "input_stride_for_output")


# ---- RMSNorm, declared on the engine ------------------------------------------------------------------
@dataclass(frozen=True)
class RstdClose(Close):
    """rstd in fp32 against float64, up to n_cols + 2 roundings (the expected tensor carries n_cols)."""

    def close(self, got, want) -> bool:
        n = getattr(want, "roundings", 1)      # against a misconception's own rstd (no roundings): the same numbers
        return tolerance.close_enough(got, want, n=n, dtype=torch.float32, tf32=False)


def _rmsnorm_case(seed: int, name, rows, n_cols, dtype, stride, padding, make, eps) -> dict:
    case = _softmax_case(seed, name, rows, n_cols, dtype, stride, padding, make)
    weight = 1 + 0.5 * torch.randn(n_cols, generator=torch.Generator().manual_seed(100 + seed))
    return {**case, "_weight": _with_room(weight.to(dtype)), "_eps": eps}


def _run_rmsnorm(kernel, case: dict, out: torch.Tensor) -> dict:
    x, (rows, n_cols) = case["_x"], out.shape
    rstd = _with_room(torch.full((rows,), SENTINEL), fill=SENTINEL)
    launch(kernel, (rows,), x, case["_weight"], out, rstd, n_cols, x.stride(0), out.stride(0), case["_eps"],
           BLOCK=_block(n_cols))
    return {"rstd": rstd.cpu()}


def expect_rmsnorm(case: dict, observed: dict) -> dict:
    x, dtype = case["_x"].cpu().double(), case["dtype"]
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1) + case["_eps"])                        # (rows,)
    normed = (x * rstd[:, None]).to(dtype).double()                                  # rounded as x
    y = (normed * case["_weight"].cpu().double()).to(dtype)
    return {"raised": "", "NaN": 0, "rstd": per_case(rstd, n=x.shape[-1] + 2), "y": y, "outside": 0}


RMSNORM = Check(
    "rmsnorm_kernel", requires=REQUIRES, cases=[_rmsnorm_case(seed, *case) for seed, case in enumerate(RMSNORM_CASES)],
    observe=_observe_rows(_run_rmsnorm), expect=expect_rmsnorm, course="picotron.kernels",
    note=(f"one program per row, in {WHERE}; expected: rstd = 1/sqrt(mean(x^2) + eps), "
          "y = w * (x rstd, rounded to x's dtype), in float64"),
    quantities={"raised": RAISED, "NaN": NAN,
                "rstd": RstdClose("rstd (store 1/sqrt(mean(x^2) + eps) of row r at rstd_ptr + r)"),
                "y": RowClose("y"), "outside": OUTSIDE},
    misconceptions=[
        Misconception(rmsnorm_mean_over_block, "divide the sum of squares by n_cols, not BLOCK: the padding lanes "
                                               "are not columns of the row"),
        Misconception(rmsnorm_no_eps, "add eps inside the square root: rstd = 1 / sqrt(mean(x^2) + eps)"),
        Misconception(rmsnorm_no_weight, "multiply the normalized row by the weight w (loaded at w_ptr + cols, "
                                         "masked like x)"),
        Misconception(rmsnorm_forgets_rstd, "store each row's rstd at rstd_ptr + r: the backward reads it"),
        Misconception(rmsnorm_std_not_rstd, "rstd is 1 / sqrt(mean(x^2) + eps): multiply x by it, not by the root "
                                            "mean square"),
        Misconception(rmsnorm_input_stride_for_output, "address output row r at out_ptr + r * out_row_stride: "
                                                       "x_row_stride is the input's")])


def check_rmsnorm_kernel(rmsnorm_kernel) -> None:
    """Launch rmsnorm_kernel with one program per row on each case of RMSNORM_CASES; compare y and rstd with
    float64 torch."""
    RMSNORM(rmsnorm_kernel)


# ---- online softmax: the misconceptions ------------------------------------------------
@jit
def _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr,
                    MISTAKE: tl.constexpr):
    """online_softmax_kernel, right when MISTAKE is "" (the running max is shifted by 0 while it is -inf), else
    with that mistake."""
    row = tl.program_id(0)
    if MISTAKE == "contiguous_rows":              # rows addressed as row * n_cols: right only when contiguous
        x_row_stride, out_row_stride = n_cols, n_cols
    if MISTAKE == "one_big_block":                # BLOCK ignored: the whole row (up to 8192 columns) at once
        cols = tl.arange(0, 8192)
        inside = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        y = e / tl.sum(e, axis=0)
        tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)
    else:
        cols = tl.arange(0, BLOCK)
        # a finite start hides the NaN of a first block of only -inf, which these mistakes are not about
        m = -1e38 if MISTAKE == "no_rescale" or MISTAKE == "rescale_inverted" or MISTAKE == "store_then_fix" \
            else float("-inf")
        total = 0.0
        if MISTAKE == "lanes_from_minus_inf":     # a running max per lane started at -inf: a lane of only -inf is nan
            m = tl.full([BLOCK], float("-inf"), tl.float32)
            total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            inside = (cols if MISTAKE == "unmasked_tail" else start + cols) < n_cols   # cols: the tail runs over
            x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
            if MISTAKE == "no_max":                   # exp(x) summed: overflows for large scores
                total += tl.sum(tl.exp(x), axis=0)
            elif MISTAKE == "three_passes":           # the max only: the sum takes a pass of its own
                m = tl.maximum(m, tl.max(x, axis=0))
            elif MISTAKE == "no_rescale":             # the old sum kept against a smaller max
                m = tl.maximum(m, tl.max(x, axis=0))
                total = total + tl.sum(tl.exp(x - m), axis=0)
            elif MISTAKE == "lanes_from_minus_inf":
                new_m = tl.maximum(m, x)
                total = total * tl.exp(m - new_m) + tl.exp(x - new_m)
                m = new_m
            else:
                new_m = tl.maximum(m, tl.max(x, axis=0))
                if MISTAKE == "rescale_inverted":     # exp(new_m - m), capped to stay finite
                    total = total * tl.exp(tl.minimum(new_m - m, 80.0)) + tl.sum(tl.exp(x - new_m), axis=0)
                elif MISTAKE == "nan_after_masked_block" or MISTAKE == "store_then_fix":   # no care for m = -inf
                    total = total * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
                else:
                    shift = tl.where(new_m == float("-inf"), 0.0, new_m)
                    total = total * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
                m = new_m
                if MISTAKE == "store_then_fix":       # exp(x - running max) stored now, re-read and fixed later
                    tl.store(out_ptr + row * out_row_stride + start + cols, tl.exp(x - m), mask=inside)
        if MISTAKE == "three_passes":
            for start in range(0, n_cols, BLOCK):
                x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                            other=float("-inf")).to(tl.float32)
                total += tl.sum(tl.exp(x - m), axis=0)
        if MISTAKE == "lanes_from_minus_inf":         # the lanes merged into the row's max and sum
            row_m = tl.max(m, axis=0)
            total = tl.sum(total * tl.exp(m - row_m), axis=0)
            m = row_m
        for start in range(0, n_cols, BLOCK):
            inside = (cols if MISTAKE == "unmasked_tail" else start + cols) < n_cols
            if MISTAKE == "store_then_fix":
                e = tl.load(out_ptr + row * out_row_stride + start + cols, mask=inside, other=0.0)
            x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
            y = tl.exp(x) / total if MISTAKE == "no_max" else tl.exp(x - m) / total
            if MISTAKE == "store_then_fix":
                y = y + 0.0 * e
            tl.store(out_ptr + row * out_row_stride + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@jit
def online_nan_after_masked_block(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "nan_after_masked_block")


@jit
def online_no_rescale(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "no_rescale")


@jit
def online_rescale_inverted(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "rescale_inverted")


@jit
def online_three_passes(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "three_passes")


@jit
def online_store_then_fix(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "store_then_fix")


@jit
def online_one_big_block(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "one_big_block")


@jit
def online_unmasked_tail(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "unmasked_tail")


@jit
def online_lanes_from_minus_inf(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "lanes_from_minus_inf")


@jit
def online_no_max(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "no_max")


@jit
def online_contiguous_rows(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "contiguous_rows")


# ---- online softmax, declared on the engine ---------------------------------------------------------------
def _online_case(seed: int, name, rows, n_cols, block, dtype, stride, padding, make) -> dict:
    masked = make == "first block masked"
    case = _softmax_case(200 + seed, name, rows, n_cols, dtype, stride, padding, "randn" if masked else make)
    if masked:
        case["_x"][:, :block] = float("-inf")        # a row that starts with masked keys (a padded prompt)
    return {**case, "_block": block}


def _run_online(kernel, case: dict, out: torch.Tensor) -> dict:
    x, (rows, n_cols), block = case["_x"], out.shape, case["_block"]
    args = (x, out, n_cols, x.stride(0), out.stride(0))
    launch(kernel, (rows,), *args, BLOCK=block)
    return _online_traffic(kernel, args, block, rows, n_cols)


def _online_traffic(kernel, args: tuple, block: int, rows: int, n_cols: int) -> dict:
    """What each program loads and stores, per element of its row, from the kernel's IR: the widest load, the
    loads and stores of an element (the most of any program), the arguments stored through other than the output;
    or why they could not be counted."""
    named = _arguments(kernel, args, {"BLOCK": block})
    try:
        kernel_ir = _kernel_ir(kernel, named, {"BLOCK": block})
        programs = [kernel_ir.traffic((row, 0, 0), named) for row in range(rows)]
    except _Unknown as e:
        return {"counted": f"could not count what the kernel loads: {e}"}
    except Exception as e:  # noqa: BLE001 - a kernel the compiler refuses is a failed case, said in one line
        return {"counted": f"could not compile the kernel to count its loads: {_first_line(e)}"}
    x_name, out_name = list(named)[:2]
    padded = -(-n_cols // block) * block               # the values a row's blocks cover
    return {"counted": "",
            "widest": max((math.prod(shape) for p in programs for shapes in p.load_shapes.values()
                           for shape in shapes), default=0),
            "loads": max(p.loaded(x_name) + p.loaded(out_name) for p in programs) / padded,
            "stores": max(p.stored(out_name) for p in programs) / padded,
            "other stores": sorted({name for p in programs for name in p.stores} - {out_name})}


def expect_online(case: dict, observed: dict) -> dict:
    n_cols, block = case["shape"][1], case["_block"]
    y = torch.softmax(case["_x"].cpu().double(), dim=-1).to(case["dtype"])
    return {"raised": "", "counted": "", "widest": block, "loads": 2, "stores": 1, "other stores": [], "NaN": 0,
            "y": per_case(y, n=n_cols + 2 * -(-n_cols // block) + 2), "outside": 0}


def _traffic_columns(case: dict, observed: dict) -> dict:
    return {"BLOCK": case["_block"], **{f"{k}/elem": f"{observed[k]:.2f}" for k in ("loads", "stores")
                                        if isinstance(observed.get(k), float)}}


ONLINE_SOFTMAX = Check(
    "online_softmax_kernel", requires=REQUIRES,
    cases=[_online_case(seed, *case) for seed, case in enumerate(ONLINE_SOFTMAX_CASES)],
    observe=_observe_rows(_run_online), expect=expect_online, columns=_traffic_columns, course="picotron.kernels",
    note=(f"one program per row, BLOCK columns at a time, in {WHERE}; expected = torch.softmax in float64; "
          "loads and stores counted on the kernel's Triton IR"),
    quantities={"raised": RAISED, "counted": Said("the count of loads and stores on the kernel's Triton IR"),
                "widest": AtMost("the widest load", rule="one load read {got} values at once; BLOCK is {want}: walk "
                                                          "the row BLOCK columns at a time"),
                "stores": AtMost("stores of each element", rule="each element was stored {got:.2f} times: once, "
                                 "in the second pass"),
                "loads": AtMost("loads of each element", rule="each element was loaded {got:.2f} times: at most "
                                "{want} (a first pass keeps the running max and sum, a second writes the output)"),
                "other stores": Exact("the arguments stored through besides the output (write the output only)"),
                "NaN": NAN, "y": RowClose("y"), "outside": OUTSIDE},
    misconceptions=[
        Misconception(online_nan_after_masked_block, "a block of only -inf leaves the running max at -inf, and "
                      "exp(m - new_m) = exp(-inf - (-inf)) is NaN: rescale only where the max is finite"),
        Misconception(online_no_rescale, "when a block raises the running max m, rescale the running sum by "
                                         "exp(m_old - m_new) before adding the block's terms"),
        Misconception(online_rescale_inverted, "the running sum is rescaled by exp(m_old - m_new) (at most 1), not "
                                               "exp(m_new - m_old)"),
        Misconception(online_unmasked_tail, "mask each block with start + cols < n_cols: the ragged last block "
                                            "reads and writes past the row"),
        Misconception(online_lanes_from_minus_inf, "a lane that has seen only -inf (padding, masked scores) turns "
                      "NaN: keep one running max per row (a scalar), or guard the lanes that are still -inf"),
        Misconception(online_no_max, "subtract the running max before exp: exp(2000) overflows to inf"),
        Misconception(online_contiguous_rows, "address row r at x_ptr + r * x_row_stride and out_ptr + r * "
                                              "out_row_stride: rows are n_cols apart only in a contiguous tensor"),
        Misconception(online_three_passes, "two passes over the row: the first keeps the running max and the "
                                           "rescaled sum together, the second writes the output"),
        Misconception(online_store_then_fix, "store each element once, in the second pass, when the row's max and "
                                             "sum are known"),
        Misconception(online_one_big_block, "load BLOCK columns at a time in a loop over the row, not the whole "
                                            "row at once")])


def check_online_softmax_kernel(online_softmax_kernel) -> None:
    """Launch online_softmax_kernel with one program per row and a BLOCK smaller than the row, on each case of
    ONLINE_SOFTMAX_CASES; compare with float64 torch.softmax. From the kernel's Triton IR (the same on a CPU and
    a GPU), count what each program loads and stores: at most BLOCK values a load, two loads and one store of
    each element."""
    ONLINE_SOFTMAX(online_softmax_kernel)


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


# ---- FlashAttention: the misconceptions, each breaking one thing the task states ---------------------
@jit
def _tile(ptr, head, head_stride, row_stride, first, seq_len, head_dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows, dims = first + tl.arange(0, ROWS), tl.arange(0, BLOCK_D)
    return tl.load(ptr + head * head_stride + rows[:, None] * row_stride + dims[None, :],
                   mask=(rows[:, None] < seq_len) & (dims[None, :] < head_dim), other=0.0)


@jit
def _scores(q, k, cols, rows, seq_len, scale, CAUSAL: tl.constexpr):
    """q k^T scale, -inf where a key is past seq_len or (causal) after the query."""
    visible = cols[None, :] < seq_len
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None])
    return tl.where(visible, tl.dot(q, tl.trans(k)) * scale, float("-inf"))


@jit
def _step(acc, l, m, q, k, v, cols, rows, seq_len, scale, CAUSAL: tl.constexpr, MISTAKE: tl.constexpr):
    """One key block folded into (acc, l, m): the online softmax, rescaling l and acc as the max rises."""
    s = _scores(q, k, cols, rows, seq_len, scale, CAUSAL)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    if MISTAKE == "no_rescale":                   # the output so far not rescaled when the max rises (l is)
        acc = acc + tl.dot(p, v)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, l * alpha + tl.sum(p, axis=1), m_new


@jit
def _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, MISTAKE: tl.constexpr):
    """flash_attention_kernel, right when MISTAKE is "", else with that mistake."""
    head, start_m = tl.program_id(0), tl.program_id(1) * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    if MISTAKE == "rows_head_dim_apart":          # right only for contiguous q, k, v
        head_stride, row_stride = seq_len * head_dim, head_dim
    q = _tile(q_ptr, head, head_stride, row_stride, start_m, seq_len, head_dim, BLOCK_M, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if MISTAKE == "whole_rows_of_scores":         # not tiled: every key (up to 128) in one go
        k = _tile(k_ptr, head, head_stride, row_stride, 0, seq_len, head_dim, 128, BLOCK_D)
        v = _tile(v_ptr, head, head_stride, row_stride, 0, seq_len, head_dim, 128, BLOCK_D)
        acc, l, m = _step(acc, l, m, q, k, v, tl.arange(0, 128), rows, seq_len, scale, CAUSAL, MISTAKE)
    else:
        KEYS: tl.constexpr = 2 * BLOCK_N if MISTAKE == "double_key_tiles" else BLOCK_N   # double: 2 tiles a load
        # every key block, causal or not: the masked ones above the diagonal computed too
        hi = tl.minimum(start_m + BLOCK_M, seq_len) if CAUSAL and MISTAKE != "causal_computes_every_block" \
            else seq_len
        if MISTAKE == "two_passes":               # not online: a first pass over K finds each row's max
            for start_n in range(0, hi, BLOCK_N):
                k = _tile(k_ptr, head, head_stride, row_stride, start_n, seq_len, head_dim, BLOCK_N, BLOCK_D)
                s = _scores(q, k, start_n + tl.arange(0, BLOCK_N), rows, seq_len, scale, CAUSAL)
                m = tl.maximum(m, tl.max(s, axis=1))
        for start_n in range(0, hi, KEYS):
            k = _tile(k_ptr, head, head_stride, row_stride, start_n, seq_len, head_dim, KEYS, BLOCK_D)
            v = _tile(v_ptr, head, head_stride, row_stride, start_n, seq_len, head_dim, KEYS, BLOCK_D)
            cols = start_n + tl.arange(0, KEYS)
            if MISTAKE == "diagonal_excluded":    # causal mask cols < rows: a query does not see its own key
                cols = cols + CAUSAL
            acc, l, m = _step(acc, l, m, q, k, v, cols, rows, seq_len, scale, CAUSAL, MISTAKE)
    lse = m if MISTAKE == "stores_the_max" else m + tl.log(l)      # the max: without log l
    dims = tl.arange(0, BLOCK_D)
    tl.store(o_ptr + head * o_head_stride + rows[:, None] * o_row_stride + dims[None, :], acc / l[:, None],
             mask=(rows[:, None] < seq_len) & (dims[None, :] < head_dim))
    tl.store(lse_ptr + head * seq_len + rows, lse, mask=rows < seq_len)


@jit
def flash_causal_computes_every_block(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride,
                                      row_stride, o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr,
                                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "causal_computes_every_block")


@jit
def flash_two_passes(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                     o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "two_passes")


@jit
def flash_double_key_tiles(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                           o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "double_key_tiles")


@jit
def flash_whole_rows_of_scores(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                               o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "whole_rows_of_scores")


@jit
def flash_stores_the_max(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                         o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "stores_the_max")


@jit
def flash_no_rescale(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                     o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "no_rescale")


@jit
def flash_diagonal_excluded(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                            o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "diagonal_excluded")


@jit
def flash_rows_head_dim_apart(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                              o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "rows_head_dim_apart")


# ---- the stretch: FlashAttention forward, declared on the engine -------------------------------------------
TF32 = not INTERPRETED            # a compiled fp32 tl.dot runs in TF32 unless told input_precision="ieee"


@dataclass(frozen=True)
class AttentionClose(Close):
    """fp32 against float64 up to the roundings of attention (picotron.kernels.flash_attention_torch's
    attention_roundings, carried by the expected tensor), TF32 where a compiled tl.dot uses it."""

    def close(self, got, want) -> bool:
        return tolerance.close_enough(got, want, n=getattr(want, "roundings", 1), dtype=torch.float32, tf32=TF32)


def _flash_case(seed: int, name, heads, seq, head_dim, block_m, block_n, causal, make) -> dict:
    q, k, v = _attention_data(heads, seq, head_dim, make, 300 + seed)
    return {"case": name, "(heads, s, d)": (heads, seq, head_dim), "BLOCK_M x BLOCK_N": f"{block_m} x {block_n}",
            "causal": causal, "_qkv": (q, k, v), "_scale": 1.0 / math.sqrt(head_dim),
            "_constexprs": dict(CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, _block(head_dim)))}


def _run_flash(kernel, case: dict) -> dict:
    """Launch the kernel with one program per (head, query block): its traffic (from its IR), O, its NaNs, the lse,
    and the values outside O it overwrote."""
    (q, k, v), (heads, seq, head_dim), constexprs = case["_qkv"], case["(heads, s, d)"], case["_constexprs"]
    buffer, rows_out = _output_buffer(heads * seq, head_dim, 3, torch.float32)
    out = rows_out.view(heads, seq, head_dim)
    lse = _with_room(torch.full((heads, seq), SENTINEL), fill=SENTINEL)
    args = (q, k, v, out, lse, seq, head_dim, q.stride(0), q.stride(1), out.stride(0), out.stride(1), case["_scale"])
    launch(kernel, (heads, -(-seq // constexprs["BLOCK_M"])), *args, **constexprs)
    o = out.cpu()
    return {**_flash_traffic(kernel, _arguments(kernel, args, constexprs), constexprs, heads, seq),
            "NaN": int(o.isnan().sum()), "O": o, "O (torch)": o, "lse": lse.cpu(),
            "outside": _outside_touched(buffer, rows_out)}


def expect_flash(case: dict, observed: dict) -> dict:
    from picotron.kernels.flash_attention_torch import attention_roundings, flash_attention_torch

    (q, k, v), (_, seq, head_dim), c = case["_qkv"], case["(heads, s, d)"], case["_constexprs"]
    qd, kd, vd = (t.cpu().double() for t in (q, k, v))
    causal, scale = c["CAUSAL"], case["_scale"]
    scores = (qd @ kd.mT) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    in_torch = flash_attention_torch(q.cpu(), k.cpu(), v.cpu(), causal=causal, scale=scale, block_q=c["BLOCK_M"],
                                     block_k=c["BLOCK_N"])
    n = attention_roundings(head_dim, seq)
    tile = max(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_D"])
    return {"raised": "", "counted": "", "largest": tile, "q load": c["BLOCK_M"] * c["BLOCK_D"],
            "k load": c["BLOCK_N"] * c["BLOCK_D"], "v load": c["BLOCK_N"] * c["BLOCK_D"], "passes": "",
            "other stores": [], "NaN": 0,
            "O": per_case(F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale), n=n),
            "O (torch)": per_case(in_torch, n=n),
            "lse": per_case(torch.logsumexp(scores, dim=-1), n=attention_roundings(head_dim, seq, of="lse")),
            "outside": 0}


def _load_rule(name: str, what: str) -> AtMost:
    return AtMost(f"the widest load of {name}", rule=f"one load of {name} reads {{got}} values: at most a {what} "
                                                     "tile ({want})")


FLASH_ATTENTION = Check(
    "flash_attention_kernel", requires=REQUIRES,
    cases=[_flash_case(seed, *case) for seed, case in enumerate(FLASH_CASES)],
    observe=_observe(_run_flash), expect=expect_flash, course="picotron.kernels",
    note=(f"one program per (head, query block), in "
          f"{WHERE if INTERPRETED else 'a compiled GPU kernel (fp32 tl.dot in TF32)'}; expected O = SDPA in "
          "float64 and picotron's torch FlashAttention, lse = logsumexp in float64; loads counted on the kernel's "
          "Triton IR"),
    quantities={"raised": RAISED, "counted": Said("the count of loads and stores on the kernel's Triton IR"),
                "q load": _load_rule("q_ptr", "BLOCK_M x BLOCK_D"), "k load": _load_rule("k_ptr", "BLOCK_N x BLOCK_D"),
                "v load": _load_rule("v_ptr", "BLOCK_N x BLOCK_D"),
                "largest": AtMost("the longest dimension of a tensor the kernel holds",
                                  rule="the kernel holds a tensor {got} long, longer than any tile ({want}): never "
                                       "the s x s scores, nor a whole row of them"),
                "passes": Said("the passes over K and V of a query block"),
                "other stores": Exact("the arguments stored through besides O and the lse (write O and the lse only)"),
                "NaN": Exact("NaN in O (an exp(-inf - (-inf)) or a 0 / 0 somewhere)"),
                "O": AttentionClose("O against SDPA"),
                "O (torch)": AttentionClose("O against picotron's torch FlashAttention"),
                "lse": AttentionClose("lse (store m + log l of row i, natural log, at lse_ptr + head * seq_len + i)"),
                "outside": Exact("values outside O overwritten (mask the store (rows < seq_len, dims < head_dim) "
                                 "and address O through o_head_stride and o_row_stride)")},
    misconceptions=[
        Misconception(flash_double_key_tiles, "load K and V one BLOCK_N x BLOCK_D tile at a time"),
        Misconception(flash_whole_rows_of_scores, "hold one BLOCK_M x BLOCK_N tile of scores at a time, never a "
                                                  "whole row of them: fold each key block into the running max, sum "
                                                  "and output"),
        Misconception(flash_two_passes, "one pass over K and V per query block: the online softmax rescales the "
                                        "running sum and output as the max rises"),
        Misconception(flash_causal_computes_every_block, "causal: stop the key loop at the query block's last row; "
                                                         "the blocks above the diagonal are all masked"),
        Misconception(flash_stores_the_max, "store the log-sum-exp m + log(l) of each row, not the max m alone"),
        Misconception(flash_no_rescale, "when a key block raises the running max, rescale the running sum and the "
                                        "output accumulator by exp(m_old - m_new)"),
        Misconception(flash_diagonal_excluded, "causal: a query attends to its own key, mask keys > query (not >=)"),
        Misconception(flash_rows_head_dim_apart, "address rows through row_stride (and O through o_row_stride): "
                                                 "rows are not head_dim apart")])


def check_flash_attention_kernel(flash_attention_kernel) -> None:
    """Launch flash_attention_kernel with one program per (head, query block) on each case of FLASH_CASES; compare
    O with F.scaled_dot_product_attention in float64 and with picotron's FlashAttention in torch
    (picotron/kernels/flash_attention_torch.py, same tiles), and the log-sum-exp with torch.logsumexp in float64.
    From the kernel's Triton IR (the same on a CPU and a GPU): loads of at most a BLOCK_M x BLOCK_D tile of Q and
    a BLOCK_N x BLOCK_D tile of K or V, no tensor longer than a tile, one pass over K and V per query block, and
    (causal) no key block above the diagonal."""
    FLASH_ATTENTION(flash_attention_kernel)


def _flash_traffic(kernel, named: dict, constexprs: dict, heads: int, seq: int) -> dict:
    """The stretch's traffic, from the kernel's IR, for every program: the longest dimension of a tensor it holds,
    its widest loads of Q, K and V, the first program that reads K or V more than once ("" when none; causal:
    the key blocks above the diagonal), the arguments stored through besides O and the lse; or why they could
    not be counted."""
    block_m, block_n, block_d, causal = (constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "CAUSAL"))
    q_name, k_name, v_name, o_name, lse_name = list(named)[:5]
    try:
        kernel_ir = _kernel_ir(kernel, named, constexprs)
        programs = {(h, b): kernel_ir.traffic((h, b, 0), named) for h in range(heads)
                    for b in range(-(-seq // block_m))}
    except _Unknown as e:
        return {"counted": f"could not count what the kernel loads: {e}"}
    except Exception as e:  # noqa: BLE001 - a kernel the compiler refuses is a failed case, said in one line
        return {"counted": f"could not compile the kernel to count its loads: {_first_line(e)}"}
    largest, _ = kernel_ir.largest_dimension()
    first = programs[(0, 0)]
    facts = {"counted": "", "largest": largest}
    for key, name in (("q load", q_name), ("k load", k_name), ("v load", v_name)):
        facts[key] = max((math.prod(s) for s in first.load_shapes.get(name, ())), default=0)
    passes = ""
    for (head, block), traffic in programs.items():
        visible = min((block + 1) * block_m, seq) if causal else seq         # keys this query block can see
        needed, every = -(-visible // block_n), -(-seq // block_n)
        for name in (k_name, v_name):
            tiles = traffic.loaded(name) / (block_n * block_d)
            if tiles > needed and causal and tiles <= every:
                passes = passes or (f"causal: program (head {head}, query block {block}) loads {tiles:.0f} tiles "
                                    f"of {name} where {needed} reach its last row: skip the key blocks above the "
                                    "diagonal")
            elif tiles > needed:
                passes = passes or (f"{name} was read {tiles / needed:.2f} times by program (head {head}, query "
                                    f"block {block}): one pass over K and V per query block (the online softmax)")
        if passes:
            break                                    # one program says it; the others would say the same
    return {**facts, "passes": passes,
            "other stores": sorted({name for t in programs.values() for name in t.stores} - {o_name, lse_name})}


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

"""The checks of assignment 09: a fused row-softmax kernel and an RMSNorm forward kernel, in Triton.

Each check launches the learner's @triton.jit kernel itself, one program per row, on inputs chosen
to catch the usual slips, and compares with plain torch math done here in float64 (never with
picotron.kernels, the code the assignment rebuilds). Without a GPU the kernel runs in the Triton
interpreter (picotron.kernels.runtime sets it up); on a GPU it compiles. Chapter: chapters/09_gpu_kernels.ipynb;
the assignment: solutions/09_gpu_kernels.ipynb.

    check_softmax_kernel(softmax_kernel)
        softmax_kernel[(rows,)](x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK=BLOCK)
    check_rmsnorm_kernel(rmsnorm_kernel)
        rmsnorm_kernel[(rows,)](x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps,
                                BLOCK=BLOCK)

BLOCK is n_cols rounded up to a power of two. The cases: a power-of-two row, a row that is not one
(the padding lanes must neither win the max nor add to the sum or the mean), large values (exp
overflows without the max subtracted), -inf entries (masked scores), tiny values (where eps
matters), rows read through a stride (a slice x[:, :n] of a wider tensor) and written through
another, bf16. The output is written into a larger buffer filled with a sentinel: a store
without its mask, or through the wrong stride, changes values outside the rows, and the check
says so.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from picotron import tolerance
from picotron_course.checks import Report, max_abs_error, mismatch
from picotron.kernels.runtime import INTERPRETED, kernel_device   # decides interpreter vs compiler, before any kernel

__all__ = ["check_softmax_kernel", "check_rmsnorm_kernel", "SOFTMAX_CASES", "RMSNORM_CASES", "launch"]

SENTINEL = -4096.0   # exact in bf16 too; fills the output buffer around the rows: any change is a store out of place
# Elements of spare memory after every tensor a kernel gets. The interpreter does not check addresses:
# a wrong stride would write into whatever lies after the tensor and can crash the process. With this
# room, it writes into the spare part instead, and the check reports it.
SLACK = 16384

# (name, rows, n_cols, dtype, x_row_stride or None for contiguous, padding of each output row, make)
SOFTMAX_CASES = [
    ("64 columns", 4, 64, torch.float32, None, 0, "randn"),
    ("100 columns: BLOCK 128, 28 padding lanes", 5, 100, torch.float32, None, 0, "randn"),
    ("large values, up to 3000", 3, 50, torch.float32, None, 0, "large"),
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


def _not_the_course_answer(what: str, kernel) -> None:
    module = str(getattr(getattr(kernel, "fn", kernel), "__module__", ""))
    if module.startswith("picotron.kernels"):
        raise AssertionError(f"{what}: {_name(kernel)} comes from {module}, the course's own kernel; write your own")


# ---- data ---------------------------------------------------------------------------------------
def _data(rows: int, n_cols: int, dtype: torch.dtype, stride: int | None, make: str, seed: int) -> torch.Tensor:
    """(rows, n_cols) input, as a slice of a (rows, stride) tensor when stride is given."""
    generator = torch.Generator().manual_seed(seed)
    width = stride or n_cols
    x = torch.randn(rows, width, generator=generator, dtype=torch.float32)
    if make == "large":
        x = x * 1000.0 + 2000.0                # exp(3000) overflows fp32 (and fp64)
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
    _not_the_course_answer("check_softmax_kernel", softmax_kernel)
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
    _not_the_course_answer("check_rmsnorm_kernel", rmsnorm_kernel)
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


def _run_case(report: Report, name: str, dtype: torch.dtype, expected: torch.Tensor, buffer: torch.Tensor,
              out: torch.Tensor, x: torch.Tensor, call: Callable[[], None], rstd=None) -> None:
    """Run one launch and add its row: output (and rstd) against expected, and nothing written elsewhere."""
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
    if not _close(actual, expected.cpu(), dtype, out.shape[-1]):
        problems.append("y: " + mismatch(actual.double(), expected.cpu().double()))
    if rstd is not None:
        got, want = rstd[0].cpu(), rstd[1].cpu()
        if not tolerance.close_enough(got, want, n=out.shape[-1] + 2, dtype=torch.float32, tf32=False):
            problems.append("rstd (store 1/sqrt(mean(x^2) + eps) of row r at rstd_ptr + r): "
                            + mismatch(got.double(), want))
    touched = _outside_touched(buffer, out)
    if touched:
        problems.append(f"{touched} values outside the rows were overwritten: mask the store (cols < n_cols) and "
                        "address row r of the output at out_ptr + r * out_row_stride")
    err = max_abs_error(actual.double().nan_to_num(nan=math.inf), expected.cpu().double())
    report.add(ok=not problems, detail="; ".join(problems), **columns, max_abs_err=err)

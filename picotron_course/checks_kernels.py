"""The checks of assignment 09: a fused row-softmax kernel, an RMSNorm forward kernel and (the stretch) an
online softmax for rows longer than one block, in Triton.

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
    check_online_softmax_kernel(online_softmax_kernel)
        online_softmax_kernel[(rows,)](x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK=BLOCK)

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
block entirely -inf (the running max is still -inf after it), strides and bf16. In the Triton
interpreter the check also counts what the kernel loads and stores (by patching the interpreter's
load and store, for the launch only): at most BLOCK values per load, at most two loads and one
store of each element (the online softmax's two passes). Compiled on a GPU, only the values are
checked.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from picotron import tolerance
from picotron_course.checks import Report, max_abs_error, mismatch
from picotron.kernels.runtime import INTERPRETED, kernel_device   # decides interpreter vs compiler, before any kernel

__all__ = ["check_softmax_kernel", "check_rmsnorm_kernel", "check_online_softmax_kernel", "SOFTMAX_CASES",
           "RMSNORM_CASES", "ONLINE_SOFTMAX_CASES", "launch"]

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


# ---- the stretch: online softmax ----------------------------------------------------------------------
def check_online_softmax_kernel(online_softmax_kernel) -> None:
    """Launch online_softmax_kernel with one program per row and a BLOCK smaller than the row, on each case of
    ONLINE_SOFTMAX_CASES; compare with float64 torch.softmax. In the interpreter, also count the values it
    loads and stores: at most BLOCK per load, two loads and one store per element."""
    _not_the_course_answer("check_online_softmax_kernel", online_softmax_kernel)
    where = "the Triton interpreter (CPU), loads and stores counted" if INTERPRETED else \
        "a compiled GPU kernel (loads and stores not counted: the interpreter counts them)"
    note = f"one program per row, BLOCK columns at a time, in {where}; expected = torch.softmax in float64"
    with Report("online_softmax_kernel", note=note) as report:
        for seed, (name, rows, n_cols, block, dtype, stride, padding, make) in enumerate(ONLINE_SOFTMAX_CASES):
            x = _data(rows, n_cols, dtype, stride, "randn" if make == "first block masked" else make, 200 + seed)
            if make == "first block masked":
                x[:, :block] = float("-inf")          # a row that starts with masked keys (a padded prompt)
            expected = torch.softmax(x.double(), dim=-1).to(dtype)
            buffer, out = _output_buffer(rows, n_cols, padding, dtype)
            counter = _MemoryCounter(reads_from=(x, buffer), writes_to=buffer)

            def call(x=x, out=out, n_cols=n_cols, block=block, rows=rows, counter=counter):
                with counter:
                    launch(online_softmax_kernel, (rows,), x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block)

            blocks = -(-n_cols // block)
            _run_case(report, name, dtype, expected, buffer, out, x, call, n=n_cols + 2 * blocks + 2,
                      traffic=lambda counter=counter, block=block, rows=rows, n_cols=n_cols: _online_traffic(
                          counter, block, rows * n_cols))


def _online_traffic(counter: "_MemoryCounter", block: int, elements: int) -> tuple[dict, list[str]]:
    """The BLOCK column and, in the interpreter, the loads and stores per element; problems if over budget."""
    columns = {"BLOCK": block}
    if not counter.counted:
        return columns, []
    loads, stores = counter.loads / elements, counter.stores / elements
    columns.update({"loads/elem": f"{loads:.2f}", "stores/elem": f"{stores:.2f}"})
    problems = []
    if counter.widest > block:
        problems.append(f"one load read {counter.widest} values at once; BLOCK is {block}: walk the row BLOCK "
                        "columns at a time")
    if counter.loads > 2 * elements:
        problems.append(f"each element was loaded {loads:.2f} times: at most 2 (a first pass keeps the running max "
                        "and sum, a second writes the output)")
    if counter.stores > elements:
        problems.append(f"each element was stored {stores:.2f} times: once, in the second pass")
    return columns, problems


class _MemoryCounter:
    """Within `with counter:`, count the values the Triton interpreter loads from the memory of `reads_from`
    and stores into `writes_to` (masked-off lanes do not count), and the widest load. Compiled kernels
    cannot be counted this way: `counted` stays False."""

    def __init__(self, reads_from: tuple[torch.Tensor, ...], writes_to: torch.Tensor):
        self.read_ranges = [_address_range(t) for t in reads_from]
        self.write_range = _address_range(writes_to)
        self.loads = self.stores = self.widest = 0
        self.counted = False

    def __enter__(self) -> "_MemoryCounter":
        self._patch = _interpreter_memory_hooks(self) if INTERPRETED else None
        if self._patch is not None:
            self._patch.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        if self._patch is not None:
            self._patch.__exit__(*exc)
            self.counted = self.loads > 0          # 0: loads the hook does not see (e.g. block pointers)
        return False

    def saw_load(self, addresses, mask) -> None:
        inside = sum(((addresses >= lo) & (addresses < hi) & mask).sum() for lo, hi in self.read_ranges)
        if inside:
            self.loads += int(inside)
            self.widest = max(self.widest, int(addresses.size))

    def saw_store(self, addresses, mask) -> None:
        lo, hi = self.write_range
        self.stores += int(((addresses >= lo) & (addresses < hi) & mask).sum())


def _address_range(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of t's whole storage (the spare room after it included)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


@contextmanager
def _interpreter_memory_hooks(counter: _MemoryCounter) -> Iterator[None]:
    """Route the interpreter's masked loads and stores (plain ones go through them too) via `counter`."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store

    def counted_load(ptrs, mask, *args, **kwargs):
        counter.saw_load(np.asarray(ptrs.data), np.broadcast_to(np.asarray(mask.data), np.shape(ptrs.data)))
        return load(ptrs, mask, *args, **kwargs)

    def counted_store(ptrs, value, mask, *args, **kwargs):
        counter.saw_store(np.asarray(ptrs.data), np.broadcast_to(np.asarray(mask.data), np.shape(ptrs.data)))
        return store(ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store   # this instance only
    try:
        yield
    finally:
        del builder.create_masked_load, builder.create_masked_store    # back to the class's methods


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

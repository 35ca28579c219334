"""The checks of assignment 09 pass correct kernels and fail planted wrong ones.

The correct kernels are the checks' own bases (picotron_course.checks_kernels) bound to no mistake, the code each
misconception changes in one place, and other correct ones written here in other ways; none is taken from the
solution notebook (which runs under nbval on its own), so a check that passes everything, or nothing, is caught.
Nothing here uses picotron.kernels' own kernels, except to see that the checks refuse them. Without a GPU the
kernels run in the Triton interpreter, on a GPU they compile; either way the online softmax's and
FlashAttention's checks count loads and stores on the kernel's Triton IR, so a right answer that
breaks a stated rule (reads the row three times, writes it twice, loads a whole row at once, reads
K twice, computes the causal blocks above the diagonal, holds the s x s scores) fails too, with a
message that names the rule.
"""

import pytest
import triton
import triton.language as tl

from picotron.kernels.runtime import use_device_descriptors
from picotron_course.checks_kernels import (_flash_attention, _online_softmax, _rmsnorm, _softmax,
                                            check_flash_attention_kernel, check_online_softmax_kernel,
                                            check_rmsnorm_kernel, check_softmax_kernel)


use_device_descriptors()     # a compiled kernel that makes tensor descriptors needs a little global memory for them


# ---- correct answers: the checks' bases with no MISTAKE, and other ways to write them ------------------------
@triton.jit
def ref_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "")


@triton.jit
def ref_softmax_exp2(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """exp2 of x log2(e), a where() instead of `other`, and multiplication by 1/sum: the same softmax."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=inside).to(tl.float32)
    x = tl.where(inside, x * 1.4426950408889634, float("-inf"))
    e = tl.exp2(x - tl.max(x, axis=0))
    y = e * (1.0 / tl.sum(e, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def ref_rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    _rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK, "")


@triton.jit
def ref_online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    _online_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK, "")


@triton.jit
def ref_online_softmax_lanes(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """A running max and sum per lane, started at a finite -1e38 (never nan), merged across lanes at the end;
    exp2 of x log2(e)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], -1e38, tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=start + cols < n_cols,
                    other=float("-inf")).to(tl.float32) * 1.4426950408889634
        new_m = tl.maximum(m, x)
        total = total * tl.exp2(m - new_m) + tl.exp2(x - new_m)
        m = new_m
    row_m = tl.max(m, axis=0)
    row_total = tl.sum(total * tl.exp2(m - row_m), axis=0)
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        y = tl.exp2(x * 1.4426950408889634 - row_m) / row_total
        tl.store(out_ptr + row * out_row_stride + start + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


# ---- FlashAttention forward (the stretch): correct answers, the base and one with tensor descriptors ---------
@triton.jit
def ref_flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                        o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    _flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride, o_head_stride,
                     o_row_stride, scale, CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, "")


@triton.jit
def _fold_keys(acc, l, m, q, k_desc, v_desc, rows, lo, hi, seq_len, qk_scale, BLOCK_N: tl.constexpr,
               MASK: tl.constexpr):
    """Fold the key blocks [lo, hi) into (acc, l, m), tiles through tensor descriptors, in log2 units."""
    for start_n in range(lo, hi, BLOCK_N):
        k = k_desc.load([start_n, 0])                 # rows past seq_len come as zeros
        v = v_desc.load([start_n, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        cols = start_n + tl.arange(0, BLOCK_N)
        visible = cols[None, :] < seq_len
        if MASK:
            visible = visible & (cols[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    return acc, l, m


@triton.jit
def ref_flash_attention_split(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                              o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tensor descriptors, a helper called twice when causal (key blocks left of the diagonal unmasked, then the
    diagonal blocks masked), exp2 of log2(e)-scaled scores: one pass over the keys all the same."""
    head, start_m = tl.program_id(0), tl.program_id(1) * BLOCK_M
    rows, dims = start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)
    q_desc = tl.make_tensor_descriptor(q_ptr + head * head_stride, [seq_len, head_dim], [row_stride, 1],
                                       [BLOCK_M, BLOCK_D])
    k_desc = tl.make_tensor_descriptor(k_ptr + head * head_stride, [seq_len, head_dim], [row_stride, 1],
                                       [BLOCK_N, BLOCK_D])
    v_desc = tl.make_tensor_descriptor(v_ptr + head * head_stride, [seq_len, head_dim], [row_stride, 1],
                                       [BLOCK_N, BLOCK_D])
    q = q_desc.load([start_m, 0])
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    if CAUSAL:
        below = start_m // BLOCK_N * BLOCK_N                   # key blocks wholly left of the diagonal
        acc, l, m = _fold_keys(acc, l, m, q, k_desc, v_desc, rows, 0, below, seq_len, qk_scale, BLOCK_N, False)
        acc, l, m = _fold_keys(acc, l, m, q, k_desc, v_desc, rows, below, tl.minimum(start_m + BLOCK_M, seq_len),
                               seq_len, qk_scale, BLOCK_N, True)
    else:
        acc, l, m = _fold_keys(acc, l, m, q, k_desc, v_desc, rows, 0, seq_len, seq_len, qk_scale, BLOCK_N, False)
    tl.store(o_ptr + head * o_head_stride + rows[:, None] * o_row_stride + dims[None, :], acc / l[:, None],
             mask=(rows[:, None] < seq_len) & (dims[None, :] < head_dim))
    tl.store(lse_ptr + head * seq_len + rows, (m + tl.log2(l)) * 0.6931471805599453, mask=rows < seq_len)


# The cases each check's table runs (picotron_course.checks.Report): its promise, asserted by every_case.
CASES = {"softmax_kernel": 7, "rmsnorm_kernel": 7, "online_softmax_kernel": 10, "flash_attention_kernel": 6}


@pytest.mark.parametrize("check, kernel", [(check_softmax_kernel, ref_softmax),
                                           (check_softmax_kernel, ref_softmax_exp2),
                                           (check_rmsnorm_kernel, ref_rmsnorm),
                                           (check_online_softmax_kernel, ref_online_softmax),
                                           (check_online_softmax_kernel, ref_online_softmax_lanes),
                                           (check_flash_attention_kernel, ref_flash_attention),
                                           (check_flash_attention_kernel, ref_flash_attention_split)],
                         ids=["softmax", "softmax_exp2", "rmsnorm", "online_softmax", "online_softmax_lanes",
                              "flash_attention", "flash_attention_split"])
def test_correct_answer_passes(check, kernel, every_case):
    check(kernel)
    every_case(CASES)


# ---- softmax: its wrong answers are the check's misconceptions (tests/test_misconceptions.py) ------------------
@triton.jit
def softmax_doubled(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """A mistake no misconception makes: twice the softmax."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(out_ptr + row * out_row_stride + cols, 2 * e / tl.sum(e, axis=0), mask=cols < n_cols)


def test_a_softmax_mistake_no_record_makes_fails_without_a_hint(capsys):
    with pytest.raises(AssertionError) as error:
        check_softmax_kernel(softmax_doubled)
    assert "Hint" not in str(error.value) and "y" in str(error.value)
    assert "FAIL" in capsys.readouterr().out


def _course_softmax():
    from picotron.kernels.row_softmax import softmax_kernel_v1
    return softmax_kernel_v1


def _course_rmsnorm():
    from picotron.kernels.rmsnorm import rmsnorm_forward_kernel_v1
    return rmsnorm_forward_kernel_v1


def _course_online_softmax():
    from picotron.kernels.row_softmax import softmax_kernel_v3
    return softmax_kernel_v3


def _course_flash_attention():
    from picotron.kernels.attention import attention_forward_kernel_v1
    return attention_forward_kernel_v1


@pytest.mark.parametrize("check, course", [(check_softmax_kernel, _course_softmax),
                                           (check_rmsnorm_kernel, _course_rmsnorm),
                                           (check_online_softmax_kernel, _course_online_softmax),
                                           (check_flash_attention_kernel, _course_flash_attention)],
                         ids=["softmax", "rmsnorm", "online_softmax", "flash_attention"])
def test_the_course_kernel_is_refused(check, course):
    with pytest.raises(AssertionError, match="the course's answer"):
        check(course())


@triton.jit
def unsolved_softmax(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK: tl.constexpr):
    """What the exercise notebook gives the learner."""
    raise NotImplementedError("unsolved_softmax: write this part")


@triton.jit
def unsolved_rmsnorm(x_ptr, w_ptr, out_ptr, rstd_ptr, n_cols, x_row_stride, out_row_stride, eps, BLOCK: tl.constexpr):
    raise NotImplementedError("unsolved_rmsnorm: write this part")


@triton.jit
def unsolved_flash_attention(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, seq_len, head_dim, head_stride, row_stride,
                             o_head_stride, o_row_stride, scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    raise NotImplementedError("unsolved_flash_attention: write this part")


@pytest.mark.parametrize("check, kernel", [(check_softmax_kernel, unsolved_softmax),
                                           (check_rmsnorm_kernel, unsolved_rmsnorm),
                                           (check_online_softmax_kernel, unsolved_softmax),
                                           (check_flash_attention_kernel, unsolved_flash_attention)],
                         ids=["softmax", "rmsnorm", "online_softmax", "flash_attention"])
def test_unsolved_kernel_raises_not_implemented(check, kernel):
    with pytest.raises(NotImplementedError, match="not written yet"):
        check(kernel)


def test_not_implemented_raised_inside_a_kernel_comes_out_as_itself():
    """The interpreter wraps what a kernel raises in an InterpreterError; launch unwraps NotImplementedError."""
    import torch

    from picotron_course.checks_kernels import launch

    @triton.jit
    def calls_an_unfinished_helper(x_ptr, BLOCK: tl.constexpr):
        unfinished_helper(x_ptr)

    with pytest.raises(NotImplementedError, match="unfinished"):
        launch(calls_an_unfinished_helper, (1,), torch.zeros(4), BLOCK=4)


@triton.jit
def unfinished_helper(x_ptr):
    raise NotImplementedError("unfinished_helper: write this part")


def test_a_kernel_that_crashes_is_a_failed_case(capsys):
    @triton.jit
    def wrong_signature(x_ptr, out_ptr, BLOCK: tl.constexpr):
        pass

    with pytest.raises(AssertionError, match="raised"):
        check_softmax_kernel(wrong_signature)
    assert "FAIL" in capsys.readouterr().out


def test_not_a_kernel_is_explained():
    def plain_python(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride, BLOCK):
        pass

    with pytest.raises(AssertionError, match="triton.jit"):
        check_softmax_kernel(plain_python)


def test_the_ir_count_sees_every_program_and_loop():
    """KernelIR counts, for each program, the loads its loops run: a causal query block further down loads more
    key tiles, the first one fewer; the loop bounds come from the program ids and the launch's integers."""
    import torch

    from picotron_course.checks_kernels import KernelIR

    q = torch.zeros(1, 64, 16)
    named = dict(q_ptr=q, k_ptr=q, v_ptr=q, o_ptr=q, lse_ptr=q[0, :, 0], seq_len=64, head_dim=16, head_stride=1024,
                 row_stride=16, o_head_stride=1024, o_row_stride=16, scale=0.25)
    constexprs = dict(CAUSAL=True, BLOCK_M=16, BLOCK_N=16, BLOCK_D=16)
    kernel_ir = KernelIR(ref_flash_attention, {**named, **constexprs}, constexprs)
    tiles = [kernel_ir.traffic((0, block, 0), named).loaded("k_ptr") // 256 for block in range(4)]
    assert tiles == [1, 2, 3, 4]
    assert kernel_ir.traffic((0, 3, 0), named).stored("lse_ptr") == 16


def test_reading_the_ir_leaves_the_interpreter_working(capsys):
    """The IR is compiled between interpreted launches (the check swaps triton.language's functions for the
    compiler's, then back): kernels still run in the interpreter afterwards, and the next check compiles again."""
    check_online_softmax_kernel(ref_online_softmax)
    check_flash_attention_kernel(ref_flash_attention)
    check_softmax_kernel(ref_softmax)
    assert "FAIL" not in capsys.readouterr().out

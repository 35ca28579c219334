"""picotron.kernels: every kernel against torch, in the Triton interpreter on a CPU and compiled on a GPU.

Without a GPU the kernels run in the interpreter (small sizes: it executes each program in Python);
with one they compile, and the tests marked `gpu` add larger sizes, bf16 and the comparison with
torch's own kernels (skipped here). `test_every_kernel_compiles_for_an_h100` needs no GPU: Triton
compiles to sm_90 machine code without one, which catches what only the compiler rejects.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from picotron import tolerance
from picotron.kernels import add, attention, attention_tma, gpu, rmsnorm, row_softmax, runtime, timing
from picotron.kernels.attention import flash_attention
from picotron.kernels.rmsnorm import TritonRMSNorm
from picotron.kernels.row_softmax import softmax
from picotron.kernels.runtime import INTERPRETED, kernel_device

ROOT = Path(__file__).resolve().parents[1]
DEVICE = kernel_device()
ON_GPU = torch.cuda.is_available() and not INTERPRETED
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the kernels compile there)")


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env=environment, timeout=300)


# ---- importing --------------------------------------------------------------------------------------
# The course's notebook tools (pyproject's dependencies for the notebooks, not for the core): a machine may lack them.
NOTEBOOK_PACKAGES = ("nbformat", "nbclient", "ipywidgets", "matplotlib", "jupyter", "jupyterlab", "jupyter_client",
                     "jupyter_core", "ipykernel", "IPython")


def test_the_rest_of_picotron_does_not_import_triton():
    """Every picotron module but picotron.kernels (and the checks of chapter 09) imports without triton.

    A picotron_course module that needs a notebook package this machine lacks is left out (and named);
    a core module never is, and any other missing package is an error: so the test still fails when a
    module imports triton, installed (it lands in sys.modules) or not (ModuleNotFoundError: triton)."""
    # Module names from the files (pkgutil.walk_packages would import picotron.kernels to look inside it).
    names = sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                   for path in (ROOT / "picotron").rglob("*.py"))
    names = [name for name in names if not name.startswith(("picotron.kernels", "picotron_course.checks_kernels"))]
    assert "picotron.model" in names and "picotron.train" in names
    done = _python(f"""
        import importlib, sys
        left_out = []
        for name in {names!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as error:
                missing = (error.name or "").partition(".")[0]
                if not (name.startswith("picotron_course") and missing in {NOTEBOOK_PACKAGES!r}):
                    raise
                left_out.append(name + " needs " + missing)
        assert "triton" not in sys.modules, [name for name in sys.modules if name.startswith("triton")]
        print("clean; left out:", left_out)
    """)
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr


def _picotron_imports(path: Path) -> set[str]:
    """The picotron modules a file imports, at the top or inside a function (`from a.b import c` counts a.b, and
    a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "picotron" and ((ROOT / Path(*parts)).with_suffix(".py").exists()
                                           or (ROOT / Path(*parts) / "__init__.py").exists()):
                found.add(name)
    return found


def test_the_kernels_are_one_layer_without_cycles():
    """picotron/kernels/ imports nothing else of picotron; its package file imports nothing, so no kernel file
    depends on it; and its files import each other one way only (runtime.py first, a leaf)."""
    files = {f"picotron.kernels.{path.stem}": path for path in (ROOT / "picotron" / "kernels").glob("*.py")}
    files["picotron.kernels"] = files.pop("picotron.kernels.__init__")
    imports = {name: _picotron_imports(path) for name, path in files.items()}
    assert imports["picotron.kernels"] == set()
    assert imports["picotron.kernels.runtime"] == set()
    for name, targets in imports.items():
        outside = {t for t in targets if not t.startswith("picotron.kernels.")}
        assert not outside, f"{name} imports {outside}: the kernels must not depend on the rest of picotron"

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen))
                   for t in imports.get(start, ()))

    cycles = [name for name in imports if reaches(name, name, set())]
    assert not cycles, f"import cycles through {cycles}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without a GPU")
@pytest.mark.parametrize("first", ["import triton", "import torch._dynamo", "pass"])
def test_kernels_work_whatever_was_imported_first(first):
    """torch._dynamo (imported by the first optimizer step and by torch.compile) imports triton before
    TRITON_INTERPRET is set."""
    done = _python(f"""
        import torch
        {first}
        from picotron.kernels.row_softmax import softmax
        from picotron.kernels.rmsnorm import rmsnorm
        from picotron.kernels.runtime import INTERPRETED
        from picotron import tolerance
        x = torch.randn(5, 37)
        tolerance.assert_close(softmax(x), torch.softmax(x, -1), n=37 + 2)   # exp, the row's sum, the division
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        tolerance.assert_close(rmsnorm(x, torch.ones(37), 1e-5), expected, n=37 + 2)   # the sum of squares + a few
        import os; print("interpreted", INTERPRETED, os.environ["TRITON_INTERPRET"])
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpreted True 1" in done.stdout


def _norm_on_rank(width):
    import torch.distributed as dist
    from picotron.kernels.rmsnorm import rmsnorm
    from picotron.tolerance import compare
    x = torch.randn(3, width) + dist.get_rank()
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return compare(rmsnorm(x, torch.ones(width), 1e-5), expected, n=width + 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="ranks run on CPU tensors, which compiled kernels refuse")
def test_kernels_run_in_forked_ranks():
    from picotron.launch import run
    results = run(_norm_on_rank, 2, args=(24,), timeout=120)
    assert len(results) == 2 and all(results), [str(result) for result in results]


# ---- vector add ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 1000, 4097])
@pytest.mark.parametrize("version", [add.add_v1, add.add_v2, add.add_v3],
                         ids=["v1", "v2_grid_stride", "v3_autotuned"])
def test_vector_add(version, n):
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    torch.testing.assert_close(version(x, y), x + y, atol=0, rtol=0)


def test_grid_stride_with_one_program_covers_everything():
    x, y = torch.randn(3000, device=DEVICE), torch.randn(3000, device=DEVICE)
    torch.testing.assert_close(add.add_v2(x, y, block=256, programs=1), x + y, atol=0, rtol=0)


def test_autotune_picks_one_of_its_configs():
    x = torch.randn(2000, device=DEVICE)
    add.add_v3(x, x)
    assert add.add_kernel_v3.best_config.kwargs["BLOCK"] in (256, 1024, 4096)


def test_vector_add_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="contiguous"):
        add.add_v1(torch.randn(4, 4, device=DEVICE).t(), torch.randn(4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="equal shapes"):
        add.add_v1(torch.randn(3, device=DEVICE), torch.randn(4, device=DEVICE))


def test_wrong_device_is_explained(monkeypatch):
    monkeypatch.setattr(runtime, "kernel_device", lambda: torch.device("cuda"))   # as on a GPU machine
    with pytest.raises(ValueError, match="must be on cuda.*move it"):
        runtime.check_device(torch.ones(2))


# ---- softmax --------------------------------------------------------------------------------------
SOFTMAX_VERSIONS = [row_softmax.softmax_v1, row_softmax.softmax_v2, row_softmax.softmax_v3,
                    lambda x: row_softmax.softmax_v3(x, block=32), gpu.softmax_unfused]


@pytest.mark.parametrize("version", SOFTMAX_VERSIONS, ids=["v1", "v2", "v3", "v3_blocks_of_32", "unfused"])
@pytest.mark.parametrize("shape, scale", [((7, 100), 1.0), ((3, 64), 300.0), ((20, 5), 1.0)])
def test_softmax_versions(version, shape, scale):
    x = torch.randn(shape, device=DEVICE) * scale
    # Roundings behind one output (picotron.tolerance): exp, the sum over the row, the division.
    tolerance.assert_close(version(x), torch.softmax(x, dim=-1), n=shape[-1] + 2)


@pytest.mark.parametrize("version", SOFTMAX_VERSIONS[:4], ids=["v1", "v2", "v3", "v3_blocks_of_32"])
def test_softmax_reads_rows_through_their_stride(version):
    wide = torch.randn(6, 90, device=DEVICE)
    tolerance.assert_close(version(wide[:, 10:80]), torch.softmax(wide[:, 10:80], dim=-1), n=70 + 2)
    tolerance.assert_close(version(wide.t()), torch.softmax(wide.t(), dim=-1), n=6 + 2)   # last dim not contiguous


def test_softmax_keeps_masked_entries_at_zero():
    x = torch.randn(4, 50, device=DEVICE).masked_fill(torch.rand(4, 50, device=DEVICE) < 0.4, float("-inf"))
    x[:, 0] = 0.0
    tolerance.assert_close(softmax(x), torch.softmax(x, dim=-1), n=50 + 2)   # masked entries: exactly 0 on both sides


def test_softmax_any_shape_and_bf16():
    x = torch.randn(2, 3, 40, device=DEVICE, dtype=torch.bfloat16)
    y = softmax(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # Both compute in fp32 and round once to bf16: two bf16 roundings apart (picotron.tolerance).
    tolerance.assert_close(y, torch.softmax(x.float(), dim=-1).bfloat16(), n=2, dtype=torch.bfloat16)
    assert softmax(torch.empty(0, 8, device=DEVICE)).shape == (0, 8)


def test_softmax_chooses_the_online_version_for_long_rows(monkeypatch):
    monkeypatch.setattr(row_softmax, "MAX_FUSED_BLOCK", 32)
    called = []
    monkeypatch.setattr(row_softmax, "softmax_v3", lambda x: called.append(x.shape) or torch.softmax(x, -1))
    softmax(torch.randn(2, 40, device=DEVICE))
    assert called == [(2, 40)]


def test_softmax_bytes_match_the_counted_traffic():
    x = torch.randn(16, 48)
    _, ops = gpu.count_traffic(gpu.softmax_unfused, x)
    assert [op.name for op in ops] == ["amax", "sub", "exp", "sum", "div"]
    assert sum(op.bytes_read + op.bytes_written for op in ops) == gpu.softmax_bytes(16, 48, 4, "unfused")
    assert gpu.softmax_bytes(16, 48, 4, "fused") * 4 < gpu.softmax_bytes(16, 48, 4, "unfused")


# ---- RMSNorm --------------------------------------------------------------------------------------
def torch_rms_norm(x, weight, eps):
    """picotron.model.RMSNorm's arithmetic, written out."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_dx_terms(x, weight, grad, eps):
    """The largest sum of |terms| of dx = r (g w - x^ mean(g w x^)): its scale where the two cancel (a row of
    one value: dx = r g w eps / (x^2 + eps), far smaller than either term and than their round-off)."""
    x, gw = x.detach().double(), (grad * weight.detach()).double().abs()
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = (x * r).abs()
    return (r * (gw + x_hat * (gw * x_hat).mean(-1, keepdim=True))).max().item()


@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 100), (33, 24), (1, 1)])
def test_rmsnorm_forward_and_backward(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    w = (1 + 0.3 * torch.randn(shape[-1], device=DEVICE)).requires_grad_()
    y = rmsnorm.rmsnorm(x, w, 1e-5)
    grad = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), grad)
    y_ref = torch_rms_norm(x, w, 1e-5)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), grad)
    # Roundings (picotron.tolerance): y, the row's sum of squares and a few; dx, that sum and backward's sum over
    # the row, against the size of its terms; dw, that sum and the sum over the rows.
    rows, cols = x.numel() // shape[-1], shape[-1]
    tolerance.assert_close(y, y_ref, n=cols + 2)
    tolerance.assert_close(dx, dx_ref, n=2 * cols, scale=rmsnorm_dx_terms(x, w, grad, 1e-5))
    tolerance.assert_close(dw, dw_ref, n=cols + rows)


def test_rmsnorm_backward_against_float64_autograd():
    """The kernels compute in fp32: compare with torch's autograd in float64, within fp32 round-off."""
    x = torch.randn(40, 72, device=DEVICE, requires_grad=True)
    w = torch.randn(72, device=DEVICE, requires_grad=True)
    g = torch.randn(40, 72, device=DEVICE)
    dx, dw = torch.autograd.grad(rmsnorm.rmsnorm(x, w, 1e-3), (x, w), g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    dx64, dw64 = torch.autograd.grad(torch_rms_norm(x64, w64, 1e-3), (x64, w64), g.double())
    tolerance.assert_close(dx, dx64, n=2 * 72, dtype=torch.float32)      # the row's two sums
    tolerance.assert_close(dw, dw64, n=72 + 40, dtype=torch.float32)     # the row's sum, then the 40 rows'


def test_rmsnorm_forward_v1_equals_v2():
    x = torch.randn(9, 70, device=DEVICE)
    w = torch.randn(70, device=DEVICE)
    y1, r1 = rmsnorm.rmsnorm_forward_v1(x, w, 1e-5)     # one row per program, BLOCK = 128
    y2, r2 = rmsnorm.rmsnorm_forward_v2(x, w, 1e-5)
    tolerance.assert_close(y1, y2, n=70 + 2)    # the row's sum of squares and a few roundings
    tolerance.assert_close(r1, r2, n=70 + 2)


@pytest.mark.parametrize("shape, dtype", [((40, 72), torch.float32), ((37, 100), torch.float32),
                                          ((9, 64), torch.bfloat16), ((130, 8), torch.float32)])
def test_rmsnorm_backward_v2_equals_v1(shape, dtype):
    """v2 moves the same tiles by TMA: the same dx and dw (rows past the end load as zeros, as v1's masks give)."""
    torch.manual_seed(0)
    x, g = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2))
    w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
    _, rstd = rmsnorm.rmsnorm_forward_v2(x, w, 1e-5)
    dx1, dw1 = rmsnorm.rmsnorm_backward_v1(g, x, w, rstd)
    dx2, dw2 = rmsnorm.rmsnorm_backward_v2(g, x, w, rstd)
    n = 2 if dtype == torch.bfloat16 else 2 * shape[-1] + shape[0]   # fp32 sums; bf16: the roundings of the results
    tolerance.assert_close(dx2, dx1, n=n, dtype=dtype)
    tolerance.assert_close(dw2, dw1, n=n, dtype=dtype)


def test_rmsnorm_backward_v2_refuses_rows_tma_cannot_move():
    x = torch.randn(4, 33, device=DEVICE)                                     # 132-byte rows
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        rmsnorm.rmsnorm_backward_v2(x, x, torch.ones(33, device=DEVICE), torch.ones(4, device=DEVICE))


def test_rmsnorm_bf16_matches_the_torch_module():
    x = torch.randn(4, 48, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = rmsnorm.rmsnorm(x, w, 1e-5)
    y_ref = torch_rms_norm(x, w, 1e-5)
    assert y.dtype == y_ref.dtype == torch.bfloat16
    # Both compute in fp32 and round x^ and then y to bf16 (picotron.tolerance: n in bf16 roundings); autograd's
    # bf16 backward rounds g w and each g x^ too, before its fp32 sums.
    tolerance.assert_close(y, y_ref, n=2)
    g = torch.randn_like(y)
    for mine, ref in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(y_ref, (x, w), g)):
        tolerance.assert_close(mine, ref, n=4)


def test_triton_rmsnorm_is_a_drop_in_for_the_model_norm():
    from picotron.model import RMSNorm
    torch.manual_seed(0)
    ref = RMSNorm(32, 1e-6).to(DEVICE)
    with torch.no_grad():
        ref.weight.normal_()
    mine = TritonRMSNorm(32, 1e-6).to(DEVICE)
    # The same parameters (name, shape, dtype, starting value), the same eps, the same state dict: without
    # subclassing picotron.model.RMSNorm (picotron.kernels imports nothing from the rest of picotron).
    fresh = RMSNorm(32, 1e-6).to(DEVICE)
    assert [(n, p.shape, p.dtype) for n, p in mine.named_parameters()] == \
        [(n, p.shape, p.dtype) for n, p in fresh.named_parameters()]
    assert torch.equal(mine.weight, fresh.weight) and list(mine.buffers()) == list(fresh.buffers()) == []
    mine.load_state_dict(ref.state_dict())
    assert mine.eps == ref.eps and set(mine.state_dict()) == {"weight"}
    ref.load_state_dict(mine.state_dict())
    x = torch.randn(2, 5, 32, device=DEVICE)
    tolerance.assert_close(mine(x), ref(x), n=32 + 2)   # the row's sum of squares and a few roundings
    shared = TritonRMSNorm.from_torch(ref)
    assert shared.weight is ref.weight and shared.eps == ref.eps
    assert "Triton" in repr(mine)


def test_a_model_with_triton_norms_trains_like_the_torch_one():
    """Swap every RMSNorm of a tiny Llama for TritonRMSNorm: same loss, same gradients."""
    from picotron.config import ModelConfig
    from picotron.model import Llama, RMSNorm, loss_fn
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    reference = Llama(config).to(DEVICE)
    model = Llama(config).to(DEVICE)
    model.load_state_dict(reference.state_dict())
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is RMSNorm:
                setattr(module, name, TritonRMSNorm.from_torch(child))
                swapped += 1
    assert swapped == 2 * config.num_layers + 1
    ids = torch.randint(0, 64, (2, 16), device=DEVICE)
    losses = []
    for m in (reference, model):
        loss = loss_fn(m(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        losses.append(loss)
    assert abs(losses[1].item() - losses[0].item()) < tolerance.LOSS_ATOL      # the course's claim for fp32 losses
    grads = tolerance.compare_all({name: q.grad for name, q in model.named_parameters()},
                                  {name: p.grad for name, p in reference.named_parameters()},
                                  n=tolerance.llama_roundings(config, 15, 2 * 15))   # float32 round-off of the model
    assert grads, str(grads)


def test_rmsnorm_bytes():
    assert gpu.rmsnorm_bytes(8, 16, 2) == 2 * 8 * 16 * 2 + 16 * 2 + 4 * 8
    assert gpu.rmsnorm_bytes(8, 16, 2, backward=True) == 3 * 8 * 16 * 2 + 16 * 2 + 4 * 8


# ---- FlashAttention -------------------------------------------------------------------------------
ATTENTION_CASES = [  # (batch, heads, kv_heads, seq_q, seq_k, head_dim, blocks)
    (1, 2, 2, 64, 64, 32, None),
    (2, 4, 2, 100, 100, 32, None),             # GQA; seq not a multiple of the block
    (1, 2, 1, 48, 48, 24, (16, 16)),           # head_dim not a power of two; many small blocks
    (1, 2, 2, 40, 72, 16, (32, 16)),           # more keys than queries (top-left causal alignment, as SDPA)
]


ATTENTION_CASE_IDS = ["square", "gqa_ragged", "d24_small_blocks", "seq_k_longer"]
WIDE_KEY_CASES = [  # versions 2 to 4 take any two tiles: key tiles wider than query tiles, the causal split
    (1, 4, 2, 70, 70, 16, (16, 32)),           # across several
    (1, 2, 2, 72, 40, 16, (16, 64)),           # and query tiles past the last key
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case, version", [(case, version) for version in (1, 2, 3, 4) for case in ATTENTION_CASES]
                         + [(case, version) for version in (2, 3, 4) for case in WIDE_KEY_CASES],
                         ids=[f"v{version}-{name}" for version in (1, 2, 3, 4) for name in ATTENTION_CASE_IDS]
                         + [f"v{version}-{name}" for version in (2, 3, 4)
                            for name in ("keys_wider", "keys_wider_seq_q_longer")])
def test_flash_attention_forward_and_backward(case, version, causal):
    batch, heads, kv_heads, seq_q, seq_k, head_dim, blocks = case
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq_q, head_dim, device=DEVICE, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, device=DEVICE, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, device=DEVICE, requires_grad=True)
    out = flash_attention(q, k, v, causal=causal, blocks=blocks, version=version)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    # Roundings (picotron.tolerance): forward, q.k over head_dim, the softmax and P V over seq_k; backward the
    # same sums again, and the sum over the queries (and a GQA group) of dK, dV.
    forward = head_dim + 2 * seq_k
    tolerance.assert_close(out, ref, n=forward)
    for name, mine, theirs in zip("qkv", grads, ref_grads):
        tolerance.assert_close(mine, theirs, n=2 * forward + 2, msg=f"d{name}")


def test_long_row_softmax_with_a_masked_start():
    """softmax_v3 (rows longer than a block) on rows whose first blocks are all -inf, as a causal mask makes them:
    the running sum starts at exp(-inf - -inf), NaN, unless the shift is guarded."""
    x = torch.randn(2, 20_000, device=DEVICE)
    x[:, :4096] = float("-inf")
    tolerance.assert_close(row_softmax.softmax_v3(x, block=1024), torch.softmax(x, -1), n=20_000 + 2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=ATTENTION_CASE_IDS)
def test_flash_attention_forward_v2_equals_v1_and_sdpa(case, causal):
    """v2 reads its tiles through tensor descriptors (TMA on Hopper); the arithmetic is v1's, in the same order."""
    batch, heads, kv_heads, seq_q, seq_k, head_dim, blocks = case
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq_q, head_dim, device=DEVICE)
    k, v = (torch.randn(batch, kv_heads, seq_k, head_dim, device=DEVICE) for _ in range(2))
    out, lse = attention.attention_forward_v2(q, k, v, causal, blocks=blocks)
    tolerance.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                           n=head_dim + 2 * seq_k)
    out_v1, lse_v1 = attention.attention_forward_v1(q, k, v, causal, blocks=blocks)
    tolerance.assert_close(out, out_v1, n=head_dim + 2 * seq_k)    # (equal in the interpreter: the same sums)
    tolerance.assert_close(lse, lse_v1, n=head_dim + seq_k)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_flash_attention_forward_v3_autotuned_equals_sdpa(causal):
    torch.manual_seed(0)
    q = torch.randn(1, 4, 70, 32, device=DEVICE)
    k, v = (torch.randn(1, 2, 70, 32, device=DEVICE) for _ in range(2))
    out, lse = attention.attention_forward_v3(q, k, v, causal)
    tolerance.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
                           n=32 + 2 * 70)
    tolerance.assert_close(lse, attention.attention_forward_v2(q, k, v, causal)[1], n=32 + 70)
    best = attention_tma.attention_forward_kernel_v3.best_config
    assert best in attention_tma.attention_forward_kernel_v3.configs     # one of the configs it timed


def test_flash_attention_v2_refuses_rows_tma_cannot_read():
    q = torch.randn(1, 2, 16, 6, device=DEVICE, dtype=torch.float16)    # 12-byte rows
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        attention.attention_forward_v2(q, q, q)


def test_flash_attention_log_sum_exp_and_strided_inputs():
    torch.manual_seed(1)
    qkv = torch.randn(1, 48, 3, 2, 32, device=DEVICE)               # (batch, seq, q/k/v, heads, d): a fused projection
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))       # (batch, heads, seq, d) views, not contiguous
    out, lse = attention.attention_forward_v1(q, k, v, causal=True)
    scores = (q @ k.transpose(-2, -1)) / 32 ** 0.5
    scores = scores.masked_fill(torch.ones(48, 48, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    tolerance.assert_close(lse, torch.logsumexp(scores, dim=-1), n=32 + 48)   # q.k over d, then the sum over keys
    tolerance.assert_close(out, torch.softmax(scores, -1) @ v, n=32 + 2 * 48)   # and P V over the keys


def test_flash_attention_with_a_scale_and_in_bf16():
    q, k, v = (torch.randn(1, 2, 40, 16, device=DEVICE, dtype=torch.bfloat16) for _ in range(3))
    out = flash_attention(q, k, v, causal=True, scale=0.3)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.3)
    assert out.dtype == torch.bfloat16
    # bf16 roundings (picotron.tolerance): P rounded to bf16 before P V, the output; the sums run in fp32.
    tolerance.assert_close(out.float(), ref, n=4, dtype=torch.bfloat16)


def test_flash_attention_refuses_bad_shapes():
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="do not split"):
        flash_attention(q, torch.randn(1, 2, 8, 16, device=DEVICE), torch.randn(1, 2, 8, 16, device=DEVICE))
    with pytest.raises(ValueError, match="powers of two"):
        flash_attention(q, q, q, blocks=(16, 32))
    with pytest.raises(ValueError, match="version=5; choose one of"):
        flash_attention(q, q, q, version=5)
    with pytest.raises(ValueError, match="needs scale >= 0, got -0.5; use version 3"):
        flash_attention(q, q, q, scale=-0.5, version=4)
    scores = (q @ q.transpose(-1, -2) * -0.5).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    tolerance.assert_close(flash_attention(q, q, q, scale=-0.5, version=3),         # version 3 takes it
                           scores.softmax(-1) @ q, n=16 + 2 * 8)


def test_attention_flops():
    assert gpu.attention_flops(1, 1, 8, 8, 4, causal=False) == 4 * 8 * 8 * 4
    assert gpu.attention_flops(2, 3, 8, 8, 4) == 2 * 3 * 4 * 8 * 8 * 4 / 2
    assert gpu.attention_flops(1, 1, 8, 8, 4, backward=True) == 2.5 * 4 * 8 * 8 * 4 / 2


# ---- the GPU model, the timer -------------------------------------------------------------------------
def test_sectors_per_warp():
    lanes = torch.arange(32 * 4)
    assert gpu.sectors_per_warp(lanes, 4) == 4            # 32 consecutive fp32: 128 B, 4 sectors
    assert gpu.sectors_per_warp(lanes * 64, 4) == 32      # one column of a 64-wide row-major matrix
    assert gpu.sectors_per_warp(lanes, 2) == 2            # bf16: 64 B
    assert gpu.sectors_per_warp(lanes // 32, 4) == 1      # a warp reading one value (broadcast)


def test_roofline_and_h100_figures():
    assert gpu.roofline(1 / 12, 989e12, 3.35e12) == pytest.approx(3.35e12 / 12)
    assert gpu.roofline(1e4, 989e12, 3.35e12) == 989e12
    assert 290 < gpu.H100_SXM.ridge_point < 300
    assert gpu.H200.hbm_bandwidth > gpu.H100_SXM.hbm_bandwidth and gpu.H200.bf16_flops == gpu.H100_SXM.bf16_flops


def test_cpu_timer_speaks_do_bench():
    calls = []
    ms = timing.cpu_do_bench(lambda: calls.append(1), warmup=2, rep=3)
    assert ms >= 0 and len(calls) == 5
    assert len(timing.cpu_do_bench(lambda: None, quantiles=(0.5, 0.2, 0.8))) == 3
    assert timing.bench(lambda: None, device="cpu", rep=2) >= 0


def test_kernels_tell_where_they_run():
    assert runtime.INTERPRETED == (not ON_GPU) or os.environ.get("TRITON_INTERPRET") == "1"
    assert DEVICE.type == ("cpu" if INTERPRETED else "cuda")


# ---- compiled for an H100, without one --------------------------------------------------------------
COMPILE_ALL = """
    import os, torch
    os.environ["TRITON_INTERPRET"] = "0"
    torch.cuda.is_available = lambda: True      # pretend: make picotron.kernels define compiler kernels
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from picotron.kernels import add, attention, attention_tma, rmsnorm, row_softmax

    def compile(kernel, types, constexprs, warps, stages=3):
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        # An H100 gives one block at most 227 KB of shared memory; more fails only when launched on the GPU.
        assert compiled.metadata.shared <= 227 * 1024, (kernel.__name__, compiled.metadata.shared)
        print("compiled", kernel.__name__)

    P, B = "*fp32", "*bf16"
    compile(add.add_kernel_v1, dict(x_ptr=P, y_ptr=P, z_ptr=P), dict(BLOCK=1024), 4)
    compile(add.add_kernel_v2, dict(x_ptr=P, y_ptr=P, z_ptr=P), dict(BLOCK=1024), 4)
    compile(add.add_kernel_v3.fn, dict(x_ptr=P, y_ptr=P, z_ptr=P), dict(BLOCK=4096), 8)
    compile(row_softmax.softmax_kernel_v1, dict(x_ptr=B, out_ptr=B), dict(BLOCK=4096), 8)
    compile(row_softmax.softmax_kernel_v2, dict(x_ptr=B, out_ptr=B), dict(ROWS=4, BLOCK=1024), 8)
    compile(row_softmax.softmax_kernel_v3, dict(x_ptr=P, out_ptr=P), dict(BLOCK=4096), 8)
    norm = dict(x_ptr=B, w_ptr=B, out_ptr=B, rstd_ptr=P, eps="fp32")
    compile(rmsnorm.rmsnorm_forward_kernel_v1, norm, dict(BLOCK=4096), 8)
    compile(rmsnorm.rmsnorm_forward_kernel_v2, norm, dict(ROWS=2, BLOCK=2048), 8)
    compile(rmsnorm.rmsnorm_backward_kernel_v1,
            dict(dy_ptr=B, x_ptr=B, w_ptr=B, rstd_ptr=P, dx_ptr=B, dw_partial_ptr=P), dict(ROWS=2, BLOCK=2048), 8)
    compile(rmsnorm.rmsnorm_backward_kernel_v2, dict(dy_ptr=B, x_ptr=B, w_ptr=B, rstd_ptr=P, dx_ptr=B,
            dw_partial_ptr=P), dict(ROWS=2, BLOCK=2048, STAGES=3), 8)
    flash = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_D=128, CAUSAL=True, DOT_FP32=False, PRECISION="tf32")
    tensors = {name: B for name in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr")}
    tensors.update(lse_ptr=P, delta_ptr=P, qk_scale="fp32", scale="fp32")
    for element_size, pointer, precision in ((2, B, "tf32"), (4, P, "ieee")):   # the launchers' tile choices
        typed = {name: (pointer if kind == B else kind) for name, kind in tensors.items()}
        block_m, block_n, warps, stages = attention._blocks(128, element_size=element_size)
        tiles = dict(flash, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision)
        compile(attention.attention_forward_kernel_v1, typed, tiles, warps, stages)
        compile(attention_tma.attention_forward_kernel_v2, typed, dict(tiles, LEAN=False), warps, stages)
        compile(attention_tma.attention_forward_kernel_v2, typed, dict(tiles, LEAN=True), warps, stages)   # v4
        block_m, block_n, warps, stages = attention._blocks(128, backward=True, element_size=element_size)
        tiles = dict(flash, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision)
        compile(attention.attention_backward_dkdv_kernel_v1, typed, tiles, warps, stages)
        compile(attention.attention_backward_dq_kernel_v1, typed, tiles, warps, stages)
        compile(attention_tma.attention_backward_dkdv_kernel_v2, typed, dict(tiles, KEYS_MAJOR=False), warps, stages)
        compile(attention_tma.attention_backward_dq_kernel_v2, typed, tiles, warps, stages)
        for kernel, configs, major in ((attention_tma.attention_backward_dkdv_kernel_v3, attention_tma.DKDV_CONFIGS,
                                        dict(KEYS_MAJOR=True)),
                                       (attention_tma.attention_backward_dq_kernel_v3, attention_tma.DQ_CONFIGS, {})):
            smallest = configs[-1]    # backward v3's autotuners: at least this one fits, in bf16 and in fp32
            compile(kernel.fn, typed, dict(flash, **smallest.kwargs, **major, PRECISION=precision),
                    smallest.num_warps, smallest.num_stages)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine compiles them for real in the other tests")
def test_every_kernel_compiles_for_an_h100():
    done = _python(COMPILE_ALL, TRITON_DEFAULT_FP_FUSION="1")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("compiled") == 28


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine picotron.kernels compiles for that GPU")
def test_compile_report_for_an_h100_shows_what_each_version_changed():
    """python -m picotron.kernels.report: registers, spills, shared memory and instructions of every kernel
    version compiled for sm_90. What the ladder claims must be there: FlashAttention's dots on Hopper's wgmma,
    forward v2's tiles by TMA instead of loads into registers, and no forward, dq or backward v3 config spilling
    registers (the dkdv kernels of v1 and v2 do: v3's reason to be)."""
    done = subprocess.run([sys.executable, "-m", "picotron.kernels.report", "--json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout)
    reports = {r["name"]: r for r in rows}
    assert len(rows) == 36 and all(r["arch"] == 90 for r in rows)
    assert all(r["shared_bytes"] <= 227 * 1024 for r in rows), rows
    spilling = {r["name"] for r in rows if r["local_bytes"]}
    assert spilling <= {"attention_backward_dkdv_kernel_v1", "attention_backward_dkdv_kernel_v2"}, rows
    for name, configs in (("forward_kernel_v3", attention_tma.FORWARD_CONFIGS),
                          ("forward_kernel_v4", attention_tma.FORWARD_CONFIGS),
                          ("backward_dkdv_kernel_v3", attention_tma.DKDV_CONFIGS),
                          ("backward_dq_kernel_v3", attention_tma.DQ_CONFIGS)):   # every config an autotuner may pick
        assert sum(r["name"] == f"attention_{name}" for r in rows) == len(configs)
    v3s, v4s = ([r for r in rows if r["name"] == f"attention_forward_kernel_v{n}"] for n in (3, 4))
    for v3, v4 in zip(v3s, v4s):        # v4's claim: the same tiles, fewer FP32 instructions, as many exp2s
        assert v3["tiles"] == v4["tiles"] and v4["fp32_ops"] < v3["fp32_ops"], (v3, v4)
    v1, v2 = reports["attention_forward_kernel_v1"], reports["attention_forward_kernel_v2"]
    assert v1["hgmma"] > 0 and v2["hgmma"] > 0 and v1["hmma"] == v2["hmma"] == 0
    assert v1["tma_loads"] == 0 and v1["global_loads"] > 0
    assert v2["tma_loads"] > 0 and v2["global_loads"] == 0 and v2["registers"] < v1["registers"]
    assert reports["softmax_kernel_v1"]["hgmma"] == 0          # no matmul, no matrix instruction
    norm_v1, norm_v2 = reports["rmsnorm_backward_kernel_v1"], reports["rmsnorm_backward_kernel_v2"]
    assert norm_v2["tma_loads"] > 0 and norm_v2["global_loads"] < norm_v1["global_loads"]
    for part in ("dkdv", "dq"):                                 # backward v2 reads its streamed tiles by TMA
        old, new = reports[f"attention_backward_{part}_kernel_v1"], reports[f"attention_backward_{part}_kernel_v2"]
        assert new["tma_loads"] > 0 and new["global_loads"] < old["global_loads"], (old, new)


# ---- on a GPU: larger sizes, bf16, against torch's kernels -------------------------------------------
@gpu_only
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 30000), (8192, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_softmax_large(shape, dtype):
    x = torch.randn(shape, device="cuda", dtype=dtype) * 4
    # fp32: exp, the row's sum, the division; bf16: both compute in fp32 and round once (no matmul: no TF32).
    n = shape[-1] + 2 if dtype == torch.float32 else 2
    tolerance.assert_close(softmax(x), torch.softmax(x.float(), -1).to(dtype), n=n, tf32=False)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_rmsnorm_large(dtype):
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(4096, device="cuda", dtype=dtype, requires_grad=True)
    y = rmsnorm.rmsnorm(x, w, 1e-5)
    g = torch.randn_like(y)
    y_ref = torch_rms_norm(x, w, 1e-5)
    rows, cols = x.shape
    # Roundings (picotron.tolerance; no matmul: no TF32): fp32 as test_rmsnorm_forward_and_backward; bf16 as
    # test_rmsnorm_bf16_matches_the_torch_module, the sums in fp32.
    if dtype == torch.float32:
        n_y, n_dx, n_dw = cols + 2, 2 * cols, cols + rows
    else:
        n_y, n_dx, n_dw = 2, 4, 4
    tolerance.assert_close(y, y_ref, n=n_y, tf32=False)
    mine, ref = torch.autograd.grad(y, (x, w), g), torch.autograd.grad(y_ref, (x, w), g)
    tolerance.assert_close(mine[0], ref[0], n=n_dx, tf32=False, msg="dx")
    tolerance.assert_close(mine[1], ref[1], n=n_dw, tf32=False, msg="dw")


@gpu_only
@pytest.mark.parametrize("causal, head_dim, version", [(causal, d, 1) for causal in (True, False) for d in (64, 128)]
                         + [(True, 128, 2), (True, 128, 3), (False, 64, 3), (True, 128, 4)])   # autotuned, compiled
def test_gpu_flash_attention_bf16(causal, head_dim, version):
    problem = runtime.gpu_problem(capability=(8, 0), shared_kib=132)   # forward v2's 128 x 64 tiles: 129 KiB
    if version > 1 and problem:
        pytest.skip(f"versions 2-4 as tuned for an A100/H100: {problem}")
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1024, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 4, 1024, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 4, 1024, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attention(q, k, v, causal=causal, version=version)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    # bf16 roundings (picotron.tolerance): both round P (and dS) to bf16 before their fp32-accumulated products,
    # and round the result once.
    tolerance.assert_close(out, ref, n=4)
    g = torch.randn_like(out)
    grads, ref_grads = torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)
    for name, mine, theirs in zip("qkv", grads, ref_grads):
        tolerance.assert_close(mine, theirs, n=4, msg=f"d{name}")


@gpu_only
def test_gpu_fp32_attention_is_not_tf32():
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda") for _ in range(3))
    # fp32 round-off (u = 2^-24, not TF32's 2^-11: the kernel's tl.dot runs input_precision="ieee" for fp32):
    # q.k over head_dim 64, the softmax and P V over 256 keys.
    tolerance.assert_close(flash_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           n=64 + 2 * 256, tf32=False)


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.0", True), ("3.6.0", "2.2.6", False),
    ("3.7.1", "2.4.6", False), ("3.9.0+git1234", "2.4.6", False), ("3.5.1", "2.3.1rc1", True),
])
def test_interpreter_problem_names_the_triton_numpy_pair_that_breaks_loops(triton_version, numpy_version, refused):
    # measured: triton 3.6 + numpy 2.4.6 fails every assignment 09 kernel with a loop;
    # 3.6 + numpy 2.2.6 and 3.7.1 + numpy 2.4.6 pass
    from picotron.kernels.runtime import interpreter_problem
    problem = interpreter_problem(triton_version, numpy_version)
    assert (problem is not None) == refused
    if refused:
        assert "triton>=3.7" in problem and "numpy<2.3" in problem

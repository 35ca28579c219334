"""Where triton is missing (it is built for Linux only: macOS, Windows outside WSL), chapter 09 runs its torch parts,
FlashAttention on the plain-torch path, and says what it skipped; assignment 09 stops at once, saying where to go,
and the grader refuses to grade it there.

The notebooks run in a kernel that cannot import triton: a sitecustomize on PYTHONPATH puts a finder in front of
every other that refuses `triton` and its submodules, as a Python without the package does.
"""

import os
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]

HIDE_TRITON = '''
import sys

class HideTriton:
    """Import `triton` as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTriton())
'''


def execute_without_triton(notebook: Path, tmp_path: Path, monkeypatch) -> nbformat.NotebookNode:
    (tmp_path / "sitecustomize.py").write_text(HIDE_TRITON)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(notebook, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}}).execute()
    return nb


def printed(nb) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_chapter_09_runs_without_triton_on_the_torch_path(tmp_path, monkeypatch):
    nb = execute_without_triton(ROOT / "chapters" / "09_gpu_kernels.ipynb", tmp_path, monkeypatch)
    text = printed(nb)
    assert "Triton kernels: none here: triton is not installed" in text
    assert text.count("needs triton, which is built for Linux only") == 8        # each Triton cell says it skipped
    assert "plain-torch FlashAttention (no triton here): 8 cases" in text        # O, dQ, dK, dV, causal and not
    assert "plain-torch FlashAttention" in text.split("loss: SDPA + torch norms")[1]
    assert "Not measured: triton is not installed" in text


def test_assignment_09_says_where_to_run_it(tmp_path, monkeypatch):
    with pytest.raises(nbclient.exceptions.CellExecutionError,
                       match="This assignment writes Triton kernels, and triton is not installed here"):
        execute_without_triton(ROOT / "exercises" / "09_gpu_kernels.ipynb", tmp_path, monkeypatch)


def test_the_grader_refuses_assignment_09_where_triton_is_missing(tmp_path):
    """Every check would fail on the grader's machine, not on the answers: it says so before any kernel starts."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_TRITON)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "picotron_course", "grade", "exercises/09_gpu_kernels.ipynb"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "assignment 09_gpu_kernels runs on triton, which is not installed here" in done.stdout
    assert "grade it where triton is" in done.stdout and "Traceback" not in done.stdout + done.stderr

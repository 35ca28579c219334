"""The set-up cell (picotron_course/setup_cell.py): every chapter and assignment installs the course where it
is missing (Colab, a fresh Jupyter), and does nothing where it is installed."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import venv
from importlib.metadata import distribution
from pathlib import Path

import nbformat
import pytest
from packaging.requirements import Requirement

from picotron_course import exercises
from picotron_course.setup_cell import SOURCE, TAG, after_install

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(ROOT.glob("chapters/*.ipynb")) + sorted(ROOT.glob("solutions/*.ipynb")) + \
            sorted(ROOT.glob("exercises/*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_notebook_runs_the_setup_cell_first(path):
    first = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    assert first.source == SOURCE and TAG in first.metadata.get("tags", []), \
        f"{path.relative_to(ROOT)}: its first code cell is not the set-up cell; run python -m picotron_course generate"


def test_generate_puts_it_back_and_stale_says_so(tmp_path):
    for folder in ("chapters", "solutions", "exercises"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    chapter = tmp_path / "chapters" / "00_collectives.ipynb"
    nb = nbformat.read(chapter, as_version=4)
    nb.cells = [c for c in nb.cells if TAG not in c.metadata.get("tags", [])]
    nbformat.write(nb, chapter)
    assert exercises.stale(tmp_path) == [f"{chapter}'s first code cell is not the set-up cell of "
                                         "picotron_course/setup_cell.py"]
    assert exercises.generate(tmp_path) == [chapter]
    assert exercises.stale(tmp_path) == []


def test_where_the_course_is_installed_it_does_nothing(monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the set-up cell ran a command"))
    exec(SOURCE, {})
    assert capsys.readouterr() == ("", "")


def test_without_the_course_or_a_clone_it_says_what_to_do(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "picotron" else real(name, *a))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the set-up cell ran a command"))
    monkeypatch.delenv("PICOTRON_SOURCE", raising=False)
    monkeypatch.chdir(tmp_path)   # no clone in .., ./picotron or /content/picotron
    with pytest.raises(SystemExit, match=r"no clone of it is here\. Run `!git clone <the course's git URL> picotron`"):
        exec(SOURCE, {})


def test_after_install_asks_for_a_restart_only_when_pip_replaced_what_was_imported(tmp_path, capsys):
    def report(*names):
        path = tmp_path / "report.json"
        path.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": "1.0"}} for n in names]}))
        return str(path)

    imported = {"pytest", "_distutils_hack"}   # setuptools' module, which every Python imports at start
    after_install("/the/clone", report("picotron", "a-package-never-imported", "setuptools"), imported)
    assert capsys.readouterr().out.startswith("picotron installed from /the/clone: 3 packages; torch ")
    with pytest.raises(SystemExit, match=r"pip replaced pytest, which this Python had already imported: restart"):
        after_install("/the/clone", report("picotron", "pytest"), imported)


def _pip_reaches_an_index(python: str, folder: Path) -> bool:
    try:
        return subprocess.run([python, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), "tqdm"],
                              capture_output=True, timeout=120).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _share_torch(site_packages: Path, shim: Path) -> None:
    """Make this environment's torch (and what it needs) visible to a fresh one, as Colab's preinstalled torch is:
    a folder of links to its files, on the new environment's path through a .pth file."""
    shim.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        dist = distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if Path(dist.locate_file(top)).exists() and not (shim / top).exists():
                (shim / top).symlink_to(dist.locate_file(top))
        for requirement in map(Requirement, dist.requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    (site_packages / "shared-torch.pth").write_text(str(shim) + "\n")


def test_chapter_00_sets_itself_up_outside_the_repository(tmp_path):
    """The Colab case: a notebook alone in a folder, a Python that has torch (and a kernel) but not the course.
    The set-up cell, pointed at this clone by PICOTRON_SOURCE, installs the course; then the whole chapter runs."""
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = str(env_dir / "bin" / "python")
    if not _pip_reaches_an_index(python, tmp_path / "download"):
        pytest.skip("pip cannot reach a package index from here: the set-up cell installs the course from one")
    site_packages = Path(subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    _share_torch(site_packages, tmp_path / "torch-as-preinstalled")
    subprocess.run([python, "-m", "pip", "install", "-q", "ipykernel", "nbclient"], check=True)
    clone = tmp_path / "clone"   # what pip builds from (it writes build/ beside the sources: not in this checkout)
    clone.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, clone / name)
    for name in ("picotron", "picotron_course"):
        shutil.copytree(ROOT / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    notebook = tmp_path / "work" / "00_collectives.ipynb"
    notebook.parent.mkdir()
    shutil.copy(ROOT / "chapters" / "00_collectives.ipynb", notebook)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {
        "PICOTRON_SOURCE": str(clone), "JUPYTER_DATA_DIR": str(tmp_path / "jupyter")}   # no kernel of this machine's
    execute = ("import nbclient, nbformat, sys; nb = nbformat.read(sys.argv[1], as_version=4); "
               "nbclient.NotebookClient(nb, timeout=300, kernel_name='python3', resources={'metadata': {'path': "
               "sys.argv[2]}}).execute(); print(''.join(o.get('text', '') for o in nb.cells[next(i for i, c in "
               "enumerate(nb.cells) if c.cell_type == 'code')].outputs))")
    done = subprocess.run([python, "-c", execute, str(notebook), str(notebook.parent)], env=env, cwd=notebook.parent,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(f"picotron installed from {re.escape(str(clone))}: \\d+ packages; torch \\S+ kept", done.stdout), \
        done.stdout   # the torch already there is kept, as Colab's would be

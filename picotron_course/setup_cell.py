"""The first code cell of every chapter and assignment: the course installs itself where it is missing.

On Colab, or in a Jupyter whose Python does not have the course, the cell installs it: from
PICOTRON_SOURCE when that is set (a git URL, a clone's folder or a wheel), else from a clone found
beside the notebook (the notebook's own repository, or a `picotron/` folder cloned into the working
directory, as `!git clone ... picotron` does on Colab). pip keeps every package that is already new
enough, torch included (Colab's CUDA build stays), and `after_install` then says in one line what
was installed and whether the kernel must restart: only when pip replaced a package this Python had
already imported. Where the course is installed (a clone after README.md's set-up) the cell does
nothing.

The cell's text is SOURCE below, written into every notebook by `python -m picotron_course generate`
and checked by tests/test_setup_cell.py; it is plain Python on purpose, since it runs before the
course can be imported.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SOURCE", "TAG", "after_install", "with_setup_cell"]

TAG = "picotron-setup"

SOURCE = '''\
# Set-up: where this Python lacks the course (Colab, a fresh Jupyter) this installs it, from PICOTRON_SOURCE or a
# clone beside this notebook (1-2 minutes; a torch that is new enough is kept), and says whether to restart.
# Where the course is installed (README.md's set-up) it does nothing.
import importlib.util
if importlib.util.find_spec("picotron") is None:
    import os, subprocess, sys, tempfile
    places = [os.environ.get("PICOTRON_SOURCE", ""), "..", "picotron", "/content/picotron"]
    source = next((p for p in places if p.startswith(("git+", "https://")) or p.endswith(".whl")
                   or os.path.isfile(os.path.join(p, "picotron", "launch.py"))), None)
    if source is None:
        raise SystemExit("The course is not installed and no clone of it is here. Run `!git clone <the course's git "
                         "URL> picotron` in a cell (the repository this notebook came from), then this cell again.")
    report, imported = os.path.join(tempfile.mkdtemp(), "pip-report.json"), set(sys.modules)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--report", report, source], check=True)
    importlib.invalidate_caches()
    from picotron_course.setup_cell import after_install
    after_install(source, report, imported)'''


def after_install(source: str, report: str, imported: set[str]) -> None:
    """Say what pip installed (its --report file); stop with what to do when the kernel must restart: when pip
    replaced a package of which a module was `imported` before it ran (pip's own tools aside)."""
    installed = {item["metadata"]["name"].lower(): item["metadata"]["version"]
                 for item in json.loads(Path(report).read_text())["install"]}
    from importlib.metadata import packages_distributions
    modules = packages_distributions()
    stale = sorted(name for name in installed if name not in {"picotron", "pip", "setuptools", "wheel"}
                   and any(m in imported for m in modules_of(name, modules)))
    import torch
    kept = "installed" if "torch" in installed else "kept"
    print(f"picotron installed from {source}: {len(installed)} packages; torch {torch.__version__} {kept}"
          f" ({'CUDA: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU only'})")
    if stale:
        raise SystemExit(f"pip replaced {', '.join(stale)}, which this Python had already imported: restart the kernel "
                         "(Colab: Runtime > Restart session), then run the notebook from the top (this cell will "
                         "then do nothing).")


def modules_of(distribution: str, modules: dict[str, list[str]]) -> list[str]:
    """The top-level modules of `distribution` (a name as pip's report gives it), from packages_distributions()."""
    return [m for m, dists in modules.items() if distribution in {d.lower() for d in dists}] or \
        [distribution.replace("-", "_")]


def with_setup_cell(nb) -> bool:
    """Make the set-up cell `nb`'s first code cell (before its imports); True when that changed `nb`."""
    import nbformat
    cells = nb.cells
    at = next((i for i, c in enumerate(cells) if TAG in c.get("metadata", {}).get("tags", [])
               or (c.cell_type == "code" and c.source == SOURCE)), None)
    if at is not None:
        tags = cells[at].setdefault("metadata", {}).setdefault("tags", [])
        if cells[at].source == SOURCE and TAG in tags:
            return False
        cells[at].source = SOURCE
        if TAG not in tags:
            tags.append(TAG)
        return True
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    cells.insert(first_code, nbformat.v4.new_code_cell(SOURCE, metadata={"tags": [TAG]}, id=TAG))
    return True

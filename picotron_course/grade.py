"""Grade a learner's notebook: run every cell in a fresh kernel, count the check cells that pass.

    python -m picotron_course grade exercises/00_collectives.ipynb

Every cell runs, in order, even after one fails (a learner who solved exercises 1 and 3 gets
both), with the notebook's folder as working directory. A check cell passes when it raises
nothing; its check raises AssertionError on a wrong answer and the learner's stub raises
NotImplementedError on an unsolved one. The notebook file itself is not modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from picotron_course.exercises import check_name

__all__ = ["CellResult", "grade", "score_table"]


@dataclass
class CellResult:
    index: int            # cell number in the notebook, from 1
    check: str | None     # the check the cell calls; None for other cells
    error: str | None     # "ExceptionType: first line of the message", None when the cell ran
    seconds: float | None

    @property
    def passed(self) -> bool:
        return self.error is None

    @property
    def verdict(self) -> str:
        if self.error is None:
            return "passed"
        if self.error.startswith("NotImplementedError"):
            return "not done yet (NotImplementedError)"
        if self.error.split(":")[0] in ("AssertionError", "CollectiveNotAllowed"):
            return "wrong answer"
        return "error"


def grade(path: str | Path, cell_timeout: float = 300, kernel_name: str = "python3") -> list[CellResult]:
    """Execute the notebook at `path` and return one result per code cell that ran or should have."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, allow_errors=True, kernel_name=kernel_name,
                            shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    died = None
    try:
        client.execute()
    except DeadKernelError as e:  # e.g. a learner's os._exit: the cells after it never ran
        died = f"DeadKernelError: the kernel died ({e})".split("\n")[0]
    results = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        ran = "execution" in cell.metadata or cell.get("execution_count") is not None
        error = _error_of(cell) if ran else (died or "not run")
        results.append(CellResult(i + 1, check_name(cell.source), error, _seconds(cell) if ran else None))
    return results


def _error_of(cell) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            first = (output.get("evalue") or "").strip().split("\n")[0]
            return f"{output.get('ename')}: {first}"[:160]
    return None


def _seconds(cell) -> float | None:
    timing = cell.metadata.get("execution", {})
    try:
        start = datetime.fromisoformat(timing["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(timing["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def score_table(results: list[CellResult], title: str = "") -> str:
    """The table a teacher reads: one row per check cell, then the score."""
    checks = [r for r in results if r.check]
    rows = [("cell", "check", "result", "time")]
    rows += [(str(r.index), r.check, r.verdict, "" if r.seconds is None else f"{r.seconds:.1f} s") for r in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [title] if title else []
    lines += ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    for r in checks:
        if not r.passed:
            lines.append(f"  cell {r.index}: {r.error}")
    for r in results:
        if not r.check and not r.passed:  # a definition that does not run breaks the checks after it
            lines.append(f"  cell {r.index} (not a check) failed: {r.error}")
    passed = sum(r.passed for r in checks)
    lines.append(f"score: {passed}/{len(checks)}")
    return "\n".join(lines)

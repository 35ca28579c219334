"""What every test shares: under pytest-xdist (`pytest -n N`) the machine's cores split between the N workers, and
the `every_case` fixture, which counts the cases a check of the course ran.

Each torch process otherwise starts one thread per core: 12 workers on 16 cores run 192 compute threads (on
the H200 machine, 2026-11-28, a test that takes 0.9 s alone took 506 s among them). OMP_NUM_THREADS, set before any
test imports torch, also reaches what the workers start (notebook kernels, `python -m picotron.train`); the
ranks of `picotron.launch.run` always use one thread each. A value already set is kept.
"""

import os
import sys

import pytest

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _workers))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def every_case():
    """For the test of a check's correct answer: `every_case({title: cases})` after the check asserts that it
    printed at least one table and that each ran exactly that many cases. The count is the check's promise:
    without it, a check that quietly skipped some of its cases (a group size, a dtype) would still pass."""
    from picotron_course.checks import Report

    Report.finished.clear()

    def ran(expected: dict) -> None:
        assert Report.finished, "the check printed no table"
        wrong = [(title, n, expected.get(title)) for title, n in Report.finished if n != expected.get(title)]
        assert not wrong, f"(table, cases it ran, cases expected): {wrong}"
    return ran


@pytest.fixture
def refusing_nothing(monkeypatch):
    """For the test of a checks module's own correct bases (the records' parents, which the checks refuse as
    answers): `refusing_nothing(module)` switches Check.refuse off for every check the module declares, for this
    test only. It reaches this process alone: checks whose ranks refuse too need another way (an unrefused copy)."""
    def off(module) -> None:
        from picotron_course.engine import Check
        for declared in [value for value in vars(module).values() if isinstance(value, Check)]:
            monkeypatch.setattr(declared, "course", None)
    return off

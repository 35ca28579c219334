"""Course tooling: exercises are generated from solutions, and every unsolved check fails alone.

The solution notebooks themselves run under nbval (`pytest solutions/`); the checks are tested on their
correct answers in tests/test_checks_*.py and on their misconceptions in tests/test_misconceptions.py.
"""

import json
import linecache
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from picotron_course import exercises
from picotron_course.exercises import MarkerError, is_check_cell, stub_code, stub_markdown

ROOT = Path(__file__).resolve().parents[1]
EXERCISE_NOTEBOOKS = sorted((ROOT / "exercises").glob("*.ipynb"))


# ---- 1. exercises/ is what the generator makes from solutions/ --------------------------------
def test_exercises_are_generated_from_solutions(tmp_path):
    solutions = sorted((ROOT / "solutions").glob("*.ipynb"))
    assert solutions, "no solution notebooks found"
    assert [p.name for p in EXERCISE_NOTEBOOKS] == [p.name for p in solutions]
    for solution in solutions:
        generated = exercises.make_exercise(nbformat.read(solution, as_version=4), solution.name)
        committed = nbformat.read(ROOT / "exercises" / solution.name, as_version=4)
        assert [(c.cell_type, c.source) for c in committed.cells] == \
               [(c.cell_type, c.source) for c in generated.cells], \
               f"exercises/{solution.name} is stale: run `python -m picotron_course generate`"
        assert not any(c.get("outputs") or c.get("execution_count") for c in committed.cells)
        assert "### BEGIN SOLUTION" not in json.dumps([c.source for c in committed.cells])
    assert exercises.stale(ROOT) == []


def test_stale_exercises_are_detected(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    assert exercises.stale(tmp_path) == []
    nb = nbformat.read(tmp_path / "exercises" / EXERCISE_NOTEBOOKS[0].name, as_version=4)
    nb.cells[-1].source += "\nedited by hand"
    nbformat.write(nb, tmp_path / "exercises" / EXERCISE_NOTEBOOKS[0].name)
    assert "differs" in " ".join(exercises.stale(tmp_path))
    cli = [sys.executable, "-m", "picotron_course"]
    assert subprocess.run([*cli, "check", "--root", str(tmp_path)], capture_output=True).returncode == 1
    assert exercises.generate(tmp_path) == [tmp_path / "exercises" / EXERCISE_NOTEBOOKS[0].name]
    assert exercises.stale(tmp_path) == []
    assert exercises.generate(tmp_path) == []  # deterministic: a second run writes nothing


def test_generate_only_the_named_assignments(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    (tmp_path / "exercises").mkdir()
    first, second = EXERCISE_NOTEBOOKS[0].stem, EXERCISE_NOTEBOOKS[1].stem
    made = exercises.generate(tmp_path, only=[f"solutions/{first}.ipynb"])
    assert made == [tmp_path / "exercises" / f"{first}.ipynb"]
    assert not (tmp_path / "exercises" / f"{second}.ipynb").exists()   # the others are left alone
    with pytest.raises(ValueError, match="no solutions/<name>.ipynb for \\['99_nope'\\]"):
        exercises.generate(tmp_path, only=["99_nope"])


def test_strip_outputs(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)", id="a")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[0].execution_count = 3
    nb.cells[0].metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    nb.metadata["widgets"] = {"state": {}}
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    assert exercises.strip_outputs(path, write=False) is True
    assert nbformat.read(path, as_version=4).cells[0].outputs  # write=False changed nothing
    assert exercises.strip_outputs(path) is True
    clean = nbformat.read(path, as_version=4)
    assert clean.cells[0].outputs == [] and clean.cells[0].execution_count is None
    assert clean.cells[0].metadata == {} and "widgets" not in clean.metadata
    assert exercises.strip_outputs(path) is False  # idempotent


# ---- 2. every check cell of every exercise fails on its own with NotImplementedError -----------
def _check_cells():
    for path in EXERCISE_NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if is_check_cell(cell):
                yield pytest.param(path, i, id=f"{path.stem}-cell{i + 1}-{exercises.check_name(cell.source)}")


def test_every_exercise_has_check_cells():
    for path in EXERCISE_NOTEBOOKS:
        assert any(is_check_cell(c) for c in nbformat.read(path, as_version=4).cells), path


@pytest.mark.parametrize("path, index", list(_check_cells()))
def test_unsolved_check_fails_with_not_implemented(path, index):
    """Run the cells before the check (skipping other checks), then only this check cell.

    Cells run in this process (much faster than a kernel); the functions they define live in
    `namespace`, and `run` sends the ones a rank calls to the ranks (by value, as from a notebook).
    """
    cells = nbformat.read(path, as_version=4).cells
    namespace = {"__name__": "__main__"}
    for i, cell in enumerate(cells[:index]):
        if cell.cell_type == "code" and not is_check_cell(cell):
            try:
                _run_cell(cell.source, f"{path.name} cell {i + 1}", namespace)
            except NotImplementedError:  # a demo cell calling an unsolved function: its check will say so
                pass
    with pytest.raises(NotImplementedError):
        _run_cell(cells[index].source, f"{path.name} cell {index + 1}", namespace)


def _run_cell(source: str, name: str, namespace: dict) -> None:
    """exec a cell as Jupyter does, its source registered in linecache: code that reads the source of a
    function defined there (a @triton.jit kernel does, through inspect) finds the cell, not __main__'s file."""
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    exec(compile(source, name, "exec"), namespace)


# ---- 3. the generator: stubs, and markers it must refuse ---------------------------------------
def test_stub_keeps_signature_docstring_and_indentation():
    source = 'import torch\n\ndef f(x, y=2):\n    """Doc."""\n    a = 1\n    ### BEGIN SOLUTION\n' \
             '    if x:\n        return y\n    return a\n    ### END SOLUTION\n\nclass A:\n    def m(self):\n' \
             '        for i in range(3):\n            ### BEGIN SOLUTION\n            pass\n' \
             '            ### END SOLUTION\n        return 1\n'
    stubbed = stub_code(source)
    assert stubbed == 'import torch\n\ndef f(x, y=2):\n    """Doc."""\n    a = 1\n' \
                      '    raise NotImplementedError("f: write this part")\n\nclass A:\n    def m(self):\n' \
                      '        for i in range(3):\n            raise NotImplementedError("m: write this part")\n' \
                      '        return 1\n'
    namespace = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError):
        namespace["f"](1)
    assert stub_code("x = 1  # no markers\n") == "x = 1  # no markers\n"


@pytest.mark.parametrize("source, says", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "inside a function body"),
    ("class A:\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION\n", "inside a function body"),
    ("def f():\n    x = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION\n", "inside a function body"),
    ("def f():\n    class B:\n        ### BEGIN SOLUTION\n        x = 1\n        ### END SOLUTION\n",
     "inside a function body"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n", "has no"),
    ("def f():\n    return 1\n    ### END SOLUTION\n", "END without its BEGIN"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n",
     "BEGIN inside another"),
    ("def f():\n    ### BEGIN SOLUTION\n    if 1:\n        x = 1\n        ### END SOLUTION\n", "same indentation"),
    ("def f():\n    ## begin solution\n    return 1\n", "exactly"),
])
def test_generator_rejects_bad_markers(source, says):
    with pytest.raises(MarkerError, match=says):
        stub_code(source)


def test_markdown_answers():
    text = "**Q1.** Why?\n\n<!-- BEGIN SOLUTION -->\nBecause.\n<!-- END SOLUTION -->\n"
    assert stub_markdown(text) == "**Q1.** Why?\n\n*Write your answer here.*\n"
    with pytest.raises(MarkerError, match="unbalanced"):
        stub_markdown("<!-- BEGIN SOLUTION -->\nBecause.\n")


def test_generate_names_the_notebook_and_cell(tmp_path):
    (tmp_path / "solutions").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("hi", id="a"),
                                         nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION",
                                                                   id="b")])
    nbformat.write(nb, tmp_path / "solutions" / "99_bad.ipynb")
    with pytest.raises(MarkerError, match=r"99_bad.ipynb, cell 3, line 1"):   # after the set-up cell generate adds
        exercises.generate(tmp_path)


def test_check_cells_are_recognised():
    cell = nbformat.v4.new_code_cell
    assert is_check_cell(cell("check_ring_all_reduce(ring_all_reduce)"))
    assert is_check_cell(cell("# run it\nfor f in fs:\n    check_thing(f)"))
    assert not is_check_cell(cell("from picotron_course.checks_collectives import check_ring_all_reduce"))
    assert not is_check_cell(cell("def check_mine(x):\n    return x"))
    assert not is_check_cell(nbformat.v4.new_markdown_cell("check_ring_all_reduce(f)"))

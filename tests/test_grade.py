"""The grader scores the course's checks, not the submission's: deleted or edited check cells score 0, and a
check runs in a process of its own, so what a notebook does to its kernel (rebinding or patching a check, or
torch) cannot make it pass.

Most tests grade a tiny course built here (exercises/99_tiny.ipynb, generated from its solution,
whose check cells call a module written here): a kernel runs such a notebook in about a second.
One test grades the fastest real exercise through the command line.
"""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from picotron_course import exercises
from picotron_course.__main__ import main
from picotron_course.grade import grade, grade_folder
from picotron_course.setup_cell import SOURCE as SETUP_CELL

ROOT = Path(__file__).resolve().parents[1]
TINY = "99_tiny"
CHECKS_MODULE = "tiny_course_checks"  # a name no other test imports: the grader imports it in this process

CHECKS_SOURCE = '''"""The checks of the tiny course of tests/test_grade.py."""
CASES = (0, 1, 5)


def _expect(what, got, want):
    assert got == want, f"{what} = {got!r}, expected {want!r}"


def check_double(double):
    for x in CASES:
        _expect(f"double({x})", double(x), 2 * x)
    print("double: ok")


def check_square(square):
    import torch  # here, not above: the notebook imports this module, and its kernel need not import torch
    for x in CASES:
        assert torch.allclose(torch.tensor(float(square(x))), torch.tensor(float(x * x))), f"square({x})"
    print("square: ok")
'''

DOUBLE = 'def double(x):\n    """2 x."""\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n'
SQUARE = 'def square(x):\n    """x squared."""\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION\n'
SOLUTION_CELLS = [
    ("markdown", "# Assignment 99: a tiny course"),
    ("code", SETUP_CELL),   # as every notebook of the course has (generate would add it)
    ("code", f"from {CHECKS_MODULE} import check_double, check_square"),
    ("markdown", "## 1. Double"),
    ("code", DOUBLE),
    ("code", "check_double(double)"),
    ("markdown", "**Q1.** Why double?\n\n<!-- BEGIN SOLUTION -->\nTwice is nice.\n<!-- END SOLUTION -->"),
    ("markdown", "## 2. Square"),
    ("code", SQUARE),
    ("code", "check_square(square)"),
    ("markdown", "## 3. Questions\n\n**Q2.** What is 3 squared?\n\n<!-- BEGIN SOLUTION -->\n9\n<!-- END SOLUTION -->"
                 "\n\n**Q3.** And 4 squared?\n\n<!-- BEGIN SOLUTION -->\n16\n<!-- END SOLUTION -->\n"),
]


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A course root: the checks module, solutions/99_tiny.ipynb and the exercise the generator makes of it."""
    root = tmp_path_factory.mktemp("course")
    (root / f"{CHECKS_MODULE}.py").write_text(CHECKS_SOURCE)
    (root / "solutions").mkdir()
    cells = [nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text)
             for kind, text in SOLUTION_CELLS]
    nbformat.write(nbformat.v4.new_notebook(cells=cells), root / "solutions" / f"{TINY}.ipynb")
    exercises.generate(root)
    return root


def exercise(root):
    return nbformat.read(root / "exercises" / f"{TINY}.ipynb", as_version=4)


def solved(root):
    """The exercise with both functions written (the solution's cells) and no written answers."""
    nb = exercise(root)
    nb.cells[4].source, nb.cells[8].source = DOUBLE, SQUARE
    return nb


def insert(nb, index, source, kind="code"):
    nb.cells.insert(index, nbformat.v4.new_code_cell(source) if kind == "code" else
                    nbformat.v4.new_markdown_cell(source))


def cell_of(nb, source):
    """The cell number (from 1) of the cell with this source."""
    return next(i + 1 for i, cell in enumerate(nb.cells) if cell.source == source)


def write(nb, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return nb


# ---- a class: one folder, the CSVs ------------------------------------------------------------
@pytest.fixture(scope="module")
def graded_class(course, tmp_path_factory):
    """Five submissions, graded once: a solved one, an unsolved one and three that try to cheat."""
    folder = tmp_path_factory.mktemp("submissions")
    stub = exercises.MD_STUB
    alice = solved(course)  # also: added cells, answers in place and in new cells
    insert(alice, 1, "I add a note here.", "markdown")
    insert(alice, 2, "print('my own cell')")
    q1 = next(i for i, cell in enumerate(alice.cells) if "**Q1.**" in cell.source)
    insert(alice, q1 + 1, "Twice is nice.", "markdown")  # Q1's stub left in place, the answer below it
    questions = alice.cells[-1]
    questions.source = questions.source.replace(stub, "9, since 3 x 3 = 9.", 1).replace(stub, "")
    insert(alice, len(alice.cells), "Sixteen.", "markdown")
    bob = exercise(course)  # the exercise as handed out, in a flat file named after the assignment
    carol = exercise(course)  # deletes one check cell, edits the other into one that passes
    del carol.cells[5]
    carol.cells[8].source = "check_square(lambda x: x * x)"
    dave = exercise(course)  # rebinds the name in the notebook, then patches the module
    insert(dave, 5, "check_double = lambda f: None")
    insert(dave, 10, f"import {CHECKS_MODULE}\n{CHECKS_MODULE}.check_square = lambda f: None")
    erin = exercise(course)  # changes the check in place; a wrong square, and torch.allclose patched to hide it
    erin.cells[8].source = "def square(x):\n    return x + x"
    insert(erin, 5, "check_double.__code__ = (lambda double: None).__code__")
    insert(erin, 10, "import torch\ntorch.allclose = lambda *args, **kwargs: True")
    submissions = {"alice": write(alice, folder / "alice" / f"{TINY}.ipynb"),
                   "bob": write(bob, folder / f"bob_{TINY}.ipynb"),
                   "carol": write(carol, folder / "carol" / f"{TINY}.ipynb"),
                   "dave": write(dave, folder / "dave" / f"{TINY}.ipynb"),
                   "erin": write(erin, folder / "erin" / f"{TINY}.ipynb")}
    out = folder.parent / f"{folder.name}_grades" / "grades.csv"
    lines = []
    graded = dict(grade_folder(folder, out, root=course, cell_timeout=60, log=lines.append))
    return submissions, graded, out, lines


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_batch_csv_has_a_row_per_student_and_check(graded_class):
    submissions, _, out, lines = graded_class
    rows = read_csv(out)
    assert list(rows[0]) == ["student", "assignment", "check", "cell", "result", "seconds"]
    got = [(r["student"], r["assignment"], r["check"], r["cell"], r["result"]) for r in rows]
    alice, bob, carol, dave, erin = (submissions[s] for s in ("alice", "bob", "carol", "dave", "erin"))
    double, square = "check_double(double)", "check_square(square)"
    assert got == [
        ("alice", TINY, "check_double", str(cell_of(alice, double)), "passed"),
        ("alice", TINY, "check_square", str(cell_of(alice, square)), "passed"),
        ("bob", TINY, "check_double", str(cell_of(bob, double)), "not done"),
        ("bob", TINY, "check_square", str(cell_of(bob, square)), "not done"),
        ("carol", TINY, "check_double", "", "missing"),
        ("carol", TINY, "check_square", str(cell_of(carol, "check_square(lambda x: x * x)")), "edited"),
        ("dave", TINY, "check_double", str(cell_of(dave, double)), "not done"),
        ("dave", TINY, "check_square", str(cell_of(dave, square)), "not done"),
        ("erin", TINY, "check_double", str(cell_of(erin, double)), "not done"),
        ("erin", TINY, "check_square", str(cell_of(erin, square)), "wrong answer"),
    ]
    for r in rows:  # a check that ran has its time; a deleted or edited one never ran
        assert (r["seconds"] == "") == (r["result"] in ("missing", "edited")), r
        assert r["seconds"] == "" or 0 <= float(r["seconds"]) < 60
    assert lines == ["alice  score 2/2\nbob    score 0/2\ncarol  score 0/2\ndave   score 0/2\nerin   score 0/2"]


def test_deleted_or_edited_check_scores_zero(graded_class):
    """carol's edited cell would pass if it ran; the exercise's cell is what counts."""
    carol = graded_class[1]["carol"]
    assert carol.score == (0, 2)
    assert [(r.name, r.result, r.cell) for r in carol.checks] == \
           [("check_double", "missing", None), ("check_square", "edited", 9)]
    assert "exercise's cell 6" in carol.checks[0].detail


def test_what_a_notebook_does_to_its_kernel_does_not_reach_the_checks(graded_class):
    """Each of these would pass if the checks ran in the learner's kernel (the check does nothing, or torch.allclose
    no longer compares: erin's square is wrong); the checks run in their own processes, on the learner's functions."""
    dave, erin = graded_class[1]["dave"], graded_class[1]["erin"]
    assert dave.score == erin.score == (0, 2)
    assert [r.detail for r in dave.checks] == [f"NotImplementedError: {name}: write this part"   # the stubs, called
                                               for name in ("double", "square")]             # by the real checks
    assert erin.checks[1].detail == "AssertionError: square(1)"               # torch.allclose was the real one


def test_solved_notebook_passes_and_the_file_is_untouched(graded_class):
    submissions, graded, _, _ = graded_class
    assert graded["alice"].score == (2, 2) and graded["alice"].cell_errors == []
    on_disk = nbformat.read(graded["alice"].path, as_version=4)
    assert [c.source for c in on_disk.cells] == [c.source for c in submissions["alice"].cells]
    assert not any(c.get("outputs") for c in on_disk.cells)


def test_written_answers_are_exported(graded_class):
    rows = read_csv(graded_class[2].with_name("answers.csv"))
    assert list(rows[0]) == ["student", "assignment", "question", "cell", "status", "answer"]
    answers = {(r["student"], r["question"]): (r["status"], r["answer"]) for r in rows}
    assert answers[("alice", "Q1")] == ("answered", "Twice is nice.")  # a cell the learner added below the question
    assert answers[("alice", "Q2")] == ("answered", "9, since 3 x 3 = 9.")
    assert answers[("alice", "Q3")] == ("answered", "Sixteen.")  # the stub deleted, the answer in a new last cell
    for question in ("Q1", "Q2", "Q3"):
        assert answers[("bob", question)] == ("blank", "")
    assert len(rows) == 5 * 3
    assert "Twice is nice" not in json.dumps([r["answer"] for r in rows if r["student"] != "alice"])


# ---- one notebook ----------------------------------------------------------------------------
def test_timeout_stops_a_notebook_that_sleeps_forever(course, tmp_path):
    nb = solved(course)
    insert(nb, 8, "import os, time\nopen('kernel.pid', 'w').write(str(os.getpid()))\ntime.sleep(10 ** 6)")
    write(nb, tmp_path / f"{TINY}.ipynb")
    start = time.monotonic()
    graded = grade(tmp_path / f"{TINY}.ipynb", root=course, cell_timeout=300, notebook_timeout=5)
    assert time.monotonic() - start < 40
    assert [(r.name, r.result) for r in graded.checks] == [("check_double", "passed"), ("check_square", "timeout")]
    assert "ran past its 5 s" in graded.checks[1].detail
    pid = int((tmp_path / "kernel.pid").read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # the kernel is killed


def test_a_check_past_its_time_is_stopped_and_the_next_check_runs(course, tmp_path):
    nb = solved(course)
    nb.cells[4].source = "def double(x):\n    import time\n    time.sleep(10 ** 6)"   # the check calls it: it hangs
    write(nb, tmp_path / f"{TINY}.ipynb")
    start = time.monotonic()
    graded = grade(tmp_path / f"{TINY}.ipynb", root=course, cell_timeout=5)
    assert time.monotonic() - start < 60
    assert [(r.name, r.result) for r in graded.checks] == [("check_double", "timeout"), ("check_square", "passed")]
    assert graded.checks[0].detail == "the check ran past its 5 s and was stopped"


def test_errors_name_the_fix(course, tmp_path, capsys):
    """One line, exit status 2, no traceback."""
    (tmp_path / "empty").mkdir()
    notebook = tmp_path / "zed.ipynb"
    write(exercise(course), notebook)
    no_exercise = tmp_path / "no_exercise"
    (no_exercise / "exercises").mkdir(parents=True)
    (no_exercise / "solutions").mkdir()
    (no_exercise / "solutions" / f"{TINY}.ipynb").write_text((course / "solutions" / f"{TINY}.ipynb").read_text())
    grade_it = ["grade", str(notebook), "--root"]
    cases = [(["grade", str(tmp_path / "empty")], "no notebooks in"),
             ([*grade_it, str(course), "--assignment", "98_nope"], "unknown assignment '98_nope'"),
             ([*grade_it, str(course)], "pass --assignment NN_name"),
             ([*grade_it, str(no_exercise), "--assignment", TINY], f"exercises/{TINY}.ipynb is missing"),
             ([*grade_it, str(tmp_path / "empty"), "--assignment", TINY], "no exercises/ folder"),
             (["grade", str(tmp_path / "nope.ipynb")], "no such notebook or folder")]
    for argv, says in cases:
        assert main(argv) == 2, argv
        out = capsys.readouterr().out
        assert says in out and len(out.strip().splitlines()) == 1, out


# ---- a real exercise, through the command line ---------------------------------------------------
def test_grade_a_real_exercise(tmp_path):
    """00_collectives with chunk_to_send and all_gather_phase solved (2 of 6: the stretch and the hang are not done
    either), and the ring's check rebound in the kernel (which changes nothing: the check runs elsewhere)."""
    solution = nbformat.read(ROOT / "solutions" / "00_collectives.ipynb", as_version=4)
    learner = nbformat.read(ROOT / "exercises" / "00_collectives.ipynb", as_version=4)
    for i, cell in enumerate(solution.cells):
        if "def chunk_to_send" in cell.source or "def all_gather_phase" in cell.source:
            learner.cells[i].source = cell.source
    ring = next(i for i, cell in enumerate(learner.cells) if cell.source.startswith("def ring_all_reduce"))
    learner.cells[ring].source += "\n\ncheck_ring_all_reduce = lambda ring_all_reduce: None"
    path = tmp_path / "alice" / "00_collectives.ipynb"
    write(learner, path)
    done = subprocess.run([sys.executable, "-m", "picotron_course", "grade", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    rows = {line.split()[1]: line for line in out.splitlines() if line.split()[:1] and line.split()[0].isdigit()}
    assert "passed" in rows["check_chunk_to_send"] and "passed" in rows["check_all_gather_phase"]
    assert "not done (NotImplementedError)" in rows["check_reduce_scatter_phase"]
    assert "not done (NotImplementedError)" in rows["check_ring_all_reduce"]
    assert "not done (NotImplementedError)" in rows["check_recursive_doubling_all_reduce"]
    assert out.strip().endswith("score: 2/6") and "Traceback" not in out
    assert nbformat.read(path, as_version=4).cells[4].outputs == []  # the learner's file is untouched


@pytest.mark.parametrize("assignment", sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")))
def test_every_solution_scores_full_marks(assignment, tmp_path):
    """The grader, not only nbval, on each solution: every check's arguments must travel out of the kernel (a Triton
    kernel does not pickle: it goes as its function) and pass in a process of its own."""
    path = tmp_path / f"{assignment}.ipynb"
    write(nbformat.read(ROOT / "solutions" / f"{assignment}.ipynb", as_version=4), path)
    done = subprocess.run([sys.executable, "-m", "picotron_course", "grade", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    out = done.stdout
    score = out.strip().splitlines()[-1] if out.strip() else ""
    got, total = score.removeprefix("score: ").split("/") if score.startswith("score: ") else ("?", "?")
    assert done.returncode == 0 and got == total, out + done.stderr

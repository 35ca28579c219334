"""Grade learners' notebooks: run each in a fresh kernel and score the course's own check cells.

    python -m picotron_course grade exercises/00_collectives.ipynb   # one notebook: a table; exit 1 unless all pass
    python -m picotron_course grade submissions/ --out grades.csv   # a class: grades.csv and answers.csv

What a submission is scored on comes from the course, not from the submission. A notebook of
assignment NN_name (its file name says which, or --assignment) is scored on the check cells of
exercises/NN_name.ipynb: their order, the `check_*` each calls and their source. A check cell
the learner deleted scores 0 ("missing"), one whose source differs beyond blank lines and
trailing spaces scores 0 ("edited"); the others run with the exercise's own source.

Every cell runs, in order, even after one fails (a learner who solved exercises 1 and 3 gets
both), with the notebook's folder as working directory; the learner's file is not modified.
A check passes when its cell raises nothing: the check raises AssertionError (or a subclass)
on a wrong answer, the learner's stub NotImplementedError on an unsolved one. A notebook that
runs past --timeout-per-notebook (or a cell past --cell-timeout) is stopped, its kernel killed,
and its remaining checks are "timeout". A folder of submissions also gives answers.csv: the text
each learner wrote where the exercise says "*Write your answer here.*", found by the question
before it, so cells a learner added or moved do not shift it.

Checks run outside the learner's process. The grader runs the notebook in a fresh kernel with
each check cell replaced by one of its own that evaluates the call's arguments there (the learner's
functions and classes, e.g. `ring_all_reduce` in `check_ring_all_reduce(ring_all_reduce)`) and sends
them out with cloudpickle, by value, as `picotron.launch.run` sends a function to its ranks. After
the notebook, the checks run in a fresh Python the notebook never touched, one after another: it
imports each check from the course's files and calls it on what was sent, under --cell-timeout (past
it, the process is killed with its process group, and the next check gets a new one). So
nothing the notebook does to its own process reaches a check: rebinding `check_x`, patching the
check's module, or patching what checks use (`torch.allclose = lambda *a, **k: True`) changes
only the kernel. A notebook that writes to the course's files is caught after it ran (grading
stops, naming the notebook), before it can change the next learner's grade.

What this does not catch: a learner's function is still the learner's code, and runs inside the
checks' process when a check calls it, so a function written to tamper with its caller (or with the
notebook's next checks, which run in the same process) can; a
function copied from someone else passes as it would for them. Read the code of a surprising pass,
and grade a class in a throwaway copy of the course (a container), as a notebook can write
anything the grader's user can.
"""

from __future__ import annotations

import ast
import copy
import csv
import importlib
import importlib.util
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from picotron_course.exercises import EXERCISES, MD_STUB, SOLUTIONS, check_name, is_check_cell

__all__ = ["GradeError", "CourseChanged", "Check", "Question", "Assignment", "CheckResult", "Answer", "Graded",
           "RESULTS", "course_root", "assignment_of", "load_assignment", "check_timeouts", "grade", "grade_notebook",
           "grade_folder", "find_submissions", "class_summary", "score_table"]

RESULTS = ("passed", "wrong answer", "not done", "error", "missing", "edited", "timeout")
_SHOWN = {"missing": "missing (check cell deleted)", "edited": "edited (check cell changed)",
          "not done": "not done (NotImplementedError)"}
_QUESTION_LABEL = re.compile(r"\*\*(Q\d+[a-z]?)\.?\*\*")


class GradeError(Exception):
    """Grading cannot start: the message names what is wrong and what to do."""


class CourseChanged(GradeError):
    """A notebook wrote to the course's files: every grade after it would be in doubt."""


# ---- the course: what an assignment expects ------------------------------------------------
@dataclass
class Check:
    """A check cell of the exercise: every submission of the assignment is scored on it."""
    index: int    # its cell number in the exercise, from 1
    name: str     # the check it calls, e.g. check_ring_all_reduce
    source: str   # the cell's source, run as is in place of the learner's copy
    module: str   # the module the exercise imports the check from


@dataclass
class Question:
    """A written answer the exercise asks for: where it sits, told by the text around it."""
    label: str    # "Q1", or the section heading when the question has no **Qn.** label
    before: str   # the question: the paragraph just before "*Write your answer here.*"
    after: str    # the first line after it ("" at the end of the notebook): where the answer stops


@dataclass
class Assignment:
    name: str
    checks: list[Check]
    questions: list[Question]
    files: list[str]        # the course's source files, which no notebook may change
    import_dirs: list[str]  # put first on the kernel's and the checks' PYTHONPATH


def course_root() -> Path:
    """The checkout this package comes from (its exercises/ are the default reference)."""
    return Path(__file__).resolve().parents[1]


def assignment_of(notebook: str | Path, root: str | Path, assignment: str | None = None) -> str:
    """The assignment a notebook is (by --assignment, else its file name), checked to exist under root."""
    root, notebook = Path(root), Path(notebook)
    folder = root / EXERCISES
    if not folder.is_dir():
        raise GradeError(f"no {EXERCISES}/ folder under {root.resolve()}; pass --root with the course checkout "
                         f"that holds {EXERCISES}/NN_name.ipynb")
    names = sorted(path.stem for path in folder.glob("*.ipynb"))
    known = sorted(set(names) | {path.stem for path in (root / SOLUTIONS).glob("*.ipynb")})
    if assignment:
        wanted = Path(assignment).stem
    else:
        matches = sorted((name for name in known if name in notebook.stem), key=len)
        if not matches:
            raise GradeError(f"cannot tell which assignment {notebook} is: its name contains none of "
                             f"{', '.join(known)}; pass --assignment NN_name")
        wanted = matches[-1]
    if wanted not in names:
        if wanted in known:
            raise GradeError(f"{EXERCISES}/{wanted}.ipynb is missing under {root.resolve()}; write it with "
                             f"`python -m picotron_course generate {wanted}` there")
        raise GradeError(f"unknown assignment {wanted!r}; the assignments are {', '.join(names)}")
    return wanted


def load_assignment(root: str | Path, name: str) -> Assignment:
    """Read exercises/<name>.ipynb: its check cells (each one call of a check) and its questions."""
    path = Path(root) / EXERCISES / f"{name}.ipynb"
    if not path.is_file():
        raise GradeError(f"no {path}; write it with `python -m picotron_course generate {name}` or pass --root")
    cells = nbformat.read(path, as_version=4).cells
    imported = _imported_checks(cells)
    checks = []
    for i, cell in enumerate(cells):
        if is_check_cell(cell):
            check = check_name(cell.source)
            if check not in imported:
                raise GradeError(f"{path}, cell {i + 1} calls {check} but no cell has `from MODULE import {check}`; "
                                 "add that import so the grader knows which check is the course's")
            if _call_of(cell.source, check) is None:
                raise GradeError(f"{path}, cell {i + 1}: a check cell is one call, `{check}(...)`, and nothing else "
                                 "(the grader sends the call's arguments to the check's own process)")
            checks.append(Check(i + 1, check, cell.source, imported[check]))
    files, dirs = set(), []
    for module_name in sorted({check.module for check in checks}):
        module = _import_course_module(module_name, Path(root), path)
        _missing_requirements(name, module)
        top = sys.modules[module_name.split(".")[0]]
        folder = Path(top.__file__).resolve().parent
        packages = [folder] if hasattr(top, "__path__") else []
        if module_name.split(".")[0] != "picotron" and "picotron" in sys.modules:
            packages.append(Path(sys.modules["picotron"].__file__).resolve().parent)  # what the checks run on
        files |= {str(Path(module.__file__).resolve())} | {str(f) for p in packages for f in p.rglob("*.py")}
        dirs.append(str(folder.parent if hasattr(top, "__path__") else folder))
    return Assignment(name, checks, _questions(cells), sorted(files), list(dict.fromkeys(dirs)))


def _call_of(source: str, check: str) -> ast.Call | None:
    """The call `check(...)` when it is all the cell does."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    if len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Call) \
            and isinstance(body[0].value.func, ast.Name) and body[0].value.func.id == check:
        return body[0].value
    return None


def _imported_checks(cells) -> dict[str, str]:
    """check name -> module, from the `from MODULE import check_x` statements of the exercise's code cells."""
    found = {}
    for cell in cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    if alias.name.startswith("check_") and (alias.asname or alias.name) == alias.name:
                        found[alias.name] = node.module
    return found


def _import_course_module(name: str, root: Path, exercise: Path):
    """Import a check module in the grader's process, the course root first on the path (a checkout
    that is not installed): it must import, and the packages it runs on must be there."""
    sys.path.insert(0, str(root.resolve()))
    try:
        return importlib.import_module(name)
    except Exception as e:
        raise GradeError(f"cannot import {name}, where {exercise} takes its checks from ({type(e).__name__}: {e}); "
                         "install the course (pip install -e .) or pass --root") from None
    finally:
        sys.path.remove(str(root.resolve()))


def _missing_requirements(assignment: str, module) -> None:
    """Refuse to grade where a package the checks run on is missing (a check module's REQUIRES): every check
    of the assignment would fail on the grader's machine, not on the learners' answers."""
    for package in getattr(module, "REQUIRES", ()):
        try:
            found = importlib.util.find_spec(package) is not None
        except ImportError:
            found = False
        if not found:
            raise GradeError(f"assignment {assignment} runs on {package}, which is not installed here "
                             f"({module.__name__}.REQUIRES: {getattr(module, 'REQUIRES_WHY', '')}); grade it where "
                             f"{package} is")


# ---- a check, outside the learner's process ------------------------------------------------------
def _export_cell(check: Check, path: Path):
    """The grader's cell in place of a check cell: evaluate the call's arguments in the learner's kernel and write
    them to `path` by value (picotron.pickling, as `run` sends a function to its ranks: the notebook's functions
    and classes, and the values they use); the check itself runs later, in a process of its own (`_CheckProcess`)."""
    call = _call_of(check.source, check.name)
    args = "".join(ast.unparse(a) + ", " for a in call.args)
    kwargs = ", ".join(f"{k.arg!r}: {ast.unparse(k.value)}" for k in call.keywords)
    source = (f"# picotron grader: what {check.name} gets, sent to its own process (not a cell of the learner's)\n"
              "from picotron.pickling import write as __picotron_write__\n"
              f"__picotron_write__({str(path)!r}, (({args}), {{{kwargs}}}))\n"
              "del __picotron_write__\n")
    return nbformat.v4.new_code_cell(source, metadata={"picotron_grader": check.name})


class _CheckProcess:
    """A fresh Python that runs a notebook's checks one after another, on what its kernel sent (`_check_loop`): a
    process the notebook never touched, which imports torch and the checks once per notebook, not once per check.
    A check past its time is stopped with the process (and its process group: the check's ranks); the next
    check gets a new one."""

    def __init__(self, folder: Path, import_dirs: list[str]):
        self.folder, self.import_dirs, self.process = folder, import_dirs, None

    def run(self, check: Check, sent: Path, timeout: float) -> tuple:
        """(result, detail, seconds) of `check` on the arguments in `sent`."""
        if self.process is None:
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(
                self.import_dirs + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
            self.log = tempfile.TemporaryFile()
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from picotron_course.grade import _check_loop; _check_loop()"],
                cwd=self.folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                start_new_session=True, text=True)
        verdict = sent.with_suffix(".verdict")
        started = time.monotonic()
        self.process.stdin.write(f"{check.module}\t{check.name}\t{sent}\t{verdict}\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        answer = self.process.stdout.readline() if ready else None
        seconds = time.monotonic() - started
        if answer is None:
            self.close()
            return "timeout", f"the check ran past its {timeout:g} s and was stopped", seconds
        if not answer or not verdict.exists():
            self.log.seek(0)
            said = self.log.read().decode(errors="replace").strip().splitlines()
            code = self.process.poll()
            self.close()
            return "error", f"the check's process exited (code {code}): {said[-1] if said else ''}"[:160], seconds
        result, detail = verdict.read_text().split("\n", 1)
        return result, detail, seconds

    def close(self) -> None:
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # with the checks' ranks and rank servers
            except ProcessLookupError:
                pass
            self.process.wait()
            self.log.close()
            self.process = None


def _check_loop() -> None:
    """The check process: for each line "module, check, sent, verdict" on stdin, run the check, write its verdict
    and say "done" on stdout (the grader's channel: what the checks print goes to stderr)."""
    answers, sys.stdout = sys.stdout, sys.stderr
    for line in sys.stdin:
        _check_process(*line.rstrip("\n").split("\t"))
        answers.write("done\n")
        answers.flush()


def _check_process(module: str, name: str, sent: str, verdict: str) -> None:
    """A check's own process: import the check from the course's files, then load what the learner sent (after
    the check's module: it may set the process up, e.g. Triton's interpreter), call the check, write the verdict."""
    import importlib

    from picotron import pickling
    try:
        check = getattr(importlib.import_module(module), name)
        args, kwargs = pickling.read(sent)
    except Exception as e:  # noqa: BLE001 - the learner's arguments could not be rebuilt here
        result, detail = "error", f"the grader could not load what the notebook sent: {type(e).__name__}: {e}"
    else:
        try:
            check(*args, **kwargs)
            result, detail = "passed", ""
        except NotImplementedError as e:
            result, detail = "not done", f"NotImplementedError: {e}"
        except AssertionError as e:  # the checks raise AssertionError (or a subclass) on a wrong answer
            result, detail = "wrong answer", f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            result, detail = "error", f"{type(e).__name__}: {e}"
    first = detail.strip().split("\n")[0][:160]
    with open(verdict, "w") as f:
        f.write(f"{result}\n{first}")


# ---- a submission: match its cells to the exercise's, run it, read the results ----------------------
@dataclass
class CheckResult:
    name: str
    cell: int | None      # the check's cell number in the submission, from 1; None when deleted
    result: str           # one of RESULTS
    detail: str = ""      # why, when it did not pass
    seconds: float | None = None

    @property
    def passed(self) -> bool:
        return self.result == "passed"


@dataclass
class Answer:
    question: str
    cell: int | None  # where the question is in the submission, from 1
    status: str       # answered, blank, question not found
    text: str


@dataclass
class Graded:
    path: Path
    assignment: str
    checks: list[CheckResult]
    answers: list[Answer] = field(default_factory=list)
    cell_errors: list[tuple[int, str]] = field(default_factory=list)  # learner cells (not checks) that failed

    @property
    def score(self) -> tuple[int, int]:
        return sum(r.passed for r in self.checks), len(self.checks)


def check_timeouts(cell_timeout: float, notebook_timeout: float | None) -> None:
    """Raise GradeError unless each limit is a positive number of seconds (notebook_timeout may be None: no
    limit). A limit of 0 or less would stop every notebook at its first cell and score every check "timeout"."""
    for name, flag, value in (("cell_timeout", "--cell-timeout", cell_timeout),
                              ("notebook_timeout", "--timeout-per-notebook", notebook_timeout)):
        if value is None and name == "notebook_timeout":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise GradeError(f"{name}={value!r} ({flag}) must be a positive number of seconds, e.g. 300"
                             + (", or None for no limit" if name == "notebook_timeout" else ""))


def grade(path: str | Path, assignment: str | None = None, root: str | Path | None = None, cell_timeout: float = 300,
          notebook_timeout: float | None = None, kernel_name: str = "python3") -> Graded:
    """Grade one notebook against the course at `root` (default: this checkout)."""
    check_timeouts(cell_timeout, notebook_timeout)
    root = Path(root) if root else course_root()
    expected = load_assignment(root, assignment_of(path, root, assignment))
    return grade_notebook(path, expected, cell_timeout, notebook_timeout, kernel_name)


def grade_notebook(path: str | Path, assignment: Assignment, cell_timeout: float = 300,
                   notebook_timeout: float | None = None, kernel_name: str = "python3") -> Graded:
    """Run `path` with each check cell it kept replaced by the grader's (which sends the check's arguments out),
    then run the checks in a process of their own, and score them."""
    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:
        raise GradeError(f"cannot read {path} as a notebook ({type(e).__name__}: {str(e)[:100]}); "
                         "is it the .ipynb file?") from None
    cells = nb.cells
    found, static = _match_checks(cells, assignment.checks)
    outbox = Path(tempfile.mkdtemp(prefix="picotron-grade-"))
    checks = _CheckProcess(path.parent, assignment.import_dirs)
    try:
        run_cells, origin, where = [], [], {}  # where: check index -> its cell's position in run_cells
        at_cell = {cell: k for k, cell in found.items()}
        for i, cell in enumerate(cells):
            if cell.cell_type != "code":
                continue
            if i in at_cell:
                where[at_cell[i]] = len(run_cells)
                run_cells.append(_export_cell(assignment.checks[at_cell[i]], outbox / f"check-{at_cell[i]}.sent"))
            else:
                run_cells.append(copy.deepcopy(cell))
            origin.append(i)
        run_nb = nbformat.v4.new_notebook(cells=run_cells, metadata=copy.deepcopy(nb.metadata))
        on_disk = _file_stamps(assignment.files)
        replies, stopped = _execute(run_nb, path.parent, cell_timeout, notebook_timeout, kernel_name,
                                    assignment.import_dirs)
        changed = [file for file, stamp in _file_stamps(assignment.files).items() if stamp != on_disk[file]]
        if changed:
            raise CourseChanged(f"{path} changed the course's files while it ran ({', '.join(changed)}); restore "
                                f"them (e.g. `git checkout -- {changed[0]}`) and grade the others again")
        results = []
        for k, check in enumerate(assignment.checks):
            if k in static:
                results.append(CheckResult(check.name, static[k][0], static[k][1], static[k][2]))
                continue
            cell, reply = found[k] + 1, replies.get(where[k])
            if reply is None:
                kind, why = stopped or ("error", "the check did not run")
                results.append(CheckResult(check.name, cell, "timeout" if kind == "timeout" else "error", why))
            elif reply.get("status") != "ok":  # its arguments could not be evaluated or sent (a stub, a typo)
                result = "not done" if reply.get("ename") == "NotImplementedError" else "error"
                results.append(CheckResult(check.name, cell, result, _error_text(reply)))
            else:
                result, detail, seconds = checks.run(check, outbox / f"check-{k}.sent", cell_timeout)
                results.append(CheckResult(check.name, cell, result, detail, seconds))
    finally:
        checks.close()
        shutil.rmtree(outbox, ignore_errors=True)
    errors = [(origin[j] + 1, _error_text(replies[j])) for j in range(len(run_cells))
              if origin[j] not in at_cell and replies.get(j, {}).get("status") == "error"]
    return Graded(path, assignment.name, results, _answers(cells, assignment.questions), errors)


def _normalised(source: str) -> str:
    """Blank lines and trailing spaces do not count; indentation does (it is Python)."""
    return "\n".join(line.rstrip() for line in source.strip().splitlines() if line.strip())


def _match_checks(cells, checks: list[Check]) -> tuple[dict[int, int], dict[int, tuple]]:
    """For each expected check: the submission cell that is it (same source), else why it scores 0.

    The search for a check starts after the previous check's cell (then wraps around), so checks with
    the same source each find their own cell, in order. A cell that calls the check but differs from
    the exercise's is "edited"; with none, the check is "missing".
    """
    found, static, used, after = {}, {}, set(), 0
    code = [i for i, cell in enumerate(cells) if cell.cell_type == "code"]
    for k, check in enumerate(checks):
        want = _normalised(check.source)
        order = [i for i in code if i >= after] + [i for i in code if i < after]
        same = next((i for i in order if i not in used and _normalised(cells[i].source) == want), None)
        if same is not None:
            found[k], after = same, same + 1
            used.add(same)
            continue
        edited = next((i for i in order if i not in used and check_name(cells[i].source) == check.name), None)
        if edited is not None:
            used.add(edited)
            static[k] = (edited + 1, "edited", f"cell {edited + 1} is not the exercise's cell {check.index}")
        else:
            static[k] = (None, "missing", f"no cell runs the exercise's cell {check.index}")
    return found, static


def _execute(nb, folder: Path, cell_timeout: float, notebook_timeout: float | None, kernel_name: str,
             import_dirs: list[str]) -> tuple[dict[int, dict], tuple[str, str] | None]:
    """Run every cell; return each cell's execute_reply content and why the run stopped early, if it did.

    The notebook's clock starts at its first cell (a kernel slow to start on a busy machine is not
    the learner's time). A cell past its limit, or the notebook past its own, stops the run and the
    kernel is killed with its process group.
    """
    replies, started = {}, []

    def timeout_of(cell) -> float:
        if not started:
            started.append(time.monotonic())
        if notebook_timeout is None:
            return cell_timeout
        left = started[0] + notebook_timeout - time.monotonic()
        return max(0.01, min(cell_timeout, left))  # 0 would mean "no limit" to nbclient

    def executed(cell, cell_index, execute_reply) -> None:
        replies[cell_index] = execute_reply["content"]

    client = NotebookClient(nb, timeout_func=timeout_of, allow_errors=True, kernel_name=kernel_name,
                            shutdown_kernel="immediate", on_cell_executed=executed,
                            resources={"metadata": {"path": str(folder.resolve())}})
    env = dict(os.environ)  # the kernel imports the course from the files the checks run from
    env["PYTHONPATH"] = os.pathsep.join(import_dirs + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        client.execute(env=env)
    except CellTimeoutError:
        spent = time.monotonic() - started[0] if started else 0.0
        if notebook_timeout is not None and spent >= notebook_timeout - 0.1:
            return replies, ("timeout", f"the notebook ran past its {notebook_timeout:g} s and was stopped")
        return replies, ("timeout", f"a cell ran past its {cell_timeout:g} s and the notebook was stopped")
    except DeadKernelError as e:  # e.g. a learner's os._exit: the cells after it never ran
        return replies, ("died", f"the kernel died ({e})".split("\n")[0])
    except Exception as e:
        if type(e).__name__ == "NoSuchKernel":
            raise GradeError(f"no Jupyter kernel named {kernel_name!r}; install one with `pip install ipykernel`")
        raise
    return replies, None


def _file_stamps(files: list[str]) -> dict[str, tuple]:
    stamps = {}
    for file in files:
        try:
            stamps[file] = (Path(file).read_bytes(),)
        except OSError:
            stamps[file] = ("missing",)
    return stamps


def _error_text(reply: dict) -> str:
    first = (reply.get("evalue") or "").strip().split("\n")[0]
    return f"{reply.get('ename', 'error')}: {first}"[:160]


# ---- written answers ---------------------------------------------------------------------
def _questions(cells) -> list[Question]:
    """Each "*Write your answer here.*" of the exercise, told by the question before it and the line after."""
    questions, heading, seen = [], "", set()
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        pieces = cell.source.split(MD_STUB)
        for k in range(len(pieces) - 1):
            heading = _last_heading(pieces[k]) or heading
            before = _paragraphs(pieces[k])[-1:] or _paragraphs(_previous_text(cells, i))[-1:]
            following = pieces[k + 1] if pieces[k + 1].strip() else _next_text(cells, i)
            labels = _QUESTION_LABEL.findall(pieces[k])
            label = labels[-1] if labels else heading.lstrip("# ") or f"answer {len(questions) + 1}"
            if label in seen:
                label = f"{label} ({len(questions) + 1})"
            seen.add(label)
            lines = [line.strip() for line in following.splitlines() if line.strip()]
            questions.append(Question(label, before[0] if before else "", lines[0] if lines else ""))
        heading = _last_heading(pieces[-1]) or heading
    return questions


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def _last_heading(text: str) -> str:
    headings = [line.strip() for line in text.splitlines() if line.startswith("#")]
    return headings[-1] if headings else ""


def _previous_text(cells, i: int) -> str:
    return next((c.source for c in reversed(cells[:i]) if c.cell_type == "markdown" and c.source.strip()), "")


def _next_text(cells, i: int) -> str:
    return next((c.source for c in cells[i + 1:] if c.source.strip()), "")


def _loose(text: str) -> re.Pattern:
    """`text` with any run of whitespace matching any other: a learner's editor may rewrap lines."""
    return re.compile(r"\s+".join(re.escape(word) for word in text.split()))


def _find(text: str, cells, start: tuple[int, int], markdown_only: bool) -> tuple[int, int, int] | None:
    """(cell, start, end) of the first match of `text` at or after position `start` (cell, offset)."""
    if not text.strip():
        return None
    pattern = _loose(text)
    for i in range(start[0], len(cells)):
        if markdown_only and cells[i].cell_type != "markdown":
            continue
        match = pattern.search(cells[i].source, start[1] if i == start[0] else 0)
        if match:
            return i, match.start(), match.end()
    return None


def _answers(cells, questions: list[Question]) -> list[Answer]:
    """The learner's text under each question, up to the exercise's next line: in the question's cell or in
    markdown cells the learner added after it (code cells in between are not part of a written answer)."""
    answers, position = [], (0, 0)
    for question in questions:
        asked = _find(question.before, cells, position, markdown_only=True)
        if asked is None:
            answers.append(Answer(question.label, None, "question not found", ""))
            continue
        cell, _, end = asked
        position = (cell, end)
        stop = _find(question.after, cells, position, markdown_only=False) if question.after else None
        if stop is None:  # the end of the notebook, or (the next line edited away) of the question's cell
            stop = (len(cells), 0, 0) if not question.after else (cell, len(cells[cell].source), 0)
        parts = []
        for i in range(cell, min(stop[0], len(cells) - 1) + 1):
            if cells[i].cell_type == "markdown":
                text = cells[i].source
                parts.append(text[end if i == cell else 0: stop[1] if i == stop[0] else len(text)])
        text = "\n\n".join(part.strip() for part in parts if part.strip()).replace(MD_STUB, "").strip()
        answers.append(Answer(question.label, cell + 1, "answered" if text else "blank", text))
    return answers


# ---- a class: a folder of submissions --------------------------------------------------------
def find_submissions(folder: str | Path) -> list[tuple[str | None, Path]]:
    """(student, notebook) for FOLDER/<student>/*.ipynb, and (None, notebook) for FOLDER/*.ipynb, whose
    student is the file's name once its assignment is known."""
    folder = Path(folder)
    found = [(None, path) for path in sorted(folder.glob("*.ipynb"))]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found += [(sub.name, path) for path in sorted(sub.glob("*.ipynb"))]
    if not found:
        raise GradeError(f"no notebooks in {folder}; put submissions there as {folder}/<student>.ipynb or "
                         f"{folder}/<student>/<NN_name>.ipynb")
    return found


def _student(path: Path, assignment: str) -> str:
    """alice_00_collectives.ipynb -> alice; a file named only after the assignment keeps its name."""
    rest = path.stem.replace(assignment, "").strip(" _-.")
    return rest or path.stem


def grade_folder(folder: str | Path, out: str | Path, assignment: str | None = None, root: str | Path | None = None,
                 cell_timeout: float = 300, notebook_timeout: float | None = None, kernel_name: str = "python3",
                 log=print) -> list[tuple[str, Graded | None]]:
    """Grade every notebook of a class; write `out` (one row per student, notebook and check) and answers.csv
    beside it (one row per student and written question). Returns (student, graded) in order.

    Written answers go to a CSV, like the grades: one row per answer, so a spreadsheet sorts them by
    question and a teacher marks all the answers to Q1 together, in a column added beside them.
    """
    check_timeouts(cell_timeout, notebook_timeout)   # a typo must not score a whole class "timeout"
    root = Path(root) if root else course_root()
    submissions = []
    for student, path in find_submissions(folder):  # every name checked before the first kernel starts
        name = assignment_of(path, root, assignment)
        submissions.append((student or _student(path, name), name, path))
    submissions.sort()
    assignments = {name: load_assignment(root, name) for name in sorted({name for _, name, _ in submissions})}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    graded = []
    with open(out, "w", newline="", encoding="utf-8") as grades_file, \
         open(out.with_name("answers.csv"), "w", newline="", encoding="utf-8") as answers_file:
        grades, answers = csv.writer(grades_file), csv.writer(answers_file)
        grades.writerow(["student", "assignment", "check", "cell", "result", "seconds"])
        answers.writerow(["student", "assignment", "question", "cell", "status", "answer"])
        for n, (student, name, path) in enumerate(submissions):
            print(f"[{n + 1}/{len(submissions)}] {student}: {path}", file=sys.stderr, flush=True)
            try:
                result = grade_notebook(path, assignments[name], cell_timeout, notebook_timeout, kernel_name)
            except CourseChanged:
                raise
            except GradeError as e:  # an unreadable file: its checks are errors, the class goes on
                print(f"  {e}", file=sys.stderr)
                result = Graded(path, name, [CheckResult(c.name, None, "error", str(e))
                                             for c in assignments[name].checks])
            graded.append((student, result))
            for r in result.checks:
                grades.writerow([student, name, r.name, r.cell or "", r.result,
                                 "" if r.seconds is None else f"{r.seconds:.1f}"])
            for a in result.answers:
                answers.writerow([student, name, a.question, a.cell or "", a.status, a.text])
            grades_file.flush()
            answers_file.flush()
    log(class_summary(graded))
    return graded


def class_summary(graded: list[tuple[str, Graded]]) -> str:
    """One line per student: their score over all their notebooks, and per assignment when there are several."""
    by_student: dict[str, list[Graded]] = {}
    for student, result in graded:
        by_student.setdefault(student, []).append(result)
    width = max(len(student) for student in by_student)
    lines = []
    for student, results in by_student.items():
        passed, total = (sum(r.score[i] for r in results) for i in (0, 1))
        line = f"{student.ljust(width)}  score {passed}/{total}"
        if len(results) > 1:
            line += "  (" + ", ".join(f"{r.assignment} {r.score[0]}/{r.score[1]}" for r in results) + ")"
        lines.append(line)
    return "\n".join(lines)


def score_table(graded: Graded, title: str = "") -> str:
    """The table a teacher reads: one row per check of the assignment, then the score."""
    rows = [("cell", "check", "result", "time")]
    rows += [("-" if r.cell is None else str(r.cell), r.name, _SHOWN.get(r.result, r.result),
              "" if r.seconds is None else f"{r.seconds:.1f} s") for r in graded.checks]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [title] if title else []
    lines += ["  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip() for row in rows]
    for r in graded.checks:
        if not r.passed and r.detail:
            lines.append(f"  {r.name}: {r.detail}")
    for cell, error in graded.cell_errors:  # a definition that does not run breaks the checks after it
        lines.append(f"  cell {cell} (not a check) failed: {error}")
    passed, total = graded.score
    lines.append(f"score: {passed}/{total}")
    return "\n".join(lines)

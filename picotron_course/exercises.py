"""Exercises are generated from solutions: one source, answers between markers.

In a code cell of `solutions/NN_name.ipynb`, the answer sits inside a function body between

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

and `exercises/NN_name.ipynb` gets, at the same indentation, a stub that fails until the
learner writes the code:

    raise NotImplementedError("ring_all_reduce: write this part")

The signature and the docstring stay. Markers anywhere else (at module level, in a class
body, unbalanced, or nested) are an error: an exercise must still define every function its
check cell calls. In a markdown cell, text between `<!-- BEGIN SOLUTION -->` and
`<!-- END SOLUTION -->` (an answer to a question) becomes "*Write your answer here.*".

`generate` also makes the set-up cell (picotron_course/setup_cell.py, which installs the course
where it is missing, as on Colab) the first code cell of every chapter and solution, so of every
exercise too.

Notebooks are written without outputs or execution counts (`strip_outputs` does the same for
any notebook), so the diffs of a pull request show only what an author changed.
"""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import nbformat

from picotron_course.setup_cell import with_setup_cell

__all__ = ["MarkerError", "stub_code", "stub_markdown", "make_exercise", "generate", "stale", "clean",
           "strip_outputs", "is_check_cell", "check_name", "SOLUTIONS", "EXERCISES"]

SOLUTIONS, EXERCISES = "solutions", "exercises"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
MD_BEGIN, MD_END = "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"
MD_STUB = "*Write your answer here.*"
# A line that looks like a marker (any number of #, any case), to catch "## Begin solution" typos.
_MARKER_LINE = re.compile(r"^(\s*)#+\s*(BEGIN|END)\s+SOLUTION\b.*$", re.IGNORECASE)
_MARKER_CALL = "__picotron_solution_marker__"
_CHECK_CALL = re.compile(r"^[^#\n]*?\bcheck_(\w+)\s*\(", re.MULTILINE)
# Cell metadata that only records a session (nbstripout's list); tags and the like stay.
_SESSION_CELL_KEYS = ("collapsed", "scrolled", "execution", "ExecuteTime", "heading_collapsed", "hidden")


class MarkerError(ValueError):
    """A solution marker that the generator cannot turn into an exercise."""


# ---- one cell ----------------------------------------------------------------------------
def stub_code(source: str, where: str = "cell") -> str:
    """Replace each BEGIN/END SOLUTION block of a code cell by a NotImplementedError stub."""
    lines = source.split("\n")
    markers = _find_markers(lines, where)
    if not markers:
        return source
    functions = _functions_around(lines, markers, where)
    out, start = [], 0
    for (begin, indent), (end, _), function in zip(markers[::2], markers[1::2], functions):
        out += lines[start:begin]
        out.append(f'{indent}raise NotImplementedError("{function}: write this part")')
        start = end + 1
    out += lines[start:]
    stubbed = "\n".join(out)
    try:
        ast.parse(stubbed)
    except SyntaxError as e:  # e.g. the block held the only statement of an `if`
        raise MarkerError(f"{where}: the exercise would not parse ({e.msg}, line {e.lineno}); "
                          "put the markers around whole statements of the function body") from None
    return stubbed


def _find_markers(lines: list[str], where: str) -> list[tuple[int, str]]:
    """(line index, indentation) of each marker, checked to alternate BEGIN, END, BEGIN, ..."""
    markers, expect = [], "BEGIN"
    for i, line in enumerate(lines):
        match = _MARKER_LINE.match(line)
        if not match:
            continue
        kind = match.group(2).upper()
        if line.strip() != (BEGIN if kind == "BEGIN" else END):
            raise MarkerError(f"{where}, line {i + 1}: write the marker exactly as "
                              f"'{BEGIN if kind == 'BEGIN' else END}', not {line.strip()!r}")
        if kind != expect:
            problem = "a BEGIN inside another BEGIN ... END block" if kind == "BEGIN" else "an END without its BEGIN"
            raise MarkerError(f"{where}, line {i + 1}: unbalanced solution markers: {problem}")
        markers.append((i, match.group(1)))
        expect = "END" if kind == "BEGIN" else "BEGIN"
    if expect == "END":
        raise MarkerError(f"{where}, line {markers[-1][0] + 1}: unbalanced solution markers: "
                          f"'{BEGIN}' has no '{END}'")
    return markers


def _functions_around(lines: list[str], markers: list, where: str) -> list[str]:
    """The function holding each BEGIN/END pair, which must be two statements of one block of its body.

    Turning the marker comments into calls lets Python's own parser say where they sit.
    """
    probe = list(lines)
    for i, indent in markers:
        probe[i] = f"{indent}{_MARKER_CALL}()"
    try:
        tree = ast.parse("\n".join(probe))
    except SyntaxError as e:
        raise MarkerError(f"{where}, line {e.lineno}: a solution marker is not indented like the code "
                          f"around it ({e.msg})") from None
    owner = _marker_places(tree)  # marker line -> (id of its statement list, enclosing function)
    functions = []
    for (begin, _), (end, _) in zip(markers[::2], markers[1::2]):
        body_begin, function = owner[begin]
        body_end, _ = owner[end]
        if function is None:
            raise MarkerError(f"{where}, line {begin + 1}: solution markers must be inside a function body "
                              "(the exercise keeps the signature and docstring and raises NotImplementedError); "
                              "these are at module level or in a class body")
        if body_begin != body_end:
            raise MarkerError(f"{where}, lines {begin + 1}-{end + 1}: '{BEGIN}' and '{END}' must be at the same "
                              "indentation in one block of the function body")
        functions.append(function)
    return functions


def _marker_places(tree: ast.AST) -> dict[int, tuple[int, str | None]]:
    """For each marker statement: which statement list holds it, and the function around it."""
    places = {}

    def visit(node: ast.AST, function: str | None) -> None:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list):
                for statement in block:
                    if _is_marker(statement):
                        places[statement.lineno - 1] = (id(block), function)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
            else:  # a class body is not a function body, even inside a function
                visit(child, None if isinstance(child, ast.ClassDef) else function)

    visit(tree, None)
    return places


def _is_marker(statement: ast.AST) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
            and isinstance(statement.value.func, ast.Name) and statement.value.func.id == _MARKER_CALL)


def stub_markdown(source: str, where: str = "cell") -> str:
    """Replace each hidden answer of a markdown cell by a line for the learner's own."""
    pattern = re.compile(rf"{re.escape(MD_BEGIN)}.*?{re.escape(MD_END)}", re.DOTALL)
    stubbed = pattern.sub(MD_STUB, source)
    for marker in (MD_BEGIN, MD_END):
        if marker in stubbed:
            raise MarkerError(f"{where}: unbalanced answer markers: a '{marker}' has no partner "
                              f"(write {MD_BEGIN} ... {MD_END}, not nested)")
    return stubbed


# ---- notebooks ---------------------------------------------------------------------------
def clean(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop outputs, execution counts and session metadata; give every cell a stable id."""
    nb.nbformat, nb.nbformat_minor = 4, max(nb.get("nbformat_minor", 0), 5)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        for key in _SESSION_CELL_KEYS:
            cell.metadata.pop(key, None)
        if "id" not in cell:  # nbformat would invent random ids, and every run would differ
            cell.id = hashlib.sha1(f"{i}:{cell.source}".encode()).hexdigest()[:8]
    keep = {"kernelspec", "language_info", "picotron"}
    for key in [k for k in nb.metadata if k not in keep]:
        del nb.metadata[key]
    if "language_info" in nb.metadata:  # its version would change with whoever saved last
        nb.metadata.language_info = {"name": nb.metadata.language_info.get("name", "python")}
    return nb


def strip_outputs(path: str | Path, write: bool = True) -> bool:
    """Clean a notebook file in place (see `clean`); return whether it was not clean.

    With `write=False` only report (for a pre-commit hook or CI).
    """
    path = Path(path)
    before = path.read_text(encoding="utf-8")
    after = nbformat.writes(clean(nbformat.reads(before, as_version=4))) + "\n"
    if write and after != before:
        path.write_text(after, encoding="utf-8")
    return after != before


def make_exercise(solution: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The exercise notebook of a solution notebook (a new object; the solution is untouched)."""
    nb = clean(nbformat.from_dict(solution))
    for i, cell in enumerate(nb.cells):
        where = f"{name}, cell {i + 1}"
        if cell.cell_type == "code":
            cell.source = stub_code(cell.source, where)
        elif cell.cell_type == "markdown":
            cell.source = stub_markdown(cell.source, where)
    nb.metadata["picotron"] = {"generated_from": f"{SOLUTIONS}/{name}",
                               "note": f"generated by `python -m picotron_course generate`; edit {SOLUTIONS}/{name}"}
    return nb


def _pairs(root: Path) -> list[tuple[Path, Path]]:
    solutions = root / SOLUTIONS
    if not solutions.is_dir():
        raise FileNotFoundError(f"no {SOLUTIONS}/ folder under {root.resolve()}; run from the repository root "
                                "or pass --root")
    return [(path, root / EXERCISES / path.name) for path in sorted(solutions.glob("*.ipynb"))]


def _exercise_text(solution: Path) -> str:
    nb = nbformat.read(solution, as_version=4)
    return nbformat.writes(make_exercise(nb, solution.name)) + "\n"


def generate(root: str | Path = ".", only: list[str] | None = None) -> list[Path]:
    """Write exercises/NN.ipynb for every solutions/NN.ipynb; return the files that changed.

    only: notebook names (e.g. "03_zero" or "solutions/03_zero.ipynb") to generate, leaving the
    others alone, for an author working on one assignment while others edit theirs.
    """
    root, changed = Path(root), []
    (root / EXERCISES).mkdir(exist_ok=True)
    pairs = _pairs(root)
    if only is not None:
        wanted = {Path(name).stem for name in only}
        unknown = wanted - {solution.stem for solution, _ in pairs}
        if unknown:
            raise ValueError(f"no {SOLUTIONS}/<name>.ipynb for {sorted(unknown)}; the assignments are "
                             f"{sorted(solution.stem for solution, _ in pairs)}")
        pairs = [(solution, exercise) for solution, exercise in pairs if solution.stem in wanted]
    chapters = sorted((root / "chapters").glob("*.ipynb")) if only is None else []
    for notebook in chapters + [solution for solution, _ in pairs]:
        nb = nbformat.read(notebook, as_version=4)
        if with_setup_cell(nb):   # every chapter and assignment can install the course (Colab)
            notebook.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
            changed.append(notebook)
    for solution, exercise in pairs:
        text = _exercise_text(solution)
        if not exercise.exists() or exercise.read_text(encoding="utf-8") != text:
            exercise.write_text(text, encoding="utf-8")
            changed.append(exercise)
    return changed


def stale(root: str | Path = ".") -> list[str]:
    """What is out of date in exercises/ (empty when it is exactly what `generate` would write)."""
    root, problems = Path(root), []
    pairs = _pairs(root)
    for notebook in sorted((root / "chapters").glob("*.ipynb")) + [solution for solution, _ in pairs]:
        if with_setup_cell(nbformat.read(notebook, as_version=4)):
            problems.append(f"{notebook}'s first code cell is not the set-up cell of picotron_course/setup_cell.py")
    for solution, exercise in pairs:
        if not exercise.exists():
            problems.append(f"{exercise} is missing")
            continue
        want = nbformat.reads(_exercise_text(solution), as_version=4)
        have = nbformat.read(exercise, as_version=4)
        if _content(want) != _content(have):
            problems.append(f"{exercise} differs from what {solution} generates")
        elif any(cell.get("outputs") or cell.get("execution_count") for cell in have.cells):
            problems.append(f"{exercise} has outputs or execution counts")
    expected = {exercise.name for _, exercise in pairs}
    for orphan in sorted((root / EXERCISES).glob("*.ipynb")):
        if orphan.name not in expected:
            problems.append(f"{orphan} has no {SOLUTIONS}/{orphan.name}")
    return problems


def _content(nb: nbformat.NotebookNode) -> list[tuple[str, str]]:
    return [(cell.cell_type, cell.source) for cell in nb.cells]


# ---- check cells -------------------------------------------------------------------------
def check_name(source: str) -> str | None:
    """The check a code cell runs (`check_ring_all_reduce(f)` -> "check_ring_all_reduce"), if any.

    Only calls the cell makes count: a check called inside a `def` or imported is not run.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a learner's typo: fall back to reading the text
        match = _CHECK_CALL.search(source)
        return f"check_{match.group(1)}" if match else None
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", "")
            if name.startswith("check_"):
                return name
        todo.extend(ast.iter_child_nodes(node))
    return None


def is_check_cell(cell) -> bool:
    return cell.cell_type == "code" and check_name(cell.source) is not None

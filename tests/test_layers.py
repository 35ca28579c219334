"""The package's layers point one way: no import cycle among picotron's modules (docs/design.md, "Layers").

Every `import` and `from ... import` counts, also those inside functions: a late import hides a
cycle from Python, not from a reader. Imports of other packages (torch, triton, transformers) are
not edges of this graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_names(package_dir: Path) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of a package directory."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of `modules` that `name` imports anywhere in its file (a package counts as its __init__)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                  # relative: from . import x, from ..a import b
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:       # picotron.a.b.func -> picotron.a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    modules = module_names(package_dir)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_picotron():
    cycle = find_cycle(import_graph(ROOT / "picotron"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_trainer_is_the_top_and_the_reference_never_imports_the_course():
    graph = import_graph(ROOT / "picotron")
    assert not [name for name, deps in graph.items() if "picotron.train" in deps]
    course = [str(path.relative_to(ROOT)) for path in (ROOT / "picotron").rglob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, (ast.Import, ast.ImportFrom))
              and any(name.startswith("picotron_course") for name in
                      ([node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]))]
    assert not course, f"the reference imports the course's tooling in {course}"


def test_the_course_tooling_has_no_cycle_either():
    cycle = find_cycle(import_graph(ROOT / "picotron_course"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("late", [False, True])
def test_the_check_finds_a_cycle(tmp_path, late):
    """The check itself can fail: a package whose modules import each other, at the top or in a function."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    body = "def g():\n    from pkg import a\n    return a\n" if late else "from . import a\n\ndef g():\n    return a\n"
    (package / "b.py").write_text(body)
    (package / "c.py").write_text("import pkg.a\nimport torch\n")
    graph = import_graph(package)
    assert graph["pkg.c"] == {"pkg.a"}                     # torch is not an edge
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_no_module_re_exports_what_another_defines():
    """A name in a module's __all__ is defined there: importers take each name from where it is written."""
    re_exports = {}
    for path in sorted((ROOT / "picotron").rglob("*.py")):
        tree = ast.parse(path.read_text())
        defined, public = set(), []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
                if "__all__" in names:
                    public = [element.value for element in node.value.elts]
                defined |= names
        if [name for name in public if name not in defined]:
            re_exports[str(path.relative_to(ROOT))] = [name for name in public if name not in defined]
    assert not re_exports, f"re-exported names: {re_exports}"

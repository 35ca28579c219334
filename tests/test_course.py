"""Course tooling: exercises are generated from solutions, checks catch wrong answers, grading scores.

The solution notebooks themselves run under nbval (`pytest solutions/`); here the checks are
also tested against a reference written in this file, so a check that passes everything, or
nothing, is caught even without a notebook.
"""

import ast
import json
import linecache
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch
import torch.distributed as dist

from picotron.comm import send_recv
from picotron_course import checks_collectives as collectives, exercises
from picotron_course.checks import CollectiveNotAllowed
from picotron_course.checks_collectives import (check_all_gather_phase, check_chunk_to_send,
                                                check_reduce_scatter_phase, check_ring_all_reduce)
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


# ---- reference answers, written here (not taken from the solution notebook) -------------------
def ref_chunk_to_send(step, rank, world):
    return (rank - step) % world


def ref_reduce_scatter_phase(chunks, rank, world, steps=None):
    buffer = torch.empty_like(chunks[0])
    for step in range(world - 1 if steps is None else steps):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        chunks[(rank - 1 - step) % world] += buffer


def ref_all_gather_phase(chunks, rank, world):
    for step in range(world - 1, 2 * (world - 1)):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, chunks[(rank - 1 - step) % world],
                  (rank - 1) % world)


def ref_ring_all_reduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world)
    flat = tensor.new_zeros(world * k)
    flat[: tensor.numel()] = tensor.flatten()
    chunks = list(flat.split(k))
    ref_reduce_scatter_phase(chunks, rank, world)
    ref_all_gather_phase(chunks, rank, world)
    tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))
    return tensor


# ---- 4. a correct answer passes every check ---------------------------------------------------
@pytest.mark.parametrize("check, answer", [(check_chunk_to_send, ref_chunk_to_send),
                                           (check_reduce_scatter_phase, ref_reduce_scatter_phase),
                                           (check_all_gather_phase, ref_all_gather_phase),
                                           (check_ring_all_reduce, ref_ring_all_reduce)],
                         ids=["chunk_to_send", "reduce_scatter", "all_gather", "ring"])
def test_correct_answer_passes(check, answer, capsys):
    check(answer)
    out = capsys.readouterr().out
    assert "FAIL" not in out and " ok" in out


def test_ring_check_covers_the_cases_it_promises():
    """World sizes 2-4, float32 and float64, sizes that split over the ranks and sizes that do not."""
    assert set(collectives.RING_WORLDS) >= {2, 3, 4} and set(collectives.RING_DTYPES) == {torch.float32, torch.float64}
    numels = [(world, torch.Size(shape).numel()) for world in collectives.RING_WORLDS
              for shape in collectives.RING_SHAPES]
    assert any(n % w == 0 for w, n in numels) and any(n % w for w, n in numels) and any(n < w for w, n in numels)
    assert any(len(shape) > 1 for shape in collectives.RING_SHAPES)


# ---- 3. planted wrong answers fail their check -------------------------------------------------
def wrong_chunk_to_send(step, rank, world):
    return (rank + step) % world  # rotates the wrong way


def rs_one_step_short(chunks, rank, world):
    ref_reduce_scatter_phase(chunks, rank, world, steps=world - 2)


def rs_rebinds_chunks(chunks, rank, world):
    buffer = torch.empty_like(chunks[0])
    for step in range(world - 1):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        i = (rank - 1 - step) % world
        chunks[i] = chunks[i] + buffer  # a new tensor: the flat buffer never sees it


def ag_adds_instead_of_copies(chunks, rank, world):
    buffer = torch.empty_like(chunks[0])
    for step in range(world - 1, 2 * (world - 1)):
        send_recv(chunks[(rank - step) % world], (rank + 1) % world, buffer, (rank - 1) % world)
        chunks[(rank - 1 - step) % world] += buffer


def ring_local_only(tensor):
    return tensor  # never communicates: each rank keeps its own tensor


def ring_drops_remainder(tensor):
    world = dist.get_world_size()
    even = tensor.numel() // world * world  # forgets the last numel % world elements
    flat = tensor.view(-1)
    if even:
        part = flat[:even].clone()
        chunks = list(part.split(even // world))
        ref_reduce_scatter_phase(chunks, dist.get_rank(), world)
        ref_all_gather_phase(chunks, dist.get_rank(), world)
        flat[:even] = part
    return tensor


def ring_uses_all_reduce(tensor):
    dist.all_reduce(tensor)
    return tensor


def ring_calls_the_course_answer(tensor):
    import picotron.comm
    return picotron.comm.ring_all_reduce(tensor)


def ring_sends_whole_tensor(tensor):
    """Right sum, wrong algorithm: the whole tensor goes around the ring, (N-1) S bytes per rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    passing, received = tensor.clone(), torch.empty_like(tensor)
    for _ in range(world - 1):
        send_recv(passing, (rank + 1) % world, received, (rank - 1) % world)
        tensor += received
        passing = received.clone()
    return tensor


def ring_not_in_place(tensor):
    return ref_ring_all_reduce(tensor.clone())


WRONG_ANSWERS = [
    (check_chunk_to_send, wrong_chunk_to_send, "chunk_to_send"),
    (check_reduce_scatter_phase, rs_one_step_short, "reduce_scatter_phase"),
    (check_reduce_scatter_phase, rs_rebinds_chunks, "in place"),
    (check_all_gather_phase, ag_adds_instead_of_copies, "all_gather_phase"),
    (check_ring_all_reduce, ring_local_only, "ring_all_reduce"),
    (check_ring_all_reduce, ring_drops_remainder, "ring_all_reduce"),
    (check_ring_all_reduce, ring_uses_all_reduce, "dist.all_reduce"),
    (check_ring_all_reduce, ring_calls_the_course_answer, "picotron.comm.ring_all_reduce"),
    (check_ring_all_reduce, ring_sends_whole_tensor, "bytes"),
    (check_ring_all_reduce, ring_not_in_place, "in place"),
]


@pytest.mark.parametrize("check, answer, says", WRONG_ANSWERS, ids=[a.__name__ for _, a, _ in WRONG_ANSWERS])
def test_wrong_answer_fails(check, answer, says, capsys):
    with pytest.raises(AssertionError, match=says):
        check(answer)
    out = capsys.readouterr().out
    if answer not in (ring_uses_all_reduce, ring_calls_the_course_answer):  # the others print the table
        assert "FAIL" in out


def test_remainder_bug_fails_only_where_world_does_not_divide(capsys):
    with pytest.raises(AssertionError):
        check_ring_all_reduce(ring_drops_remainder)
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("2", "3", "4") and parts[-1] in ("ok", "FAIL"):
            numel = torch.Size(ast.literal_eval(" ".join(parts[1:-5]))).numel()
            assert (parts[-1] == "ok") == (numel % int(parts[0]) == 0), line


def ring_with_isend_irecv(tensor):
    """The same ring, written with dist.isend / dist.irecv and waits."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world)
    flat = tensor.new_zeros(world * k)
    flat[: tensor.numel()] = tensor.flatten()
    chunks, buffer = list(flat.split(k)), torch.empty(k, dtype=tensor.dtype)
    for step in range(2 * (world - 1)):
        into = buffer if step < world - 1 else chunks[(rank - 1 - step) % world]
        requests = [dist.isend(chunks[(rank - step) % world], (rank + 1) % world),
                    dist.irecv(into, (rank - 1) % world)]
        for request in requests:
            request.wait()
        if step < world - 1:
            chunks[(rank - 1 - step) % world] += buffer
    tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))
    return tensor


def ring_with_blocking_send_recv(tensor):
    """The same ring with blocking dist.send / dist.recv: even ranks send first, odd ranks receive first."""
    rank, world = dist.get_rank(), dist.get_world_size()
    k = -(-tensor.numel() // world)
    flat = tensor.new_zeros(world * k)
    flat[: tensor.numel()] = tensor.flatten()
    chunks, buffer = list(flat.split(k)), torch.empty(k, dtype=tensor.dtype)
    for step in range(2 * (world - 1)):
        into = buffer if step < world - 1 else chunks[(rank - 1 - step) % world]
        send = lambda: dist.send(chunks[(rank - step) % world].clone(), (rank + 1) % world)
        recv = lambda: dist.recv(into, (rank - 1) % world)
        for op in ((send, recv) if rank % 2 == 0 else (recv, send)):
            op()
        if step < world - 1:
            chunks[(rank - 1 - step) % world] += buffer
    tensor.copy_(flat[: tensor.numel()].reshape(tensor.shape))
    return tensor


@pytest.mark.parametrize("answer", [ring_with_isend_irecv, ring_with_blocking_send_recv], ids=lambda f: f.__name__)
def test_bytes_are_counted_once_whatever_the_point_to_point_api(answer, capsys):
    check_ring_all_reduce(answer)  # sent/rank must be within the ring's bound: counted once, not twice
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.endswith(" ok")]
    assert rows and all(int(row[-3]) > 0 for row in rows)


def test_collective_not_allowed_is_an_assertion():
    assert issubclass(CollectiveNotAllowed, AssertionError)


# ---- 5. the generator: stubs, and markers it must refuse ---------------------------------------
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

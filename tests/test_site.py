"""The course site: a real chapter executed and rendered, and a synthetic failing one that must not stop the build.

Chapter 00 is the fastest chapter (about 25 s on 2 CPU cores); the synthetic notebooks take a
few seconds each, most of it starting their kernel.
"""

import json
import sys
from pathlib import Path

import nbformat
import pytest

from picotron_course import site

ROOT = Path(__file__).resolve().parents[1]


def _notebook(path: Path, *cells) -> None:
    nb = nbformat.v4.new_notebook(cells=list(cells))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


@pytest.fixture(scope="module")
def real_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    assert site.main(["--root", str(ROOT), "--out", str(out), "--only", "00_collectives"]) == 0
    return out


def test_a_real_chapter_is_executed_and_rendered(real_site):
    index = (real_site / "index.html").read_text()
    assert 'href="00_collectives.html"' in index
    assert "Collectives" in index and " s</td>" in index            # its title and how long it ran
    assert "exercises/00_collectives.ipynb" in index and "solutions/00_collectives.ipynb" in index
    page = (real_site / "00_collectives.html").read_text()
    assert 'src="data:image/png;base64,' in page                    # a figure, inline
    assert "ranks started, ran and joined" in page                  # printed output
    assert 'href="01_memory.html"' in page and 'href="index.html"' in page
    assert "GPU measurements this chapter cites" not in page        # 00 does not cite docs/benchmarks.md
    assert "<table>" in (real_site / "benchmarks.html").read_text()
    assert (real_site / "design.html").is_file()
    records = json.loads((real_site / "build.json").read_text())
    assert records["00_collectives"][1] is None and records["00_collectives"][0] > 0


def test_a_failing_chapter_still_builds_and_exits_1(tmp_path, capsys):
    chapters, out = tmp_path / "chapters", tmp_path / "site"   # a small repository: chapters/, docs/, exercises/
    for folder in ("chapters", "docs", "exercises"):
        (tmp_path / folder).mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text("# Measured\n\n| figure | value |\n| --- | --- |\n| a | 1 |\n")
    _notebook(tmp_path / "exercises" / "00_cites.ipynb")
    _notebook(chapters / "00_cites.ipynb",
              nbformat.v4.new_markdown_cell("# 00 · Cites\n\nThe numbers are in `docs/benchmarks.md`.\n\n"
                                            "[next](01_broken.ipynb), [figures](../docs/benchmarks.md#measured), "
                                            "[exercise](../exercises/00_cites.ipynb), [web](https://example.org)"),
              nbformat.v4.new_code_cell("import sys\nprint('kernel:', sys.executable)"))
    _notebook(chapters / "01_broken.ipynb",
              nbformat.v4.new_markdown_cell("# 01 · Broken"),
              nbformat.v4.new_code_cell("print('before')"),
              nbformat.v4.new_code_cell("raise ValueError('broken on purpose')"),
              nbformat.v4.new_code_cell("print('never printed')"))
    assert site.main(["--root", str(tmp_path)]) == 1
    printed = capsys.readouterr().out
    assert "1 chapter(s) failed: 01_broken" in printed and "design.md not found" in printed

    index = (out / "index.html").read_text()
    assert "failed: ValueError: broken on purpose (cell 3)" in index
    assert "The numbers are in docs/benchmarks.md." in index       # the summary, as plain text
    assert 'href="../exercises/00_cites.ipynb"' in index
    cites = (out / "00_cites.html").read_text()
    assert 'GPU measurements this chapter cites: <a href="benchmarks.html">' in cites
    assert f"kernel: {sys.executable}" in cites                    # this interpreter, as --nbval-current-env
    for link in ("01_broken.html", "benchmarks.html#measured", "../exercises/00_cites.ipynb", "https://example.org"):
        assert f'href="{link}"' in cites                           # links written for chapters/, read from site/
    broken = (out / "01_broken.html").read_text()
    assert "broken on purpose" in broken and "Execution failed here" in broken
    assert "before" in broken and "never printed</pre>" not in broken
    assert "<table>" in (out / "benchmarks.html").read_text()

    # Rendering one chapter again keeps what the index knew about the other.
    assert site.main(["--root", str(tmp_path), "--only", "01", "--no-execute"]) == 0
    index = (out / "index.html").read_text()
    assert "not executed (--no-execute)" in index and "failed:" not in index
    assert " s</td>" in index                                      # 00_cites: its time from the first build


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert site.main(["--root", str(ROOT), "--out", str(tmp_path), "--only", "99_nope"]) == 2
    assert capsys.readouterr().out.startswith("no chapter named 99_nope in ")
    assert site.main(["--root", str(tmp_path), "--out", str(tmp_path / "site")]) == 2
    assert "run from the repository root or pass --root" in capsys.readouterr().out


def test_title_and_summary():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_markdown_cell("# 03 · ZeRO\n\n**The problem.** A [link](x.md) and `code`\n"
                                      "over two lines.\n\nLater."),
    ])
    assert site.title_and_summary(nb, "fallback") == ("03 · ZeRO", "The problem. A link and code over two lines.")
    long = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# T\n\n" + "word " * 100)])
    summary = site.title_and_summary(long, "fallback")[1]
    assert len(summary) <= site.SUMMARY_CHARS + 2 and summary.endswith(" …")
    assert site.title_and_summary(nbformat.v4.new_notebook(), "fallback") == ("fallback", "")

"""The course site: a real chapter executed and rendered, and a synthetic failing one that must not stop the build.

Chapter 00 is the fastest chapter (about 25 s on 2 CPU cores); the synthetic notebooks take a
few seconds each, most of it starting their kernel. The formula tests render every page of the
course without executing it (about 10 s): no raw TeX may be left outside code, and no MathJax.
"""

import html
import json
import re
import sys
from html.parser import HTMLParser
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


# ---- formulas: MathML when the site is built, nothing left for a script ------------------------
class _Text(HTMLParser):
    """The text of an HTML page outside <code>, <pre>, <math>, <script>, <style> and <head>, and the
    text inside <math> separately: a reader sees the first as typed, the second as a formula."""

    SKIP = {"code", "pre", "script", "style", "head", "math"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.open, self.prose, self.math = [], [], []

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.open.append(tag)

    def handle_endtag(self, tag):
        if tag in self.open:
            del self.open[len(self.open) - 1 - self.open[::-1].index(tag):]   # up to its matching start

    def handle_data(self, data):
        if not self.open:
            self.prose.append(data)
        elif self.open == ["math"]:
            self.math.append(data)


# What raw TeX looks like in prose: a $...$ or $$...$$ span (opening $ before a non-space, closing
# $ not before a digit, as site.INLINE_MATH: "$5 and $10" is prose), a command (\frac, \Psi, \,),
# \( \[ delimiters, or a script with braces (2^{-8}, N_{kv}).
RAW_TEX = re.compile(r"\$\$.+?\$\$|\$(?![\s$])[^$]{1,300}?\$(?!\d)|\\[A-Za-z]+|\\[,;!()\[\]{}]|[\^_]\{", re.DOTALL)


DISPLAY_MATH = re.compile(r'<math [^>]*display="block"')


def raw_tex(page: str) -> list[str]:
    """Raw TeX a reader of `page` would see: in its prose, or a command latex2mathml let through
    into a <math> element as text."""
    parser = _Text()
    parser.feed(page)
    found = RAW_TEX.findall("".join(parser.prose))
    return found + [text for text in parser.math if "\\" in text]


@pytest.fixture(scope="module")
def course_site(tmp_path_factory):
    """Every page of the course, rendered without executing the chapters (a few seconds)."""
    out = tmp_path_factory.mktemp("course_site")
    assert site.main(["--root", str(ROOT), "--out", str(out), "--no-execute"]) == 0
    return out


def test_every_formula_of_the_course_is_mathml(course_site):
    pages = sorted(course_site.glob("*.html"))
    chapters = sorted(path.stem for path in (ROOT / "chapters").glob(site.CHAPTER_GLOB))
    assert {path.stem for path in pages} == {"index", *site.DOCS, *chapters}
    for path in pages:
        page = path.read_text()
        assert raw_tex(page) == [], f"{path.name} shows raw TeX"
        assert "mathjax" not in page.lower(), f"{path.name} still loads MathJax"
    formulas = {path.stem: path.read_text().count("<math ") for path in pages}
    assert formulas["glossary"] >= 100                   # $N$, $\Psi$, $2^{-8}$, ... in its tables
    assert formulas["index"] >= 1                        # chapter summaries: "use $N$ of them"
    assert all(formulas[name] >= 20 for name in chapters), formulas
    zero = (course_site / "03_zero.html").read_text()
    assert DISPLAY_MATH.search((course_site / "01_memory.html").read_text())   # its $$A_\text{layer} = ...$$
    assert "<mi>Ψ</mi>" in html.unescape(zero)           # \Psi
    assert "<mfrac>" in zero                             # \frac


def test_the_detector_sees_raw_tex():
    seen = lambda body: raw_tex(f"<html><head><title>$x$</title></head><body>{body}</body></html>")  # noqa: E731
    for raw in ("bytes $2\\Psi$ sent", "$$\\frac{a}{b}$$", "a \\Psi alone", "2^{-8}", "\\(x\\)", "a $N$ b",
                "$x<em>y</em>z$", "<p>$x$</p>", "<math><mi>\\foo</mi></math>"):
        assert seen(raw), raw
    for clean in ("costs $5 and $10", "<code>$HOME \\frac</code>", "<pre>echo $A $B</pre>",
                  '<math display="inline"><mi>N</mi></math>', "a lone $ sign", "<script>let s = '$x$'</script>"):
        assert seen(clean) == [], clean


def test_formulas_prose_dollars_code_and_a_bad_formula(tmp_path, capsys):
    for folder in ("chapters", "docs"):
        (tmp_path / folder).mkdir()
    (tmp_path / "docs" / "glossary.md").write_text(
        "# Glossary\n\n| symbol | meaning |\n| --- | --- |\n| $\\Psi$ | parameters, $2\\Psi$ bytes in bf16 |\n\n"
        "Prose keeps its dollars: it costs $5 and $10.\n\nNext to a formula one is written \\$3, as $x$.\n\n"
        "    export N=$WORLD_SIZE   # $x$ in an indented block\n\n"
        "```bash\necho \"$HOME $PATH\"\n```\n\nCode `$x$` and `a $b` stay.\n\n$$\\frac{N-1}{N}\\,S$$\n")
    _notebook(tmp_path / "chapters" / "00_sums.ipynb",
              nbformat.v4.new_markdown_cell("# 00 · Sums over $N$ ranks\n\nA ring sends $2(N-1)/N \\cdot S$ bytes, "
                                            "less than $2S$.\n\n$$T = \\alpha + \\frac{S}{W}$$"),
              nbformat.v4.new_code_cell("print('$x$ costs $5')"))
    assert site.main(["--root", str(tmp_path), "--no-execute"]) == 0
    out = tmp_path / "site"
    for name in ("glossary", "00_sums", "index"):
        page = (out / f"{name}.html").read_text()
        assert raw_tex(page) == [], name
        assert "<math " in page, name
    glossary = (out / "glossary.html").read_text()
    assert "it costs $5 and $10.</p>" in glossary and "written $3, as <math" in glossary
    assert "$WORLD_SIZE   # $x$ in an indented block" in glossary
    assert '<span class="nv">$HOME</span>' in glossary                 # fenced code, highlighted
    assert "<code>$x$</code>" in glossary and "<code>a $b</code>" in glossary
    assert len(DISPLAY_MATH.findall(glossary)) == 1 and "<mfrac>" in glossary
    index = (out / "index.html").read_text()
    assert ">00 · Sums over <math" in index                       # the title, and the summary
    assert "A ring sends <math" in index and "less than <math" in index
    chapter = (out / "00_sums.html").read_text()
    assert "print(&#39;$x$ costs $5&#39;)" in chapter or "$x$ costs $5" in chapter   # code as typed

    # A formula latex2mathml cannot convert stops the build: one line, the page, the formula.
    (tmp_path / "docs" / "glossary.md").write_text("# Glossary\n\nAn unknown command: $\\foo{x} + 1$.\n")
    assert site.main(["--root", str(tmp_path), "--no-execute"]) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith(f"{tmp_path / 'docs' / 'glossary.md'}: the formula $\\foo{{x}} + 1$ does not")
    assert "\\foo" in printed[-1]
    (tmp_path / "docs" / "glossary.md").write_text("# Glossary\n")
    _notebook(tmp_path / "chapters" / "01_broken.ipynb", nbformat.v4.new_markdown_cell("# 01 · Broken"),
              nbformat.v4.new_markdown_cell("Display:\n\n$$\\frac{1}{2$$"))
    assert site.main(["--root", str(tmp_path), "--no-execute"]) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1].startswith(f"{tmp_path / 'chapters' / '01_broken.ipynb'}, markdown cell 1: the formula "
                                  "$$\\frac{1}{2$$ has unbalanced braces"), printed[-1]


@pytest.mark.parametrize("tex, why", [
    (r"\foo{x}", r"does not know \foo"),                       # latex2mathml would show "\foo" as text
    (r"\frac{1}{2", "unbalanced braces"),                      # ... and close the brace itself
    (r"a}", "unbalanced braces"),                              # ... and drop this one
    (r"\begin{aligned}a &= b\end{aligned}", "an environment latex2mathml does not know, of aligned"),
    (r"\left( x", "ExtraLeftOrMissingRightError"),
    (r"x^", "MissingSuperScriptOrSubscriptError"),
])
def test_a_formula_that_does_not_convert_is_an_error(tex, why):
    with pytest.raises(site.FormulaError, match=re.escape(why)) as error:
        site.tex_to_mathml(tex)
    assert str(error.value).startswith(f"the formula ${tex}$ ") and "\n" not in str(error.value)
    assert "<mtable" in site.tex_to_mathml(r"\begin{cases} a & b \\ c & d \end{cases}", display=True)
    assert "<mo" in site.tex_to_mathml(r"\{x\} \cup \lceil y \rceil")


def test_a_prime_sits_beside_its_letter():
    # latex2mathml writes m' as <msup>m ′</msup>, and browsers raise the (already raised) prime once more.
    for tex in ("m'", r"\Psi'", "e^{m - m'}", r"\sum_{r'} g_{r'}", "m''"):
        mathml = site.tex_to_mathml(tex)
        assert not re.search(r"<msup><mi>[^<]*</mi><m[io]>(&#x0203[23];|[′″])</m[io]></msup>", mathml), tex
        assert re.search(r"<mi>(&#x0203[23];|[′″])</mi>", mathml), tex
    assert "<msup>" in site.tex_to_mathml("m^2")

"""Build the course as a static HTML site: every chapter executed, with its figures and printed output.

    python -m picotron_course.site                          # all chapters into site/
    python -m picotron_course.site --only 00_collectives    # one chapter; the index keeps the others
    python -m picotron_course.site --no-execute             # render as committed (no outputs): a quick look

chapters/*.ipynb are committed without outputs, so a reader of the repository sees no figure. Here
each chapter runs in a fresh kernel of this interpreter with chapters/ as working directory, the
way `pytest chapters/` runs it under nbval (--nbval-current-env, 300 s per cell), and nbconvert
turns the executed notebook into one page with its images inline. docs/benchmarks.md,
docs/design.md and docs/glossary.md become pages too: chapters cite the first for what only a GPU can
measure.

Formulas ($...$ and $$...$$ in markdown cells and docs pages) become MathML here, at build time,
which browsers render natively: the pages need no script and no network to show them. A formula
that does not convert stops the build with one line naming the page and the formula.

A chapter that fails still gets its page, which shows the error; the index marks it "failed"
and the command exits 1 once everything is built. Exercise and solution notebooks are linked,
not rendered: they are meant to be opened in Jupyter and worked in, and unexecuted they would
show nothing the chapter page does not.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

__all__ = ["Chapter", "find_chapters", "title_and_summary", "execute", "build", "main"]

CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"
DOCS = ("benchmarks", "design", "glossary")   # docs/NAME.md -> site/NAME.html
BENCHMARKS_CITATION = "docs/benchmarks.md"
RECORDS = "build.json"                    # per chapter: seconds and error of the last build that ran it
SUMMARY_CHARS = 200

STYLE = """<style>
.course-nav { font: 14px sans-serif; display: flex; justify-content: space-between; gap: 1em;
              padding: 8px 16px; background: #f3f4f6; border-bottom: 1px solid #ddd; }
.course-nav.bottom { border-top: 1px solid #ddd; border-bottom: none; margin-top: 2em; }
.course-box { font: 14px sans-serif; margin: 12px 16px; padding: 8px 12px; border-left: 4px solid #2563eb;
              background: #eff6ff; }
.course-box.failed { border-color: #dc2626; background: #fef2f2; }
/* MathML: a font with an OpenType MATH table stretches braces, roots and sums; without one they stay small */
math { font-family: "Latin Modern Math", "STIX Two Math", "Cambria Math", math; font-size-adjust: 0.5; }
math[display="block"] { margin: 0.6em 0; overflow-x: auto; overflow-y: hidden; }
menclose[notation~="box"] { border: 1px solid currentColor; padding: 0 0.2em; }  /* TeX's boxed: not in MathML Core */
</style>
"""


@dataclass
class Chapter:
    path: Path
    title: str
    summary: str
    seconds: float | None = None   # wall-clock time to execute here; None when not executed
    error: str | None = None       # "ExceptionType: first line of the message" when execution failed

    @property
    def name(self) -> str:
        return self.path.stem


# ---- reading chapters --------------------------------------------------------------------------
def find_chapters(chapters_dir: Path, only: list[str] | None = None) -> list[Path]:
    """chapters_dir/NN_*.ipynb in course order, or only those named ("04_tensor_parallel", "04", a path)."""
    chapters = sorted(chapters_dir.glob(CHAPTER_GLOB))
    if not chapters:
        raise ValueError(f"no chapter notebooks ({CHAPTER_GLOB}) in {chapters_dir}; "
                         "run from the repository root or pass --root")
    if not only:
        return chapters
    wanted = [Path(name).stem for name in only]
    unknown = [name for name in wanted if not any(_is_named(path, name) for path in chapters)]
    if unknown:
        raise ValueError(f"no chapter named {', '.join(unknown)} in {chapters_dir}; "
                         f"choose from {', '.join(path.stem for path in chapters)}")
    return [path for path in chapters if any(_is_named(path, name) for name in wanted)]


def _is_named(path: Path, name: str) -> bool:
    return path.stem == name or path.stem.split("_")[0] == name


def title_and_summary(nb, fallback: str) -> tuple[str, str]:
    """The first markdown heading, and the paragraph after it as plain text cut to SUMMARY_CHARS."""
    title, paragraph = None, []
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in cell.source.split("\n"):
            if title is None:
                if line.startswith("#"):
                    title = line.lstrip("#").strip()
            elif line.strip():
                paragraph.append(line.strip())
            elif paragraph:
                break
        if paragraph:
            break
    return title or fallback, _shorten(_plain(" ".join(paragraph)))


def _plain(markdown: str) -> str:
    """Markdown emphasis, code marks and links reduced to their text, for a one-line summary.

    Formulas ($...$) stay as they are (their _ and * are TeX), for the index to turn into MathML.
    """
    def plain(text: str) -> str:
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        return re.sub(r"[*_`]{1,3}(?=\S)|(?<=\S)[*_`]{1,3}", "", text)

    parts, end = [], 0
    for m in _INLINE_MATH.finditer(markdown):
        parts += [plain(markdown[end:m.start()]), m.group(0)]
        end = m.end()
    return "".join(parts) + plain(markdown[end:])


def _shorten(text: str) -> str:
    """`text` cut at a space to SUMMARY_CHARS, before a formula rather than inside it."""
    if len(text) <= SUMMARY_CHARS:
        return text
    inside = [m.start() for m in _INLINE_MATH.finditer(text) if m.start() < SUMMARY_CHARS < m.end()]
    head = text[:inside[0]].rstrip() if inside else text[:SUMMARY_CHARS].rsplit(" ", 1)[0]
    return head.rstrip(",;:") + " …"


# ---- formulas: TeX to MathML when the site is built ---------------------------------------------
# Inline math is $...$ as in Jupyter, with two of pandoc's rules so that dollars in prose stay text:
# the opening $ is not followed by a space and the closing $ not by a digit ("$5 and $10" is prose).
# A formula holds no backtick and no unescaped $, so it cannot run into a code span. A literal
# dollar next to a formula is written \$, which Jupyter shows as $ too.
INLINE_MATH = r"(?s:(?<![$\\])\$(?![\s$])(?P<math_inline_tex>(?:\\.|[^$`\\])+?)\$(?!\d))"
_INLINE_MATH = re.compile(INLINE_MATH)
_UNCONVERTED = re.compile(r">[^<]*(\\[A-Za-z]*)[^<]*<")  # a TeX command latex2mathml passed through as text
# x' as latex2mathml writes it, a prime in a superscript: browsers raise it twice (the glyph is raised already)
_PRIMED = re.compile(r"<msup>(<m[in]>[^<]*</m[in]>)<m[io]>(&#x0203[234];|[\u2032-\u2034])</m[io]></msup>")


class FormulaError(ValueError):
    """A formula latex2mathml cannot turn into MathML; the caller adds the page it is on."""


def tex_to_mathml(tex: str, display: bool = False) -> str:
    r"""One formula as a <math> element, or FormulaError naming it.

    latex2mathml raises on some malformed TeX, but it copies a command it does not know (\foo) into
    the MathML as text, drops an environment it does not know (\begin{aligned}) and closes a missing
    brace: the reader would see a wrong formula. All of these are errors here.
    """
    from latex2mathml.converter import convert

    shown = " ".join(tex.split())
    shown = f"$${shown}$$" if display else f"${shown}$"
    shown = shown if len(shown) <= 100 else shown[:97] + "..."
    depth = 0
    for brace in re.findall(r"\\.|[{}]", tex):  # latex2mathml closes a missing } silently, and drops a stray one
        depth += {"{": 1, "}": -1}.get(brace, 0)
        if depth < 0:
            break
    if depth:
        raise FormulaError(f"the formula {shown} has unbalanced braces {{ }}; fix its TeX")
    try:
        mathml = convert(tex.strip(), display="block" if display else "inline")
    except Exception as e:  # latex2mathml's own exceptions, and IndexError/KeyError on some bad input
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}"
        raise FormulaError(f"the formula {shown} does not convert to MathML ({reason}); fix its TeX") from None
    environments = re.findall(r"\\begin\s*\{([^}]*)\}", tex)
    if len(environments) > mathml.count("<mtable"):  # each one it knows becomes a table
        raise FormulaError(f"the formula {shown} does not convert to MathML (an environment latex2mathml does "
                           f"not know, of {', '.join(environments)}); use cases, array or a matrix")
    unknown = _UNCONVERTED.search(mathml)
    if unknown:
        raise FormulaError(f"the formula {shown} does not convert to MathML (latex2mathml does not know "
                           f"{unknown.group(1)}); write it with commands it knows")
    return _PRIMED.sub(r"<mrow>\1<mi>\2</mi></mrow>", mathml)


def _markdown_renderer(**options):
    """nbconvert's markdown renderer with formulas written as MathML instead of left for MathJax."""
    from nbconvert.filters.markdown_mistune import IPythonRenderer

    class MathMLRenderer(IPythonRenderer):
        def inline_math(self, body: str) -> str:
            return tex_to_mathml(body)

        def block_math(self, body: str) -> str:
            return tex_to_mathml(body, display=True)

        def latex_environment(self, name: str, body: str) -> str:
            return tex_to_mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)

        def multiline_math(self, text: str) -> str:  # mistune 2: `text` is display math already rendered inline
            return text

    return MathMLRenderer(escape=False, **options)


def markdown_to_html(text: str, **options) -> str:
    """Markdown, with its formulas in MathML, as HTML (nbconvert's markdown: tables, raw HTML, anchors).

    `options` go to nbconvert's IPythonRenderer (embed_images, path, attachments, anchor links).
    """
    from nbconvert.filters import markdown_mistune
    from nbconvert.filters.markdown_mistune import MarkdownWithMath, MathInlineParser

    mistune_3 = getattr(markdown_mistune, "MISTUNE_V3", False)  # nbconvert < 7.3 knows only mistune 2

    class InlineParser(MathInlineParser):
        INLINE_MATH_TEX = INLINE_MATH                                     # mistune 2 reads the rule here
        if mistune_3:
            SPECIFICATION = {**MathInlineParser.SPECIFICATION, "inline_math_tex": INLINE_MATH}

    renderer = _markdown_renderer(**options)
    inline = InlineParser(hard_wrap=False) if mistune_3 else InlineParser(renderer, hard_wrap=False)
    return MarkdownWithMath(renderer=renderer, inline=inline).render(text)


def text_to_html(text: str) -> str:
    """Plain text with $...$ formulas (a title, a summary) as HTML: the text escaped (\\$ a dollar, as in
    markdown), the formulas MathML."""
    def prose(text: str) -> str:
        return html.escape(text.replace("\\$", "$"))

    parts, end = [], 0
    for m in _INLINE_MATH.finditer(text):
        parts += [prose(text[end:m.start()]), tex_to_mathml(m.group("math_inline_tex"))]
        end = m.end()
    return "".join(parts) + prose(text[end:])


def check_formulas(nb, where: Path) -> None:
    """Convert every formula of `nb`'s markdown cells now, so that a bad one stops the build before
    any chapter runs, with the notebook and the cell it is in."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            try:
                markdown_to_html(cell.source)
            except FormulaError as e:
                raise FormulaError(f"{where}, markdown cell {i}: {e}") from None


# ---- executing one chapter ---------------------------------------------------------------------
def execute(nb, cwd: Path, cell_timeout: float = 300) -> tuple[float, str | None]:
    """Run every cell of `nb` in place in a fresh kernel; return (seconds, error line or None).

    Execution stops at the first failing cell, as under nbval; the outputs so far, the error's
    included, stay in `nb` for the page.
    """
    from nbclient import NotebookClient  # imported here: `--help` and --no-execute do not need it

    running = {"cell": None}
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            kernel_manager_class=_this_interpreter_kernel(), shutdown_kernel="immediate",
                            resources={"metadata": {"path": str(cwd.resolve())}},
                            on_cell_start=lambda cell, cell_index: running.update(cell=cell_index + 1))
    start = time.perf_counter()
    try:
        client.execute()
    except Exception as e:  # a failing chapter must not stop the others; its page shows the error
        ename, evalue = getattr(e, "ename", type(e).__name__), getattr(e, "evalue", str(e))
        first = (evalue or "").strip().split("\n")[0]
        where = f" (cell {running['cell']})" if running["cell"] else ""
        return time.perf_counter() - start, f"{ename}: {first}"[:200] + where
    return time.perf_counter() - start, None


def _this_interpreter_kernel():
    """A kernel manager whose "python3" is this interpreter, like nbval's --nbval-current-env.

    The installed python3 kernelspec runs whatever `python` is first on PATH, which need not
    be the environment that holds picotron.
    """
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from traitlets import default

    class ThisInterpreterSpecs(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            if kernel_name != "python3":
                return super().get_kernel_spec(kernel_name)
            return KernelSpec(resource_dir=ipykernel.kernelspec.RESOURCES, **ipykernel.kernelspec.get_kernel_dict())

    class ThisInterpreterKernel(AsyncKernelManager):
        @default("kernel_spec_manager")
        def _kernel_spec_manager_default(self):
            return ThisInterpreterSpecs(data_dir=self.data_dir)

    return ThisInterpreterKernel


# ---- pages -------------------------------------------------------------------------------------
def chapter_page(nb, chapter: Chapter, previous: Chapter | None, following: Chapter | None,
                 root: Path, out: Path) -> str:
    """nbconvert's page for `nb`, with navigation, the benchmarks box and, if it failed, the error."""
    resources = {"metadata": {"name": chapter.title, "path": str(chapter.path.parent)}}  # path: for embed_images
    try:
        page, _ = _exporter().from_notebook_node(nb, resources=resources)
    except FormulaError as e:  # check_formulas has seen the markdown cells: this is a text/markdown output
        raise FormulaError(f"{chapter.path}, an output: {e}") from None
    page = _relink(page, chapter.path.parent, chapter.path.parent, root, out)
    top = _nav(previous, following)
    if chapter.error:
        top += (f'<div class="course-box failed">Execution failed here: {html.escape(chapter.error)}. '
                "That cell shows the error; the cells after it did not run and show only their code.</div>\n")
    if any(BENCHMARKS_CITATION in cell.source for cell in nb.cells):
        top += ('<div class="course-box">GPU measurements this chapter cites: '
                '<a href="benchmarks.html">benchmarks.html</a> (docs/benchmarks.md)</div>\n')
    page = page.replace("</head>", STYLE + "</head>", 1)
    page, found = re.subn(r"<body[^>]*>", lambda m: m.group(0) + "\n" + top, page, count=1)
    if not found:
        raise RuntimeError("nbconvert's page has no <body> tag; the navigation has nowhere to go")
    end = page.rfind("</body>")
    return page[:end] + _nav(previous, following, "bottom") + page[end:]


# nbconvert's "lab" page without its MathJax <script> (a CDN, so nothing rendered offline): the formulas
# are MathML already.
_TEMPLATE = "picotron_course_page.html.j2"
_TEMPLATE_SOURCE = ("{%- extends 'index.html.j2' -%}\n"
                    "{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}\n")


def _exporter():
    """nbconvert's HTMLExporter with images inline, formulas as MathML (markdown cells and text/markdown
    outputs, which go through its markdown2html filter) and no MathJax."""
    import jinja2
    from nbconvert import HTMLExporter

    class MathMLExporter(HTMLExporter):
        @jinja2.pass_context
        def markdown2html(self, context, source):
            cell = context.get("cell", {})
            return markdown_to_html(source, attachments=cell.get("attachments", {}), embed_images=self.embed_images,
                                    path=context.get("resources", {}).get("metadata", {}).get("path", ""),
                                    anchor_link_text=self.anchor_link_text,
                                    exclude_anchor_links=self.exclude_anchor_links,
                                    **getattr(self, "lexer_options", {}))  # nbconvert >= 7.3

    return MathMLExporter(embed_images=True, template_file=_TEMPLATE,
                          extra_loaders=[jinja2.DictLoader({_TEMPLATE: _TEMPLATE_SOURCE})])


def _site_href(href: str, source_dir: Path, chapters_dir: Path, root: Path, out: Path) -> str:
    """Where a relative link of a chapter or docs page, written from `source_dir`, points from the site.

    A chapter notebook becomes its page, the docs/ files of DOCS their pages, and any
    other file (exercises/, README.md) a path relative to `out`, so it opens wherever the site is.
    """
    if re.match(r"([a-zA-Z][a-zA-Z0-9+.-]*:|#|/)", href) or not href:  # a URL, an anchor, an absolute path
        return href
    path, hash_mark, anchor = html.unescape(href).partition("#")
    target = (source_dir / path).resolve()
    if target.parent == chapters_dir.resolve() and target.match(CHAPTER_GLOB):
        return html.escape(f"{target.stem}.html{hash_mark}{anchor}")
    for name in DOCS:
        if target == (root / "docs" / f"{name}.md").resolve():
            return html.escape(f"{name}.html{hash_mark}{anchor}")
    return html.escape(_relative(target, out) + hash_mark + anchor)


def _relink(page: str, source_dir: Path, chapters_dir: Path, root: Path, out: Path) -> str:
    return re.sub(r'(<a\s[^>]*?href=")([^"]*)"',
                  lambda m: m.group(1) + _site_href(m.group(2), source_dir, chapters_dir, root, out) + '"', page)


def _nav(previous: Chapter | None, following: Chapter | None, where: str = "top") -> str:
    back = ahead = "<span></span>"  # keeps "index" centred at the first and the last chapter
    if previous:
        back = f'<a href="{previous.name}.html">&larr; {text_to_html(previous.title)}</a>'
    if following:
        ahead = f'<a href="{following.name}.html">{text_to_html(following.title)} &rarr;</a>'
    return f'<nav class="course-nav {where}">{back}<a href="index.html">index</a>{ahead}</nav>\n'


def markdown_page(path: Path, chapters_dir: Path, root: Path, out: Path) -> str:
    """A docs/*.md file as a standalone page (mistune, through nbconvert)."""
    text = path.read_text()
    title = next((line.lstrip("#").strip() for line in text.split("\n") if line.startswith("#")), path.stem)
    try:
        body = _relink(markdown_to_html(text), path.parent, chapters_dir, root, out)
    except FormulaError as e:
        raise FormulaError(f"{path}: {e}") from None
    return _standalone(title, f'<nav class="course-nav"><a href="index.html">index</a></nav>\n'
                              f'<main>{body}</main>')


def index_page(chapters: list[Chapter], built: set[str], out: Path, root: Path, executed: bool) -> str:
    """The table of contents: title, summary, time to execute, and links to the notebooks on disk."""
    rows = []
    for chapter in chapters:
        try:
            title, summary = text_to_html(chapter.title), text_to_html(chapter.summary)
        except FormulaError as e:
            raise FormulaError(f"{chapter.path}, its title or first paragraph (the index shows them): {e}") from None
        link = f'<a href="{chapter.name}.html">{title}</a>' if chapter.name in built else title
        notebooks = [root / folder / chapter.path.name for folder in ("exercises", "solutions")]
        notebooks = " · ".join(f'<a href="{_relative(path, out)}">{path.parent.name[:-1]}</a>'
                               for path in notebooks if path.is_file())
        rows.append(f"<tr><td>{link}<br><small>{summary}</small></td>"
                    f"<td>{_status(chapter, chapter.name in built, executed)}</td><td>{notebooks}</td></tr>")
    labels = (("benchmarks", "what GPUs measured"), ("design", "design notes"), ("glossary", "glossary and notation"))
    docs = [f'{label}: <a href="{name}.html">docs/{name}.md</a>' for name, label in labels
            if (out / f"{name}.html").is_file()]
    body = ("<h1>picotron: training LLMs with 5D parallelism, one chapter per technique</h1>\n"
            "<p>The chapters run on CPU ranks (gloo) standing in for GPUs; \"executed\" is how long each took "
            "on the machine that built this site. Exercise and solution notebooks open in Jupyter. "
            + " · ".join(docs) + "</p>\n"
            '<table><tr><th>chapter</th><th>executed</th><th>notebooks</th></tr>\n' + "\n".join(rows) + "</table>")
    return _standalone("picotron course", body)


def _status(chapter: Chapter, built: bool, executed: bool) -> str:
    if not built:
        return "not built"
    if chapter.error:
        return f'<span class="failed">failed: {html.escape(chapter.error)}</span>'
    if chapter.seconds is None:
        return "not executed" + ("" if executed else " (--no-execute)")
    seconds = chapter.seconds
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _relative(target: Path, out: Path) -> str:
    return Path(os.path.relpath(target.resolve(), out.resolve())).as_posix()


def _standalone(title: str, body: str) -> str:
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
{STYLE}<style>
body {{ margin: 0; font: 15px/1.5 sans-serif; color: #222; }}
main, h1, p, table {{ max-width: 1100px; margin-left: 24px; margin-right: 24px; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ddd; padding: 6px 10px; text-align: left; vertical-align: top; }}
pre {{ background: #f6f8fa; padding: 8px; overflow-x: auto; }}
.failed {{ color: #b91c1c; }}
a.anchor-link {{ visibility: hidden; text-decoration: none; padding-left: 0.2em; }}  /* the heading's ¶: on hover */
:is(h1, h2, h3, h4, h5, h6):hover > a.anchor-link {{ visibility: visible; }}
</style></head>
<body>
{body}
</body></html>
"""


# ---- the whole site ----------------------------------------------------------------------------
def build(root: Path, out: Path, chapters_dir: Path | None = None, only: list[str] | None = None,
          cell_timeout: float = 300, run: bool = True) -> list[Chapter]:
    """Write out/index.html, one page per chapter built, and the docs pages; return the chapters built."""
    chapters_dir = chapters_dir or root / "chapters"
    paths = find_chapters(chapters_dir, only)
    if importlib.util.find_spec("latex2mathml") is None:
        raise ValueError("the site writes its formulas as MathML with latex2mathml, which is not installed: "
                         "pip install -e '.[dev]' (or pip install 'latex2mathml>=3.66')")
    everything = [_read(path) for path in sorted(chapters_dir.glob(CHAPTER_GLOB))]  # bad input fails here
    for path in paths:  # and a formula that does not convert, before any chapter runs
        check_formulas(_load(path), path)
    out.mkdir(parents=True, exist_ok=True)
    for name in DOCS:
        source = root / "docs" / f"{name}.md"
        if source.is_file():
            (out / f"{name}.html").write_text(markdown_page(source, chapters_dir, root, out))
        else:
            print(f"warning: {source} not found; {name}.html is not written")

    records = _load_records(out)
    for chapter in everything:  # chapters not built now keep what the last build recorded
        chapter.seconds, chapter.error = records.get(chapter.name, (None, None))
    built = []
    for path in paths:
        chapter = next(c for c in everything if c.path == path)
        nb = _load(path)
        print(f"{chapter.name} ...", end=" ", flush=True)
        chapter.seconds, chapter.error = execute(nb, chapters_dir, cell_timeout) if run else (None, None)
        print(f"failed: {chapter.error}" if chapter.error else _status(chapter, True, run), flush=True)
        i = everything.index(chapter)
        neighbours = (everything[i - 1] if i > 0 else None, everything[i + 1] if i + 1 < len(everything) else None)
        (out / f"{chapter.name}.html").write_text(chapter_page(nb, chapter, *neighbours, root, out))
        records[chapter.name] = (chapter.seconds, chapter.error)
        built.append(chapter)

    (out / RECORDS).write_text(json.dumps(records, indent=1) + "\n")
    on_disk = {chapter.name for chapter in everything if (out / f"{chapter.name}.html").is_file()}
    (out / "index.html").write_text(index_page(everything, on_disk, out, root, run))
    return built


def _read(path: Path) -> Chapter:
    return Chapter(path, *title_and_summary(_load(path), fallback=path.stem))


def _load(path: Path):
    try:
        return nbformat.read(path, as_version=4)
    except (OSError, ValueError, nbformat.ValidationError) as e:  # NotJSONError is a ValueError
        raise ValueError(f"{path} is not a readable notebook ({str(e).splitlines()[0][:120]}); "
                         "restore it with git or fix its JSON") from None


def _load_records(out: Path) -> dict[str, tuple[float | None, str | None]]:
    try:
        return {name: tuple(value) for name, value in json.loads((out / RECORDS).read_text()).items()}
    except (OSError, ValueError, TypeError):  # no earlier build, or a file this code did not write
        return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picotron_course.site", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="repository root holding chapters/, docs/, exercises/ (default: .)")
    parser.add_argument("--out", help="folder to write the site to (default: ROOT/site)")
    parser.add_argument("--only", nargs="+", metavar="CHAPTER", help="only these chapters (e.g. 00_collectives or 00)")
    parser.add_argument("--chapters-dir", help="folder of NN_*.ipynb chapters (default: ROOT/chapters)")
    parser.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300, as nbval)")
    parser.add_argument("--no-execute", action="store_true", help="render the notebooks as they are, without outputs")
    args = parser.parse_args(argv)

    root = Path(args.root)
    out = Path(args.out) if args.out else root / "site"
    chapters_dir = Path(args.chapters_dir) if args.chapters_dir else None
    start = time.perf_counter()
    try:
        built = build(root, out, chapters_dir, args.only, args.cell_timeout, run=not args.no_execute)
    except ValueError as e:
        print(e)
        return 2
    failed = [chapter for chapter in built if chapter.error]
    print(f"built {len(built)} chapter(s) in {time.perf_counter() - start:.0f} s: {out / 'index.html'}")
    if failed:
        print(f"{len(failed)} chapter(s) failed: {', '.join(chapter.name for chapter in failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

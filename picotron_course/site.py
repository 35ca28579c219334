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

A chapter that fails still gets its page, which shows the error; the index marks it "failed"
and the command exits 1 once everything is built. Exercise and solution notebooks are linked,
not rendered: they are meant to be opened in Jupyter and worked in, and unexecuted they would
show nothing the chapter page does not.
"""

from __future__ import annotations

import argparse
import html
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
    """Markdown emphasis, code marks and links reduced to their text, for a one-line summary."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", markdown)
    return re.sub(r"[*_`]{1,3}(?=\S)|(?<=\S)[*_`]{1,3}", "", text)


def _shorten(text: str) -> str:
    if len(text) <= SUMMARY_CHARS:
        return text
    return text[:SUMMARY_CHARS].rsplit(" ", 1)[0].rstrip(",;:") + " …"


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
    from nbconvert import HTMLExporter

    resources = {"metadata": {"name": chapter.title, "path": str(chapter.path.parent)}}  # path: for embed_images
    page, _ = HTMLExporter(embed_images=True).from_notebook_node(nb, resources=resources)
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
        back = f'<a href="{previous.name}.html">&larr; {html.escape(previous.title)}</a>'
    if following:
        ahead = f'<a href="{following.name}.html">{html.escape(following.title)} &rarr;</a>'
    return f'<nav class="course-nav {where}">{back}<a href="index.html">index</a>{ahead}</nav>\n'


def markdown_page(path: Path, chapters_dir: Path, root: Path, out: Path) -> str:
    """A docs/*.md file as a standalone page (mistune, through nbconvert)."""
    from nbconvert.filters import markdown2html

    text = path.read_text()
    title = next((line.lstrip("#").strip() for line in text.split("\n") if line.startswith("#")), path.stem)
    body = _relink(markdown2html(text), path.parent, chapters_dir, root, out)
    return _standalone(title, f'<nav class="course-nav"><a href="index.html">index</a></nav>\n'
                              f'<main>{body}</main>')


def index_page(chapters: list[Chapter], built: set[str], out: Path, root: Path, executed: bool) -> str:
    """The table of contents: title, summary, time to execute, and links to the notebooks on disk."""
    rows = []
    for chapter in chapters:
        title = html.escape(chapter.title)
        link = f'<a href="{chapter.name}.html">{title}</a>' if chapter.name in built else title
        notebooks = [root / folder / chapter.path.name for folder in ("exercises", "solutions")]
        notebooks = " · ".join(f'<a href="{_relative(path, out)}">{path.parent.name[:-1]}</a>'
                               for path in notebooks if path.is_file())
        rows.append(f"<tr><td>{link}<br><small>{html.escape(chapter.summary)}</small></td>"
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
    everything = [_read(path) for path in sorted(chapters_dir.glob(CHAPTER_GLOB))]  # bad input fails here
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

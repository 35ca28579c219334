"""Course tooling from the command line.

    python -m picotron_course generate            # exercises/*.ipynb from solutions/*.ipynb
    python -m picotron_course generate 03_zero    # only exercises/03_zero.ipynb
    python -m picotron_course check               # exit 1 when exercises/ is out of date
    python -m picotron_course strip NOTEBOOK...   # remove outputs (--check: only report, exit 1 if dirty)
    python -m picotron_course grade NOTEBOOK      # run a learner's notebook, print the score table
    python -m picotron_course grade FOLDER --out grades.csv   # a class's submissions: grades.csv, answers.csv
    python -m picotron_course site                # execute the chapters, write the HTML course to site/
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

from picotron_course import exercises


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m picotron_course", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (("generate", "write exercises/ from solutions/"),
                       ("check", "exit 1 when exercises/ is not what `generate` would write")):
        command = commands.add_parser(name, help=text)
        command.add_argument("--root", default=".", help="repository root holding solutions/ (default: .)")
    commands.choices["generate"].add_argument("notebooks", nargs="*",
                                              help="only these assignments (e.g. 03_zero); default: all")
    strip = commands.add_parser("strip", help="remove outputs and execution counts from notebooks")
    strip.add_argument("notebooks", nargs="+")
    strip.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook has outputs")
    grade = commands.add_parser("grade", help="run notebooks and score the course's check cells in them")
    grade.add_argument("path", metavar="NOTEBOOK_OR_FOLDER",
                       help="a notebook, or a folder of FOLDER/<student>.ipynb or FOLDER/<student>/<NN_name>.ipynb")
    grade.add_argument("--assignment", help="the assignment, e.g. 00_collectives (default: from the file names)")
    grade.add_argument("--root", help="the course checkout holding exercises/ (default: this package's checkout)")
    grade.add_argument("--out", default="grades.csv",
                       help="with a folder: the CSV of results (default grades.csv); answers.csv goes beside it")
    grade.add_argument("--cell-timeout", type=_seconds("--cell-timeout 300"), default=300,
                       help="seconds per cell (default 300)")
    grade.add_argument("--timeout-per-notebook", default=None,
                       type=_seconds("--timeout-per-notebook 600, or leave the flag out for no limit"),
                       help="seconds a notebook may run before its kernel is killed (default: no limit)")
    commands.add_parser("site", help="execute the chapters and build the HTML course (site --help: its options)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["site"]:   # its own options (picotron_course.site parses them)
        from picotron_course import site as course_site  # imports nbconvert: only here
        return course_site.main(argv[1:])
    args = parser.parse_args(argv)

    if args.command in ("generate", "check") and not (Path(args.root) / exercises.SOLUTIONS).is_dir():
        print(f"no {exercises.SOLUTIONS}/ folder under {Path(args.root).resolve()}; run from the repository root "
              f"or pass --root")   # before generate creates exercises/ there
        return 2
    if args.command == "generate":
        try:
            changed = exercises.generate(args.root, only=args.notebooks or None)
        except (ValueError, OSError) as e:   # an unknown assignment, a solution marker out of place, a file
            print(e)
            return 2
        print("\n".join(f"wrote {path}" for path in changed) or "exercises/ is up to date")
        return 0
    if args.command == "check":
        try:
            problems = exercises.stale(args.root)
        except (ValueError, OSError) as e:
            print(e)
            return 2
        if problems:
            print("exercises/ is out of date; run `python -m picotron_course generate`:")
            print("\n".join(f"  {problem}" for problem in problems))
            return 1
        print("exercises/ is up to date")
        return 0
    if args.command == "strip":
        return _strip(args.notebooks, args.check)
    if args.command == "grade":
        return _grade(args)
    return 2


def _seconds(example: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number of seconds, else an error (argparse names the flag) saying
    what to give, e.g. `example`. A timeout of 0 or less would stop every notebook at once: all "timeout"."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds; give one, e.g. {example}")
        return value
    return parse


def _grade(args: argparse.Namespace) -> int:
    """One notebook: its table, exit 1 unless every check passed. A folder: the CSVs, a line per student."""
    from picotron_course import grade  # imports nbclient: only here
    path = Path(args.path)
    options = dict(assignment=args.assignment, root=args.root, cell_timeout=args.cell_timeout,
                   notebook_timeout=args.timeout_per_notebook)
    try:
        if path.is_dir():
            grade.grade_folder(path, args.out, **options)
            print(f"wrote {args.out} and {Path(args.out).with_name('answers.csv')}")
            return 0
        if not path.is_file():
            raise grade.GradeError(f"no such notebook or folder: {path}")
        graded = grade.grade(path, **options)
    except grade.GradeError as e:
        print(e)
        return 2
    print(grade.score_table(graded, title=f"grading {path} (assignment {graded.assignment})"))
    passed, total = graded.score
    return 0 if passed == total else 1


def _strip(paths: list[str], check_only: bool) -> int:
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        print("no such notebook: " + ", ".join(missing))
        return 2
    for path in paths:   # every file read before any is written
        try:
            exercises.strip_outputs(path, write=False)
        except Exception as e:  # noqa: BLE001 - nbformat raises many types for a file that is not a notebook
            said = (str(e).strip().splitlines() or [""])[0][:100]
            print(f"cannot read {path} as a notebook ({type(e).__name__}: {said}); is it the .ipynb file?")
            return 2
    dirty = [path for path in paths if exercises.strip_outputs(path, write=not check_only)]
    verb = "has outputs or session metadata:" if check_only else "stripped"
    print("\n".join(f"{verb} {path}" for path in dirty) or "all clean")
    return 1 if check_only and dirty else 0


if __name__ == "__main__":
    sys.exit(main())

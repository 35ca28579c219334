"""Course tooling from the command line.

    python -m picotron_course generate            # exercises/*.ipynb from solutions/*.ipynb
    python -m picotron_course generate 03_zero    # only exercises/03_zero.ipynb
    python -m picotron_course check               # exit 1 when exercises/ is out of date
    python -m picotron_course strip NOTEBOOK...   # remove outputs (--check: only report, exit 1 if dirty)
    python -m picotron_course grade NOTEBOOK      # run a learner's notebook, print the score table
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    grade = commands.add_parser("grade", help="run a notebook and print the score of its check cells")
    grade.add_argument("notebook")
    grade.add_argument("--cell-timeout", type=float, default=300, help="seconds per cell (default 300)")
    args = parser.parse_args(argv)

    if args.command == "generate":
        try:
            changed = exercises.generate(args.root, only=args.notebooks or None)
        except ValueError as e:
            print(e)
            return 2
        print("\n".join(f"wrote {path}" for path in changed) or "exercises/ is up to date")
        return 0
    if args.command == "check":
        problems = exercises.stale(args.root)
        if problems:
            print("exercises/ is out of date; run `python -m picotron_course generate`:")
            print("\n".join(f"  {problem}" for problem in problems))
            return 1
        print("exercises/ is up to date")
        return 0
    if args.command == "strip":
        return _strip(args.notebooks, args.check)
    if args.command == "grade":
        from picotron_course.grade import grade as run_grade, score_table  # imports nbclient: only here
        results = run_grade(args.notebook, cell_timeout=args.cell_timeout)
        print(score_table(results, title=f"grading {args.notebook}"))
        return 0 if all(r.passed for r in results if r.check) else 1
    return 2


def _strip(paths: list[str], check_only: bool) -> int:
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        print("no such notebook: " + ", ".join(missing))
        return 2
    dirty = [path for path in paths if exercises.strip_outputs(path, write=not check_only)]
    verb = "has outputs or session metadata:" if check_only else "stripped"
    print("\n".join(f"{verb} {path}" for path in dirty) or "all clean")
    return 1 if check_only and dirty else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every misconception a check declares fails that check, and the check names it: its hint is in the error.

A misconception is one record of picotron_course.engine: a wrong answer learners write and the hint they should
read. The check gives the hint of the first record whose mistake the answer reproduces, so a record the check
cannot see (it passes), or one the check takes for an earlier record (another hint), fails here.

Each check sees its records twice: in one launch for its hints (Check.hint, in the records' order) and in another
here (seen_apart, in the reverse order), and judges each record by the second. A record seen to do something else
in the other launch (what ran before it on the ranks changed what it did, or it varies from run to run) fails.
"""

import importlib
import pkgutil

import pytest

import picotron_course
from picotron_course import engine

for module in pkgutil.iter_modules(picotron_course.__path__):
    if module.name.startswith("checks"):
        importlib.import_module(f"picotron_course.{module.name}")

# Sorted: every xdist worker must collect the same tests in the same order, whatever imported a checks module first.
RECORDS = sorted(((check, misconception) for check in engine.CHECKS for misconception in check.misconceptions),
                 key=lambda record: (record[0].title, record[1].name))


APART: dict[int, list] = {}   # id(check): its records' observations


def seen_apart(check: engine.Check) -> list:
    """What each record of `check` does, seen in one launch of their own (per check, once), in the reverse of the
    order the check sees them in for its hints: a record must do the same whichever records ran before it on the
    ranks, since a learner's answer runs alone (the first and last records run first in one of the two launches)."""
    if id(check) not in APART:
        answers = [m.answer for m in reversed(check.misconceptions)]
        APART[id(check)] = check.observe(answers, check.cases)[::-1]
    return APART[id(check)]


@pytest.mark.parametrize("check, misconception", RECORDS, ids=[f"{c.title}:{m.name}" for c, m in RECORDS])
def test_each_misconception_fails_its_check_with_its_hint(check, misconception, capsys):
    if check.missing():
        pytest.skip(f"{check.title} runs on {', '.join(check.missing())}, not installed here")
    with pytest.raises(AssertionError) as error:
        check.judge(seen_apart(check)[check.misconceptions.index(misconception)])
    assert str(error.value).endswith(f"Hint: {misconception.hint}")
    out = capsys.readouterr().out
    assert "FAIL" in out and f"hint: {misconception.hint}" in out


def test_every_check_has_misconceptions_with_distinct_hints():
    for check in engine.CHECKS:
        hints = [m.hint for m in check.misconceptions]
        assert hints and len(set(hints)) == len(hints), check.title

"""Every misconception a check declares fails that check, and the check names it: its hint is in the error.

A misconception is one record of picotron_course.engine: a wrong answer learners write and the hint they should
read. The check gives the hint of the first record whose mistake the answer reproduces, so a record the check
cannot see (it passes), or one the check takes for an earlier record (another hint), fails here.
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


@pytest.mark.parametrize("check, misconception", RECORDS, ids=[f"{c.title}:{m.name}" for c, m in RECORDS])
def test_each_misconception_fails_its_check_with_its_hint(check, misconception, capsys):
    if check.missing():
        pytest.skip(f"{check.title} runs on {', '.join(check.missing())}, not installed here")
    with pytest.raises(AssertionError) as error:
        check(misconception.answer)
    assert str(error.value).endswith(f"Hint: {misconception.hint}")
    out = capsys.readouterr().out
    assert "FAIL" in out and f"hint: {misconception.hint}" in out


def test_every_check_has_misconceptions_with_distinct_hints():
    for check in engine.CHECKS:
        hints = [m.hint for m in check.misconceptions]
        assert hints and len(set(hints)) == len(hints), check.title

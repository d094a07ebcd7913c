"""The wrong-solution catalog (staff only): every entry applies to the reference, every problem has at
least three, and (slow) each one costs its own problem points and no other problem any."""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_grading import catalog
from cs336_grading import rubric as rubric_mod

REPO = Path(__file__).resolve().parents[1]
MIN_ENTRIES = 3


def test_catalog_applies_and_covers_every_problem():
    entries = catalog.load(REPO)  # raises CatalogError if an edit no longer applies exactly once
    problems = rubric_mod.load(REPO)["problems"]
    unknown = sorted({e.id for e in entries if e.problem not in problems})
    assert not unknown, f"catalog entries for problems the rubric does not have: {unknown}"
    counts = {p: sum(e.problem == p for e in entries) for p in problems}
    short = {p: n for p, n in counts.items() if n < MIN_ENTRIES}
    assert not short, f"problems with fewer than {MIN_ENTRIES} wrong solutions in the catalog: {short}"
    for e in entries:
        assert e.mistake and e.file.startswith(rubric_mod.PACKAGES), f"{e.id}: say the mistake and the file"
        specs = problems[e.problem]["functions"]
        assert any(spec.startswith(e.file + "::") for spec in specs), (
            f"{e.id}: {e.file} holds none of its functions"
        )


def test_an_entry_that_does_not_apply_is_refused(tmp_path):
    entry = catalog.WrongSolution("rope", "x", "y", "cs336_inference/layers.py", [("no such text", "z")])
    with pytest.raises(catalog.CatalogError, match="occurs 0 times"):
        entry.apply((REPO / entry.file).read_text())


@pytest.mark.slow
def test_every_wrong_solution_costs_its_own_problem_and_no_other():
    entries = catalog.load(REPO)
    verdicts = list(catalog.check(REPO, entries, workers=2))
    lines = catalog.summary(verdicts)
    (REPO / "runs").mkdir(exist_ok=True)
    (REPO / "runs" / "check_tests.txt").write_text("\n".join(lines) + "\n")  # the table, for the record
    assert all(v.ok for v in verdicts), "\n".join(line for line in lines if not line[0].islower())

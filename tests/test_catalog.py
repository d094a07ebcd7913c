"""The wrong-solution catalog (staff only): every entry applies to the reference, every problem has at
least three, the runner picks the graded tests an entry can affect, and (slow) each entry costs its own
problem points and no other problem any."""

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


FAKE_MODULE = """LIMIT = 3


def helper(x):
    return x + 1


def f(x, scale=2):
    \"\"\"Problem a.\"\"\"
    return helper(x) * scale


class C:
    def g(self, x):
        return x - LIMIT
"""


@pytest.mark.parametrize(
    "problem, find, replace, expected",
    [
        ("a", "return helper(x) * scale", "return helper(x) * scale + 1", True),  # inside its function
        ("a", "    return helper(x) * scale", "    # a comment\n    return helper(x) * scale", True),
        ("b", "return x - LIMIT", "return x + LIMIT", True),  # a method
        ("a", "LIMIT = 3", "LIMIT = 4", False),  # module-level code: every problem's tests may see it
        ("a", "return x + 1", "return x + 2", False),  # a helper its function calls
        ("a", "return x - LIMIT", "return x + LIMIT", False),  # another problem's function
        ("a", "scale=2", "scale=3", False),  # the signature
        ("a", "def f(", "def extra(y):\n    return y\n\n\ndef f(", False),  # a new module-level name
    ],
)
def test_only_an_edit_inside_its_own_problems_functions_is_confined(
    tmp_path, problem, find, replace, expected
):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(FAKE_MODULE)
    rubric = {"problems": {"a": {"functions": ["pkg/mod.py::f"]}, "b": {"functions": ["pkg/mod.py::C.g"]}}}
    entry = catalog.WrongSolution(problem, "x", "y", "pkg/mod.py", [(find, replace)])
    assert catalog.confined(tmp_path, entry, rubric) is expected


def test_a_confined_edit_runs_every_test_from_its_problems_first_one_on():
    order = [("t1", "b"), ("t2", "a"), ("t3", "c"), ("t4", "a"), ("t5", "b")]
    # t3 and t5 are other problems' tests, run after a's first test: state its wrong code leaves behind
    # (a shared fixture, a cache, the RNG) could cost them points, so they are checked too
    assert catalog.select(order, "a", confined=True) == ["t2", "t3", "t4", "t5"]
    assert catalog.select(order, "a", confined=False) == ["t1", "t2", "t3", "t4", "t5"]
    assert catalog.select(order, "a", confined=True, only_own=True) == ["t2", "t4"]


def relabeled_entry(entries: list[catalog.WrongSolution], rubric: dict) -> catalog.WrongSolution:
    """A confined catalog entry filed under another problem whose functions share its file: a leak."""
    for e in entries:
        for other, p in rubric["problems"].items():
            shares = other != e.problem and any(spec.startswith(e.file + "::") for spec in p["functions"])
            if shares and catalog.confined(REPO, e, rubric):
                return catalog.WrongSolution(other, f"really_{e.id}", e.mistake, e.file, e.edits)
    pytest.skip("no file holds the functions of two problems")


def test_an_entry_filed_under_the_wrong_problem_runs_every_graded_test():
    rubric = rubric_mod.load(REPO)
    leak = relabeled_entry(catalog.load(REPO), rubric)  # its edit is confined to its real problem's code
    assert not catalog.confined(REPO, leak, rubric), f"{leak.id} edits another problem's code"


@pytest.mark.slow
def test_a_leak_and_an_entry_that_no_longer_applies_are_reported():
    entries = catalog.load(REPO)
    leak = relabeled_entry(entries, rubric_mod.load(REPO))
    real = leak.name.removeprefix("really_").split("/")[0]  # the problem whose function it edits
    stale = catalog.WrongSolution(leak.problem, "stale", "gone", leak.file, [("no such text", "x")])
    verdicts = list(catalog.check(REPO, [leak, stale], workers=2))
    assert not verdicts[0].caught and verdicts[0].leaked == [real] and not verdicts[0].error, verdicts[0]
    lines = catalog.summary(verdicts)
    assert any(line.startswith(f"LEAKED {leak.id}: also cost {real}; tests/") for line in lines), lines
    assert verdicts[1].error and "occurs 0 times" in verdicts[1].error, verdicts[1]
    assert f"ERROR {stale.id}: CatalogError" in "\n".join(lines)


@pytest.mark.slow
def test_every_wrong_solution_costs_its_own_problem_and_no_other():
    entries = catalog.load(REPO)
    verdicts = list(catalog.check(REPO, entries, workers=2))
    lines = catalog.summary(verdicts)
    (REPO / "runs").mkdir(exist_ok=True)
    (REPO / "runs" / "check_tests.txt").write_text("\n".join(lines) + "\n")  # the table, for the record
    assert all(v.ok for v in verdicts), "\n".join(line for line in lines if not line[0].islower())

"""The catalog of wrong solutions: plausible student mistakes, each a small edit of the reference.

A graded test is as good as the wrong solutions it catches. Each entry of
assignments/staff/wrong_solutions/*.py (a list `WRONG` of dicts) names a problem, a mistake, a file
and one or more (find, replace) edits. `check` applies each entry to a copy of the reference package,
grades that copy as a submission and requires that exactly the entry's own problem loses points.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .grader import GradeError, run_graded
from .rubric import PACKAGES

CATALOG = "assignments/staff/wrong_solutions"


class CatalogError(ValueError):
    """An entry is malformed or no longer applies to the reference."""


@dataclass
class WrongSolution:
    problem: str
    name: str
    mistake: str
    file: str
    edits: list[tuple[str, str]]
    source: str = ""  # catalog file it came from

    @property
    def id(self) -> str:
        return f"{self.problem}/{self.name}"

    def apply(self, text: str) -> str:
        for find, replace in self.edits:
            count = text.count(find)
            if count != 1:
                raise CatalogError(f"{self.id}: {find!r} occurs {count} times in {self.file} (must be once)")
            text = text.replace(find, replace)
        return text


@dataclass
class Verdict:
    entry: WrongSolution
    lost: dict[str, tuple[float, float]] = field(default_factory=dict)  # problem -> (score, max) below max
    error: str = ""

    @property
    def caught(self) -> bool:
        return self.entry.problem in self.lost

    @property
    def leaked(self) -> list[str]:
        return [p for p in self.lost if p != self.entry.problem]

    @property
    def ok(self) -> bool:
        return self.caught and not self.leaked and not self.error


def load(repo: Path) -> list[WrongSolution]:
    """Every entry of the catalog, validated (fields, unique ids, edits that apply exactly once)."""
    entries, seen = [], set()
    for path in sorted((Path(repo) / CATALOG).glob("*.py")):
        namespace: dict = {}
        exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
        for raw in namespace.get("WRONG", []):
            raw = dict(raw)
            edits = raw.pop("edits", None) or [(raw.pop("find"), raw.pop("replace"))]
            raw.pop("find", None), raw.pop("replace", None)
            try:
                entry = WrongSolution(edits=[tuple(e) for e in edits], source=path.name, **raw)
            except TypeError as e:
                raise CatalogError(f"{path.name}: malformed entry {raw.get('name')!r}: {e}") from e
            if entry.id in seen:
                raise CatalogError(f"{path.name}: {entry.id} appears twice")
            seen.add(entry.id)
            entry.apply((Path(repo) / entry.file).read_text(encoding="utf-8"))
            entries.append(entry)
    return entries


def make_submission(repo: Path, entry: WrongSolution, dest: Path) -> Path:
    """A submission: the reference packages with the entry's edits applied."""
    for package in PACKAGES:
        shutil.copytree(Path(repo) / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = dest / entry.file
    target.write_text(entry.apply(target.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


def check_one(repo: Path, entry: WrongSolution, only_own: bool = False) -> Verdict:
    """Grade the reference with this one mistake planted; which problems lost points?"""
    with tempfile.TemporaryDirectory(prefix=f"wrong-{entry.problem}-") as tmp:
        submission = make_submission(repo, entry, Path(tmp))
        extra = [f"--problem={entry.problem}"] if only_own else None
        try:
            run = run_graded(
                repo, submission=submission, extra=extra, problems=[entry.problem] if only_own else None
            )
        except GradeError as e:
            return Verdict(entry, error=str(e))
    scores = run.problem_scores()
    if only_own:
        scores = {entry.problem: scores[entry.problem]}
    return Verdict(entry, {p: s for p, s in scores.items() if s[0] < s[1]})


def check(repo: Path, entries: list[WrongSolution], workers: int = 2, only_own: bool = False, progress=None):
    """check_one for every entry, `workers` grading runs at a time; yields verdicts as they finish."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(check_one, repo, entry, only_own) for entry in entries]
        for future in futures:
            verdict = future.result()
            if progress is not None:
                progress(verdict)
            yield verdict


def summary(verdicts: list[Verdict]) -> list[str]:
    """A table per problem (entries, caught by their own problem, leaked to another) and the failures."""
    problems: dict[str, list[Verdict]] = {}
    for v in verdicts:
        problems.setdefault(v.entry.problem, []).append(v)
    width = max([len("problem")] + [len(p) for p in problems])
    lines = [f"{'problem':<{width}}  entries  caught  leaked  kill rate"]
    for problem, vs in problems.items():
        caught, leaked = sum(v.caught for v in vs), sum(bool(v.leaked) for v in vs)
        lines.append(f"{problem:<{width}}  {len(vs):>7}  {caught:>6}  {leaked:>6}  {caught / len(vs):>9.0%}")
    total, killed = len(verdicts), sum(v.caught for v in verdicts)
    clean = sum(v.ok for v in verdicts)
    lines.append(
        f"CATALOG: {total} wrong solutions, {killed} caught by their own problem ({killed / max(total, 1):.0%}), "
        f"{clean} caught with no other problem losing points"
    )
    for v in verdicts:
        if v.error:
            lines.append(f"ERROR {v.entry.id}: {v.error}")
        elif not v.caught:
            lines.append(f"NOT CAUGHT {v.entry.id}: {v.entry.mistake}")
        elif v.leaked:
            lines.append(f"LEAKED {v.entry.id}: also cost {', '.join(v.leaked)}")
    return lines

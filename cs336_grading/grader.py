"""Run the graded tests in a pytest subprocess and score them against the rubric.

The tests, the reference outputs and the rubric are this checkout's (the staff copy); a submission
contributes only the functions that hold its solutions (`--submission`). The maximum is the rubric's
total, whatever the run collected: a graded test that did not run (its module failed to import, say)
scores 0 and says so.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from . import rubric as rubric_mod

TIMEOUT = 300.0  # seconds one graded test may run (the slowest reference test takes a few)


class GradeError(RuntimeError):
    """Grading itself could not run (bad arguments, pytest usage or internal error)."""


@dataclass
class GradedTest:
    nodeid: str
    problem: str
    points: float  # this case's share of its test function's points (from the rubric)
    outcome: str = "not run"  # passed, failed, error (setup/teardown), timeout, skipped, not run
    output: str = ""

    @property
    def score(self) -> float:
        return self.points if self.outcome == "passed" else 0


@dataclass
class GradeRun:
    rubric: dict
    tests: list[GradedTest] = field(default_factory=list)
    collection_errors: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, output)
    seconds: float = 0.0
    pytest_output: str = ""

    @property
    def score(self) -> float:
        return _round(sum((Fraction(str(t.score)) for t in self.tests), Fraction(0)))

    @property
    def max_score(self) -> float:
        return self.rubric["total"]

    def problem_scores(self) -> dict[str, tuple[float, float]]:
        """problem -> (score, max) in the rubric's order."""
        out = {}
        for name, entry in self.rubric["problems"].items():
            tests = [t for t in self.tests if t.problem == name]
            out[name] = (_round(sum((Fraction(str(t.score)) for t in tests), Fraction(0))), entry["points"])
        return out


def _round(x: Fraction) -> float:
    return int(x) if x.denominator == 1 else round(float(x), 2)


def fmt(x: float) -> str:
    """Points without a trailing .0: 5, 2.5, 0.33."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0")


def graded_files(repo: Path, rubric: dict, problems: list[str] | None = None) -> list[str]:
    """The test files that hold the rubric's graded tests (of these problems), for pytest's command line."""
    chosen = [p for name, p in rubric["problems"].items() if problems is None or name in problems]
    files = sorted({nodeid.split("::")[0] for p in chosen for nodeid in p["tests"]})
    return [f for f in files if (Path(repo) / f).is_file()] or ["tests"]


def run_graded(
    repo: Path,
    submission: Path | None = None,
    k: str | None = None,
    workers: int = 0,
    extra: list[str] | None = None,
    problems: list[str] | None = None,
    timeout: float | None = TIMEOUT,
) -> GradeRun:
    """Grade `submission` (default: the checkout's own code, as it is) with repo's graded tests and rubric.
    A graded test running past `timeout` seconds fails as "timeout" (None: no limit)."""
    repo = Path(repo).resolve()
    if not (repo / "tests").is_dir():
        raise GradeError(f"{repo} has no tests/ folder")
    if submission is not None and not Path(submission).is_dir():
        raise GradeError(f"--submission {submission} is not a folder")
    if workers and importlib.util.find_spec("xdist") is None:
        raise GradeError("-n needs pytest-xdist, which is not installed")
    try:
        rubric = rubric_mod.load(repo)
    except rubric_mod.RubricError as e:
        raise GradeError(str(e)) from e
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *graded_files(repo, rubric, problems),
            "-m",
            "graded",
            "-q",
            "--tb=short",
            "-p",
            "no:cacheprovider",
        ]
        cmd += ["--grade-report", str(report), "--continue-on-collection-errors"]
        cmd += ["--graded-timeout", str(timeout)] if timeout else []
        cmd += ["--submission", str(Path(submission).resolve())] if submission is not None else []
        cmd += ["-k", k] if k else []
        cmd += ["-n", str(workers)] if workers else []
        cmd += extra or []
        paths = [str(repo)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1"}
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        output = proc.stdout + proc.stderr
        # 0: all passed, 1: some failed, 5: nothing selected. Anything else means grading did not happen.
        if proc.returncode not in (0, 1, 5) or not report.exists():
            errors = [line for line in output.splitlines() if line.startswith("ERROR")]
            last = errors[-1] if errors else (output.strip().splitlines() or ["no output"])[-1]
            raise GradeError(f"pytest could not run the graded tests (exit status {proc.returncode}): {last}")
        data = json.loads(report.read_text())
    ran = {t["nodeid"]: t for t in data["tests"]}
    tests = []
    for name, entry in rubric["problems"].items():
        for nodeid, points in entry["tests"].items():
            t = GradedTest(nodeid, name, points)
            if nodeid in ran:
                t.outcome, t.output = ran[nodeid]["outcome"], ran[nodeid]["output"]
                if ran[nodeid]["problem"] != name:
                    raise GradeError(
                        f"{nodeid} is marked {ran[nodeid]['problem']!r} but the rubric says {name!r}"
                    )
            elif k is None:
                t.output = "this graded test did not run (see the collection errors)"
            tests.append(t)
    if k is not None or problems is not None:
        tests = [t for t in tests if t.nodeid in ran or (problems is not None and t.problem in problems)]
    return GradeRun(rubric, tests, [tuple(e) for e in data["collection_errors"]], seconds, output)


def results_json(run: GradeRun) -> dict:
    """Gradescope's results.json: a total score and one entry per test (name, score, max_score, output)."""
    tests = [
        {
            "name": f"{t.problem}: {t.nodeid}",
            "score": t.score,
            "max_score": t.points,
            "status": "passed" if t.outcome == "passed" else "failed",
            "output": t.output,
            "visibility": "visible",
        }
        for t in run.tests
    ]
    tests += [
        {
            "name": f"collection error: {nodeid}",
            "score": 0,
            "max_score": 0,
            "status": "failed",
            "output": output,
            "visibility": "visible",
        }
        for nodeid, output in run.collection_errors
    ]
    return {
        "score": run.score,
        "execution_time": round(run.seconds, 1),
        "output": "\n".join(summary_lines(run)),
        "visibility": "visible",
        "tests": tests,
    }


SHOWN_PER_PROBLEM = 3  # failing tests listed per problem (all of them are in results.json)


def summary_lines(run: GradeRun) -> list[str]:
    """A table per problem, then each problem's first few tests not passed (with the line that says
    why), and last the line 'TOTAL: <score> / <max>'."""
    scores = run.problem_scores()
    width = max([len("problem")] + [len(p) for p in scores])
    lines = [f"{'problem':<{width}}  {'tests passed':>12}  {'points':>13}"]
    for problem, (score, points) in scores.items():
        tests = [t for t in run.tests if t.problem == problem]
        passed = f"{sum(t.outcome == 'passed' for t in tests)}/{len(tests)}"
        lines.append(f"{problem:<{width}}  {passed:>12}  {fmt(score) + ' / ' + fmt(points):>13}")
    lines += [f"COLLECTION ERROR {nodeid}: {last_line(out)}" for nodeid, out in run.collection_errors]
    for problem in scores:
        bad = [t for t in run.tests if t.problem == problem and t.outcome != "passed"]
        reasons = {(t.outcome, last_line(t.output)) for t in bad}
        if len(bad) > 1 and len(reasons) == 1:  # e.g. a problem not started: one line, not one per test
            outcome, why = reasons.pop()
            lines.append(f"{outcome.upper()} all {len(bad)} tests of {problem}: {why}")
            continue
        shown = bad[:SHOWN_PER_PROBLEM]
        lines += [f"{t.outcome.upper()} {t.nodeid} ({problem}): {last_line(t.output)}" for t in shown]
        if len(bad) > len(shown):
            lines.append(f"... and {len(bad) - len(shown)} more of {problem} (results.json has them all)")
    lines.append(f"TOTAL: {fmt(run.score)} / {fmt(run.max_score)}")
    return lines


def last_line(text: str) -> str:
    """The line that says what went wrong: the first 'E   SomeError: ...' of pytest's report (its
    assertion message, not the diff pytest adds after it), else the last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    for line in lines:
        if line.startswith("E ") and "Error" in line.split(":", 1)[0]:
            return line
    return lines[-1] if lines else ""


def write_rubric(repo: Path, trace: bool = True) -> dict:
    """Collect the reference's graded tests (and, with trace, run them recording which problems each
    calls), write assignments/rubric.json and the handout's table of problems. Returns the rubric."""
    repo = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="rubric-") as tmp:
        collected, needs = Path(tmp) / "graded.json", Path(tmp) / "needs.json"
        cmd = [sys.executable, "-m", "pytest", "tests", "-m", "graded", "-q", "-p", "no:cacheprovider"]
        cmd += ["--collect-graded", str(collected)]
        cmd += ["--trace-needs", str(needs)] if trace else ["--collect-only"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
        if proc.returncode not in (0, 5) or not collected.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise GradeError(
                "the reference's graded tests must all pass to write the rubric:\n" + "\n".join(tail)
            )
        graded = json.loads(collected.read_text())
        traced = json.loads(needs.read_text()) if trace else None
    rubric = rubric_mod.build(repo, graded, traced)
    (repo / rubric_mod.RUBRIC).write_text(rubric_mod.dump(rubric), encoding="utf-8")
    handout = repo / rubric_mod.HANDOUT
    if rubric_mod.TABLE_BEGIN in handout.read_text(encoding="utf-8"):
        handout.write_text(
            rubric_mod.with_table(handout.read_text(encoding="utf-8"), rubric), encoding="utf-8"
        )
    return rubric

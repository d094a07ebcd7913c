"""Grade a checkout: run its graded tests and write Gradescope's results.json.

    python scripts/grade.py [--repo DIR] [--out results.json] [-k EXPR] [-n WORKERS]

Each test marked @pytest.mark.graded(problem=..., points=...) earns its points when it passes (setup,
call and teardown) and nothing otherwise; a skipped test (e.g. a CUDA test without a GPU) earns nothing.
pytest runs in a subprocess with its working directory and PYTHONPATH set to DIR, so DIR's package is the
one graded. This file is also the pytest plugin that records the outcomes in that subprocess.
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN = "cs336_grade_plugin"  # module name of this file inside the pytest subprocess
MAX_OUTPUT = 4000  # characters of failure output kept per test (the end, where the error is)


class GradeError(RuntimeError):
    """Grading itself could not run (bad arguments, pytest usage or internal error)."""


@dataclass
class GradedTest:
    nodeid: str
    problem: str
    points: float
    outcome: str = "passed"  # passed, failed, error (setup/teardown), skipped
    output: str = ""
    index: int = 0  # position in collection order (xdist reports arrive in any order)

    @property
    def score(self) -> float:
        return self.points if self.outcome == "passed" else 0


@dataclass
class GradeRun:
    tests: list[GradedTest] = field(default_factory=list)
    collection_errors: list[tuple[str, str]] = field(default_factory=list)  # (nodeid, output)
    seconds: float = 0.0
    pytest_output: str = ""

    @property
    def score(self) -> float:
        return sum(t.score for t in self.tests)

    @property
    def max_score(self) -> float:
        return sum(t.points for t in self.tests)


def fmt(x: float) -> str:
    """Points without a trailing .0: 5, 2.5."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _number(x: float) -> float:
    return int(x) if float(x).is_integer() else x


# ----------------------------------------------------------------------------------------------------
# Running pytest


def run_graded(repo: Path, k: str | None = None, workers: int = 0) -> GradeRun:
    """Run the graded tests of repo/tests in a pytest subprocess and collect one result per test."""
    repo = Path(repo).resolve()
    if not (repo / "tests").is_dir():
        raise GradeError(f"{repo} has no tests/ folder")
    if workers and importlib.util.find_spec("xdist") is None:
        raise GradeError("-n needs pytest-xdist, which is not installed")
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        shutil.copyfile(__file__, Path(tmp) / f"{PLUGIN}.py")
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pytest", "tests", "-m", "graded", "-q", "--tb=short"]
        cmd += ["-p", PLUGIN, "--grade-report", str(report), "-p", "no:cacheprovider"]
        cmd += ["--continue-on-collection-errors"]
        cmd += ["-k", k] if k else []
        cmd += ["-n", str(workers)] if workers else []
        paths = [str(repo), tmp] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
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
    tests = sorted((GradedTest(**t) for t in data["tests"]), key=lambda t: t.index)
    return GradeRun(tests, [tuple(e) for e in data["collection_errors"]], seconds, output)


# ----------------------------------------------------------------------------------------------------
# Reporting


def results_json(run: GradeRun) -> dict:
    """Gradescope's results.json: a total score and one entry per test (name, score, max_score, output)."""
    tests = [
        {
            "name": f"{t.problem}: {t.nodeid}",
            "score": _number(t.score),
            "max_score": _number(t.points),
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
        "score": _number(run.score),
        "execution_time": round(run.seconds, 1),
        "output": "\n".join(summary_lines(run)),
        "visibility": "visible",
        "tests": tests,
    }


def summary_lines(run: GradeRun) -> list[str]:
    """Problems not passed, a table per problem, and last the line 'TOTAL: <score> / <max>'."""
    lines = [f"COLLECTION ERROR {nodeid}: {_last_line(out)}" for nodeid, out in run.collection_errors]
    lines += [
        f"{t.outcome.upper()} {t.nodeid} ({t.problem}): {_last_line(t.output)}"
        for t in run.tests
        if t.outcome != "passed"
    ]
    problems: dict[str, list[GradedTest]] = {}
    for t in run.tests:
        problems.setdefault(t.problem, []).append(t)
    width = max([len("problem")] + [len(p) for p in problems])
    lines.append(f"{'problem':<{width}}  {'tests passed':>12}  {'points':>11}")
    for problem, tests in problems.items():
        passed = f"{sum(t.outcome == 'passed' for t in tests)}/{len(tests)}"
        points = f"{fmt(sum(t.score for t in tests))} / {fmt(sum(t.points for t in tests))}"
        lines.append(f"{problem:<{width}}  {passed:>12}  {points:>11}")
    lines.append(f"TOTAL: {fmt(run.score)} / {fmt(run.max_score)}")
    return lines


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parents[1]
    parser.add_argument("--repo", type=Path, default=here, help="checkout to grade (default: this one)")
    parser.add_argument("--out", type=Path, default=Path("results.json"), help="where to write results.json")
    parser.add_argument("-k", default=None, help="only run graded tests matching this pytest -k expression")
    parser.add_argument("-n", type=int, default=0, help="pytest-xdist workers (0: none)")
    args = parser.parse_args(argv)
    try:
        if not args.repo.is_dir():
            raise GradeError(f"--repo {args.repo} is not a folder")
        run = run_graded(args.repo, k=args.k, workers=args.n)
        args.out.write_text(json.dumps(results_json(run), indent=2) + "\n")
    except (GradeError, OSError) as e:
        print(f"grade: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(run)))
    return 0


# ----------------------------------------------------------------------------------------------------
# The pytest plugin (loaded as `-p cs336_grade_plugin` inside the subprocess; also in xdist workers)


def pytest_addoption(parser):
    parser.addoption("--grade-report", default=None, help="write graded test outcomes to this JSON file")


def _graded(item) -> tuple[str, float] | None:
    import pytest

    marker = item.get_closest_marker("graded")
    if marker is None:
        return None
    problem, points = marker.kwargs.get("problem"), marker.kwargs.get("points")
    if not isinstance(problem, str) or isinstance(points, bool) or not isinstance(points, int | float):
        raise pytest.UsageError(f"{item.nodeid}: write @pytest.mark.graded(problem=..., points=...)")
    return problem, points


def pytest_collection_modifyitems(config, items):
    # Runs where the items are collected (the xdist workers, if any); reports carry user_properties back.
    for index, item in enumerate(items):
        graded = _graded(item)
        if graded is not None:
            item.user_properties.append(("graded", [*graded, index]))


_RESULTS: dict[str, GradedTest] = {}
_COLLECTION_ERRORS: list[tuple[str, str]] = []
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 2}


def pytest_collectreport(report):
    if report.failed:
        _COLLECTION_ERRORS.append((report.nodeid, report.longreprtext[-MAX_OUTPUT:]))


def pytest_runtest_logreport(report):
    graded = dict(report.user_properties).get("graded")
    if graded is None:
        return
    problem, points, index = graded
    result = _RESULTS.setdefault(report.nodeid, GradedTest(report.nodeid, problem, points, index=index))
    if report.failed:
        outcome, text = ("failed" if report.when == "call" else "error"), report.longreprtext
    elif report.skipped and hasattr(report, "wasxfail"):
        outcome, text = "failed", f"expected to fail (xfail): {report.wasxfail}"
    elif report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        outcome, text = "skipped", reason
    else:
        return
    if _RANK[outcome] > _RANK[result.outcome]:
        result.outcome = outcome
    text = "\n".join(line for line in text.splitlines() if not line.startswith("[gw"))  # xdist's header
    result.output = (result.output + "\n" + text).strip()[-MAX_OUTPUT:]


def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--grade-report")
    if path is None or hasattr(session.config, "workerinput"):  # only the controller writes
        return
    tests = [vars(t) for t in _RESULTS.values()]
    Path(path).write_text(json.dumps({"tests": tests, "collection_errors": _COLLECTION_ERRORS}))


if __name__ == "__main__":
    sys.exit(main())

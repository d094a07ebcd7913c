"""The pytest side of grading (registered by tests/conftest.py).

- checks every `graded` marker reads graded(problem=<name>, points=<positive number>);
- `--submission DIR`: each graded test of problem P runs with DIR's functions for P swapped into the
  reference (cs336_grading.submission); without it the tests run whatever package is imported;
- `--grade-report FILE`: writes one outcome per graded test case (the controller, under xdist too);
- `--collect-graded FILE`: writes the collected graded cases (nodeid, problem, points), for the rubric;
- `--problem NAME` (repeatable): runs only that problem's graded tests (`pytest --problem rope`);
- `--trace-needs FILE`: records which problems' functions each graded test calls (for the rubric);
- graded tests marked `costly(seconds=...)` (seconds each, where the rest take milliseconds) run first,
  the longest first, in every run: the staff's wrong-solution catalog grades in this order and skips
  every test before an entry's own problem, so they run only for their own entries;
- `--graded-timeout SECONDS`: a graded test still running after that long is stopped and counts as
  failed ("timeout"), so an infinite loop costs its own problem's points and the rest is still graded.
  (A SIGALRM in the test's thread: Python code is stopped at once, a long C call when it returns.)
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from . import rubric as rubric_mod
from .submission import Submission, SubmissionError, reference_function

MAX_OUTPUT = 4000  # characters of failure output kept per test (the end, where the error is)
_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 2, "timeout": 3}


class GradedTestTimeout(Exception):
    """Raised inside a graded test that runs past --graded-timeout."""


@contextmanager
def time_limit(seconds: float | None, nodeid: str):
    """Raise GradedTestTimeout in this thread after `seconds` (None, or no SIGALRM here: no limit)."""
    if (
        not seconds
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def stop(signum, frame):
        raise GradedTestTimeout(f"ran past {seconds:g} s, the time limit of a graded test ({nodeid})")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pytest_addoption(parser):
    group = parser.getgroup("cs336 grading")
    group.addoption("--submission", default=None, help="grade this checkout's functions, problem by problem")
    group.addoption("--grade-report", default=None, help="write graded test outcomes to this JSON file")
    group.addoption(
        "--collect-graded", default=None, help="write the collected graded cases to this JSON file"
    )
    group.addoption("--problem", action="append", default=None, help="run only this problem's graded tests")
    group.addoption(
        "--trace-needs", default=None, help="write the problems each graded test calls to this file"
    )
    group.addoption(
        "--graded-timeout", type=float, default=None, help="seconds a graded test may run (default: no limit)"
    )


def _cost_rank(item) -> float:
    """Sort key: minus the seconds of a test marked costly(seconds=...), 0 for any other test."""
    marker = item.get_closest_marker("costly")
    if marker is None:
        return 0.0
    seconds = marker.kwargs.get("seconds")
    if marker.args or set(marker.kwargs) != {"seconds"} or not isinstance(seconds, int | float):
        raise pytest.UsageError(f"{item.nodeid}: write the marker as @pytest.mark.costly(seconds=...)")
    return -float(seconds)


def graded_marker(item) -> tuple[str, float] | None:
    """(problem, points) of a graded test; pytest.UsageError for a malformed marker."""
    marker = item.get_closest_marker("graded")
    if marker is None:
        return None
    where = item.nodeid
    if marker.args or set(marker.kwargs) != {"problem", "points"}:
        raise pytest.UsageError(f"{where}: write the marker as @pytest.mark.graded(problem=..., points=...)")
    problem, points = marker.kwargs["problem"], marker.kwargs["points"]
    if not isinstance(problem, str) or not problem.isidentifier():
        raise pytest.UsageError(f"{where}: the problem must be a name, got {problem!r}")
    if isinstance(points, bool) or not isinstance(points, int | float) or points <= 0:
        raise pytest.UsageError(f"{where}: points must be a positive number, got {points!r}")
    return problem, points


class GradingPlugin:
    def __init__(self, config):
        self.config = config
        submission = config.getoption("--submission")
        self.submission = Submission(submission) if submission else None
        self.trace_path = config.getoption("--trace-needs")
        self._rubric = None
        self.results: dict[str, dict] = {}
        self.collection_errors: list[tuple[str, str]] = []
        self.needs: dict[str, set[str]] = {}
        self._active = {}
        self._codes = None

    @property
    def rubric(self) -> dict:
        if self._rubric is None:
            self._rubric = rubric_mod.load(Path(self.config.rootpath))
        return self._rubric

    # ---------------------------------------------------------------- collection
    def pytest_ignore_collect(self, collection_path, config):
        """With --problem, a test file that holds none of those problems' graded tests (by the rubric)
        is not even imported: a student's loop on one problem takes a second, not the whole suite's
        collection."""
        only = config.getoption("--problem")
        if not only or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
            return None
        keep = {name for value in only for name in value.split(",")}
        files = {
            test.split("::")[0]
            for name, problem in self.rubric.get("problems", {}).items()
            if name in keep
            for test in problem.get("tests", {})
        }
        if not files:
            return None  # an unknown problem: collect as usual, so the usual message says so
        relative = collection_path.relative_to(Path(config.rootpath)).as_posix()
        return True if relative not in files else None

    def pytest_collection_modifyitems(self, config, items):
        only = config.getoption("--problem")
        if only:
            keep = {name for value in only for name in value.split(",")}
            chosen = [item for item in items if (graded_marker(item) or ("",))[0] in keep]
            config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
            items[:] = chosen
        items.sort(key=_cost_rank)  # stable: the costly ones first, the longest first
        collected = []
        for index, item in enumerate(items):
            graded = graded_marker(item)
            if graded is not None:
                item.user_properties.append(("graded", [*graded, index]))
                collected.append({"nodeid": item.nodeid, "problem": graded[0], "points": graded[1]})
        path = config.getoption("--collect-graded")
        if path and not hasattr(config, "workerinput"):
            Path(path).write_text(json.dumps(collected))

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append((report.nodeid, report.longreprtext[-MAX_OUTPUT:]))

    # ---------------------------------------------------------------- running one graded test
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        graded = graded_marker(item)
        if graded is None:
            return
        if self.trace_path:
            self._start_trace(item.nodeid)
        if self.submission is not None:
            problem = graded[0]
            entry = self.rubric["problems"].get(problem)
            if entry is None:
                pytest.fail(f"problem {problem!r} is not in the rubric", pytrace=False)
            context = self.submission.use(entry["functions"])
            try:
                context.__enter__()
            except SubmissionError as e:
                pytest.fail(str(e), pytrace=False)
            self._active[item.nodeid] = context

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_teardown(self, item):
        yield
        context = self._active.pop(item.nodeid, None)
        if context is not None:
            context.__exit__(None, None, None)
        if self.trace_path:
            sys.setprofile(None)
            threading.setprofile(None)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        if graded_marker(item) is None:
            yield
            return
        with time_limit(self.config.getoption("--graded-timeout"), item.nodeid):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.excinfo is not None and call.excinfo.errisinstance(GradedTestTimeout):
            outcome.get_result().user_properties.append(("timeout", str(call.excinfo.value)))

    def _start_trace(self, nodeid: str) -> None:
        if self._codes is None:  # code object -> problem, from the solution blocks (not the rubric)
            self._codes = {}
            for problem, specs in rubric_mod.solution_functions(Path(self.config.rootpath)).items():
                for spec in specs:
                    self._codes[reference_function(spec).__code__] = problem
        codes = self._codes
        called = self.needs.setdefault(nodeid, set())

        def profile(frame, event, arg):
            if event == "call":
                problem = codes.get(frame.f_code)
                if problem is not None:
                    called.add(problem)

        sys.setprofile(profile)
        threading.setprofile(profile)  # and threads the test starts (Part 8's simulated ranks)

    # ---------------------------------------------------------------- reporting (controller only)
    def pytest_runtest_logreport(self, report):
        graded = dict(report.user_properties).get("graded")
        if graded is None:
            return
        problem, points, index = graded
        new = {"nodeid": report.nodeid, "problem": problem, "points": points, "index": index}
        result = self.results.setdefault(report.nodeid, {**new, "outcome": "passed", "output": ""})
        timeout = dict(report.user_properties).get("timeout")
        if report.failed and timeout is not None:
            outcome, text = "timeout", timeout
        elif report.failed:
            outcome, text = ("failed" if report.when == "call" else "error"), report.longreprtext
        elif report.skipped and hasattr(report, "wasxfail"):
            outcome, text = "failed", f"expected to fail (xfail): {report.wasxfail}"
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            outcome, text = "skipped", reason
        else:
            return
        if _RANK[outcome] > _RANK[result["outcome"]]:
            result["outcome"] = outcome
        text = "\n".join(line for line in text.splitlines() if not line.startswith("[gw"))  # xdist's header
        result["output"] = (result["output"] + "\n" + text).strip()[-MAX_OUTPUT:]

    def pytest_sessionfinish(self, session, exitstatus):
        if hasattr(session.config, "workerinput"):
            return
        path = session.config.getoption("--grade-report")
        if path is not None:
            report = {"tests": list(self.results.values()), "collection_errors": self.collection_errors}
            Path(path).write_text(json.dumps(report))
        if self.trace_path:
            Path(self.trace_path).write_text(json.dumps({k: sorted(v) for k, v in self.needs.items()}))


def pytest_configure(config):
    config.pluginmanager.register(GradingPlugin(config), "cs336_grading")

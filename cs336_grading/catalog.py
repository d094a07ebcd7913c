"""The catalog of wrong solutions: plausible student mistakes, each a small edit of the reference.

A graded test is as good as the wrong solutions it catches. Each entry of
assignments/staff/wrong_solutions/*.py (a list `WRONG` of dicts) names a problem, a mistake, a file
and one or more (find, replace) edits. `check` applies each entry to a copy of the reference package,
grades that copy as a submission and requires that exactly the entry's own problem loses points.

How `check` runs: one runner process (`python -m cs336_grading.catalog JOBS`) imports torch, pytest and
the graded test modules once, grades the unedited reference in a forked child (every graded test must
pass; the modules that run imported lazily, transformers say, are then imported by the runner too) and
forks one child per entry, `workers` at a time. A child restores the torch RNG state of a fresh run and
runs pytest on the graded tests with the edited copy as --submission, as `grader.run_graded` would.

Which graded tests a child runs (`select`): the grader swaps a problem's functions in only while that
problem's tests run, so an edit that changes nothing but the bodies of its own problem's functions
(`confined`) leaves every test before that problem's first graded test exactly as in the reference
run, where it passed. Those are skipped; every graded test from there on runs, whatever its problem,
since the wrong code may leave state behind (a shared fixture, a cache, the RNG). An edit anywhere else
(module-level code, a signature, a helper, another problem's function) runs every graded test.
The grading plugin runs the graded tests marked `costly` first (the reference run and the children
alike, as `scripts/grade.py` does), so a confined entry of another problem skips them: the sampled
tree-verification tests, which take seconds, run only for their own problem's entries.
"""

from __future__ import annotations

import ast
import dataclasses
import gc
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .grader import TIMEOUT as GRADED_TIMEOUT
from .grader import GradedTest, GradeError, GradeRun, graded_files, last_line
from .rubric import PACKAGES
from .rubric import load as load_rubric
from .submission import split_spec

CATALOG = "assignments/staff/wrong_solutions"
TIMEOUT = 300.0  # seconds one entry's grading may take before it counts as an error
RUNNER = "cs336_grading.catalog"


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
    failed: dict[str, list[str]] = field(default_factory=dict)  # problem -> ["nodeid (outcome): last line"]
    tests: int = 0  # graded tests run
    seconds: float = 0.0

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


def make_submission(repo: Path, entry: WrongSolution | None, dest: Path) -> Path:
    """A submission: the reference packages with the entry's edits applied (None: unedited)."""
    for package in PACKAGES:
        shutil.copytree(Path(repo) / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    if entry is not None:
        target = dest / entry.file
        target.write_text(entry.apply(target.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


# ---------------------------------------------------------------------- which graded tests an entry runs
def confined(repo: Path, entry: WrongSolution, rubric: dict) -> bool:
    """Whether the entry changes nothing but the bodies of its own problem's functions (compared as
    syntax trees: comments and blank lines do not count, a signature, a decorator or a new name does)."""
    specs = map(split_spec, rubric["problems"][entry.problem]["functions"])
    own = [qualname for rel, qualname in specs if rel == entry.file]
    text = (Path(repo) / entry.file).read_text(encoding="utf-8")
    try:
        before, after = ast.parse(text), ast.parse(entry.apply(text))
    except SyntaxError:
        return False
    return _hollowed(before, own) == _hollowed(after, own)


def _hollowed(tree: ast.Module, qualnames: list[str]) -> str:
    """The tree's dump with the bodies of these functions ('name' or 'Class.name') replaced by `pass`."""
    defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for qualname in qualnames:
        node = tree
        for name in qualname.split("."):
            node = next((n for n in node.body if isinstance(n, defs) and n.name == name), None)
            if node is None:
                break
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node.body = [ast.Pass()]
    return ast.dump(tree)


def select(order: list[tuple[str, str]], problem: str, confined: bool, only_own: bool = False) -> list[str]:
    """The graded tests an entry of `problem` runs, from `order`: (nodeid, problem) in the reference
    run's order. Its own problem's tests only (`only_own`: no check for leaks); else, for a confined
    edit, every test from its problem's first one on; else every test."""
    if only_own:
        return [nodeid for nodeid, p in order if p == problem]
    first = next((i for i, (_, p) in enumerate(order) if p == problem), 0) if confined else 0
    return [nodeid for nodeid, _ in order[first:]]


# ---------------------------------------------------------------------- checking entries
def check(
    repo: Path,
    entries: list[WrongSolution],
    workers: int = 2,
    only_own: bool = False,
    progress=None,
    every_test: bool = False,
    timeout: float = TIMEOUT,
):
    """Grade every entry (see the module docstring), `workers` at a time; yields the verdicts in the
    entries' order. `every_test` runs every graded test for every entry (no selection). GradeError when
    nothing can be judged (the reference itself loses points, say)."""
    entries = list(entries)
    if not entries:
        return
    repo = Path(repo).resolve()
    with tempfile.TemporaryDirectory(prefix="catalog-") as tmp:
        jobs, log = Path(tmp) / "jobs.json", Path(tmp) / "runner.log"
        jobs.write_text(
            json.dumps(
                {
                    "repo": str(repo),
                    "workers": max(1, workers),
                    "only_own": only_own,
                    "every_test": every_test,
                    "timeout": timeout,
                    "entries": [dataclasses.asdict(e) for e in entries],
                }
            )
        )
        paths = [str(repo)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONDONTWRITEBYTECODE": "1"}
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", RUNNER, str(jobs)],
                cwd=repo,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,  # its own process group: killed as one if we stop early
            )
        try:
            done, following = {}, 0
            for line in proc.stdout:
                message = json.loads(line)
                if "fatal" in message:
                    raise GradeError(message["fatal"])
                done[message["index"]] = _verdict(entries[message["index"]], message)
                while following in done:
                    verdict = done.pop(following)
                    following += 1
                    if progress is not None:
                        progress(verdict)
                    yield verdict
            proc.wait()
            if following < len(entries):
                tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-10:])
                raise GradeError(
                    f"the catalog runner stopped (exit status {proc.returncode}) after {following} of "
                    f"{len(entries)} entries:\n{tail}"
                )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            proc.stdout.close()


def _verdict(entry: WrongSolution, message: dict) -> Verdict:
    lost = {p: tuple(s) for p, s in message.get("lost", {}).items()}
    keys = ("error", "failed", "tests", "seconds")
    return Verdict(entry, lost, **{k: message[k] for k in keys if k in message})


def check_one(repo: Path, entry: WrongSolution, only_own: bool = False) -> Verdict:
    """Grade the reference with this one mistake planted; which problems lost points?"""
    return next(check(repo, [entry], workers=1, only_own=only_own))


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
            continue
        if not v.caught:
            lines.append(f"NOT CAUGHT {v.entry.id}: {v.entry.mistake} (its problem's tests all passed)")
        if v.leaked:
            first = next((f"; {v.failed[p][0]}" for p in v.leaked if v.failed.get(p)), "")
            lines.append(f"LEAKED {v.entry.id}: also cost {', '.join(v.leaked)}{first}")
    return lines


# ---------------------------------------------------------------------- the runner process
class _Fatal(Exception):
    """Nothing can be judged."""


@dataclass
class _Job:
    index: int  # -1: the unedited reference
    entry: WrongSolution | None
    folder: Path
    keep: list[str] | None  # the graded tests it runs (None: all)
    pid: int = 0
    status: int = 0  # as os.waitpid gives it
    started: float = 0.0
    timed_out: bool = False


class _Keep:
    """A pytest plugin for a child: run only these graded tests, in the usual order."""

    def __init__(self, nodeids: list[str]):
        self.nodeids = set(nodeids)

    def pytest_collection_modifyitems(self, config, items):
        kept = [item for item in items if item.nodeid in self.nodeids]
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in self.nodeids])
        items[:] = kept


class _Runner:
    def __init__(self, jobs: dict, send):
        import pytest
        import torch

        self.pytest, self.torch, self.send = pytest, torch, send
        self.repo = Path(jobs["repo"])
        self.workers, self.timeout = jobs["workers"], jobs["timeout"]
        self.only_own, self.every_test = jobs["only_own"], jobs["every_test"]
        self.entries = [
            WrongSolution(**{**e, "edits": list(map(tuple, e["edits"]))}) for e in jobs["entries"]
        ]
        self.rubric = load_rubric(self.repo)
        self.args = [*graded_files(self.repo, self.rubric), "-m", "graded", "-q", "--tb=short"]
        self.args += ["--graded-timeout", str(GRADED_TIMEOUT)]  # a wrong solution that loops costs one test
        self.args += ["-p", "no:cacheprovider", "--continue-on-collection-errors"]
        torch.set_num_threads(1)  # as tests/conftest.py does; no thread pool may exist when we fork
        pytest.main([*self.args, "--collect-only"])  # imports conftest and the test modules, here, once
        self.rng = torch.get_rng_state()  # a fresh run's state when its first test starts

    def run(self, tmp: Path) -> None:
        reference = _Job(-1, None, tmp / "reference", None)
        self._start(reference, modules=tmp / "modules.txt")
        self._wait({reference.pid: reference})
        result = self._finish(reference)
        if result.get("error") or result["lost"]:
            failed = [line for lines in result.get("failed", {}).values() for line in lines]
            why = result.get("error") or "; ".join(failed[:5])
            raise _Fatal(f"the reference itself does not earn every point, so no entry can be judged: {why}")
        ran = json.loads((reference.folder / "report.json").read_text())["tests"]
        order = [(t["nodeid"], t["problem"]) for t in sorted(ran, key=lambda t: t["index"])]
        for name in (tmp / "modules.txt").read_text().split():
            try:
                importlib.import_module(name)  # what the tests imported lazily, imported once here
            except Exception:  # a module that imports only in its context; the children will, or not
                pass
        gc.collect()
        gc.freeze()  # the children's garbage collections skip everything made so far
        pending = list(enumerate(self.entries))
        running: dict[int, _Job] = {}
        while pending or running:
            while pending and len(running) < self.workers:
                index, entry = pending.pop(0)
                job = _Job(index, entry, tmp / f"entry{index}", None)
                try:
                    if self.only_own or not self.every_test:
                        narrow = confined(self.repo, entry, self.rubric)
                        job.keep = select(order, entry.problem, narrow, self.only_own)
                    self._start(job)
                except Exception as e:  # the edit no longer applies, an unknown problem: this entry's error
                    self._send(job, {"error": f"{type(e).__name__}: {e}"})
                    continue
                running[job.pid] = job
            job = self._wait(running)
            self._send(job, self._finish(job))

    def _send(self, job: _Job, result: dict) -> None:
        self.send(json.dumps({"index": job.index, **result}) + "\n")
        shutil.rmtree(job.folder, ignore_errors=True)

    def _start(self, job: _Job, modules: Path | None = None) -> None:
        job.folder.mkdir(parents=True)
        submission = make_submission(self.repo, job.entry, job.folder / "submission")
        args = [*self.args, "--grade-report", str(job.folder / "report.json")]
        args += ["--submission", str(submission)]
        sys.stdout.flush(), sys.stderr.flush()
        job.started = time.perf_counter()
        job.pid = os.fork()
        if job.pid == 0:  # the child: grade, then leave without running the runner's exit handlers
            code = 70
            try:
                out = os.open(job.folder / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(out, 1), os.dup2(out, 2)
                self.torch.set_rng_state(self.rng)
                before = set(sys.modules)
                code = int(self.pytest.main(args, plugins=[] if job.keep is None else [_Keep(job.keep)]))
                if modules is not None:
                    modules.write_text("\n".join(sorted(set(sys.modules) - before)))
            except BaseException:  # reported through the exit status and the output
                traceback.print_exc()
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(code)

    def _wait(self, running: dict[int, _Job]) -> _Job:
        """The next child to end, taken out of `running` (any that runs past the timeout is killed)."""
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in running:
                running[pid].status = status
                return running.pop(pid)
            now = time.perf_counter()
            for job in running.values():
                if not job.timed_out and now - job.started > self.timeout:
                    job.timed_out = True
                    os.kill(job.pid, signal.SIGKILL)
            time.sleep(0.02)

    def _finish(self, job: _Job) -> dict:
        """What the ended child's grade report says: problems below their maximum, failing tests."""
        seconds = round(time.perf_counter() - job.started, 2)
        output_file, report = job.folder / "output.txt", job.folder / "report.json"
        output = output_file.read_text(errors="replace") if output_file.exists() else ""
        code = os.waitstatus_to_exitcode(job.status)
        if job.timed_out:
            return {"error": f"grading took over {self.timeout:g} s; killed", "seconds": seconds}
        if code not in (0, 1, 5) or not report.exists():
            errors = [line for line in output.splitlines() if line.startswith(("ERROR", "INTERNALERROR"))]
            last = errors[-1] if errors else last_line(output) or "no output"
            why = f"pytest could not run the graded tests (exit status {code}): {last}"
            return {"error": why, "seconds": seconds}
        data = json.loads(report.read_text())
        ran = {t["nodeid"]: t for t in data["tests"]}
        keep = None if job.keep is None else set(job.keep)
        tests, failed = [], {}
        for problem, entry in self.rubric["problems"].items():
            for nodeid, points in entry["tests"].items():
                if nodeid in ran:
                    outcome, text = ran[nodeid]["outcome"], ran[nodeid]["output"]
                elif keep is None or nodeid in keep:
                    errors = "; ".join(f"{n}: {last_line(o)}" for n, o in data["collection_errors"])
                    outcome, text = "not run", f"did not run ({errors or 'not collected'})"
                else:
                    outcome, text = "passed", ""  # not selected: as in the reference run, where it passed
                tests.append(GradedTest(nodeid, problem, points, outcome, text))
                if outcome != "passed":
                    failed.setdefault(problem, []).append(f"{nodeid} ({outcome}): {last_line(text)}")
        lost = {p: s for p, s in GradeRun(self.rubric, tests).problem_scores().items() if s[0] < s[1]}
        return {"lost": lost, "failed": failed, "tests": len(ran), "seconds": seconds}


def _main(argv: list[str]) -> int:
    """The runner: reads the jobs file, writes one JSON line per entry to stdout as each is graded."""
    jobs = json.loads(Path(argv[0]).read_text())
    send = os.fdopen(os.dup(1), "w", buffering=1).write
    os.dup2(2, 1)  # anything else printed (pytest's collection, say) goes to the log, not to the caller
    try:
        with tempfile.TemporaryDirectory(prefix="catalog-run-") as tmp:
            _Runner(jobs, send).run(Path(tmp))
    except _Fatal as e:
        send(json.dumps({"fatal": str(e)}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

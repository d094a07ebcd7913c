"""The assignment machinery: stripping solutions (make_handout.py), grading (grade.py), and the real tree's
handout failing every graded test that the reference passes."""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cs336_scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_handout = _load("make_handout")
grade = _load("grade")


def lines(*rows: str) -> str:
    return "".join(row + "\n" for row in rows)


# ----------------------------------------------------------------------------------------------------
# Stripping one source


def test_strip_keeps_indentation_and_names_the_problem():
    source = lines(
        "def outer(x):",
        '    """Doc."""',
        "    y = x + 1",
        "    # BEGIN SOLUTION rmsnorm",
        "    z = y * 2",
        "    return z",
        "    # END SOLUTION",
        "",
        "",
        "class A:",
        "    def f(self):",
        "        if True:",
        "            # BEGIN SOLUTION rope",
        "            return 1",
        "            # END SOLUTION",
        "        return 0",
    )
    stripped, problems = make_handout.strip_solutions(source)
    assert problems == ["rmsnorm", "rope"]
    assert stripped == lines(
        "def outer(x):",
        '    """Doc."""',
        "    y = x + 1",
        '    raise NotImplementedError("rmsnorm")',
        "",
        "",
        "class A:",
        "    def f(self):",
        "        if True:",
        '            raise NotImplementedError("rope")',
        "        return 0",
    )
    namespace = {}
    exec(compile(stripped, "<handout>", "exec"), namespace)
    with pytest.raises(NotImplementedError, match="rmsnorm"):
        namespace["outer"](1)
    with pytest.raises(NotImplementedError, match="rope"):
        namespace["A"]().f()


def test_strip_leaves_files_without_markers_and_quoted_markers_alone():
    source = lines(
        "def f():",
        '    """Explains the markers:',
        "    # BEGIN SOLUTION <problem>",
        '    """',
        '    return "# END SOLUTION"',
    )
    assert make_handout.strip_solutions(source) == (source, [])
    assert make_handout.strip_solutions("x = 1\n") == ("x = 1\n", [])


BEGIN, END, BODY = "    # BEGIN SOLUTION", "    # END SOLUTION", "    return 1"


@pytest.mark.parametrize(
    "body, message",
    [
        ([BEGIN + " rope", BODY], "m.py:2: BEGIN SOLUTION without an END SOLUTION"),
        ([BODY, END], "m.py:3: END SOLUTION without a BEGIN SOLUTION"),
        ([BEGIN, BODY, END], "m.py:2: write the marker as '# BEGIN SOLUTION <problem_name>'"),
        ([BEGIN + " rope mla", BODY, END], "m.py:2: write the marker as"),
        (
            [BEGIN + " rope", BEGIN + " mla", BODY, END],
            "m.py:3: BEGIN SOLUTION inside the block opened at line 2",
        ),
        ([BEGIN + " rope", BODY, "  # END SOLUTION"], "m.py:4: END SOLUTION is not indented like its BEGIN"),
        (["    #BEGIN SOLUTION rope", BODY, END], "m.py:2: malformed solution marker"),
        (
            ["    x = (", BEGIN + " rope", "    1", END, "    )"],
            "m.py:3: the handout version is not valid Python",
        ),
    ],
)
def test_strip_rejects_bad_markers(body, message):
    with pytest.raises(make_handout.SolutionMarkerError) as excinfo:
        make_handout.strip_solutions(lines("def f():", *body), "m.py")
    assert str(excinfo.value).startswith(message)
    assert "\n" not in str(excinfo.value)


def test_strip_rejects_a_block_outside_a_function():
    source = lines("# BEGIN SOLUTION rope", "x = 1", "# END SOLUTION")
    with pytest.raises(
        make_handout.SolutionMarkerError, match="m.py:1: BEGIN SOLUTION must be inside a function"
    ):
        make_handout.strip_solutions(source, "m.py")


# ----------------------------------------------------------------------------------------------------
# conftest.py: marker checks and CUDA skips


class FakeItem:
    def __init__(self, *marks):
        self.nodeid, self.marks = "tests/test_x.py::test_x", [m.mark for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, marker):
        self.marks.append(marker.mark)


@pytest.mark.parametrize(
    "marker, message",
    [
        (pytest.mark.graded(problem="rope"), "write the marker as"),
        (pytest.mark.graded("rope", 2), "write the marker as"),
        (pytest.mark.graded(problem="rope", points=2, extra=1), "write the marker as"),
        (pytest.mark.graded(problem="RoPE", points=2), "unknown problem 'RoPE'"),
        (pytest.mark.graded(problem="rope", points=0), "points must be a positive number"),
        (pytest.mark.graded(problem="rope", points="2"), "points must be a positive number"),
    ],
)
def test_conftest_rejects_bad_graded_markers(marker, message):
    conftest = _load_conftest()
    conftest.check_graded_marker(FakeItem(pytest.mark.slow))  # ungraded: fine
    conftest.check_graded_marker(FakeItem(pytest.mark.graded(problem="rope", points=2.5)))
    with pytest.raises(pytest.UsageError, match=f"tests/test_x.py::test_x: {message}"):
        conftest.check_graded_marker(FakeItem(marker))


def test_conftest_skips_cuda_tests_exactly_without_a_gpu():
    import torch

    items = [FakeItem(pytest.mark.cuda), FakeItem(pytest.mark.slow)]
    _load_conftest().pytest_collection_modifyitems(None, items)
    skipped = [item.get_closest_marker("skip") is not None for item in items]
    assert skipped == [not torch.cuda.is_available(), False]


def _load_conftest():
    spec = importlib.util.spec_from_file_location("cs336_tests_conftest", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------------------
# make_handout + grade on a throwaway repository


def _mini_repo(root: Path, extra_test: str = "") -> Path:
    """A tiny package with two solution blocks, graded tests (one exercising uncovered code), staff files."""
    files = {
        "minipkg/__init__.py": "",
        "minipkg/ops.py": lines(
            "def double(x):",
            "    # BEGIN SOLUTION rmsnorm",
            "    return 2 * x",
            "    # END SOLUTION",
            "",
            "",
            "def square(x):",
            "    # BEGIN SOLUTION swiglu",
            "    return x * x",
            "    # END SOLUTION",
            "",
            "",
            "def increment(x):",
            "    return x + 1",
        ),
        "tests/test_ops.py": lines(
            "import pytest",
            "",
            "from minipkg.ops import double, increment, square",
            "",
            "",
            '@pytest.mark.graded(problem="rmsnorm", points=2)',
            "def test_double():",
            "    assert double(3) == 6",
            "",
            "",
            '@pytest.mark.graded(problem="rmsnorm", points=1.5)',
            "def test_double_negative():",
            "    assert double(-1) == -2",
            "",
            "",
            '@pytest.mark.graded(problem="rope", points=1)',
            "def test_increment():  # exercises code no solution block covers",
            "    assert increment(1) == 2",
            "",
            "",
            '@pytest.mark.graded(problem="swiglu", points=3)',
            "def test_square():",
            "    assert square(3) == 9",
            "",
            "",
            "def test_not_graded():",
            "    assert False",
        )
        + extra_test,
        "tests/hidden/test_secret.py": "def test_secret():\n    pass\n",
        "scripts/make_reference_outputs.py": "print('staff')\n",
        "reference_weights/blob.bin": "\x00\x01binary\xff",
        "notes.log": "ignored by git\n",
        ".gitignore": "*.log\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for rel in ("pyproject.toml", "tests/conftest.py", "scripts/grade.py"):
        shutil.copyfile(REPO / rel, root / rel)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def _problems(tree: Path, ref, handout) -> list[str]:
    """Everything that breaks 'the reference passes every graded test, the handout fails every one, and
    every graded problem has a solution block and vice versa'."""
    problems = []
    for name, run in (("reference", ref), ("handout", handout)):
        problems += [f"{name}: collection error in {nodeid}" for nodeid, _ in run.collection_errors]
    cuda_skips = {t.nodeid for t in ref.tests if t.outcome == "skipped" and "CUDA" in t.output}
    problems += [
        f"reference {t.outcome}: {t.nodeid} ({t.problem}): {grade._last_line(t.output)}"
        for t in ref.tests
        if t.outcome != "passed" and t.nodeid not in cuda_skips
    ]
    if {t.nodeid for t in handout.tests} != {t.nodeid for t in ref.tests}:
        problems.append("the handout does not collect the same graded tests as the reference")
    problems += [
        f"handout passes: {t.nodeid} ({t.problem}); the code it exercises is not inside a solution block"
        for t in handout.tests
        if t.outcome == "passed"
    ]
    blocks = make_handout.solution_blocks(tree)
    graded = {t.problem for t in ref.tests}
    problems += [f"graded problem {p!r} has no solution block" for p in sorted(graded - set(blocks))]
    for p in sorted(set(blocks) - graded):
        problems.append(f"solution block for {p!r} has no graded test ({', '.join(blocks[p])})")
    return problems


def _grade_both(ref_dir: Path, handout_dir: Path):
    # One after the other: on 2 cores, running the two (or pytest-xdist workers) side by side was slower.
    return grade.run_graded(ref_dir), grade.run_graded(handout_dir)


def test_handout_and_grade_on_a_mini_repo(tmp_path):
    src = _mini_repo(tmp_path / "src")
    out = tmp_path / "handout"
    cli = [sys.executable, str(REPO / "scripts" / "make_handout.py"), "--repo", str(src), "--out", str(out)]
    made = subprocess.run(cli, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert made.stdout.count("\n") == 1 and "stripped 2 blocks: rmsnorm 1, swiglu 1" in made.stdout

    # Staff-only and git-ignored files are left out; everything else is copied, data byte for byte.
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == [
        ".gitignore",
        "minipkg/__init__.py",
        "minipkg/ops.py",
        "pyproject.toml",
        "reference_weights/blob.bin",
        "scripts/grade.py",
        "tests/conftest.py",
        "tests/test_ops.py",
    ]
    blob = "reference_weights/blob.bin"
    assert (out / blob).read_bytes() == (src / blob).read_bytes()
    assert 'raise NotImplementedError("rmsnorm")' in (out / "minipkg/ops.py").read_text()
    again = subprocess.run(cli, capture_output=True, text=True)
    assert again.returncode == 2 and "not an empty folder" in again.stderr

    # Grade the reference through the CLI (results.json, table, xdist) and both trees through the function.
    results = tmp_path / "results.json"
    cmd = [sys.executable, str(src / "scripts" / "grade.py"), "--repo", str(src), "--out", str(results)]
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []  # reports then come from workers
    graded = subprocess.run(cmd + workers, capture_output=True, text=True)
    assert graded.returncode == 0, graded.stderr
    assert graded.stdout.strip().splitlines()[-1] == "TOTAL: 7.5 / 7.5"
    report = json.loads(results.read_text())
    assert report["score"] == 7.5
    assert sorted((t["name"], t["score"], t["max_score"]) for t in report["tests"]) == [
        ("rmsnorm: tests/test_ops.py::test_double", 2, 2),
        ("rmsnorm: tests/test_ops.py::test_double_negative", 1.5, 1.5),
        ("rope: tests/test_ops.py::test_increment", 1, 1),
        ("swiglu: tests/test_ops.py::test_square", 3, 3),
    ]
    assert all(isinstance(t["output"], str) and t["visibility"] == "visible" for t in report["tests"])

    ref, handout = _grade_both(src, out)
    assert (ref.score, ref.max_score, handout.score, handout.max_score) == (7.5, 7.5, 1, 7.5)
    failed = {t.nodeid.split("::")[1]: t for t in handout.tests if t.outcome == "failed"}
    assert sorted(failed) == ["test_double", "test_double_negative", "test_square"]
    assert "NotImplementedError: rmsnorm" in failed["test_double"].output
    assert grade.summary_lines(handout)[-1] == "TOTAL: 1 / 7.5"

    # The coverage check names the graded test that the handout still passes, and the problem without a block.
    assert _problems(src, ref, handout) == [
        "handout passes: tests/test_ops.py::test_increment (rope); "
        "the code it exercises is not inside a solution block",
        "graded problem 'rope' has no solution block",
    ]


def test_grade_rejects_bad_markers_and_arguments(tmp_path):
    bad = lines("", "", '@pytest.mark.graded(problem="no_such_problem", points=1)', "def test_bad():", BODY)
    src = _mini_repo(tmp_path / "src", extra_test=bad)
    with pytest.raises(grade.GradeError, match="unknown problem 'no_such_problem'"):
        grade.run_graded(src)
    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "grade.py"), "--repo", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "is not a folder" in missing.stderr


# ----------------------------------------------------------------------------------------------------
# The real tree


@pytest.mark.slow
def test_handout_fails_every_graded_test_the_reference_passes(tmp_path):
    handout_dir = tmp_path / "handout"
    summary = make_handout.make_handout(REPO, handout_dir)
    ref, handout = _grade_both(REPO, handout_dir)
    if not ref.tests and not ref.collection_errors:
        pytest.skip(f"no graded tests in the tree yet ({sum(summary['blocks'].values())} solution blocks)")
    problems = _problems(REPO, ref, handout)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)

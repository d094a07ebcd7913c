"""The assignment machinery: stripping solutions (make_handout.py), the rubric, grading problem by problem
(cs336_grading, scripts/grade.py), and the real tree: the reference earns every point, the handout none,
and every handout failure is its own problem's."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"cs336_scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


make_handout = _load("make_handout")
from cs336_grading import grader, plugin  # noqa: E402
from cs336_grading import rubric as rubric_mod  # noqa: E402
from cs336_grading import submission as submission_mod  # noqa: E402


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
# Markers and CUDA skips


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
        (pytest.mark.graded(problem="no such", points=2), "the problem must be a name"),
        (pytest.mark.graded(problem="rope", points=0), "points must be a positive number"),
        (pytest.mark.graded(problem="rope", points="2"), "points must be a positive number"),
    ],
)
def test_bad_graded_markers_are_usage_errors(marker, message):
    assert plugin.graded_marker(FakeItem(pytest.mark.slow)) is None  # ungraded: fine
    assert plugin.graded_marker(FakeItem(pytest.mark.graded(problem="rope", points=2.5))) == ("rope", 2.5)
    with pytest.raises(pytest.UsageError, match=f"tests/test_x.py::test_x: {message}"):
        plugin.graded_marker(FakeItem(marker))


class FakeConfig:
    rootpath = REPO

    def getoption(self, name):
        return None  # no --problem, --submission, --collect-graded, ...


def test_costly_graded_tests_run_first_the_longest_first():
    names = ["cheap", "one_second", "also_cheap", "three_seconds", "two_seconds"]
    marks = [
        [],
        [pytest.mark.costly(seconds=1)],
        [],
        [pytest.mark.costly(seconds=3)],
        [pytest.mark.costly(seconds=2)],
    ]
    items = []
    for name, extra in zip(names, marks, strict=True):
        item = FakeItem(pytest.mark.graded(problem="rope", points=1), *extra)
        item.nodeid, item.user_properties = f"tests/test_x.py::{name}", []
        items.append(item)
    config = FakeConfig()
    plugin.GradingPlugin(config).pytest_collection_modifyitems(config, items)
    order = [item.nodeid.split("::")[1] for item in items]
    assert order == ["three_seconds", "two_seconds", "one_second", "cheap", "also_cheap"], order
    assert [dict(item.user_properties)["graded"][2] for item in items] == [0, 1, 2, 3, 4]  # numbered in it
    for bad in (pytest.mark.costly, pytest.mark.costly(2), pytest.mark.costly(seconds="2")):
        with pytest.raises(pytest.UsageError, match="write the marker as @pytest.mark.costly"):
            plugin.GradingPlugin(config).pytest_collection_modifyitems(config, [FakeItem(bad)])


def test_conftest_skips_cuda_tests_exactly_without_a_gpu():
    import torch

    spec = importlib.util.spec_from_file_location("cs336_tests_conftest", REPO / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    items = [FakeItem(pytest.mark.cuda), FakeItem(pytest.mark.slow)]
    conftest.pytest_collection_modifyitems(None, items)
    skipped = [item.get_closest_marker("skip") is not None for item in items]
    assert skipped == [not torch.cuda.is_available(), False]


# ----------------------------------------------------------------------------------------------------
# Swapping a submission's functions into the reference


def test_submission_swaps_code_in_place_and_restores_it(tmp_path):
    """The student's code runs with the reference's globals: its calls reach the reference helpers."""
    import cs336_inference.layers as layers

    student = tmp_path / "cs336_inference" / "layers.py"
    student.parent.mkdir()
    source = (REPO / "cs336_inference" / "layers.py").read_text()
    body = "    x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat([-x2, x1], dim=-1)\n"
    assert body in source
    wrong = "    return _student_helper(x)\n\n\ndef _student_helper(x):\n    return -x\n"
    student.write_text(source.replace(body, wrong).replace("eps: float = 1e-5", "eps: float = 0.5"))
    x = torch.arange(4.0)
    reference = layers.rotate_half(x)
    sub = submission_mod.Submission(tmp_path)
    with sub.use(["cs336_inference/layers.py::rotate_half"]):
        assert torch.equal(layers.rotate_half(x), -x), "the student's rotate_half runs"
        from cs336_inference.layers import rotate_half  # a name imported elsewhere sees it too

        assert torch.equal(rotate_half(x), -x)
        assert layers.RMSNorm(4).eps == 1e-5, "code outside the problem's functions stays the reference's"
    assert torch.equal(layers.rotate_half(x), reference) and not hasattr(layers, "_student_helper")


def test_submission_method_using_super_and_a_new_helper_method(tmp_path):
    import cs336_inference.layers as layers

    student = tmp_path / "cs336_inference" / "layers.py"
    student.parent.mkdir()
    source = (REPO / "cs336_inference" / "layers.py").read_text()
    body = "        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))\n"
    assert body in source
    new = (
        "        super().forward  # the reference never calls super(): a __class__ cell to rebuild\n"
        "        return self._twice(x)\n\n"
        "    def _twice(self, x):\n        return 2 * x\n"
    )
    student.write_text(source.replace(body, new))
    mlp, x = layers.SwiGLU(4, 6), torch.randn(2, 4)
    with submission_mod.Submission(tmp_path).use(["cs336_inference/layers.py::SwiGLU.forward"]):
        assert torch.equal(mlp(x), 2 * x)
    assert not hasattr(layers.SwiGLU, "_twice") and mlp(x).shape == (2, 4) and not torch.equal(mlp(x), 2 * x)


def test_submission_that_does_not_import_or_lacks_the_function(tmp_path):
    (tmp_path / "cs336_inference").mkdir()
    (tmp_path / "cs336_inference" / "layers.py").write_text("def rotate_half(x:\n")
    (tmp_path / "cs336_inference" / "kv_cache.py").write_text("x = 1\n")
    sub = submission_mod.Submission(tmp_path)
    with pytest.raises(submission_mod.SubmissionError, match=r"layers.py failed to import.*SyntaxError"):
        with sub.use(["cs336_inference/layers.py::rotate_half"]):
            pass
    with pytest.raises(submission_mod.SubmissionError, match="has no function StaticKVCache.update"):
        with sub.use(["cs336_inference/kv_cache.py::StaticKVCache.update"]):
            pass
    with pytest.raises(submission_mod.SubmissionError, match="cannot be read"):
        with sub.use(["cs336_inference/model.py::TransformerLM.forward"]):
            pass


# ----------------------------------------------------------------------------------------------------
# The rubric, make_handout and grade on a throwaway repository


def _mini_repo(root: Path, extra_test: str = "", heading_points: str = "3.5") -> Path:
    """A tiny package with solution blocks in two modules, a handout, graded tests, staff files."""
    files = {
        "cs336_inference/__init__.py": "",
        "cs336_inference/ops.py": lines(
            "def double(x):",
            "    # BEGIN SOLUTION rmsnorm",
            "    return 2 * x",
            "    # END SOLUTION",
            "",
            "",
            "class Squarer:",
            "    def __call__(self, x):",
            "        # BEGIN SOLUTION swiglu",
            "        return x * x",
            "        # END SOLUTION",
            "",
            "",
            "def increment(x):",
            "    return x + 1",
        ),
        "cs336_inference/acc.py": lines(
            "from cs336_inference.ops import double",
            "",
            "",
            "def quadruple(x):",
            "    # BEGIN SOLUTION matmul_accounting",
            "    return double(double(x))",
            "    # END SOLUTION",
        ),
        "tests/test_ops.py": lines(
            "import pytest",
            "",
            "from cs336_inference.ops import Squarer, double, increment",
            "",
            "",
            '@pytest.mark.graded(problem="rmsnorm", points=2)',
            "def test_double():",
            "    assert double(3) == 6",
            "    assert increment(1) == 2",
            "",
            "",
            '@pytest.mark.graded(problem="rmsnorm", points=1.5)',
            '@pytest.mark.parametrize("x", [-1, 0, 5])',
            "def test_double_cases(x):",
            "    assert double(x) == x + x",
            "",
            "",
            '@pytest.mark.graded(problem="swiglu", points=3)',
            "def test_square():",
            "    assert Squarer()(3) == 9",
            "",
            "",
            "def test_not_graded():",
            "    assert False",
        )
        + extra_test,
        "tests/test_acc.py": lines(
            "import pytest",
            "",
            "from cs336_inference.acc import quadruple",
            "",
            "",
            '@pytest.mark.graded(problem="matmul_accounting", points=2)',
            "def test_quadruple():",
            "    assert quadruple(3) == 12",
        ),
        "assignments/handout.md": lines(
            "## Part 1: ops",
            f"### Problem (rmsnorm): Doubling ({heading_points} points)",
            "### Problem (swiglu): Squaring (3 points)",
            "## Part 3: accounting",
            "### Problem (matmul_accounting): Four times (2 points)",
        ),
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
    shutil.copytree(
        REPO / "cs336_grading", root / "cs336_grading", ignore=shutil.ignore_patterns("__pycache__")
    )
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_rubric_from_handout_blocks_and_tests(tmp_path):
    src = _mini_repo(tmp_path / "src")
    rubric = grader.write_rubric(src)
    assert json.loads((src / "assignments" / "rubric.json").read_text()) == rubric
    assert rubric["total"] == 8.5
    rms = rubric["problems"]["rmsnorm"]
    assert (rms["points"], rms["part"], rms["functions"]) == (3.5, 1, ["cs336_inference/ops.py::double"])
    assert rms["tests"] == {  # a parametrized test's points are shared by its cases
        "tests/test_ops.py::test_double": 2,
        "tests/test_ops.py::test_double_cases[-1]": 0.5,
        "tests/test_ops.py::test_double_cases[0]": 0.5,
        "tests/test_ops.py::test_double_cases[5]": 0.5,
    }
    assert rubric["problems"]["swiglu"]["functions"] == ["cs336_inference/ops.py::Squarer.__call__"]
    # The traced run: quadruple's tests call double, so matmul_accounting needs rmsnorm done first.
    assert [rubric["problems"][p]["needs"] for p in ("rmsnorm", "swiglu", "matmul_accounting")] == [
        [],
        [],
        ["rmsnorm"],
    ]


def test_rubric_refuses_disagreements(tmp_path):
    src = _mini_repo(tmp_path / "src", heading_points="4")
    with pytest.raises(
        rubric_mod.RubricError, match="'rmsnorm': the handout says 4 points, its tests carry 3.5"
    ):
        grader.write_rubric(src, trace=False)
    ops = src / "cs336_inference" / "ops.py"
    ops.write_text(
        ops.read_text().replace(
            "    return 2 * x\n",
            "    y = 2 * x\n    # END SOLUTION\n    # BEGIN SOLUTION rope\n    return y\n",
        )
    )
    with pytest.raises(rubric_mod.RubricError, match="ops.py::double holds blocks of two problems"):
        rubric_mod.solution_functions(src)


def test_handout_and_grade_on_a_mini_repo(tmp_path):
    src = _mini_repo(tmp_path / "src")
    grader.write_rubric(src)
    out = tmp_path / "handout"
    cli = [sys.executable, str(REPO / "scripts" / "make_handout.py"), "--repo", str(src), "--out", str(out)]
    made = subprocess.run(cli, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    assert made.stdout.count("\n") == 1 and "stripped 3 blocks" in made.stdout

    # Staff-only and git-ignored files are left out; everything else is copied, data byte for byte.
    written = {
        p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    assert {"assignments/rubric.json", "cs336_inference/ops.py", "reference_weights/blob.bin"} <= written
    assert not written & {"tests/hidden/test_secret.py", "scripts/make_reference_outputs.py", "notes.log"}
    blob = "reference_weights/blob.bin"
    assert (out / blob).read_bytes() == (src / blob).read_bytes()
    assert 'raise NotImplementedError("rmsnorm")' in (out / "cs336_inference/ops.py").read_text()
    again = subprocess.run(cli, capture_output=True, text=True)
    assert again.returncode == 2 and "not an empty folder" in again.stderr

    # The reference through the CLI (results.json, table, xdist workers).
    results = tmp_path / "results.json"
    cmd = [sys.executable, str(src / "scripts" / "grade.py"), "--submission", str(src), "--out", str(results)]
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []  # reports then come from workers
    graded = subprocess.run(cmd + workers, capture_output=True, text=True)
    assert graded.returncode == 0, graded.stderr
    assert graded.stdout.strip().splitlines()[-1] == "TOTAL: 8.5 / 8.5"
    report = json.loads(results.read_text())
    assert report["score"] == 8.5 and len(report["tests"]) == 6
    assert ("rmsnorm: tests/test_ops.py::test_double_cases[0]", 0.5, 0.5) in [
        (t["name"], t["score"], t["max_score"]) for t in report["tests"]
    ]

    # The handout scores 0 and each failure is its own problem's stub (matmul_accounting's test calls
    # double, which is rmsnorm's, but runs with the reference double: isolation).
    handout = grader.run_graded(src, submission=out)
    assert (handout.score, handout.max_score) == (0, 8.5)
    for t in handout.tests:
        assert f"NotImplementedError: {t.problem}" in t.output, (t.nodeid, t.output)
    assert grader.summary_lines(handout)[-1] == "TOTAL: 0 / 8.5"

    # A syntax error in one module costs exactly that module's problems, with the error as their output.
    broken = tmp_path / "broken"
    shutil.copytree(src / "cs336_inference", broken / "cs336_inference")
    (broken / "cs336_inference" / "acc.py").write_text("def quadruple(x:\n")
    run = grader.run_graded(src, submission=broken)
    assert (run.score, run.max_score) == (6.5, 8.5)
    [failed] = [t for t in run.tests if t.outcome != "passed"]
    assert failed.problem == "matmul_accounting" and "acc.py failed to import" in failed.output

    # A submission's own tests and rubric are never used: the staff's grade it.
    cheat = tmp_path / "cheat"
    shutil.copytree(out, cheat)
    (cheat / "tests" / "test_ops.py").write_text(
        "import pytest\n\n\n@pytest.mark.graded(problem='rmsnorm', points=99)\ndef test_x():\n    pass\n"
    )
    (cheat / "assignments" / "rubric.json").write_text('{"total": 1, "problems": {}}')
    run = grader.run_graded(src, submission=cheat)
    assert (run.score, run.max_score) == (0, 8.5)


def test_the_maximum_does_not_shrink_when_a_test_module_fails_to_import(tmp_path):
    src = _mini_repo(tmp_path / "src")
    grader.write_rubric(src)
    (src / "tests" / "test_acc.py").write_text("import no_such_module\n")
    run = grader.run_graded(src)
    assert (run.score, run.max_score) == (6.5, 8.5)
    [missing] = [t for t in run.tests if t.outcome != "passed"]
    assert missing.outcome == "not run" and missing.problem == "matmul_accounting"
    assert run.collection_errors and "no_such_module" in run.collection_errors[0][1]
    assert grader.summary_lines(run)[-1] == "TOTAL: 6.5 / 8.5"


def test_grade_rejects_bad_arguments(tmp_path):
    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "grade.py"), "--submission", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "is not a folder" in missing.stderr


# ----------------------------------------------------------------------------------------------------
# The real tree


def test_rubric_is_current():
    """assignments/rubric.json is what the handout, the blocks and the graded tests say now."""
    stored = rubric_mod.load(REPO)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-m", "graded", "--collect-only", "-q", "-p", "no:cacheprovider",
         "--collect-graded", str(REPO / ".pytest_graded.json")],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    path = REPO / ".pytest_graded.json"
    try:
        assert collected.returncode == 0, collected.stdout[-2000:]
        graded = json.loads(path.read_text())
    finally:
        path.unlink(missing_ok=True)
    fresh = rubric_mod.build(REPO, graded)
    handout = (REPO / rubric_mod.HANDOUT).read_text()
    assert rubric_mod.with_table(handout, stored) == handout, "the handout's table of problems is stale"
    for entry in stored["problems"].values():
        entry.pop("needs", None)
    assert fresh == stored, "assignments/rubric.json is stale: run python scripts/grade.py --write-rubric"


@pytest.mark.slow
def test_reference_earns_every_point_and_the_handout_none(tmp_path):
    """The handout fails every graded test with its own problem's NotImplementedError (so no problem's
    tests depend on another problem's code during grading); the reference passes every one."""
    handout_dir = tmp_path / "handout"
    make_handout.make_handout(REPO, handout_dir)
    traced = tmp_path / "needs.json"
    ref = grader.run_graded(REPO, extra=["--trace-needs", str(traced)])
    problems = [
        f"reference {t.outcome}: {t.nodeid}: {grader.last_line(t.output)}"
        for t in ref.tests
        if t.outcome != "passed"
    ]
    rubric = rubric_mod.load(REPO)
    assert ref.score == ref.max_score == rubric["total"], "\n".join(problems)
    needs = json.loads(traced.read_text())
    for name, entry in rubric["problems"].items():
        called = {p for nodeid in entry["tests"] for p in needs[nodeid]} - {name}
        assert set(entry["needs"]) == called, f"{name}: the rubric's needs are stale (--write-rubric)"
    handout = grader.run_graded(REPO, submission=handout_dir)
    problems = [
        f"{t.nodeid} ({t.problem}) does not fail on its own stub: {grader.last_line(t.output)}"
        for t in handout.tests
        if not re.search(rf"NotImplementedError\W{{1,3}}{t.problem}\b", t.output)
    ]
    assert not problems, "\n".join(problems)
    assert handout.score == 0


def test_handout_order_lets_each_problem_pass_locally():
    """A problem's tests call only problems above it in the handout, or one that in turn calls it (the
    two are then done together), so a student working top to bottom can run each problem's tests."""
    problems = rubric_mod.load(REPO)["problems"]
    order = list(problems)
    late = [
        f"{name} needs {need}, which comes later and does not need {name}"
        for name, entry in problems.items()
        for need in entry["needs"]
        if order.index(need) > order.index(name) and name not in problems[need]["needs"]
    ]
    assert not late, "reorder assignments/handout.md: " + "; ".join(late)


def test_every_problem_section_has_its_deliverable_command():
    text = (REPO / rubric_mod.HANDOUT).read_text()
    for name in rubric_mod.load(REPO)["problems"]:
        section = text.split(f"### Problem ({name})", 1)[1].split("\n### ", 1)[0]
        assert f"python -m pytest --problem {name}`" in section, f"the {name} section lacks its deliverable"


MENTION = re.compile(
    r"\b((?:scripts|tests|assignments|cs336_inference|cs336_grading|reference_weights|\.ci)/[\w./-]*\w)"
)


def test_the_handout_mentions_only_what_it_ships(tmp_path):
    """No file of the student repo names a path the student repo does not have (staff scripts, CI)."""
    out = tmp_path / "handout"
    make_handout.make_handout(REPO, out)
    missing = []
    for path in out.rglob("*"):
        if path.suffix not in (".md", ".py", ".toml", ".ipynb", ".json") or "reference_weights" in path.parts:
            continue
        for name in MENTION.findall(path.read_text(encoding="utf-8", errors="replace")):
            if not (out / name).exists() and not any(out.glob(name)):
                missing.append(f"{path.relative_to(out)} names {name}")
    assert not missing, "\n".join(sorted(set(missing)))
    readme = (out / "README.md").read_text()
    assert readme.startswith("# CS336 Assignment") and "python -m pytest --problem" in readme


def test_a_graded_test_that_never_returns_times_out_and_the_rest_is_graded(tmp_path):
    """The grader's per-test time limit: a solution that loops forever costs its own problem's tests
    (each stopped after the limit, a TIMEOUT line for it) and every other problem is still graded."""
    from cs336_grading import catalog
    from cs336_grading.grader import run_graded, summary_lines

    loop = catalog.WrongSolution(
        "rmsnorm", "loops", "never returns", "cs336_inference/layers.py",
        [("        dtype = x.dtype\n        x32 = x.float()\n", "        while True:\n            pass\n")],
    )  # fmt: skip
    submission = catalog.make_submission(REPO, loop, tmp_path)
    problems = ["rmsnorm", "swiglu"]
    run = run_graded(
        REPO, submission, extra=[f"--problem={p}" for p in problems], problems=problems, timeout=2
    )
    rmsnorm = [t for t in run.tests if t.problem == "rmsnorm"]
    assert rmsnorm and all(t.outcome == "timeout" for t in rmsnorm), [(t.nodeid, t.outcome) for t in rmsnorm]
    scores = run.problem_scores()
    assert scores["rmsnorm"][0] == 0 and scores["swiglu"][0] == scores["swiglu"][1] > 0, scores
    timeouts = [line for line in summary_lines(run) if line.startswith("TIMEOUT ")]
    assert timeouts and all("rmsnorm" in line and "ran past 2 s" in line for line in timeouts), timeouts

"""The rubric: which problems exist, what each is worth, which functions and which tests belong to it.

It is written from the reference tree by `python scripts/grade.py --write-rubric` and shipped with the
handout as assignments/rubric.json, so the maximum score never depends on what a submission's tests
collect. Its sources, checked against each other when it is written:

- the handout's headings `### Problem (name): Title (N points)`: the problems, in order, and their points;
- the `# BEGIN SOLUTION <problem>` blocks: the functions a problem's grade swaps in (one problem per function);
- the tests marked `@pytest.mark.graded(problem=..., points=...)`: a test function's points are shared
  equally by its parametrized cases, so points follow the work and not the number of cases;
- (optionally) a traced run of the reference: which other problems' functions each problem's tests call,
  i.e. what a student needs done before that problem's tests can pass locally.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
from fractions import Fraction
from pathlib import Path

RUBRIC = "assignments/rubric.json"
HANDOUT = "assignments/handout.md"
PACKAGES = ("cs336_inference",)
HEADING = re.compile(r"^#{2,4} Problem \((\w+)\): (.+?) \((\d+(?:\.\d+)?) points?\)\s*$", re.MULTILINE)
PART = re.compile(r"^## Part (\d+)", re.MULTILINE)
BEGIN = re.compile(r"^[ \t]*# BEGIN SOLUTION[ \t]+(\w+)[ \t]*$")


class RubricError(ValueError):
    """The handout, the solution blocks and the graded tests disagree."""


def handout_problems(repo: Path) -> dict[str, dict]:
    """name -> {"title", "points", "part"} in the handout's order."""
    text = (repo / HANDOUT).read_text(encoding="utf-8")
    parts = [(m.start(), int(m.group(1))) for m in PART.finditer(text)]
    problems: dict[str, dict] = {}
    for m in HEADING.finditer(text):
        part = max((n for start, n in parts if start < m.start()), default=0)
        if m.group(1) in problems:
            raise RubricError(f"{HANDOUT}: problem {m.group(1)!r} has two headings")
        problems[m.group(1)] = {"title": m.group(2), "points": _number(Fraction(m.group(3))), "part": part}
    return problems


def solution_functions(repo: Path) -> dict[str, list[str]]:
    """problem -> ['path.py::Qual.name', ...]: the functions holding its solution blocks, in file order."""
    found: dict[str, list[str]] = {}
    owner_of: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            rel = path.relative_to(repo).as_posix()
            text = path.read_text(encoding="utf-8")
            if "BEGIN SOLUTION" not in text:
                continue
            spans = _function_spans(ast.parse(text, filename=rel))
            for line in _comment_begin_lines(text):
                problem = BEGIN.match(text.splitlines()[line - 1]).group(1)
                inside = [(first, last, q) for first, last, q in spans if first <= line <= last]
                if not inside:
                    raise RubricError(f"{rel}:{line}: BEGIN SOLUTION outside a function")
                spec = f"{rel}::{min(inside, key=lambda s: s[0])[2]}"  # the outermost function
                if owner_of.setdefault(spec, problem) != problem:
                    raise RubricError(
                        f"{spec} holds blocks of two problems ({owner_of[spec]}, {problem}); "
                        "a graded function belongs to one problem"
                    )
                if spec not in found.setdefault(problem, []):
                    found[problem].append(spec)
    return found


def _function_spans(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first body line, last line, qualified name) of every function outside other functions."""
    spans = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                spans.append((child.lineno, child.end_lineno, f"{prefix}{child.name}"))

    visit(tree, "")
    return spans


def _comment_begin_lines(text: str) -> list[int]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.start[0] for t in tokens if t.type == tokenize.COMMENT and BEGIN.match(t.line.rstrip("\r\n"))]


def build(repo: Path, graded: list[dict], needs: dict[str, list[str]] | None = None) -> dict:
    """The rubric from the handout, the solution blocks and the collected graded tests.

    graded: one dict per collected test case: {"nodeid", "problem", "points"} (points of its function).
    needs: nodeid -> problems whose functions the test called on the reference (from a traced run).
    """
    problems = handout_problems(repo)
    functions = solution_functions(repo)
    errors = [
        f"solution blocks of {p!r}, which has no handout heading" for p in functions if p not in problems
    ]
    cases: dict[tuple[str, str], list[dict]] = {}
    for case in graded:
        if case["problem"] not in problems:
            errors.append(f"{case['nodeid']}: problem {case['problem']!r} has no handout heading")
            continue
        cases.setdefault((case["nodeid"].split("[")[0], case["problem"]), []).append(case)
    tests: dict[str, dict[str, Fraction]] = {p: {} for p in problems}
    for (function, problem), group in cases.items():
        if len({Fraction(str(c["points"])) for c in group}) != 1:
            errors.append(f"{function}: the cases of {problem!r} carry different points; write one value")
            continue
        share = Fraction(str(group[0]["points"])) / len(group)
        for case in group:
            tests[problem][case["nodeid"]] = share
    rubric = {"total": 0, "problems": {}}
    for name, info in problems.items():
        total = sum(tests[name].values(), Fraction(0))
        if not functions.get(name):
            errors.append(f"problem {name!r} has no solution block")
        if not tests[name]:
            errors.append(f"problem {name!r} has no graded test")
        elif total != Fraction(str(info["points"])):
            errors.append(
                f"problem {name!r}: the handout says {info['points']} points, its tests carry {_number(total)}"
            )
        entry = {**info, "functions": functions.get(name, [])}
        entry["tests"] = {nodeid: _number(share) for nodeid, share in tests[name].items()}
        if needs is not None:
            called = {p for nodeid in tests[name] for p in needs.get(nodeid, [])}
            entry["needs"] = [p for p in problems if p in called and p != name]
        rubric["problems"][name] = entry
        rubric["total"] += total
    if errors:
        raise RubricError("\n".join(errors))
    rubric["total"] = _number(rubric["total"])
    return rubric


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else round(float(x), 6)


def load(repo: Path) -> dict:
    path = Path(repo) / RUBRIC
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RubricError(f"cannot read the rubric {path}: {e}") from e


def dump(rubric: dict) -> str:
    return json.dumps(rubric, indent=1) + "\n"


def problem_of_function(rubric: dict) -> dict[str, str]:
    """'path.py::Qual.name' -> problem."""
    return {spec: name for name, p in rubric["problems"].items() for spec in p["functions"]}


TABLE_BEGIN = "<!-- rubric table: written by `python scripts/grade.py --write-rubric` -->"
TABLE_END = "<!-- end rubric table -->"


def handout_table(rubric: dict) -> str:
    """The handout's table of problems: part, problem, points, and which other problems' code its tests
    call (done first, they let the tests pass locally; the grader uses the reference for them)."""
    rows = ["| part | problem | points | its tests also call |", "| ---: | --- | ---: | --- |"]
    for name, p in rubric["problems"].items():
        needs = ", ".join(f"`{n}`" for n in p.get("needs", [])) or "nothing else"
        rows.append(f"| {p['part']} | `{name}`: {p['title']} | {p['points']} | {needs} |")
    rows.append(f"| | **total** | **{rubric['total']}** | |")
    return "\n".join(rows)


def with_table(handout: str, rubric: dict) -> str:
    """The handout text with the table between its markers replaced (RubricError without markers)."""
    if TABLE_BEGIN not in handout or TABLE_END not in handout:
        raise RubricError(f"{HANDOUT} needs the lines {TABLE_BEGIN!r} and {TABLE_END!r} around its table")
    head, rest = handout.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{handout_table(rubric)}\n{TABLE_END}{tail}"

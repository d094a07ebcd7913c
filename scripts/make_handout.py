"""Write the student handout: a copy of the repository with the solutions cut out.

Every block

    # BEGIN SOLUTION <problem>
    ...
    # END SOLUTION

in a .py file becomes `raise NotImplementedError("<problem>")` at the block's indentation.
Staff-only files (STAFF_ONLY below) are left out, and the student README replaces the staff one. Usage:

    python scripts/make_handout.py --out handout/ [--repo .]
"""

import argparse
import ast
import fnmatch
import io
import os
import re
import shutil
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

# Paths left out of the handout (relative to the repository root, "/" separated). An entry ending in "/"
# is a folder; other entries are file names or glob patterns.
STAFF_ONLY = (
    ".ci/",  # the staff repository's CI
    "scripts/make_handout.py",
    "scripts/check_tests.py",  # the wrong-solution catalog and its runner
    "cs336_grading/catalog.py",
    "tests/test_catalog.py",
    "scripts/make_reference_outputs.py",
    "tests/test_handout.py",
    "tests/test_repo.py",  # ruff on stripped code and the staff CI script are not the students' concern
    "tests/test_docs.py",  # the staff tree's docs hygiene
    "tests/hidden/",
    "assignments/staff/",
)

# Files the handout takes from elsewhere in the tree: the student README replaces the staff one.
REPLACED = {"README.md": "assignments/README.student.md"}

# Folders skipped when the source is not a git checkout.
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints", "build", "dist"}
SKIP_DIRS |= {"handout", "runs", ".venv", "venv"}

BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION(?P<problem>([ \t].*)?)$")
END = re.compile(r"^(?P<indent>[ \t]*)# END SOLUTION[ \t]*$")
ANY_MARKER = re.compile(r"^[ \t]*#.*\b(BEGIN|END)[ \t]+SOLUTION\b")
PROBLEM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SolutionMarkerError(ValueError):
    """A solution marker is malformed, unbalanced, nested or outside a function body."""


def strip_solutions(text: str, path: str = "<string>") -> tuple[str, list[str]]:
    """Replace every solution block of one Python source by a raise; return (new text, problems in order)."""
    new_text, blocks = _strip(text, path)
    return new_text, [problem for problem, _ in blocks]


def _strip(text: str, path: str) -> tuple[str, list[tuple[str, int]]]:
    """strip_solutions, also returning the line of each block's BEGIN."""
    if "SOLUTION" not in text:
        return text, []

    def error(n: int, message: str) -> SolutionMarkerError:
        return SolutionMarkerError(f"{path}:{n}: {message}")

    comments = _comment_lines(text, path)
    out: list[str] = []
    blocks: list[tuple[str, int]] = []
    open_block = None  # (line number, indent, problem) of the BEGIN we are inside
    for n, line in enumerate(text.splitlines(keepends=True), start=1):
        body = line.rstrip("\r\n")
        if n not in comments or not ANY_MARKER.match(body):
            if open_block is None:
                out.append(line)
            continue
        begin, end = BEGIN.match(body), END.match(body)
        if begin:
            problem = begin["problem"].strip()
            if open_block is not None:
                raise error(n, f"BEGIN SOLUTION inside the block opened at line {open_block[0]}")
            if not PROBLEM_NAME.match(problem):
                raise error(n, "write the marker as '# BEGIN SOLUTION <problem_name>'")
            open_block = (n, begin["indent"], problem)
        elif end:
            if open_block is None:
                raise error(n, "END SOLUTION without a BEGIN SOLUTION")
            start, indent, problem = open_block
            if end["indent"] != indent:
                raise error(n, f"END SOLUTION is not indented like its BEGIN (line {start})")
            newline = "\r\n" if line.endswith("\r\n") else "\n"
            out.append(f'{indent}raise NotImplementedError("{problem}"){newline}')
            blocks.append((problem, start))
            open_block = None
        else:
            raise error(n, f"malformed solution marker: {body.strip()!r}")
    if open_block is not None:
        raise error(open_block[0], "BEGIN SOLUTION without an END SOLUTION")
    if not blocks:
        return text, blocks
    _check_inside_functions(text, path, comments)
    new_text = "".join(out)
    try:
        compile(new_text, path, "exec")
    except SyntaxError as e:
        raise error(e.lineno or 0, f"the handout version is not valid Python: {e.msg}") from e
    return new_text, blocks


def _comment_lines(text: str, path: str) -> set[int]:
    """Line numbers holding only a comment (so a marker quoted inside a string is not a marker)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        raise SolutionMarkerError(f"{path}: not valid Python: {e}") from e
    comments = [tok for tok in tokens if tok.type == tokenize.COMMENT]
    return {tok.start[0] for tok in comments if not tok.line[: tok.start[1]].strip()}


def _check_inside_functions(text: str, path: str, comments: set[int]) -> None:
    """Every BEGIN SOLUTION must sit in a function body, else the handout would fail on import."""
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        raise SolutionMarkerError(f"{path}:{e.lineno}: not valid Python: {e.msg}") from e
    spans = [
        (node.lineno + 1, node.end_lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    for n, line in enumerate(text.splitlines(), start=1):
        if n in comments and BEGIN.match(line) and not any(first <= n <= last for first, last in spans):
            raise SolutionMarkerError(f"{path}:{n}: BEGIN SOLUTION must be inside a function body")


def is_staff_only(rel: str) -> bool:
    for pattern in STAFF_ONLY:
        if pattern.endswith("/") and rel.startswith(pattern):
            return True
        if fnmatch.fnmatchcase(rel, pattern):
            return True
    return False


def list_files(src: Path) -> list[str]:
    """The repository's files ("/" separated, relative to src): git's tracked and untracked-but-not-ignored
    files in a git checkout, else every file outside SKIP_DIRS."""
    if (src / ".git").exists():
        git = ["git", "-C", str(src), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
        try:
            listed = subprocess.run(git, check=True, capture_output=True).stdout.decode()
        except (OSError, subprocess.CalledProcessError) as e:
            raise RuntimeError(f"git ls-files failed in {src}: {e}") from e
        names = {name for name in listed.split("\0") if name}
        return sorted(name for name in names if (src / name).is_file())  # drop files deleted from the tree
    files = []
    for root, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        rel_root = Path(root).relative_to(src)
        files += [(rel_root / name).as_posix() for name in names if not name.endswith((".pyc", ".pyo"))]
    return sorted(files)


def solution_blocks(src: Path) -> dict[str, list[str]]:
    """problem -> ["path:line", ...] of the solution blocks in the handout's .py files."""
    blocks: dict[str, list[str]] = {}
    for rel in list_files(src):
        if rel.endswith(".py") and not is_staff_only(rel):
            for problem, n in _strip((src / rel).read_text(encoding="utf-8"), rel)[1]:
                blocks.setdefault(problem, []).append(f"{rel}:{n}")
    return blocks


def make_handout(src: Path, out: Path) -> dict:
    """Write the handout of src into out (which must be empty or absent). Returns a summary."""
    src, out = src.resolve(), out.resolve()
    if not src.is_dir():
        raise FileNotFoundError(f"--repo {src} is not a folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty folder")
    files = [rel for rel in list_files(src) if not (src / rel).resolve().is_relative_to(out)]
    kept = [rel for rel in files if not is_staff_only(rel) and rel not in REPLACED.values()]
    # Strip everything before writing anything, so an error leaves no half-written handout.
    stripped: dict[str, str] = {}
    blocks: Counter = Counter()
    for rel in kept:
        if rel.endswith(".py"):
            text = (src / rel).read_text(encoding="utf-8")
            new_text, problems = strip_solutions(text, rel)
            if problems:
                stripped[rel] = new_text
                blocks.update(problems)
    for rel in kept:
        dst = out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel in REPLACED and (src / REPLACED[rel]).is_file():
            shutil.copy2(src / REPLACED[rel], dst)
        elif rel in stripped:
            with open(dst, "w", encoding="utf-8", newline="") as f:
                f.write(stripped[rel])
            shutil.copymode(src / rel, dst)
        else:
            shutil.copy2(src / rel, dst)
    committed = _git_init(out)
    return {
        "files": len(kept),
        "left_out": len(files) - len(kept),
        "blocks": blocks,
        "out": out,
        "git": committed,
    }


def _git_init(out: Path) -> bool:
    """Make the handout a git repository with one commit of the starting code, so a student can
    `git diff` their own work; False (and no repository) if git is missing or fails."""
    if shutil.which("git") is None:
        return False
    who = [
        "-c",
        "user.name=CS336 staff",
        "-c",
        "user.email=staff@cs336.invalid",
        "-c",
        "commit.gpgsign=false",
    ]
    for cmd in (
        ["init", "-q"],
        ["add", "-A"],
        [*who, "commit", "-q", "-m", "The handout: the starting code"],
    ):
        if subprocess.run(["git", "-C", str(out), *cmd], capture_output=True).returncode != 0:
            shutil.rmtree(out / ".git", ignore_errors=True)
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write the handout into")
    parser.add_argument("--repo", default=Path(__file__).resolve().parents[1], type=Path, help="source tree")
    args = parser.parse_args(argv)
    try:
        summary = make_handout(args.repo, args.out)
    except (SolutionMarkerError, OSError, RuntimeError, UnicodeDecodeError) as e:
        print(f"make_handout: error: {e}", file=sys.stderr)
        return 2
    blocks = summary["blocks"]
    per_problem = ", ".join(f"{p} {c}" for p, c in sorted(blocks.items())) or "none"
    print(
        f"make_handout: wrote {summary['files']} files to {summary['out']} "
        f"({summary['left_out']} staff-only left out); stripped {sum(blocks.values())} blocks: {per_problem}"
        + ("; a git repository with the starting code committed" if summary["git"] else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

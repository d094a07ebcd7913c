"""assignments/: the walkthrough notebooks (stored without outputs, each runs top to bottom) and the
handout (its points per problem are those of the graded tests).

The notebooks are executed with nbclient in a kernel started from this very interpreter (a kernel
spec written to a temporary folder, so no `ipykernel install` is needed and no other Python on the
PATH is picked up), in the repository root, with the checkout first on PYTHONPATH. In the student
handout the notebooks need the finished solutions: a notebook that stops on NotImplementedError is
skipped and names the problem it is waiting for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "assignments").glob("*.ipynb"))
EXPECTED = {"01_decode_is_memory_bound.ipynb", "02_kv_cache_variants.ipynb", "03_sampling.ipynb"}
CELL_TIMEOUT = 600  # seconds per cell; the notebooks take well under 2 minutes on an idle CPU
HANDOUT = REPO / "assignments" / "handout.md"
PROBLEM_HEADING = re.compile(r"^#+ Problem \((\w+)\): .* \((\d+(?:\.\d+)?) points?\)\s*$", re.MULTILINE)
COLLECTOR = """
import json, os

def pytest_collection_modifyitems(config, items):
    graded = [item.get_closest_marker("graded") for item in items]
    rows = [[m.kwargs.get("problem"), m.kwargs.get("points")] for m in graded if m is not None]
    with open(os.environ["CS336_GRADED_OUT"], "w") as f:
        json.dump(rows, f)
"""


def graded_points() -> dict[str, float]:
    """Points per problem over the graded tests pytest collects (parametrized tests count once each)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cs336_collect_graded.py").write_text(COLLECTOR)
        out = Path(tmp) / "graded.json"
        paths = [tmp, str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "CS336_GRADED_OUT": str(out)}
        cmd = [sys.executable, "-m", "pytest", "tests", "--collect-only", "-q", "-m", "graded"]
        cmd += ["-p", "cs336_collect_graded", "-p", "no:cacheprovider"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        assert proc.returncode == 0 and out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
        rows = json.loads(out.read_text())
    points: dict[str, float] = {}
    for problem, n in rows:
        points[problem] = points.get(problem, 0) + n
    return points


def test_handout_points_equal_the_graded_tests():
    """handout.md and the later parts (assignments/part*.md): each file's headings add up to its own
    total line, and all the headings together are the graded tests' points."""
    headings: dict[str, float] = {}
    for path in [HANDOUT, *sorted(HANDOUT.parent.glob("part*.md"))]:
        text = path.read_text()
        found = {name: float(n) for name, n in PROBLEM_HEADING.findall(text)}
        total = re.search(r"\*\*total\*\* \| \*\*(\d+(?:\.\d+)?)\*\*", text)
        assert total and float(total.group(1)) == sum(found.values()), (
            f"{path.name}: total != sum of its problems"
        )
        assert not set(found) & set(headings), f"{path.name} repeats a problem of another file"
        headings |= found
    graded = graded_points()
    assert headings == graded, "'Problem (name): ... (N points)' headings != graded test points"


def test_the_walkthroughs_exist():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} have outputs or execution counts; "
        f"run: python scripts/build_notebooks.py --strip {path.relative_to(REPO)}"
    )


def kernel_manager(folder: Path):
    """A kernel manager whose only kernel, "python3", is ipykernel on this interpreter."""
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    write_kernel_spec(folder / "python3")  # argv: [sys.executable, "-m", "ipykernel_launcher", ...]
    specs = KernelSpecManager(kernel_dirs=[str(folder)], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    for module in ("nbformat", "nbclient", "ipykernel", "jupyter_client"):
        pytest.importorskip(module, reason=f"running the notebooks needs {module} (pip install -e '.[test]')")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    km = kernel_manager(tmp_path / "kernels")
    client = NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, resources={"metadata": {"path": str(REPO)}})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    # One torch thread unless the caller chose: test workers run side by side on few cores, and
    # oversubscribed threads make small CPU ops many times slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        if e.ename == "NotImplementedError":
            pytest.skip(f"{path.name} needs the solution to problem {e.evalue}")
        raise
    finally:
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors

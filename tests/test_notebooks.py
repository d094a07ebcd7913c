"""assignments/: the walkthrough notebooks (stored without outputs, each runs top to bottom).
(The handout's points against the graded tests are checked with the rubric, by the staff tests.)

The .ipynb files are the source: edit them in Jupyter, then clear all outputs before committing
(Edit > Clear Outputs of All Cells, or `jupyter nbconvert --clear-output --inplace <notebook>`).

The notebooks are executed with nbclient in a kernel started from this very interpreter (a kernel
spec written to a temporary folder, so no `ipykernel install` is needed and no other Python on the
PATH is picked up), in the repository root, with the checkout first on PYTHONPATH. In the student
handout the notebooks need the finished solutions: a notebook that stops on one of the handout's
stubs (`raise NotImplementedError("<problem>")`) is skipped and names the problem it is waiting for.
In the reference (the checkout still has its solution blocks) every notebook must run.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from cs336_grading.rubric import handout_problems

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "assignments").glob("*.ipynb"))
EXPECTED = {
    "01_decode_is_memory_bound.ipynb",
    "02_kv_cache_variants.ipynb",
    "03_sampling.ipynb",
    "04_quantization.ipynb",
    "05_speculative.ipynb",
    "06_pruning.ipynb",
    "07_serving.ipynb",
    "08_sharding.ipynb",
}
CELL_TIMEOUT = 600  # seconds per cell; the notebooks take well under 2 minutes on an idle CPU
HANDOUT = REPO / "assignments" / "handout.md"
PACKAGE = REPO / "cs336_inference"
PROBLEMS = tuple(handout_problems(REPO))
SOLUTION_MARKER = re.compile(r"^[ \t]*# BEGIN SOLUTION\b", re.MULTILINE)


def test_the_walkthroughs_exist():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    assert nb.get("nbformat") == 4, f"{path.name}: not an nbformat 4 notebook"
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"{path.name}: cells {dirty} have outputs or execution counts; clear them: "
        f"jupyter nbconvert --clear-output --inplace {path.relative_to(REPO)}"
    )


def stubbed_problem(ename: str, evalue: str, package: Path) -> str | None:
    """The problem a notebook stopped on, if `package` is the student handout's and the error is the
    stub that replaced that problem's solution; None if the notebook simply failed.

    The handout is recognised by having no solution markers left, a stub by its message: one of the
    problem names, raised by a line the handout maker wrote. Any other NotImplementedError (in the
    reference, or one the code raises on purpose) is a real failure.
    """
    if ename != "NotImplementedError" or evalue not in PROBLEMS:
        return None
    sources = [p.read_text(encoding="utf-8") for p in sorted(package.rglob("*.py"))]
    if any(SOLUTION_MARKER.search(text) for text in sources):
        return None
    stub = f'raise NotImplementedError("{evalue}")'
    return evalue if any(stub in text for text in sources) else None


def test_only_a_handout_stub_skips_a_notebook(tmp_path):
    marker = "    # BEGIN " + "SOLUTION rope\n"  # split so that make_handout does not see a marker here
    reference, handout = tmp_path / "reference", tmp_path / "handout"
    for folder, body in [
        (reference, marker + "    return x\n    # END " + "SOLUTION\n"),
        (handout, '    raise NotImplementedError("rope")\n'),
    ]:
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "layers.py").write_text("def rope(x):\n" + body)
        (folder / "other.py").write_text('def f():\n    raise NotImplementedError("not yet supported")\n')
    assert stubbed_problem("NotImplementedError", "rope", handout) == "rope"
    # The reference's NotImplementedError, an error other than a stub, another exception: failures.
    assert stubbed_problem("NotImplementedError", "rope", reference) is None
    assert stubbed_problem("NotImplementedError", "not yet supported", handout) is None
    assert stubbed_problem("NotImplementedError", "mla", handout) is None
    assert stubbed_problem("NotImplementedError", "", handout) is None
    assert stubbed_problem("ValueError", "rope", handout) is None


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
        problem = stubbed_problem(e.ename, e.evalue, PACKAGE)
        if problem is not None:
            pytest.skip(f"{path.name} needs the solution to problem {problem}")
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

"""Shared pytest setup: one torch thread, CUDA skips, and the grading plugin (graded markers, isolation)."""

import os

import pytest
import torch

# The fp32 product plans (fast/autotune.py) are measured in each test process, never read from or
# written to the user's plans file.
os.environ["CS336_AUTOTUNE_CACHE"] = "0"

# The grading plugin: checks the `graded` markers; `--submission DIR` grades DIR problem by problem.
pytest_plugins = ("cs336_grading.plugin",)

# One torch thread per test process. The tests run tiny models, which gain nothing from threads,
# and with pytest -n 2 on two cores, two OpenMP threads per worker stall at every barrier while the
# other worker holds a core (seen here: 20x slower matmuls).
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in cuda_items:
            item.add_marker(skip)


@pytest.fixture(params=["haswell", "x86-64"])
def march(request, monkeypatch):
    """The kernels built for an AVX2 CPU (8 lanes) or plain x86-64 (4 lanes, no intrinsics), on
    whatever CPU runs the tests; the normal build again afterwards (tests/test_kernels.py, test_a8.py)."""
    from cs336_inference.fast.cpu import build

    monkeypatch.delenv("CS336_KERNELS", raising=False)
    monkeypatch.setenv("CS336_KERNELS_MARCH", request.param)
    build.reset()
    if build.library() is None:
        build.reset()
        pytest.skip(f"could not build for -march={request.param} here")
    yield request.param
    build.reset()

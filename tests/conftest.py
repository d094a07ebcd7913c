"""Shared pytest setup: one torch thread, CUDA skips, and the grading plugin (graded markers, isolation)."""

import pytest
import torch

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

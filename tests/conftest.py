"""Shared pytest setup: CUDA skips and a check of the `graded` markers."""

import pytest
import torch

# One torch thread per test process. The tests run tiny models, which gain nothing from threads,
# and with pytest -n 2 on two cores, two OpenMP threads per worker stall at every barrier while the
# other worker holds a core (seen here: 20x slower matmuls).
torch.set_num_threads(1)

# The assignment's problems. A graded test must name one of these; solution blocks use the same names.
PROBLEMS = (
    "rmsnorm",
    "rope",
    "swiglu",
    "attention",
    "sliding_window",
    "cla",
    "mla",
    "transformer_lm",
    "kv_cache",
    "ring_cache",
    "mla_cache",
    "naive_generate",
    "generate",
    "sampling",
    "matmul_accounting",
    "mlp_attention_accounting",
    "kv_cache_bytes",
    "latency_throughput",
    "speculative_accounting",
    "int8_absmax",
    "int4_groupwise",
    "q8_0",
    "llm_int8",
    "awq",
)


def check_graded_marker(item: pytest.Item) -> None:
    """Raise pytest.UsageError unless the test's `graded` marker reads graded(problem=<known>, points=<n>)."""
    marker = item.get_closest_marker("graded")
    if marker is None:
        return
    where = item.nodeid
    if marker.args or set(marker.kwargs) != {"problem", "points"}:
        raise pytest.UsageError(f"{where}: write the marker as @pytest.mark.graded(problem=..., points=...)")
    problem, points = marker.kwargs["problem"], marker.kwargs["points"]
    if problem not in PROBLEMS:
        raise pytest.UsageError(f"{where}: unknown problem {problem!r}; known: {', '.join(PROBLEMS)}")
    if isinstance(points, bool) or not isinstance(points, int | float) or points <= 0:
        raise pytest.UsageError(f"{where}: points must be a positive number, got {points!r}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        check_graded_marker(item)
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if cuda_items and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in cuda_items:
            item.add_marker(skip)

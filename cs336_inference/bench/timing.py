"""Timing on CPU and GPU: a stopwatch, the median of several runs after warm-up, and the machine's
two roofline numbers (read bandwidth and matmul FLOP/s).

Every speed this project reports is a median of runs after warm-up (the first run pays for memory
allocation, caches and lazy initialisation). On a GPU, kernels run asynchronously: `Timer`
synchronises before and after, `median_seconds` uses CUDA events.

    t = median_seconds(lambda: model(ids), repeats=5)          # seconds
    with Timer() as timer:
        work()
    timer.seconds
    read_bandwidth(256 * 2**20)                                # bytes per second
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

Clock = Callable[[], float]


def as_device(device: torch.device | str | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued kernels (a no-op on the CPU, where every op is synchronous)."""
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall-clock seconds of a `with` block, the device synchronised at both ends.

    `clock` is the time source (time.perf_counter; tests pass a fake one).
    """

    def __init__(self, device: torch.device | str | None = None, clock: Clock = time.perf_counter):
        self.device, self.clock = as_device(device), clock
        self.seconds: float | None = None

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self._start = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = self.clock() - self._start


def median_seconds(
    fn: Callable[[], object],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
    clock: Clock = time.perf_counter,
) -> float:
    """Median seconds of `repeats` calls of fn() after `warmup` untimed calls.

    On a CUDA device each call is timed with CUDA events (GPU time, no host overhead in between).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    device = as_device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            with Timer(device, clock) as timer:
                fn()
            times.append(timer.seconds)
    return statistics.median(times)


def interleaved_rounds(
    contenders: dict[str, Callable[[], float]], rounds: int, log: Callable[[str], None], fmt: str = ".1f"
) -> dict[str, list[float]]:
    """{name: [seconds per round]}: each contender's fn() (which times itself and returns seconds per
    token) once untimed, then `rounds` rounds of one call each, in turn, so that a machine's drift
    (load, clocks, memory bandwidth) is shared by all contenders; logs each warm-up and round."""
    for name, fn in contenders.items():  # warm-up (builds kernels, plans layouts, compiles, records)
        log(f"  warm-up: {name}" + (" (compiling, about 2 minutes)" if name.endswith("compiled") else ""))
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name, fn in contenders.items():
            times[name].append(fn())
        log(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {1 / v[-1]:{fmt}}" for k, v in times.items())
            + " tok/s"
        )
    return times


def read_bandwidth(
    n_bytes: int, device: torch.device | str | None = None, repeats: int = 5, warmup: int = 2
) -> float:
    """Bytes per second reading a float32 buffer of about n_bytes (x.sum(): one read, almost no writes).

    Choose n_bytes well beyond the last-level cache (see `last_level_cache_bytes`) to measure main
    memory, or the size of a model's weights to measure what a decode step can hope for.
    """
    if n_bytes < 4:
        raise ValueError(f"n_bytes must be at least 4 (one float32), got {n_bytes}")
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=as_device(device))
    return x.nbytes / median_seconds(x.sum, repeats, warmup, device)


def matmul_flops_per_second(
    n: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, repeats: int = 5
) -> float:
    """FLOP/s of an [n, n] @ [n, n] matmul (2n^3 FLOPs): the machine's compute roof for this dtype."""
    device = as_device(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / median_seconds(lambda: torch.matmul(a, b, out=out), repeats, device=device)


def last_level_cache_bytes(device: torch.device | str | None = None) -> int | None:
    """Size of the largest cache (L3 on a CPU, from sysfs; L2 on a GPU), or None if unknown."""
    device = as_device(device)
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    best = None
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            n = int(size.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        except (OSError, ValueError):
            continue
        if best is None or (level, n) > best:
            best = (level, n)
    return None if best is None else best[1]

"""How many threads to decode with on this machine now: as many as there are idle cores.

A decode step is a chain of short parallel regions (one per product), each ending at a barrier. When
another process holds one of the cores, the thread that shares it is descheduled for whole time
slices, and every barrier waits for it: on 2 cores with one kept busy, SmolLM2 decoded at 20 tokens/s
with 2 threads and 54 with 1 (AMD EPYC Zen 5, 2026-11-25, `yes > /dev/null` on the other core). So the
CLI samples how busy the cores it may use are, for a fraction of a second, and takes one thread per
idle core.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def _cpu_times(stat: str) -> dict[int, tuple[int, int]]:
    """cpu index -> (idle jiffies, total jiffies), from the text of /proc/stat."""
    out = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in fields]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            out[int(name[3:])] = (idle, sum(values[:8]))  # user .. steal; guest time is inside user
    return out


def idle_cores(before: str, after: str, cpus: set[int]) -> float:
    """How many of `cpus` were idle between two readings of /proc/stat (a sum of idle fractions)."""
    t0, t1 = _cpu_times(before), _cpu_times(after)
    idle = 0.0
    for cpu in cpus & t0.keys() & t1.keys():
        d_idle, d_total = t1[cpu][0] - t0[cpu][0], t1[cpu][1] - t0[cpu][1]
        idle += d_idle / d_total if d_total > 0 else 1.0
    return idle


def auto_threads(sample_s: float = 0.25) -> tuple[int, float | None]:
    """(threads, idle cores measured): one thread per idle core this process may use, at least one;
    (all of them, None) where /proc/stat cannot be read."""
    cpus = (
        set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    )
    stat = Path("/proc/stat")
    try:
        before = stat.read_text()
        time.sleep(sample_s)
        after = stat.read_text()
    except OSError:
        return len(cpus), None
    idle = idle_cores(before, after, cpus)
    return max(1, min(len(cpus), int(idle + 0.3))), idle  # 0.7 of a core idle counts as one


def in_passing_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread of its own that ends when fn returns; its result, or its
    exception raised here.

    For the work (loading a model, installing the kernels) of a process whose decode steps then run
    on another thread, as the server's engine loop does. Every thread that starts a parallel region
    gets an OpenMP team of its own, which lives as long as the thread. Once a process's teams hold
    more threads than there are cores, libgomp waits at its barriers with only a short spin before
    sleeping (the GOMP_SPINCOUNT entry of its manual), and a decode step is hundreds of barriers:
    the engine's steps slow down for as long as such a thread lives, and not after it has ended.
    """
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 (raised again on the calling thread)
            error.append(e)

    thread = threading.Thread(target=run, name=getattr(fn, "__name__", "passing"))
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]

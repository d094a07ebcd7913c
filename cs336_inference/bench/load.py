"""Loading a GGUF file: seconds and peak memory, dequantized to float32 against packed.

`load_pretrained(path)` dequantizes every tensor into a float32 model; `load_pretrained(path,
packed=True)` keeps the quantized matrices as the file stores them (io/gguf_packed.py). Peak resident
memory is a process's high-water mark, so every load runs in a process of its own; what it reports is
that mark after loading, and the mark before (Python, torch and this package imported), whose
difference is what the model costs. `python scripts/benchmark.py load --markdown docs/measured/load.md`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys, time
def hwm():  # this process's peak resident kB (VmHWM; ru_maxrss would start from the parent's at the fork)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
import torch
from cs336_inference import load_pretrained
before = hwm()
start = time.perf_counter()
model = load_pretrained(sys.argv[1], packed=sys.argv[2] == "packed")
seconds = time.perf_counter() - start
after = hwm()
print(json.dumps({"seconds": seconds, "before_kb": before, "after_kb": after}))
"""
MODES = ("float32", "packed")


def load_once(path: Path, mode: str) -> dict:
    """One load in a fresh process: its seconds and its peak memory before and after (kB)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True)
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"loading {path} ({mode}) failed: {tail[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_load(models: list[str], runs: int) -> dict:
    """Each model loaded `runs` times in each mode, alternating; medians of seconds, the largest peak."""
    from cs336_inference.io.sources import resolve_checkpoint

    rows = []
    for name in models:
        path = resolve_checkpoint(name).path
        if resolve_checkpoint(name).kind != "gguf":
            raise ValueError(f"{name} is not a GGUF file (the load benchmark compares a file's two loads)")
        seen: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for i in range(runs):
            for mode in MODES:
                seen[mode].append(load_once(path, mode))
                print(
                    f"  {path.name} {mode} run {i + 1}/{runs}: {seen[mode][-1]['seconds']:.2f} s",
                    file=sys.stderr,
                )
        size = path.stat().st_size
        for mode in MODES:
            peak = max(r["after_kb"] for r in seen[mode]) * 1024
            base = min(r["before_kb"] for r in seen[mode]) * 1024
            rows.append(
                dict(
                    model=path.name,
                    file_bytes=size,
                    mode=mode,
                    seconds=statistics.median(r["seconds"] for r in seen[mode]),
                    peak_bytes=peak,
                    model_bytes=peak - base,
                )  # fmt: skip
            )
    return {"rows": rows, "table": format_load(rows), "runs": runs}


def format_load(rows: list[dict]) -> str:
    mb = 1 << 20
    lines = [
        f"{'model':36s} {'file MB':>8s} {'load':8s} {'seconds':>8s} {'peak MB':>8s} {'model MB':>9s} {'/ file':>7s}"
    ]
    for r in rows:
        lines.append(
            f"{r['model'][:36]:36s} {r['file_bytes'] / mb:8.1f} {r['mode']:8s} {r['seconds']:8.2f} "
            f"{r['peak_bytes'] / mb:8.1f} {r['model_bytes'] / mb:9.1f} {r['model_bytes'] / r['file_bytes']:7.2f}"
        )
    lines.append("model MB: the peak after loading less the peak before it (Python, torch and the package)")
    return "\n".join(lines)

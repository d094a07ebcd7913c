"""Decode speed on a busy machine (scripts/benchmark.py contention).

Course machines and CI runners are shared: another process often holds a core. A decode step is a
chain of short parallel regions, each ending at a barrier, so a thread whose core is taken stalls
every region (fast/threads.py). This benchmark measures each entry point's decode tokens/s idle and
with one core kept busy by a CPU-burning child process that the benchmark starts and stops itself
(bounded: the child also exits on its own after `burn_limit_s`).

    CLI default      the single-stream native step with `auto_threads()` (what scripts/generate.py runs)
    native, all      the same step with one thread per core (torch's default for a library user)
    readable, auto   `generate` on the readable model with auto threads (generate.py --eager)
    engine n, auto   LLMEngine on the fast path with n requests decoding, auto threads (scripts/serve.py)
    engine n, all    the same with one thread per core

The thread count of an "auto" row is chosen again in each phase, as a fresh process would choose it.
The phases alternate over `rounds` (idle, busy, idle, busy, ...), and each row's tokens/s is the
median over the rounds: memory bandwidth drifts on a shared machine, and one idle pass measured
minutes before its busy pass can be a third faster or slower. "kept" is the median of the rounds'
busy / idle ratios, its range given beside it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from cs336_inference.bench.engine import EngineSteps, StreamSteps, synthetic_prompt
from cs336_inference.fast import install, uninstall
from cs336_inference.fast.threads import auto_threads

BURNER = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end:\n    pass\n"


class Burner:
    """A child process that keeps one core busy until stopped (or `limit_s` passes)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Burner:
        code = BURNER.format(limit=float(self.limit_s))
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)
        time.sleep(0.5)  # let it take its core before the threads are counted
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


class ReadableSteps:
    """`generate`'s cached decode on the readable model: `step()` times one step of one sequence."""

    def __init__(self, model, prompt_len: int, steps: int):
        prompt = torch.tensor([synthetic_prompt(model.config.vocab_size, prompt_len)])
        self.model, self.cache = model, model.new_cache(1, prompt_len + steps + 8)
        self.token = model(prompt, cache=self.cache)[:, -1:].argmax(-1)
        self.n = 1

    def step(self) -> float:
        start = time.perf_counter()
        self.token = self.model(self.token, cache=self.cache)[:, -1:].argmax(-1)
        return time.perf_counter() - start


def _rows(model, sizes: list[int], prompt_len: int, steps: int):
    """name -> (threads policy, make(model) -> an object with step() and n, fast path or not)."""
    rows = {
        "CLI default (native, auto)": ("auto", lambda: StreamSteps(model, prompt_len, steps), True),
        "native, all cores": ("all", lambda: StreamSteps(model, prompt_len, steps), True),
        "readable, auto": ("auto", lambda: ReadableSteps(model, prompt_len, steps), False),
    }
    for n in sizes:
        rows[f"engine {n}, auto"] = ("auto", lambda n=n: EngineSteps(model, n, prompt_len, steps), True)
        rows[f"engine {n}, all cores"] = ("all", lambda n=n: EngineSteps(model, n, prompt_len, steps), True)
    return rows


@torch.inference_mode()
def contention_benchmark(
    model,
    sizes: list[int],
    prompt_len: int = 64,
    steps: int = 16,
    burn_limit_s: float = 1800.0,
    rounds: int = 1,
    log: Callable[[str], None] = print,
) -> dict:
    """Median decode tokens/s of every row (module docstring), idle and with one core busy."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    default_threads = torch.get_num_threads()
    runs: dict[str, dict[str, list]] = {}  # name -> phase -> [(threads, tokens/s) per round]
    for r, phase in [(r, phase) for r in range(rounds) for phase in ("idle", "one core busy")]:
        log(f"round {r + 1}/{rounds}, {phase}:")
        burner = Burner(burn_limit_s) if phase != "idle" else None
        if burner is not None:
            burner.__enter__()
        try:
            for name, (policy, make, fast) in _rows(model, sizes, prompt_len, steps + 3).items():
                threads = auto_threads()[0] if policy == "auto" else cores
                torch.set_num_threads(threads)
                (install if fast else uninstall)(model)
                row = make()
                for _ in range(3):
                    row.step()
                times = [row.step() for _ in range(steps)]
                tok_s = row.n / statistics.median(times)
                runs.setdefault(name, {}).setdefault(phase, []).append((threads, tok_s))
                log(f"  {name}: {threads} thread(s), {tok_s:.1f} tok/s")
        finally:
            if burner is not None:
                burner.__exit__(None, None, None)
            torch.set_num_threads(default_threads)
            install(model)
    results = {}
    for name, phases in runs.items():
        results[name] = {
            phase: dict(threads=statistics.mode(t for t, _ in got), tokens_per_s=statistics.median(v for _, v in got),
                        tokens_per_s_rounds=[v for _, v in got])
            for phase, got in phases.items()
        }  # fmt: skip
        kept = [b / i for (_, i), (_, b) in zip(phases["idle"], phases["one core busy"], strict=True)]
        results[name].update(kept=statistics.median(kept), kept_rounds=kept)
    return dict(rows=results, cores=cores, prompt_len=prompt_len, timed_steps=steps, rounds=rounds)


def format_contention_table(result: dict) -> str:
    out = [
        "| entry point | idle: threads | idle: tok/s | one core busy: threads | one core busy: tok/s | kept |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result["rows"].items():
        idle, busy = r["idle"], r["one core busy"]
        k = r.get("kept_rounds", [])
        spread = f" ({min(k):.0%}-{max(k):.0%})" if len(k) > 1 else ""
        out.append(
            f"| {name} | {idle['threads']} | {idle['tokens_per_s']:.1f} | {busy['threads']} | "
            f"{busy['tokens_per_s']:.1f} | {r['kept']:.0%}{spread} |"
        )
    return "\n".join(out)

"""Static vs continuous batching on a generated serving workload (scripts/benchmark.py serve).

The workload (seeded): requests arrive as a Poisson process of a given rate; prompt and output
lengths are log-normal (a long right tail: most requests are short, a few are long); a share of
the prompts start with one common system prompt. Every request generates exactly its
max_new_tokens (no stop tokens), so both systems do the same useful work.

    static      FCFS batches of up to B waiting requests, left-padded and run by
                `sampling.generate_steps` with one contiguous cache of B x (longest prompt +
                longest output) slots; the batch runs until its longest request ends, and requests
                that arrive meanwhile wait for the next batch.
    continuous  `LLMEngine`: requests join and leave at every step, the KV cache is paged, and
                prompt prefixes already cached are not recomputed.

Time is simulated from measured compute: a clock advances by the measured duration of each
forward (step), and jumps to the next arrival when the system is idle. So arrivals never wait for
the machine's other jobs, and a run takes only as long as its compute.
Per request: TTFT = first token - arrival (queueing included), TPOT = (last token - first token) /
(outputs - 1); static batching is credited with each row's own last token (as if streamed), not
the end of its batch. KV memory: at every step, slots reserved (static: the batch's contiguous
cache; engine: allocated blocks x block size) vs slots needed (prompt + tokens so far of every
live request), averaged over steps weighted by their duration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cs336_inference.sampling import generate_steps
from cs336_inference.serving import LLMEngine, SamplingParams


@dataclass
class WorkloadRequest:
    arrival: float  # seconds
    prompt_ids: list[int]
    max_new_tokens: int
    shared_prefix: bool


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int):
    return np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), lo, hi).astype(int)


def make_workload(
    num_requests: int,
    rate: float,
    vocab_size: int,
    seed: int = 0,
    prompt_median: float = 32,
    output_median: float = 32,
    sigma: float = 0.8,
    max_prompt: int = 256,
    max_output: int = 256,
    shared_fraction: float = 0.5,
    system_prompt_len: int = 64,
    first_id: int = 100,
) -> list[WorkloadRequest]:
    """num_requests requests, sorted by arrival; rate in requests per second (> 0).

    The same seed gives the same lengths and tokens at every rate (arrival gaps are unit-rate
    exponentials divided by rate), so a sweep over rates changes only the load. Token ids are
    uniform in [first_id, vocab_size) (first_id skips special tokens).
    """
    if num_requests < 1 or rate <= 0:
        raise ValueError(f"need num_requests >= 1 and rate > 0, got {num_requests}, {rate}")
    if not 0 <= shared_fraction <= 1:
        raise ValueError(f"shared_fraction must be in [0, 1], got {shared_fraction}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, num_requests)
    prompts = lognormal_lengths(rng, num_requests, prompt_median, sigma, 4, max_prompt)
    outputs = lognormal_lengths(rng, num_requests, output_median, sigma, 2, max_output)
    shared = rng.random(num_requests) < shared_fraction
    system = rng.integers(first_id, vocab_size, system_prompt_len).tolist()
    arrivals = np.cumsum(gaps) / rate
    out = []
    for i in range(num_requests):
        own = rng.integers(first_id, vocab_size, int(prompts[i])).tolist()
        ids = system + own if shared[i] else own
        out.append(WorkloadRequest(float(arrivals[i]), ids, int(outputs[i]), bool(shared[i])))
    return out


@dataclass
class Trace:
    """What one system did with a workload: per-request times (simulated seconds) and tokens."""

    first: list[float | None]
    last: list[float | None]
    tokens: list[list[int]]
    kv_reserved: float = 0.0  # slot-seconds
    kv_needed: float = 0.0
    busy: float = 0.0  # seconds of compute
    extra: dict | None = None

    def account_kv(self, reserved: int, needed: int, dt: float) -> None:
        self.kv_reserved += reserved * dt
        self.kv_needed += needed * dt


@torch.inference_mode()
def run_static(model, requests: list[WorkloadRequest], batch_size: int) -> Trace:
    """Static batching (module docstring)."""
    n = len(requests)
    trace = Trace([None] * n, [None] * n, [[] for _ in range(n)], extra={"batches": 0})
    clock, nxt, queue = 0.0, 0, []
    while nxt < n or queue:
        while nxt < n and requests[nxt].arrival <= clock:
            queue.append(nxt)
            nxt += 1
        if not queue:
            clock = requests[nxt].arrival
            continue
        batch, queue = queue[:batch_size], queue[batch_size:]
        T = max(requests[i].max_new_tokens for i in batch)
        P = max(len(requests[i].prompt_ids) for i in batch)
        reserved = len(batch) * (P + T)  # the contiguous cache generate allocates: B x (P + T)
        steps = generate_steps(model, [requests[i].prompt_ids for i in batch], T, temperature=0.0)
        for t in range(T):
            start = time.perf_counter()
            token, _ = next(steps)
            dt = time.perf_counter() - start
            clock += dt
            trace.busy += dt
            needed = 0
            for row, i in enumerate(batch):
                r = requests[i]
                if t < r.max_new_tokens:
                    trace.tokens[i].append(int(token[row]))
                    needed += len(r.prompt_ids) + t + 1
                    if t == 0:
                        trace.first[i] = clock
                    if t + 1 == r.max_new_tokens:
                        trace.last[i] = clock
            trace.account_kv(reserved, needed, dt)
        trace.extra["batches"] += 1
    return trace


@torch.inference_mode()
def run_engine(model, requests: list[WorkloadRequest], **engine_kwargs) -> Trace:
    """Continuous batching with LLMEngine (module docstring)."""
    n = len(requests)
    engine = LLMEngine(model, **engine_kwargs)
    trace = Trace([None] * n, [None] * n, [[] for _ in range(n)])
    index: dict[str, int] = {}
    clock, nxt = 0.0, 0
    while nxt < n or engine.has_unfinished():
        while nxt < n and requests[nxt].arrival <= clock:
            r = requests[nxt]
            params = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0, stop_token_ids=())
            index[engine.add_request(r.prompt_ids, params)] = nxt
            nxt += 1
        if not engine.has_unfinished():
            clock = requests[nxt].arrival
            continue
        start = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - start
        clock += dt
        trace.busy += dt
        for out in outputs:
            i = index[out.request_id]
            if out.new_token_ids and trace.first[i] is None:
                trace.first[i] = clock
            trace.tokens[i].extend(out.new_token_ids)
            if out.finished:
                trace.last[i] = clock
        stats = engine.stats()
        trace.account_kv(stats["allocated_token_slots"], stats["used_token_slots"], dt)
    stats = engine.stats()
    if stats["free_blocks"] != stats["num_blocks"]:
        raise RuntimeError(f"the engine leaked KV blocks: {stats}")
    trace.extra = stats
    return trace


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else float("nan")


def summarize_trace(requests: list[WorkloadRequest], trace: Trace) -> dict:
    """Throughput, TTFT / TPOT (median, p99), end-to-end latency, KV memory reserved vs needed."""
    n_out = sum(len(t) for t in trace.tokens)
    start = min(r.arrival for r in requests)
    end = max(x for x in trace.last if x is not None)
    ttft = [f - r.arrival for r, f in zip(requests, trace.first, strict=True)]
    tpot = [
        (last - first) / (len(toks) - 1)
        for first, last, toks in zip(trace.first, trace.last, trace.tokens, strict=True)
        if len(toks) > 1
    ]
    e2e = [last - r.arrival for r, last in zip(requests, trace.last, strict=True)]
    reserved = trace.kv_reserved / trace.busy
    needed = trace.kv_needed / trace.busy
    return {
        "requests": len(requests),
        "output_tokens": n_out,
        "makespan_s": end - start,
        "busy_s": trace.busy,
        "throughput_tok_s": n_out / (end - start),
        "ttft_median_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "e2e_median_s": percentile(e2e, 50),
        "kv_reserved_slots": reserved,  # time-averaged token slots
        "kv_needed_slots": needed,
        "kv_waste": max(0.0, 1.0 - needed / reserved) if reserved else 0.0,
    }


ENGINE_KEYS = ("preemptions", "prefix_hit_rate", "computed_tokens", "peak_used_blocks")


def serving_benchmark(
    model,
    rates: list[float],
    num_requests: int = 48,
    seed: int = 0,
    batch_size: int = 16,
    num_blocks: int = 256,
    block_size: int = 16,
    max_batch_tokens: int = 512,
    workload_kwargs: dict | None = None,
    log=lambda msg: None,
) -> dict:
    """Static vs continuous at every rate, plus the engine without prefix caching at the highest
    rate (what prefix sharing saves). A JSON-ready dict: {"workload": ..., "runs": [row, ...]}."""
    engine_kwargs = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_batch_tokens=max_batch_tokens,
        max_batch_seqs=batch_size,
    )
    runs = []
    rates = sorted(rates)
    for rate in rates:
        requests = make_workload(num_requests, rate, model.config.vocab_size, seed, **(workload_kwargs or {}))
        log(f"rate {rate:g} req/s: static batching")
        static = run_static(model, requests, batch_size)
        runs.append({"rate": rate, "system": "static"} | summarize_trace(requests, static) | static.extra)
        variants = [("continuous", True)] + (
            [("continuous, no prefix cache", False)] if rate == rates[-1] else []
        )
        for name, prefix_caching in variants:
            log(f"rate {rate:g} req/s: {name}")
            trace = run_engine(model, requests, **engine_kwargs, prefix_caching=prefix_caching)
            row = {"rate": rate, "system": name} | summarize_trace(requests, trace)
            row |= {k: trace.extra[k] for k in ENGINE_KEYS}
            # greedy both ways: each request's tokens should agree (float noise can flip a near tie)
            row["same_tokens_as_static"] = sum(
                a == b for a, b in zip(static.tokens, trace.tokens, strict=True)
            )
            runs.append(row)
    lengths = [len(r.prompt_ids) for r in requests]
    outputs = [r.max_new_tokens for r in requests]
    workload = {
        "num_requests": num_requests,
        "seed": seed,
        "prompt_tokens": sum(lengths),
        "output_tokens": sum(outputs),
        "shared_prefix_requests": sum(r.shared_prefix for r in requests),
        "prompt_len_median": float(np.median(lengths)),
        "prompt_len_max": max(lengths),
        "output_len_median": float(np.median(outputs)),
        "output_len_max": max(outputs),
    } | (workload_kwargs or {})
    return {"workload": workload, "engine": engine_kwargs, "runs": runs}


def format_serving_table(result: dict) -> str:
    """The runs as a markdown table."""
    head = (
        "| rate (req/s) | system | throughput (tok/s) | TTFT median / p99 (s) | TPOT median / p99 (ms) "
        "| KV reserved / needed (slots) | KV waste | prefix hit rate | tokens computed |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in result["runs"]:
        hit = r.get("prefix_hit_rate")
        lines.append(
            f"| {r['rate']:g} | {r['system']} | {r['throughput_tok_s']:.1f} "
            f"| {r['ttft_median_s']:.2f} / {r['ttft_p99_s']:.2f} "
            f"| {r['tpot_median_s'] * 1e3:.0f} / {r['tpot_p99_s'] * 1e3:.0f} "
            f"| {r['kv_reserved_slots']:.0f} / {r['kv_needed_slots']:.0f} | {r['kv_waste']:.0%} "
            f"| {'-' if hit is None else f'{hit:.0%}'} | {r.get('computed_tokens') or '-'} |"
        )
    return "\n".join(lines)


def plot_serving(result: dict, path) -> None:
    """Throughput and TTFT (median, p99) against the arrival rate, static vs continuous."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for system, color in (("static", "tab:red"), ("continuous", "tab:blue")):
        rows = [r for r in result["runs"] if r["system"] == system]
        rates = [r["rate"] for r in rows]
        ax1.plot(rates, [r["throughput_tok_s"] for r in rows], "o-", color=color, label=system)
        ax2.plot(rates, [r["ttft_median_s"] for r in rows], "o-", color=color, label=f"{system}, median")
        ax2.plot(rates, [r["ttft_p99_s"] for r in rows], "s--", color=color, label=f"{system}, p99")
    ax1.set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s", title="throughput")
    ax1.set_ylim(bottom=0)
    ax2.set(xlabel="arrival rate (requests/s)", ylabel="seconds", title="time to first token", yscale="log")
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["rate"] for r in result["runs"]}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

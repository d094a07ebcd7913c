"""Serving over HTTP, measured from the client (scripts/benchmark.py http).

What a practitioner would measure before choosing a server (vLLM's benchmark_serving does the same):
the server runs in its own process, a client in another process (bench/http_client.py, the
official `openai` client) sends streamed completions at Poisson arrival times, and every time is
taken on the client's clock.

The workload (seeded): prompt and output lengths log-normal (a long right tail: bench/serving.py's
`make_workload`), prompts cut from CPython's reference documentation (pydoc_data.topics) at those
lengths in SmolLM2's tokens, a share of them behind one common system prompt. Every rate has the
same lengths and order of requests, with its prompts cut from other places of the documentation
(`rate_workloads`): a server runs every rate in one process, and both ours (prefix caching) and
llama-server (its slots keep their last prompt) would otherwise answer a later rate's prompts from
the KV cache that an earlier rate left, measuring their caches instead of their prefill. Only the
system prompt is shared, within a rate and across rates. Every reply runs to its max_tokens (our
server: "ignore_eos"; llama.cpp's: a -100 bias on the EOS ids), so every system does the same work.

Systems, each started and stopped by the benchmark on a free port:
    continuous   scripts/serve.py: LLMEngine on the fast path (continuous batching, paged KV cache,
                 prefix caching)
    static       scripts/serve.py --static-batching: the same server admitting a new batch only once
                 the last has finished
    llama.cpp    llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`) on the
                 same GGUF, if that package is installed: one request at a time
    llama-server llama.cpp's own C++ server (`--llama-server PATH`: the binary, which PyPI does not
                 ship; docs/serving.md says how to build it from llama-cpp-python's source package)
                 with `--parallel` slots (continuous batching over one shared KV cache, as many
                 slots as our servers' max_batch_seqs)

Per rate and system: output tokens/s (all output tokens over the time from the first request sent
to the last reply ended), TTFT, time per output token (TPOT: (end - first token) / (tokens - 1))
and end-to-end latency, median and p99, failed requests and replies cut short of their max_tokens
(llama-cpp-python's server interrupts a streamed reply when the next request comes, unless told not
to: it runs with --interrupt_requests False here).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cs336_inference.bench.serving import make_workload

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MODEL_NAME = "smollm2"


def documentation_tokens(tokenizer, n: int = 200_000) -> list[int]:
    """Token ids of the first n characters of CPython's reference documentation (pydoc_data.topics)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tokenizer.encode(text[:n], add_special_tokens=False)


def text_workload(
    tokenizer, num_requests: int, rate: float, seed: int, shape: dict, text_seed: int | None = None
) -> list[dict]:
    """Requests {arrival, prompt (text), max_tokens, shared} (module docstring): lengths and arrivals
    from seed, where the prompts are cut from the documentation from text_seed (default seed + 1)."""
    shaped = make_workload(num_requests, rate, tokenizer.vocab_size, seed, **shape)
    doc = documentation_tokens(tokenizer)
    rng = np.random.default_rng(seed + 1 if text_seed is None else text_seed)
    system_len = shape.get("system_prompt_len", 0)
    system = tokenizer.decode(doc[:system_len]) if system_len else ""
    out = []
    for r in shaped:
        own = len(r.prompt_ids) - (system_len if r.shared_prefix else 0)
        start = int(rng.integers(system_len, len(doc) - own))
        text = tokenizer.decode(doc[start : start + own])
        out.append(
            dict(
                arrival=r.arrival,
                prompt=(system + text) if r.shared_prefix else text,
                max_tokens=r.max_new_tokens,
                shared=r.shared_prefix,
            )  # fmt: skip
        )
    return out


def rate_workloads(
    tokenizer, rates: list[float], num_requests: int, seed: int, shape: dict
) -> tuple[dict[float, list[dict]], list[dict]]:
    """The requests of every rate (the same lengths and arrival pattern, each rate's text cut from other
    places: module docstring) and two warm-up requests with text of their own."""
    workloads = {
        rate: text_workload(tokenizer, num_requests, rate, seed, shape, text_seed=seed + 1 + i)
        for i, rate in enumerate(rates)
    }
    warm_up = text_workload(tokenizer, 2, rates[0], seed, shape, text_seed=seed + 1 + len(rates))
    return workloads, warm_up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(system: str, model_path: str, port: int, threads: int, options: dict) -> list[str]:
    if system == "llama-server":
        slots = options.get("max_batch_seqs", 16)
        return [
            options["llama_server"], "--model", model_path, "--port", str(port), "--host", "127.0.0.1",
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(slots),
            "--ctx-size", str(slots * options.get("n_ctx", 2048)), "--alias", MODEL_NAME, "--kv-unified",
            "--no-webui",
        ]  # fmt: skip
    if system == "llama.cpp":
        return [
            sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--port", str(port),
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(options.get("n_ctx", 2048)),
            "--model_alias", MODEL_NAME, "--interrupt_requests", "False",  # True: a new request cuts the last
        ]  # fmt: skip
    cmd = [
        sys.executable, str(SCRIPTS / "serve.py"), "--model", model_path, "--port", str(port),
        "--threads", str(threads), "--name", MODEL_NAME, "--num-blocks", str(options.get("num_blocks", 512)),
        "--max-batch-seqs", str(options.get("max_batch_seqs", 16)),
    ]  # fmt: skip
    if options.get("quantize"):
        cmd += ["--quantize", options["quantize"]]
    if system == "static":
        cmd.append("--static-batching")
    return cmd


def wait_ready(port: int, proc: subprocess.Popen, timeout_s: float, log: Callable[[str], None]) -> None:
    """Poll GET /v1/models until it answers 200 (the model is loaded), the process dies, or timeout."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                log(f"  ready after {time.monotonic() - start:.0f} s")
                return
        except OSError:
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s")
        time.sleep(1.0)


def run_client(port: int, extra_body: dict, requests: list[dict]) -> list[dict]:
    """The requests sent by the client process (bench/http_client.py); its records."""
    plan = dict(
        base_url=f"http://127.0.0.1:{port}/v1", model=MODEL_NAME, extra_body=extra_body, requests=requests
    )
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, out_path = Path(tmp) / "plan.json", Path(tmp) / "result.json"
        plan_path.write_text(json.dumps(plan))
        subprocess.run(
            [sys.executable, "-m", "cs336_inference.bench.http_client", str(plan_path), str(out_path)],
            check=True,
        )
        return json.loads(out_path.read_text())["records"]


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None and r["first"] is not None]
    short = sum(r["tokens"] < r["max_tokens"] for r in ok)  # replies cut before max_tokens
    tokens = sum(r["tokens"] for r in ok)
    span = max(r["end"] for r in ok) - min(r["sent"] for r in records) if ok else float("nan")
    ttft = [r["first"] - r["sent"] for r in ok]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    e2e = [r["end"] - r["sent"] for r in ok]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    return dict(
        requests=len(records), failed=len(records) - len(ok), short=short, output_tokens=tokens,
        throughput=tokens / span if ok else 0.0, duration_s=span,
        ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99), tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99),
        e2e_p50=pct(e2e, 50), e2e_p99=pct(e2e, 99),
        errors=sorted({r["error"] for r in records if r["error"]})[:3],
    )  # fmt: skip


def http_benchmark(
    model_path: str,
    tokenizer,
    systems: list[str],
    rates: list[float],
    num_requests: int,
    seed: int,
    shape: dict,
    threads: int,
    options: dict,
    eos_ids: list[int],
    log: Callable[[str], None] = print,
    ready_timeout_s: float = 600.0,
) -> dict:
    """Every system at every rate (module docstring); {"runs": [...], "workload": {...}}."""
    runs = []
    workloads, warm_up = rate_workloads(tokenizer, rates, num_requests, seed, shape)
    first = workloads[rates[0]]
    extra = {
        "llama.cpp": {"logit_bias": {str(i): -100.0 for i in eos_ids}},
        "llama-server": {"ignore_eos": True},
        "continuous": {"ignore_eos": True},
        "static": {"ignore_eos": True},
    }
    for system in systems:
        port = free_port()
        cmd = server_command(system, model_path, port, threads, options)
        log(f"{system}: starting {' '.join(cmd[1:])}")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(os.devnull, "w") as quiet:
            proc = subprocess.Popen(cmd, stdout=quiet, stderr=quiet, env=env)
        try:
            wait_ready(port, proc, ready_timeout_s, log)
            run_client(port, extra[system], warm_up)  # kernels built, plans made, memory touched
            for rate in rates:
                log(f"  {system}: {num_requests} requests at {rate:g}/s")
                summary = summarize(run_client(port, extra[system], workloads[rate]))
                runs.append(dict(system=system, rate=rate, **summary))
                log(
                    f"    {summary['throughput']:.1f} output tok/s, TTFT p50 {summary['ttft_p50']:.2f} s, "
                    f"TPOT p50 {summary['tpot_p50'] * 1e3:.0f} ms, {summary['failed']} failed"
                )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    prompts = [len(tokenizer.encode(r["prompt"], add_special_tokens=False)) for r in first]
    outputs = [r["max_tokens"] for r in first]
    workload = dict(
        num_requests=num_requests, prompt_tokens_median=float(np.median(prompts)), prompt_tokens_max=max(prompts),
        output_tokens_median=float(np.median(outputs)), output_tokens_max=max(outputs),
        shared_prefix_requests=sum(r["shared"] for r in first), shape=shape,
    )  # fmt: skip
    return dict(runs=runs, workload=workload, threads=threads, options=options)


def format_http_table(result: dict) -> str:
    out = [
        "| rate (req/s) | server | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | end-to-end p50 / p99 (s) | failed | cut short |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(result["runs"], key=lambda r: (r["rate"], r["system"])):
        out.append(
            f"| {r['rate']:g} | {r['system']} | {r['throughput']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
            f"{r['tpot_p50'] * 1e3:.0f} / {r['tpot_p99'] * 1e3:.0f} | {r['e2e_p50']:.1f} / {r['e2e_p99']:.1f} | "
            f"{r['failed']} | {r['short']} |"
        )
    return "\n".join(out)


def plot_http(result: dict, path) -> None:
    """Throughput against latency (end-to-end and TTFT, median and p99), one colour per server, one point
    per arrival rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, system in enumerate(sorted({r["system"] for r in result["runs"]})):
        runs = sorted((r for r in result["runs"] if r["system"] == system), key=lambda r: r["rate"])
        x, color = [r["throughput"] for r in runs], f"C{i}"
        axes[0].plot(x, [r["e2e_p50"] for r in runs], "o-", color=color, label=f"{system} (p50)")
        axes[0].plot(x, [r["e2e_p99"] for r in runs], "x--", color=color, label=f"{system} (p99)")
        axes[1].plot(x, [r["ttft_p50"] for r in runs], "o-", color=color, label=f"{system} (p50)")
        axes[1].plot(x, [r["ttft_p99"] for r in runs], "x--", color=color, label=f"{system} (p99)")
        for r in runs:  # each point's arrival rate
            axes[0].annotate(
                f"{r['rate']:g}/s",
                (r["throughput"], r["e2e_p50"]),
                fontsize=7,
                xytext=(3, -9),
                textcoords="offset points",
            )
    axes[0].set(xlabel="output tokens/s", ylabel="end-to-end latency (s)", title="latency vs throughput")
    axes[1].set(xlabel="output tokens/s", ylabel="time to first token (s)", title="TTFT vs throughput")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

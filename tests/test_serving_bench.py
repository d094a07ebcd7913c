"""The serving benchmarks' machinery: the engine table, the contention runs, the HTTP benchmark's
workload, summary and (slow) a live run of two servers over HTTP."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from cs336_inference.bench import contention, http
from cs336_inference.bench import engine as bench_engine
from cs336_inference.config import ModelConfig
from cs336_inference.model import TransformerLM


def tiny_model() -> TransformerLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256
    )
    return TransformerLM(cfg).eval()


def test_the_engine_table_has_every_row_and_its_roofline():
    result = bench_engine.engine_benchmark(tiny_model(), [1, 3], prompt_len=9, steps=4, rounds=2, eager_sizes=[2], sampled_sizes=[2], log=lambda m: None)  # fmt: skip
    names = [r["name"] for r in result["rows"]]
    want = ["stream", "engine 1", "engine 3", "sampled engine 2", "seeded engine 2", "readable engine 2"]
    assert names == want, names
    for r in result["rows"]:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0, r
        assert r["tokens_per_s"] == pytest.approx(r["sequences"] / r["step_ms"] * 1e3)
    engine3 = result["rows"][2]
    assert engine3["bytes_per_step"] > result["rows"][1]["bytes_per_step"] > result["weight_bytes"]
    table, _, note = bench_engine.format_engine_table(result).partition("\n\n")
    table = table.splitlines()
    assert len(table) == 2 + 6 and all(line.count("|") == table[0].count("|") for line in table), table
    assert note.startswith("roofline: read bandwidth") and "GB/s" in note, note


def test_stored_bytes_counts_quantized_buffers_once():
    from cs336_inference.quantization import quantize_model

    model = tiny_model()
    fp32 = bench_engine.stored_bytes(model)
    q = quantize_model(model, "int8", quantize_head=True)
    assert bench_engine.stored_bytes(q) < fp32 / 2, "int8 weights are a quarter of float32's, scales aside"
    lookup = (
        model.embed.weight.numel() * 4 if model.lm_head is not None else 0
    )  # an untied embedding is read by rows
    assert fp32 == sum(p.numel() * 4 for p in model.parameters()) - lookup


def test_the_burner_keeps_a_core_busy_and_is_stopped():
    with contention.Burner(limit_s=30) as burner:
        time.sleep(0.3)
        assert burner.proc.poll() is None, "the burner exited early"
    assert burner.proc.returncode is not None, "the burner still runs after the block"


def test_the_contention_table_measures_every_row_idle_and_busy():
    result = contention.contention_benchmark(tiny_model(), [2], prompt_len=9, steps=3, burn_limit_s=60, rounds=3, log=lambda m: None)  # fmt: skip
    rows = result["rows"]
    assert set(rows) == {"CLI default (native, auto)", "native, all cores", "readable, auto", "engine 2, auto", "engine 2, all cores"}  # fmt: skip
    for name, r in rows.items():
        idle, busy = r["idle"]["tokens_per_s_rounds"], r["one core busy"]["tokens_per_s_rounds"]
        assert len(idle) == len(busy) == 3 and min(idle + busy) > 0, (name, idle, busy)
        assert r["idle"]["tokens_per_s"] == statistics.median(idle), name
        assert r["kept_rounds"] == pytest.approx([b / i for i, b in zip(idle, busy, strict=True)]), name
        assert r["kept"] == statistics.median(r["kept_rounds"]), name
        assert r["idle"]["threads"] >= 1
    assert rows["native, all cores"]["one core busy"]["threads"] == result["cores"]
    table = contention.format_contention_table(result).splitlines()
    assert len(table) == 2 + len(rows) and all(line.endswith("%) |") for line in table[2:]), table


def test_the_http_workload_is_text_of_the_asked_lengths():
    from cs336_inference.io.checkpoint import default_model_path
    from cs336_inference.io.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    shape = dict(prompt_median=40, output_median=10, max_prompt=80, max_output=20, system_prompt_len=16, shared_fraction=0.5)  # fmt: skip
    reqs = http.text_workload(tok, 12, 2.0, seed=0, shape=shape)
    again = http.text_workload(tok, 12, 8.0, seed=0, shape=shape)
    assert [r["prompt"] for r in reqs] == [r["prompt"] for r in again], "the rate changes arrivals only"
    assert [4 * r["arrival"] for r in again] == pytest.approx([r["arrival"] for r in reqs])
    shared = [r["prompt"] for r in reqs if r["shared"]]
    assert shared and len({p[:20] for p in shared}) == 1, "the shared requests start with one system prompt"
    for r in reqs:
        n = len(tok.encode(r["prompt"], add_special_tokens=False))
        assert 2 <= n <= 80 + 16 + 8, f"a prompt of {n} tokens"  # decoding and re-encoding may move a few
        assert 2 <= r["max_tokens"] <= 20


def test_every_rate_of_the_http_benchmark_has_prompts_of_its_own():
    """A server runs every rate in one process: a prompt seen at an earlier rate (or in the warm-up)
    would be answered from its KV cache, so only the system prompt may repeat."""
    from cs336_inference.io.checkpoint import default_model_path
    from cs336_inference.io.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    shape = dict(prompt_median=40, output_median=10, max_prompt=80, max_output=20, system_prompt_len=16, shared_fraction=0.5)  # fmt: skip
    workloads, warm_up = http.rate_workloads(tok, [0.5, 1.0, 2.0], 12, seed=0, shape=shape)
    system = tok.decode(http.documentation_tokens(tok)[:16])
    seen: dict[str, str] = {}
    for name, reqs in [*((f"rate {rate}", reqs) for rate, reqs in workloads.items()), ("warm-up", warm_up)]:
        for r in reqs:
            own = r["prompt"].removeprefix(system) if r["shared"] else r["prompt"]
            head = own[:24]
            assert head not in seen, f"a prompt of {name} starts as one of {seen.get(head)}: {head!r}"
            seen[head] = name
    lengths = {rate: [(r["max_tokens"], r["shared"]) for r in reqs] for rate, reqs in workloads.items()}
    assert lengths[0.5] == lengths[1.0] == lengths[2.0], "every rate has the same shape of requests"
    assert [2 * r["arrival"] for r in workloads[1.0]] == pytest.approx([r["arrival"] for r in workloads[0.5]])


def test_the_http_summary_counts_tokens_latencies_and_short_replies():
    records = [
        dict(sent=0.0, first=0.5, end=2.5, tokens=5, max_tokens=5, error=None),
        dict(sent=1.0, first=1.2, end=3.2, tokens=3, max_tokens=5, error=None),  # cut short
        dict(sent=2.0, first=None, end=2.1, tokens=0, max_tokens=5, error="APIError: boom"),
    ]
    s = http.summarize(records)
    assert (s["requests"], s["failed"], s["short"], s["output_tokens"]) == (3, 1, 1, 8)
    assert s["throughput"] == pytest.approx(8 / 3.2)
    assert s["ttft_p50"] == pytest.approx(0.35) and s["tpot_p50"] == pytest.approx((0.5 + 1.0) / 2)
    assert s["errors"] == ["APIError: boom"]


@pytest.mark.slow
def test_two_servers_over_http_answer_every_request_in_full():
    """scripts/serve.py (continuous and static batching) started by the benchmark, driven by the
    openai client from another process: every request answered with all its max_tokens."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from cs336_inference.io.checkpoint import default_model_path
    from cs336_inference.io.tokenizer import load_tokenizer

    source = str(default_model_path())
    tok = load_tokenizer(source)
    shape = dict(prompt_median=20, output_median=6, max_prompt=40, max_output=10, system_prompt_len=8, shared_fraction=0.5)  # fmt: skip
    result = http.http_benchmark(
        source, tok, ["continuous", "static"], [8.0], 5, 0, shape, threads=1, options=dict(quantize="q4_0"),
        eos_ids=sorted(tok.eos_token_ids), log=lambda m: None,
    )  # fmt: skip
    assert [r["system"] for r in result["runs"]] == ["continuous", "static"]
    for r in result["runs"]:
        assert r["failed"] == 0 and r["short"] == 0, r
        assert r["output_tokens"] == sum(x["max_tokens"] for x in http.text_workload(tok, 5, 8.0, 0, shape))


def test_llama_server_runs_with_parallel_slots_over_one_kv_cache():
    options = dict(llama_server="/opt/llama-server", max_batch_seqs=16)
    cmd = http.server_command("llama-server", "m.gguf", 8123, 2, options)
    assert cmd[0] == "/opt/llama-server"
    flags = dict(zip(cmd[1:-2:2], cmd[2:-2:2], strict=True))  # the last two take no value
    assert (
        flags["--parallel"] == "16" and flags["--ctx-size"] == str(16 * 2048) and flags["--threads"] == "2"
    ), cmd
    assert (
        cmd[-2:] == ["--kv-unified", "--no-webui"]
        and flags["--model"] == "m.gguf"
        and flags["--port"] == "8123"
    ), cmd

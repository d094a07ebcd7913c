"""The GGUF benchmark (cs336_inference/bench/gguf.py) at small scale: a tiny Qwen3-like model through
the same functions as the 1B run (files written and cached, ours timed, the table), in seconds.
llama.cpp's rows only where llama-cpp-python is installed (not on CI)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest
import torch

from cs336_inference.bench import gguf as gb
from cs336_inference.io.checkpoint import load_pretrained

HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-bench")
    return folder, gb.build_files("tiny", ["f32", "q8_0", "q4_k_m"], folder)


def test_public_configs():
    llama, qwen = gb.shaped_config("llama1b"), gb.shaped_config("qwen06b")
    assert (llama.vocab_size, llama.d_model, llama.n_layers, llama.n_heads, llama.n_kv_heads) == (
        128256,
        2048,
        16,
        32,
        8,
    )
    assert (llama.head_dim, llama.d_ff, llama.rope_theta, llama.tie_embeddings) == (64, 8192, 500000.0, True)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 32.0
    assert (qwen.vocab_size, qwen.d_model, qwen.n_layers, qwen.n_heads, qwen.n_kv_heads) == (
        151936,
        1024,
        28,
        16,
        8,
    )
    assert (qwen.head_dim, qwen.d_ff, qwen.rope_theta, qwen.qk_norm, qwen.tie_embeddings) == (
        128,
        3072,
        1e6,
        True,
        True,
    )
    with pytest.raises(ValueError):
        gb.shaped_config("nope")


def test_shaped_model_weights():
    model = gb.shaped_model(gb.shaped_config("tiny"))
    w = model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - 0.02) < 0.002
    norms = [p for p in model.parameters() if p.dim() == 1]
    assert norms and all(torch.all(p == 1) for p in norms)


def test_files_written_cached_and_readable(files):
    folder, paths = files
    assert set(paths) == {"f32", "q8_0", "q4_k_m"}
    sizes = {fmt: p.stat().st_size for fmt, p in paths.items()}
    assert sizes["f32"] > sizes["q8_0"] > sizes["q4_k_m"]
    stamps = {fmt: p.stat().st_mtime_ns for fmt, p in paths.items()}
    assert gb.build_files("tiny", ["f32", "q8_0", "q4_k_m"], folder) == paths  # cached: nothing rewritten
    assert {fmt: p.stat().st_mtime_ns for fmt, p in paths.items()} == stamps
    model = load_pretrained(paths["q8_0"], packed=True)
    assert model.config.vocab_size == gb.shaped_config("tiny").vocab_size and model.config.qk_norm


def test_bench_file_ours_and_table(files):
    _, paths = files
    rows = []
    for fmt in ("f32", "q4_k_m"):
        rows += gb.bench_file(
            "tiny", fmt, paths[fmt], threads=1, runs=1, new_tokens=2, prompt_len=8, short_prompt=4,
            llama=False, load_runs=1 if fmt == "q4_k_m" else 0,
        )["rows"]  # fmt: skip
    assert [(r["model"], r["format"], r["engine"]) for r in rows] == [
        ("tiny", "f32", "ours"),
        ("tiny", "q4_k_m", "ours"),
    ]
    assert all(r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in rows)
    assert "load_s" not in rows[0] and rows[1]["load_s"] > 0 and rows[1]["peak_rss_bytes"] > 0
    result = {
        "settings": {"threads": 1, "runs": 1, "new_tokens": 2, "prompt_len": 8, "short_prompt": 4},
        "llama_cpp": "llama.cpp rows left out (--no-llama)",
        "rows": rows,
    }
    table = gb.format_gguf(result)
    assert "tiny      q4_k_m" in table and "llama.cpp rows left out" in table
    json.dumps(rows)


def test_run_gguf_rejects_unknown_names(tmp_path):
    args = argparse.Namespace(models="gpt5", formats="q4_k_m", threads=1, runs=1, new_tokens=2, prompt_len=8)
    with pytest.raises(ValueError, match="gpt5"):
        gb.run_gguf(args)


def test_cli_parses_gguf(monkeypatch, tmp_path):
    import importlib.util as u
    from pathlib import Path

    spec = u.spec_from_file_location(
        "benchmark_script", Path(__file__).parents[1] / "scripts" / "benchmark.py"
    )
    script = u.module_from_spec(spec)
    spec.loader.exec_module(script)
    seen = {}

    def fake(args):
        seen.update(vars(args))
        return {"table": "t", "rows": []}

    monkeypatch.setattr(gb, "run_gguf", fake)
    out = tmp_path / "g.json"
    assert (
        script.main(
            ["gguf", "--models", "gemma270m", "--formats", "q4_k_m", "--runs", "2", "--out", str(out)]
        )
        == 0
    )
    assert seen["models"] == "gemma270m" and seen["runs"] == 2 and seen["prompt_len"] == 512
    assert json.loads(out.read_text())["table"] == "t"


@pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
def test_llama_cpp_reads_the_synthetic_vocabulary(files):
    _, paths = files
    rows = gb.bench_file(
        "tiny", "q8_0", paths["q8_0"], threads=1, runs=1, new_tokens=2, prompt_len=8, short_prompt=4,
        llama=True, load_runs=0,
    )["rows"]  # fmt: skip
    assert [r["engine"] for r in rows] == ["ours", "llama.cpp"]
    assert "x / " in gb.format_gguf(
        {"settings": {"threads": 1, "runs": 1, "new_tokens": 2, "prompt_len": 8, "short_prompt": 4},
         "llama_cpp": "ran", "rows": rows}
    )  # fmt: skip


def test_run_gguf_without_llama_cpp(files, monkeypatch):
    import sys

    folder, _ = files
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    assert "not installed" in gb.llama_available()
    logged = []
    args = argparse.Namespace(
        models="tiny", formats="q8_0", threads=1, runs=1, new_tokens=2, prompt_len=8, folder=folder,
        load_runs=0, log=logged.append,
    )  # fmt: skip
    result = gb.run_gguf(args)
    assert [r["engine"] for r in result["rows"]] == ["ours"]
    assert result["llama_cpp"].startswith("llama.cpp rows skipped") and result["llama_cpp"] in result["table"]
    assert any("tiny q8_0" in m for m in logged)

"""cs336_inference.bench.decode and scripts/benchmark.py's report, on a tiny random model (seconds)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from cs336_inference import accounting as acc
from cs336_inference.bench import decode as bench
from cs336_inference.config import ModelConfig
from cs336_inference.model import TransformerLM

ROOT = Path(__file__).resolve().parents[1]


def test_summarize_reads_the_medians_off_the_token_stamps():
    # Two runs of 3 tokens: first token at 1.0 / 2.0 s, then 0.5 / 1.5 s per token.
    stamps = [[1.0, 1.5, 2.0], [2.0, 3.5, 5.0]]
    s = bench.summarize_stamps(stamps, 3)
    assert s["total_s"] == 3.5 and s["ttft_s"] == 1.5 and s["decode_step_s"] == 1.0
    assert s["tokens_per_s"] == 3 / 3.5 and s["runs_total_s"] == [2.0, 5.0]
    # Fewer tokens are read off the same runs (the first n steps are the same work).
    assert bench.summarize_stamps(stamps, 2)["total_s"] == 2.5
    assert bench.summarize_stamps(stamps, 1)["decode_step_s"] is None


def test_decode_benchmark_on_a_tiny_model():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (8,))
    result = bench.decode_benchmark({"tiny": model}, prompt, sizes=[2, 4], vs_n=4, runs=1)
    entry = result["models"]["tiny"]
    assert set(entry["cached"]) == set(entry["naive"]) == {2, 4}
    assert all(v > 0 for v in entry["speedup"].values())
    rf = result["roofline"]
    assert rf["avg_context"] == 8 + 4 // 2
    assert rf["bytes_per_step"] == acc.decode_step_bytes(model, 1, rf["avg_context"])
    assert rf["weight_bytes"] + rf["kv_bytes_per_step"] == rf["bytes_per_step"]
    assert 0 < rf["fraction"] and 0 < rf["matvec_floor_s"]
    assert "vs_transformers" not in result and result["profile"]
    json.dumps(result)  # JSON-ready

    # The script's report reads every key it needs from this dict.
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result["targets"] = script.targets(result, 4)
    report = script.format_report(result)
    assert "tiny" in report and "of read bandwidth" in report
    assert report.count("[met]") + report.count("[MISSED]") == len(result["targets"]) == 2


def test_format_benchmark_adds_amx_rows_and_leaves_amx_off_afterwards():
    from cs336_inference.bench import formats as fb
    from cs336_inference.fast.cpu import build

    model, prompt = _one_layer_model_with_kernels()
    lib = build.library()
    if not lib.cs336_amx_enable(1):
        pytest.skip("no AMX on this CPU or in this build")
    lib.cs336_amx_enable(0)
    r = fb.format_benchmark(
        model, prompt, ["fp32", "int8"], new_tokens=2, rounds=1, llama_cpp=False, native=True, amx=True
    )
    assert {"ours int8 native amx", "ours int8 native"} <= set(r["rows"]) and "ours fp32 native amx" not in r[
        "rows"
    ]
    assert r["settings"]["amx"] and set(r["t_token_cost_native_amx"]) == {"int8"}
    assert "int8 n amx" in fb.format_formats_table(r)
    # the switch is off again: an AMX-sized int8 product gives the AVX kernel's bits
    q, scale = torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32)
    x, y = torch.randn(2, 64), torch.empty(2, 32)

    def product():
        lib.cs336_int8(x.data_ptr(), 2, 64, 64, q.data_ptr(), scale.data_ptr(), 32, None, y.data_ptr(), 1)
        return y.clone()

    after = product()
    lib.cs336_amx_enable(1)
    on = product()
    lib.cs336_amx_enable(0)
    assert not torch.equal(after, on) and torch.equal(after, product()), "AMX was left on after the benchmark"


def test_decode_benchmark_amx_without_native_is_one_line(capsys):
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["decode", "--formats-only", "--amx"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["benchmark.py: error: --amx times native steps: add --native"], err


def test_a_prompt_longer_than_the_window_is_one_clear_error():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_seq_len=16)
    model = TransformerLM(cfg).eval()
    with pytest.raises(ValueError, match="exceed the model's window 16"):
        bench.decode_benchmark({"tiny": model}, torch.zeros(8, dtype=torch.long), sizes=[16], vs_n=4, runs=1)


def test_format_benchmark_on_a_tiny_model(tmp_path):
    from cs336_inference.bench import formats as fb

    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
    torch.manual_seed(0)
    model = TransformerLM(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (20,))
    r = fb.format_benchmark(model, prompt, ["fp32", "int8", "q4_0"], new_tokens=2, rounds=1, llama_cpp=False)
    assert set(r["rows"]) == {"ours fp32", "ours int8", "ours q4_0"}
    assert r["rows"]["ours fp32"]["vs_ours_fp32"] == 1.0
    assert r["rows"]["ours int8"]["bits_per_weight"] < r["rows"]["ours fp32"]["bits_per_weight"] == 32.0
    for row in r["rows"].values():
        assert (
            row["bytes_per_step"] == row["weight_bytes"] + r["kv_bytes_per_step"]
            and row["roofline_fraction"] > 0
        )
    assert set(r["t_token_cost"]["int8"]) == set(fb.T_SIZES)
    json.dumps(r)
    assert "ours q4_0" in fb.format_formats_table(r)
    fb.plot_formats(r, tmp_path / "formats.png")
    assert (tmp_path / "formats.png").stat().st_size > 0


def _one_layer_model_with_kernels() -> tuple[TransformerLM, torch.Tensor]:
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        pytest.skip("the C kernels are not built here")
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
    torch.manual_seed(0)
    return TransformerLM(cfg).eval(), torch.randint(0, cfg.vocab_size, (20,))


def test_format_benchmark_adds_a_compiled_row_per_format():
    from cs336_inference.bench import formats as fb

    model, prompt = _one_layer_model_with_kernels()
    r = fb.format_benchmark(model, prompt, ["fp32"], new_tokens=2, rounds=1, llama_cpp=False, compiled=True)
    assert set(r["rows"]) == {"ours fp32", "ours fp32 compiled"} and r["settings"]["compiled"]
    assert r["rows"]["ours fp32 compiled"]["bytes_per_step"] == r["rows"]["ours fp32"]["bytes_per_step"]
    assert "ours fp32 compiled" in fb.format_formats_table(r)


def test_format_benchmark_adds_native_rows_and_their_t_token_costs(tmp_path):
    from cs336_inference.bench import formats as fb

    model, prompt = _one_layer_model_with_kernels()
    formats = ["fp32", "int8", "q4_0_a8"]
    r = fb.format_benchmark(model, prompt, formats, new_tokens=2, rounds=1, llama_cpp=False, native=True)
    assert set(r["rows"]) == {f"ours {f}" for f in formats} | {f"ours {f} native" for f in formats}
    assert r["settings"]["native"] and set(r["t_token_cost_native"]) == set(formats)
    assert set(r["t_token_cost_native"]["int8"]) == set(fb.T_SIZES)
    table = fb.format_formats_table(r)
    assert "ours int8 native" in table and "int8 n" in table
    # the arithmetic bound: at least 1, growing with T, printed under the costs; none for the a8
    # method, whose extra rows are integer dot products the fp32 peak does not bound
    assert r["env"]["fma_per_s"] > 1e9 and set(r["t_token_floor_native"]) == {"fp32", "int8"}
    assert set(r["t_token_floor"]) == {"fp32", "int8"}
    for floor in r["t_token_floor_native"].values():
        costs = [floor[T] for T in fb.T_SIZES]
        assert costs[0] >= 1.0 and costs == sorted(costs), floor
    assert (
        "least cost from arithmetic alone" in table and "q4_0_a8 n " not in table.split("arithmetic alone")[1]
    )
    assert "(none for q4_0_a8: integer dot products" in table
    fb.plot_formats(r, tmp_path / "formats.png")


def test_fma_rate_is_the_machines_arithmetic_roof():
    """decode.c's register-only fma loop against torch's matmul, timed independently: no real
    computation beats the roof, and a roof off by the vector width (16 lanes) is far from
    any BLAS (MKL's fp32 matmul ran at 0.8x of it on an Intel Xeon, 0.4x on an AMD EPYC)."""
    from cs336_inference.bench.timing import matmul_flops_per_second
    from cs336_inference.fast.cpu import build, ops

    if build.library() is None:
        pytest.skip("the C kernels are not built here")
    roof = ops.fma_per_second()
    blas = matmul_flops_per_second(1024) / 2  # multiply-adds per second
    assert 0.5 * blas <= roof <= 12 * blas, (
        f"fma roof {roof / 1e9:.0f} G/s against matmul's {blas / 1e9:.0f} G/s"
    )


def _kernel_sources_match_head() -> bool:
    """Whether the kernel sources in the working tree are HEAD's (false outside a git checkout)."""
    import subprocess

    from cs336_inference.fast.cpu import build

    names = [str(p.relative_to(ROOT)) for p in build.SOURCES]
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "diff", "--quiet", "HEAD", "--", *names], capture_output=True
        )
    except OSError:
        return False
    return done.returncode == 0


def test_comparing_kernel_builds_times_both_and_says_whether_their_bits_agree():
    from cs336_inference.bench import kernels_ab
    from cs336_inference.fast.cpu import build

    if build.library() is None or not _kernel_sources_match_head():
        pytest.skip("needs the kernels built and their sources unchanged from HEAD")
    shapes = [(8, 64), (5, 128), (3, 192)]
    r = kernels_ab.compare("HEAD", ("fp32", "int4", "q4_0"), (1, 3), 2, shapes, log=lambda _: None)
    assert [(x["format"], x["rows"]) for x in r["results"]] == [
        (f, m) for f in ("fp32", "int4", "q4_0") for m in (1, 3)
    ]
    for x in r["results"]:
        assert x["base_ms"] > 0 and x["tree_ms"] > 0, x
        # the same sources built twice: the same bits, or the comparison is not of like with like
        assert x["same"], f"{x['format']} at {x['rows']} rows: HEAD's build and the tree's disagree"
    assert "tree/base" in kernels_ab.format_compare(r)


def test_comparing_kernel_builds_on_native_passes_times_both_per_t():
    from cs336_inference.bench import kernels_ab
    from cs336_inference.fast.cpu import build

    if build.library() is None or not _kernel_sources_match_head():
        pytest.skip("needs the kernels built and their sources unchanged from HEAD")
    model, _ = _one_layer_model_with_kernels()
    r = kernels_ab.compare_passes(
        "HEAD", model, ("fp32", "q4_0"), (1, 3), 2, contexts=(8, 20), log=lambda _: None
    )
    want = [(f, c, T) for f in ("fp32", "q4_0") for c in (8, 20) for T in (1, 3)]
    assert [(x["format"], x["context"], x["T"]) for x in r["results"]] == want
    for x in r["results"]:
        assert x["base_ms"] > 0 and x["tree_ms"] > 0 and x["base_cost"] > 0, x
        assert x["same"], f"{x['format']} T={x['T']}: HEAD's build and the tree's gave different logits"
    assert [x["tree_cost"] for x in r["results"] if x["T"] == 1] == [1.0] * 4
    assert "tree cost" in kernels_ab.format_passes(r)


def run_script(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("benchmark_script", ROOT / "scripts" / "benchmark.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(argv)


def test_comparing_kernel_builds_refuses_a_bad_revision_in_one_line(capsys):
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        pytest.skip("the kernels could not be built here")
    assert run_script(["kernels", "--base", "no-such-revision", "--rounds", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-revision" in err[0], err
    assert run_script(["kernels", "--rows", "1,40"]) == 2
    assert "rows must be between 1 and 32" in capsys.readouterr().err


def test_a_markdown_report_names_its_command_cpu_torch_and_date(tmp_path):
    """benchmark.py --markdown: the docs' tables are written by the benchmark, never pasted."""
    import datetime

    from cs336_inference.bench import report

    table = "format  tok/s\nfp32    41.0"
    text = report.markdown(table, "python scripts/benchmark.py decode --quick", datetime.date(2026, 11, 25))
    head, body = text.split("\n\n", 1)
    assert head.startswith("`python scripts/benchmark.py decode --quick` on ") and head.endswith(
        ", 2026-11-25:"
    )
    assert f"torch {torch.__version__}" in head and report.cpu_description() in head
    assert body == f"```text\n{table}\n```\n"
    cpu = report.cpu_description()
    assert "cores)" in cpu and "(" in cpu, cpu
    report.write_markdown(tmp_path / "docs" / "t.md", table)
    assert (tmp_path / "docs" / "t.md").read_text().endswith(f"```text\n{table}\n```\n")


def test_grammar_benchmark_replays_every_schema_and_writes_its_table():
    """benchmark.py grammar on a tiny random model with SmolLM2's vocabulary and three schemas."""
    pytest.importorskip("llguidance")
    from cs336_inference import ModelConfig, TransformerLM
    from cs336_inference.bench import grammar
    from cs336_inference.io.checkpoint import default_model_path
    from cs336_inference.io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=512,
        eos_token_id=tokenizer.eos_token_ids,
    )  # fmt: skip
    schemas = {k: v for k, v in grammar.load_schemas().items() if k in ("point", "weekday", "colours")}
    r = grammar.grammar_benchmark(TransformerLM(cfg).eval(), tokenizer, schemas, log=lambda *_: None)
    ours = r["engines"]["llguidance"]
    assert ours["schemas"] == 3 and ours["tokens"] == r["tokens"] > 0, r
    assert 0 < ours["mask_us_median"] <= ours["mask_us_p99"]
    table = grammar.format_grammar_table(r)
    assert "| llguidance | 3 |" in table and "tok/s with the mask" in table, table


def test_tp_benchmark_splits_the_step_and_halves_the_bytes():
    """benchmark.py tp, briefly: tp = 1 and 2 gloo processes, bytes per rank halved, the table."""
    from cs336_inference.bench import parallel

    r = parallel.tp_benchmark([1, 2], B=1, S=8, steps=2, threads=2, log=lambda *_: None)
    one, two = r["rows"]
    assert two["weight_bytes"] * 2 == pytest.approx(one["weight_bytes"], rel=1e-3), "weights per rank halve"
    assert two["kv_bytes"] * 2 == one["kv_bytes"], "the cache per rank halves (4 K/V heads over 2 ranks)"
    assert one["comm_s"] == 0 < two["comm_s"] <= two["step_s"] and two["predicted_comm_s"] > 0
    r["crossover"] = parallel.crossover_table()
    table = parallel.format_tp_table(r)
    assert "| 2 |" in table and "llama2-70b | PCIe | 8" in table, table

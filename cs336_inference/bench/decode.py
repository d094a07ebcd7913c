"""The decode benchmark: how fast is token-by-token generation, and how far from the memory roofline?

Greedy, batch 1, no early stop; every time is the median of `runs` runs after a warm-up.

1. KV-cached vs naive generation (`cached_vs_naive`). Naive step t re-runs all P + t tokens, so its
   time grows quadratically with the new tokens while cached decode grows linearly. Naive times for
   fewer tokens are read off the longest runs (time to the n-th token): the first n steps of naive
   generation are the same work whatever follows.
2. Our cached decode vs Hugging Face transformers' `generate` on the same weights, prompt and token
   count, runs interleaved (`vs_transformers`; transformers is optional).
3. The decode roofline (`decode_roofline`): a step reads `accounting.decode_step_bytes`, so it cannot
   take less than those bytes / read bandwidth. Reported: the fraction of the bandwidth achieved,
   and a "matvec floor" (the step's F.linear calls alone, `matvec_floor`) and a torch.profiler table
   (`profile_decode`) that show where the rest of the time goes.

`decode_benchmark` runs all three; scripts/benchmark.py prints the result and writes it as JSON.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from cs336_inference import accounting as acc
from cs336_inference.bench.timing import Timer, median_seconds, read_bandwidth, synchronize
from cs336_inference.config import ModelConfig
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import generate, generate_steps

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press into a system that could produce "
    "books faster than any scribe. Within decades, presses had spread across Europe."
)
Log = Callable[[str], None]


def tiny_config() -> ModelConfig:
    """A small random Llama-style GQA model: per-step time is mostly Python and kernel-launch overhead."""
    return ModelConfig(
        vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=688,
        max_seq_len=1024, tie_embeddings=True,
    )  # fmt: skip


def benchmark_prompt(source: Path, vocab_size: int, n: int) -> torch.Tensor:
    """The first n tokens of PROMPT_TEXT in the checkpoint's tokenizer (random ids if it has none)."""
    from cs336_inference.io.tokenizer import load_tokenizer

    try:
        ids = load_tokenizer(source).encode(PROMPT_TEXT * 4)[:n]
    except Exception:  # a checkpoint without a tokenizer: random ids do for timing
        ids = []
    if len(ids) < n:
        ids = torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor(ids, dtype=torch.long)


def token_times(model: TransformerLM, prompt: torch.Tensor, n: int, use_cache: bool) -> list[float]:
    """Seconds from the start until each of the n new tokens exists (greedy, no stop)."""
    device = model.embed.weight.device
    synchronize(device)
    t0 = time.perf_counter()
    stamps = []
    for _ in generate_steps(model, prompt, n, use_cache=use_cache):
        synchronize(device)
        stamps.append(time.perf_counter() - t0)
    return stamps


def summarize_stamps(stamps_per_run: list[list[float]], n: int) -> dict:
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


def cached_vs_naive(
    model: TransformerLM, prompt: torch.Tensor, sizes: list[int], runs: int, log: Log
) -> dict:
    """Cached generation per size (separate runs) and naive generation (runs of the largest size)."""
    out = {"cached": {}, "naive": {}, "speedup": {}}
    token_times(model, prompt, 8, use_cache=True)  # warm-up
    for n in sizes:
        token_times(model, prompt, min(n, 16), use_cache=True)
        stamps = [token_times(model, prompt, n, use_cache=True) for _ in range(runs)]
        out["cached"][n] = summarize_stamps(stamps, n)
        log(f"  cached {n:4d} tokens: {out['cached'][n]['tokens_per_s']:8.1f} tok/s")
    token_times(model, prompt, 8, use_cache=False)  # warm-up
    longest = max(sizes)
    naive_runs = []
    for r in range(runs):
        naive_runs.append(token_times(model, prompt, longest, use_cache=False))
        log(f"  naive {longest} tokens, run {r + 1}/{runs}: {naive_runs[-1][-1]:.1f} s")
    for n in sizes:
        out["naive"][n] = summarize_stamps(naive_runs, n)
        out["speedup"][n] = out["naive"][n]["total_s"] / out["cached"][n]["total_s"]
    return out


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

    return median_seconds(step, repeats=max(runs, 5), warmup=2)


@torch.inference_mode()
def profile_decode(
    model: TransformerLM, prompt: torch.Tensor, steps: int = 16, rows: int = 12
) -> tuple[str, list[dict]]:
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
    """(model, None) with the same checkpoint in transformers, float32, or (None, why not)."""
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


def vs_transformers(model: TransformerLM, hf, prompt: torch.Tensor, n: int, runs: int, log: Log) -> dict:
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
        with Timer() as timer:
            our_tokens = ours()
        t_ours.append(timer.seconds)
        with Timer() as timer:
            hf_tokens = theirs()
        t_hf.append(timer.seconds)
    if len(hf_tokens) != n:
        raise RuntimeError(f"transformers generated {len(hf_tokens)} tokens, expected {n}")
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


def decode_roofline(
    model: TransformerLM, cached: dict, prompt_len: int, bandwidth: float, floor_s: float, floor_t_s: float
) -> dict:
    """Achieved bytes/s of the decode steps of `cached` (a `summarize` entry) vs the read bandwidth."""
    n = cached["new_tokens"]
    S = prompt_len + n // 2  # average context length over the decode steps
    per_step = acc.decode_step_bytes(model, 1, S)
    weights = acc.decode_weight_bytes(model)
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


def decode_benchmark(
    models: dict[str, TransformerLM],
    prompt: torch.Tensor,
    sizes: list[int],
    vs_n: int,
    runs: int,
    hf_source: Path | None = None,
    log: Log = lambda msg: None,
) -> dict:
    """Sections 1-3 (see the module docstring) as one JSON-ready dict; CPU.

    The first of `models` is the main one: its roofline is measured at vs_n new tokens, and compared
    with transformers loading `hf_source` (None: skipped). Every model gets section 1.
    """
    main_name, model = next(iter(models.items()))
    if len(prompt) + max(sizes) > model.config.max_seq_len:
        raise ValueError(f"prompt + {max(sizes)} tokens exceed the model's window {model.config.max_seq_len}")
    result: dict = {
        "env": {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "device": "cpu",
            "cpu": platform.processor() or platform.machine(),
            "load_average_at_start": os.getloadavg()[0],
        },
        "settings": {"prompt_len": len(prompt), "sizes": sizes, "runs": runs},
        "targets": {},
        "models": {},
    }
    bandwidth = read_bandwidth(max(acc.decode_weight_bytes(model), 64 * 2**20), repeats=7)
    result["env"]["read_bandwidth_bytes_per_s"] = bandwidth
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads")

    for name, m in models.items():
        log(f"{name}: cached vs naive")
        entry = {"parameters": m.num_parameters(), "weight_bytes": acc.decode_weight_bytes(m)}
        entry |= cached_vs_naive(m, prompt % m.config.vocab_size, sizes, runs, log)
        result["models"][name] = entry

    # Roofline of the cached decode at vs_n tokens (measured again so that it sits next to the floor).
    stamps = [token_times(model, prompt, vs_n, use_cache=True) for _ in range(runs)]
    cached_vs_n = summarize_stamps(stamps, vs_n)
    floor_s, floor_t_s = matvec_floor(model, runs), matvec_floor(model, runs, transposed=True)
    result["roofline"] = decode_roofline(model, cached_vs_n, len(prompt), bandwidth, floor_s, floor_t_s)
    table, summary = profile_decode(model, prompt)
    result["profile"] = summary
    result["profile_table"] = table

    if hf_source is not None:
        log(f"loading {main_name} in transformers")
        hf, why = load_transformers(hf_source)
        if hf is None:
            log(f"  skipped: {why}")
            result["vs_transformers"] = {"skipped": why}
        else:
            result["vs_transformers"] = vs_transformers(model, hf, prompt, vs_n, runs, log)
            del hf
    result["env"]["load_average_at_end"] = os.getloadavg()[0]
    return result

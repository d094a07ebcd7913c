"""The GPU decode benchmark: eager vs CUDA-graph steps, bf16 / int8 / int4, transformers, the roofline.

On a GPU a small model's eager decode step is bound by kernel launches, not by memory: SmolLM2's
bf16 weights (270 MB) take about 0.1 ms to read at 3 TB/s, while its ~600 small kernels take
milliseconds to launch from Python. So the table has two columns that matter: the eager step (what
`generate` does) and the CUDA-graph step (fast/step/fixed.py, gpt-fast's loop), whose time should
approach bytes / bandwidth, with int8 and int4 (fast/gpu/products.py) reading fewer bytes.

All contenders run interleaved, `rounds` times, greedy, batch 1; each time is one decode step
(the whole run minus its prefill, over new_tokens - 1 steps), median over rounds after a warm-up.
"""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_inference import accounting as acc
from cs336_inference.bench.formats import weight_bytes
from cs336_inference.bench.timing import interleaved_rounds, read_bandwidth
from cs336_inference.config import ModelConfig
from cs336_inference.fast.step.fixed import FixedStep
from cs336_inference.model import TransformerLM

Log = Callable[[str], None]
T_SIZES = (1, 2, 5, 9, 17)


def smollm2_config() -> ModelConfig:
    """SmolLM2-135M's architecture (what the default checkpoint's GGUF header says)."""
    return ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
        max_seq_len=2048, tie_embeddings=True, rope_theta=100000.0, model_type="llama",
    )  # fmt: skip


def llama_1b_config() -> ModelConfig:
    """Llama-3.2-1B's architecture: 1.2B parameters, 2.5 GB in bf16, where a step is bound by
    reading the weights even on a GPU (SmolLM2's 270 MB are not: its step is launch-bound)."""
    return ModelConfig(
        vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
        max_seq_len=2048, tie_embeddings=True, rope_theta=500000.0, model_type="llama",
    )  # fmt: skip


SHAPES = {"smollm2-135m": smollm2_config, "llama-1b": llama_1b_config}


def _step_seconds(model: TransformerLM, prompt: torch.Tensor, n: int, graph: bool) -> float:
    """Seconds per decode step: n greedy steps after a prefill, timed with CUDA events."""
    with torch.inference_mode():
        cache = model.new_cache(1, len(prompt) + n + 1)
        token = model(prompt[None], cache=cache, last_only=True)[:, -1].argmax(-1)
        step = FixedStep(model, cache) if graph else None
        if step is not None:  # record outside the timed part (done once per cache in real use too)
            token = step(token).argmax(-1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            logits = step(token) if step is not None else model(token[:, None], cache=cache)[:, -1]
            token = logits.argmax(-1)
        end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / n


def _greedy(model: TransformerLM, prompt: torch.Tensor, n: int, graph: bool) -> list[int]:
    from cs336_inference.fast.step.fixed import graph_generate
    from cs336_inference.sampling import generate

    if graph:
        return graph_generate(model, prompt, n).tolist()
    return generate(model, prompt, n, stop_token_ids=[]).tolist()


def _hf_step_seconds(hf, prompt: torch.Tensor, n: int) -> float:
    ids = prompt[None]
    mask = torch.ones_like(ids)

    def run(k: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    with torch.inference_mode():
        return (run(n + 1) - run(1)) / n


def _transformers(model: TransformerLM, log: Log):
    """The same weights in transformers (bf16, on the GPU), or None if it is not installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        log(f"transformers not installed ({e}): no transformers row")
        return None
    from cs336_inference.io.checkpoint import save_pretrained

    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(copy.deepcopy(model).float().cpu(), tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def _forward_seconds(model: TransformerLM, prompt: torch.Tensor, T: int, repeats: int) -> float:
    with torch.inference_mode():
        cache = model.new_cache(1, len(prompt) + max(T_SIZES) + 1)
        model(prompt[None], cache=cache)
        times = []
        for _ in range(repeats + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(prompt[None, :T], cache=cache)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            cache.truncate(len(prompt))
    return statistics.median(times[2:])


def cuda_decode_benchmark(
    model: TransformerLM,
    prompt: torch.Tensor,
    new_tokens: int = 128,
    rounds: int = 5,
    formats: tuple[str, ...] = ("bf16", "int8", "int4"),
    hf: bool = True,
    log: Log = lambda msg: None,
) -> dict:
    """The interleaved GPU comparison (module docstring) as a JSON-ready dict. `model`: any float
    TransformerLM; it is converted to bf16 on the GPU (quantized formats also store the output
    matrix quantized, as llama.cpp's files do)."""
    from cs336_inference.fast import install
    from cs336_inference.quantization import quantize_model

    if not torch.cuda.is_available():
        raise RuntimeError("the GPU decode benchmark needs a CUDA device")
    base = model.to("cuda", torch.bfloat16).eval()
    prompt = prompt.to("cuda")
    models = {
        f: install(base if f == "bf16" else quantize_model(base, f, quantize_head=True)) for f in formats
    }
    contenders: dict[str, Callable[[], float]] = {}
    for f, m in models.items():
        contenders[f"ours {f} eager"] = lambda m=m: _step_seconds(m, prompt, new_tokens, graph=False)
        contenders[f"ours {f} graph"] = lambda m=m: _step_seconds(m, prompt, new_tokens, graph=True)
    hf_model = _transformers(base, log) if hf else None
    if hf_model is not None:
        contenders["transformers bf16 eager"] = lambda: _hf_step_seconds(hf_model, prompt, new_tokens)
    bandwidth = read_bandwidth(2**30, device="cuda", repeats=9)
    log(f"{torch.cuda.get_device_name()}: read bandwidth {bandwidth / 1e12:.2f} TB/s")
    times = interleaved_rounds(contenders, rounds, log, ".0f")

    S = len(prompt) + new_tokens // 2
    kv = acc.kv_cache_bytes(base.config, 1, S, 2)
    rows = {}
    for name, ts in times.items():
        step = statistics.median(ts)
        fmt = name.split()[1]
        step_bytes = weight_bytes(models.get(fmt, base)) + kv
        rows[name] = {
            "decode_step_s": step,
            "tokens_per_s": 1 / step,
            "bytes_per_step": step_bytes,
            "roofline_tokens_per_s": bandwidth / step_bytes,
            "roofline_fraction": step_bytes / bandwidth / step,
            "runs_s": ts,
        }
    log("greedy tokens: graph vs eager, and vs transformers")
    agree = {}
    n = min(new_tokens, 64)
    for f, m in models.items():
        eager, graph = _greedy(m, prompt, n, False), _greedy(m, prompt, n, True)
        agree[f] = next((i for i, (a, b) in enumerate(zip(eager, graph, strict=True)) if a != b), n)
    if hf_model is not None:
        with torch.inference_mode():
            theirs = hf_model.generate(prompt[None], max_new_tokens=n, do_sample=False)[
                0, len(prompt) :
            ].tolist()
        ours = _greedy(base, prompt, n, False)
        agree["bf16 vs transformers"] = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), n
        )
    log("T-token forwards (eager, against a cache of the prompt)")
    t_cost = {}
    for f, m in models.items():
        base_s = _forward_seconds(m, prompt, 1, 2 * rounds + 3)
        t_cost[f] = {T: _forward_seconds(m, prompt, T, 2 * rounds + 3) / base_s for T in T_SIZES}
    props = torch.cuda.get_device_properties(0)
    return {
        "env": {
            "gpu": torch.cuda.get_device_name(),
            "multiprocessors": props.multi_processor_count,
            "torch": torch.__version__,
            "read_bandwidth_bytes_per_s": bandwidth,
            "python": sys.version.split()[0],
        },
        "settings": {"prompt_len": len(prompt), "new_tokens": new_tokens, "rounds": rounds, "avg_context": S},
        "kv_bytes_per_step": kv,
        "rows": rows,
        "greedy_identical_prefix": agree,
        "greedy_tokens": n,
        "t_token_cost": t_cost,
    }


def format_gpu_table(r: dict) -> str:
    lines = [
        f"GPU decode: {r['env']['gpu']}, torch {r['env']['torch']}, read bandwidth "
        f"{r['env']['read_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s; batch 1, {r['settings']['new_tokens']} "
        f"new tokens, median of {r['settings']['rounds']} interleaved rounds",
        "",
        "| contender | step ms | tok/s | MB/step | roofline tok/s | of roofline |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in r["rows"].items():
        lines.append(
            f"| {name} | {row['decode_step_s'] * 1e3:.3f} | {row['tokens_per_s']:.0f} | "
            f"{row['bytes_per_step'] / 1e6:.0f} | {row['roofline_tokens_per_s']:.0f} | "
            f"{row['roofline_fraction']:.1%} |"
        )
    lines += ["", "greedy tokens identical (of " + str(r["greedy_tokens"]) + "): "
              + ", ".join(f"{k} {v}" for k, v in r["greedy_identical_prefix"].items()), "",
              "T-token forward / one-token forward (eager):"]  # fmt: skip
    for f, costs in r["t_token_cost"].items():
        lines.append(f"  {f}: " + ", ".join(f"T={T} {v:.2f}x" for T, v in costs.items()))
    return "\n".join(lines)


def main_model(
    source: Path | None, log: Log, shape: str | None = None
) -> tuple[TransformerLM, torch.Tensor, str]:
    """The checkpoint if there is one (and no `shape` is asked for), else random weights in the
    shapes of `shape` (default SmolLM2-135M; speed does not depend on the values); a 64-token prompt."""
    from cs336_inference.bench.decode import benchmark_prompt
    from cs336_inference.io.checkpoint import CheckpointError, default_model_path, load_pretrained

    if shape is None:
        try:
            source = source or default_model_path()
            model = load_pretrained(source, dtype=torch.float32)
            return model, benchmark_prompt(source, model.config.vocab_size, 64), str(source.name)
        except CheckpointError as e:
            log(f"{e}; using SmolLM2-135M's shapes with random weights")
    shape = shape or "smollm2-135m"
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    torch.manual_seed(0)
    model = TransformerLM(SHAPES[shape]()).eval()
    with torch.no_grad():
        model.norm.weight.mul_(8.0)  # a random model's logits are nearly flat: sharpen them
    prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    return model, prompt, f"{shape} shapes, random weights"

"""The roofline of this machine: is prefill compute-bound and decode memory-bound here too?

A kernel takes at least max(FLOPs / peak FLOP/s, bytes / read bandwidth). `measure_roofline`
measures the two roofs (`timing.read_bandwidth`, `timing.matmul_flops_per_second`), then times
matmuls [B*T, D] x [D, F] for growing B*T and a model's decode steps (several batch sizes) and one
prefill, and puts each next to its prediction. FLOPs and bytes come from `accounting`: a matmul's
`matmul_flops` / `matmul_bytes`, a step's `forward_flops` / `decode_step_bytes`.

scripts/roofline.py prints the result, plots it and writes it as JSON.
"""

from __future__ import annotations

import torch

from cs336_inference import accounting as acc
from cs336_inference.bench.timing import (
    last_level_cache_bytes,
    matmul_flops_per_second,
    median_seconds,
    read_bandwidth,
)
from cs336_inference.config import ModelConfig
from cs336_inference.model import TransformerLM

MiB = 2**20
BT_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
BT_SIZES_QUICK = [1, 4, 16, 64, 256]
DECODE_BATCHES = [1, 4, 16]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def predict(flops: float, n_bytes: float, peak: float, bandwidth: float) -> dict:
    """The roofline: a kernel takes as long as its slower resource (compute and reads overlap)."""
    compute, memory = flops / peak, n_bytes / bandwidth
    return {
        "flops": flops,
        "bytes": n_bytes,
        "intensity": flops / n_bytes,
        "predicted_s": max(compute, memory),
        "bound": "compute" if compute >= memory else "memory",
    }


def matmul_sweep(
    sizes: list[int], D: int, F: int, dtype: torch.dtype, device: torch.device, peak: float, bandwidth: float,
    repeats: int,
) -> list[dict]:  # fmt: skip
    """[BT, D] x [D, F] for each BT in sizes: predicted and measured seconds."""
    dtype_bytes = dtype.itemsize
    w = torch.randn(D, F, device=device).to(dtype)
    rows = []
    for BT in sizes:
        x = torch.randn(BT, D, device=device).to(dtype)
        y = torch.empty(BT, F, device=device, dtype=dtype)
        row = {"name": f"matmul BT={BT}", "BT": BT, "D": D, "F": F}
        row |= predict(acc.matmul_flops(BT, D, F), acc.matmul_bytes(BT, D, F, dtype_bytes), peak, bandwidth)
        row["measured_s"] = median_seconds(lambda x=x, y=y: torch.matmul(x, w, out=y), repeats, device=device)
        rows.append(row)
    return rows


@torch.inference_mode()
def model_steps(
    model: TransformerLM, context: int, peak: float, bandwidth: float, repeats: int,
    batches: list[int] = DECODE_BATCHES,
) -> list[dict]:  # fmt: skip
    """Decode steps at several batch sizes (S = context + 1 keys each) and one prefill of `context` tokens."""
    cfg, device = model.config, model.embed.weight.device
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        prompt = torch.randint(0, cfg.vocab_size, (B, context), generator=gen).to(device)
        step_ids = torch.randint(0, cfg.vocab_size, (B, 1), generator=gen).to(device)
        cache = model.new_cache(B, context + 1)
        model(prompt, cache=cache)

        def step(cache=cache, step_ids=step_ids):
            model(step_ids, cache=cache, last_only=True)
            cache.truncate(context)  # keep S fixed: every timed step attends to context + 1 keys

        S = context + 1
        row = {"name": f"decode B={B}", "B": B, "T": 1, "S": S}
        row |= predict(acc.forward_flops(cfg, B, 1, S), acc.decode_step_bytes(model, B, S), peak, bandwidth)
        row["measured_s"] = median_seconds(step, repeats, device=device)
        rows.append(row)

    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=gen).to(device)
    row = {"name": f"prefill T={context}", "B": 1, "T": context, "S": context}
    flops = acc.forward_flops(cfg, 1, context, context)
    row |= predict(flops, acc.decode_step_bytes(model, 1, context), peak, bandwidth)
    row["measured_s"] = median_seconds(
        lambda: model(prompt, cache=model.new_cache(1, context)), repeats, device=device
    )
    rows.append(row)
    return rows


def random_model_config(device: torch.device, quick: bool) -> ModelConfig:
    """A small random Llama-style GQA model (tied embeddings, so every weight is read per step)."""
    if device.type == "cuda":  # Llama-3-8B-shaped layers, fewer of them
        layers = 2 if quick else 8
        return ModelConfig(
            vocab_size=32000, d_model=4096, n_layers=layers, n_heads=32, n_kv_heads=8, d_ff=14336,
            max_seq_len=4096, tie_embeddings=True,
        )  # fmt: skip
    if quick:
        return ModelConfig(
            vocab_size=32000, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1408, max_seq_len=1024,
            tie_embeddings=True,
        )  # fmt: skip
    return ModelConfig(
        vocab_size=32000, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=2816,
        max_seq_len=2048, tie_embeddings=True,
    )  # fmt: skip


def random_model(device: torch.device, dtype: torch.dtype, quick: bool) -> TransformerLM:
    """`random_model_config`'s model, seeded, built directly on the device."""
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device (a GPU-sized model is slow to build on CPU)
        model = TransformerLM(random_model_config(device, quick))
    return model.to(dtype=dtype).eval()


def sweep_dtype(device: torch.device) -> str:
    """The dtype of the sweep and the model: bf16 on a GPU (its tensor cores), float32 on a CPU."""
    return "bfloat16" if device.type == "cuda" else "float32"


def measure_roofline(
    model: TransformerLM, source: str = "random", quick: bool = False, context: int | None = None
) -> dict:
    """Both roofs of the model's device, a matmul sweep and the model's steps, as one JSON-ready dict.

    The model (loaded from `source`) must already be in `sweep_dtype(device)`. The read bandwidth is measured twice: on a
    set well beyond the last-level cache ("large_set", the matmuls' roof) and on one the size of the
    model's weights ("model_set", the model steps' roof).
    """
    device = model.embed.weight.device
    on_gpu = device.type == "cuda"
    repeats = 3 if quick else 10
    dtype_name = sweep_dtype(device)
    dtype = DTYPES[dtype_name]
    cfg = model.config
    context = context or (64 if quick else 256)
    if context < 1 or context + 1 > cfg.max_seq_len:
        raise ValueError(f"context must be in 1..{cfg.max_seq_len - 1} (max_seq_len - 1), got {context}")

    result: dict = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device)
        if on_gpu
        else f"CPU, {torch.get_num_threads()} torch thread(s)",
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "quick": quick,
        "sweep_dtype": dtype_name,
    }
    llc = last_level_cache_bytes(device)
    result["last_level_cache_bytes"] = llc
    result["model"] = {"source": source, "params": model.num_parameters(), "config": cfg.to_dict()}
    weight_bytes = acc.decode_weight_bytes(model)
    large = max(4 * (llc or 0), (256 if on_gpu or not quick else 128) * MiB)
    if on_gpu and not quick:
        large = max(large, 1024 * MiB)
    result["bandwidth"] = {
        "large_set": {"bytes": large, "bytes_per_s": read_bandwidth(large, device, repeats)},
        "model_set": {"bytes": weight_bytes, "bytes_per_s": read_bandwidth(weight_bytes, device, repeats)},
    }
    n = (4096 if quick else 8192) if on_gpu else (1024 if quick else 2048)
    result["peak_flops"] = {
        name: matmul_flops_per_second(n, dt, device, repeats) for name, dt in DTYPES.items()
    }
    result["peak_matmul_n"] = n
    peak = result["peak_flops"][dtype_name]

    D = F = 8192 if on_gpu else 4096  # the weight alone is larger than the last-level cache
    sizes = BT_SIZES_QUICK if quick else BT_SIZES
    bw_large = result["bandwidth"]["large_set"]["bytes_per_s"]
    result["matmul"] = matmul_sweep(sizes, D, F, dtype, device, peak, bw_large, repeats)
    bw_model = result["bandwidth"]["model_set"]["bytes_per_s"]
    result["model_steps"] = model_steps(model, context, peak, bw_model, repeats)
    return result

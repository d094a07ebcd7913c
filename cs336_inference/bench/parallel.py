"""Tensor parallelism measured on this machine (`scripts/benchmark.py tp`), beside the accounting.

The model is SmolLM2-135M's shape with 8 query heads of 72 and 4 K/V heads (SmolLM2's own 9 heads
split over 3 ranks, not 2), random float32 weights. tp = 1 runs it whole with all the CPU threads;
tp = n runs n gloo processes with an equal share of the threads each. Each decode step is timed,
and inside it the time spent in the collectives (all-reduce, all-gather), so the step splits into
compute and communication. The all-reduce itself is timed alone at two sizes, which fixes the
latency and bandwidth of gloo here; the accounting's ring formula with them predicts the step's
communication, set beside what was measured.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from ..accounting import (
    NVLINK_BANDWIDTH,
    NVLINK_LATENCY,
    PCIE_BANDWIDTH,
    PCIE_LATENCY,
    preset,
    ring_allgather_time,
    ring_allreduce_time,
    tp_decode_step,
)
from ..config import ModelConfig
from ..model import TransformerLM

SHAPE = dict(n_heads=8, n_kv_heads=4, head_dim=72)  # SmolLM2's widths, heads that 2 ranks divide


def bench_config() -> ModelConfig:
    return preset("smollm2-135m", **SHAPE, max_seq_len=2048)


class CollectiveTimer:
    """Wraps torch.distributed's all_reduce and all_gather to add up the seconds spent in them."""

    NAMES = ("all_reduce", "all_gather")

    def __init__(self):
        self.seconds = 0.0
        self.real = {name: getattr(dist, name) for name in self.NAMES}

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(dist, name, self._timed(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return call


def _allreduce_seconds(numbers: int, rounds: int) -> float:
    x = torch.zeros(numbers)
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def rank_run(B: int, S: int, steps: int, threads: int) -> dict:
    """On each rank (or alone, tp = 1): median decode step, its communication, bytes held."""
    torch.set_num_threads(threads)
    cfg = bench_config()
    torch.manual_seed(0)
    whole = TransformerLM(cfg).eval()
    tp = dist.get_world_size() if dist.is_initialized() else 1
    if tp > 1:
        from ..parallel import shard_model

        model = shard_model(whole)
        del whole
        local = model.local
    else:
        model = local = whole
    weights = sum(t.nbytes for t in local.state_dict().values())
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(B, S + steps + 2)
    model(ids, cache=cache, last_only=True)
    token = ids[:, -1:]
    step_s, comm_s = [], []
    for _ in range(steps + 2):  # two warm-up steps
        if tp > 1:
            dist.barrier()
        with CollectiveTimer() as timer:
            start = time.perf_counter()
            model(token, cache=cache, last_only=True)
            step_s.append(time.perf_counter() - start)
        comm_s.append(timer.seconds)
    out = dict(
        step_s=statistics.median(step_s[2:]),
        comm_s=statistics.median(comm_s[2:]),
        weight_bytes=weights,
        kv_bytes=sum(layer.nbytes for layer in cache.layers if layer is not None),
    )
    if tp > 1:  # gloo's latency and bandwidth here: a tiny and a large all-reduce
        small, large = B * cfg.d_model, 4 * 1024 * 1024
        out["allreduce_small_s"] = _allreduce_seconds(small, 50)
        out["allreduce_large_s"] = _allreduce_seconds(large, 10)
    return out


@torch.inference_mode()
def compare_with_whole(B: int = 2, T: int = 12, new_tokens: int = 16) -> dict:
    """On each rank: the sharded model's logits and greedy tokens against the whole model's (both
    built from the same seed in this rank's memory), and the bytes each holds."""
    from ..parallel import shard_model
    from ..sampling import generate

    cfg = bench_config()
    torch.manual_seed(0)
    whole = TransformerLM(cfg).eval()
    shard = shard_model(whole)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    diff = (shard(ids) - whole(ids)).abs().max().item()
    same = (
        generate(shard, ids[0], new_tokens, stop_token_ids=[]).tolist()
        == generate(whole, ids[0], new_tokens, stop_token_ids=[]).tolist()
    )
    return dict(
        rank=dist.get_rank(),
        max_logit_difference=diff,
        same_greedy_tokens=same,
        shard_weight_bytes=sum(t.nbytes for t in shard.local.state_dict().values()),
        whole_weight_bytes=sum(t.nbytes for t in whole.state_dict().values()),
    )


def tp_benchmark(tps: list[int], B: int, S: int, steps: int, threads: int, log=print) -> dict:
    from ..parallel.launch import spawn

    cfg = bench_config()
    rows = []
    for tp in tps:
        log(f"tp = {tp}: {tp} process(es), {max(1, threads // tp)} thread(s) each")
        ranks = (
            [rank_run(B, S, steps, threads)]
            if tp == 1
            else spawn(rank_run, tp, B, S, steps, max(1, threads // tp))
        )
        r0 = ranks[0]
        row = dict(tp=tp, step_s=max(r["step_s"] for r in ranks), comm_s=max(r["comm_s"] for r in ranks))
        row.update(weight_bytes=r0["weight_bytes"], kv_bytes=r0["kv_bytes"])
        if tp > 1:
            # the alpha-beta model of gloo here, from the two sizes: t = 2 (tp - 1) (a + n / (tp b))
            small_n, large_n = 4 * B * cfg.d_model, 4 * 4 * 1024 * 1024
            ts, tl = r0["allreduce_small_s"], r0["allreduce_large_s"]
            steps_ = 2 * (tp - 1)
            bandwidth = (large_n - small_n) / tp / ((tl - ts) / steps_)
            latency = ts / steps_ - small_n / tp / bandwidth
            latency = max(latency, 0.0)
            predicted = (2 * cfg.n_layers + 1) * ring_allreduce_time(small_n, tp, bandwidth, latency)
            predicted += ring_allgather_time(4 * B * cfg.vocab_size, tp, bandwidth, latency)
            row.update(link_bandwidth=bandwidth, link_latency=latency, predicted_comm_s=predicted)
        rows.append(row)
    return dict(B=B, S=S, steps=steps, threads=threads, config=dataclasses.asdict(cfg), rows=rows)


def crossover_table(B: int = 1, S: int = 1024) -> list[dict]:
    """The accounting's decode step for tp = 1, 2, 4, 8 on H100s over NVLink and PCIe (bf16)."""
    rows = []
    for name in ("llama2-13b", "llama2-70b"):
        cfg = preset(name)
        base = tp_decode_step(cfg, B, S, 1)["step_s"]
        for link, bw, lat in (
            ("NVLink", NVLINK_BANDWIDTH, NVLINK_LATENCY),
            ("PCIe", PCIE_BANDWIDTH, PCIE_LATENCY),
        ):
            for tp in (1, 2, 4, 8):
                p = tp_decode_step(cfg, B, S, tp, link_bandwidth=bw, link_latency=lat)
                rows.append(dict(model=name, link=link, tp=tp, speedup=base / p["step_s"], **p))
    return rows


def format_tp_table(r: dict) -> str:
    lines = [
        f"decode steps, B = {r['B']}, S = {r['S']}, float32, {r['threads']} threads in all (median of {r['steps']})",
        "",
        "| tp | step (ms) | communication (ms) | share | predicted communication (ms) | weights per rank (MB) | KV per rank (MB) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["rows"]:
        pred = f"{1e3 * row['predicted_comm_s']:.2f}" if "predicted_comm_s" in row else "-"
        lines.append(
            f"| {row['tp']} | {1e3 * row['step_s']:.2f} | {1e3 * row['comm_s']:.2f} | "
            f"{row['comm_s'] / row['step_s']:.0%} | {pred} | {row['weight_bytes'] / 1e6:.1f} | {row['kv_bytes'] / 1e6:.2f} |"
        )
    for row in r["rows"]:
        if "link_bandwidth" in row:
            lines.append(
                f"gloo here, tp = {row['tp']}: latency {1e6 * row['link_latency']:.0f} us per ring step, "
                f"bandwidth {row['link_bandwidth'] / 1e9:.2f} GB/s (fitted from two all-reduce sizes)"
            )
    lines += [
        "",
        "predicted decode step on H100s (accounting.tp_decode_step, bf16, B = 1, S = 1024):",
        "",
        "| model | link | tp | memory (ms) | communication (ms) | step (ms) | speedup |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r["crossover"]:
        lines.append(
            f"| {row['model']} | {row['link']} | {row['tp']} | {1e3 * row['memory_s']:.2f} | "
            f"{1e3 * row['communication_s']:.2f} | {1e3 * row['step_s']:.2f} | {row['speedup']:.2f}x |"
        )
    return "\n".join(lines)

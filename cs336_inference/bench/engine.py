"""The serving engine's decode throughput against one stream (scripts/benchmark.py engine).

A decode step reads every weight once, whatever the number of sequences in it, and does 2 FLOPs
per weight per sequence: on a CPU one sequence's step is memory-bound and 16 sequences' step costs
the same weight read plus 16x the multiply-adds. So `LLMEngine` with n requests decoding at once
should give nearly n times the tokens/s of one request, until the multiply-adds catch up with
the bytes. Measured here side by side, one process, one model:

    stream      the single-stream fast path (what `scripts/generate.py` runs: a native FixedStep of
                one sequence over a static cache), decode steps only
    engine n    LLMEngine with n requests of the same prompt length, all decoding (steady state:
                prefill done, nobody finishing), on the fast path (`fast.install`) and on the
                readable model (`--eager` rows); greedy, and for `sampled_sizes` also sampled
                (temperature 0.8, top-p 0.95) without and with a seed, after prompts of text

Each row is the median of its timed steps after warm-up steps, rounds interleaved across the rows so
that a machine's drift is shared; the ratio to one engine request is also given per round (its
range in brackets), since a memory bandwidth that drifts moves one request's step far more than a
compute-bound 16-request step. The roofline of a step is the bytes it must read (the weights
plus the n sequences' K/V at their mean length, `accounting.decode_step_bytes`) over the read
bandwidth of a buffer the size of the weights, measured at the start of every round (the median
of the rounds; their range is reported, since it drifts on a shared machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cs336_inference import accounting as acc
from cs336_inference.bench.timing import read_bandwidth
from cs336_inference.fast import install, uninstall
from cs336_inference.fast.step.fixed import FixedStep
from cs336_inference.serving import LLMEngine, SamplingParams


def stored_bytes(model) -> int:
    """Bytes a decode step reads from the weights: parameters and buffers (quantized layers keep their
    codes and scales as buffers), less the rotary tables and an untied input embedding."""
    skip = {id(model.embed.weight)} if model.lm_head is not None else set()
    skip |= {id(model.rope_cos), id(model.rope_sin)}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def synthetic_prompt(vocab_size: int, n: int, index: int = 0) -> list[int]:
    """n token ids spread over the vocabulary (past the first 100, where special tokens sit);
    distinct prompts for distinct `index`, so no two requests share a prefix."""
    return [(100 + 7919 * (index * n + t)) % (vocab_size - 100) + 100 for t in range(n)]


SAMPLED = dict(temperature=0.8, top_p=0.95)  # the sampled rows' parameters (`sampled_sizes`)


class EngineSteps:
    """An engine holding n requests that all decode: `step()` times one engine step (seconds)."""

    def __init__(
        self, model, n: int, prompt_len: int, steps: int, block_size: int = 16, sampling: dict | None = None,
        prompts: list[list[int]] | None = None,
    ):  # fmt: skip
        S = prompt_len + steps + 8
        blocks = n * -(-S // block_size) + 1
        self.engine = LLMEngine(model, num_blocks=blocks, block_size=block_size, max_batch_tokens=max(512, n), max_batch_seqs=n)  # fmt: skip
        sampling = sampling or dict(temperature=0.0)
        params = SamplingParams(max_new_tokens=steps + 4, stop_token_ids=(), **sampling)
        for i in range(n):
            prompt = (
                prompts[i][:prompt_len]
                if prompts
                else synthetic_prompt(model.config.vocab_size, prompt_len, i)
            )
            self.engine.add_request(prompt, params)
        while any(s.num_computed < s.num_prompt for s in self.engine.requests.values()):
            self.engine.step()  # prefill (and the first tokens)
        self.n = n

    def step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def context(self) -> float:
        return statistics.mean(s.num_computed for s in self.engine.requests.values())


class StreamSteps:
    """One sequence on the single-stream fast path: `step()` times one native decode step."""

    def __init__(self, model, prompt_len: int, steps: int):
        prompt = torch.tensor([synthetic_prompt(model.config.vocab_size, prompt_len)])
        self.cache = model.new_cache(1, prompt_len + steps + 8)
        self.token = model(prompt, cache=self.cache)[:, -1].argmax(-1)
        try:
            self.fixed = FixedStep(model, self.cache, "native")
        except ValueError:  # a model the native step cannot run: the fixed-shape step on the kernels
            self.fixed = FixedStep(model, self.cache, "eager")
        self.n = 1

    def step(self) -> float:
        start = time.perf_counter()
        self.token = self.fixed(self.token).argmax(-1)
        return time.perf_counter() - start

    def context(self) -> float:
        return float(self.cache.pos)


@torch.inference_mode()
def engine_benchmark(
    model,
    sizes: list[int],
    prompt_len: int = 64,
    steps: int = 24,
    rounds: int = 3,
    eager_sizes: list[int] | None = None,
    sampled_sizes: list[int] | None = None,
    sampled_prompts: list[list[int]] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Median step time and tokens/s of the stream and of the engine at each size (module docstring).

    `steps` timed steps per row, split over `rounds` interleaved rounds (after 3 warm-up steps each).
    `eager_sizes`: engine sizes also run on the readable model (the fast path uninstalled meanwhile).
    `sampled_sizes`: engine sizes also run with SAMPLED parameters instead of greedy: unseeded (drawn
    in one batch, serving/sampler.py) and seeded (drawn row by row, as `generate` draws), from
    `sampled_prompts` if given (text: how wide a nucleus is, and so what drawing costs, depends on
    it; the synthetic prompts' token soup gives nuclei of hundreds of tokens).
    """
    install(model)
    weights = stored_bytes(model)
    bandwidths = []  # read bandwidth, one per round
    total = steps + 3 * rounds
    rows: dict[str, object] = {"stream": StreamSteps(model, prompt_len, total)}
    for n in sizes:
        log(f"  prefilling {n} request(s) of {prompt_len} tokens")
        rows[f"engine {n}"] = EngineSteps(model, n, prompt_len, total)
    for n in sampled_sizes or []:
        log(f"  prefilling {n} sampled request(s), unseeded and seeded")
        rows[f"sampled engine {n}"] = EngineSteps(model, n, prompt_len, total, sampling=SAMPLED, prompts=sampled_prompts)  # fmt: skip
        rows[f"seeded engine {n}"] = EngineSteps(model, n, prompt_len, total, sampling=dict(SAMPLED, seed=0), prompts=sampled_prompts)  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in rows}
    contexts: dict[str, list[float]] = {name: [] for name in rows}
    per_round = -(-steps // rounds)
    steps_by_round: dict[str, list[list[float]]] = {name: [] for name in rows}
    for r in range(rounds):
        bandwidths.append(read_bandwidth(max(weights, 1 << 26)))
        for name, row in rows.items():
            for _ in range(3):  # warm-up: caches, thread pools, layouts
                row.step()
            for _ in range(per_round):
                contexts[name].append(row.context())
                times[name].append(row.step())
            steps_by_round[name].append(times[name][-per_round:])
        log(f"  round {r + 1}/{rounds}: {bandwidths[-1] / 1e9:.1f} GB/s; " + ", ".join(f"{k} {rows[k].n / statistics.median(v):.1f}" for k, v in times.items()) + " tok/s")  # fmt: skip
    readable = {}
    if eager_sizes:
        uninstall(model)
        for n in eager_sizes:
            log(f"  readable engine, {n} request(s)")
            row = EngineSteps(model, n, prompt_len, steps + 3)
            for _ in range(3):
                row.step()
            readable[n] = [row.step() for _ in range(max(4, steps // 4))]
        install(model)
    bandwidth = statistics.median(bandwidths)
    log(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s over {weights / 1e6:.0f} MB of weights (median of rounds)"
    )
    results = []
    for name, row in rows.items():
        step_s = statistics.median(times[name])
        S = statistics.mean(contexts[name])
        need = weights + acc.kv_cache_bytes(model.config, row.n, round(S), 4)
        results.append(
            dict(
                name=name,
                sequences=row.n,
                step_ms=step_s * 1e3,
                tokens_per_s=row.n / step_s,
                mean_context=S,
                bytes_per_step=need,
                roofline_ms=need / bandwidth * 1e3,
                fraction_of_roofline=need / bandwidth / step_s,
            )  # fmt: skip
        )
    for n, ts in readable.items():
        step_s = statistics.median(ts)
        results.append(
            dict(name=f"readable engine {n}", sequences=n, step_ms=step_s * 1e3, tokens_per_s=n / step_s)
        )
    one = next((r for r in results if r["name"] == "engine 1"), None)
    stream = results[0]
    for r in results:
        r["vs_stream"] = r["tokens_per_s"] / stream["tokens_per_s"]
        if one is not None:
            r["vs_engine_1"] = r["tokens_per_s"] / one["tokens_per_s"]
    if one is not None:  # the same ratio within each round: how far the machine's drift moves it
        by_round = {name: [statistics.median(ts) for ts in lists] for name, lists in steps_by_round.items()}
        for r in results:
            if r["name"] in by_round:
                ratios = [
                    r["sequences"] * a / b
                    for a, b in zip(by_round["engine 1"], by_round[r["name"]], strict=True)
                ]
                r["vs_engine_1_rounds"] = ratios
    return dict(rows=results, weight_bytes=weights, read_bandwidth=bandwidth, read_bandwidth_rounds=bandwidths,
                prompt_len=prompt_len, timed_steps=steps, rounds=rounds, threads=torch.get_num_threads())  # fmt: skip


def format_engine_table(result: dict) -> str:
    """The rows as a markdown table."""
    out = [
        "| path | sequences | step (ms) | tokens/s | x one engine request (rounds) | x stream | roofline step (ms) | of roofline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        roof = f"{r['roofline_ms']:.1f} | {r['fraction_of_roofline']:.0%}" if "roofline_ms" in r else "| "
        vs1 = f"{r['vs_engine_1']:.2f}" if "vs_engine_1" in r else ""
        if len(r.get("vs_engine_1_rounds", [])) > 1:
            vs1 += f" ({min(r['vs_engine_1_rounds']):.2f}-{max(r['vs_engine_1_rounds']):.2f})"
        out.append(
            f"| {r['name']} | {r['sequences']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | {vs1} | "
            f"{r['vs_stream']:.2f} | {roof} |"
        )
    bw = [b / 1e9 for b in result.get("read_bandwidth_rounds", [result["read_bandwidth"]])]
    out += ["", f"roofline: read bandwidth {result['read_bandwidth'] / 1e9:.1f} GB/s over {result['weight_bytes'] / 1e6:.0f} MB "
            f"(the weights' size), median of the rounds ({min(bw):.1f}-{max(bw):.1f})"]  # fmt: skip
    return "\n".join(out)

"""What structured output costs per token (`scripts/benchmark.py grammar`).

The model writes one JSON value per schema (evals/json_schemas.json) through the engine with the
llguidance mask, sampling at temperature 1. Those token sequences are then replayed through each
grammar engine installed (llguidance, which structured.py uses; outlines-core, if present) to time,
per token, what the sampler waits for: the set of allowed tokens as a [V] mask over the 49K-token
vocabulary, applied to a row of logits. Compile time is per schema. End to end, the engine decodes
the same prompts for the same numbers of tokens with and without the mask, all requests together.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..sampling import SamplingParams
from ..serving import LLMEngine
from ..serving.choices import TokenStrings
from ..structured import JsonGrammar

SCHEMAS = Path(__file__).resolve().parents[2] / "evals" / "json_schemas.json"


def load_schemas(path: Path = SCHEMAS) -> dict[str, dict]:
    return json.loads(path.read_text())


def schema_prompt(tokenizer, schema: dict) -> list[int]:
    """A chat prompt asking for JSON that follows the schema (what the benchmark and tests send)."""
    messages = [{"role": "user", "content": "Reply with JSON only, for this schema: " + json.dumps(schema)}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)


class _Outlines:
    """outlines-core's index for one schema, as a [V] mask (its Guide lists the allowed ids)."""

    def __init__(self, tokenizer, eos: int):
        from outlines_core import Vocabulary

        strings, table = TokenStrings(tokenizer), {}
        for t in range(tokenizer.vocab_size):
            if t != eos:
                table.setdefault(strings.bytes(t), []).append(t)
        self.vocab, self.V, self.eos = Vocabulary(eos, table), tokenizer.vocab_size, eos

    def compile(self, schema: dict):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), self.vocab)

    def run(self, index, tokens: list[int], logits: torch.Tensor) -> list[float] | None:
        from outlines_core import Guide

        guide, times = Guide(index), []
        for t in tokens:
            start = time.perf_counter()
            mask = torch.zeros(self.V, dtype=torch.bool)
            mask[torch.tensor(guide.get_tokens())] = True
            logits.masked_fill_(~mask, float("-inf"))
            times.append(time.perf_counter() - start)
            if not mask[t]:
                return None  # its regex does not take this tokenization
            if t == self.eos:
                break
            guide.advance(t)
        return times


def _llguidance_run(
    grammar: JsonGrammar, schema: dict, tokens: list[int], logits: torch.Tensor
) -> list[float]:
    matcher, times = grammar.matcher(schema), []
    for t in tokens:
        start = time.perf_counter()
        logits.masked_fill_(~matcher.allowed(), float("-inf"))
        times.append(time.perf_counter() - start)
        if not matcher.done:
            matcher.accept(t)
    return times


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def grammar_benchmark(
    model, tokenizer, schemas: dict[str, dict], seed: int = 0, log: Callable = print
) -> dict:
    grammar = JsonGrammar(tokenizer)
    prompts = [schema_prompt(tokenizer, s) for s in schemas.values()]
    params = [
        SamplingParams(max_new_tokens=200, temperature=1.0, seed=seed + i, json_schema=s)
        for i, s in enumerate(schemas.values())
    ]
    log(f"writing one JSON value per schema ({len(schemas)} schemas), with the mask")
    engine = LLMEngine(model, num_blocks=512, max_batch_tokens=32, grammar=grammar)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    masked_s = time.perf_counter() - start
    masked_steps = engine.stats()["steps"]
    lengths = [len(o) for o in outputs]
    log("the same prompts and lengths without the mask")
    engine = LLMEngine(model, num_blocks=512, max_batch_tokens=32)
    free = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed + i, stop_token_ids=()) for i, n in enumerate(lengths)]  # fmt: skip
    start = time.perf_counter()
    engine.generate(prompts, free)
    free_s = time.perf_counter() - start

    V = tokenizer.vocab_size
    logits = torch.randn(V)
    engines: dict[str, dict] = {}
    log("replaying the values through llguidance")
    compile_ms, per_token = [], []
    for schema, tokens in zip(schemas.values(), outputs, strict=True):
        start = time.perf_counter()
        grammar._compiled.clear()
        grammar.compile(schema)
        compile_ms.append(1e3 * (time.perf_counter() - start))
        per_token += _llguidance_run(grammar, schema, tokens, logits.clone())
    engines["llguidance"] = dict(schemas=len(schemas), compile_ms=compile_ms, mask_s=per_token)
    try:
        outlines = _Outlines(tokenizer, tokenizer.eos_token_ids[0])
    except ImportError:
        outlines = None
    if outlines is not None:
        log("replaying the values through outlines-core")
        compile_ms, per_token, compiled, refused = [], [], 0, []
        for name, schema, tokens in zip(schemas, schemas.values(), outputs, strict=True):
            start = time.perf_counter()
            try:
                index = outlines.compile(schema)
            except Exception:  # a schema it does not support
                refused.append(f"{name} (does not compile)")
                continue
            compile_ms.append(1e3 * (time.perf_counter() - start))
            times = outlines.run(index, tokens, logits.clone())
            if times is None:
                refused.append(f"{name} (masks a token of the value)")
            else:
                compiled += 1
                per_token += times
        engines["outlines-core"] = dict(
            schemas=compiled, compile_ms=compile_ms, mask_s=per_token, refused=refused
        )
    n_tokens = sum(lengths)
    return dict(
        schemas=len(schemas),
        tokens=n_tokens,
        vocab=V,
        engine_masked_s=masked_s,
        engine_free_s=free_s,
        engine_steps=masked_steps,
        engines={
            name: dict(
                schemas=e["schemas"],
                compile_ms_median=statistics.median(e["compile_ms"]) if e["compile_ms"] else None,
                compile_ms_max=max(e["compile_ms"]) if e["compile_ms"] else None,
                mask_us_median=1e6 * statistics.median(e["mask_s"]) if e["mask_s"] else None,
                mask_us_p99=1e6 * _quantile(e["mask_s"], 0.99) if e["mask_s"] else None,
                tokens=len(e["mask_s"]),
                refused=e.get("refused", []),
            )
            for name, e in engines.items()
        },
    )


def format_grammar_table(r: dict) -> str:
    lines = [
        f"{r['schemas']} schemas, {r['tokens']} tokens sampled at temperature 1, vocabulary {r['vocab']}",
        "",
        "| grammar engine | schemas run | compile ms median / max | mask per token, us median / p99 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, e in r["engines"].items():
        compile_ms = (
            "-"
            if e["compile_ms_median"] is None
            else f"{e['compile_ms_median']:.2f} / {e['compile_ms_max']:.2f}"
        )
        mask = "-" if e["mask_us_median"] is None else f"{e['mask_us_median']:.0f} / {e['mask_us_p99']:.0f}"
        lines.append(f"| {name} | {e['schemas']} | {compile_ms} | {mask} |")
    for name, e in r["engines"].items():
        if e["refused"]:
            lines.append(f"{name} did not run: {', '.join(e['refused'])}")
    per_token_ms = 1e3 * (r["engine_masked_s"] - r["engine_free_s"]) / r["tokens"]
    lines += [
        "",
        f"engine, all {r['schemas']} requests together: {r['tokens'] / r['engine_masked_s']:.1f} tok/s with the "
        f"mask, {r['tokens'] / r['engine_free_s']:.1f} tok/s without ({per_token_ms:+.2f} ms per token)",
    ]
    return "\n".join(lines)

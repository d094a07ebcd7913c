"""The serving engine on the fast path (fast/step/paged.py, step.c's cs336_layers_paged).

Independent references: the readable paged forward (model.forward_paged over serving/paged_attention.py,
itself tested equal to the full forward) and `generate` alone on the readable model. And a property
that cannot hold by accident: on the native path a request's logits are bitwise the same whether it
runs alone or beside other requests (every row is computed by the same operations, whatever else
shares the step).
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from cs336_inference.config import FULL, SLIDING, ModelConfig
from cs336_inference.fast import install
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import SamplingParams, generate
from cs336_inference.serving import LLMEngine
from cs336_inference.serving.paged_attention import PagedBatch, PagedKVCache

BASE = dict(vocab_size=64, d_model=64, n_layers=2, d_ff=128, max_seq_len=128, n_heads=4)
VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=5, n_layers=3, layer_types=[SLIDING, FULL, SLIDING]),
    "qkv_bias": dict(n_kv_heads=2, qkv_bias=True),
    "wide_group": dict(n_heads=12, n_kv_heads=1, head_dim=8),  # 12 query heads per K/V head: groups of <= 8
    # the head sizes step.c's paged attention compiles for (SmolLM2: 64-wide heads in groups of 3)
    "groups_of_3_h64": dict(n_heads=6, n_kv_heads=2, head_dim=64),
    "groups_of_4_h64": dict(n_heads=8, n_kv_heads=2, head_dim=64),
    "groups_of_4_h128": dict(n_heads=4, n_kv_heads=1, head_dim=128),
}


def kernels_or_skip() -> None:
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")


def tiny(variant: str, fmt: str = "fp32", seed: int = 0) -> TransformerLM:
    from cs336_inference.quantization import quantize_model

    kernels_or_skip()
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**BASE, **VARIANTS[variant]})).eval()
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # larger logits: greedy choices far from ties
        if model.config.qkv_bias:
            for block in model.layers:
                for layer in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                    layer.bias.normal_()
    return model if fmt == "fp32" else quantize_model(model, fmt, quantize_head=True)


def native_calls(monkeypatch) -> list[int]:
    """Rows of every step that ran natively (PagedStep.__call__), recorded."""
    from cs336_inference.fast.step import paged

    calls: list[int] = []
    run = paged.PagedStep.__call__

    def counted(self, input_ids, batch, *rest):
        calls.append(int(input_ids.shape[0]))
        return run(self, input_ids, batch, *rest)

    monkeypatch.setattr(paged.PagedStep, "__call__", counted)
    return calls


# Three sequences in scattered blocks of 4: prompt chunks together, decode steps, then a step mixing
# a chunk with decoding rows (and, for the window variants, keys past the window).
TABLES = [[5, 2, 9, 11, 14], [1, 7, 12], [3, 8, 0, 4, 6, 10]]
SCHEDULE = [[(0, 7), (1, 4), (2, 11)]] + [[(0, 1), (1, 1), (2, 1)]] * 4 + [[(0, 3), (1, 1), (2, 1)]]
SCHEDULE += [[(0, 1), (2, 1)]] * 3


# every attention variant in fp32; the kernels' quantized formats on three of them
CASES = [(v, "fp32") for v in VARIANTS]
CASES += [(v, f) for v in ("gqa", "hybrid", "qkv_bias") for f in ("int8", "int4", "q8_0", "q4_0")]


@pytest.mark.parametrize("variant,fmt", CASES)
def test_the_paged_native_step_equals_the_readable_paged_forward(variant, fmt, monkeypatch):
    """model.forward_paged on the fast path (one C call over the blocks) against the readable
    forward_paged of the same model, step by step on the same schedule, to float32 rounding."""
    readable = tiny(variant, fmt)
    fast = install(copy.deepcopy(readable))
    calls = native_calls(monkeypatch)
    cfg = readable.config
    caches = [PagedKVCache(cfg, 16, 4, torch.float32, "cpu") for _ in range(2)]
    tokens = [[(7 * i + 3 * j) % 64 for j in range(20)] for i in range(3)]  # more than any step reads
    done = [0, 0, 0]
    with torch.inference_mode():
        for step, rows in enumerate(SCHEDULE):
            spans = [(TABLES[i], done[i], n) for i, n in rows]
            ids = torch.tensor([t for i, n in rows for t in tokens[i][done[i] : done[i] + n]])
            want = TransformerLM.forward_paged(readable, ids, PagedBatch(caches[0], spans, "cpu"))
            got = fast.forward_paged(ids, PagedBatch(caches[1], spans, "cpu"))
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"{variant} {fmt} step {s}: {m}"
            )
            for (i, n), row in zip(rows, want, strict=True):
                done[i] += n
                if done[i] >= len(tokens[i]):
                    tokens[i].append(int(row.argmax()))
    assert calls == [sum(n for _, n in rows) for rows in SCHEDULE], (
        f"{variant} {fmt}: the native step ran for rows {calls}, expected every step"
    )


def workload(n: int, seed: int, shared: list[int]):
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(n):
        own = [rng.randrange(64) for _ in range(rng.randint(1, 20))]
        prompts.append(shared + own[:6] if rng.random() < 0.5 else own)
        params.append(SamplingParams(max_new_tokens=rng.randint(1, 14), stop_token_ids=()))
    return prompts, params


@pytest.mark.parametrize("fmt", ["fp32", "q4_0"])
def test_an_engine_on_the_fast_path_decodes_as_generate_alone(fmt, monkeypatch):
    """Under preemption (a small block budget) and prefix sharing, with steps of up to 24 rows: every
    request's greedy tokens are those of `generate` on the readable model alone."""
    readable = tiny("gqa", fmt)
    fast = install(copy.deepcopy(readable))
    calls = native_calls(monkeypatch)
    prompts, params = workload(40, seed=3, shared=[5, 9, 13, 17, 21, 25, 29, 33, 37])
    engine = LLMEngine(fast, num_blocks=14, block_size=4, max_batch_tokens=24, max_batch_seqs=8)
    outs = engine.generate(prompts, params)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_hits"] > 0, f"meant to preempt and share: {stats}"
    assert stats["free_blocks"] == stats["num_blocks"], f"blocks leaked: {stats}"
    assert len(calls) == stats["steps"], f"{len(calls)} native steps of {stats['steps']}"
    for i, (prompt, p, out) in enumerate(zip(prompts, params, outs, strict=True)):
        want = generate(readable, prompt, params=p).tolist()
        assert out == want, f"{fmt} request {i} (prompt of {len(prompt)}): {out} != generate alone {want}"


def test_long_requests_on_the_fast_path_decode_as_generate_alone(monkeypatch):
    """Sequences of 80 to 120 steps in blocks of 4 (the tables 20-30 blocks long; sliding windows
    left far behind), prompts prefilled in chunks of at most 32 rows: as `generate` alone."""
    rng = random.Random(7)
    for variant in ("gqa", "hybrid"):
        readable = tiny(variant)
        fast = install(copy.deepcopy(readable))
        calls = native_calls(monkeypatch)
        prompts = [[rng.randrange(64) for _ in range(rng.randint(50, 90))] for _ in range(4)]
        params = SamplingParams(max_new_tokens=30, stop_token_ids=())
        engine = LLMEngine(fast, num_blocks=128, block_size=4, max_batch_tokens=32, max_batch_seqs=8)
        outs = engine.generate(prompts, params)
        assert len(calls) == engine.stats()["steps"], f"{variant}: {len(calls)} native steps"
        for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
            want = generate(readable, prompt, params=params).tolist()
            assert out == want, f"{variant} request {i} (prompt of {len(prompt)}): {out} != {want}"
        monkeypatch.undo()


def recorded_logits(model, prompts, max_new: int) -> dict[int, list[torch.Tensor]]:
    """Each request's logits, step by step, from an engine whose steps have at most 32 rows."""
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_tokens=32, max_batch_seqs=16)
    seen: dict[int, list[torch.Tensor]] = {}
    ids = {engine.add_request(p, SamplingParams(max_new_tokens=max_new, stop_token_ids=())): i for i, p in enumerate(prompts)}  # fmt: skip
    sample = engine._sample

    def recording(logits, picks):
        for seq, row in picks:
            seen.setdefault(ids[seq.request_id], []).append(logits[row].clone())
        return sample(logits, picks)

    engine._sample = recording
    while engine.has_unfinished():
        engine.step()
    return seen


def test_a_request_gets_the_same_bits_alone_and_beside_others():
    """Batch invariance of the native path: request 0 alone, and among 11 others arriving with it
    (their prompt chunks and decode rows sharing its steps), gets bitwise the same logits."""
    model = install(tiny("gqa"))
    rng = random.Random(0)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(2, 9))] for _ in range(12)]
    with torch.inference_mode():
        alone = recorded_logits(model, prompts[:1], 10)[0]
        together = recorded_logits(model, prompts, 10)[0]
    assert len(alone) == len(together) == 10
    for t, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert torch.equal(a, b), (
            f"output token {t}: max |diff| {float((a - b).abs().max()):.2e} beside others"
        )


def test_an_engine_gone_frees_its_kv_cache():
    """The native step kept for an engine's cache (paged_step, a weak map from cache to step) does not
    keep that cache alive: once the engine is gone, so is its KV store. (A step that held its cache
    kept every engine's cache: answering the draft head's training prompts in chunks, one engine per
    chunk, grew by an engine's cache a chunk until the process was killed.)"""
    import gc
    import weakref

    from cs336_inference.fast.step.paged import paged_step

    model = install(tiny("gqa"))
    engine = LLMEngine(model, num_blocks=8, block_size=4, max_batch_tokens=8, max_batch_seqs=2)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, stop_token_ids=()))
    assert paged_step(model, engine.cache) is not None, "the engine's steps did not take the native path"
    cache = weakref.ref(engine.cache)
    del engine
    gc.collect()
    assert cache() is None, "the engine is gone but its KV cache is still alive"


@pytest.mark.parametrize(
    "variant", ["gqa", "wide_group", "groups_of_3_h64", "groups_of_4_h64", "groups_of_4_h128"]
)
def test_paged_native_layers_give_the_bits_of_the_static_native_layers(variant):
    """paged == contiguous, bitwise: the decoder layers over scattered blocks (cs336_layers_paged)
    and over a static [B, K, S, H] cache (cs336_layers) on the same rows, a prompt of 6 then 3 decode
    steps. Attention visits each head's keys in step order with the same reduction in both."""
    from cs336_inference.fast.step.fuse import fuse_siblings
    from cs336_inference.fast.step.native import NativeLayers
    from cs336_inference.fast.step.paged import PagedLayers
    from cs336_inference.kv_cache import KVCache, StaticKVCache

    model = install(tiny(variant))
    fuse_siblings(model)  # stacked q/k/v and gate/up, as both native steps run them
    cfg = model.config
    K, H = cfg.n_kv_heads, cfg.head_dim
    static = KVCache([StaticKVCache(1, K, 16, H, H, torch.float32, "cpu") for _ in range(cfg.n_layers)], 16)
    paged = PagedKVCache(cfg, 8, 4, torch.float32, "cpu")
    table = torch.tensor([[5, 2, 7, 1]])  # steps 0..15 in blocks 5, 2, 7, 1 of 4 slots
    native, over_blocks = NativeLayers(model, static), PagedLayers(model, paged)
    g = torch.Generator().manual_seed(0)
    for start, n in ((0, 6), (6, 1), (7, 1), (8, 1)):
        x = torch.randn(n, cfg.d_model, generator=g)
        steps = torch.arange(start, start + n)
        cos, sin = model.rope_cos[steps], model.rope_sin[steps]
        want = native(x.clone()[None], cos[None], sin[None], steps, torch.zeros(1, dtype=torch.long))[0]
        slots = table[0, steps // 4] * 4 + steps % 4
        rows = torch.stack([steps, slots, torch.zeros(n, dtype=torch.long)])
        got = over_blocks(x.clone(), cos, sin, rows, table)
        assert torch.equal(got, want), (
            f"{variant}, steps {start}..{start + n - 1}: max |diff| {float((got - want).abs().max()):.2e} "
            "between the paged and the static native layers"
        )


def test_models_the_native_step_cannot_run_take_the_readable_forward(monkeypatch):
    """MLA and CLA (and float64) go through the readable paged forward, with the same tokens."""
    from cs336_inference.fast.step import paged

    kernels_or_skip()
    calls = native_calls(monkeypatch)
    for fields, dtype in [
        (dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8), torch.float32),
        (dict(n_kv_heads=2, n_layers=4, kv_share=2), torch.float32),
        (dict(n_kv_heads=2), torch.float64),
    ]:
        torch.manual_seed(0)
        readable = TransformerLM(ModelConfig(**{**BASE, **fields})).eval().to(dtype)
        fast = install(copy.deepcopy(readable))
        cache = PagedKVCache(readable.config, 8, 4, dtype, "cpu")
        assert paged.why_not_paged(fast, cache) is not None, (
            f"{fields}: expected a reason not to run natively"
        )
        prompt = [1, 2, 3, 4, 5]
        out = LLMEngine(fast, num_blocks=8, block_size=4).generate([prompt], SamplingParams(max_new_tokens=6))
        assert out[0] == generate(readable, prompt, 6).tolist(), f"{fields}: {out[0]}"
    assert calls == [], f"the native step ran for {calls}"

"""Sliding-window blocks given back: when every layer slides over W steps, a block whose steps have
all left the window returns to the allocator, so a long request holds about W / block_size blocks.

The contract still holds with windows shorter than the sequences: engine == `generate` alone
(greedy and seeded), every block free at the end, with chunked prefill, preemption, n samples and
prefix caching (a prefix hit after the blocks were given back, and after they were reused by
others, still equals `generate`). A hybrid model's global layers read every block, so it gives
none back.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_serving_engine import tiny_model

from cs336_inference import ModelConfig, TransformerLM, generate
from cs336_inference.serving import LLMEngine, SamplingParams
from cs336_inference.serving.block_manager import BlockManager, BlockTable


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(61) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_release_before_gives_back_whole_blocks_once():
    bm = BlockManager(8, 4)
    table = BlockTable()
    bm.prepare_write(table, 0, 14, lambda a, b: None)  # 4 blocks for steps 0..13
    assert bm.num_free == 4
    assert bm.release_before(table, 7) == 1, "steps 0..3 are all before 7: one block"
    assert bm.release_before(table, 7) == 0, "given back once"
    assert bm.release_before(table, 12) == 2 and table.dropped == 3 and bm.num_free == 7
    child = bm.fork(table)
    assert bm.ref_count(table.blocks[3]) == 2 and child.dropped == 3, "a fork shares only the held blocks"
    bm.free(child)
    bm.free(table)
    assert bm.num_free == 8 and table.dropped == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sliding_requests_equal_generate_while_their_blocks_are_given_back(temperature):
    model = tiny_model("sliding")  # window 5, block size 4: most of each sequence leaves the window
    ps = prompts(6, 6, 30)
    params = [
        SamplingParams(max_new_tokens=40, temperature=temperature, seed=i, stop_token_ids=())
        for i in range(6)
    ]
    engine = LLMEngine(model, num_blocks=24, block_size=4, max_batch_tokens=8)
    got = engine.generate(ps, params)
    for i, (p, sp) in enumerate(zip(ps, params, strict=True)):
        assert got[i] == generate(model, p, params=sp).tolist(), f"request {i} at temperature {temperature}"
    stats = engine.stats()
    assert stats["window_released_blocks"] > 40 and stats["free_blocks"] == 24, stats


def test_one_long_request_holds_a_window_of_blocks():
    """A Mistral-style model (every layer slides over 64 steps), one 2,000-token request, blocks of
    16: given back, it holds at most (64 - 1 + 32) / 16 + 1 blocks at once; kept, all 125."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=2048, sliding_window=64)  # fmt: skip
    model = TransformerLM(cfg).eval().double()
    prompt = prompts(1, 1000, 1000, seed=3)[0]
    params = SamplingParams(max_new_tokens=1000, stop_token_ids=())
    peaks = {}
    for release in (True, False):
        engine = LLMEngine(
            model, num_blocks=128, block_size=16, max_batch_tokens=32, release_window_blocks=release
        )
        out = engine.generate([prompt], params)[0]
        peaks[release] = engine.stats()["peak_used_blocks"]
        assert engine.stats()["free_blocks"] == 128
    assert peaks[True] <= -(-(64 - 1 + 32) // 16) + 1, f"held {peaks[True]} blocks with the window"
    assert peaks[False] == 125, peaks
    assert out == generate(model, prompt, params=params).tolist()[: len(out)]
    small = LLMEngine(model, num_blocks=8, block_size=16, max_batch_tokens=32)
    assert small.generate([prompt], params)[0] == out, "8 blocks (128 slots) serve a 2,000-token request"


def test_preemption_and_samples_with_a_window():
    model = tiny_model("sliding")
    ps = prompts(5, 10, 25, seed=4)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=9, n=2, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=9, block_size=4, max_batch_tokens=16)
    runs = engine.run(ps, params)
    assert engine.stats()["preemptions"] > 0, "the budget was meant to force preemption"
    for i, (p, samples) in enumerate(zip(ps, runs, strict=True)):
        for s in samples:
            want = generate(model, p, params=SamplingParams(**{**params.__dict__, "seed": 9 + s.index}))
            assert s.new_token_ids == want.tolist(), f"request {i}, sample {s.index}"
    assert engine.stats()["free_blocks"] == 9


def test_prefix_hits_after_the_blocks_left_the_window_and_were_reused():
    """Request A gives back its prompt's first blocks (still cached); B with the same prompt hits
    them; then other requests reuse those blocks, and C with the same prompt must not get their
    contents: every output equals generate."""
    model = tiny_model("sliding")
    prompt = prompts(1, 28, 28, seed=5)[0]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=14, block_size=4, max_batch_tokens=8)
    want = generate(model, prompt, params=params).tolist()
    assert engine.generate([prompt], params)[0] == want
    hits = engine.stats()["prefix_hits"]
    assert engine.generate([prompt], params)[0] == want
    assert engine.stats()["prefix_hits"] > hits, "the second request should hit the cached prefix"
    others = prompts(3, 20, 28, seed=6)
    engine.generate(others, params)  # allocates (and evicts) the cached blocks
    assert engine.generate([prompt], params)[0] == want
    assert engine.stats()["free_blocks"] == 14


def test_a_hybrid_gives_back_nothing_and_still_equals_generate():
    model = tiny_model("hybrid")
    ps = prompts(4, 10, 30, seed=7)
    params = SamplingParams(max_new_tokens=25, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_tokens=8)
    assert engine.window is None
    got = engine.generate(ps, params)
    for i, p in enumerate(ps):
        assert got[i] == generate(model, p, params=params).tolist(), f"request {i}"
    assert engine.stats()["window_released_blocks"] == 0

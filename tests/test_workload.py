"""The serving benchmark's workload and its two systems (static batching, the engine) on a tiny model."""

import numpy as np
import pytest
import torch

from cs336_inference.bench import serving as workload
from cs336_inference.config import ModelConfig
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import generate


def test_workload_is_seeded_and_only_the_rate_changes_arrivals():
    a = workload.make_workload(200, 2.0, 1000, seed=3, max_prompt=64, max_output=32, system_prompt_len=8)
    b = workload.make_workload(200, 8.0, 1000, seed=3, max_prompt=64, max_output=32, system_prompt_len=8)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.max_new_tokens for r in a] == [r.max_new_tokens for r in b]
    np.testing.assert_allclose([4 * r.arrival for r in b], [r.arrival for r in a])
    gaps = np.diff([0.0] + [r.arrival for r in a])
    assert (gaps >= 0).all() and 0.35 < gaps.mean() < 0.65, f"mean gap {gaps.mean()} at 2 req/s"
    own = [len(r.prompt_ids) - 8 * r.shared_prefix for r in a]
    assert 4 <= min(own) and max(own) <= 64 and all(2 <= r.max_new_tokens <= 32 for r in a)
    assert np.mean(own) > np.median(own), "lengths should be right-skewed"
    shared = [r for r in a if r.shared_prefix]
    assert 60 < len(shared) < 140 and len({tuple(r.prompt_ids[:8]) for r in shared}) == 1
    assert all(100 <= t < 1000 for r in a for t in r.prompt_ids)
    with pytest.raises(ValueError):
        workload.make_workload(10, 0.0, 1000)


def test_static_and_continuous_serve_every_request_like_generate_alone():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=256
    )
    model = TransformerLM(cfg).eval()
    reqs = workload.make_workload(12, 50.0, 256, seed=1, max_prompt=24, max_output=16, system_prompt_len=16)
    static = workload.run_static(model, reqs, batch_size=4)
    engine = workload.run_engine(
        model, reqs, num_blocks=32, block_size=8, max_batch_seqs=4, max_batch_tokens=64
    )
    for i, r in enumerate(reqs):
        alone = generate(model, r.prompt_ids, r.max_new_tokens, stop_token_ids=[]).tolist()
        assert static.tokens[i] == alone, f"static batching, request {i}"
        assert engine.tokens[i] == alone, f"engine, request {i}"
        for t in (static, engine):
            assert r.arrival <= t.first[i] <= t.last[i]
    s, e = workload.summarize_trace(reqs, static), workload.summarize_trace(reqs, engine)
    assert s["output_tokens"] == e["output_tokens"] == sum(r.max_new_tokens for r in reqs)
    assert e["kv_waste"] < s["kv_waste"], f"paged waste {e['kv_waste']:.2f} vs static {s['kv_waste']:.2f}"
    assert engine.extra["prefix_hits"] > 0, "the shared system prompt should hit the prefix cache"

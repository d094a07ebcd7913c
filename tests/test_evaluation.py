"""Evaluation: sliding-window perplexity, KL and agreement against direct computations with torch's own
cross_entropy / kl_div on tiny models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.evaluation import (
    default_calibration_text,
    default_eval_text,
    greedy_agreement,
    greedy_references,
    perplexity,
    score_text,
    weight_count,
    windows,
)
from cs336_inference.quantization import quantize_model

TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)


def tiny(seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(**TINY)).eval()


def text_ids(n: int = 100, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "n, window, stride", [(100, 32, 16), (100, 32, 31), (33, 32, 8), (10, 32, 16), (97, 20, 7)]
)
def test_windows_score_every_target_once_with_enough_context(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert end - begin <= window and first > begin
        if begin > 0:
            assert first - begin >= window - stride, "each target sees at least window - stride tokens"
        scored += range(first, end)
    assert scored == list(range(1, n))


def test_perplexity_of_one_window_is_exp_cross_entropy():
    model, ids = tiny(), text_ids(40)
    with torch.no_grad():
        ce = F.cross_entropy(model(ids[None, :-1])[0], ids[1:])
    assert perplexity(model, ids, window=64, stride=32) == pytest.approx(math.exp(ce.item()), rel=1e-5)


def test_sliding_perplexity_matches_a_direct_loop():
    model, ids = tiny(1), text_ids(100, seed=1)
    nll, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, 100, 16):  # window 32, stride 16: score the targets after position begin + 15
            end = min(begin + 32, 100)
            logp = model(ids[None, begin:end])[0].log_softmax(-1)
            lo = 1 if begin == 0 else begin + 16
            for t in range(lo, end):
                nll -= logp[t - 1 - begin, ids[t]].item()
                count += 1
            if end == 100:
                break
    assert count == 99
    assert perplexity(model, ids, window=32, stride=16) == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_kl_and_agreement_against_torch():
    a, ids = tiny(2), text_ids(30, seed=2)
    b = quantize_model(a, "q4_0")
    scores = score_text({"a": a, "b": b, "same": a}, ids, reference="a", window=64, stride=32)
    with torch.no_grad():
        pa, pb = a(ids[None, :-1])[0].log_softmax(-1), b(ids[None, :-1])[0].log_softmax(-1)
    kl = F.kl_div(pb, pa, log_target=True, reduction="batchmean").item()
    assert scores["b"]["kl"] == pytest.approx(kl, rel=1e-4) and kl > 0
    assert scores["b"]["top1_agreement"] == pytest.approx(
        (pa.argmax(-1) == pb.argmax(-1)).float().mean().item()
    )
    assert scores["same"]["kl"] == 0 and scores["same"]["top1_agreement"] == 1
    assert "kl" not in scores["a"] and scores["a"]["n_targets"] == 29


def test_greedy_agreement_with_itself_is_total():
    model = tiny(3)
    prompts = [[1, 2, 3], [5, 6]]
    refs = greedy_references(model, prompts, max_new_tokens=8)
    assert [len(r) for r in refs] == [11, 10]
    assert greedy_agreement(model, refs, [3, 2]) == {"greedy_agreement": 1.0, "greedy_prefix": 8}
    other = greedy_agreement(tiny(4), refs, [3, 2])
    assert other["greedy_agreement"] < 1.0


def test_weight_count_is_the_float_models():
    model = tiny()
    assert weight_count(model) == model.num_parameters()
    assert weight_count(quantize_model(model, "int4")) == model.num_parameters()


def test_default_texts():
    text, calibration = default_eval_text(), default_calibration_text()
    assert 'The "assert" statement' in text and len(text) > 100_000
    assert len(calibration) > 50_000
    assert calibration[1000:1200] not in text, "calibration text must not be the evaluation text"


def test_bad_windows():
    for stride in (32, 16, 0):
        with pytest.raises(ValueError, match="stride < window"):
            windows(100, 16, stride)
    with pytest.raises(ValueError, match="nothing to predict"):
        windows(1, 16, 8)

"""Log-probabilities and n samples in the library and the serving engine.

sampled_logprobs is checked against transformers' own logits warpers; the engine's log-probabilities
against `generate` alone (the same distribution, the same tokens) and against a plain full forward
(prompt log-probabilities); n > 1 samples against `generate` with seed + i, with one prefill.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_serving_engine import tiny_model

from cs336_inference import generate
from cs336_inference.sampling import SamplingParams, sampled_logprobs, token_logprobs
from cs336_inference.serving import LLMEngine

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.6),
]


def prompts(n: int, seed: int = 0, vocab: int = 61) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 11))] for _ in range(n)]


# ------------------------------------------------------------------ the distribution
@pytest.mark.parametrize("settings", SETTINGS[1:], ids=str)
def test_sampled_logprobs_match_transformers_warpers(settings):
    """exp(sampled_logprobs) is the distribution transformers' temperature / top-k / top-p warpers
    (applied in the same order) leave to sample from."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    ids = torch.zeros(6, 1, dtype=torch.long)
    ref = TemperatureLogitsWarper(settings["temperature"])(ids, logits.clone())
    if settings.get("top_k"):
        ref = TopKLogitsWarper(settings["top_k"])(ids, ref)
    if settings.get("top_p"):
        ref = TopPLogitsWarper(settings["top_p"])(ids, ref)
    ours = sampled_logprobs(logits, settings["temperature"], settings.get("top_k"), settings.get("top_p"))
    torch.testing.assert_close(ours.exp(), ref.softmax(-1), atol=1e-6, rtol=1e-5, msg=f"{settings}")
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), f"{settings}: a different set of tokens kept"


def test_greedy_reports_the_models_own_distribution():
    logits = torch.randn(3, 50)
    torch.testing.assert_close(sampled_logprobs(logits, 0.0, top_k=2, top_p=0.1), logits.log_softmax(-1))


def test_token_logprobs_lists_alternatives_most_likely_first_without_filtered_ones():
    lp = torch.tensor([[0.0, -1.0, float("-inf"), -0.5], [-3.0, -2.0, -2.0, -1.0]])
    got = token_logprobs(lp, torch.tensor([2, 0]), num_top=3)
    assert got[0].token_id == 2 and got[0].logprob == float("-inf")
    assert got[0].top == [(0, 0.0), (3, -0.5), (1, -1.0)], got[0].top
    assert got[1].top == [(3, -1.0), (1, -2.0), (2, -2.0)], f"equal values: lower id first, got {got[1].top}"
    short = token_logprobs(torch.tensor([[0.0, float("-inf"), float("-inf")]]), torch.tensor([0]), 3)[0]
    assert short.top == [(0, 0.0)], f"-inf alternatives are left out, got {short.top}"


@pytest.mark.parametrize("bad", [dict(logprobs=-1), dict(logprobs=21), dict(prompt_logprobs=True), dict(n=0)])
def test_out_of_range_settings_are_one_line_errors(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad).validate()


# ------------------------------------------------------------------ the engine against generate
@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_engine_logprobs_equal_generate_alone(settings):
    """Each request's tokens and log-probabilities (chosen token and top 4) in a busy engine equal
    `generate` on its prompt alone with the same SamplingParams."""
    model = tiny_model("gqa")
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_tokens=16)
    ps = prompts(5)
    params = [
        SamplingParams(max_new_tokens=9, seed=i, logprobs=4, stop_token_ids=(), **settings) for i in range(5)
    ]
    runs = engine.run(ps, params)
    for i, (p, sp, run) in enumerate(zip(ps, params, runs, strict=True)):
        tokens, expected = generate(model, p, params=sp, return_logprobs=True)
        assert run[0].new_token_ids == tokens.tolist(), f"request {i} {settings}: tokens differ"
        assert len(run[0].logprobs) == len(expected) == 9
        for t, (got, want) in enumerate(zip(run[0].logprobs, expected, strict=True)):
            where = f"request {i}, token {t}, {settings}"
            assert got.token_id == want.token_id, where
            assert got.logprob == pytest.approx(want.logprob, abs=1e-6), where
            assert [a for a, _ in got.top] == [a for a, _ in want.top], f"{where}: top alternatives"
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-6), where
            if settings["temperature"] == 0.0:
                assert got.top[0][0] == got.token_id, f"{where}: greedy picks the most likely token"


@pytest.mark.parametrize("variant", ["gqa", "sliding", "mla"])
def test_prompt_logprobs_equal_a_full_forward(variant):
    """Prompt log-probabilities (echo): position i holds log-softmax(logits at i - 1)[token i] of one
    plain forward over the prompt, the first position None, whatever the chunking of the prefill,
    and also when a cached prefix of the same prompt is in the engine."""
    model = tiny_model(variant)
    prompt = prompts(1, seed=3)[0] * 4  # 12..44 tokens: several blocks, several chunks
    with torch.no_grad():
        full = model(torch.tensor([prompt]))[0].double().log_softmax(-1)
    for chunk in (5, 64):
        engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_tokens=chunk)
        engine.generate([prompt], SamplingParams(max_new_tokens=1))  # leaves the prompt's blocks cached
        run = engine.run([prompt], SamplingParams(max_new_tokens=2, prompt_logprobs=2))[0][0]
        got = run.prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None, f"{variant}, chunks of {chunk}"
        for i in range(1, len(prompt)):
            where = f"{variant}, chunks of {chunk}, prompt position {i}"
            assert got[i].token_id == prompt[i], where
            assert got[i].logprob == pytest.approx(float(full[i - 1, prompt[i]]), abs=1e-6), where
            top = torch.topk(full[i - 1], 2)
            assert [a for a, _ in got[i].top] == top.indices.tolist(), where
        assert engine.stats()["free_blocks"] == 64


# ------------------------------------------------------------------ n samples
def test_n_samples_share_one_prefill_and_each_equals_generate_with_its_seed():
    model = tiny_model("gqa")
    prompt = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]  # 6..22 tokens, a partly filled last block
    prompt = prompt[: 4 * (len(prompt) // 4) + 2]
    n, M = 4, 10
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_tokens=64)
    params = SamplingParams(max_new_tokens=M, temperature=1.0, seed=100, n=n, logprobs=1, stop_token_ids=())
    samples = engine.run([prompt], params)[0]
    assert [s.index for s in samples] == list(range(n))
    P = len(prompt)
    assert engine.stats()["computed_tokens"] == P + n * (M - 1), (
        f"n={n}: the prompt ({P} tokens) is prefilled once and each sample decodes M - 1 = {M - 1} "
        f"tokens; computed {engine.stats()['computed_tokens']} tokens"
    )
    assert engine.stats()["cow_copies"] == n - 1, (
        "the shared partial block is copied by all but the last writer"
    )
    for i, s in enumerate(samples):
        expected, lps = generate(
            model, prompt, params=SamplingParams(**{**params.__dict__, "seed": 100 + i}), return_logprobs=True
        )
        assert s.new_token_ids == expected.tolist(), f"sample {i} differs from generate(seed=100 + {i})"
        assert [e.logprob for e in s.logprobs] == pytest.approx([e.logprob for e in lps], abs=1e-6)
    assert len({tuple(s.new_token_ids) for s in samples}) > 1, "4 samples at temperature 1 all alike"
    assert engine.stats()["free_blocks"] == 64 and not engine.has_unfinished()


def test_n_samples_survive_preemption_and_aborting_one_sample():
    """A block budget too small for all samples at once: samples are preempted and recomputed and
    still equal generate with their seeds; aborting one sample leaves the others running."""
    model = tiny_model("gqa")
    prompt = prompts(1, seed=8)[0]
    params = SamplingParams(max_new_tokens=20, temperature=1.0, top_k=10, seed=7, n=3, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=12, block_size=4, max_batch_tokens=64)
    samples = engine.run([prompt], params)[0]
    assert engine.stats()["preemptions"] > 0, "the budget was meant to force preemption"
    for i, s in enumerate(samples):
        expected = generate(model, prompt, params=SamplingParams(**{**params.__dict__, "seed": 7 + i}))
        assert s.new_token_ids == expected.tolist(), f"sample {i} after preemption"

    engine = LLMEngine(model, num_blocks=64, block_size=4)
    rid = engine.add_request(prompt, params)
    engine.step()  # prefill and fork: 3 samples running
    engine.abort(rid, index=1)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    aborted = [o for o in outs if o.index == 1]
    assert [(o.finished, o.finish_reason) for o in aborted] == [(True, "abort")]
    for i in (0, 2):
        assert sum(len(o.new_token_ids) for o in outs if o.index == i) == 19, f"sample {i} ran to the end"
    assert engine.stats()["free_blocks"] == 64


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["gqa", "sliding"])
def test_samples_logprobs_and_window_on_a_gpu(variant):
    """The engine on CUDA: n seeded samples from one prefill, log-probabilities, and (sliding) blocks
    given back as they leave the window; each sample equals generate on the GPU with its seed."""
    model = tiny_model(variant).cuda()
    prompt = prompts(1, seed=11)[0] * 3
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=21, n=3, logprobs=2, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=32, block_size=4, max_batch_tokens=8)
    samples = engine.run([prompt], params)[0]
    for s in samples:
        p = SamplingParams(**{**params.__dict__, "seed": 21 + s.index, "n": 1})
        tokens, lps = generate(model, prompt, params=p, return_logprobs=True)
        assert s.new_token_ids == tokens.tolist(), f"{variant}, sample {s.index}"
        assert [e.logprob for e in s.logprobs] == pytest.approx([e.logprob for e in lps], abs=1e-6)
    assert engine.stats()["free_blocks"] == 32
    if variant == "sliding":
        assert engine.stats()["window_released_blocks"] > 0

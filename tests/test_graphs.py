"""The fixed-shape decode step (fast/step/fixed.py) equals the cached forward; on CUDA, its graph too.

Independent property: `model(token, cache=cache)` (the eager step, attending over exactly the
written keys) against the fixed-shape step (attending over the whole preallocated cache with the
unwritten slots masked). On the CPU the fixed-shape step runs eagerly; the cuda-marked tests record
it as a CUDA graph and compare tokens and timing.
"""

from __future__ import annotations

import pytest
import torch

from cs336_inference.config import FULL, SLIDING, ModelConfig
from cs336_inference.fast.step.fixed import FixedStep, FixedSteps, graph_generate
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import generate

BASE = dict(vocab_size=64, d_model=32, n_layers=2, d_ff=64, max_seq_len=96, n_heads=4)
VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "cla": dict(n_kv_heads=2, n_layers=4, kv_share=2),
    # a window, held in a full static cache (window >= the cache length is not needed: masks apply)
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=5, n_layers=3, layer_types=[SLIDING, FULL, SLIDING]),
}


def tiny(variant: str, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**BASE, **VARIANTS[variant]}))
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # larger logits: greedy choices far from ties
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_fixed_shape_step_equals_the_cached_forward(variant):
    model = tiny(variant)
    with torch.inference_mode():
        _check_steps(model)


def _check_steps(model):
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    S = 40
    # sliding layers get a ring when window + spare < S; spare = S makes them static caches
    eager_cache, fixed_cache = model.new_cache(2, S, spare=S), model.new_cache(2, S, spare=S)
    model(prompt, cache=eager_cache)
    model(prompt, cache=fixed_cache)
    step = FixedStep(model, fixed_cache, "eager")
    token = torch.tensor([3, 5])
    for t in range(S - 7):
        expected = model(token[:, None], cache=eager_cache)[:, -1]
        got = step(token)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, t=t: f"step {t}: {m}")
        assert fixed_cache.pos == eager_cache.pos
        token = expected.argmax(-1)
    with pytest.raises(ValueError, match="KV cache full"):
        step(token)


def test_the_fixed_shape_step_keeps_left_padding():
    model = tiny("gqa")
    with torch.inference_mode():
        _check_padding(model)


def _check_padding(model):
    prompts = [torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([7, 8])]
    expected = generate(model, prompts, 12, stop_token_ids=[])
    pad = torch.tensor([0, 4])
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 8]])
    cache = model.new_cache(2, 6 + 12, pad=pad)
    token = model(ids, cache=cache)[:, -1].argmax(-1)
    step, out = FixedStep(model, cache, "eager"), [token]
    for _ in range(11):
        token = step(token).argmax(-1)
        out.append(token)
    got = torch.stack(out, 1)
    assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()


def test_ring_and_mla_caches_are_refused_in_one_line():
    ring = TransformerLM(ModelConfig(**{**BASE, "n_kv_heads": 2, "sliding_window": 5}))
    with pytest.raises(ValueError, match="layer 0 has a RingKVCache"):
        FixedStep(ring, ring.new_cache(1, 40))
    mla = TransformerLM(
        ModelConfig(**BASE, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    )
    with pytest.raises(ValueError, match="MLACache"):
        FixedStep(mla, mla.new_cache(1, 40))


def test_graph_generate_on_the_cpu_is_greedy_generate():
    model = tiny("gqa")
    prompt = torch.tensor([4, 9, 16, 25])
    expected = generate(model, prompt, 20, stop_token_ids=[])
    assert graph_generate(model, prompt, 20).tolist() == expected.tolist()
    with pytest.raises(ValueError, match="max_new_tokens"):
        graph_generate(model, prompt, 0)


def test_graph_generate_stops_where_generate_does():
    model = tiny("gqa")
    prompt = torch.tensor([4, 9, 16, 25])
    free = generate(model, prompt, 20, stop_token_ids=[]).tolist()
    stop = free[5]  # a token that comes: both stop at its first occurrence, and keep it
    expected = generate(model, prompt, 20, stop_token_ids=[stop])
    got = graph_generate(model, prompt, 20, stop_token_ids=[stop])
    assert got.tolist() == expected.tolist() and got[-1] == stop and len(got) <= 6


# ------------------------------------------------------------------ T tokens: a verify pass
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_fixed_shape_step_of_t_tokens_equals_the_cached_forward(variant):
    """T = 4 tokens per call (speculative decoding's verify pass): causal among the T new queries."""
    model = tiny(variant)
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    S, T = 40, 4
    with torch.inference_mode():
        eager_cache, fixed_cache = model.new_cache(2, S, spare=S), model.new_cache(2, S, spare=S)
        model(prompt, cache=eager_cache)
        model(prompt, cache=fixed_cache)
        step = FixedStep(model, fixed_cache, "eager", T=T)
        ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(2))
        for t in range((S - 7) // T):
            expected = model(ids, cache=eager_cache)
            got = step(ids)
            assert got.shape == (2, T, 64), f"{variant}: logits shape {tuple(got.shape)}"
            torch.testing.assert_close(
                got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, t=t: f"call {t}: {m}"
            )
            assert fixed_cache.pos == eager_cache.pos
            ids = expected.argmax(-1)
        with pytest.raises(ValueError, match="KV cache full"):
            step(ids)


@pytest.mark.parametrize("variant", ["mha", "gqa", "mqa", "cla"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_speculative_decoding_through_fixed_shape_steps_is_greedy_generate(variant, k):
    """steps runs the target's verify passes as one padded (k+1)-token step: same tokens, and the
    cache, rolled back and overwritten, holds exactly the accepted tokens at the end."""
    from cs336_inference.speculative import speculative_generate

    model = tiny(variant)
    base = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([base, base, base[:4]])  # repeats: prompt lookup proposes, and is often right
    expected = generate(model, prompt, 30, stop_token_ids=[])
    got, stats = speculative_generate(
        model, "ngram", prompt, 30, k=k, stop_token_ids=[], return_stats=True, steps=FixedSteps("eager")
    )
    assert got.tolist() == expected.tolist(), f"{variant} k={k}"
    assert stats.target_passes < 30 and stats.accepted > 0
    final = torch.cat([prompt, got])[None, :-1]
    cache = stats.caches["target"]
    assert cache.pos == final.shape[1]
    with torch.inference_mode():
        fresh = model.new_cache(1, cache.capacity)
        model(final, cache=fresh)
    for i, (a, b) in enumerate(zip(cache.layers, fresh.layers, strict=True)):
        if a is not None:
            n = final.shape[1]
            torch.testing.assert_close(
                a.k[:, :, :n], b.k[:, :, :n], msg=lambda m, i=i: f"layer {i} keys: {m}"
            )


def test_sampled_speculative_decoding_through_fixed_steps_draws_what_the_eager_target_draws():
    """At temperature 1 with top-p and a seed, the fixed-shape target consumes the same random draws
    on (to rounding) the same distributions as the model's own forward: the same tokens."""
    from cs336_inference.speculative import speculative_generate

    model = tiny("gqa")
    base = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([base, base])
    settings = dict(k=3, temperature=1.0, top_p=0.9, seed=7, stop_token_ids=[])
    expected = speculative_generate(model, "ngram", prompt, 30, **settings)
    got = speculative_generate(model, "ngram", prompt, 30, steps=FixedSteps("eager"), **settings)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("mode", ["compile", "native"])
def test_compiled_speculative_decoding_is_greedy_generate(mode):
    """The compiled (or native) 1- and (k+1)-token steps (CPU) give greedy generate's tokens."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.speculative import speculative_generate

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    model = tiny("gqa")
    base = torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(3))
    prompt = torch.cat([base, base, base[:4]])
    expected = generate(model, prompt, 30, stop_token_ids=[])
    got, stats = speculative_generate(
        model, "ngram", prompt, 30, k=3, stop_token_ids=[], return_stats=True, steps=FixedSteps(mode)
    )
    assert got.tolist() == expected.tolist() and stats.accepted > 0


def _target_and_perturbed_draft() -> tuple[TransformerLM, TransformerLM]:
    """The gqa tiny model and a copy with its embedding perturbed: a draft that agrees with the target
    often, not always."""
    target, draft = tiny("gqa"), tiny("gqa")
    with torch.no_grad():
        draft.embed.weight.add_(
            0.5 * torch.randn(draft.embed.weight.shape, generator=torch.Generator().manual_seed(1))
        )
    return target, draft


@pytest.mark.parametrize("mode", ["eager", "compile", "native"])
def test_a_model_draft_in_fixed_shape_steps_gives_greedy_generate(mode):
    """With steps, a TransformerLM draft runs fixed-shape steps of 1 and 2 tokens on its own cache:
    the target's greedy tokens, and the draft's cache holds the tokens it was fed (a fresh prefill's)."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.speculative import ModelDraft, speculative_generate

    if mode != "eager" and build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    target, draft = _target_and_perturbed_draft()
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(5))
    expected = generate(target, prompt, 24, stop_token_ids=[])
    for k in (1, 3):
        drafter = ModelDraft(draft, FixedSteps(mode)) if k == 3 else draft  # a bare model takes steps too
        got, stats = speculative_generate(
            target, drafter, prompt, 24, k=k, stop_token_ids=[], return_stats=True, steps=FixedSteps(mode)
        )
        assert got.tolist() == expected.tolist(), f"{mode} k={k}"
        assert stats.accepted > 0 and stats.rejected > 0, (
            f"{mode} k={k}: {stats.accepted} accepted, {stats.rejected} rejected"
        )
    cache, fed = stats.caches["draft"], drafter.fed
    assert cache.pos == len(fed) and fed[: len(prompt)].tolist() == prompt.tolist()
    with torch.inference_mode():
        fresh = draft.new_cache(1, cache.capacity)
        draft(fed[None], cache=fresh)
    for i, (a, b) in enumerate(zip(cache.layers, fresh.layers, strict=True)):
        if a is not None:
            torch.testing.assert_close(
                a.k[:, :, : cache.pos], b.k[:, :, : cache.pos], msg=lambda m, i=i: f"{mode} layer {i}: {m}"
            )


@pytest.mark.parametrize("mode", ["eager", "compile", "native"])
def test_a_draft_sharing_the_targets_cache_in_fixed_shape_steps_gives_greedy_generate(mode):
    """share_cache with steps: the draft runs one-token fixed-shape steps on the target's cache
    (no cache of its own): the target's greedy tokens; the target itself as the draft never misses."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.speculative import ModelDraft, speculative_generate

    if mode != "eager" and build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    target, draft = _target_and_perturbed_draft()
    prompt = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(5))
    expected = generate(target, prompt, 24, stop_token_ids=[])
    for name, model in (("perturbed", draft), ("target", target)):
        got, stats = speculative_generate(
            target, ModelDraft(model, FixedSteps(mode), share_cache=True), prompt, 24, k=3, stop_token_ids=[],
            return_stats=True, steps=FixedSteps(mode),
        )  # fmt: skip
        assert got.tolist() == expected.tolist(), f"{mode}, {name} draft"
        assert stats.caches["draft"] is stats.caches["target"]
    assert stats.rejected == 0, f"{mode}: the target as its own draft had {stats.rejected} rejections"


@pytest.mark.parametrize("mode", ["eager", "native"])
def test_lookup_then_a_shared_cache_draft_in_fixed_shape_steps_gives_greedy_generate(mode):
    """ModelDraft(share_cache=True, lookup=True) on a prompt with repeats: rounds of copies (of any
    length up to k: a native target runs a step of exactly the drafts it got) and rounds of the
    model's drafts, the target's greedy tokens."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.speculative import ModelDraft, speculative_generate

    if mode != "eager" and build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    target, draft = _target_and_perturbed_draft()
    motif = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(7))
    prompt = torch.cat([torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(5)), motif, motif])
    expected = generate(target, prompt, 24, stop_token_ids=[])
    drafter = ModelDraft(draft, FixedSteps(mode), share_cache=True, lookup=True)
    got, stats = speculative_generate(
        target, drafter, prompt, 24, k=4, stop_token_ids=[], return_stats=True, steps=FixedSteps(mode)
    )
    assert got.tolist() == expected.tolist(), f"{mode}: lookup, then the shared-cache draft"
    assert stats.accepted > 0 and stats.rejected > 0, (
        f"{mode}: {stats.accepted} accepted, {stats.rejected} rejected"
    )


def test_speculative_fixed_steps_hold_sliding_layers_in_static_caches():
    """A sliding model's fixed-shape steps get a static cache in every layer (speculative.steps_cache:
    no ring, the window is the mask's), so speculative decoding through them is greedy generate."""
    from cs336_inference.speculative import speculative_generate

    sliding = tiny("sliding")
    prompt = torch.tensor([1, 2, 3, 1, 2, 3, 4])
    expected = generate(sliding, prompt, 20, stop_token_ids=[])
    for draft in ("ngram", sliding):
        got = speculative_generate(
            sliding, draft, prompt, 20, k=2, stop_token_ids=[], steps=FixedSteps("eager")
        )
        assert got.tolist() == expected.tolist(), f"draft {draft if isinstance(draft, str) else 'model'}"


# ------------------------------------------------------------------ GPU
def smollm2_shaped(dtype=torch.bfloat16) -> TransformerLM:
    """SmolLM2-135M's shapes with random weights (timing does not depend on the values)."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
        max_seq_len=2048, tie_embeddings=True, rope_theta=100000.0,
    )  # fmt: skip
    model = TransformerLM(cfg).to("cuda", dtype).eval()
    with torch.no_grad():
        model.norm.weight.mul_(8.0)
    return model


@pytest.mark.cuda
def test_cuda_graph_tokens_equal_eager_generate():
    model = smollm2_shaped(torch.float32)
    prompt = torch.randint(0, 49152, (32,), generator=torch.Generator().manual_seed(0))
    expected = generate(model, prompt, 48, stop_token_ids=[])
    got = graph_generate(model, prompt, 48)
    assert got.tolist() == expected.tolist()


@pytest.mark.cuda
def test_cuda_graph_step_is_at_least_3x_faster_than_the_eager_step():
    """SmolLM2's eager step is launch-bound on a GPU; the recorded graph removes the launches."""
    from cs336_inference.bench.timing import median_seconds

    model = smollm2_shaped()
    prompt = torch.randint(0, 49152, (1, 64), device="cuda")
    with torch.inference_mode():
        eager_cache, graph_cache = model.new_cache(1, 512), model.new_cache(1, 512)
        model(prompt, cache=eager_cache)
        model(prompt, cache=graph_cache)
        token = torch.tensor([1], device="cuda")
        step = FixedStep(model, graph_cache)

        def eager():
            model(token[:, None], cache=eager_cache)
            eager_cache.truncate(64)

        def graph():
            step(token)
            graph_cache.pos = 64

        t_eager = median_seconds(eager, 20, device="cuda")
        t_graph = median_seconds(graph, 20, device="cuda")
    assert t_graph * 3 < t_eager, f"graph step {t_graph * 1e3:.3f} ms vs eager {t_eager * 1e3:.3f} ms"


def test_a_bf16_quantized_model_decodes_in_the_fixed_shape_step():
    """The cache of a quantized bf16 model is bf16 (its activations' dtype, not the float32 that its
    quantized table reports): index_copy_ would refuse the new keys otherwise."""
    from cs336_inference.quantization import quantize_model

    model = quantize_model(tiny("gqa").to(torch.bfloat16), "int8", quantize_head=True)
    prompt = torch.tensor([4, 9, 16, 25])
    expected = generate(model, prompt, 12, stop_token_ids=[])
    assert model.new_cache(1, 8).layers[0].k.dtype == torch.bfloat16
    assert graph_generate(model, prompt, 12).tolist() == expected.tolist()


@pytest.mark.parametrize("fmt", ["fp32", "int8", "q4_0", "llm_int8"])
def test_the_compiled_cpu_step_equals_the_cached_forward(fmt):
    """torch.compile of the fixed-shape step (one graph; the C kernels as opaque custom ops) against
    the eager cached forward: logits to float32 rounding (the compiler fuses and reorders the small
    ops), then the same greedy tokens."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.quantization import quantize_model

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    model = tiny("gqa")
    model = model if fmt == "fp32" else quantize_model(model, fmt, quantize_head=True)
    prompt = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        eager_cache, fixed_cache = model.new_cache(1, 24), model.new_cache(1, 24)
        token = model(prompt, cache=eager_cache)[:, -1].argmax(-1)
        model(prompt, cache=fixed_cache)
        step = FixedStep(model, fixed_cache, "compile")
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for t in range(18):
            expected = model(token[:, None], cache=eager_cache)[:, -1]
            got = step(token)
            torch.testing.assert_close(
                got, expected, rtol=1e-4, atol=1e-4, msg=lambda m, t=t: f"{fmt} step {t}: {m}"
            )
            token = expected.argmax(-1)
            assert got.argmax(-1).tolist() == token.tolist(), f"{fmt} step {t}: greedy token differs"
    # one graph for the 18 steps, eager calls in between (the stacked products' state must not
    # leave a guard failing: a recompile costs minutes on SmolLM2)
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
    assert compiled == 1, f"{fmt}: {compiled} graphs compiled for one fixed-shape step, expected 1"


def test_modes_are_checked_in_one_line():
    model = tiny("gqa")
    with pytest.raises(ValueError, match="mode must be one of"):
        FixedStep(model, model.new_cache(1, 8), "fast")
    with pytest.raises(ValueError, match="runs on CUDA"):
        FixedStep(model, model.new_cache(1, 8), "graph")


# ------------------------------------------------------------------ the native step (step.c)
NATIVE_VARIANTS = {
    **{v: c for v, c in VARIANTS.items() if v != "cla"},
    "qkv_bias": dict(n_kv_heads=2, qkv_bias=True),
    # heads of 64 and 128 (step.c's attention has compile-time shapes for them), three query heads a
    # K/V head as SmolLM2's, and a window whose start differs between the rows of one pass
    "h64": dict(d_model=192, n_heads=3, n_kv_heads=1),
    "h64_sliding": dict(d_model=192, n_heads=3, n_kv_heads=1, sliding_window=5),
    "h128": dict(d_model=256, n_heads=2, n_kv_heads=1),
}


def _native_model(variant: str, fmt: str = "fp32", seed: int = 0) -> TransformerLM:
    from cs336_inference.fast.cpu import build
    from cs336_inference.quantization import quantize_model

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    torch.manual_seed(seed)
    wide = dict(d_model=64, d_ff=128) if fmt != "fp32" else {}  # whole 32-blocks and int4 groups
    model = TransformerLM(ModelConfig(**{**BASE, **NATIVE_VARIANTS[variant], **wide})).eval()
    with torch.no_grad():
        model.norm.weight.mul_(4.0)
        if model.config.qkv_bias:
            for block in model.layers:
                for layer in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                    layer.bias.normal_()
    return model if fmt == "fp32" else quantize_model(model, fmt, quantize_head=True)


def test_the_native_step_profile_splits_a_pass_into_its_phases():
    """graphs.native_profile: every phase timed (products, attention, SiLU...), the layers' phases
    inside the whole pass, and nothing recorded while profiling is off."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.fast.step import native as native_step
    from cs336_inference.fast.step.fixed import native_profile

    model = _native_model("gqa")
    ms = native_profile(model, T=3, rounds=3, prompt_len=7)
    assert set(ms) == {*native_step.PHASES, "layers", "pass", "rest"}
    assert all(ms[name] >= 0 for name in native_step.PHASES), ms
    assert all(ms[name] > 0 for name in ("qkv", "o", "gateup", "down", "attend")), ms
    assert 0 < ms["layers"] < 2 * ms["pass"], ms  # medians of separate lists: the sum may pass the whole
    lib, before, after = (
        build.library(),
        torch.zeros(9, dtype=torch.float64),
        torch.zeros(9, dtype=torch.float64),
    )
    lib.cs336_step_profile(0, before.data_ptr())
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        FixedStep(model, cache, "native", T=2)(torch.zeros(1, 2, dtype=torch.long))
    lib.cs336_step_profile(0, after.data_ptr())
    assert torch.equal(before, after), "cs336_layers recorded phases with profiling off"


def _native_pair(model, T: int, S: int, label: str):
    """(eager cache, fixed cache, native T-token step, first ids): two caches of 2 rows holding the
    same 7-token prompt, one for the model's cached forward and one for the native step."""
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    eager_cache, fixed_cache = model.new_cache(2, S, spare=S), model.new_cache(2, S, spare=S)
    model(prompt, cache=eager_cache)
    model(prompt, cache=fixed_cache)
    step = FixedStep(model, fixed_cache, "native", T=T)
    assert step.step.native is not None, f"{label}: the native layers were not made"
    return (
        eager_cache,
        fixed_cache,
        step,
        torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(2)),
    )


def _check_native_steps(model, T: int, label: str, tol: float = 1e-4, steps: int | None = None):
    """The native T-token step against the cached forward (2 rows), to float32 rounding (its sums
    and softmax add up in another order than torch's)."""
    S = 40
    with torch.inference_mode():
        eager_cache, fixed_cache, step, ids = _native_pair(model, T, S, label)
        for t in range(steps or (S - 7) // T):
            expected = model(ids, cache=eager_cache)
            got = step(ids).reshape(expected.shape)
            torch.testing.assert_close(
                got, expected, rtol=tol, atol=tol, msg=lambda m, t=t: f"{label} call {t}: {m}"
            )
            assert fixed_cache.pos == eager_cache.pos
            ids = expected[:, -T:].argmax(-1).reshape(2, T)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("variant", list(NATIVE_VARIANTS))
def test_the_native_step_equals_the_cached_forward(variant, T):
    """Every layer in one C call (fast/cpu/step.c) against the model's own cached forward: MHA / GQA /
    MQA, sliding-window and hybrid layers in a static cache, Qwen2's q/k/v bias; 1 and 4 tokens."""
    _check_native_steps(_native_model(variant), T, f"{variant} T={T}")


@pytest.mark.parametrize("fmt", ["int8", "int4", "q8_0", "q4_0", "q4_1"])
def test_the_native_step_runs_every_kernel_format(fmt):
    _check_native_steps(_native_model("gqa", fmt), 3, fmt, tol=1e-4, steps=6)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("fmt", ["int4_a8", "q8_0_a8", "q4_0_a8"])
def test_the_native_step_runs_the_q8_0_activation_formats(fmt, T):
    """With x rounded to integers (quantization/a8.py) a product jumps where x / d_x crosses k + 1/2.
    The native step's norms and sums, added in another order than torch's, move x by ~1e-7 and now
    and then across such a point, and a cache written then carries the jump into every later call.
    So the two caches are made equal after each call, and at least half of the calls must match the
    cached forward to 1e-4 (measured: 7 to 11 of 11, 30 to 33 of 33); with float products in the
    native step instead (x not rounded) none does."""
    model = _native_model("gqa", fmt)
    S, close = 40, 0
    calls = (S - 7) // T
    with torch.inference_mode():
        eager_cache, fixed_cache, step, ids = _native_pair(model, T, S, fmt)
        for t in range(calls):
            expected = model(ids, cache=eager_cache)
            got = step(ids).reshape(expected.shape)
            worst = (got - expected).abs().max().item()
            assert worst < 1.0, f"{fmt} T={T} call {t}: logits {worst:.3g} apart, more than a rounding jump"
            close += worst < 1e-4
            for mine, theirs in zip(fixed_cache.layers, eager_cache.layers, strict=True):
                mine.k.copy_(theirs.k)
                mine.v.copy_(theirs.v)
            ids = expected[:, -T:].argmax(-1).reshape(2, T)
    assert 2 * close >= calls, f"{fmt} T={T}: {close} of {calls} calls match the cached forward to 1e-4"


@pytest.mark.parametrize("variant", ["gqa", "h64"])
def test_the_native_step_keeps_left_padding(variant):
    _check_padding_mode(_native_model(variant), "native")


def _check_padding_mode(model, mode):
    prompts = [torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([7, 8])]
    expected = generate(model, prompts, 12, stop_token_ids=[])
    pad = torch.tensor([0, 4])
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 7, 8]])
    with torch.inference_mode():
        cache = model.new_cache(2, 6 + 12, pad=pad)
        token = model(ids, cache=cache)[:, -1].argmax(-1)
        step, out = FixedStep(model, cache, mode), [token]
        for _ in range(11):
            token = step(token).argmax(-1)
            out.append(token)
    got = torch.stack(out, 1)
    for row in range(2):
        assert got[row].tolist() == expected[row].tolist(), (
            f"{mode}: left-padded row {row} decoded differently"
        )


@pytest.mark.parametrize("fmt", ["fp32", "int4", "int4-amx", "int8-amx"])
def test_a_native_verify_pass_gives_each_row_the_bits_of_one_token_steps(fmt, monkeypatch):
    """Speculative decoding's greedy identity needs a row's logits not to depend on T: a native
    4-token step equals 4 one-token steps bit for bit (also with the products on AMX tiles)."""
    from cs336_inference.fast.cpu import build

    if fmt.endswith("-amx"):
        monkeypatch.setenv("CS336_KERNELS_AMX", "1")
        build.reset()
        if build.library() is None or not build.amx_on:
            build.reset()
            pytest.skip("no AMX on this CPU or in this build")
        monkeypatch.undo()  # the library keeps AMX on until the next load
    try:
        model = _native_model("gqa", fmt.removesuffix("-amx"))
        _verify_pass_equals_single_steps(model, fmt)
    finally:
        if fmt.endswith("-amx"):
            build.reset()


@pytest.mark.parametrize("variant", ["h64", "h128"])
def test_a_native_verify_pass_of_wide_heads_gives_the_bits_of_one_token_steps(variant):
    """step.c attends a pass's queries side by side (every row's heads of one K/V head): a row's bits
    must still not depend on the other rows, at the head widths its attention is specialised for."""
    _verify_pass_equals_single_steps(_native_model(variant), variant)


def _verify_pass_equals_single_steps(model, fmt):
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[5, 9, 2, 11]])
    with torch.inference_mode():
        one, four = model.new_cache(1, 24), model.new_cache(1, 24)
        model(prompt, cache=one)
        model(prompt, cache=four)
        step1, step4 = FixedStep(model, one, "native"), FixedStep(model, four, "native", T=4)
        singles = torch.stack([step1(ids[:, t]).clone() for t in range(4)], 1)
        together = step4(ids)
    assert torch.equal(singles, together), f"{fmt}: max difference {(singles - together).abs().max():.3g}"


def _one_native_step(model):
    """(native step, eager cache, token, logits): a 7-token prompt in two caches, then one step of the
    token by the native step and by the cached forward."""
    prompt = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    token = torch.tensor([3])
    with torch.inference_mode():
        eager_cache, fixed_cache = model.new_cache(1, 24), model.new_cache(1, 24)
        model(prompt, cache=eager_cache)
        model(prompt, cache=fixed_cache)
        step = FixedStep(model, fixed_cache, "native")
        logits = step(token)
        model(token[:, None], cache=eager_cache)
    return step, eager_cache, token, logits


def test_the_native_step_follows_replaced_weights():
    """A weight replaced between steps (a stacked q/k/v member, and an unstacked down_proj), then a
    whole layer replaced, is read on the next native step, as the cached forward reads it."""
    model = _native_model("gqa")
    step, eager_cache, token, _ = _one_native_step(model)
    g = torch.Generator().manual_seed(9)
    attn, mlp = model.layers[0].attn, model.layers[1].mlp
    attn.k_proj.weight = torch.nn.Parameter(torch.randn(attn.k_proj.weight.shape, generator=g))
    mlp.down_proj.weight = torch.nn.Parameter(torch.randn(mlp.down_proj.weight.shape, generator=g))
    with torch.inference_mode():
        got = step(token)
        expected = model(token[:, None], cache=eager_cache)[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    from cs336_inference.layers import Linear  # a layer replaced by another module

    with torch.inference_mode():  # a step with the layouts settled (the eager call re-stores new weights)
        step(token), model(token[:, None], cache=eager_cache)
    model.layers[0].mlp.down_proj = Linear(*reversed(mlp.down_proj.weight.shape))
    with torch.inference_mode():
        got = step(token)  # first: before the eager forward re-stores the new layer's weight
        expected = model(token[:, None], cache=eager_cache)[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_the_native_step_follows_weights_updated_in_place():
    """The native step multiplies from panels, a second copy of each fp32 weight (fast/cpu/ops.panels):
    a weight updated in place (a stacked q/k/v member, an unstacked down_proj, the output matrix, as
    an optimizer step does) is packed again on the next step, as the cached forward reads it."""
    model = _native_model("gqa")
    step, eager_cache, token, before = _one_native_step(model)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for w in (
            model.layers[0].attn.q_proj.weight,
            model.layers[1].mlp.down_proj.weight,
            model.vocab_weight,
        ):
            w.add_(torch.randn(w.shape, generator=g) * 0.5)
    with torch.inference_mode():
        got = step(token)
        expected = model(token[:, None], cache=eager_cache)[:, -1]
    torch.testing.assert_close(
        got, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"after in-place updates: {m}"
    )
    assert (got - before).abs().max() > 0.1, "the updates did not change the logits: the test shows nothing"


def test_panels_are_made_only_where_the_memory_allows(monkeypatch, capsys):
    """The panels copy every fp32 weight: with less memory available than PANEL_MEMORY_SHARE needs,
    the native step keeps one copy (row-/column-major products, still equal to the cached forward),
    and says so once; the choice holds for every later step of the model; CS336_KERNELS_PANELS=1 / 0
    decide whatever the memory."""
    from cs336_inference.fast.cpu import ops

    model = _native_model("gqa")
    need = ops.fp32_weight_bytes(model)
    assert need == sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2), "tied weights count once"
    monkeypatch.delenv("CS336_KERNELS_PANELS", raising=False)
    monkeypatch.setattr(ops, "available_memory", lambda: int(need / ops.PANEL_MEMORY_SHARE) - 1)
    step, eager_cache, token, _ = _one_native_step(model)
    assert not step.step.native.panels and not step.step.output.panels, "panels made without the memory"
    with torch.inference_mode():
        got, expected = step(token), model(token[:, None], cache=eager_cache)[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(ops, "available_memory", lambda: 1 << 50)
    again, *_ = _one_native_step(model)
    assert not again.step.native.panels, "decided again for the same model: its products, and bits, switched"
    told = capsys.readouterr().err
    assert told.count("not copied into panels") == 1, f"told {told.count('not copied into panels')} times"
    other = _native_model("gqa", seed=1)  # panels that fit, then the memory they took is gone
    assert _one_native_step(other)[0].step.native.panels, "panels that fit refused"
    monkeypatch.setattr(ops, "available_memory", lambda: 0)
    assert _one_native_step(other)[0].step.output.panels, "a later step of the same model dropped its panels"
    monkeypatch.setattr(ops, "available_memory", lambda: int(need / ops.PANEL_MEMORY_SHARE))
    assert ops.panels_on(need), "panels that just fit refused"
    monkeypatch.setattr(ops, "available_memory", lambda: 0)
    monkeypatch.setenv("CS336_KERNELS_PANELS", "1")
    assert ops.panels_on(need), "CS336_KERNELS_PANELS=1 overruled"
    monkeypatch.setenv("CS336_KERNELS_PANELS", "0")
    monkeypatch.setattr(ops, "available_memory", lambda: 1 << 50)
    assert not ops.panels_on(need), "CS336_KERNELS_PANELS=0 overruled"


def test_the_native_step_refuses_what_it_cannot_run_in_one_line(monkeypatch):
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    cla = tiny("cla")
    with pytest.raises(ValueError, match="layer 1 borrows its K/V"):
        FixedStep(cla, cla.new_cache(1, 8), "native")
    model = tiny("gqa")
    monkeypatch.setenv("CS336_KERNELS_FUSE", "0")
    with pytest.raises(ValueError, match="CS336_KERNELS_FUSE=0"):
        FixedStep(model, model.new_cache(1, 8), "native")
    monkeypatch.delenv("CS336_KERNELS_FUSE")
    half = tiny("gqa").to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32 models on the CPU"):
        FixedStep(half, half.new_cache(1, 8), "native")
    monkeypatch.setattr(build, "library", lambda: None)
    with pytest.raises(ValueError, match="C kernels are not built"):
        FixedStep(model, model.new_cache(1, 8), "native")


@pytest.mark.parametrize("fmt", ["q8_0", "int8"])
def test_native_step_refuses_more_rows_than_its_kernels_hold(fmt):
    """The quantized kernels keep at most MAX_ROWS rows' sums on their stacks: a native step of more
    rows (a tree of 33 or more nodes) is a one-line ValueError, not a write past them."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.fast.cpu.ops import MAX_ROWS
    from cs336_inference.fast.step.fuse import fuse_siblings
    from cs336_inference.fast.step.native import NativeLayers
    from cs336_inference.quantization import quantize_model

    if build.library() is None:
        pytest.skip("the C kernels are not built here")
    model = quantize_model(tiny("gqa"), fmt)
    fuse_siblings(model)
    cache = model.new_cache(1, 64)
    layers = NativeLayers(model, cache)
    T, cfg = MAX_ROWS + 1, model.config
    x = torch.zeros(1, T, cfg.d_model)
    cos, sin = model.rope_cos[:T][None], model.rope_sin[:T][None]
    pad = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"up to {MAX_ROWS} rows"):
        layers(x, cos, sin, torch.arange(T), pad)
    out = layers(x[:, :MAX_ROWS], cos[:, :MAX_ROWS], sin[:, :MAX_ROWS], torch.arange(MAX_ROWS), pad)
    assert out.shape == (1, MAX_ROWS, cfg.d_model), f"{fmt}: {MAX_ROWS} rows gave {tuple(out.shape)}"


# ------------------------------------------------------------------ the native prefill
@pytest.mark.parametrize("fmt", ["fp32", "int8"])
@pytest.mark.parametrize(
    ("P", "rows", "start"), [(3, 4, 0), (4, 4, 0), (10, 4, 0), (9, 4, 5), (33, 32, 0), (40, None, 3)]
)
def test_a_native_prefill_gives_the_bits_of_one_token_steps(fmt, P, rows, start):
    """native_prefill (passes of `rows` tokens, the last one ending at the prompt's end and writing
    again what the pass before wrote; by default one pass of 40 with fp32 panels, two of 20 with int8)
    leaves every layer's K/V and the last logits bit for bit as
    feeding the P tokens one by one through native decode steps does; its features are the final
    norm's output of each position, as the model's own forward gives them."""
    from cs336_inference.fast.step.fixed import native_prefill

    model = _native_model("gqa", fmt)
    g = torch.Generator().manual_seed(P + (rows or 0) + start)
    head = torch.randint(0, 64, (1, start), generator=g)
    ids = torch.randint(0, 64, (1, P), generator=g)
    with torch.inference_mode():
        one, chunked = model.new_cache(1, 48), model.new_cache(1, 48)
        step = FixedStep(model, one, "native")
        for t in range(start):
            step(head[:, t])
        for t in range(P):
            single = step(ids[:, t]).clone()
        head_step = FixedStep(model, chunked, "native")
        for t in range(start):
            head_step(head[:, t])
        logits, h = native_prefill(model, chunked, ids, rows=rows)
        full = model.new_cache(1, 48)
        x = model(torch.cat([head, ids], 1), cache=full, return_hidden=True)[1][0, start:]
    case = f"{fmt}, P={P}, rows={rows}, from step {start}"
    assert chunked.pos == start + P, f"{case}: cache.pos {chunked.pos}, expected {start + P}"
    assert torch.equal(logits, single), f"{case}: last logits differ by {(logits - single).abs().max():.3g}"
    for i, (a, b) in enumerate(zip(one.layers, chunked.layers, strict=True)):
        n = start + P
        assert torch.equal(a.k[:, :, :n], b.k[:, :, :n]) and torch.equal(a.v[:, :, :n], b.v[:, :, :n]), (
            f"{case}: layer {i}'s K/V differ from one-token steps"
        )
    assert torch.allclose(h, x, atol=1e-4), f"{case}: features differ by {(h - x).abs().max():.3g}"


@pytest.mark.parametrize(("fmt", "P", "passes"), [("fp32", 40, 1), ("fp32", 90, 2), ("int8", 40, 2)])
def test_a_native_prefill_takes_as_few_passes_as_its_products_allow(fmt, P, passes, monkeypatch):
    """Each pass reads every weight again: with fp32 panels (any number of rows) a pass takes up to
    PANEL_PREFILL_ROWS tokens (64 here), with int8 (sums of MAX_ROWS rows on the stack) 32, the
    prompt split evenly."""
    from cs336_inference.fast.step import fixed

    model = _native_model("gqa", fmt)
    monkeypatch.setattr(fixed, "PANEL_PREFILL_ROWS", 64)  # (the tiny model's context is 96)
    ran = []
    real = fixed.StaticDecodeStep.forward
    monkeypatch.setattr(
        fixed.StaticDecodeStep, "forward", lambda self, **kw: ran.append(self.T) or real(self, **kw)
    )
    ids = torch.randint(0, 64, (1, P), generator=torch.Generator().manual_seed(P))
    fixed.native_prefill(model, model.new_cache(1, P), ids)
    assert len(ran) == passes, f"{fmt}, {P} tokens: {len(ran)} passes of {ran}, expected {passes}"
    assert max(ran) - min(ran) <= 1 and sum(ran) == P, f"{fmt}, {P} tokens: passes of {ran} are not even"


def test_a_native_prefill_refuses_a_prompt_past_the_cache_in_one_line():
    from cs336_inference.fast.step.fixed import native_prefill

    model = _native_model("gqa")
    with pytest.raises(ValueError, match="does not fit a cache of 8"):
        native_prefill(model, model.new_cache(1, 8), torch.zeros(1, 9, dtype=torch.long))


def test_graph_generate_native_is_greedy_generate_from_a_long_prompt():
    """A prompt longer than a native prefill pass (40 > 32 tokens) decodes as generate does."""
    model = _native_model("gqa")
    prompt = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3))
    expected = generate(model, prompt, 20, stop_token_ids=[])
    assert graph_generate(model, prompt, 20, "native").tolist() == expected.tolist()


@pytest.mark.parametrize("slice_size", [256, 4], ids=["nuclei in the slice", "nuclei wider than the slice"])
def test_step_stream_samples_what_generate_samples_without_sorting_rows(slice_size, monkeypatch):
    """The fast decode loop draws its sampled tokens through nucleus.draw_seeded: with a seed, the
    tokens of `generate` (which sorts every row for top-p), and no row sorted by top_p_filter. A slice
    of 4 tokens sends most nuclei down the wider path."""
    from cs336_inference import nucleus, sampling
    from cs336_inference.fast.step.fixed import step_stream

    monkeypatch.setattr(nucleus, "NUCLEUS_SLICE", slice_size)
    sorts = []
    real = sampling.top_p_filter
    monkeypatch.setattr(sampling, "top_p_filter", lambda x, p: sorts.append(1) or real(x, p))
    model = tiny("gqa")
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(4))
    for settings in (
        dict(temperature=1.0, top_p=0.9, seed=1),
        dict(temperature=0.7, top_p=0.5, seed=2),
        dict(temperature=1.5, top_k=10, top_p=0.99, seed=3),
        dict(temperature=1.0, seed=4),
    ):
        sorts.clear()
        got = list(step_stream(model, prompt, 20, "eager", stop_token_ids=[], **settings))
        assert not sorts, f"{settings}: the fast loop sorted {len(sorts)} rows for top-p"
        expected = generate(model, prompt, 20, stop_token_ids=[], **settings)
        assert sorts or "top_p" not in settings, "generate should sort its rows (else this checks nothing)"
        assert got == expected.tolist(), f"{settings}: step_stream drew {got}, generate {expected.tolist()}"


def test_prepare_native_leaves_nothing_for_the_first_prefill_to_pack(monkeypatch):
    """generate.py calls prepare_native before its clock starts: the weights' panels, the output
    matrix's included, are made there, and the first prefill and decode step pack none."""
    from cs336_inference.fast.cpu import build, ops
    from cs336_inference.fast.step.fixed import native_prefill, prepare_native, step_stream

    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
    model = tiny("gqa")
    packed = []
    real = ops.pack_panels
    monkeypatch.setattr(ops, "pack_panels", lambda w: packed.append(tuple(w.shape)) or real(w))
    prepare_native(model)
    assert packed, "prepare_native packed no panels (else this checks nothing)"
    packed.clear()
    prompt = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(5))
    native_prefill(model, model.new_cache(1, 16), prompt[None])
    assert (
        list(step_stream(model, prompt, 3, "native", stop_token_ids=[]))
        == generate(model, prompt, 3, stop_token_ids=[]).tolist()
    )
    assert not packed, f"panels packed after prepare_native: {packed}"


def _sampling_and_self_draft_on(device: str, mode: str) -> None:
    """The fast paths' sampling and generate.py --draft int8's speculation, on `device`:
    step_stream's sort-free nucleus draws generate's tokens for a seed; the model's int8 copy, drafting
    on the target's cache with prompt lookup first, gives greedy generate's tokens, and sampled with a
    seed the tokens of the same speculation with eager steps."""
    from cs336_inference.fast.step.fixed import step_stream
    from cs336_inference.quantization import quantize_model
    from cs336_inference.speculative import ModelDraft, speculative_generate

    target = tiny("gqa").to(device)
    draft = quantize_model(target, "int8", quantize_head=True)
    motif = torch.randint(0, 64, (6,), generator=torch.Generator().manual_seed(7))
    prompt = torch.cat([torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(5)), motif, motif])
    prompt = prompt.to(device)
    for settings in (
        dict(temperature=1.0, top_p=0.9, seed=1),
        dict(temperature=0.7, top_k=10, top_p=0.95, seed=2),
    ):
        got = list(step_stream(target, prompt, 20, mode, stop_token_ids=[], **settings))
        expected = generate(target, prompt, 20, stop_token_ids=[], **settings)
        assert got == expected.tolist(), f"{device} {mode} {settings}: step_stream {got}, generate {expected}"
    expected = generate(target, prompt, 24, stop_token_ids=[])
    got, stats = speculative_generate(
        target, ModelDraft(draft, FixedSteps(mode), share_cache=True, lookup=True), prompt, 24, k=4,
        stop_token_ids=[], return_stats=True, steps=FixedSteps(mode),
    )  # fmt: skip
    assert got.tolist() == expected.tolist(), f"{device} {mode}: greedy speculation with the int8 self-draft"
    assert stats.caches["draft"] is stats.caches["target"] and stats.accepted > 0
    settings = dict(k=4, temperature=1.0, top_p=0.9, seed=7, stop_token_ids=[])
    eager = speculative_generate(
        target, ModelDraft(draft, share_cache=True, lookup=True), prompt, 30, **settings
    )
    fixed = speculative_generate(
        target, ModelDraft(draft, FixedSteps(mode), share_cache=True, lookup=True), prompt, 30,
        steps=FixedSteps(mode), **settings,
    )  # fmt: skip
    assert fixed.tolist() == eager.tolist(), f"{device} {mode}: sampled speculation, fixed vs eager steps"


def test_sampling_and_the_int8_self_draft_in_fixed_steps_on_the_cpu():
    _sampling_and_self_draft_on("cpu", "eager")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_sampling_and_the_int8_self_draft_on_cuda(mode):
    """The same on a GPU: fixed-shape steps run eagerly, or recorded as CUDA graphs."""
    _sampling_and_self_draft_on("cuda", mode)

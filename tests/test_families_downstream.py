"""Everything downstream of the model on the families' tiny checkpoints (reference_weights/, whose parity
with transformers tests/test_families.py shows): the fast path (fast.install, fixed-shape steps, the
native C step or the one line naming the switch it does not compute), the serving engine with and
without the fast path, speculative decoding, quantization, pruning, tensor parallelism and the server.

The reference is always the readable model: greedy tokens of `generate` equal, logits close (to float32
rounding where the computation is the same, to the format's error where it is quantized), and each
pruned model equal to the original with the same units masked.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from simulated_ranks import on_ranks
from torch import nn

from cs336_inference import generate, load_pretrained
from cs336_inference.config import FULL, SLIDING, ModelConfig
from cs336_inference.fast import install
from cs336_inference.fast.cpu import build
from cs336_inference.layers import GeGLU
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import SamplingParams, stream_generate
from cs336_inference.serving import LLMEngine

REF = Path(__file__).resolve().parents[1] / "reference_weights"
CASES = [
    "llama3_rope",
    "llama_yarn",
    "qwen3_qk_norm",
    "gemma3_local_global",
    "gemma3_multimodal",
    "phi3_fused",
    "phi4_partial_rotary",
]
# the native step's refusals: the first switch it meets that step.c does not compute
NATIVE_REFUSED = {
    "phi4_partial_rotary": "partial_rotary_factor",
}
PROMPT = [3, 17, 42, 99, 5, 3, 17, 42, 7]  # a repeat for prompt lookup to find
NEW = 24  # prompt + NEW = 33 steps: past every sliding window (6) and rope's original window (16)
PROMPTS = [PROMPT, [64, 1, 7, 88, 120], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [2]]


@functools.cache
def _load(case: str) -> TransformerLM:
    return load_pretrained(REF / case).eval()


def readable(case: str) -> TransformerLM:
    """The checkpoint's readable model (a fresh copy: the fast path changes a model in place)."""
    return copy.deepcopy(_load(case))


@functools.cache
def expected(case: str, prompt: tuple[int, ...] = tuple(PROMPT), n: int = NEW) -> list[int]:
    return generate(_load(case), list(prompt), n, stop_token_ids=[]).tolist()


def kernels_or_skip() -> None:
    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")


# ================================================================== the fast path
@pytest.mark.parametrize("case", CASES)
def test_the_native_step_runs_a_family_or_names_the_switch_it_lacks(case):
    from cs336_inference.fast.step.native import model_problem, why_not

    kernels_or_skip()
    model = install(readable(case))
    problem = model_problem(model)
    if case in NATIVE_REFUSED:
        assert problem is not None and NATIVE_REFUSED[case] in problem, f"{case}: {problem!r}"
        assert "\n" not in problem
        assert why_not(model, model.new_cache(1, 8)) == problem
    else:
        assert problem is None, f"{case}: the native step refused it: {problem}"


def _switched(**fields) -> TransformerLM:
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=96)
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**base, **fields})).eval()


# every switch step.c does not compute, alone, and the words its refusal must hold
REFUSED_SWITCHES = {
    "partial_rotary": (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
}


@pytest.mark.parametrize("switch", list(REFUSED_SWITCHES))
def test_each_switch_the_native_step_lacks_is_refused_in_one_line(switch):
    from cs336_inference.fast.step.fixed import FixedStep
    from cs336_inference.fast.step.native import model_problem
    from cs336_inference.fast.step.paged import why_not_paged
    from cs336_inference.serving.paged_attention import PagedKVCache

    kernels_or_skip()
    fields, words = REFUSED_SWITCHES[switch]
    model = install(_switched(**fields))
    problem = model_problem(model)
    assert problem is not None and words in problem and "\n" not in problem, f"{switch}: {problem!r}"
    paged = PagedKVCache(model.config, 4, 4, torch.float32, "cpu")
    assert why_not_paged(model, paged) == problem
    with pytest.raises(ValueError, match=words):
        FixedStep(model, model.new_cache(1, 8, spare=8), "native")


# the switches the native step computes, together: QK-norm (its gains not one), N x H != D, an attention
# scale of the model's own, embeddings times sqrt(D), YaRN and a GGUF's rope_freqs, a hybrid window
NATIVE_SWITCHES = dict(
    head_dim=16,
    qk_norm=True,
    query_pre_attn_scalar=10.0,
    embed_scale=True,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    rope_freqs=[1.0, 1.5, 2.0, 1.0, 3.0, 1.0, 1.0, 4.0],
    sliding_window=5,
    layer_types=[SLIDING, FULL],
)


def switched_model() -> TransformerLM:
    model = _switched(**NATIVE_SWITCHES)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        model.norm.weight.mul_(4.0)
    return model


def _native_against_cached(model: TransformerLM, T: int, label: str, V: int) -> None:
    """The native T-token step (2 rows) against the cached forward, to float32 rounding (as in
    tests/test_graphs.py)."""
    from cs336_inference.fast.step.fixed import FixedStep

    S = 40
    prompt = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        eager_cache, fixed_cache = model.new_cache(2, S, spare=S), model.new_cache(2, S, spare=S)
        model(prompt, cache=eager_cache)
        model(prompt, cache=fixed_cache)
        step = FixedStep(model, fixed_cache, "native", T=T)
        assert step.step.native is not None
        ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
        for t in range((S - 7) // T):
            want = model(ids, cache=eager_cache)
            got = step(ids).reshape(want.shape)
            torch.testing.assert_close(
                got, want, rtol=1e-4, atol=1e-4, msg=lambda m, t=t: f"{label} {t}: {m}"
            )
            ids = want[:, -T:].argmax(-1).reshape(2, T)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("case", [c for c in CASES if c not in NATIVE_REFUSED] + ["switches"])
def test_the_native_step_equals_the_cached_forward_on_a_family(case, T):
    """Rope scaling (llama3, YaRN), Phi-3's split qkv, Qwen3's QK-norm with N x H != D, and a model with
    every switch step.c takes at once: the native step is the readable cached forward. (The QK-norm
    gains are not ones in either, and turning qk_norm off moves the logits (tests/test_families.py): a
    step that skipped the norm would fail here.)"""
    kernels_or_skip()
    model = switched_model() if case == "switches" else readable(case)
    _native_against_cached(model, T, f"{case} T={T}", model.config.vocab_size)


@pytest.mark.parametrize("case", CASES)
def test_fast_install_keeps_every_family_module(case):
    from cs336_inference.fast import readable_type, uninstall

    model = readable(case)
    before = {name: type(m) for name, m in model.named_modules()}
    install(model)
    for name, m in model.named_modules():
        assert readable_type(m) is before[name], f"{case}: {name} became {type(m).__name__}"
    cfg = model.config
    block = model.layers[0]
    assert (type(block.mlp) is GeGLU) == (cfg.mlp_act == "gelu_tanh")
    assert (
        hasattr(block.attn, "q_norm") == cfg.qk_norm and hasattr(block, "post_attn_norm") == cfg.sandwich_norm
    )
    uninstall(model)
    assert {name: type(m) for name, m in model.named_modules()} == before


@pytest.mark.parametrize("case", CASES)
def test_the_default_decode_path_on_the_fast_path_is_generate(case):
    """What scripts/generate.py runs by default: fast.install, then native steps where why_not allows
    (step_stream), else the readable forward through the kernels (stream_generate); and the eager
    fixed-shape steps (the model's own blocks over static caches, a sliding layer's too)."""
    from cs336_inference.fast.step.fixed import graph_generate, step_stream
    from cs336_inference.fast.step.native import why_not

    fast = install(readable(case))
    native = build.library() is not None and why_not(fast, fast.new_cache(1, 1)) is None
    assert native == (build.library() is not None and case not in NATIVE_REFUSED)
    if native:
        tokens = list(step_stream(fast, PROMPT, NEW, mode="native", stop_token_ids=[]))
    else:
        tokens = list(stream_generate(fast, PROMPT, NEW, stop_token_ids=[]))
    assert tokens == expected(case), f"{case} ({'native' if native else 'kernels'})"
    got = graph_generate(install(readable(case)), torch.tensor(PROMPT), NEW, mode="eager")
    assert got.tolist() == expected(case), f"{case}: eager fixed-shape steps"


@pytest.mark.parametrize("case", ["qwen3_qk_norm", "gemma3_local_global"])
def test_a_draft_heads_native_layer_takes_qk_norm_and_gemmas_block(case):
    """fast.install(head) (fast/step/head.py): a head of a Qwen3 target (its block has QK-norm) and of a
    Gemma 3 target (sandwich norms, GeGLU) runs its layer natively and gives the readable head's
    features."""
    from cs336_inference.draft_head import DraftHead

    kernels_or_skip()
    target = readable(case)
    torch.manual_seed(0)
    head = DraftHead(target.config).attach(target).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
    install(head)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode():
        _, h = target(ids[None], return_hidden=True)
        fast_cache, ref_cache = head.new_cache(32), head.new_cache(32)
        got = head(ids[None, 1:], h[:, :-1], cache=fast_cache)
        want = DraftHead.forward(head, ids[None, 1:], h[:, :-1], cache=ref_cache)
        native = head._native(fast_cache)
    assert native is not None, f"{case}: the head's layer did not run natively"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_qk_norm", "gemma3_local_global", "phi4_partial_rotary"])
def test_compiled_fixed_shape_steps_are_generate(case):
    from cs336_inference.fast.step.fixed import graph_generate

    got = graph_generate(install(readable(case)), torch.tensor(PROMPT), NEW, mode="compile")
    assert got.tolist() == expected(case)


# ================================================================== the serving engine
def native_calls(monkeypatch) -> list[int]:
    from cs336_inference.fast.step import paged

    calls: list[int] = []
    run = paged.PagedStep.__call__

    def counted(self, input_ids, batch, *rest):
        calls.append(int(input_ids.shape[0]))
        return run(self, input_ids, batch, *rest)

    monkeypatch.setattr(paged.PagedStep, "__call__", counted)
    return calls


@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
@pytest.mark.parametrize("case", CASES)
def test_the_engine_decodes_a_family_as_generate_alone(case, fast, monkeypatch):
    """Continuous batching over a paged cache in blocks of 4 (prompt chunks, preemption, windows left
    behind): each request's greedy tokens are generate's alone; on the fast path the steps run natively
    where the native step takes the family, else the readable paged forward."""
    if fast:
        kernels_or_skip()
    calls = native_calls(monkeypatch)
    model = install(readable(case)) if fast else readable(case)
    engine = LLMEngine(model, num_blocks=20, block_size=4, max_batch_tokens=12, max_batch_seqs=3)
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, stop_token_ids=()))
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["free_blocks"] == stats["num_blocks"], stats
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out == expected(case, tuple(prompt)), f"{case}: prompt {prompt}"
    ran_native = fast and case not in NATIVE_REFUSED
    assert (len(calls) == stats["steps"]) if ran_native else not calls, f"{case}: {len(calls)} native steps"


def test_the_engine_runs_every_native_switch_natively(monkeypatch):
    kernels_or_skip()
    calls = native_calls(monkeypatch)
    model = switched_model()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    p = SamplingParams(max_new_tokens=20, stop_token_ids=())
    want = [generate(model, prompt, params=p).tolist() for prompt in prompts]
    engine = LLMEngine(install(copy.deepcopy(model)), num_blocks=24, block_size=4, max_batch_tokens=12)
    assert engine.generate(prompts, p) == want
    assert len(calls) == engine.stats()["steps"]


# ================================================================== speculative decoding
@pytest.mark.parametrize("case", CASES)
def test_speculative_decoding_of_a_family_is_greedy_generate(case):
    """Prompt lookup, the model as its own draft (own cache or the target's), and the model draft with
    the target in fixed-shape steps (native where the native step takes the family, else eager, the
    native mode then refused in one line)."""
    from cs336_inference.fast.step.fixed import FixedSteps
    from cs336_inference.speculative import ModelDraft, NGramDraft, speculative_generate

    model = readable(case)
    want = expected(case)
    for label, draft in [
        ("ngram", NGramDraft()),
        ("model", model),
        ("shared", ModelDraft(model, share_cache=True)),
    ]:
        got = speculative_generate(model, draft, PROMPT, NEW, k=3, stop_token_ids=[])
        assert got.tolist() == want, f"{case}: {label} draft"
    fast = install(readable(case))
    mode = "native" if build.library() is not None and case not in NATIVE_REFUSED else "eager"
    got = speculative_generate(fast, fast, PROMPT, NEW, k=3, stop_token_ids=[], steps=FixedSteps(mode))
    assert got.tolist() == want, f"{case}: a model draft in {mode} fixed-shape steps"
    if case in NATIVE_REFUSED and build.library() is not None:
        with pytest.raises(ValueError, match=NATIVE_REFUSED[case]):
            speculative_generate(fast, "ngram", PROMPT, NEW, k=3, steps=FixedSteps("native"))


# ================================================================== quantization
def _kl(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(
        F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    )


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
# 8-bit formats: KL to the float model (tests/test_quantization.py allows 0.005 on its tiny model). The
# Gemma checkpoints' attention is sharper (QK-norm gains about 2.4, scale 1/sqrt(20)): q_proj's and
# k_proj's rounding moves their logits about 50x more, measured 0.02-0.05 for int8 and q8_0
KL_8BIT = {"gemma3_local_global": 0.1, "gemma3_multimodal": 0.1}


@pytest.mark.parametrize("case", CASES)
def test_a_quantized_family_is_its_float_model_with_rounded_weights(case):
    """Every block product quantized and nothing else changed (GeGLU, QK-norm, sandwich norms, embedding
    scale, local rotary base kept): the weight-only formats' logits are those of the float model holding
    the dequantized weights; every format's are close to the float model's; and it generates."""
    from cs336_inference.quantization import QuantizedLinear, quantize_model

    model = readable(case)
    with torch.no_grad():
        ref = model(IDS)
    kls = {}
    for method in ("int8", "q8_0", "q4_0", "int4", "llm_int8"):
        q = quantize_model(model, method, group_size=32 if method == "int4" else None)
        rounded = copy.deepcopy(model)
        layers = dict(q.named_modules())
        with torch.no_grad():
            for name, m in rounded.named_modules():
                if isinstance(layers.get(name), QuantizedLinear):
                    m.weight.copy_(layers[name].dequantize())
            got, want = q(IDS), rounded(IDS)
        if method != "llm_int8":  # (which rounds the activations too)
            assert (got - want).abs().max() <= 1e-4, f"{case} {method}: {(got - want).abs().max():.3g}"
        kls[method] = _kl(got, ref)
        assert len(generate(q, PROMPT, 4, stop_token_ids=[])) == 4
    bound = KL_8BIT.get(case, 0.005)
    assert all(kls[m] < bound for m in ("int8", "q8_0", "llm_int8")), f"{case}: {kls}"
    assert max(kls["int8"], kls["q8_0"]) < kls["q4_0"] / 5, f"{case}: 4 bits not coarser than 8? {kls}"


@pytest.mark.parametrize("case", CASES)
def test_awq_folds_its_scales_into_every_family_exactly(case):
    """AWQ's scales folded into attn_norm (q, k, v), mlp_norm (gate, up), v_proj (o) and up_proj (down:
    linear in up for GeGLU as for SwiGLU) leave the float model's function unchanged, QK-norm and
    sandwich norms included; then the int4 model runs."""
    from cs336_inference.quantization import awq as awq_mod
    from cs336_inference.quantization import quantize_model

    model = readable(case)
    folded, chosen = awq_mod.awq_fold(model, IDS, group_size=32)
    assert any(alpha > 0 for alpha, _ in chosen.values())
    with torch.no_grad():
        diff = (folded(IDS) - model(IDS)).abs().max()
    assert diff <= 1e-4, f"{case}: folding moved the logits by {diff:.3g}"
    q = quantize_model(model, "awq", group_size=32, calibration=IDS)
    assert len(generate(q, PROMPT, 4, stop_token_ids=[])) == 4


# ================================================================== pruning
def random_scores(cfg: ModelConfig, seed: int = 3):
    from cs336_inference.pruning import Importance

    g = torch.Generator().manual_seed(seed)
    L = cfg.n_layers
    return Importance(
        heads=torch.rand(L, cfg.n_heads, generator=g),
        neurons=torch.rand(L, cfg.d_ff, generator=g),
        channels=torch.rand(cfg.d_model, generator=g),
        layers=torch.rand(L, generator=g),
    )


def _top(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:k])


def masked_logits(model, x, heads=None, neurons=None, layers=None) -> torch.Tensor:
    """The model's logits with the other heads / neurons zeroed at o_proj's / down_proj's input, or only
    `layers` run."""
    model = copy.deepcopy(model)
    cfg = model.config
    for i, block in enumerate(model.layers):
        if heads is not None:
            mask = torch.zeros(cfg.n_heads, cfg.head_dim)
            mask[heads[i]] = 1.0
            mask = mask.flatten()
            block.attn.o_proj.register_forward_pre_hook(lambda m, a, k=mask: (a[0] * k,))
        if neurons is not None:
            mask = torch.zeros(cfg.d_ff)
            mask[neurons[i]] = 1.0
            block.mlp.down_proj.register_forward_pre_hook(lambda m, a, k=mask: (a[0] * k,))
    if layers is not None:
        model.layers = nn.ModuleList(model.layers[i] for i in layers)
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("case", CASES)
def test_depth_pruning_a_family_equals_skipping_its_layers(case):
    from cs336_inference.pruning import prune

    model = readable(case)
    keep = [0, 2, 5] if model.config.n_layers == 6 else [1]
    small = prune(model, layers=keep)
    if model.config.layer_types is not None:  # Gemma's local layers keep their window and rotary base
        assert small.config.layer_types == [model.config.layer_types[i] for i in keep]
    with torch.no_grad():
        got = small(IDS)
    torch.testing.assert_close(got, masked_logits(model, IDS, layers=keep), rtol=0, atol=2e-5)
    assert len(generate(small, PROMPT, NEW, stop_token_ids=[])) == NEW  # its cache: windows, local rope


@pytest.mark.parametrize("case", CASES)
def test_width_pruning_a_family_equals_masking_heads_and_neurons(case):
    """Query heads within their groups (QK-norm's per-head-dim gains kept whole, H kept under partial
    rotary and N x H != D) and GeGLU / SwiGLU neurons: the pruned model is the original with them masked."""
    from cs336_inference.pruning import prune

    model = readable(case)
    cfg = model.config
    s = random_scores(cfg)
    N, K = cfg.n_heads, cfg.n_kv_heads
    G, n_heads = N // K, N // 2
    small = prune(model, n_heads=n_heads, d_ff=40, scores=s, head_mode="within")
    assert (small.config.n_heads, small.config.n_kv_heads, small.config.head_dim) == (
        n_heads,
        K,
        cfg.head_dim,
    )
    assert small.config.rotary_dim == cfg.rotary_dim
    heads = [
        [k * G + g for k in range(K) for g in _top(s.heads[i][k * G : (k + 1) * G], G // 2)]
        for i in range(cfg.n_layers)
    ]
    neurons = [_top(s.neurons[i], 40) for i in range(cfg.n_layers)]
    with torch.no_grad():
        got = small(IDS)
    torch.testing.assert_close(
        got, masked_logits(model, IDS, heads=heads, neurons=neurons), rtol=0, atol=2e-5
    )
    if cfg.qk_norm:
        assert torch.equal(small.layers[0].attn.q_norm.weight, model.layers[0].attn.q_norm.weight)


def _with_dead_channels(model: TransformerLM, dead: list[int]) -> TransformerLM:
    with torch.no_grad():
        model.embed.weight[:, dead] = 0
        for block in model.layers:
            block.attn.o_proj.weight[dead] = 0
            block.mlp.down_proj.weight[dead] = 0
    return model


@pytest.mark.parametrize(
    "case", ["llama3_rope", "qwen3_qk_norm", "phi4_partial_rotary", "gemma3_no_embed_scale"]
)
def test_removing_zero_channels_of_a_family_is_exact(case):
    """d_model pruning: channels that are zero in the residual stream removed, every norm over D (Gemma's
    post_attn_norm / post_mlp_norm too, whose input is zero there as well) rescaled: the logits are the
    original's. QK-norm's eps is the config's one rms_norm_eps, scaled by D/D' with the others: not
    exact, a few 1e-6 here. Gemma with embed_scale is refused (next test); here its block without it."""
    from cs336_inference.pruning import prune

    if case == "gemma3_no_embed_scale":
        gemma = readable("gemma3_local_global")
        model = TransformerLM(ModelConfig.from_dict({**gemma.config.to_dict(), "embed_scale": False})).eval()
        model.load_state_dict(gemma.state_dict())
    else:
        model = readable(case)
    dead = [0, 7, 8, 30, 47, 63]
    model = _with_dead_channels(model, dead)
    s = random_scores(model.config)
    s.channels[dead] = -1.0
    small = prune(model, d_model=58, scores=s)
    if model.config.sandwich_norm:
        assert small.layers[0].post_attn_norm.weight.shape == (58,)
    with torch.no_grad():
        got, want = small(IDS), model(IDS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 if model.config.qk_norm else 2e-5)
    if model.config.sandwich_norm:  # the negative control: the post norms cut but not rescaled
        with torch.no_grad():
            for block in small.layers:
                for norm in (block.post_attn_norm, block.post_mlp_norm):
                    norm.weight.div_((64 / 58) ** 0.5)
            assert (small(IDS) - want).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["gemma3_local_global", "gemma3_multimodal"])
def test_d_model_pruning_of_a_model_scaling_its_embeddings_is_refused_in_one_line(case):
    from cs336_inference.pruning import prune

    model = readable(case)
    s = random_scores(model.config)
    with pytest.raises(ValueError, match="embed_scale") as e:
        prune(model, d_model=48, scores=s)
    assert "\n" not in str(e.value)
    small = prune(model, n_layers=3, d_ff=48, n_heads=2, head_mode="within", scores=s)  # the other axes prune
    assert (small.config.n_layers, small.config.d_ff, small.config.n_heads) == (3, 48, 2)
    assert len(generate(small, PROMPT, 4, stop_token_ids=[])) == 4


def test_geglu_neurons_are_scored_by_what_they_feed_down_proj():
    from cs336_inference.pruning import importance_scores

    model = readable("gemma3_local_global")
    seen = []
    hook = model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        scores = importance_scores(model, IDS, batch_size=2)
    hook.remove()
    want = seen[0].abs().mean(dim=(0, 1))
    torch.testing.assert_close(scores.neurons[1], want, rtol=1e-5, atol=1e-7)


# ================================================================== tensor parallelism
@pytest.mark.parametrize("case", CASES)
def test_a_sharded_family_gives_the_whole_models_logits_and_tokens(case):
    """Two ranks (threads, tests/simulated_ranks.py): q/k/v/o and gate/up/down split as Llama's, QK-norm
    and the sandwich norms replicated, the embedding scale and local rotary base in every shard."""
    from cs336_inference.parallel import shard_model
    from cs336_inference.parallel.tensor_parallel import shard_plan, slice_of

    model = readable(case)
    cfg = model.config
    shard = shard_plan(cfg, 2, 0)
    for name in model.state_dict():
        if "norm" in name:
            assert slice_of(name, cfg, shard) is None, f"{name} is split"
    with torch.inference_mode():
        want = model(IDS)

    def on_rank(rank: int):
        tp = shard_model(model)
        full = tp(IDS)
        cache = tp.new_cache(2, 30)
        cached = torch.cat([tp(IDS[:, :13], cache=cache), tp(IDS[:, 13:], cache=cache)], dim=1)
        return full, cached, generate(tp, PROMPT, NEW, stop_token_ids=[]).tolist()

    for rank, (full, cached, tokens) in enumerate(on_ranks(2, on_rank)):
        torch.testing.assert_close(full, want, rtol=0, atol=1e-4, msg=lambda m, r=rank: f"rank {r}: {m}")
        torch.testing.assert_close(cached, want, rtol=0, atol=1e-4, msg=lambda m, r=rank: f"rank {r}: {m}")
        assert tokens == expected(case), f"{case}, rank {rank}"


@pytest.mark.parametrize("case", ["qwen3_qk_norm", "gemma3_local_global"])
def test_the_engine_on_a_sharded_family_decodes_as_generate_alone(case):
    """Each rank's engine over its shard's paged cache (its own K/V heads), stepping in lockstep."""
    from cs336_inference.parallel import shard_model

    model = readable(case)
    p = SamplingParams(max_new_tokens=NEW, stop_token_ids=())

    def on_rank(rank: int):
        engine = LLMEngine(
            shard_model(model), num_blocks=20, block_size=4, max_batch_tokens=12, max_batch_seqs=3
        )
        return engine.generate(PROMPTS, p)

    for rank, outs in enumerate(on_ranks(2, on_rank)):
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out == expected(case, tuple(prompt)), f"{case}, rank {rank}: prompt {prompt}"


# ================================================================== the server
@pytest.mark.parametrize("case", ["qwen3_qk_norm", "gemma3_local_global"])
def test_the_server_serves_a_family_model_on_the_fast_path(case):
    """A random model of the family's architecture with SmolLM2's vocabulary (its tokenizer), installed
    on the fast path as scripts/serve.py does: the completion is greedy generate's text."""
    pytest.importorskip("fastapi")
    from test_server import MODEL, Server

    from cs336_inference.io.checkpoint import default_model_path
    from cs336_inference.io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    fields = {**_load(case).config.to_dict(), "vocab_size": tokenizer.vocab_size, "max_seq_len": 128}
    fields["eos_token_id"] = tokenizer.eos_token_ids
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.from_dict(fields)).eval()
    reference = copy.deepcopy(model)
    engine = LLMEngine(install(model), num_blocks=32, block_size=8, max_batch_seqs=4)
    server = Server(reference, tokenizer, engine)
    try:
        prompt = "The capital of France is"
        out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        assert out.choices[0].text == server.expected(tokenizer.encode(prompt), 10)
    finally:
        server.uvicorn.should_exit = True
        server.thread.join(timeout=10)

"""The model's parts against independent implementations (torch's own ops, formulas, properties)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_inference import ConfigError, ModelConfig, TransformerLM
from cs336_inference.attention import attend, attention_mask
from cs336_inference.layers import RMSNorm, SwiGLU, apply_rope, rope_tables

TINY = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64)
MLA_DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def tiny_model(seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # norms away from 1 so that a missing weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


# ---------------------------------------------------------------------------------- layers
@pytest.mark.graded(problem="rmsnorm", points=1)
def test_rmsnorm_matches_torch():
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    x = torch.randn(3, 5, 48) * 3
    expected = F.rms_norm(x, (48,), weight=norm.weight, eps=1e-5)
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.graded(problem="rope", points=2)
def test_rope_matches_complex_rotation():
    """RoPE as the original paper writes it: multiply the complex number x_i + i x_{i+H/2} by e^{i p w_i}."""
    H, T, theta = 16, 11, 10000.0
    cos, sin = rope_tables(H, 32, theta)
    x = torch.randn(2, 3, T, H)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    out = apply_rope(x, cos[pos], sin[pos])
    w = theta ** (-torch.arange(0, H, 2, dtype=torch.float64) / H)
    z = torch.complex(x[..., : H // 2].double(), x[..., H // 2 :].double())
    z = z * torch.exp(1j * pos[:, None, :, None].double() * w)
    expected = torch.cat([z.real, z.imag], dim=-1).float()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.graded(problem="rope", points=1)
def test_rope_scores_depend_on_relative_position_only():
    H = 8
    cos, sin = rope_tables(H, 64, 10000.0)
    q, k = torch.randn(1, 1, 1, H), torch.randn(1, 1, 1, H)

    def score(i: int, j: int) -> float:
        qi = apply_rope(q, cos[i].view(1, 1, H), sin[i].view(1, 1, H))
        kj = apply_rope(k, cos[j].view(1, 1, H), sin[j].view(1, 1, H))
        return float((qi * kj).sum())

    assert score(5, 2) == pytest.approx(score(40, 37), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)  # negative control


@pytest.mark.graded(problem="swiglu", points=1)
def test_swiglu_formula():
    mlp = SwiGLU(16, 40)
    x = torch.randn(2, 3, 16)
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    g = x @ gate.T
    expected = ((g / (1 + torch.exp(-g))) * (x @ up.T)) @ down.T  # silu(z) = z * sigmoid(z)
    torch.testing.assert_close(mlp(x), expected, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------- attention
@pytest.mark.graded(problem="attention", points=3)
@pytest.mark.parametrize("K", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attend_matches_torch_sdpa(K: int):
    B, N, T, H = 2, 4, 9, 16
    q, k, v = torch.randn(B, N, T, H), torch.randn(B, K, T, H), torch.randn(B, K, T, H)
    steps = torch.arange(T)
    out = attend(q, k, v, attention_mask(steps, steps), H**-0.5)
    # torch's kernel with every K/V head repeated for its N/K query heads (the definition of GQA)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(N // K, dim=1), v.repeat_interleave(N // K, dim=1), is_causal=True
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.graded(problem="sliding_window", points=2)
def test_sliding_window_mask_definition():
    """Key j visible to query i iff i - W < j <= i (the window counts the current token)."""
    T, W = 10, 3
    steps = torch.arange(T)
    mask = attention_mask(steps, steps, window=W)[0]
    for i in range(T):
        for j in range(T):
            assert bool(mask[i, j]) == (i - W < j <= i), (i, j)
    assert attention_mask(steps, steps)[0].sum() == T * (T + 1) // 2  # no window: plain causal


@pytest.mark.graded(problem="attention", points=1)
def test_left_padding_is_invisible():
    """A left-padded row attends as if the padding were not there."""
    model = tiny_model(n_kv_heads=2)
    ids = torch.randint(0, 97, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    with torch.no_grad():
        alone = model(ids)
        batch = model(torch.cat([padded, torch.randint(0, 97, (1, 9))]), pad=torch.tensor([3, 0]))
    torch.testing.assert_close(batch[0, 3:], alone[0], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------- CLA
def test_cla_kv_share_1_is_plain_attention():
    plain = tiny_model(n_kv_heads=2)
    cla = TransformerLM(ModelConfig(**TINY, n_kv_heads=2, kv_share=1))
    cla.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(cla(ids), plain(ids), atol=0, rtol=0)


def test_cla_only_owning_layers_have_kv():
    model = tiny_model(n_layers=4, n_kv_heads=2, kv_share=2)
    names = {n for n, _ in model.named_parameters()}
    for i in range(4):
        owns = i % 2 == 0
        assert (f"layers.{i}.attn.k_proj.weight" in names) == owns
        assert (f"layers.{i}.attn.v_proj.weight" in names) == owns
    cache = model.new_cache(1, 16)
    assert [store is not None for store in cache.layers] == [True, False, True, False]
    assert cache.nbytes == 2 * 2 * (1 * 2 * 16 * 16) * 4  # 2 owning layers x (K, V) x B K S H x fp32


@pytest.mark.graded(problem="cla", points=3)
def test_cla_matches_hand_written_forward():
    """A from-scratch CLA forward (torch SDPA, no code from the package but the weights)."""
    model = tiny_model(n_layers=4, n_kv_heads=2, kv_share=2)
    cfg = model.config
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    ids = torch.randint(0, 97, (2, 10))
    T = ids.shape[1]
    cos, sin = rope_tables(H, T, cfg.rope_theta)

    def rope(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def rms(x, w):
        return F.rms_norm(x, (x.shape[-1],), weight=w, eps=cfg.rms_norm_eps)

    with torch.no_grad():
        x = model.embed.weight[ids]
        for i, block in enumerate(model.layers):
            a = block.attn
            h = rms(x, block.attn_norm.weight)
            q = rope((h @ a.q_proj.weight.T).view(2, T, N, H).transpose(1, 2))
            if i % 2 == 0:
                k = rope((h @ a.k_proj.weight.T).view(2, T, K, H).transpose(1, 2))
                v = (h @ a.v_proj.weight.T).view(2, T, K, H).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(2, T, N * H) @ a.o_proj.weight.T
            h = rms(x, block.mlp_norm.weight)
            m = block.mlp
            x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
        expected = rms(x, model.norm.weight) @ model.lm_head.weight.T
        torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------- MLA
@pytest.mark.graded(problem="mla", points=3)
@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_mla_absorbed_equals_naive(q_lora_rank):
    model = tiny_model(**MLA_DIMS, q_lora_rank=q_lora_rank, rope_interleave=True)
    ids = torch.randint(0, 97, (2, 15))
    with torch.no_grad():
        for block in model.layers:
            block.attn.absorb = False
        naive = model(ids)
        for block in model.layers:
            block.attn.absorb = True
        absorbed = model(ids)
    assert (naive - absorbed).abs().max() <= 1e-5
    assert naive.abs().max() > 0.1  # the comparison is not between two zero tensors


def test_mla_absorbed_reads_no_per_head_keys():
    """The absorbed path never calls kv_b_proj (no up-projected K/V are built)."""
    model = tiny_model(**MLA_DIMS)
    calls = []
    for block in model.layers:
        block.attn.kv_b_proj.register_forward_hook(lambda *a: calls.append(1))
        block.attn.absorb = True
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 5)))
    assert calls == []


# ------------------------------------------------------------------------------ bad configs
@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(d_model=60, n_heads=7), "not divisible by n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "not divisible by n_kv_heads"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window is not set"),
        (dict(kv_share=0), "kv_share"),
        (dict(head_dim=15), "must be even"),
        (dict(kv_share="2"), "kv_share must be an integer"),
        (dict(sliding_window=4.5), "sliding_window must be an integer"),
        (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
        (dict(**MLA_DIMS, q_lora_rank=0), "q_lora_rank must be an integer >= 1"),
        (dict(kv_lora_rank=0, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12), "kv_lora_rank"),
        (dict(**{**MLA_DIMS, "v_head_dim": 12.0}), "v_head_dim must be an integer"),
        (dict(n_layers=True), "n_layers must be an integer"),  # a bool is not an int
        (dict(n_heads="4"), "n_heads must be an integer"),
        (dict(vocab_size=97.0), "vocab_size must be an integer"),
        (dict(d_ff=-1), "d_ff must be an integer >= 1"),
        (dict(max_seq_len=0), "max_seq_len must be an integer >= 1"),
        (dict(n_kv_heads=0), "n_kv_heads must be an integer >= 1"),
        (dict(head_dim=0), "head_dim must be an integer >= 1"),
        (dict(qk_rope_head_dim=-2), "qk_rope_head_dim must be an integer >= 0"),
        (dict(bos_token_id=-1), "bos_token_id must be an integer >= 0"),
        (dict(eos_token_id="2"), "eos_token_id must be"),
        (dict(eos_token_id=[1, None]), "eos_token_id must be"),
        (dict(rope_theta=0.0), "rope_theta must be a number > 0"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a number > 0"),
        (dict(tie_embeddings=1), "tie_embeddings must be True or False"),
        (dict(rope_interleave="yes"), "rope_interleave must be True or False"),
    ],
)
def test_bad_config_is_one_clear_error(overrides, words):
    with pytest.raises(ConfigError, match=words) as e:
        ModelConfig(**{**TINY, **overrides})
    assert "\n" not in str(e.value)


def test_good_config_values_pass():
    """Integers of numpy or JSON origin, eos lists, and MLA without a query latent are all fine."""
    ModelConfig(**TINY, eos_token_id=[1, 2], bos_token_id=0, rope_theta=500000, sliding_window=8)
    ModelConfig(**TINY, **MLA_DIMS, q_lora_rank=None)
    ModelConfig(**{**TINY, "n_layers": 3}, kv_share=3)


# ------------------------------------------------------------------------------- pad and caches
def test_pad_may_be_a_list_or_tuple():
    model = tiny_model(n_kv_heads=2)
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        expected = model(ids, pad=torch.tensor([3, 0]))
        torch.testing.assert_close(model(ids, pad=[3, 0]), expected, atol=0, rtol=0)
        torch.testing.assert_close(model(ids, pad=(3, 0)), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "pad, words",
    [
        ([3], r"pad must have shape \(2,\)"),
        ([[3, 0]], r"pad must have shape \(2,\)"),
        ([3, -1], "pad must be in 0..8"),
        ([9, 0], "pad must be in 0..8"),
        ([1.5, 0], "pad must hold integers"),
    ],
)
def test_bad_pad_is_one_clear_error(pad, words):
    model = tiny_model(n_kv_heads=2)
    with pytest.raises(ValueError, match=words) as e:
        model(torch.randint(0, 97, (2, 9)), pad=pad)
    assert "\n" not in str(e.value)
    cache_pad = [16 if p == 9 else p for p in pad]  # a cache of 16 steps: pad 9 is fine, 16 is not
    with pytest.raises(ValueError, match=words.replace("0..8", "0..15")):
        model.new_cache(2, 16, pad=cache_pad)


def test_pad_together_with_a_cache_is_refused():
    """The cache's own pad (given to new_cache) applies to every step; a second one would be ignored."""
    model = tiny_model(n_kv_heads=2)
    cache = model.new_cache(2, 16, pad=[1, 0])
    with pytest.raises(ValueError, match="new_cache"):
        model(torch.randint(0, 97, (2, 4)), cache=cache, pad=torch.tensor([1, 0]))


def test_cache_dtype_other_than_the_model_is_refused():
    model = tiny_model(n_kv_heads=2)
    with pytest.raises(ValueError, match="float32"):
        model.new_cache(1, 16, dtype=torch.bfloat16)
    assert model.new_cache(1, 16, dtype=torch.float32).layers[0].k.dtype == torch.float32
    half = tiny_model(n_kv_heads=2).to(torch.bfloat16)
    assert half.new_cache(1, 16).layers[0].k.dtype == torch.bfloat16


def test_over_long_input_is_clear():
    model = tiny_model()
    with pytest.raises(ValueError, match="context window"):
        model(torch.zeros(1, TINY["max_seq_len"] + 1, dtype=torch.long))


def test_parameter_count_matches_config():
    cfg = ModelConfig(**TINY, n_kv_heads=2)
    model = TransformerLM(cfg)
    D, F_, V, L, H = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.n_layers, cfg.head_dim
    attn = D * cfg.n_heads * H * 2 + D * cfg.n_kv_heads * H * 2
    assert model.num_parameters() == 2 * V * D + L * (attn + 3 * D * F_ + 2 * D) + D
    assert math.isclose(sum(p.numel() for p in model.parameters()), model.num_parameters())


# ------------------------------------------------------------------------- half precision
# Worst |logit - fp32 logit| over max |fp32 logit| seen on these tiny models (CPU): 2.8% in bf16
# (8-bit mantissa, MLA) and 0.27% in fp16 (11-bit mantissa). The bounds leave 2-3x room for other
# kernels; a lost upcast or a float32 leftover shows as inf/NaN, a dtype check, or a far larger error.
HALF_TOL = {torch.bfloat16: 0.06, torch.float16: 0.008}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("variant", ["gqa", "sliding", "mla"])
def test_half_precision_forward_is_close_to_float32(dtype, variant):
    overrides = {"gqa": dict(n_kv_heads=2), "sliding": dict(n_kv_heads=2, sliding_window=5)}
    model = tiny_model(**overrides.get(variant, MLA_DIMS))
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # peaked logits: greedy choices far from ties
        reference = model(ids)
        half = model.to(dtype)
        assert {p.dtype for p in half.parameters()} == {dtype}
        logits = half(ids)
    assert logits.dtype == dtype and bool(torch.isfinite(logits).all()), f"{dtype}: non-finite logits"
    scale = float(reference.abs().max())
    err = float((logits.float() - reference).abs().max())
    assert err <= HALF_TOL[dtype] * scale, (
        f"{dtype} {variant}: max |logit error| {err:.3g} vs scale {scale:.3g}"
    )
    agree = float((logits.float().argmax(-1) == reference.argmax(-1)).float().mean())
    assert agree >= 0.9, f"{dtype} {variant}: greedy token agrees with fp32 at {agree:.0%} of positions"


@pytest.mark.parametrize("interleave", [False, True])
def test_mla_without_interleaved_rope_absorbed_equals_naive(interleave):
    """DeepSeek checkpoints with rope_interleave=False (rotate-half keys) as well as True."""
    model = tiny_model(**MLA_DIMS, q_lora_rank=24, rope_interleave=interleave)
    ids = torch.randint(0, 97, (2, 15))
    with torch.no_grad():
        outputs = []
        for absorb in (False, True):
            for block in model.layers:
                block.attn.absorb = absorb
            outputs.append(model(ids))
    naive, absorbed = outputs
    assert (naive - absorbed).abs().max() <= 1e-5
    other = tiny_model(**MLA_DIMS, q_lora_rank=24, rope_interleave=not interleave)
    with torch.no_grad():  # same weights, other rotary layout: the flag really changes the model
        assert (other(ids) - naive).abs().max() > 1e-3

"""The lecture's accounting: every figure it states, checked against the formulas, and the formulas
checked against things that do not share their code (torch's FLOP counter, tensor sizes, Hugging Face
models and caches, a Monte Carlo simulation, the live caches of TransformerLM)."""

import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from cs336_inference import accounting as acc
from cs336_inference.config import FULL, SLIDING, ModelConfig

S_LECTURE = 1024  # the lecture's Llama-2-13B example context


def counted_flops(fn) -> int:
    """FLOPs torch's own counter sees when running fn (attention through the countable math path)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def tiny(**fields) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, d_ff=48, max_seq_len=64)
    return ModelConfig(**{**base, **fields})


# ------------------------------------------------------------------------ matmul
@pytest.mark.graded(problem="matmul_accounting", points=3)
def test_matmul_flops_bytes_match_torch_and_intensity_tends_to_B():
    B, D, F = 3, 40, 24
    x, w = torch.randn(B, D, dtype=torch.bfloat16), torch.randn(D, F, dtype=torch.bfloat16)
    y = x @ w
    assert acc.matmul_flops(B, D, F) == counted_flops(lambda: x @ w)
    assert acc.matmul_bytes(B, D, F) == x.nbytes + w.nbytes + y.nbytes  # bf16: 2BD + 2DF + 2BF
    assert acc.matmul_bytes(B, D, F, dtype_bytes=4) == 2 * acc.matmul_bytes(B, D, F)
    # B << D, F: the weight read dominates and the intensity approaches B from below.
    D = F = 16384
    for B in (1, 2, 8, 32, 128):
        intensity = acc.matmul_intensity(B, D, F)
        assert B * (1 - B * (1 / D + 1 / F)) < intensity < B
    # Negative control: when B is not small the intensity is far from B (square: B / 3).
    assert acc.matmul_intensity(4096, 4096, 4096) == pytest.approx(4096 / 3)


@pytest.mark.graded(problem="matmul_accounting", points=1)
def test_h100_accelerator_intensity_is_295():
    assert round(acc.accelerator_intensity()) == 295  # lecture: 989e12 / 3.35e12
    assert acc.accelerator_intensity(200e9, 40e9) == pytest.approx(5.0)


# ------------------------------------------------------------- MLP and attention
def swiglu(x, w_gate, w_up, w_down):
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
def test_mlp_counts_match_torch_and_the_lecture():
    cfg = tiny(d_model=24, d_ff=40)
    B, T, D, F = 2, 3, 24, 40
    x = torch.randn(B, T, D)
    weights = torch.randn(D, F), torch.randn(D, F), torch.randn(F, D)
    assert acc.mlp_flops(cfg, B, T) == counted_flops(lambda: swiglu(x, *weights))  # 6BTDF
    # The lecture's byte count for bf16: 4BTD + 4BTF + 6DF.
    assert acc.mlp_bytes(cfg, B, T) == 4 * B * T * D + 4 * B * T * F + 6 * D * F
    # Intensity tends to B*T when B*T << D, F (Llama-2-13B): decode ~ B, prefill ~ B*S.
    big = acc.llama2_13b()
    for B, T in [(1, 1), (4, 1), (64, 1), (1, 16), (2, 64)]:
        assert 0.9 * B * T < acc.mlp_intensity(big, B, T) < B * T


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
def test_attention_counts_match_torch_and_intensity_is_ST_over_S_plus_T():
    cfg = tiny()  # MHA: N*H = D = 32
    B, N, H = 2, 4, 8
    for T, S in [(1, 9), (5, 5), (3, 11)]:
        q, k, v = torch.randn(B, N, T, H), torch.randn(B, N, S, H), torch.randn(B, N, S, H)
        run = lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
        assert acc.attention_flops(cfg, B, T, S) == counted_flops(run)  # 4BSTD
        D = cfg.d_model
        assert acc.attention_bytes(cfg, B, T, S) == 4 * B * S * D + 4 * B * T * D  # lecture, bf16
        assert acc.attention_intensity(cfg, B, T, S) == pytest.approx(S * T / (S + T))


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
def test_decode_attention_intensity_below_one_for_every_S_and_batch():
    cfg = acc.llama2_13b()
    for S in [1, 2, 7, 100, 1024, 4096, 131072, 10**7]:
        for B in (1, 64, 1024):
            intensity = acc.attention_intensity(cfg, B, 1, S)
            assert intensity < 1
            assert intensity == pytest.approx(acc.attention_intensity(cfg, 1, 1, S))  # batching does not help
    # Prefill (T = S) is S/2: well above the H100's 295 for a 4096-token prompt.
    assert acc.attention_intensity(cfg, 1, 4096, 4096) == pytest.approx(2048)
    # Negative control: GQA (K = 8 of N = 40) reads 5x less K/V, so decode goes above 1 (but below N/K).
    gqa = dataclasses.replace(cfg, n_kv_heads=8)
    assert 1 < acc.attention_intensity(gqa, 1, 1, 4096) < 40 / 8


@pytest.mark.graded(problem="mlp_attention_accounting", points=1)
def test_prefill_is_compute_bound_and_decode_memory_bound():
    cfg, h100 = acc.llama2_13b(), 989e12 / 3.35e12  # the H100's FLOPs per byte, about 295
    # Prefill of one 1024-token prompt: both the MLP and attention are above the H100's ridge.
    assert acc.mlp_intensity(cfg, 1, 1024) > h100
    assert acc.attention_intensity(cfg, 1, 1024, 1024) > h100
    # Decode at B = 64: both are below it.
    assert acc.mlp_intensity(cfg, 64, 1) < h100
    assert acc.attention_intensity(cfg, 64, 1, 1024) < h100


# ----------------------------------------------------------------------- KV cache
@pytest.mark.graded(problem="kv_cache_bytes", points=2)
def test_kv_cache_lecture_numbers_llama2_70b():
    cfg = acc.llama2_70b()  # L=80, K=8, H=128
    assert acc.kv_cache_bytes(cfg, 1, 4096) == 1_342_177_280
    assert acc.kv_cache_bytes_per_token(cfg) == 2 * 80 * 8 * 128 * 2
    big = acc.kv_cache_bytes(cfg, 64, 32768)
    assert big == 687_194_767_360
    assert round(big / 140e9, 1) == 4.9  # the lecture's 140 GB of weights (70B x 2 bytes)


@pytest.mark.graded(problem="kv_cache_bytes", points=1)
def test_mla_576_dims_per_token_vs_mha_8192():
    mla = acc.deepseek_v2()
    assert acc.kv_bytes_per_token_layer(mla, dtype_bytes=1) == 512 + 64
    assert acc.kv_cache_bytes_per_token(mla, dtype_bytes=2) == 60 * 576 * 2
    mha = dataclasses.replace(acc.llama2_70b(), n_kv_heads=64)  # N = K = 64, H = 128
    per_kv = mha.n_kv_heads * mha.head_dim
    assert per_kv == 8192
    assert round(per_kv / 576, 1) == 14.2  # the lecture's "14x": 8192 key dims vs 576 latent dims
    # The MHA cache holds keys AND values, 2 x 8192 numbers per token and layer, so per byte the
    # reduction is twice the lecture's ratio.
    ratio = acc.kv_bytes_per_token_layer(mha) / acc.kv_bytes_per_token_layer(mla)
    assert ratio == pytest.approx(2 * 8192 / 576)


@pytest.mark.graded(problem="kv_cache_bytes", points=2)
def test_kv_cache_bytes_equal_hugging_face_cache_sizes():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    B, S = 2, 7
    for K in (4, 2, 1):  # MHA, GQA, MQA
        cfg = tiny(n_kv_heads=K)
        hf = LlamaConfig(
            vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=K, intermediate_size=48,
        )  # fmt: skip
        with torch.no_grad():
            cache = LlamaForCausalLM(hf).eval()(torch.randint(0, 97, (B, S)), use_cache=True).past_key_values
        hf_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert acc.kv_cache_bytes(cfg, B, S, dtype_bytes=4) == hf_bytes
        assert acc.kv_cache_layer_bytes(cfg, 0, B, S, 4) == cache.layers[0].keys.nbytes * 2


@pytest.mark.graded(problem="kv_cache_bytes", points=2)
def test_sliding_cla_and_hybrid_kv_bytes():
    full, W = tiny(n_kv_heads=2), 8
    sliding = dataclasses.replace(full, sliding_window=W)
    # Sliding window: grows with S up to W, then stays flat. Negative control: full attention keeps growing.
    assert acc.kv_cache_bytes(sliding, 3, 5) == acc.kv_cache_bytes(full, 3, 5)
    assert (
        acc.kv_cache_bytes(sliding, 3, 100)
        == acc.kv_cache_bytes(sliding, 3, W)
        == acc.kv_cache_bytes(full, 3, W)
    )
    assert acc.kv_cache_bytes(full, 3, 100) > acc.kv_cache_bytes(full, 3, W)
    # Hybrid (1 global layer of 4): a quarter of the full cache plus three quarters of the sliding one.
    hybrid = dataclasses.replace(sliding, layer_types=[SLIDING, SLIDING, FULL, SLIDING])
    expected = (acc.kv_cache_bytes(full, 3, 100) + 3 * acc.kv_cache_bytes(sliding, 3, 100)) / 4
    assert acc.kv_cache_bytes(hybrid, 3, 100) == expected
    # CLA: kv_share = 2 halves the cache; kv_share = 3 with L = 4 keeps ceil(4/3) = 2 owning layers.
    for share, owners in [(2, 2), (3, 2), (4, 1)]:
        cla = dataclasses.replace(full, kv_share=share)
        assert acc.kv_cache_bytes(cla, 3, 10) * 4 == acc.kv_cache_bytes(full, 3, 10) * owners
        assert acc.kv_cache_bytes_per_token(cla) * 4 == acc.kv_cache_bytes_per_token(full) * owners
        assert acc.kv_cache_layer_bytes(cla, 1, 3, 10) == 0  # layer 1 borrows layer 0's K/V


LIVE_VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=5, layer_types=[SLIDING, FULL, SLIDING, SLIDING]),
    "cla": dict(n_kv_heads=2, kv_share=2),
    "mla": dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, head_dim=12),
    "mla_q_lora": dict(
        kv_lora_rank=12, q_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, head_dim=12
    ),
}


@pytest.mark.parametrize("variant", list(LIVE_VARIANTS))
def test_live_cache_nbytes_equal_the_formula(variant):
    from cs336_inference.model import TransformerLM

    cfg = tiny(**LIVE_VARIANTS[variant])
    assert cfg.variant == variant.removesuffix("_q_lora")
    model = TransformerLM(cfg)
    B, S = 3, 16  # S > W for the sliding variants: the ring buffer holds W slots per layer
    cache = model.new_cache(B, S, dtype=torch.float32)
    assert cache.nbytes == acc.kv_cache_bytes(cfg, B, S, dtype_bytes=4)
    for i, store in enumerate(cache.layers):
        expected = acc.kv_cache_layer_bytes(cfg, i, B, S, dtype_bytes=4)
        assert (store.nbytes if store is not None else 0) == expected
    # Running tokens through the cache does not change its size (it is preallocated).
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (B, 6)), cache=cache)
    assert cache.nbytes == acc.kv_cache_bytes(cfg, B, S, dtype_bytes=4)


# --------------------------------------------------------- parameters, memory, latency
@pytest.mark.graded(problem="latency_throughput", points=3)
def test_lecture_llama2_13b_table():
    cfg = acc.llama2_13b()
    assert acc.num_params(cfg) == 13_015_449_600
    lecture = {  # B: (bytes, latency in ms or None, tokens/s)
        1: (26_869_760_000, 8.0208, 124.675),
        64: (79_717_990_400, 23.796, 2689.48),
        256: (240_779_264_000, None, 3561.77),
    }
    for B, (n_bytes, ms, tok_s) in lecture.items():
        assert acc.total_memory_bytes(cfg, B, S_LECTURE) == n_bytes
        if ms is not None:
            assert acc.decode_latency(cfg, B, S_LECTURE) * 1e3 == pytest.approx(ms, abs=5e-4)
        assert acc.decode_throughput(cfg, B, S_LECTURE) == pytest.approx(tok_s, abs=5e-3)
    assert acc.total_memory_bytes(cfg, 64, S_LECTURE) < 80e9 < acc.total_memory_bytes(cfg, 256, S_LECTURE)


@pytest.mark.graded(problem="latency_throughput", points=2)
def test_lecture_gqa_table():
    gqa = dataclasses.replace(acc.llama2_13b(), n_kv_heads=8)  # 1:5 grouping
    assert acc.total_memory_bytes(gqa, 64, S_LECTURE) == 33_412_874_240
    assert acc.decode_throughput(gqa, 64, S_LECTURE) == pytest.approx(6416.69, abs=5e-3)
    assert acc.total_memory_bytes(gqa, 256, S_LECTURE) == 65_625_128_960
    assert acc.decode_throughput(gqa, 256, S_LECTURE) == pytest.approx(13068.16, abs=5e-3)
    assert acc.total_memory_bytes(gqa, 256, S_LECTURE) < 80e9  # fits now


@pytest.mark.graded(problem="latency_throughput", points=1)
def test_max_batch_size_is_the_largest_that_fits():
    for cfg in (acc.llama2_13b(), dataclasses.replace(acc.llama2_13b(), n_kv_heads=8), acc.llama3_8b()):
        B = acc.max_batch_size(cfg, S_LECTURE, memory=80e9)
        assert (
            acc.total_memory_bytes(cfg, B, S_LECTURE) <= 80e9 < acc.total_memory_bytes(cfg, B + 1, S_LECTURE)
        )
    assert 64 <= acc.max_batch_size(acc.llama2_13b(), S_LECTURE) < 256  # the lecture: 64 fits, 256 does not
    assert acc.max_batch_size(acc.llama2_70b(), S_LECTURE) == 0  # 70B in bf16 alone exceeds 80 GB


def hf_param_count(hf_config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.graded(problem="latency_throughput", points=2)
def test_num_params_exact_matches_hugging_face():
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config

    def llama(cfg: ModelConfig):
        return LlamaConfig(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
            intermediate_size=cfg.d_ff, tie_word_embeddings=cfg.tie_embeddings,
        )  # fmt: skip

    for cfg in (acc.llama2_7b(), acc.llama2_13b(), acc.llama2_70b(), acc.llama3_8b(), acc.smollm2_135m()):
        assert acc.num_params(cfg, exact=True) == hf_param_count(llama(cfg))
    # Well-known totals: Llama-2-7B 6,738,415,616; SmolLM2-135M 134,515,008.
    assert acc.num_params(acc.llama2_7b(), exact=True) == 6_738_415_616
    assert acc.num_params(acc.smollm2_135m(), exact=True) == 134_515_008
    # The lecture's formula leaves out only the 2L + 1 norm vectors of length D.
    cfg = acc.llama2_13b()
    assert acc.num_params(cfg, exact=True) - acc.num_params(cfg) == (2 * 40 + 1) * 5120
    # Qwen2 puts a bias on q, k, v.
    qwen = tiny(n_kv_heads=2, qkv_bias=True)
    hf_qwen = Qwen2Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, tie_word_embeddings=False,
    )  # fmt: skip
    assert acc.num_params(qwen, exact=True) == hf_param_count(hf_qwen)
    # MLA with and without a low-rank query (DeepSeek-V3 layout, dense MLP in every layer).
    for q_lora in (None, 10):
        mla = tiny(**{**LIVE_VARIANTS["mla"], "q_lora_rank": q_lora})
        hf_mla = DeepseekV3Config(
            vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
            kv_lora_rank=12, q_lora_rank=q_lora, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
            first_k_dense_replace=4, tie_word_embeddings=False,
        )  # fmt: skip
        assert acc.num_params(mla, exact=True) == hf_param_count(hf_mla)


def test_live_model_parameter_count_and_forward_flops():
    from cs336_inference.model import TransformerLM

    for fields in (dict(n_kv_heads=2), dict(n_kv_heads=2, kv_share=2), dict(tie_embeddings=True)):
        cfg = tiny(**fields)
        model = TransformerLM(cfg)
        assert sum(p.numel() for p in model.parameters()) == acc.num_params(cfg, exact=True)
        B, S = 2, 9
        cache = model.new_cache(B, S + 1, dtype=torch.float32)
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (B, S)), cache=cache)
            step = torch.randint(0, cfg.vocab_size, (B, 1))
            flops = counted_flops(lambda m=model, x=step, c=cache: m(x, cache=c))
        assert flops == acc.forward_flops(cfg, B, 1, S + 1)  # the new token attends to S + 1 keys


def test_secondary_source_figures_do_not_follow_from_the_formula():
    cfg, gqa = acc.llama2_13b(), dataclasses.replace(acc.llama2_13b(), n_kv_heads=8)
    # "8.08 ms" at B=1: the formula gives 8.02 ms, and 8.08 ms contradicts the 124.6 tok/s quoted with it.
    assert acc.decode_latency(cfg, 1, S_LECTURE) * 1e3 == pytest.approx(8.02, abs=0.005)
    assert 1 / 8.08e-3 == pytest.approx(123.8, abs=0.05)
    # "130.6 GB, 16,584 tok/s" at GQA B=256: inconsistent with each other at 3.35e12 B/s.
    assert 256 / (130.6e9 / acc.H100_BANDWIDTH) == pytest.approx(6567, abs=1)
    assert 256 / 16584 * acc.H100_BANDWIDTH == pytest.approx(51.7e9, rel=1e-3)
    assert acc.total_memory_bytes(gqa, 256, S_LECTURE) / 1e9 == pytest.approx(65.6, abs=0.05)
    # "171.8 GB" for 70B, 64 x 32k tokens: exactly a quarter of the formula (640 GiB), i.e. 16 requests.
    kv = acc.kv_cache_bytes(acc.llama2_70b(), 64, 32768)
    assert acc.gib(kv) == 640
    assert kv / 4 / 1e9 == pytest.approx(171.8, abs=0.05)
    assert acc.kv_cache_bytes(acc.llama2_70b(), 16, 32768) == kv / 4


# ------------------------------------------------------------ speculative decoding
@pytest.mark.graded(problem="speculative_accounting", points=2)
def test_speculative_expected_tokens_matches_simulation():
    gen = torch.Generator().manual_seed(0)
    rounds = 200_000
    for alpha, k in [(0.8, 4), (0.5, 3), (0.95, 8)]:
        accept = torch.rand(rounds, k, generator=gen) < alpha
        # Drafts are kept up to the first rejection; the target always adds one token.
        kept = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        tokens = (kept + 1).double()
        stderr = tokens.std().item() / math.sqrt(rounds)
        expected = acc.speculative_expected_tokens(alpha, k)
        assert abs(tokens.mean().item() - expected) < 5 * stderr
        # Negative control: the lecture's k*alpha + 1 is far outside the simulation's error.
        assert abs(tokens.mean().item() - (k * alpha + 1)) > 20 * stderr
    assert acc.speculative_expected_tokens(1.0, 4) == 5  # perfect draft: k + 1
    assert acc.speculative_expected_tokens(0.0, 4) == 1  # useless draft: the target's own token


@pytest.mark.graded(problem="speculative_accounting", points=1)
def test_speculative_speedup():
    alpha, k, c = 0.8, 4, 0.11  # the lecture's example (8B draft, 70B target)
    tokens = sum(alpha**i for i in range(k + 1))
    assert acc.speculative_speedup(alpha, k, c) == pytest.approx(tokens / (1 + k * c))
    assert acc.speculative_speedup(alpha, k, c) == pytest.approx(2.334, abs=1e-3)  # not the lecture's 2.9
    assert acc.speculative_speedup(1.0, k, 0.0) == k + 1
    assert acc.speculative_speedup(0.0, k, c) < 1  # a draft that is always rejected only costs time


def test_draft_cost_ratio_and_presets():
    assert acc.draft_cost_ratio(acc.llama3_8b(), acc.llama2_70b()) == pytest.approx(0.11, abs=0.01)
    assert (
        acc.deepseek_v2().is_mla and acc.llama2_70b().variant == "gqa" and acc.llama2_13b().variant == "mha"
    )
    assert acc.preset("llama2-13b", n_kv_heads=8).n_kv_heads == 8
    with pytest.raises(ValueError, match="unknown preset"):
        acc.preset("gpt-5")


# ------------------------------------------------------------------- bytes per decode step
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("variant", list(LIVE_VARIANTS))
def test_decode_step_bytes_are_the_live_parameters_and_cache(variant, tie):
    from cs336_inference.model import TransformerLM

    cfg = tiny(**LIVE_VARIANTS[variant], tie_embeddings=tie)
    B, S = 2, 16
    for dtype in (torch.float32, torch.bfloat16):
        model = TransformerLM(cfg).to(dtype)
        params = list(model.parameters())
        weights = sum(p.nbytes for p in params)
        if not tie:  # the untied input embedding is a lookup of B rows, not read whole
            weights -= model.embed.weight.nbytes
        else:
            assert len(params) == len({p.data_ptr() for p in params})  # the tied matrix counted once
        cache = model.new_cache(B, S)
        got = acc.decode_step_bytes(model, B, S)
        assert got == weights + cache.nbytes, f"{variant} {dtype}: {got} != {weights} + {cache.nbytes}"
        assert acc.decode_weight_bytes(model) == weights
        # The config's formula agrees with the live model of the same dtype.
        assert acc.decode_step_bytes(cfg, B, S, dtype_bytes=dtype.itemsize) == got
    assert acc.decode_step_bytes(cfg, B, S) == acc.decode_step_bytes(cfg, B, S, dtype_bytes=2)

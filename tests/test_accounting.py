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
# A tiny MLA: query/key heads of nope 8 + rope 4 = 12 numbers, value heads of 6.
MLA_FIELDS = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6, head_dim=12)


def counted_flops(fn) -> int:
    """FLOPs torch's own counter sees when running fn (attention through the countable math path)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def tiny(**fields) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, d_ff=48, max_seq_len=64)
    return ModelConfig(**{**base, **fields})


def check(got, want, what: str) -> None:
    """Exact comparison with a message naming the call, the expected and the obtained value."""
    assert got == want, f"{what}: expected {want}, got {got}"


def check_close(got, want, what: str, rel: float = 1e-9, abs: float = 0.0) -> None:
    assert got == pytest.approx(want, rel=rel, abs=abs), f"{what}: expected {want}, got {got}"


# ------------------------------------------------------------------------ matmul
MATMUL_SHAPES = [(3, 40, 24), (1, 7, 5), (6, 1, 9)]
DTYPES = [(torch.bfloat16, 2), (torch.float32, 4), (torch.float64, 8)]


@pytest.mark.graded(problem="matmul_accounting", points=2)
@pytest.mark.costly(seconds=1)
def test_matmul_flops_and_bytes_match_torch():
    for B, D, F in MATMUL_SHAPES:
        for dtype, size in DTYPES:
            x, w = torch.randn(B, D, dtype=dtype), torch.randn(D, F, dtype=dtype)
            y = x @ w
            if dtype == torch.bfloat16:
                got = acc.matmul_flops(B, D, F)
                check(got, counted_flops(lambda x=x, w=w: x @ w), f"matmul_flops(B={B}, D={D}, F={F})")
            moved = x.nbytes + w.nbytes + y.nbytes  # read X and W, write Y
            check(
                acc.matmul_bytes(B, D, F, dtype_bytes=size),
                moved,
                f"matmul_bytes(B={B}, D={D}, F={F}, dtype_bytes={size})",
            )
    check(
        acc.matmul_bytes(3, 40, 24), 2 * (3 * 40 + 40 * 24 + 3 * 24), "matmul_bytes(3, 40, 24) (default bf16)"
    )


@pytest.mark.graded(problem="matmul_accounting", points=1)
def test_matmul_intensity_tends_to_B():
    # Hand computations: 2*2*3*4 = 48 FLOPs over 2*(6 + 12 + 8) = 52 bytes in bf16, 104 in float32.
    check_close(acc.matmul_intensity(2, 3, 4), 48 / 52, "matmul_intensity(B=2, D=3, F=4)")
    check_close(
        acc.matmul_intensity(2, 3, 4, dtype_bytes=4),
        48 / 104,
        "matmul_intensity(B=2, D=3, F=4, dtype_bytes=4)",
    )
    # Square: 2B^3 / (3 * 2B^2) = B/3 in bf16, B/6 in float32.
    check_close(acc.matmul_intensity(4096, 4096, 4096), 4096 / 3, "matmul_intensity(4096, 4096, 4096)")
    check_close(
        acc.matmul_intensity(4096, 4096, 4096, 4),
        4096 / 6,
        "matmul_intensity(4096, 4096, 4096, dtype_bytes=4)",
    )
    # B << D, F: the weight read dominates and the intensity approaches B from below.
    D = F = 16384
    for B in (1, 2, 8, 32, 128):
        got = acc.matmul_intensity(B, D, F)
        low = B * (1 - B * (1 / D + 1 / F))
        assert low < got < B, (
            f"matmul_intensity(B={B}, D={D}, F={F}): expected in ({low:.4f}, {B}), got {got}"
        )


@pytest.mark.graded(problem="matmul_accounting", points=1)
def test_h100_accelerator_intensity_is_295():
    got = acc.accelerator_intensity()
    check(round(got), 295, "round(accelerator_intensity()) for the H100 (989e12 / 3.35e12)")
    check_close(acc.accelerator_intensity(200e9, 40e9), 5.0, "accelerator_intensity(200e9 FLOP/s, 40e9 B/s)")


# ------------------------------------------------------------- MLP and attention
def swiglu(x, w_gate, w_up, w_down):
    return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
def test_mlp_counts_match_torch_and_the_lecture():
    for D, F, B, T in [(24, 40, 2, 3), (32, 48, 1, 1), (16, 8, 3, 5)]:
        cfg = tiny(d_model=D, d_ff=F)
        x = torch.randn(B, T, D)
        weights = torch.randn(D, F), torch.randn(D, F), torch.randn(F, D)
        want = counted_flops(lambda x=x, weights=weights: swiglu(x, *weights))  # 6BTDF
        check(acc.mlp_flops(cfg, B, T), want, f"mlp_flops(D={D}, F={F}, B={B}, T={T})")
        # The lecture's byte count, 4BTD + 4BTF + 6DF in bf16: read X, the three weights, write up
        # and gate [BT, F] and Y [BT, D]; with 4-byte numbers every term doubles.
        for size in (2, 4):
            want = size * (2 * B * T * D + 2 * B * T * F + 3 * D * F)
            check(
                acc.mlp_bytes(cfg, B, T, size),
                want,
                f"mlp_bytes(D={D}, F={F}, B={B}, T={T}, dtype_bytes={size})",
            )
        check_close(
            acc.mlp_intensity(cfg, B, T, dtype_bytes=4),
            6 * B * T * D * F / (4 * (2 * B * T * D + 2 * B * T * F + 3 * D * F)),
            f"mlp_intensity(D={D}, F={F}, B={B}, T={T}, dtype_bytes=4)",
        )
    # Intensity tends to B*T when B*T << D, F (Llama-2-13B): decode ~ B, prefill ~ B*S.
    big = acc.llama2_13b()
    for B, T in [(1, 1), (4, 1), (64, 1), (1, 16), (2, 64)]:
        got = acc.mlp_intensity(big, B, T)
        assert 0.9 * B * T < got < B * T, (
            f"mlp_intensity(llama2-13b, B={B}, T={T}): expected in (0.9BT, BT), got {got}"
        )


# Attention shapes: (N, K, H_qk, H_v). MHA with N*H = D; GQA whose N*H = 48 differs from D = 32 (so
# the lecture's "D" would be wrong); MLA's up-projected heads (nope 8 + rope 4 = 12, values 6).
ATTENTION_VARIANTS = {
    "mha": (dict(), (4, 4, 8, 8)),
    "gqa_wide_heads": (dict(n_kv_heads=2, head_dim=12), (4, 2, 12, 12)),
    "mla": (MLA_FIELDS, (4, 4, 12, 6)),
}


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
@pytest.mark.parametrize("variant", list(ATTENTION_VARIANTS))
def test_attention_counts_match_torch(variant):
    fields, (N, K, H_qk, H_v) = ATTENTION_VARIANTS[variant]
    cfg = tiny(**fields)
    B = 2
    for T, S in [(1, 9), (5, 5), (3, 11)]:
        case = f"{variant}: attention_flops(B={B}, T={T}, S={S})"
        q, k, v = torch.randn(B, N, T, H_qk), torch.randn(B, N, S, H_qk), torch.randn(B, N, S, H_v)
        run = lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
        check(acc.attention_flops(cfg, B, T, S), counted_flops(run), case)
        # Bytes: a fused kernel reads Q and the K/V heads as stored (K of them), and writes Y once.
        for dtype, size in DTYPES[:2]:
            q, k, v = (
                torch.randn(B, n, length, h, dtype=dtype)
                for n, length, h in [(N, T, H_qk), (K, S, H_qk), (K, S, H_v)]
            )
            y = torch.empty(B, N, T, H_v, dtype=dtype)
            want = q.nbytes + k.nbytes + v.nbytes + y.nbytes
            check(
                acc.attention_bytes(cfg, B, T, S, size),
                want,
                f"{variant}: attention_bytes(B={B}, T={T}, S={S}, dtype_bytes={size})",
            )
        if variant == "mha":  # the lecture's 4BSD + 4BTD bytes (bf16), intensity ST / (S + T)
            D = cfg.d_model
            check(
                acc.attention_bytes(cfg, B, T, S),
                4 * B * S * D + 4 * B * T * D,
                f"mha: attention_bytes(B={B}, T={T}, S={S})",
            )
            check_close(
                acc.attention_intensity(cfg, B, T, S),
                S * T / (S + T),
                f"mha: attention_intensity(B={B}, T={T}, S={S})",
            )


@pytest.mark.graded(problem="mlp_attention_accounting", points=2)
def test_decode_attention_intensity_below_one_for_every_S_and_batch():
    cfg = acc.llama2_13b()
    for S in [1, 2, 7, 100, 1024, 4096, 131072, 10**7]:
        one = acc.attention_intensity(cfg, 1, 1, S)
        check_close(one, S / (S + 1), f"attention_intensity(llama2-13b, B=1, T=1, S={S})")
        for B in (64, 1024):  # each sequence reads its own KV cache: batching does not help
            check_close(
                acc.attention_intensity(cfg, B, 1, S),
                one,
                f"attention_intensity(llama2-13b, B={B}, T=1, S={S})",
            )
    # Prefill (T = S) is S/2: well above the H100's 295 for a 4096-token prompt.
    check_close(
        acc.attention_intensity(cfg, 1, 4096, 4096), 2048, "attention_intensity(llama2-13b, B=1, T=S=4096)"
    )
    # GQA (K = 8 of N = 40) reads 5x less K/V: FLOPs 4BSTD over bytes 2(2BTD + 2BSD/5).
    gqa = dataclasses.replace(cfg, n_kv_heads=8)
    check_close(
        acc.attention_intensity(gqa, 1, 1, 4096),
        4 * 4096 / (4 + 4 * 4096 / 5),
        "attention_intensity(GQA K=8, B=1, T=1, S=4096)",
    )
    check_close(
        acc.attention_intensity(cfg, 2, 1, 4096, dtype_bytes=4),
        4096 / 4097 / 2,
        "attention_intensity(B=2, T=1, S=4096, dtype_bytes=4)",
    )


@pytest.mark.graded(problem="mlp_attention_accounting", points=1)
def test_prefill_is_compute_bound_and_decode_memory_bound():
    cfg, h100 = acc.llama2_13b(), 989e12 / 3.35e12  # the H100's FLOPs per byte, about 295
    cases = {  # (call, intensity, above the ridge?)
        "mlp_intensity(B=1, T=1024) (prefill)": (acc.mlp_intensity(cfg, 1, 1024), True),
        "attention_intensity(B=1, T=S=1024) (prefill)": (acc.attention_intensity(cfg, 1, 1024, 1024), True),
        "mlp_intensity(B=64, T=1) (decode)": (acc.mlp_intensity(cfg, 64, 1), False),
        "attention_intensity(B=64, T=1, S=1024) (decode)": (acc.attention_intensity(cfg, 64, 1, 1024), False),
    }
    for call, (got, compute_bound) in cases.items():
        assert (got > h100) == compute_bound, (
            f"llama2-13b {call}: expected {'above' if compute_bound else 'below'} the H100's 295 FLOPs/byte, got {got:.1f}"
        )


# ----------------------------------------------------------------------- KV cache
@pytest.mark.graded(problem="kv_cache_bytes", points=2)
def test_kv_cache_lecture_numbers_llama2_70b():
    cfg = acc.llama2_70b()  # L=80, K=8, H=128
    check(acc.kv_bytes_per_token_layer(cfg), 2 * 8 * 128 * 2, "kv_bytes_per_token_layer(llama2-70b)")
    check(acc.kv_cache_bytes_per_token(cfg), 2 * 80 * 8 * 128 * 2, "kv_cache_bytes_per_token(llama2-70b)")
    check(acc.kv_cache_bytes(cfg, 1, 4096), 1_342_177_280, "kv_cache_bytes(llama2-70b, B=1, S=4096)")
    check(
        acc.kv_cache_bytes(cfg, 1, 4096, dtype_bytes=1),
        671_088_640,
        "kv_cache_bytes(llama2-70b, B=1, S=4096, dtype_bytes=1)",
    )
    big = acc.kv_cache_bytes(cfg, 64, 32768)
    check(big, 687_194_767_360, "kv_cache_bytes(llama2-70b, B=64, S=32768)")
    check(round(big / 140e9, 1), 4.9, "kv_cache_bytes(llama2-70b, 64, 32768) / 140 GB of weights")


@pytest.mark.graded(problem="kv_cache_bytes", points=1)
def test_mla_576_dims_per_token_vs_mha_8192():
    mla = acc.deepseek_v2()
    check(
        acc.kv_bytes_per_token_layer(mla, dtype_bytes=1),
        512 + 64,
        "kv_bytes_per_token_layer(deepseek-v2, dtype_bytes=1)",
    )
    check(
        acc.kv_cache_bytes_per_token(mla, dtype_bytes=2),
        60 * 576 * 2,
        "kv_cache_bytes_per_token(deepseek-v2)",
    )
    check(
        acc.kv_cache_bytes(mla, 3, 100, dtype_bytes=4),
        3 * 100 * 60 * 576 * 4,
        "kv_cache_bytes(deepseek-v2, B=3, S=100, dtype_bytes=4)",
    )
    mha = dataclasses.replace(acc.llama2_70b(), n_kv_heads=64)  # N = K = 64, H = 128
    per_kv = mha.n_kv_heads * mha.head_dim
    # The lecture's "14x": 8192 key dims vs 576 latent dims (a property of the configs, not of your code).
    assert per_kv == 8192 and round(per_kv / 576, 1) == 14.2, f"MHA has {per_kv} key dims per token and layer"
    # The MHA cache holds keys AND values, 2 x 8192 numbers per token and layer, so per byte the
    # reduction is twice the lecture's ratio.
    ratio = acc.kv_bytes_per_token_layer(mha) / acc.kv_bytes_per_token_layer(mla)
    check_close(
        ratio, 2 * 8192 / 576, "kv_bytes_per_token_layer(MHA 64x128) / kv_bytes_per_token_layer(deepseek-v2)"
    )


@pytest.mark.graded(problem="kv_cache_bytes", points=2)
@pytest.mark.costly(seconds=1.5)
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
        check(
            acc.kv_cache_bytes(cfg, B, S, dtype_bytes=4),
            hf_bytes,
            f"kv_cache_bytes(K={K}, B={B}, S={S}, dtype_bytes=4) vs Hugging Face's float32 cache",
        )
        layer0 = cache.layers[0].keys.nbytes * 2
        check(
            acc.kv_cache_layer_bytes(cfg, 0, B, S, 4),
            layer0,
            f"kv_cache_layer_bytes(K={K}, layer 0, B={B}, S={S}, dtype_bytes=4)",
        )


@pytest.mark.graded(problem="kv_cache_bytes", points=2)
def test_sliding_cla_and_hybrid_kv_bytes():
    full, W = tiny(n_kv_heads=2), 8  # 2*K*H = 32 numbers per token and layer, 64 bytes in bf16
    sliding = dataclasses.replace(full, sliding_window=W)
    # Sliding window: grows with S up to W, then stays flat (B = 3, L = 4).
    check(acc.kv_cache_bytes(sliding, 3, 5), 3 * 5 * 4 * 64, "kv_cache_bytes(sliding W=8, B=3, S=5)")
    check(acc.kv_cache_bytes(sliding, 3, 100), 3 * 8 * 4 * 64, "kv_cache_bytes(sliding W=8, B=3, S=100)")
    check(
        acc.kv_cache_layer_bytes(sliding, 2, 3, 100),
        3 * 8 * 64,
        "kv_cache_layer_bytes(sliding W=8, layer 2, B=3, S=100)",
    )
    check(acc.kv_cache_bytes(full, 3, 100), 3 * 100 * 4 * 64, "kv_cache_bytes(full attention, B=3, S=100)")
    # Hybrid (layer 2 global): one layer keeps all 100 tokens, three keep 8.
    hybrid = dataclasses.replace(sliding, layer_types=[SLIDING, SLIDING, FULL, SLIDING])
    check(
        acc.kv_cache_bytes(hybrid, 3, 100),
        3 * (100 + 3 * 8) * 64,
        "kv_cache_bytes(hybrid S,S,F,S, W=8, B=3, S=100)",
    )
    check(
        acc.kv_cache_layer_bytes(hybrid, 2, 3, 100),
        3 * 100 * 64,
        "kv_cache_layer_bytes(hybrid, global layer 2, B=3, S=100)",
    )
    # CLA: kv_share = 2 halves the cache; kv_share = 3 with L = 4 keeps ceil(4/3) = 2 owning layers (0, 3).
    for share, owners in [(2, 2), (3, 2), (4, 1)]:
        cla = dataclasses.replace(full, kv_share=share)
        check(
            acc.kv_cache_bytes(cla, 3, 10),
            3 * 10 * owners * 64,
            f"kv_cache_bytes(CLA kv_share={share}, L=4, B=3, S=10)",
        )
        check(
            acc.kv_cache_bytes_per_token(cla),
            owners * 64,
            f"kv_cache_bytes_per_token(CLA kv_share={share}, L=4)",
        )
        check(
            acc.kv_cache_layer_bytes(cla, 1, 3, 10),
            0,
            f"kv_cache_layer_bytes(CLA kv_share={share}, layer 1 borrows layer 0)",
        )


LIVE_VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=5, layer_types=[SLIDING, FULL, SLIDING, SLIDING]),
    "cla": dict(n_kv_heads=2, kv_share=2),
    "mla": MLA_FIELDS,
    "mla_q_lora": dict(MLA_FIELDS, q_lora_rank=10),
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
    check(acc.num_params(cfg), 13_015_449_600, "num_params(llama2-13b)")
    lecture = {  # B: (bytes, latency in ms or None, tokens/s)
        1: (26_869_760_000, 8.0208, 124.675),
        64: (79_717_990_400, 23.796, 2689.48),
        256: (240_779_264_000, None, 3561.77),
    }
    for B, (n_bytes, ms, tok_s) in lecture.items():
        check(
            acc.total_memory_bytes(cfg, B, S_LECTURE),
            n_bytes,
            f"total_memory_bytes(llama2-13b, B={B}, S=1024)",
        )
        if ms is not None:
            got = acc.decode_latency(cfg, B, S_LECTURE) * 1e3
            check_close(got, ms, f"decode_latency(llama2-13b, B={B}, S=1024) in ms", abs=5e-4)
        got = acc.decode_throughput(cfg, B, S_LECTURE)
        check_close(got, tok_s, f"decode_throughput(llama2-13b, B={B}, S=1024) in tokens/s", abs=5e-3)


@pytest.mark.graded(problem="latency_throughput", points=1)
def test_lecture_gqa_table():
    gqa = dataclasses.replace(acc.llama2_13b(), n_kv_heads=8)  # 1:5 grouping
    for B, n_bytes, tok_s in [(64, 33_412_874_240, 6416.69), (256, 65_625_128_960, 13068.16)]:
        check(
            acc.total_memory_bytes(gqa, B, S_LECTURE),
            n_bytes,
            f"total_memory_bytes(llama2-13b GQA K=8, B={B}, S=1024)",
        )
        got = acc.decode_throughput(gqa, B, S_LECTURE)
        check_close(got, tok_s, f"decode_throughput(llama2-13b GQA K=8, B={B}, S=1024)", abs=5e-3)


@pytest.mark.graded(problem="latency_throughput", points=1)
def test_dtype_and_bandwidth_arguments_are_used():
    cfg = acc.llama2_13b()
    # int8 weights and cache: 13,015,449,600 one-byte weights + 2*40*40*128 bytes per token x 1024 x 64.
    want = 13_015_449_600 + 2 * 40 * 40 * 128 * 1024 * 64
    check(
        acc.total_memory_bytes(cfg, 64, S_LECTURE, dtype_bytes=1),
        want,
        "total_memory_bytes(llama2-13b, B=64, S=1024, dtype_bytes=1)",
    )
    check_close(
        acc.decode_latency(cfg, 1, S_LECTURE, bandwidth=1e12),
        26_869_760_000 / 1e12,
        "decode_latency(llama2-13b, B=1, S=1024, bandwidth=1e12)",
    )
    check_close(
        acc.decode_throughput(cfg, 64, S_LECTURE, bandwidth=2e12, dtype_bytes=4),
        64 / (2 * 79_717_990_400 / 2e12),
        "decode_throughput(llama2-13b, B=64, S=1024, bandwidth=2e12, dtype_bytes=4)",
    )
    # float32 (4 bytes): 52,061,798,400 bytes of weights leave 27,938,201,600 of 80e9 for caches of
    # 2*40*40*128*1024*4 = 1,677,721,600 bytes per sequence: 16 sequences.
    check(
        acc.max_batch_size(cfg, S_LECTURE, memory=80e9, dtype_bytes=4),
        16,
        "max_batch_size(llama2-13b, S=1024, 80 GB, dtype_bytes=4)",
    )


@pytest.mark.graded(problem="latency_throughput", points=1)
def test_max_batch_size_is_the_largest_that_fits():
    gqa = dataclasses.replace(acc.llama2_13b(), n_kv_heads=8)
    for name, cfg in [
        ("llama2-13b", acc.llama2_13b()),
        ("llama2-13b GQA K=8", gqa),
        ("llama3-8b", acc.llama3_8b()),
    ]:
        B = acc.max_batch_size(cfg, S_LECTURE, memory=80e9)
        fits, next_one = (
            acc.total_memory_bytes(cfg, B, S_LECTURE),
            acc.total_memory_bytes(cfg, B + 1, S_LECTURE),
        )
        assert fits <= 80e9 < next_one, (
            f"max_batch_size({name}, S=1024, 80 GB) = {B}: expected B bytes <= 80e9 < B+1 bytes, got "
            f"{fits:,} and {next_one:,}"
        )
    # Hand computation: (80e9 - 26,030,899,200) / (2*40*40*128*1024*2 = 838,860,800) = 64.3; GQA: 341.
    check(acc.max_batch_size(acc.llama2_13b(), S_LECTURE), 64, "max_batch_size(llama2-13b, S=1024)")
    check(acc.max_batch_size(gqa, S_LECTURE), 341, "max_batch_size(llama2-13b GQA K=8, S=1024)")
    check(
        acc.max_batch_size(acc.llama2_70b(), S_LECTURE),
        0,
        "max_batch_size(llama2-70b, S=1024): 140 GB of weights alone",
    )


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

    for name in ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "smollm2-135m"):
        cfg = acc.preset(name)
        check(
            acc.num_params(cfg, exact=True),
            hf_param_count(llama(cfg)),
            f"num_params({name}, exact=True) vs Hugging Face",
        )
    # Well-known totals: Llama-2-7B 6,738,415,616; SmolLM2-135M 134,515,008.
    check(acc.num_params(acc.llama2_7b(), exact=True), 6_738_415_616, "num_params(llama2-7b, exact=True)")
    check(acc.num_params(acc.smollm2_135m(), exact=True), 134_515_008, "num_params(smollm2-135m, exact=True)")
    # The lecture's formula leaves out only the 2L + 1 norm vectors of length D.
    check(acc.num_params(acc.llama2_13b()), 13_015_449_600, "num_params(llama2-13b)")
    # Qwen2 puts a bias on q, k, v.
    qwen = tiny(n_kv_heads=2, qkv_bias=True)
    hf_qwen = Qwen2Config(
        vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, tie_word_embeddings=False,
    )  # fmt: skip
    check(
        acc.num_params(qwen, exact=True),
        hf_param_count(hf_qwen),
        "num_params(tiny GQA with qkv bias, exact=True) vs Qwen2",
    )
    # MLA with and without a low-rank query (DeepSeek-V3 layout, dense MLP in every layer).
    for q_lora in (None, 10):
        mla = tiny(**{**MLA_FIELDS, "q_lora_rank": q_lora})
        hf_mla = DeepseekV3Config(
            vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
            kv_lora_rank=12, q_lora_rank=q_lora, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6,
            first_k_dense_replace=4, tie_word_embeddings=False,
        )  # fmt: skip
        check(
            acc.num_params(mla, exact=True),
            hf_param_count(hf_mla),
            f"num_params(tiny MLA q_lora_rank={q_lora}, exact=True) vs DeepSeek-V3",
        )
    # CLA (no Hugging Face model has it), by hand for V=97, D=32, L=4, N=4, K=2, H=8, F=48, kv_share=2:
    # embeddings 2*97*32 = 6208; per layer 3DF = 4608 and Q, O 2*32*32 = 2048; K, V 2*32*16 = 1024 in
    # the owning layers 0 and 2 only: 6208 + 4*(4608 + 2048) + 2*1024 = 34,880.
    check(
        acc.num_params(tiny(n_kv_heads=2, kv_share=2)), 34_880, "num_params(tiny GQA K=2 with CLA kv_share=2)"
    )


def test_live_model_parameter_count_and_forward_flops():
    from cs336_inference.attention import MLA
    from cs336_inference.model import TransformerLM

    variants = [
        dict(n_kv_heads=2),
        dict(n_kv_heads=2, kv_share=2),
        dict(tie_embeddings=True),
        MLA_FIELDS,
        dict(MLA_FIELDS, q_lora_rank=10),
    ]
    for fields in variants:
        cfg = tiny(**fields)
        model = TransformerLM(cfg)
        for module in model.modules():
            if isinstance(module, MLA):
                module.absorb = False  # forward_flops counts MLA's up-projected path
        live = sum(p.numel() for p in model.parameters())
        check(
            acc.num_params(cfg, exact=True), live, f"{cfg.variant}: num_params(exact=True) vs the live model"
        )
        B, S = 2, 9
        cache = model.new_cache(B, S + 1, dtype=torch.float32)
        prompt, step = torch.randint(0, cfg.vocab_size, (B, S)), torch.randint(0, cfg.vocab_size, (B, 1))
        with torch.no_grad():
            prefill = counted_flops(lambda m=model, x=prompt, c=cache: m(x, cache=c))
            decode = counted_flops(lambda m=model, x=step, c=cache: m(x, cache=c))
        check(
            acc.forward_flops(cfg, B, S, S),
            prefill,
            f"{cfg.variant}: forward_flops(B={B}, T=S={S}) (prefill)",
        )
        # The new token attends to S + 1 keys.
        check(
            acc.forward_flops(cfg, B, 1, S + 1),
            decode,
            f"{cfg.variant}: forward_flops(B={B}, T=1, S={S + 1}) (decode)",
        )


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
    for alpha, k in [(0.8, 4), (0.5, 3), (0.95, 8), (0.3, 1)]:
        accept = torch.rand(rounds, k, generator=gen) < alpha
        # Drafts are kept up to the first rejection; the target always adds one token.
        kept = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
        tokens = (kept + 1).double()
        mean, stderr = tokens.mean().item(), tokens.std().item() / math.sqrt(rounds)
        got = acc.speculative_expected_tokens(alpha, k)
        assert abs(mean - got) < 5 * stderr, (
            f"speculative_expected_tokens(alpha={alpha}, k={k}): a simulation of {rounds} rounds gives "
            f"{mean:.4f} +- {stderr:.4f}, got {got}"
        )
        # Negative control: the lecture's k*alpha + 1 is far outside the simulation's error.
        if k > 1:
            assert abs(mean - (k * alpha + 1)) > 20 * stderr, (
                f"simulation cannot tell k*alpha + 1 (alpha={alpha}, k={k})"
            )
    check(
        acc.speculative_expected_tokens(1.0, 4),
        5,
        "speculative_expected_tokens(alpha=1, k=4): every draft kept",
    )
    check(
        acc.speculative_expected_tokens(0.0, 4),
        1,
        "speculative_expected_tokens(alpha=0, k=4): the target's own token",
    )
    check(
        acc.speculative_expected_tokens(0.5, 0), 1, "speculative_expected_tokens(alpha=0.5, k=0): no drafts"
    )


@pytest.mark.graded(problem="speculative_accounting", points=1)
def test_speculative_speedup():
    # The lecture's example (8B draft, 70B target): (1 + .8 + .64 + .512 + .4096) / (1 + 4 * 0.11)
    # = 3.3616 / 1.44 = 2.3344, not the lecture's 2.9.
    check_close(
        acc.speculative_speedup(0.8, 4, 0.11),
        3.3616 / 1.44,
        "speculative_speedup(alpha=0.8, k=4, cost_ratio=0.11)",
    )
    check_close(
        acc.speculative_speedup(0.5, 2, 0.25),
        1.75 / 1.5,
        "speculative_speedup(alpha=0.5, k=2, cost_ratio=0.25)",
    )
    check(acc.speculative_speedup(1.0, 4, 0.0), 5, "speculative_speedup(alpha=1, k=4, free draft)")
    got = acc.speculative_speedup(0.0, 4, 0.11)
    check_close(
        got, 1 / 1.44, "speculative_speedup(alpha=0, k=4, cost_ratio=0.11): a draft that is always rejected"
    )


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

"""The lecture's accounting: FLOPs, bytes, arithmetic intensity, KV-cache size, latency, throughput.

Everything here is a formula on a `ModelConfig` (or on matmul sizes, or on the parameter sizes of a
live model); nothing runs a model. The notation is the lecture's: B batch, T query tokens of this
pass (prefill T = S, decode T = 1), S key/value tokens, D d_model, F d_ff, N query heads, K key/value
heads, H head dim, L layers, V vocab.

The central claim, derived from these counts:

* A matmul [B, D] x [D, F] does 2BDF FLOPs and moves 2BD + 2DF + 2BF bytes (bf16). When B << D, F
  the weight read 2DF dominates and the intensity FLOPs/bytes tends to B.
* An H100 does 989e12 FLOP/s and reads 3.35e12 B/s: 295 FLOPs per byte. A kernel below that
  intensity waits on memory.
* Prefill processes B*S tokens at once (intensity ~ B*S in the MLP, S/2 in attention): compute-bound.
  Decode processes B tokens (MLP intensity ~ B) and attention reads every sequence's own KV cache
  (intensity S/(S+1) < 1 however large B is): memory-bound.
* Hence decode time per step = bytes read (weights + KV cache) / bandwidth, throughput = B / time.

The lecture's Llama-2-13B example on an H100 (S = 1024, bf16, 3.35e12 B/s) follows exactly from
`num_params`, `total_memory_bytes`, `decode_latency` and `decode_throughput` below:

    B=1     26,869,760,000 bytes   8.0208 ms   124.675 tok/s
    B=64    79,717,990,400 bytes  23.796 ms   2689.48 tok/s
    B=256  240,779,264,000 bytes  71.874 ms   3561.77 tok/s   (does not fit in 80 GB)
    GQA K=8, B=64    33,412,874,240 bytes   6416.69 tok/s
    GQA K=8, B=256   65,625,128,960 bytes  13068.16 tok/s   (fits)

Some write-ups of the lecture quote other figures. They do not follow from the formula:

* "8.08 ms" at B=1: the formula gives 26.87e9 / 3.35e12 = 8.0208 ms. The same write-up gives
  124.6 tok/s, which is 1 / 8.02 ms; 1 / 8.08 ms would be 123.8 tok/s, so 8.08 disagrees with
  its own throughput (the same source's "70.07 ms" at B=256 likewise disagrees with its
  3561.7 tok/s, which needs 71.87 ms).
* "130.6 GB, 16,584 tok/s" for GQA K=8 at B=256: the two cannot both hold at 3.35e12 B/s, since
  256 sequences reading 130.6 GB per step give 6,567 tok/s, and 16,584 tok/s needs 51.7 GB per
  step; and 130.6 GB would not fit in the 80 GB it is said to fit in. The formula gives 65.6 GB
  and 13,068 tok/s (the weights shrink too: K=8 leaves 11,337,728,000 parameters).
* "171.8 GB" for Llama-2-70B with 64 requests of 32,768 tokens: the formula gives
  2*80*8*128*32768*64*2 = 687,194,767,360 bytes = 687.2 GB (exactly 640 GiB), 4.9x the 140 GB of
  weights. 171.8 GB is exactly a quarter of that (160 GiB), what 16 requests (or 8,192 tokens)
  would need; it is not a GB-vs-GiB slip, since 687.2 GB is 640 GiB, not 171.8 GiB. The same
  write-up's own product, 1.34 GB x 64 x (32768 / 4096), is 686 GB, not 172 GB.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from cs336_inference.config import ModelConfig

if TYPE_CHECKING:  # only for annotations: accounting needs no model
    from cs336_inference.model import TransformerLM

# The lecture's accelerator: an H100 SXM (dense bf16 FLOP/s, HBM bytes per second, memory).
H100_FLOPS = 989e12
H100_BANDWIDTH = 3.35e12
H100_MEMORY = 80e9  # the lecture's "80 GB" (the card's 80 GiB would be 85.9e9 bytes)


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


# --------------------------------------------------------------------------- matmul
def matmul_flops(B: int, D: int, F: int) -> int:
    """FLOPs of X [B, D] @ W [D, F]: B*F dot products of length D, 2 FLOPs (multiply, add) each."""
    # BEGIN SOLUTION matmul_accounting
    return 2 * B * D * F
    # END SOLUTION


def matmul_bytes(B: int, D: int, F: int, dtype_bytes: int = 2) -> int:
    """Bytes moved to and from memory by X [B, D] @ W [D, F]: read X and W, write Y [B, F].

    With bf16 (2 bytes): 2BD + 2DF + 2BF.
    """
    # BEGIN SOLUTION matmul_accounting
    return dtype_bytes * (B * D + D * F + B * F)
    # END SOLUTION


def matmul_intensity(B: int, D: int, F: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of the matmul; tends to B (bf16) when B << D, F (the weight read dominates)."""
    # BEGIN SOLUTION matmul_accounting
    return matmul_flops(B, D, F) / matmul_bytes(B, D, F, dtype_bytes)
    # END SOLUTION


def accelerator_intensity(flops_per_second: float = H100_FLOPS, bandwidth: float = H100_BANDWIDTH) -> float:
    """FLOPs the accelerator can do per byte it reads (H100: 989e12 / 3.35e12, about 295).

    A kernel whose intensity is below this is memory-bound; above it, compute-bound.
    """
    # BEGIN SOLUTION matmul_accounting
    return flops_per_second / bandwidth
    # END SOLUTION


# ------------------------------------------------------------------ MLP and attention
def mlp_flops(cfg: ModelConfig, B: int, T: int) -> int:
    """FLOPs of one SwiGLU MLP on B*T tokens: three [D, F] matmuls, 6BTDF."""
    # BEGIN SOLUTION mlp_attention_accounting
    return 3 * 2 * B * T * cfg.d_model * cfg.d_ff
    # END SOLUTION


def mlp_bytes(cfg: ModelConfig, B: int, T: int, dtype_bytes: int = 2) -> int:
    """Bytes of one SwiGLU MLP, counted as the lecture does (bf16: 4BTD + 4BTF + 6DF).

    Read X [BT, D] once and the three weights (3DF); write the up and gate activations (2 x BTF)
    and the output Y [BT, D]. The down projection's read of act(gate) * up is taken as fused
    with the writes and not counted.
    """
    # BEGIN SOLUTION mlp_attention_accounting
    D, F = cfg.d_model, cfg.d_ff
    read_x, weights, up_and_gate, write_y = B * T * D, 3 * D * F, 2 * B * T * F, B * T * D
    return dtype_bytes * (read_x + weights + up_and_gate + write_y)
    # END SOLUTION


def mlp_intensity(cfg: ModelConfig, B: int, T: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of the MLP; tends to B*T (bf16) when B*T << D, F.

    Prefill (T = S): B*S, compute-bound once B*S passes the accelerator intensity.
    Decode (T = 1): B, so only many concurrent requests make it compute-bound.
    """
    # BEGIN SOLUTION mlp_attention_accounting
    return mlp_flops(cfg, B, T) / mlp_bytes(cfg, B, T, dtype_bytes)
    # END SOLUTION


def attention_flops(cfg: ModelConfig, B: int, T: int, S: int) -> int:
    """FLOPs of one layer's attention core (T queries against S keys, per sequence): 4BSTD for MHA.

    Returns scores + weighted sum: Q K^T costs 2*B*S*T*N*H_qk and A V costs 2*B*S*T*N*H_v, where
    H_qk is the query/key head dim and H_v the value head dim. MHA/GQA/MQA: both are H, and with
    N*H = D that is the lecture's 4BSTD. MLA (on its up-projected path): H_qk =
    qk_nope_head_dim + qk_rope_head_dim, H_v = v_head_dim. (The Q/K/V/O projections are matmuls,
    counted by `matmul_flops`.)
    """
    # BEGIN SOLUTION mlp_attention_accounting
    N = cfg.n_heads
    if cfg.is_mla:
        H_qk, H_v = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        H_qk = H_v = cfg.head_dim
    scores, weighted_sum = 2 * B * S * T * N * H_qk, 2 * B * S * T * N * H_v
    return scores + weighted_sum
    # END SOLUTION


def attention_bytes(cfg: ModelConfig, B: int, T: int, S: int, dtype_bytes: int = 2) -> int:
    """Bytes of one layer's attention core with a fused (FlashAttention-style) kernel.

    Returns the bytes of reading Q [B, T, N*H] and K, V [B, S, K*H] once and writing Y [B, T, N*H]
    once. For MHA (K*H = N*H = D) this is the lecture's 4BSD + 4BTD (bf16). With GQA the K/V reads
    shrink by N/K. MLA (up-projected path, K = N heads): Q and K have H_qk = qk_nope_head_dim +
    qk_rope_head_dim per head, V and Y have H_v = v_head_dim.
    """
    # BEGIN SOLUTION mlp_attention_accounting
    N, K = cfg.n_heads, cfg.n_kv_heads
    if cfg.is_mla:
        K, H_qk, H_v = N, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    else:
        H_qk = H_v = cfg.head_dim
    read_q, read_k, read_v, write_y = B * T * N * H_qk, B * S * K * H_qk, B * S * K * H_v, B * T * N * H_v
    return dtype_bytes * (read_q + read_k + read_v + write_y)
    # END SOLUTION


def attention_intensity(cfg: ModelConfig, B: int, T: int, S: int, dtype_bytes: int = 2) -> float:
    """FLOPs per byte of attention; for MHA in bf16 exactly S*T / (S + T), independent of B.

    Prefill (T = S): S/2. Decode (T = 1): S/(S+1) < 1 for every S: each sequence reads its own
    KV cache, so batching does not help. (GQA raises it, but below N/K.)
    """
    # BEGIN SOLUTION mlp_attention_accounting
    return attention_flops(cfg, B, T, S) / attention_bytes(cfg, B, T, S, dtype_bytes)
    # END SOLUTION


# -------------------------------------------------------------------- parameters
def num_params(cfg: ModelConfig, exact: bool = False) -> int:
    """Parameter count with the lecture's formula: 2VD + L * (attention + 3DF).

    Attention (MHA/GQA/MQA): Q and O are D x NH, K and V are D x KH: 2DNH + 2DKH per layer. CLA
    layers that borrow another layer's K/V have no K/V projections. MLA: the low-rank query
    (D x q_lora_rank, q_lora_rank x N(nope+rope)) or a plain D x N(nope+rope) one, the down
    projection D x (kv_lora_rank + rope), the up projection kv_lora_rank x N(nope+v), and O.
    Tied embeddings count V*D once. The lecture leaves out the norm weights and biases; exact=True
    adds them (RMSNorm weights, q/k/v biases), giving the count torch reports for the model.
    """
    # BEGIN SOLUTION latency_throughput
    D, F, N, K, H, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size
    total = V * D if cfg.tie_embeddings else 2 * V * D
    if exact:
        total += D  # final norm
    for layer in range(cfg.n_layers):
        total += 3 * D * F  # gate, up, down
        if exact:
            total += 2 * D  # attention and MLP norms
        if cfg.is_mla:
            r, rope, nope, Hv = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
            if cfg.q_lora_rank:
                total += D * cfg.q_lora_rank + cfg.q_lora_rank * N * (nope + rope)
                total += cfg.q_lora_rank if exact else 0  # q_a_norm
            else:
                total += D * N * (nope + rope)
            total += D * (r + rope) + r * N * (nope + Hv) + N * Hv * D
            total += r if exact else 0  # kv_a_norm
            continue
        owns_kv = cfg.kv_owner(layer) == layer
        total += 2 * D * N * H + (2 * D * K * H if owns_kv else 0)
        if exact and cfg.qkv_bias:
            total += N * H + (2 * K * H if owns_kv else 0)
    return total
    # END SOLUTION


# ----------------------------------------------------------------------- KV cache
def kv_bytes_per_token_layer(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes one token occupies in one K/V-owning layer's cache.

    MHA/GQA/MQA: a key and a value for each of the K kv heads, 2*K*H values. MLA: the latent
    c_kv and the shared rotary key, kv_lora_rank + qk_rope_head_dim values for all heads.
    DeepSeek-V2: 512 + 64 = 576 values, against N*H = 64 x 128 = 8192 in the lecture's MHA
    comparison (14.2x; that counts the keys only, with the values MHA holds 16384, 28.4x).
    """
    # BEGIN SOLUTION kv_cache_bytes
    if cfg.is_mla:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes
    return 2 * cfg.n_kv_heads * cfg.head_dim * dtype_bytes
    # END SOLUTION


def kv_cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to the cache across all layers (before any sliding window fills).

    MHA/GQA/MQA: 2*L*K*H*dtype_bytes. MLA: L*(kv_lora_rank + qk_rope_head_dim)*dtype_bytes.
    CLA: only the ceil(L / kv_share) layers that own K/V store anything.
    """
    # BEGIN SOLUTION kv_cache_bytes
    owners = sum(1 for layer in range(cfg.n_layers) if cfg.kv_owner(layer) == layer)
    return owners * kv_bytes_per_token_layer(cfg, dtype_bytes)
    # END SOLUTION


def kv_cache_layer_bytes(cfg: ModelConfig, layer: int, B: int, S: int, dtype_bytes: int = 2) -> int:
    """Bytes of one layer's cache for B sequences of S tokens.

    0 for a CLA layer that reads another layer's K/V. A sliding-window layer keeps min(S, W) tokens
    (a ring buffer), a full-attention layer all S. A CLA group stores what its owning layer needs.
    """
    # BEGIN SOLUTION kv_cache_bytes
    if not 0 <= layer < cfg.n_layers:
        raise ValueError(f"layer {layer} out of range for n_layers={cfg.n_layers}")
    if cfg.kv_owner(layer) != layer:
        return 0
    window = cfg.layer_window(layer)
    tokens = S if window is None else min(S, window)
    return B * tokens * kv_bytes_per_token_layer(cfg, dtype_bytes)
    # END SOLUTION


def kv_cache_bytes(cfg: ModelConfig, B: int, S: int, dtype_bytes: int = 2) -> int:
    """Bytes of the whole KV cache for B sequences of S tokens: the sum over layers.

    Full attention everywhere: B * S * kv_cache_bytes_per_token (the lecture's 2*L*K*H*S*B*2 for
    MHA/GQA in bf16). Sliding layers cap at the window; hybrid stacks mix the two.
    """
    # BEGIN SOLUTION kv_cache_bytes
    return sum(kv_cache_layer_bytes(cfg, layer, B, S, dtype_bytes) for layer in range(cfg.n_layers))
    # END SOLUTION


# ---------------------------------------------------------- memory, latency, throughput
def total_memory_bytes(cfg: ModelConfig, B: int, S: int, dtype_bytes: int = 2) -> int:
    """Bytes held (and read every decode step): the weights plus B sequences' KV caches of S tokens."""
    # BEGIN SOLUTION latency_throughput
    return dtype_bytes * num_params(cfg) + kv_cache_bytes(cfg, B, S, dtype_bytes)
    # END SOLUTION


def decode_latency(
    cfg: ModelConfig, B: int, S: int, bandwidth: float = H100_BANDWIDTH, dtype_bytes: int = 2
) -> float:
    """Seconds per decode step when memory-bound: every step reads all weights and KV caches once.

    The lecture's idealisation: compute fully overlaps the reads, so latency = bytes / bandwidth.
    """
    # BEGIN SOLUTION latency_throughput
    _check_positive(bandwidth=bandwidth)
    return total_memory_bytes(cfg, B, S, dtype_bytes) / bandwidth
    # END SOLUTION


def decode_throughput(
    cfg: ModelConfig, B: int, S: int, bandwidth: float = H100_BANDWIDTH, dtype_bytes: int = 2
) -> float:
    """Tokens per second over the batch: each step yields B tokens, so B / latency."""
    # BEGIN SOLUTION latency_throughput
    return B / decode_latency(cfg, B, S, bandwidth, dtype_bytes)
    # END SOLUTION


def max_batch_size(cfg: ModelConfig, S: int, memory: float = H100_MEMORY, dtype_bytes: int = 2) -> int:
    """The largest B whose weights plus KV caches of S tokens fit in `memory` bytes (0: none fits)."""
    # BEGIN SOLUTION latency_throughput
    free = memory - dtype_bytes * num_params(cfg)
    per_sequence = kv_cache_bytes(cfg, 1, S, dtype_bytes)
    if free < 0:
        return 0
    return int(free // per_sequence)
    # END SOLUTION


def forward_flops(cfg: ModelConfig, B: int, T: int, S: int) -> int:
    """Matmul FLOPs of one forward pass of T new tokens per sequence attending to S tokens.

    2 FLOPs per weight per token for every matrix (all linears and the unembedding; the input
    embedding is a lookup), plus every layer's attention core over min(S, W) keys. MLA is counted
    on its up-projected (non-absorbed) path: the up projection W_UKV (kv_lora_rank x N(nope + v))
    runs on all S cached latents, not only the T new tokens.
    """
    matrices = num_params(cfg) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    attention = 0
    for layer in range(cfg.n_layers):
        window = cfg.layer_window(layer)
        attention += attention_flops(cfg, B, T, S if window is None else min(S, window))
    if cfg.is_mla:  # the up projection of the S - T latents that were cached before this pass
        up = cfg.kv_lora_rank * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        attention += cfg.n_layers * 2 * B * (S - T) * up
    return 2 * B * T * matrices + attention


def decode_weight_bytes(model: TransformerLM) -> int:
    """Bytes of weights one decode step of a live model reads: every parameter once, in its own dtype.

    A tied embedding is one parameter, read as the output matrix. An untied input embedding is left
    out: a step looks up only B of its rows.
    """
    skip = model.embed.weight if model.lm_head is not None else None
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not skip)


def decode_step_bytes(
    model_or_cfg: TransformerLM | ModelConfig, B: int, S: int, dtype_bytes: int | None = None
) -> int:
    """Bytes one decode step reads: the weights (`decode_weight_bytes`) plus B KV caches of S tokens.

    The numerator of the decode roofline (time >= bytes / read bandwidth). Given a model, the weights
    are counted from its parameters and `dtype_bytes` (of the cache) defaults to the model's dtype;
    given a config, the weights are num_params(exact=True) less an untied input embedding, and
    dtype_bytes defaults to 2 (bf16). Unlike the lecture's `total_memory_bytes` (all memory held),
    this counts the norm weights and leaves out the rows of an untied input embedding nobody reads.
    """
    if isinstance(model_or_cfg, ModelConfig):
        cfg, dtype_bytes = model_or_cfg, dtype_bytes or 2
        lookup_only = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
        weights = dtype_bytes * (num_params(cfg, exact=True) - lookup_only)
    else:
        cfg, weights = model_or_cfg.config, decode_weight_bytes(model_or_cfg)
        dtype_bytes = dtype_bytes or model_or_cfg.norm.weight.element_size()  # the KV cache's dtype
    return weights + kv_cache_bytes(cfg, B, S, dtype_bytes)


# -------------------------------------------------------------- speculative decoding
def speculative_expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens per target pass when each of k drafted tokens is accepted with probability alpha.

    The pass keeps drafts up to the first rejection and always adds one token of its own (the
    correction, or a bonus token if all k pass): 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a).
    (The lecture's k*a + 1 ignores that a rejection discards every later draft; it overestimates.)
    """
    # BEGIN SOLUTION speculative_accounting
    if not 0 <= alpha <= 1:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"draft length k must be >= 0, got {k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)
    # END SOLUTION


def speculative_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speedup over plain decoding: tokens per round / cost of a round in target passes.

    A round runs the draft k times (cost k * cost_ratio target passes) and the target once, so
    speedup = (1 - a^(k+1)) / ((1 - a) * (1 + k * cost_ratio)). Below 1 if the draft is poor.
    """
    # BEGIN SOLUTION speculative_accounting
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
    return speculative_expected_tokens(alpha, k) / (1 + k * cost_ratio)
    # END SOLUTION


def draft_cost_ratio(draft: ModelConfig, target: ModelConfig) -> float:
    """Draft cost / target cost for memory-bound decode: the ratio of weights read (8B/70B ~ 0.11)."""
    return num_params(draft) / num_params(target)


# ------------------------------------------------------------------------- tensor parallelism
# Links between accelerators, one direction: an H100's NVLink 4 moves 900 GB/s both ways (450e9 each
# way); PCIe Gen4 x16 about 32e9 B/s each way (25e9 is typical of what a copy gets). The latency is
# a small all-reduce step's fixed cost (launch, synchronisation), a few microseconds.
NVLINK_BANDWIDTH, NVLINK_LATENCY = 450e9, 5e-6
PCIE_BANDWIDTH, PCIE_LATENCY = 25e9, 10e-6


def tp_allreduce_bytes(cfg: ModelConfig, B: int, T: int, dtype_bytes: int = 2) -> int:
    """Bytes of activations all-reduced by one forward under tensor parallelism: after o_proj and
    after down_proj in every layer, and once for the vocab-parallel embedding, B x T x D each."""
    # BEGIN SOLUTION tp_accounting
    return (2 * cfg.n_layers + 1) * B * T * cfg.d_model * dtype_bytes
    # END SOLUTION


def ring_allreduce_time(n_bytes: float, tp: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-reduce of n_bytes over tp ranks: a reduce-scatter and an all-gather,
    2 (tp - 1) steps in each of which every rank sends n_bytes / tp to its neighbour."""
    if tp == 1:
        return 0.0
    # BEGIN SOLUTION tp_accounting
    return 2 * (tp - 1) * (latency + n_bytes / tp / bandwidth)
    # END SOLUTION


def ring_allgather_time(n_bytes: float, tp: int, bandwidth: float, latency: float) -> float:
    """Seconds for a ring all-gather that leaves every rank n_bytes (n_bytes / tp from each)."""
    if tp == 1:
        return 0.0
    # BEGIN SOLUTION tp_accounting
    return (tp - 1) * (latency + n_bytes / tp / bandwidth)
    # END SOLUTION


def tp_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """K/V heads each rank holds: K / tp, or one replicated head when K < tp."""
    # BEGIN SOLUTION tp_accounting
    return max(cfg.n_kv_heads // tp, 1)
    # END SOLUTION


def tp_weight_bytes_per_rank(cfg: ModelConfig, tp: int, dtype_bytes: int = 2) -> int:
    """Weight bytes one of tp ranks holds: 1/tp of every split matrix (q, k, v, o, gate, up, down,
    embedding, output) and a whole K/V head where K < tp (replicated); norms left out, as
    `num_params` leaves them out, so tp = 1 gives dtype_bytes * num_params (V divisible by tp)."""
    if cfg.is_mla:
        raise ValueError("the per-rank weight count models MHA/GQA/MQA attention, not MLA")
    D, Fd, N, H, L, V = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.head_dim, cfg.n_layers, cfg.vocab_size
    owners = len({cfg.kv_owner(i) for i in range(L)})
    # BEGIN SOLUTION tp_accounting
    vocab = -(-V // tp) * D * (1 if cfg.tie_embeddings else 2)
    per_layer = 2 * D * N * H // tp + 3 * D * Fd // tp
    kv = owners * 2 * D * H * tp_kv_heads(cfg, tp)
    return dtype_bytes * (vocab + L * per_layer + kv)
    # END SOLUTION


def tp_kv_bytes_per_token_per_rank(cfg: ModelConfig, tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one rank: its K/V heads only (the cache is sharded with them)."""
    if cfg.is_mla:
        return kv_cache_bytes_per_token(cfg, dtype_bytes)  # the latents are replicated
    owners = len({cfg.kv_owner(i) for i in range(cfg.n_layers)})
    # BEGIN SOLUTION tp_accounting
    return owners * 2 * tp_kv_heads(cfg, tp) * cfg.head_dim * dtype_bytes
    # END SOLUTION


def tp_decode_step(
    cfg: ModelConfig,
    B: int,
    S: int,
    tp: int,
    bandwidth: float = H100_BANDWIDTH,
    link_bandwidth: float = NVLINK_BANDWIDTH,
    link_latency: float = NVLINK_LATENCY,
    dtype_bytes: int = 2,
) -> dict[str, float]:
    """The predicted decode step under tensor parallelism (memory-bound, as `decode_latency`).

    memory: each rank reads its own weights and KV caches, about 1/tp of the whole, in parallel.
    communication: 2L + 1 all-reduces of B x D activations and the all-gather of B x V logits,
    which do not shrink with tp (they grow: 2 (tp - 1) steps each). step = memory + communication
    (no overlap assumed).
    """
    _check_positive(bandwidth=bandwidth, link_bandwidth=link_bandwidth)
    held = tp_weight_bytes_per_rank(cfg, tp, dtype_bytes) + B * S * tp_kv_bytes_per_token_per_rank(
        cfg, tp, dtype_bytes
    )
    memory = held / bandwidth
    one = B * cfg.d_model * dtype_bytes
    comm = (2 * cfg.n_layers + 1) * ring_allreduce_time(one, tp, link_bandwidth, link_latency)
    comm += ring_allgather_time(B * cfg.vocab_size * dtype_bytes, tp, link_bandwidth, link_latency)
    return dict(memory_s=memory, communication_s=comm, step_s=memory + comm, bytes_per_rank=held)


# ------------------------------------------------------------------------- presets
def llama2_7b() -> ModelConfig:
    return ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096,
        rms_norm_eps=1e-5, model_type="llama",
    )  # fmt: skip


def llama2_13b() -> ModelConfig:
    """The lecture's example: S=1024, D=5120, F=13824, N=K=40, H=128, L=40, V=32000."""
    return ModelConfig(
        vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, d_ff=13824, max_seq_len=4096,
        rms_norm_eps=1e-5, model_type="llama",
    )  # fmt: skip


def llama2_70b() -> ModelConfig:
    """GQA: N=64 query heads share K=8 key/value heads."""
    return ModelConfig(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
        max_seq_len=4096, rms_norm_eps=1e-5, model_type="llama",
    )  # fmt: skip


def llama3_8b() -> ModelConfig:
    return ModelConfig(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        max_seq_len=8192, rope_theta=500000.0, rms_norm_eps=1e-5, model_type="llama",
    )  # fmt: skip


def deepseek_v2() -> ModelConfig:
    """DeepSeek-V2's attention (MLA: kv_lora_rank 512, rotary key 64, q_lora_rank 1536, 128 heads).

    Only the attention dims are DeepSeek-V2's: the MLP is one dense SwiGLU of the first layer's
    size (the mixture of experts is not modelled), so num_params is not the real 236B.
    """
    return ModelConfig(
        vocab_size=102400, d_model=5120, n_layers=60, n_heads=128, head_dim=192, d_ff=12288,
        max_seq_len=163840, rms_norm_eps=1e-6, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True,
        model_type="deepseek_v3",
    )  # fmt: skip


def smollm2_135m() -> ModelConfig:
    """The project's default real model: GQA 9/3, 30 layers, tied embeddings."""
    return ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_embeddings=True, model_type="llama",
    )  # fmt: skip


PRESETS = {
    "llama2-7b": llama2_7b,
    "llama2-13b": llama2_13b,
    "llama2-70b": llama2_70b,
    "llama3-8b": llama3_8b,
    "deepseek-v2": deepseek_v2,
    "smollm2-135m": smollm2_135m,
}


def preset(name: str, **overrides) -> ModelConfig:
    """A preset by name, with fields replaced (e.g. preset("llama2-13b", n_kv_heads=8))."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name](), **overrides)


def gib(n_bytes: float) -> float:
    """Bytes in GiB (2^30), for comparing with figures quoted in binary units."""
    return n_bytes / 2**30

"""TransformerLM: a Llama-style decoder (pre-norm blocks, RoPE, SwiGLU) with swappable attention.

    x = embed(ids)
    for each of L blocks:  x = x + attn(norm(x));  x = x + mlp(norm(x))
    logits = norm(x) W_vocab^T            (W_vocab = the embedding when tie_embeddings)

`model(ids)` is the full causal forward. `model(ids, cache=cache)` processes the next T tokens
against a KV cache from `model.new_cache(...)` (prefill: T = prompt length; decode: T = 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from .attention import MLA, Attention, ForwardContext
from .config import ModelConfig
from .kv_cache import KVCache, MLACache, RingKVCache, StaticKVCache
from .layers import Embedding, GeGLU, Linear, RMSNorm, SwiGLU, rope_tables, skip_random_init


def as_pad(pad, B: int, T: int, device: torch.device) -> Int[Tensor, " B"]:
    """pad (a tensor, list or tuple of B integers, each in 0..T-1) as a LongTensor; ValueError otherwise.

    T is the number of steps the padding is counted in (each row keeps at least one real token).
    """
    pad = torch.as_tensor(pad, device=device)
    if pad.dtype.is_floating_point or pad.dtype.is_complex or pad.dtype == torch.bool:
        raise ValueError(f"pad must hold integers (left-padding counts), got dtype {pad.dtype}")
    if pad.shape != (B,):
        raise ValueError(f"pad must have shape ({B},), one count per row, got {tuple(pad.shape)}")
    if B and not (0 <= int(pad.min()) and int(pad.max()) < T):
        raise ValueError(f"pad must be in 0..{T - 1} (every row keeps a real token), got {pad.tolist()}")
    return pad.long()


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.attn = MLA(cfg, layer) if cfg.is_mla else Attention(cfg, layer)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.mlp = (GeGLU if cfg.mlp_act == "gelu_tanh" else SwiGLU)(cfg.d_model, cfg.d_ff)
        if cfg.sandwich_norm:  # Gemma: the outputs of attention and MLP are normalized too
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)

    def forward(self, x: Float[Tensor, "B T D"], ctx: ForwardContext) -> Float[Tensor, "B T D"]:
        """Pre-norm residual block: x + attn(attn_norm(x)), then that + mlp(mlp_norm(that))."""
        if hasattr(self, "post_attn_norm"):  # Gemma's sandwich: each branch's output normalized too
            x = x + self.post_attn_norm(self.attn(self.attn_norm(x), ctx))
            return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))
        # BEGIN SOLUTION transformer_lm
        x = x + self.attn(self.attn_norm(x), ctx)
        return x + self.mlp(self.mlp_norm(x))
        # END SOLUTION


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = cfg = config
        self.embed = Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size)
        self.init_rope()
        # Gemma multiplies the embeddings by sqrt(D), rounded to the model's dtype
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.embed_scale else None

    def init_rope(self) -> None:
        """The rotary tables (buffers, not weights): cos and sin of every position's angles, and the
        sliding layers' own where they rotate with another base (Gemma 3)."""
        cfg = self.config
        rope_dim = cfg.qk_rope_head_dim if cfg.is_mla else cfg.rotary_dim
        cos, sin = rope_tables(rope_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling, cfg.rope_freqs)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.rope_local_theta is not None:
            cos, sin = rope_tables(rope_dim, cfg.max_seq_len, cfg.rope_local_theta)
            self.register_buffer("rope_cos_local", cos, persistent=False)
            self.register_buffer("rope_sin_local", sin, persistent=False)

    @classmethod
    def empty(
        cls, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> TransformerLM:
        """A model with allocated but unfilled weights, for a checkpoint loader to copy into.

        The constructor fills every weight with random numbers that loading overwrites at once (about
        10 s for SmolLM2 on a CPU); here Linear and Embedding skip that (layers.skip_random_init).
        Everything else is built as usual: column-major weights (layers.transposed_empty), the rotary
        tables, norms at one. (Building on the "meta" device and then to_empty would work as well, but
        torch runs meta kernels of ops like normal_ in Python and imports sympy for them: seconds.)
        """
        with skip_random_init(), torch.device(device):
            model = cls(config)
        return model.to(dtype=dtype)  # keeps each weight's strides (a no-op for float32)

    def embed_tokens(self, ids: Int[Tensor, "B T"]) -> Float[Tensor, "B T D"]:
        """The embedding rows of ids (times sqrt(D) where the family scales them, as Gemma does)."""
        x = self.embed(ids)
        if self.embed_scale is None:
            return x
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def context(
        self, q_steps: Int[Tensor, " T"], start: int, positions: Int[Tensor, "B T"], **kw
    ) -> ForwardContext:
        """The ForwardContext of one pass: the rotary angles of these positions (and of the sliding
        layers' own base where the model has one), plus whatever kw sets (pad, cache, paged, tree)."""
        local = None
        if hasattr(self, "rope_cos_local"):
            local = (self.rope_cos_local[positions], self.rope_sin_local[positions])
        return ForwardContext(
            q_steps, start, self.rope_cos[positions], self.rope_sin[positions], local_rope=local, **kw
        )

    @property
    def vocab_weight(self) -> Tensor:
        """The [V, D] output matrix: the embedding when tie_embeddings. Quantized, a PackedWeight
        (quantization/linear.py), which F.linear multiplies from its stored bytes."""
        head = self.embed if self.lm_head is None else self.lm_head
        return head.packed_weight if hasattr(head, "packed_weight") else head.weight

    def forward(
        self,
        input_ids: Int[Tensor, "B T"],
        cache: KVCache | None = None,
        pad: Int[Tensor, " B"] | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
    ) -> Float[Tensor, "B T V"]:
        """Logits for every position (only the last one when last_only).

        pad[b] = number of left-padding tokens in row b (batched prompts of unequal length): a tensor,
        list or tuple of B integers in 0..T-1. With a cache, the pad given to new_cache applies to
        every step, and passing pad here too is an error. With a cache, the tokens are steps
        cache.pos .. cache.pos + T - 1, and cache.pos advances by T. The logits are the final norm
        of the last block's output times the vocabulary matrix (`vocab_weight`: the embedding when
        tie_embeddings). return_hidden=True returns (logits, h) with h = that final norm's output
        [B, T, D], the features a trained draft head reads (speculative decoding, EAGLE).
        """
        B, T = input_ids.shape
        start = 0 if cache is None else cache.pos
        if cache is not None:
            if pad is not None:
                raise ValueError(
                    "pad is given with a cache: the cache's own pad (model.new_cache(..., pad=...)) "
                    "applies to every step; pass pad to new_cache only"
                )
            pad = cache.pad
            if start + T > cache.capacity:
                raise ValueError(f"KV cache full: {start} + {T} tokens > capacity {cache.capacity}")
        if start + T > self.config.max_seq_len:
            raise ValueError(
                f"{start + T} tokens exceed the context window of {self.config.max_seq_len} (max_seq_len)"
            )
        if cache is None and pad is not None:
            pad = as_pad(pad, B, T, input_ids.device)
        q_steps = torch.arange(start, start + T, device=input_ids.device)
        positions = q_steps[None] if pad is None else (q_steps[None] - pad[:, None]).clamp(min=0)
        ctx = self.context(q_steps, start, positions, pad=pad, cache=cache)
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(x, ctx)
        if last_only:
            x = x[:, -1:]
        if cache is not None:
            cache.pos = start + T
        # BEGIN SOLUTION transformer_lm
        h = self.norm(x)
        logits = F.linear(h, self.vocab_weight)
        # END SOLUTION
        return (logits, h) if return_hidden else logits

    def forward_paged(
        self, input_ids: Int[Tensor, " T"], batch, return_hidden: bool = False
    ) -> Float[Tensor, "n V"] | tuple[Float[Tensor, "n V"], Float[Tensor, "T D"]]:
        """Selective batching for the serving engine: the new tokens of n sequences in one row.

        `batch` (a serving.paged_attention.PagedBatch) gives each token's position (for RoPE) and its slot in
        the paged KV cache; embedding, projections and MLP run once over all T tokens ([1, T, D]),
        attention runs per sequence over that sequence's blocks. Returns the logits of the rows
        batch.logit_rows, [n, V]: each sequence's last token (and every token of a sequence whose
        prompt log-probabilities the engine wants). return_hidden=True returns (logits, h) with h the
        final norm's output at every one of the T rows (the features a draft head reads).
        """
        positions = batch.positions
        if batch.max_position >= self.config.max_seq_len:
            raise ValueError(f"position {batch.max_position} is past max_seq_len={self.config.max_seq_len}")
        ctx = self.context(positions, 0, positions[None], paged=batch)
        x = self.embed_tokens(input_ids[None])
        for block in self.layers:
            x = block(x, ctx)
        if return_hidden:
            h = self.norm(x[0])
            return F.linear(h[batch.logit_rows], self.vocab_weight), h
        return F.linear(self.norm(x[0, batch.logit_rows]), self.vocab_weight)

    def new_cache(
        self,
        batch_size: int,
        max_seq_len: int | None = None,
        pad: Int[Tensor, " B"] | None = None,
        dtype: torch.dtype | None = None,
        spare: int = 0,
    ) -> KVCache:
        """An empty cache for `batch_size` sequences of up to `max_seq_len` steps (padding included).

        Full-attention layers get a static [B, K, S, H] cache, sliding-window layers a ring of
        W (+ spare) slots, MLA layers the latent cache, CLA borrowing layers nothing.

        dtype, if given, must be the model's own: attention multiplies queries by the cached keys,
        so both must have one dtype (a cheaper cache dtype would need a cast on every read).
        """
        cfg = self.config
        S = cfg.max_seq_len if max_seq_len is None else max_seq_len
        if not 0 < S <= cfg.max_seq_len:
            raise ValueError(f"cache length {S} must be in 1..max_seq_len={cfg.max_seq_len}")
        model_dtype = self.norm.weight.dtype  # the activations' dtype (the embedding may be quantized)
        if dtype is not None and dtype != model_dtype:
            raise ValueError(
                f"cache dtype {dtype} differs from the model's {model_dtype}: convert the model "
                f"(model.to({dtype})) or leave dtype out"
            )
        dtype = model_dtype
        device = self.embed.weight.device
        B, K, H = batch_size, cfg.n_kv_heads, cfg.head_dim
        layers: list = []
        for i in range(cfg.n_layers):
            window = cfg.layer_window(i)
            if cfg.kv_owner(i) != i:
                layers.append(None)
            elif cfg.is_mla:
                layers.append(MLACache(B, S, cfg.kv_lora_rank, cfg.qk_rope_head_dim, dtype, device))
            elif window is not None and window + spare < S:
                layers.append(RingKVCache(B, K, window, H, H, dtype, device, spare=spare))
            else:
                layers.append(StaticKVCache(B, K, S, H, H, dtype, device))
        if pad is not None:
            pad = as_pad(pad, B, S, device)
        return KVCache(layers, S, pad)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

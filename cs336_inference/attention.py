"""Attention and the variants that shrink the KV cache: MHA / GQA / MQA, sliding window, CLA, MLA.

MHA   K = N: every query head has its own key/value head.
GQA   N/K query heads share each K/V head: the cache shrinks by N/K.
MQA   K = 1: one K/V head for all query heads.
sliding window W: a query sees only the last W keys, so a ring of W slots suffices.
CLA   groups of kv_share layers reuse the first layer's K/V: the cache shrinks by kv_share.
MLA   keys and values are up-projected from a small latent c_kv that is all the cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from .config import ModelConfig
from .kv_cache import KVCache, RingKVCache
from .layers import Linear, RMSNorm, apply_partial_rope, apply_rope, interleaved_to_half


def causal_mask(q_steps: Int[Tensor, " T"], k_steps: Int[Tensor, " S"]) -> Bool[Tensor, "T S"]:
    """The causal rule: mask[i, j] = True (visible) iff 0 <= k_steps[j] <= q_steps[i].

    Steps are time indices, not slot numbers: a cache may return its keys in any order (a ring
    buffer does), and a key step of -1 marks an empty slot, which is never visible.
    """
    q, k = q_steps[:, None], k_steps[None, :]
    # BEGIN SOLUTION attention
    return (k <= q) & (k >= 0)
    # END SOLUTION


def window_mask(q_steps: Int[Tensor, " T"], k_steps: Int[Tensor, " S"], window: int) -> Bool[Tensor, "T S"]:
    """The sliding-window clause: mask[i, j] = True iff q_steps[i] - window < k_steps[j].

    The window counts the current token (Mistral's convention): with causality (applied separately,
    by `attention_mask`) query i sees keys i - W + 1 .. i, W of them.
    """
    q, k = q_steps[:, None], k_steps[None, :]
    # BEGIN SOLUTION sliding_window
    return k > q - window
    # END SOLUTION


def attention_mask(
    q_steps: Int[Tensor, " T"],
    k_steps: Int[Tensor, " S"],
    window: int | None = None,
    pad: Int[Tensor, " B"] | None = None,
) -> Bool[Tensor, "B T S"]:
    """Which keys each query may see (True = visible); batch dim is 1 when there is no padding.

    Causal (`causal_mask`): key step j is visible to query step i iff 0 <= j <= i.
    Sliding window W (`window_mask`): additionally i - W < j (the window counts the current token).
    Left padding: keys in row b's first pad[b] steps are never visible (a padding query sees
    itself only, so its row of the softmax is never empty).
    """
    visible = causal_mask(q_steps, k_steps)
    if window is not None:
        visible = visible & window_mask(q_steps, k_steps, window)
    if pad is None:
        return visible[None]
    q, k = q_steps[:, None], k_steps[None, :]
    not_pad = k[None] >= pad[:, None, None]
    return visible[None] & (not_pad | (k == q)[None])


def attend(
    q: Float[Tensor, "B N T H"],
    k: Float[Tensor, "B K S H"],
    v: Float[Tensor, "B K S Hv"],
    mask: Bool[Tensor, "B T S"] | None,
    scale: float,
) -> Float[Tensor, "B N T Hv"]:
    """softmax(q k^T * scale + mask) v, with each K/V head serving N/K consecutive query heads.

    Query head n uses K/V head n // (N/K). mask[b, i, j] = True lets query i of row b see key j
    (None: every key is visible); the softmax is computed in float32. Returns a new tensor in v's
    dtype; K and V must not be copied N/K times (group the query heads instead).

    Decode reads all of k and v (2 * B * K * S * H numbers) for only 4 * B * N * S * H FLOPs:
    arithmetic intensity about N/K, however large B is. That is why decode is memory-bound.
    """
    # BEGIN SOLUTION attention
    K = k.shape[1]
    qg = rearrange(q, "b (k g) t h -> b k g t h", k=K)
    scores = torch.einsum("bkgth,bksh->bkgts", qg, k) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    probs = scores.float().softmax(dim=-1).to(v.dtype)
    out = torch.einsum("bkgts,bksh->bkgth", probs, v)
    return rearrange(out, "b k g t h -> b (k g) t h")
    # END SOLUTION


@dataclass
class ForwardContext:
    """What every layer of one forward pass shares: steps, rotary angles, cache, masks, CLA K/V."""

    q_steps: Int[Tensor, " T"]
    start: int
    cos: Float[Tensor, "B T R"]
    sin: Float[Tensor, "B T R"]
    pad: Int[Tensor, " B"] | None = None
    cache: KVCache | None = None
    masks: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)  # layer -> (k, v, steps), for CLA borrowers
    paged: Any = None  # serving.paged_attention.PagedBatch: K/V in paged blocks, attention per sequence
    tree: Bool[Tensor, "T n"] | None = None  # tree drafts: steps tree_start.. are tree nodes (see mask)
    tree_start: int = 0
    local_rope: tuple[Tensor, Tensor] | None = None  # (cos, sin) of sliding layers with their own base

    def mask(self, steps: Tensor, window: int | None, store) -> Tensor | None:
        """The mask for these key steps, built once per forward for each kind of layer.

        With a tree (speculative tree drafting and verification), the keys at steps tree_start ..
        tree_start + n - 1 are n nodes of a tree of drafts: query i sees those that row i of `tree`
        marks (its ancestors and itself) and every key before tree_start, on top of the causal rule.
        """
        T = self.q_steps.shape[0]
        if self.tree is not None:
            key = ("tree", window, steps.shape[0])
            if key not in self.masks:
                rel = steps - self.tree_start
                in_tree = (rel < 0) | self.tree[:, rel.clamp(min=0, max=self.tree.shape[1] - 1)]
                self.masks[key] = attention_mask(self.q_steps, steps, window, self.pad) & in_tree[None]
            return self.masks[key]
        if T == 1 and self.pad is None:
            if isinstance(store, RingKVCache):
                if store.pos >= store.slots == store.window:
                    return None  # a full ring of exactly W slots is the window
            elif window is None or steps.shape[0] <= window:
                return None  # one query at the last step sees every key
        key = (window, type(store).__name__, steps.shape[0])
        if key not in self.masks:
            self.masks[key] = attention_mask(self.q_steps, steps, window, self.pad)
        return self.masks[key]


class Attention(nn.Module):
    """Multi-head attention with K <= N key/value heads, optional sliding window and CLA sharing."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.owner = layer, cfg.kv_owner(layer)
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.layer_window(layer)
        self.scale = cfg.attn_scale
        # Gemma 3's sliding layers rotate with their own base (ctx.local_rope)
        self.local_rope = cfg.layer_rope_theta(layer) != cfg.rope_theta
        D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(D, N * H, bias=cfg.qkv_bias)
        if self.owner == layer:  # CLA: only the first layer of a group projects keys and values
            self.k_proj = Linear(D, K * H, bias=cfg.qkv_bias)
            self.v_proj = Linear(D, K * H, bias=cfg.qkv_bias)
        self.o_proj = Linear(N * H, D)
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head's queries and keys RMS-normalized before RoPE
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps)
            if self.owner == layer:
                self.k_norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, x: Float[Tensor, "B T D"], ctx: ForwardContext) -> Float[Tensor, "B T D"]:
        """Attention output for the T tokens of x (before the residual add).

        An owning layer projects K/V, writes them to its cache store (if any) and records
        ctx.kv[layer] = (k, v, steps). A borrowing layer (CLA) projects only its queries and reads the
        (k, v, steps) its owner `cfg.kv_owner(layer)` recorded earlier in this forward pass.
        """
        H = self.head_dim
        q = self.rope(self.heads(self.q_proj(x), "q_norm"), ctx)
        if self.owner == self.layer:
            k = self.rope(self.heads(self.k_proj(x), "k_norm"), ctx)
            v = rearrange(self.v_proj(x), "b t (k h) -> b k t h", h=H)
        if ctx.paged is not None:  # serving: K/V live in paged blocks, each sequence attends over its own
            if self.owner == self.layer:
                ctx.paged.write(self.layer, k, v)
            out = ctx.paged.attend(
                self.owner, self.window, (q,), lambda q, k, v, m: attend(q, k, v, m, self.scale)
            )
            return self.o_proj(rearrange(out, "b n t h -> b t (n h)"))
        store = ctx.cache.layers[self.owner] if ctx.cache is not None else None
        if self.owner == self.layer:
            if store is not None:
                k, v, steps = store.update(k, v, ctx.start)
            else:
                steps = ctx.q_steps
            ctx.kv[self.layer] = (k, v, steps)
        else:
            k, v, steps = self.borrowed_kv(ctx)
        out = attend(q, k, v, ctx.mask(steps, self.window, store), self.scale)
        return self.o_proj(rearrange(out, "b n t h -> b t (n h)"))

    def heads(self, x: Float[Tensor, "B T heads_H"], norm: str) -> Float[Tensor, "B heads T H"]:
        """[B, T, heads * H] -> [B, heads, T, H], each head RMS-normalized where the model has QK-norm."""
        x = rearrange(x, "b t (n h) -> b n t h", h=self.head_dim)
        return getattr(self, norm)(x) if hasattr(self, norm) else x

    def rope(self, x: Float[Tensor, "B heads T H"], ctx: ForwardContext) -> Float[Tensor, "B heads T H"]:
        """Rotary embedding with this layer's angles (a sliding layer's own base where it has one);
        the first R dims of each head rotate under partial rotary."""
        if not self.local_rope:
            return apply_partial_rope(x, ctx.cos, ctx.sin)
        if ctx.local_rope is None:
            raise ValueError(
                f"layer {self.layer} rotates with its own base, but the context has no local_rope"
            )
        return apply_partial_rope(x, *ctx.local_rope)

    def borrowed_kv(
        self, ctx: ForwardContext
    ) -> tuple[Float[Tensor, "B K S H"], Float[Tensor, "B K S H"], Int[Tensor, " S"]]:
        """CLA: the (k, v, steps) that the first layer of this layer's group (`self.owner`, i.e.
        `cfg.kv_owner(layer)`) stored in `ctx.kv` earlier in this forward pass. A borrowing layer has
        no K/V projections and no cache of its own; it attends over exactly what its owner attends."""
        # BEGIN SOLUTION cla
        k, v, steps = ctx.kv[self.owner]
        return k, v, steps
        # END SOLUTION


LATENT_NORM_EPS = 1e-6  # DeepSeek normalizes its latents with a fixed eps, not config.rms_norm_eps


class MLA(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3).

    Per token the cache keeps c_kv = norm(W_DKV x) (kv_lora_rank numbers) and one rotary key
    k_pe shared by all heads (qk_rope_head_dim numbers). Keys and values of head n are
    k_n = [W_UK_n c_kv, k_pe], v_n = W_UV_n c_kv.

    naive:    up-project the cached latents to per-head keys and values, then attend.
    absorbed: q_n . (W_UK_n c) = (W_UK_n^T q_n) . c, so fold W_UK into the query, attend over
              the latents directly, and apply W_UV after attention: no per-head K/V is built.
    """

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        D, N = cfg.d_model, cfg.n_heads
        self.layer, self.n_heads = layer, N
        self.r, self.p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.rope_interleave = cfg.rope_interleave
        self.scale = (self.nope + self.p) ** -0.5
        self.absorb: bool | None = None  # None: absorbed for decode (T == 1), naive otherwise
        q_dim = N * (self.nope + self.p)
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(D, q_dim)
        else:
            self.q_a_proj = Linear(D, cfg.q_lora_rank)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_dim)
        self.kv_a_proj = Linear(D, self.r + self.p)
        self.kv_a_norm = RMSNorm(self.r, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(self.r, N * (self.nope + self.v_dim))
        self.o_proj = Linear(N * self.v_dim, D)

    def _rope(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        if self.rope_interleave:
            x = interleaved_to_half(x)
        return apply_rope(x, ctx.cos, ctx.sin)

    def forward(self, x: Float[Tensor, "B T D"], ctx: ForwardContext) -> Float[Tensor, "B T D"]:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = rearrange(q, "b t (n d) -> b n t d", n=self.n_heads)
        q_nope, q_pe = q.split([self.nope, self.p], dim=-1)
        q_pe = self._rope(q_pe, ctx)
        c_kv, k_pe = self.kv_a_proj(x).split([self.r, self.p], dim=-1)
        c_kv = self.kv_a_norm(c_kv)
        k_pe = self._rope(k_pe[:, None], ctx)[:, 0]  # one rotary key for all heads
        if ctx.paged is not None:  # serving: each sequence attends over its paged latents
            ctx.paged.write(self.layer, c_kv, k_pe)
            out = ctx.paged.attend(self.layer, None, (q_nope, q_pe), self.attend_latents)
            return self.o_proj(rearrange(out, "b n t v -> b t (n v)"))
        store = ctx.cache.layers[self.layer] if ctx.cache is not None else None
        if store is not None:
            c_kv, k_pe, steps = store.update(c_kv, k_pe, ctx.start)
        else:
            steps = ctx.q_steps
        out = self.attend_latents(q_nope, q_pe, c_kv, k_pe, ctx.mask(steps, None, store))
        return self.o_proj(rearrange(out, "b n t v -> b t (n v)"))

    def attend_latents(self, q_nope, q_pe, c_kv, k_pe, mask) -> Float[Tensor, "B N T v"]:
        """`absorbed` for one query per row (decode) unless self.absorb says otherwise, else `naive`."""
        absorb = (q_nope.shape[2] == 1) if self.absorb is None else self.absorb
        return (self.absorbed if absorb else self.naive)(q_nope, q_pe, c_kv, k_pe, mask)

    def _w_uk_uv(self) -> tuple[Float[Tensor, "N nope r"], Float[Tensor, "N v r"]]:
        w = rearrange(self.kv_b_proj.weight, "(n d) r -> n d r", n=self.n_heads)
        return w[:, : self.nope], w[:, self.nope :]

    def naive(
        self,
        q_nope: Float[Tensor, "B N T nope"],
        q_pe: Float[Tensor, "B N T p"],
        c_kv: Float[Tensor, "B S r"],
        k_pe: Float[Tensor, "B S p"],
        mask: Bool[Tensor, "B T S"] | None,
    ) -> Float[Tensor, "B N T v"]:
        """Up-project every cached latent to per-head keys and values, then attend.

        kv_b_proj(c_kv) gives, per head, nope key dims followed by v_dim value dims; head n's key is
        [k_nope_n, k_pe] (k_pe shared by all heads) and its query [q_nope_n, q_pe]. Returns the
        attention output of every head, [B, N, T, v_dim].
        """
        # BEGIN SOLUTION mla
        kv = rearrange(self.kv_b_proj(c_kv), "b s (n d) -> b n s d", n=self.n_heads)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.n_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return attend(q, k, v, mask, self.scale)
        # END SOLUTION

    def absorbed(
        self,
        q_nope: Float[Tensor, "B N T nope"],
        q_pe: Float[Tensor, "B N T p"],
        c_kv: Float[Tensor, "B S r"],
        k_pe: Float[Tensor, "B S p"],
        mask: Bool[Tensor, "B T S"] | None,
    ) -> Float[Tensor, "B N T v"]:
        """Attend over the latents: W_UK folded into the query, W_UV applied to the output.

        Same result as `naive` (same scale, mask and float32 softmax), but scores are
        (W_UK_n^T q_nope_n) . c_kv + q_pe_n . k_pe, and W_UV multiplies the weighted sum of latents:
        kv_b_proj is never applied to the cache. `_w_uk_uv` gives W_UK [N, nope, r] and W_UV [N, v, r].
        Returns [B, N, T, v_dim].
        """
        # BEGIN SOLUTION mla
        w_uk, w_uv = self._w_uk_uv()
        q_latent = torch.einsum("bntd,ndr->bntr", q_nope, w_uk)
        scores = torch.einsum("bntr,bsr->bnts", q_latent, c_kv) + torch.einsum("bntp,bsp->bnts", q_pe, k_pe)
        scores = scores * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = scores.float().softmax(dim=-1).to(c_kv.dtype)
        out_latent = torch.einsum("bnts,bsr->bntr", probs, c_kv)
        return torch.einsum("bntr,nvr->bntv", out_latent, w_uv)
        # END SOLUTION

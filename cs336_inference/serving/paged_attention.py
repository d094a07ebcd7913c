"""Paged attention (vLLM's PagedAttention): the K/V of every layer stored in blocks, and attention
over a sequence's scattered blocks (its block table: block_manager.py).

Per layer the storage is [num_blocks, B_s, K, H] for keys and values (MLA: [num_blocks, B_s, r]
latents and [num_blocks, B_s, p] rotary keys), addressed by flat slots.

    PagedKVCache     the K/V (or latent) storage of every layer, addressed by slots
    slot_mapping, gather_blocks, paged_attention
                     writing into and attending over a sequence's scattered blocks
    PagedBatch       one engine step as the model sees it (selective batching): many sequences'
                     new tokens flattened into one row, attention per sequence over its blocks
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..attention import attend, attention_mask
from ..config import ModelConfig


# ------------------------------------------------------------------ storage and paged attention
def slot_mapping(block_table: Int[Tensor, " n"], start: int, end: int, block_size: int) -> Int[Tensor, " T"]:
    """Flat slot of each step start..end-1: block_table[t // block_size] * block_size + t % block_size.

    A layer's storage [num_blocks, block_size, ...] viewed as [num_blocks * block_size, ...] holds
    step t of this sequence at that row.
    """
    # BEGIN SOLUTION paged_attention
    steps = torch.arange(start, end, device=block_table.device)
    return block_table[steps // block_size] * block_size + steps % block_size
    # END SOLUTION


def gather_blocks(
    store: Float[Tensor, "num_blocks block_size ..."], block_table: Int[Tensor, " n"], length: int
) -> Float[Tensor, "S ..."]:
    """Steps 0..length-1 of the sequence whose blocks are block_table, contiguous: [length, ...].

    Only the first ceil(length / block_size) blocks are read; the last one may be partly filled.
    The cost, said plainly: this is a copy of the sequence's K/V (or latents) per layer per step,
    which this readable version pays so that `attend` can run unchanged; vLLM's kernel reads the
    blocks in place instead and never makes it.
    """
    # BEGIN SOLUTION paged_attention
    n = -(-length // store.shape[1])
    return store[block_table[:n]].flatten(0, 1)[:length]
    # END SOLUTION


def paged_attention(
    q: Float[Tensor, "N T H"],
    k_store: Float[Tensor, "num_blocks block_size K H"],
    v_store: Float[Tensor, "num_blocks block_size K Hv"],
    block_table: Int[Tensor, " n"],
    start: int,
    scale: float,
    window: int | None = None,
) -> Float[Tensor, "N T Hv"]:
    """Attention of one sequence's T queries (steps start..start+T-1) over its paged keys/values.

    The keys of steps 0..start+T-1 are gathered from the blocks (`gather_blocks`); query step i sees
    key step j iff j <= i (and i - window < j with a window): `attention_mask`. Same result as
    `attend` over a contiguous cache holding those steps.
    """
    # BEGIN SOLUTION paged_attention
    S = start + q.shape[1]
    k = rearrange(gather_blocks(k_store, block_table, S), "s k h -> 1 k s h")
    v = rearrange(gather_blocks(v_store, block_table, S), "s k h -> 1 k s h")
    steps = torch.arange(S, device=q.device)
    mask = attention_mask(steps[start:], steps, window)
    return attend(q[None], k, v, mask, scale)[0]
    # END SOLUTION


class PagedKVCache:
    """Every layer's paged storage: keys/values [num_blocks, block_size, K, H], or for MLA the
    latents [num_blocks, block_size, r] and rotary keys [num_blocks, block_size, p]. CLA layers that
    borrow K/V hold nothing (they read their group owner's blocks)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size)
        self.layers: list[tuple[Tensor, ...] | None] = []
        for i in range(cfg.n_layers):
            if cfg.kv_owner(i) != i:
                self.layers.append(None)
            elif cfg.is_mla:
                self.layers.append(
                    (
                        torch.zeros(*shape, cfg.kv_lora_rank, dtype=dtype, device=device),
                        torch.zeros(*shape, cfg.qk_rope_head_dim, dtype=dtype, device=device),
                    )
                )
            else:
                K, H = cfg.n_kv_heads, cfg.head_dim
                self.layers.append(
                    (
                        torch.zeros(*shape, K, H, dtype=dtype, device=device),
                        torch.zeros(*shape, K, H, dtype=dtype, device=device),
                    )
                )
        self.is_mla = cfg.is_mla

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for store in self.layers if store is not None for t in store)

    @property
    def block_nbytes(self) -> int:
        return self.nbytes // self.num_blocks

    def write(self, layer: int, slots: Int[Tensor, " T"], *new: Tensor) -> None:
        """Store the new tokens' K/V (the model's layout: [1, K, T, H], MLA [1, T, r]) at slots."""
        for store, x in zip(self.layers[layer], new, strict=True):
            rows = x[0] if self.is_mla else rearrange(x[0], "k t h -> t k h")
            store.view(-1, *store.shape[2:]).index_copy_(0, slots, rows.to(store.dtype))

    def gather(self, layer: int, block_table: Int[Tensor, " n"], length: int) -> tuple[Tensor, ...]:
        """Steps 0..length-1 in the layout attention takes: k, v [1, K, S, H]; MLA c_kv [1, S, r], k_pe [1, S, p]."""
        out = [gather_blocks(store, block_table, length) for store in self.layers[layer]]
        if self.is_mla:
            return tuple(x[None] for x in out)
        return tuple(rearrange(x, "s k h -> 1 k s h") for x in out)

    def copy_block(self, src: int, dst: int) -> None:
        for store in self.layers:
            for t in store or ():
                t[dst] = t[src]


def pad_tables(tables: list[Int[Tensor, " n"]]) -> Int[Tensor, "B n_max"]:
    """Block tables of different lengths as the rows of one tensor, padded with block 0 (never read:
    the lengths say where each sequence ends)."""
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for b, t in enumerate(tables):
        out[b, : len(t)] = t
    return out


@dataclass
class SeqSpan:
    """One sequence's share of a step: tokens offset..offset+n-1 of the row are its steps start..start+n-1."""

    offset: int
    start: int
    n: int
    block_table: Tensor


class PagedBatch:
    """One engine step as the model sees it (selective batching, Orca).

    The new tokens of all scheduled sequences are flattened into one row of T tokens: embedding,
    projections and MLP run once over [1, T, D]; each attention layer writes the new K/V to their
    slots (`write`) and attends per sequence over that sequence's blocks (`attend`). Sequences with
    one new token (decoding) attend together, as one batch padded to the longest of them (the
    padding masked out); sequences with a chunk of prompt attend one by one.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        spans: list[tuple[list[int], int, int]],
        device,
        all_logits: Sequence[bool] | None = None,
    ):
        """spans: (block table, start, n) per sequence, in row order.

        logit_rows: the rows whose logits the forward returns, in row order: each sequence's last
        token, or all n of its tokens where all_logits[i] (prompt log-probabilities).
        The index tensors are built on the CPU and moved to `device` once (no per-sequence transfers).
        """
        self.cache = cache
        self.spans: list[SeqSpan] = []
        positions, slots, offset = [], [], 0
        for blocks, start, n in spans:
            table = torch.tensor(blocks, dtype=torch.long)
            self.spans.append(SeqSpan(offset, start, n, table))
            positions.append(torch.arange(start, start + n))
            slots.append(slot_mapping(table, start, start + n, cache.block_size))
            offset += n
        positions = torch.cat(positions)
        self.max_position = int(positions.max())
        self.positions: Int[Tensor, " T"] = positions.to(device)
        self.slots: Int[Tensor, " T"] = torch.cat(slots).to(device)
        every = all_logits or [False] * len(self.spans)
        rows = [
            list(range(s.offset, s.offset + s.n)) if a else [s.offset + s.n - 1]
            for s, a in zip(self.spans, every, strict=True)
        ]
        self.logit_rows = torch.tensor([r for span_rows in rows for r in span_rows]).to(device)
        # the one-token spans (decoding), batched: their row index, padded block tables and lengths
        single = [s for s in self.spans if s.n == 1]
        self.single_idx = torch.tensor([s.offset for s in single], dtype=torch.long).to(device)
        if single:
            self.single_tables = pad_tables([s.block_table for s in single]).to(device)
            self.single_lengths = torch.tensor([s.start + 1 for s in single]).to(device)
        self.chunks = [s for s in self.spans if s.n > 1]
        for s in self.chunks:
            s.block_table = s.block_table.to(device)
        self._masks: dict = {}

    def write(self, layer: int, *new: Tensor) -> None:
        self.cache.write(layer, self.slots, *new)

    def single_mask(self, window: int | None) -> Bool[Tensor, "B 1 S"]:
        """Key j of one-token row b is visible iff j < length_b (and j > length_b - 1 - window)."""
        if ("single", window) not in self._masks:
            S = self.single_tables.shape[1] * self.cache.block_size
            k = torch.arange(S, device=self.positions.device)[None]
            lengths = self.single_lengths[:, None]
            visible = k < lengths
            if window is not None:
                visible &= k > lengths - 1 - window
            self._masks["single", window] = visible[:, None]
        return self._masks["single", window]

    def chunk_mask(self, i: int, window: int | None) -> Bool[Tensor, "1 n S"]:
        span = self.chunks[i]
        if (i, window) not in self._masks:
            steps = torch.arange(span.start + span.n, device=self.positions.device)
            self._masks[i, window] = attention_mask(steps[span.start :], steps, window)
        return self._masks[i, window]

    def attend(
        self, layer: int, window: int | None, qs: tuple[Tensor, ...], fn: Callable[..., Tensor]
    ) -> Tensor:
        """Attention of every token of the row over its own sequence's blocks of `layer`.

        qs: the queries, each [1, N, T, ...]; fn(*queries, *keys/values, mask) -> [B, N, t, Hv] is
        the attention (keys/values in the layout PagedKVCache.gather gives). Returns [1, N, T, Hv].
        """
        out = None
        if len(self.single_idx):
            stores = self.cache.layers[layer]
            kv = [store[self.single_tables].flatten(1, 2) for store in stores]  # [B, S, ...]
            if not self.cache.is_mla:
                kv = [rearrange(x, "b s k h -> b k s h") for x in kv]
            q = [rearrange(x[0, :, self.single_idx], "n b h -> b n 1 h") for x in qs]
            o = fn(*q, *kv, self.single_mask(window))  # [B, N, 1, Hv]
            out = o.new_empty(1, o.shape[1], self.positions.shape[0], o.shape[3])
            out[0, :, self.single_idx] = rearrange(o, "b n 1 h -> n b h")
        for i, span in enumerate(self.chunks):
            kv = self.cache.gather(layer, span.block_table, span.start + span.n)
            o = fn(
                *(x[:, :, span.offset : span.offset + span.n] for x in qs), *kv, self.chunk_mask(i, window)
            )
            if out is None:
                out = o.new_empty(1, o.shape[1], self.positions.shape[0], o.shape[3])
            out[:, :, span.offset : span.offset + span.n] = o
        return out

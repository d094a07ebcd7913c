"""Paged KV cache (vLLM's PagedAttention): the cache in fixed-size blocks, one block table per sequence.

The cache memory is a pool of `num_blocks` blocks of `block_size` (B_s) token slots, per layer
[num_blocks, B_s, K, H] for keys and values (MLA: [num_blocks, B_s, r] latents and
[num_blocks, B_s, p] rotary keys). A sequence owns a list of block ids, its block table: step t
lives in block table[t // B_s] at offset t % B_s, i.e. at flat slot table[t // B_s] * B_s + t % B_s.
Blocks are handed out one at a time as a sequence grows, so the waste is at most one partly
filled block per sequence (a contiguous cache reserves max_seq_len slots up front).

    BlockAllocator   reference-counted blocks and a free list (a block may be shared)
    BlockManager     block tables: grow, free, prefix caching (a full block is found again by a hash
                     of its tokens chained with its prefix's hash), copy-on-write of shared blocks
    PagedKVCache     the K/V (or latent) storage of every layer, addressed by slots
    slot_mapping, gather_blocks, paged_attention
                     writing into and attending over a sequence's scattered blocks
    PagedBatch       one engine step as the model sees it (selective batching): many sequences'
                     new tokens flattened into one row, attention per sequence over its blocks
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from einops import rearrange
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..attention import attend, attention_mask
from ..config import ModelConfig


class NoFreeBlocks(RuntimeError):
    """Every block is in use (the scheduler checks `num_free` first, so this means a bookkeeping bug)."""


# ------------------------------------------------------------------ the allocator
class BlockAllocator:
    """Blocks 0..num_blocks-1 with reference counts; the free list is kept in LRU order.

    ref_counts[b] = how many block tables hold block b (0: free). A freed block keeps its contents
    (the prefix cache may hand it out again, `share`), so `allocate` takes the block freed longest
    ago: `free_ids` is ordered oldest first.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def _check(self, block: int) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block id {block!r} is not in 0..{self.num_blocks - 1}")

    def allocate(self) -> int:
        """Take the free block freed longest ago (the front of `free_ids`); its count goes 0 -> 1.

        Raises NoFreeBlocks (one line) when no block is free.
        """
        # BEGIN SOLUTION block_allocator
        if not self.free_ids:
            raise NoFreeBlocks(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self.free_ids.popitem(last=False)
        self.ref_counts[block] = 1
        return block
        # END SOLUTION

    def share(self, block: int) -> None:
        """One more owner of `block` (count + 1). A free block (count 0, its contents still cached)
        leaves the free list: it is in use again. ValueError for an id out of range."""
        self._check(block)
        # BEGIN SOLUTION block_allocator
        if self.ref_counts[block] == 0:
            del self.free_ids[block]
        self.ref_counts[block] += 1
        # END SOLUTION

    def free(self, block: int) -> None:
        """One owner fewer (count - 1); at 0 the block joins the END of the free list (freed most
        recently, so handed out last). ValueError (one line) if the block is already free: a double
        free would put it on the list twice and give it to two sequences."""
        self._check(block)
        # BEGIN SOLUTION block_allocator
        if self.ref_counts[block] == 0:
            raise ValueError(f"double free of KV block {block}: its reference count is already 0")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids[block] = None
        # END SOLUTION


# ------------------------------------------------------------------ block tables, prefix cache, copy-on-write
def block_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: a digest of the previous block's key and these tokens.

    Chaining makes the key name the WHOLE prefix up to this block's end: the same 16 tokens after a
    different prefix have different keys and values, so they must not match. prev is b"" for the
    first block. (A cryptographic digest, so distinct prefixes never collide in practice.)
    """
    # BEGIN SOLUTION prefix_cow
    digest = hashlib.blake2b(prev, digest_size=16)
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()
    # END SOLUTION


@dataclass
class BlockTable:
    """One sequence's blocks (step t in blocks[t // block_size]) and the keys of its full blocks."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # hashes[i]: key of full block i (prefix cache)


class BlockManager:
    """Block tables on top of a BlockAllocator, with prefix caching and copy-on-write.

    Prefix cache: `cached` maps the key (`block_hash`) of a full block to the block holding it. A
    freed block stays in `cached` until `allocate` reuses it for something else (eviction, LRU via
    the allocator's free list). `match_prefix` gives a new sequence the cached blocks of its
    prompt's longest cached prefix of full blocks (shared: reference count + 1 each).
    Copy-on-write: before a sequence writes into a block that another table also holds
    (count > 1), `copy_on_write` gives it a private copy.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.cached: dict[bytes, int] = {}  # key of a full block -> the block holding it
        self.key_of: dict[int, bytes] = {}  # block -> its key in `cached`
        self.prefix_queries = self.prefix_hits = self.cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def ref_count(self, block: int) -> int:
        return self.allocator.ref_counts[block]

    def _allocate(self) -> int:
        """A fresh block; if it still held a cached full block, that cache entry is evicted."""
        block = self.allocator.allocate()
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.cached[key]
        return block

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Append to the empty `table` the cached blocks of the longest cached prefix of full blocks.

        Walk the full blocks of token_ids in order, chaining keys (`block_hash(prev_key, tokens)`,
        prev_key = b"" for the first); stop at the first key not in `cached`. Each hit is shared
        (allocator.share: count + 1) and appended to table.blocks, its key to table.hashes. Counts
        every key looked up in prefix_queries and every hit in prefix_hits. Returns the number of
        blocks matched (0 when prefix caching is off).
        """
        if table.blocks:
            raise ValueError("match_prefix needs an empty block table")
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        # BEGIN SOLUTION prefix_cow
        prev = b""
        for i in range(len(token_ids) // bs):
            key = block_hash(prev, token_ids[i * bs : (i + 1) * bs])
            self.prefix_queries += 1
            block = self.cached.get(key)
            if block is None:
                break
            self.allocator.share(block)
            table.blocks.append(block)
            table.hashes.append(key)
            self.prefix_hits += 1
            prev = key
        return len(table.blocks)
        # END SOLUTION

    def register_full_blocks(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Record the keys of the blocks that the first num_computed steps fill completely.

        For each full block i not yet in table.hashes: its key is block_hash(key of block i-1, its
        tokens); append it to table.hashes and, if no block holds that key yet, make this block the
        cached one (`cached[key] = block`, `key_of[block] = key`).
        """
        if not self.prefix_caching:
            return
        bs = self.block_size
        # BEGIN SOLUTION prefix_cow
        for i in range(len(table.hashes), num_computed // bs):
            prev = table.hashes[i - 1] if i else b""
            key = block_hash(prev, token_ids[i * bs : (i + 1) * bs])
            table.hashes.append(key)
            block = table.blocks[i]
            if key not in self.cached and block not in self.key_of:
                self.cached[key] = block
                self.key_of[block] = key
        # END SOLUTION

    def blocks_needed(self, table: BlockTable, start: int, end: int) -> int:
        """Free blocks that writing steps start..end-1 takes: new blocks past the table's end, plus
        one copy for every shared block (count > 1) that the write touches."""
        bs = self.block_size
        new = max(0, self.num_blocks_for(end) - len(table.blocks))
        touched = table.blocks[start // bs : self.num_blocks_for(end)]
        return new + sum(self.allocator.ref_counts[b] > 1 for b in touched)

    def copy_on_write(
        self, table: BlockTable, start: int, end: int, copy_block: Callable[[int, int], None]
    ) -> None:
        """Before steps start..end-1 are written: give the table a private copy of every block it
        shares (count > 1) among the blocks those steps fall in.

        For such a block: allocate a new one (`self._allocate()`), copy the contents
        (`copy_block(src, dst)`), drop this table's reference to the old one (allocator.free) and
        put the new one in its place; count it in cow_copies. Blocks held by this table alone are
        written in place.
        """
        bs = self.block_size
        # BEGIN SOLUTION prefix_cow
        for i in range(start // bs, min(len(table.blocks), self.num_blocks_for(end))):
            old = table.blocks[i]
            if self.allocator.ref_counts[old] > 1:
                new = self._allocate()
                copy_block(old, new)
                self.allocator.free(old)
                table.blocks[i] = new
                self.cow_copies += 1
        # END SOLUTION

    def prepare_write(
        self, table: BlockTable, start: int, end: int, copy_block: Callable[[int, int], None]
    ) -> None:
        """Make steps start..end-1 writable: copy-on-write, then grow the table to cover `end` steps.

        The caller checks `blocks_needed(...) <= num_free` first; NoFreeBlocks otherwise.
        """
        self.copy_on_write(table, start, end, copy_block)
        while len(table.blocks) < self.num_blocks_for(end):
            table.blocks.append(self._allocate())

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table holding the same blocks (each shared: count + 1), e.g. for parallel samples."""
        for block in table.blocks:
            self.allocator.share(block)
        return BlockTable(list(table.blocks), list(table.hashes))

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, last block first (so a prefix's first blocks stay cached
        longest: the free list hands out the earliest freed first), and empty it."""
        for block in reversed(table.blocks):
            self.allocator.free(block)
        table.blocks.clear()
        table.hashes.clear()


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

    def __init__(self, cache: PagedKVCache, spans: list[tuple[list[int], int, int]], device):
        """spans: (block table, start, n) per sequence, in row order.

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
        self.last = torch.tensor([s.offset + s.n - 1 for s in self.spans]).to(device)
        # the one-token spans (decoding), batched: their row index, padded block tables and lengths
        single = [s for s in self.spans if s.n == 1]
        self.single_idx = torch.tensor([s.offset for s in single], dtype=torch.long).to(device)
        if single:
            tables = torch.zeros(len(single), max(len(s.block_table) for s in single), dtype=torch.long)
            for b, s in enumerate(single):
                tables[b, : len(s.block_table)] = s.block_table
            self.single_tables = tables.to(device)
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

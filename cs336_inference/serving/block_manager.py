"""The block manager of a paged KV cache (vLLM): which fixed-size blocks of cache slots each sequence owns.

The cache memory is a pool of `num_blocks` blocks of `block_size` (B_s) token slots. A sequence owns
a list of block ids, its block table: step t lives in block table[t // B_s] at offset t % B_s, i.e.
at flat slot table[t // B_s] * B_s + t % B_s. Blocks are handed out one at a time as a sequence
grows, so the waste is at most one partly filled block per sequence (a contiguous cache reserves
max_seq_len slots up front).

    BlockAllocator   reference-counted blocks and a free list (a block may be shared)
    BlockManager     block tables: grow, free, prefix caching (a full block is found again by a hash
                     of its tokens chained with its prefix's hash), copy-on-write of shared blocks

The storage the slots address and attention over it: paged_attention.py.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


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
    # blocks[:dropped] were given back when they left every layer's sliding window: their ids stay
    # (attention never reads them, the window masks them) but this table no longer holds them
    dropped: int = 0


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
        table.hashes only grows, one key per full block in block order (blocks it already has are
        skipped); a partly filled last block gets no key. num_computed never exceeds the steps the
        table's blocks hold.
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
        written in place. Steps past the table's last block are left alone (prepare_write grows the
        table after this), and table.hashes is not changed: a copy holds the same tokens, so its key
        stays right, but only the old block is the cached one.
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
        for block in table.blocks[table.dropped :]:
            self.allocator.share(block)
        return BlockTable(list(table.blocks), list(table.hashes), table.dropped)

    def release_before(self, table: BlockTable, step: int) -> int:
        """Give back the blocks that hold only steps before `step` (no later query can see them: they
        left every layer's sliding window); returns how many. They stay in the prefix cache until
        reused, like any freed block."""
        end = min(max(step, 0) // self.block_size, len(table.blocks))
        for block in table.blocks[table.dropped : end]:
            self.allocator.free(block)
        released, table.dropped = max(0, end - table.dropped), max(table.dropped, end)
        return released

    def free(self, table: BlockTable) -> None:
        """Drop the table's references, last block first (so a prefix's first blocks stay cached
        longest: the free list hands out the earliest freed first), and empty it."""
        for block in reversed(table.blocks[table.dropped :]):
            self.allocator.free(block)
        table.blocks.clear()
        table.hashes.clear()
        table.dropped = 0

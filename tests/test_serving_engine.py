"""Serving: the paged KV cache (allocator, prefix cache, copy-on-write, paged attention), the scheduler
and the continuous-batching engine (every request completes, equals `generate` alone, no block leaks)."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
import torch
from einops import rearrange

from cs336_inference import ModelConfig, TransformerLM, generate
from cs336_inference.attention import attend, attention_mask
from cs336_inference.serving import LLMEngine, SamplingParams
from cs336_inference.serving.block_manager import (
    BlockAllocator,
    BlockManager,
    BlockTable,
    NoFreeBlocks,
    block_hash,
)
from cs336_inference.serving.paged_attention import (
    PagedBatch,
    PagedKVCache,
    gather_blocks,
    paged_attention,
    slot_mapping,
)
from cs336_inference.serving.request import Request
from cs336_inference.serving.scheduler import Scheduler

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_seq_len=96)
MLA_DIMS = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "cla": dict(n_layers=4, n_kv_heads=2, kv_share=2),
    "mla": dict(**MLA_DIMS),
    "mla_qlora": dict(**MLA_DIMS, q_lora_rank=16, rope_interleave=True),
}


def tiny_model(variant: str = "gqa", dtype=torch.float64) -> TransformerLM:
    """float64: the engine's chunked / batched passes and `generate` round differently in float32, and a
    near-tie between two logits could then flip a greedy token; in float64 it cannot by accident."""
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**TINY, **VARIANTS[variant]})).eval().to(dtype)


def alone(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """What `generate` gives for this prompt alone (the engine's reference)."""
    return generate(model, prompt, params=p).tolist()  # the same SamplingParams


def first_difference(got: list[int], expected: list[int]) -> str:
    i = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    return f"first difference at output token {i}: got {got[i : i + 5]}, expected {expected[i : i + 5]} (lengths {len(got)} vs {len(expected)})"


# ====================================================================================== block_allocator
@pytest.mark.graded(problem="block_allocator", points=2)
def test_allocator_hands_out_each_block_once_oldest_freed_first():
    alloc = BlockAllocator(5)
    got = [alloc.allocate() for _ in range(5)]
    assert sorted(got) == list(range(5)), (
        f"5 allocations from 5 free blocks gave {got}: each block exactly once"
    )
    assert alloc.ref_counts == [1] * 5, f"every allocated block has count 1, got counts {alloc.ref_counts}"
    assert alloc.num_free == 0, f"num_free after allocating all 5 blocks: {alloc.num_free}, expected 0"
    with pytest.raises(NoFreeBlocks):
        alloc.allocate()
    alloc.free(got[3])
    alloc.free(got[1])
    assert alloc.num_free == 2, f"num_free after freeing 2 blocks: {alloc.num_free}"
    again = [alloc.allocate(), alloc.allocate()]
    assert again == [got[3], got[1]], (
        f"freed {got[3]} then {got[1]}; allocate gave {again}: the block freed longest ago comes first "
        "(a block freed recently may still be found by the prefix cache)"
    )


@pytest.mark.graded(problem="block_allocator", points=2)
def test_allocator_reference_counts_share_and_double_free():
    alloc = BlockAllocator(4)
    b = alloc.allocate()
    alloc.share(b)
    assert alloc.ref_counts[b] == 2, f"allocate then share: count {alloc.ref_counts[b]}, expected 2"
    alloc.free(b)
    assert alloc.ref_counts[b] == 1, f"count 2 then free: {alloc.ref_counts[b]}, expected 1"
    assert b not in alloc.free_ids and alloc.num_free == 3, (
        f"block {b} still has an owner after one of two frees, yet free_ids = {list(alloc.free_ids)}"
    )
    alloc.free(b)
    assert alloc.ref_counts[b] == 0 and list(alloc.free_ids).count(b) == 1, (
        f"the last owner freed block {b}: count {alloc.ref_counts[b]}, free_ids {list(alloc.free_ids)}"
    )
    with pytest.raises(ValueError, match="double free"):
        alloc.free(b)
    assert alloc.ref_counts[b] == 0 and list(alloc.free_ids).count(b) == 1, (
        f"a refused double free changed block {b}: count {alloc.ref_counts[b]}, free_ids {list(alloc.free_ids)}"
    )
    alloc.share(b)  # a free block whose cached contents are wanted again
    assert alloc.ref_counts[b] == 1 and b not in alloc.free_ids, (
        f"share of free block {b}: count {alloc.ref_counts[b]}, expected 1, and it must leave free_ids "
        f"{list(alloc.free_ids)} (else allocate could hand it to someone else)"
    )


@pytest.mark.graded(problem="block_allocator", points=2)
def test_allocator_random_operations_keep_counts_consistent():
    """A random sequence of allocate / share / free against a shadow model of the counts."""
    rng = random.Random(0)
    n = 8
    alloc = BlockAllocator(n)
    counts = [0] * n
    free_order = OrderedDict((b, None) for b in range(n))
    for step in range(3000):
        op = rng.choice(["allocate", "share", "free", "free"])
        b = rng.randrange(n)
        where = f"operation {step} ({op}"
        if op == "allocate":
            if not free_order:
                with pytest.raises(NoFreeBlocks):
                    alloc.allocate()
                continue
            b = alloc.allocate()
            expected, _ = free_order.popitem(last=False)
            assert b == expected, f"{where}): got block {b}, expected {expected}, the block freed longest ago"
            counts[b] = 1
        elif op == "share":
            alloc.share(b)
            if counts[b] == 0:
                del free_order[b]
            counts[b] += 1
        elif counts[b] == 0:
            with pytest.raises(ValueError):
                alloc.free(b)
        else:
            alloc.free(b)
            counts[b] -= 1
            if counts[b] == 0:
                free_order[b] = None
        assert alloc.ref_counts == counts, (
            f"{where} of block {b}): counts {alloc.ref_counts}, expected {counts}"
        )
        assert list(alloc.free_ids) == list(free_order), (
            f"{where} of block {b}): free list {list(alloc.free_ids)}, expected {list(free_order)} "
            "(exactly the blocks with count 0, oldest freed first)"
        )


# ====================================================================================== prefix_cow
@pytest.mark.graded(problem="prefix_cow", points=2)
def test_block_hash_names_the_whole_prefix():
    a = block_hash(b"", [1, 2, 3, 4])
    assert isinstance(a, bytes), f"block_hash returns bytes (a digest), got {type(a).__name__}"
    assert a == block_hash(b"", [1, 2, 3, 4]), "block_hash must be deterministic"
    assert a != block_hash(b"", [4, 3, 2, 1]), "the same tokens in another order must give another key"
    assert a != block_hash(b"", [1, 2, 3, 5]), "blocks differing in one token must differ"
    b = block_hash(a, [5, 6, 7, 8])
    other_prefix = block_hash(block_hash(b"", [9, 9, 9, 9]), [5, 6, 7, 8])
    assert b != other_prefix, (
        "the same block of tokens after a different first block got the same key: the key must chain the "
        "previous block's key (a different prefix means different keys and values in that block)"
    )
    assert b != block_hash(b"", [5, 6, 7, 8]), "a second block's key must depend on the first block's key"
    assert b == block_hash(block_hash(b"", [1, 2, 3, 4]), [5, 6, 7, 8]), "equal prefixes must give equal keys"


def table_with_tokens(mgr: BlockManager, tokens: list[int]) -> BlockTable:
    table = BlockTable()
    mgr.prepare_write(table, 0, len(tokens), lambda src, dst: None)
    mgr.register_full_blocks(table, tokens, len(tokens))
    return table


@pytest.mark.graded(problem="prefix_cow", points=3)
def test_prefix_cache_finds_full_blocks_of_a_shared_prefix():
    mgr = BlockManager(8, 4)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # two full blocks and a partial one
    probe = BlockTable()
    assert mgr.match_prefix(probe, tokens) == 0 and probe.blocks == [], (
        "an empty prefix cache matched something"
    )
    a = table_with_tokens(mgr, tokens)
    assert len(a.hashes) == 2 and len(mgr.cached) == 2, (
        f"10 tokens in blocks of 4: the 2 full blocks are registered, got {len(a.hashes)} keys in the table "
        f"and {len(mgr.cached)} in the cache (a partial block must not be: it will still change)"
    )
    queries, hits = mgr.prefix_queries, mgr.prefix_hits
    b = BlockTable()
    matched = mgr.match_prefix(b, tokens[:8] + [7, 7, 7, 7, 7])
    assert matched == 2 and b.blocks == a.blocks[:2], (
        f"a prompt sharing the 8 first tokens matched {matched} blocks {b.blocks}, expected 2: {a.blocks[:2]}"
    )
    assert [mgr.ref_count(x) for x in b.blocks] == [2, 2], (
        f"shared blocks have 2 owners, got counts {[mgr.ref_count(x) for x in b.blocks]}"
    )
    assert (mgr.prefix_queries - queries, mgr.prefix_hits - hits) == (3, 2), (
        f"13 tokens = 3 full blocks looked up, 2 found: counted {mgr.prefix_queries - queries} queries, "
        f"{mgr.prefix_hits - hits} hits"
    )
    c = BlockTable()
    assert mgr.match_prefix(c, tokens[:6] + [0, 0, 0, 0]) == 1, (
        "a prompt diverging inside block 1 matches 1 block"
    )
    d = BlockTable()
    assert mgr.match_prefix(d, [0, 0, 0, 0] + tokens[4:8]) == 0, (
        "block 1's tokens after a different block 0 matched: the lookup must stop at the first miss "
        "and keys must chain the prefix"
    )
    a_blocks = list(a.blocks)
    for t in (a, b, c):
        mgr.free(t)
    assert mgr.num_free == 8, f"every table freed, yet {8 - mgr.num_free} blocks are in use"
    e = BlockTable()
    assert mgr.match_prefix(e, tokens) == 2 and e.blocks == a_blocks[:2], (
        f"all tables freed: the cached blocks {a_blocks[:2]} must still be found, matched {e.blocks}"
    )
    assert [mgr.ref_count(x) for x in e.blocks] == [1, 1] and mgr.num_free == 6, (
        f"matching 2 free cached blocks: counts {[mgr.ref_count(x) for x in e.blocks]} (expected 1 each), "
        f"{mgr.num_free} free (expected 6)"
    )
    mgr.free(e)
    other = table_with_tokens(mgr, list(range(30, 62)))  # takes all 8 blocks: the cached ones are reused
    assert mgr.match_prefix(BlockTable(), tokens) == 0, "blocks reused for other tokens are still matched"
    mgr.free(other)


@pytest.mark.graded(problem="prefix_cow", points=3)
def test_copy_on_write_gives_a_writer_its_own_copy():
    mgr = BlockManager(6, 4, prefix_caching=False)
    assert mgr.match_prefix(BlockTable(), [1, 2, 3, 4]) == 0, "prefix caching is off: nothing may match"
    store = torch.zeros(6, 4)
    copies = []

    def copy_block(src: int, dst: int) -> None:
        copies.append((src, dst))
        store[dst] = store[src]

    a = BlockTable()
    mgr.prepare_write(a, 0, 6, copy_block)
    for t in range(6):
        store[a.blocks[t // 4], t % 4] = 100 + t
    b = mgr.fork(a)  # a second sequence with the same 6 tokens, e.g. a parallel sample
    before = store.clone()
    mgr.copy_on_write(b, 6, 7, copy_block)
    assert b.blocks[0] == a.blocks[0] and b.blocks[1] != a.blocks[1], (
        f"writing step 6 (block 1) of a shared table: tables {a.blocks} and {b.blocks}; block 1 must be "
        "copied, block 0 (not written) kept shared"
    )
    assert copies == [(a.blocks[1], b.blocks[1])] and mgr.cow_copies == 1, f"copies made: {copies}"
    assert torch.equal(store[b.blocks[1]], before[a.blocks[1]]), (
        "the copy must hold the shared block's contents"
    )
    assert [mgr.ref_count(x) for x in (a.blocks[0], a.blocks[1], b.blocks[1])] == [2, 1, 1], (
        f"counts after the copy: shared block 0 -> {mgr.ref_count(a.blocks[0])} (expected 2), the old block 1 "
        f"-> {mgr.ref_count(a.blocks[1])} (expected 1), the copy -> {mgr.ref_count(b.blocks[1])} (expected 1)"
    )
    store[b.blocks[1], 2] = -1.0  # b writes its step 6
    assert store[a.blocks[1], 2] == 0.0, "b's write reached a's block"
    mgr.copy_on_write(b, 7, 8, copy_block)
    mgr.copy_on_write(a, 6, 8, copy_block)
    assert len(copies) == 1, f"blocks held by one table alone were copied again: {copies}"
    mgr.copy_on_write(a, 0, 8, copy_block)
    assert len(copies) == 2 and a.blocks[0] != b.blocks[0], "writing a shared block 0 must copy it"
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free == 6, f"{6 - mgr.num_free} blocks leaked"


# ====================================================================================== paged_attention
@pytest.mark.graded(problem="paged_attention", points=2)
def test_slot_mapping_and_gather_follow_the_block_table():
    table = torch.tensor([5, 2, 7])
    got = slot_mapping(table, 3, 10, 4).tolist()
    expected = [5 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 7 * 4, 7 * 4 + 1]
    assert got == expected, (
        f"slots of steps 3..9 with table [5, 2, 7] and blocks of 4: got {got}, expected {expected}"
    )
    store = torch.randn(8, 4, 2, 3)
    for length in (10, 8, 3, 1):
        expected = torch.cat([store[5], store[2], store[7]])[:length]
        got = gather_blocks(store, table, length)
        assert got.shape == expected.shape, (
            f"gather of {length} steps: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        )
        assert torch.equal(got, expected), f"gather of {length} steps from blocks [5, 2, 7]: wrong contents"


PAGED_CASES = [  # (N, K, window, start, T)
    (4, 4, None, 0, 6),
    (4, 2, None, 5, 1),
    (4, 1, None, 9, 3),
    (4, 2, 3, 7, 1),
    (4, 2, 4, 2, 7),
]


@pytest.mark.graded(problem="paged_attention", points=2)
@pytest.mark.parametrize("N,K,window,start,T", PAGED_CASES)
def test_paged_attention_equals_contiguous_attention(N, K, window, start, T):
    g = torch.Generator().manual_seed(start * 10 + T)
    S, bs, H = start + T, 4, 8
    k, v = torch.randn(S, K, H, generator=g), torch.randn(S, K, H, generator=g)
    q = torch.randn(N, T, H, generator=g)
    n_blocks = -(-S // bs)
    table = torch.randperm(12, generator=g)[:n_blocks]  # scattered; the last block partly filled
    k_store, v_store = torch.randn(12, bs, K, H, generator=g), torch.randn(12, bs, K, H, generator=g)
    k_store.view(-1, K, H)[slot_mapping(table, 0, S, bs)] = k
    v_store.view(-1, K, H)[slot_mapping(table, 0, S, bs)] = v
    got = paged_attention(q, k_store, v_store, table, start, H**-0.5, window)
    steps = torch.arange(S)
    mask = attention_mask(steps[start:], steps, window)
    kk, vv = (rearrange(x, "s k h -> 1 k s h") for x in (k, v))
    expected = attend(q[None], kk, vv, mask, H**-0.5)[0]
    case = f"N={N} K={K} window={window}, queries at steps {start}..{S - 1}, blocks {table.tolist()}"
    assert got.shape == expected.shape, f"{case}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    err = float((got - expected).abs().max())
    assert err < 1e-5, f"{case}: max |paged - contiguous| = {err:.2e}"


@pytest.mark.graded(problem="paged_attention", points=2)
@pytest.mark.parametrize("variant", ["gqa", "sliding", "cla", "mla"])
def test_forward_paged_equals_the_full_forward(variant):
    """Three sequences in scattered blocks: prompt chunks of different lengths, then one token each."""
    model = tiny_model(variant, torch.float32)
    g = torch.Generator().manual_seed(1)
    lengths, bs = [9, 4, 13], 4
    seqs = [torch.randint(0, 61, (n + 1,), generator=g) for n in lengths]
    perm = torch.randperm(16, generator=g).tolist()
    tables = [perm[0:3], perm[3:5], perm[5:9]]
    cache = PagedKVCache(model.config, 16, bs, torch.float32, "cpu")
    with torch.no_grad():
        chunk = PagedBatch(cache, [(t, 0, n) for t, n in zip(tables, lengths, strict=True)], "cpu")
        prefill = model.forward_paged(torch.cat([s[:n] for s, n in zip(seqs, lengths, strict=True)]), chunk)
        step = PagedBatch(cache, [(t, n, 1) for t, n in zip(tables, lengths, strict=True)], "cpu")
        decode = model.forward_paged(torch.stack([s[n] for s, n in zip(seqs, lengths, strict=True)]), step)
        for i, s in enumerate(seqs):
            full = model(s[None])[0]
            for what, got, pos in [
                ("prefill", prefill[i], lengths[i] - 1),
                ("decode", decode[i], lengths[i]),
            ]:
                err = float((got - full[pos]).abs().max())
                assert err < 1e-4, (
                    f"variant {variant}, sequence {i} (blocks {tables[i]}), {what} logits at step {pos}: "
                    f"max |paged - full forward| = {err:.2e}"
                )


# ====================================================================================== scheduler
def make_scheduler(num_blocks: int, block_size: int, max_tokens: int, max_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), lambda src, dst: None, max_tokens, max_seqs)


def make_seq(i: int, n: int) -> Request:
    tokens = [(7 * i + 3 * t) % 50 + 1 for t in range(n)]
    return Request(f"r{i}", tokens, n, SamplingParams(), 0.0, i)


def complete(scheduled) -> None:
    """What the engine does after the forward: the tokens are computed; a finished prompt samples one."""
    for seq, n in scheduled:
        seq.num_computed += n
        if seq.remaining == 0:
            seq.token_ids.append(0)


def names(scheduled) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in scheduled]


@pytest.mark.graded(problem="scheduler", points=2)
def test_scheduler_admits_in_order_within_the_token_budget():
    sched = make_scheduler(32, 4, max_tokens=10)
    seqs = [make_seq(i, n) for i, n in enumerate([4, 3, 6, 2])]
    sched.waiting.extend(seqs)
    first = sched.schedule()
    assert names(first) == [("r0", 4), ("r1", 3), ("r2", 3)], (
        f"budget 10, prompts of 4, 3, 6, 2: scheduled {names(first)}, expected r0 whole, r1 whole, the first 3 "
        "tokens of r2 (chunked prefill), r3 waiting"
    )
    assert [s.request_id for s in sched.running] == ["r0", "r1", "r2"], (
        "admitted requests join `running` in order"
    )
    assert [s.request_id for s in sched.waiting] == ["r3"], (
        f"waiting: {[s.request_id for s in sched.waiting]}"
    )
    blocks = [len(s.table.blocks) for s in seqs[:3]]
    assert blocks == [1, 1, 1], (
        f"blocks reserved for 4, 3 and 3 tokens in blocks of 4: {blocks}, expected 1 each"
    )
    complete(first)
    second = sched.schedule()
    assert names(second) == [("r0", 1), ("r1", 1), ("r2", 3), ("r3", 2)], (
        f"step 2: scheduled {names(second)}, expected r0 and r1 decoding one token each, the rest of r2's "
        "prompt, then r3 admitted"
    )
    assert len(seqs[0].table.blocks) == 2 and len(seqs[2].table.blocks) == 2, (
        "r0 writes step 4 and r2 steps 3..5: each needs a second block"
    )


@pytest.mark.graded(problem="scheduler", points=2)
def test_scheduler_decodes_first_and_caps_the_batch():
    sched = make_scheduler(32, 4, max_tokens=20, max_seqs=2)
    sched.waiting.extend([make_seq(0, 2), make_seq(1, 30), make_seq(2, 2)])
    first = sched.schedule()
    assert names(first) == [("r0", 2), ("r1", 18)], (
        f"max_batch_seqs=2, budget 20: scheduled {names(first)}, expected r0 whole and 18 tokens of r1; "
        "r2 must wait (two sequences run)"
    )
    complete(first)
    sched.max_batch_tokens = 5
    second = sched.schedule()
    assert names(second) == [("r0", 1), ("r1", 4)], (
        f"budget 5, r0 decoding, r1 with 12 prompt tokens left: scheduled {names(second)}, expected r0's one "
        "decode token first, then 4 tokens of r1's prompt (a long prompt must not stall decoding)"
    )
    assert [s.request_id for s in sched.waiting] == ["r2"], "r2 still waits for a free place in the batch"


@pytest.mark.graded(problem="scheduler", points=2)
def test_scheduler_preempts_the_newest_when_blocks_run_out():
    sched = make_scheduler(4, 2, max_tokens=16)
    s0, s1 = make_seq(0, 3), make_seq(1, 3)
    sched.waiting.extend([s0, s1])
    for _ in range(2):  # prefill both (2 blocks each: all 4 used), then one decode step each
        complete(sched.schedule())
    assert sched.blocks.num_free == 0 and s0.remaining == 1 == s1.remaining, "setup: 4 of 4 blocks in use"
    sched.max_batch_tokens = 3
    third = sched.schedule()
    assert names(third) == [("r0", 1)], (
        f"r0 needs a third block and none is free: scheduled {names(third)}, expected only r0 (r1, the newest, "
        "preempted to make room, and not admitted again in the step that preempted it)"
    )
    assert [s.request_id for s in sched.running] == ["r0"] and list(sched.waiting) == [s1], (
        f"after preempting r1: running {[s.request_id for s in sched.running]}, waiting "
        f"{[s.request_id for s in sched.waiting]} (a preempted request goes back to the FRONT of the queue)"
    )
    assert s1.table.blocks == [] and s1.num_computed == 0 and len(s1.token_ids) == 5, (
        f"preempted r1: blocks {s1.table.blocks} (expected none), num_computed {s1.num_computed} (expected 0: "
        f"recomputed later), {len(s1.token_ids)} tokens (expected 5: prompt and output are kept)"
    )
    assert sched.preemptions == 1 and s1.preemptions == 1, f"preemptions counted: {sched.preemptions}"
    assert len(s0.table.blocks) == 3 and sched.blocks.num_free == 1, (
        f"r0 holds {len(s0.table.blocks)} blocks, {sched.blocks.num_free} free; expected 3 and 1"
    )
    complete(third)
    fourth = sched.schedule()
    assert names(fourth) == [("r0", 1), ("r1", 2)], (
        f"next step, budget 3: scheduled {names(fourth)}, expected r0's decode and the first 2 of r1's 5 "
        "tokens (prompt and output, recomputed) in the free block"
    )


@pytest.mark.graded(problem="scheduler", points=1)
def test_scheduler_admission_stops_at_the_first_request_that_does_not_fit():
    sched = make_scheduler(4, 2, max_tokens=20)
    s0 = make_seq(0, 4)
    sched.waiting.append(s0)
    complete(sched.schedule())  # r0: 4 tokens, 2 blocks
    sched.blocks.register_full_blocks(s0.table, s0.token_ids, s0.num_computed)
    s1 = make_seq(1, 7)
    s1.token_ids[:2] = s0.token_ids[:2]  # shares r0's first block: the prefix cache finds it
    s2 = make_seq(2, 1)
    sched.waiting.extend([s1, s2])
    got = sched.schedule()
    assert names(got) == [("r0", 1)], (
        f"scheduled {names(got)}: r0 decodes into a third block; r1 needs 3 more blocks for its 7 tokens and "
        "1 is free, so it waits, and r2 behind it waits too (first come, first served: skipping r1 could "
        "starve it)"
    )
    assert list(sched.waiting) == [s1, s2], f"waiting: {[s.request_id for s in sched.waiting]}"
    assert s1.table.blocks == [] and s1.num_computed == 0, (
        f"r1 was not admitted but holds blocks {s1.table.blocks} (num_computed {s1.num_computed}): the blocks "
        "its prefix lookup took must be given back"
    )
    assert sched.blocks.ref_count(s0.table.blocks[0]) == 1, "r0's first block still counts r1 as an owner"


@pytest.mark.graded(problem="scheduler", points=1)
def test_scheduler_never_preempts_a_sequence_already_scheduled():
    sched = make_scheduler(6, 2, max_tokens=10)
    s0, s1, s2 = make_seq(0, 5), make_seq(1, 6), make_seq(2, 4)
    for seq, computed in [(s0, 4), (s1, 2), (s2, 3)]:  # s0, s2 decoding; s1 (older than s2) mid-prefill
        sched.blocks.prepare_write(seq.table, 0, computed, sched.copy_block)
        seq.num_computed = computed
    sched.running = [s0, s1, s2]
    assert sched.blocks.num_free == 1, "setup: 5 of 6 blocks in use"
    got = sched.schedule()
    assert names(got) == [("r0", 1), ("r2", 1)], (
        f"scheduled {names(got)}, expected the decoders r0 (taking the last free block) and r2 (room in its "
        "block); r1's chunk then needs 2 blocks and the only sequence not yet scheduled is r1 itself"
    )
    assert [s.request_id for s in sched.running] == ["r0", "r2"] and list(sched.waiting) == [s1], (
        f"running {[s.request_id for s in sched.running]}, waiting {[s.request_id for s in sched.waiting]}: "
        "r2 is the newest but already scheduled in this step, so r1 is the one preempted"
    )
    assert len(s2.table.blocks) == 2 and s1.table.blocks == [], "r2 keeps its blocks, r1 gives its block back"


# ====================================================================================== the engine (ungraded)
def random_workload(
    n: int, seed: int, max_prompt: int = 40, max_new: int = 12, shared: list[int] | None = None
):
    rng = random.Random(seed)
    prompts, params, arrivals = [], [], []
    for _ in range(n):
        length = rng.randint(1, max_prompt)
        prompt = [rng.randrange(61) for _ in range(length)]
        if shared is not None and rng.random() < 0.7:
            prompt = shared + prompt[: rng.randint(0, 8)]
        prompts.append(prompt)
        params.append(SamplingParams(max_new_tokens=rng.randint(1, max_new)))
        arrivals.append(rng.randint(0, 3 * n // 2))
    return prompts, params, arrivals


def run_with_arrivals(engine: LLMEngine, prompts, params, arrivals, check=None) -> list[list[int]]:
    """Add each request at its arrival step, step until all are done; every step check invariants."""
    out: dict[str, list[int]] = {}
    ids = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step, nxt = 0, 0
    while nxt < len(order) or engine.has_unfinished():
        while nxt < len(order) and arrivals[order[nxt]] <= step:
            i = order[nxt]
            ids[i] = engine.add_request(prompts[i], params[i])
            out[ids[i]] = []
            nxt += 1
        for o in engine.step():
            assert not o.finished or o.finish_reason in ("stop", "length"), (
                f"{o.request_id}: {o.finish_reason}"
            )
            out[o.request_id].extend(o.new_token_ids)
        if check is not None:
            check(engine)
        step += 1
        assert step < 100_000, "the engine stopped making progress"
    return [out[i] for i in ids]


def check_block_accounting(engine: LLMEngine) -> None:
    """Counts = number of tables holding each block; shared blocks are counted once in the used total."""
    holders: dict[int, int] = {}
    for seq in engine.scheduler.running:
        for b in seq.table.blocks:
            holders[b] = holders.get(b, 0) + 1
    for seq in engine.scheduler.waiting:
        assert not seq.table.blocks, f"waiting {seq.request_id} holds blocks {seq.table.blocks}"
    counts = engine.blocks.allocator.ref_counts
    assert all(counts[b] == holders.get(b, 0) for b in range(len(counts))), (
        "reference counts != table holders"
    )
    assert engine.stats()["used_blocks"] == len(holders), "used blocks != distinct blocks held"


def assert_same_as_alone(model, prompts, params, outs) -> None:
    bad = [
        i for i, (p, sp, o) in enumerate(zip(prompts, params, outs, strict=True)) if o != alone(model, p, sp)
    ]
    if bad:
        i = bad[0]
        raise AssertionError(
            f"{len(bad)} of {len(prompts)} requests differ from generate alone; request {i} (prompt of "
            f"{len(prompts[i])}): {first_difference(outs[i], alone(model, prompts[i], params[i]))}"
        )


def test_engine_under_pressure_every_request_completes_as_alone():
    model = tiny_model("gqa")
    prompts, params, arrivals = random_workload(200, seed=0, max_new=10)
    engine = LLMEngine(
        model, num_blocks=16, block_size=4, max_batch_tokens=24, max_batch_seqs=8, prefix_caching=False
    )
    outs = run_with_arrivals(engine, prompts, params, arrivals, check=check_block_accounting)
    stats = engine.stats()
    assert stats["preemptions"] > 20, f"the block budget was meant to force preemption: {stats}"
    assert stats["free_blocks"] == stats["num_blocks"], f"blocks leaked: {stats}"
    assert [len(o) for o in outs] == [p.max_new_tokens for p in params], "a request lost or gained tokens"
    assert_same_as_alone(model, prompts, params, outs)


@pytest.mark.parametrize("path", ["readable", "fast", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_keep_hidden_gives_each_sample_the_features_of_its_whole_sequence(path):
    """LLMEngine(keep_hidden=True), what a draft head's training data is taken from: each finished
    sample carries the final norm's output at every position of prompt + output but the last, as the
    model's own forward over that sequence gives it (return_hidden), through prompt chunks, preemption
    (a sequence recomputed from its first token), a prompt prefix shared with others (the prefix cache
    is off: a block taken from it would never be computed) and n = 2 samples forked from one prompt."""
    model = tiny_model("gqa", torch.float32)
    if path == "fast":
        from cs336_inference.fast import install
        from cs336_inference.fast.cpu import build

        if build.library() is None:
            pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")
        install(model)
    if path == "cuda":
        model = model.to("cuda")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 61, (9,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 61, (n,), generator=g).tolist() for n in (1, 14, 30, 6, 22)]
    params = [SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[])] * 4
    params.append(SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, n=2, stop_token_ids=[]))
    for blocks in (16, 64):  # preempting (the forked sample among others), and not
        engine = LLMEngine(
            model, blocks, block_size=4, max_batch_tokens=8, max_batch_seqs=4, keep_hidden=True
        )
        outs = engine.run(prompts, params)
        preempted = engine.stats()["preemptions"]
        assert (preempted > 0) == (blocks == 16), f"{blocks} blocks: {preempted} preemptions"
        for i, (prompt, samples) in enumerate(zip(prompts, outs, strict=True)):
            for out in samples:
                case = f"{path}, {blocks} blocks, request {i} sample {out.index}"
                seq = prompt + out.new_token_ids
                with torch.inference_mode():
                    _, h = model(
                        torch.tensor(seq, device=model.embed.weight.device)[None], return_hidden=True
                    )
                got = None if out.hidden is None else tuple(out.hidden.shape)
                assert got == (len(seq) - 1, 32), f"{case}: features {got}, expected {(len(seq) - 1, 32)}"
                torch.testing.assert_close(
                    out.hidden, h[0, :-1].cpu(), atol=1e-4, rtol=1e-4, msg=lambda m, case=case: f"{case}: {m}"
                )
    plain = LLMEngine(model, num_blocks=16, block_size=4, max_batch_tokens=8, max_batch_seqs=4)
    assert all(o.hidden is None for samples in plain.run(prompts[:2], params[:2]) for o in samples)
    with pytest.raises(ValueError, match="keep_hidden needs a TransformerLM"):
        LLMEngine(torch.nn.Linear(2, 2), keep_hidden=True)  # e.g. a tensor-parallel shard's wrapper


def test_static_batching_admits_a_batch_only_when_the_last_has_finished():
    """static_batching=True: requests arriving while a batch runs wait for all of it to finish; every
    request still decodes as generate alone."""
    model = tiny_model("gqa")
    prompts, params, arrivals = random_workload(30, seed=4, max_new=10)
    engine = LLMEngine(model, num_blocks=64, block_size=4, max_batch_seqs=6, static_batching=True)

    batches, last = [], set()

    def check(engine):
        running = {s.request_id for s in engine.scheduler.running}
        if running - last and last - running == set() and last:
            raise AssertionError(f"admitted {sorted(running - last)} while {sorted(last)} still ran")
        if running and not (running & last):
            batches.append(running)
        last.clear()
        last.update(running)

    outs = run_with_arrivals(engine, prompts, params, arrivals, check=check)
    assert len(batches) > 3, f"expected several static batches, got {batches}"
    assert_same_as_alone(model, prompts, params, outs)


def test_engine_prefix_sharing_counts_shared_blocks_once_and_keeps_outputs():
    model = tiny_model("mha")
    shared = [random.Random(5).randrange(61) for _ in range(13)]  # 3 full blocks of 4 and one token
    prompts, params, arrivals = random_workload(120, seed=1, max_prompt=20, shared=shared)
    engine = LLMEngine(model, num_blocks=20, block_size=4, max_batch_tokens=32, max_batch_seqs=8)
    peak_sharing = []

    def check(engine):
        check_block_accounting(engine)
        total = sum(len(s.table.blocks) for s in engine.scheduler.running)
        peak_sharing.append(total - engine.stats()["used_blocks"])

    outs = run_with_arrivals(engine, prompts, params, arrivals, check=check)
    stats = engine.stats()
    assert stats["prefix_hits"] > 100, (
        f"a common 3-block prefix in 70% of the prompts hit the cache rarely: {stats}"
    )
    assert max(peak_sharing) >= 3, "running sequences never shared a block"
    assert stats["free_blocks"] == stats["num_blocks"], f"blocks leaked: {stats}"
    assert_same_as_alone(model, prompts, params, outs)


@pytest.mark.parametrize("variant", ["mqa", "hybrid", "mla_qlora"])
def test_engine_sampling_at_fixed_seeds_is_the_same_as_alone(variant):
    model = tiny_model(variant)
    prompts, params, arrivals = random_workload(40, seed=2, max_prompt=24)
    rng = random.Random(3)
    for i, p in enumerate(params):
        p.temperature = rng.choice([0.0, 0.7, 1.0, 1.5])
        p.top_k = rng.choice([None, 5, 20])
        p.top_p = rng.choice([None, 0.9])
        p.seed = i
        p.stop_token_ids = (rng.randrange(61),)
    engine = LLMEngine(model, num_blocks=12, block_size=4, max_batch_tokens=16, max_batch_seqs=6)
    outs = run_with_arrivals(engine, prompts, params, arrivals, check=check_block_accounting)
    assert engine.stats()["preemptions"] > 0 and engine.stats()["free_blocks"] == 12, engine.stats()
    assert_same_as_alone(model, prompts, params, outs)


def test_copy_on_write_isolates_requests_that_share_a_prompt_then_diverge():
    model = tiny_model("gqa")
    prompt = [random.Random(7).randrange(61) for _ in range(12)]  # exactly 3 blocks of 4
    engine = LLMEngine(model, num_blocks=16, block_size=4, max_batch_tokens=64)
    first = engine.generate([prompt], SamplingParams(max_new_tokens=1))[0]
    assert first == alone(model, prompt, SamplingParams(max_new_tokens=1))
    params = [SamplingParams(max_new_tokens=10, temperature=1.5, seed=s) for s in (1, 2)]
    outs = engine.generate([prompt, prompt], params)
    assert outs[0] != outs[1], "the two seeds were meant to diverge"
    assert engine.stats()["prefix_hits"] >= 6 and engine.stats()["cow_copies"] >= 1, engine.stats()
    for o, p in zip(outs, params, strict=True):
        expected = alone(model, prompt, p)
        assert o == expected, f"seed {p.seed}: {first_difference(o, expected)}"
    assert engine.stats()["free_blocks"] == 16


def test_abort_frees_blocks_and_bad_requests_are_one_line_errors():
    model = tiny_model("gqa")
    engine = LLMEngine(model, num_blocks=8, block_size=4)
    rid = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=20))
    keep = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    engine.step()
    assert engine.stats()["free_blocks"] < 8
    engine.abort(rid)
    engine.abort("no-such-request")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert any(o.request_id == rid and o.finish_reason == "abort" for o in outs)
    assert engine.stats()["free_blocks"] == 8, engine.stats()
    metrics = engine.request_metrics(keep)
    assert metrics["output_tokens"] == 3 and metrics["ttft"] >= 0 and metrics["e2e"] >= metrics["ttft"]
    for prompt, params, message in [
        ([], None, "empty"),
        ([1] * 90, SamplingParams(max_new_tokens=10), "context window"),
        ([1] * 30, SamplingParams(max_new_tokens=10), "KV blocks"),
        ([61], None, r"\[0, 61\)"),
        ([1], SamplingParams(temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1], SamplingParams(max_new_tokens=2), request_id=keep)


# ====================================================================================== CUDA
@pytest.mark.cuda
def test_engine_on_cuda_equals_generate():
    model = tiny_model("gqa", torch.float32).cuda()
    prompts, params, arrivals = random_workload(24, seed=4, max_prompt=30)
    engine = LLMEngine(model, num_blocks=12, block_size=4, max_batch_tokens=16, max_batch_seqs=6)
    outs = run_with_arrivals(engine, prompts, params, arrivals, check=check_block_accounting)
    assert engine.stats()["free_blocks"] == 12
    assert_same_as_alone(model, prompts, params, outs)


@pytest.mark.cuda
def test_batched_decode_of_16_sequences_costs_less_than_3x_one():
    """Decode is memory-bound: one step reads every weight once, for 1 sequence or for 16 (Part 3).
    A SmolLM2-shaped model (random weights, bf16); CUDA events around whole engine steps after warm-up."""
    cfg = ModelConfig(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536, max_seq_len=2048,
        tie_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = TransformerLM(cfg).to(torch.bfloat16).eval()

    def median_step_ms(B: int) -> float:
        engine = LLMEngine(
            model, num_blocks=16 * B + 16, block_size=16, max_batch_tokens=8192, max_batch_seqs=16
        )
        g = torch.Generator().manual_seed(B)
        for _ in range(B):
            engine.add_request(
                torch.randint(0, 49152, (128,), generator=g), SamplingParams(max_new_tokens=64)
            )
        engine.step()  # prefill of all B prompts
        for _ in range(5):
            engine.step()
        times = []
        for _ in range(21):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs = engine.step()
            end.record()
            torch.cuda.synchronize()
            assert len(outs) == B, f"batch {B}: a step produced {len(outs)} tokens"
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    one, sixteen = median_step_ms(1), median_step_ms(16)
    assert sixteen < 3 * one, f"a decode step of 16 sequences took {sixteen:.2f} ms, of one {one:.2f} ms"


def test_finished_history_is_bounded():
    """A long-running server must not keep every finished request: the oldest are forgotten."""
    engine = LLMEngine(tiny_model("gqa"), num_blocks=16, block_size=4)
    engine.keep_finished = 3
    ids = [engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2)) for _ in range(5)]
    while engine.has_unfinished():
        engine.step()
    assert list(engine.finished) == ids[2:], f"expected the last 3 finished ids, got {list(engine.finished)}"
    assert engine.request_metrics(ids[-1])["output_tokens"] == 2

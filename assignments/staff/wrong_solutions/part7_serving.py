"""Wrong solutions for Part 7 (serving: paged KV cache, prefix caching, scheduler) (staff only).

Each entry is a small patch of one problem's solution code. Applied alone, it must make that
problem's graded tests lose points (the other problems are graded with the reference code).
"""

BLOCKS = "cs336_inference/serving/block_manager.py"
ATTENTION = "cs336_inference/serving/paged_attention.py"
SCHEDULER = "cs336_inference/serving/scheduler.py"

WRONG = [
    # ------------------------------------------------------------------------------ block_allocator
    dict(
        problem="block_allocator",
        name="free_list_as_stack",
        mistake="pops the most recently freed block (a stack), so the blocks the prefix cache would find "
        "again are the first to be overwritten",
        file=BLOCKS,
        find="block, _ = self.free_ids.popitem(last=False)",
        replace="block, _ = self.free_ids.popitem()",
    ),
    dict(
        problem="block_allocator",
        name="free_releases_shared_block",
        mistake="returns a block to the free list on every free, even while another table still holds it",
        file=BLOCKS,
        find="""        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_ids[block] = None""",
        replace="""        self.ref_counts[block] -= 1
        self.free_ids[block] = None""",
    ),
    dict(
        problem="block_allocator",
        name="no_double_free_check",
        mistake="trusts callers: a double free drives the count negative instead of raising",
        file=BLOCKS,
        find="""        if self.ref_counts[block] == 0:
            raise ValueError(f"double free of KV block {block}: its reference count is already 0")
""",
        replace="",
    ),
    dict(
        problem="block_allocator",
        name="share_leaves_block_on_free_list",
        mistake="share only increments the count: a free cached block that is shared again stays on the "
        "free list, and allocate hands it to a second sequence",
        file=BLOCKS,
        find="""        if self.ref_counts[block] == 0:
            del self.free_ids[block]
""",
        replace="",
    ),
    dict(
        problem="block_allocator",
        name="allocate_forgets_count",
        mistake="takes a block off the free list without setting its count, so its first free is a double free",
        file=BLOCKS,
        find="""        self.ref_counts[block] = 1
        return block""",
        replace="""        return block""",
    ),
    # ------------------------------------------------------------------------------ prefix_cow
    dict(
        problem="prefix_cow",
        name="hash_not_chained",
        mistake="hashes only the block's own tokens: the same 16 tokens after a different prefix match, "
        "although their keys and values differ",
        file=BLOCKS,
        find="digest = hashlib.blake2b(prev, digest_size=16)",
        replace="digest = hashlib.blake2b(digest_size=16)",
    ),
    dict(
        problem="prefix_cow",
        name="match_forgets_to_chain",
        mistake="never advances the previous key while walking the prompt, so every block after the first is "
        "looked up as if it began the prompt",
        file=BLOCKS,
        find="""            self.prefix_hits += 1
            prev = key""",
        replace="""            self.prefix_hits += 1""",
    ),
    dict(
        problem="prefix_cow",
        name="match_does_not_share",
        mistake="appends the cached block to the table without taking a reference: the first owner's free "
        "returns it to the free list while the second still reads it",
        file=BLOCKS,
        find="""            self.allocator.share(block)
            table.blocks.append(block)""",
        replace="""            table.blocks.append(block)""",
    ),
    dict(
        problem="prefix_cow",
        name="registers_partial_blocks",
        mistake="registers the last, partly filled block too (rounds up): its key then names tokens that are "
        "not all there yet",
        file=BLOCKS,
        find="for i in range(len(table.hashes), num_computed // bs):",
        replace="for i in range(len(table.hashes), -(-num_computed // bs)):",
    ),
    dict(
        problem="prefix_cow",
        name="cow_without_copying_contents",
        mistake="gives the writer a fresh block but never copies the shared block's contents into it",
        file=BLOCKS,
        find="""                copy_block(old, new)
""",
        replace="",
    ),
    dict(
        problem="prefix_cow",
        name="cow_keeps_old_reference",
        mistake="swaps in the copy but never drops the table's reference to the shared block (a leak)",
        file=BLOCKS,
        find="""                self.allocator.free(old)
                table.blocks[i] = new""",
        replace="""                table.blocks[i] = new""",
    ),
    dict(
        problem="prefix_cow",
        name="cow_copies_every_block",
        mistake="copies every block written to, shared or not (count >= 1): correct outputs, wasted blocks",
        file=BLOCKS,
        find="if self.allocator.ref_counts[old] > 1:",
        replace="if self.allocator.ref_counts[old] >= 1:",
    ),
    # ------------------------------------------------------------------------------ paged_attention
    dict(
        problem="paged_attention",
        name="slot_forgets_block_size",
        mistake="adds the offset to the block id instead of to block_id * block_size",
        file=ATTENTION,
        find="return block_table[steps // block_size] * block_size + steps % block_size",
        replace="return block_table[steps // block_size] + steps % block_size",
    ),
    dict(
        problem="paged_attention",
        name="gather_keeps_whole_last_block",
        mistake="returns every slot of the gathered blocks, the unwritten rest of the last block included",
        file=ATTENTION,
        find="return store[block_table[:n]].flatten(0, 1)[:length]",
        replace="return store[block_table[:n]].flatten(0, 1)",
    ),
    dict(
        problem="paged_attention",
        name="gather_offset_major",
        mistake="flattens [blocks, offsets] in the wrong order (offset-major), interleaving the blocks' steps",
        file=ATTENTION,
        find="return store[block_table[:n]].flatten(0, 1)[:length]",
        replace="return store[block_table[:n]].transpose(0, 1).flatten(0, 1)[:length]",
    ),
    dict(
        problem="paged_attention",
        name="queries_start_at_zero",
        mistake="builds the mask as if the queries were steps 0..T-1, forgetting that they start at `start`",
        file=ATTENTION,
        find="mask = attention_mask(steps[start:], steps, window)",
        replace="mask = attention_mask(steps[: q.shape[1]], steps, window)",
    ),
    dict(
        problem="paged_attention",
        name="drops_the_window",
        mistake="masks causally but forgets the sliding window",
        file=ATTENTION,
        find="mask = attention_mask(steps[start:], steps, window)",
        replace="mask = attention_mask(steps[start:], steps)",
    ),
    # ------------------------------------------------------------------------------ scheduler
    dict(
        problem="scheduler",
        name="no_decode_priority",
        mistake="serves running sequences in admission order, so a long prompt chunk ahead of them eats the "
        "budget and decoding sequences stall",
        file=SCHEDULER,
        find="order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]",
        replace="order = list(self.running)",
    ),
    dict(
        problem="scheduler",
        name="preempts_the_oldest",
        mistake="preempts the oldest unscheduled sequence, throwing away the most work (and starving it)",
        file=SCHEDULER,
        find="victim = next(s for s in reversed(self.running) if id(s) not in done)",
        replace="victim = next(s for s in self.running if id(s) not in done)",
    ),
    dict(
        problem="scheduler",
        name="victim_may_be_scheduled",
        mistake="always preempts the last running sequence, even one already scheduled in this step: its "
        "blocks are freed while the step still writes to them",
        file=SCHEDULER,
        find="victim = next(s for s in reversed(self.running) if id(s) not in done)",
        replace="victim = self.running[-1]",
    ),
    dict(
        problem="scheduler",
        name="admits_after_preemption",
        mistake="admits waiting requests in the same step that preempted, so the victim can be readmitted "
        "at once and preempted again (thrashing)",
        file=SCHEDULER,
        find="while self.waiting and not preempted and budget > 0",
        replace="while self.waiting and budget > 0",
    ),
    dict(
        problem="scheduler",
        name="keeps_prefix_blocks_when_waiting",
        mistake="leaves the blocks the prefix lookup took with a request that could not be admitted",
        file=SCHEDULER,
        find="""            if not self.fits(seq, n):
                self.blocks.free(seq.table)
                seq.num_computed = 0
                break""",
        replace="""            if not self.fits(seq, n):
                break""",
    ),
    dict(
        problem="scheduler",
        name="admission_ignores_budget",
        mistake="admits a new request's whole prompt whatever the token budget (no chunked prefill)",
        file=SCHEDULER,
        find="""            n = min(seq.remaining, budget)
            if not self.fits(seq, n):""",
        replace="""            n = seq.remaining
            if not self.fits(seq, n):""",
    ),
]

"""The scheduler of continuous batching (Orca's iteration-level scheduling): at every step, which
sequences run and how many of their tokens, within the block budget; who is preempted when the
blocks run out (the newest running sequence, recomputed later)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .block_manager import BlockManager
from .request import Request


class Scheduler:
    """Waiting queue (FIFO) and running list (admission order); decides each step's work."""

    def __init__(
        self,
        blocks: BlockManager,
        copy_block: Callable[[int, int], None],
        max_batch_tokens: int,
        max_batch_seqs: int,
    ):
        self.blocks = blocks
        self.copy_block = copy_block
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_seqs = max_batch_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    def fits(self, seq: Request, n: int) -> bool:
        """Whether computing seq's next n tokens finds the blocks it needs free."""
        return (
            self.blocks.blocks_needed(seq.table, seq.num_computed, seq.num_computed + n)
            <= self.blocks.num_free
        )

    def reserve(self, seq: Request, n: int) -> None:
        """Make the blocks for seq's next n tokens writable (copy-on-write, new blocks)."""
        self.blocks.prepare_write(seq.table, seq.num_computed, seq.num_computed + n, self.copy_block)

    def preempt(self, seq: Request) -> None:
        """Recompute later: free seq's blocks, forget its cache, put it at the front of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq.table)
        seq.num_computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def match_prefix(self, seq: Request) -> None:
        """Start a waiting sequence from the prefix cache: its cached full blocks count as computed
        (all but the last token: its logits are needed, so it is recomputed, copy-on-write). A
        request that wants its prompt's log-probabilities needs the logits of every prompt token, so
        it starts from nothing."""
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            return
        matched = self.blocks.match_prefix(seq.table, seq.token_ids)
        seq.num_computed = min(matched * self.blocks.block_size, len(seq.token_ids) - 1)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (sequence, number of its tokens to compute) pairs; blocks reserved.

        1. Running sequences, those decoding (remaining == 1) first, then those still prefilling,
           oldest first within each: n = min(remaining, budget left) tokens each (budget:
           max_batch_tokens per step). While seq does not `fits`, preempt the newest running
           sequence not scheduled yet in this step (possibly seq itself, which is then skipped).
           Then `reserve` its blocks, append (seq, n), and take n from the budget.
        2. Only if nobody was preempted in this step: admit waiting sequences in order while the
           budget is not spent and fewer than max_batch_seqs are running: `match_prefix` first
           (unless it already holds blocks), n = min(remaining, budget); if it does not fit, give
           the matched blocks back (blocks.free(seq.table), num_computed = 0) and stop admitting;
           else move it to `running`, `reserve`, append (seq, n), take n from the budget.
        """
        budget = self.max_batch_tokens
        scheduled: list[tuple[Request, int]] = []
        # BEGIN SOLUTION scheduler
        done: set[int] = set()
        preempted = False
        order = [s for s in self.running if s.remaining == 1] + [s for s in self.running if s.remaining > 1]
        for seq in order:
            if budget == 0:
                break
            if seq not in self.running:  # preempted earlier in this step
                continue
            n = min(seq.remaining, budget)
            while not self.fits(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in done)
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.reserve(seq, n)
            scheduled.append((seq, n))
            done.add(id(seq))
            budget -= n
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_batch_seqs:
            seq = self.waiting[0]
            if not seq.table.blocks:
                self.match_prefix(seq)
            n = min(seq.remaining, budget)
            if not self.fits(seq, n):
                self.blocks.free(seq.table)
                seq.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(seq)
            self.reserve(seq, n)
            scheduled.append((seq, n))
            budget -= n
        # END SOLUTION
        return scheduled

    def remove(self, seq: Request) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.table)

"""Continuous batching (Orca) over a paged KV cache (vLLM): the serving engine.

Requests arrive at any time with any lengths. Static batching runs a fixed batch until its longest
request ends; continuous batching decides again at every step (iteration-level scheduling):

    step():  schedule   decoding sequences first (one token each), then sequences still prefilling
                        (a chunk of their prompt, as the token budget max_batch_tokens allows), then
                        newly admitted waiting requests while blocks, the budget and max_batch_seqs
                        allow. When a running sequence needs a block and none is free, the NEWEST
                        running sequence is preempted: its blocks are freed and it goes back to the
                        front of the queue, to be recomputed later (its tokens so far are kept).
             run        one forward over the new tokens of all scheduled sequences flattened into
                        one row (selective batching: the linears see [T, D] once; attention runs per
                        sequence over its blocks, serving.paged_attention.PagedBatch)
             sample     each sequence whose tokens are all computed gets its next token (its own
                        temperature / top-k / top-p / seed); stop tokens and max_new_tokens end it
                        and free its blocks.

The contract (tests/test_serving_engine.py): every admitted request completes, its greedy output
equals `generate` on its prompt alone, and every block is free again at the end, however small
the block budget. With a seed, a request draws the same tokens as `generate(..., seed=seed)`.

Variants: MHA / GQA / MQA, sliding window (blocks stay allocated for the whole sequence: the
window is applied by the mask; freeing blocks that leave the window is not done), hybrid
local/global, MLA (the latent cache is paged the same way), CLA (borrowing layers read their
owner's blocks, so the paged cache shrinks by kv_share like the contiguous one).

static_batching=True turns the engine into the baseline it replaces, for benchmarks: waiting
requests are admitted only when no sequence is running, so a batch runs until its longest request ends.

The engine is not thread-safe: one thread drives it (the HTTP server does so from its own loop).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from ..sampling import SamplingParams, sample_next_token
from .block_manager import BlockManager
from .paged_attention import PagedBatch, PagedKVCache
from .request import Request, RequestOutput
from .scheduler import Scheduler


def _as_token_list(prompt_ids, vocab_size: int) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() != 1:
            raise ValueError(f"a prompt must be 1-D, got shape {tuple(prompt_ids.shape)}")
        if prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
            raise ValueError(f"prompt token ids must be integers, got dtype {prompt_ids.dtype}")
        ids = prompt_ids.tolist()
    else:
        ids = list(prompt_ids)
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise ValueError("prompt token ids must be integers")
        ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the prompt is empty: a request needs at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {min(ids)}..{max(ids)}")
    return ids


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (module docstring). Not thread-safe."""

    def __init__(
        self,
        model,
        num_blocks: int = 256,
        block_size: int = 16,
        max_batch_tokens: int = 512,
        max_batch_seqs: int = 16,
        prefix_caching: bool = True,
        static_batching: bool = False,
    ):
        for name, value in [("max_batch_tokens", max_batch_tokens), ("max_batch_seqs", max_batch_seqs)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.model = model
        self.config = model.config
        self.device = model.embed.weight.device
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.cache = PagedKVCache(self.config, num_blocks, block_size, model.norm.weight.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, self.cache.copy_block, max_batch_tokens, max_batch_seqs)
        # static batching (the baseline, for benchmarks): a new batch is admitted only once every
        # sequence of the last one has finished; steps, cache and sampling as continuous batching
        self.static_batching = static_batching
        self.requests: dict[str, Request] = {}  # live (waiting or running) requests
        # The latest finished requests, kept for request_metrics; bounded so that a long-running
        # server does not grow without limit (the oldest is forgotten first).
        self.finished: dict[str, Request] = {}
        self.keep_finished = 1024
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step
        self._ids = itertools.count()
        self._order = itertools.count()
        self.num_steps = self.computed_tokens = self.generated_tokens = self.peak_used_blocks = 0

    # ------------------------------------------------------------------ requests
    def add_request(
        self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. ValueError (one line) for a request that can never run."""
        params = SamplingParams() if params is None else params
        params.validate()
        if params.stop_token_ids is None:  # the model's EOS ids, as generate does
            params = dataclasses.replace(params, stop_token_ids=params.stops(self.config))
        ids = _as_token_list(prompt_ids, self.config.vocab_size)
        P, M = len(ids), int(params.max_new_tokens)
        if P + M > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({P} tokens) + max_new_tokens ({M}) exceeds the context window of "
                f"{self.config.max_seq_len} tokens"
            )
        need = self.blocks.num_blocks_for(P + M - 1)  # the last token's K/V is never computed
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({P}) + max_new_tokens ({M}) needs {need} KV blocks of {self.blocks.block_size} "
                f"tokens, more than the engine's {self.blocks.num_blocks}"
            )
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request_id = str(request_id)
        if request_id in self.requests or request_id in self.finished:
            raise ValueError(f"request id {request_id!r} is already in use")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(params.seed))
        seq = Request(request_id, ids, P, params, time.perf_counter(), next(self._order), generator)
        self.requests[request_id] = seq
        self.scheduler.waiting.append(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a live request (e.g. its client disconnected) and free its blocks; unknown or
        finished ids are ignored. The next step reports it with finish_reason "abort"."""
        seq = self.requests.get(request_id)
        if seq is None:
            return
        self._finish(seq, "abort")
        self._pending.append(RequestOutput(request_id, [], True, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def _finish(self, seq: Request, reason: str) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.remove(seq)
        del self.requests[seq.request_id]
        self.finished[seq.request_id] = seq
        while len(self.finished) > self.keep_finished:
            del self.finished[next(iter(self.finished))]

    # ------------------------------------------------------------------ one iteration
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over every scheduled sequence's new tokens, sample."""
        outputs, self._pending = self._pending, []
        scheduled = self._schedule()
        if not scheduled:
            return outputs
        self.num_steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.blocks.num_blocks - self.blocks.num_free)
        spans = [(seq.table.blocks, seq.num_computed, n) for seq, n in scheduled]
        batch = PagedBatch(self.cache, spans, self.device)
        ids = [t for seq, n in scheduled for t in seq.token_ids[seq.num_computed : seq.num_computed + n]]
        logits = self.model.forward_paged(torch.tensor(ids, dtype=torch.long, device=self.device), batch)
        self.computed_tokens += len(ids)
        for seq, n in scheduled:
            seq.num_computed += n
            self.blocks.register_full_blocks(seq.table, seq.token_ids, seq.num_computed)
        rows = [i for i, (seq, _) in enumerate(scheduled) if seq.remaining == 0]  # the rest: prompt chunks
        tokens = self._sample(logits, [scheduled[i][0] for i in rows], rows)
        now = time.perf_counter()
        for i, token in zip(rows, tokens, strict=True):
            seq = scheduled[i][0]
            p = seq.params
            seq.token_ids.append(token)
            self.generated_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = None
            if token in p.stop_token_ids:
                reason = "stop"
            elif seq.num_output >= p.max_new_tokens:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(RequestOutput(seq.request_id, [token], reason is not None, reason))
        return outputs

    def _schedule(self) -> list[tuple[Request, int]]:
        sched = self.scheduler
        if not (self.static_batching and sched.running):
            return sched.schedule()
        held, sched.waiting = sched.waiting, collections.deque()  # a batch is running: admit nobody
        try:
            return sched.schedule()
        finally:
            sched.waiting.extend(held)  # after any sequence this step preempted (at the front)

    def _sample(self, logits: Tensor, seqs: list[Request], rows: list[int]) -> list[int]:
        """Next token of each sequence from its row of logits: greedy rows in one argmax, sampled rows
        one by one with their own parameters and generator (so a seed draws as in `generate`)."""
        tokens: list[int | None] = [None] * len(seqs)
        greedy = [j for j, seq in enumerate(seqs) if seq.params.temperature == 0.0]
        if greedy:
            picked = logits[[rows[j] for j in greedy]].argmax(dim=-1).tolist()
            for j, token in zip(greedy, picked, strict=True):
                tokens[j] = token
        for j, seq in enumerate(seqs):
            if tokens[j] is None:
                p = seq.params
                row = logits[rows[j] : rows[j] + 1]
                tokens[j] = int(sample_next_token(row, p.temperature, p.top_k, p.top_p, seq.generator)[0])
        return tokens

    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run the prompts (lists of ids or 1-D tensors) to completion; new token ids per prompt."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        left = set(ids)
        while left:
            if not self.has_unfinished():
                raise RuntimeError(f"engine idle with {len(left)} of its requests unfinished")
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
                    if o.finished:
                        left.discard(o.request_id)
        return [out[rid] for rid in ids]

    # ------------------------------------------------------------------ metrics
    def request_metrics(self, request_id: str) -> dict:
        """Times (time.perf_counter seconds) and lengths of one request, live or among the latest
        `keep_finished` finished ones.

        ttft = first token - arrival; tpot = (finish - first token) / (outputs - 1), the time per
        output token after the first; e2e = finish - arrival (None until known).
        """
        seq = self.requests.get(request_id) or self.finished.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request id {request_id!r}")
        first, end = seq.first_token_time, seq.finish_time
        n = seq.num_output
        return dict(
            arrival=seq.arrival,
            first_token=first,
            finish=end,
            ttft=None if first is None else first - seq.arrival,
            tpot=(end - first) / (n - 1) if end is not None and first is not None and n > 1 else None,
            e2e=None if end is None else end - seq.arrival,
            prompt_tokens=seq.num_prompt,
            output_tokens=n,
            preemptions=seq.preemptions,
            finish_reason=seq.finish_reason,
        )

    def stats(self) -> dict:
        """Run-wide counters: blocks (total, free, used, peak), preemptions, prefix cache, tokens."""
        b = self.blocks
        running = self.scheduler.running
        used = b.num_blocks - b.num_free
        return dict(
            num_blocks=b.num_blocks,
            block_size=b.block_size,
            free_blocks=b.num_free,
            used_blocks=used,
            peak_used_blocks=self.peak_used_blocks,
            kv_bytes_per_block=self.cache.block_nbytes,
            used_token_slots=sum(
                s.num_computed for s in running
            ),  # K/V written (shared prefixes per sequence)
            allocated_token_slots=used * b.block_size,
            preemptions=self.scheduler.preemptions,
            prefix_hits=b.prefix_hits,
            prefix_queries=b.prefix_queries,
            prefix_hit_rate=b.prefix_hits / b.prefix_queries if b.prefix_queries else 0.0,
            cow_copies=b.cow_copies,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(running),
            steps=self.num_steps,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
        )

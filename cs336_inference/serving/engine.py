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

n samples of one prompt (params.n): the prompt is prefilled once; when its first token is due,
n - 1 more samples are forked from it (blocks shared, copy-on-write), sample i drawing with seed + i.
Log-probabilities (params.logprobs, params.prompt_logprobs) come with the outputs; a request that
wants its prompt's needs every prompt row's logits, so it takes nothing from the prefix cache.
Structured output (params.json_schema): the engine's grammar (structured.JsonGrammar) gives each
such sample a matcher, and the sampler masks, row by row, every token it does not allow.

Variants: MHA / GQA / MQA, sliding window (when every layer slides over W steps, a block whose
steps have all left the window is given back after each step, so a long request holds about W /
block_size blocks; a hybrid keeps all its blocks, since its global layers read them), hybrid
local/global, MLA (the latent cache is paged the same way), CLA (borrowing layers read their
owner's blocks, so the paged cache shrinks by kv_share like the contiguous one).

keep_hidden=True: each sample's final output also carries its features, the final norm's output at
every position it computed (prompt and output), which is what a draft head is trained on
(draft_training.answer_with_features). The prefix cache is off then: its blocks are not computed.

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

from ..model import TransformerLM
from ..nucleus import draw_seeded, filter_row
from ..sampling import (
    SamplingParams,
    TokenLogprobs,
    advance,
    constrain,
    sampled_logprobs,
    token_logprobs,
)
from .block_manager import BlockManager
from .paged_attention import PagedBatch, PagedKVCache
from .request import Request, RequestOutput
from .sampler import sample_rows
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
        grammar=None,
        release_window_blocks: bool = True,
        keep_hidden: bool = False,
    ):
        for name, value in [("max_batch_tokens", max_batch_tokens), ("max_batch_seqs", max_batch_seqs)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if keep_hidden and not isinstance(model, TransformerLM):
            raise ValueError(
                f"keep_hidden needs a TransformerLM, whose steps can return features, not a {type(model).__name__}"
            )
        self.model = model
        self.config = model.config
        self.device = model.embed.weight.device
        self.keep_hidden = keep_hidden  # module docstring; no prefix cache then
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching and not keep_hidden)
        # a tensor-parallel shard caches only its own K/V heads (parallel/: model.cache_config)
        cache_config = getattr(model, "cache_config", self.config)
        self.cache = PagedKVCache(cache_config, num_blocks, block_size, model.norm.weight.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, self.cache.copy_block, max_batch_tokens, max_batch_seqs)
        # static batching (the baseline, for benchmarks): a new batch is admitted only once every
        # sequence of the last one has finished; steps, cache and sampling as continuous batching
        self.static_batching = static_batching
        self.grammar = grammar  # structured.JsonGrammar: compiles params.json_schema (None: refused)
        # every layer slides over a window W: a block all of whose steps are more than W - 1 behind
        # the next query is given back (a global layer anywhere would still read it: then nothing is)
        windows = {self.config.layer_window(i) for i in range(self.config.n_layers)}
        self.window = max(windows) if release_window_blocks and None not in windows else None
        self.window_released = 0
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
        if self.window is not None:  # at most a window and one step's tokens are held at once
            need = min(
                need, self.blocks.num_blocks_for(self.window - 1 + self.scheduler.max_batch_tokens) + 1
            )
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({P}) + max_new_tokens ({M}) needs {need} KV blocks of {self.blocks.block_size} "
                f"tokens, more than the engine's {self.blocks.num_blocks}"
            )
        constraint = None
        if params.json_schema is not None:
            if self.grammar is None:
                raise ValueError(
                    "json_schema needs an engine with a grammar: LLMEngine(..., grammar=JsonGrammar(tokenizer))"
                )
            constraint = self.grammar.matcher(params.json_schema)  # ValueError if it does not compile
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        request_id = str(request_id)
        if request_id in self.requests or request_id in self.finished:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Request(
            request_id, ids, P, params, time.perf_counter(), next(self._order), self._generator(params, 0)
        )
        seq.group.append(seq)
        seq.constraint = constraint
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * P
        self.requests[request_id] = seq
        self.scheduler.waiting.append(seq)
        return request_id

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample `index`'s own random stream: seeded with seed + index (None: the global RNG)."""
        if params.seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(int(params.seed) + index)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Drop a live request (e.g. its client disconnected), or only its sample `index`, and free
        the blocks; unknown or finished ids are ignored. The next step reports each sample dropped
        with finish_reason "abort"."""
        head = self.requests.get(request_id)
        if head is None:
            return
        for seq in list(head.group):
            if seq.finish_reason is None and index in (None, seq.index):
                self._finish(seq, "abort")
                self._pending.append(RequestOutput(request_id, [], True, "abort", seq.index))
        if index is None or index == 0:  # samples not forked yet never will be
            self._retire(head, aborted=True)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def _finish(self, seq: Request, reason: str) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.remove(seq)
        self._retire(seq.group[0])

    def _retire(self, head: Request, aborted: bool = False) -> None:
        """A request leaves the live ones when all n of its samples (or all forked so far, after an
        abort) are finished."""
        group = head.group
        if head.request_id not in self.requests or any(s.finish_reason is None for s in group):
            return
        if len(group) < head.params.n and not aborted:
            return
        del self.requests[head.request_id]
        self.finished[head.request_id] = head
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
        # prompt log-probabilities need the logits of every prompt row, not only the last
        every = [
            seq.prompt_logprobs is not None
            and not seq.prompt_logprobs_sent
            and seq.num_computed < seq.num_prompt
            for seq, _ in scheduled
        ]
        batch = PagedBatch(self.cache, spans, self.device, every)
        ids = [t for seq, n in scheduled for t in seq.token_ids[seq.num_computed : seq.num_computed + n]]
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.keep_hidden:
            logits, hidden = self.model.forward_paged(ids, batch, return_hidden=True)
            self._keep_hidden(scheduled, hidden)
        else:
            logits = self.model.forward_paged(ids, batch)
        self.computed_tokens += len(ids)
        picks: list[tuple[Request, int]] = []  # (sequence to sample, its row of logits)
        row = 0
        for (seq, n), all_rows in zip(scheduled, every, strict=True):
            if all_rows:
                self._prompt_logprobs(seq, logits[row : row + n], seq.num_computed)
            row += n if all_rows else 1
            seq.num_computed += n
            self.blocks.register_full_blocks(seq.table, seq.token_ids, seq.num_computed)
            if self.window is not None:  # the next query sees steps num_computed - W + 1 onwards
                self.window_released += self.blocks.release_before(
                    seq.table, seq.num_computed - self.window + 1
                )
            if seq.remaining == 0:  # the rest: prompt chunks
                picks += [(s, row - 1) for s in self._fork(seq)]
        tokens, logprobs = self._sample(logits, picks)
        now = time.perf_counter()
        for (seq, _), token, lp in zip(picks, tokens, logprobs, strict=True):
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
            prompt_lps = None
            if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
                prompt_lps, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
            hidden = None
            if reason is not None:
                self._finish(seq, reason)
                if self.keep_hidden:  # handed over, not kept among the finished requests
                    hidden, seq.hidden = torch.cat(seq.hidden), []
            outputs.append(
                RequestOutput(
                    seq.request_id, [token], reason is not None, reason, seq.index,
                    None if lp is None else [lp], prompt_lps, hidden,
                )
            )  # fmt: skip
        return outputs

    @staticmethod
    def _keep_hidden(scheduled: list[tuple[Request, int]], hidden: Tensor) -> None:
        """Append each scheduled sequence's rows of this step's features (a preempted sequence,
        recomputed from its first token, starts over)."""
        hidden, at = hidden.cpu(), 0  # one copy (on a GPU, one sync) per step
        for seq, n in scheduled:
            if seq.num_computed == 0:
                seq.hidden = []
            seq.hidden.append(hidden[at : at + n])
            at += n

    def _prompt_logprobs(self, seq: Request, logits: Tensor, start: int) -> None:
        """Row r of a prefill chunk starting at step `start` predicts prompt token start + r + 1: its
        log-probability under the model's own distribution (log-softmax of the raw logits; prompt
        tokens were not sampled) and the params.prompt_logprobs most likely tokens."""
        positions = range(start + 1, min(start + 1 + logits.shape[0], seq.num_prompt))
        if not positions:
            return
        lp = sampled_logprobs(logits[: len(positions)])  # temperature 0: the raw distribution
        targets = torch.tensor([seq.token_ids[i] for i in positions], device=lp.device)
        for i, entry in zip(positions, token_logprobs(lp, targets, seq.params.prompt_logprobs), strict=True):
            seq.prompt_logprobs[i] = entry

    def _fork(self, seq: Request) -> list[Request]:
        """The samples to draw now for seq: itself, and when sample 0 of an n > 1 request draws its
        first token, n - 1 new samples sharing its blocks (copy-on-write) and its prompt."""
        n = seq.params.n
        if seq.index != 0 or len(seq.group) == n:
            return [seq]
        for i in range(1, n):
            child = Request(
                seq.request_id, list(seq.token_ids), seq.num_prompt, seq.params, seq.arrival, seq.order,
                self._generator(seq.params, i), self.blocks.fork(seq.table), seq.num_computed,
                index=i, group=seq.group, constraint=None if seq.constraint is None else seq.constraint.copy(),
                hidden=list(seq.hidden),
            )  # fmt: skip
            seq.group.append(child)
            self.scheduler.running.append(child)
        return list(seq.group)

    def _schedule(self) -> list[tuple[Request, int]]:
        sched = self.scheduler
        if not (self.static_batching and sched.running):
            return sched.schedule()
        held, sched.waiting = sched.waiting, collections.deque()  # a batch is running: admit nobody
        try:
            return sched.schedule()
        finally:
            sched.waiting.extend(held)  # after any sequence this step preempted (at the front)

    def _sample(
        self, logits: Tensor, picks: list[tuple[Request, int]]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Next token of each sequence from its row of logits: greedy rows in one argmax, unseeded
        sampled rows in one batched draw (`sampler.sample_rows`), seeded rows one by one with their own
        generator (`nucleus.draw_seeded`: the token `sample_next_token` draws, so a seed draws as in
        `generate`); and, where params.logprobs is set, the token's log-probability (those of
        `sampled_logprobs`)."""
        constraints = [seq.constraint for seq, _ in picks]
        constrained = any(c is not None for c in constraints)
        where = [r for _, r in picks]  # each sample's row (forked samples share one)
        if constrained:  # structured output: a copy, one row per sample, -inf where the grammar says no
            logits, where = constrain(logits[where], constraints), list(range(len(picks)))
        tokens: list[int | None] = [None] * len(picks)
        greedy = [j for j, (seq, _) in enumerate(picks) if seq.params.temperature == 0.0]
        if greedy:
            picked = logits[[where[j] for j in greedy]].argmax(dim=-1).tolist()
            for j, token in zip(greedy, picked, strict=True):
                tokens[j] = token
        batched = [j for j, (seq, _) in enumerate(picks) if tokens[j] is None and seq.generator is None]
        if batched:  # unseeded rows: one batched draw (serving/sampler.py)
            ps = [picks[j][0].params for j in batched]
            drawn = sample_rows(
                logits[[where[j] for j in batched]],
                [p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps],
            )  # fmt: skip
            for j, token in zip(batched, drawn.tolist(), strict=True):
                tokens[j] = token
        logprobs: list[TokenLogprobs | None] = [None] * len(picks)
        for j, (seq, _) in enumerate(picks):
            p = seq.params
            row, filtered = logits[where[j] : where[j] + 1], None
            if tokens[j] is None:
                tokens[j], filtered = draw_seeded(row, p.temperature, p.top_k, p.top_p, seq.generator)
            if p.logprobs is not None:
                if p.temperature == 0.0:
                    lp = sampled_logprobs(row)  # the model's own distribution
                else:  # sampled_logprobs' numbers: log-softmax of filter_logits
                    if filtered is None:
                        filtered = filter_row(row, p.temperature, p.top_k, p.top_p)
                    lp = filtered.log_softmax(dim=-1)
                logprobs[j] = token_logprobs(lp, torch.tensor([tokens[j]], device=lp.device), p.logprobs)[0]
        if constrained:
            advance(constraints, torch.tensor(tokens))
        return tokens, logprobs

    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run the prompts (lists of ids or 1-D tensors) to completion; new token ids per prompt
        (of its sample 0; `run` gives every sample and the log-probabilities)."""
        return [r[0].new_token_ids for r in self.run(prompts, params)]

    def run(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[list[RequestOutput]]:
        """Run the prompts to completion; per prompt, one RequestOutput per sample (index order)
        holding all of that sample's new tokens (and log-probabilities, if asked for)."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        out = {
            rid: [RequestOutput(rid, [], False, None, i) for i in range(self.requests[rid].params.n)]
            for rid in ids
        }
        left = {(rid, i) for rid in ids for i in range(len(out[rid]))}
        while left:
            if not self.has_unfinished():
                raise RuntimeError(f"engine idle with {len(left)} of its samples unfinished")
            for o in self.step():
                if o.request_id not in out:
                    continue
                r = out[o.request_id][o.index]
                r.new_token_ids.extend(o.new_token_ids)
                if o.logprobs is not None:
                    r.logprobs = (r.logprobs or []) + o.logprobs
                if o.prompt_logprobs is not None:
                    r.prompt_logprobs = o.prompt_logprobs
                if o.hidden is not None:
                    r.hidden = o.hidden
                if o.finished:
                    r.finished, r.finish_reason = True, o.finish_reason
                    left.discard((o.request_id, o.index))
        return [out[rid] for rid in ids]

    # ------------------------------------------------------------------ metrics
    def request_metrics(self, request_id: str, index: int = 0) -> dict:
        """Times (time.perf_counter seconds) and lengths of one request (its sample `index`), live or
        among the latest `keep_finished` finished ones.

        ttft = first token - arrival; tpot = (finish - first token) / (outputs - 1), the time per
        output token after the first; e2e = finish - arrival (None until known).
        """
        head = self.requests.get(request_id) or self.finished.get(request_id)
        if head is None:
            raise KeyError(f"unknown request id {request_id!r}")
        if not 0 <= index < len(head.group):
            raise KeyError(f"request {request_id!r} has no sample {index}")
        seq = head.group[index]
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
            window_released_blocks=self.window_released,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(running),
            steps=self.num_steps,
            computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens,
        )

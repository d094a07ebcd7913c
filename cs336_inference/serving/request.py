"""A request inside the serving engine: its tokens (prompt + output so far), its KV blocks, its
sampling settings and timestamps; and what one engine step reports for it (RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..sampling import SamplingParams, TokenLogprobs
from .block_manager import BlockTable


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]  # tokens produced for this sample of the request in this step
    finished: bool  # this sample is finished
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    index: int = 0  # which of the request's n samples
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if params.logprobs is set
    # with the first token of sample 0, if params.prompt_logprobs is set: one per prompt token,
    # None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # when the sample finishes, on an engine with keep_hidden: the final norm's output at each of its
    # positions but the last (prompt and output; the last token is never fed back), [P + n - 1, D]
    hidden: Tensor | None = None


@dataclass(eq=False)  # identity: two requests are never "equal"
class Request:
    """One request inside the engine: its tokens (prompt + output so far) and its KV blocks.

    num_computed = how many of token_ids have their K/V in the cache; remaining = the rest: 1 while
    decoding (the newest token's K/V is computed in the next step), more while the prompt is being
    prefilled. The step that computes a sequence's last token samples its next one. After
    preemption num_computed = 0: prompt and output so far are recomputed together.

    n > 1 samples: sample 0 prefills the prompt; when its first token is due, samples 1..n-1 are
    forked from it (its blocks shared, copy-on-write) and every sample draws from the same logits.
    """

    request_id: str
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    arrival: float
    order: int  # arrival counter (the running list itself is kept in admission order)
    generator: torch.Generator | None = None
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0
    finish_reason: str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    index: int = 0  # which of the request's params.n samples (0: the one that prefills the prompt)
    group: list[Request] = field(default_factory=list)  # all samples so far, shared by them (index order)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled while prefilling, if asked for
    prompt_logprobs_sent: bool = False
    constraint: Any = None  # structured.JsonMatcher when params.json_schema is set
    hidden: list[Tensor] = field(default_factory=list)  # features so far, by step (engine keep_hidden)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def remaining(self) -> int:
        """Tokens whose K/V still have to be computed (1 while decoding)."""
        return len(self.token_ids) - self.num_computed

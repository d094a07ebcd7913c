"""Speculative decoding: a cheap draft proposes k tokens, the target checks them in one pass.

Notation of the lecture: p is the draft's distribution, q the target's. One round, with the target's
cache holding every token of the context except the newest one:

    draft      propose x_1 .. x_k with their distributions p_1 .. p_k (a model draft samples them from
               its own p; prompt lookup copies them from the context, p one-hot)
    verify     ONE target forward over [newest, x_1, .., x_k] (k + 1 positions, prefill-like) gives
               q_1 .. q_{k+1}: q_i is the target's distribution for the token at x_i's place
    accept     x_i is accepted with probability min(1, q_i(x_i) / p_i(x_i)), in order; at the first
               rejection the round emits one token from the residual max(q_i - p_i, 0) normalised and
               stops; if all k are accepted it emits a bonus token from q_{k+1}
    roll back  the target's cache forgets the rejected positions (`KVCache.truncate`)

The prompt's prefill gives the first token, as in plain decoding; the rounds follow it. Each round
emits between 1 and k + 1 tokens for one target pass, and every emitted token is an exact
sample of the target's distribution (the residual is exactly the probability mass the accept step
under-covers). Temperature, top-k and top-p are applied to both p and q, so the output follows the
target's *sampling* distribution; at temperature 0 both are one-hot at the argmax, so a draft token is
accepted iff it is the target's argmax and the output is exactly greedy decoding.

Batch size 1 only (rows of a batch would accept different numbers of tokens).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .kv_cache import KVCache, RingKVCache
from .model import TransformerLM
from .nucleus import draw_inverse_cdf, filter_row, sample_row
from .sampling import SamplingParams, as_prompt_list, filter_logits, sampling_params


# ------------------------------------------------------------------ distributions
def sampling_probs(
    logits: Float[Tensor, "... V"], temperature: float, top_k: int | None = None, top_p: float | None = None
) -> Float[Tensor, "... V"]:
    """The distribution `sample_next_token` draws from, as float32 probabilities.

    temperature 0: one-hot at the argmax (greedy); otherwise softmax after temperature, top-k, top-p
    (with top-p, row by row through nucleus.filter_row: filter_logits' bits without sorting the row).
    """
    shape = logits.shape
    logits = logits.reshape(-1, shape[-1]).float()
    if temperature == 0.0:
        probs = F.one_hot(logits.argmax(dim=-1), shape[-1]).float()
    elif top_p is not None and top_p < 1.0:
        probs = torch.cat([filter_row(row[None], temperature, top_k, top_p) for row in logits]).softmax(
            dim=-1
        )
    else:
        probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return probs.reshape(shape)


# ------------------------------------------------------------------ the accept / resample step
def accept_resample(
    p: Float[Tensor, "B k V"],
    q: Float[Tensor, "B k+1 V"],
    draft_tokens: Int[Tensor, "B k"],
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, " B"], Int[Tensor, " B"]]:
    """Modified rejection sampling for B independent rounds at once; returns (n_accepted, next_token).

    p[b, i] is the distribution draft token draft_tokens[b, i] was drawn from, q[b, i] the target's
    distribution at that place, q[b, k] the target's distribution after all k drafts. Row b accepts
    drafts 0 .. n_accepted[b] - 1: draft i is accepted with probability min(1, q(x)/p(x)), and only if
    every earlier draft was. next_token[b] is drawn from max(q[b, n] - p[b, n], 0) normalised when
    draft n = n_accepted[b] was rejected, or from q[b, k] (the bonus token) when all k were accepted.
    Edge cases: a draft with p(x) = 0 (one the draft could not have drawn) is accepted when q(x) > 0
    and rejected when q(x) = 0; a residual that is all zeros (q = p up to rounding, so nothing is left
    after the rejection) is replaced by q itself.
    Draws from `generator`, in this order: one uniform per draft (torch.rand(B, k): row by row, draft 0
    first), then one multinomial draw per row (torch.multinomial(dist, 1) over the B rows at once).
    """
    # BEGIN SOLUTION speculative_step
    B, k, V = p.shape
    x = draft_tokens[..., None]
    p_x = p.gather(-1, x)[..., 0]  # [B, k]
    q_x = q[:, :k].gather(-1, x)[..., 0]
    u = torch.rand(B, k, generator=generator, device=p.device)
    accepted = u < torch.clamp(q_x / p_x, max=1.0)
    n_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # length of the leading run of accepts
    residual = (q[:, :k] - p).clamp(min=0.0)
    candidates = torch.cat([residual, q[:, k:]], dim=1)  # row k: the bonus distribution
    rows = torch.arange(B, device=p.device)
    dist = candidates[rows, n_accepted]
    empty = dist.sum(dim=-1, keepdim=True) <= 0  # rejected although q = p (rounding): q itself is right
    dist = torch.where(empty, q[rows, n_accepted], dist)
    next_token = torch.multinomial(dist, num_samples=1, generator=generator)[:, 0]
    return n_accepted, next_token
    # END SOLUTION


# ------------------------------------------------------------------ verify (one target pass)
def verify_drafts(
    target: TransformerLM,
    cache: KVCache,
    last_token: Int[Tensor, " 1"],
    draft_tokens: Int[Tensor, " k"],
    draft_probs: Float[Tensor, "k V"],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, " n"]:
    """One round's target pass: returns the n = n_accepted + 1 tokens the round emits.

    `cache` holds every token of the context but the newest, `last_token`. Runs the target once on
    [last_token, draft_tokens] (k + 1 positions) with the cache, turns the logits into q with the
    sampling settings (`sampling_probs`), accepts / resamples with `accept_resample`, and truncates
    the cache so that it holds the context, last_token and the accepted drafts, nothing else.
    At temperature 0 p and q are one-hot, so the accept / resample step is a comparison: the drafts
    are accepted while each is the target's argmax, and the added token is the argmax where the
    first one is not (what `accept_resample` returns, without its draws over V entries per place).
    """
    # BEGIN SOLUTION speculative_verify
    k = draft_tokens.shape[0]
    ids = torch.cat([last_token, draft_tokens])[None]  # [1, k + 1]
    logits = target(ids, cache=cache)[0]  # [k + 1, V]: logits[i] predicts the token at draft i's place
    if temperature == 0.0:  # p and q one-hot: accept while the draft is the argmax, then the argmax
        best = logits.float().argmax(dim=-1)  # [k + 1]
        n = int((best[:k] == draft_tokens).long().cumprod(dim=0).sum())
        token = best[n : n + 1]
    else:
        q = sampling_probs(logits, temperature, top_k, top_p)
        n, token = accept_resample(draft_probs[None], q[None], draft_tokens[None], generator)
        n = int(n[0])
    cache.truncate(cache.pos - (k - n))  # forget the k - n rejected drafts
    return torch.cat([draft_tokens[:n], token])
    # END SOLUTION


# ------------------------------------------------------------------ drafts
class Draft(Protocol):
    """What speculative_generate needs from a draft."""

    def reset(self, capacity: int, k: int) -> None:
        """Forget everything; the next context has at most `capacity` tokens, rounds draft <= k."""

    def propose(
        self,
        context: Int[Tensor, " S"],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> tuple[Int[Tensor, " k2"], Float[Tensor, "k2 V"] | None]:
        """Up to k tokens to follow `context`, and the distributions they were drawn from.

        None instead of the distributions means deterministic proposals (p one-hot at each token).
        """


def prompt_lookup(context: Sequence[int], k: int, n_max: int = 3, n_min: int = 1) -> list[int]:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the context's tail.

    For n = n_max down to n_min: the pattern is the last n tokens of the context; find its latest
    occurrence that starts before the tail itself (start <= len(context) - n - 1) and return the
    (at most k) tokens that follow that occurrence in the context. The longest n with a match wins;
    no match for any n gives [].
    """
    # BEGIN SOLUTION prompt_lookup
    S = len(context)
    for n in range(min(n_max, S - 1), n_min - 1, -1):
        pattern = list(context[S - n :])
        for start in range(S - n - 1, -1, -1):  # latest first; never the tail itself
            if list(context[start : start + n]) == pattern:
                return list(context[start + n : start + n + k])
    return []
    # END SOLUTION


class NGramDraft:
    """Prompt-lookup draft (no model): copies what followed the tail's latest earlier occurrence.

    Shines when the output repeats the prompt (rewriting, extracting, editing code); costs no forward.
    """

    def __init__(self, n_max: int = 3, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"NGramDraft needs 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min

    def reset(self, capacity: int, k: int) -> None:
        pass

    def propose(
        self,
        context: Int[Tensor, " S"],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, None]:
        tokens = prompt_lookup(context.tolist(), k, self.n_max, self.n_min)
        return torch.tensor(tokens, dtype=torch.long, device=context.device), None


LOOKUP_MATCH = 3  # ModelDraft(lookup=True): the context's last tokens that must have occurred before


class Steps(Protocol):
    """Runs a model's forwards as fixed-shape steps (what makes a verify pass of k + 1 tokens cost
    about one decode step on a CPU or GPU). The staff fast path provides one
    (`cs336_inference.fast.step.fixed.FixedSteps`); nothing here depends on it."""

    def capacity(self, length: int, max_seq_len: int) -> int:
        """The cache length S to allocate for `length` steps (a static cache in every layer, a sliding
        layer's too: `steps_cache`)."""
        ...

    def __call__(self, model: TransformerLM, cache: KVCache, T: int) -> Callable[..., Tensor]:
        """A forward like `model(ids, cache=cache, last_only=...)` for calls of up to T tokens."""
        ...


def steps_cache(model: TransformerLM, steps: Steps, length: int) -> KVCache:
    """A one-row cache for `length` steps that fixed-shape steps run: steps.capacity(..) slots, static in
    every layer. A sliding layer gets the whole length too (spare = S: no ring), its window applied by
    the attention mask, so that a fixed step's shapes never change (Mistral, Gemma 3's local layers)."""
    S = steps.capacity(length, model.config.max_seq_len)
    return model.new_cache(1, S, spare=S)


class ModelDraft:
    """A TransformerLM as the draft, with its own KV cache that it rolls back to the accepted context.

    Its cache holds the tokens it has fed (the context of its last call plus its own drafts but the
    last); a call keeps the common prefix with the new context, truncates the rest and feeds the
    missing tokens (one forward), then samples k tokens with k - 1 one-token forwards. At temperature
    0 a draft token is the argmax of its logits (what sampling the one-hot p would draw, without
    drawing), and p is returned as None (one-hot).
    steps: as speculative_generate's: the draft's forwards of 1 and 2 tokens run as fixed-shape
    steps (e.g. compiled), so a small draft's step costs what its products cost rather than its
    Python and small ops.
    share_cache: the draft reads and writes the *target's* cache instead of keeping its own (a draft
    with the target's cache shapes, e.g. the target's own weights quantized, as QSpec does). It then
    never prefills the prompt nor feeds accepted tokens again: each round it runs k one-token forwards
    from the target's cache position (attending to the target's K/V of the context), and the target's
    verify pass overwrites the K/V it wrote. The output is still an exact sample of the target (only
    the drafts change); acceptance may differ from a draft with its own cache.
    lookup: prompt lookup first. Where the context's last LOOKUP_MATCH tokens occurred before, the
    round drafts the up to k tokens that followed them (`prompt_lookup`, p one-hot) and the model does
    not run: a copy of the prompt costs no draft forward, and the model drafts what is not a copy.
    """

    def __init__(
        self,
        model: TransformerLM,
        steps: Steps | None = None,
        share_cache: bool = False,
        lookup: bool = False,
    ):
        self.model, self.steps, self.share_cache, self.lookup = model, steps, share_cache, lookup
        self.forwards = 0  # the model's forwards since reset (a benchmark's draft cost per round)
        self.cache: KVCache | None = None
        self.fed: Tensor | None = None  # the tokens the cache holds (own cache only)
        self.forward = model

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def reset(self, capacity: int, k: int) -> None:
        if self.share_cache:  # `attach` gives it the target's cache
            self.cache = None
        elif self.steps is None:
            self.cache = self.model.new_cache(1, capacity, spare=k + 1)
        else:  # fixed-shape steps of 1 and 2 tokens (a round feeds 1, or 2 after all k were accepted)
            self.cache = steps_cache(self.model, self.steps, capacity + k + 2)
            self.forward = self.steps(self.model, self.cache, 2)
        self.fed = torch.empty(0, dtype=torch.long, device=self.model.embed.weight.device)
        self.forwards = 0

    def attach(self, cache: KVCache) -> None:
        """share_cache: draft on the target's `cache` from now on (`check_shared_cache` says whether
        the draft may: speculative_generate checks it with its arguments)."""
        self.cache, self.forward = cache, self.model
        if self.steps is not None:
            self.forward = self.steps(self.model, cache, 1)

    @torch.inference_mode()
    def propose(
        self,
        context: Int[Tensor, " S"],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        cache = self.cache
        if cache is None:
            raise ValueError(
                "the draft has no cache yet: call reset(capacity, k)"
                + (", then attach(target_cache) (share_cache=True)" if self.share_cache else "")
            )
        if self.lookup:
            found = prompt_lookup(context.tolist(), k, LOOKUP_MATCH, LOOKUP_MATCH)
            if found:
                return torch.tensor(found, dtype=torch.long, device=context.device), None
        if self.share_cache:  # the target's cache holds every context token but the newest
            if cache.pos != len(context) - 1:
                raise ValueError(f"the shared cache holds {cache.pos} steps, expected {len(context) - 1}")
            start, new = cache.pos, context[-1:]
        else:
            fed = self.fed
            n = min(len(fed), len(context) - 1)  # feed at least the newest token
            keep = int((fed[:n] == context[:n]).long().cumprod(dim=0).sum())
            cache.truncate(keep)
            new = context[keep:]
        greedy = params.temperature == 0.0
        tokens, probs = [], []
        for i in range(k):
            logits = self.forward(new[None], cache=cache, last_only=True)[0, -1]
            self.forwards += 1
            if greedy:
                token = logits.argmax()[None]
            else:
                p = sampling_probs(logits, params.temperature, params.top_k, params.top_p)
                # a draft token only has to come from p: one uniform number, not multinomial's V draws
                u = torch.rand(1, dtype=torch.float64, generator=generator, device=p.device)
                token = draw_inverse_cdf(p[None], u)
                probs.append(p)
            tokens.append(token)
            if i + 1 < k:
                new = token
        if self.share_cache:
            cache.truncate(start)  # the verify pass writes these steps again, the target's K/V
        else:
            self.fed = torch.cat([context] + tokens[:-1])
        return torch.cat(tokens), (None if greedy else torch.stack(probs))


def check_shared_cache(draft: TransformerLM, target: TransformerLM) -> None:
    """ValueError unless the draft's cache would have the target's layers, store types and shapes."""

    def layout(model: TransformerLM) -> list:
        cache = model.new_cache(1, 1)
        return [
            None if s is None else (type(s).__name__, [(n, t.shape, t.dtype) for n, t in vars(s).items()
                                                        if isinstance(t, Tensor)])
            for s in cache.layers
        ]  # fmt: skip

    if layout(draft) != layout(target):
        raise ValueError(
            "share_cache needs a draft whose KV cache has the target's layers and shapes "
            "(e.g. the target's own weights quantized); this draft's differs"
        )


def as_draft(draft, steps: Steps | None = None) -> Draft:
    """A TransformerLM becomes a ModelDraft (running `steps`' fixed-shape steps); "ngram" an
    NGramDraft; anything with propose/reset stays."""
    if isinstance(draft, TransformerLM):
        return ModelDraft(draft, steps)
    if isinstance(draft, str) and draft == "ngram":
        return NGramDraft()
    if hasattr(draft, "propose") and hasattr(draft, "reset"):
        return draft
    raise ValueError(f"draft must be a TransformerLM, 'ngram' or an object with propose/reset, got {draft!r}")


# ------------------------------------------------------------------ the loop
@dataclass
class SpeculativeStats:
    """Counts of one speculative_generate call.

    alpha = accepted / (accepted + rejected): the probability that a draft token the target examined
    was accepted (drafts after a rejection are never examined). This is the alpha of the formula
    tokens per pass = (1 - alpha^(k+1)) / (1 - alpha). `drafted` counts every proposed token.
    """

    k: int
    new_tokens: int = 0
    target_passes: int = 0  # verify passes (not the prompt's prefill, which gives prefill_tokens)
    prefill_tokens: int = 0  # new tokens the prompt's prefill gave (the first), before any round
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    round_drafts: list[int] = field(default_factory=list, repr=False)  # tokens drafted, round by round
    draft_seconds: float = 0.0  # tree rounds (speculative_tree.py): time spent drafting
    verify_seconds: float = 0.0  # tree rounds: time spent in the target's passes and the walk
    caches: dict = field(default_factory=dict, repr=False)  # for tests: {"target": KVCache, ...}

    def count_round(self, drafted: int, emitted: int, rejected: bool) -> None:
        """One round: `drafted` tokens proposed, `emitted` out (the accepted drafts and one more),
        `rejected`: whether the round ended at a rejected draft (else at a bonus token)."""
        self.target_passes += 1
        self.drafted += drafted
        self.round_drafts.append(drafted)
        self.accepted += emitted - 1
        self.rejected += int(rejected)

    def emit(self, new: Tensor, stops: set[int]) -> Iterator[int]:
        """Yield a round's tokens, counting them; returns True after a stop token (it is yielded)."""
        for token in new.tolist():
            self.new_tokens += 1
            yield token
            if token in stops:
                return True
        return False

    @property
    def alpha(self) -> float:
        examined = self.accepted + self.rejected
        return self.accepted / examined if examined else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Tokens the rounds emitted per verify pass (the prefill's token is not a round's)."""
        rounds = self.new_tokens - self.prefill_tokens
        return rounds / self.target_passes if self.target_passes else float("nan")

    def as_dict(self) -> dict:
        d = {key: value for key, value in asdict(self).items() if key not in ("caches", "round_drafts")}
        return {**d, "alpha": self.alpha, "tokens_per_pass": self.tokens_per_pass}


def check_rollback(cache: KVCache, k: int) -> None:
    """ValueError unless every sliding-window ring of `cache` can roll back k steps (spare >= k)."""
    for store in cache.layers:
        if isinstance(store, RingKVCache) and store.slots - store.window < k:
            raise ValueError(
                f"a sliding-window cache with {store.slots - store.window} spare slots cannot roll back "
                f"k={k} drafted tokens: allocate it with model.new_cache(..., spare={k})"
            )


def _check_args(target, draft, prompt_ids, max_new_tokens: int, k) -> Tensor:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (drafted tokens per round) must be an integer >= 1, got {k!r}")
    if not isinstance(target, TransformerLM):
        raise ValueError(f"target must be a TransformerLM, got {type(target).__name__}")
    prompts, single = as_prompt_list(prompt_ids)
    if not single:
        raise ValueError("speculative_generate supports batch size 1 only: pass one prompt (1-D)")
    ids = prompts[0].to(target.embed.weight.device)
    cfg = target.config
    if ids.numel() == 0:
        raise ValueError("the prompt needs at least one token")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, {cfg.vocab_size}), got {int(ids.min())}..{int(ids.max())}"
        )
    P = len(ids)
    if P + k > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({P} tokens) + k ({k} drafted tokens) exceeds the context window of {cfg.max_seq_len} tokens"
        )
    if P + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context window "
            f"of {cfg.max_seq_len} tokens"
        )
    draft_model = draft.model if isinstance(draft, ModelDraft) else draft
    if isinstance(draft_model, TransformerLM):
        dcfg = draft_model.config
        if dcfg.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"the draft's vocabulary ({dcfg.vocab_size} tokens) differs from the target's ({cfg.vocab_size})"
            )
        if P + max_new_tokens > dcfg.max_seq_len:
            raise ValueError(
                f"prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds the draft's context window "
                f"of {dcfg.max_seq_len} tokens"
            )
    if isinstance(draft, ModelDraft) and draft.share_cache:
        check_shared_cache(draft.model, target)
    return ids


def speculative_stream(
    target: TransformerLM,
    draft,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int = 64,
    k: int = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    stats: SpeculativeStats | None = None,
    steps: Steps | None = None,
    params: SamplingParams | None = None,
) -> Iterator[int]:
    """Yield the new token ids one by one as each round emits them (a stop token is yielded, then it
    ends); `stats`, if given, is filled in as it goes. Arguments are checked at the call; the settings
    come as keywords or as one SamplingParams (params=), as generate's."""
    params = sampling_params(
        params, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_token_ids=stop_token_ids,
    )  # fmt: skip
    ids = _check_args(target, draft, prompt_ids, int(params.max_new_tokens), k)
    stats = SpeculativeStats(k=k) if stats is None else stats
    stats.k = k
    drafter = as_draft(draft, steps)
    return _rounds(target, drafter, ids, k, params, stats, steps)


def round_generator(params: SamplingParams, device) -> torch.Generator | None:
    """The generator a speculative loop draws from: seeded by params.seed, so that the draws can be
    reproduced (seed 0 when greedy, which draws nothing that matters); None (the global RNG) when
    sampling without a seed."""
    if params.seed is None and params.temperature != 0.0:
        return None
    return torch.Generator(device=device).manual_seed(0 if params.seed is None else params.seed)


@torch.inference_mode()
def _rounds(target, drafter, ids, k, params: SamplingParams, stats, steps) -> Iterator[int]:
    P, device = len(ids), ids.device
    max_new_tokens, stops = int(params.max_new_tokens), set(params.stops(target.config))
    generator = round_generator(params, device)
    capacity = P + max_new_tokens
    if steps is None:
        cache = target.new_cache(1, capacity, spare=k)
    else:  # the target runs fixed-shape steps of 1 and k + 1 tokens
        cache = steps_cache(target, steps, capacity + k)
        target = steps(target, cache, k + 1)
    check_rollback(cache, k)
    drafter.reset(capacity, k)
    stats.caches["target"] = cache
    if isinstance(drafter, ModelDraft):
        if drafter.share_cache:
            drafter.attach(cache)
        stats.caches["draft"] = drafter.cache
    # the prompt's prefill gives the first token, as generate's does: a first round would keep it
    # waiting for k drafts and a verify pass
    logits = target(ids[None], cache=cache, last_only=True)[0, -1:]
    first = sample_row(logits, params.temperature, params.top_k, params.top_p, generator)
    context = torch.empty(capacity, dtype=torch.long, device=device)
    context[:P] = ids
    context[P] = first
    n = P + 1
    stats.prefill_tokens = 1
    if (yield from stats.emit(first, stops)):
        return
    while n - P < max_new_tokens:
        k_round = min(k, max_new_tokens - (n - P) - 1)  # never draft past max_new_tokens
        drafts, p = context.new_empty(0), None
        if k_round > 0:
            drafts, p = drafter.propose(context[:n], k_round, params, generator)
            drafts = drafts[:k_round]
        if p is None:
            p = F.one_hot(drafts, target.config.vocab_size).float()
        p = p[: len(drafts)]
        new = verify_drafts(
            target,
            cache,
            context[n - 1 : n],
            drafts,
            p,
            params.temperature,
            params.top_k,
            params.top_p,
            generator,
        )
        if not 1 <= len(new) <= len(drafts) + 1:  # e.g. a verify_drafts that emits nothing: never loop
            raise RuntimeError(
                f"verify_drafts returned {len(new)} tokens for {len(drafts)} drafts; a round emits the "
                f"accepted drafts and one more token (1 to {len(drafts) + 1})"
            )
        stats.count_round(len(drafts), len(new), rejected=len(new) - 1 < len(drafts))
        context[n : n + len(new)] = new
        n += len(new)
        if (yield from stats.emit(new, stops)):
            return


def speculative_generate(
    target: TransformerLM,
    draft,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int = 64,
    k: int = 4,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
    return_stats: bool = False,
    steps: Steps | None = None,
    params: SamplingParams | None = None,
):
    """Generate up to max_new_tokens tokens of one prompt from `target`, drafting k tokens per round.

    draft: a TransformerLM with the target's vocabulary, "ngram" / an NGramDraft (prompt lookup), or any
    object with the `Draft` methods (e.g. `ModelDraft(model, share_cache=True)`: a draft with the
    target's cache shapes drafting on the target's KV cache). The output is an exact sample of what `generate(target, ...)`
    samples with the same settings (and identical to it at temperature 0); only the number of target
    passes changes. Returns a 1-D LongTensor of new tokens (a stop token, by default the config's EOS
    ids, ends it and is kept), and with return_stats=True also a SpeculativeStats.
    Raises ValueError for k < 1, a draft with another vocabulary, a batch, or a prompt + k or prompt +
    max_new_tokens past the context window.
    steps: None runs the target's own forward; a `Steps` (staff code: `fast.step.fixed.FixedSteps`,
    compiled, CUDA graph, native or eager) runs it as fixed-shape steps of 1 and k + 1 tokens, where a
    verify pass costs little more than a decode step; a TransformerLM draft then runs fixed-shape
    steps of 1 and 2 tokens the same way. params: the settings as one SamplingParams (instead of the
    keywords).
    """
    stats = SpeculativeStats(k=k)
    stream = speculative_stream(
        target,
        draft,
        prompt_ids,
        max_new_tokens,
        k,
        temperature,
        top_k,
        top_p,
        seed,
        stop_token_ids,
        stats,
        steps,
        params,
    )
    out = torch.tensor(list(stream), dtype=torch.long, device=target.embed.weight.device)
    return (out, stats) if return_stats else out

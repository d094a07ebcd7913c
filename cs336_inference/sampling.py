"""Sampling: from logits to tokens, and the two generation loops of the lecture.

Turning one row of logits into a token (applied in this order, as in most libraries):

    temperature T    logits / T: T < 1 sharpens the distribution, T > 1 flattens it, T = 0 is greedy
    top-k            keep only the k most likely tokens
    top-p (nucleus)  keep the smallest set of most likely tokens whose probability mass reaches p
    sample           draw from softmax of what is left (a seeded torch.Generator makes it reproducible)

Generating T new tokens after a prompt of P tokens:

    naive_generate   every step runs the whole context (prompt + tokens so far) through the model
                     again: step t processes P + t tokens, so the total work grows like T^2 tokens
                     (T^3 FLOPs for attention when P is small) although only one new token is needed.
    generate         prefill: the prompt goes through the model once, in parallel (compute-bound),
                     and writes every layer's keys and values into a KV cache; decode: each step feeds
                     only the newest token and reads the cached K/V (memory-bound: the weights and the
                     cache are read once per step for very few FLOPs).

Prompts: a 1-D LongTensor or a list of ints is one prompt and gives a 1-D tensor of new tokens.
A list of prompts (lists or 1-D tensors, any lengths) or a 2-D LongTensor is a batch and gives a list
of 1-D tensors. A batch is left-padded to a common length and the model is told the padding (`pad`),
so every row gets the positions and masks it would get alone; greedy results equal unbatched ones.

Stopping: generation of a row ends after max_new_tokens or after it produces a stop token (by default
the model config's EOS ids). The stop token is kept as the last element of that row's result, so a
caller can tell "stopped" from "ran out of tokens".

Context window: prompt length (padded, for a batch) + max_new_tokens must fit in config.max_seq_len;
generate raises ValueError otherwise rather than silently generating fewer tokens (the CLI clamps
max_new_tokens to the window before calling it).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields

import torch
from jaxtyping import Float, Int
from torch import Tensor

Prompt = Tensor | Sequence[int] | Sequence[Sequence[int]] | Sequence[Tensor]
StepFn = Callable[[Float[Tensor, "B V"]], Int[Tensor, " B"]]


# ------------------------------------------------------------------ logits processing
def apply_temperature(logits: Float[Tensor, "B V"], temperature: float) -> Float[Tensor, "B V"]:
    """Return logits / T for T > 0 (a new tensor): softmax(logits / T) is the distribution we sample from."""
    # BEGIN SOLUTION sampling
    return logits / temperature
    # END SOLUTION


def top_k_filter(logits: Float[Tensor, "B V"], k: int) -> Float[Tensor, "B V"]:
    """Return the logits with all but the k largest of each row set to -inf.

    Kept logits keep their values; k >= V keeps everything. Exactly min(k, V) entries per row stay
    finite: among logits tied at the k-th value, keep any of them, but only as many as needed.
    """
    # BEGIN SOLUTION sampling
    if k >= logits.shape[-1]:
        return logits
    top = logits.topk(k, dim=-1)
    return torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)
    # END SOLUTION


def top_p_filter(logits: Float[Tensor, "B V"], p: float) -> Float[Tensor, "B V"]:
    """Nucleus filter: return the logits with every token outside the nucleus set to -inf.

    The nucleus of a row is the smallest set of most likely tokens whose probability mass
    (softmax of this row's logits) reaches p. A token is kept iff the mass of the tokens ranked
    strictly above it is still below p, so the most likely token is always kept and the token that
    makes the mass reach p is kept too. Kept logits keep their values; each row is filtered alone.
    """
    # BEGIN SOLUTION sampling
    probs = logits.float().softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_above >= p
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
    # END SOLUTION


def filter_logits(
    logits: Float[Tensor, "B V"],
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Float[Tensor, "B V"]:
    """The logits sampling draws from (temperature > 0), as a new float32 tensor: divided by the
    temperature, then the top-k kept (if top_k is given), then the top-p nucleus of what is left (if
    top_p < 1). softmax of the result is the distribution; its log-softmax, the log-probabilities.
    """
    # BEGIN SOLUTION sampling
    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return logits
    # END SOLUTION


def sample_next_token(
    logits: Float[Tensor, "B V"],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, " B"]:
    """Return one sampled token id per row (LongTensor [B]).

    temperature == 0 is greedy (argmax). Otherwise draw one token from the softmax of
    `filter_logits` (temperature, then top-k, then top-p) with `generator` (so a seeded generator
    reproduces the draws).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # BEGIN SOLUTION sampling
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    # END SOLUTION


# ------------------------------------------------------------------ constraints (structured output)
def constrain(logits: Float[Tensor, "B V"], constraints: Sequence | None) -> Float[Tensor, "B V"]:
    """Set to -inf, in place, the logits of the tokens row b's constraint does not allow next.

    A constraint (structured.JsonMatcher) has allowed() -> Bool[V] and accept(token_id); None for a
    row leaves it free. Masking before temperature / top-k / top-p restricts sampling (and greedy) to
    the allowed tokens, renormalized.
    """
    if constraints:
        for b, c in enumerate(constraints):
            if c is not None:
                logits[b].masked_fill_(~c.allowed().to(logits.device), float("-inf"))
    return logits


def advance(constraints: Sequence | None, tokens: Int[Tensor, " B"]) -> None:
    """Feed each row's drawn token to its constraint (rows already done are left alone)."""
    if constraints:
        for c, token in zip(constraints, tokens.tolist(), strict=True):
            if c is not None and not c.done:
                c.accept(token)


# ------------------------------------------------------------------ log-probabilities
def sampled_logprobs(
    logits: Float[Tensor, "B V"],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Float[Tensor, "B V"]:
    """log-probabilities of the distribution sample_next_token draws from.

    temperature > 0: log-softmax of `filter_logits` (fp32), so a token outside the kept set has
    -inf. Greedy (temperature 0) has no distribution to draw from; it reports the model's own one,
    log-softmax of the raw logits (temperature 1, nothing filtered): what scoring a text needs, and
    what the chosen token's log-probability means to a reader.
    """
    if temperature == 0.0:
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(dim=-1)
    return filter_logits(logits, temperature, top_k, top_p).log_softmax(dim=-1)


@dataclass
class TokenLogprobs:
    """One position's log-probabilities: the token's own and the `top` most likely tokens',
    [(id, logprob), ...] most likely first (equal values: the lower id first). Alternatives with -inf
    (filtered out by top-k / top-p) are left out, so `top` may be shorter than asked."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(
    logprobs: Float[Tensor, "B V"], token_ids: Int[Tensor, " B"], num_top: int = 0
) -> list[TokenLogprobs]:
    """Row b's entry for token_ids[b] with its num_top most likely alternatives (one sync in all)."""
    rows = torch.arange(logprobs.shape[0], device=logprobs.device)
    chosen = logprobs[rows, token_ids].tolist()
    ids = token_ids.tolist()
    if num_top == 0:
        return [TokenLogprobs(i, c, []) for i, c in zip(ids, chosen, strict=True)]
    values, top_ids = logprobs.topk(min(num_top, logprobs.shape[-1]), dim=-1)
    out = []
    for i, c, ts, vs in zip(ids, chosen, top_ids.tolist(), values.tolist(), strict=True):
        top = sorted(((t, v) for t, v in zip(ts, vs, strict=True) if v != float("-inf")), key=_by_value)
        out.append(TokenLogprobs(i, c, top))
    return out


def _by_value(item: tuple[int, float]) -> tuple[float, int]:
    return -item[1], item[0]


def check_sampling_args(
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    max_new_tokens: int | None = None,
) -> None:
    """Raise ValueError (one line) for a parameter outside its range."""
    if not 0.0 <= temperature < float("inf"):  # also catches NaN
        raise ValueError(f"temperature must be >= 0 and finite (0 = greedy), got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens is not None and (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, numbers.Integral)
        or max_new_tokens < 1
    ):
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


@dataclass
class SamplingParams:
    """How to pick new tokens: the one type `generate`, `stream_generate`, `speculative_generate`, the
    serving engine, the HTTP server and the CLI take. `validate()` is the one place they are checked.

    max_new_tokens: at most this many new tokens. temperature: 0 = greedy. top_k / top_p: None = off.
    seed: a seeded generator makes sampling reproducible (None: the global RNG). stop_token_ids: a row
    ends after producing one of them (it is kept); None = the model config's EOS ids, () = never early.
    logprobs: None = none; k = each new token's log-probability (`sampled_logprobs`: the distribution
    it was drawn from) and its k most likely alternatives. prompt_logprobs: the same for every prompt
    token but the first (serving engine only). n: samples of one prompt (serving engine only; sample
    i draws from its own generator seeded with seed + i, so it equals `generate` with that seed).
    json_schema: the output must be JSON this schema accepts (True: any JSON object); serving engine
    only, which compiles it with its grammar (structured.py); `generate` takes the matcher instead.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: Sequence[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    json_schema: dict | bool | None = None

    MAX_LOGPROBS = 20  # the most alternatives per position (OpenAI's limit for top_logprobs)

    def validate(self) -> None:
        """Raise ValueError (one line) for a setting outside its range."""
        check_sampling_args(self.temperature, self.top_k, self.top_p, self.max_new_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or not 0 <= value <= self.MAX_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {self.MAX_LOGPROBS}] or None, got {value!r}"
                )
        if isinstance(self.n, bool) or not isinstance(self.n, numbers.Integral) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not (self.json_schema is None or self.json_schema is True or isinstance(self.json_schema, dict)):
            raise ValueError(
                f"json_schema must be a JSON schema (a dict), True or None, got {self.json_schema!r}"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
        ):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stops = self.stop_token_ids
        if stops is not None and any(
            isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in stops
        ):
            raise ValueError(f"stop_token_ids must be integers, got {stops!r}")

    def stops(self, config) -> tuple[int, ...]:
        """The stop ids in effect for a model with this config."""
        return tuple(config.eos_token_ids if self.stop_token_ids is None else self.stop_token_ids)


def sampling_params(params: SamplingParams | None, **settings) -> SamplingParams:
    """params if given (then every keyword setting must be left at its default), else the settings as
    SamplingParams; validated either way. What the functions taking both spellings call first."""
    if params is None:
        params = SamplingParams(**settings)
    else:
        defaults = {f.name: f.default for f in fields(SamplingParams)}
        changed = sorted(name for name, value in settings.items() if value != defaults[name])
        if changed:
            raise ValueError(
                f"give the sampling settings as params or as keywords, not both ({', '.join(changed)})"
            )
    params.validate()
    return params


# ------------------------------------------------------------------ prompts and padding
def as_prompt_list(prompt_ids: Prompt) -> tuple[list[Tensor], bool]:
    """The prompts as a list of 1-D LongTensors, and whether the input was a single prompt."""
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() == 1:
            return [prompt_ids.long()], True
        if prompt_ids.dim() == 2:
            return [row.long() for row in prompt_ids], False
        raise ValueError(
            f"prompt_ids must be 1-D (one prompt) or 2-D (a batch), got shape {tuple(prompt_ids.shape)}"
        )
    prompts = list(prompt_ids)
    if not prompts:
        raise ValueError("prompt_ids is empty")
    if all(isinstance(t, numbers.Integral) for t in prompts):
        return [torch.tensor(prompts, dtype=torch.long)], True
    out = []
    for p in prompts:
        t = p.long() if isinstance(p, Tensor) else torch.tensor(list(p), dtype=torch.long)
        if t.dim() != 1:
            raise ValueError(f"each prompt of a batch must be 1-D, got shape {tuple(t.shape)}")
        out.append(t)
    return out, False


def left_pad(prompts: list[Tensor], pad_id: int = 0) -> tuple[Int[Tensor, "B P"], Int[Tensor, " B"]]:
    """Stack prompts of different lengths right-aligned: [pad .. pad, prompt]; pad[b] = padding count.

    Right alignment puts every row's newest token in the last column, so one decode step serves all.
    """
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    P = int(lengths.max())
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=prompts[0].device)
    for b, p in enumerate(prompts):
        ids[b, P - len(p) :] = p
    return ids, P - lengths


# ------------------------------------------------------------------ the two decoding loops
def naive_steps(
    model, ids: Int[Tensor, "B P"], pad: Int[Tensor, " B"] | None, max_new_tokens: int, next_token: StepFn
) -> Iterator[tuple[Int[Tensor, " B"], Float[Tensor, "B V"]]]:
    """Naive generation: each step runs the full context through `model(context, pad=pad, last_only=True)`.

    ids are the left-padded prompts [B, P] (pad[b] padding tokens in row b, None: no padding).
    Step t feeds all P + t tokens (prompt and the tokens generated so far, no cache), picks each
    row's next token with next_token(last logits), appends it to the context and yields
    (new token per row [B], the logits it was picked from [B, V]); max_new_tokens steps in all.
    """
    # BEGIN SOLUTION naive_generate
    B, P = ids.shape
    context = ids.new_empty(B, P + max_new_tokens)  # allocated once, filled step by step
    context[:, :P] = ids
    for t in range(max_new_tokens):
        logits = model(context[:, : P + t], pad=pad, last_only=True)[:, -1]
        token = next_token(logits)
        context[:, P + t] = token
        yield token, logits
    # END SOLUTION


def cached_steps(
    model, ids: Int[Tensor, "B P"], pad: Int[Tensor, " B"] | None, max_new_tokens: int, next_token: StepFn
) -> Iterator[tuple[Int[Tensor, " B"], Float[Tensor, "B V"]]]:
    """KV-cached generation: prefill the prompt in one pass, then feed one token per step.

    The cache is allocated once for P + max_new_tokens steps (`model.new_cache(B, ..., pad=pad)`:
    the cache carries the padding, so later forwards need no pad argument). The prefill gives the
    logits of the first new token; each later step feeds only the token just picked, [B, 1].
    Yields (new token per row [B], the logits it was picked from [B, V]) max_new_tokens times,
    with exactly one prefill and max_new_tokens - 1 one-token forwards.
    """
    # BEGIN SOLUTION generate
    B, P = ids.shape
    cache = model.new_cache(B, P + max_new_tokens, pad=pad)
    logits = model(ids, cache=cache, last_only=True)[:, -1]  # prefill
    for t in range(max_new_tokens):
        token = next_token(logits)
        yield token, logits
        if t + 1 < max_new_tokens:
            logits = model(token[:, None], cache=cache, last_only=True)[:, -1]  # decode one token
    # END SOLUTION


def prepare_prompts(
    model, prompt_ids: Prompt, max_new_tokens: int
) -> tuple[Int[Tensor, "B P"], Int[Tensor, " B"] | None, bool]:
    """Check the prompts against the model; return left-padded ids, pad (None if no row is padded),
    single. Before anything of size max_new_tokens is allocated (the settings: SamplingParams.validate).
    """
    prompts, single = as_prompt_list(prompt_ids)
    cfg = model.config
    for p in prompts:
        if p.numel() == 0:
            raise ValueError("every prompt needs at least one token")
        if int(p.min()) < 0 or int(p.max()) >= cfg.vocab_size:
            raise ValueError(
                f"prompt token ids must be in [0, {cfg.vocab_size}), got {int(p.min())}..{int(p.max())}"
            )
    device = model.embed.weight.device
    ids, pad = left_pad([p.to(device) for p in prompts])
    P = ids.shape[1]
    if P + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context window "
            f"of {cfg.max_seq_len} tokens"
        )
    pad = pad.to(device) if bool(pad.any()) else None
    return ids, pad, single


def generate_steps(
    model,
    prompt_ids: Prompt,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    params: SamplingParams | None = None,
    constraints: Sequence | None = None,
) -> Iterator[tuple[Int[Tensor, " B"], Float[Tensor, "B V"]]]:
    """The low-level loop: yields (tokens [B], logits [B, V]) for each of max_new_tokens steps.

    No stopping here (rows keep going after a stop token); generate / stream_generate handle that.
    For one prompt B = 1. Bad arguments raise ValueError here, at the call, not at the first step.
    constraints: one per row (or None), applied by `constrain` before each draw; the logits
    yielded are the constrained ones.
    """
    params = sampling_params(
        params, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    ids, pad, _ = prepare_prompts(model, prompt_ids, params.max_new_tokens)
    if constraints is not None and len(constraints) != ids.shape[0]:
        raise ValueError(f"{len(constraints)} constraints for {ids.shape[0]} prompts")
    return _run_steps(model, ids, pad, params, use_cache, constraints)


@torch.inference_mode()
def _run_steps(
    model, ids, pad, params: SamplingParams, use_cache: bool, constraints: Sequence | None = None
) -> Iterator[tuple[Int[Tensor, " B"], Float[Tensor, "B V"]]]:
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=ids.device).manual_seed(params.seed)

    def next_token(logits: Float[Tensor, "B V"]) -> Int[Tensor, " B"]:
        constrain(logits, constraints)
        token = sample_next_token(logits, params.temperature, params.top_k, params.top_p, generator)
        advance(constraints, token)
        return token

    steps = cached_steps if use_cache else naive_steps
    yield from steps(model, ids, pad, int(params.max_new_tokens), next_token)


@torch.inference_mode()
def generate(
    model,
    prompt_ids: Prompt,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    stop_token_ids: Sequence[int] | None = None,
    return_logits: bool = False,
    params: SamplingParams | None = None,
    return_logprobs: bool = False,
    constraints: Sequence | None = None,
):
    """Generate up to max_new_tokens new tokens per prompt (see the module docstring for shapes).

    The settings come as keywords or as one SamplingParams (params=), not both. use_cache=False runs
    the naive loop. stop_token_ids=None stops at the config's EOS ids; pass [] to always generate
    max_new_tokens. With return_logits=True returns (tokens, logits) where each row's logits are
    Float[n_new, V], the distribution each new token was sampled from (before temperature and
    filtering). With return_logprobs=True returns (tokens, logprobs): per row a list of
    TokenLogprobs, one per new token, with params.logprobs (or 0) alternatives (`sampled_logprobs`).
    constraints: one per prompt (or None), e.g. structured.JsonGrammar(tokenizer).matcher(schema):
    only the tokens it allows are drawn (`constrain`).
    """
    if return_logits and return_logprobs:
        raise ValueError("ask for return_logits or return_logprobs, not both")
    params = sampling_params(
        params, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_token_ids=stop_token_ids,
    )  # fmt: skip
    prompts, single = as_prompt_list(prompt_ids)
    stops = torch.tensor(params.stops(model.config), dtype=torch.long)
    # checks the prompts (a ValueError) before the buffers below are sized by max_new_tokens
    steps = generate_steps(model, prompts, use_cache=use_cache, params=params, constraints=constraints)
    max_new_tokens = int(params.max_new_tokens)
    B = len(prompts)
    device = model.embed.weight.device
    stops = stops.to(device)
    tokens = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    all_logits = None
    all_logprobs: list[list[TokenLogprobs]] = [[] for _ in range(B)]
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    for t, (token, logits) in enumerate(steps):
        tokens[:, t] = token
        if return_logprobs:
            lp = sampled_logprobs(logits, params.temperature, params.top_k, params.top_p)
            for row, entry in zip(all_logprobs, token_logprobs(lp, token, params.logprobs or 0), strict=True):
                row.append(entry)
        if return_logits:
            if all_logits is None:
                all_logits = logits.new_empty(B, max_new_tokens, logits.shape[-1])
            all_logits[:, t] = logits
        if stops.numel():
            hit = torch.isin(token, stops) & ~finished
            lengths = torch.where(hit, t + 1, lengths)
            finished |= hit
            if bool(finished.all()):
                break
    out = [tokens[b, : int(lengths[b])] for b in range(B)]
    extra = None
    if return_logits:
        extra = [all_logits[b, : int(lengths[b])] for b in range(B)]
    elif return_logprobs:
        extra = [all_logprobs[b][: int(lengths[b])] for b in range(B)]
    if single:
        return out[0] if extra is None else (out[0], extra[0])
    return out if extra is None else (out, extra)


def naive_generate(model, prompt_ids: Prompt, max_new_tokens: int = 64, **kwargs):
    """generate(..., use_cache=False): the lecture's baseline that recomputes the whole context each step."""
    return generate(model, prompt_ids, max_new_tokens, use_cache=False, **kwargs)


def stream_generate(
    model,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    use_cache: bool = True,
    stop_token_ids: Sequence[int] | None = None,
    params: SamplingParams | None = None,
    constraint=None,
) -> Iterator[int]:
    """Yield the new token ids of one prompt as they are produced (a stop token is yielded, then it ends).

    Settings as generate's (keywords or params=); constraint as one of generate's constraints. Bad
    arguments raise ValueError at the call, before the first token is asked for.
    """
    params = sampling_params(
        params, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_token_ids=stop_token_ids,
    )  # fmt: skip
    prompts, single = as_prompt_list(prompt_ids)
    if not single:
        raise ValueError("stream_generate takes one prompt (a 1-D tensor or a list of ints)")
    constraints = None if constraint is None else [constraint]
    steps = generate_steps(model, prompts[0], use_cache=use_cache, params=params, constraints=constraints)
    return _stream(steps, set(params.stops(model.config)))


def _stream(steps: Iterator[tuple[Tensor, Tensor]], stops: set[int]) -> Iterator[int]:
    for token, _ in steps:
        token_id = int(token[0])  # the one sync per step that streaming needs
        yield token_id
        if token_id in stops:
            return

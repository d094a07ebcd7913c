"""The top-p nucleus of a row without sorting the whole row: the same bits as sampling.top_p_filter.

top_p_filter (the lecture's rule) sorts the whole row to find the nucleus: the smallest set of most
likely tokens whose mass reaches p. For SmolLM2's 49,152 tokens that sort takes about 3 ms a row
(AMD EPYC Zen 5, 2 threads, 2026-11-27), a third of a decode step, while a nucleus rarely holds more
than a few hundred tokens. Here the nucleus is looked for among the row's NUCLEUS_SLICE most likely
tokens (one topk), and only a row whose nucleus is wider than that sorts more: its NUCLEUS_WIDE
largest values (a partition first), or else all of them. The sums are top_p_filter's (the same float32 cumulative sums over the same values
in the same order), so the kept tokens, and the logits, are the same bits; where tokens tie across the
edge of the nucleus, which of them top_p_filter keeps follows its sort, and `filter_row` hands that row
to filter_logits itself.

Used where sampled decoding meets the sort once per token: the fast decode path and the prompt's
first token in speculative decoding (`sample_row`, `draw_seeded`: the token sample_next_token draws,
the generator left in the same state), speculative sampling's distributions
(speculative.sampling_probs) and the serving engine (serving/sampler.py).
"""

from __future__ import annotations

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from .sampling import filter_logits

NUCLEUS_SLICE = 256  # the most likely tokens a row's nucleus is looked for in before the whole row
NUCLEUS_WIDE = 4096  # then the most likely tokens sorted before every value is


def sorted_descending(probs: Float[Tensor, "B V"]) -> Float[Tensor, "B V"]:
    """Each row's values, largest first. On the CPU through numpy's sort of the values alone (16
    SmolLM2 rows: about 1.6 ms, against about 24 ms for torch.sort, which also orders indices; AMD
    EPYC Zen 5, 2 threads, 2026-11-26)."""
    if probs.device.type != "cpu":
        return probs.sort(dim=-1, descending=True).values
    return torch.from_numpy(np.ascontiguousarray(np.sort(probs.numpy(), axis=-1)[:, ::-1]))


def kept_ranks(vals: Float[Tensor, "B C"], top_p: Float[Tensor, " B"]) -> Int[Tensor, " B"]:
    """How many of each row's values, sorted largest first, its nucleus keeps: those ranks whose mass
    above is still below p (sampling.top_p_filter's rule, the same float32 sums)."""
    return ((vals.cumsum(dim=-1) - vals) < top_p[:, None]).sum(dim=-1)


def nucleus_mask(probs: Float[Tensor, "B V"], top_p: Float[Tensor, " B"]) -> torch.Tensor:
    """Bool [B, V], True where a token is outside its row's nucleus: the mass of the tokens ranked
    strictly above it already reaches p (sampling.top_p_filter's rule).

    From the sorted values alone: the first r ranks are kept (the mass above rank r - 1 is below
    p, above rank r it is not), so every token larger than the r-th value v is kept, and of the
    tokens equal to v, as many as rank r still needs (the first ones; top_p_filter keeps any)."""
    vals = largest_sorted(probs, NUCLEUS_WIDE)
    r = kept_ranks(vals, top_p)[:, None]  # >= 1: nothing is above the first
    v = vals.gather(-1, r - 1)
    wider = (r >= vals.shape[-1])[:, 0] if vals.shape[-1] < probs.shape[-1] else None
    if wider is not None and wider.any():  # nuclei that may reach past the values sorted: every value
        every = sorted_descending(probs[wider])
        r[wider] = kept_ranks(every, top_p[wider])[:, None]
        v[wider] = every.gather(-1, r[wider] - 1)
    larger, tied = probs > v, probs == v
    need = r - larger.sum(dim=-1, keepdim=True)  # how many of the ties the nucleus still takes
    keep = probs >= v  # every tie, where they all fit (the usual case: the r-th value alone)
    split = (tied.sum(dim=-1, keepdim=True) > need)[:, 0]
    if split.any():  # ties across the edge: the first ones
        keep[split] = larger[split] | (tied[split] & (tied[split].cumsum(dim=-1) <= need[split]))
    return ~keep


def largest_sorted(probs: Float[Tensor, "B V"], k: int) -> Float[Tensor, "B C"]:
    """Each row's k largest values, largest first: the first k of sorted_descending, found by a
    partition, then a sort of those k alone (C = k; every value, C = V, if k >= V or off the CPU)."""
    V = probs.shape[-1]
    if k >= V or probs.device.type != "cpu":
        return sorted_descending(probs)
    top = np.partition(probs.numpy(), V - k, axis=-1)[:, V - k :]
    return torch.from_numpy(np.ascontiguousarray(np.sort(top, axis=-1)[:, ::-1]))


def nucleus_slice(
    probs: Float[Tensor, "B V"], top_p: Float[Tensor, " B"]
) -> tuple[Float[Tensor, "B C"], Int[Tensor, "B C"], Int[Tensor, " B"], torch.Tensor]:
    """Each row's NUCLEUS_SLICE most likely tokens, largest first (values, ids), how many of them its
    nucleus keeps (r), and whether the nucleus lies inside the slice (Bool [B]: the first token past
    the slice is dropped, so every later one is too); the other rows need nucleus_mask."""
    c = min(NUCLEUS_SLICE + 1, probs.shape[-1])
    vals, ids = probs.topk(c, dim=-1)
    r = kept_ranks(vals, top_p)
    inside = r < c if c < probs.shape[-1] else torch.ones_like(r, dtype=torch.bool)
    return vals, ids, r, inside


def filter_row(
    logits: Float[Tensor, "1 V"], temperature: float, top_k: int | None = None, top_p: float | None = None
) -> Float[Tensor, "1 V"]:
    """sampling.filter_logits(logits, temperature, top_k, top_p) for one row, the same bits, without
    sorting the row for top-p: its nucleus (the first r ranks, by kept_ranks) is every token at
    least as likely as the r-th. Where tokens tie with the r-th and only some of them are kept,
    which ones depends on the order top_p_filter's sort gives them, so that row goes to
    filter_logits itself."""
    if top_p is None or top_p >= 1.0:
        return filter_logits(logits, temperature, top_k, top_p)
    x = filter_logits(logits, temperature, top_k)  # divided by T, top-k: filter_logits' first steps
    probs = x.softmax(dim=-1)  # what top_p_filter ranks (x is float32 already)
    p = torch.tensor([top_p], dtype=torch.float32, device=x.device)
    vals, _, r, inside = nucleus_slice(probs, p)
    if not bool(inside[0]):  # wider than the slice: every value, sorted
        vals = sorted_descending(probs)
        r = kept_ranks(vals, p)
    r = int(r[0])
    if r < vals.shape[-1] and bool(vals[0, r] == vals[0, r - 1]):  # a tie across the edge
        return filter_logits(logits, temperature, top_k, top_p)
    return x.masked_fill(probs < vals[0, r - 1], float("-inf"))


def draw_seeded(
    logits: Float[Tensor, "1 V"],
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[int, Float[Tensor, "1 V"]]:
    """sampling.sample_next_token(logits, temperature, top_k, top_p, generator) for one sampled row
    (temperature > 0): the same token, and the generator left in the same state. Also returns the
    filtered logits, whose log-softmax is the row's `sampled_logprobs`."""
    x = filter_row(logits, temperature, top_k, top_p)
    return int(torch.multinomial(x.softmax(dim=-1), num_samples=1, generator=generator)[0, 0]), x


def sample_row(
    logits: Float[Tensor, "1 V"],
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> Int[Tensor, " 1"]:
    """sampling.sample_next_token for one row, greedy or sampled: the same token (and generator state),
    without sorting the row for top-p."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    token, _ = draw_seeded(logits, temperature, top_k, top_p, generator)
    return torch.tensor([token], device=logits.device)


def draw_inverse_cdf(weights: Float[Tensor, "n C"], u: Float[Tensor, " n"]) -> Int[Tensor, " n"]:
    """Per row, the first column whose cumulative weight exceeds u times the row's total (float64);
    a column of weight 0 is never chosen. With u ~ U[0, 1): a draw from the row's weights for one
    uniform number, where torch.multinomial on the CPU draws an exponential per column (about 0.8 ms
    for SmolLM2's 49,152 tokens; AMD EPYC Zen 5, 2 threads, 2026-11-27)."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None].to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]

"""The engine's sampler for rows that carry no seed: every row drawn in a few batched operations.

`sampling.sample_next_token` draws one row at a time with torch.multinomial, which on the CPU
draws one exponential per vocabulary entry (argmax of p / Exp(1)), and top-p sorts the whole row:
for SmolLM2's 49,152 tokens about 0.7 and 3 ms a row (AMD EPYC Zen 5, 2026-11-26), so sixteen
sampled rows cost more than the decode step that made their logits. Here the same distribution,
softmax(filter_logits(row, T, k, p)), is drawn with one uniform number per row (inverse CDF):

    logits / T             every row by its own temperature
    top-k                  one topk for the largest k among the rows, each row keeping its first k
    top-p                  the nucleus from the row's NUCLEUS_SLICE most likely tokens (one topk,
                           nucleus.py), and the draw among them; a row whose nucleus is wider than
                           that: from its NUCLEUS_WIDE largest values sorted (a partition first), or
                           else all of them (a threshold and a count of ties, no sorted indices)
    draw                   u ~ U[0, 1) per row, the first token whose cumulative mass exceeds u times
                           the row's total (float64 sums; a token of zero probability is never drawn)

Rows with a seed draw one at a time with their own generator (`nucleus.draw_seeded`), exactly as
`sample_next_token` draws, so that a seeded request draws what `generate(..., seed=seed)` draws:
torch.multinomial on the same probabilities, from logits equal bit for bit to filter_logits' but
with the nucleus found as above instead of by a sort of the whole row (`filter_row`). Unseeded
rows draw from the global random stream, which no caller can replay, so only their distribution
is promised; the tests check it by chi-square against a truncated softmax written out in plain
Python, with controls that must fail, and the nucleus token for token against top_p_filter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from cs336_inference.nucleus import draw_inverse_cdf, nucleus_mask, nucleus_slice


def sample_rows(
    logits: Float[Tensor, "B V"],
    temperature: Sequence[float],
    top_k: Sequence[int | None],
    top_p: Sequence[float | None],
    generator: torch.Generator | None = None,
) -> Int[Tensor, " B"]:
    """One token per row, drawn from softmax(filter_logits(row, temperature[b], top_k[b], top_p[b]))
    (every temperature > 0), with one uniform number per row from `generator` (None: the global
    random stream)."""
    B, V = logits.shape
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=logits.device)[:, None]
    ks = [V if k is None else min(k, V) for k in top_k]
    if min(ks) < V:
        kmax = max(k for k in ks if k < V)
        vals, idx = x.topk(kmax, dim=-1)
        keep = torch.arange(kmax, device=x.device)[None, :] < torch.tensor(ks, device=x.device)[:, None]
        cut = torch.full_like(x, float("-inf")).scatter(-1, idx, vals.masked_fill(~keep, float("-inf")))
        limited = torch.tensor([k < V for k in ks], device=x.device)
        x = torch.where(limited[:, None], cut, x)
    probs = x.softmax(dim=-1)
    u = torch.rand(
        B, dtype=torch.float64, generator=generator, device=generator.device if generator else None
    )
    u = u.to(x.device)
    tokens = torch.empty(B, dtype=torch.long, device=x.device)
    whole = torch.ones(B, dtype=torch.bool, device=x.device)  # rows drawn over the whole vocabulary
    ps = [1.0 if p is None else p for p in top_p]
    nucleus = [b for b, p in enumerate(ps) if p < 1.0]
    if nucleus:
        rows = torch.tensor(nucleus, device=x.device)
        p = torch.tensor([ps[b] for b in nucleus], dtype=torch.float32, device=x.device)
        vals, ids, r, inside = nucleus_slice(probs[rows], p)
        kept = vals.masked_fill(torch.arange(vals.shape[-1], device=x.device)[None, :] >= r[:, None], 0.0)
        pick = draw_inverse_cdf(kept[inside], u[rows[inside]])
        tokens[rows[inside]] = ids[inside].gather(-1, pick[:, None])[:, 0]
        whole[rows[inside]] = False
        wide = rows[~inside]  # nuclei wider than the slice: masked over the whole row
        if len(wide):
            probs[wide] = probs[wide].masked_fill(nucleus_mask(probs[wide], p[~inside]), 0.0)
    if whole.any():
        tokens[whole] = draw_inverse_cdf(probs[whole], u[whole])
    return tokens

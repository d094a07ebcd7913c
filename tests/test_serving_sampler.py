"""The engine's batched sampler for unseeded rows (serving/sampler.py).

Its draws cannot equal `sample_next_token`'s (one uniform per row instead of one exponential per
token), so what is checked is the distribution: every row of one mixed batch against a plain-Python
truncated softmax, by chi-square, with controls showing the same counts reject the neighbouring
wrong distributions; and the nucleus against top_p_filter's, token for token, including rows whose
nucleus is wider than the sorted slice.
"""

import pytest
import torch

from cs336_inference import nucleus
from cs336_inference.nucleus import nucleus_mask, nucleus_slice
from cs336_inference.sampling import top_p_filter
from cs336_inference.serving import sampler
from cs336_inference.serving.sampler import sample_rows
from tests.test_sampling import CHI2_CRITICAL_999, chi_square

ROW = [1.2, 0.4, -0.3, 0.9, -1.0, 0.1, 0.6, -0.6]  # V = 8
N = 20_000
# (temperature, top_k, top_p) per row of one batch
CONFIGS = [(0.7, None, None), (1.4, 4, None), (1.0, None, 0.75), (0.9, 6, 0.6), (2.0, 3, 0.99)]


def plain_truncated_softmax(logits: list[float], t: float, k: int | None, p: float | None) -> torch.Tensor:
    """softmax(logits / t) over the k most likely tokens, renormalised, then the smallest prefix of
    them (most likely first) whose mass reaches p, renormalised; written without the library."""
    import math

    weights = [math.exp(x / t) for x in logits]
    ranked = sorted(range(len(weights)), key=lambda i: -weights[i])[: k or len(weights)]
    total = sum(weights[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += weights[i] / total
        if p is not None and mass >= p:
            break
    out = torch.zeros(len(logits), dtype=torch.float64)
    out[kept] = torch.tensor([weights[i] for i in kept], dtype=torch.float64)
    return out / out.sum()


def mixed_counts(seed: int = 0) -> list[torch.Tensor]:
    logits = torch.tensor(ROW).repeat(len(CONFIGS) * N, 1)
    cfg = [c for c in CONFIGS for _ in range(N)]
    g = torch.Generator().manual_seed(seed)
    tokens = sample_rows(logits, [c[0] for c in cfg], [c[1] for c in cfg], [c[2] for c in cfg], generator=g)
    assert tokens.shape == (len(cfg),) and tokens.dtype == torch.long
    return [torch.bincount(tokens[i * N : (i + 1) * N], minlength=len(ROW)) for i in range(len(CONFIGS))]


@pytest.mark.parametrize("slice_size", [256, 2], ids=["nuclei in the slice", "wider nuclei: whole rows"])
def test_every_row_of_a_mixed_batch_draws_its_own_truncated_softmax(slice_size, monkeypatch):
    monkeypatch.setattr(nucleus, "NUCLEUS_SLICE", slice_size)
    counts = mixed_counts()
    for (t, k, p), c in zip(CONFIGS, counts, strict=True):
        want = plain_truncated_softmax(ROW, t, k, p)
        kept = set(want.nonzero().flatten().tolist())
        drawn = set(c.nonzero().flatten().tolist())
        assert drawn <= kept, (
            f"T={t} k={k} p={p}: drew {sorted(drawn - kept)}, outside the kept set {sorted(kept)}"
        )
        stat, critical = chi_square(c, want), CHI2_CRITICAL_999[len(kept) - 1]
        assert stat < critical, (
            f"T={t} k={k} p={p}: chi2 {stat:.1f} > {critical}; expected {[round(x, 3) for x in want.tolist()]}, "
            f"got {[round(x, 3) for x in (c / N).tolist()]}"
        )


def test_the_chi_square_rejects_the_neighbouring_mistakes():
    """Controls: the counts above must not fit a row's distribution with another row's temperature,
    without its top-k, without its top-p, or with the nucleus one token wider (each where it changes
    that row's distribution: a nucleus inside the top k does not depend on k)."""
    counts = mixed_counts()
    for (t, k, p), c in zip(CONFIGS, counts, strict=True):
        wrong = {"temperature 1": plain_truncated_softmax(ROW, 1.0 if t != 1.0 else 0.7, k, p)}
        if k is not None:
            wrong["no top-k"] = plain_truncated_softmax(ROW, t, None, p)
        if p is not None:
            wrong["no top-p"] = plain_truncated_softmax(ROW, t, k, None)
            n_kept = int((plain_truncated_softmax(ROW, t, k, p) > 0).sum())
            ranked = plain_truncated_softmax(ROW, t, k, None)
            wider = torch.zeros_like(ranked)
            top = ranked.argsort(descending=True)[: n_kept + 1]
            wider[top] = ranked[top]
            wrong["nucleus one wider"] = wider / wider.sum()
        right = plain_truncated_softmax(ROW, t, k, p)
        wrong = {
            name: d for name, d in wrong.items() if (d - right).abs().sum() > 0.02
        }  # mistakes that show here
        assert len(wrong) >= 1 + (k is not None and p is None)
        for name, dist in wrong.items():
            kept = int((dist > 0).sum())
            stat = chi_square(c, dist)
            assert stat > CHI2_CRITICAL_999[min(max(kept - 1, 1), 7)], (
                f"T={t} k={k} p={p}: cannot tell it from {name}"
            )


@pytest.mark.parametrize("wide", [None, 10], ids=["every value sorted", "10 largest sorted first"])
@pytest.mark.parametrize("sort", ["numpy", "torch"], ids=["cpu sort", "torch.sort (other devices)"])
def test_nucleus_equals_top_p_filter_token_for_token(sort, wide, monkeypatch):
    if sort == "torch":
        monkeypatch.setattr(nucleus, "sorted_descending", lambda p: p.sort(dim=-1, descending=True).values)
    if wide is not None:  # the partial sort (NUCLEUS_WIDE), then every value for the wider nuclei
        monkeypatch.setattr(nucleus, "NUCLEUS_WIDE", wide)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(24, 1000, generator=g) * torch.linspace(0.2, 6.0, 24)[:, None]  # flat to peaked
    ps = torch.linspace(0.05, 0.995, 24)
    probs = logits.softmax(dim=-1)
    got = nucleus_mask(probs, ps)
    widths = []
    for b in range(24):
        want = torch.isinf(top_p_filter(logits[b : b + 1], float(ps[b])))[0]
        widths.append(int((~want).sum()))
        assert torch.equal(got[b], want), (
            f"row {b} (p={float(ps[b]):.3f}, {sort} sort): kept {int((~got[b]).sum())} tokens, "
            f"top_p_filter keeps {widths[-1]}"
        )
    assert min(widths) < 10 <= max(widths), f"nuclei of {widths}: both sides of 10 should be among the cases"


def test_a_nucleus_inside_the_slice_is_top_p_filters_token_for_token(monkeypatch):
    monkeypatch.setattr(nucleus, "NUCLEUS_SLICE", 40)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(24, 1000, generator=g) * torch.linspace(0.5, 6.0, 24)[:, None]
    ps = torch.linspace(0.995, 0.3, 24)  # nuclei of 1 to 981 tokens, one of 41
    vals, ids, r, inside = nucleus_slice(logits.softmax(dim=-1), ps)
    assert 0 < int(inside.sum()) < 24, "the cases should include nuclei inside and outside a 40-token slice"
    for b in range(24):
        want = set(
            (~torch.isinf(top_p_filter(logits[b : b + 1], float(ps[b])))[0]).nonzero().flatten().tolist()
        )
        assert bool(inside[b]) == (len(want) < 41), (
            f"row {b}: inside={bool(inside[b])} for a nucleus of {len(want)}"
        )
        if inside[b]:
            got = set(ids[b, : int(r[b])].tolist())
            assert got == want, (
                f"row {b} (p={float(ps[b]):.3f}): kept {sorted(got)[:8]}..., expected {sorted(want)[:8]}..."
            )


def test_tied_tokens_at_the_edge_of_the_nucleus_are_kept_only_as_many_as_needed():
    probs = torch.tensor([[0.1, 0.2, 0.2, 0.2, 0.2, 0.1]])  # 0.2 and 0.1 tie
    for p, n in [(0.3, 2), (0.5, 3), (0.61, 4), (0.85, 5), (0.95, 6)]:
        kept = (~nucleus_mask(probs, torch.tensor([p]))[0]).nonzero().flatten().tolist()
        want = (~torch.isinf(top_p_filter(probs.log(), p)[0])).sum().item()
        assert len(kept) == n == want, f"p={p}: kept {kept}, expected {n} tokens (top_p_filter keeps {want})"
        assert len({1, 2, 3, 4} & set(kept)) == min(n, 4), f"p={p}: kept {kept}, a 0.1 before all four 0.2s"


def test_a_token_of_zero_probability_is_never_drawn():
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0]]).repeat(4000, 1)
    n = len(logits)
    one = sample_rows(logits, [1.0] * n, [1] * n, [None] * n)
    assert (one == 1).all(), "top_k = 1 must always draw the argmax"
    tiny = sample_rows(logits, [3.0] * n, [None] * n, [1e-6] * n)
    assert (tiny == 1).all(), "a nucleus of p = 1e-6 holds the argmax only"
    masked = logits.clone()
    masked[:, 1] = float("-inf")
    drawn = sample_rows(masked, [1.0] * n, [None] * n, [None] * n)
    assert (drawn != 1).all(), "a -inf logit (a grammar's mask) was drawn"


@pytest.mark.parametrize("slice_size", [256, 0], ids=["nucleus in the slice", "nucleus over the whole row"])
@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53, 1.0], ids=["u=0", "u=1-eps", "u*total rounded up"])
def test_the_ends_of_the_uniform_draw_a_possible_token(u, slice_size, monkeypatch):
    """u = 0 must skip leading tokens of zero probability, and u just below 1 must not run past the
    last possible token into trailing ones (or past the end), even where u * total rounds up to total
    (u = 1 here)."""
    monkeypatch.setattr(nucleus, "NUCLEUS_SLICE", slice_size)  # 0: row 2's one-token nucleus is "wider"
    monkeypatch.setattr(
        sampler.torch, "rand", lambda *shape, **kw: torch.full(shape, u, dtype=kw.get("dtype"))
    )
    logits = torch.tensor([[float("-inf"), 0.3, 2.0, -1.0, float("-inf")]] * 3)
    got = sample_rows(logits, [1.0] * 3, [None, 2, None], [None, None, 0.5]).tolist()
    want = [1, 1, 2] if u == 0.0 else [3, 2, 2]  # row 2: a nucleus of token 2 alone
    assert got == want, f"u={u}: drew {got}, expected {want} (first / last token of positive probability)"


def test_a_token_whose_mass_above_is_exactly_p_is_dropped():
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])  # exact in binary
    for p, kept in [(0.75, [0, 1]), (0.7, [0, 1]), (0.5, [0]), (0.875, [0, 1, 2]), (0.9, [0, 1, 2, 3])]:
        got = (~nucleus_mask(probs, torch.tensor([p]))[0]).nonzero().flatten().tolist()
        assert got == kept, f"p={p}: kept {got}, expected {kept} (kept iff the mass ranked above is below p)"
        _, ids, r, _ = nucleus_slice(probs, torch.tensor([p]))
        got = sorted(ids[0, : int(r[0])].tolist())
        assert got == kept, f"p={p}, the slice: kept {got}, expected {kept}"


def test_the_engine_draws_unseeded_rows_in_one_batch_and_seeded_rows_as_generate(monkeypatch):
    from cs336_inference.serving import LLMEngine, SamplingParams
    from cs336_inference.serving import engine as engine_module
    from tests.test_serving_engine import alone, tiny_model

    calls = []

    def counted(logits, *args, **kwargs):
        calls.append(len(logits))
        return sample_rows(logits, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample_rows", counted)
    model = tiny_model()
    prompts = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2], [7, 7]]
    free = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.9, stop_token_ids=())
    seeded = SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.9, seed=17, stop_token_ids=())
    engine = LLMEngine(model, num_blocks=32, block_size=4)
    outs = engine.generate(prompts, [free, free, free, seeded])
    assert all(len(o) == 6 and all(0 <= t < model.config.vocab_size for t in o) for o in outs)
    assert calls and max(calls) == 3, f"batched draws per step {calls}: expected the 3 unseeded rows together"
    assert outs[3] == alone(model, prompts[3], seeded), "a seeded row no longer draws as generate(seed=...)"


def _rows_to_filter(V: int = 4000, n: int = 36) -> tuple[torch.Tensor, list[tuple[float, int | None, float]]]:
    """Rows from flat to peaked, each with (temperature, top_k, top_p): nuclei of one token to
    thousands, inside and outside the sorted slice, with and without top-k."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, V, generator=g) * torch.linspace(0.3, 8.0, n)[:, None]
    cfgs = [
        ([0.6, 1.0, 1.7][b % 3], [None, 40, 900][(b // 3) % 3], float(torch.linspace(0.999, 0.02, n)[b]))
        for b in range(n)
    ]
    return logits, cfgs


def _count_fallbacks(monkeypatch) -> list[bool]:
    """Record, for each filter_logits call of nucleus.py, whether it was given top_p (a row that went
    to filter_logits whole) or not (the fast nucleus)."""
    calls = []
    real = nucleus.filter_logits

    def counted(logits, temperature, top_k=None, top_p=None):
        calls.append(top_p is not None)
        return real(logits, temperature, top_k, top_p)

    monkeypatch.setattr(nucleus, "filter_logits", counted)
    return calls


def test_filter_row_gives_filter_logits_bits_without_sorting(monkeypatch):
    """The seeded rows' filter (nucleus.filter_row) against sampling.filter_logits, bit for bit, on
    rows whose nucleus is inside and outside the slice; none of them goes to filter_logits whole."""
    from cs336_inference.sampling import filter_logits

    logits, cfgs = _rows_to_filter()
    calls = _count_fallbacks(monkeypatch)
    widths = []
    for b, (t, k, p) in enumerate(cfgs):
        row = logits[b : b + 1]
        got, want = nucleus.filter_row(row, t, k, p), filter_logits(row, t, k, p)
        widths.append(int(torch.isfinite(want).sum()))
        assert torch.equal(got, want), (
            f"row {b} (T={t}, k={k}, p={p:.3f}): {int(torch.isfinite(got).sum())} tokens kept, "
            f"filter_logits keeps {widths[-1]}, or their values differ"
        )
    assert not any(calls), f"{sum(calls)} rows without ties went to filter_logits whole"
    assert min(widths) == 1 and sum(w > nucleus.NUCLEUS_SLICE for w in widths) >= 5, widths


def test_filter_row_with_ties_at_the_edge_of_the_nucleus(monkeypatch):
    """Logits on a coarse grid tie in groups. A row whose tie straddles the nucleus' edge (which of the
    tied tokens top_p_filter keeps follows its sort) goes to filter_logits; every other row is found
    without it, and still equals it bit for bit."""
    from cs336_inference.sampling import filter_logits

    g = torch.Generator().manual_seed(12)
    logits = (torch.randn(60, 300, generator=g) * 2.0).round() / 2.0  # about 20 distinct values a row
    calls = _count_fallbacks(monkeypatch)
    outcomes = []
    for b in range(60):
        p = 0.1 + 0.85 * b / 59
        row = logits[b : b + 1]
        before = len(calls)
        got = nucleus.filter_row(row, 1.0, None, p)
        outcomes.append(any(calls[before:]))  # filter_logits given top_p: the whole row
        want = filter_logits(row, 1.0, None, p)
        if not outcomes[-1]:
            assert torch.equal(got, want), f"row {b} (p={p:.3f}): differs from filter_logits"
        probs = filter_logits(row, 1.0).softmax(dim=-1)[0]  # what the nucleus is ranked by
        kept = torch.isfinite(got[0])
        straddles = bool((probs[~kept] == probs[kept].min()).any())
        assert outcomes[-1] == straddles, (
            f"row {b} (p={p:.3f}): went to filter_logits: {outcomes[-1]}, a tie straddles the edge: {straddles}"
        )
    assert 0 < sum(outcomes) < 60, f"{sum(outcomes)} of 60 rows straddle a tie: the cases should include both"


def test_draw_seeded_draws_what_sample_next_token_draws():
    """Same token and same generator state after every draw, for rows of SmolLM2's vocabulary size
    with and without top-k and top-p, the generator carried from one draw to the next."""
    from cs336_inference.sampling import sample_next_token

    g = torch.Generator().manual_seed(13)
    logits = torch.randn(12, 49152, generator=g) * torch.linspace(0.5, 6.0, 12)[:, None]
    ours, theirs = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
    for b in range(12):
        t, k, p = [0.7, 1.0, 1.3][b % 3], [None, 50][b % 2], [None, 0.9, 0.5, 0.99][b % 4]
        for draw in range(3):
            row = logits[b : b + 1]
            token, filtered = nucleus.draw_seeded(row, t, k, p, ours)
            want = int(sample_next_token(row, t, k, p, theirs)[0])
            assert token == want, f"row {b} draw {draw} (T={t}, k={k}, p={p}): drew {token}, expected {want}"
            assert torch.equal(ours.get_state(), theirs.get_state()), (
                f"row {b} draw {draw}: generator states differ"
            )
            assert torch.isfinite(filtered[0, token]), f"row {b} draw {draw}: the token is outside its filter"

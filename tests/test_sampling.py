"""Sampling from logits: temperature, top-k, top-p, seeds (no model needed).

Distributions are checked by frequencies: a chi-square goodness-of-fit test against softmax(logits / T)
with a fixed seed, and a negative control showing the same test rejects a wrong temperature.
"""

import math

import pytest
import torch

from cs336_inference.sampling import (
    apply_temperature,
    check_sampling_args,
    sample_next_token,
    top_k_filter,
    top_p_filter,
)

# Upper 0.1% points of the chi-square distribution (standard tables, e.g. NIST/SEMATECH e-Handbook
# 1.3.6.7.4): P(chi2_df > value) = 0.001.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.8, 0.2, -0.2])  # V = 8, df = 7
N_DRAWS = 20_000


def wilson_hilferty(df: int, z: float) -> float:
    """Approximate chi-square quantile: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def test_critical_values_agree_with_wilson_hilferty():
    # z = 3.0902 is the 99.9% point of the standard normal; the approximation is within a few percent
    # (3.0% at one degree of freedom, where it is worst).
    for df, value in CHI2_CRITICAL_999.items():
        assert wilson_hilferty(df, 3.0902) == pytest.approx(value, rel=0.035)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """sum (observed - expected)^2 / expected over categories with expected > 0."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float((((counts.double() - expected) ** 2)[keep] / expected[keep]).sum())


def draw(logits: torch.Tensor, n: int, seed: int, **kwargs) -> torch.Tensor:
    """Counts per token of n independent draws (one batch row per draw)."""
    g = torch.Generator().manual_seed(seed)
    tokens = sample_next_token(logits.expand(n, -1), generator=g, **kwargs)
    assert tokens.shape == (n,) and tokens.dtype == torch.long, (
        f"sample_next_token({kwargs}) on [{n}, V] logits: expected a LongTensor of shape ({n},), "
        f"got {tokens.dtype} of shape {tuple(tokens.shape)}"
    )
    return torch.bincount(tokens, minlength=logits.shape[-1])


def finite_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


@pytest.mark.graded(problem="sampling", points=2)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    counts = draw(LOGITS, N_DRAWS, seed=1234, temperature=temperature)
    critical = CHI2_CRITICAL_999[LOGITS.numel() - 1]
    want = torch.softmax(LOGITS.double() / temperature, dim=-1)
    stat = chi_square(counts, want)
    assert stat < critical, (
        f"temperature={temperature}: {N_DRAWS} draws do not fit softmax(logits / {temperature}) "
        f"(chi2 = {stat:.1f} > {critical}); expected frequencies {[round(x, 3) for x in want.tolist()]}, "
        f"got {[round(x, 3) for x in (counts / N_DRAWS).tolist()]}"
    )
    # Negative control: the same counts must fail against a temperature 25% off, in either direction.
    for wrong in (temperature * 1.25, temperature / 1.25):
        wrong_stat = chi_square(counts, torch.softmax(LOGITS.double() / wrong, dim=-1))
        assert wrong_stat > critical, f"chi-square cannot tell T={temperature} from T={wrong}"


# (temperature, top_k, top_p, tokens kept). The kept sets are worked out by hand in the comments from
# softmax(LOGITS / T) (LOGITS ranks tokens 0, 5, 1, 6, 2, 7, 3, 4). Each case tells the handout's
# order (temperature, top-k, top-p) from the two wrong orders.
PIPELINE_CASES = {
    # T = 0.5, top-4 {0, 5, 1, 6}, renormalised 0.446, 0.299, 0.164, 0.090: the mass above token 1 is
    # 0.746 >= 0.7, so {0, 5}. Top-p before the temperature (probabilities at T = 1 over the top 4:
    # 0.348, 0.285, 0.211, ...) keeps token 1 too (mass above it 0.633 < 0.7); so does top-p before
    # top-k (over all 8 tokens at T = 0.5 the mass above token 1 is 0.659).
    "sharpened": (0.5, 4, 0.7, {0, 5}),
    # T = 2, top-5 renormalised 0.253, 0.229, 0.197, 0.169, 0.153: mass above token 6 is 0.678 < 0.7,
    # above token 2 0.847, so {0, 5, 1, 6}. At T = 1 the mass above token 6 is 0.748 (dropped); over
    # all 8 tokens at T = 2 the mass above token 2 is 0.627 (kept).
    "flattened": (2.0, 5, 0.7, {0, 5, 1, 6}),
    # T = 0.8, top-6, p = 0.8: {0, 5, 1, 6}, fewer than the k = 6 tokens, so both filters act.
    "both_filters": (0.8, 6, 0.8, {0, 5, 1, 6}),
}


def truncated_softmax(temperature: float, k: int, p: float) -> torch.Tensor:
    """The handout's recipe in plain Python: top k of softmax(LOGITS / T), renormalised, then the
    smallest prefix whose mass reaches p, renormalised."""
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: -probs[i])[:k]
    top_mass = sum(probs[i] for i in ranked)
    kept, mass = [], 0.0
    for i in ranked:
        kept.append(i)
        mass += probs[i] / top_mass
        if mass >= p:
            break
    expected = torch.zeros(len(probs), dtype=torch.float64)
    expected[kept] = torch.tensor([probs[i] for i in kept], dtype=torch.float64)
    return expected / expected.sum()


@pytest.mark.graded(problem="sampling", points=2)
@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_temperature_top_k_top_p_frequencies_match_the_truncated_softmax(case):
    temperature, k, p, kept = PIPELINE_CASES[case]
    expected = truncated_softmax(temperature, k, p)
    assert set(torch.nonzero(expected).flatten().tolist()) == kept, f"{case}: the hand computation disagrees"

    counts = draw(LOGITS, N_DRAWS, seed=99, temperature=temperature, top_k=k, top_p=p)
    args = f"sample_next_token(temperature={temperature}, top_k={k}, top_p={p})"
    sampled = set(torch.nonzero(counts).flatten().tolist())
    assert sampled <= kept, (
        f"{args}: sampled tokens {sorted(sampled - kept)} that the filters remove; expected only {sorted(kept)} "
        "(order: temperature, then top-k, then top-p over the renormalised top k)"
    )
    stat, critical = chi_square(counts, expected), CHI2_CRITICAL_999[len(kept) - 1]
    assert stat < critical, (
        f"{args}: frequencies do not fit the truncated softmax (chi2 = {stat:.1f} > {critical}); expected "
        f"{[round(x, 3) for x in expected.tolist()]}, got {[round(x, 3) for x in (counts / N_DRAWS).tolist()]}"
    )


@pytest.mark.graded(problem="sampling", points=1)
def test_top_k_filter_keeps_exactly_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    for k in (1, 5, 49, 50, 80):
        out = top_k_filter(logits, k)
        assert out.shape == logits.shape, (
            f"top_k_filter(k={k}): expected shape {tuple(logits.shape)}, got {tuple(out.shape)}"
        )
        for r, (row, out_row) in enumerate(zip(logits.tolist(), out, strict=True)):
            largest = set(sorted(range(50), key=lambda i: -row[i])[: min(k, 50)])
            kept = finite_set(out_row)
            assert kept == largest, (
                f"top_k_filter(k={k}) on V=50, row {r}: expected to keep the {min(k, 50)} largest, "
                f"kept {len(kept)}; missing {sorted(largest - kept)}, extra {sorted(kept - largest)}"
            )
            changed = [i for i in kept if out_row[i] != row[i]]
            assert not changed, f"top_k_filter(k={k}) row {r}: kept logits {changed} changed value"
            dropped = [i for i in range(50) if i not in kept and out_row[i] != float("-inf")]
            assert not dropped, f"top_k_filter(k={k}) row {r}: dropped logits {dropped} are not -inf"
    # Ties at the k-th value: still exactly k tokens, all at least as large as every dropped one.
    tied = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, -1.0, 5.0]])
    for k in (1, 2, 3):
        out = top_k_filter(tied, k)
        for r in range(2):
            kept = finite_set(out[r])
            assert len(kept) == k, (
                f"top_k_filter(k={k}) on tied row {tied[r].tolist()}: expected exactly {k} finite logits, "
                f"got {len(kept)} ({sorted(kept)})"
            )
            low = min(tied[r, i] for i in kept)
            assert all(tied[r, i] <= low for i in range(5) if i not in kept), (
                f"top_k_filter(k={k}) on tied row {tied[r].tolist()}: kept {sorted(kept)}, not the {k} largest"
            )


@pytest.mark.graded(problem="sampling", points=2)
@pytest.mark.parametrize(
    "p, kept",
    [
        (0.3, {1}),  # 0.5 alone reaches 0.3
        (0.55, {1, 3}),  # 0.5 < 0.55 <= 0.5 + 0.3
        (0.79, {1, 3}),
        (0.85, {1, 3, 2}),  # 0.8 < 0.85 <= 0.95
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    # A hand-made distribution in shuffled vocabulary order: token 1 has 0.5, 3 has 0.3, 2 has 0.15, 0 has 0.05.
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.3, 0.15, 0.05, 0.5]])
    logits = probs.log() + 3.0  # any shift gives the same distribution
    out = top_p_filter(logits, p)
    # Row two is row one with tokens relabelled 0->2, 1->3, 2->1, 3->0: each row is filtered on its own.
    relabel = {0: 2, 1: 3, 2: 1, 3: 0}
    for r, want in enumerate([kept, {relabel[i] for i in kept}]):
        got = finite_set(out[r])
        assert got == want, (
            f"top_p_filter(p={p}) on probabilities {probs[r].tolist()} (row {r}): expected to keep tokens "
            f"{sorted(want)}, kept {sorted(got)} (a token stays iff the mass ranked above it is < p)"
        )
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite]), f"top_p_filter(p={p}): kept logits changed value"
    # The boundary, exactly: 8 equal logits have probability 1/8 each (exact in floating point), so the
    # mass ranked above the j-th token is exactly j/8. Where p is such a mass, the rule (kept iff the
    # mass above is < p) keeps j tokens, not j + 1: the nucleus has just reached p.
    uniform = torch.zeros(1, 8)
    for j in (1, 2, 4, 7):
        got = int(torch.isfinite(top_p_filter(uniform, j / 8)).sum())
        assert got == j, (
            f"top_p_filter(p={j}/8) on 8 equal logits (1/8 each): expected {j} tokens (the mass of {j} "
            f"already equals p; a token is kept iff the mass above it is < p), kept {got}"
        )


@pytest.mark.graded(problem="sampling", points=1)
def test_seeded_draws_repeat_and_top_k_one_is_greedy():
    torch.manual_seed(2)
    logits = torch.randn(256, 50)
    kwargs = dict(temperature=1.0, top_k=40, top_p=0.95)
    a = sample_next_token(logits, generator=torch.Generator().manual_seed(7), **kwargs)
    b = sample_next_token(logits, generator=torch.Generator().manual_seed(7), **kwargs)
    c = sample_next_token(logits, generator=torch.Generator().manual_seed(8), **kwargs)
    differ = torch.nonzero(a != b).flatten().tolist()
    assert not differ, (
        f"sample_next_token({kwargs}) twice with generators seeded 7: rows {differ[:5]} differ "
        "(draw with the generator that is passed in)"
    )
    assert not torch.equal(a, c), "generators seeded 7 and 8 gave the same 256 draws"
    # top_k = 1 leaves one token, whatever the temperature: sampling reproduces argmax.
    logits = torch.randn(64, 100) * 3
    g = torch.Generator().manual_seed(0)
    for temperature in (0.7, 1.0, 5.0):
        sampled = sample_next_token(logits, temperature=temperature, top_k=1, generator=g)
        wrong = torch.nonzero(sampled != logits.argmax(dim=-1)).flatten().tolist()
        assert not wrong, (
            f"sample_next_token(temperature={temperature}, top_k=1): rows {wrong[:5]} did not give the argmax "
            f"(e.g. row {wrong[0]}: expected {int(logits[wrong[0]].argmax())}, got {int(sampled[wrong[0]])})"
        )
    # Control: without top_k=1 sampling at a high temperature does not reproduce argmax.
    hot = sample_next_token(logits, temperature=5.0, generator=g)
    assert not torch.equal(hot, logits.argmax(dim=-1)), (
        "sample_next_token(temperature=5.0) without top_k gave the argmax in all 64 rows: it does not sample"
    )


def test_apply_temperature_divides():
    logits = torch.tensor([[2.0, -1.0, 0.5]])
    assert torch.allclose(apply_temperature(logits, 0.5), torch.tensor([[4.0, -2.0, 1.0]]))


def test_temperature_zero_is_argmax():
    torch.manual_seed(3)
    logits = torch.randn(8, 30)
    assert torch.equal(sample_next_token(logits, temperature=0.0, top_k=3, top_p=0.5), logits.argmax(-1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-4), "max_new_tokens"),
    ],
)
def test_bad_sampling_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_sampling_args(**kwargs)


def test_good_sampling_arguments_pass():
    check_sampling_args(temperature=0.0, top_k=1, top_p=1.0, max_new_tokens=1)
    check_sampling_args(temperature=2.0, top_k=None, top_p=1e-6, max_new_tokens=10)

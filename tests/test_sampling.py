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
CHI2_CRITICAL_999 = {3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 0.8, 0.2, -0.2])  # V = 8, df = 7
N_DRAWS = 20_000


def wilson_hilferty(df: int, z: float) -> float:
    """Approximate chi-square quantile: df * (1 - 2/(9 df) + z sqrt(2/(9 df)))^3."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def test_critical_values_agree_with_wilson_hilferty():
    # z = 3.0902 is the 99.9% point of the standard normal; the approximation is within a few percent.
    for df, value in CHI2_CRITICAL_999.items():
        assert wilson_hilferty(df, 3.0902) == pytest.approx(value, rel=0.03)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """sum (observed - expected)^2 / expected over categories with expected > 0."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    return float((((counts.double() - expected) ** 2)[keep] / expected[keep]).sum())


def draw(logits: torch.Tensor, n: int, seed: int, **kwargs) -> torch.Tensor:
    """Counts per token of n independent draws (one batch row per draw)."""
    g = torch.Generator().manual_seed(seed)
    tokens = sample_next_token(logits.expand(n, -1), generator=g, **kwargs)
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    return torch.bincount(tokens, minlength=logits.shape[-1])


@pytest.mark.graded(problem="sampling", points=3)
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    counts = draw(LOGITS, N_DRAWS, seed=1234, temperature=temperature)
    critical = CHI2_CRITICAL_999[LOGITS.numel() - 1]
    stat = chi_square(counts, torch.softmax(LOGITS.double() / temperature, dim=-1))
    assert stat < critical, f"frequencies do not fit softmax(logits / {temperature}): chi2 = {stat:.1f}"
    # Negative control: the same counts must fail against a temperature 25% off, in either direction.
    for wrong in (temperature * 1.25, temperature / 1.25):
        wrong_stat = chi_square(counts, torch.softmax(LOGITS.double() / wrong, dim=-1))
        assert wrong_stat > critical, f"chi-square cannot tell T={temperature} from T={wrong}"


@pytest.mark.graded(problem="sampling", points=2)
def test_top_k_top_p_frequencies_match_the_truncated_softmax():
    temperature, k, p = 0.8, 6, 0.8
    probs = torch.softmax(LOGITS.double() / temperature, dim=-1).tolist()
    # The expected distribution, built by hand: the k most likely tokens, then the smallest prefix of
    # them (by probability, renormalized over the k) whose mass reaches p, then renormalize.
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
    expected /= expected.sum()
    assert 1 < len(kept) < k  # both filters matter for this choice of parameters

    counts = draw(LOGITS, N_DRAWS, seed=99, temperature=temperature, top_k=k, top_p=p)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    assert chi_square(counts, expected) < CHI2_CRITICAL_999[len(kept) - 1]


@pytest.mark.graded(problem="sampling", points=2)
def test_top_k_filter_keeps_exactly_the_k_largest():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    for k in (1, 5, 49, 50, 80):
        out = top_k_filter(logits, k)
        for row, out_row in zip(logits.tolist(), out, strict=True):
            largest = set(sorted(range(50), key=lambda i: -row[i])[: min(k, 50)])
            kept = set(torch.nonzero(torch.isfinite(out_row)).flatten().tolist())
            assert kept == largest
            for i in kept:
                assert out_row[i] == row[i]
            assert torch.all(out_row[[i for i in range(50) if i not in kept]] == float("-inf"))


@pytest.mark.graded(problem="sampling", points=3)
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
    assert set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist()) == kept
    # Row two is row one with tokens relabelled 0->2, 1->3, 2->1, 3->0: each row is filtered on its own.
    relabel = {0: 2, 1: 3, 2: 1, 3: 0}
    assert set(torch.nonzero(torch.isfinite(out[1])).flatten().tolist()) == {relabel[i] for i in kept}
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])


@pytest.mark.graded(problem="sampling", points=1)
def test_top_k_one_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(64, 100) * 3
    g = torch.Generator().manual_seed(0)
    for temperature in (0.7, 1.0, 5.0):
        sampled = sample_next_token(logits, temperature=temperature, top_k=1, generator=g)
        assert torch.equal(sampled, logits.argmax(dim=-1))
    # Control: without top_k=1 sampling at a high temperature does not reproduce argmax.
    assert not torch.equal(sample_next_token(logits, temperature=5.0, generator=g), logits.argmax(dim=-1))


@pytest.mark.graded(problem="sampling", points=1)
def test_same_seed_same_tokens():
    torch.manual_seed(2)
    logits = torch.randn(256, 50)
    kwargs = dict(temperature=1.0, top_k=40, top_p=0.95)
    a = sample_next_token(logits, generator=torch.Generator().manual_seed(7), **kwargs)
    b = sample_next_token(logits, generator=torch.Generator().manual_seed(7), **kwargs)
    c = sample_next_token(logits, generator=torch.Generator().manual_seed(8), **kwargs)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # a different seed gives different draws


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

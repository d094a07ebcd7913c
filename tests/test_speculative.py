"""Speculative decoding: the accept/resample step, the verify loop with cache rollback, prompt lookup.

Exactness is shown by frequencies, never assumed: chi-square tests of the step's output distribution
on hand-made p (draft) and q (target), and of the joint distribution of the first two tokens of
speculative_generate end to end; each has a negative control (a known-wrong sampler) that the same
test must reject. Greedy speculative output must equal `generate` on the target token for token,
and after a run the target's cache must hold exactly the accepted tokens (a fresh prefill of them).
"""

import math

import pytest
import torch

from cs336_inference import speculative as spec
from cs336_inference.config import FULL, SLIDING, ModelConfig
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import SamplingParams, generate
from cs336_inference.speculative import (
    NGramDraft,
    accept_resample,
    check_rollback,
    prompt_lookup,
    speculative_generate,
    verify_drafts,
)

N_DRAWS = 100_000
P_MIN = 1e-4  # seeded tests: a correct sampler passes, a wrong one is rejected far below this


# ------------------------------------------------------------------ statistics helpers
def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, p-value) of observed counts against probabilities; an outcome of probability 0 that
    occurs gives p-value 0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = counts.sum() * probs / probs.sum()
    support = expected > 1e-9
    if bool((counts[~support] > 0).any()):
        return math.inf, 0.0
    stat = float((((counts - expected) ** 2)[support] / expected[support]).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return stat, 1.0
    return stat, float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))
    )


def test_chi_square_pvalue_matches_tables():
    # upper 0.1% points of chi-square (NIST/SEMATECH e-Handbook 1.3.6.7.4): P(chi2_df > value) = 0.001
    for df, value in {1: 10.828, 3: 16.266, 7: 24.322}.items():
        p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(value / 2)))
        assert p == pytest.approx(0.001, rel=1e-3)


def dist(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# hand-made (p = draft, q = target) pairs over tiny vocabularies
STEP_CASES = {
    "lecture_AB": (dist([0.5, 0.5]), dist([0.3, 0.7])),  # the lecture's example: A accepted 60%
    "q_zero_where_p_positive": (dist([0.4, 0.3, 0.2, 0.1]), dist([0.0, 0.5, 0.2, 0.3])),
    "p_zero_where_q_positive": (dist([0.5, 0.5, 0.0, 0.0]), dist([0.1, 0.2, 0.3, 0.4])),
    "random_V6": (
        torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(1)) * 1.5, -1),
        torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(2)) * 1.5, -1),
    ),
}


def run_step(step, p: torch.Tensor, q: torch.Tensor, n: int = N_DRAWS, seed: int = 0):
    """n independent one-draft rounds (k = 1): draws x ~ p, returns (n_accepted, next token, x)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.multinomial(p.expand(n, -1), 1, replacement=True, generator=g)  # [n, 1]
    bonus = torch.roll(q, 1)  # any distribution for the bonus row; first-token output must follow q
    P = p.expand(n, 1, -1)
    Q = torch.stack([q, bonus]).expand(n, 2, -1)
    n_acc, token = step(P, Q, x, generator=g)
    return n_acc, token, x[:, 0]


def first_token(n_acc, token, x):
    """The first token a k = 1 round emits: the draft if accepted, else the resampled token."""
    return torch.where(n_acc == 1, x, token)


# ------------------------------------------------------------------ graded: speculative_step
@pytest.mark.graded(problem="speculative_step", points=4)
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_step_output_follows_target(case):
    p, q = STEP_CASES[case]
    n_acc, token, x = run_step(accept_resample, p, q)
    out = first_token(n_acc, token, x)
    counts = torch.bincount(out, minlength=len(q))
    stat, pvalue = chi_square_pvalue(counts, q)
    assert pvalue > P_MIN, (
        f"{case}: the first emitted token does not follow the target q = {q.tolist()}: frequencies "
        f"{(counts / N_DRAWS).tolist()} (chi-square {stat:.1f}, p-value {pvalue:.1e}, {N_DRAWS} draws)"
    )
    alpha = float(torch.minimum(p, q).sum())  # expected acceptance: sum_x min(p(x), q(x))
    rate = float(n_acc.float().mean())
    assert abs(rate - alpha) < 5 * math.sqrt(alpha * (1 - alpha) / N_DRAWS) + 1e-9, (
        f"{case}: acceptance rate {rate:.4f}, expected sum_x min(p, q) = {alpha:.4f}"
    )


@pytest.mark.graded(problem="speculative_step", points=2)
def test_step_greedy_one_hot():
    """Temperature 0: p and q one-hot; a draft is accepted iff it is the target's argmax."""
    V = 5
    onehot = torch.eye(V)
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 4, 3], [0, 2, 3]])
    target_argmax = torch.tensor([[1, 2, 3, 4], [1, 0, 3, 4], [1, 2, 3, 0], [1, 2, 3, 4]])
    expected_n = torch.tensor([3, 1, 1, 0])
    expected_token = torch.tensor([4, 0, 2, 1])
    n_acc, token = accept_resample(
        onehot[draft], onehot[target_argmax], draft, torch.Generator().manual_seed(0)
    )
    for b in range(len(draft)):
        assert (int(n_acc[b]), int(token[b])) == (int(expected_n[b]), int(expected_token[b])), (
            f"greedy row {b}: drafts {draft[b].tolist()}, target argmax {target_argmax[b].tolist()}: expected "
            f"{int(expected_n[b])} accepted then token {int(expected_token[b])}, got {int(n_acc[b])} then {int(token[b])}"
        )


@pytest.mark.graded(problem="speculative_step", points=2)
def test_step_bonus_and_first_rejection():
    """k = 3. Row kinds: p = q everywhere (all accepted, bonus from q[3]); and a certain rejection at
    draft 1 followed by a certain accept at draft 2 (only the leading run counts: n = 1, residual of row 1)."""
    n, V = 20_000, 4
    g = torch.Generator().manual_seed(3)
    q_rows = torch.stack([dist([1, 2, 3, 4]), dist([4, 3, 2, 1]), dist([1, 1, 1, 1]), dist([5, 1, 1, 3])])
    x = torch.multinomial(q_rows[:3], n, replacement=True, generator=g).T  # [n, 3] drafts ~ p = q
    n_acc, token = accept_resample(q_rows[:3].expand(n, 3, V), q_rows.expand(n, 4, V), x, g)
    assert bool((n_acc == 3).all()), (
        f"p = q: every draft must be accepted, got n_accepted {n_acc[:8].tolist()}..."
    )
    counts = torch.bincount(token, minlength=V)
    stat, pvalue = chi_square_pvalue(counts, q_rows[3])
    assert pvalue > P_MIN, (
        f"all 3 drafts accepted: the bonus token must follow q[3] = {q_rows[3].tolist()}, "
        f"got frequencies {(counts / n).tolist()} (p-value {pvalue:.1e})"
    )
    # draft 1 (index 1) has q(x) = 0 -> always rejected; draft 2 has q(x) = 1 > p(x) -> "accepted"
    p = torch.stack([dist([1, 0, 0, 0]), dist([0, 1, 0, 0]), dist([0, 0, 1, 1])])
    q = torch.stack([dist([1, 0, 0, 0]), dist([0, 0, 1, 3]), dist([0, 0, 1, 0]), dist([1, 1, 1, 1])])
    x = torch.tensor([0, 1, 2]).expand(n, 3)
    n_acc, token = accept_resample(p.expand(n, 3, V), q.expand(n, 4, V), x, g)
    assert bool((n_acc == 1).all()), (
        f"draft 0 certain accept, draft 1 certain reject, draft 2 certain accept: n_accepted must be 1 "
        f"(the run stops at the first rejection), got {sorted(set(n_acc.tolist()))}"
    )
    counts = torch.bincount(token, minlength=V)
    stat, pvalue = chi_square_pvalue(counts, dist([0, 0, 1, 3]))
    assert pvalue > P_MIN, (
        f"rejected draft 1: the token must follow max(q1 - p1, 0) normalised = [0, 0, .25, .75], "
        f"got frequencies {(counts / n).tolist()} (p-value {pvalue:.1e})"
    )


@pytest.mark.graded(problem="speculative_step", points=1)
def test_step_draws_in_the_documented_order():
    """The docstring's random stream: torch.rand(B, k) first, then one multinomial draw per row. Replayed
    here from the same seed with the rule written out, so a seeded speculative run is reproducible."""
    B, k, V = 64, 3, 6
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(B, k, V, generator=g), -1)
    q = torch.softmax(torch.randn(B, k + 1, V, generator=g), -1)
    x = torch.multinomial(p.reshape(-1, V), 1, generator=g).reshape(B, k)
    n_acc, token = accept_resample(p, q, x, torch.Generator().manual_seed(5))
    replay = torch.Generator().manual_seed(5)
    u = torch.rand(B, k, generator=replay)
    want_n, rows = [], []
    for b in range(B):
        n = 0
        while n < k and float(u[b, n]) < float(q[b, n, x[b, n]] / p[b, n, x[b, n]]):
            n += 1
        want_n.append(n)
        rows.append(q[b, k] if n == k else (q[b, n] - p[b, n]).clamp(min=0))
    want_token = torch.multinomial(torch.stack(rows), 1, generator=replay)[:, 0]
    assert n_acc.tolist() == want_n, (
        f"n_accepted {n_acc[:12].tolist()}..., expected {want_n[:12]}... from u = torch.rand(B, k) drawn "
        f"first from the generator (draft i of row b accepted while u[b, i] < q(x) / p(x))"
    )
    assert token.tolist() == want_token.tolist(), (
        f"next tokens {token[:12].tolist()}..., expected {want_token[:12].tolist()}...: after the uniforms, "
        f"one torch.multinomial(dist, 1) over the B rows (residual, or q[b, k] when all k were accepted)"
    )


# ------------------------------------------------------------------ negative controls for the step
def resample_from_q(p, q, draft_tokens, generator=None):
    """Wrong: on rejection, draws from q instead of the residual max(q - p, 0)."""
    B, k, V = p.shape
    x = draft_tokens[..., None]
    ratio = q[:, :k].gather(-1, x)[..., 0] / p.gather(-1, x)[..., 0]
    accepted = torch.rand(B, k, generator=generator) < ratio.clamp(max=1)
    n = accepted.long().cumprod(-1).sum(-1)
    return n, torch.multinomial(q[torch.arange(B), n], 1, generator=generator)[:, 0]


def accept_with_q(p, q, draft_tokens, generator=None):
    """Wrong: accepts with probability q(x) (no division by p(x)), residual as it should be."""
    B, k, V = p.shape
    x = draft_tokens[..., None]
    accepted = torch.rand(B, k, generator=generator) < q[:, :k].gather(-1, x)[..., 0]
    n = accepted.long().cumprod(-1).sum(-1)
    rows = torch.cat([(q[:, :k] - p).clamp(min=0), q[:, k:]], 1)[torch.arange(B), n]
    return n, torch.multinomial(rows, 1, generator=generator)[:, 0]


@pytest.mark.parametrize("wrong", [resample_from_q, accept_with_q])
@pytest.mark.parametrize("case", ["lecture_AB", "q_zero_where_p_positive", "random_V6"])
def test_step_negative_controls_fail(wrong, case):
    p, q = STEP_CASES[case]
    out = first_token(*run_step(wrong, p, q))
    _, pvalue = chi_square_pvalue(torch.bincount(out, minlength=len(q)), q)
    assert pvalue < P_MIN, (
        f"{wrong.__name__} on {case}: the chi-square test should reject it (p {pvalue:.2e})"
    )


def test_min_is_immaterial_when_comparing_a_uniform():
    """Accepting when u < q/p with u ~ U[0, 1) is the same event as u < min(1, q/p): the min of the
    lecture's formula changes nothing there (it matters only where the ratio is used as a probability)."""
    u = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    ratio = torch.rand(10_000, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(u < ratio, u < ratio.clamp(max=1))


# ------------------------------------------------------------------ tiny models
BASE = dict(vocab_size=64, d_model=32, n_layers=2, d_ff=64, max_seq_len=96, n_heads=4)
VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),  # sequences much longer than W
    "hybrid": dict(n_kv_heads=2, sliding_window=5, n_layers=3, layer_types=[SLIDING, FULL, SLIDING]),
    "cla": dict(n_kv_heads=2, n_layers=4, kv_share=2),
    "mla": dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}


def tiny_model(variant: str, seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**BASE, **VARIANTS[variant], **overrides}))
    with torch.no_grad():  # larger logits than the default init, so greedy choices are far from ties
        model.norm.weight.mul_(4.0)
    return model.eval()


def perturbed(model: TransformerLM, scale: float, seed: int = 1) -> TransformerLM:
    """A draft close to the target (a copy with noise added to every weight): it agrees often, not always."""
    draft = TransformerLM(model.config)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn(w.shape, generator=g) * scale * w.std().clamp(min=1e-3))
    return draft.eval()


def prompt(length: int, seed: int, V: int = BASE["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, V, (length,), generator=torch.Generator().manual_seed(seed))


def repetitive_prompt(length: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a short motif, so prompt lookup finds matches."""
    motif = prompt(7, seed)
    return motif.repeat(length // 7 + 1)[:length]


def check_tokens(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    wrong = (got[: len(expected)] != expected[: len(got)]).nonzero()
    if len(wrong):
        t = int(wrong[0])
        raise AssertionError(
            f"{what}: first differing new token at position {t}: expected {int(expected[t])}, got {int(got[t])}"
        )
    assert len(got) == len(expected), f"{what}: {len(got)} new tokens, expected {len(expected)}"


@torch.no_grad()
def check_cache_holds(what: str, model: TransformerLM, cache, tokens: torch.Tensor, spare: int) -> None:
    """The cache holds exactly `tokens` (its pos = len(tokens); K/V equal a fresh prefill of them)."""
    assert cache.pos == len(tokens), f"{what}: cache holds {cache.pos} steps, expected {len(tokens)}"
    fresh = model.new_cache(1, cache.capacity, spare=spare)
    model(tokens[None], cache=fresh)
    S = len(tokens)
    for i, (got, ref) in enumerate(zip(cache.layers, fresh.layers, strict=True)):
        if got is None:
            continue
        if isinstance(got, spec.RingKVCache):
            assert int(got.steps.max()) < S, (
                f"{what}: layer {i}'s ring still holds step {int(got.steps.max())}"
            )
            for s in range(max(0, S - got.window + 1), S):  # the steps the next query attends
                a, b = (got.steps == s).nonzero(), (ref.steps == s).nonzero()
                assert len(a) == 1, f"{what}: layer {i}'s ring lost step {s} (of {S})"
                for name in ("k", "v"):
                    x, y = getattr(got, name)[:, :, int(a[0])], getattr(ref, name)[:, :, int(b[0])]
                    assert torch.allclose(x, y, atol=1e-5), f"{what}: layer {i} {name} of step {s} differs"
        else:
            for name in ("k", "v") if hasattr(got, "k") else ("c_kv", "k_pe"):
                x, y = getattr(got, name), getattr(ref, name)
                x, y = (x[:, :, :S], y[:, :, :S]) if name in ("k", "v") else (x[:, :S], y[:, :S])
                diff = float((x - y).abs().max())
                assert diff < 1e-5, (
                    f"{what}: layer {i} cached {name} differs from a fresh prefill by {diff:.1e}"
                )


def run_greedy(variant: str, k: int, draft_kind: str, n_new: int = 30):
    target = tiny_model(variant)
    draft = {
        "model": lambda: perturbed(target, 0.3),
        "shared": lambda: spec.ModelDraft(perturbed(target, 0.3), share_cache=True),  # the target's cache
        "ngram": NGramDraft,
    }[draft_kind]()
    ids = repetitive_prompt(18, 5) if draft_kind == "ngram" else prompt(18, 5)
    expected = generate(target, ids, n_new, stop_token_ids=[])
    got, stats = speculative_generate(target, draft, ids, n_new, k=k, stop_token_ids=[], return_stats=True)
    what = f"{variant}, k={k}, {draft_kind} draft"
    check_tokens(what, got, expected)
    full = torch.cat([ids, got])
    check_cache_holds(f"{what}, target cache", target, stats.caches["target"], full[:-1], spare=k)
    return stats


# ------------------------------------------------------------------ graded: speculative_verify
@pytest.mark.graded(problem="speculative_verify", points=4)
@pytest.mark.parametrize(
    "variant,k,draft_kind",
    [("gqa", 3, "model"), ("sliding", 4, "model"), ("mla", 2, "model"), ("mha", 4, "ngram")],
)
def test_greedy_equals_generate_and_cache_rolled_back(variant, k, draft_kind):
    stats = run_greedy(variant, k, draft_kind, n_new=20)
    assert stats.accepted > 0 and stats.rejected > 0, (
        f"test setup: accepted {stats.accepted}, rejected {stats.rejected}"
    )


@pytest.mark.graded(problem="speculative_verify", points=2)
@pytest.mark.parametrize("setting", [dict(top_k=1), dict(top_p=1e-6)])
def test_filters_apply_to_target(setting):
    """At temperature 1 with top-k = 1 (or a tiny top-p) the target's sampling distribution is one-hot
    at its argmax, so the output must be greedy decoding whatever the draft proposes and the seed."""
    target = tiny_model("gqa")
    draft = perturbed(target, 0.5)
    ids = prompt(12, 7)
    expected = generate(target, ids, 16, stop_token_ids=[])
    for seed in range(2):
        got = speculative_generate(
            target, draft, ids, 16, k=3, temperature=1.0, seed=seed, stop_token_ids=[], **setting
        )
        check_tokens(f"temperature 1, {setting}, seed {seed}", got, expected)


@pytest.mark.graded(problem="speculative_verify", points=1)
def test_verify_drafts_one_round():
    """One round by hand: drafting the target's own greedy tokens accepts all k and adds the bonus;
    a wrong draft at index 2 keeps drafts 0-1 and the target's own token, and rolls the cache back."""
    target = tiny_model("mha")
    ids = prompt(10, 3)
    greedy = generate(target, ids, 6, stop_token_ids=[])
    V = target.config.vocab_size
    for wrong_at in (None, 2):
        drafts = greedy[:4].clone()
        if wrong_at is not None:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % V
        cache = target.new_cache(1, 32)
        with torch.no_grad():
            target(ids[None, :-1], cache=cache)
        p = torch.nn.functional.one_hot(drafts, V).float()
        passes = []  # the cost: one target forward over last_token + the k drafts, not one per token
        hook = target.register_forward_pre_hook(
            lambda m, args, passes=passes: passes.append(list(args[0].shape))
        )
        try:
            out = verify_drafts(
                target, cache, ids[-1:], drafts, p, 0.0, None, None, torch.Generator().manual_seed(0)
            )
        finally:
            hook.remove()
        n = 5 if wrong_at is None else wrong_at + 1
        what = f"verify_drafts with drafts {drafts.tolist()} (target greedy {greedy[:5].tolist()})"
        assert passes == [[1, len(drafts) + 1]], (
            f"{what}: the target ran on {passes}; a verify pass is one forward over the k + 1 = "
            f"{len(drafts) + 1} tokens [last_token, drafts] ([[1, {len(drafts) + 1}]])"
        )
        check_tokens(what, out, greedy[:n])
        assert cache.pos == len(ids) + n - 1, (
            f"{what}: after the round the cache must hold prompt + {n - 1} accepted tokens = "
            f"{len(ids) + n - 1} steps, holds {cache.pos}"
        )


@pytest.mark.graded(problem="speculative_verify", points=1)
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.7, 5)])
def test_a_sampled_verify_is_one_forward_too(temperature, top_k):
    """Sampling changes the accept step, not the cost: the target runs once over [last_token, drafts]
    whatever the settings, and the cache keeps the context and the n - 1 accepted drafts."""
    target = tiny_model("gqa")
    ids = prompt(10, 5)
    V = target.config.vocab_size
    drafts = torch.tensor([3, 9, 27, 4])
    p = torch.softmax(torch.randn(len(drafts), V, generator=torch.Generator().manual_seed(1)), dim=-1)
    for seed in range(3):
        cache = target.new_cache(1, 32)
        with torch.no_grad():
            target(ids[None, :-1], cache=cache)
        passes = []
        hook = target.register_forward_pre_hook(
            lambda m, args, passes=passes: passes.append(list(args[0].shape))
        )
        try:
            gen = torch.Generator().manual_seed(seed)
            out = verify_drafts(target, cache, ids[-1:], drafts, p, temperature, top_k, None, gen)
        finally:
            hook.remove()
        what = f"verify_drafts at temperature {temperature}, top_k {top_k}, seed {seed}"
        assert passes == [[1, len(drafts) + 1]], (
            f"{what}: the target ran on {passes}; at any temperature a verify pass is one forward over "
            f"the k + 1 = {len(drafts) + 1} tokens [last_token, drafts] ([[1, {len(drafts) + 1}]])"
        )
        assert 1 <= len(out) <= len(drafts) + 1 and cache.pos == len(ids) + len(out) - 1, (
            f"{what}: emitted {len(out)} tokens, the cache holds {cache.pos} steps; expected "
            f"{len(ids) + len(out) - 1} (the context and the {len(out) - 1} accepted drafts)"
        )


# ------------------------------------------------------------------ graded: prompt_lookup
LOOKUP_CASES = [
    # (context, k, n_max, expected, why)
    ([5, 6, 7, 8, 9, 5, 6], 3, 3, [7, 8, 9], "bigram [5, 6] seen at 0: copy what followed"),
    ([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 2, 2, [4, 8], "the latest earlier occurrence wins"),
    ([1, 2, 3, 4, 2, 3, 7, 3], 2, 3, [7, 3], "no trigram or bigram match: the unigram [3]'s latest"),
    (
        [4, 1, 2, 3, 9, 9, 2, 3, 5, 1, 2, 3],
        2,
        3,
        [9, 9],
        "the longest n with a match wins over a later bigram",
    ),
    ([1, 2, 3, 4], 3, 3, [], "no earlier occurrence of any tail: nothing"),
    ([7, 7, 7, 7], 3, 2, [7], "never the tail itself; continuation cut at the end of the context"),
    ([3, 1, 2, 3, 1], 5, 1, [2, 3, 1], "k larger than what follows"),
    ([3], 4, 3, [], "one token has no earlier occurrence"),
]


@pytest.mark.graded(problem="prompt_lookup", points=4)
@pytest.mark.parametrize("case", range(len(LOOKUP_CASES)))
def test_prompt_lookup(case):
    context, k, n_max, expected, why = LOOKUP_CASES[case]
    got = prompt_lookup(context, k, n_max=n_max)
    assert list(got) == expected, (
        f"prompt_lookup({context}, k={k}, n_max={n_max}): expected {expected} ({why}), got {list(got)}"
    )


# ------------------------------------------------------------------ ungraded: the full matrix
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matrix(variant):
    """Every attention variant, k = 1..6, model (own cache or the target's) and n-gram drafts: identical
    to generate, and the target's cache holds exactly the accepted tokens."""
    for k in range(1, 7):
        for draft_kind in ("model", "shared", "ngram"):
            run_greedy(variant, k, draft_kind, n_new=16)


def test_greedy_identical_draft_accepts_everything():
    target = tiny_model("gqa")
    ids = prompt(10, 1)
    got, stats = speculative_generate(target, target, ids, 22, k=4, stop_token_ids=[], return_stats=True)
    check_tokens("draft = target", got, generate(target, ids, 22, stop_token_ids=[]))
    # the prefill gives the first token, each round 5 (4 drafts and the bonus), the last round 1
    assert stats.rejected == 0 and stats.target_passes == 5 and stats.tokens_per_pass == pytest.approx(21 / 5)
    assert stats.prefill_tokens == 1 and stats.new_tokens == 22, stats
    assert stats.round_drafts == [4, 4, 4, 4, 0], f"drafts per round {stats.round_drafts}"  # never past 22


@pytest.mark.parametrize("variant", ["gqa", "sliding", "mla"])
def test_the_target_as_a_shared_cache_draft_accepts_everything(variant):
    """Drafting on the target's own cache with the target's own weights proposes the target's greedy
    tokens: every draft accepted (a draft reading the wrong steps of the cache would be rejected)."""
    target = tiny_model(variant)
    ids = prompt(10, 1)
    drafter = spec.ModelDraft(target, share_cache=True)
    got, stats = speculative_generate(target, drafter, ids, 22, k=4, stop_token_ids=[], return_stats=True)
    check_tokens(
        f"{variant}: target drafting on its own cache", got, generate(target, ids, 22, stop_token_ids=[])
    )
    assert stats.rejected == 0 and stats.target_passes == 5, (
        f"{variant}: {stats.rejected} rejections in {stats.target_passes} passes, expected 0 in 5"
    )
    assert stats.caches["draft"] is stats.caches["target"]


def test_a_shared_cache_needs_the_targets_cache_shapes():
    target = tiny_model("gqa")
    for other in (tiny_model("mqa"), tiny_model("gqa", n_layers=3), tiny_model("mla")):
        with pytest.raises(ValueError, match="share_cache"):
            speculative_generate(target, spec.ModelDraft(other, share_cache=True), prompt(8, 0), 4, k=2)
    with pytest.raises(ValueError, match="attach"):
        spec.ModelDraft(target, share_cache=True).propose(prompt(4, 0), 2, SamplingParams())


def test_draft_cache_matches_what_it_fed():
    target = tiny_model("sliding")
    draft = perturbed(target, 0.3)
    drafter = spec.ModelDraft(draft)
    speculative_generate(target, drafter, prompt(20, 2), 30, k=3, stop_token_ids=[])
    check_cache_holds("draft cache", draft, drafter.cache, drafter.fed, spare=4)


def test_stop_token_ends_output():
    target = tiny_model("gqa")
    ids = prompt(10, 1)
    full = generate(target, ids, 20, stop_token_ids=[])
    stop = int(full[7])
    expected = generate(target, ids, 20, stop_token_ids=[stop])
    got = speculative_generate(target, perturbed(target, 0.2), ids, 20, k=4, stop_token_ids=[stop])
    check_tokens("stop token", got, expected)


# ------------------------------------------------------------------ ungraded: end-to-end distribution
E2E = dict(vocab_size=4, d_model=16, n_layers=1, d_ff=32, max_seq_len=24, n_heads=2, n_kv_heads=2)


def e2e_models():
    torch.manual_seed(0)
    target = TransformerLM(ModelConfig(**E2E)).eval()
    torch.manual_seed(1)
    draft = TransformerLM(ModelConfig(**E2E)).eval()
    with torch.no_grad():
        target.norm.weight.mul_(3.0)
        draft.norm.weight.mul_(-6.0)  # a draft that disagrees a lot
    return target, draft


def filtered_probs(logits: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    """Independent statement of temperature-1 sampling with top-k then top-p (sorted, by hand)."""
    probs = logits.double().softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k is not None else order
    if top_p is not None:
        renorm = probs[keep] / probs[keep].sum()
        mass, kept = 0.0, []
        for i, idx in enumerate(keep):
            if mass >= top_p:
                break
            kept.append(idx)
            mass += float(renorm[i])
        keep = kept
    out = torch.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@torch.no_grad()
def target_joint(target, ids, top_k=None, top_p=None) -> torch.Tensor:
    V = target.config.vocab_size
    q1 = filtered_probs(target(ids[None])[0, -1], top_k, top_p)
    joint = torch.zeros(V, V, dtype=torch.float64)
    for a in range(V):
        seq = torch.cat([ids, torch.tensor([a])])
        joint[a] = q1[a] * filtered_probs(target(seq[None])[0, -1], top_k, top_p)
    return joint


@torch.no_grad()
def target_round_joint(target, ids, top_k=None, top_p=None) -> torch.Tensor:
    """The target's joint distribution of the second and third new tokens (the first round's first two
    places: the prompt's prefill gives the first token), summed over that first token."""
    q1 = filtered_probs(target(ids[None])[0, -1], top_k, top_p)
    return sum(
        q1[a] * target_joint(target, torch.cat([ids, torch.tensor([a])]), top_k, top_p)
        for a in range(len(q1))
    )


def e2e_counts(target, draft, ids, n_runs, share_cache=False, lookup=False, **settings) -> torch.Tensor:
    """Counts of the second and third new tokens (the first round's first two places) over n_runs seeds."""
    V = target.config.vocab_size
    counts = torch.zeros(V, V)
    drafter = spec.ModelDraft(draft, share_cache=share_cache, lookup=lookup)
    for seed in range(n_runs):
        out = speculative_generate(
            target, drafter, ids, 3, k=2, temperature=1.0, seed=seed, stop_token_ids=[], **settings
        )
        counts[int(out[1]), int(out[2])] += 1
    return counts


@pytest.mark.parametrize(
    "settings,n",
    [
        ({}, 400),
        (dict(share_cache=True), 400),  # the draft drafts on the target's cache
        pytest.param({}, 3000, marks=pytest.mark.slow),
        pytest.param(dict(top_k=3), 3000, marks=pytest.mark.slow),
        pytest.param(dict(top_p=0.8), 3000, marks=pytest.mark.slow),
    ],
)
def test_first_two_tokens_follow_target(settings, n):
    """Temperature 1 (and top-k / top-p, slow): the first round's first two places with k = 2 (the
    second and third new tokens; paths: both accepted, first accepted then residual, first rejected
    then the next round's token) have the target's joint distribution over the V^2 = 16 outcomes.
    Each run costs about 7 tiny forwards, hence few runs."""
    target, draft = e2e_models()
    ids = torch.tensor([1, 3, 0])
    counts = e2e_counts(target, draft, ids, n, **settings)
    filters = {key: v for key, v in settings.items() if key != "share_cache"}
    expected = target_round_joint(target, ids, **filters)
    stat, pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > P_MIN, (
        f"{settings}: joint frequencies of the first round's two tokens {(counts / n).flatten().tolist()} vs "
        f"the target's {expected.flatten().tolist()} (chi-square {stat:.1f}, p-value {pvalue:.1e})"
    )


def test_first_two_tokens_follow_target_with_lookup_drafts():
    """ModelDraft(lookup=True) on a prompt ending in 1, 3 where 1, 3, t occurred before for every token
    t: whatever the prefill's first token, the first round drafts what followed (one-hot p), later
    rounds the model's samples; the first round's two places keep the target's joint distribution."""
    target, draft = e2e_models()
    ids = torch.tensor([1, 3, 0, 1, 3, 1, 1, 3, 2, 1, 3, 3, 1, 3])
    first = spec.ModelDraft(draft, lookup=True)
    first.reset(24, 2)
    for t in range(4):
        drafts, p = first.propose(torch.cat([ids, torch.tensor([t])]), 2, SamplingParams(temperature=1.0))
        assert p is None, f"test setup: after the first token {t} the first round drafted with the model"
    counts = e2e_counts(target, draft, ids, 400, lookup=True)
    expected = target_round_joint(target, ids)
    stat, pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > P_MIN, (
        f"lookup drafts: joint frequencies of the first round's two tokens {(counts / 400).flatten().tolist()} "
        f"vs the target's {expected.flatten().tolist()} (chi-square {stat:.1f}, p-value {pvalue:.1e})"
    )


def test_a_model_draft_with_lookup_copies_without_running_the_model():
    """lookup=True: where the context's last LOOKUP_MATCH tokens occurred before, propose returns
    prompt_lookup's continuation (p None) and never calls the model; elsewhere the model's drafts.
    Greedy speculative decoding with it still gives generate's tokens."""
    target = tiny_model("gqa")
    draft = perturbed(target, 0.3)
    drafter = spec.ModelDraft(draft, lookup=True)
    calls = []
    drafter.forward = lambda *a, **kw: calls.append(1) or draft(*a, **kw)
    repeated = repetitive_prompt(18, 5)
    drafter.reset(64, 4)
    tokens, p = drafter.propose(repeated, 4, SamplingParams())
    expected = spec.prompt_lookup(repeated.tolist(), 4, spec.LOOKUP_MATCH, spec.LOOKUP_MATCH)
    assert tokens.tolist() == expected and p is None and not calls, (
        f"a repeated tail: drafted {tokens.tolist()} with {len(calls)} model calls, expected {expected} and none"
    )
    fresh = torch.tensor(list(range(10)))  # no token occurs twice: nothing to look up
    tokens, _ = drafter.propose(fresh, 4, SamplingParams())
    assert len(calls) == 4 and len(tokens) == 4, f"no match: {len(calls)} model calls, {len(tokens)} drafts"
    ids = torch.cat([prompt(10, 2), repetitive_prompt(14, 5)])
    expected = generate(target, ids, 30, stop_token_ids=[])
    for share_cache in (False, True):
        got, stats = speculative_generate(
            target, spec.ModelDraft(draft, share_cache=share_cache, lookup=True), ids, 30, k=4,
            stop_token_ids=[], return_stats=True,
        )  # fmt: skip
        check_tokens(f"lookup, share_cache={share_cache}", got, expected)


def test_first_two_tokens_negative_control(monkeypatch):
    monkeypatch.setattr(spec, "accept_resample", resample_from_q)
    target, draft = e2e_models()
    ids = torch.tensor([1, 3, 0])
    counts = e2e_counts(target, draft, ids, 2000)  # a mixture over the first token: more runs than 400
    _, pvalue = chi_square_pvalue(counts, target_round_joint(target, ids))
    assert pvalue < P_MIN, f"resampling from q end to end should be rejected (p-value {pvalue:.2e})"


# ------------------------------------------------------------------ ungraded: acceptance and the formula
class FixedDraft:
    """A draft whose distribution p never depends on the context (tokens drawn iid from p)."""

    def __init__(self, p: torch.Tensor):
        self.p = p

    def reset(self, capacity, k):
        pass

    def propose(self, context, k, params, generator=None):
        tokens = torch.multinomial(self.p, k, replacement=True, generator=generator)
        return tokens, self.p.expand(k, -1)


def constant_target(V: int = 8) -> TransformerLM:
    """A target whose next-token distribution is the same after every context (all embeddings equal,
    attention and MLP outputs zero)."""
    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(vocab_size=V, d_model=16, n_layers=1, d_ff=32, max_seq_len=1100, n_heads=2)
    )
    with torch.no_grad():
        model.embed.weight.copy_(model.embed.weight[0].expand(V, -1))
        model.layers[0].attn.o_proj.weight.zero_()
        model.layers[0].mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(8.0)
    return model.eval()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_acceptance_and_tokens_per_pass_match_formula(k):
    target = constant_target()
    with torch.no_grad():
        q = target(torch.tensor([[0]]))[0, -1].softmax(-1)
    p = (0.6 * q + 0.4 * torch.roll(q, 3)).clone()
    alpha = float(torch.minimum(p, q).sum())
    _, stats = speculative_generate(
        target, FixedDraft(p), [0], 1000, k=k, temperature=1.0, seed=k, stop_token_ids=[], return_stats=True
    )
    examined = stats.accepted + stats.rejected
    assert abs(stats.alpha - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / examined), (
        f"k={k}: measured alpha {stats.alpha:.3f} over {examined} examined drafts, expected "
        f"sum_x min(p, q) = {alpha:.3f}"
    )
    a = stats.alpha  # the formula at the measured alpha (checked against sum min(p, q) above)
    predicted = (1 - a ** (k + 1)) / (1 - a)
    assert stats.tokens_per_pass == pytest.approx(predicted, rel=0.04), (
        f"k={k}: {stats.tokens_per_pass:.3f} tokens per target pass, formula (1 - a^(k+1))/(1 - a) at the "
        f"measured a = {a:.3f}: {predicted:.3f}"
    )


# ------------------------------------------------------------------ ungraded: bad input
def test_bad_inputs():
    target = tiny_model("gqa")
    ids = prompt(8, 0)
    other_vocab = TransformerLM(ModelConfig(**{**BASE, "vocab_size": 65}))
    with pytest.raises(ValueError, match="k .* >= 1"):
        speculative_generate(target, NGramDraft(), ids, 4, k=0)
    with pytest.raises(ValueError, match="vocabulary"):
        speculative_generate(target, other_vocab, ids, 4)
    with pytest.raises(ValueError, match="vocabulary"):  # a model wrapped as a draft is checked too
        speculative_generate(target, spec.ModelDraft(other_vocab), ids, 4)
    with pytest.raises(ValueError, match="context window"):
        speculative_generate(target, NGramDraft(), prompt(94, 0), 1, k=4)
    with pytest.raises(ValueError, match="context window"):
        speculative_generate(target, NGramDraft(), ids, 90)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, NGramDraft(), [[1, 2], [3, 4]], 4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, NGramDraft(), ids, 4, temperature=-1.0)
    ring = tiny_model("sliding").new_cache(1, 64, spare=2)
    with pytest.raises(ValueError, match="spare"):
        check_rollback(ring, 3)
    check_rollback(ring, 2)
    with pytest.raises(ValueError, match="n_min"):
        NGramDraft(n_max=1, n_min=2)


# ------------------------------------------------------------------ the benchmark's library code
def test_benchmark_library_on_tiny_models():
    from cs336_inference.bench import speculative as spec_bench

    target = tiny_model("gqa")
    model = perturbed(target, 0.3)
    drafts = {"ngram": "ngram", "model": model, "shared": spec.ModelDraft(model, share_cache=True),
              "lookup": spec.ModelDraft(model, share_cache=True, lookup=True)}  # fmt: skip
    workloads = {"repeat": [repetitive_prompt(20, 1)], "random": [prompt(12, 2)]}
    result = spec_bench.speculative_benchmark(
        target, drafts, workloads, [1, 3], 12, [], runs=1, log=lambda m: None
    )
    rows = result["rows"]
    assert len(rows) == 2 * 4 * 2 and all(r["identical"] for r in rows)
    ratios = result["costs"]["draft_ratio"]
    assert ratios["shared"] > 0 and ratios["ngram"] == 0
    for r in rows:  # lookup: the model's steps per round, fewer than k where rounds copied
        if r["draft"] == "lookup":
            assert r["draft_cost_per"] == "round" and r["draft_cost"] <= r["k"] * ratios["lookup"] + 1e-9, r
    copied = [r for r in rows if r["draft"] == "lookup" and r["workload"] == "repeat" and r["k"] == 3]
    assert copied[0]["draft_cost"] < 3 * ratios["lookup"], f"a repeated prompt's rounds copy: {copied[0]}"
    line = spec_bench.format_speculative_costs(result["costs"])
    assert line.startswith("one-token target step") and "verify pass of 2 / 4 tokens" in line, line
    twice = spec_bench.speculative_benchmark(
        target, {"shared": drafts["shared"]}, workloads, [3], 12, [], runs=1, log=lambda m: None, repeats=2
    )["rows"]  # greedy: every repeat drafts and accepts the same, so the pooled counts keep their ratios
    once = [r for r in rows if r["draft"] == "shared" and r["k"] == 3]
    for a, b in zip(once, twice, strict=True):
        assert (a["alpha"], a["tokens_per_pass"]) == (b["alpha"], b["tokens_per_pass"]) and b["identical"], (
            a,
            b,
        )
        assert b["accepted"] == 2 * a["accepted"], f"repeats=2 pools both runs' counts: {a} vs {b}"
    for r in rows:
        assert 1.0 <= r["tokens_per_pass"] <= r["k"] + 1 and r["verify_cost"] > 0 and r["speedup"] > 0
    assert spec_bench.expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert spec_bench.expected_tokens_per_pass(1.0, 4) == 5.0
    assert spec_bench.expected_tokens_per_pass_drafted(0.5, [0, 2]) == pytest.approx((1 + 1.75) / 2)
    for r in rows:  # rounds drafting fewer than k tokens can only lower the formula
        assert r["predicted_tokens_per_pass_drafted"] <= r["predicted_tokens_per_pass"] + 1e-9, r
    for r in rows:  # the same prefill out of both times: further from 1x, on the same side
        d, s = r["decode_speedup"], r["speedup"]
        assert d is not None and (d - 1) * (s - 1) >= 0 and abs(d - 1) >= abs(s - 1) - 1e-9, r
    table = spec_bench.format_speculative_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| repeat | ngram | 3 |" in table


# ------------------------------------------------------------------ GPU: the verify pass is nearly free
@pytest.mark.cuda
def test_verify_pass_of_five_tokens_costs_under_1_5_steps_on_gpu():
    """Decode is memory-bound: a cached forward of 5 tokens reads the same weights as one of 1 token,
    so on a GPU it must cost < 1.5x a single decode step (CUDA-event timing, median of 20)."""
    from cs336_inference.bench.speculative import forward_cost

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=8, n_heads=16, n_kv_heads=4, d_ff=5632, max_seq_len=1024
    )
    model = TransformerLM(cfg).to("cuda", torch.bfloat16).eval()
    context = torch.randint(0, cfg.vocab_size, (512,), device="cuda")
    step = forward_cost(model, context, 1, runs=20)
    verify = forward_cost(model, context, 5, runs=20)
    assert verify < 1.5 * step, (
        f"verify pass of 5 tokens {verify * 1e3:.2f} ms vs one step {step * 1e3:.2f} ms"
    )


@pytest.mark.parametrize("slice_size", [256, 4], ids=["nuclei in the slice", "nuclei wider than the slice"])
def test_sampling_probs_with_top_p_is_filter_logits_softmax_bit_for_bit(slice_size, monkeypatch):
    """sampling_probs finds each row's top-p nucleus without sorting the row (nucleus.filter_row);
    the probabilities equal softmax(filter_logits) row by row, bit for bit, for rows of [k+1, V]."""
    from cs336_inference import nucleus, sampling

    monkeypatch.setattr(nucleus, "NUCLEUS_SLICE", slice_size)
    logits = (
        torch.randn(7, 300, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.3, 5, 7)[:, None]
    )
    for t, k, p in [(1.0, None, 0.9), (0.7, None, 0.5), (1.3, 40, 0.95), (1.0, None, 0.999)]:
        got = spec.sampling_probs(logits, t, k, p)
        want = torch.cat([sampling.filter_logits(row[None], t, k, p) for row in logits]).softmax(dim=-1)
        wrong = [b for b in range(7) if not torch.equal(got[b], want[b])]
        assert not wrong, f"T={t}, k={k}, p={p}: rows {wrong} differ from softmax(filter_logits)"
    assert spec.sampling_probs(logits[0], 1.0, None, 0.9).shape == (300,), "a single row keeps its shape"

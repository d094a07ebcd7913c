"""Wrong solutions for Part 5 (speculative decoding) (staff only).

Each entry is a plausible mistake, as a find/replace patch on the reference. Applying one must make
its problem's graded tests lose points and leave every other problem's graded tests green.
"""

FILE = "cs336_inference/speculative.py"

WRONG = [
    # ------------------------------------------------------------------ speculative_step
    dict(
        problem="speculative_step",
        name="resample_from_q",
        mistake="on rejection draws from the target q instead of the residual max(q - p, 0): tokens the "
        "draft over-proposes come out too often",
        file=FILE,
        find="residual = (q[:, :k] - p).clamp(min=0.0)",
        replace="residual = q[:, :k]",
    ),
    dict(
        problem="speculative_step",
        name="ratio_upside_down",
        mistake="accepts with probability min(1, p(x)/q(x)) (draft over target) instead of q(x)/p(x)",
        file=FILE,
        find="accepted = u < torch.clamp(q_x / p_x, max=1.0)",
        replace="accepted = u < torch.clamp(p_x / q_x, max=1.0)",
    ),
    dict(
        problem="speculative_step",
        name="counts_accepts_after_rejection",
        mistake="n_accepted counts every accepted draft, also those after the first rejection, instead of "
        "the leading run",
        file=FILE,
        find="n_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)",
        replace="n_accepted = accepted.long().sum(dim=-1)",
    ),
    dict(
        problem="speculative_step",
        name="bonus_from_last_draft_position",
        mistake="when all k drafts are accepted, draws the bonus token from q at the last draft's place "
        "(q[k - 1]) instead of the distribution after it (q[k])",
        file=FILE,
        find="candidates = torch.cat([residual, q[:, k:]], dim=1)",
        replace="candidates = torch.cat([residual, q[:, k - 1 : k]], dim=1)",
    ),
    dict(
        problem="speculative_step",
        name="residual_without_max",
        mistake="forgets the max(., 0) of the residual and hands q - p, negative entries included, to "
        "the sampler",
        file=FILE,
        find="residual = (q[:, :k] - p).clamp(min=0.0)",
        replace="residual = (q[:, :k] - p).abs()",
    ),
    dict(
        problem="speculative_step",
        name="uniforms_draft_by_draft",
        mistake="the right distribution from another random stream: draws the uniforms draft by draft "
        "(torch.rand(k, B) transposed) instead of the documented torch.rand(B, k), so a seeded run "
        "cannot be reproduced",
        file=FILE,
        find="u = torch.rand(B, k, generator=generator, device=p.device)",
        replace="u = torch.rand(k, B, generator=generator, device=p.device).T",
    ),
    # ------------------------------------------------------------------ speculative_verify
    dict(
        problem="speculative_verify",
        name="one_forward_per_draft",
        mistake="the right tokens at the wrong cost: runs the target once per position (k + 1 one-token "
        "cached forwards) instead of one pass over [last_token, drafts], so a round costs k + 1 decode "
        "steps and speculation can never pay",
        file=FILE,
        find="    logits = target(ids, cache=cache)[0]  # [k + 1, V]: logits[i] predicts the token at draft i's place\n",
        replace="    logits = torch.cat([target(ids[:, i : i + 1], cache=cache)[0] for i in range(k + 1)])\n",
    ),
    dict(
        problem="speculative_verify",
        name="rollback_one_too_many",
        mistake="truncates the cache to pos - (k - n) - 1, forgetting the last accepted token's K/V too",
        file=FILE,
        find="cache.truncate(cache.pos - (k - n))",
        replace="cache.truncate(cache.pos - (k - n) - 1)",
    ),
    dict(
        problem="speculative_verify",
        name="no_rollback",
        mistake="never truncates the cache: the rejected drafts' K/V stay, and the next round's tokens "
        "land at the wrong steps",
        file=FILE,
        find="cache.truncate(cache.pos - (k - n))",
        replace="pass",
    ),
    dict(
        problem="speculative_verify",
        name="q_without_top_k_top_p",
        mistake="builds the target's q with the temperature only (no top-k / top-p), so the output "
        "follows the unfiltered target, not the sampling distribution asked for",
        file=FILE,
        find="q = sampling_probs(logits, temperature, top_k, top_p)",
        replace="q = sampling_probs(logits, temperature)",
    ),
    dict(
        problem="speculative_verify",
        name="drops_bonus_token",
        mistake="when every draft is accepted returns only the drafts, without the target's bonus token",
        file=FILE,
        find="return torch.cat([draft_tokens[:n], token])",
        replace="return torch.cat([draft_tokens[:n], token]) if n < k else draft_tokens",
    ),
    dict(
        problem="speculative_verify",
        name="feeds_only_drafts",
        mistake="feeds the k drafts without the newest context token, which the cache does not hold yet "
        "(q is shifted by one place)",
        file=FILE,
        find="ids = torch.cat([last_token, draft_tokens])[None]  # [1, k + 1]",
        replace="ids = torch.cat([draft_tokens, draft_tokens[-1:]])[None]",
    ),
    # ------------------------------------------------------------------ prompt_lookup
    dict(
        problem="prompt_lookup",
        name="matches_the_tail_itself",
        mistake="lets the search start at the tail itself, whose continuation is empty",
        file=FILE,
        find="for start in range(S - n - 1, -1, -1):  # latest first; never the tail itself",
        replace="for start in range(S - n, -1, -1):",
    ),
    dict(
        problem="prompt_lookup",
        name="earliest_occurrence",
        mistake="takes the earliest occurrence of the n-gram instead of the latest",
        file=FILE,
        find="for start in range(S - n - 1, -1, -1):  # latest first; never the tail itself",
        replace="for start in range(0, S - n):",
    ),
    dict(
        problem="prompt_lookup",
        name="shortest_n_first",
        mistake="tries n = n_min first, so a unigram match wins over a longer one",
        file=FILE,
        find="for n in range(min(n_max, S - 1), n_min - 1, -1):",
        replace="for n in range(n_min, min(n_max, S - 1) + 1):",
    ),
    dict(
        problem="prompt_lookup",
        name="continuation_off_by_one",
        mistake="copies from the last token of the match instead of the token after it",
        file=FILE,
        find="return list(context[start + n : start + n + k])",
        replace="return list(context[start + n - 1 : start + n - 1 + k])",
    ),
]

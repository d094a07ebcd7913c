"""Wrong solutions for Part 5 (speculative decoding) (staff only).

Each entry is a plausible mistake, as a find/replace patch on the reference. Applying one must make
its problem's graded tests lose points and leave every other problem's graded tests green.
"""

FILE = "cs336_inference/speculative.py"
TREE = "cs336_inference/speculative_tree.py"

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
        name="per_token_forwards_when_sampling",
        mistake="one target forward over the k + 1 tokens when greedy, but one forward per token when sampling "
        "(the same numbers, k + 1 reads of the weights)",
        file=FILE,
        find="logits = target(ids, cache=cache)[0]  # [k + 1, V]",
        replace="logits = target(ids, cache=cache)[0] if temperature == 0.0 else torch.cat(\n"
        "        [target(ids[:, i : i + 1], cache=cache)[0] for i in range(k + 1)])  # [k + 1, V]",
    ),
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
    # ------------------------------------------------------------------ tree_verify
    dict(
        problem="tree_verify",
        name="mask_causal",
        mistake="lets every node see every earlier node (the causal mask of a chain), siblings and cousins "
        "included",
        file=TREE,
        find="mask = torch.eye(T, dtype=torch.bool, device=parents.device)",
        replace="mask = torch.ones(T, T, dtype=torch.bool, device=parents.device).tril()",
    ),
    dict(
        problem="tree_verify",
        name="mask_parent_only",
        mistake="marks a node's parent but not the parent's own ancestors",
        file=TREE,
        find="mask[i] |= mask[int(parents[i])]",
        replace="mask[i, int(parents[i])] = True",
    ),
    dict(
        problem="tree_verify",
        name="mask_transposed",
        mistake="returns mask[j, i] (which nodes descend from i) instead of mask[i, j] (i's ancestors)",
        file=TREE,
        find="    return mask\n    # END SOLUTION",
        replace="    return mask.T\n    # END SOLUTION",
    ),
    dict(
        problem="tree_verify",
        name="keep_path_no_move",
        mistake="truncates the cache to the path's length without moving the path's K/V down, so the "
        "cache keeps the first nodes written, whatever was accepted",
        file=TREE,
        find="            t[:, :, start : start + len(path)] = t[:, :, src.to(t.device)]",
        replace="            pass",
    ),
    dict(
        problem="tree_verify",
        name="keep_path_without_start",
        mistake="reads the path's K/V from steps path[m] instead of start + path[m]",
        file=TREE,
        find="src = torch.tensor(list(path), dtype=torch.long) + start",
        replace="src = torch.tensor(list(path), dtype=torch.long)",
    ),
    dict(
        problem="tree_verify",
        name="keep_path_drops_last",
        mistake="truncates to start + len(path) - 1: the last accepted node's K/V are lost",
        file=TREE,
        find="    cache.truncate(start + len(path))\n    # END SOLUTION",
        replace="    cache.truncate(start + len(path) - 1)\n    # END SOLUTION",
    ),
    dict(
        problem="tree_verify",
        name="greedy_compares_child_argmax",
        mistake="accepts the child whose own argmax equals its token, instead of the child equal to the "
        "parent's argmax",
        file=TREE,
        find="nxt = [c for c in kids[node] if int(tree.tokens[c]) == int(best[node])]",
        replace="nxt = [c for c in kids[node] if int(tree.tokens[c]) == int(best[c])]",
    ),
    dict(
        problem="tree_verify",
        name="greedy_first_child_only",
        mistake="looks only at the first child of each node, so a tree accepts what a chain would",
        file=TREE,
        find="nxt = [c for c in kids[node] if int(tree.tokens[c]) == int(best[node])]",
        replace="nxt = [c for c in kids[node][:1] if int(tree.tokens[c]) == int(best[node])]",
    ),
    dict(
        problem="tree_verify",
        name="greedy_bonus_from_root",
        mistake="adds the root's argmax after the path instead of the last accepted node's",
        file=TREE,
        find="return path, best[node : node + 1]",
        replace="return path, best[0:1]",
    ),
    dict(
        problem="tree_verify",
        name="sampled_keeps_rejected_in_p",
        mistake="after a rejection takes the residual but leaves the rejected token in p, although the "
        "next child was drawn without it",
        file=TREE,
        find="            p[x] = 0.0\n",
        replace="",
    ),
    dict(
        problem="tree_verify",
        name="sampled_no_residual",
        mistake="after a rejection keeps q as it was instead of the residual max(q - p, 0)",
        file=TREE,
        find="q = residual / residual.sum() if residual.sum() > 0 else q",
        replace="q = q",
    ),
    dict(
        problem="tree_verify",
        name="sampled_ratio_upside_down",
        mistake="accepts a child with probability min(1, p(x)/q(x)) instead of q(x)/p(x)",
        file=TREE,
        find="if float(u) < min(1.0, float(q[x]) / float(p[x])) if p[x] > 0 else q[x] > 0:",
        replace="if float(u) < min(1.0, float(p[x]) / float(q[x])) if q[x] > 0 else False:",
    ),
]

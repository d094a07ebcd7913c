"""Wrong solutions for Part 2's `sampling` problem (staff only).

Each entry is a plausible mistake, as a find/replace patch on the reference. Applying one must make
the `sampling` graded tests lose points and leave every other problem's graded tests green.
"""

FILE = "cs336_inference/sampling.py"

# The reference filter_logits pipeline, reordered or altered by several entries below.
_PIPELINE = """    logits = apply_temperature(logits.float(), temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
"""

WRONG = [
    dict(
        problem="sampling",
        name="temperature_multiplies",
        mistake="multiplies the logits by T, so T = 0.5 flattens and T = 2 sharpens (T = 1 looks right)",
        file=FILE,
        find="return logits / temperature",
        replace="return logits * temperature",
    ),
    dict(
        problem="sampling",
        name="top_p_before_temperature",
        mistake="filters top-k/top-p on the raw logits and divides by T afterwards; the handout fixes the "
        "order temperature, top-k, top-p, and the nucleus of softmax(logits) is not that of softmax(logits / T)",
        file=FILE,
        find=_PIPELINE,
        replace="""    logits = logits.float()
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    logits = apply_temperature(logits, temperature)
""",
    ),
    dict(
        problem="sampling",
        name="top_p_before_top_k",
        mistake="applies top-p before top-k, so the nucleus mass is measured over the whole vocabulary "
        "instead of over the k survivors",
        file=FILE,
        find=_PIPELINE,
        replace="""    logits = apply_temperature(logits.float(), temperature)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
""",
    ),
    dict(
        problem="sampling",
        name="filters_discarded",
        mistake="calls the filters as if they worked in place and drops their results, so top-k and "
        "top-p change nothing",
        file=FILE,
        edits=[
            ("        logits = top_k_filter(logits, top_k)", "        top_k_filter(logits, top_k)"),
            ("        logits = top_p_filter(logits, top_p)", "        top_p_filter(logits, top_p)"),
        ],
    ),
    dict(
        problem="sampling",
        name="ignores_generator",
        mistake="draws with torch.multinomial without the generator, so a seed does not reproduce the draws",
        file=FILE,
        find="torch.multinomial(probs, num_samples=1, generator=generator)",
        replace="torch.multinomial(probs, num_samples=1)",
    ),
    dict(
        problem="sampling",
        name="argmax_after_filtering",
        mistake="takes the argmax of the filtered distribution instead of drawing from it",
        file=FILE,
        find="return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)",
        replace="return probs.argmax(dim=-1)",
    ),
    dict(
        problem="sampling",
        name="top_k_crashes_when_k_ge_V",
        mistake="calls topk(k) without the k >= V case, which raises 'selected index k out of range'",
        file=FILE,
        find="    if k >= logits.shape[-1]:\n        return logits\n",
        replace="",
    ),
    dict(
        problem="sampling",
        name="top_k_threshold_drops_kth",
        mistake="masks every logit <= the k-th largest, which also drops the k-th itself (keeps k - 1)",
        file=FILE,
        find="    top = logits.topk(k, dim=-1)\n"
        '    return torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)\n',
        replace="    kth = logits.topk(k, dim=-1).values[..., -1:]\n"
        '    return logits.masked_fill(logits <= kth, float("-inf"))\n',
    ),
    dict(
        problem="sampling",
        name="top_k_threshold_keeps_ties",
        mistake="masks the logits below the k-th largest, so every token tied with the k-th survives too "
        "(more than k tokens; the docstring asks for exactly k)",
        file=FILE,
        find="    top = logits.topk(k, dim=-1)\n"
        '    return torch.full_like(logits, float("-inf")).scatter(-1, top.indices, top.values)\n',
        replace="    kth = logits.topk(k, dim=-1).values[..., -1:]\n"
        '    return logits.masked_fill(logits < kth, float("-inf"))\n',
    ),
    dict(
        problem="sampling",
        name="top_p_drops_crossing_token",
        mistake="drops a token once the cumulative mass INCLUDING it reaches p, which removes the token that "
        "makes the mass reach p (and everything when the top token alone exceeds p)",
        file=FILE,
        find="mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs",
        replace="mass_above = sorted_probs.cumsum(dim=-1)",
    ),
    dict(
        problem="sampling",
        name="top_p_keeps_one_past_the_boundary",
        mistake="drops a token only when the mass above it EXCEEDS p, so where the nucleus reaches p exactly "
        "one more token is kept than the smallest set (a boundary the hand-made cases never hit)",
        file=FILE,
        find="drop_sorted = mass_above >= p",
        replace="drop_sorted = mass_above > p",
    ),
    dict(
        problem="sampling",
        name="top_p_unsorted_cumsum",
        mistake="accumulates the probabilities in vocabulary order instead of from the most likely down",
        file=FILE,
        find="sorted_probs, order = probs.sort(dim=-1, descending=True)",
        replace="sorted_probs, order = probs, torch.arange(probs.shape[-1]).expand_as(probs)",
    ),
    dict(
        problem="sampling",
        name="top_p_gather_instead_of_scatter",
        mistake="maps the sorted mask back with gather(order) (the permutation) instead of scattering it "
        "(the inverse permutation), so the wrong tokens are dropped",
        file=FILE,
        find="drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)",
        replace="drop = drop_sorted.gather(-1, order)",
    ),
    dict(
        problem="sampling",
        name="top_p_masks_with_zero",
        mistake="sets the dropped logits to 0 (thinking of probabilities) instead of -inf, so they keep "
        "probability exp(0) / Z",
        file=FILE,
        find='return logits.masked_fill(drop, float("-inf"))',
        replace="return logits.masked_fill(drop, 0.0)",
    ),
]

"""Wrong solutions for Part 2 (KV caches and the generation loops): plausible mistakes (staff only).

Each entry is a small patch of one problem's solution code. Applied alone, it must make that
problem's graded tests lose points (the other problems are graded with the reference code).
"""

KV_CACHE = "cs336_inference/kv_cache.py"
SAMPLING = "cs336_inference/sampling.py"

WRONG = [
    # ------------------------------------------------------------------------------------ kv_cache
    dict(
        problem="kv_cache",
        name="grows_by_concatenation",
        mistake="grows the cache by concatenation, as Hugging Face's DynamicCache does: every step copies the "
        "whole prefix into a new tensor that replaces the cache's own (the numbers are right)",
        file=KV_CACHE,
        edits=[
            (
                "self.k[:, :, start:end] = k",
                "self.k = torch.cat([self.k[:, :, :start], k, self.k[:, :, end:]], dim=2)",
            ),
            (
                "self.v[:, :, start:end] = v",
                "self.v = torch.cat([self.v[:, :, :start], v, self.v[:, :, end:]], dim=2)",
            ),
        ],
    ),
    dict(
        problem="kv_cache",
        name="returns_a_grown_copy",
        mistake="the right numbers at the wrong cost: writes the new steps but returns the prefix "
        "concatenated with them (torch.cat), a new tensor of every cached step made again at each decode step",
        file=KV_CACHE,
        find="        return self.k[:, :, :end], self.v[:, :, :end], self.steps[:end]\n",
        replace="        k_all = torch.cat([self.k[:, :, :start], k], dim=2)\n"
        "        v_all = torch.cat([self.v[:, :, :start], v], dim=2)\n"
        "        return k_all, v_all, self.steps[:end]\n",
    ),
    dict(
        problem="kv_cache",
        name="returns_full_capacity",
        mistake="returns the whole preallocated cache, unwritten zero slots included, instead of steps < end",
        file=KV_CACHE,
        find="return self.k[:, :, :end], self.v[:, :, :end], self.steps[:end]",
        replace="return self.k, self.v, self.steps",
    ),
    dict(
        problem="kv_cache",
        name="returns_only_new_steps",
        mistake="returns only the T new keys and values: every query attends to its own chunk only",
        file=KV_CACHE,
        find="return self.k[:, :, :end], self.v[:, :, :end], self.steps[:end]",
        replace="return self.k[:, :, start:end], self.v[:, :, start:end], self.steps[start:end]",
    ),
    dict(
        problem="kv_cache",
        name="writes_at_slot_zero",
        mistake="writes every chunk at the start of the cache instead of at step `start`",
        file=KV_CACHE,
        edits=[
            ("self.k[:, :, start:end] = k", "self.k[:, :, : end - start] = k"),
            ("self.v[:, :, start:end] = v", "self.v[:, :, : end - start] = v"),
        ],
    ),
    dict(
        problem="kv_cache",
        name="no_overflow_error",
        mistake="does not check the capacity: an overflow is a shape-mismatch RuntimeError deep in torch",
        file=KV_CACHE,
        find=(
            "        if end > self.k.shape[2]:\n"
            '            raise ValueError(f"KV cache overflow: {end} steps > capacity {self.k.shape[2]}")\n'
        ),
        replace="",
    ),
    # ---------------------------------------------------------------------------------- ring_cache
    dict(
        problem="ring_cache",
        name="fits_condition_plus_two",
        mistake="'every needed key fits' off by one (T <= slots - W + 2): a 2-token chunk (W + 1 with spare "
        "slots) overwrites a key its first query still needs",
        file=KV_CACHE,
        find="if T <= self.slots - self.window + 1:",
        replace="if T <= self.slots - self.window + 2:",
    ),
    dict(
        problem="ring_cache",
        name="fits_condition_strict",
        mistake="'every needed key fits' as T < slots - W + 1: a chunk that fits is copied with the whole "
        "ring (right logits, but the ring is concatenated at every such step)",
        file=KV_CACHE,
        find="if T <= self.slots - self.window + 1:",
        replace="if T < self.slots - self.window + 1:",
    ),
    dict(
        problem="ring_cache",
        name="never_concatenates",
        mistake="always writes the new keys into the ring first: a chunk longer than the spare slots "
        "overwrites keys its earliest queries need",
        file=KV_CACHE,
        find="if T <= self.slots - self.window + 1:",
        replace="if True:",
    ),
    dict(
        problem="ring_cache",
        name="forgets_pos",
        mistake="never advances self.pos (logits stay right, but truncate no longer knows what is held)",
        file=KV_CACHE,
        edits=[("            self.pos = start + 1\n", ""), ("        self.pos = start + T\n", "")],
    ),
    dict(
        problem="ring_cache",
        name="decode_forgets_steps",
        mistake="decode writes the key and value but not their step: the new key is masked as what the "
        "slot held before",
        file=KV_CACHE,
        find="            self.steps[slot] = start\n",
        replace="",
    ),
    dict(
        problem="ring_cache",
        name="int8_steps_in_chunks",
        mistake="numbers the steps of a multi-token write in int8 (to keep the bookkeeping small): right "
        "on every prompt shorter than 128 steps, wrong once a chunk lands past step 127 (only the long "
        "schedule, a chunk meeting a ring wrapped dozens of times, reaches it)",
        file=KV_CACHE,
        find="new_steps = torch.arange(start, start + T, device=self.k.device)",
        replace="new_steps = torch.arange(start, start + T, device=self.k.device).to(torch.int8).long()",
    ),
    # ----------------------------------------------------------------------------------- mla_cache
    dict(
        problem="mla_cache",
        name="forgets_k_pe",
        mistake="stores the latents but not the rotary keys",
        file=KV_CACHE,
        find="        self.k_pe[:, start:end] = k_pe\n",
        replace="",
    ),
    dict(
        problem="mla_cache",
        name="returns_full_capacity",
        mistake="returns the whole preallocated latent cache instead of steps < end",
        file=KV_CACHE,
        find="return self.c_kv[:, :end], self.k_pe[:, :end], self.steps[:end]",
        replace="return self.c_kv, self.k_pe, self.steps",
    ),
    dict(
        problem="mla_cache",
        name="writes_at_slot_zero",
        mistake="writes every chunk at the start of the cache instead of at step `start`",
        file=KV_CACHE,
        edits=[
            ("self.c_kv[:, start:end] = c_kv", "self.c_kv[:, : end - start] = c_kv"),
            ("self.k_pe[:, start:end] = k_pe", "self.k_pe[:, : end - start] = k_pe"),
        ],
    ),
    dict(
        problem="mla_cache",
        name="no_overflow_error",
        mistake="does not check the capacity: an overflow is a shape-mismatch RuntimeError deep in torch",
        file=KV_CACHE,
        find=(
            "        if end > self.c_kv.shape[1]:\n"
            '            raise ValueError(f"MLA cache overflow: {end} steps > capacity {self.c_kv.shape[1]}")\n'
        ),
        replace="",
    ),
    # ------------------------------------------------------------------------------ naive_generate
    dict(
        problem="naive_generate",
        name="feeds_last_token_only",
        mistake="feeds only the newest token each step, without a cache: the model forgets the context",
        file=SAMPLING,
        find="logits = model(context[:, : P + t], pad=pad, last_only=True)[:, -1]",
        replace="logits = model(context[:, : P + t] if t == 0 else context[:, P + t - 1 : P + t], pad=pad, "
        "last_only=True)[:, -1]",
    ),
    dict(
        problem="naive_generate",
        name="no_pad",
        mistake="does not pass pad: the padding of shorter prompts in a batch is attended to",
        file=SAMPLING,
        find="logits = model(context[:, : P + t], pad=pad, last_only=True)[:, -1]",
        replace="logits = model(context[:, : P + t], last_only=True)[:, -1]",
    ),
    dict(
        problem="naive_generate",
        name="context_one_short",
        mistake="step t feeds P + t - 1 tokens (off by one): predicts from the token before the last",
        file=SAMPLING,
        find="logits = model(context[:, : P + t], pad=pad, last_only=True)[:, -1]",
        replace="logits = model(context[:, : max(P + t - 1, 1)], pad=pad, last_only=True)[:, -1]",
    ),
    dict(
        problem="naive_generate",
        name="greedy_instead_of_next_token",
        mistake="picks the argmax instead of calling next_token (sampling settings are ignored)",
        file=SAMPLING,
        find="        token = next_token(logits)\n        context[:, P + t] = token",
        replace="        token = logits.argmax(dim=-1)\n        context[:, P + t] = token",
    ),
    # ------------------------------------------------------------------------------------ generate
    dict(
        problem="generate",
        name="reprefills_every_step",
        mistake="runs the whole context through a fresh cache at every step (right tokens, no saving)",
        file=SAMPLING,
        find="            logits = model(token[:, None], cache=cache, last_only=True)[:, -1]  # decode one token",
        replace=(
            "            ids = torch.cat([ids, token[:, None]], dim=1)\n"
            "            cache = model.new_cache(B, P + max_new_tokens, pad=pad)\n"
            "            logits = model(ids, cache=cache, last_only=True)[:, -1]"
        ),
    ),
    dict(
        problem="generate",
        name="cache_without_pad",
        mistake="allocates the cache without pad: batched prompts attend to their padding",
        file=SAMPLING,
        find="cache = model.new_cache(B, P + max_new_tokens, pad=pad)",
        replace="cache = model.new_cache(B, P + max_new_tokens)",
    ),
    dict(
        problem="generate",
        name="greedy_instead_of_next_token",
        mistake="picks the argmax instead of calling next_token (sampling settings are ignored)",
        file=SAMPLING,
        find="        token = next_token(logits)\n        yield token, logits\n",
        replace="        token = logits.argmax(dim=-1)\n        yield token, logits\n",
    ),
    dict(
        problem="generate",
        name="prefill_token_by_token",
        mistake="prefills the prompt one token at a time (right tokens, but P sequential forwards)",
        file=SAMPLING,
        find="    logits = model(ids, cache=cache, last_only=True)[:, -1]  # prefill\n",
        replace="    for i in range(P):\n        logits = model(ids[:, i : i + 1], cache=cache, last_only=True)[:, -1]\n",
    ),
    dict(
        problem="generate",
        name="decodes_one_too_many",
        mistake="runs one more decode forward after the last token (wasted step)",
        file=SAMPLING,
        find="        if t + 1 < max_new_tokens:\n",
        replace="        if True:\n",
    ),
]

"""Wrong solutions for Part 8 (sharding) (staff only).

Each entry is a plausible mistake, as a find/replace patch on the reference. Applying one must make
its problem's graded tests lose points and leave every other problem's graded tests green.
"""

TP = "cs336_inference/parallel/tensor_parallel.py"
ACC = "cs336_inference/accounting.py"

WRONG = [
    # ------------------------------------------------------------------ vocab_parallel
    dict(
        problem="vocab_parallel",
        name="no_mask_for_other_ranks_ids",
        mistake="clamps the local index into range but does not zero the ids another rank owns, so "
        "every rank adds its first or last row for them",
        file=TP,
        find="        x = F.embedding(local.clamp(0, self.owned - 1), self.weight) * mine[..., None]",
        replace="        x = F.embedding(local.clamp(0, self.owned - 1), self.weight)",
    ),
    dict(
        problem="vocab_parallel",
        name="forgets_the_offset",
        mistake="looks up the global id in the local table (no `- first`)",
        file=TP,
        find="        local = ids - self.first\n",
        replace="        local = ids\n",
    ),
    dict(
        problem="vocab_parallel",
        name="mask_includes_one_past_the_end",
        mistake="treats id first + owned as its own (<= instead of <): the next rank's first id is "
        "counted twice, and a short last shard reads a padding row",
        file=TP,
        find="        mine = (local >= 0) & (local < self.owned)",
        replace="        mine = (local >= 0) & (local <= self.owned)",
    ),
    dict(
        problem="vocab_parallel",
        name="no_all_reduce",
        mistake="returns the local lookup without summing over the ranks",
        file=TP,
        find="        dist.all_reduce(x, group=self.group)\n        return x",
        replace="        return x",
    ),
    # ------------------------------------------------------------------ tp_layer
    dict(
        problem="tp_layer",
        name="o_proj_split_by_rows",
        mistake="splits o_proj like q_proj, by output rows (dim 0), instead of by its input columns",
        file=TP,
        find='    if leaf == "o_proj" and kind == "weight":\n        return 1, shard.heads.start * H, shard.heads.stop * H',
        replace='    if leaf == "o_proj" and kind == "weight":\n        return 0, shard.heads.start * H, shard.heads.stop * H',
    ),
    dict(
        problem="tp_layer",
        name="down_proj_split_by_output",
        mistake="splits down_proj by output rows like gate and up (it is row parallel: split its input)",
        file=TP,
        find='    if leaf == "down_proj" and kind == "weight":\n        return 1, shard.neurons.start, shard.neurons.stop',
        replace='    if leaf == "down_proj" and kind == "weight":\n        return 0, shard.neurons.start, shard.neurons.stop',
    ),
    dict(
        problem="tp_layer",
        name="bias_not_split_with_its_rows",
        mistake="splits the q/k/v weights but leaves their biases whole",
        file=TP,
        find='    if leaf == "q_proj":\n',
        replace='    if kind == "bias" and leaf in ("q_proj", "k_proj", "v_proj"):\n        return None\n    if leaf == "q_proj":\n',
    ),
    dict(
        problem="tp_layer",
        name="kv_heads_split_even_when_fewer_than_ranks",
        mistake="always gives rank r the K/V heads r K/tp .. (r+1) K/tp, which is empty when K < tp",
        file=TP,
        find="    if K >= tp:\n        if K % tp:",
        replace="    if True:\n        if K % tp and K >= tp:",
    ),
    dict(
        problem="tp_layer",
        name="replicates_unevenly",
        mistake="with fewer K/V heads than ranks, does not check that K divides tp (3 heads over 4 ranks: rank 3 "
        "reads a head 3 that does not exist)",
        file=TP,
        find="    if tp % K:\n        raise ShardingError",
        replace="    if False:\n        raise ShardingError",
    ),
    dict(
        problem="tp_layer",
        name="replicated_head_by_rank_modulo",
        mistake="replicates K/V heads round-robin (rank % K) instead of giving consecutive ranks the head "
        "their query heads read",
        file=TP,
        find="    head = rank // (tp // K)",
        replace="    head = rank % K",
    ),
    dict(
        problem="tp_layer",
        name="bias_before_all_reduce",
        mistake="adds the bias to each rank's partial product, so the all-reduce adds it tp times",
        file=TP,
        find="        y = F.linear(x, self.weight)\n        dist.all_reduce(y, group=self.group)\n        return y if self.bias is None else y + self.bias",
        replace="        y = F.linear(x, self.weight, self.bias)\n        dist.all_reduce(y, group=self.group)\n        return y",
    ),
    dict(
        problem="tp_layer",
        name="row_parallel_without_all_reduce",
        mistake="returns the partial product of the row-parallel layer without the all-reduce",
        file=TP,
        find="        y = F.linear(x, self.weight)\n        dist.all_reduce(y, group=self.group)\n",
        replace="        y = F.linear(x, self.weight)\n",
    ),
    # ------------------------------------------------------------------ tp_accounting
    dict(
        problem="tp_accounting",
        name="forgets_the_embedding_all_reduce",
        mistake="counts the two all-reduces per layer but not the vocab-parallel embedding's",
        file=ACC,
        find="    return (2 * cfg.n_layers + 1) * B * T * cfg.d_model * dtype_bytes",
        replace="    return 2 * cfg.n_layers * B * T * cfg.d_model * dtype_bytes",
    ),
    dict(
        problem="tp_accounting",
        name="ring_one_pass",
        mistake="counts tp - 1 steps for the all-reduce (only the reduce-scatter, no all-gather)",
        file=ACC,
        find="    return 2 * (tp - 1) * (latency + n_bytes / tp / bandwidth)",
        replace="    return (tp - 1) * (latency + n_bytes / tp / bandwidth)",
    ),
    dict(
        problem="tp_accounting",
        name="ring_sends_everything_each_step",
        mistake="sends all n bytes in every ring step instead of one chunk of n / tp",
        file=ACC,
        find="    return 2 * (tp - 1) * (latency + n_bytes / tp / bandwidth)",
        replace="    return 2 * (tp - 1) * (latency + n_bytes / bandwidth)",
    ),
    dict(
        problem="tp_accounting",
        name="kv_heads_not_replicated",
        mistake="divides the K/V heads by tp even when K < tp (zero heads per rank for MQA)",
        file=ACC,
        find="    return max(cfg.n_kv_heads // tp, 1)",
        replace="    return cfg.n_kv_heads // tp",
    ),
    dict(
        problem="tp_accounting",
        name="untied_output_matrix_forgotten",
        mistake="counts one vocabulary matrix per rank also when the output matrix is not the embedding",
        file=ACC,
        find="    vocab = -(-V // tp) * D * (1 if cfg.tie_embeddings else 2)",
        replace="    vocab = -(-V // tp) * D",
    ),
]

"""Plausible wrong solutions of Part 6 (pruning and distillation), each of which must lose points in its
own problem's graded tests (tests/test_pruning.py, tests/test_distill.py) and in no other problem's.

Verify: python scripts/check_tests.py --problem importance -j 1   (and prune_slice, distill_loss)
"""

PRUNING = "cs336_inference/pruning.py"
DISTILL = "cs336_inference/distill.py"

WRONG = [
    # ------------------------------------------------------------------ importance
    dict(
        problem="importance",
        name="neuron_mean_not_mean_abs",
        mistake="averages the signed activation silu(gate) * up, so large positive and negative values cancel",
        file=PRUNING,
        find="return (F.silu(gate.float()) * up.float()).abs().mean(dim=(0, 1))",
        replace="return (F.silu(gate.float()) * up.float()).mean(dim=(0, 1))",
    ),
    dict(
        problem="importance",
        name="neuron_without_silu",
        mistake="scores |gate * up|, forgetting that the MLP applies silu to the gate before the product",
        file=PRUNING,
        find="return (F.silu(gate.float()) * up.float()).abs().mean(dim=(0, 1))",
        replace="return (gate.float() * up.float()).abs().mean(dim=(0, 1))",
    ),
    dict(
        problem="importance",
        name="head_mean_abs_not_l2",
        mistake="measures a head's output by its mean |x| over the head dimension instead of its L2 norm",
        file=PRUNING,
        find="return head_out.float().norm(dim=-1).mean(dim=(0, 1))",
        replace="return head_out.float().abs().mean(dim=(0, 1, 3))",
    ),
    dict(
        problem="importance",
        name="channel_mean_not_mean_abs",
        mistake="averages the signed normalised activation per channel, so a busy channel can score zero",
        file=PRUNING,
        find="return normed.float().abs().mean(dim=(0, 1))",
        replace="return normed.float().mean(dim=(0, 1))",
    ),
    dict(
        problem="importance",
        name="block_similarity_not_distance",
        mistake="returns the mean cosine itself, so a block that changes nothing looks the most important",
        file=PRUNING,
        find="return float(1.0 - cos.mean())",
        replace="return float(cos.mean())",
    ),
    # ------------------------------------------------------------------ prune_slice
    dict(
        problem="prune_slice",
        name="o_proj_rows_instead_of_columns",
        mistake="selects the kept heads among o_proj's rows (its outputs) instead of its columns (its inputs)",
        file=PRUNING,
        find="            w = w[channels][:, q_rows]",
        replace="            w = w[q_rows][:, channels]",
    ),
    dict(
        problem="prune_slice",
        name="kv_sliced_like_queries",
        mistake="slices k_proj and v_proj with the query heads' rows, forgetting that K/V heads are fewer (GQA)",
        file=PRUNING,
        find="            w = w[kv_rows][:, channels]",
        replace="            w = w[q_rows][:, channels]",
    ),
    dict(
        problem="prune_slice",
        name="head_rows_without_offsets",
        mistake="repeats each head index H times instead of expanding it to the rows n*H .. n*H + H - 1",
        file=PRUNING,
        find="return (heads[:, None] * H + torch.arange(H, device=heads.device)).reshape(-1)",
        replace="return heads.repeat_interleave(H)",
    ),
    dict(
        problem="prune_slice",
        name="down_proj_rows_instead_of_columns",
        mistake="slices down_proj's rows by the kept neurons, although down_proj reads the neurons (columns)",
        file=PRUNING,
        find="            w = w[channels][:, neurons]",
        replace="            w = w[neurons][:, channels]",
    ),
    dict(
        problem="prune_slice",
        name="q_bias_not_sliced",
        mistake="slices q_proj's weight but leaves its bias (Qwen2) at the full N * H",
        file=PRUNING,
        find='        elif name == "attn.q_proj.bias":\n            w = w[q_rows]\n',
        replace="",
    ),
    # ------------------------------------------------------------------ distill_loss
    dict(
        problem="distill_loss",
        name="no_temperature_squared",
        mistake="leaves out the T^2 factor, so the loss and its gradient shrink as the temperature grows",
        file=DISTILL,
        find="return kl.mean() * T * T",
        replace="return kl.mean()",
    ),
    dict(
        problem="distill_loss",
        name="kl_student_to_teacher",
        mistake="computes KL(student || teacher), the mode-seeking direction, instead of KL(teacher || student)",
        file=DISTILL,
        find="kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)",
        replace="kl = (log_q.exp() * (log_q - log_p)).sum(dim=-1)",
    ),
    dict(
        problem="distill_loss",
        name="teacher_not_tempered",
        mistake="divides only the student's logits by T, comparing it with the teacher's untempered distribution",
        file=DISTILL,
        find="log_p = F.log_softmax(teacher_logits.detach().float() / T, dim=-1)",
        replace="log_p = F.log_softmax(teacher_logits.detach().float(), dim=-1)",
    ),
    dict(
        problem="distill_loss",
        name="kl_div_mean_over_vocabulary",
        mistake="uses F.kl_div with reduction='mean', which also divides by the vocabulary size",
        file=DISTILL,
        find="return kl.mean() * T * T",
        replace='return F.kl_div(log_q, log_p, log_target=True, reduction="mean") * T * T',
    ),
]

"""Plausible wrong solutions of Part 4 (quantization), each of which must lose points in its own
problem's graded tests (tests/test_quantization.py) and in no other problem's.

Verify one entry: apply its edit(s) to the file, run
    python -m pytest -q -p no:xdist -m graded tests/test_quantization.py
check that only its problem's tests fail, and restore the file (git checkout -- cs336_inference).
"""

ABSMAX = "cs336_inference/quantization/absmax.py"
INT4 = "cs336_inference/quantization/int4.py"
BLOCKS = "cs336_inference/quantization/ggml_blocks.py"
KQUANTS = "cs336_inference/quantization/kquants.py"
LLM_INT8 = "cs336_inference/quantization/llm_int8.py"
AWQ = "cs336_inference/quantization/awq.py"

WRONG = [
    # ------------------------------------------------------------------ int8_absmax
    dict(
        problem="int8_absmax",
        name="scale_from_mean",
        mistake="sets the scale from the mean |w| instead of the max, so large weights saturate at 127",
        file=ABSMAX,
        find="scale = w.abs().amax(dim=-1) / QMAX",
        replace="scale = w.abs().mean(dim=-1) / QMAX",
    ),
    dict(
        problem="int8_absmax",
        name="truncating_cast",
        mistake="casts w / scale straight to int8, which truncates toward zero instead of rounding",
        file=ABSMAX,
        find="q = torch.round(w / safe.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)",
        replace="q = (w / safe.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)",
    ),
    dict(
        problem="int8_absmax",
        name="one_scale_per_tensor",
        mistake="one absmax for the whole tensor instead of one per row",
        file=ABSMAX,
        find="scale = w.abs().amax(dim=-1) / QMAX",
        replace="scale = (w.abs().amax() / QMAX).expand(w.shape[:-1])",
    ),
    dict(
        problem="int8_absmax",
        name="divides_by_128",
        mistake="uses 128 levels per side (the int8 range is -128..127) so the largest weight rounds to 128",
        file=ABSMAX,
        find="scale = w.abs().amax(dim=-1) / QMAX",
        replace="scale = w.abs().amax(dim=-1) / 128",
    ),
    dict(
        problem="int8_absmax",
        name="scale_not_broadcast",
        mistake="multiplies q by the [rows] scale without a trailing axis, so it broadcasts along columns",
        file=ABSMAX,
        find="return q.float() * scale.float().unsqueeze(-1)",
        replace="return q.float() * scale.float()",
    ),
    # ------------------------------------------------------------------ int4_groupwise
    dict(
        problem="int4_groupwise",
        name="nibbles_swapped",
        mistake="puts element 2j in the high nibble and 2j + 1 in the low one",
        file=INT4,
        find="return pairs[..., 0] | (pairs[..., 1] << 4)",
        replace="return (pairs[..., 0] << 4) | pairs[..., 1]",
    ),
    dict(
        problem="int4_groupwise",
        name="range_without_zero",
        mistake="uses [min, max] of the group as the range (not [min(w, 0), max(w, 0)]), so zero can fall off the grid",
        file=INT4,
        edits=[
            ("lo = groups.amin(dim=-1).clamp(max=0)", "lo = groups.amin(dim=-1)"),
            ("hi = groups.amax(dim=-1).clamp(min=0)", "hi = groups.amax(dim=-1)"),
        ],
    ),
    dict(
        problem="int4_groupwise",
        name="sixteen_steps",
        mistake="divides the range into 16 steps instead of 15 (16 levels have 15 gaps)",
        file=INT4,
        find="scale = ((hi - lo) / LEVELS).half()",
        replace="scale = ((hi - lo) / 16).half()",
    ),
    dict(
        problem="int4_groupwise",
        name="zero_point_not_rounded",
        mistake="keeps the zero point fractional; it is then truncated when stored as uint8",
        file=INT4,
        find="zero = torch.round(-lo / safe).clamp(0, LEVELS)",
        replace="zero = (-lo / safe).clamp(0, LEVELS)",
    ),
    dict(
        problem="int4_groupwise",
        name="dequantize_ignores_zero",
        mistake="dequantizes as q * scale, forgetting to subtract the zero point",
        file=INT4,
        find="w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)",
        replace="w = q * scale.float().unsqueeze(-1)",
    ),
    # ------------------------------------------------------------------ q8_0
    dict(
        problem="q8_0",
        name="round_half_to_even",
        mistake="rounds with torch.round (halves to even) where llama.cpp's roundf rounds halves away from zero",
        file=BLOCKS,
        find="q = roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)",
        replace="q = torch.round(x * _inverse(d)).to(torch.int8).view(torch.uint8)",
    ),
    dict(
        problem="q8_0",
        name="quantizes_with_fp16_scale",
        mistake="divides by the fp16-rounded scale; llama.cpp divides by the float32 one and rounds d only to store it",
        file=BLOCKS,
        find="q = roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)",
        replace="q = roundf(x * _inverse(d.half().float())).to(torch.int8).view(torch.uint8)",
    ),
    dict(
        problem="q8_0",
        name="float32_scale",
        mistake="stores the block scale as float32 (36-byte blocks) instead of float16",
        file=BLOCKS,
        find="return _rows(torch.cat([_fp16_bytes(d), q], dim=1), w.shape[0])",
        replace="return _rows(torch.cat([d.contiguous().view(torch.uint8), q], dim=1), w.shape[0])",
    ),
    dict(
        problem="q8_0",
        name="signed_max",
        mistake="takes the block's max instead of its max |x|, so all-negative blocks get a negative or tiny scale",
        file=BLOCKS,
        find="d = x.abs().amax(dim=1, keepdim=True) / 127",
        replace="d = x.amax(dim=1, keepdim=True) / 127",
    ),
    dict(
        problem="q8_0",
        name="reads_q_as_unsigned",
        mistake="dequantizes the quants as uint8, so negative weights come back as large positive ones",
        file=BLOCKS,
        find="q = blocks[:, 2:].contiguous().view(torch.int8).float()",
        replace="q = blocks[:, 2:].float()",
    ),
    # ------------------------------------------------------------------ llm_int8
    dict(
        problem="llm_int8",
        name="float_matmul",
        mistake="multiplies the int8 values as floats: right numbers, but no integer product is ever done",
        file=LLM_INT8,
        find="acc = int8_mm(qx, qw.t())",
        replace="acc = qx.float() @ qw.float().t()",
    ),
    dict(
        problem="llm_int8",
        name="one_activation_scale",
        mistake="one absmax for the whole activation matrix instead of one per token",
        file=LLM_INT8,
        find="s_t = x2.abs().amax(dim=-1) / 127",
        replace="s_t = (x2.abs().amax() / 127).expand(x2.shape[0])",
    ),
    dict(
        problem="llm_int8",
        name="outlier_in_every_token",
        mistake="calls a feature an outlier only when every token exceeds the threshold (all instead of any)",
        file=LLM_INT8,
        find="outliers = (x2.abs() >= threshold).any(dim=0)",
        replace="outliers = (x2.abs() >= threshold).all(dim=0)",
    ),
    dict(
        problem="llm_int8",
        name="outliers_left_in_int8",
        mistake="adds the float outlier product but does not remove the outlier features from the int8 part",
        file=LLM_INT8,
        find="y = int8_matmul(x2.masked_fill(outliers, 0), qw, w_scale).float()",
        replace="y = int8_matmul(x2, qw, w_scale).float()",
    ),
    dict(
        problem="llm_int8",
        name="outliers_dropped",
        mistake="removes the outlier features from the int8 product and never multiplies them at all",
        file=LLM_INT8,
        find="y = y + x2[:, outliers].float() @ w_out.t()",
        replace="y = y + 0 * (x2[:, outliers].float() @ w_out.t())",
    ),
    # ------------------------------------------------------------------ q4_k
    dict(
        problem="q4_k",
        name="top_bits_with_the_other_kind",
        mistake="stores the top bits of s_4..s_7 beside m_0..m_3 and those of m_4..m_7 beside s_0..s_3 (and reads them so)",
        file=KQUANTS,
        edits=[
            ("first = s[:, :4] | ((s[:, 4:] >> 4) << 6)", "first = s[:, :4] | ((m[:, 4:] >> 4) << 6)"),
            ("second = m[:, :4] | ((m[:, 4:] >> 4) << 6)", "second = m[:, :4] | ((s[:, 4:] >> 4) << 6)"),
            ("(p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)", "(p[:, 8:12] & 0xF) | ((p[:, 4:8] >> 6) << 4)"),
            ("(p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)", "(p[:, 8:12] >> 4) | ((p[:, 0:4] >> 6) << 4)"),
        ],
    ),
    dict(
        problem="q4_k",
        name="nibbles_of_the_last_four_bytes_swapped",
        mistake="puts s_4..s_7 in the high nibbles of bytes 8-11 and m_4..m_7 in the low ones (and reads them so)",
        file=KQUANTS,
        edits=[
            (
                "third = (s[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)",
                "third = (m[:, 4:] & 0xF) | ((s[:, 4:] & 0xF) << 4)",
            ),
            ("(p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)", "(p[:, 8:12] >> 4) | ((p[:, 0:4] >> 6) << 4)"),
            ("(p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)", "(p[:, 8:12] & 0xF) | ((p[:, 4:8] >> 6) << 4)"),
        ],
    ),
    dict(
        problem="q4_k",
        name="four_bit_scales",
        mistake="keeps only the low 4 bits of s_4..s_7 and m_4..m_7 (forgets their two top bits)",
        file=KQUANTS,
        edits=[
            ("first = s[:, :4] | ((s[:, 4:] >> 4) << 6)", "first = s[:, :4]"),
            ("second = m[:, :4] | ((m[:, 4:] >> 4) << 6)", "second = m[:, :4]"),
        ],
    ),
    dict(
        problem="q4_k",
        name="adds_the_min",
        mistake="adds dmin * m_j instead of subtracting it (the mins are stored as positive numbers)",
        file=KQUANTS,
        find="x = (d * s)[..., None] * q - (dmin * m)[..., None]",
        replace="x = (d * s)[..., None] * q + (dmin * m)[..., None]",
    ),
    dict(
        problem="q4_k",
        name="high_nibble_first",
        mistake="reads sub-block 2h from the high nibbles and 2h + 1 from the low ones",
        file=KQUANTS,
        find="q = torch.stack([qs & 0xF, qs >> 4], dim=2).view(n, 8, 32)",
        replace="q = torch.stack([qs >> 4, qs & 0xF], dim=2).view(n, 8, 32)",
    ),
    dict(
        problem="q4_k",
        name="fp16_arithmetic",
        mistake="computes in float16, the type d and dmin are stored in (products round, large ones overflow)",
        file=KQUANTS,
        find="x = (d * s)[..., None] * q - (dmin * m)[..., None]",
        replace="x = ((d.half() * s.half())[..., None] * q.half() - (dmin.half() * m.half())[..., None]).float()",
    ),
    # ------------------------------------------------------------------ awq
    dict(
        problem="awq",
        name="no_unscale",
        mistake="compares Q(W s) with W without dividing the scales back out",
        file=AWQ,
        find="w_q = quantize(w * s[None, :]) / s[None, :]",
        replace="w_q = quantize(w * s[None, :])",
    ),
    dict(
        problem="awq",
        name="weight_error",
        mistake="minimises the weight error ||W - Q||^2 instead of the output error on the activations",
        file=AWQ,
        find="total += (x @ (w - w_q).t()).double().pow(2).sum().item()",
        replace="total += (w - w_q).double().pow(2).sum().item()",
    ),
    dict(
        problem="awq",
        name="max_activation",
        mistake="uses max |x| per channel instead of mean |x|",
        file=AWQ,
        find="m = (x.float().abs().mean(dim=0) if x_mean is None else x_mean.float()).clamp(min=1e-5)",
        replace="m = (x.float().abs().amax(dim=0) if x_mean is None else x_mean.float()).clamp(min=1e-5)",
    ),
    dict(
        problem="awq",
        name="not_normalised",
        mistake="returns m^alpha without dividing by sqrt(max * min)",
        file=AWQ,
        find="s = s / (s.max() * s.min()).sqrt()",
        replace="s = s",
    ),
    dict(
        problem="awq",
        name="keeps_last_alpha",
        mistake="returns the scale of the last alpha tried, not of the best one",
        file=AWQ,
        find="if err < best_err:",
        replace="if True:",
    ),
]

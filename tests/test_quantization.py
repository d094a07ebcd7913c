"""Quantization against independent references: llama.cpp's own quantizer (the `gguf` package) for the
block formats, numpy re-statements of the documented int8 / int4 rules, float64 for the integer
matmul, and properties that cannot hold by accident (error bounds, exact equalities, planted
outliers and salient channels with their negative controls)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.quantization import (
    METHODS,
    LLMInt8Linear,
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    ggml_blocks,
    model_nbytes,
    quantize_model,
)
from cs336_inference.quantization import awq as awq_mod
from cs336_inference.quantization import llm_int8 as llm_int8_mod
from cs336_inference.quantization.absmax import absmax_dequantize, absmax_quantize
from cs336_inference.quantization.int4 import int4_dequantize, int4_quantize, pack_int4, unpack_int4

GGML = {"q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1}


def rows_with_hard_cases(rows: int = 12, width: int = 128, seed: int = 0) -> np.ndarray:
    """Random rows at many scales plus the cases formats get wrong: a row of zeros, a block of zeros,
    an all-negative row, an all-positive row, a 100x outlier, exact halves, tiny values."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width)) * rng.uniform(1e-3, 5.0, size=(rows, 1))
    x[0] = 0.0
    x[1, :32] = 0.0
    x[2] = -np.abs(x[2])
    x[3] = np.abs(x[3]) + 0.5
    x[4, 7] = 100.0 * np.abs(x[4]).max()
    x[5] = np.round(rng.uniform(-126, 126, width)) + 0.5  # with max |x| = 127 the scale is 1: exact halves
    x[5, ::32] = 127.0
    x[6] *= 1e-4
    return x.astype(np.float32)


def first_mismatch(ours: np.ndarray, ref: np.ndarray) -> str:
    bad = np.argwhere(ours != ref)
    if bad.size == 0:
        return "none"
    i = tuple(bad[0])
    return f"first at index {i}: expected {ref[i]!r}, got {ours[i]!r} ({len(bad)} of {ref.size} differ)"


# ===================================================================== absmax int8
@pytest.mark.graded(problem="int8_absmax", points=2)
def test_absmax_round_trip_within_half_a_scale():
    w = torch.from_numpy(rows_with_hard_cases())
    q, scale = absmax_quantize(w)
    assert q.dtype == torch.int8 and q.shape == w.shape, f"q: {q.dtype} {tuple(q.shape)}"
    assert scale.shape == (w.shape[0],), (
        f"one scale per row: expected shape ({w.shape[0]},), got {tuple(scale.shape)}"
    )
    expected_scale = w.abs().amax(dim=1) / 127
    torch.testing.assert_close(scale.float(), expected_scale, rtol=1e-6, atol=0, msg="scale = max|row| / 127")
    assert int(q.abs().max()) <= 127, "values must lie in -127..127"
    w_hat = absmax_dequantize(q, scale)
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    err = (w - w_hat).abs()
    bound = expected_scale[:, None] / 2 * (1 + 1e-5)
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (
        f"{len(bad)} elements are further than scale/2 from the original, first at {tuple(bad[0].tolist())}: "
        f"w={w[tuple(bad[0])]:.6g}, dequantized={w_hat[tuple(bad[0])]:.6g}, scale={expected_scale[bad[0][0]]:.6g}"
    )
    assert torch.equal(w_hat[0], torch.zeros_like(w_hat[0])), "a row of zeros must come back as zeros"
    assert int((q[4].abs() <= 1).sum()) == w.shape[1] - 1, (
        "a 100x outlier sets its row's scale: every other value of that row must round to -1, 0 or 1"
    )


@pytest.mark.graded(problem="int8_absmax", points=2)
def test_absmax_matches_numpy_and_keeps_leading_dims():
    x = rows_with_hard_cases(seed=1).reshape(3, 4, 128)  # e.g. [B, T, D] activations: one scale per token
    q, scale = absmax_quantize(torch.from_numpy(x))
    s = np.abs(x).max(axis=-1) / np.float32(127)
    safe = np.where(s == 0, np.float32(1), s)
    expected = np.round(x / safe[..., None]).astype(np.int8)  # numpy rounds halves to even, like torch
    assert tuple(q.shape) == x.shape and tuple(scale.shape) == x.shape[:-1]
    assert np.array_equal(q.numpy(), expected), "q = round(x / scale): " + first_mismatch(q.numpy(), expected)
    deq = absmax_dequantize(q, scale).numpy()
    np.testing.assert_allclose(deq, expected.astype(np.float32) * s[..., None], rtol=1e-6, atol=0)


# ===================================================================== int4 group-wise + packing
@pytest.mark.graded(problem="int4_groupwise", points=2)
def test_int4_packing_layout_and_round_trip():
    q = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 3), f"got {packed.dtype} {tuple(packed.shape)}"
    assert packed.tolist() == [[0x21, 0x43, 0x0F]], (
        f"element 2j goes in the low nibble, 2j+1 in the high one: expected [0x21, 0x43, 0x0f], "
        f"got {[hex(b) for b in packed[0].tolist()]}"
    )
    every = torch.arange(16, dtype=torch.uint8)
    all_pairs = torch.cartesian_prod(every, every).reshape(2, 256)  # every (low, high) combination
    assert torch.equal(unpack_int4(pack_int4(all_pairs)), all_pairs), "unpack(pack(q)) != q"
    rows = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert pack_int4(rows).shape == (5, 3, 32), "an int4 row of I values takes I/2 bytes"
    assert torch.equal(unpack_int4(pack_int4(rows)), rows)


def int4_reference(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The documented rule in numpy: range [min(w,0), max(w,0)], fp16 scale first, halves to even."""
    rows, width = w.shape
    groups = w.reshape(rows, width // g, g)
    lo = np.minimum(groups.min(-1), 0)
    hi = np.maximum(groups.max(-1), 0)
    scale16 = ((hi - lo) / np.float32(15)).astype(np.float16)
    s = scale16.astype(np.float32)
    safe = np.where(s == 0, np.float32(1), s)
    zero = np.clip(np.round(-lo / safe), 0, 15)
    q = (
        np.clip(np.round(groups / safe[..., None]) + zero[..., None], 0, 15)
        .astype(np.uint8)
        .reshape(rows, width)
    )
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, scale16, zero.astype(np.uint8)


@pytest.mark.graded(problem="int4_groupwise", points=2)
def test_int4_quantize_matches_the_documented_rule():
    for group_size in (32, 64, 128):
        check_int4_rule(rows_with_hard_cases(seed=2), group_size)


def check_int4_rule(w: np.ndarray, group_size: int) -> None:
    packed, scale, zero = int4_quantize(torch.from_numpy(w), group_size)
    ref_packed, ref_scale, ref_zero = int4_reference(w, group_size)
    G = w.shape[1] // group_size
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (w.shape[0], w.shape[1] // 2)
    assert scale.dtype == torch.float16 and tuple(scale.shape) == (w.shape[0], G), (
        f"scale: expected float16 [{w.shape[0]}, {G}], got {scale.dtype} {tuple(scale.shape)}"
    )
    assert zero.dtype == torch.uint8 and tuple(zero.shape) == (w.shape[0], G)
    assert np.array_equal(scale.numpy(), ref_scale), (
        "scale: " + first_mismatch(scale.numpy(), ref_scale) + f" (group_size {group_size})"
    )
    assert np.array_equal(zero.numpy(), ref_zero), (
        "zero: " + first_mismatch(zero.numpy(), ref_zero) + f" (group_size {group_size})"
    )
    assert np.array_equal(packed.numpy(), ref_packed), "packed q: " + first_mismatch(
        packed.numpy(), ref_packed
    )


@pytest.mark.graded(problem="int4_groupwise", points=2)
def test_int4_round_trip_error_is_at_most_half_a_step():
    g = 32
    w = torch.from_numpy(rows_with_hard_cases(seed=3))
    packed, scale, zero = int4_quantize(w, g)
    w_hat = int4_dequantize(packed, scale, zero)
    assert w_hat.dtype == torch.float32 and w_hat.shape == w.shape
    step = scale.float().repeat_interleave(g, dim=1)
    err = (w - w_hat).abs()
    bad = (err > step / 2 * (1 + 2e-3) + 1e-12).nonzero()
    assert bad.numel() == 0, (
        f"{len(bad)} elements are further than half a step from the original, first at "
        f"{tuple(bad[0].tolist())}: w={w[tuple(bad[0])]:.6g}, got {w_hat[tuple(bad[0])]:.6g}, "
        f"step={step[tuple(bad[0])]:.6g}"
    )
    assert torch.equal(w_hat[0], torch.zeros(w.shape[1])), "a row of zeros must come back as zeros"
    assert (w_hat[2] <= 0).all(), "an all-negative row stays non-positive"
    at_zero = int4_dequantize(pack_int4(zero.repeat_interleave(g, dim=1)), scale, zero)
    assert torch.equal(at_zero, torch.zeros_like(w)), "q = zero must dequantize to 0.0 exactly"


# ===================================================================== llama.cpp blocks
@pytest.mark.graded(problem="q8_0", points=3)
def test_q8_0_bytes_equal_llama_cpp():
    for seed in (0, 1, 2):
        check_q8_0_bytes(rows_with_hard_cases(seed=seed))


def check_q8_0_bytes(x: np.ndarray) -> None:
    ours = ggml_blocks.q8_0_quantize(torch.from_numpy(x))
    ref = gguf_quantize(x, QT.Q8_0)
    assert ours.dtype == torch.uint8 and tuple(ours.shape) == ref.shape, (
        f"Q8_0 of a [12, 128] matrix is [12, 4 * 34] bytes, got {ours.dtype} {tuple(ours.shape)}"
    )
    ours = ours.numpy()
    if not np.array_equal(ours, ref):
        row, byte = map(int, np.argwhere(ours != ref)[0])
        block, offset = divmod(byte, 34)
        what = "the fp16 scale d" if offset < 2 else f"q of weight {offset - 2}"
        pytest.fail(
            f"row {row}, block {block}: byte {offset} ({what}) differs: expected {ref[row, byte]}, got "
            f"{ours[row, byte]}; weights of that block: {x[row, 32 * block : 32 * block + 32][:8]}..."
        )


@pytest.mark.graded(problem="q8_0", points=2)
def test_q8_0_dequantize_equals_llama_cpp():
    x = rows_with_hard_cases(seed=4)
    blocks = gguf_quantize(x, QT.Q8_0)
    rng = np.random.default_rng(4)
    random_blocks = rng.integers(0, 256, size=(6, 4 * 34), dtype=np.uint8)  # every int8 value appears
    random_blocks.reshape(-1, 34)[:, :2] = rng.uniform(-2, 2, size=(24, 1)).astype(np.float16).view(np.uint8)
    for raw in (blocks, random_blocks):
        ours = ggml_blocks.q8_0_dequantize(torch.from_numpy(raw))
        ref = gguf_dequantize(raw, QT.Q8_0)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape
        assert np.array_equal(ours.numpy(), ref), "dequantized: " + first_mismatch(ours.numpy(), ref)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q4_blocks_equal_llama_cpp(fmt, seed):
    x = rows_with_hard_cases(seed=seed)
    ours = getattr(ggml_blocks, f"{fmt}_quantize")(torch.from_numpy(x)).numpy()
    ref = gguf_quantize(x, GGML[fmt])
    assert ours.shape == ref.shape and np.array_equal(ours, ref), first_mismatch(ours, ref)
    deq = getattr(ggml_blocks, f"{fmt}_dequantize")(torch.from_numpy(ref)).numpy()
    assert np.array_equal(deq, gguf_dequantize(ref, GGML[fmt])), first_mismatch(
        deq, gguf_dequantize(ref, GGML[fmt])
    )


@pytest.fixture(scope="module")
def smollm2_weight() -> np.ndarray:
    """One real weight (layer 0's gate projection, 1536 x 576) of SmolLM2, read alone from the GGUF."""
    from cs336_inference.io import gguf_read as gguf_io
    from cs336_inference.io.checkpoint import CheckpointError, default_model_path

    try:
        path = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    gguf = gguf_io.read_gguf(path)
    t = gguf.tensors["blk.0.ffn_gate.weight"]
    return gguf_io.dequantize(gguf.raw(t.name), t.qtype).reshape(t.shape)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_blocks_equal_llama_cpp_on_a_real_smollm2_weight(smollm2_weight, fmt):
    x = smollm2_weight
    ours = getattr(ggml_blocks, f"{fmt}_quantize")(torch.from_numpy(x)).numpy()
    ref = gguf_quantize(x, GGML[fmt])
    assert np.array_equal(ours, ref), first_mismatch(ours, ref)
    deq = getattr(ggml_blocks, f"{fmt}_dequantize")(torch.from_numpy(ref)).numpy()
    assert np.array_equal(deq, gguf_dequantize(ref, GGML[fmt]))


def test_block_formats_reject_partial_blocks():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        ggml_blocks.q4_0_quantize(torch.zeros(2, 48))


# ===================================================================== LLM.int8()
def planted_outlier_layer(d_in=1024, d_out=128, T=16, n_outliers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    x = torch.randn(T, d_in, generator=g)
    features = torch.randperm(d_in, generator=g)[:n_outliers]
    x[:, features] *= 100.0
    return x, w, features


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel int8 weights, computed here (not with absmax_quantize) so that these
    tests depend on nothing but the LLM.int8() code."""
    s = w.abs().amax(dim=1) / 127
    return torch.round(w / s[:, None]).to(torch.int8), s


@pytest.mark.graded(problem="llm_int8", points=2)
def test_int8_matmul_is_a_real_vectorwise_int8_product(monkeypatch):
    x, w, _ = planted_outlier_layer(d_in=256, d_out=48, T=7, n_outliers=0, seed=1)
    x[3] = 0.0  # a token of zeros
    x = x.reshape(1, 7, 256)
    qw, sw = int8_weights(w)
    calls = []
    real_mm = llm_int8_mod.int8_mm

    def spy(a, b):
        calls.append((a.dtype, b.dtype, tuple(a.shape), tuple(b.shape)))
        return real_mm(a, b)

    monkeypatch.setattr(llm_int8_mod, "int8_mm", spy)
    y = llm_int8_mod.int8_matmul(x, qw, sw)
    assert calls and all(c[:2] == (torch.int8, torch.int8) for c in calls), (
        f"the product must go through int8_mm with int8 operands (an integer matmul); calls: {calls}"
    )
    assert y.shape == (1, 7, 48) and y.dtype == x.dtype, f"got {y.dtype} {tuple(y.shape)}"
    # float64 reference: every partial sum is an integer, so this is exact before the final rescale
    x2 = x.reshape(7, 256).double()
    sx = x2.abs().amax(dim=1) / 127
    qx = torch.round(x2 / torch.where(sx == 0, 1, sx)[:, None])
    expected = (qx @ qw.double().t()) * sx[:, None] * sw.double()[None, :]
    torch.testing.assert_close(y.reshape(7, 48).double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(y[0, 3], torch.zeros(48)), "a token of zeros gives zeros"


@pytest.mark.graded(problem="llm_int8", points=1)
def test_llm_int8_with_infinite_threshold_is_plain_int8():
    x, w, _ = planted_outlier_layer(d_in=256, d_out=32, seed=2)
    qw, sw = int8_weights(w)
    plain = llm_int8_mod.int8_matmul(x, qw, sw)
    assert torch.equal(llm_int8_mod.llm_int8_matmul(x, qw, sw, threshold=float("inf")), plain), (
        "threshold = inf: no outlier features, so the result must be int8_matmul's exactly"
    )


@pytest.mark.graded(problem="llm_int8", points=1)
def test_llm_int8_outlier_features_are_computed_in_float():
    x, w, features = planted_outlier_layer(d_in=256, d_out=32, seed=3)
    qw, sw = int8_weights(w)
    w_deq = qw.float() * sw[:, None]
    only = torch.zeros_like(x)
    only[:, features] = x[:, features]  # only the outlier features are non-zero
    y = llm_int8_mod.llm_int8_matmul(only, qw, sw, threshold=6.0)
    torch.testing.assert_close(
        y, only @ w_deq.t(), rtol=1e-5, atol=1e-4, msg="outlier features must be multiplied in float"
    )
    # and in a full input: the result is int8 on the other features + the float outlier product
    regular = x.clone()
    regular[:, features] = 0
    full = llm_int8_mod.llm_int8_matmul(x, qw, sw, threshold=6.0)
    int8_part = llm_int8_mod.int8_matmul(regular, qw, sw)
    torch.testing.assert_close(
        full - int8_part, x[:, features] @ w_deq[:, features].t(), rtol=1e-5, atol=1e-3
    )


@pytest.mark.graded(problem="llm_int8", points=2)
def test_llm_int8_error_is_far_below_plain_int8_with_planted_outliers():
    x, w, _ = planted_outlier_layer(d_in=1024, d_out=128, n_outliers=3, seed=4)
    qw, sw = int8_weights(w)
    w_deq = qw.float() * sw[:, None]

    def rel(y, ref):
        return float((y - ref).norm() / ref.norm())

    exact = x @ w.t()
    plain = rel(llm_int8_mod.int8_matmul(x, qw, sw), exact)
    mixed = rel(llm_int8_mod.llm_int8_matmul(x, qw, sw, threshold=6.0), exact)
    weights_only = rel(x @ w_deq.t(), exact)  # the error int8 weights alone cause
    assert plain > 0.03, f"negative control: plain int8 should suffer from the outliers (error {plain:.4f})"
    assert mixed < plain / 5, f"LLM.int8() error {mixed:.4f} should be far below plain int8's {plain:.4f}"
    assert mixed < 1.2 * weights_only, (
        f"LLM.int8() error {mixed:.4f} should be close to that of the int8 weights alone {weights_only:.4f}"
    )
    # the activation side alone (against the dequantized weights): two orders of magnitude
    act_plain = rel(llm_int8_mod.int8_matmul(x, qw, sw), x @ w_deq.t())
    act_mixed = rel(llm_int8_mod.llm_int8_matmul(x, qw, sw), x @ w_deq.t())
    assert act_mixed < act_plain / 20, f"activation error {act_mixed:.5f} vs plain {act_plain:.5f}"


# ===================================================================== AWQ
def rtn(group_size: int):
    """An independent fake int4 quantizer (asymmetric, range including 0) for the AWQ tests."""

    def q(w: torch.Tensor) -> torch.Tensor:
        rows, width = w.shape
        g = w.reshape(rows, width // group_size, group_size)
        lo, hi = g.amin(-1, keepdim=True).clamp(max=0), g.amax(-1, keepdim=True).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-12)
        z = torch.round(-lo / s)
        return ((torch.round(g / s) + z).clamp(0, 15) - z).mul(s).reshape(rows, width)

    return q


def salient_layer(seed: int = 0, width: int = 256, salient: int = 4):
    """Activations with a few channels 10-30x larger than the rest (as in real LLMs), two linears."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, width, generator=g) * 0.5
    channels = torch.randperm(width, generator=g)[:salient]
    x[:, channels] *= torch.linspace(10, 30, salient)
    weights = [torch.randn(rows, width, generator=g) / width**0.5 for rows in (64, 32)]
    return x, weights


def error_of(x, weights, s, quantize) -> float:
    return sum(
        float((x.double() @ (w.double() - (quantize(w * s) / s).double()).t()).pow(2).sum()) for w in weights
    )


@pytest.mark.graded(problem="awq", points=1)
def test_awq_output_error_is_the_scaled_quantization_error():
    x, weights = salient_layer(seed=1)
    s = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5
    quantize = rtn(32)
    got = awq_mod.awq_output_error(x, weights, s, quantize)
    expected = error_of(x, weights, s, quantize)
    assert got == pytest.approx(expected, rel=1e-4), (
        f"expected sum ||x W^T - (x/s) Q(W s)^T||^2 = {expected:.6g}, got {got:.6g}"
    )
    ones = awq_mod.awq_output_error(x, weights, torch.ones(x.shape[1]), quantize)
    assert ones == pytest.approx(error_of(x, weights, torch.ones(x.shape[1]), quantize), rel=1e-4)


@pytest.mark.graded(problem="awq", points=3)
def test_awq_search_picks_the_best_alpha_of_the_grid():
    for seed in (0, 1, 2):
        check_awq_search(*salient_layer(seed=seed), case=f"salient layer seed {seed}")


def check_awq_search(x: torch.Tensor, weights: list[torch.Tensor], case: str) -> None:
    quantize = rtn(32)
    s, alpha = awq_mod.search_scale(x, weights, quantize, n_grid=10)
    m = x.abs().mean(dim=0)
    errors = {}
    for i in range(11):
        a = i / 10
        cand = m.pow(a)
        cand = cand / (cand.max() * cand.min()).sqrt()
        errors[a] = error_of(x, weights, cand, quantize)
    best = min(errors, key=errors.get)
    assert alpha == pytest.approx(best), (
        f"{case}: alpha {alpha} was returned but alpha {best} has the smallest error; errors by alpha: "
        + ", ".join(f"{a:.1f}: {e:.4g}" for a, e in errors.items())
    )
    expected_s = m.pow(best)
    expected_s = expected_s / (expected_s.max() * expected_s.min()).sqrt()
    torch.testing.assert_close(s, expected_s, rtol=1e-5, atol=0, msg=f"{case}: s = m^alpha / sqrt(max * min)")


@pytest.mark.graded(problem="awq", points=2)
def test_awq_beats_round_to_nearest_on_salient_channels():
    quantize = rtn(64)
    x, weights = salient_layer(seed=5)
    s, alpha = awq_mod.search_scale(x, weights, quantize)
    e_awq = error_of(x, weights, s, quantize)
    e_rtn = error_of(x, weights, torch.ones(x.shape[1]), quantize)
    assert e_awq < 0.8 * e_rtn and alpha > 0, (
        f"with 4 channels 10-30x larger, scaling them up must cut the error: AWQ {e_awq:.4g} (alpha {alpha}) "
        f"vs round-to-nearest {e_rtn:.4g}"
    )
    # no salient channels: AWQ may not help, but it never hurts on its own calibration data
    g = torch.Generator().manual_seed(6)
    x_flat, w_flat = torch.randn(128, 256, generator=g), [torch.randn(64, 256, generator=g)]
    s, _ = awq_mod.search_scale(x_flat, w_flat, quantize)
    assert error_of(x_flat, w_flat, s, quantize) <= error_of(x_flat, w_flat, torch.ones(256), quantize) * (
        1 + 1e-9
    )


# ===================================================================== whole models
TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)


def tiny(seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def ids(B: int = 2, T: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def linear_weight_bytes(model: TransformerLM, per_weight) -> int:
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("layers.") and p.ndim == 2:
            total += per_weight(*p.shape)
    return total


def float_bytes_outside_linears(model: TransformerLM) -> int:
    return sum(
        4 * p.numel()
        for name, p in model.named_parameters()
        if not (name.startswith("layers.") and p.ndim == 2)
    )


FORMULA = {  # bytes of one [O, I] weight in each method (group size 64 for int4 / awq)
    "int8": lambda o, i: o * i + 4 * o,
    "llm_int8": lambda o, i: o * i + 4 * o,
    "w8a8": lambda o, i: o * i + 4 * o,
    "int4": lambda o, i: o * i // 2 + (2 + 1) * o * (i // 64),
    "awq": lambda o, i: o * i // 2 + (2 + 1) * o * (i // 64),
    "q8_0": lambda o, i: o * i // 32 * 34,
    "q4_0": lambda o, i: o * i // 32 * 18,
    "q4_1": lambda o, i: o * i // 32 * 20,
    "q5_0": lambda o, i: o * i // 32 * 22,
}
FORMULA |= {f"{fmt}_a8": FORMULA[fmt] for fmt in ("int4", "q8_0", "q4_0")}  # the same bytes, x in Q8_0


# the K-quants need rows of whole super-blocks of 256, wider than this tiny model (tests/test_kquants.py)
@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("q4_k", "q6_k", "q4_k_m")])
def test_quantize_model_bytes_equal_the_formula_and_logits_stay_close(method):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calibration = ids(2, 32, seed=9) if method == "awq" else None
    qmodel = quantize_model(model, method, calibration=calibration)
    assert qmodel is not model
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"quantize_model changed the input model's {k}"
    layers = [m for m in qmodel.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 7
    assert all(isinstance(m, LLMInt8Linear) for m in layers) == (method in ("llm_int8", "w8a8"))
    expected = linear_weight_bytes(model, FORMULA[method]) + float_bytes_outside_linears(model)
    assert model_nbytes(qmodel) == expected, (
        f"{method}: model_nbytes {model_nbytes(qmodel)} != formula {expected}"
    )
    assert model_nbytes(model) == 4 * model.num_parameters()
    with torch.no_grad():
        ref, out = model(ids()), qmodel(ids())
    kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    four_bits = ("int4", "awq", "q4_0", "q4_1", "q5_0", "int4_a8", "q4_0_a8")  # 4-5 bits per weight
    assert 0 < kl < (0.05 if method in four_bits else 0.005), f"{method}: KL {kl:.4g}"


def test_quantized_linear_forward_is_dequantize_then_matmul():
    torch.manual_seed(0)
    w, b, x = torch.randn(48, 64), torch.randn(48), torch.randn(3, 5, 64)
    for fmt in ("int8", "int4", "q8_0", "q4_0", "q4_1"):
        layer = QuantizedLinear.from_weight(w, fmt, bias=b)
        torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(), b))
        assert torch.equal(layer.weight, layer.dequantize())
        rows = torch.tensor([[3, 0], [47, 3]])
        assert torch.equal(layer.dequantize(rows=rows), layer.dequantize()[rows]), "row gather == full rows"


def test_quantize_head_stores_the_vocabulary_matrix_quantized():
    for tie in (True, False):
        model = tiny(tie_embeddings=tie)
        qmodel = quantize_model(model, "q8_0", quantize_head=True)
        assert isinstance(qmodel.embed, QuantizedEmbedding)
        table = qmodel.embed.table
        assert torch.equal(qmodel.embed(ids()), table.dequantize()[ids()])
        head = [] if tie else [qmodel.lm_head]
        assert all(isinstance(h, QuantizedLinear) for h in head)
        V, D = model.config.vocab_size, model.config.d_model
        norms = sum(4 * p.numel() for n, p in model.named_parameters() if "norm" in n)
        expected = (
            linear_weight_bytes(model, FORMULA["q8_0"]) + norms + FORMULA["q8_0"](V, D) * (1 if tie else 2)
        )
        assert model_nbytes(qmodel) == expected, f"tie={tie}"
        with torch.no_grad():
            assert (qmodel(ids()) - model(ids())).abs().max() < 0.3


@pytest.mark.parametrize("fmt", ["int8", "q4_0"])
def test_a_quantized_output_matrix_is_multiplied_from_its_bytes(fmt):
    """vocab_weight of a quantize_head model is a PackedWeight: F.linear runs the table's own layer
    (its kernel), every other op sees the dequantized numbers, and the logits are those of the
    dequantized table."""
    for tie in (True, False):
        qmodel = quantize_model(tiny(tie_embeddings=tie), fmt, quantize_head=True)
        layer = qmodel.embed.table if tie else qmodel.lm_head
        w, table = qmodel.vocab_weight, layer.dequantize()
        assert isinstance(w, PackedWeight) and w.shape == table.shape and w.dtype == torch.float32
        assert torch.equal(w * 1, table) and torch.equal(w.t(), table.t()), (
            f"tie={tie}: other ops see the numbers"
        )
        calls, forward = [], layer.forward
        layer.forward = lambda x, calls=calls, forward=forward: calls.append(x.shape) or forward(x)
        hidden = []
        qmodel.norm.register_forward_hook(lambda m, i, out, hidden=hidden: hidden.append(out))
        with torch.inference_mode():
            for B, T in ((1, 1), (2, 5)):  # a decode step and a short prefill
                logits = qmodel(ids(B, T))
                expected = F.linear(hidden[-1], table)
                torch.testing.assert_close(
                    logits, expected, rtol=1e-5, atol=1e-5, msg=f"tie={tie} B={B} T={T}"
                )
        assert calls == [(1, 1, TINY["d_model"]), (2, 5, TINY["d_model"])], (
            f"tie={tie}: the layer ran {calls}"
        )


def test_llm_int8_model_threshold_inf_equals_vectorwise_int8_model():
    model = tiny(seed=1)
    a = quantize_model(model, "w8a8")
    assert a.layers[0].mlp.down_proj.threshold == float("inf")
    int8 = quantize_model(model, "int8")
    layer_a = a.layers[0].mlp.down_proj
    layer_i = int8.layers[0].mlp.down_proj
    assert torch.equal(layer_a.qweight, layer_i.qweight), "llm_int8 stores the same int8 weights as int8"
    x = torch.randn(2, 3, TINY["d_ff"])
    assert torch.equal(layer_a(x), llm_int8_mod.int8_matmul(x, layer_i.qweight, layer_i.scale))


# ===================================================================== AWQ on a model
def awq_model(seed: int = 3, **overrides) -> TransformerLM:
    """A tiny model whose norms make a few input channels salient, as in real LLMs."""
    model = tiny(seed, **overrides)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.layers:
            for norm in (block.attn_norm, block.mlp_norm):
                norm.weight[torch.randperm(TINY["d_model"], generator=g)[:2]] *= 20
    return model


@pytest.mark.parametrize("variant", [{}, {"n_kv_heads": 4}, {"n_kv_heads": 1, "qkv_bias": True}])
def test_awq_folding_leaves_the_float_model_unchanged(variant):
    model = awq_model(**variant)
    folded, chosen = awq_mod.awq_fold(model, ids(2, 32, seed=5), group_size=32)
    assert any(alpha > 0 for alpha, _ in chosen.values()), f"no group was scaled: {chosen}"
    changed = [
        n for n, p in folded.named_parameters() if not torch.equal(p, dict(model.named_parameters())[n])
    ]
    assert any("norm" in n for n in changed) and any("o_proj" in n for n in changed), changed
    with torch.no_grad():
        diff = (folded(ids()) - model(ids())).abs().max()
    assert diff <= 1e-4, f"folding the scales changed the logits by {diff:.3g}"


def test_awq_per_layer_error_is_at_most_round_to_nearest():
    """On every group of every layer, the chosen scales' quantized output error on the calibration
    activations is <= round-to-nearest's, strictly lower where the norms planted salient channels;
    and the AWQ model's int4 weights are exactly those scaled weights, quantized."""
    model = awq_model()
    calibration = ids(2, 32, seed=5)
    folded, chosen = awq_mod.awq_fold(model, calibration, group_size=32)
    inputs = awq_mod.collect_inputs(model, calibration)
    quantize = rtn(32)
    names = {
        "qkv": ["attn.q_proj", "attn.k_proj", "attn.v_proj"],
        "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
    }
    names |= {"o": ["attn.o_proj"], "down": ["mlp.down_proj"]}
    strictly = 0
    with torch.no_grad():
        for key, (alpha, s) in chosen.items():
            layer, group = key.split(".")
            block = model.layers[int(layer)]
            weights = [block.get_submodule(n).weight for n in names[group]]
            x = inputs[key]
            err_awq, err_rtn = (
                error_of(x, weights, s, quantize),
                error_of(x, weights, torch.ones_like(s), quantize),
            )
            assert err_awq <= err_rtn * (1 + 1e-6), (
                f"{key}: AWQ {err_awq:.4g} > RTN {err_rtn:.4g} (alpha {alpha})"
            )
            strictly += err_awq < 0.9 * err_rtn
        assert strictly >= 2, (
            "the salient channels planted by the norms should make AWQ strictly better somewhere"
        )
        qmodel = quantize_model(model, "awq", group_size=32, calibration=calibration)
        gate = model.layers[1].mlp.gate_proj.weight * chosen["1.gate_up"][1]
        assert torch.equal(qmodel.layers[1].mlp.gate_proj.dequantize(), awq_mod.rtn_int4(32)(gate))


# ===================================================================== bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="int3"), "unknown quantization method 'int3'"),
        (dict(method="int4", group_size=48), "group_size 48 does not divide the row width 64"),
        (dict(method="int4", group_size=0), "group_size must be a positive integer"),
        (dict(method="q4_0", group_size=64), "q4_0 has a fixed layout"),
        (dict(method="int8", group_size=64), "int8 has a fixed layout"),
        (dict(method="awq"), "awq needs calibration token ids"),
        (dict(method="int8", calibration=torch.zeros(1, 4, dtype=torch.long)), "int8 takes no calibration"),
    ],
)
def test_bad_arguments_are_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        quantize_model(tiny(), **kwargs)
    assert "\n" not in str(info.value)


def test_quantizing_a_quantized_model_is_an_error():
    qmodel = quantize_model(tiny(), "q8_0")
    with pytest.raises(ValueError, match=r"already quantized \(layers.0.attn.q_proj is q8_0\)"):
        quantize_model(qmodel, "int4")


def test_awq_refuses_mla():
    model = tiny(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(ValueError, match="not MLA"):
        quantize_model(model, "awq", group_size=16, calibration=ids())


@pytest.mark.parametrize("method", ["int8", "int4", "q8_0"])
def test_a_bf16_model_quantized_with_its_table_keeps_bf16_activations(method):
    """The quantized embedding returns rows in the float table's dtype: a bf16 model stays bf16 end
    to end (a float32 lookup would promote the whole residual stream, and every GPU kernel that
    takes bf16 activations would decline). model.to(dtype) after quantizing moves it too."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, d_ff=128, max_seq_len=16)
    model = TransformerLM(cfg).to(torch.bfloat16).eval()
    q = quantize_model(model, method, quantize_head=True)
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert q.embed(ids).dtype == torch.bfloat16, f"{method}: embedding rows in {q.embed(ids).dtype}"
        assert q(ids).dtype == torch.bfloat16
        assert q.to(torch.float32).embed(ids).dtype == torch.float32
    assert "embed.dtype_probe" not in q.state_dict()

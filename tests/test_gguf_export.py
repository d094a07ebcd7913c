"""save_gguf: files our loader reads back to the same logits, the `gguf` package (llama.cpp's Python
reader) reads with the requested tensor types, and whose stored blocks are llama.cpp's own bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize as gguf_quantize

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.io.checkpoint import load_pretrained
from cs336_inference.io.gguf_read import unpermute_qk
from cs336_inference.io.gguf_write import save_gguf
from cs336_inference.quantization import quantize_model

TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
QTYPE = {"f32": QT.F32, "f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "q4_1": QT.Q4_1}


def tiny(seed: int = 0, **overrides) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**TINY, "model_type": "llama", "rope_theta": 5000.0, **overrides})
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_quantized_export_reloads_to_the_quantized_model(tmp_path, qtype, tie):
    qmodel = quantize_model(tiny(tie_embeddings=tie), qtype)
    path = save_gguf(qmodel, tmp_path / f"m.{qtype}.gguf", qtype)
    reloaded = load_pretrained(path)
    torch.testing.assert_close(logits(reloaded, ids()), logits(qmodel, ids()), rtol=0, atol=1e-5)
    reader = GGUFReader(path)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == QTYPE[qtype] and types["blk.1.ffn_down.weight"] == QTYPE[qtype]
    assert types["blk.0.attn_norm.weight"] == QT.F32 and types["token_embd.weight"] == QT.F32
    assert ("output.weight" in types) == (not tie)
    assert sum(t == QTYPE[qtype] for t in types.values()) == 14
    # the stored blocks are llama.cpp's bytes for the (llama.cpp-ordered) float weights
    float_w = tiny(tie_embeddings=tie).layers[1].mlp.up_proj.weight.detach().numpy()
    stored = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight").data
    assert np.array_equal(
        np.asarray(stored).reshape(stored.shape[0], -1), gguf_quantize(float_w, QTYPE[qtype])
    )


def test_float_model_exported_as_q8_0_is_quantize_model_then_export(tmp_path):
    model = tiny(seed=1)
    a = save_gguf(model, tmp_path / "a.gguf", "q8_0")
    b = save_gguf(quantize_model(model, "q8_0"), tmp_path / "b.gguf", "q8_0")
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("qtype", ["f32", "f16"])
def test_float_export_reloads(tmp_path, qtype):
    model = tiny(seed=2)
    reloaded = load_pretrained(save_gguf(model, tmp_path / "m.gguf", qtype))
    reference = model
    if qtype == "f16":  # the file rounds every matrix to fp16; norms stay float32
        reference = tiny(seed=2)
        with torch.no_grad():
            for p in reference.parameters():
                if p.ndim == 2:
                    p.copy_(p.half().float())
    torch.testing.assert_close(logits(reloaded, ids()), logits(reference, ids()), rtol=0, atol=1e-5)
    types = {t.name: t.tensor_type for t in GGUFReader(tmp_path / "m.gguf").tensors}
    assert types["blk.0.ffn_gate.weight"] == QTYPE[qtype] and types["output_norm.weight"] == QT.F32


def test_qk_rows_are_in_llama_cpp_order(tmp_path):
    model = tiny(seed=3)
    path = save_gguf(model, tmp_path / "m.gguf", "f32")
    stored = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.attn_k.weight").data
    k = model.layers[0].attn.k_proj.weight.detach()
    assert not torch.equal(torch.from_numpy(np.array(stored)), k), "the rows must be permuted"
    assert torch.equal(unpermute_qk(torch.from_numpy(np.array(stored)), TINY["n_kv_heads"]), k)


def test_tokenizer_metadata_is_carried_over(tmp_path):
    source = tmp_path / "source.gguf"
    w = GGUFWriter(str(source), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(128)])
    w.add_token_merges(["t 1", "t 2"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{{ messages }}")
    w.add_name("source model")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = save_gguf(quantize_model(tiny(), "q4_1"), tmp_path / "m.gguf", "q4_1", source=source)
    ours = {
        k: f.contents()
        for k, f in GGUFReader(path).fields.items()
        if k.startswith(("tokenizer.", "general.name"))
    }
    theirs = {
        k: f.contents()
        for k, f in GGUFReader(source).fields.items()
        if k.startswith(("tokenizer.", "general.name"))
    }
    assert ours == theirs and len(ours) == 7


def test_qwen2_with_biases_exports_as_qwen2(tmp_path):
    model = tiny(qkv_bias=True, model_type="qwen2")
    with torch.no_grad():
        for block in model.layers:
            block.attn.q_proj.bias.normal_()
    path = save_gguf(model, tmp_path / "q.gguf", "f32")
    assert GGUFReader(path).fields["general.architecture"].contents() == "qwen2"
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_pretrained(path)(ids), model(ids), atol=1e-5, rtol=0)


def test_export_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown GGUF type 'q5_k'"):
        save_gguf(tiny(), tmp_path / "x.gguf", "q5_k")
    for overrides, variant in [
        (dict(sliding_window=8, model_type="mistral"), "sliding"),
        (dict(kv_share=2, model_type="cs336"), "cla"),
        (
            dict(
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=16,
                v_head_dim=16,
                model_type="deepseek_v3",
            ),
            "mla",
        ),
    ]:
        with pytest.raises(ValueError, match=f"this model is '{variant}'"):
            save_gguf(tiny(**overrides), tmp_path / "x.gguf", "f32")
    with pytest.raises(ValueError, match="no q/k/v biases"):  # llama.cpp's qwen2 has them (next test)
        save_gguf(tiny(qkv_bias=True, model_type="llama"), tmp_path / "x.gguf", "f32")
    int4 = quantize_model(tiny(), "int4")
    with pytest.raises(ValueError, match="stored as int4, which llama.cpp cannot read as q4_0"):
        save_gguf(int4, tmp_path / "x.gguf", "q4_0")
    with pytest.raises(ValueError, match="stored as llm_int8"):
        save_gguf(quantize_model(tiny(), "llm_int8"), tmp_path / "x.gguf", "q8_0")
    # any quantized model can still be written dequantized
    reloaded = load_pretrained(save_gguf(int4, tmp_path / "int4.gguf", "f32"))
    torch.testing.assert_close(logits(reloaded, ids()), logits(int4, ids()), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_smollm2_q8_0_export_round_trip(tmp_path):
    """The real model: quantize to Q8_0, export with its tokenizer, reload: same logits, same tokens."""
    from cs336_inference import load_tokenizer
    from cs336_inference.io.checkpoint import CheckpointError, default_model_path

    try:
        source = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    qmodel = quantize_model(load_pretrained(source), "q8_0")
    path = save_gguf(qmodel, tmp_path / "smollm2.q8_0.gguf", "q8_0", source=source)
    text = "def f(x):\n    return x ** 2  # Paris"
    assert load_tokenizer(path).encode(text) == load_tokenizer(source).encode(text)
    x = torch.tensor([load_tokenizer(source).encode(text)])
    reloaded = load_pretrained(path)  # Q8_0 read back as float32 weights: exactly the dequantized values
    for name, layer in qmodel.named_modules():
        if hasattr(layer, "dequantize") and hasattr(layer, "qweight"):
            w = reloaded.get_submodule(name).weight
            assert torch.equal(w, layer.dequantize()), f"{name}: the reloaded weight is not the Q8_0 values"
    # The two models multiply the same numbers in different orders (the Q8_0 kernel against a float
    # product), which over 30 layers moves logits of size ~20 by up to ~2e-4 (1.7e-4 measured on an AMD
    # EPYC); the exact check is the weights' above.
    expected, got = logits(qmodel, x), logits(reloaded, x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-3)
    assert torch.equal(got.argmax(-1), expected.argmax(-1)), "the reloaded model's greedy tokens differ"

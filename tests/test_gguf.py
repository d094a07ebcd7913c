"""GGUF reading: our block dequantization and parser against the `gguf` package (llama.cpp's own Python
code), a tiny GGUF written with gguf.GGUFWriter against its source model, and the real SmolLM2 file
against Hugging Face transformers."""

import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cs336_inference.config import ModelConfig
from cs336_inference.io import gguf_read as gguf_io
from cs336_inference.io.checkpoint import CheckpointError, default_model_path, load_pretrained
from cs336_inference.model import TransformerLM

BLOCK_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]


# ------------------------------------------------------------------ dequantization
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, *BLOCK_TYPES], ids=lambda q: q.name)
def test_dequantize_quantized_weights_matches_gguf(qtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((8, 128)) * rng.uniform(0.01, 3.0, size=(8, 1))).astype(np.float32)
    stored = gguf_quantize(x, qtype)
    ours = gguf_io.dequantize(stored, qtype)
    ref = gguf_dequantize(stored, qtype)
    assert ours.dtype == np.float32 and ours.shape == x.shape
    np.testing.assert_array_equal(ours, ref)
    # and it is a faithful copy of x, up to the format's rounding (a property, not a value)
    assert np.abs(ours - x).max() <= 0.2 * np.abs(x).max()


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_dequantize_random_blocks_matches_gguf(qtype):
    """Random bytes hit every nibble/int8 value; only the fp16 scale (and min) are made finite."""
    per_block, block_bytes = gguf_io.BLOCK_FORMATS[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(64, block_bytes), dtype=np.uint8)
    n_halves = 2 if qtype == QT.Q4_1 else 1
    halves = rng.uniform(-2, 2, size=(64, n_halves)).astype(np.float16)
    blocks[:, : 2 * n_halves] = halves.view(np.uint8)
    rows = blocks.reshape(4, -1)  # 4 rows of 16 blocks
    ours = gguf_io.dequantize(rows, qtype)
    np.testing.assert_array_equal(ours, gguf_dequantize(rows, qtype))
    assert ours.shape == (4, 16 * per_block)


def test_unsupported_tensor_type_is_named():
    with pytest.raises(CheckpointError, match="IQ2_XXS is not supported"):
        gguf_io.dequantize(np.zeros((1, 66), np.uint8), QT.IQ2_XXS)


# ------------------------------------------------------------------ a tiny llama GGUF
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: within each head, file row 2j + e takes
    HF row j + e * H/2 (its RoPE rotates adjacent pairs, HF's rotates the two halves)."""
    H = w.shape[0] // n_head
    return w.reshape(n_head, 2, H // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)


def tiny_llama(tie: bool, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(**TINY, tie_embeddings=tie, model_type="llama", rope_theta=5000.0, rms_norm_eps=1e-5)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # norms not all ones, so misrouting them shows
    return model


GGUF_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.q_proj.weight": "attn_q.weight",
    "attn.k_proj.weight": "attn_k.weight",
    "attn.v_proj.weight": "attn_v.weight",
    "attn.o_proj.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    top = {
        "embed.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def write_gguf(model: TransformerLM, path, qtype=QT.F32, permute=True, state=None) -> dict:
    """Write model as llama.cpp would; returns the weights as the file holds them (dequantized with
    the gguf package, Q/K rows in HF order) so a test can build the exact reference model."""
    cfg = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    stored = {}
    for name, t in (model.state_dict() if state is None else state).items():
        x = t.float().numpy()
        heads = {"attn.q_proj.weight": cfg.n_heads, "attn.k_proj.weight": cfg.n_kv_heads}.get(
            name.split(".", 2)[-1]
        )
        if permute and heads:
            x = llama_cpp_permute(x, heads)
        if x.ndim == 2 and qtype != QT.F32:  # llama.cpp keeps 1-d norms in float32
            q = gguf_quantize(x, qtype)
            w.add_tensor(gguf_name(name), q, raw_dtype=qtype)
            x = gguf_dequantize(q, qtype)
        else:
            w.add_tensor(gguf_name(name), x)
        if heads:  # back to HF order with the test's own inverse: file row 2j+e -> HF row j + e H/2
            H = x.shape[0] // heads
            x = x.reshape(heads, H // 2, 2, -1).swapaxes(1, 2).reshape(x.shape)
        stored[name] = torch.from_numpy(np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_tiny_gguf_f32_gives_the_source_logits(tmp_path, tie):
    model = tiny_llama(tie)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path)
    loaded = load_pretrained(path)
    assert loaded.config.tie_embeddings == tie and (loaded.lm_head is None) == tie
    assert (loaded.config.n_heads, loaded.config.n_kv_heads, loaded.config.rope_theta) == (4, 2, 5000.0)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=1e-5)


def test_qk_permutation_is_undone(tmp_path):
    """Negative control: a file whose Q/K rows were NOT permuted gives different logits once loaded,
    so the un-permutation in the loader really acts (and acts the right way round)."""
    model = tiny_llama(False, seed=1)
    write_gguf(model, tmp_path / "plain.gguf", permute=False)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (load_pretrained(tmp_path / "plain.gguf")(ids) - model(ids)).abs().max()
    assert diff > 1e-2


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_tiny_quantized_gguf_gives_the_dequantized_source_logits(tmp_path, qtype):
    model = tiny_llama(False, seed=2)
    stored = write_gguf(model, tmp_path / "q.gguf", qtype=qtype)
    reference = TransformerLM(model.config).eval()
    reference.load_state_dict(stored)  # the weights as gguf's own dequantizer reads the file
    loaded = load_pretrained(tmp_path / "q.gguf")
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), reference(ids), rtol=0, atol=1e-5)
        assert (loaded(ids) - model(ids)).abs().max() > 0  # quantization did round something


def test_parser_matches_gguf_reader(tmp_path):
    model = tiny_llama(False)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path, qtype=QT.Q4_1)
    ours = gguf_io.read_gguf(path)
    reader = GGUFReader(path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == fields
    assert sorted(ours.tensors) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        assert ours.tensors[t.name].qtype == t.tensor_type
        np.testing.assert_array_equal(
            ours.raw(t.name).reshape(-1).view(np.uint8), t.data.reshape(-1).view(np.uint8)
        )


# ------------------------------------------------------------------ bad files
def test_truncated_gguf_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_llama(False), path)
    data = path.read_bytes()
    cases = {
        "end": (data[:-100], "truncated GGUF file"),
        "header": (data[:200], "truncated GGUF file"),
        "empty": (b"", "empty"),
        "garbage": (b"this is not a model file at all", "not a GGUF file"),
    }
    for case, (content, words) in cases.items():
        bad = tmp_path / f"{case}.gguf"
        bad.write_bytes(content)
        with pytest.raises(CheckpointError, match=words) as e:
            load_pretrained(bad)
        assert "\n" not in str(e.value)


def test_missing_and_misshaped_gguf_tensors_are_named(tmp_path):
    model = tiny_llama(False)
    state = model.state_dict()
    del state["layers.1.mlp.up_proj.weight"]
    write_gguf(model, tmp_path / "missing.gguf", state=state)
    with pytest.raises(CheckpointError, match=r"missing tensor blk\.1\.ffn_up\.weight"):
        load_pretrained(tmp_path / "missing.gguf")
    state = model.state_dict()
    state["layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    write_gguf(model, tmp_path / "misshaped.gguf", state=state)
    with pytest.raises(
        CheckpointError, match=r"blk\.0\.ffn_down\.weight has shape \(64, 64\), expected \(64, 96\)"
    ):
        load_pretrained(tmp_path / "misshaped.gguf")


def test_non_llama_architecture_is_refused(tmp_path):
    w = GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        load_pretrained(tmp_path / "x.gguf")


# ------------------------------------------------------------------ the real SmolLM2 file
@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    pytest.importorskip("transformers", reason="transformers is needed as the reference")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging

    logging.disable_progress_bar()

    from cs336_inference.io.tokenizer import load_tokenizer

    ours = load_pretrained(path)
    # transformers' own GGUF path (config mapping, gguf's dequantizer, its Q/K un-permutation). This is
    # what AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) does, minus its need for accelerate.
    hf_cfg = LlamaConfig(num_hidden_layers=ours.config.n_layers)  # only used to name the tensors
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_cfg)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    hf_cfg = LlamaConfig.from_dict({k: v for k, v in parsed["config"].items() if not k.startswith("_")})
    hf_cfg._attn_implementation = "eager"
    ref = LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = ref.load_state_dict(parsed["tensors"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    ref.tie_weights()
    return ours, ref, load_tokenizer(path)


@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers(smollm2):
    ours, ref, tok = smollm2
    ids = torch.tensor([tok.encode("The capital of France is Paris, and the")])
    assert 8 <= ids.shape[1] <= 12
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    diff = (a - b).abs().max().item()
    print(f"SmolLM2 GGUF logits: max |ours - transformers| = {diff:.3g} (logits up to {b.abs().max():.1f})")
    assert diff < 1e-3


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    ours, _, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(prompt)
    start = time.time()
    with torch.no_grad():
        for _ in range(15):  # greedy decoding without a cache: the whole sequence every step
            nxt = int(ours(torch.tensor([ids]))[0, -1].argmax())
            ids.append(nxt)
            if nxt in tok.eos_token_ids:
                break
    answer = tok.decode(ids[len(tok.encode(prompt)) :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert time.time() - start < 20


def test_llama_cpp_decodes_our_f32_export_into_our_tokens(tmp_path):
    """llama.cpp (an implementation nobody here wrote; optional, `pip install llama-cpp-python`) reads
    the f32 GGUF we export of SmolLM2 (tokenizer copied from the source file) and decodes greedily the
    tokens our model decodes: the export is the benchmark's llama.cpp row's input."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional)")
    from llama_cpp import Llama

    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.sampling import generate

    try:
        source = default_model_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    ours = load_pretrained(source)
    save_gguf(ours, tmp_path / "f32.gguf", qtype="f32", source=source)
    llm = Llama(str(tmp_path / "f32.gguf"), n_ctx=128, n_threads=torch.get_num_threads(), verbose=False)
    from cs336_inference.io.tokenizer import load_tokenizer

    prompt = load_tokenizer(source).encode("The three largest cities of France are", add_special_tokens=False)
    llm.eval(prompt)
    theirs = []
    for _ in range(16):
        theirs.append(llm.sample(temp=0.0))
        llm.eval([theirs[-1]])
    expected = generate(ours, torch.tensor(prompt), 16, stop_token_ids=[]).tolist()
    assert theirs == expected, f"llama.cpp {theirs} vs ours {expected}"

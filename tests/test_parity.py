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
# case -> (variant it checks, problem, points)
CASES = {
    "llama_mha": ("mha", "transformer_lm", 3),
    "llama_gqa": ("gqa", "attention", 1),
    "llama_mqa": ("mqa", "attention", 1),
    "mistral_sliding": ("sliding", "sliding_window", 2),
    "qwen2_bias": ("gqa", "transformer_lm", 1),
    "qwen2_hybrid": ("hybrid", "sliding_window", 1),
    "deepseek_v3_mla": ("mla", "mla", 2),
    "deepseek_v3_mla_qlora": ("mla", "mla", 1),
}
TOL = 1e-4


def our_logits(case: str) -> tuple[np.ndarray, np.ndarray, object]:
    ref = np.load(REF / case / "logits.npz")
    model = load_pretrained(REF / case, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.from_numpy(ref["input_ids"])).numpy()
    return logits, ref, model


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.graded(problem=p, points=n)) for c, (_, p, n) in CASES.items()],
)
def test_logits_match_transformers(case):
    logits, ref, model = our_logits(case)
    assert model.config.variant == CASES[case][0]
    assert logits.shape == ref["logits"].shape
    diff = np.abs(logits - ref["logits"]).max()
    assert diff <= TOL, f"{case}: max |ours - transformers| = {diff:.2e} > {TOL}"


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

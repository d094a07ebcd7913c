"""The native step (fast/step/native.py, fast/cpu/step.c) on the layers it took last: llama.cpp's
K-quants (Q5_0, Q4_K, Q6_K times x quantized to 8 bits, decode.c's cs336_kq; a Q4_K_M model's q/k/v
mix formats and run as separate products) and Gemma 3's block (sandwich norms, GeGLU, the sliding
layers' own rotary table). Each against the model's own forward (the installed model, whose K-quant
layers are quantization/k8.py's numbers), for T = 1 and T > 1, and greedy tokens against generate."""

from pathlib import Path

import pytest
import torch

from cs336_inference import load_pretrained
from cs336_inference.config import ModelConfig
from cs336_inference.fast import install
from cs336_inference.fast.cpu import build
from cs336_inference.model import TransformerLM
from cs336_inference.quantization import QuantizedLinear, quantize_model
from cs336_inference.sampling import generate

REF = Path(__file__).resolve().parent.parent / "reference_weights"


@pytest.fixture(autouse=True)
def kernels():
    if build.library() is None:
        pytest.skip("the C kernels are not built here (CS336_KERNELS=0 or no compiler)")


def kquant_model(seed: int = 0) -> TransformerLM:
    """A Q4_K_M model with all three K-quant formats: d_model 256 takes q4_k / q6_k, d_ff 384 is no
    multiple of 256, so down_proj falls back to q5_0."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        vocab_size=300, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=64
    )
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        model.norm.weight.mul_(4.0)  # larger logits: greedy choices far from ties
    return install(quantize_model(model, "q4_k_m", quantize_head=True))


def gemma() -> TransformerLM:
    return load_pretrained(REF / "gemma3_local_global").eval()


def native_against_forward(model, T: int, label: str, resync: bool = False) -> list[float]:
    """The native T-token step (2 rows) against the cached forward of the same model, step after step
    (as tests/test_graphs.py and tests/test_families_downstream.py compare them); returns each step's
    largest difference. resync: the native cache takes the forward's K/V after each step, so that a
    step's difference is its own (K-quant layers quantize x to 8 bits: a float32 rounding that moves
    one of x's numbers across a rounding boundary moves the product by a step of x's blocks, which
    the cache would carry into every later step)."""
    from cs336_inference.fast.step.fixed import FixedStep

    S, V = 40, model.config.vocab_size
    prompt = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    diffs = []
    with torch.inference_mode():
        eager_cache, fixed_cache = model.new_cache(2, S, spare=S), model.new_cache(2, S, spare=S)
        model(prompt, cache=eager_cache)
        model(prompt, cache=fixed_cache)
        step = FixedStep(model, fixed_cache, "native", T=T)
        assert step.step.native is not None
        ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
        for t in range((S - 7) // T):
            want = model(ids, cache=eager_cache)
            got = step(ids).reshape(want.shape)
            diffs.append((got - want).abs().max().item())
            if not resync:
                torch.testing.assert_close(
                    got, want, rtol=1e-4, atol=1e-4, msg=lambda m, t=t: f"{label} {t}: {m}"
                )
            else:
                for a, b in zip(eager_cache.layers, fixed_cache.layers, strict=True):
                    b.k.copy_(a.k), b.v.copy_(a.v)
            ids = want[:, -T:].argmax(-1).reshape(2, T)
    return diffs


# ------------------------------------------------------------------ K-quants
def test_a_q4_k_m_model_has_every_k_quant_and_the_native_step_takes_it():
    from cs336_inference.fast.step.native import model_problem

    model = kquant_model()
    fmts = {m.fmt for m in model.modules() if isinstance(m, QuantizedLinear)}
    assert {"q5_0", "q4_k", "q6_k"} <= fmts, fmts
    assert model_problem(model) is None


@pytest.mark.parametrize("T", [1, 3, 5])
def test_the_native_step_on_k_quants_equals_the_installed_forward(T):
    """x quantized to 8 bits inside both, the rest (norms, attention) equal to float32 rounding, which
    moves one of x's 8-bit roundings now and then (native_against_forward): most steps agree to
    float32 rounding, the others by a step of x's quantization, far less than a wrong product."""
    diffs = native_against_forward(kquant_model(), T, f"q4_k_m T={T}", resync=True)
    close = sum(d <= 1e-4 for d in diffs)
    assert close >= 0.75 * len(diffs), f"T={T}: {close} of {len(diffs)} steps to float32 rounding: {diffs}"
    assert max(diffs) < 0.5, f"T={T}: a step's logits moved by {max(diffs):.3g} (logits ~15)"


def test_the_native_k_quant_steps_greedy_tokens_are_generate():
    from cs336_inference.fast.step.fixed import graph_generate, step_stream

    model = kquant_model()
    prompt = [5, 7, 11, 13, 2]
    want = generate(model, torch.tensor(prompt), 16, stop_token_ids=[]).tolist()
    got = graph_generate(model, torch.tensor(prompt), 16, mode="native").tolist()
    assert got == want
    assert list(step_stream(model, prompt, 16, mode="native", stop_token_ids=[])) == want


# ------------------------------------------------------------------ Gemma 3's block
def test_the_native_step_takes_gemmas_block():
    from cs336_inference.fast.step.native import model_problem

    model = gemma()
    block = model.layers[0]
    assert hasattr(block, "post_attn_norm") and any(b.attn.local_rope for b in model.layers)
    assert model_problem(install(model)) is None


@pytest.mark.parametrize("T", [1, 4])
def test_the_native_step_on_gemma_equals_the_cached_forward(T):
    native_against_forward(install(gemma()), T, f"gemma3 T={T}")


def test_the_native_gemma_steps_greedy_tokens_are_generate():
    from cs336_inference.fast.step.fixed import graph_generate, step_stream

    prompt = [3, 17, 42, 99, 5, 3, 17, 42, 7]
    want = generate(gemma(), torch.tensor(prompt), 24, stop_token_ids=[]).tolist()
    model = install(gemma())
    assert graph_generate(model, torch.tensor(prompt), 24, mode="native").tolist() == want
    assert list(step_stream(model, prompt, 24, mode="native", stop_token_ids=[])) == want


@pytest.mark.parametrize("case", ["gemma", "kquant"])
def test_speculative_decoding_in_native_steps_is_greedy_generate(case):
    """The model as its own draft, the target's verify passes (T = k + 1) in native fixed-shape steps."""
    from cs336_inference.fast.step.fixed import FixedSteps
    from cs336_inference.speculative import speculative_generate

    model = install(gemma()) if case == "gemma" else kquant_model()
    prompt = [3, 17, 42, 99, 5, 3, 17, 42, 7]
    want = generate(model, torch.tensor(prompt), 20, stop_token_ids=[]).tolist()
    got = speculative_generate(model, model, prompt, 20, k=3, stop_token_ids=[], steps=FixedSteps("native"))
    assert got.tolist() == want


def native_calls(monkeypatch) -> list[int]:
    """Rows of every engine step that ran natively (PagedStep.__call__), recorded."""
    from cs336_inference.fast.step import paged

    calls: list[int] = []
    run = paged.PagedStep.__call__

    def counted(self, input_ids, batch, *rest):
        calls.append(int(input_ids.shape[0]))
        return run(self, input_ids, batch, *rest)

    monkeypatch.setattr(paged.PagedStep, "__call__", counted)
    return calls


@pytest.mark.parametrize("case", ["gemma", "kquant"])
def test_the_engines_native_step_runs_gemma_and_k_quants(monkeypatch, case):
    """The serving engine's step over paged K/V (fast/step/paged.py: both of Gemma's rotary tables; the
    K-quant products) runs every step natively and gives generate's tokens (Gemma, to float32
    rounding; the K-quant model's x quantized the same way in both)."""
    from cs336_inference.sampling import SamplingParams
    from cs336_inference.serving import LLMEngine

    calls = native_calls(monkeypatch)
    model = install(gemma()) if case == "gemma" else kquant_model()
    V = model.config.vocab_size
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    prompts = [[t % V for t in p] for p in prompts]
    p = SamplingParams(max_new_tokens=16, stop_token_ids=())
    want = [generate(model, prompt, params=p).tolist() for prompt in prompts]
    engine = LLMEngine(model, num_blocks=24, block_size=4, max_batch_tokens=12)
    assert engine.generate(prompts, p) == want
    assert calls and len(calls) == engine.stats()["steps"]

"""The families people run (Llama 3.x rope scaling, Qwen3, Gemma 3, Phi-3, Phi-4-mini) as switches on the
one TransformerLM, against transformers on tiny random checkpoints it built and saved (made once by the
course staff, in reference_weights/): logits, greedy tokens of its `generate`, cached == naive, and
each switch's negative control (turned off, the logits must move)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cs336_inference import generate, load_pretrained
from cs336_inference.config import ConfigError, ModelConfig
from cs336_inference.io.checkpoint import save_pretrained

REF = Path(__file__).resolve().parents[1] / "reference_weights"
# case -> the switches it exercises
FAMILIES = {
    "llama3_rope": dict(rope_scaling="llama3", tie_embeddings=True),
    "llama_yarn": dict(rope_scaling="yarn"),
    "qwen3_qk_norm": dict(qk_norm=True),
    "gemma3_local_global": dict(sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=True),
    "gemma3_multimodal": dict(sandwich_norm=True, qk_norm=True),
    "phi3_fused": dict(partial_rotary_factor=1.0),
    "phi4_partial_rotary": dict(partial_rotary_factor=0.75, tie_embeddings=True),
}
TOL = 1e-4
PROMPT = [[3, 17, 42, 99, 5], [64, 1, 7, 88, 120]]
NEW = 22  # with the prompt past every sliding window (6) and rope's original window (16)


def reference(case: str) -> tuple[np.ndarray, np.ndarray]:
    ref = np.load(REF / case / "logits.npz")
    return ref["input_ids"], ref["logits"]


def max_diff(model, case: str) -> float:
    ids, want = reference(case)
    with torch.no_grad():
        got = model(torch.from_numpy(ids)).numpy()
    return float(np.nan_to_num(np.abs(got - want), nan=np.inf).max())


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_logits_match_transformers(case):
    model = load_pretrained(REF / case)
    cfg = model.config
    for field, want in FAMILIES[case].items():
        got = getattr(cfg, field)
        got = got["rope_type"] if field == "rope_scaling" else got
        assert got == want, f"{case}: config.{field} = {got!r}, expected {want!r}"
    diff = max_diff(model, case)
    assert diff <= TOL, f"{case}: max |ours - transformers| = {diff:.2e} > {TOL}"


# each switch turned off must move the logits far past the tolerance (the tests above cannot pass by accident)
CONTROLS = [
    ("llama3_rope", "rope_scaling", None),
    ("llama_yarn", "rope_scaling", None),
    ("qwen3_qk_norm", "qk_norm", False),
    ("gemma3_local_global", "rope_local_theta", None),
    ("gemma3_local_global", "rope_scaling", None),
    ("gemma3_local_global", "query_pre_attn_scalar", None),
    ("gemma3_local_global", "embed_scale", False),
    ("gemma3_local_global", "mlp_act", "silu"),
    ("phi4_partial_rotary", "partial_rotary_factor", 1.0),
]


@pytest.mark.parametrize(("case", "field", "off"), CONTROLS)
def test_each_switch_matters(case, field, off):
    model = load_pretrained(REF / case)
    cfg = ModelConfig.from_dict({**model.config.to_dict(), field: off})
    if field == "qk_norm":  # the norms' weights go with the switch
        state = {k: v for k, v in model.state_dict().items() if "q_norm" not in k and "k_norm" not in k}
    else:
        state = model.state_dict()
    other = type(model).empty(cfg)
    other.load_state_dict(state)
    assert max_diff(other, case) > 100 * TOL, f"{case}: logits do not depend on {field}"


def test_gemma_window_is_shorter_than_the_sequence_and_layers_mix():
    cfg = load_pretrained(REF / "gemma3_local_global").config
    T = reference("gemma3_local_global")[0].shape[1]
    assert cfg.sliding_window < T and set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert cfg.rope_local_theta != cfg.rope_theta and cfg.n_heads * cfg.head_dim != cfg.d_model


@pytest.mark.parametrize("case", list(FAMILIES))
def test_greedy_tokens_match_transformers_generate(case):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        REF / case, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompt = torch.tensor(PROMPT)
    with torch.no_grad():
        want = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[:, prompt.shape[1] :]  # fmt: skip
    model = load_pretrained(REF / case)
    got = [t.tolist() for t in generate(model, prompt, NEW, temperature=0.0, stop_token_ids=[])]
    naive = [t.tolist() for t in generate(model, prompt, NEW, stop_token_ids=[], use_cache=False)]
    assert got == naive, f"{case}: cached tokens {got} != naive {naive}"
    assert got == want.tolist(), f"{case}: ours {got} != transformers' generate {want.tolist()}"


@pytest.mark.parametrize("case", list(FAMILIES))
def test_save_pretrained_round_trip_is_the_family_format(case, tmp_path):
    """Saved back in the family's own format (Phi-3 fused, Gemma's norms as w), loaded to the same logits."""
    model = load_pretrained(REF / case)
    save_pretrained(model, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    want_type = (
        "gemma3_text"
        if case.startswith("gemma3")
        else json.loads((REF / case / "config.json").read_text())["model_type"]
    )
    assert saved["model_type"] == want_type, f"{case}: saved as {saved['model_type']}"
    assert max_diff(load_pretrained(tmp_path), case) <= TOL


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"hidden_activation": "gelu", "hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ],
)
def test_unsupported_fields_are_one_line_naming_the_field(change, field):
    base = json.loads((REF / ("phi4_partial_rotary" if "partial" in field else "gemma3_local_global")).joinpath(
        "config.json"
    ).read_text())  # fmt: skip
    if field in ("longrope", "low_freq_factor", "mlp_bias"):
        base = json.loads((REF / "llama3_rope" / "config.json").read_text())
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_hf({**base, **change})
    message = str(err.value)
    assert field in message and "\n" not in message, message


@pytest.mark.parametrize("case", list(FAMILIES))
@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_gguf_export_then_import_gives_the_same_logits(case, qtype, tmp_path):
    """Written in the family's llama.cpp architecture (gemma3's query scale 1/sqrt(H) as llama.cpp
    assumes; llama3 scaling as a rope_freqs tensor), read back by our loader and by the gguf package."""
    from gguf import GGUFReader

    from cs336_inference.io.gguf_write import architecture, save_gguf
    from cs336_inference.quantization import quantize_model

    model = load_pretrained(REF / case)
    if case.startswith("gemma3"):  # llama.cpp fixes the scale to 1/sqrt(H); the checkpoint's is 1/sqrt(20)
        model.config.query_pre_attn_scalar = float(model.config.head_dim)
        for block in model.layers:
            block.attn.scale = model.config.attn_scale
    path = save_gguf(model, tmp_path / "m.gguf", qtype=qtype)
    arch = GGUFReader(path).fields["general.architecture"].contents()
    assert (
        arch
        == architecture(model.config)
        == {"gemma3_text": "gemma3"}.get(model.config.model_type, model.config.model_type)
    )
    back = load_pretrained(path)
    want = model if qtype == "f32" else quantize_model(model, qtype)
    ids = torch.from_numpy(reference(case)[0])
    with torch.no_grad():
        diff = (back(ids) - want(ids)).abs().max().item()
    assert diff <= TOL, f"{case} {qtype}: GGUF round trip moved the logits by {diff:.2e}"


@pytest.mark.parametrize("case", ["phi3_fused", "gemma3_multimodal", "qwen3_qk_norm"])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_load_sharded_reads_what_cutting_the_whole_model_gives(case, source, tmp_path):
    """Tensor parallelism's loader (io/shards.py) on each family's own layout: Phi-3's fused tensors,
    Gemma's shifted norms and multimodal names, in the folder and in the GGUF export."""
    from simulated_ranks import on_ranks

    from cs336_inference.io.gguf_write import save_gguf
    from cs336_inference.parallel import load_sharded, shard_model

    path = REF / case
    if source == "gguf":
        model = load_pretrained(path)
        if case.startswith("gemma3"):
            model.config.query_pre_attn_scalar = float(model.config.head_dim)
        path = save_gguf(model, tmp_path / "m.gguf", qtype="f32")
    whole = load_pretrained(path)

    def compare(rank: int) -> list[str]:
        a, b = load_sharded(path).local.state_dict(), shard_model(whole).local.state_dict()
        return [name for name in a if not torch.equal(a[name], b[name])]

    for rank, differ in enumerate(on_ranks(2, compare)):
        assert not differ, f"{case} {source}, rank {rank}: load_sharded differs in {differ[:3]}"

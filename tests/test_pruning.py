"""Structured pruning against things that cannot hold by accident: a pruned model equals the original
with the removed units masked out (head outputs zeroed, neuron activations zeroed, layers skipped, or
residual channels that are zero everywhere), planted dead units rank last and go first, the scores
equal loop-by-loop re-statements of their definitions, and transformers reads a pruned checkpoint
with the same logits."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.io.checkpoint import save_pretrained
from cs336_inference.pruning import (
    Importance,
    block_importance,
    channel_importance,
    head_importance,
    importance_scores,
    neuron_importance,
    prune,
    slice_model_state,
)

TINY = dict(
    vocab_size=96, d_model=48, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=40, max_seq_len=64
)
VARIANTS = {
    "gqa": dict(model_type="llama"),
    "mha": dict(model_type="llama", n_kv_heads=6),
    "mqa": dict(model_type="llama", n_kv_heads=1),
    "qwen2_bias": dict(model_type="qwen2", qkv_bias=True),
    "sliding": dict(model_type="mistral", sliding_window=4),
    "hybrid": dict(
        model_type="cs336",
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    ),
    "tied": dict(model_type="llama", tie_embeddings=True),
}
MLA = dict(
    model_type="deepseek_v3",
    n_kv_heads=6,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
CLA = dict(model_type="cs336", kv_share=2)


def tiny(variant: str = "gqa", seed: int = 0, **over) -> TransformerLM:
    extra = {"mla": MLA, "cla": CLA}.get(variant) or VARIANTS[variant]
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**TINY, **extra, **over})).eval()
    with torch.no_grad():  # norms and biases start as ones/zeros: make them random so a lost one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids(B: int = 2, T: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


def random_scores(cfg: ModelConfig, seed: int = 3) -> Importance:
    g = torch.Generator().manual_seed(seed)
    L = cfg.n_layers
    return Importance(
        heads=torch.rand(L, cfg.n_heads, generator=g),
        neurons=torch.rand(L, cfg.d_ff, generator=g),
        channels=torch.rand(cfg.d_model, generator=g),
        layers=torch.rand(L, generator=g),
    )


def top(scores: torch.Tensor, k: int) -> list[int]:
    """The k highest scores' indices, by plain Python sorting (ties cannot occur with random scores)."""
    return sorted(sorted(range(len(scores)), key=lambda i: -float(scores[i]))[:k])


def masked_logits(
    model: TransformerLM, x: torch.Tensor, heads=None, neurons=None, layers=None
) -> torch.Tensor:
    """The original model's logits with units masked: heads[l] / neurons[l] = kept indices of layer l
    (others zeroed at the input of o_proj / down_proj), layers = kept layers (others skipped)."""
    model = copy.deepcopy(model)
    cfg = model.config
    hooks = []
    for i, block in enumerate(model.layers):
        if heads is not None:
            mask = torch.zeros(cfg.n_heads, cfg.head_dim)
            mask[heads[i]] = 1.0
            mask = mask.flatten()
            hooks.append(block.attn.o_proj.register_forward_pre_hook(lambda m, a, k=mask: (a[0] * k,)))
        if neurons is not None:
            mask = torch.zeros(cfg.d_ff)
            mask[neurons[i]] = 1.0
            hooks.append(block.mlp.down_proj.register_forward_pre_hook(lambda m, a, k=mask: (a[0] * k,)))
    if layers is not None:
        model.layers = nn.ModuleList(model.layers[i] for i in layers)
    with torch.no_grad():
        return model(x)


def close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 2e-5) -> None:
    got, want = got.detach(), want.detach()
    err = (got - want).abs()
    assert err.max() <= atol, (
        f"{what}: logits differ by up to {float(err.max()):.3g} (allowed {atol}) at position "
        f"{tuple(int(i) for i in torch.nonzero(err == err.max())[0])}: expected {float(want[err == err.max()][0]):.6f}, "
        f"got {float(got[err == err.max()][0]):.6f}"
    )


# ------------------------------------------------------------------ importance (graded)
@pytest.mark.graded(problem="importance", points=2)
def test_unit_scores_equal_their_definitions():
    g = torch.Generator().manual_seed(0)
    B, T, N, H, Fd, D = 2, 5, 3, 4, 6, 7
    head_out = torch.randn(B, T, N, H, generator=g)
    want = [
        sum(
            math.sqrt(sum(float(head_out[b, t, n, h]) ** 2 for h in range(H)))
            for b in range(B)
            for t in range(T)
        )
        / (B * T)
        for n in range(N)
    ]
    got = head_importance(head_out)
    assert got.shape == (N,), f"head_importance: expected shape ({N},), got {tuple(got.shape)}"
    for n in range(N):
        assert abs(float(got[n]) - want[n]) < 1e-5, (
            f"head_importance head {n}: expected {want[n]:.6f} (mean L2 norm over tokens), got {float(got[n]):.6f}"
        )

    gate, up = torch.randn(B, T, Fd, generator=g), torch.randn(B, T, Fd, generator=g)
    got = neuron_importance(gate, up)
    assert got.shape == (Fd,), f"neuron_importance: expected shape ({Fd},), got {tuple(got.shape)}"
    for f in range(Fd):
        vals = [
            abs(float(gate[b, t, f]) / (1 + math.exp(-float(gate[b, t, f]))) * float(up[b, t, f]))
            for b in range(B)
            for t in range(T)
        ]
        want_f = sum(vals) / len(vals)
        assert abs(float(got[f]) - want_f) < 1e-5, (
            f"neuron_importance neuron {f}: expected mean |silu(gate)*up| = {want_f:.6f}, got {float(got[f]):.6f}"
        )

    normed = torch.randn(B, T, D, generator=g)
    got = channel_importance(normed)
    assert got.shape == (D,), f"channel_importance: expected shape ({D},), got {tuple(got.shape)}"
    for d in range(D):
        want_d = sum(abs(float(normed[b, t, d])) for b in range(B) for t in range(T)) / (B * T)
        assert abs(float(got[d]) - want_d) < 1e-5, (
            f"channel_importance channel {d}: expected mean |x| = {want_d:.6f}, got {float(got[d]):.6f}"
        )

    x_in, x_out = torch.randn(B, T, D, generator=g), torch.randn(B, T, D, generator=g)
    coss = []
    for b in range(B):
        for t in range(T):
            a, c = x_in[b, t].tolist(), x_out[b, t].tolist()
            dot = sum(p * q for p, q in zip(a, c, strict=True))
            coss.append(dot / math.sqrt(sum(p * p for p in a) * sum(q * q for q in c)))
    want_bi = 1 - sum(coss) / len(coss)
    got_bi = float(block_importance(x_in, x_out))
    assert abs(got_bi - want_bi) < 1e-5, (
        f"block_importance: expected 1 - mean cos = {want_bi:.6f}, got {got_bi:.6f}"
    )
    assert abs(float(block_importance(x_in, 3.0 * x_in))) < 1e-6, (
        "block_importance of a block that only scales x must be 0"
    )


def planted_model() -> tuple[TransformerLM, dict]:
    """A GQA model (6 query heads, 2 K/V heads) with dead units planted by zeroing weights."""
    model = tiny("gqa")
    dead = {"kv_head": (1, 0), "neurons": (2, [5, 17, 33]), "channels": [3, 20, 41], "layer": 2}
    H = model.config.head_dim
    with torch.no_grad():
        layer, kv = dead["kv_head"]  # a dead K/V head: its values are zero, so its 3 query heads output 0
        model.layers[layer].attn.v_proj.weight[kv * H : (kv + 1) * H] = 0
        layer, neurons = dead["neurons"]
        model.layers[layer].mlp.gate_proj.weight[neurons] = 0
        model.layers[layer].mlp.up_proj.weight[neurons] = 0
        model.embed.weight[:, dead["channels"]] = 0  # channels nothing writes: zero in the residual stream
        for block in model.layers:
            block.attn.o_proj.weight[dead["channels"]] = 0
            block.mlp.down_proj.weight[dead["channels"]] = 0
        block = model.layers[dead["layer"]]  # a block that adds nothing: x_out = x_in
        block.attn.o_proj.weight.zero_()
        block.mlp.down_proj.weight.zero_()
    return model, dead


@pytest.mark.graded(problem="importance", points=2)
def test_planted_dead_units_rank_last():
    model, dead = planted_model()
    s = importance_scores(model, ids(B=3, T=16))
    layer, kv = dead["kv_head"]
    group = list(range(kv * 3, kv * 3 + 3))
    assert set(s.heads[layer].argsort()[:3].tolist()) == set(group), (
        f"layer {layer}: the query heads {group} of the dead K/V head {kv} must have the lowest scores, "
        f"got {[round(float(v), 4) for v in s.heads[layer]]}"
    )
    layer, neurons = dead["neurons"]
    lowest = set(s.neurons[layer].argsort()[: len(neurons)].tolist())
    assert lowest == set(neurons), (
        f"layer {layer}: dead neurons {neurons} must score lowest, the lowest are {sorted(lowest)}"
    )
    lowest = set(s.channels.argsort()[: len(dead["channels"])].tolist())
    assert lowest == set(dead["channels"]), (
        f"dead channels {dead['channels']} must score lowest, the lowest are {sorted(lowest)}"
    )
    assert int(s.layers.argmin()) == dead["layer"], (
        f"layer {dead['layer']} adds nothing to the residual stream and must have the lowest block "
        f"importance, got {[round(float(v), 4) for v in s.layers]}"
    )


def test_prune_removes_planted_dead_units_first():
    model, dead = planted_model()
    x = ids()
    s = importance_scores(model, ids(B=3, T=16), layer_ppl=True)
    small = prune(model, n_layers=3, scores=s)  # the dead layer goes first
    close(small(x), masked_logits(model, x, layers=[0, 1, 3]), "dropping the dead layer", 1e-5)
    assert abs(float(s.layer_ppl[dead["layer"]])) < 1e-3, (
        "skipping a block that adds nothing must not change perplexity"
    )
    # dead channels: removing them is exact (with prune's norm rescaling)
    small = prune(model, d_model=45, scores=s)
    with torch.no_grad():
        close(small(x), model(x), "removing the three dead channels", 1e-5)
    # the dead neurons, and the dead K/V group (all its 3 query heads)
    small = prune(model, d_ff=37, n_heads=3, scores=s)
    assert small.config.n_kv_heads == 1
    heads = [list(range(6))] * 4
    heads[dead["kv_head"][0]] = [3, 4, 5] if dead["kv_head"][1] == 0 else [0, 1, 2]
    kept_heads = [top(s.heads[i].view(2, 3).sum(-1), 1)[0] for i in range(4)]
    heads = [list(range(k * 3, k * 3 + 3)) for k in kept_heads]
    assert kept_heads[dead["kv_head"][0]] != dead["kv_head"][1]
    neurons = [top(s.neurons[i], 37) for i in range(4)]
    assert not set(dead["neurons"][1]) & set(neurons[dead["neurons"][0]])
    close(
        small(x), masked_logits(model, x, heads=heads, neurons=neurons), "removing the dead group and neurons"
    )


# ------------------------------------------------------------------ slicing (graded)
@pytest.mark.graded(problem="prune_slice", points=2)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_keeping_everything_gives_identical_logits(variant):
    model = tiny(variant)
    small = prune(model, n_layers=4, n_heads=6, d_ff=40, d_model=48, scores=random_scores(model.config))
    x = ids()
    with torch.no_grad():
        want, got = model(x), small(x)
    assert small is not model and small.config.to_dict() == model.config.to_dict(), (
        f"{variant}: config changed"
    )
    assert torch.equal(got, want), (
        f"{variant}: keeping every unit changed the logits by {float((got - want).abs().max()):.3g}"
    )


@pytest.mark.graded(problem="prune_slice", points=3)
@pytest.mark.parametrize("variant", ["gqa", "mha", "qwen2_bias", "hybrid"])
def test_removing_heads_and_neurons_equals_masking_them(variant):
    model = tiny(variant)
    cfg = model.config
    s = random_scores(cfg)
    x = ids()
    G = cfg.n_heads // cfg.n_kv_heads
    n_heads = 3 if G in (1, 3) else G
    small = prune(model, n_heads=n_heads, d_ff=23, scores=s)
    assert small.config.n_heads == n_heads and small.config.d_ff == 23
    heads = []
    for i in range(cfg.n_layers):
        groups = top(s.heads[i].view(cfg.n_kv_heads, G).sum(-1), n_heads // G)
        heads.append([k * G + g for k in groups for g in range(G)])
    neurons = [top(s.neurons[i], 23) for i in range(cfg.n_layers)]
    with torch.no_grad():
        close(
            small(x),
            masked_logits(model, x, heads=heads, neurons=neurons),
            f"{variant}: heads {heads}, 23 neurons",
        )


@pytest.mark.graded(problem="prune_slice", points=1)
def test_removing_query_heads_within_groups_equals_masking_them():
    model = tiny("mqa")
    s = random_scores(model.config)
    small = prune(model, n_heads=2, scores=s, head_mode="within")
    assert (small.config.n_heads, small.config.n_kv_heads) == (2, 1)
    heads = [top(s.heads[i], 2) for i in range(4)]
    x = ids()
    close(small(x), masked_logits(model, x, heads=heads), f"MQA keeping query heads {heads}")


@pytest.mark.graded(problem="prune_slice", points=2)
@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_removing_zero_channels_is_exact(variant):
    """Channels that are zero in the residual stream (embedding columns, o_proj and down_proj rows):
    RMSNorm's sum of squares is unchanged, and prune's gain sqrt(D/D') and eps * D/D' restore the mean
    over D, so the logits are the original's."""
    model = tiny(variant)
    dead = [0, 7, 8, 30, 47]
    with torch.no_grad():
        model.embed.weight[:, dead] = 0
        for block in model.layers:
            block.attn.o_proj.weight[dead] = 0
            block.mlp.down_proj.weight[dead] = 0
    s = random_scores(model.config)
    s.channels[dead] = -1.0
    small = prune(model, d_model=43, n_layers=3, scores=s)
    x = ids()
    kept = top(s.layers, 3)
    close(
        small(x),
        masked_logits(model, x, layers=kept),
        f"{variant}: removing zero channels {dead} and a layer",
    )


def test_without_norm_rescaling_zero_channels_are_not_free():
    """The negative control for the test above: slicing alone changes RMSNorm's mean (D' instead of D)."""
    model = tiny("gqa")
    dead = [0, 7, 8, 30, 47]
    with torch.no_grad():
        model.embed.weight[:, dead] = 0
        for block in model.layers:
            block.attn.o_proj.weight[dead] = 0
            block.mlp.down_proj.weight[dead] = 0
    s = random_scores(model.config)
    s.channels[dead] = -1.0
    small = prune(model, d_model=43, scores=s)
    naive = TransformerLM(
        small.config.__class__(**{**small.config.to_dict(), "rms_norm_eps": model.config.rms_norm_eps})
    ).eval()
    from cs336_inference.pruning import Keep

    keep = Keep(
        list(range(4)),
        [torch.arange(6)] * 4,
        [torch.arange(2)] * 4,
        [torch.arange(40)] * 4,
        torch.tensor(top(s.channels, 43)),
    )
    naive.load_state_dict(slice_model_state(model, keep))
    x = ids()
    with torch.no_grad():
        assert (naive(x) - model(x)).abs().max() > 1e-2


@pytest.mark.graded(problem="prune_slice", points=1)
@pytest.mark.parametrize("variant", ["gqa", "sliding", "hybrid"])
def test_removing_layers_equals_skipping_them(variant):
    model = tiny(variant)
    x = ids(T=14)  # longer than the window (4)
    small = prune(model, layers=[0, 3])
    if model.config.layer_types is not None:
        assert small.config.layer_types == [model.config.layer_types[0], model.config.layer_types[3]]
    close(small(x), masked_logits(model, x, layers=[0, 3]), f"{variant}: keeping layers 0 and 3")


# ------------------------------------------------------------------ MLA, CLA, bad input (given code)
def test_mla_prunes_layers_and_mlp_cla_prunes_widths():
    model = tiny("mla")
    s = random_scores(model.config)
    small = prune(model, n_layers=2, d_ff=20, scores=s)
    neurons = [top(s.neurons[i], 20) for i in range(4)]
    x = ids()
    # masked reference: neurons in every layer, then only the kept layers
    kept = top(s.layers, 2)
    ref = copy.deepcopy(model)
    for i, block in enumerate(ref.layers):
        mask = torch.zeros(40)
        mask[neurons[i]] = 1
        block.mlp.down_proj.register_forward_pre_hook(lambda m, a, k=mask: (a[0] * k,))
    ref.layers = nn.ModuleList(ref.layers[i] for i in kept)
    with torch.no_grad():
        close(small(x), ref(x), "MLA: 2 layers, 20 neurons")
    with pytest.raises(ValueError, match="MLA"):
        prune(model, n_heads=3, scores=s)
    cla = tiny("cla")
    s = random_scores(cla.config)
    small = prune(cla, d_ff=20, d_model=40, scores=s)
    assert small.config.kv_share == 2 and small(x).shape == (2, 12, 96)
    with pytest.raises(ValueError, match="CLA"):
        prune(cla, n_layers=2, scores=s)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(n_layers=0), "n_layers must be >= 1"),
        (dict(n_heads=0), "n_heads must be >= 1"),
        (dict(d_ff=0), "d_ff must be >= 1"),
        (dict(n_heads=4), "breaks the GQA grouping"),
        (dict(n_heads=3, head_mode="within"), "breaks the GQA grouping"),
        (dict(n_layers=5), "larger than the original"),
        (dict(d_model=64), "larger than the original"),
        (dict(layers=[]), "layers must be distinct"),
        (dict(layers=[1, 1]), "layers must be distinct"),
        (dict(layers=[7]), "layers must be distinct"),
        (dict(n_layers=2.5), "must be an integer"),
        (dict(head_mode="rows"), "head_mode"),
    ],
)
def test_bad_targets_raise_one_clear_error(kwargs, words):
    model = tiny("gqa")
    with pytest.raises(ValueError, match=words):
        prune(model, scores=random_scores(model.config), **kwargs)


def test_bad_calibration_and_missing_scores():
    model = tiny("gqa")
    with pytest.raises(ValueError, match="needs scores"):
        prune(model, n_layers=2)
    with pytest.raises(ValueError, match="calib_ids"):
        importance_scores(model, torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="calib_ids must lie"):
        importance_scores(model, torch.tensor([[1, 500]]))
    small = prune(model, n_layers=2, calib_ids=ids())  # calibrates itself
    assert small.config.n_layers == 2


def test_scores_do_not_depend_on_batching():
    model = tiny("gqa")
    x = ids(B=4, T=10)
    a, b = importance_scores(model, x, batch_size=4), importance_scores(model, x, batch_size=1)
    for name in ("heads", "neurons", "channels", "layers"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-5, atol=1e-6)


def test_original_is_untouched_and_pruned_is_smaller():
    model = tiny("gqa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    small = prune(model, n_layers=2, n_heads=3, d_ff=20, d_model=32, scores=random_scores(model.config))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert small.num_parameters() < model.num_parameters()
    assert {p.data_ptr() for p in small.parameters()}.isdisjoint({p.data_ptr() for p in model.parameters()})


# ------------------------------------------------------------------ a real checkpoint
@pytest.mark.parametrize("variant", ["gqa", "tied", "qwen2_bias", "sliding"])
def test_transformers_loads_a_pruned_folder_with_our_logits(tmp_path, variant):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    model = tiny(variant)
    # transformers' Llama config insists on hidden_size % num_attention_heads == 0 (even with head_dim)
    small = prune(model, n_layers=3, n_heads=3, d_ff=24, d_model=39, scores=random_scores(model.config))
    save_pretrained(small, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    x = ids(T=14)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, small(x), rtol=0, atol=1e-4)


def test_pruned_model_generates_with_a_cache():
    from cs336_inference.sampling import generate

    model = tiny("hybrid")
    small = prune(model, n_layers=3, d_ff=20, d_model=40, scores=random_scores(model.config))
    prompt = ids(B=1, T=6)[0]
    cached = generate(small, prompt, max_new_tokens=8, use_cache=True, stop_token_ids=[])
    naive = generate(small, prompt, max_new_tokens=8, use_cache=False, stop_token_ids=[])
    assert torch.equal(cached, naive)
    assert F.softmax(small(prompt[None]), -1).isfinite().all()

"""Structured pruning (the Minitron recipe): rank units on calibration activations, slice them out.

    1. importance_scores(model, calib_ids)   one instrumented pass over a little calibration text
         heads     mean over tokens of ||head output||_2 (attention output of the head, before o_proj)
         neurons   mean over tokens of |silu(gate) * up|, per MLP neuron
         channels  mean over tokens of |RMSNorm(x)|, per model channel, averaged over every norm of D
         layers    block importance 1 - cos(x_in, x_out) (a block that barely turns x is cheap to drop),
                   and, if asked, the perplexity increase on the calibration text when it is skipped
    2. prune(model, n_layers=..., n_heads=..., d_ff=..., d_model=...)   a NEW, smaller TransformerLM
         with a valid config and weights sliced from the original; every layer keeps the same counts.
    3. distill the original into it (distill.py).

Grouped-query attention: a K/V head serves G = N/K query heads, and pruning keeps the grouping
uniform. head_mode="groups" (default) removes whole groups (a K/V head with all its G query heads):
n_heads must be a multiple of G and K' = n_heads / G. head_mode="within" keeps every K/V head and
the n_heads / K most important query heads of each group (n_heads a multiple of K; the only way to
prune MQA's heads). Groups are ranked by the summed importance of their query heads.

Model width: removing channels shrinks what RMSNorm averages over, mean(x^2) over D' instead of D.
prune rescales so that the pruned model computes exactly what the original computes when the removed
channels of the residual stream are zero: rms' = sqrt(S/D' + eps') equals sqrt(D/D') * rms if
eps' = eps * D/D', so every norm of width D gets its gain times sqrt(D/D') and rms_norm_eps becomes
eps * D/D' (when the removed channels are small but not zero, this is the closest rescaling).

Variants: MHA / GQA / MQA / sliding / hybrid take every axis (layer_types follow the kept layers).
MLA takes layers and d_ff (its heads live in a low-rank kv_b_proj, and its latent norms do not see
D). CLA takes d_ff and d_model (removing a layer or a head would change what other layers of its
sharing group read). The other axes raise a ValueError.

The families' switches (config.py) prune as follows. QK-norm's q_norm / k_norm weigh the H dims of a
head and are shared by all heads: kept whole by head pruning (and by d_model pruning, though their eps
is the config's one rms_norm_eps, which becomes eps * D/D' too: a change of eps (D/D' - 1) next to a
head's mean square, not exact). Gemma 3's sandwich norms (post_attn_norm, post_mlp_norm) normalize a
branch's output over D: cut with the channels and rescaled like the other norms (exact for zero
channels, as the branch's output is zero there too). GeGLU's neurons are scored by
|gelu_tanh(gate) * up|, what they feed down_proj. Partial rotary and an explicit head_dim (N x H != D)
keep H, so the rotary dims are those of the original. Gemma's embeddings times sqrt(D) (embed_scale):
d_model is refused, since the pruned model would multiply by sqrt(D') (its config has no other
scale); every other axis prunes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float, Int
from torch import Tensor, nn

from .config import ModelConfig
from .layers import GeGLU
from .model import TransformerLM


# ------------------------------------------------------------------ importance of one activation
def head_importance(head_out: Float[Tensor, "B T N H"]) -> Float[Tensor, " N"]:
    """Mean over the B*T tokens of the L2 norm (over H) of each head's attention output."""
    # BEGIN SOLUTION importance
    return head_out.float().norm(dim=-1).mean(dim=(0, 1))
    # END SOLUTION


def neuron_importance(gate: Float[Tensor, "B T F"], up: Float[Tensor, "B T F"]) -> Float[Tensor, " F"]:
    """Mean over the B*T tokens of |silu(gate) * up|, the activation each MLP neuron feeds down_proj.

    gate and up are the outputs of gate_proj and up_proj (before the silu)."""
    # BEGIN SOLUTION importance
    return (F.silu(gate.float()) * up.float()).abs().mean(dim=(0, 1))
    # END SOLUTION


def channel_importance(normed: Float[Tensor, "B T D"]) -> Float[Tensor, " D"]:
    """Mean over the B*T tokens of |x| per channel, x the output of an RMSNorm of the residual stream."""
    # BEGIN SOLUTION importance
    return normed.float().abs().mean(dim=(0, 1))
    # END SOLUTION


def block_importance(x_in: Float[Tensor, "B T D"], x_out: Float[Tensor, "B T D"]) -> float:
    """1 - mean over the B*T tokens of cos(x_in, x_out): how much a block turns the residual stream.

    0 for a block that only scales it (or does nothing); cosine over D, computed in float32."""
    # BEGIN SOLUTION importance
    cos = F.cosine_similarity(x_in.float(), x_out.float(), dim=-1)
    return float(1.0 - cos.mean())
    # END SOLUTION


# ------------------------------------------------------------------ the instrumented pass
@dataclass
class Importance:
    """Scores of every prunable unit (higher = more important), from `importance_scores`."""

    heads: Float[Tensor, "L N"]
    neurons: Float[Tensor, "L F"]
    channels: Float[Tensor, " D"]
    layers: Float[Tensor, " L"]  # block importance, 1 - cos(x_in, x_out)
    layer_ppl: Float[Tensor, " L"] | None = (
        None  # calibration perplexity with the layer skipped, minus without
    )


def _check_ids(model: TransformerLM, ids: Tensor) -> Tensor:
    if not isinstance(ids, Tensor) or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("calib_ids must be an integer tensor of token ids, [B, T] or [T]")
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"calib_ids must be [B, T] with T >= 2, got shape {tuple(ids.shape)}")
    V = model.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= V:
        raise ValueError(f"calib_ids must lie in 0..{V - 1}")
    return ids.to(model.embed.weight.device)


@torch.no_grad()
def importance_scores(
    model: TransformerLM, calib_ids: Int[Tensor, "B T"], batch_size: int = 4, layer_ppl: bool = False
) -> Importance:
    """Run calib_ids through the model (batch_size rows at a time) with forward hooks that feed each
    activation to the functions above; every score is a mean over all calibration tokens.

    layer_ppl=True also measures, for every layer, the calibration perplexity with that layer skipped
    minus the full model's (L more forward passes; not available for CLA)."""
    ids = _check_ids(model, calib_ids)
    cfg = model.config
    sums: dict[str, list] = {"heads": [], "neurons": [], "channels": [], "layers": []}
    hooks = []
    batch: dict = {}

    def on_o_proj(module, args):
        batch["heads"].append(head_importance(rearrange(args[0], "b t (n h) -> b t n h", n=cfg.n_heads)))

    def on_mlp(module, args):
        x = args[0]
        gate, up = module.gate_proj(x), module.up_proj(x)
        if isinstance(module, GeGLU):  # Gemma: a neuron feeds gelu_tanh(gate) * up to down_proj
            act = F.gelu(gate.float(), approximate="tanh") * up.float()
            batch["neurons"].append(act.abs().mean(dim=(0, 1)))
        else:
            batch["neurons"].append(neuron_importance(gate, up))

    def on_norm(module, args, out):
        batch["channels"].append(channel_importance(out))

    def on_block(module, args, out):
        batch["layers"].append(block_importance(args[0], out))

    for block in model.layers:
        hooks.append(block.attn.o_proj.register_forward_pre_hook(on_o_proj))
        hooks.append(block.mlp.register_forward_pre_hook(on_mlp))
        hooks.append(block.attn_norm.register_forward_hook(on_norm))
        hooks.append(block.mlp_norm.register_forward_hook(on_norm))
        hooks.append(block.register_forward_hook(on_block))
    hooks.append(model.norm.register_forward_hook(on_norm))
    try:
        for start in range(0, ids.shape[0], batch_size):
            rows = ids[start : start + batch_size]
            batch.update(heads=[], neurons=[], channels=[], layers=[])
            model(rows)
            weight = rows.shape[0] / ids.shape[0]  # equal-length rows: a batch's share of the tokens
            for key in sums:
                value = torch.stack([torch.as_tensor(v, dtype=torch.float32).cpu() for v in batch[key]])
                sums[key].append(value * weight)
    finally:
        for hook in hooks:
            hook.remove()
    scores = {key: torch.stack(values).sum(0) for key, values in sums.items()}
    result = Importance(
        heads=scores["heads"],
        neurons=scores["neurons"],
        channels=scores["channels"].mean(0),
        layers=scores["layers"],
    )
    if layer_ppl:
        result.layer_ppl = layer_perplexity_increase(model, ids)
    return result


def _nll(model: nn.Module, ids: Tensor) -> float:
    logits = model(ids[:, :-1])
    return float(F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()))


@torch.no_grad()
def layer_perplexity_increase(model: TransformerLM, ids: Int[Tensor, "B T"]) -> Float[Tensor, " L"]:
    """Calibration perplexity with each layer skipped, minus the full model's (L + 1 forward passes)."""
    if model.config.kv_share > 1:
        raise ValueError("layer perplexity needs independent layers; CLA layers share K/V")
    ids = _check_ids(model, ids)
    base = math.exp(_nll(model, ids))
    layers = model.layers
    out = []
    try:
        for skip in range(len(layers)):
            model.layers = nn.ModuleList(b for i, b in enumerate(layers) if i != skip)
            out.append(math.exp(_nll(model, ids)) - base)
    finally:
        model.layers = layers
    return torch.tensor(out)


# ------------------------------------------------------------------ slicing
@dataclass
class Keep:
    """Which units survive (indices into the original model, ascending)."""

    layers: list[int]
    heads: list[Tensor]  # per kept layer: kept query heads, ascending
    kv_heads: list[Tensor]  # per kept layer: kept K/V heads, ascending
    neurons: list[Tensor]  # per kept layer: kept MLP neurons, ascending
    channels: Tensor  # kept model channels, ascending


def head_rows(heads: Int[Tensor, " n"], H: int) -> Int[Tensor, " nH"]:
    """Row indices of these heads in an [N*H, ...] projection (head n owns rows n*H .. n*H + H - 1)."""
    # BEGIN SOLUTION prune_slice
    return (heads[:, None] * H + torch.arange(H, device=heads.device)).reshape(-1)
    # END SOLUTION


def slice_block(
    state: dict[str, Tensor],
    heads: Int[Tensor, " n"],
    kv_heads: Int[Tensor, " k"],
    neurons: Int[Tensor, " f"],
    channels: Int[Tensor, " d"],
    H: int,
) -> dict[str, Tensor]:
    """One block's state dict (names as in `TransformerBlock.state_dict()`) with only the kept units.

    A Linear's weight is [out, in]: a unit that a projection produces is a row, one it reads a column.
    Query heads `heads` select rows of q_proj (and its bias) and columns of o_proj; K/V heads `kv_heads`
    select rows of k_proj and v_proj (and their biases); MLP neurons select rows of gate_proj and
    up_proj and columns of down_proj; model channels select the columns of every projection that
    reads the residual stream (q, k, v, gate, up), the rows of those that write it (o, down) and the
    entries of both norms. Entries absent from `state` (a CLA borrower's k/v) stay absent. Returns
    new contiguous tensors for every entry of `state`; `state` is not modified.
    """
    # BEGIN SOLUTION prune_slice
    q_rows, kv_rows = head_rows(heads, H), head_rows(kv_heads, H)
    out = {}
    for name, w in state.items():
        if name in ("attn_norm.weight", "mlp_norm.weight"):
            w = w[channels]
        elif name == "attn.q_proj.weight":
            w = w[q_rows][:, channels]
        elif name == "attn.q_proj.bias":
            w = w[q_rows]
        elif name in ("attn.k_proj.weight", "attn.v_proj.weight"):
            w = w[kv_rows][:, channels]
        elif name in ("attn.k_proj.bias", "attn.v_proj.bias"):
            w = w[kv_rows]
        elif name == "attn.o_proj.weight":
            w = w[channels][:, q_rows]
        elif name in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            w = w[neurons][:, channels]
        elif name == "mlp.down_proj.weight":
            w = w[channels][:, neurons]
        out[name] = w.clone().contiguous()
    return out
    # END SOLUTION


SANDWICH_NORMS = ("post_attn_norm.weight", "post_mlp_norm.weight")  # Gemma 3's, over D


def slice_model_state(model: TransformerLM, keep: Keep) -> dict[str, Tensor]:
    """The whole state dict of the pruned model: embedding columns, output head columns, final norm,
    and each kept layer's `slice_block`, renumbered 0..L'-1."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    ch = keep.channels
    out = {"embed.weight": state["embed.weight"][:, ch].contiguous(), "norm.weight": state["norm.weight"][ch]}
    if "lm_head.weight" in state:
        out["lm_head.weight"] = state["lm_head.weight"][:, ch].contiguous()
    H = model.config.head_dim
    for new, old in enumerate(keep.layers):
        prefix = f"layers.{old}."
        block = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        # MLA: prune keeps every head and channel, so its attention weights are copied as they are
        mla_attn = (
            {k: v.clone() for k, v in block.items() if k.startswith("attn.")} if model.config.is_mla else {}
        )
        block = {k: v for k, v in block.items() if k not in mla_attn}
        sliced = slice_block(block, keep.heads[new], keep.kv_heads[new], keep.neurons[new], ch, H) | mla_attn
        for name in SANDWICH_NORMS:  # the branches' output norms keep the kept channels too
            if name in sliced:
                sliced[name] = block[name][ch].clone()
        out.update({f"layers.{new}.{k}": v for k, v in sliced.items()})
    return out


# ------------------------------------------------------------------ choosing what to keep
def _top(scores: Tensor, k: int) -> Tensor:
    """Indices of the k highest scores, ascending (ties: the lower index wins)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k].sort().values


def _target(name: str, value, original: int) -> int:
    if value is None:
        return original
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 (a model needs at least one), got {value}")
    if value > original:
        raise ValueError(
            f"{name}={value} is larger than the original model's {original}: pruning only removes"
        )
    return value


def plan(
    cfg: ModelConfig,
    scores: Importance,
    n_layers: int | None = None,
    n_heads: int | None = None,
    d_ff: int | None = None,
    d_model: int | None = None,
    layers: list[int] | None = None,
    head_mode: str = "groups",
    layer_metric: str = "block",
) -> tuple[Keep, ModelConfig]:
    """Which units to keep (the highest scores) and the config of the pruned model.

    Note: transformers' Llama / Mistral / Qwen2 configs insist on d_model % n_heads == 0 even with an
    explicit head_dim, so choose d_model accordingly for a folder that transformers should load."""
    N, K, L = cfg.n_heads, cfg.n_kv_heads, cfg.n_layers
    G = N // K
    if head_mode not in ("groups", "within"):
        raise ValueError(f"head_mode must be 'groups' or 'within', got {head_mode!r}")
    if layer_metric not in ("block", "ppl"):
        raise ValueError(f"layer_metric must be 'block' or 'ppl', got {layer_metric!r}")
    n_layers_t = _target("n_layers", n_layers, L)
    n_heads_t = _target("n_heads", n_heads, N)
    d_ff_t = _target("d_ff", d_ff, cfg.d_ff)
    d_model_t = _target("d_model", d_model, cfg.d_model)
    if cfg.is_mla and (n_heads_t != N or d_model_t != cfg.d_model):
        raise ValueError("MLA models can be pruned in layers and d_ff only (heads live in kv_b_proj)")
    if cfg.kv_share > 1 and (n_heads_t != N or n_layers_t != L or layers is not None):
        raise ValueError("CLA models can be pruned in d_ff and d_model only (layers share K/V)")
    if cfg.embed_scale and d_model_t != cfg.d_model:
        raise ValueError(
            "d_model cannot be pruned in a model that scales its embeddings by sqrt(d_model) (embed_scale, "
            "Gemma): the pruned model would scale them by sqrt of the new width; prune layers, heads or d_ff"
        )
    # layers
    if layers is not None:
        if n_layers is not None:
            raise ValueError("give n_layers or layers, not both")
        if (
            not layers
            or len(set(layers)) != len(layers)
            or not all(isinstance(i, int) and 0 <= i < L for i in layers)
        ):
            raise ValueError(
                f"layers must be distinct layer indices in 0..{L - 1}, at least one, got {layers}"
            )
        kept_layers = sorted(layers)
    else:
        if layer_metric == "ppl":
            if scores.layer_ppl is None:
                raise ValueError("layer_metric='ppl' needs scores computed with layer_ppl=True")
            layer_scores = scores.layer_ppl
        else:
            layer_scores = scores.layers
        kept_layers = _top(layer_scores, n_layers_t).tolist()
    # heads
    if head_mode == "groups":
        if n_heads_t % G:
            raise ValueError(
                f"n_heads={n_heads_t} breaks the GQA grouping: whole groups of {G} query heads per K/V head "
                f"are removed, so n_heads must be a multiple of {G} (or use head_mode='within')"
            )
        new_K, new_G = n_heads_t // G, G
    else:
        if n_heads_t % K:
            raise ValueError(
                f"n_heads={n_heads_t} breaks the GQA grouping: with head_mode='within' each of the {K} K/V "
                f"heads keeps the same number of query heads, so n_heads must be a multiple of {K}"
            )
        new_K, new_G = K, n_heads_t // K
    heads, kv_heads, neurons = [], [], []
    for layer in kept_layers:
        per_group = rearrange(scores.heads[layer], "(k g) -> k g", k=K)
        kv = _top(per_group.sum(-1), new_K)
        in_group = torch.stack([_top(per_group[k], new_G) for k in kv.tolist()])
        kv_heads.append(kv)
        heads.append((kv[:, None] * G + in_group).reshape(-1))
        neurons.append(_top(scores.neurons[layer], d_ff_t))
    channels = _top(scores.channels, d_model_t)
    new_cfg = dataclasses.replace(
        cfg,
        n_layers=len(kept_layers),
        n_heads=n_heads_t,
        n_kv_heads=new_K,
        head_dim=cfg.head_dim,
        d_ff=d_ff_t,
        d_model=d_model_t,
        rms_norm_eps=cfg.rms_norm_eps
        if d_model_t == cfg.d_model
        else cfg.rms_norm_eps * cfg.d_model / d_model_t,
        layer_types=None if cfg.layer_types is None else [cfg.layer_types[i] for i in kept_layers],
        extra=dict(cfg.extra),
    )
    return Keep(kept_layers, heads, kv_heads, neurons, channels), new_cfg


def prune(
    model: TransformerLM,
    n_layers: int | None = None,
    n_heads: int | None = None,
    d_ff: int | None = None,
    d_model: int | None = None,
    layers: list[int] | None = None,
    scores: Importance | None = None,
    calib_ids: Int[Tensor, "B T"] | None = None,
    head_mode: str = "groups",
    layer_metric: str = "block",
) -> TransformerLM:
    """A new, smaller TransformerLM keeping the most important units (the original is not modified).

    n_layers: layers to keep (the highest `layer_metric` scores), or `layers`: exactly which ones.
    n_heads: query heads per layer (see the module docstring for GQA). d_ff: MLP neurons per layer.
    d_model: model channels. None keeps an axis whole. scores come from `importance_scores`, or are
    computed here from calib_ids; without either, only `layers` (or nothing) may be pruned.
    """
    if not isinstance(model, TransformerLM):
        raise ValueError(f"prune needs a TransformerLM, got {type(model).__name__}")
    cfg = model.config
    if scores is None:
        if calib_ids is not None:
            scores = importance_scores(model, calib_ids, layer_ppl=layer_metric == "ppl")
        elif all(v is None for v in (n_layers, n_heads, d_ff, d_model)):
            scores = _uniform_scores(cfg)
        else:
            raise ValueError("pruning by importance needs scores= (importance_scores) or calib_ids=")
    keep, new_cfg = plan(cfg, scores, n_layers, n_heads, d_ff, d_model, layers, head_mode, layer_metric)
    state = slice_model_state(model, keep)
    if new_cfg.d_model != cfg.d_model:  # see the module docstring: exact when removed channels are zero
        gain = math.sqrt(cfg.d_model / new_cfg.d_model)
        for name in state:  # every norm over D (attn_norm, mlp_norm, Gemma's post_* norms, the final one)
            if name.endswith("attn_norm.weight") or name.endswith("mlp_norm.weight") or name == "norm.weight":
                state[name] = state[name] * gain
    param = model.embed.weight
    small = TransformerLM.empty(new_cfg, dtype=param.dtype, device=param.device)
    small.load_state_dict(state)
    return small.train(model.training)


def _uniform_scores(cfg: ModelConfig) -> Importance:
    L = cfg.n_layers
    return Importance(
        heads=torch.ones(L, cfg.n_heads),
        neurons=torch.ones(L, cfg.d_ff),
        channels=torch.ones(cfg.d_model),
        layers=torch.ones(L),
    )

"""AWQ (Lin et al. 2023): activation-aware scaling before group-wise int4.

Not all weights matter equally: weight column i is multiplied by input feature x_i, so rounding
errors in the columns of features with large |x_i| (about 1% of them) cost the most. AWQ protects
them without keeping anything in float: scale column i up by s_i before quantizing and scale the
input down by s_i,

    y = x W^T = (x / s) (W diag(s))^T   ~   (x / s) Q(W diag(s))^T

Scaling a column up shrinks its *relative* rounding error (the group's scale is set by the group's
largest weight, so a scaled-up column gets finer levels relative to itself). The 1 / s costs nothing
at run time: it is folded into whatever produced x (an RMSNorm weight, or the rows of the
previous linear), so the float model computes exactly the same function.

The scales come from calibration activations: s = mean_t |x_t|^alpha (per input channel), with alpha
in [0, 1] chosen by a grid search that minimises the quantized layer's output error on those same
activations. alpha = 0 is plain round-to-nearest (s = 1), so the search can only do as well or better
on the calibration data.

Groups of linears share one input and therefore one s: (q, k, v) after attn_norm, (gate, up) after
mlp_norm, o after v (attention output channel (n, h) is a mix of v's channel (kv head of n, h)), and
down after up (down's input is silu(gate) * up, linear in up's output; Gemma's GeGLU, gelu_tanh(gate)
* up, as well). QK-norm and Gemma's sandwich norms act after q / k and after o / down: the folds
keep those products' outputs, so they see what they saw.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from einops import rearrange, reduce, repeat
from jaxtyping import Float, Int
from torch import Tensor, nn

from cs336_inference.layers import RMSNorm
from cs336_inference.quantization.int4 import int4_dequantize, int4_quantize

DEFAULT_GRID = 20  # alpha in {0, 1/20, ..., 1}


def rtn_int4(group_size: int) -> Callable[[Tensor], Tensor]:
    """Round-to-nearest group-wise int4, as a fake quantizer: w -> dequantize(quantize(w))."""
    return lambda w: int4_dequantize(*int4_quantize(w, group_size))


def awq_output_error(
    x: Float[Tensor, "n I"],
    weights: Sequence[Float[Tensor, "O I"]],
    s: Float[Tensor, " I"],
    quantize: Callable[[Tensor], Tensor],
) -> float:
    """Sum over the layers of || x W^T - (x / s) Q(W diag(s))^T ||^2 (float64 total).

    quantize is a fake quantizer (float weight -> the float weight it would be stored as).
    """
    # BEGIN SOLUTION awq
    total = 0.0
    x = x.float()
    for w in weights:
        w = w.float()
        w_q = quantize(w * s[None, :]) / s[None, :]
        total += (x @ (w - w_q).t()).double().pow(2).sum().item()
    return total
    # END SOLUTION


def search_scale(
    x: Float[Tensor, "n I"],
    weights: Sequence[Float[Tensor, "O I"]],
    quantize: Callable[[Tensor], Tensor],
    n_grid: int = DEFAULT_GRID,
    x_mean: Float[Tensor, " I"] | None = None,
) -> tuple[Float[Tensor, " I"], float]:
    """The scale s = m^alpha / sqrt(max(m^alpha) min(m^alpha)), m = mean_t |x_t| per input channel
    (or the given x_mean), for the alpha in {0, 1/n_grid, ..., 1} with the smallest
    awq_output_error (the smallest alpha on a tie). m is clamped below at 1e-5 so s > 0.

    Dividing by the geometric mean of the extremes only centres s around 1 (a common factor
    cancels in the error). Returns (s, alpha).
    """
    # BEGIN SOLUTION awq
    m = (x.float().abs().mean(dim=0) if x_mean is None else x_mean.float()).clamp(min=1e-5)
    best_s, best_alpha, best_err = None, 0.0, float("inf")
    for i in range(n_grid + 1):
        alpha = i / n_grid
        s = m.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = awq_output_error(x, weights, s, quantize)
        if err < best_err:
            best_s, best_alpha, best_err = s, alpha, err
    return best_s, best_alpha
    # END SOLUTION


# ------------------------------------------------------------------ calibration and folding (given)
def collect_inputs(model: nn.Module, calibration: Int[Tensor, "B T"]) -> dict[str, Tensor]:
    """The inputs [B*T, I] of every q_proj, o_proj, gate_proj and down_proj in one float forward."""
    captured: dict[str, Tensor] = {}
    hooks = []
    for i, block in enumerate(model.layers):
        for name, layer in [
            ("qkv", block.attn.q_proj),
            ("o", block.attn.o_proj),
            ("gate_up", block.mlp.gate_proj),
            ("down", block.mlp.down_proj),
        ]:

            def hook(module, args, key=f"{i}.{name}"):
                captured[key] = args[0].detach().reshape(-1, args[0].shape[-1]).float()

            hooks.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(calibration)
    finally:
        for h in hooks:
            h.remove()
    return captured


@torch.no_grad()
def _scale_columns(linears: Sequence[nn.Module], s: Tensor) -> None:
    for lin in linears:
        lin.weight.mul_(s[None, :].to(lin.weight.dtype))


@torch.no_grad()
def _scale_rows_down(linear: nn.Module, s: Tensor) -> None:
    linear.weight.div_(s[:, None].to(linear.weight.dtype))
    if linear.bias is not None:
        linear.bias.div_(s.to(linear.bias.dtype))


def check_awq_model(model: nn.Module) -> None:
    if model.config.is_mla:
        raise ValueError("awq supports Llama-style attention (q/k/v/o projections), not MLA")


@torch.no_grad()
def awq_fold(
    model: nn.Module,
    calibration: Int[Tensor, "B T"],
    group_size: int,
    n_grid: int = DEFAULT_GRID,
) -> tuple[nn.Module, dict[str, tuple[float, Tensor]]]:
    """A copy of the float model with the AWQ scales folded in (same function, different weights).

    Returns (model, chosen) where chosen maps "layer.group" ("3.qkv", "3.gate_up", "3.o", "3.down")
    to the (alpha, s) found for that group; s scales the group's weight columns.
    """
    check_awq_model(model)
    model = copy.deepcopy(model)
    cfg = model.config
    inputs = collect_inputs(model, calibration)
    quantize = rtn_int4(group_size)
    chosen: dict[str, tuple[float, Tensor]] = {}
    G = cfg.n_heads // cfg.n_kv_heads
    for i, block in enumerate(model.layers):
        attn, mlp = block.attn, block.mlp
        qkv = [attn.q_proj] + ([attn.k_proj, attn.v_proj] if hasattr(attn, "k_proj") else [])
        groups = [
            ("qkv", block.attn_norm, qkv, None),
            ("gate_up", block.mlp_norm, [mlp.gate_proj, mlp.up_proj], None),
        ]
        if hasattr(attn, "v_proj"):  # a CLA borrower's o mixes another layer's v: no fold there
            # o's input channel (n, h) is v's channel (n // G, h): one scale per v channel
            x_o = inputs[f"{i}.o"].abs().mean(dim=0)
            per_v = reduce(x_o, "(k g h) -> k h", "mean", k=cfg.n_kv_heads, g=G)
            groups.append(("o", attn.v_proj, [attn.o_proj], repeat(per_v, "k h -> (k g h)", g=G)))
        groups.append(("down", mlp.up_proj, [mlp.down_proj], None))
        for name, prev, linears, x_mean in groups:
            x = inputs[f"{i}.{name}"]
            s, alpha = search_scale(x, [lin.weight for lin in linears], quantize, n_grid, x_mean)
            chosen[f"{i}.{name}"] = (alpha, s)
            if name == "o":
                _scale_rows_down(
                    prev, rearrange(s, "(k g h) -> k g h", k=cfg.n_kv_heads, g=G)[:, 0].flatten()
                )
            elif isinstance(prev, RMSNorm):
                prev.weight.div_(s.to(prev.weight.dtype))  # the norm now outputs x / s
            else:
                _scale_rows_down(prev, s)  # up_proj: its output, hence down's input, is divided by s
            _scale_columns(linears, s)
    return model, chosen

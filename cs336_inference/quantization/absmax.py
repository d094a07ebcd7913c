"""Symmetric absmax int8, one scale per row (per output channel of a weight, per token of activations).

    scale_o = max_i |W[o, i]| / 127          q[o, i] = round(W[o, i] / scale_o)  in -127..127
    W[o, i] ~ scale_o * q[o, i]              |W - scale * q| <= scale / 2 everywhere

One byte per weight plus one float per row: a quarter of float32, half of bf16. The weakness is in
the first line: one large |W[o, i]| (an outlier) stretches the whole row's grid, and every other
number of that row is rounded to one of a few levels around zero.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int8
from torch import Tensor

QMAX = 127  # symmetric: -127..127 (the int8 value -128 is never used, so negation is exact)


def absmax_quantize(w: Float[Tensor, "... I"]) -> tuple[Int8[Tensor, "... I"], Float[Tensor, "..."]]:
    """Quantize every row of w (last dimension) to int8 with scale = max |row| / 127.

    Returns (q, scale) with q int8 and scale float32 of w's shape without its last dimension. A row
    of zeros gets scale 0 and q = 0 (and dequantizes to zeros exactly). Rounding is torch.round
    (half to even).
    """
    # BEGIN SOLUTION int8_absmax
    w = w.float()
    scale = w.abs().amax(dim=-1) / QMAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # a zero row divides by 1
    q = torch.round(w / safe.unsqueeze(-1)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale
    # END SOLUTION


def absmax_dequantize(q: Int8[Tensor, "... I"], scale: Float[Tensor, "..."]) -> Float[Tensor, "... I"]:
    """scale * q, row by row, in float32."""
    # BEGIN SOLUTION int8_absmax
    return q.float() * scale.float().unsqueeze(-1)
    # END SOLUTION

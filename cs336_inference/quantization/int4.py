"""Asymmetric group-wise int4 with a zero point, two values packed per byte.

Each row of a weight is cut into groups of g consecutive input channels; each group gets its own
grid of 16 levels covering [lo, hi] = [min(w, 0), max(w, 0)]:

    scale = (hi - lo) / 15     (stored as float16)
    zero  = round(-lo / scale) (an integer 0..15: the level that stands for 0.0)
    q     = clamp(round(w / scale) + zero, 0, 15)        w ~ (q - zero) * scale

Asymmetric because the grid need not be centred on zero: a group whose weights are mostly positive
spends its 16 levels where the weights are. Small groups follow the local range of the weights
(an outlier only spoils its own group), at the price of a scale and a zero per group:
4 + (16 + 8) / g bits per weight (4.375 for g = 64).

Packing: a uint8 holds two 4-bit values, element 2j in the low nibble and element 2j + 1 in the
high nibble, so a row of I values takes I / 2 bytes. (llama.cpp's Q4 blocks pair element j with
element j + 16 instead; see ggml_blocks.py.)
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float, UInt8
from torch import Tensor

LEVELS = 15  # the largest 4-bit value


def check_group_size(width: int, group_size: int) -> None:
    """One-line errors for a group size that is not a positive even divisor of the row width."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if group_size % 2:
        raise ValueError(f"group_size must be even (two int4 values per byte), got {group_size}")
    if width % group_size:
        raise ValueError(f"group_size {group_size} does not divide the row width {width}")


def pack_int4(q: UInt8[Tensor, "... I"]) -> UInt8[Tensor, "... I/2"]:
    """Pack values 0..15 two per byte: byte j = q[2j] | q[2j + 1] << 4."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of values per row, got {q.shape[-1]}")
    # BEGIN SOLUTION int4_groupwise
    pairs = rearrange(q.to(torch.uint8), "... (j two) -> ... j two", two=2)
    return pairs[..., 0] | (pairs[..., 1] << 4)
    # END SOLUTION


def unpack_int4(packed: UInt8[Tensor, "... J"]) -> UInt8[Tensor, "... 2J"]:
    """Inverse of pack_int4: [..., J] bytes -> [..., 2J] values 0..15."""
    # BEGIN SOLUTION int4_groupwise
    pairs = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return rearrange(pairs, "... j two -> ... (j two)")
    # END SOLUTION


def int4_quantize(
    w: Float[Tensor, "O I"], group_size: int
) -> tuple[UInt8[Tensor, "O I/2"], Float[Tensor, "O G"], UInt8[Tensor, "O G"]]:
    """Group-wise asymmetric int4: (packed, scale, zero) with G = I / group_size groups per row.

    scale is float16 and is rounded to float16 *before* zero and q are computed, so that
    dequantization uses exactly the scale that chose the levels. An all-zero group gets scale 0,
    zero 0 and q 0. Rounding is torch.round (half to even).
    """
    check_group_size(w.shape[-1], group_size)
    # BEGIN SOLUTION int4_groupwise
    groups = rearrange(w.float(), "o (n g) -> o n g", g=group_size)
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    scale = ((hi - lo) / LEVELS).half()
    s = scale.float()
    safe = torch.where(s == 0, torch.ones_like(s), s)
    zero = torch.round(-lo / safe).clamp(0, LEVELS)
    q = (torch.round(groups / safe.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, LEVELS)
    q = rearrange(q.to(torch.uint8), "o n g -> o (n g)")
    return pack_int4(q), scale, zero.to(torch.uint8)
    # END SOLUTION


def int4_dequantize(
    packed: UInt8[Tensor, "O I/2"], scale: Float[Tensor, "O G"], zero: UInt8[Tensor, "O G"]
) -> Float[Tensor, "O I"]:
    """(q - zero) * scale group by group, in float32; the group size is I / G."""
    # BEGIN SOLUTION int4_groupwise
    q = rearrange(unpack_int4(packed).float(), "o (n g) -> o n g", n=scale.shape[-1])
    w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return rearrange(w, "o n g -> o (n g)")
    # END SOLUTION

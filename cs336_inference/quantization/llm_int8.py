"""LLM.int8() (Dettmers et al. 2022): int8 matmuls with the outlier features kept in floating point.

Vector-wise int8: quantize every token's activation row with its own absmax scale s_t and every
weight row (output channel) with its own s_o; then

    y[t, o] = s_t * s_o * sum_i qx[t, i] * qw[o, i]

where the sum is a real int8 x int8 -> int32 product. The failure it fixes: large models develop
a few input features (hidden-state dimensions) whose activations are 20-100x the rest. A token's
absmax is then set by the outlier, and all its other features are rounded to a handful of levels.

Decomposition: the features i where some token has |x[t, i]| >= threshold (6.0 in the paper) are
taken out of the int8 product and multiplied in floating point, with the dequantized weight
columns; everything else goes through int8:

    y = int8_matmul(x with outlier features zeroed) + x[:, outliers] @ W_deq[:, outliers]^T

The outliers are a few features out of thousands, so almost all arithmetic stays int8, and the
weights are still stored in 8 bits.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int8, Int32
from torch import Tensor

from cs336_inference.quantization.linear import QuantizedLinear

DEFAULT_THRESHOLD = 6.0


def int8_mm(a: Int8[Tensor, "T I"], b: Int8[Tensor, "I O"]) -> Int32[Tensor, "T O"]:
    """An exact integer matmul int8 x int8 -> int32 (torch._int_mm where it applies).

    On CUDA torch._int_mm needs T > 16 and sizes that are multiples of 8; elsewhere the product is
    done in float64, which is exact here (every partial sum is an integer below 2^53).
    """
    (T, inner), d_out = a.shape, b.shape[1]
    # (torch._int_mm on the CPU returns garbage for an inner size of 1: torch 2.13, measured)
    if (a.device.type == "cpu" and inner > 1) or (T > 16 and inner % 8 == 0 and d_out % 8 == 0):
        return torch._int_mm(a, b)
    return (a.double() @ b.double()).to(torch.int32)


def int8_matmul(
    x: Float[Tensor, "... I"], qw: Int8[Tensor, "O I"], w_scale: Float[Tensor, " O"]
) -> Float[Tensor, "... O"]:
    """Vector-wise int8 product: x quantized per token (absmax / 127, torch.round), an int8 x int8 ->
    int32 matmul (int8_mm), then rescaled: y = (acc * s_t) * s_o. A token of zeros gives zeros."""
    # BEGIN SOLUTION llm_int8
    x2 = x.reshape(-1, x.shape[-1]).float()
    s_t = x2.abs().amax(dim=-1) / 127
    safe = torch.where(s_t == 0, torch.ones_like(s_t), s_t)
    qx = torch.round(x2 / safe[:, None]).clamp(-127, 127).to(torch.int8)
    acc = int8_mm(qx, qw.t())
    y = acc.float() * s_t[:, None] * w_scale.float()[None, :]
    return y.reshape(*x.shape[:-1], qw.shape[0]).to(x.dtype)
    # END SOLUTION


def llm_int8_matmul(
    x: Float[Tensor, "... I"],
    qw: Int8[Tensor, "O I"],
    w_scale: Float[Tensor, " O"],
    threshold: float = DEFAULT_THRESHOLD,
) -> Float[Tensor, "... O"]:
    """LLM.int8(): features with |x| >= threshold in any token go through a float matmul with the
    dequantized weight columns (qw * w_scale); the rest through int8_matmul. threshold = inf gives
    int8_matmul exactly."""
    # BEGIN SOLUTION llm_int8
    x2 = x.reshape(-1, x.shape[-1])
    outliers = (x2.abs() >= threshold).any(dim=0)
    y = int8_matmul(x2.masked_fill(outliers, 0), qw, w_scale).float()
    if outliers.any():
        w_out = qw[:, outliers].float() * w_scale.float()[:, None]
        y = y + x2[:, outliers].float() @ w_out.t()
    return y.reshape(*x.shape[:-1], qw.shape[0]).to(x.dtype)
    # END SOLUTION


class LLMInt8Linear(QuantizedLinear):
    """Weights stored as int8 per output channel (like "int8"); forward is LLM.int8()."""

    def __init__(self, *args, threshold: float = DEFAULT_THRESHOLD, **kwargs):
        super().__init__(*args, **kwargs)
        self.threshold = threshold

    @classmethod
    def from_linear(cls, linear, fmt: str = "int8", group_size=None, threshold: float = DEFAULT_THRESHOLD):
        q = QuantizedLinear.from_linear(linear, "int8")
        return cls("int8", q.d_in, q.d_out, q.stored(), None, q.bias, threshold=threshold)

    def forward(self, x: Float[Tensor, "... I"]) -> Float[Tensor, "... O"]:
        y = llm_int8_matmul(x, self.qweight, self.scale, self.threshold)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"llm_int8 (threshold={self.threshold}), " + super().extra_repr()

"""Q8_0 activations: the 4- and 8-bit products done as llama.cpp does them, in integers.

A float kernel turns every stored 4-bit weight into a float before it multiplies (widen, convert,
scale), and on a CPU without wide integer units that work, not the bytes, sets the pace of decode.
llama.cpp quantizes x as well, in the weight's blocks of 32, like a Q8_0 weight:

    d_x = max |x| / 127 over the block,   q_x = round(x / d_x)    (half away from zero)

so a block's dot product is exact in integers and the two scales are applied once per block:

    y[m, o] = sum over blocks b of (d_w[o, b] d_x[m, b]) * (sum_k q_w[o, b, k] q_x[m, b, k])

q_w is q - 8 for Q4_0, q for Q8_0 and q - zero for int4 (whose group scale is d_w of each of its
blocks). What it costs in accuracy is x's rounding: at most d_x / 2 per number, 0.4% of the block's
largest |x|. The methods "q4_0_a8", "q8_0_a8" and "int4_a8" of quantize_model store the weights as
q4_0, q8_0 and int4 and multiply this way (QuantizedLinear(..., activations="q8_0")); this module
is the readable reference that decode.c's `cs336_a8` is tested against. d_x stays float32 here
(llama.cpp stores it as float16).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from cs336_inference.quantization.ggml_blocks import (
    BLOCK_BYTES,
    QK,
    _fp16_value,
    _inverse,
    _unpack_nibbles,
    roundf,
)
from cs336_inference.quantization.int4 import unpack_int4

A8_FORMATS = ("int4", "q8_0", "q4_0")  # stored formats that take Q8_0 activations


def quantize_activations(x: Float[Tensor, "M I"]) -> tuple[Float[Tensor, "M n 32"], Float[Tensor, "M n"]]:
    """(q_x, d_x): each row of x in Q8_0 blocks of 32, q_x as (integer-valued) floats."""
    xb = rearrange(x.float(), "m (n k) -> m n k", k=QK)
    d = xb.abs().amax(dim=-1) / 127
    return roundf(xb * _inverse(d).unsqueeze(-1)), d


def weight_blocks(
    fmt: str, stored: dict[str, Tensor]
) -> tuple[Float[Tensor, "O n 32"], Float[Tensor, "O n"]]:
    """(q_w, d_w): a stored weight's integers and scale per block of 32 inputs."""
    if fmt == "int4":
        q = rearrange(unpack_int4(stored["qweight"]).float(), "o (n k) -> o n k", k=QK)
        per_group = q.shape[1] // stored["scale"].shape[1]  # blocks per group
        zero = stored["zero"].float().repeat_interleave(per_group, dim=1)
        return q - zero.unsqueeze(-1), stored["scale"].float().repeat_interleave(per_group, dim=1)
    raw = stored["qweight"]
    blocks = rearrange(raw, "o (n b) -> o n b", b=BLOCK_BYTES[fmt])
    d = _fp16_value(rearrange(blocks[..., :2], "o n b -> (o n) b")).reshape(blocks.shape[:2])
    if fmt == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).float(), d
    if fmt == "q4_0":
        q = _unpack_nibbles(rearrange(blocks[..., 2:], "o n b -> (o n) b")).float() - 8
        return q.reshape(*blocks.shape[:2], QK), d
    raise ValueError(f"Q8_0 activations take {', '.join(A8_FORMATS)} weights, not {fmt}")


def a8_linear(
    x: Float[Tensor, "... I"], fmt: str, stored: dict[str, Tensor], bias: Tensor | None = None
) -> Float[Tensor, "... O"]:
    """x W^T + b with x in Q8_0 blocks (module docstring): each block's integer sum is exact (float64
    here), times d_w d_x rounded to float32 as the kernel rounds it, summed over blocks."""
    x2 = x.reshape(-1, x.shape[-1])
    qx, dx = quantize_activations(x2)
    qw, dw = weight_blocks(fmt, stored)
    y = torch.zeros(x2.shape[0], qw.shape[0], dtype=torch.float64, device=x.device)
    for b in range(qw.shape[1]):
        sums = qx[:, b].double() @ qw[:, b].double().T  # exact: at most 32 * 127 * 127
        y += sums * (dx[:, b, None] * dw[None, :, b]).double()
    y = y.float()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], qw.shape[0])

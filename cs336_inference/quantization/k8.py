"""8-bit activations for Q5_0, Q4_K and Q6_K: the products computed as llama.cpp computes them.

llama.cpp never turns these weights into floats to multiply. It quantizes x as well, once per row,
and every block's dot product is a sum of integers; the float scales are applied once per block:

    Q4_K, Q6_K  x in Q8_K blocks of 256 (ggml-quants.c, quantize_row_q8_K_ref):
                    top = the x of largest |x| in the block, with its sign (the first if tied)
                    iscale = -127 / top,  q_x = min(127, round-half-even(iscale x)),  d_x = 1 / iscale
                (-127, not -128: llama.cpp's comment says it moved from -128 for IQ2_XXS's AVX code;
                q_x lies in [-127, 127], top itself becomes -127, so d_x has the sign opposite to top's)
    Q5_0        x in Q8_0 blocks of 32: a8.py's quantize_activations (d_x = amax / 127 kept in float32,
                where llama.cpp stores it as float16; rounding half away from zero, as its reference)

For x row m and weight row o, over the weight's blocks b in order, all in float32 (each operation
one rounding, no fused multiply-add; float(S) rounds the exact integer to nearest even):

    Q5_0  S = sum_k (q - 16) q_x                                    acc = acc + float(S) * (d d_x)
    Q4_K  S = sum_j s_j sum_k q q_x,  T = sum_j m_j sum_k q_x       acc = acc + (float(S) * (d d_x)
                                                                                - float(T) * (dmin d_x))
    Q6_K  S = sum_j s_j sum_k (q - 32) q_x                          acc = acc + float(S) * (d d_x)
    y = acc (+ b)

with q the stored integers (kquants.py: 5 bits; 4 bits with 6-bit sub-block scales s_j and mins m_j
for 8 sub-blocks of 32; 6 bits with int8 scales s_j for 16 sub-blocks of 16) and d, dmin the block's
float16 scales. llama.cpp sums its terms in another float order (8 lane sums, the mins apart); the
integers are the same. decode.c's `cs336_kq` does exactly these operations, so it equals `k8_linear`
bit for bit on every build. An installed model (fast.install) multiplies its q5_0, q4_k and q6_k
layers on the CPU this way, kernel or not; QuantizedLinear.forward stays the float reference
(dequantize, then x W^T).

What it costs in accuracy is x's rounding: at most |d_x| / 2 per number, 1/254 of its block's
largest |x|, so |y - x W^T| <= sum over blocks of (|d_x| / 2) * sum |w| over the block's inputs
(`rounding_bound`), plus float32 rounding.
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from cs336_inference.quantization.a8 import quantize_activations
from cs336_inference.quantization.ggml_blocks import _fp16_value
from cs336_inference.quantization.kquants import BLOCK, QK_K, unpack_scales_mins

K8_FORMATS = ("q5_0", "q4_k", "q6_k")  # stored formats multiplied with 8-bit activations


def quantize_q8_k(x: Float[Tensor, "M I"]) -> tuple[Float[Tensor, "M n 256"], Float[Tensor, "M n"]]:
    """(q_x, d_x): each row of x in Q8_K blocks of 256 (module docstring), q_x as integer-valued floats."""
    xb = rearrange(x.float(), "m (n k) -> m n k", k=QK_K)
    top = xb.gather(-1, xb.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
    empty = top == 0
    # tensor / tensor: `-127 / t` would be t.reciprocal() * -127, two roundings
    iscale = torch.full_like(top, -127.0) / torch.where(empty, torch.ones_like(top), top)
    q = torch.round(xb * iscale.unsqueeze(-1)).clamp(max=127)
    d = torch.ones_like(iscale) / iscale
    return torch.where(empty.unsqueeze(-1), 0.0, q), torch.where(empty, 0.0, d)


def x_blocks(fmt: str, x: Float[Tensor, "M I"]) -> tuple[Float[Tensor, "M n k"], Float[Tensor, "M n"]]:
    """x quantized as the format's products take it: Q8_0 blocks of 32 for q5_0, Q8_K for the K-quants."""
    return quantize_activations(x) if fmt == "q5_0" else quantize_q8_k(x)


def _super_blocks(raw: Tensor, fmt: str) -> Tensor:
    """[O, n, bytes per block]"""
    return rearrange(raw, "o (n b) -> o n b", b=BLOCK[fmt][1])


def _fp16(raw: Tensor) -> Tensor:
    """[..., 2] bytes -> [...] float32"""
    return _fp16_value(raw.reshape(-1, 2)).reshape(raw.shape[:-1])


def q5_0_integers(raw: Tensor) -> tuple[Float[Tensor, "O n"], Float[Tensor, "O n 32"]]:
    """(d, q - 16) of every Q5_0 block: q = low nibble (weights 0-15 low, 16-31 high) + 16 * bit k of qh."""
    b = _super_blocks(raw, "q5_0")
    qh = sum(b[..., 2 + i].long() << (8 * i) for i in range(4)).unsqueeze(-1)
    nibbles = torch.cat([b[..., 6:] & 0xF, b[..., 6:] >> 4], dim=-1).long()
    q = nibbles | (((qh >> torch.arange(32, device=raw.device)) & 1) << 4)
    return _fp16(b[..., :2]), (q - 16).float()


def q4_k_integers(raw: Tensor):
    """(d, dmin, s [O n 8], m [O n 8], q [O n 8 32]) of every Q4_K super-block (kquants.py's layout)."""
    b = _super_blocks(raw, "q4_k")
    rows, n = b.shape[:2]
    s, m = (t.view(rows, n, 8) for t in unpack_scales_mins(b[..., 4:16].reshape(rows * n, 12)))
    qs = b[..., 16:].reshape(rows, n, 4, 1, 32).long()
    q = torch.cat([qs & 0xF, qs >> 4], dim=3).reshape(rows, n, 8, 32)  # sub-block 2h: low nibbles of chunk h
    return _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), s.float(), m.float(), q.float()


def q6_k_integers(raw: Tensor):
    """(d, s [O n 16], q - 32 [O n 16 16]) of every Q6_K super-block (kquants.py's layout)."""
    b = _super_blocks(raw, "q6_k")
    rows, n = b.shape[:2]
    ql, qh = b[..., :128].reshape(rows, n, 2, 2, 32).long(), b[..., 128:192].reshape(rows, n, 2, 1, 32).long()
    low = torch.cat([ql & 0xF, ql >> 4], dim=3)  # [O n half 4 32]: weights 32 t + l of the half, t = 0..3
    high = (qh >> (2 * torch.arange(4, device=raw.device).view(4, 1))) & 3  # t: bits 2t, 2t + 1 of qh byte l
    q = (low | (high << 4)) - 32
    s = b[..., 192:208].contiguous().view(torch.int8).float()
    return _fp16(b[..., 208:210]), s, q.reshape(rows, n, 16, 16).float()


def _scale(dw: Tensor, dx: Tensor) -> Tensor:
    """[M, O, n] = dw[o, n] * dx[m, n], one float32 rounding."""
    return dw.unsqueeze(0) * dx.unsqueeze(1)


def k8_terms(fmt: str, x: Float[Tensor, "M I"], stored: dict[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """The terms of y (module docstring) for every x row and weight row: [(the exact integer sums
    [M, O, n] in float64, their float32 scales [M, O, n])], y = sum over b of the first term minus
    the second (Q4_K's mins)."""
    qx, dx = x_blocks(fmt, x)
    qx = qx.double()
    raw = stored["qweight"]
    if fmt == "q5_0":
        d, qw = q5_0_integers(raw)
        return [(torch.einsum("mnk,onk->mon", qx, qw.double()), _scale(d, dx))]
    if fmt == "q4_k":
        d, dmin, s, m, q = q4_k_integers(raw)
        qx = rearrange(qx, "m n (j k) -> m n j k", k=32)
        dots = torch.einsum("mnjk,onjk->monj", qx, q.double())
        sums = torch.einsum("mnj,onj->mon", qx.sum(-1), m.double())  # the mins through x's sums
        return [((dots * s.double()).sum(-1), _scale(d, dx)), (sums, _scale(dmin, dx))]
    if fmt == "q6_k":
        d, s, q = q6_k_integers(raw)
        qx = rearrange(qx, "m n (j k) -> m n j k", k=16)
        dots = torch.einsum("mnjk,onjk->monj", qx, q.double())
        return [((dots * s.double()).sum(-1), _scale(d, dx))]
    raise ValueError(f"8-bit activations take {', '.join(K8_FORMATS)} weights, not {fmt}")


def k8_linear(
    x: Float[Tensor, "... I"], fmt: str, stored: dict[str, Tensor], bias: Tensor | None = None
) -> Float[Tensor, "... O"]:
    """x W^T + b with x in 8-bit blocks and every block's product in integers (module docstring),
    the float32 steps in the order decode.c's cs336_kq takes them."""
    x2 = x.reshape(-1, x.shape[-1])
    terms = k8_terms(fmt, x2, stored)
    acc = torch.zeros(terms[0][0].shape[:2], dtype=torch.float32, device=x.device)
    for b in range(terms[0][0].shape[2]):
        t = terms[0][0][..., b].float() * terms[0][1][..., b]
        if len(terms) > 1:  # Q4_K: minus the mins' term
            t = t - terms[1][0][..., b].float() * terms[1][1][..., b]
        acc = acc + t
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*x.shape[:-1], acc.shape[-1])


def rounding_bound(x: Float[Tensor, "M I"], fmt: str, w: Float[Tensor, "O I"]) -> Float[Tensor, "M O"]:
    """sum over x's blocks of |d_x| / 2 * sum |w| over the block: how far x's rounding alone can move
    k8_linear from x W^T (w: the dequantized weight)."""
    _, dx = x_blocks(fmt, x)
    k = 32 if fmt == "q5_0" else QK_K
    wabs = rearrange(w.abs().double(), "o (n k) -> o n k", k=k).sum(-1)
    return (dx.abs().double() / 2) @ wabs.T

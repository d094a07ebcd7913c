"""llama.cpp's block formats Q8_0, Q4_0 and Q4_1, byte for byte as llama.cpp (ggml) stores them.

A row is cut into blocks of 32 weights; each block is stored as a small struct:

    Q8_0   d (fp16) | 32 x int8 q                   34 bytes   x = d * q
    Q4_0   d (fp16) | 16 bytes of nibbles           18 bytes   x = d * (q - 8),  q in 0..15
    Q4_1   d (fp16) | m (fp16) | 16 bytes           20 bytes   x = d * q + m,    q in 0..15

(8.5, 4.5 and 5 bits per weight.) In Q4_0 / Q4_1, byte j of a block holds weight j in its low
nibble and weight j + 16 in its high nibble. fp16 numbers are little-endian.

How llama.cpp chooses the numbers (ggml-quants.c, quantize_row_*_ref), all in float32:

    Q8_0   d = max|x| / 127,  q = roundf(x / d)           (roundf: halves away from zero)
    Q4_0   m = the x of largest |x| (with its sign), d = m / -8,  q = min(15, trunc(x / d + 8.5))
    Q4_1   d = (max - min) / 15, m = min,  q = min(15, trunc((x - min) / d + 0.5))

where "x / d" is computed as x * (1 / d) with 1 / d in float32 (and taken as 0 when d = 0), and the
scale is rounded to fp16 only when stored. Q4_0 is symmetric but uses the sign of the extreme value
so that it maps to q = 0 exactly, giving that side the full 8 levels (-8 * d = m).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float, UInt8
from torch import Tensor

QK = 32  # weights per block
BLOCK_BYTES = {"q8_0": 2 + QK, "q4_0": 2 + QK // 2, "q4_1": 4 + QK // 2}


def check_block_rows(width: int, fmt: str) -> None:
    if width % QK:
        raise ValueError(f"{fmt} needs rows that are whole blocks of {QK}; the row width {width} is not")


def roundf(x: Tensor) -> Tensor:
    """C's roundf: round half away from zero (torch.round rounds half to even).

    Computed as floor(|x|) + floor(2 (|x| - floor(|x|))), which is exact in float32, unlike
    floor(|x| + 0.5) (0.49999997 + 0.5 rounds up to 1.0 in float32).
    """
    a = x.abs()
    fl = a.floor()
    return torch.sign(x) * (fl + (2 * (a - fl)).floor())


def _inverse(d: Tensor) -> Tensor:
    """1 / d in float32, and 0 where d == 0 (an all-zero block)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _fp16_bytes(x: Float[Tensor, "n 1"]) -> UInt8[Tensor, "n 2"]:
    """float32 [n, 1] -> the 2 little-endian bytes of its float16 rounding."""
    return x.half().contiguous().view(torch.uint8)


def _fp16_value(raw: UInt8[Tensor, "n 2"]) -> Float[Tensor, "n 1"]:
    return raw.contiguous().view(torch.float16).float()


def _pack_nibbles(q: UInt8[Tensor, "n 32"]) -> UInt8[Tensor, "n 16"]:
    """Weight j in the low nibble, weight j + 16 in the high nibble of byte j."""
    return q[:, : QK // 2] | (q[:, QK // 2 :] << 4)


def _unpack_nibbles(qs: UInt8[Tensor, "n 16"]) -> UInt8[Tensor, "n 32"]:
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _blocks(w: Float[Tensor, "O I"], fmt: str) -> Float[Tensor, "n 32"]:
    check_block_rows(w.shape[-1], fmt)
    return rearrange(w.float(), "o (n k) -> (o n) k", k=QK)


def _rows(blocks: Tensor, rows: int) -> Tensor:
    return rearrange(blocks, "(o n) b -> o (n b)", o=rows)


# ------------------------------------------------------------------ Q8_0 (the students' format)
def q8_0_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q8_0 blocks of every row: [O, I / 32 * 34] bytes, equal to gguf.quants.quantize(w, Q8_0)."""
    x = _blocks(w, "q8_0")
    # BEGIN SOLUTION q8_0
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return _rows(torch.cat([_fp16_bytes(d), q], dim=1), w.shape[0])
    # END SOLUTION


def q8_0_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    """Q8_0 bytes [O, n_blocks * 34] -> float32 weights [O, n_blocks * 32]."""
    blocks = rearrange(raw, "o (n b) -> (o n) b", b=BLOCK_BYTES["q8_0"])
    # BEGIN SOLUTION q8_0
    d = _fp16_value(blocks[:, :2])
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return _rows(d * q, raw.shape[0])
    # END SOLUTION


# ------------------------------------------------------------------ Q4_0, Q4_1 (given)
def q4_0_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q4_0 blocks of every row: [O, I / 32 * 18] bytes."""
    x = _blocks(w, "q4_0")
    extreme = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # signed value of largest magnitude
    d = extreme / -8
    q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return _rows(torch.cat([_fp16_bytes(d), _pack_nibbles(q)], dim=1), w.shape[0])


def q4_0_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    blocks = rearrange(raw, "o (n b) -> (o n) b", b=BLOCK_BYTES["q4_0"])
    d = _fp16_value(blocks[:, :2])
    return _rows(d * (_unpack_nibbles(blocks[:, 2:]).float() - 8), raw.shape[0])


def q4_1_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q4_1 blocks of every row: [O, I / 32 * 20] bytes."""
    x = _blocks(w, "q4_1")
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return _rows(torch.cat([_fp16_bytes(d), _fp16_bytes(lo), _pack_nibbles(q)], dim=1), w.shape[0])


def q4_1_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    blocks = rearrange(raw, "o (n b) -> (o n) b", b=BLOCK_BYTES["q4_1"])
    d, m = _fp16_value(blocks[:, :2]), _fp16_value(blocks[:, 2:4])
    return _rows(d * _unpack_nibbles(blocks[:, 4:]).float() + m, raw.shape[0])

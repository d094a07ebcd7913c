"""llama.cpp's other block formats, read with numpy: Q5_0, Q5_1, IQ4_NL and the K-quants.

gguf_read.py explains Q8_0 / Q4_0 / Q4_1; this module adds the formats of the files people actually
download ("Q4_K_M", "Q5_K_S", ...). Every function takes raw blocks [n, bytes per block] (uint8) and
returns float32 weights [n, weights per block], one numpy expression over all blocks at once.

Bit for bit llama.cpp's floats: the product d * s * q is exact in float32 (an fp16 d has 11
significant bits, s and q together at most 12 more, within float32's 24), so only the final
"- dmin * m" (or "+ m") rounds, and we write it as llama.cpp's dequantize_row_* does,
x = (d * s) * q - (dmin * m), which also gives the same sign to zeros.

Two families:

  - Blocks of 32 weights with one fp16 scale, like Q4_0: Q5_0 and Q5_1 add a fifth bit per weight,
    IQ4_NL replaces the 16 evenly spaced levels of Q4_0 by a non-uniform table.
  - K-quants: super-blocks of 256 weights (QK_K) cut into sub-blocks of 16 or 32 weights. The
    super-block stores one fp16 scale d (and one fp16 dmin); each sub-block stores a small integer
    scale (and min) that multiplies it. Two-level scales cost few bits per weight: Q4_K is 4.5 bits
    per weight with a scale and a min for every 32 weights.

    Q5_0     22 bytes /  32   x = d * (q - 16)                      q 5 bits
    Q5_1     24 bytes /  32   x = d * q + m                         q 5 bits
    IQ4_NL   18 bytes /  32   x = d * TABLE[q]                      q 4 bits
    Q2_K     84 bytes / 256   x = (d * s) * q - (dmin * m)          q 2 bits, 16 x (s, m) 4 bits
    Q3_K    110 bytes / 256   x = (d * s) * (q - 4)                 q 3 bits, 16 x s 6 bits (signed)
    Q4_K    144 bytes / 256   x = (d * s) * q - (dmin * m)          q 4 bits, 8 x (s, m) 6 bits
    Q5_K    176 bytes / 256   x = (d * s) * q - (dmin * m)          q 5 bits, 8 x (s, m) 6 bits
    Q6_K    210 bytes / 256   x = (d * s) * (q - 32)                q 6 bits, 16 x s int8
    Q8_K    292 bytes / 256   x = d * q                             q int8, d float32

(Q8_K is llama.cpp's format for activations in its K-quant dot products; files rarely hold it.)
fp16 (and Q8_K's float32) numbers are little-endian. The docstring of each function gives its layout.

A recurring packing: 4-bit values of a 32-byte run `qs` hold 64 weights, weights 0..31 in the low
nibbles and 32..63 in the high nibbles (K-quants); in the 32-weight blocks it is 16 bytes for 32
weights, weight j in the low nibble of byte j and weight j + 16 in its high nibble (as in Q4_0).
Likewise 2-bit values: a 32-byte run holds 128 weights, weights 32 k .. 32 k + 31 in bits 2k, 2k + 1.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK = 32  # weights per block in Q5_0 / Q5_1 / IQ4_NL
QK_K = 256  # weights per super-block in the K-quants

# IQ4_NL's 16 levels: denser near zero, where most weights are (llama.cpp's kvalues_iq4nl).
IQ4_NL_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])


# ------------------------------------------------------------------ helpers
def _fp16(raw: np.ndarray) -> np.ndarray:
    """Pairs of bytes [n, 2] as little-endian fp16, widened to float32 [n, 1]."""
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] bytes -> [n, 32] values 0..15: weight j in the low nibble of byte j, j + 16 in its high one."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(raw: np.ndarray, width: int) -> np.ndarray:
    """[n, b] bytes -> [n, 8 / width, b]: field k holds bits width*k .. width*k + width - 1 of each byte."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (raw[:, None, :] >> shifts) & np.uint8((1 << width) - 1)


def _high_bit_32(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes = one little-endian uint32 -> [n, 32] values 0 or 16: bit j is weight j's fifth bit."""
    return (np.unpackbits(qh, axis=1, bitorder="little") << 4).astype(np.uint8)


def _scales_mins_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes [n, 12] -> eight 6-bit scales and eight 6-bit mins, each [n, 8] (see Q4_K)."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return scales, mins


def _scaled(d: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Super-block scale [n, 1] times integer sub-block scales [n, k] -> float32 [n, k, 1]."""
    return (d * s.astype(np.float32))[:, :, None]


# ------------------------------------------------------------------ blocks of 32
def dequantize_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0, 22 bytes per 32 weights: d (fp16) | qh (4 bytes) | qs (16 bytes).

    Each weight is a 5-bit q in 0..31, x = d * (q - 16). Its low 4 bits are packed in qs as in Q4_0
    (weight j low nibble of byte j, weight j + 16 high nibble); its fifth bit is bit j of qh read as
    a little-endian uint32.
    """
    d, qh, qs = _fp16(blocks[:, :2]), blocks[:, 2:6], blocks[:, 6:]
    q = _nibbles_32(qs) | _high_bit_32(qh)
    return d * (q.astype(np.float32) - 16.0)


def dequantize_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1, 24 bytes per 32 weights: d (fp16) | m (fp16) | qh (4 bytes) | qs (16 bytes).

    q in 0..31 packed as in Q5_0; x = d * q + m, with m the block's minimum.
    """
    d, m, qh, qs = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4]), blocks[:, 4:8], blocks[:, 8:]
    q = _nibbles_32(qs) | _high_bit_32(qh)
    return d * q.astype(np.float32) + m


def dequantize_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL, 18 bytes per 32 weights: d (fp16) | qs (16 bytes), packed as in Q4_0.

    The 4-bit q picks one of 16 non-uniform levels: x = d * IQ4_NL_LEVELS[q].
    """
    d, qs = _fp16(blocks[:, :2]), blocks[:, 2:]
    return d * IQ4_NL_LEVELS.astype(np.float32)[_nibbles_32(qs)]


# ------------------------------------------------------------------ K-quants: 256 weights
def dequantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K, 84 bytes per 256 weights: scales (16 bytes) | qs (64 bytes) | d (fp16) | dmin (fp16).

    16 sub-blocks of 16 weights. scales[i]: low nibble = scale s, high nibble = min m of sub-block i.
    qs: two runs of 32 bytes, one per 128 weights; in a run, bits 2k, 2k + 1 of byte l are weight
    32 k + l of those 128. x = (d * s) * q - (dmin * m), q in 0..3.
    """
    n = len(blocks)
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _fp16(blocks[:, 80:82]), _fp16(blocks[:, 82:84])
    q = _bits(qs.reshape(2 * n, 32), 2).reshape(n, 16, 16).astype(np.float32)  # [n, sub-block, 16]
    return (_scaled(d, scales & 0x0F) * q - _scaled(dmin, scales >> 4)).reshape(n, QK_K)


def dequantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K, 110 bytes per 256 weights: hmask (32 bytes) | qs (64 bytes) | scales (12 bytes) | d (fp16).

    16 sub-blocks of 16 weights, x = (d * s) * q with q in -4..3 and s a signed 6-bit scale:
    - the low 2 bits of q are packed in qs as in Q2_K; the third bit is bit k of hmask[l] for weight
      32 k + l, and q = low bits - 4 where that bit is 0 (q = low bits where it is 1);
    - s = 6-bit value - 32. Its low 4 bits: the low nibbles of bytes 0..7 of scales for sub-blocks
      0..7, their high nibbles for 8..15. Its high 2 bits: bits 2k, 2k + 1 of byte 8 + j for sub-block
      4 k + j.
    """
    n = len(blocks)
    hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _fp16(blocks[:, 108:110])
    low = _bits(packed[:, :8], 4).reshape(n, 16)
    high = _bits(packed[:, 8:], 2).reshape(n, 16)
    s = (low | (high << 4)).astype(np.int8) - 32
    q_low = _bits(qs.reshape(2 * n, 32), 2).reshape(n, 16, 16).astype(np.int8)
    third = _bits(hmask, 1).reshape(n, 16, 16).astype(np.int8)
    q = (q_low - 4 * (1 - third)).astype(np.float32)
    return (_scaled(d, s) * q).reshape(n, QK_K)


def dequantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 144 bytes per 256 weights: d (fp16) | dmin (fp16) | scales (12 bytes) | qs (128 bytes).

    8 sub-blocks of 32 weights, x = (d * s) * q - (dmin * m), with q in 0..15 and a 6-bit scale s
    and 6-bit min m per sub-block. The 8 + 8 six-bit numbers fill the 12 bytes of `scales` (j < 4):

        bytes 0..3    s_j in the low 6 bits; the top 2 bits are the high bits of s_(j+4)
        bytes 4..7    m_j in the low 6 bits; the top 2 bits are the high bits of m_(j+4)
        bytes 8..11   low nibble: the low 4 bits of s_(j+4); high nibble: the low 4 bits of m_(j+4)

    qs: four runs of 32 bytes, run r holding sub-block 2 r in its low nibbles and sub-block 2 r + 1
    in its high nibbles.
    """
    n = len(blocks)
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    s, m = _scales_mins_k4(blocks[:, 4:16])
    q = _bits(blocks[:, 16:].reshape(4 * n, 32), 4).reshape(n, 8, 32).astype(np.float32)
    return (_scaled(d, s) * q - _scaled(dmin, m)).reshape(n, QK_K)


def dequantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K, 176 bytes per 256 weights: d | dmin (fp16) | scales (12 bytes) | qh (32 bytes) | qs (128 bytes).

    As Q4_K, with a fifth bit per weight: bit j of qh[l] is the high bit of weight l of sub-block j.
    q in 0..31, x = (d * s) * q - (dmin * m).
    """
    n = len(blocks)
    d, dmin = _fp16(blocks[:, :2]), _fp16(blocks[:, 2:4])
    s, m = _scales_mins_k4(blocks[:, 4:16])
    low = _bits(blocks[:, 48:].reshape(4 * n, 32), 4).reshape(n, 8, 32)
    high = _bits(blocks[:, 16:48], 1)  # [n, 8, 32]
    q = (low | (high << 4)).astype(np.float32)
    return (_scaled(d, s) * q - _scaled(dmin, m)).reshape(n, QK_K)


def dequantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 210 bytes per 256 weights: ql (128 bytes) | qh (64 bytes) | scales (16 x int8) | d (fp16).

    16 sub-blocks of 16 weights with an int8 scale s each; q in 0..63, x = (d * s) * (q - 32).
    Each half of 128 weights uses 64 bytes of ql and 32 of qh:
    - low 4 bits: ql bytes 0..31 hold weights 0..31 (low nibbles) and 64..95 (high nibbles), bytes
      32..63 hold weights 32..63 and 96..127;
    - high 2 bits: bits 2k, 2k + 1 of qh byte l belong to weight 32 k + l.
    """
    n = len(blocks)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    s, d = blocks[:, 192:208].view(np.int8), _fp16(blocks[:, 208:210])
    # per half [nibble, 64 bytes]: low nibbles are weights 0..63, high nibbles 64..127
    low = _bits(ql.reshape(2 * n, 64), 4).reshape(n, 16, 16)
    high = _bits(qh.reshape(2 * n, 32), 2).reshape(n, 16, 16)
    q = (low | (high << 4)).astype(np.float32) - 32.0
    return (_scaled(d, s) * q).reshape(n, QK_K)


def dequantize_q8_k(blocks: np.ndarray) -> np.ndarray:
    """Q8_K, 292 bytes per 256 weights: d (float32) | qs (256 x int8) | bsums (16 x int16).

    x = d * q. bsums (the sums of each 16 q's, a shortcut for llama.cpp's dot products) are not needed.
    """
    d = np.ascontiguousarray(blocks[:, :4]).view("<f4")
    return d * np.ascontiguousarray(blocks[:, 4:260]).view(np.int8).astype(np.float32)


# element type -> its reader (gguf_read.dequantize_blocks dispatches here)
DEQUANTIZERS = {
    GGMLQuantizationType.Q5_0: dequantize_q5_0,
    GGMLQuantizationType.Q5_1: dequantize_q5_1,
    GGMLQuantizationType.IQ4_NL: dequantize_iq4_nl,
    GGMLQuantizationType.Q2_K: dequantize_q2_k,
    GGMLQuantizationType.Q3_K: dequantize_q3_k,
    GGMLQuantizationType.Q4_K: dequantize_q4_k,
    GGMLQuantizationType.Q5_K: dequantize_q5_k,
    GGMLQuantizationType.Q6_K: dequantize_q6_k,
    GGMLQuantizationType.Q8_K: dequantize_q8_k,
}

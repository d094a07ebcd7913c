"""llama.cpp's Q5_0 and its "K-quants" Q4_K and Q6_K: the formats of the Q4_K_M files people download.

Q5_0 is Q4_0 with a fifth bit: blocks of 32, one fp16 scale, the fifth bits of all 32 weights in a
32-bit word qh. The K-quants cut a row into super-blocks of 256 weights with a second level of scales:

    Q5_0   d | qh (4 bytes) | 16 bytes of nibbles                   22 B / 32   x = d (q - 16), q in 0..31
    Q4_K   d | dmin | 12 bytes of scales | 128 bytes of nibbles   144 B / 256  x = d s_j q - dmin m_j
    Q6_K   128 bytes low nibbles | 64 bytes high pairs | 16 int8 scales | d
                                                                  210 B / 256  x = d s_j (q - 32)

Q4_K (4.5 bits per weight): 8 sub-blocks of 32, each with a 6-bit scale s_j and a 6-bit min m_j,
scaled in turn by the fp16 d and dmin. The sixteen 6-bit numbers fill 12 bytes (`pack_scales_mins`):
bytes 0-3 hold s_0..s_3 and bytes 4-7 m_0..m_3 in their low 6 bits; bytes 8-11 hold s_4..s_7 (low
nibble) and m_4..m_7 (high nibble) by their low 4 bits, and the top 2 bits of s_4..s_7 and m_4..m_7
ride in the spare top bits of bytes 0-3 and 4-7. Weights are nibbles: within each 64 weights, byte i
of its 32 bytes holds weight i (low nibble) and weight 32 + i (high nibble).

Q6_K (6.56 bits per weight): 16 sub-blocks of 16 with an int8 scale each. A 6-bit q is a low
nibble and two high bits: in each half of 128 weights, ql byte i holds weights i and 64 + i, ql byte
32 + i weights 32 + i and 96 + i; qh byte i holds the high bits of weights i, 32 + i, 64 + i, 96 + i.

How llama.cpp chooses the numbers (ggml-quants.c, quantize_row_*_ref), all in float32:
    Q5_0   like Q4_0: d = (the x of largest |x|) / -16, q = min(31, trunc(x / d + 16.5)).
    Q4_K   per sub-block, the (scale, min) of least weighted squared error (`fit_scale_min`, a search
           over 21 candidate scales with weights |x| + rms(x)); then s_j, m_j are the sub-block's
           scale and min in 6 bits of the block's largest, and q is re-rounded with the stored numbers.
    Q6_K   per sub-block, the symmetric scale of least x^2-weighted error (`fit_scale`, a search over
           19 candidates); s_j in int8 of the block's largest (stored as -128), q re-rounded.
The searches sum in another order than C does, so a rare block may differ from llama.cpp's choice by
a rounding; the layout, and what every byte means, is llama.cpp's (tests check both against the
`gguf` package's dequantization and llama.cpp's reader).
"""

from __future__ import annotations

import torch
from einops import rearrange
from jaxtyping import Float, UInt8
from torch import Tensor

from cs336_inference.quantization.ggml_blocks import _fp16_bytes, _fp16_value, _inverse

QK_K = 256  # weights per super-block
BLOCK = {"q5_0": (32, 22), "q4_k": (QK_K, 144), "q6_k": (QK_K, 210)}  # format -> (weights, bytes)


def _blocks(w: Float[Tensor, "O I"], fmt: str) -> Float[Tensor, "n k"]:
    k = BLOCK[fmt][0]
    if w.shape[-1] % k:
        raise ValueError(f"{fmt} needs rows that are whole blocks of {k}; the row width {w.shape[-1]} is not")
    return rearrange(w.float(), "o (n k) -> (o n) k", k=k)


def _raw_blocks(raw: UInt8[Tensor, "O B"], fmt: str) -> UInt8[Tensor, "n b"]:
    return rearrange(raw, "o (n b) -> (o n) b", b=BLOCK[fmt][1])


def _rows(blocks: Tensor, rows: int) -> Tensor:
    return rearrange(blocks, "(o n) b -> o (n b)", o=rows)


def _bytes_le(x: Tensor, n: int) -> UInt8[Tensor, "m n"]:
    """Integers [m] (int64) as n little-endian bytes each."""
    return torch.stack([(x >> (8 * i)) & 0xFF for i in range(n)], dim=1).to(torch.uint8)


# ------------------------------------------------------------------ Q5_0
def q5_0_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q5_0 blocks of every row: [O, I / 32 * 22] bytes, equal to gguf.quants.quantize(w, Q5_0)."""
    x = _blocks(w, "q5_0")
    extreme = x.gather(1, x.abs().argmax(dim=1, keepdim=True))
    d = extreme / -16
    q = torch.trunc(x * _inverse(d) + 16.5).clamp(max=31).to(torch.int64)
    low = (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)
    qh = ((q >> 4) << torch.arange(32)).sum(dim=1)  # bit j: the fifth bit of weight j
    return _rows(torch.cat([_fp16_bytes(d), _bytes_le(qh, 4), low.to(torch.uint8)], dim=1), w.shape[0])


def q5_0_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    b = _raw_blocks(raw, "q5_0")
    d = _fp16_value(b[:, :2])
    qh = sum(b[:, 2 + i].long() << (8 * i) for i in range(4))[:, None]
    high = (qh >> torch.arange(32)) & 1
    low = torch.cat([b[:, 6:] & 0xF, b[:, 6:] >> 4], dim=1).long()
    return _rows(d * ((low | (high << 4)) - 16).float(), raw.shape[0])


# ------------------------------------------------------------------ the searches for scales
def fit_scale_min(x: Float[Tensor, "n k"], w: Float[Tensor, "n k"], nmax: int, steps: int = 20):
    """Per row, x ~ scale * q + mn with q in 0..nmax, mn <= 0, minimizing sum w (scale q + mn - x)^2.

    Start from the range [min(x, 0), max(x)] split in nmax steps; then try nmax - 1 + 0.1 t steps
    (t = 0..steps) over the range from the best mn so far to max(x): round x to that grid, and solve
    the weighted least squares for (scale, mn) given those q; keep the best. Returns (scale [n, 1],
    -mn [n, 1], q [n, k]).
    """
    lo, hi = x.amin(dim=1, keepdim=True).clamp(max=0), x.amax(dim=1, keepdim=True)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w, sum_x = w.sum(dim=1, keepdim=True), (w * x).sum(dim=1, keepdim=True)
    scale = span / nmax
    q = torch.round((x - lo) * (nmax / span)).clamp(0, nmax)
    best = (w * (scale * q + lo - x) ** 2).sum(dim=1, keepdim=True)
    for t in range(steps + 1):  # (llama.cpp measures the range from the best min so far)
        span = torch.where(flat, torch.ones_like(hi), hi - lo)
        qt = torch.round((x - lo) * ((nmax - 1 + 0.1 * t) / span)).clamp(0, nmax)
        sl, sl2, sxl = (
            (w * qt).sum(1, keepdim=True),
            (w * qt * qt).sum(1, keepdim=True),
            (w * qt * x).sum(1, keepdim=True),
        )
        det = sum_w * sl2 - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        s = (sum_w * sxl - sum_x * sl) / det
        m = (sl2 * sum_x - sl * sxl) / det
        s = torch.where(m > 0, sxl / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), s)
        m = m.clamp(max=0)
        err = (w * (s * qt + m - x) ** 2).sum(dim=1, keepdim=True)
        better = ok & (err < best)
        q, best = torch.where(better, qt, q), torch.where(better, err, best)
        scale, lo = torch.where(better, s, scale), torch.where(better, m, lo)
    zero = torch.zeros_like(scale)
    return (
        torch.where(flat, zero, scale),
        torch.where(flat, -lo, -lo),
        torch.where(flat, torch.zeros_like(q), q),
    )


def fit_scale(x: Float[Tensor, "n k"], nmax: int) -> Float[Tensor, "n 1"]:
    """Per row, a symmetric x ~ scale * q with q in -nmax..nmax-1, weighting each x by x^2.

    The value of largest |x| maps to -nmax; the candidates -(nmax + 0.1 t) / max for t = -9..9 are
    tried, each with its least-squares scale sum(w x q) / sum(w q^2); the best is kept."""
    amax_at = x.abs().argmax(dim=1, keepdim=True)
    top = x.gather(1, amax_at)
    tiny = top.abs() < 1e-15
    top = torch.where(tiny, torch.ones_like(top), top)
    w = x * x

    def fit(iscale: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        return (w * x * q).sum(dim=1, keepdim=True), (w * q * q).sum(dim=1, keepdim=True)

    sumlx, suml2 = fit(-nmax / top)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), 0.0)
    best = scale * sumlx
    for t in [*range(-9, 0), *range(1, 10)]:
        slx, sl2 = fit(-(nmax + 0.1 * t) / top)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        s = slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
        scale, best = torch.where(better, s, scale), torch.where(better, s * slx, best)
    return torch.where(tiny, torch.zeros_like(scale), scale)


# ------------------------------------------------------------------ Q4_K
def pack_scales_mins(s: Tensor, m: Tensor) -> UInt8[Tensor, "n 12"]:
    """Eight 6-bit scales and eight 6-bit mins [n, 8] (0..63) -> Q4_K's 12 bytes per block.

    Bytes 0-3: s_0..s_3 in the low 6 bits, the top 2 bits of s_4..s_7 above them; bytes 4-7: the same
    for m_0..m_3 and m_4..m_7; bytes 8-11: the low 4 bits of s_4..s_7 (low nibble) and of m_4..m_7
    (high nibble)."""
    s, m = s.long(), m.long()
    # BEGIN SOLUTION q4_k
    first = s[:, :4] | ((s[:, 4:] >> 4) << 6)  # s_0..s_3, and the top bits of s_4..s_7
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)  # m_0..m_3, and the top bits of m_4..m_7
    third = (s[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)  # the low 4 bits of s_4..s_7 and m_4..m_7
    return torch.cat([first, second, third], dim=1).to(torch.uint8)
    # END SOLUTION


def unpack_scales_mins(packed: UInt8[Tensor, "n 12"]) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes per block -> the eight 6-bit scales and eight 6-bit mins, [n, 8] each (int64),
    the inverse of `pack_scales_mins`."""
    p = packed.long()
    # BEGIN SOLUTION q4_k
    s = torch.cat([p[:, 0:4] & 63, (p[:, 8:12] & 0xF) | ((p[:, 0:4] >> 6) << 4)], dim=1)
    m = torch.cat([p[:, 4:8] & 63, (p[:, 8:12] >> 4) | ((p[:, 4:8] >> 6) << 4)], dim=1)
    return s, m
    # END SOLUTION


def q4_k_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q4_K super-blocks of every row: [O, I / 256 * 144] bytes."""
    x = _blocks(w, "q4_k")
    n = x.shape[0]
    sub = rearrange(x, "n (j k) -> (n j) k", k=32)
    weight = (sub.pow(2).mean(dim=1, keepdim=True)).sqrt() + sub.abs()
    scale, mins, _ = fit_scale_min(sub, weight, 15)
    scale, mins = scale.view(n, 8), mins.view(n, 8)
    max_scale, max_min = scale.amax(dim=1, keepdim=True), mins.amax(dim=1, keepdim=True)
    s6 = torch.round(scale * torch.where(max_scale > 0, 63 / max_scale, 0.0)).clamp(max=63)
    m6 = torch.round(mins * torch.where(max_min > 0, 63 / max_min, 0.0)).clamp(max=63)
    d, dmin = (max_scale / 63).half().float(), (max_min / 63).half().float()
    step, offset = (d * s6)[..., None], (dmin * m6)[..., None]  # [n, 8, 1]: the stored numbers
    sub = rearrange(x, "n (j k) -> n j k", k=32)
    q = torch.round((sub + offset) / torch.where(step == 0, 1.0, step)).clamp(0, 15)
    q = torch.where(step == 0, 0.0, q).long().view(n, 4, 2, 32)  # [n, 64-weight half, lo/hi, 32]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).view(n, 128).to(torch.uint8)
    packed = pack_scales_mins(s6, m6)
    return _rows(
        torch.cat([_fp16_bytes(max_scale / 63), _fp16_bytes(max_min / 63), packed, qs], 1), w.shape[0]
    )


def q4_k_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    """Q4_K bytes [O, n * 144] -> float32 weights [O, n * 256]: weight k of sub-block j is
    (d s_j) q - (dmin m_j) in float32 (d, dmin: fp16 numbers, 11 significant bits; s_j, m_j: 6 bits;
    q: 4 bits), where every product is exact and only the subtraction rounds, as in llama.cpp."""
    b = _raw_blocks(raw, "q4_k")
    n = b.shape[0]
    d, dmin = _fp16_value(b[:, 0:2]), _fp16_value(b[:, 2:4])
    # BEGIN SOLUTION q4_k
    s, m = unpack_scales_mins(b[:, 4:16])
    qs = b[:, 16:].view(n, 4, 32).long()
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).view(n, 8, 32)  # sub-block 2h: low nibbles of half h
    x = (d * s)[..., None] * q - (dmin * m)[..., None]
    # END SOLUTION
    return _rows(x.reshape(n, QK_K), raw.shape[0])


# ------------------------------------------------------------------ Q6_K
def q6_k_quantize(w: Float[Tensor, "O I"]) -> UInt8[Tensor, "O B"]:
    """Q6_K super-blocks of every row: [O, I / 256 * 210] bytes."""
    x = _blocks(w, "q6_k")
    n = x.shape[0]
    scale = fit_scale(rearrange(x, "n (j k) -> (n j) k", k=16), 32).view(n, 16)
    top = scale.gather(1, scale.abs().argmax(dim=1, keepdim=True))  # the largest |scale|, signed
    empty = top.abs() < 1e-15
    iscale = torch.where(empty, 0.0, -128 / torch.where(empty, 1.0, top))
    s8 = torch.round(iscale * scale).clamp(max=127)
    d16 = _fp16_bytes(torch.where(empty, 0.0, 1 / torch.where(iscale == 0, 1.0, iscale)))
    step = (_fp16_value(d16) * s8)[..., None]
    sub = rearrange(x, "n (j k) -> n j k", k=16)
    q = torch.round(sub / torch.where(step == 0, 1.0, step)).clamp(-32, 31) + 32
    q = torch.where(step == 0, 0.0, q).long().view(n, 2, 4, 32)  # [n, half of 128, quarter, 32]
    low = q & 0xF
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2)
    qh = sum((q[:, :, i] >> 4) << (2 * i) for i in range(4))
    scales = s8.to(torch.int8).view(torch.uint8)
    return _rows(
        torch.cat([ql.view(n, 128).to(torch.uint8), qh.view(n, 64).to(torch.uint8), scales, d16], 1),
        w.shape[0],
    )


def q6_k_dequantize(raw: UInt8[Tensor, "O B"]) -> Float[Tensor, "O I"]:
    b = _raw_blocks(raw, "q6_k")
    n = b.shape[0]
    ql, qh = b[:, :128].view(n, 2, 64).long(), b[:, 128:192].view(n, 2, 32).long()
    s = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _fp16_value(b[:, 208:210])
    low = torch.stack([ql[..., :32] & 0xF, ql[..., 32:] & 0xF, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=2)
    high = torch.stack([(qh >> (2 * i)) & 3 for i in range(4)], dim=2)
    q = ((low | (high << 4)) - 32).view(n, 16, 16).float()
    return _rows((d * s)[..., None].mul(q).reshape(n, QK_K), raw.shape[0])

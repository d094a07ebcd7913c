"""The GPU decode path, after gpt-fast: weight-only int8 and int4 products that read the stored bytes.

int8 (per-channel scale): y = (x q^T) * scale. For bf16 / fp16 x of up to 32 rows, a Triton kernel
(fast/gpu/triton_int8.py) reads q once; otherwise torch's `_weight_int8pack_mm` where this torch has
it for CUDA; otherwise q is cast to x's dtype inside the product (gpt-fast's WeightOnlyInt8Linear,
which relies on torch.compile to fuse the cast; eager, the cast is a bf16 copy of the weight).

int4 (group-wise, zero point): tinygemm, `torch.ops.aten._weight_int4pack_mm`, bf16 activations.
tinygemm dequantizes w = (q - 8) * scale + z per group, ours w = (q - zero) * scale, so
z = (8 - zero) * scale; its packing puts element 2j in the high nibble (ours: the low one) and its
scales and z are bf16 (ours: a float16 scale), so its weights equal ours to bf16 rounding. The
repacked weight is built on the first call on each device and kept on the layer.

Each function returns None (the caller runs the readable reference) for a call it does not take.
The cuda-marked tests in tests/test_kernels.py compare both with the reference and time them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cs336_inference.fast.gpu.triton_int8 import int8_linear

TINYGEMM_GROUPS = (32, 64, 128, 256)
_INT8PACK_ON_CUDA: bool | None = None  # does this torch have _weight_int8pack_mm for CUDA?


def _int8pack_mm(x2: Tensor, q: Tensor, scale: Tensor) -> Tensor | None:
    global _INT8PACK_ON_CUDA
    if _INT8PACK_ON_CUDA is False or not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return None
    try:
        y = torch.ops.aten._weight_int8pack_mm(x2, q, scale)
    except (RuntimeError, NotImplementedError):
        _INT8PACK_ON_CUDA = False
        return None
    _INT8PACK_ON_CUDA = True
    return y


def int8_weight_only(layer, x: Tensor) -> Tensor | None:
    """y = (x q^T) * scale + b for an int8 QuantizedLinear on a CUDA device; None elsewhere."""
    if layer.fmt != "int8" or x.device.type != "cuda" or layer.qweight.device != x.device:
        return None
    if not x.dtype.is_floating_point:
        return None
    scale = layer.scale.to(x.dtype)
    y = None
    if x.numel() // x.shape[-1] <= 32:
        x2 = x.reshape(-1, x.shape[-1])
        y = int8_linear(x2, layer.qweight, scale)
        if y is None and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
            y = _int8pack_mm(x2, layer.qweight, scale)
        y = None if y is None else y.reshape(*x.shape[:-1], layer.d_out)
    if y is None:
        y = F.linear(x, layer.qweight.to(x.dtype)) * scale
    return y if layer.bias is None else y + layer.bias.to(x.dtype)


def _tinygemm_weights(layer) -> tuple[Tensor, Tensor, int] | None:
    """(packed weight, scales-and-zeros [G, O, 2] bf16, group size) for tinygemm, built once."""
    cached = getattr(layer, "_tinygemm", None)
    device = layer.qweight.device
    if cached is not None and cached[0].device == device:
        return cached
    g, d_in, d_out = layer.group_size, layer.d_in, layer.d_out
    ktiles = next((t for t in (8, 4, 2) if d_in % (16 * t) == 0), None)
    if g not in TINYGEMM_GROUPS or ktiles is None or d_out % 8 or d_in % g:
        return None
    from cs336_inference.quantization.int4 import unpack_int4

    q = unpack_int4(layer.qweight)  # [O, I] values 0..15
    packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).contiguous(), ktiles)
    scale = layer.scale.float()
    z = (8.0 - layer.zero.float()) * scale
    scales_zeros = torch.stack([scale, z], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    layer._tinygemm = (packed, scales_zeros, g)
    return layer._tinygemm


def int4_tinygemm(layer, x: Tensor) -> Tensor | None:
    """y = x dequantize(stored)^T + b for an int4 QuantizedLinear with bf16 x on a CUDA device."""
    if layer.fmt != "int4" or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return None
    if layer.qweight.device != x.device:
        return None
    weights = _tinygemm_weights(layer)
    if weights is None:
        return None
    packed, scales_zeros, g = weights
    x2 = x.reshape(-1, layer.d_in)
    y = torch.ops.aten._weight_int4pack_mm(x2, packed, g, scales_zeros).reshape(*x.shape[:-1], layer.d_out)
    return y if layer.bias is None else y + layer.bias.to(x.dtype)


def quantized_cuda(layer, x: Tensor) -> Tensor | None:
    """The CUDA entry of kernels.ops.quantized_linear: int8 and int4 have GPU paths, others decline."""
    if layer.fmt == "int8":
        return int8_weight_only(layer, x)
    if layer.fmt == "int4":
        return int4_tinygemm(layer, x)
    return None

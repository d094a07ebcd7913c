"""The GPU decode path, after gpt-fast: weight-only int8 as one cast and one cuBLAS product.

On a GPU the "kernel" for weight-only int8 is y = (x @ q^T) * scale with q cast to x's dtype
inside the product (gpt-fast's WeightOnlyInt8Linear): the int8 weight is read once (1 byte per
weight instead of 2 for bf16) and the per-channel scale is applied to the [M, O] output, not to
the weight. int4 (`torch.ops.aten._weight_int4pack_mm`, tinygemm's packing) is not wired up here.

NOTE: written without a GPU on the machine; the cuda-marked tests in tests/test_kernels.py check it
where one exists.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def int8_weight_only(layer, x: Tensor) -> Tensor | None:
    """y = (x q^T) * scale + b for an int8 QuantizedLinear on a CUDA device; None elsewhere."""
    if layer.fmt != "int8" or x.device.type != "cuda" or layer.qweight.device != x.device:
        return None
    y = F.linear(x, layer.qweight.to(x.dtype)) * layer.scale.to(x.dtype)
    return y if layer.bias is None else y + layer.bias.to(x.dtype)

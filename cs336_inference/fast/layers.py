"""The fast layers: each a subclass of a readable layer that tries a kernel first (fast/__init__.py)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from cs336_inference.fast.autotune import decode_linear
from cs336_inference.fast.cpu.ops import MAX_ROWS, llm_int8_linear, quantized_linear
from cs336_inference.layers import Linear
from cs336_inference.quantization.linear import QuantizedLinear
from cs336_inference.quantization.llm_int8 import LLMInt8Linear


class FastLinear(Linear):
    """A Linear whose decode-shaped calls (1..32 rows) take the planned fp32 product (autotune.py)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() <= MAX_ROWS * x.shape[-1]:
            y = decode_linear(self, x)
            if y is not None:
                return y
        return F.linear(x, self.weight, self.bias)


class FastQuantizedLinear(QuantizedLinear):
    """A QuantizedLinear that multiplies from the stored bytes (cpu/ops.py, gpu/) where it can."""

    def forward(self, x: Tensor) -> Tensor:
        y = quantized_linear(self, x)
        return super().forward(x) if y is None else y


class FastLLMInt8Linear(LLMInt8Linear):
    """LLM.int8() with its int8 product in C (the same numbers as the readable forward)."""

    def forward(self, x: Tensor) -> Tensor:
        y = llm_int8_linear(self, x)
        return super().forward(x) if y is None else y


FAST_LAYERS = {Linear: FastLinear, QuantizedLinear: FastQuantizedLinear, LLMInt8Linear: FastLLMInt8Linear}
READABLE = {fast: readable for readable, fast in FAST_LAYERS.items()}  # fast/__init__.py adds the model


def readable_type(layer: nn.Module) -> type:
    """The readable class of a layer, installed or not (FastLinear -> Linear)."""
    return READABLE.get(type(layer), type(layer))

"""The fast layers: each a subclass of a readable layer that tries a kernel first (fast/__init__.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cs336_inference.fast.autotune import decode_linear
from cs336_inference.fast.cpu.ops import MAX_ROWS, k8_layer, llm_int8_linear, quantized_linear
from cs336_inference.layers import Linear
from cs336_inference.quantization.k8 import k8_linear
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
    """A QuantizedLinear that multiplies from the stored bytes (cpu/ops.py, gpu/) where it can.

    Q5_0, Q4_K and Q6_K layers on the CPU multiply with x in 8-bit blocks, as llama.cpp does
    (quantization/k8.py): the kernel (decode.c's cs336_kq), and k8_linear, its bitwise reference,
    where the kernel declines (no build, a compiled step, bf16 x), so an installed model's numbers do
    not depend on which ran. These layers differ from the readable forward (float x times the
    dequantized W) by x's rounding (k8.py states the bound). Only a call that builds an autograd
    graph keeps the float forward (rounding x would zero its gradient)."""

    def forward(self, x: Tensor) -> Tensor:
        y = quantized_linear(self, x)
        if y is not None:
            return y
        if k8_layer(self) and not (torch.is_grad_enabled() and x.requires_grad):
            bias = None if self.bias is None else self.bias.float()
            return k8_linear(x, self.fmt, self.stored(), bias).to(x.dtype)
        return super().forward(x)


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

"""Quantization: fewer bytes per weight, since decode reads every weight once per step.

absmax.py       symmetric int8, one scale per row (absmax)
int4.py         asymmetric group-wise int4 with zero points, two values per byte
ggml_blocks.py  llama.cpp's Q8_0 / Q4_0 / Q4_1 blocks, byte for byte
linear.py       QuantizedLinear (stored weights + the dequantize-then-matmul reference)
llm_int8.py     LLM.int8(): int8 x int8 -> int32 matmuls, outlier features in float
awq.py          AWQ: activation-aware scales searched on calibration data, folded in
a8.py           Q8_0 activations: x in blocks of 32 as int8, exact integer block products (llama.cpp's)
quantize.py     quantize_model(model, method), model_nbytes(model)
"""

from cs336_inference.quantization.linear import (
    FORMATS,
    PackedWeight,
    QuantizedEmbedding,
    QuantizedLinear,
)
from cs336_inference.quantization.llm_int8 import LLMInt8Linear
from cs336_inference.quantization.quantize import METHODS, model_nbytes, quantize_model, quantized_layers

__all__ = [
    "FORMATS",
    "LLMInt8Linear",
    "METHODS",
    "PackedWeight",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "model_nbytes",
    "quantize_model",
    "quantized_layers",
]

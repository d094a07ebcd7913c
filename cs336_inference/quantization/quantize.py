"""quantize_model: a quantized copy of a float TransformerLM; model_nbytes: what its weights occupy.

Methods (every linear layer inside the transformer blocks is replaced by a QuantizedLinear):

    int8       absmax int8, one scale per output channel; forward dequantizes (weight-only)
    int4       asymmetric group-wise int4 (group_size 64 by default), zero points, packed
    q8_0, q4_0, q4_1   llama.cpp's blocks of 32 (byte-identical to llama.cpp's own quantizer)
    q5_0, q4_k, q6_k   llama.cpp's Q5_0 and K-quant super-blocks of 256 (kquants.py)
    q4_k_m     llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for the value and down projections of half
               the layers (`k_quant_mix`) and for the output matrix; Q5_0 / Q8_0 where a row is not
               whole super-blocks of 256
    llm_int8   int8 weights; forward is LLM.int8(): int8 x int8 matmul, outlier features in float
    w8a8       the same without the decomposition (threshold = inf): plain vector-wise int8 of
               weights *and* activations, LLM.int8()'s negative control
    awq        AWQ scales (calibration token ids needed) folded in, then group-wise int4

The embedding and the output head stay float by default (quantize_head=True quantizes them in the
same format; llm_int8 / w8a8 then store the head as int8, awq as round-to-nearest int4). Why float: the
embedding is a lookup, so a decode step reads T rows of it, not the table; and the output head is
the most sensitive matrix (its errors go straight into the logits, and there is no later layer to
average them out), which is why LLM.int8(), AWQ and GPTQ implementations all leave it out. The
cost is bytes: in SmolLM2-135M the tied 49152 x 576 table is 21% of the parameters.
"""

from __future__ import annotations

import copy
import math
import re

import torch
from jaxtyping import Int
from torch import Tensor, nn

from cs336_inference.layers import Embedding, Linear
from cs336_inference.quantization.awq import awq_fold
from cs336_inference.quantization.linear import (
    QuantizedEmbedding,
    QuantizedLinear,
    check_activations,
    check_format,
)
from cs336_inference.quantization.llm_int8 import DEFAULT_THRESHOLD, LLMInt8Linear

METHODS = (
    "int8", "int4", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k", "q4_k_m",
    "llm_int8", "w8a8", "awq", "int4_a8", "q8_0_a8", "q4_0_a8",
)  # fmt: skip
# the stored format of each method; "_a8": those weights times x in Q8_0 blocks (a8.py)
STORAGE = {
    "llm_int8": "int8",
    "w8a8": "int8",
    "awq": "int4",
    "int4_a8": "int4",
    "q8_0_a8": "q8_0",
    "q4_0_a8": "q4_0",
}


def quantized_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}  # llama.cpp's choice for rows not whole blocks of 256


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def k_quant_mix(name: str, d_in: int, n_layers: int) -> str:
    """The format llama.cpp's Q4_K_M gives the weight `name` (our state-dict name, no ".weight")."""
    if name == "lm_head":
        fmt = "q6_k"  # the output matrix (a tied embedding is one)
    else:
        m = re.fullmatch(r"layers\.(\d+)\.(attn\.v_proj|mlp\.down_proj)", name)
        fmt = "q6_k" if m and _more_bits(int(m.group(1)), n_layers) else "q4_k"
    return fmt if d_in % 256 == 0 else K_FALLBACK[fmt]


def _block_linears(model: nn.Module) -> list[tuple[nn.Module, str, Linear, str]]:
    """(parent, attribute, linear, full name) for every Linear inside the transformer blocks."""
    out = []
    for parent_name, parent in model.layers.named_modules(prefix="layers"):
        for attr, child in parent.named_children():
            if isinstance(child, Linear):
                out.append((parent, attr, child, f"{parent_name}.{attr}"))
    return out


def quantize_model(
    model: nn.Module,
    method: str,
    group_size: int | None = None,
    calibration: Int[Tensor, "B T"] | None = None,
    quantize_head: bool = False,
    threshold: float = DEFAULT_THRESHOLD,
) -> nn.Module:
    """A new model with the block linears quantized by `method`; `model` is left untouched.

    group_size: int4 / awq (default 64; must divide every quantized row width). The llama.cpp
    formats have fixed blocks of 32 and int8 / llm_int8 one scale per row: any other group_size
    is an error. calibration: token ids [B, T] for awq (e.g. a few hundred tokens of text).
    threshold: the outlier threshold of llm_int8. "int4_a8", "q8_0_a8", "q4_0_a8": int4 / q8_0 /
    q4_0 weights whose products quantize x in Q8_0 blocks first, as llama.cpp does (a8.py).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; known: {', '.join(METHODS)}")
    already = quantized_layers(model)
    if already:
        name, layer = next(iter(already.items()))
        raise ValueError(
            f"the model is already quantized ({name} is {layer.fmt}); quantize the float model instead"
        )
    fmt = STORAGE.get(method, method)
    activations = "q8_0" if method.endswith("_a8") else None
    linears = _block_linears(model)
    head = [] if not quantize_head else [model.vocab_weight]
    n_layers = model.config.n_layers

    def format_of(name: str, d_in: int) -> str:
        return k_quant_mix(name, d_in, n_layers) if method == "q4_k_m" else fmt

    for _, _, lin, name in linears:
        try:
            group_size_used = check_format(
                format_of(name, lin.weight.shape[1]), lin.weight.shape[1], group_size
            )
            if activations is not None:
                check_activations(fmt, activations, group_size_used)
        except ValueError as e:
            raise ValueError(f"{method}: {e} ({name})") from None
    for w in head:
        check_format(format_of("lm_head", w.shape[1]), w.shape[1], group_size)
    if method == "awq":
        if calibration is None:
            raise ValueError("awq needs calibration token ids [B, T] (calibration=...)")
        calibration = torch.as_tensor(calibration, dtype=torch.long)
        if calibration.ndim == 1:
            calibration = calibration[None]
        new, _ = awq_fold(model, calibration.to(model.embed.weight.device), group_size_used)
    elif calibration is not None:
        raise ValueError(f"{method} takes no calibration data (only awq does)")
    else:
        new = copy.deepcopy(model)
    for parent, attr, lin, name in _block_linears(new):
        if method in ("llm_int8", "w8a8"):
            layer = LLMInt8Linear.from_linear(lin, threshold=threshold if method == "llm_int8" else math.inf)
        else:
            layer = QuantizedLinear.from_linear(
                lin, format_of(name, lin.weight.shape[1]), group_size, activations
            )
        setattr(parent, attr, layer.to(lin.weight.device))
    if quantize_head:
        D = model.config.d_model
        tied = model.lm_head is None  # the table is then the output matrix, and gets its format
        _quantize_vocab(
            new,
            format_of("lm_head" if tied else "embed", D),
            format_of("lm_head", D),
            group_size,
            activations,
        )
    return new.eval()


def _quantize_vocab(
    model: nn.Module, embed_fmt: str, head_fmt: str, group_size: int | None, activations: str | None = None
) -> None:
    device = model.embed.weight.device
    # activations: the output product's; the lookup dequantizes rows
    table = QuantizedLinear.from_weight(model.embed.weight, embed_fmt, group_size, activations=activations)
    model.embed = QuantizedEmbedding(table.to(device), model.embed.weight.dtype)
    if model.lm_head is not None:
        model.lm_head = QuantizedLinear.from_linear(model.lm_head, head_fmt, group_size, activations).to(
            device
        )


def model_nbytes(model: nn.Module) -> int:
    """Bytes of every weight the model stores: parameters and persistent buffers, shared ones once
    (a tied embedding / output matrix counts once; the rotary tables are not weights)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def is_float_model(model: nn.Module) -> bool:
    return not quantized_layers(model) and isinstance(model.embed, Embedding)

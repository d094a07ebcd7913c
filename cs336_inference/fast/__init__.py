"""The fast path (staff code): the same model, run by kernels instead of the readable PyTorch.

Nothing in the model imports this package. A loaded model gets the fast path by one call,

    from cs336_inference.fast import install
    install(model)   # its Linear / QuantizedLinear / LLMInt8Linear layers now try the kernels first,
                     # and the serving engine's steps run natively (FastTransformerLM)

and `scripts/generate.py`, `scripts/serve.py` and `scripts/benchmark.py` make that call by default
(`--eager` opts out). An installed layer computes the same function as the readable one: it runs a
kernel for the shapes the kernels handle and falls back to the readable forward otherwise. The one
exception is llama.cpp's Q5_0 / Q4_K / Q6_K layers, which multiply as llama.cpp does, with x in 8-bit
blocks (quantization/k8.py: the readable statement of that arithmetic, which the kernel equals).

Decode reads every weight once per step for a few FLOPs per byte, so its speed is bytes over
bandwidth, and a product must (1) read the stored weight (int8, int4, llama.cpp blocks) without
first dequantizing it to float32, and (2) run all the rows of a short call (a speculative
verification, a small batch) against one read of the weight. The readable references
(layers.Linear, quantization/linear.py) do neither; the kernels do both, and give each row a result
bitwise independent of how many rows share the call.

cpu/        products of 1..32 rows in C (decode.c: fp32, int8, int4, Q8_0/Q4_0/Q4_1 weights, int8 x int8,
            4/8-bit blocks x Q8_0 activations, Q5_0/Q4_K/Q6_K x 8-bit activations; amx.c: int8/int4 on Intel AMX tiles, opt-in), built on
            first use with gcc (build.py), called through ctypes (ops.py); native.cpp: the same ops as
            C++ bodies for a compiled step. No compiler, a failed build or CS336_KERNELS=0: the
            readable path runs.
gpu/        weight-only products for bf16 activations on CUDA: int4 through tinygemm, int8 in Triton
step/       whole decode steps of fixed shapes: fixed.py (`FixedStep`: a CUDA graph, torch.compile on
            the CPU, eager, or native), native.py + cpu/step.c (every decoder layer in one C call),
            paged.py (the serving engine's step the same way, over paged K/V: `FastTransformerLM`),
            head.py (the draft head's layer the same way: `FastDraftHead`), fuse.py (q/k/v and
            gate/up as one product)
autotune.py the fp32 product and weight layout of each shape, chosen by timing the candidates
layers.py   the fast layer classes (FastLinear, FastQuantizedLinear, FastLLMInt8Linear)
"""

from __future__ import annotations

from torch import Tensor, nn

from cs336_inference.fast.layers import (
    FAST_LAYERS,
    READABLE,
    FastLinear,
    FastLLMInt8Linear,
    FastQuantizedLinear,
    readable_type,
)
from cs336_inference.model import TransformerLM


class FastTransformerLM(TransformerLM):
    """A TransformerLM whose serving-engine steps (`forward_paged`) run every decoder layer in one C
    call over the paged K/V where they can (step/paged.py); the readable forward otherwise."""

    def forward_paged(self, input_ids: Tensor, batch, return_hidden: bool = False):
        from cs336_inference.fast.step.paged import forward_paged

        out = forward_paged(self, input_ids, batch, return_hidden)
        return super().forward_paged(input_ids, batch, return_hidden) if out is None else out


FAST = {**FAST_LAYERS, TransformerLM: FastTransformerLM}
READABLE[FastTransformerLM] = TransformerLM


def _fast_types() -> dict:
    """FAST, with the draft head's fast class (step/head.py) added on first use: step/ imports this
    package, so it cannot be imported while this package is."""
    from cs336_inference.draft_head import DraftHead

    if DraftHead not in FAST:
        from cs336_inference.fast.step.head import FastDraftHead

        FAST[DraftHead] = FastDraftHead
        READABLE[FastDraftHead] = DraftHead
    return FAST


def install(model: nn.Module) -> nn.Module:
    """Put the fast path onto a loaded model, in place (and return it): each layer of a readable class
    becomes its fast subclass (same parameters, buffers and state dict). Idempotent. A layer made
    afterwards (say by `quantize_model`, which builds new layers) is readable until installed again."""
    types = _fast_types()
    for module in model.modules():
        fast = types.get(type(module))
        if fast is not None:
            module.__class__ = fast
    return model


def uninstall(model: nn.Module) -> nn.Module:
    """The readable layers again, in place (and return the model)."""
    for module in model.modules():
        readable = READABLE.get(type(module))
        if readable is not None:
            module.__class__ = readable
    return model


def installed(model: nn.Module) -> bool:
    """Whether any layer of the model runs the fast path."""
    return any(type(m) in READABLE for m in model.modules())


__all__ = [
    "FastLinear",
    "FastLLMInt8Linear",
    "FastQuantizedLinear",
    "FastTransformerLM",
    "install",
    "installed",
    "readable_type",
    "uninstall",
]

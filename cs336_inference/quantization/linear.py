"""QuantizedLinear: a linear layer whose weight is stored in a quantized format.

The layer keeps only what the format stores (packed integers, scales, zero points or raw
llama.cpp blocks) and a float bias if the original had one. `forward` is the readable reference:

    W = dequantize(stored)          # float32 [O, I]
    y = x W^T + b

That reference reads the small stored weight but then materializes the float W, so by itself it is
not faster than the float layer; what makes quantized decode fast is a kernel that multiplies
straight from the stored bytes. That is staff code (`cs336_inference.fast`): `fast.install(model)`
turns each QuantizedLinear into a subclass whose forward tries such a kernel first and falls back
to this reference for a shape the kernel does not handle. Nothing here knows of it.

Formats (bytes for an [O, I] weight; G = I / group_size):

    int8   int8 q [O, I] + float32 scale [O]                        I*O + 4*O
    int4   packed uint8 [O, I/2] + float16 scale, uint8 zero [O, G]  I*O/2 + 3*O*G
    q8_0   llama.cpp blocks [O, I/32 * 34]                          34/32 * I*O
    q4_0   llama.cpp blocks [O, I/32 * 18]                          18/32 * I*O
    q4_1   llama.cpp blocks [O, I/32 * 20]                          20/32 * I*O
    q5_0   llama.cpp blocks [O, I/32 * 22]                          22/32 * I*O
    q4_k   llama.cpp super-blocks [O, I/256 * 144]                  144/256 * I*O
    q6_k   llama.cpp super-blocks [O, I/256 * 210]                  210/256 * I*O
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from cs336_inference.quantization import ggml_blocks, kquants
from cs336_inference.quantization.a8 import A8_FORMATS, a8_linear
from cs336_inference.quantization.absmax import absmax_dequantize, absmax_quantize
from cs336_inference.quantization.int4 import check_group_size, int4_dequantize, int4_quantize


@dataclass(frozen=True)
class Format:
    """How one format stores a weight: quantize(w, group_size) -> named tensors, dequantize(**tensors) -> w.

    Every stored tensor has the weight's rows as its first dimension, so the rows of a quantized
    matrix can be gathered without dequantizing the rest (what an embedding lookup needs).
    """

    name: str
    quantize: Callable[[Tensor, int | None], dict[str, Tensor]]
    dequantize: Callable[..., Tensor]
    default_group_size: int | None  # None: not group-wise (per row, or fixed llama.cpp blocks)

    def nbytes(self, d_out: int, d_in: int, group_size: int | None) -> int:
        """The formula for the bytes of one [d_out, d_in] weight (biases not included)."""
        if self.name == "int8":
            return d_out * d_in + 4 * d_out
        if self.name == "int4":
            return d_out * d_in // 2 + 3 * d_out * (d_in // group_size)
        weights, nbytes = block_layout(self.name)
        return d_out * d_in // weights * nbytes


def block_layout(fmt: str) -> tuple[int, int]:
    """(weights, bytes) of one block of a llama.cpp format."""
    if fmt in kquants.BLOCK:
        return kquants.BLOCK[fmt]
    return ggml_blocks.QK, ggml_blocks.BLOCK_BYTES[fmt]


def _int8(w: Tensor, group_size: int | None) -> dict[str, Tensor]:
    q, scale = absmax_quantize(w)
    return {"qweight": q, "scale": scale}


def _int4(w: Tensor, group_size: int | None) -> dict[str, Tensor]:
    packed, scale, zero = int4_quantize(w, group_size)
    return {"qweight": packed, "scale": scale, "zero": zero}


def _block(fmt: str) -> tuple[Callable[[Tensor, int | None], dict[str, Tensor]], Callable[..., Tensor]]:
    module = kquants if fmt in kquants.BLOCK else ggml_blocks
    quantize, dequantize = getattr(module, f"{fmt}_quantize"), getattr(module, f"{fmt}_dequantize")
    return (lambda w, group_size: {"qweight": quantize(w)}), (lambda qweight: dequantize(qweight))


FORMATS: dict[str, Format] = {
    "int8": Format("int8", _int8, lambda qweight, scale: absmax_dequantize(qweight, scale), None),
    "int4": Format("int4", _int4, lambda qweight, scale, zero: int4_dequantize(qweight, scale, zero), 64),
    **{fmt: Format(fmt, *_block(fmt), None) for fmt in ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k")},
}


def check_format(fmt: str, d_in: int, group_size: int | None) -> int | None:
    """The group size this format uses for rows of d_in numbers; a one-line error if it cannot."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")
    if FORMATS[fmt].default_group_size is None:
        block = block_layout(fmt)[0] if fmt.startswith("q") else None
        if group_size is not None and group_size != block:
            where = f"blocks of {block}" if block else "one scale per row"
            raise ValueError(f"{fmt} has a fixed layout ({where}); group_size={group_size} does not apply")
        if block and d_in % block:
            raise ValueError(
                f"{fmt} needs rows that are whole blocks of {block}; the row width {d_in} is not"
            )
        return None
    group_size = FORMATS[fmt].default_group_size if group_size is None else group_size
    check_group_size(d_in, group_size)
    return group_size


def check_activations(fmt: str, activations: str, group_size: int | None) -> None:
    """A one-line error unless the layer can take x in Q8_0 blocks (a8.py)."""
    if activations != "q8_0":
        raise ValueError(f"activations={activations!r}: the one activation format is 'q8_0'")
    if fmt not in A8_FORMATS:
        raise ValueError(f"Q8_0 activations take {', '.join(A8_FORMATS)} weights, not {fmt}")
    if fmt == "int4" and group_size % ggml_blocks.QK:
        raise ValueError(f"int4 with Q8_0 activations needs groups of a multiple of 32, not {group_size}")


class QuantizedLinear(nn.Module):
    """y = x dequantize(stored)^T + b, with the stored tensors as (persistent) buffers."""

    def __init__(
        self,
        fmt: str,
        d_in: int,
        d_out: int,
        stored: dict[str, Tensor],
        group_size: int | None = None,
        bias: Tensor | None = None,
        activations: str | None = None,
    ):
        super().__init__()
        self.fmt, self.d_in, self.d_out, self.group_size = fmt, d_in, d_out, group_size
        if activations is not None:
            check_activations(fmt, activations, group_size)
        self.activations = activations  # "q8_0": x quantized in blocks of 32 before the product (a8.py)
        self.stored_names = tuple(stored)
        for name, t in stored.items():
            self.register_buffer(name, t.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_weight(
        cls,
        weight: Float[Tensor, "O I"],
        fmt: str,
        group_size: int | None = None,
        bias: Tensor | None = None,
        activations: str | None = None,
    ) -> QuantizedLinear:
        d_out, d_in = weight.shape
        group_size = check_format(fmt, d_in, group_size)
        if activations is not None:
            check_activations(fmt, activations, group_size)
        with torch.no_grad():
            stored = FORMATS[fmt].quantize(weight.detach(), group_size)
        return cls(fmt, d_in, d_out, stored, group_size, bias, activations)

    @classmethod
    def from_linear(
        cls, linear: nn.Module, fmt: str, group_size: int | None = None, activations: str | None = None
    ) -> QuantizedLinear:
        return cls.from_weight(linear.weight, fmt, group_size, getattr(linear, "bias", None), activations)

    def stored(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.stored_names}

    def dequantize(self, rows: Int[Tensor, "..."] | None = None) -> Float[Tensor, "O I"]:
        """The float32 weight (or only the given rows of it: [..., I])."""
        stored = self.stored()
        if rows is None:
            return FORMATS[self.fmt].dequantize(**stored)
        flat = rows.reshape(-1)
        w = FORMATS[self.fmt].dequantize(**{name: t[flat] for name, t in stored.items()})
        return w.reshape(*rows.shape, self.d_in)

    @property
    def weight(self) -> Float[Tensor, "O I"]:
        """The dequantized weight, for code that reads `.weight` (e.g. MLA's weight absorption)."""
        return self.dequantize()

    @property
    def packed_weight(self) -> PackedWeight:
        """The weight as a PackedWeight: F.linear(x, it) runs this layer (the kernels), nothing is
        dequantized until some other op needs the numbers."""
        return PackedWeight(self)

    @property
    def nbytes(self) -> int:
        """Bytes of what is stored (bias included)."""
        tensors = [*self.stored().values(), *([] if self.bias is None else [self.bias])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: Float[Tensor, "... I"]) -> Float[Tensor, "... O"]:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.activations is not None:
            return a8_linear(x, self.fmt, self.stored(), bias).to(x.dtype)
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        acts = f", activations={self.activations}" if self.activations else ""
        return f"{self.fmt}, d_in={self.d_in}, d_out={self.d_out}{group}{acts}, bias={self.bias is not None}"


class PackedWeight(Tensor):
    """A quantized layer's weight that every op sees as the dequantized float32 [O, I] matrix, except
    F.linear(x, it), which runs the layer itself (its kernel, when one takes the call).

    Why: TransformerLM.forward ends in F.linear(norm(x), vocab_weight), a line students write. For a
    quantized output matrix (quantize_model(..., quantize_head=True)) vocab_weight is one of these,
    so that line reads the table's int8 / int4 bytes instead of dequantizing all V x D numbers every
    step. It holds no storage; .shape, .dtype and .device are metadata.
    """

    @staticmethod
    def __new__(cls, layer: QuantizedLinear):
        device = layer.qweight.device
        t = Tensor._make_wrapper_subclass(cls, (layer.d_out, layer.d_in), dtype=torch.float32, device=device)
        t.layer = layer
        return t

    def __repr__(self) -> str:
        return f"PackedWeight({self.layer.extra_repr()})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is F.linear
            and len(args) == 2
            and not kwargs
            and type(args[1]) is cls
            and type(args[0]) is not cls
        ):
            return args[1].layer(args[0])
        if func in (
            Tensor.shape.__get__,
            Tensor.dtype.__get__,
            Tensor.device.__get__,
            Tensor.dim,
            Tensor.size,
        ):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(_unpack, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_unpack, (args, kwargs or {}))
        return func(*args, **kwargs)


def _unpack(t):
    return t.layer.dequantize() if type(t) is PackedWeight else t


class QuantizedEmbedding(nn.Module):
    """An embedding table stored quantized: a lookup dequantizes only the rows it reads.

    With tied embeddings the same table is the output matrix; `weight` dequantizes all of it.
    Rows come out in the dtype of the float table it replaced (`dtype`), so a bf16 model's residual
    stream stays bf16; `model.to(dtype)` changes it like any float weight's.
    """

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.table = table
        # an empty float buffer: Module.to(dtype) converts it, so it carries the output dtype along
        self.register_buffer(
            "dtype_probe", torch.zeros(0, dtype=dtype, device=table.qweight.device), persistent=False
        )

    @property
    def weight(self) -> Float[Tensor, "V D"]:
        """The table as a PackedWeight: as the output matrix of a tied model, F.linear(h, weight)
        multiplies straight from the stored bytes."""
        return self.table.packed_weight

    def forward(self, ids: Int[Tensor, "B T"]) -> Float[Tensor, "B T D"]:
        return self.table.dequantize(rows=ids).to(self.dtype_probe.dtype)

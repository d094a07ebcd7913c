"""Sibling projections as one product: q, k, v read the same x, and so do the MLP's gate and up.

A decode step is a chain of skinny products, and each call pays a fixed cost besides its bytes:
threads started and joined, the prefetcher ramping up on a new matrix, in a compiled step the
wrapper's Python. Layers that read the same input can be one call over their weights stacked
along the output: attention's three calls become one, the MLP's first two become one. Each output
is still the dot product of x with the same weight row. The quantized kernels compute every output
on its own, so their numbers are bitwise those of separate calls; an fp32 stack may be stored in the
other layout or run on BLAS (fast/autotune.py plans its shape), equal to rounding.

`fuse_siblings(model)` stacks each group's stored weights into one tensor and makes the layers'
own weights views of it: nothing is stored twice, and in-place updates (loading, training) reach
both. A decode-shaped call of a member (the kernels' path: 1..32 rows, no autograd) then goes
through its group: the first member called with x runs the stacked product and keeps the slices,
the others take theirs. Prefill, autograd and a machine without the kernels run each layer's own
readable path as before. If a member's weight is replaced (`.to()`, a new tensor), the group
stacks the members again on its next call.

SmolLM2: 210 product calls per step become 120; the compiled step ran int4 1.09x, q4_0 1.16x and fp32
1.02x as many tokens/s (Intel Xeon, 2 cores; docs/kernels.md).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from cs336_inference.fast.autotune import _stored, decode_linear, product_plan
from cs336_inference.fast.cpu import build
from cs336_inference.fast.cpu.ops import quantized_linear
from cs336_inference.fast.layers import readable_type
from cs336_inference.layers import Linear, skip_random_init
from cs336_inference.quantization.linear import QuantizedLinear

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class Siblings:
    """Layers that read the same x, answered by one product over their stacked weights."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        self.sizes = [_d_out(layer) for layer in layers]
        self._x: Tensor | None = None
        self._parts: tuple[Tensor, ...] = ()
        self._left = 0
        self._stack()

    def _stack(self) -> None:
        """Stack the members' weights into self.stacked and make theirs views of it."""
        first = self.layers[0]
        ends = torch.tensor(self.sizes).cumsum(0).tolist()
        rows = [slice(end - size, end) for size, end in zip(self.sizes, ends, strict=True)]
        bias = None if first.bias is None else torch.cat([layer.bias.detach() for layer in self.layers])
        weight = first.qweight if isinstance(first, QuantizedLinear) else first.weight
        with torch.inference_mode(weight.is_inference()), torch.no_grad():  # as layout.decode_linear
            if isinstance(first, QuantizedLinear):
                names = first.stored_names
                stored = {name: torch.cat([getattr(layer, name) for layer in self.layers]) for name in names}
                self.stacked = QuantizedLinear(
                    first.fmt, first.d_in, ends[-1], stored, first.group_size, bias, first.activations
                )
                views = {name: getattr(self.stacked, name) for name in names}
            else:
                weight = torch.cat([layer.weight.detach() for layer in self.layers])
                with skip_random_init():  # the stacked weight is copied in below
                    self.stacked = Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
                # stored in the layout the planner picks for the stacked shape, so it is never re-stored
                self.stacked.weight.data = _stored(weight, product_plan(*weight.shape).layout)
                if bias is not None:
                    self.stacked.bias.data = bias
                views = {"weight": self.stacked.weight.data}
            if bias is not None:
                views["bias"] = self.stacked.bias.data
            for layer, r in zip(self.layers, rows, strict=True):
                for name, t in views.items():
                    if isinstance(getattr(layer, name), nn.Parameter):
                        getattr(layer, name).data = t[r]
                    else:
                        setattr(layer, name, t[r])  # a buffer

    def _shared(self) -> bool:
        """Are the members' weights still views of the stacked one?"""
        if isinstance(self.stacked, QuantizedLinear):
            name = self.stacked.stored_names[0]
            return all(
                _storage(getattr(layer, name)) == _storage(getattr(self.stacked, name))
                for layer in self.layers
            )
        ptr = _storage(self.stacked.weight)
        return all(_storage(layer.weight) == ptr for layer in self.layers)

    def output(self, layer: nn.Module, x: Tensor) -> Tensor | None:
        """y = layer(x) from the stacked product of x (run when x is new); None: not a kernel call."""
        compiling = torch.compiler.is_compiling()
        fresh = self._left > 0 and self._x is x  # the members call in a row on the same x
        if not fresh:
            if not compiling and not self._shared():
                self._stack()
            s = self.stacked
            y = quantized_linear(s, x) if isinstance(s, QuantizedLinear) else decode_linear(s, x)
            if y is None:
                return None
            if not compiling and isinstance(s, Linear) and not self._shared():
                self._stack()  # the fp32 planner re-stored the stacked weight (another thread count)
            self._x, self._parts, self._left = x, y.split(self.sizes, dim=-1), len(self.layers)
        part = self._parts[layer.sibling_index]
        self._left -= 1
        if self._left == 0:
            self._x, self._parts = None, ()
        return part


def _d_out(layer: nn.Module) -> int:
    return layer.d_out if isinstance(layer, QuantizedLinear) else layer.weight.shape[0]


def _same_kind(layers: list[nn.Module]) -> bool:
    first = layers[0]
    if isinstance(first, QuantizedLinear):
        same = all(
            readable_type(layer) is QuantizedLinear
            and (layer.fmt, layer.d_in, layer.group_size, layer.activations)
            == (first.fmt, first.d_in, first.group_size, first.activations)
            for layer in layers
        )
    else:
        same = all(
            readable_type(layer) is Linear
            and layer.weight.dtype == torch.float32
            and layer.weight.shape[1] == first.weight.shape[1]
            for layer in layers
        )
    devices = {
        (layer.qweight if isinstance(layer, QuantizedLinear) else layer.weight).device.type
        for layer in layers
    }
    return same and devices == {"cpu"} and len({layer.bias is None for layer in layers}) == 1


def fuse_siblings(model: nn.Module) -> int:
    """Group every module's q/k/v and gate/up layers (when the kernels are built and the layers are
    CPU float32 Linears or QuantizedLinears of one format); returns the number of groups made.
    CS336_KERNELS_FUSE=0 turns it off."""
    if build.library() is None or os.environ.get("CS336_KERNELS_FUSE", "1") == "0":
        return 0
    made = 0
    for module in model.modules():
        for names in GROUPS:
            # nn.Module's own dictionary: getattr would raise and catch on most modules
            layers = [module._modules.get(name) for name in names]
            if any(layer is None or hasattr(layer, "siblings") for layer in layers) or not _same_kind(layers):
                continue
            group = Siblings(layers)
            for i, layer in enumerate(layers):
                layer.siblings, layer.sibling_index = group, i
            made += 1
    return made

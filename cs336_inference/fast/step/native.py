"""A fixed-shape step's decoder layers as one C call (step.c): the "native" step mode.

A compiled CPU step (fixed.py, mode "compile") leaves about 500 calls per SmolLM2 token in the
generated wrapper's Python: the products plus the fused loops of norms, rotary, softmax, SiLU and
cache writes between them. The products read the weights at close to the memory bandwidth; the
calls around them cost about a fifth of the step (docs/kernels.md). `NativeLayers` hands
all L layers to `cs336_layers` at once, which runs the same computation in C around decode.c's
product kernels, so a step is the embedding, one C call, the final norm and the output product.

Supported (`why_not` says what is not): TransformerBlocks with `Attention` (MHA / GQA / MQA, sliding
window in a static cache, Qwen2's q/k/v bias), no CLA and no MLA, whose q/k/v and gate/up are
stacked by fuse.py (on by default; groups of mixed formats, as a Q4_K_M file's, run as separate
products), every product fp32 or one of the kernels' quantized formats (int8, int4, q8_0, q4_0, q4_1,
and q5_0, q4_k, q6_k times x quantized to 8 bits as the fast layers and llama.cpp do), float32
activations, a CPU with the kernels built. Of the families'
switches (config.py): rope scaling and rope_freqs (only the cos/sin tables the caller passes differ),
N x H != D, an attention scale of one's own (query_pre_attn_scalar: the scale is an argument),
embeddings times sqrt(D) (the caller embeds), Qwen3's QK-norm (step.c normalizes each head's
queries and keys before the rotary) and Gemma 3's block: sandwich norms, GeGLU (tanh-GELU) and the
sliding layers' own rotary table (passed beside the global one; a layer flag picks). Not: partial
rotary; `model_problem` names the switch and the model runs the compiled or readable forward
instead. The model's own forward stays the reference: tests/test_graphs.py,
tests/test_families_downstream.py and tests/test_native_families.py compare the two for every
supported shape. (K-quant layers quantize x to 8 bits: where step.c's norms round one of x's numbers
across a rounding boundary that the readable forward's do not, that step's product moves by a step
of x's blocks; most steps agree to float32 rounding, and greedy tokens can part at a near tie.)

The fp32 products (the stacked groups, o_proj, down_proj and the output matrix) read panels of 16
rows (decode.c's cs336_f32_panels): a second copy of each fp32 weight made on first use
(fast/cpu/ops.panels; SmolLM2 fp32 holds 538 MB more), since the readable Linear and the prefill's
BLAS keep reading W as [O, I]. Several rows multiply faster from panels than from row-major weights
(nothing is summed across lanes at the end, and each panel is one sequential stream; the engine's
16-request step gains most), and a row's result is one fma chain per output whatever the rows,
threads or vector width.
The copy is made only where the model's fp32 weights fit in half of the available memory, decided
once per model (ops.model_panels_on); CS336_KERNELS_PANELS=0 keeps the row- or column-major weights
(no copy), as the planner stores them, and =1 makes panels whatever the memory.

Weights are read through their data pointers. Each call compares the data pointers and version
counters of the weights a step reads (270 for SmolLM2) with the last call's and describes the layers
again if one changed. The weights are looked up from the blocks by name again whenever a parameter,
buffer or submodule was assigned to any module since the last call (torch's global registration
hooks count the assignments; a lookup on every call walks a few thousand Python objects, which the
step's weights have pushed out of the CPU's caches by then). So a weight or a layer replaced since
the last call is seen (a replaced member of a stacked group is stacked again), and so is a weight
updated in place (its panels are packed again). Not seen: writes through `.data` or to an inference
tensor, which move no counter, and tensors put straight into a module's dictionaries, which call no
hook. Biases and quantization scales are not watched: one replaced on its own (its weight left as it
was) is seen only once a weight changes (fast/step/fuse.py's groups have the same limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from cs336_inference.attention import Attention
from cs336_inference.fast.autotune import decode_linear, settle
from cs336_inference.fast.cpu import build
from cs336_inference.fast.cpu.ops import (
    A8_CODE,
    FORMAT_CODES,
    K8_CODES,
    MAX_ROWS,
    k8_layer,
    linear_fp32,
    linear_panels,
    model_panels_on,
    panels,
    version,
)
from cs336_inference.fast.layers import readable_type
from cs336_inference.kv_cache import StaticKVCache
from cs336_inference.layers import GeGLU, Linear, RMSNorm, SwiGLU
from cs336_inference.quantization.linear import PackedWeight, QuantizedLinear

QK_NORMS = ("q_norm", "k_norm")  # step.c normalizes each head's queries and keys with these (QK-norm)
POST_NORMS = ("post_attn_norm", "post_mlp_norm")  # Gemma 3's sandwich norms (each branch's output)
F32_ROWS, F32_COLS, F32_PANELS = 0, 6, 7  # step.c's fp32 format codes; the quantized ones: ops.FORMAT_CODES
LOCAL_ROPE, GELU_TANH = 1, 2  # step.c's layer flags: the second rotary table; GeGLU's tanh-GELU
NO_PRODUCT = [0] * 7  # an empty product slot (O = 0): the group's first slot holds the stacked product


def _product_problem(layer) -> str | None:
    if isinstance(layer, QuantizedLinear):
        if layer.qweight.device.type != "cpu" or not (layer.fmt in FORMAT_CODES or k8_layer(layer)):
            return f"a {layer.fmt} layer"
        if layer.fmt == "int4" and layer.scale.dtype != torch.float16:
            return "an int4 layer with float32 scales"
    elif (
        readable_type(layer) is not Linear
        or layer.weight.dtype != torch.float32
        or layer.weight.device.type != "cpu"
    ):
        return f"a {type(layer).__name__} product that is not a float32 CPU Linear"
    if layer.bias is not None and (layer.bias.dtype != torch.float32 or not layer.bias.is_contiguous()):
        return "a bias that is not contiguous float32"
    return None


def why_not(model, cache) -> str | None:
    """Why the native step cannot run this model and cache (None: it can)."""
    problem = model_problem(model)
    if problem:
        return problem
    for i, store in enumerate(cache.layers):
        if not isinstance(store, StaticKVCache) or not (store.k.is_contiguous() and store.v.is_contiguous()):
            return f"layer {i}'s cache is not a contiguous static cache"
        if store.k.dtype != torch.float32 or store.k.shape[-1] != store.v.shape[-1]:
            return f"layer {i}'s cache is not float32 with equal key and value widths"
    if len({tuple(s.k.shape) for s in cache.layers}) != 1:
        return "its layers' caches differ in shape"
    return None


def model_problem(model) -> str | None:
    """Why step.c cannot run this model's decoder layers, whatever its cache (None: it can)."""
    if build.library() is None:
        return "the C kernels are not built here (CS336_KERNELS=0 or no compiler)"
    if not build.switched_on("CS336_KERNELS_FUSE"):
        return "it needs the stacked q/k/v and gate/up of fast/step/fuse.py (CS336_KERNELS_FUSE=0)"
    if model.embed.weight.dtype != torch.float32 or model.embed.weight.device.type != "cpu":
        return "it runs float32 models on the CPU"
    cfg = model.config
    H = cfg.head_dim
    if H % 2 or H > 512:
        return f"head_dim {H} is odd or above 512"
    if not cfg.is_mla and cfg.rotary_dim != H:
        return f"it rotates only {cfg.rotary_dim} of {H} head dims (partial_rotary_factor); step.c all"
    first = model.layers[0]
    for i, block in enumerate(model.layers):
        attn, mlp = block.attn, block.mlp
        if type(attn) is not Attention:
            return f"layer {i} is {type(attn).__name__} attention (MLA runs the compiled step)"
        if attn.owner != i:
            return f"layer {i} borrows its K/V (CLA runs the compiled step)"
        problem = _family_problem(i, block, first, model)
        if problem:
            return problem
        if (
            type(mlp) not in (SwiGLU, GeGLU)
            or type(block.attn_norm) is not RMSNorm
            or type(block.mlp_norm) is not RMSNorm
            or any(type(norm) is not RMSNorm for norm in _post_norms(block))
        ):
            return f"layer {i} has another MLP or norm"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            problem = _product_problem(getattr(attn, name))
            if problem:
                return f"layer {i}'s {name} is {problem}"
        for name in ("gate_proj", "up_proj", "down_proj"):
            problem = _product_problem(getattr(mlp, name))
            if problem:
                return f"layer {i}'s {name} is {problem}"
    return None


def _family_problem(i: int, block, first, model) -> str | None:
    """The switch of another family (config.py) that layer i has and step.c does not compute, if any."""
    attn = block.attn
    if len(_post_norms(block)) == 1:
        return f"layer {i} normalizes its attention or its MLP output but not both"
    if attn.local_rope and not hasattr(model, "rope_cos_local"):
        return f"layer {i} rotates with its own base, but the model holds no second rotary table"
    if len(_qk_norms(attn)) == 1:
        return f"layer {i} normalizes its queries or its keys but not both"
    norms = [block.attn_norm, block.mlp_norm, *_qk_norms(attn), *_post_norms(block)]
    if attn.scale != first.attn.scale or any(n.eps != first.attn_norm.eps for n in norms):
        return f"layer {i}'s attention scale or norm eps differs from layer 0's: step.c takes one of each"
    return None


def _post_norms(block) -> list:
    """Gemma 3's post-attention and post-MLP norms of a block (sandwich_norm), or none."""
    return [getattr(block, name) for name in POST_NORMS if hasattr(block, name)]


def _qk_norms(attn) -> list:
    """QK-norm's q_norm and k_norm of an Attention (Qwen3, Gemma 3), or none."""
    return [getattr(attn, name) for name in QK_NORMS if hasattr(attn, name)]


def _product(layer, panels_too: bool, stamp: object = None) -> list[int]:
    """step.c's {format, O, groups, weight, scale, zero, bias} of a layer (or a stacked group, whose
    members' weight versions are the stamp of its panels); an fp32 one from its panels if panels_too."""
    bias = 0 if layer.bias is None else layer.bias.data_ptr()
    if isinstance(layer, QuantizedLinear):
        scale, zero = getattr(layer, "scale", None), getattr(layer, "zero", None)
        groups = scale.shape[1] if layer.fmt == "int4" else 0
        if layer.fmt in K8_CODES:  # q5_0 / q4_k / q6_k: x quantized to 8 bits inside (decode.c's cs336_kq)
            return [K8_CODES[layer.fmt], layer.d_out, 0, layer.qweight.data_ptr(), 0, 0, bias]
        code = FORMAT_CODES[layer.fmt] + (A8_CODE if layer.activations is not None else 0)
        return [
            code, layer.d_out, groups, layer.qweight.data_ptr(),
            0 if scale is None else scale.data_ptr(), 0 if zero is None else zero.data_ptr(), bias,
        ]  # fmt: skip
    w = layer.weight
    if panels_too:
        return [F32_PANELS, w.shape[0], 0, panels(w, stamp).data_ptr(), 0, 0, bias]
    code = F32_ROWS if w.is_contiguous() else F32_COLS if w.stride() == (1, w.shape[0]) else None
    if code is None:
        raise ValueError(f"a float32 weight of strides {w.stride()} is neither row- nor column-major")
    return [code, w.shape[0], 0, w.data_ptr(), 0, 0, bias]


def _group(layers: list, panels_too: bool) -> list[int]:
    """step.c's product slots of q/k/v or gate/up: the stacked product and empty slots where fuse.py
    stacked them (one format), else each member's own product (a Q4_K_M file's mixed formats)."""
    if hasattr(layers[0], "siblings"):
        return _stacked(layers[0], panels_too) + NO_PRODUCT * (len(layers) - 1)
    return [field for layer in layers for field in _product(layer, panels_too)]


def _stacked(first, panels_too: bool) -> list[int]:
    """step.c's product of first's group, stacked again if a member's weight was replaced."""
    group = first.siblings
    if not group._shared():
        group._stack()
    members = [m.qweight if isinstance(m, QuantizedLinear) else m.weight for m in group.layers]
    return _product(group.stacked, panels_too, tuple(version(w) for w in members))


def tree_bits(mask: Tensor) -> Tensor:
    """Each row of a [T, T] bool mask (T <= 64) as the bits of one int64 (bit j = column j): a tree
    pass's `tree` argument."""
    T = mask.shape[0]
    return (mask.long() << torch.arange(T, device=mask.device)).sum(dim=-1)


class NativeLayers:
    """x -> every decoder layer of `model` applied to x (in place), for one static cache."""

    def __init__(self, model, cache):
        problem = self.why_not(model, cache)
        if problem:
            raise ValueError(f"the native step cannot run this model: {problem}")
        # q/k/v and gate/up are stacked by StaticDecodeStep (fuse_siblings) before this where they share
        # a format; the others (a Q4_K_M file's q4_k q/k and q6_k v) run as separate products
        self.model, self.cache, self.lib = model, cache, build.library()
        attn = model.layers[0].attn
        self.shape = (model.config.d_model, attn.n_heads, attn.n_kv_heads, attn.head_dim, model.config.d_ff)
        self.eps, self.scale = model.layers[0].attn_norm.eps, attn.scale
        self.windows = [block.attn.window or 0 for block in model.layers]
        self.flags = [
            (LOCAL_ROPE if block.attn.local_rope else 0) | (GELU_TANH if type(block.mlp) is GeGLU else 0)
            for block in model.layers
        ]
        self.local = any(block.attn.local_rope for block in model.layers)  # needs the second table
        # what a step reads, as (block, submodule, layer, tensor) names: a tensor or a module replaced,
        # or a tensor re-stored, moves a data pointer, and the descriptor is built again (stacking a
        # group again if one of its members moved)
        self._watch = []
        for block in model.layers:
            self._watch += [(block, "attn_norm", None, "weight"), (block, "mlp_norm", None, "weight")]
            self._watch += [(block, "attn", name, "weight") for name in QK_NORMS if hasattr(block.attn, name)]
            self._watch += [(block, name, None, "weight") for name in POST_NORMS if hasattr(block, name)]
            for part, names in (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
                for name in names:
                    layer = getattr(getattr(block, part), name)
                    self._watch.append(
                        (block, part, name, "qweight" if isinstance(layer, QuantizedLinear) else "weight")
                    )
        self._rows, self._seen = torch.empty(0, dtype=torch.int64), None
        self._assigned, self._tensors, self._versioned = None, [], []
        # fp32 products from panels, decided once (else the planner's layout)
        self.panels = model_panels_on(model)
        for block in model.layers if not self.panels else ():
            for layer in (block.attn.o_proj, block.mlp.down_proj):
                if isinstance(layer, Linear):
                    settle(layer)

    why_not = staticmethod(why_not)

    def _stores(self, i: int) -> tuple[Tensor, Tensor]:
        """Layer i's key and value storage (their data pointers go into the descriptor)."""
        store = self.cache.layers[i]
        return store.k, store.v

    def _layers(self) -> Tensor:
        """The layers' descriptor for step.c, rebuilt when a watched tensor moved (else the last one)."""
        if self._assigned != _assignments:  # something was assigned to a module: look the weights up again
            self._assigned = _assignments
            self._tensors = self._lookup()
            self._versioned = [t for t in self._tensors if not t.is_inference()]
        seen = self._pointers()
        if seen != self._seen:
            self._rows = self._describe()
            self._seen = self._pointers()
        return self._rows

    def _lookup(self) -> list[Tensor]:
        # nn.Module's own dictionaries: a third of the time of getattr through Module.__getattr__
        tensors = []
        for block, part, name, tensor in self._watch:
            module = block._modules[part]
            module = module if name is None else module._modules[name]
            t = module._parameters.get(tensor)
            tensors.append(module._buffers[tensor] if t is None else t)
        return tensors

    def _pointers(self) -> tuple[list[int], list[int]]:
        # the tensors' data pointers and version counters (inference tensors keep none): a few hundred
        # objects, which the step's weights have pushed out of the CPU's caches by the next call
        return [t.data_ptr() for t in self._tensors], [t._version for t in self._versioned]

    def _describe(self) -> Tensor:
        rows, codes = [], set()
        for i, block in enumerate(self.model.layers):
            attn, mlp, (k, v) = block.attn, block.mlp, self._stores(i)
            rows += [block.attn_norm.weight.data_ptr(), block.mlp_norm.weight.data_ptr()]
            rows += [k.data_ptr(), v.data_ptr(), self.windows[i]]
            # QK-norm (Qwen3): each head's queries and keys RMS-normalized before the rotary (0: none)
            rows += [norm.weight.data_ptr() for norm in _qk_norms(attn)] or [0, 0]
            # Gemma 3's sandwich norms (0: none) and the layer's flags
            rows += [norm.weight.data_ptr() for norm in _post_norms(block)] or [0, 0]
            rows += [self.flags[i]]
            for product in (
                _group([attn.q_proj, attn.k_proj, attn.v_proj], self.panels), _product(attn.o_proj, self.panels),
                _group([mlp.gate_proj, mlp.up_proj], self.panels), _product(mlp.down_proj, self.panels),
            ):  # fmt: skip
                rows += product
                codes.update(product[j] for j in range(0, len(product), 7) if product[j + 1])
        # every kernel but the panels' keeps at most MAX_ROWS rows' sums on its stack
        self.max_rows = MAX_ROWS if codes - {F32_PANELS} else 1 << 62
        return torch.tensor(rows, dtype=torch.int64)

    def __call__(
        self,
        x: Float[Tensor, "B T D"],
        cos: Float[Tensor, "B T H"],
        sin: Float[Tensor, "B T H"],
        steps: Int[Tensor, " T"],
        pad: Int[Tensor, " B"],
        tree: Int[Tensor, " T"] | None = None,
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Float[Tensor, "B T D"]:
        """tree: a tree pass (speculative_tree.py): new step steps[0] + i sees the new steps whose bits
        tree[i] sets (its ancestors and itself), T <= 64. local: the sliding layers' own (cos, sin)
        (ctx.local_rope; needed where a layer rotates with its own base). B * T rows: up to MAX_ROWS
        unless every product reads fp32 panels (ValueError, one line)."""
        B, T, _ = x.shape
        D, N, K, H, F = self.shape
        S = self.cache.layers[0].k.shape[2]
        layers = self._layers()
        if B * T > self.max_rows:
            raise ValueError(
                f"the native step takes up to {self.max_rows} rows with these weights, got {B * T}"
            )
        if tree is None:
            dims = [B, T, D, N, K, H, F, S]
            return self._run(self.lib.cs336_layers, layers, dims, x, local, cos, sin, steps, pad)
        if T > 64 or not hasattr(self.lib, "cs336_layers_tree"):
            raise ValueError(f"the native tree pass takes up to 64 nodes with this library, got {T}")
        dims = [B, T, D, N, K, H, F, S]
        return self._run(self.lib.cs336_layers_tree, layers, dims, x, local, cos, sin, steps, pad, tree)

    def _run(self, fn, layers: Tensor, dims: list[int], x: Tensor, local, *inputs: Tensor) -> Tensor:
        """fn(dims + [threads, cos_local, sin_local], the layers' descriptor, L, eps, scale, x, *inputs):
        x updated in place. local: the sliding layers' own (cos, sin), shaped as the inputs' cos and sin."""
        if self.local and local is None:
            raise ValueError("this model's sliding layers rotate with their own table: pass local=(cos, sin)")
        local = [] if local is None else [t.contiguous() for t in local]
        x, inputs = x.contiguous(), [t.contiguous() for t in inputs]
        tables = [t.data_ptr() for t in local] or [0, 0]
        dims = torch.tensor([*dims, torch.get_num_threads(), *tables], dtype=torch.int64)
        pointers = [t.data_ptr() for t in inputs]
        status = fn(dims.data_ptr(), layers.data_ptr(), len(self.model.layers), self.eps, self.scale, x.data_ptr(), *pointers)  # fmt: skip
        if status != 0:
            raise MemoryError("the native step could not allocate its work buffers")
        return x


class OutputHead:
    """The output product of a step, logits = h W_vocab^T.

    A quantized output matrix runs its own layer (what F.linear(h, PackedWeight) does). A float one
    takes our fp32 product first when `ours_first` (the native steps: each row's logits then do not
    depend on how many rows share the call), from panels as the layers' products (else with the
    matrix re-stored once in its planned layout); else the planned product of fast/autotune.py, which
    the model's own last line (F.linear) does not take; F.linear where neither runs.
    """

    bias = None  # a bias-free Linear, for decode_linear

    def __init__(self, model, ours_first: bool):
        w = model.vocab_weight
        self.layer = w.layer if isinstance(w, PackedWeight) else None
        self.weight, self.ours_first = w, ours_first
        self.panels = ours_first and model_panels_on(model)  # decided once, as NativeLayers
        if self.layer is None and ours_first and not self.panels:
            settle(self)

    def __call__(self, h: Float[Tensor, "... D"]) -> Float[Tensor, "... V"]:
        if self.layer is not None:
            return self.layer(h)
        y = None
        if self.ours_first:
            y = linear_panels(h, self.weight) if self.panels else linear_fp32(h, self.weight)
        if y is None:
            y = decode_linear(self, h)
        return F.linear(h, self.weight) if y is None else y


# Every parameter, buffer or submodule assigned to any module (nn.Module.__setattr__, register_*) bumps
# this count, through torch's global registration hooks: NativeLayers looks its weights up in the
# modules again only when it moved, and otherwise checks the tensors it holds
_assignments = 0


def _assigned(*args) -> None:
    global _assignments
    _assignments += 1


for _register in (
    register_module_parameter_registration_hook,
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
):
    _register(_assigned)


PHASES = ("norms", "qkv", "rope", "attend", "o", "residual", "gateup", "silu", "down")  # step.c's order

"""Python side of the kernels: check the arguments, allocate y, call the C function.

Every function returns None (the caller runs its readable PyTorch path) unless the kernels are
built and the call is a decode shape they handle: float32 x on the CPU with 1..MAX_ROWS rows, no
autograd graph to build. The checks are kept cheap: a decode step of SmolLM2 makes 211 calls.

Under torch.compile (fast/step/fixed.py compiles the fixed-shape decode step) the same calls go
through the ops `cs336::linear_f32`, `cs336::quantized` and `cs336::llm_int8`, which the compiler keeps as
opaque calls (ctypes and data pointers cannot be traced); eagerly the C function is called directly,
since a custom op's dispatch costs more than the call itself.

Q5_0, Q4_K and Q6_K layers multiply with 8-bit activations as llama.cpp does (`k8_layer`, decode.c's
cs336_kq, equal bit for bit to quantization/k8.py's k8_linear, which FastQuantizedLinear runs where the
kernel declines); they have no compiled op, so a compiled step traces k8_linear, and the native step
(step.c) does not take them.
"""

from __future__ import annotations

import ctypes
import os
import sys

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from cs336_inference.fast.cpu import build
from cs336_inference.fast.gpu.products import quantized_cuda

MAX_ROWS = 32  # more fp32 rows (prefill) stay on BLAS; 32 = MAX_M of decode.c
# Quantized layers run a short prefill through the kernels too, MAX_ROWS rows per call: the readable
# path dequantizes every weight on every call first, which BLAS wins back only on long
# prompts (docs/kernels.md: the measurement and its snippet).
QUANTIZED_MAX_ROWS = 96
GGML = {"q8_0": 3, "q4_0": 4, "q4_1": 5}  # the format codes of decode.c
# Q5_0, Q4_K and Q6_K always multiply with 8-bit activations, as llama.cpp does (decode.c's cs336_kq,
# equal bit for bit to quantization/k8.py's k8_linear). Not in FORMAT_CODES (the compiled ops do not
# take them); step.c does, under these codes (fast/step/native.py's _product).
K8_CODES = {"q5_0": 8, "q4_k": 9, "q6_k": 10}


def _rows(x: Tensor, d_in: int, needs_grad: bool, max_rows: int = MAX_ROWS) -> tuple[Tensor, int, int] | None:
    """(x, M, ldx): x as M rows of d_in float32 numbers, row i at x.data_ptr() + 4 * i * ldx; None if
    this is not a call for the kernels (more than max_rows rows, or not float32 on the CPU, or needing
    autograd)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != d_in:
        return None
    if (needs_grad or x.requires_grad) and torch.is_grad_enabled():
        return None
    if not x.is_contiguous():
        x = x.reshape(-1, d_in)
        if x.stride(-1) != 1:
            x = x.contiguous()
        M, ldx = x.shape[0], x.stride(0)
    else:
        M, ldx = x.numel() // d_in, d_in
    return (x, M, ldx) if 1 <= M <= max_rows else None


def _fp32_operands(x: Tensor, weight: Tensor, bias: Tensor | None, max_rows: int = MAX_ROWS):
    """(the kernels' library, _rows(x)) where x W^T + b can run on them in float32 on the CPU, else None."""
    lib = build.library()
    if lib is None or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    rows = _rows(
        x, weight.shape[1], weight.requires_grad or (bias is not None and bias.requires_grad), max_rows
    )
    return None if rows is None else (lib, rows)


def linear_fp32(
    x: Float[Tensor, "... I"], weight: Float[Tensor, "O I"], bias: Tensor | None = None
) -> Float[Tensor, "... O"] | None:
    """x W^T + b with W row-major ([O, I] contiguous) or column-major (W^T contiguous); None: not handled."""
    operands = _fp32_operands(x, weight, bias)
    if operands is None:
        return None
    lib, rows = operands
    d_out, d_in = weight.shape
    if weight.is_contiguous():
        fn = lib.cs336_f32_rows
    elif weight.stride() == (1, d_out):
        fn = lib.cs336_f32_cols
    else:
        return None
    if torch.compiler.is_compiling():
        return _compiled_ops().linear_f32(x, weight, bias)
    x2, M, ldx = rows
    y = torch.empty(*x.shape[:-1], d_out)
    fn(x2.data_ptr(), M, d_in, ldx, weight.data_ptr(), d_out, bias if bias is None else bias.data_ptr(), y.data_ptr(),
       torch.get_num_threads())  # fmt: skip
    return y


PANEL = 16  # output rows per panel: decode.c's PW
_panels = WeakIdKeyDictionary()  # weight -> (data pointer, version, its panels)
PANEL_MEMORY_SHARE = 0.5  # panels are made only if their bytes fit in this share of the available memory
_panels_refused: set[int] = set()  # sizes already warned about


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def panels_on(nbytes: int = 0) -> bool:
    """Whether the native steps run their fp32 products from panels, a second copy of nbytes of weights:
    CS336_KERNELS_PANELS=0 says never and =1 always; unset, only if nbytes fit in PANEL_MEMORY_SHARE of
    the available memory (a large fp32 model would otherwise take twice its size; told once)."""
    setting = os.environ.get("CS336_KERNELS_PANELS", "").strip()
    if setting:
        return build.switched_on("CS336_KERNELS_PANELS")
    free = available_memory()
    if free is None or nbytes <= PANEL_MEMORY_SHARE * free:
        return True
    if nbytes not in _panels_refused:
        _panels_refused.add(nbytes)
        print(f"cs336: fp32 weights not copied into panels: {nbytes / 2**30:.1f} GiB more, with "
              f"{free / 2**30:.1f} GiB available (CS336_KERNELS_PANELS=1 copies them anyway)", file=sys.stderr)  # fmt: skip
    return False


_fits = WeakIdKeyDictionary()  # model -> whether its panels fit the memory, decided on its first step


def model_panels_on(model: torch.nn.Module) -> bool:
    """panels_on for all of a model's fp32 weights. Where memory decides, it decides once per model: a
    later step (another shape, the engine's) must not find less memory because the panels were made,
    and switch products, and so bits, midway."""
    if os.environ.get("CS336_KERNELS_PANELS", "").strip():
        return panels_on()
    if model not in _fits:
        _fits[model] = panels_on(fp32_weight_bytes(model))
    return _fits[model]


def fp32_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's float32 matrices on the CPU: what panels of every product would copy."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(
        p.numel() * 4 for p in params if p.dtype == torch.float32 and p.dim() == 2 and p.device.type == "cpu"
    )


def pack_panels(w: Float[Tensor, "O I"]) -> Float[Tensor, "P I 16"]:
    """W as decode.c's panels: out[p, i, k] = W[16 p + k, i], the last panel padded with zero rows."""
    padded = F.pad(w.detach(), (0, 0, 0, -w.shape[0] % PANEL))
    return rearrange(padded, "(p k) i -> p i k", k=PANEL).contiguous()


def version(t: Tensor) -> int:
    return 0 if t.is_inference() else t._version  # inference tensors keep no version counter


def panels(weight: Float[Tensor, "O I"], stamp: object = None) -> Float[Tensor, "P I 16"]:
    """The panels of an fp32 weight: a second copy, made on first use and again whenever the weight was
    re-stored (a new data pointer) or updated in place (its version counter moved; not for an
    inference tensor, nor for writes through `.data`, which no counter sees). stamp: what stands for
    the version instead (a stacked weight: its members' versions, since their views count apart)."""
    key = (weight.data_ptr(), version(weight) if stamp is None else stamp)
    entry = _panels.get(weight)
    if entry is None or entry[:2] != key:
        with torch.inference_mode(weight.is_inference()), torch.no_grad():
            entry = (*key, pack_panels(weight))
        _panels[weight] = entry
    return entry[2]


def linear_panels(
    x: Float[Tensor, "... I"], weight: Float[Tensor, "O I"], bias: Tensor | None = None
) -> Float[Tensor, "... O"] | None:
    """x W^T + b from W's panels (any number of rows); None where linear_fp32 would not run either."""
    operands = _fp32_operands(x, weight, bias, max_rows=1 << 62)
    if operands is None or torch.compiler.is_compiling():
        return None
    lib, (x2, M, ldx) = operands
    d_out, d_in = weight.shape
    y = torch.empty(*x.shape[:-1], d_out)
    lib.cs336_f32_panels(x2.data_ptr(), M, d_in, ldx, panels(weight).data_ptr(), d_out,
                         bias if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())  # fmt: skip
    return y


def fma_per_second(threads: int | None = None) -> float | None:
    """Multiply-adds per second of the kernels' own vector fma from registers (decode.c's
    cs336_fma_rate), on torch's thread count unless given; None without the kernels. Every extra row
    of a product costs one multiply-add per weight, so this is the best an extra row can do."""
    lib = build.library()
    return None if lib is None else lib.cs336_fma_rate(threads or torch.get_num_threads(), 1_000_000)


# The ops a compiled step calls (fast/step/fixed.py), registered with the low-level torch.library API:
# torch.library.custom_op would add an autograd layer to every call (about 8 us of the ~30 us a call
# costs, measured), and these run only under inference mode. Each has a fake (shape-only) version
# for the compiler's tracing.
_LIB = torch.library.Library("cs336", "DEF")
_LIB.define("linear_f32(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define(
    "quantized(Tensor x, Tensor q, Tensor? scale, Tensor? zero, Tensor? bias, int fmt, int d_out) -> Tensor"
)
_LIB.define("llm_int8(Tensor x, Tensor q, Tensor scale, Tensor? bias, float threshold) -> Tensor")


def _linear_f32_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    y = linear_fp32(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


@torch.library.register_fake("cs336::linear_f32")
def _fake_linear_f32(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def k8_layer(layer) -> bool:
    """Whether the fast path multiplies this layer with 8-bit activations (quantization/k8.py): a
    Q5_0, Q4_K or Q6_K layer on the CPU, as llama.cpp always does."""
    return layer.fmt in K8_CODES and layer.activations is None and layer.qweight.device.type == "cpu"


def quantized_linear(layer, x: Float[Tensor, "... I"]) -> Float[Tensor, "... O"] | None:
    """FastQuantizedLinear's product: y = x dequantize(stored)^T + b from the stored bytes (None: declined).
    Layers with 8-bit activations (Q8_0 blocks: layer.activations; Q5_0 / Q4_K / Q6_K: `k8_layer`)
    give their reference's numbers instead (quantization/a8.py, k8.py)."""
    q = layer.qweight
    if q.device.type != "cpu":  # the GPU path (fast/gpu/products.py) needs no build
        cuda = q.device.type == "cuda" and build.enabled() and layer.activations is None
        return quantized_cuda(layer, x) if cuda else None
    lib = build.library()
    if lib is None:
        return None
    compiling = torch.compiler.is_compiling()  # the compiled ops take up to MAX_ROWS rows
    # 8-bit activations have no BLAS path (their products are integer sums): every prompt length
    integer = layer.activations is not None or k8_layer(layer)
    limit = MAX_ROWS if compiling else 1 << 62 if integer else QUANTIZED_MAX_ROWS
    rows = _rows(x, layer.d_in, False, limit)
    fmt, bias = layer.fmt, layer.bias
    if rows is None or (bias is not None and bias.dtype != torch.float32):
        return None
    if fmt not in FORMAT_CODES and not k8_layer(layer):
        return None
    if fmt == "int4" and layer.scale.dtype != torch.float16:
        return None
    if integer and compiling:  # no compiled op for these: the reference is traced
        return None
    siblings = getattr(layer, "siblings", None)  # q/k/v or gate/up as one product (fast/step/fuse.py)
    if siblings is not None:
        return siblings.output(layer, x)
    scale, zero = getattr(layer, "scale", None), getattr(layer, "zero", None)
    if compiling:
        return _compiled_ops().quantized(x, layer.qweight, scale, zero, bias, FORMAT_CODES[fmt], layer.d_out)
    a8 = layer.activations is not None
    return _quantized_call(lib, rows, x, layer.qweight, scale, zero, bias, fmt, layer.d_out, a8)


def _quantized_call(lib, rows, x, q, scale, zero, bias, fmt: str, d_out: int, a8: bool = False) -> Tensor:
    x2, M, ldx = rows
    y = torch.empty(*x.shape[:-1], d_out)
    bias, threads = None if bias is None else bias.data_ptr(), torch.get_num_threads()
    for m in range(0, M, MAX_ROWS):  # a prefill: MAX_ROWS rows per call, each reading the weights once
        _quantized_rows(lib, x2.data_ptr() + 4 * m * ldx, min(MAX_ROWS, M - m), x.shape[-1], ldx,
                        q, scale, zero, bias, fmt, d_out, y.data_ptr() + 4 * m * d_out, threads, a8)  # fmt: skip
    return y


def _quantized_rows(
    lib, x_ptr, M, d_in, ldx, q, scale, zero, bias, fmt: str, d_out: int, y_ptr, threads, a8: bool = False
) -> None:
    """One C call on M <= MAX_ROWS rows: x and y as data pointers, bias a data pointer or None; a8:
    x in Q8_0 blocks (quantization/a8.py); q5_0 / q4_k / q6_k: x in 8-bit blocks (k8.py)."""
    if fmt in K8_CODES:
        _kq(lib)(K8_CODES[fmt], x_ptr, M, d_in, ldx, q.data_ptr(), d_out, bias, y_ptr, threads)
    elif a8:
        groups = scale.shape[1] if fmt == "int4" else 0
        lib.cs336_a8(
            FORMAT_CODES[fmt], x_ptr, M, d_in, ldx, q.data_ptr(), scale.data_ptr() if groups else None,
            zero.data_ptr() if groups else None, groups, d_out, bias, y_ptr, threads,
        )  # fmt: skip
    elif fmt == "int8":
        lib.cs336_int8(
            x_ptr,
            M,
            d_in,
            ldx,
            q.data_ptr(),
            scale.data_ptr(),
            d_out,
            bias,
            y_ptr,
            threads,
        )
    elif fmt == "int4":
        lib.cs336_int4(
            x_ptr, M, d_in, ldx, q.data_ptr(), scale.data_ptr(), zero.data_ptr(), scale.shape[1], d_out,
            bias, y_ptr, threads,
        )  # fmt: skip
    else:
        lib.cs336_ggml(GGML[fmt], x_ptr, M, d_in, ldx, q.data_ptr(), d_out, bias, y_ptr, threads)


def _kq(lib):
    """decode.c's cs336_kq with its argument types (declared here on first use: build.py predates it)."""
    fn = lib.cs336_kq
    if fn.argtypes is None:
        i64, p = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes, fn.restype = [ctypes.c_int, p, i64, i64, i64, p, i64, p, p, ctypes.c_int], None
    return fn


FORMAT_CODES = {"int8": 1, "int4": 2, **GGML}
A8_CODE = 16  # step.c: A8 + format code, the product with x in Q8_0 blocks
_FORMAT_NAMES = {code: name for name, code in FORMAT_CODES.items()}


def _quantized_op(
    x: Tensor, q: Tensor, scale: Tensor | None, zero: Tensor | None, bias: Tensor | None, fmt: int, d_out: int
) -> Tensor:
    rows = _rows(x, x.shape[-1], False)
    return _quantized_call(build.library(), rows, x, q, scale, zero, bias, _FORMAT_NAMES[fmt], d_out)


@torch.library.register_fake("cs336::quantized")
def _fake_quantized(x, q, scale, zero, bias, fmt: int, d_out: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], d_out)


_FAKES = {"linear_f32": _fake_linear_f32, "quantized": _fake_quantized}


def llm_int8_linear(layer, x: Float[Tensor, "... I"]) -> Float[Tensor, "... O"] | None:
    """LLMInt8Linear's forward (llm_int8 / w8a8) with its int8 x int8 product in `cs336_w8a8`
    (AVX512-VNNI where the CPU has it): the same numbers as llm_int8_matmul + bias, bit for bit."""
    lib = build.library()
    q, bias = layer.qweight, layer.bias
    if lib is None or q.device.type != "cpu" or (bias is not None and bias.dtype != torch.float32):
        return None
    if _rows(x, layer.d_in, False) is None:
        return None
    if torch.compiler.is_compiling():
        return torch.ops.cs336.llm_int8(x, q, layer.scale, bias, float(layer.threshold))
    return _llm_int8_call(lib, x, q, layer.scale, bias, float(layer.threshold))


def _llm_int8_call(lib, x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, threshold: float) -> Tensor:
    """llm_int8_matmul's steps (quantization/llm_int8.py), its int8 product in C: the outlier
    features (|x| >= threshold in some row) are zeroed for the int8 product and added in float."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    M, d_in, d_out = x2.shape[0], x2.shape[1], q.shape[0]
    outliers = (x2.abs() >= threshold).any(dim=0) if threshold != float("inf") else None
    if outliers is not None and not outliers.any():
        outliers = None
    xq = x2 if outliers is None else x2.masked_fill(outliers, 0)
    y = torch.empty(M, d_out)
    b = bias.data_ptr() if bias is not None and outliers is None else None  # else added after, as there
    lib.cs336_w8a8(xq.data_ptr(), M, d_in, d_in, q.data_ptr(), scale.data_ptr(), d_out, b, y.data_ptr(),
                   torch.get_num_threads())  # fmt: skip
    if outliers is not None:
        y = y + x2[:, outliers] @ (q[:, outliers].float() * scale[:, None]).t()
        y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], d_out)


def _llm_int8_op(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, threshold: float) -> Tensor:
    return _llm_int8_call(build.library(), x, q, scale, bias, threshold)


@torch.library.register_fake("cs336::llm_int8")
def _(x, q, scale, bias, threshold: float) -> Tensor:
    return x.new_empty(*x.shape[:-1], q.shape[0])


_LIB.impl("linear_f32", _linear_f32_op, "CPU")
_LIB.impl("quantized", _quantized_op, "CPU")
_LIB.impl("llm_int8", _llm_int8_op, "CPU")


# The same two ops with C++ bodies (native.cpp), which a compiled step calls when they load: a call
# through the dispatcher into a Python body costs about 15 us more than the ctypes call it wraps
# (a 64 x 576 int8 product, measured on an AMD EPYC), and SmolLM2's step makes 211 of them. Tried once, by step/fixed.py.compiled_forward() before it
# compiles; if the build fails (no ninja, no headers) the Python bodies above run, said once on stderr.
_native: bool | None = None


def load_native() -> bool:
    """Build and load native.cpp and hand it decode.c's entry points; True if its ops are usable."""
    global _native
    if _native is None:
        lib = build.library()
        _native = False
        if lib is not None and build.switched_on("CS336_KERNELS_NATIVE"):
            try:
                build.build_native()
                names = ("cs336_f32_rows", "cs336_f32_cols", "cs336_int8", "cs336_int4", "cs336_ggml")
                torch.ops.cs336_native.set_kernels(
                    [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
                )
                _native = True
            except Exception as e:  # no ninja, no headers, a failed build
                print(
                    f"cs336_inference.fast: C++ op bodies not built ({' '.join(str(e).split())[:200]}); "
                    "compiled steps call the Python bodies",
                    file=sys.stderr,
                )
        if _native:
            for name in ("linear_f32", "quantized"):
                torch.library.register_fake(f"cs336_native::{name}")(_FAKES[name])
    return _native


def _compiled_ops():
    """The op namespace a compiled step calls: cs336_native if load_native() succeeded, else cs336."""
    return torch.ops.cs336_native if _native else torch.ops.cs336

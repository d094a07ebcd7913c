"""Fast products for the decode shapes (x of 1..32 rows times a weight), staff code.

Decode reads every weight once per step for a few FLOPs per byte, so its speed is bytes over
bandwidth, and a product must (1) read the stored weight (int8, int4, llama.cpp blocks) without
first materializing it in float32, and (2) run all the rows of a short call (a speculative
verification, a small batch) against one read of the weight. The readable references
(quantization/linear.py, layers.Linear) do neither; these kernels do both, and give each row a
result bitwise independent of how many rows share the call.

build.py    compiles decode.c, amx.c and step.c on first use (gcc -O3 -march=native -fopenmp, ~1-7 s), cached; loads it
            with ctypes. No compiler, a failed build or CS336_KERNELS=0: the PyTorch path runs
            (a failed build says so once on stderr).
decode.c    the kernels: fp32 (row- or column-major), int8, int4, Q8_0, Q4_0, Q4_1 weights times float
            activations; int8 x int8 (llm_int8 / w8a8: activations quantized per row, AVX512-VNNI)
amx.c       int4 and int8 on Intel AMX bf16 tiles with x in three bf16 parts (fp32's numbers): a 17-row
            step for 2.2-2.3 one-row ones, but the one row 1.2-1.5x slower, so opt-in (CS336_KERNELS_AMX=1)
ops.py      argument checks and calls (None when a call is not one the kernels handle); the ops
            cs336::* that a compiled step calls, with Python bodies
native.cpp  the same ops with C++ bodies (cs336_native::*), built with torch.utils.cpp_extension
            when a step is first compiled (tens of seconds, cached); they save ~12 us per call. Not built
            (no ninja, no headers, CS336_KERNELS_NATIVE=0): the Python bodies run, said once.
layout.py   the fp32 path of layers.Linear: layout and product chosen per shape by measurement
fuse.py     q/k/v and gate/up, which read the same x, as one product over their stacked weights
            (the fixed-shape step turns it on; CS336_KERNELS_FUSE=0 turns it off)
graphs.py   the decode step with fixed shapes: replayed as a CUDA graph on a GPU, torch.compile'd on
            the CPU (the products above stay opaque custom ops), run natively, or run eagerly
step.c      every decoder layer of a fixed-shape step in one C function around decode.c's products
native_step.py  its arguments (FixedStep mode "native"; MHA/GQA/MQA, windows, fp32 and 5 formats)
cuda.py     GPU weight-only products for bf16 activations: int4 through tinygemm, int8 through
triton_int8.py  a Triton kernel that reads the int8 weight once

quantization.linear.KERNELS is filled from QUANTIZED; layers.Linear calls `decode_linear`.
An fp32 prefill (more than 32 rows) stays on BLAS. 32 covers a speculative verification of up to 31
drafts. Quantized layers run up to QUANTIZED_MAX_ROWS rows (a short prompt) 32 at a time through the
kernels, since their readable path dequantizes every weight first; longer prompts take it.
"""

from .build import enabled, library
from .layout import decode_linear
from .ops import MAX_ROWS, QUANTIZED_MAX_ROWS, linear_fp32, llm_int8_linear, quantized_linear

QUANTIZED = {fmt: quantized_linear for fmt in ("int8", "int4", "q8_0", "q4_0", "q4_1")}

__all__ = [
    "MAX_ROWS",
    "QUANTIZED_MAX_ROWS",
    "QUANTIZED",
    "decode_linear",
    "enabled",
    "library",
    "linear_fp32",
    "llm_int8_linear",
    "quantized_linear",
]

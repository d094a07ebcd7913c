"""CPU products for the decode shapes (x of 1..32 rows times a weight), in C.

build.py    compiles decode.c, amx.c and step.c on first use (gcc -O3 -march=native -fopenmp), caches the
            shared library and loads it with ctypes. No compiler, a failed build or CS336_KERNELS=0:
            `library()` is None and the readable path runs (a failed build says so once on stderr).
decode.c    fp32 (row- or column-major, or in panels of 16 rows), int8, int4, Q8_0, Q4_0, Q4_1 weights times float activations;
            int8 x int8 (llm_int8 / w8a8, AVX512-VNNI where present); 4/8-bit blocks x Q8_0 activations
amx.c       int4 and int8 on Intel AMX bf16 tiles (opt-in: CS336_KERNELS_AMX=1; docs/kernels.md says why)
step.c      every decoder layer of a fixed-shape step in one C function (fast/step/native.py drives it)
ops.py      argument checks and calls (None when a call is not one the kernels handle), and the ops
            cs336::* that a compiled step calls
native.cpp  those ops with C++ bodies, built with torch.utils.cpp_extension when a step is first compiled

An fp32 prefill (more than MAX_ROWS = 32 rows) stays on BLAS; 32 covers a speculative verification of
up to 31 drafts. Quantized layers run up to QUANTIZED_MAX_ROWS rows (a short prompt) 32 at a time
through the kernels, since their readable path dequantizes every weight first.
"""

from cs336_inference.fast.cpu.build import enabled, library
from cs336_inference.fast.cpu.ops import (
    MAX_ROWS,
    QUANTIZED_MAX_ROWS,
    linear_fp32,
    linear_panels,
    llm_int8_linear,
    quantized_linear,
)

__all__ = [
    "MAX_ROWS",
    "QUANTIZED_MAX_ROWS",
    "enabled",
    "library",
    "linear_fp32",
    "linear_panels",
    "llm_int8_linear",
    "quantized_linear",
]

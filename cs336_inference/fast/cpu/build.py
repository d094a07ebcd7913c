"""Build decode.c (the products), amx.c (int8 and int4 products on AMX tiles) and step.c (the decoder
layers) on first use, as one library loaded with ctypes; None (and one line on stderr) if that fails.

The shared library is cached under $CS336_KERNELS_CACHE (default ~/.cache/cs336_inference/fast),
named by a hash of the source, the compiler, its flags and this CPU's feature flags, so a changed
source or another CPU builds anew and concurrent processes never see a half-written file.

    CS336_KERNELS=0        never build or use the kernels (the readable PyTorch path runs)
    CS336_KERNELS_CC=gcc   the C compiler (default: $CC, else gcc)
    CS336_KERNELS_MARCH=x  compile for -march=x instead of the running CPU (tests: the AVX2 path)
    CS336_KERNELS_NATIVE=0 compiled steps call the ops' Python bodies, not native.cpp's C++ ones
    CS336_KERNELS_AMX=1    int4 and int8 products of every row count on Intel AMX tiles (amx.c; off
                           by default: faster from about 5 rows, 1.2-1.5x slower at one)

Why a plain C file + ctypes: it builds in about a second with no torch headers (a
torch.utils.cpp_extension build of the same kernels takes tens of seconds and needs ninja and the
headers), and the per-call overhead through ctypes is a few microseconds, small next to a
decode step's products (see the package docstring for the numbers).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("decode.c")
STEP_SOURCE = Path(__file__).with_name("step.c")  # the decoder layers in one call (fast/step/native.py)
AMX_SOURCE = Path(__file__).with_name("amx.c")  # int8 and int4 on AMX tiles (CS336_KERNELS_AMX=1)
SOURCES = (SOURCE, AMX_SOURCE, STEP_SOURCE)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp"]


def compile_flags() -> list[str]:
    """FLAGS, with -march from $CS336_KERNELS_MARCH if set (tests build the AVX2 and plain x86-64 code
    paths on an AVX-512 machine this way)."""
    march = os.environ.get("CS336_KERNELS_MARCH", "").strip()
    return [f"-march={march}" if f == "-march=native" and march else f for f in FLAGS]


_lib: ctypes.CDLL | None = None
_tried = False
amx_on = False  # int4 and int8 products on AMX tiles (CS336_KERNELS_AMX=1 on a CPU that has them)


def switched_on(variable: str, default: str = "1") -> bool:
    """An on/off environment variable, on unless set (or by default) to 0 / false / no / off."""
    return os.environ.get(variable, default).strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return switched_on("CS336_KERNELS")


def _cpu_fingerprint() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "cs336_inference" / "fast"
    return Path(os.environ.get("CS336_KERNELS_CACHE", default))


def _compile(cc: str, flags: list[str], out: Path, sources: tuple[Path, ...] = SOURCES) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        target = Path(tmp) / out.name
        # no time limit: a cold build on a busy 2-core machine can take minutes, and a compiler ends
        subprocess.run(
            [cc, *flags, *map(str, sources), "-o", str(target), "-lm"], check=True, capture_output=True
        )
        os.replace(target, out)  # atomic: another process sees the whole file or none


def _declare(lib: ctypes.CDLL, every: bool = True) -> None:
    """Argument and result types of the library's functions; every=False: skip the ones it lacks
    (an older revision's build, which bench/kernels_ab.py loads)."""
    i64, p, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    signatures = {
        "cs336_f32_rows": [p, i64, i64, i64, p, i64, p, p, i32],
        "cs336_f32_cols": [p, i64, i64, i64, p, i64, p, p, i32],
        "cs336_f32_panels": [p, i64, i64, i64, p, i64, p, p, i32],
        "cs336_int8": [p, i64, i64, i64, p, p, i64, p, p, i32],
        "cs336_int4": [p, i64, i64, i64, p, p, p, i64, i64, p, p, i32],
        "cs336_ggml": [i32, p, i64, i64, i64, p, i64, p, p, i32],
        "cs336_w8a8": [p, i64, i64, i64, p, p, i64, p, p, i32],
        "cs336_a8": [i32, p, i64, i64, i64, p, p, p, i64, i64, p, p, i32],
        "cs336_exp": [p, i64],
        "cs336_silu_mul": [p, i64, i64, p, i32],
        "cs336_step_profile": [i32, p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name) if every else getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = args, None
    lib.cs336_has_avx2.restype = ctypes.c_int
    lib.cs336_fma_rate.argtypes, lib.cs336_fma_rate.restype = [i32, i64], ctypes.c_double
    f32 = ctypes.c_float
    lib.cs336_layers.argtypes = [p, p, i64, f32, f32, p, p, p, p, p]
    lib.cs336_layers.restype = ctypes.c_int
    if hasattr(lib, "cs336_layers_paged"):  # an older revision's library (bench/kernels_ab.py) may lack it
        lib.cs336_layers_paged.argtypes = [p, p, i64, f32, f32, p, p, p, p, p]
        lib.cs336_layers_paged.restype = ctypes.c_int
    if hasattr(lib, "cs336_layers_tree"):
        lib.cs336_layers_tree.argtypes = [p, p, i64, f32, f32, p, p, p, p, p, p]
        lib.cs336_layers_tree.restype = ctypes.c_int
    lib.cs336_amx_enable.argtypes, lib.cs336_amx_enable.restype = [i32], ctypes.c_int


def _compiler(cc: str | None = None) -> str:
    return cc or os.environ.get("CS336_KERNELS_CC") or os.environ.get("CC") or "gcc"


def _one_line(error: Exception | None) -> str:
    """The error and the first line of the compiler's stderr, if it said anything."""
    detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace").strip().splitlines()[:1]
    return f"{error}{': ' + detail[0] if detail else ''}"


def build_from(sources: list[Path], out: Path) -> ctypes.CDLL:
    """A library from other copies of SOURCES (another revision's, for bench/kernels_ab.py),
    compiled as `build` compiles, not cached; one line if that fails."""
    try:
        _compile(_compiler(), compile_flags(), out, tuple(sources))
        lib = ctypes.CDLL(str(out))
        _declare(lib, every=False)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        raise RuntimeError(f"building {', '.join(p.name for p in sources)}: {_one_line(e)}") from None
    return lib


@contextlib.contextmanager
def _one_builder(path: Path):
    """An exclusive lock on path's lock file: another process building the same library waits for it
    and then loads what it built."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(cc: str | None = None) -> ctypes.CDLL:
    """Compile (or find in the cache) and load the library; raises on any failure."""
    cc = _compiler(cc)
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler {cc!r} on PATH")
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    last_error: Exception | None = None
    chosen = compile_flags()
    for flags in (chosen, chosen[:-1]):  # without OpenMP if the compiler has none
        key = hashlib.sha256(
            b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu_fingerprint().encode()])
        )
        path = cache_dir() / f"decode-{key.hexdigest()[:16]}.so"
        try:
            with _one_builder(path):  # processes started together (pytest -n 2) share one build
                if not path.exists():  # tens of seconds on a busy 2-core machine: say so
                    print(
                        f"cs336_inference.fast: compiling {', '.join(p.name for p in SOURCES)} for this CPU, "
                        f"once (cached in {cache_dir()})",
                        file=sys.stderr,
                        flush=True,
                    )
                    _compile(cc, flags, path)
            lib = ctypes.CDLL(str(path))
            _declare(lib)
            return lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            last_error = e
    raise RuntimeError(_one_line(last_error))


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when disabled or the build failed (said once on stderr)."""
    global _lib, _tried
    if _lib is not None or _tried:
        return _lib
    if not enabled():
        return None  # checked again on the next call (a test may switch the variable)
    if not _tried:
        _tried = True
        try:
            _lib = build()
            _switch_amx(_lib)
        except Exception as e:  # no compiler, a failed build, a library that does not load
            print(
                f"cs336_inference.fast: kernels not built ({' '.join(str(e).split())[:200]}); using the PyTorch path",
                file=sys.stderr,
            )
            _lib = None
    return _lib


def _switch_amx(lib: ctypes.CDLL) -> None:
    """CS336_KERNELS_AMX=1: int8 and int4 products on AMX tiles (one line on stderr where there are none)."""
    global amx_on
    wanted = switched_on("CS336_KERNELS_AMX", default="0")
    amx_on = bool(lib.cs336_amx_enable(int(wanted)))
    if wanted and not amx_on:
        print(
            "cs336_inference.fast: CS336_KERNELS_AMX=1 but no AMX here; int8 and int4 run on AVX",
            file=sys.stderr,
        )


@contextlib.contextmanager
def amx_switched_on():
    """int8 / int4 products on AMX tiles inside the block (it gets whether they are), as before after it."""
    lib = library()
    on = lib is not None and bool(lib.cs336_amx_enable(1))
    try:
        yield on
    finally:
        if lib is not None:
            lib.cs336_amx_enable(int(amx_on))


NATIVE_SOURCE = Path(__file__).with_name("native.cpp")


def build_native() -> None:
    """Compile (or find in the cache) native.cpp, the C++ bodies of the compiled step's ops, and load
    it (it registers the ops `cs336_native::*`); raises on any failure. A torch.utils.cpp_extension
    build: it needs ninja and torch's headers and takes tens of seconds, so only compiled steps ask."""
    import torch
    from torch.utils import cpp_extension

    key = hashlib.sha256(b"\0".join([NATIVE_SOURCE.read_bytes(), torch.__version__.encode()])).hexdigest()[
        :16
    ]
    directory = cache_dir() / f"native-{key}"
    built = directory / f"cs336_native_{key}.so"
    if built.exists():
        torch.ops.load_library(str(built))
        return
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:  # concurrent builds never share a folder
        cpp_extension.load(
            name=f"cs336_native_{key}",
            sources=[str(NATIVE_SOURCE)],
            extra_cflags=["-O2"],
            build_directory=tmp,
            is_python_module=False,
            verbose=False,
        )  # loads it too
        os.replace(Path(tmp) / built.name, built)


def reset() -> None:
    """Forget the loaded library (tests: build again, e.g. with another compiler)."""
    global _lib, _tried, amx_on
    _lib, _tried, amx_on = None, False, False

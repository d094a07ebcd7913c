"""The fp32 decode path of layers.Linear: which weight layout and which product, chosen by measurement.

For a decode-shaped call (1..32 rows) the fastest of four ways to compute x W^T depends on the CPU,
its BLAS and the shape: torch's F.linear or our kernel, with W stored row-major ([O, I] contiguous)
or column-major (W^T contiguous, how layers.transposed_empty allocates it). `product_plan(O, I)` times the
four on random weights of that shape at M = 1 and M = 5 rows (once per shape and thread count per
process, under a second for SmolLM2's shapes) and keeps the one with the smallest total. Each
candidate runs over a ring of copies of the weight (RING_BYTES in all, at most RING_COPIES), as a
decode step reads its weights: one after another, not one small matrix called again and again from
the core's own cache.
Our kernel is kept unless torch is more than OURS_MARGIN faster: with it a row's result does not
depend on the number of rows (below), and at several rows it streams better than BLAS (SmolLM2's
fp32 multi-token forwards; docs/kernels.md), while the per-shape totals of the two measure within a
few percent of each other, either way from run to run.

One product per shape for every M in 1..32, never a switch between M = 1 and M = 2: with our
kernel, a row's result is then bitwise the same whatever the number of rows (what speculative
verification relies on); BLAS gives no such promise.

CS336_KERNELS_FP32=ours | torch | auto (default) forces the product (the layout is still measured).
Plans are kept in a file between processes (`plans_file`), so only a machine's first run pays for
the timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cs336_inference.fast.cpu import build
from cs336_inference.fast.cpu.ops import MAX_ROWS, linear_fp32

_plans: dict[tuple[int, int, int, str], Plan] = {}
_latest: dict[tuple[int, int], Plan] = {}  # the plan last used per shape (what a compiled step reads)


@dataclass(frozen=True)
class Plan:
    layout: str  # "rows" | "cols"
    product: str  # "ours" | "torch"
    seconds: dict[str, float]  # the measured candidates, "product/layout" -> seconds (M = 1 plus M = 5)


def _stored(w: Tensor, layout: str) -> Tensor:
    return w.contiguous() if layout == "rows" else w.t().contiguous().t()


def _median_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


RING_BYTES = 64 * 2**20  # the copies a candidate is timed over (one copy if the weight is larger),
RING_COPIES = 128  # and at most this many (a small model's weights sit in a cache anyway)
OURS_MARGIN = 0.10  # our kernel unless torch's total is more than 10% smaller


@torch.inference_mode()
def measure(d_out: int, d_in: int, force: str = "auto") -> Plan:
    """Time the four (product, layout) candidates for an [O, I] weight; the fastest one's Plan.

    Seconds per call, at M = 1 plus M = 5, each call on the next copy of a ring of RING_BYTES.
    """
    g = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=g)
    xs = [torch.randn(m, d_in, generator=g) for m in (1, 5)]
    n = min(RING_COPIES, max(1, RING_BYTES // w.nbytes))
    seconds = {}
    for layout in ("cols", "rows"):
        stored = _stored(w, layout)
        ring = [stored.clone() for _ in range(n)]  # clone keeps the layout's strides
        for product in ("torch", "ours"):
            if force != "auto" and product != force:
                continue
            fn = linear_fp32 if product == "ours" else F.linear
            seconds[f"{product}/{layout}"] = sum(
                _median_time(lambda x=x, fn=fn, ring=ring: [fn(x, c) for c in ring]) / n for x in xs
            )
        ring = []  # freed before the other layout's copies are made
    best = min(seconds, key=seconds.get)
    ours = min((k for k in seconds if k.startswith("ours")), key=seconds.get, default=None)
    if ours is not None and seconds[ours] <= (1 + OURS_MARGIN) * seconds[best]:
        best = ours
    product, layout = best.split("/")
    return Plan(layout, product, seconds)


def _key(d_out: int, d_in: int) -> tuple[int, int, int, str]:
    return (d_out, d_in, torch.get_num_threads(), os.environ.get("CS336_KERNELS_FP32", "auto"))


def plans_file() -> Path | None:
    """Where measured plans are kept between processes: $CS336_AUTOTUNE_CACHE (0: nowhere), by default
    autotune.json beside the built kernels. A plan is keyed by the CPU, torch, threads and shape."""
    where = os.environ.get("CS336_AUTOTUNE_CACHE")
    if where == "0":
        return None
    return Path(where) if where else build.cache_dir() / "autotune.json"


def _file_key(key: tuple[int, int, int, str]) -> str:
    d_out, d_in, threads, force = key
    cpu = hashlib.sha256(build._cpu_fingerprint().encode()).hexdigest()[:16]
    return f"cpu {cpu}, torch {torch.__version__}, {threads} threads, {force}, {d_out}x{d_in}"


def _read_plans(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_plan(path: Path, name: str, p: Plan) -> None:
    """Add one plan to the file (written whole to a temporary file, then renamed into place)."""
    saved = _read_plans(path)
    saved[name] = {"layout": p.layout, "product": p.product, "seconds": p.seconds}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: plans are measured again next time


def product_plan(d_out: int, d_in: int) -> Plan:
    """The plan for this shape: from this process, else from the plans file, else measured (and saved)."""
    key = _key(d_out, d_in)
    if key not in _plans:
        force = key[3] if build.library() is not None else "torch"
        path = plans_file()
        saved = None if path is None else _read_plans(path).get(_file_key(key))
        if (
            saved is not None
            and saved.get("product") in ("ours", "torch")
            and saved.get("layout") in ("rows", "cols")
        ):
            _plans[key] = Plan(saved["layout"], saved["product"], dict(saved.get("seconds", {})))
        else:
            _plans[key] = measure(d_out, d_in, force)
            if path is not None:
                _write_plan(path, _file_key(key), _plans[key])
    _latest[(d_out, d_in)] = _plans[key]
    return _plans[key]


def decode_linear(layer, x: Tensor) -> Tensor | None:
    """y = layer(x) for a decode-shaped x through the planned product (None: let F.linear run).

    The first call for a layer may re-store its weight in the planned layout (same values and
    shape; only the strides change).
    """
    weight = layer.weight
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or x.numel() > MAX_ROWS * x.shape[-1]
        or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        or build.library() is None
    ):
        return None
    siblings = getattr(layer, "siblings", None)  # q/k/v or gate/up as one product (fast/step/fuse.py)
    if siblings is not None:
        return siblings.output(layer, x)
    if torch.compiler.is_compiling():  # the plan and the layout were settled by an eager call
        p = _latest.get(tuple(weight.shape))
        return linear_fp32(x, weight, layer.bias) if p is not None and p.product == "ours" else None
    if _get_current_dispatch_mode() is not None:  # FLOP counting, tracing: keep the op visible
        return None
    p = settle(layer)
    return linear_fp32(x, weight, layer.bias) if p.product == "ours" else None


def settle(layer) -> Plan:
    """The plan for layer's fp32 weight shape, with the weight re-stored in its layout if it was not
    (same values and shape; only the strides change). The native step settles its layers this way."""
    weight = layer.weight
    p = product_plan(*weight.shape)
    if (p.layout == "rows") != weight.is_contiguous():
        # A normal tensor even under inference_mode, so the model can still be trained afterwards;
        # but an inference tensor (a model loaded under inference_mode) stays one: a Parameter made
        # there cannot hold a normal tensor (every later op on it raised "Inference tensors do not
        # track version counter")
        with torch.inference_mode(weight.is_inference()), torch.no_grad():
            weight.data = _stored(weight.data, p.layout)
    return p

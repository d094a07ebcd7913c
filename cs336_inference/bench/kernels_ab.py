"""Two builds of the kernels timed in turns on the products of one decode step (staff tool).

A kernel change is measured against the sources of another git revision, in one process: both
libraries are loaded, every product of a SmolLM2 decode step (the native step's shapes: stacked
q/k/v, o, stacked gate/up and down for 30 layers, then the output matrix) runs through one build and
then the other, alternating which goes first, and the medians of the rounds are compared. The weights
are made by this project's quantizers from random numbers (the timing does not depend on their
values), so each format reads the bytes a quantized SmolLM2 reads. A change that only reorders work
should keep the bits: `same` says whether both builds gave identical outputs.

    python scripts/benchmark.py kernels --base HEAD~3 --formats int4,q4_0 --rows 1,5,17

With --passes, the same turns time whole T-token passes of the native step on SmolLM2 instead
(`compare_passes`): the decoder layers (step.c, with its products, norms, attention and SwiGLU) run
in one build and then the other; the embedding and the output matrix run in the working tree's.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from cs336_inference.fast.cpu import build, ops
from cs336_inference.quantization import QuantizedLinear

SMOLLM2_PRODUCTS = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
FORMATS = ("fp32", "int8", "int4", "q8_0", "q4_0", "q4_1")


def build_at(revision: str, workdir: Path) -> ctypes.CDLL:
    """The kernels library built from the sources at a git revision of this repository (one line if
    the revision or its build fails)."""
    root = Path(__file__).resolve().parents[2]
    paths = []
    for source in build.SOURCES:
        name = source.relative_to(root).as_posix()
        shown = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{name}"], capture_output=True)
        if shown.returncode != 0:  # a revision from before the kernels moved to fast/cpu/
            old = "/".join(("cs336_inference", "kernels", source.name))  # that folder is gone now
            shown = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{old}"], capture_output=True)
        if shown.returncode != 0:
            raise ValueError(f"cannot read {name} at {revision!r}: {shown.stderr.decode().strip()}")
        (workdir / source.name).write_bytes(shown.stdout)
        paths.append(workdir / source.name)
    return build.build_from(paths, workdir / "base.so")


def weights(fmt: str, shapes: list[tuple[int, int]], seed: int = 0) -> list[tuple]:
    """One stored weight per (d_out, d_in): the fp32 tensor, or the QuantizedLinear's tensors."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for d_out, d_in in shapes:
        w = torch.randn(d_out, d_in, generator=g) * 0.02
        if fmt == "fp32":
            out.append((w,))
        else:
            layer = QuantizedLinear.from_weight(w, fmt)
            out.append((layer.qweight, getattr(layer, "scale", None), getattr(layer, "zero", None)))
    return out


def step(lib, fmt: str, shapes, stored, x: torch.Tensor, M: int, ys, threads: int) -> None:
    """Every product once: y = x[:M] W^T, one C call each."""
    for (d_out, d_in), w, y in zip(shapes, stored, ys, strict=True):
        if fmt == "fp32":
            lib.cs336_f32_rows(
                x.data_ptr(), M, d_in, d_in, w[0].data_ptr(), d_out, None, y.data_ptr(), threads
            )
        else:
            q, scale, zero = w
            ops._quantized_rows(lib, x.data_ptr(), M, d_in, d_in, q, scale, zero, None, fmt, d_out, y.data_ptr(), threads)  # fmt: skip


def compare(
    base: str,
    formats=FORMATS,
    rows=(1, 2, 5, 9, 17),
    rounds: int = 9,
    shapes=SMOLLM2_PRODUCTS,
    threads: int | None = None,
    log=print,
) -> dict:
    """Medians of `rounds` alternating rounds of both builds, per format and number of rows."""
    for fmt in formats:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}: expected some of {', '.join(FORMATS)}")
    if not rows or max(rows) > ops.MAX_ROWS or min(rows) < 1:
        raise ValueError(f"rows must be between 1 and {ops.MAX_ROWS}")
    threads = threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(base, Path(tmp)), "tree": build.build()}
        x = torch.randn(
            max(rows), max(d_in for _, d_in in shapes), generator=torch.Generator().manual_seed(1)
        )
        results = []
        for fmt in formats:
            stored = weights(fmt, list(shapes))
            ys = {k: [torch.zeros(max(rows), d_out) for d_out, _ in shapes] for k in libs}
            for M in rows:
                times: dict[str, list[float]] = {k: [] for k in libs}
                for r in range(rounds + 1):  # round 0 warms both up
                    order = list(libs) if r % 2 else list(reversed(libs))
                    for k in order:
                        start = time.perf_counter()
                        step(libs[k], fmt, shapes, stored, x, M, ys[k], threads)
                        if r:
                            times[k].append(time.perf_counter() - start)
                same = all(torch.equal(a[:M], b[:M]) for a, b in zip(ys["base"], ys["tree"], strict=True))
                med = {k: statistics.median(v) for k, v in times.items()}
                results.append(
                    {
                        "format": fmt,
                        "rows": M,
                        "base_ms": med["base"] * 1e3,
                        "tree_ms": med["tree"] * 1e3,
                        "ratio": med["tree"] / med["base"],
                        "same": same,
                    }  # fmt: skip
                )
                log(f"  {fmt} M={M}: base {med['base'] * 1e3:.2f} ms, tree {med['tree'] * 1e3:.2f} ms")
    return {"base": base, "threads": threads, "rounds": rounds, "products": len(shapes), "results": results}


def format_compare(r: dict) -> str:
    lines = [
        f"kernels at {r['base']} (base) against the working tree (tree): {r['products']} products a step, "
        f"{r['threads']} threads, median of {r['rounds']} alternating rounds",
        "",
        f"{'format':8s}{'rows':>5s}{'base ms':>10s}{'tree ms':>10s}{'tree/base':>11s}  same bits",
    ]
    for x in r["results"]:
        lines.append(
            f"{x['format']:8s}{x['rows']:5d}{x['base_ms']:10.2f}{x['tree_ms']:10.2f}{x['ratio']:10.2f}x  "
            f"{'yes' if x['same'] else 'no'}"
        )
    return "\n".join(lines)


@torch.inference_mode()
def compare_passes(
    base: str,
    model,
    formats=("fp32",),
    sizes=(1, 5, 17),
    rounds: int = 9,
    contexts=(32,),
    log=print,
) -> dict:
    """Medians of `rounds` alternating rounds: one native T-token pass against a cache holding a
    prompt of each length in `contexts` (attention reads that many keys per query), per format (the
    output matrix quantized too) and T, with cs336_layers from each build; "same" says whether the two
    gave identical logits; "cost" is each build's pass over its pass of sizes[0] at that context."""
    from cs336_inference.fast.step.fixed import FixedStep
    from cs336_inference.quantization import quantize_model

    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_at(base, Path(tmp)), "tree": build.library()}
        results = []
        g = torch.Generator().manual_seed(0)
        prompts = {c: torch.randint(0, model.config.vocab_size, (c,), generator=g) for c in contexts}
        # the passes' own tokens (a pass may be longer than the prompt)
        fed = torch.randint(0, model.config.vocab_size, (1, max(sizes)), generator=g)
        for fmt in formats:
            m = model if fmt == "fp32" else quantize_model(model, fmt, quantize_head=True)
            for prompt_len in contexts:
                prompt, medians = prompts[prompt_len], {}
                # the prompt goes in once; each pass is truncated back to it
                cache = m.new_cache(1, prompt_len + max(sizes) + 1)
                m(prompt[None], cache=cache)
                for T in sizes:
                    step = FixedStep(m, cache, "native", T)
                    times: dict[str, list[float]] = {k: [] for k in libs}
                    logits = {}
                    for r in range(rounds + 1):  # round 0 warms both up
                        for k in list(libs) if r % 2 else list(reversed(libs)):
                            step.step.native.lib = libs[k]
                            start = time.perf_counter()
                            logits[k] = step(fed[:, :T]).clone()
                            seconds = time.perf_counter() - start
                            cache.truncate(prompt_len)
                            if r:
                                times[k].append(seconds)
                    medians[T] = {k: statistics.median(v) for k, v in times.items()}
                    same = torch.equal(logits["base"], logits["tree"])
                    results.append(
                        {
                            "format": fmt,
                            "context": prompt_len,
                            "T": T,
                            "base_ms": medians[T]["base"] * 1e3,
                            "tree_ms": medians[T]["tree"] * 1e3,
                            "ratio": medians[T]["tree"] / medians[T]["base"],
                            "same": same,
                        }
                    )
                    log(
                        f"  {fmt}, context {prompt_len}, T={T}: base {medians[T]['base'] * 1e3:.2f} ms, "
                        f"tree {medians[T]['tree'] * 1e3:.2f} ms"
                    )
                for x in results:
                    if x["format"] == fmt and x["context"] == prompt_len:
                        x["base_cost"] = medians[x["T"]]["base"] / medians[sizes[0]]["base"]
                        x["tree_cost"] = medians[x["T"]]["tree"] / medians[sizes[0]]["tree"]
    return {
        "base": base,
        "rounds": rounds,
        "sizes": list(sizes),
        "contexts": list(contexts),
        "results": results,
    }


def format_passes(r: dict) -> str:
    T0 = r["sizes"][0]
    lines = [
        f"native T-token passes, layers by the kernels at {r['base']} (base) and by the working tree (tree), "
        f"median of {r['rounds']} alternating rounds; cost: the pass over the T = {T0} pass of the same build "
        "at the same context (tokens in the cache before the pass)",
        "",
        f"{'format':8s}{'context':>8s}{'T':>4s}{'base ms':>10s}{'tree ms':>10s}{'tree/base':>11s}{'base cost':>11s}"
        f"{'tree cost':>11s}  same bits",
    ]
    for x in r["results"]:
        lines.append(
            f"{x['format']:8s}{x['context']:8d}{x['T']:4d}{x['base_ms']:10.2f}{x['tree_ms']:10.2f}"
            f"{x['ratio']:10.2f}x"
            f"{x['base_cost']:10.2f}x{x['tree_cost']:10.2f}x  {'yes' if x['same'] else 'no'}"
        )
    return "\n".join(lines)

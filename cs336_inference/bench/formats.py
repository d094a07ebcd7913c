"""Decode speed per weight format, in one interleaved run: does fewer bytes buy speed?

For one checkpoint, greedy, batch 1: our decode tokens/s in fp32 and each quantized format (the
decode kernels of cs336_inference/fast doing the products), transformers' `generate` on the
same fp32 weights, and llama.cpp (llama-cpp-python, optional) on GGUF files of the same weights
that we write ourselves (io.gguf_write.save_gguf). Runs are interleaved round by round (every
contender once per round, medians over rounds), so load on a shared machine hits all of them alike.

Next to each: bytes read per decode step (weights as stored + the KV cache at the average context),
the roofline step time (bytes / read bandwidth measured in the same run) and the fraction reached;
and the cost of a forward of T tokens against the cache relative to one token (T = 1, 2, 5, 9, 17:
what a speculative verification of T - 1 drafts costs). `plot` draws tokens/s against bits per
weight with the roofline curve.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_inference import accounting as acc
from cs336_inference.bench.timing import interleaved_rounds, read_bandwidth
from cs336_inference.model import TransformerLM

Log = Callable[[str], None]
T_SIZES = (1, 2, 5, 9, 17)
LLAMA_CPP_TYPES = {"fp32": "f32", "q8_0": "q8_0", "q4_0": "q4_0"}
LLAMA_CPP_HINT = (
    "llama.cpp skipped: llama-cpp-python is not installed (no binary wheel on PyPI: "
    "`pip install llama-cpp-python` compiles llama.cpp, about 15 minutes on 2 cores with cmake and a C++ "
    "compiler; on a CPU with AMX, build it without AMX, see docs/kernels.md)"
)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def weight_bytes(model: TransformerLM) -> int:
    """Bytes of weights a decode step reads: everything stored once (tied table once)."""
    from cs336_inference.quantization import model_nbytes

    lookup_only = (
        0 if model.lm_head is None else model.embed.weight.numel() * model.embed.weight.element_size()
    )
    return model_nbytes(model) - lookup_only


@torch.inference_mode()
def decode_seconds(model: TransformerLM, prompt: torch.Tensor, n: int, step_mode: str | None = None) -> float:
    """Seconds per decode step over n greedy steps after the prefill (argmax, no sampling overhead).

    step_mode "compile" / "native": the steps run fast/step/fixed.py's fixed-shape step, under
    torch.compile (its first call compiles, once per process and model) or with the decoder layers
    in one C call (fast/step/native.py); its first step is made before the clock starts."""
    cache = model.new_cache(1, len(prompt) + n + 2)
    token = model(prompt[None], cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    if step_mode is not None:
        from cs336_inference.fast.step.fixed import FixedStep

        step = FixedStep(model, cache, step_mode)
        token = step(token[:, 0]).argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        for _ in range(n):
            token = step(token[:, 0]).argmax(-1, keepdim=True)
        return (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        token = model(token, cache=cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    return (time.perf_counter() - t0) / n


def _timed_forward(
    model: TransformerLM, prompt: torch.Tensor, T: int, step_mode: str | None = None
) -> Callable[[], float]:
    """A function that times one forward of T tokens against a cache holding the prompt, then drops
    those T tokens from the cache (step_mode "native": the fixed-shape step of T tokens, as
    speculative decoding's verify pass runs it). Call this and the function under inference_mode."""
    cache = model.new_cache(1, len(prompt) + max(T_SIZES) + 1)
    model(prompt[None], cache=cache)
    ids = prompt[None, :T]
    if step_mode is not None:
        from cs336_inference.fast.step.fixed import FixedStep

        step = FixedStep(model, cache, step_mode, T)
        forward = lambda: step(ids)  # noqa: E731
    else:
        forward = lambda: model(ids, cache=cache)  # noqa: E731

    def timed() -> float:
        t0 = time.perf_counter()
        forward()
        seconds = time.perf_counter() - t0
        cache.truncate(len(prompt))
        return seconds

    return timed


@torch.inference_mode()
def forward_seconds(
    model: TransformerLM, prompt: torch.Tensor, T: int, repeats: int, step_mode: str | None = None
) -> float:
    """Median seconds of one forward of T tokens against a cache holding the prompt (after one
    untimed forward)."""
    timed = _timed_forward(model, prompt, T, step_mode)
    return statistics.median([timed() for _ in range(repeats + 1)][1:])


@torch.inference_mode()
def t_token_seconds(
    model: TransformerLM, prompt: torch.Tensor, repeats: int, step_mode: str | None = None
) -> dict[int, float]:
    """Median seconds of a T-token forward against the cache, for T in T_SIZES. The sizes take
    turns, one forward each per round, so a machine that speeds up or slows down during the
    measurement (these VMs do, by tens of percent) moves every T alike and their ratios hold."""
    timed = {T: _timed_forward(model, prompt, T, step_mode) for T in T_SIZES}
    times: dict[int, list[float]] = {T: [] for T in T_SIZES}
    for r in range(repeats + 1):
        for T, f in timed.items():
            seconds = f()
            if r:  # the first round warms up
                times[T].append(seconds)
    return {T: statistics.median(ts) for T, ts in times.items()}


def hf_decode_seconds(hf, prompt: torch.Tensor, n: int) -> float:
    """transformers generate: (time for n + 1 tokens - time for 1 token) / n, i.e. per decode step."""
    ids, mask = prompt[None], torch.ones(1, len(prompt), dtype=torch.long)

    @torch.inference_mode()
    def run(k):
        t0 = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False)
        return time.perf_counter() - t0

    return (run(n + 1) - run(1)) / n


def load_llama_cpp(model: TransformerLM, qtype: str, workdir: Path, log: Log, gguf_source=None):
    """A llama_cpp.Llama on our own GGUF export of `model` in qtype (its tokenizer copied from the GGUF
    `gguf_source`: llama.cpp refuses a file without one), or None (llama-cpp-python missing)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from cs336_inference.io.gguf_write import save_gguf

    path = workdir / f"model-{qtype}.gguf"
    save_gguf(model, path, qtype=qtype, source=gguf_source)
    log(f"  llama.cpp: {path.name}")
    return Llama(str(path), n_ctx=512, n_threads=torch.get_num_threads(), verbose=False)


def llama_decode_seconds(llm, prompt: torch.Tensor, n: int) -> float:
    llm.reset()
    llm.eval(prompt.tolist())
    t0 = time.perf_counter()
    for _ in range(n):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    return (time.perf_counter() - t0) / n


def format_benchmark(
    model: TransformerLM,
    prompt: torch.Tensor,
    formats: list[str],
    new_tokens: int,
    rounds: int,
    hf=None,
    llama_cpp: bool = True,
    log: Log = lambda msg: None,
    quantize_head: bool = False,
    compiled: bool = False,
    gguf_source=None,
    native: bool = False,
    amx: bool = False,
) -> dict:
    """The interleaved comparison (module docstring) as a JSON-ready dict.

    quantize_head: the quantized formats store the output matrix (the tied embedding) in their
    format too (as llama.cpp's files do); otherwise it stays float32, a quarter of the int8 model's
    bytes per step. gguf_source: the GGUF file the model came from (llama.cpp's rows take its tokenizer;
    without one they are skipped). compiled / native: rows "ours FMT compiled" / "ours FMT native"
    with fast/step/fixed.py's fixed-shape step in that mode; native also measures the T-token
    costs of its T-token steps ("t_token_cost_native"). amx (with native): rows "ours FMT native amx"
    for int8 and int4 with their products on AMX tiles (fast/cpu/amx.c, switched on around each of
    those timings only), and their T-token costs ("t_token_cost_native_amx")."""
    from cs336_inference.fast import cpu as kernels
    from cs336_inference.fast import install
    from cs336_inference.quantization import quantize_model

    models = {  # each through the fast path (the kernels), as the CLI runs it
        fmt: install(model if fmt == "fp32" else quantize_model(model, fmt, quantize_head=quantize_head))
        for fmt in formats
    }
    bandwidth = read_bandwidth(max(weight_bytes(model), 64 * 2**20), repeats=7)
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    fma = kernels.ops.fma_per_second()  # the arithmetic roof of the extra rows of a T-token forward
    if fma is not None:
        log(f"fp32 multiply-adds {fma / 1e9:.0f} G/s (the kernels' vector fma, from registers)")
    contenders: dict[str, Callable[[], float]] = {
        f"ours {fmt}": (lambda m=m: decode_seconds(m, prompt, new_tokens)) for fmt, m in models.items()
    }
    if compiled:
        for fmt, m in models.items():
            contenders[f"ours {fmt} compiled"] = lambda m=m: decode_seconds(m, prompt, new_tokens, "compile")
    if native:
        for fmt, m in models.items():
            contenders[f"ours {fmt} native"] = lambda m=m: decode_seconds(m, prompt, new_tokens, "native")
    amx_models = {fmt: m for fmt, m in models.items() if fmt in AMX_FORMATS} if native and amx else {}
    for fmt, m in amx_models.items():
        contenders[f"ours {fmt} native amx"] = lambda m=m: on_amx(
            decode_seconds, m, prompt, new_tokens, "native"
        )
    if hf is not None:
        contenders["transformers fp32"] = lambda: hf_decode_seconds(hf, prompt, new_tokens)
    llama_note = None
    if llama_cpp and gguf_source is None:
        llama_cpp, llama_note = (
            False,
            "llama.cpp skipped: it needs the model as a GGUF file (for its tokenizer)",
        )
    with tempfile.TemporaryDirectory() as tmp:
        if llama_cpp:
            for fmt, qtype in LLAMA_CPP_TYPES.items():
                llm = load_llama_cpp(model, qtype, Path(tmp), log, gguf_source)
                if llm is None:
                    llama_note = LLAMA_CPP_HINT
                    break
                contenders[f"llama.cpp {fmt}"] = lambda llm=llm: llama_decode_seconds(llm, prompt, new_tokens)
        times = interleaved_rounds(contenders, rounds, log)

    S = len(prompt) + new_tokens // 2
    kv = acc.kv_cache_bytes(model.config, 1, S, 4)
    params = sum(p.numel() for p in model.parameters())  # the weights a step reads (as weight_bytes):
    params -= 0 if model.lm_head is None else model.embed.weight.numel()  # an untied table is a lookup
    rows = {}
    for name, ts in times.items():
        step = statistics.median(ts)
        fmt = name.split()[1]
        m = models.get(fmt, model)
        wb = weight_bytes(m) if fmt in models else None
        if name.startswith("llama.cpp"):
            wb = (
                None  # its own file's bytes (it quantizes the same tensors, the table too): not ours to count
            )
        row = {"decode_step_s": step, "tokens_per_s": 1 / step, "runs_s": ts}
        if wb is not None:
            step_bytes = wb + kv
            row |= {
                "weight_bytes": wb,
                "bits_per_weight": 8 * wb / params,
                "bytes_per_step": step_bytes,
                "roofline_step_s": step_bytes / bandwidth,
                "roofline_fraction": step_bytes / bandwidth / step,
            }
        rows[name] = row
    fp32 = rows["ours fp32"]["tokens_per_s"] if "ours fp32" in rows else None
    for row in rows.values():
        row["vs_ours_fp32"] = row["tokens_per_s"] / fp32 if fp32 else None

    log("T-token forwards")
    t_cost, floor, floor_native = {}, {}, {}

    def floor_of(fmt: str, base: float) -> dict[int, float] | None:
        """A bound on the T-token cost from arithmetic alone: T rows are T x params multiply-adds,
        at best at the fma peak (memory reads and weight decoding could all overlap them). None for
        the "_a8" methods: their rows are integer dot products, which this fp32 peak does not bound."""
        if fma is None or fmt.endswith("_a8"):
            return None
        return {T: max(1.0, T * params / fma / base) for T in T_SIZES}

    def costs(seconds: dict[int, float]) -> dict[int, float]:
        return {T: seconds[T] / seconds[1] for T in T_SIZES}

    for fmt, m in models.items():
        seconds = t_token_seconds(m, prompt, 2 * rounds + 3)
        t_cost[fmt], floor[fmt] = costs(seconds), floor_of(fmt, seconds[1])
        log(f"  {fmt}: " + ", ".join(f"T={T} {v:.2f}x" for T, v in t_cost[fmt].items()))
    t_native = {}
    for fmt, m in models.items() if native else ():
        seconds = t_token_seconds(m, prompt, 2 * rounds + 3, "native")
        t_native[fmt], floor_native[fmt] = costs(seconds), floor_of(fmt, seconds[1])
        log(f"  {fmt} native steps: " + ", ".join(f"T={T} {v:.2f}x" for T, v in t_native[fmt].items()))
    t_amx = {}
    for fmt, m in amx_models.items():
        t_amx[fmt] = costs(on_amx(t_token_seconds, m, prompt, 2 * rounds + 3, "native"))
        log(f"  {fmt} native steps on AMX: " + ", ".join(f"T={T} {v:.2f}x" for T, v in t_amx[fmt].items()))
    return {
        "env": {
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "kernels": kernels.library() is not None,
            "amx": kernels.build.amx_on,  # int4 and int8 products on AMX tiles (CS336_KERNELS_AMX=1)
            "read_bandwidth_bytes_per_s": bandwidth,
            "fma_per_s": fma,  # fp32 multiply-adds per second from registers (None: no kernels)
            "load_average": os.getloadavg(),
            "python": sys.version.split()[0],
        },
        "settings": {
            "prompt_len": len(prompt),
            "new_tokens": new_tokens,
            "rounds": rounds,
            "avg_context": S,
            "quantize_head": quantize_head,
            "compiled": compiled,
            "native": native,
            "amx": bool(amx_models),
        },
        "parameters": params,
        "kv_bytes_per_step": kv,
        "rows": rows,
        "t_token_cost": t_cost,
        "t_token_cost_native": t_native,
        "t_token_cost_native_amx": t_amx,
        # the least T-token cost arithmetic allows: max(1, T x params / fma_per_s / (T = 1 seconds))
        "t_token_floor": {f: v for f, v in floor.items() if v is not None},
        "t_token_floor_native": {f: v for f, v in floor_native.items() if v is not None},
        "llama_cpp": llama_note or "ran",
    }


AMX_FORMATS = ("int8", "int4")  # the formats fast/cpu/amx.c runs


def on_amx(fn, *args):
    """fn(*args) with the int8 / int4 products on AMX tiles, the switch as it was afterwards."""
    from cs336_inference.fast.cpu import build

    with build.amx_switched_on():
        return fn(*args)


def format_formats_table(r: dict) -> str:
    env, st = r["env"], r["settings"]
    lines = [
        f"decode by weight format: {env['cpu']}, {env['threads']} threads, torch {env['torch']}, kernels "
        f"{'on' if env['kernels'] else 'OFF'}{' (int4, int8 on AMX)' if env.get('amx') else ''}; read bandwidth {env['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
        f"batch 1, prompt {st['prompt_len']}, {st['new_tokens']} greedy steps, median of {st['rounds']} "
        f"interleaved rounds; load average {env['load_average'][0]:.1f}; output matrix of the quantized "
        f"formats: {'quantized' if st.get('quantize_head') else 'float32'}",
        "",
        f"{'':<24}{'tok/s':>8}{'vs fp32':>9}{'bits/w':>8}{'MB/step':>9}{'roofline':>10}",
    ]
    for name, row in r["rows"].items():
        bits = f"{row['bits_per_weight']:.2f}" if "bits_per_weight" in row else "-"
        mb = f"{row['bytes_per_step'] / 1e6:.0f}" if "bytes_per_step" in row else "-"
        frac = f"{row['roofline_fraction']:.0%}" if "roofline_fraction" in row else "-"
        vs = f"{row['vs_ours_fp32']:.2f}x" if row.get("vs_ours_fp32") else "-"
        lines.append(f"{name:<24}{row['tokens_per_s']:>8.1f}{vs:>9}{bits:>8}{mb:>9}{frac:>10}")
    lines += ["", "cost of a T-token forward against the cache, relative to T = 1:"]
    lines.append(f"{'':<12}" + "".join(f"{f'T={T}':>8}" for T in T_SIZES))
    for fmt, cost in r["t_token_cost"].items():
        lines.append(f"{fmt:<12}" + "".join(f"{cost[T]:>7.2f}x" for T in T_SIZES))
    for fmt, cost in r.get("t_token_cost_native", {}).items():  # the native fixed-shape steps
        lines.append(f"{fmt + ' n':<12}" + "".join(f"{cost[T]:>7.2f}x" for T in T_SIZES))
    for fmt, cost in r.get("t_token_cost_native_amx", {}).items():  # the same on AMX tiles
        lines.append(f"{fmt + ' n amx':<12}" + "".join(f"{cost[T]:>7.2f}x" for T in T_SIZES))
    floors = r.get("t_token_floor_native") or r.get("t_token_floor") or {}
    if floors:  # the arithmetic bound: each extra row is one multiply-add per weight
        native = bool(r.get("t_token_floor_native"))
        lines += [
            "",
            f"least cost from arithmetic alone, T x {r['parameters'] / 1e6:.1f} M multiply-adds at the "
            f"fp32 peak ({r['env']['fma_per_s'] / 1e9:.0f} G/s measured) over the T = 1 time, "
            f"{'native steps' if native else 'eager forwards'}:",
        ]
        for fmt, cost in floors.items():
            lines.append(
                f"{fmt + (' n' if native else ''):<12}" + "".join(f"{cost[T]:>7.2f}x" for T in T_SIZES)
            )
        a8 = [f for f in r["t_token_cost"] if f.endswith("_a8")]
        if a8:
            lines.append(f"(none for {', '.join(a8)}: integer dot products, not bound by the fp32 peak)")
    if r["llama_cpp"] != "ran":
        lines += ["", r["llama_cpp"]]
    return "\n".join(lines)


def plot_formats(r: dict, path: Path) -> None:
    """tokens/s against bits per weight: ours, llama.cpp (at its format's nominal bits), the roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw, params, kv = r["env"]["read_bandwidth_bytes_per_s"], r["parameters"], r["kv_bytes_per_step"]
    nominal = {"fp32": 32.0, "q8_0": 8.5, "q4_0": 4.5}
    fig, ax = plt.subplots(figsize=(6, 4))
    bits = [b / 10 for b in range(30, 330)]
    ax.plot(
        bits, [bw / (b / 8 * params + kv) for b in bits], "k--", label="roofline (bandwidth / bytes per step)"
    )
    # one colour per contender and way of running it, the format written next to each point
    colours = {"ours": "tab:gray", "ours compiled": "tab:blue", "ours native": "tab:red"}
    colours |= {"ours native amx": "tab:orange"}
    colours |= {"llama.cpp": "tab:green", "transformers": "black"}
    labelled = set()
    for name, row in r["rows"].items():
        who, fmt, *how = name.split()
        b = row.get("bits_per_weight", nominal.get(fmt))
        if b is None:
            continue
        group = " ".join([who, *how])
        marker = {"ours": "o", "llama.cpp": "s", "transformers": "^"}[who]
        label = None if group in labelled else group
        labelled.add(group)
        ax.plot(b, row["tokens_per_s"], marker, color=colours.get(group, "tab:purple"), label=label)
        ax.annotate(fmt, (b, row["tokens_per_s"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("bits per weight (as read per step)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(r["env"]["cpu"][:60], fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Roofline of this machine: is prefill compute-bound and decode memory-bound here too?

Measures the read bandwidth (a working set well beyond the last-level cache, and one the size of the
model) and the matmul FLOP/s (fp32, bf16). Then, for matmuls [B*T, D] x [D, F] with B*T = 1..1024
and for real decode steps of a model at several batch sizes, it compares the measured time with the
roofline prediction max(FLOPs / peak, bytes / bandwidth) (cs336_inference/bench/roofline.py), prints a
table, writes roofline.json and draws roofline.png (log-log: the bandwidth slope, the compute roof,
the measured points). Float32 on a CPU, bfloat16 on a GPU.

    python scripts/roofline.py                  # this machine (the GPU if there is one)
    python scripts/roofline.py --quick          # small sizes, few repeats (seconds)
    python scripts/roofline.py --lecture        # the lecture's Llama-2-13B H100 table, from the formulas
    python scripts/roofline.py --model default  # decode SmolLM2-135M instead of a random model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cs336_inference import accounting as acc
from cs336_inference.bench import roofline as rl
from cs336_inference.io.checkpoint import default_model_path, load_pretrained

MiB = rl.MiB


class RooflineError(Exception):
    """Bad input or an unusable device; reported as one line."""


# ------------------------------------------------------------------------ the lecture
def lecture_table() -> str:
    """The lecture's numbers, computed from the formulas in cs336_inference.accounting."""
    cfg, S, gb = acc.llama2_13b(), 1024, 1e9
    gqa = acc.preset("llama2-13b", n_kv_heads=8)
    lines = [
        f"H100: {acc.H100_FLOPS:.3g} FLOP/s / {acc.H100_BANDWIDTH:.3g} B/s = "
        f"{acc.accelerator_intensity():.1f} FLOPs per byte (compute-bound above this intensity)",
        "",
        f"Llama-2-13B (S={S}, bf16, {acc.H100_BANDWIDTH:.3g} B/s): {acc.num_params(cfg):,} parameters "
        f"(lecture formula: 2VD + L(2DNH + 2DKH + 3DF), no norm weights)",
        f"{'config':<10}{'B':>5}{'KV cache GB':>13}{'total bytes':>18}{'latency ms':>12}"
        f"{'tok/s':>13}  fits 80 GB",
    ]
    for name, c, batches in [("MHA K=40", cfg, (1, 64, 256)), ("GQA K=8", gqa, (1, 64, 256))]:
        for B in batches:
            total = acc.total_memory_bytes(c, B, S)
            lines.append(
                f"{name:<10}{B:>5}{acc.kv_cache_bytes(c, B, S) / gb:>13.2f}{total:>18,}"
                f"{acc.decode_latency(c, B, S) * 1e3:>12.4f}{acc.decode_throughput(c, B, S):>13.4f}"
                f"  {'yes' if total <= acc.H100_MEMORY else 'no'}"
            )
    lines.append(
        f"largest batch in 80 GB: MHA {acc.max_batch_size(cfg, S)}, GQA K=8 {acc.max_batch_size(gqa, S)}"
    )
    big = acc.llama2_70b()
    one, many = acc.kv_cache_bytes(big, 1, 4096), acc.kv_cache_bytes(big, 64, 32768)
    lines += [
        "",
        f"Llama-2-70B KV cache (L=80, K=8, H=128, bf16): 4096 tokens {one:,} bytes; "
        f"64 x 32768 tokens {many:,} bytes ({many / gb:.1f} GB = {acc.gib(many):.0f} GiB, "
        f"{many / 140e9:.1f}x the 140 GB of weights)",
    ]
    mla = acc.deepseek_v2()
    latent = acc.kv_bytes_per_token_layer(mla, dtype_bytes=1)
    lines.append(
        f"MLA (DeepSeek-V2): {mla.kv_lora_rank} + {mla.qk_rope_head_dim} = {latent} numbers per token and "
        f"layer vs the lecture's MHA N*H = 64 x 128 = 8192: {8192 / latent:.1f}x (keys and values together: "
        f"{2 * 8192 / latent:.1f}x; DeepSeek-V2's own {mla.n_heads} heads of 128 give N*H = {mla.n_heads * 128})"
    )
    lines += ["", "intensity (FLOPs/byte, bf16, Llama-2-13B)        prefill S=1024   decode S=1024"]
    for B in (1, 64):
        name = f"MLP, B={B}"
        lines.append(f"  {name:<46}{acc.mlp_intensity(cfg, B, S):>9.1f}{acc.mlp_intensity(cfg, B, 1):>16.2f}")
    lines.append(
        f"  {'attention (any B)':<46}{acc.attention_intensity(cfg, 1, S, S):>9.1f}"
        f"{acc.attention_intensity(cfg, 1, 1, S):>16.4f}"
    )
    lines.append(
        f"speculative decoding, alpha=0.8, k=4, cost ratio 0.11: "
        f"{acc.speculative_expected_tokens(0.8, 4):.3f} tokens per target pass, "
        f"speedup {acc.speculative_speedup(0.8, 4, 0.11):.2f}x"
    )
    lines += [
        "",
        "Figures some write-ups quote that these formulas do not give (see cs336_inference/accounting.py):",
        "  8.08 ms at B=1 (formula 8.0208 ms; 1 / 8.08 ms = 123.8 tok/s, not the 124.6 quoted with it);",
        "  130.6 GB / 16,584 tok/s for GQA B=256 (formula 65.6 GB / 13,068; 130.6 GB at B=256 gives 6,567);",
        "  171.8 GB for 70B, 64 x 32k tokens (formula 687.2 GB; 171.8 GB is a quarter of it, 16 requests).",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------ reporting
def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(
        f"{'':<18}{'FLOPs':>11}{'bytes':>11}{'intensity':>11}{'bound':>9}"
        f"{'predicted ms':>14}{'measured ms':>13}{'roofline/meas':>15}"
    )
    for r in rows:
        print(
            f"{r['name']:<18}{r['flops']:>11.3g}{r['bytes']:>11.3g}{r['intensity']:>11.2f}{r['bound']:>9}"
            f"{r['predicted_s'] * 1e3:>14.4f}{r['measured_s'] * 1e3:>13.4f}"
            f"{r['predicted_s'] / r['measured_s']:>15.2f}"
        )


def plot(path: Path, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtype = result["sweep_dtype"]
    peak, bw = result["peak_flops"][dtype], result["bandwidth"]["large_set"]["bytes_per_s"]
    points = result["matmul"] + result["model_steps"]
    lo = min(0.5, *(p["intensity"] / 2 for p in points))
    hi = max(4 * peak / bw, *(p["intensity"] * 2 for p in points))
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot(
        xs, [min(peak, bw * x) for x in xs], "k-", lw=2, label=f"roofline ({dtype}): min(peak, bandwidth x I)"
    )
    for name, value in result["peak_flops"].items():
        ax.axhline(value, ls=":", color="gray", lw=1)
        ax.text(lo, value * 1.08, f"{name} peak {value / 1e9:.0f} GFLOP/s", fontsize=8, color="gray")
    ax.axvline(peak / bw, ls="--", color="gray", lw=1)
    ax.text(peak / bw * 1.1, bw * lo, f"ridge {peak / bw:.1f} FLOP/B", fontsize=8, color="gray")
    for rows, marker, label in [
        (result["matmul"], "o", "matmul [BT, D] x [D, F]"),
        ([r for r in result["model_steps"] if r["T"] == 1], "^", "decode step"),
        ([r for r in result["model_steps"] if r["T"] > 1], "s", "prefill"),
    ]:
        if rows:
            ax.plot(
                [r["intensity"] for r in rows],
                [r["flops"] / r["measured_s"] for r in rows],
                marker,
                label=label,
            )
            for r in rows:
                tag = f"BT={r['BT']}" if "BT" in r else f"B={r['B']}" if r["T"] == 1 else f"T={r['T']}"
                ax.annotate(tag, (r["intensity"], r["flops"] / r["measured_s"]), fontsize=7, xytext=(3, -9),
                            textcoords="offset points")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("achieved FLOP/s")
    ax.set_title(f"Roofline of {result['device_name']} (bandwidth {bw / 1e9:.1f} GB/s)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def measure(args: argparse.Namespace) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RooflineError("--device cuda, but CUDA is not available on this machine")
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = rl.DTYPES[rl.sweep_dtype(device)]
    if args.model is None:
        model, source = rl.random_model(device, dtype, args.quick), "random"
    else:
        path = default_model_path() if args.model == "default" else args.model
        model, source = load_pretrained(path, dtype=dtype, device=device).eval(), str(path)
    return rl.measure_roofline(model, source, quick=args.quick, context=args.context)


def run(args: argparse.Namespace) -> dict:
    result = measure(args)
    llc = result["last_level_cache_bytes"]
    bw = result["bandwidth"]
    print(
        f"device: {result['device_name']}  torch {result['torch_version']}  threads {result['torch_threads']}"
    )
    print(f"last-level cache: {'unknown' if llc is None else f'{llc / MiB:.0f} MiB'}")
    for name, b in bw.items():
        print(f"read bandwidth ({name}, {b['bytes'] / MiB:.0f} MiB): {b['bytes_per_s'] / 1e9:.1f} GB/s")
    for name, value in result["peak_flops"].items():
        n = result["peak_matmul_n"]
        print(f"matmul {name} ({n}x{n}x{n}): {value / 1e9:.1f} GFLOP/s")
    peak = result["peak_flops"][result["sweep_dtype"]]
    print(
        f"machine intensity ({result['sweep_dtype']}): {peak / bw['large_set']['bytes_per_s']:.1f} FLOPs per byte "
        f"(the H100 of the lecture: {acc.accelerator_intensity():.0f})"
    )
    m = result["matmul"][0]
    print_table(f"matmul [BT, {m['D']}] x [{m['D']}, {m['F']}] ({result['sweep_dtype']})", result["matmul"])
    model = result["model"]
    print_table(
        f"model steps ({model['source']} model, {model['params']:,} params, {result['sweep_dtype']}; "
        f"bandwidth of the model-sized set)",
        result["model_steps"],
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["png"] = str(out / "roofline.png")
    plot(out / "roofline.png", result)
    (out / "roofline.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out / 'roofline.json'} and {out / 'roofline.png'}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds)")
    parser.add_argument("--lecture", action="store_true", help="print the lecture's table from the formulas")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--model", help="decode this checkpoint (folder, hub id, .gguf or 'default' for SmolLM2)"
    )
    parser.add_argument("--context", type=int, help="tokens in each sequence's cache during decode")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default="runs/roofline", help="folder for roofline.json and roofline.png")
    args = parser.parse_args(argv)
    if args.lecture:
        print(lecture_table())
        return 0
    try:
        if args.context is not None and args.context < 1:
            raise RooflineError(f"--context must be >= 1, got {args.context}")
        if args.threads is not None and args.threads < 1:
            raise RooflineError(f"--threads must be >= 1, got {args.threads}")
        run(args)
    except (RooflineError, ValueError, OSError, RuntimeError) as e:
        print(f"roofline: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

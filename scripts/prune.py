"""Prune SmolLM2-135M and heal it by distillation (the Minitron recipe), then compare the three models.

    python scripts/prune.py                                  # 30 -> 20 layers, distill for 25 minutes
    python scripts/prune.py --d-ff 768 --layers 30           # MLP 1536 -> 768 instead
    python scripts/prune.py --minutes 4 --eval-tokens 2048 --out runs/pruned --json runs/prune.json

1. importance scores on --calib-tokens tokens of standard-library docstrings (not the eval text);
2. prune to the target (--layers, --d-ff, --n-heads, --d-model; block importance ranks the layers);
3. distill the original into it on CPython's pydoc topics (9 of every 10 topics) for --minutes;
4. perplexity of the original, pruned and healed models on the held-out topics (every 10th), weight
   bytes, parameters and decode tokens/s; the healed model is saved with save_pretrained (--out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from cs336_inference import evaluation
from cs336_inference.distill import distill, split_topics, token_windows
from cs336_inference.io.checkpoint import (
    CheckpointError,
    default_model_path,
    load_pretrained,
    save_pretrained,
)
from cs336_inference.io.tokenizer import load_tokenizer
from cs336_inference.pruning import importance_scores, prune


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--layers", type=int, default=20, help="layers to keep (default 20 of 30)")
    p.add_argument("--d-ff", type=int, help="MLP neurons to keep per layer")
    p.add_argument("--n-heads", type=int, help="query heads to keep per layer (whole GQA groups)")
    p.add_argument("--d-model", type=int, help="model channels to keep")
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--minutes", type=float, default=25.0, help="distillation budget (0: prune only)")
    p.add_argument("--window", type=int, default=128, help="tokens per training window")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eval-tokens", type=int, default=4096, help="held-out tokens for perplexity")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="save the healed model here (save_pretrained)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def step_seconds(student, teacher, windows, batch_size) -> float:
    """Time of one training step (teacher forward, student forward and backward), after a warm-up."""
    x = windows[:batch_size]
    times = []
    for _ in range(2):
        start = time.perf_counter()
        with torch.no_grad():
            teacher(x[:, :-1])
        student(x[:, :-1]).float().logsumexp(-1).mean().backward()
        times.append(time.perf_counter() - start)
    student.zero_grad(set_to_none=True)
    return times[-1]


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        source = args.model or default_model_path()
        teacher, tok = load_pretrained(source), load_tokenizer(source)
        encode = lambda text: torch.tensor(tok.encode(text, add_special_tokens=False))  # noqa: E731
        calib = encode(evaluation.default_calibration_text())[: args.calib_tokens]
        calib = token_windows(calib, min(256, calib.numel()))
        train_text, held_text = split_topics()
        held = encode(held_text)[: args.eval_tokens]
        train = token_windows(encode(train_text), args.window)
        log(f"calibrating on {calib.numel()} tokens ...")
        scores = importance_scores(teacher, calib)
        student = prune(
            teacher,
            n_layers=args.layers,
            n_heads=args.n_heads,
            d_ff=args.d_ff,
            d_model=args.d_model,
            scores=scores,
        )
        log(f"pruned: {student.config.n_layers} layers, d_ff {student.config.d_ff}; scoring ...")
        ppl = {"original": evaluation.perplexity(teacher, held, 512, 384)}
        ppl["pruned"] = evaluation.perplexity(student, held, 512, 384)
        history, steps = [], 0
        if args.minutes > 0:
            per_step = step_seconds(student, teacher, train, args.batch_size)
            steps = max(1, int(args.minutes * 60 * 0.9 / per_step))
            log(f"one step ~{per_step:.1f} s: {steps} steps of {args.batch_size} x {args.window} tokens")
            held_windows = token_windows(held[:1024], args.window)
            history = distill(
                student, teacher, train, held_windows, budget_s=args.minutes * 60, steps=steps,
                batch_size=args.batch_size, lr=args.lr, warmup=max(1, steps // 10), temperature=args.temperature,
                eval_every=max(1, steps // 4), seed=args.seed,
            )  # fmt: skip
            ppl["healed"] = evaluation.perplexity(student, held, 512, 384)
        prompt = encode("The Python language reference describes")
        models = {"original": teacher, "pruned" if args.minutes == 0 else "healed": student}
        speed = evaluation.decode_speed(models, prompt, new_tokens=args.decode_tokens)
        if args.out:
            save_pretrained(student, args.out)
    except (ValueError, OSError, CheckpointError) as e:
        print(f"prune.py: error: {e}", file=sys.stderr)
        return 2
    rows = []
    for name, model in (("original", teacher), ("pruned", student), ("healed", student)):
        if name not in ppl:
            continue
        n = model.num_parameters()
        rows.append(
            dict(
                model=name, layers=model.config.n_layers, d_ff=model.config.d_ff, params_M=n / 1e6,
                weight_MB=sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6,
                perplexity=ppl[name], tok_s=speed.get(name, speed.get("healed" if name == "pruned" else name)),
            )
        )  # fmt: skip
    print(f"{source}\nheld-out: pydoc_data.topics of Python {evaluation.python_version()}, every 10th topic, "
          f"first {held.numel()} tokens (windows 512, stride 384); distilled {len(history) and history[-1]['step']} "
          f"steps of {args.batch_size} x {args.window} tokens\n")  # fmt: skip
    print("| model | layers | d_ff | params (M) | weight MB | perplexity | decode tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['layers']} | {r['d_ff']} | {r['params_M']:.1f} | {r['weight_MB']:.1f} | "
              f"{r['perplexity']:.3f} | {r['tok_s']:.1f} |")  # fmt: skip
    if history:
        print("\nheld-out KL to the original during distillation: "
              + ", ".join(f"step {h['step']}: {h['kl']:.3f}" for h in history))  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"source": str(source), "rows": rows, "history": history}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

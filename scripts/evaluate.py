"""Evaluate a model, and quantized copies of it, on a text: perplexity, KL to the float model, agreement.

    python scripts/evaluate.py                                   # SmolLM2-135M on the CPython docs
    python scripts/evaluate.py --methods int8,q8_0,q4_0,awq --max-tokens 4096 --json eval.json
    python scripts/evaluate.py --model dir/or/file.gguf --text my_text.txt --window 512 --stride 256

The default text is the Python reference documentation that ships with CPython (pydoc_data.topics,
about 113K SmolLM2 tokens); its content differs slightly between Python versions, so the output
names the version. --max-tokens evaluates only a prefix of the text (and says how many tokens).
Perplexity uses a sliding window (--window tokens, advancing by --stride). AWQ is calibrated on
standard-library docstrings, never on the evaluation text. A table goes to stdout, JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cs336_inference import evaluation
from cs336_inference.io.checkpoint import CheckpointError, default_model_path, load_pretrained
from cs336_inference.io.tokenizer import load_tokenizer
from cs336_inference.quantization import METHODS


def parse_methods(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    for name in names:
        if name.partition("+")[0] not in METHODS or name.partition("+")[2] not in ("", "head"):
            raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)} (optionally with +head)")
    return names


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--methods", default="", help=f"comma-separated, from: {','.join(METHODS)} (+head)")
    parser.add_argument("--text", type=Path, help="a UTF-8 text file (default: CPython's pydoc_data.topics)")
    parser.add_argument("--max-tokens", type=int, help="evaluate only the first N tokens of the text")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window")
    parser.add_argument("--stride", type=int, default=512, help="tokens the window advances by")
    parser.add_argument("--calibration-tokens", type=int, default=512, help="AWQ calibration tokens")
    parser.add_argument("--greedy-tokens", type=int, default=32, help="tokens per chat prompt (0: skip)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")


def prepare(args: argparse.Namespace):
    """(model, tokenizer, eval ids, calibration ids, description of the text) from the arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    source = args.model or default_model_path()
    model, tokenizer = load_pretrained(source), load_tokenizer(source)
    if args.text is not None:
        text, text_name = args.text.read_text(encoding="utf-8"), str(args.text)
    else:
        text = evaluation.default_eval_text()
        text_name = f"pydoc_data.topics of Python {evaluation.python_version()}"
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
    total = ids.numel()
    if args.max_tokens is not None:
        if args.max_tokens < 2:
            raise ValueError("--max-tokens must be >= 2")
        ids = ids[: args.max_tokens]
    calibration = tokenizer.encode(evaluation.default_calibration_text(), add_special_tokens=False)
    calibration = torch.tensor(calibration[: args.calibration_tokens])[None]
    described = (
        f"{text_name}: first {ids.numel()} of {total} tokens"
        if ids.numel() < total
        else f"{text_name}: {total} tokens"
    )
    return model, tokenizer, ids, calibration, {"source": str(source), "text": described}


def progress(iterable):
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc="windows", unit="window", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    try:
        methods = parse_methods(args.methods)
        model, tokenizer, ids, calibration, info = prepare(args)
        rows = evaluation.compression_table(
            model, tokenizer, methods, ids, calibration, args.window, args.stride,
            decode_tokens=0, greedy_tokens=args.greedy_tokens, progress=progress,
            log=lambda message: print(message, file=sys.stderr),
        )  # fmt: skip
    except (ValueError, OSError, CheckpointError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{info['source']}\n{info['text']}, window {args.window}, stride {args.stride}\n")
    print(evaluation.format_quality_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            **info,
            "python": evaluation.python_version(),
            "window": args.window,
            "stride": args.stride,
        }
        args.json.write_text(json.dumps({**payload, "rows": rows}, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

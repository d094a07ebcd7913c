"""Serve a model over an OpenAI-compatible HTTP API (continuous batching + a paged KV cache).

    python scripts/serve.py                                  # SmolLM2-135M-Instruct on 127.0.0.1:8000
    python scripts/serve.py --model path/to/model.gguf --port 8080 --num-blocks 512
    python scripts/serve.py --quantize q4_1 --threads 2     # 4-bit weights, as the GGUF stores them

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'

Needs the `serve` extra (pip install -e '.[serve]'). The server itself: cs336_inference/serving/server.py.
Bad arguments exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("int8", "int4", "q8_0", "q4_0", "q4_1", "int4_a8", "q8_0_a8", "q4_0_a8")  # kernels for each


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="folder, hub id or GGUF file (default: the SmolLM2 GGUF)")
    p.add_argument("--name", help="the model's name in the API (default: the file or folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--num-blocks",
        type=int,
        help="KV cache blocks (default: enough for one sequence of the model's whole window, at least 256)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--max-batch-seqs", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens per step (default: 32 on the fast path, the rows one native C call takes; 512 with --eager)",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share prompt-prefix blocks")
    p.add_argument(
        "--packed",
        action="store_true",
        help="a GGUF's quantized matrices kept as the file stores them (default: dequantized to --dtype)",
    )
    p.add_argument(
        "--static-batching",
        action="store_true",
        help="admit a new batch only when the last has finished (the baseline, for benchmarks)",
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the model runs (cuda: the readable layers on the GPU; with --tensor-parallel, one GPU per rank)",
    )
    p.add_argument(
        "--quantize",
        choices=QUANTIZE,
        help="serve the weights quantized to this format, the output matrix too (default: as loaded)",
    )
    p.add_argument("--eager", action="store_true", help="the readable PyTorch layers, not the kernels")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $CS336_API_KEY, "
        "else no key)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: one per idle core)")
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="shard the model over N processes (torchrun --nproc-per-node N; readable layers)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda":
        if args.quantize:
            p.error("--device cuda serves the readable float layers: drop --quantize")
        args.eager = True
    if args.tensor_parallel is not None:
        if args.tensor_parallel < 1:
            p.error("--tensor-parallel must be >= 1")
        if args.quantize or args.static_batching:
            p.error("--tensor-parallel serves the readable float layers: drop --quantize / --static-batching")
        args.eager = True
    if args.max_batch_tokens is None:
        # on the fast path a step of up to 32 rows is one native call over the paged cache; a longer
        # prompt chunk would run the readable forward, slower per token (docs/serving.md)
        args.max_batch_tokens = 512 if args.eager else 32
    for name in ("num_blocks", "block_size", "max_batch_seqs", "max_batch_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < args.port < 65536:
        p.error("--port must be in 1..65535")
    try:
        import uvicorn

        from cs336_inference.serving.server import create_app
    except ImportError as e:
        print(f"serve.py: {e}; install the serve extra: pip install -e '.[serve]'", file=sys.stderr)
        return 2

    import torch

    from cs336_inference.fast.threads import auto_threads, in_passing_thread

    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    rank, device = 0, args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("serve.py: --device cuda: this machine has no CUDA GPU", file=sys.stderr)
        return 2
    if args.tensor_parallel is not None:
        from cs336_inference.parallel.launch import init_from_torchrun

        try:
            rank, device = init_from_torchrun(args.tensor_parallel, device, script="scripts/serve.py")
        except ValueError as e:
            print(f"serve.py: {e}", file=sys.stderr)
            return 2
        args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.tensor_parallel)
    torch.set_num_threads(args.threads or auto_threads()[0])  # a busy machine: fewer threads, no stalls

    listener = None
    if rank == 0:  # the port first: a busy one is an error before minutes of loading, not after
        try:
            listener = listen(args.host, args.port)
        except OSError as e:
            print(f"serve.py: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
            return 2

    from cs336_inference.io.checkpoint import default_model_path, load_pretrained
    from cs336_inference.io.sources import CheckpointError
    from cs336_inference.io.tokenizer import load_tokenizer
    from cs336_inference.serving import LLMEngine

    def load(source):
        if args.tensor_parallel is not None:
            from cs336_inference.parallel import load_sharded

            model = load_sharded(source, dtype=getattr(torch, args.dtype), device=device)
        else:
            model = load_pretrained(
                source, dtype=getattr(torch, args.dtype), device=device, packed=args.packed
            )
            model = model.eval()
        if args.quantize:
            from cs336_inference.quantization import quantize_model

            model = quantize_model(model, args.quantize, quantize_head=True)
        if not args.eager:
            from cs336_inference.fast import install

            install(model)  # the products through the kernels (the same function; --eager: the readable one)
        return model

    # On the CPU the model is built on a thread that ends before the engine's starts: see
    # threads.in_passing_thread (a GPU's current device belongs to a thread, so it stays here).
    here = in_passing_thread if device == "cpu" else (lambda fn, *a, **kw: fn(*a, **kw))
    try:
        source = args.model or default_model_path()
        model = here(load, source)
        tokenizer = load_tokenizer(source)
    except (CheckpointError, OSError, ValueError) as e:
        print(f"serve.py: {e}", file=sys.stderr)
        return 2
    name = args.name or Path(str(source).rstrip("/")).name.split(".")[0]
    if args.num_blocks is None:  # one request may fill the model's window
        args.num_blocks = max(256, -(-model.config.max_seq_len // args.block_size))
    if rank != 0:  # tensor parallel: rank 0 schedules and samples, this rank follows its steps
        from cs336_inference.parallel.serving import follow

        follow(model, args.num_blocks, args.block_size)
        return 0
    engine = here(
        LLMEngine,
        model,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_seqs=args.max_batch_seqs,
        prefix_caching=not args.no_prefix_caching,
        static_batching=args.static_batching,
    )
    api_key = args.api_key or os.environ.get("CS336_API_KEY") or None
    path = "eager (readable PyTorch)" if args.eager else "fast path (kernels installed)"
    if device != "cpu":
        path += f" on {device}"
    if args.quantize:
        path += f", weights in {args.quantize}"
    if api_key:
        path += ", API key required"
    if args.tensor_parallel is not None:
        from cs336_inference.parallel.serving import lead, stop_followers

        lead(engine)
        path += f", tensor parallel over {args.tensor_parallel} processes"
    print(
        f"serving {name!r} on http://{args.host}:{args.port}/v1; {path}, {torch.get_num_threads()} threads, "
        f"KV cache of {args.num_blocks} x {args.block_size} tokens (window {model.config.max_seq_len})",
        file=sys.stderr,
    )
    app = create_app(engine, tokenizer, name, api_key=api_key)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[listener])
    finally:
        if args.tensor_parallel is not None:
            stop_followers()
    return 0


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # a bad argument: one line, not the whole usage
        print(f"serve.py: error: {message} (serve.py --help lists the options)", file=sys.stderr)
        sys.exit(2)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (OSError if another process holds it), handed to uvicorn."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


if __name__ == "__main__":
    sys.exit(main())

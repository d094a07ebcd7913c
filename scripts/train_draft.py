"""Train an EAGLE-style draft head for SmolLM2-135M-Instruct (or --model) on its own answers.

    python scripts/train_draft.py                       # 80-110 minutes on 2 cores, into runs/draft-head
    python scripts/train_draft.py --prompts 64 --steps 50 --out /tmp/head   # a quick trial
    python scripts/train_draft.py --init runs/draft-head --steps 4000 --lr 3e-4   # about 35 more minutes

1. chat prompts cut from CPython's pydoc topics (every 10th topic held out; --tasks tasks for each
   paragraph or code example) and general chat requests (--general: everyday topics, programming
   questions, short messages, why-questions), answered by the target itself, greedy, on the serving
   engine;
2. with the answers, the features the engine computed on the way (the final norm's output at every
   position of prompt and answer), in chunks of 256 prompts (work/features/answers-*.safetensors);
3. the head trained on them (checkpoints in work/checkpoint/, resumed if there): by default at every
   position, against the target's own distribution (--positions); the held-out acceptance on the
   held-out topics' answers is printed at every evaluation.
Every stage keeps what is already on disk, so an interrupted command goes on where it stopped. The head
is saved as runs/draft-head/draft_head.safetensors + draft_head.json, where `generate.py --draft head`
and `benchmark.py speculative --drafts head` look for it. --init trains a saved head further on the same
answers, with a fresh optimizer and learning-rate schedule (checkpoints in work/checkpoint-init/), and
saves it over --out (docs/speculative.md: what 4,000 more steps gave).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from cs336_inference import draft_prompts as dp
from cs336_inference import draft_training as dt
from cs336_inference.draft_head import DraftHead, save_draft_head
from cs336_inference.fast import install, uninstall
from cs336_inference.io.checkpoint import CheckpointError, default_model_path, load_pretrained
from cs336_inference.io.tokenizer import load_tokenizer

DEFAULT_OUT = Path("runs/draft-head")
ANSWER_GROUP = 256  # prompts per chunk on disk: what an interrupted run loses at most


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="target checkpoint (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"where the head goes (default {DEFAULT_OUT})"
    )
    p.add_argument("--prompts", type=int, default=3600, help="training prompts to answer (0: all)")
    p.add_argument(
        "--tasks", type=int, default=4, help="tasks per paragraph or code example (prompts: 902 each)"
    )
    p.add_argument("--held-prompts", type=int, default=96, help="held-out prompts to answer")
    p.add_argument(
        "--general",
        type=int,
        help="general chat requests to add to the training prompts (default: all; 0: none)",
    )
    p.add_argument("--held-general", type=int, default=24, help="held-out general requests to add")
    p.add_argument("--max-new-tokens", type=int, default=128, help="answer length cap")
    p.add_argument(
        "--vocab", type=int, default=8192, help="draft vocabulary: the most frequent tokens (0: all)"
    )
    p.add_argument(
        "--init", type=Path, help="continue the head saved in this folder (fresh optimizer and schedule)"
    )
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--window", type=int, default=256, help="positions per training window (a sequence's last)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--unroll", type=int, default=2, help="training passes (2: also from its own features)")
    p.add_argument(
        "--w-token", type=float, default=0.5, help="weight of the cross-entropy (the feature loss: 1)"
    )
    p.add_argument(
        "--positions",
        choices=["all", "answers"],
        default="all",
        help="where the losses count: every position, against the target's distribution (all), or the "
        "answers' tokens only, against its argmax (answers)",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="training passes under bfloat16 autocast, or float32 (auto: bf16 where the hardware has it)",
    )
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", type=Path, help="also write the training log for docs/ (command, CPU, date)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        source = args.model or default_model_path()
        target, tok = load_pretrained(source), load_tokenizer(source)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in target.parameters():
        p.requires_grad_(False)
    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()

    train_texts, held_texts = dp.topic_split()
    train_prompts = dp.draft_prompts(train_texts, args.seed, tasks=args.tasks)
    held_prompts = dp.draft_prompts(held_texts, args.seed)[: args.held_prompts]
    if args.prompts:
        train_prompts = train_prompts[: args.prompts]
    general, held_general = dp.general_prompts(args.seed)
    train_prompts += general[: args.general]
    held_prompts += held_general[: args.held_general]
    log(f"1-2. answers and their features: {len(train_prompts)} training and {len(held_prompts)} held-out "
        f"prompts, up to {args.max_new_tokens} tokens each")  # fmt: skip
    header = dt.generation_header(tok)
    data, counts = {}, {}
    for name, prompts in (("train", train_prompts), ("held", held_prompts)):
        groups = [prompts[i : i + ANSWER_GROUP] for i in range(0, len(prompts), ANSWER_GROUP)]
        paths = [dt.chunk_path(work / "features", g, args.max_new_tokens, str(source)) for g in groups]
        for c, (group, path) in enumerate(zip(groups, paths, strict=True)):
            if path.exists():
                continue
            install(target)  # the engine on the fast path
            log(f"  {name} chunk {c + 1}/{len(groups)}: {len(group)} prompts")
            dt.save_chunk(dt.answer_with_features(target, dp.chat_ids(tok, group), args.max_new_tokens, log=log),
                          path)  # fmt: skip
        data[name] = dt.mark_answers(dt.load_features(paths), header)
        counts[name] = len(prompts)
        log(f"  {name}: {int(data[name]['answer'].sum())} answer tokens in {counts[name]} sequences")
    uninstall(target)  # the head reads the readable target's embedding and output matrix

    always = list(dict.fromkeys([*tok.eos_token_ids, *target.config.eos_token_ids]))
    labels = {name: d["labels"][torch.roll(d["answer"], -1)] for name, d in data.items()}  # answers' argmax
    vocab = None if args.vocab == 0 else dt.frequent_tokens(labels["train"], args.vocab, always)
    if vocab is not None:
        covered = torch.isin(labels["held"], vocab).float().mean()
        log(f"  draft vocabulary: {len(vocab)} tokens cover {covered:.1%} of the held-out argmax tokens")
    summary = [
        f"data: {int(data['train']['answer'].sum())} answer tokens of {counts['train']} training prompts, "
        f"{int(data['held']['answer'].sum())} of {counts['held']} held-out prompts (other topics)"
    ]
    if vocab is not None:
        summary.append(
            f"draft vocabulary: the {len(vocab)} most frequent argmax tokens ({covered:.1%} of the held-out ones)"
        )
    if args.init:
        try:
            head = dt.continued_head(args.init, target, vocab)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        summary.append(f"continued from the head in {args.init} (fresh optimizer and schedule)")
    else:
        head = DraftHead(target.config, vocab).attach(target)
    bf16 = args.precision == "bf16" or (args.precision == "auto" and dt.cpu_has_bf16())
    precision = "bfloat16 autocast" if bf16 else "float32"
    summary.append(f"training passes in {precision}, {args.steps} steps of {args.batch_size} windows")
    summary.append(
        "losses at every position, against the target's distribution"
        if args.positions == "all"
        else "losses at the answers' tokens, against the target's argmax"
    )
    log(f"3. training the head ({sum(p.numel() for p in head.parameters()):,} parameters, {precision})")
    checkpoints = work / ("checkpoint-init" if args.init else "checkpoint")  # --init: not the first run's
    history = dt.train_draft_head(
        head, data["train"], data["held"], checkpoints, log=log, steps=args.steps,
        batch_size=args.batch_size, T=args.window, lr=args.lr, unroll=args.unroll,
        eval_every=args.eval_every, seed=args.seed, w_token=args.w_token, bf16=bf16,
        every_position=args.positions == "all",
    )  # fmt: skip
    save_draft_head(head, args.out, {"history": history, "model": str(source)})
    if args.markdown:
        from cs336_inference.bench.report import write_markdown

        write_markdown(args.markdown, "\n".join(summary) + "\n\n" + dt.format_history(history))
        log(f"wrote {args.markdown}")
    log(f"saved {args.out / 'draft_head.safetensors'} ({time.perf_counter() - began:.0f} s in this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

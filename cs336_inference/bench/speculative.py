"""Measuring speculative decoding: acceptance, tokens per target pass, pass costs and speedup.

For each workload (a list of prompts), draft and k, `speculative_benchmark` runs greedy
speculative decoding and plain `generate` on the same prompts in the same process and reports

    alpha            accepted / examined drafts, pooled over the workload's prompts
    tokens/pass      new tokens of the rounds (not the prefill's first one) / target passes, next to
                     the formula (1 - a^(k+1)) / (1 - a), and the formula averaged over the rounds
                     with each round's own number of drafts d
                     in place of k ("drafted": prompt lookup drafts fewer than k tokens, or none)
    verify cost      time of a (k+1)-token target forward with the cache / a 1-token step (timed
                     side by side); for a tree draft, its rounds' mean tree pass / the decode step of
                     the row's own target-only runs
    draft cost       time of a 1-token draft step / a 1-token target step (0 for prompt lookup); for a
                     tree draft, its rounds' mean drafting time, over the same step; for a model draft
                     with lookup (ModelDraft(lookup=True)), the model's steps per round times that
                     ratio (rounds that copy run no model)
    predicted        tokens/pass / (verify cost + k * draft cost), in units of one target step (a cost
                     per round counts once)
    speedup          target-only time / speculative time (measured), pooled; per prompt in the JSON
                     ("speedup_per_prompt") and the log. Each prompt's target-only run is repeated
                     right before each row's speculative run of it, and the row's speedup uses those
                     times: a memory bandwidth that drifts over the minutes a workload takes moves the
                     speed of both alike. With repeats > 1 the pair alternates that many times and
                     each prompt's times are the medians
    decode speedup   the same with the prompts' prefill taken out of both times (the prefill of
                     each prompt as the runs do it, timed alone: `prefill_seconds`). Speculation does
                     not touch the prefill, a tenth to a fifth of the time of 64 new tokens for the
                     benchmark's prompts on a CPU; this is the measured figure to set beside the
                     predicted one, which counts rounds only
    identical        greedy speculative output == greedy generate output, every prompt

Times are wall clock on whatever device the models are on (CUDA events on a GPU).

step_mode (None, "compile" or "native" on the CPU, "graph" on CUDA) runs the target as fixed-shape steps
(fast/step/fixed.py) in every measurement: the verify and one-token step costs, the target-only
baseline (`graph_generate`) and speculative decoding, so the speedup compares like with like; a
model draft runs its steps the same way.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cs336_inference.bench.timing import median_seconds, synchronize
from cs336_inference.fast.step.fixed import FixedSteps
from cs336_inference.fast.step.fixed import prefill as fixed_prefill
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import generate
from cs336_inference.speculative import ModelDraft, speculative_generate
from cs336_inference.speculative_tree import tree_generate

Log = Callable[[str], None]

CHAT_PROMPTS = [
    "What are three good habits for staying healthy? Answer briefly.",
    "Explain in two sentences why the sky is blue.",
    "Write a short note inviting a colleague to lunch on Friday.",
    "What is the difference between a list and a tuple in Python?",
]

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin spans about "
    "seven million square kilometres, of which about five and a half million are covered by the "
    "rainforest. The region includes territory belonging to nine nations. The majority of the forest "
    "is contained within Brazil, with 60 percent of the rainforest, followed by Peru with 13 percent "
    "and Colombia with 10 percent."
)
REWRITE_PROMPTS = [
    f"Copy the following passage exactly, sentence by sentence:\n\n{PASSAGE}",
    f"Here is a passage:\n\n{PASSAGE}\n\nRepeat the sentences of the passage that contain a number.",
    f"Rewrite the following passage in the past tense, changing nothing else:\n\n{PASSAGE}",
    f"Read the passage and list each country it names with its percentage.\n\n{PASSAGE}",
]
FUNCTION = """def moving_average(values, window):
    averages = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(window):
            total += values[i + j]
        averages.append(total / window)
    return averages"""
CODE_PROMPTS = [
    f"Here is a Python function:\n\n{FUNCTION}\n\nRename the variable `total` to `running_sum` and return the "
    "whole function.",
    f"Add a docstring to this Python function and return the whole function:\n\n{FUNCTION}",
    f"Here is a Python function:\n\n{FUNCTION}\n\nAdd type hints to its arguments and return value, and "
    "return the whole function.",
    f"Change this function so that it raises ValueError when window is not positive. Return the whole "
    f"function.\n\n{FUNCTION}",
]
WORKLOADS = {"chat": CHAT_PROMPTS, "rewrite": REWRITE_PROMPTS, "code": CODE_PROMPTS}


@dataclass
class TreeDraft:
    """A benchmark entry for a draft that proposes trees (speculative_tree.py): make(k) builds it for
    one k (per_k) or once for every k (its own shape; the row's k is its depth)."""

    make: Callable[[int], object]
    per_k: bool = False


def head_entry(name: str, target: TransformerLM, folder=None) -> TreeDraft:
    """The benchmark's draft-head entries: "head" (chains of k), "head-full" (chains reading out all V
    tokens), "head-tree" (DEFAULT_TREE), "head-gate" (the nodes of DEFAULT_TREE the confidence gate
    lets through), "head-auto" (HeadDraft.auto: adaptive depth, prompt lookup).
    The head runs as the CLI runs it: its products in q8_0 through the kernels."""
    from cs336_inference.draft_head import DEFAULT_HEAD_DIR, HeadDraft, load_draft_head
    from cs336_inference.fast import install
    from cs336_inference.speculative_tree import DEFAULT_TREE

    head = load_draft_head(folder or DEFAULT_HEAD_DIR, target, full_vocab=name == "head-full")
    install(head.quantize("q8_0"))  # as generate.py drafts with it
    if name in ("head", "head-full"):
        return TreeDraft(lambda k: HeadDraft(head, k), per_k=True)
    if name == "head-tree":
        return TreeDraft(lambda k: HeadDraft(head, DEFAULT_TREE))
    if name == "head-gate":
        return TreeDraft(lambda k: HeadDraft(head, DEFAULT_TREE, gate=True))
    return TreeDraft(lambda k: HeadDraft.auto(head))


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """(1 - a^(k+1)) / (1 - a): the expected tokens per target pass for acceptance a (k + 1 at a = 1)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_per_pass_drafted(alpha: float, round_drafts: list[int]) -> float:
    """The formula with each round's own number of drafts d (prompt lookup drafts fewer than k, none
    without a match; the last rounds never draft past max_new_tokens): mean of (1 - a^(d+1)) / (1 - a)."""
    return sum(expected_tokens_per_pass(alpha, d) for d in round_drafts) / len(round_drafts)


@torch.inference_mode()
def forward_cost(
    model: TransformerLM, context: torch.Tensor, n_tokens: int, runs: int = 3, step_mode: str | None = None
) -> float:
    """Median seconds of one cached forward of n_tokens after `context` (rolled back after each);
    with a step_mode, of the fixed-shape step of n_tokens (as speculative decoding runs it)."""
    if step_mode is None:
        cache = model.new_cache(1, len(context) + n_tokens)
        forward = model
    else:
        from cs336_inference.fast.step.fixed import FixedShapes, fixed_capacity

        cache = model.new_cache(1, fixed_capacity(len(context) + n_tokens, model.config.max_seq_len))
        forward = FixedShapes(model, cache, n_tokens, step_mode)
    model(context[None, :-n_tokens], cache=cache)
    start = cache.pos
    feed = context[None, -n_tokens:]

    def step():
        forward(feed, cache=cache)
        cache.truncate(start)

    return median_seconds(step, repeats=runs, warmup=1, device=context.device)


def pass_costs(
    target: TransformerLM, context: torch.Tensor, ks: list[int], runs: int, log: Log, step_mode=None
) -> dict:
    """{"step_s": 1-token step, "verify_ratio": {k: (k+1)-token forward / 1-token step}}. Each ratio
    divides by a 1-token step timed right after its pass (memory bandwidth drifts over a run);
    step_s is the median of those steps."""
    steps, ratios = [], {}
    for k in ks:
        verify = forward_cost(target, context, k + 1, runs, step_mode)
        steps.append(forward_cost(target, context, 1, runs, step_mode))
        ratios[k] = verify / steps[-1]
        log(f"  verify pass of {k + 1} tokens: {ratios[k]:.2f}x a one-token step ({steps[-1] * 1e3:.0f} ms)")
    step = statistics.median(steps) if steps else forward_cost(target, context, 1, runs, step_mode)
    return {"step_s": step, "verify_ratio": ratios}


def prefill_seconds(
    target: TransformerLM, ids: torch.Tensor, runs: int = 3, step_mode: str | None = None
) -> float:
    """Median seconds of the prompt's prefill into a fresh cache (the last position's logits), as
    target-only decoding and speculation begin (fixed.prefill: native steps with step_mode "native",
    else the model's own forward)."""
    cache = target.new_cache(1, len(ids) + 1)

    def prefill():
        fixed_prefill(target, cache, ids[None], step_mode)
        cache.truncate(0)

    return median_seconds(prefill, repeats=runs, warmup=1, device=ids.device)


def _timed(fn) -> tuple[object, float]:
    synchronize()
    start = time.perf_counter()
    out = fn()
    synchronize()
    return out, time.perf_counter() - start


def speculative_benchmark(
    target: TransformerLM,
    drafts: dict[str, object],
    workloads: dict[str, list[torch.Tensor]],
    ks: list[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    runs: int = 3,
    log: Log = print,
    step_mode: str | None = None,
    repeats: int = 1,
) -> dict:
    """Greedy speculative decoding vs target-only decoding; returns {"rows": [...], "costs": {...}}.

    drafts: name -> "ngram" / NGramDraft / TransformerLM / ModelDraft (e.g. share_cache=True);
    workloads: name -> list of prompt ids.
    Each (workload, draft, k) row pools the workload's prompts. step_mode: see the module docstring.
    repeats: each prompt's baseline and speculative run alternate this many times; the times are their
    medians (the counts pool every repeat).
    """
    first = next(iter(workloads.values()))[0]
    log(f"pass costs at a context of {len(first)} tokens{'' if step_mode is None else ', ' + step_mode}:")
    costs = pass_costs(target, first, sorted(set(ks)), runs, log, step_mode)
    draft_ratio = {}
    for name, draft in drafts.items():
        if isinstance(draft, TreeDraft):  # measured round by round (SpeculativeStats.draft_seconds)
            draft_ratio[name] = None
            continue
        model = draft.model if isinstance(draft, ModelDraft) else draft
        if isinstance(model, TransformerLM):
            draft_ratio[name] = forward_cost(model, first, 1, runs, step_mode) / costs["step_s"]
            shared = isinstance(draft, ModelDraft) and draft.share_cache  # then one-token steps only
            if step_mode is not None and not shared:
                # its 2-token step (a round after all k were accepted) compiles here, not in a timed run
                forward_cost(model, first, 2, 1, step_mode)
            log(f"  draft {name}: one step = {draft_ratio[name]:.2f}x a target step")
        else:
            draft_ratio[name] = 0.0

    def target_only(ids):
        if step_mode is None:
            return generate(target, ids, max_new_tokens, stop_token_ids=stop_token_ids)
        from cs336_inference.fast.step.fixed import graph_generate

        return graph_generate(target, ids, max_new_tokens, step_mode, stop_token_ids or ())

    rows = []
    for wname, prompts in workloads.items():
        base_tokens, base_times = [], []
        for ids in prompts:
            out, seconds = _timed(lambda ids=ids: target_only(ids))
            base_tokens.append(out)
            base_times.append(seconds)
        base_s = sum(base_times)
        n_base = sum(len(t) for t in base_tokens)
        prefill_s = sum(prefill_seconds(target, ids, runs, step_mode) for ids in prompts)
        log(f"{wname}: target only, {n_base} tokens in {base_s:.1f} s ({n_base / base_s:.2f} tokens/s)")
        for dname, draft in drafts.items():
            tree = isinstance(draft, TreeDraft)
            for k in ks if not tree or draft.per_k else ks[:1]:
                new = passes = accepted = rejected = drafted = first = 0
                spec_times, row_base_times, identical, round_drafts = [], [], True, []
                draft_s = verify_s = 0.0
                forwards = 0  # a model draft's forwards (with lookup, only its rounds without a copy run it)
                drafter = draft.make(k) if tree else draft
                # ModelDraft(lookup=True): the rounds that copy run no model
                copies = getattr(drafter, "lookup", False)
                if tree:
                    k = drafter.max_depth
                # a chain draft takes k; a tree draft has its own shape
                run = tree_generate if tree else functools.partial(speculative_generate, k=k)
                for ids, ref in zip(prompts, base_tokens, strict=True):
                    bases, specs = [], []
                    for _ in range(repeats):
                        # the baseline again right before: the speedup pairs runs seconds apart, not minutes
                        bases.append(_timed(lambda ids=ids: target_only(ids))[1])
                        (out, stats), seconds = _timed(
                            lambda ids=ids, run=run, drafter=drafter: run(
                                target,
                                drafter,
                                ids,
                                max_new_tokens,
                                stop_token_ids=stop_token_ids,
                                return_stats=True,
                                steps=None if step_mode is None else FixedSteps(step_mode),
                            )
                        )
                        specs.append(seconds)
                        draft_s += stats.draft_seconds
                        forwards += getattr(drafter, "forwards", 0)
                        verify_s += stats.verify_seconds
                        identical &= torch.equal(out, ref)
                        new += stats.new_tokens
                        first += stats.prefill_tokens  # the prompt's prefill gave them, not a round
                        passes += stats.target_passes
                        accepted += stats.accepted
                        rejected += stats.rejected
                        drafted += stats.drafted
                        round_drafts += stats.round_drafts
                    row_base_times.append(statistics.median(bases))
                    spec_times.append(statistics.median(specs))
                spec_s = sum(spec_times)
                alpha = accepted / (accepted + rejected) if accepted + rejected else float("nan")
                tpp = (new - first) / passes
                if tree:  # measured per round (drafting, all levels; the tree pass) over the decode step
                    # of this row's own target-only runs, timed beside it
                    step_s = (sum(row_base_times) - prefill_s) / max(1, n_base - len(prompts))
                    step_s = step_s if step_s > 0 else costs["step_s"]
                    verify_cost = verify_s / passes / step_s
                    draft_cost = draft_s / passes / step_s
                    round_cost = verify_cost + draft_cost
                elif copies:  # the model ran in some rounds only: its steps per round
                    verify_cost = costs["verify_ratio"][k]
                    draft_cost = forwards / passes * draft_ratio[dname]
                    round_cost = verify_cost + draft_cost
                else:
                    verify_cost, draft_cost = costs["verify_ratio"][k], draft_ratio[dname]
                    round_cost = verify_cost + k * draft_cost
                row = dict(
                    workload=wname,
                    draft=dname,
                    k=k,
                    alpha=alpha,
                    tokens_per_pass=tpp,
                    predicted_tokens_per_pass=expected_tokens_per_pass(alpha, k) if alpha == alpha else None,
                    predicted_tokens_per_pass_drafted=(
                        expected_tokens_per_pass_drafted(alpha, round_drafts) if alpha == alpha else None
                    ),
                    verify_cost=verify_cost,
                    draft_cost=draft_cost,
                    draft_cost_per="round" if tree or copies else "step",
                    drafted_per_pass=drafted / passes,
                    predicted_speedup=tpp / round_cost,
                    speedup=sum(row_base_times) / spec_s,
                    decode_speedup=(
                        (sum(row_base_times) - prefill_s) / (spec_s - prefill_s)
                        if spec_s > prefill_s
                        else None
                    ),
                    speedup_per_prompt=[b / t for b, t in zip(row_base_times, spec_times, strict=True)],
                    tokens_per_s=new / spec_s,
                    target_tokens_per_s=n_base / sum(row_base_times),
                    drafted=drafted,
                    accepted=accepted,
                    identical=bool(identical),
                )
                rows.append(row)
                log(
                    f"  {dname} k={k}: alpha {alpha:.2f}, {tpp:.2f} tokens/pass, speedup {row['speedup']:.2f}x "
                    f"(predicted {row['predicted_speedup']:.2f}x; per prompt "
                    f"{', '.join(f'{x:.2f}x' for x in row['speedup_per_prompt'])}), identical {identical}"
                )
    return {"rows": rows, "costs": {**costs, "draft_ratio": draft_ratio}}


def format_speculative_table(rows: list[dict]) -> str:
    """A markdown table of the rows."""
    head = (
        "| workload | draft | k | alpha | tokens/pass | formula | formula, drafted | verify cost | draft cost | "
        "predicted speedup | speedup | decode speedup | identical |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    )
    lines = [head]
    for r in rows:
        formula = "–" if r["predicted_tokens_per_pass"] is None else f"{r['predicted_tokens_per_pass']:.2f}"
        drafted = r.get("predicted_tokens_per_pass_drafted")
        drafted = "–" if drafted is None else f"{drafted:.2f}"
        per = " per round" if r.get("draft_cost_per") == "round" else ""
        decode = "–" if r.get("decode_speedup") is None else f"{r['decode_speedup']:.2f}x"
        lines.append(
            f"| {r['workload']} | {r['draft']} | {r['k']} | {r['alpha']:.2f} | {r['tokens_per_pass']:.2f} | "
            f"{formula} | {drafted} | {r['verify_cost']:.2f} | {r['draft_cost']:.2f}{per} | {r['predicted_speedup']:.2f}x | "
            f"{r['speedup']:.2f}x | {decode} | {'yes' if r['identical'] else 'NO'} |"
        )
    return "\n".join(lines)


def format_speculative_costs(costs: dict) -> str:
    """One line under the table: the one-token target step, the verify passes and the model drafts' steps
    in units of it (the pass costs at the first prompt's context)."""
    ratios = costs["verify_ratio"]
    sizes = " / ".join(str(k + 1) for k in sorted(ratios))
    verify = " / ".join(f"{ratios[k]:.2f}" for k in sorted(ratios))
    line = (
        f"one-token target step {costs['step_s'] * 1e3:.1f} ms; verify pass of {sizes} tokens: {verify} steps"
    )
    drafts = {name: r for name, r in costs.get("draft_ratio", {}).items() if r}
    if drafts:
        line += "; a draft step: " + ", ".join(f"{name} {r:.2f}" for name, r in drafts.items())
    return line


def plot_speedup(rows: list[dict], path) -> None:
    """Measured (solid) and predicted (dashed) speedup against k, one line per workload and draft."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for key in dict.fromkeys((r["workload"], r["draft"]) for r in rows):
        sel = [r for r in rows if (r["workload"], r["draft"]) == key]
        ks = [r["k"] for r in sel]
        (line,) = ax.plot(ks, [r["speedup"] for r in sel], marker="o", label=f"{key[0]}, {key[1]}")
        ax.plot(ks, [r["predicted_speedup"] for r in sel], ls="--", color=line.get_color())
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("k (drafted tokens per round)")
    ax.set_ylabel("speedup over target-only decoding")
    ax.set_title("Speculative decoding (solid: measured, dashed: predicted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

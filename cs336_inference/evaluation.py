"""Judging a compressed model: perplexity, KL to the float model, greedy agreement, bytes, speed.

Perplexity with a sliding window. A text of N tokens is longer than the context we give the model,
so windows of `window` tokens advance by `stride`; each window scores only the targets no earlier
window scored, so every token 1..N-1 is predicted exactly once, with at least window - stride
tokens of context (except in the first window):

    window [b, b + W)   scores targets t in [last scored + 1, b + W)   (stride < W: t > b)
    NLL = mean over targets of -log p(x_t | x_b..x_{t-1}),   perplexity = exp(NLL)

KL(float || quantized) per token: the same windows through both models; at every scored position
sum_v p_float(v) (log p_float(v) - log p_quant(v)), averaged over positions. Perplexity can hide
errors that cancel (some tokens more likely, some less); KL measures how far each next-token
distribution moved. top-1 agreement: how often the two argmaxes are the same token.

Greedy agreement on chat prompts: the float model generates greedily; the other model is run on
the same tokens (teacher forcing) and we count the positions where its argmax is the float model's
token, and the length of the common prefix (what free-running greedy decoding would share).

The default text is the Python reference documentation shipped with CPython (pydoc_data.topics):
English prose and code nobody here wrote, present on every machine. It differs a little between
Python versions, so every number names the version (`python_version()`). Calibration data (for
AWQ) comes from a different source, the docstrings of some standard-library modules, so the
evaluation text is never seen during calibration.
"""

from __future__ import annotations

import importlib
import inspect
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor, nn

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the factorial of n.",
    "Give me three tips for a good night's sleep.",
)
CALIBRATION_MODULES = (
    "argparse",
    "collections",
    "subprocess",
    "threading",
    "logging",
    "json",
    "pathlib",
    "functools",
    "unittest",
    "email.message",
    "http.client",
    "asyncio.tasks",
)


def python_version() -> str:
    return platform.python_version()


def default_eval_text() -> str:
    """The CPython reference documentation topics (pydoc_data.topics), in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def default_calibration_text(max_chars: int | None = None) -> str:
    """Docstrings of a few standard-library modules and their public members (not the eval text)."""
    parts = []
    for name in CALIBRATION_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(dir(module)):
            member = getattr(module, attr)
            if not attr.startswith("_") and getattr(member, "__module__", None) == module.__name__:
                doc = inspect.getdoc(member)
                if doc:
                    parts.append(doc)
    text = "\n\n".join(p for p in parts if p)
    return text if max_chars is None else text[:max_chars]


# ------------------------------------------------------------------ windows
def windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_target) of each window; targets first_target..end-1 are scored in it."""
    if window < 2 or not 1 <= stride < window:
        raise ValueError(f"need window >= 2 and 1 <= stride < window, got window={window}, stride={stride}")
    if n_tokens < 2:
        raise ValueError(f"a text of {n_tokens} token(s) has nothing to predict")
    out, scored_until, begin = [], 1, 0
    while scored_until < n_tokens:
        end = min(begin + window, n_tokens)
        out.append((begin, end, scored_until))
        scored_until = end
        begin += stride
    return out


def _window_logprobs(model: nn.Module, ids: Tensor, begin: int, end: int, first: int) -> Tensor:
    """log-softmax [n_scored, V] at the positions that predict targets first..end-1."""
    with torch.no_grad():  # position i predicts token i + 1: the window's last token is only a target
        logits = model(ids[None, begin : end - 1].to(model.norm.weight.device))[0]
    return logits[first - 1 - begin :].float().log_softmax(dim=-1)


def continuation_logprob(
    model: nn.Module, context_ids: list[int], continuation_ids: list[int]
) -> tuple[float, bool]:
    """log p(continuation | context), summed over the continuation's tokens, and whether each of
    them is the argmax of its position (greedy decoding would write it): what a multiple-choice
    evaluation compares across choices (lm-eval's loglikelihood request), from one forward."""
    if not context_ids or not continuation_ids:
        raise ValueError("the context and the continuation each need at least one token")
    ids = torch.tensor(context_ids + continuation_ids)
    first = len(context_ids)
    lp = _window_logprobs(model, ids, 0, len(ids), first)  # rows predict tokens first..end-1
    targets = ids[first:].to(lp.device)
    picked = lp.gather(-1, targets[:, None])[:, 0]
    return float(picked.double().sum()), bool((lp.argmax(dim=-1) == targets).all())


@dataclass
class TextScores:
    nll_sum: float = 0.0
    kl_sum: float = 0.0
    top1_same: int = 0
    n: int = 0

    def as_dict(self, with_reference: bool) -> dict:
        out = {
            "n_targets": self.n,
            "nll": self.nll_sum / self.n,
            "perplexity": math.exp(self.nll_sum / self.n),
        }
        if with_reference:
            out |= {"kl": self.kl_sum / self.n, "top1_agreement": self.top1_same / self.n}
        return out


def score_text(
    models: dict[str, nn.Module],
    ids: Int[Tensor, " N"],
    reference: str | None = None,
    window: int = 1024,
    stride: int = 512,
    progress: Callable[[Iterator], Iterator] | None = None,
) -> dict[str, dict]:
    """Perplexity of every model on ids, and KL / top-1 agreement to models[reference].

    Window by window, all models in turn (one interleaved pass, so the reference's log-probs are
    computed once per window and never all held at once). progress wraps the window iterator
    (e.g. tqdm). Returns {name: {"perplexity", "nll", "n_targets", ["kl", "top1_agreement"]}}.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    spans = windows(ids.numel(), window, stride)
    scores = {name: TextScores() for name in models}
    order = ([reference] if reference else []) + [n for n in models if n != reference]
    it = progress(iter(spans)) if progress else spans
    for begin, end, first in it:
        targets = ids[first:end]
        ref_lp = None
        for name in order:
            lp = _window_logprobs(models[name], ids, begin, end, first)
            s = scores[name]
            s.nll_sum += float(-lp.gather(1, targets[:, None].to(lp.device)).sum())
            s.n += targets.numel()
            if name == reference:
                ref_lp = lp
            elif ref_lp is not None:
                s.kl_sum += float((ref_lp.exp() * (ref_lp - lp)).sum())
                s.top1_same += int((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
    return {name: scores[name].as_dict(reference is not None and name != reference) for name in models}


def perplexity(model: nn.Module, ids: Int[Tensor, " N"], window: int = 1024, stride: int = 512) -> float:
    """exp(mean NLL) of ids under model, with a sliding window (see the module docstring)."""
    return score_text({"model": model}, ids, window=window, stride=stride)["model"]["perplexity"]


# ------------------------------------------------------------------ greedy agreement
def greedy_references(model: nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[Tensor]:
    """prompt + the model's greedy continuation (no early stop), one 1-D tensor per prompt."""
    from cs336_inference.sampling import generate

    out = []
    for p in prompts:
        new = generate(model, torch.tensor(p), max_new_tokens=max_new_tokens, stop_token_ids=[])
        out.append(torch.cat([torch.tensor(p), new.cpu()]))
    return out


def greedy_agreement(model: nn.Module, references: list[Tensor], prompt_lengths: list[int]) -> dict:
    """Teacher-forced on each reference continuation: the fraction of positions where model's argmax
    is the reference token, and the mean length of the common greedy prefix."""
    same = total = 0
    prefixes = []
    for seq, P in zip(references, prompt_lengths, strict=True):
        with torch.no_grad():
            logits = model(seq[None, :-1].to(model.norm.weight.device))[0, P - 1 :]
        match = (logits.argmax(-1).cpu() == seq[P:]).tolist()
        same += sum(match)
        total += len(match)
        prefixes.append(match.index(False) if False in match else len(match))
    return {"greedy_agreement": same / total, "greedy_prefix": statistics.mean(prefixes)}


def chat_prompt_ids(tokenizer, prompts: tuple[str, ...] = CHAT_PROMPTS) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# ------------------------------------------------------------------ decode speed
def decode_speed(
    models: dict[str, nn.Module], prompt: Tensor, new_tokens: int = 32, rounds: int = 3
) -> dict[str, float]:
    """Decode tokens/s of each model (greedy, batch 1): median over rounds, models interleaved
    within each round so that machine noise hits all of them alike. One warm-up each first.
    Time per token = (time for prompt + new_tokens) - (time for prompt + 1), over new_tokens - 1."""
    from cs336_inference.sampling import generate

    def timed(model, n):
        start = time.perf_counter()
        generate(model, prompt, max_new_tokens=n, stop_token_ids=[])
        return time.perf_counter() - start

    for model in models.values():
        timed(model, 2)
    per_token: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            per_token[name].append((timed(model, new_tokens) - timed(model, 1)) / (new_tokens - 1))
    return {name: 1.0 / statistics.median(times) for name, times in per_token.items()}


def weight_count(model: nn.Module) -> int:
    """Numbers in the weights of the float model this one came from (a quantized layer counts d_out * d_in)."""
    from cs336_inference.quantization import QuantizedEmbedding, QuantizedLinear

    total = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            total += module.d_in * module.d_out + (0 if module.bias is None else module.d_out)
            seen.update(id(t) for t in module.buffers())
        elif not isinstance(module, QuantizedEmbedding):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
    return total


# ------------------------------------------------------------------ the compression table
def compression_table(
    model: nn.Module,
    tokenizer,
    methods: list[str],
    eval_ids: Int[Tensor, " N"],
    calibration_ids: Int[Tensor, "B T"] | None = None,
    window: int = 1024,
    stride: int = 512,
    decode_tokens: int = 32,
    decode_rounds: int = 3,
    greedy_tokens: int = 32,
    progress: Callable[[Iterator], Iterator] | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """fp32 and every quantization method side by side: bits per weight, weight MB, perplexity on
    eval_ids, KL to fp32, top-1 and greedy agreement with fp32, decode tokens/s (interleaved).

    A method name may end in "+head" (e.g. "q8_0+head") to quantize the embedding / output head too.
    """
    from cs336_inference.quantization import model_nbytes, quantize_model

    models: dict[str, nn.Module] = {"fp32": model}
    seconds: dict[str, float] = {"fp32": 0.0}
    for name in methods:
        method, _, head = name.partition("+")
        log(f"quantizing: {name}")
        start = time.perf_counter()
        models[name] = quantize_model(
            model,
            method,
            calibration=calibration_ids if method == "awq" else None,
            quantize_head=head == "head",
        )
        seconds[name] = time.perf_counter() - start
    log(f"perplexity and KL on {eval_ids.numel()} tokens (window {window}, stride {stride})")
    text = score_text(models, eval_ids, "fp32", window, stride, progress)
    prompts = chat_prompt_ids(tokenizer)
    refs = None
    if greedy_tokens > 0:
        log(f"greedy agreement on {len(CHAT_PROMPTS)} chat prompts x {greedy_tokens} tokens")
        refs = greedy_references(model, prompts, greedy_tokens)
    speed = {}
    if decode_tokens > 1:
        log(f"decode speed: {decode_tokens} new tokens, median of {decode_rounds} interleaved rounds")
        speed = decode_speed(models, torch.tensor(prompts[0]), decode_tokens, decode_rounds)
    n_weights = weight_count(model)
    rows = []
    for name, m in models.items():
        nbytes = model_nbytes(m)
        row = {
            "method": name,
            "bits_per_weight": 8 * nbytes / n_weights,
            "weight_mb": nbytes / 1e6,
            **text[name],
        }
        if refs is not None and name != "fp32":
            row |= greedy_agreement(m, refs, [len(p) for p in prompts])
        if speed:
            row["decode_tok_s"] = speed[name]
        rows.append(row | {"quantize_s": seconds[name]})
    return rows


def format_quality_table(rows: list[dict]) -> str:
    """A fixed-width text table of compression_table's rows."""
    head = f"{'method':<12}{'bits/w':>8}{'MB':>9}{'ppl':>9}{'KL':>9}{'top1':>7}{'greedy':>8}{'prefix':>8}{'tok/s':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        kl = f"{r['kl']:.4f}" if "kl" in r else "-"
        top1 = f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "-"
        greedy = f"{r['greedy_agreement']:.3f}" if "greedy_agreement" in r else "-"
        prefix = f"{r['greedy_prefix']:.1f}" if "greedy_prefix" in r else "-"
        speed = f"{r['decode_tok_s']:.1f}" if "decode_tok_s" in r else "-"
        lines.append(
            f"{r['method']:<12}{r['bits_per_weight']:>8.2f}{r['weight_mb']:>9.1f}{r['perplexity']:>9.3f}"
            f"{kl:>9}{top1:>7}{greedy:>8}{prefix:>8}{speed:>8}"
        )
    return "\n".join(lines)

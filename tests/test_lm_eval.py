"""A real evaluation client: lm-eval's completions backend scores SmolLM2 through the server.

The task is evals/python_mc (24 multiple-choice questions in a local JSONL, no network). lm-eval
tokenizes through the server's /tokenize, sends each (context, choice) as token ids with echo,
logprobs and max_tokens 1, and sums the choice's token log-probabilities. The same sums computed
in-process with the library (evaluation.continuation_logprob on one plain forward, the text split
into context and continuation as lm-eval splits it) must give the same log-likelihoods, the same
choice per item and the same accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
lm_eval = pytest.importorskip("lm_eval")

from test_server import MODEL, Server, running  # noqa: E402

from cs336_inference.evaluation import continuation_logprob  # noqa: E402
from cs336_inference.io.checkpoint import default_model_path, load_pretrained  # noqa: E402
from cs336_inference.io.tokenizer import load_tokenizer  # noqa: E402
from cs336_inference.serving import LLMEngine  # noqa: E402

EVALS = Path(__file__).resolve().parents[1] / "evals"


def split_like_lm_eval(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's rule: trailing spaces of the context move to the continuation; the whole text is
    encoded once and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = tokenizer.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


@pytest.fixture(scope="module")
def smollm2_server():
    torch.manual_seed(0)
    path = default_model_path()
    model = load_pretrained(path).eval()
    tokenizer = load_tokenizer(path)
    engine = LLMEngine(model, num_blocks=64, block_size=16)
    yield from running(Server(model, tokenizer, engine))


def test_lm_eval_scores_through_the_server_as_the_library_does(smollm2_server, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    server = smollm2_server
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    results = simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL, "base_url": url, "num_concurrent": 1, "max_retries": 1},
        tasks=["python_mc"],
        task_manager=TaskManager(include_path=str(EVALS)),
        log_samples=True,
    )
    samples = sorted(results["samples"]["python_mc"], key=lambda s: s["doc_id"])
    docs = [json.loads(line) for line in (EVALS / "python_mc" / "python_mc.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs) == 24

    correct = 0
    for sample, doc in zip(samples, docs, strict=True):
        context = f"Question: {doc['question']}\nAnswer:"
        ours = [
            continuation_logprob(server.model, *split_like_lm_eval(server.tokenizer, context, " " + c))[0]
            for c in doc["choices"]
        ]
        theirs = [float(r[0][0]) for r in sample["resps"]]
        item = f"item {sample['doc_id']} ({doc['question']!r})"
        assert theirs == pytest.approx(ours, abs=2e-3), f"{item}: lm-eval's log-likelihoods vs the library's"
        best = max(range(4), key=ours.__getitem__)
        if sorted(ours)[-1] - sorted(ours)[-2] > 1e-2:  # a clear winner: both must pick it
            assert max(range(4), key=theirs.__getitem__) == best, f"{item}: a different choice"
        assert sample["acc"] == float(best == doc["answer"]), f"{item}: lm-eval's acc"
        correct += best == doc["answer"]
    accuracy = results["results"]["python_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(docs)), "lm-eval's accuracy vs the library's"
    assert accuracy > 0.25, f"accuracy {accuracy:.3f}: not above chance (4 choices)"
    stats = server.stats()
    assert stats["free_blocks"] == stats["num_blocks"]

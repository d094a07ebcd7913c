"""The server's log-probabilities, echo, n and tokenizer endpoints, through the official `openai`
client against a live uvicorn on 127.0.0.1 (the tiny model with SmolLM2's vocabulary of
test_server.py). Expected values come from the library: `generate(..., return_logprobs=True)` and a
plain forward's log-softmax."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from test_server import MODEL, NUM_BLOCKS, get, running, start_server  # noqa: E402

from cs336_inference.sampling import SamplingParams, generate  # noqa: E402


@pytest.fixture(scope="module")
def server():
    yield from running(start_server())


def library(server, ids: list[int], max_tokens: int, top: int, **settings):
    """generate's tokens and log-probabilities for one prompt, the server's stop ids. A stop token
    that ends the reply is listed with its log-probability, though its text is not in the reply."""
    stops = sorted(set(server.tokenizer.eos_token_ids) | set(server.model.config.eos_token_ids))
    p = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stops, logprobs=top, **settings)
    tokens, lps = generate(server.model, ids, params=p, return_logprobs=True)
    return tokens.tolist(), lps


def shown(server, tokens: list[int]) -> list[int]:
    """The tokens whose text is in the reply (a stop token's is not)."""
    return tokens[:-1] if tokens and tokens[-1] in server.tokenizer.eos_token_ids else tokens


def full_logprobs(server, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return server.model(torch.tensor([ids]))[0].log_softmax(-1)


def token_str(server, token_id: int) -> str:
    return server.tokenizer.decode([token_id])


def test_completion_logprobs_equal_generate(server):
    prompt = "The capital of France is"
    ids = server.tokenizer.encode(prompt)
    out = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3
    )
    tokens, lps = library(server, ids, 8, 3)
    got = out.choices[0].logprobs
    assert got.tokens == [token_str(server, t) for t in tokens], "one token string per token of the reply"
    assert got.token_logprobs == pytest.approx([e.logprob for e in lps], abs=1e-5)
    for t, (top, e) in enumerate(zip(got.top_logprobs, lps, strict=True)):
        assert list(top) == [token_str(server, a) for a, _ in e.top], f"token {t}: top 3, most likely first"
        assert list(top.values()) == pytest.approx([v for _, v in e.top], abs=1e-5)
        assert max(top.values()) == pytest.approx(got.token_logprobs[t], abs=1e-6), "greedy = most likely"
    text = out.choices[0].text
    assert got.text_offset == [
        len(server.tokenizer.decode(shown(server, tokens[:i]))) for i in range(len(tokens))
    ]
    assert text == server.tokenizer.decode(shown(server, tokens))


def test_sampled_logprobs_are_those_of_the_filtered_distribution(server):
    prompt = "Once upon a time"
    ids = server.tokenizer.encode(prompt)
    settings = dict(temperature=0.8, top_k=7, seed=3)
    out = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, logprobs=5, extra_body={"top_k": 7}, temperature=0.8, seed=3
    )
    tokens, lps = library(server, ids, 6, 5, **settings)
    got = out.choices[0].logprobs
    assert got.tokens == [token_str(server, t) for t in tokens]
    assert got.token_logprobs == pytest.approx([e.logprob for e in lps], abs=1e-5)
    for top in got.top_logprobs:  # a top-7 distribution: its top 5 hold most of the mass
        assert 0.0 < sum(torch.tensor(list(top.values())).exp()) <= 1.0 + 1e-6


def test_echo_with_max_tokens_0_scores_the_prompt(server):
    """What lm-eval sends to score a continuation: echo, logprobs, no new tokens. Position i holds
    log-softmax(forward(prompt)[i - 1])[prompt[i]], the first null."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = server.tokenizer.encode(prompt)
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and out.usage.completion_tokens == 0 and choice.finish_reason == "length"
    lp = full_logprobs(server, ids)
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    best = [token_str(server, int(lp[i - 1].argmax())) for i in range(1, len(ids))]
    assert [next(iter(t)) for t in choice.logprobs.top_logprobs[1:]] == best
    assert choice.logprobs.tokens == [token_str(server, t) for t in ids]
    assert choice.logprobs.text_offset[-1] == len(server.tokenizer.decode(ids[:-1]))


def test_echo_with_new_tokens_as_token_ids(server):
    """A prompt given as token ids, echoed with its log-probabilities, then 4 new tokens'."""
    ids = server.tokenizer.encode("In the beginning")
    out = server.client.completions.create(
        model=MODEL, prompt=ids, max_tokens=4, echo=True, logprobs=0, temperature=0
    )
    tokens, lps = library(server, ids, 4, 0)
    got = out.choices[0].logprobs
    prompt_text = server.tokenizer.decode(ids)
    assert out.choices[0].text == prompt_text + server.tokenizer.decode(shown(server, tokens))
    assert len(got.token_logprobs) == len(ids) + len(tokens)
    assert got.token_logprobs[len(ids) :] == pytest.approx([e.logprob for e in lps], abs=1e-5)
    assert got.text_offset[len(ids)] == len(prompt_text), "the new tokens' offsets count the echoed prompt"


def test_chat_logprobs_and_top_logprobs(server):
    messages = [{"role": "user", "content": "Name three colours."}]
    out = server.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    ids = server.tokenizer.encode(server.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    tokens, lps = library(server, ids, 10, 2)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [token_str(server, t) for t in tokens]
    n = len(shown(server, tokens))
    assert b"".join(bytes(c.bytes) for c in content[:n]).decode() == out.choices[0].message.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in lps], abs=1e-5)
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    plain = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_samples_each_equal_generate_with_seed_plus_index(server):
    prompts = ["Once upon a time", "The capital of France is"]
    before = server.stats()["computed_tokens"]
    out = server.client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        i, j = divmod(c.index, 3)
        ids = server.tokenizer.encode(prompts[i])
        tokens = generate(server.model, ids, 6, temperature=1.0, seed=11 + j, stop_token_ids=[]).tolist()
        assert c.text == server.tokenizer.decode(tokens), f"choice {c.index}: prompt {i}, sample {j}"
    P = sum(len(server.tokenizer.encode(p)) for p in prompts)
    assert server.stats()["computed_tokens"] - before == P + 6 * 5, "each prompt is prefilled once"
    assert out.usage.completion_tokens == 36
    assert server.stats()["free_blocks"] == NUM_BLOCKS


def test_streamed_n_with_logprobs_adds_up_to_the_plain_reply(server):
    kwargs = dict(model=MODEL, prompt="Hello there", n=2, max_tokens=8, temperature=0.9, seed=5, logprobs=2)
    plain = server.client.completions.create(**kwargs)
    text, lps = {0: "", 1: ""}, {0: [], 1: []}
    finish = {}
    for chunk in server.client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text[c.index] += c.text
            if c.logprobs is not None:
                lps[c.index] += c.logprobs.token_logprobs
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    for c in plain.choices:
        assert text[c.index] == c.text, f"choice {c.index}: streamed text"
        assert lps[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-6), f"choice {c.index}"
        assert finish[c.index] == c.finish_reason


def test_streamed_chat_logprobs(server):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True
    )
    plain = server.client.chat.completions.create(**kwargs)
    streamed = []
    for chunk in server.client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [c.token for c in streamed] == [c.token for c in plain.choices[0].logprobs.content]


BAD = {
    "logprobs over 20": ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    "logprobs negative": ({"prompt": "hi", "logprobs": -1}, "logprobs"),
    "n = 0": ({"prompt": "hi", "n": 0}, "n"),
    "n too large": ({"prompt": "hi", "n": 65}, "n"),
    "prompts x n too many": ({"prompt": ["a", "b", "c"], "n": 30}, "n"),
    "echo not a bool": ({"prompt": "hi", "echo": "yes"}, "echo"),
    "a bad prompt in a batch": ({"prompt": ["hi", 3]}, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_logprobs_and_n_are_400s(server, case):
    body, param = BAD[case]
    status, reply = server.post("/v1/completions", {"model": MODEL, "max_tokens": 2, **body})
    assert status == 400 and reply["error"]["param"] == param, f"{case}: {status} {reply}"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply = server.post("/v1/chat/completions", chat | {"top_logprobs": 2})
    assert status == 400 and reply["error"]["param"] == "top_logprobs", "top_logprobs without logprobs"
    status, reply = server.post("/v1/chat/completions", chat | {"logprobs": True, "top_logprobs": 21})
    assert status == 400 and reply["error"]["param"] == "top_logprobs"
    out = server.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_tokenizer_endpoints(server):
    text = "héllo — wörld"
    status, body = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == server.tokenizer.encode(text, add_special_tokens=False)
    assert body["count"] == len(body["tokens"])
    status, back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": text}
    status, bad = server.post("/detokenize", {"tokens": [-1]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, raw = get(server.port, "/tokenizer_info")
    info = json.loads(raw)
    assert status == 200 and info["eos_token"] == server.tokenizer.eos_token
    assert info["chat_template"] == server.tokenizer.chat_template


@pytest.mark.slow
def test_scripts_serve_py_answers_every_new_parameter():
    """scripts/serve.py itself (the readable path, SmolLM2) on 127.0.0.1, through the openai client:
    logprobs with echo, n samples with a seed, a JSON schema, stop strings; each as the library gives."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import openai

    from cs336_inference.bench.http import free_port, wait_ready
    from cs336_inference.io.checkpoint import default_model_path, load_pretrained
    from cs336_inference.io.tokenizer import load_tokenizer

    path = default_model_path()
    model, tok = load_pretrained(path).eval(), load_tokenizer(path)
    port = free_port()
    script = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
    cmd = [sys.executable, str(script), "--port", str(port), "--eager", "--name", "smol", "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        wait_ready(port, proc, 600, lambda m: None)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        prompt = "The capital of France is"
        ids = tok.encode(prompt)
        out = client.completions.create(model="smol", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
        with torch.no_grad():
            lp = model(torch.tensor([ids]))[0].log_softmax(-1)
        want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert out.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        out = client.completions.create(model="smol", prompt=prompt, n=2, max_tokens=5, temperature=1, seed=4)
        stops = sorted(set(tok.eos_token_ids) | set(model.config.eos_token_ids))
        for c in out.choices:
            toks = generate(model, ids, 5, temperature=1.0, seed=4 + c.index, stop_token_ids=stops).tolist()
            toks = toks[:-1] if toks and toks[-1] in stops else toks
            assert c.text == tok.decode(toks), f"sample {c.index}"
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}  # fmt: skip
        out = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Capital of France, as JSON?"}], max_tokens=30,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )  # fmt: skip
        assert set(json.loads(out.choices[0].message.content)) == {"city"}
        out = client.completions.create(
            model="smol", prompt=prompt, max_tokens=12, temperature=0, stop=[" Paris"]
        )
        assert " Paris" not in out.choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)

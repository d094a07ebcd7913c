"""The OpenAI-compatible server: the official `openai` client against a live uvicorn on 127.0.0.1.

The model is a tiny random one whose vocabulary is SmolLM2's, so the real tokenizer and chat template
apply while each step costs little. Expected texts come from `generate` on the prompt alone.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from cs336_inference.config import ModelConfig  # noqa: E402
from cs336_inference.io.checkpoint import default_model_path  # noqa: E402
from cs336_inference.io.tokenizer import load_tokenizer  # noqa: E402
from cs336_inference.model import TransformerLM  # noqa: E402
from cs336_inference.sampling import generate  # noqa: E402
from cs336_inference.serving import LLMEngine  # noqa: E402
from cs336_inference.serving.server import create_app  # noqa: E402

MODEL = "tiny-smollm2-vocab"
NUM_BLOCKS, BLOCK_SIZE = 64, 16  # 1024 tokens of KV cache
MAX_SEQ_LEN = 512


class Server:
    def __init__(self, model, tokenizer, engine, **app_options):
        self.model, self.tokenizer, self.engine = model, tokenizer, engine
        self.aborted: list[str] = []
        abort = engine.abort

        def counting_abort(rid, index=None):  # runs on the engine's thread; lets the test see aborts happen
            self.aborted.append(rid)
            return abort(rid, index)

        engine.abort = counting_abort
        self.app = create_app(engine, tokenizer, MODEL, **app_options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, held from here on (no race with other processes)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=1)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uvicorn.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0
        )

    def stats(self) -> dict:
        return self.app.state.runner.call(lambda e: e.stats()).result(timeout=10)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        status, raw = resp.status, resp.read()
        conn.close()
        return status, json.loads(raw)

    def expected(self, prompt_ids: list[int], max_tokens: int) -> str:
        """What greedy `generate` alone gives for the prompt, as the server renders it."""
        stops = sorted(set(self.tokenizer.eos_token_ids) | set(self.model.config.eos_token_ids))
        ids = generate(self.model, prompt_ids, max_tokens, stop_token_ids=stops).tolist()
        if ids and ids[-1] in stops:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def start_server(**app_options) -> Server:
    torch.manual_seed(0)
    tokenizer = load_tokenizer(default_model_path())
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
        max_seq_len=MAX_SEQ_LEN, eos_token_id=tokenizer.eos_token_ids,
    )  # fmt: skip
    model = TransformerLM(cfg).eval()
    engine = LLMEngine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_batch_seqs=8)
    return Server(model, tokenizer, engine, **app_options)


def running(s: Server):
    """A fixture's body: the server, stopped when the module is done with it."""
    yield s
    s.uvicorn.should_exit = True
    s.thread.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    yield from running(start_server())


def get(port: int, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    status, raw = resp.status, resp.read()
    conn.close()
    return status, raw


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels, if any) in Prometheus' text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {name} in /metrics:\n{text}")


def test_health_and_models(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_completion_matches_generate(server):
    prompt = "The capital of France is"
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ids = server.tokenizer.encode(prompt)
    assert out.choices[0].text == server.expected(ids, 12)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len(ids) and 1 <= out.usage.completion_tokens <= 12


def test_ignore_eos_runs_to_max_tokens(server):
    """vLLM's extension: the EOS ids do not end the reply; it is generate's with no stop tokens."""
    prompt = "Once upon a time"
    out = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    ids = generate(server.model, server.tokenizer.encode(prompt), 9, stop_token_ids=[]).tolist()
    assert out.usage.completion_tokens == 9 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text == server.tokenizer.decode(ids)


def test_stop_strings_end_the_reply_before_them_streamed_or_not(server):
    """A stop string that spans two tokens, in the middle of the reply: the text ends before it,
    finish_reason is "stop", the streamed deltas add up to the same text, and the request's blocks
    are freed (the engine stops it)."""
    prompt = "The capital of France is"
    gen = generate(server.model, server.tokenizer.encode(prompt), 24, stop_token_ids=[]).tolist()
    full = server.tokenizer.decode(gen)
    prefixes = [server.tokenizer.decode(gen[:i]) for i in range(1, len(gen))]
    b = next(
        len(p) for p in prefixes
        if 6 <= len(p) <= len(full) - 3 and full.startswith(p) and "\ufffd" not in full[len(p) - 2 : len(p) + 2]
    )  # fmt: skip
    stop = full[b - 2 : b + 2]  # two characters of one token, two of the next
    want = full[: full.find(stop)]
    kwargs = dict(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=["never in this text", stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    plain = server.client.completions.create(**kwargs)
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "stop", plain.choices[0]
    chunks = list(server.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 10
    while server.stats()["free_blocks"] != NUM_BLOCKS:
        assert time.monotonic() < deadline, f"blocks still held after a stop string: {server.stats()}"
        time.sleep(0.05)


def test_streamed_chat_equals_plain_chat_and_generate(server):
    messages = [{"role": "user", "content": "Name three colours."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    plain = server.client.chat.completions.create(**kwargs)
    chunks = list(server.client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert len(chunks) > 3, f"expected one chunk per piece of text, got {len(chunks)}"
    text = server.tokenizer.apply_chat_template(messages)
    ids = server.tokenizer.encode(text, add_special_tokens=False)
    alone = server.expected(ids, 20)
    assert plain.choices[0].message.content == alone
    assert streamed == alone, f"streamed {streamed!r} != generate alone {alone!r}"


def test_concurrent_burst_all_succeed(server):
    prompts = [f"Request number {i} says" + " hello" * i for i in range(12)]

    def one(prompt):
        out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
        return out.choices[0].text

    steps_before = server.stats()["steps"]
    with ThreadPoolExecutor(12) as pool:
        texts = list(pool.map(one, prompts))
    steps = server.stats()["steps"] - steps_before
    assert steps < 12 * 10, f"{steps} engine steps for 12 x 10 tokens: the requests were not batched"
    for i, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        alone = server.expected(server.tokenizer.encode(prompt), 10)
        assert text == alone, f"request {i}: served {text!r} != generate alone {alone!r}"
    stats = server.stats()
    assert stats["free_blocks"] == stats["num_blocks"], f"blocks leaked after the burst: {stats}"


BAD = {
    "malformed JSON": (b'{"model": "tiny", "prompt": ', 400),
    "unknown model": ({"model": "gpt-5", "prompt": "hi", "max_tokens": 4}, 404),
    "max_tokens = 0": ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    "max_tokens < 0": ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400),
    "over-long prompt": ({"model": MODEL, "prompt": "word " * 2000, "max_tokens": 4}, 400),
    "prompt + max_tokens too long": ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_SEQ_LEN}, 400),
    "temperature < 0": ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    "top_p > 1": ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, 400),
    "prompt missing": ({"model": MODEL, "max_tokens": 4}, 400),
    "not an object": (b"[1, 2]", 400),
    "ignore_eos not a bool": ({"model": MODEL, "prompt": "hi", "ignore_eos": "yes"}, 400),
    "5 stop strings": ({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    "an empty stop string": ({"model": MODEL, "prompt": "hi", "stop": [""]}, 400),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_gets_4xx_json_and_server_keeps_serving(server, case):
    body, status = BAD[case]
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions") and isinstance(body, dict):
            body = {k: v for k, v in body.items() if k != "prompt"}
            if "prompt" in BAD[case][0]:
                body["messages"] = [{"role": "user", "content": BAD[case][0]["prompt"]}]
        got, reply = server.post(path, body)
        assert got == status, f"{case} on {path}: expected HTTP {status}, got {got}: {reply}"
        err = reply.get("error", {})
        assert isinstance(err.get("message"), str) and err.get("type"), f"{case}: not OpenAI's shape: {reply}"
    out = server.client.completions.create(model=MODEL, prompt="still there?", max_tokens=3, temperature=0)
    assert out.choices[0].text == server.expected(server.tokenizer.encode("still there?"), 3)


def test_a_chat_message_of_an_unknown_role_is_a_400(server):
    body = {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}
    got, reply = server.post("/v1/chat/completions", body)
    assert got == 400 and "wizard" in reply["error"]["message"], reply
    body["messages"][0]["role"] = "user"
    assert server.post("/v1/chat/completions", body)[0] == 200


def test_openai_client_raises_on_unknown_model(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )


def test_client_disconnect_mid_stream_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_SEQ_LEN - 16, "stream": True}
    before = len(server.aborted)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request(
        "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first
    stats = server.stats()
    assert stats["free_blocks"] < stats["num_blocks"], "the streaming request should hold blocks"
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 15
    while (stats := server.stats())["free_blocks"] != stats["num_blocks"]:
        assert time.monotonic() < deadline, f"blocks not freed after the client left: {stats}"
        time.sleep(0.05)
    assert len(server.aborted) == before + 1, "the request should have been aborted, not run to the end"
    out = server.client.completions.create(model=MODEL, prompt="after", max_tokens=3, temperature=0)
    assert out.choices[0].text == server.expected(server.tokenizer.encode("after"), 3)


def test_metrics_count_requests_tokens_and_latencies(server):
    """/metrics in Prometheus' text format, scraped before and after three requests."""
    before = get(server.port, "/metrics")[1].decode()
    for prompt in ("one", "two", "three"):
        server.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    status, raw = get(server.port, "/metrics")
    after = raw.decode()
    assert status == 200 and "# TYPE cs336_time_to_first_token_seconds histogram" in after
    done = 'cs336_requests_finished_total{finish_reason="length"}'
    assert metric(after, done) - (metric(before, done) if done in before else 0) == 3
    assert (
        metric(after, "cs336_generation_tokens_total") - metric(before, "cs336_generation_tokens_total") == 15
    )
    assert metric(after, "cs336_time_to_first_token_seconds_count") >= 3
    assert metric(after, "cs336_time_per_output_token_seconds_count") >= 3
    assert metric(after, "cs336_kv_blocks") == NUM_BLOCKS and metric(after, "cs336_requests_running") == 0
    assert metric(after, "cs336_kv_blocks_used") == 0 and metric(after, "cs336_preemptions_total") >= 0


def test_a_body_over_the_limit_is_a_413_and_the_server_keeps_serving():
    s = start_server(max_body_bytes=1000)
    try:
        status, reply = s.post("/v1/completions", {"model": MODEL, "prompt": "word " * 500, "max_tokens": 2})
        assert status == 413 and "larger than 1000 bytes" in reply["error"]["message"], reply
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)  # no length: chunked
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for _ in range(40):
            conn.send(b"64\r\n" + b"x" * 100 + b"\r\n")
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 413
        conn.close()
        out = s.client.completions.create(model=MODEL, prompt="still there?", max_tokens=2, temperature=0)
        assert out.choices[0].text == s.expected(s.tokenizer.encode("still there?"), 2)
    finally:
        s.uvicorn.should_exit = True
        s.thread.join(timeout=10)


def test_an_api_key_is_needed_everywhere_but_health():
    s = start_server(api_key="sesame")
    try:
        assert get(s.port, "/health")[0] == 200
        for path in ("/v1/models", "/metrics"):
            assert get(s.port, path)[0] == 401, path
            assert get(s.port, path, {"Authorization": "Bearer wrong"})[0] == 401, path
            assert get(s.port, path, {"Authorization": "Bearer sesame"})[0] == 200, path
        status, reply = s.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", reply
        with pytest.raises(openai.AuthenticationError):
            s.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # its key is "none"
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{s.port}/v1", api_key="sesame", max_retries=0)
        out = keyed.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
        assert out.choices[0].text == s.expected(s.tokenizer.encode("hi"), 2)
    finally:
        s.uvicorn.should_exit = True
        s.thread.join(timeout=10)


def test_serve_py_on_a_busy_port_fails_before_loading_the_model():
    """The port is bound first: a second server says so at once instead of loading, printing 'serving'
    and dying."""
    import subprocess
    import sys
    from pathlib import Path

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    script = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
    try:
        out = subprocess.run(
            [sys.executable, str(script), "--port", str(port), "--model", "/nonexistent/never-loaded.gguf"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        busy.close()
    assert out.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in out.stderr, out.stderr
    assert "never-loaded" not in out.stderr and "serving" not in out.stderr, out.stderr


def test_the_context_error_says_which_limit_was_hit(server):
    """The KV blocks a server was started with, or the model's own window: the message names the one."""
    from cs336_inference.serving.server import APIError, RequestParser

    for capacity, limit in ((256, "KV cache holds 256 tokens"), (4096, "model's context holds 512 tokens")):
        parse = RequestParser(server.tokenizer, MODEL, MAX_SEQ_LEN, capacity, [])
        with pytest.raises(APIError) as err:
            parse({"model": MODEL, "prompt": "hi", "max_tokens": 600}, chat=False)
        assert err.value.status == 400 and limit in str(err.value), str(err.value)

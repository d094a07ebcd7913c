"""An OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

    app = create_app(engine, tokenizer, model_name="smollm2")
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: python scripts/serve.py

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true for
server-sent events, one `data: {chunk}` per new piece of text and `data: [DONE]` at the end),
GET /v1/models, GET /health, GET /metrics (Prometheus' text format), and vLLM's tokenizer endpoints
POST /tokenize, POST /detokenize, GET /tokenizer_info (what lm-eval's remote tokenizer reads).
With an API key every endpoint but /health needs `Authorization: Bearer <key>` (else 401); a body
over 1 MiB is a 413.

Parameters beyond the basic ones:
    "stop"          up to 4 strings; a reply ends before the first one in its text (finish_reason
                    "stop"), and a stream holds back text that could begin one
    "n"             samples per prompt (the prompt is prefilled once, its blocks shared copy-on-write);
                    with a seed, sample i draws with seed + i; choice index = prompt index * n + i
    "prompt"        (completions) a string, a list of token ids, or a list of either (a batch)
    "logprobs"      completions: N alternatives per token; chat: true, with "top_logprobs": N
                    (N <= 20). Values are those of the distribution sampled from (sampling.py's
                    sampled_logprobs; greedy: the model's own). A stop token is listed, though
                    its text is not in the reply.
    "echo"          (completions) the prompt comes first in the text; with logprobs, its tokens'
                    log-probabilities too (the first null); "max_tokens": 0 scores a text only
    "response_format"  {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
                    ...}}: only tokens the schema's grammar allows are sampled (structured.py); a
                    schema that does not compile is a 400
Extensions, as vLLM names them: "top_k", and "ignore_eos" (true: the reply runs to max_tokens, the
model's EOS ids included; for benchmarks). Bad requests get a 4xx JSON body in OpenAI's error shape
{"error": {"message", "type", "param", "code"}}; the server keeps serving.

Threads: the engine is not thread-safe, so one background thread owns it. It drains a command
queue (add a request, abort one or one of its samples), runs `engine.step()` while anything is
unfinished, and hands each request's outputs to its HTTP call's asyncio queue on the event loop
(call_soon_threadsafe).
HTTP handlers never touch the engine: they send commands and await their queue. A client that
disconnects (or a stream that is cancelled) aborts its request, which frees its KV blocks.
`scripts/serve.py` builds the model on a thread that has ended before this loop starts
(fast/threads.in_passing_thread): a live thread that once ran a parallel torch op keeps an OpenMP
team, and with more such threads than cores the engine's steps wait at every barrier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cs336_inference.io.detokenize import check_stop_strings
from cs336_inference.serving import SamplingParams
from cs336_inference.serving.choices import (
    TextOffsets,
    TextStream,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    text_offsets,
)

DONE = object()  # put on every request's queue when the engine thread fails
MAX_BODY_BYTES = 1 << 20  # a request body past this is a 413 (a prompt of a million characters)


CHAT_ROLES = ("system", "user", "assistant")  # what chat templates render (tools are not served)


class APIError(Exception):
    """A request we refuse: becomes an OpenAI-style JSON error with this HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------ the engine's thread
class EngineLoop:
    """Owns the engine on one background thread; the event loop talks to it through commands."""

    def __init__(self, engine):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        # request id -> (event loop, queue its outputs go to, samples not finished yet)
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.commands.put(("wake",))
        self._thread.join(timeout=10)

    # called from the event loop ------------------------------------------------------------
    async def add(self, prompt_ids: list[int], params: SamplingParams, out: asyncio.Queue) -> str:
        """Queue a request; returns its id. Its RequestOutputs (of all its n samples) arrive on `out`.
        Raises ValueError when the engine refuses it (too long, bad parameters)."""
        if self.error is not None:
            raise RuntimeError(f"the engine thread died: {self.error!r}")
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("add", prompt_ids, params, loop, out, future))
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Drop a request, or only its sample `index`."""
        self.commands.put(("abort", request_id, index))

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn(engine) on the engine's thread between steps (e.g. to read engine.stats())."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.commands.put(("call", fn, future))
        return future

    # the thread ------------------------------------------------------------------------------
    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt_ids, params, loop, out, future = command
            try:
                rid = self.engine.add_request(prompt_ids, params, request_id=uuid.uuid4().hex)
            except Exception as e:  # the engine's ValueError for a bad request travels back
                future.set_exception(e)
                return
            self.streams[rid] = (loop, out, params.n)
            future.set_result(rid)
        elif kind == "abort":
            _, rid, index = command
            if rid not in self.streams:
                return
            if index is None:
                del self.streams[rid]
                self.engine.abort(rid)
            else:
                self.engine.abort(rid, index)  # the "abort" output it causes is counted below
        elif kind == "call":
            _, fn, future = command
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                # block for the next command when idle; otherwise take what is queued and step
                try:
                    idle = not self.engine.has_unfinished()
                    self._handle(self.commands.get(timeout=0.5) if idle else self.commands.get_nowait())
                    while True:
                        self._handle(self.commands.get_nowait())
                except queue.Empty:
                    pass
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                for out in self.engine.step():
                    target = self.streams.get(out.request_id)
                    if target is None:  # aborted meanwhile
                        continue
                    loop, q, left = target
                    loop.call_soon_threadsafe(q.put_nowait, out)
                    if out.finished:
                        if left == 1:
                            del self.streams[out.request_id]
                        else:
                            self.streams[out.request_id] = (loop, q, left - 1)
        except BaseException as e:  # a bug in the engine: fail every waiting request, loudly
            self.error = e
            for loop, q, _ in self.streams.values():
                loop.call_soon_threadsafe(q.put_nowait, DONE)
            self.streams.clear()
            raise


# ------------------------------------------------------------------ request parsing
MAX_CHOICES = 64  # prompts x n in one request


@dataclass
class Parsed:
    prompts: list[list[int]]  # one or more (completions take a batch of prompts)
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...] = ()
    prompt_texts: list[str] | None = None  # the prompts as text, for echo
    echo: bool = False
    max_tokens: int = 16  # 0: echo only (the prompt scored, nothing generated)
    logprobs: int | None = None  # alternatives per token, if log-probabilities were asked for

    @property
    def n(self) -> int:
        return self.params.n


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise APIError(400, f"'{name}' must be {kind}, got {value!r}", param=name)
    if not lo <= value <= hi:
        raise APIError(400, f"'{name}' must be in [{lo:g}, {hi:g}], got {value!r}", param=name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be true or false, got {value!r}", param=name)
    return value


class RequestParser:
    """Turns an OpenAI request body into prompt ids and SamplingParams, or raises APIError."""

    def __init__(
        self, tokenizer, model_name: str, max_seq_len: int, capacity: int, stop_ids: list[int], grammar=None
    ):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_seq_len, self.capacity, self.stop_ids = max_seq_len, capacity, stop_ids
        self.grammar = grammar  # structured.JsonGrammar, or None: response_format JSON is refused

    def __call__(self, body: Any, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server has {self.model_name!r}", "model",
                "model_not_found",
            )  # fmt: skip
        try:
            stop_strings = check_stop_strings(body.get("stop") or None)
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        if chat:
            prompts, texts = [self._chat_prompt(body)], None
        else:
            prompts, texts = self._completion_prompts(body)
        n = _number(body, "n", 1, 1, MAX_CHOICES, integer=True)
        if n * len(prompts) > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n = {n} is over {MAX_CHOICES} choices", param="n")
        echo = False if chat else _flag(body, "echo")
        logprobs = self._logprobs(body, chat)
        P = max(len(p) for p in prompts)
        window = min(self.max_seq_len, self.capacity)
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        name = next((n for n in names if body.get(n) is not None), names[-1])
        default = max(window - P, 1) if chat else 16  # OpenAI's defaults: the rest of the context / 16
        max_tokens = _number(body, name, default, 0 if echo else 1, 1 << 30, integer=True)
        if P + max(max_tokens, 1) > window:
            held = (  # which limit: the model's window, or the KV blocks this server was started with
                f"this model's context holds {window} tokens"
                if window == self.max_seq_len
                else f"this server's KV cache holds {window} tokens (--num-blocks x --block-size; the "
                f"model's window is {self.max_seq_len})"
            )
            raise APIError(
                400, f"{held}; the prompt has {P} and {name} asks for {max_tokens}",
                param=name, code="context_length_exceeded",
            )  # fmt: skip
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise APIError(400, "'top_p' must be > 0", param="top_p")
        top_k = _number(body, "top_k", None, 1, 1 << 30, integer=True)  # an extension, like vLLM's
        seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1 - MAX_CHOICES, integer=True)
        stream = _flag(body, "stream")
        ignore_eos = _flag(body, "ignore_eos")  # an extension, like vLLM's: exactly max_tokens tokens
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        params = SamplingParams(
            max_new_tokens=max(int(max_tokens), 1),  # echo only: one token is drawn and not returned
            temperature=float(temperature),
            top_k=top_k,
            top_p=None if top_p >= 1.0 else float(top_p),
            seed=seed,
            stop_token_ids=() if ignore_eos else tuple(self.stop_ids),
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            n=n,
            json_schema=self._response_format(body),
        )
        return Parsed(
            prompts, params, stream, bool(options.get("include_usage", False)), stop_strings, texts, echo,
            int(max_tokens), logprobs,
        )  # fmt: skip

    def _response_format(self, body: dict) -> dict | bool | None:
        """The JSON schema the reply must follow (True: any JSON object), or None; checked to compile."""
        fmt = body.get("response_format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            schema: dict | bool = True
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "'response_format.json_schema.schema' must be a JSON schema", "response_format"
                )
        else:
            raise APIError(
                400,
                f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
                "response_format",
            )
        if self.grammar is None:
            raise APIError(
                400, "structured output needs the llguidance package on the server", "response_format"
            )
        try:
            self.grammar.compile(schema)
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None
        return schema

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        """Alternatives per token, or None: completions' "logprobs": N, chat's "logprobs": true with
        "top_logprobs": N."""
        top = SamplingParams.MAX_LOGPROBS
        if not chat:
            return _number(body, "logprobs", None, 0, top, integer=True)
        if not _flag(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        return _number(body, "top_logprobs", 0, 0, top, integer=True)

    def _completion_prompts(self, body: dict) -> tuple[list[list[int]], list[str]]:
        """The prompts (a string, a list of ids, or a list of either) as ids, and as text."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and _is_ids(prompt)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise APIError(
                400, "'prompt' must be a string, a list of token ids, or a list of either", "prompt"
            )
        if len(prompt) > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} prompts, got {len(prompt)}", "prompt")
        ids, texts = [], []
        V = self.tokenizer.vocab_size
        for p in prompt:
            if isinstance(p, str):
                one, text = self.tokenizer.encode(p), p
            elif isinstance(p, list) and _is_ids(p):
                if any(not 0 <= t < V for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {V})", param="prompt")
                one, text = list(p), self.tokenizer.decode(p)
            else:
                raise APIError(
                    400, "'prompt' must be a string, a list of token ids, or a list of either", "prompt"
                )
            if not one:
                raise APIError(400, "the prompt is empty", param="prompt")
            ids.append(one)
            texts.append(text)
        return ids, texts

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] needs a 'role'", param="messages")
            if m["role"] not in CHAT_ROLES:
                raise APIError(
                    400,
                    f"messages[{i}] has role {m['role']!r}; roles are {', '.join(CHAT_ROLES)}",
                    "messages",
                )
            content = m.get("content")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
                if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                    raise APIError(400, f"messages[{i}]: only text content is supported", "messages")
                content = "".join(parts)
            if not isinstance(content, str):
                raise APIError(400, f"messages[{i}] needs a string 'content'", param="messages")
            clean.append({"role": m["role"], "content": content})
        try:
            text = self.tokenizer.apply_chat_template(clean, add_generation_prompt=True)
        except ValueError as e:  # the template's raise_exception
            raise APIError(400, str(e), param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)


def _is_ids(x: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) for t in x)


# ------------------------------------------------------------------ /metrics
class Metrics:
    """The server's Prometheus metrics: counters and latency histograms of the requests it answered,
    kept here, and the engine's own numbers (requests running and waiting, KV blocks, preemptions),
    read from engine.stats() at each scrape (`collect`)."""

    content_type = CONTENT_TYPE_LATEST
    LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.finished = Counter("cs336_requests_finished", "Requests finished, by reason", ["finish_reason"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter(
            "cs336_prompt_tokens", "Prompt tokens of the requests finished", registry=r
        )
        self.generated = Counter("cs336_generation_tokens", "Tokens generated for the requests finished", registry=r)  # fmt: skip
        self.ttft = Histogram("cs336_time_to_first_token_seconds", "Arrival to first token", buckets=self.LATENCY, registry=r)  # fmt: skip
        self.tpot = Histogram("cs336_time_per_output_token_seconds", "After the first token, per token", buckets=self.LATENCY, registry=r)  # fmt: skip
        self.stats: dict = {}
        r.register(self)

    def collect(self):
        s = self.stats
        yield GaugeMetricFamily("cs336_requests_running", "Requests running in the engine", value=s.get("num_running", 0))  # fmt: skip
        yield GaugeMetricFamily("cs336_requests_waiting", "Requests waiting to be admitted", value=s.get("num_waiting", 0))  # fmt: skip
        yield GaugeMetricFamily(
            "cs336_kv_blocks_used", "KV cache blocks in use", value=s.get("used_blocks", 0)
        )
        yield GaugeMetricFamily("cs336_kv_blocks", "KV cache blocks in all", value=s.get("num_blocks", 0))
        yield CounterMetricFamily("cs336_preemptions", "Sequences preempted (to be recomputed)", value=s.get("preemptions", 0))  # fmt: skip

    def observe(self, prompt_tokens: int, text: TextStream) -> None:
        """A request answered (finished, or ended by a stop string): count it, time it."""
        self.finished.labels(text.finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated.inc(text.num_tokens)
        if text.first is not None:
            self.ttft.observe(text.first - text.start)
            if text.num_tokens > 1:
                self.tpot.observe((text.end - text.first) / (text.num_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def create_app(
    engine,
    tokenizer,
    model_name: str,
    stop_token_ids: list[int] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
):
    """The FastAPI app serving `engine` (an LLMEngine) as `model_name`.

    Replies stop at the tokenizer's and the model config's EOS ids (or at stop_token_ids).
    api_key: every endpoint but /health then needs `Authorization: Bearer <api_key>` (else 401).
    A request body over max_body_bytes is a 413, read no further.
    The engine's thread starts with the app (lifespan) and stops with it.
    """
    cfg = engine.model.config
    if stop_token_ids is None:
        stop_token_ids = sorted(set(tokenizer.eos_token_ids) | set(cfg.eos_token_ids or []))
    stats = engine.stats()
    block_size = getattr(engine, "block_size", None) or stats.get("block_size", 16)
    capacity = int(stats["num_blocks"]) * int(block_size)
    if getattr(engine, "grammar", None) is None:
        try:  # structured output, where llguidance is installed
            from cs336_inference.structured import JsonGrammar

            engine.grammar = JsonGrammar(tokenizer, list(stop_token_ids))
        except ValueError:
            engine.grammar = None
    parse = RequestParser(
        tokenizer,
        model_name,
        cfg.max_seq_len,
        capacity,
        list(stop_token_ids),
        getattr(engine, "grammar", None),
    )
    runner = EngineLoop(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="cs336-inference", lifespan=lifespan)
    app.state.runner = runner

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                err = APIError(
                    401, "a valid API key is needed: Authorization: Bearer <key>", code="invalid_api_key"
                )
                return JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return JSONResponse(APIError(404, f"no route {request.url.path}").body(), status_code=404)

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        msg = f"{request.method} is not allowed on {request.url.path}"
        return JSONResponse(APIError(405, msg).body(), status_code=405)

    @app.get("/health")
    async def health():
        if runner.error is not None:
            raise APIError(503, f"the engine thread died: {runner.error!r}")
        return {"status": "ok"}

    metrics = Metrics()

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.stats = await asyncio.wrap_future(runner.call(lambda e: e.stats()))
        return Response(metrics.exposition(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "cs336-inference"}
        return {"object": "list", "data": [card]}

    # the tokenizer endpoints (as vLLM names them): evaluation harnesses count tokens through them
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {
            "tokenizer_class": "cs336_inference.io.tokenizer.Tokenizer",
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": None,
            "chat_template": tokenizer.chat_template,
            "model_max_length": min(cfg.max_seq_len, capacity),
        }

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        special = _flag(body, "add_special_tokens")
        if "messages" in body:
            ids = parse._chat_prompt(body)
        elif isinstance(body.get("prompt"), str):
            ids = tokenizer.encode(body["prompt"], add_special_tokens=special)
        else:
            raise APIError(400, "'prompt' must be a string (or give 'messages')", param="prompt")
        return {"count": len(ids), "max_model_len": min(cfg.max_seq_len, capacity), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        V = tokenizer.vocab_size
        if not isinstance(ids, list) or not _is_ids(ids) or any(not 0 <= t < V for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {V})", param="tokens")
        return {"prompt": tokenizer.decode(ids)}

    async def read_body(request: Request) -> Any:
        too_big = APIError(413, f"the request body is larger than {max_body_bytes} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body_bytes:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():  # a body without a length (chunked) is counted as it comes
            size += len(chunk)
            if size > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None

    strings = TokenStrings(tokenizer)

    async def start(parsed: Parsed, out: asyncio.Queue) -> list[str]:
        """Queue one engine request per prompt (each with n samples); their outputs go to `out`."""
        rids: list[str] = []
        try:
            for prompt in parsed.prompts:
                rids.append(await runner.add(prompt, parsed.params, out))
        except ValueError as e:
            for rid in rids:
                runner.abort(rid)
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e)) from None
        return rids

    async def outputs(request: Request, rids: list[str], out: asyncio.Queue) -> AsyncIterator:
        """The requests' RequestOutputs as they come; on leaving (every choice done, the client gone,
        the stream cancelled) whatever is still running is aborted."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(out.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if item is DONE:
                    raise APIError(500, f"the engine failed: {runner.error!r}")
                yield item
        finally:
            for rid in rids:
                runner.abort(rid)  # finished requests are ignored

    @dataclass
    class Reply:
        """One choice: sample j of prompt i, choice index i * n + j."""

        index: int
        prompt: int
        text: TextStream
        started: bool = False  # a stream has sent its first chunk (the role; with echo, the prompt)
        sent: int = 0  # tokens whose log-probabilities a stream has sent
        offsets: TextOffsets | None = None  # text_offset of its tokens, counted once each

    async def handle(request: Request, chat: bool):
        parsed = parse(await read_body(request), chat)
        out: asyncio.Queue = asyncio.Queue()
        rids = await start(parsed, out)
        n = parsed.n
        replies = {
            (rid, j): Reply(i * n + j, i, TextStream(tokenizer, parse.stop_ids, parsed.stop_strings))
            for i, rid in enumerate(rids)
            for j in range(n)
        }
        prompt_logprobs: list[list | None] = [None] * len(rids)
        kind = "chat.completion" if chat else "text_completion"
        rid_public = ("chatcmpl-" if chat else "cmpl-") + rids[0]
        head = {"id": rid_public, "object": kind, "created": int(time.time()), "model": model_name}

        def receive(item) -> tuple[Reply, str] | None:
            """Take one engine output; returns its reply and the new text (None: a late output of a
            reply already finished by a stop string)."""
            reply = replies[item.request_id, item.index]
            if item.prompt_logprobs is not None:
                prompt_logprobs[reply.prompt] = item.prompt_logprobs
            if reply.text.finish_reason is not None:
                return None
            if parsed.max_tokens == 0:  # echo only: the token drawn is not part of the reply
                return reply, reply.text.push([], True, "length")
            delta = reply.text.push(item.new_token_ids, item.finished, item.finish_reason, item.logprobs)
            if reply.text.finish_reason is not None and not item.finished:
                runner.abort(item.request_id, item.index)  # a stop string ended this sample
            return reply, delta

        def observe() -> None:
            for reply in replies.values():
                prompt = len(parsed.prompts[reply.prompt]) if reply.index % n == 0 else 0
                metrics.observe(prompt, reply.text)

        def usage() -> dict:
            P = sum(len(p) for p in parsed.prompts)
            c = sum(r.text.num_tokens for r in replies.values()) if parsed.max_tokens else 0
            return {"prompt_tokens": P, "completion_tokens": c, "total_tokens": P + c}

        def echoed(reply: Reply) -> str:
            return parsed.prompt_texts[reply.prompt] if parsed.echo else ""

        def logprobs_of(reply: Reply, first: int, last: int, with_prompt: bool) -> dict | None:
            """The logprobs object for the reply's tokens first..last-1 (and the prompt's, for echo)."""
            if parsed.logprobs is None:
                return None
            entries, ids = reply.text.logprobs[first:last], reply.text.logprob_ids[first:last]
            if chat:
                return chat_logprobs(strings, entries)
            if reply.offsets is None:
                reply.offsets = TextOffsets(strings, len(echoed(reply)))
            reply.offsets.push(reply.text.logprob_ids[len(reply.offsets.offsets) : last])
            offsets = reply.offsets.offsets[first:last]
            if with_prompt and parsed.echo:
                prompt = parsed.prompts[reply.prompt]
                entries = list(prompt_logprobs[reply.prompt] or [None] * len(prompt)) + entries
                ids, offsets = prompt + ids, text_offsets(strings, prompt) + offsets
            return completion_logprobs(strings, entries, ids, offsets)

        if not parsed.stream:
            left = len(replies)
            async for item in outputs(request, rids, out):
                got = receive(item)
                if got is not None and got[0].text.finish_reason is not None:
                    left -= 1
                    if left == 0:
                        break
            if left:  # the client went away
                return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
            observe()
            choices = []
            for reply in sorted(replies.values(), key=lambda r: r.index):
                last = len(reply.text.logprobs)
                choice = {
                    "index": reply.index,
                    "finish_reason": reply.text.finish_reason,
                    "logprobs": logprobs_of(reply, 0, last, with_prompt=True),
                }
                if chat:
                    choice["message"] = {"role": "assistant", "content": reply.text.text()}
                else:
                    choice["text"] = echoed(reply) + reply.text.text()
                choices.append(choice)
            return {**head, "choices": choices, "usage": usage()}

        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        def chunk(reply: Reply, delta: str | None, finish_reason: str | None, logprobs=None) -> str:
            choice: dict[str, Any] = {
                "index": reply.index,
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
            if chat:
                choice["delta"] = ({"role": "assistant"} if not reply.started else {}) | (
                    {} if delta is None else {"content": delta}
                )
            else:
                choice["text"] = delta or ""
            reply.started = True
            body = {**head, "choices": [choice]}
            if parsed.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        def pending_logprobs(reply: Reply, with_prompt: bool):
            last = len(reply.text.logprobs)
            lp = logprobs_of(reply, reply.sent, last, with_prompt)
            reply.sent = last
            return lp

        async def events() -> AsyncIterator[str]:
            if chat:
                for reply in replies.values():
                    yield chunk(reply, "", None)
            left = len(replies)
            async for item in outputs(request, rids, out):
                got = receive(item)
                if got is None:
                    continue
                reply, delta = got
                if not reply.started and parsed.echo:  # the prompt, with its log-probabilities
                    yield chunk(reply, echoed(reply), None, logprobs_of(reply, 0, 0, with_prompt=True))
                if delta:
                    yield chunk(reply, delta, None, pending_logprobs(reply, with_prompt=False))
                if reply.text.finish_reason is not None:  # finished, or a stop string (then aborted)
                    yield chunk(reply, None, reply.text.finish_reason, pending_logprobs(reply, False))
                    left -= 1
                    if left == 0:
                        break
            if left:
                return  # aborted: the client is gone
            observe()
            if parsed.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage()})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app

"""An OpenAI-compatible HTTP server over the continuous-batching engine (FastAPI + uvicorn).

    app = create_app(engine, tokenizer, model_name="smollm2")
    uvicorn.run(app, host="127.0.0.1", port=8000)        # or: python scripts/serve.py

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with "stream": true for
server-sent events, one `data: {chunk}` per new piece of text and `data: [DONE]` at the end),
GET /v1/models, GET /health, GET /metrics (Prometheus' text format). With an API key every endpoint
but /health needs `Authorization: Bearer <key>` (else 401); a body over 1 MiB is a 413. "stop": up to 4 strings; the reply ends before the first one that
appears in its text (finish_reason "stop"), and a stream holds back text that could begin one.
Extensions to OpenAI's parameters, as vLLM names them: "top_k", and
"ignore_eos" (true: the reply runs to max_tokens, the model's EOS ids included; for benchmarks). Bad requests get a 4xx JSON body in OpenAI's error shape
{"error": {"message", "type", "param", "code"}}; the server keeps serving.

Threads: the engine is not thread-safe, so one background thread owns it. It drains a command
queue (add a request, abort one), runs `engine.step()` while anything is unfinished, and hands each
request's new tokens to that request's asyncio queue on the event loop (call_soon_threadsafe).
HTTP handlers never touch the engine: they send commands and await their queue. A client that
disconnects (or a stream that is cancelled) aborts its request, which frees its KV blocks.
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

from cs336_inference.io.detokenize import Detokenizer, check_stop_strings
from cs336_inference.serving import SamplingParams

DONE = object()  # put on a request's queue when the engine will send nothing more for it
MAX_BODY_BYTES = 1 << 20  # a request body past this is a 413 (a prompt of a million characters)


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
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
    async def add(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns (request id, the queue its RequestOutputs arrive on).
        Raises ValueError when the engine refuses it (too long, bad parameters)."""
        if self.error is not None:
            raise RuntimeError(f"the engine thread died: {self.error!r}")
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        out: asyncio.Queue = asyncio.Queue()
        self.commands.put(("add", prompt_ids, params, loop, out, future))
        rid = await asyncio.wrap_future(future)
        return rid, out

    def abort(self, request_id: str) -> None:
        self.commands.put(("abort", request_id))

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
            self.streams[rid] = (loop, out)
            future.set_result(rid)
        elif kind == "abort":
            rid = command[1]
            if self.streams.pop(rid, None) is not None:
                self.engine.abort(rid)
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
                    loop, q = target
                    loop.call_soon_threadsafe(q.put_nowait, out)
                    if out.finished:
                        del self.streams[out.request_id]
                        loop.call_soon_threadsafe(q.put_nowait, DONE)
        except BaseException as e:  # a bug in the engine: fail every waiting request, loudly
            self.error = e
            for loop, q in self.streams.values():
                loop.call_soon_threadsafe(q.put_nowait, DONE)
            self.streams.clear()
            raise


# ------------------------------------------------------------------ request parsing
@dataclass
class Parsed:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop_strings: tuple[str, ...] = ()


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


class RequestParser:
    """Turns an OpenAI request body into prompt ids and SamplingParams, or raises APIError."""

    def __init__(self, tokenizer, model_name: str, max_seq_len: int, capacity: int, stop_ids: list[int]):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.max_seq_len, self.capacity, self.stop_ids = max_seq_len, capacity, stop_ids

    def __call__(self, body: Any, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != self.model_name:
            raise APIError(
                404, f"the model {model!r} does not exist; this server has {self.model_name!r}", "model",
                "model_not_found",
            )  # fmt: skip
        if body.get("n") not in (None, 1):
            raise APIError(400, "only n = 1 is supported", param="n")
        try:
            stop_strings = check_stop_strings(body.get("stop") or None)
        except ValueError as e:
            raise APIError(400, str(e), param="stop") from None
        prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        P = len(prompt_ids)
        window = min(self.max_seq_len, self.capacity)
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        name = next((n for n in names if body.get(n) is not None), names[-1])
        default = max(window - P, 1) if chat else 16  # OpenAI's defaults: the rest of the context / 16
        max_tokens = _number(body, name, default, 1, 1 << 30, integer=True)
        if P + max_tokens > window:
            raise APIError(
                400,
                f"this model's context holds {window} tokens; the prompt has {P} and {name} asks for "
                f"{max_tokens}",
                param=name, code="context_length_exceeded",
            )  # fmt: skip
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        if top_p == 0.0:
            raise APIError(400, "'top_p' must be > 0", param="top_p")
        top_k = _number(body, "top_k", None, 1, 1 << 30, integer=True)  # an extension, like vLLM's
        seed = _number(body, "seed", None, -(1 << 63), (1 << 63) - 1, integer=True)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be true or false, got {stream!r}", param="stream")
        ignore_eos = body.get("ignore_eos", False)  # an extension, like vLLM's: exactly max_tokens tokens
        if not isinstance(ignore_eos, bool):
            raise APIError(400, f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        params = SamplingParams(
            max_new_tokens=int(max_tokens),
            temperature=float(temperature),
            top_k=top_k,
            top_p=None if top_p >= 1.0 else float(top_p),
            seed=seed,
            stop_token_ids=() if ignore_eos else tuple(self.stop_ids),
        )
        return Parsed(prompt_ids, params, stream, bool(options.get("include_usage", False)), stop_strings)

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            V = self.tokenizer.vocab_size
            if any(not 0 <= t < V for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {V})", param="prompt")
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)", "prompt")
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] needs a 'role'", param="messages")
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


# ------------------------------------------------------------------ detokenizing a stream
class TextStream:
    """A reply's token ids in, text deltas out (io/detokenize.py's Detokenizer: half characters and
    what could begin a stop string held back). The deltas concatenate to the final text, which leaves
    out the stop token that ended the reply, and ends before a stop string that did."""

    def __init__(self, tokenizer, stop_ids: list[int], stop_strings: tuple[str, ...] = ()):
        self.stop_ids = set(stop_ids)
        self.detok = Detokenizer(tokenizer, stop_strings)
        self.finish_reason: str | None = None
        self.eos = 0
        self.start, self.first, self.end = time.perf_counter(), None, None  # for /metrics

    @property
    def num_tokens(self) -> int:
        return len(self.detok.ids) + self.eos

    def push(self, new_ids: list[int], finished: bool, finish_reason: str | None) -> str:
        if new_ids and self.first is None:
            self.first = time.perf_counter()
        eos = finished and finish_reason == "stop" and bool(new_ids) and new_ids[-1] in self.stop_ids
        delta = self.detok.push(new_ids[:-1] if eos else new_ids, finished)
        if eos:
            self.eos = 1  # the stop token: counted in the usage, not decoded
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif finished:
            self.finish_reason = finish_reason or "length"
        if self.finish_reason is not None:
            self.end = time.perf_counter()
        return delta

    def text(self) -> str:
        return self.detok.text


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
    parse = RequestParser(tokenizer, model_name, cfg.max_seq_len, capacity, list(stop_token_ids))
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

    async def start(parsed: Parsed) -> tuple[str, asyncio.Queue]:
        try:
            return await runner.add(parsed.prompt_ids, parsed.params)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(503, str(e)) from None

    async def outputs(request: Request, rid: str, out: asyncio.Queue) -> AsyncIterator:
        """The request's RequestOutputs until it finishes; aborts it if the client goes away
        (or if whoever iterates stops early / is cancelled)."""
        finished = False
        try:
            while True:
                try:
                    item = await asyncio.wait_for(out.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if item is DONE:
                    finished = True
                    if runner.error is not None:
                        raise APIError(500, f"the engine failed: {runner.error!r}")
                    return
                yield item
        finally:
            if not finished:
                runner.abort(rid)

    def usage(parsed: Parsed, text: TextStream) -> dict:
        P, n = len(parsed.prompt_ids), text.num_tokens
        return {"prompt_tokens": P, "completion_tokens": n, "total_tokens": P + n}

    async def handle(request: Request, chat: bool):
        parsed = parse(await read_body(request), chat)
        rid, out = await start(parsed)
        kind = "chat.completion" if chat else "text_completion"
        rid_public = ("chatcmpl-" if chat else "cmpl-") + rid
        head = {"id": rid_public, "object": kind, "created": int(time.time()), "model": model_name}
        text = TextStream(tokenizer, parse.stop_ids, parsed.stop_strings)

        if not parsed.stream:
            async for item in outputs(request, rid, out):
                text.push(item.new_token_ids, item.finished, item.finish_reason)
                if text.finish_reason is not None:
                    break  # finished, or a stop string ended it: leaving `outputs` aborts the request
            if text.finish_reason is None:  # the client went away
                return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
            metrics.observe(len(parsed.prompt_ids), text)
            choice = {"index": 0, "finish_reason": text.finish_reason, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text.text()}
            else:
                choice["text"] = text.text()
            return {**head, "choices": [choice], "usage": usage(parsed, text)}

        head["object"] = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish_reason: str | None, first: bool = False) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
            if chat:
                choice["delta"] = ({"role": "assistant"} if first else {}) | (
                    {} if delta is None else {"content": delta}
                )
            else:
                choice["text"] = delta or ""
            body = {**head, "choices": [choice]}
            if parsed.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            if chat:
                yield chunk("", None, first=True)
            async for item in outputs(request, rid, out):
                delta = text.push(item.new_token_ids, item.finished, item.finish_reason)
                if delta:
                    yield chunk(delta, None)
                if text.finish_reason is not None:  # finished, or a stop string (the request is aborted)
                    yield chunk(None, text.finish_reason)
                    break
            if text.finish_reason is None:
                return  # aborted: the client is gone
            metrics.observe(len(parsed.prompt_ids), text)
            if parsed.include_usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(parsed, text)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app

"""The client side of the HTTP serving benchmark: one process, the official `openai` client.

    python -m cs336_inference.bench.http_client PLAN.json RESULT.json

PLAN: {"base_url", "model", "extra_body", "requests": [{"arrival", "prompt", "max_tokens"}]}. Each
request is sent at its arrival time (seconds after the start) as a streamed completion at
temperature 0, whether or not earlier ones have finished (an open loop, as vLLM's benchmark_serving).
Per request the client records, on its own clock: the time the first text arrived (TTFT), the end
(end-to-end latency), the output tokens (the usage the server reports, else the chunks) and any
error. RESULT: {"start", "records": [...]}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path


async def one(client, plan: dict, r: dict, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + r["arrival"] - time.perf_counter()))
    sent = time.perf_counter()
    rec = dict(arrival=r["arrival"], sent=sent - t0, first=None, end=None, chunks=0, tokens=None, error=None)
    rec["max_tokens"] = r["max_tokens"]
    try:
        stream = await client.completions.create(
            model=plan["model"], prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=plan.get("extra_body") or None,
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                rec["chunks"] += 1
                if rec["first"] is None:
                    rec["first"] = time.perf_counter() - t0
            if getattr(chunk, "usage", None) is not None:
                rec["tokens"] = chunk.usage.completion_tokens
                rec["prompt_tokens"] = chunk.usage.prompt_tokens
    except Exception as e:  # a failed request is recorded, the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["end"] = time.perf_counter() - t0
    if rec["tokens"] is None:
        rec["tokens"] = rec["chunks"]
    return rec


async def run(plan: dict) -> dict:
    import openai

    client = openai.AsyncOpenAI(
        base_url=plan["base_url"], api_key=plan.get("api_key", "none"), max_retries=0, timeout=3600.0
    )
    t0 = time.perf_counter()
    records = await asyncio.gather(*(one(client, plan, r, t0) for r in plan["requests"]))
    await client.close()
    return dict(records=list(records))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m cs336_inference.bench.http_client PLAN.json RESULT.json", file=sys.stderr)
        return 2
    plan = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(asyncio.run(run(plan))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

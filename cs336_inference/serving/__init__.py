"""Serving: a paged KV cache and a continuous-batching engine over it, behind an OpenAI-compatible API.

request.py          Request (one sequence inside the engine), RequestOutput
block_manager.py    BlockAllocator, BlockManager: block tables, prefix caching, copy-on-write
paged_attention.py  PagedKVCache (the blocks' K/V storage), paged attention, PagedBatch
scheduler.py        Scheduler: which sequences run each step, preemption
engine.py           LLMEngine: schedule, one forward over every scheduled token, sample
server.py           the HTTP server (FastAPI): /v1/completions, /v1/chat/completions, streaming
"""

from ..sampling import SamplingParams
from .block_manager import BlockAllocator, BlockManager
from .engine import LLMEngine
from .paged_attention import PagedKVCache
from .request import RequestOutput

__all__ = ["BlockAllocator", "BlockManager", "LLMEngine", "PagedKVCache", "RequestOutput", "SamplingParams"]

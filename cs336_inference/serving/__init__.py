"""Serving: a paged KV cache (paged.py) and a continuous-batching engine over it (engine.py)."""

from .engine import LLMEngine, RequestOutput, SamplingParams
from .paged import BlockAllocator, BlockManager, PagedKVCache

__all__ = ["BlockAllocator", "BlockManager", "LLMEngine", "PagedKVCache", "RequestOutput", "SamplingParams"]

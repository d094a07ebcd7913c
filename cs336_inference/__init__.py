"""cs336-inference: how transformer language models are served, from scratch."""

from .config import ConfigError, ModelConfig
from .kv_cache import KVCache
from .model import TransformerLM

__all__ = ["ConfigError", "KVCache", "ModelConfig", "TransformerLM"]

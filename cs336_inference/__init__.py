"""cs336-inference: how transformer language models are served, from scratch."""

from cs336_inference.io.checkpoint import load_pretrained, save_pretrained
from cs336_inference.io.tokenizer import load_tokenizer

from .config import ConfigError, ModelConfig
from .kv_cache import KVCache
from .model import TransformerLM
from .sampling import SamplingParams, generate, naive_generate, stream_generate

__all__ = [
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "SamplingParams",
    "TransformerLM",
    "generate",
    "load_pretrained",
    "load_tokenizer",
    "naive_generate",
    "save_pretrained",
    "stream_generate",
]

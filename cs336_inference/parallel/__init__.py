"""Tensor parallelism over torch.distributed (Megatron's split; see tensor_parallel.py)."""

from .tensor_parallel import (
    Shard,
    ShardingError,
    TensorParallelLM,
    load_sharded,
    plan,
    shard_model,
)

__all__ = ["Shard", "ShardingError", "TensorParallelLM", "load_sharded", "plan", "shard_model"]

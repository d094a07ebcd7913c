"""Tensor parallelism over torch.distributed (Megatron's split; see tensor_parallel.py)."""

from .tensor_parallel import (
    Shard,
    ShardingError,
    TensorParallelLM,
    load_sharded,
    shard_model,
    shard_plan,
)

__all__ = ["Shard", "ShardingError", "TensorParallelLM", "load_sharded", "shard_plan", "shard_model"]

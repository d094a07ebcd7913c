"""The serving engine over a sharded model: rank 0 schedules and samples, the other ranks follow.

Rank 0 runs an ordinary LLMEngine whose model is its TensorParallelLM shard. Every step it announces
to the other ranks what it is about to compute (the token ids, each sequence's block table, start and
length, the rows whose logits it wants) and every copy-on-write block copy; each follower holds its
own share of the paged KV cache (its K/V heads, the same block ids) and runs the same forward, so the
collectives inside line up. Only rank 0 samples; the gathered logits are the same on every rank.

    rank 0:  engine = LLMEngine(shard, ...); lead(engine); ... engine.generate(...) ...; stop_followers()
    others:  follow(shard, num_blocks, block_size)          # returns at stop_followers()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..serving.paged_attention import PagedBatch, PagedKVCache


def _announce(message: tuple) -> tuple:
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def lead(engine) -> None:
    """Make rank 0's engine announce each step and each block copy to the followers."""
    model, cache = engine.model, engine.cache
    forward_paged = model.forward_paged

    def announced_forward(input_ids, batch):
        spans = [(s.block_table.tolist(), s.start, s.n) for s in batch.spans]
        _announce(("step", input_ids.tolist(), spans, batch.logit_rows.tolist()))
        return forward_paged(input_ids, batch)

    def announced_copy(src: int, dst: int) -> None:
        _announce(("copy", src, dst))
        cache.copy_block(src, dst)

    model.forward_paged = announced_forward
    engine.scheduler.copy_block = announced_copy


def stop_followers() -> None:
    _announce(("stop",))


@torch.inference_mode()
def follow(model, num_blocks: int, block_size: int) -> int:
    """A follower's loop: its share of the paged cache, the leader's steps and copies, until stopped.
    Returns the number of steps it ran."""
    device = model.embed.weight.device
    cache = PagedKVCache(model.cache_config, num_blocks, block_size, model.norm.weight.dtype, device)
    steps = 0
    while True:
        message = _announce(None)
        if message[0] == "stop":
            return steps
        if message[0] == "copy":
            cache.copy_block(message[1], message[2])
            continue
        _, ids, spans, rows = message
        batch = PagedBatch(cache, spans, device)
        batch.logit_rows = torch.tensor(rows, dtype=torch.long, device=device)
        model.forward_paged(torch.tensor(ids, dtype=torch.long, device=device), batch)
        steps += 1

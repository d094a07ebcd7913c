"""Tensor parallelism (Megatron-LM) over torch.distributed: one model split across tp processes.

When one device cannot hold a model or read its weights fast enough, shard it. Each of the tp ranks
holds a slice of every matrix and computes with it; two all-reduces per layer put the pieces back:

    attention   q/k/v split by output (column parallel): rank r owns N/tp query heads and the K/V
                heads they read, so attention runs on local heads only; o_proj split by input (row
                parallel): each rank's product is a partial sum of the [B, T, D] output, all-reduced
    MLP         gate/up column parallel (F/tp neurons each), down row parallel, then all-reduce
    vocabulary  the embedding and the output matrix split by rows (V/tp tokens each): an id owned
                elsewhere embeds to zeros before the all-reduce; the logits are all-gathered
    KV cache    sharded with the heads: rank r caches only its K/V heads

so a layer costs 2 all-reduces of B x T x D activations whatever tp is, while weights and KV bytes
per rank fall by tp. Fewer K/V heads than ranks (MQA, small GQA): each K/V head is replicated on
tp / K ranks (as vLLM does). MLA: heads are split as above, the small latent projection and its
cache are replicated. Sliding window, hybrid and CLA layers split like any other. The families'
switches need nothing more: norms are replicated (QK-norm's [H] gains, shared by every head, and
Gemma 3's sandwich norms too), and each shard keeps D, H and the rotary tables (embed_scale, a
sliding layer's own rotary base, partial rotary, rope scaling).

Each rank's model is an ordinary TransformerLM built from the shard's config (N/tp heads, F/tp
neurons, V/tp vocabulary rows); o_proj / down_proj / the embedding become their parallel subclasses
below and TensorParallelLM all-gathers the logits. Logits are identical on every rank, so greedy
and seeded sampling give every rank the same tokens. Launch with torchrun (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from ..config import ModelConfig
from ..layers import Embedding, Linear
from ..model import TransformerLM


class ShardingError(ValueError):
    """A model and a tensor-parallel size that do not fit together (one line)."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which part of the model rank `rank` of `tp` holds."""

    tp: int
    rank: int
    heads: range  # query heads
    kv_heads: range  # K/V heads (one replicated head when K < tp)
    neurons: range  # MLP rows of gate/up, columns of down
    vocab: range  # rows of the embedding and output matrix (the last shard may be short)
    vocab_rows: int  # rows each shard stores (the short one padded with zeros)


def shard_plan(cfg: ModelConfig, tp: int, rank: int) -> Shard:
    """Rank `rank`'s share; ShardingError if tp does not divide what must be split."""
    if not 0 <= rank < tp:
        raise ShardingError(f"rank {rank} is not in 0..{tp - 1}")
    N, K, Fd, V = cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size
    if N % tp:
        raise ShardingError(f"--tensor-parallel {tp} does not divide the {N} query heads")
    if Fd % tp:
        raise ShardingError(f"--tensor-parallel {tp} does not divide d_ff = {Fd}")
    n = N // tp
    if cfg.is_mla:
        kv = range(0)  # the latents are not split by head
    else:
        kv = kv_heads_of_rank(K, tp, rank)
    rows = -(-V // tp)
    return Shard(
        tp, rank, range(rank * n, (rank + 1) * n), kv, range(rank * Fd // tp, (rank + 1) * Fd // tp),
        range(min(rank * rows, V), min((rank + 1) * rows, V)), rows,
    )  # fmt: skip


def shard_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of the ordinary TransformerLM that holds one shard."""
    return dataclasses.replace(
        cfg,
        n_heads=len(shard.heads),
        n_kv_heads=len(shard.kv_heads) if not cfg.is_mla else len(shard.heads),
        d_ff=len(shard.neurons),
        vocab_size=shard.vocab_rows,
        head_dim=cfg.head_dim,
    )


def kv_heads_of_rank(K: int, tp: int, rank: int) -> range:
    """The K/V heads rank `rank` of tp holds: K/tp of them when tp divides K; when K < tp, the one
    head its query heads read (query head n reads K/V head n // (N/K)), replicated on tp/K ranks.
    ShardingError when neither tp divides K nor K divides tp."""
    # BEGIN SOLUTION tp_layer
    if K >= tp:
        if K % tp:
            raise ShardingError(f"--tensor-parallel {tp} does not divide the {K} key/value heads")
        return range(rank * K // tp, (rank + 1) * K // tp)
    if tp % K:
        raise ShardingError(f"{K} key/value heads cannot be replicated evenly over {tp} ranks")
    head = rank // (tp // K)
    return range(head, head + 1)
    # END SOLUTION


def slice_of(name: str, cfg: ModelConfig, shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the full tensor `name` (a state-dict name, weight [out, in] or bias
    [out]) that the shard holds; None: replicated whole.

    Column parallel (split the output, dim 0): q_proj by the shard's query heads, k_proj / v_proj by
    its K/V heads (H rows each), gate_proj / up_proj by its neurons; a bias goes with its rows. Row
    parallel (split the input, dim 1): o_proj by the query heads, down_proj by the neurons; their
    output is all-reduced, so a bias of theirs is not split (None). The embedding and output matrix
    split by vocabulary rows; norms are whole.
    """
    parts = name.split(".")
    leaf, kind = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    H = cfg.head_dim
    if name in ("embed.weight", "lm_head.weight"):
        return 0, shard.vocab.start, shard.vocab.stop
    if cfg.is_mla and ".attn." in name:
        per_head = {"q_proj": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "q_b_proj": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "kv_b_proj": cfg.qk_nope_head_dim + cfg.v_head_dim}  # fmt: skip
        if leaf in per_head:
            w = per_head[leaf]
            return 0, shard.heads.start * w, shard.heads.stop * w
        if leaf == "o_proj" and kind == "weight":
            return 1, shard.heads.start * cfg.v_head_dim, shard.heads.stop * cfg.v_head_dim
        return None  # q_a_proj, kv_a_proj and the latent norms: replicated
    # BEGIN SOLUTION tp_layer
    if leaf == "q_proj":
        return 0, shard.heads.start * H, shard.heads.stop * H
    if leaf in ("k_proj", "v_proj"):
        return 0, shard.kv_heads.start * H, shard.kv_heads.stop * H
    if leaf == "o_proj" and kind == "weight":
        return 1, shard.heads.start * H, shard.heads.stop * H
    if leaf in ("gate_proj", "up_proj"):
        return 0, shard.neurons.start, shard.neurons.stop
    if leaf == "down_proj" and kind == "weight":
        return 1, shard.neurons.start, shard.neurons.stop
    return None  # norms
    # END SOLUTION


def take(tensor: Tensor, where: tuple[int, int, int] | None) -> Tensor:
    """The shard's part of a full tensor."""
    if where is None:
        return tensor
    dim, start, stop = where
    return tensor.narrow(dim, start, stop - start)


def pad_rows(part: Tensor, rows: int) -> Tensor:
    """Zero rows appended up to `rows` (the last vocabulary shard, when tp does not divide V)."""
    if part.shape[0] >= rows:
        return part
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])


# ------------------------------------------------------------------ the parallel layers
class RowParallelLinear(Linear):
    """y = all_reduce(x_r W_r^T): this rank's slice of the input dimension gives a partial sum."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: Float[Tensor, "... d_in"]) -> Float[Tensor, "... d_out"]:
        """x holds this rank's slice of the input features; the output is the whole y = x W^T + b on
        every rank: the partial products summed by one all-reduce (dist.all_reduce, in place, over
        self.group), the bias (whole on every rank) added once, after the sum."""
        # BEGIN SOLUTION tp_layer
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias
        # END SOLUTION


class VocabParallelEmbedding(Embedding):
    """Rows first..first+rows-1 of the [V, D] table; an id owned by another rank embeds to zeros
    here, and the all-reduce sums the one rank's row that is not zero."""

    group: dist.ProcessGroup | None = None
    first: int = 0
    owned: int = 0  # real rows (the last shard may hold padding rows after them)

    def forward(self, ids: Int[Tensor, "B T"]) -> Float[Tensor, "B T D"]:
        """Rows of the whole table for every id, on every rank: this rank looks up the ids in
        first..first+owned-1 (its row id - first), zeros for every other id, then one all-reduce
        (dist.all_reduce over self.group) sums the ranks' contributions."""
        # BEGIN SOLUTION vocab_parallel
        local = ids - self.first
        mine = (local >= 0) & (local < self.owned)
        x = F.embedding(local.clamp(0, self.owned - 1), self.weight) * mine[..., None]
        dist.all_reduce(x, group=self.group)
        return x
        # END SOLUTION


def gather_vocab(logits: Float[Tensor, "... v"], V: int, group=None) -> Float[Tensor, "... V"]:
    """Every rank's [.., V/tp] logits side by side, padding rows dropped: the full [.., V]."""
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :V]


class TensorParallelLM(nn.Module):
    """One rank's shard of a TransformerLM: the same calls as the whole model (`config` is the whole
    model's; `new_cache` gives this rank's share of the cache), full logits on every rank."""

    def __init__(self, local: TransformerLM, config: ModelConfig, shard: Shard, group=None):
        super().__init__()
        self.local, self.config, self.shard, self.group = local, config, shard, group
        for block in local.layers:
            for linear in (block.attn.o_proj, block.mlp.down_proj):
                linear.__class__, linear.group = RowParallelLinear, group
        embed = local.embed
        embed.__class__, embed.group = VocabParallelEmbedding, group
        embed.first, embed.owned = shard.vocab.start, len(shard.vocab)

    @property
    def embed(self) -> Embedding:
        return self.local.embed

    @property
    def norm(self) -> nn.Module:
        return self.local.norm

    @property
    def layers(self) -> nn.ModuleList:
        return self.local.layers

    @property
    def cache_config(self) -> ModelConfig:
        """What this rank's KV cache holds per layer: its own K/V heads (the serving engine's paged
        cache is sized by it)."""
        return self.local.config

    def new_cache(self, *args, **kwargs):
        return self.local.new_cache(*args, **kwargs)

    def forward(self, input_ids: Int[Tensor, "B T"], cache=None, pad=None, last_only: bool = False):
        logits = self.local(input_ids, cache=cache, pad=pad, last_only=last_only)
        return gather_vocab(logits, self.config.vocab_size, self.group)

    def forward_paged(self, input_ids: Int[Tensor, " T"], batch) -> Float[Tensor, "n V"]:
        return gather_vocab(self.local.forward_paged(input_ids, batch), self.config.vocab_size, self.group)


def group_shard(cfg: ModelConfig, group=None) -> Shard:
    if not dist.is_initialized():
        raise ShardingError(
            "tensor parallelism needs torch.distributed: launch with torchrun --nproc-per-node N"
        )
    return shard_plan(cfg, dist.get_world_size(group), dist.get_rank(group))


@torch.no_grad()
def shard_model(model: TransformerLM, group=None) -> TensorParallelLM:
    """This rank's shard of a whole model already in memory (the tests' way; a checkpoint is better
    loaded with `load_sharded`, which never holds the whole model)."""
    cfg = model.config
    shard = group_shard(cfg, group)
    dtype, device = model.norm.weight.dtype, model.norm.weight.device
    local = TransformerLM.empty(shard_config(cfg, shard), dtype, device)
    full = model.state_dict()
    for name, dst in local.state_dict().items():
        dst.copy_(pad_rows(take(full[name], slice_of(name, cfg, shard)), dst.shape[0]))
    return TensorParallelLM(local.eval(), cfg, shard, group)


@torch.no_grad()
def load_sharded(path, group=None, dtype: torch.dtype = torch.float32, device="cpu") -> TensorParallelLM:
    """This rank's shard of a checkpoint (folder, hub id or GGUF), read tensor by tensor: a
    safetensors folder is read only where the shard's slices lie, a GGUF tensor is dequantized one
    at a time, so no rank holds the whole model."""
    from ..io.checkpoint import copy_weight_
    from ..io.shards import checkpoint_tensors

    cfg, tensors = checkpoint_tensors(path)
    shard = group_shard(cfg, group)
    local = TransformerLM.empty(shard_config(cfg, shard), dtype, device)
    state = local.state_dict()
    for name, part in tensors(lambda name: slice_of(name, cfg, shard)):
        copy_weight_(state[name], pad_rows(part, state[name].shape[0]))
    return TensorParallelLM(local.eval(), cfg, shard, group)


def rank_bytes(model: TensorParallelLM) -> dict[str, int]:
    """Weight bytes this rank holds, split into sharded and replicated."""
    cfg, shard = model.config, model.shard
    out = {"sharded": 0, "replicated": 0}
    for name, t in model.local.state_dict().items():
        out["replicated" if slice_of(name, cfg, shard) is None else "sharded"] += t.numel() * t.element_size()
    return out

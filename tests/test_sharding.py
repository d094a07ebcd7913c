"""Part 8's graded problems (sharding): the tensor-parallel split of a layer and where its
all-reduce goes, the vocab-parallel embedding, and the communication accounting.

The ranks are threads of this process (tests/simulated_ranks.py), so the grader's swapped-in
functions are the ones that run; tests/test_parallel.py runs the same code over real gloo processes.
Every check compares with the whole model, the whole embedding table, a ring all-reduce played out
on numbers, or bytes counted in a live sharded model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from simulated_ranks import SimulatedRanks, on_ranks
from test_parallel import TINY, tiny

from cs336_inference import ModelConfig
from cs336_inference.layers import Embedding, Linear
from cs336_inference.parallel import shard_model
from cs336_inference.parallel.tensor_parallel import (
    RowParallelLinear,
    ShardingError,
    VocabParallelEmbedding,
    kv_heads_of_rank,
    shard_plan,
    slice_of,
)

# the tiny models of the multi-process tests; these variants exercise every split of Part 8
GRADED_VARIANTS = ["gqa", "mqa", "gqa2", "cla", "sliding", "untied", "qkv_bias"]
IDS = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))


# ====================================================================================== tp_layer
@pytest.mark.graded(problem="tp_layer", points=3)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("variant", GRADED_VARIANTS)
def test_sharded_model_gives_the_whole_models_logits(variant, tp):
    whole = tiny(variant)
    with torch.inference_mode():
        expected = whole(IDS)
    got = on_ranks(tp, lambda rank: shard_model(whole)(IDS))
    for rank, logits in enumerate(got):
        err = (logits - expected).abs().max().item()
        assert err < 1e-5, (
            f"{variant}, tp={tp}, rank {rank}: logits differ from the whole model's by {err:.2e}"
        )


@pytest.mark.graded(problem="tp_layer", points=2)
def test_the_split_of_each_weight():
    cfg = ModelConfig(**{**TINY, "n_kv_heads": 4, "qkv_bias": True})
    shard = shard_plan(cfg, 2, 1)  # rank 1 of 2: query heads 4..7, K/V heads 2..3, neurons 48..95
    H = cfg.head_dim
    expect = {
        "layers.0.attn.q_proj.weight": (0, 4 * H, 8 * H),
        "layers.0.attn.q_proj.bias": (0, 4 * H, 8 * H),
        "layers.0.attn.k_proj.weight": (0, 2 * H, 4 * H),
        "layers.1.attn.v_proj.bias": (0, 2 * H, 4 * H),
        "layers.0.attn.o_proj.weight": (1, 4 * H, 8 * H),
        "layers.1.mlp.gate_proj.weight": (0, 48, 96),
        "layers.1.mlp.up_proj.weight": (0, 48, 96),
        "layers.0.mlp.down_proj.weight": (1, 48, 96),
        "layers.0.attn_norm.weight": None,
        "norm.weight": None,
    }
    for name, want in expect.items():
        assert slice_of(name, cfg, shard) == want, (
            f"{name}: expected {want} (dim, start, stop), got {slice_of(name, cfg, shard)}"
        )


@pytest.mark.graded(problem="tp_layer", points=1)
def test_kv_heads_split_or_replicate():
    assert [kv_heads_of_rank(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)], "K = 4 over 2 ranks"
    assert [kv_heads_of_rank(1, 4, r) for r in range(4)] == [range(0, 1)] * 4, "MQA: every rank holds head 0"
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ], "K = 2 over 4 ranks: ranks 0, 1 (query heads 0..3) read K/V head 0; ranks 2, 3 head 1"
    # what cannot be split evenly: tp not dividing K >= tp, and K < tp not dividing tp (K/V heads would be
    # replicated on unequal numbers of ranks, or a rank would read a head that does not exist)
    for K, tp in [(6, 4), (3, 2), (3, 4), (4, 6), (2, 3)]:
        for rank in range(tp):
            try:
                got = kv_heads_of_rank(K, tp, rank)
            except ShardingError:
                continue
            raise AssertionError(
                f"K = {K} key/value heads over tp = {tp} ranks, rank {rank}: returned {got}; expected a "
                f"ShardingError ({'tp does not divide K' if K >= tp else 'K does not divide tp'})"
            )


@pytest.mark.graded(problem="tp_layer", points=1)
def test_row_parallel_linear_all_reduces_once_then_adds_the_bias():
    torch.manual_seed(0)
    whole = Linear(12, 5, bias=True)
    torch.nn.init.normal_(whole.bias)
    x = torch.randn(3, 12)
    expected = F.linear(x, whole.weight, whole.bias)
    ranks = SimulatedRanks(3)

    def rank_forward(rank: int):
        part = Linear(4, 5, bias=True)
        part.weight.data.copy_(whole.weight[:, 4 * rank : 4 * rank + 4])
        part.bias.data.copy_(whole.bias)
        part.__class__ = RowParallelLinear
        return part(x[:, 4 * rank : 4 * rank + 4])

    for rank, y in enumerate(ranks.run(rank_forward)):
        calls = [name for name, _ in ranks.calls[rank]]
        assert calls == ["all_reduce"], (
            f"rank {rank}: the forward made the collective calls {calls}; a row-parallel product sums its "
            "partial results with exactly one all_reduce"
        )
        torch.testing.assert_close(
            y, expected,
            msg=lambda detail, rank=rank: f"rank {rank}: y = x W^T + b with the partial sums all-reduced and "
            f"the bias added once, after the all-reduce (added before it, it counts tp times)\n{detail}",
        )  # fmt: skip


# ================================================================================= vocab_parallel
@pytest.mark.graded(problem="vocab_parallel", points=3)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_parallel_embedding_looks_up_every_id(tp):
    """V = 67 rows over tp ranks (67 is prime: the last shard is short and padded); every id, the
    first and last of each shard among them, gets its row of the whole table on every rank."""
    torch.manual_seed(0)
    table = torch.randn(67, 16)
    ids = torch.arange(67).reshape(1, 67).flip(-1)
    rows = -(-67 // tp)

    def lookup(rank: int):
        first, owned = min(rank * rows, 67), min(rows, 67 - min(rank * rows, 67))
        emb = Embedding(rows, 16)
        emb.weight.data.zero_()
        emb.weight.data[:owned] = table[first : first + owned]
        emb.weight.data[owned:] = 1e3  # padding rows: must never be read
        emb.__class__ = VocabParallelEmbedding
        emb.first, emb.owned = first, owned
        return emb(ids)

    for rank, got in enumerate(on_ranks(tp, lookup)):
        torch.testing.assert_close(got, table[ids], msg=f"tp={tp}, rank {rank}: rows of the whole table")


# ================================================================================== tp_accounting
def counted(tp: int, variant: str) -> tuple[SimulatedRanks, list]:
    whole = tiny(variant)
    ranks = SimulatedRanks(tp)

    def rank_run(rank: int):
        model = shard_model(whole)
        ranks.calls[rank].clear()
        model(IDS)
        cache = model.new_cache(1, 10)
        weights = sum(t.nbytes for name, t in model.local.state_dict().items() if "norm" not in name)
        return weights, sum(layer.nbytes for layer in cache.layers if layer is not None) // 10

    return ranks, ranks.run(rank_run)


@pytest.mark.graded(problem="tp_accounting", points=1)
@pytest.mark.parametrize("variant", ["gqa", "cla"])
def test_allreduce_bytes_are_what_a_sharded_forward_all_reduces(variant):
    from cs336_inference.accounting import tp_allreduce_bytes

    cfg = tiny(variant).config
    ranks, _ = counted(2, variant)
    for rank, calls in enumerate(ranks.calls):
        reduced = sum(n for name, n in calls if name == "all_reduce")
        want = tp_allreduce_bytes(cfg, *IDS.shape, dtype_bytes=4)
        assert reduced == want, (
            f"{variant}, rank {rank}: the forward all-reduced {reduced} bytes, the accounting says {want}"
        )


@pytest.mark.graded(problem="tp_accounting", points=2)
@pytest.mark.parametrize("variant, tp", [("gqa", 2), ("mqa", 4), ("gqa2", 4), ("untied", 2), ("cla", 2)])
def test_weight_and_kv_bytes_per_rank_are_what_a_shard_holds(variant, tp):
    from cs336_inference.accounting import tp_kv_bytes_per_token_per_rank, tp_weight_bytes_per_rank

    cfg = tiny(variant).config
    _, held = counted(tp, variant)
    for rank, (weights, kv_per_token) in enumerate(held):
        assert tp_weight_bytes_per_rank(cfg, tp, dtype_bytes=4) == weights, (
            f"{variant}, tp={tp}, rank {rank}: weights"
        )
        assert tp_kv_bytes_per_token_per_rank(cfg, tp, dtype_bytes=4) == kv_per_token, (
            f"{variant}, tp={tp}, rank {rank}: KV per token"
        )


def ring_traffic(n: int, tp: int, gather_only: bool = False) -> int:
    """Play a ring all-reduce (or only its all-gather half) out on numbers; bytes one rank sends."""
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(tp, n // 4 // tp, generator=g, dtype=torch.float64) for _ in range(tp)]
    total = sum(d.clone() for d in data)
    if gather_only:  # rank r starts with the finished chunk r
        data = [total.clone() * (torch.arange(tp) == r)[:, None] for r in range(tp)]
    sent = 0
    if not gather_only:
        for step in range(tp - 1):  # reduce-scatter: rank r sends chunk r - step to r + 1
            out = [(r, (r - step) % tp, data[r][(r - step) % tp].clone()) for r in range(tp)]
            for r, c, chunk in out:
                data[(r + 1) % tp][c] += chunk
            sent += out[0][2].numel() * 4
    shift = 0 if gather_only else 1
    for step in range(tp - 1):  # all-gather: rank r forwards its newest finished chunk
        out = [(r, (r + shift - step) % tp, data[r][(r + shift - step) % tp].clone()) for r in range(tp)]
        for r, c, chunk in out:
            data[(r + 1) % tp][c] = chunk
        sent += out[0][2].numel() * 4
    for r in range(tp):
        torch.testing.assert_close(data[r], total)
    return sent


@pytest.mark.graded(problem="tp_accounting", points=1)
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_ring_times_are_the_ring_traffic_plus_one_latency_per_step(tp):
    from cs336_inference.accounting import ring_allgather_time, ring_allreduce_time

    n = 4 * 1024 * 8
    assert ring_allreduce_time(n, tp, 1e9, 0.0) * 1e9 == pytest.approx(ring_traffic(n, tp)), (
        f"tp={tp}: all-reduce"
    )
    assert ring_allgather_time(n, tp, 1e9, 0.0) * 1e9 == pytest.approx(
        ring_traffic(n, tp, gather_only=True)
    ), f"tp={tp}: all-gather"
    assert ring_allreduce_time(n, tp, 1e9, 1e-5) - ring_allreduce_time(n, tp, 1e9, 0) == pytest.approx(
        2 * (tp - 1) * 1e-5
    )
    assert ring_allgather_time(n, tp, 1e9, 1e-5) - ring_allgather_time(n, tp, 1e9, 0) == pytest.approx(
        (tp - 1) * 1e-5
    )

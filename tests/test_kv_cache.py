"""Caches: a cached forward, token by token, equals the full forward (naive == cached)."""

from __future__ import annotations

import pytest
import torch

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference.kv_cache import MLACache, RingKVCache, StaticKVCache

TINY = dict(vocab_size=97, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64)
MLA_DIMS = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)
VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=2, sliding_window=5),
    "hybrid": dict(n_kv_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "cla": dict(n_layers=4, n_kv_heads=2, kv_share=2),
    "mla": dict(**MLA_DIMS, rope_interleave=False),
    "mla_qlora": dict(**MLA_DIMS, q_lora_rank=24, rope_interleave=True),
}


def tiny_model(**overrides) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(ModelConfig(**{**TINY, **overrides})).eval()


def check_close(what: str, got: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4, dim: int = 1):
    """Assert |got - expected| <= atol; the message names the case and the first position (along dim) off."""
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs().nan_to_num(nan=float("inf"))
    if diff.max() > atol:
        bad = (diff > atol).movedim(dim, 0).flatten(1).any(dim=1).nonzero()
        raise AssertionError(
            f"{what}: max |diff| {float(diff.max()):.2e} > {atol:g}; first position off: {int(bad[0])}"
        )


def check_incremental(name: str, chunks: list[int], spare: int = 0, dtype: torch.dtype = torch.float32):
    """Feed the tokens chunk by chunk through a cache: every chunk's logits equal the full forward's."""
    model = tiny_model(**VARIANTS[name], max_seq_len=max(64, sum(chunks))).to(dtype)
    ids = torch.randint(0, 97, (2, sum(chunks)), generator=torch.Generator().manual_seed(len(chunks)))
    with torch.no_grad():
        full = model(ids)
        # bf16: cached and full may run different kernels (MLA decode even another formula: absorbed),
        # each rounding to 8 bits of mantissa; seen: 0 for K/V caches, 1.4% of the largest logit for MLA.
        atol = 1e-4 if dtype == torch.float32 else 0.04 * float(full.float().abs().max())
        cache, t = model.new_cache(2, max(40, sum(chunks)), spare=spare), 0
        for n in chunks:
            out = model(ids[:, t : t + n], cache=cache)
            what = f"variant {name}, chunks {chunks}" + (f", spare {spare}" if spare else "")
            check_close(
                f"{what}: logits of the chunk of {n} at step {t} (position 0 = step {t})",
                out,
                full[:, t : t + n],
                atol=atol,
            )
            t += n
    assert cache.pos == sum(chunks), f"variant {name}: cache.pos = {cache.pos} after {sum(chunks)} tokens"


DECODE = [6] + [1] * 14  # 20 tokens: longer than every window
CHUNKED = [5, 3, 1, 2, 4, 1, 4]
# 247 tokens: multi-token queries against a cache of a hundred steps and more, the rings of the
# sliding-window variants (4-5 slots) wrapped some fifty times
LONG = [24] + [1] * 60 + [7, 3] + [1] * 40 + [9, 5, 2] + [1] * 80 + [6, 11]


@pytest.mark.graded(problem="kv_cache", points=3)
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "cla"])
def test_static_cache_prefill_then_decode_equals_full_forward(name):
    check_incremental(name, DECODE)
    check_incremental(name, CHUNKED)
    check_incremental(name, LONG)


def check_store(what: str, got: tuple, written: list[tuple], end: int, names=("keys", "values")):
    """`got` = what update returned; `written` = the chunks written so far, along the step dim."""
    for i, expected in enumerate(zip(*written, strict=True)):
        expected = torch.cat(expected, dim=-2)
        assert got[i].shape == expected.shape, (
            f"{what}: returned {names[i]} of shape {tuple(got[i].shape)}, expected {tuple(expected.shape)} "
            f"(steps 0..{end - 1} only)"
        )
        assert torch.equal(got[i], expected), f"{what}: returned {names[i]} differ from the ones written"
    assert torch.equal(got[2], torch.arange(end)), (
        f"{what}: returned steps {got[2].tolist()}, expected 0..{end - 1}"
    )


def check_value_error(what: str, fn) -> None:
    """fn() must raise ValueError (a clear one-line error), not another exception or none."""
    try:
        fn()
    except ValueError:
        return
    except Exception as e:  # any other exception: name it in the failure
        raise AssertionError(
            f"{what}: raised {type(e).__name__} ({e}); expected a one-line ValueError"
        ) from None
    raise AssertionError(f"{what}: no error; expected ValueError")


@pytest.mark.graded(problem="kv_cache", points=1)
def test_static_cache_update_writes_and_returns_steps_so_far():
    store = StaticKVCache(2, 2, 10, 4, 3, torch.float32, "cpu")
    written, start = [], 0
    storage = {"keys": store.k.untyped_storage().data_ptr(), "values": store.v.untyped_storage().data_ptr()}
    for T in [4, 1, 3]:
        kv = (torch.randn(2, 2, T, 4), torch.randn(2, 2, T, 3))
        written.append(kv)
        got = store.update(*kv, start)
        start += T
        what = f"StaticKVCache(S_max=10).update of {T} steps at {start - T}"
        check_store(what, got, written, start)
        # the cost: the new steps are written into the storage allocated at construction (taken before the
        # first call), and what attention reads is a view of it: never a copy of the whole prefix made again
        # at every step (torch.cat, clone), whether returned or put in place of the cache's own tensors
        for name, out, now in (("keys", got[0], store.k), ("values", got[1], store.v)):
            assert now.untyped_storage().data_ptr() == storage[name], (
                f"{what}: the cache's {name} are no longer the tensor allocated at construction (replaced by a "
                f"new one, e.g. torch.cat of the old and the new steps): every step would copy all {start} "
                "cached steps again; write the new steps into the preallocated tensor in place"
            )
            assert out.untyped_storage().data_ptr() == storage[name], (
                f"{what}: the returned {name} are a new [{', '.join(map(str, out.shape))}] tensor, not a view "
                f"of the cache: a decode step would copy all {start} cached steps again"
            )


@pytest.mark.graded(problem="kv_cache", points=1)
def test_static_cache_overflow_is_a_value_error():
    store = StaticKVCache(2, 2, 10, 4, 3, torch.float32, "cpu")
    kv = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 3)
    check_value_error("StaticKVCache(S_max=10).update of 3 steps at 8", lambda: store.update(*kv, 8))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bf16_prefill_then_decode_equals_full_forward(name):
    check_incremental(name, [6] + [1] * 14, dtype=torch.bfloat16)


@pytest.mark.graded(problem="ring_cache", points=2)
@pytest.mark.parametrize("name", ["sliding", "hybrid"])
def test_ring_prefill_then_decode_equals_full_forward(name):
    check_incremental(name, DECODE)
    check_incremental(name, LONG)


@pytest.mark.graded(problem="ring_cache", points=3)
@pytest.mark.parametrize("name", ["sliding", "hybrid"])
@pytest.mark.parametrize("spare", [0, 2])
def test_ring_chunked_prefill_across_the_wrap(name, spare):
    # chunks longer than the window overwrite the ring mid-pass; 2- and 4-token chunks just too long to fit
    for chunks in ([3, 9, 1, 7], [6, 2, 2, 2, 1, 2, 5], [8, 4, 1, 4, 3]):
        check_incremental(name, chunks, spare=spare)


@pytest.mark.graded(problem="ring_cache", points=1)
def test_ring_holds_w_slots_however_long():
    model = tiny_model(**VARIANTS["sliding"])
    small, large = model.new_cache(1, 16), model.new_cache(1, 64)
    assert all(isinstance(s, RingKVCache) for s in large.layers), (
        "a sliding layer's cache is not a RingKVCache"
    )
    expected = 2 * 2 * (1 * 2 * 5 * 16) * 4  # L x (K,V) x B K W H x fp32
    assert small.nbytes == large.nbytes == expected, (
        f"ring caches of 16 and 64 steps hold {small.nbytes} and {large.nbytes} bytes, expected {expected} (W slots)"
    )
    with torch.no_grad():
        for t in range(30):
            model(torch.tensor([[t % 97]]), cache=large)
    assert large.layers[0].k.shape[2] == 5, f"the ring grew to {large.layers[0].k.shape[2]} slots (W = 5)"


def check_ring_update(store: RingKVCache, start: int, T: int, rolled_back: bool = False) -> None:
    """One update of steps start..start+T-1, whose keys hold their step number (values: minus it)."""
    W, slots = store.window, store.slots
    what = f"RingKVCache(W={W}, spare={slots - W}).update of {T} steps at {start}"
    k = torch.arange(start, start + T, dtype=torch.float32).view(1, 1, T, 1).expand(1, 1, T, 2).contiguous()
    out_k, out_v, out_steps = store.update(k, -k, start)
    assert store.pos == start + T, (
        f"{what}: store.pos = {store.pos} afterwards, expected {start + T} (update advances pos)"
    )
    valid = out_steps >= 0
    assert torch.equal(out_k[0, 0, valid, 0], out_steps[valid].float()), (
        f"{what}: returned keys do not hold the steps returned with them: steps {out_steps.tolist()}, "
        f"keys {out_k[0, 0, :, 0].tolist()}"
    )
    assert torch.equal(out_v[0, 0, valid, 0], -out_steps[valid].float()), (
        f"{what}: values do not match their steps"
    )
    returned = set(out_steps.tolist())
    for i in range(start, start + T):
        missing = [j for j in range(max(0, i - W + 1), i + 1) if j not in returned]
        assert not missing, f"{what}: query step {i} needs key steps {missing}, which were not returned"
    if T <= slots - W + 1:
        assert out_k.shape[2] == slots, (
            f"{what}: returned {out_k.shape[2]} keys; a chunk that fits in the ring must return the ring "
            f"itself ({slots} slots), not a copy"
        )
    held = sorted(j for j in store.steps.tolist() if j >= 0)
    expected = list(range(max(0, start + T - slots), start + T))
    if rolled_back:  # truncate emptied the slots of the steps it forgot
        expected = expected[-len(held) :] if len(held) >= W else expected
    assert held == expected, f"{what}: the ring holds steps {held} afterwards, expected the newest {expected}"
    assert torch.equal(store.k[0, 0, store.steps >= 0, 0], store.steps[store.steps >= 0].float()), (
        f"{what}: a ring slot holds the key of another step than store.steps says"
    )


@pytest.mark.graded(problem="ring_cache", points=2)
@pytest.mark.parametrize("spare", [0, 2])
def test_ring_update_returns_every_needed_key_and_advances_pos(spare):
    store, start = RingKVCache(1, 1, 4, 2, 2, torch.float32, "cpu", spare=spare), 0
    for T in [3, 1, 1, 2, 3, 4, 1, 9, 2, 1]:
        check_ring_update(store, start, T)
        start += T
    # truncate (given) relies on pos: rolling back 3 steps needs 3 spare slots
    if spare == 0:
        check_value_error(
            f"truncate({start - 3}) after {start} steps in a ring without spare slots (truncate reads store.pos)",
            lambda: store.truncate(start - 3),
        )
    else:
        store.truncate(start - 2)
        assert store.pos == start - 2, f"pos = {store.pos} after truncate({start - 2})"
        check_ring_update(store, start - 2, 1, rolled_back=True)


@pytest.mark.graded(problem="mla_cache", points=2)
@pytest.mark.parametrize("name", ["mla", "mla_qlora"])
def test_mla_cache_prefill_then_decode_equals_full_forward(name):
    check_incremental(name, DECODE)
    check_incremental(name, CHUNKED)
    check_incremental(name, LONG)


@pytest.mark.graded(problem="mla_cache", points=1)
def test_mla_cache_holds_only_latent_and_rope_key():
    model = tiny_model(**VARIANTS["mla"])
    cache = model.new_cache(3, 20)
    assert all(isinstance(s, MLACache) for s in cache.layers), "an MLA layer's cache is not an MLACache"
    per_token_per_layer = MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]
    expected = TINY["n_layers"] * 3 * 20 * per_token_per_layer * 4
    assert cache.nbytes == expected, f"the MLA cache holds {cache.nbytes} bytes, expected {expected}"
    latents = []  # what the cache must hold: the normalized latent c_kv of every token
    model.layers[1].attn.kv_a_norm.register_forward_hook(lambda mod, inp, out: latents.append(out))
    with torch.no_grad():
        model(torch.randint(0, 97, (3, 7)), cache=cache)
    check_close("MLA cache: c_kv of the 7 prompt tokens", cache.layers[1].c_kv[:, :7], latents[0], atol=1e-6)
    assert cache.layers[1].c_kv[:, 7:].abs().max() == 0, "the MLA cache wrote beyond the 7 prompt steps"


@pytest.mark.graded(problem="mla_cache", points=1)
def test_mla_cache_update_writes_and_returns_steps_so_far():
    store = MLACache(2, 10, 6, 4, torch.float32, "cpu")
    written, start = [], 0
    for T in [4, 1, 3]:
        latent = (torch.randn(2, T, 6), torch.randn(2, T, 4))
        written.append(latent)
        got = store.update(*latent, start)
        start += T
        check_store(
            f"MLACache(S_max=10).update of {T} steps at {start - T}", got, written, start, ("c_kv", "k_pe")
        )


@pytest.mark.graded(problem="mla_cache", points=1)
def test_mla_cache_overflow_is_a_value_error():
    store = MLACache(2, 10, 6, 4, torch.float32, "cpu")
    latent = torch.randn(2, 3, 6), torch.randn(2, 3, 4)
    check_value_error("MLACache(S_max=10).update of 3 steps at 8", lambda: store.update(*latent, 8))


def test_cache_kinds_per_layer():
    hybrid = tiny_model(**VARIANTS["hybrid"]).new_cache(1, 32)
    assert [type(s) for s in hybrid.layers] == [RingKVCache, StaticKVCache]
    short = tiny_model(**VARIANTS["sliding"]).new_cache(1, 4)  # shorter than the window: no ring needed
    assert all(isinstance(s, StaticKVCache) for s in short.layers)


@pytest.mark.parametrize("name", ["gqa", "sliding", "mla"])
def test_truncate_rolls_back(name):
    """Decode 4 tokens, roll back 3, decode other tokens: same as never having seen the first ones."""
    model = tiny_model(**VARIANTS[name])
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(1, 32, spare=4)
        model(ids[:, :12], cache=cache)
        model(torch.randint(0, 97, (1, 4)), cache=cache)  # a rejected draft
        cache.truncate(12)
        out = model(ids[:, 12:], cache=cache)
    torch.testing.assert_close(out, full[:, 12:], atol=1e-4, rtol=1e-4)


def test_ring_truncate_without_spare_is_refused():
    model = tiny_model(**VARIANTS["sliding"])
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 12)), cache=cache)
    with pytest.raises(ValueError, match="spare"):
        cache.truncate(9)


def test_cache_overflow_is_clear():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="capacity"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)

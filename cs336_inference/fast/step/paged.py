"""The serving engine's step in one C call: every decoder layer over paged K/V (step.c).

`LLMEngine` flattens the new tokens of all scheduled sequences into one row (selective batching)
and calls `model.forward_paged(ids, batch)`. The readable forward (model.py, serving/paged_attention.py)
runs each layer's products once over the row and attention per sequence over its blocks, about
fifteen PyTorch calls per layer. On the fast path (`cs336_inference.fast.install`) a step of up to
MAX_ROWS rows goes instead to `cs336_layers_paged`: the same layers as the native decode step
(native.py), with each row's keys and values written to its slot and read back through its
sequence's block table, in place (no gathered copy). The products read each weight once for all
the rows, so 16 decoding sequences cost little more than one: decode is memory-bound.

Row by row the operations are those of the native step over a static cache (the same products,
norms and rotary, each head's keys visited in step order), and no row's numbers depend on the other
rows of the step: a request gets bitwise the same logits alone as beside others
(tests/test_paged_native.py, which also compares every step with the readable forward). Longer steps (a prompt chunk past MAX_ROWS tokens) and models or caches it cannot
run (`why_not_paged`: MLA, CLA, another dtype, the families' switches step.c does not compute:
partial rotary) take the readable forward.
"""

from __future__ import annotations

import weakref

import torch
from jaxtyping import Float, Int
from torch import Tensor

from cs336_inference.fast.cpu.ops import MAX_ROWS
from cs336_inference.fast.step.fuse import fuse_siblings
from cs336_inference.fast.step.native import NativeLayers, OutputHead, model_problem
from cs336_inference.serving.paged_attention import pad_tables


def why_not_paged(model, cache) -> str | None:
    """Why the paged native step cannot run this model over this PagedKVCache (None: it can)."""
    problem = model_problem(model)
    if problem:
        return problem
    if cache.is_mla:
        return "its cache holds MLA latents"
    for i, store in enumerate(cache.layers):
        k, v = store
        if k.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape:
            return f"layer {i}'s paged store is not contiguous float32 with equal key and value widths"
    return None


class PagedLayers(NativeLayers):
    """x -> every decoder layer applied to the flattened rows of one engine step (in place)."""

    why_not = staticmethod(why_not_paged)

    # a weak reference: paged_step keeps the step in a WeakKeyDictionary keyed by its cache, whose
    # entry would never go (nor the cache's memory, an engine's whole KV store) if its value held it
    @property
    def cache(self):
        return self._cache()

    @cache.setter
    def cache(self, cache) -> None:
        self._cache = weakref.ref(cache)

    def _stores(self, i: int) -> tuple[Tensor, Tensor]:
        return self.cache.layers[i]

    def __call__(
        self,
        x: Float[Tensor, "M D"],
        cos: Float[Tensor, "M H"],
        sin: Float[Tensor, "M H"],
        rows: Int[Tensor, "3 M"],
        tables: Int[Tensor, "n blocks"],
        local: tuple[Tensor, Tensor] | None = None,
    ) -> Float[Tensor, "M D"]:
        """local: the sliding layers' own (cos, sin) [M, H] where the model has a second table."""
        D, N, K, H, F = self.shape
        dims = [x.shape[0], D, N, K, H, F, tables.shape[1], self.cache.block_size]
        return self._run(self.lib.cs336_layers_paged, self._layers(), dims, x, local, cos, sin, rows, tables)


class PagedStep:
    """logits of the rows batch.logit_rows (each sequence's last new token), [n, V], for one engine
    step (module docstring)."""

    def __init__(self, model, cache):
        fuse_siblings(model)  # q/k/v and gate/up as one product each, as the native decode step
        self.model, self.layers = model, PagedLayers(model, cache)
        self.output = OutputHead(model, ours_first=True)  # each row's logits independent of the others

    def __call__(self, input_ids: Int[Tensor, " M"], batch, return_hidden: bool = False):
        model = self.model
        spans = batch.spans
        seq = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([s.n for s in spans]))
        tables = pad_tables([s.block_table for s in spans])
        rows = torch.stack([batch.positions, batch.slots, seq])
        x = model.embed_tokens(input_ids)
        positions = batch.positions
        local = None  # Gemma 3's sliding layers rotate with their own table
        if hasattr(model, "rope_cos_local"):
            local = (model.rope_cos_local[positions], model.rope_sin_local[positions])
        x = self.layers(x, model.rope_cos[positions], model.rope_sin[positions], rows, tables, local)
        if return_hidden:  # every row's features too, as the readable forward_paged gives them
            h = model.norm(x)
            return self.output(h[batch.logit_rows]), h
        return self.output(model.norm(x[batch.logit_rows]))


_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PagedKVCache -> PagedStep | None


def paged_step(model, cache) -> PagedStep | None:
    """The paged native step of model over cache, made on first use; None where it cannot run."""
    if cache not in _steps:
        _steps[cache] = None if why_not_paged(model, cache) else PagedStep(model, cache)
    step = _steps[cache]
    return step if step is not None and step.model is model else None


def forward_paged(model, input_ids: Int[Tensor, " M"], batch, return_hidden: bool = False):
    """The engine step on the native path (logits [n, V], or (logits, h [M, D]) with return_hidden, as
    TransformerLM.forward_paged), or None (the caller runs the readable forward)."""
    if not 1 <= input_ids.shape[0] <= MAX_ROWS or torch.is_grad_enabled():
        return None
    if batch.max_position >= model.config.max_seq_len:
        return None  # the readable forward raises the error
    step = paged_step(model, batch.cache)
    return None if step is None else step(input_ids, batch, return_hidden)

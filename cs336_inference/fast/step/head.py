"""The draft head's passes (draft_head.py) with its decoder layer in one C call, as the target's steps.

A head pass reads a few MB of weights (its one layer and, for drafting, 8,192 output rows in q8_0),
so much of its time is the calls around the products: run eagerly, the norms, rotary, cache write,
masked attention, SiLU and residuals are some forty PyTorch calls a pass, each a few microseconds of
dispatch.
`FastDraftHead` (what `fast.install(head)` makes of a DraftHead) hands the layer to step.c's
`cs336_layers` / `cs336_layers_tree` (native.NativeLayers), which compute the same function; the
input product, the final norm and the readout stay the head's own.

It runs natively when its inputs are one row on a float32 CPU static cache (a pass of more than
MAX_ROWS steps, a prompt's catch-up, goes in pieces of MAX_ROWS), with the layer's products in
formats the native step takes, and for a tree pass when every tree node already in the cache is
visible to every new input (step.c shows the steps before a pass to all of its inputs); otherwise it
runs the readable forward. HeadDraft feeds a tree's level again with the nodes before it where a
level's inputs see different ones, so its passes all qualify.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from cs336_inference.draft_head import DraftHead
from cs336_inference.fast.cpu.ops import MAX_ROWS
from cs336_inference.fast.step.fuse import fuse_siblings
from cs336_inference.fast.step.native import NativeLayers, tree_bits
from cs336_inference.kv_cache import KVCache


class _Layers:
    """What NativeLayers reads of a model, for the head's one layer."""

    def __init__(self, head: DraftHead):
        self.layers, self.config, self.embed = [head.block], head.config, head.target.embed

    def parameters(self):  # what ops.model_panels_on weighs
        return self.layers[0].parameters()


class FastDraftHead(DraftHead):
    """A DraftHead whose cached passes run its layer natively where they can (see the module doc)."""

    def _native(self, cache: KVCache) -> NativeLayers | None:
        """The native layer for this cache (made once per cache), None where it cannot run."""
        made = getattr(self, "_native_for", None)
        if made is not None and made[0] is cache:
            return made[1]
        runner = None
        if not torch.is_grad_enabled() and self.norm.weight.dtype == torch.float32:
            fuse_siblings(self)  # q/k/v and gate/up stacked, as NativeLayers reads them
            layers = _Layers(self)
            if NativeLayers.why_not(layers, cache) is None and cache.layers[0].k.shape[0] == 1:
                try:
                    runner = NativeLayers(layers, cache)
                except ValueError:
                    runner = None
        self._native_for = (cache, runner)
        return runner

    def forward(
        self,
        tokens: Int[Tensor, "B T"],
        feats: Float[Tensor, "B T D"],
        cache: KVCache | None = None,
        depth: Int[Tensor, " T"] | None = None,
        tree: Bool[Tensor, "T n"] | None = None,
        tree_start: int | None = None,
    ) -> Float[Tensor, "B T D"]:
        native = None if cache is None or torch.is_grad_enabled() else self._native(cache)
        B, T = tokens.shape
        start = 0 if cache is None else cache.pos
        if tree is not None:
            before = start - (start if tree_start is None else tree_start)
            if T > MAX_ROWS or (before and not bool(tree[:, :before].all())):
                native = None  # too many nodes, or one must not see a node fed before: readable
        if native is None or B != 1 or feats.dtype != torch.float32:
            return super().forward(tokens, feats, cache, depth, tree, tree_start)
        if T > MAX_ROWS:  # a prompt's catch-up: causal, so MAX_ROWS steps at a time give the same
            parts = [
                self.forward(
                    tokens[:, i : i + MAX_ROWS],
                    feats[:, i : i + MAX_ROWS],
                    cache,
                    None if depth is None else depth[i : i + MAX_ROWS] - i,
                )
                for i in range(0, T, MAX_ROWS)
            ]
            return torch.cat(parts, dim=1)
        if start + T > cache.capacity:
            raise ValueError(f"KV cache full: {start} + {T} steps > capacity {cache.capacity}")
        steps = torch.arange(start, start + T, device=tokens.device)
        positions = steps if depth is None else start + depth
        z = self.fc(torch.cat([self.target.embed(tokens).to(feats.dtype), feats], dim=-1)).contiguous()
        bits = None if tree is None else tree_bits(tree[:, -T:])
        pad = torch.zeros(1, dtype=torch.long, device=tokens.device)
        x = native(z, self.rope_cos[positions][None], self.rope_sin[positions][None], steps, pad, bits)
        cache.pos = start + T
        return self.norm(x)

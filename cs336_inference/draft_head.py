"""A trained draft head (EAGLE's design): one decoder layer that drafts from the target's own features.

A token-level draft (a small model, the target quantized) must rebuild from the tokens alone what the
target has already computed. The head reads it instead. With h_j the target's feature at position j
(its final norm's output, the vector the output matrix turns into the logits for token j + 1) and
e(x) the target's embedding of token x:

    input at position j      z_j = W_fc [e(x_j); h_{j-1}]                     (2D -> D)
    one decoder layer        u_j = block(z_j)   (causal attention over the head's own KV cache)
    predicted feature        g_j = norm(u_j)  ~  h_j
    draft logits             g_j W_vocab^T    (the target's output matrix, or its rows of the
                                               `vocab_ids` most frequent tokens: a truncated head)

Drafting token j + 1 needs h_{j-1}, known once the target has verified x_{j-1}; the head then feeds
its own prediction g_j as the feature of the next position, k times for k drafts. One step reads the
head's layer (about 1/30 of SmolLM2's layers) and the output rows, not the target's 30 layers.

Trained (draft_training.py) to regress g_j onto h_j and to predict the target's own argmax; its file
holds only its own weights: the embedding and the output matrix are the target's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .attention import ForwardContext
from .config import ModelConfig
from .kv_cache import KVCache, StaticKVCache
from .layers import Linear, RMSNorm, rope_tables
from .model import TransformerBlock, TransformerLM

CONFIG_NAME, WEIGHTS_NAME = "draft_head.json", "draft_head.safetensors"
# HeadDraft's prompt lookup: matches of LOOKUP_N[0] tokens down to LOOKUP_N[1] (a one-token match
# predicts little: most tokens of a text occurred somewhere before). A match of COPY_RUN tokens is a
# copy under way
LOOKUP_N, COPY_RUN = (3, 2), 6
DEFAULT_HEAD_DIR = Path("runs/draft-head")  # where scripts/train_draft.py puts SmolLM2's head


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's one-layer config: the target's attention and MLP shapes, full attention, no CLA."""
    return dataclasses.replace(
        target, n_layers=1, layer_types=None, sliding_window=None, kv_share=1, tie_embeddings=True
    )


class DraftHead(nn.Module):
    """fc([e(x); h]) -> one TransformerBlock -> norm: the predicted next feature (see the module doc).

    vocab_ids: the target's token ids the head drafts from ([Vd], sorted by id), None for all V.
    `attach(target)` borrows the target's embedding and output rows (never saved with the head).
    """

    def __init__(self, config: ModelConfig, vocab_ids: Int[Tensor, " Vd"] | None = None):
        super().__init__()
        self.config = cfg = head_config(config)
        D = cfg.d_model
        self.fc = Linear(2 * D, D)
        self.block = TransformerBlock(cfg, 0)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if vocab_ids is not None:
            vocab_ids = torch.as_tensor(vocab_ids, dtype=torch.long).sort().values
            if len(vocab_ids) == 0 or int(vocab_ids[0]) < 0 or int(vocab_ids[-1]) >= cfg.vocab_size:
                raise ValueError(f"vocab_ids must be a non-empty set of ids in [0, {cfg.vocab_size})")
        self.register_buffer("vocab_ids", vocab_ids, persistent=False)
        self._target: list[TransformerLM] = []  # a list, so the target is not a submodule
        self.readout: Tensor | None = None
        self.readout_q: nn.Module | None = None  # `quantize`: the readout rows as a quantized layer

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.vocab_ids is None else len(self.vocab_ids)

    def attach(self, target: TransformerLM, full_vocab: bool = False) -> DraftHead:
        """Borrow target's embedding and output matrix (its vocab_ids rows unless full_vocab)."""
        cfg = target.config
        if (cfg.d_model, cfg.vocab_size) != (self.config.d_model, self.config.vocab_size):
            raise ValueError(
                f"the head was made for d_model={self.config.d_model}, V={self.config.vocab_size}; "
                f"the target has d_model={cfg.d_model}, V={cfg.vocab_size}"
            )
        w = target.vocab_weight
        if type(w) not in (Tensor, nn.Parameter) or not w.is_floating_point():
            raise ValueError("the draft head needs the target's output matrix in floating point")
        self._target = [target]
        self.full_vocab = full_vocab or self.vocab_ids is None
        rows = w.detach() if self.full_vocab else w.detach()[self.vocab_ids.to(w.device)]
        self.readout = rows.to(self.norm.weight.dtype).contiguous()
        self.readout_q = None  # a quantized readout (quantize) would read the old rows
        return self

    @property
    def target(self) -> TransformerLM:
        if not self._target:
            raise ValueError("the draft head has no target: call head.attach(target) first")
        return self._target[0]

    def token_ids(self, rows: Int[Tensor, "..."]) -> Int[Tensor, "..."]:
        """Target token ids of readout rows (the identity for a full-vocabulary readout)."""
        return rows if self.full_vocab else self.vocab_ids[rows]

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.config
        w = self.norm.weight  # (the products' weights may be quantized)
        store = StaticKVCache(1, cfg.n_kv_heads, capacity, cfg.head_dim, cfg.head_dim, w.dtype, w.device)
        return KVCache([store], capacity)

    def forward(
        self,
        tokens: Int[Tensor, "B T"],
        feats: Float[Tensor, "B T D"],
        cache: KVCache | None = None,
        depth: Int[Tensor, " T"] | None = None,
        tree: Bool[Tensor, "T n"] | None = None,
        tree_start: int | None = None,
    ) -> Float[Tensor, "B T D"]:
        """Predicted features g for inputs (x_j, h_{j-1}); with a cache the T inputs are its next steps.

        depth/tree: the T inputs are nodes of a tree of drafts (tree drafting): input i sits at
        position cache.pos + depth[i]; the cache's steps from tree_start on are the tree's nodes fed
        so far and these T, of which input i sees those tree[i] marks (ForwardContext.tree).
        """
        B, T = tokens.shape
        start = 0 if cache is None else cache.pos
        steps = torch.arange(start, start + T, device=tokens.device)
        positions = steps if depth is None else start + depth
        ctx = ForwardContext(steps, start, self.rope_cos[positions][None], self.rope_sin[positions][None],
                             cache=cache, tree=tree, tree_start=start if tree_start is None else tree_start)  # fmt: skip
        z = self.fc(torch.cat([self.target.embed(tokens).to(feats.dtype), feats], dim=-1))
        g = self.norm(self.block(z, ctx))
        if cache is not None:
            cache.pos = start + T
        return g

    def logits(self, g: Float[Tensor, "... D"]) -> Float[Tensor, "... Vd"]:
        """Draft logits over the head's vocabulary (readout rows; `token_ids` maps them to the target's)."""
        if self.readout is None:
            raise ValueError("the draft head has no target: call head.attach(target) first")
        if self.readout_q is not None:
            return self.readout_q(g)
        return F.linear(g, self.readout)

    def quantize(self, fmt: str = "q8_0") -> DraftHead:
        """Its products (fc, the layer's projections, the readout rows) stored in a weight format of
        quantization/, in place: a draft step reads a quarter of the bytes with q8_0 (what the kernels
        of `fast.install(head)` then multiply). Only the drafts can change, never what the target
        emits. For drafting: a quantized head is neither trained nor saved."""
        from .quantization.linear import QuantizedLinear

        for parent in (self, self.block.attn, self.block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    setattr(parent, name, QuantizedLinear.from_linear(child, fmt))
        self.readout_q = QuantizedLinear.from_weight(self.readout, fmt)
        return self


def save_draft_head(head: DraftHead, folder: str | Path, extra: dict | None = None) -> None:
    """folder/draft_head.safetensors (its own weights and vocab_ids) and folder/draft_head.json."""
    if head.readout_q is not None:
        raise ValueError("save the draft head before quantize(): its quantized layers are not saved")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in head.state_dict().items()}
    if head.vocab_ids is not None:
        tensors["vocab_ids"] = head.vocab_ids.cpu()
    save_file(tensors, str(folder / WEIGHTS_NAME))
    meta = {"d_model": head.config.d_model, "vocab_size": head.config.vocab_size,
            "draft_vocab_size": head.draft_vocab_size, **(extra or {})}  # fmt: skip
    (folder / CONFIG_NAME).write_text(json.dumps(meta, indent=1) + "\n")


def load_draft_head(folder: str | Path, target: TransformerLM, full_vocab: bool = False) -> DraftHead:
    """The head saved in folder, attached to target (ValueError, one line, if it does not fit)."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        hint = " (train one: python scripts/train_draft.py)" if folder == DEFAULT_HEAD_DIR else ""
        raise ValueError(f"{folder} holds no draft head ({CONFIG_NAME} and {WEIGHTS_NAME}){hint}")
    tensors = load_file(str(folder / WEIGHTS_NAME))
    vocab_ids = tensors.pop("vocab_ids", None)
    head = DraftHead(target.config, vocab_ids)
    want = {name: tuple(t.shape) for name, t in head.state_dict().items()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if want != got:
        raise ValueError(f"the draft head in {folder} does not fit this target (its tensors: {got})")
    head.load_state_dict(tensors)
    head = head.to(device=target.embed.weight.device, dtype=target.norm.weight.dtype)
    return head.attach(target, full_vocab)


class HeadDraft:
    """Drafting with a DraftHead: trees (or chains) of drafts from the target's features.

    Used by speculative_tree.tree_generate, which hands it the target's features of every position its
    cache gains (`observe`). Each round it first feeds the head the positions it has not seen with
    their true features (x_j, h_{j-1}), one head pass, whose last output g drafts the first tokens;
    then it drafts level by level down `shape` (a speculative_tree.TreeShape, or an int k for a chain),
    each level one head pass over the new nodes with their parents' g as features, attending to the
    head's cached context and to each node's own ancestors (a level below a branching goes in again
    with the nodes before it, so that no pass's input must miss a cached step). The head's cache then
    drops the nodes (the next round feeds the accepted ones again, with the target's features).
    `fast.install(head)` runs the passes' decoder layer in C (fast/step/head.py).

    adaptive: each round the depth of the tree is chosen by `speculative_tree.AdaptiveDepth` from the
    measured acceptance per depth and the measured cost of drafting and verifying each depth;
    depth 0 (no drafts: a plain decode step) is among the choices.
    lookup: prompt lookup first (speculative.prompt_lookup, n = 3 down to 2: LOOKUP_N): where the
    context's tail occurred before, the round drafts the tokens that followed it as a chain with
    one-hot p instead of the head's tree (a copy runs long, and a chain's verify pass is cheaper
    than a tree's): up to copy_depth of them (default: the shape's depth), or with `adaptive` as
    many as an AdaptiveDepth over chains chooses, one for each length n of the match (copying and
    the head succeed on different text, and a match of two tokens is weaker evidence of a copy than
    one of three; 0 leaves the round to the head). Where the context's last COPY_RUN tokens occurred
    before, a copy is under way and the round drafts all that followed them (up to copy_depth): copies
    come in runs, which the chooser's averages would follow only a level at a time. After a round whose
    copy was accepted whole, the next copy under way may draft twice as many, up to run_depth
    (default copy_depth): a long copy then takes fewer verify passes; a rejection brings the cap back
    to copy_depth. (A chain deeper than copy_depth is no choice of the copiers': not recorded.)
    gate: the head drafts only the nodes of `shape` whose path it is sure enough of
    (`speculative_tree.ConfidenceGate`: the product of its probabilities along the path against
    what a drafted node measurably costs), instead of a chosen depth (`adaptive` then chooses only
    the copies' lengths).
    `HeadDraft.auto(head)` is what `generate.py --draft head` runs.
    """

    reads_features = True

    def __init__(
        self,
        head: DraftHead,
        shape=4,
        adaptive: bool = False,
        lookup: bool = False,
        copy_depth: int | None = None,
        gate: bool = False,
        run_depth: int | None = None,
    ):
        from .speculative_tree import AdaptiveDepth, ConfidenceGate, TreeShape, as_shape

        self.head, self.shape, self.lookup = head, as_shape(shape), lookup
        self.copy_depth = self.shape.depth if copy_depth is None or not lookup else copy_depth
        if self.copy_depth < 1:
            raise ValueError(f"copy_depth must be >= 1, got {copy_depth}")
        self.run_depth = self.copy_depth if run_depth is None or not lookup else run_depth
        if self.run_depth < self.copy_depth:
            raise ValueError(f"run_depth must be >= copy_depth ({self.copy_depth}), got {run_depth}")
        self.max_depth = max(self.shape.depth, self.run_depth)
        self.max_nodes = len(self.shape) + (self.run_depth if lookup else 0)
        self.gate = ConfidenceGate() if gate else None
        self.adaptive = AdaptiveDepth(self.shape) if adaptive and not gate else None
        # with both, copying has choices of its own: how many of the tokens lookup found to draft,
        # for a match of n tokens (copiers[LOOKUP_N[0] - n])
        n_copiers = LOOKUP_N[0] - LOOKUP_N[1] + 1 if adaptive and lookup else 0
        self.copiers = [AdaptiveDepth(TreeShape.chain(self.copy_depth)) for _ in range(n_copiers)]
        self.choosers = [c for c in (self.adaptive, self.gate, *self.copiers) if c is not None]
        self.drafter = None
        self.model = None  # not a TransformerLM draft (speculative._check_args)

    @classmethod
    def auto(cls, head: DraftHead) -> HeadDraft:
        """The CLI's drafting: DEFAULT_TREE with adaptive depth, prompt lookup first, copies of up to
        8 tokens (a copy often runs longer than the head's drafts are worth; the copying chooser
        takes fewer where they are rejected), 16 for a copy under way that keeps being accepted.
        `benchmark.py speculative --drafts head-auto` measures it. (With the confidence gate instead
        of the adaptive depth it drafted more tokens a pass but was no faster on a 2-core CPU, where
        every node it adds costs the verify pass a row: docs/speculative.md.)"""
        from .speculative_tree import DEFAULT_TREE

        return cls(head, DEFAULT_TREE, adaptive=True, lookup=True, copy_depth=8, run_depth=16)

    def reset(self, capacity: int, spare: int) -> None:
        head = self.head
        self.cache = head.new_cache(capacity + spare)
        w = head.norm.weight
        self.feats = torch.empty(capacity + spare, head.config.d_model, dtype=w.dtype, device=w.device)
        self.known = 0  # features of positions 0 .. known - 1 are in self.feats
        self.fed = 0  # the head's cache holds positions 1 .. fed (position j at step j - 1)
        self.last_g: Tensor | None = None  # the head's output at position fed
        self.run_cap, self.copying = self.copy_depth, False  # a copy under way's drafts, at most
        for chooser in self.choosers:
            chooser.reset()

    def observe(self, h: Float[Tensor, "n D"]) -> None:
        self.feats[self.known : self.known + len(h)] = h.to(self.feats.dtype)
        self.known += len(h)

    def record(self, tree, path, draft_s: float, verify_s: float) -> None:
        """A round's outcome to the adaptive choice that made it; a round of plain decoding to both
        (each compares its depths with plain decoding's time). A copy under way accepted whole doubles
        the next one's cap (up to run_depth); one rejected sets it back to copy_depth."""
        if self.copying:
            whole = len(path) == len(tree)
            self.run_cap = min(2 * self.run_cap, self.run_depth) if whole else self.copy_depth
        if len(tree) == 1:
            for chooser in self.choosers:
                chooser.record(tree, path, draft_s, verify_s)
        elif self.drafter is not None and not (self.copying and len(tree) - 1 > self.copy_depth):
            self.drafter.record(tree, path, draft_s, verify_s)

    def _distribution(self, g: Tensor, params) -> Tensor:
        """The head's draft distribution over its vocabulary (the target's filters applied)."""
        from .speculative import sampling_probs

        logits = self.head.logits(g)
        if params.temperature == 0.0:
            return logits.float().softmax(-1)
        return sampling_probs(logits, params.temperature, params.top_k, params.top_p)

    @torch.inference_mode()
    def propose_tree(self, context: Int[Tensor, " S"], params, generator=None, budget: int | None = None):
        from .speculative_tree import DraftTree

        n, head, device = len(context), self.head, context.device
        budget = self.max_depth if budget is None else budget
        limit = min(budget, self.shape.depth)
        if self.known != n - 1:
            raise ValueError(f"the head has the features of {self.known} positions, expected {n - 1}")
        root = DraftTree(context[-1:], torch.tensor([-1], device=device))
        self.drafter = None  # which choice this round's drafts came from (record)
        self.copying = False  # whether this round drafts a copy under way
        if budget <= 0 or n < 2:
            return root
        if self.lookup:
            from .speculative import prompt_lookup

            tail, found, k = context.tolist(), [], min(budget, self.copy_depth)
            for match in range(LOOKUP_N[0], LOOKUP_N[1] - 1, -1):  # the longest match wins
                found = prompt_lookup(tail, k, match, match)
                if found:
                    break
            if found and match == LOOKUP_N[0]:  # a copy under way drafts all that followed its run
                run = prompt_lookup(tail, min(budget, self.run_cap), COPY_RUN, COPY_RUN)
                found, self.copying = run or found, bool(run)
            if found and self.copiers:
                self.drafter = self.copiers[LOOKUP_N[0] - match]
                if not self.copying:
                    found = found[: self.drafter.choose()]
            if found:  # the continuation alone, a chain of deterministic drafts (p one-hot)
                chain = torch.tensor([int(context[-1]), *found], device=device)
                p = None
                if params.temperature != 0.0:
                    p = torch.zeros(len(chain), head.config.vocab_size, device=device)
                    p[torch.arange(len(found)), chain[1:]] = 1.0
                return DraftTree(chain, torch.arange(-1, len(found), device=device), p)
        depth = limit
        if self.adaptive is not None:
            depth, self.drafter = min(limit, self.adaptive.choose()), self.adaptive
        if self.gate is not None:
            if self.gate.tau > 1.0:  # no node could pass (plain decoding not timed yet)
                return root
            self.drafter = self.gate
        return root if depth == 0 else self._head_tree(context, params, generator, depth)

    @torch.inference_mode()
    def catch_up(self, context: Int[Tensor, " S"]) -> Float[Tensor, " D"]:
        """Feed the head the positions it has not seen (fed + 1 .. S - 1, each with the target's
        features of the position before); returns g of the last one. speculative_tree calls it after
        the prompt's prefill, so that the first round that drafts does not pay for reading the prompt
        (which would make drafting look slow to the adaptive depth)."""
        n = len(context)
        if self.known != n - 1:
            raise ValueError(f"the head has the features of {self.known} positions, expected {n - 1}")
        self.cache.truncate(self.fed)
        if self.fed == n - 1:  # nothing new: the last g is kept
            return self.last_g
        g = self.head(context[None, self.fed + 1 : n], self.feats[None, self.fed : n - 1], cache=self.cache)
        self.fed, self.last_g = n - 1, g[0, -1]
        return self.last_g

    def _head_tree(self, context, params, generator, depth: int):
        from .speculative_tree import draw_children, tree_mask

        n, head, device = len(context), self.head, context.device
        shape = self.shape.cut(depth)
        greedy = params.temperature == 0.0
        g = self.catch_up(context)
        T = len(shape)
        tokens = torch.zeros(T, dtype=torch.long, device=device)
        tokens[0] = context[-1]
        probs = None if greedy else torch.zeros(T, head.config.vocab_size, device=device)
        gs = {0: g}
        drawn = [True] + [False] * (T - 1)
        sure = [1.0] * T  # the gate's P(node): its path's draft probabilities multiplied
        tau = self.gate.tau if self.gate is not None else 0.0
        ancestors = tree_mask(torch.tensor(shape.parents, device=device))
        fed_nodes: list[int] = []  # tree nodes in the head's cache, in order (after its n - 1 context steps)
        level = [0]
        for _ in range(depth):
            new = []
            for i in level:
                if not shape.kids[i] or not drawn[i]:
                    continue
                p = self._distribution(gs[i], params)
                kids = shape.kids[i]
                if self.gate is not None:  # rank r's chance: the r-th largest p (known before drawing)
                    top = (sure[i] * p.topk(len(kids)).values).tolist()
                    kids = [c for c, s in zip(kids, top, strict=True) if s >= tau]
                    for c, s in zip(kids, top, strict=False):
                        sure[c] = s
                    if not kids:
                        continue
                picks = head.token_ids(draw_children(p, len(kids), greedy, generator))
                if probs is not None:
                    probs[i, head.token_ids(torch.arange(len(p), device=device))] = p
                children = kids[: len(picks)]
                tokens[children] = picks
                for child in children:
                    drawn[child] = True
                new += children
            if not any(shape.kids[c] for c in new):
                break
            # one head pass over the new nodes: their parents' g as features, ancestors visible. Where
            # a node fed before is not an ancestor of every new one, the pass feeds the level again
            # with the nodes before it (their K/V once more), so that a pass's inputs see every step
            # before it: the form the native layer runs (fast/step/head.py)
            feed = new
            if not bool(ancestors[new][:, fed_nodes].all()):
                self.cache.truncate(self.fed)
                feed, fed_nodes = fed_nodes + new, []
            feats = torch.stack([gs[shape.parents[c]] for c in feed])[None]
            depth_of = torch.tensor([len(shape.nodes[c]) - 1 for c in feed], device=device)
            start = self.cache.pos  # nodes go after the context steps and the nodes fed before
            out = head(tokens[feed][None], feats, cache=self.cache, depth=depth_of + (n - 1 - start),
                       tree=ancestors[feed][:, fed_nodes + feed], tree_start=n - 1)[0]  # fmt: skip
            gs.update(zip(new, out[len(feed) - len(new) :], strict=True))
            fed_nodes += feed
            level = new
        self.cache.truncate(self.fed)
        return shape.drafted(tokens, drawn, probs)

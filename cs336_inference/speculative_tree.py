"""Tree speculation: the draft proposes a tree of continuations, the target checks every node at once.

A chain of k drafts dies at its first wrong token. A tree keeps several candidates at each depth, so
a round survives a wrong first guess when the second is right; the target still runs one pass.

    tree       node 0 is the root, the newest context token (not a draft); node i > 0 is a drafted
               token whose parent is parents[i] < i. Children of a node are drafted in node order.
    verify     ONE target pass over all T nodes: node i sits at position start + depth[i] and attends
               to the cached context and to its own ancestors only (`tree_mask`), never to its
               siblings or cousins; its K/V land at cache step start + i
    accept     walk down from the root: at each node the target's distribution q decides which child,
               if any, is accepted (greedy: the child equal to the argmax; sampled: children tried
               one after another, each accepted with probability min(1, q(x)/p(x)), q replaced by the
               residual max(q - p, 0) normalised and x struck from p after each rejection); the walk
               ends with one token drawn from the final q
    keep       the cache keeps the accepted path's K/V, moved to steps start, start + 1, ...
               (`keep_path`), and forgets the rest

Sampled children must be drawn from p one after another without replacement (torch.multinomial(p,
m, replacement=False) does exactly that), which is what makes the walk an exact sample of the target.
A chain is the tree whose nodes each have one child: the verify is then speculative.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from .kv_cache import KVCache, StaticKVCache
from .model import TransformerLM
from .nucleus import sample_row
from .sampling import SamplingParams, sampling_params
from .speculative import SpeculativeStats, _check_args, round_generator, sampling_probs


@dataclass
class DraftTree:
    """T nodes: tokens[0] the root (the newest context token), parents[0] = -1, parents[i] < i.

    probs[i]: the draft distribution node i's children were drawn from (sampled drafting), or None
    (greedy drafting: children are the draft's top choices, p one-hot for the accept step).
    """

    tokens: Int[Tensor, " T"]
    parents: Int[Tensor, " T"]
    probs: Float[Tensor, "T V"] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


def tree_depths(parents: Int[Tensor, " T"]) -> Int[Tensor, " T"]:
    """depth[i] = number of ancestors of node i (the root has depth 0)."""
    depth = torch.zeros_like(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def children_of(parents: Int[Tensor, " T"]) -> list[list[int]]:
    """children[i]: node i's children, in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents))]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


def tree_mask(parents: Int[Tensor, " T"]) -> Bool[Tensor, "T T"]:
    """mask[i, j] = True iff node j is node i itself or one of its ancestors.

    parents[0] = -1 (the root), parents[i] < i otherwise. Row i is what node i may attend to among
    the tree's nodes: the path from the root down to i, and nothing else.
    """
    # BEGIN SOLUTION tree_verify
    T = len(parents)
    mask = torch.eye(T, dtype=torch.bool, device=parents.device)
    for i in range(1, T):
        mask[i] |= mask[int(parents[i])]
    return mask
    # END SOLUTION


def keep_path(cache: KVCache, start: int, path: Sequence[int]) -> None:
    """Keep the accepted path's K/V: node path[m], written at step start + path[m] by the verify pass,
    moves to step start + m (m = 0 .. len(path) - 1), and the cache is truncated to start + len(path).

    path[0] = 0 is the root and path[m] > path[m - 1]. Every layer's store is a StaticKVCache
    (`k`, `v`: [B, K, S, H]); CLA layers without a store (None) are skipped.
    """
    # BEGIN SOLUTION tree_verify
    src = torch.tensor(list(path), dtype=torch.long) + start
    for store in cache.layers:
        if store is None:
            continue
        for t in (store.k, store.v):
            t[:, :, start : start + len(path)] = t[:, :, src.to(t.device)]
    cache.truncate(start + len(path))
    # END SOLUTION


def check_tree_cache(cache: KVCache) -> None:
    """ValueError unless every store is a StaticKVCache (tree verification moves K/V by step)."""
    for i, store in enumerate(cache.layers):
        if store is not None and not isinstance(store, StaticKVCache):
            raise ValueError(
                f"tree verification needs full-attention static caches; layer {i} has a "
                f"{type(store).__name__} (sliding-window rings and MLA latents are not supported)"
            )


def tree_forward(
    model: TransformerLM,
    cache: KVCache,
    tree: DraftTree,
    return_hidden: bool = False,
):
    """The target's logits [T, V] for every node (and its features [T, D] with return_hidden): one
    pass over the tree, node i at position cache.pos + depth[i], K/V written at step cache.pos + i,
    attending to the cache and to its ancestors. cache.pos advances by T (keep_path then rolls back)."""
    ids = tree.tokens[None]
    T, start = len(tree), cache.pos
    if start + T > cache.capacity:
        raise ValueError(f"KV cache full: {start} + {T} tree nodes > capacity {cache.capacity}")
    steps = torch.arange(start, start + T, device=ids.device)
    positions = start + tree_depths(tree.parents).to(ids.device)
    ctx = model.context(steps, start, positions[None], pad=cache.pad, cache=cache,
                        tree=tree_mask(tree.parents).to(ids.device), tree_start=start)  # fmt: skip
    x = model.embed_tokens(ids)
    for block in model.layers:
        x = block(x, ctx)
    cache.pos = start + T
    h = model.norm(x)[0]
    logits = F.linear(h, model.vocab_weight)
    return (logits, h) if return_hidden else logits


def accept_tree(
    tree: DraftTree,
    logits: Float[Tensor, "T V"],
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[list[int], Int[Tensor, " 1"]]:
    """Walk the tree with the target's logits; returns (path: accepted nodes from the root, the token
    drawn after the path's last node).

    Greedy (temperature 0): follow the child whose token is the target's argmax while there is one;
    the token added is the argmax at the last node. Sampled: at each node with target distribution q
    (`sampling_probs` with the settings) and draft distribution p = tree.probs[node], try its children
    in node order: child x is accepted with probability min(1, q(x) / p(x)) (then walk on from it);
    after a rejection q becomes max(q - p, 0) normalised (q itself if that is all zeros) and p loses x
    (renormalised). When no child is accepted the token is drawn from q. Draws from `generator`: one
    uniform (torch.rand(1)) per child tried, then one torch.multinomial(q, 1).
    """
    # BEGIN SOLUTION tree_verify
    kids = children_of(tree.parents)
    node, path = 0, [0]
    if params.temperature == 0.0:
        best = logits.float().argmax(dim=-1)
        while True:
            nxt = [c for c in kids[node] if int(tree.tokens[c]) == int(best[node])]
            if not nxt:
                return path, best[node : node + 1]
            node = nxt[0]
            path.append(node)
    while True:
        q = sampling_probs(logits[node], params.temperature, params.top_k, params.top_p)
        p = tree.probs[node].float().clone() if kids[node] else None
        accepted = None
        for c in kids[node]:
            x = int(tree.tokens[c])
            u = torch.rand(1, generator=generator, device=q.device)
            if float(u) < min(1.0, float(q[x]) / float(p[x])) if p[x] > 0 else q[x] > 0:
                accepted = c
                break
            residual = (q - p).clamp(min=0.0)
            q = residual / residual.sum() if residual.sum() > 0 else q
            p[x] = 0.0
            p = p / p.sum() if p.sum() > 0 else p
        if accepted is None:
            return path, torch.multinomial(q, 1, generator=generator)
        node = accepted
        path.append(node)
    # END SOLUTION


def verify_tree(
    target,
    cache: KVCache,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    features: bool = False,
) -> tuple[Int[Tensor, " n"], list[int], Tensor | None]:
    """One round's target pass over a tree: returns (the n tokens it emits: the accepted drafts and
    one more, the accepted path, the path's features [n, D] if `features`, else None).

    `cache` holds every context token but the root. `target` is a TransformerLM (`tree_forward`) or
    anything with a `tree(cache, tree, return_hidden)` method (the fast path's fixed-shape steps).
    """
    start = cache.pos
    if hasattr(target, "tree"):
        out = target.tree(cache, tree, features)
    else:
        out = tree_forward(target, cache, tree, features)
    logits, h = out if features else (out, None)
    path, token = accept_tree(tree, logits, params, generator)
    if path == list(range(len(path))):  # a prefix of the nodes (a chain, a root alone): already in place
        cache.truncate(start + len(path))
    else:
        keep_path(cache, start, path)
    new = torch.cat([tree.tokens[path[1:]], token.to(tree.tokens.device)])
    return new, path, (None if h is None else h[path])


# ------------------------------------------------------------------ tree shapes and drafts
class TreeShape:
    """A static tree of drafts written as Medusa's "choices": node (0, 1) is the second child (rank 1)
    of the root's first child. The root () is implied. Every node's parent must be there, and rank r
    only with ranks 0 .. r - 1 beside it (children are the draft's first choices, so that sampled
    drafting can draw them one after another). `nodes` is in tree order: by depth, then by ranks."""

    def __init__(self, choices: Sequence[Sequence[int]]):
        nodes = sorted({tuple(int(r) for r in c) for c in choices} - {()}, key=lambda c: (len(c), c))
        have = set(nodes) | {()}
        for c in nodes:
            if min(c) < 0 or c[:-1] not in have or (c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in have):
                raise ValueError(f"tree node {c} needs its parent and its lower-ranked siblings in the tree")
        self.nodes = [(), *nodes]
        index = {c: i for i, c in enumerate(self.nodes)}
        self.parents = [-1] + [index[c[:-1]] for c in nodes]
        self.kids = children_of(torch.tensor(self.parents))  # kids[i][r]: node i's child of rank r
        self.depth = max((len(c) for c in self.nodes), default=0)

    @classmethod
    def chain(cls, k: int) -> TreeShape:
        """k drafts in a row: speculative.py's round as a tree."""
        return cls([(0,) * d for d in range(1, k + 1)])

    def cut(self, depth: int) -> TreeShape:
        """The nodes of depth <= depth."""
        return TreeShape([c for c in self.nodes if len(c) <= depth])

    def children(self, node: int) -> int:
        return len(self.kids[node])

    def drafted(self, tokens: Tensor, drawn: list[bool], probs: Tensor | None) -> DraftTree:
        """The DraftTree of this shape's nodes that were drawn (sampling may draw fewer children than
        the shape has: p has fewer non-zero entries), numbered again in order."""
        keep = [i for i, d in enumerate(drawn) if d]  # parents come first, so ancestors are kept
        remap = {old: new for new, old in enumerate(keep)}
        parents = [-1] + [remap[self.parents[i]] for i in keep[1:]]
        return DraftTree(tokens[keep], torch.tensor(parents, device=tokens.device),
                         None if probs is None else probs[keep])  # fmt: skip

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"TreeShape({self.nodes[1:]})"


# the default tree: three candidates for the next token, two for the one after the best, and the best
# path to depth 5 (small: on a CPU every node adds to the verify pass, docs/speculative.md)
DEFAULT_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)]


def as_shape(shape) -> TreeShape:
    """A TreeShape, from one, a list of choices, or an int k (a chain of k)."""
    if isinstance(shape, TreeShape):
        return shape
    if isinstance(shape, int):
        return TreeShape.chain(shape)
    return TreeShape(shape)


def draw_children(p: Float[Tensor, " V"], m: int, greedy: bool, generator=None) -> Int[Tensor, " m"]:
    """m distinct children from the draft distribution p: its top m when greedy, else drawn one after
    another without replacement (at most as many as p has non-zero entries)."""
    if greedy:
        return p.topk(m).indices
    return torch.multinomial(p, min(m, int((p > 0).sum())), replacement=False, generator=generator)


class ModelTreeDraft:
    """A TransformerLM drafting the nodes of a TreeShape level by level. The readable reference
    drafter: it runs the draft on the whole context plus each node's path (no cache), so it is for
    tests and small models."""

    def __init__(self, model: TransformerLM, shape):
        self.model, self.shape = model, as_shape(shape)
        self.max_depth, self.max_nodes = self.shape.depth, len(self.shape)

    def reset(self, capacity: int, spare: int) -> None:
        pass

    @torch.inference_mode()
    def propose_tree(self, context: Int[Tensor, " S"], params: SamplingParams, generator=None,
                     budget: int | None = None) -> DraftTree:  # fmt: skip
        shape = self.shape if budget is None or budget >= self.shape.depth else self.shape.cut(budget)
        greedy, V, device = params.temperature == 0.0, self.model.config.vocab_size, context.device
        tokens = torch.zeros(len(shape), dtype=torch.long, device=device)
        tokens[0] = context[-1]
        probs = torch.zeros(len(shape), V, device=device)
        drawn = [True] + [False] * (len(shape) - 1)
        for i, path in enumerate(shape.nodes):  # path: ranks from the root; node i's ancestors first
            if not shape.kids[i] or not drawn[i]:
                continue
            ancestors = [shape.nodes.index(path[:d]) for d in range(1, len(path) + 1)]
            logits = self.model(torch.cat([context, tokens[ancestors]])[None])[0, -1]
            if greedy:
                p = logits.float().softmax(-1)
            else:
                p = sampling_probs(logits, params.temperature, params.top_k, params.top_p)
            probs[i] = p
            picks = draw_children(p, len(shape.kids[i]), greedy, generator)
            for child, x in zip(shape.kids[i], picks.tolist(), strict=False):
                tokens[child], drawn[child] = x, True
        return shape.drafted(tokens, drawn, None if greedy else probs)


# ------------------------------------------------------------------ choosing the depth
class AdaptiveDepth:
    """Each round's tree depth d (0 .. the shape's depth; 0: no drafts, a plain decode step), chosen to
    maximise the expected tokens per second from what the rounds so far measured:

        a_e          acceptance at depth e: of the rounds whose walk reached depth e - 1 with a node
                     of depth e to try, the share that accepted one (decayed, so it follows the text);
                     a depth no round has reached takes the deepest reached one's (the geometric
                     guess of the chain formula), so a choice that keeps being accepted climbs
        E[d]         1 + sum_{e <= d} a_1 ... a_e       (expected tokens a round of depth d emits)
        t[d]         measured seconds of a round of depth d (drafting + verifying), an average that
                     forgets; a depth not measured yet is extrapolated from the nearest measured one
        d            argmax E[d] / t[d]

    A depth above 0 is chosen only when its rate beats plain decoding's by `margin` (measured times
    are noisy, and a draft that barely pays is not worth the risk). The first round is plain
    decoding, to time it. After that, every `explore` rounds a depth beside the best is tried, so
    that the figures of the depths around it stay current (a depth never run keeps its old time):
    one above after a change, else below and above in turns. While explorations change nothing,
    each waits twice as long as the one before (up to 8 x `explore` rounds): on text the head
    cannot follow, every exploration is a lost pass. The times leave out building a pass of a new
    size (`_tree_rounds` has the target prepare it first), which would make a depth tried once look
    slow.
    """

    def __init__(self, shape: TreeShape, explore: int = 16, decay: float = 0.95, margin: float = 0.05):
        self.shape, self.explore, self.decay, self.margin = shape, explore, decay, margin
        D = shape.depth
        self.nodes = [len(shape.cut(d)) for d in range(D + 1)]
        self.reached = [0.0] + [2.0] * D  # a prior of 0.6 accepts in two tries at every depth
        self.accepted = [0.0] + [0.6] * D
        self.seen = [False] * (D + 1)  # whether any round has reached depth e - 1 with a node of depth e
        self.seconds: list[float | None] = [None] * (D + 1)
        self.reset()

    def reset(self) -> None:
        self.rounds = self.last_explore = self.unchanged = 0
        self.period, self.explored = self.explore, None

    def expected_tokens(self) -> list[float]:
        out, run, total, a = [1.0], 1.0, 1.0, None
        for e in range(1, self.shape.depth + 1):
            # a level no round has reached yet: as likely as the deepest one reached (else the prior)
            a = self.accepted[e] / self.reached[e] if self.seen[e] or a is None else a
            run *= a
            total += run
            out.append(total)
        return out

    def round_seconds(self) -> list[float]:
        known = [(d, s) for d, s in enumerate(self.seconds) if s is not None]
        if not known:
            return [1.0 + 0.05 * (n - 1) + 0.05 * d for d, n in enumerate(self.nodes)]
        out = []
        for d, n in enumerate(self.nodes):
            if self.seconds[d] is not None:
                out.append(self.seconds[d])
                continue
            near, s = min(known, key=lambda ds: abs(ds[0] - d))
            out.append(s * (1.0 + 0.05 * (n - self.nodes[near]) + 0.05 * (d - near)))
        return out

    def choose(self) -> int:
        self.rounds += 1
        if self.seconds[0] is None:  # plain decoding's own time first, the yardstick of every other depth
            return 0
        rate = [e / t for e, t in zip(self.expected_tokens(), self.round_seconds(), strict=True)]
        best = max(range(len(rate)), key=rate.__getitem__)
        if rate[best] < (1.0 + self.margin) * rate[0]:
            best = 0
        if self.explored is not None:  # an exploration that changed nothing waits twice as long for the next
            same = best == self.explored
            self.period = min(2 * self.period, 8 * self.explore) if same else self.explore
            self.unchanged = self.unchanged + 1 if same else 0
            self.explored = None
        if self.rounds - self.last_explore >= self.period:
            self.last_explore, self.explored = self.rounds, best
            below = self.unchanged % 2 == 1 and best > 0  # above first: a choice that moved may go on
            if below or best < self.shape.depth:
                return best - 1 if below else best + 1
        return best

    def record(self, tree: DraftTree, path: list[int], draft_s: float, verify_s: float) -> None:
        depths = tree_depths(tree.parents)
        d = int(depths.max())
        reach = int(depths[path[-1]])
        for e in range(1, d + 1):
            self.reached[e] *= self.decay
            self.accepted[e] *= self.decay
            if reach >= e - 1:
                self.seen[e] = True
                self.reached[e] += 1.0
                self.accepted[e] += float(reach >= e)
        s = draft_s + verify_s
        old = self.seconds[d]
        self.seconds[d] = s if old is None else 0.8 * old + 0.2 * s


class ConfidenceGate:
    """Which nodes of a tree to draft this round, from the draft's own confidence (EAGLE-2's idea):
    a node is drafted when the chance that the target accepts its whole path is worth what the node
    costs. With P(node) the product of the draft's probabilities along the node's path,

        t0      measured seconds of a plain round (no drafts), an average that forgets
        m       measured seconds each drafted node adds to a round (drafting and verifying)
        tau     m / t0
        draft the node  iff  P(node) >= tau    (an accepted node saves a plain step, t0)

    So a round drafts deep where the draft is sure and not at all where it is not, instead of the same
    depth every round. P uses, for a child of rank r, the r-th largest probability of its parent's
    draft distribution, read before any child is drawn: the shape never depends on a drawn token's
    own value, so sampled verification stays exact. The first round is plain decoding, to time t0.
    """

    def __init__(self, prior: float = 0.1, decay: float = 0.8):
        self.prior, self.decay = prior, decay  # prior: m / t0 until a drafted round is measured
        self.plain: float | None = None  # t0
        self.per_node: float | None = None  # m

    def reset(self) -> None:  # the measured times carry over from one generation to the next
        pass

    @property
    def tau(self) -> float:
        if self.plain is None:
            return float("inf")  # nothing drafted before plain decoding is timed
        return self.prior if self.per_node is None else self.per_node / self.plain

    def record(self, tree: DraftTree, path: list[int], draft_s: float, verify_s: float) -> None:
        s, n = draft_s + verify_s, len(tree) - 1
        forget = lambda old, new: new if old is None else self.decay * old + (1 - self.decay) * new  # noqa: E731
        if n == 0:
            self.plain = forget(self.plain, s)
        elif self.plain is not None:
            self.per_node = forget(self.per_node, max(s - self.plain, 0.0) / n)


# ------------------------------------------------------------------ the loop
def prompt_features(
    target: TransformerLM, ids: Int[Tensor, " P"], cache: KVCache
) -> tuple[Float[Tensor, "1 V"], Float[Tensor, "P D"]]:
    """The prompt's prefill into cache: the last position's logits and the features of every position
    (the final norm's output). A hook keeps the last block's output, which `last_only` would cut to
    one row before the norm: the features `target(..., return_hidden=True)` gives, without the P - 1
    rows of the output product it would compute and throw away (for SmolLM2 each row reads 49,152 x
    576 weights)."""
    kept = []
    hook = target.layers[-1].register_forward_hook(lambda module, args, out: kept.append(out))
    try:
        logits = target(ids[None], cache=cache, last_only=True)
    finally:
        hook.remove()
    return logits[0], target.norm(kept[0])[0]


def tree_stream(
    target: TransformerLM,
    draft,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int = 64,
    params: SamplingParams | None = None,
    stats: SpeculativeStats | None = None,
    steps=None,
    **settings,
) -> Iterator[int]:
    """Yield new token ids as tree rounds emit them (a stop token is yielded, then it ends).

    draft: an object with max_depth, max_nodes (its deepest and largest tree, root included),
    reset(capacity, spare) and propose_tree(context, params, generator, budget) -> DraftTree of depth
    <= budget (`ModelTreeDraft`, draft_head.HeadDraft); if it reads the target's features it has
    `reads_features = True` and `observe(h)`, given the features of every position the target's cache
    gains, and may have `catch_up(context)`, called once after the prompt's prefill. steps: a
    fast-path object giving the target's tree passes (optional).
    """
    params = sampling_params(params, max_new_tokens=max_new_tokens, **settings)
    ids = _check_args(target, draft, prompt_ids, int(params.max_new_tokens), draft.max_nodes)
    stats = SpeculativeStats(k=draft.max_depth) if stats is None else stats
    return _tree_rounds(target, draft, ids, params, stats, steps)


@torch.inference_mode()
def _tree_rounds(target, draft, ids, params: SamplingParams, stats, steps) -> Iterator[int]:
    P, device = len(ids), ids.device
    max_new_tokens, stops = int(params.max_new_tokens), set(params.stops(target.config))
    generator = round_generator(params, device)
    capacity = P + max_new_tokens
    spare = draft.max_nodes
    if steps is None:
        cache = target.new_cache(1, min(capacity + spare, target.config.max_seq_len))
        runner = target
    else:
        runner, cache = steps.tree_target(target, capacity + spare)
    check_tree_cache(cache)
    features = getattr(draft, "reads_features", False)
    draft.reset(capacity, spare)
    stats.caches["target"] = cache
    # the prompt's prefill gives the first token, as generate's does: a first round would spend a
    # target pass on the newest prompt token (a root alone whenever the adaptive depth drafts nothing)
    if hasattr(runner, "prefill"):  # fixed-shape steps prefill their own way (native: in passes of rows)
        logits, h = runner.prefill(ids)
        if features:
            draft.observe(h)
    elif features:
        logits, h = prompt_features(target, ids, cache)
        draft.observe(h)
    else:
        logits = target(ids[None], cache=cache, last_only=True)[0]
    first = sample_row(logits[-1:], params.temperature, params.top_k, params.top_p, generator)
    context = torch.empty(capacity, dtype=torch.long, device=device)
    context[:P] = ids
    context[P] = first
    n = P + 1
    stats.prefill_tokens = 1
    if (yield from stats.emit(first, stops)):
        return
    if hasattr(draft, "catch_up"):  # a trained head reads the prompt now, not in the first round that drafts
        draft.catch_up(context[:n])
    while n - P < max_new_tokens:
        budget = max_new_tokens - (n - P) - 1  # never draft past max_new_tokens
        began = time.perf_counter()
        tree = draft.propose_tree(context[:n], params, generator, budget)
        drafted_s = time.perf_counter() - began
        if hasattr(runner, "prepare"):  # a pass of a new size is built outside the timed verify
            runner.prepare(len(tree))
        began = time.perf_counter()
        new, path, h = verify_tree(runner, cache, tree, params, generator, features)
        verify_s = time.perf_counter() - began
        stats.draft_seconds += drafted_s
        stats.verify_seconds += verify_s
        if hasattr(draft, "record"):
            draft.record(tree, path, drafted_s, verify_s)
        if features:
            draft.observe(h)
        # the walk ended at a rejection when its last node has children (else: a bonus token)
        stats.count_round(len(tree) - 1, len(new), rejected=bool(children_of(tree.parents)[path[-1]]))
        context[n : n + len(new)] = new
        n += len(new)
        if (yield from stats.emit(new, stops)):
            return


def tree_generate(
    target: TransformerLM,
    draft,
    prompt_ids: Tensor | Sequence[int],
    max_new_tokens: int = 64,
    return_stats: bool = False,
    steps=None,
    params: SamplingParams | None = None,
    **settings,
):
    """Generate with tree speculation (see the module doc): the same tokens as `generate(target, ...)`
    when greedy, an exact sample of it when sampling. Settings as generate's (temperature, top_k,
    top_p, seed, stop_token_ids) or one SamplingParams (params=). Returns a 1-D LongTensor, and with
    return_stats=True also a SpeculativeStats (drafted counts every tree node but the root)."""
    stats = SpeculativeStats(k=0)
    stream = tree_stream(target, draft, prompt_ids, max_new_tokens, params, stats, steps, **settings)
    out = torch.tensor(list(stream), dtype=torch.long, device=target.embed.weight.device)
    return (out, stats) if return_stats else out

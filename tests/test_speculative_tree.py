"""Tree speculation and the trained draft head: the tree mask, the accepted path's cache, the walk.

Exactness by the same two means as test_speculative.py: greedy tree decoding must equal `generate`
token for token (with the target's cache equal to a fresh prefill of the accepted tokens after the
run), and sampled tree decoding must pass chi-square tests of its output distribution, each with a
negative control (a known-wrong walk) that the same test rejects.
"""

import math

import pytest
import torch

from cs336_inference import speculative_tree as st
from cs336_inference.config import ModelConfig
from cs336_inference.draft_head import DraftHead, HeadDraft, load_draft_head, save_draft_head
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import SamplingParams, generate
from cs336_inference.speculative_tree import (
    DraftTree,
    ModelTreeDraft,
    TreeShape,
    accept_tree,
    draw_children,
    keep_path,
    tree_forward,
    tree_generate,
    tree_mask,
)
from tests.test_speculative import (
    P_MIN,
    check_cache_holds,
    check_tokens,
    chi_square_pvalue,
    e2e_models,
    perturbed,
    prompt,
    target_joint,
    tiny_model,
)

SMALL_TREE = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


# ------------------------------------------------------------------ graded: tree_verify
@pytest.mark.graded(problem="tree_verify", points=2)
@pytest.mark.parametrize(
    "parents,rows",
    [
        ([-1], ["1"]),
        ([-1, 0, 1, 2], ["1000", "1100", "1110", "1111"]),  # a chain: causal
        ([-1, 0, 0, 1, 1, 2], ["100000", "110000", "101000", "110100", "110010", "101001"]),
        ([-1, 0, 1, 0, 3, 1], ["100000", "110000", "111000", "100100", "100110", "110001"]),
    ],
    ids=["root", "chain", "binary", "interleaved"],
)
def test_tree_mask(parents, rows):
    got = tree_mask(torch.tensor(parents))
    want = torch.tensor([[c == "1" for c in row] for row in rows])
    assert got.dtype == torch.bool and got.shape == want.shape, (
        f"parents {parents}: expected a bool [{len(rows)}, {len(rows)}] mask, got {got.dtype} {tuple(got.shape)}"
    )
    wrong = (got != want).nonzero().tolist()
    assert not wrong, (
        f"parents {parents}: node {wrong[0][0]} sees node {wrong[0][1]}: {bool(got[tuple(wrong[0])])}, "
        f"expected {bool(want[tuple(wrong[0])])} (a node sees itself and its ancestors only)"
    )


@pytest.mark.graded(problem="tree_verify", points=3)
@pytest.mark.parametrize("variant,path", [("gqa", [0, 2, 4]), ("mha", [0, 1, 3, 6]), ("cla", [0, 5])])
def test_keep_path_leaves_the_accepted_path(variant, path):
    """After a tree pass and keep_path, the cache equals a fresh prefill of context + the path's tokens."""
    target = tiny_model(variant)
    context = prompt(11, 3)
    cache = target.new_cache(1, 40)
    target(context[None, :-1], cache=cache)
    tree = DraftTree(
        torch.tensor([int(context[-1]), 5, 9, 17, 33, 2, 40]), torch.tensor([-1, 0, 0, 1, 2, 0, 3])
    )
    tree_forward(target, cache, tree)
    keep_path(cache, len(context) - 1, path)
    kept = torch.cat([context[:-1], tree.tokens[path]])
    check_cache_holds(f"{variant}, path {path}", target, cache, kept, spare=0)


def _logits(rows):
    return torch.tensor(rows, dtype=torch.float)


@pytest.mark.graded(problem="tree_verify", points=2)
def test_accept_tree_greedy():
    greedy = SamplingParams(temperature=0.0)
    V = 6
    # node: 0 root, 1 (tok 3) and 2 (tok 4) children of the root, 3 (tok 1) child of 2, 4 (tok 5) child of 3
    tree = DraftTree(torch.tensor([0, 3, 4, 1, 5]), torch.tensor([-1, 0, 0, 2, 3]))

    def argmax_rows(best):
        out = torch.zeros(len(best), V)
        for i, b in enumerate(best):
            out[i, b] = 5.0
        return out

    cases = [
        ([4, 0, 1, 5, 2], [0, 2, 3, 4], 2, "the second child, then down to the leaf, then the bonus"),
        ([3, 2, 1, 5, 2], [0, 1], 2, "the first child, a leaf: its argmax is the bonus"),
        ([2, 0, 0, 0, 0], [0], 2, "no child is the argmax: the argmax itself"),
        ([4, 0, 0, 0, 0], [0, 2], 0, "the second child, then its child is wrong"),
    ]
    for best, path, token, what in cases:
        got_path, got_token = accept_tree(tree, argmax_rows(best), greedy)
        assert list(got_path) == path and int(got_token[0]) == token, (
            f"{what}: target argmax per node {best}: expected path {path} then token {token}, "
            f"got {list(got_path)} then {int(got_token[0])}"
        )


def _first_token_counts(q, p, m, n_draws, walk=accept_tree, seed=0):
    """Frequencies of the first token one round emits: the root's m children drawn from p without
    replacement, q the target's distribution at the root, children with no children of their own."""
    V = len(q)
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(V)
    logits = torch.log(q.clamp(min=1e-30)).expand(m + 1, V).clone()
    for _ in range(n_draws):
        kids = draw_children(p, m, False, g)
        tree = DraftTree(torch.cat([torch.tensor([0]), kids]), torch.tensor([-1] + [0] * len(kids)),
                         p.expand(len(kids) + 1, V).clone())  # fmt: skip
        path, token = walk(tree, logits, params, g)
        first = int(tree.tokens[path[1]]) if len(path) > 1 else int(token[0])
        counts[first] += 1
    return counts


CASES = {
    "lecture_AB": (torch.tensor([0.3, 0.7]), torch.tensor([0.5, 0.5]), 2),
    "three_of_five": (
        torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15]),
        torch.tensor([0.5, 0.05, 0.3, 0.05, 0.1]),
        3,
    ),
    "q_zero_where_p_positive": (torch.tensor([0.0, 0.6, 0.4, 0.0]), torch.tensor([0.4, 0.2, 0.1, 0.3]), 2),
}


@pytest.mark.graded(problem="tree_verify", points=3)
@pytest.mark.costly(seconds=2)
@pytest.mark.parametrize("case", list(CASES))
def test_accept_tree_sampled_follows_target(case):
    q, p, m = CASES[case]
    n = 20_000
    counts = _first_token_counts(q, p, m, n)
    stat, pvalue = chi_square_pvalue(counts, q)
    assert pvalue > P_MIN, (
        f"{case}: {m} children drawn from p = {p.tolist()} without replacement; the first emitted token's "
        f"frequencies {(counts / n).tolist()} should follow q = {q.tolist()} (chi-square {stat:.1f}, "
        f"p-value {pvalue:.1e}, {n} rounds)"
    )


@pytest.mark.graded(problem="tree_verify", points=2)
@pytest.mark.parametrize(
    "variant,shape",
    [("gqa", SMALL_TREE), ("mqa", [(0,), (1,), (2,), (0, 0)]), ("mha", 3)],
    ids=["gqa-tree", "mqa-wide", "mha-chain"],
)
def test_tree_generate_greedy_equals_generate(variant, shape):
    target = tiny_model(variant)
    ids = prompt(14, 7)
    expected = generate(target, ids, 24, stop_token_ids=[])
    for name, draft in (("perturbed draft", perturbed(target, 0.3)), ("the target itself", target)):
        got, stats = tree_generate(target, ModelTreeDraft(draft, shape), ids, 24, return_stats=True,
                                   stop_token_ids=[])  # fmt: skip
        what = f"{variant}, tree {shape}, {name}"
        check_tokens(what, got, expected)
        check_cache_holds(
            f"{what}, target cache", target, stats.caches["target"], torch.cat([ids, got])[:-1], 0
        )


# ------------------------------------------------------------------ negative controls of the walk
def walk_without_strike(tree, logits, params, generator=None):
    """A wrong walk: after a rejection it takes the residual but leaves the rejected token in p."""
    kids = st.children_of(tree.parents)
    q = st.sampling_probs(logits[0], params.temperature)
    p = tree.probs[0].float()
    for c in kids[0]:
        x = int(tree.tokens[c])
        if float(torch.rand(1, generator=generator)) < min(1.0, float(q[x]) / float(p[x])):
            return [0, c], torch.tensor([0])
        r = (q - p).clamp(min=0)
        q = r / r.sum() if r.sum() > 0 else q
    return [0], torch.multinomial(q, 1, generator=generator)


def walk_without_residual(tree, logits, params, generator=None):
    """A wrong walk: after a rejection it keeps q as it was (no residual)."""
    kids = st.children_of(tree.parents)
    q = st.sampling_probs(logits[0], params.temperature)
    p = tree.probs[0].float().clone()
    for c in kids[0]:
        x = int(tree.tokens[c])
        if float(torch.rand(1, generator=generator)) < min(1.0, float(q[x]) / float(p[x])):
            return [0, c], torch.tensor([0])
        p[x] = 0
        p = p / p.sum()
    return [0], torch.multinomial(q, 1, generator=generator)


@pytest.mark.parametrize("wrong", [walk_without_strike, walk_without_residual], ids=lambda f: f.__name__)
def test_sampled_walk_negative_controls_fail(wrong):
    q, p, m = CASES["three_of_five"]
    counts = _first_token_counts(q, p, m, 20_000, walk=wrong)
    _, pvalue = chi_square_pvalue(counts, q)
    assert pvalue < P_MIN, f"{wrong.__name__}: the chi-square test should reject it (p-value {pvalue:.2e})"


# ------------------------------------------------------------------ end to end, sampled
def e2e_tree_counts(target, draft, ids, n_runs, **settings):
    V = target.config.vocab_size
    counts = torch.zeros(V, V)
    for seed in range(n_runs):
        out = tree_generate(target, draft, ids, 3, temperature=1.0, seed=seed, stop_token_ids=[], **settings)
        counts[int(out[0]), int(out[1])] += 1
    return counts


def e2e_head(target):
    torch.manual_seed(2)
    head = DraftHead(target.config).attach(target)
    with torch.no_grad():
        head.norm.weight.mul_(4.0)
    return head.eval()


@pytest.mark.parametrize(
    "kind,n",
    [("model", 400), ("head", 400), ("head-gate", 400), pytest.param("model", 3000, marks=pytest.mark.slow),
     pytest.param("head", 3000, marks=pytest.mark.slow), pytest.param("head-gate", 3000, marks=pytest.mark.slow)],
)  # fmt: skip
def test_first_two_tokens_follow_target(kind, n):
    """Temperature 1: the first two tokens of tree_generate (a tree of 2 children, the first with 2 of
    its own) have the target's joint distribution over the V^2 = 16 outcomes. head-gate: the confidence
    gate prunes that tree, held at 0.011: the head's second choice for the second token has 0.010-0.013
    (by the first token), so the root gets one candidate or two."""
    target, draft = e2e_models()
    shape = [(0,), (1,), (0, 0), (0, 1)]
    if kind == "model":
        drafter = ModelTreeDraft(draft, shape)
    else:
        drafter = HeadDraft(e2e_head(target), shape, gate=kind == "head-gate")
        if kind == "head-gate":
            fixed_gate(drafter, 0.011)
    ids = torch.tensor([1, 3, 0])
    counts = e2e_tree_counts(target, drafter, ids, n)
    expected = target_joint(target, ids)
    stat, pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > P_MIN, (
        f"{kind} tree draft: joint frequencies of the first two tokens {(counts / n).flatten().tolist()} vs "
        f"the target's {expected.flatten().tolist()} (chi-square {stat:.1f}, p-value {pvalue:.1e})"
    )


def test_first_two_tokens_negative_control(monkeypatch):
    monkeypatch.setattr(st, "accept_tree", lambda tree, logits, params, g=None: walk_without_residual_deep(
        tree, logits, params, g))  # fmt: skip
    target, draft = e2e_models()
    ids = torch.tensor([1, 3, 0])
    counts = e2e_tree_counts(target, ModelTreeDraft(draft, [(0,), (1,), (0, 0), (0, 1)]), ids, 400)
    _, pvalue = chi_square_pvalue(counts, target_joint(target, ids))
    assert pvalue < P_MIN, f"a walk without the residual should be rejected end to end (p-value {pvalue:.2e})"


def walk_without_residual_deep(tree, logits, params, generator=None):
    """walk_without_residual at every node of the tree."""
    kids = st.children_of(tree.parents)
    node, path = 0, [0]
    while True:
        q = st.sampling_probs(logits[node], params.temperature)
        p = tree.probs[node].float().clone()
        nxt = None
        for c in kids[node]:
            x = int(tree.tokens[c])
            if float(torch.rand(1, generator=generator)) < min(1.0, float(q[x]) / max(float(p[x]), 1e-30)):
                nxt = c
                break
            p[x] = 0
            p = p / p.sum() if p.sum() > 0 else p
        if nxt is None:
            return path, torch.multinomial(q, 1, generator=generator)
        node = nxt
        path.append(node)


# ------------------------------------------------------------------ the draft head
def test_head_tree_features_equal_a_forward_along_each_path():
    """What the head computes for a tree node with its cache and tree mask equals an uncached head
    forward along the node's own path (context with the target's features, then the path's nodes
    with their parents' predicted features)."""
    target = tiny_model("gqa")
    head = e2e_head(target)
    drafter = HeadDraft(head, SMALL_TREE)
    ids = prompt(12, 4)
    drafter.reset(40, len(TreeShape(SMALL_TREE)))
    with torch.no_grad():
        _, h = target(ids[None, :-1], return_hidden=True)
    drafter.observe(h[0])
    tree = drafter.propose_tree(ids, SamplingParams(temperature=0.0))
    assert len(tree) == len(TreeShape(SMALL_TREE)), (
        f"{len(tree)} nodes, expected {len(TreeShape(SMALL_TREE))}"
    )
    feats = h[0]
    with torch.no_grad():
        g_ctx = head(ids[None, 1:], feats[None])[0]  # positions 1 .. n - 1
    g = {0: g_ctx[-1]}
    for i in range(1, len(tree)):
        path, node = [], i
        while node > 0:
            path.append(node)
            node = int(tree.parents[node])
        path.reverse()
        toks = torch.cat([ids[1:], tree.tokens[path]])
        fs = torch.cat([feats, torch.stack([g[int(tree.parents[c])] for c in path])])
        with torch.no_grad():
            g[i] = head(toks[None], fs[None])[0, -1]
        want = head.logits(g[int(tree.parents[i])]).argsort(descending=True)
        rank = int(TreeShape(SMALL_TREE).nodes[i][-1])
        assert int(tree.tokens[i]) == int(head.token_ids(want[rank])), (
            f"node {i}: token {int(tree.tokens[i])}, expected the parent's rank-{rank} choice "
            f"{int(head.token_ids(want[rank]))} of an uncached forward along the path"
        )


@pytest.mark.parametrize(
    "shape,adaptive", [(4, False), (SMALL_TREE, False), (SMALL_TREE, True), (SMALL_TREE, "gate")], ids=str
)
def test_head_greedy_equals_generate(shape, adaptive):
    target = tiny_model("gqa")
    head = DraftHead(target.config, torch.arange(0, 64, 3)).attach(target).eval()
    ids = prompt(14, 8)
    expected = generate(target, ids, 30, stop_token_ids=[])
    drafter = HeadDraft(head, shape, adaptive is True, gate=adaptive == "gate")
    if adaptive == "gate":
        fixed_gate(drafter, 0.05)
    got, stats = tree_generate(target, drafter, ids, 30, return_stats=True, stop_token_ids=[])
    check_tokens(f"head, tree {shape}, adaptive {adaptive}", got, expected)
    check_cache_holds("head target cache", target, stats.caches["target"], torch.cat([ids, got])[:-1], 0)


def test_adaptive_depth_follows_acceptance_and_cost():
    shape = TreeShape.chain(4)
    never = st.AdaptiveDepth(shape)
    always = st.AdaptiveDepth(shape)
    for _ in range(60):
        d_never, d_always = never.choose(), always.choose()
        chain = lambda d: DraftTree(torch.zeros(d + 1, dtype=torch.long), torch.arange(-1, d))  # noqa: E731
        never.record(chain(d_never), [0], 0.001 * d_never, 0.010 + 0.001 * d_never)
        always.record(chain(d_always), list(range(d_always + 1)), 0.001 * d_always, 0.010 + 0.001 * d_always)
    picks_never = [never.choose() for _ in range(8)]
    picks_always = [always.choose() for _ in range(8)]
    assert sorted(picks_never)[len(picks_never) // 2] == 0, (
        f"no draft ever accepted, yet depths {picks_never}"
    )
    assert sorted(picks_always)[len(picks_always) // 2] == 4, (
        f"every draft accepted, yet depths {picks_always}"
    )


def test_adaptive_depth_times_plain_decoding_and_forgets_a_first_round():
    """Drafts accepted 20% of the time, rounds costing 10 ms + 3 ms per level, a depth's first round 5x
    (as if building its pass): plain decoding is the fastest, and after the first rounds it is what
    the choice settles on, its explorations aside."""
    shape = TreeShape.chain(4)
    adaptive, gen, seen = st.AdaptiveDepth(shape), torch.Generator().manual_seed(0), set()
    picks = []
    for _ in range(200):
        d = adaptive.choose()
        picks.append(d)
        reach = 0
        while reach < d and torch.rand((), generator=gen) < 0.2:
            reach += 1
        seconds = (0.010 + 0.003 * d) * (5 if d not in seen else 1)
        seen.add(d)
        tree = DraftTree(torch.zeros(d + 1, dtype=torch.long), torch.arange(-1, d))
        adaptive.record(tree, list(range(reach + 1)), 0.0, seconds)
    late = picks[100:]
    assert late.count(0) >= 0.85 * len(late), f"rounds 100-199 chose depths {late}, expected mostly 0"


def fixed_gate(drafter, tau):
    """The drafter's confidence gate held at tau (its measured times would move it)."""
    drafter.gate.plain, drafter.gate.per_node = 1.0, tau
    drafter.gate.record = lambda *args: None
    return drafter


def test_confidence_gate_measures_what_a_node_costs():
    gate = st.ConfidenceGate(prior=0.1)
    chain = lambda d: DraftTree(torch.zeros(d + 1, dtype=torch.long), torch.arange(-1, d))  # noqa: E731
    assert gate.tau == math.inf, "before plain decoding is timed nothing should be drafted"
    gate.record(chain(0), [0], 0.001, 0.009)
    assert gate.tau == 0.1, f"a timed plain round and no drafted one: tau {gate.tau}, expected the prior 0.1"
    for _ in range(50):  # plain rounds of 10 ms, rounds of 4 nodes of 18 ms: 2 ms a node
        gate.record(chain(0), [0], 0.0, 0.010)
        gate.record(chain(4), [0, 1], 0.004, 0.014)
    assert abs(gate.tau - 0.2) < 1e-3, f"tau {gate.tau}, expected 2 ms a node / 10 ms a step = 0.2"


@pytest.mark.parametrize("tau", [0.0, 0.05, 0.16, 0.2, 0.5, 2.0])
def test_gate_drafts_the_nodes_whose_path_it_is_sure_of(tau):
    """Greedy, the gate held at tau: the drafted tree is exactly SMALL_TREE's nodes whose path has a
    product of the head's probabilities >= tau, each probability from an uncached forward along the
    node's path (the rank-r child's: the parent's r-th largest)."""
    target = tiny_model("gqa")
    head = e2e_head(target)
    ids = prompt(12, 4)
    drafter = fixed_gate(HeadDraft(head, SMALL_TREE, gate=True), tau)
    drafter.reset(40, len(TreeShape(SMALL_TREE)))
    with torch.no_grad():
        _, h = target(ids[None, :-1], return_hidden=True)
    drafter.observe(h[0])
    tree = drafter.propose_tree(ids, SamplingParams(temperature=0.0))
    shape = TreeShape(SMALL_TREE)
    with torch.no_grad():
        g_ctx = head(ids[None, 1:], h[0][None])[0]
    g, sure, tokens, kept = {0: g_ctx[-1]}, {0: 1.0}, {0: int(ids[-1])}, [0]
    for i in range(1, len(shape)):
        parent, rank = shape.parents[i], shape.nodes[i][-1]
        if parent not in kept:
            continue
        p = head.logits(g[parent]).float().softmax(-1)
        top = p.topk(rank + 1)
        if sure[parent] * float(top.values[rank]) < tau:
            continue
        kept.append(i)
        sure[i], tokens[i] = sure[parent] * float(top.values[rank]), int(head.token_ids(top.indices[rank]))
        path, node = [], i
        while node > 0:
            path.append(node)
            node = shape.parents[node]
        path.reverse()
        toks = torch.cat([ids[1:], torch.tensor([tokens[c] for c in path])])
        fs = torch.cat([h[0], torch.stack([g[shape.parents[c]] for c in path])])
        with torch.no_grad():
            g[i] = head(toks[None], fs[None])[0, -1]
    want_parents = [-1] + [kept.index(shape.parents[i]) for i in kept[1:]]
    assert tree.parents.tolist() == want_parents and tree.tokens.tolist() == [tokens[i] for i in kept], (
        f"tau {tau}: drafted tokens {tree.tokens.tolist()} with parents {tree.parents.tolist()}, expected "
        f"{[tokens[i] for i in kept]} with {want_parents} (nodes {[shape.nodes[i] for i in kept]})"
    )


def test_gate_decides_before_drawing():
    """Sampled, the gate held: how many candidates the root gets depends on the head's distribution
    only, never on which tokens were drawn (that would bias verification): the same for every seed."""
    target = tiny_model("gqa")
    head = e2e_head(target)
    ids = prompt(12, 4)
    with torch.no_grad():
        _, h = target(ids[None, :-1], return_hidden=True)
        p = head.logits(head(ids[None, 1:], h)[0, -1]).float().softmax(-1).sort(descending=True).values
    tau = float(p[1] + p[2]) / 2  # between the second and third largest: two candidates
    counts, tokens = set(), set()
    for seed in range(12):
        drafter = fixed_gate(HeadDraft(head, [(0,), (1,), (2,)], gate=True), tau)
        drafter.reset(40, 4)
        drafter.observe(h[0])
        tree = drafter.propose_tree(ids, SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed))
        counts.add(len(tree) - 1)
        tokens.add(tuple(tree.tokens[1:].tolist()))
    assert counts == {2}, f"the root got {sorted(counts)} candidates across seeds, expected 2 every time"
    assert len(tokens) > 1, "the seeds should have drawn different candidates"


def test_prompt_features_equal_the_forward_s_own():
    for variant in ("gqa", "mla", "sliding"):
        target = tiny_model(variant)
        ids = prompt(9, 3)
        a, b = target.new_cache(1, 16), target.new_cache(1, 16)
        with torch.no_grad():
            logits, got = st.prompt_features(target, ids, a)
            all_logits, want = target(ids[None], cache=b, return_hidden=True)
        assert torch.equal(got, want[0]), f"{variant}: features differ from return_hidden=True's"
        torch.testing.assert_close(logits, all_logits[0, -1:], msg=f"{variant}: the last position's logits")
        assert a.pos == b.pos == 9, f"{variant}: cache at {a.pos}, expected 9"
        check_cache_holds(f"{variant} prompt_features cache", target, a, ids, 0)


def test_head_save_load_round_trip(tmp_path):
    target = tiny_model("gqa")
    head = DraftHead(target.config, torch.tensor([5, 1, 9, 30])).attach(target)
    save_draft_head(head, tmp_path, {"note": "test"})
    back = load_draft_head(tmp_path, target)
    assert back.vocab_ids.tolist() == [1, 5, 9, 30]
    x, f = prompt(6, 1)[None], torch.randn(1, 6, target.config.d_model)
    with torch.no_grad():
        assert torch.equal(head(x, f), back(x, f))
    with pytest.raises(ValueError, match="holds no draft head"):
        load_draft_head(tmp_path / "nothing", target)
    other = TransformerLM(
        ModelConfig(vocab_size=64, d_model=48, n_layers=1, d_ff=64, max_seq_len=32, n_heads=4)
    )
    with pytest.raises(ValueError, match="does not fit|was made for"):
        load_draft_head(tmp_path, other)


def test_tree_shape_checks():
    with pytest.raises(ValueError, match="parent"):
        TreeShape([(0,), (0, 0, 0)])
    with pytest.raises(ValueError, match="lower-ranked"):
        TreeShape([(1,)])
    shape = TreeShape(SMALL_TREE)
    assert shape.depth == 3 and len(shape) == 7 and shape.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert len(shape.cut(1)) == 3 and TreeShape.chain(3).parents == [-1, 0, 1, 2]


def test_tree_needs_static_caches():
    target = tiny_model("sliding")
    with pytest.raises(ValueError, match="static caches"):
        tree_generate(target, ModelTreeDraft(target, 2), prompt(20, 1), 8)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32-every-position"])
def test_draft_training_learns_on_a_tiny_target(tmp_path, precision):
    """160 steps on a tiny target's own greedy continuations (1,400 positions), answered on the serving
    engine with their features (answer_with_features, saved and loaded as train_draft.py does), lift
    the head's held-out agreement with the target's next token from chance (1/64) to several times
    that, and a run stopped and resumed from its checkpoint ends with the same head as an
    uninterrupted one; in float32, with the training passes under bfloat16 autocast (bf16=True,
    what train_draft.py uses where the CPU multiplies bf16), whose weights stay float32, and with the
    losses at every position against the target's distribution (every_position=True)."""
    from cs336_inference import draft_training as dt

    target = tiny_model("gqa")
    for p in target.parameters():
        p.requires_grad_(False)
    prompts = [prompt(4, s).tolist() for s in range(40)]
    chunks = [dt.save_chunk(dt.answer_with_features(target, ps, 40, log=lambda m: None), tmp_path / f"{n}.st")
              for n, ps in (("train", prompts[:32]), ("held", prompts[32:]))]  # fmt: skip
    train, held = dt.load_features(chunks[:1]), dt.load_features(chunks[1:])
    starts = train["starts"].tolist()
    for i in range(3):  # greedy answers, each label the token after it (-1 after the last)
        seq = train["tokens"][starts[i] : starts[i + 1]]
        assert seq[4:].tolist() == generate(target, prompts[i], 40, stop_token_ids=[]).tolist(), i
        assert train["labels"][starts[i] : starts[i + 1]].tolist() == [*seq[1:].tolist(), -1], i
    settings = dict(steps=160, batch_size=8, T=32, lr=3e-3, warmup=10, eval_every=80, unroll=2,
                    bf16=precision == "bf16", every_position=precision.endswith("every-position"))  # fmt: skip
    torch.manual_seed(0)
    head = DraftHead(target.config).attach(target)
    history = dt.train_draft_head(
        head, train, held, tmp_path / "ck", progress=False, log=lambda m: None, **settings
    )
    first, last = history[0], history[-1]
    assert last["accept_depth1"] > max(0.15, 4 * first["accept_depth1"]), f"held-out acceptance: {history}"
    for _ in range(2):  # stopped at step 80, then resumed in a fresh head from the checkpoint
        torch.manual_seed(0)
        again = DraftHead(target.config).attach(target)
        dt.train_draft_head(again, train, held, tmp_path / "ck2", progress=False, log=lambda m: None,
                            stop_at=80 if _ == 0 else None, **settings)  # fmt: skip
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), (
            f"a run stopped at step 80 and resumed differs in {name} from an uninterrupted one"
        )
    assert math.isfinite(last["feature_loss"])
    assert all(p.dtype == torch.float32 for p in head.parameters()), f"{precision}: weights left float32"
    if precision == "bf16":  # the passes did run in bf16: 20 steps from the same start differ from float32's
        heads = []
        for bf16 in (True, False):
            torch.manual_seed(0)
            heads.append(DraftHead(target.config).attach(target))
            dt.train_draft_head(heads[-1], train, held, tmp_path / f"short-{bf16}", progress=False,
                                log=lambda m: None, stop_at=20, **{**settings, "bf16": bf16})  # fmt: skip
        assert not torch.equal(heads[0].fc.weight, heads[1].fc.weight), "bf16=True trained as float32 does"


def test_a_saved_head_trains_on_from_where_it_stopped(tmp_path):
    """continued_head (train_draft.py --init): the saved head comes back with its weights, so a fresh
    schedule's first evaluation reads the saved head's held-out acceptance, and its training moves
    those weights; a head saved with another draft vocabulary than the data's is refused in one line."""
    from cs336_inference import draft_training as dt

    target = tiny_model("gqa")
    for p in target.parameters():
        p.requires_grad_(False)
    prompts = [prompt(4, s).tolist() for s in range(24)]
    data = dt.load_features([dt.save_chunk(dt.answer_with_features(target, prompts, 24, log=lambda m: None),
                                           tmp_path / "answers.st")])  # fmt: skip
    vocab = torch.arange(0, 64, 2)
    torch.manual_seed(0)
    head = DraftHead(target.config, vocab).attach(target)
    settings = dict(batch_size=8, T=16, lr=3e-3, warmup=5, eval_every=40, unroll=2)
    first = dt.train_draft_head(head, data, data, tmp_path / "ck", progress=False, log=lambda m: None,
                                steps=40, **settings)  # fmt: skip
    save_draft_head(head, tmp_path / "head")
    again = dt.continued_head(tmp_path / "head", target, vocab)
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), f"continued_head changed {name}"
    more = dt.train_draft_head(again, data, data, tmp_path / "ck-init", progress=False, log=lambda m: None,
                               steps=10, **{**settings, "eval_every": 10})  # fmt: skip
    assert more[0]["accept_depth1"] == first[-1]["accept_depth1"], (
        f"a continued head's first evaluation {more[0]} is not where the saved one stopped {first[-1]}"
    )
    assert not torch.equal(again.fc.weight, head.fc.weight), "the continued head did not train"
    for other in (torch.arange(1, 64, 2), None):
        with pytest.raises(ValueError, match="another draft vocabulary") as e:
            dt.continued_head(tmp_path / "head", target, other)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------ the fast path's tree pass
@pytest.mark.parametrize("mode", ["eager", "native"])
@pytest.mark.parametrize("variant", ["gqa", "mha", "h64"])
def test_fixed_step_tree_pass_equals_the_readable_one(mode, variant):
    """A tree pass as a fixed-shape step (step.c's cs336_layers_tree when native) gives the readable
    tree_forward's logits and features, and after keep_path the same cache; native passes of every
    size share the cache's one NativeLayers."""
    from cs336_inference.fast.cpu import build
    from cs336_inference.fast.step.fixed import FixedSteps

    if mode == "native" and build.library() is None:
        pytest.skip("the C kernels are not built here")
    # h64: heads of 64, three a K/V head (SmolLM2's shape, which step.c's attention specialises)
    target = tiny_model("mqa", d_model=192, n_heads=3) if variant == "h64" else tiny_model(variant)
    context = prompt(13, 2)
    tree = DraftTree(
        torch.tensor([int(context[-1]), 5, 9, 17, 33, 2, 40, 8]), torch.tensor([-1, 0, 0, 1, 2, 0, 3, 6])
    )
    runner, cache = FixedSteps(mode).tree_target(target, 64)
    ref_cache = target.new_cache(1, cache.capacity)
    with torch.no_grad():
        for c in (cache, ref_cache):
            target(context[None, :-1], cache=c)
        logits, h = runner.tree(cache, tree, return_hidden=True)
        want_logits, want_h = tree_forward(target, ref_cache, tree, return_hidden=True)
    assert torch.allclose(logits, want_logits, atol=1e-4), (
        f"{mode}: tree-pass logits differ from the readable ones by {float((logits - want_logits).abs().max()):.1e}"
    )
    assert torch.allclose(h, want_h, atol=1e-4), f"{mode}: tree-pass features differ"
    if mode == "native":  # one NativeLayers for every pass of the cache (building one takes a few ms)
        runner.prepare(3)
        passes = {T: step.step.native for T, step in runner.trees.items()}
        assert sorted(passes) == [1, 3, 8] and all(n is runner.native for n in passes.values()), (
            f"the passes of one cache must share its NativeLayers: {passes}"
        )
        from cs336_inference.fast.step.fixed import StaticDecodeStep

        with pytest.raises(ValueError, match="same model and cache"):
            StaticDecodeStep(target, target.new_cache(1, 64), 2, native=runner.native)
    path = [0, 1, 3, 6, 7]
    keep_path(cache, len(context) - 1, path)
    check_cache_holds(f"{mode} tree pass", target, cache, torch.cat([context[:-1], tree.tokens[path]]), 0)
    head = DraftHead(target.config, torch.arange(0, 64, 2)).attach(target).eval()
    if mode == "native":  # as generate.py drafts: the head's products in q8_0 through the kernels
        from cs336_inference.fast import install

        install(head.quantize("q8_0"))
        with pytest.raises(ValueError, match="before quantize"):
            save_draft_head(head, "unused")
    ids = prompt(12, 9)
    expected = generate(target, ids, 24, stop_token_ids=[])
    for name, drafter in (
        ("model tree", ModelTreeDraft(perturbed(target, 0.3), SMALL_TREE)),
        ("head, adaptive, lookup", HeadDraft(head, SMALL_TREE, adaptive=True, lookup=True)),
    ):
        got = tree_generate(target, drafter, ids, 24, stop_token_ids=[], steps=FixedSteps(mode))
        check_tokens(f"{mode}, {name}", got, expected)


@pytest.mark.parametrize("fmt", ["fp32", "q8_0"])
def test_native_head_passes_equal_the_readable_ones(fmt):
    """fast.install(head): its cached passes with the layer in one C call (fast/step/head.py) give the
    readable head's g and cache, for a catch-up pass, a chain step and tree levels (fresh, and with
    nodes before them that every input sees); a level whose inputs must not see a node fed before
    runs the readable forward."""
    from cs336_inference.draft_head import DraftHead as Readable
    from cs336_inference.fast import install
    from cs336_inference.fast.cpu import build

    if build.library() is None:
        pytest.skip("the C kernels are not built here")
    target = tiny_model("gqa")
    head = e2e_head(target)
    if fmt == "q8_0":
        head.quantize("q8_0")
    install(head)
    assert type(head).__name__ == "FastDraftHead", f"install made a {type(head).__name__}"
    ids = prompt(12, 6)
    with torch.no_grad():
        _, h = target(ids[None], return_hidden=True)
    fast_cache, ref_cache = head.new_cache(32), head.new_cache(32)
    # four nodes under a root: nodes 0 and 1 its children, node 2 under 0, node 3 under 1
    mask = tree_mask(torch.tensor([-1, 0, 0, 1, 2]))[1:, 1:]

    def both(name, tokens, feats, **tree):
        with torch.inference_mode():
            got = head(tokens[None], feats[None], cache=fast_cache, **tree)[0]
            want = Readable.forward(head, tokens[None], feats[None], cache=ref_cache, **tree)[0]
        assert torch.allclose(got, want, atol=1e-4), (
            f"{fmt}, {name}: g differs from the readable head's by {float((got - want).abs().max()):.1e}"
        )
        n = ref_cache.pos
        assert fast_cache.pos == n, f"{fmt}, {name}: cache at {fast_cache.pos}, expected {n}"
        got_kv, want_kv = fast_cache.layers[0], ref_cache.layers[0]
        for a, b in ((got_kv.k, want_kv.k), (got_kv.v, want_kv.v)):
            assert torch.allclose(a[:, :, :n], b[:, :, :n], atol=1e-4), f"{fmt}, {name}: cached K/V differ"
        return got

    g = both("catch-up", ids[1:10], h[0, :9])
    with torch.inference_mode():
        assert head._native(fast_cache) is not None, f"{fmt}: the native layer does not run this head"
    g1 = both("chain step", ids[10:11], g[-1:])
    start = ref_cache.pos
    depth = torch.tensor([0, 0])
    lvl = both(
        "tree level", ids[3:5], torch.stack([g1[0], g1[0]]), depth=depth, tree=mask[:2, :2], tree_start=start
    )
    # the next level: node 2 sees node 0 but not node 1, so the readable forward runs it
    both("level with a hidden node", ids[5:6], lvl[:1], depth=torch.tensor([1]) - 2, tree=mask[2:3, :3],
         tree_start=start)  # fmt: skip
    for c in (fast_cache, ref_cache):
        c.truncate(start)
    # fed again from the tree's start, as HeadDraft does: every node in one pass
    feats = torch.stack([g1[0], g1[0], lvl[0], lvl[1]])
    both("level fed again", ids[3:7], feats, depth=torch.tensor([0, 0, 1, 1]), tree=mask, tree_start=start)


def test_head_with_prompt_lookup_greedy_equals_generate():
    from tests.test_speculative import repetitive_prompt

    target = tiny_model("gqa")
    head = DraftHead(target.config).attach(target).eval()
    ids = repetitive_prompt(30, 3)
    expected = generate(target, ids, 30, stop_token_ids=[])
    got, stats = tree_generate(
        target, HeadDraft(head, 4, lookup=True), ids, 30, return_stats=True, stop_token_ids=[]
    )
    check_tokens("head with prompt lookup", got, expected)
    assert stats.accepted > 0, "a repetitive prompt should let prompt lookup's drafts be accepted"


def test_head_copy_chains_go_deeper_than_the_tree():
    """copy_depth: prompt lookup's chains may be longer than the head's tree is deep; output still
    equals generate, and the cache has room for the longest chain."""
    from tests.test_speculative import repetitive_prompt

    target = tiny_model("gqa")
    head = DraftHead(target.config).attach(target).eval()
    ids = repetitive_prompt(30, 3)
    drafter = HeadDraft(head, SMALL_TREE, lookup=True, copy_depth=7)
    assert drafter.max_depth == 7 and drafter.max_nodes >= 8
    got, stats = tree_generate(target, drafter, ids, 40, return_stats=True, stop_token_ids=[])
    check_tokens("head, lookup chains of up to 7", got, generate(target, ids, 40, stop_token_ids=[]))
    depth = st.as_shape(SMALL_TREE).depth
    assert max(stats.round_drafts) > depth, (
        f"no round drafted more than the tree's depth {depth}: {stats.round_drafts}"
    )
    with pytest.raises(ValueError, match="copy_depth"):
        HeadDraft(head, SMALL_TREE, lookup=True, copy_depth=0)


def test_head_auto_copying_has_its_own_choice():
    """With adaptive depth and lookup, the rounds that draft lookup's tokens are chosen and recorded
    by the copying chooser, the head's trees by the head's: output still equals generate."""
    from tests.test_speculative import repetitive_prompt

    target = tiny_model("gqa")
    head = DraftHead(target.config).attach(target).eval()
    ids = repetitive_prompt(30, 3)
    drafter = HeadDraft(head, SMALL_TREE, adaptive=True, lookup=True)
    got, stats = tree_generate(target, drafter, ids, 40, return_stats=True, stop_token_ids=[])
    check_tokens("head-auto on a repetitive prompt", got, generate(target, ids, 40, stop_token_ids=[]))
    trees = drafter.adaptive
    copying = [c for c in drafter.copiers if c.seen[1]]
    assert copying and all(c.seconds[0] is not None for c in drafter.copiers), (
        "lookup's chains were not recorded as copying's"
    )
    chains = sum(sum(c.accepted[1:]) + sum(c.reached[1:]) for c in copying)
    assert stats.accepted > 0 and chains > 0, "a repetitive prompt should let lookup's drafts be accepted"
    assert trees.rounds < stats.target_passes, (
        f"the head's chooser was asked in {trees.rounds} of {stats.target_passes} rounds: lookup's rounds too"
    )


def test_head_auto_copies_by_match_length():
    """HeadDraft's lookup: a match of three tokens asks the first copier, of two the second, of one
    none (the head decides); the context's last COPY_RUN tokens seen before draft all lookup found,
    before any copier has timed a round (which would choose no drafts)."""
    from cs336_inference.draft_head import COPY_RUN, LOOKUP_N

    target = tiny_model("gqa")
    head = e2e_head(target)
    ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(5)).tolist()
    motif, noise, (a, b, c, x) = ids[:9], ids[9:49], ids[49:53]  # no id twice but where placed so
    cases = {
        "a copy under way": (motif + noise[:4] + motif[:COPY_RUN], "run"),
        "three tokens": (noise[:8] + [a, b, c, x] + noise[10:16] + [a, b, c], 0),
        "two tokens": (noise[:8] + [b, c, x] + noise[10:16] + [b, c], 1),
        "one token": (noise[:8] + [c, x] + noise[10:16] + [c], None),
    }
    assert LOOKUP_N == (3, 2) and COPY_RUN <= 9
    for name, (ids, asks) in cases.items():
        ids = torch.tensor(ids)
        drafter = HeadDraft(head, SMALL_TREE, adaptive=True, lookup=True, copy_depth=5)
        drafter.reset(64, drafter.max_nodes)
        with torch.no_grad():
            _, h = target(ids[None, :-1], return_hidden=True)
        drafter.observe(h[0])
        tree = drafter.propose_tree(ids, SamplingParams(temperature=0.0))
        asked = [i for i, chooser in enumerate(drafter.copiers) if chooser.rounds]
        if asks == "run":
            want = motif[COPY_RUN : COPY_RUN + 3] + noise[:2]
            assert tree.tokens[1:].tolist() == want, (
                f"{name}: drafted {tree.tokens[1:].tolist()}, expected all five tokens that followed {want}"
            )
        else:
            assert asked == ([] if asks is None else [asks]), (
                f"{name}: copiers {asked} chose, expected {'none' if asks is None else [asks]}"
            )
            assert len(tree) == 1, f"{name}: {len(tree) - 1} drafts before any round was timed, expected 0"


def test_head_copy_under_way_doubles_its_cap():
    """run_depth: a copy under way accepted whole lets the next one draft twice as many tokens (up to
    run_depth), a rejected one sets the cap back to copy_depth; such a chain, deeper than copy_depth,
    is not recorded as the copiers' choice (test_head_copy_chains_go_deeper_than_the_tree verifies
    chains deeper than the tree)."""
    target = tiny_model("gqa")
    head = e2e_head(target)
    D = target.config.d_model
    motif = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(6))[:40]
    drafter = HeadDraft(head, SMALL_TREE, adaptive=True, lookup=True, copy_depth=3, run_depth=8)
    assert drafter.max_depth == 8 and drafter.max_nodes >= 9
    drafter.reset(128, drafter.max_nodes)
    context, greedy = motif.tolist() + motif[:6].tolist(), SamplingParams(temperature=0.0)
    drafter.observe(torch.zeros(len(context) - 1, D))
    copier = drafter.copiers[0]
    for accepted, want_cap in [(None, 3), (None, 6), (None, 8), (2, 8), (None, 3)]:
        tree = drafter.propose_tree(torch.tensor(context), greedy)
        drafts = tree.tokens[1:].tolist()
        at = len(context) - len(motif)  # where in the motif the copy goes on
        assert drafts == motif[at : at + want_cap].tolist(), (
            f"a copy under way at motif position {at}: drafted {len(drafts)} tokens {drafts}, expected "
            f"the {want_cap} that follow"
        )
        before = (list(copier.reached), list(copier.accepted))
        keep = len(tree) if accepted is None else accepted + 1
        drafter.record(tree, list(range(keep)), 0.01, 0.02)
        if len(tree) - 1 > 3:
            assert (copier.reached, copier.accepted) == before, "a chain deeper than copy_depth was recorded"
        new = drafts[: keep - 1] + [int(motif[at + keep - 1])]  # the accepted drafts and the target's token
        context += new
        drafter.observe(torch.zeros(len(new), D))
    with pytest.raises(ValueError, match="run_depth"):
        HeadDraft(head, SMALL_TREE, lookup=True, copy_depth=4, run_depth=3)


def test_general_prompts_split_by_topic():
    from cs336_inference import draft_prompts as dp
    from cs336_inference.bench.speculative import CHAT_PROMPTS

    train, held = dp.general_prompts()
    assert (train, held) == dp.general_prompts(), "the prompts should not depend on anything but the seed"
    sizes = [(len(subjects), len(tasks)) for subjects, tasks in dp.GENERAL_FAMILIES]
    assert len(held) == sum(n // 10 * k for n, k in sizes), "every tenth subject of a family is held out"
    assert len(train) + len(held) == sum(n * k for n, k in sizes)
    assert len(set(train + held)) == len(train + held), "a prompt appears twice"
    for subjects, tasks in dp.GENERAL_FAMILIES:
        for i, subject in enumerate(subjects):
            side = held if i % 10 == 9 else train
            assert all(t.format(subject) in side for t in tasks), f"subject {subject!r} split across sides"
    # the first family's prompts lead the list, so a family added after it leaves the chunks of their
    # answers on disk valid
    first = len(dp.GENERAL_TOPICS) - len(dp.GENERAL_TOPICS) // 10
    assert set(train[: first * len(dp.GENERAL_TASKS)]) == {
        t.format(topic) for i, topic in enumerate(dp.GENERAL_TOPICS) if i % 10 != 9 for t in dp.GENERAL_TASKS
    }
    words = {w.strip(".,?").lower() for p in CHAT_PROMPTS for w in p.split()}
    for distinctive in ("sky", "lunch", "tuple", "healthy"):
        assert distinctive in words  # the benchmark's chat prompts stay unseen in training
        assert not any(distinctive in p.lower() for p in train + held), (
            f"{distinctive!r} is in a training prompt"
        )


def test_answer_masks_count_only_answer_predictions():
    """With an answer mask, a training window is a sequence's tail and only the labels that predict an
    answer token count (the prompt before the answer is context only)."""
    from cs336_inference import draft_training as dt

    header = [7, 8]
    seqs = [[1, 2, 7, 8, 3, 4, 5], [9, 9, 9], [1, 7, 8, 6]]
    assert dt.answer_starts(seqs, header) == [4, 3, 3]
    N = sum(len(s) for s in seqs)
    starts = torch.tensor([0, 7, 10, 14])
    data = {"tokens": torch.tensor(sum(seqs, [])), "feats": torch.randn(N, 4).half(),
            "labels": torch.arange(N) + 100, "starts": starts}  # fmt: skip
    data = dt.mark_answers(data, header)
    assert data["answer"].nonzero().flatten().tolist() == [4, 5, 6, 13]
    wins = dt.training_windows(data, T=4)
    assert wins.tolist() == [[2, 5], [10, 4]], (
        "one window per sequence with an answer: its last T + 1 positions"
    )
    x, prev, want, y = dt._batch(data, wins, [0, 1], 4, "cpu")
    # window (2, 5): inputs are positions 3..6; label y_j counts when x_{j+1} is an answer token
    assert x[0].tolist() == [8, 3, 4, 5] and y[0].tolist() == [103, 104, 105, -1]
    assert x[1].tolist() == [7, 8, 6, 0] and y[1].tolist() == [-1, 112, -1, -1]


@pytest.mark.parametrize("every_position", [False, True])
def test_draft_losses_do_not_depend_on_the_readout_padding(monkeypatch, every_position):
    """draft_losses pads the readout's rows to a multiple of READOUT_ROWS (a few fixed shapes, so that
    oneDNN's per-shape weight copies under bf16 autocast stay few): the padding counts in no loss and
    the logits it returns are those of the M positions that count, equal to an unpadded readout's."""
    from cs336_inference import draft_training as dt

    target = tiny_model("gqa")
    torch.manual_seed(0)
    head = DraftHead(target.config, torch.arange(0, 64, 2)).attach(target)
    B, T, D = 3, 10, target.config.d_model
    x = torch.randint(0, 64, (B, T))
    prev, want = torch.randn(B, T, D), torch.randn(B, T, D)
    want[1, 6:] = 0.0  # padding: no feature
    y = torch.randint(-1, 64, (B, T))  # -1 and odd ids (outside the head's vocabulary) count in no CE
    M = B * T - 4 if every_position else int((y >= 0).sum())
    results = {}
    for rows in (1, 16, 128):
        monkeypatch.setattr(dt, "READOUT_ROWS", rows)
        f_loss, t_loss, logits = dt.draft_losses(
            head, x, prev, want, y, unroll=2, every_position=every_position
        )
        assert [lg.shape[0] for lg in logits] == [M, M], f"READOUT_ROWS={rows}: logits of {M} positions"
        results[rows] = (f_loss, t_loss, logits)
    for rows in (16, 128):
        for what, a, b in zip(["feature loss", "token loss", "logits", "logits"], [*results[1][:2], *results[1][2]],
                              [*results[rows][:2], *results[rows][2]], strict=True):  # fmt: skip
            assert torch.allclose(a, b, atol=1e-6), f"READOUT_ROWS={rows} changed the {what}"


def test_draft_losses_at_every_position_distil_the_target_distribution():
    """every_position=True (train_draft.py's default): every position with a feature counts, the
    prompt's too, whatever its label, and the token loss is the cross-entropy of the head's draft
    distribution against the target's own, softmax(h_j W^T) over the head's vocabulary rows: checked
    against torch.distributions (entropy + KL), and the feature loss against a smooth L1 over
    exactly those positions."""
    from torch.distributions import Categorical, kl_divergence

    from cs336_inference import draft_training as dt

    target = tiny_model("gqa")
    torch.manual_seed(0)
    vocab = torch.arange(0, 64, 2)
    head = DraftHead(target.config, vocab).attach(target)
    B, T, D = 2, 9, target.config.d_model
    x = torch.randint(0, 64, (B, T))
    prev, want = torch.randn(B, T, D), torch.randn(B, T, D)
    want[0, 7:] = 0.0  # padding: no feature, no loss
    counted = want.abs().amax(-1) > 0
    answers = torch.full((B, T), -1)
    answers[1, 4:] = torch.randint(0, 64, (5,))  # a few answer labels; the others are prompt positions
    got = [
        dt.draft_losses(head, x, prev, want, y, unroll=1, every_position=True)
        for y in (answers, -answers.abs())
    ]
    for a, b in zip([*got[0][:2], *got[0][2]], [*got[1][:2], *got[1][2]], strict=True):
        assert torch.equal(a, b), (
            "with every_position the labels y must not matter (the target's distribution counts)"
        )
    f_loss, t_loss, (logits,) = got[0]
    assert logits.shape == (int(counted.sum()), len(vocab)), (
        f"logits at every position with a feature ({int(counted.sum())}), got {tuple(logits.shape)}"
    )
    with torch.no_grad():
        g = head(x, prev)
        teacher = Categorical(logits=want[counted] @ target.vocab_weight[vocab].T)
        student = Categorical(logits=head.logits(g[counted]))
        expected = (teacher.entropy() + kl_divergence(teacher, student)).mean()
        feature = torch.nn.functional.smooth_l1_loss(g[counted], want[counted])
    assert torch.allclose(t_loss, expected, atol=1e-5), (
        f"token loss {float(t_loss):.6f}: expected the cross-entropy against the target's distribution "
        f"{float(expected):.6f}"
    )
    assert torch.allclose(f_loss, feature, atol=1e-6), (
        f"feature loss {float(f_loss):.6f}: expected smooth L1 over the positions with a feature {float(feature):.6f}"
    )


def test_benchmark_rows_of_tree_drafts():
    """benchmark.py speculative's library with tree drafts: a draft made per k (a chain of k) and one
    with its own shape (one row, k = its depth); per-round draft and verify costs come from the run."""
    from cs336_inference.bench import speculative as spec_bench
    from tests.test_speculative import repetitive_prompt

    target = tiny_model("gqa")
    head = DraftHead(target.config).attach(target).eval()
    drafts = {
        "chain": spec_bench.TreeDraft(lambda k: HeadDraft(head, k), per_k=True),
        "tree": spec_bench.TreeDraft(lambda k: ModelTreeDraft(perturbed(target, 0.3), SMALL_TREE)),
    }
    result = spec_bench.speculative_benchmark(
        target, drafts, {"repeat": [repetitive_prompt(20, 1)]}, [1, 3], 12, [], runs=1, log=lambda m: None
    )
    rows = result["rows"]
    assert [(r["draft"], r["k"]) for r in rows] == [("chain", 1), ("chain", 3), ("tree", 3)]
    for r in rows:
        assert r["identical"] and r["draft_cost_per"] == "round" and r["verify_cost"] > 0, r
    assert "per round" in spec_bench.format_speculative_table(rows)

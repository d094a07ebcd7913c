"""naive_generate and generate (prefill + KV-cached decode) on tiny random models of every variant.

The independent reference for greedy generation is one full causal forward over prompt + generated
tokens: by causality its logits at positions P-1 .. P+n-2 are the distributions every step must have
seen, and greedy tokens are their argmax. Naive and cached generation must both reproduce it, and
each other; batched generation must reproduce unbatched generation row by row.
"""

import pytest
import torch

from cs336_inference.config import FULL, SLIDING, ModelConfig
from cs336_inference.model import TransformerLM
from cs336_inference.sampling import (
    generate,
    generate_steps,
    naive_generate,
    sample_next_token,
    stream_generate,
)

BASE = dict(vocab_size=128, d_model=64, n_layers=2, d_ff=128, max_seq_len=96, n_heads=4)
VARIANTS = {
    "mha": dict(n_kv_heads=4),
    "mqa": dict(n_kv_heads=1),
    "gqa": dict(n_kv_heads=2),
    "sliding": dict(n_kv_heads=2, sliding_window=6),  # prompts and outputs much longer than W
    "hybrid": dict(n_kv_heads=2, sliding_window=6, n_layers=3, layer_types=[SLIDING, FULL, SLIDING]),
    "cla": dict(n_kv_heads=2, n_layers=4, kv_share=2),
    "mla": dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
}
N_NEW = 24
ATOL = 1e-4


def tiny_model(variant: str, seed: int = 0) -> TransformerLM:
    torch.manual_seed(seed)
    model = TransformerLM(ModelConfig(**{**BASE, **VARIANTS[variant]}))
    with torch.no_grad():  # larger logits than the default init, so greedy choices are far from ties
        model.norm.weight.mul_(4.0)
    return model.eval()


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))


def check_tokens(what: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal token sequences; else name the first differing new token."""
    assert got.shape == expected.shape, f"{what}: {len(got)} new tokens, expected {len(expected)}"
    wrong = (got != expected).nonzero()
    if len(wrong):
        t = int(wrong[0])
        raise AssertionError(
            f"{what}: first differing new token at position {t}: expected {int(expected[t])}, got {int(got[t])}"
        )


def check_logits(what: str, got: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    """Step logits [n, V] equal within atol; else name the worst and the first step off."""
    assert got.shape == expected.shape, (
        f"{what}: logits of shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    )
    diff = (got - expected).abs().nan_to_num(nan=float("inf")).amax(dim=-1)
    if diff.max() > atol:
        first = int((diff > atol).nonzero()[0])
        raise AssertionError(
            f"{what}: max |diff| {float(diff.max()):.1e} at step {int(diff.argmax())} > {atol:g} "
            f"(first step off: {first})"
        )


@torch.no_grad()
def check_against_full_forward(what, model, prompt_ids, new_tokens, step_logits):
    """Greedy tokens = argmax of, and step logits = the logits of, one teacher-forced full forward."""
    P, n = len(prompt_ids), len(new_tokens)
    reference = model(torch.cat([prompt_ids, new_tokens])[None])[0, P - 1 : P - 1 + n]
    check_logits(what, step_logits, reference)
    check_tokens(what, new_tokens, reference.argmax(dim=-1))


PROMPTS = {"prompt 0 (10 tokens)": (10, 1), "prompt 1 (1 token)": (1, 2)}  # name -> (length, seed)


@pytest.mark.graded(problem="naive_generate", points=3)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_naive_generate_matches_one_full_forward(variant):
    model = tiny_model(variant)
    for name, (length, seed) in PROMPTS.items():
        p = prompt(length, seed)
        tokens, logits = naive_generate(model, p, N_NEW, return_logits=True, stop_token_ids=[])
        check_against_full_forward(f"variant {variant}, {name}", model, p, tokens, logits)


@pytest.mark.graded(problem="generate", points=3)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_generate_matches_one_full_forward(variant):
    model = tiny_model(variant)
    for name, (length, seed) in PROMPTS.items():
        p = prompt(length, seed)
        tokens, logits = generate(model, p, N_NEW, return_logits=True, stop_token_ids=[])
        check_against_full_forward(f"variant {variant}, {name}", model, p, tokens, logits)


SAMPLING = dict(temperature=1.5, top_k=50, top_p=0.95)


@torch.no_grad()
def check_sampled(use_cache: bool) -> None:
    """Tokens are drawn by the given next_token (seeded sampling), not by an argmax of their own."""
    model = tiny_model("gqa")
    p = prompt(6, seed=9)
    tokens, logits = generate(
        model, p, 20, seed=123, use_cache=use_cache, return_logits=True, stop_token_ids=[], **SAMPLING
    )
    what = f"sampling with {SAMPLING}, seed 123"
    reference = model(torch.cat([p, tokens])[None])[0, len(p) - 1 : len(p) - 1 + len(tokens)]
    check_logits(what, logits, reference)
    generator = torch.Generator().manual_seed(123)  # the same draws, one step at a time
    expected = torch.cat([sample_next_token(row[None], generator=generator, **SAMPLING) for row in reference])
    check_tokens(what, tokens, expected)
    assert not torch.equal(tokens, reference.argmax(dim=-1)), "control: these draws should not all be greedy"


@pytest.mark.graded(problem="naive_generate", points=1)
def test_naive_generate_samples_with_next_token():
    check_sampled(use_cache=False)


@pytest.mark.graded(problem="generate", points=1)
def test_generate_samples_with_next_token():
    check_sampled(use_cache=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_and_naive_agree(variant):
    model = tiny_model(variant, seed=3)
    for length in (1, 4, 13):  # a one-token prompt, and prompts shorter and longer than the window
        p = prompt(length, seed=length)
        cached, cached_logits = generate(model, p, 40, return_logits=True, stop_token_ids=[])
        naive, naive_logits = naive_generate(model, p, 40, return_logits=True, stop_token_ids=[])
        what = f"variant {variant}, prompt of {length} tokens: cached vs naive"
        check_tokens(what, cached, naive)
        check_logits(what, cached_logits, naive_logits)


class ForwardRecorder:
    """Records the number of tokens (T) of every model forward, and the new_cache arguments."""

    def __init__(self, model):
        self.T: list[int] = []
        self.caches: list[tuple] = []
        model.register_forward_pre_hook(lambda module, args: self.T.append(args[0].shape[1]))
        new_cache = model.new_cache

        def recording_new_cache(*args, **kwargs):
            self.caches.append((args, kwargs))
            return new_cache(*args, **kwargs)

        model.new_cache = recording_new_cache


@pytest.mark.graded(problem="generate", points=2)
def test_generate_prefills_once_then_feeds_one_token_per_step():
    model = tiny_model("gqa")
    recorder = ForwardRecorder(model)
    generate(model, prompt(9, seed=2), 12, stop_token_ids=[])
    expected = [9] + [1] * 11  # prefill the prompt, then decode: no recomputation
    assert recorder.T == expected, (
        f"12 new tokens after a 9-token prompt: the model saw forwards of {recorder.T} tokens, "
        f"expected {expected} (one prefill, then one token per step)"
    )
    assert len(recorder.caches) == 1, f"new_cache was called {len(recorder.caches)} times, expected once"


@pytest.mark.graded(problem="naive_generate", points=1)
def test_naive_generate_feeds_the_whole_context_every_step():
    model = tiny_model("gqa")
    recorder = ForwardRecorder(model)
    naive_generate(model, prompt(9, seed=2), 12, stop_token_ids=[])
    expected = list(range(9, 9 + 12))
    assert recorder.T == expected, (
        f"12 new tokens after a 9-token prompt: the model saw forwards of {recorder.T} tokens, "
        f"expected {expected} (the whole context every step)"
    )
    assert recorder.caches == [], "naive generation allocated a KV cache"


def batch_check(variant: str, use_cache: bool):
    model = tiny_model(variant, seed=4)
    prompts = [prompt(3, seed=10), prompt(11, seed=11), prompt(7, seed=12), prompt(1, seed=13)]
    batched, batched_logits = generate(
        model, prompts, 20, use_cache=use_cache, return_logits=True, stop_token_ids=[]
    )
    assert isinstance(batched, list) and len(batched) == len(prompts), (
        f"variant {variant}: a batch of {len(prompts)} prompts gave {type(batched).__name__}, expected a list of 4"
    )
    P = max(len(p) for p in prompts)
    for i, (p, tokens, logits) in enumerate(zip(prompts, batched, batched_logits, strict=True)):
        alone, alone_logits = generate(
            model, p, 20, use_cache=use_cache, return_logits=True, stop_token_ids=[]
        )
        what = f"variant {variant}, prompt {i} ({len(p)} tokens, {P - len(p)} padding) batched vs alone"
        check_logits(what, logits, alone_logits)
        check_tokens(what, tokens, alone)


@pytest.mark.graded(problem="generate", points=3)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_generate_equals_unbatched(variant):
    batch_check(variant, use_cache=True)


@pytest.mark.graded(problem="naive_generate", points=2)
@pytest.mark.parametrize("variant", ["gqa", "sliding", "mla"])
def test_batched_naive_generate_equals_unbatched(variant):
    batch_check(variant, use_cache=False)


def test_a_2d_tensor_is_a_batch_and_a_list_of_ints_one_prompt():
    model = tiny_model("gqa")
    p = prompt(6, seed=5)
    out = generate(model, torch.stack([p, p]), 8, stop_token_ids=[])
    assert isinstance(out, list) and all(torch.equal(o, out[0]) for o in out)
    single = generate(model, p.tolist(), 8, stop_token_ids=[])
    assert single.dim() == 1 and torch.equal(single, out[0])


def test_stop_tokens_end_each_row_and_are_kept():
    model = tiny_model("gqa")
    prompts = [prompt(5, seed=20), prompt(8, seed=21)]
    free = generate(model, prompts, 30, stop_token_ids=[])
    # Stop at the 6th token of row 0; row 1 stops wherever that token first appears in it (if at all).
    stop = int(free[0][5])
    first = int((free[0] == stop).nonzero()[0])
    stopped = generate(model, prompts, 30, stop_token_ids=[stop])
    assert torch.equal(stopped[0], free[0][: first + 1])
    hits = (free[1] == stop).nonzero()
    expected_1 = free[1][: int(hits[0]) + 1] if len(hits) else free[1]
    assert torch.equal(stopped[1], expected_1)
    # The default stop tokens are the config's EOS ids.
    model.config.eos_token_id = stop
    assert torch.equal(generate(model, prompts[0], 30), free[0][: first + 1])
    assert torch.equal(naive_generate(model, prompts[0], 30), free[0][: first + 1])


def test_stream_generate_yields_what_generate_returns():
    model = tiny_model("sliding")
    p = prompt(9, seed=6)
    free = generate(model, p, 25, stop_token_ids=[])
    streamed = list(stream_generate(model, p, 25, stop_token_ids=[]))
    assert all(isinstance(t, int) for t in streamed) and streamed == free.tolist()
    stop = int(free[10])
    cut = list(stream_generate(model, p, 25, stop_token_ids=[stop]))
    assert cut == free[: int((free == stop).nonzero()[0]) + 1].tolist() and cut[-1] == stop


def test_generate_steps_yields_tokens_and_logits_per_step():
    model = tiny_model("mla")
    steps = list(generate_steps(model, [prompt(4, seed=7), prompt(6, seed=8)], 5))
    assert len(steps) == 5
    for tokens, logits in steps:
        assert tokens.shape == (2,) and logits.shape == (2, BASE["vocab_size"])
        assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_same_tokens():
    model = tiny_model("gqa")
    p = prompt(5, seed=9)
    kwargs = dict(temperature=1.5, top_k=50, top_p=0.95, stop_token_ids=[])
    a = generate(model, p, 30, seed=123, **kwargs)
    assert torch.equal(a, generate(model, p, 30, seed=123, **kwargs))
    assert torch.equal(a, naive_generate(model, p, 30, seed=123, **kwargs))  # same logits, same draws
    assert not torch.equal(a, generate(model, p, 30, seed=124, **kwargs))
    assert not torch.equal(a, generate(model, p, 30, **{**kwargs, "temperature": 0.0}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=2.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=90), "context window"),  # 10 + 90 > max_seq_len = 96
    ],
)
def test_generate_rejects_bad_arguments(kwargs, match):
    model = tiny_model("gqa")
    args = {"max_new_tokens": 4, **kwargs}
    for use_cache in (True, False):
        with pytest.raises(ValueError, match=match):
            generate(model, prompt(10, seed=0), use_cache=use_cache, **args)


def test_generate_rejects_bad_prompts():
    model = tiny_model("gqa")
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [5, 128], 4)
    with pytest.raises(ValueError, match="1-D"):
        generate(model, torch.zeros(1, 2, 3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="one prompt"):
        next(stream_generate(model, [[1, 2], [3]], 4))


def test_greedy_matches_transformers_llama():
    """Our generate on the weights of a random Hugging Face Llama equals its greedy `generate`."""
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=96,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for param in hf.parameters():  # larger weights than HF's init, so logits are far from ties
            param.normal_(0.0, 0.2)
    ours = TransformerLM(ModelConfig.from_hf(hf_config.to_dict())).eval()
    renames = [
        ("model.embed_tokens.", "embed."),
        ("model.norm.", "norm."),
        ("model.layers.", "layers."),
        ("self_attn.", "attn."),
        ("input_layernorm.", "attn_norm."),
        ("post_attention_layernorm.", "mlp_norm."),
    ]
    state = {}
    for name, value in hf.state_dict().items():
        for old, new in renames:
            name = name.replace(old, new)
        state[name] = value
    ours.load_state_dict(state)

    p = prompt(7, seed=30)
    with torch.no_grad():
        out = hf.generate(
            p[None],
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    hf_tokens = out.sequences[0, len(p) :]
    hf_logits = torch.cat(out.logits)
    tokens, logits = generate(ours, p, 20, return_logits=True, stop_token_ids=[])
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)


@pytest.fixture
def no_large_allocation(monkeypatch):
    """Make torch.empty / zeros / full refuse more than 10M elements (an 8 TB request fails at once)."""
    limit = 10_000_000

    def guarded(fn, takes_fill: bool):
        def wrapper(*args, **kwargs):
            size = args[:-1] if takes_fill else args  # torch.full(size, fill_value)
            dims = size[0] if len(size) == 1 and isinstance(size[0], tuple | list | torch.Size) else size
            numel = 1
            for d in dims:
                numel *= int(d)
            assert numel <= limit, f"allocation of {numel} elements before the arguments were validated"
            return fn(*args, **kwargs)

        return wrapper

    for name in ("empty", "zeros", "full"):
        monkeypatch.setattr(torch, name, guarded(getattr(torch, name), takes_fill=name == "full"))


def consume(result):
    """Run a generator (stream_generate / generate_steps) to its first step, if it is one."""
    if not isinstance(result, torch.Tensor | list):
        next(iter(result))


@pytest.mark.parametrize("max_new_tokens", [-1, 0, 10**12, 2.5, True])
@pytest.mark.parametrize(
    "fn", [generate, naive_generate, stream_generate, generate_steps], ids=lambda f: f.__name__
)
def test_bad_max_new_tokens_is_one_value_error_before_any_allocation(fn, max_new_tokens, no_large_allocation):
    model = tiny_model("gqa")
    with pytest.raises(ValueError, match="max_new_tokens|context window") as e:
        fn(model, prompt(10, seed=0), max_new_tokens)  # raised by the call itself, before any step
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "fn", [generate, naive_generate, stream_generate, generate_steps], ids=lambda f: f.__name__
)
def test_context_window_is_checked_when_called(fn):
    model = tiny_model("gqa")
    with pytest.raises(ValueError, match="context window"):
        fn(model, prompt(10, seed=0), 87)  # 10 + 87 > 96
    consume(fn(model, prompt(10, seed=0), 86))  # 10 + 86 = 96 fits


def test_one_sampling_params_drives_generate_stream_and_speculative():
    """SamplingParams is the one type for the settings: generate, stream_generate and
    speculative_generate give with params= what they give with the same keywords; both at once, or a
    bad setting, is a ValueError (one place checks them: SamplingParams.validate)."""
    from cs336_inference import SamplingParams
    from cs336_inference.sampling import stream_generate
    from cs336_inference.speculative import speculative_generate

    model = tiny_model("gqa")
    ids = prompt(6, seed=3)
    settings = dict(max_new_tokens=9, temperature=0.8, top_k=20, top_p=0.9, seed=5, stop_token_ids=[])
    params = SamplingParams(**settings)
    assert torch.equal(generate(model, ids, params=params), generate(model, ids, **settings))
    assert list(stream_generate(model, ids, params=params)) == generate(model, ids, **settings).tolist()
    greedy = SamplingParams(max_new_tokens=9, stop_token_ids=())
    assert torch.equal(
        speculative_generate(model, model, ids, k=3, params=greedy), generate(model, ids, params=greedy)
    )
    with pytest.raises(ValueError, match="not both .*temperature"):
        generate(model, ids, temperature=0.5, params=params)
    for bad, match in (
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(seed=1.5), "seed"),
        (SamplingParams(stop_token_ids=["x"]), "stop_token_ids"),
    ):
        with pytest.raises(ValueError, match=match):
            generate(model, ids, params=bad)
    assert SamplingParams().stops(model.config) == tuple(model.config.eos_token_ids)
    assert SamplingParams(stop_token_ids=[3]).stops(model.config) == (3,)

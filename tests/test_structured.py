"""Structured output: the grammar's mask (structured.py) in generate, the engine and the server.

The outputs are checked by the `jsonschema` package (nobody here wrote it): over the 25 schemas of
evals/json_schemas.json (nested objects, arrays, enums, numbers, strings with patterns, $ref,
anyOf, const), SmolLM2 sampling at temperature 1 writes JSON that parses and validates, every
time, through the engine and through the server; the same prompts without the mask mostly do
not (the negative control). The first mask of an enum is compared with the tokens that begin one
of its values, found by brute force over the vocabulary.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from cs336_inference.bench.grammar import load_schemas, schema_prompt  # noqa: E402
from cs336_inference.io.checkpoint import default_model_path, load_pretrained  # noqa: E402
from cs336_inference.io.tokenizer import load_tokenizer  # noqa: E402
from cs336_inference.sampling import SamplingParams, generate  # noqa: E402
from cs336_inference.serving import LLMEngine  # noqa: E402
from cs336_inference.serving.choices import TokenStrings  # noqa: E402
from cs336_inference.structured import JsonGrammar  # noqa: E402

SCHEMAS = load_schemas()


@pytest.fixture(scope="module")
def smollm2():
    path = default_model_path()
    return load_pretrained(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def fast_smollm2():
    """The same model on the fast path (the engine's paged native step, as the server runs it)."""
    from cs336_inference.fast import install

    path = default_model_path()
    return install(load_pretrained(path).eval()), load_tokenizer(path)


@pytest.fixture(scope="module")
def grammar(smollm2):
    return JsonGrammar(smollm2[1])


def reply_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in tokenizer.eos_token_ids else ids)


def check(schema, text: str) -> str | None:
    """None if text is JSON the schema accepts, else why not."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def test_at_least_20_schemas():
    assert len(SCHEMAS) >= 20
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)  # each is a valid schema


def test_the_first_mask_of_an_enum_is_the_tokens_that_begin_a_value(smollm2, grammar):
    _, tokenizer = smollm2
    schema = SCHEMAS["weekday"]
    values = [json.dumps(v) for v in schema["enum"]]
    strings = TokenStrings(tokenizer)
    special = set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    expected = {
        t
        for t in range(tokenizer.vocab_size)
        if t not in special
        and (text := strings.bytes(t).decode("utf-8", "replace"))
        and any(v.startswith(text) for v in values)
    }
    allowed = set(grammar.matcher(schema).allowed().nonzero().flatten().tolist())
    assert allowed == expected, (
        f"only in the mask: {sorted(allowed - expected)[:10]}, missing: {sorted(expected - allowed)[:10]}"
    )


def test_a_complete_value_allows_only_the_end_of_sequence(smollm2, grammar):
    _, tokenizer = smollm2
    m = grammar.matcher(SCHEMAS["point"])
    for t in tokenizer.encode('{"x":3,"y":-7}', add_special_tokens=False):
        assert bool(m.allowed()[t]), f"token {t} of a valid value was masked"
        m.accept(t)
    assert m.done and m.allowed().nonzero().flatten().tolist() == tokenizer.eos_token_ids


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "("}, "regex"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
        ("not a schema", "must be"),
    ],
)
def test_a_schema_that_does_not_compile_is_a_one_line_error(grammar, schema, why):
    with pytest.raises(ValueError, match=why) as e:
        grammar.compile(schema)
    assert "\n" not in str(e.value)


def test_engine_samples_valid_json_for_every_schema_and_the_unmasked_control_fails(fast_smollm2, grammar):
    model, tokenizer = fast_smollm2
    engine = LLMEngine(model, num_blocks=256, block_size=16, max_batch_tokens=32, grammar=grammar)
    prompts = [schema_prompt(tokenizer, s) for s in SCHEMAS.values()]
    params = [
        SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, n=2, json_schema=s)
        for i, s in enumerate(SCHEMAS.values())
    ]
    runs = engine.run(prompts, params)
    for (name, schema), samples in zip(SCHEMAS.items(), runs, strict=True):
        for s in samples:
            text = reply_text(tokenizer, s.new_token_ids)
            assert s.finish_reason == "stop", f"{name}, sample {s.index}: ran out of tokens: {text!r}"
            assert check(schema, text) is None, f"{name}, sample {s.index}: {check(schema, text)}: {text!r}"
    assert engine.stats()["free_blocks"] == 256

    control = list(SCHEMAS.values())[:12]  # the same prompts, no mask: most replies are not valid
    free = [SamplingParams(max_new_tokens=40, temperature=1.0, seed=i) for i in range(len(control))]
    texts = [
        reply_text(tokenizer, ids)
        for ids in LLMEngine(model, max_batch_tokens=32).generate(prompts[: len(control)], free)
    ]
    failures = sum(check(s, t) is not None for s, t in zip(control, texts, strict=True))
    assert failures >= len(control) // 2, f"without the mask only {failures} of {len(control)} replies fail"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_equals_generate_with_the_same_matcher(smollm2, grammar, temperature):
    model, tokenizer = smollm2
    names = ["nested_address", "shape_union"]
    prompts = [schema_prompt(tokenizer, SCHEMAS[n]) for n in names]
    params = [
        SamplingParams(max_new_tokens=50, temperature=temperature, seed=i, json_schema=SCHEMAS[n])
        for i, n in enumerate(names)
    ]
    served = LLMEngine(model, max_batch_tokens=64, grammar=grammar).generate(prompts, params)
    for name, prompt, p, got in zip(names, prompts, params, served, strict=True):
        alone = generate(model, prompt, params=p, constraints=[grammar.matcher(SCHEMAS[name])]).tolist()
        assert got == alone, (
            f"{name} at temperature {temperature}: the engine's tokens differ from generate's"
        )


def test_generate_without_a_grammar_refuses_json_schema_in_the_engine(smollm2):
    model, tokenizer = smollm2
    with pytest.raises(ValueError, match="grammar"):
        LLMEngine(model).add_request([1, 2, 3], SamplingParams(json_schema=True))


# ------------------------------------------------------------------ through the server
@pytest.fixture(scope="module")
def server(fast_smollm2):
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from test_server import Server, running

    torch.manual_seed(0)
    model, tokenizer = fast_smollm2
    yield from running(
        Server(model, tokenizer, LLMEngine(model, num_blocks=256, block_size=16, max_batch_tokens=32))
    )


def test_server_response_format_json_schema_on_both_endpoints(server):
    from test_server import MODEL

    def ask(item):
        i, (name, schema) = item
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        if i % 2:
            out = server.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Reply with JSON for: " + json.dumps(schema)}],
                max_tokens=200, temperature=1.0, seed=i, response_format=fmt,
            )  # fmt: skip
            return name, out.choices[0].finish_reason, out.choices[0].message.content
        out = server.client.completions.create(
            model=MODEL, prompt=f"A JSON value for the schema {json.dumps(schema)}:\n", max_tokens=200,
            temperature=1.0, seed=i, extra_body={"response_format": fmt},
        )  # fmt: skip
        return name, out.choices[0].finish_reason, out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, enumerate(SCHEMAS.items())))
    for name, finish, text in replies:
        assert finish == "stop", f"{name}: ran out of tokens: {text!r}"
        assert check(SCHEMAS[name], text) is None, f"{name}: {check(SCHEMAS[name], text)}: {text!r}"
    ended = []  # any JSON object: a small model may go on (and greedy loops), so a few seeds
    for seed in range(6):
        out = server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe Paris in JSON."}], max_tokens=80,
            temperature=1.0, seed=seed, response_format={"type": "json_object"},
        )  # fmt: skip
        text = out.choices[0].message.content
        assert text.startswith('{"'), f"json_object, seed {seed}: {text!r}"
        if out.choices[0].finish_reason == "stop":
            ended.append(json.loads(text))
    assert ended and all(isinstance(v, dict) for v in ended), f"json_object: {ended}"


BAD_FORMATS = {
    "unknown type": {"type": "xml"},
    "not an object": "json",
    "schema missing": {"type": "json_schema", "json_schema": {"name": "x"}},
    "does not compile": {
        "type": "json_schema",
        "json_schema": {"schema": {"type": "array", "uniqueItems": True}},
    },
    "bad regex": {"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(["}}},
}


@pytest.mark.parametrize("case", list(BAD_FORMATS))
def test_server_bad_response_format_is_a_400(server, case):
    from test_server import MODEL

    for path, body in [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        status, reply = server.post(
            path, {"model": MODEL, "max_tokens": 4, "response_format": BAD_FORMATS[case], **body}
        )
        assert status == 400 and reply["error"]["param"] == "response_format", (
            f"{case} on {path}: {status} {reply}"
        )
    out = server.client.completions.create(model=MODEL, prompt="still serving", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")

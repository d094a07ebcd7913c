"""Structured output: sampling only what a JSON schema allows.

Before each token is drawn, the grammar says which tokens can continue the text so far into
something the schema accepts; every other token's logit becomes -inf (`sampling.constrain`), so
greedy and sampled decoding alike can only write valid JSON, and the end-of-sequence token is
allowed only once the value is complete. The tokens drawn are then fed back to the grammar.

The grammar engine is llguidance (PyPI `llguidance`, the Rust library behind Guidance and vLLM's
guidance backend): it compiles a schema in well under a millisecond and computes the next-token
mask lazily over SmolLM2's 49K tokens in microseconds (`scripts/benchmark.py grammar` measures it
beside outlines-core). JSON is written compactly (no free whitespace), so a model cannot wander
into endless blank space.

    grammar = JsonGrammar(tokenizer)          # once per tokenizer
    matcher = grammar.matcher(schema)         # per sequence; schema True: any JSON object
    tokens = generate(model, ids, constraints=[matcher])
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool
from torch import Tensor

ANY_OBJECT = {"type": "object"}


def _schema_text(schema: dict | bool) -> str:
    if schema is True:
        schema = ANY_OBJECT
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object (or True for any JSON object), got {schema!r}")
    # compact JSON: no whitespace between tokens, the separators OpenAI's examples use
    return json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}})


class JsonGrammar:
    """Compiles JSON schemas for one tokenizer (the token bytes llguidance matches against)."""

    def __init__(self, tokenizer, eos_token_ids: list[int] | None = None):
        try:
            import llguidance
        except ImportError:
            raise ValueError(
                "structured output needs the llguidance package: pip install llguidance"
            ) from None
        self._llg = llguidance
        eos = list(eos_token_ids or tokenizer.eos_token_ids)
        self.vocab_size = tokenizer.vocab_size
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos[0] if len(eos) == 1 else eos
        )
        self._compiled: dict[str, str] = {}

    def compile(self, schema: dict | bool) -> str:
        """The grammar of a schema (cached); ValueError (one line) for one it cannot compile."""
        text = _schema_text(schema)
        grammar = self._compiled.get(text)
        if grammar is None:
            llg = self._llg
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(text)
            except Exception as e:
                raise ValueError(f"the JSON schema does not compile: {_one_line(e)}") from None
            ok, error = _validate(llg, grammar, self.tokenizer)
            if not ok:
                raise ValueError(f"the JSON schema does not compile: {_one_line(error)}")
            if len(self._compiled) > 256:  # a server sees many schemas: keep the latest
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[text] = grammar
        return grammar

    def matcher(self, schema: dict | bool) -> JsonMatcher:
        """A fresh matcher (the empty text) for one sequence."""
        return JsonMatcher(self._llg.LLMatcher(self.tokenizer, self.compile(schema)), self.vocab_size)


def _validate(llg, grammar: str, tokenizer) -> tuple[bool, str]:
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return (not is_error), "; ".join(messages) if messages else ""


def _one_line(e: Any) -> str:
    return " ".join(str(e).split())[:300]


class JsonMatcher:
    """One sequence's place in the grammar: which tokens may come next, and the tokens so far."""

    def __init__(self, matcher, vocab_size: int):
        self._m, self.vocab_size = matcher, vocab_size
        self._words = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def allowed(self) -> Bool[Tensor, " V"]:
        """True for every token that can come next (only end-of-sequence once the value is done)."""
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        # bit j of word w is token 32 w + j: little-endian words, so byte by byte, low bit first
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.vocab_size]
        return torch.from_numpy(bits.view(np.bool_))

    def accept(self, token_id: int) -> None:
        if not self._m.consume_token(int(token_id)):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The value is complete and nothing more can follow."""
        return self._m.is_stopped()

    def copy(self) -> JsonMatcher:
        """An independent matcher in the same state (a forked sample's)."""
        return JsonMatcher(self._m.deep_copy(), self.vocab_size)

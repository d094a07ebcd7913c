"""One choice of an OpenAI-style reply: its text as it streams, and its log-probabilities in the two
shapes the API has.

    TextStream            token ids in, text deltas out (io/detokenize.py: half characters and what
                          could begin a stop string held back); the stop token is counted, not shown
    completion_logprobs   /v1/completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"},
                          parallel lists, one entry per token (with echo the prompt's first: null)
    chat_logprobs         /v1/chat/completions: {"content": [{"token", "logprob", "bytes",
                          "top_logprobs": [...]}, ...]}

A token's text is its bytes decoded as UTF-8. A byte-level BPE token can hold part of a character;
its text is then "bytes:" followed by the bytes as \\xNN escapes (vLLM's spelling), and "bytes" in
a chat entry carries the exact bytes either way. text_offset counts the characters of the reply's
text that come before a token (a token inside a character gets the offset of that character).
"""

from __future__ import annotations

import codecs
import functools
import time

from ..io.detokenize import Detokenizer
from ..sampling import TokenLogprobs


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: bytes that are printable stand
    for themselves, the other 68 are moved to 256, 257, ... in byte order (GPT-2's table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenStrings:
    """Each token id's bytes and text for one tokenizer (cached)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.special: set[str] = set()
        if backend is not None:
            self.special = {t.content for t in backend.get_added_tokens_decoder().values()}
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._token_bytes(token_id)
        return raw

    def _token_bytes(self, token_id: int) -> bytes:
        if self.byte_level:
            piece = self.tokenizer.backend.id_to_token(token_id)
            alphabet = _byte_level_alphabet()
            if piece is not None and piece not in self.special and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Characters of text before each token, counted as the tokens come (an incremental UTF-8
    decoder), the text being `start` characters and then the tokens decoded."""

    def __init__(self, strings: TokenStrings, start: int = 0):
        self.strings, self.chars, self.offsets = strings, start, []
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> None:
        for token_id in ids:
            self.offsets.append(self.chars)
            self.chars += len(self.decoder.decode(self.strings.bytes(token_id)))


def text_offsets(strings: TokenStrings, ids: list[int], start: int = 0) -> list[int]:
    """Characters of text before each token, the text being start characters and then ids decoded."""
    counter = TextOffsets(strings, start)
    counter.push(ids)
    return counter.offsets


def completion_logprobs(
    strings: TokenStrings, entries: list[TokenLogprobs | None], ids: list[int], offsets: list[int]
) -> dict:
    """The completions API's logprobs object for these tokens (an entry None: the first prompt token)."""
    return {
        "tokens": [strings.text(t) for t in ids],
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else {strings.text(t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(strings: TokenStrings, entries: list[TokenLogprobs]) -> dict:
    """The chat API's logprobs object for these tokens."""

    def one(token_id: int, logprob: float) -> dict:
        return {"token": strings.text(token_id), "logprob": logprob, "bytes": list(strings.bytes(token_id))}

    return {
        "content": [
            one(e.token_id, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top]} for e in entries
        ]
    }


class TextStream:
    """A reply's token ids in, text deltas out (io/detokenize.py's Detokenizer: half characters and
    what could begin a stop string held back). The deltas concatenate to the final text, which leaves
    out the stop token that ended the reply, and ends before a stop string that did. The tokens'
    log-probability entries are kept (`logprobs`, `logprob_ids`), the stop token's included, as
    OpenAI and vLLM list it; after a stop string, no more."""

    def __init__(self, tokenizer, stop_ids: list[int], stop_strings: tuple[str, ...] = ()):
        self.stop_ids = set(stop_ids)
        self.detok = Detokenizer(tokenizer, stop_strings)
        self.finish_reason: str | None = None
        self.eos = 0
        self.logprobs: list[TokenLogprobs] = []  # one per token received, the stop token included
        self.logprob_ids: list[int] = []
        self.start, self.first, self.end = time.perf_counter(), None, None  # for /metrics

    @property
    def num_tokens(self) -> int:
        return len(self.detok.ids) + self.eos

    def push(
        self,
        new_ids: list[int],
        finished: bool,
        finish_reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> str:
        if new_ids and self.first is None:
            self.first = time.perf_counter()
        eos = finished and finish_reason == "stop" and bool(new_ids) and new_ids[-1] in self.stop_ids
        if logprobs is not None and not self.detok.stopped:
            self.logprobs += logprobs  # the stop token's too (what lm-eval's echo expects)
            self.logprob_ids += new_ids
        delta = self.detok.push(new_ids[:-1] if eos else new_ids, finished)
        if eos:
            self.eos = 1  # the stop token: counted in the usage, not decoded
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif finished:
            self.finish_reason = finish_reason or "length"
        if self.finish_reason is not None:
            self.end = time.perf_counter()
        return delta

    def text(self) -> str:
        return self.detok.text

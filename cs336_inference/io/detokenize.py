"""Token ids in, text out as it becomes final: streaming detokenization and stop strings.

A byte-level BPE token can end in the middle of a UTF-8 character, so the decoded text may end in
U+FFFD until the next token completes it: that tail is held back. A stop string ends generation at
its first occurrence in the decoded text, which is cut before it. It can be split across tokens
("\\n\\n" as two "\\n" tokens), so text that could still be the start of a stop string is held back
too, until the next tokens show that it is not (then it is sent) or that it is (then it is cut).
The CLI (`--stop`) and the server (`"stop"`) both stream through `Detokenizer`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_STOP_STRINGS = 4  # OpenAI's limit


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """The stop strings as a tuple; ValueError (one line) for more than 4, or an empty or non-string one."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list | tuple) else None
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop strings must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise ValueError("a stop string must not be empty")
    return tuple(stops)


def find_stop(text: str, stops: Iterable[str]) -> tuple[int, str] | None:
    """(where, which): the earliest occurrence of any stop string in text, or None."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found) if found else None


def partial_stop(text: str, stops: Iterable[str]) -> int:
    """Length of the longest end of text that is the beginning of a stop string (and not all of it)."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class Detokenizer:
    """Push token ids, get the text that became final (module docstring). After a stop string,
    `stop_string` says which one ended the text and pushing does nothing more."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, check_stop_strings(stop_strings)
        self.ids: list[int] = []
        self.text = ""  # sent so far: final
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def push(self, new_ids: Iterable[int], finished: bool = False) -> str:
        """Add ids; return the new final text. finished: no more ids will come (send what is held)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        hit = find_stop(text, self.stops)
        if hit is not None:
            text, self.stop_string, finished = text[: hit[0]], hit[1], True
        if not finished:
            if text.endswith("\ufffd"):
                return ""  # half a character: wait for the rest
            text = text[: len(text) - partial_stop(text, self.stops)]
        if not text.startswith(self.text):
            return ""  # byte-level BPE does not rewrite what it decoded before; never send a change
        delta, self.text = text[len(self.text) :], text
        return delta

"""Streaming detokenization and stop strings (io/detokenize.py), on tokenizers whose tokens are known:
one character per token, or one byte per token (UTF-8 split across tokens)."""

from __future__ import annotations

import pytest

from cs336_inference.io.detokenize import Detokenizer, check_stop_strings, partial_stop


class Chars:
    """Token i is the character chr(i)."""

    def decode(self, ids):
        return "".join(map(chr, ids))


class Bytes:
    """Token i is the byte i: a character of several bytes spans several tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(tok, pieces, stops, finish=True):
    """Push each piece's ids one token at a time; (the deltas, the Detokenizer)."""
    d = Detokenizer(tok, stops)
    deltas = []
    for piece in pieces:
        ids = list(map(ord, piece)) if isinstance(tok, Chars) else list(piece.encode())
        for i in ids:
            deltas.append(d.push([i]))
    if finish:
        deltas.append(d.push([], finished=True))
    return deltas, d


def test_a_stop_string_split_across_tokens_ends_the_text_before_it():
    deltas, d = feed(Chars(), "Hello\n\nWorld", ["\n\n"])
    assert d.text == "Hello" and d.stop_string == "\n\n" and "".join(deltas) == "Hello"
    assert deltas[5] == "", "the first newline could begin the stop string: held back"


def test_text_held_back_is_sent_once_it_cannot_begin_a_stop_string():
    deltas, d = feed(Chars(), "ab\nc", ["\n\n"], finish=False)
    assert deltas == ["a", "b", "", "\nc"] and not d.stopped
    deltas, d = feed(Chars(), "ab\n", ["\n\n"])
    assert deltas[-1] == "\n" and d.text == "ab\n" and not d.stopped, "held text is sent at the end"


def test_the_earliest_of_several_stop_strings_wins_and_overlaps_are_held():
    _, d = feed(Chars(), "xx aab yy END", ["END", "aab"])
    assert d.text == "xx " and d.stop_string == "aab"
    deltas, d = feed(Chars(), "aaab", ["aab"])  # "aa" held, then "a" sent when "aaa" shows it is not
    assert d.text == "a" and deltas[:3] == ["", "", "a"]
    assert partial_stop("xyzab", ["abc", "b"]) == 2


def test_nothing_more_is_sent_after_a_stop_string():
    d = Detokenizer(Chars(), ["!"])
    assert d.push(list(map(ord, "hi!"))) == "hi" and d.stopped
    assert d.push(list(map(ord, " more")), finished=True) == "" and d.text == "hi"


def test_half_a_character_waits_for_the_rest():
    deltas, d = feed(Bytes(), ["é", "€x"], [])
    assert deltas[:2] == ["", "é"] and deltas[2:4] == ["", ""] and deltas[4] == "€" and d.text == "é€x"
    _, d = feed(Bytes(), ["ab€€", "€cd"], ["€€€"])  # a stop string of multi-byte characters
    assert d.text == "ab" and d.stop_string == "€€€"


def test_without_stop_strings_the_deltas_are_the_text():
    text = "plain text, no stops.\n"
    deltas, d = feed(Chars(), text, [])
    assert "".join(deltas) == text == d.text and all(len(x) <= 1 for x in deltas)


@pytest.mark.parametrize(
    "stop, error",
    [(["a"] * 5, "at most 4"), ([""], "empty"), ([3], "strings"), (7, "strings")],
)
def test_bad_stop_strings_are_one_line_value_errors(stop, error):
    with pytest.raises(ValueError, match=error):
        check_stop_strings(stop)
    assert check_stop_strings("x") == ("x",) and check_stop_strings(None) == ()

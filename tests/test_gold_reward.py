"""The gold reward r* against its written definition (docs/posttraining.md, "The truth is known").

Each documented rule is a row of (reply, expected r*) taken from the doc; nothing is parsed. The
negative control is the old docs' reading ("the share of its lines 20-60 bytes long", "a byte that
is not printable text"), implemented here: it must give other answers on the edge cases, so the
table tells the two definitions apart."""

from __future__ import annotations

import re

import pytest

from tpulab.data.preference import gold_reward

PROMPT = b"ROMEO.\nWhat light?\n\nJULIET.\n"  # cue speaker ROMEO: the stem is "rome"
ETX = b"\x03"
X = b"x"

# (rule, reply, r*): every row follows from one bullet of the written definition
CASES = [
    # the body: before the first stop byte wherever it is, else the first 96 bytes
    ("empty reply, no stop", b"", 0.0),
    ("after the stop byte nothing counts", X * 30 + ETX + b"\xff Romeo", 2.0),
    ("no stop: only the first 96 bytes", X * 30 + b"\n" + b" " * 65 + b"\xc3\xa9", 1.0),
    ("no stop: a name past byte 96 is not read", b" " * 96 + b"Romeo", 0.0),
    ("a late stop still ends the body", X * 30 + b"\n" + b"y" * 70 + ETX, 0.5),
    # it stops: first stop byte at offset <= 96
    ("a bare stop byte stops", ETX, 1.0),
    ("stop at offset 96 stops", X * 96 + ETX, 1.0),
    ("stop at offset 97 does not", X * 97 + ETX, 0.0),
    # verse-like lines: byte lengths 20..60 inclusive, whitespace-only lines left out
    ("19 bytes is not verse", X * 19, 0.0),
    ("20 bytes is verse", X * 20, 1.0),
    ("60 bytes is verse", X * 60 + ETX, 2.0),
    ("61 bytes is not verse", X * 61 + ETX, 1.0),
    ("a whitespace-only reply has no line", b" " * 25, 0.0),
    ("a tab-only reply has no line", b"\t" * 25, 0.0),
    ("a whitespace-only line is left out", X * 25 + b"\n" + b" " * 5, 1.0),
    ("a 25-space line is left out too", X * 25 + b"\n" + b" " * 25, 1.0),
    ("an empty line is left out", X * 25 + b"\n\n" + b"y" * 10, 0.5),
    ("spaces count in a line's length", b" " * 10 + X * 10, 1.0),
    ("lengths are bytes, not letters", "é".encode() * 10 + ETX, 1.0),
    # names the cue's speaker: stem "rome" starting a word
    ("names the speaker", b"Romeo" + ETX, 1.5),
    ("case-insensitive", b"ROMEO!" + ETX, 1.5),
    ("the stem need not end a word", b"Romer" + ETX, 1.5),
    ("after a letter is not a name", b"aromeo" + ETX, 1.0),
    ("after a digit starts a word", b"1romeo" + ETX, 1.5),
    ("three letters do not name", b"Rom" + ETX, 1.0),
    # not text: a byte outside 0x20-0x7E, tab, LF
    ("UTF-8 e-acute is not text", b"caf\xc3\xa9" * 5, 0.0),
    ("CR is part of a line and not text", X * 25 + b"\r" + ETX, 1.0),
    ("NUL is not text", b"\x00", -1.0),
    ("the top: stops, verse, names, text", b"Romeo, " + X * 23 + ETX, 2.5),
]


def old_docs_reading(prompt: bytes, reply: bytes) -> float:
    """The old docs, read plainly: every line counts; printable means printable characters."""
    stop = reply.find(ETX)
    body = reply[:stop] if stop >= 0 else reply
    stopped = 0 <= stop <= 96
    lines = body.split(b"\n")
    verse = sum(20 <= len(line) <= 60 for line in lines) / len(lines)
    stem = prompt.split(b"\n", 1)[0].rstrip(b".")[:4].lower()
    named = re.search(rb"(?<![a-z])" + re.escape(stem), body.lower()) is not None
    try:
        text = all(c.isprintable() or c in "\n\t" for c in body.decode("utf-8"))
    except UnicodeDecodeError:
        text = False
    return float(stopped) + verse + 0.5 * float(named) - (0.0 if text else 1.0)


@pytest.mark.parametrize(("rule", "reply", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_gold_reward_follows_each_written_rule(rule, reply, expected):
    assert gold_reward(PROMPT, reply) == expected, rule


def test_an_empty_cue_speaker_names_no_one():
    assert gold_reward(b".\nWho?\n\nJULIET.\n", b"Anyone" + ETX) == 1.0


def test_the_table_tells_the_old_reading_from_the_written_one():
    differs = {rule for rule, reply, r in CASES if old_docs_reading(PROMPT, reply) != r}
    # the edge cases of issue 37: whitespace-only lines and non-ASCII letters
    assert {
        "a whitespace-only reply has no line",
        "a whitespace-only line is left out",
        "UTF-8 e-acute is not text",
        "no stop: only the first 96 bytes",
    } <= differs
    assert old_docs_reading(PROMPT, b" " * 25) == 1.0
    assert old_docs_reading(PROMPT, X * 25 + b"\n" + b" " * 5) == 0.5
    # a fair control: on ordinary replies the two readings agree
    same = {rule for rule, *_ in CASES} - differs
    assert {"names the speaker", "the top: stops, verse, names, text", "20 bytes is verse"} <= same

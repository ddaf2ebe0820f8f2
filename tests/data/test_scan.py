"""Tests of mtcli.data.scan: numpy finds every line and counts its words as ``str.split`` does
(or its characters other than spaces), pandas hashes the lines, and spans of a block are taken
in order."""

from __future__ import annotations

import numpy as np
import pytest

from mtcli.data import scan
from mtcli.data.scan import (
    line_ends,
    line_hashes,
    line_layout,
    numpy_lines,
    take_spans,
    text_length,
)

# Every character str.split() splits on but the line end, and some that look alike but are not.
SPACES = [chr(c) for c in range(0x110000) if chr(c).isspace() and c != 10]
PIECES = [*SPACES, "a", "Hund", "über", "日本", "🙂", "\u200b", "\ufeff", "\x00", "\x7f", "\u00a1", "\u2010", "x" * 17]


def _block(lines: list[str], ended: bool = True) -> bytes:
    return ("\n".join(lines) + ("\n" if ended else "")).encode()


def test_every_python_space_is_known_and_none_is_above_u3000() -> None:
    assert max(map(ord, SPACES)) <= 0x3000
    assert scan._WIDE_LEADS == [0xC2, 0xE1, 0xE2, 0xE3]  # the first bytes _wide_space_lines looks for


@pytest.mark.parametrize("characters", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_line_layout_finds_every_line_and_its_length(seed: int, characters: bool) -> None:
    rng = np.random.default_rng(seed)
    alphabet = ["a", "bc", "ä", "“", "\u2029x", " ", "  ", "\t", "\x1c", "\x01", "猫", "🙂", *SPACES[::7],
                "\u200b", "\u200f", "\ufeff", "\U000e0020", "\u0600", "\u00ad"]
    lines = ["".join(rng.choice(alphabet, size=rng.integers(0, 12))) for _ in range(300)]
    for ended in (True, False):
        block = "\n".join(lines).encode() + (b"\n" if ended else b"")
        stops, counts = line_layout(block, characters)
        starts = [0, *stops[:-1].tolist()]
        assert [block[a:b].rstrip(b"\n").decode() for a, b in zip(starts, stops.tolist(), strict=True)] == lines
        assert counts.tolist() == [text_length(line, characters) for line in lines]
    assert [len(x) for x in line_layout(b"", characters)] == [0, 0]


def test_the_format_characters_looked_for_are_every_one_unicode_has() -> None:
    """Looked for in the first two planes and the tags only: this Python's Unicode has none elsewhere."""
    import unicodedata

    assert scan._format_characters().tolist() == [c for c in range(0x110000) if unicodedata.category(chr(c)) == "Cf"]


@pytest.mark.parametrize("characters", [False, True])
def test_a_line_of_invisible_format_characters_alone_is_empty(characters: bool) -> None:
    """A side of zero-width spaces or direction marks alone (U+200B, U+200F) passed the empty
    rule as a word, and was kept with no token at all."""
    empty = ["\u200b", "\u200f", " \u200b \u200e ", "\ufeff", "\u2060\u2060", "\u00ad", "\U000e0001", "\u200b\u3000"]
    text = ["\u200bhallo", "hallo\u200b", "\u200f\u0645\u0631\u062d\u0628\u0627", " \u200b x", "猫\u200b", "\u00ad-"]
    assert [text_length(line, characters) for line in empty] == [0] * len(empty)
    assert all(text_length(line, characters) > 0 for line in text)
    block = "\n".join([*empty, *text]).encode()
    assert line_layout(block, characters)[1].tolist() == [text_length(line, characters) for line in [*empty, *text]]
    from mtcli.data.cleaning import PairCleaner

    cleaner = PairCleaner(max_length=100, max_ratio=3.0, characters=(False, characters))
    assert list(cleaner([("Thanks.", "\u200f"), ("Thank you very much for this.", "\u200b")])) == []
    assert cleaner.counts.empty == 2 and cleaner.counts.ratio == 0  # the second was a ratio drop


@pytest.mark.parametrize("ended", [True, False])
def test_word_counts_equal_str_split(ended: bool) -> None:
    lines = ["", " ", "a", " a  b ", "a\tb", "ä ö ü", "“quoted” text", "\x01 x\x02", "\x1f", "end"]
    lines += [f"a{space}b" for space in SPACES] + [f"{space}x{space}" for space in SPACES]
    block = "\n".join(lines).encode() + (b"\n" if ended else b"")
    assert line_layout(block)[1].tolist() == [len(line.split()) for line in lines]
    assert line_layout(b"")[1].tolist() == []


@pytest.mark.parametrize("ended", [True, False])
def test_character_counts_leave_out_every_space(ended: bool) -> None:
    lines = ["", " ", "一只猫在玩", "一只 猫\u3000在玩", "日本語のテキスト", "Straße 🙂", "a\u00a0b", "\x01x"]
    lines += [f"猫{space}狗" for space in SPACES]
    block = "\n".join(lines).encode() + (b"\n" if ended else b"")
    want = [len("".join(ch for ch in line if not ch.isspace())) for line in lines]
    assert line_layout(block, characters=True)[1].tolist() == want
    assert want[2:6] == [5, 5, 8, 7]




@pytest.mark.parametrize("ended", [True, False])
def test_numpy_lines_hash_each_line_as_its_text(ended: bool) -> None:
    lines = ["a b", "", "Straße", "日本 語", "a b"]
    got = numpy_lines(_block(lines, ended), hashes=True)
    assert got.lengths.tolist() == [2, 0, 1, 2, 2]
    assert numpy_lines(_block(lines, ended), hashes=False, characters=True).lengths.tolist() == [2, 0, 6, 3, 2]
    assert got.hashes.tolist() == line_hashes(lines).tolist() and got.hashes[0] == got.hashes[4]
    assert numpy_lines(_block(lines), hashes=False).hashes is None


def test_line_ends_and_spans_are_taken_in_order() -> None:
    block = b"one\ntwo\n\nfour\n"
    ends = line_ends(np.frombuffer(block, dtype=np.uint8))
    assert ends.tolist() == [4, 8, 9, 14]
    starts = np.concatenate(([0], ends[:-1]))
    picked = np.array([3, 0, 2])
    assert take_spans(block, starts[picked], ends[picked]) == b"four\none\n\n"

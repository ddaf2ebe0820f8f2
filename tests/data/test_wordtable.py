"""Tests of mtcli.data.wordtable: the C table gives each word the ids its encoder gave, keeps
the first ``max_words`` distinct words, and without a compiler says so once."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest

from mtcli.data import wordtable
from tests.native_cases import the_one_warning, without_compiler

needs_table = pytest.mark.skipif(not wordtable.available(), reason="no C compiler for the word table")
WORDS = ["a", "Hund", "über", "日本", "🙂", "x" * 40, "\u00a0", "\t", "ein", "die", "Straße", "."]


def _fake_ids(word: str) -> list[int]:
    """Ids that depend on the word only (a stand-in for SentencePiece)."""
    return [len(word) % 7 + 4, *(ord(c) % 900 + 10 for c in word[:3])]


@needs_table
@pytest.mark.parametrize("max_words", [1_000, 5, 0])
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_every_word_gets_its_ids_block_after_block(max_words: int, dtype) -> None:
    rng = random.Random(max_words)
    table = wordtable.WordTable(max_words)
    asked: list[str] = []

    def encode(words: list[str]) -> list[list[int]]:
        assert len(set(words)) == len(words)  # each new word once a block
        asked.extend(words)
        return [_fake_ids(w) for w in words]

    for _ in range(6):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(0, 9))) for _ in range(30)]
        lines += ["", " ", "a  b", " lead", "trail "]
        ids, lengths = table.encode_text("".join(line + "\n" for line in lines).encode(), encode, np.dtype(dtype))
        expected = [[i for word in line.split(" ") if word for i in _fake_ids(word)] for line in lines]
        assert lengths.tolist() == [len(e) for e in expected]
        assert ids.tolist() == [i for e in expected for i in e] and ids.dtype == np.dtype(dtype)
        assert len(table) <= max_words
    if max_words == 1_000:  # room for every word: each was encoded once in all
        assert len(asked) == len(set(asked))
    unended, _ = table.encode_text(b"a b", encode, np.dtype(dtype))
    assert unended.tolist() == _fake_ids("a") + _fake_ids("b")


def test_without_a_compiler_the_word_table_warns_once(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with without_compiler(monkeypatch, tmp_path, wordtable._library), caplog.at_level(logging.WARNING, logger="mtcli"):
        assert not wordtable.available() and not wordtable.available()
        warning = the_one_warning(caplog)
        assert "word table unavailable" in warning and "no-such-compiler" in warning
        with pytest.raises(RuntimeError, match="not available"):
            wordtable.WordTable(10)


@needs_table
@pytest.mark.parametrize("seed", range(3))
def test_words_that_differ_in_one_byte_anywhere_stay_apart(seed: int) -> None:
    """Words of 1-40 bytes that differ in one byte only (inside or past the first 8, at the
    end), over several of the scan's 4 KiB windows, the last word ending the text: each word
    is asked for once and gets its own ids."""
    rng = random.Random(seed)
    stems = ["".join(rng.choice("abcdeäöü日") for _ in range(rng.randrange(1, 40))) for _ in range(60)]
    words = sorted({stem[:k] + ch + stem[k + 1:] for stem in stems for k in (0, len(stem) // 2, len(stem) - 1)
                    for ch in "xyz"})
    number = {word: i for i, word in enumerate(words)}
    lines = [" ".join(rng.choice(words) for _ in range(rng.randrange(1, 12))) for _ in range(800)]
    lines[-1] += " " + max(words, key=len)
    asked: list[str] = []

    def encode(batch: list[str]) -> list[list[int]]:
        asked.extend(batch)
        return [[number[w] + 4, len(w)] for w in batch]

    text = "\n".join(lines).encode()
    ids, lengths = wordtable.WordTable(10_000).encode_text(text, encode, np.dtype(np.int32))
    assert len(text) > 3 * 4096 and len(asked) == len(set(asked))
    assert ids.tolist() == [i for line in lines for w in line.split(" ") for i in (number[w] + 4, len(w))]
    assert lengths.tolist() == [2 * len(line.split(" ")) for line in lines]

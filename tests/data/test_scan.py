"""Tests of mtcli.data.scan: the C scanner gives what numpy and pandas give (line ends, word
counts as ``str.split``, line hashes), and declines exactly the blocks the reader must decode."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtcli.data import scan
from mtcli.data.scan import line_hashes, line_layout, scan_lines
from tests.native_cases import python_utf8, short_utf8_samples, the_one_warning, without_compiler

needs_scanner = pytest.mark.skipif(not scan.available(), reason="no C compiler for the line scanner")

# Every character str.split() splits on but the line end, and some that look alike but are not.
SPACES = [chr(c) for c in range(0x110000) if chr(c).isspace() and c != 10]
PIECES = [*SPACES, "a", "Hund", "über", "日本", "🙂", "\u200b", "\ufeff", "\x00", "\x7f", "\u00a1", "\u2010", "x" * 17]


def _block(lines: list[str], ended: bool = True) -> bytes:
    return ("\n".join(lines) + ("\n" if ended else "")).encode()


@needs_scanner
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ended", [True, False])
def test_scan_equals_numpy_layout_and_pandas_hashes(seed: int, ended: bool) -> None:
    rng = random.Random(seed)
    lines = ["".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 25))) for _ in range(500)]
    lines = [line.replace("\r", " ") for line in lines] + ["last"]
    block = _block(lines, ended)
    got = scan_lines(block, hashes=True)
    stops, words = line_layout(block + (b"" if ended else b"\n"))
    assert got is not None and len(got.stops) == len(lines)
    assert got.words.tolist() == words.tolist() == [len(line.split()) for line in lines]
    assert got.stops.tolist() == (stops if ended else np.append(stops[:-1], len(block))).tolist()
    assert got.hashes.tolist() == line_hashes([line.encode() for line in lines]).tolist()
    assert scan_lines(block, hashes=False).hashes is None


@needs_scanner
def test_strict_declines_what_the_reader_changes_and_the_rest_does_not() -> None:
    assert scan_lines(b"a\rb\n", True, strict=True) is None
    assert scan_lines(b"a\rb\n", True).words.tolist() == [2]  # Arrow's rows: a CR is a space
    bom = "\ufeffa b\n".encode()
    assert scan_lines(bom, True, strict=True, file_start=True) is None
    assert scan_lines(bom, True, strict=True).words.tolist() == [2]  # not the file's first line
    empty = scan_lines(b"", True, strict=True, file_start=True)
    assert empty is not None and len(empty.stops) == 0


@needs_scanner
def test_scan_accepts_utf8_as_python_does_on_every_short_sequence() -> None:
    """Every 1- and 2-byte sequence, and 3- and 4-byte ones over every lead and second byte:
    the scanner declines a block exactly when Python's strict decoder would fail on it."""
    samples = [raw for raw in short_utf8_samples() if b"\r" not in raw]
    wrong = [raw for raw in samples if (scan_lines(b"ok " + raw + b" ok", False) is not None) != python_utf8(raw)]
    assert not wrong, wrong[:10]


@needs_scanner
@given(st.binary(max_size=64))
@settings(max_examples=300)
def test_scan_on_any_bytes_agrees_with_python(raw: bytes) -> None:
    got = scan_lines(raw, hashes=True)
    assert (got is not None) == python_utf8(raw)
    if got is not None:
        lines = raw.split(b"\n")
        lines = lines[:-1] if raw.endswith(b"\n") or not raw else lines
        assert got.words.tolist() == [len(line.decode().split()) for line in lines]
        assert got.hashes.tolist() == line_hashes(lines).tolist()


def test_without_the_scanner_scan_lines_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scan, "_library", lambda: None)
    assert scan_lines(b"a b\n", hashes=True) is None


@needs_scanner
@pytest.mark.parametrize("piece", ["\u00a0", "\u3000", "\u2003", "\u1680", "ü", "“", "日", "🙂", "\u0085", "a"])
def test_characters_across_every_64_byte_boundary(piece: str) -> None:
    """The scanner reads 64 bytes at a time: a character (a word's or a space) that starts
    just before a boundary and ends after it is counted as str.split counts it."""
    lines = ["x" * k + piece + "y z" + piece * 3 for k in range(0, 140)]
    block = _block(lines)
    got = scan_lines(block, hashes=True)
    assert got is not None
    assert got.words.tolist() == [len(line.split()) for line in lines]
    assert got.hashes.tolist() == line_hashes(lines).tolist()
    assert got.stops.tolist() == line_layout(block)[0].tolist()


@needs_scanner
@pytest.mark.parametrize("at", [0, 5, 63, 64, 65, 127, 128, 200])
@pytest.mark.parametrize("bad", [b"\xff", b"\xc3", b"\xe2\x80", b"\xed\xa0\x80", b"\x80", b"\xf4\x90\x80\x80"])
def test_invalid_utf8_anywhere_is_declined(at: int, bad: bytes) -> None:
    block = b"a" * at + bad + b" b" * 100 + b"\n"
    assert scan_lines(block, hashes=False) is None
    assert scan_lines(b"a" * at + b"\r" + b" b" * 100 + b"\n", hashes=False, strict=True) is None


def test_every_python_space_is_known_and_none_is_above_u3000() -> None:
    assert max(map(ord, SPACES)) <= 0x3000
    assert scan._WIDE_LEADS == [0xC2, 0xE1, 0xE2, 0xE3]  # the first bytes _wide_space_lines looks for


@needs_scanner
@pytest.mark.parametrize("every", [1, 2, 3, 5, 33, 1000])
@pytest.mark.parametrize("seen", [0, 1, 4, 999])
def test_line_cuts_count_the_ends_and_find_every_nth(every: int, seen: int) -> None:
    """Blocks of random lengths whose lines are short and long (several ends in 32 bytes, and
    none in many), some with no line end at all: the count and the cuts are Python's."""
    rng = random.Random(every * 1000 + seen)
    for _ in range(40):
        size = rng.choice([0, 1, 31, 32, 33, 64, 65, 300, 5000])
        raw = bytes(rng.choice(b"\n" * rng.randint(0, 6) + b"abcdefgh") for _ in range(size))
        ends = [i + 1 for i, byte in enumerate(raw) if byte == 10]
        want = [end for k, end in enumerate(ends, start=seen + 1) if k % every == 0]
        count, cuts = scan.line_cuts(np.frombuffer(raw, dtype=np.uint8), every, seen)
        assert count == len(ends) and cuts.tolist() == want


@pytest.mark.parametrize("seed", range(5))
def test_line_layout_finds_every_line_and_its_words(seed: int) -> None:
    rng = np.random.default_rng(seed)
    alphabet = ["a", "bc", "ä", "“", "\u2029x", " ", "  ", "\t", "\x1c", "\x01", *SPACES[::7]]
    lines = ["".join(rng.choice(alphabet, size=rng.integers(0, 12))) for _ in range(300)]
    for ended in (True, False):
        block = "\n".join(lines).encode() + (b"\n" if ended else b"")
        stops, counts = line_layout(block)
        starts = [0, *stops[:-1].tolist()]
        assert [block[a:b].rstrip(b"\n").decode() for a, b in zip(starts, stops.tolist(), strict=True)] == lines
        assert counts.tolist() == [len(line.split()) for line in lines]
    assert [len(x) for x in line_layout(b"")] == [0, 0]


@pytest.mark.parametrize("ended", [True, False])
def test_word_counts_equal_str_split(ended: bool) -> None:
    lines = ["", " ", "a", " a  b ", "a\tb", "ä ö ü", "“quoted” text", "\x01 x\x02", "\x1f", "end"]
    lines += [f"a{space}b" for space in SPACES] + [f"{space}x{space}" for space in SPACES]
    block = "\n".join(lines).encode() + (b"\n" if ended else b"")
    assert line_layout(block)[1].tolist() == [len(line.split()) for line in lines]
    assert line_layout(b"")[1].tolist() == []


def test_without_a_compiler_the_scanner_warns_once(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with without_compiler(monkeypatch, tmp_path, scan._library), caplog.at_level(logging.WARNING, logger="mtcli"):
        assert not scan.available() and scan_lines(b"a b\n", hashes=True) is None
        warning = the_one_warning(caplog)
        assert "line scanner unavailable" in warning and "no-such-compiler" in warning


@pytest.mark.parametrize("in_c", [True, False])
def test_take_spans_joins_the_spans_in_order(monkeypatch: pytest.MonkeyPatch, in_c: bool) -> None:
    if in_c and not scan.available():
        pytest.skip("no C compiler for the line scanner")
    if not in_c:
        monkeypatch.setattr(scan, "_library", lambda: None)
    block = bytes(range(256)) * 3
    starts = np.array([0, 5, 5, 700, 10], dtype=np.int64)
    ends = np.array([3, 5, 9, 768, 11], dtype=np.int64)
    want = block[0:3] + block[5:9] + block[700:768] + block[10:11]
    assert scan.take_spans(block, starts, ends) == want
    assert scan.take_spans(memoryview(block), starts[:0], ends[:0]) == b""

"""mtcli.data.tsv: a .tsv file's pairs line by line, and the same pairs as blocks split by numpy."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mtcli.data.tsv import table_blocks, table_pairs
from mtcli.errors import DataError

LANGS = ("de", "en")


def blocks_as_pairs(path: Path, src_lang: str, block_bytes: int) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for src, tgt in table_blocks(path, LANGS, src_lang, block_bytes):
        assert all(side.endswith(b"\n") or not side for side in (src, tgt))
        sides = src.decode("utf-8").split("\n")[:-1], tgt.decode("utf-8").split("\n")[:-1]
        assert len(sides[0]) == len(sides[1])
        pairs += zip(*sides, strict=True)
    return pairs


EDGES = {
    "header, a line of three columns, one of none": b"de\ten\nein hund\ta dog\nzwei\tkatzen\tcats\nrot\n\nblau\tblue\n",
    "byte-order mark, CRLF, lone CR, last line unended": b"\xef\xbb\xbfde\ten\r\na\r\rb\tc\r\n\r\nx\ty\r",
    "byte-order mark, no header": b"\xef\xbb\xbfa\tb\nc\td",
    "tabs at the edges": b"\tb\na\t\n\t\n\t\t\n",
    "a header-like line later": b"a\tb\nde\ten\n",
    "only a header": b"de\ten\r\n",
    "wide characters": "über\tüber\n日本\t中文\r\n".encode(),
}


@pytest.mark.parametrize("data", EDGES.values(), ids=EDGES.keys())
@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_blocks_give_the_pairs_the_reader_gives(tmp_path: Path, data: bytes, gz: bool,
                                                caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / ("x.de-en.tsv.gz" if gz else "x.de-en.tsv")
    path.write_bytes(gzip.compress(data) if gz else data)
    for src_lang in LANGS:
        caplog.clear()
        want = list(table_pairs(path, LANGS, src_lang))
        warned = [r.getMessage() for r in caplog.records]
        for block_bytes in (1, 3, 1 << 20):  # blocks of one line each, and one block
            caplog.clear()
            assert blocks_as_pairs(path, src_lang, block_bytes) == want
            assert [r.getMessage() for r in caplog.records] == warned  # the count and the first line


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "ü", " ", "\t", "\r", "\n", "\r\n", "\ufeff", "de\ten"]), max_size=40),
       st.sampled_from(["", "de\ten\n", "\ufeffde\ten\r\n", "\ufeff"]), st.integers(1, 9))
def test_blocks_match_the_reader_on_any_text(tmp_path_factory: pytest.TempPathFactory, pieces: list[str],
                                             head: str, block_bytes: int) -> None:
    path = tmp_path_factory.mktemp("tsv") / "x.de-en.tsv"
    path.write_bytes((head + "".join(pieces)).encode("utf-8"))
    logging.disable(logging.WARNING)
    try:
        for src_lang in LANGS:
            assert outcome(blocks_as_pairs, path, src_lang, block_bytes) == \
                outcome(lambda *args: list(table_pairs(*args)), path, LANGS, src_lang)
    finally:
        logging.disable(logging.NOTSET)


def outcome(read, *args):
    """What ``read(*args)`` gives, or the message of the DataError it raises."""
    try:
        return read(*args)
    except DataError as exc:
        return f"DataError: {exc}"


def test_invalid_utf8_in_a_later_block_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "x.de-en.tsv"
    path.write_bytes(b"a\tb\nc\td\ne\t\xff\n")
    with pytest.raises(DataError, match=r"x.de-en.tsv:3: invalid UTF-8 \(byte 0xff at column 3\)$"):
        list(table_blocks(path, LANGS, "de", block_bytes=4))


def test_verbatim_pairs_stop_at_a_line_without_two_columns(tmp_path: Path) -> None:
    path = tmp_path / "val.de-en.tsv"
    path.write_bytes(b"de\ten\na\tb\nc\n")
    with pytest.raises(DataError, match=r"val.de-en.tsv:3: expected 2 tab-separated columns, found 1; "):
        list(table_pairs(path, LANGS, "en", verbatim=True))
    assert list(table_pairs(path, LANGS, "en")) == [("b", "a"), ("", "")]


@pytest.mark.parametrize("start", [b"", b"\xef\xbb\xbf"], ids=["plain", "bom"])
def test_a_header_naming_the_languages_the_other_way_round_is_refused(tmp_path: Path, start: bytes) -> None:
    """``en<TAB>de`` atop ``train.de-en.tsv`` was read as a pair: which column is which is unclear."""
    path = tmp_path / "train.de-en.tsv"
    path.write_bytes(start + b"en\tde\r\na\tb\n")
    said = r"train.de-en.tsv:1: its header names en then de, its name de-en: which column is which is unclear"
    with pytest.raises(DataError, match=said):
        list(table_pairs(path, LANGS, "de"))
    with pytest.raises(DataError, match=said):
        list(table_blocks(path, LANGS, "de"))


@pytest.mark.parametrize("damage", [lambda data: data[:10] + b"\xff" * 200, lambda data: data[:-30],
                                    lambda data: b"de\ten\na\tb\n"], ids=["junk", "truncated", "not-gzip"])
def test_a_corrupt_gzipped_table_is_one_line_in_blocks_as_in_lines(tmp_path: Path, damage) -> None:
    """Both readers name the file as every gzipped text does: ``<path>: corrupt gzip data (...)``."""
    path = tmp_path / "train.de-en.tsv.gz"
    path.write_bytes(damage(gzip.compress(b"ein hund\ta dog\n" * 500)))
    for read in (lambda: list(table_pairs(path, LANGS, "de")), lambda: list(table_blocks(path, LANGS, "de", 1 << 10))):
        with pytest.raises(DataError, match=rf"^{path}: corrupt gzip data \(.+\)$"):
            read()


@pytest.mark.parametrize("first", [b"src\ttgt", b"Source\tTarget", b"DE\tEN", b"de_DE\ten_US", b"EN\tDE"])
def test_a_first_line_of_other_column_names_is_warned_of(tmp_path: Path, first: bytes,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """``src<TAB>tgt`` atop a file (pandas' ``to_csv`` with named columns) was read as a pair,
    unsaid: in a test split, a wrong line scored."""
    path = tmp_path / "test.de-en.tsv"
    path.write_bytes(first + b"\nein hund\ta dog\n")
    for read in (lambda: list(table_pairs(path, LANGS, "de")), lambda: blocks_as_pairs(path, "de", 1 << 10)):
        caplog.clear()
        assert len(read()) == 2  # read as a pair, as it may be one
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and said[0].startswith(f"{path}:1: '{first.decode().replace(chr(9), '<TAB>')}' "
                                                      "looks like a header, and is read as a pair")


@pytest.mark.parametrize("first", [b"de\ten", b"ja\tyes", b"Hallo\tHello", b"Text\tText"])
def test_a_header_of_the_codes_or_a_pair_is_not_warned_of(tmp_path: Path, first: bytes,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "test.de-en.tsv"
    path.write_bytes(first + b"\nein hund\ta dog\n")
    list(table_pairs(path, LANGS, "de")), blocks_as_pairs(path, "de", 1 << 10)
    assert not caplog.records


def test_a_table_of_lone_cr_line_ends_is_refused(tmp_path: Path) -> None:
    """A file saved with classic Mac OS line ends was one malformed pair: the whole training split lost."""
    path = tmp_path / "train.de-en.tsv"
    for text in (b"ein hund\ta dog\rzwei\ttwo\r", b"ein hund\ta dog\rzwei\ttwo\rdrei\tthree\r\n",
                 b"ein hund\ta dog\rzwei\ttwo\rdrei\tthree\n"):
        path.write_bytes(text)  # (a classic Mac OS file that an editor ended with one \n: one pair too)
        for read in (lambda: list(table_pairs(path, LANGS, "de")), lambda: blocks_as_pairs(path, "de", 4),
                     lambda: blocks_as_pairs(path, "de", 1 << 10)):
            with pytest.raises(DataError, match=rf"^{path}: its lines end in a lone \\r \(classic Mac OS line ends\)"):
                read()
    path.write_bytes(b"ein\rhund\ta dog\n")  # one stray \r in a one-line file: a space, as before
    assert list(table_pairs(path, LANGS, "de")) == blocks_as_pairs(path, "de", 4) == [("ein hund", "a dog")]

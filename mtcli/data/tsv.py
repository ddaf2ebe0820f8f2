"""``<split>.<l1>-<l2>.tsv[.gz]``: both sides of a split in one file, a pair a line.

The columns hold the languages in the order of the file's name, and either direction reads the
same file. A first line that names the two languages (``de<TAB>en``) is a header; one that looks
like a header in another form (``src<TAB>tgt``, ``DE<TAB>EN``) is read as a pair, and warned of.
A line without exactly two columns (a tab inside a sentence) cannot be read as a pair: a
training split reads it as an empty pair, which cleaning drops and counts, and warns of the
lines at the end; a validation or test split, which keeps every line, stops at it
(``verbatim``). A field is read as it is: a CSV writer's quoting (``"a ""b"" c"``) stays, and is
warned of.

:func:`table_pairs` reads the lines by :mod:`mtcli.data.textio`'s rules; :func:`table_blocks`
gives the same pairs as two blocks of text at a time, split by numpy over the bytes, for the
cleaning processes (:func:`mtcli.data.cleaning.clean_text_blocks`) of a large file.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from mtcli.data.textio import (
    decode_block,
    is_utf8,
    open_binary,
    read_errors_named,
    read_lines,
    refuse_lone_cr_ends,
)
from mtcli.errors import DataError
from mtcli.languages import language_code
from mtcli.logs import get_logger

#: How much of the file :func:`table_blocks` reads at a time (then cut after its last whole line).
BLOCK_BYTES = 16 << 20

_BOM = b"\xef\xbb\xbf"


def table_pairs(path: Path, langs: tuple[str, str], src_lang: str,
                verbatim: bool = False) -> Iterator[tuple[str, str]]:
    """The pairs of the ``.tsv`` file ``path`` whose columns hold ``langs``, as (source, target)
    with ``src_lang`` the source (see the module docstring); ``verbatim``: a line without two
    columns raises :class:`DataError` naming it."""
    malformed: list[int] = []
    reverse, header = langs[0] != src_lang, "\t".join(langs)
    quoted = _warn_of_quoted_fields(path, _head(path), langs)
    for n, line in enumerate(read_lines(path), 1):
        columns = line.split("\t")
        quoted = quoted or '""' in line and _warn_of_csv_quoting(path, line.encode("utf-8"), n)
        if n == 1 and line == header:
            continue
        if n == 1:
            _check_header(path, line.encode("utf-8"), langs)
        if len(columns) != 2:
            if verbatim:
                raise DataError(f"{path}:{n}: expected 2 tab-separated columns, found {len(columns)}; a "
                                "validation or test split keeps every line: mend the file")
            malformed.append(n)
            yield "", ""
        else:
            yield (columns[1], columns[0]) if reverse else (columns[0], columns[1])
    _warn_of_malformed(path, len(malformed), malformed[0] if malformed else 0)


def table_blocks(path: Path, langs: tuple[str, str], src_lang: str,
                 block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[bytes, bytes]]:
    """The pairs :func:`table_pairs` gives (not ``verbatim``), as blocks of the (source, target)
    sides' UTF-8 text, each line ended by ``\\n``: whole lines of the file at a time, split into
    columns without a Python loop over them. Invalid UTF-8 raises the reader's one-line error
    naming file, line and column."""
    header = "\t".join(langs).encode("utf-8")
    first, malformed, first_malformed, quoted = 1, 0, 0, False
    with read_errors_named(path), open_binary(path) as handle:
        for block in _whole_lines(handle, block_bytes, str(path)):
            if not is_utf8(block):
                decode_block(block, str(path), first)  # raises, naming line and column
            quoted = quoted or _warn_of_csv_quoting(path, block, first)
            if first == 1:
                quoted = quoted or _warn_of_quoted_fields(path, block, langs)
                _check_header(path, block.split(b"\n", 1)[0].rstrip(b"\r").removeprefix(_BOM), langs)
            columns, bad = _columns(block, header if first == 1 else None)
            if len(bad):
                malformed += len(bad)
                first_malformed = first_malformed or first + int(bad[0])
            first += block.count(b"\n")
            yield columns if langs[0] == src_lang else (columns[1], columns[0])
    _warn_of_malformed(path, malformed, first_malformed)


#: A field in quotes whose quotes inside come in pairs: a CSV writer's (pandas' ``to_csv(sep="\t")``,
#: Python's csv) quoting of a field holding a quote, when a pair is inside. Read as it is, such
#: a field keeps its quotes. (No two alternatives overlap: linear in the field.)
_QUOTED_FIELD = re.compile(rb'(?:^|\t)"((?:[^"\t\n]|"")*)"(?=\t|\r?$)', re.MULTILINE)


def _warn_of_csv_quoting(path: Path, text: bytes, first: int) -> bool:
    """Warn, naming its line, when a field of ``text`` (lines from line ``first`` on) is
    CSV-quoted; whether one was (a file is warned of once). Text without a ``""`` costs one
    search of its bytes."""
    at = text.find(b'""')
    while at >= 0:
        start, end = text.rfind(b"\n", 0, at) + 1, text.find(b"\n", at)
        end = len(text) if end < 0 else end
        if any(b'""' in field[1] for field in _QUOTED_FIELD.finditer(text, start, end)):
            line = first + text.count(b"\n", 0, start)
            get_logger().warning("%s:%d: a field in quotes with its quotes doubled, as a CSV writer quotes it; a .tsv's "
                                 "fields are read as they are, quotes and all: write it without CSV quoting, or as "
                                 "<split>.<lang> text files", path, line)
            return True
        at = text.find(b'""', end)
    return False


#: The first lines :func:`_warn_of_quoted_fields` reads.
_HEAD_LINES = 20
#: A line of two fields in quotes (quotes inside doubled, if any).
_BOTH_QUOTED = re.compile(rb'"(?:[^"\t\n]|"")*"\t"(?:[^"\t\n]|"")*"\r?')


def _head(path: Path) -> bytes:
    """The first :data:`_HEAD_LINES` lines of ``path`` as stored (a ``.gz`` file's text)."""
    with read_errors_named(path), open_binary(path) as handle:
        return b"".join(itertools.islice(handle, _HEAD_LINES))


def _warn_of_quoted_fields(path: Path, head: bytes, langs: tuple[str, str]) -> bool:
    """Warn when every field of the file's first lines (``head``; a header of the languages
    aside) is in quotes, as a CSV writer that quotes all fields writes them (pandas'
    ``quoting=csv.QUOTE_ALL``, R's ``write.table``); whether it did."""
    lines = [line for line in head.removeprefix(_BOM).split(b"\n", _HEAD_LINES)[:_HEAD_LINES]
             if line.strip() and line.rstrip(b"\r") != "\t".join(langs).encode("utf-8")]
    if len(lines) < 2 or not all(_BOTH_QUOTED.fullmatch(line) for line in lines):
        return False
    get_logger().warning("%s: every field of its first lines is in quotes, as a CSV writer that quotes all fields "
                         "writes them; a .tsv's fields are read as they are, quotes and all: write it without CSV "
                         "quoting, or as <split>.<lang> text files", path)
    return True


#: Column names a first line may hold instead of the two languages' codes.
_HEADER_WORDS = frozenset({"src", "source", "tgt", "trg", "target", "text", "sentence", "translation", "input",
                           "output", "source_text", "target_text", "src_text", "tgt_text", "src_lang", "tgt_lang"})


def _check_header(path: Path, first_line: bytes, langs: tuple[str, str]) -> None:
    """A header naming the languages the other way round from the file's name (``fr<TAB>en`` in
    ``train.en-fr.tsv``) leaves which column is which unclear: a :class:`DataError`, not a pair.
    A first line of column names in another form (``src<TAB>tgt``, ``DE<TAB>EN``,
    ``de_DE<TAB>en_US``) is read as a pair, and warned of."""
    if first_line == f"{langs[1]}\t{langs[0]}".encode():
        raise DataError(f"{path}:1: its header names {langs[1]} then {langs[0]}, its name {langs[0]}-{langs[1]}: "
                        "which column is which is unclear; rename the file or mend the header")
    fields = first_line.decode("utf-8", "replace").strip().split("\t")
    if len(fields) != 2 or first_line == "\t".join(langs).encode():
        return
    named = all(field.strip().lower() in _HEADER_WORDS for field in fields) and \
        fields[0].strip().lower() != fields[1].strip().lower()  # ("Text<TAB>Text": a pair as likely)
    coded = sorted(language_code(field.strip()) for field in fields) == sorted(map(language_code, langs))
    if named or coded:
        get_logger().warning("%s:1: '%s' looks like a header, and is read as a pair: a .tsv's header is the two "
                             "languages' codes as its name gives them (%s<TAB>%s)", path,
                             "<TAB>".join(fields), *langs)


def _warn_of_malformed(path: Path, count: int, first: int) -> None:
    if count:
        get_logger().warning("%s: %d line(s) without 2 tab-separated columns (the first: line %d), read as empty "
                             "pairs", path, count, first)


def _whole_lines(handle: BinaryIO, block_bytes: int, name: str) -> Iterator[bytes]:
    """The bytes of the file ``name`` in blocks of whole lines, each line ended by ``\\n`` (one
    is added to a last line without it, whose ``\\r`` at the end is then a space, as the reader
    makes it); a file of lines ended by lone ``\\r`` is refused as the reader refuses it."""
    rest, blocks, first = b"", 0, b""
    while chunk := handle.read(block_bytes):
        chunk = rest + chunk
        end = chunk.rfind(b"\n") + 1
        rest = chunk[end:]
        if end:
            blocks += 1
            first = chunk[:end] if blocks == 1 and chunk.count(b"\n", 0, end) == 1 else b""
            yield chunk[:end]
    if not blocks or (first and not rest):  # a file of one line, its \n at the end or none
        refuse_lone_cr_ends(first or rest, name)
    if rest:
        yield (rest[:-1] + b" " if rest.endswith(b"\r") else rest) + b"\n"


def _columns(block: bytes, header: bytes | None) -> tuple[tuple[bytes, bytes], np.ndarray]:
    """The two columns of ``block`` (whole lines, valid UTF-8) as lines of text by the reader's
    rules: ``\\r\\n`` ends a line, another ``\\r`` is a space, a byte-order mark opening the
    file (``header`` is given for the file's first block) is dropped, and a first line equal to
    ``header`` is left out. A line without exactly one tab gives an empty line on both sides;
    their indices in the block come back too."""
    data = np.frombuffer(block, dtype=np.uint8).copy()
    stops = np.flatnonzero(data == 10)  # each line's \n
    starts = np.concatenate(([0], stops[:-1] + 1))
    ends = stops - (data[np.maximum(stops - 1, 0)] == 13) * (stops > starts)  # a \r before the \n is not text
    data[data == 13] = 32
    data[ends] = 10  # each line's text is now followed by a \n
    if header is not None and block.startswith(_BOM):
        starts[0] += len(_BOM)
    keep = np.ones(len(stops), dtype=bool)
    keep[0] = header is None or block[starts[0]:ends[0]] != header  # (a header holds no \r)
    tabs = np.flatnonzero(data == 9)
    line_of_tab = np.searchsorted(stops, tabs)
    good = np.bincount(line_of_tab, minlength=len(stops)) == 1
    tab = ends.copy()  # a line without one tab: both sides empty, the span of its \n
    lone = good[line_of_tab]
    tab[line_of_tab[lone]] = tabs[lone]
    data[tab[good]] = 10
    src = _gather(data, np.where(good, starts, ends)[keep], tab[keep] + 1)
    tgt = _gather(data, np.where(good, tab + 1, ends)[keep], ends[keep] + 1)
    return (src, tgt), np.flatnonzero(~good & keep)


def _gather(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> bytes:
    """The bytes ``data[starts[i]:ends[i]]`` one after another (ascending spans that do not
    overlap), picked by one mask over the block: no Python loop over the spans."""
    edges = np.empty(2 * len(starts) + 2, dtype=np.int64)
    edges[0], edges[-1] = 0, len(data)
    edges[1:-1:2], edges[2:-1:2] = starts, ends
    inside = np.zeros(len(edges) - 1, dtype=bool)
    inside[1::2] = True  # the runs between a start and its end
    return data[np.repeat(inside, np.diff(edges))].tobytes()

"""Strict UTF-8 line reading: the one reader of every text mtcli reads.

Text is read strictly as UTF-8 (an invalid byte is a :class:`DataError` naming file and line),
``\\r\\n`` is normalised, only the line ending is stripped (inner and trailing spaces stay), and a
stray ``\\r`` inside a line becomes a space (so any reader splits the written text identically).
``.gz`` files are read transparently. :class:`ArrivingLines` hands over the lines of a pipe or
terminal as they arrive.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import os
import select
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from mtcli.errors import DataError
from mtcli.logs import get_logger


def is_gzip(path: Path) -> bool:
    """Whether ``path`` is read gunzipped: a ``.gz`` name."""
    return path.suffix.lower() == ".gz"


def open_binary(path: Path) -> BinaryIO:
    """Binary handle on ``path``, transparently gunzipped for ``.gz`` files."""
    if is_gzip(path):
        return gzip.open(path, "rb")
    return open(path, "rb")


def refuse_lone_cr_ends(text: bytes, name: str) -> None:
    """Raise :class:`DataError` when ``text``, the start of ``name`` (a text of one line, ended
    by ``\\n`` or not), holds more than one ``\\r``: its lines end in a lone ``\\r`` (classic
    Mac OS), and read by the rules here it would be one sentence, its line ends spaces."""
    if text.endswith(b"\n"):  # its ending, \r\n as a whole (a stray \r in a Windows line is no line end)
        text = text[:-2] if text.endswith(b"\r\n") else text[:-1]
    if text.count(b"\r") > 1 and b"\n" not in text:
        how = (f"convert them first: tr '\\r' '\\n' < {name} > {name}.unix" if not name.startswith("<")
               else "pipe it through tr '\\r' '\\n' first")  # (<stdin>)
        raise DataError(f"{name}: its lines end in a lone \\r (classic Mac OS line ends), which mtcli reads "
                        f"as one line; {how}")


def _decode_line(raw: bytes, name: str, lineno: int) -> str:
    """One line's bytes (its ending included or not) as text, by :func:`iter_binary_lines`' rules."""
    if raw.endswith(b"\n"):
        raw = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    elif lineno == 1:  # the whole text is one line
        refuse_lone_cr_ends(raw, name)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        utf16 = lineno == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff")  # a UTF-16 byte-order mark
        raise DataError(
            f"{name}:{lineno}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
            f"{'; it is UTF-16 text: convert it, iconv -f UTF-16 -t UTF-8' if utf16 else ''}"
        ) from None
    if lineno == 1 and line.startswith("\ufeff"):
        line = line[1:]
    if "\r" in line:
        line = line.replace("\r", " ")
    return line


def iter_binary_lines(handle: BinaryIO, name: str, bom_note: str = "") -> Iterator[str]:
    """Decode a binary stream line by line as strict UTF-8, without the line endings.

    The one line reader of mtcli (``prepare``, ``translate``, ``evaluate``, validation):
    only ``\\n`` ends a line and ``\\r\\n`` counts as ``\\n``; a lone ``\\r`` becomes a space
    inside its line (other Unicode separators stay inside too), so one input line is always one
    sentence; a text whose lines all end in a lone ``\\r`` (and so would be one line) is a
    :class:`DataError` (:func:`refuse_lone_cr_ends`). A UTF-8 byte-order mark on the first line
    is dropped; an empty line stays an empty string. An undecodable line raises
    :class:`DataError` as ``NAME:LINE: invalid UTF-8 ...``. ``bom_note``: said as a warning
    (``NAME: NOTE``) when the text opens with a byte-order mark; with it (a file to score), a
    byte-order mark opening a later line (files joined with ``cat``) is dropped too, and warned of.
    """
    lines = iter(handle)
    first, second = next(lines, None), next(lines, None)
    if first is None:
        return
    if bom_note and first.startswith(b"\xef\xbb\xbf"):
        get_logger().warning("%s: %s", name, bom_note)
    if second is None:  # the whole text is one line, its ending or not
        refuse_lone_cr_ends(first, name)
    yield _decode_line(first, name, 1)
    if second is not None:
        rest = itertools.chain([second], lines)
        if bom_note:
            yield from _without_inner_boms(rest, name)
        else:
            for lineno, raw in enumerate(rest, start=2):
                yield _decode_line(raw, name, lineno)


def _without_inner_boms(raws: Iterator[bytes], name: str) -> Iterator[str]:
    """Lines 2 on of a file to score, a byte-order mark that opens one dropped: it marks where
    ``cat`` joined a file that opened with one, and kept, it would be the next word's first
    character, a word no hypothesis holds. Warned of once, at the end, naming the first line."""
    marked: list[int] = []
    for lineno, raw in enumerate(raws, start=2):
        line = _decode_line(raw, name, lineno)
        if line.startswith("\ufeff"):
            marked.append(lineno)
            line = line[1:]
        yield line
    if marked:
        more = f" (and {len(marked) - 1} more)" if len(marked) > 1 else ""
        get_logger().warning(
            "%s:%d%s: a byte-order mark opens the line, where a file opening with one was joined on "
            "(cat); mtcli drops it, sacreBLEU's command line keeps it in the first word", name, marked[0], more)


def is_utf8(block: bytes) -> bool:
    """Whether ``block`` is valid UTF-8, by the rules of Python's strict decoder (no overlong
    forms, no surrogates, nothing above U+10FFFF), checked by Arrow without making a string:
    several times faster than ``block.decode()`` on large blocks."""
    import numpy as np
    import pyarrow as pa

    offsets = pa.py_buffer(np.array([0, len(block)], dtype=np.int64))
    text = pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(block)])
    try:
        text.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def check_unicode(text: str, where: str) -> None:
    """Raise :class:`DataError` when ``text`` is not valid Unicode: a ``str`` can hold a lone
    surrogate (JSON's ``"\\ud800"``, Python's ``surrogateescape``), which no UTF-8 text holds and
    SentencePiece refuses. The message names ``where`` and the 1-based column, e.g.
    ``text[3]: not valid Unicode (lone surrogate at column 5)``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: not valid Unicode (lone surrogate at column {exc.start + 1})"
        ) from None


def read_range(path: str | Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a file, undecoded: a range of whole lines a worker cut for itself."""
    with open(path, "rb") as handle:
        handle.seek(start)
        return handle.read(end - start)


def decode_block(block: bytes, name: str, first_lineno: int) -> list[str]:
    """The lines of ``block`` decoded as :func:`iter_binary_lines` decodes them, for a reader
    that cuts a file into blocks of whole lines itself: ``block`` starts at line
    ``first_lineno`` of ``name``, and only the file's last line may lack its ``\n``.

    The common block (valid UTF-8, no ``\r``, no byte-order mark) is decoded in one call; any
    other falls back to the line-by-line rules, so errors name the same line and column.
    """
    try:
        text: str | None = block.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\r" not in text and not (first_lineno == 1 and text.startswith("\ufeff")):
        lines = text.split("\n")
        if not lines[-1]:
            lines.pop()  # the empty text after the last "\n"
        return lines
    raws = block.split(b"\n")
    last = raws.pop()
    lines = [_decode_line(raw + b"\n", name, first_lineno + i) for i, raw in enumerate(raws)]
    if last:
        lines.append(_decode_line(last, name, first_lineno + len(raws)))
    return lines


def _has_input(fd: int) -> bool:
    """True when reading ``fd`` would not block (data or end of input waiting), by ``select``."""
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):  # no select on this kind of descriptor: reading may block
        return True


class ArrivingLines:
    """The lines of a pipe, terminal or socket, handed over as they arrive.

    Iterating gives every line, like :func:`iter_binary_lines` (same decoding rules and errors,
    but for a text of lone ``\r`` line ends ended by one ``\n``: its line is handed over before the
    end of the stream could show it is the only one, so it is one sentence).
    :meth:`windows` gives them in lists instead: it waits for one complete line, then adds the
    lines that have already arrived, without waiting for more. A consumer that works a window at
    a time (``mtcli translate``) then answers each line of a slow producer (``tail -f``, a
    program writing one request at a time) as soon as it is written, while a fast producer
    (``cat big.txt |``) still fills whole windows. Reads the file descriptor directly (unbuffered
    ``os.read``), so nothing may have read from ``handle`` before.
    """

    def __init__(self, handle: BinaryIO, name: str, chunk_bytes: int = 1 << 16) -> None:
        self.fd = handle.fileno()
        self.name = name
        self.chunk_bytes = int(chunk_bytes)

    def __iter__(self) -> Iterator[str]:
        for window in self.windows(1):
            yield from window

    def windows(self, max_lines: int) -> Iterator[list[str]]:
        """Lists of 1 to ``max_lines`` lines: the next line (waiting for it) and those already there."""
        max_lines = max(1, int(max_lines))
        pending = bytearray()  # read, not yet handed over
        scan = 0  # pending[:scan] holds no newline
        lineno = 0
        eof = False
        while True:
            window: list[str] = []
            while len(window) < max_lines:
                end = pending.find(b"\n", scan)
                if end >= 0:
                    lineno += 1
                    window.append(_decode_line(bytes(pending[:end + 1]), self.name, lineno))
                    del pending[:end + 1]
                    scan = 0
                    continue
                scan = len(pending)
                if eof:
                    if pending:  # a last line without a newline
                        lineno += 1
                        window.append(_decode_line(bytes(pending), self.name, lineno))
                        pending.clear()
                    break
                if window and not _has_input(self.fd):
                    break  # hand over what has arrived rather than wait for more
                chunk = os.read(self.fd, self.chunk_bytes)
                pending += chunk
                eof = not chunk
            if window:
                yield window
            if eof and not pending:
                return


def read_lines(path: str | Path, bom_note: str = "") -> Iterator[str]:
    """Stream the lines of a UTF-8 text file (``.gz`` allowed); see :func:`iter_binary_lines`."""
    path = Path(path)
    with read_errors_named(path), open_binary(path) as handle:
        yield from iter_binary_lines(handle, str(path), bom_note)


def read_lines_hashed(path: str | Path, bom_note: str = "") -> tuple[list[str], str]:
    """Every line of a text file (as :func:`read_lines` reads them) and the sha256 of its bytes
    as stored (a ``.gz`` file's compressed bytes, what ``sha256sum`` gives), from one read: a
    stream (``<(zcat ref.gz)``, a named pipe) gives its bytes once, so the lines scored and the
    checksum recorded are of the same text. The whole file is held in memory (a test set)."""
    path = Path(path)
    with read_errors_named(path):
        with open(path, "rb") as handle:
            data = handle.read()
        text = gzip.decompress(data) if is_gzip(path) else data
        lines = list(iter_binary_lines(io.BytesIO(text), str(path), bom_note))
    return lines, hashlib.sha256(data).hexdigest()


def lines_sha256(lines: Iterable[str]) -> str:
    """The sha256 of text as lines (each ended by ``\n``, in UTF-8): the same for a file, its
    ``.gz`` and its CRLF copy, whose bytes differ."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


@contextmanager
def read_errors_named(path: Path) -> Iterator[None]:
    """Turn the errors of reading ``path`` inside the block into one-line :class:`DataError`
    errors naming it: ``<path>: corrupt gzip data (...)`` for a ``.gz`` file that is not gzip,
    is damaged or is cut short (``gzip`` raises ``BadGzipFile``, ``zlib.error`` or
    ``EOFError``), and a missing, directory or unreadable file. Every reader of a file that may
    be gzipped (:func:`read_lines`, the ``.tsv`` and ``.tmx`` readers) reads inside it."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt gzip data ({exc})") from None
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, expected a text file") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied") from None


def count_lines(path: str | Path) -> int:
    """Number of lines of a text file (a last line without ``\\n`` counts), streamed; a damaged
    ``.gz`` is :func:`read_errors_named`'s one-line error."""
    count = 0
    last = b"\n"
    with read_errors_named(Path(path)), open_binary(Path(path)) as handle:
        while chunk := handle.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")

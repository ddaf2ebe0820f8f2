"""A block of text lines scanned in one C pass for cleaning: line ends, word counts, hashes.

Cleaning a range of lines needs, for each line, where it ends, its number of words (as
``str.split`` counts them) and, for dedup, the hash of its bytes (:func:`line_hashes`), and
it needs to know the bytes are the lines the reader would give (valid UTF-8, no ``\\r``, no
byte-order mark). In numpy and pandas that takes several passes over the bytes and a Python
object a line; ``scan.c`` does all of it in one pass. It is compiled on first use
(:mod:`mtcli.native`); without a compiler, or with ``MTCLI_KERNELS=0``, :func:`scan_lines`
returns None and cleaning takes its numpy path, with the same result.
"""

from __future__ import annotations

import ctypes
import functools
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mtcli import native
from mtcli.logs import get_logger

SOURCE = Path(__file__).with_name("scan.c")
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES = {
    "scan_lines": (_L, [ctypes.c_char_p, _L, _I, _I, _L, _P, _P, _P]),
    "count_lines": (_L, [ctypes.c_char_p, _L]),
}


class Lines(NamedTuple):
    """A block's lines: ``stops[i]`` is the offset just after line ``i`` (its ``\\n``
    included), ``words[i]`` its ``len(line.split())``, ``hashes[i]`` (or None) its
    :func:`line_hashes` value."""

    stops: np.ndarray
    words: np.ndarray
    hashes: np.ndarray | None


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("MTCLI_KERNELS", "1") == "0":
        return None
    try:
        return native.build(SOURCE, _SIGNATURES)[0]
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        get_logger().warning("the C line scanner is unavailable (%s); cleaning uses numpy", e)
        return None


def available() -> bool:
    """Whether the scanner is compiled and loaded (compiles it on the first call)."""
    return _library() is not None


def scan_lines(block: bytes, hashes: bool, strict: bool = False, file_start: bool = False) -> Lines | None:
    """The :class:`Lines` of ``block`` (UTF-8 lines ended by ``\\n``, the last maybe not),
    with their hashes when ``hashes``. None where the C scanner is unavailable, where the block
    is not valid UTF-8, or, when ``strict``, where the reader would change its bytes (a
    ``\\r``, or a byte-order mark at the ``file_start``): the caller then takes its own path,
    which also names the line of an error. Without ``strict``, ``\\r`` is a space."""
    lib = _library()
    if lib is None:
        return None
    capacity = lib.count_lines(block, len(block)) + 1
    stops = np.empty(capacity, dtype=np.int64)
    words = np.empty(capacity, dtype=np.int64)
    hashed = np.empty(capacity, dtype=np.uint64) if hashes else None
    lines = lib.scan_lines(block, len(block), int(strict), int(file_start), capacity, stops.ctypes.data,
                           words.ctypes.data, None if hashed is None else hashed.ctypes.data)
    if lines < 0:
        return None
    return Lines(stops[:lines], words[:lines], None if hashed is None else hashed[:lines])


def line_hashes(lines: Sequence[bytes | str]) -> np.ndarray:
    """The 64-bit hash (uint64) of each line: SipHash-2-4 of its UTF-8 bytes under a fixed key,
    then a 64-bit mixer (pandas' ``hash_array``, which a str and its UTF-8 bytes get alike).
    The same in every run and process, and the same as :func:`scan_lines` gives."""
    from pandas.util import hash_array  # pandas comes with `datasets`; imported when deduplicating

    values = np.empty(len(lines), dtype=object)
    values[:] = lines
    return hash_array(values, categorize=False)

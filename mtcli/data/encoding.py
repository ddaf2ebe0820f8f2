"""Encoding the text files ``prepare`` wrote into the cache's id arrays: through a word
table (:class:`~mtcli.data.tokenizer.WordCache`), in forked processes for a large file, each
reading its own byte range of whole lines; and reading those files back a block at a time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mtcli.data.cache import ArrayWriter
from mtcli.data.scan import line_ends
from mtcli.data.textio import read_range
from mtcli.data.tokenizer import Tokenizer, WordCache
from mtcli.data.vocabmap import VocabTokenizer
from mtcli.data.workers import can_fork, forked_pool, in_order
from mtcli.logs import progress

CHUNK_BYTES = 1 << 22
# Below this many lines a file is encoded in-process: forking workers
# costs about as much as it saves on a corpus the size of Multi30k.
PARALLEL_MIN_LINES = 50_000

_WORKER: dict[str, Any] = {}


def _init_worker(model_path: str, dtype: str) -> None:
    _WORKER["encoder"] = WordCache(Tokenizer(model_path), np.dtype(dtype))


def _encode_range_in_worker(task: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Read bytes ``[start, end)`` of a text file we wrote (whole ``\n``-ended lines), encode."""
    return _WORKER["encoder"].encode_text(read_range(*task))


def line_blocks(path: Path, block_bytes: int = 1 << 24) -> Iterator[tuple[memoryview, np.ndarray]]:
    """The whole lines of a text file :func:`~mtcli.data.prepare.prepare` wrote (valid UTF-8, each ended by
    ``\n`` alone), undecoded, a block at a time, with the offset just after each line's end.
    The checks of :func:`~mtcli.data.textio.read_lines` were made when the source was read; at
    WMT size they cost several seconds per pass. Each block is read into the same buffer, so it
    is only valid until the next one is asked for."""
    buffer = bytearray(block_bytes)
    carry = 0  # the bytes of an unended line at the buffer's start
    with open(path, "rb", buffering=0) as handle:
        while True:
            if carry == len(buffer):  # a line longer than the buffer
                buffer = buffer + bytes(len(buffer))
            read = handle.readinto(memoryview(buffer)[carry:])
            if not read:
                return  # an unended last line is not one of the lines prepare writes
            size = carry + read
            cut = buffer.rfind(b"\n", 0, size) + 1
            if cut:
                whole = memoryview(buffer)[:cut]
                yield whole, line_ends(np.frombuffer(whole, dtype=np.uint8))
            buffer[:size - cut] = buffer[cut:size]
            carry = size - cut


def byte_ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split a ``\n``-terminated text file into ``[start, end)`` byte ranges of whole lines."""
    size = path.stat().st_size
    ranges = []
    start = 0
    with open(path, "rb") as handle:
        while start < size:
            if start + chunk_bytes >= size:
                end = size
            else:
                handle.seek(start + chunk_bytes)
                handle.readline()
                end = handle.tell()
            ranges.append((start, end))
            start = end
    return ranges


def encode_file(
    model_path: Path,
    text_path: Path,
    writer: ArrayWriter,
    num_lines: int,
    workers: int = 1,
    show_progress: bool = False,
) -> None:
    """Encode a text file written by :func:`~mtcli.data.prepare.prepare` into ``writer``, in order.

    Files of at least :data:`PARALLEL_MIN_LINES` lines are cut into byte ranges of whole lines
    that ``workers`` forked processes read, decode and encode themselves (the parent only
    writes), with at most ``2 * workers`` ranges in flight so memory stays bounded. Smaller files
    are encoded in-process: starting processes would cost more than it saves. Each process
    encodes through a :class:`~mtcli.data.tokenizer.WordCache` (a word's ids are looked up once
    it has been seen: the same ids, for a fraction of SentencePiece's time per sentence).
    """
    bar = progress(total=num_lines, enabled=show_progress, desc=f"encode {text_path.stem}", unit="sent")
    try:
        if workers > 1 and num_lines >= PARALLEL_MIN_LINES and can_fork():
            tasks = [(str(text_path), a, b) for a, b in byte_ranges(text_path, CHUNK_BYTES)]
            with forked_pool(workers, _init_worker, (str(model_path), writer.dtype.str)) as pool:
                for ids, lengths in in_order(pool, _encode_range_in_worker, tasks, 2 * workers):
                    writer.append(ids, lengths)
                    bar.update(len(lengths))
        else:
            encoder = WordCache(Tokenizer(model_path), writer.dtype)
            for start, end in byte_ranges(text_path, CHUNK_BYTES):
                ids, lengths = encoder.encode_text(read_range(str(text_path), start, end))
                writer.append(ids, lengths)
                bar.update(len(lengths))
    finally:
        bar.close()


def encode_with_vocab(tokenizer: VocabTokenizer, text_path: Path, writer: ArrayWriter, target: bool,
                      chunk: int = 10_000) -> None:
    """Encode a text file written by :func:`~mtcli.data.prepare.prepare` with separate source and target models mapped
    through one vocabulary (a run ``mtcli import-hf`` made), in this process, ``chunk`` lines at a
    time: the source side's model, or with ``target`` the target side's."""
    encode = tokenizer.encode_target_batch if target else tokenizer.encode_batch
    lines = text_path.read_text(encoding="utf-8").split("\n")[:-1]
    for start in range(0, len(lines), chunk):
        ids = encode(lines[start:start + chunk])
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        writer.append(np.fromiter((i for x in ids for i in x), dtype=np.int64, count=int(lengths.sum())), lengths)


__all__ = ["CHUNK_BYTES", "PARALLEL_MIN_LINES", "byte_ranges", "encode_file", "encode_with_vocab", "line_blocks"]

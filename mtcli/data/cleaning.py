"""Cleaning the training pairs: each pair is kept or dropped for one counted reason.

Only the training split is cleaned (:class:`PairCleaner`); valid/test splits keep every line, so
scores are over the full test sets. A large training split is cleaned by several processes at
once (:func:`clean_text_files` for plain-text files, :func:`clean_text_blocks` for Arrow rows),
with the same result as one process.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mtcli.data.arrowrows import BlockReader
from mtcli.data.dedup import key_set, keys_of, pair_keys
from mtcli.data.scan import Lines, numpy_lines, text_length
from mtcli.data.sourcebase import Pair, mismatch_error
from mtcli.data.textio import decode_block, is_utf8, read_range, refuse_lone_cr_ends
from mtcli.data.workers import forked_pool, in_order, result_of, settle

# Pairs a worker cleans at a time: about 4 MB of WMT text a side, a tenth of a second of work.
PAIRS_PER_RANGE = 20_000
# Bytes read at a time while the parent finds where the ranges of a text file start.
CUT_BLOCK_BYTES = 1 << 24
# Pairs one process cleans at a time (the dedup memory is looked up a batch at a time).
CHUNK_PAIRS = 4096


@dataclass
class CleanCounts:
    """How many training pairs were read, kept, and dropped for each reason."""

    read: int = 0
    kept: int = 0
    empty: int = 0
    too_long: int = 0
    ratio: int = 0
    duplicate: int = 0

    def dropped(self) -> dict[str, int]:
        """Dropped pairs per reason (``empty``, ``too_long``, ``ratio``, ``duplicate``)."""
        return {"empty": self.empty, "too_long": self.too_long, "ratio": self.ratio, "duplicate": self.duplicate}

    def to_dict(self) -> dict[str, Any]:
        """``{"read", "kept", "dropped": {reason: n}}`` as stored in the manifest."""
        return {"read": self.read, "kept": self.kept, "dropped": self.dropped()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CleanCounts:
        """Inverse of :meth:`to_dict`."""
        return cls(read=raw["read"], kept=raw["kept"], **raw.get("dropped", {}))

    def add(self, other: CleanCounts) -> None:
        """Add ``other``'s counts to these (a range cleaned elsewhere)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


#: The cleaning rules' version, in a cache's key (:func:`~mtcli.data.prepare.build_key`): a cache
#: cleaned by other rules is prepared again. 2: a side of invisible format characters alone
#: (a zero-width space, a direction mark) is empty.
CLEANING_RULES = 2


class PairCleaner:
    """Filters training pairs; each pair is dropped for the first rule it breaks, in order:

    1. ``empty``: either side is empty, or holds only spaces and invisible format characters (a
       zero-width space, a direction mark);
    2. ``too_long``: either side is longer than ``max_length``;
    3. ``ratio``: ``max(|x|, |y|) / min(|x|, |y|) > max_ratio``;
    4. ``duplicate`` (when ``dedup``): the exact (source, target) pair was already kept. Kept
       pairs are remembered by a 64-bit hash (:func:`pair_keys`) in a
       :func:`~mtcli.data.dedup.key_set`, so memory is 8-21 bytes per unique pair, not the text.

    A side's length is its number of words (whitespace-separated), or with ``characters`` (one
    flag a side; :func:`mtcli.languages.measured_in_characters`) its characters other than spaces.

    ``record_keys`` also keeps the kept pairs' keys in order (:attr:`kept_keys`, an array per
    batch), for a range cleaned in a worker and handed to the parent's cleaner (:meth:`absorb`).
    """

    def __init__(self, max_length: int, max_ratio: float, dedup: bool = False,
                 record_keys: bool = False, characters: tuple[bool, bool] = (False, False)) -> None:
        self.max_length = max_length
        self.max_ratio = max_ratio
        self.dedup = dedup
        self.characters = characters
        self.counts = CleanCounts()
        self.record_keys = record_keys
        self.kept_keys: list[np.ndarray] = []  # with record_keys: the kept pairs' keys, in order
        self._keys = key_set()

    def reason(self, src: str, tgt: str) -> str | None:
        """Why the pair would be dropped (a :class:`CleanCounts` field name), or None to keep.

        Does not update counts or the dedup memory.
        """
        n_src, n_tgt = text_length(src, self.characters[0]), text_length(tgt, self.characters[1])
        if n_src == 0 or n_tgt == 0:
            return "empty"
        if n_src > self.max_length or n_tgt > self.max_length:
            return "too_long"
        if max(n_src, n_tgt) > self.max_ratio * min(n_src, n_tgt):
            return "ratio"
        return None

    def __call__(self, pairs: Iterable[Pair]) -> Iterator[Pair]:
        """Yield the kept pairs, counting every drop in :attr:`counts` (a batch at a time)."""
        it = iter(pairs)
        while chunk := list(itertools.islice(it, CHUNK_PAIRS)):
            counts = self.counts
            counts.read += len(chunk)
            passing = []
            for i, (src, tgt) in enumerate(chunk):
                why = self.reason(src, tgt)
                if why is None:
                    passing.append(i)
                else:
                    setattr(counts, why, getattr(counts, why) + 1)
            kept = np.array(passing, dtype=np.intp)
            if self.dedup:
                kept = self._deduplicated(kept, pair_keys([chunk[i][0] for i in passing],
                                                          [chunk[i][1] for i in passing]))
            counts.kept += len(kept)
            yield from (chunk[i] for i in kept.tolist())

    def kept_among(self, keys: np.ndarray) -> np.ndarray:
        """The mask of the pair ``keys`` (:func:`pair_keys`) that are a kept pair's. Only a
        cleaner that deduplicates remembers its kept pairs."""
        if not self.dedup:
            raise ValueError("a cleaner that does not deduplicate keeps no pair keys")
        return self._keys.contains(keys)

    def _deduplicated(self, passing: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """The items of ``passing`` whose ``keys`` were not kept before (now remembered)."""
        new = self._keys.add_new(keys)
        self.counts.duplicate += len(keys) - int(new.sum())
        if self.record_keys:
            self.kept_keys.append(keys[new])
        return passing[new]

    def clean_lines(self, n_src: np.ndarray, n_tgt: np.ndarray, src_hashes: np.ndarray | None,
                    tgt_hashes: np.ndarray | None) -> np.ndarray:
        """The indices (ascending) of the kept pairs among line-aligned lines whose lengths
        are ``n_src``/``n_tgt`` and whose hashes (:func:`~mtcli.data.scan.line_hashes`; needed
        only with dedup) are ``src_hashes``/``tgt_hashes``: the rules of :meth:`reason` over
        whole arrays, then dedup on the passing pairs (the same keys as :func:`pair_keys`).
        Counts as :meth:`__call__`."""
        empty = (n_src == 0) | (n_tgt == 0)
        too_long = ~empty & ((n_src > self.max_length) | (n_tgt > self.max_length))
        longer, shorter = np.maximum(n_src, n_tgt), np.minimum(n_src, n_tgt)
        ratio = ~empty & ~too_long & (longer > self.max_ratio * shorter.astype(np.float64))
        passing = np.flatnonzero(~(empty | too_long | ratio))
        counts = self.counts
        counts.read += len(n_src)
        counts.empty += int(empty.sum())
        counts.too_long += int(too_long.sum())
        counts.ratio += int(ratio.sum())
        if self.dedup:
            assert src_hashes is not None and tgt_hashes is not None
            if len(passing) == len(n_src):  # every pair passes the rules: nothing to gather
                keys = keys_of(src_hashes, tgt_hashes)
            else:
                keys = keys_of(src_hashes[passing], tgt_hashes[passing])
            passing = self._deduplicated(passing, keys)
        counts.kept += len(passing)
        return passing

    def absorb(self, counts: CleanCounts, keys: np.ndarray) -> np.ndarray | None:
        """Take over a range that another cleaner with these settings cleaned on its own (its
        ``counts`` and its ``kept_keys`` joined), dropping the pairs kept in an earlier range as
        duplicates. Returns None when every pair of the range stays, else the indices of those
        that go (ascending)."""
        self.counts.add(counts)
        new = self._keys.add_new(keys)
        if new.all():
            return None
        drop = np.flatnonzero(~new)
        self.counts.kept -= len(drop)
        self.counts.duplicate += len(drop)
        return drop


# ----------------------------------------------------------------------------- in parallel


def _line_cuts(path: Path, every: int) -> tuple[list[int], int, int]:
    """Byte offsets just after lines ``every``, ``2 * every``, ...; the line count (a last line
    without ``\n`` counts) and the size of the file. One read into one buffer, no decoding."""
    cuts: list[int] = []
    count = size = 0
    last = b"\n"
    buffer = bytearray(CUT_BLOCK_BYTES)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            block = np.frombuffer(buffer, dtype=np.uint8, count=n)
            newline = block == 10
            ends = int(np.count_nonzero(newline))
            if count + ends >= (len(cuts) + 1) * every:
                at = np.flatnonzero(newline)
                while count + ends >= (len(cuts) + 1) * every:
                    cuts.append(size + int(at[(len(cuts) + 1) * every - count - 1]) + 1)
            count += ends
            size += n
            last = bytes(buffer[n - 1:n])
    if count == 0 or (count == 1 and last == b"\n"):  # one line: refused if it is lines ended by lone \r
        refuse_lone_cr_ends(read_range(path, 0, min(size, CUT_BLOCK_BYTES)), str(path))
    # a cut at the very end (a file that ends with line ``k * every``) starts no range
    return [cut for cut in cuts if cut < size], count + (last != b"\n"), size


def aligned_ranges(src: Path, tgt: Path, lines_per_range: int,
                   pool: Pool | None = None) -> list[tuple[int, int, int, int, int]]:
    """Cut two line-aligned files into ranges of the same lines: ``(first line number, source
    start, source end, target start, target end)`` in bytes. A :class:`DataError` names both
    files if their line counts differ. With a ``pool``, its workers read the two files at once."""
    if pool is None:
        src_cuts, src_lines, src_size = _line_cuts(src, lines_per_range)
        tgt_cuts, tgt_lines, tgt_size = _line_cuts(tgt, lines_per_range)
    else:
        reads = [pool.apply_async(_line_cuts, (path, lines_per_range)) for path in (src, tgt)]
        settle(reads, pool)  # both finish before either's error leaves the pool
        (src_cuts, src_lines, src_size), (tgt_cuts, tgt_lines, tgt_size) = (result_of(pool, r) for r in reads)
    if src_lines != tgt_lines:
        raise mismatch_error(src, src_lines, tgt, tgt_lines)
    src_edges, tgt_edges = [0, *src_cuts, src_size], [0, *tgt_cuts, tgt_size]
    return [(1 + i * lines_per_range, src_edges[i], src_edges[i + 1], tgt_edges[i], tgt_edges[i + 1])
            for i in range(len(src_edges) - 1) if src_edges[i] < src_size or tgt_edges[i] < tgt_size]


def _lines_blob(lines: list[bytes]) -> bytes:
    """``lines`` (UTF-8, without their ends) as the bytes of a file, each ended by ``\n``."""
    return b"\n".join(lines) + b"\n" if lines else b""


def _verbatim(block: bytes, name: str, first: int) -> bool:
    """True when ``block`` decodes to its lines byte for byte (valid UTF-8, no ``\r``, no
    byte-order mark); raises the reader's one-line error for invalid UTF-8."""
    if not is_utf8(block):
        decode_block(block, name, first)  # raises, naming line and column
        return False  # never reached while Arrow and Python agree on what is UTF-8
    return b"\r" not in block and not (first == 1 and block.startswith(b"\xef\xbb\xbf"))


# What a worker gives back of each side of a range: where each kept line ends, counted from the
# range's first kept byte, and either None (the kept lines are in the side's part file) or the
# byte spans of the input file that hold them, in order (``(k, 2)``, int64).
Side = tuple[np.ndarray, np.ndarray | None]


def _clean_range_in_worker(task: tuple[Any, ...]) -> tuple[np.ndarray, CleanCounts, tuple[Side, Side]]:
    """Clean one range; return the kept pairs' keys, the counts, and where each side's kept
    lines are (:data:`Side`), so that the parent can append them to the output, dropping lines
    without reading them. A range is the text itself (Arrow rows made into lines), a
    :class:`~mtcli.data.arrowrows.BlockReader` that gives it here, or ``(path, start, end)`` of
    both text files (:func:`_clean_file_range`). Kept lines that are not spans of an input file
    are written to the part files ``<part>.src`` and ``<part>.tgt``."""
    part, first, src, tgt, max_length, max_ratio, dedup, characters = task
    cleaner = PairCleaner(max_length, max_ratio, dedup, record_keys=True, characters=characters)
    if isinstance(src, tuple):
        sides = _clean_file_range(cleaner, first, src, tgt, part)
    else:
        blocks = src.blocks() if isinstance(src, BlockReader) else [(src, tgt)]
        with _PartWriter(part) as writer:
            for src_block, tgt_block in blocks:  # Arrow's text: valid UTF-8, its rows made into lines
                ended = (_ended(src_block), _ended(tgt_block))
                layouts = _layouts(ended, False, first, ("", ""), cleaner)
                assert layouts is not None  # only strict blocks are declined
                writer.write_spans(ended, layouts, _kept(cleaner, layouts))
        sides = writer.sides()
    keys = np.concatenate([np.zeros(0, dtype=np.uint64), *cleaner.kept_keys])
    return keys, cleaner.counts, sides


def _kept(cleaner: PairCleaner, layouts: list[Lines]) -> np.ndarray:
    """The kept pairs of two sides' lines (:meth:`PairCleaner.clean_lines`)."""
    return cleaner.clean_lines(layouts[0].lengths, layouts[1].lengths, layouts[0].hashes, layouts[1].hashes)


def _clean_file_range(cleaner: PairCleaner, first: int, src: tuple[str, int, int],
                      tgt: tuple[str, int, int], part: str) -> tuple[Side, Side]:
    """Read, check (by :mod:`mtcli.data.textio`'s rules and errors) and clean the lines of
    ``(path, start, end)`` of the source and target files. Lines that are the reader's lines
    byte for byte are cleaned as bytes and given back as spans of the files, to be copied from
    there; a range that the reader would change (``\r``, a byte-order mark) is decoded line by
    line and its kept lines written to the part files, as is the last range of a file whose
    last line has no ``\n``."""
    blocks = (read_range(*src), read_range(*tgt))
    ended = (_ended(blocks[0]), _ended(blocks[1]))
    layouts = _layouts(ended, True, first, (src[0], tgt[0]), cleaner)
    if layouts is not None and ended[0] is blocks[0] and ended[1] is blocks[1]:
        kept = _kept(cleaner, layouts)
        return _file_side(layouts[0].stops, kept, src[1]), _file_side(layouts[1].stops, kept, tgt[1])
    with _PartWriter(part) as writer:
        if layouts is None:
            pairs = list(cleaner(zip(decode_block(blocks[0], src[0], first),
                                     decode_block(blocks[1], tgt[0], first), strict=True)))
            writer.write_lines([s.encode() for s, _ in pairs], [t.encode() for _, t in pairs])
        else:
            writer.write_spans(ended, layouts, _kept(cleaner, layouts))
    return writer.sides()


def _file_side(stops: np.ndarray, kept: np.ndarray, offset: int) -> Side:
    """The :data:`Side` of lines ``kept`` of a block that starts at byte ``offset`` of its file,
    whose lines end at ``stops``."""
    starts = np.concatenate(([0], stops[:-1]))
    runs = np.array(_spans(starts, stops, kept), dtype=np.int64).reshape(-1, 2) + offset
    return np.cumsum(stops[kept] - starts[kept]), runs


class _PartWriter:
    """The part files ``<part>.src`` and ``<part>.tgt`` of a range, opened when first written."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.outs: list[BinaryIO] = []
        self.ends: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])

    def __enter__(self) -> _PartWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        for out in self.outs:
            out.close()

    def _open(self) -> list[BinaryIO]:
        if not self.outs:
            self.outs = [open(f"{self.part}.src", "wb"), open(f"{self.part}.tgt", "wb")]
        return self.outs

    def write_spans(self, blocks: tuple[bytes, bytes], layouts: list[Lines], kept: np.ndarray) -> None:
        """Append lines ``kept`` of both blocks (each line ended by ``\n``)."""
        for side, out, block, lines in zip(self.ends, self._open(), blocks, layouts, strict=True):
            size = out.tell()
            side.append(_write_lines(out, block, lines.stops, kept) + size)

    def write_lines(self, src: list[bytes], tgt: list[bytes]) -> None:
        """Append ``src`` and ``tgt`` (lines without their ends)."""
        for side, out, lines in zip(self.ends, self._open(), (src, tgt), strict=True):
            size = out.tell()
            out.write(_lines_blob(lines))
            side.append(_line_ends(lines) + size)

    def sides(self) -> tuple[Side, Side]:
        """Both sides' line ends so far, in the part files."""
        src, tgt = (np.concatenate([np.zeros(0, dtype=np.int64), *side]) for side in self.ends)
        return (src, None), (tgt, None)


def _layouts(blocks: tuple[bytes, bytes], strict: bool, first: int, names: tuple[str, str],
             cleaner: PairCleaner) -> list[Lines] | None:
    """Both blocks' lines (:class:`~mtcli.data.scan.Lines`), measured as ``cleaner`` measures
    each side, with their hashes when it deduplicates. None when ``strict`` and the reader would
    change the bytes (they are then decoded line by line); raises the reader's one-line error for
    invalid UTF-8."""
    if strict and not all(_verbatim(block, name, first) for block, name in zip(blocks, names, strict=True)):
        return None
    return [numpy_lines(block, cleaner.dedup, characters)
            for block, characters in zip(blocks, cleaner.characters, strict=True)]


def _ended(block: bytes) -> bytes:
    """``block`` with a ``\n`` after its last line if it has none (the last range of a file
    that does not end with one)."""
    return block + b"\n" if block and not block.endswith(b"\n") else block


def _write_lines(out: BinaryIO, block: bytes, stops: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Write lines ``kept`` (ascending) of ``block`` (whose lines, each ended by ``\n``, end at
    ``stops``) to ``out``, a run of consecutive lines at a time; return the byte offsets just
    after each line written, counted from where it began, as :func:`_line_ends`."""
    starts = np.concatenate(([0], stops[:-1]))
    view = memoryview(block)
    out.writelines(view[start:stop] for start, stop in _spans(starts, stops, kept))
    return np.cumsum(stops[kept] - starts[kept])


def _spans(starts: np.ndarray, stops: np.ndarray, kept: np.ndarray) -> list[tuple[int, int]]:
    """The byte spans of the lines numbered ``kept`` (ascending), line ``i`` being bytes
    ``starts[i]`` to ``stops[i]``: one span for each run of consecutive lines."""
    if not len(kept):
        return []
    runs = np.flatnonzero(np.diff(kept) != 1) + 1  # where a run of consecutive lines begins
    firsts, lasts = kept[np.concatenate(([0], runs))], kept[np.concatenate((runs - 1, [len(kept) - 1]))]
    return list(zip(starts[firsts].tolist(), stops[lasts].tolist(), strict=True))


def _line_ends(lines: list[bytes]) -> np.ndarray:
    """Byte offsets just after each line of :func:`_lines_blob` ``(lines)``."""
    return np.cumsum(np.fromiter(map(len, lines), dtype=np.int64, count=len(lines)) + 1)


def clean_text_files(src: Path, tgt: Path, out_src: Path, out_tgt: Path, cleaner: PairCleaner,
                     workers: int, lines_per_range: int | None = None) -> None:
    """Clean two plain-text files into ``out_src``/``out_tgt`` with ``workers`` processes, with
    ``cleaner``'s settings and into its counts: the same files and counts as ``cleaner`` over the
    files' pairs in one process.

    One read of each file (the two at once, by two workers) finds where every
    ``lines_per_range``-th line (:data:`PAIRS_PER_RANGE`) ends (and checks that the files' line
    counts agree); each worker then reads, checks (the rules and errors of
    :mod:`mtcli.data.textio`) and cleans a range of lines, deduplicating within it. The parent
    takes the ranges in order and drops the pairs an earlier range already kept, so the first
    occurrence of a pair is the one kept, as in one process; the workers then copy each range's
    kept lines from the input files to their place in the output (inside the kernel). A range
    the reader would change (``\r``, a byte-order mark) goes through part files beside the
    output instead.
    """
    with _parts_directory(out_src) as parts, forked_pool(workers) as pool:  # the pool ends first
        ranges = aligned_ranges(src, tgt, lines_per_range or PAIRS_PER_RANGE, pool)
        tasks = ((first, (str(src), s0, s1), (str(tgt), t0, t1)) for first, s0, s1, t0, t1 in ranges)
        _clean_in_workers(tasks, out_src, out_tgt, cleaner, pool, workers, parts, (src, tgt))


def clean_text_blocks(blocks: Iterable[tuple[bytes, bytes] | BlockReader], out_src: Path, out_tgt: Path,
                      cleaner: PairCleaner, workers: int) -> None:
    """Clean pairs given as blocks of text (:meth:`mtcli.data.sourcebase.Source.text_blocks`), or
    as readers of them that the workers call themselves (:meth:`~mtcli.data.sourcebase.Source.block_readers`),
    into ``out_src``/``out_tgt`` with ``workers`` processes, as :func:`clean_text_files` does."""
    ranges = ((0, block, None) if isinstance(block, BlockReader) else (0, *block) for block in blocks)
    with _parts_directory(out_src) as parts, forked_pool(workers) as pool:
        _clean_in_workers(ranges, out_src, out_tgt, cleaner, pool, workers, parts)


def _parts_directory(out: Path) -> tempfile.TemporaryDirectory:
    """A temporary directory beside ``out`` for the workers' part files. It must outlive the
    pool: on an error, workers still running would write into a directory being removed."""
    return tempfile.TemporaryDirectory(prefix=".clean-", dir=out.parent)


def _clean_in_workers(ranges: Iterable[tuple[int, Any, Any]], out_src: Path, out_tgt: Path,
                      cleaner: PairCleaner, pool: Pool, workers: int, parts: str,
                      inputs: tuple[Path, Path] | None = None) -> None:
    """Clean ``(first line, source, target)`` ranges in ``pool``'s ``workers`` processes. The
    parent takes the results in order and drops the pairs an earlier range kept; the workers
    then copy each range's kept lines, from its part files under ``parts`` or from the
    ``inputs`` files, to where they belong in the output (a copy inside the kernel)."""
    settings = (cleaner.max_length, cleaner.max_ratio, cleaner.dedup, cleaner.characters)
    tasks = ((f"{parts}/{i:06d}", *task, *settings) for i, task in enumerate(ranges))
    outs = (str(out_src), str(out_tgt))
    for out in outs:
        open(out, "wb").close()
    copies: list[AsyncResult] = []
    written = [0, 0]
    try:
        for i, (keys, counts, sides) in enumerate(in_order(pool, _clean_range_in_worker, tasks, 2 * workers)):
            drop = cleaner.absorb(counts, keys)
            for side, suffix, (ends, runs) in zip((0, 1), ("src", "tgt"), sides, strict=True):
                spans = _kept_spans(ends, drop)
                part = f"{parts}/{i:06d}.{suffix}"
                if runs is not None:
                    assert inputs is not None
                    origin, spans = str(inputs[side]), list(_through(spans, runs))
                elif spans:
                    origin = part
                else:
                    Path(part).unlink(missing_ok=True)
                    continue
                task = (origin, spans, outs[side], written[side], runs is None)
                copies.append(pool.apply_async(_copy_spans, (task,)))
                written[side] += sum(stop - start for start, stop in spans)
    finally:
        settle(copies, pool)  # every copy finishes before an error leaves the pool
    for copy in copies:
        result_of(pool, copy)


def _copy_spans(task: tuple[str, list[tuple[int, int]], str, int, bool]) -> None:
    """Copy byte ``spans`` of a file into another from byte ``at`` on (a worker's task), and
    delete the file after when ``delete`` (a part file)."""
    origin, spans, out, at, delete = task
    with open(origin, "rb") as handle, open(out, "r+b") as target:
        for start, stop in spans:
            _copy_span(handle.fileno(), target.fileno(), start, stop, at)
            at += stop - start
    if delete:
        os.unlink(origin)


def _through(spans: list[tuple[int, int]], runs: np.ndarray) -> Iterator[tuple[int, int]]:
    """The ``spans`` (ascending) of the bytes that the spans of a file ``runs`` hold, one after
    another, as spans of that file."""
    lengths = runs[:, 1] - runs[:, 0]
    offsets = np.concatenate(([0], np.cumsum(lengths))).tolist()
    starts = runs[:, 0].tolist()
    k = 0
    for start, stop in spans:
        while offsets[k + 1] <= start:
            k += 1
        while start < stop:
            span_stop = min(stop, offsets[k + 1])
            yield starts[k] + start - offsets[k], starts[k] + span_stop - offsets[k]
            start = span_stop
            if start == offsets[k + 1]:
                k += 1


def _kept_spans(ends: np.ndarray, drop: np.ndarray | None) -> list[tuple[int, int]]:
    """The byte spans of a part file (whose lines end at ``ends``) left when the lines numbered
    ``drop`` (ascending; None for none) are taken out."""
    kept = np.arange(len(ends)) if drop is None else np.delete(np.arange(len(ends)), drop)
    return _spans(np.concatenate(([0], ends[:-1])), ends, kept)


def _copy_span(source: int, target: int, start: int, stop: int, at: int) -> None:
    """Copy bytes ``[start, stop)`` of the open file ``source`` to byte ``at`` of ``target``
    (file descriptors), inside the kernel where it can."""
    size = stop - start
    try:
        while size > 0:
            copied = os.copy_file_range(source, target, size, stop - size, at + stop - start - size)
            if copied == 0:
                break
            size -= copied
    except (AttributeError, OSError):
        pass
    while size > 0:  # no copy_file_range here (or it stopped short): copy what is left in Python
        chunk = os.pread(source, min(size, 1 << 24), stop - size)
        if not chunk:
            raise OSError(f"file shorter than expected while copying byte {stop - size}")
        os.pwrite(target, chunk, at + stop - start - size)
        size -= len(chunk)

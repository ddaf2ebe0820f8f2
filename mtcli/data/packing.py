"""Packed batches: several sentence pairs in each row of a fixed length, so every batch has one shape.

Token batches (:mod:`mtcli.data.batching`) change shape from batch to batch, and pad every
sentence to the longest in its batch. Packing instead lays sentence pairs end to end in rows of
``length`` slots: a row's source holds the sources of its pairs (each with its eos), the same
row's decoder input and target hold their targets (bos + ids, ids + eos) in the same order, and
the rest of the row is padding. A batch is ``rows`` such rows, always ``[rows, length]``: one
compiled graph, replayable as a CUDA graph, and little padding.

Each slot carries its pair's number within the row (its *segment*, 1, 2, ...; 0 at padding)
and its position within its own sentence. The model keeps the pairs of a row apart with them
(:func:`mtcli.model.attention.packed_attn_masks`): attention stays inside a sentence, and
positional encodings restart at each sentence, so a packed pair gets the same outputs as it
would alone (a test checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.device import to_device

#: How many of the most recent rows stay open for the next pair: a pair that does not fit the
#: newest row may still fill a gap in one of these (a fuller packing than one open row).
OPEN_ROWS = 8


def rows_per_batch(max_tokens: int, length: int) -> int:
    """How many rows of ``length`` slots a batch of ``max_tokens`` holds (at least one)."""
    return max(1, int(max_tokens) // length)


def pack_rows(src_lengths: np.ndarray, tgt_lengths: np.ndarray, order: np.ndarray, length: int) -> list[np.ndarray]:
    """Cut the pairs ``order`` (indices into the length arrays, taken in that order) into rows of
    ``length`` slots: each row's pairs need ``src + 1`` source slots and ``tgt + 1`` target slots
    (the eos, the bos) and fit ``length`` on both sides. A pair goes into the first of the last
    :data:`OPEN_ROWS` rows with room on both sides, else opens a new row. Pairs too long for a row
    on their own raise ``ValueError`` (filter them first)."""
    need_src = (src_lengths[order].astype(np.int64) + 1).tolist()
    need_tgt = (tgt_lengths[order].astype(np.int64) + 1).tolist()
    if need_src and max(max(need_src), max(need_tgt)) > length:
        raise ValueError(f"a pair needs more than {length} slots: filter pairs longer than {length - 1} pieces first")
    closed: list[list[int]] = []  # rows that left the window, in the order they were opened
    rows: list[list[int]] = []  # the open rows, oldest first, and their free source and target slots
    free_src: list[int] = []
    free_tgt: list[int] = []
    for pair, s, t in zip(order.tolist(), need_src, need_tgt, strict=True):
        for r in range(len(rows)):
            if free_src[r] >= s and free_tgt[r] >= t:
                rows[r].append(pair)
                free_src[r] -= s
                free_tgt[r] -= t
                break
        else:
            if len(rows) == OPEN_ROWS:
                closed.append(rows.pop(0))
                del free_src[0], free_tgt[0]
            rows.append([pair])
            free_src.append(length - s)
            free_tgt.append(length - t)
    return [np.asarray(row, dtype=np.int64) for row in closed + rows]


def pack_epoch(src_lengths: np.ndarray, tgt_lengths: np.ndarray, indices: np.ndarray, rows: int, length: int,
               seed: int, epoch: int) -> list[list[np.ndarray]]:
    """An epoch's packed batches: the pairs ``indices`` shuffled with a generator seeded by
    ``(seed, epoch)``, packed into rows (:func:`pack_rows`), ``rows`` rows a batch (the last one
    may have fewer; collation pads it with empty rows). A pure function of its arguments, so the
    position ``(epoch, batch)`` still says everything for resume."""
    order = np.random.default_rng([seed, epoch, 11]).permutation(np.asarray(indices, dtype=np.int64))
    packed = pack_rows(src_lengths, tgt_lengths, order, length)
    return [packed[i:i + rows] for i in range(0, len(packed), rows)]


def packed_padding(batches: Sequence[Sequence[np.ndarray]], src_lengths: np.ndarray, tgt_lengths: np.ndarray,
                   rows: int, length: int) -> float:
    """Share of padding slots over the source and target tensors of packed batches."""
    pairs = [np.concatenate(batch) for batch in batches if len(batch)]
    real = sum(int(src_lengths[p].sum() + tgt_lengths[p].sum()) + 2 * len(p) for p in pairs)
    slots = 2 * rows * length * len(pairs)
    return 1.0 - real / slots if slots else 0.0


class SlotCounts:
    """What every collated batch reports of its padding (:class:`~mtcli.data.batching.Batch` and
    :class:`PackedBatch`): both hold ``src``, ``tgt_out`` and their real token counts."""

    src: Tensor
    tgt_out: Tensor
    src_tokens: int
    tgt_tokens: int

    @property
    def padded_tokens(self) -> int:
        """Slots in the source and target tensors, padding included."""
        return int(self.src.numel() + self.tgt_out.numel())

    @property
    def padding(self) -> float:
        """Share of padding among the slots of ``src`` and ``tgt_out``."""
        return 1.0 - (self.src_tokens + self.tgt_tokens) / max(self.padded_tokens, 1)


@dataclass
class PackedBatch(SlotCounts):
    """``rows`` rows of ``length`` slots: ids ``src``, ``tgt_in``, ``tgt_out``, and per slot its
    pair's segment (``src_segments``, ``tgt_segments``: 1, 2, ... within the row, 0 at padding) and
    its position within its sentence (``src_positions``, ``tgt_positions``). All ``[rows, length]``
    int64."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    src_segments: Tensor
    tgt_segments: Tensor
    src_positions: Tensor
    tgt_positions: Tensor
    src_tokens: int
    tgt_tokens: int

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on ``device`` (through pinned memory to a GPU: :func:`to_device`)."""
        moved = {name: to_device(getattr(self, name), device) for name in
                 ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions", "tgt_positions")}
        return PackedBatch(**moved, src_tokens=self.src_tokens, tgt_tokens=self.tgt_tokens)


def _lay_out(ids: list[np.ndarray], rows: np.ndarray, segments: np.ndarray, shape: tuple[int, int],
             with_bos: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """One side of packed rows: the sentences ``ids`` end to end within their ``rows`` (a
    sentence per entry, in row order), each taking its length + 1 slots. Returns ``(ids + eos,
    bos + ids or None, segments, positions)``, each ``shape``; the bos form only ``with_bos``."""
    sizes = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes  # in the flat stream of all the sentences
    words = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    # where each sentence starts in its row: its flat start less its row's first flat start
    row_first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else rows
    row_start = np.repeat(starts[row_first], np.diff(np.r_[row_first, len(rows)]))
    sentence = np.repeat(np.arange(len(ids)), sizes)
    position = np.arange(len(sentence)) - starts[sentence]
    slot = (rows[sentence], starts[sentence] - row_start[sentence] + position)

    def place(values: np.ndarray | int, fill: int = 0) -> np.ndarray:
        out = np.full(shape, fill, dtype=np.int64)
        out[slot] = values
        return out

    def with_marker(marker: np.ndarray, symbol: int) -> np.ndarray:
        flat = np.empty(len(sentence), dtype=np.int64)
        is_word = np.ones(len(flat), dtype=bool)
        is_word[marker] = False
        flat[marker], flat[is_word] = symbol, words
        return place(flat, PAD_ID)

    with_eos = with_marker(ends - 1, EOS_ID)
    with_bos_first = with_marker(starts, BOS_ID) if with_bos else None
    return with_eos, with_bos_first, place(segments[sentence]), place(position)


def collate_packed(src: Any, tgt: Any, rows: Sequence[np.ndarray], n_rows: int, length: int) -> PackedBatch:
    """The pairs of ``rows`` (from :func:`pack_rows`; ``src``/``tgt`` index the sentences' ids, as
    :class:`~mtcli.data.batching.SentenceArray` does) as a :class:`PackedBatch` of ``n_rows`` rows
    (rows beyond ``len(rows)`` are all padding, so every batch has the same shape)."""
    if len(rows) > n_rows:
        raise ValueError(f"{len(rows)} rows do not fit a batch of {n_rows}")
    pairs = np.concatenate(rows).astype(np.int64) if len(rows) else np.zeros(0, dtype=np.int64)
    row_of = np.repeat(np.arange(len(rows)), [len(r) for r in rows])
    segments = np.concatenate([np.arange(1, len(r) + 1) for r in rows]) if len(rows) else row_of
    src_ids = [np.asarray(src[p], dtype=np.int64) for p in pairs.tolist()]
    tgt_ids = [np.asarray(tgt[p], dtype=np.int64) for p in pairs.tolist()]
    shape = (n_rows, length)
    source, _, src_segments, src_positions = _lay_out(src_ids, row_of, segments, shape, with_bos=False)
    tgt_out, tgt_in, tgt_segments, tgt_positions = _lay_out(tgt_ids, row_of, segments, shape, with_bos=True)
    tensors = {"src": source, "tgt_in": tgt_in, "tgt_out": tgt_out, "src_segments": src_segments,
               "tgt_segments": tgt_segments, "src_positions": src_positions, "tgt_positions": tgt_positions}
    return PackedBatch(**{k: torch.from_numpy(v) for k, v in tensors.items()},
                       src_tokens=sum(len(x) + 1 for x in src_ids), tgt_tokens=sum(len(y) + 1 for y in tgt_ids))


__all__ = ["OPEN_ROWS", "PackedBatch", "SlotCounts", "collate_packed", "pack_epoch", "pack_rows", "packed_padding",
           "rows_per_batch"]

"""Token-budget batches from length-sorted buckets, and collation with bos/eos/pad.

A batch holds as many sentence pairs as fit a budget of *padded* tokens:

    batch_size * max(longest source, longest target) <= max_tokens

where lengths include the added eos (source, target) or bos (decoder input). To keep padding
low without making every batch hold sentences of one length forever, an epoch is built as:

1. shuffle the kept pair indices with a generator seeded by ``(seed, epoch)``;
2. cut the shuffled order into pools of about ``pool_batches`` batches' worth of pairs;
3. sort each pool by length and cut it greedily into token-budget batches;
4. shuffle the order of all the epoch's batches.

The batch list of an epoch is therefore a pure function of ``(seed, epoch)``, so the position in
the data stream is just ``(epoch, index of the next batch)``: what :class:`BatchStream` saves and
restores for exact resume. Under DistributedDataParallel every rank builds the same list and takes
every ``world_size``-th batch of each step's group.

Pairs longer than ``max_source_length`` / ``max_target_length`` pieces are skipped and counted;
a single pair over ``max_tokens`` gets a batch of its own.

Collation follows the fixed conventions: source = ids + [eos], decoder input = [bos] + ids,
decoder target = ids + [eos], padded with ``pad`` (0) into int64 tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from mtcli.data.packing import (
    PackedBatch,
    SlotCounts,
    collate_packed,
    pack_epoch,
    packed_padding,
    rows_per_batch,
)
from mtcli.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from mtcli.device import to_device
from mtcli.errors import DataError
from mtcli.logs import get_logger


class SentenceArray(Protocol):
    """What batching needs of a cache array (``mtcli.data.cache.TokenArray``)."""

    lengths: np.ndarray

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> np.ndarray: ...


Resegment = Callable[[int], tuple[SentenceArray, SentenceArray]]


@dataclass
class Batch(SlotCounts):
    """One collated batch: ``src`` [B, S], ``tgt_in`` / ``tgt_out`` [B, T], all int64."""

    src: Tensor
    tgt_in: Tensor
    tgt_out: Tensor
    indices: np.ndarray
    src_tokens: int
    tgt_tokens: int

    def padded(self, multiple: int) -> Batch:
        """The batch with its source and target lengths padded up to a multiple of ``multiple``.

        The loss and every real position's output are unchanged (pad keys are masked, pad targets
        ignored, and the causal mask keeps trailing pads out of earlier positions). A compiled
        step needs it: its kernels assume the alignment of the first lengths they saw, and a
        length off that alignment would compile the step again."""
        return dataclasses.replace(self, src=pad_length(self.src, multiple), tgt_in=pad_length(self.tgt_in, multiple),
                                   tgt_out=pad_length(self.tgt_out, multiple))

    def to(self, device: torch.device | str) -> Batch:
        """Move the tensors to ``device`` without waiting for it (:func:`to_device`)."""
        return Batch(
            src=to_device(self.src, device),
            tgt_in=to_device(self.tgt_in, device),
            tgt_out=to_device(self.tgt_out, device),
            indices=self.indices,
            src_tokens=self.src_tokens,
            tgt_tokens=self.tgt_tokens,
        )


def filter_by_length(src_lengths: np.ndarray, tgt_lengths: np.ndarray, max_source_length: int,
                     max_target_length: int) -> tuple[np.ndarray, int]:
    """Indices of pairs within both limits (in pieces, without bos/eos), and how many were skipped."""
    src_lengths = np.asarray(src_lengths, dtype=np.int64)
    tgt_lengths = np.asarray(tgt_lengths, dtype=np.int64)
    if src_lengths.shape != tgt_lengths.shape:
        raise DataError(
            f"source and target have different sentence counts ({len(src_lengths)} vs {len(tgt_lengths)})"
        )
    keep = (src_lengths <= max_source_length) & (tgt_lengths <= max_target_length)
    indices = np.flatnonzero(keep).astype(np.int64)
    return indices, int(len(src_lengths) - len(indices))


def cut_batches(order: np.ndarray, width: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Greedily cut ``order`` (items sorted by ``width``, ``width[k]`` that of ``order[k]``) into
    batches of consecutive items with ``len(batch) * max(width in batch) <= max_tokens``; an item
    wider than the budget gets a batch of its own. The one batching rule of training,
    validation and decoding."""
    batches: list[np.ndarray] = []
    start = 0
    widest = 0
    for pos in range(len(order)):
        w = int(width[pos])
        widest_if_added = max(widest, w)
        if pos > start and (pos - start + 1) * widest_if_added > max_tokens:
            batches.append(order[start:pos])
            start = pos
            widest_if_added = w
        widest = widest_if_added
    if start < len(order):
        batches.append(order[start:])
    return batches


def make_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, indices: np.ndarray,
                 max_tokens: int, *, seed: int = 1, epoch: int = 0, shuffle: bool = True,
                 pool_batches: int = 100) -> list[np.ndarray]:
    """Token-budget batches of ``indices`` (each an int64 array of pair indices).

    ``src_lengths``/``tgt_lengths`` are piece counts without bos/eos (one per pair of the
    whole split). With ``shuffle=False`` the pairs are sorted by length as one pool and the
    batches come in that order (for validation). Deterministic given ``(seed, epoch)``.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0:
        return []
    src_size = np.asarray(src_lengths, dtype=np.int64)[indices] + 1
    tgt_size = np.asarray(tgt_lengths, dtype=np.int64)[indices] + 1
    width = np.maximum(src_size, tgt_size)
    rng = np.random.default_rng([int(seed), int(epoch)])
    if shuffle:
        perm = rng.permutation(len(indices))
        per_batch = max(1, max_tokens // max(1, int(width.mean())))
        pool = max(1, per_batch * max(1, pool_batches))
    else:
        perm = np.arange(len(indices))
        pool = len(indices)
    batches: list[np.ndarray] = []
    for start in range(0, len(perm), pool):
        chunk = perm[start:start + pool]
        # Stable sort by (width, source size, target size): ties keep the shuffled order.
        order = chunk[np.lexsort((tgt_size[chunk], src_size[chunk], width[chunk]))]
        for local in cut_batches(order, width[order], max_tokens):
            batches.append(indices[local])
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def source_batches(lengths: Sequence[int], max_tokens: int, beam_size: int = 1) -> list[list[int]]:
    """Decoding batches: indices into ``lengths`` (source pieces, without eos), longest first,
    cut with :func:`cut_batches` so that ``B * S_max * beam_size <= max_tokens`` where ``S_max``
    counts eos. Every index appears in exactly one batch."""
    order = np.array(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), dtype=np.int64)
    width = np.asarray(lengths, dtype=np.int64).reshape(-1)[order] + 1
    return [b.tolist() for b in cut_batches(order, width, max_tokens // max(1, beam_size))]


def source_batch_tokens(lengths: Sequence[int], beam_size: int = 1) -> int:
    """``B * S_max * beam_size``: the tokens :func:`source_batches` counts for one batch of
    sources of ``lengths`` pieces (``S_max`` counts eos)."""
    return len(lengths) * (max(lengths) + 1) * max(1, beam_size)


def padding_fraction(batches: Sequence[np.ndarray], src_lengths: np.ndarray,
                     tgt_lengths: np.ndarray) -> float:
    """Share of padding slots over all source and target tensors the batches collate to."""
    real = 0
    padded = 0
    for batch in batches:
        s = np.asarray(src_lengths)[batch] + 1
        t = np.asarray(tgt_lengths)[batch] + 1
        real += int(s.sum() + t.sum())
        padded += len(batch) * int(s.max() + t.max())
    return 1.0 - real / padded if padded else 0.0


def pad_length(ids: Tensor, multiple: int) -> Tensor:
    """``[B, L]`` ids with pad columns added up to a length that is a multiple of ``multiple``."""
    extra = -ids.size(1) % multiple
    return torch.nn.functional.pad(ids, (0, extra), value=PAD_ID) if extra else ids


def collate(src: SentenceArray, tgt: SentenceArray, indices: np.ndarray, *, pad_id: int = PAD_ID,
            bos_id: int = BOS_ID, eos_id: int = EOS_ID) -> Batch:
    """Pad pairs into tensors: source = ids+[eos], decoder input = [bos]+ids, target = ids+[eos]."""
    indices = np.asarray(indices, dtype=np.int64)
    src_ids = [np.asarray(src[int(i)], dtype=np.int64) for i in indices]
    tgt_ids = [np.asarray(tgt[int(i)], dtype=np.int64) for i in indices]
    n = len(indices)
    s_len = max(len(x) for x in src_ids) + 1
    t_len = max(len(y) for y in tgt_ids) + 1
    src_out = np.full((n, s_len), pad_id, dtype=np.int64)
    tgt_in = np.full((n, t_len), pad_id, dtype=np.int64)
    tgt_out = np.full((n, t_len), pad_id, dtype=np.int64)
    for row, (x, y) in enumerate(zip(src_ids, tgt_ids, strict=True)):
        src_out[row, : len(x)] = x
        src_out[row, len(x)] = eos_id
        tgt_in[row, 0] = bos_id
        tgt_in[row, 1 : len(y) + 1] = y
        tgt_out[row, : len(y)] = y
        tgt_out[row, len(y)] = eos_id
    return Batch(
        src=torch.from_numpy(src_out),
        tgt_in=torch.from_numpy(tgt_in),
        tgt_out=torch.from_numpy(tgt_out),
        indices=indices,
        src_tokens=int(sum(len(x) + 1 for x in src_ids)),
        tgt_tokens=int(sum(len(y) + 1 for y in tgt_ids)),
    )


def collate_sources(sources: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Pad source ids for decoding: ``ids + [eos]`` rows of a ``[B, S]`` long tensor (pad 0)."""
    width = max(len(s) for s in sources) + 1
    batch = torch.full((len(sources), width), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(sources):
        batch[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
        batch[row, len(ids)] = EOS_ID
    return batch.to(device)


class CorpusMix:
    """Which training pairs an epoch reads when they come from several corpora with weights
    (``data.sources[k].weight``): corpus k's pairs are drawn ``weight_k`` times an epoch on
    average. A weight of 2 reads each pair twice; 0.5 reads half of them, a different half each
    epoch; 1.5 reads each once and a random half again. The draw is a pure function of
    ``(seed, epoch, k)``, so the position ``(epoch, batch)`` still says everything for resume.

    ``sizes`` are the corpora's pair counts, in the order their pairs are numbered."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], seed: int) -> None:
        if len(sizes) != len(weights):
            raise DataError(f"data.sources lists {len(weights)} corpora but the prepared cache holds "
                            f"{len(sizes)}; run `mtcli prepare` again")
        self.bounds = np.cumsum([0, *sizes])
        self.weights = [float(w) for w in weights]
        self.seed = int(seed)

    @property
    def uniform(self) -> bool:
        """Whether every pair is read once an epoch (all weights 1): the pairs as they are."""
        return all(w == 1.0 for w in self.weights)

    def epoch_indices(self, indices: np.ndarray, epoch: int) -> np.ndarray:
        """The pairs of ``indices`` (those within the length limits) that ``epoch`` reads."""
        if self.uniform:
            return indices
        chosen = []
        for k, weight in enumerate(self.weights):
            mine = indices[(indices >= self.bounds[k]) & (indices < self.bounds[k + 1])]
            if not len(mine):
                continue
            # weight x pairs drawn on average: the fraction is one pair more in that share of epochs
            # (rounded, a weight under 1/(2 x pairs) drew none, ever)
            total = weight * len(mine)
            extra = np.random.default_rng([self.seed, int(epoch), k, 8]).random() < total - int(total)
            whole, part = divmod(int(total) + int(extra), len(mine))
            rng = np.random.default_rng([self.seed, int(epoch), k, 7])
            chosen += [np.tile(mine, whole), rng.choice(mine, size=part, replace=False)]
        return np.concatenate(chosen) if chosen else indices[:0]

    def shares(self, indices: np.ndarray) -> list[float]:
        """Each corpus's share of an epoch's pairs (for the log)."""
        drawn = [self.weights[k] * int(((indices >= self.bounds[k]) & (indices < self.bounds[k + 1])).sum())
                 for k in range(len(self.weights))]
        total = sum(drawn) or 1.0
        return [d / total for d in drawn]


@dataclass
class StepGroup:
    """The batches of one optimiser step: ``batches`` is the whole group (all ranks)."""

    epoch: int
    start: int
    batches: list[Any]  # each a batch's pair indices, or packed, its rows' (mtcli.data.packing)
    world_size: int
    rank: int

    def mine(self) -> list[Any]:
        """This rank's share: every ``world_size``-th batch starting at ``rank``."""
        return self.batches[self.rank :: self.world_size]

    def target_tokens(self, tgt_lengths: np.ndarray) -> int:
        """Non-pad target tokens (with eos) of the whole group, the loss normaliser on every rank."""
        pairs = [np.concatenate(b) if isinstance(b, list) else b for b in self.batches]
        return int(sum(int(np.asarray(tgt_lengths)[b].sum()) + len(b) for b in pairs))


class BatchStream:
    """The endless, deterministic sequence of training batches, grouped per optimiser step.

    Each epoch's batch list comes from :func:`make_batches` with ``(seed, epoch)``; the list is
    trimmed to a multiple of ``world_size`` (so every rank does the same number of steps) and read
    in groups of ``update_freq * world_size`` batches that never cross an epoch boundary (the
    last group of an epoch may be shorter). ``state_dict()`` is the position ``(epoch, batch)``
    of the next group.

    With ``resegment`` (subword regularisation), every epoch reads the pairs that
    ``resegment(epoch)`` returns, a deterministic function of the epoch, instead of ``src``/``tgt``:
    lengths, the length filter and the batches are recomputed per epoch, and ``src``, ``tgt``,
    ``src_lengths``, ``tgt_lengths``, ``indices`` and ``skipped`` describe the epoch of the last
    :meth:`next_group` (resume stays exact: the position still says everything).

    With ``mix`` (several corpora by weight), each epoch reads the pairs :class:`CorpusMix` draws.

    With ``pack_length`` > 0 the batches are packed (:mod:`mtcli.data.packing`): ``max_tokens //
    pack_length`` rows of ``pack_length`` slots each, pairs longer than a row skipped, and
    :meth:`collate` gives :class:`~mtcli.data.packing.PackedBatch` es of that one shape.

    Resumed under another ``max_tokens`` in the middle of an epoch, the epoch keeps the batches it
    had done and batches the pairs it had not yet seen under the new budget (its ``segments``:
    each earlier budget and where its batches stop), so every pair of the epoch is still seen
    once; the state carries the segments, so a later resume rebuilds the same epoch.
    """

    def __init__(self, src: SentenceArray, tgt: SentenceArray, *, max_tokens: int,
                 max_source_length: int, max_target_length: int, seed: int, update_freq: int = 1,
                 world_size: int = 1, rank: int = 0, pool_batches: int = 100,
                 resegment: Resegment | None = None, mix: CorpusMix | None = None, pack_length: int = 0) -> None:
        self.mix = mix
        self.pack_length = int(pack_length)
        self.pack_rows = rows_per_batch(max_tokens, self.pack_length) if self.pack_length else 0
        longest = self.pack_length - 1 if self.pack_length else max(max_source_length, max_target_length)
        self.max_source_length = min(int(max_source_length), longest)
        self.max_target_length = min(int(max_target_length), longest)
        self.resegment = resegment
        self._use_arrays(src, tgt)
        self.max_tokens = int(max_tokens)
        self.seed = int(seed)
        self.update_freq = max(1, int(update_freq))
        self.world_size = max(1, int(world_size))
        self.rank = int(rank)
        self.pool_batches = int(pool_batches)
        self.epoch = 0
        self.batch = 0
        self._cached: tuple[int, list[Any], tuple[SentenceArray, SentenceArray]] | None = None
        self.segments: list[tuple[int, int]] = []  # the current epoch's earlier budgets and their ends
        self.left_out = 0  # batches the last epoch_batches() left out (fewer than the processes)
        if self.mix is not None and not len(self.mix.epoch_indices(self.indices, 0)):
            raise DataError("the corpus weights (data.sources[].weight) draw no training pair an epoch: raise them "
                            "(a weight is how many times each of a corpus's pairs is drawn, on average)")
        per_process = len(self.epoch_batches(0)) // self.world_size
        if per_process < 1:
            raise DataError(
                f"the training split makes too few batches for {self.world_size} processes (each takes one "
                f"a step); lower train.max_tokens"
            )
        if self.update_freq > per_process:  # no step spans two epochs
            get_logger().warning("an epoch makes %d batches a process, so a step takes those %d, not "
                                 "train.update_freq=%d: its updates are smaller than asked; lower train.max_tokens "
                                 "for more batches", per_process, per_process, self.update_freq)

    def _use_arrays(self, src: SentenceArray, tgt: SentenceArray) -> None:
        """Read pairs from ``src``/``tgt`` from now on (lengths and the length filter follow)."""
        self.src, self.tgt = src, tgt
        self.src_lengths = np.asarray(src.lengths, dtype=np.int64)
        self.tgt_lengths = np.asarray(tgt.lengths, dtype=np.int64)
        self.indices, self.skipped = filter_by_length(
            self.src_lengths, self.tgt_lengths, self.max_source_length, self.max_target_length
        )
        if len(self.indices) == 0:
            limits = ("train.max_source_length and train.max_target_length, at most model.max_positions - 1"
                      + (f", and train.pack_length - 1 ({self.pack_length - 1})" if self.pack_length else ""))
            raise DataError(
                f"no training pair is within {self.max_source_length} source and {self.max_target_length} target "
                f"pieces ({self.skipped} skipped; the limits are {limits})"
            )

    def epoch_batches(self, epoch: int) -> list[Any]:
        """The epoch's batch list, trimmed to a multiple of ``world_size`` (cached per epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            if self.resegment is not None:
                self._use_arrays(*self.resegment(epoch))
            indices = self.indices if self.mix is None else self.mix.epoch_indices(self.indices, epoch)
            done: list[Any] = []
            for max_tokens, end in self.segments if epoch == self.epoch else []:
                taken = self._batched(indices, max_tokens, epoch)[: end - len(done)]
                done += taken
                if taken:  # indices holds the pairs not seen yet: take away this segment's alone
                    indices = _without(indices, np.concatenate([np.concatenate(b) if self.pack_length else b
                                                                for b in taken]))
            batches = self._batched(indices, self.max_tokens, epoch)
            usable = len(batches) // self.world_size * self.world_size
            self.left_out = len(batches) - usable  # (fewer than the processes: out of this epoch)
            self._cached = (epoch, done + batches[:usable], (self.src, self.tgt))
        elif self.resegment is not None and self.src is not self._cached[2][0]:
            self._use_arrays(*self._cached[2])
        return self._cached[1]

    def _batched(self, indices: np.ndarray, max_tokens: int, epoch: int) -> list[Any]:
        """The batches of ``indices`` under a budget of ``max_tokens`` (packed or not), untrimmed."""
        if self.pack_length:
            return pack_epoch(self.src_lengths, self.tgt_lengths, indices, rows_per_batch(max_tokens, self.pack_length),
                              self.pack_length, self.seed, epoch)
        return make_batches(self.src_lengths, self.tgt_lengths, indices, max_tokens,
                            seed=self.seed, epoch=epoch, pool_batches=self.pool_batches)

    def padding_fraction(self, epoch: int | None = None) -> float:
        """Padding share of an epoch's batches (default: the current epoch)."""
        batches = self.epoch_batches(self.epoch if epoch is None else epoch)
        if self.pack_length:
            return packed_padding(batches, self.src_lengths, self.tgt_lengths, self.pack_rows, self.pack_length)
        return padding_fraction(batches, self.src_lengths, self.tgt_lengths)

    def next_group(self) -> StepGroup:
        """The batches of the next optimiser step; advances the position."""
        batches = self.epoch_batches(self.epoch)
        group_size = self.update_freq * self.world_size
        group = StepGroup(self.epoch, self.batch, batches[self.batch : self.batch + group_size],
                          self.world_size, self.rank)
        self.batch += len(group.batches)
        if self.batch >= len(batches):
            self._next_epoch()
        return group

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.batch = 0
        self.segments = []

    def steps_until_epoch(self, epoch: int) -> int:
        """Optimiser steps from the position to the start of ``epoch``, the epochs after this one
        counted as long as this one (a mix or subword sampling changes them a little). It batches
        nothing: at the start of an epoch not batched yet, the last one batched stands for it (so
        that subword sampling does not switch the pairs under a step still training on them)."""
        group = self.update_freq * self.world_size
        batches = len(self._cached[1] if self._cached is not None else self.epoch_batches(self.epoch))
        return -(-(batches - self.batch) // group) + max(0, epoch - self.epoch - 1) * -(-batches // group)

    def collate(self, indices: Any) -> Batch | PackedBatch:
        """Collate one batch of this stream's pairs (packed: its rows, into the one packed shape)."""
        if self.pack_length:
            return collate_packed(self.src, self.tgt, indices, self.pack_rows, self.pack_length)
        return collate(self.src, self.tgt, indices)

    def state_dict(self) -> dict[str, Any]:
        """Position of the next group: ``{"epoch": int, "batch": int}`` (plus the seed for checks),
        the ``max_tokens`` the epoch is batched with and the ``segments`` of earlier budgets (see
        the class docstring), which let a resume under another ``max_tokens`` go on with the
        pairs the epoch has not seen."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "max_tokens": self.max_tokens,
                "segments": [list(s) for s in self.segments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position. Saved under another ``max_tokens``, or by another number
        of processes at a position this one's cannot share, the epoch keeps the batches it had
        done and batches the pairs it had not seen under this budget (every pair of the epoch
        once, but not in the batches an uninterrupted run would make: inexact)."""
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.segments = [(int(tokens), int(end)) for tokens, end in state.get("segments", [])]
        saved = int(state.get("max_tokens", self.max_tokens))
        start = self.segments[-1][1] if self.segments else 0  # where the batches of this budget begin
        if self.batch > start and (saved != self.max_tokens or (self.batch - start) % self.world_size):
            # another budget, or a position saved by another number of processes that this one's
            # cannot share (each rank must get a batch of every group): the rest of the epoch is
            # batched anew, in a count the processes share evenly
            self.segments.append((saved, self.batch))
        self._cached = None
        if self.batch >= len(self.epoch_batches(self.epoch)):
            self._next_epoch()


def _without(indices: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """``indices`` less ``taken``, as multisets (a pair drawn twice by a mix and taken once stays
    once), in their order."""
    if not len(taken):
        return indices
    size = int(max(indices.max(initial=0), taken.max())) + 1
    left = np.bincount(taken, minlength=size)  # occurrences still to remove, per pair
    order = np.argsort(indices, kind="stable")
    ranked = indices[order]
    occurrence = np.arange(len(ranked)) - np.searchsorted(ranked, ranked, side="left")
    keep = np.empty(len(indices), dtype=bool)
    keep[order] = occurrence >= left[ranked]
    return indices[keep]


__all__ = [
    "Batch",
    "BatchStream",
    "CorpusMix",
    "StepGroup",
    "collate",
    "collate_sources",
    "filter_by_length",
    "cut_batches",
    "make_batches",
    "padding_fraction",
    "source_batch_tokens",
    "source_batches",
]

"""``mtcli train`` with token batches that are random samples of the corpus: for the loss curves of
``bench/gpu_loss_curve.sh`` (its mode ``random``), which tell what a batch's mix of lengths does to
learning, apart from packing and compiling.

``mtcli train`` cuts each epoch into slices of similar lengths (:func:`mtcli.data.batching.make_batches`),
so that little of a batch is padding. Packed batches (``train.pack_length``) are instead samples
of the whole corpus. Here the token batches are samples too: each epoch's pairs in a seeded random
order, cut into batches of ``train.max_tokens`` real slots (a pair counts ``max(source, target) + 1``,
as in a token batch), so a batch holds about as many pairs and real tokens as a length-sorted one,
and about half its padded tensor is padding. Everything else is ``mtcli train`` itself.

Usage (the arguments of ``mtcli train``):
    python bench/random_batches.py train CONFIG [--set KEY=VALUE ...]
"""

from __future__ import annotations

import numpy as np

import mtcli.data.batching as batching
from mtcli.cli import app


def random_batches(src_lengths: np.ndarray, tgt_lengths: np.ndarray, indices: np.ndarray, max_tokens: int, *,
                   seed: int = 1, epoch: int = 0, shuffle: bool = True, pool_batches: int = 100) -> list[np.ndarray]:
    """The pairs ``indices`` in a random order seeded by ``(seed, epoch)`` (their own order with
    ``shuffle=False``), cut into consecutive batches whose widths sum to ``max_tokens`` at most (a
    pair wider than that alone in its batch); ``pool_batches`` is
    :func:`~mtcli.data.batching.make_batches`'s and unused here."""
    del pool_batches
    indices = np.asarray(indices, dtype=np.int64)
    width = np.maximum(np.asarray(src_lengths)[indices], np.asarray(tgt_lengths)[indices]) + 1
    order = np.random.default_rng([int(seed), int(epoch)]).permutation(len(indices)) if shuffle else np.arange(len(indices))
    ends = np.cumsum(width[order])
    cuts = []
    start_total = 0
    for pos, total in enumerate(ends.tolist()):
        if pos and total - start_total > max_tokens:
            cuts.append(pos)
            start_total = int(ends[pos - 1])
    return [indices[part] for part in np.split(order, cuts) if len(part)]


if __name__ == "__main__":
    batching.make_batches = random_batches  # BatchStream looks it up at each epoch
    app()

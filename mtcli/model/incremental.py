"""Incremental decoding state: the encoder's output, the decoder's key/value cache, and the
buffers decoding reuses from one batch to the next.

Each decoder layer keeps its self-attention keys and values in a preallocated, time-major buffer
``[max_len, rows, h, d_k]``; the encoder's cross-attention keys and values are computed once per
sentence by :meth:`~mtcli.model.Transformer.init_cache` and shared by the ``beam_size`` rows of
that sentence (the beams are folded into the query axis of cross-attention, so the encoder side
is never copied per beam).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class EncoderOutput:
    """What the encoder hands to the decoder.

    ``memory [B, S, d_model]``; ``src_pad_mask [B, S]`` bool, True at padding; ``attn_mask`` the
    same as an additive ``[B, 1, 1, S]`` mask, or None when the batch has no padding.
    """

    memory: Tensor
    src_pad_mask: Tensor
    attn_mask: Tensor | None = None

    def select(self, index: Tensor) -> EncoderOutput:
        """Rows ``index`` (e.g. the sentences still being decoded)."""
        mask = self.attn_mask.index_select(0, index) if self.attn_mask is not None else None
        return EncoderOutput(
            self.memory.index_select(0, index), self.src_pad_mask.index_select(0, index), mask
        )

    def repeat_interleave(self, repeats: int) -> EncoderOutput:
        """Each row ``repeats`` times in a row (``[B, ...]`` -> ``[B*repeats, ...]``), for beams."""
        mask = self.attn_mask.repeat_interleave(repeats, 0) if self.attn_mask is not None else None
        return EncoderOutput(
            self.memory.repeat_interleave(repeats, 0),
            self.src_pad_mask.repeat_interleave(repeats, 0),
            mask,
        )


class Workspace:
    """Flat buffers that incremental decoding reuses from one call to the next.

    A fresh large tensor is fresh memory from the operating system, and its first touch costs a
    page fault per 4 KiB page: on a CPU, decoding a batch of 64 sentences with beam 5 spent
    ~10% of its time in the kernel faulting in new key/value caches and logits. A workspace
    keeps those buffers (key/value caches, logits, scratch) alive between batches instead, at
    the price of holding that memory (~100 MB for batch 64, beam 5 of the Multi30k model) until
    :meth:`clear` or until the workspace is dropped.

    ``get(key, shape, ...)`` returns a view of the buffer named ``key`` (grown when too small);
    a later ``get`` of the same key may overwrite or replace it, so one key serves one purpose.
    Not thread-safe: use one workspace per thread.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(
        self, key: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A tensor of ``shape`` (contents undefined) in the buffer named ``key``."""
        numel = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()


class DecoderCache:
    """Decoder state for incremental decoding (one new target position per call).

    Rows come in groups: row ``r`` belongs to sentence ``r // group`` (``group`` is the beam size).

    * ``self_k[l]``, ``self_v[l]``: layer ``l``'s self-attention keys/values, time-major
      ``[max_len, rows, h, d_k]``, filled up to ``length``: the first ``rows`` rows of a
      preallocated buffer ``[max_len, capacity, h, d_k]`` (a view, contiguous in each time step).
    * ``cross_k[l]``, ``cross_v[l]``: encoder keys/values ``[sentences, h, S, d_k]``, computed
      once (the first ``sentences`` of the batch's, contiguous).
    * ``cross_mask``: the source padding mask ``[sentences, 1, 1, S]`` or None.
    * ``output_t``: the pre-softmax weight transposed and contiguous ``[d_model, vocab]``, made
      once per cache by :meth:`Transformer.decode` (``hidden @ W^T`` is then one plain ``mm``,
      about 10% faster on a CPU than ``linear`` with the ``[vocab, d_model]`` weight).
    * ``output_product``: when set (by a search decoding over a shortlist of the output
      vocabulary), :meth:`Transformer.decode` returns ``output_product(hidden)`` as the logits.

    :meth:`reorder` selects rows (beam reordering, dropping finished sentences) and can change
    ``group`` (beam search runs its first step with one row per sentence). It works in place:
    only the rows ``i`` with ``index[i] != i`` are copied (their sources read before any row is
    written), at the filled times only, and the views shrink when rows are dropped. The search
    keeps that copy small: beam search leaves each surviving hypothesis's first extension in
    its parent's row, and finished sentences' places are taken by the last live ones. Only a
    reorder to more rows than the buffers hold (beam search's first step fanning each sentence
    out to its beams) copies everything, into new buffers. With a :class:`Workspace` the buffers
    (and the logits, see :meth:`Transformer.decode`) live in the workspace's ``"cache_a"``,
    ``"cache_b"`` and ``"logits"``, kept for the next cache made with it.
    """

    def __init__(
        self, self_k: list[Tensor], self_v: list[Tensor], cross_k: list[Tensor],
        cross_v: list[Tensor], cross_mask: Tensor | None, group: int,
        workspace: Workspace | None = None, storage_key: str = "cache_a",
    ) -> None:
        self.self_k, self.self_v = self_k, self_v
        self.cross_k, self.cross_v, self.cross_mask = cross_k, cross_v, cross_mask
        self.group = group
        self.length = 0
        self.output_t: Tensor | None = None
        self.output_product: Callable[[Tensor], Tensor] | None = None
        self.workspace = workspace
        self._buffers = self_k + self_v  # [max_len, capacity, h, d_k]: the views' storage
        self._cross = cross_k + cross_v  # [capacity sentences, h, S, d_k]
        self._keys = (storage_key, "cache_b" if storage_key == "cache_a" else "cache_a")

    @property
    def rows(self) -> int:
        """Number of decoder rows (sentences x group)."""
        return self.self_k[0].size(1)

    @property
    def max_len(self) -> int:
        """Most positions this cache can hold."""
        return self.self_k[0].size(0)

    def reorder(self, index: Tensor, group: int | None = None) -> None:
        """Keep rows ``index`` (LongTensor, new row ``i`` = old row ``index[i]``).

        ``index`` must keep rows grouped: each run of ``group`` new rows (``group`` defaults to
        the current one; a new value, e.g. the beam size after a first step of one row per
        sentence, replaces it) comes from one old sentence, in any order of sentences. The
        encoder side then follows the sentences (copying only those that change places).
        """
        n_new, old_group = index.numel(), self.group
        group = old_group if group is None else group
        if group < 1 or n_new % group:
            raise ValueError(f"reorder: {n_new} rows is not a multiple of group={group}")
        self.group = group
        sentences = index.view(-1, group)[:, 0] // old_group
        n_sentences = sentences.numel()
        with torch.no_grad():  # the cache serves inference; no gradient flows through a reorder
            if n_new > self._buffers[0].size(1):
                self._grow(index)
            else:
                _move_rows(self._buffers, index, self.length)
            moved = _move_rows(self._cross, sentences)
        half = len(self._buffers) // 2
        views = [b[:, :n_new] for b in self._buffers]
        self.self_k, self.self_v = views[:half], views[half:]
        if moved or n_sentences != self.cross_k[0].size(0):
            self.cross_k = [c[:n_sentences] for c in self._cross[:half]]
            self.cross_v = [c[:n_sentences] for c in self._cross[half:]]
            if self.cross_mask is not None:  # small, and shared with the encoder output: copied
                self.cross_mask = self.cross_mask.index_select(0, sentences)

    def _grow(self, index: Tensor) -> None:
        """Rows ``index`` of the filled times into new buffers of ``index.numel()`` rows."""
        old = self._buffers[0]
        shape = (old.size(0), index.numel()) + tuple(old.shape[2:])
        if self.workspace is None:
            new = [old.new_empty(shape) for _ in self._buffers]
        else:
            flat = self.workspace.get(self._keys[1], (len(self._buffers), math.prod(shape)),
                                      old.dtype, old.device)
            new = [t.view(shape) for t in flat.unbind(0)]
            self._keys = self._keys[::-1]
        rows = _time_rows(index, old.size(1), self.length)
        for src, dst in zip(self._buffers, new, strict=True):
            torch.index_select(_flat(src), 0, rows, out=_flat(dst)[: rows.numel()])
        self._buffers = new


def _flat(buffer: Tensor) -> Tensor:
    """A contiguous time-major buffer ``[max_len, width, h, d_k]`` as ``[max_len * width, h * d_k]``."""
    return buffer.view(-1, buffer.size(2) * buffer.size(3))


def _time_rows(rows: Tensor, width: int, times: int) -> Tensor:
    """Indices of ``rows`` at every time ``0..times-1`` into the ``[max_len * width, h * d_k]``
    view of a time-major buffer ``width`` rows wide (one 1-D gather of whole rows runs faster
    than indexing the second axis of the 4-D buffer)."""
    steps = torch.arange(times, device=rows.device) * width
    return (steps[:, None] + rows[None, :]).view(-1)


def _move_rows(buffers: list[Tensor], index: Tensor, times: int | None = None) -> bool:
    """In place, row ``i`` of every buffer becomes old row ``index[i]``, for the ``i`` where they
    differ (every source is read before any row is written); the buffers keep their size.
    Returns whether any row moved.

    With ``times``, the buffers are time-major ``[max_len, capacity, h, d_k]`` and only times
    ``0..times-1`` are moved; otherwise the rows are the buffers' first axis."""
    moved = index.ne(torch.arange(index.numel(), device=index.device)).nonzero()[:, 0]
    if moved.numel() == 0:
        return False
    sources, targets = index[moved], moved
    if times == 0:
        return True
    if times is not None:
        width = buffers[0].size(1)
        sources, targets = _time_rows(sources, width, times), _time_rows(targets, width, times)
    for buffer in buffers:
        rows = buffer if times is None else _flat(buffer)
        rows.index_copy_(0, targets, rows.index_select(0, sources))
    return True

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

    * ``self_k[l]``, ``self_v[l]``: layer ``l``'s self-attention keys/values, preallocated
      time-major ``[max_len, rows, h, d_k]``, filled up to ``length``.
    * ``cross_k[l]``, ``cross_v[l]``: encoder keys/values ``[sentences, h, S, d_k]``, computed once.
    * ``cross_mask``: the source padding mask ``[sentences, 1, 1, S]`` or None.
    * ``output_t``: the pre-softmax weight transposed and contiguous ``[d_model, vocab]``, made
      once per cache by :meth:`Transformer.decode` (``hidden @ W^T`` is then one plain ``mm``,
      about 10% faster on a CPU than ``linear`` with the ``[vocab, d_model]`` weight).
    * ``output_product``: when set (by a search decoding over a shortlist of the output
      vocabulary), :meth:`Transformer.decode` returns ``output_product(hidden)`` as the logits.

    :meth:`reorder` selects rows (beam reordering, dropping finished sentences) and can change
    ``group`` (beam search runs its first step with one row per sentence). Time-major
    buffers make the filled part ``[:length]`` contiguous, so a reorder copies exactly that part,
    into a second preallocated set of buffers that then swaps with the first (ping-pong): after
    the first reorder, decoding allocates nothing. A reorder that keeps the number of rows and
    leaves at least half of them where they are (``index[i] == i``, as beam search arranges by
    giving each surviving hypothesis's first extension its parent's row) copies only the rows
    that change, in place. With a :class:`Workspace` both sets (and the
    logits, see :meth:`Transformer.decode`) live in the workspace's buffers ``"cache_a"``,
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
        self._spare: list[Tensor] = []  # flat storage for the next reorder
        self._storage = [t.view(-1) for t in self_k + self_v]  # flat storage of the current state
        self._keys = (storage_key, "cache_b" if storage_key == "cache_a" else "cache_a")

    def _allocate(self, count: int, size: int, like: Tensor) -> list[Tensor]:
        """``count`` flat buffers of ``size`` elements for the next reorder."""
        if self.workspace is None:
            return [like.new_empty(size) for _ in range(count)]
        flat = self.workspace.get(self._keys[1], (count, size), like.dtype, like.device)
        return list(flat.unbind(0))

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
        sentence, replaces it) comes from one old sentence, sentences in increasing order (what
        beam search and dropping finished sentences produce). The encoder side is then selected
        per sentence, and left untouched when no sentence was dropped.
        """
        n_new, old_group = index.numel(), self.group
        group = old_group if group is None else group
        if group < 1 or n_new % group:
            raise ValueError(f"reorder: {n_new} rows is not a multiple of group={group}")
        self.group = group
        if n_new == self.rows and group == old_group and self._reorder_in_place(index):
            return
        if n_new // group != self.cross_k[0].size(0):
            sentences = index.view(-1, group)[:, 0] // old_group
            self.cross_k = [t.index_select(0, sentences) for t in self.cross_k]
            self.cross_v = [t.index_select(0, sentences) for t in self.cross_v]
            if self.cross_mask is not None:
                self.cross_mask = self.cross_mask.index_select(0, sentences)
        old = self.self_k + self.self_v
        shape = (old[0].size(0), n_new) + tuple(old[0].shape[2:])
        size = math.prod(shape)
        if not self._spare or self._spare[0].numel() < size:
            self._spare = self._allocate(len(old), size, old[0])
        new = [flat[:size].view(shape) for flat in self._spare]
        flat_index = self._time_rows(index, old[0].size(1))
        with torch.no_grad():  # the cache serves inference; no gradient flows through a reorder
            for src, dst in zip(old, new, strict=True):
                torch.index_select(self._rows(src), 0, flat_index, out=self._rows(dst)[: flat_index.numel()])
        self._spare, self._storage = self._storage, self._spare
        self._keys = self._keys[::-1]
        half = len(new) // 2
        self.self_k, self.self_v = new[:half], new[half:]

    def _time_rows(self, rows: Tensor, width: int) -> Tensor:
        """Indices into a ``[max_len * width, h * d_k]`` view of a buffer of ``width`` rows:
        ``rows`` at every filled time ``0..length-1`` (one 1-D index: a gather of whole
        ``h * d_k`` rows runs faster than indexing the second axis of the 4-D buffer)."""
        times = torch.arange(self.length, device=rows.device) * width
        return (times[:, None] + rows[None, :]).view(-1)

    @staticmethod
    def _rows(buffer: Tensor) -> Tensor:
        """A time-major buffer ``[max_len, rows, h, d_k]`` as ``[max_len * rows, h * d_k]``."""
        return buffer.view(-1, buffer.size(2) * buffer.size(3))

    def _reorder_in_place(self, index: Tensor) -> bool:
        """Copy only the rows ``i`` with ``index[i] != i``, in place (their sources are read
        before any row is written); False, doing nothing, when more than half of them move."""
        moved = index.ne(torch.arange(index.numel(), device=index.device)).nonzero()[:, 0]
        if 2 * moved.numel() > index.numel():
            return False
        if moved.numel() == 0 or self.length == 0:
            return True
        sources = self._time_rows(index[moved], index.numel())
        targets = self._time_rows(moved, index.numel())
        with torch.no_grad():
            for buffer in self.self_k + self.self_v:
                rows = self._rows(buffer)
                rows.index_copy_(0, targets, rows.index_select(0, sources))
        return True

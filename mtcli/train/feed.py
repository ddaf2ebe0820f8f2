"""The trainer's batches, one step ahead: drawn from the :class:`~mtcli.data.batching.BatchStream`,
collated and sent to the device while the device still runs the step before.

The host waits for each step's loss; collating the next batches only after that wait would leave
a GPU idle for as long as collating takes (a few milliseconds a packed batch). Collating reads no
random state, and :attr:`BatchFeed.position` is the position before the batches prefetched, which
is what a checkpoint saves: training and resume are the same as without prefetching.
"""

from __future__ import annotations

from typing import Any

import torch

from mtcli.data.batching import Batch, BatchStream, StepGroup
from mtcli.data.packing import PackedBatch


class BatchFeed:
    """This rank's batches of each step, collated and on their way to ``device``; token
    batches padded to a multiple of ``pad_multiple`` (0: not padded; a compiled step's)."""

    def __init__(self, stream: BatchStream, device: torch.device, pad_multiple: int = 0) -> None:
        self.stream = stream
        self.device = device
        self.pad_multiple = pad_multiple
        # the next step's batches: (the stream's position before them, their group, the batches)
        self._ahead: tuple[dict[str, Any], StepGroup, list[Batch | PackedBatch]] | None = None

    @property
    def position(self) -> dict[str, Any]:
        """The stream's position of the next step to train (:meth:`BatchStream.state_dict`): the
        position before the batches already prefetched, which no step has trained yet."""
        return self._ahead[0] if self._ahead is not None else self.stream.state_dict()

    def next(self) -> tuple[StepGroup, list[Batch | PackedBatch]]:
        """The next step's group and batches: those prefetched, else drawn and collated now."""
        if self._ahead is not None:
            _, group, batches = self._ahead
            self._ahead = None
            return group, batches
        group = self.stream.next_group()
        return group, self.collate(group)

    def prefetch(self) -> None:
        """Draw and collate the next step's batches now (the device runs this step meanwhile)."""
        position = self.stream.state_dict()
        group = self.stream.next_group()
        self._ahead = (position, group, self.collate(group))

    def collate(self, group: StepGroup) -> list[Batch | PackedBatch]:
        """This rank's batches of ``group``, collated and sent to the device (without waiting)."""
        batches = []
        for indices in group.mine():
            batch = self.stream.collate(indices)
            if self.pad_multiple and isinstance(batch, Batch):  # one compiled graph for every length
                batch = batch.padded(self.pad_multiple)
            batches.append(batch.to(self.device))
        return batches

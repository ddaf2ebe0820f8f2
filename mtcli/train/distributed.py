"""Distributed data parallel training under ``torchrun``: this process's rank and the few
collectives the trainer needs.

Under ``torchrun --nproc_per_node=N`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the model is
wrapped in DistributedDataParallel (NCCL on CUDA, gloo on CPU). Every rank runs the same loop;
only rank 0 writes files and validates, and the stop decisions are agreed on with these
collectives so that every rank stops at the same step. In one process they are the identity.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from mtcli.errors import TrainingError, one_line
from mtcli.train.rng import get_rng_state


@dataclass
class DistInfo:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False
    local_world_size: int = 1  # the processes on this machine

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs to TensorBoard and validates."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistInfo:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (as set by torchrun)."""
        try:
            return cls(
                rank=int(os.environ.get("RANK", "0")),
                world_size=int(os.environ.get("WORLD_SIZE", "1")),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            )
        except ValueError:
            raise TrainingError("RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE must be integers") from None


#: How long a rank waits in a collective: the others wait while rank 0 validates (decoding the
#: whole validation split), which NCCL's default of 10 minutes does not always cover (gloo's
#: default, and Hugging Face's for both).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def init_distributed(info: DistInfo, device: torch.device) -> None:
    """Make a CUDA ``device`` the current one (streams, events and new tensors default to it:
    ``train.device: cuda:1`` in one process too), and join the process group of a multi-process
    run (a no-op in one process or if joined)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not info.distributed or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, timeout=COLLECTIVE_TIMEOUT)
    info.initialized_here = True


def leave_distributed(info: DistInfo) -> None:
    """Leave the process group this process joined, while the interpreter is still whole.

    Gloo's worker threads can hold tensors whose release needs the GIL: a group (or a
    DistributedDataParallel reducer that keeps it alive) left to interpreter shutdown can abort
    the process after a successful run. So drop the reducer first (the caller clears its
    reference), collect the cycles that still hold it, and destroy the group here.
    """
    if not (info.distributed and info.initialized_here and dist.is_initialized()):
        return
    gc.collect()
    dist.destroy_process_group()


def sum_gradients(process_group: Any, bucket):  # type: ignore[no-untyped-def]
    """DistributedDataParallel's communication hook: the ranks' gradients summed, not averaged.

    Each rank backpropagates its losses over the whole step's target-token count, as one process
    accumulating every batch of the step would, so the sum is that process's gradient, without
    the rescaling by the process count that averaging needs (exact in fp32 and bf16 only for a
    count that is a power of two, and never under fp16's loss scaling, whose underflow and
    overflow depend on the magnitude). Registered with ``ddp.register_comm_hook(None, ...)``;
    like DDP's own reduction, it overlaps the backward pass bucket by bucket. (``bucket`` is a
    ``dist.GradBucket`` and the result a ``Future[Tensor]``; unannotated, since DDP refuses a
    hook whose annotations are strings, as this module's are.)"""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


def all_sum_queued(values: Tensor, info: DistInfo) -> Tensor:
    """Element-wise sum over ranks of a tensor on the device, queued there like DDP's own
    gradient reductions: the host does not wait for it (``values`` itself in one process)."""
    if info.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Element-wise sum over ranks, read back on the host (identity in one process)."""
    if not info.distributed:
        return values
    return all_sum_queued(torch.tensor(values, dtype=torch.float64, device=device), info).tolist()


def gather_rng_states(info: DistInfo, device: torch.device) -> list[dict[str, Any]]:
    """Every rank's :func:`get_rng_state`, in rank order, on every rank (one entry in one process)."""
    mine = get_rng_state(device)
    if not info.distributed:
        return [mine]
    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states


def broadcast(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Rank 0's values on every rank (the other ranks wait here while rank 0 validates)."""
    if not info.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def agree_on_resume(step: int | None, info: DistInfo) -> None:
    """Stop every rank unless all of them found the same checkpoint to resume from (``step``,
    None for none): a run directory that only one machine sees would start the others afresh."""
    if not info.distributed:
        return
    steps: list[Any] = [None] * info.world_size
    dist.all_gather_object(steps, step)
    if len(set(steps)) > 1:
        found = ", ".join(f"rank {rank}: {'none' if s is None else f'step {s}'}" for rank, s in enumerate(steps))
        raise TrainingError(
            f"the processes found different checkpoints to resume from ({found}); every process must see "
            "the same run directory (on several machines, a shared file system)")


def agree_on_data(cache: tuple[str, str], info: DistInfo) -> None:
    """Stop every rank unless all of them opened the same prepared cache (``cache``: its build
    key, and the sha256 of its SentencePiece model): on machines of their own, with caches of
    their own, ranks would otherwise train one model on different data and piece ids."""
    if not info.distributed:
        return
    caches: list[Any] = [None] * info.world_size
    dist.all_gather_object(caches, cache)
    if len(set(caches)) > 1:
        differ = ", ".join(f"rank {rank}" for rank, found in enumerate(caches) if found != caches[0])
        raise TrainingError(
            f"{differ}: another prepared cache than rank 0's (other inputs, settings or SentencePiece model); every "
            "process must read the same cache: prepare it once on a shared file system, or from the same files "
            "on each machine")


# what gloo says when the process at the other end of a collective has gone
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


class PeerStopped(TrainingError):
    """A collective failed because another rank stopped (or the connection to it failed)."""


@contextlib.contextmanager
def peer_failures(info: DistInfo) -> Iterator[None]:
    """Turn a collective that failed because another rank stopped (its own error said there)
    into one line, instead of the communication library's traceback."""
    try:
        yield
    except RuntimeError as exc:
        if info.distributed and (isinstance(exc, dist.DistError) or any(text in str(exc) for text in _PEER_GONE)):
            raise PeerStopped(
                f"rank {info.rank}: a collective failed: another process of this run stopped (its own error, on "
                f"its console, and in train.log once the run has one, says why) or the connection to it failed "
                f"({one_line(exc)[:200]})") from None
        raise

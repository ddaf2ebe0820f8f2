"""Where training and decoding run: the device, and whether it multiplies bf16 natively.

``train.precision: auto`` asks :func:`device_has_bf16_units`: autocast pays only where the matrix
units take bf16 (a GPU from Ampere on; a CPU with AVX512-BF16, AMX or Arm BF16), and costs
~100x on a CPU without them.
"""

from __future__ import annotations

import contextlib
import platform
import resource
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mtcli.allocator import available_host_bytes
from mtcli.errors import ConfigError, DeviceMemoryError, failed_to_allocate
from mtcli.logs import get_logger

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def resolve_device(name: str, local_rank: int = 0, key: str = "train.device",
                   local_processes: int = 1) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else the CPU; ``cuda`` ->
    ``cuda:<local_rank>``; else ``cpu`` or ``cuda:N``. Raises :class:`ConfigError` naming ``key``
    for anything else, a GPU this machine does not have, or ``cuda:N`` for each of
    ``local_processes`` processes on this machine when each of them sees several GPUs (they
    would all train on GPU N)."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank > 0 and local_rank >= count:  # torchrun --nproc-per-node above the GPUs
            raise ConfigError(f"{key}={name!r}: process {local_rank} of this machine has no GPU of its own ({count} "
                              f"visible): start at most {count} processes a machine (torchrun --nproc-per-node), "
                              "or, where each process sees only its own GPU (SLURM's --gpus-per-task), set "
                              f"{key}=cuda:0")
        return torch.device(f"cuda:{local_rank}")
    if name == "auto":
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key}={name!r}: not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}={name!r} but CUDA is not available (use auto or cpu)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"{key}={name!r} but this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")
        if local_processes > 1 and count > 1:  # NCCL stops at a GPU two processes share
            raise ConfigError(f"{key}={name!r} puts every process of this machine on one of its {count} visible GPUs: "
                              f"set {key}=auto (process N trains on cuda:N)")
    elif device.type != "cpu":
        raise ConfigError(f"{key}={name!r}: mtcli runs on cpu or cuda")
    return device


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset[str]]:
    """The first CPU's model name (``""`` if unknown) and feature flags (x86 ``flags``, Arm
    ``Features``) from ``/proc/cpuinfo``; empty where there is none."""
    name, flags = "", frozenset[str]()
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name, flags


def cpu_name() -> str:
    """This CPU's model name, from ``/proc/cpuinfo`` where it has one, else what Python knows."""
    return cpu_info()[0] or platform.processor() or platform.machine()


def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX, Arm BF16); False if unknown.

    Without them PyTorch's bf16 matmuls take a slow path: ~100x slower than fp32 on an AVX2
    Zen 3 CPU, ~2x *faster* than fp32 on an AVX512-BF16 Zen 4 one (docs/performance.md).
    """
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & cpu_info(cpuinfo)[1])


def device_has_bf16_units(device: torch.device) -> bool:
    """Whether bf16 pays on ``device``: a GPU whose tensor cores take bf16 (compute capability
    8.0 on, Ampere; or ROCm), or a CPU with bf16 units. Not a V100 or a T4, where PyTorch only
    emulates bf16 (``torch.cuda.is_bf16_supported()`` says True there, counting emulation)."""
    if device.type == "cuda":
        return bool(torch.version.hip) or torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and cpu_has_bf16_units()


def autocast(device: torch.device, enabled: bool | str) -> contextlib.AbstractContextManager:
    """Autocast on ``device``: bf16 when ``enabled`` is True or ``"bf16"`` (``decode.bf16``,
    ``train.precision``), fp16 for ``"fp16"``, else nothing (``False``, ``"fp32"``)."""
    dtype = {True: torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}.get(enabled)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``. To a GPU it goes through pinned (page-locked) host memory: a copy
    from ordinary memory first waits for every kernel already queued on the GPU, so each batch
    would drain the queue and leave the GPU idle while the host launches the next step; from
    pinned memory the copy is queued behind them and the host goes on."""
    if torch.device(device).type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` is an allocation failure: PyTorch's ``OutOfMemoryError``, a
    ``MemoryError`` (a C++ library's ``std::bad_alloc``, as pybind11 gives it), or a
    ``RuntimeError`` that reads as one (:func:`mtcli.errors.failed_to_allocate`), also when wrapped
    (``torch.compile`` wraps what fails while it compiles)."""
    for _ in range(8):  # a chain of wrappers, never a cycle
        if exc is None:
            return False
        if isinstance(exc, torch.OutOfMemoryError) or failed_to_allocate(exc):
            return True
        exc = exc.__cause__ or getattr(exc, "inner_exception", None)
    return False


def in_halves_when_out_of_memory(run: Callable[[list[_Item]], list[_Result]], items: list[_Item],
                                 failed: Callable[[list[_Item]], str], alone: str,
                                 halving: Callable[[list[_Item], str], None]) -> list[_Result]:
    """``run(items)`` (one result an item); when the device runs out of memory, ``halving(items,
    failed(items))`` (to warn), then each half in turn, the same way. One item that does not fit
    alone raises :class:`DeviceMemoryError` ``"{failed(items)}: {alone}"``. The failed run's
    tensors go with its exception, so the halves have its memory."""
    try:
        return run(items)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        where = failed(items)
        if len(items) == 1:
            raise DeviceMemoryError(f"{where}: {alone}") from None
    halving(items, where)
    half = len(items) // 2
    return (in_halves_when_out_of_memory(run, items[:half], failed, alone, halving)
            + in_halves_when_out_of_memory(run, items[half:], failed, alone, halving))


def peak_memory_mb(device: torch.device) -> float:
    """The most memory this process has held for its work on ``device``, in MiB: PyTorch's
    allocations on a GPU (since the last ``torch.cuda.reset_peak_memory_stats``), the process's
    peak resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)  # bytes on macOS, KiB on Linux


def available_bytes(device: torch.device) -> int | None:
    """The memory new allocations on ``device`` can have now: a GPU's free memory (what other
    processes hold left out), the host's ``MemAvailable`` for a CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_bytes() if device.type == "cpu" else None


def memory_text(device: torch.device) -> str:
    """``device`` with its memory, for a message: ``cuda:0 (79.1 GiB)``; a CPU's name alone."""
    if device.type != "cuda":
        return str(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return f"{device} ({total / 2**30:.1f} GiB)"


class MemoryBudget:
    """The most a batch may cost (in the caller's tokens) on a device that has run out of memory,
    kept for every batch of a job, or of a long-lived ``Translator`` (``mtcli serve``).

    Unlimited until a batch does not fit; then half that batch's cost. A device shared with other
    processes (a server beside a training) may have been short only for a while, so once
    ``patience`` (:attr:`PATIENCE`) batches in a row have fitted while costing more than half the
    budget, it doubles: a probe. A probe that fails puts the budget back where it fitted and
    doubles the wait for the next one, so a device that stays short costs a failed batch each
    time the work done doubles, not one every ``patience`` batches; a probe that fits resets the
    wait.
    """

    PATIENCE = 64

    def __init__(self, patience: int | None = None) -> None:
        self.tokens = sys.maxsize
        self._patience = self._wait = patience or self.PATIENCE
        self._fitted = 0
        self._fits_at: int | None = None  # the budget before a probe, while one is in the air

    def lower(self, cost: int) -> None:
        """A batch that cost ``cost`` did not fit."""
        if self._fits_at is not None and cost > self._fits_at:  # the probe failed
            self.tokens, self._wait = self._fits_at, 2 * self._wait
        else:
            self.tokens = max(1, min(self.tokens, cost // 2))
        self._fits_at, self._fitted = None, 0

    def fitted(self, cost: int) -> None:
        """A batch that cost ``cost`` fitted."""
        if self.tokens == sys.maxsize or 2 * cost <= self.tokens:
            return  # no limit yet, or a batch too small to say anything about the budget
        if self._fits_at is not None and cost > self._fits_at:  # the probe fitted
            self._fits_at, self._wait = None, self._patience
        self._fitted += 1
        if self._fitted >= self._wait:
            self._fits_at, self._fitted = self.tokens, 0
            self.tokens = min(sys.maxsize, 2 * self.tokens)
            get_logger().info("%d batches in a row fitted: trying batches of up to %d tokens again",
                              self._wait, self.tokens)


def in_budget_halves(run: Callable[[list[_Item]], list[_Result]], items: list[_Item], budget: MemoryBudget,
                     cost: Callable[[list[_Item]], int], cut: Callable[[list[_Item], int], list[list[int]]],
                     failed: Callable[[list[_Item]], str], alone: str,
                     halving: Callable[[list[_Item], str], None]) -> list[_Result]:
    """:func:`in_halves_when_out_of_memory` under ``budget``: a batch that does not fit lowers it
    (and ``halving(items, where)`` warns), one that fits tells it so, and a batch that costs more
    than ``budget.tokens``, cut before the budget dropped (a failed batch's other half, the rest
    of a window), is cut to it (``cut(items, budget.tokens)``: groups of indices into ``items``)
    before it is tried, so once a batch has fitted no other fails."""
    def lowering(part: list[_Item], where: str) -> None:
        budget.lower(cost(part))
        halving(part, where)

    def fitting(part: list[_Item]) -> list[_Result]:
        spent = cost(part)
        if len(part) == 1 or spent <= budget.tokens:
            results = run(part)
            budget.fitted(spent)
            return results
        found: list[Any] = [None] * len(part)
        for group in cut(part, budget.tokens):
            for i, result in zip(group, in_fitting_halves([part[i] for i in group]), strict=True):
                found[i] = result
        return found

    def in_fitting_halves(part: list[_Item]) -> list[_Result]:
        return in_halves_when_out_of_memory(fitting, part, failed, alone, lowering)

    return in_fitting_halves(items)


__all__ = ["autocast", "cpu_has_bf16_units", "cpu_info", "cpu_name", "device_has_bf16_units", "is_out_of_memory",
           "memory_text", "peak_memory_mb", "resolve_device", "to_device", "in_budget_halves",
           "in_halves_when_out_of_memory", "MemoryBudget"]

"""Keep freed memory in the process: glibc ``malloc`` settings for CPU training and decoding
(and :func:`bound_onednn_cache`, a bound on oneDNN's kernel cache for the decoding commands).

PyTorch's CPU tensors come from ``malloc``. glibc serves every block above its mmap threshold
(at most 32 MiB, often far less) with a fresh ``mmap`` and gives it back with ``munmap`` when
the tensor dies, and it trims the top of the heap back to the kernel when more than 128 KiB
there is free. A training step allocates and frees the same large activations every step
(the ``[tokens, vocab]`` logits and their gradient are ~20-40 MiB at Multi30k's shapes), so
each step pays the kernel to zero and map those pages again: one page fault per 4 KiB. On a
2-core CPU an element-wise pass over 10M floats took 16 ms in fresh memory and 2-4 ms in reused
memory; what it saves a whole training step depends on how many large temporaries the step
makes (docs/performance.md has the measurements).

:func:`keep_freed_memory` sets ``M_MMAP_MAX = 0`` (no block is served by its own mapping, so
every block comes from the heap and is reused) and a 1 GiB ``M_TRIM_THRESHOLD`` (free memory
stays in the process). The cost: resident memory no longer shrinks after a peak, which for a
process that trains or decodes until it exits is the same peak it had already reached.

It changes nothing where it cannot apply or should not: not glibc (macOS, musl), another
allocator preloaded (jemalloc, tcmalloc), or the user's own ``MALLOC_*`` settings in the
environment, which glibc has already read. ``MTCLI_KEEP_FREED_MEMORY=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 1 << 30
_done: bool | None = None


def _glibc() -> bool:
    """Whether this process runs on Linux's glibc, whose malloc these settings are for."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _libc() -> ctypes.CDLL:
    """The C library this process runs on."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _skip_reason() -> str | None:
    if os.environ.get("MTCLI_KEEP_FREED_MEMORY", "1") == "0":
        return "MTCLI_KEEP_FREED_MEMORY=0"
    if not _glibc():
        return "not glibc"
    if "malloc" in os.environ.get("LD_PRELOAD", ""):
        return "another allocator is preloaded"
    if any(name.startswith("MALLOC_") or name.startswith("GLIBC_TUNABLES") for name in os.environ):
        return "MALLOC_* or GLIBC_TUNABLES set by the user"
    return None


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the kernel now (glibc's ``malloc_trim``); True if
    done. For the moment a transient peak has passed that the process will not reach again:
    loading a checkpoint reads its whole payload, optimizer moments included, several times the
    model's size, which :func:`keep_freed_memory` would otherwise keep resident for the whole
    decoding after it."""
    if not _glibc():
        return False
    try:
        return bool(_libc().malloc_trim(0))
    except (OSError, AttributeError):
        return False


def keep_freed_memory() -> bool:
    """Make glibc reuse freed blocks instead of returning them to the kernel; True if applied.

    Process-wide and idempotent: the first call decides, later calls return the same answer.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if _skip_reason() is None:
        try:
            libc = _libc()
            _done = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
        except (OSError, AttributeError):
            _done = False
    return _done


#: oneDNN primitive-cache entries a decoding command allows (oneDNN's own default is 1,024).
ONEDNN_CACHE_CAPACITY = 256
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> bool:
    """Cap oneDNN's primitive cache at ``capacity`` entries for this process; True if set here.

    oneDNN keeps every kernel it has built, keyed by the product's shapes, up to 1,024 of them.
    Decoding multiplies by each weight a number of rows that changes from step to step (beams
    times the sentences still live), so a long decoding process, a server above all, fills the
    whole cache; in bf16 each kernel holds enough memory that the full cache costs several
    hundred MB more (docs/performance.md), and a cap of 256 costs no measurable speed. (The
    packed products round their rows to a few counts, :func:`mtcli.infer.packed.padded_rows`,
    which bounds how many kernels a process builds at all.) oneDNN reads the setting once,
    when it builds its first kernel, so the commands call this before they load a model; the
    user's own ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (or ``DNNL_...``) wins.
    """
    if any(name in os.environ for name in _ONEDNN_CACHE_VARS):
        return False
    os.environ[_ONEDNN_CACHE_VARS[0]] = str(capacity)
    return True


__all__ = ["ONEDNN_CACHE_CAPACITY", "bound_onednn_cache", "keep_freed_memory", "release_freed_memory"]


def available_host_bytes() -> int | None:
    """The memory the kernel says new allocations can have (``MemAvailable``), or None where it
    does not say (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None

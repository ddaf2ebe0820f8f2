"""Compiling and loading mtcli's C files (:mod:`mtcli.model.kernels`, :mod:`mtcli.data.scan`).

A C file is compiled on first use with the system's C compiler (``cc``, or ``$CC``) for this CPU
(``-march=native`` where the compiler takes it) into ``$XDG_CACHE_HOME/mtcli/kernels``
(``~/.cache/mtcli/kernels``), named by a hash of the source, the compiler, the flags and the
CPU's feature flags, so a cache shared by machines of different CPUs holds one library per CPU.
The library is written under a temporary name and renamed, so a concurrent process never loads
half a file. :func:`load` gives None instead, with one warning, when there is no compiler or
compiling fails, or when ``MTCLI_KERNELS=0``; callers then take their Python path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtcli.logs import get_logger

# Every file is compiled with these; ``-fno-math-errno`` lets the compiler vectorize math calls.
BASE_FLAGS = ["-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math"]


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), or '' where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cache_dir() -> Path:
    """Where compiled libraries are kept: ``$XDG_CACHE_HOME/mtcli/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mtcli" / "kernels"


def compiler() -> str:
    """The C compiler: ``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH (OSError if none)."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if found is None:
        raise OSError("no C compiler found (cc, gcc or clang; or set CC)")
    return found


def _compile(cc: str, flags: list[str], source: Path, target: Path) -> None:
    """Compile ``source`` into the shared library ``target`` (under a temporary name, then renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cc, *flags, "-shared", "-fPIC", str(source), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise OSError(f"{' '.join(cmd)}: {last}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return set()
    return {p for p in paths if re.match(r"lib(g|i|)omp[0-9]*[.-]", os.path.basename(p))}


def build(source: Path, signatures: dict[str, tuple[Any, list[Any]]],
          openmp: bool = False) -> tuple[ctypes.CDLL, bool]:
    """The library compiled from ``source`` for this CPU (compiling it first if needed), its
    functions typed by ``signatures`` (``name: (return type or None, argument types)``), and
    whether its OpenMP loops may run on several threads.

    The flags tried in turn: OpenMP (when ``openmp``) and this CPU's instructions, then without
    OpenMP, then for any CPU of this architecture. OpenMP loops share the threads of the OpenMP
    runtime already loaded (torch's ``libgomp``) when loading the library maps no new runtime;
    were it to bring its own, that runtime's threads would compete, so the loops are then meant
    to run on one thread (the second value is False). Raises OSError when nothing compiles.
    """
    cc = compiler()
    cpu = cpu_flags()
    native = ["-march=native"] if cpu else []
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    before = _openmp_runtimes()
    error: OSError | None = None
    choices = ([BASE_FLAGS + native + ["-fopenmp"]] if openmp else []) + [BASE_FLAGS + native, BASE_FLAGS]
    for flags in choices:
        key = hashlib.sha256("\0".join(
            [source.read_text(encoding="utf-8"), cc, version, " ".join(flags), platform.machine(), cpu]
        ).encode()).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        try:
            if not target.is_file():
                _compile(cc, flags, target=target, source=source)
        except OSError as e:
            error = error or e
            continue
        lib = ctypes.CDLL(str(target))
        for name, (restype, argtypes) in signatures.items():
            getattr(lib, name).restype, getattr(lib, name).argtypes = restype, argtypes
        return lib, "-fopenmp" in flags and not _openmp_runtimes() - before
    assert error is not None
    raise error


def load(source: Path, signatures: dict[str, tuple[Any, list[Any]]], openmp: bool, what: str,
         instead: str) -> tuple[ctypes.CDLL, bool] | None:
    """:func:`build`, or None when ``MTCLI_KERNELS=0`` or when it cannot be built, which is
    logged as ``<what> unavailable (<why>); <instead>`` (callers load once per process)."""
    if os.environ.get("MTCLI_KERNELS", "1") == "0":
        return None
    try:
        return build(source, signatures, openmp)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        get_logger().warning("%s unavailable (%s); %s", what, e, instead)
        return None


def library(source: Path, signatures: dict[str, tuple[Any, list[Any]]], what: str,
            instead: str) -> Callable[[], ctypes.CDLL | None]:
    """A loader of ``source``'s library without OpenMP, run once per process (its
    ``cache_clear`` forgets the result): the library, or None as :func:`load` says."""

    @functools.cache
    def loaded() -> ctypes.CDLL | None:
        result = load(source, signatures, False, what, instead)
        return None if result is None else result[0]

    return loaded

"""keep_freed_memory: glibc keeps freed blocks in the process (checked in fresh processes)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from mtcli.infer.packed import packing_supported

# Allocate and free a 64 MiB block, then report whether it was applied and how much of the
# block's memory the process still holds (resident pages, from /proc/self/statm).
PROBE = """
import ctypes, os, sys
from mtcli.allocator import keep_freed_memory
applied = keep_freed_memory()
assert keep_freed_memory() == applied  # idempotent
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
size = 64 << 20
before = rss()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print(int(applied), (rss() - before) / size)
"""

glibc_linux = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc on Linux only")


def _probe(**env: str) -> tuple[bool, float]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "MTCLI_KEEP_FREED_MEMORY"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True,
                         text=True, check=True).stdout.split()
    return bool(int(out[0])), float(out[1])


@glibc_linux
def test_freed_memory_stays_in_the_process() -> None:
    applied, kept = _probe()
    assert applied
    assert kept > 0.9  # the freed 64 MiB block is still resident, ready for the next step


@glibc_linux
def test_default_glibc_returns_it_and_the_switch_turns_it_off() -> None:
    applied, kept = _probe(MTCLI_KEEP_FREED_MEMORY="0")
    assert not applied
    assert kept < 0.1  # glibc's default: a block this large was mapped and unmapped


@glibc_linux
def test_user_malloc_settings_win() -> None:
    applied, _ = _probe(MALLOC_ARENA_MAX="2")
    assert not applied


# Products of 1, 2, 3 and again 1 row by one packed weight; ONEDNN_VERBOSE says whether oneDNN
# found the last one's kernel in its cache.
CACHE_PROBE = """
import sys
from mtcli.allocator import bound_onednn_cache
print("set", int(bound_onednn_cache(int(sys.argv[1]))), flush=True)
import torch
from mtcli.infer.packed import PackedLinear
product = PackedLinear(torch.randn(16, 8), torch.randn(16))
with torch.inference_mode():
    for rows in (1, 2, 3, 1):
        print("rows", rows, flush=True)
        product(torch.randn(rows, 8))
"""


def _last_product_cached(capacity: int, **env: str) -> tuple[bool, bool]:
    """(whether bound_onednn_cache set the cap, whether the last product hit oneDNN's cache)."""
    clean = {k: v for k, v in os.environ.items() if "PRIMITIVE_CACHE_CAPACITY" not in k}
    out = subprocess.run([sys.executable, "-c", CACHE_PROBE, str(capacity)],
                         env={**clean, "ONEDNN_VERBOSE": "all", **env}, capture_output=True,
                         text=True, check=True).stdout
    last = out.split("rows 1")[-1]
    assert "create:cache_" in last, out[-2000:]
    return out.startswith("set 1"), "create:cache_hit" in last


@pytest.mark.skipif(not packing_supported(), reason="this PyTorch build has no oneDNN linear")
def test_the_onednn_cache_bound_evicts_kernels_and_the_user_setting_wins() -> None:
    # two entries hold one product's kernels: the first one-row kernel is gone by the last call
    assert _last_product_cached(2) == (True, False)
    assert _last_product_cached(64) == (True, True)
    assert _last_product_cached(2, ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024") == (False, True)

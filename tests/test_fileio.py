"""Atomic writes: all or nothing, ordinary permissions, and the failing file named."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mtcli.fileio import atomic_dir, atomic_write, default_file_mode, sha256_file


def test_atomic_write_replaces_with_ordinary_mode(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with atomic_write(target) as handle:
        handle.write("new\n")
    assert target.read_text() == "new\n"
    assert stat.S_IMODE(target.stat().st_mode) == default_file_mode()
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_write_failure_keeps_old_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_write(target) as handle:
        handle.write("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_dir_swaps_in_complete_directory(tmp_path: Path) -> None:
    target = tmp_path / "cache"
    target.mkdir()
    (target / "a").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
        (tmp / "a").write_text("half")
        raise RuntimeError("interrupted")
    assert (target / "a").read_text() == "old"
    with atomic_dir(target) as tmp:
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o777 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_sha256_file(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_bytes(b"abc")
    assert sha256_file(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"

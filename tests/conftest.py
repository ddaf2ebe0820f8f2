"""Shared fixtures: the repo paths, the toy corpus, and the shared WMT data (skipped if absent)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOY_DIR = REPO / "tests" / "fixtures" / "toy"
TOY_CONFIG = REPO / "configs" / "toy.yaml"
SHARED_DATA = REPO.parent / "shared" / "data"

# Small models on a 2-core machine: one intra-op thread keeps tests deterministic and lets
# pytest-level parallelism (if any) not oversubscribe.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def _torch_threads() -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return
    torch.set_num_threads(1)


_torch_threads()


@pytest.fixture
def toy_dir(tmp_path: Path) -> Path:
    """A private copy of the toy corpus (tests may damage it)."""
    dst = tmp_path / "toy"
    shutil.copytree(TOY_DIR, dst)
    return dst


@pytest.fixture
def toy_config_path() -> Path:
    """Path of configs/toy.yaml."""
    return TOY_CONFIG


def shared_corpus(name: str) -> Path:
    """``../shared/data/<name>``, or skip the test with a clear reason."""
    path = SHARED_DATA / name
    if not path.is_dir():
        pytest.skip(f"shared corpus {path} not found (tests that need real data read ../shared/data)")
    return path

"""The random generators' states, saved in every checkpoint so that a resume is exact."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def get_rng_state(device: torch.device) -> dict[str, Any]:
    """Python, numpy, torch (and CUDA) generator states as plain lists/tensors (weights-only safe)."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [int(version), list(internal), gauss],
        "numpy": [str(key), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of :func:`get_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    key, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((key, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)

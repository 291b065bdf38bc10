"""A worker's random streams (torch, numpy, python): seeded from (seed, step, rank), captured and restored.

Captured states hold tensors and numbers only, so a checkpoint's RNG files load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """The process's RNG states as tensors and numbers only, so they load with ``weights_only=True``."""
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": np_pos,
            "has_gauss": np_has_gauss,
            "gauss": np_gauss,
        },
        "python": {"version": py_version, "internal": torch.tensor(py_internal, dtype=torch.int64), "gauss": py_gauss},
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["internal"].tolist()), p["gauss"]))


def seed_rngs(seed: int, step: int, rank: int) -> None:
    """Deterministic RNG streams for (seed, step, rank), used at start and after a resharding resume."""
    s = (seed * 1_000_003 + step * 7_919 + rank) % (2**31 - 1)
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)

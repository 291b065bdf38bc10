"""Running a native kernel over disjoint ranges on a few threads (ctypes releases the GIL)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def parallel_ranges(fn: Callable[[int, int], None], bounds: np.ndarray) -> None:
    """Call ``fn(bounds[i], bounds[i + 1])`` for every non-empty range, one thread per range."""
    ranges = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if len(ranges) <= 1:
        for a, b in ranges:
            fn(a, b)
        return
    with ThreadPoolExecutor(len(ranges)) as pool:
        for f in [pool.submit(fn, a, b) for a, b in ranges]:
            f.result()

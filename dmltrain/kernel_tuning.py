"""Tuned Triton launch configurations, chosen once and kept across ranks and runs.

Triton's autotuner times every config in every process: each rank of each run re-tunes at start,
and the launcher cannot size its grid or buffers from the chosen tiles before the launch.
:class:`Tuner` instead picks a kernel's config for a shape key once, by timing each candidate, and
keeps the choice in a JSON file per (GPU name, Triton version) in a private folder
(``$DMLTRAIN_TUNING_DIR``, default ``~/.cache/dmltrain/triton-tuning``, created 0700; written
atomically). The file is read as data only: an entry names a config by its tile values and is used
only when it is one of the kernel's own candidates, so a stale or edited file can at worst pick
another candidate. Ranks sharing the folder reuse each other's choices once written; ranks tuning at
once may each keep their own (the file keeps the last written), so kernels that must give the same bits
on every rank and run take fixed tiles instead (the classifier's ``deterministic``).

Configs the device cannot run are pruned here: Triton refuses to launch a kernel whose shared memory
(or registers) exceed the device's, and :func:`time_launch` counts such a config as infinitely slow,
so it is never chosen (the offline compile tests check today's candidates fit an A100 and an H100).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmltrain.fileio import write_json


@dataclass(frozen=True)
class LaunchConfig:
    """A kernel's compile-time tiles (``meta``) and its warps and pipeline stages."""

    meta: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int

    @classmethod
    def of(cls, num_warps: int, num_stages: int, **meta: int) -> LaunchConfig:
        return cls(tuple(sorted(meta.items())), num_warps, num_stages)

    def kwargs(self) -> dict[str, int]:
        """Keyword arguments of a Triton launch: the tiles, ``num_warps`` and ``num_stages``."""
        return {**dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}

    def __getitem__(self, name: str) -> int:
        return dict(self.meta)[name]

    def to_json(self) -> dict[str, Any]:
        return {"meta": dict(self.meta), "num_warps": self.num_warps, "num_stages": self.num_stages}


def time_launch(
    launch: Callable[[LaunchConfig], Any], cfg: LaunchConfig, bench: Callable[..., float] | None = None
) -> float:
    """Milliseconds of ``launch(cfg)`` (Triton's ``do_bench`` unless ``bench``); ``inf`` when the device cannot
    run ``cfg`` (Triton's ``OutOfResources``: shared memory or registers beyond the device's)."""
    from triton.runtime.errors import OutOfResources

    if bench is None:
        from triton.testing import do_bench as bench
    try:
        return bench(lambda: launch(cfg), warmup=5, rep=20)
    except OutOfResources:
        return math.inf


def tuning_dir() -> Path:
    """The private folder of the tuning files (created 0700 when absent)."""
    path = Path(os.environ.get("DMLTRAIN_TUNING_DIR") or Path.home() / ".cache" / "dmltrain" / "triton-tuning")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)[:120]


class Tuner:
    """Config choices of the kernels of one GPU model and Triton version, cached in one JSON file.

    ``choose(kernel, key, candidates, time_config)`` returns the cached choice for ``(kernel, key)``
    when it is still among ``candidates``, else times each candidate with ``time_config`` (seconds;
    ``inf`` for one that cannot run) and stores the fastest.
    """

    def __init__(self, device_name: str, triton_version: str, directory: Path | None = None) -> None:
        self.path = (directory or tuning_dir()) / f"{_safe_name(device_name)}-triton-{_safe_name(triton_version)}.json"
        self._memo: dict[str, dict[str, Any]] | None = None

    def _entries(self) -> dict[str, dict[str, Any]]:
        if self._memo is None:
            self._memo = {}
            try:
                st = self.path.stat()
                # only a file of ours that nobody else may write is trusted to pick among our candidates
                if st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    data = json.loads(self.path.read_text())
                    if isinstance(data, dict):
                        self._memo = {k: v for k, v in data.items() if isinstance(v, dict)}
            except (OSError, ValueError):
                pass
        return self._memo

    def choose(
        self,
        kernel: str,
        key: Sequence[Any],
        candidates: Sequence[LaunchConfig],
        time_config: Callable[[LaunchConfig], float],
    ) -> LaunchConfig:
        name = f"{kernel}|{'|'.join(str(k) for k in key)}"
        saved = self._entries().get(name)
        for c in candidates:
            if saved is not None and c.to_json() == saved:
                return c
        times = [time_config(c) for c in candidates]
        if all(t == math.inf for t in times):
            raise RuntimeError(
                f"{kernel}: none of its {len(candidates)} tile configs fits this GPU (shared memory or registers)"
            )
        best = candidates[min(range(len(candidates)), key=times.__getitem__)]
        self._memo = {**self._read_fresh(), name: best.to_json()}
        try:
            write_json(self.path, self._memo)
        except OSError:  # a read-only home: the choice holds for this process
            pass
        return best

    def _read_fresh(self) -> dict[str, dict[str, Any]]:
        """The file as another rank may have written it since (merged, so no choice is lost)."""
        self._memo = None
        return dict(self._entries())

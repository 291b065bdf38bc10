"""Reading checkpoint files without running code from them: weights-only unpickling with an explicit allow-list.

A checkpoint folder is data, but whoever can write into it (a shared storage path, a copied
run folder) must not be able to run code on the workers that resume from it: a ``.pt`` file is
a pickle, and an unrestricted ``torch.load`` runs whatever its ``__reduce__`` names. So every
file of a checkpoint is read with ``torch.load(weights_only=True)``: tensors, numbers, strings
and containers, plus the few classes DeepSpeed's engine checkpoint holds
(:data:`ENGINE_STATE_TYPES`: its ZeRO stage enum, loss scalers and flat-partition addresses).
Anything else is refused before any of it is built, with one line naming the file and the type.

* :func:`load_file`: one file (the checkpointer's own files; DeepSpeed's inside :func:`restricted_loads`);
* :func:`restricted_loads`: while a resume runs, DeepSpeed's checkpoint engine reads through
  :func:`load_file`, and any other ``torch.load`` in the process is forced weights-only
  (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``) with the same allow-list, whatever its caller passed;
* :func:`scan_checkpoint`: the driver's check of a checkpoint folder before any worker starts;
  it reads the pickles' opcodes and builds nothing;
* :func:`checkpoint_files`: a checkpoint's files, symbolic links included (one leaving the folder is
  refused: by the scan, and again by :func:`restricted_loads` on the workers).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dmltrain.errors import UserError

# What DeepSpeed 0.19's engine checkpoints hold beyond tensors and containers (ZeRO 0-3, fp32/bf16/fp16):
# each is a plain value class whose construction from checkpoint data runs none of the file's code.
ENGINE_STATE_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
FORCE_WEIGHTS_ONLY = (
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load's own switch: weights-only even where weights_only=False
)
TRUST_NOTE = "checkpoint files are loaded as data only (docs/security.md: 'What is trusted')"
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def engine_state_types() -> list[type]:
    """The classes of :data:`ENGINE_STATE_TYPES` (importing DeepSpeed's modules that define them)."""
    out = []
    for name in ENGINE_STATE_TYPES:
        module, _, attr = name.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def load_file(path: str | os.PathLike[str], map_location: Any = "cpu", *, engine_types: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``, with DeepSpeed's :data:`ENGINE_STATE_TYPES` allowed if ``engine_types``.

    A file that names any other type is refused with a one-line :class:`UserError` naming the file
    and the type; a file that is not a readable ``torch.save`` file, with one naming the file.
    """
    allowed = engine_state_types() if engine_types else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = found.group(1) if found else " ".join(str(e).split())[:120]
        raise UserError(f"{path}: refused to load a checkpoint file that holds {what}; {TRUST_NOTE}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise UserError(f"{path}: cannot read this checkpoint file ({' '.join(str(e).split())[:160]})") from None


class _WeightsOnlyCheckpointEngine:
    """DeepSpeed's checkpoint engine with ``load`` replaced by :func:`load_file`; everything else is the original's."""

    def __init__(self, inner: Any):
        self._inner = inner

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_file(path, map_location, engine_types=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def restricted_loads(engine: Any, directory: str | os.PathLike[str]) -> Iterator[None]:
    """Within the block, ``engine.load_checkpoint`` and any other ``torch.load`` unpickle data and allowed types only;
    a refusal outside :func:`load_file` becomes a one-line :class:`UserError` naming ``directory``."""
    checkpoint_files(directory)  # a link leaving the checkpoint: refused before anything is read
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnlyCheckpointEngine(inner)
    before = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(engine_state_types()):
            yield
    except (
        pickle.UnpicklingError
    ) as e:  # a torch.load outside the checkpoint engine (forced weights-only) refused a type
        found = _GLOBAL.search(str(e))
        what = found.group(1) if found else "a type outside the allow-list"
        raise UserError(f"{directory}: refused to load a checkpoint file that holds {what}; {TRUST_NOTE}") from None
    finally:
        engine.checkpoint_engine = inner
        if before is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = before


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The files of a checkpoint folder as a resume would read them, symbolic links included.

    The folder is walked without following links; a link to a file or a folder inside the checkpoint
    stands for its target (listed under the link's name, as a reader would open it), and a link
    leaving the checkpoint (or a broken one) is refused with one line: it would make the resume
    read whatever it points at (pathlib's ``rglob`` of Python 3.11 does not follow folder links, so a
    scan by it would not even see those files). The folder itself must not be a link: it is refused, not
    resolved and walked (it would stand for whatever folder it names)."""
    if Path(directory).is_symlink():
        raise UserError(
            f"{directory}: a symbolic link to {Path(directory).resolve()}; refused (a checkpoint is a folder of its "
            f"run: {TRUST_NOTE})"
        )
    root = Path(directory).resolve()
    out = []
    for here, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(here, name)
            if not path.is_symlink():
                if name in files:
                    out.append(path)
                continue
            target = path.resolve()
            if not target.exists() or not target.is_relative_to(root):
                raise UserError(
                    f"{path}: a symbolic link to {target}, outside the checkpoint {root}; refused "
                    f"(a checkpoint holds its own files only: {TRUST_NOTE})"
                )
            if target.is_dir():  # a link inside: its files are read under its name too
                out.extend(path / Path(here, f).relative_to(target) for here, _, fs in os.walk(target) for f in fs)
            else:
                out.append(path)
    return sorted(out)


def scan_checkpoint(directory: str | os.PathLike[str]) -> None:
    """Refuse (one-line :class:`UserError`) a checkpoint folder holding a ``.pt`` file that names a type
    :func:`load_file` would not load, or that is not a ``torch.save`` zip file, or a symbolic link leaving the
    folder (:func:`checkpoint_files`). Nothing is unpickled: the pickles' opcodes are read (an opcode the
    weights-only reader does not know is refused too)."""
    for path in checkpoint_files(directory):
        if path.suffix != ".pt":
            continue
        try:
            names = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
        except Exception as e:  # noqa: BLE001 — a damaged or foreign file: refused the same way whatever torch raised
            raise UserError(f"{path}: cannot read this checkpoint file ({' '.join(str(e).split())[:160]})") from None
        bad = sorted(names - set(ENGINE_STATE_TYPES))  # names beyond torch's own weights-only set and ours
        if bad:
            raise UserError(f"{path}: refused to load a checkpoint file that holds {bad[0]}; {TRUST_NOTE}")

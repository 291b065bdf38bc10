"""An embedding set: the folder ``dmltrain embed`` writes and ``dmltrain index`` reads, in formats other tools read.

::

    embeddings.npy    float32 N × D, one row per embedded image (NumPy's .npy: numpy.load, memory-mappable)
    codes.npy         uint8 N × ceil(D/8): the sign bits, packed (numpy.packbits order), with --binary
    ids.parquet       one row per embedding: row (its row in embeddings.npy), id, label (text or null), index
                      (its position in the source) and the source's other columns (split, path, the table's columns)
    embeddings.json   what the set is: format, count, dim, normalized, binary, the model (its contract), the
                      source, the images that could not be read; written last, so its presence means complete

While ``embed`` runs, ``chunks/`` holds ``plan.json`` (what is being embedded, by what) and one
``chunk-NNNNNN.npz`` per finished chunk of the source (the embeddings and positions of its readable
images, and their codes), each written atomically. A run interrupted at any point is finished by the same
command with ``--resume``: complete chunks are kept, the others embedded; a plan that differs (another
model file, another source) is refused naming the difference, and so is a chunk that is not what this plan
writes (:meth:`ChunkedWriter.read`: its arrays, their dtypes and shapes, positions increasing inside the chunk's
share of the source), before anything is embedded. At the end the chunks are assembled into the files above
(written under temporary names, then renamed) and ``chunks/`` is removed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path, read_json, write_json

FORMAT = "dmltrain.embeddings"
VERSION = 1
EMBEDDINGS, CODES, IDS, INFO, CHUNKS, PLAN = (
    "embeddings.npy",
    "codes.npy",
    "ids.parquet",
    "embeddings.json",
    "chunks",
    "plan.json",
)


@dataclass
class EmbeddingSet:
    """A loaded embedding set (see the module doc); ``embeddings`` is memory-mapped."""

    folder: Path
    info: dict[str, Any]
    embeddings: np.ndarray
    codes: np.ndarray | None
    ids: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.embeddings)

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def labels(self) -> np.ndarray | None:
        """Each row's label as a string array, None when the source had no labels."""
        labels = self.ids.get("label")
        if labels is None or all(v is None for v in labels):
            return None
        return np.asarray(["" if v is None else str(v) for v in labels])


def load_embedding_set(path: str | os.PathLike[str]) -> EmbeddingSet:
    """The set in ``path`` (its folder, or its ``embeddings.json``); one-line :class:`UserError` naming the file."""
    folder = Path(path)
    if folder.name == INFO:
        folder = folder.parent
    info_path = folder / INFO
    if not info_path.is_file():
        more = " (an interrupted embed: rerun it with --resume)" if (folder / CHUNKS).is_dir() else ""
        raise UserError(f"{info_path}: not found; not a folder written by dmltrain embed{more}")
    info = read_json(info_path)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise UserError(f"{info_path}: not a {FORMAT} file")
    emb = _npy(folder / EMBEDDINGS, mmap=True)
    if emb.ndim != 2 or emb.dtype != np.float32 or len(emb) != info.get("count"):
        raise UserError(f"{folder / EMBEDDINGS}: expected float32 {info.get('count')} × D, got {emb.dtype} {emb.shape}")
    codes = _npy(folder / CODES, mmap=True) if info.get("binary") else None
    import pyarrow.parquet as pq

    try:
        ids = pq.read_table(folder / IDS).to_pydict()
    except Exception as e:  # noqa: BLE001 — pyarrow raises several types for a missing or damaged file
        raise UserError(f"{folder / IDS}: unreadable ({type(e).__name__}: {e})") from None
    if len(ids.get("row", [])) != len(emb):
        raise UserError(f"{folder / IDS}: {len(ids.get('row', []))} rows for the {len(emb)} embeddings")
    return EmbeddingSet(folder, info, emb, codes, ids)


def _npy(path: Path, mmap: bool) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable .npy file ({' '.join(str(e).split())[:120]})") from None


class ChunkedWriter:
    """Writes an embedding set chunk by chunk into ``folder`` (see the module doc)."""

    def __init__(self, folder: str | os.PathLike[str], plan: dict[str, Any], *, resume: bool, overwrite: bool):
        self.folder = Path(folder)
        self.chunks = self.folder / CHUNKS
        self.plan = json.loads(json.dumps(plan))  # as JSON reads it back
        mine = [self.folder / n for n in (EMBEDDINGS, CODES, IDS, INFO)]
        if overwrite and resume:
            raise UserError("--overwrite and --resume: choose one")
        if overwrite:
            for p in mine:
                p.unlink(missing_ok=True)
            shutil.rmtree(self.chunks, ignore_errors=True)
        elif (self.folder / INFO).exists():
            what = "a complete set (nothing to resume)" if resume else "an embedding set"
            raise UserError(f"{self.folder}: holds {what}; pass --overwrite to replace it, or choose another --out")
        elif self.chunks.is_dir() and not resume:
            raise UserError(
                f"{self.folder}: holds an interrupted embed; pass --resume to finish it, --overwrite to start afresh"
            )
        elif self.folder.is_dir() and any(self.folder.iterdir()) and not self.chunks.is_dir():
            raise UserError(f"{self.folder}: not empty; choose an empty or new --out")
        plan_path = self.chunks / PLAN
        if resume and plan_path.is_file():
            old = read_json(plan_path)
            diff = next((k for k in sorted(set(old) | set(self.plan)) if old.get(k) != self.plan.get(k)), None)
            if diff is not None:
                raise UserError(
                    f"{plan_path}: the interrupted embed had {diff} = {json.dumps(old.get(diff))[:120]}, this one "
                    f"{json.dumps(self.plan.get(diff))[:120]}; rerun it as it was, or --overwrite"
                )
        else:
            write_json(plan_path, self.plan)

    def path(self, c: int) -> Path:
        return self.chunks / f"chunk-{c:06d}.npz"

    def done(self, c: int) -> bool:
        return self.path(c).is_file()

    def read(self, c: int, count: int, dim: int) -> dict[str, np.ndarray]:
        """Chunk ``c``'s arrays, checked against the plan: ``embeddings`` float32 ``n × dim``, ``index`` int64 ``n``
        strictly increasing within the chunk's positions of the ``count`` source images, ``codes`` uint8
        ``n × ceil(dim / 8)`` exactly when the plan is binary, nothing else. A chunk is written by this class
        atomically, so any other is a file someone changed: one-line :class:`UserError` naming it."""
        path, size = self.path(c), int(self.plan["chunk_size"])
        lo, hi = c * size, min((c + 1) * size, count)

        def bad(what: str) -> UserError:
            return UserError(f"{path}: {what}; not a chunk of this embed (remove it to embed it again, or --overwrite)")

        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except Exception as e:  # noqa: BLE001 — numpy raises several types for a damaged .npz: one line
            raise bad(f"unreadable ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
        want = {"embeddings", "index"} | ({"codes"} if self.plan.get("binary") else set())
        if set(arrays) != want:
            raise bad(f"holds {', '.join(sorted(arrays)) or 'nothing'}, expected {', '.join(sorted(want))}")
        emb, index = arrays["embeddings"], arrays["index"]
        if emb.dtype != np.float32 or emb.ndim != 2 or emb.shape[1] != dim:
            raise bad(f"embeddings {emb.dtype} {emb.shape}, expected float32 N × {dim}")
        if index.dtype != np.int64 or index.shape != (len(emb),):
            raise bad(f"positions {index.dtype} {index.shape} for {len(emb)} embeddings")
        if len(index) and (int(index[0]) < lo or int(index[-1]) >= hi or bool((np.diff(index) <= 0).any())):
            raise bad(f"positions not increasing within this chunk's images {lo} to {hi - 1}")
        codes = arrays.get("codes")
        if codes is not None and (codes.dtype != np.uint8 or codes.shape != (len(emb), -(-dim // 8))):
            raise bad(f"codes {codes.dtype} {codes.shape}, expected uint8 {len(emb)} × {-(-dim // 8)}")
        return arrays

    def check_done(self, n_chunks: int, count: int, dim: int) -> int:
        """Check every saved chunk (:meth:`read`) before a resumed embed adds to them; how many there are."""
        done = [c for c in range(n_chunks) if self.done(c)]
        for c in done:
            self.read(c, count, dim)
        return len(done)

    def write(self, c: int, emb: np.ndarray, index: np.ndarray, codes: np.ndarray | None) -> None:
        arrays = {"embeddings": emb.astype(np.float32, copy=False), "index": index.astype(np.int64, copy=False)}
        if codes is not None:
            arrays["codes"] = codes
        with atomic_path(self.path(c)) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)

    def assemble(
        self,
        n_chunks: int,
        count: int,
        rows: Callable[[np.ndarray], dict[str, list[Any]]],
        info: dict[str, Any],
        dim: int,
    ) -> EmbeddingSet:
        """The set from chunks ``0 .. n_chunks-1`` (each :meth:`read`, so checked): the arrays, the ids
        (``rows(positions)``), then ``embeddings.json`` with ``info`` and the counts (``count``: the source's
        images, readable or not)."""
        binary = bool(self.plan.get("binary"))
        index = np.concatenate([np.zeros(0, np.int64), *(self.read(c, count, dim)["index"] for c in range(n_chunks))])
        if not len(index):  # a chunk of unreadable images only has no rows
            raise UserError(f"{self.folder}: none of the {count} images could be read")
        codes = []
        with atomic_path(self.folder / EMBEDDINGS) as tmp:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(index), dim))
            at = 0
            for c in range(n_chunks):
                p = self.read(c, count, dim)
                e = p["embeddings"]
                out[at : at + len(e)] = e
                at += len(e)
                if binary:
                    codes.append(p["codes"])
            out.flush()
            del out
        if binary:
            with atomic_path(self.folder / CODES) as tmp, open(tmp, "wb") as f:
                np.save(f, np.concatenate(codes), allow_pickle=False)
        import pyarrow as pa
        import pyarrow.parquet as pq

        columns = {"row": list(range(len(index))), **rows(index)}
        with atomic_path(self.folder / IDS) as tmp:
            pq.write_table(pa.table(columns), tmp)
        missing = np.setdiff1d(np.arange(count), index)
        unreadable = rows(missing)["id"][:20] if len(missing) else []
        record = {
            "format": FORMAT,
            "version": VERSION,
            "count": int(len(index)),
            "dim": int(dim),
            "binary": binary,
            "unreadable": int(len(missing)),
            "unreadable_ids": unreadable,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **info,
        }
        write_json(self.folder / INFO, record)
        shutil.rmtree(self.chunks, ignore_errors=True)
        return load_embedding_set(self.folder)

"""Classifier checkpoints keyed by global class id, loadable at any world size.

A *piece* is a dict holding the rows ``class_start … class_end`` of the weight (and bias) with
the optimizer state of those rows::

    {"format": FORMAT, "kind", "num_classes", "dim", "params", "class_start", "class_end",
     "weight": (rows × D, or rows × k × D with k sub-centers), "bias": (rows) | None,
     "optimizer": None | {"type", "param_groups": [hyperparameters by group name],
                          "rows": {"weight": {state: rows × …}, "bias": {...}}},
     "class_state": {name: rows × …}, "class_scalars": {name: int}}

``class_state`` is what the classifier keeps per class besides its rows
(:meth:`~dmltrain.distributed.sharded_softmax.ShardedClassifier.class_state`: the nearness index of
hard-class sampling, the sub-center counts of sample dropping), sliced and resharded like the rows;
pieces saved before it existed have none (the index is then rebuilt at the next step).

A whole state is one piece covering ``0 … C``. Loading takes a piece or a list of pieces
and keeps, on each worker, the rows it owns; every owned row must be covered.

Two ways to save: :func:`gather_state` assembles the whole state on one rank (simple, but
that rank holds ``C × D`` times (1 + optimizer states)); :func:`save_by_class` has every
worker write its own piece to a directory and never materialises the whole weight,
and :func:`load_by_class` memory-maps only the pieces that overlap a worker's rows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dmltrain.distributed.collectives import gather_rows, group_rank_size
from dmltrain.distributed.sharded_softmax import ShardedClassifier
from dmltrain.errors import UserError
from dmltrain.fileio import atomic_path, write_json

FORMAT = "dmltrain.sharded_classifier/1"
INDEX_NAME = "classifier-index.json"


def _param_items(clf: ShardedClassifier) -> list[tuple[str, Tensor]]:
    return [(n, p) for n, p in (("weight", clf.weight), ("bias", clf.bias)) if p is not None]


def _optimizer_groups(optimizer: Any) -> list[dict[str, Any]]:
    out = []
    for i, g in enumerate(optimizer.param_groups):
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        hyper.setdefault("name", f"group{i}")
        out.append(hyper)
    return out


def _check_optimizer(optimizer: Any) -> None:
    if not hasattr(optimizer, "row_state"):
        raise TypeError(
            f"classifier checkpoint: {type(optimizer).__name__} is not a row-sparse optimizer (make_classifier_optimizer)"
        )


def local_state(clf: ShardedClassifier, optimizer: Any = None) -> dict[str, Any]:
    """This worker's piece (tensors moved to the CPU)."""
    piece: dict[str, Any] = {
        "format": FORMAT,
        "kind": clf.kind,
        "num_classes": clf.num_classes,
        "dim": clf.dim,
        "params": dict(clf.params),
        "class_start": clf.class_start,
        "class_end": clf.class_end,
        "weight": clf.weight.detach().cpu(),
        "bias": None if clf.bias is None else clf.bias.detach().cpu(),
        "optimizer": None,
    }
    tensors, scalars = clf.class_state()
    piece["class_state"] = {k: v.detach().cpu() for k, v in tensors.items()}
    piece["class_scalars"] = dict(scalars)
    if optimizer is not None:
        _check_optimizer(optimizer)
        rows = {
            name: {k: optimizer.state[p][k].detach().cpu() for k in optimizer.row_state}
            for name, p in _param_items(clf)
        }
        piece["optimizer"] = {
            "type": type(optimizer).__name__,
            "param_groups": _optimizer_groups(optimizer),
            "rows": rows,
        }
    return piece


def _gather_to(t: Tensor, sizes: list[int], group: Any, dst: int | None) -> Tensor | None:
    """Concatenate every worker's rows on ``dst`` (group rank) or everywhere (None)."""
    rank, world = group_rank_size(group)
    if world == 1:
        return t
    if dst is None:
        return gather_rows(t.contiguous(), sizes, group)
    biggest = max(sizes)
    x = t.contiguous()
    if x.shape[0] < biggest:
        x = torch.cat([x, x.new_zeros((biggest - x.shape[0], *x.shape[1:]))])
    bufs = [torch.empty_like(x) for _ in sizes] if rank == dst else None
    dist.gather(x, bufs, group=group, group_dst=dst)
    if rank != dst:
        return None
    return torch.cat([b[:s] for b, s in zip(bufs, sizes)])


def gather_state(clf: ShardedClassifier, optimizer: Any = None, dst: int | None = 0) -> dict[str, Any] | None:
    """The whole state (one piece over all classes) on group rank ``dst``; None elsewhere.

    Collective: every worker must call it. ``dst=None`` returns it on every worker.
    """
    rank, _ = group_rank_size(clf.group)
    sizes = [e - s for s, e in clf.partition.bounds()]
    dev = clf.weight.device
    mine = dst is None or rank == dst

    def gather(t: Tensor) -> Tensor | None:
        out = _gather_to(t.detach().to(dev), sizes, clf.group, dst)
        return None if out is None else out.cpu()

    state: dict[str, Any] = {
        "format": FORMAT,
        "kind": clf.kind,
        "num_classes": clf.num_classes,
        "dim": clf.dim,
        "params": dict(clf.params),
        "class_start": 0,
        "class_end": clf.num_classes,
        "weight": gather(clf.weight),
        "bias": None if clf.bias is None else gather(clf.bias),
        "optimizer": None,
    }
    tensors, scalars = clf.class_state()
    state["class_state"] = {k: gather(v) for k, v in tensors.items()}
    state["class_scalars"] = dict(scalars)
    if optimizer is not None:
        _check_optimizer(optimizer)
        rows: dict[str, dict[str, Any]] = {}
        for name, p in _param_items(clf):
            rows[name] = {k: gather(optimizer.state[p][k]) for k in optimizer.row_state}
        state["optimizer"] = {
            "type": type(optimizer).__name__,
            "param_groups": _optimizer_groups(optimizer),
            "rows": rows,
        }
    return state if mine else None


def _check_piece(clf: ShardedClassifier, piece: dict[str, Any]) -> None:
    if piece.get("format") != FORMAT:
        raise ValueError(f"classifier checkpoint: unknown format {piece.get('format')!r} (expected {FORMAT})")
    for key in ("num_classes", "dim", "kind"):
        if piece[key] != getattr(clf, key):
            raise ValueError(
                f"classifier checkpoint: saved {key} = {piece[key]!r} but this classifier has {getattr(clf, key)!r}"
            )
    w = piece.get("weight")
    saved_k = 1 if w is None or w.dim() < 3 else int(w.shape[1])
    if saved_k != clf.subcenters:
        raise ValueError(
            f"classifier checkpoint: saved with {saved_k} sub-center(s) per class but this classifier has "
            f"params.subcenters = {clf.subcenters}"
        )


@torch.no_grad()
def load_state(clf: ShardedClassifier, state: dict[str, Any] | list[dict[str, Any]], optimizer: Any = None) -> None:
    """Copy this worker's rows (and their optimizer state) out of one or several pieces."""
    pieces = [state] if isinstance(state, dict) else list(state)
    if optimizer is not None:
        _check_optimizer(optimizer)
    covered = torch.zeros(clf.num_local, dtype=torch.bool)
    params = dict(_param_items(clf))
    hyper: list[dict[str, Any]] | None = None
    extra: dict[str, Tensor] = {}  # the per-class state besides the rows, this worker's classes
    extra_covered: dict[str, Tensor] = {}
    scalars: dict[str, int] = {}
    for piece in pieces:
        _check_piece(clf, piece)
        s, e = int(piece["class_start"]), int(piece["class_end"])
        lo, hi = max(s, clf.class_start), min(e, clf.class_end)
        for name, value in (piece.get("class_scalars") or {}).items():
            if scalars.setdefault(name, int(value)) != int(value):
                raise ValueError(f"classifier checkpoint: its pieces disagree on {name} ({scalars[name]} and {value})")
        if optimizer is not None:
            opt = piece.get("optimizer")
            if opt is None:
                raise ValueError(
                    "classifier checkpoint: it holds no optimizer state, but an optimizer was given to load into"
                )
            if opt["type"] != type(optimizer).__name__:
                raise ValueError(
                    f"classifier checkpoint: optimizer state is {opt['type']}, cannot load it into {type(optimizer).__name__}"
                )
            hyper = opt["param_groups"]
        if lo >= hi:
            continue
        src, dst = slice(lo - s, hi - s), slice(lo - clf.class_start, hi - clf.class_start)
        for name, p in params.items():
            if piece.get(name) is None:
                raise ValueError(f"classifier checkpoint: no {name} saved")
            p[dst] = piece[name][src].to(device=p.device, dtype=p.dtype)
            if optimizer is not None:
                saved = piece["optimizer"]["rows"][name]
                for k in optimizer.row_state:
                    target = optimizer.state[p][k]
                    target[dst] = saved[k][src].to(device=target.device, dtype=target.dtype)
        covered[dst] = True
        for name, t in (piece.get("class_state") or {}).items():
            if name not in extra:
                extra[name] = torch.zeros((clf.num_local, *t.shape[1:]), dtype=t.dtype)
                extra_covered[name] = torch.zeros(clf.num_local, dtype=torch.bool)
            extra[name][dst] = t[src]
            extra_covered[name][dst] = True
    if not bool(covered.all()):
        missing = (~covered).nonzero().squeeze(1)
        first = int(missing[0]) + clf.class_start
        raise ValueError(
            f"classifier checkpoint: {missing.numel()} of this worker's classes are missing (first: class {first})"
        )
    if optimizer is not None and hyper is not None:
        by_name = {h.get("name"): h for h in hyper}
        for i, g in enumerate(optimizer.param_groups):
            saved = by_name.get(g.get("name", f"group{i}"))
            if saved is None:
                continue
            for k, v in saved.items():
                if k in g and k not in ("params", "name"):
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v
    # a state only some pieces hold (saved by another version) is not this worker's: left out
    clf.load_class_state({k: v for k, v in extra.items() if bool(extra_covered[k].all())}, scalars)
    if optimizer is not None:
        clf.row_grads.cleared()


def _piece_name(rank: int, world: int) -> str:
    return f"classifier-{rank:05d}-of-{world:05d}.pt"


def save_by_class(clf: ShardedClassifier, directory: str | os.PathLike[str], optimizer: Any = None) -> None:
    """Every worker writes its own piece into ``directory``; rank 0 then writes the index.

    Collective (ends with a barrier so that the index is complete when it returns).
    """
    rank, world = group_rank_size(clf.group)
    directory = Path(directory)
    piece = local_state(clf, optimizer)
    with atomic_path(directory / _piece_name(rank, world)) as tmp:
        torch.save(piece, tmp)
    if world > 1:
        dist.barrier(group=clf.group)
    if rank == 0:
        index = {
            "format": FORMAT,
            "num_classes": clf.num_classes,
            "dim": clf.dim,
            "kind": clf.kind,
            "pieces": [
                {"file": _piece_name(r, world), "class_start": s, "class_end": e}
                for r, (s, e) in enumerate(clf.partition.bounds())
            ],
        }
        write_json(directory / INDEX_NAME, index)
    if world > 1:
        dist.barrier(group=clf.group)


def load_by_class(clf: ShardedClassifier, directory: str | os.PathLike[str], optimizer: Any = None) -> None:
    """Load from :func:`save_by_class`'s directory at any world size, reading only overlapping pieces."""
    directory = Path(directory)
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: no classifier checkpoint index")
    index = json.loads(index_path.read_text())
    pieces = []
    for entry in index["pieces"]:
        if entry["class_end"] <= clf.class_start or entry["class_start"] >= clf.class_end:
            continue
        name = str(entry["file"])
        if Path(name).name != name or name in ("", ".", ".."):  # a tampered index must not reach outside the folder
            raise UserError(f"{index_path}: piece {name!r} is not a file name inside the checkpoint folder")
        pieces.append(torch.load(directory / name, map_location="cpu", mmap=True, weights_only=True))
    load_state(clf, pieces, optimizer)

"""Embedding a model's test batches, gathering them to rank 0, and evaluating a model on shards.

Distributed evaluation: every worker embeds its own disjoint part of the split
(``shards.read.stream.eval_batches`` hands each rank a contiguous share), the parts are gathered
to rank 0 in sample-index order, and rank 0 computes the metrics once. Because rows are put
back in index order, the metrics are identical for any number of workers.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from tqdm import tqdm

from dmltrain.evaluate.rerank import Rerank
from dmltrain.evaluate.retrieval import retrieval_metrics
from dmltrain.models.compiled import has_compiled_parts
from dmltrain.models.precision import autocast, to_channels_last
from shards.decode.transforms import PixelNorm
from shards.read.stream import eval_batches


def _as_numpy(x: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False).reshape(-1)


def _embedding_of(out: Any) -> Tensor:
    """The embedding tensor of a forward's output: a tensor, the first of a tuple, or ``out['embedding']``."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        return out[0]
    if isinstance(out, Mapping) and isinstance(out.get("embedding"), Tensor):
        return out["embedding"]
    raise TypeError(f"embed_batches: the model returned {type(out).__name__}; expected a tensor of embeddings")


def embed_batches(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any, Any]],
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    progress: bool = True,
    channels_last: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Embed ``(images, labels, index)`` batches: ``(emb float32 N × D, labels int64, index int64)``.

    The model runs in eval mode under ``torch.no_grad`` (its previous mode is restored
    afterwards), in ``precision`` autocast (``bf16`` on a GPU: the tensor cores' format), with
    4-D image batches in ``channels_last`` layout when asked (the layout a channels_last model
    convolves fastest; the model's own layout is the caller's). The embeddings stay on the
    device until the last batch, so the host does not wait for each forward pass, and come back
    as float32 on the CPU, unnormalized. Empty batches are skipped; no batch at all gives a
    ``0 × 0`` array. Progress goes to stderr. A model with compiled parts (``model.compile``) sees every
    batch at the largest size so far (the first's): a smaller one (a split's last, or one that lost unreadable
    samples) is padded with zero images, whose embeddings are dropped (static shapes: nothing recompiles; in
    eval mode a sample's embedding is its own).
    """

    dev = torch.device(device)
    static = has_compiled_parts(model)
    size = 0  # the batch size a compiled model sees (the largest so far: the first, but where it lost samples)
    was_training = model.training
    model.eval()
    embs: list[Tensor] = []
    labels: list[np.ndarray] = []
    index: list[np.ndarray] = []
    bar = tqdm(desc="embed", unit="img", file=sys.stderr, disable=not progress, leave=False)
    try:
        with torch.no_grad(), autocast(dev, precision):
            for images, y, idx in batches:
                if len(images) == 0:
                    continue
                images = (
                    images.to(dev, non_blocking=True)
                    if isinstance(images, Tensor)
                    else torch.as_tensor(images, device=dev)
                )
                n = len(images)
                size = max(size, n)
                if static and n < size:
                    images = torch.cat([images, images.new_zeros((size - n, *images.shape[1:]))])
                if channels_last:
                    images = to_channels_last(images)
                emb = _embedding_of(model(images)).float()
                if emb.ndim != 2 or emb.shape[0] != len(images):
                    raise ValueError(
                        f"embed_batches: expected {len(images)} × D embeddings, got shape {tuple(emb.shape)}"
                    )
                embs.append(emb[:n])
                labels.append(_as_numpy(y, np.int64))
                index.append(_as_numpy(idx, np.int64))
                if len(labels[-1]) != n or len(index[-1]) != n:
                    raise ValueError("embed_batches: a batch's labels or index do not match its images")
                bar.update(n)
    finally:
        bar.close()
        model.train(was_training)
    if not embs:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return torch.cat(embs).cpu().numpy(), np.concatenate(labels), np.concatenate(index)


def _sort_by_index(emb: np.ndarray, labels: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(index, kind="stable")
    index = index[order]
    keep = np.ones(len(index), dtype=bool)
    keep[1:] = index[1:] != index[:-1]
    if not keep.all():
        warnings.warn(
            f"gather_to_rank0: {int((~keep).sum())} duplicated sample indices dropped", RuntimeWarning, stacklevel=3
        )
    order = order[keep]
    return emb[order], labels[order]


def gather_to_rank0(
    emb: np.ndarray, labels: np.ndarray, index: np.ndarray, group: Any = None
) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """All workers' rows on rank 0 of ``group``, sorted by ``index``; other ranks get ``(None, None)``.

    Sizes may differ between ranks (a rank may have none). A sample index seen twice keeps
    its first row (with a warning). Without an initialized process group the input comes
    back sorted. Works with gloo (CPU tensors) and NCCL (through the current CUDA device).
    """

    emb = np.asarray(emb, dtype=np.float32)
    labels = np.asarray(labels).astype(np.int64, copy=False).reshape(-1)
    index = np.asarray(index).astype(np.int64, copy=False).reshape(-1)
    if emb.ndim != 2 or not len(emb) == len(labels) == len(index):
        raise ValueError(
            f"gather_to_rank0: {emb.shape} embeddings, {len(labels)} labels and {len(index)} indices do not match"
        )
    if not (dist.is_available() and dist.is_initialized()):
        return _sort_by_index(emb, labels, index)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dev = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    )

    meta = torch.tensor([len(emb), emb.shape[1] if len(emb) else 0], dtype=torch.int64, device=dev)
    metas = [torch.zeros_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    sizes = [int(m[0]) for m in metas]
    dims = {int(m[1]) for m, n in zip(metas, sizes) if n > 0}
    if len(dims) > 1:
        raise ValueError(f"gather_to_rank0: ranks hold embeddings of different dims {sorted(dims)}")
    dim = dims.pop() if dims else 0
    cap = max(max(sizes), 1)

    rows = torch.zeros((cap, dim), dtype=torch.float32, device=dev)
    ids = torch.zeros((cap, 2), dtype=torch.int64, device=dev)
    if len(emb):
        rows[: len(emb)] = torch.from_numpy(emb).to(dev)
        ids[: len(emb)] = torch.from_numpy(np.stack([labels, index], 1)).to(dev)
    row_parts = [torch.empty_like(rows) for _ in range(world)] if rank == 0 else None
    id_parts = [torch.empty_like(ids) for _ in range(world)] if rank == 0 else None
    dist.gather(rows, row_parts, dst=dst, group=group)
    dist.gather(ids, id_parts, dst=dst, group=group)
    if rank != 0:
        return None, None
    assert row_parts is not None and id_parts is not None
    all_rows = np.concatenate([p[:n].cpu().numpy() for p, n in zip(row_parts, sizes)]).reshape(-1, dim)
    all_ids = np.concatenate([p[:n].cpu().numpy() for p, n in zip(id_parts, sizes)]).reshape(-1, 2)
    return _sort_by_index(all_rows, all_ids[:, 0], all_ids[:, 1])


def evaluate_model(
    model: nn.Module,
    shard_dir: str,
    splits: list[str],
    eval_cfg: Any,
    data_cfg: Any,
    rank: int = 0,
    world_size: int = 1,
    device: str | torch.device = "cpu",
    precision: str = "fp32",
    progress: bool = True,
    channels_last: bool = False,
) -> tuple[dict[str, float], dict[str, tuple[np.ndarray, np.ndarray]]] | tuple[None, None]:
    """Embed ``splits`` of the shards on every rank, gather to rank 0, compute the metrics there.

    ``splits``: ``['test']`` (self-retrieval) or ``['query', 'gallery']`` (query→gallery).
    Uses ``eval_cfg.ks``, ``nmi``, ``map_at_r``, ``binary``, ``rerank``, ``rerank_params`` and
    ``data_cfg.eval_batch_size`` (per worker), ``eval_resize``, ``eval_crop``, ``augment.grayscale``,
    ``loader_workers``, and the model's input normalization ``mean``, ``std`` and resampling ``interpolation``
    (ImageNet's and bilinear when None). Every rank must call it.
    ``progress``: rank 0 draws bars (off inside training, where the driver shows progress).
    ``precision`` and ``channels_last``: as in :func:`embed_batches`; the metrics run on
    ``device`` when it is a GPU.
    Rank 0 returns ``(metrics, {split: (embeddings, labels)})``; the other ranks ``(None, None)``.
    Samples whose shard member cannot be read are left out of the metrics (not replaced); when
    there are any, ``metrics["unreadable_samples"]`` says how many (all splits, all ranks).
    """

    splits = list(splits)
    if len(splits) not in (1, 2):
        raise ValueError(f"evaluate_model: splits must be ['test'] or ['query', 'gallery'], got {splits}")
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"evaluate_model: world_size={world_size} needs an initialized torch.distributed process group"
        )
    gathered: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    unreadable = 0
    for split in splits:
        batches = eval_batches(
            shard_dir,
            split,
            rank=rank,
            world_size=world_size,
            batch_size=data_cfg.eval_batch_size,
            resize=data_cfg.eval_resize,
            crop=data_cfg.eval_crop,
            grayscale=data_cfg.augment.grayscale,
            loader_workers=data_cfg.loader_workers,
            storage_options=getattr(data_cfg, "storage_options", None),
            remote=getattr(data_cfg, "remote", None),
            norm=PixelNorm.of(getattr(data_cfg, "mean", None), getattr(data_cfg, "std", None)),
            interpolation=getattr(data_cfg, "interpolation", None),
        )
        emb, labels, index = embed_batches(
            model,
            batches,
            device=device,
            precision=precision,
            progress=progress and rank == 0,
            channels_last=channels_last,
        )
        out = gather_to_rank0(emb, labels, index)
        if out[0] is not None:
            gathered[split] = out  # type: ignore[assignment]
            # the samples no rank could read (each rank dropped and counted its own in batches.skipped);
            # counted from the gathered rows, so no extra collective is needed
            unreadable += batches.num_samples - len(out[1])
    if rank != 0 or not gathered:
        return None, None
    q_emb, q_lab = gathered[splits[0]]
    g_emb, g_lab = gathered[splits[1]] if len(splits) == 2 else (None, None)
    metric_device = device if torch.device(device).type == "cuda" else "cpu"
    rerank = Rerank.of(getattr(eval_cfg, "rerank", None), getattr(eval_cfg, "rerank_params", None))
    metrics = retrieval_metrics(
        q_emb,
        q_lab,
        g_emb,
        g_lab,
        ks=eval_cfg.ks,
        nmi=eval_cfg.nmi,
        map_at_r=eval_cfg.map_at_r,
        binary=eval_cfg.binary,
        device=metric_device,
        progress=progress,
        rerank=rerank,
    )
    if unreadable > 0:  # left out of the metrics, never replaced by another image
        metrics["unreadable_samples"] = float(unreadable)
    return metrics, gathered

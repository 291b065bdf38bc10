"""The default process group as the trainer needs it: started if absent, objects and replicas kept in step.

* :func:`ensure_process_group` joins the group Ray Train (or a test) started, or starts a
  one-process gloo group on loopback (Ray with one worker in local mode, a direct call), so
  DeepSpeed always finds one.
* :func:`broadcast_object` hands rank 0's picklable object to every rank (metrics computed
  on rank 0). It unpickles what another worker of the same job sent, never a file.
* :func:`broadcast_params` and :func:`average_grads` keep replicated parameters (the proxies
  of a proxy instance loss, trained on every worker outside DeepSpeed) bit-identical: equal
  at the start, then stepped with the same averaged gradient.
* :func:`broadcast_buffers` gives every rank rank 0's buffers (BatchNorm's running statistics,
  which each worker updates from its own batches), as DDP does, so that a model every rank
  evaluates is the one model rank 0 saves.

Every function is a no-op in a group of one, so the same code runs in one process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dmltrain.distributed.collectives import group_rank_size


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_process_group() -> tuple[int, int]:
    """``(rank, world size)`` of the default group, first starting a gloo group of one on 127.0.0.1 if none exists
    (then also ``LOCAL_RANK=0`` unless set: DeepSpeed refuses to start without it)."""
    if not dist.is_initialized():
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (a collective: every rank calls it; the others pass anything)."""
    if group_rank_size()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_params(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's ``params`` with those of the group's rank 0 (in place)."""
    if group_rank_size(group)[1] == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for p in params:
        dist.broadcast(p.data, src=src, group=group)


def broadcast_buffers(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's buffers of ``module`` (running means and variances, batch counts) with rank 0's."""
    if group_rank_size(group)[1] == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for b in module.buffers():
        dist.broadcast(b.data, src=src, group=group)


def average_grads(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> None:
    """Replace each existing ``p.grad`` by its mean over the group (parameters without a gradient are skipped)."""
    _, world = group_rank_size(group)
    if world == 1:
        return
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)

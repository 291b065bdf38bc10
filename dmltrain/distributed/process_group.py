"""The default process group as the trainer needs it: started if absent, objects and replicas kept in step.

* :func:`ensure_process_group` joins the group Ray Train (or a test) started, or starts a
  one-process gloo group on loopback (Ray with one worker in local mode, a direct call), so
  DeepSpeed always finds one.
* :func:`init_local_group` starts a group of processes of this machine that listens on loopback
  only (torch's own rendezvous would listen on every interface).
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

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (``lo`` on Linux, ``lo0`` on BSD and macOS), or
    None if it has neither."""
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


def init_local_group(backend: str, rank: int, world_size: int, port: int = 0) -> None:
    """Start (rank 0) or join the default process group of ``world_size`` processes of this machine, every socket
    of it on loopback; ``port``: the rendezvous port rank 0 listens on (0: any free one, for a group of one).

    torch's ``TCPStore`` server, which ``init_process_group(init_method="tcp://127.0.0.1:PORT")`` starts on rank 0,
    binds ``::`` (else ``0.0.0.0``) whatever the host in the URL: the only way to bind it to loopback is to hand it
    a socket already bound (``master_listen_fd``). Gloo's own sockets go to the address this machine's host name
    resolves to, NCCL's bootstrap to its first non-loopback interface: both are put on the loopback interface
    through ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` unless the user set them. These stay set for the rest
    of the process: every later group reads them (``new_group``: DeepSpeed's, the elastic run's host flags; NCCL at
    its first collective), and every process of this group is on this machine."""
    from torch.distributed.constants import default_pg_timeout  # what init_process_group's rendezvous waits

    if rank == 0:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))
            sock.listen()
            port = sock.getsockname()[1]
            listen_fd = sock.detach()  # the store owns it from here on: it closes it when it stops
        store = dist.TCPStore(LOOPBACK, port, world_size, True, default_pg_timeout, master_listen_fd=listen_fd)
    else:
        store = dist.TCPStore(LOOPBACK, port, world_size, False, default_pg_timeout)
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)


def ensure_process_group() -> tuple[int, int]:
    """``(rank, world size)`` of the default group, first starting a gloo group of one on 127.0.0.1 if none exists
    (:func:`init_local_group`, which also sets the loopback interface for gloo and NCCL unless set; then also
    ``LOCAL_RANK=0`` unless set: DeepSpeed refuses to start without it)."""
    if not dist.is_initialized():
        os.environ.setdefault("LOCAL_RANK", "0")
        init_local_group("gloo", 0, 1)
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

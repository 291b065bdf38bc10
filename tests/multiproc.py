"""Run a function on W processes joined by a gloo process group on loopback.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes, each calling
``fn(rank, world_size, *args)`` after ``torch.distributed`` is initialised, and returns the
list of their return values (rank order). An exception in any worker is re-raised in the
test with the worker's traceback; a hang ends after ``timeout`` seconds. ``fn`` must be a
module-level function of an importable module (spawn pickles it by name).
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 — every failure, KeyboardInterrupt included, goes back to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, payload = queue.get()
        if ok:
            results[rank] = payload
        else:
            failures.append(f"--- worker {rank} ---\n{payload}")
            break  # the others may now hang in a collective; stop them
    for p in procs:
        p.join(timeout=0 if failures else 10)
        if p.is_alive():
            p.terminate()
            p.join(5)
    if failures:
        raise RuntimeError("a worker failed:\n" + "\n".join(failures))
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        raise RuntimeError(f"workers {missing} returned nothing within {timeout:.0f}s (exit codes {codes})")
    return [results[r] for r in range(world_size)]


def end_process_group() -> None:
    """End this process's group through DeepSpeed when it has used it, so DeepSpeed forgets the groups it
    cloned from it (a later test's engine would otherwise broadcast over a group that no longer exists)."""
    import sys

    import torch.distributed as dist

    if "deepspeed.comm" in sys.modules:
        sys.modules["deepspeed.comm"].destroy_process_group()
    elif dist.is_initialized():
        dist.destroy_process_group()

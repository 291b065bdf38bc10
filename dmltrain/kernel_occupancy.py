"""How many CTAs (programs) of a compiled Triton kernel one SM runs at once, from the binary's registers and shared
memory and the SM's limits.

The sharded classifier's launcher sizes its class splits so that the grid fills whole waves of ``SMs × CTAs per SM``
programs (:func:`dmltrain.distributed.softmax_kernels.num_splits`), and the roofline model
(:mod:`dmltrain.distributed.roofline`) counts the same waves with the same :func:`occupancy`. On a GPU the registers
and shared memory are those of the binary Triton launches (:func:`resources`); the roofline takes those of the
offline compiles it records. Where they cannot be read, one CTA per SM: a split count sized for fewer programs than
run at once leaves SMs idle in the last wave but never changes a result.

Importable without torch or Triton (the roofline's ``bench --help``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: shared memory the driver reserves for each CTA on sm_80 and later (CUDA C++ Programming Guide, "Shared Memory")
RESERVED_SHARED = 1024


@dataclass(frozen=True)
class SMLimits:
    """One SM's resources: 32-bit registers, shared memory bytes (the largest carve-out), resident threads and
    CTAs (sm_80 and sm_90: 65,536 / 2,048 / 32; the shared memory 164 KiB on sm_80, 228 KiB on sm_90)."""

    shared: int
    regs: int = 65536
    threads: int = 2048
    ctas: int = 32


def ctas_per_sm(sm: SMLimits, regs: int, shared: int, warps: int) -> int:
    """CTAs of ``warps`` warps one SM holds at ``regs`` registers a thread and ``shared`` bytes a CTA (registers
    allocated 256 a warp, shared memory with :data:`RESERVED_SHARED` a CTA); 0 when one does not fit."""
    warp_regs = max(1, math.ceil(regs * 32 / 256)) * 256
    by_regs = (sm.regs // warp_regs) // warps
    by_smem = sm.shared // (shared + RESERVED_SHARED)
    return max(0, min(by_regs, by_smem, sm.threads // (32 * warps), sm.ctas))


def occupancy(sm: SMLimits, used: tuple[int, int] | None, warps: int) -> int:
    """CTAs per SM a launch's waves count: :func:`ctas_per_sm` of ``used`` (registers a thread, shared bytes a CTA),
    1 where ``used`` is unknown (None) or nothing fits (the launch itself then fails with Triton's
    ``OutOfResources``)."""
    return max(1, ctas_per_sm(sm, *used, warps)) if used is not None else 1


def resources(compiled: Any) -> tuple[int, int] | None:
    """(registers a thread, shared bytes a CTA) of a Triton ``CompiledKernel`` (what ``kernel.warmup(...)`` and a
    launch return), None where this Triton names them otherwise.

    Triton 3.6 and 3.8 alike keep the shared memory in ``metadata.shared`` and learn the registers only when the
    binary is loaded on the device (``_init_handles``, which sets ``n_regs``; a launch does it too). Loading may raise
    ``OutOfResources``, as the launch would: it is not caught here."""
    if hasattr(compiled, "result"):  # an asynchronous compile's future
        compiled = compiled.result()
    if getattr(compiled, "n_regs", None) is None and callable(getattr(compiled, "_init_handles", None)):
        compiled._init_handles()
    regs = getattr(compiled, "n_regs", None)
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    if isinstance(regs, bool) or isinstance(shared, bool) or not isinstance(regs, int) or not isinstance(shared, int):
        return None
    return regs, shared


#: resident CTAs per SM by compute capability (CUDA C++ Programming Guide, "Technical Specifications per Compute
#: Capability"); 16, the least of any since sm_50, for one not listed (it binds only below 4 warps a CTA)
_MAX_CTAS = {(7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 7): 16, (8, 9): 24, (9, 0): 32, (10, 0): 32}


def device_limits(props: Any) -> SMLimits:
    """:class:`SMLimits` of a CUDA device from ``torch.cuda.get_device_properties`` (the register file where torch
    does not report it: 65,536, every architecture's since sm_50)."""
    return SMLimits(
        shared=int(props.shared_memory_per_multiprocessor),
        regs=int(getattr(props, "regs_per_multiprocessor", 65536)),
        threads=int(props.max_threads_per_multi_processor),
        ctas=_MAX_CTAS.get((props.major, props.minor), 16),
    )

"""Every Triton kernel of the project, as the variants its launchers can compile.

The CPU interpreter accepts kernels a real compile rejects (shared memory beyond the chip's limit,
register spills, shapes ``tl.dot`` refuses), so each module that defines Triton kernels lists, in a
``compile_variants()`` function, every (autotune config × constexpr combination) its launchers can
pass. The offline compile tests build each one for real GPU architectures with the ptxas that ships
with Triton, no GPU needed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: modules defining Triton kernels; each exposes ``compile_variants() -> list[KernelVariant]``
KERNEL_MODULES = (
    "dmltrain.distributed.softmax_kernels",
    "dmltrain.evaluate.gpu_kernels",
)


@dataclass(frozen=True)
class KernelVariant:
    """One compile of one kernel: the argument types and the compile-time constants a launcher passes.

    ``name`` says which kernel, flags and tile this is (it names the test case); ``signature`` maps
    each argument to its Triton type (``"*fp32"``, ``"i32"``, ``"constexpr"``); ``constexprs`` holds
    the constexpr values, tile sizes included. ``spills_allowed`` is for a variant whose design
    accepts register spills; the module says why where it sets it.
    """

    name: str
    fn: Callable[..., Any]
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    spills_allowed: bool = False


def all_variants() -> list[KernelVariant]:
    """Every variant of every kernel module (imports Triton)."""
    out: list[KernelVariant] = []
    for name in KERNEL_MODULES:
        out.extend(importlib.import_module(name).compile_variants())
    return out

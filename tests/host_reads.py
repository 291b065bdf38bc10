"""Catch, on the CPU, the reads that would make a CUDA step wait for the device.

``no_host_reads()`` makes every Python-level way of bringing a tensor's value to the host raise
while it is active: ``item``, ``tolist``, ``numpy``, ``bool``/``int``/``float``/``index`` of a
tensor, ``nonzero`` and ``unique`` (their output size depends on the values), and indexing by a
boolean mask (a hidden ``nonzero``). On a GPU each of those is a device synchronisation; here they
are caught even though a CPU tensor costs nothing to read. Shapes, dtypes and ``numel`` stay free.
"""

from __future__ import annotations

import contextlib

import torch


class HostRead(AssertionError):
    pass


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise HostRead(f"{name} reads a device value on the host")

    return refuse


def _masked(original, name: str):
    def index(self, idx, *rest):
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
            raise HostRead(f"{name} with a boolean mask reads a device value on the host")
        return original(self, idx, *rest)

    return index


@contextlib.contextmanager
def no_host_reads():
    patches = {
        (torch.Tensor, m): _refuse(f"Tensor.{m}")
        for m in ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")
    }
    patches[(torch, "nonzero")] = _refuse("torch.nonzero")
    patches[(torch, "unique")] = _refuse("torch.unique")
    patches[(torch, "masked_select")] = _refuse("torch.masked_select")
    patches[(torch.Tensor, "__getitem__")] = _masked(torch.Tensor.__getitem__, "indexing")
    patches[(torch.Tensor, "__setitem__")] = _masked(torch.Tensor.__setitem__, "index assignment")
    saved = {key: getattr(*key) for key in patches}
    try:
        for (owner, name), fn in patches.items():
            setattr(owner, name, fn)
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)

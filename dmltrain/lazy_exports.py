"""Packages whose public names are imported on first use (``dmltrain eval --help`` stays fast)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module-level ``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps a public name to
    the submodule defining it. A name is imported on first access and cached in the package;
    an unknown name raises :class:`AttributeError` as for any module."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        pkg = importlib.import_module(package)
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(pkg, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__

"""A griffe extension for the API pages: the code's docstrings are written with reST roles
(``:class:`~dmltrain.errors.UserError```, ``:func:`load_config```), which Markdown would show as they are.

Each role becomes a code span of its target (``~`` keeps the last dotted part, as Sphinx does); the double
backticks of reST literals are already Markdown code spans. Targets are not made links: a role may name an object
the API pages do not render, which would be a broken cross-reference under ``mkdocs build --strict``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """``text`` with every reST role replaced by a code span of its target."""

    def span(m: re.Match[str]) -> str:
        target = m.group(2).strip()
        return f"`{target.rsplit('.', 1)[-1] if m.group(1) else target}`"

    return _ROLE.sub(span, text)


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain_roles(obj.docstring.value)

"""Raw config trees (plain dicts, before validation): YAML files, ``extends``, merging, dotted keys.

:mod:`dmltrain.config` builds the typed config from these; ``tune`` samples into them and
``submit`` lists the files a config is made of. Every error is a one-line
:class:`~dmltrain.errors.ConfigError` naming the file or the key.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from dmltrain.errors import ConfigError


def parse_yaml(text: str, source: str | Path) -> Any:
    """The YAML document ``text``; invalid YAML is ``<source>: invalid YAML at line N: <problem>``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}: invalid YAML{where}: {getattr(e, 'problem', e)}") from None


def config_files(path: str | Path, _ancestors: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """The files a config is made of, in merge order, each with its own keys (``extends`` removed).

    A file's ``extends`` (a path or a list, relative to the file) comes before the file itself,
    recursively and in the order listed; a file extended twice is listed twice (merging it again
    is what reading it twice did). Errors name the file: not found, unreadable, not UTF-8, invalid
    YAML, not a mapping, ``extends`` not a path or a list of paths, ``extends`` looping back to a
    file that extends it.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    if path.resolve() in _ancestors:
        raise ConfigError(f"{path}: 'extends' loops back to this file")
    tree = parse_yaml(read_text(path), path) or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(tree).__name__}")
    parents = tree.pop("extends", None) or []
    if isinstance(parents, str):
        parents = [parents]
    if not isinstance(parents, list) or not all(isinstance(p, str) and p for p in parents):
        raise ConfigError(f"{path}: extends: expected a config path or a list of paths, got {parents!r}")
    out: list[tuple[Path, dict[str, Any]]] = []
    for parent in parents:
        out += config_files(path.parent / parent, _ancestors + (path.resolve(),))
    return out + [(path, tree)]


def read_text(path: Path) -> str:
    """A config file's text; one line naming the file when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror or e})") from None


def read_tree(path: str | Path) -> dict[str, Any]:
    """One config file merged over the files it ``extends`` (see :func:`config_files`)."""
    merged: dict[str, Any] = {}
    for _, tree in config_files(path):
        merged = deep_merge(merged, tree)
    return merged


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base`` (both left as they are), recursively for mappings; ``top``'s None replaces a whole section."""
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to scalar values; lists and empty mappings are rendered as strings."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple, dict)):
            out[key] = str(v)
        else:
            out[key] = v
    return out


def set_dotted(tree: dict[str, Any], key: str, value: Any, *, merge: bool = False) -> None:
    """Set the dotted ``key`` of ``tree`` to ``value``, in place.

    Missing or null sections on the way are created; a value on the way (``optim.lr.x`` where
    ``optim.lr`` is a number) is a :class:`ConfigError` naming it, never overwritten. A mapping
    ``value`` replaces the section it lands on (an override ``loss.classifier.params={}`` clears
    it), or with ``merge`` is merged into it (a Tune choice that sets several keys of a section
    together, such as P×K); None always replaces.
    """
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"'{key}' is not a dotted config key")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    old = node.get(parts[-1])
    node[parts[-1]] = (
        deep_merge(old, value) if merge and isinstance(value, dict) and isinstance(old, dict) else copy.deepcopy(value)
    )


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``tree`` (copied) with ``a.b.c=value`` overrides applied (the value read as YAML, else kept as text).

    Each replaces what is there (:func:`set_dotted` without ``merge``); one naming a value as a
    section, or not of the form ``dotted.key=value``, is a :class:`ConfigError` quoting it.
    """
    tree = copy.deepcopy(tree)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': expected dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        try:
            set_dotted(tree, key, value)
        except ConfigError as e:
            raise ConfigError(f"override '{item}': {e}") from None
    return tree

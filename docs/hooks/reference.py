"""The docs' reference pages, generated at build time from the code (a MkDocs hook, ``hooks:`` in mkdocs.yml).

``reference/config.md`` walks the run config's pydantic models (:class:`dmltrain.config.Config`): every key with its
type, default, bounds and description, and the loss kinds with their parameters from the loss registry.
``reference/cli.md`` walks the parsers ``dmltrain`` builds (:func:`dmltrain.cli.build_parser`, one command at a
time, nothing run): every command, subcommand, argument and flag. Nothing here is committed as Markdown, so a key
added to ``dmltrain/config.py`` or a flag added to a command is in the next build without anyone writing it.
``tests/test_docs.py`` builds the same Markdown with these functions and checks that nothing is missing.

The hook also checks the hand-written pages: a config key they name in a code span (```train.ema_decay```) that
the schema lacks is a warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HOOKS = Path(__file__).resolve().parent
REPO = HOOKS.parents[1]
# the checkout the docs are built from, ahead of any installed copy: the reference describes this code
for folder in (HOOKS, REPO):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from pydantic import BaseModel  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402
from rst_roles import plain_roles  # noqa: E402

from dmltrain.text import md_code  # noqa: E402

log = logging.getLogger("mkdocs.hooks.reference")

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


_CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")
_EMPHASIS = re.compile(r"\*|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def prose(text: Any) -> str:
    """The code's own text (a description, a docstring, a help line) as Markdown on one line, for a table cell:
    reST roles as code spans, ``|`` escaped, ``& < >`` as entities and ``*`` or a word's outer ``_`` escaped outside
    code spans (so ``<run>`` shows and nothing turns into emphasis)."""
    parts = _CODE_SPAN.split(" ".join(plain_roles(str(text)).split()))
    for i in range(0, len(parts), 2):  # outside code spans
        s = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        parts[i] = _EMPHASIS.sub(lambda m: "\\" + m.group(0), s)
    return "".join(parts).replace("|", "\\|")


# -- the run config ----------------------------------------------------------------------------
def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section class an annotation holds (``X`` or ``X | None``), else None."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def config_sections() -> Iterator[tuple[str, type[BaseModel]]]:
    """``(dotted prefix, section class)`` for every section of the run config, depth first in schema order."""
    from dmltrain.config import Config

    def walk(prefix: str, model: type[BaseModel]) -> Iterator[tuple[str, type[BaseModel]]]:
        yield prefix, model
        for name, field in model.model_fields.items():
            sub = _section_model(field.annotation)
            if sub is not None:
                yield from walk(f"{prefix}.{name}" if prefix else name, sub)

    yield from walk("", Config)


def config_keys() -> list[str]:
    """Every dotted key of the run config, sections included (``data``, ``data.remote``, ``data.remote.retries``)."""
    return [
        f"{prefix}.{name}" if prefix else name for prefix, model in config_sections() for name in model.model_fields
    ]


def type_text(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML: ``int``, ``float | null``, ``uniform | hard``, ``[float, float]``."""
    if annotation is type(None):
        return "null"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in args)
    if origin in (list, tuple) and args:
        if origin is tuple and Ellipsis not in args:
            return "[" + ", ".join(type_text(a) for a in args) + "]"
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"mapping of {type_text(args[1])}" if args else "mapping"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: Any) -> str:
    """A field's default as YAML would spell it (``null``, ``true``, ``[1, 2, 4, 8]``); empty for a section."""
    if field.default is not PydanticUndefined:
        value = field.default
    elif field.default_factory is not None:
        value = field.default_factory()
    else:
        return "required"
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:g}" if abs(value) >= 1e6 else f"{value:.1f}"
    return json.dumps(value, ensure_ascii=False, default=str)


_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def bounds_text(field: Any) -> str:
    """A field's constraints: ``≥ 0, < 1``, ``length ≤ 200``, ``pattern `^[A-Za-z0-9]...` ``; empty when none."""
    parts = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:g}" if isinstance(value, float | int) else f"{sign} {value}")
        if getattr(meta, "max_length", None) is not None:
            parts.append(f"length ≤ {meta.max_length}")
        if getattr(meta, "pattern", None) is not None:
            parts.append(f"pattern `{meta.pattern}`")
    return ", ".join(parts)


def _anchor(kind: str, name: str) -> str:
    """A heading's id: ``config-data-augment-color-jitter``, ``cli-dmltrain-index-build``."""
    return kind + "-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _doc(model: type[BaseModel]) -> str:
    """A section class's own docstring (not an inherited one), as a paragraph."""
    doc = model.__dict__.get("__doc__")
    return inspect.cleandoc(doc) if doc else ""


def config_markdown() -> str:
    """The config reference page: one table per section, a row per key, then the loss kinds and their parameters."""
    out = [
        "# Configuration keys",
        "",
        "Generated from the schema in `dmltrain/config.py` and `shards/config.py` when the site is built: every key,"
        " its type, default, bounds and description. `dmltrain config show CONFIG [key=value ...]` prints a"
        " resolved config with every key; [Configs](../how-to/training.md#configs) says how files, `extends` and"
        " overrides combine. A key that is a section (a table of its own below) has no default of its own.",
        "",
    ]
    for prefix, model in config_sections():
        if not prefix:
            continue
        depth = prefix.count(".")
        out += ["", f"{'#' * (2 + min(depth, 2))} `{prefix}` {{#{_anchor('config', prefix)}}}", ""]
        if _doc(model):
            out += [prose(_doc(model)), ""]
        out += ["| key | type | default | bounds | description |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}"
            sub = _section_model(field.annotation)
            kind = type_text(field.annotation)
            if sub is not None:
                optional = " or null" if type(None) in typing.get_args(field.annotation) else ""
                kind = f"[section](#{_anchor('config', key)}){optional}"
            else:
                kind = md_code(kind)
            description = prose(field.description) if field.description else ""
            out.append(
                f"| {md_code(key)} | {kind} | {md_code(default_text(field)) if default_text(field) else ''} |"
                f" {prose(bounds_text(field))} |"
                f" {description} |"
            )
    out += ["", *loss_kinds_markdown()]
    return "\n".join(out) + "\n"


def loss_kinds_markdown() -> list[str]:
    """``loss.classifier.kind`` and ``loss.instance.kind``: each name with the parameters ``params`` takes."""
    from dmltrain.losses.kinds import KINDS
    from dmltrain.losses.registry import accepted_params, loss_class, loss_names

    out = [
        "## Loss kinds and their `params` {#config-loss-kinds}",
        "",
        "`loss.classifier.kind` and its `loss.classifier.params` (from `dmltrain/losses/kinds.py`):",
        "",
        "| kind | params: default (bounds) | normalized |",
        "|---|---|---|",
    ]
    for kind in KINDS.values():
        params = ", ".join(f"`{p.name}`: {p.default:g} ({p.bound_text()})" for p in kind.params)
        out.append(f"| `{kind.name}` | {prose(params)} | {'yes' if kind.normalized else 'no (a linear layer)'} |")
    out += [
        "",
        "`loss.instance.kind` and its `loss.instance.params` (the loss registry, `dmltrain/losses/`; the defaults are"
        " the constructor's):",
        "",
        "| kind | params: default | what it is |",
        "|---|---|---|",
    ]
    for name in loss_names():
        cls = loss_class(name)
        signature = inspect.signature(cls.__init__).parameters
        params = []
        for p in accepted_params(name):
            default = signature[p].default if p in signature else inspect.Parameter.empty
            params.append(f"`{p}`" + ("" if default is inspect.Parameter.empty else f": {default!r}"))
        summary = (inspect.getdoc(cls) or "").split("\n\n")[0]
        out.append(f"| `{name}` | {prose(', '.join(params))} | {prose(summary)} |")
    return out


# -- the command line --------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """``(command line, parser)`` of every command and subcommand, as ``dmltrain`` builds them.

    :func:`dmltrain.cli.build_parser` adds a command's arguments only when it is the chosen one (so that
    ``dmltrain --help`` imports nothing), so each command's parser comes from a build that chose it."""
    from dmltrain.cli import COMMANDS, build_parser

    found: list[tuple[str, argparse.ArgumentParser]] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found.append((name, parser))
        for sub_name, sub in _subparsers(parser).items():
            walk(f"{name} {sub_name}", sub)

    for command in COMMANDS:
        walk(f"dmltrain {command}", _subparsers(build_parser([command]))[command])
    # parsers built when their command runs: each benchmark's options, and `make gpu-check`'s
    from dmltrain import gpu_check
    from dmltrain.bench import BENCHES, bench_parser

    at = next(i for i, (name, _) in enumerate(found) if name == "dmltrain bench") + 1
    found[at:at] = [(f"dmltrain bench {name}", bench_parser(name)) for name in BENCHES]
    check = argparse.ArgumentParser(prog="python -m dmltrain.gpu_check", description=gpu_check.__doc__.split("\n\n")[0])
    gpu_check.add_arguments(check)
    found.append(("python -m dmltrain.gpu_check", check))
    return found


def _help(action: argparse.Action, prog: str) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    values = {**vars(action), "prog": prog}
    for key in ("choices",):
        if values.get(key) is not None:
            values[key] = ", ".join(map(str, values[key]))
    try:
        return action.help % values
    except (KeyError, TypeError, ValueError):
        return action.help


def _argument(action: argparse.Action) -> str:
    """What follows an option: its metavar or choices (``{onnx,pt2}``), empty for a flag."""
    if action.nargs == 0:
        return ""
    if action.choices is not None and action.metavar is None:
        return "{" + ",".join(map(str, action.choices)) + "}"
    metavar = action.metavar or (action.dest.upper() if action.option_strings else action.dest)
    metavar = " ".join(metavar) if isinstance(metavar, tuple) else metavar
    return {"?": f"[{metavar}]", "*": f"[{metavar} ...]", "+": f"{metavar} [...]"}.get(action.nargs, metavar)


def _default(action: argparse.Action) -> str:
    value = action.default
    if value in (None, argparse.SUPPRESS, False) or action.nargs == 0 or value == []:
        return ""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return str(value)


def cli_markdown() -> str:
    """The command-line reference page: a section per command and subcommand, a row per argument and option."""
    import dmltrain.cli as cli

    out = [
        "# Command line",
        "",
        "Generated from the parsers of `dmltrain` when the site is built (`dmltrain/cli.py` and each command's"
        " `add_arguments`): every command, subcommand, argument and option, as `dmltrain COMMAND --help` prints them.",
        "",
        '!!! note "Every command"',
        "",
        *("    " + line for line in plain_roles(inspect.cleandoc(cli.__doc__)).splitlines()),
        "",
    ]
    for name, parser in command_parsers():
        depth = name.count(" ") if name.startswith("dmltrain ") else 1  # `python -m ...` is a command of its own
        out += ["", f"{'#' * (1 + min(depth, 3))} `{name}` {{#{_anchor('cli', name)}}}", ""]
        if parser.description and parser.formatter_class is argparse.RawDescriptionHelpFormatter:
            out += ["```text", parser.description.strip(), "```", ""]
        elif parser.description:
            out += [prose(parser.description), ""]
        # argparse's own usage line, wrapped at a fixed width (its default follows the terminal)
        formatter = parser.formatter_class(prog=parser.prog, width=100)
        formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
        out += ["```text", formatter.format_help().strip(), "```", ""]
        subs = _subparsers(parser)
        rows = []
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in subs.items():
                    rows.append(
                        (
                            f"[`{sub_name}`](#{_anchor('cli', f'{name} {sub_name}')})",
                            "",
                            "",
                            prose(sub.description or ""),
                        )
                    )
                continue
            if action.option_strings:
                flags = ", ".join(md_code(s) for s in action.option_strings)
                argument = md_code(_argument(action)) if _argument(action) else ""
            else:  # a positional: its name, and how many it takes
                flags = md_code(action.metavar or action.dest)
                argument = {"?": "optional", "*": "any number", "+": "one or more"}.get(action.nargs, "")
            default = md_code(_default(action)) if _default(action) else ""
            rows.append((flags, argument, default, prose(_help(action, parser.prog))))
        if rows:
            out += ["| argument or option | value | default | meaning |", "|---|---|---|---|"]
            out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out) + "\n"


# -- hand-written pages: config keys they name must exist -------------------------------------------
_KEY_SPAN = re.compile(r"`((?:data|model|loss|optim|schedule|train|eval|tracking|cluster)\.[a-z_][a-z0-9_.]*)")
_NOT_KEYS = re.compile(r"\.(pt|pth|py|yaml|json|md|csv|png|db|sh|onnx|bin|safetensors)$|\.$")  # files, prefixes


def unknown_keys(markdown: str, keys: set[str]) -> list[str]:
    """The config keys a page names in code spans (```train.ema_decay```, ```data.shards=...```) that ``keys``
    lacks; file names such as ```model.pt```, prefixes ending in a dot and the keys of earlier versions that a
    config refuses with their new name (``shards.config.MOVED_DATA_KEYS``) are not reported."""
    from shards.config import MOVED_DATA_KEYS

    keys = keys | {f"data.{old}" for old in MOVED_DATA_KEYS}
    found = []
    for match in _KEY_SPAN.finditer(markdown):
        key = match.group(1)
        if _NOT_KEYS.search(key) or key in keys:
            continue
        # a key of a mapping (loss.classifier.params.temperature, data.storage_options.anon) is free-form below it
        if not any(key.startswith(k + ".") and _is_mapping(k) for k in keys):
            found.append(key)
    return found


def _is_mapping(key: str) -> bool:
    return key in _mapping_keys()


def _mapping_keys() -> set[str]:
    if not hasattr(_mapping_keys, "cache"):
        _mapping_keys.cache = {
            f"{prefix}.{name}" if prefix else name
            for prefix, model in config_sections()
            for name, field in model.model_fields.items()
            if "mapping" in type_text(field.annotation)
        }
    return _mapping_keys.cache


# -- the MkDocs hook -----------------------------------------------------------------------------------
def on_files(files, config):
    """Add the generated reference pages to the site (they exist in no folder)."""
    from mkdocs.structure.files import File

    for path, make in ((CONFIG_PAGE, config_markdown), (CLI_PAGE, cli_markdown)):
        files.append(File.generated(config, path, content=make()))
    return files


def on_page_markdown(markdown, page, config, files):
    """Warn (an error under ``--strict``) for a config key a hand-written page names that the schema lacks."""
    if page.file.src_uri in (CONFIG_PAGE, CLI_PAGE):
        return markdown
    keys = set(config_keys())
    for key in sorted(set(unknown_keys(markdown, keys))):
        log.warning(f"{page.file.src_uri}: names config key `{key}`, which dmltrain/config.py does not have")
    return markdown

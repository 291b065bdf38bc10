"""The ``dmltrain`` command.

Each subcommand lives in the module that owns its work and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; :data:`COMMANDS` names, for each, the function that
imports that module. Only the chosen subcommand's module is imported, so ``dmltrain --help`` and
``dmltrain config show`` stay fast. A
:class:`~dmltrain.errors.UserError` anywhere becomes one line on stderr and its exit code; so
does an ``OSError`` (a folder that cannot be written, a disk that filled up), naming the path,
with exit code 1. Both lines are redacted (:func:`dmltrain.redact.redact_url`): a URL's password
never reaches the terminal; and they are one line of visible text (:func:`dmltrain.text.printable`): a label, a
path or a manifest field quoted in them brings no control character (an ANSI escape, a carriage return) along.
Dotted overrides may also follow a command's options (``dmltrain train cfg.yaml --no-progress optim.lr=0.1``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from dmltrain.errors import UserError
from dmltrain.redact import redact_url
from dmltrain.text import printable


# -- the commands ---------------------------------------------------------------------------------
# Each is a function that imports the module owning the command and returns it: lazily (only the chosen
# command's module is loaded), yet followable: a reader, or an editor's "go to definition", goes from the
# command's name to its code.
def _shards() -> ModuleType:
    from shards import cli

    return cli


def _train() -> ModuleType:
    from cluster import launch

    return launch


def _eval() -> ModuleType:
    from dmltrain.evaluate import cli

    return cli


def _submit() -> ModuleType:
    from cluster import submit

    return submit


def _cluster() -> ModuleType:
    from cluster import local

    return local


def _tune() -> ModuleType:
    from cluster.tune import cli

    return cli


def _study() -> ModuleType:
    from cluster import study

    return study


def _report() -> ModuleType:
    from dmltrain.report import cli

    return cli


def _export() -> ModuleType:
    from dmltrain.models import cli

    return cli


def _embed() -> ModuleType:
    from dmltrain.evaluate import embed_cli

    return embed_cli


def _index() -> ModuleType:
    from dmltrain.evaluate import index_cli

    return index_cli


def _noisy_labels() -> ModuleType:
    from dmltrain.evaluate import noisy_labels

    return noisy_labels


def _bench() -> ModuleType:
    from dmltrain import bench

    return bench


def _doctor() -> ModuleType:
    from dmltrain import doctor

    return doctor


def _config() -> ModuleType:
    return sys.modules[__name__]


# name -> (the function that imports its module, one-line help)
COMMANDS: dict[str, tuple[Callable[[], ModuleType], str]] = {
    "shards": (_shards, "build WebDataset shards from a dataset layout, or inspect and verify them"),
    "train": (_train, "train on Ray: DeepSpeed workers, sharded classifier, MLflow logging"),
    "eval": (_eval, "evaluate a checkpoint or saved embeddings: Recall@K, NMI, MAP@R"),
    "submit": (_submit, "submit a training to a Ray cluster as a Ray Job; follow, query or stop it"),
    "cluster": (_cluster, "start or stop a local multi-node Ray cluster on loopback (a head and N worker nodes)"),
    "tune": (_tune, "search hyperparameters with Ray Tune (ASHA), trials logged as MLflow child runs"),
    "study": (_study, "run class-subsampling scalability studies (accuracy, speed, memory vs ratio)"),
    "report": (_report, "compare MLflow runs in a Markdown and HTML report"),
    "export": (
        _export,
        "export a trained model as ONNX, TorchScript or pt2 with its preprocessing contract, checked against PyTorch",
    ),
    "embed": (_embed, "embed a gallery (shards, a table or a folder of images), resumably"),
    "index": (_index, "build, evaluate and query a faiss index of embeddings"),
    "noisy-labels": (
        _noisy_labels,
        "list the train samples a sub-center model puts far from their class, to rebuild shards without them",
    ),
    "bench": (_bench, "benchmarks: input pipeline, losses, sharded classifier, evaluation"),
    "doctor": (_doctor, "what this node can and cannot do: CUDA, GPUs, NCCL, Triton, nvJPEG, Ray, MLflow, faiss"),
    "config": (_config, "show the resolved configuration (YAML file + dotted overrides)"),
}


# -- `dmltrain config` -------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = sub.add_parser(
        "show", help="print the resolved config as YAML", description="Print the resolved config as YAML."
    )
    show.add_argument("config", nargs="?", help="YAML config (default: the embedded defaults)")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=0.01 loss.instance.kind=ice")


def run(args: argparse.Namespace) -> int:
    from dmltrain.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # `dmltrain config show optim.lr=1`: defaults + overrides
        config, overrides = None, [config, *overrides]
    print(load_config(config, overrides).to_yaml(), end="")  # redacted: secrets are not shown
    return 0


# -- entry point --------------------------------------------------------------------------------
def _chosen_command(argv: Sequence[str]) -> str | None:
    for token in argv:
        if not token.startswith("-"):
            return token if token in COMMANDS else None
    return None


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dmltrain",
        description="Distributed deep metric learning with huge label spaces (Ray + DeepSpeed + WebDataset + MLflow).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen_command(argv)
    for name, (command, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        if name == chosen:
            command().add_arguments(p)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The parsed command line; ``key=value`` words after a command's options join its ``overrides``."""
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or not all("=" in x and not x.startswith("-") for x in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def os_error_line(e: OSError) -> str:
    """``<path>: <reason>`` for an OSError (both paths of a failed rename or copy)."""
    reason = e.strerror or str(e) or type(e).__name__
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {reason}" if paths else reason


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse(argv)
        return int(COMMANDS[args.command][0]().run(args) or 0)
    except UserError as e:
        print(f"dmltrain: error: {printable(redact_url(str(e)), None)}", file=sys.stderr)
        return e.exit_code
    except OSError as e:
        print(f"dmltrain: error: {printable(redact_url(os_error_line(e)), None)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dmltrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

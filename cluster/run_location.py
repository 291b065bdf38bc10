"""Where a config's runs live: one rule for ``train``, ``tune``, ``study`` and ``submit``.

A config's runs go under one *runs root*, ``cluster.storage_path`` or else ``train.output_dir``:
a local (or shared) folder, or a URL (``s3://...``; any ``scheme://`` string, ``file://`` included,
is a URL and never a path: :func:`shards.storage.location.is_url`). A run, a search or a study
is the folder ``<root>/<name>`` in it; what only a file system can hold (the driver's record,
the checks before a start, a search's tables) needs a local root, and for a URL root a search's
or a study's tables go to ``./runs/<name>`` instead. Runs are tracked in the config's MLflow
store (``tracking.uri``, by default ``mlflow.db`` in the working directory).

This module is the only place that tells a URL from a path for these locations (and for the
tracking URI); everything else asks a :class:`RunLocation`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmltrain.config import RUN_NAME_PATTERN
from dmltrain.errors import UserError
from dmltrain.fileio import check_output_dir
from dmltrain.text import printable
from shards.storage.location import is_url


def check_name(name: str, flag: str, kind: str = "run") -> str:
    """``name`` when it names one folder of the runs root (:data:`~dmltrain.config.RUN_NAME_PATTERN`, as
    ``train.run_name``: no separator, no ``..``, no leading dot); else one line, ``<flag> <name>: not a <kind> name``."""
    if not isinstance(name, str) or not re.match(RUN_NAME_PATTERN, name) or len(name) > 200:
        raise UserError(f"{flag} {printable(name, 80)}: not a {kind} name (letters, digits, _ . -)")
    return name


@dataclass(frozen=True)
class RunLocation:
    """The runs root of a config (see the module doc) and its MLflow store."""

    configured: str  # the root as the config gives it (a relative path stays relative)
    key: str  # the config key it comes from
    tracking_uri: str  # the MLflow store (the default filled in as an absolute SQLite path)

    @classmethod
    def of(cls, cfg: Any) -> RunLocation:
        key = "cluster.storage_path" if cfg.cluster.storage_path else "train.output_dir"
        raw = cfg.cluster.storage_path or cfg.train.output_dir
        return cls(raw, key, cfg.tracking.resolved_uri())

    @property
    def remote(self) -> bool:
        """A URL root: no records, no local checks."""
        return is_url(self.configured)

    @property
    def root(self) -> str:
        """The root as Ray Train storage takes it: a URL as given, a path made absolute (workers change directory)."""
        if self.remote:
            return self.configured.rstrip("/")
        return str(Path(self.configured).expanduser().resolve())

    @property
    def folder(self) -> Path | None:
        """The root as a local folder; None for a URL."""
        return None if self.remote else Path(self.root)

    def run(self, name: str) -> str:
        """``<root>/<name>``: where the run (search, study) ``name`` lives."""
        return f"{self.root}/{name}"

    def run_dir(self, name: str) -> Path | None:
        """The run's local folder; None under a URL root (records and checks need a file system)."""
        folder = self.folder
        return None if folder is None else folder / name

    def outputs(self, name: str, out: str | Path | None = None) -> Path:
        """Where a search or a study writes its tables: ``out``, else beside its runs, else ``./runs/<name>`` (URL root)."""
        if out:
            return Path(out)
        local = self.run_dir(name)
        return local if local is not None else Path.cwd() / "runs" / name

    def check_writable(self) -> None:
        """Refuse (one line naming the key) a local root that cannot be written; a URL is written through its SDK."""
        if not self.remote:
            check_output_dir(self.root, self.key)

    @property
    def relative(self) -> bool:
        """A local root given as a relative path (on a cluster: the job's temporary working directory)."""
        return not self.remote and not Path(self.configured).expanduser().is_absolute()


def tracking_opens_files(uri: str | None) -> bool:
    """A tracking URI that names files on the node that opens it (unset: ``./mlflow.db``; ``sqlite:``, ``file:``,
    a plain path); a server URL (``http://``) or ``databricks`` does not."""
    if uri is None or uri.startswith(("sqlite:", "file:")):
        return True
    return not is_url(uri) and not uri.startswith("databricks")

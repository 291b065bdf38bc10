"""What ``dmltrain submit`` uploads with a job: an allow-list of the project, checked for credentials.

The upload is built here, file by file, and sent to Ray as one zip, so the list ``--dry-run``
prints is exactly what leaves the machine. It holds, from the working directory:

* the code and recipes: ``dmltrain/``, ``shards/``, ``cluster/``, ``configs/``, ``pyproject.toml``
  and ``constraints.txt`` (those that exist);
* the config being submitted and every file it ``extends``, wherever they are in the folder;
* any ``--include PATH``.

Inside those, what a project folder accumulates but a job must not carry is left out: version
control, caches and bytecode, virtual environments (any folder holding ``pyvenv.cfg``), data and
outputs (shard tars, arrays, model weights, archives), databases (MLflow's ``mlflow.db`` and its
``-wal``/``-journal``, any ``*.sqlite``), shared objects; so is whatever ``.gitignore`` or
``.rayignore`` files (at any level) and ``--exclude`` patterns name. A file that looks like a
credential stops the submission with one line naming it (and the line, never the secret): by its name
(SSH, cloud and Ray tokens, ``.env``, ``*.pem``, ...) or by its content, every file read whole
(:mod:`cluster.credential_scan`: private keys, AWS, GCP, GitHub keys, bearer tokens, passwords in URLs
and ``.netrc`` lines, ``password``/``secret``/``token`` assignments). Move it out, ``--exclude`` it, or,
deliberately, ``--allow-file`` it.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster.credential_scan import find_secret
from dmltrain.errors import UserError

#: Top-level entries of the working directory that go with every job (when present).
ALLOWED = ("dmltrain", "shards", "cluster", "configs", "pyproject.toml", "constraints.txt")

#: gitignore-style patterns never uploaded: VCS, caches, environments, data, outputs, stores, binaries.
LEFT_OUT = tuple(
    (
        ".git/ .hg/ .svn/ __pycache__/ *.py[cod] *.egg-info/ .pytest_cache/ .mypy_cache/ "
        ".ruff_cache/ .ipynb_checkpoints/ .venv/ venv/ env/ .tox/ .nox/ node_modules/ "
        "/data/ /runs/ /mlruns/ /mlartifacts/ /bench-out/ /reports/ "
        "*.tar *.tar.* *.tgz *.zip *.npy *.npz *.pt *.pth *.ckpt *.safetensors *.bin "
        "*.db *.db-* *.sqlite *.sqlite3 *.sqlite-* *-wal *-journal *-shm "
        "*.so *.dylib *.dll"
    ).split()
)

#: gitignore-style patterns of files that look like credentials: refused, never silently sent.
CREDENTIALS = tuple(
    (
        ".ssh/ .aws/ .gnupg/ .kube/ .docker/ .azure/ gcloud/ .ray/ .mlflow/ "
        ".env .env.* !.env.example !.env.sample !.env.template "
        ".netrc _netrc .pgpass .git-credentials .npmrc .pypirc .databrickscfg auth_token "
        "credentials credentials.* *credentials*.json secrets.* *.secrets service-account*.json "
        "*.pem *.key *.p12 *.pfx *.jks *.keystore *.kdbx *.ovpn "
        "id_rsa* id_dsa* id_ecdsa* id_ed25519* kubeconfig *.kubeconfig"
    ).split()
)

_IGNORE_FILES = (".gitignore", ".rayignore")
# a fixed timestamp: the same files give the same zip, so Ray reuses an upload it already has
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _spec(lines: Iterable[str]):
    # Ray's own gitignore matcher (it packs working directories with it); vendored in Ray, so lazy
    from ray._private.thirdparty.pathspec import PathSpec

    return PathSpec.from_lines("gitwildmatch", list(lines))


@dataclass(frozen=True)
class Upload:
    """The files of a job's working directory: ``files`` are ``(path relative to root, bytes)``, sorted."""

    root: Path
    files: tuple[tuple[str, int], ...]

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)

    def describe(self) -> dict:
        """JSON-ready: where from, how many files and bytes, and each file with its size."""
        return {"from": str(self.root), "files": len(self.files), "bytes": self.total_bytes, "list": dict(self.files)}

    def summary(self) -> str:
        return f"{len(self.files)} files, {self.total_bytes / 2**20:.2f} MiB from {self.root}"

    def write_zip(self, path: Path) -> Path:
        """The files as a zip Ray unpacks as the job's working directory (paths relative to it)."""
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for rel, _ in self.files:
                info = zipfile.ZipInfo(rel, _ZIP_TIME)
                info.external_attr = (0o644 if not os.access(self.root / rel, os.X_OK) else 0o755) << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(info, (self.root / rel).read_bytes())
        return path


class _Rules:
    """Left-out and credential patterns, plus the ignore files met on the way down (each relative to its folder)."""

    def __init__(self, root: Path, excludes: Iterable[str]):
        self.root = root
        self.left_out = _spec([*LEFT_OUT, *excludes])
        self.credentials = _spec(CREDENTIALS)
        self._ignores: dict[str, list] = {}

    def _ignore_specs(self, rel_dir: str) -> list:
        if rel_dir not in self._ignores:
            specs = []
            for name in _IGNORE_FILES:
                f = self.root / rel_dir / name
                if f.is_file():
                    try:
                        specs.append(_spec(f.read_text(errors="replace").splitlines()))
                    except OSError as e:
                        raise UserError(f"{f}: cannot read it ({e.strerror or e})") from None
            self._ignores[rel_dir] = specs
        return self._ignores[rel_dir]

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Left out by the built-in list, --exclude, or a .gitignore/.rayignore of any folder above it."""
        key = rel + "/" if is_dir else rel
        if self.left_out.match_file(key):
            return True
        parts = rel.split("/")
        for depth in range(len(parts)):
            base = "/".join(parts[:depth])
            sub = "/".join(parts[depth:]) + ("/" if is_dir else "")
            if any(spec.match_file(sub) for spec in self._ignore_specs(base)):
                return True
        return False

    def credential(self, rel: str, path: Path) -> str | None:
        """Why ``rel`` looks like a credential (its name, or a line of its content), or None."""
        parts = rel.split("/")
        for i in range(len(parts)):  # the file's name, or a folder it sits in (.ssh/, .aws/ ...)
            sub = "/".join(parts[i:])
            if self.credentials.match_file(sub) or any(self.credentials.match_file(d + "/") for d in parts[i:-1]):
                return "its name is that of a credential file"
        try:
            found = find_secret(path)
        except OSError as e:
            raise UserError(f"{path}: cannot read it ({e.strerror or e})") from None
        if found is not None:
            return f"line {found.line} looks like a secret ({found.what})"
        return None


def _walk(root: Path, start: Path, rules: _Rules) -> Iterator[Path]:
    """Files under ``start`` (a file or folder inside ``root``) that the rules keep; links are not followed."""
    rel = start.relative_to(root).as_posix()
    if start.is_symlink():
        _check_link(root, start)
        if start.is_dir():
            return
    if start.is_file():
        if not rules.ignored(rel, is_dir=False):
            yield start
        return
    if not start.is_dir() or (rel != "." and rules.ignored(rel, is_dir=True)) or (start / "pyvenv.cfg").exists():
        return
    for child in sorted(start.iterdir()):
        yield from _walk(root, child, rules)


def _check_link(root: Path, link: Path) -> None:
    target = link.resolve()
    if target != root and root not in target.parents:
        raise UserError(
            f"{link}: a link to {target}, outside the working directory {root}; "
            "the upload does not follow it (copy what the job needs into the folder, or --exclude it)"
        )


def plan_upload(
    root: Path,
    config_files: Iterable[Path],
    includes: Iterable[str] = (),
    excludes: Iterable[str] = (),
    allow_files: Iterable[str] = (),
) -> Upload:
    """The allow-listed files of ``root`` plus ``config_files`` and ``includes``; :class:`UserError` for a credential.

    ``config_files`` must lie inside ``root`` and must not be left out by the rules (the job could not
    start without them); ``includes`` are paths relative to ``root`` (or absolute, inside it).
    ``allow_files`` (``--allow-file``) are files of the upload that look like credentials and go anyway:
    the user's deliberate exception, one file at a time; one that is not in the upload is an error.
    """
    root = root.resolve()
    rules = _Rules(root, list(excludes))
    chosen: dict[str, Path] = {}
    starts = [root / name for name in ALLOWED if (root / name).exists() or (root / name).is_symlink()]
    for item in includes:
        p = Path(os.path.normpath(root / Path(item).expanduser()))  # an absolute item replaces root here
        if p != root and root not in p.parents:
            raise UserError(f"--include {item}: outside the working directory {root}")
        if not (p.exists() or p.is_symlink()):
            raise UserError(f"--include {item}: no such file or folder")
        starts.append(p)
    for start in starts:
        for f in _walk(root, start, rules):
            chosen[f.relative_to(root).as_posix()] = f
    for cf in config_files:
        try:
            rel = cf.resolve().relative_to(root).as_posix()
        except ValueError:
            raise UserError(
                f"{cf}: outside the working directory {root} that is uploaded with the job; "
                "move it there or pass --working-dir"
            ) from None
        if rules.ignored(rel, is_dir=False):
            raise UserError(
                f"{cf}: excluded from the upload (by the built-in list, a .gitignore/.rayignore or --exclude); "
                "move it or change --exclude"
            )
        chosen[rel] = root / rel
    allowed = set()
    for item in allow_files:
        p = Path(os.path.normpath(root / Path(item).expanduser()))
        rel = p.relative_to(root).as_posix() if root in p.parents else None
        if rel not in chosen:
            raise UserError(f"--allow-file {item}: not a file of the upload (see the list of --dry-run)")
        allowed.add(rel)
    for rel, path in sorted(chosen.items()):
        why = None if rel in allowed else rules.credential(rel, path)
        if why:
            raise UserError(
                f"{path}: would be uploaded with the job, but {why}; move it out of the upload, "
                f"leave it out with --exclude '{rel}', or send it anyway with --allow-file '{rel}'"
            )
    return Upload(root, tuple((rel, chosen[rel].stat().st_size) for rel in sorted(chosen)))

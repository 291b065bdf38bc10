"""Where a build's shards and manifest go: a local folder, or a URL they are uploaded to as they are finished.

:class:`Publisher` owns the output of one build. :meth:`Publisher.prepare` checks the folder first
(refuses a non-empty one unless ``overwrite`` or ``resume``; ``overwrite`` removes the previous
build, only what its manifest lists, and stops before removing anything when a shard-like file no
manifest lists could be clobbered). Shards are written to :attr:`Publisher.staging` (the folder
itself when local, a temporary folder when remote); each finished shard is handed to
:meth:`Publisher.shard_done`, which uploads it in the background (fsspec uploads large files in
parts, e.g. S3 multipart) while the next one is written, at most :data:`QUEUED` waiting, and deletes
the local copy. :meth:`Publisher.finish` waits for the uploads and writes ``manifest.json`` last, so
a folder is never taken for a whole dataset before every shard is in place. ``resume`` continues an
interrupted build in the same folder: a shard already there with the same size and SHA-256 as the
one just rebuilt is kept (a remote one is hashed by ranged GETs, not uploaded again).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from dmltrain.errors import UserError
from dmltrain.fileio import write_text
from shards.build.writer import ShardRecord
from shards.manifest import MANIFEST_NAME, Manifest
from shards.storage.location import Location, read_chunks
from shards.storage.retries import IOStats

# what a build writes: <split>-NNNNNN.tar shards, and hidden temporaries while it runs (atomic_path)
SHARD_NAME = re.compile(r"[A-Za-z0-9_.]+-\d{6}\.tar")
TEMPORARY_NAME = re.compile(r"\.([A-Za-z0-9_.]+-\d{6}\.tar|manifest\.json)\..+\.tmp")
QUEUED = 2  # finished shards waiting for their upload (local disk in use: this many plus the one being written)


class Publisher:
    """The output folder of one build (see the module docstring); use :meth:`close` (or ``with``) to end it."""

    def __init__(self, out: Location, *, overwrite: bool = False, resume: bool = False):
        if overwrite and resume:
            raise UserError(
                "--overwrite and --resume: choose one (--resume continues an interrupted build, --overwrite replaces a finished one)"
            )
        if out.remote and out.protocol in ("http", "https"):
            raise UserError(
                f"{out}: http(s) URLs are read-only here; build to a local folder or object storage "
                "(s3://, gs://) and serve that folder over HTTP"
            )
        self.out, self.overwrite, self.resume = out, overwrite, resume
        self.stats = IOStats()  # uploads, and the reads that check kept shards
        self.uploaded = self.kept = 0
        self._existing: dict[str, int | None] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(QUEUED)
        self._jobs: list[Future] = []
        self._tmp: Path | None = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def staging(self) -> Path:
        """The local folder the shards are written to."""
        if not self.out.remote:
            return self.out.path
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="dmltrain-build-"))
        return self._tmp

    # -- before -----------------------------------------------------------------------------
    def prepare(self) -> None:
        """Check (and with ``overwrite`` clear) the folder; see the module docstring."""
        out = self.out
        if not out.remote and out.path.exists() and not out.path.is_dir():
            raise UserError(f"{out}: exists and is not a directory")
        try:
            present = out.listing()
        except OSError as e:
            raise UserError(f"{out}: cannot list the output folder ({e})") from None
        if present and not (self.overwrite or self.resume):
            raise UserError(
                f"{out}: directory is not empty (pass --overwrite to replace the shards in it, "
                "or --resume to finish an interrupted build)"
            )
        listed: set[str] = set()
        if MANIFEST_NAME in present:
            if self.resume:
                raise UserError(
                    f"{out.url(MANIFEST_NAME)}: the build there is complete (nothing to resume); "
                    "pass --overwrite to build it again"
                )
            try:
                old = Manifest.load(out)
            except UserError as e:
                raise UserError(
                    f"--overwrite: {e}; cannot tell which files are its shards, so nothing was removed "
                    "(remove them yourself or choose another --out)"
                ) from None
            listed = {
                sh.file
                for name in old.splits
                for sh in [*old.split(name).shards, *([old.split(name).rows] if old.split(name).rows else [])]
            }
        if self.overwrite:
            for name in sorted(present):
                if SHARD_NAME.fullmatch(name) and name not in listed:
                    why = (
                        "not listed by its manifest.json"
                        if listed
                        else "no manifest.json lists it (an interrupted build's shard, or not a shard)"
                    )
                    raise UserError(
                        f"{out.url(name)}: {why}; the new build could overwrite it, so nothing was removed "
                        "(move or remove it yourself, --resume an interrupted build, or choose another --out)"
                    )
            # the manifest goes first: from here on the folder reads as an unfinished build
            out.remove(MANIFEST_NAME)
            for name in sorted(listed & set(present)):
                out.remove(name)
        for name in present:
            if TEMPORARY_NAME.fullmatch(name) and not out.remote:
                out.remove(name)
        if not out.remote:
            out.path.mkdir(parents=True, exist_ok=True)
        self._existing = {k: v for k, v in out.listing().items() if SHARD_NAME.fullmatch(k)} if self.resume else {}

    # -- during -----------------------------------------------------------------------------
    def shard_done(self, rec: ShardRecord, path: Path) -> None:
        """A finished shard at ``path`` (in :attr:`staging`): keep it in place (local) or upload it in the background."""
        self._raise_failed()
        if not self.out.remote:
            self.uploaded += 1
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dmltrain-upload")
        self._slots.acquire()
        self._jobs.append(self._pool.submit(self._publish, rec, path))

    def _publish(self, rec: ShardRecord, path: Path) -> None:
        try:
            if self._existing.get(rec.file) == rec.bytes and self._remote_sha256(rec) == rec.sha256:
                self.kept += 1
            else:
                try:
                    self.out.upload(path, rec.file, self.stats)
                except OSError as e:
                    raise UserError(
                        f"{self.out.url(rec.file)}: upload failed ({e}); the build is incomplete and has no "
                        "manifest.json: rerun the same command with --resume to finish it"
                    ) from None
                self.uploaded += 1
        finally:
            path.unlink(missing_ok=True)
            self._slots.release()

    def _remote_sha256(self, rec: ShardRecord) -> str | None:
        h = hashlib.sha256()
        try:
            for chunk in read_chunks(self.out, rec.file, rec.bytes, self.stats):
                h.update(chunk)
        except OSError:
            return None  # unreadable: upload it again
        return h.hexdigest()

    def _raise_failed(self) -> None:
        for job in self._jobs:
            if job.done() and job.exception() is not None:
                raise job.exception()  # type: ignore[misc]

    # -- after ------------------------------------------------------------------------------
    def finish(self, manifest_text: str) -> Manifest:
        """Wait for every upload, write the manifest last, and load it back (the reader's own check)."""
        for job in self._jobs:
            job.result()
        if self.out.remote:
            try:
                self.out.write_bytes(MANIFEST_NAME, manifest_text.encode("utf-8"), self.stats)
            except OSError as e:
                raise UserError(
                    f"{self.out.url(MANIFEST_NAME)}: upload failed ({e}); every shard is in place: rerun with --resume"
                ) from None
        else:
            write_text(self.out.path / MANIFEST_NAME, manifest_text)
        return Manifest.load(self.out)

    def close(self) -> None:
        """Stop: queued uploads are cancelled (the one running finishes); the staging folder is removed."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def summary(self) -> str | None:
        """One line about the uploads, for remote outputs."""
        if not self.out.remote:
            return None
        retries = self.stats.retries
        kept = f", {self.kept} already there with the same checksum (kept)" if self.resume else ""
        return f"uploaded {self.uploaded} shards to {self.out}{kept}; {retries} retr{'y' if retries == 1 else 'ies'} after transient errors"

"""A search's Ray Tune state, authenticated: Tune unpickles it on resume, so only this user's own is read back.

Ray Tune keeps a search's state in its folder ``<root>/<name>/`` and unpickles it when the search
is resumed (Ray 2.60, ``Tuner.restore``):

============================================  ==============================================================
``tuner.pkl``                                 the Tuner (``pickle.loads``)
``experiment_state-<session>.json``           the trials and the controller: JSON with embedded cloudpickles
                                              (every trial's run metadata, config, placement), also read by
                                              ``ExperimentAnalysis``
``basic-variant-state-<session>.json``        the search algorithm's state (cloudpickle, despite the name)
``callback-states-<session>.pkl``             the callbacks' state (cloudpickle)
``<trial>/error.pkl``                         a failed trial's exception (cloudpickle), read for its result
``<trial>/params.pkl``                        a trial's config (cloudpickle), written by Tune's logger, not
                                              read on resume
============================================  ==============================================================

A file planted there (a shared storage path, a copied folder) would run its code as the user who
resumes. So Tune reads and writes the folder through :class:`SealedFileSystem`, a pyarrow file
system in front of the real one (local, or the ``s3://`` / ``gs://`` one of the URL):

* every file Ray may unpickle (:func:`is_sealed`: ``*.json`` and ``*.pkl`` directly in the search's
  folder, ``*.pkl`` below it) is *sealed* when written through it: beside it goes
  ``<file>.dmltrain-sig``, an HMAC-SHA256 of the file's path in the storage and its bytes, under
  this user's key (:func:`dmltrain.private.state_key`, ``~/.config/dmltrain/state.key``, 0600);
* every such file is *verified* when read through it: the bytes are read whole, checked against
  the tag, and only then handed to Ray (so a file swapped after the check is not the file read);
  one without a valid tag is refused (:class:`StateNotAuthentic`), before Ray unpickles anything;
* it fails closed: a ``*.json`` or ``*.pkl`` outside the storage root (``<root>/../x/tuner.pkl``) is neither read
  nor written through it. A search's name is one folder name (:func:`cluster.run_location.check_name`), so its
  files lie exactly where :func:`is_sealed` looks.

:func:`check_resumable` runs the same verification over the whole folder before Ray starts, so a
search that is not this user's own is refused in one line (``dmltrain tune --resume``). Other
files (``result.json``, ``progress.csv``, ``params.json``) are read as data only and pass through.
The key never leaves the driver: a copy of the file system sent to Ray's processes (Tune ships it
to its trial actors) holds no key (copies within the driver find it in a table of that process);
it cannot seal, and it refuses to read sealed files.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import posixpath
import secrets
import time
from dataclasses import dataclass

import pyarrow
import pyarrow.fs

from cluster.run_location import check_name
from dmltrain.errors import UserError
from dmltrain.private import state_key
from dmltrain.text import printable
from shards.storage.location import is_url

SIG_SUFFIX = ".dmltrain-sig"
TUNER_FILE = "tuner.pkl"
_DOMAIN = b"dmltrain tune state v1\0"


class StateNotAuthentic(PermissionError):
    """A sealed file without a valid tag of this user's key: never handed to Ray."""


def is_sealed(relpath: str) -> bool:
    """Whether Ray may unpickle the file at ``relpath`` (``<search>/<file>`` or deeper, relative to the root)."""
    parts = relpath.split("/")
    if len(parts) < 2 or parts[-1].endswith(SIG_SUFFIX):
        return False
    return parts[-1].endswith((".pkl", ".json")) if len(parts) == 2 else parts[-1].endswith(".pkl")


def tag(key: bytes, relpath: str, data: bytes) -> str:
    """The HMAC-SHA256 of ``data`` stored at ``relpath``: a file moved to another name or search no longer verifies."""
    return hmac.new(key, _DOMAIN + relpath.encode() + b"\0" + data, hashlib.sha256).hexdigest()


class SealedFileSystem(pyarrow.fs.FileSystemHandler):
    """A pyarrow file-system handler over ``inner`` that seals and verifies the files of :func:`is_sealed` (see the
    module doc); ``root``: the storage root (paths are named relative to it in the tags); ``key``: None in a copy."""

    def __init__(self, inner: pyarrow.fs.FileSystem, root: str, key: bytes | None):
        self.inner, self.root, self.key = inner, root.rstrip("/"), key
        self._key_id = secrets.token_hex(8)
        if key is not None:
            _KEYS[self._key_id] = key

    def __reduce__(self):
        # Ray copies the file system within this process (copy.copy of a trial's storage) and ships it to its
        # other processes: a copy finds the key by id in this process's table, which no other process holds
        return _restore, (self.inner, self.root, self._key_id)

    def __eq__(self, other) -> bool:
        return isinstance(other, SealedFileSystem) and (other.inner, other.root) == (self.inner, self.root)

    def __hash__(self) -> int:
        return hash(self.root)

    # -- sealing and verifying -----------------------------------------------------------------------------------
    def relpath(self, path: str) -> str | None:
        """``path`` relative to the root; None outside it."""
        path = posixpath.normpath(path)
        if not path.startswith(self.root + "/"):
            return None
        return path[len(self.root) + 1 :]

    def sealed(self, path: str) -> bool:
        """Whether ``path`` is read verified and written with its tag: :func:`is_sealed` inside the root, and outside
        it every name Ray may unpickle (failing closed: :meth:`_inside` then refuses it)."""
        rel = self.relpath(path)
        if rel is None:
            return path.endswith((".pkl", ".json"))
        return is_sealed(rel)

    def _inside(self, path: str) -> str:
        """The sealed file ``path`` relative to the root; :class:`StateNotAuthentic` outside it."""
        rel = self.relpath(path)
        if rel is None:
            raise StateNotAuthentic(f"{printable(path)}: outside the storage {printable(self.root)}; refused")
        return rel

    def read_verified(self, path: str) -> bytes:
        """The bytes of the sealed file ``path``, checked against its tags; :class:`StateNotAuthentic` if they are not.

        The bytes are read before the tags, and a mismatch is read again twice (0.1 s apart): a file being
        rewritten through :meth:`write_sealed` lists both tags while its bytes change."""
        rel = self._inside(path)
        for attempt in range(3):
            if attempt:
                time.sleep(0.1)
            with self.inner.open_input_stream(path) as f:
                data = f.read()
            if self.key is not None:
                expected = tag(self.key, rel, data)
                if any(hmac.compare_digest(expected.encode(), t.encode()) for t in self._tags(path)):
                    return data
        raise StateNotAuthentic(f"{printable(path)}: not written by this user's dmltrain (no valid signature)")

    def _tags(self, path: str) -> set[str]:
        try:
            with self.inner.open_input_stream(path + SIG_SUFFIX) as f:
                return set(f.read(4096).decode("ascii", "replace").split())
        except OSError:  # FileNotFoundError included: no tags
            return set()

    def write_sealed(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` with its tag beside it (no tag without the key: the file then reads as foreign).

        A reader sees the old bytes or the new ones, each with its tag listed: the new tag is added to the
        sidecar, the bytes replaced at once, then the old tag dropped (each write a whole-file replace)."""
        rel = self._inside(path)
        if self.key is None:
            self._drop_tag(path)
            self._put(path, data)
            return
        new = tag(self.key, rel, data)
        self._put(path + SIG_SUFFIX, "\n".join([new, *sorted(self._tags(path) - {new})][:2]).encode())
        self._put(path, data)
        self._put(path + SIG_SUFFIX, new.encode())

    def _put(self, path: str, data: bytes) -> None:
        """``data`` as the whole file ``path``, replaced at once: under a temporary name then renamed on a local file
        system (an object store's upload is whole-or-nothing already)."""
        if not isinstance(self.inner, pyarrow.fs.LocalFileSystem):
            with self.inner.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with self.inner.open_output_stream(tmp) as f:
            f.write(data)
        self.inner.move(tmp, path)

    def _drop_tag(self, path: str) -> None:
        try:
            self.inner.delete_file(path + SIG_SUFFIX)
        except (FileNotFoundError, OSError):
            pass

    # -- pyarrow's FileSystemHandler -------------------------------------------------------------------------------
    def get_type_name(self) -> str:
        return "dmltrain-sealed+" + self.inner.type_name

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths):
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.inner.delete_dir_contents(self.root, missing_dir_ok=True)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)
        if self.sealed(path):
            self._drop_tag(path)

    def move(self, src: str, dest: str) -> None:
        self.copy_file(src, dest)
        self.delete_file(src)

    def copy_file(self, src: str, dest: str) -> None:
        if not self.sealed(dest):
            self.inner.copy_file(src, dest)
        elif self.sealed(src):
            self.write_sealed(dest, self.read_verified(src))
        else:  # bytes nobody vouched for, under a name Ray unpickles: copied without a tag
            self.inner.copy_file(src, dest)
            self._drop_tag(dest)

    def open_input_stream(self, path: str):
        return (
            pyarrow.BufferReader(self.read_verified(path)) if self.sealed(path) else self.inner.open_input_stream(path)
        )

    def open_input_file(self, path: str):
        return pyarrow.BufferReader(self.read_verified(path)) if self.sealed(path) else self.inner.open_input_file(path)

    def open_output_stream(self, path: str, metadata=None):
        if self.sealed(path):
            self._inside(path)  # refused at once, not when closed
            return pyarrow.PythonFile(_SealOnClose(self, path), mode="w")
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata=None):
        if self.sealed(path):
            raise StateNotAuthentic(f"{printable(path)}: a sealed file is written whole, never appended to")
        return self.inner.open_append_stream(path, metadata=metadata)


_KEYS: dict[str, bytes] = {}  # this process's keys, by handler: never pickled


def _restore(inner: pyarrow.fs.FileSystem, root: str, key_id: str) -> SealedFileSystem:
    handler = SealedFileSystem(inner, root, _KEYS.get(key_id))
    handler._key_id = key_id
    return handler


class _SealOnClose(io.RawIOBase):
    """The bytes written to a sealed file, kept until close, then written with their tag (``write_sealed``)."""

    def __init__(self, fs: SealedFileSystem, path: str):
        super().__init__()
        self.fs, self.path, self.buffer = fs, path, io.BytesIO()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        return self.buffer.write(data)

    def close(self) -> None:
        if not self.closed:
            self.fs.write_sealed(self.path, self.buffer.getvalue())
        super().close()


@dataclass(frozen=True)
class SearchState:
    """The Tune state of the search ``name`` under the runs root ``root`` (a folder or a URL)."""

    root: str
    name: str

    def __post_init__(self):
        check_name(self.name, "--name", "search")

    def _inner(self) -> tuple[pyarrow.fs.FileSystem, str]:
        if is_url(self.root):
            return pyarrow.fs.FileSystem.from_uri(self.root)
        return pyarrow.fs.LocalFileSystem(), self.root

    def filesystem(self) -> tuple[pyarrow.fs.FileSystem, str]:
        """The sealing file system Tune must use (with this user's key) and the storage path on it."""
        inner, fs_root = self._inner()
        return pyarrow.fs.PyFileSystem(SealedFileSystem(inner, fs_root, state_key())), fs_root

    def exists(self) -> bool:
        """Whether the folder holds a Tune search (its ``tuner.pkl``, sealed or not)."""
        inner, fs_root = self._inner()
        info = inner.get_file_info(f"{fs_root}/{self.name}/{TUNER_FILE}")
        return info.type == pyarrow.fs.FileType.File

    def check_resumable(self) -> None:
        """Before Ray starts: the search exists and every file of it that Ray may unpickle carries a valid tag of
        this user's key; otherwise a one-line :class:`UserError` naming the file. Nothing is unpickled."""
        inner, fs_root = self._inner()
        folder = f"{fs_root}/{self.name}"
        if not self.exists():
            raise UserError(f"tune --resume: no search named {self.name} in {printable(self.root)} (no {TUNER_FILE})")
        sealer = SealedFileSystem(inner, fs_root, state_key())
        Selector = pyarrow.fs.FileSelector
        entries = inner.get_file_info(Selector(folder))
        for sub in [e for e in entries if e.type == pyarrow.fs.FileType.Directory]:
            entries += inner.get_file_info(Selector(sub.path))  # trial folders (a training's files lie deeper)
        for entry in entries:
            if entry.type == pyarrow.fs.FileType.File and sealer.sealed(entry.path):
                try:
                    sealer.read_verified(entry.path)  # refused outside the root too
                except StateNotAuthentic as e:
                    raise UserError(
                        f"tune --resume {self.name}: {e}; Ray would unpickle it (run code from it), so the search "
                        "is not resumed (docs/security.md)"
                    ) from None

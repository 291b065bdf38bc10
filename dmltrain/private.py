"""This user's private folders and files: what only their owner can enter, read or write.

Whatever dmltrain keeps for the user alone — the authentication key of the state it writes for
itself (:func:`state_key`), the local Ray's session folders and token (:mod:`cluster.ray_files`),
the native kernels' build cache — lies in a folder that is this user's, mode 0700, and is checked
to be so before it is trusted: the folder (not followed if a link) must be owned by this user and
closed to others, and so must each file read from it.

* :func:`not_private`: why a path cannot be trusted, or None;
* :func:`private_folder`: a folder created 0700 if missing, made private if it is this user's, refused
  with one line otherwise;
* :func:`config_dir`: ``$XDG_CONFIG_HOME/dmltrain`` (default ``~/.config/dmltrain``), private;
* :func:`state_key`: a random 32-byte key in it (``state.key``, 0600), made on first use.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from dmltrain.errors import UserError

KEY_FILE = "state.key"
KEY_BYTES = 32


def not_private(path: str | os.PathLike[str], *, kind: str, owners: tuple[int, ...], others: int = 0o022) -> str | None:
    """Why ``path`` (not followed if a link) cannot be trusted: missing, not a ``kind`` (``dir`` or ``file``),
    owned by none of ``owners``, or open to others by a bit of ``others`` (default: writable by group or others);
    None when it can be."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        return f"{path}: not a {'folder' if kind == 'dir' else 'regular file'} (a link or something else)"
    if st.st_uid not in owners:
        return f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    if st.st_mode & others:
        how = "writable" if st.st_mode & others & 0o022 else "readable"
        return f"{path}: {how} by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def private_folder(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a folder only this user can enter: created 0700 (parents as needed) if missing, its mode set
    to 0700 if it is this user's and open to others; a one-line :class:`UserError` naming ``what`` if it is not
    this user's folder (a link, another owner)."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    uid = os.getuid()
    problem = not_private(path, kind="dir", owners=(uid,), others=0o077)
    if problem and not_private(path, kind="dir", owners=(uid,), others=0) is None:
        os.chmod(path, 0o700)  # ours, only too open: close it
        problem = not_private(path, kind="dir", owners=(uid,), others=0o077)
    if problem:
        raise UserError(f"{what}: {problem}; it must be a folder of yours that only you can enter")
    return path


def private_file(path: str | os.PathLike[str], what: str) -> Path:
    """An existing file of this user's, its mode set to 0600 if it was open to others; a one-line
    :class:`UserError` naming ``what`` if it is not this user's regular file."""
    path = Path(path)
    uid = os.getuid()
    problem = not_private(path, kind="file", owners=(uid,), others=0)
    if problem is None and not_private(path, kind="file", owners=(uid,), others=0o077):
        os.chmod(path, 0o600)
    if problem:
        raise UserError(f"{what}: {problem}; it must be a file of yours that only you can read")
    return path


def config_dir() -> Path:
    """dmltrain's private configuration folder (``$XDG_CONFIG_HOME/dmltrain``, default ``~/.config/dmltrain``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return private_folder(Path(base) / "dmltrain", "dmltrain's configuration folder")


def state_key() -> bytes:
    """This user's key for authenticating the state dmltrain writes for itself (:data:`KEY_BYTES` random bytes in
    ``config_dir()/state.key``, created 0600 on first use); refused in one line if the file is not this user's
    alone or not a key."""
    path = config_dir() / KEY_FILE
    if not os.path.lexists(path):
        # written whole under a temporary name, then linked into place (which never replaces a key there already):
        # a start that dies half-way, or one racing another, never leaves a short key that every later run refuses
        tmp = path.with_name(f".{KEY_FILE}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    problem = not_private(path, kind="file", owners=(os.getuid(),), others=0o077)
    if problem:
        raise UserError(f"dmltrain's key: {problem}; it must be a file of yours that only you can read")
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise UserError(f"dmltrain's key: {path}: {len(key)} bytes, not {KEY_BYTES}; remove it to make a new one")
    return key

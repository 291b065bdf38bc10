"""The local Ray's files that must stay this user's: its session folders and its authentication token.

Ray keeps a local instance's session folders (logs, sockets, spilled objects, and Ray Train's and
Tune's driver staging, from which a resumed search reads its state back) under ``/tmp/ray``, and
makes each of them mode 0777; and it writes the token of its token authentication to
``~/.ray/auth_token`` with the default umask (0644, in a 0755 folder). On a shared machine
anyone could read the token (and with it drive the local Ray) or plant files in its sessions.

For the local Ray dmltrain starts (:func:`cluster.launch.start_local_ray`):

* :func:`private_temp_dir`: Ray's temporary root is ``<tmp>/dmltrain-ray-<uid>/ray`` (``<tmp>``:
  ``$RAY_TMPDIR``, else the system's), inside a folder of this user's that only they can enter (0700;
  Ray still makes its own folders 0777, but nobody else can reach them);
* :func:`private_token`: the token Ray reads (``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)
  is made here, 0600 in a 0700 ``~/.ray``, before Ray would make it; one that exists is made 0600
  (and ``~/.ray`` 0700). A token in ``$RAY_AUTH_TOKEN`` has no file; ``RAY_AUTH_MODE=disabled`` none.

Anything in the way that is not this user's (a folder or token another user owns, a link) is one line.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from dmltrain.errors import UserError
from dmltrain.private import private_file, private_folder

TOKEN_ENV, TOKEN_PATH_ENV, MODE_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"


def private_temp_dir() -> str:
    """Ray's temporary root for a local instance (``_temp_dir`` of ``ray.init``), inside a private folder."""
    base = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir())
    folder = private_folder(base / f"dmltrain-ray-{os.getuid()}", "the local Ray's session folder")
    return str(folder / "ray")  # Ray makes this one 0777 itself


def default_token_path() -> Path:
    """Where Ray reads its token from a file when ``$RAY_AUTH_TOKEN_PATH`` is unset."""
    return Path.home() / ".ray" / "auth_token"


def private_token() -> Path | None:
    """The local Ray's token file, this user's alone (see the module doc); None when there is no file to keep
    (token authentication off, or the token in ``$RAY_AUTH_TOKEN``)."""
    if os.environ.get(MODE_ENV, "").lower() == "disabled" or os.environ.get(TOKEN_ENV):
        return None
    named = os.environ.get(TOKEN_PATH_ENV)
    if named:  # the user's own choice of file: made private if it exists (Ray refuses a missing one)
        path = Path(named).expanduser()
        return private_file(path, TOKEN_PATH_ENV) if path.exists() else None
    path = default_token_path()
    private_folder(path.parent, "Ray's token folder")
    if not path.exists():
        _write_new_token(path)
    return private_file(path, "Ray's token")


def _write_new_token(path: Path) -> None:
    """A new token, as Ray would make it, written 0600 (another process may have written one meanwhile: kept)."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(generate_new_authentication_token())
    if not path.is_file():
        raise UserError(f"Ray's token: {path}: could not be created")

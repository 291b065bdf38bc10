"""Load one source image for a shard: its bytes as stored, checked to decode, or re-encoded on request.

Images are stored byte for byte (any format PIL reads; the shard member's extension names
the format: ``jpg``, ``png``, ``bmp``...). Grayscale, palette, CMYK, 16-bit and RGBA images
are converted to RGB (:func:`shards.decode.rgb.to_rgb`) at decode time, not at build time, so the stored
bytes stay the source's.
Only ``resize`` re-encodes: RGB, shorter side scaled down to ``resize`` (never up), JPEG
quality 95.

Every image is fully decoded once during the build so a truncated or corrupt file is caught
there (JPEGs at 1/8 scale through PIL's draft mode, which still reads the whole entropy
stream and so still sees a truncation); one whose header claims more than
:data:`~shards.decode.rgb.MAX_IMAGE_PIXELS` pixels is skipped before any decoding.

A source is read with a bound: at most :data:`MAX_SOURCE_BYTES` (a larger file is skipped, never read whole; a
table refuses it up front, :func:`shards.build.table.check_files`), and only from a regular file (a FIFO or a
device would hold the build or feed it without end).
"""

from __future__ import annotations

import io
import json
import os
import stat
import warnings
from collections.abc import Callable
from typing import Any

from PIL import Image

from shards.decode.rgb import ImageTooLarge, open_image, to_rgb
from shards.manifest import EXTENSIONS

RESIZE_QUALITY = 95
#: the most bytes one image source may have: far above any photo within the pixel bound (a 9,500 x 9,500 JPEG is
#: tens of MB; its uncompressed 8-bit RGB, 256 MiB), and a bound on what one build worker holds per image
MAX_SOURCE_BYTES = 256 * 2**20


def too_large(size: int) -> str:
    """Why a source of ``size`` bytes is not read (for a skip or a table's refusal)."""
    return f"{size:,} bytes, more than the {MAX_SOURCE_BYTES // 2**20} MiB an image source may have"


class SkipImage(Exception):
    """An image that cannot go into a shard; the message says why (unreadable, corrupt, not an image)."""


def extension_for(fmt: str | None) -> str:
    if not fmt:
        raise SkipImage("unknown image format")
    return EXTENSIONS.get(fmt, fmt.lower())


def check_image(data: bytes) -> tuple[str, tuple[int, int]]:
    """Decode ``data`` completely (cheaply for JPEG); return (member extension, (width, height)) or raise SkipImage."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DecompressionBombWarning, EXIF warnings: not our business here
            img = open_image(data)
            fmt, size = img.format, img.size
            if fmt == "JPEG":
                img.draft(img.mode, (max(1, size[0] // 8), max(1, size[1] // 8)))
            img.load()
            to_rgb(img)  # what every reader will do with it
    except SkipImage:
        raise
    except ImageTooLarge as e:
        raise SkipImage(str(e)) from None
    except Image.UnidentifiedImageError:
        raise SkipImage("not an image PIL can read") from None
    except Exception as e:  # noqa: BLE001 — PIL raises many types (OSError, SyntaxError, ValueError...) for bad files
        raise SkipImage(f"corrupt image: {type(e).__name__}: {e}") from None
    return extension_for(fmt), size


def reencode(data: bytes, resize: int) -> bytes:
    """RGB JPEG (quality 95) with the shorter side scaled down to ``resize`` (kept when already smaller)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = open_image(data)
            w, h = img.size
            scale = resize / min(w, h)
            if scale < 1 and img.format == "JPEG":
                img.draft("RGB", (max(1, round(w * scale)), max(1, round(h * scale))))
            img = to_rgb(img)
            if scale < 1:
                img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC, reducing_gap=3.0)
            out = io.BytesIO()
            img.save(out, format="JPEG", quality=RESIZE_QUALITY)
    except Exception as e:  # noqa: BLE001 — as above: any failure to decode or re-encode skips the image
        raise SkipImage(f"corrupt image: {type(e).__name__}: {e}") from None
    return out.getvalue()


def ingest_bytes(data: bytes, resize: int | None = None) -> tuple[bytes, str]:
    """(bytes to store, member extension) for an image's bytes; raises SkipImage when unusable."""
    if not data:
        raise SkipImage("empty file")
    if len(data) > MAX_SOURCE_BYTES:
        raise SkipImage(too_large(len(data)))
    ext, _size = check_image(data)
    if resize is not None:
        return reencode(data, resize), "jpg"
    return data, ext


def ingest_file(path: str, resize: int | None = None) -> tuple[bytes, str]:
    """(bytes to store, member extension) for the image file at ``path``; raises SkipImage when unusable."""
    return ingest_bytes(_read_file(path), resize)


def _read_file(path: str) -> bytes:
    """The bytes of a regular file of at most :data:`MAX_SOURCE_BYTES` (read no further); SkipImage otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open must not wait for a writer
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SkipImage("not a regular file")
            if st.st_size > MAX_SOURCE_BYTES:
                raise SkipImage(too_large(st.st_size))
            data = f.read(MAX_SOURCE_BYTES + 1)  # the file may have grown since
    except OSError as e:
        raise SkipImage(f"unreadable: {e.strerror or e}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise SkipImage(too_large(len(data)))
    return data


# one Location per (folder URL, options, guard) and process: an SDK client is slow to make (about 0.3 s for S3)
_LOCATIONS: dict[tuple[str, str, Any], Any] = {}


def read_source(path: str, storage_options: dict[str, Any] | None = None, guard: Any = None) -> bytes:
    """The bytes of a local file or a URL (at most :data:`MAX_SOURCE_BYTES`, with the retries of
    :mod:`shards.storage.location`, through ``storage_options``; with ``guard``, a
    :class:`~shards.storage.location.HostGuard`, an http(s) URL connects to the addresses it allows only);
    SkipImage when it cannot be read."""
    from shards.storage.location import AddressRefused, Location, is_url
    from shards.storage.retries import IOStats

    if not is_url(path):
        return _read_file(path)
    folder, name = path.rsplit("/", 1)
    key = (folder, json.dumps(storage_options or {}, sort_keys=True, default=str), guard)
    if key not in _LOCATIONS:
        _LOCATIONS[key] = Location(folder, storage_options, guard=guard)
    loc = _LOCATIONS[key]
    try:  # a ranged read: no more than one byte past the bound comes back, whatever the object has become
        data = loc.run(loc.call("cat_file", loc.url(name), start=0, end=MAX_SOURCE_BYTES + 1, stats=IOStats()))
    except FileNotFoundError:
        raise SkipImage("unreadable: not found") from None
    except OSError as e:
        cause: BaseException | None = e
        while cause is not None and not isinstance(getattr(cause, "os_error", cause), AddressRefused):
            cause = cause.__cause__ or cause.__context__
        raise SkipImage(f"unreadable: {getattr(cause, 'os_error', cause) if cause is not None else e}") from None
    if len(data) > MAX_SOURCE_BYTES:
        raise SkipImage(too_large(len(data)))
    return data


def ingest_source(
    path: str, resize: int | None = None, storage_options: dict[str, Any] | None = None, guard: Any = None
) -> tuple[bytes, str]:
    """:func:`ingest_file` for a local path or a URL (:func:`read_source`, with ``guard``)."""
    return ingest_bytes(read_source(path, storage_options, guard), resize)


def load_or_skip(load: Callable[[Any], tuple[bytes, str]], arg: Any) -> tuple[bool, Any, str]:
    """``(True, bytes, extension)`` from ``load(arg)``, or ``(False, None, reason)`` when it raises SkipImage."""
    try:
        data, ext = load(arg)
        return True, data, ext
    except SkipImage as e:
        return False, None, str(e)

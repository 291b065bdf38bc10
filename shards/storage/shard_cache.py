"""A local disk cache of whole remote shards, shared by the processes of a machine and bounded in size.

Files are named by their SHA-256 from the manifest (``<sha256>.tar``), written under a temporary
name while they download, hashed, and renamed into place only when the hash matches, so a file
under its final name is always a whole, verified shard (and two datasets sharing a shard share
the file). One process downloads a given shard at a time (an ``flock`` on ``.<sha256>.lock``); the
others wait for it and then find the file. Before a download, least recently used shards (by
mtime, refreshed on every use) are removed until the new one fits under the bound; a shard larger
than the whole bound is not cached. A file removed while another process has it open stays
readable there (POSIX).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path


class ShardCache:
    """Whole shards under ``directory`` (made 0700), at most ``max_bytes`` in all."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int):
        self.dir = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)

    def path(self, sha256: str) -> Path:
        return self.dir / f"{sha256}.tar"

    def lookup(self, sha256: str, size: int) -> Path | None:
        """The cached shard, its use time refreshed, or None when absent (or of another size)."""
        p = self.path(sha256)
        try:
            if p.stat().st_size != size:
                return None
            os.utime(p)
        except OSError:
            return None
        return p

    def _evict(self, need: int, keep: str) -> bool:
        """Remove least recently used shards until ``need`` more bytes fit; False if they cannot (downloads in
        progress, whose temporaries are sized in full at once, count as used but are not removed)."""
        entries, busy = [], 0
        for e in os.scandir(self.dir):
            try:
                st = e.stat()
            except OSError:
                continue
            if e.name.endswith(".tmp"):
                if e.name.split(".")[1] != keep and self._abandoned(e.name.split(".")[1]):
                    Path(e.path).unlink(missing_ok=True)  # left by a process that died while downloading
                else:
                    busy += st.st_size
            elif e.name.endswith(".tar") and not e.name.startswith(".") and e.name != f"{keep}.tar":
                entries.append((st.st_mtime, st.st_size, e.path))
        used = busy + sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if used + need <= self.max_bytes:
                break
            Path(path).unlink(missing_ok=True)
            used -= size
        return used + need <= self.max_bytes

    def _abandoned(self, sha256: str) -> bool:
        """Whether nobody holds the download lock of ``sha256`` (so its temporaries are leftovers)."""
        try:
            fd = os.open(self.dir / f".{sha256}.lock", os.O_RDWR)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # releases the lock if taken
        return True

    async def fetch(self, sha256: str, size: int, download: Callable[[int], Awaitable[None]]) -> Path | None:
        """The cached shard, downloaded first if needed by ``download(fd)`` (which writes ``size`` bytes to the
        file descriptor at their offsets). None when it does not fit (larger than the cache, or the cache is
        taken by downloads in progress). Raises OSError when
        the download fails or its SHA-256 differs from ``sha256``; nothing is left behind then."""
        if size > self.max_bytes:
            return None
        hit = self.lookup(sha256, size)
        if hit is not None:
            return hit
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = os.open(self.dir / f".{sha256}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            while True:  # another process may be downloading this shard: wait without blocking the loop
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.05)
            hit = self.lookup(sha256, size)
            if hit is not None:
                return hit
            if not self._evict(size, sha256):  # then, with no await between, the space is taken (a full-size temporary)
                return None
            fd, tmp = tempfile.mkstemp(prefix=f".{sha256}.", suffix=".tmp", dir=self.dir)
            try:
                os.ftruncate(fd, size)
                await download(fd)
                got = await asyncio.to_thread(_sha256_of, fd, size)
                if got != sha256:
                    raise OSError(f"downloaded shard has sha256 {got[:16]}..., the manifest says {sha256[:16]}...")
                os.replace(tmp, self.path(sha256))
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
            return self.path(sha256)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            os.close(lock)


def _sha256_of(fd: int, size: int) -> str:
    h = hashlib.sha256()
    pos = 0
    while pos < size:
        chunk = os.pread(fd, min(1 << 22, size - pos), pos)
        if not chunk:
            break
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()

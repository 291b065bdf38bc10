"""Reading a split's shards from a URL: ranged GETs planned per batch, or whole shards from the local cache.

:class:`RemoteSource` is the :class:`~shards.read.tar_index.ByteSource` of a remote split, one per loader
process. :meth:`RemoteSource.prefetch` receives the byte ranges the *next* batch needs (from
:meth:`shards.read.tar_index.GroupReader.read_ahead`) while the current one decodes: per shard they are
sorted and coalesced (:func:`coalesce`: gaps up to :data:`MERGE_GAP` merged, requests cut at
``request_mb``), and fetched concurrently on fsspec's I/O thread, at most ``requests_in_flight`` at a
time. The fetched blocks of the current and the next batch are all that is held, so a loader
process's memory is bounded by requests in flight × their size plus two batches' ranges, never by
shard size. Each request has a time limit and is retried after transient failures
(:meth:`shards.storage.location.Location.call`); a range that still fails makes :meth:`read` raise
:class:`OSError`, and the reader counts its samples as unreadable, as for a damaged local shard.

With the cache on (``data.remote.cache``, the default for URLs) the first batch that needs a shard
also starts its download, whole, in ``request_mb`` pieces, into :class:`~shards.storage.shard_cache.ShardCache`,
and once it is there the shard is read from local disk. Nothing waits for a download: until it is
done the shard's ranges are fetched as above. Downloads use at most half of the request slots, so
the next batch's ranges always find room; a shard that cannot be cached is read by ranges.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections import deque
from collections.abc import Iterable
from typing import Any

from shards.manifest import SplitInfo
from shards.storage.location import Location
from shards.storage.retries import IOStats, ShortRead
from shards.storage.shard_cache import ShardCache

MERGE_GAP = 1 << 20  # ranges of one shard closer than this are fetched in one request (a round trip costs more)
READ_AHEAD = 256 << 10  # a small read nobody planned fetches this much (header walks read on from there)
GENERATIONS = 2  # batches whose blocks are held: the one being decoded and the next


def coalesce(ranges: Iterable[tuple[int, int, int]], gap: int, limit: int) -> list[tuple[int, int, int]]:
    """``(shard, start, end)`` requests covering ``(shard, offset, size)`` ranges: per shard in offset order,
    neighbours merged while the hole between them is at most ``gap`` and the request at most ``limit``
    bytes; a longer range is cut into ``limit``-sized requests."""
    out: list[tuple[int, int, int]] = []
    cur: list[int] | None = None
    for shard, off, size in sorted((int(s), int(o), int(n)) for s, o, n in ranges if n > 0):
        end = off + size
        if cur is not None and cur[0] == shard and off <= cur[2] + gap and max(end, cur[2]) - cur[1] <= limit:
            cur[2] = max(cur[2], end)
            continue
        if cur is not None:
            out.append((cur[0], cur[1], cur[2]))
        cur = [shard, off, end]
    if cur is not None:
        out.append((cur[0], cur[1], cur[2]))
    cut = []
    for shard, start, end in out:
        cut.extend((shard, s, min(end, s + limit)) for s in range(start, end, limit))
    return cut


class _Block:
    __slots__ = ("start", "end", "future")

    def __init__(self, start: int, end: int, future: concurrent.futures.Future):
        self.start, self.end, self.future = start, end, future


class RemoteSource:
    """:class:`~shards.read.tar_index.ByteSource` over the shards of a split whose location is a URL (see the module docstring).

    ``stats`` counts requests, bytes, retries by kind and failures (:class:`~shards.storage.retries.IOStats`).
    Not thread-safe: one reader thread, as in a loader process.
    """

    def __init__(self, split: SplitInfo, location: Location | None = None):
        self.split = split
        self.loc = location if location is not None else split.location
        s = self.loc.settings
        self.stats = IOStats()
        self.cache = ShardCache(s.cache_dir, int(s.cache_gb * 2**30)) if s.cache else None
        self._sem: asyncio.Semaphore | None = None
        self._download_sem: asyncio.Semaphore | None = None
        self._gens: deque[dict[int, list[_Block]]] = deque()
        self._ahead: tuple[int, _Block] | None = None
        self._downloads: dict[int, concurrent.futures.Future] = {}
        self._download_tasks: set[asyncio.Task] = set()  # their tasks on the loop (touched there only)
        self._files: dict[int, int] = {}
        self._uncached: set[int] = set()

    # -- ByteSource ---------------------------------------------------------------------------
    def name(self, shard: int) -> str:
        return self.loc.url(self.split.shards[shard].file)

    def read(self, shard: int, offset: int, size: int) -> bytes:
        total = self.split.shards[shard].bytes
        size = max(0, min(size, total - offset))
        if size == 0:
            return b""
        fd = self._cached(shard)
        if fd is not None:
            return os.pread(fd, size, offset)
        data = self._from_blocks(shard, offset, size)
        if data is not None:
            return data
        if size < READ_AHEAD:  # a header walk or a stray sample: read on, the next read is likely near
            blk = _Block(offset, min(total, offset + READ_AHEAD), None)  # type: ignore[arg-type]
            blk.future = self._submit(shard, blk.start, blk.end)
            self._ahead = (shard, blk)
            return blk.future.result()[:size]
        return b"".join(
            self._submit(shard, s, e).result() for _, s, e in coalesce([(shard, offset, size)], 0, self._limit)
        )

    def wait_for_downloads(self) -> int:
        """Block until every shard download started so far has ended (the shard in the cache, or failed: its ranges
        are read then); returns how many shards are now read from local disk. Readers never call it (a batch does
        not wait for a download); a caller that wants the cache filled, such as a warm-up or a test, does."""
        concurrent.futures.wait(list(self._downloads.values()))
        for shard in list(self._downloads):
            self._cached(shard, start=False)  # a finished download's file opened (or the shard left to ranges)
        return len(self._files)

    def close(self) -> None:
        for gen in self._gens:
            for blocks in gen.values():
                for b in blocks:
                    b.future.cancel()
        self._gens.clear()
        self._ahead = None
        if self._downloads:  # cancelled and awaited on the loop, so their temporaries are removed before we exit
            asyncio.run_coroutine_threadsafe(self._stop_downloads(), self.loc.loop).result()
        self._downloads.clear()
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    # -- planning -----------------------------------------------------------------------------
    @property
    def _limit(self) -> int:
        return self.loc.settings.request_bytes

    def prefetch(self, ranges: Iterable[tuple[int, int, int]]) -> None:
        """Start fetching ``(shard, offset, size)`` ranges (the next batch's) in the background; keep the
        blocks of the last :data:`GENERATIONS` calls. With the cache, shards already on disk are skipped,
        and the others start downloading (after these ranges, which are not held up by them)."""
        ranges = [r for r in ranges if self._cached(r[0], start=False) is None]
        gen: dict[int, list[_Block]] = {}
        todo = []
        for r in ranges:
            held = self._covering(r[0], r[1], r[2])
            if held is None:
                todo.append(r)
            else:  # already fetched for the batch before: carried over, not fetched again
                gen.setdefault(r[0], []).extend(b for b in held if b not in gen.get(r[0], []))
        for shard, start, end in coalesce(todo, min(MERGE_GAP, self._limit // 4), self._limit):
            gen.setdefault(shard, []).append(_Block(start, end, self._submit(shard, start, end)))
        for blocks in gen.values():
            blocks.sort(key=lambda b: b.start)
        self._gens.append(gen)
        for shard in sorted({r[0] for r in ranges}):
            self._cached(shard)  # starts its download
        while len(self._gens) > GENERATIONS:
            old = self._gens.popleft()
            live = {id(b) for g in self._gens for bl in g.values() for b in bl}
            for blocks in old.values():
                for b in blocks:
                    if id(b) not in live:
                        b.future.cancel()

    def held_bytes(self) -> int:
        """Bytes of fetched blocks held for the current and the next batch."""
        seen = {id(b): b.end - b.start for g in self._gens for bl in g.values() for b in bl}
        return sum(seen.values())

    def _covering(self, shard: int, offset: int, size: int) -> list[_Block] | None:
        """Held blocks that together cover ``[offset, offset + size)`` of ``shard``, in order; None if they do not."""
        candidates = [b for g in reversed(self._gens) for b in g.get(shard, ())]
        if self._ahead is not None and self._ahead[0] == shard:
            candidates.append(self._ahead[1])
        out, pos, end = [], offset, offset + size
        for b in sorted(candidates, key=lambda b: (b.start, -b.end)):
            if b.start <= pos < b.end:
                out.append(b)
                pos = b.end
                if pos >= end:
                    return out
        return None

    def _from_blocks(self, shard: int, offset: int, size: int) -> bytes | None:
        blocks = self._covering(shard, offset, size)
        if blocks is None:
            return None
        parts, pos, end = [], offset, offset + size
        for b in blocks:
            data = b.future.result()  # raises the range's OSError when it could not be fetched
            parts.append(data[pos - b.start : min(end, b.end) - b.start])
            pos = b.end
        return b"".join(parts)

    # -- fetching (on the location's event loop) ---------------------------------------------------
    def _schedule(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loc.loop)

    def _submit(self, shard: int, start: int, end: int) -> concurrent.futures.Future:
        return self._schedule(self._get(shard, start, end))

    async def _get(self, shard: int, start: int, end: int, download: bool = False) -> bytes:
        if self._sem is None:
            n = self.loc.settings.requests_in_flight
            self._sem, self._download_sem = asyncio.Semaphore(n), asyncio.Semaphore(max(1, n // 2))
        if download:  # a download's piece takes one of half the slots first: ranges keep the other half
            async with self._download_sem:  # type: ignore[union-attr]
                return await self._get(shard, start, end)
        sh = self.split.shards[shard]
        n = end - start

        def check(data: bytes) -> None:
            if len(data) != n and len(data) != sh.bytes:  # a server ignoring Range sends the whole shard
                raise ShortRead(f"{len(data)} bytes for a range of {n}")

        async with self._sem:
            data = await self.loc.call(
                "cat_file", self.loc.url(sh.file), start=start, end=end, stats=self.stats, nbytes=n, check=check
            )
        if len(data) != n:
            data = data[start:end]
        self.stats.add("bytes", len(data))
        return data

    async def _download(self, shard: int) -> int | None:
        """The open descriptor of the cached shard (downloaded first when needed), or None: read it by ranges."""
        sh, limit = self.split.shards[shard], self._limit
        self._download_tasks.add(asyncio.current_task())  # type: ignore[arg-type]
        wrote = []

        async def write(fd: int) -> None:
            async def piece(s: int) -> None:
                os.pwrite(fd, await self._get(shard, s, min(sh.bytes, s + limit), download=True), s)

            tasks = [asyncio.ensure_future(piece(s)) for s in range(0, sh.bytes, limit)]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:  # none may write to the descriptor once it is closed
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            wrote.append(shard)

        for _ in range(3):  # opened at once: another process making room may remove the file, not an open one
            path = await self.cache.fetch(sh.sha256, sh.bytes, write)  # type: ignore[union-attr]
            if wrote:  # counted once the shard is in the cache (checked and renamed), not when its bytes arrived
                self.stats.add("cache_downloads")
                wrote.clear()
            if path is None:
                return None
            try:
                return os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
        return None

    async def _stop_downloads(self) -> None:
        tasks = [t for t in self._download_tasks if not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for fut in self._downloads.values():  # finished ones hold an open file
            if fut.done() and not fut.cancelled() and fut.exception() is None and fut.result() is not None:
                os.close(fut.result())

    def _cached(self, shard: int, start: bool = True) -> int | None:
        """The open cached file of ``shard`` when it is on local disk; else None (read it by ranges), its
        download started (with ``start``) if the cache takes it. Never waits."""
        if self.cache is None or shard in self._uncached:
            return None
        fd = self._files.get(shard)
        if fd is not None:
            return fd
        fut = self._downloads.get(shard)
        if fut is None:
            sh = self.split.shards[shard]
            hit = self.cache.lookup(sh.sha256, sh.bytes)  # there already (an earlier epoch, another process)
            if hit is not None:
                try:
                    fd = self._files[shard] = os.open(hit, os.O_RDONLY)
                    return fd
                except FileNotFoundError:
                    pass
            if start:
                self._downloads[shard] = self._schedule(self._download(shard))
            return None
        if not fut.done():
            return None
        del self._downloads[shard]
        try:
            fd = fut.result()
        except (OSError, concurrent.futures.CancelledError):  # failed after its retries: its ranges are read instead
            fd = None
        if fd is None:
            self._uncached.add(shard)
            return None
        self._files[shard] = fd
        return fd

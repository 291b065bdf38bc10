"""Where shards live: a local folder or an fsspec URL prefix (``s3://``, ``gs://``, ``https://``, ...).

:func:`open_location` turns ``data.shards`` / ``--out`` / ``--shards`` into a :class:`Location`. A
string with a scheme (``name://``) is a URL and is never taken for a path; ``file://`` and plain
strings are local paths, handled with ``open()`` alone (no fsspec, no cloud SDK). A URL's
filesystem is fsspec's, created once per process with the location's storage options
(``data.storage_options``: endpoint, region, anonymous access); credentials come from where the
SDKs look (environment, ``~/.aws``, fsspec configuration) and are refused in the options, which
end up in MLflow params and job uploads (what passes is still written redacted: :mod:`dmltrain.redact`).
A URL may carry a user name and password (``https://USER:PASSWORD@host/shards``): fsspec uses them,
and a :class:`Location` prints as the URL without them. The SDK for a scheme (s3fs, gcsfs) is imported when a URL
of that scheme is first used; a missing one is one line naming the package.

A URL that someone else wrote (a table's image, :mod:`shards.build.table`) is fetched only from a public address:
:class:`HostGuard` resolves its host and refuses a loopback, link-local (``169.254.169.254``, a cloud's metadata
service), private or otherwise non-global address, both before anything is built (one line naming the row) and
at every connection a ``Location`` made with the guard opens (so a redirect, or a name that resolves elsewhere the
second time, reaches no such address either).

Every remote call goes through :meth:`Location.call`: a time limit per request, and retries with
capped exponential backoff and full jitter after *transient* failures (:mod:`shards.storage.retries`:
timeouts, HTTP 5xx, throttling, dropped connections, truncated bodies), each counted in an
:class:`IOStats`. Other failures (not found, forbidden) are not retried. The SDKs' own retries
are turned off where fsspec lets us (s3fs, botocore), so the counts are every retry made.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ipaddress
import os
import re
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dmltrain.errors import UserError
from dmltrain.redact import TOKEN_MODES, redact, redact_url, secret_name
from shards.storage.retries import IOStats, ShortRead, backoff_s, transient_kind

T = TypeVar("T")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# the package that serves a scheme, and the dmltrain extra that installs it
PACKAGES = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "http": ("aiohttp", None),
    "https": ("aiohttp", None),
    "az": ("adlfs", None),
    "abfs": ("adlfs", None),
}
READ_ONLY = ("http", "https")


def is_url(where: Any) -> bool:
    """True for ``scheme://...`` strings: those are URLs (``file://`` included), never paths."""
    return isinstance(where, str) and _SCHEME.match(where) is not None


def check_storage_options(options: Mapping[str, Any], where: str = "data.storage_options") -> dict[str, Any]:
    """``options`` as a plain dict, refusing with one line what is plainly a credential, anywhere in the nesting:
    a key named like one (:func:`dmltrain.redact.secret_name`; gcsfs's ``token`` only when it is not an
    authentication mode) or a URL with userinfo (``endpoint_url=http://KEY:SECRET@host``).

    A refusal is the first line of defence only: whatever passes is still written redacted
    (:func:`dmltrain.redact.redact`: every option outside an allow-list), so a secret under a name this
    check does not know stays out of MLflow and run files all the same.
    """
    if not isinstance(options, Mapping):
        raise UserError(f"{where}: expected a mapping of fsspec options, got {type(options).__name__}")

    def refuse(key: str, what: str) -> UserError:
        return UserError(
            f"{key}: {what} do not belong in storage options (the config is logged to MLflow and uploaded with "
            "jobs); give credentials through the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "GOOGLE_APPLICATION_CREDENTIALS, or FSSPEC_<PROTOCOL> as JSON for fsspec options such as headers), "
            "~/.aws/credentials or a cloud role"
        )

    def walk(value: Any, key: str) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                name = re.sub(r"[-_]", "", str(k).lower())
                if secret_name(str(k)) and not (name == "token" and isinstance(v, str) and v in TOKEN_MODES):
                    raise refuse(f"{key}.{k}", "credentials")
                walk(v, f"{key}.{k}")
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, key)
        elif isinstance(value, str) and redact_url(value) != value:
            raise refuse(key, "user names and passwords in URLs")

    walk(options, where)
    return {str(k): v for k, v in options.items()}


def parse_storage_options(items: list[str] | None, flag: str = "--storage-option") -> dict[str, Any]:
    """``KEY=VALUE`` strings (values read as YAML, dotted keys nest) -> options: ``anon=true``,
    ``endpoint_url=http://127.0.0.1:9000``, ``client_kwargs.region_name=eu-west-1``."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise UserError(f"{flag} {item!r}: expected KEY=VALUE (e.g. endpoint_url=http://127.0.0.1:9000, anon=true)")
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"{flag} {item!r}: {p} is already a value, not a mapping")
        node[last] = value
    return check_storage_options(out, flag)


def add_storage_option(parser: argparse.ArgumentParser) -> None:
    """``--storage-option KEY=VALUE`` (repeatable): fsspec options of a URL, as ``data.storage_options``."""
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec option of a URL, repeatable (endpoint_url=http://host:9000, anon=true, client_kwargs.region_name=eu-west-1); "
        "credentials come from the environment or ~/.aws, never from here",
    )


@dataclass(frozen=True)
class RemoteSettings:
    """How a URL's shards are read (``data.remote``); local paths ignore it."""

    requests_in_flight: int = 8  # per loader process: with request_mb, the bound on bytes being fetched
    request_mb: float = 8.0  # the largest ranged GET; coalesced ranges are cut at this size
    timeout_s: float = 30.0  # one request; past it the request counts as failed and is retried
    retries: int = 8  # retries of one request after transient failures
    cache: bool = True  # whole shards kept on local disk (remote URLs only)
    cache_dir: str = "~/.cache/dmltrain/shards"
    cache_gb: float = 50.0

    @classmethod
    def of(cls, x: Any) -> RemoteSettings:
        """From None (defaults), a RemoteSettings, a mapping, or an object with these attributes (``DataConfig.remote``)."""
        if x is None or isinstance(x, cls):
            return x or cls()
        get = x.get if isinstance(x, Mapping) else lambda k, d: getattr(x, k, d)
        return cls(**{f.name: get(f.name, f.default) for f in fields(cls)})

    @property
    def request_bytes(self) -> int:
        return max(4096, int(self.request_mb * 2**20))


# -- whom a URL may reach --------------------------------------------------------------------
#: schemes whose URLs name a network host that the guard checks (an object store's URL names a bucket; its
#: endpoint comes from the user's storage options)
HOST_SCHEMES = ("http", "https")


class AddressRefused(PermissionError):
    """A connection to an address the :class:`HostGuard` refuses (never retried)."""


def _kind(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What makes ``addr`` no public address (``loopback``, ``link-local``...), or None for a global one."""
    mapped = getattr(addr, "ipv4_mapped", None) or getattr(addr, "sixtofour", None)
    if mapped is not None:  # ::ffff:127.0.0.1 is 127.0.0.1
        addr = mapped
    for kind in ("unspecified", "loopback", "link_local", "multicast", "private", "reserved", "site_local"):
        if getattr(addr, f"is_{kind}", False):
            return kind.replace("_", "-")
    return None if addr.is_global else "non-global"


@dataclass(frozen=True)
class HostGuard:
    """Which addresses a URL written by someone else may reach: global ones, and ``allowed`` (the addresses of the
    host the user named, whose relative paths a table may use). Picklable: build workers carry it."""

    allowed: frozenset[str] = frozenset()

    def address_refusal(self, ip: str) -> str | None:
        """Why the address ``ip`` may not be reached (``127.0.0.1, a loopback address``), or None."""
        ip = ip.split("%")[0]  # an IPv6 address's zone
        if ip in self.allowed:
            return None
        try:
            kind = _kind(ipaddress.ip_address(ip))
        except ValueError:
            return f"{ip}, not an IP address"
        return None if kind is None else f"{ip}, {'an' if kind[0] in 'aeiou' else 'a'} {kind} address"

    def url_refusal(self, url: str) -> str | None:
        """Why ``url`` may not be fetched: its host is missing or resolves (every address is checked) to an address
        :meth:`address_refusal` refuses; None for a URL of another scheme (:data:`HOST_SCHEMES`) or a public host."""
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme.lower() not in HOST_SCHEMES:
            return None
        host = parts.hostname
        if not host:
            return "no host"
        try:
            infos = socket.getaddrinfo(host, parts.port or 443, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError, ValueError) as e:
            return f"its host {host} does not resolve ({getattr(e, 'strerror', None) or e})"
        for *_, sockaddr in infos:
            why = self.address_refusal(str(sockaddr[0]))
            if why is not None:
                return f"its host is {why}" if why.startswith(f"{host},") else f"its host {host} resolves to {why}"
        return None

    @classmethod
    def allowing(cls, url: str | None) -> HostGuard:
        """A guard that also allows the addresses of ``url``'s host (the table's own, named by the user), for an
        http(s) ``url``; else a guard of global addresses only."""
        from urllib.parse import urlsplit

        parts = urlsplit(url) if url and is_url(url) else None
        host = parts.hostname if parts is not None and parts.scheme.lower() in HOST_SCHEMES else None
        if not host:
            return cls()
        try:
            return cls(frozenset(str(i[4][0]).split("%")[0] for i in socket.getaddrinfo(host, None)))
        except (OSError, UnicodeError, ValueError):
            return cls()

    def socket_for(self, addr_info: tuple) -> socket.socket:
        """aiohttp's ``socket_factory``: the socket for one resolved address, or :class:`AddressRefused`."""
        family, type_, proto, _, sockaddr = addr_info
        why = self.address_refusal(str(sockaddr[0]))
        if why is not None:
            raise AddressRefused(f"refused to connect to {why} (a URL from a table reaches public addresses only)")
        return socket.socket(family=family, type=type_, proto=proto)

    async def client(self, **kwargs: Any) -> Any:
        """fsspec-http's ``get_client``: an aiohttp session whose every connection is checked (:meth:`socket_for`),
        redirects and later resolutions of the same name included."""
        import aiohttp

        kwargs.setdefault("connector", aiohttp.TCPConnector(socket_factory=self.socket_for))
        return aiohttp.ClientSession(**kwargs)


# -- locations ------------------------------------------------------------------------------
def _missing_package(url: str, protocol: str, e: Exception) -> UserError:
    pkg, extra = PACKAGES.get(protocol, (None, None))
    how = (
        f"pip install 'dmltrain[{extra}]'"
        if extra
        else f"pip install {pkg}"
        if pkg
        else "install the fsspec implementation it names"
    )
    return UserError(f"{url}: {protocol}:// URLs need the {pkg or 'matching'} package ({how}); {e}")


class Location:
    """A shard folder: ``root`` is an absolute-or-relative local path, or a URL prefix without a trailing ``/``.

    ``remote`` tells which. For a URL, :attr:`fs` is the fsspec filesystem (made once per process, so a
    pickled or forked copy makes its own) and :meth:`call` runs one of its operations with the time
    limit and retries of ``settings``. Names inside the folder are joined with ``/`` and must be plain
    (the manifest checks this), so nothing is read or written outside the prefix.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        remote: Any = None,
        guard: HostGuard | None = None,
    ):
        root = os.fspath(root)
        self.guard = guard  # http(s): every connection checked (a URL someone else wrote)
        m = _SCHEME.match(root)
        if m and m.group(1).lower() == "file":
            root = root[len(m.group(0)) :] or "/"
            m = None
        self.remote = m is not None
        self.settings = RemoteSettings.of(remote)
        self.storage_options = check_storage_options(storage_options or {})
        if self.remote:
            self.protocol = m.group(1).lower()
            rest = root[len(m.group(0)) :]
            if not rest.strip("/") or "?" in rest or "#" in rest:
                raise UserError(
                    f"{redact_url(root)}: not a folder URL (it needs a bucket or host and path, and no query or fragment)"
                )
            self.root = root.rstrip("/")
        else:
            self.protocol = "file"
            self.root = str(Path(root).expanduser())
        self._fs: Any = None
        self._fs_pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fs": None, "_fs_pid": -1}

    def __str__(self) -> str:
        """The folder as messages show it: a URL's user name and password redacted (:attr:`root` keeps them)."""
        return redact_url(self.root)

    def __repr__(self) -> str:
        return f"Location({str(self)!r})"

    @property
    def path(self) -> Path:
        """The local folder (only for local locations)."""
        if self.remote:
            raise ValueError(f"{self}: a URL, not a local folder")
        return Path(self.root)

    def url(self, name: str) -> str:
        """What ``name`` inside the folder is called: ``<root>/<name>``."""
        return f"{self.root}/{name}"

    @property
    def fs(self) -> Any:
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs, self._fs_pid = self._make_fs(), os.getpid()
        return self._fs

    def _make_fs(self) -> Any:
        import fsspec

        opts = {"use_listings_cache": False, **self.storage_options}  # other writers: a cached listing would go stale
        if self.protocol in ("s3", "s3a"):  # botocore's own retries off: ours are counted
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            opts["config_kwargs"] = config
        if self.guard is not None and self.protocol in HOST_SCHEMES:
            opts["get_client"] = self.guard.client
        try:
            fs = fsspec.filesystem(self.protocol, skip_instance_cache=True, **opts)
        except ImportError as e:
            raise _missing_package(str(self), self.protocol, e) from None
        except ValueError as e:
            if "Protocol not known" in str(e):
                raise UserError(
                    f"{self}: unknown URL scheme {self.protocol!r} (fsspec knows s3, gs, https, ...)"
                ) from None
            raise UserError(f"{self}: bad storage options ({redact_url(str(e))})") from None
        except TypeError as e:
            raise UserError(f"{self}: bad storage options ({redact_url(str(e))})") from None
        if isinstance(getattr(type(fs), "retries", None), int):
            fs.retries = 1  # s3fs's own retry loop: one attempt, ours retry
        return fs

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop remote calls run on (fsspec's I/O thread)."""
        from fsspec.asyn import get_loop

        fs = self.fs
        return fs.loop if getattr(fs, "async_impl", False) else get_loop()

    async def _op(self, name: str, *args: Any, **kw: Any) -> Any:
        fs = self.fs
        if getattr(fs, "async_impl", False):
            return await getattr(fs, "_" + name)(*args, **kw)
        return await asyncio.to_thread(getattr(fs, name), *args, **kw)

    async def _connect(self) -> None:
        """The SDK's session, made before any request is timed (a botocore client takes a second of CPU to build)."""
        fs = self.fs
        if (
            getattr(fs, "async_impl", False)
            and hasattr(fs, "set_session")
            and getattr(fs, "_dmltrain_ready", None) is None
        ):
            await fs.set_session()
            fs._dmltrain_ready = True

    async def call(
        self,
        name: str,
        *args: Any,
        stats: IOStats,
        nbytes: int = 0,
        timeout: bool = True,
        check: Callable[[Any], None] | None = None,
        **kw: Any,
    ) -> Any:
        """``fs.<name>(*args, **kw)`` with the time limit (unless ``timeout=False``: long uploads) and retries.

        ``check`` may raise (:class:`ShortRead`) to reject a result, which is then retried as truncated.
        After the last retry, or on a failure that is not transient, raises :class:`OSError` naming the
        URL in ``args[0]`` and the cause.
        """
        s = self.settings
        await self._connect()
        for attempt in range(s.retries + 1):
            stats.start(nbytes)
            stats.add("requests")
            try:
                op = self._op(name, *args, **kw)
                out = await (asyncio.wait_for(op, s.timeout_s) if timeout else op)
                if check is not None:
                    check(out)
                return out
            except asyncio.CancelledError:
                raise
            except Exception as e:
                kind = "truncated" if isinstance(e, ShortRead) else transient_kind(e)
                if kind is None or attempt == s.retries:
                    stats.add("failed")
                    why = "timed out" if kind == "timeout" else f"{type(e).__name__}: {e}".rstrip(": ")
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    err = FileNotFoundError if isinstance(e, FileNotFoundError) else OSError
                    raise err(redact_url(f"{args[0] if args else self.root}: {name} failed{tries} ({why})")) from e
                stats.add(f"retries/{kind}")
            finally:
                stats.end(nbytes)
            await asyncio.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")

    def run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine of this location on its loop and wait for it (from any thread but the loop's)."""
        try:
            loop = self.loop  # makes the filesystem: a missing SDK or bad options raise here
        except BaseException:
            coro.close()  # type: ignore[attr-defined]
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]

    # -- whole-file operations (manifest, listing, uploads) ----------------------------------
    def read_bytes(self, name: str, stats: IOStats | None = None, limit: int | None = None) -> bytes:
        """The whole of ``name``, or its first ``limit`` bytes at most (a ranged read: a server that says less
        than it sends cannot make it hold more); FileNotFoundError when it is not there."""
        if not self.remote:
            with open(self.path / name, "rb") as f:
                return f.read(-1 if limit is None else limit)
        bound = {} if limit is None else {"start": 0, "end": limit}
        return self.run(self.call("cat_file", self.url(name), stats=stats or IOStats(), **bound))

    def write_bytes(self, name: str, data: bytes, stats: IOStats | None = None) -> None:
        """Write ``name`` whole (an object store makes it visible at once, never half-written)."""
        self.run(self.call("pipe_file", self.url(name), data, stats=stats or IOStats(), timeout=False))

    def upload(self, local: Path, name: str, stats: IOStats | None = None) -> None:
        """Copy a local file to ``name`` (fsspec uploads large files in parts, e.g. S3 multipart)."""
        self.run(self.call("put_file", str(local), self.url(name), stats=stats or IOStats(), timeout=False))

    def size(self, name: str, stats: IOStats | None = None) -> int | None:
        """Size in bytes of ``name``, or None when it is not there."""
        if not self.remote:
            p = self.path / name
            return p.stat().st_size if p.is_file() else None
        try:
            info = self.run(self.call("info", self.url(name), stats=stats or IOStats()))
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("size") is not None else None

    def sizes(self, names: list[str]) -> dict[str, int | None]:
        """Size of each of ``names`` (None: not there), asked one by one (HTTP servers do not list folders)."""
        if not self.remote:
            return {n: self.size(n) for n in names}

        async def one(name: str, sem: asyncio.Semaphore, stats: IOStats) -> int | None:
            async with sem:
                try:
                    info = await self.call("info", self.url(name), stats=stats)
                except FileNotFoundError:
                    return None
                return int(info["size"]) if info.get("size") is not None else None

        async def all_of() -> list[int | None]:
            sem, stats = asyncio.Semaphore(self.settings.requests_in_flight), IOStats()
            return list(await asyncio.gather(*(one(n, sem, stats) for n in names)))

        return dict(zip(names, self.run(all_of())))

    def listing(self) -> dict[str, int | None]:
        """Names directly inside the folder and their sizes (None for a subfolder); empty when it does not exist."""
        if not self.remote:
            if not self.path.is_dir():
                return {}
            return {p.name: (p.stat().st_size if p.is_file() else None) for p in self.path.iterdir()}
        try:
            listed = self.run(self.call("ls", self.root, detail=True, stats=IOStats()))
        except FileNotFoundError:
            return {}
        prefix = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        out: dict[str, int | None] = {}
        for e in listed:
            name = str(e["name"]).rstrip("/")
            if name.startswith(prefix) and len(name) > len(prefix):
                out[name[len(prefix) :]] = (
                    int(e["size"]) if e.get("type") == "file" and e.get("size") is not None else None
                )
        return out

    def remove(self, name: str) -> None:
        if not self.remote:
            (self.path / name).unlink(missing_ok=True)
            return
        try:
            self.run(self.call("rm_file", self.url(name), stats=IOStats()))
        except FileNotFoundError:
            pass

    def describe(self) -> dict[str, Any]:
        """What the location is, as it may be printed or logged (redacted: :func:`dmltrain.redact.redact`)."""
        return redact({"root": self.root, "storage_options": self.storage_options, "remote": asdict(self.settings)})


def open_location(
    where: str | os.PathLike[str] | Location, storage_options: Mapping[str, Any] | None = None, remote: Any = None
) -> Location:
    """``where`` as a :class:`Location` (returned as is when it already is one)."""
    if isinstance(where, Location):
        return where
    return Location(where, storage_options, remote)


def location_of(data: Any, where: str | os.PathLike[str] | None = None) -> Location:
    """The shards of a ``DataConfig`` (or its dict): ``where`` (default ``data.shards``) with its storage options and settings."""
    get = data.get if isinstance(data, Mapping) else lambda k, d=None: getattr(data, k, d)
    return Location(
        where if where is not None else get("shards"), get("storage_options", None) or {}, get("remote", None)
    )


def read_chunks(location: Location, name: str, size: int, stats: IOStats | None = None) -> Iterator[bytes]:
    """The bytes of ``name`` (``size`` of them) in order, in ``request_mb`` ranged GETs with up to
    ``requests_in_flight`` ahead (memory: that many chunks); raises OSError when a chunk cannot be read."""
    stats = stats or IOStats()
    s = location.settings
    limit, url = s.request_bytes, location.url(name)

    async def get(start: int) -> bytes:
        end = min(size, start + limit)

        def check(data: bytes) -> None:
            if len(data) != end - start:
                raise ShortRead(f"{len(data)} bytes for a range of {end - start}")

        data = await location.call("cat_file", url, start=start, end=end, stats=stats, nbytes=end - start, check=check)
        stats.add("bytes", len(data))
        return data

    starts = iter(range(0, size, limit))
    pending: deque[concurrent.futures.Future] = deque()
    try:
        for st in starts:
            pending.append(asyncio.run_coroutine_threadsafe(get(st), location.loop))
            if len(pending) >= s.requests_in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:
            fut.cancel()

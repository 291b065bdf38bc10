"""Transient failures of remote requests: which ones to retry, how long to wait, and counting them.

:func:`transient_kind` sorts a failed request into one of :data:`RETRY_KINDS` (timeout, throttled,
server_error, connection, truncated), looking through the exceptions an SDK chained (s3fs wraps
botocore's ``ClientError``), or None for a failure that retrying will not mend (not found,
forbidden, another 4xx). :func:`backoff_s` is capped exponential backoff with full jitter;
:class:`IOStats` counts requests, bytes and retries by kind in one process.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Mapping

RETRY_KINDS = ("timeout", "throttled", "server_error", "connection", "truncated")
_THROTTLE_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "TooManyRequests",
    "TooManyRequestsException",
    "RequestThrottled",
    "ServiceUnavailable",
}
_TIMEOUT_NAMES = {
    "TimeoutError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "FSTimeoutError",
    "ServerTimeoutError",
    "timeout",
}
_CONNECTION_NAMES = {
    "ConnectionError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "ClientOSError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "HTTPClientError",
}
_TRUNCATED_NAMES = {
    "ClientPayloadError",
    "IncompleteRead",
    "IncompleteReadError",
    "ResponseStreamingError",
    "ContentLengthError",
    "ShortRead",
    "TransferEncodingError",
}


class ShortRead(OSError):
    """A response body shorter (or longer) than the range asked for."""


def _status_and_code(e: BaseException) -> tuple[int | None, str | None]:
    resp = getattr(e, "response", None)
    if isinstance(resp, Mapping):  # botocore ClientError
        meta, err = resp.get("ResponseMetadata") or {}, resp.get("Error") or {}
        status = meta.get("HTTPStatusCode")
        return (int(status) if status else None), err.get("Code")
    for attr in ("status", "code", "status_code"):  # aiohttp ClientResponseError, gcsfs HttpError
        v = getattr(e, attr, None)
        if isinstance(v, int) and 100 <= v < 600:
            return v, None
    return None, None


def transient_kind(e: BaseException) -> str | None:
    """Why a failed request is worth retrying (one of :data:`RETRY_KINDS`), or None when it is not
    (not found, forbidden, a bad request). Looks through the causes an SDK chained (s3fs wraps botocore)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(getattr(e, "os_error", None), PermissionError):
            return None  # a connection refused before it opened (shards.storage.location.AddressRefused)
        names = {c.__name__ for c in type(e).__mro__}
        status, code = _status_and_code(e)
        if code in _THROTTLE_CODES or status in (429, 503):
            return "throttled"
        if status is not None and status >= 500:
            return "server_error"
        if status is not None:  # a definite 4xx answer
            return None
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return None
        if names & _TRUNCATED_NAMES:
            return "truncated"
        if names & _TIMEOUT_NAMES or isinstance(e, asyncio.TimeoutError):
            return "timeout"
        if names & _CONNECTION_NAMES:
            return "connection"
        e, seen = (e.__cause__ or e.__context__), seen + 1
    return None


def backoff_s(attempt: int, base: float = 0.1, cap: float = 10.0) -> float:
    """Full-jitter exponential backoff before retry ``attempt`` (0-based): uniform in [0, min(cap, base·2^attempt)]."""
    return random.uniform(0.0, min(cap, base * 2.0**attempt))


class IOStats:
    """Counts of one process's remote requests: ``requests``, ``bytes``, ``retries/<kind>``, ``failed`` (gave up),
    cache ``cache_downloads``; plus the peaks of requests and bytes in flight (for the memory bound)."""

    COUNTERS = ("requests", "bytes", *(f"retries/{k}" for k in RETRY_KINDS), "failed", "cache_downloads")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.COUNTERS, 0)
        self._taken = dict(self.counts)
        self.in_flight = self.in_flight_bytes = 0
        self.peak_in_flight = self.peak_in_flight_bytes = 0
        self.pid = os.getpid()

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] += n

    @property
    def retries(self) -> int:
        return sum(self.counts[f"retries/{k}"] for k in RETRY_KINDS)

    def take(self) -> dict[str, int]:
        """The counts added since the last ``take`` (a batch carries them out of its loader process)."""
        if self.pid != os.getpid():  # a forked copy: the parent's counts are not ours
            self.__init__()
        out = {k: v - self._taken[k] for k, v in self.counts.items() if v != self._taken[k]}
        self._taken = dict(self.counts)
        return out

    def start(self, nbytes: int) -> None:
        self.in_flight += 1
        self.in_flight_bytes += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.peak_in_flight_bytes = max(self.peak_in_flight_bytes, self.in_flight_bytes)

    def end(self, nbytes: int) -> None:
        self.in_flight -= 1
        self.in_flight_bytes -= nbytes

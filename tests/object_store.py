"""Object storage on loopback for the remote-shard tests: moto's S3 server and a Range-honouring HTTP server,
both behind the same fault injection.

:class:`Faults` decides, per request, whether to answer 503 (S3's ``SlowDown``), to hang past the
client's time limit, to cut one response short (the connection closes mid-body), or to refuse the
uploads of matching keys; it counts what it injected and logs every request. Faults are drawn
from a seeded generator, only for reads of objects (GET), unless ``fail_puts`` names keys.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

try:
    import s3fs  # noqa: F401  (read by the code under test, through fsspec)
    from moto.moto_server.threaded_moto_server import ThreadedMotoServer
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server
except ImportError as e:  # an error, not a skip: CI must run these tests
    raise ImportError(
        f"{e}: the remote-shard tests need the test-s3 extra, which `make test` installs into "
        f"{Path(sys.prefix) / 'test-s3'}"
    ) from e

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class Faults:
    """What to inject: ``p_503`` and ``p_hang`` of object GETs (hanging ``hang_s``), ``truncate`` responses cut
    short (the next ones, once each), uploads whose path matches ``fail_puts`` answered 403."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.p_503 = self.p_hang = 0.0
        self.hang_s = 2.0
        self.truncate = 0
        self.fail_puts: str | None = None
        self.limit: int | None = None  # 503s and hangs left to inject (None: no limit)
        self.injected = {"503": 0, "hang": 0, "truncated": 0, "put_refused": 0}
        self.log: list[tuple[str, str]] = []

    def set(self, **kw) -> Faults:
        for k, v in kw.items():
            setattr(self, k, v)
        return self

    def clear(self) -> Faults:
        return self.set(p_503=0.0, p_hang=0.0, truncate=0, fail_puts=None, limit=None)

    def draw(self, method: str, path: str) -> str | None:
        with self.lock:
            self.log.append((method, path))
            if method == "PUT" and self.fail_puts and re.search(self.fail_puts, path):
                self.injected["put_refused"] += 1
                return "refuse"
            if method != "GET" or path.rstrip("/").count("/") < 2 and not path.endswith((".tar", ".json")):
                return None  # bucket listings and the like
            if self.truncate:
                self.truncate -= 1
                self.injected["truncated"] += 1
                return "truncate"
            x = self.rng.random()
            if self.limit is not None:
                if self.limit <= 0:
                    return None
                if x < self.p_503 + self.p_hang:
                    self.limit -= 1
            if x < self.p_503:
                self.injected["503"] += 1
                return "503"
            if x < self.p_503 + self.p_hang:
                self.injected["hang"] += 1
                return "hang"
            return None

    def puts(self, pattern: str = "") -> list[str]:
        return [p for m, p in self.log if m == "PUT" and pattern in p]


class _FaultyApp:
    """WSGI middleware around moto's application."""

    def __init__(self, app, faults: Faults):
        self.app, self.faults = app, faults

    def __call__(self, environ, start_response):
        fault = self.faults.draw(environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""))
        if fault == "503":
            start_response(
                "503 Service Unavailable",
                [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOW_DOWN)))],
            )
            return [SLOW_DOWN]
        if fault == "refuse":
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = b"<Error><Code>AccessDenied</Code><Message>refused by the test</Message></Error>"
            start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if fault == "hang":
            time.sleep(self.faults.hang_s)
        if fault == "truncate":
            captured = {}

            def keep(status, headers, exc_info=None):
                captured["status"], captured["headers"] = status, headers

            body = b"".join(self.app(environ, keep))
            headers = [(k, v) for k, v in captured["headers"] if k.lower() not in ("content-length", "connection")]
            start_response(captured["status"], headers + [("Content-Length", str(len(body))), ("Connection", "close")])
            return [body[: len(body) // 2]]
        return self.app(environ, start_response)


class FaultyMotoServer(ThreadedMotoServer):
    """moto's threaded S3 server on 127.0.0.1 (a free port), its requests passing through :class:`Faults`."""

    def __init__(self, faults: Faults):
        super().__init__(ip_address="127.0.0.1", port=0, verbose=False)
        self.faults = faults

    def _server_entry(self) -> None:
        app = _FaultyApp(DomainDispatcherApplication(create_backend_app), self.faults)
        self._server = make_server(self._ip_address, self._port, app, True, request_handler=MotoRequestHandler)
        self._server_ready_event.set()
        self._server.serve_forever()

    @property
    def endpoint(self) -> str:
        host, port = self.get_host_and_port()
        return f"http://{host}:{port}"


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with single ``Range: bytes=a-b`` requests answered 206, through :class:`Faults`."""

    faults: Faults
    seen: list[str]  # the method of every request received
    auth: str | None = None  # "user:password": every request must carry it (HTTP basic auth), else 401
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _refused(self) -> bool:
        import base64

        self.seen.append(self.command)  # every request, answered or not

        if self.auth is None or self.headers.get("Authorization") == "Basic " + base64.b64encode(
            self.auth.encode()
        ).decode("ascii"):
            return False
        self.send_response(401)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def do_GET(self) -> None:
        if self._refused():
            return
        fault = self.faults.draw("GET", self.path)
        if fault == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if fault == "hang":
            time.sleep(self.faults.hang_s)
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        status, body = 200, data
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(len(data) - 1, int(m.group(2))) if m.group(2) else len(data) - 1
            if start >= len(data):
                self.send_error(416)
                return
            status, body = 206, data[start : end + 1]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        if fault == "truncate":
            self.send_header("Connection", "close")
            self.close_connection = True
            body = body[: len(body) // 2]
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        if self._refused():
            return
        path = Path(self.translate_path(self.path))
        if not path.is_file():
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(path.stat().st_size))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()


class RangeHTTPServer:
    """Serve ``root`` on 127.0.0.1 (a free port) in a thread; ``url`` is its base URL; ``auth`` (``user:password``):
    only requests with these basic-auth credentials are answered."""

    def __init__(self, root: Path, faults: Faults, auth: str | None = None):
        self.seen: list[str] = []
        handler = type("Handler", (_RangeHandler,), {"faults": faults, "auth": auth, "seen": self.seen})
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(root)))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.faults = faults

    def start(self) -> RangeHTTPServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requests(self) -> int:
        """How many requests it received."""
        return len(self.seen)


# credentials for moto only, and nothing read from the user's own AWS files
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def s3_server(faults: Faults) -> Iterator[FaultyMotoServer]:
    """A started :class:`FaultyMotoServer`, with test credentials in the environment (as a user would have theirs)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        server = FaultyMotoServer(faults)
        server.start()
        try:
            yield server
        finally:
            server.stop()

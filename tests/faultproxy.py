"""A small fault-injecting HTTP proxy in front of the loopback S3 server, for tests.

Point boto3 at ``FaultProxy.url`` instead of the S3 endpoint and a seeded fraction of
requests fails the way real S3 and real networks fail:

- ``5xx``: a 500 InternalError or 503 SlowDown with S3's XML error body, the request never
  reaching S3;
- ``drop``: the connection is closed without a response, either before the request is
  forwarded or AFTER S3 has executed it (the write happened but the client never heard).

Kinds: "500", "503", "drop-before", "drop-after". ``force`` pins a kind on the first request
matching a method and path substring (e.g. the second multipart part).

Faults are bounded (``max_faults``; rates < 1) so a run always finishes, reproducible
(``seed``), counted (``stats``), and the proxy only listens on and forwards to loopback.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import urlsplit

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_ERRORS = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's backlog of 5 would itself drop connections of a parallel multipart
    # upload under load: the only faults here are the ones this proxy injects.
    request_queue_size = socket.SOMAXCONN

    def handle_error(self, request, client_address) -> None:
        pass  # clients reset connections we dropped on purpose; nothing to report


class FaultProxy:
    """``with FaultProxy(upstream, error_rate=0.1, drop_rate=0.05) as proxy: ... proxy.url``."""

    def __init__(self, upstream: str, *, error_rate: float = 0.0, drop_rate: float = 0.0,
                 max_faults: int = 50, seed: int = 0,
                 force: list[tuple[str, str, str]] | None = None) -> None:
        parts = urlsplit(upstream)
        if parts.hostname not in _LOOPBACK or parts.scheme != "http":
            raise ValueError(f"FaultProxy forwards to loopback http only, not {upstream!r}")
        if not (0 <= error_rate < 1 and 0 <= drop_rate < 1 and error_rate + drop_rate < 1):
            raise ValueError("error_rate + drop_rate must be in [0, 1): some requests have to get through")
        self.upstream = (parts.hostname, parts.port or 80)
        self.error_rate, self.drop_rate, self.max_faults = error_rate, drop_rate, max_faults
        #: (method, path substring, fault kind) each applied to the first matching request, so a
        #: test can hit a precise step (a multipart part, CompleteMultipartUpload) for certain
        self._force = list(force or [])
        self.stats: Counter[str] = Counter()
        #: (method, path, outcome) per request in arrival order; outcome is the fault kind or
        #: the upstream status, so a test can check the order in which objects were written
        self.log: list[tuple[str, str, str]] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def faults(self) -> int:
        return sum(n for kind, n in self.stats.items() if kind != "requests")

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _decide(self, method: str, path: str) -> str | None:
        with self._lock:
            self.stats["requests"] += 1
            for i, (want_method, needle, kind) in enumerate(self._force):
                if method == want_method and needle in path:
                    del self._force[i]
                    self.stats[kind] += 1
                    return kind
            if self.faults >= self.max_faults:
                return None
            roll = self._rng.random()
            if roll < self.error_rate:
                kind = self._rng.choice(["500", "503"])
            elif roll < self.error_rate + self.drop_rate:
                kind = self._rng.choice(["drop-before", "drop-after"])
            else:
                return None
            self.stats[kind] += 1
            return kind

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
                pass

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _drop(self) -> None:
                self.close_connection = True
                self.connection.close()

            def _handle(self) -> None:
                body = self._read_body()
                fault = proxy._decide(self.command, self.path)
                with proxy._lock:
                    entry = len(proxy.log)
                    proxy.log.append((self.command, self.path, fault or "pending"))
                if fault == "drop-before":
                    return self._drop()
                if fault in ("500", "503"):
                    code, message = _ERRORS[int(fault)]
                    payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                               f"<Message>{message}</Message></Error>").encode()
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                with proxy._lock:
                    proxy.log[entry] = (self.command, self.path, fault or str(resp.status))
                if fault == "drop-after":
                    return self._drop()
                self.send_response(resp.status, resp.reason)
                for key, value in resp.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return None

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler

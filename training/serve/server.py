"""``python -m training.serve.server --model-dir DIR [--port 8080]``: the handler behind /ping and /invocations.

The container contract SageMaker hosting speaks to (docs.aws.amazon.com/sagemaker/latest/dg/
your-algorithms-inference-code.html): a web server on port 8080; ``GET /ping`` answers 200
with an empty body when the container is healthy (SageMaker gives it 2 seconds);
``POST /invocations`` carries the request body with its Content-Type and Accept headers and
must answer within 60 seconds. This server implements that contract for local use (the
demo, the tests, a quick look at a model directory on a workstation) and runs the handler of
training/serve/handler.py exactly as the SageMaker inference toolkit does (``model_fn`` once;
``input_fn`` -> ``predict_fn`` -> ``output_fn`` per request; a missing or ``*/*`` Accept becomes
``SAGEMAKER_DEFAULT_INVOCATIONS_ACCEPT``). On SageMaker the DLC's TorchServe is the server;
this one is not deployed.

Behaviour worth knowing:

- It listens at once and loads the model in the background: ``/ping`` is 503 ``loading`` until
  ``model_fn`` returns, then 200; if loading fails it stays 503 with the cause in one line
  (a missing or corrupt model directory, a graph for another target).
- Concurrency: one pipeline, one request at a time (training/serve/runtime.py holds its lock);
  requests wait in a bounded queue of ``--max-queue``; one more is answered 503 ``busy`` at
  once instead of waiting past the caller's timeout. The HTTP threads only parse and wait.
- Errors: a bad request is its 4xx with one line; a request that raises anything else is a
  500 with one line (the traceback goes to the log) and the server keeps serving. A body over
  the limit is refused from its Content-Length before it is read.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from training.errors import exits_cleanly
from training.serve import handler
from training.serve.errors import RequestError
from training.serve.spec import Limits

log = logging.getLogger(__name__)
DEFAULT_PORT = 8080
DEFAULT_QUEUE = 32


class ServingState:
    """The model (loading, ready or failed) and the bounded wait in front of it."""

    def __init__(self, model_dir: Path, *, max_queue: int = DEFAULT_QUEUE) -> None:
        self.model_dir = Path(model_dir)
        self.model: Any = None
        self.error: str | None = None
        self.ready = threading.Event()
        self.slots = threading.BoundedSemaphore(max_queue + 1)  # waiting + the one running
        self.max_queue = max_queue
        self.served = 0
        self.failed = 0
        self._count = threading.Lock()

    def load(self) -> None:
        try:
            self.model = handler.model_fn(str(self.model_dir))
        except Exception as exc:  # any load failure is reported on /ping, never raised in a thread
            self.error = " ".join(str(exc).split()) or type(exc).__name__
            log.error("serve: model failed to load: %s", self.error)
        finally:
            self.ready.set()

    def health(self) -> tuple[int, bytes]:
        if not self.ready.is_set():
            return 503, b"loading\n"
        if self.error is not None:
            return 503, f"unhealthy: {self.error}\n".encode()
        return 200, b""

    def invoke(self, body: bytes, content_type: str | None, accept: str | None) -> tuple[int, bytes, str]:
        """One request through the handler, as the toolkit's Transformer runs it."""
        status, payload = self.health()
        if status != 200:
            return status, payload, "text/plain"
        if not self.slots.acquire(blocking=False):
            return 503, f"busy: {self.max_queue} requests are already waiting; retry later\n".encode(), "text/plain"
        try:
            if not accept or accept.strip() == "*/*":
                accept = handler.default_accept()
            data = handler.input_fn(body.decode("utf-8") if _is_json(content_type) else body, content_type)
            prediction = handler.predict_fn(data, self.model)
            payload, media = handler.output_fn(prediction, accept)
            with self._count:
                self.served += 1
            return 200, payload, media
        except RequestError as exc:
            return exc.status_code, f"{exc.message}\n".encode(), "text/plain"
        except UnicodeDecodeError:
            return 400, b"request body is not UTF-8 JSON\n", "text/plain"
        except Exception as exc:  # the worker must survive whatever one request raises
            with self._count:
                self.failed += 1
            log.error("serve: request failed:\n%s", traceback.format_exc())
            line = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            return 500, f"inference failed: {line}\n".encode(), "text/plain"
        finally:
            self.slots.release()


def _is_json(content_type: str | None) -> bool:
    return (content_type or "application/json").split(";")[0].strip().lower() == "application/json"


def _handler_class(state: ServingState) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "sana-serve"

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, not stderr
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, body: bytes, media: str = "text/plain", close: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] == "/ping":
                self._send(*state.health())
            else:
                self._send(404, b"not found: this server answers GET /ping and POST /invocations\n")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != "/invocations":
                self._send(404, b"not found: this server answers GET /ping and POST /invocations\n", close=True)
                return
            length = self.headers.get("Content-Length")
            limit = int(os.environ.get(handler.MAX_BODY_ENV, Limits.max_body_bytes))
            if length is None or not length.isdigit():
                self._send(411, b"Content-Length required\n", close=True)
                return
            if int(length) > limit:  # refused unread: the connection is closed, not drained
                self._send(400, f"request body is {length} bytes; the limit is {limit}\n".encode(), close=True)
                return
            body = self.rfile.read(int(length))
            self._send(*state.invoke(body, self.headers.get("Content-Type"), self.headers.get("Accept")))

    return Handler


class _HTTPServer(http.server.ThreadingHTTPServer):
    # socketserver's listen backlog is 5 (Lib/socketserver.py, TCPServer.request_queue_size):
    # a burst of more connections than the accept thread takes at once overflowed it, and the
    # callers got no answer or a reset instead of the queue's 200 or 503 busy. The kernel caps
    # this at net.core.somaxconn.
    request_queue_size = socket.SOMAXCONN
    daemon_threads = True


class LocalServer:
    """The HTTP server and its model, started in threads; ``stop()`` ends both."""

    def __init__(self, model_dir: Path, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 max_queue: int = DEFAULT_QUEUE) -> None:
        self.state = ServingState(model_dir, max_queue=max_queue)
        self.httpd = _HTTPServer((host, port), _handler_class(self.state))
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> LocalServer:
        for target, name in ((self.state.load, "sana-serve-load"), (self.httpd.serve_forever, "sana-serve-http")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def wait_ready(self, timeout: float) -> None:
        if not self.state.ready.wait(timeout):
            raise TimeoutError(f"model in {self.state.model_dir} did not load within {timeout:g} s")

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def running(model_dir: Path, **kwargs: Any) -> Iterator[LocalServer]:
    """A started LocalServer for a ``with`` block (tests, the demo)."""
    server = LocalServer(model_dir, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


@exits_cleanly
def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m training.serve.server", description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="model directory (export/ [+ compiled/]) or a serving export")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default 8080, the SageMaker contract)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_QUEUE, help="requests that may wait for the model")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    server = LocalServer(Path(args.model_dir), host=args.host, port=args.port, max_queue=args.max_queue).start()
    print(f"serve: listening on {server.url} (GET /ping, POST /invocations); model loading from {args.model_dir}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()
        print("serve: stopped", file=sys.stderr)


if __name__ == "__main__":
    main()

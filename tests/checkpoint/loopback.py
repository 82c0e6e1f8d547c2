"""A real HTTP server on 127.0.0.1 for the checkpoint-URL tests: serves bytes by path, counts
the requests per path, answers 404 for unknown paths, and can cut a response off part way, stall
in the middle of one, answer an error status first, answer late, redirect, or stream a body of
any declared length (none, or a false one), or an endless one, at any pace."""
from __future__ import annotations

import collections
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Set

import pytest


class Loopback:
    """``files``: path -> bytes; ``cut``: paths whose response announces the full length, sends
    half of it and closes the connection; ``stall``: the same, but it then sends nothing more
    until the server closes; ``fail``: path -> HTTP statuses to answer first, one per request;
    ``delay``: path -> seconds to wait before answering; ``redirect``: path -> the ``Location``
    of a 302 answer; ``requests``: path -> GET count; ``streams`` (:meth:`stream`): path -> how
    to stream it; ``sent``: body bytes streamed per path."""

    #: A stream never lasts longer: a downloader without bounds fails its test instead of hanging it.
    STREAM_S = 8.0

    def __init__(self) -> None:
        self.files: Dict[str, bytes] = {}
        self.cut: Set[str] = set()
        self.stall: Set[str] = set()
        self.fail: Dict[str, List[int]] = {}
        self.delay: Dict[str, float] = {}
        self.redirect: Dict[str, str] = {}
        self.requests: Dict[str, int] = collections.Counter()
        self.streams: Dict[str, dict] = {}
        self.sent: Dict[str, int] = collections.Counter()
        self.closing = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    self.answer()
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout under test)
                    self.close_connection = True

            def answer(self) -> None:
                path = self.path  # the query string included: ``/uc?id=A`` and ``/uc?id=B`` are two files
                server.requests[path] += 1
                time.sleep(server.delay.get(path, 0.0))
                if path in server.streams:
                    self.stream(server.streams[path])
                    return
                if path in server.redirect:
                    self.send_response(302)
                    self.send_header("Location", server.redirect[path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = server.files.get(path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                if server.fail.get(path):
                    self.send_response(server.fail[path].pop(0))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", f'"{len(body)}-{path}"')
                self.end_headers()
                if path in server.stall:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    server.closing.wait()
                    self.close_connection = True
                    return
                if path in server.cut:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def stream(self, spec: dict) -> None:
                """``spec['body']`` in ``chunk``-byte pieces every ``every`` s, or ``fill * chunk``
                endlessly, after a ``Content-Length`` of ``declared`` (``None``: none; the body
                ends when the connection closes)."""
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if spec["declared"] is not None:
                    self.send_header("Content-Length", str(spec["declared"]))
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                body, chunk, every = spec["body"], spec["chunk"], spec["every"]
                end, at = time.monotonic() + server.STREAM_S, 0
                while time.monotonic() < end and (body is None or at < len(body)):
                    if every and server.closing.wait(every) or server.closing.is_set():
                        break
                    piece = body[at:at + chunk] if body is not None else spec["fill"] * chunk
                    self.wfile.write(piece)
                    self.wfile.flush()
                    at += len(piece)
                    server.sent[self.path] += len(piece)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True)
        self.thread.start()

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.root + path

    def serve(self, path: str, body: bytes) -> str:
        """Serve ``body`` at ``path``; its URL."""
        self.files[path] = body
        return self.url(path)

    def stream(self, path: str, declared: Optional[int], body: Optional[bytes] = None, fill: bytes = b"\0",
               chunk: int = 4096, every: float = 0.0) -> str:
        """Stream ``body`` (or ``fill`` endlessly) at ``path`` (:meth:`Handler.stream`); its URL."""
        self.streams[path] = dict(declared=declared, body=body, fill=fill, chunk=chunk, every=every)
        return self.url(path)

    def total(self) -> int:
        return sum(self.requests.values())

    def close(self) -> None:
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    """A :class:`Loopback` server for one test (import the fixture where it is used)."""
    srv = Loopback()
    yield srv
    srv.close()


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """A fresh ``$TORCH_HOME`` (and ``$MMENGINE_HOME``): the cache every download goes to."""
    home = tmp_path / "torch_home"
    monkeypatch.setenv("TORCH_HOME", str(home))
    monkeypatch.setenv("MMENGINE_HOME", str(tmp_path / "mmengine_home"))
    monkeypatch.setenv("SWIN_BACKBONE_DOWNLOAD_BACKOFF", "0.05")  # retries without the default's seconds
    return home

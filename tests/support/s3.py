"""A real S3-compatible server on loopback (nanio: objects are files, so it survives a restart)
and an HTTP proxy in front of it that injects 503 SlowDown, connection resets and outages."""

from __future__ import annotations

import http.client
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from support.ports import free_port

ACCESS_KEY = "resume-test"
SECRET_KEY = "resume-test-secret"

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")


def _wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class S3Server:
    """nanio on 127.0.0.1:<port>, data under ``data_dir``; stop/start/restart by pid."""

    def __init__(self, data_dir: str, port: int | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(os.path.dirname(data_dir), "nanio.log")
        self.restarts = 0

    def start(self) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        nanio = shutil.which("nanio", path=os.path.dirname(sys.executable)) or shutil.which("nanio")
        if nanio is None:
            raise RuntimeError("nanio is not installed (pip install -e '.[test]')")
        env = {**os.environ, "NANIO_ACCESS_KEY": ACCESS_KEY, "NANIO_SECRET_KEY": SECRET_KEY}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [nanio, "serve", "--data-dir", self.data_dir, "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-access-log", "--log-level", "warning"], env=env, stdout=log, stderr=log)
        _wait_for_port(self.port)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
        self.restarts += 1

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_bucket(self, name: str) -> None:
        os.makedirs(os.path.join(self.data_dir, name), exist_ok=True)


class _QuietServer(ThreadingHTTPServer):
    """A client dropping a connection the proxy reset on purpose is not news."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FaultProxy:
    """Forwards HTTP to the server; a share ``rate`` of requests gets a 503 SlowDown or a
    connection reset instead. ``restart_when(predicate)`` restarts the server once, in the
    middle of the request that matches (method, path)."""

    def __init__(self, server: S3Server, *, rate: float = 0.0, seed: int = 0) -> None:
        self.server = server
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "slowdown": 0, "reset": 0, "restart": 0, "upstream_down": 0}
        self._restart_predicate = None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _reset(self) -> None:
                # RST, not FIN: what a dying load balancer or server does to a client.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                self.connection.close()

            def _handle(self) -> None:
                body = self._body()
                fault = proxy._draw(self.command, self.path)
                if fault == "slowdown":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    self.wfile.write(SLOWDOWN)
                    return
                if fault == "reset":
                    self._reset()
                    return
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", proxy.server.port, timeout=60)
                    conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                            conn.putheader(k, v)
                    conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                    resp = conn.getresponse()
                    data = resp.read()
                    conn.close()
                except OSError:
                    with proxy.lock:
                        proxy.counts["upstream_down"] += 1
                    self._reset()
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "date", "server"):
                        self.send_header(k, v)
                # A HEAD answer carries the object's length, not its (empty) body's.
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def restart_when(self, predicate) -> None:
        self._restart_predicate = predicate

    def _draw(self, method: str, path: str) -> str | None:
        with self.lock:
            self.counts["requests"] += 1
            predicate = self._restart_predicate
            if predicate is not None and predicate(method, path):
                self._restart_predicate = None
                self.counts["restart"] += 1
                restart = True
            else:
                restart = False
            roll = self.rng.random()
        if restart:
            self.server.restart()  # this request then meets the new server
            return None
        if roll < self.rate / 2:
            with self.lock:
                self.counts["slowdown"] += 1
            return "slowdown"
        if roll < self.rate:
            with self.lock:
                self.counts["reset"] += 1
            return "reset"
        return None

    def start(self) -> FaultProxy:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def s3_env(endpoint: str) -> dict[str, str]:
    """What s3fs/botocore read: credentials and the endpoint, from the environment."""
    return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

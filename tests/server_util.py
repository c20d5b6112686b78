"""Running the OpenAI-compatible server in a background thread for tests, and raw HTTP requests to it."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass

from glm5next.server import start_server

MODEL = "tiny"


@dataclass
class Served:
    """A server running in its own thread and event loop."""

    server: object
    loop: asyncio.AbstractEventLoop
    engine: object

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def call(self, coro, timeout: float = 60.0):
        """Run `coro` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@contextlib.contextmanager
def serving(engine, grace: float = 5.0, **settings):
    """A server over `engine` with `ServerSettings` fields `settings`, closed (with `grace`) on exit."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(start_server(engine, MODEL, "127.0.0.1", 0, **settings))
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    served = Served(server, loop, engine)
    try:
        yield served
    finally:
        if not server.api.draining:
            served.call(server.close(grace))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def request(port: int, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 60.0):
    """(status, headers, parsed JSON body or raw bytes) of one request over a fresh connection; `body` is
    sent as JSON unless it is bytes; headers default to a JSON content type."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json"} if headers is None else headers)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = raw
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
    finally:
        conn.close()


def send_raw(port: int, data: bytes) -> bytes:
    """Everything the server answers to raw bytes `data` before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def wait_idle(engine, timeout: float = 10.0) -> bool:
    """Whether the engine holds no request within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_unfinished() == 0:
            return True
        time.sleep(0.02)
    return False

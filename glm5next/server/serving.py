"""The app served by uvicorn on one listening socket, started and stopped from a running event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket

import uvicorn

from .app import OpenAIServer
from .settings import WILDCARD_HOSTS, ServerSettings

SHUTDOWN_WAIT_S = 10
"""After draining, how long uvicorn waits for connections to finish before cancelling them."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server leaving SIGINT and SIGTERM to its owner, who drains live requests before stopping it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class Server:
    """`OpenAIServer` over `engine`, listening on (host, port) once started; `port` is the bound port."""

    def __init__(self, engine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000) -> None:
        if host not in WILDCARD_HOSTS and not _is_ip(host) and host not in settings.allowed_hosts:
            # the name it listens on is a name its clients use
            settings = dataclasses.replace(settings, allowed_hosts=settings.allowed_hosts + (host,))
        self.engine, self.host, self.port = engine, host, port
        self.api = OpenAIServer(engine, settings)
        self._uvicorn: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> "Server":
        """Start the engine's worker and listen; returns once connections are accepted."""
        self.engine.start()
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.api.asgi, lifespan="off", log_config=None, access_log=False,
                                server_header=False, timeout_graceful_shutdown=SHUTDOWN_WAIT_S)
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self

    async def wait(self) -> None:
        """Return when the HTTP server stops by itself (it failed)."""
        await asyncio.shield(self._task)

    async def close(self, grace: float = 5.0) -> None:
        """Drain (new requests refused, live ones given `grace` seconds, then ended with a final event), then
        stop listening and close the connections. The engine keeps running: shut it down after."""
        await self.api.drain(grace)
        self._uvicorn.should_exit = True
        await self._task


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host.strip("[]"))
        return True
    except OSError:
        return False


async def start_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, **settings) -> Server:
    """The OpenAI-compatible server over `engine` (an AsyncLLM), listening; `settings` are `ServerSettings`
    fields (api_key, allowed_hosts, ...)."""
    return await Server(engine, ServerSettings(model_name, **settings), host, port).start()

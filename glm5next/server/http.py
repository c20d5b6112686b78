"""A small HTTP/1.1 server on asyncio streams: keep-alive, Content-Length request bodies,
fixed-length and chunked (streamed) responses, an exact-path router. While a handler runs the
connection is watched; when the client goes away the handler and its stream are cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable
from urllib.parse import unquote, urlsplit

logger = logging.getLogger("glm5next.server")

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           411: "Length Required", 413: "Content Too Large", 431: "Request Header Fields Too Large",
           500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable",
           505: "HTTP Version Not Supported"}
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_READ_SIZE = 65536


class HTTPError(Exception):
    """A request answered with `status` (and extra `headers`)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    """Lower-case names; repeated headers joined with ', '."""
    body: bytes = b""


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj, status: int = 200) -> "Response":
        return cls(status, json.dumps(obj, separators=(",", ":")).encode())


@dataclass
class StreamingResponse:
    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable["Response | StreamingResponse"]]


class Router:
    """Exact-path routes; a trailing slash is ignored. HEAD falls back to GET."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self._routes.setdefault(path.rstrip("/") or "/", {})[method.upper()] = handler

    def resolve(self, method: str, path: str) -> Handler:
        methods = self._routes.get(path.rstrip("/") or "/")
        if methods is None:
            raise HTTPError(404, f"no route for {path}")
        handler = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            raise HTTPError(405, f"{method} is not allowed on {path} (allowed: {allowed})", {"Allow": allowed})
        return handler


def parse_head(head: bytes) -> Request:
    """The request line and headers (without the blank line), or HTTPError 400/505."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]):
        raise HTTPError(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        status = 505 if re.fullmatch(r"HTTP/\d\.\d", version) else 400
        raise HTTPError(status, f"unsupported protocol version {version!r}")
    if not target.startswith(("/", "http://", "https://")):  # origin form, or absolute form
        raise HTTPError(400, "malformed request target")
    split = urlsplit(target)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):
            raise HTTPError(400, "malformed header line")
        value = value.strip(" \t")
        if _BAD_VALUE.search(value):
            raise HTTPError(400, f"control character in header {name}")
        key = name.lower()  # a repeated Content-Length becomes "a, b", which is refused as malformed
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return Request(method, unquote(split.path or "/"), split.query, version, headers)


def _keep_alive(req: Request) -> bool:
    tokens = {t.strip().lower() for t in req.headers.get("connection", "").split(",")}
    return "keep-alive" in tokens if req.version == "HTTP/1.0" else "close" not in tokens


class _Conn:
    """A connection's reader with its own buffer, so a watcher may read ahead safely."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer, self.buf, self.eof = reader, writer, bytearray(), False
        self._read: asyncio.Future | None = None

    async def fill(self) -> bool:
        """Read more into the buffer; False at end of input. Cancelling this keeps the read pending."""
        if self.eof:
            return False
        if self._read is None:
            self._read = asyncio.ensure_future(self.reader.read(_READ_SIZE))
        await asyncio.wait({self._read})
        task, self._read = self._read, None
        data = b"" if task.cancelled() or task.exception() else task.result()
        self.buf += data
        self.eof = not data
        return bool(data)

    async def read_head(self, limit: int) -> bytes | None:
        """The next request head; None when the client closed between requests."""
        while True:
            while self.buf[:2] == b"\r\n":  # blank lines before a request line are allowed
                del self.buf[:2]
            end = self.buf.find(b"\r\n\r\n")
            if (end if end >= 0 else len(self.buf)) > limit:
                raise HTTPError(431, "request head too large")
            if end >= 0:
                head = bytes(self.buf[:end])
                del self.buf[: end + 4]
                return head
            if not await self.fill():
                if self.buf:
                    raise ConnectionError("the client closed the connection mid-request")
                return None

    async def read_body(self, size: int) -> bytes:
        while len(self.buf) < size:
            if not await self.fill():
                raise ConnectionError("the client closed the connection mid-body")
        body, self.buf = bytes(self.buf[:size]), self.buf[size:]
        return body


class ClientGone(Exception):
    """The client closed its connection while its request was being answered."""


class HTTPServer:
    """Serves `app(request)` on (host, port); `error_response(HTTPError)` renders the error replies."""

    def __init__(self, app: Handler, error_response: Callable[[HTTPError], Response], host: str = "127.0.0.1",
                 port: int = 8000, max_body: int = 32 << 20, max_head: int = 64 << 10,
                 idle_timeout: float = 120.0, body_timeout: float = 60.0) -> None:
        self.app, self.error_response, self.host, self.port = app, error_response, host, port
        self.max_body, self.max_head = max_body, max_head
        self.idle_timeout, self.body_timeout = idle_timeout, body_timeout
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[asyncio.Task, bool] = {}  # connection task -> busy answering a request
        self._closing = False

    async def start(self) -> "HTTPServer":
        self._server = await asyncio.start_server(self._serve, self.host, self.port, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self, grace: float = 5.0) -> None:
        """Stop listening, let busy connections finish for up to `grace` seconds, then cancel the rest."""
        self._closing = True
        self._server.close()
        for task in [t for t, busy in self._conns.items() if not busy]:
            task.cancel()
        if self._conns:
            _, pending = await asyncio.wait(list(self._conns), timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self._server.wait_closed()

    # ----------------------------------------------------------- connections
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns[task] = False
        conn = _Conn(reader, writer)
        try:
            while not self._closing and await self._one(conn, task):
                pass
        except (ConnectionError, ClientGone, asyncio.CancelledError):  # gone, or server shutdown: end quietly
            pass
        except Exception:
            logger.exception("connection handler failed")
        finally:
            self._conns.pop(task, None)
            if conn._read is not None:
                conn._read.cancel()
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass

    async def _one(self, conn: _Conn, task: asyncio.Task) -> bool:
        """Read and answer one request; False when the connection should close."""
        try:
            head = await asyncio.wait_for(conn.read_head(self.max_head), self.idle_timeout)
            if head is None:
                return False
            self._conns[task] = True
            req = parse_head(head)
            await self._read_body(conn, req)
        except asyncio.TimeoutError:
            if conn.buf:
                await self._write(conn, None, self.error_response(HTTPError(408, "timed out reading")), False)
            return False
        except HTTPError as e:
            await self._write(conn, None, self.error_response(e), False)
            await self._linger(conn)
            return False
        keep = _keep_alive(req) and not self._closing
        resp = await self._guarded(conn, self._call(req))
        ok = await self._guarded(conn, self._write(conn, req, resp, keep))
        self._conns[task] = False
        return ok and keep

    async def _read_body(self, conn: _Conn, req: Request) -> None:
        if "transfer-encoding" in req.headers:
            raise HTTPError(411, "request bodies need Content-Length (Transfer-Encoding is not supported)")
        length = req.headers.get("content-length")
        if length is None:
            return
        if not (length.isascii() and length.isdigit()):
            raise HTTPError(400, f"malformed Content-Length {length!r}")
        size = int(length)
        if size > self.max_body:
            raise HTTPError(413, f"the request body has {size} bytes; the limit is {self.max_body}")
        if req.headers.get("expect", "").lower() == "100-continue" and len(conn.buf) < size:
            conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            req.body = await asyncio.wait_for(conn.read_body(size), self.body_timeout)
        except asyncio.TimeoutError:
            raise HTTPError(408, "timed out reading the request body") from None

    async def _call(self, req: Request) -> Response | StreamingResponse:
        try:
            return await self.app(req)
        except HTTPError as e:
            return self.error_response(e)
        except Exception:
            logger.exception("the handler of %s %s failed", req.method, req.path)
            return self.error_response(HTTPError(500, "internal server error"))

    async def _guarded(self, conn: _Conn, coro):
        """Await `coro`, cancelling it (and raising ClientGone) if the client disconnects first."""
        work = asyncio.ensure_future(coro)
        try:
            while not work.done() and len(conn.buf) <= self.max_body:  # past that, stop reading ahead
                if conn.eof:
                    raise ClientGone()
                watch = asyncio.ensure_future(conn.fill())
                try:  # on end of input the loop's next turn sees conn.eof
                    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    watch.cancel()
            await asyncio.wait({work})
            return work.result()
        finally:
            if not work.done():
                work.cancel()
                await asyncio.wait({work})

    async def _linger(self, conn: _Conn, seconds: float = 2.0) -> None:
        """After an error reply, drop what the client still sends, so it sees the reply, not a reset."""
        async def drop() -> None:
            while await conn.fill():
                conn.buf.clear()

        try:
            conn.writer.write_eof()
            await asyncio.wait_for(drop(), seconds)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass

    # -------------------------------------------------------------- responses
    async def _write(self, conn: _Conn, req: Request | None, resp, keep: bool) -> bool:
        """Send `resp` (only its head for HEAD); False when the client is gone."""
        streaming = isinstance(resp, StreamingResponse)
        chunked = streaming and req is not None and req.version == "HTTP/1.1"
        keep = keep and (chunked or not streaming)
        fields = {"Content-Type": resp.content_type, "Connection": "keep-alive" if keep else "close", **resp.headers}
        if streaming:
            fields.update({"Cache-Control": "no-cache", **({"Transfer-Encoding": "chunked"} if chunked else {})})
        else:
            fields["Content-Length"] = str(len(resp.body))
        head = f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'Unknown')}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        head_only = req is not None and req.method == "HEAD"
        w = conn.writer
        try:
            w.write(head.encode("latin-1") + (b"" if streaming or head_only else resp.body))
            await w.drain()
            if streaming and not head_only:
                async for chunk in resp.chunks:
                    if chunk:
                        w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                        await w.drain()
                if chunked:
                    w.write(b"0\r\n\r\n")
                    await w.drain()
            return keep
        except (ConnectionError, OSError):
            return False
        finally:
            if streaming and hasattr(resp.chunks, "aclose"):
                await resp.chunks.aclose()

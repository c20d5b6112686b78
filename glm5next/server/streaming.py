"""Watching the client while a request is read and answered: a body that is too big or too slow is refused,
and a client that goes away cancels the work for it (and so aborts its engine request), whether the reply is
streamed or not."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request

from .api import ApiError

logger = logging.getLogger("glm5next.server")

EVENT_STREAM_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
"""Server-sent events, not cached, not buffered by proxies."""


class ClientGone(Exception):
    """The client closed its connection before its reply was ready."""


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body: at most `limit` bytes (else 413), arrived within `timeout` seconds (else 408; a client
    trickling it would hold its place forever). A client gone mid-body raises ClientGone."""
    length = request.headers.get("content-length")
    close = {"Connection": "close"}  # the rest of the body is not read
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {int(length)} bytes; the limit is {limit}", headers=close)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the limit of {limit} bytes", headers=close)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", headers=close) from None
    except ClientDisconnect:
        raise ClientGone() from None


async def _disconnected(receive) -> None:
    """Return once the client has gone (the request body must have been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnected(work: Awaitable, receive) -> asyncio.Future:
    """Run `work` until it ends or the client goes away first (then `work` is cancelled): its task, done."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return task


async def unless_disconnected(work: Awaitable, receive):
    """The result of `work`; if the client goes away first, `work` is cancelled and ClientGone raised."""
    task = await _until_disconnected(work, receive)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream:
    """An ASGI response sending `events` (server-sent events, bytes) as they come; if the client goes away
    the stream is cancelled and closed. `on_close` runs once the response is over, however it ended."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events, self.on_close = events, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM_HEADERS})
            pump = await _until_disconnected(self._pump(send), receive)
            if not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()
        finally:
            await self.events.aclose()
            self.on_close()

    async def _pump(self, send) -> None:
        try:
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # servers on ASGI 2.4 report a client gone mid-send this way
            logger.debug("a client went away mid-stream")

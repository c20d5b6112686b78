"""ASGI middleware around the API, outermost first: the access log (and request counts), the Host
allow-list, then (inside CORS) the API key and the JSON content type. A refusal is an OpenAI error body."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import time

from .api import ApiError
from .metrics import ServerMetrics, route_of

access_logger = logging.getLogger("glm5next.access")

LOOPBACK_NAMES = ("localhost",)
"""Host names that always reach this machine (and `*.localhost`)."""


async def send_error(send, e: ApiError) -> None:
    """Answer with `e`'s OpenAI error body."""
    body = json.dumps(e.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class AccessLog:
    """One log line per HTTP request once it is answered (client, request line, status, bytes, seconds),
    and the request count by route and status."""

    def __init__(self, app, metrics: ServerMetrics, enabled: bool = True) -> None:
        self.app, self.metrics, self.enabled = app, metrics, enabled

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, sent = time.monotonic(), 0, 0

        async def watch(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.http_requests.labels(route_of(scope["path"]), str(status or 500)).inc()
            if self.enabled:
                client = scope.get("client")
                who = f"{client[0]}:{client[1]}" if client else "-"
                query = "?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else ""
                access_logger.info('%s "%s %s%s HTTP/%s" %s %d %.3fs', who, scope["method"], scope["path"], query,
                                   scope["http_version"], status or "-", sent, time.monotonic() - start)


def host_name(header: str) -> str:
    """The name in a Host header, without its port, lower case (IPv6 literals without brackets)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether Host `name` may reach the server: an IP literal (a DNS-rebinding page always sends a domain
    name), a loopback name, or a name in `allowed` (`*` any, `.example.com` or `*.example.com` subdomains)."""
    name = name.rstrip(".")
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    for a in allowed:
        a = a.lower().rstrip(".")
        if a == "*" or a == name or (a.startswith(("*.", ".")) and name.endswith(a.lstrip("*"))):
            return True
    return False


class HostCheck:
    """Refuses requests whose Host header names a host not allowed (a web page whose domain was re-pointed
    at this machine, DNS rebinding, would otherwise reach the server from the victim's browser)."""

    def __init__(self, app, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if host is not None and not host_allowed(host_name(host), self.allowed):
                name = host_name(host)
                return await send_error(send, ApiError(
                    400, f"the Host header {name!r} is not allowed: start the server with --allowed-hosts {name} "
                         f"to accept it", code="host_not_allowed"))
        await self.app(scope, receive, send)


class Authorization:
    """`/v1` routes need `Authorization: Bearer <api_key>` when the server has a key; POST bodies must be
    declared `application/json` (a browser sends `text/plain` across origins without asking first)."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                return await send_error(send, error)
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> ApiError | None:
        if self.key is not None and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = _header(scope, b"authorization") or ""
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode("latin-1"), self.key):
                what = "no API key was given" if not given else "the API key is not valid"
                return ApiError(401, f"{what}: send it as 'Authorization: Bearer <key>'", code="invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                got = f"not {kind!r}" if kind else "and this request has no Content-Type"
                return ApiError(415, f"request bodies must be JSON sent with 'Content-Type: application/json', {got}",
                                code="unsupported_media_type")
        return None

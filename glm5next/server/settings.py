"""What a server is configured with beyond its engine: the model's name, who may call it, and its limits."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_BODY_BYTES = 32 << 20
"""The largest request body accepted by default (413 beyond)."""
BODY_TIMEOUT_S = 60.0
"""How long a request body may take to arrive by default (408 beyond)."""
SHUTDOWN_TIMEOUT_S = 30.0
"""How long live requests may run on after a shutdown begins before they are ended."""
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Bind addresses that listen on every interface."""


@dataclass(frozen=True)
class ServerSettings:
    """A server's name for its model, access rules and limits."""

    model_name: str
    api_key: str | None = None
    """Callers of `/v1` routes must send `Authorization: Bearer <api_key>` (None: anyone may call)."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted beside IP literals and loopback names (`*` any, `.example.com` subdomains)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins whose web pages may call the API (CORS; `*` any); empty: CORS is off."""
    max_concurrent_requests: int = 256
    """Generation requests held at once (tokenizing, waiting or running); more are answered 503."""
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    access_log: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name={self.model_name!r} must be a non-empty string")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)
                                         or not self.api_key.isascii()):
            raise ValueError("the API key must be a non-empty ASCII string without spaces")
        for name in ("max_concurrent_requests", "max_body_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(self.body_timeout_s, (int, float)) or not self.body_timeout_s > 0:
            raise ValueError(f"body_timeout_s={self.body_timeout_s!r} must be a positive number of seconds")
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name}={value!r} must be a tuple of non-empty strings")


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_list(text: str | None) -> tuple[str, ...]:
    """The items of a comma-separated command-line list."""
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())

"""The gateway app's ASGI middleware: requests counted by endpoint and status, API keys checked and bodies bounded
before they are read."""

from __future__ import annotations

import asyncio

from nesa_node.gateway.auth import ADMIN_KEY_NEEDED, KEY_NEEDED, ApiKeys
from nesa_node.gateway.requests import ApiError
from nesa_node.metrics import GatewayMetrics

BODY_TIMEOUT_S = (
    30.0  # how long a request's body may take to arrive whole (a slow one holds its bytes meanwhile; guess)
)
BODIES_BUFFERED = 64  # bodies of the largest size taken the gateway reads at once, all callers together (guess)
MANAGING = frozenset({"/v1/adapters/load", "/v1/adapters/unload"})  # what admin keys guard, where there are any
ENDPOINTS = frozenset(
    {"/", "/api/swarm", "/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"} | MANAGING
)


class CountRequests:
    """ASGI middleware counting answered requests by endpoint and status. Any other path counts as "other": the
    label's values stay bounded whatever paths clients make up. (Starlette's BaseHTTPMiddleware would copy every
    streamed chunk through a queue of its own.)"""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = "500"  # unless the app starts a response

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.requests_total.labels(endpoint, status).inc()


class LimitBody:
    """ASGI middleware reading each request's body before the app does, at most `max_bytes` of it: a larger one is
    refused with 413 (at once when its Content-Length says so), never held whole in memory nor parsed. Bodies being
    read hold their Content-Length (`max_bytes` for a chunked one) of `budget_bytes`, shared by all callers: past it a
    request is refused at once (503 `server_busy`), so clients trickling bodies over many connections cannot make
    the gateway hold more. A body not whole within `timeout_s` is refused (408 `request_timeout`) and its bytes let
    go."""

    def __init__(self, app, max_bytes: int, *, budget_bytes: int | None = None, timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.budget_bytes = BODIES_BUFFERED * max_bytes if budget_bytes is None else budget_bytes
        self.reading = 0  # bytes of budget held by bodies being read

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(scope, receive, send)
            return
        # what this body may come to: HTTP/1.1 gives a body without a Content-Length only in chunks
        held = int(declared) if declared is not None else self.max_bytes if b"transfer-encoding" in headers else 0
        if held and self.reading + held > self.budget_bytes:
            message = "the gateway is reading its most request bodies at once: retry later"
            await ApiError(503, message, kind="server_error", code="server_busy").response()(scope, receive, send)
            return
        self.reading += held
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout_s if held else None):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # the client went away before its request was whole
                        return
                    size += len(message.get("body", b""))
                    if size > self.max_bytes:
                        await self._too_large(scope, receive, send)
                        return
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            message = f"the request body did not arrive whole within {self.timeout_s:g} s"
            await ApiError(408, message, code="request_timeout").response()(scope, receive, send)
            return
        finally:
            self.reading -= held
        replayed = False

        async def body_then_rest():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, body_then_rest, send)

    async def _too_large(self, scope, receive, send) -> None:
        message = f"the request body is larger than this gateway takes ({self.max_bytes} bytes)"
        await ApiError(413, message, code="request_too_large").response()(scope, receive, send)


class RequireKey:
    """ASGI middleware refusing a `/v1/*` request without one of `api_keys` or `admin_keys` (401 `invalid_api_key`,
    gateway/auth.py) before anything of its body is read: a caller without a key costs the gateway no body and no
    parse. `api_keys` None: no keys, every request goes on. With `admin_keys`, managing adapters (MANAGING) without
    one of them is a 403 `permission_error` here too, before the body."""

    def __init__(self, app, api_keys: ApiKeys | None, admin_keys: ApiKeys | None = None):
        self.app, self.api_keys, self.admin_keys = app, api_keys, admin_keys

    def _allows(self, authorization: str | None) -> bool:
        return self.api_keys.allows(authorization) or (
            self.admin_keys is not None and self.admin_keys.allows(authorization)
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            # the first Authorization header, as the app's request.headers.get reads it
            raw = next((value for name, value in scope["headers"] if name == b"authorization"), None)
            authorization = raw.decode("latin-1") if raw is not None else None
            refusal = None
            if self.api_keys is not None and not self._allows(authorization):
                refusal = ApiError(401, KEY_NEEDED, code="invalid_api_key")
            elif (
                self.admin_keys is not None and scope["path"] in MANAGING and not self.admin_keys.allows(authorization)
            ):
                refusal = ApiError(403, ADMIN_KEY_NEEDED, kind="permission_error")
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


__all__ = ["BODIES_BUFFERED", "BODY_TIMEOUT_S", "ENDPOINTS", "CountRequests", "LimitBody", "RequireKey"]

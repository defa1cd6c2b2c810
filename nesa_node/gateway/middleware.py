"""The gateway app's ASGI middleware: requests counted by endpoint and status, API keys checked and bodies bounded
before they are read."""

from __future__ import annotations

from nesa_node.gateway.auth import ADMIN_KEY_NEEDED, KEY_NEEDED, ApiKeys
from nesa_node.gateway.requests import ApiError
from nesa_node.metrics import GatewayMetrics

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
    refused with 413 (at once when its Content-Length says so), never held whole in memory nor parsed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its request was whole: no work
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
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


__all__ = ["ENDPOINTS", "CountRequests", "LimitBody", "RequireKey"]

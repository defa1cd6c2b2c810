"""Every error the gateway's app answers, in OpenAI's shape {"error": {"message", "type", "param", "code"}}: its own
refusals (ApiError), requests that do not parse, the swarm's typed errors, Starlette's own refusals (a path or a
method the app does not serve) and, as a 500 whose traceback goes to the log only, a fault of the gateway's own."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nesa_node.errors import (
    AdapterBudgetError,
    CacheBudgetError,
    NesaError,
    NoRouteError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
)
from nesa_node.gateway.requests import ApiError, shown

logger = logging.getLogger(__name__)

__all__ = ["CAPACITY", "add_error_handlers"]

# refusals for want of room on the nodes (the session's cache, the caller's share, an adapter budget in use): the
# swarm's state, not the request's fault
CAPACITY = (AdapterBudgetError, CacheBudgetError, QuotaExceededError, TooManySessionsError)
SERVED = (
    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /v1/adapters/load and /unload, GET /health, "
    "GET /metrics, the dashboard at /"
)


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's shape (see the module docstring)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            error = (first.get("ctx") or {}).get("error", "")
            return ApiError(400, f"the request body is not valid JSON: {error}".rstrip(": ")).response()
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return ApiError(400, f"{param or 'request'}: {first.get('msg', 'invalid request')}", param=param).response()

    @app.exception_handler(HTTPException)
    async def starlette_refusal(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals: a path it does not serve (404), a method a path does not take (405), a body it
        cannot read (400)."""
        path = shown(request.url.path)
        if exc.status_code == 404:
            message, code = f"there is no {path} on this gateway (it serves {SERVED})", "not_found"
        elif exc.status_code == 405:
            message, code = (
                f"{shown(request.method, 20)} is not taken by {path} (it serves {SERVED})",
                "method_not_allowed",
            )
        else:
            message, code = shown(str(exc.detail), 300), None
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        response = ApiError(exc.status_code, message, kind=kind, code=code).response()
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(NoRouteError)
    async def no_route(request: Request, exc: NoRouteError) -> JSONResponse:
        return ApiError(503, exc.message, kind="server_error", code=exc.code).response()

    @app.exception_handler(PeerUnavailableError)
    async def unavailable(request: Request, exc: PeerUnavailableError) -> JSONResponse:
        return ApiError(503, exc.message, kind="server_error", code=exc.code).response()

    @app.exception_handler(NesaError)
    async def refused(request: Request, exc: NesaError) -> JSONResponse:
        """Any other typed error: a node's refusal of what this request asks (its adapter, its length) is the
        request's (400); the swarm's capacity (no room for the session, the adapter or the caller's share of either:
        worth trying again later) and the rest are 503."""
        status = 400 if isinstance(exc, RequestError) and not isinstance(exc, CAPACITY) else 503
        kind = "invalid_request_error" if status == 400 else "server_error"
        return ApiError(status, exc.message, kind=kind, code=exc.code).response()

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception) -> JSONResponse:
        """A fault of the gateway's own, in OpenAI's shape (its traceback goes to the log, not to the caller)."""
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        message = f"internal error: {type(exc).__name__}"
        return ApiError(500, message, kind="server_error", code="internal").response()

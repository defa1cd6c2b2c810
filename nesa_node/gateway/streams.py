"""Streamed answers: their server-sent events, and a response for them that cannot outlive its reader.

`answer_events` writes OpenAI's chunks of a generation, one `data: {json}` each, an error event when the generation
fails after the stream started, and `data: [DONE]` at the end.

A client that stops reading fills its socket's buffers, and the server's next write then waits for it forever: the
request's generation slot and its swarm session with it. `EventStream` gives each write `send_timeout_s`; past it the
stream ends there (the server closes the connection), its events' generator is closed (so the generation's slot is
freed and its session closed at once), and `on_close` runs. A client that goes away ends the stream the same way.
The server then closes the connection; the ERROR line uvicorn writes about a response left unfinished is dropped for
such a stream (`quiet_cut_streams`): the gateway's own INFO line says what happened, and an operator's log shows no
error for a client that stalled.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from nesa_node.errors import NesaError
from nesa_node.gateway.answers import Generation, answer_id, event, usage
from nesa_node.gateway.requests import ApiError, ChatRequest, CompletionRequest

logger = logging.getLogger(__name__)

# a reader that takes nothing for this long is gone or stuck: a live client reads a chunk within milliseconds, a
# slow link within seconds (guess, generous for mobile links; `Gateway(send_timeout_s=...)`)
SEND_TIMEOUT_S = 30.0

__all__ = ["SEND_TIMEOUT_S", "EventStream", "answer_events", "quiet_cut_streams"]

# True in a request's task once its stream was cut for a reader that took nothing (`EventStream`)
_CUT = contextvars.ContextVar("nesa_stream_cut", default=False)
UNFINISHED = "ASGI callable returned without completing response."  # uvicorn's line, at ERROR (protocols/http)


class _QuietCutStreams(logging.Filter):
    """Drops uvicorn's line about an unfinished response where the gateway cut that stream itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == UNFINISHED and _CUT.get())


def quiet_cut_streams() -> None:
    """Install the filter on uvicorn's error logger (once): uvicorn writes that line in the request's task, right
    after the app returned, where `_CUT` reads what `EventStream` set."""
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(known, _QuietCutStreams) for known in uvicorn_log.filters):
        uvicorn_log.addFilter(_QuietCutStreams())


class EventStream(StreamingResponse):
    """A `text/event-stream` response of `events`, each write bounded by `send_timeout_s`; `on_close` runs once the
    response is over, however it ended (all sent, the reader too slow or gone, the request cancelled)."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        send_timeout_s: float = SEND_TIMEOUT_S,
        on_close: Callable[[], None] = lambda: None,
    ):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.send_timeout_s = send_timeout_s
        self.on_close = on_close
        self.cut = False  # ended for a reader that took nothing (the response is left unfinished)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.cut:  # here, in the request's task (Starlette may write the body in a task of its own)
                _CUT.set(True)
            try:
                await self.body_iterator.aclose()  # a stream never started (the request cancelled first): none runs
            finally:
                self.on_close()

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            async with asyncio.timeout(self.send_timeout_s):
                await send(message)

        # closed on every way out, cancellation included: its generation's slot and session are freed now, not when
        # the garbage collector finds the generator
        async with contextlib.aclosing(self.body_iterator):
            try:
                await bounded({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await bounded({"type": "http.response.body", "body": chunk, "more_body": True})
                await bounded({"type": "http.response.body", "body": b"", "more_body": False})
            except TimeoutError:
                # the response is left unfinished: the server closes the connection, and the client sees its stream
                # cut (uvicorn's line about it is dropped: `quiet_cut_streams`)
                self.cut = True
                logger.info("a client took nothing of its stream for %.0f s: the stream is ended", self.send_timeout_s)


async def answer_events(
    request: CompletionRequest | ChatRequest, updates: AsyncGenerator[tuple[Generation, str], None]
) -> AsyncGenerator[bytes, None]:
    """The server-sent events of a streamed answer to `request`, from its generation's `updates` (gateway/app.py
    `Gateway.generate`), which are closed with these events."""
    chat = isinstance(request, ChatRequest)
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    base = {
        "id": answer_id(chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.model,
    }

    def chunk(piece: str | None, finish_reason: str | None, *, role: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if piece:
                delta["content"] = piece
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish_reason}
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return event(body)

    generation = None
    # closed with this stream (its client gone or too slow), so the generation's slot and session are freed at once
    async with contextlib.aclosing(updates):
        try:
            if chat:
                yield chunk(None, None, role=True)
            async for update in updates:
                generation, piece = update
                if piece:
                    yield chunk(piece, None)
            yield chunk(None, generation.finish_reason)
            if include_usage:
                yield event({**base, "choices": [], "usage": usage(generation)})
        except NesaError as exc:
            yield event({"error": {"message": exc.message, "type": "server_error", "param": None, "code": exc.code}})
        except ApiError as exc:  # no room left after all (check_room)
            yield event({"error": {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}})
        except Exception as exc:  # the stream has started: the error goes in it, and the stream still ends
            logger.exception("a streamed answer failed")
            yield event({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                   "param": None, "code": "internal"}})  # fmt: skip
    yield b"data: [DONE]\n\n"

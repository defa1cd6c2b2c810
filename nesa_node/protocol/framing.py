"""Streaming RPCs served with limits: every frame's length is checked before its bytes are read.

hivemind frames a protobuf stream as (marker byte, 8-byte big-endian length, payload) and its own stream
handler reads whatever length a peer declares, so one header claiming 2**60 bytes makes the receiver buffer
until memory runs out. `serve_stream` speaks the same framing (hivemind clients call it unchanged) but:

  - refuses a frame longer than `max_frame_bytes` as soon as its header arrives (`MessageTooLargeError`);
  - answers an unparseable payload or an unknown marker with `BadRequestError`;
  - sends those errors as hivemind's RPCError frame with text "[code] message", then closes the stream;
  - when it ends a stream the peer is still writing to, first drops the peer's bytes for up to `linger_s`
    (closing with unread bytes would reset the connection and could lose the answers already sent);
  - holds at most `max_prefetch` parsed requests the handler has not taken yet (the peer then waits on TCP).

Unary RPCs go through p2pd's persistent connection, which bounds their size itself (4 MiB by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from google.protobuf.message import DecodeError, Message
from hivemind.p2p import P2P, P2PContext
from hivemind.proto.p2pd_pb2 import RPCError

from nesa_node.errors import BadRequestError, MessageTooLargeError, NesaError, RequestError

logger = logging.getLogger(__name__)

StreamHandler = Callable[[AsyncIterator[Message], P2PContext], AsyncIterator[Message]]

_HEADER_BYTES = P2P.HEADER_LEN  # 8, big-endian payload length


async def read_frame(reader: asyncio.StreamReader, message_type: type[Message], max_frame_bytes: int) -> Message | None:
    """One request from a peer's stream; None at its end (an RPCError frame, as hivemind ends streams).

    Raises MessageTooLargeError before reading an oversized payload, BadRequestError for bytes that are not a
    frame of `message_type`, and asyncio.IncompleteReadError when the peer closes mid-frame.
    """
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise BadRequestError(f"unknown frame marker {marker!r}; expected a hivemind protobuf stream")
    length = int.from_bytes(await reader.readexactly(_HEADER_BYTES), P2P.BYTEORDER)
    if length > max_frame_bytes:
        raise MessageTooLargeError(f"frame of {length} bytes exceeds this node's limit of {max_frame_bytes} bytes")
    payload = await reader.readexactly(length)
    message = message_type() if marker == P2P.MESSAGE_MARKER else RPCError()
    try:
        message.ParseFromString(payload)
    except DecodeError as exc:
        raise BadRequestError(f"unparseable {type(message).__name__} protobuf: {exc}") from None
    return message if marker == P2P.MESSAGE_MARKER else None


async def _discard_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> None:
    """Read and drop what the peer still sends, until it closes or `timeout_s` passes. Closing a socket with
    unread bytes resets the connection, and a reset can drop our last answers before the peer reads them."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            while await reader.read(1 << 16):
                pass


def error_frame(error: NesaError) -> RPCError:
    return RPCError(message=f"[{error.code}] {error.message}")


async def serve_stream(
    p2p: P2P,
    name: str,
    handler: StreamHandler,
    request_type: type[Message],
    *,
    max_frame_bytes: int,
    max_prefetch: int = 4,
    linger_s: float = 1.0,
) -> None:
    """Register `handler` (requests, context) -> responses as stream RPC `name` on `p2p`, with frame limits."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        requests: asyncio.Queue = asyncio.Queue(max_prefetch)

        async def incoming() -> AsyncIterator[Message]:
            while (request := await requests.get()) is not None:
                yield request

        async def respond() -> None:
            try:
                async for response in handler(incoming(), context):
                    try:
                        await P2P.send_protobuf(response, writer)
                    except Exception as exc:  # the caller went away
                        logger.debug("%s: could not send a response: %r", name, exc)
                        return
            except Exception as exc:
                logger.warning("%s: handler failed: %r", name, exc, exc_info=True)
                with contextlib.suppress(Exception):
                    await P2P.send_protobuf(error_frame(NesaError(f"handler failed: {type(exc).__name__}")), writer)

        with contextlib.closing(writer):
            responding = asyncio.create_task(respond())
            try:
                while True:
                    receiving = asyncio.ensure_future(read_frame(reader, request_type, max_frame_bytes))
                    await asyncio.wait({responding, receiving}, return_when=asyncio.FIRST_COMPLETED)
                    if responding.done():  # the handler ended the stream (it may not have read everything)
                        receiving.cancel()
                        await _discard_until_closed(reader, linger_s)
                        return
                    try:
                        request = receiving.result()
                    except asyncio.IncompleteReadError:  # the caller closed the stream or died
                        return
                    except RequestError as exc:  # refuse the frame, end the stream; nothing else disturbed
                        logger.debug("%s: refused a frame from %s: %s", name, stream_info.peer_id, exc)
                        responding.cancel()
                        with contextlib.suppress(Exception):
                            await P2P.send_protobuf(error_frame(exc), writer)
                        await _discard_until_closed(reader, linger_s)
                        return
                    await requests.put(request)  # None (end of stream) is passed on too
                    if request is None:
                        await responding
                        return
            except Exception as exc:
                logger.debug("%s: stream from %s failed: %r", name, stream_info.peer_id, exc)
            finally:
                responding.cancel()

    await p2p.add_binary_stream_handler(name, handle)

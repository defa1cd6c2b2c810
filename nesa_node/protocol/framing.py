"""libp2p streams as Channels, with limits: every frame's length is checked before its bytes are read.

hivemind frames a protobuf stream as (marker byte, 8-byte big-endian length, payload); an RPCError frame with an
empty message ends a stream, one with text carries an error. Its own stream handler reads whatever length a peer
declares, so one header claiming 2**60 bytes makes the receiver buffer until memory runs out. `StreamChannel` speaks
the same framing but:

  - refuses a frame longer than `max_frame_bytes` as soon as its header arrives (`MessageTooLargeError`);
  - refuses an unparseable payload or an unknown marker with `BadRequestError`;
  - `refuse(error)` answers such a frame with an RPCError frame "[code] message" and stops reading (the stream's
    owner then closes it);
  - when it ends a stream the peer is still writing to, first drops the peer's bytes for up to `linger_s`
    (closing with unread bytes would reset the connection, and a reset loses the answers already sent that the
    peer has not read yet: a busy client reads late).

`serve_stream` registers a handler (channel, context) for a stream RPC; `open_stream` opens one to a peer. Unary RPCs
go through p2pd's persistent connection, which bounds their size itself (4 MiB by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto.p2pd_pb2 import RPCError

from nesa_node.errors import (
    BadRequestError,
    MessageTooLargeError,
    NesaError,
    PeerUnavailableError,
    RequestError,
    error_from_code,
)
from nesa_node.protocol.channel import ChannelClosedError, Frame
from nesa_node.protocol.lane import close_writer

logger = logging.getLogger(__name__)

StreamHandler = Callable[["StreamChannel", P2PContext], Awaitable[None]]

_HEADER_BYTES = P2P.HEADER_LEN  # 8, big-endian payload length
_ERROR_TEXT = re.compile(r"^\[([a-z_]{1,32})\] (.*)$", re.DOTALL)


class UnparseableFrameError(BadRequestError):
    """A frame whose payload is not the protobuf it should be (the stream itself is still readable)."""


async def read_frame(reader: asyncio.StreamReader, max_frame_bytes: int) -> Frame | RPCError:
    """One frame from a peer's stream, or the RPCError frame that ends it.

    Raises MessageTooLargeError before reading an oversized payload, BadRequestError for bytes that are not a frame,
    and asyncio.IncompleteReadError when the peer closes (mid-frame or between frames)."""
    marker = await reader.readexactly(1)
    if marker not in (P2P.MESSAGE_MARKER, P2P.ERROR_MARKER):
        raise BadRequestError(f"unknown frame marker {marker!r}; expected a hivemind protobuf stream")
    length = int.from_bytes(await reader.readexactly(_HEADER_BYTES), P2P.BYTEORDER)
    if length > max_frame_bytes:
        raise MessageTooLargeError(f"frame of {length} bytes exceeds this node's limit of {max_frame_bytes} bytes")
    payload = await reader.readexactly(length)
    message = Frame() if marker == P2P.MESSAGE_MARKER else RPCError()
    try:
        message.ParseFromString(payload)
    except DecodeError as exc:
        raise UnparseableFrameError(f"unparseable {type(message).__name__} protobuf: {exc}") from None
    return message


def _pack(marker: bytes, payload: bytes) -> bytes:
    return marker + len(payload).to_bytes(_HEADER_BYTES, P2P.BYTEORDER) + payload


def error_from_text(text: str) -> NesaError:
    """The typed error an RPCError frame's text names ("[code] message"); a plain text is a peer that failed."""
    found = _ERROR_TEXT.match(text)
    if found is None:
        return ChannelClosedError(f"stream ended with an error: {text[:500]}")
    return error_from_code(found.group(1), found.group(2)[:4096])


class StreamChannel:
    """One libp2p stream (reader and writer of p2pd's unix socket) as a Channel of frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame_bytes: int):
        self.reader, self.writer = reader, writer
        self.max_frame_bytes = max_frame_bytes
        self.closed = False
        self.peer_ended = False  # the peer ended its side (end frame or close): nothing more to read
        self.on_settled: Callable[[], None] | None = None  # frees the stream's place among opening ones (`settled`)

    def send(self, frame: Frame) -> None:
        if self.closed or self.writer.is_closing():
            raise ChannelClosedError("stream is closed")
        self.writer.write(_pack(P2P.MESSAGE_MARKER, frame.SerializeToString()))

    async def drain(self) -> None:
        """Wait until the frames written have left for p2pd (a peer that stops reading holds this)."""
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            self.closed = True
            raise ChannelClosedError(f"stream failed: {exc!r}") from None

    def end(self) -> None:
        """End our side: the peer reads the end of the stream (it may still answer)."""
        if not (self.closed or self.writer.is_closing()):
            self.writer.write(_pack(P2P.ERROR_MARKER, RPCError().SerializeToString()))

    async def receive(self) -> Frame | None:
        """The next frame; None at the stream's end. An error frame with text raises the error it names. A frame over
        the limit or an unknown marker (MessageTooLargeError, BadRequestError) leaves the stream unreadable: it is
        marked closed; an unparseable payload (BadRequestError) does not."""
        if self.closed:
            return None
        try:
            received = await read_frame(self.reader, self.max_frame_bytes)
        except asyncio.IncompleteReadError as exc:
            self.peer_ended = True
            if exc.partial:
                raise ChannelClosedError("stream closed mid-frame") from None
            return None
        except (ConnectionError, OSError) as exc:
            self.peer_ended = True
            raise ChannelClosedError(f"stream failed: {exc!r}") from None
        except UnparseableFrameError:
            raise
        except RequestError:  # the payload was not read: no frame boundary is left
            self.closed = True
            raise
        if isinstance(received, RPCError):
            self.peer_ended = True
            if received.message:
                error = error_from_text(received.message)
                error.named_by_peer = True  # a refusal the peer sent, not a fault found here in what it sent
                raise error
            return None
        return received

    def refuse(self, error: NesaError) -> None:
        """Answer with an error frame "[code] message" (what a hivemind client raises), then stop reading."""
        with contextlib.suppress(Exception):
            if not self.writer.is_closing():
                self.writer.write(_pack(P2P.ERROR_MARKER, RPCError(message=f"[{error.code}] {error.message}")
                                        .SerializeToString()))  # fmt: skip
        self.closed = True

    async def linger(self, timeout_s: float) -> None:
        """Flush our frames; unless the peer ended its side, read and drop what it still sends until it closes or
        `timeout_s` passes: closing a socket with unread bytes resets the connection, and a reset can drop our last
        frames before the peer reads them."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
        if self.peer_ended:
            return
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(1 << 16):
                    pass

    def abort(self) -> None:
        """Close the stream at once, dropping what is still buffered for the peer (a peer that does not read)."""
        with contextlib.suppress(Exception):
            self.writer.transport.abort()
        self.closed = True

    def close(self) -> None:
        """End our side (if not ended) and close the stream; frames already written are still delivered to a peer
        that reads (for a while: protocol/lane.py close_writer)."""
        with contextlib.suppress(Exception):
            if not self.closed:
                self.end()
            close_writer(self.writer)
        self.closed = True


async def serve_stream(
    p2p: P2P, name: str, handler: StreamHandler, *, max_frame_bytes: int, linger_s: float = 5.0
) -> None:
    """Register `handler(channel, context)` as stream RPC `name` on `p2p`. The stream is closed when the handler
    returns; a handler that raises (a defect) has its stream answered with an error frame."""

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        context = P2PContext(handle_name=name, local_id=p2p.peer_id, remote_id=stream_info.peer_id)
        channel = StreamChannel(reader, writer, max_frame_bytes)
        try:
            await handler(channel, context)
        except RequestError as exc:  # a frame refused before any session took it
            logger.debug("%s: refused a stream from %s: %s", name, stream_info.peer_id, exc)
            channel.refuse(exc)
        except PeerUnavailableError as exc:  # the peer went away: normal
            logger.debug("%s: stream from %s ended: %s", name, stream_info.peer_id, exc)
        except Exception as exc:
            logger.warning("%s: handler failed: %r", name, exc, exc_info=True)
            channel.refuse(NesaError(f"handler failed: {type(exc).__name__}"))
        finally:
            await channel.linger(linger_s)
            channel.close()

    await p2p.add_binary_stream_handler(name, handle)


async def open_stream(p2p: P2P, peer_id: str, name: str, *, max_frame_bytes: int) -> StreamChannel:
    """A stream to `peer_id`'s RPC `name`; raises hivemind's or OS errors when it cannot be opened (callers bound the
    time with their own timeout)."""
    _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), name)
    return StreamChannel(reader, writer, max_frame_bytes)


def settled(channel: object) -> None:
    """`channel` has said what it is for (its session's open read, its push stream bound): from now on limits of its
    own hold it, and its place among its peer's streams still opening is freed (server/rpc.py opening_streams). Once
    per stream; a no-op for a channel that holds no such place (a data lane is admitted at its handshake)."""
    hook = getattr(channel, "on_settled", None)
    if hook is not None:
        channel.on_settled = None
        hook()


UnaryHandler = Callable[[Frame, P2PContext], Awaitable[Frame]]


async def answer_one_frame(channel: StreamChannel, context: P2PContext, handler: UnaryHandler, *, timeout_s: float):
    """The stream twin of a unary RPC, for a request or an answer over p2pd's unary bound: read one frame (within
    `timeout_s` and the channel's frame limit) and send `handler`'s answer to it. Returns once the answer has left
    (within `timeout_s` again): a peer that does not read it has the stream aborted, so its unread bytes are dropped
    rather than held by the node."""
    try:
        async with asyncio.timeout(timeout_s):
            request = await channel.receive()
    except TimeoutError:
        return
    if request is None:
        return
    channel.send(await handler(request, context))
    try:
        async with asyncio.timeout(timeout_s):
            await channel.drain()
    except TimeoutError:
        channel.abort()


async def call_on_stream(
    p2p: P2P, peer_id: str, name: str, request: Frame, *, max_answer_bytes: int, timeout_s: float
) -> Frame:
    """One request and its answer on a stream of its own to `peer_id`'s RPC `name` (served by `answer_one_frame`).
    The typed error the peer answers with when it refuses the call (QuotaExceededError when busy,
    MessageTooLargeError for a request over its limit); PeerUnavailableError when the stream fails, the peer sends no
    answer within `timeout_s`, or an answer over `max_answer_bytes` or that cannot be read (the peer's fault, as a
    failed unary call is)."""
    channel = None
    try:
        async with asyncio.timeout(timeout_s):
            channel = await open_stream(p2p, peer_id, name, max_frame_bytes=max_answer_bytes)
            channel.send(request)
            channel.end()
            answer = await channel.receive()
        if answer is None:
            raise ChannelClosedError("the peer ended the stream without an answer")
        return answer
    except Exception as exc:
        if isinstance(exc, NesaError) and getattr(exc, "named_by_peer", False):  # the peer refused: its typed error
            raise
        logger.debug("%s to %s failed: %r", name, peer_id, exc)
        raise PeerUnavailableError(f"peer {peer_id} did not answer {name}: {exc!r}") from None
    finally:
        if channel is not None:
            channel.close()


__all__ = [
    "StreamChannel",
    "answer_one_frame",
    "call_on_stream",
    "error_from_text",
    "open_stream",
    "read_frame",
    "serve_stream",
    "settled",
]

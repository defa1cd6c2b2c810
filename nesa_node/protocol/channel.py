"""The one transport seam: a `Channel` carries frames between two peers, and session code never asks which kind it
is on. Two kinds:

  StreamChannel   a libp2p stream (protocol/framing.py): authenticated peers, every message through two p2pd
  LaneChannel     a data lane (protocol/lane.py): direct TCP, AES-GCM with keys handed out over libp2p

A frame is hivemind's ExpertRequest protobuf: one message (protocol/messages.py) in its metadata, and tensors. Both
directions of every channel carry frames; `read` turns one into a typed message, or a BadRequestError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from google.protobuf.message import DecodeError
from hivemind.proto import runtime_pb2
from pydantic import TypeAdapter

from nesa_node.errors import BadRequestError, PeerUnavailableError
from nesa_node.protocol import lane
from nesa_node.protocol.messages import MAX_METADATA_BYTES, Message, decode, encode

Frame = runtime_pb2.ExpertRequest  # metadata: one encoded message; tensors: its tensors


class ChannelClosedError(PeerUnavailableError):
    """The channel ended or failed; what was in flight on it is lost."""


class Channel(Protocol):
    """Frames to and from one peer. `send` queues a frame without waiting (ChannelClosedError once closed);
    `drain` waits until what was queued has gone to the peer's side of the connection (a peer that stops reading
    holds it: callers bound it with a timeout); `receive` returns the next frame, None when the peer ended the
    channel between frames, and raises ChannelClosedError when it broke, a RequestError when the peer sent something
    malformed, or the typed error a libp2p stream's error frame names. `close` still sends what was queued to a peer
    that reads (for a while: protocol/lane.py close_writer); `abort` drops it (a peer that stopped reading)."""

    closed: bool

    def send(self, frame: Frame) -> None: ...

    async def drain(self) -> None: ...

    async def receive(self) -> Frame | None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def frame(message: Message, tensors: Sequence[runtime_pb2.Tensor] = ()) -> Frame:
    return Frame(metadata=encode(message), tensors=list(tensors))


_ERROR_HEAD = b"\xa4kind\xa5error"  # `encode` writes the kind first: after the map's one-byte header, "kind": "error"


def is_error_reply(frame: Frame) -> bool:
    """Whether a frame this process encoded (`frame`) carries an ErrorReply (read without decoding it)."""
    return frame.metadata[1 : 1 + len(_ERROR_HEAD)] == _ERROR_HEAD


def read(frame: Frame, kinds: TypeAdapter, *, max_bytes: int = MAX_METADATA_BYTES) -> Message:
    """The typed message of a frame from a peer (protocol/messages.py decode); BadRequestError if malformed."""
    return decode(frame.metadata, kinds, max_bytes=max_bytes)


def parse_frame(payload: bytes, what: str) -> Frame:
    """A frame from raw protobuf bytes; BadRequestError naming `what` when they do not parse."""
    parsed = Frame()
    try:
        parsed.ParseFromString(payload)
    except DecodeError:
        raise BadRequestError(f"unparseable {what}") from None
    return parsed


class LaneChannel:
    """A data lane (protocol/lane.py SealedStream) as a Channel."""

    def __init__(self, stream: lane.SealedStream, what: str = "frame on a data lane"):
        self.stream = stream
        self.what = what

    @property
    def closed(self) -> bool:
        return self.stream.closed

    @property
    def max_frame_bytes(self) -> int:
        """Longest frame accepted from the peer; a longer one is refused before it is read (it may be lowered)."""
        return self.stream.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        self.stream.max_frame_bytes = value

    def send(self, frame: Frame) -> None:
        try:
            self.stream.send(frame.SerializeToString())
        except lane.LaneClosedError as exc:
            raise ChannelClosedError(exc.message) from None

    async def drain(self) -> None:
        try:
            await self.stream.drain()
        except lane.LaneClosedError as exc:
            raise ChannelClosedError(exc.message) from None

    async def receive(self) -> Frame | None:
        try:
            payload = await self.stream.receive()
        except lane.LaneClosedError as exc:
            raise ChannelClosedError(exc.message) from None
        return None if payload is None else parse_frame(payload, self.what)

    def close(self) -> None:
        self.stream.close()

    def abort(self) -> None:
        self.stream.abort()


__all__ = ["Channel", "ChannelClosedError", "Frame", "LaneChannel", "frame", "parse_frame", "read"]

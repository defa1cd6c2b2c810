"""The node's side of data lanes (nesa_node.protocol.lane): accepting lane connections, steps and forward calls arriving on
them, pushing a session's outputs to the next node on one, and FORWARD lane tickets.

`LaneServing` is a part of BlockHandler (it uses the handler's sessions, config and forward path); the session
stream protocol itself stays in nesa_node.server.handler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import AsyncIterator  # noqa: UP035 -- hivemind's servicer detects streams by typing's name

from google.protobuf.message import DecodeError
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from nesa_node.errors import (
    BadRequestError,
    NesaError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    SessionNotFoundError,
)
from nesa_node.protocol import lane
from nesa_node.protocol.wire import error_response, field, pack_metadata, unpack_metadata
from nesa_node.server.session import ServerSession, end_push_stream

logger = logging.getLogger(__name__)

MAX_TICKETS_PER_PEER = 8  # unused FORWARD lane tickets one peer may hold (a client keeps one lane per node)
MAX_TICKETS = 1024


def close_lanes(session: ServerSession) -> None:
    """Close every data lane of the session: inbound steps, the client's output lane, the push lane."""
    for stream in list(session.lane_streams):
        stream.close()
    session.lane_streams.clear()
    if session.output_lane is not None:
        session.output_lane.close()
        session.output_lane = None
    end_push_stream(session)


def lane_settings(metadata: dict) -> dict:
    """The optional "lane" entry of an open or retarget message: {"in": key hex, "out": key hex, "next": address or
    None}, each when given. Returns the parsed values under the session's field names."""
    settings = field(metadata, "lane", (dict, type(None)), default=None)
    if settings is None:
        return {}
    unknown = set(settings) - {"in", "out", "next"}
    if unknown:
        raise BadRequestError(f"unknown lane settings {sorted(unknown)[:4]}")
    parsed: dict = {}
    for name, attribute in (("in", "lane_in"), ("out", "lane_out")):
        if name in settings:
            parsed[attribute] = lane.parse_key(settings[name], name)
    if "next" in settings:
        if settings["next"] is not None:
            lane.parse_address(settings["next"])
        parsed["lane_next"] = settings["next"]
    return parsed


async def lane_responses(stream: lane.SealedStream) -> AsyncIterator[runtime_pb2.ExpertResponse]:
    """The next node's answers on a push lane (it answers only to refuse a step)."""
    while (payload := await stream.receive()) is not None:
        response = runtime_pb2.ExpertResponse()
        try:
            response.ParseFromString(payload)
        except DecodeError:
            raise BadRequestError("unparseable answer on a data lane") from None
        yield response


class LaneServing:
    """BlockHandler's data lane methods."""

    async def rpc_lane_ticket(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A ticket for a FORWARD data lane (nesa_node.protocol.lane): an id and a fresh key, known to this peer only. A
        ticket serves one connection; a peer holds at most MAX_TICKETS_PER_PEER unused ones (the oldest go)."""
        if self.lane_address is None:
            return error_response(BadRequestError("this node has no data lane"))
        peer = context.remote_id.to_base58()
        held = [ticket for ticket, (_, owner, _) in self.tickets.items() if owner == peer]
        for ticket in held[: max(0, len(held) - MAX_TICKETS_PER_PEER + 1)]:
            del self.tickets[ticket]
        while len(self.tickets) >= MAX_TICKETS:
            del self.tickets[next(iter(self.tickets))]
        ticket, key = os.urandom(16).hex(), lane.new_key()
        self.tickets[ticket] = (key, peer, time.monotonic())
        return runtime_pb2.ExpertResponse(
            metadata=pack_metadata({"ticket": ticket, "key": key.hex(), "lane": self.lane_address})
        )

    async def _push_lane(self, session: ServerSession, request: runtime_pb2.ExpertRequest) -> None:
        if session.push_lane is None:
            try:
                async with asyncio.timeout(self.config.peer_timeout_s):
                    stream = await lane.connect(
                        session.lane_next,
                        lane.ROLE_SEND,
                        session.session_id,
                        session.lane_out,
                        max_frame_bytes=self.max_message_bytes,
                    )
            except (lane.LaneClosedError, TimeoutError) as exc:
                raise PeerUnavailableError(f"next node {session.next_peer} did not take the step: {exc}") from None
            session.push_lane = stream
            session.push_reader = asyncio.create_task(self._read_push_errors(session, lane_responses(stream)))
        try:
            session.push_lane.send(request.SerializeToString())
        except lane.LaneClosedError:
            raise PeerUnavailableError(f"next node {session.next_peer}: data lane closed") from None

    async def serve_lane(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One data lane connection (nesa_node.protocol.lane): a ping, steps into a session, a client taking the outputs
        of a session whose last node this is, or a client's forward calls (with a ticket). Anything malformed or unauthenticated closes the connection and
        touches no session."""
        stream = session = None
        try:
            async with asyncio.timeout(self.config.peer_timeout_s):
                role, session_id, salt = await lane.read_hello(reader)
                if role == lane.ROLE_PING:
                    await self._injected_delay()
                    writer.write(os.urandom(lane.SALT_BYTES))
                    await writer.drain()
                    return
                if role == lane.ROLE_FORWARD:
                    key, owner = self._take_ticket(session_id)
                else:
                    session = self.sessions.get(session_id)
                    key = None
                    if session is not None:
                        key = session.lane_in if role == lane.ROLE_SEND else None
                        if role == lane.ROLE_RECEIVE and session.next_peer is None:
                            key = session.lane_out
                    if key is None:
                        raise SessionNotFoundError(f"no session {session_id[:32]!r} with a lane of that role here")
                stream = await lane.accept(reader, writer, role, salt, key, self.max_message_bytes)
            if role == lane.ROLE_FORWARD:
                self.forward_lanes[owner] = self.forward_lanes.get(owner, 0) + 1
                try:
                    lane.confirm(stream)
                    await self._lane_forwards(stream)
                finally:
                    self.forward_lanes[owner] -= 1
                    if not self.forward_lanes[owner]:
                        del self.forward_lanes[owner]
                return
            if self.sessions.get(session_id) is not session:
                return
            if role == lane.ROLE_RECEIVE:
                if session.output_lane is not None:
                    session.output_lane.close()
                session.output_lane = stream
                lane.confirm(stream)
                while await stream.receive() is not None:  # the client sends nothing more: wait for its close
                    raise BadRequestError("frames from the client on an output lane")
            else:
                session.lane_streams.add(stream)
                lane.confirm(stream)
                await self._lane_steps(session, stream)
        except (NesaError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("lane connection ended: %r", exc)
        finally:
            if session is not None:
                session.lane_streams.discard(stream)
                if session.output_lane is stream and stream is not None:
                    session.output_lane = None
            if stream is not None:
                stream.close()
            else:
                writer.close()

    def _take_ticket(self, ticket: str) -> tuple[bytes, str]:
        """(key, peer) of an unexpired ticket, which is used up. SessionNotFoundError for any other ticket, and
        QuotaExceededError when its peer already holds MAX_TICKETS_PER_PEER open forward lanes."""
        key, owner, issued = self.tickets.pop(ticket, (None, None, 0.0))
        if key is None or time.monotonic() - issued > self.config.peer_timeout_s:
            raise SessionNotFoundError("no such lane ticket (unknown, used or expired)")
        if self.forward_lanes.get(owner, 0) >= MAX_TICKETS_PER_PEER:
            raise QuotaExceededError(f"peer already has {MAX_TICKETS_PER_PEER} forward lanes open here")
        return key, owner

    async def _lane_forwards(self, stream: lane.SealedStream) -> None:
        """Forward calls on a FORWARD lane, answered in order on it, until the client closes it or leaves it idle
        for session_timeout_s."""
        while True:
            try:
                async with asyncio.timeout(self.config.session_timeout_s):
                    payload = await stream.receive()
            except TimeoutError:
                return
            if payload is None:
                return
            request = runtime_pb2.ExpertRequest()
            try:
                request.ParseFromString(payload)
            except DecodeError:
                stream.send(error_response(BadRequestError("unparseable forward on a data lane")).SerializeToString())
                continue
            stream.send((await self._forward(request)).SerializeToString())

    async def _lane_steps(self, session: ServerSession, stream: lane.SealedStream) -> None:
        """Steps arriving on a lane go into the session's queue like pushed ones; a refused one is answered on the
        lane (its sender reports it to the client), and the lane goes on."""
        while (payload := await stream.receive()) is not None:
            if self.sessions.get(session.session_id) is not session or stream.closed:
                return
            request, step_id = runtime_pb2.ExpertRequest(), None
            try:
                try:
                    request.ParseFromString(payload)
                except DecodeError:
                    raise BadRequestError("unparseable step on a data lane") from None
                metadata = unpack_metadata(request.metadata)
                step_id = metadata.get("step_id") if isinstance(metadata.get("step_id"), str) else None
                if "control" in metadata or "replay" in metadata:
                    raise BadRequestError("session control and replay come on the session's stream, not a lane")
                if session.room.locked():
                    raise QuotaExceededError(
                        f"session {session.session_id!r} already has {self.config.max_queued_steps} steps waiting"
                    )
            except RequestError as exc:
                stream.send(error_response(exc, step_id=step_id).SerializeToString())
                continue
            await session.room.acquire()  # free, so this does not wait
            session.inbox.put_nowait((request, metadata))

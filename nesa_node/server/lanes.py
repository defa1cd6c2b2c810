"""The node's side of data lanes (protocol/lane.py): the listening socket, and what each connection is for.

  SEND      steps into a session (from the client, or the previous node); they enter through SessionTable.admit,
            and a refused one is answered on the lane (its sender reports it to the client)
  RECEIVE   the client takes a session's outputs (this node is the last)
  FORWARD   a client's cacheless forward calls, opened with a one-time ticket issued over libp2p (`issue_ticket`)
  TRAIN     one LoRA training session (server/training.py), opened with such a ticket too
  PING      answered at once, for round-trip times
Anything malformed or unauthenticated closes the connection and touches no session. How many connections are taken at
all, and how long a hello may take, is server/lane_gate.py's business.

A hello names a session id, which several peers may have open here (sessions are scoped to their opener): the
connection belongs to the session whose lane key its handshake proves, so a session of the same id opened by anyone
else (who lacks the owner's fresh random key) never takes the owner's lane or steps.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable

from nesa_node.errors import (
    BadRequestError,
    NesaError,
    PeerUnavailableError,
    PortInUseError,
    QuotaExceededError,
    RequestError,
    SessionNotFoundError,
)
from nesa_node.protocol import lane
from nesa_node.protocol.channel import Channel, Frame, LaneChannel, frame, read
from nesa_node.protocol.framing import settled
from nesa_node.protocol.messages import PUSHED, ErrorReply, LaneTicket, Step
from nesa_node.server.config import NetworkConfig
from nesa_node.server.lane_gate import LaneAdmission, LaneGate
from nesa_node.server.sessions import Inbound, ServerSession, SessionTable

logger = logging.getLogger(__name__)

REFUSAL_DRAIN_S = 10.0  # how long a refusal of a pushed step may wait to leave before its channel is dropped
MAX_TICKETS_PER_PEER = 8  # unused FORWARD lane tickets one peer may hold (a client keeps one lane per node)
MAX_TICKETS = 1024
# Connections the kernel completes for the lane before the node's loop accepts them (capped by net.core.somaxconn).
# asyncio's default of 100 let a burst of connects, a flood or many sessions opening at once, overflow the accept
# queue: the kernel then drops the handshake's last ACK, so the connector holds a connection the node never sees,
# never gated and never closed, for as long as the connector waits on it.
LANE_BACKLOG = 4096

Forward = Callable[[Frame], Awaitable[Frame]]


class LaneServer:
    """Accepts data lane connections for the node's sessions and forward calls (see the module docstring)."""

    def __init__(
        self,
        sessions: SessionTable,
        forward: Forward,
        network: NetworkConfig,
        *,
        session_timeout_s: float,
        max_frame_bytes: int,
        injected_delay: Callable[[], Awaitable[None]],
        train: Callable[[Channel, str], Awaitable[None]] | None = None,
        prover=None,
    ):
        self.prover = prover  # the node's RecordSigner: signs PROVE hellos (None: they are refused)
        self.train = train  # serves one training session on a channel, for its peer (None: no TRAIN lanes)
        self.sessions = sessions
        self.forward = forward
        self.network = network
        self.session_timeout_s = session_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.injected_delay = injected_delay
        self.address: str | None = None  # "ip:port" once listening; announced in the node's record
        self.tickets: dict[str, tuple[bytes, str, float]] = {}  # FORWARD lane tickets: id -> (key, peer, issued)
        self.ticket_lanes: dict[str, int] = {}  # open FORWARD and TRAIN lanes per peer (those opened by tickets)
        self.gate = LaneGate(network)
        self._server: asyncio.Server | None = None

    async def start(self, visible_host: Callable[[], Awaitable[str]]) -> str:
        """Listen on the node's host and lane port; returns the address to announce (`visible_host` names the
        address peers reach the node on, when it listens on every interface)."""
        try:
            self._server = await asyncio.start_server(
                self.serve, self.network.host, self.network.lane_port, backlog=LANE_BACKLOG
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"--lane-port {self.network.lane_port}: port {self.network.lane_port} on {self.network.host} "
                    "is already in use; pick another, or --lane-port 0 for any free one"
                ) from None
            raise
        port = self._server.sockets[0].getsockname()[1]
        host = self.network.host
        if host in ("0.0.0.0", "::") or self.network.announce_host is not None:
            host = await visible_host()
        self.address = lane.format_address(host, port)
        logger.info("data lane on %s", self.address)
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    # ---- tickets ------------------------------------------------------------------------------------------------

    def issue_ticket(self, peer: str) -> LaneTicket:
        """A ticket for a FORWARD or TRAIN lane: an id and a fresh key, known to `peer` only. A ticket serves one connection;
        a peer holds at most MAX_TICKETS_PER_PEER unused ones (the oldest go). BadRequestError without a lane."""
        if self.address is None:
            raise BadRequestError("this node has no data lane")
        held = [ticket for ticket, (_, owner, _) in self.tickets.items() if owner == peer]
        for ticket in held[: max(0, len(held) - MAX_TICKETS_PER_PEER + 1)]:
            del self.tickets[ticket]
        while len(self.tickets) >= MAX_TICKETS:
            del self.tickets[next(iter(self.tickets))]
        ticket, key = os.urandom(16).hex(), lane.new_key()
        self.tickets[ticket] = (key, peer, time.monotonic())
        return LaneTicket(ticket=ticket, key=key.hex(), lane=self.address)

    def _take_ticket(self, ticket: str) -> tuple[bytes, str]:
        """(key, peer) of an unexpired ticket, which is used up. SessionNotFoundError for any other ticket, and
        QuotaExceededError when its peer already holds MAX_TICKETS_PER_PEER open FORWARD and TRAIN lanes."""
        key, owner, issued = self.tickets.pop(ticket, (None, None, 0.0))
        if key is None or time.monotonic() - issued > self.network.peer_timeout_s:
            raise SessionNotFoundError("no such lane ticket (unknown, used or expired)")
        if self.ticket_lanes.get(owner, 0) >= MAX_TICKETS_PER_PEER:
            raise QuotaExceededError(f"peer already has {MAX_TICKETS_PER_PEER} forward and training lanes open here")
        return key, owner

    # ---- connections --------------------------------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One lane connection, from its hello to its end; one the gate refuses is closed at once, unread."""
        admission = self.gate.admit(writer.get_extra_info("peername"), writer.transport)
        if admission is None:
            writer.transport.abort()  # no FIN handshake to wait for: the descriptor is free now
            return
        try:
            await self._serve_admitted(reader, writer, admission)
        finally:
            admission.release()

    async def _serve_admitted(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, admission: LaneAdmission
    ) -> None:
        channel: LaneChannel | None = None
        session: ServerSession | None = None
        role = None
        try:
            async with asyncio.timeout(self.network.lane_hello_timeout_s):
                role, session_id, salt = await lane.read_hello(reader)
                if role == lane.ROLE_PING:
                    await self.injected_delay()
                    writer.write(os.urandom(lane.SALT_BYTES))
                    await writer.drain()
                    return
                if role == lane.ROLE_PROVE:
                    if self.prover is None:
                        raise BadRequestError("this node has no identity key to prove its lane with")
                    writer.write(lane.proof_answer(salt, self.prover.public_key, self.prover.sign_bytes))
                    await writer.drain()
                    return
                owner = None
                if role in (lane.ROLE_FORWARD, lane.ROLE_TRAIN):
                    if role == lane.ROLE_TRAIN and self.train is None:
                        raise BadRequestError("this node takes no training sessions on its lane")
                    key, owner = self._take_ticket(session_id)
                    stream = await lane.accept(reader, writer, role, salt, key, self.max_frame_bytes)
                else:
                    stream, session = await self._accept_session(reader, writer, role, session_id, salt)
                channel = LaneChannel(stream, "frame on a data lane")
            admission.authenticated()
            if role in (lane.ROLE_FORWARD, lane.ROLE_TRAIN):
                await self._serve_ticket_lane(channel, role, owner)
            elif self.sessions.holds(session):
                if role == lane.ROLE_RECEIVE:
                    await self._serve_output(channel, session)
                else:
                    await self._serve_steps(channel, session)
        except (NesaError, TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            logger.debug("lane connection ended: %r", exc)
        except Exception as exc:  # a fault serving it (say, the device out of memory): this connection ends alone
            logger.warning("lane connection (role %s) failed: %r", role, exc)
        finally:
            if session is not None:
                session.inbound.discard(channel)
                if session.output is channel and channel is not None:
                    session.output = None
            if channel is not None:
                channel.close()
            else:
                writer.close()

    async def _accept_session(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: int, session_id: str, salt: bytes
    ) -> tuple[lane.SealedStream, ServerSession]:
        """The handshake of a SEND or RECEIVE lane: the session of id `session_id` whose key of that role the
        connecting side proves it holds. SessionNotFoundError when no such session has a lane of that role,
        BadRequestError when the proof opens under none of their keys."""
        candidates = [session for session in self.sessions.named(session_id) if _session_key(session, role)]
        if not candidates:
            raise SessionNotFoundError(f"no session {session_id[:32]!r} with a lane of that role here")
        keys = [_session_key(session, role) for session in candidates]
        stream, index = await lane.accept_any(reader, writer, role, salt, keys, self.max_frame_bytes)
        return stream, candidates[index]

    async def _serve_ticket_lane(self, channel: LaneChannel, role: int, owner: str) -> None:
        """A FORWARD or TRAIN lane, counted among its peer's (at most MAX_TICKETS_PER_PEER at once: `_take_ticket`)
        until it ends."""
        self.ticket_lanes[owner] = self.ticket_lanes.get(owner, 0) + 1
        try:
            lane.confirm(channel.stream)
            if role == lane.ROLE_FORWARD:
                await self._serve_forwards(channel)
            else:
                await self.train(channel, owner)
        finally:
            self.ticket_lanes[owner] -= 1
            if not self.ticket_lanes[owner]:
                del self.ticket_lanes[owner]

    async def _serve_forwards(self, channel: LaneChannel) -> None:
        """Forward calls answered in order on the lane, until the client closes it or leaves it idle for the session
        timeout (counted from its last call: refused frames do not keep it open)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.session_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    request = await channel.receive()
            except TimeoutError:
                return
            except BadRequestError as exc:  # an unparseable frame: refused, the lane goes on
                answer = frame(ErrorReply.of(exc))
            else:
                if request is None:
                    return
                answer = await self.forward(request)
                deadline = loop.time() + self.session_timeout_s
            channel.send(answer)
            try:  # a client that does not read its answers (or refusals) cannot make the node buffer them
                async with asyncio.timeout(self.network.peer_timeout_s):
                    await channel.drain()
            except TimeoutError:
                channel.abort()
                return

    async def _serve_output(self, channel: LaneChannel, session: ServerSession) -> None:
        """The client takes the session's outputs here; it sends nothing more, so wait for its close."""
        if session.output is not None:
            session.output.close()
        session.output = channel
        lane.confirm(channel.stream)
        if await channel.receive() is not None:
            raise BadRequestError("frames from the client on an output lane")

    async def _serve_steps(self, channel: LaneChannel, session: ServerSession) -> None:
        # one lane of steps a session, from its one upstream: a newer one (it connected again) ends the older, so a
        # peer holds no more lanes into a node than the sessions it feeds there
        for older in list(session.inbound):
            older.close()
        session.inbound.clear()
        session.inbound.add(channel)
        session.limit_frames(channel, 0)  # frames it can use (the bound set at its open)
        lane.confirm(channel.stream)
        await serve_steps(channel, session, self.sessions, sender=None)


async def serve_steps(
    channel: Channel, session_of, sessions: SessionTable, *, sender: str | None, first_frame_s: float | None = None
) -> None:
    """Steps arriving on a channel into their session's queue, until the channel ends; each refused one is answered on
    the channel (its sender reports it to the client) and the channel goes on. `session_of`: the session (a lane is
    bound to one at its handshake), or None for a libp2p push stream, which is bound to the session its first step
    names: a stream whose first step does not come within `first_frame_s`, or names no session of which the sender is
    the upstream, ends, and a later step naming another session is refused. The session's end closes its push stream, and so does a newer push stream of the
    same session (its upstream reopened its channel): a peer holds no more push streams than sessions it feeds."""
    bound = session_of
    while True:
        step_id = None
        try:
            if bound is None and first_frame_s is not None:
                try:
                    async with asyncio.timeout(first_frame_s):
                        request = await channel.receive()
                except TimeoutError:
                    logger.debug("push stream from %s: no step within %.0f s", sender, first_frame_s)
                    return
            else:
                request = await channel.receive()
            if request is None:
                return
            message = read(request, PUSHED)
            step_id = message.step_id if isinstance(message, Step) else None
            if session_of is not None:
                session = session_of
            else:
                session = sessions.find(message.session_id, message.owner, sender=sender)
                if bound is not None and session is not bound:
                    raise BadRequestError("a push stream carries the steps of one session only")
            if not sessions.holds(session) or channel.closed:
                return
            if bound is None:
                if sender != session.upstream_peer:  # before it may close the upstream's own push stream
                    raise BadRequestError("push from a peer that is not this session's upstream")
                bound = session
                session.take_push_stream(channel)
                session.limit_frames(channel, 0)  # later frames: no longer than the session can use
                settled(channel)  # one push stream per session from here (server/rpc.py opening_streams)
            await sessions.admit(session, Inbound(request, message), sender=sender, wait=False)
        except RequestError as exc:
            if channel.closed:  # the channel cannot go on (a frame over the limit): its handler ends it
                raise
            channel.send(frame(ErrorReply.of(exc, step_id)))
            try:  # a sender of junk that never reads the refusals cannot make the node buffer them
                async with asyncio.timeout(REFUSAL_DRAIN_S):
                    await channel.drain()
            except (TimeoutError, PeerUnavailableError):
                channel.abort()
                return
            if bound is None:  # a push stream whose first step names no session it may feed serves none
                return


def _session_key(session: ServerSession | None, role: int) -> bytes | None:
    """The key a lane of `role` into `session` must hold: steps in (SEND), or the outputs of a last node (RECEIVE)."""
    if session is None:
        return None
    if role == lane.ROLE_SEND:
        return session.lane_in
    if role == lane.ROLE_RECEIVE and session.next_peer is None:
        return session.lane_out
    return None


__all__ = ["MAX_TICKETS", "MAX_TICKETS_PER_PEER", "LaneServer", "serve_steps"]

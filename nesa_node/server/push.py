"""A node's pushes along a direct chain: each session's outputs go to its next node over one channel, a data lane
when the client set one up (protocol/lane.py) or else a libp2p push stream, opened at the first push. The next node
answers on that channel only to refuse a step; a refusal, or the channel ending while the session still pushes, is
reported to the client at once (in order with the session's answers), so it replaces the next node now rather than
at its step deadline.

A lane is dialed only at the address the next node itself announces (its `rpc_info` answer over libp2p, which
authenticates the peer), never at an address a client names: otherwise any client could make a node connect to any
ip:port it can reach and write there. Nor at one nearer than the node's own address (`lane.may_dial`: a node on the
internet dials no loopback or private address), since the next node may be hostile too. Where the lane is not
dialed, or cannot be reached, the pushes go over libp2p; a failure's cause stays in this node's log, not in the
refusal a client reads.
"""

from __future__ import annotations

import asyncio
import logging
import time

from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2

from nesa_node.errors import NesaError, PeerUnavailableError, SessionNotFoundError
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Channel, Frame, LaneChannel, frame, read
from nesa_node.protocol.framing import open_stream
from nesa_node.protocol.messages import INFO_ANSWERS, MAX_INFO_BYTES, PUSH_ANSWERS, ErrorReply, InfoReply, Step
from nesa_node.server.sessions import ServerSession, SessionTable

logger = logging.getLogger(__name__)

LANE_CACHE_S = 60.0  # how long a next node's announced lane address is reused before asking it again
LANE_CACHE_PEERS = 1024  # next nodes remembered at most


class PushSender:
    """Opens and feeds the channel from each session to its next node (see the module docstring)."""

    def __init__(self, p2p: P2P, sessions: SessionTable, *, peer_timeout_s: float, max_frame_bytes: int, own_host: str):
        self.own_host = own_host  # this node's own address: lanes nearer than it are not dialed (lane.may_dial)
        self.p2p = p2p
        self.sessions = sessions
        self.peer_timeout_s = peer_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._lanes: dict[str, tuple[str | None, float]] = {}  # peer id -> (its announced lane, monotonic s)

    async def push(self, session: ServerSession, step: Step, tensors: list[runtime_pb2.Tensor]) -> None:
        """Hand a step's output to the session's next node. PeerUnavailableError when it cannot be reached."""
        if session.downstream is None:
            channel = await self._open(session)
            if not self.sessions.holds(session):  # closed while the channel opened (a move)
                channel.close()
                raise PeerUnavailableError(f"session {session.session_id} closed; its output is not pushed")
            session.downstream = channel
            session.downstream_reader = asyncio.create_task(self._read_answers(session, channel))
        try:
            session.downstream.send(frame(step, tensors))
            await session.downstream.drain()  # a next node that reads nothing holds the step, within its timeout
        except PeerUnavailableError as exc:
            raise PeerUnavailableError(f"next node {session.next_peer}: {exc.message}") from None

    async def _open(self, session: ServerSession) -> Channel:
        try:
            async with asyncio.timeout(self.peer_timeout_s):
                address = None
                if session.lane_next is not None and session.lane_out is not None:
                    address = await self.announced_lane(session.next_peer)
                    if address != session.lane_next:
                        logger.debug(
                            "session %s names lane %s for %s, which announces %s",
                            session.session_id, session.lane_next, session.next_peer, address,
                        )  # fmt: skip
                if address is not None and not lane.may_dial(address, self.own_host):
                    logger.info("%s announces lane %s, nearer than this node's own: pushed over libp2p instead",
                                session.next_peer, address)  # fmt: skip
                    address = None
                if address is not None:
                    try:
                        stream = await lane.connect(
                            address,
                            lane.ROLE_SEND,
                            session.session_id,
                            session.lane_out,
                            max_frame_bytes=self.max_frame_bytes,
                        )
                        return LaneChannel(stream, "answer on a data lane")
                    except lane.LaneClosedError as exc:  # (full, or not reachable from here): libp2p still is
                        logger.debug("lane %s of %s failed (%r): pushed over libp2p", address, session.next_peer, exc)
                return await open_stream(
                    self.p2p, session.next_peer, rpc.PUSH_STREAM, max_frame_bytes=self.max_frame_bytes
                )
        except Exception as exc:
            logger.debug("push channel to %s failed: %r", session.next_peer, exc)
            message = exc.message if isinstance(exc, NesaError) else "not reachable"  # (the cause stays in this log)
            raise PeerUnavailableError(f"next node {session.next_peer} did not take the step: {message}") from None

    async def announced_lane(self, peer_id: str) -> str | None:
        """The lane address `peer_id` announces for itself (None: it has none, or did not answer properly), asked
        over libp2p and kept for LANE_CACHE_S."""
        now = time.monotonic()
        cached = self._lanes.get(peer_id)
        if cached is not None and now - cached[1] < LANE_CACHE_S:
            return cached[0]
        try:
            answer = await self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), rpc.INFO, Frame(), Frame)
            reply = read(answer, INFO_ANSWERS, max_bytes=MAX_INFO_BYTES)
            info = reply.node_info() if isinstance(reply, InfoReply) else None
            address = info.lane if info is not None and info.peer_id == peer_id else None
        except Exception as exc:
            logger.debug("lane address of %s unknown: %r", peer_id, exc)
            address = None
        if len(self._lanes) >= LANE_CACHE_PEERS:
            self._lanes.clear()
        self._lanes[peer_id] = (address, now)
        return address

    async def _read_answers(self, session: ServerSession, channel: Channel) -> None:
        """The next node's refusals, reported to the client; then the channel's end, if the session still uses it."""
        try:
            while (answer := await channel.receive()) is not None:
                message = read(answer, PUSH_ANSWERS)
                if isinstance(message, ErrorReply):
                    # reported as the next node's (the client replaces that one), never as this node's own: a
                    # refusal this node passed on as its own would make the client take it for this node refusing
                    # its input, and accuse the node before it
                    error = message.error()
                    if isinstance(error, SessionNotFoundError):  # it dropped the session (moved, restarted): failed
                        error = PeerUnavailableError(f"next node {session.next_peer} lost the session: {error.message}")
                    else:  # its queue or streams full (quota), or a push it refused
                        error = PeerUnavailableError(f"next node {session.next_peer} refused: {error.message}")
                    session.report(error)
            ending = "ended"
        except Exception as exc:
            ending = f"failed: {exc!r}"
        logger.debug("push channel of session %s %s", session.session_id, ending)
        channel.close()
        if session.downstream is channel and self.sessions.holds(session):
            session.downstream = session.downstream_reader = None  # a later push opens a new channel
            session.report(PeerUnavailableError(f"next node {session.next_peer}: push channel {ending}"))


__all__ = ["PushSender"]

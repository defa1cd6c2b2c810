"""A node's pushes along a direct chain over libp2p: taking the steps its upstream node pushes (one long-lived stream
per session, or one message each), and pushing its own outputs to the next node, reporting to the client when the next
node refuses a step or goes away. Data lanes, where the client set them up, carry the same pushes (server/lanes.py).

`PushServing` is a part of BlockHandler (it uses the handler's sessions, config and P2P host).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator  # noqa: UP035 -- hivemind's servicer detects streams by typing's name

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import runtime_pb2

from nesa_node.errors import (
    BadRequestError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    SessionNotFoundError,
)
from nesa_node.protocol.wire import (
    RPC_PUSH_STREAM,
    drain,
    error_from_metadata,
    error_response,
    field,
    pack_metadata,
    tensor_to_proto,
    unpack_metadata,
)
from nesa_node.server.session import END_OF_SESSION, MAX_ID_LENGTH, ServerSession

logger = logging.getLogger(__name__)


class PushServing:
    """Pushes between the nodes of a direct chain (see the module docstring)."""

    async def rpc_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """A step pushed by the upstream node of a direct chain; queued into its session."""
        try:
            await self._accept_push(request, context)
            return runtime_pb2.ExpertResponse()
        except RequestError as exc:
            return error_response(exc)

    async def rpc_push_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        """Steps pushed by the upstream node over one long-lived stream (no per-step stream setup)."""
        async for request in requests:
            try:
                await self._accept_push(request, context)
            except RequestError as exc:
                yield error_response(exc)

    async def _accept_push(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> None:
        metadata = unpack_metadata(request.metadata)
        session_id = field(metadata, "session_id", str)
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFoundError(f"no open session {session_id[:MAX_ID_LENGTH]!r} on this node")
        if context.remote_id.to_base58() != session.upstream_peer:
            raise BadRequestError("push from a peer that is not this session's upstream")
        if "control" in metadata or "replay" in metadata:
            raise BadRequestError("session control and replay come from the session's client only")
        if session.room.locked():
            raise QuotaExceededError(
                f"session {session_id[:MAX_ID_LENGTH]!r} already has {self.config.max_queued_steps} steps waiting"
            )
        await session.room.acquire()  # free, so this does not wait
        session.inbox.put_nowait((request, metadata))

    async def _push(self, session: ServerSession, output: torch.Tensor, reply: dict) -> None:
        request = runtime_pb2.ExpertRequest(
            tensors=[tensor_to_proto(output, session.output_codec)],
            metadata=pack_metadata({**reply, "session_id": session.session_id}),
        )
        if session.lane_next is not None and session.lane_out is not None:
            await self._push_lane(session, request)
            return
        if session.push_outbox is None:
            outbox: asyncio.Queue = asyncio.Queue()
            try:
                responses = await asyncio.wait_for(
                    self.p2p.iterate_protobuf_handler(
                        PeerID.from_base58(session.next_peer),
                        RPC_PUSH_STREAM,
                        drain(outbox, END_OF_SESSION),
                        runtime_pb2.ExpertResponse,
                    ),
                    timeout=self.config.peer_timeout_s,
                )
            except Exception as exc:
                logger.debug("push stream to %s failed: %r", session.next_peer, exc)
                raise PeerUnavailableError(f"next node {session.next_peer} did not take the step: {exc!r}") from None
            session.push_outbox = outbox
            session.push_reader = asyncio.create_task(self._read_push_errors(session, responses))
        session.push_outbox.put_nowait(request)

    async def _read_push_errors(self, session: ServerSession, responses) -> None:
        """The next node answers a push stream only to refuse a step; report that to the client. The stream
        ending while the session still pushes on it means the next node is gone: report that at once, so the
        client replaces it now rather than when its step deadline passes."""
        try:
            async for response in responses:
                metadata = unpack_metadata(response.metadata)
                if "error" in metadata:
                    error = error_from_metadata(metadata)
                    if isinstance(error, SessionNotFoundError):  # it dropped the session (moved, restarted): failed
                        error = PeerUnavailableError(f"next node {session.next_peer} lost the session: {error.message}")
                    session.inbox.put_nowait((None, {"_error": error}))
            ending = "ended"
        except Exception as exc:
            ending = f"failed: {exc!r}"
        logger.debug("push stream of session %s %s", session.session_id, ending)
        if session.push_reader is asyncio.current_task() and self.sessions.get(session.session_id) is session:
            session.push_outbox = session.push_reader = None  # a later push opens a new stream
            error = PeerUnavailableError(f"next node {session.next_peer}: push stream {ending}")
            session.inbox.put_nowait((None, {"_error": error}))


__all__ = ["PushServing"]

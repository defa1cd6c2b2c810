"""The node's RPC handlers: info, forward, streaming inference with a KV cache, and push between nodes.

Protocol of `rpc_inference` (one stream per session):
  1. the client sends an open message: metadata {session_id, blocks, batch, max_length, upstream, next?}, where
     `blocks` lists the block ids the client expects this node to run: its span or a contiguous part of it (a
     chain may use a node for part of its range; the session still reserves cache for the whole span);
  2. the node reserves the session's cache bytes (within the node's budget and the peer's quota) and answers
     {ok: true, cache_tokens_left} or an error;
  3. steps arrive as {step_id, position} + hidden states (batch, seq, hidden), either on this stream (first
     node, or client-relayed mode) or pushed by the upstream node (direct chain) over one `rpc_push_stream`
     per session (`rpc_push` takes single steps);
  4. each step's output goes to `next` over that push stream, or back on this stream when there is no next node;
  5. the cache is freed when the stream ends, on error, after `session_timeout_s` without a step, or when a step
     is not computed and handed on within `step_timeout_s` (a stuck next node, or this node stalled).
Steps and outputs may instead travel on data lanes (direct encrypted TCP, keys given at open): see
nesa_node.server.lanes. A step whose step_id equals the previous one is a duplicate: its stored output is sent again, not recomputed.

Limits, all checked before anything is allocated: frames over `max_message_bytes` (see nesa_node.protocol.framing),
hidden states over `max_tokens_per_step`, at most `max_queued_steps` waiting steps per session (the client's
stream then waits; a pusher is refused), and `max_step_errors` refused steps in a row end the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator  # noqa: UP035 -- hivemind's servicer detects streams by typing's name

import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

from nesa_node.compression.codec import WIRE_DTYPES, all_finite
from nesa_node.errors import (
    BadRequestError,
    MessageTooLargeError,
    NesaError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
    WrongBlocksError,
)
from nesa_node.protocol import lane
from nesa_node.protocol.framing import serve_stream
from nesa_node.protocol.wire import (
    MAX_METADATA_BYTES,
    WireCodec,
    error_response,
    field,
    pack_metadata,
    tensor_from_proto,
    tensor_to_proto,
    unpack_metadata,
)
from nesa_node.server.config import NodeConfig
from nesa_node.server.lanes import LaneServing, close_lanes, lane_settings
from nesa_node.server.link_probe import MAX_PING_BYTES
from nesa_node.server.push import PushServing
from nesa_node.server.session import END_OF_SESSION, MAX_ID_LENGTH, ServerSession, end_push_stream
from nesa_node.sharding.kv_cache import CacheBudget

logger = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 8  # batch x seq of a decode step; such steps may run inline (NodeConfig.inline_compute_ms)


def _step_digest(request: runtime_pb2.ExpertRequest, metadata: dict, position: int) -> bytes:
    """What identifies a step's content: position, codec and the tensor bytes as sent (a retry sends the same)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str((position, metadata.get("codec"))).encode())
    for tensor in request.tensors:
        digest.update(str((tensor.dtype, tuple(tensor.size))).encode())
        digest.update(tensor.buffer)
    return digest.digest()


class BlockHandler(LaneServing, PushServing, ServicerBase):
    """Serves one BlockSpan over hivemind P2P. Compute runs on one worker thread so the event loop stays free."""

    def __init__(self, span, config: NodeConfig, budget: CacheBudget, info_provider, p2p: P2P):
        self.span = span
        self.config = config
        self.budget = budget
        self.info_provider = info_provider  # () -> NodeInfo, the live record
        self.p2p = p2p
        self.sessions: dict[str, ServerSession] = {}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nesa-compute")
        self.compute_seconds = 0.0  # total time spent in the blocks
        self.steps_served = 0
        self._small_step_s: float | None = None  # moving average compute time of small steps, seconds
        self.draining = False
        self.idle = asyncio.Event()  # set while no session is open
        self.idle.set()
        self.accepted_codecs = tuple(dict.fromkeys(("none", *config.compression)))  # "none" always works
        # float32 hidden states of the largest step, plus metadata and protobuf framing
        self.max_message_bytes = config.max_message_bytes or (
            config.max_tokens_per_step * span.hidden_size * 4 + MAX_METADATA_BYTES + 1024
        )
        self.peer_cache_bytes = int(budget.capacity_bytes * config.max_cache_share_per_peer)
        self.lane_address: str | None = None  # set by the node once its lane listens
        self.tickets: dict[str, tuple[bytes, str, float]] = {}  # FORWARD lane tickets: id -> (key, peer, issued)
        self.forward_lanes: dict[str, int] = {}  # open FORWARD lanes per peer

    async def add_p2p_handlers(self, p2p: P2P, wrapper=None, *, namespace=None, balanced=False) -> None:
        """Unary RPCs through hivemind (p2pd bounds their size); streams through `serve_stream`, which checks
        each frame's length before reading it."""
        self._collect_rpc_handlers()
        for rpc in self._rpc_handlers:
            name = self._get_handle_name(namespace, rpc.method_name)
            method = getattr(self, rpc.method_name)
            if rpc.stream_input:
                await serve_stream(p2p, name, method, rpc.request_type, max_frame_bytes=self.max_message_bytes)
            else:
                await p2p.add_protobuf_handler(name, method, rpc.request_type, stream_output=rpc.stream_output)

    # ---- unary -------------------------------------------------------------------------------------------

    async def _injected_delay(self) -> None:
        if self.config.inject_delay_ms > 0:
            await asyncio.sleep(self.config.inject_delay_ms / 1000)

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        await self._injected_delay()
        return runtime_pb2.ExpertResponse(metadata=pack_metadata({"info": self.info_provider().to_wire()}))

    async def rpc_ping(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """An empty answer, for RTT; a request may carry up to MAX_PING_BYTES of payload, for bandwidth."""
        await self._injected_delay()
        if request.ByteSize() > MAX_PING_BYTES:
            return error_response(MessageTooLargeError(f"ping of {request.ByteSize()} bytes over {MAX_PING_BYTES}"))
        return runtime_pb2.ExpertResponse()

    async def rpc_forward(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        """Run the span on a whole sequence without a cache (positions from 0)."""
        return await self._forward(request)

    async def _forward(self, request: runtime_pb2.ExpertRequest) -> runtime_pb2.ExpertResponse:
        await self._injected_delay()
        try:
            metadata = unpack_metadata(request.metadata)
            blocks = self._check_blocks(metadata)
            hidden = self._read_hidden(request, metadata, batch=None)
            output_codec = self._codec(metadata.get("output_codec", metadata.get("codec")))
            output, seconds = await self._compute(hidden, None, 0, blocks)
            return runtime_pb2.ExpertResponse(
                tensors=[tensor_to_proto(output, output_codec)],
                metadata=pack_metadata({"compute_s": seconds, "codec": output_codec.to_metadata()}),
            )
        except RequestError as exc:
            return error_response(exc)

    # ---- streaming inference ------------------------------------------------------------------------------

    async def rpc_inference(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            first = await asyncio.wait_for(anext(requests), timeout=self.config.peer_timeout_s)
            session = self._open_session(first, context)
        except (StopAsyncIteration, TimeoutError):
            return
        except RequestError as exc:
            yield error_response(exc)
            return
        reader = asyncio.create_task(self._read_stream(requests, session))
        try:
            yield runtime_pb2.ExpertResponse(
                metadata=pack_metadata({"ok": True, "cache_tokens_left": self.budget.tokens_left})
            )
            while True:
                try:
                    if session.inbox.empty():  # asyncio.timeout: no task per step, unlike wait_for
                        async with asyncio.timeout(self.config.session_timeout_s):
                            item = await session.inbox.get()
                    else:
                        item = session.inbox.get_nowait()
                except TimeoutError:
                    logger.info(
                        "session %s idle for %.0f s, closing", session.session_id, self.config.session_timeout_s
                    )
                    break
                if item is END_OF_SESSION:
                    break
                request, metadata = item
                if request is not None:  # a peer's message (not a report from this node's own push stream)
                    session.room.release()
                step_id = metadata.get("step_id")
                try:
                    if "control" in metadata:
                        yield self._control(session, metadata)
                        continue
                    replay = metadata.get("replay") is True  # rebuilding this node's cache: output to the client
                    try:
                        async with asyncio.timeout(self.config.step_timeout_s):
                            output, seconds = await self._inference_step(session, request, metadata)
                            start = session.last_position  # of this step, also when it was a duplicate
                            upstream_s = metadata.get("compute_s", 0.0)  # compute time of the nodes before this one
                            valid = isinstance(upstream_s, float | int) and upstream_s >= 0
                            reply = {
                                "step_id": step_id,
                                "position": start,
                                "compute_s": seconds + (float(upstream_s) if valid else 0.0),
                                "codec": session.output_codec.to_metadata(),
                            }
                            if not replay and session.next_peer is not None:
                                await self._push(session, output, reply)
                    except TimeoutError:
                        logger.info(
                            "session %s: step over %.1f s, closing", session.session_id, self.config.step_timeout_s
                        )
                        yield error_response(
                            PeerUnavailableError(
                                f"step not done within this node's step timeout of {self.config.step_timeout_s} s; "
                                "session closed"
                            ),
                            step_id=step_id,
                        )
                        break
                    if replay:
                        yield runtime_pb2.ExpertResponse(
                            tensors=[tensor_to_proto(output, session.output_codec)],
                            metadata=pack_metadata({**reply, "replayed": True}),
                        )
                    elif session.next_peer is None:
                        response = runtime_pb2.ExpertResponse(
                            tensors=[tensor_to_proto(output, session.output_codec)], metadata=pack_metadata(reply)
                        )
                        if not self._send_output(session, response):
                            yield response  # no output lane (or it closed): on the session's own stream
                    session.refused_in_a_row = 0
                except NesaError as exc:
                    yield error_response(exc, step_id=step_id)
                    session.refused_in_a_row += 1
                    if session.refused_in_a_row >= self.config.max_step_errors:
                        yield error_response(
                            BadRequestError(f"{session.refused_in_a_row} refused steps in a row; session closed")
                        )
                        break
        finally:
            reader.cancel()
            close_lanes(session)
            self._close_session(session)

    @staticmethod
    def _send_output(session: ServerSession, response: runtime_pb2.ExpertResponse) -> bool:
        """Send a last node's output on the client's output lane; False when there is none to send it on."""
        if session.output_lane is None:
            return False
        try:
            session.output_lane.send(response.SerializeToString())
            return True
        except lane.LaneClosedError:
            session.output_lane = None
            return False

    def _control(self, session: ServerSession, metadata: dict) -> runtime_pb2.ExpertResponse:
        """Session control from the client, in order with its steps (failover of a neighbouring node):
        "history" returns this node's outputs for the first `position` tokens (lossless), so a replacement for the
        next span can rebuild its cache; "retarget" sets `next` (the peer this node pushes to) and/or `upstream`
        (the only peer whose pushes it accepts), each when given."""
        control = field(metadata, "control", str)
        if control == "history":
            upto = field(metadata, "position", int)
            kept = sum(output.shape[1] for output in session.outputs)  # tokens; only nodes with a next node keep any
            if not 0 < upto <= kept:
                raise BadRequestError(f"history position {upto} outside 1..{kept} (the outputs this node keeps)")
            history = torch.cat(session.outputs, dim=1)[:, :upto]  # (batch, upto, hidden)
            return runtime_pb2.ExpertResponse(
                tensors=[tensor_to_proto(history)], metadata=pack_metadata({"control": control, "position": upto})
            )
        if control == "retarget":
            peers = {
                name: field(metadata, name, (str, type(None))) for name in ("next", "upstream") if name in metadata
            }
            for name, peer in peers.items():
                if peer is None:
                    continue
                try:
                    PeerID.from_base58(peer)
                except Exception:
                    raise BadRequestError(f"{name} is not a valid peer id") from None
            given_lanes = lane_settings(metadata)
            if peers.get("upstream") is not None:
                session.upstream_peer = peers["upstream"]
            if "next" in peers:
                end_push_stream(session)
                session.next_peer = peers["next"]
                session.lane_next = None  # unless the retarget names the new next node's lane
            if "lane_in" in given_lanes:  # a new upstream: the old one's lanes end
                for stream in list(session.lane_streams):
                    stream.close()
            if "lane_next" in given_lanes or "lane_out" in given_lanes:
                end_push_stream(session)
            for attribute, value in given_lanes.items():
                setattr(session, attribute, value)
            return runtime_pb2.ExpertResponse(metadata=pack_metadata({"control": control, "ok": True}))
        raise BadRequestError(f"unknown session control {control[:32]!r}")

    def _open_session(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> ServerSession:
        metadata = unpack_metadata(request.metadata)
        blocks = self._check_blocks(metadata)
        session_id = field(metadata, "session_id", str)
        batch = field(metadata, "batch", int)
        max_length = field(metadata, "max_length", int)
        client_peer = context.remote_id.to_base58()
        upstream = field(metadata, "upstream", str, default=client_peer)
        next_peer = field(metadata, "next", (str, type(None)), default=None)
        output_codec = self._codec(metadata.get("output_codec"))
        given_lanes = lane_settings(metadata)
        if not session_id.isascii():
            raise BadRequestError("session_id must be ASCII")
        if not 0 < len(session_id) <= MAX_ID_LENGTH or len(upstream) > MAX_ID_LENGTH:
            raise BadRequestError("session_id and upstream must be non-empty ids of at most 128 characters")
        if next_peer is not None:
            try:
                PeerID.from_base58(next_peer)
            except Exception:
                raise BadRequestError("next is not a valid peer id") from None
        if self.draining:
            raise TooManySessionsError("node is draining and accepts no new sessions")
        if session_id in self.sessions:
            raise BadRequestError(f"session {session_id!r} is already open on this node")
        if len(self.sessions) >= self.config.max_sessions:
            raise TooManySessionsError(f"node has {len(self.sessions)} open sessions, its limit")
        if not 0 < batch <= self.config.max_batch:
            raise BadRequestError(f"batch must be in 1..{self.config.max_batch}, got {batch}")
        if not 0 < max_length <= self.config.max_length:
            raise BadRequestError(f"max_length must be in 1..{self.config.max_length}, got {max_length}")
        peer_sessions = [session for session in self.sessions.values() if session.client_peer == client_peer]
        if len(peer_sessions) >= self.config.max_sessions_per_peer:
            raise QuotaExceededError(
                f"peer already has {len(peer_sessions)} open sessions here, the per-peer limit "
                "(node setting max_sessions_per_peer)"
            )
        peer_bytes = sum(session.reserved_bytes for session in peer_sessions)
        need = self.budget.session_bytes(batch, max_length)
        if need <= self.budget.free_bytes and peer_bytes + need > self.peer_cache_bytes:  # else: CacheBudgetError
            raise QuotaExceededError(
                f"a cache of batch {batch} x {max_length} tokens would take this peer past its share of the node's "
                f"cache ({self.peer_cache_bytes // self.budget.bytes_per_token} tokens of batch 1, of which "
                f"{peer_bytes // self.budget.bytes_per_token} are reserved); use a shorter max_length"
            )
        reserved = self.budget.reserve(batch, max_length)  # raises CacheBudgetError
        session = ServerSession(
            session_id=session_id,
            batch=batch,
            max_length=max_length,
            reserved_bytes=reserved,
            cache=self.span.new_cache(),
            blocks=blocks,
            client_peer=client_peer,
            upstream_peer=upstream,
            next_peer=next_peer,
            output_codec=output_codec,
            room=asyncio.Semaphore(self.config.max_queued_steps),
            **given_lanes,
        )
        self.sessions[session_id] = session
        self.idle.clear()
        logger.debug("opened session %s (batch %d, max_length %d)", session_id, batch, max_length)
        return session

    def _close_session(self, session: ServerSession) -> None:
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
            self.budget.release(session.reserved_bytes)
            session.cache = None
            close_lanes(session)
            session.last_output = None
            session.outputs.clear()
            if not self.sessions:
                self.idle.set()
            logger.debug("closed session %s", session.session_id)

    async def _read_stream(self, requests: AsyncIterator[runtime_pb2.ExpertRequest], session: ServerSession) -> None:
        try:
            async for request in requests:
                try:
                    metadata = unpack_metadata(request.metadata)
                except RequestError as exc:
                    metadata = {"_error": exc}
                await session.room.acquire()  # a client sending faster than the node computes waits here
                session.inbox.put_nowait((request, metadata))
        except Exception as exc:  # the client went away: a normal event
            logger.debug("stream of session %s ended: %r", session.session_id, exc)
        session.inbox.put_nowait(END_OF_SESSION)  # not when cancelled: the session is over already

    async def _inference_step(
        self, session: ServerSession, request: runtime_pb2.ExpertRequest, metadata: dict
    ) -> tuple[torch.Tensor, float]:
        if "_error" in metadata:
            raise metadata["_error"]
        await self._injected_delay()
        step_id = field(metadata, "step_id", str)
        position = field(metadata, "position", int)
        digest = _step_digest(request, metadata, position)
        if step_id == session.last_step_id and session.last_output is not None:
            # A new upstream (a replacement of the previous node, since retargeted) resends a step this node already
            # took from the old one: it recomputed it from a cache rebuilt by replay, so its values may differ from
            # the old node's in the last bits. The recorded output stays the answer: it is what this node's cache
            # holds. From the same upstream, other content under a used id is refused.
            if digest != session.last_digest and session.last_upstream == session.upstream_peer:
                raise BadRequestError(f"step id {step_id[:MAX_ID_LENGTH]!r} was already used for different content")
            return session.last_output, 0.0  # a duplicate delivery (a retry): same output, computed once
        if position != session.position:
            raise BadRequestError(f"step at position {position}, but the session's cache holds {session.position}")
        hidden = self._read_hidden(request, metadata, batch=session.batch)
        if position + hidden.shape[1] > session.max_length:
            raise BadRequestError(
                f"step would reach {position + hidden.shape[1]} tokens, over the session's max_length "
                f"{session.max_length}"
            )
        output, seconds = await self._compute(hidden, session.cache, position, session.blocks)
        session.last_position = position
        session.position += hidden.shape[1]
        if session.next_peer is not None:  # kept for a replacement of the next node (see _control "history")
            session.outputs.append(output)
        session.last_step_id, session.last_output, session.last_digest = step_id, output, digest
        session.last_upstream = session.upstream_peer
        return output, seconds

    def _check_blocks(self, metadata: dict) -> tuple[int, int]:
        """The block ids a client expects this node to run, (first, end): a contiguous ascending part of its span."""
        blocks = field(metadata, "blocks", list)
        if self.span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")
        total = self.span.config.num_hidden_layers
        if not 0 < len(blocks) <= total or not all(type(block) is int for block in blocks):
            raise BadRequestError(f"blocks must be a list of 1..{total} block ids")
        unknown = [block for block in blocks if not 0 <= block < total]
        if unknown:
            raise BadRequestError(f"unknown block {unknown[0]}: the model has blocks 0..{total - 1}")
        if blocks != list(range(blocks[0], blocks[0] + len(blocks))):
            raise BadRequestError(f"blocks must be contiguous and ascending, got {blocks[:8]}")
        if not self.span.start <= blocks[0] <= blocks[-1] < self.span.end:
            raise WrongBlocksError(
                f"this node serves blocks {self.span.start}..{self.span.end - 1}, not {blocks[0]}..{blocks[-1]}"
            )
        return blocks[0], blocks[-1] + 1

    def _codec(self, value) -> WireCodec:
        """A codec named by a peer, checked against the codecs this node accepts (BadRequestError otherwise)."""
        return WireCodec.from_metadata(value, accepted=self.accepted_codecs)

    def _read_hidden(self, request: runtime_pb2.ExpertRequest, metadata: dict, *, batch: int | None) -> torch.Tensor:
        if len(request.tensors) != 1:
            raise BadRequestError(f"expected one tensor of hidden states, got {len(request.tensors)}")
        hidden = tensor_from_proto(
            request.tensors[0],
            allowed_dtypes=tuple(WIRE_DTYPES),
            max_elements=self.config.max_tokens_per_step * self.span.hidden_size,
            rank=3,
            codec=self._codec(metadata.get("codec")),
        )
        rows, seq, width = hidden.shape  # (batch, seq, hidden)
        if width != self.span.hidden_size:
            raise BadRequestError(f"hidden size {width} does not match the model's {self.span.hidden_size}")
        if seq == 0 or rows == 0:
            raise BadRequestError("hidden states must hold at least one token")
        if batch is not None and rows != batch:
            raise BadRequestError(f"batch of {rows} rows in a session opened with {batch}")
        if not all_finite(hidden):
            raise BadRequestError("hidden states contain NaN or Inf")
        return hidden

    async def _compute(
        self, hidden: torch.Tensor, cache, position: int, blocks: tuple[int, int]
    ) -> tuple[torch.Tensor, float]:
        """Run `blocks` (first, end) of the span; short steps on the loop itself, others on the compute thread (see
        inline_compute_ms)."""

        span = self.span  # the span the blocks were checked against, even if the node moves meanwhile

        def run() -> tuple[torch.Tensor, float]:
            started = time.perf_counter()
            output = span(hidden, cache, position, blocks)
            return output, time.perf_counter() - started

        small = hidden.shape[0] * hidden.shape[1] <= SMALL_STEP_TOKENS
        if small and self._small_step_s is not None and self._small_step_s * 1000 < self.config.inline_compute_ms:
            output, seconds = run()
        else:
            output, seconds = await asyncio.get_running_loop().run_in_executor(self.executor, run)
        if small:  # moving average of recent small steps: what the next one will likely cost
            previous = self._small_step_s
            self._small_step_s = seconds if previous is None else 0.8 * previous + 0.2 * seconds
        self.compute_seconds += seconds
        self.steps_served += 1
        return output, seconds

    def use_span(self, span, budget: CacheBudget) -> None:
        """Serve `span` with the cache `budget` sized for it (a node that moved); span None while the node loads
        other blocks: requests naming blocks are refused. Call with no session open (see drop_sessions)."""
        self.span, self.budget = span, budget
        self.peer_cache_bytes = int(budget.capacity_bytes * self.config.max_cache_share_per_peer)

    def drop_sessions(self) -> None:
        """Close every session still open now, freeing its cache (a stuck one, after shutdown() asked it to end)."""
        for session in list(self.sessions.values()):
            session.inbox.put_nowait(END_OF_SESSION)
            self._close_session(session)

    async def shutdown(self) -> None:
        """End every session after the steps already in its queue (the compute thread stays up: see close)."""
        self.draining = True
        for session in list(self.sessions.values()):
            session.inbox.put_nowait(END_OF_SESSION)

    def close(self) -> None:
        """Stop the compute thread; steps still waiting for it are cancelled."""
        with contextlib.suppress(Exception):
            self.executor.shutdown(wait=False, cancel_futures=True)

"""The node's RPCs on its P2P host (names in protocol/rpc.py): each a thin entry that reads the peer's frame and calls
the component that does the work.

  INFO         the node's live record                 PING          an empty answer (RTT, bandwidth probes)
  FORWARD      a cacheless forward (InferenceService)  INFERENCE     one session stream (InferenceService)
  FORWARD_STREAM  one cacheless forward too large for a unary call
  PUSH         one step pushed by an upstream node    PUSH_STREAM   a session's pushes over one stream
  LANE_TICKET  a FORWARD data lane ticket (LaneServer)  ADAPTER       a LoRA adapter's blocks, for a peer (NodeAdapters)
  TRAIN        one LoRA training session (TrainingService)  TRAIN_SYNC    a replica's gradients (TrainingService)
Unary calls are bounded by p2pd (4 MiB); streams by the node's frame limit (protocol/framing.py).
"""

from __future__ import annotations

from collections.abc import Callable

from hivemind.p2p import P2P, P2PContext

from nesa_node.errors import MessageTooLargeError, QuotaExceededError, RequestError
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame, frame, is_error_reply, read
from nesa_node.protocol.framing import StreamChannel, answer_one_frame, serve_stream, settled
from nesa_node.protocol.messages import PUSHED, ErrorReply, InfoReply
from nesa_node.protocol.records import NodeInfo
from nesa_node.protocol.stream_gate import AnswerGate, OpeningGate
from nesa_node.server.adapter_fetch import adapter_answer_gate, answer_adapter_request
from nesa_node.server.inference import InferenceService
from nesa_node.server.lanes import LaneServer, serve_steps
from nesa_node.server.sessions import Inbound, SessionTable
from nesa_node.server.training import TrainingService

MAX_FORWARD_STREAMS = 8  # large forwards a node reads and runs at once (each up to a frame of its limit in memory)
MAX_FORWARD_STREAMS_PER_PEER = 2  # a client sends one at a time to a node; one more for a retry after a failure
MAX_FORWARD_STREAMS_PER_MINUTE = 120  # per peer (guess: a long prompt's forward takes a second or more)
# forwards that fit a unary call (up to p2pd's 4 MiB each): each waits for the one compute thread, holding its request
# and answer, so they are bounded like the large ones, with room for the short calls a busy client makes
MAX_FORWARD_CALLS = 16
MAX_FORWARD_CALLS_PER_PEER = 2
MAX_FORWARD_CALLS_PER_MINUTE = 3600  # per peer
# session, push, training and sync streams that have not yet said what they are for, each reading a frame of up to
# the node's limit at most: an honest peer's settle within milliseconds of opening (its first frame goes out with the
# stream), so these bounds are met only by streams held idle (a peer's own may be as many as its sessions here)
MAX_OPENING_STREAMS = 128
MAX_OPENING_STREAMS_PER_PEER = 32


class NodeRpc:
    """Registers and answers the node's RPCs."""

    def __init__(
        self,
        inference: InferenceService,
        training: TrainingService,
        sessions: SessionTable,
        lanes: LaneServer,
        info: Callable[[], NodeInfo],
        *,
        max_frame_bytes: int,
        metrics=None,
    ):
        self.metrics = metrics  # nesa_node.metrics.NodeMetrics, or None
        self.inference = inference
        self.training = training
        self.sessions = sessions
        self.lanes = lanes
        self.info = info
        self.max_frame_bytes = max_frame_bytes
        self.adapter_answers = adapter_answer_gate()  # peers' ADAPTER streams: bounded per peer and in all
        # peers' FORWARD_STREAMs, each up to a frame of the node's limit in memory: bounded the same way (a client
        # sends its forwards to a node one at a time)
        elsewhere = "ask again later or ask another node"
        self.forward_streams = AnswerGate.per_minute(
            MAX_FORWARD_STREAMS,
            MAX_FORWARD_STREAMS_PER_PEER,
            MAX_FORWARD_STREAMS_PER_MINUTE,
            "large forwards",
            elsewhere,
        )
        self.forward_calls = AnswerGate.per_minute(  # the unary ones
            MAX_FORWARD_CALLS, MAX_FORWARD_CALLS_PER_PEER, MAX_FORWARD_CALLS_PER_MINUTE, "forwards", elsewhere
        )
        # peers' streams from their opening until they say what they are for (framing.settled: a session's open read,
        # a push stream bound to its session; a training sync's stream is counted to its end): these kinds are bounded
        # by limits of their own only once settled, so until then they are bounded here, per peer and in all
        self.opening_streams = OpeningGate(max_opening=MAX_OPENING_STREAMS, max_per_peer=MAX_OPENING_STREAMS_PER_PEER)

    async def register(self, p2p: P2P) -> None:
        for name, handler in (
            (rpc.INFO, self.rpc_info),
            (rpc.PING, self.rpc_ping),
            (rpc.FORWARD, self.rpc_forward),
            (rpc.PUSH, self.rpc_push),
            (rpc.LANE_TICKET, self.rpc_lane_ticket),
        ):
            await p2p.add_protobuf_handler(name, self._counted(name, handler), Frame)
        # a node is the upstream of many sessions, or syncs many replicas, and may open their streams in one burst:
        # those kinds only weigh in the total's eviction; a client opens no more sessions here than its quota
        streams = (
            (rpc.INFERENCE, self._opening(self.inference.serve_session)),
            (rpc.FORWARD_STREAM, self.rpc_forward_stream),
            (rpc.PUSH_STREAM, self._opening(self.rpc_push_stream, capped=False)),
            (rpc.ADAPTER, self.rpc_adapter),
            (rpc.TRAIN, self._opening(self.training.serve_training)),
            (rpc.TRAIN_SYNC, self._opening(self.training.sync.serve, capped=False)),
        )
        for name, handler in streams:
            await serve_stream(p2p, name, self._counted_stream(name, handler), max_frame_bytes=self.max_frame_bytes)

    async def rpc_adapter(self, channel: StreamChannel, context: P2PContext) -> None:
        """A peer fetching an adapter this node announces (server/adapter_fetch.py)."""
        peer = context.remote_id.to_base58()
        await answer_adapter_request(channel, self.inference.adapters, peer, self.adapter_answers)

    def _opening(self, handler, *, capped: bool = True):
        """`handler`, admitted by `opening_streams` before a byte of its stream is read (refused with a typed error
        when the peer has its most streams opening, if `capped`) and holding its place there until it settles;
        evicted, the stream is answered with a typed error and closed."""

        async def opening(channel: StreamChannel, context: P2PContext) -> None:
            def evict() -> None:
                channel.refuse(QuotaExceededError("this node has its most streams opening; the idlest one is closed"))
                channel.close()
                self._count_refused("evicted")

            try:
                channel.on_settled = self.opening_streams.enter(context.remote_id.to_base58(), evict, capped=capped)
            except QuotaExceededError:
                self._count_refused("peer_share")
                raise
            try:
                await handler(channel, context)
            finally:
                settled(channel)

        return opening

    def _count_refused(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.opening_streams_refused_total.labels(reason).inc()

    def _counted(self, name: str, handler):
        """`handler`, counting its answers by status (an ErrorReply is "error") when the node has metrics."""
        if self.metrics is None:
            return handler
        counter = self.metrics.rpcs_total

        async def counted(request: Frame, context: P2PContext) -> Frame:
            answer = await handler(request, context)
            counter.labels(name, "error" if is_error_reply(answer) else "ok").inc()
            return answer

        return counted

    def _counted_stream(self, name: str, handler):
        if self.metrics is None:
            return handler
        counter = self.metrics.rpcs_total

        async def counted(channel, context: P2PContext) -> None:
            counter.labels(name, "ok").inc()  # a stream: its messages' errors are answered on it
            await handler(channel, context)

        return counted

    async def rpc_info(self, request: Frame, context: P2PContext) -> Frame:
        await self.inference.injected_delay()
        return frame(InfoReply(info=self.info().to_wire()))

    async def rpc_ping(self, request: Frame, context: P2PContext) -> Frame:
        """An empty answer, for RTT; a request may carry up to MAX_PING_BYTES of payload, for bandwidth."""
        await self.inference.injected_delay()
        if request.ByteSize() > rpc.MAX_PING_BYTES:
            error = MessageTooLargeError(f"ping of {request.ByteSize()} bytes over {rpc.MAX_PING_BYTES}")
            return frame(ErrorReply.of(error))
        return Frame()

    async def rpc_forward(self, request: Frame, context: P2PContext) -> Frame:
        """A cacheless forward in one unary call: a few at once per peer and in all (`forward_calls`); others are
        refused at once rather than queued behind the compute thread's sessions."""
        try:
            leave = self.forward_calls.enter(context.remote_id.to_base58())
        except QuotaExceededError as exc:
            return frame(ErrorReply.of(exc))
        try:
            return await self.inference.forward(request)
        finally:
            leave()

    async def _forward_on_stream(self, request: Frame, context: P2PContext) -> Frame:
        return await self.inference.forward(request)

    async def rpc_forward_stream(self, channel: StreamChannel, context: P2PContext) -> None:
        """A cacheless forward whose request or answer is over p2pd's unary bound (a long prompt's hidden states): one
        request on the stream, read within the peer timeout and the node's frame limit, and its answer. A few such
        streams at once per peer and in all (`forward_streams`); others are refused before a byte is read."""
        leave = self.forward_streams.enter(context.remote_id.to_base58())
        try:
            await answer_one_frame(
                channel, context, self._forward_on_stream, timeout_s=self.inference.network.peer_timeout_s
            )
        finally:
            leave()

    async def rpc_push(self, request: Frame, context: P2PContext) -> Frame:
        """A step pushed by the upstream node of a direct chain, queued into its session."""
        try:
            message = read(request, PUSHED)
            sender = context.remote_id.to_base58()
            session = self.sessions.find(message.session_id, message.owner, sender=sender)
            await self.sessions.admit(session, Inbound(request, message), sender=sender, wait=False)
            return Frame()
        except RequestError as exc:
            return frame(ErrorReply.of(exc))

    async def rpc_push_stream(self, channel: StreamChannel, context: P2PContext) -> None:
        """Steps of one session pushed by its upstream node over one long-lived stream (no per-step stream set-up);
        its first step within the peer timeout, and the stream ends with the session (server/lanes.py serve_steps)."""
        sender = context.remote_id.to_base58()
        timeout_s = self.inference.network.peer_timeout_s
        await serve_steps(channel, None, self.sessions, sender=sender, first_frame_s=timeout_s)

    async def rpc_lane_ticket(self, request: Frame, context: P2PContext) -> Frame:
        try:
            return frame(self.lanes.issue_ticket(context.remote_id.to_base58()))
        except RequestError as exc:
            return frame(ErrorReply.of(exc))


__all__ = ["NodeRpc"]

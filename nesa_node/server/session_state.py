"""One open inference session as a node holds it (`ServerSession`), and the items of its queue (`Inbound`); the
table that opens, admits into and ends them is server/sessions.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nesa_node.protocol.channel import Channel, Frame
from nesa_node.protocol.messages import MAX_METADATA_BYTES, LaneSettings, Message
from nesa_node.protocol.tensors import NO_CODEC, WireCodec

SessionKey = tuple[str, str]  # (base58 id of the peer that opened the session, session id)


@dataclass
class Inbound:
    """One item of a session's queue: a peer's frame and its message (or the error reading it gave), or a report
    from this node itself (frame None: its push to the next node failed)."""

    frame: Frame | None
    message: Message | None = None
    error: Exception | None = None
    from_peer: bool = True  # took a place in the queue (a report from this node does not)
    client_stream: bool = False  # came on the session's own stream (the client's), not pushed by a peer or on a lane


MAX_QUEUED_REPORTS = 4  # a session's reports of its next node's failures waiting to be answered to the client


@dataclass
class ServerSession:
    session_id: str
    batch: int  # rows, fixed for the session
    max_length: int  # tokens the session may reach
    reserved_bytes: int  # cache reserved in the budget: batch x reserved_tokens x bytes per token
    cache: object  # the span's KV cache (sharding/span_cache.py SpanCache)
    blocks: tuple[int, int]  # (first, end): the part of the span this session runs
    client_peer: str  # base58 peer id that opened the session
    upstream_peer: str  # the only peer allowed to push steps (the previous node, or the client)
    next_peer: str | None  # direct chain: push results here; None: answer on the client's stream
    reply: Channel  # the client's session stream: acks, errors, control answers, outputs when no lane takes them
    output_codec: WireCodec = NO_CODEC  # how this node encodes its outputs, chosen by the client at open
    position: int = 0  # tokens already in the cache
    last_step_id: str | None = None
    last_position: int = 0  # where the last step started
    last_digest: bytes = b""  # content of the last step: a duplicate id must come with the same content
    last_upstream: str | None = None  # the upstream peer when the last step was taken (see retarget)
    last_output: torch.Tensor | None = None
    # outputs of every step (batch, seq, hidden), in order: one hidden vector per token, small next to the span's
    # KV cache (2 * kv width per block per token); lets a replacement of the next node rebuild its cache
    outputs: list[torch.Tensor] = field(default_factory=list)
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    # free places for peers' messages in `inbox` (the node's own reports always fit): LimitsConfig.max_queued_steps
    room: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(8))
    refused_in_a_row: int = 0  # consecutive refused steps; the session ends at LimitsConfig.max_step_errors
    reports_queued: int = 0  # this node's own reports in the inbox (`report`), at most MAX_QUEUED_REPORTS
    # data lanes (protocol/lane.py), when the client asked for them: the keys of the links into and out of this node
    # and the next node's lane address
    lane_in: bytes | None = None  # steps from the upstream peer (the client, or the previous node)
    lane_out: bytes | None = None  # outputs to the next node, or to the client when this node is the last
    lane_next: str | None = None  # the next node's lane address; None: push over libp2p
    output: Channel | None = None  # the client's output lane (this node is the last), once it connects
    downstream: Channel | None = None  # to the next node (a push stream or lane), opened at the first push
    downstream_reader: asyncio.Task | None = None
    inbound: set = field(default_factory=set)  # data lanes carrying steps into the session
    # the longest frame any of its channels may bring: its whole cache's hidden states in float32 and a message
    # (`limit_frames`); a frame queued for it can hold no more, whatever the node's own limit
    max_frame_bytes: int | None = None
    push_stream: Channel | None = None  # the libp2p push stream carrying steps into the session (server/lanes.py)
    reserved_tokens: int = 0  # tokens per row the reservation covers
    last_active: float = field(default_factory=time.monotonic)  # opened, or a step done (monotonic s)
    busy: bool = False  # a queue item is being taken: a step computed or handed on, a duplicate or a request answered
    computing: bool = False  # a step that advances the session waits for cache room or is computed
    adapter: object = None  # the LoRA AdapterSlice every step runs with (sharding/lora.py), or None
    adapter_id: str | None = None  # its adapter's id (the sha256 of its manifest)
    push_key: bytes | None = None  # the client's key: this node's pushes' tags, its steps' seals (protocol/push_tag.py)
    release_adapter: Callable[[], None] | None = None  # lets the node's adapter store evict it again, once
    window_log: object = None  # the session's signed hop records (server/window_log.py), when the client asked
    lent_bytes: int = 0  # of reserved_bytes, what its growth borrowed past its peer's share (server/cache_room.py)
    revoked: Exception | None = None  # its lent cache is taken back: it ends right after the step under way
    revoked_for: object = None  # the open or growth it was revoked for, which its cache goes to (SessionTable)
    revoked_s: float = 0.0  # when it was revoked (monotonic s)

    @property
    def key(self) -> SessionKey:
        return (self.client_peer, self.session_id)

    def limit_frames(self, channel, hidden_size: int) -> None:
        """Hold `channel` (its own stream, a lane or push stream into it) to frames this session can use: rows x its
        max_length tokens of `hidden_size` in float32, and a message (a smaller limit of the channel's stays)."""
        if self.max_frame_bytes is None and hidden_size > 0:
            self.max_frame_bytes = self.batch * self.max_length * hidden_size * 4 + MAX_METADATA_BYTES + 1024
        if self.max_frame_bytes is not None:
            channel.max_frame_bytes = min(channel.max_frame_bytes, self.max_frame_bytes)

    def idle_s(self, now: float) -> float:
        """Seconds since the session last advanced (opened, or a step that moved its position); 0 while such a step
        is computed. Duplicates, refused steps and requests queued or answered are no work: a peer that keeps its
        queue full of them is as idle as one that sends nothing."""
        if self.computing:
            return 0.0
        return now - self.last_active

    def apply_lane_settings(self, settings: LaneSettings | None) -> None:
        """Take the lane settings a client gave (at open or retarget): each named one replaces the current one; a new
        inbound key ends the lanes of the old upstream, a new outbound key or next address the downstream channel."""
        if settings is None:
            return
        given = settings.model_fields_set
        if "key_in" in given:
            self.lane_in = bytes.fromhex(settings.key_in) if settings.key_in is not None else None
            for channel in list(self.inbound):
                channel.close()
        if "key_out" in given:
            self.lane_out = bytes.fromhex(settings.key_out) if settings.key_out is not None else None
        if "next" in given:
            self.lane_next = settings.next
        if given & {"key_out", "next"}:
            self.end_downstream()

    def end_downstream(self) -> None:
        """Close the channel to the next node, if one is open (a later push opens a new one)."""
        if self.downstream is not None:
            self.downstream.close()
        if self.downstream_reader is not None:
            self.downstream_reader.cancel()
        self.downstream = self.downstream_reader = None

    def take_push_stream(self, channel: Channel) -> None:
        """`channel` carries the session's pushes from now on; the push stream that did before is closed."""
        if self.push_stream is not None and self.push_stream is not channel:
            self.push_stream.close()
        self.push_stream = channel

    def close_channels(self) -> None:
        """Close every channel but the client's stream: inbound lanes and push stream, the output lane, the
        downstream."""
        for channel in list(self.inbound):
            channel.close()
        self.inbound.clear()
        if self.push_stream is not None:
            self.push_stream.close()
            self.push_stream = None
        if self.output is not None:
            self.output.close()
            self.output = None
        self.end_downstream()

    def report(self, error: Exception) -> bool:
        """A failure this node met on the session's behalf (its next node refused or went away): answered to the
        client in order with the steps. At most MAX_QUEUED_REPORTS wait at once (the first already fails the hop
        for the client; a next node sending refusals without end cannot fill this node's memory with them): whether
        this one was queued."""
        if self.reports_queued >= MAX_QUEUED_REPORTS:
            return False
        self.reports_queued += 1
        self.inbox.put_nowait(Inbound(frame=None, error=error, from_peer=False))
        return True


__all__ = ["MAX_QUEUED_REPORTS", "Inbound", "ServerSession", "SessionKey"]

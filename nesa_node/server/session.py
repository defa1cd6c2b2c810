"""Server-side inference sessions: the KV cache of one client's generation on this node's span."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from nesa_node.protocol.wire import NO_CODEC, WireCodec

logger = logging.getLogger(__name__)

MAX_ID_LENGTH = 128  # characters of a session id (and of peer ids given as upstream)
END_OF_SESSION = object()  # put in the inbox when the client's stream ends; in a push outbox, ends the stream


@dataclass
class ServerSession:
    session_id: str
    batch: int  # rows, fixed for the session
    max_length: int  # tokens, reserved in the cache budget
    reserved_bytes: int
    cache: object  # transformers DynamicCache for this span
    blocks: tuple[int, int]  # (first, end): the part of the span this session runs
    client_peer: str  # base58 peer id that opened the session
    upstream_peer: str  # the only peer allowed to push steps (the previous node, or the client)
    next_peer: str | None  # direct chain: push results here; None: answer on the client's stream
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
    push_outbox: asyncio.Queue | None = None  # steps for next_peer, over one stream opened at the first push
    push_reader: asyncio.Task | None = None
    # free places for peers' messages in `inbox` (the node's own reports always fit): NodeConfig.max_queued_steps
    room: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(8))
    refused_in_a_row: int = 0  # consecutive refused steps; the session ends at NodeConfig.max_step_errors
    # data lanes (nesa_node.protocol.lane), when the client asked for them at open: the keys of the links into and out of
    # this node, the next node's lane address, and the connections in use
    lane_in: bytes | None = None  # steps from the upstream peer (the client, or the previous node)
    lane_out: bytes | None = None  # outputs to the next node, or to the client when this node is the last
    lane_next: str | None = None  # the next node's lane address; None: push over libp2p
    push_lane: object | None = None  # SealedStream to lane_next, opened at the first push
    output_lane: object | None = None  # SealedStream the client receives this (last) node's outputs on
    lane_streams: set = field(default_factory=set)  # inbound SealedStreams carrying steps into the session


def end_push_stream(session: ServerSession) -> None:
    """Close the session's push stream or lane to its next node, if one is open (a later push opens a new one)."""
    if session.push_outbox is not None:
        session.push_outbox.put_nowait(END_OF_SESSION)
    if session.push_lane is not None:
        session.push_lane.close()
    if session.push_reader is not None:
        session.push_reader.cancel()
    session.push_outbox = session.push_reader = session.push_lane = None

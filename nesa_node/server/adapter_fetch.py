"""LoRA adapters between nodes: a node asked for an adapter it lacks fetches its span's blocks from the peers that
announce the adapter (RPC ADAPTER, one stream per peer, all at once), and answers such requests from its peers.

Nothing a peer sends is trusted: the manifest must hash to the adapter id the session named, every block to the
manifest's hash for that block (sharding/lora_identity.py). A peer that answers with anything else (or not at all)
is skipped and the range asked of the next peer announcing it; a range no peer delivers ends the fetch with
AdapterMissingError, which the client routes around. Concurrent sessions naming the same missing adapter share one
fetch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nesa_node.errors import AdapterError, AdapterMissingError, NesaError
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.framing import StreamChannel, open_stream
from nesa_node.protocol.messages import (
    ADAPTER_ANSWERS,
    ADAPTER_REQUESTS,
    AdapterBlocks,
    AdapterRequest,
    ErrorReply,
    expect,
)
from nesa_node.protocol.records import NodeInfo
from nesa_node.protocol.tensors import bytes_from_proto, bytes_to_proto
from nesa_node.sharding.lora import AdapterManifest, AdapterSlice, merge_slices, slice_blobs, slice_from_blocks
from nesa_node.sharding.lora_identity import MAX_MANIFEST_BYTES

logger = logging.getLogger(__name__)

__all__ = ["AdapterFetcher", "answer_adapter_request", "cover"]


def cover(start: int, end: int, holders: list[NodeInfo]) -> list[tuple[int, int, list[NodeInfo]]]:
    """Blocks [start, end) cut into ranges, each with the holders whose spans contain it, fewest ranges first
    (greedy: from each range's start, the holder reaching furthest). Raises AdapterMissingError for a block no
    holder serves."""
    ranges, block = [], start
    while block < end:
        serving = [info for info in holders if info.start_block <= block < info.end_block]
        if not serving:
            raise AdapterMissingError(f"no peer announcing the adapter serves block {block}")
        stop = min(end, max(info.end_block for info in serving))
        ranges.append((block, stop, [info for info in serving if info.end_block >= stop]))
        block = stop
    return ranges


class AdapterFetcher:
    """Fetches an adapter's blocks from the peers announcing it. `records`: the model's NodeInfo records on the DHT
    (an awaitable call); the node's own P2P host, peer id, per-peer timeout and frame limit."""

    def __init__(
        self,
        p2p,
        peer_id: str,
        records: Callable[[], Awaitable[list[NodeInfo]]],
        *,
        timeout_s: float,
        max_frame_bytes: int,
    ):
        self.p2p = p2p
        self.peer_id = peer_id
        self.records = records
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._under_way: dict[tuple[str, int, int], asyncio.Future] = {}

    async def fetch(self, adapter_id: str, start: int, end: int) -> tuple[str, AdapterManifest, AdapterSlice]:
        """(name, manifest, slice of blocks [start, end)) of adapter `adapter_id`, checked by hash. Raises
        AdapterMissingError when the peers announcing it cannot deliver it."""
        key = (adapter_id, start, end)
        under_way = self._under_way.get(key)
        if under_way is not None:
            return await asyncio.shield(under_way)
        future = asyncio.get_running_loop().create_future()
        self._under_way[key] = future
        try:
            result = await self._fetch(adapter_id, start, end)
            future.set_result(result)
            return result
        except BaseException as exc:
            future.set_exception(exc if isinstance(exc, Exception) else AdapterMissingError("fetch cancelled"))
            future.exception()  # retrieved: no "never retrieved" warning when no session waits on it
            raise
        finally:
            del self._under_way[key]

    async def _fetch(self, adapter_id: str, start: int, end: int) -> tuple[str, AdapterManifest, AdapterSlice]:
        holders = [
            info
            for info in await self.records()
            if info.peer_id != self.peer_id and any(held.adapter_id == adapter_id for held in info.adapters)
        ]
        if not holders:
            raise AdapterMissingError(f"adapter {adapter_id}: no peer announces it")
        name = next(held.name for held in holders[0].adapters if held.adapter_id == adapter_id)
        ranges = cover(start, end, holders)
        pieces = await asyncio.gather(*(self._range(adapter_id, first, stop, peers) for first, stop, peers in ranges))
        manifest = pieces[0][0]
        return name, manifest, merge_slices(piece for _, piece in pieces)

    async def _range(
        self, adapter_id: str, start: int, end: int, peers: list[NodeInfo]
    ) -> tuple[AdapterManifest, AdapterSlice]:
        failures = []
        for info in peers:
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await self._ask(info.peer_id, adapter_id, start, end)
            except (NesaError, TimeoutError, OSError, ConnectionError) as exc:
                logger.info(
                    "adapter %s blocks %d:%d from %s failed: %r", adapter_id[:12], start, end, info.peer_id, exc
                )
                failures.append(f"{info.peer_id[-8:]}: {exc}")
        raise AdapterMissingError(
            f"adapter {adapter_id} blocks {start}:{end}: no peer delivered them ({'; '.join(failures)})"
        )

    async def _ask(self, peer_id: str, adapter_id: str, start: int, end: int) -> tuple[AdapterManifest, AdapterSlice]:
        channel = await open_stream(self.p2p, peer_id, rpc.ADAPTER, max_frame_bytes=self.max_frame_bytes)
        try:
            channel.send(frame(AdapterRequest(adapter_id=adapter_id, start_block=start, end_block=end)))
            answer = await channel.receive()
        finally:
            channel.close()
        if answer is None:
            raise AdapterMissingError(f"{peer_id} ended the stream without an answer")
        message = read(answer, ADAPTER_ANSWERS)
        if isinstance(message, ErrorReply):
            raise message.error()
        if (message.adapter_id, message.start_block, message.end_block) != (adapter_id, start, end):
            raise AdapterError("the peer answered with other blocks than those asked for")
        return await asyncio.to_thread(_check, message, answer, self.max_frame_bytes)


def _check(message: AdapterBlocks, answer, max_bytes: int) -> tuple[AdapterManifest, AdapterSlice]:
    count = message.end_block - message.start_block
    if len(answer.tensors) != count + 1:
        raise AdapterError(f"expected a manifest and {count} block(s), got {len(answer.tensors)} tensors")
    manifest = AdapterManifest.from_bytes(
        bytes_from_proto(answer.tensors[0], max_bytes=MAX_MANIFEST_BYTES), message.adapter_id
    )
    blobs = [bytes_from_proto(tensor, max_bytes=max_bytes) for tensor in answer.tensors[1:]]
    return manifest, slice_from_blocks(manifest, message.start_block, message.end_block, blobs)


async def answer_adapter_request(channel: StreamChannel, adapters) -> None:
    """One ADAPTER stream: a peer's AdapterRequest, answered from `adapters` (the node's NodeAdapters) with the
    blocks it announces, or a typed error."""
    async with asyncio.timeout(adapters.request_timeout_s):
        request = await channel.receive()
    if request is None:
        return
    try:
        message = expect(read(request, ADAPTER_REQUESTS), AdapterRequest)
        manifest, piece = adapters.shared(message.adapter_id, message.start_block, message.end_block)
        blobs = await asyncio.to_thread(slice_blobs, piece)
        channel.send(frame(message_of(message), [bytes_to_proto(manifest.to_bytes()), *map(bytes_to_proto, blobs)]))
    except NesaError as exc:
        channel.send(frame(ErrorReply.of(exc)))


def message_of(request: AdapterRequest) -> AdapterBlocks:
    return AdapterBlocks(adapter_id=request.adapter_id, start_block=request.start_block, end_block=request.end_block)

"""The client's view of the swarm: a P2P host and a client-mode DHT node on a background event loop.

The SDK is synchronous (Hugging Face style); every network call runs on this object's loop and is awaited
with a timeout through `call`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Coroutine
from typing import Any

import torch
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from nesa_node import event_loop
from nesa_node.errors import BadRequestError, NesaError, PeerUnavailableError
from nesa_node.peer import start_peer
from nesa_node.protocol import lane
from nesa_node.protocol.dht import NodeRecord, fetch_node_infos
from nesa_node.protocol.records import NodeInfo
from nesa_node.protocol.wire import (
    NO_CODEC,
    RPC_FORWARD,
    RPC_INFO,
    RPC_LANE_TICKET,
    RPC_PING,
    WireCodec,
    pack_metadata,
    raise_if_error,
    tensor_from_proto,
    tensor_to_proto,
    unpack_metadata,
)
from nesa_node.routing.chain import Hop, SwarmSnapshot
from nesa_node.swarm_view import build_snapshot

logger = logging.getLogger(__name__)

# A NodeInfo a node gave the client directly (probe_nodes) counts as its record for this long: about one announce
# period of a default node plus margin (guess); the DHT's own records take over when they arrive.
PROBED_RECORD_TTL_S = 15.0
# Nodes whose records expired less than this long ago are still asked directly when routing finds no chain (guess:
# a few announcement lifetimes; a node gone longer is unlikely to be back under the same id).
RECENT_RECORD_S = 120.0


class SwarmClient:
    """Owns the client's event loop thread, P2P host and DHT node. Close it (or use `with`) to stop them."""

    def __init__(
        self,
        initial_peers: list[str],
        *,
        dht_prefix: str,
        request_timeout_s: float = 30.0,
        records_wait_s: float = 0.5,  # guess: a healthy DHT read takes 20-40 ms on loopback, a few 100 ms on a WAN
    ):
        if not initial_peers:
            raise ValueError("initial_peers is empty: give the multiaddr of at least one swarm peer")
        self.dht_prefix = dht_prefix
        self.request_timeout_s = request_timeout_s
        self.loop = event_loop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="nesa-client-loop", daemon=True)
        self._thread.start()
        self.rtt_ms: dict[str, float] = {}  # peer id -> least round trip of the client's last pings, ms
        self._rtt_measured: dict[str, float] = {}  # peer id -> monotonic s of that measurement
        self._records: dict[str, NodeRecord] = {}  # peer id -> newest record seen (expired ones are skipped)
        self._refresh: asyncio.Future | None = None  # the DHT read in flight, on the client loop
        self.records_wait_s = records_wait_s
        self._bans: dict[str, tuple[float, float]] = {}  # peer -> (banned until, monotonic s; last ban length, s)
        # a FORWARD data lane per node, kept open between forward calls (nesa_node.protocol.lane), one call at a time
        self._forward_lanes: dict[str, lane.SealedStream] = {}
        self._forward_locks: dict[str, asyncio.Lock] = {}
        try:
            self.p2p, self.dht = self.call(self._start(list(initial_peers)), timeout=60)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    async def _start(self, initial_peers: list[str]) -> tuple[P2P, DHTNode]:
        self.peer = await start_peer(
            initial_peers=initial_peers, host=None, dht_prefixes=(self.dht_prefix,), client_mode=True
        )
        return self.peer.p2p, self.peer.dht

    def call(self, coroutine: Coroutine, timeout: float | None = None) -> Any:
        """Run `coroutine` on the client loop and wait for it (from any thread but the loop's)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise PeerUnavailableError(f"no answer within {timeout} s") from None

    def ban(self, peer_id: str, *, base_s: float = 15.0, max_s: float = 600.0) -> float:
        """Keep `peer_id` out of new chains for a while: base_s, doubling on each repeat ban up to max_s.

        15 s covers a restart of a node that crashed (guess); a peer that keeps failing stays out for minutes.
        Returns the ban length in seconds."""
        now = time.monotonic()
        until, last = self._bans.get(peer_id, (0.0, 0.0))
        length = min(max_s, last * 2) if until > now - max_s and last else base_s
        self._bans[peer_id] = (now + length, length)
        return length

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(peer for peer, (until, _) in self._bans.items() if until > now)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    # ---- swarm state --------------------------------------------------------------------------------------

    def node_records(self, fresh: bool = False) -> list[NodeRecord]:
        """The nodes' records: a fresh DHT read merged with earlier reads whose records have not expired yet.

        A DHT lookup can miss replicas now and then; a record stays valid until its own expiration, so a
        momentarily empty answer does not make live nodes vanish from routing. While unexpired records are at
        hand, a read slower than `records_wait_s` (a DHT peer that stopped answering costs hivemind 3 s) is not
        waited for: routing uses the records at hand and the read lands in them when it completes.
        `fresh=True` waits for the read in any case (routing found no chain in the records at hand)."""
        return self.call(self._node_records(fresh), timeout=self.request_timeout_s + 5)

    async def _node_records(self, fresh: bool) -> list[NodeRecord]:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._refresh_records())
        held = self._unexpired()
        try:
            if held and not fresh:
                await asyncio.wait_for(asyncio.shield(self._refresh), timeout=self.records_wait_s)
            else:
                await asyncio.wait_for(asyncio.shield(self._refresh), timeout=self.request_timeout_s)
        except TimeoutError:
            if not held:
                raise PeerUnavailableError(f"no answer from the DHT within {self.request_timeout_s} s") from None
        except Exception as exc:
            if not held:
                raise
            logger.debug("DHT read failed, routing with the records at hand: %r", exc)
        return list(self._unexpired().values())

    async def _refresh_records(self) -> None:
        self._hold(await fetch_node_infos(self.dht, self.dht_prefix))

    def _unexpired(self) -> dict[str, NodeRecord]:
        now = get_dht_time()
        return {peer: record for peer, record in self._records.items() if record.expiration_time > now}

    def _hold(self, records: list[NodeRecord]) -> None:
        """Merge `records` into the records at hand: per node, the one that expires last."""
        held = dict(self._records)
        for record in records:
            known = held.get(record.info.peer_id)
            if known is None or record.expiration_time >= known.expiration_time:
                held[record.info.peer_id] = record
        self._records = held  # replaced whole: other threads may be reading the previous dict

    def recent_nodes(self, start_block: int, end_block: int, *, within_s: float = RECENT_RECORD_S) -> list[str]:
        """Peer ids of the nodes whose records, seen by this client, overlap blocks [start_block, end_block) and
        expired less than `within_s` ago or not yet: the candidates to ask directly (see probe_nodes)."""
        horizon = get_dht_time() - within_s
        return sorted(
            peer
            for peer, record in self._records.items()
            if record.expiration_time > horizon
            and record.info.start_block < end_block
            and record.info.end_block > start_block
        )

    def probe_nodes(self, peer_ids: list[str], *, timeout_s: float = 1.0) -> int:
        """Ask nodes for their NodeInfo directly (rpc_info over libp2p, whose connection authenticates the peer id)
        and hold each answer as a record for PROBED_RECORD_TTL_S; returns how many answered.

        Routing's fallback when the DHT replicas it reads lack a live node's record: a node whose announcements did
        not reach them, or a read slowed by a replica that stopped answering. All peers are asked at once; a dead
        one costs at most `timeout_s`."""
        if not peer_ids:
            return 0
        return self.call(self._probe_nodes(list(peer_ids), timeout_s), timeout=timeout_s + 5)

    async def _probe_nodes(self, peer_ids: list[str], timeout_s: float) -> int:
        async def ask(peer_id: str) -> NodeRecord | None:
            try:
                info = await self._info(peer_id, timeout_s)
            except Exception as exc:  # gone, slow or malformed: not a candidate
                logger.debug("no NodeInfo from %s: %r", peer_id, exc)
                return None
            if info.peer_id != peer_id:
                logger.debug("node %s answered with the NodeInfo of %s", peer_id, info.peer_id)
                return None
            return NodeRecord(info=info, expiration_time=get_dht_time() + PROBED_RECORD_TTL_S)

        answers = [record for record in await asyncio.gather(*(ask(peer) for peer in peer_ids)) if record is not None]
        self._hold(answers)
        return len(answers)

    def lane_address(self, peer_id: str) -> str | None:
        """The data lane address a node's record announces (nesa_node.protocol.lane), if any and well formed."""
        record = self._records.get(peer_id)
        address = record.info.lane if record is not None else None
        if address is None:
            return None
        try:
            lane.parse_address(address)
        except BadRequestError:
            logger.debug("ignoring the malformed lane address of %s", peer_id)
            return None
        return address

    def snapshot(self, num_blocks: int, *, fresh: bool = False, hidden_size: int = 0) -> SwarmSnapshot:
        """Freeze the current records, with the client's measured rtts, for routing (nesa_node/swarm_view.py); `fresh`: see
        node_records."""
        infos = [record.info for record in self.node_records(fresh)]
        return build_snapshot(infos, num_blocks, client_rtt_ms=dict(self.rtt_ms), hidden_size=hidden_size)

    def measure_rtts(self, peer_ids: list[str], *, max_age_s: float = 60.0, timeout_s: float = 2.0) -> None:
        """Ping the peers whose round trip is unknown or older than `max_age_s` (all at once; the least of two
        pings, so a first connection's setup does not count). A peer that does not answer within `timeout_s`
        keeps no measurement; routing then relies on the links other nodes publish."""
        now = time.monotonic()
        stale = [peer for peer in peer_ids if now - self._rtt_measured.get(peer, -math.inf) > max_age_s]
        if stale:
            self.call(self._measure_rtts(stale, timeout_s), timeout=2 * timeout_s + 5)

    async def _measure_rtts(self, peer_ids: list[str], timeout_s: float) -> None:
        async def least_of_two(peer_id: str) -> None:
            try:
                rtts = [await self._ping(peer_id, timeout_s) for _ in range(2)]
            except Exception as exc:  # gone or slow: normal
                logger.debug("no rtt to %s: %r", peer_id, exc)
                self.rtt_ms.pop(peer_id, None)
                return
            self.rtt_ms[peer_id] = min(rtts)
            self._rtt_measured[peer_id] = time.monotonic()

        await asyncio.gather(*(least_of_two(peer_id) for peer_id in peer_ids))

    async def _ping(self, peer_id: str, timeout_s: float) -> float:
        """Round trip in ms: over the node's data lane when it has one (a TCP socket the client closes at once,
        nothing left behind when the node is gone), else rpc_ping over libp2p."""
        address = self.lane_address(peer_id)
        if address is not None:
            async with asyncio.timeout(timeout_s):
                return await lane.ping(address) * 1000
        started = time.perf_counter()
        await asyncio.wait_for(
            self.p2p.call_protobuf_handler(
                PeerID.from_base58(peer_id), RPC_PING, runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
            ),
            timeout=timeout_s,
        )
        return (time.perf_counter() - started) * 1000

    # ---- RPCs ---------------------------------------------------------------------------------------------

    async def _unary(
        self, peer_id: str, name: str, request: runtime_pb2.ExpertRequest, timeout_s: float | None = None
    ) -> runtime_pb2.ExpertResponse:
        try:
            response = await asyncio.wait_for(
                self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), name, request, runtime_pb2.ExpertResponse),
                timeout=timeout_s or self.request_timeout_s,
            )
        except Exception as exc:
            logger.debug("%s to %s failed: %r", name, peer_id, exc)
            raise PeerUnavailableError(f"peer {peer_id} did not answer {name}: {exc!r}") from None
        return response

    def info(self, peer_id: str, *, timeout_s: float | None = None) -> NodeInfo:
        """The live NodeInfo of a peer, asked directly (not from the DHT); PeerUnavailableError after timeout_s."""
        return self.call(self._info(peer_id, timeout_s))

    async def _info(self, peer_id: str, timeout_s: float | None) -> NodeInfo:
        response = await self._unary(peer_id, RPC_INFO, runtime_pb2.ExpertRequest(), timeout_s)
        metadata = unpack_metadata(response.metadata)
        raise_if_error(metadata)
        return NodeInfo.from_wire(metadata.get("info"))

    async def forward_async(
        self, hop: Hop, hidden: torch.Tensor, codec: WireCodec = NO_CODEC, output_codec: WireCodec = NO_CODEC
    ) -> tuple[torch.Tensor, float]:
        """Run a node's span on `hidden` (batch, seq, hidden) without a cache; returns (output, compute seconds)."""
        peer_id = hop.peer_id
        metadata = {
            "blocks": list(range(hop.start_block, hop.end_block)),
            "codec": codec.to_metadata(),
            "output_codec": output_codec.to_metadata(),
        }
        request = runtime_pb2.ExpertRequest(tensors=[tensor_to_proto(hidden, codec)], metadata=pack_metadata(metadata))
        lock = self._forward_locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            stream = await self._forward_lane(peer_id)
            if stream is not None:
                response = await self._forward_on_lane(peer_id, stream, request)
            else:
                response = await self._unary(peer_id, RPC_FORWARD, request)
        metadata = unpack_metadata(response.metadata)
        raise_if_error(metadata)
        if len(response.tensors) != 1:
            raise PeerUnavailableError(f"peer {peer_id} sent a malformed answer to {RPC_FORWARD}")
        output = tensor_from_proto(
            response.tensors[0],
            allowed_dtypes=("float32", "float16", "bfloat16"),
            max_elements=hidden.numel(),
            rank=3,
            codec=WireCodec.from_metadata(metadata.get("codec")),
        )
        return output, float(metadata.get("compute_s", 0.0))

    async def _forward_lane(self, peer_id: str) -> lane.SealedStream | None:
        """The open FORWARD lane to a node, opened now if needed (a ticket over libp2p, then the lane); None when
        the node has no lane or it cannot be opened: the call then goes over libp2p."""
        held = self._forward_lanes.get(peer_id)
        if held is not None and not held.closed:
            return held
        address = self.lane_address(peer_id)
        if address is None:
            return None
        try:
            response = await self._unary(peer_id, RPC_LANE_TICKET, runtime_pb2.ExpertRequest())
            metadata = unpack_metadata(response.metadata)
            raise_if_error(metadata)
            ticket, key = metadata.get("ticket"), lane.parse_key(metadata.get("key"), "key")
            if not isinstance(ticket, str):
                raise BadRequestError("lane ticket without an id")
            async with asyncio.timeout(self.request_timeout_s):
                stream = await lane.connect(address, lane.ROLE_FORWARD, ticket, key)
        except (NesaError, TimeoutError, ValueError) as exc:
            logger.debug("no forward lane to %s, using libp2p: %r", peer_id, exc)
            return None
        self._forward_lanes[peer_id] = stream
        return stream

    async def _forward_on_lane(
        self, peer_id: str, stream: lane.SealedStream, request: runtime_pb2.ExpertRequest
    ) -> runtime_pb2.ExpertResponse:
        try:
            stream.send(request.SerializeToString())
            async with asyncio.timeout(self.request_timeout_s):
                payload = await stream.receive()
            if payload is None:
                raise lane.LaneClosedError("the node closed the lane")
            response = runtime_pb2.ExpertResponse()
            response.ParseFromString(payload)
            return response
        except Exception as exc:  # the lane is unusable after any failure mid-call
            stream.close()
            self._forward_lanes.pop(peer_id, None)
            raise PeerUnavailableError(f"peer {peer_id} did not answer a forward on its data lane: {exc!r}") from None

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def stop() -> None:
            for stream in self._forward_lanes.values():
                stream.close()
            await self.peer.shutdown(10.0)
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:  # hivemind's background refreshers
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            self.call(stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["SwarmClient"]

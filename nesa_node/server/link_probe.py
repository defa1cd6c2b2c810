"""Link measurement: RTT and bandwidth from this node to a bounded sample of peers, published in its record.

The sample always holds the node's neighbours in the block order (nodes whose span ends where this node's
starts, or starts where it ends: the links a chain through this node would use), then other peers at random,
up to `max_peers`. RTT is the least of `pings` empty `rpc_ping` round trips; bandwidth comes from one ping that
carries `payload_bytes`: payload bits / (its round trip - the RTT), that difference taken as at least a tenth of
the loaded round trip where it is lost in noise (protocol/records.py `bandwidth_from_pings`: a bound from below).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from hivemind.p2p import P2P, PeerID
from hivemind.proto.runtime_pb2 import Tensor

from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.records import LinkInfo, NodeInfo, bandwidth_from_pings

logger = logging.getLogger(__name__)


class LinkProber:
    def __init__(
        self,
        p2p: P2P,
        *,
        max_peers: int = 8,  # guess: a chain uses 2 links per node; a few more give routing alternatives
        pings: int = 3,
        payload_bytes: int = 256 * 1024,  # long enough to dominate a loopback RTT, short for a slow uplink
        timeout_s: float = 5.0,
        seed: int | None = None,
    ):
        self.p2p = p2p
        self.max_peers = max_peers
        self.pings = pings
        self.payload_bytes = payload_bytes
        self.timeout_s = timeout_s
        self.rng = random.Random(seed)
        self.links: dict[str, LinkInfo] = {}  # peer id -> newest measurement

    def sample(self, me: NodeInfo, others: list[NodeInfo]) -> list[str]:
        """Peers to measure: neighbours in the block order first, then a random few."""
        others = [info for info in others if info.peer_id != me.peer_id]
        neighbours = [
            info.peer_id for info in others if me.start_block == info.end_block or me.end_block == info.start_block
        ]
        rest = sorted({info.peer_id for info in others} - set(neighbours))
        self.rng.shuffle(rest)
        return (sorted(set(neighbours)) + rest)[: self.max_peers]

    async def ping(self, peer_id: str, payload: bytes = b"") -> float:
        """Seconds for one rpc_ping round trip carrying `payload`."""
        request = Frame(tensors=[Tensor(buffer=payload)] if payload else [])
        started = time.perf_counter()
        await asyncio.wait_for(
            self.p2p.call_protobuf_handler(PeerID.from_base58(peer_id), rpc.PING, request, Frame),
            timeout=self.timeout_s,
        )
        return time.perf_counter() - started

    async def measure(self, peer_id: str) -> LinkInfo:
        rtt_s = min([await self.ping(peer_id) for _ in range(self.pings)])
        loaded_s = await self.ping(peer_id, bytes(self.payload_bytes))
        bandwidth = bandwidth_from_pings(self.payload_bytes, rtt_s, loaded_s)
        return LinkInfo(peer_id=peer_id, rtt_ms=rtt_s * 1000, bandwidth_mbps=bandwidth)

    async def probe(self, me: NodeInfo, others: list[NodeInfo]) -> list[LinkInfo]:
        """Measure the sample; peers that do not answer are dropped from the published links."""
        sample = self.sample(me, others)
        for peer_id in sample:
            try:
                self.links[peer_id] = await self.measure(peer_id)
            except Exception as exc:  # a peer that is gone or slow: normal
                logger.debug("link to %s not measured: %r", peer_id, exc)
                self.links.pop(peer_id, None)
        self.links = {peer: link for peer, link in self.links.items() if peer in sample}
        return list(self.links.values())

"""The client's round trips to nodes (client/swarm.py Swarm is a RoundTripMeter): pings over the nodes' data lanes or
libp2p, kept as the least of recent ones (client/timings.py RoundTrips), for routing's latency, for telling a gone node
from a slow one, and for what a step's wall time is charged before the rest counts as compute (`step_rtt_ms`).

A lane is pinged only once it proved to be the peer's (protocol/lane.py `prove`: the node signs fresh salts with its
identity key, whose peer id must be the one pinged), once per peer and address: a record may name any address, such
as a nearer host's lane, to look close. A lane that does not prove so is left for LANE_PROOF_RETRY_S and the peer is
pinged over libp2p, which authenticates it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from nesa_node.client.timings import RoundTrips
from nesa_node.errors import NesaError
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import Frame
from nesa_node.verification.receipts import signer_of

logger = logging.getLogger(__name__)

RTT_RECHECK_S = 10.0  # a round trip a step showed too long is pinged again at most this often (guess)
LANE_PROOF_RETRY_S = 60.0  # a lane that did not prove to be its peer's is asked again after this (guess)
MAX_LANE_PROOFS = 4096  # (peer, address) outcomes kept; past it they are forgotten and asked again


class RoundTripMeter:
    """Round trips by peer id (see the module docstring). Needs the swarm's `lane_address`, `unary` and `_background`
    (the tasks it holds until done)."""

    def __init__(self) -> None:
        self.rtt_ms = RoundTrips()  # peer id -> least round trip of the client's recent pings, ms
        self.wire_rtt_ms = RoundTrips()  # the same, of the TCP set-ups of its lane pings: the network alone, ms
        self._rtt_measured: dict[str, float] = {}  # peer id -> monotonic s of that measurement
        self._rtt_rechecked: dict[str, float] = {}  # peer id -> monotonic s a step last had its round trip pinged again
        self._lane_proofs: dict[tuple[str, str], tuple[bool, float]] = {}  # (peer, address) -> (proved, monotonic s)

    async def measure_rtts(self, peer_ids: list[str], *, max_age_s: float = 60.0, timeout_s: float = 2.0) -> None:
        """Ping the peers whose round trip is unknown or older than `max_age_s` (all at once; the least of two
        pings, so a first connection's setup does not count). A peer that does not answer within `timeout_s`
        keeps no measurement; routing then relies on the links other nodes publish."""
        now = time.monotonic()
        stale = [peer for peer in peer_ids if now - self._rtt_measured.get(peer, -math.inf) > max_age_s]

        async def least_of_two(peer_id: str) -> None:
            try:
                rtts = [await self._ping(peer_id, timeout_s) for _ in range(2)]
            except Exception as exc:  # gone or slow: normal
                logger.debug("no rtt to %s: %r", peer_id, exc)
                self.rtt_ms.forget(peer_id)
                self.wire_rtt_ms.forget(peer_id)
                return
            self.rtt_ms.add(peer_id, min(rtts), time.monotonic())
            self._rtt_measured[peer_id] = time.monotonic()

        await asyncio.gather(*(least_of_two(peer_id) for peer_id in stale))

    def step_rtt_ms(self, peer_id: str) -> float:
        """The round trip to `peer_id` that a step's wall time is charged with before the rest counts as the chain's
        compute (client/timings.py), ms: the least TCP set-up time of the client's lane pings to it, which the node's
        kernel answers before the node's program sees the connection; a node that delays its answers to pings would
        otherwise look that much faster at compute (RELIABILITY.md G4). A node without a lane: its libp2p ping,
        which it answers itself (what a session charges it is bounded below: InferenceSession._measure_nodes); 0 when
        the client has no round trip to it."""
        if peer_id in self.wire_rtt_ms:
            return self.wire_rtt_ms[peer_id]
        return self.rtt_ms.get(peer_id, 0.0)

    def recheck_rtts_soon(self, peer_ids: list[str]) -> None:
        """Ping `peer_ids` again in the background (each at most once per RTT_RECHECK_S): a session found a step
        faster than the round trips it knows, so one was taken at a busy moment (RoundTrips keeps the least)."""
        now = time.monotonic()
        stale = [
            peer for peer in dict.fromkeys(peer_ids) if now - self._rtt_rechecked.get(peer, -math.inf) > RTT_RECHECK_S
        ]
        if stale:
            self._rtt_rechecked.update(dict.fromkeys(stale, now))
            task = asyncio.ensure_future(self.measure_rtts(stale, max_age_s=0.0))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def unreachable(self, peer_ids: list[str], *, timeout_s: float = 2.0, fresh_s: float = 5.0) -> list[str]:
        """Those of `peer_ids` that do not answer a ping within `timeout_s` (all pinged at once; a peer that answered
        one in the last `fresh_s` counts as reachable). A node whose process is gone refuses its lane's TCP port at
        once, where opening a libp2p stream to it waits out p2pd's dial timeout (20 s measured on loopback)."""
        now = time.monotonic()

        async def answers(peer_id: str) -> bool:
            if now - self._rtt_measured.get(peer_id, -math.inf) <= fresh_s:
                return True
            try:
                self.rtt_ms.add(peer_id, await self._ping(peer_id, timeout_s), time.monotonic())
            except Exception as exc:  # gone, stopped or slow
                logger.debug("%s did not answer a ping: %r", peer_id, exc)
                return False
            self._rtt_measured[peer_id] = time.monotonic()
            return True

        answered = await asyncio.gather(*(answers(peer_id) for peer_id in peer_ids))
        return [peer_id for peer_id, ok in zip(peer_ids, answered, strict=True) if not ok]

    async def proved_lane(self, peer_id: str, timeout_s: float) -> str | None:
        """The lane address `peer_id`'s record names, once the lane proved to be that peer's (module docstring);
        None without a lane, or for one that did not prove so (asked again after LANE_PROOF_RETRY_S)."""
        address = self.lane_address(peer_id)
        if address is None:
            return None
        now = time.monotonic()
        known = self._lane_proofs.get((peer_id, address))
        if known is not None and (known[0] or now - known[1] < LANE_PROOF_RETRY_S):
            return address if known[0] else None
        try:
            async with asyncio.timeout(timeout_s):
                proof = await lane.prove(address)
            signer = signer_of(proof.signed_bytes, proof.signature, proof.public_key)
            proved = signer == peer_id
            if not proved:
                logger.warning("the lane %s that %s announces is %s's: pinged over libp2p", address, peer_id, signer)
        except (NesaError, TimeoutError, OSError) as exc:
            logger.debug("the lane %s of %s proved nothing: %r", address, peer_id, exc)
            proved = False
        if len(self._lane_proofs) >= MAX_LANE_PROOFS:
            self._lane_proofs.clear()
        self._lane_proofs[(peer_id, address)] = (proved, now)
        return address if proved else None

    async def _ping(self, peer_id: str, timeout_s: float) -> float:
        """Round trip in ms: over the node's data lane when it has one (a TCP socket the client closes at once,
        nothing left behind when the node is gone; its set-up time goes to `wire_rtt_ms`), else a ping over libp2p."""
        address = await self.proved_lane(peer_id, timeout_s)
        if address is not None:
            async with asyncio.timeout(timeout_s):
                times = await lane.probe(address)
            self.wire_rtt_ms.add(peer_id, times.connect_s * 1000, time.monotonic())
            return times.answer_s * 1000
        started = time.perf_counter()
        await self.unary(peer_id, rpc.PING, Frame(), timeout_s)
        return (time.perf_counter() - started) * 1000

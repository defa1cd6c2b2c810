"""The client's own measurement of each node's speed, from the steps of its sessions (RELIABILITY.md G4): routing
trusts these over what nodes claim (routing/claims.py).

A direct chain returns one answer per step, so the client sees the whole chain's time, not each node's. Each node's
share is estimated by subtraction: a hop's time is the step's compute time (the wall time less the client's round
trips to the chain's ends) minus what the client currently believes of the other hops (its measurement when it has
one, else the bounded claim routing used), split by blocks among the hops it knows nothing of. A chain of one node
is measured exactly; a longer chain converges as its nodes are measured on other chains too. Per node, the median of
its last WINDOW steps in ms per block per token: a step held up by a busy host (a scheduling stall, a collection)
moves it by one rank, not by a share of the stall, while a lasting change of load shows within WINDOW / 2 steps.

The round trips subtracted are `RoundTrips`: per node the least of the pings of the last RTT_WINDOW_S. A ping is
only ever delayed, never sped up, so the least is the link's own time; one taken at a busy moment would otherwise
be subtracted from every step, making the node look faster than it is by the delay. For the same reason the pings'
TCP set-up times are subtracted where the node has a data lane (Swarm.step_rtt_ms), not their answers: the node's
kernel answers a set-up, while a node that delays its answers to pings on purpose would look faster by that much.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterator, Mapping, Sequence

from nesa_node.routing.claims import Measured

WINDOW = 9  # steps a node's estimate is the median of (guess: a change of load shows within 5 steps)
FLOOR_SHARE = 0.05  # a hop is charged at least this share of the step: an estimate never goes to 0
RTT_WINDOW_S = 300.0  # pings the least round trip is taken over (guess: routes on a LAN/WAN change over minutes)


class NodeTimings:
    """Per-node measured compute time (see the module docstring)."""

    def __init__(self) -> None:
        self._recent: dict[str, deque[float]] = {}
        self._block_ms: dict[str, float] = {}
        self._samples: dict[str, int] = {}

    def measured(self) -> dict[str, Measured]:
        return {peer: Measured(ms, self._samples[peer]) for peer, ms in self._block_ms.items()}

    def observe(
        self, hops: Sequence[tuple[str, int]], compute_ms: float, tokens: int, believed: Mapping[str, float]
    ) -> None:
        """One step of `tokens` tokens per row through `hops` ((peer id, blocks) in chain order) that took
        `compute_ms` of compute; `believed`: ms per block per token routing assumed for each peer."""
        if tokens <= 0 or compute_ms <= 0 or not hops:
            return
        per_token = compute_ms / tokens
        known = {peer: self._estimate(peer, believed) for peer, _ in hops}
        for index, (peer, blocks) in enumerate(hops):
            if blocks <= 0:
                continue
            others = [(other, other_blocks) for position, (other, other_blocks) in enumerate(hops) if position != index]
            charged = sum(known[other] * other_blocks for other, other_blocks in others if known[other] is not None)
            unknown_blocks = sum(other_blocks for other, other_blocks in others if known[other] is None)
            share = max(per_token - charged, FLOOR_SHARE * per_token) * blocks / (blocks + unknown_blocks)
            self._update(peer, share / blocks)

    def _estimate(self, peer: str, believed: Mapping[str, float]) -> float | None:
        if peer in self._block_ms:
            return self._block_ms[peer]
        value = believed.get(peer)
        return value if value else None

    def _update(self, peer: str, block_ms: float) -> None:
        recent = self._recent.setdefault(peer, deque(maxlen=WINDOW))
        recent.append(block_ms)
        self._block_ms[peer] = statistics.median(recent)
        self._samples[peer] = self._samples.get(peer, 0) + 1


class RoundTrips(Mapping[str, float]):
    """The client's round trip to each node, ms: the least ping of the last RTT_WINDOW_S (module docstring). Read
    as a mapping; `add` a ping, `forget` a node that stopped answering."""

    def __init__(self, window_s: float = RTT_WINDOW_S) -> None:
        self.window_s = window_s
        self._pings: dict[str, deque[tuple[float, float]]] = {}  # peer id -> (monotonic s, ms), oldest first

    def add(self, peer_id: str, rtt_ms: float, now: float) -> None:
        pings = self._pings.setdefault(peer_id, deque())
        pings.append((now, rtt_ms))
        while pings and now - pings[0][0] > self.window_s:
            pings.popleft()

    def forget(self, peer_id: str) -> None:
        self._pings.pop(peer_id, None)

    def __getitem__(self, peer_id: str) -> float:
        return min(ms for _, ms in self._pings[peer_id])

    def __iter__(self) -> Iterator[str]:
        return iter(self._pings)

    def __len__(self) -> int:
        return len(self._pings)


__all__ = ["RoundTrips", "NodeTimings"]

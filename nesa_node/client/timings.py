"""The client's own measurement of each node's speed, from the steps of its sessions (RELIABILITY.md G4): routing
trusts these over what nodes claim (routing/claims.py).

A direct chain returns one answer per step, so the client sees the whole chain's time, not each node's. Each node's
share is estimated by subtraction: a hop's time is the step's compute time (the wall time less the client's round
trips to the chain's ends) minus what the client currently believes of the other hops (its measurement when it has
one, else the bounded claim routing used), split by blocks among the hops it knows nothing of. A chain of one node
is measured exactly; a longer chain converges as its nodes are measured on other chains too. Per node, an
exponential average over steps in ms per block per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nesa_node.routing.claims import Measured

EMA_WEIGHT = 0.3  # weight of a new step (guess: a few steps follow a change of load)
FLOOR_SHARE = 0.05  # a hop is charged at least this share of the step: an estimate never goes to 0


class NodeTimings:
    """Per-node measured compute time (see the module docstring)."""

    def __init__(self) -> None:
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
        previous = self._block_ms.get(peer)
        self._block_ms[peer] = block_ms if previous is None else (1 - EMA_WEIGHT) * previous + EMA_WEIGHT * block_ms
        self._samples[peer] = self._samples.get(peer, 0) + 1


__all__ = ["NodeTimings"]

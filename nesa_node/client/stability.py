"""Stability-informed reliability in the live client (Nesa sec. 3.1): nodes in long-lived H0 components of the swarm
graph are more reliable, and eq. 18's reliability term says so.

The client builds its routing snapshots from the nodes' records (their measured links included). Every `period_s`
at most, `StabilityTracker.observe` turns the current snapshot into the swarm graph (topology/graph.py) and keeps
each node's `node_stability` in a bounded history; `apply` raises each node's R_A toward 1 by its stability over
that history (`temporal_stability`, `stable_reliability`: R' = R + weight * s * (1 - R)). A node whose links flap
spends part of the history in short-lived components (or alone), so it gains less than a node as fast that stays
in its cluster, and among otherwise equal nodes routing prefers the stable one. With fewer than `min_history`
snapshots nothing changes: one snapshot cannot tell a flapping node from a stable one.
"""

from __future__ import annotations

import logging
from collections import deque

from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.monitor import STABILITY_WEIGHT, node_stability, stable_reliability, temporal_stability

logger = logging.getLogger(__name__)

HISTORY = 30  # snapshots kept: five minutes at the default period
MIN_HISTORY = 3


class StabilityTracker:
    """Per-node stability over the client's recent snapshots (see the module docstring)."""

    def __init__(
        self,
        *,
        weight: float = STABILITY_WEIGHT,
        period_s: float = 10.0,
        history: int = HISTORY,
        min_history: int = MIN_HISTORY,
    ):
        if not 0.0 <= weight <= 1.0 or not period_s > 0 or history < 1 or min_history < 1:
            raise ValueError("need 0 <= weight <= 1, period_s > 0, history >= 1 and min_history >= 1")
        self.weight = weight
        self.period_s = period_s
        self.min_history = min_history
        self.history: deque[dict[str, float]] = deque(maxlen=history)
        self._last_s: float | None = None

    def observe(self, snapshot: SwarmSnapshot, now_s: float) -> None:
        """Keep the nodes' stability in `snapshot` when `period_s` has passed since the last one kept."""
        if self.weight == 0 or (self._last_s is not None and now_s - self._last_s < self.period_s):
            return
        self._last_s = now_s
        try:
            self.history.append(node_stability(swarm_graph(snapshot)))
        except ValueError as error:  # a snapshot the graph cannot be built from (no node available)
            logger.debug("no stability from this snapshot: %s", error)

    def stability(self) -> dict[str, float]:
        """Each node's stability over the history; empty until `min_history` snapshots were kept."""
        if len(self.history) < self.min_history:
            return {}
        return temporal_stability(list(self.history))

    def apply(self, snapshot: SwarmSnapshot) -> SwarmSnapshot:
        """`snapshot` with R_A raised by each node's stability (unchanged without enough history)."""
        stability = self.stability()
        if not stability or self.weight == 0:
            return snapshot
        return stable_reliability(snapshot, stability, weight=self.weight)


__all__ = ["HISTORY", "MIN_HISTORY", "StabilityTracker"]

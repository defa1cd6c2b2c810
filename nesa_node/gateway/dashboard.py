"""The topology dashboard's data: what the gateway's own swarm client sees, as one JSON document the page at `/`
polls every second.

- nodes: every unexpired record (a killed node drops out when its record expires), with its state, blocks, KV cache
  left, codecs and quantization, and its speed as the client measured it (ms per block per token, from its own
  sessions' steps; the claim, bounded by the other nodes' claims, until then: routing/claims.py);
- coverage: per block, the online nodes serving it, and the gaps;
- chains: the nodes of each session open now;
- topology: the swarm graph (topology/graph.py, positions projected to 2-D) and its H0/H1 persistence diagrams
  (topology/homology.py, gudhi), recomputed at most every `topology_period_s`;
- change: change detection over those snapshots, as the nodes' homology rebalance trigger does it
  (topology/monitor.py): the first CALIBRATION_SNAPSHOTS snapshots set the threshold (repeated measurements of a
  swarm taken as unchanged; at least MIN_THRESHOLD), then each snapshot is scored against the reference (> 1: a change, which becomes the
  new reference); the recent scores are drawn over time;
- events: nodes joining, leaving, moving to other blocks (a rebalancing move) or changing state, and topology
  changes, as this gateway saw them, newest first.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import replace

import numpy as np

from nesa_node.protocol.records import NodeState
from nesa_node.topology.monitor import MonitorState, learn_threshold, observe, start_monitor

DOCUMENT_MAX_AGE_S = 1.0  # the swarm as the page shows it: read again once this old (the page polls every second)
TOPOLOGY_PERIOD_S = 5.0  # persistent homology of a few hundred nodes takes tens of ms; the page polls every second
CALIBRATION_SNAPSHOTS = 5  # as the nodes' homology trigger (server/rebalance.py): 10 pairs behind the threshold
MAX_EVENTS = 50
MAX_SCORES = 120  # change scores kept for the chart: ten minutes at the default period
# least threshold of each change statistic (ms for the bottleneck distances): a swarm measured with no noise at all
# (every node on one host) would otherwise call any difference, however small, a change of unbounded score (guess:
# below what pings resolve)
MIN_THRESHOLD = 0.05


class DashboardState:
    """Builds the dashboard document of one AsyncDistributedModel's swarm (see the module docstring)."""

    def __init__(self, model, *, model_name: str, topology_period_s: float = TOPOLOGY_PERIOD_S):
        self.model = model
        self.model_name = model_name
        self.topology_period_s = topology_period_s
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._seen: dict[str, tuple] = {}  # peer id -> (state, start, end) at the last poll
        self._topology: dict | None = None
        self._topology_at = -math.inf
        self._calibration: list = []  # diagrams of the first snapshots, until the threshold is learned
        self._monitor: MonitorState | None = None
        self._scores: deque[list[float]] = deque(maxlen=MAX_SCORES)  # [time, score] per snapshot once watching

    async def document(self) -> dict:
        swarm = self.model.swarm
        num_blocks = self.model.model_config.num_hidden_layers
        # live: a read at most every DOCUMENT_MAX_AGE_S, whoever polls how often (each costs a signature check a
        # record on the event loop), waited for up to 0.5 s
        records = await swarm.node_records(max_age_s=DOCUMENT_MAX_AGE_S)
        infos = sorted((record.info for record in records), key=lambda info: (info.start_block, info.peer_id))
        infos = [info for info in infos if info.end_block <= num_blocks]
        self._note_changes(infos)
        snapshot = swarm.snapshot_of(infos, num_blocks, hidden_size=self.model.model_config.hidden_size)
        measured = swarm.timings.measured()
        views = {node.peer_id: node for node in snapshot.nodes}
        nodes = []
        for info in infos:
            view = views.get(info.peer_id)
            blocks = info.end_block - info.start_block
            costed_ms = 1000.0 / (view.inference_tps * blocks) if view is not None and view.inference_tps else None
            seen = measured.get(info.peer_id)
            nodes.append(
                {
                    "peer_id": info.peer_id,
                    "state": info.state.value,
                    "blocks": [info.start_block, info.end_block],
                    "block_ms": round(seen.block_ms if seen else costed_ms, 4) if (seen or costed_ms) else None,
                    "speed_source": "measured" if seen else "claimed (bounded)",
                    "cache_tokens_left": info.cache_tokens_left,
                    "codecs": list(info.codecs),
                    "quantization": info.quantization,
                    "dtype": info.dtype,
                    "queue": info.load.queue,
                }
            )
        coverage = [
            [
                info.peer_id
                for info in infos
                if info.state == NodeState.online and info.start_block <= block < info.end_block
            ]
            for block in range(num_blocks)
        ]
        chains = [list(session.chain.peer_ids) for session in list(swarm.open_sessions)]
        return {
            "model": self.model_name,
            "num_blocks": num_blocks,
            "time": time.time(),
            "nodes": nodes,
            "coverage": coverage,
            "gaps": [block for block, servers in enumerate(coverage) if not servers],
            "chains": chains,
            "topology": self._topology_of(snapshot),
            "change": self._change_document(),
            "events": list(self.events),
        }

    def _note_changes(self, infos) -> None:
        now = time.time()
        current = {info.peer_id: (info.state.value, info.start_block, info.end_block) for info in infos}
        for peer, (state, start, end) in current.items():
            before = self._seen.get(peer)
            if before is None:
                self._event(now, peer, f"joined: blocks {start}:{end}, {state}")
                continue
            old_state, old_start, old_end = before
            if (old_start, old_end) != (start, end):
                self._event(now, peer, f"moved: blocks {old_start}:{old_end} -> {start}:{end}, {state}")
            elif old_state != state:
                self._event(now, peer, f"state: {old_state} -> {state}")
        for peer in self._seen.keys() - current.keys():
            self._event(now, peer, "left (record expired or withdrawn)")
        self._seen = current

    def _event(self, when: float, peer: str, text: str) -> None:
        self.events.appendleft({"time": when, "peer_id": peer, "event": text})

    def _topology_of(self, snapshot) -> dict | None:
        if time.monotonic() - self._topology_at < self.topology_period_s and self._topology is not None:
            return self._topology
        self._topology_at = time.monotonic()
        try:
            self._topology, found = topology_document(snapshot)
        except Exception as exc:  # gudhi missing, or too few nodes: the page says why
            self._topology = {"error": f"{type(exc).__name__}: {exc}"}
            return self._topology
        self._watch(found)
        return self._topology

    def _watch(self, found) -> None:
        """Feed one snapshot's diagrams to the change detection (see the module docstring)."""
        now = time.time()
        if self._monitor is None:
            self._calibration.append(found)
            if len(self._calibration) < CALIBRATION_SNAPSHOTS:
                return
            learned = learn_threshold(self._calibration)
            threshold = replace(
                learned,
                h0=max(learned.h0, MIN_THRESHOLD),
                h1=max(learned.h1, MIN_THRESHOLD),
                features=max(learned.features, MIN_THRESHOLD),
            )
            self._monitor = observe(start_monitor(threshold), found, now)
            self._calibration = []
            return
        self._monitor = observe(self._monitor, found, now)
        last = self._monitor.last
        self._scores.append([now, round(last.score, 4)])
        if last.changed:
            self._event(
                now,
                "",
                f"topology changed: score {last.score:.2f} (bottleneck H0 {last.distance_h0:.2f} ms, "
                f"H1 {last.distance_h1:.2f} ms)",
            )

    def _change_document(self) -> dict:
        if self._monitor is None:
            return {"calibrating": [len(self._calibration), CALIBRATION_SNAPSHOTS], "scores": []}
        return {"calibrating": None, "scores": list(self._scores)}


def topology_document(snapshot) -> tuple[dict, object]:
    """The swarm graph (2-D positions, edges) and its H0/H1 persistence pairs (ms), for drawing; and the diagrams
    (homology.Diagrams) for change detection."""
    from nesa_node.topology.graph import swarm_graph
    from nesa_node.topology.homology import diagrams

    graph = swarm_graph(snapshot)
    positions = np.asarray(graph.positions, dtype=float)
    if positions.shape[0]:
        positions = positions[:, :2] - positions[:, :2].mean(axis=0)
    found = diagrams(graph)

    def pairs(dimension: int) -> list[list[float]]:
        return [[round(float(birth), 3), round(float(death), 3)] for birth, death in found.dimension(dimension)]

    document = {
        "peer_ids": list(graph.peer_ids),
        "positions": [[round(float(x), 3), round(float(y), 3)] for x, y in positions],
        "edges": [[int(a), int(b)] for a, b in graph.edges],
        "h0": pairs(0),
        "h1": pairs(1),
        "scale_cap_ms": round(float(graph.scale_cap_ms), 3),
    }
    return document, found


__all__ = ["DashboardState", "topology_document"]

"""The topology dashboard's data: what the gateway's own swarm client sees, as one JSON document the page at `/`
polls every second.

- nodes: every unexpired record (a killed node drops out when its record expires), with its state, blocks, KV cache
  left, codecs and quantization, and its speed as the client measured it (ms per block per token, from its own
  sessions' steps; the claim, bounded by the other nodes' claims, until then: routing/claims.py);
- coverage: per block, the online nodes serving it, and the gaps;
- chains: the nodes of each session open now;
- topology: the swarm graph (topology/graph.py, positions projected to 2-D) and its H0/H1 persistence diagrams
  (topology/homology.py, gudhi), recomputed at most every TOPOLOGY_PERIOD_S;
- events: nodes joining, leaving and changing blocks or state, as this gateway saw them, newest first.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np

from nesa_node.protocol.records import NodeState

TOPOLOGY_PERIOD_S = 5.0  # persistent homology of a few hundred nodes takes tens of ms; the page polls every second
MAX_EVENTS = 50


class DashboardState:
    """Builds the dashboard document of one AsyncDistributedModel's swarm (see the module docstring)."""

    def __init__(self, model, *, model_name: str):
        self.model = model
        self.model_name = model_name
        self.events: deque[dict] = deque(maxlen=MAX_EVENTS)
        self._seen: dict[str, tuple] = {}  # peer id -> (state, start, end) at the last poll
        self._topology: dict | None = None
        self._topology_at = -math.inf

    async def document(self) -> dict:
        swarm = self.model.swarm
        num_blocks = self.model.model_config.num_hidden_layers
        records = await swarm.node_records()
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
            "events": list(self.events),
        }

    def _note_changes(self, infos) -> None:
        now = time.time()
        current = {info.peer_id: (info.state.value, info.start_block, info.end_block) for info in infos}
        for peer, (state, start, end) in current.items():
            before = self._seen.get(peer)
            if before is None:
                self.events.appendleft(
                    {"time": now, "peer_id": peer, "event": f"joined: blocks {start}:{end}, {state}"}
                )
            elif before != (state, start, end):
                self.events.appendleft({"time": now, "peer_id": peer, "event": f"now blocks {start}:{end}, {state}"})
        for peer in self._seen.keys() - current.keys():
            self.events.appendleft({"time": now, "peer_id": peer, "event": "left (record expired or withdrawn)"})
        self._seen = current

    def _topology_of(self, snapshot) -> dict | None:
        if time.monotonic() - self._topology_at < TOPOLOGY_PERIOD_S and self._topology is not None:
            return self._topology
        self._topology_at = time.monotonic()
        try:
            self._topology = topology_document(snapshot)
        except Exception as exc:  # gudhi missing, or too few nodes: the page says why
            self._topology = {"error": f"{type(exc).__name__}: {exc}"}
        return self._topology


def topology_document(snapshot) -> dict:
    """The swarm graph (2-D positions, edges) and its H0/H1 persistence pairs (ms), for drawing."""
    from nesa_node.topology.graph import swarm_graph
    from nesa_node.topology.homology import diagrams

    graph = swarm_graph(snapshot)
    positions = np.asarray(graph.positions, dtype=float)
    if positions.shape[0]:
        positions = positions[:, :2] - positions[:, :2].mean(axis=0)
    found = diagrams(graph)

    def pairs(dimension: int) -> list[list[float]]:
        return [[round(float(birth), 3), round(float(death), 3)] for birth, death in found.dimension(dimension)]

    return {
        "peer_ids": list(graph.peer_ids),
        "positions": [[round(float(x), 3), round(float(y), 3)] for x, y in positions],
        "edges": [[int(a), int(b)] for a, b in graph.edges],
        "h0": pairs(0),
        "h1": pairs(1),
        "scale_cap_ms": round(float(graph.scale_cap_ms), 3),
    }


__all__ = ["DashboardState", "topology_document"]

"""Two topology classes of a small swarm of the 4-block tiny model, for the schema book's tests.

Nine node roles, each a place (lat, lon), a span length and a compute time per block. "atlantic": three nodes in
New York and three in Frankfurt; "pacific": Frankfurt's have left and three nodes in Tokyo have joined. A book is
built from records of both states with the small variations of remeasurement (compute times +-3%, places +-0.1
degrees), as `nesa-node schema record` would have taken them on different days.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.swarm_view import build_snapshot
from nesa_node.topology.schemas import SchemaBook, apply_schema, build_book

NUM_BLOCKS = 4


@dataclass(frozen=True)
class Role:
    place: tuple[float, float]  # (lat, lon)
    length: int  # blocks served
    block_ms: float  # compute ms per block per token (claims stay within 2x of each other: none is capped)

    def inference_tps(self, scale: float = 1.0) -> float:
        return 1000.0 / (self.block_ms * scale * self.length)


NEW_YORK, FRANKFURT, TOKYO = (40.71, -74.0), (50.11, 8.68), (35.68, 139.69)
ROLES = {
    "ny1": Role(NEW_YORK, 2, 6.0),
    "ny2": Role((NEW_YORK[0] + 0.02, NEW_YORK[1]), 2, 8.0),
    "ny3": Role((NEW_YORK[0] + 0.04, NEW_YORK[1]), 1, 7.0),
    "fra1": Role(FRANKFURT, 2, 6.5),
    "fra2": Role((FRANKFURT[0] + 0.02, FRANKFURT[1]), 2, 9.0),
    "fra3": Role((FRANKFURT[0] + 0.04, FRANKFURT[1]), 1, 7.5),
    "tyo1": Role(TOKYO, 3, 6.0),
    "tyo2": Role((TOKYO[0] + 0.02, TOKYO[1]), 3, 9.0),
    "tyo3": Role((TOKYO[0] + 0.04, TOKYO[1]), 1, 8.5),
}
STATES = {
    "atlantic": ("ny1", "ny2", "ny3", "fra1", "fra2", "fra3"),
    "pacific": ("ny1", "ny2", "ny3", "tyo1", "tyo2", "tyo3"),
}
# where the Tokyo nodes start when they join: every one at the first blocks (what an operator starting them with
# --blocks 0:N would do), so the pacific swarm is lopsided until it moves
TOKYO_JOINS_AT = {"tyo1": 0, "tyo2": 0, "tyo3": 0}


def record(
    peer_id: str, role: Role, start: int, *, state: NodeState = NodeState.online, rng: np.random.Generator | None = None
) -> NodeInfo:
    """A node's record in role `role` at blocks [start, start + length); `rng` varies it as a remeasurement."""
    scale, lat, lon = 1.0, *role.place
    if rng is not None:
        scale = float(rng.uniform(0.97, 1.03))
        lat, lon = lat + float(rng.uniform(-0.1, 0.1)), lon + float(rng.uniform(-0.1, 0.1))
    return NodeInfo(
        peer_id=peer_id,
        state=state,
        start_block=start,
        end_block=start + role.length,
        dtype="float32",
        inference_tps=role.inference_tps(scale),
        location=(lat, lon),
    )


def state_records(state: str, starts: dict[str, int], *, rng: np.random.Generator | None = None) -> list[NodeInfo]:
    """Records of the state's roles (peer id = role name) at `starts`."""
    return [record(name, ROLES[name], starts[name], rng=rng) for name in STATES[state]]


def default_starts(state: str) -> dict[str, int]:
    """Starts that serve every block: the state's roles in turn at the first blocks and at the last ones."""
    return {
        name: (0 if index % 2 == 0 else NUM_BLOCKS - ROLES[name].length) for index, name in enumerate(STATES[state])
    }


def make_book(per_state: int = 4, seed: int = 0) -> SchemaBook:
    """A book of `per_state` varied snapshots of each state (the book's classes and radius come from their spread)."""
    rng = np.random.default_rng(seed)
    snapshots = [
        build_snapshot(state_records(state, default_starts(state), rng=rng), NUM_BLOCKS)
        for state in STATES
        for _ in range(per_state)
    ]
    return build_book(snapshots, rng=np.random.default_rng(seed))


def schema_starts(book: SchemaBook, infos: list[NodeInfo]) -> tuple[int, dict[str, int], bool]:
    """(class, start by peer id, far) of the book's assignment for the snapshot of `infos`."""
    assignment = apply_schema(build_snapshot(infos, NUM_BLOCKS), book)
    return assignment.label, assignment.starts, assignment.far

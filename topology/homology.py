"""Persistence diagrams of the swarm graph, their summary features, and the distance between two snapshots.

Sec. 2.7.1 of the Nesa paper: filter the swarm's complex by scale, record when connected components (H0) and
cycles (H1) are born and die, and compare snapshots by their diagrams. Here the complex is the vertex-weighted flag
complex of `SwarmGraph` (graph.py): vertices at their own delay, edges at half the link delay, triangles at their
last edge. Before the expansion to triangles gudhi's edge collapse (Boissonnat and Pritam, the paper's ref. [46])
removes edges that cannot change the persistence, which keeps 10,000-node swarms fast.

Truncation: the filtration is read up to `SwarmGraph.scale_cap_ms` = median(w) + (swarm diameter) / 2, the scale
at which two typical nodes at the two ends of the swarm are joined. Bars are clipped there; the whole swarm's
essential H0 class ends at the cap; a node so slow it is born after the cap leaves no bar.

Essential H1 classes are counted (`Diagrams.essential`) but left out of the H1 diagram. They are cycles of
measured links that no measured chord ever fills: the bridges between cities meet at different nodes, so a ring of
cities has no triangles. Which of those rings exist flips with every re-measurement of which node is closest to
which, so they carry measurement noise, not topology (measured: with them, repeated measurements of one swarm
differed by ~20 ms of H1 bottleneck distance). With enough neighbours that chords exist (a dense swarm, or
`neighbours >= n - 1`, the full weighted Rips complex) rings fill and show as finite H1 bars.

gudhi is imported lazily (it is a compiled dependency, not needed to run a node).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nesa_node.topology.graph import SwarmGraph

# Betti-curve grid, ms: log-spaced over what one hop can take, LAN to antipodes (fixed so snapshots compare)
FEATURE_GRID_MS = tuple(float(value) for value in np.geomspace(0.5, 400.0, 24))

__all__ = [
    "FEATURE_GRID_MS",
    "Diagrams",
    "betti_curve",
    "bottleneck_distances",
    "diagrams",
    "features",
    "h0_from_graph",
    "persistence_entropy",
    "total_persistence",
]


def _gudhi():
    try:
        import gudhi
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "topology needs gudhi for persistent homology: pip install gudhi (it is in nesa-node's dependencies)"
        ) from error
    return gudhi


@dataclass(frozen=True, eq=False)
class Diagrams:
    """H0 and H1 persistence diagrams of one snapshot, ms; rows (birth, death), clipped at `cap`; essential H1
    classes only counted."""

    h0: np.ndarray  # (k, 2)
    h1: np.ndarray  # (m, 2)
    cap: float  # largest filtration value of the complex, ms
    essential: tuple[int, int]  # how many bars of H0 and H1 were infinite before the cut

    def dimension(self, dimension: int) -> np.ndarray:
        if dimension not in (0, 1):
            raise ValueError(f"diagrams hold dimensions 0 and 1, not {dimension}")
        return self.h0 if dimension == 0 else self.h1


def _cut(intervals: np.ndarray, cap: float) -> tuple[np.ndarray, int]:
    """Clip deaths (infinite ones included) to `cap`; drop the bars left with no length."""
    intervals = np.asarray(intervals, np.float64).reshape(-1, 2)
    infinite = int((~np.isfinite(intervals[:, 1])).sum())
    clipped = np.column_stack([intervals[:, 0], np.minimum(intervals[:, 1], cap)])
    return clipped[clipped[:, 1] > clipped[:, 0]], infinite


def diagrams(graph: SwarmGraph, *, collapse: bool = True) -> Diagrams:
    """H0 and H1 of the graph's vertex-weighted flag filtration (gudhi, Z/2 coefficients).

    `collapse` applies gudhi's edge collapse first (same diagrams, faster on dense graphs). Raises ImportError
    without gudhi."""
    gudhi = _gudhi()
    tree = gudhi.SimplexTree()
    count = graph.num_nodes
    if count == 0:
        empty = np.zeros((0, 2))
        return Diagrams(empty, empty, 0.0, (0, 0))
    # insert_batch reads its arrays raw: they must be C-contiguous int64 / float64 (a transposed view or int32
    # vertices silently corrupt the complex)
    vertices = np.ascontiguousarray(np.arange(count, dtype=np.int64)[None, :])
    tree.insert_batch(vertices, np.ascontiguousarray(graph.node_delay_ms, dtype=np.float64))
    if len(graph.edges):
        edges = np.ascontiguousarray(graph.edges.T, dtype=np.int64)
        tree.insert_batch(edges, np.ascontiguousarray(graph.filtration, dtype=np.float64))
    if collapse and len(graph.edges):
        tree.collapse_edges(-1)  # until no edge can be collapsed
    tree.expansion(2)
    tree.compute_persistence(homology_coeff_field=2, persistence_dim_max=False)
    cap = graph.scale_cap_ms
    h0, essential0 = _cut(tree.persistence_intervals_in_dimension(0), cap)
    h1 = np.asarray(tree.persistence_intervals_in_dimension(1), np.float64).reshape(-1, 2)
    essential1 = int((~np.isfinite(h1[:, 1])).sum())
    h1, _ = _cut(h1[np.isfinite(h1[:, 1])], cap)
    return Diagrams(h0, h1, cap, (essential0, essential1))


def h0_from_graph(graph: SwarmGraph) -> np.ndarray:
    """H0 bars by Kruskal's union-find with the elder rule (the younger component dies at a merge), without gudhi:
    (k, 2) rows clipped at the cap as in `diagrams`. Same bars as `diagrams(...).h0`
    (H0 depends only on the graph), used to check one against the other and by monitor.py for per-node stability."""
    parent = np.arange(graph.num_nodes)
    birth = graph.node_delay_ms.astype(np.float64).copy()

    def root(node: int) -> int:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    bars = []
    for edge in np.argsort(graph.filtration, kind="stable"):
        first, second = root(int(graph.edges[edge, 0])), root(int(graph.edges[edge, 1]))
        if first == second:
            continue
        if birth[first] > birth[second] or (birth[first] == birth[second] and first > second):
            first, second = second, first  # `first` is the elder
        bars.append((birth[second], float(graph.filtration[edge])))
        parent[second] = first
    cap = graph.scale_cap_ms
    roots = {root(node) for node in range(graph.num_nodes)}
    bars.extend((birth[node], np.inf) for node in roots)
    return _cut(np.array(bars, np.float64), cap)[0]


def total_persistence(diagram: np.ndarray) -> float:
    """Sum of bar lengths, ms."""
    diagram = np.asarray(diagram).reshape(-1, 2)
    return float((diagram[:, 1] - diagram[:, 0]).sum())


def persistence_entropy(diagram: np.ndarray) -> float:
    """Shannon entropy (nats) of bar lengths normalised to sum 1; 0 for an empty diagram. Low: a few bars dominate
    (clear clusters or holes); high: many bars of similar length (noise)."""
    diagram = np.asarray(diagram).reshape(-1, 2)
    lengths = diagram[:, 1] - diagram[:, 0]
    lengths = lengths[lengths > 0]
    if lengths.size == 0:
        return 0.0
    share = lengths / lengths.sum()
    return float(-(share * np.log(share)).sum())


def betti_curve(diagram: np.ndarray, grid_ms=FEATURE_GRID_MS) -> np.ndarray:
    """Number of bars alive (birth <= t < death) at each scale t of `grid_ms`."""
    diagram = np.asarray(diagram).reshape(-1, 2)
    grid = np.asarray(grid_ms, np.float64)[:, None]
    return ((diagram[None, :, 0] <= grid) & (grid < diagram[None, :, 1])).sum(axis=1)


def features(snapshot_diagrams: Diagrams, grid_ms=FEATURE_GRID_MS) -> np.ndarray:
    """One vector per snapshot for the schema classifier: log(1 + Betti curve) of H0 and H1 on the grid, then
    log(1 + total persistence) and persistence entropy of H0 and H1, then log(1 + cap)."""
    parts = []
    for diagram in (snapshot_diagrams.h0, snapshot_diagrams.h1):
        parts.append(np.log1p(betti_curve(diagram, grid_ms)))
    for diagram in (snapshot_diagrams.h0, snapshot_diagrams.h1):
        parts.append([np.log1p(total_persistence(diagram)), persistence_entropy(diagram)])
    parts.append([np.log1p(snapshot_diagrams.cap)])
    return np.concatenate([np.asarray(part, np.float64) for part in parts])


def bottleneck_distances(first: Diagrams, second: Diagrams) -> tuple[float, float]:
    """Bottleneck distance between two snapshots' H0 and between their H1 diagrams, ms. Raises ImportError
    without gudhi."""
    gudhi = _gudhi()
    return (
        float(gudhi.bottleneck_distance(first.h0, second.h0)),
        float(gudhi.bottleneck_distance(first.h1, second.h1)),
    )

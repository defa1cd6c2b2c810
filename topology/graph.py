"""The swarm as a weighted graph: the space persistent homology filters (sec. 2.7.1 of the Nesa paper).

The paper embeds the swarm by geography and weights it by "node internet connectivity and node computational
power". Exactly what is built here, all times in ms:

- Nodes: the available nodes of the snapshot (online, not draining). A node's own delay per hop is

      w_v = access_v + D / bandwidth_v + t_v

  its last mile, the serialisation of one token's hidden state (D = hidden_size * element_bytes, zero when the
  snapshot does not know the hidden size) at its access bandwidth, and its idle compute time per block per token
  t_v = 1000 / (inference_tps * span). w_v carries connectivity and compute power. The current load is left out on
  purpose: it moves by the minute (routing's eq. 18 already charges it per request), and 1 / (1 - load) of a busy
  node would drown the topology in that noise.
- Metric space: when every node announced a location (lat, lon), its point on the sphere (chord distances, in ms at
  the speed of light in fibre times a route inflation); otherwise classical MDS of the regions' shortest-path
  backbone latencies (Floyd-Warshall over `region_latency_ms`, then the top three eigenpairs of the double-centred
  squared distances); nodes of one region share its point, nodes with no region sit at the centroid. Each point is
  lifted by its w_v as a fourth coordinate so nodes of one place are told apart by their delay.
- Core latency between two nodes: the larger of the backbone latency between their regions and the great-circle
  distance at fibre speed (no path beats light in fibre; inside one region the backbone term is zero and geography
  separates the nodes). A link's one-way latency is access_a + core_ab + access_b, its bandwidth min(bw_a, bw_b).
- Edges (the measured graph): each node's `neighbours` nearest nodes in the lifted space (ranked by filtration value
  among twice as many nearest candidates), plus bridges that make the graph connected: between every pair of
  connected components when there are few, else from each component to its nearest other one, repeated (Boruvka);
  each bridge is the least-valued pair among each node's 2 * neighbours nearest nodes of the other component. The
  same cheapest links are added between every two regions (Boruvka over regions when there are many), so the
  scale at which two regions merge does not flip with which border nodes happen to be nearest. A swarm measures few of its n^2 links, so this is also what a live swarm has.
- Filtration (vertex-weighted flag complex; the weighted Rips filtration with p = 1): vertex v enters at w_v, edge
  (a, b) at max(w_a, w_b, (w_a + core_ab + w_b) / 2), that is when balls of radius t - w_a and t - w_b around the two
  nodes first touch: half the link's delay including both nodes' own delay. Higher simplices enter with their
  last edge (flag complex), see homology.py.

Why a sparse weighted flag complex rather than sparse Rips: sparse Rips filters Euclidean distances only, so it
cannot carry the node delays or measured backbone latencies; and on 1,000 simulated nodes gudhi's sparse Rips
(epsilon 0.5, on the lifted points, to dimension 2) took ~0.36 s and half a million simplices where this graph
and its H0 + H1 take ~0.03 s (measured on 2 shared cores; bench/topology.py measures both).
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components, shortest_path
from scipy.spatial import cKDTree
from scipy.spatial.distance import pdist

from nesa_node.routing.snapshot import SwarmSnapshot

EARTH_RADIUS_KM = 6371.0
FIBRE_KM_PER_MS = 200.0  # light in fibre, 2/3 c (physics)
ROUTE_INFLATION = 1.5  # internet paths run ~1.5-2x the great-circle distance (published measurements)
NEIGHBOURS = 8  # measured links per node (guess: a handful of pings per announce period; see bench/topology.py)
ALL_PAIR_BRIDGES = 24  # up to this many components, bridge every pair of them (cheap, keeps their H1 cycles)

__all__ = ["SwarmGraph", "point_graph", "swarm_graph"]


@dataclass(frozen=True, eq=False)
class SwarmGraph:
    """The weighted swarm graph. Nodes are in a canonical order (by place and delay, not by id), so relabelling or
    reordering the snapshot's nodes gives the same graph up to the ids."""

    peer_ids: tuple[str, ...]
    embedding: str  # "geographic", "latency-mds" or "points"
    positions: np.ndarray  # (n, 3) ms: the metric-space point of each node, before the lift by delay
    node_delay_ms: np.ndarray  # (n,) w_v, the vertex filtration value
    throughput_tps: np.ndarray  # (n,) tokens/s through the node's span at its load (capacity attribute)
    start_block: np.ndarray  # (n,) int
    end_block: np.ndarray  # (n,) int
    region: np.ndarray  # (n,) int, -1 unknown
    edges: np.ndarray  # (m, 2) int, node indices a < b
    latency_ms: np.ndarray  # (m,) one-way latency of the link, access_a + core + access_b
    bandwidth_mbps: np.ndarray  # (m,) min of both ends' access bandwidth
    filtration: np.ndarray  # (m,) edge filtration value, >= both vertex values
    scale_cap_ms: float  # median(w) + (geographic diameter, else widest backbone latency) / 2, see homology.py

    @property
    def num_nodes(self) -> int:
        return len(self.peer_ids)

    def to_networkx(self) -> nx.Graph:
        """networkx view: node attributes throughput_tps, delay_ms, start_block, end_block, region; edge
        attributes latency_ms, bandwidth_mbps, filtration."""
        graph = nx.Graph()
        for index, peer_id in enumerate(self.peer_ids):
            graph.add_node(
                peer_id,
                throughput_tps=float(self.throughput_tps[index]),
                delay_ms=float(self.node_delay_ms[index]),
                start_block=int(self.start_block[index]),
                end_block=int(self.end_block[index]),
                region=int(self.region[index]),
            )
        for (a, b), latency, bandwidth, value in zip(
            self.edges.tolist(), self.latency_ms, self.bandwidth_mbps, self.filtration, strict=True
        ):
            graph.add_edge(
                self.peer_ids[a],
                self.peer_ids[b],
                latency_ms=float(latency),
                bandwidth_mbps=float(bandwidth),
                filtration=float(value),
            )
        return graph


def _sphere_ms(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    """(n, 3) points on the earth's surface, scaled from km to ms of fibre."""
    lat, lon = np.radians(lat), np.radians(lon)
    xyz = np.stack([np.cos(lat) * np.cos(lon), np.cos(lat) * np.sin(lon), np.sin(lat)], axis=1)
    return xyz * EARTH_RADIUS_KM / FIBRE_KM_PER_MS * ROUTE_INFLATION


def classical_mds(distances: np.ndarray, dimensions: int = 3) -> np.ndarray:
    """Classical (Torgerson) MDS: (k, dimensions) points whose Euclidean distances best match `distances` (k, k);
    dimensions with non-positive eigenvalues are zero."""
    count = distances.shape[0]
    centring = np.eye(count) - 1.0 / count
    gram = -0.5 * centring @ (distances**2) @ centring
    values, vectors = np.linalg.eigh((gram + gram.T) / 2)
    order = np.argsort(values)[::-1][:dimensions]
    points = vectors[:, order] * np.sqrt(np.maximum(values[order], 0.0))
    return np.pad(points, ((0, 0), (0, dimensions - points.shape[1])))


def _diameter(positions: np.ndarray) -> float:
    """Largest Euclidean distance between two rows: exact over the distinct rows when there are at most 2,000,
    else a double sweep from the first row (within a factor 2 of the exact diameter; nodes are in canonical order,
    so the estimate does not depend on labels)."""
    distinct = np.unique(positions, axis=0)
    if len(distinct) <= 1:
        return 0.0
    if len(distinct) <= 2000:
        return float(pdist(distinct).max())
    far = distinct[np.argmax(np.linalg.norm(distinct - positions[0], axis=1))]
    return float(np.linalg.norm(distinct - far, axis=1).max())


def _pair_candidates(lifted: np.ndarray, neighbours: int) -> tuple[np.ndarray, np.ndarray]:
    """For each node, its 2 * neighbours nearest other nodes in the lifted space: (sources, targets)."""
    count = lifted.shape[0]
    want = min(count - 1, 2 * neighbours)
    if want <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, found = cKDTree(lifted).query(lifted, k=want + 1)
    found = np.asarray(found).reshape(count, want + 1)
    sources = np.repeat(np.arange(count), want + 1)
    targets = found.reshape(-1)
    keep = sources != targets
    return sources[keep], targets[keep]


def _cheapest(sources: np.ndarray, targets: np.ndarray, positions: np.ndarray, value_of, neighbours: int):
    """The (source, target) pair of least filtration value among each source's `neighbours` nearest targets."""
    want = min(neighbours, targets.size)
    _, nearest = cKDTree(positions[targets]).query(positions[sources], k=want)
    nearest = np.asarray(nearest).reshape(sources.size, want)
    first, second = np.repeat(sources, want), targets[nearest.reshape(-1)]
    best = int(np.argmin(value_of(first, second)))
    return int(first[best]), int(second[best])


def _bridges(positions, labels, components, value_of, neighbours) -> list[tuple[int, int]]:
    """Links joining components, each the least-valued pair among nearby candidates (so the choice does not flip
    with small measurement noise): between every pair of components when few, else Boruvka rounds."""
    members = [np.flatnonzero(labels == label) for label in range(components)]
    if components <= ALL_PAIR_BRIDGES:
        return [
            _cheapest(members[first], members[second], positions, value_of, 2 * neighbours)
            for first in range(components)
            for second in range(first + 1, components)
        ]
    return [
        _cheapest(group, np.flatnonzero(labels != labels[group[0]]), positions, value_of, 2 * neighbours)
        for group in members
    ]


def _build(
    positions: np.ndarray,
    delay: np.ndarray,
    core_ms,
    neighbours: int,
    groups: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges (m, 2), their core latency and filtration value, for nodes already in canonical order.

    `core_ms(a, b)` gives the core latency of node pairs (arrays of indices). `groups` (one label per node, e.g. the
    region) adds the cheapest link between every two groups, so the scale at which two regions merge does not
    hinge on which border nodes happen to be each other's nearest neighbours."""
    count = positions.shape[0]

    def value_of(first: np.ndarray, second: np.ndarray) -> np.ndarray:
        middle = (delay[first] + core_ms(first, second) + delay[second]) / 2
        return np.maximum(np.maximum(delay[first], delay[second]), middle)

    lifted = np.column_stack([positions, delay])
    sources, targets = _pair_candidates(lifted, neighbours)
    core = core_ms(sources, targets)
    value = np.maximum(np.maximum(delay[sources], delay[targets]), (delay[sources] + core + delay[targets]) / 2)
    # keep each node's `neighbours` best candidates by filtration value (stable: ties keep the tree's order)
    order = np.lexsort((value, sources))
    rank = np.arange(order.size) - np.searchsorted(sources[order], sources[order])
    chosen = order[rank < neighbours]
    pairs = np.sort(np.column_stack([sources[chosen], targets[chosen]]), axis=1)
    pairs = np.unique(pairs, axis=0) if pairs.size else pairs.reshape(0, 2)
    if groups is not None:
        _, labels = np.unique(groups, return_inverse=True)
        if labels.max(initial=0) >= 1:
            found = _bridges(positions, labels, int(labels.max()) + 1, value_of, neighbours)
            pairs = np.unique(np.vstack([pairs, np.sort(np.array(found, np.int64), axis=1)]), axis=0)
    while count > 1:
        adjacency = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(count, count))
        components, labels = connected_components(adjacency, directed=False)
        if components == 1:
            break
        found = _bridges(positions, labels, components, value_of, neighbours)
        extra = np.sort(np.array(found, np.int64), axis=1)
        pairs = np.unique(np.vstack([pairs, extra]), axis=0)
    pairs = pairs.astype(np.int64).reshape(-1, 2)
    core = core_ms(pairs[:, 0], pairs[:, 1])
    first, second = delay[pairs[:, 0]], delay[pairs[:, 1]]
    value = np.maximum(np.maximum(first, second), (first + core + second) / 2)
    return pairs, core, value


def point_graph(points: np.ndarray, delay_ms: np.ndarray | None = None, *, neighbours: int = NEIGHBOURS) -> SwarmGraph:
    """The graph of bare points (n, d <= 3) in ms, core latency = Euclidean distance, node delay `delay_ms` (zero
    by default). For tests and for swarms described by coordinates alone. Raises ValueError on bad shapes."""
    points = np.asarray(points, np.float64)
    if points.ndim != 2 or points.shape[1] > 3:
        raise ValueError(f"points must be (n, d) with d <= 3, got shape {points.shape}")
    count = points.shape[0]
    delay = np.zeros(count) if delay_ms is None else np.asarray(delay_ms, np.float64)
    if delay.shape != (count,) or not np.all(np.isfinite(delay)) or np.any(delay < 0):
        raise ValueError("delay_ms must be one finite, non-negative value per point")
    positions = np.pad(points, ((0, 0), (0, 3 - points.shape[1])))
    order = np.lexsort((*positions.T[::-1], delay))
    positions, delay = positions[order], delay[order]
    pairs, core, value = _build(
        positions, delay, lambda a, b: np.linalg.norm(positions[a] - positions[b], axis=-1), neighbours
    )
    zeros = np.zeros(count)
    return SwarmGraph(
        peer_ids=tuple(str(int(index)) for index in order),
        embedding="points",
        positions=positions,
        node_delay_ms=delay,
        throughput_tps=zeros,
        start_block=zeros.astype(np.int64),
        end_block=zeros.astype(np.int64),
        region=np.full(count, -1),
        edges=pairs,
        latency_ms=core,
        bandwidth_mbps=np.full(len(pairs), np.inf),
        filtration=value,
        scale_cap_ms=float(np.median(delay) + _diameter(positions) / 2) if count else 0.0,
    )


def swarm_graph(snapshot: SwarmSnapshot, *, neighbours: int = NEIGHBOURS) -> SwarmGraph:
    """The weighted swarm graph of `snapshot` (see the module docstring for the exact construction).

    Raises ValueError when `neighbours` < 1."""
    if neighbours < 1:
        raise ValueError("neighbours must be >= 1")
    arrays = snapshot.arrays
    keep = np.flatnonzero(arrays.available)
    nodes = [snapshot.nodes[index] for index in keep]
    count = keep.size
    access = arrays.access_ms[keep]
    bandwidth = arrays.bandwidth_mbps[keep]
    megabits = snapshot.hidden_size * snapshot.element_bytes * 8 / 1e6
    compute = arrays.block_ms[keep]
    delay = access + megabits / bandwidth * 1000.0 + compute
    region = arrays.region[keep]  # unknown regions map to the backbone's last row/column (zero)
    backbone = arrays.backbone
    located = count > 0 and all(node.lat is not None and node.lon is not None for node in nodes)
    if located:
        lat = np.array([node.lat for node in nodes], np.float64)
        lon = np.array([node.lon for node in nodes], np.float64)
        positions = _sphere_ms(lat, lon)
        embedding = "geographic"
    else:
        regions = backbone.shape[0] - 1
        points = np.zeros((regions + 1, 3))
        if regions > 1:
            shortest = shortest_path(np.maximum(backbone[:regions, :regions], 0.0), directed=False)
            shortest = np.where(np.isfinite(shortest), shortest, np.nanmax(shortest[np.isfinite(shortest)]))
            points[:regions] = classical_mds((shortest + shortest.T) / 2)
            points[regions] = points[:regions].mean(axis=0)
        positions = points[region]
        embedding = "latency-mds"
    order = np.lexsort((*positions.T[::-1], region, delay))
    positions, delay, region, access, bandwidth = (
        positions[order],
        delay[order],
        region[order],
        access[order],
        bandwidth[order],
    )
    radius_ms = EARTH_RADIUS_KM / FIBRE_KM_PER_MS * ROUTE_INFLATION

    def core_ms(first: np.ndarray, second: np.ndarray) -> np.ndarray:
        core = backbone[region[first], region[second]]
        if located:
            chord = np.linalg.norm(positions[first] - positions[second], axis=-1)
            great_circle = 2 * radius_ms * np.arcsin(np.clip(chord / (2 * radius_ms), 0.0, 1.0))
            core = np.maximum(core, great_circle)
        return core

    pairs, core, value = _build(positions, delay, core_ms, neighbours, region)
    if located:  # announced places are stable; measured backbone maxima jitter
        chord = min(_diameter(positions), 2 * radius_ms)
        widest = 2 * radius_ms * float(np.arcsin(chord / (2 * radius_ms)))
    else:
        present = np.unique(region)
        widest = float(backbone[np.ix_(present, present)].max(initial=0.0))
    cap = float(np.median(delay) + widest / 2) if count else 0.0
    chosen = keep[order]
    tps = np.array([snapshot.nodes[index].inference_tps for index in chosen], np.float64).reshape(count)
    num_regions = backbone.shape[0] - 1
    return SwarmGraph(
        peer_ids=tuple(snapshot.nodes[index].peer_id for index in chosen),
        embedding=embedding,
        positions=positions,
        node_delay_ms=delay,
        throughput_tps=tps * (1.0 - arrays.load[chosen]),
        start_block=arrays.start[chosen],
        end_block=arrays.end[chosen],
        region=np.where(region == num_regions, -1, region),
        edges=pairs,
        latency_ms=access[pairs[:, 0]] + core + access[pairs[:, 1]] if len(pairs) else np.zeros(0),
        bandwidth_mbps=np.minimum(bandwidth[pairs[:, 0]], bandwidth[pairs[:, 1]]) if len(pairs) else np.zeros(0),
        filtration=value,
        scale_cap_ms=cap,
    )

"""Precomputed sharding schemas (sec. 2.7.1 of the Nesa paper): topology classes, a schema per class, a classifier.

The paper: precompute efficient sharding schemas for the swarm's topological states, and let a classifier over the
PH_0 and PH_1 persistence data pick the schema for the current topology instead of solving the sharding again.
Measured figures below are from 40 snapshots (8 per state, different times and remeasurements) of five states of a
200-node global swarm: all up, Asia down, Europe down, a cluster joined in Sao Paulo, the transatlantic backbone 4x
slower; held-out snapshots at other times and remeasure seeds.

Classes: k-medoids (seeded restarts) on the bottleneck distance between the snapshots' H0 diagrams; the number of
classes given, or the one of CLASS_CANDIDATES with the best mean silhouette. Measured: H0 bottleneck distances
recover the five states exactly (adjusted Rand index 1.0) and the silhouette picks k = 5 (0.86; next best 0.76);
the H1 bottleneck distance follows remeasurement noise (ARI 0.03, as homology.py explains), max(H0, H1) reaches
0.59, and standardised `homology.features` vectors 0.71 (their 24 H1 Betti-curve coordinates are noise that the
standardisation blows up to the weight of the H0 ones).

Classifier: nearest centroid over `homology.features` without the H1 Betti curve (the H0 Betti curve, then total
persistence and entropy of H0 and H1 and the scale cap), each coordinate divided by its pooled spread inside the
classes, so that it costs tens of microseconds and no gudhi call. Measured held-out accuracy 1.0 (20 of 20, also
with only 4 book snapshots per state); with the H1 curve kept it fell to 0.8-0.9. Over other swarm seeds and sizes
(150-1,000 nodes) accuracy was 0.8-1.0: on one 150-node swarm the silhouette merged two states into four classes,
on one 200-node swarm some held-out "transatlantic slow" snapshots were misread (0.87).

Schemas. A schema must apply to a snapshot whose node set differs (nodes come and go, and peer ids say nothing
about capacity), so it is a template by capacity class: per span length (what fits a node's memory), the starts
that `sharding.balancing.best_placement` gave the nodes of that length, fastest first. Applying it, the nodes of
each length, fastest first (ties by place and link, never by peer id, so relabelling the nodes relabels the
assignment and nothing else), take the template's starts by throughput rank (quantile mapping when the counts
differ); nodes of a length the template lacks join afterwards by balancing's joining rule. Each class keeps, of
its snapshots' best placements, the template that does best averaged over all of the class's snapshots. If the
applied schema leaves any block without a server, it is dropped and `best_placement` recomputes
(`Assignment.recomputed`). Measured: the picked template's bottleneck throughput is 0.988 of recomputing on average,
0.971 at worst (200 nodes; 0.996 and 0.992 at 1,000 nodes, bench/topology.py), in ~0.3 ms against ~30 ms (1 ms
against 330 ms at 1,000 nodes); a wrong class's template as little as 0.62 (Asia's schema with Asia back up), so
the classifier matters; after a misread class the worst seen was 0.89.

Far from every class. The nearest centroid always names some class, also for a state the book never saw; then its
template is a guess. The book keeps a radius, FAR_FACTOR times the largest distance of one of its own snapshots to
its class's centroid, and a snapshot further than that from every centroid is far: `apply_schema` recomputes.
Measured, leaving each of the five states out of a book of the other four (bench/topology.py `novelty`): held-out
snapshots of the known states lay within 1.14x the largest member distance at 200 nodes and 1.18x at 1,000; those of
the state left out at 1.28x and beyond at 200 nodes (all up or transatlantic slow left out: the two closest states),
7x and beyond at 1,000. A false "far" only costs a recomputation, so the factor sits nearer the known side. (The
scaled distance of a typical member is about sqrt(#coordinates), ~5.4, by construction of the scale.) Rejected: shares of throughput per start
summed over the class (the best placements of different snapshots are shifted tilings, and their sum is no tiling:
0.37-0.65 of recomputing). Recomputing is itself cheap here (balancing's objective is the bottleneck throughput
alone, and the joining rule alone reaches ~0.997 of it); the schema's gain is the time, ~30x to ~300x.

Pure: numpy over frozen snapshots; gudhi only through homology.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.sharding.balancing import (
    Placement,
    best_placement,
    join_span,
    placement_from_snapshot,
    served_throughput,
    swarm_throughput,
)
from nesa_node.topology.graph import swarm_graph
from nesa_node.topology.homology import FEATURE_GRID_MS, Diagrams, bottleneck_distances, diagrams, features

CLASS_CANDIDATES = tuple(range(2, 9))  # numbers of classes tried when none is given (guess: a handful of states)
RESTARTS = 8  # k-medoids restarts from seeded k-medoids++ starts (measured: 4 already found the best on 40 rows)
SCALE_FLOOR = 1e-6  # a coordinate that never varies inside a class is compared unscaled, not divided by zero
FAR_FACTOR = 1.2  # radius over the largest member distance (measured: known states <= 1.18x, unknown >= 1.28x)
BOOK_FORMAT = "nesa-schema-book/1"
MAX_CLASSES = 256  # a book file with more is refused (CLASS_CANDIDATES build at most 8)
_GRID = len(FEATURE_GRID_MS)
# homology.features layout: H0 Betti curve, H1 Betti curve, (total persistence, entropy) of H0 and H1, cap
CLASSIFIER_COORDINATES = tuple(range(_GRID)) + tuple(range(2 * _GRID, 2 * _GRID + 5))

__all__ = [
    "CLASSIFIER_COORDINATES",
    "Assignment",
    "Schema",
    "SchemaBook",
    "apply_schema",
    "book_from_dict",
    "book_to_dict",
    "bottleneck_throughput",
    "build_book",
    "classify",
    "cluster_diagrams",
    "h0_distances",
    "k_medoids",
    "schema_placement",
    "silhouette",
]


@dataclass(frozen=True, eq=False)
class Schema:
    """One topology class and its template."""

    label: int
    centroid: np.ndarray  # (c,) mean of the class's classifier coordinates
    lengths: tuple[int, ...]  # span lengths in the template, ascending
    starts: tuple[np.ndarray, ...]  # per length, the start block of each template node, fastest node first
    throughput_tps: float  # median bottleneck throughput of the class's best placements, tokens/s
    fit: float  # mean over the class's snapshots of (template's T) / (best_placement's T)
    snapshots: int  # how many snapshots the class was built from

    def template(self, length: int) -> np.ndarray | None:
        for known, starts in zip(self.lengths, self.starts, strict=True):
            if known == length:
                return starts
        return None


@dataclass(frozen=True, eq=False)
class SchemaBook:
    """The precomputed schemas of one model (num_blocks, demand) and the classifier's scaling."""

    num_blocks: int
    demand: np.ndarray  # (num_blocks,) relative traffic per block
    scale: np.ndarray  # (c,) pooled spread inside the classes of each classifier coordinate, >= SCALE_FLOOR
    schemas: tuple[Schema, ...]
    radius: float = math.inf  # scaled distance past which a snapshot is far from every class (inf: never far)

    def knows(self, distance: float) -> bool:
        """Whether a snapshot at this scaled distance from its nearest centroid is of a class the book holds."""
        return distance <= self.radius


@dataclass(frozen=True, eq=False)
class Assignment:
    """Where each serving node of a snapshot should start its span."""

    label: int  # the class the classifier picked
    distance: float  # scaled feature distance from the snapshot to that class's centroid
    placement: Placement  # serving nodes sorted by peer id, with their new starts
    recomputed: bool  # far from every class, or the schema would have left a block unserved: best_placement ran
    far: bool = False  # the snapshot is further than the book's radius from every class

    @property
    def starts(self) -> dict[str, int]:
        return dict(zip(self.placement.peer_ids, (int(value) for value in self.placement.start), strict=True))

    @property
    def throughput_tps(self) -> float:
        """Bottleneck throughput T = min_b served_b / demand_b of the assignment (eq. 3's objective), tokens/s."""
        return bottleneck_throughput(self.placement)


def bottleneck_throughput(placement: Placement) -> float:
    """T = min_b served_b / demand_b, tokens/s (0 when a block has no server)."""
    served, _ = served_throughput(placement.num_blocks, placement.start, placement.length, placement.throughput)
    return swarm_throughput(served, placement.demand)


def _pairwise(rows: np.ndarray) -> np.ndarray:
    squared = (rows**2).sum(axis=1)
    return np.sqrt(np.maximum(squared[:, None] + squared[None] - 2 * rows @ rows.T, 0.0))


def k_medoids(
    distances: np.ndarray, classes: int, *, rng: np.random.Generator, restarts: int = RESTARTS
) -> tuple[np.ndarray, np.ndarray]:
    """(labels (n,), medoid indices (classes,)) minimising the summed distance of each point to its medoid.

    Alternating k-medoids (assign to the nearest medoid, move each medoid to its cluster's most central member)
    from `restarts` k-medoids++ starts drawn from `rng`; the cheapest result wins. Labels are numbered by each
    cluster's first member, so equal partitions get equal labels. Raises ValueError unless 1 <= classes <= n."""
    distances = np.asarray(distances, np.float64)
    count = distances.shape[0]
    if not 1 <= classes <= count:
        raise ValueError(f"classes must be in [1, {count}], got {classes}")
    best_cost, best_medoids = np.inf, None
    for _ in range(max(restarts, 1)):
        medoids = [int(rng.integers(count))]
        while len(medoids) < classes:
            weight = distances[:, medoids].min(axis=1) ** 2
            total = weight.sum()
            pick = rng.choice(count, p=weight / total) if total > 0 else rng.integers(count)
            medoids.append(int(pick))
        medoids = np.array(medoids)
        for _ in range(100):
            labels = np.argmin(distances[:, medoids], axis=1)
            moved = medoids.copy()
            for cluster in range(classes):
                members = np.flatnonzero(labels == cluster)
                if members.size:
                    moved[cluster] = members[np.argmin(distances[np.ix_(members, members)].sum(axis=1))]
            if np.array_equal(moved, medoids):
                break
            medoids = moved
        cost = float(distances[np.arange(count), medoids[np.argmin(distances[:, medoids], axis=1)]].sum())
        if cost < best_cost - 1e-12:
            best_cost, best_medoids = cost, medoids
    labels = np.argmin(distances[:, best_medoids], axis=1)
    _, first = np.unique(labels, return_index=True)
    order = labels[np.sort(first)]  # old labels in order of first appearance
    renumber = np.empty(classes, np.int64)
    renumber[order] = np.arange(order.size)
    return renumber[labels], best_medoids[order]


def silhouette(distances: np.ndarray, labels: np.ndarray) -> float:
    """Mean silhouette (b - a) / max(a, b) over the points, a the mean distance to the own cluster, b to the nearest
    other one; points alone in their cluster score 0. In [-1, 1], higher: better separated classes."""
    labels = np.asarray(labels)
    clusters = np.unique(labels)
    if clusters.size < 2:
        return 0.0
    mean_to = np.stack([distances[:, labels == cluster].mean(axis=1) for cluster in clusters], axis=1)
    sizes = np.array([(labels == cluster).sum() for cluster in clusters])
    own = np.searchsorted(clusters, labels)
    rows = np.arange(labels.size)
    inside = mean_to[rows, own] * sizes[own] / np.maximum(sizes[own] - 1, 1)  # exclude the point itself
    mean_to[rows, own] = np.inf
    nearest = mean_to.min(axis=1)
    score = np.where(sizes[own] > 1, (nearest - inside) / np.maximum(np.maximum(inside, nearest), 1e-300), 0.0)
    return float(score.mean())


def h0_distances(snapshot_diagrams: Sequence[Diagrams]) -> np.ndarray:
    """(n, n) bottleneck distances between the snapshots' H0 diagrams, ms. Raises ImportError without gudhi."""
    count = len(snapshot_diagrams)
    distances = np.zeros((count, count))
    for first in range(count):
        for second in range(first + 1, count):
            value = bottleneck_distances(snapshot_diagrams[first], snapshot_diagrams[second])[0]
            distances[first, second] = distances[second, first] = value
    return distances


def cluster_diagrams(distances: np.ndarray, classes: int | None = None, *, rng: np.random.Generator) -> np.ndarray:
    """Class label of each snapshot: k-medoids on their (n, n) H0 bottleneck distances; with `classes` None, the
    number in CLASS_CANDIDATES (below n) with the best mean silhouette, ties to fewer classes. Raises ValueError
    for fewer than 2 snapshots or an impossible number of classes."""
    distances = np.asarray(distances, np.float64)
    if distances.ndim != 2 or distances.shape[0] != distances.shape[1] or distances.shape[0] < 2:
        raise ValueError("cluster_diagrams needs an (n, n) distance matrix with n >= 2")
    if classes is not None:
        return k_medoids(distances, classes, rng=rng)[0]
    candidates = [count for count in CLASS_CANDIDATES if count < distances.shape[0]]
    if not candidates:
        raise ValueError(f"need more than {min(CLASS_CANDIDATES)} snapshots to choose the number of classes")
    scored = [(k_medoids(distances, count, rng=rng)[0], count) for count in candidates]
    return max(scored, key=lambda item: (silhouette(distances, item[0]), -item[1]))[0]


def _coordinates(feature_vector: np.ndarray) -> np.ndarray:
    return np.asarray(feature_vector, np.float64)[..., list(CLASSIFIER_COORDINATES)]


def _node_table(snapshot: SwarmSnapshot, demand: np.ndarray | None) -> tuple[Placement, np.ndarray]:
    """(placement sorted by peer id, canonical order of its nodes: fastest first, ties by region, place, last mile
    and bandwidth, never by peer id)."""
    placement = placement_from_snapshot(snapshot, demand)
    arrays = snapshot.arrays
    index = np.array([arrays.peer_index[peer_id] for peer_id in placement.peer_ids], np.int64)
    nodes = [snapshot.nodes[position] for position in index]
    lat = np.array([np.nan if node.lat is None else node.lat for node in nodes], np.float64)
    lon = np.array([np.nan if node.lon is None else node.lon for node in nodes], np.float64)
    region = arrays.region[index] if index.size else np.zeros(0, np.int64)
    keys = (arrays.bandwidth_mbps[index], arrays.access_ms[index], lon, lat, region, -placement.throughput)
    return placement, np.lexsort(keys)


def schema_placement(placement: Placement, order: np.ndarray, schema: Schema) -> Placement:
    """The placement's nodes on the schema's template (module docstring): per span length, the nodes in `order`
    take the template's starts by rank, node r of m the template's entry floor((r + 1/2) k / m) of k; nodes of a
    length the template lacks then join by `balancing.join_span`, in `order`."""
    start = placement.start.copy()
    planned = np.zeros(start.size, bool)
    for length in np.unique(placement.length).tolist():
        template = schema.template(length)
        if template is None or template.size == 0:
            continue
        members = order[placement.length[order] == length]
        rank = ((np.arange(members.size) + 0.5) * template.size / members.size).astype(np.int64)
        start[members] = template[np.minimum(rank, template.size - 1)]
        planned[members] = True
    served, _ = served_throughput(
        placement.num_blocks, start[planned], placement.length[planned], placement.throughput[planned]
    )
    for node in order[~planned[order]]:
        length = int(placement.length[node])
        start[node] = join_span(served, placement.demand, length)
        served[start[node] : start[node] + length] += placement.throughput[node]
    return replace(placement, start=start)


def _template(best: Placement, order: np.ndarray) -> tuple[tuple[int, ...], tuple[np.ndarray, ...]]:
    lengths = tuple(np.unique(best.length).tolist())
    return lengths, tuple(best.start[order[best.length[order] == length]].copy() for length in lengths)


def build_book(
    snapshots: Sequence[SwarmSnapshot],
    *,
    rng: np.random.Generator,
    classes: int | None = None,
    demand: np.ndarray | None = None,
    snapshot_diagrams: Sequence[Diagrams] | None = None,
    far_factor: float = FAR_FACTOR,
) -> SchemaBook:
    """Cluster past snapshots into topology classes and keep each class's best template (module docstring).

    `snapshot_diagrams` are the snapshots' diagrams when the monitor already has them; computed otherwise. The
    book's radius is `far_factor` times the largest scaled distance of a snapshot to its class's centroid.
    Raises ValueError for fewer than 2 snapshots, snapshots of different models, a diagram count that does not
    match, or a far factor below 1."""
    if not far_factor >= 1.0:
        raise ValueError(f"far_factor must be >= 1, got {far_factor}")
    if len(snapshots) < 2:
        raise ValueError("build_book needs at least 2 snapshots")
    num_blocks = snapshots[0].num_blocks
    if any(snapshot.num_blocks != num_blocks for snapshot in snapshots):
        raise ValueError("all snapshots must be of one model (same num_blocks)")
    if snapshot_diagrams is None:
        snapshot_diagrams = [diagrams(swarm_graph(snapshot)) for snapshot in snapshots]
    if len(snapshot_diagrams) != len(snapshots):
        raise ValueError("snapshot_diagrams must hold one entry per snapshot")
    demand = np.ones(num_blocks) if demand is None else np.asarray(demand, np.float64)
    labels = cluster_diagrams(h0_distances(snapshot_diagrams), classes, rng=rng)
    rows = np.stack([_coordinates(features(entry)) for entry in snapshot_diagrams])
    tables = [_node_table(snapshot, demand) for snapshot in snapshots]
    bests = [best_placement(placement) for placement, _ in tables]
    best_tps = np.array([bottleneck_throughput(best) for best in bests])
    centroids = np.stack([rows[labels == label].mean(axis=0) for label in range(int(labels.max()) + 1)])
    scale = np.maximum(np.sqrt(np.mean((rows - centroids[labels]) ** 2, axis=0)), SCALE_FLOOR)
    schemas = []
    for label in range(centroids.shape[0]):
        members = np.flatnonzero(labels == label)
        candidates = []
        for member in members:  # each member's best placement, tried on every snapshot of the class
            lengths, starts = _template(bests[member], tables[member][1])
            schema = Schema(label, centroids[label], lengths, starts, 0.0, 0.0, int(members.size))
            ratios = [
                bottleneck_throughput(schema_placement(tables[other][0], tables[other][1], schema))
                / max(best_tps[other], 1e-300)
                for other in members
            ]
            candidates.append((float(np.mean(ratios)), lengths, starts))
        fit, lengths, starts = max(candidates, key=lambda item: item[0])  # first of equals: the earliest snapshot
        throughput = float(np.median(best_tps[members]))
        schemas.append(Schema(label, centroids[label], lengths, starts, throughput, fit, int(members.size)))
    spread = float(np.max(np.linalg.norm((rows - centroids[labels]) / scale, axis=1)))
    return SchemaBook(num_blocks, demand, scale, tuple(schemas), radius=far_factor * spread)


def _nearest(book: SchemaBook, feature_vector: np.ndarray) -> tuple[int, float]:
    """(position in book.schemas, scaled distance) of the nearest centroid; ties go to the earlier schema."""
    point = _coordinates(feature_vector) / book.scale
    centroids = np.stack([schema.centroid for schema in book.schemas]) / book.scale
    distances = np.linalg.norm(centroids - point, axis=1)
    position = int(np.argmin(distances))
    return position, float(distances[position])


def classify(book: SchemaBook, feature_vector: np.ndarray) -> tuple[int, float]:
    """(class label, scaled distance to its centroid) for a `homology.features` vector: the nearest centroid over
    CLASSIFIER_COORDINATES, each divided by its pooled spread inside the classes; ties go to the lower label."""
    position, distance = _nearest(book, feature_vector)
    return book.schemas[position].label, distance


def apply_schema(snapshot: SwarmSnapshot, book: SchemaBook, *, feature_vector: np.ndarray | None = None) -> Assignment:
    """The assignment of the schema the classifier picks for `snapshot`, or the recomputed best one if the schema
    would leave a block unserved (module docstring). `feature_vector` is the snapshot's `homology.features` when
    the monitor already has its diagrams. A snapshot further than the book's radius from every class gets the
    recomputed assignment, marked `far`. Raises ValueError when the snapshot is of another model than the book."""
    if snapshot.num_blocks != book.num_blocks:
        raise ValueError(f"the book is for {book.num_blocks} blocks, the snapshot has {snapshot.num_blocks}")
    vector = features(diagrams(swarm_graph(snapshot))) if feature_vector is None else feature_vector
    position, distance = _nearest(book, vector)
    label = book.schemas[position].label
    placement, order = _node_table(snapshot, book.demand)
    if not book.knows(distance):
        return Assignment(label, distance, best_placement(placement), recomputed=True, far=True)
    applied = schema_placement(placement, order, book.schemas[position])
    _, servers = served_throughput(applied.num_blocks, applied.start, applied.length, applied.throughput)
    if placement.start.size and np.all(servers >= 1):
        return Assignment(label, distance, applied, recomputed=False)
    return Assignment(label, distance, best_placement(placement), recomputed=True)


# ---- the book as JSON data (files are read and written by nesa_node.schema_book) -----------------------------------


def book_to_dict(book: SchemaBook) -> dict:
    """The book as JSON-ready data (`book_from_dict` reads it back exactly: floats are kept as Python floats)."""
    return {
        "format": BOOK_FORMAT,
        "num_blocks": book.num_blocks,
        "demand": [float(value) for value in book.demand],
        "scale": [float(value) for value in book.scale],
        "radius": None if math.isinf(book.radius) else float(book.radius),
        "schemas": [
            {
                "label": schema.label,
                "centroid": [float(value) for value in schema.centroid],
                "template": [
                    {"length": length, "starts": [int(value) for value in starts]}
                    for length, starts in zip(schema.lengths, schema.starts, strict=True)
                ],
                "throughput_tps": float(schema.throughput_tps),
                "fit": float(schema.fit),
                "snapshots": schema.snapshots,
            }
            for schema in book.schemas
        ],
    }


def _integer(value, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _number(value, name: str, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low}, got {value!r}")
    return float(value)


def _numbers(values, name: str, count: int, low: float) -> np.ndarray:
    if not isinstance(values, list) or len(values) != count:
        raise ValueError(f"{name} must be a list of {count} numbers")
    return np.array([_number(value, f"{name}[{index}]", low) for index, value in enumerate(values)], np.float64)


def _fields(data, name: str, required: tuple[str, ...]) -> Mapping:
    if not isinstance(data, dict):
        raise ValueError(f"{name} must be an object")
    missing = [key for key in required if key not in data]
    if missing:
        raise ValueError(f"{name} lacks {', '.join(missing)}")
    return data


def _schema_from_dict(data, index: int, num_blocks: int) -> Schema:
    name = f"schemas[{index}]"
    data = _fields(data, name, ("label", "centroid", "template", "throughput_tps", "fit", "snapshots"))
    centroid = _numbers(data["centroid"], f"{name}.centroid", len(CLASSIFIER_COORDINATES), -math.inf)
    template = data["template"]
    if not isinstance(template, list) or not 1 <= len(template) <= num_blocks:
        raise ValueError(f"{name}.template must be a list of 1 to {num_blocks} span lengths")
    lengths, starts = [], []
    for position, entry in enumerate(template):
        entry = _fields(entry, f"{name}.template[{position}]", ("length", "starts"))
        length = _integer(entry["length"], f"{name}.template[{position}].length", 1, num_blocks)
        if lengths and length <= lengths[-1]:
            raise ValueError(f"{name}.template lengths must be strictly ascending")
        values = entry["starts"]
        if not isinstance(values, list) or not 1 <= len(values) <= 1_000_000:
            raise ValueError(f"{name}.template[{position}].starts must be a non-empty list")
        top = num_blocks - length
        lengths.append(length)
        starts.append(np.array([_integer(value, f"{name} start", 0, top) for value in values], np.int64))
    return Schema(
        label=_integer(data["label"], f"{name}.label", 0, MAX_CLASSES - 1),
        centroid=centroid,
        lengths=tuple(lengths),
        starts=tuple(starts),
        throughput_tps=_number(data["throughput_tps"], f"{name}.throughput_tps"),
        fit=_number(data["fit"], f"{name}.fit"),
        snapshots=_integer(data["snapshots"], f"{name}.snapshots", 1, 10**9),
    )


def book_from_dict(data) -> SchemaBook:
    """The book `book_to_dict` wrote. Every field is checked (types, finite numbers, spans inside the model, unique
    labels); raises ValueError naming the first field that is wrong."""
    data = _fields(data, "the book", ("format", "num_blocks", "demand", "scale", "radius", "schemas"))
    if data["format"] != BOOK_FORMAT:
        raise ValueError(f"format must be {BOOK_FORMAT!r}, got {data['format']!r}")
    num_blocks = _integer(data["num_blocks"], "num_blocks", 1, 100_000)
    demand = _numbers(data["demand"], "demand", num_blocks, 0.0)
    if np.any(demand <= 0):
        raise ValueError("demand must be positive for every block")
    scale = _numbers(data["scale"], "scale", len(CLASSIFIER_COORDINATES), SCALE_FLOOR)
    radius = math.inf if data["radius"] is None else _number(data["radius"], "radius")
    entries = data["schemas"]
    if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_CLASSES:
        raise ValueError(f"schemas must be a list of 1 to {MAX_CLASSES} classes")
    schemas = tuple(_schema_from_dict(entry, index, num_blocks) for index, entry in enumerate(entries))
    if len({schema.label for schema in schemas}) != len(schemas):
        raise ValueError("two schemas share a label")
    return SchemaBook(num_blocks, demand, scale, schemas, radius=radius)

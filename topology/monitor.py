"""Watching the swarm's topology: snapshot history, change detection, and per-node stability (Nesa secs. 2.7.1, 3.1).

Change detection. Two measurements of an unchanged swarm still differ (pings jitter, loads move), so "changed" must
mean "further apart than repeated measurements of one swarm get". `learn_threshold` takes the diagrams of repeated
measurements of a swarm known to be unchanged, computes the bottleneck distance of every pair (the same statistic
the monitor later computes between a new snapshot and its reference) and fits, per statistic (bottleneck distance
of H0, of H1, and the distance of the feature vectors, see `snapshot_distances`), an exponential tail above the
median (peaks over threshold with a shape-0 generalised Pareto tail):

    P(distance > median + x) ~= 0.5 * exp(-x / mean_excess)   =>   threshold = median + mean_excess * ln(0.5 / alpha)

with alpha the false-alarm rate accepted per snapshot, split over the three statistics; never below the largest
distance seen in calibration. A snapshot is a change when any statistic exceeds its threshold. The reference is the last snapshot
that was a change (or the first), so slow drift adds up until it counts.

Stability (sec. 3.1: nodes in long-lived connected components are more reliable). In the single-linkage hierarchy
of the H0 filtration every merge creates a cluster that lives from that scale until it merges into a larger one.
A node's stability is the longest lifetime among the clusters of at least `min_cluster_size` nodes, short of the
whole swarm, that contain it, divided by the filtration's span (cap - least vertex value): 1 for a node whose group stays apart over the whole
range of scales, near 0 for a node that only ever sits in short-lived groups. `stable_reliability` feeds it into
R_A of eq. 18 (routing/cost.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from nesa_node.routing.snapshot import SwarmSnapshot
from nesa_node.topology.graph import SwarmGraph
from nesa_node.topology.homology import Diagrams, bottleneck_distances, features

FALSE_ALARM_RATE = 1e-3  # per snapshot: one false trigger in ~17 hours at one snapshot a minute (choice)
HISTORY = 120  # observations kept (two hours at the default one-minute announce period)
MIN_CLUSTER_SIZE = 3  # a pair of nodes is not yet a region (guess)
STABILITY_WEIGHT = 0.5  # share of the gap to full reliability a perfectly stable node closes (guess)

__all__ = [
    "ChangeThreshold",
    "MonitorState",
    "Observation",
    "learn_threshold",
    "node_stability",
    "observe",
    "snapshot_distances",
    "stable_reliability",
    "start_monitor",
    "temporal_stability",
]


@dataclass(frozen=True)
class ChangeThreshold:
    """Bottleneck distances, ms, above which a snapshot differs from its reference by more than noise."""

    h0: float
    h1: float
    features: float  # Euclidean distance of homology.features vectors (Betti curves, persistence sums)
    calibration_pairs: int = 0

    def score(self, distances: tuple[float, float, float]) -> float:
        """max over the three statistics of distance / threshold: > 1 is a change."""
        limits = (self.h0, self.h1, self.features)
        return max(distance / max(limit, 1e-12) for distance, limit in zip(distances, limits, strict=True))


def snapshot_distances(first: Diagrams, second: Diagrams) -> tuple[float, float, float]:
    """(bottleneck H0, bottleneck H1, feature distance) between two snapshots. The bottleneck distance sees one
    bar moving far; the Betti curves inside the features see many clusters vanishing at once (a regional outage),
    which the bottleneck distance can miss when other bars of similar length remain to be matched."""
    bottleneck = bottleneck_distances(first, second)
    return (*bottleneck, float(np.linalg.norm(features(first) - features(second))))


def _tail_threshold(distances: np.ndarray, false_alarm_rate: float) -> float:
    median = float(np.median(distances))
    excess = distances[distances > median] - median
    mean_excess = float(excess.mean()) if excess.size else 0.0
    return max(median + mean_excess * math.log(0.5 / false_alarm_rate), float(distances.max()))


def learn_threshold(calibration: Sequence[Diagrams], *, false_alarm_rate: float = FALSE_ALARM_RATE) -> ChangeThreshold:
    """Threshold from the diagrams of repeated measurements of one unchanged swarm (see module docstring).

    Raises ValueError with fewer than 3 measurements or a rate outside (0, 0.5)."""
    if len(calibration) < 3:
        raise ValueError("learn_threshold needs at least 3 repeated measurements")
    if not 0.0 < false_alarm_rate < 0.5:
        raise ValueError("false_alarm_rate must be in (0, 0.5)")
    pairs = [
        snapshot_distances(calibration[first], calibration[second])
        for first in range(len(calibration))
        for second in range(first + 1, len(calibration))
    ]
    distances = np.array(pairs)
    rate = false_alarm_rate / 3  # three statistics: a union bound keeps the overall rate
    return ChangeThreshold(*(_tail_threshold(distances[:, column], rate) for column in range(3)), len(pairs))


@dataclass(frozen=True)
class Observation:
    time_s: float
    distance_h0: float  # bottleneck distance to the reference, ms
    distance_h1: float
    distance_features: float
    score: float  # ChangeThreshold.score: > 1 is a change
    changed: bool


@dataclass(frozen=True)
class MonitorState:
    """Immutable: `observe` returns a new state."""

    threshold: ChangeThreshold
    reference: Diagrams | None = None
    reference_time_s: float = 0.0
    history: tuple[Observation, ...] = ()

    @property
    def last(self) -> Observation | None:
        return self.history[-1] if self.history else None


def start_monitor(threshold: ChangeThreshold) -> MonitorState:
    return MonitorState(threshold)


def observe(state: MonitorState, diagrams: Diagrams, time_s: float, *, history: int = HISTORY) -> MonitorState:
    """Compare `diagrams` (taken at `time_s`) with the reference; a change makes them the new reference. The first
    snapshot becomes the reference without being a change."""
    if state.reference is None:
        observation = Observation(time_s, 0.0, 0.0, 0.0, 0.0, False)
        return MonitorState(state.threshold, diagrams, time_s, (observation,))
    distances = snapshot_distances(state.reference, diagrams)
    score = state.threshold.score(distances)
    observation = Observation(time_s, *distances, score, score > 1.0)
    kept = (*state.history, observation)[-history:]
    if observation.changed:
        return MonitorState(state.threshold, diagrams, time_s, kept)
    return replace(state, history=kept)


def node_stability(graph: SwarmGraph, *, min_cluster_size: int = MIN_CLUSTER_SIZE) -> dict[str, float]:
    """Stability of each node in [0, 1] from the lifetimes of the H0 clusters it belongs to (module docstring)."""
    count = graph.num_nodes
    if count == 0:
        return {}
    cap = graph.scale_cap_ms
    span = max(cap - float(graph.node_delay_ms.min()), 1e-12)
    # single-linkage hierarchy over the graph's edges (Kruskal); clusters 0..n-1 are the nodes themselves
    parent_cluster = np.full(2 * count - 1, -1)
    formed = np.concatenate([graph.node_delay_ms, np.zeros(count - 1)])
    died = np.full(2 * count - 1, cap)
    size = np.concatenate([np.ones(count, np.int64), np.zeros(count - 1, np.int64)])
    owner = np.arange(count)  # union-find parent over nodes
    cluster_of_root = np.arange(count)  # current cluster id of each union-find root
    created = count

    def root(node: int) -> int:
        while owner[node] != node:
            owner[node] = owner[owner[node]]
            node = owner[node]
        return node

    for edge in np.argsort(graph.filtration, kind="stable"):
        first, second = root(int(graph.edges[edge, 0])), root(int(graph.edges[edge, 1]))
        if first == second:
            continue
        value = min(float(graph.filtration[edge]), cap)
        merged = created
        created += 1
        for side in (first, second):
            child = cluster_of_root[side]
            parent_cluster[child] = merged
            died[child] = value
        formed[merged] = value
        size[merged] = size[cluster_of_root[first]] + size[cluster_of_root[second]]
        owner[second] = first
        cluster_of_root[first] = merged
    lifetime = np.clip(np.minimum(died, cap) - np.minimum(formed, cap), 0.0, None)
    own = np.where(size >= min_cluster_size, lifetime, 0.0)
    own[size >= count] = 0.0  # belonging to the whole swarm says nothing about a node
    best = own.copy()
    for cluster in range(created - 1, -1, -1):  # parents are created after their children
        if parent_cluster[cluster] >= 0:
            best[cluster] = max(own[cluster], best[parent_cluster[cluster]])
    return {peer_id: float(min(best[index] / span, 1.0)) for index, peer_id in enumerate(graph.peer_ids)}


def temporal_stability(history: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each node's stability over time: the mean of its `node_stability` over the snapshots of `history` (oldest
    first), a snapshot it is missing from counting 0. A node whose links flap sits in a long-lived cluster in some
    snapshots and in short-lived ones (or alone) in others, so its mean falls below that of a node as fast that
    stays in its cluster; a node that comes and goes is missing from some snapshots. Nodes seen in no snapshot get
    no score. Pure; values in [0, 1]."""
    if not history:
        return {}
    peers = set().union(*(snapshot.keys() for snapshot in history))
    return {peer: sum(snapshot.get(peer, 0.0) for snapshot in history) / len(history) for peer in sorted(peers)}


def stable_reliability(
    snapshot: SwarmSnapshot, stability: dict[str, float], *, weight: float = STABILITY_WEIGHT
) -> SwarmSnapshot:
    """The snapshot with each node's R_A raised toward 1 by its stability (sec. 3.1):
    R' = R + weight * stability * (1 - R). Nodes without a stability score keep their R_A. Pure: a new snapshot.

    Raises ValueError for a weight outside [0, 1]."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError("weight must be in [0, 1]")
    nodes = tuple(
        replace(node, reliability=node.reliability + weight * stability[node.peer_id] * (1.0 - node.reliability))
        if node.peer_id in stability
        else node
        for node in snapshot.nodes
    )
    return replace(snapshot, nodes=nodes)

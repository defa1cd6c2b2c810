"""Random operation graphs and node profiles for the partitioning tests (seeded by the caller's Generator)."""

from __future__ import annotations

import numpy as np

from nesa_node.sharding.partition import NodeProfile, OperationGraph


def random_graph(rng: np.random.Generator, n: int, density: float = 0.3) -> OperationGraph:
    """A random DAG on n operations, vertex ids shuffled so index order is not a topological order."""
    relabel = rng.permutation(n)
    edges = [(int(relabel[u]), int(relabel[v])) for u in range(n) for v in range(u + 1, n) if rng.random() < density]
    return OperationGraph(
        names=tuple(f"op{index}" for index in range(n)),
        work=rng.random(n),
        size_param=rng.random(n) * 100,
        size_out=rng.random(n) * 100,
        edges=tuple(edges),
    )


def random_nodes(rng: np.random.Generator, k: int) -> list[NodeProfile]:
    """Heterogeneous nodes whose io, work and overflow terms are all of the same order."""
    return [
        NodeProfile(
            speed=float(rng.uniform(0.5, 2.0)),
            bandwidth=float(rng.uniform(50, 500)),
            fast_memory=float(rng.uniform(0, 300)),
            stream_bandwidth=float(rng.uniform(100, 1000)),
        )
        for _ in range(k)
    ]

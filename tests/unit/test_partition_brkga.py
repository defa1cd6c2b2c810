"""BRKGA over topological orders (sec. 2.6.1): never worse than the DP on Kahn's order, usually the optimum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.sharding.brkga import BrkgaSettings, brkga_partition, default_keys
from nesa_node.sharding.partition import (
    NodeProfile,
    OperationGraph,
    kahn_order,
    quotient_is_acyclic,
    set_cost,
    slice_order,
)
from tests.support.graphs import random_graph, random_nodes

SMALL_SEARCH = BrkgaSettings(population=12, generations=25, patience=8)


def set_partitions(items: list[int], max_blocks: int):
    """Every partition of `items` into at most `max_blocks` blocks (restricted growth strings)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partial in set_partitions(rest, max_blocks):
        for index in range(len(partial)):
            yield [*partial[:index], [first, *partial[index]], *partial[index + 1 :]]
        if len(partial) < max_blocks:
            yield [[first], *partial]


def brute_force_partitions(graph: OperationGraph, k: int, node: NodeProfile) -> float:
    """Eq. 11 by enumeration: the smallest bottleneck over every partition into at most k blocks whose quotient
    graph is acyclic, all blocks on identical nodes."""
    best = np.inf
    for blocks in set_partitions(list(range(graph.size)), k):
        assignment = np.empty(graph.size, dtype=np.int64)
        for index, block in enumerate(blocks):
            assignment[block] = index
        if quotient_is_acyclic(graph, assignment):
            best = min(best, max(set_cost(graph, block, node) for block in blocks))
    return best


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(1, 4))
def test_brkga_is_never_worse_than_the_dp_on_kahns_order(seed, n, k):
    rng = np.random.default_rng(seed)
    graph, nodes = random_graph(rng, n), random_nodes(rng, k)
    result = brkga_partition(graph, nodes, rng=np.random.default_rng(seed), settings=SMALL_SEARCH)
    on_default_order = slice_order(graph, kahn_order(graph), nodes).bottleneck
    assert result.default_bottleneck == pytest.approx(on_default_order, rel=1e-12)
    assert result.partition.bottleneck <= on_default_order * (1 + 1e-12)
    assert quotient_is_acyclic(graph, result.partition.assignment())
    assert list(result.history) == sorted(result.history, reverse=True)  # elitism: the best never gets worse


def test_default_keys_decode_to_kahns_order():
    graph = random_graph(np.random.default_rng(3), 20)
    assert kahn_order(graph, default_keys(graph)) == kahn_order(graph)


def test_brkga_is_deterministic_for_a_seed():
    rng = np.random.default_rng(5)
    graph, nodes = random_graph(rng, 10), random_nodes(rng, 3)
    first = brkga_partition(graph, nodes, rng=np.random.default_rng(9), settings=SMALL_SEARCH)
    second = brkga_partition(graph, nodes, rng=np.random.default_rng(9), settings=SMALL_SEARCH)
    assert first == second


def test_brkga_matches_brute_force_over_all_partitions_in_most_seeds(capsys):
    """Tiny graphs (5-7 operations, k = 2 or 3): the optimum over every acyclic partition, not only slicings of
    one order. The match rate is printed; BRKGA is a heuristic, so the bar is most seeds, not all."""
    node = NodeProfile(bandwidth=200.0, fast_memory=150.0, stream_bandwidth=500.0)
    matches, cases = 0, 0
    for seed in range(20):
        rng = np.random.default_rng(1000 + seed)
        n, k = int(rng.integers(5, 8)), int(rng.integers(2, 4))
        graph = random_graph(rng, n, density=0.35)
        optimum = brute_force_partitions(graph, k, node)
        found = brkga_partition(graph, [node] * k, rng=np.random.default_rng(seed), settings=SMALL_SEARCH)
        assert found.partition.bottleneck >= optimum * (1 - 1e-9)  # brute force is a true lower bound
        matches += found.partition.bottleneck <= optimum * (1 + 1e-9)
        cases += 1
    with capsys.disabled():
        print(f"\nBRKGA matched the brute-force optimum in {matches}/{cases} tiny graphs")
    assert matches >= 0.8 * cases

"""MTPP partitioning (eq. 8-11, Algorithm 1): costs, the reference and fast DPs, Kahn's order, quotient check."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.sharding.partition import (
    NodeProfile,
    OperationGraph,
    kahn_order,
    partition_from_ends,
    quotient_is_acyclic,
    set_cost,
    slice_order,
    slice_order_reference,
    uniform_partition,
    validate_order,
)
from tests.support.graphs import random_graph, random_nodes


def brute_force_slicings(graph: OperationGraph, order, nodes) -> float:
    """Smallest bottleneck over every slicing of `order` into 1..len(nodes) contiguous segments."""
    n, best = len(order), math.inf
    for count in range(1, min(len(nodes), n) + 1):
        for cuts in itertools.combinations(range(1, n), count - 1):
            best = min(best, partition_from_ends(graph, order, (*cuts, n), nodes).bottleneck)
    return best


graph_cases = st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(graph_cases)
def test_dp_equals_brute_force_over_slicings(case):
    seed, n, k = case
    rng = np.random.default_rng(seed)
    graph, nodes = random_graph(rng, n), random_nodes(rng, k)
    order = kahn_order(graph)
    expected = brute_force_slicings(graph, order, nodes)
    reference = slice_order_reference(graph, order, nodes)
    fast = slice_order(graph, order, nodes)
    assert reference.bottleneck == pytest.approx(expected, rel=1e-9)
    assert fast.bottleneck == pytest.approx(expected, rel=1e-9)
    assert len(fast.ends) <= k and fast.ends[-1] == n


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(13, 60), st.integers(1, 8))
def test_fast_dp_equals_reference_on_larger_graphs(seed, n, k):
    rng = np.random.default_rng(seed)
    graph, nodes = random_graph(rng, n, density=0.1), random_nodes(rng, k)
    order = kahn_order(graph, rng.random(n))
    assert slice_order(graph, order, nodes).bottleneck == pytest.approx(
        slice_order_reference(graph, order, nodes).bottleneck, rel=1e-9
    )


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 30), st.integers(1, 6))
def test_every_returned_partition_has_an_acyclic_quotient(seed, n, k):
    rng = np.random.default_rng(seed)
    graph, nodes = random_graph(rng, n), random_nodes(rng, k)
    order = kahn_order(graph, rng.random(n))
    for partition in (
        slice_order(graph, order, nodes),
        uniform_partition(graph, order, nodes, np.ones(n)),
        uniform_partition(graph, order, nodes, graph.size_param),
    ):
        assert quotient_is_acyclic(graph, partition.assignment())
        assert sorted(itertools.chain(*partition.segments)) == list(range(n))
        assert partition.costs == pytest.approx(
            [set_cost(graph, segment, node) for segment, node in zip(partition.segments, nodes, strict=False)]
        )


def test_quotient_check_finds_a_cycle():
    graph = OperationGraph(names=("a", "b", "c"), work=[1, 1, 1], size_param=[0] * 3, size_out=[1] * 3,
                           edges=((0, 1), (1, 2)))  # fmt: skip
    assert quotient_is_acyclic(graph, [0, 1, 1])
    assert not quotient_is_acyclic(graph, [0, 1, 0])  # a and c together, b apart: 0 -> 1 -> 0


def test_costs_of_a_chain_by_hand():
    """Chain a -> b -> c, 10-byte outputs, bandwidth 10 B/s, speed 2, 25 bytes of fast memory streamed at 5 B/s."""
    graph = OperationGraph(
        names=("a", "b", "c"), work=[2.0, 4.0, 6.0], size_param=[0.0, 20.0, 0.0], size_out=[10.0, 10.0, 10.0],
        edges=((0, 1), (1, 2)),
    )  # fmt: skip
    node = NodeProfile(speed=2.0, bandwidth=10.0, fast_memory=25.0, stream_bandwidth=5.0)
    # {b}: in 10 B (1 s) + work 2 s + overflow (20 param + 20 working set - 25) / 5 = 3 s + out 10 B (1 s)
    assert set_cost(graph, [1], node) == pytest.approx(7.0)
    # {a, b}: work 3 s + overflow (20 + 20 - 25) / 5 = 3 s + out 1 s
    assert set_cost(graph, [0, 1], node) == pytest.approx(7.0)
    # {a, b, c} on one node: work 6 s + overflow 3 s, nothing crosses
    assert set_cost(graph, [0, 1, 2], node) == pytest.approx(9.0)
    partition = slice_order(graph, (0, 1, 2), [node, node])
    # best of {a}|{b,c} = max(1 + 1, 1 + 5 + 3) = 9 and {a,b}|{c} = max(7, 1 + 3 + 0) = 7
    assert partition.ends == (2, 3) and partition.bottleneck == pytest.approx(7.0)


def test_heterogeneous_nodes_cost_each_segment_on_its_own_node():
    graph = OperationGraph(names=("a", "b"), work=[4.0, 4.0], size_param=[0, 0], size_out=[0, 0], edges=((0, 1),))
    slow, fast = NodeProfile(speed=1.0), NodeProfile(speed=4.0)
    assert slice_order(graph, (0, 1), [slow, fast]).costs == pytest.approx((4.0, 1.0))
    # at most k segments: all of it on the fast node (2 s) beats splitting onto the slow one (max(1, 4) s)
    assert slice_order(graph, (0, 1), [fast, slow]).costs == pytest.approx((2.0,))


def test_kahn_order_follows_priorities_and_rejects_cycles():
    graph = OperationGraph(names=tuple("abcd"), work=[1] * 4, size_param=[0] * 4, size_out=[1] * 4,
                           edges=((0, 1), (0, 2), (1, 3), (2, 3)))  # fmt: skip
    assert kahn_order(graph) == (0, 1, 2, 3)
    assert kahn_order(graph, np.array([0.9, 0.8, 0.1, 0.0])) == (0, 2, 1, 3)
    with pytest.raises(ValueError, match="not topological"):
        validate_order(graph, (0, 3, 1, 2))
    with pytest.raises(ValueError, match="cycle"):
        OperationGraph(names=("a", "b"), work=[1, 1], size_param=[0, 0], size_out=[1, 1], edges=((0, 1), (1, 0)))
    with pytest.raises(ValueError, match="non-negative"):
        OperationGraph(names=("a",), work=[-1.0], size_param=[0], size_out=[1], edges=())

"""Persistent homology of the swarm graph (nesa_node.topology.graph, homology): golden shapes, invariances."""

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.routing.scenarios import SCENARIOS
from nesa_node.routing.simulate import Simulator
from nesa_node.topology.graph import point_graph, swarm_graph
from nesa_node.topology.homology import (
    betti_curve,
    bottleneck_distances,
    diagrams,
    features,
    h0_from_graph,
    persistence_entropy,
    total_persistence,
)


def lengths(diagram):
    return np.sort(diagram[:, 1] - diagram[:, 0])[::-1]


def test_points_on_a_circle_give_one_long_h1_bar_with_the_known_birth_and_death():
    radius, count = 10.0, 24
    angle = np.arange(count) * 2 * np.pi / count
    circle = radius * np.column_stack([np.cos(angle), np.sin(angle)])
    result = diagrams(point_graph(circle, neighbours=count - 1))  # all pairs: the full Rips complex
    assert len(result.h1) == 1
    birth, death = result.h1[0]
    # born when neighbours touch (half a side of the 24-gon), dies when the inscribed triangle fills (r sqrt(3) / 2)
    assert birth == pytest.approx(radius * np.sin(np.pi / count), rel=1e-9)
    assert death == pytest.approx(radius * np.sqrt(3) / 2, rel=1e-9)
    assert lengths(result.h0)[1] < 0.2 * (death - birth)  # one connected ring, no long H0 bar but the swarm's


def test_a_noisy_circle_in_a_sparse_graph_keeps_one_long_h1_bar():
    rng = np.random.default_rng(3)
    angle = rng.uniform(0, 2 * np.pi, 80)
    circle = 10 * np.column_stack([np.cos(angle), np.sin(angle)]) + rng.normal(0, 0.2, (80, 2))
    result = diagrams(point_graph(circle, neighbours=60))  # enough chords to fill the disc
    bars = lengths(result.h1)
    assert bars[0] > 5.0 and (bars.size == 1 or bars[1] < 1.0)


@pytest.mark.parametrize("clusters", [2, 3, 5])
def test_separated_clusters_give_that_many_long_h0_bars(clusters):
    rng = np.random.default_rng(clusters)
    centres = 100 * np.column_stack([np.arange(clusters), np.arange(clusters) % 2])
    points = np.concatenate([rng.normal(0, 1, (25, 2)) + centre for centre in centres])
    bars = lengths(diagrams(point_graph(points)).h0)
    assert (bars > 20).sum() == clusters
    assert bars[clusters:].max(initial=0) < 5


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 40), st.integers(1, 6), st.integers(0, 2**31 - 1), st.booleans())
def test_union_find_h0_equals_gudhi_h0(count, neighbours, seed, weighted):
    rng = np.random.default_rng(seed)
    points = rng.normal(0, 10, (count, 2))
    delay = rng.uniform(0, 5, count) if weighted else None
    graph = point_graph(points, delay, neighbours=neighbours)
    ours, theirs = h0_from_graph(graph), diagrams(graph).h0
    assert np.allclose(np.sort(ours, axis=0), np.sort(theirs, axis=0))


@settings(max_examples=20, deadline=None)
@given(st.integers(3, 40), st.integers(0, 2**31 - 1))
def test_edge_collapse_keeps_the_diagrams(count, seed):
    rng = np.random.default_rng(seed)
    graph = point_graph(rng.normal(0, 10, (count, 2)), rng.uniform(0, 3, count), neighbours=6)
    collapsed, full = diagrams(graph), diagrams(graph, collapse=False)
    for dimension in (0, 1):
        assert np.allclose(np.sort(collapsed.dimension(dimension), axis=0), np.sort(full.dimension(dimension), axis=0))


@pytest.fixture(scope="module")
def snapshot():
    scenario = replace(SCENARIOS["global-1000"], num_nodes=150, duration_s=600)
    return Simulator(scenario).snapshot(300.0)


@pytest.mark.parametrize("located", [True, False])
def test_relabelling_and_reordering_nodes_leaves_the_diagrams_unchanged(snapshot, located):
    if not located:
        snapshot = replace(snapshot, nodes=tuple(replace(node, lat=None, lon=None) for node in snapshot.nodes))
    order = np.random.default_rng(0).permutation(len(snapshot.nodes))
    renamed = tuple(replace(snapshot.nodes[index], peer_id=f"peer-{position}") for position, index in enumerate(order))
    first, second = diagrams(swarm_graph(snapshot)), diagrams(swarm_graph(replace(snapshot, nodes=renamed)))
    for dimension in (0, 1):
        assert np.allclose(np.sort(first.dimension(dimension), axis=0), np.sort(second.dimension(dimension), axis=0))
    assert max(bottleneck_distances(first, second)) < 1e-9
    assert swarm_graph(snapshot).embedding == ("geographic" if located else "latency-mds")


def test_the_swarm_graph_is_connected_and_carries_the_measured_links(snapshot):
    graph = swarm_graph(snapshot)
    network = graph.to_networkx()
    import networkx as nx

    assert nx.is_connected(network) and network.number_of_nodes() == len(snapshot.nodes)
    edge = next(iter(network.edges(data=True)))[2]
    assert edge["latency_ms"] > 0 and edge["bandwidth_mbps"] > 0 and edge["filtration"] > 0
    assert np.all(graph.filtration >= np.maximum(*graph.node_delay_ms[graph.edges.T]) - 1e-12)
    # the continents separate: several H0 bars outlive every intra-city merge
    assert (lengths(diagrams(graph).h0) > 10).sum() >= 3


def test_summary_features():
    diagram = np.array([[0.0, 2.0], [1.0, 3.0], [0.0, 4.0]])
    assert total_persistence(diagram) == pytest.approx(8.0)
    assert persistence_entropy(np.array([[0.0, 1.0]] * 4)) == pytest.approx(np.log(4))
    assert persistence_entropy(np.zeros((0, 2))) == 0.0
    assert betti_curve(diagram, (0.5, 1.5, 3.5, 5.0)).tolist() == [2, 3, 1, 0]


def test_features_and_distances_see_a_change(snapshot):
    full = diagrams(swarm_graph(snapshot))
    europe_only = replace(snapshot, nodes=tuple(node for node in snapshot.nodes if node.region < 7))
    smaller = diagrams(swarm_graph(europe_only))
    assert max(bottleneck_distances(full, full)) < 1e-9
    assert bottleneck_distances(full, smaller)[0] > 5.0
    assert np.linalg.norm(features(full) - features(smaller)) > 1.0
    with pytest.raises(ValueError):
        full.dimension(2)


def test_bad_points_are_rejected():
    with pytest.raises(ValueError):
        point_graph(np.zeros((3, 4)))
    with pytest.raises(ValueError):
        point_graph(np.zeros((3, 2)), np.array([1.0, -1.0, 0.0]))
    with pytest.raises(ValueError):
        swarm_graph(Simulator(replace(SCENARIOS["continent-200"], num_nodes=10)).snapshot(0.0), neighbours=0)

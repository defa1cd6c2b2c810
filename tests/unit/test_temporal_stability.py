"""Stability over a history of snapshots (topology/monitor.py temporal_stability) and the client's tracker of it
(client/stability.py): pure, property-tested."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nesa_node.client.stability import StabilityTracker
from nesa_node.routing.snapshot import NodeView, SwarmSnapshot
from nesa_node.topology.monitor import stable_reliability, temporal_stability

PEERS = st.sampled_from(["a", "b", "c", "d"])
SNAPSHOT = st.dictionaries(PEERS, st.floats(0.0, 1.0), max_size=4)


@given(st.lists(SNAPSHOT, min_size=1, max_size=12))
def test_values_are_means_within_0_and_1_and_missing_snapshots_count_zero(history):
    result = temporal_stability(history)
    assert set(result) == set().union(*(snapshot.keys() for snapshot in history))
    for peer, value in result.items():
        assert 0.0 <= value <= 1.0
        assert abs(value - sum(snapshot.get(peer, 0.0) for snapshot in history) / len(history)) < 1e-12


@given(SNAPSHOT, st.integers(1, 10))
def test_an_unchanging_swarm_keeps_its_stability(snapshot, repeats):
    result = temporal_stability([snapshot] * repeats)
    assert set(result) == set(snapshot)
    assert all(abs(result[peer] - value) < 1e-12 for peer, value in snapshot.items())


def test_a_flapping_node_ends_below_a_steady_one():
    history = [{"steady": 0.9, "flapper": 0.9 if index % 2 else 0.0} for index in range(10)]
    result = temporal_stability(history)
    assert result["flapper"] < result["steady"] - 0.4
    assert temporal_stability([]) == {}


def snapshot() -> SwarmSnapshot:
    nodes = tuple(
        NodeView(peer, 0, 4, inference_tps=10.0, reliability=0.2, lat=lat, lon=lon)
        for peer, lat, lon in [("a", 50.1, 8.7), ("b", 50.11, 8.7), ("c", 50.12, 8.7), ("d", 40.7, -74.0)]
    )
    return SwarmSnapshot(num_blocks=4, nodes=nodes, hidden_size=64)


def test_the_tracker_keeps_a_snapshot_per_period_and_changes_nothing_before_enough_history():
    tracker = StabilityTracker(weight=0.5, period_s=10.0, min_history=3)
    view = snapshot()
    for second in (0.0, 1.0, 5.0, 10.0, 10.5, 20.0):
        tracker.observe(view, second)
        if len(tracker.history) < 3:
            assert tracker.apply(view) == view
    assert len(tracker.history) == 3  # at 0, 10 and 20 s
    assert tracker.apply(view) == stable_reliability(view, tracker.stability(), weight=0.5)
    off = StabilityTracker(weight=0.0, period_s=1.0, min_history=1)
    off.observe(view, 0.0)
    assert off.apply(view) == view and not off.history

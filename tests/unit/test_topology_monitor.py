"""Change detection, node stability and trigger policies (nesa_node.topology.monitor, triggers)."""

from dataclasses import replace

import numpy as np
import pytest

from nesa_node.routing.scenarios import SCENARIOS, City, ClusterJoin, LinkDegradation, Outage
from nesa_node.routing.simulate import Simulator
from nesa_node.sharding.balancing import Placement
from nesa_node.topology.graph import point_graph, swarm_graph
from nesa_node.topology.homology import diagrams
from nesa_node.topology.monitor import (
    learn_threshold,
    node_stability,
    observe,
    stable_reliability,
    start_monitor,
)
from nesa_node.topology.triggers import (
    HomologyTrigger,
    LoadVariationTrigger,
    PeriodicTrigger,
    TriggerInput,
    load_variation,
)

# a global swarm of 300 nodes, no churn: cities 0-6 Europe, 7-11 North America, 12-16 Asia
UNCHANGED = replace(SCENARIOS["global-1000"], name="global-300-still", num_nodes=300, duration_s=3 * 3600)
EVENT_S = 600.0
SEEN_S = EVENT_S + 300.0  # the first announce tick after the records of the nodes that left expired (ttl 190 s)
EVENTS = {
    "asia offline": {"outages": (Outage((12, 13, 14, 15, 16), EVENT_S),)},
    "cluster joins": {"joins": (ClusterJoin(City("Sao Paulo", -23.5, -46.6), 30, EVENT_S),)},
    "transatlantic link degrades": {
        "degradations": (LinkDegradation((0, 1, 2, 3, 4, 5, 6), (7, 8, 9, 10, 11), 4.0, EVENT_S),)
    },
}


def topology(snapshot):
    return diagrams(swarm_graph(snapshot))


@pytest.fixture(scope="module")
def calibrated():
    simulator = Simulator(UNCHANGED)
    return simulator, learn_threshold([topology(simulator.snapshot(0.0, remeasure_seed=seed)) for seed in range(20)])


def test_no_trigger_in_100_noisy_snapshots_of_an_unchanged_swarm(calibrated):
    simulator, threshold = calibrated
    state = start_monitor(threshold)
    for tick in range(100):
        time_s = tick * UNCHANGED.announce_period_s
        state = observe(state, topology(simulator.snapshot(time_s, remeasure_seed=1000 + tick)), time_s)
    assert len(state.history) == 100
    assert not any(observation.changed for observation in state.history)
    assert max(observation.score for observation in state.history) > 0.05  # the noise is real, not zero


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_a_topology_change_triggers_within_one_snapshot(calibrated, event):
    simulator, threshold = calibrated
    changed = Simulator(replace(UNCHANGED, **EVENTS[event]))
    state = observe(start_monitor(threshold), topology(simulator.snapshot(0.0, remeasure_seed=7)), 0.0)
    state = observe(state, topology(changed.snapshot(EVENT_S - 60.0, remeasure_seed=8)), EVENT_S - 60.0)
    assert not state.last.changed  # before the event
    state = observe(state, topology(changed.snapshot(SEEN_S, remeasure_seed=9)), SEEN_S)
    assert state.last.changed and state.reference_time_s == SEEN_S


def test_threshold_needs_repeated_measurements():
    graph = point_graph(np.random.default_rng(0).normal(0, 1, (10, 2)))
    with pytest.raises(ValueError):
        learn_threshold([diagrams(graph)] * 2)
    with pytest.raises(ValueError):
        learn_threshold([diagrams(graph)] * 3, false_alarm_rate=0.7)


def test_nodes_of_tight_lasting_clusters_are_the_most_stable():
    rng = np.random.default_rng(1)
    tight = np.concatenate([rng.normal(0, 0.5, (20, 2)), rng.normal(0, 0.5, (20, 2)) + (60, 0)])
    scattered = rng.uniform(-30, 90, (10, 2)) + (0, 80)
    graph = point_graph(np.concatenate([tight, scattered]))
    stability = node_stability(graph)
    values = np.array([stability[str(index)] for index in range(50)])
    assert np.all((values >= 0) & (values <= 1))
    assert values[:40].min() > values[40:].max()


def test_stability_raises_reliability_within_bounds():
    snapshot = Simulator(replace(UNCHANGED, num_nodes=60)).snapshot(0.0)
    stability = node_stability(swarm_graph(snapshot))
    adjusted = stable_reliability(snapshot, stability, weight=0.5)
    before = np.array([node.reliability for node in snapshot.nodes])
    after = np.array([node.reliability for node in adjusted.nodes])
    assert np.all(after >= before) and np.all(after <= 1.0) and np.any(after > before)
    assert stable_reliability(snapshot, stability, weight=0.0) == snapshot
    with pytest.raises(ValueError):
        stable_reliability(snapshot, stability, weight=1.5)


def placement(start, length, throughput, blocks=8):
    count = len(start)
    return Placement(
        blocks,
        np.array(start),
        np.array(length),
        np.array(throughput, float),
        np.ones(count, bool),
        np.ones(blocks),
    )


def test_periodic_trigger_fires_once_per_period():
    trigger, state, fired = PeriodicTrigger(period_s=120.0), PeriodicTrigger().start(), []
    snapshot = Simulator(replace(UNCHANGED, num_nodes=20)).snapshot(0.0)
    even = placement([0, 4], [4, 4], [1.0, 1.0])
    for time_s in range(0, 600, 60):
        state, now = trigger.step(state, TriggerInput(float(time_s), snapshot, even))
        fired.append(now)
    assert fired == [True, False, True, False, True, False, True, False, True, False]


def test_load_variation_trigger_fires_on_imbalance_only():
    snapshot = Simulator(replace(UNCHANGED, num_nodes=20)).snapshot(0.0)
    even, skewed = placement([0, 4], [4, 4], [1.0, 1.0]), placement([0, 4], [4, 4], [1.0, 5.0])
    assert load_variation(even) == pytest.approx(0.0)
    assert load_variation(placement([0], [4], [1.0])) == float("inf")  # blocks 4-7 unserved
    trigger = LoadVariationTrigger(threshold=0.3)
    assert not trigger.step(None, TriggerInput(0.0, snapshot, even))[1]
    assert trigger.step(None, TriggerInput(0.0, snapshot, skewed))[1]


def test_homology_trigger_fires_on_an_outage(calibrated):
    simulator, threshold = calibrated
    changed = Simulator(replace(UNCHANGED, **EVENTS["asia offline"]))
    trigger = HomologyTrigger(threshold)
    even = placement([0, 4], [4, 4], [1.0, 1.0])
    state, first = trigger.step(trigger.start(), TriggerInput(0.0, simulator.snapshot(0.0), even))
    state, second = trigger.step(state, TriggerInput(SEEN_S, changed.snapshot(SEEN_S), even))
    assert (first, second) == (False, True)

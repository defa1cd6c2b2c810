"""Simulated swarm life (nesa_node.topology.life) with and without a schema book (topology/adoption.py)."""

from dataclasses import replace

import numpy as np
import pytest

from nesa_node.routing.scenarios import SCENARIOS, Outage
from nesa_node.routing.simulate import Simulator
from nesa_node.topology.life import LifeConfig, calibrate, simulate_life
from nesa_node.topology.schemas import build_book
from nesa_node.topology.triggers import HomologyTrigger, PeriodicTrigger

pytestmark = pytest.mark.once  # pure simulation, no asserts of its own to strip: once, in make test's first pass

HOUR = 3600.0
ASIA = (12, 13, 14, 15, 16)
# two hours of 100 nodes; Asia is down from 0:30 to 1:30
SCENARIO = replace(
    SCENARIOS["global-1000"],
    name="global-150-asia-hour",
    num_nodes=100,
    churn_per_hour=0.0,
    duration_s=2 * HOUR,
    outages=(Outage(ASIA, 0.5 * HOUR, 1.5 * HOUR),),
)


@pytest.fixture(scope="module")
def simulator():
    return Simulator(SCENARIO)


@pytest.fixture(scope="module")
def book(simulator):
    """Snapshots of both states at other times than the ticks, with remeasurement noise."""
    times = [0.2 * HOUR, 0.35 * HOUR, 0.8 * HOUR, 1.2 * HOUR, 1.7 * HOUR, 1.9 * HOUR]
    snapshots = [simulator.snapshot(time_s + 7.0, remeasure_seed=seed) for seed, time_s in enumerate(times)]
    return build_book(snapshots, rng=np.random.default_rng(0), classes=2)


def test_life_without_a_book_is_deterministic_and_serves_every_block(simulator):
    first = simulate_life(simulator, PeriodicTrigger(600.0))
    again = simulate_life(simulator, PeriodicTrigger(600.0))
    assert np.array_equal(first.throughput_tps, again.throughput_tps) and first.moves == again.moves
    assert first.summary()["ticks_without_full_coverage"] == 0
    assert first.schema_moves == 0 and first.class_changes == 0


def test_life_following_a_book_sees_the_outage_come_and_go(simulator, book):
    trigger = HomologyTrigger(calibrate(simulator, count=8))
    result = simulate_life(simulator, trigger, book=book)
    assert result.trigger == "homology+book"
    # the first class, Asia down, Asia back (each confirmed over two snapshots)
    assert result.class_changes == 3
    assert 0 <= result.schema_moves <= result.moves
    assert result.summary()["ticks_without_full_coverage"] == 0
    # a margin no assignment can beat: the book never moves a node
    never = simulate_life(simulator, trigger, LifeConfig(schema_margin=1e9), book=book)
    assert never.schema_moves == 0


def test_a_book_of_another_model_is_refused(simulator, book):
    with pytest.raises(ValueError, match="blocks"):
        simulate_life(simulator, PeriodicTrigger(), book=replace(book, num_blocks=book.num_blocks + 1))

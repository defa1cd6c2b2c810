"""The swarm simulator, the baseline routers and the GA (nesa_node.routing.simulate, baselines, ga)."""

from dataclasses import replace
from functools import partial

import numpy as np
import pytest

from nesa_node.routing.baselines import (
    compute_rtt_load_router,
    petals_cost_partial_spans_router,
    petals_router,
    random_router,
)
from nesa_node.routing.chain import select_chain
from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.ga import evolve, tune
from nesa_node.routing.scenarios import SCENARIOS, scenario
from nesa_node.routing.simulate import FAILOVER_DETECT_MS, Simulator
from nesa_node.routing.snapshot import Chain, Hop

SMALL_GLOBAL = replace(SCENARIOS["global-1000"], name="global-300", num_nodes=300)


def ours(params=RoutingParams()):
    return lambda snapshot, request, rng: select_chain(snapshot, request, params=params)


def covers(chain, num_blocks):
    position = 0
    for hop in chain.hops:
        assert hop.start_block == position < hop.end_block
        position = hop.end_block
    return position == num_blocks


def test_the_simulator_is_reproducible():
    first, second = Simulator(SCENARIOS["continent-200"]), Simulator(SCENARIOS["continent-200"])
    requests = first.requests(5, seed=3)
    assert requests == second.requests(5, seed=3)
    assert requests != first.requests(5, seed=4)
    assert first.snapshot(600.0) == second.snapshot(600.0)
    assert np.array_equal(first.evaluate(ours(), requests), second.evaluate(ours(), requests))


def test_the_swarm_is_heterogeneous_and_covers_the_model():
    simulator = Simulator(SCENARIOS["global-1000"])
    snapshot = simulator.snapshot(300.0)
    assert len({node.region for node in snapshot.nodes}) == 17
    spans = {node.end_block - node.start_block for node in snapshot.nodes}
    assert min(spans) < 10 < 30 < max(spans)  # consumer cards and data-centre cards
    tps = [node.inference_tps for node in snapshot.nodes]
    assert max(tps) / min(tps) > 5
    coverage = np.zeros(80)
    for node in snapshot.nodes:
        coverage[node.start_block : node.end_block] += 1
    assert coverage.min() > 50
    loads = np.array([simulator.load_at(t) for t in (300.0, 3000.0)])
    assert 0.1 < loads.mean() < 0.6 and np.abs(loads[0] - loads[1]).mean() > 0.02  # load moves over time


def test_latency_grows_with_the_request_and_with_slow_or_far_nodes():
    simulator = Simulator(SCENARIOS["continent-200"])
    request = simulator.requests(1, seed=0)[0]
    snapshot = simulator.snapshot(request.time_s)
    chain = select_chain(snapshot, simulator.chain_request(request), params=RoutingParams())
    base = simulator.latency_s(chain, request)
    assert simulator.latency_s(chain, replace(request, new_tokens=request.new_tokens * 2)) > base
    assert simulator.latency_s(chain, replace(request, prompt_tokens=request.prompt_tokens * 4)) > base
    far = replace(request, client_lat=-33.9, client_lon=151.2)  # Sydney
    assert simulator.latency_s(chain, far) > base + 0.25


def test_churn_leaves_stale_records_that_cost_a_failover():
    simulator = Simulator(SCENARIOS["global-1000-churn"])
    stale = []
    for time_s in np.arange(120.0, 3600.0, 60.0):
        listed = {int(node.peer_id[4:]) for node in simulator.snapshot(time_s + 30).nodes}
        online = simulator.online(time_s + 30)
        stale += [(time_s + 30, index) for index in listed if not online[index]]
        assert online.sum() > 0.8 * online.size
    assert stale  # routers can pick nodes that are gone
    time_s, gone = stale[0]
    request = replace(simulator.requests(1, seed=0)[0], time_s=time_s)
    node = simulator.peer_ids[gone]
    start, end = int(simulator.start[gone]), int(simulator.end[gone])
    others = [i for i in range(simulator.scenario.num_nodes) if simulator.online(time_s)[i]]
    alive = next(i for i in others if (simulator.start[i], simulator.end[i]) == (start, end))
    dead_chain = Chain((Hop(node, start, end),))
    live_chain = Chain((Hop(simulator.peer_ids[alive], start, end),))
    assert simulator.latency_s(dead_chain, request) * 1000 >= FAILOVER_DETECT_MS
    assert simulator.latency_s(dead_chain, request) > simulator.latency_s(live_chain, request)


def test_every_router_returns_a_chain_covering_the_model():
    simulator = Simulator(SMALL_GLOBAL)
    rng = np.random.default_rng(0)
    for request in simulator.requests(5, seed=1):
        snapshot = simulator.snapshot(request.time_s)
        chain_request = simulator.chain_request(request)
        spans = {node.peer_id: (node.start_block, node.end_block) for node in snapshot.nodes}
        for router in (petals_router, petals_cost_partial_spans_router, compute_rtt_load_router, random_router, ours()):
            chain = router(snapshot, chain_request, rng)
            assert covers(chain, 80)
        for hop in petals_router(snapshot, chain_request).hops[:-1]:
            assert hop.end_block == spans[hop.peer_id][1]  # petals runs a server to the end of its span


def test_our_router_beats_the_baselines_on_a_small_heterogeneous_swarm():
    """A smoke check of the bench's table (bench/routing.py has the real one), on 300 nodes and 40 requests."""
    simulator = Simulator(SMALL_GLOBAL)
    requests = simulator.requests(40, seed=1)
    ours_mean = simulator.evaluate(ours(), requests).mean()
    assert ours_mean < 0.9 * simulator.evaluate(petals_router, requests).mean()
    assert ours_mean < simulator.evaluate(compute_rtt_load_router, requests).mean()
    assert ours_mean < 0.5 * simulator.evaluate(random_router, requests).mean()


def test_the_ga_finds_the_optimum_of_a_known_function():
    target = np.array([1.7, 0.6, 2.2])

    def latency(candidates):  # a bowl with its minimum at target
        return np.array([1.0 + np.sum((np.array([c.gamma, c.beta, c.alpha]) - target) ** 2) for c in candidates])

    best, history = evolve(latency, generations=40, population=30, seed=0)
    assert np.abs(np.array([best.gamma, best.beta, best.alpha]) - target).max() < 0.15
    fitness = [entry["best_fitness"] for entry in history]
    assert fitness == sorted(fitness) and fitness[-1] > fitness[0]  # elitism: the best never gets worse
    again, history_again = evolve(latency, generations=40, population=30, seed=0)
    assert again == best and history_again == history
    other, _ = evolve(latency, generations=40, population=30, seed=1)
    assert other != best


def test_tuning_on_the_simulator_is_reproducible_and_improves():
    simulator = Simulator(SMALL_GLOBAL)
    best, history = tune(simulator, generations=8, population=10, requests=5, seed=2, validation=0)  # no gate
    fitness = [entry["best_fitness"] for entry in history]
    assert fitness == sorted(fitness) and fitness[-1] > fitness[0]
    assert len(history) == 9 and best.to_dict() == history[-1]["best"]
    again, history_again = tune(simulator, generations=8, population=10, requests=5, seed=2, validation=0)
    assert (again, history_again) == (best, history)
    with pytest.raises(ValueError):
        tune(simulator, generations=1, population=1)


def test_unknown_scenarios_are_named():
    with pytest.raises(KeyError, match="continent-200"):
        scenario("mars")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["global-1000", "global-1000-churn"])
def test_tuned_routing_beats_petals_and_the_load_dp_by_ten_percent(name):
    """The acceptance target, on held-out request seeds (the bench prints the full table)."""
    simulator = Simulator(SCENARIOS[name])
    params, _ = tune(simulator, seed=0)
    held_out = simulator.requests(200, seed=1000)
    tuned = simulator.evaluate(partial(lambda p, s, r, g: select_chain(s, r, params=p), params), held_out).mean()
    assert tuned < 0.9 * simulator.evaluate(petals_router, held_out).mean()
    assert tuned < 0.9 * simulator.evaluate(compute_rtt_load_router, held_out).mean()

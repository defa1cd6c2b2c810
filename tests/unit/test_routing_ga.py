"""The GA's guarantees (nesa_node.routing.ga) and the perfect-information bound (nesa_node.routing.bound)."""

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.routing.baselines import petals_router
from nesa_node.routing.bound import best_chain, bound_latency_s, untuned_latency_s
from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.ga import GENES, evolve, paired_comparison, tune
from nesa_node.routing.scenarios import SCENARIOS
from nesa_node.routing.simulate import Simulator

SMALL_CONTINENT = replace(SCENARIOS["continent-200"], name="continent-60", num_nodes=60, duration_s=1200)


def bumpy(seed: int):
    """A deterministic objective with many local minima: a random bowl plus ripples, as a noisy fitness looks."""
    rng = np.random.default_rng(seed)
    centre, ripple, phase = rng.uniform(0.3, 2.8, 3), rng.uniform(0.0, 0.5), rng.uniform(0, 6, 3)

    def latency(candidates):
        genes = np.array([[getattr(c, gene) for gene in GENES] for c in candidates])
        return 1.0 + ((genes - centre) ** 2).sum(axis=1) + ripple * np.sin(7 * genes + phase).sum(axis=1)

    return latency


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(0, 2**16), st.integers(3, 12), st.integers(0, 4))
def test_the_ga_never_returns_worse_than_an_initial_set_and_is_deterministic(objective, seed, population, generations):
    latency = bumpy(objective)
    untuned = RoutingParams()
    best, history = evolve(latency, generations=generations, population=population, seed=seed, initial=(untuned,))
    assert latency([best])[0] <= latency([untuned])[0]
    assert history[0]["best_latency_s"] <= latency([untuned])[0]
    assert len(history) == generations + 1
    assert evolve(latency, generations=generations, population=population, seed=seed, initial=(untuned,)) == (
        best,
        history,
    )


def test_more_initial_sets_than_the_population_are_refused():
    with pytest.raises(ValueError, match="initial"):
        evolve(bumpy(0), generations=1, population=2, seed=0, initial=(RoutingParams(),) * 3)


def test_paired_comparison_accepts_only_a_gain_beyond_the_noise():
    untuned = np.array([10.0, 12.0, 9.0, 15.0, 11.0])
    clear = paired_comparison(untuned, untuned - np.array([1.0, 1.1, 0.9, 1.0, 1.05]))
    assert clear["accepted"] and clear["requests"] == 5
    assert clear["tuned_s"] == pytest.approx(untuned.mean() - 1.01)
    assert clear["paired_standard_error_s"] == pytest.approx(np.std([1.0, 1.1, 0.9, 1.0, 1.05], ddof=1) / math.sqrt(5))
    noisy = paired_comparison(untuned, untuned + np.array([-2.0, 1.5, -1.0, 1.0, -0.2]))  # lower mean, but noise
    assert noisy["tuned_s"] < noisy["untuned_s"] and not noisy["accepted"]
    assert not paired_comparison(untuned, untuned)["accepted"]  # equal is not better
    assert not paired_comparison(untuned, np.r_[untuned[:-1] - 5, math.inf])["accepted"]  # a request without chain


def test_tune_keeps_the_untuned_exponents_when_held_out_requests_do_not_confirm_the_gain():
    """Two training requests overfit: the GA's best is faster on them, but not on 40 validation requests."""
    simulator = Simulator(SMALL_CONTINENT)
    best, history = tune(simulator, generations=3, population=8, requests=2, seed=0, validation=40)
    ga_best = RoutingParams.from_dict(history[-1]["best"])
    assert ga_best != RoutingParams()
    assert history[-1]["best_latency_s"] < history[0]["population_latency_s"]
    verdict = history[-1]["validation"]
    assert verdict["requests"] == 40 and not verdict["accepted"]
    assert best == RoutingParams()
    without_gate, _ = tune(simulator, generations=3, population=8, requests=2, seed=0, validation=0)
    assert without_gate == ga_best


def test_the_perfect_information_bound_covers_the_model_and_beats_the_routers():
    simulator = Simulator(SMALL_CONTINENT)
    requests = simulator.requests(15, seed=5)
    chain = best_chain(simulator, requests[0])
    position = 0
    for hop in chain.hops:
        assert hop.start_block == position < hop.end_block
        position = hop.end_block
    assert position == SMALL_CONTINENT.model.num_blocks
    bound = bound_latency_s(simulator, requests)
    untuned = untuned_latency_s(simulator, requests)
    assert np.isfinite(bound).all()
    assert bound.mean() <= untuned.mean()
    assert bound.mean() < simulator.evaluate(petals_router, requests).mean()

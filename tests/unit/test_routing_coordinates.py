"""Last-mile latencies fitted from round trips (nesa_node.routing.coordinates): recovery, invariance, edge cases."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.routing.coordinates import combine_measurements, fit_access_ms

star_metrics = st.lists(st.floats(0.0, 80.0), min_size=3, max_size=10)


def complete(access: list[float]) -> list[tuple[str, str, float]]:
    names = [f"n{index}" for index in range(len(access))]
    return [
        (names[i], names[j], 2 * (access[i] + access[j])) for i in range(len(access)) for j in range(i + 1, len(access))
    ]


@settings(max_examples=40, deadline=None)
@given(star_metrics)
def test_a_star_metric_measured_completely_is_recovered(access):
    fit = fit_access_ms(complete(access))
    for index, value in enumerate(access):
        assert fit[f"n{index}"] == pytest.approx(value, abs=1e-3)


@settings(max_examples=25, deadline=None)
@given(star_metrics, st.randoms(use_true_random=False))
def test_the_fit_ignores_the_order_and_direction_of_measurements(access, shuffler):
    measurements = complete(access)
    flipped = [
        (second, first, rtt) if shuffler.random() < 0.5 else (first, second, rtt) for first, second, rtt in measurements
    ]
    shuffler.shuffle(flipped)
    assert fit_access_ms(flipped) == pytest.approx(fit_access_ms(measurements), abs=1e-6)


def test_a_node_slow_to_answer_gets_the_larger_last_mile():
    # a node that delays its answers by 40 ms: measured 41 ms when called, 1 ms when it calls; the larger counts
    measurements = [("client", "fast", 1.0), ("client", "slow", 41.0), ("fast", "slow", 41.0), ("slow", "fast", 1.0)]
    measurements += [("client", "other", 1.0), ("fast", "other", 1.0), ("slow", "other", 1.0)]
    fit = fit_access_ms(measurements)
    assert fit["slow"] > max(fit["fast"], fit["other"], fit["client"]) + 5.0
    assert all(value >= 0 for value in fit.values())


def test_client_only_measurements_give_each_node_its_own_share():
    fit = fit_access_ms([("client", "a", 2.0), ("client", "b", 2.0), ("client", "c", 82.0)])
    assert fit["c"] - fit["a"] == pytest.approx(40.0, abs=1e-3)
    assert fit["a"] == pytest.approx(fit["b"], abs=1e-9)


def test_bad_measurements_are_dropped_and_repeats_keep_the_largest():
    pairs = combine_measurements(
        [("a", "a", 3.0), ("a", "b", float("nan")), ("a", "b", -1.0), ("b", "a", 4.0), ("a", "b", 6.0)]
    )
    assert pairs == {("a", "b"): 6.0}
    assert fit_access_ms([]) == {}
    assert fit_access_ms([("x", "x", 5.0)]) == {}

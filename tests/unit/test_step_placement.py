"""Where a node runs a small step (server/compute.py StepPlacement): on its event loop while recent small steps
were short, on the compute thread otherwise; one slow step does not move the next ones."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nesa_node.server.compute import RECENT_STEPS, StepPlacement


def test_the_first_step_goes_to_the_compute_thread():
    assert not StepPlacement(0.015).inline()


def test_short_steps_run_inline_and_long_ones_on_the_thread():
    placement = StepPlacement(0.015)
    placement.record(0.006)
    assert placement.inline()
    for _ in range(RECENT_STEPS):
        placement.record(0.040)
    assert not placement.inline()
    for _ in range(RECENT_STEPS // 2 + 1):
        placement.record(0.006)
    assert placement.inline()  # back once most recent steps are short


def test_zero_sends_every_step_to_the_thread():
    placement = StepPlacement(0.0)
    for _ in range(RECENT_STEPS):
        placement.record(0.0)
    assert not placement.inline()


@given(
    warm=st.floats(min_value=1e-4, max_value=0.010),
    cold=st.lists(st.floats(min_value=0.016, max_value=1.0), min_size=1, max_size=RECENT_STEPS // 2),
    where=st.integers(min_value=0, max_value=RECENT_STEPS),
)
def test_a_minority_of_cold_steps_never_moves_a_warm_node_off_the_loop(warm, cold, where):
    """The first step of a new cache length on a GPU can take ten times a warm one: with fewer slow steps than half
    of the recent ones, wherever they fall, every next step stays inline (a moving average would flip)."""
    placement = StepPlacement(0.015)
    times = [warm] * RECENT_STEPS
    times[where:where] = cold
    for seconds in times:
        placement.record(seconds)
        if len(placement.recent) == RECENT_STEPS:
            assert placement.inline()

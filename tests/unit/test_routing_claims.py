"""Claims bounded by the other nodes' and replaced by measurement (routing/claims.py), and the client's per-node
timings (client/timings.py)."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.client.timings import WINDOW, NodeTimings, RoundTrips
from nesa_node.protocol.records import LinkInfo, NodeInfo, NodeState
from nesa_node.routing.chain import ChainRequest, select_chain
from nesa_node.routing.claims import (
    CLAIM_CAP,
    MIN_SAMPLES,
    OVERCLAIM_TOLERANCE,
    Measured,
    SpeedClaim,
    capped_bandwidths,
    capped_uptimes,
    medians_of_the_others,
    trusted_speeds,
)
from nesa_node.routing.cost import RoutingParams
from nesa_node.swarm_view import build_snapshot, link_measurements


def full_span(peer: str, tps: float) -> SpeedClaim:
    return SpeedClaim(peer, 0, 4, tps)


def test_a_claim_far_above_the_others_is_cut_to_a_small_multiple_of_their_median():
    claims = [full_span("a", 10.0), full_span("b", 10.0), full_span("liar", 1000.0)]
    speeds = trusted_speeds(claims, {})
    honest_ms = 1000.0 / (10.0 * 4)
    assert speeds["a"].block_ms == pytest.approx(honest_ms)
    assert speeds["liar"].block_ms == pytest.approx(honest_ms / CLAIM_CAP)


def test_an_unknown_or_zero_claim_costs_the_median_not_nothing():
    claims = [full_span("a", 10.0), full_span("b", 20.0), full_span("c", 40.0), full_span("silent", 0.0)]
    speeds = trusted_speeds(claims, {})
    assert speeds["silent"].block_ms == pytest.approx(1000.0 / (20.0 * 4))


def test_only_nodes_sharing_blocks_set_the_median():
    claims = [SpeedClaim("fast", 0, 2, 1000.0), SpeedClaim("slow", 2, 4, 1.0), SpeedClaim("peer", 0, 2, 900.0)]
    speeds = trusted_speeds(claims, {})
    assert speeds["fast"].block_ms == pytest.approx(1000.0 / (1000.0 * 2))  # within CLAIM_CAP of its block's median


def test_a_measurement_replaces_the_claim_and_an_overclaim_costs_reliability():
    claims = [full_span("a", 10.0), full_span("liar", 1000.0)]
    real_ms = 1000.0 / (10.0 * 4)
    measured = {"a": Measured(real_ms, MIN_SAMPLES), "liar": Measured(real_ms, MIN_SAMPLES)}
    speeds = trusted_speeds(claims, measured)
    assert speeds["a"].block_ms == pytest.approx(real_ms) and speeds["a"].reliability_factor == 1.0
    claimed_ms = 1000.0 / (1000.0 * 4)
    factor = OVERCLAIM_TOLERANCE * claimed_ms / real_ms
    assert speeds["liar"].reliability_factor == pytest.approx(factor)
    assert speeds["liar"].block_ms == pytest.approx(real_ms / factor)  # costed slower than it measured
    too_few = trusted_speeds(claims, {"liar": Measured(real_ms, MIN_SAMPLES - 1)})
    assert too_few["liar"].block_ms < real_ms  # not yet trusted: the bounded claim still stands


@given(
    st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=1, max_size=12),
    st.lists(st.floats(0.01, 1e4), max_size=12),
)
def test_no_claim_beats_the_cap_and_every_node_has_a_cost_once_any_claims(tps_values, measured_values):
    claims = [full_span(f"n{index}", tps) for index, tps in enumerate(tps_values)]
    measured = {f"n{index}": Measured(ms, MIN_SAMPLES) for index, ms in enumerate(measured_values)}
    speeds = trusted_speeds(claims, measured)
    known = [claim.block_ms for claim in claims if claim.block_ms is not None]
    for claim in claims:
        speed = speeds[claim.peer_id]
        assert 0.0 < speed.reliability_factor <= 1.0
        others = [other.block_ms for other in claims if other is not claim and other.block_ms is not None]
        if claim.peer_id in measured:
            assert speed.block_ms == pytest.approx(measured[claim.peer_id].block_ms / speed.reliability_factor)
        elif others:
            others.sort()
            middle = len(others) // 2
            median = others[middle] if len(others) % 2 else (others[middle - 1] + others[middle]) / 2
            assert speed.block_ms >= median / CLAIM_CAP - 1e-9
        elif known and claim.block_ms is not None:
            assert speed.block_ms == claim.block_ms


def test_uptime_claims_are_bounded_by_the_others_and_by_what_the_client_saw():
    claimed = {"a": 100.0, "b": 120.0, "liar": 1e9}
    capped = capped_uptimes(claimed, {"a": 5.0, "b": 5.0, "liar": 5.0})
    assert capped["liar"] == pytest.approx(110.0)  # the median of the others
    assert capped["a"] == 100.0
    assert capped_uptimes(claimed, {"liar": 1e4})["liar"] == 1e4  # seen that long by this client


def test_bandwidth_claims_are_bounded_by_the_others():
    capped = capped_bandwidths({"a": 100.0, "b": 100.0, "liar": 1e6})
    assert capped["liar"] == CLAIM_CAP * 100.0 and capped["a"] == 100.0


def record(peer: str, tps: float, **fields) -> NodeInfo:
    return NodeInfo(
        peer_id=peer,
        state=NodeState.online,
        start_block=0,
        end_block=4,
        dtype="float32",
        inference_tps=tps,
        cache_tokens_left=1024,
        **fields,
    )


def test_a_measured_liar_loses_to_honest_nodes_of_equal_speed():
    infos = [record("a", 10.0, uptime_s=60.0), record("b", 10.0, uptime_s=60.0), record("liar", 1000.0, uptime_s=60.0)]
    request = ChainRequest(max_length=16, prompt_tokens=4, new_tokens=8)
    seen = {peer: 60.0 for peer in ("a", "b", "liar")}
    before = select_chain(build_snapshot(infos, 4, seen_s=seen), request, params=RoutingParams())
    assert before.peer_ids == ("liar",)  # unmeasured, its bounded claim is still the fastest
    real_ms = 1000.0 / (10.0 * 4)
    measured = {"liar": Measured(real_ms, MIN_SAMPLES)}
    after = select_chain(build_snapshot(infos, 4, seen_s=seen, measured=measured), request, params=RoutingParams())
    assert after.peer_ids != ("liar",)


def test_own_open_sessions_spread_a_clients_chains_over_equal_nodes():
    infos = [record(peer, 10.0, uptime_s=60.0) for peer in ("a", "b", "c")]
    request = ChainRequest(max_length=16, prompt_tokens=4, new_tokens=8)
    sessions: dict[str, int] = {}
    for _ in range(12):
        chain = select_chain(build_snapshot(infos, 4, own_sessions=sessions), request, params=RoutingParams())
        sessions[chain.peer_ids[0]] = sessions.get(chain.peer_ids[0], 0) + 1
    assert sorted(sessions.values()) == [4, 4, 4]


def test_timings_of_a_one_node_chain_are_exact_and_a_chain_is_split_by_what_is_known():
    timings = NodeTimings()
    for _ in range(MIN_SAMPLES):
        timings.observe([("a", 4)], compute_ms=8.0, tokens=1, believed={})
    assert timings.measured()["a"] == Measured(2.0, MIN_SAMPLES)
    # a two-node chain: a is known (2 ms/block), so b is charged the rest
    timings.observe([("a", 4), ("b", 2)], compute_ms=14.0, tokens=1, believed={})
    assert timings.measured()["b"].block_ms == pytest.approx(3.0)
    # nothing known of either: split by blocks
    fresh = NodeTimings()
    fresh.observe([("x", 1), ("y", 3)], compute_ms=8.0, tokens=1, believed={})
    assert fresh.measured()["x"].block_ms == pytest.approx(2.0) and fresh.measured()["y"].block_ms == pytest.approx(2.0)


def test_a_stalled_step_moves_a_nodes_timing_by_one_rank_and_a_lasting_change_shows_within_half_the_window():
    timings = NodeTimings()
    for _ in range(WINDOW):
        timings.observe([("a", 4)], compute_ms=8.0, tokens=1, believed={})
    timings.observe([("a", 4)], compute_ms=400.0, tokens=1, believed={})  # one step held up 50x by a busy host
    assert timings.measured()["a"].block_ms == pytest.approx(2.0)
    for _ in range(WINDOW // 2):  # the node got 3x slower for good
        timings.observe([("a", 4)], compute_ms=24.0, tokens=1, believed={})
    assert timings.measured()["a"].block_ms == pytest.approx(6.0)
    assert timings.measured()["a"].samples == WINDOW + 1 + WINDOW // 2


def test_round_trips_keep_the_least_recent_ping_and_drop_old_ones():
    rtts = RoundTrips(window_s=100.0)
    rtts.add("a", 1.0, now=0.0)
    rtts.add("a", 9.0, now=50.0)  # taken at a busy moment
    rtts.add("b", 3.0, now=50.0)
    assert dict(rtts) == {"a": 1.0, "b": 3.0}
    rtts.add("a", 4.0, now=120.0)  # the 1 ms ping is older than the window
    assert rtts["a"] == 4.0
    rtts.forget("b")
    assert "b" not in rtts and rtts.get("b") is None and len(rtts) == 1


@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), max_size=40))
def test_each_values_median_of_the_others_is_that_of_the_list_without_it(values):
    expected = [statistics.median(values[:index] + values[index + 1 :]) if len(values) > 1 else None
                for index in range(len(values))]  # fmt: skip
    assert medians_of_the_others(values) == pytest.approx(expected)


def test_links_to_peers_without_a_record_neither_add_entries_nor_move_the_bandwidth_cap():
    """A record listing links to made-up peers at huge bandwidths: they do not enter the median its own claim is
    capped by (the node stays within CLAIM_CAP of the recorded nodes), nor the latency fit."""
    honest = [record(f"honest{index}", 100.0, links=(LinkInfo(peer_id="liar", rtt_ms=1.0, bandwidth_mbps=100.0),))
              for index in range(3)]  # fmt: skip
    fakes = [LinkInfo(peer_id=f"fake{index}", rtt_ms=0.1, bandwidth_mbps=1e6) for index in range(5)]
    liar = record("liar", 100.0, links=tuple(fakes))
    snapshot = build_snapshot([*honest, liar], 4)
    claimed = {node.peer_id: node.bandwidth_mbps for node in snapshot.nodes}
    assert set(claimed) == {"honest0", "honest1", "honest2", "liar"}
    assert claimed["liar"] <= CLAIM_CAP * 100.0
    assert all(pair[1] in claimed for pair in link_measurements([*honest, liar], {}))

"""Eq. 18 as implemented (nesa_node.routing.cost): golden values, monotonicity, parameter files."""

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.routing.cost import (
    RELIABILITY_MS,
    RoutingParams,
    chain_cost,
    tokens_per_pass,
)
from nesa_node.routing.ga import load_params, params_from_json, params_to_json, save_params
from nesa_node.routing.snapshot import ChainRequest, Hop, NodeView, SwarmSnapshot

HOPS = (Hop("a", 0, 2), Hop("b", 2, 4))


def snapshot(b: NodeView | None = None, backbone_ms: float = 20.0, hidden: int = 1000) -> SwarmSnapshot:
    a = NodeView("a", 0, 2, inference_tps=50.0, region=0, access_ms=1.0, bandwidth_mbps=100.0, load=0.5)
    b = b or NodeView("b", 2, 4, inference_tps=25.0, region=1, access_ms=2.0, bandwidth_mbps=10.0, reliability=0.5)
    return SwarmSnapshot(
        4, (a, b), hidden_size=hidden, element_bytes=2.0, region_latency_ms=((0.0, backbone_ms), (backbone_ms, 0.0))
    )


def test_golden_value_with_unit_exponents():
    # one token per pass, codec fp16: D = 1000 elements * 2 bytes = 16 kbit; 0.16 ms at 100 Mbit/s, 1.6 ms at 10
    request = ChainRequest(codec="fp16", client_region=0, client_access_ms=3.0)
    cost = chain_cost(snapshot(), request, RoutingParams(1.0, 1.0, 1.0), HOPS)
    client_to_a = 3.0 + 0.0 + 1.0 + 0.16  # client access + backbone + a's access + serialisation at a
    a_to_b = 0.16 + 1.0 + 20.0 + 2.0 + 1.6  # both ends' serialisation and access, plus the backbone
    b_to_client = 1.6 + 2.0 + 20.0 + 3.0
    assert cost.transfer == pytest.approx(client_to_a + a_to_b + b_to_client)
    # a: 1000 / (50 tok/s * 2 blocks) = 10 ms per block, at load 0.5 -> 20; b: 20 ms per block, idle
    assert cost.load == pytest.approx(2 * 20.0 + 2 * 20.0)
    assert cost.reliability == pytest.approx(RELIABILITY_MS / 2.0 + RELIABILITY_MS / 1.5)
    assert cost.total == pytest.approx(cost.transfer + cost.load + cost.reliability)


def test_exponents_apply_per_term():
    request = ChainRequest(codec="fp16", client_region=0, client_access_ms=3.0)
    base = chain_cost(snapshot(), request, RoutingParams(1.0, 1.0, 1.0), HOPS)
    squared = chain_cost(snapshot(), request, RoutingParams(2.0, 1.0, 1.0), HOPS)
    assert squared.load == pytest.approx(base.load) and squared.reliability == pytest.approx(base.reliability)
    legs = [3.0 + 1.0 + 0.16, 0.16 + 1.0 + 20.0 + 2.0 + 1.6, 1.6 + 2.0 + 20.0 + 3.0]
    assert squared.transfer == pytest.approx(sum(leg**2 for leg in legs))


def test_the_window_looks_back_over_more_nodes():
    nodes = snapshot().nodes + (NodeView("c", 4, 6, region=0, access_ms=1.0),)
    swarm = SwarmSnapshot(6, nodes, region_latency_ms=((0.0, 20.0), (20.0, 0.0)))
    hops = HOPS + (Hop("c", 4, 6),)
    request = ChainRequest(client_region=0, client_access_ms=3.0)
    narrow = chain_cost(swarm, request, RoutingParams(window=0), hops).transfer
    wide = chain_cost(swarm, request, RoutingParams(window=1), hops).transfer
    # window 1 adds client -> b (3 + 20 + 2) and a -> c (1 + 0 + 1)
    assert wide - narrow == pytest.approx(25.0 + 2.0)


def test_tokens_per_pass_is_the_mean_pass():
    assert tokens_per_pass(ChainRequest(prompt_tokens=300, new_tokens=99)) == pytest.approx(3.99)
    assert tokens_per_pass(ChainRequest(batch=2)) == 2.0


positive = st.floats(0.5, 500.0)
params = st.builds(RoutingParams, st.floats(0.25, 3.0), st.floats(0.25, 3.0), st.floats(0.05, 3.0))


@settings(max_examples=60, deadline=None)
@given(params, positive, positive, st.floats(1.0, 1e4), st.floats(0.0, 0.9), st.floats(0.0, 1.0), positive)
def test_cost_is_monotone_in_each_measurement(params, access, backbone, bandwidth, load, reliability, delta):
    request = ChainRequest(prompt_tokens=200, new_tokens=20, client_region=0)
    b = NodeView(
        "b",
        2,
        4,
        inference_tps=25.0,
        region=1,
        access_ms=access,
        bandwidth_mbps=bandwidth,
        load=load,
        reliability=reliability,
    )

    def cost(node=b, backbone_ms=backbone):
        return chain_cost(snapshot(node, backbone_ms), request, params, HOPS)

    base = cost()
    # more latency (b's last mile, the backbone) costs more
    assert cost(replace(b, access_ms=access + delta)).transfer > base.transfer
    assert cost(backbone_ms=backbone + delta).transfer > base.transfer
    # more load costs more
    if load + 0.05 <= 0.99:
        assert cost(replace(b, load=load + 0.05)).load > base.load
    # more bandwidth costs less
    assert cost(replace(b, bandwidth_mbps=bandwidth * 2)).transfer < base.transfer
    # more reliability costs less
    if reliability <= 0.95:
        assert cost(replace(b, reliability=reliability + 0.05)).reliability < base.reliability
    assert math.isfinite(base.total) and base.total > 0


def test_a_measured_client_rtt_replaces_the_estimate():
    measured = replace(snapshot().nodes[0], rtt_ms=100.0)
    swarm = SwarmSnapshot(2, (measured,), hidden_size=0, region_latency_ms=((0.0,),))
    cost = chain_cost(swarm, ChainRequest(client_region=0), RoutingParams(), (Hop("a", 0, 2),))
    assert cost.transfer == pytest.approx(2 * 50.0)


def test_params_round_trip_and_validation(tmp_path):
    params = RoutingParams(1.25, 0.5, 2.0, window=2, beam_width=8)
    assert params_from_json(params_to_json(params)) == params
    save_params(params, tmp_path / "params.json")
    assert load_params(tmp_path / "params.json") == params
    for bad in ('{"gamma": 0}', '{"gamma": "1"}', '{"window": -1}', '{"delta": 1}', "[1, 2]", '{"window": 1.5}'):
        with pytest.raises(ValueError):
            params_from_json(bad)

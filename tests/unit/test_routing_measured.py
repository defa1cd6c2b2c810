"""Tuning inputs: snapshots built from records (nesa_node/swarm_view.py), measured latency (routing/measured.py), and the
`nesa-node tune` command."""

import json

import numpy as np
import pytest

from nesa_node.cli import main
from nesa_node.cli.tune import load_scenario
from nesa_node.protocol.records import LinkInfo, LoadInfo, NodeInfo, NodeState
from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.ga import evolve, load_params
from nesa_node.routing.measured import measured_latency_s, snapshot_fitness, synthetic_requests
from nesa_node.routing.snapshot import Chain, ChainRequest, Hop, NodeView, SwarmSnapshot
from nesa_node.swarm_view import UPTIME_SCALE_S, build_snapshot, load_share


def info(peer: str, start: int, end: int, **fields) -> NodeInfo:
    return NodeInfo(peer_id=peer, state=NodeState.online, start_block=start, end_block=end, dtype="float16", **fields)


def test_snapshot_from_records_fills_the_eq18_inputs():
    infos = [
        info("a", 0, 2, links=(LinkInfo(peer_id="b", rtt_ms=2.0, bandwidth_mbps=50.0),), uptime_s=UPTIME_SCALE_S),
        info("b", 2, 4, links=(LinkInfo(peer_id="a", rtt_ms=2.0),), load=LoadInfo(queue=3), reputation=0.5),
        info("c", 2, 4, links=(LinkInfo(peer_id="a", rtt_ms=42.0),)),
        info("d", 2, 6),  # past the model's 4 blocks: dropped
    ]
    snapshot = build_snapshot(infos, 4, client_rtt_ms={"a": 2.0}, hidden_size=64)
    views = {node.peer_id: node for node in snapshot.nodes}
    assert sorted(views) == ["a", "b", "c"]
    assert (snapshot.hidden_size, snapshot.element_bytes) == (64, 2.0)
    assert views["a"].reliability == pytest.approx(0.5)  # up for one warm-up scale, reputation 1
    assert views["b"].reliability == 0.0 and views["b"].load == pytest.approx(0.75)  # 3 waiting: rho = 3 / 4
    assert views["a"].bandwidth_mbps == views["b"].bandwidth_mbps == 50.0 and views["c"].bandwidth_mbps is None
    assert views["a"].rtt_ms == 2.0 and views["b"].rtt_ms is None
    assert views["c"].access_ms > views["b"].access_ms + 15.0  # 42 ms away from a, where b is 2 ms away


def test_load_share_reads_the_larger_of_queue_and_gpu():
    assert load_share(LoadInfo()) == 0.0
    assert load_share(LoadInfo(queue=1, gpu_percent=80.0)) == pytest.approx(0.8)
    assert load_share(LoadInfo(queue=9, gpu_percent=10.0)) == pytest.approx(0.9)


def two_hop_snapshot() -> SwarmSnapshot:
    nodes = (
        NodeView("a", 0, 2, inference_tps=100.0, access_ms=1.0, bandwidth_mbps=1000.0),
        NodeView("b", 2, 4, inference_tps=50.0, access_ms=2.0, bandwidth_mbps=1000.0, load=0.5),
    )
    return SwarmSnapshot(4, nodes, hidden_size=0)


def test_measured_latency_golden_value():
    # hidden 0: transfer is latency only; client legs: a 1 ms in, b 2 ms out, a -> b 1 + 2 ms
    # compute: a 2 blocks x 5 ms (100 tok/s over 2 blocks), b 2 blocks x 10 ms / (1 - 0.5)
    request = ChainRequest(prompt_tokens=4, new_tokens=2)
    chain = Chain((Hop("a", 0, 2), Hop("b", 2, 4)))
    transfer_ms = 1.0 + 2.0 + 3.0
    compute_ms = 2 * 5.0 + 2 * 20.0
    expected = (3 * transfer_ms + 6 * compute_ms) / 1000
    assert measured_latency_s(two_hop_snapshot(), request, chain) == pytest.approx(expected)


def test_tuning_on_a_snapshot_is_reproducible_and_never_worse_than_its_first_generation():
    rng = np.random.default_rng(3)
    nodes = tuple(
        NodeView(
            f"n{index}",
            start,
            start + 2,
            inference_tps=float(rng.uniform(20, 200)),
            access_ms=float(rng.uniform(0.5, 40)),
            load=float(rng.uniform(0, 0.9)),
        )
        for index, start in enumerate([0, 0, 0, 2, 2, 2, 1, 1])
    )
    snapshot = SwarmSnapshot(4, nodes)
    requests = synthetic_requests(6, np.random.default_rng(0))
    runs = [evolve(snapshot_fitness(snapshot, requests), generations=4, population=8, seed=5) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    history = runs[0][1]
    assert history[-1]["best_latency_s"] <= history[0]["best_latency_s"]
    assert all(np.isfinite(entry["best_latency_s"]) for entry in history)


def test_tune_command_writes_params_a_client_can_load(tmp_path, capsys):
    scenario_file = tmp_path / "small.json"
    scenario_file.write_text(json.dumps({"base": "continent-200", "num_nodes": 40, "duration_s": 900}))
    out = tmp_path / "params.json"
    args = ["tune", "--scenario", str(scenario_file), "--generations", "2", "--population", "4", "--requests", "2"]
    assert main([*args, "--out", str(out)]) == 0
    params = load_params(out)
    assert isinstance(params, RoutingParams) and params.window == 0
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"base": "nowhere"}, "unknown scenario"),
        ({"base": "global-1000", "cities": 3}, "unknown or non-numeric scenario field 'cities'"),
        ({"base": "global-1000", "num_nodes": 1.5}, "num_nodes must be an integer"),
        ({"base": "global-1000", "churn_per_hour": -1}, "churn_per_hour must be >= 0"),
        ([1, 2], 'expected an object with "base"'),
    ],
)
def test_bad_scenario_files_are_refused_with_the_reason(tmp_path, content, message):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_scenario(str(path))
    assert main(["tune", "--scenario", str(path), "--out", str(tmp_path / "p.json")]) == 2


def test_a_scenario_file_changes_only_what_it_names(tmp_path):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"base": "global-1000", "churn_per_hour": 0.3}))
    scenario = load_scenario(str(path))
    assert scenario.churn_per_hour == 0.3 and scenario.num_nodes == load_scenario("global-1000").num_nodes

"""The dashboard's events and change detection (gateway/dashboard.py), without a swarm: node records as a gateway
reads them poll after poll, and persistence diagrams of point clouds (gudhi) for the change detection."""

from __future__ import annotations

import numpy as np
import pytest

from nesa_node.gateway.dashboard import CALIBRATION_SNAPSHOTS, DashboardState
from nesa_node.protocol.records import NodeInfo, NodeState

pytest.importorskip("gudhi")

from nesa_node.topology.graph import point_graph  # noqa: E402
from nesa_node.topology.homology import diagrams  # noqa: E402


def info(peer: str, start: int, end: int, state: NodeState = NodeState.online) -> NodeInfo:
    return NodeInfo(peer_id=peer, state=state, start_block=start, end_block=end, dtype="float32")


def texts(state: DashboardState) -> list[str]:
    return [f"{event['peer_id']} {event['event']}" for event in reversed(state.events)]  # oldest first


def test_joins_moves_state_changes_and_departures_are_events_once_each():
    state = DashboardState(model=None, model_name="tiny")
    state._note_changes([info("a", 0, 2), info("b", 2, 4)])
    state._note_changes([info("a", 0, 2), info("b", 2, 4)])  # nothing new: no event
    state._note_changes([info("a", 0, 2, NodeState.draining), info("b", 2, 4)])
    state._note_changes([info("a", 2, 4, NodeState.joining), info("b", 2, 4)])  # a rebalancing move
    state._note_changes([info("a", 2, 4), info("b", 2, 4)])
    state._note_changes([info("b", 2, 4)])
    assert texts(state) == [
        "a joined: blocks 0:2, online",
        "b joined: blocks 2:4, online",
        "a state: online -> draining",
        "a moved: blocks 0:2 -> 2:4, joining",
        "a state: joining -> online",
        "a left (record expired or withdrawn)",
    ]


def cloud(rng: np.random.Generator, centres: list[tuple[float, float]], jitter_ms: float = 0.05) -> object:
    """Diagrams of 8 points around each centre (ms), every coordinate jittered: a fresh measurement."""
    points = np.concatenate([np.asarray(centre) + rng.normal(0, 1.0, (8, 2)) for centre in centres])
    return diagrams(point_graph(points + rng.normal(0, jitter_ms, points.shape)))


def test_change_detection_calibrates_then_flags_a_new_region_and_not_noise():
    rng = np.random.default_rng(0)
    base = [(0.0, 0.0), (40.0, 0.0)]
    state = DashboardState(model=None, model_name="tiny")
    for index in range(CALIBRATION_SNAPSHOTS):
        assert state._change_document()["calibrating"] == [index, CALIBRATION_SNAPSHOTS]
        state._watch(cloud(rng, base))
    assert state._change_document() == {"calibrating": None, "scores": []}
    for _ in range(3):  # the same swarm measured again: scored, not a change
        state._watch(cloud(rng, base))
    scores = [score for _, score in state._change_document()["scores"]]
    assert len(scores) == 3 and max(scores) <= 1.0, scores
    assert not any("topology changed" in text for text in texts(state))
    state._watch(cloud(rng, [*base, (0.0, 80.0)]))  # a new region joins far away
    assert state._change_document()["scores"][-1][1] > 1.0
    assert [text for text in texts(state) if "topology changed" in text] != []
    state._watch(cloud(rng, [*base, (0.0, 80.0)]))  # the new shape is the reference now
    assert state._change_document()["scores"][-1][1] <= 1.0

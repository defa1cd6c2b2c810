"""The daemon's rebalancing decisions (nesa_node.server.rebalance), without sockets: records in, a move out."""

import pytest

from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.server.rebalance import CalibratedHomologyTrigger, Rebalancer, make_trigger, planning_snapshot
from nesa_node.topology.triggers import PeriodicTrigger, TriggerInput


def info(peer: str, start: int, end: int, state: NodeState = NodeState.online, tps: float = 0.0) -> NodeInfo:
    return NodeInfo(peer_id=peer, state=state, start_block=start, end_block=end, dtype="float32", inference_tps=tps)


class FakeNode:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


def rebalancer(peer: str, trigger=None) -> Rebalancer:
    trigger = trigger or make_trigger("periodic", period_s=60.0)
    return Rebalancer(FakeNode(peer), trigger, num_blocks=4, period_s=1.0, drain_timeout_s=1.0)


def test_a_hole_moves_exactly_one_node_whatever_the_trigger():
    infos = [info("a", 0, 2), info("b", 0, 2), info("c", 0, 2)]  # blocks 2-3 have no server
    decisions = {peer: rebalancer(peer).decide(infos, 0.0) for peer in "abc"}
    assert decisions["a"][0].to_start == 2 and decisions["a"][1] == "hole"
    assert decisions["b"] == (None, "") and decisions["c"] == (None, "")


def test_a_node_loading_blocks_counts_as_serving_them():
    infos = [info("a", 0, 2), info("b", 0, 2), info("c", 2, 4, NodeState.joining)]
    assert all(rebalancer(peer).decide(infos, 0.0) == (None, "") for peer in "ab")
    # a node draining to leave serves nothing: its blocks are a hole, covered by a node of the redundant span
    infos = [info("a", 0, 2), info("b", 0, 2), info("c", 2, 4, NodeState.draining)]
    assert rebalancer("a").decide(infos, 0.0)[0].to_start == 2 and rebalancer("c").decide(infos, 0.0) == (None, "")


def test_the_trigger_opens_an_episode_that_ends_when_no_node_has_a_move():
    lopsided = [info(peer, 0, 2, tps=10.0) for peer in "abc"] + [info("d", 2, 4, tps=10.0)]
    first, other = rebalancer("a"), rebalancer("b")
    assert first.decide(lopsided, 0.0)[0].to_start == 2 and first.episode  # T 10 -> 20 tokens/s
    assert other.decide(lopsided, 0.0) == (None, "periodic") and other.episode  # the plan names "a" only
    balanced = [info("a", 2, 4, tps=10.0), *lopsided[1:]]
    assert other.decide(balanced, 1.0) == (None, "") and not other.episode
    assert other.decide(lopsided, 2.0) == (None, "")  # the periodic trigger waits its period before firing again


def test_the_plan_does_not_change_while_its_mover_drains():
    lopsided = [info(peer, 0, 2, tps=10.0) for peer in "abc"] + [info("d", 2, 4, tps=10.0)]
    draining = [info("a", 0, 2, NodeState.draining, tps=10.0), *lopsided[1:]]
    snapshot = planning_snapshot(draining, 4, draining_serves=True)
    assert all(node.online and not node.draining for node in snapshot.nodes)
    assert rebalancer("b").decide(draining, 0.0) == (None, "periodic")


def test_the_homology_trigger_calibrates_before_it_may_fire():
    trigger = CalibratedHomologyTrigger(calibration=3)
    snapshot = planning_snapshot([info("a", 0, 2, tps=5.0), info("b", 2, 4, tps=5.0)], 4, draining_serves=True)
    state = trigger.start()
    for time_s in range(3):
        state, fired = trigger.step(state, TriggerInput(float(time_s), snapshot, None))
        assert not fired
    assert state[1] is not None  # calibrated: the monitor runs from here
    state, fired = trigger.step(state, TriggerInput(3.0, snapshot, None))
    assert not fired  # the same swarm again is no change


def test_unknown_triggers_are_refused():
    assert make_trigger("periodic", period_s=5.0) == PeriodicTrigger(5.0)
    with pytest.raises(ValueError, match="unknown rebalance trigger"):
        make_trigger("off", period_s=5.0)

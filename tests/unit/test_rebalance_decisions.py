"""The daemon's rebalancing decisions (nesa_node.server.rebalance), without sockets: records in, a move out."""

import pytest

from nesa_node.errors import SchemaBookError
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.schema_book import save_book
from nesa_node.server.config import RebalanceConfig
from nesa_node.server.rebalance import (
    FAR,
    CalibratedHomologyTrigger,
    Rebalancer,
    load_schema_book,
    make_trigger,
    planning_snapshot,
)
from nesa_node.sharding.balancing import placement_from_snapshot
from nesa_node.topology.schemas import bottleneck_throughput
from nesa_node.topology.triggers import PeriodicTrigger, TriggerInput
from tests.support import topology_states
from tests.support.topology_states import record


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


# ---- a schema book (server/rebalance.py step 3) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def book():
    return topology_states.make_book()


def with_book(peer: str, book) -> Rebalancer:
    trigger = make_trigger("periodic", period_s=1e9)  # fires once, at the first check
    return Rebalancer(FakeNode(peer), trigger, num_blocks=4, period_s=1.0, drain_timeout_s=1.0, book=book)


def rounds(rebalancers: dict, starts: dict, *, first_round: int, limit: int = 20) -> list[tuple[int, str, int, str]]:
    """Every node decides on the same records each round; the moves are made before the next round (all nodes back
    online). Returns (round, peer, new start, reason) of every move; checks that every block keeps a node that stays
    online through each round's moves."""
    moved = []
    for number in range(first_round, first_round + limit):
        infos = [record(peer, topology_states.ROLES[peer], starts[peer]) for peer in rebalancers]
        decided = {peer: rebalancer.decide(infos, float(number)) for peer, rebalancer in rebalancers.items()}
        moves = {peer: (move, reason) for peer, (move, reason) in decided.items() if move is not None}
        staying = [info for info in infos if info.peer_id not in moves]
        assert all(any(info.start_block <= block < info.end_block for info in staying) for block in range(4))
        for peer, (move, reason) in moves.items():
            assert rebalancers[peer].confirm(infos, reason) == move  # a second read names the same move
            starts[peer] = move.to_start
            moved.append((number, peer, move.to_start, reason))
        if not moves and number > first_round + 2:
            break
    return moved


def test_a_topology_class_change_moves_the_swarm_to_the_new_class_schema(book):
    """Atlantic (New York + Frankfurt) on its schema stays; Frankfurt leaves and Tokyo joins at the first blocks:
    the swarm goes to the pacific class's assignment, a move a round, every block served throughout, where the
    trigger's own planning would stop 15% short of it."""
    atlantic = topology_states.state_records("atlantic", topology_states.default_starts("atlantic"))
    label_atlantic, starts, far = topology_states.schema_starts(book, atlantic)
    assert not far and len(book.schemas) == 2
    rebalancers = {peer: with_book(peer, book) for peer in topology_states.STATES["atlantic"]}
    assert rounds(rebalancers, starts, first_round=0) == []  # on its class's schema: nothing to do
    assert {rebalancer.topology_class for rebalancer in rebalancers.values()} == {label_atlantic}
    for peer in ("fra1", "fra2", "fra3"):
        del rebalancers[peer], starts[peer]
    for peer, start in topology_states.TOKYO_JOINS_AT.items():
        rebalancers[peer], starts[peer] = with_book(peer, book), start
    joined = dict(starts)
    pacific = [record(peer, topology_states.ROLES[peer], starts[peer]) for peer in rebalancers]
    label, target, far = topology_states.schema_starts(book, pacific)
    assert label != label_atlantic and not far and target != starts
    moved = rounds(rebalancers, starts, first_round=10)
    assert starts == target
    assert {reason for *_, reason in moved} == {f"schema {label}"} and len({number for number, *_ in moved}) == len(
        moved
    )  # one move a round (5% of six nodes)
    assert {rebalancer.topology_class for rebalancer in rebalancers.values()} == {label}
    assert all(rebalancer.book_state.adopting is None for rebalancer in rebalancers.values())  # the episode is over

    # without the book, the trigger's planning from the same start stops short of the schema's throughput
    def bottleneck(spans):
        infos = [record(peer, topology_states.ROLES[peer], spans[peer]) for peer in spans]
        return bottleneck_throughput(placement_from_snapshot(planning_snapshot(infos, 4, draining_serves=True)))

    plain = dict(joined)
    plain_rebalancers = {peer: rebalancer(peer) for peer in rebalancers}
    rounds(plain_rebalancers, plain, first_round=0)
    assert bottleneck(joined) < bottleneck(plain) < 0.9 * bottleneck(target)


def test_a_swarm_far_from_every_class_recomputes(book):
    """New York with one Tokyo node is no class of the book: the change opens an episode of the trigger's own
    planning, which moves a node for the bottleneck as without a book."""
    starts = {"ny1": 0, "ny2": 0, "ny3": 3, "tyo1": 1}  # block 2 has only tyo1
    infos = [record(peer, topology_states.ROLES[peer], start) for peer, start in starts.items()]
    assert topology_states.schema_starts(book, infos)[2]  # far
    deciders = {peer: with_book(peer, book) for peer in starts}
    # the first snapshot is not a class yet (topology/adoption.py: CONFIRMATIONS in a row), so nothing moves on it
    assert all(decider.decide(infos, 0.0) == (None, "") for decider in deciders.values())
    decided = {peer: decider.decide(infos, 1.0) for peer, decider in deciders.items()}
    moves = {peer: move for peer, (move, _) in decided.items() if move is not None}
    assert {reason for _, reason in decided.values()} == {"periodic"}
    assert [(peer, move.to_start) for peer, move in moves.items()] == [("ny2", 1)]
    assert moves["ny2"].throughput_after > 1.05 * moves["ny2"].throughput_before
    assert all(decider.topology_class == FAR and decider.classes[-1][1] == FAR for decider in deciders.values())
    assert deciders["ny2"].confirm(infos, "periodic") == moves["ny2"]


def test_a_schema_book_needs_rebalancing_and_the_models_blocks(book, tmp_path):
    path = tmp_path / "book.json"
    save_book(book, path)
    with pytest.raises(ValueError, match="--rebalance off"):
        load_schema_book(RebalanceConfig(trigger="off", schema_book=str(path)), 4)
    with pytest.raises(SchemaBookError, match="for 4 blocks; this model has 8"):
        load_schema_book(RebalanceConfig(schema_book=str(path)), 8)
    assert load_schema_book(RebalanceConfig(schema_book=str(path)), 4).radius == book.radius
    assert load_schema_book(RebalanceConfig(), 4) is None

"""Moving toward a target assignment (a topology class's schema): nesa_node.sharding.balancing.plan_toward."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nesa_node.sharding.balancing import (
    MARGIN,
    Placement,
    plan_toward,
    served_throughput,
    swarm_throughput,
)


def make(start, length, throughput, blocks):
    return Placement(
        blocks,
        np.asarray(start, np.int64),
        np.asarray(length, np.int64),
        np.asarray(throughput, float),
        np.ones(len(start), bool),
        np.ones(blocks),
        tuple(f"peer{index:02d}" for index in range(len(start))),
    )


def bottleneck(placement: Placement, start) -> float:
    served, _ = served_throughput(placement.num_blocks, np.asarray(start), placement.length, placement.throughput)
    return swarm_throughput(served, placement.demand)


def servers(placement: Placement, start, mask) -> np.ndarray:
    start, mask = np.asarray(start), np.asarray(mask, bool)
    _, count = served_throughput(placement.num_blocks, start[mask], placement.length[mask], np.ones(mask.sum()))
    return count


@st.composite
def swarms(draw, max_nodes=10, max_blocks=8):
    """A swarm with every block served, a target whose spans also serve every block, and a serving mask."""
    blocks = draw(st.integers(2, max_blocks))
    count = draw(st.integers(2, max_nodes))
    length = [draw(st.integers(1, blocks)) for _ in range(count)]
    start = [draw(st.integers(0, blocks - size)) for size in length]
    target = [draw(st.integers(0, blocks - size)) for size in length]
    throughput = [draw(st.sampled_from([1.0, 1.02, 2.0, 5.0])) for _ in range(count)]
    serving = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    placement = make(start, length, throughput, blocks)
    return placement, np.array(target), np.array(serving)


@settings(max_examples=150, deadline=None)
@given(swarms(), st.integers(1, 4))
def test_a_plan_never_leaves_a_block_without_a_serving_node_that_stays(case, max_moves):
    placement, target, serving = case
    moves = plan_toward(placement, target, serving=serving, margin=0.0, max_moves=max_moves)
    assert len(moves) <= max_moves
    movers = np.zeros(placement.start.size, bool)
    for move in moves:
        assert not movers[move.node]  # once per node
        assert move.from_start == placement.start[move.node] != move.to_start
        movers[move.node] = True
    covered_now = servers(placement, placement.start, serving) >= 1
    staying = servers(placement, placement.start, serving & ~movers)
    assert np.all(staying[covered_now] >= 1)  # while every mover drains and loads, its blocks keep a server
    # no move lowers T, and a plan stops at the first move reaching its best T (later moves wait for a round)
    reached = [move.throughput_after for move in moves]
    previous = [bottleneck(placement, placement.start), *reached][: len(reached)]
    assert all(after >= before * (1 - 1e-12) for before, after in zip(previous, reached, strict=True))
    assert len(moves) <= 1 or reached[-1] > reached[-2]


@settings(max_examples=100, deadline=None)
@given(swarms())
def test_rounds_of_plans_end_and_never_lower_the_bottleneck(case):
    """Every node online after each round (its moves done): T never goes down, and the rounds end."""
    placement, target, _ = case
    start = placement.start.copy()
    previous = bottleneck(placement, start)
    for _ in range(4 * placement.start.size):
        moves = plan_toward(make(start, placement.length, placement.throughput, placement.num_blocks), target, margin=0)
        if not moves:
            break
        for move in moves:
            assert move.throughput_after >= move.throughput_before * (1 - 1e-9)
            start[move.node] = move.to_start
        assert bottleneck(placement, start) >= previous * (1 - 1e-9)
        previous = bottleneck(placement, start)
    else:
        pytest.fail("the plans never ended")


def test_a_lopsided_swarm_goes_to_the_target_in_rounds_of_one_move():
    # 6 nodes of 2 blocks on 4 blocks: five at 0:2 and one at 2:4; the target spreads them 3 and 3
    placement = make([0, 0, 0, 0, 0, 2], [2] * 6, [1.0] * 6, 4)
    target = np.array([0, 0, 0, 2, 2, 2])
    first = plan_toward(placement, target)
    assert len(first) == 1  # 5% of 6 nodes rounds up to one move a round
    assert first[0].to_start == 2 and first[0].throughput_before == 1.0 and first[0].throughput_after == 2.0
    start = placement.start.copy()
    rounds = 0
    while moves := plan_toward(make(start, [2] * 6, [1.0] * 6, 4), target, margin=0.0):
        start[moves[0].node] = moves[0].to_start
        rounds += 1
    assert rounds == 2 and sorted(start.tolist()) == [0, 0, 0, 2, 2, 2]


def test_interchangeable_nodes_trade_targets_instead_of_moving():
    # the target swaps two equal nodes: nothing is worth moving
    assert plan_toward(make([0, 2], [2, 2], [3.0, 3.0], 4), np.array([2, 0]), margin=0.0) == ()
    # within the 5% tolerance they are equals too
    assert plan_toward(make([0, 2], [2, 2], [3.0, 3.1], 4), np.array([2, 0]), margin=0.0) == ()


def test_hysteresis_needs_the_margin_to_start_and_none_once_under_way():
    # T 1.0 now (blocks 2-3); moving the slow node there gives 1.04: under the 5% margin
    placement = make([0, 0, 2, 0], [2] * 4, [1.0, 1.0, 1.0, 0.04], 4)
    target = np.array([0, 0, 2, 2])
    assert bottleneck(placement, placement.start) == 1.0 and bottleneck(placement, target) == pytest.approx(1.04)
    assert plan_toward(placement, target, margin=MARGIN) == ()
    assert [(move.node, move.to_start) for move in plan_toward(placement, target, margin=0.0)] == [(3, 2)]
    # the same T with a lower summed load: only once under way
    placement = make([0, 1, 2, 2, 2], [1] * 5, [1.0] * 5, 3)
    target = np.array([0, 1, 2, 2, 1])
    assert plan_toward(placement, target, margin=MARGIN) == ()
    assert [(move.node, move.to_start) for move in plan_toward(placement, target, margin=0.0)] == [(4, 1)]


def test_the_sole_serving_node_of_a_block_waits_for_a_later_round():
    # a (1.0) at 0:2 should go to 2:4 and b (2.0) at 2:4 to 0:2; c (1.5) is at 2:4 too
    placement = make([0, 2, 2], [2, 2, 2], [1.0, 2.0, 1.5], 4)
    target = np.array([2, 0, 2])
    assert bottleneck(placement, target) == 2.0 > bottleneck(placement, placement.start) == 1.0
    # c still loading (joining): a and b are each the only serving node of their blocks
    assert plan_toward(placement, target, serving=np.array([True, True, False]), max_moves=3) == ()
    # c online: b may go (c keeps 2:4); a may not in the same round (b is on its way)
    moves = plan_toward(placement, target, serving=np.array([True, True, True]), max_moves=3)
    assert [(move.node, move.to_start) for move in moves] == [(1, 0)]
    # next round b is loading 0:2: a still waits
    moved = make([0, 0, 2], [2, 2, 2], [1.0, 2.0, 1.5], 4)
    assert plan_toward(moved, target, serving=np.array([True, False, True]), margin=0.0) == ()
    # b online: a goes
    assert [(move.node, move.to_start) for move in plan_toward(moved, target, margin=0.0)] == [(0, 2)]


def test_bad_targets_are_refused():
    placement = make([0, 2], [2, 2], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match="one start per node"):
        plan_toward(placement, np.array([0]))
    with pytest.raises(ValueError, match="inside"):
        plan_toward(placement, np.array([0, 3]))
    with pytest.raises(ValueError, match=">= 0"):
        plan_toward(placement, np.array([0, 2]), margin=-1.0)
    with pytest.raises(ValueError, match="one flag per node"):
        plan_toward(placement, np.array([0, 2]), serving=np.array([True]))

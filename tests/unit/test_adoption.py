"""Following a schema book, the policy nodes and the life simulator share (nesa_node.topology.adoption)."""

import numpy as np
import pytest

from nesa_node.sharding.balancing import Placement
from nesa_node.topology.adoption import CONFIRMATIONS, FAR, BookState, follow_book
from nesa_node.topology.schemas import Assignment

PEERS = ("a", "b", "c", "d")


def placement(starts, slowest: float = 1.0) -> Placement:
    # four nodes of 2 blocks on 4 blocks, equal speed except d (slower, so not interchangeable)
    return Placement(4, np.array(starts), np.full(4, 2), np.array([2.0, 2.0, 2.0, slowest]), np.ones(4, bool),
                     np.ones(4), PEERS)  # fmt: skip


def assignment(label: int, starts, *, far=False, recomputed=False, slowest: float = 1.0) -> Assignment:
    return Assignment(label, 1.0, placement(starts, slowest), recomputed=recomputed or far, far=far)


LOPSIDED = [0, 0, 0, 2]  # T = min(6, 1) = 1
SCHEMA = [0, 2, 0, 2]  # T = min(4, 3) = 3; a, b and c are equals, so c is the one to move


def confirmed(state: BookState, assignment: Assignment, placement: Placement):
    """The state and step once `assignment` has shown in CONFIRMATIONS snapshots in a row (nothing moves before)."""
    for _ in range(CONFIRMATIONS - 1):
        state, step = follow_book(state, assignment, placement)
        assert step.moves == () and not step.changed and state.adopting is None
    return follow_book(state, assignment, placement)


def test_the_first_class_once_confirmed_starts_adopting_its_schema():
    state, step = confirmed(BookState(), assignment(3, SCHEMA), placement(LOPSIDED))
    assert step.changed and step.started and not step.recompute
    assert [(move.peer_id, move.to_start) for move in step.moves] == [("c", 2)]
    assert state == BookState(3, 3)
    # next round, b moved: nothing left; the adoption ends
    state, step = follow_book(state, assignment(3, SCHEMA), placement(SCHEMA))
    assert step.moves == () and step.finished and state == BookState(3, None)
    # and later rounds of the same class do nothing (no change, no trigger), even with the swarm lopsided again
    again, step = follow_book(state, assignment(3, SCHEMA), placement(LOPSIDED))
    assert step.moves == () and again == BookState(3)


def test_the_trigger_firing_on_a_known_class_also_plans_toward_its_schema():
    state = BookState(3)
    _, step = follow_book(state, assignment(3, SCHEMA), placement(LOPSIDED), fired=True)
    assert [(move.peer_id, move.to_start) for move in step.moves] == [("c", 2)] and not step.changed


def test_a_new_class_counts_only_once_confirmed():
    state = BookState(3)
    for _ in range(CONFIRMATIONS - 1):
        state, step = follow_book(state, assignment(5, SCHEMA), placement(LOPSIDED))
        assert step.moves == () and not step.changed and state.topology_class == 3 and state.pending == 5
    # a flip back to the old class clears it: the count starts over
    flipped, step = follow_book(state, assignment(3, SCHEMA), placement(LOPSIDED))
    assert flipped == BookState(3) and not step.changed
    flipped, step = follow_book(flipped, assignment(5, SCHEMA), placement(LOPSIDED))
    assert (flipped.topology_class, flipped.pending, flipped.seen) == (3, 5, 1)
    state, step = follow_book(state, assignment(5, SCHEMA), placement(LOPSIDED))
    assert step.changed and state.topology_class == 5 and step.moves


def test_far_from_every_class_defers_to_the_trigger_and_starts_its_episode():
    state = BookState(3, 3)
    for _ in range(CONFIRMATIONS - 1):
        state, step = follow_book(state, assignment(3, SCHEMA, far=True), placement(LOPSIDED))
        assert step.moves == ()
    state, step = follow_book(state, assignment(3, SCHEMA, far=True), placement(LOPSIDED))
    assert step.moves is None and step.recompute and step.changed and step.finished
    assert state == BookState(FAR, None)
    state, step = follow_book(state, assignment(3, SCHEMA, far=True), placement(LOPSIDED))
    assert step.moves is None and not step.recompute  # the episode was started once


def test_a_joining_nodes_first_snapshot_far_from_every_class_starts_nothing_when_the_next_is_known():
    state, step = follow_book(BookState(), assignment(3, SCHEMA, far=True), placement(LOPSIDED))
    assert step.moves == () and not step.recompute and state.topology_class is None
    state, step = confirmed(state, assignment(3, SCHEMA), placement(LOPSIDED))
    assert step.changed and not step.recompute and step.moves and state.topology_class == 3


def test_a_schema_that_would_leave_a_gap_defers_without_an_episode():
    state, step = follow_book(BookState(3), assignment(3, SCHEMA, recomputed=True), placement(LOPSIDED))
    assert step.moves is None and not step.recompute and state.topology_class == 3


def test_the_margin_holds_at_the_start_and_on_the_way():
    # d (0.05 tokens/s) at 0:2; the schema moves it to 2:4: T 2.0 -> 2.05, under the 5% margin
    before, after = placement([0, 0, 2, 0], 0.05), assignment(1, [0, 0, 2, 2], slowest=0.05)
    for state in (BookState(), BookState(1, 1)):
        state, step = confirmed(state, after, before)
        assert step.moves == () and state.adopting is None
    # with d at 1.0 tokens/s the same move is worth it (T 2 -> 3)
    _, step = confirmed(BookState(), assignment(1, [0, 0, 2, 2]), placement([0, 0, 2, 0]))
    assert [(move.peer_id, move.to_start) for move in step.moves] == [("d", 2)]


def test_an_assignment_of_other_nodes_is_refused():
    other = Assignment(0, 1.0, Placement(4, np.zeros(1, np.int64), np.full(1, 2), np.ones(1), np.ones(1, bool),
                                         np.ones(4), ("z",)), recomputed=False)  # fmt: skip
    with pytest.raises(ValueError, match="other nodes"):
        follow_book(BookState(), other, placement(LOPSIDED))

"""RefusedOpens (client/open_refusals.py): a node that refused an open of its own accord is left out of later opens
asking as much or more for REMEMBER_S, never of ones asking less."""

from __future__ import annotations

from nesa_node.client import open_refusals
from nesa_node.client.open_refusals import REMEMBER_S, RefusedOpens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_refusal_leaves_the_node_out_of_opens_asking_as_much_or_more_until_it_is_forgotten(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(open_refusals.time, "monotonic", clock)
    refused = RefusedOpens()
    refused.note("a", batch=2, max_length=64)
    assert refused.excluded(2, 64) == {"a"} and refused.excluded(4, 128) == {"a"}
    assert refused.excluded(1, 64) == frozenset() and refused.excluded(2, 32) == frozenset()  # asks less
    refused.note("a", batch=4, max_length=16)  # the least it refused: 2 rows, 16 tokens
    assert refused.excluded(2, 16) == {"a"} and refused.excluded(1, 128) == frozenset()
    clock.now += REMEMBER_S + 1
    assert refused.excluded(64, 4096) == frozenset()
    refused.note("a", batch=4, max_length=16)  # a refusal after the last was forgotten starts afresh
    assert refused.excluded(2, 16) == frozenset() and refused.excluded(4, 16) == {"a"}


def test_refusals_of_identities_that_came_and_went_are_dropped(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(open_refusals.time, "monotonic", clock)
    refused = RefusedOpens()
    for index in range(open_refusals.PRUNE_AT):
        refused.note(f"old-{index}", batch=1, max_length=1)
    clock.now += REMEMBER_S + 1
    refused.note("new", batch=1, max_length=1)
    assert len(refused._refused) == 1 and refused.excluded(1, 1) == {"new"}

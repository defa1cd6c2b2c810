"""The bound on peers' streams that have not yet said what they are for (protocol/stream_gate.py OpeningGate): a few
per peer, refused beyond that; a few in all, the oldest stream of the peer holding the most evicted beyond that."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nesa_node.errors import QuotaExceededError
from nesa_node.protocol.stream_gate import OpeningGate


def test_a_peer_over_its_share_is_refused_and_a_stream_over_the_total_evicts_the_heaviest_peers_oldest():
    gate = OpeningGate(max_opening=4, max_per_peer=3)
    evicted: list[str] = []
    settle = {name: gate.enter(name[0], lambda name=name: evicted.append(name)) for name in ("a1", "a2", "a3", "b1")}
    with pytest.raises(QuotaExceededError, match="a peer may have 3 streams opening at once"):
        gate.enter("a", lambda: evicted.append("a4"))
    gate.enter("c", lambda: evicted.append("c1"))  # over the total: a holds the most, its oldest goes
    assert evicted == ["a1"] and gate.evicted == 1
    assert gate.per_peer == {"a": 2, "b": 1, "c": 1}
    settle["a1"]()  # an evicted stream's end frees nothing more
    settle["a2"]()
    settle["a2"]()  # nor does settling twice
    assert gate.per_peer == {"a": 1, "b": 1, "c": 1}
    gate.enter("d", lambda: evicted.append("d1"))  # room again: nobody evicted
    gate.enter("e", lambda: evicted.append("e1"))  # every peer holds one: the oldest of all goes
    assert evicted == ["a1", "a3"]


def test_uncapped_kinds_pass_the_peers_share_but_weigh_in_the_eviction():
    gate = OpeningGate(max_opening=4, max_per_peer=2)
    evicted: list[str] = []
    gate.enter("b", lambda: evicted.append("b1"))
    for index in range(3):  # a node pushing the first steps of many sessions at once
        gate.enter("a", lambda index=index: evicted.append(f"a{index}"), capped=False)
    with pytest.raises(QuotaExceededError):
        gate.enter("a", lambda: None)  # a capped kind: over its share
    gate.enter("c", lambda: evicted.append("c1"))
    assert evicted == ["a0"] and gate.per_peer == {"a": 2, "b": 1, "c": 1}


actions = st.lists(st.one_of(st.tuples(st.just("open"), st.sampled_from("abcd")), st.tuples(st.just("settle"),
                   st.integers(0, 40))), max_size=60)  # fmt: skip


@given(actions, st.integers(1, 6), st.integers(1, 4))
def test_the_bounds_hold_and_each_stream_is_evicted_or_settled_once(steps, max_opening, max_per_peer):
    gate = OpeningGate(max_opening=max_opening, max_per_peer=max_per_peer)
    live: dict[int, str] = {}  # stream -> peer, in the order they opened
    settles: list = []
    evictions: list[int] = []
    for action, value in steps:
        if action == "open":
            stream = len(settles)
            counts = {peer: list(live.values()).count(peer) for peer in set(live.values())}
            if counts.get(value, 0) >= max_per_peer:
                with pytest.raises(QuotaExceededError):
                    gate.enter(value, lambda: None)
                continue
            before = len(evictions)
            settles.append(gate.enter(value, lambda stream=stream: evictions.append(stream)))
            if len(live) >= max_opening:  # one evicted: the oldest of a peer holding the most
                assert len(evictions) == before + 1
                victim = evictions[-1]
                heaviest = max(counts.values())
                assert counts[live[victim]] == heaviest
                assert victim == min(stream for stream, peer in live.items() if peer == live[victim])
                del live[victim]
            else:
                assert len(evictions) == before
            live[stream] = value
        elif value < len(settles):
            settles[value]()
            live.pop(value, None)
        assert len(gate.opening) == len(live) <= max_opening
        assert all(count <= max_per_peer for count in gate.per_peer.values())
        assert sum(gate.per_peer.values()) == len(live)
    assert len(set(evictions)) == len(evictions) == gate.evicted

"""The training memory's room making (nesa_node/server/training_room.py) with sessions as the node holds them:
what gives way, in order, and all or nothing (a request refused leaves every session exactly as it was)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

from nesa_node.errors import AdapterBudgetError
from nesa_node.server.training_room import TrainingRoom
from nesa_node.server.training_state import ANSWERED_KEPT, Saved, TrainingSession

SLICE_BYTES = 1000  # each session's fixed bytes: 4 x this (no replicas)
MB = 2**20


def session(peer: str, name: str) -> TrainingSession:
    return TrainingSession(name, peer, (0, 2), SimpleNamespace(nbytes=SLICE_BYTES), optimizer=None, step=0)


def service(budget: int, share: float, *sessions: TrainingSession, idle=()) -> SimpleNamespace:
    held = {(one.client_peer, one.session_id): one for one in sessions}
    ended = []

    def end(one: TrainingSession, error) -> None:
        ended.append(held.pop((one.client_peer, one.session_id)))

    limits = SimpleNamespace(
        max_training_mb=budget / MB, max_cache_share_per_peer=share, preempt_idle_s=5.0, step_timeout_s=30.0
    )
    return SimpleNamespace(
        limits=limits,
        sessions=held,
        ended=ended,
        _preemptible=lambda now: [one for one in idle if (one.client_peer, one.session_id) in held],
        _end=end,
    )


def save(owner: TrainingSession, step_id: str, nbytes: int, *, graph: int = 0, age_s: float = 0.0) -> None:
    owner.saved[step_id] = Saved(
        torch.zeros(nbytes // 4, dtype=torch.float32),
        (torch.zeros(1), torch.zeros(1)) if graph else None,
        graph,
        time.monotonic() - age_s,
    )


def snapshot(*sessions: TrainingSession) -> list:
    return [
        (list(one.saved), [(s.graph is not None, s.graph_bytes) for s in one.saved.values()], list(one.dropped))
        for one in sessions
    ]


def test_a_request_that_cannot_fit_leaves_everything_as_it_was():
    """A borrower past its share with a kept graph, an overdue forward, forwards borrowed and a full list of ids
    dropped before: a request short of room even with all of them is refused, and every session is exactly as it
    was (its saved forwards in order, graphs, the dropped ids: none of the oldest lost)."""
    borrower, other = session("b", "borrows"), session("o", "other")
    borrower.dropped.update(dict.fromkeys(f"old{index}" for index in range(ANSWERED_KEPT)))
    save(borrower, "graph", 400, graph=4000)
    save(borrower, "late", 400, age_s=60)
    borrower.last_active -= 60
    for index in range(3):
        save(borrower, f"f{index}", 400)
    room = TrainingRoom(service(4000 * 2 + 6000 + 500, 0.4, borrower, other))
    before = snapshot(borrower, other)
    with pytest.raises(AdapterBudgetError, match="max_training_mb"):
        room.make_room(20_000, "no room", peer="o", keep=other, preempt=False)
    assert not room.could_take(20_000, peer="o")
    assert snapshot(borrower, other) == before


def test_room_is_made_in_order_and_no_further_than_needed():
    """Overdue forwards first, then graphs, then the newest forwards borrowed past a share: each step only as far
    as the request needs."""
    borrower, other = session("b", "borrows"), session("o", "other")
    save(borrower, "late", 400, age_s=60)
    save(borrower, "graph", 400, graph=1000, age_s=2)
    borrower.last_active -= 60  # silent as long as its oldest forward: that one is overdue
    for index in range(6):
        save(borrower, f"f{index}", 400, age_s=1 - index / 100)  # the later, the newer
    used = 8 * SLICE_BYTES + 8 * 400 + 1000
    assert used == 12_200
    room = TrainingRoom(service(12_300, 6300 / 12_300, borrower, other))
    room.make_room(500, "no room", peer="o", keep=other, preempt=False)  # the overdue one is enough
    assert list(borrower.saved) == ["graph"] + [f"f{index}" for index in range(6)]
    assert list(borrower.dropped) == ["late"] and borrower.saved["graph"].graph_bytes == 1000
    room.make_room(1000, "no room", peer="o", keep=other, preempt=False)  # the graph is
    assert borrower.saved["graph"].graph_bytes == 0 and len(borrower.saved) == 7
    room.make_room(2300, "no room", peer="o", keep=other, preempt=False)  # the two newest borrowed forwards
    assert list(borrower.saved) == ["graph", "f0", "f1", "f2", "f3"] and list(borrower.dropped) == ["late", "f5", "f4"]


def test_a_requester_past_its_share_takes_nothing_back():
    borrower, other = session("b", "borrows"), session("o", "other")
    for index in range(3):
        save(borrower, f"f{index}", 400)
    save(other, "mine", 2000)  # past its share too
    room = TrainingRoom(service(8 * SLICE_BYTES + 1200 + 2000, 0.45, borrower, other))
    before = snapshot(borrower, other)
    with pytest.raises(AdapterBudgetError):
        room.make_room(400, "no room", peer="o", keep=other, preempt=False)
    assert snapshot(borrower, other) == before


def test_an_open_ends_idle_sessions_only_when_it_then_fits():
    busy, idle = session("a", "busy"), session("i", "idle")
    save(busy, "f", 400)
    within = 8 * SLICE_BYTES + 400
    fits = service(within + 4 * SLICE_BYTES - 1, 1.0, busy, idle, idle=[idle])
    TrainingRoom(fits).make_room(4 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True)
    assert fits.ended == [idle]  # ending the idle one makes the room
    short = service(within, 1.0, busy, idle, idle=[idle])
    with pytest.raises(AdapterBudgetError):  # ending it would not be enough: it is left alone
        TrainingRoom(short).make_room(9 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True)
    assert short.ended == [] and len(short.sessions) == 2


@pytest.mark.parametrize("seed", range(30))
def test_room_making_is_all_or_nothing(seed):
    """Random sessions, forwards (some overdue, some with graphs, some busy sessions) and requests: a request either
    fits afterwards, or is refused with every session exactly as before; and `could_take` tells which beforehand."""
    rng = random.Random(seed)
    sessions = [session(f"p{rng.randrange(3)}", f"s{index}") for index in range(rng.randrange(2, 6))]
    for one in sessions:
        one.busy = rng.random() < 0.2
        one.last_active -= rng.choice((0, 60))
        one.lent = rng.random() < 0.3
        for index in range(rng.randrange(0, 6)):
            save(one, f"f{index}", 400 * rng.randrange(1, 4), graph=rng.choice((0, 0, 2000)), age_s=rng.choice((0, 60)))
    used = sum(one.state_bytes for one in sessions)
    room = TrainingRoom(service(used + rng.randrange(0, 3000), rng.choice((0.3, 0.5, 1.0)), *sessions))
    requester = rng.choice(sessions)
    nbytes = rng.randrange(100, 8000)
    before = snapshot(*sessions)
    expected = room._free(nbytes, peer=requester.client_peer, keep=requester, commit=False)
    assert snapshot(*sessions) == before  # tried on the side: nothing changed
    try:
        room.make_room(nbytes, "no room", peer=requester.client_peer, keep=requester, preempt=False)
    except AdapterBudgetError:
        assert not expected and snapshot(*sessions) == before
    else:
        assert expected and room.used_bytes + nbytes <= room.max_bytes


def test_a_peer_alone_borrows_whole_sessions_and_a_peer_within_its_share_ends_the_newest():
    """A peer alone may open past its share (into free memory: its sessions are marked lent); a peer within its
    share needing the room ends the newest lent session, as far as it needs; a peer past its share ends none."""
    lone = [session("l", f"l{index}") for index in range(3)]
    for index, one in enumerate(lone):
        one.opened += index  # l2 the newest
        one.lent = index > 0  # the first within the share, the others opened past it
    room = TrainingRoom(state := service(3 * 4 * SLICE_BYTES + 1000, 0.4, *lone))
    assert room.could_take(4 * SLICE_BYTES, peer="n")  # a newcomer within its share: l2 would be ended
    assert room.share_bytes < room.peer_bytes("l")
    with pytest.raises(AdapterBudgetError):  # a forward ends no session: a whole one for a few bytes is too much
        room.make_room(4 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=False)
    assert state.ended == []
    room.make_room(4 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True)
    assert state.ended == [lone[2]]
    past = session("p", "past")
    state.sessions[("p", "past")] = past
    with pytest.raises(AdapterBudgetError):  # an open past its share (its own 4000 and 4000 more) ends nobody
        room.make_room(4 * SLICE_BYTES, "no room", peer="p", keep=None, preempt=True)
    assert state.ended == [lone[2]]


def test_a_lent_session_is_ended_only_while_its_peer_is_past_its_share():
    """Sessions a and then b, c opened past the share: an open needing more than c gives back is refused, b not
    ended (with c gone its peer is within its share), and nobody is (all or nothing)."""
    held = [session("x", name) for name in "abc"]
    for index, one in enumerate(held):
        one.opened += index
        one.lent = index > 0
    state = service(14 * SLICE_BYTES, 8 / 14, *held)
    room = TrainingRoom(state)
    assert room.share_bytes == 8 * SLICE_BYTES
    with pytest.raises(AdapterBudgetError):
        room.make_room(8 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True)
    assert state.ended == []
    room.make_room(4 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True)
    assert state.ended == [held[2]]


def test_an_open_at_the_session_limit_ends_a_session_even_with_memory_to_spare():
    idle = session("i", "idle")
    state = service(100 * SLICE_BYTES, 1.0, idle, idle=[idle])
    room = TrainingRoom(state)
    assert room.could_take(4 * SLICE_BYTES, peer="n", slots=1)
    room.make_room(4 * SLICE_BYTES, "no room", peer="n", keep=None, preempt=True, slots=1)
    assert state.ended == [idle]
    busy = session("b", "busy")
    state.sessions[("b", "busy")] = busy
    assert not room.could_take(4 * SLICE_BYTES, peer="n", slots=1)  # nobody may be ended: refused, nobody ended

"""Sessions are scoped to the peer that opened them (nesa_node.server.sessions, RELIABILITY.md G5): one id may be open
by several peers at once, and every lookup names one session unambiguously."""

from __future__ import annotations

import asyncio
import hashlib

import multihash
import pytest
from hivemind.p2p import PeerID

from nesa_node.errors import (
    BadRequestError,
    PeerUnavailableError,
    QuotaExceededError,
    SessionNotFoundError,
    TooManySessionsError,
)
from nesa_node.protocol.messages import OpenSession
from nesa_node.server.config import LimitsConfig
from nesa_node.server.session_state import MAX_QUEUED_REPORTS
from nesa_node.server.sessions import END_OF_SESSION, SessionTable
from nesa_node.sharding.kv_cache import CacheBudget


def peer(seed: int) -> str:
    """A valid base58 libp2p peer id (a sha2-256 multihash)."""
    return PeerID(multihash.encode(hashlib.sha256(bytes([seed])).digest(), "sha2-256")).to_base58()


OWNER, SQUATTER, PREVIOUS, OTHER = (peer(seed) for seed in range(4))


def table(**limits) -> SessionTable:
    return SessionTable(LimitsConfig(**limits), CacheBudget.for_tokens(4096, bytes_per_token=64))


def open_session(sessions: SessionTable, by: str, session_id: str = "s1", upstream: str | None = PREVIOUS):
    request = OpenSession(session_id=session_id, start_block=0, end_block=1, batch=1, max_length=64, upstream=upstream)
    return sessions.open(request, client_peer=by, blocks=(0, 1), cache=None, reply=None)


def test_one_id_opened_by_two_peers_gives_two_sessions():
    sessions = table()
    owner = open_session(sessions, OWNER)
    squatter = open_session(sessions, SQUATTER)
    assert owner is not squatter and len(sessions) == 2
    assert sessions.get(OWNER, "s1") is owner and sessions.get(SQUATTER, "s1") is squatter
    assert sessions.named("s1") == [owner, squatter]


def test_the_owner_opening_an_id_again_ends_its_idle_session_there_but_not_one_with_a_step_under_way():
    sessions = table()
    first = open_session(sessions, OWNER)
    squatter = open_session(sessions, SQUATTER)
    first.busy = True
    with pytest.raises(BadRequestError, match="already open on this node, a step under way"):
        open_session(sessions, OWNER)
    first.busy = False
    second = open_session(sessions, OWNER)  # as after losing its channel to this node: failover to the same node
    assert second is not first and sessions.get(OWNER, "s1") is second
    assert not sessions.holds(first) and first.inbox.get_nowait() is END_OF_SESSION
    assert sessions.get(SQUATTER, "s1") is squatter  # another peer's session of that id is untouched
    assert sessions.budget.used_bytes == second.reserved_bytes + squatter.reserved_bytes
    sessions.close(first)  # the old session's handler closing it later leaves the new one open
    assert sessions.get(OWNER, "s1") is second and len(sessions) == 2


def test_a_reopen_waits_for_the_old_sessions_step_to_end():
    sessions = table()
    first = open_session(sessions, OWNER)
    first.busy = True

    async def reopen():
        request = OpenSession(session_id="s1", start_block=0, end_block=1, batch=1, max_length=64, upstream=PREVIOUS)
        reopened = asyncio.create_task(
            sessions.open_when_room(request, client_peer=OWNER, blocks=(0, 1), cache=None, reply=None)
        )
        await asyncio.sleep(0.2)
        assert not reopened.done()  # the step under way is not cut off
        first.busy = False
        return await asyncio.wait_for(reopened, 5)

    second = asyncio.run(reopen())
    assert sessions.get(OWNER, "s1") is second and not sessions.holds(first)


def test_a_push_naming_the_owner_finds_its_session_whatever_else_shares_the_id():
    sessions = table()
    squatter = open_session(sessions, SQUATTER)  # first, claiming the owner's upstream too
    owner = open_session(sessions, OWNER)
    assert sessions.find("s1", OWNER, sender=PREVIOUS) is owner
    assert sessions.find("s1", SQUATTER, sender=PREVIOUS) is squatter
    with pytest.raises(SessionNotFoundError):
        sessions.find("s1", OTHER, sender=PREVIOUS)


def test_a_push_without_an_owner_needs_exactly_one_session_of_its_sender():
    sessions = table()
    owner = open_session(sessions, OWNER)
    open_session(sessions, SQUATTER, upstream=OTHER)
    assert sessions.find("s1", None, sender=PREVIOUS) is owner
    with pytest.raises(BadRequestError, match="not this session's upstream"):
        sessions.find("s1", None, sender=peer(9))
    with pytest.raises(SessionNotFoundError):
        sessions.find("s2", None, sender=PREVIOUS)
    open_session(sessions, peer(10))  # a third peer claims the same upstream: which one is meant is unknown
    with pytest.raises(BadRequestError, match="name the session's owner"):
        sessions.find("s1", None, sender=PREVIOUS)


def test_closing_one_peer_s_session_leaves_the_other_and_frees_its_cache():
    sessions = table()
    owner = open_session(sessions, OWNER)
    squatter = open_session(sessions, SQUATTER)
    sessions.close(squatter)
    assert not sessions.holds(squatter) and sessions.holds(owner)
    assert sessions.budget.used_bytes == owner.reserved_bytes
    sessions.close(squatter)  # twice: nothing more happens
    assert list(sessions.sessions) == [(OWNER, "s1")]


def test_quotas_stay_per_peer():
    sessions = table(max_sessions_per_peer=1)
    open_session(sessions, SQUATTER)
    open_session(sessions, OWNER)  # the squatter's session counts against the squatter only
    with pytest.raises(QuotaExceededError):
        open_session(sessions, SQUATTER, session_id="s2")


def test_opens_under_way_count_toward_the_peers_quota():
    sessions = table(max_sessions_per_peer=2)
    open_session(sessions, OWNER, "s1")
    with sessions.opening(OWNER, "s2"):  # its adapter coming, or waiting for room
        with pytest.raises(QuotaExceededError, match="1 open sessions here and 1 opens under way, the per-peer"):
            with sessions.opening(OWNER, "s3"):
                pass
        with sessions.opening(OWNER, "s1"):  # a reopen of its own id: the same session, within the quota
            pass
        with sessions.opening(SQUATTER, "s3"):  # another peer's quota is its own
            pass
    with sessions.opening(OWNER, "s1"), sessions.opening(OWNER, "s3"):  # a reopen waiting does not count twice
        pass
    with sessions.opening(OWNER, "s3"):
        with pytest.raises(QuotaExceededError, match="1 open sessions here and 1 opens under way"):
            with sessions.opening(OWNER, "s4"):
                pass
    open_session(sessions, OWNER, "s2")
    for attempt in range(3):  # refused at once, with nothing kept for the refused peer
        with pytest.raises(QuotaExceededError, match="2 open sessions here, the per-peer"):
            with sessions.opening(OWNER, f"more{attempt}"):
                pass
    assert not sessions._opens  # every place given back


def test_opens_of_one_id_at_once_each_take_a_place():
    """One id opened many times at once (each open waiting for an adapter, say) holds as many places: a peer cannot
    keep more opens under way than its quota by naming one id."""
    sessions = table(max_sessions_per_peer=2)
    with sessions.opening(OWNER, "same"), sessions.opening(OWNER, "same"):
        with pytest.raises(QuotaExceededError, match="0 open sessions here and 2 opens under way"):
            with sessions.opening(OWNER, "same"):
                pass
    assert not sessions._opens


def test_a_draining_table_refuses_new_sessions_and_keeps_the_open_ones():
    """RELIABILITY.md A6: once the node drains (SIGTERM, or a move), opens are refused with a typed error the client
    re-routes on, while the sessions it holds stay open to finish their steps."""
    sessions = table()
    held = open_session(sessions, OWNER)
    sessions.draining = True
    for by, session_id in ((OTHER, "s2"), (OWNER, "s2")):
        with pytest.raises(TooManySessionsError, match="draining") as refused:
            open_session(sessions, by, session_id)
        assert refused.value.code == "too_many_sessions"
    assert sessions.get(OWNER, "s1") is held and len(sessions) == 1
    assert sessions.budget.used_bytes == held.reserved_bytes


def test_a_sessions_own_reports_of_its_next_node_are_bounded():
    """A next node that sends refusals without end (each one a report to answer the client) fills at most
    MAX_QUEUED_REPORTS places in the session's queue; the rest are dropped (the first already fails the hop)."""
    session = open_session(table(), OWNER)
    queued = [session.report(PeerUnavailableError(f"refusal {index}")) for index in range(MAX_QUEUED_REPORTS + 50)]
    assert queued == [True] * MAX_QUEUED_REPORTS + [False] * 50
    assert session.inbox.qsize() == MAX_QUEUED_REPORTS

"""A peer's share of a node's KV cache (nesa_node.server.sessions, RELIABILITY.md G3) is checked before anything is
reserved: an open or a growth that the share refuses ends no idle session of anyone to make room first."""

from __future__ import annotations

import hashlib
import time

import multihash
import pytest
from hivemind.p2p import PeerID

from nesa_node.errors import CacheBudgetError, QuotaExceededError
from nesa_node.protocol.messages import OpenSession
from nesa_node.server.config import LimitsConfig
from nesa_node.server.sessions import RESERVE_CHUNK_TOKENS, SessionTable
from nesa_node.sharding.kv_cache import CacheBudget

BYTES_PER_TOKEN = 64


def peer(seed: int) -> str:
    return PeerID(multihash.encode(hashlib.sha256(bytes([seed])).digest(), "sha2-256")).to_base58()


GATEWAY, OTHER = peer(1), peer(2)


def table(tokens: int, share: float = 0.5, sessions: int = 64) -> SessionTable:
    limits = LimitsConfig(max_cache_share_per_peer=share, max_sessions=sessions, max_sessions_per_peer=32)
    return SessionTable(limits, CacheBudget.for_tokens(tokens, bytes_per_token=BYTES_PER_TOKEN))


def open_session(sessions: SessionTable, by: str, session_id: str, max_length: int, batch: int = 1):
    request = OpenSession(session_id=session_id, start_block=0, end_block=1, batch=batch, max_length=max_length)
    return sessions.open(request, client_peer=by, blocks=(0, 1), cache=None, reply=None)


def all_idle(sessions: SessionTable) -> list:
    long_ago = time.monotonic() - 3600
    for session in sessions.sessions.values():
        session.last_active = long_ago  # every session preemptible
    return list(sessions.sessions.values())


def test_an_open_over_the_share_ends_no_idle_session_for_cache():
    sessions = table(1024)  # full at 8 sessions of 128 tokens; 4 of them per peer
    for index in range(4):
        open_session(sessions, OTHER, f"o{index}", 128)
        open_session(sessions, GATEWAY, f"g{index}", 128)
    before = all_idle(sessions)
    with pytest.raises(QuotaExceededError, match=r"\(512 tokens of batch 1, of which 512 are held\)"):
        open_session(sessions, GATEWAY, "g4", 128)
    assert all(sessions.holds(session) for session in before)
    assert sessions.budget.free_bytes == 0
    assert sessions.holds(open_session(sessions, peer(3), "t", 128))  # a peer within its share: an idle one goes


def test_an_open_over_the_share_ends_no_idle_session_for_a_place():
    sessions = table(4096, share=0.125, sessions=8)  # 512 tokens a peer; the node full at 8 sessions
    for index in range(4):
        open_session(sessions, OTHER, f"o{index}", 128)
        open_session(sessions, GATEWAY, f"g{index}", 128)
    before = all_idle(sessions)
    with pytest.raises(QuotaExceededError, match="past its share"):
        open_session(sessions, GATEWAY, "g4", 128)
    assert all(sessions.holds(session) for session in before)


def test_a_growth_over_the_share_ends_no_idle_session_and_keeps_its_reservation():
    sessions = table(1024)
    for index in range(4):
        open_session(sessions, OTHER, f"o{index}", 128)
    own = [open_session(sessions, GATEWAY, f"g{index}", 256) for index in range(3)]
    sessions.grow(own[0], 200)  # 512: its share, and the node full
    before = all_idle(sessions)
    with pytest.raises(QuotaExceededError, match=r"batch 1 x 256 tokens .* of which 512 are held"):
        sessions.grow(own[1], 129)
    assert all(sessions.holds(session) for session in before)
    assert own[1].reserved_tokens == RESERVE_CHUNK_TOKENS and sessions.budget.free_bytes == 0


def test_rows_count_toward_the_share():
    sessions = table(2048)  # 1024 tokens of batch 1 per peer
    open_session(sessions, GATEWAY, "a", 128, batch=6)
    with pytest.raises(QuotaExceededError, match="batch 3 x 128 tokens"):
        open_session(sessions, GATEWAY, "b", 128, batch=3)
    assert sessions.holds(open_session(sessions, GATEWAY, "c", 128, batch=2))


def test_with_a_share_of_the_whole_node_the_budget_refuses():
    sessions = table(512, share=1.0)
    first = open_session(sessions, GATEWAY, "a", 512)
    second = open_session(sessions, OTHER, "b", 512)
    sessions.grow(first, 256)  # 256 + 128 of the 512
    with pytest.raises(CacheBudgetError):
        sessions.grow(first, 512)
    third = open_session(sessions, GATEWAY, "c", 256)  # 128 more: the node full, the peer at 384 of it
    with pytest.raises(CacheBudgetError):
        open_session(sessions, GATEWAY, "d", 256)
    assert first.reserved_tokens == 256 and sessions.holds(second) and sessions.holds(third)

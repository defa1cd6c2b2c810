"""A peer's share of a node's KV cache (nesa_node.server.sessions and cache_room, RELIABILITY.md G3): sessions open
within it, checked before anything is reserved; their growth may borrow past it from cache nobody else needs, which a
peer within its share takes back, from the sessions that borrowed, newest first, a busy one right after its step."""

from __future__ import annotations

import asyncio
import hashlib
import time

import multihash
import pytest
from hivemind.p2p import PeerID

from nesa_node.errors import BadRequestError, CacheBudgetError, QuotaExceededError, SessionPreemptedError
from nesa_node.protocol.messages import OpenSession
from nesa_node.server import cache_room
from nesa_node.server.cache_room import STALLED_REVOKE_S
from nesa_node.server.config import LimitsConfig
from nesa_node.server.sessions import RESERVE_CHUNK_TOKENS, SessionTable
from nesa_node.sharding.kv_cache import CacheBudget

BYTES_PER_TOKEN = 64


def peer(seed: int) -> str:
    return PeerID(multihash.encode(hashlib.sha256(bytes([seed])).digest(), "sha2-256")).to_base58()


GATEWAY, OTHER, THIRD = peer(1), peer(2), peer(3)


def table(tokens: int, share: float = 0.5, sessions: int = 64) -> SessionTable:
    limits = LimitsConfig(max_cache_share_per_peer=share, max_sessions=sessions, max_sessions_per_peer=32)
    return SessionTable(limits, CacheBudget.for_tokens(tokens, bytes_per_token=BYTES_PER_TOKEN))


def open_session(sessions: SessionTable, by: str, session_id: str, max_length: int, batch: int = 1):
    request = OpenSession(session_id=session_id, start_block=0, end_block=1, batch=batch, max_length=max_length)
    return sessions.open(request, client_peer=by, blocks=(0, 1), cache=None, reply=None)


def grow(sessions: SessionTable, session, tokens: int) -> None:
    asyncio.run(sessions.grow(session, tokens))


def grow_to(sessions: SessionTable, session, tokens: int) -> None:
    for step in range(session.reserved_tokens, tokens + 1, 16):  # as its steps need it
        grow(sessions, session, step)
    grow(sessions, session, tokens)


def all_idle(sessions: SessionTable) -> list:
    long_ago = time.monotonic() - 3600
    for session in sessions.sessions.values():
        session.last_active = long_ago  # every session preemptible
    return list(sessions.sessions.values())


def tokens(nbytes: int) -> int:
    return nbytes // BYTES_PER_TOKEN


def test_a_batch_over_the_step_limit_is_refused_at_open():
    """A step holds at least a token a row: a session of more rows than a node's step limit could take no step, and
    a client counts on one-token steps within it (client/session.py `_own_input_sane`)."""
    limits = LimitsConfig(max_batch=64, max_tokens_per_step=8)
    sessions = SessionTable(limits, CacheBudget.for_tokens(4096, bytes_per_token=BYTES_PER_TOKEN))
    with pytest.raises(BadRequestError, match=r"batch must be in 1\.\.8, got 9"):
        open_session(sessions, GATEWAY, "s" * 32, max_length=16, batch=9)
    assert open_session(sessions, GATEWAY, "t" * 32, max_length=16, batch=8) is not None
    sessions.step_tokens = 5  # what the node announces: fewer where its frame limit cannot carry 8 tokens
    with pytest.raises(BadRequestError, match=r"batch must be in 1\.\.5, got 6"):
        open_session(sessions, GATEWAY, "u" * 32, max_length=16, batch=6)


# ---- the share is checked first -----------------------------------------------------------------------------------


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
    assert sessions.holds(open_session(sessions, THIRD, "t", 128))  # a peer within its share: an idle one goes


def test_an_open_over_the_share_ends_no_idle_session_for_a_place():
    sessions = table(4096, share=0.125, sessions=8)  # 512 tokens a peer; the node full at 8 sessions
    for index in range(4):
        open_session(sessions, OTHER, f"o{index}", 128)
        open_session(sessions, GATEWAY, f"g{index}", 128)
    before = all_idle(sessions)
    with pytest.raises(QuotaExceededError, match="past its share"):
        open_session(sessions, GATEWAY, "g4", 128)
    assert all(sessions.holds(session) for session in before)


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
    grow(sessions, first, 256)  # 256 + 128 of the 512
    with pytest.raises(CacheBudgetError):
        grow(sessions, first, 512)
    third = open_session(sessions, GATEWAY, "c", 256)  # 128 more: the node full, the peer at 384 of it
    with pytest.raises(CacheBudgetError):
        open_session(sessions, GATEWAY, "d", 256)
    assert first.reserved_tokens == 256 and sessions.holds(second) and sessions.holds(third)
    assert first.lent_bytes == 0


# ---- lending past the share ---------------------------------------------------------------------------------------


def test_a_peer_alone_on_a_node_grows_its_sessions_past_its_share():
    sessions = table(8192)  # a share of 4096 tokens
    gateway = [open_session(sessions, GATEWAY, f"s{index}", 408) for index in range(16)]  # 2048 reserved at open
    for session in gateway:
        grow_to(sessions, session, 408)
    assert all(session.reserved_tokens == 408 for session in gateway)
    assert tokens(sessions.budget.used_bytes) == 16 * 408  # 6528: past the share, within the node
    assert tokens(sum(session.lent_bytes for session in gateway)) == 16 * 408 - 4096
    # announced for routing, each session counted once: between steps, every session is reclaimable (all of them,
    # once idle); with steps under way, the free cache plus the newest sessions that borrowed, until the peer is
    # back within its share (6 of 408 tokens: 6528 - 6 x 408 = 4080)
    assert sessions.tokens_available() == 8192
    for session in gateway:
        session.busy = session.computing = True
    assert sessions.tokens_available() == (8192 - 16 * 408) + 6 * 408


def test_growth_past_the_share_with_nothing_free_is_refused_and_ends_no_session():
    sessions = table(1024)  # a share of 512
    others = [open_session(sessions, OTHER, f"o{index}", 128) for index in range(4)]  # 512 held, at its share
    own = [open_session(sessions, GATEWAY, f"g{index}", 256) for index in range(3)]  # 384 held
    grow_to(sessions, own[0], 256)  # 512 held: at its share, the node full
    before = all_idle(sessions)
    with pytest.raises(QuotaExceededError, match="no cache to lend it now"):
        grow(sessions, own[1], 129)
    assert all(sessions.holds(session) for session in before)
    assert own[1].reserved_tokens == RESERVE_CHUNK_TOKENS and sessions.budget.free_bytes == 0
    assert all(session.lent_bytes == 0 for session in others + own)


def lent_node() -> tuple[SessionTable, list]:
    """A node of 1024 tokens (a share of 512) where the gateway's four sessions hold it all, each 128 tokens of it
    lent (each opened within the share and grew past it)."""
    sessions = table(1024)
    gateway = [open_session(sessions, GATEWAY, f"g{index}", 256) for index in range(4)]  # 512: its share
    for session in gateway:
        grow_to(sessions, session, 256)
    assert sessions.budget.free_bytes == 0
    assert [tokens(session.lent_bytes) for session in gateway] == [128] * 4
    return sessions, gateway


def test_a_peer_within_its_share_takes_back_lent_cache_from_the_newest_borrower():
    sessions, gateway = lent_node()
    other = open_session(sessions, OTHER, "o", 512)  # 128 needed: g3, the newest, ends
    assert [sessions.holds(session) for session in gateway] == [True, True, True, False]
    grow(sessions, other, 129)  # 128 more: g3's 256 freed that
    assert [sessions.holds(session) for session in gateway] == [True, True, True, False]
    grow(sessions, other, 257)  # 256 more, within its share: g2 ends too
    assert [sessions.holds(session) for session in gateway] == [True, True, False, False]
    assert tokens(sessions.budget.used_bytes) == 1024 and other.reserved_tokens == 512
    # the gateway back at its share: nothing more is taken from it
    with pytest.raises(CacheBudgetError):
        open_session(sessions, THIRD, "t", 128)
    assert sessions.holds(gateway[0]) and sessions.holds(gateway[1])


def test_only_sessions_that_borrowed_are_taken_back():
    sessions = table(1024)  # a share of 512
    gateway = [open_session(sessions, GATEWAY, f"g{index}", 512) for index in range(4)]  # 512: its share
    grow_to(sessions, gateway[0], 512)  # the oldest grows past the share: 384 lent to it
    assert [tokens(session.lent_bytes) for session in gateway] == [384, 0, 0, 0]
    assert sessions.budget.free_bytes == 128 * BYTES_PER_TOKEN
    other = open_session(sessions, OTHER, "o", 512)  # fits the free 128
    grow(sessions, other, 200)  # 128 more, nothing free: g0 ends, not g3, g2 or g1 (newer, but never borrowed)
    assert [sessions.holds(session) for session in gateway] == [False, True, True, True]


def test_idle_sessions_go_before_lent_ones_and_together_they_make_room():
    sessions = table(1536)  # a share of 768
    idle = open_session(sessions, THIRD, "idle", 128)
    gateway = [
        open_session(sessions, GATEWAY, name, length) for name, length in (("g0", 512), ("g1", 384), ("g2", 512))
    ]
    grow_to(sessions, gateway[0], 512)  # 768: at its share
    grow_to(sessions, gateway[1], 384)  # 256 lent to g1
    grow_to(sessions, gateway[2], 256)  # 128 lent to g2: the node holds 1280 of 1536
    assert [tokens(session.lent_bytes) for session in gateway] == [0, 256, 128]
    idle.last_active = time.monotonic() - 3600
    other = open_session(sessions, OTHER, "o", 512)  # 128 of the 256 free
    assert sessions.holds(idle) and all(sessions.holds(session) for session in gateway)
    grow(sessions, other, 512)  # 384 more, 128 free: the idle session's 128 alone is short, g2's 256 with it fits
    assert not sessions.holds(idle) and not sessions.holds(gateway[2])
    assert sessions.holds(gateway[0]) and sessions.holds(gateway[1]) and other.reserved_tokens == 512


def open_request(session_id: str, max_length: int, batch: int = 1) -> OpenSession:
    return OpenSession(session_id=session_id, start_block=0, end_block=1, batch=batch, max_length=max_length)


def test_a_borrower_with_a_step_under_way_ends_after_it_and_the_open_waits_for_that():
    sessions, gateway = lent_node()
    for session in gateway:
        session.inbox.put_nowait(object())  # a step queued on every session, always: none is ever between steps
    with pytest.raises(CacheBudgetError):
        open_session(sessions, OTHER, "o", 512)  # the room comes only once g3 ends
    assert isinstance(gateway[3].revoked, SessionPreemptedError)
    assert gateway[2].revoked is None  # g3's 256 is enough
    assert sum(session.reserved_bytes for session in gateway if session.revoked is not None) == 256 * BYTES_PER_TOKEN

    async def open_when_g3_ends():
        async def g3_step_done():  # what InferenceService._run does after the step: the session ends
            await asyncio.sleep(0.2)
            sessions.close(gateway[3])

        ending = asyncio.create_task(g3_step_done())
        started = time.monotonic()
        opened = await sessions.open_when_room(
            open_request("o", 512), client_peer=OTHER, blocks=(0, 1), cache=None, reply=None
        )
        await ending
        return opened, time.monotonic() - started

    other, waited_s = asyncio.run(open_when_g3_ends())
    assert sessions.holds(other) and 0.15 < waited_s < 5.0
    assert [sessions.holds(session) for session in gateway] == [True, True, True, False]
    assert gateway[2].revoked is None  # the wait took nothing more


def test_a_growth_within_the_share_waits_for_a_revoked_borrower():
    sessions, gateway = lent_node()
    gateway[2].busy = True  # a step under way
    other = open_session(sessions, OTHER, "o", 512)  # g3, between steps, ends at once
    assert not sessions.holds(gateway[3]) and sessions.holds(gateway[2])

    async def grow_while_g2_steps():
        async def g2_step_done():
            await asyncio.sleep(0.2)
            assert gateway[2].revoked is not None  # revoked, not ended, while its step was under way
            assert sessions.holds(gateway[2])
            sessions.close(gateway[2])

        ending = asyncio.create_task(g2_step_done())
        await sessions.grow(other, 300)  # 172 more within its share: 128 free, the rest once g2's step ends
        await ending

    asyncio.run(grow_while_g2_steps())
    assert other.reserved_tokens == 300
    assert sessions.holds(gateway[0]) and sessions.holds(gateway[1])


def test_nothing_is_taken_back_for_a_peer_past_its_own_share():
    sessions, gateway = lent_node()
    with pytest.raises(QuotaExceededError, match="past its share"):
        open_session(sessions, GATEWAY, "g4", 128)  # opens stay within the share
    assert all(sessions.holds(session) for session in gateway)


def test_a_peer_back_within_its_share_once_its_revoked_session_ends_loses_nothing_more():
    sessions = table(2048)  # a share of 1024
    big = open_session(sessions, GATEWAY, "big", 1024)
    small = open_session(sessions, GATEWAY, "small", 256)  # 256 held at open
    grow_to(sessions, big, 1024)  # 1152 held: 128 lent to big
    grow_to(sessions, small, 256)  # 1280: 128 lent to small, the newest
    assert [tokens(big.lent_bytes), tokens(small.lent_bytes)] == [128, 128]
    big.busy = small.busy = True  # steps under way
    filler = open_session(sessions, THIRD, "f", 128, batch=5)  # 640 of the 768 free
    with pytest.raises(CacheBudgetError):
        open_session(
            sessions, OTHER, "o", 128, batch=2
        )  # 128 short: small is revoked; without it the gateway is at 1024
    assert small.revoked is not None and big.revoked is None
    with pytest.raises(CacheBudgetError):  # 512 more wanted: small's 256 is coming, but big is within the share now
        open_session(sessions, peer(4), "x", 128, batch=4)
    assert big.revoked is None and sessions.holds(big) and sessions.holds(filler)


def test_nothing_is_lent_while_a_peer_waits_for_a_revoked_session():
    sessions = table(1024)  # a share of 512
    gateway = [open_session(sessions, GATEWAY, f"g{index}", 512) for index in range(4)]  # 512: its share
    grow(sessions, gateway[0], 129)
    grow(sessions, gateway[1], 129)  # 768 held, 256 of it lent; 256 free
    gateway[1].busy = True

    async def scenario():
        opening = asyncio.create_task(  # 384 wanted, 128 short: g1 revoked, and the open waits for it
            sessions.open_when_room(
                open_request("o", 128, batch=3), client_peer=OTHER, blocks=(0, 1), cache=None, reply=None
            )
        )
        await asyncio.sleep(0.1)
        assert gateway[1].revoked is not None and not opening.done()
        with pytest.raises(QuotaExceededError, match="no cache to lend it now"):
            await sessions.grow(gateway[2], 129)  # 256 free, but it is for the peer waiting on g1
        sessions.close(gateway[1])
        other = await opening
        await sessions.grow(gateway[2], 129)  # nobody waits now: the last 128 free is lent
        return other

    other = asyncio.run(scenario())
    assert sessions.holds(other) and gateway[2].reserved_tokens == 256 and sessions.budget.free_bytes == 0


def test_a_revoked_session_nobody_waits_for_stops_no_lending():
    sessions = table(1024)  # a share of 512
    gateway = [open_session(sessions, GATEWAY, f"g{index}", 512) for index in range(4)]
    grow(sessions, gateway[0], 129)
    grow(sessions, gateway[1], 129)  # 256 free
    gateway[1].busy = True
    with pytest.raises(CacheBudgetError):
        open_session(sessions, OTHER, "o", 128, batch=3)  # g1 revoked; this open gives up at once
    assert gateway[1].revoked is not None
    grow(sessions, gateway[2], 129)  # a borrower whose revoked session stalls holds no lending up
    assert gateway[2].reserved_tokens == 256 and tokens(gateway[2].lent_bytes) == 128


def gateway_holding_the_node() -> tuple[SessionTable, list]:
    """A node of 1024 tokens (a share of 512) where the gateway's four sessions (up to 512 tokens each) hold it all,
    each 128 tokens of it lent."""
    sessions = table(1024)
    gateway = [open_session(sessions, GATEWAY, f"g{index}", 512) for index in range(4)]
    for session in gateway:
        grow(sessions, session, 129)
    assert sessions.budget.free_bytes == 0 and [tokens(s.lent_bytes) for s in gateway] == [128] * 4
    return sessions, gateway


def test_what_a_revoked_session_frees_goes_to_the_waiter_not_to_a_borrower():
    sessions, gateway = gateway_holding_the_node()
    gateway[3].busy = True
    with pytest.raises(CacheBudgetError):
        open_session(sessions, OTHER, "o", 512)  # g3 revoked
    assert gateway[3].revoked is not None

    async def race():
        opening = asyncio.create_task(
            sessions.open_when_room(open_request("o", 512), client_peer=OTHER, blocks=(0, 1), cache=None, reply=None)
        )
        await asyncio.sleep(0.02)  # the open waits for g3
        sessions.close(gateway[3])  # g3's step done: 256 free while the open still sleeps
        with pytest.raises(QuotaExceededError, match="no cache to lend it now"):
            await sessions.grow(gateway[2], 257)  # a borrower past its share in between: nothing lent to it
        return await opening

    other = asyncio.run(race())
    assert sessions.holds(other) and sessions.holds(gateway[2]) and gateway[2].reserved_tokens == 256


def test_a_peer_claims_none_of_what_its_own_revoked_session_frees():
    sessions = table(1024)  # a share of 512
    small, big = open_session(sessions, GATEWAY, "small", 512), open_session(sessions, GATEWAY, "big", 512)
    grow_to(sessions, big, 512)  # 640 held: 128 lent to big
    open_session(sessions, OTHER, "o", 128, batch=3)  # the node full
    big.busy = small.busy = True
    request = open_request("t", 128).model_copy(update={"batch": 4})

    async def race():
        opening = asyncio.create_task(
            sessions.open_when_room(request, client_peer=THIRD, blocks=(0, 1), cache=None, reply=None)
        )
        await asyncio.sleep(0.03)  # big revoked for THIRD, which waits
        assert big.revoked is not None
        with pytest.raises(QuotaExceededError, match="past its share"):  # the gateway still holds big's 512
            open_session(sessions, GATEWAY, "more", 128, batch=3)
        with pytest.raises(QuotaExceededError):
            await sessions.grow(small, 129)
        sessions.close(big)
        return await opening

    third = asyncio.run(race())
    assert sessions.holds(third) and sessions.holds(small) and small.reserved_tokens == RESERVE_CHUNK_TOKENS


def test_the_announced_room_counts_what_taking_back_would_really_free():
    class Held:
        def __init__(self, reserved: int, lent: int, busy: bool):
            self.client_peer, self.reserved_bytes, self.lent_bytes, self.busy = GATEWAY, reserved, lent, busy
            self.computing = busy
            self.revoked, self.inbox = None, asyncio.Queue()

    # an older idle session and the newest, busy, that borrowed: with the idle one preempted the peer is within
    # its share of 100, so nothing is taken back from the busy one
    sessions = [Held(60, 0, busy=False), Held(60, 60, busy=True)]
    assert cache_room.available_bytes(sessions, 0, 100, idle_soon=True, now=time.monotonic()) == 60
    assert (
        cache_room.available_bytes(sessions, 0, 100, idle_soon=False, now=time.monotonic()) == 60
    )  # the borrower, taken back
    assert cache_room.available_bytes(sessions, 0, 50, idle_soon=True, now=time.monotonic()) == 120


@pytest.mark.parametrize("seed", range(40))
def test_the_announced_lent_room_is_exactly_what_taking_back_frees(seed):
    """For any mix of peers, borrowers and revoked sessions (some of them stalled), the room `available_bytes`
    announces from lent cache is what `choose` can free for a newcomer within its share: all of it, and not a byte
    more."""
    import random

    now = time.monotonic()

    class Held:
        def __init__(self, peer_id: str, reserved: int, lent: int, revoked: bool, stalled: bool):
            self.client_peer, self.reserved_bytes, self.lent_bytes = peer_id, reserved, lent
            self.revoked = SessionPreemptedError("revoked") if revoked else None
            self.revoked_s = now - (STALLED_REVOKE_S if stalled else 0.0)
            self.busy, self.inbox, self.last_active = True, asyncio.Queue(), now

        def idle_s(self, now: float) -> float:
            return now - self.last_active

    rng = random.Random(seed)
    sessions = []
    for _ in range(rng.randint(1, 12)):
        reserved = rng.choice((16, 32, 64, 128))
        lent = rng.choice((0, 0, reserved // 2, reserved))
        owner, revoked, stalled = rng.choice((GATEWAY, OTHER, THIRD)), rng.random() < 0.3, rng.random() < 0.5
        sessions.append(Held(owner, reserved, lent, revoked=revoked, stalled=stalled))
    share = rng.choice((32, 64, 128, 256))
    announced = cache_room.available_bytes(sessions, 0, share, idle_soon=False, now=now)

    def choose(nbytes: int):
        return cache_room.choose(
            sessions, nbytes, keep=None, for_peer=peer(9), share_bytes=share, idle_after_s=float("inf"),
            now=now, under_way=lambda session: session.busy,
        )  # fmt: skip

    if announced:
        room = choose(announced)
        assert room is not None and not room.idle and not room.lent
        assert sum(session.reserved_bytes for session in room.revoke) == announced
        assert all(session.lent_bytes and session.revoked is None for session in room.revoke)
    assert choose(announced + 1) is None


def other_within_its_share_next_to_a_borrower(borrower: bool) -> tuple[SessionTable, object]:
    """A node of 1024 tokens (a share of 512): OTHER holds 384 (o1 at 256 of its 512, o2 at 128); with `borrower`,
    the gateway holds the rest, 128 of it lent to g3."""
    sessions = table(1024)
    first = open_session(sessions, OTHER, "o1", 512)
    grow(sessions, first, 129)  # 256
    open_session(sessions, OTHER, "o2", 128)
    if borrower:
        gateway = [open_session(sessions, GATEWAY, f"g{index}", 256) for index in range(4)]  # 512: its share
        grow(sessions, gateway[3], 129)  # borrows the last 128 free
        assert sessions.budget.free_bytes == 0 and tokens(gateway[3].lent_bytes) == 128
    return sessions, first


def test_a_growth_whose_step_fits_the_share_doubles_only_as_far_as_the_share():
    sessions, first = other_within_its_share_next_to_a_borrower(borrower=False)
    grow(sessions, first, 257)  # one token more: doubling to 512 would pass the share, so it stops at 384
    assert first.reserved_tokens == 384 and first.lent_bytes == 0  # nothing borrowed: nothing to take back later


def test_a_growth_whose_step_fits_the_share_takes_back_lent_cache_rather_than_being_refused():
    sessions, first = other_within_its_share_next_to_a_borrower(borrower=True)
    grow(sessions, first, 257)
    assert first.reserved_tokens == 384 and first.lent_bytes == 0
    assert [session.session_id for session in sessions.sessions.values() if session.client_peer == GATEWAY] == [
        "g0", "g1", "g2"
    ]  # fmt: skip


def test_a_growth_past_the_share_is_refused_for_what_its_step_needs():
    sessions, first = other_within_its_share_next_to_a_borrower(borrower=True)
    grow(sessions, first, 384)  # g3 taken back: 128 free
    open_session(sessions, GATEWAY, "g4", 128)  # the gateway back at its share: the node full
    with pytest.raises(QuotaExceededError, match=r"batch 1 x 385 tokens"):  # not the doubled 512
        grow(sessions, first, 385)


def test_what_is_revoked_for_one_waiting_open_is_not_counted_for_another():
    sessions, gateway = gateway_holding_the_node()
    gateway[3].busy = True

    async def scenario():
        waiting = asyncio.create_task(
            sessions.open_when_room(
                open_request("o", 128, batch=2), client_peer=OTHER, blocks=(0, 1), cache=None, reply=None
            )
        )
        await asyncio.sleep(0.1)
        assert gateway[3].revoked is not None and not waiting.done()  # g3's 256 is for OTHER
        with sessions._claim() as claim, pytest.raises(CacheBudgetError):  # another open under way, as a waiter is
            request = open_request("t", 128, batch=3)  # 384: g3's is not its own, and g2 alone is too few
            sessions.open(request, client_peer=THIRD, blocks=(0, 1), cache=None, reply=None, claim=claim)
        assert [sessions.holds(session) for session in gateway[:3]] == [True, True, True]  # nothing ended for it
        sessions.close(gateway[3])
        return await waiting

    assert sessions.holds(asyncio.run(scenario()))


def test_a_growth_past_the_share_borrows_what_is_free_when_doubling_would_not_fit():
    sessions = table(1024)  # a share of 512
    gateway = open_session(sessions, GATEWAY, "g", 1024)
    grow_to(sessions, gateway, 512)  # its whole share
    other = open_session(sessions, OTHER, "o", 512)
    grow(sessions, other, 400)  # 112 tokens free
    grow(sessions, gateway, 513)  # one token more: doubling to 1024 does not fit, the 112 free do
    assert gateway.reserved_tokens == 624 and tokens(gateway.lent_bytes) == 112 and sessions.budget.free_bytes == 0


def test_a_revoked_borrower_that_stalls_is_not_waited_for_by_the_next_open():
    sessions, gateway = gateway_holding_the_node()
    gateway[3].busy = True  # its step never ends: its client stopped reading
    with pytest.raises(CacheBudgetError):
        open_session(sessions, OTHER, "o", 512)  # g3 revoked; this open gives up
    with pytest.raises(CacheBudgetError):
        open_session(sessions, THIRD, "t", 512)  # g3 is on its way: waited for, nothing more ended
    assert [sessions.holds(session) for session in gateway] == [True, True, True, True]
    gateway[3].revoked_s -= STALLED_REVOKE_S  # stalled since
    third = open_session(sessions, THIRD, "t", 512)  # g2 ends for it instead
    assert sessions.holds(third) and [sessions.holds(session) for session in gateway] == [True, True, False, True]
    open_session(sessions, peer(4), "p4", 512)  # the 128 left free
    # the stalled g3 still holds its cache, so the gateway is still past its share: g1's lent cache is taken back
    fifth = open_session(sessions, peer(5), "p5", 512)
    assert sessions.holds(fifth) and [sessions.holds(session) for session in gateway] == [True, False, False, True]


def test_many_fresh_identities_take_back_only_what_was_lent():
    """Identities cost nothing: each opens within its own share, and together they take back the gateway's lent
    cache, whole sessions, newest first, but never what it holds within its share."""
    sessions, gateway = gateway_holding_the_node()  # 4 x 256 tokens, 128 of each lent: 512 past its share of 512
    opened, refused = [], 0
    for seed in range(10, 20):  # ten throwaway identities, one chunk of 128 tokens each
        try:
            opened.append(open_session(sessions, peer(seed), "s", 128))
        except CacheBudgetError:
            refused += 1
    assert [sessions.holds(session) for session in gateway] == [True, True, False, False]  # g3, then g2
    assert len(opened) == 4 and refused == 6  # the 512 freed, and nothing more
    assert tokens(sum(session.reserved_bytes for session in gateway if sessions.holds(session))) == 512

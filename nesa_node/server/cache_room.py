"""Which sessions a node ends to make room in its KV cache (server/sessions.py SessionTable), and how cache is lent past
a peer's share.

A session opens within its peer's share of the cache (`--max-cache-share-per-peer`). As its steps need more, it grows
(doubling) within the share as before, as far as the share allows when its step fits in it; when the step itself is
past the share, a growth borrows cache that is free at that moment and ends no one's session for it (`lent_bytes`). So
the many sessions of one peer alone on a node (a gateway's users are all one peer) use what nobody else needs, where
their growth past the share used to fail them in the middle of a generation.

Room for an open, or a growth within its peer's share, when the cache is full (`choose`), all or nothing:
  1. idle sessions (idle `--preempt-idle` seconds): of the peer holding the most sessions first, then the longest idle;
  2. for a peer within its share only: sessions that borrowed (lent_bytes > 0) of peers holding more than their
     share, the newest first (the least work lost), each only while its peer is still past its share. One between
     steps ends now; one with a step under way is revoked: it ends right after that step (InferenceService._run),
     however many steps its peer keeps queued, and the room comes then (the open or growth waits for it, bounded).
A borrower that keeps a step always queued thus loses its lent cache all the same, and lent cache is counted as
available for routing (SessionTable.tokens_available).

What a revoked session frees is for the open or growth it was revoked for: each counts only its own, so two waiters
never count one session twice, and one that gave up leaves its sessions to the next that makes room. Nothing is lent
while such a request waits; a revoked session nobody waits for holds no lending up. A revoked session normally ends
within one pass; one whose client (or next node) stops reading holds its cache up to twice its step timeout (its step,
then its answer). The request waiting for it gives up first (bounded: MAX_ADMISSION_WAIT_S, GROW_WAIT_S; the sessions
already ended for it stay ended, their cache free for the next one), and once it is STALLED_REVOKE_S past its
revocation no later request waits for it, and it counts toward its peer's cache again: they take their room elsewhere,
from its peer's other borrowers too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

# a revoked session not ended this long after (its step stalled: a client or next node that stops reading) is waited for
# by no request more, and counts toward its peer's cache again; it ends at its step timeout (a pass takes milliseconds
# to a few hundred: guess)
STALLED_REVOKE_S = 2.0

TAKEN_BACK = (
    "session ended to give another peer its share of the node's cache: it held cache lent past its peer's share while "
    "nobody else needed it"
)


@dataclass
class Room:
    """What to end: idle sessions and sessions holding lent cache between steps (now), and sessions holding lent
    cache with a step under way (revoked: they end after it)."""

    idle: list = field(default_factory=list)
    lent: list = field(default_factory=list)
    revoke: list = field(default_factory=list)


def choose(
    sessions: Sequence,
    nbytes: int,
    *,
    keep,
    for_peer: str | None,
    share_bytes: int,
    idle_after_s: float,
    now: float,
    under_way: Callable[[object], bool],
) -> Room | None:
    """The sessions to end for `nbytes` (module docstring), from `sessions` in the order they opened; None when all
    of them would not free enough (then nothing is ended: ending sessions that cannot make room only hurts their
    owners). `keep`: never chosen (the growing session); `for_peer`: the peer the room is for, within its share (None:
    idle sessions only)."""
    room, freed = Room(), 0
    holding = Counter(session.client_peer for session in sessions)
    idle = [session for session in sessions if session is not keep and session.idle_s(now) >= idle_after_s]
    idle.sort(key=lambda session: (-holding[session.client_peer], session.last_active))
    for session in idle:
        if freed >= nbytes:
            break
        room.idle.append(session)
        freed += session.reserved_bytes
    if freed < nbytes and for_peer is not None:
        chosen = {id(session) for session in room.idle}
        rest = [session for session in sessions if id(session) not in chosen]
        for session in _borrowers(rest, share_bytes, now, skip=lambda s: s is keep or s.client_peer == for_peer):
            if freed >= nbytes:
                break
            (room.revoke if under_way(session) else room.lent).append(session)
            freed += session.reserved_bytes
    return room if freed >= nbytes else None


def available_bytes(sessions: Sequence, free_bytes: int, share_bytes: int, idle_soon: bool, now: float) -> int:
    """What a new session within its peer's share could get: the free bytes, those of sessions between steps now
    (`idle_soon`: when the node preempts idle sessions within an open's wait), and those `choose` would take back
    from the rest (its second rule), each session counted once."""
    idle = [session for session in sessions if idle_soon and not session.computing]
    counted = {id(session) for session in idle}
    rest = [session for session in sessions if id(session) not in counted]  # as `choose` sees them after those
    lent = sum(session.reserved_bytes for session in _borrowers(rest, share_bytes, now, skip=lambda session: False))
    return free_bytes + sum(session.reserved_bytes for session in idle) + lent


def _borrowers(sessions: Sequence, share_bytes: int, now: float, *, skip: Callable[[object], bool]) -> Iterator:
    """`choose`'s second rule, lazily: the sessions that borrowed (lent_bytes > 0, not revoked, not `skip`), newest
    first, each while its peer still keeps more than its share once the ones before it are taken."""
    keeps = _kept(sessions, now)
    for session in reversed(sessions):
        peer = session.client_peer
        if session.lent_bytes and session.revoked is None and keeps[peer] > share_bytes and not skip(session):
            keeps[peer] -= session.reserved_bytes
            yield session


def _kept(sessions: Sequence, now: float) -> Counter:
    """Bytes each peer keeps: its revoked sessions' left out while they are on their way back (its peer may be within
    its share with them gone), those stalled (`stalled`) counted again. SessionTable._charged counts them all, for the
    opposite question."""
    keeps = Counter()
    for session in sessions:
        if session.revoked is None or stalled(session, now):
            keeps[session.client_peer] += session.reserved_bytes
    return keeps


def stalled(session, now: float) -> bool:
    """Whether a revoked session's step has not ended STALLED_REVOKE_S after it was revoked."""
    return now - session.revoked_s >= STALLED_REVOKE_S


__all__ = ["STALLED_REVOKE_S", "TAKEN_BACK", "Room", "available_bytes", "choose", "stalled"]

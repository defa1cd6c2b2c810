"""The node's open inference sessions: the session table (open with quotas and the cache budget, close, drain), and
step ingress, the one place where a step from any channel (the client's stream, a push stream, a unary push, a data
lane) enters a session's queue.

Admission, where identities cost nothing (RELIABILITY.md G3): a session reserves cache as it uses it (a chunk at open,
doubling as its steps need more, never past its max_length), takes no step within `first_step_timeout_s` and it is
closed, and when the node is full (sessions or cache) sessions idle for `preempt_idle_s` are ended to admit the new
one (their owners get a typed `preempted` error and fail over), those of the peer holding the most sessions first.
An active session is preempted only to take back cache lent past its peer's share (server/cache_room.py), right
after its step under way. A refusal is always a typed error, at once or after a bounded wait for such a session.

Scope (RELIABILITY.md G5): a session belongs to the peer that opened it, and the table keys it by (that peer, session
id). Any chain member learns a session's id from the steps it sees, and could open that id first on the nodes that
might replace a failing one; scoped, its sessions sit beside the owner's and take none of its steps. Every way into a
session names it unambiguously: the owner's own stream is bound to it at open, a push names the owner and must come
from the session's upstream (`find`), and a data lane is matched by the key its handshake proves (server/lanes.py).
The owner opening an id it has open here again (its failover back to this node after its channel broke) ends the
old session of that id once no step of it is under way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from nesa_node.errors import (
    BadRequestError,
    CacheBudgetError,
    QuotaExceededError,
    SessionNotFoundError,
    SessionPreemptedError,
    TooManySessionsError,
)
from nesa_node.protocol.channel import Channel, frame
from nesa_node.protocol.messages import MAX_ID_LENGTH, ErrorReply, OpenSession, Step
from nesa_node.server import cache_room
from nesa_node.server.config import LimitsConfig
from nesa_node.server.session_state import Inbound, ServerSession, SessionKey
from nesa_node.sharding.kv_cache import CacheBudget

logger = logging.getLogger(__name__)

END_OF_SESSION = object()  # put in a session's inbox when its stream ends or the node ends it
REOPEN_POLL_S = 0.05  # how often a reopen looks whether the old session's step has ended
MAX_ADMISSION_WAIT_S = 10.0  # longest an open waits for room (a client's open waits twice its request timeout)
GROW_WAIT_S = 0.5  # longest a growth waits for revoked sessions to end (a decode step's deadline is 1 s or more)
RESERVE_CHUNK_TOKENS = 128  # cache reserved at open (per row): a prompt of this length needs no growth (guess)


class SessionTable:
    """Sessions by (opening peer, id), with the node's limits, the per-peer quotas and the KV cache budget."""

    def __init__(self, limits: LimitsConfig, budget: CacheBudget, *, metrics=None):
        self.limits = limits
        # rows x tokens of the largest step taken (announced as NodeInfo.max_step_tokens: the node sets it from its
        # frame limit too)
        self.step_tokens = limits.max_tokens_per_step
        self.metrics = metrics  # nesa_node.metrics.NodeMetrics, or None
        self.sessions: dict[SessionKey, ServerSession] = {}
        self.draining = False  # refuse new sessions (the node is stopping or moving)
        self._reopening: set[SessionKey] = set()  # owners' reopens waiting for their old session's step to end
        self._opens: dict[str, Counter[str]] = {}  # peer -> ids it is opening (an adapter coming, a wait for room)
        self._waiting = 0  # opens and growths waiting for revoked sessions to end (server/cache_room.py)
        self._claims: set[object] = set()  # the opens and growths under way that sessions may be revoked for
        self.idle = asyncio.Event()  # set while no session is open
        self.idle.set()
        self.use_budget(budget)

    def use_budget(self, budget: CacheBudget) -> None:
        """Account sessions in `budget` (a node that moved to a span of another length); no session may be open."""
        self.budget = budget
        self.peer_cache_bytes = int(budget.capacity_bytes * self.limits.max_cache_share_per_peer)

    def __len__(self) -> int:
        return len(self.sessions)

    def tokens_available(self) -> int:
        """Cache tokens (batch 1) a new session can have: the free ones, those of sessions idle now, which an open
        waits for and preempts (when preemption comes within MAX_ADMISSION_WAIT_S), and those lent past a share
        (server/cache_room.py), each session counted once. Announced for routing."""
        sessions, idle_soon = list(self.sessions.values()), self.limits.preempt_idle_s <= MAX_ADMISSION_WAIT_S
        free = cache_room.available_bytes(
            sessions, self.budget.free_bytes, self.peer_cache_bytes, idle_soon, time.monotonic()
        )
        return free // self.budget.bytes_per_token

    def get(self, client_peer: str, session_id: str) -> ServerSession | None:
        """The session `client_peer` opened as `session_id`, if it is open."""
        return self.sessions.get((client_peer, session_id))

    def named(self, session_id: str) -> list[ServerSession]:
        """Every open session of id `session_id`, whoever opened it (several peers may use one id), oldest first."""
        return [session for session in self.sessions.values() if session.session_id == session_id]

    def holds(self, session: ServerSession) -> bool:
        """Whether `session` is still open (not closed, and not replaced by a later open of the same key)."""
        return self.sessions.get(session.key) is session

    def queued_steps(self) -> int:
        return sum(session.inbox.qsize() for session in self.sessions.values())

    def open(
        self, request: OpenSession, *, client_peer: str, blocks: tuple[int, int], cache, reply: Channel, claim=None
    ) -> ServerSession:
        """Reserve the session's first chunk of cache and register it, preempting idle sessions when the node is
        full. An id this peer already has open here ends that session when it has no step under way (the owner opens
        it again after losing its channel: failover to the same node); with one under way, BadRequestError. Raises
        TooManySessionsError (draining, node limit), BadRequestError (batch or length out of range),
        QuotaExceededError (the peer's share), CacheBudgetError (the node's budget). `claim`: the sessions revoked
        for this open so far (`open_when_room`'s tries are one claim)."""
        limits = self.limits
        if self.draining:
            raise TooManySessionsError("node is draining and accepts no new sessions")
        if (old := self.sessions.get((client_peer, request.session_id))) is not None:
            if self._step_under_way(old):
                raise BadRequestError(f"session {request.session_id!r} is already open on this node, a step under way")
            logger.info("session %s of %s opened again by its owner: the old one ended", old.session_id, client_peer)
            self.end(old, BadRequestError(f"session {old.session_id!r} was opened again by its owner"))
        if request.batch > min(limits.max_batch, self.step_tokens):  # a step is at least a token a row
            raise BadRequestError(f"batch must be in 1..{min(limits.max_batch, self.step_tokens)}, got {request.batch}")
        if request.max_length > limits.max_length:
            raise BadRequestError(f"max_length must be in 1..{limits.max_length}, got {request.max_length}")
        budget = self.budget
        if budget.session_bytes(request.batch, request.max_length) > budget.capacity_bytes:
            raise CacheBudgetError(
                f"a cache of batch {request.batch} x {request.max_length} tokens is larger than this node's whole "
                f"budget ({budget.capacity_bytes // budget.bytes_per_token} tokens of batch 1); use a shorter "
                "max_length or another node"
            )
        if (opened := len(self._of_peer(client_peer))) >= limits.max_sessions_per_peer:
            raise QuotaExceededError(
                f"peer already has {opened} open sessions here, the per-peer limit (node setting max_sessions_per_peer)"
            )
        tokens = min(request.max_length, RESERVE_CHUNK_TOKENS)
        # every refusal of this peer's own comes before an idle session of anyone is ended to make room
        self._check_peer_share(client_peer, request.batch, tokens)
        if len(self.sessions) >= limits.max_sessions:
            self._preempt_idle(slots=1)
            if len(self.sessions) >= limits.max_sessions:
                raise TooManySessionsError(f"node has {len(self.sessions)} active sessions, its limit")
        reserved = self._reserve(request.batch, tokens, for_peer=client_peer, claim=claim)  # raises CacheBudgetError
        session = ServerSession(
            session_id=request.session_id,
            batch=request.batch,
            max_length=request.max_length,
            reserved_bytes=reserved,
            reserved_tokens=tokens,
            cache=cache,
            blocks=blocks,
            client_peer=client_peer,
            upstream_peer=request.upstream or client_peer,
            next_peer=request.next,
            reply=reply,
            output_codec=request.output_codec,
            room=asyncio.Semaphore(limits.max_queued_steps),
        )
        session.apply_lane_settings(request.lane)
        self.sessions[session.key] = session
        self.idle.clear()
        logger.debug(
            "opened session %s (batch %d, max_length %d)", session.session_id, session.batch, session.max_length
        )
        return session

    @contextlib.contextmanager
    def opening(self, client_peer: str, session_id: str):
        """A place for an open under way, which may wait (for its adapter, for room): the session ids a peer has open
        here and is opening stay within its session quota (QuotaExceededError at once otherwise). No bound in all:
        that would let identities that wait hold every place; each is bounded by its own wait."""
        under_way = self._opens.get(client_peer, Counter())  # kept only while the peer has an open under way
        held = {key[1] for key in self.sessions if key[0] == client_peer}
        repeats = sum(under_way.values()) - len(under_way)  # opens of an id already being opened: each holds a place
        if (
            len(held | set(under_way) | {session_id}) + repeats + (session_id in under_way)
            > self.limits.max_sessions_per_peer
        ):
            waiting = f" and {sum(under_way.values())} opens under way" if under_way else ""
            raise QuotaExceededError(
                f"peer already has {len(held)} open sessions here{waiting}, the per-peer limit (node setting "
                "max_sessions_per_peer)"
            )
        self._opens[client_peer] = under_way
        under_way[session_id] += 1
        try:
            yield
        finally:
            under_way[session_id] -= 1
            if not under_way[session_id]:
                del under_way[session_id]
            if not under_way:
                self._opens.pop(client_peer, None)

    async def open_when_room(self, request: OpenSession, **kwargs) -> ServerSession:
        """`open`, but when the node is full of sessions that are about to count as idle, wait (at most
        `preempt_idle_s`) for the first to become preemptible and try again: an honest client is admitted rather
        than refused while throwaway sessions hold the node. The same errors as `open`."""
        deadline = time.monotonic() + min(self.limits.preempt_idle_s, MAX_ADMISSION_WAIT_S)
        key = (kwargs["client_peer"], request.session_id)
        if (old := self.sessions.get(key)) is not None and self._step_under_way(old):
            # the owner's old session of this id has a step under way: one reopen waits for it to end
            if key in self._reopening:
                raise BadRequestError(f"session {request.session_id!r} is already being opened again on this node")
            self._reopening.add(key)
            try:
                # a flag and a queue, not an event: polled, by one waiter a session, for seconds at most
                while self._step_under_way(old) and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(REOPEN_POLL_S)
            finally:
                self._reopening.discard(key)
        with self._claim() as claim:  # the sessions revoked for this open, over its tries
            while True:
                try:
                    return self.open(request, claim=claim, **kwargs)
                except (TooManySessionsError, CacheBudgetError) as refused:
                    revoked = isinstance(refused, CacheBudgetError) and self.revoked_bytes(claim)  # end after steps
                    wait_s = REOPEN_POLL_S if revoked else self._next_preemptible_s()
                    never = self.budget.session_bytes(request.batch, request.max_length) > self.budget.capacity_bytes
                    if never or self.draining or wait_s is None or time.monotonic() + wait_s > deadline:
                        raise
                if revoked:
                    await self._wait_for_revoked()
                else:
                    await asyncio.sleep(wait_s + 0.01)

    @contextlib.contextmanager
    def _claim(self):
        """A claim on the cache of the sessions revoked for one open or growth, while it is under way; those of a
        claim that ended go to the next that makes room (`_make_room`)."""
        claim = object()
        self._claims.add(claim)
        try:
            yield claim
        finally:
            self._claims.discard(claim)

    def _step_under_way(self, session: ServerSession) -> bool:
        return self.holds(session) and (session.busy or not session.inbox.empty())

    def _next_preemptible_s(self) -> float | None:
        """Seconds until the first session not working now has been idle `preempt_idle_s`; None if none."""
        now = time.monotonic()
        waiting = [
            session.last_active + self.limits.preempt_idle_s - now
            for session in self.sessions.values()
            if not session.computing  # (duplicates and requests it keeps queued are no work: idle_s)
        ]
        return max(0.0, min(waiting)) if waiting else None

    async def grow(self, session: ServerSession, tokens: int) -> None:
        """Cover `tokens` per row: doubling (up to max_length) as far as its peer's share allows, ending sessions for
        room (waiting GROW_WAIT_S for revoked ones); when `tokens` alone is past the share, borrowing free cache
        (server/cache_room.py). Quota/CacheBudgetError."""
        if tokens <= session.reserved_tokens:
            return
        with self._claim() as claim:
            await self._grow(session, tokens, claim, time.monotonic() + GROW_WAIT_S)

    async def _grow(self, session: ServerSession, tokens: int, claim, deadline: float) -> None:
        peer, budget = session.client_peer, self.budget
        while True:
            if session.revoked is not None:  # ends after this step: it makes no room for itself
                raise SessionPreemptedError(session.revoked.message)
            target = min(session.max_length, max(tokens, 2 * session.reserved_tokens))
            if (within := self._share_cap(session, tokens)) is not None:
                target = min(target, within)
                try:
                    more = target - session.reserved_tokens
                    extra, lent = self._reserve(session.batch, more, keep=session, for_peer=peer, claim=claim), 0
                except CacheBudgetError:
                    if not self.revoked_bytes(claim) or time.monotonic() > deadline:
                        raise
                    await self._wait_for_revoked()
                    if not self.holds(session):  # the node dropped it (a move, a stop)
                        raise SessionPreemptedError("the session was closed while it waited for room") from None
                    continue
            else:  # borrowed, as far as the free cache goes; refused when not even the step fits in it
                row_bytes = session.batch * budget.bytes_per_token
                target = min(target, session.reserved_tokens + budget.free_bytes // row_bytes)
                if target < tokens or self._waiting:  # nothing to lend, or what is freed is for a waiter
                    more = tokens - session.reserved_tokens  # what the step needs, past the share: refused
                    self._check_peer_share(peer, session.batch, more, whole=tokens, lending=True)
                extra = budget.reserve(session.batch, target - session.reserved_tokens)
                lent = min(extra, self._charged(peer) + extra - self.peer_cache_bytes)  # the part past the share
            break
        session.lent_bytes += lent
        session.reserved_bytes += extra
        session.reserved_tokens = target

    def _share_cap(self, session: ServerSession, tokens: int) -> int | None:
        """The tokens per row `session` may reach within its peer's share, when `tokens` fits in it (None: past it).
        A share of the whole node is none: the budget decides."""
        if self.peer_cache_bytes >= self.budget.capacity_bytes:
            return session.max_length
        row_bytes = session.batch * self.budget.bytes_per_token
        cap = session.reserved_tokens + max(0, self.peer_cache_bytes - self._charged(session.client_peer)) // row_bytes
        return cap if tokens <= cap else None

    def _of_peer(self, peer: str) -> list[ServerSession]:
        return [session for session in self.sessions.values() if session.client_peer == peer]

    def _check_peer_share(
        self, peer: str, batch: int, tokens: int, *, whole: int | None = None, lending: bool = False
    ) -> None:
        """QuotaExceededError when `batch` x `tokens` more (`whole` once grown) take `peer` past its share; checked
        before anything is reserved or ended for it. A share of the whole node is none: the budget decides."""
        held, budget = self._charged(peer), self.budget
        if budget.capacity_bytes > self.peer_cache_bytes < held + budget.session_bytes(batch, tokens):
            per_token = budget.bytes_per_token
            raise QuotaExceededError(
                f"a cache of batch {batch} x {whole or tokens} tokens would take this peer past its share of the "
                f"node's cache ({self.peer_cache_bytes // per_token} tokens of batch 1, of which {held // per_token} "
                f"are held){', and the node has no cache to lend it now' if lending else ''}"
            )

    def _reserve(
        self, batch: int, tokens: int, keep: ServerSession | None = None, *, for_peer: str | None = None, claim=None
    ) -> int:
        """Reserve `batch` x `tokens` for `for_peer` (within its share), ending sessions (never `keep`) when they
        are what stands in the way (server/cache_room.py). CacheBudgetError while the room is not there (yet: a
        revoked session frees its bytes after its step)."""
        need = self.budget.session_bytes(batch, tokens)
        if need > self.budget.free_bytes:
            claim = object() if claim is None else claim  # none: a request of one try
            self._make_room(need - self.budget.free_bytes, keep=keep, for_peer=for_peer, claim=claim)
        return self.budget.reserve(batch, tokens)  # raises CacheBudgetError

    def _charged(self, peer: str) -> int:  # a revoked session's too: what it frees is for the peer waiting for it
        return sum(session.reserved_bytes for session in self._of_peer(peer))

    async def _wait_for_revoked(self) -> None:  # a poll's wait; nothing is lent meanwhile: what they free is ours
        self._waiting += 1
        try:
            await asyncio.sleep(REOPEN_POLL_S)
        finally:
            self._waiting -= 1

    def revoked_bytes(self, claim) -> int:
        """Bytes freed when the sessions revoked for `claim` (an open's or a growth's) end after their steps."""
        return sum(
            session.reserved_bytes
            for session in self.sessions.values()
            if session.revoked is not None and session.revoked_for is claim
        )

    def _make_room(self, nbytes: int, *, keep: ServerSession | None, for_peer: str | None, claim) -> None:
        # what the sessions revoked for this request free is coming, and so is what those revoked for a request that
        # is over free, as much of it as this one needs (those revoked for another under way are that one's)
        now = time.monotonic()
        revoked = [session for session in self.sessions.values() if session.revoked is not None]
        coming = sum(session.reserved_bytes for session in revoked if session.revoked_for is claim)
        for session in revoked:  # those of a request that is over, unless stalled (cache_room.STALLED_REVOKE_S)
            free = session.revoked_for not in self._claims and session.revoked_for is not claim
            if coming < nbytes and free and not cache_room.stalled(session, now):
                session.revoked_for = claim
                coming += session.reserved_bytes
        nbytes -= coming
        room = cache_room.choose(
            list(self.sessions.values()), nbytes, keep=keep, for_peer=for_peer, share_bytes=self.peer_cache_bytes,
            idle_after_s=self.limits.preempt_idle_s, now=now, under_way=self._step_under_way,
        )  # fmt: skip
        if nbytes <= 0 or room is None:
            return
        for session in room.idle:
            self.preempt(session, now - session.last_active)
        for session in room.lent:
            self.end(session, self._taken_back(session))
        for session in room.revoke:  # ended by its run after the step under way (InferenceService._run)
            session.revoked, session.revoked_for, session.revoked_s = self._taken_back(session), claim, now

    def _taken_back(self, session: ServerSession) -> SessionPreemptedError:
        logger.info("session %s of %s holds lent cache: taken back", session.session_id, session.client_peer)
        if self.metrics is not None:
            self.metrics.preempted_sessions_total.inc()
        return SessionPreemptedError(cache_room.TAKEN_BACK)

    def _preempt_idle(self, *, slots: int) -> None:
        """End `slots` idle sessions, or none if fewer are idle: the sessions of the peer holding the most go
        first, then the longest idle (room in the cache: `_make_room`)."""
        now = time.monotonic()
        holding = Counter(session.client_peer for session in self.sessions.values())
        idle = [session for session in self.sessions.values() if session.idle_s(now) >= self.limits.preempt_idle_s]
        idle.sort(key=lambda session: (-holding[session.client_peer], session.last_active))
        if len(idle) >= slots:
            for session in idle[:slots]:
                self.preempt(session, now - session.last_active)

    def adapter_preemptible_in_s(self) -> float | None:
        """Seconds until the first session holding an adapter, and not working now, has been idle
        `preempt_idle_s`; None if there is none."""
        now = time.monotonic()
        waiting = [
            session.last_active + self.limits.preempt_idle_s - now
            for session in self.sessions.values()
            if session.adapter is not None and not session.computing
        ]
        return max(0.0, min(waiting)) if waiting else None

    def preempt_idle_adapter_session(self) -> bool:
        """End one idle session that holds a LoRA adapter, to let the adapter budget make room: of the peer holding
        the most adapter bytes, the longest idle. False when no such session is idle."""
        now = time.monotonic()
        idle = [
            session
            for session in self.sessions.values()
            if session.adapter is not None and session.idle_s(now) >= self.limits.preempt_idle_s
        ]
        if not idle:
            return False
        holding = Counter()
        for session in self.sessions.values():
            if session.adapter is not None:
                holding[session.client_peer] += session.adapter.nbytes
        victim = min(idle, key=lambda session: (-holding[session.client_peer], session.last_active))
        self.preempt(victim, now - victim.last_active)
        return True

    def preempt(self, session: ServerSession, idle_s: float) -> None:
        """End an idle session at once to make room: its owner is told (typed), its cache freed."""
        error = SessionPreemptedError(f"session idle for {idle_s:.0f} s was ended to admit another: the node is full")
        logger.info("session %s of %s idle for %.0f s: preempted", session.session_id, session.client_peer, idle_s)
        self.end(session, error)
        if self.metrics is not None:
            self.metrics.preempted_sessions_total.inc()

    def end(self, session: ServerSession, error: Exception) -> None:
        """End a session with no step under way at once: its owner is told (typed, on its stream and ahead of the
        close on the lanes it reads: whichever it reads first says why), its cache freed."""
        for channel in (session.reply, session.output, *session.inbound):
            with contextlib.suppress(Exception):  # the owner may be gone already
                channel.send(frame(ErrorReply.of(error)))
        session.inbox.put_nowait(END_OF_SESSION)
        self.close(session)

    def close(self, session: ServerSession) -> None:
        """Free the session's cache and channels (the client's stream is its handler's to close)."""
        if not self.holds(session):
            return
        del self.sessions[session.key]
        self.budget.release(session.reserved_bytes)
        if session.release_adapter is not None:
            session.release_adapter()
            session.release_adapter = None
        session.adapter = None
        session.cache = None
        session.close_channels()
        session.last_output = None
        session.outputs.clear()
        if not self.sessions:
            self.idle.set()
        logger.debug("closed session %s", session.session_id)

    def end_all(self) -> None:
        """Ask every session to end after the steps already in its queue."""
        for session in list(self.sessions.values()):
            session.inbox.put_nowait(END_OF_SESSION)

    def drop_all(self) -> None:
        """Close every session still open now, freeing its cache (a stuck one, after end_all asked it to end)."""
        for session in list(self.sessions.values()):
            session.inbox.put_nowait(END_OF_SESSION)
            self.close(session)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every session to close; whether they did."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout=timeout_s)
        return not self.sessions

    # ---- step ingress ------------------------------------------------------------------------------------------

    def find(self, session_id: str | None, owner: str | None, *, sender: str) -> ServerSession:
        """The session a push from `sender` names: `owner`'s session `session_id` (a pushing node names the peer that
        opened the session). A push without an owner takes the one session of that id whose upstream is `sender`.
        SessionNotFoundError when none is open; BadRequestError when `sender` is not the upstream of any, or of
        several (it must name the owner)."""
        name = session_id[:MAX_ID_LENGTH] if session_id else None
        if owner is not None:
            session = self.get(owner, session_id) if session_id is not None else None
            if session is None:
                raise SessionNotFoundError(f"no open session {name!r} of {owner[:MAX_ID_LENGTH]!r} on this node")
            return session
        named = self.named(session_id) if session_id is not None else []
        if not named:
            raise SessionNotFoundError(f"no open session {name!r} on this node")
        upstream_of = [session for session in named if session.upstream_peer == sender]
        if not upstream_of:
            raise BadRequestError("push from a peer that is not this session's upstream")
        if len(upstream_of) > 1:
            raise BadRequestError(f"several sessions {name!r} take pushes from this peer: name the session's owner")
        return upstream_of[0]

    async def admit(self, session: ServerSession, item: Inbound, *, sender: str | None, wait: bool) -> None:
        """Queue a step for `session`. From a pusher (`sender`: the peer on a libp2p push; None on a data lane, whose
        key authenticates it) only plain steps of the session's upstream are taken, and a full queue refuses
        (QuotaExceededError); the client's own stream (`wait`) instead waits for room, so a client sending faster
        than the node computes is slowed by TCP. Raises BadRequestError for a push that is not the upstream's or
        that carries anything but a step."""
        if not wait:
            if sender is not None and sender != session.upstream_peer:
                raise BadRequestError("push from a peer that is not this session's upstream")
            if not isinstance(item.message, Step) or item.message.replay:
                raise BadRequestError("session control and replay come on the session's own stream only")
            if session.room.locked():
                raise QuotaExceededError(
                    f"session {session.session_id[:MAX_ID_LENGTH]!r} already has {self.limits.max_queued_steps} "
                    "steps waiting"
                )
        await session.room.acquire()  # a pusher: free, so this does not wait
        session.inbox.put_nowait(item)


__all__ = ["END_OF_SESSION", "Inbound", "ServerSession", "SessionKey", "SessionTable"]

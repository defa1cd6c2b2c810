"""The training memory of a node (`max_training_mb`) and each peer's share of it (`max_cache_share_per_peer`), for
server/training.py's sessions.

What a session holds: from its open to its end, four float32 copies of its slice and room for its replicas'
gradients from other nodes (training_state.fixed_bytes), reserved while the open builds them; then the inputs of
its forwards that wait for their backward pass, and their autograd graphs while kept. What takes a peer past its
share is borrowed: it takes free memory only (and what gives way to anyone, 1 and 2 below), and it is the first to
go when a peer within its share needs the room. Room for a request (`make_room`), in this order:
  1. saved forwards whose backward pass is overdue (waiting past the step timeout an honest chain answers within),
     of sessions that have answered no request for as long (not answering one now);
  2. kept autograd graphs of other sessions not answering a request now (their backward passes recompute from the
     inputs instead);
  3. for a peer within its share only: saved forwards of peers past their share (what they borrowed from free
     memory), the newest first, of sessions not answering a request now;
  4. for an open of a peer within its share (or one at the session limit): idle sessions
     (TrainingService._preemptible), the longest idle first, then sessions opened past their peer's share (`lent`)
     while it still is past it, the newest first: ended, their owners told why (preempted: they fail over, blaming
     nobody). A forward ends no session: a whole one for a few bytes would be too much.
All or nothing: a request that would not fit even then is refused with nothing given way (`_free` puts back what
it dropped, and an open is tried on the side, `could_take`, before it builds and before anyone is ended for it).
A dropped forward's backward pass, if it comes, is refused as preempted (its client fails over, blaming nobody).
So a peer alone on a node may use all of its memory, and a peer within its share gets back what others borrowed;
what a peer holds within its share is taken from it only once its sessions idle. A peer past its share ends nobody.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from nesa_node.errors import AdapterBudgetError, SessionPreemptedError

if TYPE_CHECKING:
    from nesa_node.server.training_state import TrainingSession

logger = logging.getLogger(__name__)

__all__ = ["TrainingRoom"]


class TrainingRoom:
    """The training memory of a TrainingService's sessions (module docstring)."""

    def __init__(self, service):
        self.service = service  # server/training.py TrainingService: its sessions, limits, preemption
        self.opening: Counter[str] = Counter()  # peer -> bytes reserved for its opens being built

    @property
    def max_bytes(self) -> int:
        return int(self.service.limits.max_training_mb * 2**20)

    @property
    def share_bytes(self) -> int | None:
        """What one peer's sessions may hold of it, borrowing aside (None: a share of the whole node is no limit)."""
        share = self.service.limits.max_cache_share_per_peer
        return None if share >= 1 else int(self.max_bytes * share)

    @property
    def used_bytes(self) -> int:
        return sum(session.state_bytes for session in self.service.sessions.values()) + self.opening.total()

    def peer_bytes(self, peer: str) -> int:
        """What `peer`'s sessions hold, and its opens being built."""
        held = sum(session.state_bytes for session in self.service.sessions.values() if session.client_peer == peer)
        return held + self.opening[peer]

    def within_share(self, peer: str, nbytes: int) -> bool:
        share = self.share_bytes
        return share is None or self.peer_bytes(peer) + nbytes <= share

    @contextlib.contextmanager
    def building(self, peer: str, nbytes: int, what: str):
        """Hold `nbytes` for an open of `peer` while its state is built, refused (AdapterBudgetError) when it could
        not be admitted (`could_take`) or opens being built would take all of the memory. Given back on the way out,
        however the build ends."""
        fits = self.opening.total() + nbytes <= self.max_bytes and self.could_take(nbytes, peer=peer)
        if not fits:
            raise AdapterBudgetError(
                f"{what} of {nbytes} bytes does not fit: {self.used_bytes} of max_training_mb ({self.max_bytes} "
                "bytes) are taken or being built, and no session may be ended for it"
            )
        self.opening[peer] += nbytes
        try:
            yield
        finally:
            self.opening[peer] -= nbytes
            if self.opening[peer] <= 0:
                del self.opening[peer]

    def could_take(self, nbytes: int, *, peer: str, slots: int = 0) -> bool:
        """Whether a new session of `peer` holding `nbytes` would fit once what may give way has, sessions that may
        be ended for it included (at least `slots` of them: places in the session limit): tried on the side, nothing
        changes (an open checks it before it builds, and before anyone is ended for it)."""
        return self._plan(nbytes, peer=peer, keep=None, preempt=True, slots=slots) is not None

    def make_room(
        self, nbytes: int, refusal: str, *, peer: str, keep: TrainingSession | None, preempt: bool, slots: int = 0
    ) -> None:
        """Room for `nbytes` more of `peer`'s (module docstring: what gives way, in order), sessions other than
        `keep` giving it, and with `preempt` (an open) at least `slots` sessions ended; AdapterBudgetError(`refusal`)
        when nothing more can, with nothing given way (a request refused anyway takes nothing from anyone).
        Synchronous: the caller takes the room right after."""
        plan = self._plan(nbytes, peer=peer, keep=keep, preempt=preempt, slots=slots)
        if plan is None:
            raise AdapterBudgetError(
                f"{refusal}: {self.used_bytes} of max_training_mb ({self.max_bytes} bytes) are taken"
            )
        for victim, why in plan:
            logger.info("training session %s of %s ended to make room: %s", victim.session_id, victim.client_peer, why)
            self.service._end(victim, SessionPreemptedError(f"training session ended: {why}"))
        if not self._free(nbytes, peer=peer, keep=keep):  # as planned (nothing awaited since)
            raise AdapterBudgetError(
                f"{refusal}: {self.used_bytes} of max_training_mb ({self.max_bytes} bytes) are taken"
            )

    def _plan(
        self, nbytes: int, *, peer: str, keep: TrainingSession | None, preempt: bool, slots: int
    ) -> list[tuple[TrainingSession, str]] | None:
        """The sessions to end so that `nbytes` more of `peer`'s fit once what may give way has, and at least `slots`
        are ended: the fewest, taken in the order `_enders` gives, each only while it may still be ended (a lent one
        while its peer is still past its share once those before it are gone); None when none does. Tried on the
        side: nothing changes."""
        if not slots and self._free(nbytes, peer=peer, keep=keep, commit=False):
            return []
        sessions, gone, plan = self.service.sessions, {}, []
        try:
            for victim, why, lent in self._enders(nbytes, peer=peer, keep=keep, preempt=preempt):
                share = self.share_bytes
                if lent and (share is None or self.peer_bytes(victim.client_peer) <= share):
                    continue
                key = (victim.client_peer, victim.session_id)
                gone[key] = sessions.pop(key)
                plan.append((victim, why))
                if len(plan) >= slots and self._free(nbytes, peer=peer, keep=keep, commit=False):
                    return plan
            return None
        finally:
            sessions.update(gone)

    def _enders(
        self, nbytes: int, *, peer: str, keep: TrainingSession | None, preempt: bool
    ) -> list[tuple[TrainingSession, str, bool]]:
        """Sessions that may be ended for an open (`preempt`) of `peer` within its share holding `nbytes`, in the order
        they would be, with why and whether each is lent: idle ones (TrainingService._preemptible), the longest idle
        first, then sessions opened past their peer's share (`lent`), the newest first. None for a forward, or for a
        peer past its share (what it borrows is free memory only)."""
        if not preempt or not self.within_share(peer, nbytes):
            return []
        now = time.monotonic()
        idle = sorted(
            (session for session in self.service._preemptible(now) if session is not keep),
            key=lambda session: session.last_active,
        )
        enders = [
            (session, f"idle for {now - session.last_active:.0f} s, and the node is full", False) for session in idle
        ]
        listed = {id(session) for session in idle}
        lenders = [
            session
            for session in self._givers(keep)
            if session.lent and session.client_peer != peer and id(session) not in listed
        ]
        why = (
            "it was opened past its peer's share of max_training_mb (max_cache_share_per_peer), and a peer within its "
            "share needs the room"
        )
        enders += [
            (session, why, True) for session in sorted(lenders, key=lambda session: session.opened, reverse=True)
        ]
        return enders

    def _free(self, nbytes: int, *, peer: str, keep: TrainingSession | None, commit: bool = True) -> bool:
        """Whether there is room for `nbytes` more of `peer`'s once what may give way without ending a session has
        (steps 1 to 3 of the module docstring). All or nothing: when it is not enough (or without `commit`), what was
        dropped on the way is put back."""
        undo: list = []
        fits = False
        try:
            while self.used_bytes + nbytes > self.max_bytes:
                if not (
                    self._drop_overdue(keep, undo)
                    or self._drop_graphs(keep, undo)
                    or (self.within_share(peer, nbytes) and self._take_back(keep, undo))
                ):
                    break
            fits = self.used_bytes + nbytes <= self.max_bytes
        finally:
            if not (fits and commit):
                for action in reversed(undo):
                    action()
        return fits

    def _drop_overdue(self, keep: TrainingSession | None, undo: list) -> bool:
        """Drop the saved forwards whose backward pass is overdue (waiting longer than `idle_limit_s` gives a forward)
        of sessions other than `keep` not answering a request now. Whether any was."""
        limits = self.service.limits
        limit_s = max(limits.preempt_idle_s, limits.step_timeout_s)
        now, dropped = time.monotonic(), False
        for session in self._givers(keep):
            if now - session.last_active < limit_s:  # stepping: its forwards wait for a chain that is running
                continue
            for step_id in [step_id for step_id, saved in session.saved.items() if now - saved.at >= limit_s]:
                self._drop_saved(session, step_id, undo)
                dropped = True
        return dropped

    def _drop_graphs(self, keep: TrainingSession | None, undo: list) -> bool:
        """Forget the kept autograd graphs of sessions other than `keep` not answering a request now (their backward
        passes recompute from the inputs). Whether any was kept."""
        kept = [(saved, saved.graph, saved.graph_bytes) for session in self._givers(keep)
                for saved in session.saved.values() if saved.graph_bytes]  # fmt: skip

        def put_back() -> None:
            for saved, graph, size in kept:
                saved.graph, saved.graph_bytes = graph, size

        for saved, _, _ in kept:
            saved.graph, saved.graph_bytes = None, 0
        undo.append(put_back)
        return bool(kept)

    def _take_back(self, keep: TrainingSession | None, undo: list) -> bool:
        """Drop the newest saved forward of a peer past its share (of a session other than `keep` not answering a
        request now). Whether there was one."""
        share = self.share_bytes
        if share is None:
            return False
        over = {peer for peer in {session.client_peer for session in self.service.sessions.values()}
                if self.peer_bytes(peer) > share}  # fmt: skip
        newest = max(
            ((saved.at, session, step_id) for session in self._givers(keep) if session.client_peer in over
             for step_id, saved in session.saved.items()),
            key=lambda entry: entry[0],
            default=None,
        )  # fmt: skip
        if newest is None:
            return False
        self._drop_saved(newest[1], newest[2], undo)
        return True

    @staticmethod
    def _drop_saved(session: TrainingSession, step_id: str, undo: list) -> None:
        order, dropped = list(session.saved.items()), list(session.dropped)

        def put_back() -> None:
            session.saved.clear()
            session.saved.update(order)
            session.dropped.clear()
            session.dropped.update(dict.fromkeys(dropped))

        session.drop_saved(step_id)
        undo.append(put_back)

    def _givers(self, keep: TrainingSession | None) -> list[TrainingSession]:
        return [session for session in self.service.sessions.values() if session is not keep and not session.busy]

"""Admission of peers' streams of one kind, decided before a byte of them is read (RELIABILITY.md G6): a peer
that opens streams and holds them, or opens them over and over, is refused with a typed error once it has its share,
and all peers together are bounded too (AnswerGate). Streams that become long-lived once they say what they are for
are bounded while they have not yet said it (OpeningGate)."""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable

from nesa_node.errors import QuotaExceededError


class AnswerGate:
    """Admission of peers' streams of one kind: `enter(peer)` before serving one, the returned call when done. At
    most `max_running` at once in all, `max_running_per_peer` of one peer, and `max_per_window` started by one peer
    per `window_s`. `what` names the streams in the refusals, `hint` says what to do when the node is full. `now` is
    the clock (time.monotonic)."""

    def __init__(
        self,
        *,
        max_running: int,
        max_running_per_peer: int,
        max_per_window: int,
        window_s: float,
        what: str = "requests",
        hint: str = "ask again later",
        now=time.monotonic,
    ):
        self.max_running, self.max_running_per_peer = max_running, max_running_per_peer
        self.max_per_window, self.window_s = max_per_window, window_s
        self.what, self.hint = what, hint
        self.now = now
        self.running: Counter[str] = Counter()
        self.recent: dict[str, deque[float]] = {}  # peer -> when its streams in the window started

    @classmethod
    def per_minute(cls, running: int, per_peer: int, per_minute: int, what: str, hint: str = "ask again later"):
        """A gate of `running` streams at once, `per_peer` of one peer, `per_minute` started by one peer a minute."""
        return cls(
            max_running=running,
            max_running_per_peer=per_peer,
            max_per_window=per_minute,
            window_s=60.0,
            what=what,
            hint=hint,
        )

    def enter(self, peer: str):
        """Admit one stream of `peer`: the call that ends it (once). Raises QuotaExceededError, naming the limit,
        when the node serves its most streams at once, the peer its share, or the peer asked its most this window."""
        now = self.now()
        for known in [known for known, times in self.recent.items() if times[-1] <= now - self.window_s]:
            del self.recent[known]  # peers quiet for a whole window are forgotten: the table stays small
        times = self.recent.get(peer, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if sum(self.running.values()) >= self.max_running:
            raise QuotaExceededError(f"this node answers {self.max_running} {self.what} at once; {self.hint}")
        if self.running[peer] >= self.max_running_per_peer:
            raise QuotaExceededError(f"a peer may have {self.max_running_per_peer} {self.what} under way at once")
        if len(times) >= self.max_per_window:
            raise QuotaExceededError(
                f"a peer may send {self.what} {self.max_per_window} times per {self.window_s:.0f} s"
            )
        times.append(now)
        self.recent[peer] = times
        self.running[peer] += 1
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self.running[peer] -= 1
                if not self.running[peer]:
                    del self.running[peer]

        return leave


class OpeningGate:
    """Streams from their opening until they settle (say what they are for, after which limits of their own hold
    them): at most `max_per_peer` of one peer (of the kinds capped), a stream over that refused with a typed error,
    and `max_opening` in all. A stream over the total evicts one instead of being refused: the oldest of the peer
    with the most streams opening (its `evict` call is made). An honest peer's streams settle within milliseconds of
    opening, so the ones evicted are those held idle, and identities that fill the node cannot keep another peer's
    streams out."""

    def __init__(self, *, max_opening: int, max_per_peer: int, what: str = "streams opening"):
        self.max_opening, self.max_per_peer, self.what = max_opening, max_per_peer, what
        self.opening: dict[int, tuple[str, Callable[[], None]]] = {}  # token -> (peer, evict), oldest first
        self.per_peer: Counter[str] = Counter()
        self.evicted = 0
        self._tokens = itertools.count()

    def enter(self, peer: str, evict: Callable[[], None], *, capped: bool = True) -> Callable[[], None]:
        """Admit a stream of `peer`: the call that settles it (idempotent). `evict` ends the stream when a newer one
        needs its place. Raises QuotaExceededError when `peer` already has its most streams opening, unless not
        `capped` (a kind an honest peer may open many of at once: it still counts toward the peer's weight)."""
        if capped and self.per_peer[peer] >= self.max_per_peer:
            raise QuotaExceededError(f"a peer may have {self.max_per_peer} {self.what} at once")
        while len(self.opening) >= self.max_opening:
            heaviest = max(self.per_peer.values())
            token = next(token for token, (owner, _) in self.opening.items() if self.per_peer[owner] == heaviest)
            _, victim = self._remove(token)
            self.evicted += 1
            victim()
        token = next(self._tokens)
        self.opening[token] = (peer, evict)
        self.per_peer[peer] += 1
        return lambda: self._remove(token)

    def _remove(self, token: int):
        entry = self.opening.pop(token, None)
        if entry is not None:
            peer = entry[0]
            self.per_peer[peer] -= 1
            if not self.per_peer[peer]:
                del self.per_peer[peer]
        return entry


__all__ = ["AnswerGate", "OpeningGate"]

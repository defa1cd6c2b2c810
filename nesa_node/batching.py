"""When a shared pass over the requests of concurrent members should start: the rule by which a node gathers the
decode steps of its sessions (server/compute.py) and a client the LM head scores of its sessions
(client/head_batch.py).

Requests queue while a pass runs and the next pass takes all of them. What decides batching is the moment a pass
starts when nothing runs. Starting at once gives a lone member no wait, but in a chain of processes the requests of one
round come spread out (the previous node pushes each session's output in turn, the client sends each session's next
step in turn), and sessions that started at different times stay apart: the passes stay small, and a pass costs nearly
the same for one row as for sixteen (the weights are read once). So a pass about to start waits for the members
expected soon:

- every member's requests are timed; its period is the gap between its last two (smoothed), so its next request is
  expected one period after its last;
- a pass waits while a member with no request queued is expected within `window_s` of the oldest queued request (and
  is not already late, below), and starts when the expected members have arrived, when the window is
  over, or at once when no member is expected;
- the wait is also at most half the period of the expected member and of every queued one: two groups of members
  half a round apart or closer merge within a round and then stay merged (the wait is paid once), a fast member waits
  for a slower one at most half its own round, and a member that falls behind stops being waited for once it is
  late by more than `late_s` (the caller's: about one pass) or a quarter of its period, whichever is more;
- members that close are forgotten; one silent for `forget_s` is no longer waited for, and is dropped when a new
  member comes.

Pure logic over times the caller passes in (seconds of one monotonic clock).
"""

from __future__ import annotations

from collections.abc import Collection, Hashable
from dataclasses import dataclass

SMOOTHING = 0.5  # weight of the newest gap in a member's period (its rounds change with the swarm's load: guess)
PERIOD_SHARE = 0.5  # the longest wait for a member, as a share of its period (groups half a round apart merge)
LATE_SHARE = 0.25  # how late a member may be, as a share of its period: arrivals jitter with the round (guess)


@dataclass
class _Member:
    last_s: float  # time of its last request
    period_s: float | None = None  # smoothed gap between its requests; None after its first


class Gathering:
    """The members seen and when each is expected next (module docstring)."""

    # forget_s: a session silent this long has stopped (a decode round is 10-100 ms; a consumer pausing a stream
    # for longer is not worth waiting for: guess)
    def __init__(self, *, window_s: float, forget_s: float = 2.0):
        self.window_s = window_s
        self.forget_s = forget_s
        self._members: dict[Hashable, _Member] = {}

    def __len__(self) -> int:
        return len(self._members)

    def arrived(self, member: Hashable, now: float) -> None:
        """Note a request of `member` at `now`."""
        known = self._members.get(member)
        if known is None:
            self._members[member] = _Member(now)
            self._forget_silent(now)
            return
        gap = now - known.last_s
        known.period_s = gap if known.period_s is None else (1 - SMOOTHING) * known.period_s + SMOOTHING * gap
        known.last_s = now

    def forget(self, member: Hashable) -> None:
        """`member` sends no more requests (its session closed)."""
        self._members.pop(member, None)

    def others_active(self, member: Hashable, now: float) -> bool:
        """Whether a member other than `member` is stepping now: its last request came less than two of its periods
        ago (less than `forget_s` while its period is unknown)."""
        for key, other in self._members.items():
            recent_s = self.forget_s if other.period_s is None else min(self.forget_s, 2 * other.period_s)
            if key != member and now - other.last_s < recent_s:
                return True
        return False

    def wait_s(self, queued: Collection[Hashable], oldest_s: float, now: float, late_s: float) -> float:
        """Seconds a pass should still wait before taking the `queued` members' requests (0: start now); the caller
        asks again when a request arrives. `oldest_s`: when the oldest of them arrived; `late_s`: how late past its
        expected time a member is still waited for at least (the caller's: about one pass)."""
        until = now
        periods = [self._members[key].period_s for key in queued if key in self._members]
        window_s = min([self.window_s] + [PERIOD_SHARE * period for period in periods if period is not None])
        for key, member in self._members.items():
            if member.period_s is None or key in queued or now - member.last_s >= self.forget_s:
                continue
            expected = member.last_s + member.period_s
            deadline = oldest_s + min(window_s, PERIOD_SHARE * member.period_s)
            allowed = expected + max(late_s, LATE_SHARE * member.period_s)
            if expected <= deadline and now <= allowed:
                until = max(until, min(deadline, allowed))
        return until - now

    def _forget_silent(self, now: float) -> None:
        silent = [key for key, member in self._members.items() if now - member.last_s >= self.forget_s]
        for key in silent:
            del self._members[key]


__all__ = ["Gathering"]

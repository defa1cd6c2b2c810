"""Each caller's share of a gateway: at most `limit` requests running or waiting at once per caller, so that one
caller cannot take every generation slot and every waiting place (and leave everyone else 429 `overloaded`).

A caller is an API key when the gateway has keys (gateway/auth.py), else a client address: behind a reverse proxy
every client has the proxy's address, and shares one caller's limit.
"""

from __future__ import annotations

from collections import Counter

from nesa_node.gateway.requests import ApiError

__all__ = ["CallerLimit", "Held", "default_limit"]


def default_limit(max_concurrency: int) -> int:
    """A quarter of the gateway's generation slots, at least one: four callers at their limit fill the gateway, and
    one caller alone gets a useful share (guess)."""
    return max(1, max_concurrency // 4)


class Held:
    """One request's place in its caller's share; `release` gives it back (once, however often it is called)."""

    def __init__(self, limit: CallerLimit, caller: str):
        self._limit, self._caller, self._released = limit, caller, False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limit.release(self._caller)


class CallerLimit:
    """Requests per caller, running or waiting (see the module docstring)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"max_requests_per_caller is at least 1, not {limit}")
        self.limit = limit
        self._held: Counter[str] = Counter()

    def admit(self, caller: str) -> Held:
        """A place for one more request of `caller`; ApiError 429 `too_many_concurrent_requests` when it has `limit`
        requests running or waiting already."""
        if self._held[caller] >= self.limit:
            who = "this API key" if caller.startswith("key:") else "this client address"
            raise ApiError(
                429,
                f"{who} has {self._held[caller]} requests running or waiting, the most one caller may have at once "
                f"on this gateway ({self.limit}): wait for one to end, then retry",
                kind="rate_limit_error",
                code="too_many_concurrent_requests",
            )
        self._held[caller] += 1
        return Held(self, caller)

    def held(self, caller: str) -> int:
        """Requests of `caller` running or waiting now."""
        return self._held[caller]

    def release(self, caller: str) -> None:
        self._held[caller] -= 1
        if self._held[caller] <= 0:
            del self._held[caller]  # callers that come and go leave nothing behind

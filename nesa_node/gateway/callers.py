"""Each caller's share of a gateway: while it holds as many requests (running, waiting or being prepared) as it has
generation slots, a caller with `limit` requests running or waiting gets no more, so that one caller cannot take every waiting place too (and
leave everyone else 429 `overloaded`); while slots are free, a caller may use them past its share (one user of a
local gateway is not held to a quarter of it), and the waiting places that fill once they are taken are left to
others. Requests past the share end in their own time: a stream whose client stops reading ends after the gateway's
send timeout (gateway/streams.py).

A caller is an API key when the gateway has API keys (gateway/auth.py; admin keys count as such), else a client
address (`caller_address`: an IPv6 client's /64, what one host or site is given). That address is the one the HTTP
server reports: behind a reverse proxy on the gateway's own machine that sets X-Forwarded-For, the client's (uvicorn
trusts that header from 127.0.0.1 only); behind any other, the proxy's, and every client behind it shares one
caller's limit.
"""

from __future__ import annotations

import ipaddress
from collections import Counter

from nesa_node.gateway.requests import ApiError

__all__ = ["CallerLimit", "Held", "caller_address", "default_limit"]


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # the well-known prefix: an IPv4 host's address in the last 32 bits


def caller_address(host: str) -> str:
    """The caller a client address is: the address, or for IPv6 its /64 (a single host or site is commonly given a
    whole /64, and could otherwise be as many callers as it likes). IPv6 addresses that stand for an IPv4 host are
    that host (mapped, NAT64, a Teredo client, a 6to4 site: each IPv4 address one caller, not all of a translator's
    or relay's clients one). Link-local addresses are one caller a link (fe80::/64 and the interface, the zone the
    server reports), as a global /64 is: every link's hosts share fe80::/64, and a host can take as many addresses
    in it as it likes."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"address:{host}"
    if address.version == 6:
        zone = address.scope_id
        address = address.__class__(int(address))  # without its zone (fe80::1%eth0)
        teredo = address.teredo
        ipv4 = address.ipv4_mapped or (teredo[1] if teredo else None) or address.sixtofour
        if ipv4 is None and address in NAT64:
            ipv4 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if ipv4 is not None:
            return f"address:{ipv4}"
        if address.is_link_local:
            return f"address:fe80::/64%{zone}" if zone else "address:fe80::/64"
        return f"address:{ipaddress.ip_network(f'{address}/64', strict=False)}"
    return f"address:{address}"


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

    def admit(self, caller: str, *, contended: bool = True) -> Held:
        """A place for one more request of `caller`; ApiError 429 `too_many_concurrent_requests` when it has `limit`
        requests running or waiting already and the gateway is `contended` (module docstring)."""
        if self._held[caller] >= self.limit and contended:
            who = "this API key" if caller.startswith("key:") else "this client address"
            raise ApiError(
                429,
                f"{who} has {self._held[caller]} request(s) running or waiting, and the gateway has as many requests "
                f"as generation slots: one caller may then have at most {self.limit} at once; wait for one to end, "
                "then retry",
                kind="rate_limit_error",
                code="too_many_concurrent_requests",
            )
        self._held[caller] += 1
        return Held(self, caller)

    @property
    def total(self) -> int:
        """Requests of every caller running or waiting now."""
        return self._held.total()

    def held(self, caller: str) -> int:
        """Requests of `caller` running or waiting now."""
        return self._held[caller]

    def release(self, caller: str) -> None:
        self._held[caller] -= 1
        if self._held[caller] <= 0:
            del self._held[caller]  # callers that come and go leave nothing behind

"""Which data lane connections the node takes at all (RELIABILITY.md G6), decided before a byte is read.

A lane connection costs its opener one TCP connect and the node one file descriptor until the hello is done. Without
caps, 2,000 idle connections held the node at its descriptor limit: its DHT announcements then failed and clients
blamed an innocent node. The gate counts connections whose authenticated hello is not done yet ("pending"), in all
and per source address, and those past it ("established"). A new connection is closed at once, unread, when

  - the node is short of file descriptors (fewer than FD_HEADROOM_FRACTION of its soft limit free, or MIN_FREE_FDS),
  - its source already has `max_pending_lanes_per_host` pending connections, or
  - `max_lanes` lanes are established.

At `max_pending_lanes` pending in all, the oldest pending connection is closed to make room instead: an honest hello
takes one round trip, so the oldest is the idlest, and refusing new ones would let a flood from a few dozen addresses
turn away every client's pings (a node whose lane refuses a ping is banned as dead). Refusals are logged at debug, at
most once per REFUSAL_LOG_PERIOD_S.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import time
from collections.abc import Callable

from nesa_node.server.config import NetworkConfig

logger = logging.getLogger(__name__)

# descriptors kept for the node's own work (DHT, libp2p daemon sockets, model files, pushes to the next node); a
# guess: a quarter of the soft limit, and never fewer than 64 (the default soft limit is 1024 on most systems)
FD_HEADROOM_FRACTION = 0.25
MIN_FREE_FDS = 64
FD_COUNT_REFRESH_S = 0.2  # counting /proc/self/fd costs O(open fds): at most this often; admissions count between
REFUSAL_LOG_PERIOD_S = 5.0
IPV6_SOURCE_PREFIX = 64  # one IPv6 host usually holds a whole /64: it counts as one source


def open_fd_count() -> int | None:
    """Descriptors this process has open, or None where the system does not list them."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return None


def fd_soft_limit() -> int | None:
    """The process's RLIMIT_NOFILE soft limit, or None when unlimited or unknown (no `resource` module)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def required_free_fds(soft_limit: int) -> int:
    return max(MIN_FREE_FDS, int(soft_limit * FD_HEADROOM_FRACTION))


class FdHeadroom:
    """Whether the process still has descriptors to spare for one more lane connection.

    The count is refreshed at most every FD_COUNT_REFRESH_S; connections admitted since the last count are added to
    it, so a burst between two counts cannot overshoot (closed ones are noticed at the next count)."""

    def __init__(
        self,
        *,
        soft_limit: Callable[[], int | None] = fd_soft_limit,
        count: Callable[[], int | None] = open_fd_count,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._soft_limit, self._count, self._clock = soft_limit, count, clock
        self._counted: int | None = None
        self._counted_at = -float("inf")
        self._admitted_since = 0

    def admit(self) -> bool:
        """True (and counted) when one more descriptor leaves the headroom intact, or when nothing can be counted."""
        limit = self._soft_limit()
        if limit is None:
            return True
        now = self._clock()
        if now - self._counted_at >= FD_COUNT_REFRESH_S:
            self._counted, self._counted_at, self._admitted_since = self._count(), now, 0
        if self._counted is None:
            return True
        if limit - (self._counted + self._admitted_since + 1) < required_free_fds(limit):  # +1: this connection
            return False
        self._admitted_since += 1
        return True


def source_of(peername: object) -> str:
    """The address a connection counts against: its IP (IPv4-mapped IPv6 as IPv4), an IPv6 address's /64."""
    host = peername[0] if isinstance(peername, tuple) and peername else str(peername)
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.ip_network(f"{address}/{IPV6_SOURCE_PREFIX}", strict=False))
    return str(address)


class LaneAdmission:
    """One admitted connection: pending until `authenticated`, counted until `release` (call it in `finally`)."""

    def __init__(self, gate: LaneGate, source: str, transport: asyncio.BaseTransport | None):
        self.gate, self.source, self.transport = gate, source, transport
        self.state = "pending"

    def authenticated(self) -> None:
        if self.state == "pending":
            self.gate._leave_pending(self)
            self.gate.established += 1
            self.state = "established"

    def release(self) -> None:
        if self.state == "pending":
            self.gate._leave_pending(self)
        elif self.state == "established":
            self.gate.established -= 1
        self.state = "released"

    def evict(self) -> None:
        """Close the connection now (its handler then ends on a failed read) and stop counting it."""
        self.release()
        if self.transport is not None:
            self.transport.abort()


class LaneGate:
    """The counts and caps of the module docstring."""

    def __init__(self, network: NetworkConfig, headroom: FdHeadroom | None = None, *, clock=time.monotonic):
        self.network = network
        self.headroom = headroom if headroom is not None else FdHeadroom()
        self.pending: dict[LaneAdmission, None] = {}  # oldest first
        self.pending_by_source: dict[str, int] = {}
        self.established = 0
        self.refused = 0  # connections closed unread since the node started, evicted ones included
        self._clock = clock
        self._refused_unlogged = 0
        self._logged_at = -float("inf")

    def admit(self, peername: object, transport: asyncio.BaseTransport | None = None) -> LaneAdmission | None:
        """An admission for a new connection from `peername` (its `transport` may be evicted later), or None: close
        it at once, unread."""
        source = source_of(peername)
        reason = self._refusal(source)
        if reason is not None:
            self._log_refusal(source, reason)
            return None
        if len(self.pending) >= self.network.max_pending_lanes:
            oldest = next(iter(self.pending))
            oldest.evict()
            self._log_refusal(oldest.source, f"evicted: {self.network.max_pending_lanes} connections in their hello")
        admission = LaneAdmission(self, source, transport)
        self.pending[admission] = None
        self.pending_by_source[source] = self.pending_by_source.get(source, 0) + 1
        return admission

    def _refusal(self, source: str) -> str | None:
        network = self.network
        if self.pending_by_source.get(source, 0) >= network.max_pending_lanes_per_host:
            return f"{network.max_pending_lanes_per_host} connections from it are still in their hello"
        if self.established >= network.max_lanes:
            return f"{network.max_lanes} lanes are open"
        if not self.headroom.admit():
            return "the process is short of file descriptors"
        return None

    def _leave_pending(self, admission: LaneAdmission) -> None:
        del self.pending[admission]
        left = self.pending_by_source[admission.source] - 1
        if left:
            self.pending_by_source[admission.source] = left
        else:
            del self.pending_by_source[admission.source]

    def _log_refusal(self, source: str, reason: str) -> None:
        """Debug, at most once per REFUSAL_LOG_PERIOD_S: a flood must not become a flood of log lines."""
        self.refused += 1
        self._refused_unlogged += 1
        now = self._clock()
        if now - self._logged_at >= REFUSAL_LOG_PERIOD_S:
            logger.debug(
                "closed %d lane connection(s) unread since the last report; latest from %s: %s",
                self._refused_unlogged,
                source,
                reason,
            )
            self._refused_unlogged, self._logged_at = 0, now


__all__ = [
    "FD_HEADROOM_FRACTION",
    "MIN_FREE_FDS",
    "FdHeadroom",
    "LaneAdmission",
    "LaneGate",
    "fd_soft_limit",
    "open_fd_count",
    "required_free_fds",
    "source_of",
]

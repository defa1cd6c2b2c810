"""What opening a session does with each node's failure or refusal (AsyncDistributedModel.open_session): a node whose
record no longer holds (moved, full, draining) or that failed to open is banned and another chain chosen; one that
cannot get or hold the session's adapter, or refuses for any other reason, is left out of this open only. Any other
refusal the same from a second node is the caller's own to see, as is the refusal of nodes without which no chain
is left. Once the open went through on other nodes, a node that refused it for no routable reason, and that no other
node echoed, is remembered with what was asked (`opened`, RefusedOpens): for REMEMBER_S, later opens asking as much
or more (rows, length) leave it out, so a node refusing every open does not cost every later open an attempt. It is
not banned: a refusal may be an honest node's limit on the request (rows a session, its longest session), and an
open asking less, or one with no chain left without it, asks it again."""

from __future__ import annotations

import logging
import time

from nesa_node.client.chain_links import LinkFailed
from nesa_node.errors import (
    AdapterBudgetError,
    AdapterError,
    AdapterHashError,
    CacheBudgetError,
    NoRouteError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
    WrongBlocksError,
)

logger = logging.getLogger(__name__)

ROUTABLE_REFUSALS = (WrongBlocksError, CacheBudgetError, TooManySessionsError, QuotaExceededError)  # moved, full...
ADAPTER_REFUSALS = (AdapterError, AdapterBudgetError)  # cannot get or hold a session's adapter: route around it
REMEMBER_S = 60.0  # how long a node's refusal of an open is remembered (then it is asked again, an attempt: guess)
PRUNE_AT = 4096  # refusals kept before those over are dropped (identities that came and went)


class RefusedOpens:
    """Nodes that refused an open for a reason of their own, with the least they refused (rows, length) within
    REMEMBER_S (module docstring)."""

    def __init__(self) -> None:
        self._refused: dict[str, tuple[int, int, float]] = {}  # peer -> (batch, max_length, until: monotonic s)

    def note(self, peer_id: str, batch: int, max_length: int) -> None:
        now = time.monotonic()
        if len(self._refused) >= PRUNE_AT:
            self._refused = {peer: known for peer, known in self._refused.items() if known[2] > now}
        known = self._refused.get(peer_id)
        if known is not None and known[2] > now:  # the least asked that it refused
            batch, max_length = min(batch, known[0]), min(max_length, known[1])
        self._refused[peer_id] = (batch, max_length, now + REMEMBER_S)

    def excluded(self, batch: int, max_length: int) -> frozenset[str]:
        """The nodes to leave out of an open of `batch` rows up to `max_length` tokens."""
        now = time.monotonic()
        return frozenset(
            peer
            for peer, (rows, length, until) in self._refused.items()
            if until > now and batch >= rows and max_length >= length
        )


class OpenRefusals:
    """The failures and refusals of one open's attempts (module docstring). `own_adapter`: the session's adapter is
    the client's own (a hash refusal of it is the client's, no node's)."""

    def __init__(self, swarm, *, own_adapter: bool):
        self.swarm = swarm
        self.own_adapter = own_adapter
        self.passed_over: set[str] = set()  # nodes left out of this open only
        self._refused: dict[str, set[str]] = {}  # code -> nodes that refused with it, for no routable reason
        self._last: RequestError | None = None  # the last refusal that left a node out

    def no_route(self, error: NoRouteError) -> Exception:
        """What to raise when no chain is left: the refusal of the nodes left out, if one was."""
        return self._last if self._last is not None else error

    def take(self, error: LinkFailed | RequestError, *, last_attempt: bool) -> None:
        """Note an attempt's failure or refusal and who to route around; raises it when it is the caller's."""
        if isinstance(error, LinkFailed):
            if error.link is None or last_attempt:
                raise error
            logger.info("could not open a session on %s: %s", error.link.peer_id, error)
            self.swarm.ban(error.link.peer_id, fault=error.fault)
            return
        peer_id = getattr(error, "peer_id", None)
        if peer_id is None or last_attempt:
            raise error
        if isinstance(error, ROUTABLE_REFUSALS):  # its record was stale: route around it
            logger.info("%s refused the session: %s", peer_id, error)
            self.swarm.ban(peer_id)
            return
        if isinstance(error, ADAPTER_REFUSALS):  # left out of this open only (its other work is fine)
            if isinstance(error, AdapterHashError) and self.own_adapter:
                raise error  # this client's own bytes do not match its adapter's id: no node will take them
            logger.info("%s refused the session: %s", peer_id, error)
            self.passed_over.add(peer_id)
            return
        # any other refusal: a node that refuses every open must not fail every session routed through it
        nodes = self._refused.setdefault(error.code, set())
        if nodes and peer_id not in nodes:
            raise error
        nodes.add(peer_id)
        logger.info("%s refused the session (%s): trying another chain", peer_id, error)
        self.passed_over.add(peer_id)
        self._last = error

    def opened(self, remembered: RefusedOpens, *, batch: int, max_length: int) -> None:
        """The open (of `batch` rows up to `max_length` tokens) went through: the nodes that refused it for no
        routable reason go into `remembered` (module docstring)."""
        for nodes in self._refused.values():
            for peer_id in nodes:
                remembered.note(peer_id, batch, max_length)


__all__ = ["ADAPTER_REFUSALS", "REMEMBER_S", "ROUTABLE_REFUSALS", "OpenRefusals", "RefusedOpens"]

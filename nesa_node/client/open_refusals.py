"""What opening a session does with each node's failure or refusal (AsyncDistributedModel.open_session): a node whose
record no longer holds (moved, full, draining) or that failed to open is banned and another chain chosen; one that
cannot get or hold the session's adapter, or refuses for any other reason, is left out of this open only. Any other
refusal the same from a second node is the caller's own to see, as is the refusal of nodes without which no chain
is left. Once the open went through on other nodes, a node that refused it for no routable reason, and that no other
node echoed, is banned for a failure (`opened`): a node refusing every open is not asked first again by every later
one (an extra attempt each), and, a failure's ban, it may be asked again when no chain is left without it."""

from __future__ import annotations

import logging

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

    def opened(self) -> None:
        """The open went through: the nodes that refused it for no routable reason are banned for a failure (see the
        module docstring)."""
        for nodes in self._refused.values():
            for peer_id in nodes:
                self.swarm.ban(peer_id)


__all__ = ["ADAPTER_REFUSALS", "ROUTABLE_REFUSALS", "OpenRefusals"]

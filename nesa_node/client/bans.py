"""The client's bans (client/swarm.py Swarm is one): peers kept out of new chains for a while, and why.

A ban for a failure (a stream that broke, a node that went quiet, one its neighbour could not reach) may be lifted
early when the node answers again and no chain is left without it (client/routing.py, client/failover.py); a ban
for a fault (something wrong it sent: client/chain_links.py LinkFailed.fault; outvoted; blamed) never is.

Accusations (`accuse`): in a direct chain a node that refuses the input its previous node pushed accuses that node,
which the client cannot see. When the accused's own record of what it sent (its kept outputs) does not show the
fault, it is one node's word against another's: the accused is replaced for a failure only, and an accuser whose
word stood against ACCUSATIONS_TO_BLAME different nodes (within FORGET_AFTER_S, none of them found faulty since) is
replaced instead, for a failure too: neither gets a ban for a fault on a word the client cannot check
(client/failover.py).
"""

from __future__ import annotations

import time

PRUNE_AT = 4096  # bans kept before those over for an hour (longer than any ban's doubling looks back) are dropped
FORGET_AFTER_S = 3600.0
# an honest node meets a node that pushes it bad inputs yet keeps a sane record of them rarely; two such in a row
# (distinct nodes) say the accuser lies (guess)
ACCUSATIONS_TO_BLAME = 2


class Bans:
    """Bans by peer id, with their lengths and which were for a fault (see the module docstring)."""

    def __init__(self) -> None:
        self._bans: dict[str, tuple[float, float]] = {}  # peer -> (banned until, monotonic s; last ban length, s)
        self._faulty: set[str] = set()  # peers banned for a fault at least once: their bans are never lifted early
        self._accusations: dict[str, dict[str, float]] = {}  # accuser -> {accused: monotonic s of the accusation}

    def ban(self, peer_id: str, *, base_s: float = 15.0, max_s: float = 600.0, fault: bool = False) -> float:
        """Keep `peer_id` out of new chains for a while: base_s, doubling on each repeat ban up to max_s.

        15 s covers a restart of a node that crashed (guess); a peer that keeps failing stays out for minutes.
        `fault`: it sent something wrong (client/chain_links.py LinkFailed.fault), was outvoted or blamed: such a
        ban is never lifted early, where one for a failure may be (`second_chance`). Returns the ban length."""
        if fault:
            self._faulty.add(peer_id)
        now = time.monotonic()
        if len(self._bans) >= PRUNE_AT:  # bans long over, of identities that came and went: forgotten
            self._bans = {peer: ban for peer, ban in self._bans.items() if ban[0] > now - FORGET_AFTER_S}
        until, last = self._bans.get(peer_id, (0.0, 0.0))
        # at least this kind of ban's own length (a ban for a failure before a blame does not shorten the blame's),
        # and a ban under way is never cut short by a shorter one
        length = max(base_s, min(max_s, last * 2)) if until > now - max_s and last else base_s
        self._bans[peer_id] = (max(until, now + length), length)
        return length

    def unban(self, peer_id: str) -> bool:
        """Lift a ban for a failure that proved wrong (a quiet node that answered a longer probe: client/failover.py,
        client/routing.py); a ban for a fault stays. The ban's length is kept, so a node banned again soon is banned
        twice as long. Whether the peer is free now."""
        if peer_id in self._faulty:
            return False
        until, last = self._bans.get(peer_id, (0.0, 0.0))
        if until > time.monotonic():
            self._bans[peer_id] = (time.monotonic(), last)
        return True

    def accuse(self, accuser: str, accused: str) -> int:
        """Record that `accuser` refused inputs of `accused` whose own record did not show the fault (module
        docstring); the number of distinct nodes, not found faulty since, it accused so in the last FORGET_AFTER_S."""
        now = time.monotonic()
        if len(self._accusations) >= PRUNE_AT:
            self._accusations = {
                peer: got for peer, got in self._accusations.items() if max(got.values()) > now - FORGET_AFTER_S
            }
        standing = {
            peer: at
            for peer, at in self._accusations.get(accuser, {}).items()
            if at > now - FORGET_AFTER_S and peer not in self._faulty
        }
        standing[accused] = now
        newest = sorted(standing.items(), key=lambda item: item[1])[-ACCUSATIONS_TO_BLAME:]  # more say nothing more
        self._accusations[accuser] = dict(newest)
        return len(newest)

    def faulty(self) -> frozenset[str]:
        """Peers banned for a fault at least once (see `ban`)."""
        return frozenset(self._faulty)

    def second_chance(self, peer_ids) -> list[str]:
        """Those of `peer_ids` banned now for a failure only (never for a fault: see `ban`), whose ban may be lifted
        when they answer a probe and no chain is left without them (client/routing.py)."""
        banned = self.banned()
        return [peer for peer in peer_ids if peer in banned and peer not in self._faulty]

    def banned(self) -> frozenset[str]:
        now = time.monotonic()
        return frozenset(peer for peer, (until, _) in self._bans.items() if until > now)


__all__ = ["Bans"]

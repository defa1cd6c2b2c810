"""A bootstrap DHT peer that serves no blocks (`nesa-node dht`): the first peer of a deployment.

Any peer of a swarm can be given as `--initial-peers`; a bootstrap peer is only one that is always there. It may
die: nodes keep their routing tables, and each announce period they dial their initial peers again, so a bootstrap
restarted with the same identity and port knows the swarm again within one period.
"""

from __future__ import annotations

import asyncio
import contextlib

from nesa_node.peer import Peer, start_peer, write_address_file

CONTACT_PERIOD_S = 30.0  # how often a bootstrap peer dials its own initial peers (other bootstrap peers) again


class BootstrapPeer:
    def __init__(self, peer: Peer):
        self.peer = peer
        self._contact: asyncio.Task | None = None

    @property
    def p2p(self):
        return self.peer.p2p

    @property
    def dht(self):
        return self.peer.dht

    @classmethod
    async def create(
        cls,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        identity_path: str | None = None,
        initial_peers: tuple[str, ...] = (),
        dht_prefixes: tuple[str, ...] = (),
    ) -> BootstrapPeer:
        """`dht_prefixes`: model keys whose records this peer validates (it stores them for the swarm)."""
        peer = await start_peer(
            initial_peers=initial_peers, host=host, port=port, identity_path=identity_path, dht_prefixes=dht_prefixes
        )
        return cls(peer)

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    def start(self, contact_period_s: float = CONTACT_PERIOD_S) -> None:
        """Dial the initial peers again every `contact_period_s` (they may restart, as this peer may)."""
        if self.peer.initial_peers and self._contact is None:
            self._contact = asyncio.create_task(self._contact_loop(contact_period_s))

    async def _contact_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.peer.contact_initial_peers()

    async def visible_maddrs(self) -> list[str]:
        return await self.peer.visible_maddrs()

    async def write_address_file(self, path: str) -> None:
        await asyncio.to_thread(write_address_file, path, await self.visible_maddrs())

    async def shutdown(self) -> None:
        if self._contact is not None:
            self._contact.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._contact
        await self.peer.shutdown()

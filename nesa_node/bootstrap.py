"""A bootstrap DHT peer that serves no blocks (`nesa-node dht`): the first peer of a deployment."""

from __future__ import annotations

import asyncio

from nesa_node.peer import Peer, start_peer, write_address_file


class BootstrapPeer:
    def __init__(self, peer: Peer):
        self.peer = peer

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

    async def visible_maddrs(self) -> list[str]:
        return await self.peer.visible_maddrs()

    async def write_address_file(self, path: str) -> None:
        await asyncio.to_thread(write_address_file, path, await self.visible_maddrs())

    async def shutdown(self) -> None:
        await self.peer.shutdown()

"""A bootstrap DHT peer that serves no blocks (`nesa-node dht`): the first peer of a deployment."""

from __future__ import annotations

import asyncio
import logging

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from nesa_node.dht_records import make_validator
from nesa_node.identity import ensure_identity
from nesa_node.launcher import write_address_file

logger = logging.getLogger(__name__)


class BootstrapPeer:
    def __init__(self, p2p: P2P, dht: DHTNode):
        self.p2p = p2p
        self.dht = dht

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
        if identity_path is not None:
            ensure_identity(identity_path)
        p2p = await P2P.create(
            initial_peers=list(initial_peers),
            host_maddrs=[f"/ip4/{host}/tcp/{port}"],
            identity_path=identity_path,
            check_if_identity_free=False,
        )
        try:
            dht = await DHTNode.create(
                p2p=p2p, initial_peers=list(initial_peers), record_validator=make_validator(None, list(dht_prefixes))
            )
        except BaseException:
            await p2p.shutdown()
            raise
        return cls(p2p, dht)

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    async def write_address_file(self, path: str) -> None:
        await asyncio.to_thread(write_address_file, path, await self.visible_maddrs())

    async def shutdown(self) -> None:
        try:
            await self.dht.shutdown()
        finally:
            await self.p2p.shutdown()

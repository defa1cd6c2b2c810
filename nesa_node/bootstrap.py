"""A bootstrap DHT peer that serves no blocks (`nesa-node dht`): the first peer of a deployment.

Any peer of a swarm can be given as `--initial-peers`; a bootstrap peer is only one that is always there. It may
die, and come back with the same identity and port:
- it remembers the DHT peers it knows (their addresses, in a peers file next to its identity) and dials them when
  it starts again, so it knows the swarm at once, however long it was down;
- nodes also dial their initial peers every announce period (nesa_node.peer.Peer.contact_initial_peers), which
  covers nodes that joined while it was down. After a long outage libp2p's dial backoff may hold those dials back
  for minutes: the peers file does not depend on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from nesa_node.peer import Peer, check_initial_peers, start_peer, write_address_file

logger = logging.getLogger(__name__)

CONTACT_PERIOD_S = 30.0  # how often a bootstrap peer dials its own initial peers (other bootstrap peers) again
REMEMBER_PERIOD_S = 2.0  # how often the known peers are compared with the peers file (written when they changed)
MAX_REMEMBERED = 1024  # peers kept in the file: hivemind's routing table holds fewer


def default_peers_file(identity_path: str | None) -> Path | None:
    """Where a bootstrap with this identity file keeps its peers: `boot.key` -> `boot.peers`."""
    return Path(identity_path).with_suffix(".peers") if identity_path else None


def read_peers_file(path: Path) -> list[str]:
    """The peer addresses in `path`, one per line; unreadable files and malformed lines are skipped."""
    try:
        lines = path.read_text().split()
    except OSError:
        return []
    addresses = []
    for line in lines[:MAX_REMEMBERED]:
        try:
            check_initial_peers([line])
        except Exception:
            continue
        addresses.append(line)
    return addresses


class BootstrapPeer:
    def __init__(self, peer: Peer, peers_file: Path | None = None):
        self.peer = peer
        self.peers_file = peers_file
        self.remembered: dict[str, str] = {}  # peer id -> its address, for peers of the DHT routing table
        self._tasks: list[asyncio.Task] = []

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
        peers_file: str | Path | None = None,
        announce_host: str | None = None,
    ) -> BootstrapPeer:
        """`dht_prefixes`: model keys whose records this peer validates (it stores them for the swarm).
        `peers_file`: where the known peers are kept across restarts (default: next to `identity_path`; none
        without one). `announce_host`: the IP address other machines reach it at, when not `host`'s."""
        peer = await start_peer(
            initial_peers=initial_peers,
            host=host,
            port=port,
            identity_path=identity_path,
            dht_prefixes=dht_prefixes,
            announce_host=announce_host,
        )
        path = Path(peers_file) if peers_file else default_peers_file(identity_path)
        return cls(peer, path)

    @property
    def peer_id(self) -> str:
        return self.peer.peer_id

    async def start(self, contact_period_s: float = CONTACT_PERIOD_S) -> int:
        """Dial the peers an earlier run remembered, then keep the peers file and dial the initial peers every
        `contact_period_s`. Returns how many remembered peers answered."""
        answered = 0
        if self.peers_file is not None:
            addresses = read_peers_file(self.peers_file)
            self.remembered = {address.rsplit("/p2p/", 1)[1]: address for address in addresses}
            if addresses:
                answered = await self.peer.contact(addresses)
                logger.info("%d of %d remembered peers answered", answered, len(addresses))
            self._tasks.append(asyncio.create_task(self._remember_loop()))
        if self.peer.initial_peers:
            self._tasks.append(asyncio.create_task(self._contact_loop(contact_period_s)))
        return answered

    async def remember(self) -> bool:
        """Update the known peers from the DHT routing table (its peers are the live DHT servers: nodes and other
        bootstrap peers, not clients) and the connections' addresses; write the file if they changed."""
        table = {str(peer_id) for peer_id in self.dht.protocol.routing_table.peer_id_to_uid}
        known = {peer: address for peer, address in self.remembered.items() if peer in table}
        for info in await self.p2p.list_peers():
            peer = str(info.peer_id)
            if peer in table and info.addrs and len(known) < MAX_REMEMBERED:
                known[peer] = f"{info.addrs[0]}/p2p/{peer}"
        if known == self.remembered and self.peers_file.exists():
            return False
        self.remembered = known
        await asyncio.to_thread(write_address_file, self.peers_file, sorted(known.values()))
        return True

    async def _remember_loop(self) -> None:
        while True:
            try:
                await self.remember()
            except Exception as exc:  # a full disk or a p2pd restart must not stop the peer
                logger.warning("could not update %s: %r", self.peers_file, exc)
            await asyncio.sleep(REMEMBER_PERIOD_S)

    async def _contact_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            await self.peer.contact_initial_peers()

    async def visible_maddrs(self) -> list[str]:
        return await self.peer.visible_maddrs()

    async def write_address_file(self, path: str) -> None:
        await asyncio.to_thread(write_address_file, path, await self.visible_maddrs())

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.peer.shutdown()

"""Starting a peer of the swarm: identity, a hivemind P2P host (one p2pd process) and a DHT node with the record
validators. One function, `start_peer`, used by the node daemon, the graph-stage node, the bootstrap peer and the
client alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

from nesa_node.protocol.dht import make_validator
from nesa_node.protocol.identity import ensure_identity, load_private_key

logger = logging.getLogger(__name__)

SHUTDOWN_STEP_S = 2.0  # per network step of a shutdown (guess: a healthy DHT leave takes well under 1 s)


@dataclass
class Peer:
    """A running P2P host and DHT node. `signature_validator` signs this peer's own records (None for a peer that
    writes none: clients and bootstrap peers)."""

    p2p: P2P
    dht: DHTNode
    signature_validator: RSASignatureValidator | None
    _identity_tmp: tempfile.TemporaryDirectory | None = None

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    async def shutdown(self, step_s: float = SHUTDOWN_STEP_S) -> None:
        """Leave the DHT, then stop p2pd; each step bounded by `step_s` (peers that are gone must not hold a
        stopping process). A fresh identity made for this run is deleted."""
        for closer in (self.dht.shutdown, self.p2p.shutdown):
            try:
                await asyncio.wait_for(closer(), timeout=step_s)
            except Exception as exc:  # a peer that is gone, or p2pd already stopped: normal during shutdown
                logger.debug("peer shutdown step failed: %r", exc)
        if self._identity_tmp is not None:
            self._identity_tmp.cleanup()
            self._identity_tmp = None


async def start_peer(
    *,
    initial_peers: tuple[str, ...] | list[str] = (),
    host: str | None = "127.0.0.1",
    port: int = 0,
    identity_path: str | None = None,
    dht_prefixes: tuple[str, ...] | list[str] = (),
    signs_records: bool = False,
    client_mode: bool = False,
) -> Peer:
    """Start P2P and DHT. `dht_prefixes`: model keys whose NodeInfo records this peer validates (protocol.dht).

    `signs_records`: the peer announces records signed with its identity key (nodes); without `identity_path` a
    fresh key is made for this run. `client_mode`: a DHT client that stores nothing for others (SDK clients).
    `host` None lets hivemind pick its default listening address. Raises OSError or hivemind's errors when p2pd
    cannot start; nothing is left running then."""
    identity_tmp = None
    if identity_path is None and signs_records:  # records need a key this process can read: a fresh one
        identity_tmp = tempfile.TemporaryDirectory(prefix="nesa-node-")
        identity_path = os.path.join(identity_tmp.name, "identity.key")
    signature_validator = None
    try:
        if identity_path is not None:
            ensure_identity(identity_path)
            if signs_records:
                signature_validator = RSASignatureValidator(load_private_key(identity_path))
        options: dict = {"initial_peers": list(initial_peers)}
        if host is not None:
            options["host_maddrs"] = [f"/ip4/{host}/tcp/{port}"]
        if identity_path is not None:
            options.update(identity_path=str(identity_path), check_if_identity_free=False)
        if client_mode:
            options["dht_mode"] = "client"
        p2p = await _create_p2p(options)
    except BaseException:
        if identity_tmp is not None:
            identity_tmp.cleanup()
        raise
    try:
        dht = await DHTNode.create(
            p2p=p2p,
            initial_peers=list(initial_peers),
            client_mode=client_mode,
            record_validator=make_validator(signature_validator, list(dht_prefixes)),
        )
    except BaseException:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(p2p.shutdown(), timeout=SHUTDOWN_STEP_S)
        if identity_tmp is not None:
            identity_tmp.cleanup()
        raise
    return Peer(p2p, dht, signature_validator, identity_tmp)


async def _create_p2p(options: dict, attempts: int = 20) -> P2P:
    """P2P.create, which spawns p2pd. uvloop refuses to spawn a process while a loop in another thread of this process
    is spawning one ("Racing with another loop to spawn a process"), before anything is started: two clients made
    at once from two threads meet this. The spawn is tried again after a short, growing pause."""
    for attempt in range(attempts):
        try:
            return await P2P.create(**options)
        except RuntimeError as exc:
            if "Racing with another loop" not in str(exc) or attempt + 1 == attempts:
                raise
            await asyncio.sleep(0.01 * (attempt + 1))
    raise RuntimeError("unreachable")  # the loop returns or raises


def write_address_file(path: str | Path, addresses: list[str]) -> None:
    """Write one multiaddr per line, atomically: a reader never sees a half-written file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text("".join(f"{address}\n" for address in addresses))
    tmp.replace(path)


__all__ = ["Peer", "start_peer", "write_address_file"]

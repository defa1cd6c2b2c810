"""DHT records (RELIABILITY.md B): a replayed older record cannot evict the newer one; records that break the
schema or the expiration rules are refused by honest peers and ignored by readers; store and get keep working while
a fifth of the DHT peers die. (Forged records of another node: tests/swarm/test_node.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from nesa_node.bootstrap import BootstrapPeer
from nesa_node.protocol.dht import fetch_node_infos, model_key, store_node_info
from nesa_node.protocol.identity import peer_id_of_public_key
from nesa_node.protocol.records import NodeState
from tests.support.swarm import LocalSwarm, SyncSwarm, wait_until


def test_b_replayed_older_record_does_not_evict_the_newer_one(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="replay", announce_period_s=30.0)
    newest = node.current_info()
    assert newest.state == NodeState.online
    # an older record of the same node: correctly signed, but expiring before the one stored now
    stale = newest.model_copy(update={"state": NodeState.draining, "cache_tokens_left": 1})
    stored = local_swarm.run(
        store_node_info(node.dht, node.dht_prefix, stale, node.peer.signature_validator, ttl_s=5.0)
    )
    assert not stored  # every replica keeps the record with the later expiration
    with SyncSwarm(local_swarm.initial_peers, dht_prefix="replay") as swarm:
        wait_until(lambda: any(r.info.peer_id == node.peer_id for r in swarm.node_records()), timeout_s=30)
        records = swarm.call(fetch_node_infos(swarm.dht, "replay"))
    (record,) = [record for record in records if record.info.peer_id == node.peer_id]
    assert record.info.state == NodeState.online and record.info.cache_tokens_left == newest.cache_tokens_left
    assert record.expiration_time > get_dht_time() + 10  # the newer record's expiration, not the replay's


# ---- a hostile writer, honest peers that know the model key, and a fifth of the DHT dying ----------------------

PREFIX = "hostile"


class DHTPeers:
    """Extra DHT peers (no blocks) that validate records under PREFIX, started in the local swarm's loop."""

    def __init__(self, swarm, count: int):
        self.swarm = swarm
        self.peers = [
            swarm.run(BootstrapPeer.create(initial_peers=tuple(swarm.initial_peers), dht_prefixes=(PREFIX,)))
            for _ in range(count)
        ]

    def kill(self, peer: BootstrapPeer) -> None:
        """SIGKILL the peer's p2pd: from then on it is a dead DHT peer (its Python side stays, unreachable)."""
        os.kill(peer.p2p._child.pid, signal.SIGKILL)  # hivemind keeps the daemon's process as P2P._child

    def close(self) -> None:
        for peer in self.peers:
            with contextlib.suppress(Exception):
                self.swarm.run(asyncio.wait_for(peer.shutdown(), 10), timeout=20)


@pytest.fixture
def hostile_swarm():
    """A local swarm whose bootstrap peer validates records under PREFIX, like every node serving that model."""
    swarm = LocalSwarm(dht_prefixes=(PREFIX,))
    try:
        yield swarm
    finally:
        swarm.close()


@pytest.fixture
def dht_peers(hostile_swarm):
    peers = DHTPeers(hostile_swarm, 9)
    try:
        yield peers
    finally:
        peers.close()


class Attacker:
    """A DHT peer with a key of its own that signs whatever it stores: no schema or expiration check of its own."""

    def __init__(self, swarm):
        self.swarm = swarm
        self.key = RSAPrivateKey()
        self.peer_id = peer_id_of_public_key(self.key.get_public_key()).to_base58()
        self.signer = RSASignatureValidator(self.key)

        async def start():  # a DHT client: it stores on other peers only, so their verdict is what store returns
            p2p = await P2P.create(initial_peers=list(swarm.initial_peers))
            dht = await DHTNode.create(
                p2p=p2p, initial_peers=list(swarm.initial_peers), record_validator=self.signer, client_mode=True
            )
            return p2p, dht

        self.p2p, self.dht = swarm.run(start())

    @property
    def subkey(self) -> bytes:
        return self.peer_id.encode() + self.signer.local_public_key

    def store(self, value: str, expiration: float) -> bool:
        return self.swarm.run(self.dht.store(model_key(PREFIX), value, expiration, subkey=self.subkey))

    def plant(self, dht: DHTNode, value: str, expiration: float) -> None:
        """Put a signed record straight into `dht`'s storage, as a replica that skipped validation would hold it."""
        key = DHTID.generate(source=model_key(PREFIX))
        record = DHTRecord(
            key=key.to_bytes(),
            subkey=DHTProtocol.serializer.dumps(self.subkey),
            value=DHTProtocol.serializer.dumps(value),
            expiration_time=expiration,
        )
        signed = self.signer.sign_value(record)
        assert dht.protocol.storage.store_subkey(key, record.subkey, signed, expiration)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.swarm.run(self.dht.shutdown(), timeout=20)
            self.swarm.run(self.p2p.shutdown(), timeout=20)


def held_by(peers, attacker: Attacker) -> list[str]:
    """Values of the attacker's subkey in the local storage of `peers` (what honest peers accepted)."""
    key = DHTID.generate(source=model_key(PREFIX))
    found = []
    for dht in peers:
        item = dht.protocol.storage.get(key)
        if item is None or not hasattr(item.value, "items"):
            continue
        for subkey, entry in item.value.items():
            if attacker.signer.local_public_key in subkey:
                found.append(entry.value)
    return found


def test_b_schema_and_expiration_violations_are_rejected_on_store_and_on_read(hostile_swarm, tiny_llama, dht_peers):
    node = hostile_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX)
    honest = [node.dht, hostile_swarm.bootstrap.dht] + [peer.dht for peer in dht_peers.peers]
    attacker = Attacker(hostile_swarm)
    try:
        wire = json.loads(node.current_info().model_copy(update={"peer_id": attacker.peer_id}).to_wire())
        now = get_dht_time()
        violations = [
            {"cache_tokens_left": -5},
            {"start_block": 4, "end_block": 4},
            {"start_block": "0"},
            {"state": "sleeping"},
            {"adapters": ["adapter"] * 65},
            {"forward_tps": float("inf")},
        ]
        # on store: every honest peer refuses, so no replica takes them
        for change in violations:
            assert not attacker.store(json.dumps(wire | change), now + 30), change
        for expiration in (float("nan"), float("inf"), now - 10, now + 10**6):
            assert not attacker.store(json.dumps(wire), expiration), expiration
        assert held_by(honest, attacker) == []
        with SyncSwarm(hostile_swarm.initial_peers, dht_prefix=PREFIX) as swarm:
            # on read: a replica that took a bad record anyway (planted in the peer nearest to the key, which
            # every read asks) does not get it past the reader
            key = DHTID.generate(source=model_key(PREFIX))
            nearest = min(honest, key=lambda dht: dht.node_id.xor_distance(key))
            attacker.plant(nearest, json.dumps(wire | {"cache_tokens_left": -5}), get_dht_time() + 60)
            for _ in range(3):
                fresh = swarm.call(fetch_node_infos(swarm.dht, PREFIX))
                assert node.peer_id in {r.info.peer_id for r in fresh}
                assert attacker.peer_id not in {r.info.peer_id for r in fresh}
            # the control: the same writer's well-formed record is stored and read, so the refusals were real
            assert attacker.store(json.dumps(wire), get_dht_time() + 30)
            assert held_by(honest, attacker)
            wait_until(lambda: attacker.peer_id in {r.info.peer_id for r in swarm.node_records()}, timeout_s=30)
            # blocks outside the model pass the schema (it does not know the model's depth); readers drop them
            assert attacker.store(json.dumps(wire | {"end_block": 999}), get_dht_time() + 60)
            wait_until(
                lambda: any(r.info.end_block == 999 for r in swarm.call(fetch_node_infos(swarm.dht, PREFIX))),
                timeout_s=30,
            )
            # a read made now (the client's own held records may be up to records_stale_s old)
            assert {view.peer_id for view in swarm.call(swarm.swarm.snapshot(4, fresh=True)).nodes} == {node.peer_id}
    finally:
        attacker.close()


def test_b_store_and_get_keep_working_while_a_fifth_of_the_dht_peers_die(hostile_swarm, tiny_llama, dht_peers):
    local_swarm = hostile_swarm
    first = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX, announce_period_s=1.0)
    peers = [first.dht, local_swarm.bootstrap.dht] + [peer.dht for peer in dht_peers.peers]  # 11 DHT peers
    # the dying fifth (and more): of the extra peers, the three nearest to the model key, i.e. replicas of its records
    key = DHTID.generate(source=model_key(PREFIX))
    dying = sorted(dht_peers.peers, key=lambda peer: peer.dht.node_id.xor_distance(key))[:3]
    with SyncSwarm(local_swarm.initial_peers, dht_prefix=PREFIX) as swarm:
        wait_until(lambda: first.peer_id in {r.info.peer_id for r in swarm.node_records()}, timeout_s=30)
        for peer in dying:
            dht_peers.kill(peer)
        assert len(dying) / len(peers) >= 0.2
        # store: a node that starts now is found; get: fresh reads (not the client's cache) see both nodes
        second = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX, announce_period_s=1.0)
        started = time.monotonic()

        def both_found() -> bool:
            fresh = swarm.call(fetch_node_infos(swarm.dht, PREFIX), timeout=30)
            return {first.peer_id, second.peer_id} <= {record.info.peer_id for record in fresh}

        wait_until(both_found, timeout_s=30)
        print(
            f"\nwith {len(dying)} of {len(peers)} DHT peers dead, a new node's record was read after {time.monotonic() - started:.2f} s"
        )
        # and it keeps working: ten more fresh reads in a row each see both
        for _ in range(10):
            assert both_found()


def test_a_restarted_bootstrap_dials_the_peers_it_remembered(tmp_path):
    """The peers file alone brings a restarted bootstrap back into the swarm: the other peer here never dials it
    again (a bare DHT peer, no announce loop)."""
    import socket

    from nesa_node import event_loop
    from nesa_node.peer import start_peer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    identity = str(tmp_path / "boot.key")

    async def scenario() -> None:
        first = await BootstrapPeer.create(port=port, identity_path=identity)
        assert first.peers_file == tmp_path / "boot.peers"
        assert await first.start() == 0
        other = await start_peer(initial_peers=await first.visible_maddrs())
        try:
            deadline = time.monotonic() + 30
            while other.peer_id not in first.remembered:
                assert time.monotonic() < deadline, "the bootstrap never wrote the other peer down"
                await first.remember()
                await asyncio.sleep(0.2)
            assert other.peer_id in (tmp_path / "boot.peers").read_text()
            await first.shutdown()

            again = await BootstrapPeer.create(port=port, identity_path=identity)
            try:
                assert again.peer_id == first.peer_id
                assert await again.start() == 1
                table = {str(peer) for peer in again.dht.protocol.routing_table.peer_id_to_uid}
                assert other.peer_id in table
                assert str(again.p2p.peer_id) in {str(peer) for peer in other.dht.protocol.routing_table.peer_id_to_uid}
            finally:
                await again.shutdown()
        finally:
            await other.shutdown()

    event_loop.run(scenario())


def test_a_fresh_identity_leaves_no_file_once_the_peer_runs(tmp_path, monkeypatch):
    """A node run without --identity signs with a key made for the run: p2pd reads its file at start and this
    process keeps the key in memory, so the file is gone at once, and a killed node leaves nothing behind."""
    import tempfile

    from nesa_node import event_loop
    from nesa_node.peer import start_peer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    async def scenario() -> None:
        peer = await start_peer(signs_records=True)
        try:
            assert not list(tmp_path.glob("nesa-node-*"))
            key = peer.signature_validator._private_key.get_public_key()
            assert peer_id_of_public_key(key).to_base58() == peer.peer_id  # p2pd runs with the key this process holds
        finally:
            await peer.shutdown()

    event_loop.run(scenario())

"""Hostile DHT stores (RELIABILITY G2) against live peers on 127.0.0.1: a peer flooding `rpc_store` with junk grew
its victim by about 200 MB in 6 s, and a bootstrap peer, which knows no model prefix, stored forged NodeInfo
records. Now a victim keeps to its storage limits per sender and in total, still answers, keeps honest records,
and every peer refuses a forged or malformed NodeInfo under any key."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from nesa_node import event_loop
from nesa_node.bootstrap import BootstrapPeer
from nesa_node.peer import Peer, start_peer
from nesa_node.protocol import dht_storage
from nesa_node.protocol.dht import fetch_node_infos, model_key, store_node_info
from nesa_node.protocol.dht_storage import StorageLimits, ledger_of, record_size, set_storage_limits
from nesa_node.protocol.records import NodeInfo, NodeState

PREFIX = "hostile-dht"
LIMITS = StorageLimits(total_bytes=256 * 1024, total_records=1000, sender_bytes=64 * 1024, sender_records=250)
JUNK_BYTES = 200  # value bytes of one flooded record
BATCH = 500  # records per store request


@pytest.fixture
def small_limits():
    previous = set_storage_limits(LIMITS)  # peers started in the test get these
    yield LIMITS
    set_storage_limits(previous)


def node_info(peer: Peer) -> NodeInfo:
    return NodeInfo(peer_id=peer.peer_id, start_block=0, end_block=4, state=NodeState.online, dtype="float32")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_records(protocol: DHTProtocol) -> tuple[int, int]:
    """Records and bytes the victim's storage and cache hold, counted from hivemind's own structures."""
    records = size = 0
    for storage in (protocol.storage, protocol.cache):
        for key, entry in list(storage.data.items()):
            if isinstance(entry.value, DictionaryDHTValue):
                for subkey, item in entry.value.data.items():
                    records, size = records + 1, size + record_size(key, subkey, item.value)
            else:
                records, size = records + 1, size + record_size(key, dht_storage.REGULAR, entry.value)
    return records, size


async def store_junk(attacker: Peer, victim: PeerID, count: int) -> int:
    """One store request of `count` junk regular values under fresh keys; returns how many the victim took."""
    expiration = get_dht_time() + 120
    request = dht_pb2.StoreRequest(
        keys=[DHTID.generate().to_bytes() for _ in range(count)],
        subkeys=[DHTProtocol.IS_REGULAR_VALUE] * count,
        values=[os.urandom(JUNK_BYTES) for _ in range(count)],
        expiration_time=[expiration] * count,
        in_cache=[index % 2 == 1 for index in range(count)],  # the cache is bounded too
    )
    response = await attacker.dht.protocol.get_stub(victim).rpc_store(request, timeout=10)
    return sum(response.store_ok)


async def flood(attacker: Peer, victim: PeerID, seconds: float, parallel: int = 4) -> tuple[int, int]:
    """Store junk as fast as `parallel` requests at a time allow, for `seconds`; returns (sent, accepted)."""
    deadline = time.monotonic() + seconds
    sent = accepted = 0

    async def worker() -> None:
        nonlocal sent, accepted
        while time.monotonic() < deadline:
            taken = await store_junk(attacker, victim, BATCH)
            sent, accepted = sent + BATCH, accepted + taken

    await asyncio.gather(*(worker() for _ in range(parallel)))
    return sent, accepted


async def shutdown_all(peers: list, bootstrap: BootstrapPeer) -> None:
    for peer in reversed(peers):
        await peer.shutdown()
    await bootstrap.shutdown()


def test_a_flood_of_junk_stores_stays_within_the_victims_limits(small_limits):
    async def scenario() -> dict:
        victim = await BootstrapPeer.create()
        address = await victim.visible_maddrs()
        peers: list[Peer] = []
        try:
            writer = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            reader = await start_peer(initial_peers=address, client_mode=True, dht_prefixes=(PREFIX,))
            peers += [writer, reader]
            for _ in range(6):  # several identities, together over the total: eviction at work
                peers.append(await start_peer(initial_peers=address, client_mode=True))
            assert await store_node_info(writer.dht, PREFIX, node_info(writer), writer.signature_validator, 60)
            rss_before = rss_bytes()
            floods = await asyncio.gather(*(flood(attacker, victim.p2p.peer_id, 3.0) for attacker in peers[2:]))
            result = {
                "sent": sum(sent for sent, _ in floods),
                "rss_growth": rss_bytes() - rss_before,
                "ledger": ledger_of(victim.dht.protocol).total,
                "held": held_records(victim.dht.protocol),
                "before": await fetch_node_infos(reader.dht, PREFIX),
            }
            late = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            peers.append(late)
            result["late_stored"] = await store_node_info(
                late.dht, PREFIX, node_info(late), late.signature_validator, 60
            )
            result["after"] = {record.info.peer_id for record in await fetch_node_infos(reader.dht, PREFIX)}
            result["honest"] = {writer.peer_id, late.peer_id}
            result["answers"] = await reader.dht.protocol.call_ping(victim.p2p.peer_id) is not None
            return result
        finally:
            await shutdown_all(peers, victim)

    result = event_loop.run(scenario())
    assert result["sent"] >= 10 * LIMITS.total_records, result  # the flood was far larger than the bound
    ledger = result["ledger"]
    assert ledger.records <= LIMITS.total_records and ledger.bytes <= LIMITS.total_bytes, result
    records, size = result["held"]  # the storage itself: at most the bound plus the honest writer's own record
    assert records <= LIMITS.total_records + 1 and size <= LIMITS.total_bytes + 4096, result
    assert result["rss_growth"] < 64 * 1024 * 1024, result  # unbounded, the same flood kept every record it sent
    assert [record.info.peer_id for record in result["before"]] != [], result
    assert result["late_stored"] and result["after"] == result["honest"], result
    assert result["answers"], result


def test_one_flooding_sender_neither_evicts_nor_blocks_another(small_limits):
    async def scenario() -> dict:
        victim = await BootstrapPeer.create()
        address = await victim.visible_maddrs()
        peers: list[Peer] = []
        try:
            flooder = await start_peer(initial_peers=address, client_mode=True)
            other = await start_peer(initial_peers=address, client_mode=True)
            peers += [flooder, other]
            victim_id = victim.p2p.peer_id
            early = await store_junk(other, victim_id, 100)
            sent, accepted = await flood(flooder, victim_id, 2.0)
            ledger = ledger_of(victim.dht.protocol)
            return {
                "early": early,
                "sent": sent,
                "accepted": accepted,
                "kept": ledger.usage(other.p2p.peer_id),
                "flooder": ledger.usage(flooder.p2p.peer_id),
                "flooder_now": await store_junk(flooder, victim_id, 10),
                "later": await store_junk(other, victim_id, 100),
            }
        finally:
            await shutdown_all(peers, victim)

    result = event_loop.run(scenario())
    assert result["early"] == 100 and result["sent"] >= 10 * LIMITS.sender_records, result
    assert result["accepted"] == LIMITS.sender_records, result  # the rest refused, nobody evicted for it
    assert result["flooder"].records == LIMITS.sender_records, result
    assert result["kept"].records == 100, result
    assert result["flooder_now"] == 0 and result["later"] == 100, result


def test_a_bootstrap_without_prefixes_refuses_forged_node_info_and_stores_a_valid_one():
    async def scenario() -> dict:
        bootstrap = await BootstrapPeer.create()  # no dht_prefixes: it cannot tell the model key from others
        address = await bootstrap.visible_maddrs()
        peers: list[Peer] = []
        try:
            honest = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            forger = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
            peers += [honest, forger]
            expiration = get_dht_time() + 60
            forger_subkey = forger.peer_id.encode() + forger.signature_validator.local_public_key
            impersonation = node_info(honest).to_wire()  # the honest peer's id, the forger's signature
            malformed = json.dumps(json.loads(node_info(forger).to_wire()) | {"start_block": -3, "dtype": 5})

            async def forge(value: str, subkey: bytes) -> bool:
                return await forger.dht.store(model_key(PREFIX), value, expiration, subkey=subkey)

            stored = {
                "impersonation": await forge(impersonation, forger_subkey),
                "impersonation_subkey": await forge(
                    impersonation, honest.peer_id.encode() + forger.signature_validator.local_public_key
                ),
                "malformed": await forge(malformed, forger_subkey),
                "valid": await store_node_info(honest.dht, PREFIX, node_info(honest), honest.signature_validator, 60),
            }
            held = bootstrap.dht.protocol.storage.get(DHTID.generate(source=model_key(PREFIX)))
            stored["held"] = [owner for owner, _ in held.value.items()] if held is not None else []
            stored["honest_subkey"] = honest.peer_id.encode() + honest.signature_validator.local_public_key
            return stored
        finally:
            await shutdown_all(peers, bootstrap)

    stored = event_loop.run(scenario())
    assert not stored["impersonation"] and not stored["impersonation_subkey"] and not stored["malformed"], stored
    assert stored["valid"], stored
    assert stored["held"] == [stored["honest_subkey"]], stored

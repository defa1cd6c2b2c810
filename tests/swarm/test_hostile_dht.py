"""Hostile DHT stores (RELIABILITY G2) against live peers on 127.0.0.1: a peer flooding `rpc_store` with junk grew
its victim by about 200 MB in 6 s, and a bootstrap peer, which knows no model prefix, stored forged NodeInfo
records. Now a victim keeps to its storage limits per sender and in total, still answers, keeps honest records,
and every peer refuses a forged or malformed NodeInfo under any key. Where the victims are a real local swarm's
bootstrap and node, an honest client at the same time finds the node and gets its reference tokens (greedy
generation through the swarm equals transformers' own on the same tiny model), as RELIABILITY G asks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time

import pytest
import torch
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from nesa_node import event_loop
from nesa_node.bootstrap import BootstrapPeer
from nesa_node.client.model import DistributedModelForCausalLM, LoopThread
from nesa_node.peer import Peer, start_peer
from nesa_node.protocol import dht_storage
from nesa_node.protocol.dht import fetch_node_infos, model_key, store_node_info
from nesa_node.protocol.dht_storage import StorageLimits, ledger_of, record_size, set_storage_limits
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.server.node import Node
from tests.support.swarm import LocalSwarm, wait_for_chain

PREFIX = "hostile-dht"
LIMITS = StorageLimits(total_bytes=256 * 1024, total_records=1000, sender_bytes=64 * 1024, sender_records=250)
JUNK_BYTES = 200  # value bytes of one flooded record
BATCH = 500  # records per store request
MODEL_PREFIX = "hostile-dht-model"  # the real node's model key (PREFIX holds the test's hand-written records)
PROMPT = torch.tensor([[3, 14, 15, 92]])
NEW_TOKENS = 8
OWN_RECORD_SLACK = (4, 16 * 1024)  # records and bytes a node stores for itself (its announcement): not accounted


@pytest.fixture
def small_limits():
    previous = set_storage_limits(LIMITS)  # peers started in the test get these
    yield LIMITS
    set_storage_limits(previous)


@pytest.fixture(scope="module")
def reference_tokens(tiny_llama) -> torch.Tensor:
    """transformers' own greedy generation on the tiny model: what an honest client must get through the swarm."""
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        return AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
            PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False
        )


@contextlib.contextmanager
def swarm_with_node(tiny_llama: str):
    """A real local swarm, started under the storage limits set now: a bootstrap without prefixes and one node
    serving all four blocks under MODEL_PREFIX. Always closed."""
    swarm = LocalSwarm()
    try:
        node = swarm.start_node(tiny_llama, 0, 4, dht_prefix=MODEL_PREFIX)
        yield swarm, node
    finally:
        swarm.close()


def honest_generation(swarm: LocalSwarm, node: Node) -> dict:
    """A fresh honest client routed via the swarm's bootstrap: the chain it finds and the tokens it generates."""
    started = time.monotonic()
    with DistributedModelForCausalLM.from_pretrained(
        node.config.model_path, initial_peers=swarm.initial_peers, dht_prefix=MODEL_PREFIX, compression="none"
    ) as model:
        chain = wait_for_chain(model, timeout_s=20)
        with torch.inference_mode():
            tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    return {"chain": [hop.peer_id for hop in chain.hops], "tokens": tokens, "took_s": time.monotonic() - started}


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


async def flood(
    attacker: Peer, victim: PeerID, seconds: float, parallel: int = 4, until: threading.Event | None = None
) -> tuple[int, int]:
    """Store junk as fast as `parallel` requests at a time allow, for `seconds` (and then until `until` is set, if
    given); returns (sent, accepted)."""
    deadline = time.monotonic() + seconds
    sent = accepted = 0

    def going() -> bool:
        return time.monotonic() < deadline or (until is not None and not until.is_set())

    async def worker() -> None:
        nonlocal sent, accepted
        while going():
            taken = await store_junk(attacker, victim, BATCH)
            sent, accepted = sent + BATCH, accepted + taken

    await asyncio.gather(*(worker() for _ in range(parallel)))
    return sent, accepted


async def shutdown_all(peers: list, bootstrap: BootstrapPeer) -> None:
    for peer in reversed(peers):
        await peer.shutdown()
    await bootstrap.shutdown()


# serial: the attackers flood from this process, so a test beside it in the other worker starves victims and client
# alike, and the honest client's wait for the node's record (a bound on its time) measures that load, not the flood
@pytest.mark.serial
def test_a_flood_of_junk_stores_stays_within_the_victims_limits(small_limits, tiny_llama, reference_tokens):
    """Six attacker identities flood a real swarm's bootstrap and node with junk stores while an honest client joins
    via the bootstrap: it finds the node and gets its reference tokens, and both victims keep to their bounds."""
    flooding, honest_done = threading.Event(), threading.Event()

    with swarm_with_node(tiny_llama) as (swarm, node):
        node_id = node.peer_id
        victims = {"bootstrap": swarm.bootstrap.dht.protocol, "node": node.dht.protocol}
        victim_ids = {"bootstrap": swarm.bootstrap.p2p.peer_id, "node": node.p2p.peer_id}

        async def scenario() -> dict:
            address = swarm.initial_peers
            peers: list[Peer] = []
            try:
                writer = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
                reader = await start_peer(initial_peers=address, client_mode=True, dht_prefixes=(PREFIX, MODEL_PREFIX))
                peers += [writer, reader]
                for _ in range(6):  # several identities, together over the total: eviction at work
                    peers.append(await start_peer(initial_peers=address, client_mode=True))
                assert await store_node_info(writer.dht, PREFIX, node_info(writer), writer.signature_validator, 60)
                rss_before = rss_bytes()
                flooding.set()
                # each identity stores into both victims, 2 requests at a time into each, at least 3 s and as long
                # as the honest client is at work
                targets = [name for _ in peers[2:] for name in victims]
                floods = asyncio.gather(
                    *(
                        flood(attacker, victim_ids[name], 3.0, parallel=2, until=honest_done)
                        for attacker in peers[2:]
                        for name in victims
                    )
                )
                await asyncio.sleep(1.0)  # well into the flood: the victims' storage is at its bound by now
                during = await fetch_node_infos(reader.dht, MODEL_PREFIX)
                sent = {name: 0 for name in victims}
                for name, (sent_one, _) in zip(targets, await floods, strict=True):
                    sent[name] += sent_one
                result = {
                    "sent": sent,
                    "rss_growth": rss_bytes() - rss_before,
                    "ledger": {name: ledger_of(protocol).total for name, protocol in victims.items()},
                    "held": {name: held_records(protocol) for name, protocol in victims.items()},
                    "node_during": [record.info.peer_id for record in during],
                    "before": await fetch_node_infos(reader.dht, PREFIX),
                }
                late = await start_peer(initial_peers=address, client_mode=True, signs_records=True)
                peers.append(late)
                result["late_stored"] = await store_node_info(
                    late.dht, PREFIX, node_info(late), late.signature_validator, 60
                )
                result["after"] = {record.info.peer_id for record in await fetch_node_infos(reader.dht, PREFIX)}
                result["honest"] = {writer.peer_id, late.peer_id}
                result["answers"] = {
                    name: await reader.dht.protocol.call_ping(peer_id) is not None
                    for name, peer_id in victim_ids.items()
                }
                result["node_after"] = [
                    record.info.peer_id for record in await fetch_node_infos(reader.dht, MODEL_PREFIX)
                ]
                return result
            finally:
                flooding.set()
                for peer in reversed(peers):
                    await peer.shutdown()

        attackers = LoopThread("hostile-dht-attackers")  # a loop of their own: the victims' loop only serves
        try:
            attack = asyncio.run_coroutine_threadsafe(scenario(), attackers.loop)
            assert flooding.wait(timeout=60), "the attackers did not start"
            try:
                if attack.done():
                    attack.result()  # the attackers failed to start: their error
                time.sleep(0.5)  # the flood is under way
                honest = honest_generation(swarm, node)
                honest["while_flooding"] = not attack.done()
            finally:
                honest_done.set()
            result = attack.result(timeout=60)
        finally:
            attackers.stop()
        result["node_up"] = node.state == NodeState.online

    for name in ("bootstrap", "node"):
        # the flood on each victim was far larger than the bound
        assert result["sent"][name] >= 10 * LIMITS.total_records, (name, result)
        ledger = result["ledger"][name]
        assert ledger.records <= LIMITS.total_records and ledger.bytes <= LIMITS.total_bytes, (name, result)
    # the storage itself: at most the bound plus records the victim keeps as its own (never accounted)
    records, size = result["held"]["bootstrap"]  # the bootstrap keeps nothing of its own
    assert records <= LIMITS.total_records + 1 and size <= LIMITS.total_bytes + 4096, result
    records, size = result["held"]["node"]  # the node keeps its own announcement
    extra_records, extra_bytes = OWN_RECORD_SLACK
    assert records <= LIMITS.total_records + extra_records and size <= LIMITS.total_bytes + extra_bytes, result
    assert result["rss_growth"] < 64 * 1024 * 1024, result  # unbounded, the same flood kept every record it sent
    assert [record.info.peer_id for record in result["before"]] != [], result
    assert result["late_stored"] and result["after"] == result["honest"], result
    assert result["answers"] == {"bootstrap": True, "node": True}, result
    # the honest client, while the flood went on: it found the node and got the reference tokens
    assert result["node_during"] == [node_id] and result["node_after"] == [node_id], result
    assert honest["while_flooding"] and honest["chain"] == [node_id], honest
    assert torch.equal(honest["tokens"], reference_tokens), (honest, reference_tokens)
    assert result["node_up"], result
    print(f"honest generation during the flood: {honest['took_s']:.1f} s; sent {result['sent']}")


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


def test_a_bootstrap_without_prefixes_refuses_forged_node_info_and_stores_a_valid_one(tiny_llama, reference_tokens):
    """A forger stores, via a real swarm's bootstrap (which knows no model prefix), a record impersonating the real
    node, one under the node's subkey and a malformed one: all refused, the node's own record kept, and an honest
    client routed via that bootstrap finds the node and gets its reference tokens."""
    with swarm_with_node(tiny_llama) as (swarm, node):
        bootstrap, node_id = swarm.bootstrap, node.peer_id

        async def scenario() -> dict:
            peers: list[Peer] = []
            try:
                forger = await start_peer(initial_peers=swarm.initial_peers, client_mode=True, signs_records=True)
                peers.append(forger)
                expiration = get_dht_time() + 60
                forger_subkey = forger.peer_id.encode() + forger.signature_validator.local_public_key
                impersonation = node.current_info().to_wire()  # the node's own record, the forger's signature
                malformed = json.dumps(json.loads(node_info(forger).to_wire()) | {"start_block": -3, "dtype": 5})

                async def forge(value: str, subkey: bytes) -> bool:
                    return await forger.dht.store(model_key(MODEL_PREFIX), value, expiration, subkey=subkey)

                stored = {
                    "impersonation": await forge(impersonation, forger_subkey),
                    "impersonation_subkey": await forge(
                        impersonation, node_id.encode() + forger.signature_validator.local_public_key
                    ),
                    "malformed": await forge(malformed, forger_subkey),
                    # the node's own announcement, as its announce loop stores it
                    "valid": await store_node_info(
                        node.dht, MODEL_PREFIX, node.current_info(), node.peer.signature_validator, 60
                    ),
                }
                key = DHTID.generate(source=model_key(MODEL_PREFIX))
                for name, dht in (("held", bootstrap.dht), ("node_held", node.dht)):
                    held = dht.protocol.storage.get(key)
                    stored[name] = [owner for owner, _ in held.value.items()] if held is not None else []
                stored["honest_subkey"] = node_id.encode() + node.peer.signature_validator.local_public_key
                return stored
            finally:
                for peer in reversed(peers):
                    await peer.shutdown()

        stored = swarm.run(scenario(), timeout=60)
        honest = honest_generation(swarm, node)  # via the bootstrap that refused the forgeries

    assert not stored["impersonation"] and not stored["impersonation_subkey"] and not stored["malformed"], stored
    assert stored["valid"], stored
    assert stored["held"] == [stored["honest_subkey"]], stored
    assert stored["node_held"] == [stored["honest_subkey"]], stored  # the node refused them too
    assert honest["chain"] == [node_id], honest
    assert torch.equal(honest["tokens"], reference_tokens), (honest, reference_tokens)

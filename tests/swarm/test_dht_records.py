"""DHT records (RELIABILITY.md B): an older record of a node, replayed with its valid signature, cannot evict the
node's newer record."""

from __future__ import annotations

from hivemind.utils import get_dht_time

from nesa_node.client.swarm import SwarmClient
from nesa_node.dht_records import fetch_node_infos, store_node_info
from nesa_node.records import NodeState
from tests.swarm.conftest import wait_until


def test_b_replayed_older_record_does_not_evict_the_newer_one(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="replay", announce_period_s=30.0)
    newest = node.current_info()
    assert newest.state == NodeState.online
    # an older record of the same node: correctly signed, but expiring before the one stored now
    stale = newest.model_copy(update={"state": NodeState.draining, "cache_tokens_left": 1})
    stored = local_swarm.run(store_node_info(node.dht, node.dht_prefix, stale, node.signature_validator, ttl_s=5.0))
    assert not stored  # every replica keeps the record with the later expiration
    with SwarmClient(local_swarm.initial_peers, dht_prefix="replay") as swarm:
        wait_until(lambda: any(r.info.peer_id == node.peer_id for r in swarm.node_records()), timeout_s=30)
        records = swarm.call(fetch_node_infos(swarm.dht, "replay"))
    (record,) = [record for record in records if record.info.peer_id == node.peer_id]
    assert record.info.state == NodeState.online and record.info.cache_tokens_left == newest.cache_tokens_left
    assert record.expiration_time > get_dht_time() + 10  # the newer record's expiration, not the replay's

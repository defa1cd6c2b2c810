"""Link measurement: nodes ping their neighbours in the block order with rpc_ping and publish RTT and bandwidth in
their records; a node started with --inject-delay-ms looks that much further away to the measurement."""

from __future__ import annotations

from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from nesa_node.client.swarm import SwarmClient
from nesa_node.server.links import MAX_PING_BYTES
from nesa_node.wire import RPC_PING, unpack_metadata
from tests.swarm.conftest import wait_until

DELAY_MS = 40.0


def test_nodes_measure_and_publish_their_links_and_an_injected_delay_shows(local_swarm, tiny_llama):
    settings = {"dht_prefix": "links", "announce_period_s": 1.0, "link_probe_period_s": 1.0}
    first = local_swarm.start_node(tiny_llama, 0, 2, **settings)
    near = local_swarm.start_node(tiny_llama, 2, 4, **settings)
    far = local_swarm.start_node(tiny_llama, 2, 4, inject_delay_ms=DELAY_MS, **settings)
    with SwarmClient(local_swarm.initial_peers, dht_prefix="links") as swarm:

        def links_of_first() -> dict:
            for record in swarm.node_records():
                if record.info.peer_id == first.peer_id:
                    return {link.peer_id: link for link in record.info.links}
            return {}

        wait_until(lambda: {near.peer_id, far.peer_id} <= set(links_of_first()), timeout_s=30)
        links = links_of_first()
        print(f"\nmeasured from the first node: near {links[near.peer_id]}, far {links[far.peer_id]}")
        assert links[far.peer_id].rtt_ms - links[near.peer_id].rtt_ms > 0.75 * DELAY_MS
        assert links[near.peer_id].rtt_ms < DELAY_MS / 2
        assert links[near.peer_id].bandwidth_mbps is not None and links[near.peer_id].bandwidth_mbps > 0

        # a ping heavier than the node accepts is refused with a typed error
        oversized = runtime_pb2.ExpertRequest(tensors=[runtime_pb2.Tensor(buffer=bytes(MAX_PING_BYTES + 1))])
        response = swarm.call(
            swarm.p2p.call_protobuf_handler(
                PeerID.from_base58(near.peer_id), RPC_PING, oversized, runtime_pb2.ExpertResponse
            )
        )
        assert unpack_metadata(response.metadata)["error"] == "too_large"

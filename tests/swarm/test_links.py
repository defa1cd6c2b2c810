"""Link measurement: nodes ping their neighbours in the block order with rpc_ping and publish RTT and bandwidth in
their records; a node started with --inject-delay-ms looks that much further away to the measurement."""

from __future__ import annotations

import pytest
from hivemind.proto.runtime_pb2 import Tensor

from nesa_node.client.swarm import Swarm
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame, read
from nesa_node.protocol.messages import INFO_ANSWERS
from tests.support.swarm import wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

DELAY_MS = 40.0


def test_nodes_measure_and_publish_their_links_and_an_injected_delay_shows(local_swarm, tiny_llama):
    settings = {"dht_prefix": "links", "announce_period_s": 1.0, "link_probe_period_s": 1.0}
    first = local_swarm.start_node(tiny_llama, 0, 2, **settings)
    near = local_swarm.start_node(tiny_llama, 2, 4, **settings)
    far = local_swarm.start_node(tiny_llama, 2, 4, inject_delay_ms=DELAY_MS, **settings)
    swarm = local_swarm.run(Swarm.create(local_swarm.initial_peers, dht_prefix="links"))
    try:

        def links_of_first() -> dict:
            for record in local_swarm.run(swarm.node_records()):
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
        oversized = Frame(tensors=[Tensor(buffer=bytes(rpc.MAX_PING_BYTES + 1))])
        answer = local_swarm.run(swarm.unary(near.peer_id, rpc.PING, oversized))
        assert read(answer, INFO_ANSWERS).code == "too_large"
    finally:
        local_swarm.run(swarm.close())


def test_the_client_routes_around_a_node_that_is_40_ms_further_away(local_swarm, tiny_models):
    """Two nodes per span, one of each 40 ms further away: eq. 18 on the measured links picks the near node of every
    span, and the tokens are the single-process ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from nesa_node import DistributedModelForCausalLM

    path = tiny_models["llama"]
    settings = {"dht_prefix": "links-routing", "announce_period_s": 1.0, "link_probe_period_s": 1.0}
    near, far = [], []
    for start, end in [(0, 2), (2, 4)]:
        far.append(local_swarm.start_node(path, start, end, inject_delay_ms=DELAY_MS, **settings))
        near.append(local_swarm.start_node(path, start, end, **settings))
    prompt = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = AutoModelForCausalLM.from_pretrained(path).generate(
            prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
    with DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=local_swarm.initial_peers, dht_prefix="links-routing", compression="none"
    ) as model:

        def every_link_published() -> bool:
            records = {record.info.peer_id: record.info for record in model.call(model.swarm.node_records())}
            first, second = {node.peer_id for node in near[:1] + far[:1]}, {node.peer_id for node in near[1:] + far[1:]}
            return len(records) == 4 and all(
                {link.peer_id for link in records[peer].links} >= (second if peer in first else first)
                for peer in records
            )

        wait_until(every_link_published, timeout_s=30)
        chain = model.choose_chain(max_length=36)
        snapshot = model.snapshot()
        access = {node.peer_id: node.access_ms for node in snapshot.nodes}
        print(f"\nchain {chain.peer_ids}; fitted last miles (ms): {access}")
        assert chain.peer_ids == (near[0].peer_id, near[1].peer_id)
        assert min(access[node.peer_id] for node in far) > max(access[node.peer_id] for node in near) + DELAY_MS / 8
        # the client's own round trips to the first-block candidates, pinged on their data lanes when it chose
        rtts = model.swarm.rtt_ms
        assert set(rtts) >= {near[0].peer_id, far[0].peer_id}
        assert rtts[far[0].peer_id] - rtts[near[0].peer_id] > 0.75 * DELAY_MS
        output = model.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert model.last_chain.peer_ids == chain.peer_ids
    assert torch.equal(output, expected)

"""A record may name any lane address: a node announcing another node's lane (nearer to the client, say) must not
borrow its round trip. The client pings a lane only once it proved to be the peer's (protocol/lane.py `prove`,
client/round_trips.py `proved_lane`); the liar is pinged over libp2p, which authenticates it. Nor may a next node's
announced lane point a node at services of its own machine or network: a node dials no lane nearer than its own
address (protocol/lane.py `may_dial`) and pushes over libp2p instead."""

from __future__ import annotations

from nesa_node import DistributedModelForCausalLM
from nesa_node.protocol.dht import NodeRecord
from tests.support.swarm import wait_for_chain

PREFIX = "lane-identity"


def test_a_node_naming_another_nodes_lane_is_not_timed_on_it(module_swarm, tiny_llama):
    honest = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX)
    liar = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX)
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
        ) as model:
            wait_for_chain(model, hops=2, max_length=16)
            swarm = model.swarm
            address = swarm.lane_address(honest.peer_id)
            assert address is not None and swarm.lane_address(liar.peer_id) not in (None, address)
            record = swarm._records[liar.peer_id]  # the liar's record, as if it had announced the honest lane
            swarm.hold([NodeRecord(record.info.model_copy(update={"lane": address}), record.expiration_time)])
            assert swarm.lane_address(liar.peer_id) == address
            swarm.wire_rtt_ms.forget(liar.peer_id)
            swarm.rtt_ms.forget(liar.peer_id)
            assert model.call(swarm.proved_lane(honest.peer_id, 5.0)) == address
            assert model.call(swarm.proved_lane(liar.peer_id, 5.0)) is None
            model.call(swarm.measure_rtts([liar.peer_id, honest.peer_id], max_age_s=0.0))
            assert swarm.rtt_ms.get(liar.peer_id) is not None  # measured, over libp2p
            assert swarm.wire_rtt_ms.get(liar.peer_id) is None  # no lane set-up time of another node's lane
            assert swarm.wire_rtt_ms.get(honest.peer_id) is not None
    finally:
        module_swarm.stop_node(liar)
        module_swarm.stop_node(honest)


def test_a_node_pushes_over_libp2p_to_a_lane_nearer_than_its_own_address(module_swarm, tiny_llama):
    """A node on the internet does not dial a next node's lane on loopback (a hostile next node could point it at
    services of its own machine): its pushes go over libp2p instead, and the tokens are the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from nesa_node.protocol.channel import LaneChannel

    prompt = torch.tensor([[5, 6, 7, 8, 9]])
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(prompt, max_new_tokens=6, do_sample=False)
    prefix = f"{PREFIX}-scope"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    second = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    first.inference.push.own_host = "1.1.1.1"  # as if it listened on the internet
    pushed: list[object] = []
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=prefix, compression="none"
        ) as model:
            wait_for_chain(model, hops=2, max_length=16)
            assert model.swarm.lane_address(second.peer_id) is not None  # it has a lane, on loopback
            with model.inference_session(max_length=16) as session:
                assert session.links.direct  # its pushes go node to node
                output = model.generate(prompt, max_new_tokens=6, do_sample=False)
                pushed.extend(held.downstream for held in first.sessions.sessions.values())
        assert torch.equal(output, reference)
        assert pushed and all(channel is not None and not isinstance(channel, LaneChannel) for channel in pushed)
    finally:
        module_swarm.stop_node(second)
        module_swarm.stop_node(first)

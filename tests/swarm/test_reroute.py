"""Routing when the DHT holds no record of a live node (its announcements missed the replicas read, or a frozen
replica slows every read): the client asks the nodes it saw lately for the blocks directly, over libp2p."""

from __future__ import annotations

import pytest
import torch
from hivemind.utils import get_dht_time
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.swarm import RECENT_RECORD_S
from nesa_node.errors import NoRouteError
from nesa_node.protocol.dht import NodeRecord

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])


def test_a_live_node_missing_from_the_dht_is_asked_directly(local_swarm, tiny_llama):
    # the node announces under another DHT prefix: the client's reads never return its record
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="announced-elsewhere")
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="read-here", compression="none"
    ) as model:
        with pytest.raises(NoRouteError, match="nodes seen for blocks 0:4: none"):
            model.choose_chain(max_length=32)  # a node the client never saw is not found
        # a record seen longer ago than the horizon: not asked
        model.swarm.hold([NodeRecord(info=node.current_info(), expiration_time=get_dht_time() - RECENT_RECORD_S - 5)])
        with pytest.raises(NoRouteError):
            model.choose_chain(max_length=32)
        # the same record, expired 30 s ago: the client asks the node, which answers with its live NodeInfo
        model.swarm.hold([NodeRecord(info=node.current_info(), expiration_time=get_dht_time() - 30)])
        chain = model.choose_chain(max_length=32)
        assert [(hop.peer_id, hop.start_block, hop.end_block) for hop in chain.hops] == [(node.peer_id, 0, 4)]
        output = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert torch.equal(output, reference)

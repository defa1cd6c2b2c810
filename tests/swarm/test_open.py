"""Opening a session on a node that takes the stream and never answers: the client names that node (so the model
bans it and opens on another chain) instead of failing with no node to blame."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.p2p import P2P

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.chain_links import LinkFailed
from nesa_node.protocol import rpc
from nesa_node.routing.chain import Chain, Hop


async def silent_peer(initial_peers: list[str]) -> P2P:
    """A peer serving the inference stream that reads every request and answers none."""
    p2p = await P2P.create(initial_peers=initial_peers)

    async def swallow(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(1 << 16):
            pass

    await p2p.add_binary_stream_handler(rpc.INFERENCE, swallow)
    return p2p


def test_a_node_that_never_acknowledges_the_open_is_named(local_swarm, tiny_llama):
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, request_timeout_s=3.0
    ) as model:
        client_maddrs = model.call(model.swarm.peer.visible_maddrs())
        silent = local_swarm.run(silent_peer(client_maddrs))  # connected to the client from the start
        try:
            peer_id = silent.peer_id.to_base58()
            with pytest.raises(LinkFailed) as failure:
                model.session_on(Chain(hops=(Hop(peer_id, 0, 4),)), batch=1, max_length=8, failover=False)
            assert failure.value.link is not None and failure.value.link.hop.peer_id == peer_id
            assert "did not acknowledge the open" in failure.value.message
        finally:
            local_swarm.run(silent.shutdown())

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
from tests.support.swarm import wait_until


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


def test_an_unreachable_node_is_named_before_any_node_reserves_a_cache(local_swarm, tiny_llama):
    """The session's streams open together and the opens go out once every one is up: when a later node of the chain
    cannot be reached, the client names it, and the nodes before it were never asked to reserve a cache."""
    node = local_swarm.start_node(tiny_llama, 0, 2)
    opened = []
    table_open = node.sessions.open

    def counted_open(request, **kwargs):
        opened.append(request.session_id)
        return table_open(request, **kwargs)

    node.sessions.open = counted_open
    try:
        gone = local_swarm.run(P2P.create(initial_peers=local_swarm.peers_with(node)))
        gone_id = gone.peer_id.to_base58()
        local_swarm.run(gone.shutdown())
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, request_timeout_s=3.0
        ) as model:
            wait_until(  # the client knows the node (its record, with its addresses)
                lambda: (
                    node.peer_id in {record.info.peer_id for record in model.call(model.swarm.node_records(fresh=True))}
                )
            )
            with pytest.raises(LinkFailed) as failure:
                model.session_on(
                    Chain(hops=(Hop(node.peer_id, 0, 2), Hop(gone_id, 2, 4))), batch=1, max_length=8, failover=False
                )
            assert failure.value.link is not None and failure.value.link.hop.peer_id == gone_id
            assert "could not open a session" in failure.value.message
            assert opened == []  # the reachable node got no open
            session = model.session_on(Chain(hops=(Hop(node.peer_id, 0, 2),)), batch=1, max_length=8, failover=False)
            session.close()
            assert len(opened) == 1  # and opens a session when asked
    finally:
        local_swarm.stop_node(node)

"""Stability-informed reliability live (client/stability.py, Nesa sec. 3.1): seven nodes serve the whole tiny Llama,
four announced in Frankfurt and three in New York; one of the Frankfurt nodes announces links that flap (its round
trips to the others jump between 2 and 400 ms from one record to the next). In the snapshots where its links are
slow it joins only the whole swarm, a component too large to count, where the other Frankfurt nodes form a cluster
that lives until the ocean is crossed; so over the client's recent snapshots its stability, and its reliability
term, end below the stable nodes'. Once its links are calm again routing still prefers an equally fast stable
node, and the tokens equal the reference."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.protocol.records import LinkInfo
from tests.support.swarm import wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

PREFIX = "stability"
PROMPT = torch.tensor([[5, 6, 7, 8]])


def announcing(node, where: tuple[float, float], links_of) -> None:
    """Make `node` announce location `where` and the links `links_of()` gives at each call of its record."""
    honest = node.current_info
    node.current_info = lambda: honest().model_copy(update={"location": where, "links": links_of()})


def test_a_node_whose_links_flap_gets_a_worse_reliability_and_is_routed_around(module_swarm, tiny_llama):
    nodes = [module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX, announce_period_s=0.5) for _ in range(7)]
    stable, flapper = nodes[:3] + nodes[4:], nodes[3]
    places = [(50.1 + 0.01 * index, 8.7) for index in range(4)] + [(40.7 + 0.01 * index, -74.0) for index in range(3)]
    place = {node.peer_id: where for node, where in zip(nodes, places, strict=True)}
    peers = [node.peer_id for node in nodes]

    def calm(me: str) -> tuple[LinkInfo, ...]:
        return tuple(LinkInfo(peer_id=peer, rtt_ms=2.0) for peer in peers if peer != me)

    phases = itertools.cycle([2.0, 400.0])
    flapping = {"on": True}

    def flapper_links() -> tuple[LinkInfo, ...]:
        rtt = next(phases) if flapping["on"] else 2.0
        return tuple(LinkInfo(peer_id=peer, rtt_ms=rtt) for peer in peers if peer != flapper.peer_id)

    for node in stable:
        announcing(node, place[node.peer_id], lambda me=node.peer_id: calm(me))
    announcing(flapper, place[flapper.peer_id], flapper_links)
    with torch.inference_mode():
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(PROMPT, max_new_tokens=6, do_sample=False)
    model = DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
    )
    try:
        model.swarm.stability.period_s = 0.25
        wait_until(lambda: set(peers) <= {r.info.peer_id for r in model.call(model.swarm.node_records(fresh=True))}, 30)  # noqa: E501
        deadline = time.monotonic() + 8.0  # snapshots of both phases of the flapper's records
        while time.monotonic() < deadline:
            model.call(model.swarm.snapshot(4, fresh=True))
            time.sleep(0.25)
        stability = model.swarm.stability.stability()
        assert len(model.swarm.stability.history) >= 10
        assert stability[flapper.peer_id] < min(stability[node.peer_id] for node in stable) - 0.1, stability
        flapping["on"] = False  # calm from now on: only the history tells it apart
        time.sleep(1.5)  # its calm record is announced and read
        snapshot = model.call(model.swarm.snapshot(4, fresh=True))
        reliability = {node.peer_id: node.reliability for node in snapshot.nodes}
        assert reliability[flapper.peer_id] < min(reliability[node.peer_id] for node in stable), reliability
        now = time.monotonic()
        for peer in peers:  # equally fast to this client: its pings on a loaded host vary by more than the term
            model.swarm.rtt_ms.add(peer, 0.01, now)
        for _ in range(5):
            assert flapper.peer_id not in model.choose_chain(max_length=16).peer_ids
        assert torch.equal(model.generate(PROMPT, max_new_tokens=6, do_sample=False), reference)
    finally:
        model.close()
        for node in nodes:
            module_swarm.stop_node(node)

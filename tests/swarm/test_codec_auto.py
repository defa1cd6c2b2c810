"""The default codec, "auto", on a live swarm: on loopback every hop stays lossless and the tokens equal one
process's; when the client's link to the first node is slow, a long prompt goes compressed and the one-token steps
after it do not (the choice is per message, and visible in the session's step timings)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.compression.names import AUTO_CODEC
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

PREFIX = "auto-codec"
PROMPT = torch.tensor([list(range(5, 69))])  # 64 tokens: 4096 elements of the tiny Llama's width
NEW_TOKENS = 6


def test_auto_is_lossless_on_loopback_and_compresses_only_what_pays_on_a_slow_link(module_swarm, tiny_llama):
    for start, end in ((0, 2), (2, 4)):
        module_swarm.start_node(tiny_llama, start, end, dht_prefix=PREFIX)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX
    ) as model:
        assert model.client.config.compression.name == "auto"
        wait_for_chain(model)
        with model.inference_session(max_length=80) as session:
            output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(output, reference)
        assert {timing.codec for timing in session.timings} == {"none"}
        assert set(session.output_codecs.values()) == {"none"}
        first = session.chain.peer_ids[0]
        swarm = model.swarm
        assert swarm.bandwidth_mbps(first, None) == math.inf  # a node on this machine: no network link at all

        swarm._bandwidth[first] = 20.0  # as measured on a slow uplink, to a node elsewhere
        swarm._bandwidth_measured[first] = time.monotonic()
        swarm._on_this_host = lambda peer_id: False
        with model.inference_session(max_length=80) as session:
            output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        codecs = [timing.codec for timing in session.timings]
        assert codecs[0] == AUTO_CODEC and set(codecs[1:]) == {"none"}  # the prompt compressed, 64-wide steps not
        assert output.shape == reference.shape


def test_nodes_without_lanes_on_this_machine_are_no_network_link_either(module_swarm, tiny_llama):
    """Nodes run with --no-lane announce no lane address to tell they are on this machine: the client's libp2p
    connections to them, all on loopback, tell it instead, so their links count as no network link (lossless), not
    as whatever a busy host makes a 256 KiB ping look like."""
    prefix = f"{PREFIX}-no-lane"
    nodes = [module_swarm.start_node(tiny_llama, start, end, dht_prefix=prefix, lane_port=None) for start, end in (
        (0, 2), (2, 4)
    )]  # fmt: skip
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama).generate(
        PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    try:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=prefix
        ) as model:
            wait_for_chain(model, hops=2)
            output = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
            swarm = model.swarm
            first, last = (node.peer_id for node in nodes)
            assert swarm.lane_address(first) is None and swarm.lane_address(last) is None
            wait_until(lambda: swarm.bandwidth_mbps(first, None) == swarm.bandwidth_mbps(last, None) == math.inf, 30)
            assert swarm.bandwidth_mbps(first, last) == math.inf  # two nodes on this machine
        assert torch.equal(output, reference)
    finally:
        for node in nodes:
            module_swarm.stop_node(node)

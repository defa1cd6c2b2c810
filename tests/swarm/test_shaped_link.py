"""The "auto" codec over a link shaped to 50 Mbit/s (a node in a network namespace behind a `tc tbf` veth pair):
the client measures the slow link, sends a long prompt and a batch forward compressed with the 8-bit codec, and the
forward is faster than with "none". On loopback (tests/swarm/test_codec_auto.py) the same default stays lossless."""

from __future__ import annotations

import time

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.compression.auto import LOSSLESS_FROM_MBPS
from nesa_node.compression.names import AUTO_CODEC
from nesa_node.devtools.launcher import ProcessGroup
from tests.support.netns import ShapedNamespace, can_shape
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = [pytest.mark.cli, pytest.mark.serial, pytest.mark.skipif(can_shape() is not None, reason=str(can_shape()))]

RATE_MBIT = 50
PREFIX = "shaped"


def timed_forward(model, input_ids) -> float:
    started = time.perf_counter()
    model(input_ids)
    return time.perf_counter() - started


def test_auto_compresses_over_a_slow_link_and_the_forward_is_faster(tiny_llama, tmp_path):
    with ShapedNamespace(RATE_MBIT) as namespace, ProcessGroup(tmp_path) as group:
        bootstrap, boot_file = group.start("dht", ["dht", "--host", namespace.outer_ip])
        peers = group.wait_address(bootstrap, boot_file)
        node_args = ["run", "--model", tiny_llama, "--blocks", "0:4", "--initial-peers", *peers]
        node_args += ["--host", namespace.inner_ip, "--dht-prefix", PREFIX, "--no-measure", "--rebalance", "off"]
        node, node_file = group.start("node", node_args, wrapper=namespace.command())
        group.wait_address(node, node_file)
        with DistributedModelForCausalLM.from_pretrained(tiny_llama, initial_peers=peers, dht_prefix=PREFIX) as auto:
            wait_for_chain(auto)
            node_id = auto.choose_chain(max_length=16).peer_ids[0]
            auto.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)  # opening a session measures the link
            wait_until(lambda: auto.swarm.bandwidth_mbps(node_id, None) is not None, timeout_s=30)
            measured = auto.swarm.bandwidth_mbps(node_id, None)
            assert measured < LOSSLESS_FROM_MBPS, measured
            prompt = torch.tensor([list(range(5, 133))])  # 128 tokens: 8192 elements, 32 KiB lossless
            with auto.inference_session(max_length=140) as session:
                auto.generate(prompt, max_new_tokens=4, do_sample=False)
            assert session.timings[0].codec == AUTO_CODEC  # the prompt went compressed
            batch = torch.randint(3, 1000, (8, 128), generator=torch.Generator().manual_seed(0))
            timed_forward(auto, batch)  # warm-up
            auto_s = min(timed_forward(auto, batch) for _ in range(3))
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=peers, dht_prefix=PREFIX, compression="none"
        ) as lossless:
            wait_for_chain(lossless)
            timed_forward(lossless, batch)
            none_s = min(timed_forward(lossless, batch) for _ in range(3))
        print(
            f"\n8x128 forward over {RATE_MBIT} Mbit/s (measured {measured:.0f}): auto {auto_s * 1000:.0f} ms, "
            f"none {none_s * 1000:.0f} ms, {none_s / auto_s:.2f}x"
        )
        assert auto_s < none_s

"""A swarm across machines: a bootstrap peer, three nodes and the client each in a network namespace of its own,
joined by veth pairs to one bridge (a LAN), one node's link shaped to 50 Mbit/s with `tc tbf`. Every peer listens on
0.0.0.0 and announces its LAN address (`--announce-host`), so no loopback address is in any record; the client gets
the single-process tokens (`compression="none"`), also with the node serving its chain's last blocks killed
mid-generation (the spare takes over). Every namespace and veth made is removed at the end."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.devtools.launcher import ProcessGroup
from tests.support.netns import Switch, can_shape
from tests.support.swarm import wait_for_chain

pytestmark = [pytest.mark.cli, pytest.mark.skipif(can_shape() is not None, reason=str(can_shape()))]

PREFIX = "multihost"
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])
NEW_TOKENS, KILL_AFTER = 16, 6
SPANS = {"n1": (0, 2), "n2": (2, 4), "n3": (2, 4)}  # n2 and n3: one serves the chain, the other is the spare
SHAPED = "n2"
RATE_MBIT = 50


def test_a_swarm_across_network_namespaces_gives_the_reference_and_survives_a_killed_node(tiny_llama, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="nesa_node.client")  # the client's failover steps, in a failure's report
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        reference = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    switch = Switch(subnet=f"10.214.{os.getpid() % 250}")
    with switch, ProcessGroup(tmp_path) as group:
        boot = switch.host("boot")
        hosts = {name: switch.host(name, rate_mbit=RATE_MBIT if name == SHAPED else None) for name in SPANS}
        client_ip = switch.attach_here()
        every = ["--host", "0.0.0.0"]
        bootstrap, boot_file = group.start(
            "dht", ["dht", *every, "--port", "31337", "--announce-host", boot.ip], wrapper=boot.command()
        )
        peers = group.wait_address(bootstrap, boot_file)
        assert peers and all(f"/ip4/{boot.ip}/tcp/31337/p2p/" in peer for peer in peers), peers
        processes = {}
        for name, (start, end) in SPANS.items():
            args = ["run", "--model", tiny_llama, "--blocks", f"{start}:{end}", "--initial-peers", *peers, *every]
            args += ["--announce-host", hosts[name].ip, "--dht-prefix", PREFIX, "--no-measure", "--rebalance", "off"]
            args += ["--torch-threads", "1"]
            processes[name] = group.start(name, args, wrapper=hosts[name].command())
        addresses = {name: group.wait_address(*started) for name, started in processes.items()}
        for name, listed in addresses.items():  # announced: the LAN address alone
            assert all(f"/ip4/{hosts[name].ip}/tcp/" in address for address in listed), (name, listed)
        by_peer = {listed[0].rsplit("/p2p/", 1)[1]: name for name, listed in addresses.items()}

        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=peers, dht_prefix=PREFIX, compression="none"
        ) as client:
            wait_for_chain(client, hops=2)
            records = {record.info.peer_id: record.info for record in client.call(client.swarm.node_records(True))}
            for peer_id, name in by_peer.items():  # the data lanes are announced on the LAN too
                assert records[peer_id].lane.startswith(f"{hosts[name].ip}:"), records[peer_id].lane
            with client.inference_session(max_length=32) as session:
                first, last = (by_peer[peer_id] for peer_id in session.chain.peer_ids)
                assert (first, SPANS[last]) == ("n1", (2, 4)), session.chain.peer_ids
                victim = processes[last][0]
                try:
                    output = client.generate(
                        PROMPT,
                        max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS,
                        do_sample=False,
                        streamer=AfterTokens(KILL_AFTER, lambda: os.killpg(victim.pid, signal.SIGKILL)),
                    )
                except Exception as exc:  # what the client and each node saw, in the report
                    tails = "\n".join(
                        f"{name}: {group.log_tail(started[0], 40)}" for name, started in processes.items()
                    )
                    raise AssertionError(f"{exc!r}\nfailovers: {session.failovers}\n{tails}") from exc
                spare = next(name for name in ("n2", "n3") if name != last)
                assert [by_peer[peer_id] for peer_id in session.chain.peer_ids] == ["n1", spare]
            assert victim.wait(timeout=10) == -signal.SIGKILL
        print(f"\nclient {client_ip}; chain n1 -> {last} ({SHAPED} shaped to {RATE_MBIT} Mbit/s), {last} killed "
              f"after {KILL_AFTER} tokens, finished on {spare}")  # fmt: skip
        assert torch.equal(output, reference)
    assert switch.leftovers() == []

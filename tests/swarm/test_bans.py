"""Bans and their second chance (client/routing.py Router.reachable_chain, client/swarm.py Swarm.ban): a node banned
after a failure that answers again is routed to once no chain is left without it; one banned for a fault (it sent
something wrong) never is, nor one that does not answer. And a chain kept while it is slow (client/failover.py):
once a step, so a node that answers pings but never a step costs a bounded wait."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.config import ClientConfig
from nesa_node.devtools.chaos import AfterTokens
from nesa_node.errors import NoRouteError, PeerUnavailableError
from tests.support.swarm import wait_for_chain, wait_until

PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
PREFIX = "second-chance"


@pytest.fixture(scope="module")
def reference(tiny_llama) -> torch.Tensor:
    with torch.inference_mode():
        return AutoModelForCausalLM.from_pretrained(tiny_llama).generate(PROMPT, max_new_tokens=6, do_sample=False)


def connect(swarm, path: str) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=PREFIX, compression="none"
    )


def fail_once(node, failure, *, after_compute: bool = False) -> list[int]:
    """Make the in-process `node` await `failure()` once, at its second decode step (before or after computing
    it); the positions it did so at."""
    honest_run, failed = node.compute.run, []

    async def run(hidden, cache, position, blocks, adapter=None):
        due = position >= PROMPT.shape[1] + 2 and not failed
        if due and not after_compute:
            failed.append(position)
            await failure()
        output = await honest_run(hidden, cache, position, blocks, adapter)
        if due and after_compute:
            failed.append(position)
            await failure()
        return output

    node.compute.run = run
    return failed


def generate_through_one_failover(model, session, reference, failed: str, replacement: str) -> None:
    """Generate in `session`: the reference tokens, through one failover from `failed` to `replacement`."""
    output = model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(output, reference)
    assert [(entry["failed"], entry["replacements"]) for entry in session.failovers] == [(failed, [replacement])], (
        session.failovers
    )


def test_the_last_node_banned_after_a_failure_gets_a_second_chance_when_it_answers(local_swarm, tiny_llama, reference):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX)
    with connect(local_swarm, tiny_llama) as model:
        wait_for_chain(model)
        # as after a failure its neighbour reported (a dial refused for a moment); long enough not to expire here
        model.swarm.ban(node.peer_id, base_s=600)
        assert node.peer_id in model.swarm.banned()
        output = model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert torch.equal(output, reference)
        assert node.peer_id not in model.swarm.banned()
        assert model.last_chain.peer_ids == (node.peer_id,)

        model.swarm.ban(node.peer_id, fault=True)  # as after bad hidden states: no second chance, ever
        with pytest.raises(NoRouteError, match="banned for sending something wrong"):
            model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert node.peer_id in model.swarm.banned()
        assert not model.swarm.unban(node.peer_id) and node.peer_id in model.swarm.banned()  # not even by hand
        model.swarm.ban(node.peer_id, base_s=600)  # a failure ban after a fault: still no second chance
        with pytest.raises(NoRouteError):
            model.generate(PROMPT, max_new_tokens=6, do_sample=False)


def test_a_banned_node_that_does_not_answer_stays_banned(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX)
    with connect(local_swarm, tiny_llama) as model:
        wait_for_chain(model)
        peer_id = node.peer_id
        local_swarm.stop_node(node)  # gone; its record lingers until it expires
        model.swarm.ban(peer_id, base_s=600)
        with pytest.raises(NoRouteError, match="blocks 0"):
            model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert peer_id in model.swarm.banned()


def test_a_second_chance_that_gives_no_chain_either_is_taken_back(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX)  # no node serves blocks 2:4
    with connect(local_swarm, tiny_llama) as model:
        wait_until(lambda: node.peer_id in {record.info.peer_id for record in model.call(model.swarm.node_records())})
        model.swarm.ban(node.peer_id, base_s=600)
        with pytest.raises(NoRouteError, match="blocks 2"):
            model.generate(PROMPT, max_new_tokens=6, do_sample=False)
        assert node.peer_id in model.swarm.banned()  # it answered, but no chain had it: banned again


def test_a_node_that_answers_pings_but_never_a_step_is_waited_for_once(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX)
    honest_run = node.compute.run

    async def stuck_run(hidden, cache, position, blocks, adapter=None):
        if position >= PROMPT.shape[1] + 3:  # a few honest steps first, so the decode deadline is the short one
            await asyncio.sleep(20)  # its event loop stays free: it answers every probe
        return await honest_run(hidden, cache, position, blocks, adapter)

    node.compute.run = stuck_run
    config = ClientConfig(request_timeout_s=3.0)  # a config's field holds where no keyword overrides it
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=PREFIX, compression="none", config=config
    ) as model:
        wait_for_chain(model)
        with model.inference_session(max_length=32) as session:
            started = time.monotonic()
            with pytest.raises(PeerUnavailableError, match="every node of the chain still answers"):
                model.generate(PROMPT, max_new_tokens=10, min_new_tokens=10, do_sample=False)
            elapsed = time.monotonic() - started
        assert [(entry["failed"], entry["kept"]) for entry in session.failovers] == [(None, True)]  # kept once
        assert elapsed < 12, elapsed  # the 1 s deadline, then the 3 s request timeout once, and the probes
        # then the chain's nodes are banned for a failure (not a fault): the next session is not routed the same way
        # at once, and the ban can be lifted if no other chain is left
        assert node.peer_id in model.swarm.banned() and node.peer_id not in model.swarm.faulty()


def test_a_replacements_slow_first_step_is_not_taken_for_its_failure(local_swarm, tiny_llama, reference):
    """A replacement's first step is a cold one (channels to and from it opened anew, its first compute): the step
    sent again after a failover gets the request timeout, not the deadline of the warm steps before, so a healthy
    replacement slow at it is not probed, kept or banned as if it had failed (a second recovery would follow)."""
    local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX)
    spans = [local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX) for _ in range(2)]
    with connect(local_swarm, tiny_llama) as model:
        wait_for_chain(model, hops=2)
        wait_until(lambda: len(model.call(model.swarm.node_records(True))) == 3)
        with model.inference_session(max_length=32) as session:
            lost = next(node for node in spans if node.peer_id == session.chain.peer_ids[-1])
            spare = next(node for node in spans if node is not lost)
            honest_run, slowed = spare.compute.run, []

            async def slow_first_step(hidden, cache, position, blocks, adapter=None):
                if hidden.shape[1] == 1 and not slowed:  # its first decode step, after the replayed prefix
                    slowed.append(position)
                    await asyncio.sleep(2.5)  # over the warm steps' deadline (1 s), far under the request timeout
                return await honest_run(hidden, cache, position, blocks, adapter)

            spare.compute.run = slow_first_step
            output = model.generate(  # the lost node stops (ending its sessions) before the 5th token's step
                PROMPT,
                max_new_tokens=6,
                min_new_tokens=6,
                do_sample=False,
                streamer=AfterTokens(4, lambda: local_swarm.stop_node(lost)),
            )
            assert torch.equal(output, reference)
            assert slowed, "the spare took no decode step"
            assert [(entry["failed"], entry["replacements"]) for entry in session.failovers] == [
                (lost.peer_id, [spare.peer_id])
            ], session.failovers


def test_a_node_over_its_step_timeout_is_replaced_not_its_next_node(local_swarm, tiny_llama, reference):
    """A node whose own compute of a step runs past its step timeout ends the session with step_timeout: the client
    replaces that node. (A node that could not hand a step on names its next node, peer_unavailable.)"""
    firsts = [local_swarm.start_node(tiny_llama, 0, 2, dht_prefix=PREFIX, step_timeout_s=1.0) for _ in range(2)]
    last = local_swarm.start_node(tiny_llama, 2, 4, dht_prefix=PREFIX)
    config = ClientConfig(step_timeout_s=30.0)  # the client waits for the node's own answer
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix=PREFIX, compression="none", config=config
    ) as model:
        wait_for_chain(model, hops=2)
        wait_until(lambda: len(model.call(model.swarm.node_records(True))) == 3)
        with model.inference_session(max_length=32) as session:
            slow = next(node for node in firsts if node.peer_id == session.chain.peer_ids[0])
            spare = next(node for node in firsts if node is not slow)
            assert session.chain.peer_ids[1] == last.peer_id
            slowed = fail_once(slow, lambda: asyncio.sleep(3.0))  # over the node's step timeout
            generate_through_one_failover(model, session, reference, slow.peer_id, spare.peer_id)
            assert slowed
            assert last.peer_id not in model.swarm.banned()


@pytest.mark.parametrize("broken", [1, 2], ids=["middle", "last"])
def test_the_only_node_of_a_span_whose_channel_broke_is_opened_again_not_given_up(
    local_swarm, tiny_llama, reference, broken
):
    """The client's channel to a node breaks while the node lives on, and no other node serves its blocks: the
    session opens again on that node (its cache rebuilt from the history) instead of ending with no_route. The node
    after it takes the step the reopened node sends again, recomputed from the replayed cache, as from any
    replacement: the tokens are the reference."""
    nodes = [
        local_swarm.start_node(tiny_llama, start, end, dht_prefix=PREFIX) for start, end in ((0, 1), (1, 3), (3, 4))
    ]
    with connect(local_swarm, tiny_llama) as model:
        wait_for_chain(model, hops=3)
        with model.inference_session(max_length=32) as session:
            assert session.chain.peer_ids == tuple(node.peer_id for node in nodes)
            node = nodes[broken]

            async def cut() -> None:  # the client's session stream to this node, once the step is computed
                (server_session,) = node.sessions.sessions.values()
                server_session.reply.abort()

            was_cut = fail_once(node, cut, after_compute=True)
            generate_through_one_failover(model, session, reference, node.peer_id, node.peer_id)
            assert was_cut
            assert not model.swarm.banned()

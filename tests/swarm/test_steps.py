"""Step ids (RELIABILITY.md A7) and a client that dies (A5), against a real node on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from nesa_node import DistributedModelForCausalLM
from nesa_node.errors import BadRequestError
from nesa_node.protocol.channel import Frame, frame
from nesa_node.protocol.messages import ErrorReply, Retarget, Step
from nesa_node.protocol.tensors import tensor_to_proto
from tests.support.swarm import step_held_up, wait_for_chain


def succeeded(message):
    """The message, unless it is a node's ErrorReply: then the error it names is raised."""
    if isinstance(message, ErrorReply):
        raise message.error()
    return message


def test_a7_a_step_delivered_twice_is_processed_once(local_swarm, tiny_llama):
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="steps")
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="steps", compression="none"
    ) as model:
        chain = wait_for_chain(model)
        session = model.session_on(chain, batch=1, max_length=16, failover=False)
        link = session.links.links[0]
        hidden = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(0))

        def request(tensor: torch.Tensor) -> Frame:
            return frame(Step(step_id="s:0", position=0), [tensor_to_proto(tensor)])

        async def send(message: Frame):
            link.send(message)  # on the session's stream, around the session's own bookkeeping
            _, answer, answer_frame = await session.links.next_answer(10.0)
            return answer, answer_frame

        try:
            served = node.compute.steps_served
            first_answer, first = model.call(send(request(hidden)))
            again_answer, again = model.call(send(request(hidden)))
            succeeded(first_answer)
            succeeded(again_answer)
            assert again.tensors[0].buffer == first.tensors[0].buffer  # the same output, from the record
            assert again_answer.position == first_answer.position == 0
            assert node.compute.steps_served == served + 1  # computed once
            forged_answer, _ = model.call(send(request(hidden + 1)))  # same id, other content
            with pytest.raises(BadRequestError, match="already used for different content"):
                succeeded(forged_answer)
            # after a retarget to a new upstream (a replacement of the previous node), the same step recomputed by
            # that replacement may differ in the last bits: answered from the record, not refused, not recomputed
            retarget = Retarget(upstream=local_swarm.bootstrap.p2p.peer_id.to_base58())
            succeeded(model.call(send(frame(retarget)))[0])
            recomputed_answer, recomputed = model.call(send(request(hidden * (1 + 1e-6))))
            succeeded(recomputed_answer)
            assert recomputed.tensors[0].buffer == first.tensors[0].buffer
            assert node.compute.steps_served == served + 1
            # the session is undisturbed: the next step continues from position 2, the client its upstream again (a
            # node with another peer upstream takes only steps carrying the client's seal: protocol/push_tag.py)
            succeeded(model.call(send(frame(Retarget(upstream=model.swarm.peer_id))))[0])
            session.session.position = 2  # the raw steps above went around the session's own bookkeeping
            assert session.step(torch.randn(1, 1, 64)).shape == (1, 1, 64)
        finally:
            session.close()


def test_a_session_with_no_failover_waits_for_a_step_held_up_for_a_moment(local_swarm, tiny_llama):
    """A session on a fixed chain (no rerouter) has nothing to fail over to: a decode step the node holds up past the
    adaptive deadline of a generation's steps (10x the recent ones, at least 1 s) is waited for, within the request
    timeout, not taken for a broken chain."""
    node = local_swarm.start_node(tiny_llama, 0, 4, dht_prefix="held-up")
    # the prompt and 8 one-token steps fast, so the adaptive deadline would be 1 s, then the 10th held up
    with step_held_up(node, at=10, seconds=1.5) as held:
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=local_swarm.initial_peers, dht_prefix="held-up", compression="none"
        ) as model:
            chain = wait_for_chain(model)
            generator = torch.Generator().manual_seed(0)
            with model.session_on(chain, batch=1, max_length=32, failover=False) as session:
                output = session.step(torch.randn(1, 4, 64, generator=generator))
                for _ in range(9):
                    started = time.monotonic()
                    output = session.step(output[:, -1:])
                assert held.steps == 10 and time.monotonic() - started >= 1.5  # the last step was the held-up one
                assert output.shape == (1, 1, 64) and torch.isfinite(output).all()


CLIENT = textwrap.dedent(
    """
    import sys, time, torch
    from nesa_node import DistributedModelForCausalLM
    model = DistributedModelForCausalLM.from_pretrained(sys.argv[1], initial_peers=sys.argv[3:], dht_prefix=sys.argv[2])
    with model.inference_session(max_length=200):
        model(torch.tensor([[5, 6, 7, 8]]))
        print("session open", flush=True)
        time.sleep(600)
    """
)


def test_a5_a_dead_client_frees_every_node_cache(local_swarm, tiny_llama):
    nodes = [
        local_swarm.start_node(tiny_llama, start, end, dht_prefix="dead-client") for start, end in ((0, 2), (2, 4))
    ]
    baseline = [node.budget.tokens_left for node in nodes]
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, tiny_llama, "dead-client", *local_swarm.initial_peers],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert client.stdout.readline().strip() == "session open"
        assert all(node.budget.tokens_left < left for node, left in zip(nodes, baseline, strict=True))
        client.kill()  # SIGKILL: no goodbye, its p2pd dies with it
        client.wait(timeout=10)
        deadline = time.monotonic() + 30
        while [node.budget.tokens_left for node in nodes] != baseline and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [node.budget.tokens_left for node in nodes] == baseline
        assert all(not node.sessions.sessions for node in nodes)
    finally:
        client.kill()
        client.wait(timeout=10)

"""What a client accepts as a node's answer to a cacheless forward (client/swarm.py `Swarm.forward`): exactly the
input's shape, every value finite; anything else fails the call with a typed error and bans the node for a fault."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nesa_node.client.swarm import Swarm
from nesa_node.errors import PeerUnavailableError, QuotaExceededError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.messages import ErrorReply, ForwardResult
from nesa_node.protocol.tensors import tensor_to_proto
from nesa_node.routing.chain import Hop

HIDDEN = torch.randn(2, 3, 4)


def forward_answered_with(output: torch.Tensor | None, tensors: int = 1):
    swarm = Swarm(SimpleNamespace(p2p=None, dht=None), dht_prefix="test")
    swarm.use_lanes = False  # the call goes over libp2p, here the node's unary answer below

    async def unary(peer_id, name, request, timeout_s=None):
        return frame(ForwardResult(compute_s=0.001), [tensor_to_proto(output)] * tensors)

    swarm.unary = unary
    return swarm, asyncio.run(_call(swarm))


async def _call(swarm: Swarm):
    try:
        return await swarm.forward(Hop("node", 0, 2), HIDDEN)
    except PeerUnavailableError as error:
        return error


def test_an_answer_of_the_inputs_shape_is_taken():
    swarm, result = forward_answered_with(HIDDEN * 2)
    assert torch.equal(result[0], HIDDEN * 2) and "node" not in swarm.banned()


@pytest.mark.parametrize(
    "output, tensors, why",
    [
        (torch.full((1, 1, 12), float("nan")), 1, "shape"),  # as many elements, another shape
        (torch.randn(2, 2, 4), 1, "shape"),  # a token short
        (torch.full((2, 3, 4), float("inf")), 1, "NaN or infinite"),
        (torch.randn(2, 3, 4), 2, "not one tensor"),
    ],
)
def test_a_malformed_answer_fails_the_call_and_bans_the_node_for_a_fault(output, tensors, why):
    swarm, result = forward_answered_with(output, tensors)
    assert isinstance(result, PeerUnavailableError) and why in result.message
    assert "node" in swarm.banned() and "node" in swarm._faulty


def test_a_node_running_its_most_forwards_is_asked_again_after_a_short_wait():
    """Honest callers beyond a node's forward bound (server/rpc.py) are refused at once; the client waits a little
    and asks again rather than failing the call, a few times."""
    swarm = Swarm(SimpleNamespace(p2p=None, dht=None), dht_prefix="test")
    swarm.use_lanes = False
    refusals = [2]  # the node is busy for its first two answers

    async def unary(peer_id, name, request, timeout_s=None):
        if refusals[0]:
            refusals[0] -= 1
            return frame(ErrorReply.of(QuotaExceededError("this node answers 16 forwards at once")))
        return frame(ForwardResult(compute_s=0.001), [tensor_to_proto(HIDDEN)])

    swarm.unary = unary
    output, _ = asyncio.run(swarm.forward(Hop("node", 0, 2), HIDDEN))
    assert torch.equal(output, HIDDEN) and refusals == [0]
    refusals[0] = 100  # busy for good: the refusal reaches the caller, typed
    with pytest.raises(QuotaExceededError):
        asyncio.run(swarm.forward(Hop("node", 0, 2), HIDDEN))

"""A node checks the replicas a training open names against the swarm's records (server/training_sync.py
check_nodes): a peer that announces no span of the blocks is refused as the client's mistake (bad_request), while a
records read that fails is the node's own trouble, refused as retryable (the client opens elsewhere)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nesa_node.errors import AdapterError, BadRequestError, PeerUnavailableError
from nesa_node.protocol.messages import TrainSync
from nesa_node.server.training_sync import ReplicaSync


def service(records):
    return SimpleNamespace(records=records, network=SimpleNamespace(peer_timeout_s=3.0))


async def announcing():
    return [SimpleNamespace(peer_id="serving", start_block=0, end_block=4)]


async def failing():
    raise OSError("the DHT did not answer")


async def silent():
    await asyncio.sleep(60)


def test_replicas_that_announce_the_blocks_pass():
    asyncio.run(ReplicaSync(service(announcing)).check_nodes({"serving"}, (0, 2)))


def test_a_replica_announcing_no_such_span_is_the_clients_mistake():
    with pytest.raises(BadRequestError, match="do not announce blocks 2:6"):
        asyncio.run(ReplicaSync(service(announcing)).check_nodes({"serving"}, (2, 6)))


@pytest.mark.parametrize("records", [failing, silent], ids=["failing", "silent"])
def test_records_the_node_cannot_read_are_its_own_trouble(records):
    with pytest.raises(PeerUnavailableError, match="could not read the swarm's records"):
        asyncio.run(ReplicaSync(service(records)).check_nodes({"serving"}, (0, 2)))


def test_gradients_for_an_update_already_read_are_refused_not_kept():
    """A replica's gradients for the update whose step is still running (read from the inbox already) would never
    be read again: refused, so nothing piles up outside the room the session reserved."""
    owner, replica = "client", ("replica-node", "replica-session")
    session = SimpleNamespace(replicas=(replica,), step=4, synced_round=5, inbox={})
    sync = ReplicaSync(SimpleNamespace(sessions={(owner, "s"): session}))

    def message(round_: int) -> TrainSync:
        return TrainSync(owner=owner, session_id="s", from_session_id=replica[1], round=round_)

    with pytest.raises(BadRequestError, match="gradients for update 5"):
        sync._receiver(message(5), replica[0])
    assert sync._receiver(message(6), replica[0]) is session  # the next update's are kept
    session.synced_round = 0  # nothing read yet: this update's own are taken
    assert sync._receiver(message(5), replica[0]) is session


def test_a_synced_step_that_fails_marks_its_session_to_end_typed():
    """The optimizer step after the replicas' gradients are summed fails (out of memory, say): the slice may be half
    updated, so the session is marked to end once the refusal is answered, and the refusal is typed."""
    parameter = torch.nn.Parameter(torch.zeros(3))
    parameter.grad = torch.ones(3)
    calls = []

    async def compute(work):
        calls.append(work)
        if len(calls) == 2:  # the optimizer step
            raise RuntimeError("CUDA error: an illegal memory access")
        return work(), 0.0

    session = SimpleNamespace(
        slice=SimpleNamespace(parameters=lambda: [parameter]),
        replicas=(),
        step=0,
        synced_round=0,
        session_id="s",
        client_peer="client",
        inbox={},
        arrived=asyncio.Event(),
        failed=False,
    )
    service = SimpleNamespace(peer_id="node", network=SimpleNamespace(peer_timeout_s=3.0), _compute=compute)
    with pytest.raises(AdapterError, match="optimizer step failed"):
        asyncio.run(ReplicaSync(service).sync_and_step(session))
    assert session.failed and len(calls) == 2

"""A majority session's step runs span after span (client/majority.py): one that fails after some spans took it
leaves the session unusable, saying why, since a step sent again would be taken twice by those spans; one that fails
before any span took it leaves the session as it was. And who an outvoted replica gets banned."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nesa_node.client.majority import MajoritySession, VotedSpan
from nesa_node.errors import PeerUnavailableError, SessionStateError


class FakeSession:
    """A chain of one span: takes steps (its position moves) until told to fail."""

    def __init__(self) -> None:
        self.position = 0
        self.failing = False

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.failing:
            raise PeerUnavailableError("the chain's node is gone")
        self.position += hidden.shape[1]
        return hidden + 1


def majority(first: FakeSession, second: FakeSession) -> MajoritySession:
    spans = [VotedSpan(0, 2, [first], voted=False), VotedSpan(2, 4, [second], voted=False)]
    return MajoritySession(spans, None, replicas=3, tolerance=0.0, max_length=32, batch=1)


def test_a_step_failing_after_a_span_took_it_leaves_the_session_unusable():
    first, second = FakeSession(), FakeSession()
    session = majority(first, second)
    assert torch.equal(asyncio.run(session.step(torch.zeros(1, 3, 4))), torch.full((1, 3, 4), 2.0))
    second.failing = True
    with pytest.raises(PeerUnavailableError):
        asyncio.run(session.step(torch.zeros(1, 1, 4)))
    assert (first.position, second.position, session.position) == (4, 3, 3)
    second.failing = False
    with pytest.raises(SessionStateError, match="after some of its spans took a step"):
        asyncio.run(session.step(torch.zeros(1, 1, 4)))
    assert first.position == 4  # not taken twice


def test_a_step_failing_before_any_span_took_it_leaves_the_session_as_it_was():
    first, second = FakeSession(), FakeSession()
    session = majority(first, second)
    first.failing = True
    with pytest.raises(PeerUnavailableError):
        asyncio.run(session.step(torch.zeros(1, 2, 4)))
    first.failing = False
    asyncio.run(session.step(torch.zeros(1, 2, 4)))
    assert (first.position, second.position, session.position) == (2, 2, 2)


@pytest.mark.parametrize("shape", [(1, 0, 4), (2, 1, 4)], ids=["no-token", "other-batch"])
def test_a_malformed_step_is_the_callers_error_and_no_replica_is_dropped(shape):
    first, second = FakeSession(), FakeSession()
    session = majority(first, second)
    with pytest.raises(SessionStateError):
        asyncio.run(session.step(torch.zeros(shape)))
    assert all(span.replicas[0] is not None for span in session.spans) and first.position == 0
    asyncio.run(session.step(torch.zeros(1, 1, 4)))
    assert session.position == 1


class Voter:
    """A replica of a voted span over `peers`, answering `hidden + offset`."""

    def __init__(self, peers: tuple[str, ...], offset: float):
        self.chain = SimpleNamespace(peer_ids=peers)
        self.position, self.offset, self.closed = 0, offset, False

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        self.position += hidden.shape[1]
        return hidden + self.offset

    async def close(self) -> None:
        self.closed = True


class Bans:
    def __init__(self) -> None:
        self.bans: dict[str, bool] = {}

    def ban(self, peer_id: str, *, base_s: float = 15.0, fault: bool = False) -> float:
        self.bans[peer_id] = fault
        return base_s


@pytest.mark.parametrize("loser", [("cheat",), ("honest", "throwaway")], ids=["one-node", "sub-chain"])
def test_an_outvoted_replica_of_one_node_is_banned_for_a_fault_one_of_several_for_a_failure(loser):
    """Which node of an outvoted sub-chain computed the wrong output is not known: a throwaway identity joining an
    honest node's sub-chain and losing on purpose must not get that node banned for a fault."""
    bans = Bans()
    replicas = [Voter(("a",), 1.0), Voter(("b",), 1.0), Voter(loser, 5.0)]
    session = MajoritySession([VotedSpan(0, 4, list(replicas), voted=True)], bans, replicas=3, tolerance=1e-3,
                              max_length=32, batch=1)  # fmt: skip
    output = asyncio.run(session.step(torch.zeros(1, 1, 4)))
    assert torch.equal(output, torch.ones(1, 1, 4)) and replicas[2].closed
    assert bans.bans == dict.fromkeys(loser, len(loser) == 1)
    assert session.verification["outvoted"] == sorted(loser)

"""A majority session's step runs span after span (client/majority.py): one that fails after some spans took it
leaves the session unusable, saying why, since a step sent again would be taken twice by those spans; one that fails
before any span took it leaves the session as it was."""

from __future__ import annotations

import asyncio

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

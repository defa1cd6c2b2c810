"""How many recoveries a step makes (client/session.py `_step_with_failover`): `max_failovers` counted, a recovery cut
short by another node found lost not counted (that node's is), and never more than twice `max_failovers` in all."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from nesa_node.client.chain_links import LinkFailed
from nesa_node.client.config import ClientConfig
from nesa_node.client.session import InferenceSession
from nesa_node.errors import PeerUnavailableError
from nesa_node.routing.chain import Chain

A, B, C = (SimpleNamespace(peer_id=name) for name in ("A", "B", "C"))


def session_with(max_failovers: int, steps: list, recoveries: list) -> tuple[InferenceSession, list]:
    """A session whose steps fail as `steps` says (a link: LinkFailed naming it; None: the step goes through) and
    whose recoveries do as `recoveries` says (a link: cut short by a LinkFailed naming it; None: done); the
    failures each recovery was asked for are returned."""
    session = InferenceSession(
        SimpleNamespace(announced=lambda peer_id: None, request_timeout_s=30.0),
        Chain(hops=()),
        ClientConfig(max_failovers=max_failovers),
        batch=1,
        max_length=32,
        session_id="session",
        reroute=lambda request: None,
    )
    asked = []

    async def step(hidden, deadline_s):
        link = steps.pop(0)
        if link is not None:
            raise LinkFailed(f"{link.peer_id} failed", link)
        return hidden, 0.0, 0, 0, [hidden]

    async def recover(failure, **options):
        asked.append(failure.link.peer_id if failure.link is not None else None)
        link = recoveries.pop(0)
        if link is not None:
            raise LinkFailed(f"{link.peer_id} is lost too", link)
        return True

    session._step = step
    session.failover = SimpleNamespace(recover=recover)
    session._measure_nodes = lambda wall_s: None
    return session, asked


def test_an_adjacent_double_failure_costs_two_of_the_budget_not_three():
    # B fails; its recovery finds A (whose outputs it needs) lost; A is replaced; B fails again and is replaced
    session, asked = session_with(2, [B, B, None], [A, None, None])
    asyncio.run(session._step_with_failover(torch.zeros(1, 1, 8)))
    assert asked == ["B", "A", "B"] and session.timings[-1].failovers == 3


def test_failures_of_one_node_are_all_counted():
    session, asked = session_with(2, [B, B, B], [None, None, None])
    with pytest.raises(PeerUnavailableError, match="no failover left"):
        asyncio.run(session._step_with_failover(torch.zeros(1, 1, 8)))
    assert asked == ["B", "B"]


def test_recoveries_cut_short_again_and_again_stop_at_twice_the_budget():
    # every recovery names the other node lost: none is counted, yet the step gives up after 2 x 2 recoveries
    session, asked = session_with(2, [B], [A, B, A, B, A, B])
    with pytest.raises(PeerUnavailableError, match="no failover left"):
        asyncio.run(session._step_with_failover(torch.zeros(1, 1, 8)))
    assert asked == ["B", "A", "B", "A"]


def test_no_failover_budget_means_the_first_failure_is_the_callers():
    session, asked = session_with(0, [B], [])
    with pytest.raises(PeerUnavailableError, match="no failover left"):
        asyncio.run(session._step_with_failover(torch.zeros(1, 1, 8)))
    assert asked == []

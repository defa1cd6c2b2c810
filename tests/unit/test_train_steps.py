"""The client's count of optimizer steps during fine-tuning follows only what the chain must report: a node that
answers a backward pass with another update than the one its step takes the chain to is failed and blamed
(client/train_link.py backward_pass), so it cannot move the count that checkpoints are taken by. Also the client's
other judgments of a training chain's nodes: which values could honestly overflow a node (`overflows`), and when a
node that keeps saying it has no room is left out of the chains (AsyncFineTuningSession.open)."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from nesa_node.client.finetune import FULL_REPEATS, AsyncFineTuningSession
from nesa_node.client.train_link import OVERFLOW_HEADROOM, LinkLost, backward_pass, overflows
from nesa_node.errors import NoRouteError
from nesa_node.protocol.channel import read
from nesa_node.protocol.messages import NO_CODEC, TO_TRAINING, TrainBackward, TrainGrad
from nesa_node.routing.snapshot import Hop


class ReportingLink:
    """A training link whose node answers every backward pass, reporting `update` as its step count."""

    def __init__(self, peer_id: str, update: int):
        self.peer_id, self.update = peer_id, update
        self.asked: list[TrainBackward] = []

    def takes(self, tokens: int) -> bool:
        return True

    async def call(self, request, expected, *, timeout_s: float, max_answer_bytes: int, well_formed: bool):
        message = read(request, TO_TRAINING)
        self.asked.append(message)
        return TrainGrad(step_id=message.step_id, step=self.update), None

    def read_tensor(self, answer, codec, like: torch.Tensor) -> torch.Tensor:
        return like


def run_backward(links: list[ReportingLink], *, apply: bool = True, step_after: int | None = 5):
    return asyncio.run(
        backward_pass(
            links,
            torch.ones(1, 2, 4),
            "pass.0",
            lambda link, elements: NO_CODEC,
            lambda link: apply,
            timeout_of=lambda applies: 1.0,
            step_after=step_after,
        )
    )


def test_the_steps_of_a_chain_that_takes_the_update_are_returned():
    steps, grad = run_backward([ReportingLink("first", 5), ReportingLink("last", 5)])
    assert steps == [5, 5] and torch.equal(grad, torch.ones(1, 2, 4))


@pytest.mark.parametrize("reported", [0, 4, 6, 1 << 30], ids=["zero", "behind", "ahead", "far-ahead"])
def test_a_node_reporting_another_update_is_failed_and_blamed(reported):
    first, last = ReportingLink("first", 5), ReportingLink("last", reported)
    with pytest.raises(LinkLost) as lost:
        run_backward([first, last])
    assert lost.value.peer_id == "last" and lost.value.blame
    assert f"reported update {reported} for update 5" in lost.value.message
    assert not first.asked  # the pass stopped at the node that misreported (the backward runs from the last)


def test_without_an_update_the_reported_count_is_not_judged():
    # micro-batches gathered before a step (apply False): the count a node reports is not an update of this pass
    steps, _ = run_backward([ReportingLink("first", 3), ReportingLink("last", 7)], apply=False)
    assert steps == []


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_only_values_near_a_dtypes_largest_finite_one_can_overflow_an_honest_node(dtype):
    """`overflows` (who is blamed for a not_finite answer): values within OVERFLOW_HEADROOM of the dtype's largest
    finite one could overflow an honest node's blocks; smaller ones, of either sign, could not."""
    limit = torch.finfo(getattr(torch, dtype)).max / OVERFLOW_HEADROOM
    generator = torch.Generator().manual_seed(5)
    ordinary = torch.randn(2, 3, 8, generator=generator) * 1000.0
    assert not overflows(ordinary.clamp(-limit * 0.99, limit * 0.99), dtype)
    for sign in (1.0, -1.0):
        large = ordinary.clone()
        large[1, 2, 5] = sign * limit
        assert overflows(large, dtype)
    assert not overflows(torch.empty(0, 3, 8), dtype)


def test_a_node_announcing_no_known_dtype_is_judged_as_float32():
    """A record naming a dtype no node computes in gives the widest range: its claims of overflow need the largest
    values to be believed."""
    below_float32 = torch.full((4,), torch.finfo(torch.float32).max / OVERFLOW_HEADROOM / 2)
    assert not overflows(below_float32, "float64") and not overflows(below_float32, "bogus")
    assert overflows(torch.full((4,), 1e38), "bogus")


class Routes:
    """A stand-in for the client's model when a training chain is chosen: `choose_chain` gives the first of `nodes`
    not excluded (NoRouteError when none is left), recording each exclude set; opening a link on `full_peer` fails
    as a node with no room does (LinkLost, full, unblamed)."""

    def __init__(self, nodes: list[str], full_peer: str):
        self.nodes, self.full_peer = nodes, full_peer
        self.excluded: list[frozenset[str]] = []
        self.config = SimpleNamespace(max_open_attempts=8)
        self.swarm = SimpleNamespace(ban=lambda peer: pytest.fail(f"{peer} banned for having no room"))

    async def choose_chain(self, *, exclude: frozenset[str]):
        self.excluded.append(exclude)
        for peer in self.nodes:
            if peer not in exclude:
                return SimpleNamespace(hops=(Hop(peer, 0, 4),))
        raise NoRouteError("no chain without the nodes left out")


def opened_on(routes: Routes, full: Counter) -> tuple[str, list[frozenset[str]]]:
    """The peer `AsyncFineTuningSession.open` opens its chain on, given how many failovers each node caused by having no
    room (`full`), and the exclude sets it asked routing with."""
    session = object.__new__(AsyncFineTuningSession)
    session.model, session.data_parallel, session._full, session.chains = routes, 1, full, []

    async def open_link(hop: Hop, session_id: str, replicas=()):
        if hop.peer_id == routes.full_peer:
            raise LinkLost(hop.peer_id, "reported [adapter_budget] no room", blame=False, full=True)
        return SimpleNamespace(peer_id=hop.peer_id)

    session._open_link = open_link
    asyncio.run(session.open())
    return session.chains[0][0].peer_id, routes.excluded


def test_a_node_that_said_it_had_no_room_twice_is_left_out_of_later_opens_while_others_serve_its_blocks():
    """Routing prefers the node that keeps saying it has no room: after one such failover it is still tried first
    (no room may be momentary), after FULL_REPEATS it is left out from the start; where no other node serves its
    blocks, it is tried again rather than the open failing."""
    peer, excluded = opened_on(Routes(["full", "spare"], "full"), Counter({"full": FULL_REPEATS - 1}))
    assert peer == "spare" and excluded == [frozenset(), frozenset({"full"})]  # tried, then left out of this open
    routes = Routes(["full", "spare"], "full")
    peer, excluded = opened_on(routes, Counter({"full": FULL_REPEATS}))
    assert peer == "spare" and excluded == [frozenset({"full"})]  # not tried at all
    routes = Routes(["full"], "full")
    routes.full_peer = None  # it has room again
    peer, excluded = opened_on(routes, Counter({"full": FULL_REPEATS}))
    assert peer == "full" and excluded == [frozenset({"full"}), frozenset()]

"""Live rebalancing (topology item 6, server/rebalance.py): a coverage hole is covered by one node that moves, and a
generation in flight on a node that drains to move completes with the reference tokens."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.protocol.records import NodeState
from nesa_node.server.config import NodeConfig
from nesa_node.server.node import Node
from tests.support.swarm import LocalSwarm, wait_for_chain, wait_until

SPANS = [(0, 2), (0, 2), (0, 2), (2, 4), (2, 4)]  # five nodes on the 4-block tiny llama
PROMPT = torch.randint(3, 1000, (1, 16), generator=torch.Generator().manual_seed(11))
NEW_TOKENS, MOVE_AFTER = 32, 8
MAX_LENGTH = 16 + NEW_TOKENS
PERIOD_S = 1.0  # the nodes' rebalance period (their announce period too)
COVER_LIMIT_S = 30.0  # acceptance: the hole is covered within a bounded time (a generous bound; ~3 periods expected)
SETTINGS = {
    "trigger": "homology",  # the daemon's default, spelled out: the swarm fixtures turn it off elsewhere
    "dht_prefix": "rebalance",
    "announce_period_s": PERIOD_S,
    "period_s": PERIOD_S,
    "drain_timeout_s": 30.0,
}


@pytest.fixture(scope="module")
def swarm(tiny_llama):
    """The five nodes start together: started one by one, the first ones would see the last blocks uncovered and
    rightly move to cover them."""
    local = LocalSwarm()
    try:
        configs = [
            NodeConfig(tiny_llama, *span).with_settings(
                initial_peers=tuple(local.initial_peers), measure_throughput=False, **SETTINGS
            )
            for span in SPANS
        ]

        async def gather(coroutines):
            return await asyncio.gather(*coroutines, return_exceptions=True)

        created = local.run(gather(Node.create(config) for config in configs))
        local.nodes.extend(node for node in created if isinstance(node, Node))  # close() stops them
        for node in created:
            if not isinstance(node, Node):
                raise node
        for started in local.run(gather(node.start() for node in local.nodes)):
            if isinstance(started, BaseException):
                raise started
        yield local
    finally:
        local.close()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


def connect(swarm: LocalSwarm, path: str) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix="rebalance", compression="none"
    )


def spans(swarm: LocalSwarm) -> dict[str, tuple[int, int]]:
    return {node.peer_id: (node.start_block, node.end_block) for node in swarm.nodes}


def generate(model, streamer=None) -> torch.Tensor:
    return model.generate(
        PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, streamer=streamer
    )


def test_a_coverage_hole_is_covered_by_one_node_and_generation_resumes(swarm, tiny_llama, reference):
    last = [node for node in swarm.nodes if (node.start_block, node.end_block) == (2, 4)]
    before = spans(swarm)
    for node in last:  # blocks 2-3 are left without a server
        swarm.stop_node(node)
    stopped = time.monotonic()
    wait_until(lambda: any(node.state == NodeState.online and node.moves for node in swarm.nodes), COVER_LIMIT_S)
    covered_s = time.monotonic() - stopped
    moved = [node for node in swarm.nodes if spans(swarm)[node.peer_id] != before[node.peer_id]]
    assert len(moved) == 1, spans(swarm)  # the plan is deterministic: exactly one node moved
    mover = moved[0]
    assert (mover.start_block, mover.end_block) == (2, 4)
    assert [(move["from"], move["to"], move["reason"]) for move in mover.moves] == [((0, 2), (2, 4), "hole")]
    assert mover.peer_id == min(peer for peer, span in before.items() if span == (0, 2))  # most redundant, then id
    assert mover.budget.tokens_left == mover.config.limits.max_cache_tokens and not mover.sessions.draining
    with connect(swarm, tiny_llama) as model:
        chain = wait_for_chain(model, max_length=MAX_LENGTH, timeout_s=COVER_LIMIT_S)
        assert mover.peer_id in {hop.peer_id for hop in chain.hops}  # the only server of blocks 2-3
        resumed_s = time.monotonic() - stopped
        assert torch.equal(generate(model), reference)
    print(f"\nhole covered by {mover.peer_id[-6:]} {covered_s:.2f} s after the stop; a client routed {resumed_s:.2f} s")


class MoveDuringGeneration:
    """A `generate` streamer that asks `node` to move to `start` once `count` new tokens were produced (without
    waiting: the move waits for this very session), and records the node's state at every later token."""

    def __init__(self, swarm: LocalSwarm, node, start: int, count: int, drain_timeout_s: float) -> None:
        self.swarm, self.node, self.start, self.count, self.seen = swarm, node, start, count, -1
        self.drain_timeout_s = drain_timeout_s
        self.future = None
        self.states: list[tuple[NodeState, bool]] = []

    def put(self, value) -> None:
        self.seen += 1
        if self.seen == self.count:
            move = self.node.move_to(self.start, drain_timeout_s=self.drain_timeout_s)
            self.future = asyncio.run_coroutine_threadsafe(move, self.swarm.loop)
            # the next token waits until the node drains (and, given no time to drain, has ended the session): the
            # move announces itself on the DHT first, which on a busy machine can outlast the rest of the generation
            wait_until(lambda: self.node.sessions.draining, timeout_s=30)
            if self.drain_timeout_s == 0:
                wait_until(lambda: not self.node.sessions.sessions, timeout_s=30)
        elif self.seen > self.count:
            self.states.append((self.node.state, self.node.sessions.draining))

    def end(self) -> None:
        pass


@pytest.mark.parametrize("drain_timeout_s", [30.0, 0.0], ids=["session-finishes", "session-fails-over"])
def test_a_generation_in_flight_on_a_draining_node_completes(swarm, tiny_llama, reference, drain_timeout_s):
    """The node on the chain whose span has a spare moves to the other half mid-generation: with time to drain, the
    session finishes on it (no failover); with none, it ends the session and the client fails over. Tokens equal
    the reference either way, and the node then serves its new span."""
    with connect(swarm, tiny_llama) as model:
        wait_for_chain(model, max_length=MAX_LENGTH)
        with model.inference_session(max_length=MAX_LENGTH) as session:
            held = spans(swarm)
            hop = next(hop for hop in session.chain.hops if list(held.values()).count(held[hop.peer_id]) >= 2)
            node = next(node for node in swarm.nodes if node.peer_id == hop.peer_id)
            old = (node.start_block, node.end_block)
            streamer = MoveDuringGeneration(swarm, node, 2 - old[0], MOVE_AFTER, drain_timeout_s)
            output = generate(model, streamer)
        streamer.future.result(timeout=60)
    assert torch.equal(output, reference)
    assert (node.start_block, node.end_block, node.state) == (2 - old[0], 4 - old[0], NodeState.online)
    move = node.moves[-1]
    assert (move["from"], move["to"], move["reason"]) == (old, (node.start_block, node.end_block), "operator")
    if drain_timeout_s > 0:
        assert session.failovers == [] and move["ended_sessions"] == 0
        assert set(streamer.states) == {(NodeState.draining, True)}  # it drained while the generation went on
    else:
        assert [failover["failed"] for failover in session.failovers] == [node.peer_id]
        assert move["ended_sessions"] == 1
    assert not node.sessions.sessions and node.budget.tokens_left == node.config.limits.max_cache_tokens

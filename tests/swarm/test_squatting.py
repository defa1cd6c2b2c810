"""Nobody can squat another client's session on a spare (RELIABILITY.md G5). Any member of a chain learns the session's
id from the steps it sees; an attacker with its own libp2p identity opens sessions under that id first on the spare
nodes that could replace a failing one (and on the chain's own nodes). Sessions are scoped to the peer that opened
them, so the honest client still fails over to a spare, its tokens unchanged, and the squatter's sessions sit beside
its own, untouched. A replacement that refuses the client's open for any other typed reason is banned and the next
one used.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.protocol import lane, rpc
from nesa_node.protocol.channel import LaneChannel, frame
from nesa_node.protocol.messages import LaneSettings, OpenSession
from nesa_node.routing.chain import Chain, Hop
from tests.support.swarm import wait_for_chain, wait_until

PROMPT = torch.tensor([[7, 21, 33, 40, 51, 62]])
NEW_TOKENS = 12
SQUAT_AFTER, KILL_AFTER = 2, 6  # new tokens before the squatter opens, and before the chain's node stops
MAX_LENGTH = 32


class Squatter:
    """A peer with its own identity that opens sessions under ids it learnt and holds them open, idle, recording
    every answer each node sends on them."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self.answers: dict[str, list[dict]] = {}  # node peer id -> the answers on the squatter's session there
        self._tasks: list[asyncio.Task] = []
        self._release = asyncio.Event()

    @classmethod
    async def create(cls, initial_peers: list[str]) -> Squatter:
        return cls(await P2P.create(initial_peers=initial_peers))

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def open(self, node: str, message: OpenSession) -> dict:
        """Open `message` on `node` and keep the stream; the node's first answer."""
        first = asyncio.get_running_loop().create_future()
        self._tasks.append(asyncio.create_task(self._hold(node, message, first)))
        return await first

    async def _hold(self, node: str, message: OpenSession, first: asyncio.Future) -> None:
        answers = self.answers.setdefault(node, [])

        async def requests():
            yield frame(message)
            await self._release.wait()

        try:
            stream = await self.p2p.iterate_protobuf_handler(
                PeerID.from_base58(node), rpc.INFERENCE, requests(), runtime_pb2.ExpertResponse
            )
            async for response in stream:
                answers.append(msgpack.unpackb(response.metadata))
                if not first.done():
                    first.set_result(answers[0])
        except Exception as exc:  # the node ended the stream (it stopped)
            answers.append({"kind": "stream_ended", "error": repr(exc)})
        if not first.done():
            first.set_result({"kind": "no_answer"})

    async def close(self) -> None:
        self._release.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.p2p.shutdown()


def squat_message(session_id: str, start: int, end: int, upstream: str, next_peer: str | None) -> OpenSession:
    """The squatter's open: the honest session's id and shape, an upstream it claims (the honest previous node, or
    the client), and lane keys of its own."""
    keys = LaneSettings(key_in=lane.new_key().hex(), key_out=lane.new_key().hex())
    return OpenSession(
        session_id=session_id,
        start_block=start,
        end_block=end,
        batch=1,
        max_length=MAX_LENGTH,
        upstream=upstream,
        next=next_peer,
        lane=keys,
    )


@pytest.fixture(scope="module")
def reference(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)


@pytest.fixture
def squatter(module_swarm):
    squatter = module_swarm.run(Squatter.create(module_swarm.initial_peers))
    try:
        yield squatter
    finally:
        module_swarm.run(squatter.close(), timeout=60)


def connect(swarm, path: str, prefix: str, *, lanes: bool = True) -> DistributedModelForCausalLM:
    return DistributedModelForCausalLM.from_pretrained(
        path, initial_peers=swarm.initial_peers, dht_prefix=prefix, compression="none", lanes=lanes
    )


def sees_every_node(model, count: int) -> None:
    """Wait until the client's routing view holds `count` nodes (the spares included: failover routes to them)."""
    wait_until(lambda: len(model.snapshot(fresh=True).nodes) == count, timeout_s=30)


class AtTokens:
    """A `generate` streamer that runs `actions[count]` once `count` new tokens were produced: steps of an attack
    and a fault at chosen points of one generation."""

    def __init__(self, actions: dict) -> None:
        self.actions, self.seen = actions, -1  # the first call carries the prompt

    def put(self, value) -> None:
        self.seen += 1
        if self.seen in self.actions:
            self.actions[self.seen]()

    def end(self) -> None:
        pass


def generate(model, actions: dict) -> torch.Tensor:
    return model.generate(
        PROMPT, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, streamer=AtTokens(actions)
    )


@pytest.mark.parametrize("lanes", [True, False], ids=["lanes", "libp2p"])
def test_g5_squatted_spares_still_take_the_failover(module_swarm, tiny_llama, reference, squatter, lanes):
    """Mid-generation the squatter opens the honest session's id on both spares of the last span, then on the
    chain's two nodes (claiming the honest upstream each time, with lane keys of its own); then the chain's last
    node stops. Pushes name the session's owner and lanes prove its key, so the chain is not disturbed, the client
    fails over to a spare, the tokens equal single-process generation, and the squatter's sessions stay apart."""
    prefix = f"squat-{'lanes' if lanes else 'libp2p'}"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    lasts = [module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix) for _ in range(3)]
    with connect(module_swarm, tiny_llama, prefix, lanes=lanes) as model:
        wait_for_chain(model, hops=2, max_length=MAX_LENGTH)
        sees_every_node(model, 4)
        with model.inference_session(max_length=MAX_LENGTH) as session:
            owner, session_id = session.swarm.peer_id, session.session_id
            lost = next(node for node in lasts if node.peer_id == session.chain.hops[1].peer_id)
            spares = [node for node in lasts if node is not lost]

            def squat() -> None:  # spares first: those a failover would use
                opens = [(spare, 2, 4, first.peer_id, None) for spare in spares]
                opens += [(first, 0, 2, owner, lost.peer_id), (lost, 2, 4, first.peer_id, None)]
                for node, start, end, upstream, next_peer in opens:
                    message = squat_message(session_id, start, end, upstream, next_peer)
                    answer = module_swarm.run(squatter.open(node.peer_id, message))
                    assert answer["kind"] == "opened", answer

            output = generate(model, {SQUAT_AFTER: squat, KILL_AFTER: lambda: module_swarm.stop_node(lost)})
            assert torch.equal(output, reference)
            assert [failover["failed"] for failover in session.failovers] == [lost.peer_id]
            (replacement,) = [node for node in spares if node.peer_id == session.chain.hops[1].peer_id]
            # the replacement and the first node hold both sessions of the id: the honest one went on, the
            # squatter's never took a step
            for node in (replacement, first):
                honest = node.sessions.get(owner, session_id)
                squatted = node.sessions.get(squatter.peer_id, session_id)
                assert honest is not None and squatted is not None and honest is not squatted
                assert honest.position > 0 and squatted.position == 0
            if lanes:  # each lane of the id reached the honest session: the client's, and the first node's push
                assert first.sessions.get(owner, session_id).inbound
                assert isinstance(first.sessions.get(owner, session_id).downstream, LaneChannel)
                assert replacement.sessions.get(owner, session_id).inbound
                assert replacement.sessions.get(owner, session_id).output is not None
            for node in (*spares, first):  # nothing but its own open's answer reached the squatter
                assert [answer["kind"] for answer in squatter.answers[node.peer_id]] == ["opened"]
    for node in (first, *spares):
        module_swarm.stop_node(node)


def test_g5_a_replacement_refusing_the_open_is_banned_and_the_next_one_used(module_swarm, tiny_llama, reference):
    """The replacement routing ranks first refuses the client's open with a typed error (the client already holds
    its quota of sessions there): it is banned like a dead one and the next spare takes the span."""
    prefix = "squat-refused"
    first = module_swarm.start_node(tiny_llama, 0, 2, dht_prefix=prefix)
    lost = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    full = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix, max_sessions_per_peer=1)
    spare = module_swarm.start_node(tiny_llama, 2, 4, dht_prefix=prefix)
    with connect(module_swarm, tiny_llama, prefix) as model:
        wait_for_chain(model, hops=2, max_length=MAX_LENGTH)
        sees_every_node(model, 4)
        correct = model.router.chain_selector

        def full_first(snapshot, request):  # the session's chain, then the full node as the first replacement
            if request.start_block == 0:
                return Chain((Hop(first.peer_id, 0, 2), Hop(lost.peer_id, 2, 4)))
            if full.peer_id not in request.exclude:
                return Chain((Hop(full.peer_id, 2, 4),))
            return correct(snapshot, request)

        model.router.chain_selector = full_first
        held = model.session_on(Chain((Hop(first.peer_id, 0, 2), Hop(full.peer_id, 2, 4))), max_length=MAX_LENGTH)
        try:
            with model.inference_session(max_length=MAX_LENGTH) as session:
                output = generate(model, {KILL_AFTER: lambda: module_swarm.stop_node(lost)})
            assert torch.equal(output, reference)
            (failover,) = session.failovers
            assert failover["failed"] == lost.peer_id and failover["replacements"] == [spare.peer_id]
            assert full.peer_id in failover["banned"]
            assert len(full.sessions) == 1  # the held session only
        finally:
            with contextlib.suppress(Exception):
                held.close()
    for node in (first, full, spare):
        module_swarm.stop_node(node)

"""Throwaway identities cannot starve a node (RELIABILITY.md G3). Attackers are real libp2p peers, each with its own
identity, that open sessions on a real node and never step; an honest client at the same time must open within 10 s
and generate the reference tokens, and every refusal anyone gets is typed and prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from transformers import AutoModelForCausalLM

from nesa_node import DistributedModelForCausalLM
from nesa_node.errors import QuotaExceededError
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame, frame, read
from nesa_node.protocol.framing import call_on_stream
from nesa_node.protocol.messages import FORWARD_ANSWERS, ForwardRequest, ForwardResult, Step, expect
from nesa_node.protocol.tensors import tensor_from_proto, tensor_to_proto
from nesa_node.server.sessions import RESERVE_CHUNK_TOKENS
from nesa_node.sharding.blocks import SpanSpec, load_block_span
from nesa_node.sharding.kv_cache import kv_bytes_per_token_for
from tests.support.swarm import wait_for_chain, wait_until

pytestmark = pytest.mark.serial  # measures time: run alone, after the parallel pass (Makefile)

PREFIX = "starve"
LIMITS = {
    "max_sessions": 16,
    "max_sessions_per_peer": 4,
    "max_cache_tokens": 512,
    "max_cache_share_per_peer": 0.5,  # 256 tokens of batch 1 per peer
    "max_length": 256,
}
PROMPT = torch.tensor([[3, 14, 15, 92]])
NEW_TOKENS = 8


class Attackers:
    """`identities` peers, each holding the sessions it opened on `node` idle until `release`."""

    def __init__(self, identities: list[P2P], node: PeerID):
        self.identities = identities
        self.node = node
        self.answers: list[list[dict]] = []  # per session: every message the node sent on it
        self._streams: list = []
        self._readers: list[asyncio.Task] = []
        self._release = asyncio.Event()

    @classmethod
    async def create(cls, count: int, initial_peers: list[str], node: PeerID) -> Attackers:
        identities = await asyncio.gather(*(P2P.create(initial_peers=initial_peers) for _ in range(count)))
        return cls(list(identities), node)

    async def open(self, per_identity: int, max_length: int) -> list[dict]:
        """Open `per_identity` sessions from every identity at once; each one's first answer (opened, or a typed
        refusal), once every one has answered."""
        firsts = [asyncio.get_running_loop().create_future() for _ in range(per_identity * len(self.identities))]
        openers = [
            self._hold(p2p, max_length, firsts[index * per_identity + slot])
            for index, p2p in enumerate(self.identities)
            for slot in range(per_identity)
        ]
        self._readers += [asyncio.create_task(opener) for opener in openers]
        return list(await asyncio.gather(*firsts))

    async def _hold(self, p2p: P2P, max_length: int, first: asyncio.Future) -> None:
        answers: list[dict] = []
        self.answers.append(answers)
        opening = {"kind": "open", "session_id": uuid.uuid4().hex, "start_block": 0, "end_block": 4, "batch": 1}
        opening["max_length"] = max_length

        async def requests():
            yield runtime_pb2.ExpertRequest(metadata=msgpack.packb(opening))
            await self._release.wait()  # idle: never a step

        try:
            stream = await p2p.iterate_protobuf_handler(
                self.node, rpc.INFERENCE, requests(), runtime_pb2.ExpertResponse
            )
            self._streams.append(stream)
            async for response in stream:
                answers.append(msgpack.unpackb(response.metadata))
                if not first.done():
                    first.set_result(answers[0])
        except Exception as exc:  # the node ended the stream: refused before reading it (typed), or failed
            typed = re.search(r"\[([a-z_]{1,32})\] (.*)'\)$", repr(exc))
            answer = {"kind": "error", "code": typed[1], "message": typed[2]} if typed else None
            if not first.done():
                first.set_result(answer or {"kind": "stream_failed", "error": repr(exc)})
            if answer is not None:
                answers.append(answer)
        if not first.done():
            first.set_result({"kind": "no_answer"})

    def codes(self) -> list[str]:
        """The error code of every error any attacker session received."""
        return [answer["code"] for answers in self.answers for answer in answers if answer.get("kind") == "error"]

    async def close(self) -> None:
        self._release.set()
        for reader in self._readers:
            reader.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()
        await asyncio.gather(*(p2p.shutdown() for p2p in self.identities), return_exceptions=True)


@pytest.fixture(scope="module")
def starved(module_swarm, tiny_llama):
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix=PREFIX, **LIMITS)
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
    with torch.inference_mode():
        tokens = reference.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    with DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix=PREFIX, compression="none"
    ) as honest:
        wait_for_chain(honest)
        yield module_swarm, node, honest, tokens


def attack(starved, identities: int, per_identity: int, max_length: int):
    swarm, node, honest, reference = starved
    attackers = swarm.run(Attackers.create(identities, swarm.peers_with(node), PeerID.from_base58(node.peer_id)))
    try:
        firsts = swarm.run(attackers.open(per_identity, max_length), timeout=60)
        kinds = {answer["kind"] for answer in firsts}
        assert kinds <= {"opened", "error"}, firsts  # every open answered, typed
        assert all(answer["code"] in {"too_many_sessions", "cache_budget"} for answer in firsts if "code" in answer)
        started = time.monotonic()
        output = honest.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        took_s = time.monotonic() - started
        assert torch.equal(output, reference)
        assert took_s < 10.0, f"the honest client needed {took_s:.1f} s"
        print(f"honest generation among {identities} attacker identities: {took_s:.1f} s")
        assert "preempted" in attackers.codes()  # room was made by ending idle sessions, and their owners were told
        return firsts, took_s
    finally:
        swarm.run(attackers.close(), timeout=60)
        wait_until(lambda: not node.sessions.sessions, timeout_s=20)
        assert node.budget.used_bytes == 0


def test_g3_two_identities_holding_the_cache_do_not_lock_out_an_honest_client(starved):
    # two peers, two sessions each of 128 tokens reserved: the whole cache, each peer at its share
    firsts, _ = attack(starved, identities=2, per_identity=2, max_length=256)
    assert [answer["kind"] for answer in firsts] == ["opened"] * 4
    node = starved[1]
    assert node.budget.free_bytes >= 0


def test_g3_nine_identities_holding_every_session_slot_do_not_lock_out_an_honest_client(starved):
    # nine peers, four sessions each: 36 opens for 16 places
    firsts, _ = attack(starved, identities=9, per_identity=4, max_length=8)
    assert sum(answer["kind"] == "opened" for answer in firsts) >= LIMITS["max_sessions"]


def test_g3_five_hundred_concurrent_opens_are_all_answered_promptly(starved):
    swarm, node, honest, reference = starved
    attackers = swarm.run(Attackers.create(5, swarm.peers_with(node), PeerID.from_base58(node.peer_id)))
    try:
        started = time.monotonic()
        firsts = swarm.run(attackers.open(100, 8), timeout=120)
        took_s = time.monotonic() - started
        assert len(firsts) == 500
        unanswered = [answer for answer in firsts if answer["kind"] not in ("opened", "error")]
        assert not unanswered, f"{len(unanswered)} opens got no typed answer, e.g. {unanswered[:3]}"
        # opens that waited may preempt earlier ones (which frees their owner's quota): the node stays within limits
        assert len(node.sessions) <= LIMITS["max_sessions"]
        assert {answer["code"] for answer in firsts if answer["kind"] == "error"} <= {
            "quota",
            "too_many_sessions",
            "cache_budget",
        }
        assert took_s < 30.0, f"500 opens took {took_s:.1f} s to be answered"
        output = honest.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert torch.equal(output, reference)
    finally:
        swarm.run(attackers.close(), timeout=60)
        wait_until(lambda: not node.sessions.sessions, timeout_s=20)


def test_g3_sessions_reserve_cache_as_they_use_it_and_one_that_never_steps_is_closed(module_swarm, tiny_llama):
    """An open reserves a chunk of cache, not its whole max_length; a session that takes no step within the first-step
    deadline is closed by the node although its owner keeps the stream open, and its cache returns; an honest
    session that generates past the chunk grows its reservation and gets the reference tokens."""
    node = module_swarm.start_node(
        tiny_llama, 0, 4, dht_prefix="starve-deadline", first_step_timeout_s=1.0, max_cache_tokens=1024
    )
    chunk = node.budget.session_bytes(1, RESERVE_CHUNK_TOKENS)
    attackers = module_swarm.run(Attackers.create(2, module_swarm.peers_with(node), PeerID.from_base58(node.peer_id)))
    try:
        firsts = module_swarm.run(attackers.open(1, 1024), timeout=60)
        assert [answer["kind"] for answer in firsts] == ["opened", "opened"], firsts
        assert node.budget.used_bytes == 2 * chunk  # not two sessions of 1024 tokens: the whole cache
        started = time.monotonic()
        wait_until(lambda: not node.sessions.sessions, timeout_s=10)
        print(f"idle sessions closed {time.monotonic() - started:.1f} s after opening (deadline 1 s)")
        assert node.budget.used_bytes == 0

        new_tokens = RESERVE_CHUNK_TOKENS + 20  # past the first chunk
        reference = AutoModelForCausalLM.from_pretrained(tiny_llama)
        with torch.inference_mode():
            expected = reference.generate(PROMPT, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        with DistributedModelForCausalLM.from_pretrained(
            tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="starve-deadline", compression="none"
        ) as honest:
            wait_for_chain(honest)
            with honest.inference_session(max_length=512):
                output = honest.generate(PROMPT, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                (session,) = node.sessions.sessions.values()
                assert session.reserved_tokens == 2 * RESERVE_CHUNK_TOKENS
                assert node.budget.used_bytes == node.budget.session_bytes(1, 2 * RESERVE_CHUNK_TOKENS)
                # the cache's buffers are what the budget counted for them (the rest is the outputs kept per token)
                span = node.compute.span
                kv_bytes = kv_bytes_per_token_for(span.config, span.end - span.start, 4)
                assert session.cache.held_bytes() == 2 * RESERVE_CHUNK_TOKENS * kv_bytes
                assert {layer.reserved for layer in session.cache.layers} == {session.reserved_tokens}
        assert torch.equal(output, expected)
    finally:
        module_swarm.run(attackers.close(), timeout=60)
        module_swarm.stop_node(node)


@pytest.mark.parametrize("pipelined", [False, True], ids=["resent", "pipelined"])
def test_g3_a_session_kept_busy_with_one_step_resent_is_closed_at_its_timeout(module_swarm, tiny_llama, pipelined):
    """A peer that takes one step, then sends the same step again every few tenths of a second (each a duplicate,
    answered from its record at no cost) does not keep its session, and its cache, past the session timeout; nor
    does one sending them faster than the node answers, so that its queue is never empty (each answer here takes
    0.2 s), and such a session counts as idle for preemption meanwhile."""
    delay = {"inject_delay_ms": 200.0} if pipelined else {}
    node = module_swarm.start_node(
        tiny_llama, 0, 4, dht_prefix=f"starve-resent-{pipelined}", session_timeout_s=1.5, **delay
    )
    hidden = torch.randn(1, 4, 64)
    step = frame(Step(step_id="resent:0", position=0), [tensor_to_proto(hidden)])
    opening = {"kind": "open", "session_id": "resent", "start_block": 0, "end_block": 4, "batch": 1, "max_length": 64}
    peers = module_swarm.peers_with(node)

    async def keep_resending() -> tuple[list[str], float]:
        p2p = await P2P.create(initial_peers=peers)
        kinds: list[str] = []
        started = time.monotonic()
        idle: list[float] = []  # the session's idleness, as preemption reads it, while it is kept busy

        async def requests():
            yield runtime_pb2.ExpertRequest(metadata=msgpack.packb(opening))
            while time.monotonic() - started < 10:
                yield step
                held = list(node.sessions.sessions.values())
                idle.extend(session.idle_s(time.monotonic()) for session in held)
                await asyncio.sleep(0.02 if pipelined else 0.3)

        try:
            stream = await p2p.iterate_protobuf_handler(
                PeerID.from_base58(node.peer_id), rpc.INFERENCE, requests(), runtime_pb2.ExpertResponse
            )
            async for response in stream:
                kinds.append(msgpack.unpackb(response.metadata)["kind"])
                if not node.sessions.sessions and "result" in kinds:
                    break
        except Exception:  # the node ended the stream with the session
            pass
        finally:
            await p2p.shutdown()
        return kinds, time.monotonic() - started, idle

    try:
        kinds, seconds, idle = module_swarm.run(keep_resending(), timeout=60)
        assert kinds[:2] == ["opened", "result"], kinds
        assert kinds.count("result") > 3  # the duplicates were answered, from the record
        assert not node.sessions.sessions and seconds < 8.0, (seconds, kinds)
        assert node.budget.used_bytes == 0
        assert max(idle) > 1.0  # idle to preemption while it was kept busy (the node was not full: none came)
    finally:
        module_swarm.stop_node(node)


def test_g3_identities_holding_every_large_forward_slot_free_it_within_the_peer_timeout(module_swarm, tiny_llama):
    """Throwaway identities, two streams each (a peer's most), take every slot a node has for large forwards and
    never send on them: another peer's large forward is refused at once with a typed quota error (it does not wait
    behind them), the node drops every held stream once its peer timeout has passed, and the same forward is then
    answered with the blocks' output."""
    peer_timeout_s = 2.0
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="starve-forward", peer_timeout_s=peer_timeout_s)
    gate = node.rpc.forward_streams
    count = gate.max_running // gate.max_running_per_peer
    span = load_block_span(tiny_llama, SpanSpec(0, 4))
    hidden = torch.randn(1, 5, span.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = span(hidden)
    request = frame(ForwardRequest(start_block=0, end_block=4), [tensor_to_proto(hidden)])
    peers = module_swarm.peers_with(node)

    async def forward(p2p: P2P) -> torch.Tensor:
        answer = await call_on_stream(
            p2p, node.peer_id, rpc.FORWARD_STREAM, request, max_answer_bytes=1 << 20, timeout_s=10
        )
        expect(read(answer, FORWARD_ANSWERS), ForwardResult)
        return tensor_from_proto(answer.tensors[0], allowed_dtypes=("float32",), max_elements=1 << 20, rank=3)

    async def hold() -> tuple[list[P2P], list]:
        identities = list(await asyncio.gather(*(P2P.create(initial_peers=peers) for _ in range(count + 1))))
        held = []
        for p2p in identities[1:]:  # the first is the honest peer
            for _ in range(gate.max_running_per_peer):
                held.append(await p2p.call_binary_stream_handler(PeerID.from_base58(node.peer_id), rpc.FORWARD_STREAM))
        return identities, held

    async def release(identities: list[P2P], held: list) -> None:
        for _, _, writer in held:
            writer.close()
        await asyncio.gather(*(p2p.shutdown() for p2p in identities), return_exceptions=True)

    identities, held = module_swarm.run(hold(), timeout=60)
    try:
        wait_until(lambda: sum(list(gate.running.values())) == gate.max_running)  # the node has taken every one
        started = time.monotonic()
        with pytest.raises(QuotaExceededError, match=f"answers {gate.max_running} large forwards at once"):
            module_swarm.run(forward(identities[0]), timeout=30)
        refused_s = time.monotonic() - started
        wait_until(lambda: not gate.running, timeout_s=5 * peer_timeout_s)  # they sent nothing: dropped
        freed_s = time.monotonic() - started
        output = module_swarm.run(forward(identities[0]), timeout=30)
    finally:
        module_swarm.run(release(identities, held), timeout=60)
        module_swarm.stop_node(node)
    print(f"large forward refused in {refused_s:.2f} s; {count} identities' slots freed after {freed_s:.1f} s")
    assert refused_s < 2.0
    assert freed_s <= peer_timeout_s + 3.0
    assert torch.allclose(output, expected, atol=1e-5)


def test_g3_a_burst_of_unary_forwards_from_one_peer_runs_two_at_once_and_refuses_the_rest(module_swarm, tiny_llama):
    """Forwards small enough for one unary call are bounded like the large ones: a peer firing many at once gets two
    run (its share) and the others refused at once with a typed quota error, not queued behind the sessions'
    steps; once they are done it is served again."""
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="starve-calls", inject_delay_ms=500.0)
    request = frame(ForwardRequest(start_block=0, end_block=4), [tensor_to_proto(torch.randn(1, 8, 64))])
    peers = module_swarm.peers_with(node)

    async def burst(count: int) -> list[str]:
        p2p = await P2P.create(initial_peers=peers)
        try:
            answers = await asyncio.gather(
                *(
                    p2p.call_protobuf_handler(PeerID.from_base58(node.peer_id), rpc.FORWARD, request, Frame)
                    for _ in range(count)
                )
            )
            messages = [read(answer, FORWARD_ANSWERS) for answer in answers]
            return [message.kind if message.kind != "error" else f"error:{message.code}" for message in messages]
        finally:
            await p2p.shutdown()

    try:
        answers = module_swarm.run(burst(10), timeout=60)
        assert sorted(answers) == ["error:quota"] * 8 + ["forward_result"] * 2, answers
        assert module_swarm.run(burst(1), timeout=60) == ["forward_result"]
        assert not node.rpc.forward_calls.running
    finally:
        module_swarm.stop_node(node)

"""Bad input to a node (RELIABILITY.md section D): each case gets a typed error with a code, and nothing else is
disturbed. One real node serves all four blocks of the tiny Llama with small limits; an honest client keeps one
session open through the whole module, and after every test its next step must still equal a local run of the
same blocks, while the node holds no session but the honest one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import select
import socket
import time
import uuid
from dataclasses import dataclass

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hivemind.proto import runtime_pb2
from hivemind.proto.p2pd_pb2 import RPCError

from nesa_node import DistributedModelForCausalLM
from nesa_node.client.model import SyncSession
from nesa_node.errors import PeerUnavailableError, QuotaExceededError
from nesa_node.protocol import lane, push_tag, rpc
from nesa_node.protocol.channel import Frame
from nesa_node.protocol.framing import StreamChannel, call_on_stream, open_stream
from nesa_node.protocol.tensors import tensor_to_proto
from nesa_node.server.lanes import MAX_TICKETS_PER_PEER
from nesa_node.server.node import max_frame_bytes
from nesa_node.sharding.blocks import SpanSpec, load_block_span
from tests.support.swarm import wait_for_chain, wait_until

HIDDEN = 64  # the tiny Llama's hidden size
LIMITS = {
    "max_tokens_per_step": 64,
    "max_length": 64,
    "max_batch": 4,
    "max_sessions_per_peer": 3,
    "max_cache_tokens": 1024,
    "max_cache_share_per_peer": 0.5,  # 512 tokens of batch 1 per peer
    "max_step_errors": 4,
}
_END = object()


@dataclass
class Target:
    node: object
    honest: SyncSession
    reference: object  # the same blocks, run locally
    reference_cache: object
    attacker: DistributedModelForCausalLM  # a second client: another peer id, so quotas are its own
    honest_client: DistributedModelForCausalLM
    chain: object

    @property
    def p2p(self) -> P2P:
        return self.attacker.swarm.p2p

    @property
    def peer(self) -> PeerID:
        return PeerID.from_base58(self.node.peer_id)

    def call(self, coroutine, timeout: float = 30.0):
        return self.attacker.call(coroutine, timeout=timeout)


@pytest.fixture(scope="module")
def target(module_swarm, tiny_llama):
    node = module_swarm.start_node(tiny_llama, 0, 4, dht_prefix="bad-input", **LIMITS)
    honest_client = DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="bad-input", compression="none"
    )
    attacker = DistributedModelForCausalLM.from_pretrained(
        tiny_llama, initial_peers=module_swarm.initial_peers, dht_prefix="bad-input", compression="none"
    )
    try:
        chain = wait_for_chain(honest_client)
        honest = honest_client.session_on(chain, batch=1, max_length=64, failover=False)
        reference = load_block_span(tiny_llama, SpanSpec(0, 4))
        target = Target(node, honest, reference, reference.new_cache(), attacker, honest_client, chain)
        yield target
        target.honest.close()
    finally:
        attacker.close()
        honest_client.close()


@pytest.fixture(autouse=True)
def others_undisturbed(target):
    """After each test: the honest session's next step is still right, and no other session lingers."""
    yield
    if target.honest.position == target.honest.max_length:  # a full session: the honest client opens another
        target.honest.close()
        target.honest = target.honest_client.session_on(target.chain, batch=1, max_length=64, failover=False)
        target.reference_cache = target.reference.new_cache()
    hidden = torch.randn(1, 1, HIDDEN, generator=torch.Generator().manual_seed(target.honest.position))
    expected = target.reference(hidden, target.reference_cache, target.honest.position)
    assert torch.allclose(target.honest.step(hidden), expected, atol=1e-5)
    honest_key = (target.honest_client.swarm.peer_id, target.honest.session_id)
    wait_until(lambda: set(target.node.sessions.sessions) == {honest_key})
    honest_bytes = target.node.sessions.sessions[honest_key].reserved_bytes
    assert target.node.budget.used_bytes == honest_bytes


# ---- helpers --------------------------------------------------------------------------------------------------


def message(fields: dict, tensors: list | None = None) -> runtime_pb2.ExpertRequest:
    """A frame with `fields` as its message, written by hand (as a hostile peer would) rather than by the models."""
    return runtime_pb2.ExpertRequest(tensors=tensors or [], metadata=msgpack.packb(fields))


def answer_of(response) -> dict:
    """The message of a node's answer, as the map it sent."""
    return msgpack.unpackb(response.metadata) if response.metadata else {}


def is_error(answer: dict) -> bool:
    return answer.get("kind") == "error"


def opening(**changes) -> runtime_pb2.ExpertRequest:
    fields = {"kind": "open", "session_id": uuid.uuid4().hex, "start_block": 0, "end_block": 4, "batch": 1}
    return message({**fields, "max_length": 16, **changes})


def step(position: int, hidden: torch.Tensor | None = None, **changes) -> runtime_pb2.ExpertRequest:
    if hidden is None:
        hidden = torch.randn(1, 1, HIDDEN)
    fields = {"kind": "step", "step_id": f"s:{position}", "position": position, **changes}
    return message(fields, [tensor_to_proto(hidden)])


def raw_tensor(shape: list[int], buffer: bytes, dtype: str = "float32") -> runtime_pb2.ExpertRequest:
    tensor = runtime_pb2.Tensor(buffer=buffer, size=shape, dtype=dtype, compression=runtime_pb2.CompressionType.NONE)
    return message({"kind": "step", "step_id": "s:0", "position": 0}, [tensor])


async def drain(queue: asyncio.Queue, end: object):
    """The items of `queue` until `end`: the request side of a stream."""
    while (item := await queue.get()) is not end:
        yield item


def converse(
    target: Target, messages, *, answers: int | None = None, until=None, timeout: float = 20.0, read_after_s: float = 0
) -> list[dict]:
    """Send `messages` (a list, or an async iterator) on one inference stream; the metadata of the node's answers,
    `answers` of them or all until the node ends the stream; the first answer is read `read_after_s` after the
    stream opened (a busy client)."""

    async def run() -> list[dict]:
        if isinstance(messages, list):
            outbox: asyncio.Queue = asyncio.Queue()
            for message in messages:
                outbox.put_nowait(message)
            requests = drain(outbox, _END)
        else:
            outbox, requests = None, messages
        stream = await target.p2p.iterate_protobuf_handler(
            target.peer, rpc.INFERENCE, requests, runtime_pb2.ExpertResponse
        )
        received = []
        await asyncio.sleep(read_after_s)
        try:
            async with asyncio.timeout(timeout):
                async for response in stream:
                    received.append(answer_of(response))
                    if answers is not None and len(received) == answers:
                        break
                    if until is not None and until(received[-1]):  # the client stops here, still writing
                        break
        except ConnectionError:  # the node ended the stream while the client was still writing
            pass
        finally:
            if outbox is not None:
                outbox.put_nowait(_END)
            await stream.aclose()
        return received

    return target.call(run(), timeout=timeout + 10)


def refusal(target: Target, messages, *, answers: int) -> dict:
    """The last of `answers` answers, which must be a typed error."""
    received = converse(target, messages, answers=answers)
    assert len(received) == answers, received
    assert is_error(received[-1]), received
    return received[-1]


def raw_frame(target: Target, frame: bytes, name: str = rpc.INFERENCE) -> str:
    """Write bytes on a fresh stream of RPC `name`; the text of the error frame the node answers with."""

    async def run() -> str:
        _, reader, writer = await target.p2p.call_binary_stream_handler(target.peer, name)
        try:
            writer.write(frame)
            await writer.drain()
            return await error_frame(reader)
        finally:
            writer.close()

    return target.call(run())


async def error_frame(reader: asyncio.StreamReader) -> str:
    """The text of the error frame a node answers a stream with (within 10 s)."""
    async with asyncio.timeout(10):
        marker = await reader.readexactly(1)
        length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
        payload = await reader.readexactly(length)
    assert marker == P2P.ERROR_MARKER
    error = RPCError()
    error.ParseFromString(payload)
    return error.message


async def held_stream(target: Target, first: runtime_pb2.ExpertRequest):
    """An inference stream that sends `first` and then nothing, until the test closes it (aclose)."""

    async def hold_open():
        yield first
        await asyncio.sleep(3600)
        yield first

    return await target.p2p.iterate_protobuf_handler(
        target.peer, rpc.INFERENCE, hold_open(), runtime_pb2.ExpertResponse
    )


def frame(payload: bytes, declared: int | None = None) -> bytes:
    length = len(payload) if declared is None else declared
    return P2P.MESSAGE_MARKER + length.to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + payload


# ---- framing ----------------------------------------------------------------------------------------------------


STREAMS = [rpc.INFERENCE, rpc.FORWARD_STREAM]


@pytest.mark.parametrize("name", STREAMS)
def test_d_frame_larger_than_the_limit_is_refused_before_it_is_read(target, name):
    limit = max_frame_bytes(target.node.config, HIDDEN)
    assert limit == 64 * HIDDEN * 4 + 16 * 1024 + 1024
    # a header declaring 1 TiB followed by a few bytes: the node must answer without waiting for the rest
    message = raw_frame(target, frame(b"\x0a\x00", declared=1 << 40), name)
    assert message == f"[too_large] frame of {1 << 40} bytes exceeds this node's limit of {limit} bytes"


def test_g_a_session_stream_takes_no_frame_longer_than_the_session_can_use(target):
    """Once a session is open, its stream takes frames no longer than its whole cache's hidden states (rows x
    max_length, in float32) and a message: a longer one, though within the node's own limit, is refused at its header,
    so the frames queued for a small session cannot hold the node's memory."""
    node_limit = max_frame_bytes(target.node.config, HIDDEN)
    session_limit = 1 * 4 * HIDDEN * 4 + 16 * 1024 + 1024  # batch 1, max_length 4

    async def run() -> tuple[dict, str]:
        _, reader, writer = await target.p2p.call_binary_stream_handler(target.peer, rpc.INFERENCE)
        try:
            opening_bytes = opening(max_length=4).SerializeToString()
            writer.write(frame(opening_bytes))
            await writer.drain()
            async with asyncio.timeout(10):
                marker = await reader.readexactly(1)
                length = int.from_bytes(await reader.readexactly(P2P.HEADER_LEN), P2P.BYTEORDER)
                opened = runtime_pb2.ExpertResponse()
                opened.ParseFromString(await reader.readexactly(length))
            assert marker == P2P.MESSAGE_MARKER
            writer.write(frame(b"\x0a\x00", declared=node_limit - 10))  # within the node's limit, past the session's
            await writer.drain()
            return answer_of(opened), await error_frame(reader)
        finally:
            writer.close()

    opened, message = target.call(run())
    assert opened["kind"] == "opened" and session_limit < node_limit - 10
    assert message == f"[too_large] frame of {node_limit - 10} bytes exceeds this node's limit of {session_limit} bytes"


@pytest.mark.parametrize("name", STREAMS)
def test_d_unparseable_protobuf(target, name):
    message = raw_frame(target, frame(b"\xff\xff\xff\xff\x0f"), name)
    assert message.startswith("[bad_request] unparseable ExpertRequest protobuf")


def test_g6_large_forward_streams_held_open_are_capped_per_peer(target):
    """A peer holding forward streams open without sending (each would hold up to a frame of the node's limit) gets
    two at once; a third is refused with a typed error before a byte of it is read. Once it closes them, a forward
    on a stream is answered again."""
    per_peer = target.node.rpc.forward_streams.max_running_per_peer

    async def run() -> tuple[str, dict]:
        held = [await target.p2p.call_binary_stream_handler(target.peer, rpc.FORWARD_STREAM) for _ in range(per_peer)]
        try:
            await asyncio.sleep(0.5)  # the node has taken them
            _, reader, writer = await target.p2p.call_binary_stream_handler(target.peer, rpc.FORWARD_STREAM)
            try:
                refused = await error_frame(reader)
            finally:
                writer.close()
            with pytest.raises(QuotaExceededError, match="large forwards under way"):  # typed, not "unavailable"
                await call_on_stream(
                    target.p2p, target.node.peer_id, rpc.FORWARD_STREAM, Frame(), max_answer_bytes=1024, timeout_s=10
                )
        finally:
            for _, _, writer in held:
                writer.close()
        await asyncio.sleep(0.5)  # the node has seen them close
        request = message(
            {"kind": "forward", "start_block": 0, "end_block": 4}, [tensor_to_proto(torch.ones(1, 2, HIDDEN))]
        )
        channel = await open_stream(target.p2p, target.node.peer_id, rpc.FORWARD_STREAM, max_frame_bytes=1 << 20)
        try:
            channel.send(request)
            async with asyncio.timeout(10):
                answer = await channel.receive()
        finally:
            channel.close()
        return refused, answer_of(answer)

    refused, answered = target.call(run())
    assert refused == f"[quota] a peer may have {per_peer} large forwards under way at once"
    assert answered["kind"] == "forward_result", answered
    wait_until(lambda: not target.node.rpc.forward_streams.running)  # each slot freed once its answer has left


@pytest.mark.parametrize(
    "read_after_s, pause_s",
    [(0, 0), (2.5, 0), (2.5, 0.05)],
    ids=["reading", "reading-late", "reading-late-sending-slowly"],
)
def test_d_endless_stream_ends_with_a_typed_error(target, read_after_s, pause_s):
    """A client that never stops sending steps: the node works through its session's max_length, refuses the
    rest, and ends the session after `max_step_errors` refusals; the client's unread steps wait on TCP. A client
    that reads late, after the node ended the session, still gets every answer: the node drops what the client
    keeps sending for a while instead of resetting the stream (a reset loses the answers not yet read), whether
    the client floods (the node's reader waits on its queue) or sends slowly (the reader waits on the socket)."""

    async def endless():
        yield opening(max_length=8)
        position = 0
        while True:
            yield step(position)
            position += 1
            # hivemind's writer awaits drain(), which does not suspend while p2pd takes the bytes as fast as they
            # come: without this the writer holds the client's event loop, and the late read starts seconds late
            await asyncio.sleep(pause_s)

    received = converse(
        target,
        endless(),
        until=lambda answer: "session closed" in answer.get("message", ""),
        read_after_s=read_after_s,
    )
    assert received and received[0]["kind"] == "opened", received
    served = [answer for answer in received[1:] if not is_error(answer)]
    refused = [answer for answer in received[1:] if is_error(answer)]
    assert len(served) == 8, received
    assert [answer["code"] for answer in refused] == ["bad_request"] * (LIMITS["max_step_errors"] + 1)
    assert "over the session's max_length" in refused[0]["message"]
    assert refused[-1]["message"] == f"{LIMITS['max_step_errors']} refused steps in a row; session closed"


def test_g_the_next_nodes_refusals_are_reported_but_not_counted_against_the_session(target, module_swarm):
    """A next node that answers its pushes with refusals without end: each is reported to the client (which replaces
    that node), but none counts toward this session's `max_step_errors`, so the honest node before it does not
    close its client's session, and get blamed for it, over another node's refusals."""
    session_id = uuid.uuid4().hex
    reports = LIMITS["max_step_errors"] + 2

    async def requests():
        yield opening(session_id=session_id)
        key = (target.attacker.swarm.peer_id, session_id)
        while (session := target.node.sessions.sessions.get(key)) is None:  # noqa: ASYNC110  (on another loop)
            await asyncio.sleep(0.02)
        for _ in range(reports):  # as its push channel's reader reports them (server/push.py), one after another
            error = PeerUnavailableError("next node refused: its queue is full")
            module_swarm.loop.call_soon_threadsafe(session.report, error)
            await asyncio.sleep(0.1)
        yield step(0)
        await asyncio.Event().wait()  # the stream stays open until its answers are read

    received = converse(target, requests(), answers=2 + reports)  # (the stream's end stops the requests)
    assert received[0]["kind"] == "opened", received
    assert [answer["code"] for answer in received[1:-1]] == ["peer_unavailable"] * reports, received
    assert received[-1]["kind"] == "result", received


# ---- metadata and blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x93\x01\x02\x03", "a message is a map with a 'kind', got tuple"),
        (msgpack.packb({str(key): key for key in range(40)}), "Unable to extract tag using discriminator 'kind'"),
        (msgpack.packb({1: "a"}), "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (b"\xd4\x01\x00", "extension type 1 is not accepted"),
        (msgpack.packb({"kind": "open", "x": [[[[[1]]]]]}), "nested deeper than 4 levels"),
    ],
    ids=["a list", "forty keys", "integer keys", "not msgpack", "extension type", "deep nesting"],
)
def test_d_metadata_that_is_not_a_small_map(target, raw, message):
    error = refusal(target, [runtime_pb2.ExpertRequest(metadata=raw)], answers=1)
    assert error["code"] == "bad_request"
    assert message in error["message"]


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ((0, 10), "unknown block 9: the model has blocks 0..3"),
        ((-1, 3), "start_block: Input should be greater than or equal to 0"),
        ((2, 2), "start_block 2 must be below end_block 2"),
        ((3, 1), "start_block 3 must be below end_block 1"),
        ((0, True), "end_block: Input should be a valid integer"),
    ],
    ids=["past the model", "negative", "empty", "descending", "not integers"],
)
def test_d_unknown_or_empty_block_ranges(target, blocks, message):
    error = refusal(target, [opening(start_block=blocks[0], end_block=blocks[1])], answers=1)
    assert error["code"] == "bad_request"
    assert message in error["message"]


def test_d_blocks_as_a_list_are_an_unknown_key(target):
    """Blocks travel as a range [start_block, end_block): a list of ids cannot even be non-contiguous."""
    fields = msgpack.unpackb(opening().metadata)
    del fields["start_block"], fields["end_block"]
    error = refusal(target, [message({**fields, "blocks": [0, 2, 3]})], answers=1)
    assert error["code"] == "bad_request"
    assert "blocks: Extra inputs are not permitted" in error["message"]


# ---- tensors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "int64", "uint8", "bool", ""])
def test_d_tensor_dtype_outside_the_allowed_set(target, dtype):
    error = refusal(target, [opening(), raw_tensor([1, 1, HIDDEN], bytes(8 * HIDDEN), dtype)], answers=2)
    assert error["code"] == "bad_request"
    assert error["message"].startswith(f"dtype {dtype!r} is not allowed")


@pytest.mark.parametrize("shape", [[1, 2, HIDDEN], [1, 1, HIDDEN // 2], [2, 1, HIDDEN]])
def test_d_declared_shape_does_not_match_the_buffer(target, shape):
    one_token = bytes(4 * HIDDEN)
    error = refusal(target, [opening(), raw_tensor(shape, one_token)], answers=2)
    assert error["code"] == "bad_request"
    assert "needs" in error["message"] and f"payload has {len(one_token)} bytes" in error["message"]


def test_d_element_count_over_the_limit(target):
    # the declared size alone is refused: the buffer holds one token, not 2**24
    error = refusal(target, [opening(), raw_tensor([1, 1 << 24, HIDDEN], bytes(4 * HIDDEN))], answers=2)
    assert error["code"] == "bad_request"
    assert f"exceeds the limit of {64 * HIDDEN} elements" in error["message"]
    error = refusal(target, [opening(max_length=64), step(0, torch.randn(1, 65, HIDDEN))], answers=2)
    assert f"exceeds the limit of {64 * HIDDEN} elements" in error["message"]


@pytest.mark.parametrize("shape", [[0, 1 << 31, 1 << 31], [0, (1 << 32) - 1, (1 << 32) - 1], [0, 1, 1 << 20]])
def test_g1_an_empty_tensor_with_huge_dimensions_is_a_bad_request(target, shape):
    """No elements, so no payload, but dimensions whose strides overflow torch (it raised RuntimeError): refused by
    their size like any tensor over the limit, and the node goes on serving (the autouse check after each test)."""
    error = refusal(target, [opening(), raw_tensor(shape, b"")], answers=2)
    assert error["code"] == "bad_request"
    assert f"exceeds the limit of {64 * HIDDEN} elements" in error["message"]


@pytest.mark.parametrize("shape", [[HIDDEN], [1, HIDDEN], [1, 1, 1, HIDDEN]])
def test_d_wrong_rank(target, shape):
    error = refusal(target, [opening(), raw_tensor(shape, bytes(4 * HIDDEN))], answers=2)
    assert error["code"] == "bad_request"
    assert error["message"].startswith("expected a tensor of rank 3")


def test_d_wrong_hidden_size(target):
    error = refusal(target, [opening(), step(0, torch.randn(1, 2, HIDDEN // 2))], answers=2)
    assert (error["code"], error["message"]) == (
        "bad_request",
        f"hidden size {HIDDEN // 2} does not match the model's {HIDDEN}",
    )


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_d_nan_or_inf_in_hidden_states(target, value):
    hidden = torch.randn(1, 3, HIDDEN)
    hidden[0, 1, 7] = value
    error = refusal(target, [opening(), step(0, hidden)], answers=2)
    assert (error["code"], error["message"]) == ("bad_request", "hidden states contain NaN or Inf")


# ---- session state ------------------------------------------------------------------------------------------------


def test_d_max_length_over_the_node_limit(target):
    error = refusal(target, [opening(max_length=LIMITS["max_length"] + 1)], answers=1)
    assert (error["code"], error["message"]) == ("bad_request", "max_length must be in 1..64, got 65")


def test_d_position_before_0_or_past_the_prefix(target):
    received = converse(target, [opening(), step(0), step(-1), step(2), step(0, step_id="again"), step(1)], answers=6)
    assert received[0]["kind"] == "opened" and not is_error(received[1])
    assert (received[2]["code"], received[2]["message"]) == (
        "bad_request",
        "step message: position: Input should be greater than or equal to 0",
    )
    for refused in received[3:5]:
        assert refused["code"] == "bad_request"
        assert refused["message"].startswith("step at position") and "cache holds 1" in refused["message"]
    assert not is_error(received[5]) and received[5]["position"] == 1  # the session went on undisturbed


def test_d_batch_size_changed_mid_session(target):
    received = converse(target, [opening(batch=2), step(0, torch.randn(2, 1, HIDDEN)), step(1)], answers=3)
    assert not is_error(received[1])
    assert (received[2]["code"], received[2]["message"]) == (
        "bad_request",
        "batch of 1 rows in a session opened with 2",
    )


def test_d_duplicate_session_id_ends_the_owners_idle_session_of_that_id(target):
    """A peer opening an id it already has open here (as a client failing over to the same node, once its channel
    to it broke) ends that session, typed on its stream, and opens anew. Only its own: the id's sessions of other
    peers are untouched (the honest session lives on: others_undisturbed)."""
    first = opening(session_id=target.honest.session_id)  # the honest client's id, opened by another peer

    async def run():
        stream = await held_stream(target, first)  # idle after its open
        try:
            opened = answer_of(await anext(stream))
            again = await asyncio.to_thread(converse, target, [first], answers=1)
            async with asyncio.timeout(10):
                told = answer_of(await anext(stream))
            return opened, again, told
        finally:
            await stream.aclose()

    opened, again, told = target.call(run())
    assert opened["kind"] == again[0]["kind"] == "opened", (opened, again)
    assert (told["code"], told["message"]) == (
        "bad_request",
        f"session {target.honest.session_id!r} was opened again by its owner",
    ), told


@pytest.mark.parametrize(
    ("session_id", "message"),
    [
        ("s1\r\nHost: 10.0.0.1", "String should match pattern"),
        ("s1\nGET / HTTP/1.1", "String should match pattern"),
        ("two words", "String should match pattern"),
        ("tab\there", "String should match pattern"),
        ("nul\x00byte", "String should match pattern"),
        ("caf\u00e9", "String should match pattern"),
        ("", "String should have at least 1 character"),
        ("x" * 129, "String should have at most 128 characters"),
    ],
    ids=["crlf", "lf", "space", "tab", "nul", "non-ascii", "empty", "too-long"],
)
def test_g5_a_session_id_outside_the_fixed_format_is_refused(target, session_id, message):
    """Session ids travel into logs and lane hellos, where line breaks or other characters could forge a line of
    another protocol: an open naming one is refused with a typed bad_request and opens nothing (the honest session
    goes on: the autouse check)."""
    error = refusal(target, [opening(session_id=session_id)], answers=1)
    assert error["code"] == "bad_request"
    assert f"open message: session_id: {message}" in error["message"], error


def test_d_push_from_a_peer_that_is_not_the_upstream(target):
    """A session whose upstream is the honest client: the attacker's pushes into it are refused."""
    session_id = uuid.uuid4().hex
    upstream = target.honest.swarm.peer_id

    async def run():
        stream = await held_stream(target, opening(session_id=session_id, upstream=upstream))
        try:
            assert answer_of(await anext(stream))["kind"] == "opened"
            push = step(0, session_id=session_id)
            response = await target.p2p.call_protobuf_handler(target.peer, rpc.PUSH, push, runtime_pb2.ExpertResponse)
            return answer_of(response)
        finally:
            await stream.aclose()

    error = target.call(run())
    assert (error["code"], error["message"]) == ("bad_request", "push from a peer that is not this session's upstream")


def test_g_a_one_shot_push_of_other_tokens_than_the_client_sealed_is_refused(target):
    """A session whose client sealed its steps (it gave the node a key, protocol/push_tag.py) and whose upstream is
    another peer: that peer's one-shot push (`nesa.push`) of a step with a token more than the client's seal says is
    refused, as on a push stream or lane; the step as sealed is taken."""
    session_id, key = uuid.uuid4().hex, push_tag.new_key()
    upstream = target.honest_client  # the pushing peer: its own p2p, on its own event loop
    opened = opening(session_id=session_id, upstream=upstream.swarm.peer_id, push_key=key.hex())
    stream = target.call(held_stream(target, opened))

    async def answer() -> dict:
        return answer_of(await anext(stream))

    async def push(hidden: torch.Tensor, tokens: int) -> dict:
        seals = push_tag.seal_chain([key], "s:0", 0, tokens)
        request = step(0, hidden, session_id=session_id, owner=target.attacker.swarm.peer_id, seals=list(seals))
        return answer_of(
            await upstream.swarm.p2p.call_protobuf_handler(target.peer, rpc.PUSH, request, runtime_pb2.ExpertResponse)
        )

    try:
        assert target.call(answer())["kind"] == "opened"
        assert upstream.call(push(torch.randn(1, 2, HIDDEN), tokens=1)) == {}  # queued: answers go on the stream
        refused = target.call(answer())
        assert upstream.call(push(torch.randn(1, 2, HIDDEN), tokens=2)) == {}
        taken = target.call(answer())
    finally:
        target.call(stream.aclose())
    assert refused["code"] == "bad_request" and "seal" in refused["message"], refused
    assert taken["kind"] == "result" and taken["position"] == 0, taken


def test_g6_push_streams_end_unless_they_feed_a_session_and_a_session_keeps_one(target, monkeypatch):
    """Push streams (one session's steps from its upstream node, server/lanes.py serve_steps): one that sends nothing
    ends at the node's peer timeout; one whose first step names no session, or a session the sender does not feed,
    is refused and ends; a session's push stream is closed by a newer one of the same session and by the session's
    end. A peer holds no more push streams than sessions it feeds."""
    network = dataclasses.replace(target.node.inference.network, peer_timeout_s=1.0)
    monkeypatch.setattr(target.node.inference, "network", network)
    session_id, me = uuid.uuid4().hex, target.attacker.swarm.peer_id

    async def push_stream() -> StreamChannel:
        return await open_stream(target.p2p, target.node.peer_id, rpc.PUSH_STREAM, max_frame_bytes=1 << 20)

    async def until_ended(channel: StreamChannel) -> list[dict]:
        """The node's answers on `channel` until it ends the stream (within 10 s)."""
        answers = []
        async with asyncio.timeout(10):
            while (answer := await channel.receive()) is not None:
                answers.append(answer_of(answer))
        return answers

    async def run():
        started = time.monotonic()
        idle = await push_stream()
        assert await until_ended(idle) == []
        idle_s = time.monotonic() - started
        ended = {}
        for name, session in (("unknown", uuid.uuid4().hex), ("not fed", target.honest.session_id)):
            stray = await push_stream()
            stray.send(step(0, session_id=session))
            ended[name] = await until_ended(stray)
        opened = await held_stream(target, opening(session_id=session_id, upstream=me))
        try:
            assert answer_of(await anext(opened))["kind"] == "opened"
            older, newer = await push_stream(), await push_stream()
            answers = []
            for position, channel in enumerate((older, newer)):
                channel.send(step(position, session_id=session_id))
                answers.append(answer_of(await anext(opened))["kind"])
            ended["older"] = await until_ended(older)
        finally:
            await opened.aclose()
        ended["newer"] = await until_ended(newer)
        return idle_s, answers, ended

    idle_s, answers, ended = target.call(run())
    assert 0.9 <= idle_s < 10, idle_s
    assert [answer["code"] for answer in ended["unknown"]] == ["unknown_session"], ended
    assert [answer["message"] for answer in ended["not fed"]] == [
        "push from a peer that is not this session's upstream"
    ], ended
    assert answers == ["result", "result"]  # each stream's step was taken
    assert ended["older"] == [] and ended["newer"] == [], ended


def test_g6_streams_that_do_not_say_what_they_are_for_are_capped_and_the_idlest_is_evicted(target, monkeypatch):
    """Session, push, training and sync streams are held by limits of their own only once they say what they are for
    (a session's open read, a push stream bound): until then a node keeps a few session or training streams of one
    peer (more are refused with a typed error before a byte is read; push streams only count) and a few in all, and a
    stream over the total closes the oldest of the peer holding the most. Identities holding idle streams cannot keep
    another peer's session out."""
    gate = target.node.rpc.opening_streams
    monkeypatch.setattr(gate, "max_opening", 4)
    monkeypatch.setattr(gate, "max_per_peer", 3)
    attacker, honest = target.attacker.swarm.peer_id, target.honest_client.swarm.peer_id

    def refusals() -> dict[str, float]:  # the node's metric, by reason
        registry = target.node.metrics.registry
        name = "nesa_node_opening_streams_refused_total"
        return {reason: registry.get_sample_value(name, {"reason": reason}) for reason in ("peer_share", "evicted")}

    refused_before = refusals()

    async def hold(p2p: P2P, names: list[str]) -> list:
        return [await p2p.call_binary_stream_handler(target.peer, name) for name in names]

    async def close_all(streams: list) -> None:
        for _, _, writer in streams:
            writer.close()

    async def refused(name: str) -> str:
        _, reader, writer = await target.p2p.call_binary_stream_handler(target.peer, name)
        try:
            return await error_frame(reader)
        finally:
            writer.close()

    held = target.call(hold(target.p2p, [rpc.INFERENCE, rpc.PUSH_STREAM, rpc.TRAIN]))
    honest_held = []
    try:
        wait_until(lambda: gate.per_peer[attacker] == 3)
        over_share = target.call(refused(rpc.INFERENCE))
        honest_held = target.honest_client.call(hold(target.honest_client.swarm.p2p, [rpc.INFERENCE]))
        wait_until(lambda: dict(gate.per_peer) == {attacker: 3, honest: 1})
        session = target.honest_client.session_on(target.chain, batch=1, max_length=64, failover=False)
        try:
            hidden = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(5))
            expected = target.reference(hidden, target.reference.new_cache(), 0)
            assert torch.allclose(session.step(hidden), expected, atol=1e-5)
        finally:
            session.close()

        async def first_frames() -> list[str | None]:
            """Each held stream's error frame, or None when it has none within 2 s."""

            async def one(reader) -> str | None:
                try:
                    async with asyncio.timeout(2):
                        return await error_frame(reader)
                except TimeoutError:
                    return None

            return await asyncio.gather(*(one(reader) for _, reader, _ in held))

        evicted = [text for text in target.call(first_frames()) if text is not None]  # one of the attacker's
        assert dict(gate.per_peer) == {attacker: 2, honest: 1}
        assert gate.evicted == 1

        async def open_on_a_new_stream() -> tuple[dict, dict]:
            opened = await held_stream(target, opening())
            try:
                answer = answer_of(await anext(opened))
                return answer, dict(gate.per_peer)  # settled once its session opened: its place is free again
            finally:
                await opened.aclose()

        answer, while_open = target.call(open_on_a_new_stream())
    finally:
        target.call(close_all(held))  # each on its own client's loop
        target.honest_client.call(close_all(honest_held))
    assert over_share == "[quota] a peer may have 3 streams opening at once"
    assert evicted == ["[quota] this node has its most streams opening; the idlest one is closed"]
    assert answer["kind"] == "opened", answer
    assert while_open == {attacker: 2, honest: 1}, while_open
    assert {reason: count - refused_before[reason] for reason, count in refusals().items()} == {
        "peer_share": 1,
        "evicted": 1,
    }
    wait_until(lambda: not gate.opening, timeout_s=15)  # every place freed as its stream ended
    assert not gate.per_peer


# ---- data lanes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"in": "zz" * 32}, "open message: lane.in: String should match pattern '^[0-9a-fA-F]+$'"),
        ({"out": "ab"}, "open message: lane.out: String should have at least 64 characters"),
        (
            {"next": "example.com:80"},
            "open message: lane.next: Value error, lane address 'example.com:80' is not 'ip:port'",
        ),
        ({"sideways": 1}, "open message: lane.sideways: Extra inputs are not permitted"),
        ("in", "open message: lane: Input should be a valid dictionary or instance of LaneSettings"),
    ],
)
def test_d_malformed_lane_settings_at_open(target, settings, message):
    error = refusal(target, [opening(lane=settings)], answers=1)
    assert (error["code"], error["message"]) == ("bad_request", message)


def test_d_a_node_dials_no_lane_address_a_client_names(target):
    """A client names an address of its choosing as the next node's lane (a request-forgery attempt: the node would
    connect there and write a hello with the session id). The node dials only the lane its next peer announces for
    itself; this next peer (the honest client) announces none, so nothing reaches the named address."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        next_peer = target.honest_client.swarm.peer_id
        messages = [opening(next=next_peer, lane={"out": lane.new_key().hex(), "next": address}), step(0)]
        received = converse(target, messages, answers=2, timeout=30)
        assert received[0]["kind"] == "opened", received
        assert is_error(received[1]) and received[1]["code"] == "peer_unavailable", received  # no way to push
        readable, _, _ = select.select([listener], [], [], 1.0)
        assert readable == [], "the node connected to the address the client named"
    finally:
        listener.close()


def test_d_lane_connections_without_the_key_touch_no_session(target):
    """Garbage, an unknown session, and the honest session's id with a guessed key: each connection is closed, and
    the honest session (which itself runs over lanes) goes on."""
    address = target.node.lane_address
    honest_id = target.honest.session_id
    assert target.honest.links.links[0].has_step_lane()  # the honest client's steps do travel on a lane

    async def run():
        host, port = lane.parse_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\x16\x03\x01 not a lane hello" + bytes(64))
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed without an answer
        writer.close()
        outcomes = []
        for role, session_id in (
            (lane.ROLE_SEND, uuid.uuid4().hex),
            (lane.ROLE_SEND, honest_id),
            (lane.ROLE_RECEIVE, honest_id),
        ):
            try:
                await asyncio.wait_for(lane.connect(address, role, session_id, lane.new_key()), 10)
                outcomes.append("accepted")
            except lane.LaneClosedError:
                outcomes.append("refused")
        return outcomes

    assert target.call(run()) == ["refused"] * 3


def test_d_a_lane_carries_steps_only(target):
    """The client of a session (it holds the key) sends session control and an unparseable frame on its lane:
    each is refused on the lane with a typed error, and a good step after them is computed."""
    session_id, key_in, key_out = uuid.uuid4().hex, lane.new_key(), lane.new_key()
    settings = {"in": key_in.hex(), "out": key_out.hex(), "next": None}

    async def run():
        stream = await held_stream(target, opening(session_id=session_id, lane=settings))
        sender = receiver = None
        try:
            assert answer_of(await anext(stream))["kind"] == "opened"
            sender = await lane.connect(target.node.lane_address, lane.ROLE_SEND, session_id, key_in)
            receiver = await lane.connect(target.node.lane_address, lane.ROLE_RECEIVE, session_id, key_out)
            answers = []
            control = message({"kind": "history", "position": 1})
            for payload in (control.SerializeToString(), step(0, replay=True).SerializeToString(), b"\xff\xff not pb"):
                sender.send(payload)
                response = runtime_pb2.ExpertResponse()
                response.ParseFromString(await asyncio.wait_for(sender.receive(), 10))
                answers.append(answer_of(response))
            sender.send(step(0).SerializeToString())
            output = runtime_pb2.ExpertResponse()
            output.ParseFromString(await asyncio.wait_for(receiver.receive(), 10))
            return answers, answer_of(output), len(output.tensors)
        finally:
            for each in (sender, receiver):
                if each is not None:
                    each.close()
            await stream.aclose()

    answers, output, tensors = target.call(run())
    assert [(answer["code"], answer["message"]) for answer in answers] == [
        ("bad_request", "history message: kind: Input should be 'step'; step_id: Field required"),
        ("bad_request", "session control and replay come on the session's own stream only"),
        ("bad_request", "unparseable frame on a data lane"),
    ]
    assert (output["step_id"], output["position"], tensors) == ("s:0", 0, 1)


def test_g6_a_session_has_one_lane_of_steps_a_newer_one_ends_the_older(target):
    """The holder of a session's key connects its SEND lane again and again: each new lane ends the one before (its
    upstream connected again), so one peer cannot hold the node's lane places through one small session. The newest
    lane carries the steps."""
    session_id, key_in, key_out = uuid.uuid4().hex, lane.new_key(), lane.new_key()
    settings = {"in": key_in.hex(), "out": key_out.hex(), "next": None}

    async def run():
        stream = await held_stream(target, opening(session_id=session_id, lane=settings))
        senders, receiver = [], None
        try:
            assert answer_of(await anext(stream))["kind"] == "opened"
            for _ in range(5):
                senders.append(await lane.connect(target.node.lane_address, lane.ROLE_SEND, session_id, key_in))
            ended = []
            for sender in senders[:-1]:  # the node closed each older lane: its end arrives
                try:
                    ended.append(await asyncio.wait_for(sender.receive(), 10) is None)
                except lane.LaneClosedError:
                    ended.append(True)
            receiver = await lane.connect(target.node.lane_address, lane.ROLE_RECEIVE, session_id, key_out)
            senders[-1].send(step(0).SerializeToString())
            output = runtime_pb2.ExpertResponse()
            output.ParseFromString(await asyncio.wait_for(receiver.receive(), 10))
            return ended, answer_of(output)
        finally:
            for each in [*senders, receiver]:
                if each is not None:
                    each.close()
            await stream.aclose()

    ended, output = target.call(run())
    assert ended == [True] * 4 and output["step_id"] == "s:0"


def test_d_forward_lane_tickets_are_single_use_and_bound_to_their_key(target):
    """A FORWARD lane opens only with a ticket the node issued (over libp2p), once, with the ticket's key."""

    async def ticket() -> dict:
        response = await target.p2p.call_protobuf_handler(
            target.peer, rpc.LANE_TICKET, runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
        )
        return answer_of(response)

    async def run():
        issued = await ticket()
        address, key = issued["lane"], bytes.fromhex(issued["key"])
        assert address == target.node.lane_address
        outcomes = []
        for ticket_id, ticket_key in ((issued["ticket"], lane.new_key()), (uuid.uuid4().hex, key)):
            try:
                await asyncio.wait_for(lane.connect(address, lane.ROLE_FORWARD, ticket_id, ticket_key), 10)
                outcomes.append("accepted")
            except lane.LaneClosedError:
                outcomes.append("refused")
        # a wrong key used the ticket up: the right key no longer opens it
        try:
            await asyncio.wait_for(lane.connect(address, lane.ROLE_FORWARD, issued["ticket"], key), 10)
            outcomes.append("accepted")
        except lane.LaneClosedError:
            outcomes.append("refused")
        # a fresh ticket with its key works, and answers a forward call like rpc_forward
        issued = await ticket()
        stream = await lane.connect(address, lane.ROLE_FORWARD, issued["ticket"], bytes.fromhex(issued["key"]))
        try:
            forward = runtime_pb2.ExpertRequest(
                tensors=[tensor_to_proto(torch.randn(1, 3, HIDDEN))],
                metadata=msgpack.packb({"kind": "forward", "start_block": 0, "end_block": 4}),
            )
            stream.send(b"\x00garbage")
            stream.send(forward.SerializeToString())
            answers = []
            for _ in range(2):
                response = runtime_pb2.ExpertResponse()
                response.ParseFromString(await asyncio.wait_for(stream.receive(), 10))
                answers.append((answer_of(response).get("code"), len(response.tensors)))
        finally:
            stream.close()
        return outcomes, answers

    outcomes, answers = target.call(run())
    assert outcomes == ["refused", "refused", "refused"]
    assert answers == [("bad_request", 0), (None, 1)]


def test_d_forward_lanes_per_peer_are_bounded(target):
    """One peer may hold MAX_TICKETS_PER_PEER forward lanes open on a node; one more is refused, and closing one
    makes room again."""

    async def open_forward_lane() -> lane.SealedStream:
        response = await target.p2p.call_protobuf_handler(
            target.peer, rpc.LANE_TICKET, runtime_pb2.ExpertRequest(), runtime_pb2.ExpertResponse
        )
        issued = answer_of(response)
        return await asyncio.wait_for(
            lane.connect(issued["lane"], lane.ROLE_FORWARD, issued["ticket"], bytes.fromhex(issued["key"])), 10
        )

    async def run():
        held = [await open_forward_lane() for _ in range(MAX_TICKETS_PER_PEER)]
        try:
            try:
                held.append(await open_forward_lane())
                refused = False
            except lane.LaneClosedError:
                refused = True
            held.pop(0).close()
            for _ in range(100):  # the node notices the close on its next read
                if target.node.lanes.ticket_lanes.get(target.attacker.swarm.peer_id, 0) < MAX_TICKETS_PER_PEER:
                    break
                await asyncio.sleep(0.05)
            held.append(await open_forward_lane())
            return refused
        finally:
            for stream in held:
                stream.close()

    assert target.call(run()) is True


# ---- quotas -------------------------------------------------------------------------------------------------------


def hold_sessions(target: Target, openings: list[runtime_pb2.ExpertRequest]) -> list[dict]:
    """Open each session on its own stream and keep them all open; the node's first answer to each."""

    async def run():
        streams, answers = [], []

        async def held(message):
            yield message
            await asyncio.sleep(3600)

        try:
            for message in openings:
                stream = await target.p2p.iterate_protobuf_handler(
                    target.peer, rpc.INFERENCE, held(message), runtime_pb2.ExpertResponse
                )
                streams.append(stream)
                answers.append(answer_of(await anext(stream)))
            return answers
        finally:
            for stream in streams:
                await stream.aclose()

    return target.call(run())


def test_d_more_sessions_than_the_per_peer_quota(target):
    answers = hold_sessions(target, [opening() for _ in range(LIMITS["max_sessions_per_peer"] + 1)])
    assert all(answer["kind"] == "opened" for answer in answers[:-1])
    assert answers[-1]["code"] == "quota"
    assert "3 open sessions here, the per-peer limit" in answers[-1]["message"]


def test_d_more_cache_than_the_per_peer_quota(target):
    # 3 x 64 tokens per session: two fit the peer's 512-token share, the third does not (the node has room)
    answers = hold_sessions(target, [opening(batch=3, max_length=64) for _ in range(3)])
    assert answers[0]["kind"] == answers[1]["kind"] == "opened"
    assert answers[-1]["code"] == "quota"
    assert "past its share of the node's cache (512 tokens of batch 1, of which 384 are held)" in answers[-1]["message"]
    assert target.node.budget.tokens_left >= 3 * 64  # the node itself had room: the quota refused it


# ---- every message kind: an unknown key, a wrong type, an oversized field ------------------------------------------

LONG = "s" * 300
SESSION_KINDS = {  # sent on a session stream, after a valid open (except the open itself)
    "open": (
        lambda: msgpack.unpackb(opening().metadata),
        {"sideways": 1},
        {"batch": "1"},
        {"session_id": LONG},
    ),
    "step": (
        lambda: {"kind": "step", "step_id": "s:0", "position": 0},
        {"sideways": 1},
        {"position": "0"},
        {"step_id": LONG},
    ),
    "history": (lambda: {"kind": "history", "position": 1}, {"sideways": 1}, {"position": "1"}, {"position": 1 << 40}),
    "retarget": (lambda: {"kind": "retarget"}, {"sideways": 1}, {"upstream": 5}, {"upstream": LONG}),
}
UNARY_KINDS = {  # unary RPCs: a pushed step and a cacheless forward
    "push": (
        rpc.PUSH,
        lambda: {"kind": "step", "step_id": "s:0", "position": 0, "session_id": "x"},
        {"session_id": LONG},
    ),
    "forward": (rpc.FORWARD, lambda: {"kind": "forward", "start_block": 0, "end_block": 4}, {"end_block": 1 << 20}),
}
EXPECTED = {
    "unknown key": "sideways: Extra inputs are not permitted",
    "wrong type": "Input should be a valid",
    "oversized field": "should have at most|less than or equal to",
}


@pytest.mark.parametrize("variant", list(EXPECTED))
@pytest.mark.parametrize("kind", list(SESSION_KINDS))
def test_g_session_messages_refuse_unknown_keys_wrong_types_and_oversized_fields(target, kind, variant):
    base, *changes = SESSION_KINDS[kind]
    bad = message({**base(), **changes[list(EXPECTED).index(variant)]})
    if kind == "open":
        error = refusal(target, [bad], answers=1)
    else:
        error = refusal(target, [opening(), bad], answers=2)
    assert error["code"] == "bad_request"
    assert error["message"].startswith(f"{kind} message: ")
    assert re.search(EXPECTED[variant], error["message"]), error["message"]


@pytest.mark.parametrize("variant", list(EXPECTED))
@pytest.mark.parametrize("kind", list(UNARY_KINDS))
def test_g_unary_messages_refuse_unknown_keys_wrong_types_and_oversized_fields(target, kind, variant):
    name, base, oversized = UNARY_KINDS[kind]
    fields = base()
    change = {"unknown key": {"sideways": 1}, "wrong type": {"start_block" if kind == "forward" else "position": "0"}}
    fields.update(change.get(variant, oversized))
    tensors = [tensor_to_proto(torch.randn(1, 1, HIDDEN))]

    async def run() -> dict:
        response = await target.p2p.call_protobuf_handler(
            target.peer, name, message(fields, tensors), runtime_pb2.ExpertResponse
        )
        return answer_of(response)

    error = target.call(run())
    assert error["kind"] == "error" and error["code"] == "bad_request"
    assert re.search(EXPECTED[variant], error["message"]), error["message"]

"""What a client accepts from a node (client/session_chain.py): frames bounded by the session's own answers, and a
bounded number of unread answers per node."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nesa_node.client.chain_links import ChainLink, LinkFailed
from nesa_node.client.config import ClientConfig
from nesa_node.client.session_chain import (
    ANSWER_HEADROOM_BYTES,
    MAX_HIDDEN,
    MAX_QUEUED_ANSWERS,
    SessionChain,
    answer_frame_bytes,
)
from nesa_node.errors import PeerUnavailableError
from nesa_node.protocol.channel import frame
from nesa_node.protocol.lane import CLIENT_MAX_FRAME_BYTES
from nesa_node.protocol.messages import History, StepResult
from nesa_node.protocol.tensors import NO_CODEC, tensor_to_proto
from nesa_node.routing.chain import Hop


class Channel:
    """A channel whose limit and closing the chain sets; nothing to read."""

    def __init__(self) -> None:
        self.max_frame_bytes = CLIENT_MAX_FRAME_BYTES
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Swarm:
    """What reading an answer asks of the client's Swarm: the dtype the node's record announces."""

    def answer_dtypes(self, peer_id: str) -> tuple[str, ...]:
        return ("float32",)


def chain_with_link() -> tuple[SessionChain, ChainLink]:
    chain = SessionChain(Swarm(), ClientConfig(), session_id="s", batch=2, max_length=32)
    link = ChainLink(Hop("peer", 0, 4))
    link.control, link.outputs = Channel(), Channel()
    chain.links = [link]
    return chain, link


def answer(hidden: torch.Tensor):
    return frame(StepResult(step_id="s:0", position=0), [tensor_to_proto(hidden)])


def test_frames_are_bounded_by_the_session_and_then_by_the_models_hidden_size():
    chain, link = chain_with_link()
    assert chain.max_answer_bytes == 2 * 32 * MAX_HIDDEN * 4 + ANSWER_HEADROOM_BYTES
    assert answer_frame_bytes(64, 1 << 20, 1 << 16) == CLIENT_MAX_FRAME_BYTES  # never above the transport's own cap
    hidden = torch.randn(2, 5, 64)
    chain.read_hidden(link, answer(hidden), NO_CODEC, hidden.numel(), tuple(hidden.shape))
    assert chain.max_answer_bytes == 2 * 32 * 64 * 4 + ANSWER_HEADROOM_BYTES
    assert link.control.max_frame_bytes == link.outputs.max_frame_bytes == chain.max_answer_bytes
    # the largest honest answer (the whole session's hidden states) fits the bound
    assert answer(torch.randn(2, 32, 64)).ByteSize() <= chain.max_answer_bytes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_hidden_states_in_another_dtype_than_the_node_announces_fail_the_node(dtype):
    chain, link = chain_with_link()
    hidden = torch.randn(2, 5, 64)
    with pytest.raises(LinkFailed, match="is not allowed; allowed: float32") as failed:
        chain.read_hidden(link, answer(hidden.to(dtype)), NO_CODEC, hidden.numel(), tuple(hidden.shape))
    assert failed.value.link is link
    assert chain.read_hidden(link, answer(hidden), NO_CODEC, hidden.numel(), tuple(hidden.shape)).dtype == torch.float32


def test_a_node_flooding_answers_is_failed_once_its_unread_answers_reach_the_bound():
    chain, link = chain_with_link()
    small = answer(torch.randn(2, 1, 64))
    for _ in range(MAX_QUEUED_ANSWERS):
        chain._queue_answer(link, small, link.outputs)
    with pytest.raises(PeerUnavailableError, match="unread: it sent what nobody asked for"):
        chain._queue_answer(link, small, link.outputs)
    assert link.outputs.closed

    async def take_one():
        return await chain.next_answer(1.0)

    assert asyncio.run(take_one())[0] is link  # taking an answer makes room again
    assert link.queued_answers == MAX_QUEUED_ANSWERS - 1
    chain._queue_answer(link, small, link.outputs)


def test_unread_bytes_are_bounded_too():
    chain, link = chain_with_link()
    chain._learn_hidden_size(64)
    big = answer(torch.randn(1, 1, (chain.max_answer_bytes - 1024) // 4))  # nearly a frame's limit: two fit
    chain._queue_answer(link, big, link.outputs)
    chain._queue_answer(link, big, link.outputs)
    with pytest.raises(PeerUnavailableError):
        chain._queue_answer(link, big, link.outputs)


def test_a_failed_read_names_the_node():
    chain, link = chain_with_link()
    chain.answers.put_nowait((link, PeerUnavailableError("the data lane of peer failed: lane frame of 9 bytes")))

    async def take_one():
        return await chain.next_answer(1.0)

    with pytest.raises(LinkFailed) as failed:
        asyncio.run(take_one())
    assert failed.value.link is link and "lane frame of" in failed.value.message


class TalkingChannel(Channel):
    """A channel that takes what the client sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = []

    def send(self, message) -> None:
        self.sent.append(message)


def test_answers_nobody_waits_for_do_not_extend_an_exchange_past_its_deadline():
    """A node that keeps sending answers of other steps, each just within the wait for one answer, cannot hold an
    exchange open: its deadline holds for the whole exchange (here a history request), not for each answer."""
    chain, link = chain_with_link()
    link.control = TalkingChannel()
    chain.swarm.request_timeout_s = 0.6
    other = frame(StepResult(step_id="s:other", position=0), [tensor_to_proto(torch.zeros(2, 1, 64))])

    async def exchange() -> float:
        async def chatter():
            while True:
                await asyncio.sleep(0.1)  # well within the 0.6 s a single answer may take
                chain._queue_answer(link, other, link.control)

        talker = asyncio.create_task(chatter())
        started = asyncio.get_running_loop().time()
        try:
            with pytest.raises(LinkFailed, match="no answer from the chain"):
                async with asyncio.timeout(5.0):  # without the exchange's deadline: waits for ever
                    await chain.history(link, 3)
        finally:
            talker.cancel()
        return asyncio.get_running_loop().time() - started

    waited = asyncio.run(exchange())
    assert 0.5 < waited < 2.0, waited
    assert len(link.control.sent) == 1  # one history request, answered by nothing but chatter


def test_a_history_of_another_shape_than_the_sessions_fails_its_sender():
    """Once a step showed the model's width, a node's history must be (batch, position, hidden) exactly: one of the
    same number of values in another shape would be refused by every honest replacement it is replayed into."""
    chain, link = chain_with_link()
    link.control = TalkingChannel()
    chain.swarm.request_timeout_s = 5.0
    chain.read_hidden(link, answer(torch.randn(2, 1, 64)), NO_CODEC, 2 * 64, (2, 1, 64))  # a step: width 64

    async def history_answered_with(hidden: torch.Tensor) -> torch.Tensor:
        chain._queue_answer(link, frame(History(position=3), [tensor_to_proto(hidden)]), link.control)
        return await chain.history(link, 3)

    assert asyncio.run(history_answered_with(torch.randn(2, 3, 64))).shape == (2, 3, 64)
    with pytest.raises(LinkFailed, match="expected \\(2, 3, 64\\)") as failed:
        asyncio.run(history_answered_with(torch.randn(2, 3 * 64, 1)))
    assert failed.value.link is link and failed.value.fault


def test_a_client_that_knows_its_models_width_bounds_answers_by_it_from_the_first():
    """Before any answer, a session opened by a client that knows the model's hidden size bounds every frame by it,
    not by the widest hidden state accepted (a hostile first answer cannot be 1000 times an honest one)."""
    chain = SessionChain(Swarm(), ClientConfig(), session_id="s", batch=2, max_length=32, hidden_size=64)
    assert chain.hidden_size == 64
    assert chain.max_answer_bytes == 2 * 32 * 64 * 4 + ANSWER_HEADROOM_BYTES

"""The stream twin of a unary call (protocol/framing.py `answer_one_frame`): one request read within the timeout, its
answer sent, and the node's side done once the answer has left; a peer that never reads its answer has the stream
aborted (its unread bytes dropped), not held by the node."""

from __future__ import annotations

import asyncio

from nesa_node.protocol.channel import Frame
from nesa_node.protocol.framing import answer_one_frame


class Channel:
    """A stream's node side: `request` arrives (None: the peer ended at once); `draining` says whether the answer
    leaves (False: a peer that does not read)."""

    def __init__(self, request: Frame | None, *, draining: bool = True, arrives_after_s: float = 0.0):
        self.request, self.draining, self.arrives_after_s = request, draining, arrives_after_s
        self.sent: list[Frame] = []
        self.aborted = False

    async def receive(self) -> Frame | None:
        await asyncio.sleep(self.arrives_after_s)
        return self.request

    def send(self, frame: Frame) -> None:
        self.sent.append(frame)

    async def drain(self) -> None:
        if not self.draining:
            await asyncio.Event().wait()

    def abort(self) -> None:
        self.aborted = True


async def echo(request: Frame, context) -> Frame:
    return Frame(metadata=b"answer to " + request.metadata)


def serve(channel: Channel, timeout_s: float = 0.2) -> Channel:
    asyncio.run(asyncio.wait_for(answer_one_frame(channel, None, echo, timeout_s=timeout_s), timeout=5))
    return channel


def test_one_request_gets_its_answer():
    channel = serve(Channel(Frame(metadata=b"x")))
    assert [frame.metadata for frame in channel.sent] == [b"answer to x"] and not channel.aborted


def test_an_answer_the_peer_does_not_read_is_dropped_with_the_stream():
    channel = serve(Channel(Frame(metadata=b"x"), draining=False))
    assert len(channel.sent) == 1 and channel.aborted


def test_no_request_within_the_timeout_or_none_at_all_gets_no_answer():
    assert serve(Channel(Frame(metadata=b"x"), arrives_after_s=1.0)).sent == []
    assert serve(Channel(None)).sent == []

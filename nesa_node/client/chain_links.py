"""The client's link to one node of an inference session's chain: its libp2p stream, and the data lanes the client
itself holds with that node (nesa_node.protocol.lane); and the failure of a link."""

from __future__ import annotations

import asyncio

from nesa_node.errors import PeerUnavailableError
from nesa_node.protocol import lane
from nesa_node.routing.chain import Hop


class ChainLink:
    """The client's stream to one node of the chain, and the data lanes the client itself holds with it."""

    def __init__(self, hop: Hop):
        self.hop = hop
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.reader: asyncio.Task | None = None
        # keys of the data lanes into and out of this node (nesa_node.protocol.lane), drawn by the client at open
        self.key_in = lane.new_key()
        self.key_out = lane.new_key()
        self.send_lane: lane.SealedStream | None = None  # first node: the client's steps
        self.receive_lane: lane.SealedStream | None = None  # last node: its outputs
        self.lane_readers: list[asyncio.Task] = []

    def close_lanes(self) -> None:
        for stream in (self.send_lane, self.receive_lane):
            if stream is not None:
                stream.close()
        for task in self.lane_readers:
            task.cancel()
        self.send_lane = self.receive_lane = None
        self.lane_readers = []


class LinkFailed(PeerUnavailableError):
    """A node of the chain failed (stream closed or errored); `link` is None when the chain as a whole went quiet."""

    def __init__(self, message: str, link: ChainLink | None):
        super().__init__(message)
        self.link = link


def stale_report(answered: ChainLink, metadata: dict, awaited: list[ChainLink]) -> bool:
    """A node other than those the client waits on, during an open or a replay, reporting that its next node is
    gone: the failure being recovered from (the previous node's push to the lost one failed), not an answer. A live
    node that fails meanwhile is met by the next step."""
    return metadata.get("error") == PeerUnavailableError.code and not any(answered is link for link in awaited)


__all__ = ["ChainLink", "LinkFailed", "stale_report"]

"""The client's link to one node of an inference session's chain: its session stream, the data lanes the client
itself holds with that node, and the failure of a link."""

from __future__ import annotations

import asyncio

from nesa_node.errors import (
    CacheBudgetError,
    NesaError,
    PeerUnavailableError,
    QuotaExceededError,
    SessionPreemptedError,
    StepFailedError,
    StepTimeoutError,
)
from nesa_node.protocol import lane, push_tag
from nesa_node.protocol.channel import Channel, Frame
from nesa_node.protocol.framing import StreamChannel
from nesa_node.protocol.messages import ErrorReply, Message
from nesa_node.routing.chain import Hop


class ChainLink:
    """One node of the chain. `control` is the session's libp2p stream (open, control, errors, and steps when there
    is no lane); `steps` the channel the client's steps go on (a lane to the first node, else `control`); `outputs`
    the lane the last node's outputs come back on, when there is one."""

    def __init__(self, hop: Hop):
        self.hop = hop
        self.control: StreamChannel | None = None
        self.steps: Channel | None = None
        self.outputs: Channel | None = None
        self.readers: list[asyncio.Task] = []
        self.closed = False  # closed by the client (failover or close): its last words no longer matter
        self.said: Frame | None = None  # the node's last refusal, kept for when its channel closes right after it
        # answers of this node read from its channels and not yet taken by the session (SessionChain bounds them)
        self.queued_answers = 0
        self.queued_bytes = 0
        # keys of the data lanes into and out of this node (protocol/lane.py), drawn by the client at open
        self.key_in = lane.new_key()
        self.key_out = lane.new_key()
        # the key this node tags the steps it pushes with, and the client seals its steps for it with
        # (protocol/push_tag.py): only it and the client know it
        self.push_key = push_tag.new_key()

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    def send(self, frame: Frame) -> None:
        """Send on the session stream."""
        self.control.send(frame)

    def send_step(self, frame: Frame) -> None:
        """Send a step on the link's step channel (its lane, or the session stream)."""
        (self.steps or self.control).send(frame)

    def has_step_lane(self) -> bool:
        return self.steps is not None and self.steps is not self.control

    def close_lanes(self) -> None:
        for channel in (self.steps, self.outputs):
            if channel is not None and channel is not self.control:
                channel.close()
        self.steps = self.outputs = None

    def close(self) -> None:
        """Close everything: lanes, the session stream (the node ends the session), the readers."""
        self.closed = True
        self.close_lanes()
        if self.control is not None:
            self.control.close()
        for task in self.readers:
            task.cancel()
        self.readers = []


class LinkFailed(PeerUnavailableError):
    """A node of the chain failed (stream closed or errored); `link` is None when the chain as a whole went quiet.
    `fault`: the node sent something wrong (a malformed answer, bad hidden states, a pushed input its next node
    refused), not merely stopped: its ban is never lifted early (Swarm.ban). `full`: the node has no room for the
    session (cache, its quota): opening it there again cannot help (client/failover.py). `accuser`: the node that
    refused the input `link` pushed it, an accusation the failover weighs against `link`'s record of its outputs
    for the first `through` tokens before it blames anyone (Failover.judge). `reporter`: the node that said `link`,
    its next node, did not take its pushes: its word, weighed before anyone is blamed (Failover.weigh_report)."""

    def __init__(
        self,
        message: str,
        link: ChainLink | None,
        *,
        fault: bool = False,
        full: bool = False,
        accuser: ChainLink | None = None,
        through: int = 0,
        reporter: ChainLink | None = None,
    ):
        super().__init__(message)
        self.link = link
        self.fault = fault
        self.full = full
        self.accuser = accuser
        self.through = through
        self.reporter = reporter


def link_ended(error: NesaError, link: ChainLink) -> LinkFailed | None:
    """A node's refusal that says it dropped the session (preempted it: idle, or holding lent cache; or did not compute
    a step within its step timeout, or its blocks failed one) or has no room to grow its cache for it, as the failure
    of its link: it is replaced like a lost node. None for any other refusal."""
    ended = SessionPreemptedError | StepTimeoutError | StepFailedError | CacheBudgetError | QuotaExceededError
    if isinstance(error, ended):
        return LinkFailed(error.message, link, full=isinstance(error, CacheBudgetError | QuotaExceededError))
    return None


def stale_report(answered: ChainLink, message: Message, awaited: list[ChainLink]) -> bool:
    """A node other than those the client waits on, during an open or a replay, reporting that its next node is
    gone: the failure being recovered from (the previous node's push to the lost one failed), not an answer. A live
    node that fails meanwhile is met by the next step."""
    return (
        isinstance(message, ErrorReply)
        and message.code == PeerUnavailableError.code
        and not any(answered is link for link in awaited)
    )


__all__ = ["ChainLink", "LinkFailed", "link_ended", "stale_report"]

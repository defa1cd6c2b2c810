"""The client's side of one node in a LoRA training chain (client/finetune.py): its training stream, one request and
one answer at a time, and the causal LM loss the client computes on the chain's output."""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from nesa_node.errors import PeerUnavailableError, RequestError
from nesa_node.protocol.channel import Frame, read
from nesa_node.protocol.framing import StreamChannel
from nesa_node.protocol.messages import FROM_TRAINING, ErrorReply, Message, expect
from nesa_node.routing.snapshot import Hop

IGNORE_INDEX = -100  # labels that take no part in the loss (transformers' convention)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next label (-100: ignored), in float32."""
    shifted = logits[:, :-1].float()  # (batch, seq - 1, vocab)
    targets = labels[:, 1:].to(shifted.device)  # (batch, seq - 1)
    return nn.functional.cross_entropy(
        shifted.reshape(-1, shifted.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


class LinkLost(PeerUnavailableError):
    """A node of the training chain failed, went silent or answered nonsense: it is replaced (failover)."""

    def __init__(self, peer_id: str, reason: str):
        super().__init__(f"node {peer_id[:12]}… {reason}")
        self.peer_id = peer_id


class TrainLink:
    """The training stream to one node of the chain: one request, one answer, in order."""

    def __init__(self, hop: Hop, channel: StreamChannel, timeout_s: float):
        self.hop = hop
        self.channel = channel
        self.timeout_s = timeout_s

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    async def call(self, request: Frame, expected: type[Message]) -> tuple[Message, Frame]:
        """Send `request`, return the node's answer; its typed error when it refused; PeerUnavailableError when the
        stream broke or the node did not answer within the timeout."""
        try:
            self.channel.send(request)
            async with asyncio.timeout(self.timeout_s):
                await self.channel.drain()
                answer = await self.channel.receive()
        except TimeoutError:
            raise LinkLost(self.peer_id, f"did not answer within {self.timeout_s} s") from None
        except PeerUnavailableError as exc:
            raise LinkLost(self.peer_id, exc.message) from None
        except RequestError as exc:  # a malformed frame
            raise LinkLost(self.peer_id, f"sent a malformed frame: {exc.message}") from None
        if answer is None:
            raise LinkLost(self.peer_id, "ended the training stream")
        try:
            message = read(answer, FROM_TRAINING)
        except RequestError as exc:
            raise LinkLost(self.peer_id, f"sent a malformed answer: {exc.message}") from None
        if isinstance(message, ErrorReply):
            raise message.error()
        return expect(message, expected), answer

    def close(self) -> None:
        self.channel.close()


__all__ = ["IGNORE_INDEX", "LinkLost", "TrainLink", "causal_lm_loss"]

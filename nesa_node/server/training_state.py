"""What a node keeps of one LoRA training session (server/training.py): its trainable slice and optimizer, the
forwards that wait for their backward pass, and its replicas' gradients, with the bytes each takes of the node's
training memory."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from nesa_node.protocol.channel import Channel
from nesa_node.sharding.lora_train import TrainableSlice

ANSWERED_KEPT = 64  # step ids of answered backward passes remembered per session: a reused one is refused


def activation_bytes(span, tokens: int, blocks: tuple[int, int]) -> int:
    """What a forward's autograd graph holds through `blocks` for `tokens` tokens, bytes: per token and block, the
    inputs of the seven projections and two norms, the attention output and the MLP's intermediate tensors (a guess
    of 12 hidden-wide and 5 intermediate-wide float32 tensors; eager attention holds its probabilities on top)."""
    config = span.config
    per_token = 12 * config.hidden_size + 5 * getattr(config, "intermediate_size", 4 * config.hidden_size)
    return 4 * tokens * per_token * (blocks[1] - blocks[0])


def fixed_bytes(slice_bytes: int, replicas: int) -> int:
    """What a session holds from its open to its end: four float32 copies of its slice (parameters, gradients, AdamW's
    two moments), and room for its replicas' gradients on other nodes, of this update and the next (each a slice's
    worth; a replica on the same node hands over its own tensor)."""
    return (4 + 2 * replicas) * slice_bytes


@dataclass
class Saved:
    """A forward that waits for its backward pass: its input, and its graph (inputs, output) while kept."""

    input: torch.Tensor
    graph: tuple[torch.Tensor, torch.Tensor] | None
    graph_bytes: int
    at: float = field(default_factory=time.monotonic)  # when the forward was taken

    @property
    def nbytes(self) -> int:
        return self.input.nbytes + self.graph_bytes


@dataclass
class TrainingSession:
    session_id: str
    client_peer: str
    blocks: tuple[int, int]
    slice: TrainableSlice
    optimizer: torch.optim.Optimizer
    step: int  # optimizer steps applied
    saved: OrderedDict[str, Saved] = field(default_factory=OrderedDict)  # step id -> what its backward needs
    answered: OrderedDict[str, None] = field(default_factory=OrderedDict)  # ids of the last backward passes
    dropped: OrderedDict[str, None] = field(default_factory=OrderedDict)  # saved forwards dropped for room (ids)
    pending_grads: bool = False  # gradients gathered since the last optimizer step
    step_after_answer: object = None  # the optimizer step of the backward pass just answered, run once it is sent
    replicas: tuple[tuple[str, str], ...] = ()  # (peer id, session id) of the sessions training the same blocks
    channel: Channel | None = None
    busy: bool = False  # a request of the session is being answered
    lent: bool = False  # opened past its peer's share: ended first when a peer within its share needs the room
    remote_replicas: int = 0  # replicas on other nodes: their gradients wait in the inbox (local ones are shared)
    opened: float = field(default_factory=time.monotonic)
    failed: bool = False  # its slice may be half updated (an optimizer step failed): it ends once that is answered
    last_active: float = field(default_factory=time.monotonic)  # when it last had an answer (or opened)
    # update round -> {(peer id, session id): the replica's flat gradients}, and a wake-up on each arrival
    inbox: dict[int, dict[tuple[str, str], torch.Tensor]] = field(default_factory=dict)
    synced_round: int = 0  # the last update whose replicas' gradients were read from the inbox
    confirmed: set[tuple[str, str]] = field(default_factory=set)  # replicas on other nodes that said they take ours
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def state_bytes(self) -> int:
        """Parameters, their gradients and AdamW's two moments, what waits for backward passes, and room for its
        replicas' gradients (`fixed_bytes`)."""
        return fixed_bytes(self.slice.nbytes, self.remote_replicas) + sum(saved.nbytes for saved in self.saved.values())

    def drop_saved(self, step_id: str) -> None:
        """Drop a saved forward to make room: its backward pass, if it comes, is refused as preempted."""
        del self.saved[step_id]
        self.dropped[step_id] = None
        while len(self.dropped) > ANSWERED_KEPT:
            self.dropped.popitem(last=False)

    def drop_graphs(self) -> None:
        """Forget the autograd graphs of forwards that wait for their backward pass (they hold the parameters'
        values before an optimizer step): those backward passes recompute from their inputs."""
        for saved in self.saved.values():
            saved.graph, saved.graph_bytes = None, 0


__all__ = ["ANSWERED_KEPT", "Saved", "TrainingSession", "activation_bytes", "fixed_bytes"]

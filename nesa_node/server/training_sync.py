"""Data-parallel LoRA training: the sessions of one span on several nodes (or one node) are each other's replicas,
and before every optimizer step each sends its gradients to the others and all sum them in one fixed order, so the
replicas take bit-identical steps (server/training.py's module docstring says why the client names the group
instead of hivemind's averager finding one).

  TrainSync   node -> node on rpc.TRAIN_SYNC: one replica's flat gradients for one update; TrainSynced, or refused

Only a session's named replicas are heard, only for this update or the next, and a node sends gradients only to
replicas that announce the blocks on the DHT, and only once the replica said it holds a session that names this one
as its replica (a probe, metadata alone, before the first gradients): a client naming nodes that hold no such
session cannot make a node upload its gradients to each of them at every step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import P2PContext

from nesa_node.errors import (
    AdapterError,
    BadRequestError,
    NesaError,
    PeerUnavailableError,
    ReplicaUnavailableError,
    RequestError,
)
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.framing import StreamChannel, open_stream
from nesa_node.protocol.messages import (
    MAX_METADATA_BYTES,
    TRAIN_SYNC,
    TRAIN_SYNC_ANSWERS,
    ErrorReply,
    TrainSync,
    TrainSynced,
    expect,
)
from nesa_node.protocol.tensors import tensor_from_proto, tensor_to_proto

if TYPE_CHECKING:
    from nesa_node.server.training_state import TrainingSession

logger = logging.getLogger(__name__)


def _grad_of(parameter: torch.nn.Parameter) -> torch.Tensor:
    return parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)


class ReplicaSync:
    """The gradient exchange of a TrainingService's sessions with their replicas."""

    def __init__(self, service):
        self.service = service  # server/training.py TrainingService: its sessions, records, P2P host, compute

    async def check_nodes(self, peers: set[str], blocks: tuple[int, int]) -> None:
        """BadRequestError unless every peer in `peers` announces on the DHT a span holding `blocks`: gradients go
        only to nodes that could train the same blocks, never to a peer a client merely names."""
        if not peers:
            return
        serving = set()
        if self.service.records is not None:
            try:
                async with asyncio.timeout(self.service.network.peer_timeout_s / 3):
                    infos = await self.service.records()
                serving = {
                    info.peer_id for info in infos if info.start_block <= blocks[0] and blocks[1] <= info.end_block
                }
            except Exception as exc:  # a DHT read that fails: the node cannot check them now (the client goes on)
                logger.warning("training: could not read the swarm's records to check replicas: %r", exc)
                raise PeerUnavailableError(
                    "this node could not read the swarm's records to check the session's replicas; try another"
                ) from None
        unknown = sorted(peers - serving)
        if unknown:
            raise BadRequestError(
                f"replicas {', '.join(peer[:12] for peer in unknown)} do not announce blocks {blocks[0]}:{blocks[1]}"
            )

    async def sync_and_step(self, session: TrainingSession) -> float:
        """Send this session's gradients to its replicas, wait for theirs (peer_timeout_s), sum all in the order of
        (peer id, session id), so every replica gets the same bits, then take the optimizer step. Seconds spent."""
        started = asyncio.get_running_loop().time()
        parameters = session.slice.parameters()
        # the gradients gathered, summed and serialized off the event loop (tens of MB for a big slice: the loop
        # serves every other session meanwhile), and serialized once for all replicas on other nodes
        flat, _ = await self.service._compute(
            lambda: torch.cat([_grad_of(parameter).reshape(-1) for parameter in parameters]).cpu()
        )
        remote = any(peer != self.service.peer_id for peer, _ in session.replicas)
        wire = await asyncio.to_thread(tensor_to_proto, flat) if remote else None
        round_ = session.step + 1
        me = (self.service.peer_id, session.session_id)
        try:
            async with asyncio.timeout(self.service.network.peer_timeout_s):
                async with asyncio.TaskGroup() as group:
                    for peer, session_id in session.replicas:
                        group.create_task(self._send_gradients(session, peer, session_id, round_, flat, wire))
                inbox = session.inbox.setdefault(round_, {})
                while not set(session.replicas) <= set(inbox):
                    session.arrived.clear()
                    await session.arrived.wait()
        except (TimeoutError, ExceptionGroup) as exc:
            session.optimizer.zero_grad(set_to_none=True)  # this update is lost: its gradients must not linger
            session.pending_grads = False
            missing = sorted(set(session.replicas) - set(session.inbox.pop(round_, {})))
            # why: a replica's refusal in its words, else what failed (a timeout: one sent nothing)
            errors = exc.exceptions if isinstance(exc, ExceptionGroup) else (exc,)
            why = next((error.message for error in errors if isinstance(error, NesaError)), type(errors[0]).__name__)
            raise ReplicaUnavailableError(
                f"update {round_}: no gradients from replicas {', '.join(peer[:12] for peer, _ in missing)} ({why})"
            ) from None
        gradients = {**session.inbox.pop(round_), me: flat}
        session.synced_round = round_  # read: a late copy for it is refused, never kept (_receiver)

        def step() -> None:
            total = functools.reduce(torch.add, (gradients[key] for key in sorted(gradients)))
            offset = 0
            for parameter in parameters:
                count = parameter.numel()
                parameter.grad = total[offset : offset + count].view_as(parameter).to(parameter.device).clone()
                offset += count
            session.optimizer.step()
            session.optimizer.zero_grad(set_to_none=True)

        try:
            await self.service._compute(step)
        except Exception as exc:  # the slice may be half updated: the session ends once this is answered
            session.failed = True
            raise exc if isinstance(exc, RequestError) else AdapterError(f"optimizer step failed: {exc!r}") from None
        return asyncio.get_running_loop().time() - started

    async def _send_gradients(
        self, session: TrainingSession, peer: str, session_id: str, round_: int, flat: torch.Tensor, wire
    ) -> None:
        message = TrainSync(
            owner=session.client_peer, session_id=session_id, from_session_id=session.session_id, round=round_
        )
        if peer == self.service.peer_id:  # a replica on this node
            self._deliver(message, self.service.peer_id, flat)
            return
        if (peer, session_id) not in session.confirmed:  # asked first, with nothing but the message
            await self._exchange(peer, frame(message.model_copy(update={"probe": True})))
            session.confirmed.add((peer, session_id))
        try:
            await self._exchange(peer, frame(message, [wire]))
        except RequestError:
            session.confirmed.discard((peer, session_id))  # it took them before: asked again next time
            raise

    async def _exchange(self, peer: str, request) -> None:
        """One TrainSync to `peer` on a stream of its own, answered TrainSynced; its refusal raised typed."""
        channel = await open_stream(self.service.p2p, peer, rpc.TRAIN_SYNC, max_frame_bytes=MAX_METADATA_BYTES + 4096)
        try:
            channel.send(request)
            answer = await channel.receive()
            if answer is None:
                raise PeerUnavailableError(f"replica {peer[:12]}… ended the sync stream")
            reply = read(answer, TRAIN_SYNC_ANSWERS)
            if isinstance(reply, ErrorReply):
                raise reply.error()
        finally:
            channel.close()

    async def serve(self, channel: StreamChannel, context: P2PContext) -> None:
        """A replica's gradients for one of this node's sessions (TrainSync), answered TrainSynced or refused."""
        try:
            async with asyncio.timeout(self.service.network.peer_timeout_s):
                request = await channel.receive()
        except TimeoutError:
            return
        if request is None:
            return
        try:
            message = expect(read(request, TRAIN_SYNC), TrainSync)
            if len(request.tensors) != (0 if message.probe else 1):
                raise BadRequestError("a training sync carries one tensor of gradients (a probe none)")
            sender = context.remote_id.to_base58()
            session = self._receiver(message, sender)  # before the gradients are read at all
            if message.probe:  # whether gradients from the sender would be taken: they would
                channel.send(frame(TrainSynced()))
                return
            numel = sum(parameter.numel() for parameter in session.slice.parameters())

            def parse() -> tuple[torch.Tensor, bool]:  # off the event loop, as the sender's side
                flat = tensor_from_proto(request.tensors[0], allowed_dtypes=("float32",), max_elements=numel, rank=1)
                return flat, bool(torch.isfinite(flat).all())

            flat, finite = await asyncio.to_thread(parse)
            self._deliver(message, sender, flat, finite=finite)
            channel.send(frame(TrainSynced()))
        except RequestError as exc:
            channel.send(frame(ErrorReply.of(exc)))

    def _receiver(self, message: TrainSync, sender: str) -> TrainingSession:
        """The session gradients from `sender` are for: BadRequestError unless it is one of this node's, names the
        sender's session as a replica, and is at an update that takes them (this one or the next)."""
        session = self.service.sessions.get((message.owner, message.session_id))
        if session is None:
            raise BadRequestError(f"no training session {message.session_id} of that client here")
        if (sender, message.from_session_id) not in session.replicas:
            raise BadRequestError("the sender is not a replica of this training session")
        # this update or the next, nothing else is kept: not one already read (its step may still be running)
        if not max(session.step, session.synced_round) < message.round <= session.step + 2:
            raise BadRequestError(f"gradients for update {message.round}; this session is at update {session.step}")
        return session

    def _deliver(self, message: TrainSync, sender: str, flat: torch.Tensor, *, finite: bool | None = None) -> None:
        """Keep a replica's gradients for its update, after every check (`finite`: whether the caller found every
        value finite already; None: checked here)."""
        session = self._receiver(message, sender)
        numel = sum(parameter.numel() for parameter in session.slice.parameters())
        if flat.shape != (numel,) or not (finite if finite is not None else bool(torch.isfinite(flat).all())):
            raise BadRequestError(f"replica gradients must be {numel} finite float32 values")
        # kept until the update, one per replica and round, in the room the session reserved for them at its open
        session.inbox.setdefault(message.round, {})[(sender, message.from_session_id)] = flat
        session.arrived.set()


__all__ = ["ReplicaSync"]

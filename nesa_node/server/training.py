"""LoRA training sessions on a node: its blocks run with its own slice of the adapter under autograd, and it updates
that slice itself (Nesa paper section 2.4.2, eq. 7; AdamW, of which eq. 7 is the SGD case).

One training stream (protocol.rpc.TRAIN) is one session. The client sends, in order, and the node answers each:

  OpenTraining   + the slice's canonical bytes   -> TrainOpened   the node keeps a float32 trainable copy
  TrainForward   + hidden states (positions 0..)  -> TrainOutput   the input is saved for the backward pass
  TrainBackward  + gradient of the outputs        -> TrainGrad     gradient of the inputs, then an AdamW step
  TrainStateRequest                               -> TrainState    the slice and AdamW's state, signed by the node

What a node keeps for backward is only the input of each forward (batch x seq x hidden): the backward pass runs the
blocks again from it with autograd on and backpropagates through them (activation recomputation). A node that
replaces a failed one therefore needs nothing but that input, which the client holds; at most `max_queued_steps`
inputs wait for their backward pass. A backward pass answered once is answered again from record (the client
resends it after a lost answer), so no update is ever applied twice.

Limits: `max_training_sessions` sessions on the node, each peer at most `max_cache_share_per_peer` of them (one at
least); a session's trainable state (parameters, gradients and AdamW's two moments: four float32 copies of its
slice) and saved inputs within `max_training_mb`. Refusals are typed (too_many_sessions, quota, adapter_budget,
adapter, bad_request); a session ends after `session_timeout_s` without a message.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from hivemind.p2p import P2PContext

from nesa_node.errors import (
    AdapterBudgetError,
    AdapterError,
    BadRequestError,
    QuotaExceededError,
    RequestError,
    TooManySessionsError,
)
from nesa_node.protocol.channel import Frame, frame, read
from nesa_node.protocol.framing import StreamChannel
from nesa_node.protocol.messages import (
    TO_TRAINING,
    ErrorReply,
    OpenTraining,
    TrainBackward,
    TrainForward,
    TrainGrad,
    TrainOpened,
    TrainOutput,
    TrainState,
    TrainStateRequest,
    expect,
)
from nesa_node.protocol.tensors import bytes_from_proto, bytes_to_proto, tensor_to_proto
from nesa_node.server.compute import BlockCompute
from nesa_node.server.config import LimitsConfig, NetworkConfig
from nesa_node.sharding.lora import AdapterSlice, check_fits_model
from nesa_node.sharding.lora_rows import trainable_adapter
from nesa_node.sharding.lora_train import OptimizerState, TrainableSlice

logger = logging.getLogger(__name__)

ANSWERED_KEPT = 4  # backward answers kept per session for a resent step (the client has one in flight)


@dataclass
class TrainingSession:
    session_id: str
    client_peer: str
    blocks: tuple[int, int]
    slice: TrainableSlice
    optimizer: torch.optim.Optimizer
    step: int  # optimizer steps applied
    saved: OrderedDict[str, torch.Tensor] = field(default_factory=OrderedDict)  # step id -> forward input
    answered: OrderedDict[str, Frame] = field(default_factory=OrderedDict)  # step id -> its TrainGrad frame
    pending_grads: bool = False  # gradients gathered since the last optimizer step

    @property
    def state_bytes(self) -> int:
        """Parameters, their gradients and AdamW's two moments, and the saved inputs."""
        return 4 * self.slice.nbytes + sum(tensor.nbytes for tensor in self.saved.values())


class TrainingService:
    """The node's LoRA training sessions (module docstring)."""

    def __init__(
        self, compute: BlockCompute, limits: LimitsConfig, network: NetworkConfig, model_config, *, signer=None
    ):
        self.signer = signer  # the node's RSAPrivateKey (hivemind), which signs the states it hands out; None: unsigned
        self.compute = compute
        self.limits = limits
        self.network = network
        self.model_config = model_config
        self.sessions: dict[tuple[str, str], TrainingSession] = {}
        self.updates_applied = 0

    @property
    def max_state_bytes(self) -> int:
        return int(self.limits.max_training_mb * 2**20)

    # ---- the stream ------------------------------------------------------------------------------------------------

    async def serve_training(self, channel: StreamChannel, context: P2PContext) -> None:
        """One training stream, from its OpenTraining to its end."""
        peer = context.remote_id.to_base58()
        request = await self._next(channel)
        if request is None:
            return
        try:
            session = await self._open(request, peer)
        except RequestError as exc:
            channel.send(frame(ErrorReply.of(exc)))
            return
        try:
            channel.send(frame(TrainOpened(step=session.step)))
            while (request := await self._next(channel)) is not None:
                channel.send(await self._answer(session, request))
                await channel.drain()
        finally:
            self.sessions.pop((peer, session.session_id), None)

    async def _next(self, channel: StreamChannel) -> Frame | None:
        try:
            async with asyncio.timeout(self.limits.session_timeout_s):
                return await channel.receive()
        except TimeoutError:
            return None

    async def _answer(self, session: TrainingSession, request: Frame) -> Frame:
        step_id = None
        try:
            message = read(request, TO_TRAINING)
            step_id = getattr(message, "step_id", None)
            if isinstance(message, TrainForward):
                return await self._forward(session, request, message)
            if isinstance(message, TrainBackward):
                return await self._backward(session, request, message)
            if isinstance(message, TrainStateRequest):
                return self._state(session)
            raise BadRequestError("this training session is open already")
        except RequestError as exc:
            return frame(ErrorReply.of(exc, step_id))

    # ---- opening ---------------------------------------------------------------------------------------------------

    async def _open(self, request: Frame, peer: str) -> TrainingSession:
        message = expect(read(request, TO_TRAINING), OpenTraining)
        blocks = self.compute.check_blocks(message.start_block, message.end_block)
        if (peer, message.session_id) in self.sessions:
            raise BadRequestError(f"training session {message.session_id} is open already")
        if len(self.sessions) >= self.limits.max_training_sessions:
            raise TooManySessionsError(
                f"this node holds {len(self.sessions)} training sessions, its limit (max_training_sessions)"
            )
        share = max(1, math.floor(self.limits.max_training_sessions * self.limits.max_cache_share_per_peer))
        if sum(owner == peer for owner, _ in self.sessions) >= share:
            raise QuotaExceededError(f"this peer holds {share} training sessions here, its share")
        tensors = 1 if message.optimizer_sha256 is None else 2
        if len(request.tensors) != tensors:
            raise BadRequestError(
                f"this training open carries {tensors} tensors: the slice's bytes, and AdamW's state when it names one"
            )
        data = bytes_from_proto(request.tensors[0], max_bytes=self.max_state_bytes // 4)
        piece = await asyncio.to_thread(AdapterSlice.from_bytes, data, message.slice_sha256)
        saved = None
        if message.optimizer_sha256 is not None:
            data = bytes_from_proto(request.tensors[1], max_bytes=self.max_state_bytes // 2)
            saved = await asyncio.to_thread(OptimizerState.from_bytes, data, message.optimizer_sha256)
        if (piece.start, piece.end) != blocks:
            raise AdapterError(f"the slice holds blocks {piece.start}:{piece.end}, the session {blocks[0]}:{blocks[1]}")
        check_fits_model(piece, self.model_config)
        trainable = TrainableSlice(piece, self.compute.span.spec.device)
        trainable.check_fits(self.compute.span)
        used = sum(session.state_bytes for session in self.sessions.values())
        if used + 4 * trainable.nbytes > self.max_state_bytes:
            raise AdapterBudgetError(
                f"training state of {4 * trainable.nbytes} bytes does not fit: {used} of max_training_mb "
                f"({self.max_state_bytes} bytes) are taken"
            )
        optimizer = torch.optim.AdamW(
            trainable.parameters(),
            lr=message.lr,
            betas=message.betas,
            eps=message.eps,
            weight_decay=message.weight_decay,
            foreach=False,
        )
        if saved is not None:
            trainable.restore_optimizer(optimizer, saved)
        session = TrainingSession(message.session_id, peer, blocks, trainable, optimizer, step=message.step)
        self.sessions[(peer, message.session_id)] = session
        return session

    # ---- passes ----------------------------------------------------------------------------------------------------

    async def _forward(self, session: TrainingSession, request: Frame, message: TrainForward) -> Frame:
        hidden = self.compute.read_hidden(request, message.codec, batch=None)
        output_codec = self.compute.codec(message.output_codec)
        if message.keep:
            if message.step_id in session.saved or message.step_id in session.answered:
                raise BadRequestError(f"step {message.step_id} was run already in this session")
            if len(session.saved) >= self.limits.max_queued_steps:
                raise BadRequestError(
                    f"{len(session.saved)} forward passes wait for their backward pass, the limit (max_queued_steps)"
                )
            used = sum(other.state_bytes for other in self.sessions.values())
            if used + hidden.nbytes > self.max_state_bytes:
                raise AdapterBudgetError("saved inputs would exceed max_training_mb; send the waiting backward passes")
        span, factors = self.compute.span, session.slice.factors

        def run() -> torch.Tensor:
            with torch.no_grad(), trainable_adapter(span, factors):
                return span(hidden, None, 0, session.blocks)

        output, seconds = await self.compute.run_work(run)
        if message.keep:
            session.saved[message.step_id] = hidden
        return frame(
            TrainOutput(step_id=message.step_id, compute_s=seconds, codec=output_codec),
            [tensor_to_proto(output, output_codec)],
        )

    async def _backward(self, session: TrainingSession, request: Frame, message: TrainBackward) -> Frame:
        answered = session.answered.get(message.step_id)
        if answered is not None:
            return answered
        hidden = session.saved.get(message.step_id)
        if hidden is None:
            raise BadRequestError(f"no forward pass {message.step_id} waits for its backward pass here")
        grad = self.compute.read_hidden(request, message.codec, batch=hidden.shape[0])
        if grad.shape != hidden.shape:
            raise BadRequestError(f"gradient of shape {tuple(grad.shape)} for outputs of {tuple(hidden.shape)}")
        output_codec = self.compute.codec(message.output_codec)
        span, trainable, optimizer = self.compute.span, session.slice, session.optimizer

        def run() -> torch.Tensor:
            inputs = hidden.to(span.spec.device, span.dtype_).detach().requires_grad_(True)
            with torch.enable_grad(), trainable_adapter(span, trainable.factors):
                output = span(inputs, None, 0, session.blocks)
            torch.autograd.backward(output, grad.to(output.device, output.dtype))
            if message.apply:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            return inputs.grad

        grad_input, seconds = await self.compute.run_work(run)
        del session.saved[message.step_id]
        session.pending_grads = not message.apply
        if message.apply:
            session.step += 1
            self.updates_applied += 1
        answer = frame(
            TrainGrad(step_id=message.step_id, step=session.step, compute_s=seconds, codec=output_codec),
            [tensor_to_proto(grad_input, output_codec)],
        )
        session.answered[message.step_id] = answer
        while len(session.answered) > ANSWERED_KEPT:
            session.answered.popitem(last=False)
        return answer

    def _state(self, session: TrainingSession) -> Frame:
        """The slice and AdamW's state now, signed (TrainState)."""
        if session.pending_grads:
            raise BadRequestError("gradients are gathered but not applied yet: finish the step before asking")
        piece = session.slice.snapshot()
        optimizer_bytes = session.slice.optimizer_state(session.optimizer).to_bytes()
        message = TrainState(
            start_block=piece.start,
            end_block=piece.end,
            step=session.step,
            slice_sha256=piece.sha256,
            optimizer_sha256=hashlib.sha256(optimizer_bytes).hexdigest(),
        )
        if self.signer is not None:
            signature = self.signer.sign(message.signed_bytes(session.session_id))
            message = message.model_copy(
                update={"public_key": self.signer.get_public_key().to_bytes(), "signature": signature}
            )
        return frame(message, [bytes_to_proto(piece.to_bytes()), bytes_to_proto(optimizer_bytes)])

    def close(self) -> None:
        self.sessions.clear()


__all__ = ["TrainingService", "TrainingSession"]

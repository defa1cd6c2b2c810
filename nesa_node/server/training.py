"""LoRA training sessions on a node: its blocks run with its own slice of the adapter under autograd, and it updates
that slice itself (Nesa paper section 2.4.2, eq. 7; AdamW, of which eq. 7 is the SGD case).

One training stream (protocol.rpc.TRAIN) is one session. The client sends, in order, and the node answers each:

  OpenTraining   + the slice's canonical bytes   -> TrainOpened   the node keeps a float32 trainable copy
  TrainForward   + hidden states (positions 0..)  -> TrainOutput   the input is saved for the backward pass
  TrainBackward  + gradient of the outputs        -> TrainGrad     gradient of the inputs, then an AdamW step once
                                                                   the answer is sent (or, apply=False, gathered
                                                                   for a TrainApply)
  TrainApply                                      -> TrainApplied  the AdamW step on the gathered micro-batches
  TrainStateRequest                               -> TrainState    the slice and AdamW's state, signed by the node

What a node keeps for backward: the input of each forward (batch x seq x hidden), and its autograd graph while the
node's training memory (`max_training_mb`) has room for it (activation_bytes, an estimate); without the graph the
backward pass runs the blocks again from the input with autograd on (activation recomputation), with the same
result. A node that replaces a failed one therefore needs nothing but that input, which the client holds. At most
`max_queued_steps` forwards wait for their backward pass; an optimizer step drops the others' graphs (they saw the
parameters before it). A step id's backward pass runs once (a repeat is refused), and a TrainApply for the step
already taken is answered without another, so no update is ever applied twice; a client that loses an answer
reopens its chain at its last checkpoint instead (client/finetune.py). A pass of more activations than
`max_training_mb` holds is refused; running out of device memory is a typed refusal too.

Limits: `max_training_sessions` sessions on the node, each peer at most `max_cache_share_per_peer` of them (one at
least, its opens under way counted, refused before their bytes are read); when the node is full, the session idle
longest, if idle for `preempt_idle_s` (`step_timeout_s` while a forward waits for its backward pass; a refused request
or one answered from record is no activity), is ended (preempted) to admit a new one. A session's trainable state
(parameters, gradients and AdamW's two moments: four float32 copies of its slice, reserved while an open builds
it), saved inputs and its replicas' gradients stay within `max_training_mb`, and a peer's sessions within its share
of it (`max_cache_share_per_peer`), a forward's room reserved before it runs. A saved forward whose backward pass is
overdue, or that its peer keeps past its share, is dropped when another session needs the room
(server/training_room.py). Refusals are typed (too_many_sessions, quota,
adapter_budget, adapter, bad_request). A session ends when it sends nothing within `first_step_timeout_s` of opening, or
`session_timeout_s` later on.

Data parallel (server/training_sync.py): sessions on the same blocks opened as each other's `replicas` (OpenTraining) each run part of every
batch; before each optimizer step every member sends its gradients to the others (rpc.TRAIN_SYNC, node to node; a
replica on the same node directly) and waits for theirs, and all sum them in one fixed order, so the replicas take
bit-identical steps and their slices never drift apart. Only the named replicas' gradients are taken, for this
update or the next; one that does not send within `peer_timeout_s` fails the step (replica_unavailable) and the
client replaces the chains. The client names the group when it opens the sessions, so no matchmaking round is
needed (hivemind's averager finds its group through the DHT each round, seconds that a step of a few hundred ms
cannot spare).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time

import torch
from hivemind.p2p import P2PContext

from nesa_node.errors import (
    AdapterBudgetError,
    AdapterError,
    BadRequestError,
    NotFiniteError,
    PeerUnavailableError,
    QuotaExceededError,
    RequestError,
    SessionPreemptedError,
    TooManySessionsError,
)
from nesa_node.protocol.channel import Channel, Frame, frame, read
from nesa_node.protocol.framing import StreamChannel, settled
from nesa_node.protocol.messages import (
    TO_TRAINING,
    ErrorReply,
    OpenTraining,
    TrainApplied,
    TrainApply,
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
from nesa_node.server.training_room import TrainingRoom
from nesa_node.server.training_state import ANSWERED_KEPT, Saved, TrainingSession, activation_bytes, fixed_bytes
from nesa_node.server.training_sync import ReplicaSync
from nesa_node.sharding.lora import AdapterSlice, check_fits_model
from nesa_node.sharding.lora_rows import trainable_adapter
from nesa_node.sharding.lora_train import OptimizerState, TrainableSlice

logger = logging.getLogger(__name__)


class TrainingService:
    """The node's LoRA training sessions (module docstring)."""

    def __init__(
        self,
        compute: BlockCompute,
        limits: LimitsConfig,
        network: NetworkConfig,
        model_config,
        *,
        signer=None,
        p2p=None,
        records=None,
    ):
        self.signer = signer  # the node's RSAPrivateKey (hivemind), which signs the states it hands out; None: unsigned
        self.p2p = p2p  # the node's P2P host: gradients to replicas on other nodes (None: only local replicas)
        self.peer_id = p2p.peer_id.to_base58() if p2p is not None else ""
        self.records = records  # async () -> the NodeInfo records of the swarm (DHT): who may be a replica
        self.sync = ReplicaSync(self)  # data parallel: gradients to and from the sessions' replicas
        self.compute = compute
        self.limits = limits
        self.network = network
        self.model_config = model_config
        self.sessions: dict[tuple[str, str], TrainingSession] = {}
        self.opening: dict[str, int] = {}  # peer -> its opens being checked (not yet sessions): they count as held
        self.room = TrainingRoom(self)  # the training memory, and each peer's share of it
        self.draining = False  # refuse new sessions (the node is stopping or moving)
        self.updates_applied = 0

    @property
    def max_state_bytes(self) -> int:
        return self.room.max_bytes

    # ---- the stream ------------------------------------------------------------------------------------------------

    async def serve_training(self, channel: StreamChannel, context: P2PContext) -> None:
        """One training stream (libp2p), from its OpenTraining to its end."""
        await self.serve_session(channel, context.remote_id.to_base58())

    async def serve_session(self, channel: Channel, peer: str) -> None:
        """One training session on `channel` (a libp2p stream, or a TRAIN data lane opened with a ticket `peer`
        was given), from its OpenTraining to its end."""
        request = await self._next(channel, self.limits.first_step_timeout_s)
        if request is None:
            return
        try:
            session = await self._open(request, peer)
        except RequestError as exc:
            channel.send(frame(ErrorReply.of(exc)))
            return
        session.channel = channel
        settled(channel)  # the node's training session limits hold it from here (server/rpc.py opening_streams)
        try:
            channel.send(frame(TrainOpened(step=session.step)))
            timeout_s = self.limits.first_step_timeout_s  # opening costs nothing: a session must use its place
            while (request := await self._next(channel, timeout_s)) is not None:
                session.busy, answered = True, False
                try:
                    answer, answered = await self._answer(session, request)
                    channel.send(answer)
                    if session.failed:  # told why in the answer; its owner fails over to its last checkpoint
                        return
                    if session.step_after_answer is not None:  # the step, off the client's critical path
                        step, session.step_after_answer = session.step_after_answer, None
                        if not await self._step_after_answer(session, step):
                            return
                    async with asyncio.timeout(self.limits.step_timeout_s):
                        await channel.drain()
                except TimeoutError:  # a client that stops reading: the session ends
                    logger.debug("training session %s: client stopped reading", session.session_id)
                    return
                finally:  # a refused request is no activity: it cannot keep an idle session from preemption
                    session.busy = False
                    if answered:
                        session.last_active = time.monotonic()
                timeout_s = self.limits.session_timeout_s
        finally:
            if self.sessions.get((peer, session.session_id)) is session:
                del self.sessions[(peer, session.session_id)]

    async def _step_after_answer(self, session: TrainingSession, step) -> bool:
        """Take the optimizer step of the backward pass whose answer was just sent: the gradient of the input is on
        its way to the previous node while this one updates its slice, and the session's next request is read only
        after the step. Whether it was taken; a step that fails ends the session (its slice may be half updated),
        and the client fails over to its last checkpoint."""
        try:
            await self._compute(step)
        except Exception as exc:  # noqa: BLE001 - any failure leaves the slice unusable: typed, then the end
            logger.warning("training session %s: optimizer step failed: %r", session.session_id, exc)
            error = exc if isinstance(exc, RequestError) else AdapterError(f"optimizer step failed on the node: {exc}")
            self._end(session, error)
            return False
        return True

    async def _next(self, channel: Channel, timeout_s: float) -> Frame | None:
        try:
            async with asyncio.timeout(timeout_s):
                return await channel.receive()
        except TimeoutError:
            return None

    def idle_limit_s(self, session: TrainingSession) -> float:
        """How long `session` may go without an answered request before it may be preempted: `preempt_idle_s`, or
        while forwards wait for their backward pass (the rest of its chain is running) `step_timeout_s` at least."""
        if session.saved:
            return max(self.limits.preempt_idle_s, self.limits.step_timeout_s)
        return self.limits.preempt_idle_s

    def _preemptible(self, now: float) -> list[TrainingSession]:
        return [
            session
            for session in self.sessions.values()
            if not session.busy and now - session.last_active >= self.idle_limit_s(session)
        ]

    async def _answer(self, session: TrainingSession, request: Frame) -> tuple[Frame, bool]:
        """The answer to one request of the session, and whether it was served (False: refused, typed)."""
        step_id = None
        try:
            message = read(request, TO_TRAINING)
            step_id = getattr(message, "step_id", None)
            if isinstance(message, TrainForward):
                return await self._forward(session, request, message), True
            if isinstance(message, TrainBackward):
                return await self._backward(session, request, message), True
            if isinstance(message, TrainApply):  # answering one taken already is no activity: it costs nothing
                progress = message.update != session.step
                return await self._apply(session, message), progress
            if isinstance(message, TrainStateRequest):
                return await self._state(session), True
            raise BadRequestError("this training session is open already")
        except (
            RequestError,
            PeerUnavailableError,
        ) as exc:  # refused, or a replica sent nothing: typed, the stream stays
            return frame(ErrorReply.of(exc, step_id)), False

    # ---- opening ---------------------------------------------------------------------------------------------------

    async def _open(self, request: Frame, peer: str) -> TrainingSession:
        """Refuse what needs no work first (the peer's share and the node's sessions, counting opens under way), then
        validate the open (everything that awaits), then admit it in one go with no await between the checks and
        the insert, so concurrent opens cannot all pass the same limits."""
        message = expect(read(request, TO_TRAINING), OpenTraining)
        blocks = self.compute.check_blocks(message.start_block, message.end_block)
        self._check_room(peer, message.session_id)  # before the bytes are parsed and the slice built
        # (other peers' opens under way do not count here: ones bound to fail would keep honest ones out)
        if len(self.sessions) >= self.limits.max_training_sessions and not self._preemptible(time.monotonic()):
            raise TooManySessionsError(
                f"this node holds {len(self.sessions)} training sessions, its limit (max_training_sessions)"
            )
        self.opening[peer] = self.opening.get(peer, 0) + 1
        try:
            return await self._open_checked(request, message, blocks, peer)
        finally:
            self.opening[peer] -= 1
            if not self.opening[peer]:
                del self.opening[peer]

    async def _open_checked(self, request: Frame, message: OpenTraining, blocks, peer: str) -> TrainingSession:
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
        if not piece.factors:
            raise AdapterError("the slice holds no LoRA factors: nothing to train")
        replicas = tuple(sorted({(replica.peer, replica.session_id) for replica in message.replicas}))
        if (self.peer_id, message.session_id) in replicas:
            raise BadRequestError("a training session cannot be its own replica")
        await self.sync.check_nodes({peer for peer, _ in replicas} - {self.peer_id}, blocks)
        span = self.compute.span
        if span is None:
            raise TooManySessionsError("node is loading other blocks (rebalancing); route around it")

        def build() -> tuple[TrainableSlice, torch.optim.Optimizer]:
            trainable = TrainableSlice(piece, span.spec.device)
            trainable.check_fits(span)
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
            return trainable, optimizer

        # what the session holds (float32 state, room for its replicas' gradients) is reserved while it is built, so
        # concurrent opens cannot build more than the training memory holds before any of them is admitted
        numel = sum(factor.lora_a.numel() + factor.lora_b.numel() for factor in piece.factors.values())
        remote = sum(replica_peer != self.peer_id for replica_peer, _ in replicas)
        with self.room.building(peer, fixed_bytes(4 * numel, remote), "training state"):
            try:
                trainable, optimizer = await asyncio.to_thread(build)
            except torch.OutOfMemoryError:
                raise AdapterBudgetError("the device ran out of memory for this training session's state") from None
        nbytes = fixed_bytes(trainable.nbytes, remote)
        lent = not self.room.within_share(peer, nbytes)  # past the share: free memory only, ended first for others
        self._admit(peer, message.session_id, nbytes, opening=1)
        session = TrainingSession(
            message.session_id,
            peer,
            blocks,
            trainable,
            optimizer,
            step=message.step,
            replicas=replicas,
            lent=lent,
            remote_replicas=remote,
        )
        self.sessions[(peer, message.session_id)] = session
        return session

    def _check_room(self, peer: str, session_id: str, *, opening: int = 0) -> None:
        """The refusals an open gets without preempting anyone: the node draining, the id in use, the peer at its
        share (its opens under way counted, less `opening` of them: the caller's own). Checked before an open's
        bytes are read, and again at its admission."""
        if self.draining:
            raise TooManySessionsError("node is draining or moving; route around it")
        if (peer, session_id) in self.sessions:
            raise BadRequestError(f"training session {session_id} is open already")
        share = max(1, math.floor(self.limits.max_training_sessions * self.limits.max_cache_share_per_peer))
        held = sum(owner == peer for owner, _ in self.sessions) + self.opening.get(peer, 0) - opening
        if held >= share:
            raise QuotaExceededError(
                f"this peer holds {share} training sessions here, its share (opens under way count)"
            )

    def _admit(self, peer: str, session_id: str, nbytes: int, *, opening: int = 0) -> None:
        """Room for a new session of `peer` holding `nbytes`, ending sessions when the node is full (of sessions or of
        training memory: server/training_room.py says which); the typed refusal otherwise, with nobody ended.
        Synchronous: the caller inserts right after. `opening`: opens under way of `peer` that are this one (1 from
        `_open`)."""
        self._check_room(peer, session_id, opening=opening)
        slots = max(0, len(self.sessions) + 1 - self.limits.max_training_sessions)  # places to free in the limit
        if slots and not self.room.could_take(nbytes, peer=peer, slots=slots):
            raise TooManySessionsError(
                f"this node holds {len(self.sessions)} training sessions, its limit (max_training_sessions)"
            )
        refusal = f"training state of {nbytes} bytes does not fit"
        self.room.make_room(nbytes, refusal, peer=peer, keep=None, preempt=True, slots=slots)

    @property
    def used_bytes(self) -> int:
        return self.room.used_bytes

    def end_all(self, reason: str) -> None:
        """End every training session (the node drains or moves): each owner is told and fails over."""
        for session in list(self.sessions.values()):
            self._end(session, SessionPreemptedError(f"training session ended: {reason}"))

    def _end(self, session: TrainingSession, error) -> None:
        self.sessions.pop((session.client_peer, session.session_id), None)
        if session.channel is not None:
            with contextlib.suppress(Exception):
                session.channel.send(frame(ErrorReply.of(error)))
            session.channel.close()

    # ---- passes ----------------------------------------------------------------------------------------------------

    async def _forward(self, session: TrainingSession, request: Frame, message: TrainForward) -> Frame:
        hidden = self.compute.read_hidden(request, message.codec, batch=None)
        output_codec = self.compute.codec(message.output_codec)
        if message.keep:
            if (
                message.step_id in session.saved
                or message.step_id in session.answered
                or message.step_id in session.dropped
            ):
                raise BadRequestError(f"step {message.step_id} was run already in this session")
            if len(session.saved) >= self.limits.max_queued_steps:
                raise BadRequestError(
                    f"{len(session.saved)} forward passes wait for their backward pass, the limit (max_queued_steps)"
                )
        span, factors = self.compute.span, session.slice.factors
        graph_bytes = activation_bytes(span, hidden.shape[0] * hidden.shape[1], session.blocks)
        if message.keep and graph_bytes > self.max_state_bytes:  # a backward pass holds it, kept or recomputed
            raise AdapterBudgetError(
                f"a pass of {hidden.shape[0] * hidden.shape[1]} tokens needs about {graph_bytes} bytes of activations, "
                f"over max_training_mb ({self.max_state_bytes} bytes): send fewer tokens per pass (micro-batches)"
            )
        if message.keep:  # refused above before anything gives way: a request refused anyway takes nothing
            refusal = "saved inputs would exceed max_training_mb; send the waiting backward passes"
            self.room.make_room(hidden.nbytes, refusal, peer=session.client_peer, keep=session, preempt=False)
        used = self.used_bytes + hidden.nbytes
        keep_graph = (  # else recomputed on backward; kept only in free room, within the peer's share
            message.keep
            and used + graph_bytes <= self.max_state_bytes
            and self.room.within_share(session.client_peer, hidden.nbytes + graph_bytes)
        )
        if message.keep:  # its bytes reserved before the await: other sessions' forwards meanwhile count them
            session.saved[message.step_id] = Saved(hidden, None, graph_bytes if keep_graph else 0)

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            if not keep_graph:
                with torch.no_grad(), trainable_adapter(span, factors):
                    return span(hidden, None, 0, session.blocks), None
            inputs = hidden.to(span.spec.device, span.dtype_).detach().requires_grad_(True)
            with torch.enable_grad(), trainable_adapter(span, factors):
                output = span(inputs, None, 0, session.blocks)
            return output, inputs

        try:
            (output, inputs), seconds = await self._compute(run)
            if not torch.isfinite(output).all():  # (its input is finite: read_hidden checked it)
                raise NotFiniteError("these hidden states overflow this node's blocks (outputs not finite)")
        except BaseException:
            if message.keep:
                session.saved.pop(message.step_id, None)
            raise
        kept = session.saved.get(message.step_id) if message.keep else None
        if kept is not None and kept.graph_bytes:  # its room was reserved for the graph (and not dropped since)
            kept.graph = (inputs, output)
        output = output.detach()
        return frame(
            TrainOutput(step_id=message.step_id, compute_s=seconds, codec=output_codec),
            [tensor_to_proto(output, output_codec)],
        )

    async def _backward(self, session: TrainingSession, request: Frame, message: TrainBackward) -> Frame:
        if message.step_id in session.answered:
            raise BadRequestError(f"the backward pass of step {message.step_id} was run already")
        if message.step_id in session.dropped:
            raise SessionPreemptedError(
                f"the input of forward {message.step_id} was dropped to make room (its backward pass came late, or "
                "its peer was past its share of max_training_mb): start the pass again"
            )
        saved = session.saved.get(message.step_id)
        if saved is None:
            raise BadRequestError(f"no forward pass {message.step_id} waits for its backward pass here")
        hidden = saved.input
        grad = self.compute.read_hidden(request, message.codec, batch=hidden.shape[0])
        if grad.shape != hidden.shape:
            raise BadRequestError(f"gradient of shape {tuple(grad.shape)} for outputs of {tuple(hidden.shape)}")
        output_codec = self.compute.codec(message.output_codec)
        span, trainable, optimizer = self.compute.span, session.slice, session.optimizer
        synced = message.apply and bool(session.replicas)

        def run() -> torch.Tensor | None:
            graph = saved.graph  # read once: the event loop may drop it meanwhile (training_room.py)
            if graph is not None:  # the forward's own graph
                inputs, output = graph
            else:  # recomputed from the saved input
                inputs = hidden.to(span.spec.device, span.dtype_).detach().requires_grad_(True)
                with torch.enable_grad(), trainable_adapter(span, trainable.factors):
                    output = span(inputs, None, 0, session.blocks)
            parameters = trainable.parameters()
            grads = torch.autograd.grad(
                output, [inputs, *parameters], grad.to(output.device, output.dtype), allow_unused=True
            )
            if not all(each is None or torch.isfinite(each).all() for each in grads) or grads[0] is None:
                return None  # nothing accumulated: the step's gradients would poison the adapter's AdamW state
            for parameter, each in zip(parameters, grads[1:], strict=True):
                if each is not None:  # accumulated as backward would (micro-batches of one step add up)
                    parameter.grad = each if parameter.grad is None else parameter.grad + each
            return grads[0]

        grad_input, seconds = await self._compute(run)
        del session.saved[message.step_id]  # its graph is used up
        if grad_input is None:  # (the gradient it was sent is finite: read_hidden checked it)
            raise NotFiniteError("this gradient overflows this node's blocks (gradients not finite); no step taken")
        session.answered[message.step_id] = None
        while len(session.answered) > ANSWERED_KEPT:
            session.answered.popitem(last=False)
        if synced:  # the replicas' gradients summed in, then the step every replica takes alike
            seconds += await self.sync.sync_and_step(session)
        session.pending_grads = session.pending_grads or not message.apply
        if message.apply:
            if not synced:  # taken once the answer is sent (serve_session), before the next request is read

                def step() -> None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                session.step_after_answer = step
            session.pending_grads = False
            session.drop_graphs()  # graphs of other forwards saw the parameters before this step
            session.step += 1
            self.updates_applied += 1
        return frame(
            TrainGrad(step_id=message.step_id, step=session.step, compute_s=seconds, codec=output_codec),
            [tensor_to_proto(grad_input, output_codec)],
        )

    async def _apply(self, session: TrainingSession, message: TrainApply) -> Frame:
        """The optimizer step on the gradients of the micro-batches gathered since the last one (TrainApply)."""
        if message.update == session.step:  # taken already: the client resent it after a lost answer
            return frame(TrainApplied(step=session.step))
        if message.update != session.step + 1:
            raise BadRequestError(f"update {message.update} asked of a session at step {session.step}")
        if not session.pending_grads:
            raise BadRequestError("no backward pass since the last step: nothing to apply")
        optimizer = session.optimizer
        if session.replicas:
            seconds = await self.sync.sync_and_step(session)
        else:

            def step() -> None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            _, seconds = await self._compute(step)
        session.pending_grads = False
        session.step += 1
        self.updates_applied += 1
        session.drop_graphs()
        return frame(TrainApplied(step=session.step, compute_s=seconds))

    async def _state(self, session: TrainingSession) -> Frame:
        """The slice and AdamW's state now, signed (TrainState); serialized off the event loop."""
        if session.pending_grads:
            raise BadRequestError("gradients are gathered but not applied yet: finish the step before asking")

        def serialize() -> tuple[AdapterSlice, bytes]:
            return session.slice.snapshot(), session.slice.optimizer_state(session.optimizer).to_bytes()

        (piece, optimizer_bytes), _ = await self._compute(serialize)
        slice_bytes = await asyncio.to_thread(piece.to_bytes)
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
        return frame(message, [bytes_to_proto(slice_bytes), bytes_to_proto(optimizer_bytes)])

    async def _compute(self, work):
        """`work` on the compute thread (its result, seconds); device memory running out is a typed refusal."""
        try:
            result, seconds = await self.compute.run_work(work)
        except torch.OutOfMemoryError:
            raise AdapterBudgetError("the device ran out of memory for this training pass; send fewer tokens") from None
        return result, seconds

    def close(self) -> None:
        self.end_all("node stopped")


__all__ = ["TrainingService", "TrainingSession", "activation_bytes"]

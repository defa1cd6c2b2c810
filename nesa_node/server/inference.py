"""Inference on the node: a session's stream, its steps with the KV cache, session control, and cacheless forwards.

A session (one client stream, `serve_session`):
  1. the client sends OpenSession; the node checks the blocks against its span, reserves the session's cache (within
     the node's budget and the peer's quota) and answers Opened, or an ErrorReply;
  2. steps arrive as Step messages with hidden states (batch, seq, hidden): on this stream (first node, or
     client-relayed mode), pushed by the upstream node (direct chain) over a push stream or a data lane; every one
     enters through SessionTable.admit and is taken in order from the session's queue;
  3. each step's output goes to the next node (server/push.py), or back to the client (on its output lane when it
     has one, else on this stream) when there is no next node; a replayed step's output always goes to the client;
  4. the session ends, and its cache is freed, when the stream ends, on `max_step_errors` refused steps in a row,
     when no step comes within `first_step_timeout_s` of opening or `session_timeout_s` of the last one, when a
     step is not computed and handed on within `step_timeout_s` (a stuck next node, or this node stalled), or when
     the node preempts it, idle, to admit another (server/sessions.py), or takes back cache lent to it past its
     peer's share, after its step under way (server/cache_room.py).
A step whose step_id equals the previous one is a duplicate: its recorded output is the answer, not recomputed.
HistoryRequest and Retarget are the client's failover controls, answered in order with the steps; RecordsRequest
fetches the session's signed hop records (server/window_log.py), kept when the client opened it with `commit_hop`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time

import torch
from hivemind.p2p import P2PContext

from nesa_node import step_trace
from nesa_node.errors import (
    AdapterBudgetError,
    BadRequestError,
    NesaError,
    PeerUnavailableError,
    RequestError,
    StepFailedError,
    StepTimeoutError,
)
from nesa_node.protocol.channel import Channel, ChannelClosedError, Frame, frame, read
from nesa_node.protocol.framing import StreamChannel, settled
from nesa_node.protocol.messages import (
    FORWARD,
    TO_SESSION,
    AdapterBlocks,
    ErrorReply,
    ForwardRequest,
    ForwardResult,
    History,
    HistoryRequest,
    Opened,
    OpenSession,
    Records,
    RecordsRequest,
    Retarget,
    Retargeted,
    Step,
    StepResult,
    expect,
)
from nesa_node.protocol.push_tag import seal_matches, tag_of
from nesa_node.protocol.tensors import NO_CODEC, as_received, bytes_to_proto, tensor_to_proto, tensor_to_wire
from nesa_node.server.adapters import NodeAdapters
from nesa_node.server.compute import BlockCompute
from nesa_node.server.config import LimitsConfig, NetworkConfig
from nesa_node.server.push import PushSender
from nesa_node.server.sessions import END_OF_SESSION, Inbound, ServerSession, SessionTable
from nesa_node.server.window_log import WindowLog
from nesa_node.verification.receipts import RecordSigner

logger = logging.getLogger(__name__)


def _step_digest(request: Frame, step: Step) -> bytes:
    """What identifies a step's content: position, codec and the tensor bytes as sent (a retry sends the same)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(str((step.position, step.codec)).encode())
    for tensor in request.tensors:
        digest.update(str((tensor.dtype, tuple(tensor.size))).encode())
        digest.update(tensor.buffer)
    return digest.digest()


class InputRefused(BadRequestError):
    """A step refused for what it holds (its position, its tensor): its sender's doing, if the refusing node tells
    the truth. A pushed one goes back with the refusal as evidence (InferenceService._refusal)."""


class InferenceService:
    """Sessions and forwards over the node's blocks (see the module docstring)."""

    def __init__(
        self,
        sessions: SessionTable,
        compute: BlockCompute,
        push: PushSender,
        limits: LimitsConfig,
        network: NetworkConfig,
        *,
        adapters: NodeAdapters,
        metrics=None,
        signer: RecordSigner | None = None,
    ):
        self.metrics = metrics  # nesa_node.metrics.NodeMetrics, or None
        self.signer = signer  # signs hop records with the node's identity key; None: sessions asking are refused
        self.adapters = adapters
        # opens under way that hold an adapter already: (peer, a token of the open) -> (adapter id, slice bytes),
        # counted in the peer's share
        self.opening_adapters: dict[tuple[str, object], tuple[str, int]] = {}
        self.sessions = sessions
        self.compute = compute
        self.push = push
        self.limits = limits
        self.network = network

    async def injected_delay(self) -> None:
        if self.network.inject_delay_ms > 0:
            await asyncio.sleep(self.network.inject_delay_ms / 1000)

    # ---- cacheless forward ---------------------------------------------------------------------------------------

    async def forward(self, request: Frame) -> Frame:
        """Run the asked blocks on a whole sequence without a cache (positions from 0); an ErrorReply frame for
        anything refused."""
        await self.injected_delay()
        try:
            message = expect(read(request, FORWARD), ForwardRequest)
            blocks = self.compute.check_blocks(message.start_block, message.end_block)
            hidden = self.compute.read_hidden(request, message.codec, batch=None)
            output_codec = self.compute.codec(message.output_codec)
            output, seconds = await self.compute.run(hidden, None, 0, blocks)
            proto, sent_codec = tensor_to_wire(output, output_codec)
            return frame(ForwardResult(compute_s=seconds, codec=sent_codec), [proto])
        except RequestError as exc:
            return frame(ErrorReply.of(exc))

    # ---- sessions ------------------------------------------------------------------------------------------------

    async def serve_session(self, channel: StreamChannel, context: P2PContext) -> None:
        """One session stream, from its OpenSession to its end (see the module docstring)."""
        try:
            async with asyncio.timeout(self.network.peer_timeout_s):
                first = await channel.receive()
        except TimeoutError:
            return
        if first is None:
            return
        try:
            upload = None
            if isinstance(read(first, TO_SESSION), AdapterBlocks):  # the client's own adapter, then its open
                upload, first = first, await self._next_frame(channel)
                if first is None:
                    return
            settled(channel)  # the frames an open needs are in: the session limits hold it from here (_open)
            session = await self._open(first, channel, context.remote_id.to_base58(), upload)
            upload = first = None  # an adapter's bytes live in the store now, not in this frame for the session's life
        except RequestError as exc:
            channel.send(frame(ErrorReply.of(exc)))
            return
        span = self.compute.span
        session.limit_frames(channel, span.hidden_size if span is not None else 0)  # its queue: frames it can use
        reader = asyncio.create_task(self._read_stream(channel, session))
        try:
            channel.send(frame(Opened(cache_tokens_left=self.sessions.tokens_available())))
            await self._run(session)
        finally:
            reader.cancel()
            self.sessions.close(session)
            if session.key not in self.sessions.sessions:  # not opened again by its owner meanwhile
                self.compute.forget(session.key, last=not self.sessions.sessions)
            session.close_channels()  # also when the node dropped the session first (a move): a push opened since
            # the reader gone before the stream lingers: a read still waiting on the socket makes the linger's read
            # fail at once, and a stream closed with the client's steps unread resets, losing the answers not yet read
            await asyncio.wait([reader])

    async def _hold_adapter(self, message: OpenSession, blocks, upload: Frame | None, client_peer: str):
        """The session's adapter, held: sent with the open (checked by hash), resident, or fetched from peers (the
        adapter budget preempts idle sessions holding adapters to make room: NodeAdapters). A peer whose sessions
        would hold more than its share of the budget is refused (AdapterBudgetError: the client leaves this node out
        of that session's chain), for an adapter it sends or the node fetches before the adapter goes into the store
        (where making room may preempt other peers' idle sessions), and again once it is held."""
        share = self.limits.max_cache_share_per_peer * self.adapters.budget_bytes

        def admit(nbytes: int) -> None:
            # in the store's unit (NodeAdapters.weigh): what running them costs the budget, not their bytes alone;
            # the operator's preloaded adapters are held whoever uses them: in no peer's share
            preloaded = {entry.adapter_id for entry in self.adapters.store.entries() if entry.preloaded}
            if message.adapter in preloaded:
                return
            mine_open = [session for session in self.sessions.sessions.values() if session.client_peer == client_peer]
            held = [(s.adapter_id, self.adapters.weigh(s.adapter)) for s in mine_open if s.adapter is not None]
            held += [used for (peer, _), used in self.opening_adapters.items() if peer == client_peer]
            held = [(adapter_id, size) for adapter_id, size in held if adapter_id not in preloaded]
            mine: dict[str, int] = {}  # adapter id -> the most bytes of it its open sessions and opens under way hold
            for adapter_id, size in held:
                mine[adapter_id] = max(size, mine.get(adapter_id, 0))
            extra = max(0, nbytes - mine.get(message.adapter, 0))  # (a wider slice of one it holds: the rest)
            if extra and sum(mine.values()) + extra > share:
                raise AdapterBudgetError(
                    f"this peer's sessions here would hold {sum(mine.values()) + extra} bytes of adapters, over "
                    f"its share of {share:.0f} (node setting max_cache_share_per_peer, of the adapter budget)"
                )

        if upload is not None:
            sent = expect(read(upload, TO_SESSION), AdapterBlocks)
            self.compute.check_blocks(sent.start_block, sent.end_block)  # inside this node's span
            if message.adapter != sent.adapter_id or not sent.start_block <= blocks[0] < blocks[1] <= sent.end_block:
                raise BadRequestError("adapter blocks must be those of the session opened right after them")
            adapter, release = await self.adapters.hold_uploaded(sent, upload, admit=admit)
        else:
            adapter, release = await self.adapters.hold_or_fetch(message.adapter, blocks, admit=admit)
        try:  # again: other opens of this peer may have come in meanwhile, or the adapter was resident
            admit(self.adapters.weigh(adapter))
        except AdapterBudgetError:
            release()
            raise
        return adapter, release  # (the caller counts it in the peer's share before it awaits anything)

    async def _next_frame(self, channel: StreamChannel) -> Frame | None:
        try:
            async with asyncio.timeout(self.network.peer_timeout_s):
                return await channel.receive()
        except TimeoutError:
            return None

    async def _open(
        self, request: Frame, channel: Channel, client_peer: str, upload: Frame | None = None
    ) -> ServerSession:
        message = expect(read(request, TO_SESSION), OpenSession)
        if message.commit_hop is not None and self.signer is None:
            raise BadRequestError("this node signs no hop records (it has no identity key)")
        blocks = self.compute.check_blocks(message.start_block, message.end_block)
        self.compute.codec(message.output_codec)
        with self.sessions.opening(client_peer, message.session_id):  # bounded while it waits
            adapter, release, token = None, None, (client_peer, object())
            if upload is not None or message.adapter is not None:  # held (never evicted) until the session closes
                adapter, release = await self._hold_adapter(message, blocks, upload, client_peer)
                # in its share until the open ends
                self.opening_adapters[token] = (message.adapter, self.adapters.weigh(adapter))
            try:
                if adapter is not None:  # the node may have begun moving while the adapter came
                    self.compute.check_blocks(message.start_block, message.end_block)
                session = await self.sessions.open_when_room(
                    message, client_peer=client_peer, blocks=blocks, cache=self.compute.span.new_cache(), reply=channel
                )
            except BaseException:
                if release is not None:
                    release()
                raise
            finally:  # a session now, or released
                self.opening_adapters.pop(token, None)
        session.adapter, session.release_adapter = adapter, release
        session.adapter_id = message.adapter if adapter is not None else None
        session.push_key = bytes.fromhex(message.push_key) if message.push_key is not None else None
        if message.commit_hop is not None:
            session.window_log = WindowLog(
                self.signer,
                session_id=message.session_id,
                hop=message.commit_hop,
                blocks=blocks,
                hidden_size=self.compute.span.hidden_size,
                weights_hash=self.compute.span.weights_hash,
                adapter_hash=message.adapter or "",
                codec=session.output_codec.name,
            )
        return session

    async def _read_stream(self, channel: StreamChannel, session: ServerSession) -> None:
        """The client's frames into the session's queue, in order (a malformed one too: it is answered in order)."""
        try:
            while (request := await channel.receive()) is not None:
                try:
                    item = Inbound(request, read(request, TO_SESSION), client_stream=True)
                except RequestError as exc:
                    item = Inbound(request, error=exc, client_stream=True)
                await self.sessions.admit(session, item, sender=None, wait=True)
        except RequestError as exc:  # a frame over the limit, or not a frame: refused, and the stream ends
            logger.debug("session %s: stream refused: %s", session.session_id, exc)
            channel.refuse(exc)
        except Exception as exc:  # the client went away: a normal event
            logger.debug("stream of session %s ended: %r", session.session_id, exc)
        session.inbox.put_nowait(END_OF_SESSION)  # not when cancelled: the session is over already

    async def _run(self, session: ServerSession) -> None:
        """Take the session's queue in order until it ends."""
        while True:
            if session.revoked is not None:  # its lent cache taken back (server/cache_room.py): ends between steps
                self.sessions.end(session, session.revoked)
                return
            # counted from the open or the last step done: refused steps do not keep a session alive
            limit_s = self.limits.session_timeout_s if session.last_step_id else self.limits.first_step_timeout_s
            left_s = self._left_s(session, limit_s)
            try:
                if left_s <= 0:  # also with items queued: duplicates and refused steps, kept coming, keep nothing
                    raise TimeoutError
                if session.inbox.empty():  # asyncio.timeout: no task per step, unlike wait_for
                    async with asyncio.timeout_at(asyncio.get_running_loop().time() + left_s):
                        item = await session.inbox.get()
                else:
                    item = session.inbox.get_nowait()
            except TimeoutError:
                logger.info("session %s: no step done for %.0f s, closing", session.session_id, limit_s)
                return
            if item is END_OF_SESSION:
                return
            if item.from_peer:
                session.room.release()
            elif item.frame is None:
                session.reports_queued -= 1
            step_id = item.message.step_id if isinstance(item.message, Step) else None
            session.busy = True
            try:
                if item.error is not None:
                    raise item.error
                if isinstance(item.message, HistoryRequest | Retarget | RecordsRequest):
                    await self._answer(session.reply, self._control(session, item.message))
                    continue
                position = session.position
                if not await self._step(session, item.frame, expect(item.message, Step), pushed=not item.client_stream):
                    return  # a step not done within the step timeout: the session is closed
                if session.position != position:
                    # only a step that advanced the session keeps it alive: a duplicate answered from its record
                    # (a retry) costs nothing, and resent every few seconds would hold the cache for ever
                    session.refused_in_a_row = 0
                    session.last_active = time.monotonic()
            except ChannelClosedError:  # the client's stream is gone, or it stopped reading: so is the session
                return
            except NesaError as exc:
                if item.from_peer:  # a report of the next node's (item.frame None) is no refusal of this session's
                    session.refused_in_a_row += 1
                replies = [self._refusal(exc, step_id, item, session)]
                if session.refused_in_a_row >= self.limits.max_step_errors:
                    refusal = BadRequestError(f"{session.refused_in_a_row} refused steps in a row; session closed")
                    replies.append(ErrorReply.of(refusal))
                try:
                    for reply in replies:
                        await self._answer(session.reply, reply if isinstance(reply, Frame) else frame(reply))
                except ChannelClosedError:
                    return
                if len(replies) > 1:
                    return
            except Exception as exc:  # the blocks' own error (out of device memory, say): the session ends, said so
                logger.warning("session %s: step %s failed, session ended: %r", session.session_id, step_id, exc)
                failed = StepFailedError(f"the node failed the step: {type(exc).__name__}: {str(exc)[:200]}")
                with contextlib.suppress(ChannelClosedError):
                    await self._answer(session.reply, frame(ErrorReply.of(failed, step_id)))
                return
            finally:
                session.busy = False

    def _refusal(
        self, error: NesaError, step_id: str | None, item: Inbound, session: ServerSession
    ) -> ErrorReply | Frame:
        """The refusal of a queue item; a tagged step its previous node pushed, refused for what it holds
        (InputRefused), goes back with it as evidence (protocol/push_tag.py), when no larger than the session's
        whole input could be (so the client can read it)."""
        reply = ErrorReply.of(error, step_id)
        step = item.message
        if isinstance(error, InputRefused) and isinstance(step, Step) and step.tag is not None:
            span = self.compute.span
            bound = session.batch * session.max_length * (span.hidden_size if span is not None else 0) * 4
            if item.frame is not None and len(item.frame.tensors) == 1 and len(item.frame.tensors[0].buffer) <= bound:
                return frame(reply.model_copy(update={"evidence": step}), [item.frame.tensors[0]])
        return reply

    @staticmethod
    def _left_s(session: ServerSession, limit_s: float) -> float:
        return max(0.0, session.last_active + limit_s - time.monotonic())

    async def _answer(self, channel: Channel, answer: Frame) -> None:
        """Send `answer` and wait until it has left: a client that stops reading cannot make the node buffer its
        answers without bound. ChannelClosedError when the channel is gone or stays full for step_timeout_s."""
        channel.send(answer)
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                await channel.drain()
        except TimeoutError:
            channel.abort()  # what it did not read is dropped, not kept for it
            raise ChannelClosedError(f"the peer read nothing for {self.limits.step_timeout_s} s") from None

    async def _step(self, session: ServerSession, request: Frame, step: Step, *, pushed: bool) -> bool:
        """Compute a step and hand its output on; False when it missed the step timeout (the session ends). The
        step's counters are taken once its output has left: nothing down the chain waits for them."""
        pushing = False  # whether the step's time ran out handing it on (the next node did not take it)
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                step_trace.mark("compute")
                output, seconds = await self._compute_step(session, request, step, pushed)
                step_trace.mark("computed", int(seconds * 1e6))
                # lossless where the session's codec cannot carry these values (beyond fp16's range)
                proto, sent_codec = tensor_to_wire(output, session.output_codec)
                tensors = [proto]
                if session.outputs and session.outputs[-1] is output:
                    # kept as the next node decodes it: a replacement of that node rebuilds exactly its cache
                    session.outputs[-1] = as_received(output, proto, sent_codec)
                compute_s = seconds + step.compute_s  # this node's and those before it
                if not step.replay and session.next_peer is not None:
                    push_started, pushing = time.perf_counter(), True
                    try:
                        position = session.last_position  # of this step, also when it was a duplicate
                        key = session.push_key  # a tag: evidence of what it pushed, should the next node refuse it
                        seals = step.seals[1:] if _sealed(session, pushed) else step.seals  # its own taken off
                        tag = (
                            None if key is None else tag_of(key, step.step_id, position, sent_codec, tensors[0], seals)
                        )
                        out = Step(
                            step_id=step.step_id,
                            position=position,
                            codec=sent_codec,
                            compute_s=compute_s,
                            session_id=session.session_id,
                            owner=session.client_peer,
                            tag=tag,
                            **({"seals": seals} if seals else {}),
                        )
                        await self.push.push(session, out, tensors)
                    finally:
                        if self.metrics is not None:
                            self._count_step(session, request, step, tensors, seconds, output.shape[1])
                    if self.metrics is not None:
                        self.metrics.push_duration_seconds.observe(time.perf_counter() - push_started)
                    return True
        except TimeoutError:
            logger.info("session %s: step over %.1f s, closing", session.session_id, self.limits.step_timeout_s)
            timeout_s = self.limits.step_timeout_s
            # the client replaces the node this names: the next one when it did not take the step, else this one
            error = (
                PeerUnavailableError(
                    f"next node {session.next_peer} did not take the step within this node's step timeout of "
                    f"{timeout_s} s; session closed"
                )
                if pushing
                else StepTimeoutError(f"step not done within this node's step timeout of {timeout_s} s; session closed")
            )
            with contextlib.suppress(ChannelClosedError):
                session.reply.send(frame(ErrorReply.of(error, step.step_id)))
            return False
        result = StepResult(
            step_id=step.step_id,
            position=session.last_position,
            compute_s=compute_s,
            codec=sent_codec,
            replayed=step.replay,
        )
        try:
            if step.replay:  # rebuilding this node's cache after a failover: the output goes back to the client
                await self._answer(session.reply, frame(result, tensors))
            else:  # the last node of the chain
                await self._send_output(session, frame(result, tensors))
        finally:
            if self.metrics is not None:
                self._count_step(session, request, step, tensors, seconds, output.shape[1])
        return True

    def _count_step(
        self, session: ServerSession, request: Frame, step: Step, outputs: list, seconds: float, tokens: int
    ) -> None:
        metrics = self.metrics
        if step.replay:
            metrics.replayed_steps_total.inc()
        elif seconds > 0:  # a duplicate is answered from its record, not computed
            metrics.step_duration_seconds.labels("prefill" if tokens > 1 else "decode").observe(seconds)
        received = sum(len(tensor.buffer) for tensor in request.tensors)
        metrics.wire_bytes_total.labels("in", step.codec.name).inc(received)
        sent = sum(len(tensor.buffer) for tensor in outputs)
        metrics.wire_bytes_total.labels("out", session.output_codec.name).inc(sent)

    async def _send_output(self, session: ServerSession, output: Frame) -> None:
        """A last node's output: on the client's output lane when it has one, else on the session's stream."""
        if session.output is not None:
            try:
                await self._answer(session.output, output)
                return
            except PeerUnavailableError:
                session.output = None
        await self._answer(session.reply, output)

    async def _compute_step(
        self, session: ServerSession, request: Frame, step: Step, pushed: bool
    ) -> tuple[torch.Tensor, float]:
        await self.injected_delay()
        digest = _step_digest(request, step)
        if step.step_id == session.last_step_id and session.last_output is not None:
            # A new upstream (a replacement of the previous node, since retargeted) resends a step this node already
            # took from the old one: it recomputed it from a cache rebuilt by replay, so its values may differ from
            # the old node's in the last bits. The recorded output stays the answer: it is what this node's cache
            # holds. From the same upstream, other content under a used id is refused.
            if digest != session.last_digest and session.last_upstream == session.upstream_peer:
                raise BadRequestError(f"step id {step.step_id!r} was already used for different content")
            _check_seal(session, step, session.last_output.shape[1], pushed)  # its seals are pushed on again
            return session.last_output, 0.0  # a duplicate delivery (a retry): same output, computed once
        if step.position != session.position:
            raise InputRefused(f"step at position {step.position}, but the session's cache holds {session.position}")
        try:
            hidden = self.compute.read_hidden(request, step.codec, batch=session.batch)
        except BadRequestError as refused:  # (a pushed one goes back as evidence: _refusal)
            raise InputRefused(refused.message) from None
        _check_seal(session, step, hidden.shape[1], pushed)
        if step.position + hidden.shape[1] > session.max_length:
            raise BadRequestError(
                f"step would reach {step.position + hidden.shape[1]} tokens, over the session's max_length "
                f"{session.max_length}"
            )
        session.computing = True  # not idle while it waits for room and computes (sessions may be preempted)
        try:
            await self.sessions.grow(session, step.position + hidden.shape[1])  # the cache it is about to hold
            session.cache.reserve(session.reserved_tokens)  # its buffers grow to what the budget holds for it
            output, seconds = await self.compute.run_decode(
                hidden, session.cache, step.position, session.blocks, session.adapter, member=session.key
            )
        finally:
            session.computing = False
        output = _alone(output)  # kept below: not a view holding the whole pass's output alive
        session.last_position = step.position
        session.position += hidden.shape[1]
        session.last_active = time.monotonic()  # an advancing step (its hand-on, however long, is not idleness)
        if session.next_peer is not None:  # kept for a replacement of the next node (see _control, history)
            session.outputs.append(output)
        session.last_step_id, session.last_output, session.last_digest = step.step_id, output, digest
        session.last_upstream = session.upstream_peer
        if session.window_log is not None:
            session.window_log.add(step.position, hidden, output)
        return output, seconds

    def _control(self, session: ServerSession, message: HistoryRequest | Retarget | RecordsRequest) -> Frame:
        """Session control from the client, in order with its steps (failover of a neighbouring node): a history
        request returns this node's outputs for the first `position` tokens (lossless, each as the next node decoded
        it), so a replacement for the next span can rebuild its cache; a retarget points the node at a new next node
        and/or upstream, each when given."""
        if isinstance(message, RecordsRequest):
            if session.window_log is None:
                raise BadRequestError("this session was opened without hop records (commit_hop)")
            records = session.window_log.take(final=message.final)
            tensors = [bytes_to_proto(self.signer.public_key)] + [bytes_to_proto(r.to_bytes()) for r in records]
            return frame(Records(count=len(records)), tensors)
        if isinstance(message, HistoryRequest):
            kept = sum(output.shape[1] for output in session.outputs)  # tokens; only nodes with a next node keep any
            if not message.position <= kept:
                raise BadRequestError(f"history position {message.position} outside 1..{kept} (the outputs kept)")
            history = torch.cat(session.outputs, dim=1)[:, : message.position]  # (batch, position, hidden)
            return frame(History(position=message.position), [tensor_to_proto(history)])
        given = message.model_fields_set
        # checked before anything changes: a codec this node does not take refuses the whole retarget ("none"
        # travels as null: given, it is the codec named)
        output_codec = self.compute.codec(message.output_codec or NO_CODEC) if "output_codec" in given else None
        if message.upstream is not None:
            # a replaced upstream, or the same node opened again: either resends the last step recomputed from a
            # replayed cache (see _compute_step), its content may differ in the last bits
            session.upstream_peer = message.upstream
            session.last_upstream = None
        if "next" in given:
            session.end_downstream()
            session.next_peer = message.next
            session.lane_next = None  # unless the retarget names the new next node's lane
        session.apply_lane_settings(message.lane)
        if output_codec is not None:
            session.output_codec = output_codec
        return frame(Retargeted())


def _sealed(session: ServerSession, pushed: bool) -> bool:
    """Whether a step that did not come on the client's own session stream (`pushed`: on a push stream, a data lane
    or a one-shot push) came from the previous node of a direct chain whose client seals its steps
    (protocol/push_tag.py), and so must carry this node's seal first."""
    return pushed and session.push_key is not None and session.upstream_peer != session.client_peer


def _check_seal(session: ServerSession, step: Step, tokens: int, pushed: bool) -> None:
    """InputRefused unless a pushed step carries the client's seal of its position and `tokens` tokens a row, and
    of the seals after it: a previous node adding or dropping tokens, or altering a later node's seal, is refused
    here, its own tag on what it pushed (the refusal's evidence) showing the client it was its doing."""
    if _sealed(session, pushed) and not seal_matches(session.push_key, step, tokens):
        raise InputRefused(
            f"the pushed step at position {step.position} with {tokens} tokens a row does not carry the client's "
            "seal of it (a step of other tokens than the client sent, or altered seals)"
        )


def _alone(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in a storage of its own: a session's part of a batched pass is a view of the pass's whole output,
    which a session keeping its outputs (for a replacement of its next node, for its audit windows) would hold alive,
    16 sessions' worth for each kept step of a pass of 16."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


__all__ = ["InferenceService"]

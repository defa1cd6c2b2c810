"""The links of one inference session, and everything said on them: opening a segment of the chain (a stream per node,
acknowledged), the client's own data lanes, one queue of every node's answers, control messages and their answers,
replaying a history into replacement nodes, closing. The session (client/session.py) and its failover
(client/failover.py) both work through this object and nothing else of each other.

What a node sends is bounded before it is read: a frame no longer than the session's largest honest answer
(`answer_frame_bytes`), and at most MAX_QUEUED_ANSWERS answers (2 frames' worth of bytes) waiting per node. A node past
either is failed like a dead one: banned, its span re-routed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from nesa_node.client.chain_links import ChainLink, LinkFailed, link_ended, stale_report
from nesa_node.client.codec_choice import AUTO_ELEMENTS, codec_for
from nesa_node.client.config import ClientConfig
from nesa_node.client.swarm import Swarm
from nesa_node.compression.codec import all_finite
from nesa_node.errors import BadRequestError, NesaError, PeerUnavailableError, ReceiptError, RequestError
from nesa_node.protocol import lane, push_tag, rpc
from nesa_node.protocol.channel import Channel, Frame, LaneChannel, frame, is_error_reply, read
from nesa_node.protocol.framing import open_stream
from nesa_node.protocol.lane import CLIENT_MAX_FRAME_BYTES
from nesa_node.protocol.messages import (
    FROM_SESSION,
    MAX_METADATA_BYTES,
    AdapterBlocks,
    ErrorReply,
    History,
    HistoryRequest,
    LaneSettings,
    Message,
    Opened,
    OpenSession,
    Records,
    RecordsRequest,
    Retarget,
    Retargeted,
    Step,
    StepResult,
)
from nesa_node.protocol.tensors import (
    NO_CODEC,
    WireCodec,
    bytes_from_proto,
    bytes_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from nesa_node.routing.chain import Hop
from nesa_node.sharding.lora import AdapterManifest
from nesa_node.verification.commitment import WINDOW_TOKENS
from nesa_node.verification.receipts import MAX_RECORD_BYTES, HopRecord, key_peer_id, verify_record

logger = logging.getLogger(__name__)

REPLAY_CHUNK_TOKENS = 1024  # history replayed per message, rows x tokens: well under a node's max_tokens_per_step
MAX_HIDDEN = 1 << 16  # widest hidden state accepted in a replayed history, elements
ANSWER_HEADROOM_BYTES = MAX_METADATA_BYTES + 4096  # the message and protobuf framing around an answer's tensor
MAX_QUEUED_ANSWERS = 64  # an honest node has a few outstanding (a result, an error report): past this, unasked for
MAX_KEY_BYTES = 2048  # a node's DER public key (RSA up to 8192 bits is ~1.1 KB)
LANE_END_GRACE_S = 0.25  # guess: its stream's last words come within it on any link a step can take


def answer_frame_bytes(batch: int, max_length: int, hidden_size: int) -> int:
    """The longest frame an honest node sends in a session, bytes: hidden states of the session's whole length in
    float32 (a prompt step, or a history for replay; every codec is at most 4 bytes an element), and its message."""
    return min(CLIENT_MAX_FRAME_BYTES, batch * max_length * hidden_size * 4 + ANSWER_HEADROOM_BYTES)


@dataclass(frozen=True)
class OwnAdapter:
    """A LoRA adapter the client holds whole (a folder it named): its manifest and every block's canonical bytes,
    sent to a node that does not announce it, right before the session's open (messages.AdapterBlocks)."""

    manifest: AdapterManifest
    blobs: tuple[bytes, ...]  # one per block of the model

    @property
    def adapter_id(self) -> str:
        return self.manifest.adapter_id

    @property
    def block_bytes(self) -> float:
        """Mean bytes per block: what sending a span costs routing, per block."""
        return sum(len(blob) for blob in self.blobs) / max(len(self.blobs), 1)

    def blocks_frame(self, start: int, end: int) -> Frame:
        tensors = [bytes_to_proto(self.manifest.to_bytes()), *(bytes_to_proto(blob) for blob in self.blobs[start:end])]
        return frame(AdapterBlocks(adapter_id=self.adapter_id, start_block=start, end_block=end), tensors)


@dataclass(frozen=True)
class Deadline:
    """One bound for an exchange of several answers, `seconds` from its start (`after`): a node that keeps sending
    answers nobody waits for (other steps, stale reports) cannot keep the wait for the awaited one open past it."""

    seconds: float
    at: float  # the event loop's time

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(seconds, asyncio.get_running_loop().time() + seconds)

    def left(self) -> float:
        return max(0.0, self.at - asyncio.get_running_loop().time())


class SessionChain:
    """The links of session `session_id` and the queue of their answers."""

    def __init__(
        self,
        swarm: Swarm,
        config: ClientConfig,
        *,
        session_id: str,
        batch: int,
        max_length: int,
        adapter: str | None = None,
        own_adapter: OwnAdapter | None = None,
        adapter_block_bytes: float = 0.0,
        commit: bool = False,
        hidden_size: int | None = None,
    ):
        self.swarm = swarm
        self.config = config
        self.commit = commit  # nodes sign a hop record per window (server/window_log.py), fetched with `records`
        self.session_id = session_id
        self.batch = batch
        self.max_length = max_length
        self.adapter = adapter  # the LoRA adapter id every node of the chain runs the session with
        self.own_adapter = own_adapter  # the adapter's blocks, when the client has them: sent to nodes lacking it
        self.adapter_block_bytes = adapter_block_bytes  # what a node lacking it must get, per block (routing)
        self.direct = config.mode == "direct"
        # direct mode: hidden states go over data lanes where nodes offer them, else over libp2p
        self.lanes = config.lanes and self.direct
        self.links: list[ChainLink] = []
        self.answers: asyncio.Queue = asyncio.Queue()  # (link, frame or exception), from every channel
        # the model's hidden size, given by a client that knows its model, else learnt from the first answer checked
        # against a shape the client sent; until then frames are bounded for the widest hidden state accepted
        self.hidden_size: int | None = None
        self.output_codecs: dict[str, str] = {}  # peer id -> the codec its outputs are sent with
        self.push_codecs: dict[str, WireCodec] = {}  # peer id -> that codec with its parameters, as opened
        self.recoded: set[str] = set()  # peer ids whose output codec a retarget changed mid-session
        self.max_answer_bytes = answer_frame_bytes(batch, max_length, MAX_HIDDEN)
        if hidden_size is not None:
            self._learn_hidden_size(hidden_size)

    @property
    def hops(self) -> tuple[Hop, ...]:
        return tuple(link.hop for link in self.links)

    # ---- opening -----------------------------------------------------------------------------------------------------

    def push_codec(self, hop: Hop, receiver: Hop | None) -> WireCodec:
        """The codec `hop`'s node sends its outputs to `receiver` with (None: the client), chosen for a one-token
        step, the message a session sends most."""
        return codec_for(
            hop,
            receiver,
            self.config.compression,
            elements=self.batch * (self.hidden_size or AUTO_ELEMENTS),
            bandwidth_mbps=self.swarm.bandwidth_mbps(hop.peer_id, receiver.peer_id if receiver else None),
            lossless_bits=self.swarm.answer_bits(hop.peer_id),
        )

    def _open_message(
        self,
        index: int,
        hops: tuple[Hop, ...],
        upstream: str,
        downstream: Hop | None,
        lane_settings: LaneSettings | None,
    ) -> OpenSession:
        # who decodes this node's output: the next node in a direct chain, else the client
        receiver = (hops[index + 1] if index + 1 < len(hops) else downstream) if self.direct else None
        hop = hops[index]
        output_codec = self.push_codec(hop, receiver)
        self.output_codecs[hop.peer_id] = output_codec.name
        self.push_codecs[hop.peer_id] = output_codec
        return OpenSession(
            session_id=self.session_id,
            start_block=hop.start_block,
            end_block=hop.end_block,
            batch=self.batch,
            max_length=self.max_length,
            upstream=(hops[index - 1].peer_id if index > 0 else upstream) if self.direct else self.swarm.peer_id,
            next=receiver.peer_id if receiver is not None else None,
            output_codec=output_codec,
            lane=lane_settings,
            adapter=self.adapter,
            # the hop's place in the whole chain: the links before this segment's first block, then its index
            commit_hop=self._hops_before(hops[0]) + index if self.commit else None,
        )

    def _hops_before(self, hop: Hop) -> int:
        return sum(1 for link in self.links if link.hop.end_block <= hop.start_block)

    def _lane_settings(self, links: list[ChainLink], downstream: ChainLink | None) -> list[LaneSettings | None]:
        """Each link's lane settings for its open message: keys of the links into and out of the node, the next
        node's lane address. A segment's end links take the keys of their neighbours' links (`downstream`: the
        node after the segment; at the chain's end, the client)."""
        if not self.lanes:
            return [None] * len(links)
        for index, link in enumerate(links[1:], start=1):
            link.key_in = links[index - 1].key_out
        settings = []
        for index, link in enumerate(links):
            receiver = links[index + 1].hop if index + 1 < len(links) else downstream.hop if downstream else None
            next_lane = self.swarm.lane_address(receiver.peer_id) if receiver is not None else None
            settings.append(LaneSettings(key_in=link.key_in.hex(), key_out=link.key_out.hex(), next=next_lane))
        return settings

    async def open_segment(self, hops: tuple[Hop, ...], upstream: str, downstream: ChainLink | None) -> list[ChainLink]:
        """Open a session stream on each hop (a chain segment between `upstream` and `downstream`, None: the
        client) and wait for every acknowledgement. The segment's outer lane keys are fresh: a replaced segment's
        neighbours get them by retarget, so a node that was dropped holds no key still in use. Raises LinkFailed
        naming the node that failed, or the RequestError a node refused with (its `peer_id` set)."""
        links = [ChainLink(hop) for hop in hops]
        settings = self._lane_settings(links, downstream)
        timeout_s = self.swarm.request_timeout_s

        async def open_control(link: ChainLink) -> None:
            async with asyncio.timeout(timeout_s):
                link.control = await open_stream(
                    self.swarm.p2p, link.peer_id, rpc.INFERENCE, max_frame_bytes=self.max_answer_bytes
                )

        # the streams open together (one round trip to the nodes, not one per node); the opens go out in chain order
        try:
            opened = await asyncio.gather(*(open_control(link) for link in links), return_exceptions=True)
        except BaseException:  # cancelled meanwhile: the streams already open are closed
            self.close_links(links)
            raise
        for link, outcome in zip(links, opened, strict=True):
            if isinstance(outcome, BaseException):
                self.close_links(links)
                if not isinstance(outcome, Exception):
                    raise outcome  # a cancellation, not the node's failure
                raise LinkFailed(f"could not open a session on {link.peer_id}: {outcome!r}", link) from None
        for index, link in enumerate(links):
            message = self._open_message(index, hops, upstream, downstream.hop if downstream else None, settings[index])
            if self.direct:  # it tags what it pushes and checks the seals of what it is pushed (protocol/push_tag.py)
                message = message.model_copy(update={"push_key": link.push_key.hex()})
            if self.own_adapter is not None and not self.swarm.holds_adapter(link.peer_id, self.own_adapter.adapter_id):
                # the node's whole span where its record says it: its other sessions on part of it can share them
                start, end = self.swarm.span_of(link.peer_id) or (link.hop.start_block, link.hop.end_block)
                link.send(self.own_adapter.blocks_frame(start, end))
            link.send(frame(message))
            link.readers.append(asyncio.create_task(self._read(link, link.control, "the session")))
        # every node acknowledges the open (cache reserved) or refuses it with a typed error
        pending = {id(link): link for link in links}
        until = Deadline.after(timeout_s)  # for the whole exchange: answers nobody waits for do not extend it
        try:
            while pending:
                try:
                    answered, message, _ = await self.next_answer(until)
                except LinkFailed as silent:
                    if silent.link is not None:
                        raise
                    # a node that took the stream but never answered the open has failed for this session: name it,
                    # so the caller bans it and opens on another chain
                    unanswered = next(iter(pending.values()))
                    raise LinkFailed(
                        f"{silent.message}: node {unanswered.peer_id} did not acknowledge the open", unanswered
                    ) from None
                if stale_report(answered, message, links):
                    continue
                if isinstance(message, ErrorReply):
                    refusal = message.error()
                    refusal.peer_id = answered.peer_id  # who refused: the caller may route around it
                    raise refusal
                if isinstance(message, Opened):
                    pending.pop(id(answered), None)
        except BaseException:
            self.close_links(links)
            raise
        return links

    async def connect_client_lanes(self) -> None:
        """The client's own lanes: steps to the first node, outputs from the last. A node without a lane, or one
        that cannot be reached on it, is spoken to over its session stream instead."""
        if not self.lanes:
            return
        first, last = self.links[0], self.links[-1]

        async def steps_lane() -> None:
            if first.steps is None:
                first.steps = await self._connect_lane(first, lane.ROLE_SEND, first.key_in)

        async def outputs_lane() -> None:
            if last.outputs is None:
                last.outputs = await self._connect_lane(last, lane.ROLE_RECEIVE, last.key_out)

        await asyncio.gather(steps_lane(), outputs_lane())  # both at once: one round trip

    async def _connect_lane(self, link: ChainLink, role: int, key: bytes) -> Channel | None:
        address = self.swarm.lane_address(link.peer_id)
        if address is None:
            return None
        try:
            async with asyncio.timeout(self.swarm.request_timeout_s):
                stream = await lane.connect(address, role, self.session_id, key, max_frame_bytes=self.max_answer_bytes)
        except (lane.LaneClosedError, TimeoutError) as exc:
            logger.info("no data lane to %s (%s); its steps go over libp2p", link.peer_id, exc)
            return None
        channel = LaneChannel(stream, "answer on a data lane")
        link.readers.append(asyncio.create_task(self._read(link, channel, "the data lane")))
        return channel

    async def _read(self, link: ChainLink, channel: Channel, what: str) -> None:
        try:
            while (received := await channel.receive()) is not None:
                self._queue_answer(link, received, channel)
            failure = PeerUnavailableError(f"node {link.peer_id} closed {what}")
        except Exception as exc:  # a channel that fails is a node that fails, whatever the reason
            message = exc.message if isinstance(exc, NesaError) else repr(exc)
            failure = PeerUnavailableError(f"{what} of {link.peer_id} failed: {message}")
        if channel is not link.control:  # a node ending the session says why on its stream: a lane's end waits for it
            await asyncio.sleep(LANE_END_GRACE_S)
        self.answers.put_nowait((link, failure))

    def _queue_answer(self, link: ChainLink, received: Frame, channel: Channel) -> None:
        """Queue a node's answer for `next_answer`; PeerUnavailableError (the channel closed) when the node already
        has MAX_QUEUED_ANSWERS, or two frames' worth of bytes, waiting: it floods the client."""
        size = received.ByteSize()
        if link.queued_answers >= MAX_QUEUED_ANSWERS or link.queued_bytes + size > 2 * self.max_answer_bytes:
            channel.close()
            raise PeerUnavailableError(
                f"{link.queued_answers} answers ({link.queued_bytes + size} bytes) unread: it sent what nobody asked for"
            )
        link.queued_answers += 1
        link.queued_bytes += size
        if is_error_reply(received):
            link.said = received
        self.answers.put_nowait((link, received))

    @staticmethod
    def said(link: ChainLink) -> tuple[Message, Frame] | None:
        """The refusal `link`'s node sent last, read (None: none, or malformed): why it closed a channel."""
        try:
            return (read(link.said, FROM_SESSION), link.said) if link.said is not None else None
        except RequestError:
            return None

    def _learn_hidden_size(self, hidden_size: int) -> None:
        """Bound every later frame by the model's own hidden size, on the channels open and those opened later."""
        if self.hidden_size is not None:
            return
        self.hidden_size = hidden_size
        self.max_answer_bytes = min(self.max_answer_bytes, answer_frame_bytes(self.batch, self.max_length, hidden_size))
        for link in self.links:
            for channel in (link.control, link.steps, link.outputs):
                if channel is not None:
                    channel.max_frame_bytes = self.max_answer_bytes

    # ---- answers -----------------------------------------------------------------------------------------------------

    async def next_answer(self, within: float | Deadline) -> tuple[ChainLink, Message, Frame]:
        """The next answer from any link still open: (link, message, frame). LinkFailed when a link's channel broke,
        a node sent something malformed, or nothing came `within` (seconds, or an exchange's Deadline; link None)."""
        deadline = within if isinstance(within, Deadline) else Deadline.after(within)
        while True:
            try:
                async with asyncio.timeout(deadline.left()):  # no task per step, unlike wait_for
                    link, item = await self.answers.get()
            except TimeoutError:
                raise LinkFailed(f"no answer from the chain within {deadline.seconds} s", None) from None
            if not isinstance(item, BaseException):
                link.queued_answers -= 1
                link.queued_bytes -= item.ByteSize()
                if item is link.said:
                    link.said = None  # read in turn: only one still unread explains a channel closing
            if link.closed:
                continue  # a link closed by failover: its last words no longer matter
            if isinstance(item, BaseException):
                message = item.message if isinstance(item, NesaError) else repr(item)
                raise LinkFailed(f"stream to {link.peer_id} failed: {message}", link)
            try:
                return link, read(item, FROM_SESSION), item
            except RequestError as exc:
                raise LinkFailed(
                    f"node {link.peer_id} sent a malformed answer: {exc.message}", link, fault=True
                ) from None

    def read_hidden(
        self,
        link: ChainLink,
        answer: Frame,
        codec: WireCodec,
        max_elements: int,
        shape: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """The hidden states of a node's answer; LinkFailed (the node is failed: banned, its span re-routed) when they
        are not one well-formed tensor of exactly `shape` (when given), in the dtype the node announces, with every
        value finite."""
        if len(answer.tensors) != 1:
            raise LinkFailed(f"node {link.peer_id} sent a malformed answer", link, fault=True)
        try:
            hidden = tensor_from_proto(
                answer.tensors[0],
                allowed_dtypes=self.swarm.answer_dtypes(link.peer_id),
                max_elements=max_elements,
                rank=3,
                codec=codec,
            )
        except RequestError as exc:
            raise LinkFailed(
                f"node {link.peer_id} sent malformed hidden states: {exc.message}", link, fault=True
            ) from None
        if shape is not None and tuple(hidden.shape) != tuple(shape):
            raise LinkFailed(
                f"node {link.peer_id} sent hidden states of shape {tuple(hidden.shape)}, expected {tuple(shape)}",
                link,
                fault=True,
            )
        if not all_finite(hidden):
            raise LinkFailed(f"node {link.peer_id} sent hidden states with NaN or infinite values", link, fault=True)
        if shape is not None:
            self._learn_hidden_size(shape[-1])
        return hidden

    def pushed_malformed(
        self, pusher: ChainLink, refusal: ErrorReply, answer: Frame, *, expected: Step, shape: tuple
    ) -> bool | None:
        """What a refusal's evidence (protocol/push_tag.py) shows of the step `pusher` pushed, which should have been
        `expected` (its id and position) holding hidden states of `shape`: True when malformed (another position,
        codec than the session's, dtype, shape; values not finite); False when well formed (its seals are for the
        caller to weigh); None when there is no evidence under `pusher`'s tag (for Failover.judge to weigh)."""
        step = refusal.evidence
        if step is None or step.step_id != expected.step_id or len(answer.tensors) != 1:
            return None
        if not push_tag.tag_matches(pusher.push_key, step, answer.tensors[0]):
            return None
        if step.position != expected.position:
            return True
        if step.codec != self.push_codecs.get(pusher.peer_id, step.codec):
            return True
        batch, tokens, width = shape
        try:
            hidden = self.read_hidden(pusher, answer, step.codec, max(tokens, 1) * batch * MAX_HIDDEN)
        except LinkFailed:
            return True
        return tuple(hidden.shape) != tuple(shape)  # tokens too: the pusher's own input was sealed with the step's

    # ---- control -----------------------------------------------------------------------------------------------------

    async def history(self, link: ChainLink, position: int) -> torch.Tensor:
        """The outputs `link`'s node kept for the first `position` tokens (batch, position, hidden), lossless."""
        link.send(frame(HistoryRequest(position=position)))
        _, answer = await self._control_answer(link, History)
        # of the session's exact shape once a step showed its width: a history that is not would make every honest
        # replacement refuse the replay (each banned in turn) while its sender went on unblamed
        shape = None if self.hidden_size is None else (self.batch, position, self.hidden_size)
        return self.read_hidden(link, answer, NO_CODEC, position * self.batch * MAX_HIDDEN, shape)

    async def records(
        self, link: ChainLink, final: bool = False, *, position: int | None = None
    ) -> tuple[bytes, list[HopRecord]]:
        """The node's public key (DER) and its signed hop records of this session not fetched yet (`final`: the window
        under way closed first). ReceiptError (its `peer_id` set) for a key that is not the node's, or a record that is
        malformed, not signed by it, not of this session and the node's blocks, or not of a window of the tokens the
        session holds (`position`: how many)."""
        link.send(frame(RecordsRequest(final=final)))
        message, answer = await self._control_answer(link, Records)
        try:
            if len(answer.tensors) != message.count + 1:
                raise ReceiptError(f"{message.count} records announced, {len(answer.tensors) - 1} sent")
            der = bytes_from_proto(answer.tensors[0], max_bytes=MAX_KEY_BYTES)
            if key_peer_id(der) != link.peer_id:
                raise ReceiptError("the public key sent is not the node's own")
            records = []
            for tensor in answer.tensors[1:]:
                record = HopRecord.from_bytes(bytes_from_proto(tensor, max_bytes=MAX_RECORD_BYTES))
                failed = verify_record(record, der)
                if failed is not None:
                    raise ReceiptError(f"a record fails its {failed[0]} check: {failed[1]}")
                blocks = (record.span_start, record.span_end)
                if record.session_id != self.session_id or blocks != (link.hop.start_block, link.hop.end_block):
                    raise ReceiptError(f"a record of session {record.session_id} blocks {blocks}, not this hop's")
                first = record.window * WINDOW_TOKENS
                last = first + WINDOW_TOKENS if position is None else min(first + WINDOW_TOKENS, position)
                if not first <= record.token_start < record.token_end <= last:
                    raise ReceiptError(
                        f"a record of window {record.window} says tokens {record.token_start}:{record.token_end}, "
                        f"not within {first}:{last}"
                    )
                records.append(record)
        except (ReceiptError, BadRequestError) as error:
            refusal = ReceiptError(f"{link.peer_id}: {error.message}")
            refusal.peer_id = link.peer_id
            raise refusal from None
        return der, records

    async def retarget(self, link: ChainLink, message: Retarget) -> None:
        link.send(frame(message))
        await self._control_answer(link, Retargeted)
        codec = message.output_codec
        if codec is not None and codec != self.push_codecs.get(link.peer_id):
            self.recoded.add(link.peer_id)
            self.output_codecs[link.peer_id] = codec.name
            self.push_codecs[link.peer_id] = codec

    async def _control_answer(self, link: ChainLink, model: type[Message]) -> tuple[Message, Frame]:
        until = Deadline.after(self.swarm.request_timeout_s)  # for the whole exchange, whatever else the nodes send
        while True:
            answered, message, answer = await self.next_answer(until)
            if isinstance(message, ErrorReply):
                if message.code == PeerUnavailableError.code or answered is not link:
                    # a node reporting that its next node is gone (the failure being recovered from), or another
                    # node's refusal of a step sent before: not this exchange's answer, nor for `link` to answer for
                    continue
                error = message.error()
                error.peer_id = link.peer_id  # who refused
                raise link_ended(error, link) or error  # a node that dropped the session fails like a lost one
            if answered is link and isinstance(message, model):
                return message, answer

    def step_tokens(self, link: ChainLink) -> int:
        """Rows x tokens of the largest step `link`'s node takes, as this client holds it: the limit it announces
        (NodeInfo.max_step_tokens), else (a node that does not say, or no record at hand) what the session asks of
        every node of its chain (`floor_tokens`); 0: neither (min_step_tokens 0). A node refusing a step within it
        has failed (InferenceSession._own_input_sane)."""
        info = self.swarm.announced(link.peer_id)
        return (info.max_step_tokens if info is not None else 0) or self.floor_tokens()

    def floor_tokens(self) -> int:
        """What the session asks every node of its chain to take a step (ClientConfig.step_tokens; 0: none)."""
        return self.config.step_tokens(self.batch, self.max_length)

    async def replay(self, links: list[ChainLink], history: torch.Tensor) -> list[list[torch.Tensor]]:
        """Rebuild the caches of replacement nodes: the history (batch, position, hidden) goes through them one by
        one, via the client. Returns each link's input history (one tensor per link). Raises LinkFailed naming a node
        that failed, or the RequestError a node refused with (its `peer_id` set)."""
        inputs = []
        for link in links:
            inputs.append([history])
            outputs = []
            bound = min(REPLAY_CHUNK_TOKENS, self.step_tokens(link) or REPLAY_CHUNK_TOKENS)
            tokens = max(1, bound // history.shape[0])  # a chunk's rows x tokens within the bound
            for start in range(0, history.shape[1], tokens):
                chunk = history[:, start : start + tokens]  # (batch, <= tokens, hidden)
                step_id = f"{self.session_id}:replay:{start}"
                link.send(frame(Step(step_id=step_id, position=start, replay=True), [tensor_to_proto(chunk)]))
                until = Deadline.after(self.swarm.request_timeout_s)
                while True:
                    try:
                        answered, message, answer = await self.next_answer(until)
                    except LinkFailed as failure:  # only the replayed node owes an answer now: silence is its
                        raise LinkFailed(failure.message, failure.link or link) from None
                    if stale_report(answered, message, [link]):
                        continue
                    if isinstance(message, ErrorReply):
                        if message.code == PeerUnavailableError.code:  # the replayed node gave up (timeout)
                            raise LinkFailed(message.message, link)
                        refusal = message.error()
                        refusal.peer_id = answered.peer_id  # who refused: failover bans it and tries another
                        raise refusal
                    if answered is link and isinstance(message, StepResult) and message.step_id == step_id:
                        break
                outputs.append(self.read_hidden(link, answer, message.codec, chunk.numel(), tuple(chunk.shape)))
            history = torch.cat(outputs, dim=1)
        return inputs

    # ---- closing -----------------------------------------------------------------------------------------------------

    @staticmethod
    def close_links(links: list[ChainLink]) -> None:
        for link in links:
            link.close()

    async def close(self, timeout_s: float = 5.0) -> None:
        """End the session on every node: end each stream and wait up to `timeout_s` for the nodes to close theirs
        (their caches are then free), then close everything."""
        for link in self.links:
            if link.control is not None:
                link.control.end()
        readers = [link.readers[0] for link in self.links if link.readers]
        try:
            if readers:
                await asyncio.wait(readers, timeout=timeout_s)
        finally:  # cancelled while waiting (a caller that went away): the links are closed all the same
            self.close_links(self.links)


__all__ = [
    "ANSWER_HEADROOM_BYTES",
    "MAX_HIDDEN",
    "MAX_QUEUED_ANSWERS",
    "REPLAY_CHUNK_TOKENS",
    "SessionChain",
    "answer_frame_bytes",
]

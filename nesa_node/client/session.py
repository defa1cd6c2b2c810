"""Client side of an inference session over a chain of nodes.

Direct mode (fig. 2 of the Nesa paper): the client opens one stream per node, sends each step to the first
node, every node pushes its output straight to the next, and the last node answers the client. Relayed mode:
the client sends each step to every node in turn and forwards the outputs itself (kept for comparison).
Caches stay on the nodes in both modes; only hidden states of the new tokens travel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from nesa_node.client.chain_links import ChainLink, LinkFailed, stale_report
from nesa_node.client.failover import Failover
from nesa_node.client.swarm import SwarmClient
from nesa_node.errors import NesaError, PeerUnavailableError, RequestError, SessionStateError
from nesa_node.protocol import lane
from nesa_node.protocol.wire import (
    NO_CODEC,
    RPC_INFERENCE,
    WireCodec,
    drain,
    pack_metadata,
    raise_if_error,
    tensor_from_proto,
    tensor_to_proto,
    unpack_metadata,
)
from nesa_node.routing.chain import Chain, ChainRequest, Hop

logger = logging.getLogger(__name__)

MODES = ("direct", "relay")
MIN_STEP_DEADLINE_S = 1.0  # a decode step is ms on a healthy chain; 1 s leaves room for a GC pause (guess)
_CLOSE = object()


@dataclass
class StepTiming:
    wall_s: float  # client-observed time of the step
    compute_s: float  # time the nodes report spending in their blocks
    bytes_sent: int = 0  # serialized request bytes the client sent for this step
    bytes_received: int = 0  # serialized response bytes the client received for this step
    failovers: int = 0  # nodes replaced during this step (wall_s then spans failed step to next good step)


def codec_for(sender: Hop | None, receiver: Hop | None, preferred: WireCodec) -> WireCodec:
    """The codec for hidden states going from `sender` to `receiver`: `preferred` when both ends accept it, else
    "none". None stands for the client, which accepts every codec."""
    for hop in (sender, receiver):
        if hop is not None and preferred.name not in hop.codecs:
            return NO_CODEC
    return preferred


Rerouter = Callable[[ChainRequest], Chain]  # picks a chain for a block range, excluding banned peers


class RemoteInferenceSession(Failover):
    """An open inference session along `chain`. Not thread-safe: one generation at a time.

    Failover (when `reroute` is given): when a node fails during a step, the client bans it, asks `reroute` for
    nodes covering exactly the lost span, rebuilds their caches by replaying the span's input history (in direct
    mode the previous node's outputs, kept by that node, or the client's own inputs for the first span; in relay
    mode the client's inputs to that span), points the previous node at the replacement (direct mode), and sends
    the step again under the same step id: nodes that already did it answer from their record, so every cache
    advances exactly once. At most `max_failovers` per step; a replacement that fails while being set up is
    banned and the next one tried, up to `max_replacement_attempts`.
    """

    def __init__(
        self,
        swarm: SwarmClient,
        chain: Chain,
        *,
        batch: int,
        max_length: int,
        mode: str = "direct",
        compression: WireCodec = NO_CODEC,
        reroute: Rerouter | None = None,
        max_failovers: int = 3,
        max_replacement_attempts: int = 8,
        step_timeout_s: float | None = None,
        probe_timeout_s: float = 1.0,
        lanes: bool = True,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.compression = compression
        self.swarm = swarm
        self.chain = chain
        self.batch = batch
        self.max_length = max_length
        self.mode = mode
        # direct mode: hidden states go over data lanes (nesa_node.protocol.lane) where nodes offer them, else over libp2p
        self.lanes = lanes and mode == "direct"
        self.reroute = reroute
        self.max_failovers = max_failovers
        # replacements tried for one lost span: records of crashed nodes linger until they expire, so a failover
        # during churn can meet several dead nodes in a row; each is banned and the next one tried
        self.max_replacement_attempts = max_replacement_attempts
        self.step_timeout_s = step_timeout_s  # None: adaptive, see _deadline
        self.probe_timeout_s = probe_timeout_s  # rpc_info to find which node of a silent chain is gone
        self.session_id = uuid.uuid4().hex
        self.position = 0  # tokens the nodes' caches hold
        self.timings: list[StepTiming] = []
        self.failovers: list[dict] = []  # one entry per recovery: failed peer, replacements, seconds, phases
        self._phases: dict[str, float] = {}  # seconds per phase of the recovery in progress (see _timed)
        # what the client sent, per step, for replay: direct mode to the first span only, relay mode to every link
        self._inputs: list[list[torch.Tensor]] = []  # [link][step] (batch, seq, hidden)
        self._links: list[ChainLink] = []
        self._responses: asyncio.Queue | None = None
        self._closed = False
        self._opened = False

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def open(self) -> RemoteInferenceSession:
        try:
            self.swarm.call(self._open(), timeout=self.swarm.request_timeout_s * 2)
        except BaseException:
            self.close()
            raise
        self._opened = True
        return self

    def _open_metadata(self, index: int, hops: tuple[Hop, ...], upstream: str, downstream: Hop | None) -> dict:
        direct = self.mode == "direct"
        # who decodes this node's output: the next node in a direct chain, else the client
        receiver = (hops[index + 1] if index + 1 < len(hops) else downstream) if direct else None
        return {
            "output_codec": codec_for(hops[index], receiver, self.compression).to_metadata(),
            "session_id": self.session_id,
            "blocks": list(range(hops[index].start_block, hops[index].end_block)),
            "batch": self.batch,
            "max_length": self.max_length,
            "upstream": (hops[index - 1].peer_id if index > 0 else upstream) if direct else self.swarm.peer_id,
            "next": receiver.peer_id if receiver is not None else None,
        }

    def _lane_metadata(self, links: list[ChainLink], downstream: ChainLink | None) -> list[dict | None]:
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
            settings.append({"in": link.key_in.hex(), "out": link.key_out.hex(), "next": next_lane})
        return settings

    async def _open_links(self, hops: tuple[Hop, ...], upstream: str, downstream: ChainLink | None) -> list[ChainLink]:
        """Open a session stream on each hop (a chain segment between `upstream` and `downstream`, None: the
        client); wait for acks. The segment's outer lane keys are fresh: a replaced segment's neighbours get them
        by retarget, so a node that was dropped holds no key still in use."""
        links = [ChainLink(hop) for hop in hops]
        lane_settings = self._lane_metadata(links, downstream)
        for index, link in enumerate(links):
            metadata = self._open_metadata(index, hops, upstream, downstream.hop if downstream else None)
            if lane_settings[index] is not None:
                metadata["lane"] = lane_settings[index]
            link.outbox.put_nowait(runtime_pb2.ExpertRequest(metadata=pack_metadata(metadata)))
        for link in links:
            hop = link.hop
            try:
                stream = await asyncio.wait_for(
                    self.swarm.p2p.iterate_protobuf_handler(
                        PeerID.from_base58(hop.peer_id),
                        RPC_INFERENCE,
                        drain(link.outbox, _CLOSE),
                        runtime_pb2.ExpertResponse,
                    ),
                    timeout=self.swarm.request_timeout_s,
                )
            except Exception as exc:
                self._close_links(links)
                raise LinkFailed(f"could not open a session on {hop.peer_id}: {exc!r}", link) from None
            link.reader = asyncio.create_task(self._read(link, stream))
        # every node acknowledges the open (cache reserved) or refuses it with a typed error
        pending = {id(link): link for link in links}
        try:
            while pending:
                try:
                    link, metadata, _ = await self._next_response(self.swarm.request_timeout_s)
                except LinkFailed as silent:
                    if silent.link is not None:
                        raise
                    # a node that took the stream but never answered the open has failed for this session: name it,
                    # so the caller bans it and opens on another chain
                    unanswered = next(iter(pending.values()))
                    raise LinkFailed(
                        f"{silent.message}: node {unanswered.hop.peer_id} did not acknowledge the open", unanswered
                    ) from None
                if stale_report(link, metadata, links):
                    continue
                try:
                    raise_if_error(metadata)
                except RequestError as refusal:
                    refusal.peer_id = link.hop.peer_id  # who refused: the caller may route around it
                    raise
                if metadata.get("ok"):
                    pending.pop(id(link), None)
        except BaseException:
            self._close_links(links)
            raise
        return links

    async def _open(self) -> None:
        self._responses = asyncio.Queue()
        self._links = await self._open_links(self.chain.hops, self.swarm.peer_id, None)
        await self._connect_lanes()

    async def _connect_lanes(self) -> None:
        """The client's own lanes: steps to the first node, outputs from the last. A node without a lane, or one
        that cannot be reached on it, is spoken to over its libp2p stream instead."""
        if not self.lanes:
            return
        first, last = self._links[0], self._links[-1]
        if first.send_lane is None:
            first.send_lane = await self._connect_lane(first, lane.ROLE_SEND, first.key_in)
        if last.receive_lane is None:
            last.receive_lane = await self._connect_lane(last, lane.ROLE_RECEIVE, last.key_out)

    async def _connect_lane(self, link: ChainLink, role: int, key: bytes) -> lane.SealedStream | None:
        address = self.swarm.lane_address(link.hop.peer_id)
        if address is None:
            return None
        try:
            async with asyncio.timeout(self.swarm.request_timeout_s):
                stream = await lane.connect(address, role, self.session_id, key)
        except (lane.LaneClosedError, TimeoutError) as exc:
            logger.info("no data lane to %s (%s); its steps go over libp2p", link.hop.peer_id, exc)
            return None
        link.lane_readers.append(asyncio.create_task(self._read_lane(link, stream)))
        return stream

    async def _read_lane(self, link: ChainLink, stream: lane.SealedStream) -> None:
        try:
            while (payload := await stream.receive()) is not None:
                response = runtime_pb2.ExpertResponse()
                response.ParseFromString(payload)
                self._responses.put_nowait((link, response))
        except Exception as exc:  # a lane that fails is a node that fails, whatever the reason
            message = exc.message if isinstance(exc, NesaError) else repr(exc)
            self._responses.put_nowait((link, PeerUnavailableError(f"data lane of {link.hop.peer_id}: {message}")))
            return
        self._responses.put_nowait((link, PeerUnavailableError(f"node {link.hop.peer_id} closed the data lane")))

    async def _read(self, link: ChainLink, stream) -> None:
        try:
            async for response in stream:
                self._responses.put_nowait((link, response))
        except Exception as exc:
            self._responses.put_nowait((link, exc))
            return
        self._responses.put_nowait((link, PeerUnavailableError(f"node {link.hop.peer_id} closed the session")))

    async def _next_response(self, timeout_s: float) -> tuple[ChainLink, dict, runtime_pb2.ExpertResponse]:
        while True:
            try:
                async with asyncio.timeout(timeout_s):  # no task per step, unlike wait_for
                    link, item = await self._responses.get()
            except TimeoutError:
                raise LinkFailed(f"no answer from the chain within {timeout_s} s", None) from None
            if isinstance(link, ChainLink) and link.reader is None:
                continue  # a link closed by failover: its last words no longer matter
            if isinstance(item, BaseException):
                if isinstance(item, NesaError) and not isinstance(item, PeerUnavailableError):
                    raise item
                raise LinkFailed(f"stream to {link.hop.peer_id} failed: {item!r}", link)
            return link, unpack_metadata(item.metadata), item

    def _close_links(self, links: list[ChainLink]) -> None:
        for link in links:
            link.close_lanes()
            link.outbox.put_nowait(_CLOSE)
            if link.reader is not None:
                link.reader.cancel()
                link.reader = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._links:
            with contextlib.suppress(Exception):
                self.swarm.call(self._close(), timeout=10)

    async def _close(self) -> None:
        for link in self._links:
            link.outbox.put_nowait(_CLOSE)
        readers = [link.reader for link in self._links if link.reader is not None]
        if readers:
            await asyncio.wait(readers, timeout=5)
        for reader in readers:
            reader.cancel()
        for link in self._links:
            link.close_lanes()

    def __enter__(self) -> RemoteInferenceSession:
        return self.open() if not self._opened else self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- steps --------------------------------------------------------------------------------------------

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run the new tokens' hidden states (batch, seq, hidden) through the chain; returns the last block's."""
        if self._closed or not self._opened:
            raise SessionStateError("the inference session is not open")
        if hidden.shape[0] != self.batch:
            raise SessionStateError(f"session opened for batch {self.batch}, got {hidden.shape[0]} rows")
        if self.position + hidden.shape[1] > self.max_length:
            raise SessionStateError(
                f"{self.position + hidden.shape[1]} tokens exceed the session's max_length {self.max_length}"
            )
        started = time.perf_counter()
        failovers = 0
        deadline = self._deadline(hidden.shape[0] * hidden.shape[1])
        failure: LinkFailed | None = None
        while True:
            try:
                if failure is not None:  # a replacement that fails while its cache is rebuilt fails like any node
                    self._recover(failure)
                output, compute_s, sent, received, inputs = self.swarm.call(self._step(hidden, deadline))
                break
            except LinkFailed as failed:
                if self.reroute is None or failovers >= self.max_failovers:
                    raise PeerUnavailableError(f"{failed.message} (no failover left)") from None
                failovers += 1
                failure = failed
        self.timings.append(
            StepTiming(
                wall_s=time.perf_counter() - started,
                compute_s=compute_s,
                bytes_sent=sent,
                bytes_received=received,
                failovers=failovers,
            )
        )
        if self.reroute is not None:  # replayed into a replacement of a span that fails
            if not self._inputs:
                self._inputs = [[] for _ in inputs]
            for kept, sent_input in zip(self._inputs, inputs, strict=True):
                kept.append(sent_input.detach().clone())
        self.position += hidden.shape[1]
        return output

    def _deadline(self, tokens: int) -> float:
        """Seconds a step may take before the chain is presumed broken (a node killed mid-step may leave its
        stream open). Given, or: for a decode step once a few are measured, 10x the slowest recent one and at
        least MIN_STEP_DEADLINE_S; the request timeout otherwise (prefill can be slow)."""
        if self.step_timeout_s is not None:
            return self.step_timeout_s
        recent = [timing.wall_s for timing in self.timings[-8:]]
        if tokens <= 8 and len(recent) >= 3:
            return max(MIN_STEP_DEADLINE_S, 10 * max(recent))
        return self.swarm.request_timeout_s

    async def _step(
        self, hidden: torch.Tensor, deadline_s: float
    ) -> tuple[torch.Tensor, float, int, int, list[torch.Tensor]]:
        """One step through the chain: (output, compute seconds, bytes sent, bytes received, the input the client
        sent to each link it feeds: the first in direct mode, all in relay mode)."""
        step_id = f"{self.session_id}:{self.position}"  # the same on a retry: nodes that did it answer from record
        links = self._links if self.mode == "relay" else self._links[:1]
        compute_s, sent, received, inputs = 0.0, 0, 0, []
        for link in links:
            inputs.append(hidden)
            codec = codec_for(None, link.hop, self.compression)
            request = runtime_pb2.ExpertRequest(
                tensors=[tensor_to_proto(hidden, codec)],
                metadata=pack_metadata({"step_id": step_id, "position": self.position, "codec": codec.to_metadata()}),
            )
            sent += request.ByteSize()
            if link.send_lane is not None:
                try:
                    link.send_lane.send(request.SerializeToString())
                except lane.LaneClosedError:
                    raise LinkFailed(f"data lane to {link.hop.peer_id} closed", link) from None
            else:
                link.outbox.put_nowait(request)
            expected = link if self.mode == "relay" else self._links[-1]
            while True:
                answered, metadata, response = await self._next_response(deadline_s)
                self._raise_step_error(answered, metadata)
                if answered is expected and metadata.get("step_id") == step_id:
                    break
            received += response.ByteSize()
            hidden = self._read_hidden(answered, response, metadata, hidden.numel())
            compute_s += float(metadata.get("compute_s", 0.0))
        return hidden, compute_s, sent, received, inputs

    def _raise_step_error(self, answered: ChainLink, metadata: dict) -> None:
        """A node that could not push a step to its next node reports peer_unavailable: that next node failed."""
        try:
            raise_if_error(metadata)
        except PeerUnavailableError as error:
            index = self._links.index(answered) if answered in self._links else -1
            if self.mode == "direct" and 0 <= index < len(self._links) - 1:
                raise LinkFailed(error.message, self._links[index + 1]) from None
            raise LinkFailed(error.message, answered) from None

    def _read_hidden(self, link: ChainLink, response, metadata: dict, max_elements: int) -> torch.Tensor:
        if len(response.tensors) != 1:
            raise LinkFailed(f"node {link.hop.peer_id} sent a malformed answer", link)
        return tensor_from_proto(
            response.tensors[0],
            allowed_dtypes=("float32", "float16", "bfloat16"),
            max_elements=max_elements,
            rank=3,
            codec=WireCodec.from_metadata(metadata.get("codec")),
        )

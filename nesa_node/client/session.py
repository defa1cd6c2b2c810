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
from dataclasses import dataclass

import torch
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from nesa_node.client.swarm import SwarmClient
from nesa_node.errors import NesaError, PeerUnavailableError, SessionStateError
from nesa_node.routing.chain import Chain, Hop
from nesa_node.wire import (
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

logger = logging.getLogger(__name__)

MODES = ("direct", "relay")
_CLOSE = object()


@dataclass
class StepTiming:
    wall_s: float  # client-observed time of the step
    compute_s: float  # time the nodes report spending in their blocks
    bytes_sent: int = 0  # serialized request bytes the client sent for this step
    bytes_received: int = 0  # serialized response bytes the client received for this step


def codec_for(sender: Hop | None, receiver: Hop | None, preferred: WireCodec) -> WireCodec:
    """The codec for hidden states going from `sender` to `receiver`: `preferred` when both ends accept it, else
    "none". None stands for the client, which accepts every codec."""
    for hop in (sender, receiver):
        if hop is not None and preferred.name not in hop.codecs:
            return NO_CODEC
    return preferred


class RemoteInferenceSession:
    """An open inference session along `chain`. Not thread-safe: one generation at a time."""

    def __init__(
        self,
        swarm: SwarmClient,
        chain: Chain,
        *,
        batch: int,
        max_length: int,
        mode: str = "direct",
        compression: WireCodec = NO_CODEC,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.compression = compression
        self.swarm = swarm
        self.chain = chain
        self.batch = batch
        self.max_length = max_length
        self.mode = mode
        self.session_id = uuid.uuid4().hex
        self.position = 0  # tokens the nodes' caches hold
        self.timings: list[StepTiming] = []
        self._outboxes: list[asyncio.Queue] = []
        self._responses: asyncio.Queue | None = None
        self._readers: list[asyncio.Task] = []
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

    async def _open(self) -> None:
        self._responses = asyncio.Queue()
        hops = self.chain.hops
        peers = [hop.peer_id for hop in hops]
        for index, peer in enumerate(peers):
            direct = self.mode == "direct"
            # who decodes this node's output: the next node in a direct chain, else the client
            receiver = hops[index + 1] if direct and index + 1 < len(hops) else None
            metadata = {
                "output_codec": codec_for(hops[index], receiver, self.compression).to_metadata(),
                "session_id": self.session_id,
                "batch": self.batch,
                "max_length": self.max_length,
                "upstream": peers[index - 1] if direct and index > 0 else self.swarm.peer_id,
                "next": peers[index + 1] if direct and index + 1 < len(peers) else None,
            }
            outbox: asyncio.Queue = asyncio.Queue()
            outbox.put_nowait(runtime_pb2.ExpertRequest(metadata=pack_metadata(metadata)))
            self._outboxes.append(outbox)
            try:
                stream = await asyncio.wait_for(
                    self.swarm.p2p.iterate_protobuf_handler(
                        PeerID.from_base58(peer), RPC_INFERENCE, drain(outbox, _CLOSE), runtime_pb2.ExpertResponse
                    ),
                    timeout=self.swarm.request_timeout_s,
                )
            except Exception as exc:
                raise PeerUnavailableError(f"could not open a session on {peer}: {exc!r}") from None
            self._readers.append(asyncio.create_task(self._read(index, stream)))
        # every node acknowledges the open (cache reserved) or refuses it with a typed error
        acknowledged = set()
        while len(acknowledged) < len(peers):
            index, metadata, _ = await self._next_response()
            raise_if_error(metadata)
            if metadata.get("ok"):
                acknowledged.add(index)

    async def _read(self, index: int, stream) -> None:
        try:
            async for response in stream:
                self._responses.put_nowait((index, response))
        except Exception as exc:
            self._responses.put_nowait((index, exc))
            return
        self._responses.put_nowait((index, PeerUnavailableError(f"node {self.chain.hops[index].peer_id} closed")))

    async def _next_response(self) -> tuple[int, dict, runtime_pb2.ExpertResponse]:
        try:
            async with asyncio.timeout(self.swarm.request_timeout_s):  # no task per step, unlike wait_for
                index, item = await self._responses.get()
        except TimeoutError:
            raise PeerUnavailableError(f"no answer from the chain within {self.swarm.request_timeout_s} s") from None
        if isinstance(item, BaseException):
            if isinstance(item, NesaError):
                raise item
            raise PeerUnavailableError(f"stream to {self.chain.hops[index].peer_id} failed: {item!r}")
        return index, unpack_metadata(item.metadata), item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._outboxes or self._readers:
            with contextlib.suppress(Exception):
                self.swarm.call(self._close(), timeout=10)

    async def _close(self) -> None:
        for outbox in self._outboxes:
            outbox.put_nowait(_CLOSE)
        if self._readers:
            await asyncio.wait(self._readers, timeout=5)
        for reader in self._readers:
            reader.cancel()

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
        output, compute_s, sent, received = self.swarm.call(self._step(hidden))
        self.timings.append(
            StepTiming(
                wall_s=time.perf_counter() - started, compute_s=compute_s, bytes_sent=sent, bytes_received=received
            )
        )
        self.position += hidden.shape[1]
        return output

    async def _step(self, hidden: torch.Tensor) -> tuple[torch.Tensor, float, int, int]:
        step_id = f"{self.session_id}:{self.position}"
        hops = range(len(self.chain.hops)) if self.mode == "relay" else [0]
        compute_s, sent, received = 0.0, 0, 0
        for index in hops:
            codec = codec_for(None, self.chain.hops[index], self.compression)
            request = runtime_pb2.ExpertRequest(
                tensors=[tensor_to_proto(hidden, codec)],
                metadata=pack_metadata({"step_id": step_id, "position": self.position, "codec": codec.to_metadata()}),
            )
            sent += request.ByteSize()
            self._outboxes[index].put_nowait(request)
            expected = index if self.mode == "relay" else len(self.chain.hops) - 1
            while True:
                answered, metadata, response = await self._next_response()
                raise_if_error(metadata)
                if answered == expected and metadata.get("step_id") == step_id:
                    break
            received += response.ByteSize()
            if len(response.tensors) != 1:
                raise PeerUnavailableError(f"node {self.chain.hops[answered].peer_id} sent a malformed answer")
            hidden = tensor_from_proto(
                response.tensors[0],
                allowed_dtypes=("float32", "float16", "bfloat16"),
                max_elements=hidden.numel(),
                rank=3,
                codec=WireCodec.from_metadata(metadata.get("codec")),
            )
            compute_s += float(metadata.get("compute_s", 0.0))
        return hidden, compute_s, sent, received

"""A node daemon serving one stage of a graph model (MTPP partitioning, Nesa sec. 2.5): composition root,
handler and announcer.

`GraphStageNode.create(config)` builds the plan's stages, starts a hivemind P2P host and DHT node, registers
`rpc_graph_forward` (as a unary RPC, and as a stream of one request and one answer, which pipelines use: a stage's
tensors may pass p2pd's 4 MiB bound on unary calls; a few such streams at once per peer), and announces a NodeInfo record under the plan's DHT key with blocks [stage, stage + 1), so
clients find stage i the way they find block spans. A request carries the stage's input tensors by name; the
answer carries the stage's output tensors by name. Everything read from a peer is checked first: a wrong stage,
wrong names, a dtype, size or shape the stage cannot take come back as BadRequestError, never as a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
from hivemind.p2p import P2PContext

from nesa_node.errors import BadRequestError, RequestError
from nesa_node.graph.plan import GraphPlan, build_stages
from nesa_node.peer import SHUTDOWN_STEP_S, Peer, start_peer
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame, frame, read
from nesa_node.protocol.dht import store_node_info
from nesa_node.protocol.framing import StreamChannel, answer_one_frame, serve_stream
from nesa_node.protocol.messages import GRAPH, ErrorReply, GraphForward, GraphResult, expect
from nesa_node.protocol.records import NodeInfo, NodeState
from nesa_node.protocol.stream_gate import AnswerGate
from nesa_node.protocol.tensors import tensor_from_proto, tensor_to_proto
from nesa_node.sharding.graph import Stage
from nesa_node.version import __version__

logger = logging.getLogger(__name__)

ALLOWED_DTYPES = ("float32",)  # the graph models here take and pass float32 tensors
# stage calls on streams a node reads at once (each up to a frame of its limit in memory): a pipeline keeps up to
# STREAMS_PER_PEER in flight per stage node (nesa_node/graph/pipeline.py), the stage runs one at a time
STREAMS_PER_PEER = 4
MAX_STREAMS = 16
STREAMS_PER_PEER_PER_MINUTE = 60_000  # a pipeline of small inputs makes many calls (guess: 1000 a second)
FRAME_HEADROOM_BYTES = 1 << 20  # a request's names and framing around its tensors
STREAM_REQUEST_TIMEOUT_S = 30.0  # for a stream's request to arrive once it is opened (as a peer call's timeout)


@dataclass(frozen=True)
class GraphStageConfig:
    # (plan, stage) pairs this node serves: `nesa-node run --graph-model` gives one; a node may host several
    # (stages of different plans, for example), each announced under its plan's DHT key
    stages: tuple[tuple[GraphPlan, int], ...]
    initial_peers: tuple[str, ...] = ()  # multiaddrs of peers already in the swarm
    new_swarm: bool = False  # start a swarm alone
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    identity_path: str | None = None  # RSA key file; None: a fresh key per run
    max_elements: int = 1 << 26  # per input tensor (256 MiB of float32), refused beyond
    announce_period_s: float = 10.0  # how often the NodeInfo records are refreshed


class GraphStageHandler:
    """Runs the node's stages on requests; compute on worker threads so the event loop stays free."""

    def __init__(self, stages: dict[tuple[str, int], Stage], max_elements: int):
        self.stages, self.max_elements = stages, max_elements  # (plan DHT key, stage index) -> Stage
        self.streams = AnswerGate.per_minute(MAX_STREAMS, STREAMS_PER_PEER, STREAMS_PER_PEER_PER_MINUTE, "stage calls")
        self.locks = {key: asyncio.Lock() for key in stages}  # one forward per stage at a time: a pipeline slot
        self.requests_served = 0

    async def serve_stream(self, channel: StreamChannel, context: P2PContext) -> None:
        """One stage call on a stream (GRAPH_FORWARD_STREAM), admitted by `streams` before a byte is read."""
        leave = self.streams.enter(context.remote_id.to_base58())
        try:
            await answer_one_frame(channel, context, self.rpc_graph_forward, timeout_s=STREAM_REQUEST_TIMEOUT_S)
        finally:
            leave()

    async def rpc_graph_forward(self, request: Frame, context: P2PContext) -> Frame:
        try:
            message = expect(read(request, GRAPH), GraphForward)
            key = (message.plan, message.stage)
            stage = self.stages.get(key)
            if stage is None:
                raise BadRequestError(f"this node does not serve stage {message.stage} of plan {message.plan[:64]!r}")
            if message.names != tuple(stage.input_names) or len(request.tensors) != len(message.names):
                raise BadRequestError(f"stage {message.stage} takes tensors named {list(stage.input_names)}")
            inputs = [
                tensor_from_proto(proto, allowed_dtypes=ALLOWED_DTYPES, max_elements=self.max_elements)
                for proto in request.tensors
            ]
            async with self.locks[key]:
                started = time.perf_counter()
                outputs = await asyncio.to_thread(self._run, stage, inputs)
                seconds = time.perf_counter() - started
            self.requests_served += 1
            result = GraphResult(names=tuple(stage.output_names), compute_s=seconds)
            return frame(result, [tensor_to_proto(tensor) for tensor in outputs])
        except RequestError as exc:
            return frame(ErrorReply.of(exc))

    @staticmethod
    def _run(stage: Stage, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            with torch.no_grad():
                outputs = stage.module(*inputs)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:  # shapes the stage cannot take
            raise BadRequestError(f"the stage cannot run on these inputs: {exc}"[:500]) from None
        if not all(isinstance(tensor, torch.Tensor) for tensor in outputs):
            raise BadRequestError("the stage produced a non-tensor value; it cannot be served")
        return [tensor.contiguous() for tensor in outputs]


class GraphStageNode:
    def __init__(self, config: GraphStageConfig, peer: Peer, handler: GraphStageHandler):
        self.config, self.peer, self.handler = config, peer, handler
        self.p2p, self.dht, self.signature_validator = peer.p2p, peer.dht, peer.signature_validator
        self.started_at = time.monotonic()
        self._announcer: asyncio.Task | None = None
        self._contacter: asyncio.Task | None = None

    @classmethod
    async def create(cls, config: GraphStageConfig) -> GraphStageNode:
        """Build the stage, start P2P and the DHT, register the handler. Announces nothing yet."""
        if not config.stages:
            raise ValueError("a graph-stage node needs at least one (plan, stage) to serve")
        for plan, stage in config.stages:
            if not 0 <= stage < plan.stages:
                raise ValueError(f"stage must be in [0, {plan.stages}), got {stage}")
        if not config.initial_peers and not config.new_swarm:
            raise ValueError("give --initial-peers to join a swarm, or --new-swarm to start one")
        built = {plan: (await asyncio.to_thread(build_stages, plan))[1] for plan, _ in config.stages}
        stages = {(plan.dht_prefix, stage): built[plan][stage] for plan, stage in config.stages}
        handler = GraphStageHandler(stages, config.max_elements)
        peer = await start_peer(
            initial_peers=config.initial_peers,
            host=config.host,
            port=config.port,
            identity_path=config.identity_path,
            dht_prefixes=sorted({plan.dht_prefix for plan, _ in config.stages}),
            signs_records=True,
        )
        try:
            await peer.p2p.add_protobuf_handler(rpc.GRAPH_FORWARD, handler.rpc_graph_forward, Frame)
            await serve_stream(
                peer.p2p,
                rpc.GRAPH_FORWARD_STREAM,
                handler.serve_stream,
                # every input of the stage taking the most at its largest
                max_frame_bytes=max(len(stage.input_names) for stage in stages.values()) * config.max_elements * 4
                + FRAME_HEADROOM_BYTES,
            )
        except BaseException:
            await peer.shutdown()
            raise
        return cls(config, peer, handler)

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    def current_info(self, stage: int, state: NodeState = NodeState.online) -> NodeInfo:
        """The record of one served stage: blocks [stage, stage + 1) of its plan."""
        return NodeInfo(
            peer_id=self.peer_id,
            state=state,
            start_block=stage,
            end_block=stage + 1,
            dtype="float32",
            uptime_s=time.monotonic() - self.started_at,
            version=__version__,
        )

    async def announce(self, state: NodeState = NodeState.online) -> bool:
        """Store a record per served stage under its plan's key; True if every store reached a replica."""
        ttl_s = min(3 * self.config.announce_period_s + 10.0, 600.0)  # two periods may be missed
        stored = await asyncio.gather(
            *(
                store_node_info(self.dht, plan.dht_prefix, self.current_info(stage, state), self.signature_validator,
                                ttl_s)
                for plan, stage in self.config.stages
            )
        )  # fmt: skip
        return all(stored)

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except Exception as exc:
                logger.debug("announce failed: %r", exc)
            await asyncio.sleep(self.config.announce_period_s)

    async def _contact_loop(self) -> None:
        """A restarted bootstrap peer learns this node again (Peer.contact_initial_peers), beside the announcer."""
        while True:
            await asyncio.sleep(self.config.announce_period_s)
            await self.peer.contact_initial_peers()

    async def start(self) -> None:
        await self.announce()
        self._announcer = asyncio.create_task(self._announce_loop())
        self._contacter = asyncio.create_task(self._contact_loop())

    async def shutdown(self) -> None:
        for task in (self._announcer, self._contacter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.announce(NodeState.offline), timeout=SHUTDOWN_STEP_S)
        await self.peer.shutdown()

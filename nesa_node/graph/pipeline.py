"""Forward passes of a graph model through the swarm: one node per stage of a `GraphPlan`.

The client holds the values that cross stage boundaries and sends each stage exactly the tensors it consumes
(graph inputs and earlier stages' outputs, by fx node name), then keeps the stage's outputs; this is the io of
eq. 8, each tensor leaving its producer once and reaching each consuming stage once. `forward_many` keeps every
input in flight at once, so stage i works on one input while stage i + 1 works on the previous one (a pipeline).
Tensors travel uncompressed (codec "none"), so results equal a single-process forward. Each stage call goes on a
libp2p stream of its own (one request, one answer: graph/stage.py), never as a unary call: p2pd bounds those at
4 MiB each way, less than one batch of feature maps; at most STREAMS_PER_PEER calls are in flight per stage node.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

import torch

from nesa_node.client.swarm import Swarm, check_answer
from nesa_node.errors import NoRouteError, PeerUnavailableError
from nesa_node.graph.plan import GraphPlan, build_stages
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import frame, read
from nesa_node.protocol.dht import fetch_node_infos
from nesa_node.protocol.framing import call_on_stream
from nesa_node.protocol.messages import GRAPH_ANSWERS, GraphForward, GraphResult
from nesa_node.protocol.records import NodeState
from nesa_node.protocol.tensors import tensor_from_proto, tensor_to_proto
from nesa_node.sharding.graph import output_value

# stage calls in flight per stage node: what a stage node admits per peer (graph/stage.py STREAMS_PER_PEER; the
# two modules stay apart); more would be refused, and the stage runs one at a time anyway
STREAMS_PER_PEER = 4
MAX_ANSWER_ELEMENTS = 1 << 26  # per tensor a stage sends back (256 MiB of float32)
ANSWER_HEADROOM_BYTES = 1 << 20  # a stage answer's names and framing around its tensors
# per Swarm and stage node: stage calls in flight, of every pipeline of that Swarm (a node may serve stages of
# several plans, and admits calls per peer)
_SLOTS: weakref.WeakKeyDictionary[Swarm, dict[str, asyncio.Semaphore]] = weakref.WeakKeyDictionary()


class GraphPipeline:
    """A graph model served by the swarm; one Swarm can serve several plans (each has its own DHT key). Async: run
    it on the Swarm's event loop."""

    def __init__(self, swarm: Swarm, plan: GraphPlan):
        self.swarm, self.plan = swarm, plan
        self.traced, self.stages, _ = build_stages(plan)  # names only: the client runs no stage itself

    async def stage_peers(self) -> list[str]:
        """A serving peer per stage, from the DHT records (the most recently announced); NoRouteError if a stage
        has none online."""
        async with asyncio.timeout(self.swarm.request_timeout_s):
            found = await fetch_node_infos(self.swarm.dht, self.plan.dht_prefix)
        records = [record for record in found if record.info.state == NodeState.online]
        peers = []
        for stage in range(self.plan.stages):
            serving = [record for record in records if record.info.start_block == stage]
            if not serving:
                raise NoRouteError(f"no online node serves stage {stage} of {self.plan.factory}")
            peers.append(max(serving, key=lambda record: record.expiration_time).info.peer_id)
        return peers

    async def _forward(self, peers: Sequence[str], inputs: Sequence[torch.Tensor]):
        values: dict[str, object] = dict(zip(self.traced.input_names, inputs, strict=True))
        for index, (stage, peer_id) in enumerate(zip(self.stages, peers, strict=True)):
            message = GraphForward(plan=self.plan.dht_prefix, stage=index, names=tuple(stage.input_names))
            request = frame(message, [tensor_to_proto(values[name].contiguous()) for name in stage.input_names])
            slots = _SLOTS.setdefault(self.swarm, {}).setdefault(peer_id, asyncio.Semaphore(STREAMS_PER_PEER))
            async with slots:
                answer = await call_on_stream(
                    self.swarm.p2p,
                    peer_id,
                    rpc.GRAPH_FORWARD_STREAM,
                    request,
                    max_answer_bytes=len(stage.output_names) * MAX_ANSWER_ELEMENTS * 4 + ANSWER_HEADROOM_BYTES,
                    timeout_s=self.swarm.request_timeout_s,
                )
            result = check_answer(read(answer, GRAPH_ANSWERS), GraphResult)
            if result.names != tuple(stage.output_names) or len(answer.tensors) != len(stage.output_names):
                raise PeerUnavailableError(f"peer {peer_id} sent a malformed answer for stage {index}")
            for name, proto in zip(stage.output_names, answer.tensors, strict=True):
                values[name] = tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=MAX_ANSWER_ELEMENTS)
        return output_value(self.traced, values)

    async def forward(self, *inputs: torch.Tensor):
        """The model's output for `inputs`, computed stage by stage on the swarm."""
        peers = await self.stage_peers()
        async with asyncio.timeout(self.swarm.request_timeout_s * len(peers)):
            return await self._forward(peers, inputs)

    async def forward_many(self, batches: Sequence[Sequence[torch.Tensor]]) -> list:
        """Outputs for several inputs, all in flight at once through the same stage peers (pipelined)."""
        peers = await self.stage_peers()
        async with asyncio.timeout(self.swarm.request_timeout_s * (len(peers) + len(batches))):
            return list(await asyncio.gather(*(self._forward(peers, inputs) for inputs in batches)))

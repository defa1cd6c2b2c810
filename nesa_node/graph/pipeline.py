"""Forward passes of a graph model through the swarm: one node per stage of a `GraphPlan`.

The client holds the values that cross stage boundaries and sends each stage exactly the tensors it consumes
(graph inputs and earlier stages' outputs, by fx node name), then keeps the stage's outputs; this is the io of
eq. 8, each tensor leaving its producer once and reaching each consuming stage once. `forward_many` keeps every
input in flight at once, so stage i works on one input while stage i + 1 works on the previous one (a pipeline).
Tensors travel uncompressed (codec "none"), so results equal a single-process forward.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from hivemind.proto import runtime_pb2

from nesa_node.client.swarm import SwarmClient
from nesa_node.errors import NoRouteError, PeerUnavailableError
from nesa_node.graph.plan import RPC_GRAPH_FORWARD, GraphPlan, build_stages
from nesa_node.protocol.dht import fetch_node_infos
from nesa_node.protocol.records import NodeState
from nesa_node.protocol.wire import pack_metadata, raise_if_error, tensor_from_proto, tensor_to_proto, unpack_metadata
from nesa_node.sharding.graph import output_value

MAX_ANSWER_ELEMENTS = 1 << 26  # per tensor a stage sends back (256 MiB of float32)


class GraphPipeline:
    """A graph model served by the swarm; one SwarmClient can serve several plans (each has its own DHT key)."""

    def __init__(self, swarm: SwarmClient, plan: GraphPlan):
        self.swarm, self.plan = swarm, plan
        self.traced, self.stages, _ = build_stages(plan)  # names only: the client runs no stage itself

    def stage_peers(self) -> list[str]:
        """A serving peer per stage, from the DHT records (the most recently announced); NoRouteError if a stage
        has none online."""
        found = self.swarm.call(fetch_node_infos(self.swarm.dht, self.plan.dht_prefix), self.swarm.request_timeout_s)
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
            request = runtime_pb2.ExpertRequest(
                tensors=[tensor_to_proto(values[name].contiguous()) for name in stage.input_names],
                metadata=pack_metadata(
                    {"plan": self.plan.dht_prefix, "stage": index, "names": list(stage.input_names)}
                ),
            )
            response = await self.swarm._unary(peer_id, RPC_GRAPH_FORWARD, request)
            metadata = unpack_metadata(response.metadata)
            raise_if_error(metadata)
            if metadata.get("names") != list(stage.output_names) or len(response.tensors) != len(stage.output_names):
                raise PeerUnavailableError(f"peer {peer_id} sent a malformed answer for stage {index}")
            for name, proto in zip(stage.output_names, response.tensors, strict=True):
                values[name] = tensor_from_proto(proto, allowed_dtypes=("float32",), max_elements=MAX_ANSWER_ELEMENTS)
        return output_value(self.traced, values)

    def forward(self, *inputs: torch.Tensor):
        """The model's output for `inputs`, computed stage by stage on the swarm."""
        peers = self.stage_peers()
        return self.swarm.call(self._forward(peers, inputs), timeout=self.swarm.request_timeout_s * len(peers))

    def forward_many(self, batches: Sequence[Sequence[torch.Tensor]]) -> list:
        """Outputs for several inputs, all in flight at once through the same stage peers (pipelined)."""
        peers = self.stage_peers()

        async def run_all():
            return await asyncio.gather(*(self._forward(peers, inputs) for inputs in batches))

        return self.swarm.call(run_all(), timeout=self.swarm.request_timeout_s * (len(peers) + len(batches)))

"""Graph models (ResNet-, ViT- and U-Net-style) split into 2, 3 and 4 stages and served by local graph-stage
nodes; the client's forward pass through the swarm equals the single-process forward."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_leaves

from nesa_node.errors import BadRequestError, NoRouteError
from nesa_node.graph.models import FACTORIES
from nesa_node.graph.pipeline import GraphPipeline
from nesa_node.graph.plan import GraphPlan, load_factory, plan_from_partition
from nesa_node.graph.stage import GraphStageConfig, GraphStageNode
from nesa_node.protocol import rpc
from nesa_node.protocol.channel import Frame, read
from nesa_node.protocol.messages import GRAPH_ANSWERS, ErrorReply
from nesa_node.protocol.tensors import tensor_to_proto
from nesa_node.sharding.brkga import BrkgaSettings, brkga_partition
from nesa_node.sharding.graph import trace_graph
from nesa_node.sharding.partition import NodeProfile, kahn_order, slice_order
from tests.support.swarm import LocalSwarm, SyncSwarm

STAGE_COUNTS = (2, 3, 4)
LOOPBACK = NodeProfile(bandwidth=2.5e9)  # bytes/s, ~20 Gbit/s


def make_plan(name: str, stages: int) -> GraphPlan:
    """k = 2: equal operation counts (no solver); k = 3: the DP on Kahn's order; k = 4: BRKGA."""
    factory = f"nesa_node.graph.models:{name}"
    if stages == 2:
        return GraphPlan(factory, stages)
    traced = trace_graph(*load_factory(factory), repeats=0)
    nodes = [LOOPBACK] * stages
    if stages == 3:
        partition = slice_order(traced.graph, kahn_order(traced.graph), nodes)
    else:
        search = BrkgaSettings(population=6, generations=2)
        partition = brkga_partition(traced.graph, nodes, rng=np.random.default_rng(0), settings=search).partition
    return plan_from_partition(factory, traced, partition, stages)


@pytest.fixture(scope="module")
def graph_swarm():
    """Four nodes: node j serves stage j of every plan with more than j stages (nine plans in all)."""
    swarm, nodes, client = LocalSwarm(), [], None
    try:
        plans = {(name, k): make_plan(name, k) for name in sorted(FACTORIES) for k in STAGE_COUNTS}
        for index in range(max(STAGE_COUNTS)):
            served = tuple((plan, index) for plan in plans.values() if plan.stages > index)
            config = GraphStageConfig(stages=served, initial_peers=tuple(swarm.initial_peers), announce_period_s=2.0)
            node = swarm.run(GraphStageNode.create(config))
            nodes.append(node)
            swarm.run(node.start())
        client = SyncSwarm(list(swarm.initial_peers), dht_prefix="graph-tests")
        yield plans, client, nodes
    finally:
        if client is not None:
            client.close()
        for node in nodes:
            try:
                swarm.run(node.shutdown(), timeout=60)
            except Exception:
                pass
        swarm.close()


def wait_for_pipeline(client: SyncSwarm, pipeline: GraphPipeline, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.call(pipeline.stage_peers())
            return
        except NoRouteError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def max_difference(first, second) -> float:
    pairs = list(zip(tree_leaves(first), tree_leaves(second), strict=True))
    return max(float((a - b).abs().max()) for a, b in pairs)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_served_stages_equal_the_single_process_forward(graph_swarm, name):
    plans, client, _ = graph_swarm
    module, inputs = FACTORIES[name]()
    with torch.no_grad():
        expected = module(*inputs)
        other_inputs = tuple(torch.randn_like(tensor) for tensor in inputs)
        other_expected = module(*other_inputs)
    for stages in STAGE_COUNTS:
        pipeline = GraphPipeline(client.swarm, plans[(name, stages)])
        wait_for_pipeline(client, pipeline)
        assert len(set(client.call(pipeline.stage_peers()))) == stages  # one node per stage
        assert max_difference(client.call(pipeline.forward(*inputs)), expected) <= 1e-5
        first, second = client.call(pipeline.forward_many([inputs, other_inputs]))  # both in flight at once
        assert max_difference(first, expected) <= 1e-5
        assert max_difference(second, other_expected) <= 1e-5


def test_tensors_past_the_unary_bound_cross_stages_whole(graph_swarm):
    """A batch of 96 images: the first stage's output (6 MB) is over p2pd's 4 MiB bound on a unary call; stage
    calls go on streams, and the result equals the single-process forward."""
    plans, client, _ = graph_swarm
    module, _ = FACTORIES["resnet_tiny"]()
    images = torch.randn(96, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pipeline = GraphPipeline(client.swarm, plans[("resnet_tiny", 2)])
    wait_for_pipeline(client, pipeline)
    with torch.no_grad():
        expected = module(images)
        boundary = pipeline.stages[0].module(images)
    assert sum(tensor.numel() * 4 for tensor in tree_leaves(boundary)) > rpc.MAX_UNARY_BYTES
    assert max_difference(client.call(pipeline.forward(images), timeout=120), expected) <= 1e-5


def test_bad_requests_get_typed_errors(graph_swarm):
    plans, client, nodes = graph_swarm
    plan = plans[("resnet_tiny", 2)]
    pipeline = GraphPipeline(client.swarm, plan)
    wait_for_pipeline(client, pipeline)
    stage = pipeline.stages[0]
    peer_id = nodes[0].peer_id
    image = torch.randn(2, 3, 32, 32)

    def ask(message: dict, tensors: list[torch.Tensor]):
        request = Frame(tensors=[tensor_to_proto(tensor) for tensor in tensors], metadata=msgpack.packb(message))
        answer = read(client.call(client.swarm.unary(peer_id, rpc.GRAPH_FORWARD, request), timeout=30), GRAPH_ANSWERS)
        if isinstance(answer, ErrorReply):
            raise answer.error()

    names = list(stage.input_names)
    graph = {"kind": "graph", "plan": plan.dht_prefix}
    with pytest.raises(BadRequestError, match="does not serve"):
        ask({**graph, "stage": 1, "names": names}, [image])
    with pytest.raises(BadRequestError, match="takes tensors named"):
        ask({**graph, "stage": 0, "names": ["wrong"]}, [image])
    with pytest.raises(BadRequestError, match="cannot run"):
        ask({**graph, "stage": 0, "names": names}, [torch.randn(2, 5, 7)])
    with pytest.raises(BadRequestError):
        ask({**graph, "stage": 0, "names": names}, [image.double()])
    with pytest.raises(BadRequestError, match="stage: Field required"):
        ask({**graph, "names": names}, [image])
    with pytest.raises(BadRequestError, match="sideways: Extra inputs are not permitted"):
        ask({**graph, "stage": 0, "names": names, "sideways": 1}, [image])

"""Tracing modules into operation graphs and splitting them into stages that reproduce the forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_leaves

from nesa_node.graph.models import FACTORIES
from nesa_node.sharding.brkga import BrkgaSettings, brkga_partition
from nesa_node.sharding.graph import FALLBACK_FLOPS_PER_SECOND, run_stages, split_stages, trace_graph
from nesa_node.sharding.partition import (
    NodeProfile,
    kahn_order,
    quotient_is_acyclic,
    slice_order,
    uniform_partition,
)

LOOPBACK = NodeProfile(bandwidth=2.5e9)  # ~20 Gbit/s: costs where splitting pays, so stages are not empty


@pytest.fixture(scope="module", params=sorted(FACTORIES))
def model(request):
    module, inputs = FACTORIES[request.param]()
    with torch.no_grad():
        expected = module(*inputs)
    return request.param, trace_graph(module, inputs, repeats=0), inputs, expected


def max_difference(first, second) -> float:
    pairs = list(zip(tree_leaves(first), tree_leaves(second), strict=True))
    return max(float((a - b).abs().max()) for a, b in pairs)


def test_models_have_branches_and_the_unet_has_long_skips(model):
    name, traced, _, _ = model
    fan_out = [len(successors) for successors in traced.graph.successors]
    assert max(fan_out) >= 2  # residuals, q/k/v, skips
    if name == "unet_tiny":
        position = {v: index for index, v in enumerate(kahn_order(traced.graph))}
        assert max(position[v] - position[u] for u, v in traced.graph.edges) > traced.graph.size // 2


def test_parameter_and_output_bytes_are_accounted(model):
    _, traced, inputs, _ = model
    module = traced.module
    total = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    assert traced.graph.size_param.sum() == total  # every parameter read by exactly one operation here
    for name, tensor in zip(traced.input_names, inputs, strict=True):
        assert traced.graph.size_out[traced.node_names.index(name)] == tensor.numel() * 4


@pytest.mark.parametrize("stage_count", [2, 3, 4])
def test_stages_run_in_sequence_equal_the_single_process_forward(model, stage_count):
    _, traced, inputs, expected = model
    graph, nodes = traced.graph, [LOOPBACK] * stage_count
    partitions = [
        uniform_partition(graph, kahn_order(graph), nodes, np.ones(graph.size)),
        slice_order(graph, kahn_order(graph), nodes),
        brkga_partition(graph, nodes, rng=np.random.default_rng(stage_count), settings=BrkgaSettings(
            population=6, generations=2)).partition,
    ]  # fmt: skip
    assert len(partitions[0].ends) == stage_count
    for partition in partitions:
        assert quotient_is_acyclic(graph, partition.assignment())
        stages = split_stages(traced, partition.assignment(), stage_count)
        with torch.no_grad():
            result = run_stages(traced, stages, inputs)
        assert max_difference(result, expected) <= 1e-5


def test_unet_stages_carry_several_tensors_across_a_boundary():
    module, inputs = FACTORIES["unet_tiny"]()
    traced = trace_graph(module, inputs, repeats=0)
    partition = uniform_partition(traced.graph, kahn_order(traced.graph), [LOOPBACK] * 3, np.ones(traced.graph.size))
    stages = split_stages(traced, partition.assignment(), 3)
    assert max(len(stage.input_names) for stage in stages) >= 3  # a skip, the noise embedding, the main path


def test_flop_fallback_and_sizes_of_a_linear_layer():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3))
    traced = trace_graph(module, (torch.randn(2, 4),), repeats=0)
    linear = traced.node_names.index("_0")
    assert traced.graph.work[linear] == pytest.approx(2 * 2 * 4 * 3 / FALLBACK_FLOPS_PER_SECOND)
    assert traced.graph.size_param[linear] == (4 * 3 + 3) * 4
    assert traced.graph.size_out[linear] == 2 * 3 * 4
    measured = trace_graph(module, (torch.randn(2, 4),), repeats=3, clock=iter(range(100)).__next__)
    assert measured.graph.work[linear] == pytest.approx(1.0)  # a fake clock ticking 1 s per read


def test_a_stage_consuming_a_later_stage_is_refused():
    module, inputs = FACTORIES["resnet_tiny"]()
    traced = trace_graph(module, inputs, repeats=0)
    assignment = [1] * traced.graph.size
    assignment[-1] = 0  # the head runs before the features it reads
    with pytest.raises(ValueError, match="later stage"):
        split_stages(traced, assignment, 2)

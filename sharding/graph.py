"""Computation graphs of arbitrary `nn.Module`s for MTPP partitioning, and their split into pipeline stages.

`trace_graph` traces a module with `torch.fx` and runs it once on example inputs, operation by operation, to
measure what eq. 8-10 of the Nesa paper need per operation v: work(v) (seconds, the median of timed runs on the
target device, or a FLOP count over an assumed device speed when profiling is off), sizeparam(v) (bytes of the
parameters and buffers it reads) and sizeout(v) (bytes of the tensors it outputs). Every fx node but the output
is an operation; graph inputs (placeholders) are operations with no work, so the partition pays for carrying them.

`split_stages` turns a partition into one `torch.fx.GraphModule` per stage. A stage takes the values it consumes
from outside (graph inputs or earlier stages' outputs) by fx node name and returns the values later stages or the
graph output consume, so skip connections may cross any number of boundaries. `torch.fx.passes.split_module`
does the same splitting but renames the boundary values and orders stage arguments positionally; the node names
kept here are what the serving protocol sends across the network.

Effectful (runs the module and reads the clock), torch only; no networking.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Interpreter, Node, symbolic_trace
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from nesa_node.sharding.partition import OperationGraph

# Assumed speed for the FLOP fallback: ~20 GFLOP/s, one modern CPU core with AVX2 in float32 (guess).
FALLBACK_FLOPS_PER_SECOND = 2e10


def _tensor_bytes(value) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


def _mutates_inputs(node: Node, module: torch.nn.Module) -> bool:
    """In-place operations cannot be re-run for timing: they would change their inputs."""
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(node.target), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op == "call_function":
        return bool(node.kwargs.get("inplace", False)) or getattr(node.target, "__name__", "").endswith("_")
    return False


class _ProfilingInterpreter(Interpreter):
    def __init__(self, module: GraphModule, *, repeats: int, synchronize: Callable[[], None], clock):
        super().__init__(module)
        self.repeats, self.synchronize, self.clock = repeats, synchronize, clock
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}

    def run_node(self, node: Node):
        with FlopCounterMode(display=False) as counter:
            result = super().run_node(node)
        self.flops[node.name] = counter.get_total_flops()
        self.out_bytes[node.name] = _tensor_bytes(result)
        if self.repeats > 0 and node.op not in ("placeholder", "get_attr", "output"):
            runs = self.repeats if not _mutates_inputs(node, self.module) else 0
            samples = []
            for _ in range(runs):
                self.synchronize()
                start = self.clock()
                super().run_node(node)
                self.synchronize()
                samples.append(self.clock() - start)
            if samples:
                self.seconds[node.name] = statistics.median(samples)
        return result


@dataclass(frozen=True)
class TracedGraph:
    """A traced module and its operation graph; operation i is the fx node named `node_names[i]`."""

    module: GraphModule
    graph: OperationGraph
    node_names: tuple[str, ...]
    input_names: tuple[str, ...]  # the placeholders, in call order


def trace_graph(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    repeats: int = 5,
    flops_per_second: float = FALLBACK_FLOPS_PER_SECOND,
    clock: Callable[[], float] = time.perf_counter,
) -> TracedGraph:
    """Trace `module` with torch.fx and measure every operation on the device of `example_inputs`.

    work(v) is the median of `repeats` timed runs of the operation alone, seconds; with repeats=0, or for an
    operation that cannot be re-run (in place), its FLOP count over `flops_per_second`. Raises
    torch.fx.proxy.TraceError for modules with data-dependent control flow."""
    traced = symbolic_trace(module)
    device = next((tensor.device for tensor in example_inputs if isinstance(tensor, torch.Tensor)), None)
    synchronize = torch.cuda.synchronize if device is not None and device.type == "cuda" else (lambda: None)
    interpreter = _ProfilingInterpreter(traced, repeats=repeats, synchronize=synchronize, clock=clock)
    with torch.no_grad():
        interpreter.run(*example_inputs)
    nodes = [node for node in traced.graph.nodes if node.op != "output"]
    index = {node.name: position for position, node in enumerate(nodes)}
    work, size_param = [], []
    for node in nodes:
        estimate = interpreter.flops[node.name] / flops_per_second
        work.append(interpreter.seconds.get(node.name, estimate))
        size_param.append(_parameter_bytes(traced, node))
    edges = tuple((index[source.name], index[node.name]) for node in nodes for source in node.all_input_nodes)
    graph = OperationGraph(
        names=tuple(node.name for node in nodes),
        work=work,
        size_param=size_param,
        size_out=[interpreter.out_bytes[node.name] for node in nodes],
        edges=edges,
    )
    inputs = tuple(node.name for node in nodes if node.op == "placeholder")
    return TracedGraph(module=traced, graph=graph, node_names=graph.names, input_names=inputs)


def _parameter_bytes(traced: GraphModule, node: Node) -> int:
    if node.op == "call_module":
        submodule = traced.get_submodule(node.target)
        return _tensor_bytes(list(submodule.parameters()) + list(submodule.buffers()))
    if node.op == "get_attr":
        owner, _, name = str(node.target).rpartition(".")
        return _tensor_bytes(getattr(traced.get_submodule(owner), name))
    return 0


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: `module(*inputs by input_names)` returns a tuple of values named `output_names`."""

    module: GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def split_stages(traced: TracedGraph, assignment: Sequence[int], stage_count: int) -> list[Stage]:
    """One `Stage` per stage index in [0, stage_count), from the stage of each operation (`assignment`, by
    operation index, for example `Partition.assignment()`). Graph inputs are supplied by the caller and belong to
    no stage. Raises ValueError when a stage consumes a value of a later stage (the quotient is not a forward
    pipeline)."""
    if len(assignment) != traced.graph.size:
        raise ValueError(f"assignment has {len(assignment)} entries for {traced.graph.size} operations")
    stage_of = {name: int(stage) for name, stage in zip(traced.node_names, assignment, strict=True)}
    if any(not 0 <= stage < stage_count for stage in stage_of.values()):
        raise ValueError(f"stage indices must be in [0, {stage_count})")
    nodes = list(traced.module.graph.nodes)
    consumers: dict[str, set[int | None]] = {node.name: set() for node in nodes}
    for node in nodes:
        for source in node.all_input_nodes:
            user_stage = None if node.op == "output" else stage_of[node.name]
            consumers[source.name].add(user_stage)
            if source.op != "placeholder" and user_stage is not None and stage_of[source.name] > user_stage:
                raise ValueError(f"{node.name} in stage {user_stage} consumes {source.name} of a later stage")
    stages = []
    for stage in range(stage_count):
        members = [node for node in nodes if node.op not in ("placeholder", "output") and stage_of[node.name] == stage]
        member_names = {node.name for node in members}
        inputs = sorted(
            {source.name for node in members for source in node.all_input_nodes if source.name not in member_names},
            key=[node.name for node in nodes].index,
        )
        outputs = [node.name for node in members if consumers[node.name] - {stage}]
        graph = torch.fx.Graph()
        values = {name: graph.placeholder(name) for name in inputs}
        for node in members:
            values[node.name] = graph.node_copy(node, lambda source, known=values: known[source.name])
        graph.output(tuple(values[name] for name in outputs))
        stages.append(Stage(GraphModule(traced.module, graph), tuple(inputs), tuple(outputs)))
    return stages


def output_value(traced: TracedGraph, values: dict[str, object]):
    """The module's output rebuilt from named values (graph inputs and stage outputs)."""
    output_node = list(traced.module.graph.nodes)[-1]
    return torch.fx.node.map_arg(output_node.args[0], lambda node: values[node.name])


def run_stages(traced: TracedGraph, stages: Sequence[Stage], inputs: Sequence[torch.Tensor]):
    """Run the stages in order in this process: the single-process reference of the served pipeline."""
    values: dict[str, object] = dict(zip(traced.input_names, inputs, strict=True))
    for stage in stages:
        results = stage.module(*(values[name] for name in stage.input_names))
        values.update(zip(stage.output_names, results, strict=True))
    return output_value(traced, values)

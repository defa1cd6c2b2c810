"""Which stage of which graph model a node serves: the plan shared by graph-stage nodes and their clients.

A plan names a model factory (`package.module:function` returning (module, example_inputs)), the stage count
k, and the stage of every operation of its traced graph. Without an explicit assignment, the order of Kahn's
algorithm is cut into k segments of equal operation count: that depends on the graph alone, so every process
that loads the same factory derives the same stages. Plans made by the MTPP solvers (`plan_from_partition`)
carry their assignment and travel as JSON files. Nodes of one plan announce under the plan's own DHT key.

No networking here: both the node (nesa_node.graph.stage) and the client (nesa_node.graph.pipeline) use it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nesa_node.errors import ModelLoadError
from nesa_node.sharding.graph import Stage, TracedGraph, split_stages, trace_graph
from nesa_node.sharding.partition import NodeProfile, Partition, kahn_order, uniform_partition

MAX_STAGES = 256  # more pipeline stages than any swarm here would chain (guess; bounds a plan file)


@dataclass(frozen=True)
class GraphPlan:
    factory: str  # "package.module:function"
    stages: int  # k
    assignment: tuple[tuple[str, int], ...] = ()  # (fx node name, stage); empty: equal operation counts

    def __post_init__(self) -> None:
        if ":" not in self.factory:
            raise ModelLoadError(f"graph model {self.factory!r} must be written package.module:factory")
        if not 1 <= self.stages <= MAX_STAGES:
            raise ModelLoadError(f"stages must be in [1, {MAX_STAGES}], got {self.stages}")

    @property
    def dht_prefix(self) -> str:
        """The DHT key its nodes announce under: the factory's name and a digest of the whole plan."""
        digest = hashlib.sha256(self.to_json().encode()).hexdigest()[:16]
        return f"graph-{self.factory.rpartition(':')[2]}-{digest}"

    def to_json(self) -> str:
        return json.dumps(
            {"factory": self.factory, "stages": self.stages, "assignment": dict(self.assignment)}, sort_keys=True
        )

    @classmethod
    def from_json(cls, text: str) -> GraphPlan:
        try:
            value = json.loads(text)
            assignment = tuple(sorted((str(name), int(stage)) for name, stage in value.get("assignment", {}).items()))
            return cls(factory=str(value["factory"]), stages=int(value["stages"]), assignment=assignment)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"bad graph plan: {exc!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> GraphPlan:
        return cls.from_json(Path(path).read_text())


def load_factory(spec: str):
    """(module, example_inputs) from the factory `package.module:function`; ModelLoadError if it is missing."""
    module_name, _, function_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ModelLoadError(f"cannot load graph model {spec!r}: {exc}") from None
    module, inputs = factory()
    return module, tuple(inputs)


def plan_from_partition(factory: str, traced: TracedGraph, partition: Partition, stages: int) -> GraphPlan:
    """A plan that serves `partition` (from `slice_order` or `brkga_partition`) of `traced.graph`."""
    assignment = partition.assignment()
    return GraphPlan(factory, stages, tuple(sorted(zip(traced.node_names, map(int, assignment), strict=True))))


def build_stages(plan: GraphPlan) -> tuple[TracedGraph, list[Stage], tuple]:
    """Trace the plan's model (no profiling: stages depend on the graph, not on timings) and split it."""
    module, inputs = load_factory(plan.factory)
    traced = trace_graph(module, inputs, repeats=0)
    if plan.assignment:
        given = dict(plan.assignment)
        if set(given) != set(traced.node_names):
            raise ModelLoadError("the plan's operations do not match the traced graph of its factory")
        assignment = [given[name] for name in traced.node_names]
    else:
        graph = traced.graph
        nodes = [NodeProfile()] * min(plan.stages, graph.size)
        assignment = list(uniform_partition(graph, kahn_order(graph), nodes, np.ones(graph.size)).assignment())
    try:
        stages = split_stages(traced, assignment, plan.stages)
    except ValueError as exc:
        raise ModelLoadError(f"bad graph plan: {exc}") from None
    return traced, stages, inputs

"""The command line of graph models.

- `nesa-node graph plan --graph-model package.module:factory --stages k --out plan.json`: trace the factory's
  model, partition it with an MTPP solver (nesa_node.sharding.partition, nesa_node.sharding.brkga) and write the
  plan file.
- `nesa-node run --graph-plan plan.json --stage i` (or `--graph-model package.module:factory --stage i --stages k`):
  serve one stage of a plan (nesa_node.graph.stage); `nesa_node.cli` adds these options to `run`.
- `nesa-node graph infer --graph-plan plan.json --initial-peers MADDR`: run the factory's example inputs through
  the stages that serve the plan (nesa_node.graph.pipeline) and compare with the single-process forward.

Stages of one pipeline announce under the plan's DHT key, a digest of the whole plan: every stage and the client
must load the same plan. Factory modules are imported from the installed packages, then from the current folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nesa_node.cli.options import PARSERS
from nesa_node.errors import ModelLoadError, NoRouteError, PeerUnavailableError

if TYPE_CHECKING:  # the plan module imports torch: `nesa-node --help` and the other commands do without it
    from nesa_node.graph.plan import GraphPlan

SOLVERS = ("dp", "brkga", "uniform")
DEFAULT_BANDWIDTH_MBIT = 1000.0  # NodeProfile's default link, 1 Gbit/s
COMPARE_TOLERANCE = 1e-4  # max abs difference `graph infer --compare` accepts; served stages measure ~1e-6
DEFAULT_WAIT_S = 30.0  # how long `graph infer` waits for every stage to be announced

PLAN_DESCRIPTION = """\
Trace a graph model with torch.fx, partition its operations into at most K pipeline stages with a solver of the
Max-Throughput Partitioning Problem, and write the plan file that `nesa-node run --graph-plan FILE --stage I` and
`nesa-node graph infer --graph-plan FILE` load. Prints each stage's operations, work, parameter bytes, bytes
crossing its border and cost (eq. 10: its transfers at --bandwidth-mbit plus its work), the bottleneck (eq. 11:
the pipeline's time per input) and the plan's DHT key.

Solvers:
  dp       exact dynamic program over Kahn's topological order (default; milliseconds)
  brkga    biased random-key genetic algorithm over topological orders, each cut by the dp (under a second for a
           hundred operations; never worse than dp)
  uniform  equal operation counts on Kahn's order: the plan `nesa-node run --graph-model F --stages K` serves,
           with the same DHT key

The solvers use fewer than K stages when another stage would not lower the bottleneck (each cut adds transfers);
the plan then has fewer stages, and the summary says so. Work is each operation's FLOP count at 20 GFLOP/s
unless --profile-runs times the operations on this machine; FLOP counts give the same plan on every machine."""

PLAN_EPILOG = """\
example:
  nesa-node graph plan --graph-model nesa_node.graph.models:unet_tiny --stages 3 --out plan.json
  nesa-node run --graph-plan plan.json --stage 0 --initial-peers MADDR   # one per stage, same file"""

INFER_DESCRIPTION = """\
Run a graph model's example inputs through the nodes that serve the stages of a plan, and print the outputs'
shapes and the time. The client sends each stage the tensors it consumes (graph inputs and earlier stages'
outputs), uncompressed. Waits up to --wait-s for a node of every stage, then names the stages nobody serves.
With --compare, also runs the model in this process and prints the largest absolute difference; exit status 1
when it is above 1e-4 (the stages run the model's own float32 operations: expect 1e-6 or less)."""

INFER_EPILOG = """\
example:
  nesa-node graph infer --graph-plan plan.json --initial-peers $(cat boot.addr) --compare"""


def add_arguments(run: argparse.ArgumentParser) -> None:
    """The graph-model options of `nesa-node run` (the other options it shares with a block node)."""
    group = run.add_argument_group(
        "graph models (MTPP stages; instead of --model/--blocks)",
        "Every stage of a pipeline must be started from the same plan: one --graph-plan file, or one --graph-model "
        "and --stages (which serves the plan of `nesa-node graph plan --solver uniform`).",
    )
    source = group.add_mutually_exclusive_group()
    source.add_argument(
        "--graph-model",
        metavar="MODULE:FACTORY",
        help="function returning (module, example_inputs); stages of equal operation counts",
    )
    source.add_argument("--graph-plan", metavar="FILE", help="plan file written by `nesa-node graph plan`")
    group.add_argument("--stage", type=int, default=None, help="the stage this node serves, from 0")
    group.add_argument("--stages", type=int, default=None, help="stage count k (with --graph-model)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit 2 with usage) for a run command line that is neither a block node nor a graph stage."""
    graph = args.graph_model or args.graph_plan
    if graph and (args.model or args.blocks):
        parser.error("give either --model/--blocks (a block node) or --graph-model/--graph-plan (a graph stage)")
    if not graph and not (args.model and args.blocks):
        parser.error("run needs --model and --blocks (or --graph-model/--graph-plan with --stage)")
    if graph and args.stage is None:
        parser.error("--graph-model/--graph-plan need --stage")
    if args.graph_model and args.stages is None:
        parser.error("--graph-model needs --stages")


def _import_from_cwd() -> None:
    """Let factories live in the current folder (`nesa-node` starts with its own folder on sys.path, not the
    current one). Appended: installed packages win over a file of the same name."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def load_plan(path: str) -> GraphPlan:
    """The plan in file `path`; ModelLoadError for a missing or malformed file."""
    from nesa_node.graph.plan import GraphPlan

    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"no plan file {path!r}: make one with `nesa-node graph plan`")
    return GraphPlan.load(file)


def load_model(spec: str):
    """(module in eval mode, example_inputs) of factory `spec`; ModelLoadError when it cannot be imported, fails,
    or does not return an nn.Module and a sequence of tensors."""
    import torch

    from nesa_node.graph.plan import load_factory

    if ":" not in spec:
        raise ModelLoadError(f"graph model {spec!r} must be written package.module:factory")
    _import_from_cwd()
    try:
        module, inputs = load_factory(spec)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"graph model {spec!r} failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(module, torch.nn.Module) or not all(isinstance(value, torch.Tensor) for value in inputs):
        raise ModelLoadError(f"graph model {spec!r} must return (nn.Module, tuple of example input tensors)")
    return module.eval(), inputs


def run_graph_stage(args: argparse.Namespace) -> int:
    """Serve one stage until SIGINT/SIGTERM (arguments checked by check_arguments)."""
    from nesa_node import event_loop
    from nesa_node.graph.plan import GraphPlan
    from nesa_node.graph.stage import GraphStageConfig, GraphStageNode
    from nesa_node.peer import write_address_file

    _import_from_cwd()
    plan = load_plan(args.graph_plan) if args.graph_plan else GraphPlan(args.graph_model, args.stages)
    if not 0 <= args.stage < plan.stages:
        raise ValueError(f"--stage must be in [0, {plan.stages}) for this plan of {_count(plan.stages, 'stage')}")
    config = GraphStageConfig(
        stages=((plan, args.stage),),
        initial_peers=tuple(args.initial_peers),
        new_swarm=args.new_swarm,
        host=args.host,
        port=args.port,
        identity_path=args.identity_path,
        announce_period_s=args.announce_period_s,
    )

    async def serve() -> None:
        node = await GraphStageNode.create(config)

        async def start() -> None:
            await node.start()
            print(f"peer id {node.peer_id}", flush=True)
            for addr in await node.visible_maddrs():
                print(f"listening on {addr}", flush=True)
            print(f"serving stage {args.stage} of {plan.stages} of {plan.factory} (key {plan.dht_prefix})", flush=True)
            if args.address_file:
                await asyncio.to_thread(write_address_file, args.address_file, await node.visible_maddrs())

        await event_loop.serve_until_signal(start, node.shutdown, name="nesa-node run")

    event_loop.run(serve())
    return 0


_positive_int = PARSERS["positive_int"]
_non_negative_int = PARSERS["non_negative_int"]
_positive_float = PARSERS["positive"]


def _stage_count(text: str) -> int:
    from nesa_node.graph.plan import MAX_STAGES

    value = _positive_int(text)
    if value > MAX_STAGES:
        raise argparse.ArgumentTypeError(f"at most {MAX_STAGES} stages, got {value}")
    return value


def add_graph_commands(commands) -> None:
    """`nesa-node graph plan` and `nesa-node graph infer`."""
    graph = commands.add_parser(
        "graph",
        help="graph models: make a stage plan, run inputs through a pipeline",
        description="Graph models (any torch.fx-traceable nn.Module) served as a pipeline of stages: `graph plan` "
        "writes the plan file every stage node and client loads, `graph infer` runs inputs through the stages.",
    )
    subcommands = graph.add_subparsers(dest="graph_command", required=True, metavar="{plan,infer}")

    plan = subcommands.add_parser(
        "plan",
        help="partition a model into pipeline stages and write the plan file",
        description=PLAN_DESCRIPTION,
        epilog=PLAN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--graph-model",
        required=True,
        metavar="MODULE:FACTORY",
        help="function returning (nn.Module, example_inputs), e.g. nesa_node.graph.models:unet_tiny",
    )
    plan.add_argument("--stages", type=_stage_count, required=True, metavar="K", help="at most K pipeline stages")
    plan.add_argument("--out", default="plan.json", metavar="FILE", help="plan file to write (default plan.json)")
    plan.add_argument("--solver", choices=SOLVERS, default="dp", help="partitioning solver (default dp)")
    plan.add_argument(
        "--bandwidth-mbit",
        type=_positive_float,
        default=DEFAULT_BANDWIDTH_MBIT,
        metavar="MBIT",
        help=f"link speed between stages in Mbit/s, for the transfer costs (default {DEFAULT_BANDWIDTH_MBIT:g})",
    )
    plan.add_argument(
        "--profile-runs",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="time each operation N times on this machine and use the median as its work (default 0: FLOP counts)",
    )
    plan.add_argument("--seed", type=int, default=0, help="random seed of brkga (default 0)")
    plan.add_argument(
        "--generations", type=_non_negative_int, default=40, metavar="N", help="generation cap of brkga (default 40)"
    )

    infer = subcommands.add_parser(
        "infer",
        help="run a model's example inputs through the stage nodes of a plan",
        description=INFER_DESCRIPTION,
        epilog=INFER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    infer.add_argument(
        "--graph-plan", required=True, metavar="FILE", help="plan file the stage nodes were started from"
    )
    infer.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs of swarm peers (the bootstrap's or any stage node's `listening on` address)",
    )
    infer.add_argument(
        "--seed",
        type=int,
        default=None,
        help="standard normal inputs of the example inputs' shapes from this seed (default: the example inputs)",
    )
    infer.add_argument(
        "--compare", action="store_true", help="compare with the single-process forward; exit 1 above 1e-4"
    )
    infer.add_argument(
        "--runs", type=_positive_int, default=1, metavar="N", help="forward passes to time (default 1; the first "
        "one also opens the connections)"
    )  # fmt: skip
    infer.add_argument(
        "--wait-s",
        type=_positive_float,
        default=DEFAULT_WAIT_S,
        metavar="SECONDS",
        help=f"how long to wait for a node of every stage (default {DEFAULT_WAIT_S:g})",
    )


def run_graph_command(args: argparse.Namespace) -> int:
    if args.graph_command == "plan":
        return make_plan(args)
    return infer(args)


# ---- graph plan ------------------------------------------------------------------------------------------------


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def solve(graph, solver: str, stages: int, node, *, seed: int = 0, generations: int = 40):
    """The Partition of `graph` (an OperationGraph) that `solver` finds over at most `stages` nodes like `node`."""
    import numpy as np

    from nesa_node.sharding.brkga import BrkgaSettings, brkga_partition
    from nesa_node.sharding.partition import kahn_order, slice_order, uniform_partition

    nodes = [node] * min(stages, graph.size)
    if solver == "dp":
        return slice_order(graph, kahn_order(graph), nodes)
    if solver == "brkga":
        settings = BrkgaSettings(generations=generations)
        return brkga_partition(graph, nodes, rng=np.random.default_rng(seed), settings=settings).partition
    if solver == "uniform":  # as GraphPlan without an assignment (plan.build_stages)
        return uniform_partition(graph, kahn_order(graph), nodes, np.ones(graph.size))
    raise ValueError(f"unknown solver {solver!r}; one of {', '.join(SOLVERS)}")


def stage_summary(graph, partition) -> list[dict[str, float]]:
    """Per stage of `partition`: operations, work (s), parameter bytes, bytes in and out across its border (eq. 8:
    distinct tensors), cost (eq. 10, s)."""
    rows = []
    for index, segment in enumerate(partition.segments):
        ids = list(segment)
        inside = set(ids)
        into = {u for u, v in graph.edges if v in inside and u not in inside}
        out_of = {u for u, v in graph.edges if u in inside and v not in inside}
        rows.append(
            {
                "operations": len(ids),
                "work_s": float(graph.work[ids].sum()),
                "param_bytes": float(graph.size_param[ids].sum()),
                "bytes_in": float(sum(graph.size_out[u] for u in into)),
                "bytes_out": float(sum(graph.size_out[u] for u in out_of)),
                "cost_s": partition.costs[index],
            }
        )
    return rows


def make_plan(args: argparse.Namespace) -> int:
    """`nesa-node graph plan`: trace, partition, write the plan file, print the summary."""
    from nesa_node.graph.plan import GraphPlan, plan_from_partition
    from nesa_node.sharding.graph import FALLBACK_FLOPS_PER_SECOND, trace_graph
    from nesa_node.sharding.partition import NodeProfile

    module, inputs = load_model(args.graph_model)
    try:
        traced = trace_graph(module, inputs, repeats=args.profile_runs)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot trace {args.graph_model} with torch.fx: {type(exc).__name__}: {exc}"[:500]
        ) from None
    graph = traced.graph
    node = NodeProfile(bandwidth=args.bandwidth_mbit * 1e6 / 8)
    partition = solve(graph, args.solver, args.stages, node, seed=args.seed, generations=args.generations)
    used = len(partition.ends)
    if args.solver == "uniform" and used == args.stages:
        plan = GraphPlan(args.graph_model, args.stages)  # no assignment: the plan `run --graph-model` serves
    else:
        plan = plan_from_partition(args.graph_model, traced, partition, used)
    Path(args.out).write_text(json.dumps(json.loads(plan.to_json()), indent=1, sort_keys=True) + "\n")

    work = (
        f"median of {args.profile_runs} timed runs"
        if args.profile_runs
        else f"FLOP counts at {FALLBACK_FLOPS_PER_SECOND / 1e9:g} GFLOP/s"
    )
    print(
        f"{args.graph_model}: {graph.size} operations, {graph.work.sum() * 1e3:.2f} ms of work ({work}), "
        f"{_size(graph.size_param.sum())} of parameters"
    )
    print(f"{args.solver}: {_count(used, 'stage')}, bottleneck {partition.bottleneck * 1e3:.3f} ms per input")
    if used < args.stages:
        print(f"  ({used} of the {args.stages} stages asked: another stage would not lower the bottleneck)")
    print(f"{'stage':>5} {'operations':>10} {'work ms':>9} {'parameters':>11} {'bytes in':>10} {'bytes out':>10} "
          f"{'cost ms':>9}")  # fmt: skip
    for index, row in enumerate(stage_summary(graph, partition)):
        print(
            f"{index:>5} {row['operations']:>10} {row['work_s'] * 1e3:>9.3f} {_size(row['param_bytes']):>11} "
            f"{_size(row['bytes_in']):>10} {_size(row['bytes_out']):>10} {row['cost_s'] * 1e3:>9.3f}"
        )
    print(f"wrote {args.out}: {_count(used, 'stage')}, DHT key {plan.dht_prefix}")
    print(f"serve stage I with: nesa-node run --graph-plan {args.out} --stage I --initial-peers MADDR")
    return 0


# ---- graph infer -----------------------------------------------------------------------------------------------


def example_inputs(inputs, seed: int | None):
    """`inputs` as they are (seed None), or standard normal tensors of their shapes and dtypes drawn from `seed`
    (tensors that are not floating point are kept)."""
    import torch

    if seed is None:
        return tuple(inputs)
    generator = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(value.shape, generator=generator, dtype=value.dtype) if value.is_floating_point() else value
        for value in inputs
    )


def max_difference(first, second) -> float:
    """The largest absolute difference between the tensors of two outputs, leaf by leaf; inf when their tensor
    counts or shapes differ."""
    from torch.utils._pytree import tree_leaves

    first, second = tree_leaves(first), tree_leaves(second)
    if len(first) != len(second) or any(a.shape != b.shape for a, b in zip(first, second, strict=True)):
        return math.inf
    pairs = list(zip(first, second, strict=True))
    return max((float((a.double() - b.double()).abs().max()) for a, b in pairs if a.numel()), default=0.0)


async def missing_stages(swarm, plan: GraphPlan) -> list[int]:
    """The stages of `plan` that no online node announces."""
    from nesa_node.protocol.dht import fetch_node_infos
    from nesa_node.protocol.records import NodeState

    found = await fetch_node_infos(swarm.dht, plan.dht_prefix)
    served = {record.info.start_block for record in found if record.info.state == NodeState.online}
    return [stage for stage in range(plan.stages) if stage not in served]


async def wait_for_stages(swarm, plan: GraphPlan, plan_path: str, wait_s: float) -> None:
    """Return once a node of every stage is announced; NoRouteError naming the missing stages after `wait_s`."""
    deadline = time.monotonic() + wait_s
    missing = list(range(plan.stages))
    while True:
        try:
            async with asyncio.timeout(max(0.5, deadline - time.monotonic())):
                missing = await missing_stages(swarm, plan)
        except TimeoutError:
            pass
        if not missing:
            return
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    names = ", ".join(map(str, missing))
    raise NoRouteError(
        f"no node serves stage{'s' if len(missing) > 1 else ''} {names} of {plan_path} (DHT key {plan.dht_prefix}) "
        f"after {wait_s:g} s: start `nesa-node run --graph-plan {plan_path} --stage {missing[0]} --initial-peers "
        "...`; every stage must be started from this plan file"
    )


def infer(args: argparse.Namespace) -> int:
    """`nesa-node graph infer`: the pipeline's outputs, time, and with --compare the difference from one process."""
    import torch
    from torch.utils._pytree import tree_leaves

    from nesa_node import event_loop
    from nesa_node.client.swarm import Swarm
    from nesa_node.graph.pipeline import GraphPipeline

    plan = load_plan(args.graph_plan)
    module, inputs = load_model(plan.factory)
    inputs = example_inputs(inputs, args.seed)

    async def run_pipeline():
        async with await Swarm.create(args.initial_peers, dht_prefix=plan.dht_prefix) as swarm:
            pipeline = await asyncio.to_thread(GraphPipeline, swarm, plan)
            await wait_for_stages(swarm, plan, args.graph_plan, args.wait_s)
            outputs, seconds = None, []
            for _ in range(args.runs):
                started = time.perf_counter()
                try:
                    result = await pipeline.forward(*inputs)
                except TimeoutError:
                    raise PeerUnavailableError(
                        f"the stages did not answer within {swarm.request_timeout_s * plan.stages:g} s"
                    ) from None
                seconds.append(time.perf_counter() - started)
                outputs = result if outputs is None else outputs
            return outputs, seconds

    outputs, seconds = event_loop.run(run_pipeline())
    print(f"{plan.factory}: {_count(plan.stages, 'stage')} (DHT key {plan.dht_prefix})")
    for index, value in enumerate(tree_leaves(outputs)):
        print(f"output {index}: shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}")
    timing = f"forward through the swarm: {seconds[0] * 1e3:.1f} ms"
    if len(seconds) > 1:
        later = sorted(seconds[1:])
        timing += f" (first run), median of the next {len(later)}: {later[len(later) // 2] * 1e3:.1f} ms"
    print(timing)
    if not args.compare:
        return 0
    with torch.no_grad():
        expected = module(*inputs)
    difference = max_difference(outputs, expected)
    within = difference <= COMPARE_TOLERANCE
    print(
        f"max abs difference from the single-process forward: {difference:.3g} "
        f"({'within' if within else 'above'} the tolerance {COMPARE_TOLERANCE:g})"
    )
    return 0 if within else 1

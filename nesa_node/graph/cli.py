"""`nesa-node run --graph-model package.module:factory --stage i --stages k` (or `--graph-plan plan.json`):
serve one stage of a graph model (nesa_node.graph.stage). `nesa_node.cli` adds these options to `run`.
"""

from __future__ import annotations

import argparse
import asyncio


def add_arguments(run: argparse.ArgumentParser) -> None:
    """The graph-model options of `nesa-node run` (the other options it shares with a block node)."""
    group = run.add_argument_group("graph models (MTPP stages; instead of --model/--blocks)")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--graph-model", metavar="MODULE:FACTORY", help="factory returning (module, example_inputs)")
    source.add_argument(
        "--graph-plan", metavar="FILE", help="plan JSON file (factory, stages, stage of every operation)"
    )
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


def run_graph_stage(args: argparse.Namespace) -> int:
    """Serve one stage until SIGINT/SIGTERM (arguments checked by check_arguments)."""
    from nesa_node import event_loop
    from nesa_node.graph.plan import GraphPlan
    from nesa_node.graph.stage import GraphStageConfig, GraphStageNode
    from nesa_node.peer import write_address_file

    plan = GraphPlan.load(args.graph_plan) if args.graph_plan else GraphPlan(args.graph_model, args.stages)
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

        await event_loop.serve_until_signal(start, node.shutdown)

    event_loop.run(serve())
    return 0

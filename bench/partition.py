"""MTPP partitioning benchmark (Nesa eq. 8-11, Algorithm 1, BRKGA): prints one JSON line.

1. Partition time on synthetic layered DAGs of 1,000 and 10,000 operations at k = 8: the O(n^2 k) reference DP
   (1,000 only: its n^2 table of 10,000 would take 800 MB per term), the fast exact DP, and BRKGA with its budget
   (max distinct orders sliced), with the bottleneck each finds.
2. The three graph models (ResNet-, ViT-, U-Net-style), profiled on this CPU: the modelled bottleneck (seconds per
   input, eq. 11) of uniform splits by operation count and by parameter bytes, of the DP on Kahn's order and of
   BRKGA, for k = 2, 3, 4, and the improvement of each solver over the better uniform split.
3. Unless --no-swarm: the same models at k = 3 served by 3 local graph-stage nodes on loopback; inputs/s of a
   pipelined run (all inputs in flight) for each plan, median of --repeats.

    python bench/partition.py [--seed 0] [--threads 1] [--no-swarm] [--repeats 3] [--batches 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.graph.models import FACTORIES  # noqa: E402
from nesa_node.graph.plan import GraphPlan, plan_from_partition  # noqa: E402
from nesa_node.sharding.brkga import BrkgaSettings, brkga_partition  # noqa: E402
from nesa_node.sharding.graph import trace_graph  # noqa: E402
from nesa_node.sharding.partition import (  # noqa: E402
    NodeProfile,
    OperationGraph,
    kahn_order,
    slice_order,
    slice_order_reference,
    uniform_partition,
)

NODE = NodeProfile(bandwidth=1.25e9)  # a 10 Gbit/s link between nodes (guess for a LAN swarm)
SLOW_NODE = NodeProfile(bandwidth=1.25e8)  # 1 Gbit/s: where the U-Net's skip tensors make the cut placement matter
SYNTHETIC_BUDGET = {1000: 48, 10000: 6}  # BRKGA evaluations per graph size: seconds, not minutes, here
MODEL_SEARCH = BrkgaSettings(population=24, generations=40, patience=12)


def layered_graph(rng: np.random.Generator, size: int, width: int = 8) -> OperationGraph:
    """Layers of `width` operations, each reading two of the previous layer, plus skips of 2-5 layers (one per 20
    operations); work ~ lognormal around 0.1 ms, outputs 1-64 KiB, parameters up to 1 MiB."""
    layers = [list(range(start, min(start + width, size))) for start in range(0, size, width)]
    edges = [
        (int(u), v)
        for previous, layer in zip(layers, layers[1:], strict=False)
        for v in layer
        for u in rng.choice(previous, size=min(2, len(previous)), replace=False)
    ]
    for _ in range(size // 20):
        u = int(rng.integers(0, size - 3 * width))
        v = u + width * int(rng.integers(2, 6))
        if v < size:
            edges.append((u, v))
    return OperationGraph(
        names=tuple(f"op{index}" for index in range(size)),
        work=rng.lognormal(-9.2, 1.0, size),
        size_param=rng.integers(0, 1 << 20, size).astype(float),
        size_out=rng.integers(1 << 10, 1 << 16, size).astype(float),
        edges=tuple(edges),
    )


def timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def synthetic_section(seed: int) -> dict:
    out = {}
    for size in (1000, 10000):
        graph = layered_graph(np.random.default_rng(seed), size)
        nodes, order = [NODE] * 8, kahn_order(graph)
        fast, fast_s = timed(slice_order, graph, order, nodes)
        entry = {"fast_dp_s": round(fast_s, 4), "fast_dp_bottleneck_s": fast.bottleneck}
        if size <= 1000:
            reference, reference_s = timed(slice_order_reference, graph, order, nodes)
            entry |= {
                "reference_dp_s": round(reference_s, 4),
                "reference_equals_fast": reference.bottleneck == fast.bottleneck,
            }
        else:
            entry |= {"reference_dp_s": None, "reference_skipped": "n^2 table of 10,000 operations: 800 MB per term"}
        search = BrkgaSettings(population=12, max_evaluations=SYNTHETIC_BUDGET[size])
        found, brkga_s = timed(brkga_partition, graph, nodes, rng=np.random.default_rng(seed), settings=search)
        entry |= {
            "brkga_s": round(brkga_s, 3),
            "brkga_evaluations": found.evaluations,
            "brkga_bottleneck_s": found.partition.bottleneck,
        }
        out[str(size)] = entry
    return out


def model_section(seed: int) -> tuple[dict, dict]:
    out, plans = {}, {}
    for name in sorted(FACTORIES):
        module, inputs = FACTORIES[name]()
        traced, trace_s = timed(trace_graph, module, inputs, repeats=5)
        graph, order = traced.graph, kahn_order(traced.graph)
        entry = {"operations": graph.size, "trace_and_profile_s": round(trace_s, 2)}
        for k in (2, 3, 4):
            nodes = [NODE] * k
            by_count = uniform_partition(graph, order, nodes, np.ones(graph.size))
            by_params = uniform_partition(graph, order, nodes, graph.size_param)
            dp, dp_s = timed(slice_order, graph, order, nodes)
            found, brkga_s = timed(
                brkga_partition, graph, nodes, rng=np.random.default_rng(seed), settings=MODEL_SEARCH
            )
            uniform_best = min(by_count.bottleneck, by_params.bottleneck)
            entry[f"k{k}"] = {
                "uniform_ops_s": by_count.bottleneck,
                "uniform_params_s": by_params.bottleneck,
                "dp_kahn_s": dp.bottleneck,
                "brkga_s": found.partition.bottleneck,
                "dp_vs_uniform": round(uniform_best / dp.bottleneck, 3),
                "brkga_vs_uniform": round(uniform_best / found.partition.bottleneck, 3),
                "brkga_vs_dp_kahn": round(dp.bottleneck / found.partition.bottleneck, 3),
                "dp_time_s": round(dp_s, 4),
                "brkga_time_s": round(brkga_s, 2),
                "brkga_evaluations": found.evaluations,
            }
            if k == 3:
                factory = f"nesa_node.graph.models:{name}"
                plans[name] = {
                    "uniform_ops": plan_from_partition(factory, traced, by_count, k),
                    "uniform_params": plan_from_partition(factory, traced, by_params, k),
                    "dp_kahn": plan_from_partition(factory, traced, dp, k),
                    "brkga": plan_from_partition(factory, traced, found.partition, k),
                }
        out[name] = entry
    return out, plans


def slow_link_section(seed: int) -> dict:
    """The U-Net on 1 Gbit/s links: BRKGA against the DP on Kahn's order when transfers weigh more."""
    module, inputs = FACTORIES["unet_tiny"]()
    graph = trace_graph(module, inputs, repeats=5).graph
    order = kahn_order(graph)
    out = {"node_bandwidth_bytes_per_s": SLOW_NODE.bandwidth}
    for k in (2, 3, 4):
        nodes = [SLOW_NODE] * k
        dp = slice_order(graph, order, nodes)
        found = brkga_partition(graph, nodes, rng=np.random.default_rng(seed), settings=MODEL_SEARCH)
        out[f"k{k}"] = {
            "dp_kahn_s": dp.bottleneck,
            "brkga_s": found.partition.bottleneck,
            "brkga_vs_dp_kahn": round(dp.bottleneck / found.partition.bottleneck, 3),
        }
    return out


def swarm_section(plans: dict[str, dict[str, GraphPlan]], repeats: int, batches: int) -> dict:
    from nesa_node.bootstrap import BootstrapPeer
    from nesa_node.client.swarm import Swarm
    from nesa_node.graph.pipeline import GraphPipeline
    from nesa_node.graph.stage import GraphStageConfig, GraphStageNode

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine, timeout=120):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    bootstrap, nodes, client, out = run(BootstrapPeer.create()), [], None, {}
    try:
        peers = tuple(run(bootstrap.visible_maddrs()))
        all_plans = [plan for by_kind in plans.values() for plan in by_kind.values()]
        for stage in range(3):
            config = GraphStageConfig(stages=tuple((plan, stage) for plan in all_plans), initial_peers=peers)
            nodes.append(run(GraphStageNode.create(config)))
            run(nodes[-1].start())
        client = run(Swarm.create(list(peers), dht_prefix="bench-partition"))
        for name, by_kind in plans.items():
            _, inputs = FACTORIES[name]()
            out[name] = {}
            for kind, plan in by_kind.items():
                pipeline = GraphPipeline(client, plan)
                for _ in range(100):
                    try:
                        run(pipeline.stage_peers())
                        break
                    except Exception:
                        time.sleep(0.3)
                run(pipeline.forward_many([inputs] * 2))  # warm-up
                rates = []
                for _ in range(repeats):
                    _, seconds = timed(
                        lambda batch, pipeline=pipeline: run(pipeline.forward_many(batch)), [inputs] * batches
                    )
                    rates.append(batches / seconds)
                out[name][kind] = round(statistics.median(rates), 1)
    finally:
        if client is not None:
            run(client.close())
        for node in nodes:
            run(node.shutdown(), timeout=60)
        run(bootstrap.shutdown(), timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--no-swarm", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, default=16, help="inputs in flight per measured pipelined run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"bench": "partition", "k_synthetic": 8, "node_bandwidth_bytes_per_s": NODE.bandwidth}
    result["synthetic"] = synthetic_section(args.seed)
    result["models"], plans = model_section(args.seed)
    result["unet_1gbit"] = slow_link_section(args.seed)
    if not args.no_swarm:
        result["served_k3_inputs_per_s"] = swarm_section(plans, args.repeats, args.batches)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Topology benchmark: persistence-diagram speed, snapshot distance speed, and the trigger comparison.

Prints ONE JSON line to stdout (progress goes to stderr):

- snapshot_s: per swarm size (100, 1,000, 10,000 nodes of the global scenario), the median wall time of one
  snapshot -> swarm graph (`graph_s`) -> H0 + H1 diagrams (`diagrams_s`), and their sum (`total_s`). Targets:
  1,000 nodes under 0.5 s, 10,000 under 5 s. `sparse_rips_1000_s`: gudhi's sparse Rips (epsilon 0.5, dimension 2)
  on the same 1,000 lifted points, the alternative filtration (see topology/graph.py).
- bottleneck_s: median time of the three snapshot distances (bottleneck H0, H1, features) between two
  1,000-node snapshots.
- triggers: six hours of the `global-600-six-hours` scenario (churn, an Asian outage, a cluster joining, a
  European outage, a degraded transatlantic backbone) under each trigger: mean and 10th-percentile true swarm
  throughput (tokens/s), block moves, expected requests dropped by moves, firings. `homology_vs_best`: the
  homology trigger's mean throughput relative to the best trigger's, and its moves relative to that trigger's.
  Target: throughput within 5% of the best with at most half its moves.
- schemas: precomputed sharding schemas (topology/schemas.py) on `--schema-nodes` nodes of the global scenario in
  five states (all up, Asia down, Europe down, a cluster joined in Sao Paulo, the transatlantic backbone 4x slower):
  a book from 6 snapshots per state, then 4 held-out snapshots per state (other times, other remeasure seeds).
  `classes` found, held-out `accuracy` (the picked class is the state's class), the ratio of the picked schema's
  bottleneck throughput to recomputing (balancing.best_placement) from scratch (mean and worst), and median times:
  `classifier_s` (features -> class), `classify_apply_s` (classify + apply, the diagrams already made by the
  monitor), `diagrams_s` (snapshot -> features, if the monitor had not made them), `recompute_s`. Targets: accuracy
  and the worst ratio >= 0.95, classify + apply under a tenth of recomputing.
- novelty: the book's radius (a snapshot beyond it is a state the book does not know, and nodes recompute), on
  `--novelty-nodes` nodes of the same five states: each state left out of a book of the other four in turn.
  `known_within_radius` is the share of held-out snapshots of the book's states within its radius,
  `unknown_beyond_radius` that of the left-out state's snapshots beyond it; the distances are in units of each book's
  widest own spread. Target: both 1.0.
- book_in_life: six hours of `global-600-six-hours` under the homology trigger alone and following a schema book as
  nodes given `--schema-book` do (topology/adoption.py), the book built from 3 remeasured snapshots at each of 10
  other times of the scenario (its five states, 5 classes), at the book's default margin and at balancing's 5%:
  mean and 10th-percentile throughput, moves, expected requests dropped. Reported as measured; no target.

    python bench/topology.py [--repeats 5] [--skip-triggers] [--schema-nodes 1000] [--novelty-nodes 200]

Timings on a shared machine are noisy; the JSON carries the load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.routing.scenarios import SCENARIOS, City, ClusterJoin, LinkDegradation, Outage  # noqa: E402
from nesa_node.routing.simulate import Simulator  # noqa: E402
from nesa_node.sharding.balancing import best_placement, placement_from_snapshot  # noqa: E402
from nesa_node.topology.adoption import SCHEMA_MARGIN  # noqa: E402
from nesa_node.topology.graph import swarm_graph  # noqa: E402
from nesa_node.topology.homology import diagrams, features  # noqa: E402
from nesa_node.topology.life import LifeConfig, calibrate, simulate_life  # noqa: E402
from nesa_node.topology.monitor import snapshot_distances  # noqa: E402
from nesa_node.topology.schemas import (  # noqa: E402
    FAR_FACTOR,
    apply_schema,
    bottleneck_throughput,
    build_book,
    classify,
)
from nesa_node.topology.triggers import HomologyTrigger, LoadVariationTrigger, PeriodicTrigger  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median_time(function, repeats: int) -> tuple[float, object]:
    seconds, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def snapshot_timing(nodes: int, repeats: int) -> dict:
    simulator = Simulator(replace(SCENARIOS["global-1000"], name=f"global-{nodes}", num_nodes=nodes, duration_s=600))
    snapshot = simulator.snapshot(300.0)
    graph_s, graph = median_time(lambda: swarm_graph(snapshot), repeats)
    diagrams_s, result = median_time(lambda: diagrams(graph), repeats)
    entry = {
        "nodes_listed": len(snapshot.nodes),
        "edges": len(graph.edges),
        "graph_s": graph_s,
        "diagrams_s": diagrams_s,
        "total_s": graph_s + diagrams_s,
        "h0_bars": len(result.h0),
        "h1_bars": len(result.h1),
    }
    log(f"  {nodes} nodes: graph {graph_s:.3f} s, diagrams {diagrams_s:.3f} s, {len(graph.edges)} edges")
    if nodes == 1000:
        import gudhi

        points = np.column_stack([graph.positions, graph.node_delay_ms])

        def sparse_rips():
            tree = gudhi.RipsComplex(points=points, sparse=0.5).create_simplex_tree(max_dimension=2)
            tree.compute_persistence()
            return tree

        entry["sparse_rips_1000_s"], _ = median_time(sparse_rips, max(1, repeats // 2))
        first = result
        second = diagrams(swarm_graph(simulator.snapshot(300.0, remeasure_seed=1)))
        entry["bottleneck_s"], _ = median_time(lambda: snapshot_distances(first, second), repeats)
    return entry


def trigger_table() -> dict:
    simulator = Simulator(SCENARIOS["global-600-six-hours"])
    started = time.perf_counter()
    threshold = calibrate(simulator)
    log(f"  calibration: {threshold} in {time.perf_counter() - started:.1f} s")
    table = {}
    for trigger in (PeriodicTrigger(), LoadVariationTrigger(), HomologyTrigger(threshold)):
        started = time.perf_counter()
        result = simulate_life(simulator, trigger)
        table[trigger.name] = result.summary() | {"wall_s": time.perf_counter() - started}
        hourly = result.throughput_tps.reshape(6, -1).mean(axis=1)
        table[trigger.name]["hourly_mean_throughput_tps"] = [float(value) for value in hourly]
        log(f"  {trigger.name}: {json.dumps(table[trigger.name])}")
    best = max(table, key=lambda name: table[name]["mean_throughput_tps"])
    homology = table["homology"]
    return {
        "scenario": "global-600-six-hours",
        "threshold": {"h0_ms": threshold.h0, "h1_ms": threshold.h1, "features": threshold.features},
        "table": table,
        "best": best,
        "homology_vs_best": {
            "throughput_ratio": homology["mean_throughput_tps"] / table[best]["mean_throughput_tps"],
            "moves_ratio": homology["moves"] / max(table[best]["moves"], 1),
        },
    }


def schema_table(nodes: int, book_per_state: int = 6, held_out_per_state: int = 4) -> dict:
    states = five_states(nodes)
    base = replace(SCENARIOS["global-1000"], name=f"global-{nodes}-states", num_nodes=nodes, duration_s=3 * 3600)
    simulators = [Simulator(replace(base, **events)) for events in states.values()]
    book_snapshots = [
        sim.snapshot(300.0 + 600.0 * i, remeasure_seed=i) for sim in simulators for i in range(book_per_state)
    ]
    started = time.perf_counter()
    book_diagrams = [diagrams(swarm_graph(snapshot)) for snapshot in book_snapshots]
    book = build_book(book_snapshots, rng=np.random.default_rng(0), snapshot_diagrams=book_diagrams)
    build_s = time.perf_counter() - started
    book_labels = np.array([classify(book, features(entry))[0] for entry in book_diagrams])
    # each state's class: the class most of its book snapshots fall in
    expected = [int(np.bincount(row).argmax()) for row in book_labels.reshape(len(states), book_per_state)]
    log(f"  book of {len(book_snapshots)} snapshots: {len(book.schemas)} classes in {build_s:.1f} s")
    correct, ratios, recomputed = 0, [], 0
    timings: dict[str, list[float]] = {"classifier_s": [], "classify_apply_s": [], "diagrams_s": [], "recompute_s": []}
    for state, sim in enumerate(simulators):
        for i in range(held_out_per_state):
            snapshot = sim.snapshot(390.0 + 900.0 * i, remeasure_seed=1000 + i)
            started = time.perf_counter()
            vector = features(diagrams(swarm_graph(snapshot)))
            timings["diagrams_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            label, _ = classify(book, vector)
            timings["classifier_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            assignment = apply_schema(snapshot, book, feature_vector=vector)
            timings["classify_apply_s"].append(time.perf_counter() - started)
            placement = placement_from_snapshot(snapshot, book.demand)
            started = time.perf_counter()
            best = best_placement(placement)
            timings["recompute_s"].append(time.perf_counter() - started)
            correct += int(label == expected[state])
            recomputed += int(assignment.recomputed)
            ratios.append(assignment.throughput_tps / bottleneck_throughput(best))
    ratios_array = np.array(ratios)
    per_state = ratios_array.reshape(len(states), held_out_per_state)
    result = {
        "nodes": nodes,
        "states": list(states),
        "classes": len(book.schemas),
        "book_snapshots": len(book_snapshots),
        "held_out_snapshots": len(ratios),
        "book_build_s": build_s,
        "accuracy": correct / len(ratios),
        "throughput_ratio_mean": float(ratios_array.mean()),
        "throughput_ratio_worst": float(ratios_array.min()),
        "throughput_ratio_worst_per_state": dict(zip(states, (float(row.min()) for row in per_state), strict=True)),
        "recomputed": recomputed,
    } | {name: statistics.median(values) for name, values in timings.items()}
    log(f"  schemas: {json.dumps(result)}")
    return result


def stability_under_churn(requests: int, seeds: tuple[int, ...] = (101, 102, 103)) -> dict:
    """Sec. 3.1 under churn: requests of the `global-1000-churn` scenario (as it is) routed by eq. 18 with the
    snapshot's reliability as announced ("plain") and raised by each node's stability over the last 30 announce ticks
    ("stable": client/stability.py's rule, a node missing from a tick counting 0), on held-out request seeds. A
    request fails when a node of its chain is gone at its start or leaves before its end (the simulator's truth)."""
    from nesa_node.errors import NoRouteError
    from nesa_node.routing.chain import select_chain
    from nesa_node.routing.cost import RoutingParams
    from nesa_node.topology.monitor import node_stability, stable_reliability, temporal_stability

    simulator = Simulator(SCENARIOS["global-1000-churn"])
    period = simulator.scenario.announce_period_s
    per_tick: dict[int, dict[str, float]] = {}

    def stability_at(time_s: float) -> dict[str, float]:
        tick = int(time_s // period)
        for back in range(max(0, tick - 29), tick + 1):
            if back not in per_tick:
                per_tick[back] = node_stability(swarm_graph(simulator.snapshot(back * period)))
        return temporal_stability([per_tick[back] for back in range(max(0, tick - 29), tick + 1)])

    params = RoutingParams()
    outcomes: dict[str, list[tuple[bool, float]]] = {"plain": [], "stable": []}
    started = time.perf_counter()
    for seed in seeds:
        for request in simulator.requests(requests, seed):
            snapshot = simulator.snapshot(request.time_s)
            views = {"plain": snapshot, "stable": stable_reliability(snapshot, stability_at(request.time_s))}
            for name, view in views.items():
                try:
                    chain = select_chain(view, simulator.chain_request(request), params=params)
                except NoRouteError:
                    outcomes[name].append((True, math.inf))
                    continue
                latency = simulator.latency_s(chain, request)
                failed = any(
                    simulator.leaves_at(int(peer[4:]), request.time_s) < request.time_s + latency
                    for peer in chain.peer_ids
                )
                outcomes[name].append((failed, latency))
    result: dict = {"scenario": simulator.scenario.name, "requests": len(outcomes["plain"]), "seeds": list(seeds)}
    for name, rows in outcomes.items():
        latencies = np.array([latency for _, latency in rows])
        finite = latencies[np.isfinite(latencies)]
        result[name] = {
            "failed_rate": sum(failed for failed, _ in rows) / len(rows),
            "mean_s": float(finite.mean()) if finite.size else math.inf,
            "p95_s": float(np.percentile(finite, 95)) if finite.size else math.inf,
        }
    result["failed_ratio_stable_vs_plain"] = (
        result["stable"]["failed_rate"] / result["plain"]["failed_rate"] if result["plain"]["failed_rate"] else None
    )
    result["seconds"] = time.perf_counter() - started
    log(f"  stability under churn: {json.dumps(result)}")
    return result


def five_states(nodes: int) -> dict:
    europe, america, asia = tuple(range(7)), tuple(range(7, 12)), tuple(range(12, 17))
    return {
        "all up": {},
        "asia down": {"outages": (Outage(asia, 0.0),)},
        "europe down": {"outages": (Outage(europe, 0.0),)},
        "cluster joined": {"joins": (ClusterJoin(City("Sao Paulo", -23.5, -46.6), nodes // 5, 0.0),)},
        "transatlantic slow": {"degradations": (LinkDegradation(europe, america, 4.0, 0.0),)},
    }


def novelty_table(nodes: int, book_per_state: int = 6, held_out_per_state: int = 4) -> dict:
    states = five_states(nodes)
    base = replace(SCENARIOS["global-1000"], name=f"global-{nodes}-states", num_nodes=nodes, duration_s=3 * 3600)
    simulators = [Simulator(replace(base, **events)) for events in states.values()]
    book_snapshots = [[sim.snapshot(300.0 + 600.0 * i, remeasure_seed=i) for i in range(book_per_state)]
                      for sim in simulators]  # fmt: skip
    book_diagrams = [[diagrams(swarm_graph(snapshot)) for snapshot in row] for row in book_snapshots]
    held_out = [
        [features(diagrams(swarm_graph(sim.snapshot(390.0 + 900.0 * i, remeasure_seed=1000 + i))))
         for i in range(held_out_per_state)]
        for sim in simulators
    ]  # fmt: skip
    known_in = known_total = unknown_out = unknown_total = 0
    known_max = unknown_min = None
    per_state = {}
    for left, name in enumerate(states):
        keep = [index for index in range(len(states)) if index != left]
        book = build_book(
            [snapshot for index in keep for snapshot in book_snapshots[index]],
            rng=np.random.default_rng(0),
            snapshot_diagrams=[entry for index in keep for entry in book_diagrams[index]],
        )
        spread = book.radius / FAR_FACTOR
        known = [classify(book, vector)[1] / spread for index in keep for vector in held_out[index]]
        unknown = [classify(book, vector)[1] / spread for vector in held_out[left]]
        known_in += sum(value <= FAR_FACTOR for value in known)
        unknown_out += sum(value > FAR_FACTOR for value in unknown)
        known_total, unknown_total = known_total + len(known), unknown_total + len(unknown)
        known_max = max(known + ([known_max] if known_max is not None else []))
        unknown_min = min(unknown + ([unknown_min] if unknown_min is not None else []))
        per_state[name] = {"classes": len(book.schemas), "known_max": max(known), "unknown_min": min(unknown)}
        log(f"  {name} left out: {json.dumps(per_state[name])}")
    return {
        "nodes": nodes,
        "far_factor": FAR_FACTOR,
        "known_within_radius": known_in / known_total,
        "unknown_beyond_radius": unknown_out / unknown_total,
        "known_max_over_spread": known_max,
        "unknown_min_over_spread": unknown_min,
        "per_state_left_out": per_state,
    }


def book_in_life() -> dict:
    hour = 3600.0
    scenario = SCENARIOS["global-600-six-hours"]
    times = [0.5, 1.0, 1.75, 2.25, 3.25, 3.75, 4.1, 4.4, 5.25, 5.75]  # hours: two in each of the five states
    simulator = Simulator(scenario)
    snapshots = [simulator.snapshot(hours * hour + 120 * k + 7, remeasure_seed=100 + k) for hours in times
                 for k in range(3)]  # fmt: skip
    started = time.perf_counter()
    book = build_book(snapshots, rng=np.random.default_rng(0), classes=5)
    log(f"  book of {len(snapshots)} snapshots, {len(book.schemas)} classes in {time.perf_counter() - started:.1f} s")
    threshold = calibrate(simulator)
    table = {}
    for name, chosen, config in (
        ("homology", None, LifeConfig()),
        ("homology+book", book, LifeConfig()),
        ("homology+book_margin_5pct", book, LifeConfig(schema_margin=0.05)),
    ):
        started = time.perf_counter()
        result = simulate_life(simulator, HomologyTrigger(threshold), config, book=chosen)
        table[name] = result.summary() | {"wall_s": time.perf_counter() - started}
        log(f"  {name}: {json.dumps(table[name])}")
    alone = table["homology"]
    return {
        "scenario": scenario.name,
        "schema_margin": SCHEMA_MARGIN,
        "table": table,
        "book_vs_alone": {
            name: {
                "throughput_ratio": row["mean_throughput_tps"] / alone["mean_throughput_tps"],
                "p10_ratio": row["p10_throughput_tps"] / alone["p10_throughput_tps"],
                "moves_ratio": row["moves"] / max(alone["moves"], 1),
            }
            for name, row in table.items()
            if name != "homology"
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-triggers", action="store_true", help="timings only")
    parser.add_argument("--schema-nodes", type=int, default=1000, help="swarm size of the schema section")
    parser.add_argument("--novelty-nodes", type=int, default=200, help="swarm size of the novelty section")
    parser.add_argument(
        "--stability-requests", type=int, default=200, help="requests per held-out seed, stability under churn"
    )
    args = parser.parse_args()
    result: dict = {"bench": "topology", "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}
    log("snapshot -> diagrams")
    result["snapshot_s"] = {str(nodes): snapshot_timing(nodes, args.repeats) for nodes in (100, 1000, 10000)}
    result["bottleneck_s"] = result["snapshot_s"]["1000"].pop("bottleneck_s")
    if not args.skip_triggers:
        log("six hours of swarm life per trigger")
        result["triggers"] = trigger_table()
    log("stability-informed reliability under churn")
    result["stability_under_churn"] = stability_under_churn(args.stability_requests)
    log("precomputed schemas")
    result["schemas"] = schema_table(args.schema_nodes)
    result["classifier_time_s"] = result["schemas"]["classifier_s"]
    log("schema book radius: states left out")
    result["novelty"] = novelty_table(args.novelty_nodes)
    if not args.skip_triggers:
        log("six hours of swarm life following a schema book")
        result["book_in_life"] = book_in_life()
    result["loadavg_end"] = os.getloadavg()
    targets = {
        "snapshot_1000_under_0_5s": result["snapshot_s"]["1000"]["total_s"] < 0.5,
        "snapshot_10000_under_5s": result["snapshot_s"]["10000"]["total_s"] < 5.0,
    }
    schemas = result["schemas"]
    targets["schema_accuracy_and_worst_ratio_at_least_0_95"] = (
        schemas["accuracy"] >= 0.95 and schemas["throughput_ratio_worst"] >= 0.95
    )
    targets["schema_classify_apply_under_a_tenth_of_recompute"] = (
        schemas["classify_apply_s"] < 0.1 * schemas["recompute_s"]
    )
    targets["novelty_known_within_and_unknown_beyond_the_radius"] = (
        result["novelty"]["known_within_radius"] == 1.0 and result["novelty"]["unknown_beyond_radius"] == 1.0
    )
    if "triggers" in result:
        ratios = result["triggers"]["homology_vs_best"]
        targets["homology_within_5pct_of_best_with_half_the_moves"] = (
            ratios["throughput_ratio"] >= 0.95 and ratios["moves_ratio"] <= 0.5
        )
    result["targets"] = targets
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""Routing benchmark: select_chain speed, the GA's wall time, and request latency against the baselines.

Prints ONE JSON line to stdout (progress goes to stderr):

- select_chain_ms: time of one select_chain on swarms of 1k, 10k and 100k nodes over 80 blocks (the global
  scenario, scaled), parts of spans allowed, for eq. 2's alpha (`window`) = 0 (exact search) and 2 (beam search),
  and window 0 with whole spans (what live nodes run). Median of warm runs on one snapshot; `first_call_ms` adds
  the one-off conversion of the snapshot to columns. Targets: 10k nodes under 100 ms with window 0.
- ga: wall time of `tune` (30 generations x 40 individuals) on the 1,000-node scenario. Target: under 60 s.
- latency: per scenario, mean and p95 true request latency (s) on held-out request seeds of our router with the
  GA-tuned parameters, against (a) petals' min-latency route, (a') petals' cost with parts of spans allowed (to
  separate its cost from its span rule), (b) a DP over compute latency + rtt with a linear load compensator,
  (c) a random feasible chain, (d) our router untuned (1, 1, 1). All routers read the same noisy snapshot.
- latency.<scenario>.tuning: tuned vs untuned on the held-out requests (mean, p95, the paired standard error), the
  GA's own best before its validation gate (ga.py) and how it does held out, the training gain it claimed, and
  `bound`: the perfect-information bound (routing/bound.py) on the first --bound-requests held-out requests with
  the untuned router on the same ones: how much any setting of the cost could gain at most.
- landscape: on --landscape-requests held-out requests of each heterogeneous scenario, the change in mean latency
  (share of untuned) when one exponent moves off 1, with the share of requests whose chain changes.

    python bench/routing.py [--requests 300] [--seed 0] [--generations 30] [--population 40]
                            [--bound-requests 100] [--landscape-requests 150]

Timings on a shared machine are noisy; the JSON carries the load average at the start and the end, and the GA's
CPU time next to its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nesa_node.errors import NoRouteError  # noqa: E402
from nesa_node.routing.baselines import (  # noqa: E402
    compute_rtt_load_router,
    petals_cost_partial_spans_router,
    petals_router,
    random_router,
)
from nesa_node.routing.bound import bound_latency_s  # noqa: E402
from nesa_node.routing.chain import select_chain, select_chains  # noqa: E402
from nesa_node.routing.cost import RoutingParams  # noqa: E402
from nesa_node.routing.ga import TRAINING_REQUESTS, paired_comparison, population_latency, tune  # noqa: E402
from nesa_node.routing.scenarios import SCENARIOS  # noqa: E402
from nesa_node.routing.simulate import Simulator  # noqa: E402

HELD_OUT_SEED = 1000  # request seed for the latency table; the GA trains on --seed
SLICE_VALUES = (0.5, 0.75, 1.25, 1.5, 2.0)  # exponents tried one at a time for the landscape (others stay 1)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ours(params: RoutingParams):
    return lambda snapshot, request, rng: select_chain(snapshot, request, params=params)


def time_select(nodes: int, params: RoutingParams) -> dict:
    simulator = Simulator(replace(SCENARIOS["global-1000"], name=f"global-{nodes}", num_nodes=nodes, duration_s=600))
    snapshot = simulator.snapshot(300.0)
    requests = [simulator.chain_request(r) for r in simulator.requests(5, HELD_OUT_SEED)]
    started = time.perf_counter()
    select_chain(snapshot, requests[0], params=params)
    result = {"first_call_ms": (time.perf_counter() - started) * 1000, "nodes_listed": len(snapshot.nodes)}
    repeats = {1000: 20, 10000: 10}.get(nodes, 2)
    for label, window, partial in (("window0", 0, True), ("window2", 2, True), ("window0_whole_spans", 0, False)):
        chosen = replace(params, window=window)
        seconds = []
        for repeat in range(repeats):
            request = replace(requests[repeat % len(requests)], partial_spans=partial)
            started = time.perf_counter()
            select_chain(snapshot, request, params=chosen)
            seconds.append(time.perf_counter() - started)
        result[label] = statistics.median(seconds) * 1000
        log(f"  {nodes} nodes, {label}: {result[label]:.1f} ms (median of {repeats})")
    return result


def latency_table(simulator: Simulator, tuned: RoutingParams, count: int) -> dict:
    held_out = simulator.requests(count, HELD_OUT_SEED)
    routers = {
        "tuned": ours(tuned),
        "a_petals": petals_router,
        "a_petals_cost_partial_spans": petals_cost_partial_spans_router,
        "b_compute_rtt_load": compute_rtt_load_router,
        "c_random": random_router,
        "d_untuned_111": ours(RoutingParams(1.0, 1.0, 1.0)),
    }
    table = {}
    for name, router in routers.items():
        latency = simulator.evaluate(router, held_out)
        finite = latency[np.isfinite(latency)]
        table[name] = {
            "mean_s": float(finite.mean()),
            "p95_s": float(np.percentile(finite, 95)),
            "no_route": int((~np.isfinite(latency)).sum()),
        }
        log(f"  {name}: mean {table[name]['mean_s']:.2f} s, p95 {table[name]['p95_s']:.2f} s")
    gains = {
        f"tuned_vs_{name}": {
            "mean": 1 - table["tuned"]["mean_s"] / table[name]["mean_s"],
            "p95": 1 - table["tuned"]["p95_s"] / table[name]["p95_s"],
        }
        for name in routers
        if name != "tuned"
    }
    return {"tuned_params": tuned.to_dict(), "requests": count, "routers": table, "improvement": gains}


def summary(latency: np.ndarray) -> dict:
    return {"mean_s": float(latency.mean()), "p95_s": float(np.percentile(latency, 95))}


def tuning_report(simulator: Simulator, tuned: RoutingParams, history: list[dict], args) -> dict:
    """Tuned vs untuned on the held-out requests, the GA's best before validation, and the perfect-information
    bound (module docstring)."""
    held_out = simulator.requests(args.requests, HELD_OUT_SEED)
    untuned = RoutingParams()
    ga_best = RoutingParams.from_dict(history[-1]["best"])

    def each(params: RoutingParams) -> np.ndarray:
        return simulator.evaluate(
            lambda snapshot, request, rng: select_chain(snapshot, request, params=params), held_out
        )

    untuned_each = each(untuned)
    tuned_each = untuned_each if tuned == untuned else each(tuned)
    best_each = tuned_each if ga_best == tuned else each(ga_best)
    training = simulator.requests(TRAINING_REQUESTS, args.seed)
    claimed = population_latency(simulator, training, [untuned, ga_best])
    report = {
        "tuned": {**tuned.to_dict(), **summary(tuned_each)},
        "untuned": summary(untuned_each),
        "tuned_gain_mean": 1 - tuned_each.mean() / untuned_each.mean(),
        "tuned_gain_p95": 1 - np.percentile(tuned_each, 95) / np.percentile(untuned_each, 95),
        "paired_standard_error_s": paired_comparison(untuned_each, tuned_each)["paired_standard_error_s"],
        "ga_best": {**ga_best.to_dict(), **summary(best_each)},
        "ga_best_gain_mean_held_out": 1 - best_each.mean() / untuned_each.mean(),
        "ga_best_gain_mean_training": 1 - claimed[1] / claimed[0],
        "validation": history[-1].get("validation"),
    }
    if args.bound_requests > 0:
        count = min(args.bound_requests, len(held_out))
        bound = bound_latency_s(simulator, held_out[:count])
        report["bound"] = {
            "requests": count,
            "perfect_information": summary(bound),
            "untuned": summary(untuned_each[:count]),
            "untuned_above_bound_mean": untuned_each[:count].mean() / bound.mean() - 1,
            "untuned_above_bound_p95": np.percentile(untuned_each[:count], 95) / np.percentile(bound, 95) - 1,
        }
    log(f"  tuning: {json.dumps(report)}")
    return report


def landscape(simulator: Simulator, count: int) -> dict:
    """Mean latency change (share of untuned) and share of chains changed, one exponent off 1 at a time."""
    requests = simulator.requests(count, HELD_OUT_SEED)
    population = [RoutingParams()] + [
        RoutingParams(**{gene: value}) for gene in ("gamma", "beta", "alpha") for value in SLICE_VALUES
    ]
    latency = np.zeros((len(population), count))
    changed = np.zeros(len(population))
    for column, request in enumerate(requests):
        chains = select_chains(simulator.snapshot(request.time_s), simulator.chain_request(request), population)
        for row, chain in enumerate(chains):
            found = not isinstance(chain, NoRouteError) and not isinstance(chains[0], NoRouteError)
            latency[row, column] = simulator.latency_s(chain, request) if found else np.inf
            changed[row] += found and chain.hops != chains[0].hops
    result: dict = {"requests": count, "untuned_mean_s": float(latency[0].mean())}
    for row, params in enumerate(population[1:], start=1):
        gene = next(name for name in ("gamma", "beta", "alpha") if getattr(params, name) != 1.0)
        difference = latency[row] - latency[0]
        result.setdefault(gene, {})[str(getattr(params, gene))] = {
            "mean_change": float(latency[row].mean() / latency[0].mean() - 1),
            "standard_error": float(difference.std(ddof=1) / np.sqrt(count) / latency[0].mean()),
            "chains_changed": float(changed[row] / count),
        }
    log(f"  landscape: {json.dumps(result)}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300, help="held-out requests per scenario")
    parser.add_argument("--seed", type=int, default=0, help="GA seed (and its training requests)")
    parser.add_argument("--generations", type=int, default=30)
    parser.add_argument("--population", type=int, default=40)
    parser.add_argument("--bound-requests", type=int, default=100, help="held-out requests for the bound; 0: skip")
    parser.add_argument("--landscape-requests", type=int, default=150, help="requests per exponent slice; 0: skip")
    args = parser.parse_args()
    result: dict = {"bench": "routing", "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}

    def progress(entry: dict) -> None:
        best = entry["best"]
        log(
            f"  generation {entry['generation']}: best {entry['best_latency_s']:.3f} s "
            f"(gamma {best['gamma']:.2f}, beta {best['beta']:.2f}, alpha {best['alpha']:.2f}), "
            f"population {entry['population_latency_s']:.3f} s"
        )

    tuned: dict[str, RoutingParams] = {}
    result["latency"] = {}
    for name in ("global-1000", "global-1000-churn", "continent-200"):
        simulator = Simulator(SCENARIOS[name])
        log(f"GA on {name} ({args.generations} x {args.population})")
        started, cpu_started = time.perf_counter(), time.process_time()
        params, history = tune(
            simulator, generations=args.generations, population=args.population, seed=args.seed, progress=progress
        )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        tuned[name] = params
        if name == "global-1000":
            result["ga"] = {
                "scenario": name,
                "generations": args.generations,
                "population": args.population,
                "training_requests": TRAINING_REQUESTS,
                "wall_s": wall,
                "cpu_s": cpu,  # this process's CPU time: wall minus what other work on the machine took
                "best": params.to_dict(),
                "best_latency_s_generation_0": history[0]["best_latency_s"],
                "best_latency_s_last": history[-1]["best_latency_s"],
                "population_latency_s_generation_0": history[0]["population_latency_s"],
                "population_latency_s_last": history[-1]["population_latency_s"],
            }
        log(f"latency on {name}, {args.requests} held-out requests (GA took {wall:.1f} s)")
        result["latency"][name] = latency_table(simulator, params, args.requests)
        result["latency"][name]["ga_wall_s"] = wall
        result["latency"][name]["ga_cpu_s"] = cpu
        result["latency"][name]["tuning"] = tuning_report(simulator, params, history, args)
        if args.landscape_requests > 0 and name != "continent-200":
            result.setdefault("landscape", {})[name] = landscape(simulator, args.landscape_requests)

    log("select_chain timing")
    result["select_chain_ms"] = {
        str(nodes): time_select(nodes, tuned["global-1000"]) for nodes in (1000, 10000, 100000)
    }
    result["loadavg_end"] = os.getloadavg()
    heterogeneous = [result["latency"][name]["improvement"] for name in ("global-1000", "global-1000-churn")]
    tuning = [result["latency"][name]["tuning"] for name in ("global-1000", "global-1000-churn")]
    result["targets"] = {
        "select_10k_window0_under_100ms": result["select_chain_ms"]["10000"]["window0"] < 100,
        "ga_under_60s": result["ga"]["wall_s"] < 60,
        "tuned_beats_a_and_b_by_10pct_mean": all(
            gains[key]["mean"] >= 0.10
            for gains in heterogeneous
            for key in ("tuned_vs_a_petals", "tuned_vs_b_compute_rtt_load")
        ),
        # issue 26: tuned 5% better than untuned, or the optimum is flat: untuned is within 5% of the
        # perfect-information bound, so no parameter setting can gain 5% (needs --bound-requests > 0)
        "tuned_5pct_better_than_untuned_or_flat": all(
            report["tuned_gain_mean"] >= 0.05 or report.get("bound", {}).get("untuned_above_bound_mean", 1.0) < 0.05
            for report in tuning
        ),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

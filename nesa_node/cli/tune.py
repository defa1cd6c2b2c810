"""`nesa-node tune`: the GA of the Nesa paper's sec. 3.2 over eq. 18's exponents, written to a params file.

Two judges of a parameter set:
- `--scenario NAME|FILE`: the swarm simulator (nesa_node.routing.simulate), which scores the chains a parameter set
  picks by their true latency while the router sees only noisy measurements. A scenario file is JSON naming a
  built-in scenario and the fields it changes, e.g. {"base": "global-1000", "num_nodes": 400, "churn_per_hour": 0.2}.
- `--from-swarm`: a live swarm's current snapshot (records, links, the client's own round trips), scored by the
  latency its measurements imply (nesa_node.routing.measured).
The result goes to `--out` as JSON; clients load it with `--routing-params FILE` (SDK: `routing_params=`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import fields, replace
from pathlib import Path

from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.scenarios import Scenario, scenario


def load_scenario(text: str) -> Scenario:
    """A built-in scenario by name, or a JSON file {"base": NAME, field: value, ...} overriding top-level numbers.

    Raises ValueError naming the problem (unknown scenario or field, a value of the wrong type)."""
    path = Path(text)
    if not path.is_file():
        try:
            return scenario(text)
        except KeyError as error:
            raise ValueError(f"{error.args[0]} (or give a scenario JSON file)") from None
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(values, dict) or not isinstance(values.get("base"), str):
        raise ValueError(f'{path}: expected an object with "base" naming a built-in scenario')
    try:
        base = scenario(values.pop("base"))
    except KeyError as error:
        raise ValueError(f"{path}: {error.args[0]}") from None
    numbers = {item.name: type(getattr(base, item.name)) for item in fields(base)}
    numbers = {name: kind for name, kind in numbers.items() if kind in (int, float)}
    changes = {}
    for name, value in values.items():
        if name not in numbers:
            raise ValueError(f"{path}: unknown or non-numeric scenario field {name!r}; numeric: {', '.join(numbers)}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name} must be a number")
        if numbers[name] is int and not isinstance(value, int):
            raise ValueError(f"{path}: {name} must be an integer")
        if value < 0:
            raise ValueError(f"{path}: {name} must be >= 0")
        changes[name] = numbers[name](value)
    return replace(base, name=f"{base.name}+{path.stem}", **changes)


def run_tune(args) -> int:
    import numpy as np
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nesa_node.routing.ga import evolve, paired_comparison, request_latencies, save_params
    from nesa_node.routing.measured import snapshot_fitness, synthetic_requests
    from nesa_node.routing.simulate import Simulator

    template = RoutingParams(window=args.window)
    if args.from_swarm:
        if not args.initial_peers or not args.model:
            raise ValueError("--from-swarm needs --initial-peers and --model")
        snapshot = _live_snapshot(args)
        source = f"live swarm ({len(snapshot.nodes)} nodes)"
        requests = synthetic_requests(args.requests, np.random.default_rng(args.seed))
        latency = snapshot_fitness(snapshot, requests)
        heldout = snapshot_fitness(snapshot, synthetic_requests(args.requests, np.random.default_rng(args.seed + 1)))
        validate = None
    else:
        chosen = load_scenario(args.scenario)
        source = f"scenario {chosen.name}"
        simulator = Simulator(chosen)
        training = simulator.requests(args.requests, args.seed)
        other = simulator.requests(args.requests, args.seed + 1)

        def latency(population):
            return request_latencies(simulator, training, population).mean(axis=1)

        def heldout(population):
            return request_latencies(simulator, other, population).mean(axis=1)

        def validate(pair):  # the simulator gives per-request latencies: keep the untuned set unless tuned wins
            untuned_each, tuned_each = request_latencies(simulator, other, pair)
            return paired_comparison(untuned_each, tuned_each)

    started = time.perf_counter()
    columns = (TextColumn("tuning {task.description}"), BarColumn(), TextColumn("{task.fields[best]}"))
    with Progress(*columns, TimeElapsedColumn()) as progress:
        task = progress.add_task(source, total=args.generations + 1, best="")

        def report(entry: dict) -> None:
            best = entry["best"]
            progress.update(
                task,
                advance=1,
                best=f"best {entry['best_latency_s']:.3f} s  gamma {best['gamma']:.2f} beta {best['beta']:.2f} "
                f"alpha {best['alpha']:.2f}",
            )

        params, history = evolve(
            latency,
            generations=args.generations,
            population=args.population,
            seed=args.seed,
            progress=report,
            template=template,
            initial=(template,),  # the untuned exponents: the result is never worse on the training requests
        )
    untuned = template  # all exponents 1: what clients use without a params file
    verdict = validate([untuned, params]) if validate is not None and params != untuned else None
    if verdict is not None and not verdict["accepted"]:
        print(
            f"tuned ({params.gamma:.3f}, {params.beta:.3f}, {params.alpha:.3f}) is not better than untuned on "
            f"{verdict['requests']} held-out requests by 2 standard errors ({verdict['tuned_s']:.3f} vs "
            f"{verdict['untuned_s']:.3f} s, standard error {verdict['paired_standard_error_s']:.3f} s): writing "
            "the untuned exponents"
        )
        params = untuned
    save_params(params, args.out)
    first, last = history[0]["best_latency_s"], history[-1]["best_latency_s"]
    print(
        f"wrote {args.out}: gamma {params.gamma:.3f}, beta {params.beta:.3f}, alpha {params.alpha:.3f}, window "
        f"{params.window}; best mean latency {first:.3f} s in generation 0, {last:.3f} s after {args.generations} "
        f"({time.perf_counter() - started:.1f} s, {source})"
    )
    before_train, after_train = latency([untuned, params])
    before_held, after_held = heldout([untuned, params])
    print(
        f"mean latency, untuned -> tuned: {before_train:.3f} -> {after_train:.3f} s on the training requests, "
        f"{before_held:.3f} -> {after_held:.3f} s on as many held-out requests; {_verdict(before_held, after_held)}"
    )
    return 0


def _verdict(before: float, after: float) -> str:
    """Whether tuning helped, judged on held-out requests (1% is within the noise of a few requests)."""
    if not math.isfinite(before) or not math.isfinite(after):
        return "some requests found no chain"
    change = (after - before) / before if before > 0 else 0.0
    if change < -0.01:
        return f"tuning helped ({-change:.1%} lower)"
    if change > 0.01:
        return f"tuning did not help ({change:.1%} higher: keep the untuned exponents)"
    return "no difference beyond 1%: tuning did not change the outcome"


def _live_snapshot(args):
    from nesa_node import event_loop
    from nesa_node.client.swarm import Swarm
    from nesa_node.protocol.dht import default_dht_prefix
    from nesa_node.protocol.records import NodeState
    from nesa_node.sharding.blocks import load_config

    config = load_config(args.model)

    async def read_swarm():
        prefix = args.dht_prefix or default_dht_prefix(args.model)
        async with await Swarm.create(args.initial_peers, dht_prefix=prefix) as swarm:
            records = await swarm.node_records(fresh=True)
            await swarm.measure_rtts([r.info.peer_id for r in records if r.info.state == NodeState.online])
            return await swarm.snapshot(config.num_hidden_layers, hidden_size=config.hidden_size)

    snapshot = event_loop.run(read_swarm())
    if not snapshot.nodes:
        raise ValueError("the swarm announced no nodes for this model: nothing to tune on")
    return snapshot


def add_parser(commands) -> None:
    from nesa_node.routing.ga import TRAINING_REQUESTS
    from nesa_node.routing.scenarios import SCENARIOS

    tune = commands.add_parser(
        "tune",
        help="tune eq. 18's exponents with the GA; writes a params file for --routing-params",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = tune.add_mutually_exclusive_group()
    source.add_argument(
        "--scenario",
        default="global-1000",
        help=f"built-in scenario ({', '.join(SCENARIOS)}) or a scenario JSON file (default global-1000)",
    )
    source.add_argument("--from-swarm", action="store_true", help="tune on the live swarm's snapshot")
    tune.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR", help="with --from-swarm")
    tune.add_argument("--model", default=None, help="model folder, with --from-swarm")
    tune.add_argument("--dht-prefix", default=None, help="model key on the DHT, with --from-swarm")
    tune.add_argument("--out", required=True, help="where to write the params JSON")
    tune.add_argument("--generations", type=int, default=30, help="generations after the first (default 30)")
    tune.add_argument("--population", type=int, default=40, help="individuals per generation (default 40)")
    tune.add_argument(
        "--requests",
        type=int,
        default=TRAINING_REQUESTS,
        help=f"training requests per fitness evaluation (default {TRAINING_REQUESTS})",
    )
    tune.add_argument("--window", type=int, default=0, help="eq. 2's look-back; 0: exact search (default)")
    tune.add_argument("--seed", type=int, default=0)


def check_args(args) -> None:
    """Raises ValueError for settings the GA cannot run with."""
    if args.generations < 0 or args.population < 2 or args.requests < 1 or args.window < 0:
        raise ValueError("need --generations >= 0, --population >= 2, --requests >= 1 and --window >= 0")


__all__ = ["add_parser", "check_args", "load_scenario", "run_tune"]

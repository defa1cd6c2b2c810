"""The genetic algorithm of sec. 3.2 (eq. 19-20) that tunes eq. 18's exponents (gamma, beta, alpha).

1. Initialisation: `population` tuples drawn uniformly in `BOUNDS`.
2. Fitness: 1 / (mean true latency, s) of the training requests when routed by `select_chain` with the tuple, in
   the simulated swarm (simulate.py). Deviation: eq. 19 takes the routing cost itself as the objective, which the
   exponents can shrink at will (all terms fall as an exponent moves toward 0 on a base below 1 or rises on one
   above); the latency the chains actually give is what the tuning is for.
3. Selection: roulette wheel, probability proportional to fitness after windowing (fitness minus the population's
   worst, plus a tenth of the spread so the worst keeps a chance). Raw 1 / latency differs by only tens of percent
   across a population, which makes plain proportional selection almost uniform (Goldberg 1989, fitness scaling).
4. Crossover, eq. 20: child = eta * parent1 + (1 - eta) * parent2, one eta ~ U(0, 1) per child.
5. Mutation: each gene, with probability `mutation_rate`, moves by a normal step of `mutation_scale` times its
   range, clipped to the range.
6. Elitism: the `elite` best individuals pass unchanged (their fitness is not recomputed).

Everything is drawn from one numpy Generator seeded with `seed`, and fitness is deterministic, so a run is
reproducible. The training requests are the simulator's requests for `seed`; evaluate on other seeds (held out).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from nesa_node.errors import NoRouteError
from nesa_node.routing.chain import select_chains
from nesa_node.routing.cost import RoutingParams
from nesa_node.routing.scenarios import Scenario
from nesa_node.routing.scenarios import scenario as scenario_named
from nesa_node.routing.simulate import SimRequest, Simulator

GENES = ("gamma", "beta", "alpha")
# Ranges of the genes (guess: wide around the untuned (1, 1, 1); gamma and beta must stay > 0)
BOUNDS = {"gamma": (0.25, 3.0), "beta": (0.25, 3.0), "alpha": (0.0, 3.0)}
TRAINING_REQUESTS = 16  # per fitness evaluation: 30 x 40 individuals on 1,000 nodes in ~40 s on 2 cores (measured)


def population_latency(
    simulator: Simulator, requests: Sequence[SimRequest], population: Sequence[RoutingParams]
) -> np.ndarray:
    """Mean true latency (s) of `requests` for each parameter set (inf if some request found no chain)."""
    total = np.zeros(len(population))
    for request in requests:
        snapshot = simulator.snapshot(request.time_s)
        chains = select_chains(snapshot, simulator.chain_request(request), population)
        for index, chain in enumerate(chains):
            total[index] += math.inf if isinstance(chain, NoRouteError) else simulator.latency_s(chain, request)
    return total / max(len(requests), 1)


def _genes(params: RoutingParams) -> np.ndarray:
    return np.array([getattr(params, gene) for gene in GENES])


def _params(genes: np.ndarray, template: RoutingParams) -> RoutingParams:
    return replace(template, **{gene: float(value) for gene, value in zip(GENES, genes, strict=True)})


def _roulette(rng: np.random.Generator, fitness: np.ndarray, count: int) -> np.ndarray:
    spread = fitness.max() - fitness.min()
    weights = fitness - fitness.min() + (0.1 * spread if spread > 0 else 1.0)
    return rng.choice(fitness.size, size=count, p=weights / weights.sum())


def tune(
    scenario: Scenario | Simulator | str,
    *,
    generations: int = 30,
    population: int = 40,
    seed: int = 0,
    progress: Callable[[dict], None] | None = None,
    requests: int = TRAINING_REQUESTS,
    window: int = 0,
    **settings,
) -> tuple[RoutingParams, list[dict]]:
    """Tune (gamma, beta, alpha) for `scenario` (a Scenario, its name, or a built Simulator) on `requests`
    training requests drawn with `seed`.

    Returns the best parameters found and the history (see `evolve`). `window` is fixed (eq. 2's alpha; 0: exact
    search). `settings` go to `evolve` (elite, mutation_rate, mutation_scale, bounds).
    """
    simulator = scenario if isinstance(scenario, Simulator) else Simulator(_scenario(scenario))
    training = simulator.requests(requests, seed)
    return evolve(
        lambda candidates: population_latency(simulator, training, candidates),
        generations=generations,
        population=population,
        seed=seed,
        progress=progress,
        template=RoutingParams(window=window),
        **settings,
    )


def evolve(
    latency: Callable[[list[RoutingParams]], np.ndarray],
    *,
    generations: int,
    population: int,
    seed: int,
    progress: Callable[[dict], None] | None = None,
    template: RoutingParams = RoutingParams(),
    elite: int = 2,  # keep the best two (common GA practice; guess)
    mutation_rate: float = 0.25,  # per gene (guess; De Jong's 1 / genes would be 0.33)
    mutation_scale: float = 0.1,  # step, as a share of the gene's range (guess)
    bounds: dict[str, tuple[float, float]] | None = None,
) -> tuple[RoutingParams, list[dict]]:
    """The GA of sec. 3.2 over (gamma, beta, alpha) for any `latency` (parameter sets -> mean latency, s; lower
    is better; inf for a set that failed). Other fields come from `template`.

    Returns the best parameters and the history: per generation (0 is the initial population), a dict with the
    best parameters, its latency and fitness, and the population's mean latency. `progress`, if given, gets each
    history entry as it is made. Raises ValueError for a population smaller than 2 or elite >= population.
    """
    if population < 2 or not 0 <= elite < population:
        raise ValueError(f"need population >= 2 and 0 <= elite < population, got {population}, {elite}")
    bounds = bounds or BOUNDS
    low = np.array([bounds[gene][0] for gene in GENES])
    high = np.array([bounds[gene][1] for gene in GENES])
    rng = np.random.default_rng(seed)
    genes = rng.uniform(low, high, (population, len(GENES)))
    latencies = np.asarray(latency([_params(row, template) for row in genes]), dtype=float)
    history: list[dict] = []
    for generation in range(generations + 1):
        fitness = np.where(np.isfinite(latencies), 1.0 / latencies, 0.0)
        order = np.argsort(-fitness, kind="stable")
        best = order[0]
        finite = latencies[np.isfinite(latencies)]
        entry = {
            "generation": generation,
            "best": _params(genes[best], template).to_dict(),
            "best_latency_s": float(latencies[best]),
            "best_fitness": float(fitness[best]),
            "population_latency_s": float(finite.mean()) if finite.size else math.inf,
        }
        history.append(entry)
        if progress is not None:
            progress(entry)
        if generation == generations:
            break
        children = np.empty((population - elite, len(GENES)))
        parents = _roulette(rng, fitness, 2 * children.shape[0]).reshape(-1, 2)
        eta = rng.uniform(0.0, 1.0, (children.shape[0], 1))
        children[:] = eta * genes[parents[:, 0]] + (1 - eta) * genes[parents[:, 1]]  # eq. 20
        mutate = rng.random(children.shape) < mutation_rate
        children += mutate * rng.normal(0.0, mutation_scale, children.shape) * (high - low)
        children = np.clip(children, low, high)
        child_latencies = np.asarray(latency([_params(row, template) for row in children]), dtype=float)
        genes = np.concatenate([genes[order[:elite]], children])
        latencies = np.concatenate([latencies[order[:elite]], child_latencies])
    return _params(genes[best], template), history


def _scenario(scenario: Scenario | str) -> Scenario:
    return scenario_named(scenario) if isinstance(scenario, str) else scenario


def params_to_json(params: RoutingParams) -> str:
    return json.dumps(params.to_dict(), sort_keys=True)


def params_from_json(text: str) -> RoutingParams:
    """Raises ValueError for malformed JSON, unknown keys or values out of range."""
    values = json.loads(text)
    if not isinstance(values, dict):
        raise ValueError("routing parameters must be a JSON object")
    return RoutingParams.from_dict(values)


def save_params(params: RoutingParams, path: str | Path) -> None:
    """Write the parameters as JSON (the only file I/O in routing; the CLI calls it)."""
    Path(path).write_text(params_to_json(params) + "\n")


def load_params(path: str | Path) -> RoutingParams:
    """Raises OSError if unreadable, ValueError if malformed."""
    return params_from_json(Path(path).read_text())

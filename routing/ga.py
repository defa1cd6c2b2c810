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
7. The untuned exponents (1, 1, 1) are one of the initial individuals (`tune`), so with elitism the result is never
   worse than untuned on the training requests.
8. Validation (`tune`): the best individual replaces the untuned exponents only if it is better on `validation`
   requests of another seed by more than twice the standard error of the paired per-request difference; else
   `tune` returns the untuned ones. Every candidate of a run is scored on the same training requests (common
   random numbers), so the GA ranks candidates by paired differences, but 16 requests overfit: on global-1000 the
   best of three runs was 0.2-2.4% faster than untuned on its training requests, and from 0.03% slower to 0.2%
   faster on 300 held-out ones.

Why tuning gains little here (README "Routing", measured with bench/routing.py and routing/bound.py): with every
exponent 1, eq. 18 as implemented is already the per-pass latency in ms, a calibrated estimate, and any other
exponent distorts it (one exponent moved to 0.75 or 1.25 changes 25-50% of the chains and makes the mean 0-4% worse
on 300 held-out global-1000 requests). The untuned router is 3.4-3.6% above the perfect-information bound (bound.py,
a router that knows every true position, bandwidth, load and prefill time) on the global scenarios, so no setting
of the cost can gain 5% there; churn at 0.1 / hour costs a failover to 2 requests in 300.

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
VALIDATION_REQUESTS = 64  # for the validation gate: 2 parameter sets, ~3 s on 1,000 nodes (measured)
VALIDATION_SEED = 2**31  # added to the GA seed: validation requests never share a seed with training or the bench
ACCEPT_STANDARD_ERRORS = 2.0  # the tuned set must beat untuned by this many paired standard errors (~97.5%, one-sided)


def request_latencies(
    simulator: Simulator, requests: Sequence[SimRequest], population: Sequence[RoutingParams]
) -> np.ndarray:
    """(parameter sets, requests) true latency (s) of each request on the chain each set picks (inf: no chain)."""
    latencies = np.zeros((len(population), len(requests)))
    for column, request in enumerate(requests):
        snapshot = simulator.snapshot(request.time_s)
        chains = select_chains(snapshot, simulator.chain_request(request), population)
        for index, chain in enumerate(chains):
            latencies[index, column] = (
                math.inf if isinstance(chain, NoRouteError) else simulator.latency_s(chain, request)
            )
    return latencies


def population_latency(
    simulator: Simulator, requests: Sequence[SimRequest], population: Sequence[RoutingParams]
) -> np.ndarray:
    """Mean true latency (s) of `requests` for each parameter set (inf if some request found no chain)."""
    if not requests:
        return np.zeros(len(population))
    return request_latencies(simulator, requests, population).mean(axis=1)


def paired_comparison(
    untuned: np.ndarray, tuned: np.ndarray, *, standard_errors: float = ACCEPT_STANDARD_ERRORS
) -> dict:
    """Compare two sets' per-request latencies (s) on the same requests: means, the paired difference's standard
    error, and `accepted`: whether tuned is lower by more than `standard_errors` of them (False if any is inf)."""
    untuned, tuned = np.asarray(untuned, dtype=float), np.asarray(tuned, dtype=float)
    difference = tuned - untuned
    finite = bool(np.isfinite(difference).all()) and difference.size > 1
    error = float(difference.std(ddof=1) / math.sqrt(difference.size)) if finite else math.inf
    change = float(difference.mean()) if finite else math.inf
    return {
        "requests": int(difference.size),
        "untuned_s": float(untuned.mean()),
        "tuned_s": float(tuned.mean()),
        "paired_standard_error_s": error,
        "accepted": finite and change < -standard_errors * error,
    }


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
    validation: int = VALIDATION_REQUESTS,
    **settings,
) -> tuple[RoutingParams, list[dict]]:
    """Tune (gamma, beta, alpha) for `scenario` (a Scenario, its name, or a built Simulator) on `requests`
    training requests drawn with `seed`, starting from a population that holds the untuned exponents.

    Returns the parameters and the history (see `evolve`). With `validation` > 0 the GA's best is returned only if
    it beats the untuned exponents on that many requests of seed `seed + VALIDATION_SEED` (module docstring, 8);
    else the untuned exponents are; the last history entry then carries "validation" (`paired_comparison`'s
    dict). `window` is fixed (eq. 2's alpha; 0: exact search). `settings` go to `evolve` (elite, mutation_rate,
    mutation_scale, bounds).
    """
    simulator = scenario if isinstance(scenario, Simulator) else Simulator(_scenario(scenario))
    training = simulator.requests(requests, seed)
    untuned = RoutingParams(window=window)
    best, history = evolve(
        lambda candidates: population_latency(simulator, training, candidates),
        generations=generations,
        population=population,
        seed=seed,
        progress=progress,
        template=untuned,
        initial=(untuned,),
        **settings,
    )
    if validation <= 0 or best == untuned:
        return best, history
    held_out = request_latencies(simulator, simulator.requests(validation, seed + VALIDATION_SEED), [untuned, best])
    verdict = paired_comparison(held_out[0], held_out[1])
    history[-1]["validation"] = verdict
    return (best if verdict["accepted"] else untuned), history


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
    initial: Sequence[RoutingParams] = (),
) -> tuple[RoutingParams, list[dict]]:
    """The GA of sec. 3.2 over (gamma, beta, alpha) for any `latency` (parameter sets -> mean latency, s; lower
    is better; inf for a set that failed). Other fields come from `template`. `initial` (at most `population`
    sets, inside the bounds) replace the first random individuals of generation 0; with elite >= 1 the result is
    never worse than any of them by `latency`.

    Returns the best parameters and the history: per generation (0 is the initial population), a dict with the
    best parameters, its latency and fitness, and the population's mean latency. `progress`, if given, gets each
    history entry as it is made. Raises ValueError for a population smaller than 2 or elite >= population.
    """
    if population < 2 or not 0 <= elite < population or len(initial) > population:
        raise ValueError(
            f"need population >= 2, 0 <= elite < population and at most population initial sets, got {population}, "
            f"{elite}, {len(initial)}"
        )
    bounds = bounds or BOUNDS
    low = np.array([bounds[gene][0] for gene in GENES])
    high = np.array([bounds[gene][1] for gene in GENES])
    rng = np.random.default_rng(seed)
    genes = rng.uniform(low, high, (population, len(GENES)))
    for row, params in enumerate(initial):
        genes[row] = np.clip(_genes(params), low, high)
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

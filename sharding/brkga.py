"""Biased random-key genetic algorithm over topological orders (Nesa sec. 2.6.1).

A chromosome is a priority vector x in [0, 1]^n, one key per operation. It decodes to the topological order in
which Kahn's algorithm always releases the ready operation of smallest key; `slice_order` cuts that order into at
most k segments optimally, and the bottleneck of eq. 11 is the fitness (lower is better). Each generation keeps
the elite fraction, adds fresh random mutants, and fills the rest with biased crossover of one elite and one
non-elite parent: each key comes from the elite parent with probability rho_e. The paper writes the crossover as a
blend alpha * parent_1 + (1 - alpha) * parent_2; drawing alpha in {0, 1} per key with P(alpha = 1) = rho_e is that
blend, and keeps the keys of good orders intact (a real-valued blend would average away their relative order).

The first chromosome encodes Kahn's default order, so with elitism the result is never worse than
`slice_order` on that order. Pure: the only randomness is the caller's numpy Generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nesa_node.sharding.partition import NodeProfile, OperationGraph, Partition, kahn_order, slice_order


@dataclass(frozen=True)
class BrkgaSettings:
    """Population sizes and stopping rule. Defaults follow Gonçalves and Resende's usual ranges (elite 10-25 %,
    mutants 10-30 %, rho_e 0.6-0.8), sized down for graphs of thousands of operations."""

    population: int = 24  # chromosomes per generation
    elite_fraction: float = 0.25  # share kept unchanged each generation
    mutant_fraction: float = 0.15  # share replaced by fresh random keys
    elite_inheritance: float = 0.7  # rho_e: probability a child's key comes from its elite parent
    generations: int = 40  # hard cap
    patience: int = 12  # stop after this many generations without a better bottleneck (convergence)
    max_evaluations: int | None = None  # budget of decoded chromosomes, counting cache hits as free

    def __post_init__(self) -> None:
        if self.population < 2 or self.generations < 0 or self.patience < 1:
            raise ValueError("population must be >= 2, generations >= 0 and patience >= 1")
        if not (0 < self.elite_fraction < 1 and 0 <= self.mutant_fraction < 1):
            raise ValueError("elite_fraction must be in (0, 1) and mutant_fraction in [0, 1)")
        if self.elite_fraction + self.mutant_fraction > 1 or not 0 <= self.elite_inheritance <= 1:
            raise ValueError("elite + mutant fractions must be <= 1 and elite_inheritance in [0, 1]")
        if self.max_evaluations is not None and self.max_evaluations < 1:
            raise ValueError("max_evaluations must be >= 1")


@dataclass(frozen=True)
class BrkgaResult:
    partition: Partition  # the best partition found
    default_bottleneck: float  # seconds: `slice_order` on Kahn's default order (the first chromosome)
    evaluations: int  # distinct orders sliced
    generations: int  # generations run
    history: tuple[float, ...]  # best bottleneck after each generation, seconds


def default_keys(graph: OperationGraph) -> np.ndarray:
    """(n,) keys that decode to Kahn's first-in first-out order: each operation's rank in it, scaled to [0, 1)."""
    keys = np.empty(graph.size)
    keys[list(kahn_order(graph))] = np.arange(graph.size) / max(graph.size, 1)
    return keys


def brkga_partition(
    graph: OperationGraph,
    nodes: Sequence[NodeProfile],
    *,
    rng: np.random.Generator,
    settings: BrkgaSettings = BrkgaSettings(),
) -> BrkgaResult:
    """Search topological orders for the partition of smallest bottleneck (eq. 11) over at most len(nodes)
    segments. Deterministic for a given `rng` state."""
    n = graph.size
    population = settings.population
    elite_count = max(1, round(settings.elite_fraction * population))
    mutant_count = min(population - elite_count, round(settings.mutant_fraction * population))
    cache: dict[tuple[int, ...], Partition] = {}

    def evaluate(keys: np.ndarray) -> Partition:
        order = kahn_order(graph, keys)
        if order not in cache:
            known = min((found.bottleneck for found in cache.values()), default=None)
            cache[order] = slice_order(graph, order, nodes, upper_bound=known)
        return cache[order]

    def budget_left() -> bool:
        return settings.max_evaluations is None or len(cache) < settings.max_evaluations

    keys = rng.random((population, n))  # (population, n)
    keys[0] = default_keys(graph)
    fitness = np.empty(population)
    for index in range(population):
        if index > 0 and not budget_left():
            fitness[index:] = np.inf
            break
        fitness[index] = evaluate(keys[index]).bottleneck
    default_bottleneck = float(fitness[0])
    history = [float(fitness.min())]
    stale, generation = 0, 0
    while generation < settings.generations and stale < settings.patience and budget_left():
        generation += 1
        ranking = np.argsort(fitness, kind="stable")
        elite, others = ranking[:elite_count], ranking[elite_count:]
        children = population - elite_count - mutant_count
        elite_parents = keys[rng.choice(elite, size=children)]  # (children, n)
        other_parents = keys[rng.choice(others if len(others) else elite, size=children)]
        from_elite = rng.random((children, n)) < settings.elite_inheritance
        next_keys = np.concatenate(
            [keys[elite], rng.random((mutant_count, n)), np.where(from_elite, elite_parents, other_parents)]
        )  # (population, n)
        next_fitness = np.empty(population)
        next_fitness[:elite_count] = fitness[elite]
        for index in range(elite_count, population):
            next_fitness[index] = evaluate(next_keys[index]).bottleneck if budget_left() else np.inf
        improved = next_fitness.min() < history[-1]
        stale = 0 if improved else stale + 1
        keys, fitness = next_keys, next_fitness
        history.append(float(fitness.min()))
    best_order = kahn_order(graph, keys[int(np.argmin(fitness))])
    return BrkgaResult(
        partition=cache[best_order],
        default_bottleneck=default_bottleneck,
        evaluations=len(cache),
        generations=generation,
        history=tuple(history),
    )

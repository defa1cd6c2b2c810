"""Last-mile latencies fitted from measured round trips: what a live swarm's snapshot uses for `NodeView.access_ms`.

A live swarm announces no regions, so every node sits in the snapshot's "unknown region" and the one-way latency
between two nodes is modelled as `access_ms[a] + access_ms[b]` (snapshot.py): a star metric, each node's own delay
to a common backbone. The measurements are round trips: the client's pings to candidate nodes and the links each
node publishes in its record. The fit:

    minimise  sum over measured pairs (a, b) of (access_a + access_b - rtt_ab / 2) ** 2  +  ridge * sum access ** 2
    subject to access >= 0

- A pair measured more than once (both ends probing each other, or repeated pings) keeps its largest round trip.
  Delays are not always symmetric (a node slow to answer is slow only when someone calls it); the larger value is
  what a hop into that node costs.
- The ridge term (tiny next to any squared latency) makes the answer unique when the measurements cannot separate
  two ends, e.g. a client that measured only its own links; without it the split between the client's last mile
  and each node's would be arbitrary.
- Nodes that appear in no measurement get no estimate: the snapshot then falls back to its defaults.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np

DEFAULT_RIDGE = 1e-6  # 1e-6 per ms^2: far below one measured pair's residual, enough to make the fit unique


def combine_measurements(measurements: Iterable[tuple[str, str, float]]) -> dict[tuple[str, str], float]:
    """(a, b, rtt ms) triples -> {(a, b) with a < b: largest rtt}. Self-pairs, negative or non-finite rtts are
    dropped."""
    pairs: dict[tuple[str, str], float] = {}
    for first, second, rtt_ms in measurements:
        if first == second or not np.isfinite(rtt_ms) or rtt_ms < 0:
            continue
        key = (first, second) if first < second else (second, first)
        pairs[key] = max(pairs.get(key, 0.0), float(rtt_ms))
    return pairs


def fit_access_ms(measurements: Iterable[tuple[str, str, float]], *, ridge: float = DEFAULT_RIDGE) -> dict[str, float]:
    """One-way last-mile latency of every endpoint that appears in `measurements`, ms (see the module docstring).

    `measurements`: (endpoint, endpoint, round trip ms) triples; endpoints are any hashable names (peer ids, and
    one name for the client). Deterministic, and independent of the order of the triples. The last few fits are
    remembered by their combined measurements: a client builds a snapshot per session it opens, mostly from the same
    records and pings, and the solver takes milliseconds.
    """
    pairs = combine_measurements(measurements)
    if not pairs:
        return {}
    return dict(_fit(tuple(sorted(pairs.items())), ridge))


@functools.lru_cache(maxsize=8)
def _fit(pairs_items: tuple[tuple[tuple[str, str], float], ...], ridge: float) -> tuple[tuple[str, float], ...]:
    from scipy.optimize import lsq_linear
    from scipy.sparse import csr_matrix, identity, vstack

    pairs = dict(pairs_items)
    names = sorted({name for pair in pairs for name in pair})
    index = {name: position for position, name in enumerate(names)}
    rows = len(pairs)
    columns = np.array([[index[first], index[second]] for first, second in sorted(pairs)]).ravel()
    design = csr_matrix((np.ones(2 * rows), (np.repeat(np.arange(rows), 2), columns)), shape=(rows, len(names)))
    target = np.array([pairs[key] / 2 for key in sorted(pairs)])
    design = vstack([design, np.sqrt(ridge) * identity(len(names), format="csr")])
    target = np.concatenate([target, np.zeros(len(names))])
    scale = max(float(target.max()), 1.0)  # solve in units of the largest latency: the solver's tolerances are relative
    solution = lsq_linear(design, target / scale, bounds=(0.0, np.inf), method="trf", tol=1e-12, lsmr_tol="auto")
    return tuple((name, float(max(value, 0.0) * scale)) for name, value in zip(names, solution.x, strict=True))


__all__ = ["DEFAULT_RIDGE", "combine_measurements", "fit_access_ms"]
